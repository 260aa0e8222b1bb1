"""Models compiled with ``torch.compile`` (default mode) trained under a memory cap with Large
Model Support. Inductor's buffers are allocated through the caching allocator, so they are LMS
storages; its Triton kernels are launched from Python, and each launch pins its tensor
arguments for the launch (``torch/cuda/lms.py``), so the activations they write are
reclaimable between forward and backward. The same checks as ``test_models.py``: the cap
makes training without LMS fail, LMS trains under it, bit-identical to the uncapped compiled
run."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch
from lms_regression_harness import Batch, check_capped_training

nn = torch.nn
F = torch.nn.functional


@pytest.fixture(autouse=True)
def inductor_cache() -> Iterator[None]:
    """Inductor's compile cache in a temporary folder of this run."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="lms-inductor-") as folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
            torch._dynamo.reset()


class FeedForwardStack(nn.Module):
    """Transformer feed-forward blocks: the GELU between the matmuls is a Triton kernel, the
    matmuls are extern kernels; every block saves 4 x 128 MiB of activations for backward."""

    def __init__(self, width: int = 2048, depth: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 2 * width),
                nn.GELU(),
                nn.Linear(2 * width, width),
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def token_batches(tokens: int, width: int) -> Callable[[int], Batch]:
    def make(step: int) -> Batch:
        g = torch.Generator(device="cuda").manual_seed(2000 + step)
        x = torch.randn(tokens, width, device="cuda", generator=g)
        y = torch.randint(0, 16, (tokens,), device="cuda", generator=g)
        return x, y

    return make


def test_compiled_feed_forward_stack(record: Callable[[str, Any], None]) -> None:
    check_capped_training(
        lambda: torch.compile(FeedForwardStack()),
        token_batches(tokens=16384, width=2048),
        F.cross_entropy,
        steps=3,
        record=record,
    )


def test_compiled_resnet50(record: Callable[[str, Any], None]) -> None:
    models = pytest.importorskip("torchvision.models", reason="torchvision is not installed")

    def batches(step: int) -> Batch:
        g = torch.Generator(device="cuda").manual_seed(1000 + step)
        images = torch.randn(32, 3, 192, 192, device="cuda", generator=g)
        labels = torch.randint(0, 100, (32,), device="cuda", generator=g)
        return images, labels

    check_capped_training(
        lambda: torch.compile(models.resnet50(weights=None, num_classes=100)),
        batches,
        F.cross_entropy,
        steps=3,
        record=record,
    )
