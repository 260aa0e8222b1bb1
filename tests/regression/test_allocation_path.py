"""The allocation path under Large Model Support, sized so that the behaviour under test
really happens: an allocation inside an operator larger than the room left under the cap, a
limit well under what the tensors need, and an operator whose own inputs cannot all be
resident at once. Each case checks the contents it ends with, not only that it did not fail."""

from __future__ import annotations

from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch

from tests.regression.lms_regression_harness import MiB, deterministic, lms_summary, memory_cap

GiB = 1024 * MiB


def _filled(value: float, nbytes: int) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` holding ``value``, made inactive (an operator used it)."""
    t = torch.empty(nbytes // 4, device="cuda")
    t.fill_(value)
    return t


def _values(tensors: list[torch.Tensor]) -> list[float]:
    """Each tensor's single value, checked to be uniform (reads page storages in)."""
    out = []
    for t in tensors:
        lo, hi = torch.aminmax(t)
        assert lo.item() == hi.item(), "a tensor lost its contents"
        out.append(lo.item())
    return out


def test_allocation_inside_an_operator_larger_than_the_room_left(
    record: Callable[[str, Any], None],
) -> None:
    """``torch.cat`` allocates 768 MiB inside the operator while 1.5 GiB of inactive
    tensors fill a 2 GiB cap: the allocation must page out what the operator does not use."""
    torch.cuda.set_enabled_lms(True)
    with memory_cap(2 * GiB):
        xs = [_filled(float(i), 256 * MiB) for i in range(6)]
        before = torch.cuda.lms_stats()["pageout_bytes"]
        joined = torch.cat(xs[:3])
        stats = torch.cuda.lms_stats()
        assert stats["pageout_bytes"] - before >= 256 * MiB, lms_summary(stats)
        assert torch.cuda.memory_reserved() <= 2 * GiB
        assert _values(xs) == [float(i) for i in range(6)]
        assert _values(list(joined.chunk(3))) == [0.0, 1.0, 2.0]
    record("lms", lms_summary(torch.cuda.lms_stats()))


def test_a_limit_is_a_limit(record: Callable[[str, Any], None]) -> None:
    """``set_limit_lms(1 GiB)`` with 2 GiB of tensors: allocated memory stays at the limit plus
    what running operators pin (one 128 MiB tensor at a time here)."""
    torch.cuda.set_enabled_lms(True)
    torch.cuda.set_limit_lms(1 * GiB)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    xs = []
    for i in range(16):
        xs.append(_filled(float(i), 128 * MiB))
        assert torch.cuda.memory_allocated() - base <= 1 * GiB + 128 * MiB
    stats = torch.cuda.lms_stats()
    assert stats["pageout_bytes"] >= 1 * GiB, lms_summary(stats)
    assert stats["over_limit_bytes"]["peak"] <= 128 * MiB, lms_summary(stats)
    assert torch.cuda.max_memory_allocated() - base <= 1 * GiB + 128 * MiB
    assert _values(xs) == [float(i) for i in range(16)]
    record("peak_over_limit_bytes", stats["over_limit_bytes"]["peak"])
    if "copy_out_bytes" in stats:  # engines that time their copies
        torch.cuda.synchronize()
        timed = torch.cuda.lms_stats()
        # Every copy is timed once it is done: the bytes each way are those paged.
        assert timed["copy_out_bytes"] == timed["pageout_bytes"], lms_summary(timed)
        assert timed["copy_in_bytes"] == timed["pagein_bytes"], lms_summary(timed)
        assert timed["copy_out_ms"] > 0.0, lms_summary(timed)
        record("copy_out_gb_per_s", timed["copy_out_bytes"] / (timed["copy_out_ms"] * 1e6))
    record("lms", lms_summary(stats))


def test_operator_whose_inputs_do_not_fit_raises_and_loses_nothing() -> None:
    """``torch.cat`` of 1.2 GiB of inputs (and as much output) under a 1 GiB cap cannot run:
    it raises ``torch.OutOfMemoryError`` with the LMS message, the process goes on, and
    every tensor keeps its contents."""
    torch.cuda.set_enabled_lms(True)
    with memory_cap(1 * GiB):
        xs = [_filled(float(i + 1), 400 * MiB) for i in range(3)]
        failures = torch.cuda.lms_stats()["pin_failures"]
        with pytest.raises(torch.OutOfMemoryError, match="Large Model Support"):
            torch.cat(xs)
        assert torch.cuda.lms_stats()["pin_failures"] > failures
        assert _values(xs) == [1.0, 2.0, 3.0]
        # The device is still usable.
        y = torch.cat(xs[:1]) * 2
        assert _values([y]) == [2.0]


def test_in_place_operator_whose_inputs_do_not_fit_never_faults() -> None:
    """``_foreach_mul_`` over 1.2 GiB under a 1 GiB cap (Adam's foreach step pins every
    parameter at once like this). It either raises ``torch.OutOfMemoryError`` before touching
    anything or, allocating nothing, runs on the host copies of the inputs left out: never a
    fault, never a half-applied update."""
    torch.cuda.set_enabled_lms(True)
    with memory_cap(1 * GiB):
        xs = [_filled(float(i + 1), 400 * MiB) for i in range(3)]
        failures = torch.cuda.lms_stats()["pin_failures"]
        try:
            torch._foreach_mul_(xs, 2.0)
        except torch.OutOfMemoryError as exc:
            assert "Large Model Support" in str(exc)
            expected = [1.0, 2.0, 3.0]
        else:
            expected = [2.0, 4.0, 6.0]
        torch.cuda.synchronize()
        assert torch.cuda.lms_stats()["pin_failures"] > failures
        assert _values(xs) == expected


def test_workspace_the_cap_cannot_hold_goes_to_the_host_with_the_same_bits(
    record: Callable[[str, Any], None],
) -> None:
    """A convolution backward (batch 103, 32 channels, 128x128, fp32, deterministic) asks
    cuDNN for a workspace of several GiB uncapped; under a 1.5 GiB cap, beside its 650 MiB of
    tensors, no placement on the device holds it. LMS places it in pinned host memory, cuDNN
    keeps the plan it picks uncapped, and the gradients are bit-identical to the uncapped
    ones. With host placement off nothing goes to the host (cuDNN then picks another plan)."""
    if not hasattr(torch.cuda, "set_host_placement_lms"):
        pytest.skip("this LMS build has no host placement (torch.cuda.set_host_placement_lms)")
    deterministic()
    torch.cuda.set_enabled_lms(True)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(32, 32, 3, padding=1).cuda()
    x = torch.randn(103, 32, 128, 128, device="cuda", requires_grad=True)
    grad = torch.randn_like(x)

    def grads() -> list[torch.Tensor]:
        out = torch.autograd.grad(conv(x), [x, conv.weight, conv.bias], grad)
        return [g.detach().clone() for g in out]

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    uncapped = grads()
    need = torch.cuda.max_memory_allocated() - base
    cap = 1536 * MiB
    assert need > 2 * cap, f"the backward needs {need / MiB:.0f} MiB: too little to test a cap"
    before = torch.cuda.lms_stats()
    with memory_cap(cap):
        capped = grads()
        placed = torch.cuda.lms_stats()
        torch.cuda.set_host_placement_lms(False)
        without = grads()
        after = torch.cuda.lms_stats()
    count = placed["host_placement_count"] - before["host_placement_count"]
    placed_bytes = placed["host_placement_bytes"] - before["host_placement_bytes"]
    assert count >= 1, lms_summary(placed)
    assert placed_bytes >= need - cap, lms_summary(placed)
    assert all(torch.equal(a, b) for a, b in zip(uncapped, capped))
    assert after["host_placement_count"] == placed["host_placement_count"]
    record("uncapped_need_mib", round(need / MiB))
    record("host_placement_mib", round(placed_bytes / MiB))
    same = all(torch.equal(a, b) for a, b in zip(uncapped, without))
    record("identical_with_placement_off", same)
    record("lms", lms_summary(placed))
