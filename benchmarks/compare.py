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
   (``torch.cuda.set_per_process_memory_fraction``), at batch B: ``lms``,
   ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``) and
   ``checkpoint`` (``torch.utils.checkpoint`` around every block);
5. for each factor, while the search budget lasts: the largest batch that trains without
   LMS under the cap, ``no_lms`` measured at that batch, and the largest batch that trains
   with LMS (exponential then binary search; every probe a subprocess, so an out-of-memory
   error cannot poison the next one).

Every row gets throughput, bytes moved each way per iteration (LMS statistics for LMS, the
saved tensors' bytes through pack/unpack hooks for save_on_cpu, 0 for checkpointing) and
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

``--rescore FOLDER`` needs no GPU: it recomputes the goals of the runs recorded in FOLDER's
compare-MODEL.json files with this version's goals and rewrites their compare-MODEL-goals.csv
and compare-MODEL.png (the JSON and the measurement CSV stay as the run wrote them).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent / "examples"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _lms_setup import (  # noqa: E402
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
from _search import (  # noqa: E402
    Outcome,
    Probe,
    ProbeError,
    SearchResult,
    find_largest,
    python_command,
    subprocess_probe,
)

MODELS = ("resnet152", "vit_l", "gpt")
CAPPED_METHODS = ("lms", "lms_reactive", "offload", "save_on_cpu", "checkpoint", "no_lms")
# Methods measured at batch B under every cap (no_lms is measured at its own largest batch).
PEER_METHODS = ("lms", "lms_reactive", "offload", "save_on_cpu", "checkpoint")
# Rows --profile-iterations profiles: the ones that move memory.
PROFILED_METHODS = ("lms", "lms_reactive", "offload", "save_on_cpu")
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


def _efficiency_goal(lms: Measurement | None, f: float) -> Goal:
    """LMS's time against the deficit roofline (its ``deficit_efficiency``)."""
    name = "lms_efficiency"
    if lms is None or lms.status != "ok" or lms.deficit_efficiency is None:
        note = _status_note(lms)
        if lms is not None and lms.status == "ok":
            note = "no deficit roofline: the row records no deficit"
        return Goal(name, f, None, EFFICIENCY_TARGET, None, "not measured", note)
    e = lms.deficit_efficiency
    note = ""
    if e > 1.0:
        note = (
            "above the roofline: the measured copy bandwidth or the uncapped time "
            "underestimates what this run achieved"
        )
    gap = f"{(e - EFFICIENCY_GOAL) * 100:+.1f} points"
    return Goal(name, f, e, EFFICIENCY_TARGET, e >= EFFICIENCY_GOAL, gap, note)


def _out_vs_deficit_goal(lms: Measurement | None, f: float) -> Goal:
    """Bytes LMS pages out per iteration over the deficit."""
    name = "lms_out_vs_deficit"
    if lms is None or lms.status != "ok" or lms.out_bytes_per_iter is None or not lms.deficit_bytes:
        note = _status_note(lms)
        if lms is not None and lms.status == "ok":
            note = "no deficit or no page-out bytes recorded"
        return Goal(name, f, None, OUT_VS_DEFICIT_TARGET, None, "not measured", note)
    ratio = lms.out_bytes_per_iter / lms.deficit_bytes
    gap = f"{OUT_VS_DEFICIT_GOAL - ratio:+.2f}x"
    return Goal(name, f, ratio, OUT_VS_DEFICIT_TARGET, ratio <= OUT_VS_DEFICIT_GOAL, gap)


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
GOAL_COLUMNS = ("model", "goal", "factor", "value", "target", "met", "gap", "note")
ENV_COLUMNS = ("device", "torch", "cuda", "lms_backend", "date")


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


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; ``|`` in cells is escaped."""

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
    ]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt_factor(text: str) -> str:
    return f"{text}x" if text else "uncapped"


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
    return markdown_table(headers, rows)


def goals_markdown(records: Sequence[dict[str, str]]) -> str:
    headers = ("model", "goal", "oversubscription", "value", "target", "met", "gap", "note")
    rows = []
    for r in records:
        value = r["value"]
        if value and r["goal"] == "lms_efficiency":
            value = f"{float(value):.1%}"
        elif value and r["goal"] == "overhead_when_fitting":
            value = f"{float(value):+.2%}"
        elif value:
            value = f"{float(value):.2f}x"
        met = {"yes": "yes", "no": "no", "": "not measured"}[r["met"]]
        factor = _fmt_factor(r["factor"]) if r["factor"] else "-"
        rows.append((r["model"], r["goal"], factor, value, r["target"], met, r["gap"], r["note"]))
    return markdown_table(headers, rows)


def write_csv(
    path: Path, columns: Sequence[str], rows: Sequence[dict[str, str]], env: dict[str, Any]
) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, *ENV_COLUMNS])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **{k: str(env.get(k, "")) for k in ENV_COLUMNS}})


def plot_results(
    rows: Sequence[Measurement], bw: Bandwidth | None, png: Path, title: str
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
        ax.set_xlabel("oversubscription (uncapped peak / cap)")
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
    fig.savefig(png, dpi=110)
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
        "than off."
    )


def measurement_from_record(record: dict[str, Any]) -> Measurement:
    """The Measurement of one record of a run's JSON (``asdict``): keys it does not know are
    ignored, ``profile`` stays a dict."""
    known = {f.name for f in fields(Measurement)}
    try:
        return Measurement(**{k: v for k, v in record.items() if k in known})
    except TypeError as exc:
        raise ValueError(f"measurement {record.get('method', '?')!r}: {exc}") from None


def rescore(path: Path) -> tuple[Path, str, list[Goal]]:
    """Recomputes the goals of the run recorded in ``path`` (a compare-MODEL.json) and
    rewrites compare-MODEL-goals.csv beside it, and the chart (compare-MODEL.png) where
    matplotlib is installed; returns (that CSV, the model, the goals).

    The rooflines are recomputed as the run computed them, from its bandwidths and its
    baseline's time per sample (without a measured baseline the run wrote no goals, and
    neither does this); the goals are evaluated at its factors; the CSV gets the run's
    environment columns. Raises ValueError for a file that is not such a record.
    """
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
    model = str(config.get("model") or (rows[0].model if rows else ""))
    factors = config.get("factors") or sorted({m.factor for m in rows if m.factor is not None})
    goals: list[Goal] = []
    base = _find(rows, "baseline", None)
    if base is not None and base.status == "ok" and base.iteration_s:
        fill_roofline(rows, base.iteration_s / base.batch, bw)
        goals = evaluate_goals(rows, [float(f) for f in factors])
    out = path.with_name(f"{path.stem}-goals.csv")
    write_csv(out, GOAL_COLUMNS, [goal_record(model, g) for g in goals], env)
    if goals:
        # The chart draws the efficiency goal: redrawn with it, titled as the run titled it.
        title = f"{data.get('workload', model)}, batch {data.get('batch', '?')}"
        plot_results(rows, bw, path.with_suffix(".png"), f"{title} — {env.get('device', '')}")
    return out, model, goals


def run_rescore(args: argparse.Namespace) -> int:
    """``--rescore``: rescores a compare-MODEL.json or every one in a folder (with
    ``--model``, only that model's) and prints the goals."""
    target: Path = args.rescore
    paths = sorted(target.glob("compare-*.json")) if target.is_dir() else [target]
    if args.model is not None:
        paths = [p for p in paths if p.name == f"compare-{args.model}.json"]
    if not paths:
        which = f"compare-{args.model}.json" if args.model else "compare-*.json"
        print(f"compare.py: --rescore: no {which} in {target}", file=sys.stderr)
        return 2
    for path in paths:
        try:
            out, model, goals = rescore(path)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compare.py",
        description="Compare Large Model Support with save_on_cpu, activation checkpointing "
        "and no LMS under the same GPU memory caps, against a bandwidth roofline.",
        epilog=goals_help(),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=MODELS, default=None, help="model group (required unless --rescore)"
    )
    parser.add_argument("--out", type=Path, default=Path("out/benchmarks"), help="output folder")
    parser.add_argument(
        "--factors",
        type=parse_factors,
        default=parse_factors("1.5,2,4,8"),
        help="oversubscription factors (cap = uncapped peak / factor)",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="batch B of the uncapped and capped runs (default: per model: "
        "resnet152 8, vit_l 32, gpt 8)",
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
    parser.add_argument("--gpt-layers", type=positive_int, default=24, help="GPT layers")
    parser.add_argument("--gpt-dim", type=positive_int, default=1024, help="GPT width")
    parser.add_argument("--gpt-heads", type=positive_int, default=16, help="GPT attention heads")
    parser.add_argument("--gpt-seq", type=positive_int, default=1024, help="GPT sequence length")
    parser.add_argument("--gpt-vocab", type=positive_int, default=32768, help="GPT vocabulary")
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default=None,
        help="optimizer (default: sgd for resnet152, adamw for vit_l and gpt)",
    )
    parser.add_argument(
        "--amp", action="store_true", help="bf16 autocast (default fp32 with TF32 matmuls)"
    )
    parser.add_argument(
        "--warmup",
        type=nonneg_int,
        default=6,
        help="untimed iterations per measurement (LMS's learned schedule takes a few "
        "iterations to recognize the loop: fewer warm-up iterations time the learning)",
    )
    parser.add_argument(
        "--iterations", type=positive_int, default=5, help="timed iterations per measurement"
    )
    add_limit_share_option(parser, default=None)
    add_lms_tuning_options(parser)
    parser.add_argument(
        "--methods",
        type=parse_methods,
        default=PEER_METHODS,
        help="methods measured under each cap (comma-separated; split a run across calls "
        "with it): " + ", ".join(PEER_METHODS),
    )
    parser.add_argument(
        "--overhead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure LMS on with everything fitting, and LMS off again (lms_fits, "
        "baseline_repeat); calls that split a run measure it once",
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
        default=True,
        help="search the largest trainable batches",
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
        help="pinned host memory LMS may use: bounds the LMS batch search",
    )
    parser.add_argument(
        "--time-budget-s",
        type=positive_float,
        default=500.0,
        help="stop starting measurements after this long (what is left is reported as skipped)",
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        default=None,
        metavar="PATH",
        help="no GPU, no measurement: recompute the goals of the runs recorded in PATH (a "
        "compare-MODEL.json, or a folder of them; with --model only that model's) with this "
        "version's goals, rewrite each one's compare-MODEL-goals.csv and compare-MODEL.png "
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
    """Checks across arguments; raises ValueError with the problem."""
    if args.model is None and args.rescore is None:
        raise ValueError("--model is required (except with --rescore)")
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
    import models

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


def lms_settings(args: argparse.Namespace, cap: int | None, schedule: bool = True) -> LmsSettings:
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
    )


# ---------------------------------------------------------------------------------------
# GPU work
# ---------------------------------------------------------------------------------------


class Deadline:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._end = clock() + seconds

    def left(self) -> float:
        return self._end - self._clock()


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
    out-of-memory or other training errors: they become the row's status)."""
    import models
    import torch
    from _lms_setup import apply_lms, is_oom, lms_stats, memory_cap, settle

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
    model: Any = None
    optimizer: Any = None
    retries_left = args.oom_retries if lms is not None else 0
    settle()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        with memory_cap(m.cap_bytes):
            if lms is not None:
                apply_lms(lms)
            with device:
                model = workload.build()
            if m.method == "checkpoint":
                workload.checkpoint(model)
            model.train()
            optimizer = workload.make_optimizer(model, args.optimizer)
            before: dict[str, Any] | None = None
            allocator_before: dict[str, Any] = {}

            def one_step(step: int) -> None:
                inputs, targets = workload.make_batch(m.batch, device, step)
                if counter is not None:
                    ctx = counter.context()
                elif offload is not None:
                    ctx = offload()
                else:
                    ctx = contextlib.nullcontext()
                with ctx, amp:
                    loss = workload.loss(model(inputs), targets)
                loss.backward()
                del inputs, targets, loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()

            step = 0
            while step < warmup + iterations:
                if step == warmup:
                    torch.cuda.synchronize()
                    before = lms_stats()
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
                if step == 0:
                    m.static_bytes = torch.cuda.memory_allocated() - base
                if step >= warmup:
                    m.iteration_times.append(time.perf_counter() - start)
                step += 1
            after = lms_stats()
            allocator_after = torch.cuda.memory_stats()
            m.peak_allocated_bytes = torch.cuda.max_memory_allocated() - base
            if args.profile_iterations and m.method in PROFILED_METHODS:
                try:
                    m.profile = profile_steps(one_step, step, args.profile_iterations, log)
                except Exception as exc:  # the row's figures stand without a profile
                    log(f"      profile failed: {type(exc).__name__}: {exc}")
        if lms is not None and before is not None and after is not None:
            m.out_bytes_per_iter = (after["pageout_bytes"] - before["pageout_bytes"]) / iterations
            m.in_bytes_per_iter = (after["pagein_bytes"] - before["pagein_bytes"]) / iterations
            m.stall_ms_per_iter = (after["stall_ms"] - before["stall_ms"]) / iterations
            ahead_gib = (
                (after.get("peak_pageout_bytes", 0) - before.get("peak_pageout_bytes", 0))
                / iterations
                / GiB
            )
            m.lms_schedule = (
                f"period {after['schedule_period']}, "
                f"{after['schedule_fallbacks']} fallbacks, "
                f"{(after['pagein_demand_count'] - before['pagein_demand_count']) / iterations:g}"
                " demand page-ins/iter"
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
                    f"inactive, {after.get('schedule_fallbacks', 0)} fallbacks"
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
        if m.status == "error":
            log(traceback.format_exc())
        m.iteration_times.clear()
    finally:
        model = optimizer = None
        settle()
        if lms is not None:
            apply_lms(LmsSettings(enabled=False))
            settle()
        # Rows share a process: memory a row leaves allocated (seen after a failed row)
        # shrinks every later row's room under its cap. Say so where it happens.
        left = torch.cuda.memory_allocated() - base
        if left > MiB:
            note = f"left {left / MiB:.0f} MiB allocated after the row (later rows have less room)"
            m.detail = f"{m.detail}; {note}" if m.detail else note
            log(f"    {note}")
    return m


def profile_steps(
    one_step: Callable[[int], None], first: int, iterations: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Runs ``iterations`` more training steps under ``torch.profiler`` (CPU and CUDA
    activity) and returns their stream breakdown (see stream_profile.py)."""
    import tempfile

    import torch
    from stream_profile import analyze

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
        log(f"      profile: {line}")
    return breakdown.record()


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
    if m.peak_allocated_bytes is not None:
        parts.append(f"peak {m.peak_allocated_bytes / GiB:.2f} GiB")
    if m.oom_retries:
        parts.append(f"{m.oom_retries} OOM retries")
    return ", ".join(parts)


def run_probe(args: argparse.Namespace) -> int:
    """One search probe: trains ``--probe-iterations`` steps; exit 0 or EXIT_OOM."""
    from _lms_setup import ensure_lms_api

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

    probe = subprocess_probe(command, timeout_s=args.probe_timeout_s, log=log)
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


def run_benchmark(args: argparse.Namespace) -> int:
    import signal

    import torch
    from _lms_setup import LmsUnavailable, ensure_lms_api, environment

    if not torch.cuda.is_available():
        print("compare.py: no CUDA device: the benchmark needs a GPU", file=sys.stderr)
        return 2
    deadline = Deadline(args.time_budget_s)
    try:
        backend = ensure_lms_api()
        lms_reason = ""
    except LmsUnavailable as exc:
        backend, lms_reason = "", str(exc)
    if not args.amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    workload = make_workload(args)
    batch = args.batch or workload.default_batch
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"compare-{args.model}"
    print(
        f"== {workload.description}, batch {batch}, on {env.get('device')} "
        f"(torch {env['torch']}, CUDA {env['cuda']}, LMS: {backend or 'unavailable'})"
    )

    print("== pinned copy bandwidth")
    bw = measure_bandwidth(args.bandwidth_mib * MiB)
    print(
        f"   D2H {bw.d2h / 1e9:.1f} GB/s, H2D {bw.h2d / 1e9:.1f} GB/s, "
        f"both directions {bw.bidirectional / 1e9:.1f} GB/s"
    )

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
    ) -> Measurement:
        m = Measurement(args.model, method, factor, cap, b)
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
                if method in ("lms", "lms_reactive"):
                    settings = lms_settings(args, caps[f], schedule=method == "lms")
                    row = measure(method, f, caps[f], batch, settings)
                else:
                    row = measure(method, f, caps[f], batch, None)
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
) -> None:
    """Writes the CSVs and the JSON (every time: a run stopped early keeps what it measured);
    the PNG and the printed tables only when ``final``."""
    out: Path = args.out
    records = [measurement_record(m) for m in rows]
    goal_records = [goal_record(args.model, g) for g in goals]
    write_csv(out / f"{stem}.csv", MEASUREMENT_COLUMNS, records, env)
    write_csv(out / f"{stem}-goals.csv", GOAL_COLUMNS, goal_records, env)
    config = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if not k.startswith("probe_")
    }
    (out / f"{stem}.json").write_text(
        json.dumps(
            {
                "environment": env,
                "workload": description,
                "batch": batch,
                "config": config,
                "bandwidth_bytes_per_s": asdict(bw),
                "measurements": [asdict(m) for m in rows],
                "goals": [asdict(g) for g in goals],
                "searches": searches,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    if not final:
        return
    png = plot_results(
        rows, bw, out / f"{stem}.png", f"{description}, batch {batch} — {env.get('device', '')}"
    )
    print("\n" + measurements_markdown(records))
    if goal_records:
        print("\n" + goals_markdown(goal_records))
    print(
        f"\nwrote {out / (stem + '.csv')}, {out / (stem + '-goals.csv')}, "
        f"{out / (stem + '.json')}" + (f", {png}" if png else " (no PNG: matplotlib missing)")
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rescore is not None:
        return run_rescore(args)
    if args.probe_batch is not None:
        return run_probe(args)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
