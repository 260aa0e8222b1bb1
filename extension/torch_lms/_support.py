"""The torch releases torch_lms supports, how its packages are named, and the import check.

Standard library only: ``extension/setup.py`` (before torch is known to be usable),
``lmstool dropin`` (which builds for a torch it never imports) and the installed package all
read this one file.

The extension reaches into c10's allocator interface (``CUDAAllocator``'s virtual functions,
``StorageImpl``), which PyTorch does not keep stable between releases, so a build runs only
on the torch release it was compiled against, and only with that CUDA major version (its
module links ``libcudart.so.<major>``). A prebuilt package therefore exists per torch release
and CUDA major, and its version says which torch it is for: ``torch-lms`` ``2.11.0.1`` is
drop-in release 1 built for torch 2.11.0; its wheel carries ``+cu130`` and requires
``torch==2.11.0``.
"""

from __future__ import annotations

import re

# Distribution name of the drop-in (the import name is torch_lms).
DIST_NAME = "torch-lms"
# torch minor releases the sources compile against and are checked for (lmstool torchcheck
# --dropin); every patch release of each is built and checked against its own wheel.
SUPPORTED_MINORS = ("2.11", "2.12", "2.13", "2.14")
# The drop-in's own release number: the fourth part of a package version. Raise it when a
# package for the same torch release must replace one already handed out.
SERIAL = 1

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def release(version: str) -> str:
    """``2.11.0+cu130`` -> ``2.11.0`` (also ``2.12.0a0+git...`` -> ``2.12.0``)."""
    match = _RELEASE.match(version.strip())
    if match is None:
        raise ValueError(f"{version!r} is not a torch version (X.Y.Z)")
    return ".".join(match.groups())


def minor(version: str) -> str:
    return ".".join(release(version).split(".")[:2])


def supported_text() -> str:
    """``2.11, 2.12, 2.13 and 2.14``."""
    *head, last = SUPPORTED_MINORS
    return f"{', '.join(head)} and {last}" if head else last


def is_supported(version: str) -> bool:
    try:
        return minor(version) in SUPPORTED_MINORS
    except ValueError:
        return False


def unsupported_message(version: str) -> str:
    return (
        f"torch_lms supports torch {supported_text()}; torch {version} is not one of them: "
        f"install one of those torch releases (for example "
        f'pip install "torch=={SUPPORTED_MINORS[-1]}.*")'
    )


def cuda_major(cuda: str | None) -> str | None:
    """``13.0`` -> ``13``; None (a CPU build) stays None."""
    return cuda.split(".")[0] if cuda else None


def cuda_label(cuda: str) -> str:
    """The local version label of a build for CUDA ``cuda``: ``13.0`` -> ``cu130``, as torch's."""
    parts = cuda.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        raise ValueError(f"{cuda!r} is not a CUDA version (X.Y)")
    return f"cu{parts[0]}{parts[1]}"


def package_version(torch_version: str, serial: int = SERIAL) -> str:
    """The public version of the package built for ``torch_version``: ``2.11.0.1``."""
    return f"{release(torch_version)}.{serial}"


def install_hint(torch_version: str, cuda: str | None) -> str:
    """How to install the prebuilt package that fits ``torch_version`` with ``cuda``."""
    spec = f"{release(torch_version)}.*"
    folder = f"DIR/{cuda_label(cuda)}" if cuda else "DIR"
    return (
        f'pip install --no-index --find-links {folder} "{DIST_NAME}=={spec}" (the folder of '
        f"prebuilt wheels for CUDA {cuda_major(cuda)}), or "
        f'conda install -c CHANNEL "{DIST_NAME} {spec}"'
    )


def mismatch(built_torch: str, built_cuda: str, torch_version: str, torch_cuda: str | None) -> str:
    """Why a build for torch ``built_torch`` with CUDA ``built_cuda`` cannot load into torch
    ``torch_version`` built with CUDA ``torch_cuda``; empty when it can."""
    if release(built_torch) == release(torch_version) and cuda_major(built_cuda) == cuda_major(
        torch_cuda
    ):
        return ""
    head = (
        f"torch_lms: this package was built for torch {release(built_torch)} with CUDA "
        f"{cuda_major(built_cuda)}, and torch {torch_version} (CUDA "
        f"{cuda_major(torch_cuda) or 'none'}) is installed"
    )
    if torch_cuda is None:
        return f"{head}; Large Model Support needs a CUDA build of torch"
    if not is_supported(torch_version):
        return f"{head}. {unsupported_message(torch_version)}"
    return (
        f"{head}. Install the package built for this torch: "
        f"{install_hint(torch_version, torch_cuda)}; or build it from source against this "
        "torch (pip install --no-build-isolation ./extension, in a project checkout)"
    )
