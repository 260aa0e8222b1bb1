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


def _train_reduce_overhead(steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Adam steps of a feed-forward stack compiled with mode="reduce-overhead" (CUDA graphs
    from the second step on); returns losses, parameters and the peak allocated bytes."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = FeedForwardStack(width=2048, depth=8).cuda()
    step_fn = torch.compile(model, mode="reduce-overhead")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = token_batches(tokens=4096, width=2048)
    losses = []
    try:
        for step in range(steps):
            x, y = batches(step)
            loss = F.cross_entropy(step_fn(x), y)
            loss.backward()
            losses.append(loss.detach().cpu())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        params = [p.detach().cpu() for p in model.parameters()]
        torch.cuda.synchronize()
        return losses, params, torch.cuda.max_memory_allocated() - base
    finally:
        del model, step_fn, optimizer
        torch._dynamo.reset()


def test_reduce_overhead_under_a_cap_that_leaves_room_for_the_graph_pool(
    record: Callable[[str, Any], None],
) -> None:
    """CUDA graphs' private pools are never paged out; LMS pages out what lies outside them
    (Adam's state here) to make room, reports the pools' size, and trains bit-identically."""
    from lms_regression_harness import lms_summary, memory_cap, settle

    settle()
    losses, params, peak = _train_reduce_overhead(steps=5)
    settle()
    adam_state = 2 * sum(p.numel() * p.element_size() for p in params)
    cap = peak - adam_state // 2
    record("peak_mib", round(peak / 2**20, 1))
    record("cap_mib", round(cap / 2**20, 1))
    with memory_cap(cap):
        torch.cuda.set_enabled_lms(True)
        capped_losses, capped_params, _ = _train_reduce_overhead(steps=5)
        stats = torch.cuda.lms_stats()
    record("lms", lms_summary(stats))
    record("private_pool_mib", round(stats["private_pool_bytes"]["peak"] / 2**20, 1))
    assert stats["private_pool_bytes"]["peak"] > 0, "no private pool was reported"
    assert stats["pageout_count"] > 0, "LMS made no room outside the graph pool"
    for step, (a, b) in enumerate(zip(losses, capped_losses)):
        assert torch.equal(a, b), f"loss of step {step} differs"
    for i, (a, b) in enumerate(zip(params, capped_params)):
        assert torch.equal(a, b), f"parameter {i} differs"


def test_graph_pool_that_cannot_fit_raises_the_lms_message() -> None:
    """Under a cap far below what the graphs need, the error names the private pools."""
    from lms_regression_harness import memory_cap, settle

    settle()
    _, _, peak = _train_reduce_overhead(steps=1)
    settle()
    with memory_cap(peak // 4):
        torch.cuda.set_enabled_lms(True)
        with pytest.raises(torch.OutOfMemoryError, match="Large Model Support"):
            _train_reduce_overhead(steps=3)
