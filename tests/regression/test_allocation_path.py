"""The allocation path under Large Model Support, sized so that the behaviour under test
really happens: an allocation inside an operator larger than the room left under the cap, a
limit well under what the tensors need, and an operator whose own inputs cannot all be
resident at once. Each case checks the contents it ends with, not only that it did not fail."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch

from tests.regression.lms_regression_harness import (
    MiB,
    assert_identical,
    deterministic,
    failed_allocations,
    host_bytes,
    lms_summary,
    memory_cap,
    release_library_workspaces,
    settle,
    train,
)

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


def test_a_profile_names_the_allocations_lms_reclaims_for(tmp_path: Path) -> None:
    """Under ``torch.profiler`` the drop-in marks its part of an allocation
    (``lms::allocate``) and, inside it, the caching allocator's malloc
    (``lms::caching_allocator_malloc``): 16 tensors of 128 MiB under a 1 GiB limit page out,
    and every allocation of theirs shows both ranges, the allocator's inside LMS's."""
    from lmsbench.lms_setup import ensure_lms_api

    if ensure_lms_api() != "extension":
        pytest.skip("the profiler ranges are the drop-in extension's")
    torch.cuda.set_enabled_lms(True)
    torch.cuda.set_limit_lms(1 * GiB)
    before = torch.cuda.lms_stats()["pageout_bytes"]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        xs = [_filled(float(i), 128 * MiB) for i in range(16)]
        torch.cuda.synchronize()
    stats = torch.cuda.lms_stats()
    assert stats["pageout_bytes"] - before >= 512 * MiB, lms_summary(stats)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [
        e
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("lms::")
    ]
    outer = [e for e in events if e["name"] == "lms::allocate"]
    inner = [e for e in events if e["name"] == "lms::caching_allocator_malloc"]
    assert len(outer) >= 16, sorted({e["name"] for e in events})
    assert len(inner) >= 16, sorted({e["name"] for e in events})
    for e in inner:  # each malloc lies inside an allocation of LMS
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        assert any(
            float(o["ts"]) <= start and end <= float(o["ts"]) + float(o.get("dur", 0.0))
            for o in outer
        ), e
    assert _values(xs) == [float(i) for i in range(16)]


def _largest_free_block() -> int:
    """The largest free block of the caching allocator's large pool on this device."""
    device = torch.cuda.current_device()
    largest = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != device or segment.get("segment_type") != "large":
            continue
        for block in segment.get("blocks", []):
            if block.get("state") == "inactive":
                largest = max(largest, int(block["size"]))
    return largest


