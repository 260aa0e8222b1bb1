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
    if not torch.cuda.is_available():
        raise ImportError(
            "torch_lms: no usable CUDA device (torch.cuda.is_available() is False); "
            "Large Model Support swaps CUDA tensors and needs a GPU"
        )


_check_torch()

# lms is the shared torch/cuda/lms.py, copied into the package at build time (with
# _lms_graph.py, which lms.py imports when Inductor's configuration is imported).
from torch_lms import _C, lms  # noqa: E402
from torch_lms._integration import API_NAMES, install  # noqa: E402

install(_C, lms)

__all__ = ["API_NAMES", "lms"]
__version__ = "0.1.0"
