#!/usr/bin/env python3
"""Large Model Support against the alternatives, on one GPU, in one run.

For one model group (``--model resnet152|vit_l|gpt``) it measures, in this order:

1. pinned host<->device copy bandwidth (D2H, H2D, both at once), with large asynchronous
   copies from and to pinned host memory;
2. ``baseline``: the model trained uncapped with LMS off at batch B; its peak allocated
   memory P sets the caps, its time per sample is the compute roofline;
3. ``lms_fits`` and ``baseline_repeat``: LMS on with everything fitting (uncapped), then LMS
   off again, for LMS's overhead when nothing is paged;
4. for each oversubscription factor f (default 1.5, 2, 4), under the cap P/f
   (``torch.cuda.set_per_process_memory_fraction``), at batch B, the methods of ``--methods``:
   ``lms`` (LMS's defaults, recompute as the build has it), ``lms_hybrid`` (``lms`` with
   ``torch.cuda.set_recompute_lms(True)``: a victim is dropped and recomputed instead of
   paged out where replaying its operator is cheaper than copying it out and back),
   ``lms_paging`` (recompute off: paging only), ``lms_reactive`` (the learned schedule off),
   ``lms_nopack`` (packing tight operators off: ``torch.cuda.set_packing_lms(False)``),
   ``lms_residual`` (``lms`` with ``torch.cuda.set_residual_recipes_lms(True)``: residual
   sums get recipes),
   ``offload`` (torchtune's ``OffloadActivations`` where installed, else the same
   stream-overlapped mechanism, ``models.StreamOffload``), ``save_on_cpu``
   (``torch.autograd.graph.save_on_cpu(pin_memory=True)``), ``checkpoint``
   (``torch.utils.checkpoint`` around every block) and ``compile_budget`` (``torch.compile``
   under AOTAutograd's ``activation_memory_budget``, chosen per row by activation_budget);
5. for each factor, while the search budget lasts: the largest batch that trains without
   LMS under the cap, ``no_lms`` measured at that batch, and the largest batch that trains
   with LMS (exponential then binary search; every probe a subprocess, so an out-of-memory
   error cannot poison the next one).

Every row gets throughput, bytes moved each way per iteration (LMS statistics for LMS, the
saved tensors' bytes through pack/unpack hooks for save_on_cpu, 0 for checkpointing; LMS rows
of a build that can recompute also the bytes dropped and recomputed and the replays' device
time per iteration) and
its efficiency against the roofline ``max(B x uncapped time per sample, copy time)``, where
the copy time of ``out`` bytes to and ``in`` bytes from the host is
``max(out / D2H, in / H2D, (out + in) / bidirectional)`` at the bandwidths measured in this
run. Capped rows also get two bounds from the deficit D (uncapped peak minus cap) instead
of their own traffic: ``max(B x uncapped time per sample, copy time of D out and D in)``
(both directions at once) and ``max(..., D / D2H + D / H2D)`` (one direction at a time, as
in training, where the forward pass pages out and the backward pass pages back in;
``--profile-iterations`` measures how much the two directions overlap). The output states
the gap to each goal; ``--help`` lists the goals with their targets (the ``*_GOAL``
constants below, the one place they are set).

Writes into ``--out``: compare-MODEL.csv (one row per measurement), compare-MODEL-goals.csv,
compare-MODEL.json (device, torch and CUDA versions, date, bandwidth, every measurement,
every search probe) and compare-MODEL.png (needs matplotlib; skipped with a message without).

``--regime nocap`` measures what users meet instead: a model bigger than the GPU and no cap at
all (no memory fraction is set anywhere). The uncapped LMS-off baseline at a batch that fits
(and, with ``--linearity-check``, a second batch) gives a linear memory model, peak = S + a x
batch; the device limit D is the memory free when the run starts (``torch.cuda.mem_get_info``);
each factor f (default 1.25, 1.5, 2) trains at the batch B_f = floor((f x D - S) / a), whose
need S + B_f x a (an estimate) exceeds D by the deficit. ``lms``, ``lms_hybrid``, ``offload``,
``save_on_cpu`` and ``checkpoint`` train there uncapped, against the same rooflines, with the
compute time extrapolated from the fitting run. It writes nocap-MODEL.csv, -goals.csv, .json
and .png, and compares LMS's efficiency with the capped results at the same deficit over limit
(``--capped-results``).

``--rescore FOLDER`` needs no GPU: it recomputes the goals of the runs recorded in FOLDER's
compare-MODEL.json and nocap-MODEL.json files with this version's goals and rewrites their
goals CSV and chart (the JSON and the measurement CSV stay as the run wrote them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

from lmsbench.harness import ENV_COLUMNS as ENV_COLUMNS  # summarize.py reads it from here
from lmsbench.harness import (
    RECORD_ENV_COLUMNS,
    Deadline,
    add_amp_option,
    add_gpt_options,
    add_out_option,
    add_step_options,
    add_time_budget_option,
    checkout_env,
    csv_env_columns,
    markdown_table,
    write_csv,
    write_json,
)
from lmsbench.lms_setup import (
    EXIT_OOM,
    GiB,
    LmsSettings,
    MiB,
    add_limit_share_option,
    add_lms_tuning_options,
    nonneg_int,
    positive_float,
    positive_int,
)
from lmsbench.search import (
    Outcome,
    Probe,
    ProbeError,
    SearchResult,
    find_largest,
    python_command,
    subprocess_probe,
)

HERE = Path(__file__).resolve().parent
MODELS = ("resnet152", "vit_l", "gpt")
REGIMES = ("capped", "nocap")
# Methods measured at batch B under every cap, or at each batch of the no-cap regime: what
# --methods may name.
PEER_METHODS = (
    "lms",
    "lms_hybrid",
    "lms_reactive",
    "lms_nopack",
    "lms_residual",
    "offload",
    "save_on_cpu",
    "checkpoint",
    "lms_paging",
    "compile_budget",
)
# Every method of a capped run's rows: the peers, and no_lms, measured at its own largest batch.
CAPPED_METHODS = (*PEER_METHODS, "no_lms")
# Methods run only where --methods names them: lms_nopack (what packing costs or saves),
# lms_residual (what residual recipes save, off by default), lms_paging (paging alone,
# whatever LMS's default) and compile_budget (a torch.compile per row, minutes of compiling).
NAMED_ONLY_METHODS = ("lms_nopack", "lms_residual", "lms_paging", "compile_budget")
# The capped regime's default --methods: every peer but those.
CAPPED_DEFAULT_METHODS = tuple(m for m in PEER_METHODS if m not in NAMED_ONLY_METHODS)
# Rows --profile-iterations profiles: the ones that move memory.
PROFILED_METHODS = (
    "lms",
    "lms_hybrid",
    "lms_reactive",
    "lms_nopack",
    "lms_residual",
    "offload",
    "save_on_cpu",
    "lms_paging",
)
# The goals. Each target is set here only: the goal rows, the chart's goal line and the
# --help text (goals_help) all read it.
# LMS time against the deficit roofline (Measurement.deficit_efficiency), at every factor.
EFFICIENCY_GOAL = 0.85
# Bytes LMS pages out per iteration over the deficit, at every factor.
OUT_VS_DEFICIT_GOAL = 1.25
# LMS samples/s over those of each of FASTER_THAN_RIVALS, at every factor: faster.
FASTER_THAN_GOAL = 1.0
FASTER_THAN_RIVALS = ("offload", "save_on_cpu")  # offload only where the run measured it
# LMS samples/s over checkpointing's at CHECKPOINT_PARITY_FACTORS: as fast. At every factor
# where checkpointing runs out of memory, the goal is that LMS trains.
CHECKPOINT_RATIO_GOAL = 1.0
CHECKPOINT_PARITY_FACTORS = (1.5,)
# Largest batch with LMS over the largest without, at every factor.
BATCH_RATIO_GOAL = 10.0
# LMS on with everything fitting: slowdown against LMS off.
OVERHEAD_GOAL = 0.01
EFFICIENCY_TARGET = f">= {EFFICIENCY_GOAL:.0%}"
OUT_VS_DEFICIT_TARGET = f"<= {OUT_VS_DEFICIT_GOAL:.2f}x"
FASTER_THAN_TARGET = f"> {FASTER_THAN_GOAL:.2f}x"
CHECKPOINT_RATIO_TARGET = f">= {CHECKPOINT_RATIO_GOAL:.2f}x"
TRAINS_TARGET = "LMS trains"
BATCH_RATIO_TARGET = f">= {BATCH_RATIO_GOAL:.0f}x"
OVERHEAD_TARGET = f"<= {OVERHEAD_GOAL:.0%}"
# The goals of the no-cap regime (--regime nocap), per factor.
# LMS time against the deficit roofline (deficit_efficiency), the deficit estimated.
NOCAP_EFFICIENCY_GOAL = 0.85
# Bytes LMS pages out per iteration over the (estimated) deficit.
NOCAP_OUT_VS_DEFICIT_GOAL = 1.25
# No-cap efficiency over the capped efficiency of the same model at the same deficit over
# limit (interpolated between the capped factors): a floor, no worse than capped.
NOCAP_VS_CAPPED_GOAL = 1.0
NOCAP_EFFICIENCY_TARGET = f">= {NOCAP_EFFICIENCY_GOAL:.0%}"
NOCAP_OUT_VS_DEFICIT_TARGET = f"<= {NOCAP_OUT_VS_DEFICIT_GOAL:.2f}x"
NOCAP_VS_CAPPED_TARGET = f">= {NOCAP_VS_CAPPED_GOAL:.2f}x capped"

# Per-regime defaults of the options whose parser default is None.
NOCAP_METHODS = ("lms", "lms_hybrid", "offload", "save_on_cpu", "checkpoint")
# The methods that train with LMS on: lms (LMS's defaults, recompute included: whatever this
# build does unless told), lms_hybrid (recompute on: torch.cuda.set_recompute_lms(True)),
# lms_paging (recompute off: paging only), lms_reactive (the learned schedule off),
# lms_nopack (packing off) and lms_residual (LMS's defaults and residual recipes on).
LMS_METHODS = ("lms", "lms_hybrid", "lms_reactive", "lms_nopack", "lms_residual", "lms_paging")
# LMS methods with recompute on.
RECOMPUTE_METHODS = ("lms_hybrid",)
# LMS methods that keep LMS's own recompute default (neither set on nor off); every LMS
# method not here or in RECOMPUTE_METHODS runs with recompute off.
DEFAULT_RECOMPUTE_METHODS = ("lms", "lms_residual")
# Compiled with torch.compile under AOTAutograd's activation memory budget
# (torch._functorch.config.activation_memory_budget, chosen per row by activation_budget):
# PyTorch's compile-time recompute, LMS off.
COMPILE_BUDGET_METHODS = ("compile_budget",)
# The share of the cap (or of the device, with no cap) the compile budget aims at: the rest
# is for the compiled graphs' own buffers and the allocator's rounding.
COMPILE_BUDGET_MARGIN = 0.85
# The time compiling a model takes, for the no-cap row estimate (a cautious guess: ResNet-152
# with a memory budget compiles in one to two minutes).
COMPILE_ESTIMATE_S = 120.0
# LMS methods with the learned swap schedule off.
REACTIVE_METHODS = ("lms_reactive",)
# LMS methods with packing off (torch.cuda.set_packing_lms(False)); every other LMS row packs.
NOPACK_METHODS = ("lms_nopack",)
# LMS methods with residual recipes on (torch.cuda.set_residual_recipes_lms(True)); every
# other LMS row runs with them off, the engine's default.
RESIDUAL_METHODS = ("lms_residual",)
REGIME_DEFAULTS: dict[str, dict[str, Any]] = {
    "capped": {
        "factors": [1.5, 2.0, 4.0, 8.0],
        "warmup": 6,
        "iterations": 5,
        "methods": CAPPED_DEFAULT_METHODS,
        "search": True,
        "overhead": True,
        "linearity_check": False,
    },
    # 4 + 3: LMS's first iteration pins its host memory and the learned schedule is adopted
    # in the third; three steady iterations at the large batches of this regime keep a model's
    # rows within one 10-minute call.
    "nocap": {
        "factors": [1.25, 1.5, 2.0],
        "warmup": 4,
        "iterations": 3,
        "methods": NOCAP_METHODS,
        "search": False,
        "overhead": False,
        "linearity_check": True,
    },
}
# The second fitting batch of --linearity-check: the largest the one-batch model puts at
# FIT_FILL of the device limit, at most FIT_MAX_MULTIPLE times the first batch.
FIT_FILL = 0.7
FIT_MAX_MULTIPLE = 4
# A no-cap deficit over limit this close (relative) to the ends of the capped results' range
# is compared with the end point.
CAPPED_RATIO_TOLERANCE = 0.05
# LMS keeps this share of the device free (extension/README.md): its host memory is about the
# deficit plus this.
LMS_DEVICE_HEADROOM = 0.05
# Host memory left to the system when a no-cap row's pinned host memory is checked.
HOST_MARGIN_BYTES = 4 << 30
# The time estimate of a no-cap row (estimate_row_seconds): building, settling, the first
# step's pinning at PIN_BYTES_PER_S (a cautious guess), and NOCAP_PRIOR_SLOWDOWN over the
# serial roofline until rows of the run measure it; the final save's reserve.
ROW_SETUP_S = 10.0
PIN_BYTES_PER_S = 3e9
NOCAP_PRIOR_SLOWDOWN = 2.0
NOCAP_OBSERVED_MARGIN = 1.25
CHECKPOINT_RECOMPUTE = 4 / 3
FINAL_RESERVE_S = 15.0


# ---------------------------------------------------------------------------------------
# Arithmetic (no torch)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bandwidth:
    """Pinned copy bandwidths in bytes per second."""

    d2h: float
    h2d: float
    bidirectional: float  # both directions at once, bytes of both counted

    def validate(self) -> None:
        for name in ("d2h", "h2d", "bidirectional"):
            if not getattr(self, name) > 0:
                raise ValueError(f"bandwidth {name} must be positive, got {getattr(self, name)}")


def copy_seconds(out_bytes: float, in_bytes: float, bw: Bandwidth) -> float:
    """The least time in which ``out_bytes`` can go to the host and ``in_bytes`` come back."""
    bw.validate()
    if out_bytes < 0 or in_bytes < 0:
        raise ValueError("bytes moved cannot be negative")
    return max(out_bytes / bw.d2h, in_bytes / bw.h2d, (out_bytes + in_bytes) / bw.bidirectional)


def roofline_seconds(
    compute_s_per_sample: float, batch: int, out_bytes: float, in_bytes: float, bw: Bandwidth
) -> float:
    """The roofline time of one iteration: the uncapped compute of ``batch`` samples or the
    copies, whichever takes longer."""
    if compute_s_per_sample <= 0 or batch <= 0:
        raise ValueError("compute time per sample and batch must be positive")
    return max(compute_s_per_sample * batch, copy_seconds(out_bytes, in_bytes, bw))


def serial_copy_seconds(out_bytes: float, in_bytes: float, bw: Bandwidth) -> float:
    """The least time to move ``out_bytes`` to the host and then ``in_bytes`` back, one
    direction at a time."""
    bw.validate()
    if out_bytes < 0 or in_bytes < 0:
        raise ValueError("bytes moved cannot be negative")
    return out_bytes / bw.d2h + in_bytes / bw.h2d


def efficiency(roofline_s: float, measured_s: float) -> float:
    """Roofline time over measured time (1.0: at the roofline)."""
    if measured_s <= 0:
        raise ValueError("measured time must be positive")
    return roofline_s / measured_s


def overhead(on_s: float, off_s: Sequence[float]) -> float:
    """Relative slowdown of ``on_s`` against the mean of the LMS-off times."""
    if not off_s or any(t <= 0 for t in off_s) or on_s <= 0:
        raise ValueError("times must be positive")
    reference = sum(off_s) / len(off_s)
    return on_s / reference - 1.0


def cap_bytes(peak_bytes: int, factor: float) -> int:
    """The memory cap that oversubscribes a run of peak ``peak_bytes`` by ``factor``."""
    if factor <= 1.0:
        raise ValueError(f"an oversubscription factor must be > 1, got {factor}")
    return int(peak_bytes / factor)


def activation_budget(
    limit_bytes: int, need_bytes: int, static_bytes: int, margin: float = COMPILE_BUDGET_MARGIN
) -> float:
    """The ``activation_memory_budget`` of a compile_budget row: the share of the activation
    memory (``need_bytes`` less ``static_bytes``, which does not grow with the batch:
    parameters, gradients, optimizer state) that fits in ``margin`` x ``limit_bytes`` (the cap,
    or the device with no cap) beside the static memory, clamped to [0, 1] (0: the partitioner
    recomputes everything it can), rounded to 3 digits."""
    if limit_bytes <= 0 or not 0 < margin <= 1 or static_bytes < 0:
        raise ValueError("need a positive limit, static bytes >= 0 and a margin in (0, 1]")
    activation = need_bytes - static_bytes
    if activation <= 0:
        return 1.0
    share = (margin * limit_bytes - static_bytes) / activation
    return round(min(1.0, max(0.0, share)), 3)


def batch_bounds(batch: int, peak: int, static: int, cap: int, host_budget: int) -> tuple[int, int]:
    """(start of the no-LMS search, upper bound of the LMS search) from a linear memory model.

    ``peak`` and ``static`` (parameters and optimizer state) come from the uncapped run at
    ``batch``; each sample is assumed to need ``(peak - static) / batch`` bytes. Without LMS
    a batch needs them all on the device; with LMS they can spread over the cap plus the host
    memory budget (pinned host memory is what bounds LMS).
    """
    if batch < 1 or peak <= static or cap <= 0 or host_budget < 0:
        raise ValueError("need batch >= 1, peak > static, cap > 0, host budget >= 0")
    per_sample = (peak - static) / batch
    start = max(1, min(batch, int((cap - static) / per_sample)))
    upper = max(1, int((cap + host_budget - static) / per_sample))
    return start, upper


@dataclass
class Measurement:
    model: str
    method: str
    factor: float | None  # None: uncapped
    cap_bytes: int | None
    batch: int
    status: str = "ok"  # ok, oom, error, skipped
    detail: str = ""
    iteration_times: list[float] = field(default_factory=list)
    iteration_s: float | None = None  # median of the timed iterations
    samples_per_s: float | None = None
    out_bytes_per_iter: float | None = None
    in_bytes_per_iter: float | None = None
    stall_ms_per_iter: float | None = None
    # Bytes of the uncapped peak at this batch that do not fit under the cap: what any method
    # must keep off the device (rows at batch B only).
    deficit_bytes: int | None = None
    lms_schedule: str = ""  # the learned swap schedule at the end of the row (LMS rows)
    peak_allocated_bytes: int | None = None
    static_bytes: int | None = None
    roofline_s: float | None = None
    efficiency: float | None = None
    # Against the deficit rather than the row's own traffic (capped rows at batch B): the
    # deficit out and back in with both directions at once, and with one direction at a
    # time (a forward pass pages out, its backward pages back in: the two directions of
    # activation traffic hardly overlap, which --profile-iterations measures).
    deficit_roofline_s: float | None = None
    deficit_efficiency: float | None = None
    serial_roofline_s: float | None = None
    serial_efficiency: float | None = None
    largest_batch: int | None = None
    largest_batch_note: str = ""
    oom_retries: int = 0
    # --profile-iterations: stream_profile.StreamBreakdown.record() of iterations run after
    # the timed ones under torch.profiler (not part of the timing).
    profile: dict[str, Any] | None = None
    # The first step's time (time to the first step: LMS pins its host memory in it) and the
    # other untimed steps'; the whole row's wall time (build, steps, profile, clean-up).
    first_iteration_s: float | None = None
    # LMS rows: where the first step's time went, from the statistics around it alone
    # (iteration_account): what settling costs before the learned schedule and the recipes'
    # prices exist. warmup_accounts: the same of every untimed step, the first included, with
    # the learned schedule's state at its end (how many steps settling takes).
    first_iteration: dict[str, float] | None = None
    warmup_accounts: list[dict[str, float]] = field(default_factory=list)
    warmup_times: list[float] = field(default_factory=list)
    row_s: float | None = None
    # The caching allocator's retries (num_alloc_retries: cache released after a failed
    # allocation) over the whole row and over the timed iterations.
    alloc_retries: int | None = None
    alloc_retries_timed: int | None = None
    # Peak pinned host memory (LMS rows: LMS's host_bytes; others: PyTorch's pinned host
    # allocator, rounded blocks) and peak resident host memory of the process (VmHWM) during
    # the row; host_memory_source says where each came from.
    host_pinned_peak_bytes: int | None = None
    host_rss_peak_bytes: int | None = None
    host_memory_source: str = ""
    lms_limit_bytes: int | None = None  # LMS's limit in force at the end of the row
    # No cap (--regime nocap, rows at a factor's batch): the need at this batch estimated
    # by the linear memory model, and the device limit D; deficit_bytes = need - limit.
    need_bytes: int | None = None
    limit_bytes: int | None = None
    # Recompute (LMS rows of a build whose statistics have it; lms_hybrid turns it on): per
    # timed iteration, victims dropped instead of paged out and dropped storages recomputed
    # (count and bytes), and the device time of the replays; the peak of the bytes held
    # dropped over the row. None where the statistics have no recompute keys.
    drop_count_per_iter: float | None = None
    drop_bytes_per_iter: float | None = None
    recompute_count_per_iter: float | None = None
    recompute_bytes_per_iter: float | None = None
    recompute_ms_per_iter: float | None = None
    dropped_peak_bytes: int | None = None
    # Per operator of the recipes, over the timed iterations: outputs dropped and recomputed,
    # and their bytes (``torch.cuda.lms_recompute_operators``); None where LMS has no counts.
    recompute_operators: dict[str, dict[str, int]] | None = None
    # Per timed iteration: inputs of dropped storages' recipes the learned schedule paged in
    # ahead of their recompute (bytes), and page-ins made on the compute stream when an
    # operator (or a replay) needed a storage (count). None where the statistics lack them.
    recompute_input_prefetch_bytes_per_iter: float | None = None
    pagein_demand_count_per_iter: float | None = None
    # Per timed iteration: operators packed before they pinned their inputs (everything
    # inactive paged out so that their tensors fit in as few pages as they need). None where
    # the statistics lack the key.
    pack_count_per_iter: float | None = None
    # Allocations LMS placed before the allocator failed them (fragment_placements): large
    # ones before it tried them; with the drop-in, any its free list could not hold.
    placements_per_iter: float | None = None
    # LMS rows: whether recompute was on (get_recompute_lms after the row's setting; None
    # where the build cannot say). compile_budget rows: the activation_memory_budget used.
    recompute_on: bool | None = None
    activation_budget: float | None = None

    def finish_timing(self) -> None:
        if self.iteration_times:
            self.iteration_s = statistics.median(self.iteration_times)
            self.samples_per_s = self.batch / self.iteration_s


def fill_roofline(rows: Sequence[Measurement], compute_s_per_sample: float, bw: Bandwidth) -> None:
    """Sets ``roofline_s`` and ``efficiency`` of every measured row, and the deficit
    rooflines of every measured row with a deficit."""
    for m in rows:
        if m.status != "ok" or m.iteration_s is None:
            continue
        if m.deficit_bytes is not None:
            compute = compute_s_per_sample * m.batch
            d = float(m.deficit_bytes)
            m.deficit_roofline_s = max(compute, copy_seconds(d, d, bw))
            m.deficit_efficiency = efficiency(m.deficit_roofline_s, m.iteration_s)
            m.serial_roofline_s = max(compute, serial_copy_seconds(d, d, bw))
            m.serial_efficiency = efficiency(m.serial_roofline_s, m.iteration_s)
        m.roofline_s = roofline_seconds(
            compute_s_per_sample,
            m.batch,
            m.out_bytes_per_iter or 0.0,
            m.in_bytes_per_iter or 0.0,
            bw,
        )
        m.efficiency = efficiency(m.roofline_s, m.iteration_s)


@dataclass
class Goal:
    goal: str
    factor: float | None
    value: float | None
    target: str
    met: bool | None  # None: not measured
    gap: str
    note: str = ""


def _find(rows: Sequence[Measurement], method: str, factor: float | None) -> Measurement | None:
    for m in rows:
        if m.method == method and m.factor == factor:
            return m
    return None


def evaluate_goals(rows: Sequence[Measurement], factors: Sequence[float]) -> list[Goal]:
    """The gap to each goal, from the measurements (nothing is assumed where one is missing).

    Per factor: ``lms_efficiency``, ``lms_out_vs_deficit``, ``lms_faster_than_RIVAL`` for each
    of FASTER_THAN_RIVALS (offload only where the run measured it), one goal against
    checkpointing (``_checkpoint_goal``) and ``largest_batch_ratio``; then
    ``overhead_when_fitting``.
    """
    measured_offload = any(m.method == "offload" for m in rows)
    rivals = [r for r in FASTER_THAN_RIVALS if r != "offload" or measured_offload]
    goals: list[Goal] = []
    for f in factors:
        lms = _find(rows, "lms", f)
        goals.append(_efficiency_goal(lms, f))
        goals.append(_out_vs_deficit_goal(lms, f))
        for rival in rivals:
            goals.append(
                _speed_goal(
                    f"lms_faster_than_{rival}",
                    lms,
                    _find(rows, rival, f),
                    rival,
                    f,
                    FASTER_THAN_GOAL,
                    FASTER_THAN_TARGET,
                    strict=True,
                )
            )
        checkpoint = _checkpoint_goal(lms, _find(rows, "checkpoint", f), f)
        if checkpoint is not None:
            goals.append(checkpoint)
        goals.append(_batch_ratio_goal(lms, _find(rows, "no_lms", f), f))
    goals.append(_overhead_goal(rows))
    return goals


def _efficiency_goal(
    lms: Measurement | None,
    f: float,
    name: str = "lms_efficiency",
    goal: float = EFFICIENCY_GOAL,
    target: str = EFFICIENCY_TARGET,
    above_note: str = "",
) -> Goal:
    """LMS's time against the deficit roofline (its ``deficit_efficiency``)."""
    if lms is None or lms.status != "ok" or lms.deficit_efficiency is None:
        note = _status_note(lms)
        if lms is not None and lms.status == "ok":
            note = "no deficit roofline: the row records no deficit"
        return Goal(name, f, None, target, None, "not measured", note)
    e = lms.deficit_efficiency
    note = ""
    if e > 1.0:
        note = (
            "above the roofline: the measured copy bandwidth or the uncapped time "
            "underestimates what this run achieved" + above_note
        )
    gap = f"{(e - goal) * 100:+.1f} points"
    return Goal(name, f, e, target, e >= goal, gap, note)