def test_a_request_no_free_block_holds_is_placed_before_the_cache_is_released(
    record: Callable[[str, Any], None],
) -> None:
    """Under a 1 GiB cap, 8 MiB tensors fill 90% of LMS's limit and every other one is freed:
    the allocator holds 8 MiB holes. 9 MiB tensors, which fit no hole, then map more until the
    cap has no room for 12 MiB, and fillers shrink every free block to less than that. A 12 MiB
    tensor then fits no free block, takes the allocator past neither LMS's limit nor the size
    LMS places ahead (16 MiB), and the cap cannot map it: the allocator would return its cache
    to the device (``num_alloc_retries``, a synchronization) and map it anew. LMS pages out a
    tensor between two holes before that (with the drop-in, from the stock allocator's
    free-memory callback; a patched build after its device allocation failed, also before the
    cache goes), and the request lands in the run. Every step's precondition is checked."""
    torch.cuda.set_enabled_lms(True)
    cap = 1 * GiB
    request_bytes = 12 * MiB
    with memory_cap(cap):
        first = _filled(-1.0, 8 * MiB)  # the limit is sampled at the first LMS allocation
        limit = int(torch.cuda.lms_stats()["limit_bytes"])
        filled = [first] + [
            _filled(float(i), 8 * MiB) for i in range(1, int(0.9 * limit) // (8 * MiB))
        ]
        kept = filled[1::2]
        kept_values = [float(i) for i in range(1, len(filled), 2)]
        del filled, first
        extra: list[torch.Tensor] = []
        while (
            torch.cuda.memory_reserved() + request_bytes <= cap
            and torch.cuda.memory_allocated() + 21 * MiB <= limit
        ):
            extra.append(_filled(100.0 + len(extra), 9 * MiB))
        # Each filler takes a free block of 12 MiB or more down to 2 MiB: at 10 MiB or more
        # it is larger than every hole, so the best fit is such a block.
        fillers: list[torch.Tensor] = []
        for _ in range(64):
            largest = _largest_free_block()
            if largest < request_bytes:
                break
            fillers.append(_filled(200.0 + len(fillers), largest - 2 * MiB))
        reserved = torch.cuda.memory_reserved()
        allocated = torch.cuda.memory_allocated()
        assert reserved + request_bytes > cap, f"setup: room to map, {reserved} under {cap}"
        assert allocated + request_bytes <= limit, f"setup: {allocated} over a {limit} limit"
        assert _largest_free_block() < request_bytes, "setup: a free block holds the request"
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        before = torch.cuda.lms_stats()
        request = _filled(99.0, request_bytes)
        after = torch.cuda.lms_stats()
        assert torch.cuda.memory_stats().get("num_alloc_retries", 0) == retries, lms_summary(after)
        moved = (after["fragment_placements"] - before["fragment_placements"]) + (
            after["fragment_reclaims"] - before["fragment_reclaims"]
        )
        assert moved == 1, lms_summary(after)
        assert after["pageout_bytes"] > before["pageout_bytes"], lms_summary(after)
        assert _values(kept) == kept_values
        assert _values(extra) == [100.0 + i for i in range(len(extra))]
        assert _values(fillers) == [200.0 + i for i in range(len(fillers))]
        assert _values([request]) == [99.0]
    record("lms", lms_summary(torch.cuda.lms_stats()))


def _has_input_placement() -> bool:
    """Whether this LMS build keeps inputs the device cannot hold in host memory."""
    return "input_host_placement_count" in torch.cuda.lms_stats()


def test_operator_whose_inputs_do_not_fit_runs_with_some_on_the_host(
    record: Callable[[str, Any], None],
) -> None:
    """``torch.cat`` of 1.2 GiB of inputs (and as much output) under a 1 GiB cap: two of its
    400 MiB inputs fit beside each other, the third stays in host memory for the operator and
    its output is placed there too, and every tensor keeps its contents. With host placement
    off it raises ``torch.OutOfMemoryError`` with the LMS message, the process goes on, and
    every tensor keeps its contents."""
    if not _has_input_placement():
        pytest.skip("this LMS build keeps no operator inputs in host memory")
    torch.cuda.set_enabled_lms(True)
    with memory_cap(1 * GiB):
        xs = [_filled(float(i + 1), 400 * MiB) for i in range(3)]
        before = torch.cuda.lms_stats()
        joined = torch.cat(xs)
        after = torch.cuda.lms_stats()
        assert after["input_host_placement_count"] > before["input_host_placement_count"]
        placed = after["input_host_placement_bytes"] - before["input_host_placement_bytes"]
        assert placed == 400 * MiB, lms_summary(after)
        assert after["pin_failures"] == before["pin_failures"]
        assert _values(list(joined.chunk(3))) == [1.0, 2.0, 3.0]
        del joined
        assert _values(xs) == [1.0, 2.0, 3.0]
        record("input_host_placement_mib", round(placed / MiB))

        torch.cuda.set_host_placement_lms(False)
        failures = torch.cuda.lms_stats()["pin_failures"]
        with pytest.raises(torch.OutOfMemoryError, match="Large Model Support"):
            torch.cat(xs)
        assert torch.cuda.lms_stats()["pin_failures"] > failures
        assert _values(xs) == [1.0, 2.0, 3.0]
        # The device is still usable.
        y = torch.cat(xs[:1]) * 2
        assert _values([y]) == [2.0]


def test_in_place_operator_whose_inputs_do_not_fit_writes_them_where_they_are() -> None:
    """``_foreach_mul_`` over 1.2 GiB under a 1 GiB cap (Adam's foreach step pins every
    parameter at once like this). The input the device cannot hold beside the others stays in
    host memory and is multiplied there, over the bus; it is paged in with its new contents
    when next read. With host placement off it either raises ``torch.OutOfMemoryError``
    before touching anything or, allocating nothing, runs on the host copies of the inputs
    left out: never a fault, never a half-applied update."""
    if not _has_input_placement():
        pytest.skip("this LMS build keeps no operator inputs in host memory")
    torch.cuda.set_enabled_lms(True)
    with memory_cap(1 * GiB):
        xs = [_filled(float(i + 1), 400 * MiB) for i in range(3)]
        before = torch.cuda.lms_stats()
        torch._foreach_mul_(xs, 2.0)
        after = torch.cuda.lms_stats()
        assert after["input_host_placement_count"] > before["input_host_placement_count"]
        assert after["pin_failures"] == before["pin_failures"]
        assert _values(xs) == [2.0, 4.0, 6.0]

        torch.cuda.set_host_placement_lms(False)
        torch.cuda.reclaim_inactive()
        failures = torch.cuda.lms_stats()["pin_failures"]
        try:
            torch._foreach_mul_(xs, 2.0)
        except torch.OutOfMemoryError as exc:
            assert "Large Model Support" in str(exc)
            expected = [2.0, 4.0, 6.0]
        else:
            expected = [4.0, 8.0, 12.0]
        torch.cuda.synchronize()
        assert torch.cuda.lms_stats()["pin_failures"] > failures
        assert _values(xs) == expected


class _Lstm(torch.nn.Module):
    """A 4-layer cuDNN LSTM: input 512, hidden 2048 (122 M parameters, one 486 MiB buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(512, 2048, num_layers=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def _lstm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence 256, batch 64: the inputs and the targets of the outputs, seeded by step."""
    g = torch.Generator(device="cuda").manual_seed(step)
    inputs = torch.randn(256, 64, 512, device="cuda", generator=g)
    targets = torch.randn(256, 64, 2048, device="cuda", generator=g)
    return inputs, targets


def test_lstm_whose_backward_inputs_pass_the_cap_trains_with_the_same_bits(
    record: Callable[[str, Any], None],
) -> None:
    """A 4-layer cuDNN LSTM (input 512, hidden 2048, batch 64, sequence 256, Adam) under a cap
    of half its uncapped peak. The inputs of its backward, ``aten::_cudnn_rnn_backward`` (the
    forward's reserve space, about 2.9 GiB, the weights, the activations: about 3.6 GiB in
    seven storages), pass the cap, so they cannot all be resident at once. LMS keeps the
    largest of them in host memory for the operator, which reads it over the bus, and three
    training steps give the uncapped losses, gradients and parameters bit for bit. With host
    placement off the same training runs out of memory (the message is recorded)."""
    if not _has_input_placement():
        pytest.skip("this LMS build keeps no operator inputs in host memory")
    mse = torch.nn.functional.mse_loss
    steps = 3
    settle()
    reference = train(_Lstm, _lstm_batch, mse, steps)
    release_library_workspaces()
    settle()
    baseline = torch.cuda.memory_allocated()
    cap = reference.peak_bytes // 2
    record("peak_mib", round(reference.peak_bytes / MiB))
    record("cap_mib", round(cap / MiB))
    torch.cuda.set_enabled_lms(True)
    with memory_cap(cap):
        host_baseline = host_bytes()
        torch.cuda.reset_accumulated_lms_stats()
        ooms = failed_allocations()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            capped = train(_Lstm, _lstm_batch, mse, steps)
        record("capped_seconds", round(time.perf_counter() - start, 1))
        stats = torch.cuda.lms_stats()
        record("lms", lms_summary(stats))
        record("allocations_failed_and_caught", failed_allocations() - ooms)
        record(
            "warned",
            [str(w.message)[:160] for w in caught if "Large Model Support" in str(w.message)],
        )
        torch.cuda.set_host_placement_lms(False)
        oom = None
        try:
            train(_Lstm, _lstm_batch, mse, steps)
        except torch.OutOfMemoryError as exc:
            oom = str(exc)
        record("placement_off_error", None if oom is None else oom[:600])
        torch.cuda.set_host_placement_lms(True)
        settle()
    assert stats["input_host_placement_count"] > 0, lms_summary(stats)
    assert stats["input_host_placement_bytes"] > 0, lms_summary(stats)
    assert stats["pin_failures"] == 0, lms_summary(stats)
    assert stats["oom_count"] == 0, lms_summary(stats)
    assert capped.peak_bytes <= cap
    assert_identical(reference, capped)
    assert oom is not None, "with host placement off the LSTM trained under the cap"
    del reference, capped
    release_library_workspaces()
    settle()
    assert torch.cuda.memory_allocated() == baseline, "device memory did not return to baseline"
    assert host_bytes() == host_baseline, "LMS still holds pinned host memory"
    assert torch.cuda.lms_stats()["managed_bytes"]["current"] == 0


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
