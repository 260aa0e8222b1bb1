"""The model families of the LMS regression matrix (``test_families.py``).

Each family is a model, its synthetic data, its loss and its training recipe (optimizer,
fp16 autocast with a GradScaler, gradient accumulation). ``family(name, tiny=False)`` gives
the size trained on the GPU; ``tiny=True`` a size that builds and trains in moments on a CPU,
so the models themselves are tested where there is no GPU.

GPU sizes are chosen for an uncapped peak of about 4 to 12 GB each, with at least one tensor
allocated inside an operator larger than 256 MiB (the drop-in extension's default reclaim
headroom), and with the working set of the largest single operator well under a quarter of
the peak, so that a cap of 1/4 of the peak leaves LMS something it can do.

Nothing here touches CUDA at import time; batches are made on the device the caller names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmsbench.models import GPT, GPTConfig

Batch = tuple[torch.Tensor, torch.Tensor]
MiB = 1024 * 1024


@dataclass(frozen=True)
class Family:
    """One row group of the regression matrix.

    Attributes:
        name: the id used in test names and results.
        description: what the model is, with its size.
        build: makes the model (on the CPU; the caller moves it).
        make_batch: ``make_batch(index, device)``: the ``index``-th micro-batch, seeded.
        loss: ``loss(output, targets)``.
        make_optimizer: the optimizer of a built model.
        amp: fp16 autocast for forward and loss, with a ``torch.amp.GradScaler``.
        accumulation: micro-batches per optimizer step (loss divided by it).
        steps: optimizer steps of a regression run.
        notes: facts about the sizing worth keeping next to the results.
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    amp: bool = False
    accumulation: int = 1
    steps: int = 3
    notes: dict[str, Any] = field(default_factory=dict)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    """Single-tensor Adam: its working set is one parameter at a time.

    The multi-tensor (foreach) step, which works on every parameter of a group in one
    operator, is the subject of the ``adamw_foreach`` family.
    """
    return torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)


# ---------------------------------------------------------------------------------------
# 2D CNN at high resolution
# ---------------------------------------------------------------------------------------


def conv_bn_relu(cin: int, cout: int, stride: int = 1, dims: int = 2) -> nn.Sequential:
    """3x3 convolution (no bias), batch norm, in-place ReLU."""
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    norm = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
    return nn.Sequential(
        conv(cin, cout, 3, stride=stride, padding=1, bias=False),
        norm(cout),
        nn.ReLU(inplace=True),
    )


