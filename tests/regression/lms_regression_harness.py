"""Helpers of the LMS regression suite: deterministic training runs, memory caps, checks."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lmsbench.lms_setup import deterministic

MiB = 1024 * 1024

Batch = tuple[torch.Tensor, torch.Tensor]


def bindings() -> Any:
    """The module with the ``_cuda_lms_*`` bindings (``torch._C`` or ``torch_lms._C``)."""
    if hasattr(torch._C, "_cuda_lms_storageState"):
        return torch._C
    import torch_lms._C

    return torch_lms._C


def storage_state(tensor: torch.Tensor) -> str:
    return str(bindings()._cuda_lms_storageState(tensor))


# Every capped LMS run of check_capped_training runs with recompute on (the hybrid of paging
# and recomputing), LMS's default; LMS_REGRESSION_RECOMPUTE=0: paging only.
RECOMPUTE = os.environ.get("LMS_REGRESSION_RECOMPUTE", "1") == "1"
# Residual recipes (torch.cuda.set_residual_recipes_lms), off by default:
# LMS_REGRESSION_RESIDUAL_RECIPES=1 runs every test with them on (reset_lms sets them so).
RESIDUAL_RECIPES = os.environ.get("LMS_REGRESSION_RESIDUAL_RECIPES", "0") == "1"


def reset_lms() -> None:
    """LMS off, default settings, no memory cap, caches emptied."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.set_enabled_lms(False)
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.set_limit_lms(0)
    torch.cuda.set_size_lms(1 * MiB)
    torch.cuda.set_prefetch_lms(0)
    torch.cuda.set_speculative_lms(0)
    if hasattr(torch.cuda, "set_recompute_lms"):
        # Paging only: the rows that check paging itself name what they page out; a row
        # that trains turns recompute on, LMS's default (check_capped_training).
        torch.cuda.set_recompute_lms(False)
    if hasattr(torch.cuda, "set_host_placement_lms"):
        torch.cuda.set_host_placement_lms(True)
    if hasattr(torch.cuda, "set_residual_recipes_lms"):
        torch.cuda.set_residual_recipes_lms(RESIDUAL_RECIPES)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def memory_cap(cap_bytes: int) -> Iterator[None]:
    """Caps the caching allocator of the current device at ``cap_bytes`` (reserved memory)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@dataclass
class RunResult:
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)  # last step, before optimizer.step
    params: list[torch.Tensor] = field(default_factory=list)  # after the last step
    peak_bytes: int = 0  # peak allocated above the baseline
    static_bytes: int = 0  # parameters + optimizer state, allocated between steps


def train(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
) -> RunResult:
    """Trains a freshly built model for ``steps`` Adam steps; everything seeded."""
    deterministic()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = make_model().cuda()
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    result = RunResult()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            for step in range(steps):
                inputs, targets = make_batch(step)
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                del inputs, targets
                result.losses.append(loss.detach().cpu())
                del loss
                if step == steps - 1:
                    result.grads = [p.grad.detach().cpu() for p in model.parameters()]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step == 0:
                    torch.cuda.synchronize()
                    result.static_bytes = torch.cuda.memory_allocated() - baseline
        result.params = [p.detach().cpu() for p in model.parameters()]
        torch.cuda.synchronize()
        result.peak_bytes = torch.cuda.max_memory_allocated() - baseline
    finally:
        del model, optimizer
        gc.collect()
    return result


def assert_identical(expected: RunResult, actual: RunResult) -> None:
    assert len(expected.losses) == len(actual.losses)
    for step, (a, b) in enumerate(zip(expected.losses, actual.losses)):
        assert torch.equal(a, b), f"loss of step {step} differs: {a.item()!r} vs {b.item()!r}"
    assert len(expected.grads) == len(actual.grads)
    for i, (a, b) in enumerate(zip(expected.grads, actual.grads)):
        assert torch.equal(a, b), f"gradient of parameter {i} differs"
    for i, (a, b) in enumerate(zip(expected.params, actual.params)):
        assert torch.equal(a, b), f"parameter {i} differs after the optimizer steps"


def lms_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The statistics worth keeping in the results files."""
    keys = (
        "pageout_count",
        "pageout_bytes",
        "pagein_count",
        "pagein_bytes",
        "reclaim_limit",
        "reclaim_alloc_failure",
        "reclaim_explicit",
        "prefetch_count",
        "prefetch_hits",
        "stall_ms",
        "oom_count",
        "limit_bytes",
    )
    out = {k: stats[k] for k in keys}
    for gauge in ("managed_bytes", "pagedout_bytes", "host_bytes"):
        out[f"{gauge}_peak"] = stats[gauge]["peak"]
    if "spilled_bytes" in stats:
        out["spilled_bytes_peak"] = stats["spilled_bytes"]["peak"]
    # Counters that newer engines add (fragment_reclaims), where this LMS build has them.
    for key in OPTIONAL_STATS:
        if key in stats:
            out[key] = stats[key]
    # The host-memory budget, where this LMS build has one.
    for key in HOST_BUDGET_STATS:
        if key in stats:
            out[key] = stats[key]
    return out


