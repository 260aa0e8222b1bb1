#!/usr/bin/env python3
"""The speed table: LMS against checkpointing and PyTorch's own answers, per model, with no cap
(a need of 1.25x, 1.5x, 2x and 4x the device) and under caps (1/1.5, 1/2 and 1/4 of the
uncapped peak), each row with its warm-up iterations, its steady-state median and the
in-memory figure.

    speed.py plan [selection]         the cells a run would measure, each with its estimated
                                      time (from committed H200 results), and the total
    speed.py run --out DIR [selection]   run them: one benchmarks/compare.py call per model and
                                      regime (results under DIR/REGIME/MODEL/), each given its
                                      share of --budget-s; then DIR/speed-table.md
    speed.py table DIR... [--readme FILE [--check]]   the table of the compare-MODEL.json and
                                      nocap-MODEL.json files under the DIRs merged (a later
                                      DIR's cell replaces an earlier one's); with --readme,
                                      the section between the speed-table markers

The selection (``--models``, ``--regimes``, ``--nocap-factors``, ``--capped-factors``,
``--methods``) runs a subset, so that one table can be measured in several calls and merged.
The methods are compare.py's: ``lms`` (LMS's defaults), ``lms_paging`` (recompute off),
``lms_hybrid`` (recompute on), ``checkpoint`` (``torch.utils.checkpoint`` per block),
``compile_budget`` (``torch.compile`` under ``activation_memory_budget``) and ``offload``
(torchtune's ``OffloadActivations``, or the same mechanism where torchtune is not installed).

Per row of the table: each method's steady-state median (of the timed iterations after the
warm-up; at least MIN_STEADY_ITERATIONS of them for a figure that counts, fewer are marked),
its ratio to checkpointing's (per sample), its throughput as a share of the in-memory one, and
the warm-up iterations' own times (iteration 0, 1, ...); and the row's in-memory figure (the
time per sample of the largest batch of the run that fits, LMS off, times the row's batch).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import compare
from benchmarks.provenance import checkout_engine_sha256, engine_lines, short_device, shown
from benchmarks.sections import update
from lmsbench.harness import markdown_table
from lmsbench.lms_setup import GiB, nonneg_int, positive_float, positive_int

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = compare.MODELS
REGIMES = ("nocap", "capped")
# The table's columns, in its order.
METHODS = (
    "lms",
    "lms_residual",
    "lms_hybrid",
    "lms_paging",
    "checkpoint",
    "compile_budget",
    "offload",
)
# The order a call measures a factor's methods in (compare.py runs factor by factor: under a
# cap always, with no cap by --row-order factors; each factor's --methods in the order given),
# where its time runs out the last rows are the ones skipped. Checkpointing, the yardstick of
# every ratio, is short; then LMS's hybrid and default, what the goals judge.
# The methods a run measures unless told: all but those only --methods names (lms_residual,
# residual recipes on, which are off by default).
DEFAULT_METHODS = tuple(m for m in METHODS if m not in compare.RESIDUAL_METHODS)
MEASURE_ORDER = (
    "checkpoint",
    "lms_hybrid",
    "lms",
    "lms_residual",
    "lms_paging",
    "offload",
    "compile_budget",
)
NOCAP_FACTORS = (1.25, 1.5, 2.0, 4.0)
CAPPED_FACTORS = (1.5, 2.0, 4.0)
DEFAULT_WARMUP = 3
DEFAULT_ITERATIONS = 10
# A steady-state median of fewer timed iterations is marked in the table.
MIN_STEADY_ITERATIONS = 10
# compare.py options every call of a run gets (bf16 autocast, as the committed H200 results
# the estimates come from were run; --speed-args replaces them).
DEFAULT_COMPARE_ARGS = ("--amp",)
# compare.py options of one model's calls, before --speed-args (which may override them):
# ResNet-152's batch 64 (compare.py's default is 8), the capped batch and the first fitting
# batch of the reference runs.
MODEL_ARGS: dict[str, tuple[str, ...]] = {"resnet152": ("--batch", "64")}
SHORT_NAMES = {"resnet152": "ResNet-152", "vit_l": "ViT-L", "gpt": "GPT"}
METHOD_LABELS = {
    "lms": "LMS default",
    "lms_residual": "LMS default, residual recipes on",
    "lms_paging": "LMS paging only",
    "lms_hybrid": "LMS hybrid (recompute on)",
    "checkpoint": "checkpointing (per block)",
    "compile_budget": "torch.compile activation_memory_budget",
    "offload": "offloading (torchtune-style)",
}
# Methods measured apart from the factor rows that give the in-memory figure: LMS off,
# uncapped, at batches that fit.
FIT_METHODS = ("baseline", "baseline_fit", "baseline_repeat")

# ---------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------


def parse_list(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    """Comma-separated names, each one of ``allowed``, in the order ``allowed`` has them."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(allowed))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{what} must be some of {', '.join(allowed)}, got {text!r}"
        )
    return tuple(n for n in allowed if n in names)


