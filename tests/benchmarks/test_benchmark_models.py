"""benchmarks/models.py on the CPU: the workloads, checkpoint wrapping, save_on_cpu counting
(the GPT itself is lmsbench.models', tested in tests/lmsbench/test_lmsbench_models.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch.nn", reason="needs a torch wheel (the CPU one is enough)")
import torch

from benchmarks import models
from benchmarks.models import Checkpointed, SaveOnCpuCounter
from lmsbench.models import Block, GPTConfig

SMALL = GPTConfig(vocab=97, seq=16, dim=32, layers=3, heads=4)


def grads_after_step(model: torch.nn.Module, workload: models.Workload, batch: int) -> list:
    inputs, targets = workload.make_batch(batch, torch.device("cpu"), 0)
    workload.loss(model(inputs), targets).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_gpt_trains() -> None:
    torch.manual_seed(0)
    workload = models.gpt_workload(SMALL, batch=4)
    model = workload.build()
    optimizer = workload.make_optimizer(model)
    inputs, targets = workload.make_batch(4, torch.device("cpu"), 0)
    losses = []
    for _ in range(15):
        loss = workload.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_checkpointing_wraps_every_block_and_keeps_gradients() -> None:
    workload = models.gpt_workload(SMALL, batch=2)
    torch.manual_seed(0)
    plain = workload.build()
    torch.manual_seed(0)
    wrapped = workload.build()
    assert workload.checkpoint(wrapped) == SMALL.layers
    assert all(isinstance(b, Checkpointed) for b in wrapped.blocks)
    assert workload.checkpoint(wrapped) == SMALL.layers  # idempotent: no double wrapping
    assert not isinstance(wrapped.blocks[0].inner, Checkpointed)
    for a, b in zip(grads_after_step(plain, workload, 2), grads_after_step(wrapped, workload, 2)):
        torch.testing.assert_close(a, b)


def test_checkpointed_block_keeps_fewer_saved_tensors() -> None:
    torch.manual_seed(0)
    block = Block(32, 4)
    x = torch.randn(2, 8, 32, requires_grad=True)
    counts = []
    for module in (block, Checkpointed(block)):
        counter = SaveOnCpuCounter(pin_memory=True)
        with counter.context():
            module(x).sum().backward()
        counts.append(counter.out_count)
    assert counts[1] < counts[0]


def test_save_on_cpu_counter_counts_saved_bytes() -> None:
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(16, 64)
    counter = SaveOnCpuCounter(pin_memory=True)
    with counter.context():
        y = (x @ w).relu()  # saves x (w's gradient needs it) and relu's result
    loss = y.sum()
    assert counter.out_count == 2
    assert counter.out_bytes == (x.numel() + y.numel()) * 4
    assert counter.in_bytes == 0
    loss.backward()
    assert counter.in_count == counter.out_count
    assert counter.in_bytes == counter.out_bytes
    reference = (x @ w.detach().requires_grad_()).relu()
    assert torch.equal(reference, y.detach())


def test_image_workloads_need_torchvision_only_when_built() -> None:
    workload = models.resnet152_workload(image_size=64, classes=10, batch=2)
    images, labels = workload.make_batch(2, torch.device("cpu"), 0)
    assert images.shape == (2, 3, 64, 64) and labels.shape == (2,)
    with pytest.raises(ValueError, match="divisible by 16"):
        models.vit_l_workload(image_size=100)
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="needs torchvision"):
            workload.build()
    except Exception as exc:  # a torchvision that does not match this torch
        pytest.skip(f"torchvision does not import here: {exc}")
    else:
        model = workload.build()
        assert workload.checkpoint(model) == 3 + 8 + 36 + 3


def test_make_optimizer() -> None:
    model = torch.nn.Linear(2, 2)
    assert isinstance(models.make_optimizer(model, "sgd"), torch.optim.SGD)
    assert isinstance(models.make_optimizer(model, "adamw"), torch.optim.AdamW)
    with pytest.raises(ValueError):
        models.make_optimizer(model, "lion")


def _stack() -> torch.nn.Module:
    # ReLU saves its output: the saved tensor whose grad_fn owns it.
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_stream_offload_keeps_no_graph_alive_after_an_abandoned_step() -> None:
    import gc
    import weakref

    # On the CPU every saved tensor stays where it is, the path that parameters, views and
    # small tensors take on a GPU. A step that fails before its backward (out of memory)
    # must leave nothing behind: a kept tensor with its grad_fn would form a cycle through
    # C++ that no collection breaks, and the next rows would run with less memory.
    torch.manual_seed(0)
    model = _stack()
    weight = weakref.ref(model[0].weight)
    offload = models.StreamOffload()
    with pytest.raises(RuntimeError, match="abandoned"):
        with offload.context():
            out = model(torch.randn(8, 16))
            raise RuntimeError("abandoned before backward")
    del model, out
    gc.collect()
    assert weight() is None

    # Nothing is lost by keeping detached tensors: the same gradients as without hooks.
    torch.manual_seed(0)
    plain = _stack()
    torch.manual_seed(0)
    hooked = _stack()
    x = torch.randn(8, 16)
    plain(x).square().sum().backward()
    with offload.context():
        y = hooked(x).square().sum()
    y.backward()
    for a, b in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert offload.out_bytes == 0  # nothing left the device