# lms_stats() counters an engine may lack: allocations (failed ones, or large ones ahead of
# the allocator) placed by paging out the storages that held a range the request fits in;
# the copies timed each way.
OPTIONAL_STATS = (
    "fragment_reclaims",
    "fragment_placements",
    "host_placement_count",
    "host_placement_bytes",
    "input_host_placement_count",
    "input_host_placement_bytes",
    "pack_count",
    "pack_bytes",
    "workspace_releases",
    "drop_count",
    "drop_bytes",
    "recompute_count",
    "recompute_bytes",
    "recompute_ms",
    "recompute_input_prefetch_count",
    "recompute_input_prefetch_bytes",
    "recompute_ahead_count",
    "recompute_ahead_bytes",
    "copy_out_bytes",
    "copy_out_ms",
    "copy_in_bytes",
    "copy_in_ms",
    # The disk tier (torch.cuda.set_spill_dir_lms): page-outs written to the spill directory,
    # the bytes and time of the writes and of the reads back.
    "spill_count",
    "spill_out_bytes",
    "spill_out_ms",
    "spill_in_bytes",
    "spill_in_ms",
)

# lms_stats() keys of the host-memory budget (torch.cuda.set_host_limit_lms): the budget in
# force, the pinned memory of all LMS processes of the host, the page-outs it refused.
HOST_BUDGET_STATS = ("host_budget_bytes", "host_ledger_bytes", "host_refusals")


def host_bytes() -> int:
    return int(torch.cuda.lms_stats()["host_bytes"]["current"])


