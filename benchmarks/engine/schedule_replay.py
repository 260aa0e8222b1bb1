"""How well the learned swap schedule serves repeating training traces on the simulated GPU.

Generates repeating operator traces (``lmsbench/trace_gen.py --repeat``: the same operators
and sizes every iteration, as in real training) over every model family and optimizer of the
generator, replays each with one or more ``trace_replay`` binaries (built against the simulated
GPU by ``standalone/build.sh --runtime sim``; give two to compare engines) and prints, per
binary, the page-outs, page-ins, page-ins ahead of use (prefetches) and page-ins on demand
(the operator waited for the copy), summed over the traces, with the ratios of each binary to
the first. A trace that does not end ``ok`` is listed: the figures then compare unlike runs.

    python -m benchmarks.engine.schedule_replay --replayer work/ci/engine-sim-v2.6.0/trace_replay
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lmsbench.trace_gen import FAMILIES, OPTIMIZERS, generate

COUNTS = ("pageouts", "pageins", "prefetches")


def replay(replayer: Path, trace: Path) -> dict[str, object]:
    """The trace-result of one replay (outcome and counts)."""
    env = {**os.environ, "SIMGPU_DEVICE_COUNT": "1"}
    env.pop("SIMGPU_CAPACITY_MB", None)  # the trace sets the capacity
    proc = subprocess.run(
        [str(replayer), str(trace)], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("trace-result ")]
    if proc.returncode != 0 or not lines:
        return {"outcome": f"exit {proc.returncode}"}
    result: dict[str, object] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Replay repeating simulated training traces and count demand page-ins.",
    )
    parser.add_argument(
        "--replayer",
        type=Path,
        action="append",
        required=True,
        help="a trace_replay binary; give it twice to compare two engines",
    )
    parser.add_argument("--seeds", type=int, default=24, help="traces (default 24)")
    parser.add_argument("--iterations", type=int, default=10, help="per trace (default 10)")
    parser.add_argument(
        "--regime", default="tight", help="trace_gen regime: fit, tight or over (default tight)"
    )
    args = parser.parse_args(argv)
    for binary in args.replayer:
        if not binary.is_file():
            parser.error(f"no trace_replay binary at {binary}: build it with standalone/build.sh")
    totals = [dict.fromkeys(COUNTS, 0) for _ in args.replayer]
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="lms-schedule-replay-") as folder:
        for seed in range(args.seeds):
            family = FAMILIES[seed % len(FAMILIES)]
            optimizer = OPTIMIZERS[seed // len(FAMILIES) % len(OPTIMIZERS)]
            trace = generate(
                seed,
                family=family,
                optimizer=optimizer,
                regime=args.regime,
                iterations=args.iterations,
                repeat=True,
            )
            path = Path(folder) / f"seed{seed}.trace"
            path.write_text(trace.text())
            for binary, total in zip(args.replayer, totals):
                result = replay(binary, path)
                if result.get("outcome") != "ok":
                    failed.append(f"seed {seed} ({family}, {optimizer}) with {binary}: {result}")
                    continue
                for key in COUNTS:
                    total[key] += int(str(result[key]))
            print(f"seed {seed}: {family}, {optimizer}", file=sys.stderr)
    print(f"{args.seeds} repeating traces, {args.iterations} iterations, regime {args.regime}")
    print("| replayer | page-outs | page-ins | ahead of use | on demand | on demand vs first |")
    print("| --- | --- | --- | --- | --- | --- |")
    first_demand = None
    for binary, total in zip(args.replayer, totals):
        demand = total["pageins"] - total["prefetches"]
        first_demand = demand if first_demand is None else first_demand
        ratio = f"{demand / first_demand:.2f}x" if first_demand else ""
        print(
            f"| {binary} | {total['pageouts']} | {total['pageins']} | {total['prefetches']} "
            f"| {demand} | {ratio} |"
        )
    for line in failed:
        print(f"not ok: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
