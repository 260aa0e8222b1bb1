"""Traces what chosen operators allocate inside themselves in one stress case.

For the first calls of the operators named (substrings of their names; by default the cuDNN
convolution and RNN backward operators), the case runs in this process through ``worker``
and records, for each call, the caching allocator's actions from the call's start to its end
(allocations, frees, and failed requests: ``oom``, with the ATen and LMS frames that made
them), the bytes of the call's input storages, and the allocator before and after the call
(``worker.memory_picture``: bytes allocated and reserved, and each segment, with the blocks
and page use of the expandable ones). Run a failing seed in ``reference`` and in ``capped``
mode and compare the calls: a workspace that cuDNN got uncapped and did not get capped (its
request an ``oom`` action, then a smaller one) is the algorithm it changed under the cap; the
segments before the call show what kept pages mapped beside its inputs. The capped run's
``PYTORCH_LMS_PACK_LOG=1`` adds LMS's packing decisions to its output.

    PYTHONPATH=extension python -m tests.regression.stress.optrace --seed 123 --mode capped \\
        --cap-bytes 415800229 --out out/optrace-123

Writes ``calls.json`` (the calls) and ``run.json`` (the worker's result); prints one line per
call, after the run's own output. Needs a CUDA device: the trace is the CUDA caching
allocator's history.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import worker
from .generator import generate

DEFAULT_OPS = ("convolution_backward", "_cudnn_rnn_backward", "cudnn_convolution")
# The allocator's actions a call's trace keeps: what it allocated, freed, mapped and could not.
TRACED_ACTIONS = frozenset(
    {"alloc", "free_requested", "oom", "segment_map", "segment_unmap", "segment_alloc"}
)
# Frames worth showing: where in ATen or LMS an allocation came from.
FRAME_KEYS = ("native", "LargeModel", "Lms", "cudnn", "Conv", "RNN")
MiB = 1024 * 1024


def trace_events(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The actions of ``snapshot``'s device traces that a call's trace keeps, in order, each
    with the frames (file:line function) of ATen and LMS that made it, innermost first."""
    events = []
    for device_trace in snapshot.get("device_traces", []):
        for action in device_trace:
            if action.get("action") not in TRACED_ACTIONS:
                continue
            frames = [
                f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name'][:80]}"
                for frame in action.get("frames", [])
                if any(key in frame.get("filename", "") for key in FRAME_KEYS)
            ]
            events.append(
                {
                    "action": action["action"],
                    "bytes": int(action.get("size", 0)),
                    "address": int(action.get("addr", 0)),
                    "frames": frames[:4],
                }
            )
    return events


class OperatorTrace(TorchDispatchMode):
    """Records the allocator's history over each call of the operators named, up to a count."""

    def __init__(self, ops: tuple[str, ...], max_calls: int) -> None:
        super().__init__()
        self.ops = ops
        self.max_calls = max_calls
        self.calls: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if len(self.calls) >= self.max_calls or not any(op in name for op in self.ops):
            return func(*args, **kwargs)
        inputs = worker.storages_of((args, kwargs), "cuda")
        call: dict[str, Any] = {
            "op": name,
            "input_bytes": sorted(inputs.values(), reverse=True),
            "memory_before": worker.memory_picture(torch.device("cuda")),
        }
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="all", max_entries=100_000
        )
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            call["error"] = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            call["events"] = trace_events(snapshot)
            call["memory_after"] = worker.memory_picture(torch.device("cuda"))
            self.calls.append(call)


def describe(call: dict[str, Any]) -> str:
    """One line: the operator, its inputs, what it allocated and what it could not."""
    allocs = [e["bytes"] / MiB for e in call["events"] if e["action"] == "alloc"]
    failed = [e["bytes"] / MiB for e in call["events"] if e["action"] == "oom"]
    line = (
        f"{call['op']}: inputs {sum(call['input_bytes']) / MiB:.1f} MiB, "
        f"allocated {', '.join(f'{a:.1f}' for a in allocs) or 'nothing'} MiB"
    )
    if failed:
        line += f"; could not allocate {', '.join(f'{f:.1f}' for f in failed)} MiB"
    if "error" in call:
        line += f"; raised {call['error'][:120]}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.regression.stress.optrace",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--seed", type=int, required=True, help="the case (generator.generate)")
    parser.add_argument("--mode", choices=("reference", "capped"), default="reference")
    parser.add_argument(
        "--cap-bytes", type=int, help="the capped run's cap (a record's cap_bytes in results.jsonl)"
    )
    parser.add_argument(
        "--alloc-conf",
        default="expandable_segments:True",
        help="allocator setting of the run (default expandable_segments:True, as the suite's)",
    )
    parser.add_argument(
        "--ops",
        nargs="+",
        default=list(DEFAULT_OPS),
        help=f"operator name substrings to trace (default: {' '.join(DEFAULT_OPS)})",
    )
    parser.add_argument("--iterations", type=int, default=3, help="training iterations (default 3)")
    parser.add_argument("--max-calls", type=int, default=40, help="calls traced (default 40)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    args = parser.parse_args(argv)
    if args.mode == "capped" and args.cap_bytes is None:
        parser.error("--mode capped needs --cap-bytes (the record's cap_bytes in results.jsonl)")
    if args.iterations < 1 or args.max_calls < 1:
        parser.error(
            f"--iterations ({args.iterations}) and --max-calls ({args.max_calls}) must be >= 1"
        )
    if not torch.cuda.is_available():
        print(
            "optrace: no CUDA device: the trace is the CUDA caching allocator's history",
            file=sys.stderr,
        )
        return 2
    case = dataclasses.replace(generate(args.seed), iterations=args.iterations)
    trace = OperatorTrace(tuple(args.ops), args.max_calls)
    train = worker.train

    def traced_train(*train_args: Any, **train_kwargs: Any) -> None:
        with trace:
            train(*train_args, **train_kwargs)

    args.out.mkdir(parents=True, exist_ok=True)
    worker.train = traced_train
    try:
        status = worker.run(
            {
                "case": case.to_dict(),
                "mode": args.mode,
                "device": "cuda",
                "cap_bytes": args.cap_bytes,
                "alloc_conf": args.alloc_conf,
                "result": str(args.out / "run.json"),
            }
        )
    finally:
        worker.train = train
    (args.out / "calls.json").write_text(json.dumps(trace.calls))
    for call in trace.calls:
        print(describe(call))
    print(f"optrace: worker exit status {status}; {len(trace.calls)} calls in {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
