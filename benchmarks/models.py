"""The benchmark workloads: ResNet-152 at high resolution, ViT-L/16, a GPT-style transformer.

Each :class:`Workload` builds its model (the GPT and the ResNet are ``lmsbench.models``',
shared with the regression suite), makes synthetic batches on the device, computes the loss
and can wrap its blocks in activation checkpointing (``torch.utils.checkpoint``, one checkpoint
per residual block / encoder block / transformer block). torchvision is imported only by the
workloads that need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmsbench.models import GPT, GPTConfig, resnet, torchvision_models

Batch = tuple[torch.Tensor, torch.Tensor]


class Checkpointed(nn.Module):
    """Runs ``inner`` under activation checkpointing (non-reentrant) while grad mode is on:
    its activations are dropped after the forward pass and recomputed in the backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            out = checkpoint(self.inner, x, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out
        return self.inner(x)


def checkpoint_sequential_children(seq: nn.Sequential) -> int:
    """Wraps every child of ``seq`` in :class:`Checkpointed`; returns how many."""
    for i, child in enumerate(list(seq)):
        if not isinstance(child, Checkpointed):
            seq[i] = Checkpointed(child)
    return len(seq)


# ---------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------


def classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits, target)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def image_batch(
    classes: int, image_size: int, channels_last: bool = False
) -> Callable[[int, torch.device, int], Batch]:
    def make(batch: int, device: torch.device, step: int) -> Batch:
        g = torch.Generator(device=device).manual_seed(1000 + step)
        images = torch.randn(batch, 3, image_size, image_size, device=device, generator=g)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, classes, (batch,), device=device, generator=g)
        return images, labels

    return make


def token_batch(config: GPTConfig) -> Callable[[int, torch.device, int], Batch]:
    def make(batch: int, device: torch.device, step: int) -> Batch:
        g = torch.Generator(device=device).manual_seed(2000 + step)
        data = torch.randint(0, config.vocab, (batch, config.seq + 1), device=device, generator=g)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    return make


@dataclass
class Workload:
    name: str
    description: str
    default_batch: int
    optimizer: str  # "sgd" or "adamw"
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device, int], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    checkpoint: Callable[[nn.Module], int]  # wraps the blocks in place; returns how many

    def make_optimizer(self, model: nn.Module, kind: str | None = None) -> torch.optim.Optimizer:
        return make_optimizer(model, kind or self.optimizer)


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    raise ValueError(f"unknown optimizer {kind!r} (sgd or adamw)")


def resnet152_workload(image_size: int = 512, classes: int = 1000, batch: int = 8) -> Workload:
    def build() -> nn.Module:
        return resnet(152, classes)

    def wrap(model: nn.Module) -> int:
        return sum(checkpoint_sequential_children(getattr(model, f"layer{i}")) for i in range(1, 5))

    return Workload(
        name="resnet152",
        description=f"ResNet-152, {image_size}x{image_size} images, {classes} classes",
        default_batch=batch,
        optimizer="sgd",
        build=build,
        make_batch=image_batch(classes, image_size),
        loss=classification_loss,
        checkpoint=wrap,
    )


def vit_l_workload(
    image_size: int = 224, layers: int = 24, classes: int = 1000, batch: int = 32
) -> Workload:
    if image_size % 16:
        raise ValueError(f"ViT-L/16 needs an image size divisible by 16, got {image_size}")
    if layers < 1:
        raise ValueError(f"ViT layers must be >= 1, got {layers}")

    def build() -> nn.Module:
        vit = torchvision_models().vision_transformer
        return vit.VisionTransformer(
            image_size=image_size,
            patch_size=16,
            num_layers=layers,
            num_heads=16,
            hidden_dim=1024,
            mlp_dim=4096,
            num_classes=classes,
        )

    def wrap(model: nn.Module) -> int:
        return checkpoint_sequential_children(model.encoder.layers)  # type: ignore[union-attr,arg-type]

    depth = "" if layers == 24 else f", {layers} of 24 encoder layers"
    return Workload(
        name="vit_l",
        description=f"ViT-L/16 (torchvision vit_l_16{depth}), {image_size}x{image_size} images",
        default_batch=batch,
        optimizer="adamw",
        build=build,
        make_batch=image_batch(classes, image_size),
        loss=classification_loss,
        checkpoint=wrap,
    )


def gpt_workload(config: GPTConfig | None = None, batch: int = 8) -> Workload:
    cfg = config or GPTConfig()
    cfg.validate()

    def wrap(model: nn.Module) -> int:
        assert isinstance(model, GPT)
        return checkpoint_sequential_children(model.blocks)

    params = cfg.parameter_count() / 1e6
    return Workload(
        name="gpt",
        description=(
            f"GPT-style decoder, {cfg.layers} layers, width {cfg.dim}, {cfg.heads} heads, "
            f"sequence {cfg.seq}, vocabulary {cfg.vocab} ({params:.0f}M parameters)"
        ),
        default_batch=batch,
        optimizer="adamw",
        build=lambda: GPT(cfg),
        make_batch=token_batch(cfg),
        loss=lm_loss,
        checkpoint=wrap,
    )


# ---------------------------------------------------------------------------------------
# save_on_cpu with byte counting
# ---------------------------------------------------------------------------------------


