"""The marks of a test module that needs a CUDA GPU: ``pytestmark = GPU_ONLY`` marks it
``gpu`` and skips it, saying why, where torch has no CUDA device."""

from __future__ import annotations

import pytest

try:
    import torch.cuda

    CUDA = torch.cuda.is_available()
except ImportError:  # no torch (a folder named torch on the path is not one)
    CUDA = False

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (and a CUDA build of torch)"),
]
