#!/usr/bin/env python3
"""Several LMS training processes on one GPU: do they all finish, and how long do they take
together against one after another?

``--processes`` processes each train the GPT-style decoder of ``lmsbench/models.py`` (sized by
``--gpt-*``) with LMS on and its default settings, at a batch chosen so that one step needs
``--fraction`` of the device (of each process's view of it under ``--cap-share``, the
``set_per_process_memory_fraction`` cap every process then gets). The batch comes from a
calibration in a process of its own before the runs, LMS off: the peak allocated memory of a
training step at batch 1 and at batch 2 gives what a sample adds and what the model takes
whatever the batch.

Scenarios, each process in a process of its own (``python -m benchmarks.processes --worker
SPEC``):

1. ``together``: all processes started at once (or ``--stagger-s`` apart), on one GPU, under
   one host budget (``--host-limit-gb``; every process sets the same one, as the budget is one
   for the host; default: derived by each process from the host);
2. ``serial`` (unless ``--no-serial``): the same processes one after another, each alone on the
   GPU: the baseline.

Writes ``results.jsonl`` into ``--out`` (default
``benchmarks/results/processes/<date>-<device>-<commit>/``): one record per process and
scenario with ``scenario``, ``process``, ``status`` (``finished``; ``oom``: it ended with
``torch.OutOfMemoryError``; ``killed``: a signal ended it, the kernel's OOM killer sends
SIGKILL; ``timeout``: stopped past ``--timeout-s``; ``error``: anything else), ``wall_s`` (its
start to its exit, as this process saw it), ``wait_s`` (what LMS says it waited for the other
processes: ``host_wait_ms`` plus ``device_wait_ms`` of ``lms_stats()``), ``pages_to_disk`` (the
page-outs to a disk tier where ``lms_stats()`` counts them, else 0), the steps it trained and
its LMS traffic; then one ``summary`` record with the wall time of the ``together`` scenario
(first start to last exit), that of the ``serial`` one (the sum of its processes' wall times)
and their ratio ``together_over_serial``. Every record names the engine commit and dirty flag,
torch, CUDA and the device.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmsbench import harness
from lmsbench.lms_setup import (
    UNKNOWN,
    fraction,
    nonneg_float,
    positive_float,
    positive_int,
    utc_now,
)

HERE = Path(__file__).resolve().parent
MODULE = "benchmarks.processes"
GB = 10**9
# Statistics of a disk tier below host memory, where the engine has one: the first of these
# that lms_stats() reports is the count of page-outs to disk.
DISK_PAGEOUT_KEYS = re.compile(r"^(spill|disk)_(pageout|out|write)_count$")
STATUSES = ("finished", "oom", "killed", "timeout", "error")


# ---------------------------------------------------------------------------------------
# Sizing and records (pure: checked on a CPU by tests/benchmarks/test_processes.py)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """One training step's peak allocated memory: what the model takes whatever the batch
    (``fixed_bytes``) and what each sample adds (``sample_bytes``), and the device."""

    fixed_bytes: int
    sample_bytes: int
    device: str
    total_bytes: int


def calibrate_from(peak_1: int, peak_2: int, device: str, total_bytes: int) -> Calibration:
    """The :class:`Calibration` of the peaks at batch 1 and 2."""
    sample = max(1, peak_2 - peak_1)
    return Calibration(max(0, peak_1 - sample), sample, device, total_bytes)


def batch_for(cal: Calibration, target_bytes: int) -> int:
    """The batch whose step needs ``target_bytes`` (at least 1)."""
    return max(1, (target_bytes - cal.fixed_bytes) // cal.sample_bytes)


def view_bytes(total_bytes: int, cap_share: float | None) -> int:
    """The device as each process sees it: the whole, or its cap."""
    return total_bytes if cap_share is None else int(cap_share * total_bytes)


def pages_to_disk(stats: dict[str, Any] | None) -> int:
    """Page-outs to a disk tier in ``stats`` (``lms_stats()``), 0 where it counts none."""
    for key in sorted(stats or {}):
        if DISK_PAGEOUT_KEYS.match(key):
            return int(stats[key])  # type: ignore[index]
    return 0


def wait_seconds(stats: dict[str, Any] | None) -> float:
    """Seconds LMS waited for other processes (host and device memory)."""
    stats = stats or {}
    return round((stats.get("host_wait_ms", 0.0) + stats.get("device_wait_ms", 0.0)) / 1000, 3)


def status_of(returncode: int | None, timed_out: bool, result: dict[str, Any] | None) -> str:
    """What became of a worker: its own word where it wrote a result, else from its exit."""
    if timed_out:
        return "timeout"
    if returncode is not None and returncode < 0:
        return "killed"
    if result is not None and result.get("status") in STATUSES:
        return str(result["status"])
    return "error"


def process_record(
    scenario: str,
    process: int,
    returncode: int | None,
    timed_out: bool,
    wall_s: float,
    result: dict[str, Any] | None,
) -> dict[str, Any]:
    """One process's record (see the module's docstring)."""
    result = result or {}
    stats = result.get("lms")
    return {
        "scenario": scenario,
        "process": process,
        "status": status_of(returncode, timed_out, result or None),
        "wall_s": round(wall_s, 3),
        "wait_s": wait_seconds(stats),
        "host_wait_s": round((stats or {}).get("host_wait_ms", 0.0) / 1000, 3),
        "device_wait_s": round((stats or {}).get("device_wait_ms", 0.0) / 1000, 3),
        "pages_to_disk": pages_to_disk(stats),
        "steps": result.get("steps_done", 0),
        "train_s": result.get("train_s"),
        "batch": result.get("batch"),
        "pageout_bytes": (stats or {}).get("pageout_bytes"),
        "pagein_bytes": (stats or {}).get("pagein_bytes"),
        "host_refusals": (stats or {}).get("host_refusals"),
        "limit_bytes": (stats or {}).get("limit_bytes"),
        "returncode": returncode,
        "error": result.get("error"),
    }


def summary_record(records: Sequence[dict[str, Any]], together_s: float) -> dict[str, Any]:
    """The ``summary`` record: wall times of the scenarios and their ratio."""
    together = [r for r in records if r["scenario"] == "together"]
    serial = [r for r in records if r["scenario"] == "serial"]
    serial_s = round(sum(r["wall_s"] for r in serial), 3) if serial else None
    return {
        "scenario": "summary",
        "processes": len(together),
        "finished": sum(r["status"] == "finished" for r in together),
        "killed": sum(r["status"] == "killed" for r in together),
        "together_s": round(together_s, 3),
        "serial_s": serial_s,
        "together_over_serial": round(together_s / serial_s, 3) if serial_s else None,
        "serial_finished": sum(r["status"] == "finished" for r in serial) if serial else None,
    }


def device_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``: the device part of a results folder's name."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w != "nvidia"]
    return next((w for w in words if re.match(r"^[a-z]+\d+", w)), "-".join(words) or UNKNOWN)


def default_out(env: dict[str, Any], device: str) -> Path:
    """``benchmarks/results/processes/<date>-<device>-<commit>``."""
    commit = str(env.get("engine_commit") or UNKNOWN)
    short = "unrecorded" if commit == UNKNOWN else commit[:7]
    date = str(env.get("date") or utc_now())[:10]
    return HERE / "results" / "processes" / f"{date}-{device_slug(device)}-{short}"


# ---------------------------------------------------------------------------------------
# The worker (a process of its own: torch is imported here only)
# ---------------------------------------------------------------------------------------


def _gpt_config(spec: dict[str, Any]) -> Any:
    from lmsbench.models import GPTConfig

    return GPTConfig(**spec["gpt"])


def _step(model: Any, optimizer: Any, batch: int, seq: int, vocab: int, amp: bool) -> float:
    import torch

    idx = torch.randint(0, vocab, (batch, seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]).float(), idx.view(-1)
        )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def _calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmsbench.models import GPT

    torch.backends.cuda.matmul.allow_tf32 = True
    config = _gpt_config(spec)
    model = GPT(config).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    peaks = []
    for batch in (1, 2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(model, optimizer, batch, config.seq, config.vocab, spec["amp"])
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    props = torch.cuda.get_device_properties(0)
    return {
        "status": "finished",
        "peak_1": peaks[0],
        "peak_2": peaks[1],
        "device": props.name,
        "total_bytes": props.total_memory,
    }


def _train(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmsbench.lms_setup import ensure_lms_api, is_oom, lms_stats
    from lmsbench.models import GPT

    ensure_lms_api()
    torch.cuda.set_enabled_lms(True)
    if spec.get("host_limit_bytes"):
        torch.cuda.set_host_limit_lms(int(spec["host_limit_bytes"]))
    if spec.get("cap_share") is not None:
        torch.cuda.set_per_process_memory_fraction(float(spec["cap_share"]))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(spec.get("seed", 0))
    config = _gpt_config(spec)
    out: dict[str, Any] = {"batch": spec["batch"], "steps_done": 0, "losses": []}
    start = time.perf_counter()
    try:
        model = GPT(config).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        for _ in range(spec["steps"]):
            out["losses"].append(
                _step(model, optimizer, spec["batch"], config.seq, config.vocab, spec["amp"])
            )
            out["steps_done"] += 1
        torch.cuda.synchronize()
        out["status"] = "finished"
    except Exception as error:  # what ended the run is the record
        if not is_oom(error):
            raise
        out["status"] = "oom"
        out["error"] = harness.first_line(str(error))
    out["train_s"] = round(time.perf_counter() - start, 3)
    out["lms"] = lms_stats()
    return out


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The worker's side: calibrate or train, as the spec says."""
    return _calibrate(spec) if spec["mode"] == "calibrate" else _train(spec)


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------


