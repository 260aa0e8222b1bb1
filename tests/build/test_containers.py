"""Build containers and the Makefile fragment agree with the tag matrix (no docker needed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmstool import build


def dockerfile(repo: Path, arch: str) -> dict[str, str]:
    text = (repo / "recipes" / "containers" / f"Dockerfile.{arch}").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    args["FROM"] = re.search(r"^FROM (\S+)", text, flags=re.M).group(1)  # type: ignore[union-attr]
    args["text"] = text
    return args


@pytest.mark.parametrize("arch", build.ARCHES)
def test_dockerfile_versions_match_matrix(repo: Path, matrix: build.BuildMatrix, arch: str) -> None:
    args = dockerfile(repo, arch)
    tag = matrix.default_tag
    cuda = ".".join(args["CUDA_VERSION"].split(".")[:2])
    assert cuda in matrix.cudas(tag, arch), f"Dockerfile.{arch} CUDA {cuda} is not supported"
    image = matrix.toolchain["images"][arch]
    assert cuda == image["cuda"]
    assert args["FROM"] == "nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubi8"
    if arch == "ppc64le":
        assert build.version_tuple(cuda) <= build.version_tuple(matrix.ppc64le_max_cuda())
    assert args["PYTHON_VERSION"] in matrix.pythons(tag)
    assert args["PYTHON_VERSION"] == image["python"]
    gcc = int(args["GCC_TOOLSET"])
    assert gcc == image["gcc_toolset"]
    tool = matrix.tag_toolchain(tag)["gcc"]
    assert tool["min"] <= gcc <= min(tool["max"], matrix.cuda_info(cuda)["max_gcc"])
    # UBI 8 has glibc 2.28: the wheel repair target must say so.
    assert matrix.toolchain["manylinux"][arch] == f"manylinux_2_28_{arch}"
    assert f"ARCH={arch} CUDA={cuda}" in args["text"]


def test_every_supported_cuda_has_toolchain_facts(matrix: build.BuildMatrix) -> None:
    for tag in matrix.tags:
        assert matrix.tag_toolchain(tag)["gcc"]["min"] >= 5
        for arch in build.ARCHES:
            for cuda in matrix.cudas(tag, arch):
                info = matrix.cuda_info(cuda)
                assert arch in info["arch_list"], f"no TORCH_CUDA_ARCH_LIST for {arch} CUDA {cuda}"
                if arch == "ppc64le":
                    assert build.version_tuple(cuda) <= build.version_tuple("12.4")


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_fragment_passes_variables(repo: Path) -> None:
    done = subprocess.run(
        [
            "make",
            "-n",
            "-f",
            "mk/build.mk",
            "build",
            "PY=python3",
            "TAG=v2.6.0",
            "ARCH=ppc64le",
            "CUDA=12.4",
            "PYTHON=3.12",
            "SOURCES=/src",
            "WORK=/w",
            "MAX_JOBS=4",
            "DRY_RUN=1",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    words = done.stdout.split()
    assert words[:4] == ["python3", "-m", "lmstool", "build"]
    line = " ".join(words)
    for part in (
        "v2.6.0",
        "--work /w",
        "--arch ppc64le",
        "--cuda 12.4",
        "--python 3.12",
        "--sources /src",
        "--max-jobs 4",
        "--dry-run",
    ):
        assert part in line
    assert "--skip-tests" not in line and "--preflight" not in line
    done = subprocess.run(
        ["make", "-n", "-f", "mk/build.mk", "channel", "PY=python3", "WORK=/w"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["python3", "-m", "lmstool", "channel", "index", "/w/channel"]