def _out_vs_deficit_goal(
    lms: Measurement | None,
    f: float,
    name: str = "lms_out_vs_deficit",
    goal: float = OUT_VS_DEFICIT_GOAL,
    target: str = OUT_VS_DEFICIT_TARGET,
) -> Goal:
    """Bytes LMS pages out per iteration over the deficit."""
    if lms is None or lms.status != "ok" or lms.out_bytes_per_iter is None or not lms.deficit_bytes:
        note = _status_note(lms)
        if lms is not None and lms.status == "ok":
            note = "no deficit or no page-out bytes recorded"
        return Goal(name, f, None, target, None, "not measured", note)
    ratio = lms.out_bytes_per_iter / lms.deficit_bytes
    gap = f"{goal - ratio:+.2f}x"
    return Goal(name, f, ratio, target, ratio <= goal, gap)


def _speed_goal(
    name: str,
    lms: Measurement | None,
    other: Measurement | None,
    rival: str,
    f: float,
    goal: float,
    target: str,
    *,
    strict: bool,
) -> Goal:
    """LMS's samples/s over ``rival``'s: met above ``goal`` (``strict``) or at it; met as well
    where the rival ran out of memory and LMS trained."""
    if lms is None or lms.status != "ok" or lms.samples_per_s is None:
        return Goal(name, f, None, target, None, "not measured", "LMS: " + _status_note(lms))
    if other is not None and other.status == "oom":
        return Goal(
            name,
            f,
            None,
            target,
            True,
            "rival cannot train",
            f"{rival} ran out of memory at this cap",
        )
    if other is None or other.status != "ok" or other.samples_per_s is None:
        return Goal(name, f, None, target, None, "not measured", f"{rival}: " + _status_note(other))
    ratio = lms.samples_per_s / other.samples_per_s
    met = ratio > goal if strict else ratio >= goal
    return Goal(name, f, ratio, target, met, f"{(ratio / goal - 1) * 100:+.1f}%")


def _checkpoint_goal(lms: Measurement | None, ckpt: Measurement | None, f: float) -> Goal | None:
    """The goal against checkpointing at factor ``f``, or None where there is none.

    Where checkpointing ran out of memory: ``lms_trains_where_checkpoint_cannot`` (met when
    LMS trained). Otherwise, at CHECKPOINT_PARITY_FACTORS: ``lms_vs_checkpoint``, the ratio of
    samples/s against CHECKPOINT_RATIO_GOAL. At the other factors checkpointing that trains
    sets no goal (None); checkpointing not measured leaves the first goal not measured.
    """
    trains = "lms_trains_where_checkpoint_cannot"
    if ckpt is not None and ckpt.status == "oom":
        if lms is not None and lms.status == "ok":
            return Goal(
                trains,
                f,
                None,
                TRAINS_TARGET,
                True,
                "checkpoint cannot train",
                "checkpoint ran out of memory at this cap",
            )
        if lms is not None and lms.status == "oom":
            return Goal(
                trains, f, None, TRAINS_TARGET, False, "neither trains", "LMS: " + _status_note(lms)
            )
        return Goal(
            trains, f, None, TRAINS_TARGET, None, "not measured", "LMS: " + _status_note(lms)
        )
    if any(math.isclose(f, p) for p in CHECKPOINT_PARITY_FACTORS):
        return _speed_goal(
            "lms_vs_checkpoint",
            lms,
            ckpt,
            "checkpoint",
            f,
            CHECKPOINT_RATIO_GOAL,
            CHECKPOINT_RATIO_TARGET,
            strict=False,
        )
    if ckpt is None or ckpt.status != "ok":
        return Goal(
            trains,
            f,
            None,
            TRAINS_TARGET,
            None,
            "not measured",
            "checkpoint: " + _status_note(ckpt),
        )
    return None


def _batch_ratio_goal(lms: Measurement | None, no_lms: Measurement | None, f: float) -> Goal:
    """The largest batch with LMS over the largest without."""
    name = "largest_batch_ratio"
    lms_b = lms.largest_batch if lms is not None else None
    nol_b = no_lms.largest_batch if no_lms is not None else None
    if lms_b is None or nol_b is None:
        return Goal(
            name,
            f,
            None,
            BATCH_RATIO_TARGET,
            None,
            "not measured",
            "search not run or incomplete",
        )
    if nol_b == 0:
        return Goal(
            name,
            f,
            None,
            BATCH_RATIO_TARGET,
            lms_b > 0,
            "no-LMS trains no batch",
            f"LMS trains batch {lms_b}; without LMS not even batch 1 fits",
        )
    ratio = lms_b / nol_b
    note = "; ".join(
        n
        for n in (
            (lms.largest_batch_note if lms else ""),
            (no_lms.largest_batch_note if no_lms else ""),
        )
        if n
    )
    return Goal(
        name,
        f,
        ratio,
        BATCH_RATIO_TARGET,
        ratio >= BATCH_RATIO_GOAL,
        f"{ratio - BATCH_RATIO_GOAL:+.1f}x",
        note,
    )


def _overhead_goal(rows: Sequence[Measurement]) -> Goal:
    """LMS on with everything fitting against the mean of the LMS-off runs."""
    on = _find(rows, "lms_fits", None)
    offs = [
        m
        for m in (_find(rows, "baseline", None), _find(rows, "baseline_repeat", None))
        if m is not None and m.status == "ok" and m.iteration_s is not None
    ]
    if on is None or on.status != "ok" or on.iteration_s is None or not offs:
        return Goal(
            "overhead_when_fitting",
            None,
            None,
            OVERHEAD_TARGET,
            None,
            "not measured",
            _status_note(on),
        )
    o = overhead(on.iteration_s, [m.iteration_s for m in offs if m.iteration_s])
    noise = ""
    if len(offs) == 2 and offs[0].iteration_s and offs[1].iteration_s:
        spread = abs(offs[0].iteration_s - offs[1].iteration_s) / min(
            offs[0].iteration_s, offs[1].iteration_s
        )
        noise = f"LMS-off runs differ by {spread:.1%}"
    return Goal(
        "overhead_when_fitting",
        None,
        o,
        OVERHEAD_TARGET,
        o <= OVERHEAD_GOAL,
        f"{(OVERHEAD_GOAL - o) * 100:+.1f} points",
        noise,
    )


def _status_note(m: Measurement | None) -> str:
    if m is None:
        return "not run"
    text = m.status + (f": {m.detail}" if m.detail else "")
    return text[:200]


# ---------------------------------------------------------------------------------------
# No cap: batches, estimates and goals (no torch)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryModel:
    """Peak allocated memory of an uncapped, LMS-off training step as a linear function of the
    batch: ``intercept_bytes + per_sample_bytes x batch``."""

    intercept_bytes: float  # S: what does not grow with the batch
    per_sample_bytes: float  # a
    source: str  # how it was obtained, in words
    points: tuple[tuple[int, int], ...]  # the measured (batch, peak allocated bytes)

    def bytes_at(self, batch: int) -> float:
        return self.intercept_bytes + self.per_sample_bytes * batch

    def record(self) -> dict[str, Any]:
        return {
            "intercept_bytes": self.intercept_bytes,
            "per_sample_bytes": self.per_sample_bytes,
            "source": self.source,
            "points": [list(p) for p in self.points],
        }


def one_batch_memory_model(batch: int, peak: int, static: int) -> MemoryModel:
    """The memory model of one uncapped run: S = ``static`` (what its first step leaves
    allocated: parameters, optimizer state), a = (``peak`` - S) / ``batch``. Raises ValueError
    where that gives no positive per-sample size."""
    if batch < 1:
        raise ValueError(f"the fitting batch must be >= 1, got {batch}")
    if static < 0 or peak <= static:
        raise ValueError(
            f"the peak ({peak / GiB:.2f} GiB) must exceed the static memory "
            f"({static / GiB:.2f} GiB) for a per-sample size"
        )
    return MemoryModel(
        float(static),
        (peak - static) / batch,
        f"one batch: S = memory after the first step, a = (peak - S) / {batch}",
        ((batch, peak),),
    )


def fitted_memory_model(first: MemoryModel, batch: int, peak: int) -> MemoryModel:
    """The line through ``first``'s measured point and (``batch``, ``peak``): slope a and
    intercept S fitted. Where the two points give no usable line (the same batch, a peak that
    does not grow with the batch, a negative intercept) ``first`` stays, the second point
    recorded and the reason in its source."""
    b0, p0 = first.points[0]
    points = tuple(sorted({(b0, p0), (batch, peak)}))
    if batch == b0:
        return replace(first, source=f"{first.source}; second batch equal to the first: not fitted")
    slope = (peak - p0) / (batch - b0)
    intercept = p0 - slope * b0
    if slope <= 0 or intercept < 0:
        why = "the peak does not grow with the batch" if slope <= 0 else "negative intercept"
        return replace(
            first,
            source=f"{first.source}; fit of batches {b0} and {batch} not used: {why} "
            f"(slope {slope / GiB:.4f} GiB, intercept {intercept / GiB:.3f} GiB)",
            points=points,
        )
    return MemoryModel(
        intercept,
        slope,
        f"fit of batches {points[0][0]} and {points[1][0]} (one-batch a was "
        f"{first.per_sample_bytes / GiB:.4f} GiB, S {first.intercept_bytes / GiB:.3f} GiB)",
        points,
    )


