"""LMS's host time per operator, with everything fitting.

LMS works at every operator boundary on the host: the dispatcher boxes the operator's inputs
and outputs for its observer, the observer pins and releases the operator's storages, the
learned schedule records the operator and looks ahead, and every allocation checks the limit.
A model whose operators are short on the GPU (ViT-L: ~33 us each) is bound by the host, so
that work shows in its iteration time even when nothing is ever paged out.

This benchmark trains a deep stack of small linear layers (forward, backward, SGD step),
whose kernels take a few microseconds, so that the host sets the pace, in one fresh process
per configuration:

``off``
    LMS disabled: the reference.
``on``
    LMS enabled with its defaults (observer, schedule, managed storages).
``no_schedule``
    LMS enabled, learned schedule off: the observer and the storages' bookkeeping only.
``unmanaged``
    LMS enabled with a size threshold above every tensor of the workload: the observer and the
    allocation path's limit checks, but no storage is managed.

Each configuration runs on the same stack twice: ``small`` keeps LMS's default size threshold
(1 MiB), above every tensor of the stack, so no tensor is managed (the cuBLAS workspaces,
32 MiB each, are); ``managed`` lowers it to 64 KiB, so that every activation (128 KiB) and
weight is managed. Per row:
microseconds per iteration and per operator (operators counted at the dispatcher in one
iteration), and the difference from ``off`` per operator. ``--rounds`` repeats every
configuration in turn and reports the median and the spread between rounds: a shared host's
speed drifts by tens of percent between processes, so a single round proves little. Figures
come from one run; compare rows of the same run only.

Usage (on a GPU host; the drop-in extension is imported when torch.cuda lacks the LMS API)::

    python -m benchmarks.host_overhead [--layers 48] [--iterations 30] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmsbench.harness import checkout_env
from lmsbench.lms_setup import ensure_lms_api, positive_int, versions

CONFIGS = ("off", "on", "no_schedule", "unmanaged")
# Activations: 32 rows of 1024 float32 features, 128 KiB.
WIDTH = 1024
ROWS = 32
# LMS size threshold per size (None: the build's default, 1 MiB).
THRESHOLDS: dict[str, int | None] = {"small": None, "managed": 64 * 1024}


def _configure(config: str, size: str) -> None:
    import torch

    if config == "off":
        return
    ensure_lms_api()
    torch.cuda.set_enabled_lms(True)
    threshold = THRESHOLDS[size]
    if threshold is not None:
        torch.cuda.set_size_lms(threshold)
    if config == "no_schedule":
        torch.cuda.set_schedule_lms(False)
    elif config == "unmanaged":
        torch.cuda.set_size_lms(1 << 40)


def _count_operators(step: Any) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        step()
    return counter.count


def measure(config: str, size: str, layers: int, iterations: int) -> dict[str, Any]:
    """One row, in this process: trains the stack and times it."""
    import torch

    _configure(config, size)
    width = WIDTH
    torch.manual_seed(0)
    # Square weights would be width^2: keep them small, the activations carry the size.
    # The kernels take a few microseconds: the host sets the pace.
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(
                torch.nn.Linear(width, 64), torch.nn.Linear(64, width), torch.nn.GELU()
            )
            for _ in range(layers)
        ]
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(ROWS, width, device="cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()

    for _ in range(8):  # the schedule confirms its period within two iterations
        step()
    torch.cuda.synchronize()
    operators = _count_operators(step)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - begin) / iterations)
    row: dict[str, Any] = {
        "config": config,
        "size": size,
        "activation_kib": ROWS * width * 4 // 1024,
        "threshold_kib": (THRESHOLDS[size] or 1 << 20) // 1024,
        "layers": layers,
        "operators": operators,
        "us_per_iter": round(best * 1e6, 1),
        "us_per_op": round(best * 1e6 / operators, 3),
    }
    if config != "off":
        stats = torch.cuda.lms_stats()
        row["managed_mib"] = round(stats["managed_bytes"]["peak"] / 2**20, 1)
        row["pageout_count"] = stats["pageout_count"]
        row["schedule_period"] = stats["schedule_period"] if stats["schedule_active"] else 0
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="LMS's host time per operator with everything fitting "
        "(one fresh process per configuration).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=positive_int, default=48, help="blocks of the stack")
    parser.add_argument("--iterations", type=positive_int, default=30, help="timed iterations")
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="rounds over all configurations (the report gives the median)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated configurations ({', '.join(CONFIGS)})",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(THRESHOLDS),
        help=f"comma-separated sizes ({', '.join(THRESHOLDS)})",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for host-overhead.csv/.json")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # CONFIG:SIZE, internal
    args = parser.parse_args(argv)
    for name, allowed in (("configs", CONFIGS), ("sizes", tuple(THRESHOLDS))):
        values = [v for v in getattr(args, name).split(",") if v]
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            parser.error(
                f"--{name}: unknown or empty {unknown or values!r}; "
                f"choose from {', '.join(allowed)}"
            )
        setattr(args, name, values)
    return args


def summarize(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration and size from the rows of every round: the median time per
    iteration and per operator, the spread between rounds ((max - min) / median), and the
    difference from the ``off`` row of the same size (per operator, and as a ratio)."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in raw:
        grouped.setdefault((r["config"], r["size"]), []).append(r)
    rows: list[dict[str, Any]] = []
    for (config, size), runs in grouped.items():
        ok = [r for r in runs if "us_per_iter" in r]
        if not ok:
            rows.append({"config": config, "size": size, "error": runs[-1].get("error", "")})
            continue
        per_iter = sorted(r["us_per_iter"] for r in ok)
        median = statistics.median(per_iter)
        operators = ok[0]["operators"]
        row = {k: v for k, v in ok[0].items() if k not in ("us_per_iter", "us_per_op")}
        row.update(
            rounds=len(ok),
            us_per_iter=round(median, 1),
            us_per_op=round(median / operators, 3),
            spread=round((per_iter[-1] - per_iter[0]) / median, 3),
        )
        rows.append(row)
    reference = {r["size"]: r for r in rows if r["config"] == "off" and "us_per_op" in r}
    for r in rows:
        ref = reference.get(r["size"])
        if ref is None or "us_per_op" not in r:
            continue
        r["extra_us_per_op"] = round(r["us_per_op"] - ref["us_per_op"], 3)
        r["vs_off"] = round(r["us_per_iter"] / ref["us_per_iter"], 3)
    return rows


def run_row(config: str, size: str, args: argparse.Namespace) -> dict[str, Any]:
    """Measures one configuration in a fresh process."""
    command = [
        sys.executable,
        __file__,
        "--row",
        f"{config}:{size}",
        "--layers",
        str(args.layers),
        "--iterations",
        str(args.iterations),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=checkout_env(), check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {
            "config": config,
            "size": size,
            "error": f"exit {done.returncode}: {' | '.join(tail)}",
        }
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def write_results(out: Path, rows: list[dict[str, Any]], raw: list[dict[str, Any]]) -> None:
    """``host-overhead.json`` (summary, every round's rows, versions) and ``.csv`` (summary)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "host-overhead.json", "w") as f:
        json.dump({"rows": rows, "rounds": raw, **versions()}, f, indent=2)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(out / "host-overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row is not None:
        config, size = args.row.split(":")
        print(json.dumps(measure(config, size, args.layers, args.iterations)))
        return 0
    raw: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    # Rounds interleave the configurations: a host whose speed drifts (other tenants, clock
    # changes) then shifts every configuration alike, and the spread shows how much it moved.
    for round_index in range(args.rounds):
        for size in args.sizes:
            for config in args.configs:
                row = run_row(config, size, args)
                row["round"] = round_index
                raw.append(row)
                if "error" in row:
                    print(f"round {round_index} {config}/{size}: failed: {row['error']}")
                    continue
                print(
                    f"round {round_index} {config:12s} {size:8s} {row['operators']:6d} ops  "
                    f"{row['us_per_iter']:10.1f} us/iter  {row['us_per_op']:7.3f} us/op",
                    flush=True,
                )
        # Written after every round: a run cut short keeps the rounds it finished.
        rows = summarize(raw)
        if args.out is not None:
            write_results(args.out, rows, raw)
    print(f"\nmedian of {args.rounds} rounds")
    print("config       size       us/op  extra us/op   vs off   spread")
    for r in rows:
        if "us_per_op" in r:
            print(
                f"{r['config']:12s} {r['size']:8s} {r['us_per_op']:7.3f} "
                f"{r.get('extra_us_per_op', 0.0):+11.3f}   {r.get('vs_off', 1.0):.3f}x"
                f"   {r['spread']:.0%}"
            )
    return 0 if all("us_per_op" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