def settle() -> None:
    """Waits for the device, frees what died, returns cached device and host memory."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


def release_library_workspaces() -> None:
    """Frees the workspaces cuBLAS and cuBLASLt keep per handle and stream
    (``torch._C._cuda_clearCublasWorkspaces``). A thread's first matrix product creates one
    for its handle and keeps it for the life of the process: a recompute that replays a
    linear layer on the autograd thread creates one there, CUDA graph trees clear them around
    each capture. Neither is memory of the model or of LMS."""
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        torch.cuda.synchronize()
        clear_workspaces()


def failed_allocations() -> int:
    """Allocations the caching allocator failed so far in this process (``num_ooms``)."""
    return torch.cuda.memory_stats().get("num_ooms", 0)


def check_capped_training(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    record: Callable[[str, Any], None],
    cap_share: float = 0.5,
    recompute: bool | None = None,
) -> None:
    """The regression check of one model.

    1. Trains uncapped with LMS off: the reference losses, gradients and parameters, the
       peak memory P and the static memory S (parameters + Adam state).
    2. Caps device memory at C = S + cap_share * (P - S) < P and trains with LMS on (limit a
       margin below the cap): it must finish, page out and in, and give bit-identical losses,
       gradients and parameters. Allocations that failed inside it and were caught (a library
       falling back to a smaller workspace, which can change its results) are recorded.
    3. Under the same cap, training without LMS must raise torch.OutOfMemoryError (the cap
       binds). This runs last: cuDNN keeps, for the life of the process, the plan it ran
       for each convolution shape, and a run without LMS that catches an out-of-memory error
       on a plan's workspace stores the plan it fell back to, which every later run of that
       shape in the process then uses.
    4. Device memory and LMS's pinned host memory return to their baselines.

    ``recompute`` (default: on, LMS's default; ``LMS_REGRESSION_RECOMPUTE=0`` in the
    environment turns it off) runs the LMS run with recompute on
    (``torch.cuda.set_recompute_lms``): storages are dropped and
    recomputed where that beats the bus, and the results must still be bit-identical. Passed
    as True, the run must also have dropped and recomputed something.
    """
    hybrid = RECOMPUTE if recompute is None else recompute
    settle()
    reference = train(make_model, make_batch, loss_fn, steps)
    release_library_workspaces()
    settle()
    # Taken after the reference run: libraries keep lazily created workspaces (cuDNN, and
    # cuBLAS's until released above) allocated for the life of the process, and those are
    # not LMS's to return.
    baseline = torch.cuda.memory_allocated()
    peak, static = reference.peak_bytes, reference.static_bytes
    cap = int(static + cap_share * (peak - static))
    record("peak_mib", round(peak / MiB, 1))
    record("static_mib", round(static / MiB, 1))
    record("cap_mib", round(cap / MiB, 1))
    assert peak > cap

    with memory_cap(cap):
        host_baseline = host_bytes()
        torch.cuda.set_enabled_lms(True)
        # A margin under the cap for the operator running when the limit is reached.
        torch.cuda.set_limit_lms(int(cap * 0.75))
        if hybrid:
            torch.cuda.set_recompute_lms(True)
        record("recompute", hybrid)
        torch.cuda.reset_accumulated_lms_stats()
        torch.cuda.reset_peak_lms_stats()
        ooms = failed_allocations()
        capped = train(make_model, make_batch, loss_fn, steps)
        stats = torch.cuda.lms_stats()
        record("lms", lms_summary(stats))
        record("allocations_failed_and_caught", failed_allocations() - ooms)
        if hybrid:
            torch.cuda.set_recompute_lms(False)
        torch.cuda.set_enabled_lms(False)
        settle()

        oom = None
        ooms = failed_allocations()
        try:
            train(make_model, make_batch, loss_fn, steps)
        except torch.OutOfMemoryError as exc:
            oom = exc
        # Every failed allocation but the one that ended the run was caught inside an
        # operator (the cuDNN fallbacks the ordering above keeps out of the LMS run).
        record(
            "without_lms_allocations_failed_and_caught",
            failed_allocations() - ooms - (oom is not None),
        )
        assert oom is not None, (
            f"training fit under a cap of {cap / MiB:.0f} MiB without LMS "
            f"(uncapped peak {peak / MiB:.0f} MiB): the cap proves nothing"
        )
        del oom
        settle()
    # Recompute measures the bus on page-outs before it drops anything.
    assert stats["pageout_count"] > 0, "LMS trained under the cap without paging anything out"
    assert stats["pagein_count"] > 0, "nothing paged out was ever paged back in"
    if recompute:
        assert stats["drop_count"] > 0, "recompute was on and nothing was dropped"
        assert stats["recompute_count"] > 0, "nothing dropped was ever recomputed"
    assert capped.peak_bytes <= cap
    assert_identical(reference, capped)

    del reference, capped
    release_library_workspaces()
    settle()
    assert torch.cuda.memory_allocated() == baseline, "device memory did not return to baseline"
    assert host_bytes() == host_baseline, "LMS still holds pinned host memory"
    left = torch.cuda.lms_stats()
    assert left["managed_bytes"]["current"] == 0, "LMS still manages storages: " + ", ".join(
        f"{k} {left[k]['current']}"
        for k in (
            "managed_bytes",
            "active_bytes",
            "inactive_bytes",
            "pagedout_bytes",
            "dropped_bytes",
            "operator_output_bytes",
        )
        if k in left
    )


# ---------------------------------------------------------------------------------------
# Additions for the regression matrix (test_families.py) and its worker processes
# ---------------------------------------------------------------------------------------


def ensure_lms_api() -> str:
    """Makes the ``torch.cuda`` LMS API available the way the suite's conftest does.

    Returns ``"patched"`` when this PyTorch has LMS built in, else imports the drop-in
    extension (``import torch_lms``) and returns ``"extension"``. For processes the suite
    starts (workers, ``mp.spawn`` ranks), which do not run the conftest.
    """
    if not hasattr(torch.cuda, "set_enabled_lms"):
        import torch_lms  # noqa: F401  (installs the torch.cuda LMS API)
    return "patched" if hasattr(torch._C, "_cuda_lms_setEnabled") else "extension"


def tensors_of(run: RunResult) -> list[tuple[str, torch.Tensor]]:
    """The losses, gradients and parameters of a run, named for messages."""
    named = [(f"loss {i}", t) for i, t in enumerate(run.losses)]
    named += [(f"gradient {i}", t) for i, t in enumerate(run.grads)]
    named += [(f"parameter {i}", t) for i, t in enumerate(run.params)]
    return named


def first_difference(expected: RunResult, actual: RunResult) -> str | None:
    """``None`` when the runs' losses, gradients and parameters are bit-identical (compared
    as bytes), else what differs first."""
    a, b = tensors_of(expected), tensors_of(actual)
    if [n for n, _ in a] != [n for n, _ in b]:
        return f"the runs have different tensors ({len(a)} vs {len(b)})"
    for (name, x), (_, y) in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        if not torch.equal(_bits(x), _bits(y)):
            return f"{name} differs"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so that NaNs compare, and -0.0 differs from 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def max_relative_difference(expected: RunResult, actual: RunResult) -> float:
    """The largest ``|a - b| / max(|a|, tiny)`` over all tensors, compared as norms:
    ``norm(a - b) / norm(a)`` per tensor (a tensor of zeros compares absolutely)."""
    worst = 0.0
    for (_, x), (_, y) in zip(tensors_of(expected), tensors_of(actual)):
        x64, y64 = x.double(), y.double()
        if not (torch.isfinite(x64).all() and torch.isfinite(y64).all()):
            if not torch.equal(torch.isfinite(x64), torch.isfinite(y64)):
                return math.inf
            keep = torch.isfinite(x64)
            x64, y64 = x64[keep], y64[keep]
        scale = float(torch.linalg.vector_norm(x64))
        diff = float(torch.linalg.vector_norm(x64 - y64))
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst
