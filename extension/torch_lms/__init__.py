"""Large Model Support for a stock PyTorch wheel.

``import torch_lms`` gives an installed CUDA build of PyTorch the ``torch.cuda`` Large Model
Support API of a patched build (``torch.cuda.set_enabled_lms`` and friends): inactive tensors
are swapped to pinned host memory so models larger than GPU memory train unchanged.

Where the extension differs from a patched build is described in the package's README.md.
Settings come from the ``PYTORCH_LMS_CONF`` environment variable (same keys and syntax as the
patched build's ``PYTORCH_CUDA_ALLOC_CONF`` LMS options, e.g. ``lms:True,lms_limit_mb:8192``).
"""

from __future__ import annotations

import torch

from torch_lms import _support


def _check_torch() -> None:
    if hasattr(torch._C, "_cuda_lms_setEnabled"):
        raise ImportError(
            f"torch_lms: torch {torch.__version__} already has Large Model Support built in; "
            "use torch.cuda.set_enabled_lms() and friends directly and do not import torch_lms"
        )
    if torch.version.cuda is None:
        raise ImportError(
            f"torch_lms: torch {torch.__version__} is a CPU-only build; Large Model Support "
            "needs a CUDA build of PyTorch"
        )
    # Before the extension module loads: built for another torch, it fails with undefined
    # symbols or, worse, loads and calls into an allocator interface of another layout.
    try:
        from torch_lms import _build_info
    except ImportError:
        raise ImportError(
            "torch_lms: _build_info.py is missing, so this copy was not built (or not by "
            "extension/setup.py or lmstool dropin): build it against the installed torch "
            "(extension/README.md) or install a prebuilt package"
        ) from None
    problem = _support.mismatch(
        _build_info.TORCH_VERSION, _build_info.CUDA_VERSION, torch.__version__, torch.version.cuda
    )
    if problem:
        raise ImportError(problem)
    if not torch.cuda.is_available():
        raise ImportError(
            "torch_lms: no usable CUDA device (torch.cuda.is_available() is False); "
            "Large Model Support swaps CUDA tensors and needs a GPU"
        )


_check_torch()

# lms is the shared torch/cuda/lms.py, copied into the package at build time (with
# _lms_graph.py, which lms.py imports when Inductor's configuration is imported).
from torch_lms import _C, _build_info, lms  # noqa: E402
from torch_lms._integration import API_NAMES, install  # noqa: E402

install(_C, lms)

__all__ = ["API_NAMES", "lms"]
__version__ = _build_info.PACKAGE_VERSION
