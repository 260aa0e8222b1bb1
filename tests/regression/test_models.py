"""Real models trained under a memory cap with Large Model Support.

Each test proves the cap matters (without LMS training raises torch.OutOfMemoryError) and
that LMS trains under it with losses, gradients and Adam-updated parameters bit-identical to an
uncapped run without LMS. Sizes are kept small so the whole suite runs in minutes on one GPU.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch
from lms_regression_harness import Batch, check_capped_training

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
    return pytest.importorskip("torchvision.models", reason="torchvision is not installed")


def test_resnet50(record: Callable[[str, Any], None]) -> None:
    models = torchvision_models()
    check_capped_training(
        lambda: models.resnet50(weights=None, num_classes=100),
        image_batches(batch=32, size=160, classes=100),
        F.cross_entropy,
        steps=3,
        record=record,
    )


def test_resnet152(record: Callable[[str, Any], None]) -> None:
    models = torchvision_models()
    check_capped_training(
        lambda: models.resnet152(weights=None, num_classes=100),
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


# A GPT of its own rather than benchmarks/models.py's: that one uses scaled_dot_product_attention
# for speed, whose backward is not deterministic, and this suite compares gradients bit for bit.
class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # Explicit attention: deterministic forward and backward kernels.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        return self.head(self.ln(self.blocks(x)))


def test_gpt(record: Callable[[str, Any], None]) -> None:
    vocab, context = 8192, 256

    def batches(step: int) -> Batch:
        g = torch.Generator(device="cuda").manual_seed(2000 + step)
        data = torch.randint(0, vocab, (24, context + 1), device="cuda", generator=g)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    check_capped_training(
        lambda: GPT(vocab, context, dim=512, layers=8, heads=8),
        batches,
        loss,
        steps=3,
        record=record,
    )
