"""The models the benchmarks and the regression suite share, each built in one place.

- :class:`GPT` (:class:`GPTConfig`): the GPT-style decoder of ``benchmarks/compare.py`` and
  ``benchmarks/compile_peers.py`` (``fused_attention``: ``scaled_dot_product_attention``, fast,
  its backward not deterministic; the GPT-2 initialization) and of the regression suite and its
  matrix (``tests/regression/lms_families.py``: explicit attention, whose kernels are
  deterministic, as the suite compares bits; PyTorch's default initialization; the tied output
  projection of the ``tied_lm`` family). Either way the modules are built in the same order, so
  one seed gives one set of weights before the initialization.
- :func:`resnet`: torchvision's ResNets, randomly initialized: the benchmark's ResNet-152, the
  regression suite's ResNet-50 and -152 and the matrix's ResNet-50 under DDP.

The stress suite builds models of its own (``tests/regression/stress/models.py``), whose shapes
are not these: a ResNet-like CNN of configurable stages, widths and dimensions (2D and 3D,
pre-activation transitions, mean pooling), and a bidirectional encoder over float features
(an input projection instead of embeddings, no causal mask, its MLP the residual module of its
MLP family). Their seeded runs are recorded, so they keep their own modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------
# GPT-style decoder
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    """The decoder's shape; ``seq`` is the context (the position embeddings' length)."""

    vocab: int = 32768
    seq: int = 1024
    dim: int = 1024
    layers: int = 24
    heads: int = 16

    def validate(self) -> None:
        for name in ("vocab", "seq", "dim", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPT {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"GPT dim ({self.dim}) must be a multiple of heads ({self.heads})")

    def parameter_count(self) -> int:
        """Parameters of the untied model."""
        per_block = 12 * self.dim * self.dim + 13 * self.dim  # qkv, proj, 2 MLP, 2 LayerNorms
        embeddings = (self.vocab + self.seq) * self.dim
        return self.layers * per_block + embeddings + 2 * self.dim + self.vocab * self.dim


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``scaled_dot_product_attention`` (``fused``) or the
    scores, mask and softmax written out, whose forward and backward kernels are
    deterministic (``scaled_dot_product_attention``'s fused backward kernels are not)."""

    def __init__(self, dim: int, heads: int, fused: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.fused = fused
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention, then a 4x MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, fused_attention: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, fused_attention)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style decoder: token and position embeddings, ``layers`` blocks, LayerNorm, a
    linear head over the vocabulary.

    Args:
        config: the shape.
        fused_attention: ``scaled_dot_product_attention`` (else the deterministic explicit
            attention of :class:`CausalSelfAttention`).
        tied: the head's weight is the token embedding's.
        gpt2_init: every matrix drawn from N(0, 0.02), the residual projections' from
            N(0, 0.02 / sqrt(2 x layers)), after the modules are built (else PyTorch's
            default initialization of each module).
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        fused_attention: bool = True,
        tied: bool = False,
        gpt2_init: bool = True,
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq, config.dim)
        self.blocks = nn.Sequential(
            *(Block(config.dim, config.heads, fused_attention) for _ in range(config.layers))
        )
        self.ln = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        if tied:
            self.head.weight = self.tokens.weight
        if gpt2_init:
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    proj = name.endswith("proj.weight")
                    std = 0.02 / math.sqrt(2 * config.layers) if proj else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        return self.head(self.ln(self.blocks(x)))


# ---------------------------------------------------------------------------------------
# torchvision's ResNets
# ---------------------------------------------------------------------------------------

RESNET_DEPTHS = (18, 34, 50, 101, 152)


def torchvision_models() -> Any:
    """``torchvision.models``, imported when a model needs it.

    Raises:
        RuntimeError: torchvision is not installed.
    """
    try:
        import torchvision.models as models
    except ImportError as exc:
        raise RuntimeError(
            "this workload needs torchvision (pip install torchvision matching torch)"
        ) from exc
    return models


def resnet(depth: int, classes: int) -> nn.Module:
    """torchvision's ResNet-``depth`` (one of :data:`RESNET_DEPTHS`), randomly initialized,
    with ``classes`` outputs."""
    if depth not in RESNET_DEPTHS:
        raise ValueError(f"no ResNet-{depth}: torchvision has depths {RESNET_DEPTHS}")
    build = getattr(torchvision_models(), f"resnet{depth}")
    model: nn.Module = build(weights=None, num_classes=classes)
    return model
