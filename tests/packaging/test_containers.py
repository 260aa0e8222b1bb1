"""Build containers and the Makefile fragment agree with the tag matrix (no docker needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmstool import naming
from lmstool.matrix import Matrix


def dockerfile(repo: Path, arch: str) -> dict[str, str]:
    text = (repo / "recipes" / "containers" / f"Dockerfile.{arch}").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    args["FROM"] = re.search(r"^FROM (\S+)", text, flags=re.M).group(1)  # type: ignore[union-attr]
    args["text"] = text
    return args


@pytest.mark.parametrize("arch", naming.ARCHES)
def test_dockerfile_versions_match_matrix(repo: Path, matrix: Matrix, arch: str) -> None:
    args = dockerfile(repo, arch)
    tag = matrix.default_tag
    cuda = ".".join(args["CUDA_VERSION"].split(".")[:2])
    assert cuda in matrix.get_tag(tag).cudas(arch), (
        f"Dockerfile.{arch} CUDA {cuda} is not supported"
    )
    image = matrix.toolchain.images[arch]
    assert cuda == image.cuda
    assert args["FROM"] == "nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubi8"
    if arch == "ppc64le":
        assert naming.version_tuple(cuda) <= naming.version_tuple(matrix.toolchain.ppc64le_max_cuda)
    assert args["PYTHON_VERSION"] in matrix.get_tag(tag).python
    assert args["PYTHON_VERSION"] == image.python
    gcc = int(args["GCC_TOOLSET"])
    assert gcc == image.gcc_toolset
    tool = matrix.get_tag(tag).gcc
    assert tool is not None
    assert tool.min <= gcc <= min(tool.max, matrix.cuda_info(cuda).max_gcc)
    # UBI 8 has glibc 2.28: the wheel repair target must say so.
    assert matrix.toolchain.manylinux[arch] == f"manylinux_2_28_{arch}"
    assert f"ARCH={arch} CUDA={cuda}" in args["text"]


def test_every_supported_cuda_has_toolchain_facts(matrix: Matrix) -> None:
    for tag in matrix.tags.values():
        assert tag.gcc is not None and tag.gcc.min >= 5
        for arch in naming.ARCHES:
            for cuda in tag.cudas(arch):
                info = matrix.cuda_info(cuda)
                assert arch in info.arch_list, f"no TORCH_CUDA_ARCH_LIST for {arch} CUDA {cuda}"
                if arch == "ppc64le":
                    assert naming.version_tuple(cuda) <= naming.version_tuple("12.4")


def _make_lines(repo: Path, *args: str) -> list[list[str]]:
    """The words of each lmstool command line `make -n ARGS` prints (recipe lines of the
    prerequisites, such as creating the virtual environment, are left out)."""
    # A clean environment: under `make test SOURCES=...` the outer make passes its command-line
    # variables down through MAKEFLAGS, and the Makefile reads its variables from the
    # environment too.
    skip = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "SOURCES", "REMOTE", "MIRROR"}
    skip |= {"TAG", "WORK", "ARCH", "CUDA", "PYTHON", "PYTHON_EXE", "MAX_JOBS", "DRY_RUN"}
    env = {k: v for k, v in os.environ.items() if k not in skip}
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.split() for line in done.stdout.splitlines() if " -m lmstool " in line]


def _make_dry_run(repo: Path, *args: str) -> list[str]:
    lines = _make_lines(repo, *args)
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_build_passes_variables(repo: Path) -> None:
    words = _make_dry_run(
        repo,
        "build",
        "PY=python3",
        "TAG=v2.6.0",
        "ARCH=ppc64le",
        "CUDA=12.4",
        "PYTHON=3.12",
        "PYTHON_EXE=/opt/py312/bin/python3",
        "SOURCES=/src",
        "WORK=/w",
        "MAX_JOBS=4",
        "DRY_RUN=1",
    )
    # Errors from make targets name make variables: lmstool is told it runs under make.
    assert words[:5] == ["LMSTOOL_FRONTEND=make", "python3", "-m", "lmstool", "build"]
    line = " ".join(words)
    for part in (
        "v2.6.0",
        "--work /w",
        "--arch ppc64le",
        "--cuda 12.4",
        "--python 3.12",
        "--python-exe /opt/py312/bin/python3",
        "--sources /src",
        "--max-jobs 4",
        "--dry-run",
    ):
        assert part in line
    assert "--skip-tests" not in line and "--preflight" not in line
    assert "--remote" not in line and "--mirror" not in line
    # No SOURCES: the default source is GitHub (no --sources at all).
    words = _make_dry_run(repo, "build", "PY=python3", "TAG=v2.6.0", "DRY_RUN=1")
    assert "--sources" not in words
    words = _make_dry_run(repo, "build", "PY=python3", "MIRROR=/m", "DRY_RUN=1")
    assert " ".join(words).endswith("--mirror /m --dry-run")
    words = _make_dry_run(repo, "channel", "PY=python3", "WORK=/w")
    assert words == [
        "LMSTOOL_FRONTEND=make", "python3", "-m", "lmstool", "channel", "index", "/w/channel"
    ]  # fmt: skip
    words = _make_dry_run(repo, "channel", "PY=python3", "CHANNEL=/c")
    assert words[-1] == "/c"


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_channel_says_channel_names_the_folder(repo: Path) -> None:
    """`make help` and `make channel` name CHANNEL=."""
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "CHANNEL"}}
    run = ["make", "-n", "--no-print-directory", "channel", "PY=python3", "WORK=/w"]
    out = subprocess.run(run, cwd=repo, env=env, capture_output=True, text=True, check=True)
    assert "make channel: indexing /w/channel (CHANNEL=DIR indexes another folder)" in out.stdout
    makefile = (repo / "mk" / "build.mk").read_text()
    help_line = next(line for line in makefile.splitlines() if line.startswith("channel:"))
    assert "CHANNEL=DIR" in help_line


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_patch_defaults_to_github(repo: Path) -> None:
    checkout, apply = _make_lines(repo, "patch", "PY=python3", "TAG=v2.6.0")
    assert checkout[:5] == ["LMSTOOL_FRONTEND=make", "python3", "-m", "lmstool", "checkout"]
    assert "--require-series" in checkout
    assert "--sources" not in checkout and "--remote" not in checkout
    assert apply[4:] == ["apply", "v2.6.0", "--tree", "work/pytorch-v2.6.0"]
    checkout, _ = _make_lines(repo, "patch", "PY=python3", "SOURCES=../shared/sources")
    assert checkout[-2:] == ["--sources", "../shared/sources"]
    checkout, _ = _make_lines(repo, "patch", "PY=python3", "REMOTE=file:///m.git")
    assert checkout[-2:] == ["--remote", "file:///m.git"]
    checkout, _ = _make_lines(repo, "patch", "PY=python3", "SOURCES=", "WORK=/w")
    assert "--sources" not in checkout and checkout[-2:] == ["--dest", "/w/pytorch-v2.6.0"]