def parse_factor_list(text: str) -> tuple[float, ...]:
    """Comma-separated factors > 1 (``1.5`` or ``1/1.5``: a cap of 1/1.5 of the peak is the
    factor 1.5), sorted; empty text: none."""
    factors: set[float] = set()
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            value = float(item.removeprefix("1/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a factor: {item!r} in {text!r}") from None
        if not math.isfinite(value) or value <= 1:
            raise argparse.ArgumentTypeError(f"factors must be > 1, got {item!r}")
        factors.add(value)
    return tuple(sorted(factors))


@dataclass(frozen=True)
class Group:
    """One compare.py call: a model in a regime, its factors and methods."""

    model: str
    regime: str
    factors: tuple[float, ...]
    methods: tuple[str, ...]

    @property
    def folder(self) -> str:
        return f"{self.regime}/{self.model}"

    def argv(
        self,
        out: Path,
        warmup: int,
        iterations: int,
        budget_s: float,
        extra: Sequence[str],
        host_gib: float | None = None,
    ) -> list[str]:
        """compare.py's arguments for this group; ``host_gib``: its --host-budget-gib (no
        cap), the host's available memory, so that the host alone bounds a row."""
        argv = [
            "--model",
            self.model,
            "--regime",
            self.regime,
            "--factors",
            ",".join(f"{f:g}" for f in self.factors),
            "--methods",
            ",".join(self.methods),
            "--warmup",
            str(warmup),
            "--iterations",
            str(iterations),
            "--out",
            str(out / self.folder),
            "--time-budget-s",
            f"{budget_s:.0f}",
        ]
        if self.regime == "capped":
            argv += ["--no-search", "--no-overhead"]
        else:
            argv += ["--row-order", "factors", "--prior-slowdown", f"{NOCAP_PRIOR_SLOWDOWN:g}"]
            if host_gib is not None:
                argv += ["--host-budget-gib", f"{max(host_gib, 1.0):.0f}"]
        return [*argv, *MODEL_ARGS.get(self.model, ()), *extra]


def plan_groups(
    models: Sequence[str],
    regimes: Sequence[str],
    nocap_factors: Sequence[float],
    capped_factors: Sequence[float],
    methods: Sequence[str],
) -> list[Group]:
    """The compare.py calls of a selection: the capped ones first (small batches, short), then
    the no-cap ones, each in model order; a regime without factors has none."""
    groups = []
    for regime in ("capped", "nocap"):
        factors = tuple(capped_factors if regime == "capped" else nocap_factors)
        if regime not in regimes or not factors:
            continue
        ordered = tuple(m for m in MEASURE_ORDER if m in methods)
        groups += [Group(m, regime, factors, ordered) for m in models]
    return groups


# ---------------------------------------------------------------------------------------
# Time estimates, from a committed run of the same models on an H200
# ---------------------------------------------------------------------------------------

# H200 runs of compare.py in both regimes, each model under MODEL/ (capped at 1.5, 2 and 4
# with lms, lms_hybrid, checkpoint and offload, 6 + 5 iterations; no cap at 1.5x with
# 4 + 3): what each cell's estimate is scaled from.
REFERENCE_RUN = HERE / "results" / "recompute" / "2026-11-26-h200x4-b9b7a65"
# Each method's reference row: lms there ran with recompute off (paging only), the default
# of its engine; LMS's default now recomputes, as lms_hybrid did; compile_budget recomputes
# as checkpointing does, after compiling.
REFERENCE_METHOD = {
    "lms": "lms_hybrid",
    "lms_residual": "lms_hybrid",
    "lms_paging": "lms",
    "lms_hybrid": "lms_hybrid",
    "checkpoint": "checkpoint",
    "compile_budget": "checkpoint",
    "offload": "offload",
}
# Slowdowns over the in-memory time where the reference has no row of the method (offload
# skipped for host memory with no cap): the capped run's ResNet-152 offload row, about 8.5x.
PRIOR_SLOWDOWN = {"offload": 8.5}
# Fixed costs: a compare.py call (start, CUDA context, bandwidth, the LMS-off baselines: the
# no-cap regime's two, and its saved-tensor count where offload is measured) and a row
# (building the model, settling, cleaning up), as the reference's rows measured them.
# The no-cap call's setup as measured on an H200 (speed/2026-11-28-h200x2-0d8a624/speed-resnet-b:
# bandwidth, the baseline at batch 64 and the fitting run at batch 219 took about 40 s).
CALL_SETUP_S = {"capped": 15.0, "nocap": 40.0}
ROW_SETUP_S = compare.ROW_SETUP_S
# compare.py's no-cap row gate (--prior-slowdown): a row starts where its own estimate times
# this fits in the call's time. Its default (2) guards a run planned by nobody; a call of this
# plan has a share sized to the rows already, and with 2 the first LMS row of a share would
# rarely start. With 1.25 the ResNet-152 hybrid row at 1.5x was skipped as needing 95 s with
# 79 s left, and the whole call then ended after 67 s (speed/2026-11-28-h200x2-0d8a624/
# speed-resnet-b): the estimate alone, without a margin, gates the row.
NOCAP_PRIOR_SLOWDOWN = 1.0
# What a call may run past its share before it is stopped (compare.py saves on SIGTERM).
CALL_GRACE_S = 30.0
# A row that runs out of memory at the reference ends after about one step.
OOM_ROW_S = 15.0


@dataclass
class ReferenceRow:
    steady_s: float  # median of the timed iterations
    warmup_s: list[float]  # the warm-up iterations' times, iteration 0 first
    batch: int
    status: str = "ok"


@dataclass
class Reference:
    """One model's reference in one regime."""

    per_sample_s: float  # in-memory time per sample (LMS off, a batch that fits)
    rows: dict[tuple[str, float], ReferenceRow] = field(default_factory=dict)
    # No cap: the memory model and the device limit, for the batch at each factor.
    memory_model: compare.MemoryModel | None = None
    limit_bytes: int | None = None
    batch: int = 0  # capped: the run's batch
    saved_per_sample: float | None = None  # no cap: bytes autograd saves per sample


def _fit_per_sample(measurements: Sequence[dict[str, Any]]) -> float | None:
    """Time per sample of the largest fitting LMS-off batch measured uncapped."""
    fits = [
        m
        for m in measurements
        if m.get("method") in FIT_METHODS
        and m.get("factor") is None
        and m.get("status") == "ok"
        and m.get("iteration_s")
        and m.get("batch")
    ]
    if not fits:
        return None
    best = max(fits, key=lambda m: int(m["batch"]))
    return float(best["iteration_s"]) / int(best["batch"])


def reference_from_run(run: dict[str, Any]) -> Reference | None:
    """The Reference of one compare.py JSON record, None where it has no fitting run."""
    measurements = run.get("measurements", [])
    per_sample = _fit_per_sample(measurements)
    if per_sample is None:
        return None
    ref = Reference(per_sample_s=per_sample, batch=int(run.get("batch") or 0))
    mm = run.get("memory_model")
    if mm:
        ref.memory_model = compare.MemoryModel(
            float(mm["intercept_bytes"]), float(mm["per_sample_bytes"]), str(mm["source"]), ()
        )
        ref.limit_bytes = int((run.get("device_memory") or {}).get("limit_bytes") or 0) or None
        saved = run.get("saved_bytes_per_sample")
        ref.saved_per_sample = float(saved) if saved else None
    for m in measurements:
        if m.get("factor") is None or m.get("status") not in ("ok", "oom"):
            continue
        steady = float(m["iteration_s"]) if m.get("iteration_s") else 0.0
        ref.rows[(str(m["method"]), float(m["factor"]))] = ReferenceRow(
            steady, [float(x) for x in m.get("warmup_times") or []], int(m["batch"]), m["status"]
        )
    return ref


def load_references(folder: Path = REFERENCE_RUN) -> dict[tuple[str, str], Reference]:
    """(model, regime) -> Reference of every compare-MODEL.json and nocap-MODEL.json under
    ``folder``."""
    refs: dict[tuple[str, str], Reference] = {}
    for path in sorted(folder.rglob("*.json")):
        if not path.name.startswith(("compare-", "nocap-")):
            continue
        run = json.loads(path.read_text())
        ref = reference_from_run(run)
        if ref is not None:
            refs[(str(run["config"]["model"]), str(run.get("regime") or "capped"))] = ref
    return refs


def cell_batch(ref: Reference, regime: str, factor: float) -> int | None:
    """The batch of a cell: the run's batch under a cap; with no cap, the batch whose need
    is ``factor`` x the reference's device limit (compare.nocap_plan)."""
    if regime == "capped":
        return ref.batch
    if ref.memory_model is None or ref.limit_bytes is None:
        return None
    try:
        return compare.nocap_plan(ref.memory_model, ref.limit_bytes, factor).batch
    except ValueError:
        return None


def _nearest(ref: Reference, method: str, factor: float) -> tuple[float, ReferenceRow] | None:
    rows = [(f, r) for (m, f), r in ref.rows.items() if m == method]
    if not rows:
        return None
    return min(rows, key=lambda fr: (abs(math.log(fr[0] / factor)), fr[0]))


def estimate_cell(
    ref: Reference, regime: str, factor: float, method: str, warmup: int, iterations: int
) -> float:
    """Seconds a cell is expected to take: ROW_SETUP_S, then ``warmup`` + ``iterations``
    steps at the steady time, plus what the reference's first ``warmup`` iterations took over
    its steady time (LMS's first step pins its host memory and the schedule settles).

    The steady time is the reference row's slowdown over the in-memory time (at the nearest
    factor it measured) times the in-memory time at this cell's batch; with no cap, a
    moving method's (LMS, offload) slowdown over 1 grows as the square root of the deficit
    ((factor - 1) over the reference's), as the committed H100 no-cap rows of LMS at 1.5x and
    2x (results/nocap/2026-11-25-h100-cb6b81b) do within 10%, and its warm-up excess with
    the steady time. A method the reference lacks gets
    PRIOR_SLOWDOWN (or checkpointing's); compile_budget takes checkpointing's steps at the
    nearest factor where it trained (its budget fits caps checkpointing does not) and adds
    compare.COMPILE_ESTIMATE_S."""
    batch = cell_batch(ref, regime, factor)
    if batch is None:
        return OOM_ROW_S
    source = REFERENCE_METHOD.get(method, method)
    compiled = method in compare.COMPILE_BUDGET_METHODS
    if compiled:
        # Its own budget fits the cap where checkpointing does not: the nearest factor at
        # which checkpointing trained stands for its steps.
        trained = [(f, r) for (m, f), r in ref.rows.items() if m == source and r.status == "ok"]
        found = min(trained, key=lambda fr: abs(math.log(fr[0] / factor)), default=None)
    else:
        found = _nearest(ref, source, factor)
    if found is not None and found[1].status == "oom" and regime == "capped" and found[0] <= factor:
        return OOM_ROW_S  # out of memory at a larger cap: out of memory here too, at once
    ok = found is not None and found[1].status == "ok" and found[1].steady_s > 0
    if ok:
        assert found is not None
        f0, row = found
        slowdown = row.steady_s / (ref.per_sample_s * row.batch)
        excess = sum(max(0.0, w - row.steady_s) for w in row.warmup_s[:warmup])
        if regime == "nocap" and source not in ("checkpoint",) and f0 != factor:
            slowdown = 1 + (slowdown - 1) * math.sqrt((factor - 1) / (f0 - 1))
        steady = slowdown * ref.per_sample_s * batch
        excess *= steady / row.steady_s
    else:
        prior = PRIOR_SLOWDOWN.get(source)
        ckpt = _nearest(ref, "checkpoint", factor)
        if prior is None and ckpt is not None and ckpt[1].status == "ok":
            prior = ckpt[1].steady_s / (ref.per_sample_s * ckpt[1].batch)
        steady = (prior or compare.CHECKPOINT_RECOMPUTE) * ref.per_sample_s * batch
        excess = 0.0
    compiling = compare.COMPILE_ESTIMATE_S if compiled else 0.0
    return ROW_SETUP_S + compiling + excess + (warmup + iterations) * steady


def cell_host_bytes(ref: Reference, regime: str, factor: float, method: str) -> int:
    """The pinned host memory compare.py expects a no-cap cell to need
    (compare.nocap_host_bytes: LMS about the deficit, offload every saved tensor); 0 under a
    cap, where compare.py checks none."""
    if regime != "nocap" or ref.memory_model is None or ref.limit_bytes is None:
        return 0
    try:
        plan = compare.nocap_plan(ref.memory_model, ref.limit_bytes, factor)
    except ValueError:
        return 0
    return compare.nocap_host_bytes(
        method, plan, ref.memory_model.per_sample_bytes, ref.saved_per_sample
    )


# A cell compare.py skips at once (its host memory does not fit): seconds.
SKIPPED_ROW_S = 1.0


@dataclass(frozen=True)
class CellPlan:
    group: Group
    factor: float
    method: str
    batch: int | None
    estimate_s: float
    note: str = ""  # why compare.py is expected to skip it


def plan_cells(
    groups: Sequence[Group],
    refs: dict[tuple[str, str], Reference],
    warmup: int,
    iterations: int,
    host_room_bytes: int | None = None,
) -> list[CellPlan]:
    """Each cell of ``groups`` with its estimate. ``host_room_bytes``: the pinned host memory
    a no-cap row may take (compare.py's --host-budget-gib and the host's available memory less
    compare.HOST_MARGIN_BYTES); a cell expected to need more is skipped by compare.py at once,
    and planned so."""
    cells = []
    for g in groups:
        ref = refs.get((g.model, g.regime))
        # Factor by factor, as compare.py runs them (capped always, no cap with --row-order).
        for f in g.factors:
            for method in g.methods:
                if ref is None:
                    cells.append(CellPlan(g, f, method, None, math.nan))
                    continue
                batch = cell_batch(ref, g.regime, f)
                host = cell_host_bytes(ref, g.regime, f, method)
                if host_room_bytes is not None and host > host_room_bytes:
                    note = (
                        f"skipped: needs about {host / GiB:.0f} GiB of pinned host memory, "
                        f"{max(host_room_bytes, 0) / GiB:.0f} GiB room"
                    )
                    cells.append(CellPlan(g, f, method, batch, SKIPPED_ROW_S, note))
                    continue
                est = estimate_cell(ref, g.regime, f, method, warmup, iterations)
                cells.append(CellPlan(g, f, method, batch, est))
    return cells


def host_room(host_gib: float) -> int:
    """The pinned host memory a no-cap row may take on a host with ``host_gib`` available,
    as compare.py counts it."""
    return int(host_gib * GiB) - compare.HOST_MARGIN_BYTES


def available_host_gib() -> float | None:
    """This machine's available memory in GiB (MemAvailable), None where unknown."""
    found = compare.host_available_bytes()
    return None if found is None else found / GiB


def group_estimate(group: Group, cells: Sequence[CellPlan]) -> float:
    """CALL_SETUP_S plus the group's cells (a cell without a reference: 60 s)."""
    own = [c.estimate_s for c in cells if c.group == group]
    return CALL_SETUP_S[group.regime] + sum(60.0 if math.isnan(e) else e for e in own)


def plan_text(
    groups: Sequence[Group], cells: Sequence[CellPlan], budget_s: float, host_gib: float | None
) -> str:
    """The dry run: the host memory it plans with, each call with its cells and their
    estimates, the calls' shares and the total."""
    lines = [
        "host memory available for no-cap rows: "
        + ("unknown (not checked)" if host_gib is None else f"{host_gib:.0f} GiB")
    ]
    total = 0.0
    for g in groups:
        est = group_estimate(g, cells)
        total += est
        lines.append(f"{g.folder}: about {est:.0f} s (call setup {CALL_SETUP_S[g.regime]:.0f} s)")
        for c in (c for c in cells if c.group == g):
            label = compare_label(g.regime, c.factor)
            shown = "no reference" if math.isnan(c.estimate_s) else f"{c.estimate_s:.0f} s"
            batch = "" if c.batch is None else f", batch {c.batch}"
            note = f" ({c.note})" if c.note else ""
            lines.append(f"  {label:<24} {c.method:<15} {shown}{batch}{note}")
    verdict = (
        "fits"
        if total <= budget_s
        else "does not fit: each call gets its share (shares), and compare.py skips the rows "
        "that do not fit in it, its last rows first ('time budget')"
    )
    given = shares([group_estimate(g, cells) for g in groups], budget_s)
    lines.append(
        "shares: " + ", ".join(f"{g.folder} {s:.0f} s" for g, s in zip(groups, given, strict=True))
    )
    lines.append(f"total about {total:.0f} s for a budget of {budget_s:.0f} s: {verdict}")
    return "\n".join(lines)


# A call is given up to this much more than its estimate.
SHARE_MARGIN = 1.25


def shares(estimates: Sequence[float], budget_s: float) -> list[float]:
    """Each call's time budget out of ``budget_s``, max-min fair: a call whose need
    (SHARE_MARGIN x its estimate) is below an equal share of what is left gets its need; the
    others split the rest equally. So the short calls all run whole, and the long ones lose
    their last rows."""
    need = [SHARE_MARGIN * max(0.0, e) for e in estimates]
    given = [0.0] * len(need)
    left = max(0.0, budget_s)
    pending = list(range(len(need)))
    while pending:
        fair = left / len(pending)
        small = [i for i in pending if need[i] <= fair]
        if not small:
            for i in pending:
                given[i] = fair
            break
        for i in small:
            given[i] = need[i]
            left -= need[i]
            pending.remove(i)
    return given


# ---------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------


def compare_label(regime: str, factor: float) -> str:
    if regime == "nocap":
        return f"no cap, need {factor:g}x device"
    return f"cap 1/{factor:g} of the peak"


def steady_median(times: Sequence[float]) -> float | None:
    """The steady-state figure: the median of the timed iterations (None without any)."""
    return statistics.median(times) if times else None


def warmup_times(row: dict[str, Any]) -> list[float]:
    """A row's warm-up iterations' times, iteration 0 first; a record written before
    compare.py kept them has its first step's alone."""
    times = [float(x) for x in row.get("warmup_times") or []]
    if not times and row.get("first_iteration_s") is not None:
        times = [float(row["first_iteration_s"])]
    return times


@dataclass
class Run:
    """One compare.py record (a model in a regime) and where it came from."""

    folder: Path
    shown: str
    record: dict[str, Any]

    @property
    def model(self) -> str:
        return str(self.record["config"]["model"])

    @property
    def regime(self) -> str:
        return str(self.record.get("regime") or "capped")


def load_runs(folders: Sequence[Path], shown: Callable[[Path], str]) -> list[Run]:
    """Every compare-MODEL.json and nocap-MODEL.json under ``folders``, in the order given
    (a folder's files in path order)."""
    runs = []
    for folder in folders:
        for path in sorted(folder.rglob("*.json")):
            if path.name.startswith(("compare-", "nocap-")) and not path.name.endswith(
                "-goals.json"
            ):
                runs.append(Run(folder, shown(folder), json.loads(path.read_text())))
    return runs


@dataclass
class Cell:
    """A method's row at one factor, and the run it came from."""

    row: dict[str, Any]
    run: Run


@dataclass(frozen=True, order=True)
class RowKey:
    """What makes a row of the table: the cells of one row share their GPU, model, regime,
    factor and batch (no-cap batches follow the memory free when each run started: runs that
    got other batches make rows of their own)."""

    model_rank: int
    model: str
    regime_rank: int
    regime: str
    factor: float
    batch: int
    device: str


def row_key(run: Run, row: dict[str, Any]) -> RowKey:

    model, regime = run.model, run.regime
    return RowKey(
        MODELS.index(model) if model in MODELS else len(MODELS),
        model,
        REGIMES.index(regime) if regime in REGIMES else len(REGIMES),
        regime,
        float(row["factor"]),
        int(row.get("batch") or 0),
        short_device(run.record.get("environment", {}).get("device")),
    )


# No-cap batches of two calls this close (relative) make one row: the memory free at the
# start of each call differed by a little (the cells say their own batch, and the ratios are
# of times per sample).
BATCH_TOLERANCE = 0.02


def _same_row(a: RowKey, b: RowKey) -> bool:
    if (a.device, a.model, a.regime, a.factor) != (b.device, b.model, b.regime, b.factor):
        return False
    if not a.batch or not b.batch:
        return a.batch == b.batch
    return abs(a.batch - b.batch) <= BATCH_TOLERANCE * min(a.batch, b.batch)


def merge_cells(runs: Sequence[Run]) -> dict[RowKey, dict[str, Cell]]:
    """RowKey -> method -> its cell, over ``runs`` in order: a later run's cell of the same
    method replaces an earlier one's, except that a cell that was not measured (skipped)
    never replaces one that was; a cell whose batch is within BATCH_TOLERANCE of a row's joins
    that row. A row skipped before it had a batch (batch 0) is left out where the same GPU,
    model, regime and factor has a row with a batch."""
    cells: dict[RowKey, dict[str, Cell]] = {}
    for run in runs:
        for m in run.record.get("measurements", []):
            if m.get("factor") is None or m.get("method") not in METHODS:
                continue
            key = row_key(run, m)
            key = next((k for k in cells if _same_row(k, key)), key)
            methods = cells.setdefault(key, {})
            old = methods.get(str(m["method"]))
            if (
                old is not None
                and m.get("status") == "skipped"
                and old.row.get("status") != "skipped"
            ):
                continue
            methods[str(m["method"])] = Cell(m, run)
    batched = {(k.device, k.model, k.regime, k.factor) for k in cells if k.batch}
    return {
        k: v
        for k, v in cells.items()
        if k.batch or (k.device, k.model, k.regime, k.factor) not in batched
    }


def in_memory_s(run: Run, batch: int) -> float | None:
    """The in-memory figure of a row of ``run`` at ``batch``: the time per sample of the
    run's largest fitting LMS-off batch, times ``batch``."""
    per_sample = _fit_per_sample(run.record.get("measurements", []))
    return None if per_sample is None else per_sample * batch


def _seconds(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


# compare.py's detail of an offload row where torchtune was not installed.
STREAM_OFFLOAD_DETAIL = "baseline: models.StreamOffload"


def cell_text(
    row: dict[str, Any] | None,
    ckpt: dict[str, Any] | None,
    row_batch: int | None = None,
    in_memory_per_sample_s: float | None = None,
) -> str:
    """A method's cell: its steady median (s/iter, marked where of fewer than
    MIN_STEADY_ITERATIONS), its ratio to checkpointing's, its throughput as a share of the
    in-memory one (``in_memory_per_sample_s``), its warm-up iterations (with, for LMS rows that
    have it, iteration 0's pinning, stalls and allocator retries), its own batch where it
    is not the row's ``row_batch``; or why it has none."""
    if row is None:
        return "not measured"
    status = row.get("status")
    if status == "oom":
        return "out of memory"
    if status in ("running", "stopped"):
        return "stopped during the row"
    if status != "ok":
        detail = str(row.get("detail") or status).removeprefix("not run: ")
        return f"not run: {detail[:120]}"
    times = [float(x) for x in row.get("iteration_times") or []]
    median = _median_of(row)
    assert median is not None
    parts = [f"**{_seconds(median)}**"]
    if len(times) < MIN_STEADY_ITERATIONS:
        parts[0] += f" (median of {len(times)})"
    ratio = _ratio(row, ckpt)
    if ratio is not None and row is not ckpt:
        parts.append(f"{ratio:.2f}x ckpt")
    batch = int(row.get("batch") or 0)
    if in_memory_per_sample_s and batch:
        parts.append(f"{in_memory_per_sample_s * batch / median:.0%} of in-memory")
    warm = warmup_times(row)
    if warm:
        parts.append("warm-up " + ", ".join(_seconds(w) for w in warm))
    first = row.get("first_iteration")
    if first:
        parts.append(
            f"iteration 0 pinned host memory {float(first['host_pin_ms']):.0f} ms, "
            f"stalled {float(first['stall_ms']):.0f} ms, "
            f"{float(first['allocator_retries']):.0f} allocator retries"
        )
    if row.get("recompute_on") is not None and row.get("method") in ("lms", "lms_residual"):
        parts.append(f"recompute {'on' if row['recompute_on'] else 'off'}")
    if row.get("activation_budget") is not None:
        parts.append(f"budget {float(row['activation_budget']):g}")
    if row_batch and int(row.get("batch") or 0) != row_batch:
        parts.append(f"batch {row['batch']}")
    if str(row.get("detail") or "").startswith(STREAM_OFFLOAD_DETAIL):
        parts.append("torchtune's mechanism written here (torchtune not installed)")
    return "; ".join(parts)


def _median_of(row: dict[str, Any] | None) -> float | None:
    """A measured row's steady-state median: of its timed iterations where it kept them,
    else the median it recorded."""
    if row is None or row.get("status") != "ok":
        return None
    median = steady_median([float(x) for x in row.get("iteration_times") or []])
    if median is None and row.get("iteration_s") is not None:
        median = float(row["iteration_s"])
    return median


def _ratio(row: dict[str, Any] | None, ckpt: dict[str, Any] | None) -> float | None:
    """``row``'s time per sample over checkpointing's (the batches of one row may differ a
    little: BATCH_TOLERANCE)."""
    a, b = _median_of(row), _median_of(ckpt)
    if a is None or b is None or b <= 0 or row is None or ckpt is None:
        return None
    return (a / int(row.get("batch") or 1)) / (b / int(ckpt.get("batch") or 1))


def speed_table(runs: Sequence[Run], methods: Sequence[str] = METHODS) -> str:
    """The table: a row per GPU, model, regime, factor and batch (RowKey), a column per method
    of ``methods`` that any run measured."""
    cells = merge_cells(runs)
    shown_methods = [m for m in methods if any(m in c for c in cells.values())]
    header = (
        "model",
        "GPU",
        "regime",
        "batch",
        "in memory (s/iter)",
        *(METHOD_LABELS[m] for m in shown_methods),
    )
    rows = []
    for key in sorted(cells):
        here = cells[key]
        # The row's in-memory figure from the run of its default LMS cell where it has one;
        # each cell's share of in-memory throughput from its own run's fitting batches.
        first = here.get("lms") or next(iter(here.values()))
        memory = in_memory_s(first.run, key.batch) if key.batch else None
        ckpt = here.get("checkpoint")
        rows.append(
            [
                SHORT_NAMES.get(key.model, key.model),
                key.device,
                compare_label(key.regime, key.factor),
                str(key.batch or ""),
                "" if memory is None else _seconds(memory),
                *(
                    cell_text(
                        here[m].row if m in here else None,
                        # A ratio of two figures of one run only (cells of a row may come
                        # from several runs).
                        ckpt.row if ckpt and m in here and ckpt.run is here[m].run else None,
                        key.batch,
                        in_memory_s(here[m].run, 1) if m in here else None,
                    )
                    for m in shown_methods
                ),
            ]
        )
    return markdown_table(header, rows)


def speed_summary(folders: Sequence[Path], shown: Callable[[Path], str], engine_sha256: str) -> str:
    """The speed table of ``folders`` with a line per run environment naming its engine
    (provenance.engine_lines: the commit the results record and whether it is this checkout's
    engine), what the figures are, and the table."""

    runs = load_runs(folders, shown)
    if not runs:
        where = ", ".join(f"`{shown(f)}`" for f in folders) or "the folders given"
        return f"No compare.py results in {where} yet: run `scripts/gpu/run-speed.sh`."
    lines = engine_lines(
        [(r.shown, r.folder, r.record["environment"]) for r in runs], engine_sha256
    )
    counts = sorted(
        {
            len(c.row.get("iteration_times") or [])
            for per in merge_cells(runs).values()
            for c in per.values()
            if c.row.get("status") == "ok"
        }
    )
    what = (
        "Seconds per iteration: the median of the timed iterations after the warm-up "
        f"({', '.join(map(str, counts)) or 'none'} per row), its ratio to checkpointing's "
        "(below 1: faster), its throughput as a share of the in-memory throughput, and the "
        "warm-up iterations' own times, iteration 0 first. The in-memory figure is the time "
        "per sample of the largest batch of the same run that fits (LMS off), times the row's "
        "batch."
    )
    return "\n".join([*lines, "", what, "", speed_table(runs)])


SPEED_BEGIN = (
    "<!-- speed-table:begin (generated by benchmarks/summarize.py --speed; do not edit) -->"
)
SPEED_END = "<!-- speed-table:end -->"


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------


def run_groups(
    groups: Sequence[Group],
    cells: Sequence[CellPlan],
    args: argparse.Namespace,
    call: Callable[[list[str], float], int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
) -> int:
    """Runs each group's compare.py call in turn, each with its share of what is left of
    ``args.budget_s`` (by the estimates of it and the groups after it); returns the worst exit
    status (0: every call ended normally)."""
    began = clock()
    estimates = [group_estimate(g, cells) for g in groups]
    worst = 0
    runner = call or _subprocess_call
    for i, g in enumerate(groups):
        left = args.budget_s - (clock() - began)
        budget = shares(estimates[i:], left)[0]
        if budget < CALL_SETUP_S[g.regime] + ROW_SETUP_S:
            log(f"== {g.folder}: not run, {max(left, 0.0):.0f} s left")
            worst = max(worst, 3)
            continue
        argv = g.argv(
            args.out, args.warmup, args.iterations, budget, args.speed_args, args.host_gib
        )
        log(f"== {g.folder}: compare.py {shlex.join(argv)}")
        status = runner(argv, budget)
        if status:
            log(f"== {g.folder}: compare.py exited with {status}")
        worst = max(worst, status)
    return worst


def _subprocess_call(argv: list[str], budget_s: float) -> int:
    command = [sys.executable, "-m", "benchmarks.compare", *argv]
    try:
        return subprocess.run(
            command, cwd=ROOT, timeout=budget_s + CALL_GRACE_S, check=False
        ).returncode
    except subprocess.TimeoutExpired:
        print(
            f"compare.py ran past {budget_s + CALL_GRACE_S:.0f} s and was stopped", file=sys.stderr
        )
        return 124


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def _add_selection(parser: argparse.ArgumentParser) -> None:
    def names(allowed: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
        return lambda text: parse_list(text, allowed, what)

    parser.add_argument(
        "--models",
        type=names(MODELS, "models"),
        default=MODELS,
        help=f"comma-separated, of {', '.join(MODELS)} (default: all)",
    )
    parser.add_argument(
        "--regimes",
        type=names(REGIMES, "regimes"),
        default=REGIMES,
        help="nocap (need a factor of the device, no cap set), capped (cap = uncapped peak / "
        "factor) or both (default)",
    )
    parser.add_argument(
        "--nocap-factors",
        type=parse_factor_list,
        default=NOCAP_FACTORS,
        help="needs over the device (default: " + ",".join(f"{f:g}" for f in NOCAP_FACTORS) + ")",
    )
    parser.add_argument(
        "--capped-factors",
        type=parse_factor_list,
        default=CAPPED_FACTORS,
        help="caps as 1/FACTOR of the uncapped peak, 1.5 or 1/1.5 (default: "
        + ",".join(f"1/{f:g}" for f in CAPPED_FACTORS)
        + ")",
    )
    parser.add_argument(
        "--methods",
        type=names(METHODS, "methods"),
        default=DEFAULT_METHODS,
        help=f"comma-separated, of {', '.join(METHODS)} (compare.py's; default: all but "
        f"{', '.join(m for m in METHODS if m not in DEFAULT_METHODS)})",
    )
    parser.add_argument(
        "--warmup", type=nonneg_int, default=DEFAULT_WARMUP, help="warm-up iterations"
    )
    parser.add_argument(
        "--iterations",
        type=positive_int,
        default=DEFAULT_ITERATIONS,
        help=f"timed iterations (the table marks rows of fewer than {MIN_STEADY_ITERATIONS})",
    )
    parser.add_argument(
        "--budget-s",
        type=positive_float,
        default=540.0,
        help="wall time for every call together; each call gets a share in proportion to "
        "its estimate",
    )
    parser.add_argument(
        "--host-gib",
        type=positive_float,
        default=None,
        help="host memory available to the runs in GiB: each no-cap call's --host-budget-gib, "
        "and what the plan expects compare.py to skip for host memory (default: this "
        "machine's available memory)",
    )
    parser.add_argument(
        "--speed-args",
        type=shlex.split,
        default=list(DEFAULT_COMPARE_ARGS),
        help="more compare.py arguments for every call, one shell-quoted string "
        f"(default: {' '.join(DEFAULT_COMPARE_ARGS)})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speed.py",
        description="The speed table: LMS (defaults, paging only, hybrid) against "
        "checkpointing, torch.compile's activation_memory_budget and offloading, no cap and "
        "capped, with warm-up iterations, steady-state medians and the in-memory figure.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the cells of a selection and their estimates")
    _add_selection(plan)
    run = sub.add_parser("run", help="measure a selection (compare.py calls) and tabulate it")
    _add_selection(run)
    run.add_argument("--out", type=Path, required=True, help="results folder")
    table = sub.add_parser("table", help="the table of result folders, merged")
    table.add_argument("folders", type=Path, nargs="+", metavar="DIR")
    table.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="rewrite the section between the speed-table markers of this file",
    )
    table.add_argument("--check", action="store_true", help="with --readme: exit 1 if stale")
    return parser


def _selection(args: argparse.Namespace) -> tuple[list[Group], list[CellPlan]]:
    """The calls and cells of the selection ``args`` names; fills ``args.host_gib`` where it
    was not given (this machine's available memory)."""
    if args.host_gib is None:
        args.host_gib = available_host_gib()
    groups = plan_groups(
        args.models, args.regimes, args.nocap_factors, args.capped_factors, args.methods
    )
    room = None if args.host_gib is None else host_room(args.host_gib)
    return groups, plan_cells(groups, load_references(), args.warmup, args.iterations, room)


def main(argv: Sequence[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    if args.command == "table":
        text = speed_summary(args.folders, shown, checkout_engine_sha256())
        if args.readme is None:
            print(text)
            return 0
        redo = "python -m benchmarks.speed table " + " ".join(map(shown, args.folders))
        return update(args.readme, [(SPEED_BEGIN, SPEED_END, text)], args.check, redo)
    groups, cells = _selection(args)
    if not groups:
        print("speed.py: the selection has no cells", file=sys.stderr)
        return 2
    print(plan_text(groups, cells, args.budget_s, args.host_gib))
    if args.command == "plan":
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    status = run_groups(groups, cells, args)
    text = speed_summary([args.out], shown, checkout_engine_sha256())
    (args.out / "speed-table.md").write_text(text + "\n")
    print("\n" + text)
    return status


if __name__ == "__main__":
    sys.exit(main())
