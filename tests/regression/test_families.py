"""The LMS regression matrix: model families trained under caps, no cap, DDP, shared GPUs.

Each model family (``lms_families.py``) is trained with default LMS settings under caps of
1/2 and 1/4 of its own uncapped peak reserved memory (``-k capped``), and compared with the
uncapped run without LMS: bit for bit where two uncapped runs are bit-identical to each
other (recorded as ``reference_repeatable``), otherwise within ten times the spread of
those two runs.
Further rows: no cap at all with a need of 1.1x and 1.5x the device memory (``-k nocap``),
DistributedDataParallel on two GPUs (``-k ddp``) and several processes sharing one GPU
(``-k share``).

It runs when ``LMS_MATRIX=1`` is set (``scripts/gpu/run-matrix.sh`` does), so that the
quick regression run of ``tests/regression`` stays quick.

Every run trains in a process of its own (``lms_matrix_worker.py``), so a device fault in
one run cannot take the rest of the matrix with it; the results it writes are recorded with
the test (``LMS_RESULTS_DIR``: ``regression-results.json``). ``lms_matrix_summary.py``
turns them into a markdown table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch
from lms_families import FAMILIES
from lms_matrix_worker import LARGE_ALLOCATION_BYTES
from lms_regression_harness import MiB, host_memory_bytes

HERE = Path(__file__).resolve().parent
WORKER = HERE / "lms_matrix_worker.py"

# The matrix takes several minutes per part: it runs when asked for (scripts/gpu/run-matrix.sh
# sets LMS_MATRIX=1), not as part of every run of tests/regression (run-regression.sh).
pytestmark = pytest.mark.skipif(
    os.environ.get("LMS_MATRIX", "") != "1",
    reason="the regression matrix runs with LMS_MATRIX=1 (scripts/gpu/run-matrix.sh)",
)

CAPS = {"half": 0.5, "quarter": 0.25}
CAP_LABELS = {0.5: "1/2", 0.25: "1/4"}

Record = Callable[[str, Any], None]

# Wall-clock limits of the worker processes (a hang fails the test, not the session).
FAMILY_TIMEOUT_S = 600
SHARE_TIMEOUT_S = 480


def worker_env() -> dict[str, str]:
    """The test session's environment, with this folder on ``PYTHONPATH`` for ``mp.spawn``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """Ends a worker and the processes it started (its own session: DDP ranks too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_worker(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Runs the worker with ``args``; a worker past ``timeout_s`` fails the test."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"worker {args[0]} ran past {timeout_s:.0f} s; stderr tail:\n{err[-3000:]}")
    except BaseException:  # interrupted: leave no worker behind
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_results(path: Path, proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    tail = f"exit status {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}"
    if not path.exists():
        pytest.fail(f"the worker wrote no results ({path.name}); {tail}")
    data: dict[str, Any] = json.loads(path.read_text())
    data["_tail"] = tail
    return data


def record_all(record: Record, data: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        if key in data:
            record(key, data[key])


def check_done(data: dict[str, Any]) -> None:
    """Fails with the worker's error (and the stage it reached) unless it finished."""
    if data.get("stage") != "done" or "error" in data:
        pytest.fail(
            f"run stopped in stage {data.get('stage')!r} with "
            f"{data.get('error_type', 'no exception')}:\n{data.get('error', data['_tail'])}"
        )


FAMILY_KEYS = (
    "description",
    "device",
    "lms_backend",
    "reference_peak_reserved_bytes",
    "cap_bytes",
    "deficit_bytes",
    "reference_s_per_iter",
    "capped_s_per_iter",
    "s_per_iter",
    "pageout_bytes_per_iter",
    "pagein_bytes_per_iter",
    "stall_ms",
    "stall_ms_per_iter",
    "reference_repeatable",
    "reference_difference",
    "reference_max_relative_difference",
    "bit_identical",
    "difference",
    "max_relative_difference",
    "largest_alloc_bytes",
    "largest_alloc_source",
    "largest_alloc_over_cap",
    "param_bytes",
    "optimizer_state_bytes",
    "capped_peak_reserved_bytes",
    "lms_settings",
    "lms",
    "stage",
    "error_type",
    "lms_at_error",
)


def check_against_reference(data: dict[str, Any]) -> None:
    """Bit-identical when the reference repeats; otherwise within 10x its own spread."""
    if data["reference_repeatable"]:
        assert data["bit_identical"], (
            f"two uncapped runs are bit-identical, the capped LMS run is not: "
            f"{data['difference']} (largest relative difference "
            f"{data['max_relative_difference']:.3g})"
        )
    else:
        spread = data["reference_max_relative_difference"]
        bound = max(1e-3, 10 * spread)
        assert data["max_relative_difference"] <= bound, (
            f"the uncapped runs differ ({data['reference_difference']}; spread {spread:.3g}) "
            f"and the capped run is further off: {data['max_relative_difference']:.3g} > "
            f"{bound:.3g}"
        )


@pytest.mark.parametrize("cap", list(CAPS), ids=list(CAPS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_capped(name: str, cap: str, record: Record, tmp_path: Path) -> None:
    """One family under a cap of 1/2 or 1/4 of its uncapped peak, default LMS settings."""
    share = CAPS[cap]
    record("family", name)
    record("cap", CAP_LABELS[share])
    out = tmp_path / "result.json"
    proc = run_worker(
        ["family", "--family", name, "--cap-share", str(share), "--out", str(out)], FAMILY_TIMEOUT_S
    )
    data = read_results(out, proc)
    if "capped_s_per_iter" in data:
        data["s_per_iter"] = data["capped_s_per_iter"]
    if data.get("cap_bytes"):
        data["largest_alloc_over_cap"] = round(data["largest_alloc_bytes"] / data["cap_bytes"], 3)
    record_all(record, data, FAMILY_KEYS)
    check_done(data)

    assert data["lms"]["pageout_bytes"] > 0, "LMS trained under the cap without paging out"
    check_against_reference(data)
    # The sizing the row is for (checked last: the results above stand either way).
    assert data["largest_alloc_bytes"] > LARGE_ALLOCATION_BYTES, (
        f"the largest allocation inside an operator ({data['largest_alloc_bytes'] / MiB:.0f} "
        f"MiB, {data['largest_alloc_source']}) is not larger than 256 MiB"
    )
    if name == "adamw_foreach":
        # Its optimizer state alone does not fit in what the cap leaves beside the
        # parameters and their gradients.
        room = data["cap_bytes"] - 2 * data["param_bytes"]
        assert data["optimizer_state_bytes"] > room


def host_memory_needed(factor: float, device_bytes: int) -> int:
    """Host memory a no-cap row needs: (factor + 0.1) x the device memory, so that the
    pinned page-outs and the process itself fit beside each other (1.6x for 1.5x)."""
    return int((factor + 0.1) * device_bytes)


@pytest.mark.parametrize("factor", [1.1, 1.5], ids=["1.1x", "1.5x"])
def test_nocap(factor: float, record: Record, tmp_path: Path) -> None:
    """No memory cap: training needs ``factor`` times the device memory (a DeepMLP whose
    token count is computed from the device's total memory, so it adapts to the GPU).

    No run without LMS can hold the full batch, so the reference is the same batch in
    micro-batches without LMS: the same mathematics, not the same rounding; the LMS run
    must match it closely (relative difference 1e-3 or less).
    """
    device_bytes = torch.cuda.get_device_properties(0).total_memory
    host = host_memory_bytes()
    needed = host_memory_needed(factor, device_bytes)
    if host < needed:
        pytest.skip(
            f"host memory {host / 2**30:.0f} GiB is less than {factor + 0.1:.1f}x the device "
            f"memory ({needed / 2**30:.0f} GiB): page-outs need pinned host memory"
        )
    record("family", "deep_mlp")
    record("cap", f"none ({factor}x device)")
    out = tmp_path / "result.json"
    proc = run_worker(
        ["nocap", "--factor", str(factor), "--steps", "2", "--out", str(out)], FAMILY_TIMEOUT_S
    )
    data = read_results(out, proc)
    data["bit_identical"] = None
    data["reference_repeatable"] = None
    record_all(
        record,
        data,
        (
            "device",
            "lms_backend",
            "tokens",
            "largest_alloc_bytes",
            "largest_alloc_source",
            "need_bytes",
            "need_over_device",
            "live_after_forward_bytes",
            "peak_over_device",
            "peak_over_limit",
            "deficit_bytes",
            "s_per_iter",
            "pageout_bytes_per_iter",
            "pagein_bytes_per_iter",
            "stall_ms",
            "stall_ms_per_iter",
            "reference",
            "losses",
            "reference_losses",
            "max_relative_difference",
            "bit_identical",
            "reference_repeatable",
            "lms_settings",
            "lms",
            "stage",
            "error_type",
            "lms_at_error",
        ),
    )
    check_done(data)
    assert data["live_after_forward_bytes"] > device_bytes, (
        "the tensors alive after the forward pass fit the device: the row proves nothing"
    )
    assert data["lms"]["pageout_bytes"] > 0
    assert data["finite"], f"losses {data['losses']}"
    assert data["max_relative_difference"] <= 1e-3, (
        f"LMS run differs from the micro-batched reference by "
        f"{data['max_relative_difference']:.3g} (losses {data['losses']} vs "
        f"{data['reference_losses']})"
    )


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="DistributedDataParallel on 2 GPUs needs two CUDA devices",
)
def test_ddp_two_gpus(record: Record, tmp_path: Path) -> None:
    """ResNet-50 (torchvision; a CNN of our own without it) under DistributedDataParallel
    on two GPUs (NCCL), capped at 1/2 of each rank's own uncapped peak, LMS on with default
    settings; each rank is compared with its uncapped DDP run."""
    record("family", "ddp_resnet50")
    record("cap", "1/2 per GPU")
    proc = run_worker(["ddp", "--cap-share", "0.5", "--out-dir", str(tmp_path)], FAMILY_TIMEOUT_S)
    ranks = []
    for rank in range(2):
        data = read_results(tmp_path / f"ddp-rank{rank}.json", proc)
        ranks.append(data)
    first = ranks[0]
    for key in ("model", "device", "lms_backend"):
        if key in first:
            record(key, first[key])
    for key in (
        "reference_peak_reserved_bytes",
        "cap_bytes",
        "deficit_bytes",
        "reference_s_per_iter",
        "capped_s_per_iter",
        "pageout_bytes_per_iter",
        "stall_ms",
        "stall_ms_per_iter",
        "reference_repeatable",
        "bit_identical",
        "max_relative_difference",
        "reference_max_relative_difference",
        "largest_alloc_bytes",
        "stage",
        "error_type",
        "lms_at_error",
    ):
        record(key, [r.get(key) for r in ranks])
    # One number per column for the summary: the slower rank, the sum of page-outs.
    if all("capped_s_per_iter" in r for r in ranks):
        record("s_per_iter", max(r["capped_s_per_iter"] for r in ranks))
    for data in ranks:
        check_done(data)
    assert proc.returncode == 0, first["_tail"]
    for data in ranks:
        assert data["lms"]["pageout_bytes"] > 0, f"rank {data['rank']} did not page out"
        check_against_reference(data)


@pytest.mark.parametrize(
    ("processes", "fraction"), [(2, 0.6), (4, 0.4)], ids=["2x60pct", "4x40pct"]
)
def test_share_one_gpu(processes: int, fraction: float, record: Record, tmp_path: Path) -> None:
    """``processes`` processes on one GPU, each training a model that needs ``fraction`` of
    the device (together more than the device), started together, LMS on with default
    settings and no cap: all must finish.

    Without LMS this runs out of memory: after its first step every process keeps what it
    allocated while it waits for the others, so the needs are on the device at once. The
    same start without LMS (one step) is run as the control, and at least one of its
    processes must fail with torch.OutOfMemoryError.
    """
    device_bytes = torch.cuda.get_device_properties(0).total_memory
    host = host_memory_bytes()
    needed = int((processes * fraction - 1 + 0.5) * device_bytes)
    if host < needed:
        pytest.skip(
            f"host memory {host / 2**30:.0f} GiB is less than the {needed / 2**30:.0f} GiB the "
            "processes' page-outs and the processes themselves need"
        )
    record("family", "deep_mlp")
    record("cap", f"none ({processes} processes x {fraction:.0%} of the device)")
    lms = launch_share(processes, fraction, steps=3, lms=True, folder=tmp_path / "lms")
    # The control runs whatever the LMS run gave, so that the results show both.
    control = launch_share(processes, fraction, steps=1, lms=False, folder=tmp_path / "nolms")
    record("exit_codes", [r["returncode"] for r in lms])
    for key in (
        "need_bytes",
        "need_over_device",
        "largest_alloc_bytes",
        "s_per_iter",
        "pageout_bytes",
        "pageout_bytes_per_iter",
        "stall_ms",
        "peak_reserved_bytes",
        "waited_s",
        "lms_settings",
        "error_type",
        "lms_at_error",
    ):
        record(key, [r.get(key) for r in lms])
    needs = [r["need_bytes"] for r in lms if isinstance(r.get("need_bytes"), int)]
    if len(needs) == processes:
        record("deficit_bytes", sum(needs) - device_bytes)  # together beyond the device
    record("without_lms_exit_codes", [r["returncode"] for r in control])
    record("without_lms_errors", [r.get("error_type") for r in control])

    failed = [r for r in lms if r["returncode"] != 0 or r.get("stage") != "done"]
    assert not failed, "\n\n".join(
        f"process {r.get('rank')} (exit {r['returncode']}, stage {r.get('stage')!r}): "
        f"{r.get('error', r['_tail'])}"
        for r in failed
    )
    for r in lms:
        assert r["finite"], f"process {r['rank']}: losses {r['losses']}"
    ooms = [r for r in control if r.get("error_type") == "OutOfMemoryError"]
    assert ooms, (
        "without LMS every process finished: the processes' needs did not exceed the device"
    )


def launch_share(
    processes: int, fraction: float, steps: int, lms: bool, folder: Path
) -> list[dict[str, Any]]:
    """Starts the ``share`` workers together and returns each one's results.

    A worker that dies without saying so (a crash) is marked failed at the barrier here, so
    that the others do not wait for it.
    """
    folder.mkdir(parents=True)
    barrier = folder / "barrier"
    barrier.mkdir()
    procs = []
    for rank in range(processes):
        args = [
            "share",
            "--rank",
            str(rank),
            "--processes",
            str(processes),
            "--fraction",
            str(fraction),
            "--steps",
            str(steps),
            "--barrier",
            str(barrier),
            "--out",
            str(folder / f"rank{rank}.json"),
        ]
        if not lms:
            args.append("--no-lms")
        with (folder / f"rank{rank}.log").open("w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), *args],
                    env=worker_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + SHARE_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    (barrier / f"failed-{rank}").touch()
            if time.monotonic() > deadline:
                pytest.fail(f"the {processes} processes ran past {SHARE_TIMEOUT_S} s")
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
    results = []
    for rank, p in enumerate(procs):
        path = folder / f"rank{rank}.json"
        data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"rank": rank}
        data["returncode"] = p.returncode
        data["_tail"] = (folder / f"rank{rank}.log").read_text()[-3000:]
        results.append(data)
    return results
