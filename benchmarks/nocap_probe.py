"""Per-iteration counters of LMS training a model bigger than the device, with no cap.

Trains ResNet-152 (bf16 autocast, SGD with momentum, synthetic images) at ``--batch`` with
LMS on and default settings, no memory fraction, and prints for every iteration its time
and what changed in ``torch.cuda.memory_stats()`` (the allocator's retries, device
allocations and frees, synchronizations) and ``torch.cuda.lms_stats()`` (bytes paged out and
in, stall, returns of cached blocks, reclaims, page-ins on demand and ahead, early
page-outs), then optionally profiles ``--profile-iterations`` more iterations
(``stream_profile.py``: compute stream busy and idle, copy time each way, host time in CUDA
runtime calls). GiB figures are per iteration, except the gauges ``reserved``,
``allocated`` (after the step), ``limit`` and ``host`` (pinned host memory LMS holds).

The first iterations show what a user meets before the learned schedule: iteration 0 pins
the host memory of its page-outs, the schedule is adopted in iteration 3.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

GiB = 1 << 30
ALLOCATOR_KEYS = (
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
    "num_ooms",
)
LMS_KEYS = (
    "pageout_bytes",
    "pagein_bytes",
    "stall_ms",
    "cache_releases",
    "reclaim_limit",
    "reclaim_alloc_failure",
    "alloc_after_reclaim",
    "alloc_from_device",
    "pagein_demand_count",
    "early_pageout_bytes",
    "peak_pageout_bytes",
    "schedule_prefetch_count",
    "schedule_active",
    "pin_failures",
)
GAUGES = ("reserved", "allocated", "limit", "host", "schedule_active")
BYTE_KEYS = ("pageout_bytes", "pagein_bytes", "early_pageout_bytes", "peak_pageout_bytes")


def snapshot() -> dict[str, Any]:
    import torch

    ms = torch.cuda.memory_stats()
    ls = dict(torch.cuda.lms_stats())
    host = ls.get("host_bytes", {})
    return {
        **{k: ms.get(k, 0) for k in ALLOCATOR_KEYS},
        **{k: ls.get(k, 0) for k in LMS_KEYS},
        "reserved": ms.get("reserved_bytes.all.current", 0),
        "allocated": ms.get("allocated_bytes.all.current", 0),
        "limit": ls.get("limit_bytes", 0),
        "host": host.get("current", 0) if isinstance(host, dict) else host,
    }


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters as differences, gauges as read; bytes in GiB."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        v = value if key in GAUGES else value - before[key]
        if key in BYTE_KEYS or key in ("reserved", "allocated", "limit", "host"):
            v = round(v / GiB, 2)
        elif isinstance(v, float):
            v = round(v, 1)
        out[key] = v
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=250, help="images per iteration")
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--profile-iterations", type=int, default=0)
    parser.add_argument("--limit-mb", type=int, default=0, help="LMS limit (0: the default)")
    args = parser.parse_args(argv)
    if min(args.batch, args.image_size, args.iterations) < 1 or args.profile_iterations < 0:
        parser.error("--batch, --image-size and --iterations must be >= 1")

    import torch

    from benchmarks import models
    from lmsbench.lms_setup import LmsSettings, apply_lms, ensure_lms_api

    if not torch.cuda.is_available():
        print("nocap_probe.py: no CUDA device", file=sys.stderr)
        return 2
    ensure_lms_api()
    apply_lms(LmsSettings(enabled=True, limit_mb=args.limit_mb or None))
    workload = models.resnet152_workload(args.image_size)
    device = torch.device("cuda", torch.cuda.current_device())
    with device:
        model = workload.build()
    model.train()
    optimizer = workload.make_optimizer(model, "sgd")

    def step(i: int) -> None:
        x, y = workload.make_batch(args.batch, device, i)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = workload.loss(model(x), y)
        loss.backward()
        del x, y, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    free, total = torch.cuda.mem_get_info()
    print(f"device total {total / GiB:.2f} GiB, free at start {free / GiB:.2f} GiB", flush=True)
    before = snapshot()
    for i in range(args.iterations):
        start = time.perf_counter()
        step(i)
        seconds = time.perf_counter() - start
        after = snapshot()
        print(f"iter {i} {seconds:.3f} s " + json.dumps(delta(before, after)), flush=True)
        before = after
    print(
        f"peak allocated GiB {torch.cuda.max_memory_allocated() / GiB:.2f}, "
        f"peak reserved GiB {torch.cuda.max_memory_reserved() / GiB:.2f}"
    )
    if args.profile_iterations:
        from benchmarks.compare import profile_steps

        profile_steps(step, args.iterations, args.profile_iterations, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
