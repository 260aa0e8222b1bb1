"""The T1 compile check of the LMS sources above c10 (lmstool torchcheck).

The slow test runs once per tag with a series (config/tags.yaml): it applies the generated
series to a pristine checkout of the tag's tarball, runs torchgen and compiles
aten/src/ATen/cuda/LmsPinning.cpp, torch/csrc/cuda/LmsBindings.cpp and
torch/csrc/cuda/Module.cpp to object files (a few minutes on two cores; never a full build).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmstool import torchcheck
from lmstool.matrix import load_matrix

REPO = Path(__file__).resolve().parents[2]
MATRIX = load_matrix(REPO)
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def missing_headers() -> list[str]:
    """System headers the compile check needs that this host lacks (Debian package names)."""
    dirs = [Path("/usr/include"), Path("/usr/local/include")]
    dirs += [Path(p) for p in os.environ.get("CPATH", "").split(os.pathsep) if p]
    wanted = {"fmt/core.h": "libfmt-dev"}
    return [pkg for header, pkg in wanted.items() if not any((d / header).is_file() for d in dirs)]


def sources_dir(tarball: str) -> Path | None:
    """The folder of release tarballs ($LMS_SOURCES, `make test SOURCES=DIR` sets it), when it
    holds `tarball`."""
    env = os.environ.get("LMS_SOURCES", "").strip()
    return Path(env) if env and (Path(env) / tarball).is_file() else None


def test_own_warnings_fail_the_check(tmp_path: Path) -> None:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    src = tmp_path / "LmsPinning.cpp"
    src.write_text("int f(int unused) { int x; return 1; }\n")
    cmd = [cxx, *torchcheck.WARNING_FLAGS, "-c", str(src), "-o", str(tmp_path / "a.o")]
    result = torchcheck._compile(cmd, "aten/src/ATen/cuda/LmsPinning.cpp", own=True)
    assert result.returncode == 0
    assert result.own_warnings and not result.ok
    # The same warnings in an upstream file are tolerated.
    upstream = torchcheck._compile(cmd, "aten/src/ATen/cuda/LmsPinning.cpp", own=False)
    assert upstream.ok
    src.write_text("int f() { return 1; }\n")
    assert torchcheck._compile(cmd, "aten/src/ATen/cuda/LmsPinning.cpp", own=True).ok


def test_sources_come_from_the_engine_manifest() -> None:
    own = [source for source, is_own in torchcheck.SOURCES if is_own]
    assert own == list(torchcheck.engine_sources())
    assert "aten/src/ATen/cuda/LmsPinning.cpp" in own
    assert "torch/csrc/cuda/LmsBindings.cpp" in own
    assert all(not s.startswith("c10/") for s in own)
    assert "c10/cuda/LargeModelSupport.h" in torchcheck.REQUIRED
    assert "test/test_cuda_lms.py" in torchcheck.REQUIRED


def test_tree_without_series_is_refused(tmp_path: Path) -> None:
    (tmp_path / "torch/csrc/cuda").mkdir(parents=True)
    (tmp_path / "torch/csrc/cuda/Module.cpp").write_text("")
    with pytest.raises(torchcheck.LmsToolError, match=r"LargeModelSupport\.h"):
        torchcheck.check_tree_layout(tmp_path)


def test_math_headers_only_where_missing(tmp_path: Path) -> None:
    cuda_include = tmp_path / "cuda/include"
    cuda_include.mkdir(parents=True)
    (cuda_include / "cusparse.h").write_text("// real\n")
    dirs = torchcheck.write_config_headers(tmp_path / "build", cuda_include)
    math_dir = tmp_path / "build/math-headers"
    assert math_dir in dirs
    assert not (math_dir / "cusparse.h").exists()
    assert "cublasHandle_t" in (math_dir / "cublas_v2.h").read_text()
    assert (tmp_path / "build/aten/src/ATen/cuda/CUDAConfig.h").is_file()
    assert (tmp_path / "build/include/c10/macros/cmake_macros.h").is_file()


def lmstool(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmstool", *args], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"lmstool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("tag", [t.name for t in MATRIX.tags_with_series()])
def test_patched_tag_compiles(tag: str, tmp_path: Path) -> None:
    tarball = MATRIX.get_tag(tag).source.tarballs[0].name
    sources = sources_dir(tarball)
    if sources is None:
        pytest.skip(
            f"needs {tarball} for {tag}: `make test SOURCES=DIR` (or $LMS_SOURCES) with its folder"
        )
    if not (CUDA_HOME / "include/cuda_runtime_api.h").is_file():
        pytest.skip(f"needs the CUDA toolkit at {CUDA_HOME} (or $CUDA_HOME)")
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    missing = missing_headers()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (c10's headers include fmt): make deps")
    for module, why in (("pybind11", "pip install 'pybind11<3'"), ("yaml", "torchgen needs it")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the {module} package ({why})")

    series = tmp_path / "series"
    tree = tmp_path / "pytorch"
    lmstool("patches", tag, "--to", str(series), "--sources", str(sources))
    lmstool("checkout", tag, "--dest", str(tree), "--sources", str(sources))
    lmstool("apply", tag, "--tree", str(tree), "--series", str(series))

    results = torchcheck.check(tree, tmp_path / "build", cuda_home=CUDA_HOME, jobs=2)
    assert [r.source for r in results] == [s for s, _ in torchcheck.SOURCES]
    failures = [f"{r.source}:\n{r.output[-6000:]}" for r in results if not r.ok]
    assert not failures, "\n\n".join(failures)
    for r in results:
        obj = tmp_path / "build/obj" / (r.source.replace("/", "_") + ".o")
        assert obj.is_file() and obj.stat().st_size > 0