@dataclass
class Started:
    """A worker process under way."""

    process: int
    proc: Any
    start: float
    result_path: Path
    end: float | None = None
    timed_out: bool = False


def _start(spec: dict[str, Any], folder: Path, name: str) -> tuple[Any, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    result_path = folder / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    spec_path = folder / f"{name}.spec.json"
    harness.write_json(spec_path, {**spec, "result_path": str(result_path)})
    command = [sys.executable, "-m", MODULE, "--worker", str(spec_path)]
    with (folder / f"{name}.log").open("w") as log:
        proc = harness.start_process(command, harness.worker_env(), log, cwd=harness.REPO_ROOT)
    return proc, result_path


def run_workers(
    specs: Sequence[dict[str, Any]],
    folder: Path,
    scenario: str,
    together: bool,
    stagger_s: float,
    timeout_s: float,
) -> tuple[list[dict[str, Any]], float]:
    """Runs ``specs`` together (``stagger_s`` apart) or one after another; their records and
    the scenario's wall time (first start to last exit)."""
    begin = time.perf_counter()
    records = []
    pending: list[Started] = []

    def finish(s: Started) -> None:
        if s.proc.poll() is None:
            harness.stop_group(s.proc, grace_s=0)
        else:
            harness.stop_leftovers(s.proc)
        end = s.end if s.end is not None else time.perf_counter()
        records.append(
            process_record(
                scenario,
                s.process,
                s.proc.returncode,
                s.timed_out,
                end - s.start,
                harness.read_json(s.result_path),
            )
        )

    def wait(running: list[Started]) -> None:
        deadline = harness.Deadline(timeout_s)
        while any(s.end is None for s in running):
            for s in running:
                if s.end is None and s.proc.poll() is not None:
                    s.end = time.perf_counter()
            if deadline.left() < 0:
                for s in running:
                    if s.end is None:
                        s.timed_out = True
                        s.end = time.perf_counter()
                break
            time.sleep(0.05)

    try:
        for i, spec in enumerate(specs):
            if together and i and stagger_s:
                time.sleep(stagger_s)
            proc, result_path = _start(spec, folder, f"{scenario}-{i}")
            pending.append(Started(i, proc, time.perf_counter(), result_path))
            if not together:
                wait(pending[-1:])
        wait(pending)
    finally:
        for s in pending:
            finish(s)
    return sorted(records, key=lambda r: int(r["process"])), time.perf_counter() - begin


def calibrate(spec: dict[str, Any], folder: Path, timeout_s: float) -> Calibration:
    """Runs the calibration worker; raises when it gives no figures."""
    result = harness.run_worker(
        Path(__file__),
        {**spec, "mode": "calibrate"},
        folder / "calibrate.log",
        harness.worker_env(),
        timeout_s,
    )
    if result.get("status") != "finished":
        raise RuntimeError(f"calibration failed: {result.get('detail', result)}")
    return calibrate_from(
        int(result["peak_1"]),
        int(result["peak_2"]),
        str(result["device"]),
        int(result["total_bytes"]),
    )


def worker_specs(args: argparse.Namespace, batch: int) -> list[dict[str, Any]]:
    """The training spec of each process."""
    base = {
        "mode": "train",
        "gpt": gpt_spec(args),
        "amp": args.amp,
        "batch": batch,
        "steps": args.steps,
        "cap_share": args.cap_share,
        "host_limit_bytes": int(args.host_limit_gb * GB) if args.host_limit_gb else None,
    }
    return [{**base, "seed": i, "config": f"process {i}"} for i in range(args.processes)]


def gpt_spec(args: argparse.Namespace) -> dict[str, int]:
    return {
        "layers": args.gpt_layers,
        "dim": args.gpt_dim,
        "heads": args.gpt_heads,
        "seq": args.gpt_seq,
        "vocab": args.gpt_vocab,
    }


def run_benchmark(args: argparse.Namespace) -> tuple[Path, list[dict[str, Any]]]:
    """Calibrates, runs the scenarios and writes ``results.jsonl``; returns its folder and
    the records."""
    env = harness.record_environment(device=False)
    spec = {"gpt": gpt_spec(args), "amp": args.amp}
    with tempfile.TemporaryDirectory(prefix="lms-processes-") as calibration:
        cal = calibrate(spec, Path(calibration), args.timeout_s)
    out = args.out or default_out(env, cal.device)
    work = args.scratch or out / "runs"
    env["device"] = cal.device
    view = view_bytes(cal.total_bytes, args.cap_share)
    batch = batch_for(cal, int(args.fraction * view))
    need = cal.fixed_bytes + batch * cal.sample_bytes
    print(
        f"{cal.device}: a step needs {cal.fixed_bytes / GB:.2f} GB + {cal.sample_bytes / GB:.3f}"
        f" GB a sample; batch {batch} needs {need / GB:.1f} GB, {need / view:.2f}x the view of"
        f" the device ({view / GB:.1f} GB) of each of {args.processes} processes",
        flush=True,
    )
    specs = worker_specs(args, batch)
    records, together_s = run_workers(specs, work, "together", True, args.stagger_s, args.timeout_s)
    if not args.no_serial:
        serial, _ = run_workers(specs, work, "serial", False, 0.0, args.timeout_s)
        records += serial
    for r in records:
        r.update(
            batch=batch,
            need_bytes=need,
            view_bytes=view,
            cap_share=args.cap_share,
            host_limit_bytes=specs[0]["host_limit_bytes"],
        )
    records.append(summary_record(records, together_s))
    rows = harness.with_provenance(records, env)
    out.mkdir(parents=True, exist_ok=True)
    harness.replace_atomically(
        out / "results.jsonl", lambda f: f.writelines(json.dumps(r) + "\n" for r in rows)
    )
    return out, rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.processes",
        description=(
            "Several LMS training processes on one GPU, started together, against the same "
            "processes one after another. Writes results.jsonl (see the module docstring)."
        ),
    )
    parser.add_argument("--processes", type=positive_int, default=4, help="processes (4)")
    parser.add_argument(
        "--fraction",
        type=positive_float,
        default=0.8,
        help="what one training step of each process needs, as a share of its view of the "
        "device (0.8)",
    )
    parser.add_argument(
        "--cap-share",
        type=fraction,
        default=None,
        help="cap every process at this share of the device (set_per_process_memory_fraction)"
        "; its view of the device is then the cap (default: no cap)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=16,
        help="training steps (16: enough for processes started together to train together)",
    )
    parser.add_argument(
        "--host-limit-gb",
        type=positive_float,
        default=None,
        help="host budget for the pinned memory of all processes, in GB (default: derived)",
    )
    parser.add_argument(
        "--stagger-s",
        type=nonneg_float,
        default=0.0,
        help="seconds between two starts of the together scenario (0)",
    )
    parser.add_argument(
        "--no-serial", action="store_true", help="skip the one-after-another baseline"
    )
    parser.add_argument(
        "--timeout-s",
        type=positive_float,
        default=600.0,
        help="stop a scenario's processes after this long (600)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default benchmarks/results/processes/<date>-<device>-<commit>)",
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="folder for the workers' specs, results and logs (default OUT/runs)",
    )
    harness.add_gpt_options(parser, layers=12, dim=1024, heads=16, seq=1024, vocab=32768)
    harness.add_amp_option(parser)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        return harness.serve_worker(args.worker, run_spec)
    if args.gpt_dim % args.gpt_heads:
        print("--gpt-dim must be a multiple of --gpt-heads", file=sys.stderr)
        return 2
    out, rows = run_benchmark(args)
    for r in rows:
        if r["scenario"] == "summary":
            ratio = r["together_over_serial"]
            print(
                f"together: {r['finished']}/{r['processes']} finished, {r['killed']} killed, "
                f"{r['together_s']:.1f} s; serial {r['serial_s']} s; ratio "
                f"{'-' if ratio is None else f'{ratio:.2f}'}"
            )
        else:
            print(
                f"{r['scenario']} {r['process']}: {r['status']}, {r['wall_s']:.1f} s, waited "
                f"{r['wait_s']:.1f} s, {r['steps']} steps"
            )
    print(f"results: {out / 'results.jsonl'}")
    finished = all(r["status"] == "finished" for r in rows if r["scenario"] == "together")
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
