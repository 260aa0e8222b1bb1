"""Models compiled with ``torch.compile`` (default mode) trained under a memory cap with Large
Model Support. Inductor's buffers are allocated through the caching allocator, so they are LMS
storages; its Triton kernels are launched from Python, and each launch pins its tensor
arguments for the launch (``torch/cuda/lms.py``), so the activations they write are
reclaimable between forward and backward. The same checks as ``test_models.py``: the cap
makes training without LMS fail, LMS trains under it, bit-identical to the uncapped compiled
run.

Compiled with ``mode="reduce-overhead"``, the compiled regions are captured into CUDA graphs,
whose private pool LMS never pages out. Where that pool fits under the cap, LMS makes room for
it; where it does not, the warm-up or capture that runs out of memory makes the compiled code
run without CUDA graphs (one warning), paged like eager code, and training goes on with the
results of the uncapped run. The pool of an earlier run's CUDA graph tree, idle and left
behind in the process, goes back to the device when nothing else makes room.

mode="max-autotune" and a decoder compiled with dynamic shapes train at 1/2 and 1/4 of their
own compiled peak; each of these rows also checks that training without LMS runs out of memory
under its cap (after the LMS run, for cuDNN's plan cache)."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch

from lmsbench.models import resnet
from tests.regression.lms_families import transformer_lm
from tests.regression.lms_regression_harness import (
    Batch,
    check_capped_training,
    first_difference,
    host_bytes,
    max_relative_difference,
)

nn = torch.nn
F = torch.nn.functional


def check_paged_under_the_cap(stats: dict[str, Any], peak_bytes: int, cap: int) -> None:
    """LMS made the room the cap asks for: it paged out, paged back in, and the run's peak
    stayed under the cap."""
    assert stats["pageout_count"] > 0, "LMS trained under the cap without paging anything out"
    assert stats["pagein_count"] > 0, "nothing paged out was ever paged back in"
    assert peak_bytes <= cap


def check_out_of_memory_without_lms(
    run: Callable[[], Any], cap: int, peak: int | None = None
) -> None:
    """Training under the same cap without LMS runs out of memory, so the cap binds. Called
    after the LMS run: a run that ran short first would leave cuDNN's fallback plans to it."""
    from tests.regression.lms_regression_harness import MiB, memory_cap

    oom = None
    with memory_cap(cap):
        try:
            run()
        except torch.OutOfMemoryError as exc:
            oom = exc
    of_peak = f" (compiled peak {peak / MiB:.0f} MiB)" if peak is not None else ""
    assert oom is not None, (
        f"training fit under a cap of {cap / MiB:.0f} MiB without LMS{of_peak}: the cap "
        "proves nothing"
    )


def check_against_references(
    reference: Any, capped: Any, difference: Any, spread: float, record: Callable[[str, Any], None]
) -> None:
    """Bit-identical where the two uncapped references are (``difference`` is None). Where
    they are not, the row cannot be judged bit for bit: it records how far the capped run is
    and is reported as not judged (skipped with both figures), never passed on a tolerance."""
    if difference is None:
        mismatch = first_difference(reference, capped)
        assert mismatch is None, f"the capped run differs from the uncapped one: {mismatch}"
        return
    off = max_relative_difference(reference, capped)
    record("capped_max_relative_difference", off)
    not_judged(spread, off, record)


def not_judged(spread: float, off: float, record: Callable[[str, Any], None]) -> None:
    """Reports a row whose two uncapped references differ: it cannot be judged bit for bit,
    so it is neither passed nor failed on a tolerance."""
    record("verdict", "not judged: the uncapped references do not repeat")
    pytest.skip(
        f"not judged bit for bit: the two uncapped references differ by {spread:.3g} "
        f"(the capped run is {off:.3g} off the first; both recorded)"
    )


def record_references(
    reference: Any, repeat: Any, difference: Any, record: Callable[[str, Any], None]
) -> float:
    """Records whether the two uncapped references are identical (``difference`` is None:
    the capped run is then judged bit for bit) and, where not, what differs and by how much;
    returns that spread (0.0 when identical)."""
    record("references_identical", difference is None)
    if difference is None:
        return 0.0
    spread = max_relative_difference(reference, repeat)
    record("references_difference", difference)
    record("references_max_relative_difference", spread)
    return spread


