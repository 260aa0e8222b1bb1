"""What the dispatcher costs to call an operator observer, LMS or not.

LMS sees operators through a RecordFunction callback (``LmsPinning.cpp``). Part of LMS's host
time per operator is therefore not LMS's own work but the dispatcher's: once any callback is
installed, every operator builds a RecordFunction, and a callback that needs the operator's
inputs or outputs has them boxed. This benchmark installs callbacks that do nothing, through
a small extension compiled on the spot (``torch.utils.cpp_extension.load_inline``: a C++
compiler and PyTorch's headers are needed), and times the host-bound stack of
``benchmarks/host_overhead.py`` with LMS off:

``plain``
    no callback;
``depth_only``
    a callback that asks for nothing (all an observer that only counted operators would
    cost);
``inputs``
    a callback that needs the inputs;
``inputs_outputs``
    a callback that needs inputs and outputs, as LMS's does.

Configurations alternate within each of ``--rounds`` rounds, in one process; the report gives
each configuration's median microseconds per operator and its difference from ``plain``.

Usage (on a GPU host): ``python -m benchmarks.observer_cost [--rounds 3] [--layers 48]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from lmsbench.lms_setup import positive_int

CONFIGS = ("plain", "depth_only", "inputs", "inputs_outputs")

_SOURCE = r"""
#include <ATen/record_function.h>
#include <torch/extension.h>

namespace {
at::CallbackHandle g_handle = at::INVALID_CALLBACK_HANDLE;
bool g_inputs = false;
bool g_outputs = false;
thread_local volatile size_t t_sink = 0;

std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
  if (fn.operator_name().has_value() && g_inputs) {
    for (const c10::IValue& v : fn.inputs()) {
      t_sink = t_sink + v.isTensor();
    }
  }
  return nullptr;
}

void end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (fn.operator_name().has_value() && g_outputs) {
    for (const c10::IValue& v : fn.outputs()) {
      t_sink = t_sink + v.isTensor();
    }
  }
}
} // namespace

void install(bool inputs, bool outputs) {
  g_inputs = inputs;
  g_outputs = outputs;
  g_handle = at::addGlobalCallback(at::RecordFunctionCallback(&start, &end)
                                       .needsInputs(inputs)
                                       .needsOutputs(outputs)
                                       .scopes({at::RecordScope::FUNCTION}));
}

void uninstall() {
  at::removeCallback(g_handle);
  g_handle = at::INVALID_CALLBACK_HANDLE;
}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The dispatcher's host time per operator for an observer that does nothing.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds over the configs")
    parser.add_argument("--layers", type=positive_int, default=48, help="blocks of the stack")
    parser.add_argument("--iterations", type=positive_int, default=30, help="timed iterations")
    return parser.parse_args(argv)


def summarize(samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Median microseconds per operator per configuration, and the difference from plain."""
    medians = {k: statistics.median(v) for k, v in samples.items() if v}
    plain = medians.get("plain")
    return [
        {
            "config": k,
            "us_per_op": round(m, 3),
            "extra_us_per_op": round(m - plain, 3) if plain is not None else None,
            "rounds": len(samples[k]),
        }
        for k, m in medians.items()
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch.utils.cpp_extension import load_inline

    if not torch.cuda.is_available():
        print("observer_cost.py: needs a CUDA device (the stack it times runs on the GPU)")
        return 2
    from benchmarks import host_overhead

    ext = load_inline(
        "lms_observer_cost",
        cpp_sources=[_SOURCE],
        functions=["install", "uninstall"],
        extra_cflags=["-O2", "-DNDEBUG"],
    )
    samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for round_index in range(args.rounds):
        for config in CONFIGS:
            if config != "plain":
                ext.install(config != "depth_only", config == "inputs_outputs")
            try:
                row = host_overhead.measure("off", "small", args.layers, args.iterations)
            finally:
                if config != "plain":
                    ext.uninstall()
            samples[config].append(row["us_per_op"])
            print(f"round {round_index} {config:15s} {row['us_per_op']:7.3f} us/op", flush=True)
    print("\nconfig          median us/op  extra us/op")
    for r in summarize(samples):
        print(f"{r['config']:15s} {r['us_per_op']:12.3f}  {r['extra_us_per_op']:+11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