def second_fit_batch(
    model: MemoryModel,
    limit_bytes: int,
    fill: float = FIT_FILL,
    most: int = FIT_MAX_MULTIPLE,
) -> int | None:
    """The batch of the linearity check: the largest that ``model`` (one batch b0) puts at
    ``fill`` of the device limit, at most ``most`` x b0; b0 // 2 where that is not above b0;
    None for b0 = 1 with no room for more."""
    b0 = model.points[0][0]
    room = math.floor((fill * limit_bytes - model.intercept_bytes) / model.per_sample_bytes)
    batch = min(most * b0, room)
    if batch > b0:
        return batch
    return b0 // 2 if b0 >= 2 else None


@dataclass(frozen=True)
class NocapPlan:
    """A factor's batch in the no-cap regime, with its estimated need and the deficit."""

    factor: float
    batch: int
    need_bytes: int  # the memory model at this batch: an estimate, not measured
    limit_bytes: int  # the device limit D

    @property
    def deficit_bytes(self) -> int:
        return self.need_bytes - self.limit_bytes

    def record(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "batch": self.batch,
            "need_bytes": self.need_bytes,
            "need_is_estimate": True,
            "limit_bytes": self.limit_bytes,
            "deficit_bytes": self.deficit_bytes,
            "need_over_limit": self.need_bytes / self.limit_bytes,
        }


def nocap_plan(model: MemoryModel, limit_bytes: int, factor: float) -> NocapPlan:
    """The batch whose need is ``factor`` x the device limit D (rounded down):
    B = floor((f x D - S) / a), need = S + B x a, deficit = need - D. Raises ValueError with
    the reason where no batch has such a need: S >= f x D, B < 1, or B's need fits D."""
    if not factor > 1:
        raise ValueError(f"a factor must be > 1, got {factor}")
    if limit_bytes <= 0 or model.per_sample_bytes <= 0:
        raise ValueError("the device limit and the per-sample bytes must be positive")
    target = factor * limit_bytes
    static, a = model.intercept_bytes, model.per_sample_bytes
    if static >= target:
        raise ValueError(
            f"{factor:g}x: the memory that does not grow with the batch ({static / GiB:.2f} GiB: "
            f"parameters, optimizer state) is already {factor:g} x the device limit "
            f"({target / GiB:.2f} GiB) or more: no batch has that need"
        )
    batch = math.floor((target - static) / a)
    if batch < 1:
        raise ValueError(
            f"{factor:g}x needs a batch below 1: one sample needs {a / GiB:.2f} GiB and "
            f"{factor:g} x the device limit leaves {(target - static) / GiB:.2f} GiB for samples"
        )
    need = static + batch * a
    if need <= limit_bytes:
        raise ValueError(
            f"{factor:g}x: batch {batch} needs {need / GiB:.2f} GiB, which fits the device "
            f"limit ({limit_bytes / GiB:.2f} GiB): the factor is too close to 1 for samples of "
            f"{a / GiB:.2f} GiB"
        )
    return NocapPlan(factor, batch, int(need), limit_bytes)


FIT_METHODS = ("baseline", "baseline_fit")


def nocap_compute_s_per_sample(rows: Sequence[Measurement]) -> tuple[float, int] | None:
    """(seconds per sample, batch) of the uncapped LMS-off fitting run with the largest batch
    (``baseline`` or ``baseline_fit``): the compute roofline of the no-cap rows, B_f x it.
    None without one that trained."""
    fits = [
        m
        for m in rows
        if m.method in FIT_METHODS and m.factor is None and m.status == "ok" and m.iteration_s
    ]
    if not fits:
        return None
    best = max(fits, key=lambda m: m.batch)
    assert best.iteration_s is not None
    return best.iteration_s / best.batch, best.batch


HOST_COPY_METHODS = ("offload", "save_on_cpu")


def nocap_host_bytes(
    method: str, plan: NocapPlan, per_sample_bytes: float, saved_per_sample: float | None = None
) -> int:
    """The pinned host memory a no-cap row is estimated to need: LMS about the deficit plus
    the device share it keeps free (every LMS method: lms_hybrid holds no more than lms, what
    it drops needs no host copy); offload and save_on_cpu every saved tensor, B x the bytes
    autograd saves per sample (``saved_per_sample``, measured) or B x a where that is larger
    or not measured (saved tensors can add up to more than the peak); checkpointing none."""
    if method in LMS_METHODS:
        return int(plan.deficit_bytes + LMS_DEVICE_HEADROOM * plan.limit_bytes)
    if method in HOST_COPY_METHODS:
        return int(plan.batch * max(per_sample_bytes, saved_per_sample or 0.0))
    return 0


def estimate_row_seconds(
    compute_s: float,
    out_bytes: float,
    in_bytes: float,
    pinned_bytes: float,
    bw: Bandwidth,
    steps: int,
    slowdown: float = 1.0,
) -> float:
    """A row's wall time: ``slowdown`` x (ROW_SETUP_S + ``steps`` x max(compute, the copies
    one direction after the other) + pinning ``pinned_bytes`` at PIN_BYTES_PER_S)."""
    if steps < 1 or slowdown <= 0 or compute_s < 0 or pinned_bytes < 0:
        raise ValueError("need steps >= 1, slowdown > 0, compute and pinned bytes >= 0")
    step = max(compute_s, serial_copy_seconds(out_bytes, in_bytes, bw))
    return slowdown * (ROW_SETUP_S + steps * step + pinned_bytes / PIN_BYTES_PER_S)


def nocap_row_estimate(
    method: str,
    plan: NocapPlan,
    per_sample_bytes: float,
    compute_s_per_sample: float,
    bw: Bandwidth,
    steps: int,
    saved_per_sample: float | None = None,
) -> float:
    """estimate_row_seconds of ``method`` at ``plan``'s batch (slowdown 1): LMS moves its host
    estimate each way, offload and save_on_cpu every saved tensor, checkpointing recomputes.
    lms_hybrid gets lms's estimate, a bound: it moves at most what lms moves, and drops a
    victim only where replaying its operator takes less than the copies it saves. A
    compile_budget row recomputes as checkpointing does, after COMPILE_ESTIMATE_S of
    compiling."""
    compute = compute_s_per_sample * plan.batch
    host = nocap_host_bytes(method, plan, per_sample_bytes, saved_per_sample)
    if method == "checkpoint" or method in COMPILE_BUDGET_METHODS:
        compute *= CHECKPOINT_RECOMPUTE
    compiling = COMPILE_ESTIMATE_S if method in COMPILE_BUDGET_METHODS else 0.0
    return estimate_row_seconds(compute, host, host, host, bw, steps) + compiling


def interpolate_capped_efficiency(
    points: Sequence[tuple[float, float]],
    ratio: float,
    tolerance: float = CAPPED_RATIO_TOLERANCE,
) -> tuple[float | None, str]:
    """The capped efficiency at deficit over limit ``ratio``, from capped rows' (deficit over
    limit, efficiency) ``points``: the point's where one matches, linear between the two
    around it, the end point's where ``ratio`` is within ``tolerance`` (relative) outside the
    range; otherwise None. Returns it with how it was obtained (or why not), in words."""
    pts = sorted(points)
    if not pts:
        return None, "no capped LMS row trained"
    lo, hi = pts[0][0], pts[-1][0]
    if ratio < lo * (1 - tolerance) or ratio > hi * (1 + tolerance):
        span = f"{lo:.2f}" if lo == hi else f"{lo:.2f} to {hi:.2f}"
        return None, (
            f"deficit/limit {ratio:.2f} is outside the capped results' {span}: "
            "not comparable without extrapolating"
        )
    r = min(max(ratio, lo), hi)
    for x, e in pts:
        if math.isclose(x, r, rel_tol=1e-9, abs_tol=1e-12):
            near = "" if r == ratio else f" (this run {ratio:.2f}, within {tolerance:.0%})"
            return e, f"capped at deficit/limit {x:.2f}: {e:.1%}{near}"
    for (x0, e0), (x1, e1) in zip(pts, pts[1:]):
        if x0 < r < x1:
            e = e0 + (e1 - e0) * (r - x0) / (x1 - x0)
            return e, (
                f"interpolated at deficit/limit {r:.2f} between capped {x0:.2f} ({e0:.1%}) "
                f"and {x1:.2f} ({e1:.1%})"
            )
    raise AssertionError("unreachable: ratio inside the range")  # pragma: no cover


@dataclass(frozen=True)
class CappedPoint:
    factor: float
    deficit_over_limit: float  # deficit / cap of the capped row
    efficiency: float  # its deficit_efficiency


@dataclass(frozen=True)
class CappedReference:
    """The capped results a no-cap run is compared with: LMS's deficit efficiency per
    deficit over limit; ``reason`` says why they are not comparable, where they are not."""

    source: str
    device: str = ""
    workload: str = ""
    points: tuple[CappedPoint, ...] = ()
    reason: str = ""

    def record(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "device": self.device,
            "workload": self.workload,
            "points": [asdict(p) for p in self.points],
            "reason": self.reason,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> CappedReference | None:
        if not record:
            return None
        try:
            return cls(
                source=str(record.get("source", "")),
                device=str(record.get("device", "")),
                workload=str(record.get("workload", "")),
                points=tuple(CappedPoint(**p) for p in record.get("points") or ()),
                reason=str(record.get("reason", "")),
            )
        except TypeError as exc:
            raise ValueError(f"capped_reference: {exc}") from None


def _vs_capped_goal(
    lms: Measurement | None, f: float, reference: CappedReference | None, device: str
) -> Goal:
    """The no-cap LMS deficit efficiency over the capped one at the same deficit over limit."""
    name, target = "nocap_vs_capped", NOCAP_VS_CAPPED_TARGET
    if lms is None or lms.status != "ok" or lms.deficit_efficiency is None:
        note = _status_note(lms)
        if lms is not None and lms.status == "ok":
            note = "no deficit roofline: the row records no deficit"
        return Goal(name, f, None, target, None, "not measured", note)
    if reference is None:
        return Goal(name, f, None, target, None, "not comparable", "no capped results")
    if reference.reason:
        return Goal(name, f, None, target, None, "not comparable", reference.reason)
    if not lms.limit_bytes or lms.deficit_bytes is None:
        return Goal(
            name, f, None, target, None, "not comparable", "the row records no device limit"
        )
    ratio = lms.deficit_bytes / lms.limit_bytes
    capped, how = interpolate_capped_efficiency(
        [(p.deficit_over_limit, p.efficiency) for p in reference.points], ratio
    )
    if capped is None:
        return Goal(name, f, None, target, None, "not comparable", how)
    e = lms.deficit_efficiency
    note = f"no cap {e:.1%} against {how}"
    if reference.device and device and reference.device != device:
        note += f"; the capped run was on {reference.device}"
    value = e / capped
    gap = f"{(e - capped) * 100:+.1f} points"
    return Goal(name, f, value, target, value >= NOCAP_VS_CAPPED_GOAL, gap, note)


def evaluate_nocap_goals(
    rows: Sequence[Measurement],
    factors: Sequence[float],
    reference: CappedReference | None,
    device: str = "",
) -> list[Goal]:
    """The no-cap goals per factor, from the ``lms`` row at its batch: ``nocap_efficiency``,
    ``nocap_out_vs_deficit`` and ``nocap_vs_capped`` (against ``reference``; ``device`` is
    this run's, named in the note where the capped run's differs)."""
    goals: list[Goal] = []
    for f in factors:
        lms = _find(rows, "lms", f)
        goals.append(
            _efficiency_goal(
                lms,
                f,
                "nocap_efficiency",
                NOCAP_EFFICIENCY_GOAL,
                NOCAP_EFFICIENCY_TARGET,
                ", or the estimated need overstates the deficit",
            )
        )
        goals.append(
            _out_vs_deficit_goal(
                lms,
                f,
                "nocap_out_vs_deficit",
                NOCAP_OUT_VS_DEFICIT_GOAL,
                NOCAP_OUT_VS_DEFICIT_TARGET,
            )
        )
        goals.append(_vs_capped_goal(lms, f, reference, device))
    return goals


def parse_kib_fields(text: str) -> dict[str, int]:
    """``/proc/self/status`` or ``/proc/meminfo`` lines ``Name:   123 kB`` as bytes by name
    (other lines skipped)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            values[name.strip()] = int(parts[0]) * 1024
    return values


def read_kib_fields(path: str) -> dict[str, int]:
    """parse_kib_fields of a file; empty where it cannot be read (not Linux)."""
    try:
        with open(path) as f:
            return parse_kib_fields(f.read())
    except OSError:
        return {}


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    return read_kib_fields("/proc/meminfo").get("MemAvailable")


def reset_rss_peak() -> bool:
    """Resets the process's peak resident memory (VmHWM) to its current value (Linux's
    /proc/self/clear_refs); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------
# Tables and files
# ---------------------------------------------------------------------------------------

MEASUREMENT_COLUMNS = (
    "model",
    "method",
    "factor",
    "cap_gib",
    "batch",
    "status",
    "iteration_ms",
    "samples_per_s",
    "out_gib_per_iter",
    "in_gib_per_iter",
    "stall_ms_per_iter",
    "deficit_gib",
    "out_vs_deficit",
    "lms_schedule",
    "peak_allocated_gib",
    "roofline_ms",
    "efficiency",
    "deficit_roofline_ms",
    "deficit_efficiency",
    "serial_roofline_ms",
    "serial_efficiency",
    "largest_batch",
    "largest_batch_note",
    "oom_retries",
    "detail",
)
# LMS's recompute per iteration (Measurement.drop_bytes_per_iter, recompute_bytes_per_iter,
# recompute_ms_per_iter): columns of every CSV written since lms_hybrid. Not part of
# MEASUREMENT_COLUMNS, which readers of the committed compare-MODEL.csv files require
# (summarize.py): files written before have none of them.
RECOMPUTE_COLUMNS = ("drop_gib_per_iter", "recompute_gib_per_iter", "recompute_ms_per_iter")
# The columns of compare-MODEL.csv as written: MEASUREMENT_COLUMNS with the recompute columns
# before the detail.
assert MEASUREMENT_COLUMNS[-1] == "detail"
CAPPED_CSV_COLUMNS = (*MEASUREMENT_COLUMNS[:-1], *RECOMPUTE_COLUMNS, "detail")
GOAL_COLUMNS = ("model", "goal", "factor", "value", "target", "met", "gap", "note")
# The no-cap CSV (nocap-MODEL.csv): the rows' batch, estimated need, device limit and deficit,
# the first step apart, host memory and the allocator's retries; no caps, no batch searches.
NOCAP_MEASUREMENT_COLUMNS = (
    "model",
    "method",
    "factor",
    "batch",
    "status",
    "need_gib",
    "limit_gib",
    "deficit_gib",
    "first_iteration_ms",
    "iteration_ms",
    "samples_per_s",
    "out_gib_per_iter",
    "in_gib_per_iter",
    "out_vs_deficit",
    "stall_ms_per_iter",
    *RECOMPUTE_COLUMNS,
    "lms_schedule",
    "peak_allocated_gib",
    "host_pinned_peak_gib",
    "host_rss_peak_gib",
    "alloc_retries",
    "alloc_retries_timed",
    "roofline_ms",
    "efficiency",
    "deficit_roofline_ms",
    "deficit_efficiency",
    "serial_roofline_ms",
    "serial_efficiency",
    "row_s",
    "detail",
)
# The no-cap CSVs have carried the provenance columns from their first run.
NOCAP_ENV_COLUMNS = RECORD_ENV_COLUMNS


