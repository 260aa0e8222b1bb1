"""Real models trained under a memory cap with Large Model Support.

Each test proves the cap matters (without LMS training raises torch.OutOfMemoryError) and
that LMS trains under it with losses, gradients and Adam-updated parameters bit-identical to an
uncapped run without LMS. Sizes are kept small so the whole suite runs in minutes on one GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch

from lmsbench.models import resnet
from tests.regression.lms_families import transformer_lm
from tests.regression.lms_regression_harness import Batch, check_capped_training

nn = torch.nn
F = torch.nn.functional


def image_batches(batch: int, size: int, classes: int) -> Callable[[int], Batch]:
    def make(step: int) -> Batch:
        g = torch.Generator(device="cuda").manual_seed(1000 + step)
        images = torch.randn(batch, 3, size, size, device="cuda", generator=g)
        labels = torch.randint(0, classes, (batch,), device="cuda", generator=g)
        return images, labels

    return make


def torchvision_models() -> Any:
    """``torchvision.models``; the test is skipped without torchvision."""
    return pytest.importorskip("torchvision.models", reason="torchvision is not installed")


def test_resnet50(record: Callable[[str, Any], None]) -> None:
    torchvision_models()
    check_capped_training(
        lambda: resnet(50, 100),
        image_batches(batch=32, size=160, classes=100),
        F.cross_entropy,
        steps=3,
        record=record,
    )


def test_resnet152(record: Callable[[str, Any], None]) -> None:
    torchvision_models()
    check_capped_training(
        lambda: resnet(152, 100),
        image_batches(batch=16, size=160, classes=100),
        F.cross_entropy,
        steps=3,
        record=record,
    )


def test_vision_transformer(record: Callable[[str, Any], None]) -> None:
    vit = pytest.importorskip(
        "torchvision.models.vision_transformer", reason="torchvision is not installed"
    )
    check_capped_training(
        lambda: vit.VisionTransformer(
            image_size=64,
            patch_size=8,
            num_layers=6,
            num_heads=6,
            hidden_dim=384,
            mlp_dim=1536,
            num_classes=100,
        ),
        image_batches(batch=128, size=64, classes=100),
        F.cross_entropy,
        steps=3,
        record=record,
    )


# The benchmark's GPT (lmsbench.models) with explicit attention: the benchmark uses
# scaled_dot_product_attention for speed, whose backward is not deterministic, and this suite
# compares gradients bit for bit.


def test_gpt(record: Callable[[str, Any], None]) -> None:
    vocab, context = 8192, 256

    def batches(step: int) -> Batch:
        g = torch.Generator(device="cuda").manual_seed(2000 + step)
        data = torch.randint(0, vocab, (24, context + 1), device="cuda", generator=g)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    check_capped_training(
        lambda: transformer_lm(vocab, context, dim=512, layers=8, heads=8, tied=False),
        batches,
        loss,
        steps=3,
        record=record,
    )
