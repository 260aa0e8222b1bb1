"""Do kernels compute the same bits with their memory in pinned host memory as on the device?

LMS's host placement (``torch.cuda.set_host_placement_lms``) puts an allocation that an
operator cannot have on the device (cuDNN's workspace, an output) in pinned host memory, which
unified addressing makes valid on the device, and lets the operator's kernels use it over the
bus. This probe checks the premise without LMS: a CUDA pluggable allocator (compiled here with
the host's C compiler against ``$CUDA_HOME``) returns ``cudaHostAlloc`` memory for every
allocation while a switch is on. Each case builds its inputs on the device, then runs the same
computation three times: on the device, with every allocation it makes (workspaces, outputs) on
the host, and on the device again (whether the device runs repeat). It prints, per case,
whether the host run's results equal the device run's bit for bit, both times (the host time
includes pinning each fresh buffer) and the host memory used, and writes them to
``OUT/host-placed-kernels.json`` with the environment. Deterministic settings, no TF32.

    python -m benchmarks.host_placed_kernels --out out/probes

The allocator replaces PyTorch's for the whole process, so nothing else may use CUDA first.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ALLOCATOR_SOURCE = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>

static int g_host = 0;
static size_t g_host_bytes = 0;

void probe_set_host(int on) { g_host = on; }
size_t probe_host_bytes(void) { return g_host_bytes; }

void* probe_alloc(size_t size, int device, cudaStream_t stream) {
  void* p = NULL;
  (void)device;
  (void)stream;
  if (g_host) {
    if (cudaHostAlloc(&p, size, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) {
      return NULL;
    }
    g_host_bytes += size;
  } else if (cudaMalloc(&p, size) != cudaSuccess) {
    return NULL;
  }
  return p;
}

void probe_free(void* p, size_t size, int device, cudaStream_t stream) {
  struct cudaPointerAttributes a;
  (void)size;
  (void)device;
  cudaStreamSynchronize(stream);
  if (cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeHost) {
    cudaFreeHost(p);
  } else {
    cudaFree(p);
  }
}
"""

Case = tuple[Callable[[], Sequence[Any]], Callable[..., Sequence[Any]]]


def build_allocator(folder: Path) -> Path:
    """Compiles the switchable allocator into ``folder``; returns the library's path."""
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    source = folder / "host_placed_allocator.c"
    library = folder / "host_placed_allocator.so"
    source.write_text(ALLOCATOR_SOURCE)
    command = [
        os.environ.get("CC", "cc"),
        "-O2",
        "-shared",
        "-fPIC",
        f"-I{cuda / 'include'}",
        str(source),
        f"-L{cuda / 'lib64'}",
        "-lcudart",
        "-o",
        str(library),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"could not build the probe allocator ({' '.join(command)}):\n{done.stderr}\n"
            "set CUDA_HOME to the CUDA toolkit (with include/cuda_runtime_api.h) or CC"
        )
    return library


def cases(torch: Any) -> dict[str, Case]:
    """The computations, each as (make inputs on the device, run on them)."""
    dev = "cuda"

    def conv_backward(dims: int, n: int, c: int, size: tuple[int, ...], dtype: Any) -> Case:
        def make() -> Sequence[Any]:
            kind = torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d
            conv = kind(c, c, 3, padding=1).to(dev, dtype)
            x = torch.randn(n, c, *size, device=dev, dtype=dtype, requires_grad=True)
            return conv, x, torch.randn(n, c, *size, device=dev, dtype=dtype)

        def run(conv: Any, x: Any, grad: Any) -> Sequence[Any]:
            return torch.autograd.grad(conv(x), [x, conv.weight, conv.bias], grad)

        return make, run

    def matmul(dtype: Any, m: int, k: int, n: int) -> Case:
        def make() -> Sequence[Any]:
            return (
                torch.randn(m, k, device=dev, dtype=dtype),
                torch.randn(k, n, device=dev, dtype=dtype),
            )

        def run(a: Any, b: Any) -> Sequence[Any]:
            return [a @ b, torch.nn.functional.linear(a, b.t())]

        return make, run

    def atomics() -> Sequence[Any]:
        src = torch.randn(1 << 22, 16, device=dev)
        return src, torch.randint(0, 1024, (1 << 22,), device=dev)

    def run_atomics(src: Any, index: Any) -> Sequence[Any]:
        out = torch.zeros(1024, 16, device=dev)
        out.index_add_(0, index, src)
        flat = torch.zeros(1024 * 16, device=dev)
        flat.scatter_add_(0, (index * 16 + 3) % (1024 * 16), src[:, 0])
        return [out, flat, torch.histc(src[:, 1], bins=256)]

    def lstm() -> Sequence[Any]:
        model = torch.nn.LSTM(512, 512, num_layers=2).to(dev)
        return model, torch.randn(64, 32, 512, device=dev, requires_grad=True)

    def run_lstm(model: Any, x: Any) -> Sequence[Any]:
        y, _ = model(x)
        return [y, *torch.autograd.grad(y.sum(), [x, *model.parameters()])]

    f32, bf16 = torch.float32, torch.bfloat16
    return {
        "conv2d_fp32_b103_c32_128": conv_backward(2, 103, 32, (128, 128), f32),
        "conv2d_fp32_b136_c96_24": conv_backward(2, 136, 96, (24, 24), f32),
        "conv3d_fp32_b113_c32_16x32x32": conv_backward(3, 113, 32, (16, 32, 32), f32),
        "conv3d_fp32_b30_c64_8x32x32": conv_backward(3, 30, 64, (8, 32, 32), f32),
        "conv3d_bf16_b151_c16_8x64x64": conv_backward(3, 151, 16, (8, 64, 64), bf16),
        "conv2d_bf16_b64_c64_64": conv_backward(2, 64, 64, (64, 64), bf16),
        "matmul_fp32_4096": matmul(f32, 4096, 4096, 4096),
        "matmul_bf16_8192": matmul(bf16, 8192, 8192, 8192),
        "matmul_fp32_splitk_64x65536x64": matmul(f32, 64, 65536, 64),
        "atomics_index_add_scatter_histc": (atomics, run_atomics),
        "cudnn_lstm_fwd_bwd": (lstm, run_lstm),
    }


def probe(library: Path, names: Sequence[str] | None) -> dict[str, Any]:
    """Runs the cases (all, or ``names``) and returns the record."""
    import torch

    from lmsbench.harness import record_environment
    from lmsbench.lms_setup import deterministic

    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(library), "probe_alloc", "probe_free")
    torch.cuda.memory.change_current_allocator(allocator)
    switch = ctypes.CDLL(str(library))
    switch.probe_host_bytes.restype = ctypes.c_size_t
    deterministic()
    every = cases(torch)
    results: dict[str, Any] = {}
    for name, (make, run) in every.items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        inputs = make()
        runs = []
        for host in (0, 1, 0):
            switch.probe_set_host(host)
            before = switch.probe_host_bytes()
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = run(*inputs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            switch.probe_set_host(0)
            host_bytes = switch.probe_host_bytes() - before
            runs.append(([t.detach().cpu() for t in out], seconds, host_bytes))
        (device_a, _, _), (on_host, host_s, host_bytes), (device_b, device_s, _) = runs
        results[name] = {
            "identical": all(torch.equal(a, b) for a, b in zip(device_b, on_host)),
            "device_repeatable": all(torch.equal(a, b) for a, b in zip(device_a, device_b)),
            "device_s": round(device_s, 4),
            "host_s": round(host_s, 4),
            "host_mib": round(host_bytes / 2**20, 1),
        }
        print(name, results[name], flush=True)
    return {
        "env": record_environment(),
        "cudnn": torch.backends.cudnn.version(),
        "results": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status 1 when a case's host run differs from its device run.",
    )
    parser.add_argument("--out", type=Path, default=Path("out/probes"), help="output folder")
    parser.add_argument(
        "--case", action="append", dest="cases", help="run only this case (repeatable)"
    )
    args = parser.parse_args(argv)
    import torch

    every = cases(torch)
    unknown = sorted(set(args.cases or ()) - set(every))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; the cases are: {', '.join(every)}")
    if not torch.cuda.is_available():
        parser.error("no CUDA device: the probe runs kernels on the GPU")
    with tempfile.TemporaryDirectory() as folder:
        record = probe(build_allocator(Path(folder)), args.cases)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "host-placed-kernels.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    differing = [n for n, r in record["results"].items() if not r["identical"]]
    total = len(record["results"])
    print(f"{total - len(differing)} of {total} identical; {path}")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
