"""Compile check of the LMS sources above c10 in a patched PyTorch tree (T1, no GPU).

Given a PyTorch source tree with the LMS series applied, this runs torchgen to produce the
ATen headers, as PyTorch's CMake build does, writes the few configuration headers CMake would
generate, and compiles the translation units the series adds or changes above c10 to object
files only: every engine translation unit outside c10/ (from the engine manifest,
lmstool.manifest: today aten/src/ATen/cuda/LmsPinning.cpp, LmsRecipes.cpp,
LmsRecipeReplay.cpp and torch/csrc/cuda/LmsBindings.cpp) and torch/csrc/cuda/Module.cpp,
torch._C's CUDA module with the LMS hunks. The c10 engine sources are built by the
standalone c10 build instead.

The LMS sources must compile without a warning of their own under -Wall -Wextra; upstream
headers are allowed theirs. Nothing is linked and no full build is started.

The CUDA toolkit on build machines may lack the math libraries' headers (cuBLAS, cuSPARSE,
cuSOLVER). ATen/cuda/CUDAContextLight.h includes them only for handle and status types, so
for each one missing the check writes a declarations-only header with those types; the real
header is used whenever the toolkit has it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from lmstool import dropin, manifest, torchwheels
from lmstool.errors import LmsToolError

log = logging.getLogger(__name__)

# Upstream translation units the series changes above c10 (not held to no warnings).
UPSTREAM_SOURCES = ("torch/csrc/cuda/Module.cpp",)


def engine_sources() -> tuple[str, ...]:
    """The engine's translation units outside c10/ (the manifest's, so new ones join)."""
    return tuple(
        p.as_posix() for p in manifest.cxx_sources() if not p.as_posix().startswith("c10/")
    )


# Translation units compiled, and whether they are LMS sources (held to no warnings).
SOURCES: tuple[tuple[str, bool], ...] = (
    *((source, True) for source in engine_sources()),
    *((source, False) for source in UPSTREAM_SOURCES),
)
# Files the series must have placed in the tree for the check to mean anything: every engine
# file, the changed upstream units and torchgen.
REQUIRED = (
    *(p.as_posix() for p in manifest.engine_files()),
    *UPSTREAM_SOURCES,
    "torchgen/gen.py",
)

# What CMake's configure_file() would write for a CUDA build without MKL/cuDNN.
CONFIG_HEADERS: dict[str, str] = {
    "c10/macros/cmake_macros.h": "#pragma once\n#define C10_BUILD_SHARED_LIBS\n",
    "c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n",
    "ATen/Config.h": """#pragma once
#define AT_MKLDNN_ENABLED() 0
#define AT_MKLDNN_ACL_ENABLED() 0
#define AT_MKL_ENABLED() 0
#define AT_MKL_SEQUENTIAL() 0
#define AT_POCKETFFT_ENABLED() 0
#define AT_NNPACK_ENABLED() 0
#define CAFFE2_STATIC_LINK_CUDA() 0
#define AT_BUILD_WITH_BLAS() 1
#define AT_BUILD_WITH_LAPACK() 1
#define AT_PARALLEL_OPENMP 1
#define AT_PARALLEL_NATIVE 0
#define AT_BLAS_F2C() 0
#define AT_BLAS_USE_CBLAS_DOT() 0
""",
    "ATen/cuda/CUDAConfig.h": """#pragma once
#define AT_CUDNN_ENABLED() 0
#define AT_CUSPARSELT_ENABLED() 0
#define AT_ROCM_ENABLED() 0
#define AT_MAGMA_ENABLED() 0
#define NVCC_FLAGS_EXTRA ""
""",
}

# Declarations-only stand-ins for math-library headers the toolkit may lack (see module doc).
_MATH_TYPES = """#pragma once
// Written by lmstool torchcheck: the CUDA toolkit here has no {header}. Declares only the
// types ATen's CUDA headers name; nothing that includes it is linked or run.
"""
MATH_HEADERS: dict[str, str] = {
    "cublas_v2.h": _MATH_TYPES
    + """typedef struct cublasContext* cublasHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;
""",
    "cublasLt.h": _MATH_TYPES
    + """#include <cublas_v2.h>
typedef struct cublasLtContext* cublasLtHandle_t;
""",
    "cusparse.h": _MATH_TYPES
    + """typedef struct cusparseContext* cusparseHandle_t;
typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;
""",
    "cusolver_common.h": _MATH_TYPES
    + """typedef enum {
  CUSOLVER_STATUS_SUCCESS = 0,
  CUSOLVER_STATUS_INVALID_VALUE = 3,
  CUSOLVER_STATUS_EXECUTION_FAILED = 6
} cusolverStatus_t;
""",
    "cusolverDn.h": _MATH_TYPES
    + """#include <cusolver_common.h>