def _num(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def measurement_record(m: Measurement) -> dict[str, str]:
    return {
        "model": m.model,
        "method": m.method,
        "factor": _num(m.factor, "g"),
        "cap_gib": _num(None if m.cap_bytes is None else m.cap_bytes / GiB, ".3f"),
        "batch": str(m.batch),
        "status": m.status,
        "iteration_ms": _num(None if m.iteration_s is None else m.iteration_s * 1000, ".2f"),
        "samples_per_s": _num(m.samples_per_s, ".3f"),
        "out_gib_per_iter": _num(
            None if m.out_bytes_per_iter is None else m.out_bytes_per_iter / GiB, ".3f"
        ),
        "in_gib_per_iter": _num(
            None if m.in_bytes_per_iter is None else m.in_bytes_per_iter / GiB, ".3f"
        ),
        "stall_ms_per_iter": _num(m.stall_ms_per_iter, ".2f"),
        "deficit_gib": _num(None if m.deficit_bytes is None else m.deficit_bytes / GiB, ".3f"),
        "out_vs_deficit": _num(
            None
            if not m.deficit_bytes or m.out_bytes_per_iter is None
            else m.out_bytes_per_iter / m.deficit_bytes,
            ".2f",
        ),
        "lms_schedule": m.lms_schedule,
        "peak_allocated_gib": _num(
            None if m.peak_allocated_bytes is None else m.peak_allocated_bytes / GiB, ".3f"
        ),
        "roofline_ms": _num(None if m.roofline_s is None else m.roofline_s * 1000, ".2f"),
        "efficiency": _num(m.efficiency, ".3f"),
        "deficit_roofline_ms": _num(
            None if m.deficit_roofline_s is None else m.deficit_roofline_s * 1000, ".2f"
        ),
        "deficit_efficiency": _num(m.deficit_efficiency, ".3f"),
        "serial_roofline_ms": _num(
            None if m.serial_roofline_s is None else m.serial_roofline_s * 1000, ".2f"
        ),
        "serial_efficiency": _num(m.serial_efficiency, ".3f"),
        "largest_batch": "" if m.largest_batch is None else str(m.largest_batch),
        "largest_batch_note": m.largest_batch_note,
        "oom_retries": str(m.oom_retries),
        "detail": m.detail.replace("\n", " ")[:300],
    }


def _gib(value: float | None) -> str:
    return _num(None if value is None else value / GiB, ".3f")


def _ms(value: float | None) -> str:
    return _num(None if value is None else value * 1000, ".2f")


def recompute_record(m: Measurement) -> dict[str, str]:
    """The recompute columns of ``m`` (RECOMPUTE_COLUMNS; empty where not recorded)."""
    return {
        "drop_gib_per_iter": _gib(m.drop_bytes_per_iter),
        "recompute_gib_per_iter": _gib(m.recompute_bytes_per_iter),
        "recompute_ms_per_iter": _num(m.recompute_ms_per_iter, ".2f"),
    }


def capped_measurement_record(m: Measurement) -> dict[str, str]:
    """The row of compare-MODEL.csv as written (CAPPED_CSV_COLUMNS)."""
    merged = {**measurement_record(m), **recompute_record(m)}
    return {k: merged[k] for k in CAPPED_CSV_COLUMNS}


def nocap_measurement_record(m: Measurement) -> dict[str, str]:
    """The row of nocap-MODEL.csv (NOCAP_MEASUREMENT_COLUMNS)."""
    base = {**measurement_record(m), **recompute_record(m)}
    extra = {
        "need_gib": _gib(m.need_bytes),
        "limit_gib": _gib(m.limit_bytes),
        "first_iteration_ms": _ms(m.first_iteration_s),
        "host_pinned_peak_gib": _gib(m.host_pinned_peak_bytes),
        "host_rss_peak_gib": _gib(m.host_rss_peak_bytes),
        "alloc_retries": "" if m.alloc_retries is None else str(m.alloc_retries),
        "alloc_retries_timed": "" if m.alloc_retries_timed is None else str(m.alloc_retries_timed),
        "row_s": _num(m.row_s, ".1f"),
    }
    merged = {**base, **extra}
    return {k: merged[k] for k in NOCAP_MEASUREMENT_COLUMNS}


def goal_record(model: str, g: Goal) -> dict[str, str]:
    return {
        "model": model,
        "goal": g.goal,
        "factor": _num(g.factor, "g"),
        "value": _num(g.value, ".4f"),
        "target": g.target,
        "met": "" if g.met is None else ("yes" if g.met else "no"),
        "gap": g.gap,
        "note": g.note.replace("\n", " "),
    }


def _fmt_factor(text: str) -> str:
    return f"{text}x" if text else "uncapped"


# The tables' column of LMS's recompute, beside the bytes moved: shown where a row recorded it.
RECOMPUTE_HEADER = "GiB dropped / recomputed, recompute ms per iter"


def recompute_cell(r: dict[str, str]) -> str:
    """A row's recompute per iteration for the tables (RECOMPUTE_HEADER): bytes dropped /
    bytes recomputed, and the replays' device time; empty where the row recorded none (rows
    without LMS, builds without recompute, records written before it)."""
    drop, again, ms = (r.get(k, "") for k in RECOMPUTE_COLUMNS)
    if not (drop or again or ms):
        return ""
    return f"{drop or '0'} / {again or '0'}, {ms or '0'} ms"


def _with_recompute(
    headers: Sequence[str], rows: Sequence[Sequence[str]], records: Sequence[dict[str, str]]
) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``headers`` and ``rows`` with the recompute column after the bytes moved, where any of
    ``records`` (the rows' records, in order) has a recompute figure; unchanged otherwise."""
    cells = [recompute_cell(r) for r in records]
    if not any(cells):
        return tuple(headers), [tuple(row) for row in rows]
    at = list(headers).index("GiB out/in per iter") + 1
    return (
        (*headers[:at], RECOMPUTE_HEADER, *headers[at:]),
        [(*row[:at], cell, *row[at:]) for row, cell in zip(rows, cells)],
    )


def measurements_markdown(records: Sequence[dict[str, str]]) -> str:
    headers = (
        "model",
        "method",
        "oversubscription",
        "cap GiB",
        "batch",
        "samples/s",
        "GiB out/in per iter",
        "deficit GiB",
        "stall ms/iter",
        "efficiency",
        "vs deficit: both ways / one at a time",
        "largest batch",
        "status",
    )
    rows = []
    for r in records:
        moved = ""
        if r["out_gib_per_iter"] or r["in_gib_per_iter"]:
            moved = f"{r['out_gib_per_iter'] or '0'} / {r['in_gib_per_iter'] or '0'}"
        eff = f"{float(r['efficiency']):.0%}" if r["efficiency"] else ""
        both, serial = r.get("deficit_efficiency", ""), r.get("serial_efficiency", "")
        vs_deficit = f"{float(both):.0%} / {float(serial):.0%}" if both and serial else ""
        largest = r["largest_batch"]
        if largest and r.get("largest_batch_note"):
            largest = f"{largest} ({r['largest_batch_note']})"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['detail'][:60]}"
        rows.append(
            (
                r["model"],
                r["method"],
                _fmt_factor(r["factor"]),
                r["cap_gib"],
                r["batch"],
                r["samples_per_s"],
                moved,
                r["deficit_gib"],
                r["stall_ms_per_iter"],
                eff,
                vs_deficit,
                largest,
                status,
            )
        )
    return markdown_table(*_with_recompute(headers, rows, records))


def nocap_measurements_markdown(records: Sequence[dict[str, str]]) -> str:
    """The rows of nocap-MODEL.csv as a table (the log's summary)."""
    headers = (
        "model",
        "method",
        "need / limit",
        "batch",
        "need GiB (est.)",
        "limit GiB",
        "deficit GiB",
        "first step ms",
        "ms/iter",
        "samples/s",
        "GiB out/in per iter",
        "stall ms/iter",
        "vs deficit: both ways / one at a time",
        "host pinned GiB",
        "retries",
        "status",
    )
    rows = []
    for r in records:
        moved = ""
        if r["out_gib_per_iter"] or r["in_gib_per_iter"]:
            moved = f"{r['out_gib_per_iter'] or '0'} / {r['in_gib_per_iter'] or '0'}"
        both, serial = r["deficit_efficiency"], r["serial_efficiency"]
        vs_deficit = f"{float(both):.0%} / {float(serial):.0%}" if both and serial else ""
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['detail'][:60]}"
        rows.append(
            (
                r["model"],
                r["method"],
                f"{r['factor']}x" if r["factor"] else "fits",
                r["batch"],
                r["need_gib"],
                r["limit_gib"],
                r["deficit_gib"],
                r["first_iteration_ms"],
                r["iteration_ms"],
                r["samples_per_s"],
                moved,
                r["stall_ms_per_iter"],
                vs_deficit,
                r["host_pinned_peak_gib"],
                r["alloc_retries"],
                status,
            )
        )
    return markdown_table(*_with_recompute(headers, rows, records))


def goals_markdown(records: Sequence[dict[str, str]]) -> str:
    headers = ("model", "goal", "oversubscription", "value", "target", "met", "gap", "note")
    rows = []
    for r in records:
        value = r["value"]
        if value and r["goal"] in ("lms_efficiency", "nocap_efficiency"):
            value = f"{float(value):.1%}"
        elif value and r["goal"] == "overhead_when_fitting":
            value = f"{float(value):+.2%}"
        elif value:
            value = f"{float(value):.2f}x"
        met = {"yes": "yes", "no": "no", "": "not measured"}[r["met"]]
        factor = _fmt_factor(r["factor"]) if r["factor"] else "-"
        rows.append((r["model"], r["goal"], factor, value, r["target"], met, r["gap"], r["note"]))
    return markdown_table(headers, rows)


CAPPED_XLABEL = "oversubscription (uncapped peak / cap)"
NOCAP_XLABEL = "no cap: estimated need / device limit"


def plot_results(
    rows: Sequence[Measurement],
    bw: Bandwidth | None,
    png: Path,
    title: str,
    xlabel: str = CAPPED_XLABEL,
) -> Path | None:
    """Throughput, and efficiency against the deficit roofline (what the efficiency goal
    measures, drawn as a line), per method and oversubscription factor; None without
    matplotlib or without measured rows. Rows without a deficit (``no_lms``, at its own
    batch) have no bar on the efficiency chart."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factors = sorted({m.factor for m in rows if m.factor is not None})
    methods = [k for k in CAPPED_METHODS if any(m.method == k for m in rows)]
    if not factors or not methods:
        return None
    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        xs, tps, effs = [], [], []
        for i, f in enumerate(factors):
            m = _find(rows, method, f)
            xs.append(i + (j - (len(methods) - 1) / 2) * width)
            ok = m is not None and m.status == "ok"
            tps.append(m.samples_per_s if ok and m and m.samples_per_s else 0.0)
            effs.append(m.deficit_efficiency if ok and m and m.deficit_efficiency else 0.0)
        ax_tp.bar(xs, tps, width, label=method)
        if any(m.method == method and m.deficit_bytes is not None for m in rows):
            ax_eff.bar(xs, effs, width, label=method)
    base = _find(rows, "baseline", None)
    if base is not None and base.samples_per_s:
        ax_tp.axhline(
            base.samples_per_s,
            color="black",
            linestyle="--",
            label=f"uncapped (batch {base.batch})",
        )
    ax_eff.axhline(EFFICIENCY_GOAL, color="red", linestyle=":", label=f"goal: {EFFICIENCY_TARGET}")
    for ax in (ax_tp, ax_eff):
        ax.set_xticks(range(len(factors)), [f"{f:g}x" for f in factors])
        ax.set_xlabel(xlabel)
    ax_tp.set_ylabel("samples/s (0: did not train)")
    ax_eff.set_ylabel("deficit roofline time / measured time (0: did not train)")
    ax_tp.set_title("throughput")
    sub = ""
    if bw is not None:
        sub = (
            f" (D2H {bw.d2h / 1e9:.1f}, H2D {bw.h2d / 1e9:.1f}, "
            f"both {bw.bidirectional / 1e9:.1f} GB/s)"
        )
    ax_eff.set_title(
        "efficiency against the roofline of the deficit out and in" + sub, fontsize="small"
    )
    ax_tp.legend(fontsize="small")
    ax_eff.legend(fontsize="small")
    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    tmp = png.with_name(f".{png.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, png)
    plt.close(fig)
    return png


# ---------------------------------------------------------------------------------------
# Goals of recorded runs (no torch)
# ---------------------------------------------------------------------------------------


def goals_help() -> str:
    """The goals with their targets, in words (``--help``'s epilog)."""
    parity = ", ".join(f"{p:g}x" for p in CHECKPOINT_PARITY_FACTORS)
    return (
        "Goals (compare-MODEL-goals.csv: one row per goal and factor; met yes, no, or empty "
        "where not measured): "
        f"lms_efficiency: LMS at {EFFICIENCY_TARGET} of the roofline max(uncapped time, the "
        "deficit out and in at the measured bandwidths) at every factor; "
        f"lms_out_vs_deficit: bytes LMS pages out per iteration {OUT_VS_DEFICIT_TARGET} the "
        "deficit; "
        "lms_faster_than_offload (where measured) and lms_faster_than_save_on_cpu: LMS "
        f"samples/s {FASTER_THAN_TARGET} theirs at every cap (met where the rival runs out of "
        "memory); "
        f"lms_vs_checkpoint: at {parity}, LMS samples/s {CHECKPOINT_RATIO_TARGET} "
        "checkpointing's; "
        "lms_trains_where_checkpoint_cannot: LMS trains at every cap where checkpointing runs "
        "out of memory (no goal against checkpointing where it trains at other caps); "
        f"largest_batch_ratio: largest batch with LMS {BATCH_RATIO_TARGET} the largest "
        "without; "
        f"overhead_when_fitting: LMS on with everything fitting {OVERHEAD_TARGET} slower "
        "than off. "
        "No-cap goals (--regime nocap, nocap-MODEL-goals.csv, per factor): "
        f"nocap_efficiency: LMS at {NOCAP_EFFICIENCY_TARGET} of the roofline max(compute "
        "extrapolated to the batch, the estimated deficit out and in); "
        f"nocap_out_vs_deficit: bytes LMS pages out per iteration {NOCAP_OUT_VS_DEFICIT_TARGET} "
        "the estimated deficit; "
        f"nocap_vs_capped: that efficiency {NOCAP_VS_CAPPED_TARGET}'s efficiency at the same "
        "deficit over limit (the committed capped results, interpolated between their factors; "
        "'not comparable', with the reason, where they do not cover it)."
    )


def measurement_from_record(record: dict[str, Any]) -> Measurement:
    """The Measurement of one record of a run's JSON (``asdict``): keys it does not know are
    ignored, ``profile`` stays a dict."""
    known = {f.name for f in fields(Measurement)}
    try:
        return Measurement(**{k: v for k, v in record.items() if k in known})
    except TypeError as exc:
        raise ValueError(f"measurement {record.get('method', '?')!r}: {exc}") from None


@dataclass
class RunRecord:
    """A run's JSON (compare-MODEL.json or nocap-MODEL.json), read back."""

    data: dict[str, Any]
    config: dict[str, Any]
    env: dict[str, Any]
    bw: Bandwidth
    rows: list[Measurement]

    @property
    def regime(self) -> str:
        return str(self.data.get("regime") or self.config.get("regime") or "capped")

    @property
    def model(self) -> str:
        return str(self.config.get("model") or (self.rows[0].model if self.rows else ""))

    @property
    def factors(self) -> list[float]:
        factors = self.config.get("factors") or sorted(
            {m.factor for m in self.rows if m.factor is not None}
        )
        return [float(f) for f in factors]


def load_run(path: Path) -> RunRecord:
    """Reads a run's JSON; raises ValueError for a file that is not such a record (OSError
    where it cannot be read)."""
    try:
        data = json.loads(path.read_text())
        config: dict[str, Any] = data["config"]
        env: dict[str, Any] = data["environment"]
        bw = Bandwidth(**data["bandwidth_bytes_per_s"])
        rows = [measurement_from_record(r) for r in data["measurements"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a compare.py run record ({exc!r})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return RunRecord(data, config, env, bw, rows)


def capped_reference(
    path: Path, workload: str, amp: bool, optimizer: str | None
) -> CappedReference:
    """LMS's deficit efficiencies in the capped run recorded in ``path`` (compare-MODEL.json),
    recomputed as --rescore does, for a no-cap run of ``workload`` (with ``amp`` and
    ``optimizer``); not comparable, with the reason, where the file is missing or unreadable
    or trained another workload or precision."""
    source = str(path)
    if not path.is_file():
        return CappedReference(source, reason=f"no capped results at {path}")
    try:
        run = load_run(path)
    except (OSError, ValueError) as exc:
        return CappedReference(source, reason=f"capped results unreadable: {exc}"[:300])
    device = str(run.env.get("device", ""))
    theirs = str(run.data.get("workload", ""))
    mismatch = []
    if theirs != workload:
        mismatch.append(f"the capped run trained {theirs!r}, this run {workload!r}")
    if bool(run.config.get("amp")) != amp:
        mismatch.append(
            f"the capped run {'used' if run.config.get('amp') else 'did not use'} --amp, "
            f"this run {'does' if amp else 'does not'}"
        )
    if run.config.get("optimizer") != optimizer:
        mismatch.append(
            f"optimizer {run.config.get('optimizer') or 'default'} in the capped run, "
            f"{optimizer or 'default'} here"
        )
    if mismatch:
        return CappedReference(source, device, theirs, reason="; ".join(mismatch))
    if run.regime != "capped":
        return CappedReference(source, device, theirs, reason=f"{path} is a {run.regime} run")
    base = _find(run.rows, "baseline", None)
    if base is None or base.status != "ok" or not base.iteration_s:
        return CappedReference(source, device, theirs, reason="the capped run has no baseline")
    fill_roofline(run.rows, base.iteration_s / base.batch, run.bw)
    points = tuple(
        CappedPoint(float(m.factor), m.deficit_bytes / m.cap_bytes, m.deficit_efficiency)
        for m in run.rows
        if m.method == "lms"
        and m.factor is not None
        and m.status == "ok"
        and m.deficit_bytes
        and m.cap_bytes
        and m.deficit_efficiency is not None
    )
    reason = "" if points else "no capped LMS row trained"
    return CappedReference(source, device, theirs, points, reason)


def rescore(path: Path, capped_results: Path | None = None) -> tuple[Path, str, list[Goal]]:
    """Recomputes the goals of the run recorded in ``path`` (a compare-MODEL.json or a
    nocap-MODEL.json) and rewrites its goals CSV (STEM-goals.csv) beside it, and the chart
    (STEM.png) where matplotlib is installed; returns (that CSV, the model, the goals).

    The rooflines are recomputed as the run computed them, from its bandwidths and its
    baseline's time per sample (no cap: the fitting run with the largest batch); without a
    measured baseline the run wrote no goals, and neither does this. The goals are evaluated
    at its factors; a no-cap run is compared with the capped reference it recorded, or with
    the capped compare-MODEL.json in ``capped_results`` where that is given. The CSV gets the
    run's environment columns. Raises ValueError for a file that is not such a record.
    """
    run = load_run(path)
    model, rows, bw, env = run.model, run.rows, run.bw, run.env
    goals: list[Goal] = []
    title = f"{run.data.get('workload', model)}, batch {run.data.get('batch', '?')}"
    if run.regime == "nocap":
        env_columns, xlabel = NOCAP_ENV_COLUMNS, NOCAP_XLABEL
        title = f"{title}, no cap"
        compute = nocap_compute_s_per_sample(rows)
        if compute is not None:
            fill_roofline(rows, compute[0], bw)
            if capped_results is not None:
                reference: CappedReference | None = capped_reference(
                    capped_results / f"compare-{model}.json",
                    str(run.data.get("workload", "")),
                    bool(run.config.get("amp")),
                    run.config.get("optimizer"),
                )
            else:
                reference = CappedReference.from_record(run.data.get("capped_reference"))
            goals = evaluate_nocap_goals(rows, run.factors, reference, str(env.get("device", "")))
    else:
        env_columns, xlabel = csv_env_columns(env), CAPPED_XLABEL
        base = _find(rows, "baseline", None)
        if base is not None and base.status == "ok" and base.iteration_s:
            fill_roofline(rows, base.iteration_s / base.batch, bw)
            goals = evaluate_goals(rows, run.factors)
    out = path.with_name(f"{path.stem}-goals.csv")
    write_csv(out, GOAL_COLUMNS, [goal_record(model, g) for g in goals], env, env_columns)
    if goals:
        # The chart draws the efficiency goal: redrawn with it, titled as the run titled it.
        plot_results(
            rows, bw, path.with_suffix(".png"), f"{title} — {env.get('device', '')}", xlabel
        )
    return out, model, goals


def run_rescore(args: argparse.Namespace) -> int:
    """``--rescore``: rescores a compare-MODEL.json or nocap-MODEL.json, or every one in a
    folder (with ``--model``, only that model's), and prints the goals."""
    target: Path = args.rescore
    if target.is_dir():
        paths = sorted([*target.glob("compare-*.json"), *target.glob("nocap-*.json")])
    else:
        paths = [target]
    if args.model is not None:
        names = (f"compare-{args.model}.json", f"nocap-{args.model}.json")
        paths = [p for p in paths if p.name in names]
    if not paths:
        which = (
            f"compare-{args.model}.json or nocap-{args.model}.json"
            if args.model
            else "compare-*.json or nocap-*.json"
        )
        print(f"compare.py: --rescore: no {which} in {target}", file=sys.stderr)
        return 2
    for path in paths:
        try:
            out, model, goals = rescore(path, args.capped_results)
        except (OSError, ValueError) as exc:
            print(f"compare.py: --rescore: {exc}", file=sys.stderr)
            return 2
        print(f"== {model}: wrote {out}")
        if goals:
            print(goals_markdown([goal_record(model, g) for g in goals]) + "\n")
    return 0


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def parse_factors(text: str) -> list[float]:
    try:
        factors = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"factors must be numbers, got {text!r}") from None
    if not factors or any(not math.isfinite(f) or f <= 1.0 for f in factors):
        raise argparse.ArgumentTypeError(f"factors must be > 1, got {text!r}")
    return sorted(set(factors))


def parse_methods(text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in PEER_METHODS]
    if not methods or unknown:
        raise argparse.ArgumentTypeError(
            f"methods must be some of {', '.join(PEER_METHODS)}, got {text!r}"
        )
    return methods


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None: those options say in their help what the
    default depends on (the regime, the model)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _regime_default(option: str) -> str:
    capped, nocap = REGIME_DEFAULTS["capped"][option], REGIME_DEFAULTS["nocap"][option]

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, (list, tuple)):
            return ",".join(format(v, "g") if isinstance(v, float) else str(v) for v in value)
        return str(value)

    return f"(default: capped {text(capped)}, nocap {text(nocap)})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compare.py",
        description="Compare Large Model Support with stream-overlapped offloading, save_on_cpu, "
        "activation checkpointing and no LMS, against a bandwidth roofline: under GPU memory "
        "caps (--regime capped), or with no cap at batches whose memory need is a factor of "
        "the device's (--regime nocap).",
        epilog=goals_help(),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--model", choices=MODELS, default=None, help="model group (required unless --rescore)"
    )
    parser.add_argument(
        "--regime",
        choices=REGIMES,
        default="capped",
        help="capped: cap = uncapped peak / factor (set_per_process_memory_fraction), every "
        "method at the baseline batch; nocap: no memory fraction set anywhere, each factor "
        "trains at the batch whose estimated need is factor x the memory free at the start "
        "(linear memory model of the uncapped baseline), writes nocap-MODEL.* and compares "
        "with the capped results (--capped-results); no batch search, no overhead rows",
    )
    add_out_option(parser, Path("out/benchmarks"))
    parser.add_argument(
        "--factors",
        type=parse_factors,
        default=None,
        help="oversubscription factors: capped, cap = uncapped peak / factor; nocap, need = "
        "factor x device limit " + _regime_default("factors"),
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="batch B of the uncapped and capped runs, or the first fitting batch of nocap "
        "(default: per model: resnet152 8, vit_l 32, gpt 8)",
    )
    parser.add_argument(
        "--image-size",
        type=positive_int,
        default=None,
        help="image size (default: resnet152 512, vit_l 224)",
    )
    parser.add_argument(
        "--classes", type=positive_int, default=1000, help="classes of the image models"
    )
    parser.add_argument(
        "--vit-layers", type=positive_int, default=24, help="ViT-L encoder layers (24: full depth)"
    )
    add_gpt_options(parser, layers=24, dim=1024, heads=16, seq=1024, vocab=32768)
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default=None,
        help="optimizer (default: sgd for resnet152, adamw for vit_l and gpt)",
    )
    add_amp_option(parser)
    add_step_options(
        parser,
        warmup=None,
        iterations=None,
        warmup_help="untimed iterations per measurement (LMS's learned schedule takes a few "
        "iterations to recognize the loop: fewer warm-up iterations time the learning; "
        "nocap: LMS's first iteration pins its host memory and the schedule is adopted in the "
        "third, so 4 leave the timed ones steady) " + _regime_default("warmup"),
        iterations_help="timed iterations per measurement (nocap: fewer, at its large "
        "batches, to keep a model within one 10-minute call) " + _regime_default("iterations"),
    )
    add_limit_share_option(parser, default=None)
    add_lms_tuning_options(parser)
    parser.add_argument(
        "--methods",
        type=parse_methods,
        default=None,
        help="methods measured under each cap or at each nocap batch (comma-separated; split "
        f"a run across calls with it): {', '.join(PEER_METHODS)}. lms_hybrid is lms with "
        "recompute on (torch.cuda.set_recompute_lms(True)): a victim is dropped and recomputed "
        "instead of paged out where replaying its operator is cheaper than copying it out and "
        "back; lms keeps LMS's own recompute default (its rows say whether it was on), "
        "lms_paging and the other LMS rows run with recompute off. An LMS without "
        "set_recompute_lms ends the run with an error where lms_hybrid is named here, and "
        "leaves it out of the default methods. lms_nopack is lms with packing off "
        "(torch.cuda.set_packing_lms(False)), for what packing tight operators costs or saves. "
        "lms_residual is lms with residual recipes on "
        "(torch.cuda.set_residual_recipes_lms(True)); every other LMS row has them off. "
        "compile_budget trains torch.compile(model) with LMS off under "
        "torch._functorch.config.activation_memory_budget = (0.85 x cap (or device) - static "
        "memory) / activation memory, clamped to [0, 1] (PyTorch's compile-time recompute; a "
        "'not run: REASON' row where this torch cannot or the model does not compile). "
        "lms_nopack, lms_residual, lms_paging and compile_budget are in no default "
        + _regime_default("methods"),
    )
    parser.add_argument(
        "--overhead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure LMS on with everything fitting, and LMS off again (lms_fits, "
        "baseline_repeat); calls that split a run measure it once (capped only) "
        + _regime_default("overhead"),
    )
    parser.add_argument(
        "--linearity-check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="nocap: measure a second fitting batch (the largest the first puts at "
        f"{FIT_FILL * 100:.0f}%% of the device, at most {FIT_MAX_MULTIPLE}x the first; else "
        "half of it) and derive the batches from the line through both peaks instead of from the "
        "first batch and its static memory " + _regime_default("linearity_check"),
    )
    parser.add_argument(
        "--row-order",
        choices=("methods", "factors"),
        default=None,
        help="nocap: measure method by method, each at every factor (methods: where the time "
        "runs out, the last methods are skipped), or factor by factor, each factor's methods "
        "in --methods order (factors: the last factors are skipped); capped runs factor by "
        "factor (default: methods)",
    )
    parser.add_argument(
        "--prior-slowdown",
        type=positive_float,
        default=None,
        help="nocap: a row is started only where its time estimate times this (until rows "
        "of the run measure how far off the estimates are) fits in what is left of "
        f"--time-budget-s (default: {NOCAP_PRIOR_SLOWDOWN:g}; a caller that plans the rows "
        "to its own estimates lowers it)",
    )
    parser.add_argument(
        "--capped-results",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="nocap: the folder whose compare-MODEL.json the nocap_vs_capped goal compares "
        "with (default: the committed capped results, DEFAULT_CAPPED_RESULTS); with "
        "--rescore, compare again with this folder instead of the reference the run recorded",
    )
    parser.add_argument(
        "--oom-retries",
        type=nonneg_int,
        default=0,
        help="retries of a step that ran out of memory with LMS on (the drop-in "
        "extension cannot retry inside an operator; counted in the results)",
    )
    parser.add_argument(
        "--profile-iterations",
        type=nonneg_int,
        default=0,
        help="after the timed iterations of each row of "
        + ", ".join(PROFILED_METHODS)
        + ", run this many more under torch.profiler and report where the time goes: "
        "compute stream busy and idle, copy time and rate each way, host time in CUDA "
        "runtime calls (stream_profile.py; in the JSON as each row's 'profile')",
    )
    parser.add_argument(
        "--bandwidth-mib",
        type=positive_int,
        default=1024,
        help="size of each copy of the bandwidth measurement",
    )
    parser.add_argument(
        "--search",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="search the largest trainable batches (capped only) " + _regime_default("search"),
    )
    parser.add_argument(
        "--search-budget-s",
        type=positive_float,
        default=240.0,
        help="time for all batch searches together",
    )
    parser.add_argument(
        "--search-tolerance",
        type=float,
        default=0.1,
        help="relative precision of the LMS batch search (0: exact)",
    )
    parser.add_argument(
        "--probe-iterations",
        type=positive_int,
        default=2,
        help="training iterations per search probe",
    )
    parser.add_argument(
        "--probe-timeout-s",
        type=positive_float,
        default=90.0,
        help="a probe running longer counts as not trainable",
    )
    parser.add_argument(
        "--host-budget-gib",
        type=positive_float,
        default=96.0,
        help="pinned host memory LMS may use: bounds the LMS batch search; nocap: a row "
        "estimated to pin more than this (or more than the host's available memory less "
        f"{HOST_MARGIN_BYTES // GiB} GiB) is skipped: LMS about its deficit, offload and "
        "save_on_cpu every activation",
    )
    add_time_budget_option(
        parser,
        500.0,
        "measurements",
        "nocap starts a row only where its estimated time (the baseline's time per sample x "
        "its batch, the copies, the rows so far) fits in what is left",
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        default=None,
        metavar="PATH",
        help="no GPU, no measurement: recompute the goals of the runs recorded in PATH (a "
        "compare-MODEL.json or nocap-MODEL.json, or a folder of them; with --model only that "
        "model's) with this version's goals, rewrite each one's STEM-goals.csv and STEM.png "
        "(with matplotlib) beside it and print them",
    )
    # Internal: one search probe, run by the search in a subprocess.
    parser.add_argument("--probe-batch", type=positive_int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--probe-cap-bytes", type=positive_int, default=None, help=argparse.SUPPRESS
    )
    parser.add_argument("--probe-lms", action="store_true", help=argparse.SUPPRESS)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Checks across arguments and fills the defaults of --regime (REGIME_DEFAULTS) where an
    option was not given; raises ValueError with the problem."""
    if args.model is None and args.rescore is None:
        raise ValueError("--model is required (except with --rescore)")
    if args.regime == "nocap" and args.rescore is None:
        if args.lms_limit_frac is not None:
            raise ValueError(
                "--lms-limit-frac sets the LMS limit as a share of the memory cap, and "
                "--regime nocap sets no cap: LMS runs with its default limit there (the "
                "device's memory less its headroom), as a user would run it"
            )
        if args.search:
            raise ValueError(
                "--search belongs to --regime capped: nocap derives its batches from the "
                "device's memory and searches none"
            )
        if args.overhead:
            raise ValueError(
                "--overhead belongs to --regime capped: measure LMS's overhead when "
                "everything fits there"
            )
        if args.probe_batch is not None:
            raise ValueError("the batch search probes belong to --regime capped")
    if args.regime == "capped" and args.rescore is None:
        if args.linearity_check:
            raise ValueError("--linearity-check belongs to --regime nocap")
        if args.capped_results is not None:
            raise ValueError("--capped-results is what --regime nocap (or --rescore) compares with")
        for option in ("row_order", "prior_slowdown"):
            if getattr(args, option) is not None:
                raise ValueError(
                    f"--{option.replace('_', '-')} belongs to --regime nocap: capped runs "
                    "factor by factor and starts a row where 3 x the longest so far fits"
                )
    for option, value in REGIME_DEFAULTS[args.regime].items():
        if getattr(args, option) is None:
            setattr(args, option, list(value) if isinstance(value, list) else value)
    if not 0 <= args.search_tolerance < 1:
        raise ValueError(f"--search-tolerance must be in [0, 1), got {args.search_tolerance}")
    if args.model == "vit_l" and args.image_size is not None and args.image_size % 16:
        raise ValueError(f"ViT-L/16 needs --image-size divisible by 16, got {args.image_size}")
    if args.model == "gpt" and args.gpt_dim % args.gpt_heads:
        raise ValueError(
            f"--gpt-dim ({args.gpt_dim}) must be a multiple of --gpt-heads ({args.gpt_heads})"
        )
    if (args.probe_batch is None) != (args.probe_cap_bytes is None):
        raise ValueError("--probe-batch and --probe-cap-bytes go together")


def model_argv(args: argparse.Namespace) -> list[str]:
    """The arguments that rebuild the same workload and LMS settings in a probe."""
    argv = [
        "--model",
        args.model,
        "--classes",
        str(args.classes),
        "--vit-layers",
        str(args.vit_layers),
        "--gpt-layers",
        str(args.gpt_layers),
        "--gpt-dim",
        str(args.gpt_dim),
        "--gpt-heads",
        str(args.gpt_heads),
        "--gpt-seq",
        str(args.gpt_seq),
        "--gpt-vocab",
        str(args.gpt_vocab),
        "--prefetch",
        str(args.prefetch),
        "--speculative-mb",
        str(args.speculative_mb),
        "--oom-retries",
        str(args.oom_retries),
        "--probe-iterations",
        str(args.probe_iterations),
    ]
    if args.lms_limit_frac is not None:
        argv += ["--lms-limit-frac", str(args.lms_limit_frac)]
    if args.image_size is not None:
        argv += ["--image-size", str(args.image_size)]
    if args.optimizer is not None:
        argv += ["--optimizer", args.optimizer]
    if args.size_mb is not None:
        argv += ["--size-mb", str(args.size_mb)]
    if args.amp:
        argv.append("--amp")
    return argv


def make_workload(args: argparse.Namespace) -> Any:
    from benchmarks import models

    if args.model == "resnet152":
        return models.resnet152_workload(args.image_size or 512, args.classes)
    if args.model == "vit_l":
        return models.vit_l_workload(args.image_size or 224, args.vit_layers, args.classes)
    cfg = models.GPTConfig(
        vocab=args.gpt_vocab,
        seq=args.gpt_seq,
        dim=args.gpt_dim,
        layers=args.gpt_layers,
        heads=args.gpt_heads,
    )
    return models.gpt_workload(cfg)


def lms_settings(
    args: argparse.Namespace,
    cap: int | None,
    schedule: bool = True,
    packing: bool = True,
    residual_recipes: bool = False,
) -> LmsSettings:
    limit = None
    if cap is not None and args.lms_limit_frac is not None:
        limit = max(1, int(cap * args.lms_limit_frac / MiB))
    return LmsSettings(
        enabled=True,
        limit_mb=limit,
        size_mb=args.size_mb,
        prefetch=args.prefetch,
        speculative_mb=args.speculative_mb,
        schedule=schedule,
        packing=packing,
        residual_recipes=residual_recipes,
    )


def method_lms_settings(
    args: argparse.Namespace, method: str, cap: int | None
) -> LmsSettings | None:
    """The LMS settings of a row of ``method`` under ``cap`` (None: uncapped), or None where
    the method trains without LMS. Every LMS method has lms's settings, the learned schedule
    off for REACTIVE_METHODS, packing off for NOPACK_METHODS, residual recipes on for
    RESIDUAL_METHODS; recompute is set apart (set_recompute, in train_measure)."""
    if method not in LMS_METHODS:
        return None
    return lms_settings(
        args,
        cap,
        schedule=method not in REACTIVE_METHODS,
        packing=method not in NOPACK_METHODS,
        residual_recipes=method in RESIDUAL_METHODS,
    )


class RecomputeUnavailable(RuntimeError):
    """lms_hybrid was asked for and this LMS build cannot recompute (no set_recompute_lms)."""


def recompute_unavailable_reason(cuda: Any) -> str:
    """Why ``cuda`` (``torch.cuda``, after ensure_lms_api: the extension adds its functions on
    import) cannot run lms_hybrid, or "" where it can."""
    if callable(getattr(cuda, "set_recompute_lms", None)):
        return ""
    return (
        "lms_hybrid needs torch.cuda.set_recompute_lms (LMS's recompute instead of paging), "
        "which this PyTorch and its LMS (torch_lms extension or patched build) do not have: "
        "build them from a checkout that has it, or leave lms_hybrid out of --methods"
    )


def set_recompute(cuda: Any, enabled: bool) -> Callable[[], None]:
    """Turns LMS's recompute (``cuda.set_recompute_lms``) on or off for a row and returns what
    puts back the setting in force before (``get_recompute_lms`` where the build has it,
    else off: its default). A build without recompute: off is what it does anyway (nothing is
    set, nothing to put back); on raises RecomputeUnavailable with the reason."""
    setter = getattr(cuda, "set_recompute_lms", None)
    if not callable(setter):
        if enabled:
            raise RecomputeUnavailable(recompute_unavailable_reason(cuda))
        return lambda: None
    getter = getattr(cuda, "get_recompute_lms", None)
    previous = bool(getter()) if callable(getter) else False
    setter(enabled)
    return lambda: setter(previous)


def recompute_state(cuda: Any) -> bool | None:
    """Whether LMS's recompute is on now in ``cuda`` (``torch.cuda``): False for a build that
    cannot recompute, None where it can and has no getter."""
    if not callable(getattr(cuda, "set_recompute_lms", None)):
        return False
    getter = getattr(cuda, "get_recompute_lms", None)
    return bool(getter()) if callable(getter) else None


def compile_budget_unavailable(torch_module: Any) -> str:
    """Why ``torch_module`` cannot run a compile_budget row (no ``torch.compile``, or no
    ``torch._functorch.config.activation_memory_budget``), or "" where it can."""
    if not callable(getattr(torch_module, "compile", None)):
        return "this torch has no torch.compile"
    try:
        import torch._functorch.config as functorch_config
    except Exception as exc:  # a torch without functorch's config: the row says why
        return f"torch._functorch.config does not import ({type(exc).__name__}: {exc})"
    if not hasattr(functorch_config, "activation_memory_budget"):
        return "torch._functorch.config has no activation_memory_budget (torch 2.4 or later has it)"
    return ""


def compile_with_budget(model: Any, budget: float) -> tuple[Any, Callable[[], None]]:
    """``torch.compile(model)`` with AOTAutograd's ``activation_memory_budget`` set to
    ``budget`` (compiling happens at the first call, under that setting), and what puts the
    setting back and drops the compiled graphs (rows share a process)."""
    import torch
    import torch._functorch.config as functorch_config

    previous = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = budget

    def restore() -> None:
        functorch_config.activation_memory_budget = previous
        torch._dynamo.reset()

    return torch.compile(model), restore


def check_recompute(
    args: argparse.Namespace,
    backend: str,
    cuda: Any,
    methods_given: bool,
    log: Callable[[str], None] = print,
) -> str:
    """Where ``args.methods`` has lms_hybrid (RECOMPUTE_METHODS), LMS is there (``backend``)
    and ``cuda`` cannot recompute: the error to end the run with where the methods were given
    (``--methods``); where they are the regime's default, the recompute methods are left out
    of ``args.methods`` with a note (``log``) instead. "" otherwise (without LMS the LMS rows
    are skipped with that reason)."""
    asked = [m for m in args.methods if m in RECOMPUTE_METHODS]
    reason = recompute_unavailable_reason(cuda) if asked and backend else ""
    if not reason:
        return ""
    if methods_given:
        return reason
    args.methods = tuple(m for m in args.methods if m not in RECOMPUTE_METHODS)
    log(f"== {', '.join(asked)} left out of the default methods: {reason}")
    return ""


def record_recompute(
    m: Measurement, before: dict[str, Any], after: dict[str, Any], iterations: int
) -> None:
    """Fills ``m``'s recompute figures from LMS statistics ``before`` and ``after`` its timed
    ``iterations``, as the page-out figures are: drops and recomputes (count, bytes) and the
    replays' milliseconds per iteration, the peak of the ``dropped_bytes`` gauge (reset
    with the other peaks when the row's LMS was applied) and the recipe inputs paged in ahead
    (bytes) per iteration. Statistics without ``drop_bytes`` (a build without recompute)
    leave them None."""
    if "drop_bytes" not in after:
        return

    def per_iteration(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / iterations

    m.drop_count_per_iter = per_iteration("drop_count")
    m.drop_bytes_per_iter = per_iteration("drop_bytes")
    m.recompute_count_per_iter = per_iteration("recompute_count")
    m.recompute_bytes_per_iter = per_iteration("recompute_bytes")
    m.recompute_ms_per_iter = per_iteration("recompute_ms")
    if "recompute_input_prefetch_bytes" in after:
        m.recompute_input_prefetch_bytes_per_iter = per_iteration("recompute_input_prefetch_bytes")
    gauge = after.get("dropped_bytes")
    if isinstance(gauge, dict) and "peak" in gauge:
        m.dropped_peak_bytes = int(gauge["peak"])


def operator_counts_between(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """Per operator, the counts of ``torch.cuda.lms_recompute_operators`` that grew from
    ``before`` to ``after`` (the timed iterations'); operators whose counts did not grow are
    left out."""
    grown: dict[str, dict[str, int]] = {}
    for name, counts in after.items():
        was = before.get(name, {})
        delta = {key: value - was.get(key, 0) for key, value in counts.items()}
        if any(delta.values()):
            grown[name] = delta
    return grown


# ---------------------------------------------------------------------------------------
# GPU work
# ---------------------------------------------------------------------------------------


def measure_bandwidth(nbytes: int, repeats: int = 5) -> Bandwidth:
    """Best-of-``repeats`` pinned D2H, H2D and simultaneous (two streams) copy bandwidth."""
    import torch

    n = nbytes // 4
    host = [torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(n, dtype=torch.float32, device="cuda") for _ in range(2)]
    for t in (*host, *dev):
        t.fill_(1.0)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def timed(run: Callable[[], None]) -> float:
        best = math.inf
        run()  # warm-up
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def d2h() -> None:
        with torch.cuda.stream(streams[0]):
            host[0].copy_(dev[0], non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(streams[0]):
            dev[0].copy_(host[0], non_blocking=True)

    def both() -> None:
        with torch.cuda.stream(streams[0]):
            host[0].copy_(dev[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            dev[1].copy_(host[1], non_blocking=True)

    size = n * 4
    result = Bandwidth(
        d2h=size / timed(d2h), h2d=size / timed(h2d), bidirectional=2 * size / timed(both)
    )
    host.clear()
    dev.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return result


def allocator_flushes(before: dict[str, Any], after: dict[str, Any], iterations: int) -> str:
    """The caching allocator's retries (its cache returned to the device after a failed
    allocation, a device synchronization) and out-of-memory errors per iteration, in words."""
    retries = (after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)) / iterations
    ooms = (after.get("num_ooms", 0) - before.get("num_ooms", 0)) / iterations
    return f", allocator {retries:g} retries and {ooms:g} OOMs/iter"


def train_measure(
    args: argparse.Namespace,
    workload: Any,
    m: Measurement,
    *,
    warmup: int,
    iterations: int,
    lms: LmsSettings | None,
    log: Callable[[str], None] = print,
) -> Measurement:
    """Trains ``workload`` fresh under ``m``'s cap and method; fills ``m`` (never raises for
    out-of-memory or other training errors: they become the row's status).

    With ``lms``, LMS's recompute is turned on for RECOMPUTE_METHODS (lms_hybrid), left as
    LMS has it for DEFAULT_RECOMPUTE_METHODS (lms) and turned off for every other LMS row
    before LMS is applied and the model built, and put back as it was after LMS is off again
    (rows share a process). COMPILE_BUDGET_METHODS rows train ``torch.compile(model)`` under
    ``m.activation_budget`` (skipped, with the reason, where this torch cannot)."""
    import torch
    from torch.profiler import record_function

    from benchmarks import models
    from lmsbench.lms_setup import (
        apply_lms,
        is_oom,
        lms_recompute_operators,
        lms_stats,
        memory_cap,
        release_pinned_host_cache,
        settle,
    )

    nocap = getattr(args, "regime", "capped") == "nocap"
    device = torch.device("cuda", torch.cuda.current_device())
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if args.amp else contextlib.nullcontext()
    counter: Any = None
    if m.method == "save_on_cpu":
        counter = models.SaveOnCpuCounter(pin_memory=True)
    offload: Any = None
    if m.method == "offload":
        # torchtune's implementation where installed; otherwise the same mechanism as a
        # baseline of this benchmark (models.StreamOffload), named so in the row's detail.
        offload = models.torchtune_offload()
        if offload is None:
            counter = models.StreamOffload()
            m.detail = "baseline: models.StreamOffload (torchtune not installed)"
        else:
            m.detail = "torchtune.training.OffloadActivations"
    compiled = m.method in COMPILE_BUDGET_METHODS
    if compiled:
        reason = compile_budget_unavailable(torch)
        if not reason and m.activation_budget is None:
            reason = "no activation budget chosen for this row (no memory figures for it)"
        if reason:
            m.status, m.detail = "skipped", f"not run: {reason}"
            return m
    model: Any = None
    forward: Any = None
    optimizer: Any = None
    restore_recompute: Callable[[], None] | None = None
    restore_compile: Callable[[], None] | None = None
    retries_left = args.oom_retries if lms is not None else 0
    settle()
    if nocap:
        release_pinned_host_cache()  # rows share a process: the last row's pinned cache goes
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    row_start_stats = torch.cuda.memory_stats()
    rss_reset = reset_rss_peak()
    with contextlib.suppress(Exception):  # a torch without pinned-memory statistics
        torch.cuda.reset_peak_host_memory_stats()
    try:
        with memory_cap(m.cap_bytes):
            if lms is not None:
                if m.method not in DEFAULT_RECOMPUTE_METHODS:
                    restore_recompute = set_recompute(torch.cuda, m.method in RECOMPUTE_METHODS)
                m.recompute_on = recompute_state(torch.cuda)
                apply_lms(lms)
            with device:
                model = workload.build()
            if m.method == "checkpoint":
                workload.checkpoint(model)
            model.train()
            forward = model
            if compiled:
                assert m.activation_budget is not None
                forward, restore_compile = compile_with_budget(model, m.activation_budget)
            optimizer = workload.make_optimizer(model, args.optimizer)
            before: dict[str, Any] | None = None
            operators_before: dict[str, dict[str, int]] = {}
            allocator_before: dict[str, Any] = {}

            def one_step(step: int) -> None:
                inputs, targets = workload.make_batch(m.batch, device, step)
                if counter is not None:
                    ctx = counter.context()
                elif offload is not None:
                    ctx = offload()
                else:
                    ctx = contextlib.nullcontext()
                # The phases a profile splits its figures by (stream_profile.PHASE_PREFIX).
                with ctx, amp, record_function("step: forward"):
                    loss = workload.loss(forward(inputs), targets)
                with record_function("step: backward"):
                    loss.backward()
                del inputs, targets, loss
                with record_function("step: optimizer"):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()

            step = 0
            zero_stats: dict[str, Any] | None = None
            zero_allocator: dict[str, Any] = {}
            while step < warmup + iterations:
                if lms is not None and (step == 0 or step < warmup):
                    torch.cuda.synchronize()
                    zero_stats = lms_stats()
                    zero_allocator = torch.cuda.memory_stats()
                if step == warmup:
                    torch.cuda.synchronize()
                    before = lms_stats()
                    operators_before = lms_recompute_operators()
                    allocator_before = torch.cuda.memory_stats()
                    if isinstance(counter, models.StreamOffload):
                        counter.reset()
                    elif counter is not None:
                        counter.out_bytes = counter.in_bytes = 0
                torch.cuda.synchronize()
                start = time.perf_counter()
                try:
                    one_step(step)
                except Exception as exc:
                    if retries_left > 0 and is_oom(exc):
                        retries_left -= 1
                        m.oom_retries += 1
                        optimizer.zero_grad(set_to_none=True)
                        log(f"    step {step}: out of memory, retrying ({retries_left} left)")
                        continue
                    raise
                elapsed = time.perf_counter() - start
                if step == 0:
                    m.static_bytes = torch.cuda.memory_allocated() - base
                    m.first_iteration_s = elapsed
                if zero_stats is not None and (step == 0 or step < warmup):
                    account = iteration_account(
                        zero_stats,
                        lms_stats(),
                        zero_allocator,
                        torch.cuda.memory_stats(),
                    )
                    m.warmup_accounts.append(account)
                    if step == 0:
                        m.first_iteration = account
                    log(f"      {describe_iteration(m.method, step, elapsed, account)}")
                if step >= warmup:
                    m.iteration_times.append(elapsed)
                else:
                    m.warmup_times.append(elapsed)
                step += 1
            after = lms_stats()
            operators = operator_counts_between(operators_before, lms_recompute_operators())
            if operators:
                m.recompute_operators = operators
            allocator_after = torch.cuda.memory_stats()
            m.peak_allocated_bytes = torch.cuda.max_memory_allocated() - base
            retries = "num_alloc_retries"
            m.alloc_retries = allocator_after.get(retries, 0) - row_start_stats.get(retries, 0)
            m.alloc_retries_timed = allocator_after.get(retries, 0) - allocator_before.get(
                retries, 0
            )
            record_host_memory(m, after if lms is not None else None, rss_reset)
            if args.profile_iterations and m.method in PROFILED_METHODS:
                try:
                    row = m.method + (f" x{m.factor:g}" if m.factor else "")
                    m.profile = profile_steps(one_step, step, args.profile_iterations, log, row)
                except Exception as exc:  # the row's figures stand without a profile
                    log(f"      profile failed: {type(exc).__name__}: {exc}")
        if lms is not None and after is not None and "limit_bytes" in after:
            m.lms_limit_bytes = int(after["limit_bytes"])
        if lms is not None and before is not None and after is not None:
            m.out_bytes_per_iter = (after["pageout_bytes"] - before["pageout_bytes"]) / iterations
            m.in_bytes_per_iter = (after["pagein_bytes"] - before["pagein_bytes"]) / iterations
            m.stall_ms_per_iter = (after["stall_ms"] - before["stall_ms"]) / iterations
            if "pagein_demand_count" in after:
                m.pagein_demand_count_per_iter = (
                    after["pagein_demand_count"] - before["pagein_demand_count"]
                ) / iterations
            record_packs_and_placements(m, before, after, iterations)
            record_recompute(m, before, after, iterations)
            ahead_gib = (
                (after.get("peak_pageout_bytes", 0) - before.get("peak_pageout_bytes", 0))
                / iterations
                / GiB
            )
            # Fallbacks since the process began, and in the timed iterations alone: those
            # are the steady state's (a loop whose schedule keeps breaking pages reactively).
            timed_fallbacks = after.get("schedule_fallbacks", 0) - before.get(
                "schedule_fallbacks", 0
            )
            m.lms_schedule = (
                f"period {after['schedule_period']}, "
                f"{after['schedule_fallbacks']} fallbacks ({timed_fallbacks} timed), "
                f"{m.pagein_demand_count_per_iter:g} demand page-ins/iter"
                + (
                    f", prefetch budget {after['schedule_prefetch_budget_bytes'] / MiB:.0f} MiB"
                    f" of a {after['limit_bytes'] / MiB:.0f} MiB limit"
                    if "schedule_prefetch_budget_bytes" in after
                    else ""
                )
                + (
                    f", {ahead_gib:.2f} GiB/iter paged out ahead of the peak"
                    if "peak_pageout_bytes" in after
                    else ""
                )
                + allocator_flushes(allocator_before, allocator_after, iterations)
                if after.get("schedule_active")
                else (
                    f"inactive, {after.get('schedule_fallbacks', 0)} fallbacks "
                    f"({timed_fallbacks} timed)"
                    if "schedule_active" in after
                    else ""
                )
            )
        elif isinstance(counter, models.StreamOffload):
            m.out_bytes_per_iter = counter.out_bytes / iterations
            m.in_bytes_per_iter = counter.in_bytes / iterations
            m.stall_ms_per_iter = counter.stall_ms / iterations
        elif offload is not None:
            m.out_bytes_per_iter = m.in_bytes_per_iter = None  # torchtune does not say
        elif counter is not None:
            m.out_bytes_per_iter = counter.out_bytes / iterations
            m.in_bytes_per_iter = counter.in_bytes / iterations
        else:
            m.out_bytes_per_iter = m.in_bytes_per_iter = 0.0
        m.finish_timing()
    except Exception as exc:  # a row's failure must not end the run
        m.status = "oom" if is_oom(exc) else "error"
        first = str(exc).strip().splitlines()
        m.detail = f"{type(exc).__name__}: {first[0] if first else ''}"[:300]
        if compiled and m.status == "error" and m.first_iteration_s is None:
            # The first step compiles: an error there is torch.compile's, not training's.
            m.detail = f"not run: does not compile: {m.detail}"[:300]
        if m.status == "error":
            log(traceback.format_exc())
        m.iteration_times.clear()
    finally:
        model = forward = optimizer = None
        if restore_compile is not None:
            restore_compile()
        settle()
        if lms is not None:
            apply_lms(LmsSettings(enabled=False))
            settle()
        if restore_recompute is not None:
            restore_recompute()
        if nocap:
            release_pinned_host_cache()
        # Rows share a process: memory a row leaves allocated (seen after a failed row)
        # shrinks every later row's room under its cap. Say so where it happens.
        left = torch.cuda.memory_allocated() - base
        if left > MiB:
            note = f"left {left / MiB:.0f} MiB allocated after the row (later rows have less room)"
            m.detail = f"{m.detail}; {note}" if m.detail else note
            log(f"    {note}")
    return m


def measure_saved_bytes(
    args: argparse.Namespace, workload: Any, batch: int, device: Any = None
) -> int:
    """The bytes autograd saves for the backward pass in one training step at ``batch``
    (every tensor its saved-tensor hooks see, counted as save_on_cpu packs them), uncapped,
    LMS off: what offload and save_on_cpu keep in pinned host memory. ``device``: the current
    CUDA device where None."""
    import torch

    from lmsbench.lms_setup import settle

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    amp = (
        torch.autocast(device.type, dtype=torch.bfloat16) if args.amp else contextlib.nullcontext()
    )
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    settle()
    model: Any = None
    try:
        with device:
            model = workload.build()
        model.train()
        inputs, targets = workload.make_batch(batch, device, 0)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), amp:
            loss = workload.loss(model(inputs), targets)
        loss.backward()
        del inputs, targets, loss
    finally:
        model = None
        settle()
    return total


def iteration_account(
    lms_before: dict[str, Any],
    lms_after: dict[str, Any],
    allocator_before: dict[str, Any],
    allocator_after: dict[str, Any],
) -> dict[str, float]:
    """What the LMS statistics and the caching allocator's count of one step: milliseconds of
    pinning new host buffers, stalls, replays and waits for other processes; gibibytes paged
    and dropped; page-ins on demand; the allocator's retries (its cache returned to the device
    after a failed allocation) and failures; the learned schedules adopted and dropped in it
    and whether one is in use at its end. Keys a build's statistics lack count 0."""

    def delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
        return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)

    def lms_delta(key: str) -> float:
        return delta(lms_before, lms_after, key)

    return {
        "host_pin_ms": lms_delta("host_pin_ms"),
        "host_pins": lms_delta("host_pin_count"),
        "stall_ms": lms_delta("stall_ms"),
        "recompute_ms": lms_delta("recompute_ms"),
        "wait_ms": lms_delta("host_wait_ms") + lms_delta("device_wait_ms"),
        "out_gib": lms_delta("pageout_bytes") / GiB,
        "in_gib": lms_delta("pagein_bytes") / GiB,
        "dropped_gib": lms_delta("drop_bytes") / GiB,
        "demand_pageins": lms_delta("pagein_demand_count"),
        "allocator_retries": delta(allocator_before, allocator_after, "num_alloc_retries"),
        "allocator_failures": delta(allocator_before, allocator_after, "num_ooms"),
        "cache_releases": lms_delta("cache_releases"),
        "schedules_adopted": lms_delta("schedule_detections"),
        "schedules_dropped": lms_delta("schedule_fallbacks"),
        "schedule_active": float(lms_after.get("schedule_active", 0) or 0),
    }


def describe_schedule(account: dict[str, float]) -> str:
    """The learned schedule in one step of iteration_account: adopted, dropped, in use."""
    adopted = int(account.get("schedules_adopted", 0))
    dropped = int(account.get("schedules_dropped", 0))
    active = account.get("schedule_active", 0) > 0
    if adopted == 0 and dropped == 0:
        return "schedule in use" if active else "no schedule yet"
    events = [f"adopted {adopted}x"] if adopted else []
    events += [f"dropped {dropped}x"] if dropped else []
    return (
        "schedule " + ", ".join(events) + (", in use at the end" if active else ", none at the end")
    )


def describe_iteration(method: str, index: int, seconds: float, account: dict[str, float]) -> str:
    """One log line of iteration_account's figures for step ``index``, which took ``seconds``."""
    a = account
    return (
        f"iteration {index} of {method}: {seconds:.2f} s, {describe_schedule(a)}; "
        "pinning host memory "
        f"{a['host_pin_ms']:.0f} ms ({a['host_pins']:.0f} buffers), stalls {a['stall_ms']:.0f} ms, "
        f"recompute {a['recompute_ms']:.0f} ms, waits {a['wait_ms']:.0f} ms; paged out "
        f"{a['out_gib']:.2f} / in {a['in_gib']:.2f} GiB ({a['demand_pageins']:.0f} on demand), "
        f"dropped {a['dropped_gib']:.2f} GiB; allocator {a['allocator_retries']:.0f} retries, "
        f"{a['allocator_failures']:.0f} failures; cache returned {a['cache_releases']:.0f} times"
    )


def record_host_memory(m: Measurement, lms_after: dict[str, Any] | None, rss_reset: bool) -> None:
    """Fills ``m``'s host memory peaks: pinned (LMS's ``host_bytes`` peak with LMS statistics
    ``lms_after``, else PyTorch's pinned host allocator where this torch reports it) and
    resident (VmHWM, since the row's start where ``rss_reset``, else since the process's)."""
    import torch

    sources = []
    gauge = (lms_after or {}).get("host_bytes")
    if isinstance(gauge, dict) and "peak" in gauge:
        m.host_pinned_peak_bytes = int(gauge["peak"])
        sources.append("pinned: LMS host_bytes peak")
    else:
        stats = getattr(torch.cuda, "host_memory_stats", None)
        try:
            peak = stats().get("allocated_bytes.peak") if stats is not None else None
        except Exception:  # a torch without the statistics: the row stands without them
            peak = None
        if peak is not None:
            m.host_pinned_peak_bytes = int(peak)
            sources.append("pinned: PyTorch host allocator peak (rounded blocks)")
    rss = read_kib_fields("/proc/self/status").get("VmHWM")
    if rss is not None:
        m.host_rss_peak_bytes = rss
        sources.append("RSS: VmHWM " + ("of the row" if rss_reset else "since the process began"))
    m.host_memory_source = "; ".join(sources)


def profile_steps(
    one_step: Callable[[int], None],
    first: int,
    iterations: int,
    log: Callable[[str], None],
    label: str = "",
) -> dict[str, Any]:
    """Runs ``iterations`` more training steps under ``torch.profiler`` (CPU and CUDA
    activity) and returns their stream breakdown (see stream_profile.py). Its lines are logged
    before the row's own line, so they name the row (``label``)."""
    import tempfile

    import torch

    from benchmarks.stream_profile import analyze

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for step in range(first, first + iterations):
            one_step(step)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        breakdown = analyze(json.loads(path.read_text()), iterations)
    for line in breakdown.summary().splitlines():
        log(f"      profile{f' of {label}' if label else ''}: {line}")
    return breakdown.record()


def record_packs_and_placements(
    m: Measurement, before: dict[str, Any], after: dict[str, Any], iterations: int
) -> None:
    """The operators packed and the allocations placed before the allocator failed them
    (``fragment_placements``) per timed iteration, where LMS's statistics count them."""
    if "pack_count" in after and "pack_count" in before:
        m.pack_count_per_iter = (after["pack_count"] - before["pack_count"]) / iterations
    if "fragment_placements" in after and "fragment_placements" in before:
        m.placements_per_iter = (
            after["fragment_placements"] - before["fragment_placements"]
        ) / iterations


def describe(m: Measurement) -> str:
    if m.status != "ok":
        return f"{m.status} ({m.detail})" if m.detail else m.status
    parts = [f"{m.samples_per_s:.2f} samples/s", f"{(m.iteration_s or 0) * 1000:.1f} ms/iter"]
    if m.out_bytes_per_iter or m.in_bytes_per_iter:
        parts.append(
            f"out {(m.out_bytes_per_iter or 0) / GiB:.2f} / in "
            f"{(m.in_bytes_per_iter or 0) / GiB:.2f} GiB per iter"
        )
    if m.stall_ms_per_iter:
        parts.append(f"stall {m.stall_ms_per_iter:.1f} ms/iter")
    if m.drop_bytes_per_iter or m.recompute_bytes_per_iter:
        parts.append(
            f"dropped {(m.drop_bytes_per_iter or 0) / GiB:.2f} / recomputed "
            f"{(m.recompute_bytes_per_iter or 0) / GiB:.2f} GiB, recompute "
            f"{m.recompute_ms_per_iter or 0:.1f} ms per iter"
        )
        if m.recompute_input_prefetch_bytes_per_iter is not None:
            parts.append(
                f"recipe inputs paged in ahead "
                f"{m.recompute_input_prefetch_bytes_per_iter / GiB:.2f} GiB per iter"
            )
    if m.pagein_demand_count_per_iter:
        parts.append(f"{m.pagein_demand_count_per_iter:.0f} page-ins on demand per iter")
    if m.pack_count_per_iter:
        parts.append(f"{m.pack_count_per_iter:g} operators packed per iter")
    if m.placements_per_iter:
        parts.append(
            f"{m.placements_per_iter:g} allocations placed before the allocator failed, per iter"
        )
    if m.peak_allocated_bytes is not None:
        parts.append(f"peak {m.peak_allocated_bytes / GiB:.2f} GiB")
    if m.oom_retries:
        parts.append(f"{m.oom_retries} OOM retries")
    if m.recompute_on is not None:
        parts.append(f"recompute {'on' if m.recompute_on else 'off'}")
    if m.activation_budget is not None:
        parts.append(f"activation_memory_budget {m.activation_budget:g}")
    if m.need_bytes is not None:
        if m.first_iteration_s is not None:
            parts.append(f"first step {m.first_iteration_s:.1f} s")
        if m.host_pinned_peak_bytes:
            parts.append(f"host pinned {m.host_pinned_peak_bytes / GiB:.1f} GiB")
        if m.alloc_retries:
            parts.append(f"{m.alloc_retries} allocator retries")
    return ", ".join(parts)


def run_probe(args: argparse.Namespace) -> int:
    """One search probe: trains ``--probe-iterations`` steps; exit 0 or EXIT_OOM."""
    from lmsbench.lms_setup import ensure_lms_api

    workload = make_workload(args)
    lms = None
    if args.probe_lms:
        ensure_lms_api()
        lms = lms_settings(args, args.probe_cap_bytes)
    m = Measurement(args.model, "probe", None, args.probe_cap_bytes, args.probe_batch)
    train_measure(
        args,
        workload,
        m,
        warmup=0,
        iterations=args.probe_iterations,
        lms=lms,
        log=lambda s: print(s, file=sys.stderr),
    )
    print(f"batch {args.probe_batch}: {describe(m)}")
    if m.status == "ok":
        return 0
    return EXIT_OOM if m.status == "oom" else 1


def search_batch(
    args: argparse.Namespace,
    *,
    lms: bool,
    cap: int,
    start: int,
    upper: int,
    budget_s: float,
    log: Callable[[str], None],
) -> SearchResult:
    base = model_argv(args)

    def command(batch: int) -> list[str]:
        argv = [*base, "--probe-batch", str(batch), "--probe-cap-bytes", str(cap)]
        if lms:
            argv.append("--probe-lms")
        return python_command(str(Path(__file__).resolve()), argv)

    probe = subprocess_probe(command, timeout_s=args.probe_timeout_s, env=checkout_env(), log=log)
    return find_largest(
        probe,
        start,
        lower=1,
        upper=upper,
        rel_tol=args.search_tolerance if lms else 0.0,
        budget_s=budget_s,
    )


def search_note(result: SearchResult, tolerance: float) -> str:
    notes = []
    if result.upper_bound_hit:
        notes.append("lower bound: host-memory bound of the search reached")
    if result.budget_exhausted:
        notes.append("lower bound: search budget ran out")
    if tolerance > 0 and result.exact and result.largest > 0:
        notes.append(f"within {tolerance:.0%}")
    timeouts = sum(p.outcome is Outcome.TIMEOUT for p in result.probes)
    if timeouts:
        notes.append(f"{timeouts} probe(s) over the time limit counted as not trainable")
    return "; ".join(notes)


def probes_json(result: SearchResult) -> list[dict[str, Any]]:
    def one(p: Probe) -> dict[str, Any]:
        return {
            "batch": p.value,
            "outcome": p.outcome.value,
            "seconds": round(p.seconds, 2),
            "detail": p.detail[-500:],
        }

    return [one(p) for p in result.probes]


def run_benchmark(args: argparse.Namespace, methods_given: bool = True) -> int:
    """The measurements on the GPU. ``methods_given``: ``--methods`` was given (otherwise
    ``args.methods`` is the regime's default), which decides what lms_hybrid on a build
    without recompute does (check_recompute)."""
    import signal

    import torch

    from lmsbench.lms_setup import LmsUnavailable, ensure_lms_api, environment

    if not torch.cuda.is_available():
        print("compare.py: no CUDA device: the benchmark needs a GPU", file=sys.stderr)
        return 2
    deadline = Deadline(args.time_budget_s)
    try:
        backend = ensure_lms_api()
        lms_reason = ""
    except LmsUnavailable as exc:
        backend, lms_reason = "", str(exc)
    error = check_recompute(args, backend, torch.cuda, methods_given)
    if error:
        print(f"compare.py: {error}", file=sys.stderr)
        return 2
    if not args.amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    workload = make_workload(args)
    batch = args.batch or workload.default_batch
    env = environment()
    memory: DeviceMemory | None = None
    if args.regime == "nocap":
        # Before this process allocates anything: what other processes and this process's
        # context already use is not the run's.
        free, total = torch.cuda.mem_get_info()
        memory = DeviceMemory(int(total), int(free))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"compare-{args.model}"
    print(
        f"== {workload.description}, batch {batch}, on {env.get('device')} "
        f"(torch {env['torch']}, CUDA {env['cuda']}, LMS: {backend or 'unavailable'}, "
        f"regime {args.regime}; engine {env.get('engine_commit')}"
        f"{' with local changes' if env.get('engine_dirty') is True else ''})"
    )

    print("== pinned copy bandwidth")
    bw = measure_bandwidth(args.bandwidth_mib * MiB)
    print(
        f"   D2H {bw.d2h / 1e9:.1f} GB/s, H2D {bw.h2d / 1e9:.1f} GB/s, "
        f"both directions {bw.bidirectional / 1e9:.1f} GB/s"
    )

    if memory is not None:

        def stop(signum: int, frame: Any) -> None:
            raise SystemExit(f"compare.py: stopped by signal {signum}")

        signal.signal(signal.SIGTERM, stop)
        folder = args.capped_results or DEFAULT_CAPPED_RESULTS
        runner = NocapRun(
            args,
            description=workload.description,
            batch=batch,
            env=env,
            memory=memory,
            bw=bw,
            train=lambda m, lms: train_measure(
                args, workload, m, warmup=args.warmup, iterations=args.iterations, lms=lms
            ),
            lms_backend=backend,
            lms_reason=lms_reason,
            deadline=deadline,
            saved_bytes=lambda b: measure_saved_bytes(args, workload, b),
            reference=capped_reference(
                folder / f"compare-{args.model}.json",
                workload.description,
                args.amp,
                args.optimizer,
            ),
        )
        return runner.run()

    rows: list[Measurement] = []
    searches: dict[str, Any] = {}
    durations: list[float] = []
    per_sample: float | None = None

    def save(final: bool) -> None:
        if per_sample is not None:
            fill_roofline(rows, per_sample, bw)
        goals = evaluate_goals(rows, args.factors) if per_sample is not None else []
        write_outputs(
            args, stem, env, bw, rows, goals, searches, workload.description, batch, final=final
        )

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"compare.py: stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    def measure(
        method: str,
        factor: float | None,
        cap: int | None,
        b: int,
        lms: LmsSettings | None,
        budget: float | None = None,
    ) -> Measurement:
        m = Measurement(args.model, method, factor, cap, b, activation_budget=budget)
        rows.append(m)
        label = f"{method} x{factor:g}" if factor else method
        # A measurement is started only if three times the longest so far still fits.
        needs_s = 3 * max(durations, default=0.0)
        if lms is not None and not backend:
            m.status, m.detail = "skipped", f"LMS unavailable: {lms_reason}"
        elif deadline.left() < needs_s:
            m.status, m.detail = "skipped", "time budget"
        else:
            began = time.monotonic()
            train_measure(
                args, workload, m, warmup=args.warmup, iterations=args.iterations, lms=lms
            )
            durations.append(time.monotonic() - began)
        print(f"   {label:<22} batch {b:<5} {describe(m)}", flush=True)
        return m

    try:
        print("== uncapped")
        base = measure("baseline", None, None, batch, None)
        if base.status != "ok" or base.peak_allocated_bytes is None or base.iteration_s is None:
            print(
                f"compare.py: the uncapped baseline failed ({base.detail}); nothing to compare "
                "against: lower --batch or --image-size",
                file=sys.stderr,
            )
            return 1
        peak = base.peak_allocated_bytes
        static = base.static_bytes or 0
        per_sample = base.iteration_s / batch
        if args.overhead:
            measure("lms_fits", None, None, batch, lms_settings(args, None))
            measure("baseline_repeat", None, None, batch, None)

        caps = {f: cap_bytes(peak, f) for f in args.factors}
        for f in args.factors:
            print(
                f"== {f:g}x oversubscribed: cap {caps[f] / GiB:.2f} GiB (uncapped peak "
                f"{peak / GiB:.2f} GiB, static {static / GiB:.2f} GiB)"
            )
            for method in args.methods:
                budget = None
                if method in COMPILE_BUDGET_METHODS:
                    budget = activation_budget(caps[f], peak, static)
                row = measure(
                    method, f, caps[f], batch, method_lms_settings(args, method, caps[f]), budget
                )
                row.deficit_bytes = max(0, peak - caps[f])
            save(final=False)

        # A probe that starts before the search deadline may run up to --probe-timeout-s.
        search_s = min(args.search_budget_s, deadline.left() - args.probe_timeout_s - 10)
        search_deadline = Deadline(max(0.0, search_s))
        for f in args.factors:
            run_searches(
                args,
                f,
                caps[f],
                batch,
                peak,
                static,
                backend,
                rows,
                searches,
                search_deadline,
                measure,
            )
            save(final=False)
    finally:
        save(final=True)
    return 0


# The committed capped results (benchmarks/results/<topic>/<date>-<device>-<commit>/).
DEFAULT_CAPPED_RESULTS = HERE / "results" / "compare" / "2026-11-24-h100-unrecorded"


@dataclass(frozen=True)
class DeviceMemory:
    """The device's memory when the run starts (``torch.cuda.mem_get_info``)."""

    total_bytes: int
    free_bytes: int

    @property
    def used_at_start_bytes(self) -> int:
        """What other processes and this process's CUDA context already held."""
        return self.total_bytes - self.free_bytes

    @property
    def limit_bytes(self) -> int:
        """D: the memory this process can use."""
        return self.free_bytes

    def record(self) -> dict[str, int]:
        return {
            "total_bytes": self.total_bytes,
            "used_at_start_bytes": self.used_at_start_bytes,
            "limit_bytes": self.limit_bytes,
        }


TrainFn = Callable[[Measurement, Optional[LmsSettings]], Any]
RUNNING_DETAIL = "started, not finished: the run was stopped during this row"


class NocapRun:
    """The no-cap regime (``--regime nocap``): the fitting runs, then each factor's methods at
    its batch, uncapped. The GPU work is ``train`` (fills a Measurement, as train_measure
    does), so that the same sequence, its time and host-memory checks and its files run
    with fake training in the tests.

    Every row is written out when it starts (status ``running``: a run killed during it says
    so) and when it ends. A row starts only where its estimated time (nocap_row_estimate, times
    the slowdown the rows so far measured against their estimates) and FINAL_RESERVE_S fit in
    what is left of ``--time-budget-s``, and where its estimated pinned host memory
    (nocap_host_bytes) fits under ``--host-budget-gib`` and the host's available memory.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        description: str,
        batch: int,
        env: dict[str, Any],
        memory: DeviceMemory,
        bw: Bandwidth,
        train: TrainFn,
        lms_backend: str,
        lms_reason: str = "",
        reference: CappedReference | None = None,
        saved_bytes: Callable[[int], int | None] | None = None,
        host_available: Callable[[], int | None] = host_available_bytes,
        clock: Callable[[], float] = time.monotonic,
        deadline: Deadline | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.args = args
        self.description = description
        self.batch = batch
        self.env = env
        self.memory = memory
        self.bw = bw
        self.train = train
        self.lms_backend = lms_backend
        self.lms_reason = lms_reason
        self.reference = reference
        self.saved_bytes = saved_bytes
        self.saved_per_sample: float | None = None
        self.host_available = host_available
        self.clock = clock
        self.log = log
        # The run's --time-budget-s, counted from the start of the process's work.
        self.deadline = deadline or Deadline(args.time_budget_s, clock)
        self.rows: list[Measurement] = []
        self.model: MemoryModel | None = None
        self.plans: list[dict[str, Any]] = []
        # Per method: measured row time over its estimate at slowdown 1.
        self.observed: dict[str, list[float]] = {}
        self.estimates: list[dict[str, Any]] = []
        self.stem = f"nocap-{args.model}"

    @property
    def steps(self) -> int:
        return int(self.args.warmup + self.args.iterations)

    def slowdown(self, method: str) -> float:
        """What a row's estimate is multiplied by: NOCAP_OBSERVED_MARGIN x the largest ratio
        measured for ``method`` in this run; before any, the prior (--prior-slowdown, default
        NOCAP_PRIOR_SLOWDOWN) or the
        largest ratio of another method, whichever is larger."""
        own = self.observed.get(method)
        if own:
            return NOCAP_OBSERVED_MARGIN * max(own)
        others = [r for m, rs in self.observed.items() if m not in FIT_METHODS for r in rs]
        prior = getattr(self.args, "prior_slowdown", None) or NOCAP_PRIOR_SLOWDOWN
        return max([prior, *others])

    def host_room(self) -> int:
        """Pinned host memory a row may need: --host-budget-gib, and no more than the host's
        available memory less HOST_MARGIN_BYTES."""
        room = int(self.args.host_budget_gib * GiB)
        available = self.host_available()
        if available is not None:
            room = min(room, available - HOST_MARGIN_BYTES)
        return room

    def extra(self) -> dict[str, Any]:
        compute = nocap_compute_s_per_sample(self.rows)
        return {
            "device_memory": self.memory.record(),
            "memory_model": None if self.model is None else self.model.record(),
            "plans": self.plans,
            "compute": None
            if compute is None
            else {
                "s_per_sample": compute[0],
                "from_batch": compute[1],
                "source": "uncapped LMS-off fitting run with the largest batch",
            },
            "saved_bytes_per_sample": self.saved_per_sample,
            "capped_reference": None if self.reference is None else self.reference.record(),
            "time_estimates": self.estimates,
        }

    def save(self, final: bool) -> None:
        compute = nocap_compute_s_per_sample(self.rows)
        goals: list[Goal] = []
        if compute is not None:
            fill_roofline(self.rows, compute[0], self.bw)
            goals = evaluate_nocap_goals(
                self.rows, self.args.factors, self.reference, str(self.env.get("device", ""))
            )
        write_outputs(
            self.args,
            self.stem,
            self.env,
            self.bw,
            self.rows,
            goals,
            {},
            self.description,
            self.batch,
            final=final,
            regime="nocap",
            extra=self.extra(),
        )

    def row(
        self,
        method: str,
        factor: float | None,
        batch: int,
        lms: LmsSettings | None,
        *,
        estimate_s: float = 0.0,
        plan: NocapPlan | None = None,
        host_bytes: int = 0,
        budget: float | None = None,
    ) -> Measurement:
        """Measures one row (or records why it was skipped), writing the files before and
        after. ``estimate_s`` is its estimate at slowdown 1 (0: always start it); ``budget``
        the activation memory budget of a compile_budget row."""
        m = Measurement(self.args.model, method, factor, None, batch, activation_budget=budget)
        if plan is not None:
            m.need_bytes, m.limit_bytes = plan.need_bytes, plan.limit_bytes
            m.deficit_bytes = plan.deficit_bytes
        self.rows.append(m)
        label = f"{method} x{factor:g}" if factor else method
        expected = estimate_s * self.slowdown(method) if estimate_s else 0.0
        left = self.deadline.left() - FINAL_RESERVE_S
        room = self.host_room() if host_bytes else 0
        if lms is not None and not self.lms_backend:
            m.status, m.detail = "skipped", f"LMS unavailable: {self.lms_reason}"
        elif host_bytes and host_bytes > room:
            m.status, m.detail = (
                "skipped",
                f"host memory: needs about {host_bytes / GiB:.1f} GiB of pinned host memory, "
                f"{max(room, 0) / GiB:.1f} GiB allowed (--host-budget-gib, available memory)",
            )
        elif expected > left:
            m.status, m.detail = (
                "skipped",
                f"time budget: needs about {expected:.0f} s, {max(left, 0.0):.0f} s left",
            )
        else:
            self._measure(m, lms, estimate_s, expected)
        self.log(f"   {label:<22} batch {batch:<6} {describe(m)}")
        self.save(final=False)
        return m

    def _measure(
        self, m: Measurement, lms: LmsSettings | None, estimate_s: float, expected: float
    ) -> None:
        m.status, m.detail = "running", RUNNING_DETAIL
        self.save(final=False)
        m.detail = ""
        began = self.clock()
        try:
            self.train(m, lms)
        except BaseException:
            m.status, m.detail = "stopped", "stopped during this row (time limit or signal)"
            m.iteration_times.clear()
            m.iteration_s = m.samples_per_s = None
            raise
        finally:
            m.row_s = self.clock() - began
        if m.status == "running":
            m.status = "ok"
        if estimate_s > 0:
            self.observed.setdefault(m.method, []).append(m.row_s / estimate_s)
            self.estimates.append(
                {
                    "method": m.method,
                    "factor": m.factor,
                    "batch": m.batch,
                    "estimate_s": round(expected, 1),
                    "measured_s": round(m.row_s, 1),
                }
            )

    def run(self) -> int:
        """The whole regime; the files are written after every row and at the end."""
        memory = self.memory
        self.log(
            f"== no cap: device {memory.total_bytes / GiB:.2f} GiB, used at start "
            f"{memory.used_at_start_bytes / GiB:.2f} GiB, limit D {memory.limit_bytes / GiB:.2f} "
            f"GiB; capped reference: {self._reference_text()}"
        )
        try:
            return self._run()
        finally:
            self.save(final=True)

    def _reference_text(self) -> str:
        ref = self.reference
        if ref is None:
            return "none"
        if ref.reason:
            return f"not comparable ({ref.reason})"
        points = ", ".join(f"{p.deficit_over_limit:.2f}: {p.efficiency:.0%}" for p in ref.points)
        return f"{ref.source} (deficit/limit: efficiency {points})"

    def _saved_per_sample(self) -> float | None:
        """Bytes autograd saves per sample at the fitting batch (``saved_bytes``), which
        offload and save_on_cpu keep in pinned host memory; None where it failed."""
        assert self.saved_bytes is not None
        try:
            total = self.saved_bytes(self.batch)
        except Exception as exc:  # the host estimate falls back to the memory model
            self.log(f"   saved-tensor bytes not measured: {type(exc).__name__}: {exc}")
            return None
        if not total:
            return None
        self.saved_per_sample = total / self.batch
        self.log(
            f"   autograd saves {total / GiB:.2f} GiB at batch {self.batch} "
            f"({self.saved_per_sample / GiB:.4f} GiB per sample): what offload and "
            "save_on_cpu pin"
        )
        return self.saved_per_sample

    def _run(self) -> int:
        args, limit = self.args, self.memory.limit_bytes
        self.log(f"== uncapped, LMS off: fitting batch {self.batch}")
        base = self.row("baseline", None, self.batch, None)
        if (
            base.status != "ok"
            or base.peak_allocated_bytes is None
            or base.iteration_s is None
            or base.static_bytes is None
        ):
            self.log(
                f"compare.py: the uncapped baseline failed ({base.detail}); nothing to scale "
                "from: lower --batch or --image-size"
            )
            return 1
        try:
            model = one_batch_memory_model(self.batch, base.peak_allocated_bytes, base.static_bytes)
        except ValueError as exc:
            self.log(f"compare.py: no memory model from the baseline: {exc}")
            return 1
        if args.linearity_check:
            second = second_fit_batch(model, limit)
            if second is None:
                model = replace(model, source=f"{model.source}; no second batch to fit")
            else:
                estimate = estimate_row_seconds(
                    base.iteration_s / self.batch * second, 0, 0, 0, self.bw, self.steps
                )
                fit = self.row("baseline_fit", None, second, None, estimate_s=estimate)
                if fit.status == "ok" and fit.peak_allocated_bytes is not None:
                    model = fitted_memory_model(model, second, fit.peak_allocated_bytes)
                else:
                    model = replace(
                        model,
                        source=f"{model.source}; second batch {second} not measured ({fit.status})",
                    )
        self.model = model
        compute = nocap_compute_s_per_sample(self.rows)
        assert compute is not None  # the baseline trained
        self.log(
            f"== memory model: {model.intercept_bytes / GiB:.3f} GiB + "
            f"{model.per_sample_bytes / GiB:.4f} GiB x batch ({model.source}); compute "
            f"{compute[0] * 1000:.2f} ms per sample (batch {compute[1]})"
        )
        saved = None
        if self.saved_bytes is not None and any(m in HOST_COPY_METHODS for m in args.methods):
            saved = self._saved_per_sample()
        plans: dict[float, NocapPlan] = {}
        for f in args.factors:
            try:
                plans[f] = nocap_plan(model, limit, f)
            except ValueError as exc:
                self.plans.append({"factor": f, "error": str(exc)})
                self.log(f"== {f:g}x: no batch: {exc}")
                continue
            plan = plans[f]
            self.plans.append(plan.record())
            self.log(
                f"== {f:g}x: batch {plan.batch}, need {plan.need_bytes / GiB:.2f} GiB "
                f"(estimate), deficit {plan.deficit_bytes / GiB:.2f} GiB"
            )
        # Method by method, LMS first (the order of --methods): where the time runs out, the
        # rivals' rows are the ones skipped. --row-order factors: factor by factor instead,
        # each factor's methods in that order, so that a factor's row is whole before the next.
        cells = [(method, f) for method in args.methods for f in args.factors]
        if getattr(args, "row_order", None) == "factors":
            cells = [(method, f) for f in args.factors for method in args.methods]
        for method, f in cells:
            steps = self.steps + (args.profile_iterations if method in PROFILED_METHODS else 0)
            lms = method_lms_settings(args, method, None)
            if f not in plans:
                reason = next(p["error"] for p in self.plans if p["factor"] == f)
                self.rows.append(Measurement(args.model, method, f, None, 0, "skipped", reason))
                self.save(final=False)
                continue
            plan = plans[f]
            budget = None
            if method in COMPILE_BUDGET_METHODS:
                budget = activation_budget(limit, plan.need_bytes, int(model.intercept_bytes))
            self.row(
                method,
                f,
                plan.batch,
                lms,
                estimate_s=nocap_row_estimate(
                    method, plan, model.per_sample_bytes, compute[0], self.bw, steps, saved
                ),
                plan=plan,
                host_bytes=nocap_host_bytes(method, plan, model.per_sample_bytes, saved),
                budget=budget,
            )
        return 0


def run_searches(
    args: argparse.Namespace,
    f: float,
    cap: int,
    batch: int,
    peak: int,
    static: int,
    backend: str,
    rows: list[Measurement],
    searches: dict[str, Any],
    search_deadline: Deadline,
    measure: Callable[[str, float | None, int | None, int, LmsSettings | None], Measurement],
) -> None:
    """The no-LMS and LMS batch searches at one factor, and no_lms measured at its largest."""
    start, upper = batch_bounds(batch, peak, static, cap, int(args.host_budget_gib * GiB))
    lms_row = _find(rows, "lms", f)
    if not args.search:
        rows.append(Measurement(args.model, "no_lms", f, cap, 0, "skipped", "--no-search"))
        return
    print(f"== {f:g}x: largest batch without LMS (start {start})")
    if search_deadline.left() <= 0:
        rows.append(Measurement(args.model, "no_lms", f, cap, 0, "skipped", "search budget"))
    else:
        try:
            result = search_batch(
                args,
                lms=False,
                cap=cap,
                start=start,
                upper=batch,
                budget_s=search_deadline.left(),
                log=print,
            )
        except ProbeError as exc:
            rows.append(Measurement(args.model, "no_lms", f, cap, 0, "error", str(exc)[:300]))
        else:
            searches[f"no_lms x{f:g}"] = {
                "largest": result.largest,
                "exact": result.exact,
                "probes": probes_json(result),
            }
            if result.largest > 0:
                m = measure("no_lms", f, cap, result.largest, None)
            else:
                m = Measurement(
                    args.model, "no_lms", f, cap, 0, "oom", "not even batch 1 trains under this cap"
                )
                rows.append(m)
            m.largest_batch, m.largest_batch_note = result.largest, search_note(result, 0.0)
            print(f"   largest batch without LMS: {result.describe()}")
    if lms_row is None or not backend:
        return
    print(f"== {f:g}x: largest batch with LMS (start {batch}, host bound {upper})")
    if search_deadline.left() <= 0:
        lms_row.largest_batch_note = "not searched: search budget"
        return
    try:
        lres = search_batch(
            args,
            lms=True,
            cap=cap,
            start=batch,
            upper=max(batch, upper),
            budget_s=search_deadline.left(),
            log=print,
        )
    except ProbeError as exc:
        lms_row.largest_batch_note = f"search failed: {exc}"[:300]
        return
    searches[f"lms x{f:g}"] = {
        "largest": lres.largest,
        "exact": lres.exact,
        "probes": probes_json(lres),
    }
    lms_row.largest_batch = lres.largest
    lms_row.largest_batch_note = search_note(lres, args.search_tolerance)
    print(f"   largest batch with LMS: {lres.describe()}")


def write_outputs(
    args: argparse.Namespace,
    stem: str,
    env: dict[str, Any],
    bw: Bandwidth,
    rows: Sequence[Measurement],
    goals: Sequence[Goal],
    searches: dict[str, Any],
    description: str,
    batch: int,
    final: bool = True,
    *,
    regime: str = "capped",
    extra: dict[str, Any] | None = None,
) -> None:
    """Writes the CSVs and the JSON (every time, each file replaced whole: a run stopped early
    keeps what it measured); the PNG and the printed tables only when ``final``. ``regime``
    nocap writes the no-cap columns; ``extra`` adds keys to the JSON."""
    out: Path = args.out
    nocap = regime == "nocap"
    if nocap:
        records = [nocap_measurement_record(m) for m in rows]
        columns, env_columns = NOCAP_MEASUREMENT_COLUMNS, NOCAP_ENV_COLUMNS
    else:
        records = [capped_measurement_record(m) for m in rows]
        columns, env_columns = CAPPED_CSV_COLUMNS, csv_env_columns(env)
    goal_records = [goal_record(args.model, g) for g in goals]
    write_csv(out / f"{stem}.csv", columns, records, env, env_columns)
    write_csv(out / f"{stem}-goals.csv", GOAL_COLUMNS, goal_records, env, env_columns)
    config = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if not k.startswith("probe_")
    }
    record = {
        "environment": env,
        "regime": regime,
        "workload": description,
        "batch": batch,
        "config": config,
        **(extra or {}),
        "bandwidth_bytes_per_s": asdict(bw),
        "measurements": [asdict(m) for m in rows],
        "goals": [asdict(g) for g in goals],
        "searches": searches,
    }
    write_json(out / f"{stem}.json", record)
    if not final:
        return
    title = f"{description}, batch {batch}" + (", no cap" if nocap else "")
    png = plot_results(
        rows,
        bw,
        out / f"{stem}.png",
        f"{title} — {env.get('device', '')}",
        NOCAP_XLABEL if nocap else CAPPED_XLABEL,
    )
    table = nocap_measurements_markdown(records) if nocap else measurements_markdown(records)
    print("\n" + table)
    if goal_records:
        print("\n" + goals_markdown(goal_records))
    print(
        f"\nwrote {out / (stem + '.csv')}, {out / (stem + '-goals.csv')}, "
        f"{out / (stem + '.json')}" + (f", {png}" if png else " (no PNG: matplotlib missing)")
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    methods_given = args.methods is not None
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rescore is not None:
        return run_rescore(args)
    if args.probe_batch is not None:
        return run_probe(args)
    return run_benchmark(args, methods_given)


if __name__ == "__main__":
    sys.exit(main())