class SaveOnCpuCounter:
    """``torch.autograd.graph.save_on_cpu(pin_memory=...)`` that counts what it copies.

    Every tensor autograd saves is copied to (pinned) host memory when packed and back to its
    device when unpacked; the counters add up those copies' bytes and numbers. Use
    ``with counter.context(): loss = model(x)...`` around the forward pass.
    """

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self.out_bytes = 0
        self.in_bytes = 0
        self.out_count = 0
        self.in_count = 0

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        pack, unpack = hooks.pack_hook, hooks.unpack_hook

        def counting_pack(tensor: torch.Tensor) -> Any:
            self.out_bytes += tensor.numel() * tensor.element_size()
            self.out_count += 1
            return pack(tensor)

        def counting_unpack(packed: Any) -> torch.Tensor:
            tensor = unpack(packed)
            self.in_bytes += tensor.numel() * tensor.element_size()
            self.in_count += 1
            return tensor

        hooks.pack_hook = counting_pack
        hooks.unpack_hook = counting_unpack
        return hooks


class StreamOffload:
    """Stream-overlapped activation offloading, as torchtune's ``OffloadActivations`` does it,
    written here as the baseline for machines without torchtune.

    Saved-tensor hooks: packing copies a saved activation to pinned host memory on a
    device-to-host side stream (the compute stream goes on; the device memory is reused only
    after the copy, through ``record_stream``); unpacking, in backward, starts bringing this
    and the next ``prefetch`` saved activations (backward unpacks in the reverse order of
    packing) back on a host-to-device side stream, and the compute stream waits on the copy's
    event. Parameters, their views, non-contiguous tensors and tensors under ``min_bytes``
    stay on the device. The counters add up the bytes copied each way; ``stall_ms`` is the
    time the compute stream waited at unpacking (timing events around the wait).
    """

    def __init__(self, min_bytes: int = 1 << 20, prefetch: int = 2) -> None:
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.out_bytes = 0
        self.in_bytes = 0
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stall_ms = 0.0

    @property
    def stall_ms(self) -> float:
        """Time the compute stream waited so far (synchronizes with the device)."""
        torch.cuda.synchronize()
        for start, end in self._waits:
            self._stall_ms += max(0.0, start.elapsed_time(end))
        self._waits.clear()
        return self._stall_ms

    def reset(self) -> None:
        _ = self.stall_ms
        self.out_bytes = self.in_bytes = 0
        self._stall_ms = 0.0

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        # The side streams, created at the first copy (a forward pass with nothing to copy
        # needs no device).
        side: dict[str, torch.cuda.Stream] = {}

        def stream(name: str) -> torch.cuda.Stream:
            if name not in side:
                side[name] = torch.cuda.Stream()
            return side[name]

        # index -> [host copy, its D2H event, (device copy, its H2D event) or None]
        entries: list[list[Any] | None] = []

        def keep_on_device(t: torch.Tensor) -> bool:
            base = t._base if t._base is not None else t
            return (
                not t.is_cuda
                or t.numel() * t.element_size() < self.min_bytes
                or not t.is_contiguous()
                or (base.is_leaf and base.requires_grad)
            )

        def pack(t: torch.Tensor) -> Any:
            if keep_on_device(t):
                # Detached: a saved output kept with its grad_fn would own the graph that
                # owns it, a cycle through C++ that no garbage collection breaks, and a step
                # abandoned before its backward (out of memory) would leak the whole graph
                # and the model. Autograd restores the grad_fn when it unpacks.
                return ("device", t.detach())
            d2h = stream("d2h")
            compute = torch.cuda.current_stream()
            d2h.wait_stream(compute)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with torch.cuda.stream(d2h):
                host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(d2h)
            t.record_stream(d2h)  # its memory is reused only after the copy
            self.out_bytes += t.numel() * t.element_size()
            entries.append([host, done, None])
            return ("host", len(entries) - 1)

        def fetch(index: int) -> None:
            entry = entries[index] if 0 <= index < len(entries) else None
            if entry is None or entry[2] is not None:
                return
            host, done, _ = entry
            h2d = stream("h2d")
            with torch.cuda.stream(h2d):
                h2d.wait_event(done)
                dev = torch.empty(host.shape, dtype=host.dtype, device="cuda")
                dev.copy_(host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(h2d)
            self.in_bytes += host.numel() * host.element_size()
            entry[2] = (dev, ready)

        def unpack(packed: Any) -> torch.Tensor:
            kind, value = packed
            if kind == "device":
                return value
            index = int(value)
            for ahead in range(index, index - self.prefetch - 1, -1):
                fetch(ahead)
            entry = entries[index]
            assert entry is not None and entry[2] is not None
            dev, ready = entry[2]
            compute = torch.cuda.current_stream()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(compute)
            compute.wait_event(ready)
            end.record(compute)
            self._waits.append((start, end))
            dev.record_stream(compute)
            entries[index] = None  # the host copy goes back to the caching host allocator
            return dev

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def torchtune_offload() -> Callable[[], Any] | None:
    """torchtune's ``OffloadActivations`` (a factory of its context managers) when torchtune
    is installed, else None."""
    try:
        from torchtune.training import OffloadActivations  # type: ignore[import-not-found]
    except Exception:  # not installed, or an incompatible version
        return None
    return lambda: OffloadActivations(use_streams=True)