class HighResCNN(nn.Module):
    """A plain CNN that keeps ``full_res_blocks`` blocks at the input resolution.

    Most of its memory is the activations saved at full resolution (two tensors of
    ``batch x channels x H x W`` per block), so its peak grows with the depth at full
    resolution while the working set of one operator stays that of one block.
    """

    def __init__(self, channels: int, full_res_blocks: int, levels: int, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [conv_bn_relu(3, channels)]
        layers += [conv_bn_relu(channels, channels) for _ in range(full_res_blocks)]
        c = channels
        for _ in range(levels):
            layers += [conv_bn_relu(c, 2 * c, stride=2), conv_bn_relu(2 * c, 2 * c)]
            c *= 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def image_batches(
    batch: int, size: int, classes: int, seed: int
) -> Callable[[int, torch.device], Batch]:
    def make(index: int, device: torch.device) -> Batch:
        g = _generator(device, seed + index)
        images = torch.randn(batch, 3, size, size, device=device, generator=g)
        labels = torch.randint(0, classes, (batch,), device=device, generator=g)
        return images, labels

    return make


def cnn2d_family(tiny: bool) -> Family:
    # GPU: 2 x 16 x 1536 x 1536 fp32 = 288 MiB per full-resolution activation, 17 of them
    # saved (stem + 8 blocks); uncapped peak about 6-7 GiB.
    batch, size, channels, blocks = (2, 24, 4, 2) if tiny else (2, 1536, 16, 8)
    return Family(
        name="cnn2d",
        description=(
            f"2D CNN, {blocks} conv-BN-ReLU blocks of {channels} channels at {size}x{size}, "
            f"batch {batch}, 2 downsampling levels"
        ),
        build=lambda: HighResCNN(channels, blocks, levels=2, classes=10),
        make_batch=image_batches(batch, size, 10, seed=1000),
        loss=F.cross_entropy,
        make_optimizer=adam,
    )


def grad_accum_family(tiny: bool) -> Family:
    # GPU: micro-batches of 1 x 16 x 2176 x 2176 fp32 (289 MiB per full-resolution
    # activation), 4 per optimizer step.
    batch, size, channels, blocks = (1, 24, 4, 2) if tiny else (1, 2176, 16, 8)
    return Family(
        name="grad_accum",
        description=(
            f"gradient accumulation over 4 micro-batches: 2D CNN, {blocks} blocks of "
            f"{channels} channels at {size}x{size}, micro-batch {batch}"
        ),
        build=lambda: HighResCNN(channels, blocks, levels=2, classes=10),
        make_batch=image_batches(batch, size, 10, seed=1500),
        loss=F.cross_entropy,
        make_optimizer=adam,
        accumulation=4,
    )


# ---------------------------------------------------------------------------------------
# 3D convolutional encoder-decoder with skip concatenation
# ---------------------------------------------------------------------------------------


class UpConcat(nn.Module):
    """Transposed-convolution upsampling, then concatenation with the encoder's skip."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(cin, cout, 2, stride=2)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.up(x), skip], dim=1)


class UNet3D(nn.Module):
    """A two-level 3D U-Net: strided-convolution downsampling (deterministic, unlike
    max-pooling's backward), transposed-convolution upsampling, skip concatenation.

    ``depth`` blocks at full resolution in the encoder and the decoder each carry most of
    the memory.
    """

    def __init__(self, base: int, up_channels: int, depth: int) -> None:
        super().__init__()
        b = base
        self.enc1 = nn.Sequential(
            conv_bn_relu(1, b, dims=3), *(conv_bn_relu(b, b, dims=3) for _ in range(depth - 1))
        )
        self.enc2 = nn.Sequential(
            conv_bn_relu(b, 2 * b, stride=2, dims=3), conv_bn_relu(2 * b, 2 * b, dims=3)
        )
        self.bottom = nn.Sequential(
            conv_bn_relu(2 * b, 4 * b, stride=2, dims=3), conv_bn_relu(4 * b, 4 * b, dims=3)
        )
        self.up2 = UpConcat(4 * b, 2 * up_channels)
        self.dec2 = nn.Sequential(
            conv_bn_relu(2 * up_channels + 2 * b, 2 * b, dims=3),
            conv_bn_relu(2 * b, 2 * b, dims=3),
        )
        self.up1 = UpConcat(2 * b, up_channels)
        self.dec1 = nn.Sequential(
            conv_bn_relu(up_channels + b, b, dims=3),
            *(conv_bn_relu(b, b, dims=3) for _ in range(depth - 1)),
        )
        self.out = nn.Conv3d(b, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(s1)
        y = self.bottom(s2)
        y = self.dec2(self.up2(y, s2))
        y = self.dec1(self.up1(y, s1))
        return self.out(y)


def unet3d_family(tiny: bool) -> Family:
    # GPU: 1 x 16 x 160^3 fp32 = 250 MiB per full-resolution activation (5 encoder and 5
    # decoder blocks save two each); the full-resolution concatenation is 20 channels,
    # 312 MiB. Uncapped peak about 7 GiB.
    size, base, up, depth = (8, 2, 2, 2) if tiny else (160, 16, 4, 5)

    def make(index: int, device: torch.device) -> Batch:
        g = _generator(device, 3000 + index)
        volume = torch.randn(1, 1, size, size, size, device=device, generator=g)
        target = torch.randn(1, 1, size, size, size, device=device, generator=g)
        return volume, target

    return Family(
        name="unet3d",
        description=(
            f"3D U-Net, {size}^3 volume, {base} channels and {depth} blocks per side at full "
            f"resolution, skip concatenation at two levels"
        ),
        build=lambda: UNet3D(base, up, depth),
        make_batch=make,
        loss=F.mse_loss,
        make_optimizer=adam,
    )


# ---------------------------------------------------------------------------------------
# cuDNN LSTM
# ---------------------------------------------------------------------------------------


class StackedLSTM(nn.Module):
    """Residual stack of multi-layer ``nn.LSTM`` modules (cuDNN on a GPU) with LayerNorm.

    Each module's cuDNN reserve space (what its backward needs) is one allocation made
    inside the LSTM operator; the stack keeps ``modules`` of them alive until the backward.
    """

    def __init__(self, features: int, hidden: int, layers: int, modules: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.lstms = nn.ModuleList(
            nn.LSTM(hidden, hidden, num_layers=layers) for _ in range(modules)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(modules))
        self.out = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for lstm, norm in zip(self.lstms, self.norms):
            y, _ = lstm(norm(h))
            h = h + y
        return self.out(h)


def lstm_family(tiny: bool) -> Family:
    # GPU: sequence 256 x batch 64 x hidden 1024 (64 MiB per layer output); each 2-layer
    # module's reserve space is several times that.
    seq, batch, features, hidden, layers, modules = (
        (6, 2, 4, 8, 2, 2) if tiny else (256, 64, 256, 1024, 2, 8)
    )

    def make(index: int, device: torch.device) -> Batch:
        g = _generator(device, 4000 + index)
        x = torch.randn(seq, batch, features, device=device, generator=g)
        y = torch.randn(seq, batch, features, device=device, generator=g)
        return x, y

    return Family(
        name="lstm",
        description=(
            f"{modules} residual {layers}-layer cuDNN LSTMs ({modules * layers} layers), "
            f"hidden {hidden}, sequence {seq}, batch {batch}"
        ),
        build=lambda: StackedLSTM(features, hidden, layers, modules),
        make_batch=make,
        loss=F.mse_loss,
        make_optimizer=adam,
    )


# ---------------------------------------------------------------------------------------
# Transformer language models
# ---------------------------------------------------------------------------------------


def transformer_lm(vocab: int, context: int, dim: int, layers: int, heads: int, tied: bool) -> GPT:
    """The GPT-style decoder shared with the benchmarks (``lmsbench.models.GPT``) with explicit
    attention, whose kernels are deterministic (the regression compares bits), and PyTorch's
    default initialization; with ``tied=True`` the output projection is the token embedding."""
    config = GPTConfig(vocab=vocab, seq=context, dim=dim, layers=layers, heads=heads)
    return GPT(config, fused_attention=False, tied=tied, gpt2_init=False)


def token_batches(
    batch: int, context: int, vocab: int, seed: int
) -> Callable[[int, torch.device], Batch]:
    def make(index: int, device: torch.device) -> Batch:
        g = _generator(device, seed + index)
        data = torch.randint(0, vocab, (batch, context + 1), device=device, generator=g)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    return make


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def tied_lm_family(tiny: bool) -> Family:
    # GPU: 10 x 512 tokens x 16384 vocabulary fp32 logits = 320 MiB (and as much for the
    # log-softmax); 12 layers of width 768, attention scores 80 MiB per tensor. Uncapped
    # peak about 7 GiB.
    vocab, context, dim, layers, heads, batch = (
        (64, 8, 16, 2, 2, 2) if tiny else (16384, 512, 768, 12, 8, 10)
    )
    return Family(
        name="tied_lm",
        description=(
            f"transformer LM with tied input/output embeddings, {layers} layers of width "
            f"{dim}, vocabulary {vocab}, {batch} x {context} tokens"
        ),
        build=lambda: transformer_lm(vocab, context, dim, layers, heads, tied=True),
        make_batch=token_batches(batch, context, vocab, seed=5000),
        loss=lm_loss,
        make_optimizer=adam,
    )


def amp_family(tiny: bool) -> Family:
    # GPU: 18 x 16 heads x 512^2 attention probabilities, kept in fp32 by autocast's
    # softmax: 288 MiB per layer; 8 layers of width 1024. Uncapped peak about 7-8 GiB.
    vocab, context, dim, layers, heads, batch = (
        (64, 8, 16, 2, 2, 2) if tiny else (8192, 512, 1024, 8, 16, 18)
    )
    return Family(
        name="amp_fp16",
        description=(
            f"fp16 autocast with GradScaler: transformer LM, {layers} layers of width {dim}, "
            f"{heads} heads, {batch} x {context} tokens"
        ),
        build=lambda: transformer_lm(vocab, context, dim, layers, heads, tied=False),
        make_batch=token_batches(batch, context, vocab, seed=6000),
        loss=lm_loss,
        make_optimizer=adam,
        amp=True,
    )


# ---------------------------------------------------------------------------------------
# AdamW (foreach) whose state is larger than the free room under the cap
# ---------------------------------------------------------------------------------------


class ResidualMLP(nn.Module):
    """Pre-norm residual MLP blocks: parameters dominate, activations are small."""

    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
            )
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def layerwise_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Multi-tensor AdamW with one parameter group per layer (layer-wise learning-rate
    decay). Each group's step is one set of foreach operators over that group's
    parameters, gradients and states: a working set of one layer, while the state of all
    layers together is larger than the room left under the cap."""
    groups: list[dict[str, Any]] = []
    rest: list[nn.Parameter] = []
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for depth, layer in enumerate(layers):
        groups.append({"params": list(layer.parameters()), "lr": 1e-3 * 0.9**depth})
    seen = {id(p) for g in groups for p in g["params"]}
    rest = [p for p in model.parameters() if id(p) not in seen]
    if rest:
        groups.append({"params": rest})
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, foreach=True)


def adamw_family(tiny: bool) -> Family:
    # GPU: width 4352: each Linear weight is 4352 x 17408 fp32 = 289 MiB (its gradient is
    # allocated inside the backward matmul); 3 blocks = 1.8 GB of parameters and 3.6 GB of
    # AdamW state. Uncapped peak about 8 GiB.
    dim, blocks, tokens = (8, 2, 4) if tiny else (4352, 3, 2048)

    def make(index: int, device: torch.device) -> Batch:
        g = _generator(device, 7000 + index)
        x = torch.randn(tokens, dim, device=device, generator=g)
        y = torch.randn(tokens, dim, device=device, generator=g)
        return x, y

    return Family(
        name="adamw_foreach",
        description=(
            f"AdamW (foreach, one group per layer) on a residual MLP, {blocks} blocks of width "
            f"{dim}, {tokens} tokens"
        ),
        build=lambda: ResidualMLP(dim, blocks),
        make_batch=make,
        loss=F.mse_loss,
        make_optimizer=layerwise_adamw,
    )


# ---------------------------------------------------------------------------------------
# Token-choice mixture of experts: allocation sizes change every step
# ---------------------------------------------------------------------------------------


class TopOneMoE(nn.Module):
    """A pre-norm residual layer of ``experts`` feed-forward experts with top-1 routing.

    Each token goes to the expert its router scores highest, so how many tokens each expert
    gets, and with it the size of every expert activation, changes from step to step: the
    caching allocator sees new sizes every iteration, the pattern that fragments its cache.
    Outputs are written with ``index_copy`` (each token once), so the forward and backward
    passes are deterministic.
    """

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gate, choice = self.router(h).softmax(dim=-1).max(dim=-1)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            tokens = (choice == index).nonzero(as_tuple=True)[0]
            if tokens.numel() == 0:
                continue
            y = expert(h.index_select(0, tokens)) * gate.index_select(0, tokens).unsqueeze(1)
            out = out.index_copy(0, tokens, y)
        return x + out


class MoEStack(nn.Module):
    """``layers`` top-1 mixture-of-experts layers and a linear head."""

    def __init__(self, dim: int, hidden: int, experts: int, layers: int, classes: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(TopOneMoE(dim, hidden, experts) for _ in range(layers)))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def moe_batches(
    tokens: int, dim: int, clusters: int, classes: int, seed: int
) -> Callable[[int, torch.device], Batch]:
    """Tokens drawn around ``clusters`` centers with weights drawn anew for every batch, so
    that the router's load per expert swings between steps."""

    def make(index: int, device: torch.device) -> Batch:
        g = _generator(device, seed + index)
        centers = 4.0 * torch.randn(clusters, dim, device=device, generator=g)
        weights = torch.rand(clusters, device=device, generator=g) ** 4
        which = torch.multinomial(weights, tokens, replacement=True, generator=g)
        x = centers.index_select(0, which) + torch.randn(tokens, dim, device=device, generator=g)
        labels = torch.randint(0, classes, (tokens,), device=device, generator=g)
        return x, labels

    return make


def moe_family(tiny: bool) -> Family:
    # GPU: 32768 tokens of width 1024 (128 MiB per token tensor); an expert's hidden
    # activation is its share of 32768 x 4096 fp32 (512 MiB in all), and the shares change
    # every step. The head's logits over 3072 classes are 384 MiB, allocated inside its
    # Linear. 4 layers of 8 experts (1 GiB of parameters, 2 GiB of Adam state): uncapped
    # peak about 8-10 GiB.
    tokens, dim, hidden, experts, layers, classes = (
        (64, 16, 32, 4, 2, 8) if tiny else (32768, 1024, 4096, 8, 4, 3072)
    )
    return Family(
        name="moe",
        description=(
            f"token-choice top-1 mixture of experts, {layers} layers of {experts} experts "
            f"(width {dim}, hidden {hidden}), {tokens} tokens whose expert loads change "
            "every step"
        ),
        build=lambda: MoEStack(dim, hidden, experts, layers, classes),
        make_batch=moe_batches(tokens, dim, clusters=2 * experts, classes=classes, seed=8000),
        loss=F.cross_entropy,
        make_optimizer=adam,
    )


FAMILIES: dict[str, Callable[[bool], Family]] = {
    "cnn2d": cnn2d_family,
    "unet3d": unet3d_family,
    "lstm": lstm_family,
    "tied_lm": tied_lm_family,
    "amp_fp16": amp_family,
    "grad_accum": grad_accum_family,
    "adamw_foreach": adamw_family,
    "moe": moe_family,
}


def family(name: str, tiny: bool = False) -> Family:
    """The family ``name`` at its GPU size, or at a CPU-sized ``tiny`` scale."""
    try:
        return FAMILIES[name](tiny)
    except KeyError:
        raise ValueError(f"unknown family {name!r}; known: {sorted(FAMILIES)}") from None


# ---------------------------------------------------------------------------------------
# A model sized from the device memory: the no-cap rows and the processes sharing one GPU
# ---------------------------------------------------------------------------------------


class DeepMLP(nn.Module):
    """``layers`` x (Linear(width, width), GELU), then Linear(width, 1).

    Training saves two ``tokens x width`` tensors per layer (the Linear's input and the
    GELU's input), so its memory need is set by ``tokens``: see :func:`mlp_tokens_for`.
    """

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        body: list[nn.Module] = []
        for _ in range(layers):
            body += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*body)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def mlp_need_bytes(tokens: int, width: int, layers: int) -> int:
    """Bytes of live tensors at the peak of one fp32 training step of :class:`DeepMLP`.

    Saved for the backward: the input and two ``tokens x width`` tensors per layer; in
    the backward, a gradient and the gradient it produces on top. Parameters, their
    gradients and the optimizer state are counted too (small next to the activations).
    """
    activations = (2 * layers + 1 + 2) * tokens * width * 4
    parameters = (layers * (width * width + width) + width + 1) * 4
    return activations + 3 * parameters


def mlp_tokens_for(need_bytes: int, width: int, layers: int) -> int:
    """The largest token count whose :func:`mlp_need_bytes` is at most ``need_bytes``."""
    per_token = (2 * layers + 3) * width * 4
    fixed = mlp_need_bytes(0, width, layers)
    return max(1, (need_bytes - fixed) // per_token)


def mlp_batch(tokens: int, width: int, seed: int, device: torch.device) -> Batch:
    g = _generator(device, seed)
    x = torch.randn(tokens, width, device=device, generator=g)
    y = torch.randn(tokens, 1, device=device, generator=g)
    return x, y


# ---------------------------------------------------------------------------------------
# Training, the same on a GPU and (for the CPU tests) on a CPU
# ---------------------------------------------------------------------------------------


def make_scaler(fam: Family, device: torch.device) -> torch.amp.GradScaler | None:
    """The GradScaler of an ``amp`` family, else ``None``.

    It starts at a scale of 2**10 rather than 2**16, so that the few steps of a regression
    run update the weights instead of being skipped while the scale comes down.
    """
    return torch.amp.GradScaler(device.type, init_scale=2.0**10) if fam.amp else None


def autocast(fam: Family, device: torch.device) -> torch.autocast:
    """fp16 autocast for an ``amp`` family on a GPU (bfloat16 on a CPU); off otherwise."""
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=fam.amp)


def train_step(
    fam: Family,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    step: int,
    device: torch.device,
    after_forward: Callable[[], None] | None = None,
    before_update: Callable[[], None] | None = None,
) -> list[torch.Tensor]:
    """One optimizer step of ``fam``: ``accumulation`` micro-batches, then the update.

    Returns the micro-batches' losses (detached, on the CPU, as computed: divided by
    ``accumulation``). ``after_forward`` runs after the first micro-batch's loss, while
    its activations are alive; ``before_update`` runs when the gradients are complete.
    """
    losses: list[torch.Tensor] = []
    for micro in range(fam.accumulation):
        inputs, targets = fam.make_batch(step * fam.accumulation + micro, device)
        with autocast(fam, device):
            loss = fam.loss(model(inputs), targets)
        if fam.accumulation > 1:
            loss = loss / fam.accumulation
        del inputs, targets
        if micro == 0 and after_forward is not None:
            after_forward()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(loss.detach().float().cpu())
        del loss
    if before_update is not None:
        before_update()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses
