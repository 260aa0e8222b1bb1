"""Worker processes of the LMS regression matrix (``test_families.py``).

Every run of the matrix trains in a process of its own, started by the test: a device fault
in one run (the drop-in extension cannot always turn a failed page-in into an exception)
then ends that run only, and the others still report. Each command writes its results as
JSON to ``--out`` after every stage, so a run that dies leaves what it measured.

Commands:

``family``  one model family: the uncapped reference twice (LMS off), then the same training
            under a cap of ``--cap-share`` of the reference's peak reserved memory, LMS on
            with default settings; compared bit for bit.
``nocap``   no cap at all: a model whose training needs ``--factor`` times the device memory,
            LMS on with default settings; compared with a micro-batched run without LMS
            (``--no-reference``: none). ``--host-limit-mb``: a host-memory budget for LMS.
``share``   one of ``--processes`` processes sharing one GPU, each needing ``--fraction`` of
            the device, started together (a file barrier), LMS on (or off: ``--no-lms``).
            ``--cap-share``: a cap of that share of the device; ``--host-limit-mb``: a host
            budget; ``--wave``/``--waves``: the processes reach the end of their first
            forward pass wave after wave, each wave waiting there for the later ones.
``ddp``     DistributedDataParallel on two GPUs (``mp.spawn``, NCCL): the uncapped
            reference twice, then capped at ``--cap-share`` of each rank's own peak, LMS on.

Run as a script (``python tests/regression/lms_matrix_worker.py COMMAND ...``) in the
environment of ``lmsbench.harness.worker_env``: the repository root first on ``PYTHONPATH``
(for ``lmsbench`` and ``tests.regression``), and ``torch_lms`` from ``PYTHONPATH`` as in the
test session.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# Deterministic cuBLAS needs this before the first cuBLAS handle is created.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import nn

from lmsbench.harness import write_json
from lmsbench.lms_setup import nonneg_int, positive_int
from lmsbench.models import resnet
from tests.regression.lms_families import (
    DeepMLP,
    Family,
    family,
    make_scaler,
    mlp_batch,
    mlp_need_bytes,
    mlp_tokens_for,
    train_step,
)
from tests.regression.lms_regression_harness import (
    MiB,
    RunResult,
    deterministic,
    ensure_lms_api,
    first_difference,
    lms_summary,
    max_relative_difference,
    memory_cap,
    settle,
)

# An allocation inside an operator of more than this is larger than any room an allocator
# could keep free in advance (a fixed headroom): only a reclaim inside the allocation path,
# for the request's own size, makes room for it.
LARGE_ALLOCATION_BYTES = 256 * MiB

# The collective backend of the DDP run (the CPU tests of this module use gloo).
DDP_BACKEND = "nccl"

# DeepMLP shape of the no-cap rows and of the processes sharing a GPU.
MLP_WIDTH = 1024
MLP_LAYERS = 16


def worker_device() -> torch.device:
    """The device this process trains on (the CPU tests of this module replace it)."""
    return torch.device("cuda", torch.cuda.current_device())


def rank_device(rank: int) -> torch.device:
    """The device of DDP rank ``rank``."""
    return torch.device("cuda", rank)


# ---------------------------------------------------------------------------------------
# Results file
# ---------------------------------------------------------------------------------------


class Results:
    """A dict written to ``path`` as JSON on every :meth:`save`."""

    def __init__(self, path: Path, **initial: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = dict(initial)

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def update(self, **values: Any) -> None:
        self.data.update(values)

    def save(self) -> None:
        write_json(self.path, self.data)


def environment(backend: str) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name,
        "device_memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "lms_backend": backend,
        "pytorch_lms_conf": os.environ.get("PYTORCH_LMS_CONF", ""),
        "pid": os.getpid(),
    }


def lms_settings() -> dict[str, int]:
    """The LMS settings in effect (the matrix runs with the defaults)."""
    settings = {
        "limit_bytes": torch.cuda.get_limit_lms(),
        "size_bytes": torch.cuda.get_size_lms(),
        "prefetch": torch.cuda.get_prefetch_lms(),
        "speculative_bytes": torch.cuda.get_speculative_lms(),
    }
    host_limit = host_limit_setting()
    if host_limit is not None:
        settings["host_limit_bytes"] = host_limit
    return settings


def has_host_budget() -> bool:
    """Whether this LMS build has a host-memory budget (``set_host_limit_lms``)."""
    return hasattr(torch.cuda, "set_host_limit_lms")


def set_host_limit(limit_bytes: int) -> None:
    """Sets LMS's host-memory budget; an error where this build has none."""
    if not has_host_budget():
        raise RuntimeError(
            "this LMS build has no host-memory budget (torch.cuda.set_host_limit_lms)"
        )
    torch.cuda.set_host_limit_lms(limit_bytes)


def host_limit_setting() -> int | None:
    """``get_host_limit_lms()`` (0: derived from the host), ``None`` where there is none."""
    if not hasattr(torch.cuda, "get_host_limit_lms"):
        return None
    return int(torch.cuda.get_host_limit_lms())


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]


def record_error(results: Results, exc: BaseException) -> None:
    """Saves the error (its traceback, type and message), with LMS's statistics up to it
    where they can still be read."""
    results["error"] = error_text(exc)
    results["error_type"] = type(exc).__name__
    results["error_message"] = str(exc)[:4000]
    try:
        if torch.cuda.is_initialized() and torch.cuda.get_enabled_lms():
            results["lms_at_error"] = lms_summary(torch.cuda.lms_stats())
    except Exception as stats_exc:  # a broken CUDA context: the error above says why
        results["lms_at_error"] = f"unreadable: {type(stats_exc).__name__}"
    results.save()


def per_iteration(seconds: list[float]) -> float:
    """Seconds per iteration: the mean after the first (which pays for lazy setup)."""
    rest = seconds[1:] or seconds
    return sum(rest) / len(rest)


# ---------------------------------------------------------------------------------------
# One training run of a family
# ---------------------------------------------------------------------------------------


@dataclass
class FamilyRun:
    result: RunResult
    seconds_per_step: list[float] = field(default_factory=list)
    peak_reserved_bytes: int = 0
    param_bytes: int = 0
    optimizer_state_bytes: int = 0
    largest_alloc_bytes: int = 0
    largest_alloc_source: str = ""
    model: str = ""


def tensor_bytes(obj: Any) -> int:
    """The largest tensor in ``obj`` (a tensor, or nested tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return max((tensor_bytes(o) for o in obj), default=0)
    if isinstance(obj, dict):
        return max((tensor_bytes(o) for o in obj.values()), default=0)
    return 0


def largest_live_block() -> int:
    """The largest allocation alive on this device right now (from the allocator's
    snapshot; covers buffers no module returns, such as cuDNN's RNN reserve space)."""
    largest = 0
    for segment in torch.cuda.memory_snapshot():
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                largest = max(largest, int(block.get("requested_size", block["size"])))
    return largest


@contextmanager
def module_output_probe(model: nn.Module, found: dict[str, Any]) -> Iterator[None]:
    """Records the largest tensor any module of ``model`` returns in ``found``."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        size = tensor_bytes(output)
        if size > found.get("bytes", 0):
            found["bytes"] = size
            found["source"] = f"output of {type(module).__name__}"

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # not the scalar step counts
    )


def train_family(fam: Family, probe: bool = False) -> FamilyRun:
    """Trains a freshly built, seeded model of ``fam`` for ``fam.steps`` steps.

    With ``probe``, also finds the largest allocation made inside an operator that the
    run shows: the largest tensor a module returns, the largest live allocation after the
    first forward pass, and the largest parameter (its gradient is allocated inside the
    backward operator).
    """
    device = worker_device()
    deterministic()
    settle()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = fam.build().to(device)
    model.train()
    optimizer = fam.make_optimizer(model)
    scaler = make_scaler(fam, device)
    run = FamilyRun(RunResult())
    run.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    found: dict[str, Any] = {}
    if probe:
        largest_param = max(model.parameters(), key=lambda p: p.numel() * p.element_size())
        found = {
            "bytes": largest_param.numel() * largest_param.element_size(),
            "source": f"gradient of a {tuple(largest_param.shape)} parameter",
        }

    def after_forward() -> None:
        if probe and not run.seconds_per_step:
            live = largest_live_block()
            if live > found["bytes"]:
                found.update(bytes=live, source="live allocation after the forward pass")

    grads: list[torch.Tensor] = []
    parameters = list(model.parameters())

    def before_update() -> None:
        if len(run.seconds_per_step) == fam.steps - 1:
            grads.extend(p.grad.detach().cpu() for p in parameters if p.grad is not None)

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            for step in range(fam.steps):
                start = time.perf_counter()
                with module_output_probe(model, found) if probe and step == 0 else nullcontext():
                    losses = train_step(
                        fam, model, optimizer, scaler, step, device, after_forward, before_update
                    )
                torch.cuda.synchronize()
                run.seconds_per_step.append(time.perf_counter() - start)
                run.result.losses.extend(losses)
        run.result.grads = grads
        run.result.params = [p.detach().cpu() for p in model.parameters()]
        run.optimizer_state_bytes = optimizer_state_bytes(optimizer)
        torch.cuda.synchronize()
        run.peak_reserved_bytes = torch.cuda.max_memory_reserved()
    finally:
        del model, optimizer, scaler
        parameters.clear()
        gc.collect()
    if probe:
        run.largest_alloc_bytes = int(found["bytes"])
        run.largest_alloc_source = str(found["source"])
    return run


def run_family(name: str, cap_share: float, out: Path, tiny: bool = False) -> int:
    """The ``family`` command; returns the exit status. ``tiny``: the CPU-test size."""
    fam = family(name, tiny)
    results = Results(
        out,
        family=name,
        description=fam.description,
        cap_share=cap_share,
        steps=fam.steps,
        accumulation=fam.accumulation,
        amp=fam.amp,
        stage="start",
    )
    try:
        backend = ensure_lms_api()
        results.update(**environment(backend))
        results.save()

        results["stage"] = "reference"
        first = train_family(fam, probe=True)
        second = train_family(fam)
        difference = first_difference(first.result, second.result)
        peak = max(first.peak_reserved_bytes, second.peak_reserved_bytes)
        cap = int(cap_share * peak)
        results.update(
            reference_peak_reserved_bytes=peak,
            reference_s_per_iter=per_iteration(second.seconds_per_step),
            reference_seconds_per_step=second.seconds_per_step,
            reference_repeatable=difference is None,
            reference_difference=difference,
            reference_max_relative_difference=max_relative_difference(first.result, second.result),
            param_bytes=first.param_bytes,
            optimizer_state_bytes=first.optimizer_state_bytes,
            largest_alloc_bytes=first.largest_alloc_bytes,
            largest_alloc_source=first.largest_alloc_source,
            cap_bytes=cap,
            deficit_bytes=peak - cap,
        )
        del second
        results.save()

        results["stage"] = "capped"
        settle()
        with memory_cap(cap):
            torch.cuda.set_enabled_lms(True)
            torch.cuda.reset_accumulated_lms_stats()
            torch.cuda.reset_peak_lms_stats()
            capped = train_family(fam)
            stats = torch.cuda.lms_stats()
            results["lms_settings"] = lms_settings()
        steps = fam.steps
        results.update(
            capped_s_per_iter=per_iteration(capped.seconds_per_step),
            capped_seconds_per_step=capped.seconds_per_step,
            capped_peak_reserved_bytes=capped.peak_reserved_bytes,
            lms=lms_summary(stats),
            pageout_bytes_per_iter=stats["pageout_bytes"] / steps,
            pagein_bytes_per_iter=stats["pagein_bytes"] / steps,
            stall_ms=stats["stall_ms"],
            stall_ms_per_iter=stats["stall_ms"] / steps,
        )
        difference = first_difference(first.result, capped.result)
        results.update(
            bit_identical=difference is None,
            difference=difference,
            max_relative_difference=max_relative_difference(first.result, capped.result),
            stage="done",
        )
        results.save()
        return 0
    except BaseException as exc:
        record_error(results, exc)
        return 1


# ---------------------------------------------------------------------------------------
# No cap at all: a need larger than the device
# ---------------------------------------------------------------------------------------


def mlp_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    chunks: int,
    after_forward: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One SGD step of a DeepMLP on the mean squared error over all of ``x``, in ``chunks``
    micro-batches whose gradients add up to the full batch's (the same mathematics; not the
    same rounding unless ``chunks`` is 1).

    Returns the loss and the gradients (on the CPU) before the update.
    """
    total = torch.zeros((), dtype=torch.float64)
    for part_x, part_y in zip(x.chunk(chunks), y.chunk(chunks)):
        loss = (model(part_x) - part_y).pow(2).sum() / x.shape[0]
        if after_forward is not None:
            after_forward()
        loss.backward()
        total += loss.detach().double().cpu()
        del loss
    grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grads


def build_mlp(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DeepMLP(MLP_WIDTH, MLP_LAYERS).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def run_nocap(
    factor: float, steps: int, out: Path, host_limit_mb: int = 0, reference: bool = True
) -> int:
    """The ``nocap`` command; returns the exit status (0: done, 1: an error, recorded).

    ``host_limit_mb``: a host-memory budget for LMS (``set_host_limit_lms``), else the
    default. ``reference``: compare with the micro-batched run without LMS (else the run only
    has to train, or to fail as it should).
    """
    results = Results(
        out,
        factor=factor,
        steps=steps,
        host_limit_mb=host_limit_mb,
        reference_run=reference,
        stage="start",
    )
    try:
        backend = ensure_lms_api()
        results.update(**environment(backend))
        device = worker_device()
        total = torch.cuda.get_device_properties(device).total_memory
        need = int(factor * total)
        tokens = mlp_tokens_for(need, MLP_WIDTH, MLP_LAYERS)
        need = mlp_need_bytes(tokens, MLP_WIDTH, MLP_LAYERS)
        # Micro-batches of at most 40% of the device for the reference without LMS.
        chunks = math.ceil(need / (0.4 * total))
        results.update(
            tokens=tokens,
            width=MLP_WIDTH,
            layers=MLP_LAYERS,
            largest_alloc_bytes=tokens * MLP_WIDTH * 4,
            largest_alloc_source="output of each Linear and GELU (tokens x width, fp32)",
            need_bytes=need,
            need_over_device=need / total,
            reference=f"the same batch in {chunks} micro-batches without LMS"
            if reference
            else "none",
            reference_chunks=chunks if reference else None,
        )
        results.save()
        deterministic()

        reference_run = RunResult()
        if reference:
            results["stage"] = "reference"
            model, optimizer = build_mlp(device)
            for step in range(steps):
                x, y = mlp_batch(tokens, MLP_WIDTH, 8000 + step, device)
                loss, grads = mlp_train_step(model, optimizer, x, y, chunks)
                del x, y
                reference_run.losses.append(loss)
                reference_run.grads = grads
            reference_run.params = [p.detach().cpu() for p in model.parameters()]
            del model, optimizer
            settle()
            results.save()

        results["stage"] = "lms"
        torch.cuda.set_enabled_lms(True)
        if host_limit_mb:
            set_host_limit(host_limit_mb * MiB)
        torch.cuda.reset_accumulated_lms_stats()
        torch.cuda.reset_peak_lms_stats()
        torch.cuda.reset_peak_memory_stats()
        # What must be off the device at the peak, by the limit in force before training.
        limit_at_start = int(torch.cuda.lms_stats()["limit_bytes"])
        results.update(
            host_limit_bytes=host_limit_setting(),
            limit_at_start_bytes=limit_at_start,
            deficit_at_start_bytes=need - limit_at_start if limit_at_start else None,
        )
        results.save()
        live: list[int] = []

        def after_forward() -> None:
            # Tensors alive now: those on the device plus those LMS holds on the host.
            stats = torch.cuda.lms_stats()
            live.append(torch.cuda.memory_allocated() + stats["pagedout_bytes"]["current"])

        actual = RunResult()
        seconds: list[float] = []
        model, optimizer = build_mlp(device)
        for step in range(steps):
            start = time.perf_counter()
            x, y = mlp_batch(tokens, MLP_WIDTH, 8000 + step, device)
            loss, grads = mlp_train_step(model, optimizer, x, y, 1, after_forward)
            del x, y
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            actual.losses.append(loss)
            actual.grads = grads
        actual.params = [p.detach().cpu() for p in model.parameters()]
        stats = torch.cuda.lms_stats()
        del model, optimizer
        limit = int(stats["limit_bytes"])
        results.update(
            lms_settings=lms_settings(),
            s_per_iter=per_iteration(seconds),
            seconds_per_step=seconds,
            live_after_forward_bytes=max(live),
            peak_over_device=max(live) / total,
            peak_over_limit=max(live) / limit if limit else None,
            deficit_bytes=max(live) - limit if limit else None,
            lms=lms_summary(stats),
            pageout_bytes_per_iter=stats["pageout_bytes"] / steps,
            pagein_bytes_per_iter=stats["pagein_bytes"] / steps,
            stall_ms=stats["stall_ms"],
            stall_ms_per_iter=stats["stall_ms"] / steps,
            losses=[float(v) for v in actual.losses],
            finite=all(math.isfinite(float(v)) for v in actual.losses),
        )
        if reference:
            results.update(
                reference_losses=[float(v) for v in reference_run.losses],
                max_relative_difference=max_relative_difference(reference_run, actual),
            )
        results["stage"] = "done"
        results.save()
        return 0
    except BaseException as exc:
        record_error(results, exc)
        return 1


# ---------------------------------------------------------------------------------------
# Several processes on one GPU
# ---------------------------------------------------------------------------------------


class FileBarrier:
    """A barrier of ``parties`` processes through marker files in ``folder``.

    A party that fails marks itself failed (:meth:`fail`); it then counts as arrived at
    every later stage, so the others do not wait for it.
    """

    def __init__(self, folder: Path, parties: int, rank: int, timeout_s: float = 600.0) -> None:
        self.folder = folder
        self.parties = parties
        self.rank = rank
        self.timeout_s = timeout_s
        folder.mkdir(parents=True, exist_ok=True)

    def arrived(self, stage: str) -> int:
        names = {p.name for p in self.folder.iterdir()}
        return sum(
            1 for r in range(self.parties) if f"{stage}-{r}" in names or f"failed-{r}" in names
        )

    def wait(self, stage: str) -> float:
        """Marks this party at ``stage`` and waits for all; returns the seconds waited."""
        (self.folder / f"{stage}-{self.rank}").touch()
        start = time.monotonic()
        while self.arrived(stage) < self.parties:
            if time.monotonic() - start > self.timeout_s:
                raise TimeoutError(
                    f"barrier {stage!r}: {self.arrived(stage)} of {self.parties} processes "
                    f"arrived in {self.timeout_s:.0f} s"
                )
            time.sleep(0.01)
        return time.monotonic() - start

    def fail(self) -> None:
        (self.folder / f"failed-{self.rank}").touch()


def lms_sample(at: str, seconds: float) -> dict[str, Any]:
    """The LMS limit in force now, with what this process holds on the device and on the
    host (and the host's ledger, where LMS has a host budget): how the device is shared."""
    stats = torch.cuda.lms_stats()
    sample: dict[str, Any] = {
        "at": at,
        "t_s": round(seconds, 3),
        "limit_bytes": int(stats["limit_bytes"]),
        "managed_bytes": int(stats["managed_bytes"]["current"]),
        "pagedout_bytes": int(stats["pagedout_bytes"]["current"]),
    }
    if "host_ledger_bytes" in stats:
        ledger = stats["host_ledger_bytes"]
        sample["host_ledger_bytes"] = ledger.get("current") if isinstance(ledger, dict) else ledger
    return sample


def run_share(
    rank: int,
    processes: int,
    fraction: float,
    steps: int,
    lms: bool,
    barrier_dir: Path,
    out: Path,
    *,
    cap_share: float = 0.0,
    host_limit_mb: int = 0,
    wave: int = 0,
    waves: int = 1,
) -> int:
    """The ``share`` command: one of ``processes`` processes training together on one GPU.

    After the first step every process waits for all the others (or for their failure)
    while it keeps what it allocated (the caching allocator holds its peak), so the needs
    of all processes are on the device at the same time.

    ``cap_share``: the allocator is capped at that share of the device (each process's
    device is then full at its own cap, whatever the others hold). ``host_limit_mb``: a host
    budget for LMS (``set_host_limit_lms``). With ``waves`` > 1 the processes of ``wave`` 0
    run their first forward pass and wait at its end, their activations alive (and their
    page-outs held), until those of wave 1 got there too (or failed), and so on: wave ``w``
    starts its forward pass when the earlier waves are at the end of theirs.

    The LMS limit in force is sampled (``lms_limit_samples``) at the start, at the end of
    every forward pass and of every step, and after the wait: how the device was shared.
    """
    results = Results(
        out,
        rank=rank,
        processes=processes,
        fraction=fraction,
        steps=steps,
        lms=lms,
        cap_share=cap_share,
        host_limit_mb=host_limit_mb,
        wave=wave,
        waves=waves,
        stage="start",
    )
    barrier = FileBarrier(barrier_dir, processes, rank, timeout_s=300)
    try:
        backend = ensure_lms_api()
        results.update(**environment(backend))
        device = worker_device()
        torch.empty(1, device=device)  # create the CUDA context before the start line
        total = torch.cuda.get_device_properties(device).total_memory
        tokens = mlp_tokens_for(int(fraction * total), MLP_WIDTH, MLP_LAYERS)
        need = mlp_need_bytes(tokens, MLP_WIDTH, MLP_LAYERS)
        cap = int(cap_share * total) if cap_share else None
        results.update(
            tokens=tokens,
            need_bytes=need,
            need_over_device=need / total,
            largest_alloc_bytes=tokens * MLP_WIDTH * 4,
            cap_bytes=cap,
        )
        results.save()
        barrier.wait("start")

        results["stage"] = "training"
        deterministic()
        clock = time.monotonic()
        samples: list[dict[str, Any]] = []

        def sample(at: str) -> None:
            if lms:
                samples.append(lms_sample(at, time.monotonic() - clock))
                results["lms_limit_samples"] = samples

        with memory_cap(cap) if cap else nullcontext():
            if lms:
                torch.cuda.set_enabled_lms(True)
                if host_limit_mb:
                    set_host_limit(host_limit_mb * MiB)
                torch.cuda.reset_accumulated_lms_stats()
                results["host_limit_bytes"] = host_limit_setting()
                sample("start")
            model, optimizer = build_mlp(device)
            seconds: list[float] = []
            losses: list[float] = []
            for step in range(steps):
                if step == 0 and waves > 1:
                    for earlier in range(wave):
                        barrier.wait(f"wave{earlier}")

                def after_forward(step: int = step) -> None:
                    sample(f"step {step} forward")
                    if step == 0 and waves > 1:
                        results.save()
                        for later in range(wave, waves):
                            barrier.wait(f"wave{later}")
                        sample("step 0 after the waves")

                start = time.perf_counter()
                x, y = mlp_batch(tokens, MLP_WIDTH, 9000 + 100 * rank + step, device)
                loss, _ = mlp_train_step(model, optimizer, x, y, 1, after_forward)
                del x, y
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - start)
                losses.append(float(loss))
                sample(f"step {step} end")
                if step == 0:
                    results["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
                    results.save()
                    results["waited_s"] = barrier.wait("step1")
                    sample("step 0 after the wait")
            del model, optimizer
            results.update(
                s_per_iter=per_iteration(seconds),
                seconds_per_step=seconds,
                losses=losses,
                finite=all(math.isfinite(v) for v in losses),
            )
            if lms:
                stats = torch.cuda.lms_stats()
                results.update(
                    lms_settings=lms_settings(),
                    lms=lms_summary(stats),
                    pageout_bytes=stats["pageout_bytes"],
                    pageout_bytes_per_iter=stats["pageout_bytes"] / steps,
                    stall_ms=stats["stall_ms"],
                )
        results["stage"] = "done"
        results.save()
        return 0
    except BaseException as exc:
        record_error(results, exc)
        # Free what this process holds (its tensors, and the pinned host memory of their
        # page-outs, which the host budget counts) before the others learn of the failure:
        # a process that goes on past the barrier must not find the budget still full of
        # the page-outs of a process that has stopped, as a process that exits frees them.
        model = optimizer = x = y = loss = None  # noqa: F841 (drops the references)
        release_after_failure(exc)
        barrier.fail()
        return 1


def release_after_failure(exc: BaseException) -> None:
    """Drops the tensors the failure's traceback keeps alive and returns this process's
    cached device and pinned host memory (``torch.cuda.empty_cache``, which with LMS also
    frees its idle pinned buffers)."""
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # a broken CUDA context: the process ends next anyway
        pass


# ---------------------------------------------------------------------------------------
# DistributedDataParallel on two GPUs
# ---------------------------------------------------------------------------------------

DDP_BATCH = 72
DDP_IMAGE = 256
DDP_CLASSES = 100


def ddp_model() -> tuple[nn.Module, str]:
    """torchvision's ResNet-50 (``lmsbench.models.resnet``) when torchvision is installed,
    else a CNN of our own."""
    try:
        import torchvision.models  # noqa: F401
    except ImportError:
        from tests.regression.lms_families import HighResCNN

        return HighResCNN(32, 4, levels=3, classes=DDP_CLASSES), "HighResCNN (no torchvision)"
    return resnet(50, DDP_CLASSES), "torchvision resnet50"


def train_ddp(rank: int, steps: int, probe: bool) -> FamilyRun:
    """One seeded DDP training run of this rank (its own data: the seed depends on rank)."""
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device(rank)
    deterministic()
    settle()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    module, run_name = ddp_model()
    model = DistributedDataParallel(
        module.to(device), device_ids=[rank] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run = FamilyRun(RunResult(), model=run_name)
    found: dict[str, Any] = {"bytes": 0, "source": ""}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            for step in range(steps):
                start = time.perf_counter()
                g = torch.Generator(device=device).manual_seed(10_000 + 100 * rank + step)
                images = torch.randn(DDP_BATCH, 3, DDP_IMAGE, DDP_IMAGE, device=device, generator=g)
                labels = torch.randint(0, DDP_CLASSES, (DDP_BATCH,), device=device, generator=g)
                if probe and step == 0:
                    with module_output_probe(model, found):
                        output = model(images)
                else:
                    output = model(images)
                loss = torch.nn.functional.cross_entropy(output, labels)
                del output, images, labels
                if probe and step == 0:
                    live = largest_live_block()
                    if live > found["bytes"]:
                        found.update(bytes=live, source="live allocation after the forward pass")
                loss.backward()
                run.result.losses.append(loss.detach().cpu())
                del loss
                if step == steps - 1:
                    run.result.grads = [
                        p.grad.detach().cpu() for p in model.parameters() if p.grad is not None
                    ]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                run.seconds_per_step.append(time.perf_counter() - start)
        run.result.params = [p.detach().cpu() for p in model.parameters()]
        run.peak_reserved_bytes = torch.cuda.max_memory_reserved()
    finally:
        del model, module, optimizer
        gc.collect()
    run.largest_alloc_bytes = int(found["bytes"])
    run.largest_alloc_source = str(found["source"])
    return run


def ddp_rank(rank: int, world: int, cap_share: float, steps: int, out_dir: str, port: int) -> None:
    """One rank of the ``ddp`` command (the target of ``mp.spawn``)."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if rank_device(rank).type == "cuda":
        torch.cuda.set_device(rank)
    results = Results(
        Path(out_dir) / f"ddp-rank{rank}.json", rank=rank, world=world, cap_share=cap_share
    )
    try:
        backend = ensure_lms_api()
        results.update(**environment(backend), steps=steps, stage="start")
        results.save()
        dist.init_process_group(
            DDP_BACKEND, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180)
        )
        results["stage"] = "reference"
        first = train_ddp(rank, steps, probe=True)
        second = train_ddp(rank, steps, probe=False)
        difference = first_difference(first.result, second.result)
        peak = max(first.peak_reserved_bytes, second.peak_reserved_bytes)
        cap = int(cap_share * peak)
        results.update(
            reference_peak_reserved_bytes=peak,
            reference_s_per_iter=per_iteration(second.seconds_per_step),
            reference_repeatable=difference is None,
            reference_difference=difference,
            reference_max_relative_difference=max_relative_difference(first.result, second.result),
            largest_alloc_bytes=first.largest_alloc_bytes,
            largest_alloc_source=first.largest_alloc_source,
            model=first.model,
            cap_bytes=cap,
            deficit_bytes=peak - cap,
        )
        del second
        results.save()

        results["stage"] = "capped"
        settle()
        with memory_cap(cap):
            torch.cuda.set_enabled_lms(True)
            torch.cuda.reset_accumulated_lms_stats()
            torch.cuda.reset_peak_lms_stats()
            capped = train_ddp(rank, steps, probe=False)
            stats = torch.cuda.lms_stats()
            results["lms_settings"] = lms_settings()
        difference = first_difference(first.result, capped.result)
        results.update(
            capped_s_per_iter=per_iteration(capped.seconds_per_step),
            capped_seconds_per_step=capped.seconds_per_step,
            lms=lms_summary(stats),
            pageout_bytes_per_iter=stats["pageout_bytes"] / steps,
            stall_ms=stats["stall_ms"],
            stall_ms_per_iter=stats["stall_ms"] / steps,
            bit_identical=difference is None,
            difference=difference,
            max_relative_difference=max_relative_difference(first.result, capped.result),
            stage="done",
        )
        results.save()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        record_error(results, exc)
        raise


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ddp(cap_share: float, steps: int, out_dir: Path) -> int:
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        mp.spawn(
            ddp_rank, args=(2, cap_share, steps, str(out_dir), free_port()), nprocs=2, join=True
        )
    except Exception as exc:  # a rank failed; each rank wrote its own error
        print(f"ddp: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


HOST_LIMIT_HELP = "LMS's host-memory budget in MiB (set_host_limit_lms); 0: the default"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("family", help="one model family, uncapped twice then capped")
    p.add_argument("--family", required=True)
    p.add_argument("--cap-share", type=float, required=True)
    p.add_argument("--tiny", action="store_true", help="the CPU-test size (a quick smoke run)")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("nocap", help="a need of FACTOR x the device, no cap")
    p.add_argument("--factor", type=float, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--host-limit-mb", type=nonneg_int, default=0, help=HOST_LIMIT_HELP)
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="no micro-batched run without LMS to compare with",
    )
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("share", help="one of several processes sharing one GPU")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--fraction", type=float, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-lms", dest="lms", action="store_false")
    p.add_argument(
        "--cap-share", type=float, default=0.0, help="cap the allocator at this share of the device"
    )
    p.add_argument("--host-limit-mb", type=nonneg_int, default=0, help=HOST_LIMIT_HELP)
    p.add_argument("--wave", type=nonneg_int, default=0)
    p.add_argument("--waves", type=positive_int, default=1)
    p.add_argument("--barrier", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("ddp", help="DistributedDataParallel on two GPUs, uncapped then capped")
    p.add_argument("--cap-share", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "share":
        if args.wave >= args.waves:
            parser.error(f"--wave {args.wave} is not below --waves {args.waves}")
        if not 0.0 <= args.cap_share <= 1.0:
            parser.error(f"--cap-share {args.cap_share} is not a share of the device")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "family":
        return run_family(args.family, args.cap_share, args.out, args.tiny)
    if args.command == "nocap":
        return run_nocap(args.factor, args.steps, args.out, args.host_limit_mb, args.reference)
    if args.command == "share":
        return run_share(
            args.rank,
            args.processes,
            args.fraction,
            args.steps,
            args.lms,
            args.barrier,
            args.out,
            cap_share=args.cap_share,
            host_limit_mb=args.host_limit_mb,
            wave=args.wave,
            waves=args.waves,
        )
    return run_ddp(args.cap_share, args.steps, args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
