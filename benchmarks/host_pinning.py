"""How fast pinned host memory can be had: the rate at which LMS can grow its host tier.

A model bigger than the device pages out tens of GiB in its first iteration, and every byte
needs pinned host memory first; under a cap the first iteration pins hundreds of buffers of
tens of MiB. This measures, for buffers of each size of ``--buffer-mib``, up to
``--total-gib`` of them per method:

- ``cudaHostAlloc``: the runtime maps, zeroes and pins the pages on the calling thread (what
  the LMS host pool does for buffers under 64 MiB);
- ``register``: an anonymous mapping aligned to huge pages (with ``--huge-pages``, the
  engine's hint ``MADV_HUGEPAGE``) whose pages one thread, then ``--threads`` threads, fault
  in (``MADV_POPULATE_WRITE`` where the kernel has it, else a memset), then
  ``cudaHostRegister`` (what the pool does for buffers of 64 MiB and more).

Each buffer is freed after its measurement. Prints GB/s per size and method and the ratio of
the best ``register`` to ``cudaHostAlloc``, and writes them as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
HUGE_PAGE = 2 * MiB
# madvise advice values (linux/mman.h).
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14 and later


def _cudart() -> ctypes.CDLL:
    import torch

    torch.cuda.init()
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("libcudart not found: this benchmark needs the CUDA runtime")


def time_host_alloc(rt: ctypes.CDLL, sizes: Sequence[int]) -> float:
    ptrs = []
    start = time.perf_counter()
    for size in sizes:
        p = ctypes.c_void_p()
        err = rt.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_uint(1))
        if err != 0:
            raise RuntimeError(f"cudaHostAlloc of {size} bytes failed: error {err}")
        ptrs.append(p)
    elapsed = time.perf_counter() - start
    for p in ptrs:
        rt.cudaFreeHost(p)
    return elapsed


def thread_ranges(size: int, threads: int, unit: int) -> list[tuple[int, int]]:
    """[begin, end) of each thread's share of ``size`` bytes, whole ``unit``s each (the last
    share may be shorter); empty shares are left out."""
    chunk = (size // max(1, threads) + unit - 1) // unit * unit
    return [
        (begin, min(size, begin + chunk))
        for begin in range(0, size, max(chunk, unit))
        if begin < size
    ][:threads]


class Populator:
    """Faults the pages of a range in, on the calling thread: ``MADV_POPULATE_WRITE`` where
    the kernel has it (no write from user space, as the engine's touch of one byte a page),
    else a memset. ctypes releases the GIL, so threads fault pages in in parallel."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self.how = "MADV_POPULATE_WRITE"

    def __call__(self, address: int, length: int) -> None:
        if length <= 0:
            return
        if self.how == "MADV_POPULATE_WRITE":
            if self.libc.madvise(address, length, MADV_POPULATE_WRITE) == 0:
                return
            self.how = "memset"  # an older kernel: EINVAL
        self.libc.memset(ctypes.c_void_p(address), 0, ctypes.c_size_t(length))


def time_register(
    rt: ctypes.CDLL, sizes: Sequence[int], threads: int, huge_pages: bool, populate: Populator
) -> float:
    maps = []
    start = time.perf_counter()
    for size in sizes:
        # Aligned to a huge page, as the engine's mapping: map one more, start at the boundary.
        m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = ctypes.addressof(ctypes.c_char.from_buffer(m))
        base = (raw + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        if huge_pages:
            populate.libc.madvise(base, size, MADV_HUGEPAGE)  # a hint: fine if refused
        workers = [
            threading.Thread(target=populate, args=(base + b, e - b))
            for b, e in thread_ranges(size, threads, HUGE_PAGE)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        err = rt.cudaHostRegister(ctypes.c_void_p(base), ctypes.c_size_t(size), ctypes.c_uint(3))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed: error {err}")
        maps.append((m, base))
    elapsed = time.perf_counter() - start
    for m, base in maps:
        rt.cudaHostUnregister(ctypes.c_void_p(base))
        m.close()
    return elapsed


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--buffer-mib wants whole MiB, comma-separated (e.g. 4,16,64,256), got {text!r}"
        ) from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"--buffer-mib sizes must be positive, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_pinning",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--total-gib", type=float, default=4.0, help="pinned memory per method")
    parser.add_argument(
        "--buffer-mib", type=parse_sizes, default="4,16,64,256", help="buffer sizes, MiB"
    )
    parser.add_argument(
        "--threads", type=int, default=8, help="threads populating pages (the second register)"
    )
    parser.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="advise huge pages for the registered mappings, as the engine does",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    return parser


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rt = _cudart()
    populate = Populator()
    results = []
    for mib in args.buffer_mib:
        count = max(1, int(args.total_gib * GiB // (mib * MiB)))
        sizes = [mib * MiB] * count
        total = sum(sizes)
        host_alloc_s = time_host_alloc(rt, sizes)
        one_s = time_register(rt, sizes, 1, args.huge_pages, populate)
        many_s = time_register(rt, sizes, args.threads, args.huge_pages, populate)
        record = {
            "buffer_bytes": mib * MiB,
            "buffers": count,
            "bytes": total,
            "threads": args.threads,
            "huge_pages": args.huge_pages,
            "populate": populate.how,
            "cudaHostAlloc_gb_per_s": total / host_alloc_s / 1e9,
            "register_1_thread_gb_per_s": total / one_s / 1e9,
            "register_gb_per_s": total / many_s / 1e9,
            "speedup": host_alloc_s / min(one_s, many_s),
        }
        results.append(record)
        print(
            f"{count} buffers of {mib} MiB ({total / GiB:.1f} GiB): cudaHostAlloc "
            f"{record['cudaHostAlloc_gb_per_s']:.2f} GB/s; populate ({populate.how}) + "
            f"cudaHostRegister {record['register_1_thread_gb_per_s']:.2f} GB/s on 1 thread, "
            f"{record['register_gb_per_s']:.2f} on {args.threads} "
            f"({record['speedup']:.2f}x the first)",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.total_gib <= 0 or args.threads <= 0:
        parser.error("--total-gib and --threads must be positive")
    results = measure(args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