@contextlib.contextmanager
def lms_on(limit: int) -> Iterator[list[warnings.WarningMessage]]:
    """LMS enabled with ``limit`` and its statistics reset, for a capped run; yields the
    warnings given meanwhile (every one, not only the first of a kind)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_enabled_lms(True)
        torch.cuda.set_limit_lms(limit)
        torch.cuda.reset_accumulated_lms_stats()
        torch.cuda.reset_peak_lms_stats()
        yield caught


def check_back_to_baseline(
    baseline: int, host_baseline: int, settle_memory: Callable[[], None]
) -> None:
    """With LMS off and the runs' tensors gone, device and host memory are back where they
    were."""
    settle_memory()
    assert torch.cuda.memory_allocated() == baseline, "device memory did not return to baseline"
    assert host_bytes() == host_baseline, "LMS still holds pinned host memory"
    assert torch.cuda.lms_stats()["managed_bytes"]["current"] == 0


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
    matmuls are extern kernels; every block saves 4 x 128 MiB of activations for backward (at
    the default sizes). ``expansion`` is the hidden layer's width over ``width``."""

    def __init__(self, width: int = 2048, depth: int = 12, expansion: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, expansion * width),
                nn.GELU(),
                nn.Linear(expansion * width, width),
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


@pytest.mark.parametrize("cap_share", [0.5, 0.25], ids=["half", "quarter"])
def test_compiled_resnet50(cap_share: float, record: Callable[[str, Any], None]) -> None:
    pytest.importorskip("torchvision.models", reason="torchvision is not installed")

    def batches(step: int) -> Batch:
        g = torch.Generator(device="cuda").manual_seed(1000 + step)
        images = torch.randn(32, 3, 192, 192, device="cuda", generator=g)
        labels = torch.randint(0, 100, (32,), device="cuda", generator=g)
        return images, labels

    check_capped_training(
        lambda: torch.compile(resnet(50, 100)),
        batches,
        F.cross_entropy,
        steps=3,
        record=record,
        cap_share=cap_share,
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
    # One parameter per optimizer operator: the graphs' private pools keep the activations
    # and gradients on the device, and the room left under the cap holds the update of one
    # parameter at a time, not of all of them at once (foreach).
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
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


def _reduce_overhead_references(
    steps: int, record: Callable[[str, Any], None]
) -> tuple[tuple[list[torch.Tensor], list[torch.Tensor]], Any, int, bool]:
    """Two uncapped runs of :func:`_train_reduce_overhead`: the first's losses and parameters,
    the second's, the first's peak, and whether they repeat bit for bit (only then is
    bit-identity the bar; recorded as ``reference_repeats``)."""
    from tests.regression.lms_regression_harness import settle

    settle()
    losses, params, peak = _train_reduce_overhead(steps=steps)
    settle()
    losses_2, params_2, _ = _train_reduce_overhead(steps=steps)
    settle()
    repeats = all(torch.equal(a, b) for a, b in zip(losses + params, losses_2 + params_2))
    record("reference_repeats", repeats)
    return (losses, params), (losses_2, params_2), peak, repeats


def test_reduce_overhead_under_a_cap_that_leaves_room_for_the_graph_pool(
    record: Callable[[str, Any], None],
) -> None:
    """CUDA graphs' private pools are never paged out; LMS pages out what lies outside them
    (Adam's state here) to make room, reports the pools' size, and trains bit-identically."""
    from tests.regression.lms_regression_harness import lms_summary, memory_cap

    reference, reference_2, peak, repeats = _reduce_overhead_references(5, record)
    adam_state = 2 * sum(p.numel() * p.element_size() for p in reference[1])  # its parameters
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
    check_reduce_overhead_run(
        reference, reference_2, (capped_losses, capped_params), repeats, record
    )


def check_reduce_overhead_run(
    reference: tuple[list[torch.Tensor], list[torch.Tensor]],
    repeat: tuple[list[torch.Tensor], list[torch.Tensor]],
    capped: tuple[list[torch.Tensor], list[torch.Tensor]],
    repeats: bool,
    record: Callable[[str, Any], None],
) -> None:
    """Losses and parameters of a capped reduce-overhead run against the uncapped ones:
    bit-identical where the two uncapped runs are (``repeats``). Where they are not, the row
    cannot be judged bit for bit and is reported as such (``not_judged``)."""
    (losses, params), (_, params_2), (capped_losses, capped_params) = reference, repeat, capped
    if repeats:
        for step, (a, b) in enumerate(zip(losses, capped_losses)):
            assert torch.equal(a, b), f"loss of step {step} differs"
        for i, (a, b) in enumerate(zip(params, capped_params)):
            assert torch.equal(a, b), f"parameter {i} differs"
        return
    spread = max((a - b).abs().max().item() for a, b in zip(params, params_2))
    off = max((a - c).abs().max().item() for a, c in zip(params, capped_params))
    record("reference_spread", spread)
    record("capped_difference", off)
    not_judged(spread, off, record)


def _graph_pool_fallbacks(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings LMS gave when a CUDA graph pool did not fit and compiled code went on
    without CUDA graphs."""
    return [
        str(w.message)
        for w in caught
        if type(w.message).__name__ == "GraphPoolFallbackWarning"
        or "now run without CUDA graphs" in str(w.message)
    ]


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def test_graph_pool_that_cannot_fit_falls_back_to_running_without_graphs(
    record: Callable[[str, Any], None],
) -> None:
    """Under a cap far below what the graph pool needs (a quarter of the peak: the forward's
    activations alone, which its warm-up keeps in the pool, do not fit), the warm-up runs out
    of memory in the pool: LMS warns once, the compiled code runs without CUDA graphs from then
    on, paged like eager code, and training gives the uncapped run's losses and parameters."""
    from tests.regression.lms_regression_harness import lms_summary, memory_cap

    reference, reference_2, peak, repeats = _reduce_overhead_references(3, record)
    cap = peak // 4
    record("peak_mib", round(peak / 2**20, 1))
    record("cap_mib", round(cap / 2**20, 1))
    skips = _cudagraph_skips()
    with memory_cap(cap), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_enabled_lms(True)
        torch.cuda.reset_accumulated_lms_stats()
        capped_losses, capped_params, _ = _train_reduce_overhead(steps=3)
        stats = torch.cuda.lms_stats()
    fallbacks = _graph_pool_fallbacks(caught)
    record("lms", lms_summary(stats))
    record("fallback_warnings", fallbacks)
    assert len(fallbacks) == 1, f"expected one fallback warning, got {fallbacks}"
    assert "the pool held" in fallbacks[0] and "MiB" in fallbacks[0], fallbacks[0]
    record("cudagraph_skips", _cudagraph_skips() - skips)
    assert _cudagraph_skips() > skips, "Inductor's skip counter did not count the fallback"
    assert stats["pageout_bytes"] > 0, "LMS paged nothing out after the fallback"
    check_reduce_overhead_run(
        reference, reference_2, (capped_losses, capped_params), repeats, record
    )


def _resnet50_batches(step: int) -> Batch:
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    images = torch.randn(32, 3, 192, 192, device="cuda", generator=g)
    labels = torch.randint(0, 100, (32,), device="cuda", generator=g)
    return images, labels


def _train_resnet50_reduce_overhead(
    steps: int, fresh_tree: bool = True
) -> tuple[Any, list[torch.Tensor]]:
    """The harness's deterministic ``train`` of ResNet-50 compiled with
    mode="reduce-overhead", in a fresh CUDA graph tree (the graphs and the pool of an earlier
    run go back to the device first) unless ``fresh_tree`` is false (the tree of an earlier
    run, with its graphs and pool, serves this one); returns the run and the model's buffers
    (batch norm statistics, which the compiled forward mutates) after it."""
    from tests.regression.lms_regression_harness import settle, train

    pytest.importorskip("torchvision.models", reason="torchvision is not installed")
    if fresh_tree:
        torch._dynamo.reset()
    settle()
    built: list[nn.Module] = []

    def make_model() -> nn.Module:
        model = resnet(50, 100)
        built.append(model)
        return torch.compile(model, mode="reduce-overhead")

    run = train(make_model, _resnet50_batches, F.cross_entropy, steps)
    buffers = [b.detach().cpu() for b in built[0].buffers()]
    built.clear()
    gc.collect()
    return run, buffers


def _settle_graphs_and_workspaces() -> None:
    """No CUDA graph tree and no cuBLAS workspace left: CUDA graph trees clear cuBLAS's
    workspaces around each warm-up and capture, compiled code without CUDA graphs keeps them
    for the life of the process, and neither is memory of the model or of LMS."""
    from tests.regression.lms_regression_harness import release_library_workspaces, settle

    torch._dynamo.reset()
    release_library_workspaces()
    settle()


@pytest.mark.parametrize("cap_share", [0.5, 0.25], ids=["half-peak", "quarter-peak"])
def test_compiled_resnet50_reduce_overhead_under_a_share_of_its_peak(
    cap_share: float,
    record: Callable[[str, Any], None],
) -> None:
    """ResNet-50 compiled with mode="reduce-overhead" under a cap of half (and a quarter) of
    its uncapped peak (above its parameters and Adam state, as in ``check_capped_training``):
    the warm-up keeps the forward's activations in the graph pool, which does not fit; LMS
    warns once and trains without CUDA graphs, bit-identical to the uncapped reduce-overhead
    run (losses, gradients, parameters and batch norm statistics). Two uncapped runs are
    compared first:
    where CUDA graph replays are not repeatable here, the row is reported as not judged
    (``not_judged``)."""
    from tests.regression.lms_regression_harness import (
        MiB,
        failed_allocations,
        first_difference,
        host_bytes,
        lms_summary,
        memory_cap,
    )

    steps = 3
    reference, reference_buffers = _train_resnet50_reduce_overhead(steps)
    repeat, repeat_buffers = _train_resnet50_reduce_overhead(steps)
    _settle_graphs_and_workspaces()
    baseline = torch.cuda.memory_allocated()
    peak, static = reference.peak_bytes, reference.static_bytes
    cap = int(static + cap_share * (peak - static))
    record("peak_mib", round(peak / MiB, 1))
    record("static_mib", round(static / MiB, 1))
    record("cap_mib", round(cap / MiB, 1))
    assert peak > cap
    difference = first_difference(reference, repeat)
    if difference is None and not all(
        torch.equal(a, b) for a, b in zip(reference_buffers, repeat_buffers)
    ):
        difference = "batch norm statistics differ"
    spread = record_references(reference, repeat, difference, record)

    skips = _cudagraph_skips()
    host_baseline = host_bytes()
    ooms = failed_allocations()
    with memory_cap(cap), lms_on(int(cap * 0.75)) as caught:
        capped, capped_buffers = _train_resnet50_reduce_overhead(steps)
        stats = torch.cuda.lms_stats()
    fallbacks = _graph_pool_fallbacks(caught)
    record("lms", lms_summary(stats))
    # Failed allocations something caught: the pool's warm-up (LMS's fallback) and any that
    # a library caught and went on from with another plan (cuDNN keeps the plan it fell back
    # to, with other numbers).
    record("allocations_failed_and_caught", failed_allocations() - ooms)
    record("fallback_warnings", fallbacks)
    assert len(fallbacks) == 1, f"expected one fallback warning, got {fallbacks}"
    record("cudagraph_skips", _cudagraph_skips() - skips)
    assert _cudagraph_skips() > skips, "Inductor's skip counter did not count the fallback"
    check_paged_under_the_cap(stats, capped.peak_bytes, cap)
    check_against_references(reference, capped, difference, spread, record)
    if difference is None:
        for i, (a, b) in enumerate(zip(reference_buffers, capped_buffers)):
            assert torch.equal(a, b), f"buffer {i} (batch norm statistics) differs"

    torch.cuda.set_enabled_lms(False)
    del reference, repeat, capped
    check_back_to_baseline(baseline, host_baseline, _settle_graphs_and_workspaces)


def _graph_pool_yields(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings LMS gave when the CUDA graph pool of idle compiled functions went back to
    the device to make room."""
    return [str(w.message) for w in caught if type(w.message).__name__ == "GraphPoolYieldWarning"]


def _private_pool_bytes() -> int:
    """What the private pools of the current device reserve, from the allocator's snapshot
    (as LMS reports it, whether LMS is on or not)."""
    return int(torch.cuda.lms_stats()["private_pool_bytes"]["current"])


def test_compiled_resnet50_reduce_overhead_at_half_its_peak_after_an_uncapped_run(
    record: Callable[[str, Any], None],
) -> None:
    """The same ResNet-50 under mode="reduce-overhead" at half its peak, in a process whose
    earlier uncapped compiled run left its CUDA graph tree behind: its graphs and their pool,
    which LMS never pages, hold far more than the cap leaves. With nothing else to page out,
    LMS has the idle tree's pool go back to the device (one warning), the tree is warmed up
    and captured again when next called (or, where its pool does not fit under the cap, its
    functions run without CUDA graphs, as in the row above), and training gives the uncapped
    runs' losses, gradients, parameters and batch norm statistics bit for bit where those
    repeat. Without LMS, training under the same cap runs out of memory (checked after the
    LMS run: cuDNN's plan cache)."""
    from tests.regression.lms_regression_harness import (
        MiB,
        first_difference,
        host_bytes,
        lms_summary,
        memory_cap,
    )

    steps = 3
    reference, reference_buffers = _train_resnet50_reduce_overhead(steps)
    _settle_graphs_and_workspaces()
    baseline = torch.cuda.memory_allocated()
    # The uncapped run whose tree stays: the process this row is about.
    repeat, repeat_buffers = _train_resnet50_reduce_overhead(steps)
    left = _private_pool_bytes()
    peak, static = reference.peak_bytes, reference.static_bytes
    cap = int(static + 0.5 * (peak - static))
    record("peak_mib", round(peak / MiB, 1))
    record("static_mib", round(static / MiB, 1))
    record("cap_mib", round(cap / MiB, 1))
    record("pool_left_by_the_uncapped_run_mib", round(left / MiB, 1))
    assert peak > cap
    assert left > 0, "the uncapped run left no CUDA graph pool behind"
    difference = first_difference(reference, repeat)
    if difference is None and not all(
        torch.equal(a, b) for a, b in zip(reference_buffers, repeat_buffers)
    ):
        difference = "batch norm statistics differ"
    spread = record_references(reference, repeat, difference, record)

    host_baseline = host_bytes()
    with memory_cap(cap), lms_on(int(cap * 0.75)) as caught:
        capped, capped_buffers = _train_resnet50_reduce_overhead(steps, fresh_tree=False)
        stats = torch.cuda.lms_stats()
    yields = _graph_pool_yields(caught)
    fallbacks = _graph_pool_fallbacks(caught)
    record("lms", lms_summary(stats))
    record("pool_yield_warnings", yields)
    record("fallback_warnings", fallbacks)
    assert yields, "the idle tree's pool did not go back to the device"
    assert "went back to the device" in yields[0] and "MiB" in yields[0], yields[0]
    # The tree is released once; should its new pool not fit, it goes on without graphs.
    assert len(yields) == 1 and len(fallbacks) <= 1, (yields, fallbacks)
    check_paged_under_the_cap(stats, capped.peak_bytes, cap)
    torch.cuda.set_enabled_lms(False)

    _settle_graphs_and_workspaces()
    check_out_of_memory_without_lms(lambda: _train_resnet50_reduce_overhead(steps), cap)

    check_against_references(reference, capped, difference, spread, record)
    if difference is None:
        for i, (a, b) in enumerate(zip(reference_buffers, capped_buffers)):
            assert torch.equal(a, b), f"buffer {i} (batch norm statistics) differs"
    del reference, repeat, capped
    check_back_to_baseline(baseline, host_baseline, _settle_graphs_and_workspaces)


# ---------------------------------------------------------------------------------------
# A GPT-style decoder compiled in default mode, at 1/2 and 1/4 of its own compiled peak
# ---------------------------------------------------------------------------------------

# The drop-in extension's default reclaim headroom: an allocation inside an operator larger
# than this can only be made room for by a reclaim in the allocation path, for its own size.
RECLAIM_HEADROOM_BYTES = 256 * 2**20


# 96 x 256 tokens: the MLP's first output is 288 MiB and the logits 384 MiB, each allocated
# inside one compiled graph and larger than the reclaim headroom; 49M parameters (0.7 GiB with
# gradients and Adam's state) and the working set of the largest kernel (under 1 GiB) stay well
# under a quarter of the peak, while the saved activations make the peak several GiB.
DECODER = {"vocab": 4096, "context": 256, "dim": 768, "layers": 6, "heads": 6}
DECODER_BATCH = 96
DECODER_STEPS = 5


def _decoder_largest_allocation() -> int:
    tokens = DECODER_BATCH * DECODER["context"]
    return 4 * tokens * max(4 * DECODER["dim"], DECODER["vocab"])


def _decoder_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train_compiled_decoder() -> tuple[Any, float]:
    """Adam steps of the compiled decoder (the harness's deterministic ``train``); returns the
    run and the median seconds per iteration of the steps after the first (which compiles),
    from the start of one step to the start of the next (each step ends by copying its loss
    to the host, which waits for the device)."""
    import statistics
    import time

    from tests.regression.lms_regression_harness import train

    starts: list[float] = []

    def batches(step: int) -> Batch:
        starts.append(time.perf_counter())
        g = torch.Generator(device="cuda").manual_seed(3000 + step)
        data = torch.randint(
            0,
            DECODER["vocab"],
            (DECODER_BATCH, DECODER["context"] + 1),
            device="cuda",
            generator=g,
        )
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    run = train(
        lambda: torch.compile(transformer_lm(**DECODER, tied=False)),
        batches,
        _decoder_loss,
        DECODER_STEPS,
    )
    durations = [b - a for a, b in zip(starts[1:-1], starts[2:])]
    return run, statistics.median(durations)


@pytest.mark.parametrize("share", [0.5, 0.25], ids=["half-peak", "quarter-peak"])
def test_compiled_decoder_under_a_share_of_its_compiled_peak(
    share: float, record: Callable[[str, Any], None]
) -> None:
    """The decoder compiled in default mode trains under a cap of ``share`` of its own
    uncapped compiled peak with LMS, and its losses, gradients and parameters are those of
    the uncapped compiled run, bit for bit. Two uncapped runs are compared first: where they
    differ, the compiled program is not repeatable on this machine, which is recorded, and
    the row is reported as not judged (``not_judged``)."""
    from tests.regression.lms_regression_harness import (
        MiB,
        first_difference,
        host_bytes,
        lms_summary,
        memory_cap,
        settle,
    )

    settle()
    reference, reference_s = _train_compiled_decoder()
    settle()
    repeat, _ = _train_compiled_decoder()
    settle()
    baseline = torch.cuda.memory_allocated()
    peak = reference.peak_bytes
    cap = int(share * peak)
    limit = int(cap * 0.75)
    largest = _decoder_largest_allocation()
    record("peak_mib", round(peak / MiB, 1))
    record("static_mib", round(reference.static_bytes / MiB, 1))
    record("cap_mib", round(cap / MiB, 1))
    record("limit_mib", round(limit / MiB, 1))
    record("largest_allocation_mib", round(largest / MiB, 1))
    record("reference_s_per_iter", round(reference_s, 4))
    assert largest > RECLAIM_HEADROOM_BYTES
    assert peak - cap > RECLAIM_HEADROOM_BYTES, "the cap is not well under the peak"

    difference = first_difference(reference, repeat)
    spread = record_references(reference, repeat, difference, record)

    with memory_cap(cap):
        host_baseline = host_bytes()
        torch.cuda.set_enabled_lms(True)
        torch.cuda.set_limit_lms(limit)
        torch.cuda.reset_accumulated_lms_stats()
        torch.cuda.reset_peak_lms_stats()
        # Dynamo would reuse the references' compiled code for the new model (its parameters
        # are inputs of the graph), and code compiled while LMS was off carries no page-in
        # plan: compile again, as a program that enables LMS before compiling does.
        torch._dynamo.reset()
        capped, capped_s = _train_compiled_decoder()
        stats = torch.cuda.lms_stats()
    deficit = peak - cap
    pageout_per_iter = stats["pageout_bytes"] / DECODER_STEPS
    record("lms", lms_summary(stats))
    record("s_per_iter", round(capped_s, 4))
    record("time_vs_reference", round(capped_s / reference_s, 2))
    record("deficit_mib", round(deficit / MiB, 1))
    record("pageout_mib_per_iter", round(pageout_per_iter / MiB, 1))
    record("pageout_per_iter_vs_deficit", round(pageout_per_iter / deficit, 2))
    record("stall_ms_per_iter", round(stats["stall_ms"] / DECODER_STEPS, 1))
    assert stats["pageout_bytes"] > 0, "LMS trained under the cap without paging anything out"
    assert stats["pagein_count"] > 0, "nothing paged out was ever paged back in"
    # The compiled graphs said what they use next (lms::page_in_ahead), and LMS paged some
    # of it in ahead (in the first steps at least, before the learned schedule settles).
    record("graph_prefetch_count", stats["graph_prefetch_count"])
    assert stats["graph_prefetch_count"] > 0, "the compiled graphs' plan paged nothing in"
    assert capped.peak_bytes <= cap
    check_against_references(reference, capped, difference, spread, record)

    torch.cuda.set_enabled_lms(False)
    del reference, repeat, capped
    check_back_to_baseline(baseline, host_baseline, settle)


# ---------------------------------------------------------------------------------------
# Every compile mode under a share of its own compiled peak: max-autotune, dynamic shapes
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_inductor_cache() -> Iterator[str]:
    """One Inductor cache for the rows of one model at several caps: the first row compiles
    (and autotunes), the next ones find its code and autotuning results."""
    with tempfile.TemporaryDirectory(prefix="lms-inductor-shared-") as folder:
        yield folder


def check_compiled_under_a_share(
    run: Callable[[], Any],
    share: float,
    cache: str,
    record: Callable[[str, Any], None],
) -> None:
    """``run`` trains a compiled model (the harness's ``train``) and returns the run; each
    call compiles afresh (after ``torch._dynamo.reset()``, so that no CUDA graph tree of an
    earlier call serves it). Two uncapped runs are the references; the model then trains with
    LMS under ``share`` of their compiled peak (compiled with LMS on, as a program that
    enables LMS before compiling is), must page out and in, and is held to the references bit
    for bit where they repeat (else reported as not judged); without LMS, training under the
    same cap runs out of memory (after the LMS run: cuDNN's plan cache). Device memory and
    pinned host memory return to their baselines."""
    from tests.regression.lms_regression_harness import (
        MiB,
        first_difference,
        host_bytes,
        lms_summary,
        memory_cap,
        release_library_workspaces,
        settle,
    )

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache

    def settle_all() -> None:
        torch._dynamo.reset()
        release_library_workspaces()
        settle()

    settle_all()
    reference = run()
    settle_all()
    repeat = run()
    settle_all()
    baseline = torch.cuda.memory_allocated()
    # The smaller of the two: a first compile's autotuning allocates benchmark inputs.
    peak = min(reference.peak_bytes, repeat.peak_bytes)
    cap = int(share * peak)
    record("peak_mib", round(peak / MiB, 1))
    record("static_mib", round(reference.static_bytes / MiB, 1))
    record("cap_mib", round(cap / MiB, 1))
    assert peak - cap > RECLAIM_HEADROOM_BYTES, "the cap is not well under the peak"
    difference = first_difference(reference, repeat)
    spread = record_references(reference, repeat, difference, record)

    host_baseline = host_bytes()
    with memory_cap(cap), lms_on(int(cap * 0.75)) as caught:
        capped = run()
        stats = torch.cuda.lms_stats()
    record("lms", lms_summary(stats))
    record("graph_prefetch_count", stats["graph_prefetch_count"])
    record("fallback_warnings", _graph_pool_fallbacks(caught))
    record("pool_yield_warnings", _graph_pool_yields(caught))
    check_paged_under_the_cap(stats, capped.peak_bytes, cap)
    torch.cuda.set_enabled_lms(False)

    settle_all()
    check_out_of_memory_without_lms(run, cap, peak)

    check_against_references(reference, capped, difference, spread, record)
    del reference, repeat, capped
    check_back_to_baseline(baseline, host_baseline, settle_all)


# mode="max-autotune" (Triton GEMM templates and coordinate descent tuning, chosen by
# benchmarking, and CUDA graphs) on feed-forward blocks: six blocks of one square shape, so
# that autotuning has six distinct GEMMs to time (three of the blocks, three of the head);
# the second row finds the results in the shared cache. 16384 tokens of width 1024: 50 MiB of
# parameters, and activations of 64 MiB each, several saved per block, which make the peak.
MAX_AUTOTUNE_MODEL = {"width": 1024, "depth": 6, "expansion": 1}
MAX_AUTOTUNE_TOKENS = 16384
MAX_AUTOTUNE_STEPS = 3


def _train_max_autotune() -> Any:
    from torch._inductor import config

    from tests.regression.lms_regression_harness import train

    # GEMMs by Triton templates and ATen only (not the CPU backend of the default list).
    with config.patch({"max_autotune_gemm_backends": "ATEN,TRITON"}):
        return train(
            lambda: torch.compile(FeedForwardStack(**MAX_AUTOTUNE_MODEL), mode="max-autotune"),
            token_batches(tokens=MAX_AUTOTUNE_TOKENS, width=MAX_AUTOTUNE_MODEL["width"]),
            F.cross_entropy,
            MAX_AUTOTUNE_STEPS,
        )


@pytest.mark.parametrize("share", [0.5, 0.25], ids=["half-peak", "quarter-peak"])
def test_max_autotune_under_a_share_of_its_compiled_peak(
    share: float, shared_inductor_cache: str, record: Callable[[str, Any], None]
) -> None:
    """mode="max-autotune" trains under ``share`` of its compiled peak with LMS: where the
    CUDA graph pool fits, LMS makes room for it; where it does not, the compiled code runs
    without CUDA graphs (one warning); either way with the uncapped results bit for bit."""
    check_compiled_under_a_share(_train_max_autotune, share, shared_inductor_cache, record)


# A GPT-style decoder compiled with dynamic shapes: one graph for every sequence length, the
# steps' lengths differing (the longest, 256, sets the peak).
DYNAMIC_SEQUENCE_LENGTHS = (256, 192, 224, 160, 256)


def _train_dynamic_decoder() -> Any:
    from tests.regression.lms_regression_harness import train

    lengths = DYNAMIC_SEQUENCE_LENGTHS

    def batches(step: int) -> Batch:
        g = torch.Generator(device="cuda").manual_seed(4000 + step)
        data = torch.randint(
            0, DECODER["vocab"], (DECODER_BATCH, lengths[step] + 1), device="cuda", generator=g
        )
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    return train(
        lambda: torch.compile(transformer_lm(**DECODER, tied=False), dynamic=True),
        batches,
        _decoder_loss,
        len(lengths),
    )


@pytest.mark.parametrize("share", [0.5, 0.25], ids=["half-peak", "quarter-peak"])
def test_dynamic_shape_decoder_under_a_share_of_its_compiled_peak(
    share: float, shared_inductor_cache: str, record: Callable[[str, Any], None]
) -> None:
    """The decoder compiled with dynamic=True, its sequence length changing from step to
    step, trains under ``share`` of its compiled peak with LMS, with the uncapped results bit
    for bit; the graphs' page-in hints are placed by symbolic sizes."""
    record("sequence_lengths", list(DYNAMIC_SEQUENCE_LENGTHS))
    check_compiled_under_a_share(_train_dynamic_decoder, share, shared_inductor_cache, record)
