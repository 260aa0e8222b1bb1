"""Fixtures for the engine tier (T1): libc10 + libc10_cuda built from each tag's patched source
against the simulated GPU, and the engine suite linked against them.

The tags are those of config/tags.yaml with a series (lmstool.matrix): every engine test runs
once per tag, against one build of that tag's c10 shared by all of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmstool.matrix import TagConfig, load_matrix

REPO = Path(__file__).resolve().parents[2]

# Kept between runs so ninja and ccache only redo what changed.
WORK = REPO / "work" / "ci"
TAGS = {tag.name: tag for tag in load_matrix(REPO).tags_with_series()}


def tarball(tag: TagConfig) -> str:
    return tag.source.tarballs[0].name


def sources_dir(tag: TagConfig) -> Path | None:
    """The folder of release tarballs ($LMS_SOURCES, `make test SOURCES=DIR` sets it), when it
    holds the tag's tarball."""
    env = os.environ.get("LMS_SOURCES", "").strip()
    return Path(env) if env and (Path(env) / tarball(tag)).is_file() else None


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


@pytest.fixture(autouse=True)
def private_host_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The ledgers of pinned host memory and of device memory that the programs a test runs
    share: files of the test's own, not the user's in /dev/shm, which every LMS process of the
    user shares."""
    ledger = tmp_path / "host-ledger"
    monkeypatch.setenv("PYTORCH_LMS_HOST_LEDGER", str(ledger))
    # Likewise the ledgers of device memory (a path prefix: one file per GPU).
    monkeypatch.setenv("PYTORCH_LMS_DEVICE_LEDGER", str(tmp_path / "device-ledger"))
    return ledger


@pytest.fixture(scope="session", params=sorted(TAGS))
def engine_tag(request: pytest.FixtureRequest) -> TagConfig:
    """Each tag with a series, in turn."""
    return TAGS[request.param]


@pytest.fixture(scope="session")
def patched_tree(engine_tag: TagConfig) -> Path:
    """A checkout of the tag with its committed series applied."""
    tag = engine_tag.name
    sources = sources_dir(engine_tag)
    if sources is None:
        pytest.skip(
            f"needs {tarball(engine_tag)} for {tag}: `make test SOURCES=DIR` (or $LMS_SOURCES) "
            "with its folder"
        )
    tree = WORK / f"pytorch-{tag}-engine"
    if tree.exists():
        shutil.rmtree(tree)
    tree.parent.mkdir(parents=True, exist_ok=True)
    lmstool = [sys.executable, "-m", "lmstool"]
    run([*lmstool, "checkout", tag, "--dest", str(tree), "--sources", str(sources)])
    run([*lmstool, "apply", tag, "--tree", str(tree)])
    return tree


@pytest.fixture(scope="session")
def sim_build(engine_tag: TagConfig, patched_tree: Path) -> Path:
    """The standalone build of the tag's patched tree, linked to the simulated GPU."""
    missing = missing_build_tools()
    if missing:
        pytest.skip("the C++ build needs: " + ", ".join(missing))
    build = WORK / f"engine-sim-{engine_tag.name}"
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
