"""Names every build and package uses: architectures, conda subdirs, version and build strings.

Pure functions of their arguments, shared by the build plan, the recipe and the conda
packaging (none of which import each other for these).
"""

from __future__ import annotations

import platform
import re

from lmstool.errors import LmsToolError
from lmstool.hints import option

ARCHES = ("x86_64", "ppc64le")
CONDA_SUBDIRS = {"x86_64": "linux-64", "ppc64le": "linux-ppc64le"}


def version_tuple(text: str) -> tuple[int, ...]:
    """``"12.4"`` -> ``(12, 4)``: versions compare as numbers, not strings."""
    return tuple(int(part) for part in re.findall(r"\d+", text))


def check_arch(arch: str) -> str:
    if arch not in ARCHES:
        raise LmsToolError(
            f"unknown architecture {arch!r}: pass {option('arch', ' or '.join(ARCHES))}"
        )
    return arch


def host_arch() -> str:
    machine = platform.machine()
    return {"amd64": "x86_64", "ppc64el": "ppc64le"}.get(machine.lower(), machine)


def cuda_tag(cuda: str) -> str:
    return "cu" + cuda.replace(".", "")


def py_tag(python: str) -> str:
    return python.replace(".", "")


def local_version(version: str, cuda: str) -> str:
    """The wheel's version: PEP 440 local version saying LMS and the CUDA it was built for."""
    return f"{version}+lms.{cuda_tag(cuda)}"


def conda_build_string(python: str, cuda: str, build_number: int) -> str:
    return f"py{py_tag(python)}_{cuda_tag(cuda)}_lms_{build_number}"