typedef struct cusolverDnContext* cusolverDnHandle_t;
""",
}

WARNING_FLAGS = ("-Wall", "-Wextra")


@dataclass
class CompileResult:
    source: str
    own: bool
    returncode: int
    seconds: float
    output: str
    own_warnings: list[str]

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not (self.own and self.own_warnings)


def check_tree_layout(tree: Path) -> None:
    missing = [p for p in REQUIRED if not (tree / p).is_file()]
    if missing:
        raise LmsToolError(
            f"{tree} is not a PyTorch tree with the LMS series applied: missing "
            + ", ".join(missing)
            + " (python -m lmstool checkout/apply, or git am patches/<tag>/*.patch)"
        )


def pybind11_include(tree: Path) -> Path:
    bundled = tree / "third_party/pybind11/include"
    if (bundled / "pybind11/pybind11.h").is_file():
        return bundled
    try:
        import pybind11  # type: ignore[import-not-found]
    except ImportError:
        raise LmsToolError(
            "pybind11 headers not found: the tree has no third_party/pybind11 and the "
            "pybind11 package is not installed (pip install 'pybind11<3')"
        ) from None
    return Path(pybind11.get_include())


def write_config_headers(build: Path, cuda_include: Path) -> list[Path]:
    """Write CMake-generated headers and any missing math headers; return include dirs."""
    config = build / "include"
    for rel, text in CONFIG_HEADERS.items():
        # ATen's generated headers live beside torchgen's output, the rest in include/.
        dest = (build / "aten/src" / rel) if rel.startswith("ATen/") else (config / rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    dirs = [config]
    missing = {h: t for h, t in MATH_HEADERS.items() if not (cuda_include / h).is_file()}
    if missing:
        math_dir = build / "math-headers"
        math_dir.mkdir(parents=True, exist_ok=True)
        for header, text in missing.items():
            (math_dir / header).write_text(text.replace("{header}", header))
        log.info("torchcheck: toolkit lacks %s; using type declarations", ", ".join(missing))
        dirs.append(math_dir)
    return dirs


def run_torchgen(tree: Path, build: Path, python: str) -> float:
    """Generate ATen's headers (per-operator, as PyTorch's default CMake build); return seconds."""
    out = build / "aten/src/ATen"
    stamp = out / ".torchgen-headers-done"
    if stamp.is_file():
        log.info("torchcheck: torchgen headers already in %s", out)
        return 0.0
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        python,
        "-m",
        "torchgen.gen",
        "--source-path",
        str(tree / "aten/src/ATen"),
        "--install_dir",
        str(out),
        "--per-operator-headers",
        "--generate",
        "headers",
    ]
    log.info("torchcheck: %s", " ".join(cmd))
    start = time.monotonic()
    # cwd=tree: the tree's own torchgen, not one an installed torch wheel may carry.
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LmsToolError(f"torchgen failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    stamp.write_text("")
    return time.monotonic() - start


def compile_command(
    tree: Path, build: Path, source: str, cxx: str, include_dirs: list[Path], cuda_include: Path
) -> list[str]:
    obj = build / "obj" / (source.replace("/", "_") + ".o")
    obj.parent.mkdir(parents=True, exist_ok=True)
    python_include = sysconfig.get_paths()["include"]
    defines = ["-DUSE_CUDA"]
    if source.startswith("aten/"):
        defines += ["-DTORCH_CUDA_BUILD_MAIN_LIB", "-DTORCH_CUDA_CPP_BUILD_MAIN_LIB"]
    else:
        defines += ["-DTHP_BUILD_MAIN_LIB"]
    cmd = [cxx, "-std=c++17", "-fPIC", "-O1", *WARNING_FLAGS, *defines, "-c", str(tree / source)]
    cmd += ["-o", str(obj)]
    for inc in (tree, tree / "aten/src", build / "aten/src", tree / "torch/csrc/api/include"):
        cmd += ["-I", str(inc)]
    for inc in include_dirs:
        cmd += ["-I", str(inc)]
    for inc in (pybind11_include(tree), Path(python_include), cuda_include):
        cmd += ["-isystem", str(inc)]
    return cmd


def _compile(cmd: list[str], source: str, own: bool) -> CompileResult:
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    name = Path(source).name
    own_warnings = [
        line
        for line in proc.stderr.splitlines()
        if ("warning:" in line or "error:" in line) and name in line.split(":", 1)[0]
    ]
    return CompileResult(source, own, proc.returncode, seconds, proc.stderr, own_warnings)


def check(
    tree: Path,
    build: Path,
    *,
    cuda_home: Path = Path("/usr/local/cuda"),
    cxx: str | None = None,
    jobs: int = 2,
    python: str = sys.executable,
    sources: tuple[tuple[str, bool], ...] = SOURCES,
) -> list[CompileResult]:
    """Run torchgen and compile `sources` of `tree` into `build`; return one result each."""
    tree = tree.resolve()
    build = build.resolve()
    check_tree_layout(tree)
    cuda_include = cuda_home / "include"
    if not (cuda_include / "cuda_runtime_api.h").is_file():
        raise LmsToolError(f"no CUDA toolkit at {cuda_home} (pass --cuda-home)")
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or "c++"
    seconds = run_torchgen(tree, build, python)
    if seconds:
        log.info("torchcheck: torchgen took %.1f s", seconds)
    include_dirs = write_config_headers(build, cuda_include)
    commands = [
        (compile_command(tree, build, src, cxx, include_dirs, cuda_include), src, own)
        for src, own in sources
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda c: _compile(*c), commands))


def report(results: list[CompileResult]) -> bool:
    ok = True
    for r in results:
        status = "ok" if r.ok else "FAILED"
        print(f"torchcheck: {r.source}: {status} ({r.seconds:.1f} s)")
        if r.returncode != 0:
            ok = False
            print(r.output[-8000:])
        elif r.own and r.own_warnings:
            ok = False
            print("\n".join(r.own_warnings))
    return ok


# --------------------------------------------------------------------------------------------
# The drop-in extension against each supported torch release's own headers


@dataclass
class DropinCheck:
    """The syntax check of the drop-in's sources against one torch release's wheel."""

    release: str
    wheel: str  # the wheel's file name, or why there is none
    standard: int
    results: list[dropin.CompileResult]
    missing: str = ""  # why the release was not checked (no wheel and no downloads)

    @property
    def ok(self) -> bool:
        return not self.missing and all(r.ok for r in self.results)


def check_dropin(
    releases: list[str],
    *,
    cache: Path | None = None,
    allow_download: bool = True,
    cuda_home: Path = Path("/usr/local/cuda"),
    cxx: str | None = None,
    jobs: int = 2,
) -> list[DropinCheck]:
    """Check that every source of the drop-in compiles (-fsyntax-only, -Wall -Wextra -Werror)
    against each release's own wheel headers, with the C++ standard that wheel's
    TorchConfig.cmake names. A CPU wheel of a release serves as well as a CUDA one (same
    headers but the generated cuda_cmake_macros.h). The wheel comes from the cache, from a
    folder pip is configured with, or is downloaded once (``allow_download``)."""
    cache = cache or torchwheels.default_cache()
    cuda_include = cuda_home / "include"
    if not (cuda_include / "cuda_runtime_api.h").is_file():
        raise LmsToolError(f"no CUDA toolkit at {cuda_home} (pass --cuda-home)")
    python = dropin.python_target()
    cxx = cxx or dropin.default_cxx()
    checks = []
    for release in releases:
        try:
            wheel = torchwheels.locate(
                release, None, cache=cache, allow_download=allow_download, allow_cpu=True
            )
        except LmsToolError as exc:
            if allow_download:
                raise
            checks.append(DropinCheck(release, "", 0, [], missing=str(exc)))
            continue
        root = torchwheels.unpack(wheel, cache / "unpacked", libraries=False)
        extra = dropin.cuda_macros_dir(root, root / "generated")
        flags = dropin.compile_flags(
            root, wheel.cxx_standard, python, cuda_include, extra_includes=extra, werror=True
        )
        results = dropin.compile_all(dropin.sources(), flags, obj_dir=None, cxx=cxx, jobs=jobs)
        checks.append(DropinCheck(release, wheel.path.name, wheel.cxx_standard, results))
    return checks


def report_dropin(checks: list[DropinCheck]) -> bool:
    ok = True
    for check in checks:
        if check.missing:
            ok = False
            print(f"torchcheck: drop-in on torch {check.release}: NOT CHECKED: {check.missing}")
            continue
        seconds = sum(r.seconds for r in check.results)
        status = "ok" if check.ok else "FAILED"
        print(
            f"torchcheck: drop-in on torch {check.release} ({check.wheel}, "
            f"C++{check.standard}): {len(check.results)} sources {status} ({seconds:.1f} s)"
        )
        if not check.ok:
            ok = False
            print(dropin.failures(check.results))
    return ok
