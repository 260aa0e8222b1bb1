"""Several LMS processes on one GPU under one host budget that cannot hold them all: every
one finishes (``benchmarks/processes.py`` runs them; its records are this row's).

Four processes each train the benchmark's GPT at a batch that needs 0.8x its view of the
device, each capped at 40% of the device (``set_per_process_memory_fraction``): 32% of the
device each, 1.28x the device together, so they contend for the device (each one's share of
it is a quarter of what the device leaves for LMS, below its need) while the cap keeps the
run short. LMS runs with its default settings but for one host budget for all of them
(``lms_host_limit_mb``, the same in every process), 60% of what they must page out together
when all four run at once: the page-outs of the four cannot all be in pinned memory at once,
so some processes wait for the others' (host and device waits, 60 s by default).

The starts are 1.5 s apart and each process trains 16 steps, so that the four train at the
same time (with 4 steps 3 s apart, each one's training was over before the next began, and
none paged: engine ac633fc, H200). Four equal processes started in the same
instant reach the budget in the same instant, every one of them waiting for room in the
middle of its forward pass, and the rule that keeps that from a deadlock makes the last one to
join give up with the host error (docs/using-lms.md, "The host-memory budget"); the disk tier
(``test_share_disk_tier``) is what carries that case.
Time on an H200 (estimate): about 1.5 minutes (a calibration of 20 s, then the four
processes: about 10 s to start each, and 16 steps with the device shared four ways).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import processes as bench
from tests.regression import lms_matrix_plan as plan
from tests.regression.lms_regression_harness import ensure_lms_api

Record = Callable[[str, Any], None]

PROCESSES = 4
CAP_SHARE = 0.4
FRACTION = 0.8  # of each process's view of the device (its cap)
BUDGET_SHARE = 0.6  # of the page-outs of all four at once
STAGGER_S = 1.5
STEPS = 16
TIMEOUT_S = 200.0
GB = 10**9


def host_budget_bytes(total_bytes: int) -> int:
    """60% of what the four processes must page out when they all run: their needs less
    the device, its 5% headroom and a CUDA context each."""
    need = PROCESSES * FRACTION * CAP_SHARE * total_bytes
    room = (1 - plan.LMS_HEADROOM_SHARE) * total_bytes - PROCESSES * plan.CONTEXT_BYTES
    return int(BUDGET_SHARE * max(0.0, need - room))


def test_four_processes_over_the_device_and_the_host_budget_all_finish(
    record: Record, tmp_path: Path
) -> None:
    ensure_lms_api()
    if not hasattr(torch.cuda, "set_host_limit_lms"):
        pytest.skip("this LMS build has no host-memory budget (torch.cuda.set_host_limit_lms)")
    total = torch.cuda.get_device_properties(0).total_memory
    budget = host_budget_bytes(total)
    need = plan.HostNeed(budget, PROCESSES * plan.PROCESS_HOST_BYTES)
    host = plan.usable_host_memory()
    if host < need.total_bytes:
        pytest.skip(f"needs {need.describe()}; this host has {host / 2**30:.0f} GiB")
    args = bench.build_parser().parse_args(
        [
            "--processes",
            str(PROCESSES),
            "--fraction",
            str(FRACTION),
            "--cap-share",
            str(CAP_SHARE),
            "--host-limit-gb",
            str(budget / GB),
            "--stagger-s",
            str(STAGGER_S),
            "--steps",
            str(STEPS),
            "--no-serial",
            "--timeout-s",
            str(TIMEOUT_S),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    _, rows = bench.run_benchmark(args)
    together = [r for r in rows if r["scenario"] == "together"]
    summary = next(r for r in rows if r["scenario"] == "summary")
    record("family", "gpt")
    record(
        "cap",
        f"{CAP_SHARE:.0%} of the device each ({PROCESSES} processes x {FRACTION:.0%} of it), "
        f"host budget {budget / GB:.1f} GB",
    )
    for key in ("status", "wall_s", "wait_s", "host_wait_s", "device_wait_s", "pageout_bytes"):
        record(key, [r[key] for r in together])
    record("together_s", summary["together_s"])
    record("need_bytes", together[0]["need_bytes"])

    assert len(together) == PROCESSES
    killed = [r for r in together if r["status"] == "killed"]
    assert not killed, f"killed by a signal (the kernel's OOM killer?): {killed}"
    unfinished = [r for r in together if r["status"] != "finished"]
    assert not unfinished, "\n".join(
        f"process {r['process']}: {r['status']} after {r['wall_s']} s, waited {r['wait_s']} s:"
        f" {r['error']}"
        for r in unfinished
    )
    # The row is about contention: each process needed more than its share of the device
    # (it paged out), and the budget made some of them wait for the others.
    for r in together:
        assert r["need_bytes"] > r["view_bytes"] * FRACTION * 0.9, r
        assert r["pageout_bytes"], f"process {r['process']} paged nothing out"
        assert r["steps"] == args.steps
    assert sum(r["wait_s"] for r in together) > 0, (
        f"no process waited under a host budget of {budget / GB:.1f} GB: it held them all"
    )
