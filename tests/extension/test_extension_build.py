"""Checks of the torch_lms extension that need no GPU.

The compile check builds every C++ source of the extension (the shared engine, pinning and
binding sources and the extension's own) to object files, without linking, against the
installed torch's headers and the CUDA runtime headers, with -Wall -Wextra -Werror (torch's
headers are system headers). It runs against a CPU wheel too: only the generated
c10/cuda/impl/cuda_cmake_macros.h, which CPU wheels lack, is supplied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lmstool import manifest

REPO = Path(__file__).resolve().parents[2]
EXTENSION = REPO / "extension"
ENGINE = REPO / "engine"

# The engine's translation units come from the one manifest, as in extension/setup.py.
SOURCES = [
    *(ENGINE / rel for rel in manifest.cxx_sources(ENGINE)),
    EXTENSION / "csrc/StockAllocatorBackend.cpp",
    EXTENSION / "csrc/Module.cpp",
]


def _cuda_include() -> Path | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "include" / "cuda_runtime_api.h").is_file():
            return Path(candidate) / "include"
    return None


@pytest.mark.slow
def test_extension_compiles_against_installed_torch(tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.cpp_extension", reason="PyTorch is not installed")
    import torch

    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or $CXX) on PATH")
    cuda_include = _cuda_include()
    if cuda_include is None:
        pytest.skip("CUDA runtime headers not found (set CUDA_HOME)")

    from torch.utils.cpp_extension import include_paths

    generated = tmp_path / "generated"
    macros = Path(torch.__file__).parent / "include/c10/cuda/impl/cuda_cmake_macros.h"
    if not macros.is_file():  # CPU wheels ship c10/cuda headers without it
        target = generated / "c10/cuda/impl/cuda_cmake_macros.h"
        target.parent.mkdir(parents=True)
        target.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [
        # TorchVersion compares as a version, not as a string.
        "-std=c++20" if torch.__version__ >= "2.10" else "-std=c++17",
        "-fPIC",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_EXTENSION_NAME=_C",
        f"-I{ENGINE}",
        f"-I{ENGINE / 'aten/src'}",
    ]
    for path in [*include_paths(), str(generated), str(cuda_include)]:
        flags += ["-isystem", str(path)]
    flags += ["-isystem", sysconfig.get_paths()["include"]]

    def compile_one(source: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
        obj = tmp_path / (source.stem + ".o")
        cmd = [cxx, *flags, "-c", str(source), "-o", str(obj)]
        return source, subprocess.run(cmd, capture_output=True, text=True, check=False)

    jobs = max(1, min(2, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(compile_one, SOURCES))
    failures = [
        f"{src.relative_to(REPO)}:\n{proc.stderr[-4000:]}"
        for src, proc in results
        if proc.returncode
    ]
    assert not failures, "\n\n".join(failures)
    for source in SOURCES:
        assert (tmp_path / (source.stem + ".o")).stat().st_size > 0


def test_import_refuses_torch_without_cuda() -> None:
    pytest.importorskip("torch.version", reason="PyTorch is not installed")
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        pytest.skip("this torch has CUDA and a GPU: the refusal applies to CPU-only setups")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXTENSION), *sys.path]))
    proc = subprocess.run(
        [sys.executable, "-c", "import torch_lms"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode != 0
    assert "ImportError: torch_lms:" in proc.stderr
    assert "CUDA" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("release", ["2.11.0", "2.12.1", "2.13.0", "2.14.1"])
def test_extension_compiles_against_each_supported_torch(release: str, tmp_path: Path) -> None:
    """Every source of the drop-in against the release's own wheel headers and C++ standard
    (lmstool torchcheck --dropin). The wheel is taken from the cache ($LMS_TORCH_WHEELS) or a
    folder pip is configured with, else downloaded once (about 530 MB, half a minute here);
    LMS_TORCH_DOWNLOAD=0 forbids that and skips, naming the command that checks it."""
    from lmstool import dropin, torchcheck

    assert release in dropin.newest_per_minor()
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler (g++ or $CXX) on PATH")
    cuda_include = _cuda_include()
    if cuda_include is None:
        pytest.skip("CUDA runtime headers not found (set CUDA_HOME)")
    allow = os.environ.get("LMS_TORCH_DOWNLOAD", "1") != "0"
    (check,) = torchcheck.check_dropin(
        [release], allow_download=allow, cuda_home=cuda_include.parent
    )
    if check.missing:
        pytest.skip(
            f"torch {release} not checked: {check.missing}; run "
            f"`python -m lmstool torchcheck --dropin --torch {release}`"
        )
    assert check.ok, dropin.failures(check.results)
    assert check.standard == (17 if release == "2.11.0" else 20)
