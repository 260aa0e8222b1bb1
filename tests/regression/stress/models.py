"""The models, batches and optimizers of stress cases (see ``generator.Case``).

Every model uses operators with deterministic CUDA kernels under
``torch.use_deterministic_algorithms(True)``: explicit attention instead of
``scaled_dot_product_attention`` (whose fused backward kernels are not deterministic), mean
pooling instead of adaptive pooling, average pooling and strided convolutions instead of max
pooling, float inputs instead of embeddings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .generator import Case


def _bn_relu_conv(cin: int, cout: int, kernel: int, stride: int = 1, dims: int = 2) -> nn.Module:
    bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    return nn.Sequential(
        bn(cin),
        nn.ReLU(),
        conv(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
    )


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (projected when the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, dims: int) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        self.body = nn.Sequential(
            conv(cin, cout, 3, stride=stride, padding=1, bias=False),
            bn(cout),
            nn.ReLU(),
            conv(cout, cout, 3, padding=1, bias=False),
            bn(cout),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(conv(cin, cout, 1, stride=stride, bias=False), bn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResidualCNN(nn.Module):
    """A ResNet-like CNN (2D or 3D): stages of residual blocks with additions."""

    def __init__(self, case: Case, dims: int) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        width = case.width
        layers: list[nn.Module] = [conv(3, width, 3, padding=1, bias=False), bn(width), nn.ReLU()]
        cin = width
        for stage in range(case.stages):
            cout = width << stage
            for block in range(case.depth):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(ResidualBlock(cin, cout, stride, dims))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, case.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(x.flatten(2).mean(dim=2))


class DenseLayer(nn.Module):
    """BN-ReLU-conv1x1 (4 x growth) then BN-ReLU-conv3x3 (growth), concatenated to the input."""

    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.bottleneck = _bn_relu_conv(cin, 4 * growth, 1)
        self.conv = _bn_relu_conv(4 * growth, growth, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.conv(self.bottleneck(x))], dim=1)


class DenseCNN(nn.Module):
    """A DenseNet-like CNN: dense blocks (channel concatenation) and pooling transitions."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        growth = case.width
        channels = 2 * growth
        layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1, bias=False)]
        for block in range(case.stages):
            for _ in range(case.depth):
                layers.append(DenseLayer(channels, growth))
                channels += growth
            if block < case.stages - 1:
                layers += [_bn_relu_conv(channels, channels // 2, 1), nn.AvgPool2d(2)]
                channels //= 2
        layers += [nn.BatchNorm2d(channels), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, case.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(2).mean(dim=2))


class MlpBlock(nn.Module):
    """Pre-LayerNorm MLP with a residual: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Attention(nn.Module):
    """Multi-head self-attention written out (deterministic forward and backward)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    """Pre-LayerNorm transformer encoder block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = MlpBlock(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attn(self.ln1(x)))


class TokenModel(nn.Module):
    """Input projection, a stack of blocks, LayerNorm and a per-token classifier."""

    def __init__(self, case: Case, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(token_features(case), case.width)
        self.blocks = nn.Sequential(*blocks)
        self.ln = nn.LayerNorm(case.width)
        self.head = nn.Linear(case.width, case.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.inp(x))))


class StackedLSTM(nn.Module):
    """Single-layer LSTMs (one cuDNN call each) with a projection and a residual between."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        hidden = case.width
        self.inp = nn.Linear(token_features(case), hidden)
        self.lstms = nn.ModuleList(
            nn.LSTM(hidden, hidden, num_layers=1, batch_first=True) for _ in range(case.depth)
        )
        self.projs = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(case.depth))
        self.head = nn.Linear(hidden, case.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        device = x.device.type
        # cuDNN's RNNs take bf16 only from cuDNN 9.13 on, and the non-cuDNN CUDA LSTM
        # (used when cuDNN is disabled) not at all: under bf16 autocast the LSTMs run in fp32.
        fp32_lstm = (
            torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
        )
        for lstm, proj in zip(self.lstms, self.projs):
            if fp32_lstm:
                with torch.autocast(device, enabled=False):
                    y, _ = lstm(x.float())
            else:
                y, _ = lstm(x)
            x = x + proj(y)
        return self.head(x)


def token_features(case: Case) -> int:
    """Features of each input token of the token families and the LSTM."""
    return 64


def build_model(case: Case) -> nn.Module:
    """The model of ``case`` on the default device, initialized from the current torch seed."""
    if case.family == "resnet_add":
        return ResidualCNN(case, dims=2)
    if case.family == "conv3d":
        return ResidualCNN(case, dims=3)
    if case.family == "densenet_cat":
        return DenseCNN(case)
    if case.family == "mlp_tokens":
        return TokenModel(case, [MlpBlock(case.width) for _ in range(case.depth)])
    if case.family == "transformer":
        return TokenModel(case, [EncoderBlock(case.width, case.heads) for _ in range(case.depth)])
    if case.family == "lstm":
        return StackedLSTM(case)
    raise ValueError(f"unknown family {case.family!r}")


def make_batch(case: Case, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and integer targets of iteration ``step``, from a generator seeded by both."""
    g = torch.Generator(device=device).manual_seed(case.seed * 1000 + step)
    if case.family in ("resnet_add", "densenet_cat"):
        shape: tuple[int, ...] = (case.batch, 3, case.resolution, case.resolution)
        target_shape: tuple[int, ...] = (case.batch,)
    elif case.family == "conv3d":
        shape = (case.batch, 3, case.frames, case.resolution, case.resolution)
        target_shape = (case.batch,)
    else:
        shape = (case.batch, case.resolution, token_features(case))
        target_shape = (case.batch, case.resolution)
    inputs = torch.randn(shape, device=device, generator=g)
    targets = torch.randint(0, case.classes, target_shape, device=device, generator=g)
    return inputs, targets


def loss_fn(case: Case, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (images) or tokens (sequences), in fp32."""
    return F.cross_entropy(output.reshape(-1, case.classes).float(), targets.reshape(-1))


def build_optimizer(case: Case, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of ``case`` over ``params`` (which must already be on their device)."""
    name = case.optimizer
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=1e-3, fused=True)
    if name == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    raise ValueError(f"unknown optimizer {name!r}")


def autocast_dtype(case: Case) -> Any:
    """The autocast dtype of the case, or None when autocast is off."""
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[case.amp]
