"""How fast pinned host memory can be had: the rate at which LMS can grow its host tier.

A model bigger than the device pages out tens of GiB in its first iteration, and every byte
needs pinned host memory first. This measures, for buffers of ``--buffer-mib`` up to
``--total-gib``:

- ``cudaHostAlloc``: the runtime maps, zeroes and pins the pages (on the calling thread);
- ``register``: an anonymous mapping whose pages ``--threads`` threads fault in, then
  ``cudaHostRegister`` (what the LMS host pool does for buffers of 64 MiB and more).

Each buffer is freed after the measurement. Prints GB/s for each and their ratio, and writes
them as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30


def _cudart() -> ctypes.CDLL:
    import torch

    torch.cuda.init()
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("libcudart not found: this benchmark needs the CUDA runtime")


def time_host_alloc(rt: ctypes.CDLL, sizes: list[int]) -> float:
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


def time_register(rt: ctypes.CDLL, sizes: list[int], threads: int) -> float:
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None)
    maps = []
    start = time.perf_counter()
    for size in sizes:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        chunk = (size // threads + page - 1) // page * page

        def touch(begin: int, end: int, base: int = base) -> None:
            # memset releases the GIL: the threads fault pages in in parallel.
            if end > begin:
                libc.memset(ctypes.c_void_p(base + begin), 0, ctypes.c_size_t(end - begin))

        workers = [
            threading.Thread(target=touch, args=(t * chunk, min(size, (t + 1) * chunk)))
            for t in range(threads)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-gib", type=float, default=8.0, help="pinned memory per method")
    parser.add_argument("--buffer-mib", type=int, default=256, help="size of each buffer")
    parser.add_argument("--threads", type=int, default=8, help="threads populating pages")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.total_gib <= 0 or args.buffer_mib <= 0 or args.threads <= 0:
        parser.error("--total-gib, --buffer-mib and --threads must be positive")
    rt = _cudart()
    count = max(1, int(args.total_gib * GiB // (args.buffer_mib * MiB)))
    sizes = [args.buffer_mib * MiB] * count
    total = sum(sizes)
    host_alloc_s = time_host_alloc(rt, sizes)
    register_s = time_register(rt, sizes, args.threads)
    result = {
        "bytes": total,
        "buffer_bytes": args.buffer_mib * MiB,
        "threads": args.threads,
        "cudaHostAlloc_s": host_alloc_s,
        "cudaHostAlloc_gb_per_s": total / host_alloc_s / 1e9,
        "register_s": register_s,
        "register_gb_per_s": total / register_s / 1e9,
        "speedup": host_alloc_s / register_s,
    }
    print(
        f"{total / GiB:.1f} GiB in {count} buffers of {args.buffer_mib} MiB: cudaHostAlloc "
        f"{result['cudaHostAlloc_gb_per_s']:.2f} GB/s, populate ({args.threads} threads) + "
        f"cudaHostRegister {result['register_gb_per_s']:.2f} GB/s "
        f"({result['speedup']:.2f}x)"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
