"""Fixtures for the engine tier (T1): libc10 + libc10_cuda built from the patched v2.6.0 source
against the simulated GPU, and the engine suite linked against them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = "v2.6.0"
TARBALL = "pytorch_2.6.0+dfsg.orig.tar.xz"
# Kept between runs so ninja and ccache only redo what changed.
WORK = REPO / "work" / "ci"


def sources_dir() -> Path | None:
    """The folder of release tarballs: $LMS_SOURCES (`make test SOURCES=DIR` sets it)."""
    env = os.environ.get("LMS_SOURCES", "").strip()
    return Path(env) if env and (Path(env) / TARBALL).is_file() else None


def missing_build_tools() -> list[str]:
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (cuda_home / "include" / "cuda_runtime_api.h").is_file():
        missing.append(f"CUDA toolkit headers in {cuda_home}/include")
    carry = (REPO / ".carry").is_dir()
    if not Path("/usr/include/fmt/format.h").is_file() and not carry:
        missing.append("libfmt-dev (or a .carry folder from scripts/prepare-carry.sh)")
    if not Path("/usr/include/cpuinfo.h").is_file() and not carry:
        missing.append("libcpuinfo-dev (or a .carry folder from scripts/prepare-carry.sh)")
    nvml = (cuda_home / "include" / "nvml.h").is_file() or any(
        next((Path(base) / "nvidia").glob("*/include/nvml.h"), None) is not None
        for base in sys.path
        if base
    )
    if not nvml and not (REPO / ".carry" / "nvml").is_dir():
        missing.append("nvml.h (pip install nvidia-nvml-dev)")
    return missing


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"{proc.stdout[-8000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def patched_tree() -> Path:
    """A checkout of v2.6.0 with the committed series applied."""
    sources = sources_dir()
    if sources is None:
        pytest.skip(f"needs {TARBALL}: `make test SOURCES=DIR` (or $LMS_SOURCES) with its folder")
    tree = WORK / f"pytorch-{TAG}-engine"
    if tree.exists():
        shutil.rmtree(tree)
    tree.parent.mkdir(parents=True, exist_ok=True)
    lmstool = [sys.executable, "-m", "lmstool"]
    run([*lmstool, "checkout", TAG, "--dest", str(tree), "--sources", str(sources)])
    run([*lmstool, "apply", TAG, "--tree", str(tree)])
    return tree


@pytest.fixture(scope="session")
def sim_build(patched_tree: Path) -> Path:
    """The standalone build of the patched tree, linked to the simulated GPU."""
    missing = missing_build_tools()
    if missing:
        pytest.skip("the C++ build needs: " + ", ".join(missing))
    build = WORK / "engine-sim"
    run(
        [
            "bash",
            str(REPO / "standalone" / "build.sh"),
            "--source",
            str(patched_tree),
            "--build",
            str(build),
            "--runtime",
            "sim",
        ],
        timeout=3600,
        # nvml.h may come from the nvidia-nvml-dev wheel in this environment.
        env={**os.environ, "PYTHON": sys.executable},
    )
    return build
