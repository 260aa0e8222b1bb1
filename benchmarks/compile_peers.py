#!/usr/bin/env python3
"""Large Model Support under ``torch.compile`` against PyTorch's own compile-time answers to a
memory cap, side by side in one run on one GPU.

One model (the GPT-style decoder of ``lmsbench/models.py``, sized by ``--gpt-*`` and
``--batch``) trains with AdamW in these configurations:

1. ``compiled``: ``torch.compile`` (default mode), uncapped, LMS not even imported: the
   reference time per iteration and peak allocated memory P;
2. ``compiled_budget``: compiled under the cap with AOTAutograd's activation memory budget
   (``torch._functorch.config.activation_memory_budget``: the partitioner recomputes what it
   must to keep the saved activations within that share). The budget is chosen from the
   reference so that it should fit the cap (``--budget`` overrides); when the chosen budget
   runs out of memory it is retried once at 0 (recompute everything it can);
3. ``compiled_offload``: compiled under the cap with the compile-time activation offloading
   of the installed torch, when it has one. Its config names are looked up at run time
   (names containing "offload" in ``torch._functorch.config`` and ``torch._inductor.config``)
   and printed; where it is absent, the row says so. Where present (``enable_activation_
   offloading``), a joint-graph pass (``joint_custom_pass``) marks every forward tensor of at
   least ``--offload-min-mb`` for offloading; the partitioner offloads those it saves for the
   backward. Its separate-stream, wait-sinking and reload-prefetch options are used where
   they exist (``--no-offload-stream`` for the synchronous variant; an error in the stream
   variant is retried once synchronously);
4. ``compiled_lms``: compiled under the cap with LMS on (the drop-in extension or a patched
   build), limit ``--lms-limit-frac`` x cap, default settings: the learned swap schedule and
   the page-ins planned by the compiled graphs (``set_graph_prefetch_lms``) both on;
5. ``eager_lms``: the same model eager, LMS on, under the same cap;
6. ``eager`` (only when named in ``--configs``): eager, uncapped, LMS off;
   ``compiled_uncapped_lms`` and ``compiled_uncapped_learned_lms`` (only when named):
   compiled, uncapped, LMS on with everything fitting, with and without the compiled graphs'
   page-in plan: what LMS costs a compiled model that fits.

Only when named in ``--configs``, compiled LMS rows that turn one source of swap-schedule
knowledge off, to tell what each does: ``compiled_learned_lms`` (the learned schedule alone,
graph prefetch off), ``compiled_graph_lms`` (the graphs' plan alone, learned schedule off) and
``compiled_reactive_lms`` (both off: least recently used reclaim, demand page-ins).

``--vary-seq`` gives every step its own sequence length (between half and all of
``--gpt-seq``, a multiple of 64, the same sequence of lengths in every configuration), as
training on unpadded batches of varying length does: Dynamo compiles a graph with a dynamic
length after the second length it sees, and the learned schedule, which needs iterations
that repeat, never settles.

The caps are fractions (``--caps``, default 1/2 and 1/4) of the compiled reference's peak
allocated memory, applied with ``torch.cuda.set_per_process_memory_fraction`` as the
regression harness does. Every configuration runs in a process of its own, so that compile
state and the caching allocator start fresh; Inductor's and Triton's caches go under one
temporary folder of this run (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``), removed at
the end unless ``--keep-cache``.

Per configuration and cap: seconds per iteration (median of ``--iterations`` after
``--warmup``; the first step, which compiles, is reported apart), peak allocated memory over
the timed steps (the warm-up's, with compilation and autotuning, is in the JSON),
activation memory (allocated after the forward pass minus before it), bytes paged out and in
per iteration and stall milliseconds per iteration (``torch.cuda.lms_stats()``, LMS rows),
bytes offloaded per iteration (the tensors the offloading pass chose, offload rows), whether
it trains at the cap, and time and peak against the reference of the same run.

Writes into ``--out``: ``compile-peers.csv`` (one row per configuration and cap, with device,
versions, date and the engine commit), ``compile-peers.json`` (configuration, discovered
config names, every row with its iteration times and losses) and ``logs/`` (each worker's
output). The files are rewritten after every row, so a run stopped early keeps what it
measured. A configuration runs in a process of its own (``harness.run_worker``).
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from lmsbench import harness
from lmsbench.harness import (
    Deadline,
    add_amp_option,
    add_gpt_options,
    add_out_option,
    add_step_options,
    add_time_budget_option,
    csv_env_columns,
    markdown_table,
    record_environment,
    serve_worker,
    write_csv,
    write_json,
)
from lmsbench.lms_setup import (
    GiB,
    MiB,
    add_limit_share_option,
    add_lms_tuning_options,
    fraction,
    nonneg_float,
    positive_float,
    positive_int,
)

# Configurations, in the order they run at each cap (the reference runs first, uncapped).
REFERENCE = "compiled"
CAPPED_CONFIGS = ("compiled_lms", "compiled_budget", "compiled_offload", "eager_lms")
# Compiled LMS rows with one source of the swap schedule off (only when named).
SCHEDULE_VARIANTS = ("compiled_learned_lms", "compiled_graph_lms", "compiled_reactive_lms")
SCHEDULE_OFF = ("compiled_graph_lms", "compiled_reactive_lms")
GRAPH_PREFETCH_OFF = (
    "compiled_learned_lms",
    "compiled_reactive_lms",
    "compiled_uncapped_learned_lms",
)
# Uncapped rows beside the reference (only when named): eager, and LMS on with everything
# fitting, with and without the compiled graphs' page-in plan (what LMS costs there).
UNCAPPED_EXTRAS = ("eager", "compiled_uncapped_lms", "compiled_uncapped_learned_lms")
ALL_CONFIGS = (REFERENCE, *CAPPED_CONFIGS, *SCHEDULE_VARIANTS, *UNCAPPED_EXTRAS)
DEFAULT_CONFIGS = (REFERENCE, *CAPPED_CONFIGS)
DESCRIPTIONS = {
    "compiled": "torch.compile, uncapped, LMS off (the reference)",
    "compiled_budget": "torch.compile + AOTAutograd activation_memory_budget (recompute)",
    "compiled_offload": "torch.compile + compile-time activation offloading",
    "compiled_lms": "torch.compile + LMS",
    "compiled_learned_lms": "torch.compile + LMS, learned schedule only (graph prefetch off)",
    "compiled_graph_lms": "torch.compile + LMS, compiled graphs' plan only (schedule off)",
    "compiled_reactive_lms": "torch.compile + LMS, reactive (schedule and graph prefetch off)",
    "eager_lms": "eager + LMS",
    "eager": "eager, uncapped, LMS off",
    "compiled_uncapped_lms": "torch.compile + LMS, uncapped (everything fits)",
    "compiled_uncapped_learned_lms": "torch.compile + LMS, uncapped, graph prefetch off",
}

# Words that name an offloading option of torch's compile stack (offload, reload prefetch).
OFFLOAD_WORDS = ("offload", "reload")
# The names this benchmark can drive, where the installed torch has them.
OFFLOAD_ENABLE = "enable_activation_offloading"
JOINT_PASS = "joint_custom_pass"
OFFLOAD_STREAM_FLAGS = (
    "activation_offload_separate_stream",
    "activation_offload_sink_wait",
    "activation_reload_prefetch",
)
OFFLOAD_BANDWIDTH = "activation_offload_cpu_gpu_bw"
BUDGET_NAME = "activation_memory_budget"
# Where the offload configuration counts the bytes its forward graphs offload.
COUNT_PASS = "post_grad_custom_pre_pass"

# The learned swap schedule's state after each step of an LMS row (``lms_stats`` keys).
SCHEDULE_STEP_KEYS = (
    "schedule_active",
    "schedule_period",
    "schedule_detections",
    "schedule_fallbacks",
)


def describe_schedule(state: dict[str, int]) -> str:
    """One step's schedule state in words, e.g. ``period 984 (3 adopted, 2 dropped)``."""
    adopted = state.get("schedule_detections", 0)
    dropped = state.get("schedule_fallbacks", 0)
    counts = f"({adopted} adopted, {dropped} dropped)"
    if state.get("schedule_active"):
        return f"period {state.get('schedule_period', 0)} {counts}"
    return f"inactive {counts}"


CSV_NAME = "compile-peers.csv"
JSON_NAME = "compile-peers.json"
ROW_COLUMNS = (
    "config",
    "cap",
    "cap_gib",
    "status",
    "trains_at_cap",
    "s_per_iter",
    "time_vs_ref",
    "peak_allocated_gib",
    "peak_vs_ref",
    "activation_gib",
    "pageout_gib_per_iter",
    "pagein_gib_per_iter",
    "offloaded_gib_per_iter",
    "stall_ms_per_iter",
    "budget",
    "first_step_s",
    "loss_rel_diff_vs_ref",
    "settings",
    "detail",
)


# ---------------------------------------------------------------------------------------
# Discovery of the installed torch's offloading options (no GPU needed)
# ---------------------------------------------------------------------------------------


def sequence_length(longest: int, step: int) -> int:
    """The sequence length of ``step`` under ``--vary-seq``: between half of ``longest`` and
    all of it, a multiple of 64 (or ``longest`` when it is shorter), the same in every
    configuration, rarely the same two steps in a row."""
    if longest <= 64:
        return longest
    shortest = max(64, longest // 2 // 64 * 64)
    choices = list(range(shortest, longest + 1, 64))
    return choices[(step * 7) % len(choices)]


def config_names(module: Any) -> list[str]:
    """The option names of a torch config module (``get_config_copy()`` where it exists,
    else the module's public attributes)."""
    getter = getattr(module, "get_config_copy", None)
    if callable(getter):
        try:
            return sorted(str(k) for k in getter())
        except Exception:  # a config that cannot be copied: fall back to its attributes
            pass
    return sorted(n for n in dir(module) if not n.startswith("_"))


@dataclass
class OffloadSupport:
    """What the installed torch offers for compile-time activation offloading."""

    found: dict[str, list[str]]  # config module -> option names containing "offload"
    usable: bool
    reason: str  # why not usable ("" when usable)
    stream_flags: list[str] = field(default_factory=list)  # of OFFLOAD_STREAM_FLAGS, present
    has_budget: bool = False  # activation_memory_budget exists
    torch_version: str = ""

    def describe(self) -> str:
        parts = []
        for module, names in self.found.items():
            parts.append(f"{module}: {', '.join(names) if names else '(none)'}")
        text = "; ".join(parts)
        if self.usable:
            variant = "separate stream" if self.stream_flags else "synchronous only"
            return f"{text} -> usable ({OFFLOAD_ENABLE} + {JOINT_PASS}, {variant})"
        return f"{text} -> not usable: {self.reason}"


def discover_offload_support(
    functorch_config: Any | None = None,
    inductor_config: Any | None = None,
    torch_version: str | None = None,
) -> OffloadSupport:
    """Looks up the offloading options of the installed torch (or of the modules given)."""
    if functorch_config is None or inductor_config is None or torch_version is None:
        import torch
        import torch._functorch.config as fc
        import torch._inductor.config as ic

        functorch_config = fc if functorch_config is None else functorch_config
        inductor_config = ic if inductor_config is None else inductor_config
        torch_version = torch.__version__ if torch_version is None else torch_version
    modules = {
        "torch._functorch.config": config_names(functorch_config),
        "torch._inductor.config": config_names(inductor_config),
    }
    found = {
        module: [n for n in names if any(w in n.lower() for w in OFFLOAD_WORDS)]
        for module, names in modules.items()
    }
    functorch_names = set(modules["torch._functorch.config"])
    support = OffloadSupport(
        found=found,
        usable=False,
        reason="",
        stream_flags=[f for f in OFFLOAD_STREAM_FLAGS if f in functorch_names],
        has_budget=BUDGET_NAME in functorch_names,
        torch_version=torch_version,
    )
    missing = [n for n in (OFFLOAD_ENABLE, JOINT_PASS) if n not in functorch_names]
    if missing:
        others = [n for names in found.values() for n in names]
        support.reason = (
            f"torch {torch_version} has no torch._functorch.config.{' or '.join(missing)}"
            + (
                f" (offload options it has: {', '.join(others)}; "
                "this benchmark does not know how to drive them)"
                if others
                else " and no config option containing 'offload'"
            )
        )
    else:
        support.usable = True
    return support


# ---------------------------------------------------------------------------------------
# Arithmetic (no torch)
# ---------------------------------------------------------------------------------------


def choose_budget(cap: int, peak: int, activation: int, margin: float) -> float:
    """The activation memory budget expected to fit ``cap``.

    ``peak`` and ``activation`` (memory allocated after the forward pass minus before it)
    come from the uncapped compiled reference. A budget b keeps about b x ``activation`` of
    the saved activations; the rest of the peak (parameters, optimizer state, gradients, the
    backward pass's own buffers) stays. So b = (margin x cap - (peak - activation)) /
    activation, clamped to [0, 1].
    """
    if cap <= 0 or peak <= 0 or not 0 < margin <= 1:
        raise ValueError("need cap > 0, peak > 0 and a margin in (0, 1]")
    if activation <= 0:
        return 0.0
    b = (margin * cap - (peak - activation)) / activation
    return round(min(1.0, max(0.0, b)), 3)


def cap_label(share: float | None) -> str:
    """``1/2`` for 0.5, ``1/4`` for 0.25, ``0.3`` otherwise; ``uncapped`` for None."""
    if share is None:
        return "uncapped"
    inverse = 1.0 / share
    if abs(inverse - round(inverse)) < 1e-9:
        return f"1/{round(inverse)}"
    return f"{share:g}"


def parse_caps(text: str) -> list[float]:
    """``0.5,0.25`` or ``1/2,1/4``: caps as shares of the reference peak, each in (0, 1)."""
    caps: list[float] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            if "/" in item:
                num, den = item.split("/", 1)
                value = float(num) / float(den)
            else:
                value = float(item)
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(
                f"caps must be numbers or fractions such as 0.5 or 1/4, got {item!r}"
            ) from None
        if not (math.isfinite(value) and 0 < value < 1):
            raise argparse.ArgumentTypeError(
                f"each cap is a share of the uncapped peak and must be in (0, 1), got {item!r}"
            )
        caps.append(value)
    if not caps:
        raise argparse.ArgumentTypeError("give at least one cap, e.g. 0.5,0.25")
    return sorted(set(caps), reverse=True)


def parse_configs(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(ALL_CONFIGS)}"
        )
    if not names:
        raise argparse.ArgumentTypeError("give at least one configuration")
    # The reference always runs: the caps and ratios come from it.
    return [c for c in ALL_CONFIGS if c in names or c == REFERENCE]


def budget_fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


@dataclass
class Row:
    """One configuration at one cap (cap None: uncapped)."""

    config: str
    share: float | None
    cap_bytes: int | None
    status: str = "pending"  # ok, oom, error, timeout, skipped, unavailable
    detail: str = ""
    settings: str = ""
    budget: float | None = None
    iteration_times: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # every step, the compiling ones too
    s_per_iter: float | None = None
    first_step_s: float | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    activation_bytes: int | None = None
    pageout_bytes_per_iter: float | None = None
    pagein_bytes_per_iter: float | None = None
    stall_ms_per_iter: float | None = None
    offloaded_bytes_per_iter: float | None = None
    losses: list[float] = field(default_factory=list)
    lms: dict[str, Any] | None = None
    schedule_steps: list[dict[str, int]] = field(default_factory=list)
    lms_backend: str = ""
    attempts: list[str] = field(default_factory=list)
    worker_seconds: float | None = None
    # Against the uncapped compiled reference of the same run.
    time_vs_ref: float | None = None
    peak_vs_ref: float | None = None
    loss_rel_diff_vs_ref: float | None = None

    @property
    def trains_at_cap(self) -> bool | None:
        """Whether all steps trained (None: not measured)."""
        if self.status == "ok":
            return True
        if self.status in ("oom", "error", "timeout"):
            return False
        return None

    def absorb(self, result: dict[str, Any]) -> None:
        """Copies a worker's result into the row."""
        self.status = str(result.get("status", "error"))
        self.detail = str(result.get("detail", ""))[:400]
        for key in (
            "first_step_s",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "activation_bytes",
            "pageout_bytes_per_iter",
            "pagein_bytes_per_iter",
            "stall_ms_per_iter",
            "offloaded_bytes_per_iter",
            "lms",
        ):
            if result.get(key) is not None:
                setattr(self, key, result[key])
        self.iteration_times = [float(t) for t in result.get("iteration_times", [])]
        self.step_times = [float(t) for t in result.get("step_times", [])]
        self.losses = [float(x) for x in result.get("losses", [])]
        self.schedule_steps = [dict(x) for x in result.get("schedule_steps", [])]
        self.lms_backend = str(result.get("lms_backend", "") or "")
        if self.iteration_times and self.status == "ok":
            self.s_per_iter = statistics.median(self.iteration_times)


def fill_ratios(rows: Iterable[Row], reference: Row) -> None:
    """Time, peak and final loss of every measured row against the reference."""
    for r in rows:
        if r.status != "ok":
            continue
        if r.s_per_iter and reference.s_per_iter:
            r.time_vs_ref = r.s_per_iter / reference.s_per_iter
        if r.peak_allocated_bytes and reference.peak_allocated_bytes:
            r.peak_vs_ref = r.peak_allocated_bytes / reference.peak_allocated_bytes
        if r.losses and reference.losses and len(r.losses) == len(reference.losses):
            a, b = reference.losses[-1], r.losses[-1]
            if math.isfinite(a) and math.isfinite(b):
                r.loss_rel_diff_vs_ref = abs(a - b) / max(abs(a), 1e-30)
            else:
                r.loss_rel_diff_vs_ref = math.inf


# ---------------------------------------------------------------------------------------
# Tables and files
# ---------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _gib(value: float | None) -> str:
    return "" if value is None else f"{value / GiB:.3f}"


def row_record(r: Row) -> dict[str, str]:
    trains = r.trains_at_cap
    return {
        "config": r.config,
        "cap": cap_label(r.share),
        "cap_gib": _gib(r.cap_bytes),
        "status": r.status,
        "trains_at_cap": "" if trains is None else ("yes" if trains else "no"),
        "s_per_iter": _num(r.s_per_iter, ".4f"),
        "time_vs_ref": _num(r.time_vs_ref, ".2f"),
        "peak_allocated_gib": _gib(r.peak_allocated_bytes),
        "peak_vs_ref": _num(r.peak_vs_ref, ".2f"),
        "activation_gib": _gib(r.activation_bytes),
        "pageout_gib_per_iter": _gib(r.pageout_bytes_per_iter),
        "pagein_gib_per_iter": _gib(r.pagein_bytes_per_iter),
        "offloaded_gib_per_iter": _gib(r.offloaded_bytes_per_iter),
        "stall_ms_per_iter": _num(r.stall_ms_per_iter, ".1f"),
        "budget": _num(r.budget, "g"),
        "first_step_s": _num(r.first_step_s, ".1f"),
        "loss_rel_diff_vs_ref": _num(r.loss_rel_diff_vs_ref, ".2e"),
        "settings": r.settings,
        "detail": " | ".join([*r.attempts, r.detail] if r.detail else r.attempts).replace(
            "\n", " "
        )[:400],
    }


def rows_markdown(records: Sequence[dict[str, str]]) -> str:
    headers = (
        "config",
        "cap",
        "trains",
        "s/iter",
        "x ref",
        "peak GiB",
        "x ref",
        "paged out GiB/iter",
        "offloaded GiB/iter",
        "stall ms/iter",
        "budget",
        "status",
    )
    rows = []
    for r in records:
        cap = r["cap"] + (f" ({r['cap_gib']} GiB)" if r["cap_gib"] else "")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['detail'][:70]}"
        rows.append(
            (
                r["config"],
                cap,
                r["trains_at_cap"] or "-",
                r["s_per_iter"],
                r["time_vs_ref"],
                r["peak_allocated_gib"],
                r["peak_vs_ref"],
                r["pageout_gib_per_iter"],
                r["offloaded_gib_per_iter"],
                r["stall_ms_per_iter"],
                r["budget"],
                status,
            )
        )
    return markdown_table(headers, rows)


def write_outputs(
    out: Path,
    rows: Sequence[Row],
    env: dict[str, Any],
    support: OffloadSupport | None,
    meta: dict[str, Any],
    final: bool = True,
) -> str:
    """Writes the CSV and the JSON (every time); returns the markdown table, printed by the
    caller when ``final``."""
    out.mkdir(parents=True, exist_ok=True)
    records = [row_record(r) for r in rows]
    write_csv(out / CSV_NAME, ROW_COLUMNS, records, env, csv_env_columns(env))
    payload = {
        "environment": env,
        **meta,
        "offload_support": None if support is None else asdict(support),
        "rows": [{**asdict(r), "trains_at_cap": r.trains_at_cap} for r in rows],
        "final": final,
    }
    write_json(out / JSON_NAME, payload)
    return rows_markdown(records)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compile_peers.py",
        description="LMS under torch.compile against activation_memory_budget (recompute) "
        "and compile-time activation offloading, under the same GPU memory caps, in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_out_option(parser, Path("out/compile-peers"))
    parser.add_argument(
        "--caps",
        type=parse_caps,
        default=parse_caps("1/2,1/4"),
        help="memory caps as shares of the compiled reference's peak allocated memory",
    )
    parser.add_argument(
        "--configs",
        type=parse_configs,
        default=list(DEFAULT_CONFIGS),
        help=f"configurations to run, comma-separated, of {', '.join(ALL_CONFIGS)} "
        "(the reference 'compiled' always runs)",
    )
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per batch")
    add_gpt_options(parser, layers=12, dim=1024, heads=16, seq=2048, vocab=8192)
    add_amp_option(parser)
    parser.add_argument(
        "--vary-seq",
        action="store_true",
        help="a sequence length of its own for every step (half to all of --gpt-seq)",
    )
    add_step_options(
        parser,
        warmup=5,
        iterations=5,
        min_warmup=1,
        warmup_help="untimed steps per configuration (the first compiles; LMS's learned "
        "schedule settles in the next ones)",
        iterations_help="timed steps per configuration",
    )
    add_limit_share_option(parser, default=0.8)
    add_lms_tuning_options(parser, speculative=False, old_names=True)
    parser.add_argument(
        "--budget",
        type=budget_fraction,
        default=None,
        help="activation_memory_budget for every cap (default: chosen per cap from the "
        "reference so that it should fit)",
    )
    parser.add_argument(
        "--budget-margin",
        type=fraction,
        default=0.85,
        help="share of the cap the chosen budget aims at",
    )
    parser.add_argument(
        "--offload-min-mb",
        type=nonneg_float,
        default=1.0,
        help="smallest forward tensor marked for compile-time offloading (LMS's default size "
        "threshold is 1 MiB too)",
    )
    parser.add_argument(
        "--offload-stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offload on a separate stream with wait sinking and reload prefetch, where the "
        "installed torch has those options",
    )
    parser.add_argument(
        "--config-timeout-s",
        type=positive_float,
        default=240.0,
        help="a configuration's process running longer is stopped and reported as timeout",
    )
    parser.add_argument(
        "--min-config-s",
        type=positive_float,
        default=40.0,
        help="a configuration is started only with at least this much of the budget left",
    )
    add_time_budget_option(parser, 480.0, "configurations")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="parent of the run's temporary Inductor/Triton cache folder (default: the "
        "system's temporary folder)",
    )
    parser.add_argument(
        "--keep-cache", action="store_true", help="keep the run's compile cache folder"
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Checks across arguments; raises ValueError with the problem."""
    if args.gpt_dim % args.gpt_heads:
        raise ValueError(
            f"--gpt-dim ({args.gpt_dim}) must be a multiple of --gpt-heads ({args.gpt_heads})"
        )
    if args.min_config_s > args.time_budget_s:
        raise ValueError(
            f"--min-config-s ({args.min_config_s:g}) is larger than --time-budget-s "
            f"({args.time_budget_s:g}): nothing could run"
        )


def gpt_spec(args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab": args.gpt_vocab,
        "seq": args.gpt_seq,
        "dim": args.gpt_dim,
        "layers": args.gpt_layers,
        "heads": args.gpt_heads,
    }


def worker_spec(
    args: argparse.Namespace,
    config: str,
    cap: int | None,
    *,
    budget_value: float | None = None,
    offload: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON a worker process gets: everything it needs to run one configuration."""
    lms = config.endswith("_lms")
    limit = None
    if lms and cap is not None:
        limit = max(1, int(cap * args.lms_limit_frac))
    return {
        "config": config,
        "compile": config.startswith("compiled"),
        "backend": "inductor",
        "device": "cuda",
        "cap_bytes": cap,
        "lms": lms,
        "lms_limit_bytes": limit,
        "lms_size_bytes": None if args.size_mb is None else int(args.size_mb * MiB),
        "lms_prefetch": args.prefetch,
        # Which sources of the swap schedule are on (None: the build's defaults).
        "lms_schedule": False if config in SCHEDULE_OFF else None,
        "lms_graph_prefetch": False if config in GRAPH_PREFETCH_OFF else None,
        "vary_seq": args.vary_seq,
        "budget": budget_value,
        "offload": offload,
        "gpt": gpt_spec(args),
        "batch": args.batch,
        "warmup": args.warmup,
        "iterations": args.iterations,
        "amp": args.amp,
    }


def offload_spec(support: OffloadSupport, stream: bool, min_bytes: int) -> dict[str, Any]:
    """The offload options of a worker: the stream options all on or all off."""
    return {
        "enable": OFFLOAD_ENABLE,
        "mark_pass": JOINT_PASS,
        "flags": {f: stream for f in support.stream_flags},
        "min_bytes": min_bytes,
    }


def describe_settings(spec: dict[str, Any]) -> str:
    parts = ["compiled" if spec["compile"] else "eager"]
    if spec.get("lms"):
        limit = spec.get("lms_limit_bytes")
        parts.append("LMS" + (f" limit {limit / GiB:.2f} GiB" if limit else ""))
        off = [
            name
            for key, name in (
                ("lms_schedule", "schedule"),
                ("lms_graph_prefetch", "graph prefetch"),
            )
            if spec.get(key) is False
        ]
        if off:
            parts.append(" and ".join(off) + " off")
    if spec.get("vary_seq"):
        parts.append("varying sequence length")
    if spec.get("budget") is not None:
        parts.append(f"{BUDGET_NAME}={spec['budget']:g}")
    if spec.get("offload"):
        on = [k for k, v in spec["offload"]["flags"].items() if v]
        parts.append(
            f"{OFFLOAD_ENABLE} ({'+'.join(on) if on else 'synchronous'}; tensors >= "
            f"{spec['offload']['min_bytes'] / MiB:g} MiB marked)"
        )
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------
# The worker: one configuration in a fresh process
# ---------------------------------------------------------------------------------------


def _is_oom(error: BaseException) -> bool:
    """Out of device memory, anywhere in the exception's chain (compile errors wrap it)."""
    seen: set[int] = set()
    e: BaseException | None = error
    markers = (
        "CUDA out of memory",
        "out of memory",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "CUDNN_STATUS_ALLOC_FAILED",
        "OutOfMemoryError",
    )
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "OutOfMemoryError" or any(m in str(e) for m in markers):
            return True
        e = e.__cause__ or e.__context__
    return False


class OffloadMarker:
    """The joint-graph pass of the offload configuration (``joint_custom_pass``): marks every
    tensor-valued node of at least ``min_bytes`` with ``should_offload``. The partitioner
    offloads those of them it saves for the backward pass and can offload (not views, not
    outputs, contiguous)."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.marked = 0
        self.calls = 0

    def __call__(self, gm: Any, joint_inputs: Any) -> Any:
        self.calls += 1
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            nbytes = _node_bytes(node)
            if nbytes is not None and nbytes >= self.min_bytes:
                node.meta["should_offload"] = True
                self.marked += 1
        return gm


class OffloadCounter:
    """An Inductor post-grad pass (``post_grad_custom_pre_pass``) that adds up the bytes the
    forward graphs copy to the host: the offload nodes the partitioner inserted (named
    ``cpu_offload_*``, an ``offload`` op, or a ``device_put`` to the CPU). Being a plain
    callable, it makes Inductor bypass its FX graph cache, so it sees every compiled graph;
    ``graphs`` stays 0 when a cache still answered."""

    def __init__(self) -> None:
        self.graphs = 0
        self.nodes = 0
        self.bytes = 0

    def __call__(self, graph: Any) -> None:
        self.graphs += 1
        for node in graph.nodes:
            if node.op == "call_function" and _is_offload_node(node):
                source = node.args[0] if node.args else None
                nbytes = _node_bytes(source) if hasattr(source, "meta") else None
                if nbytes:
                    self.nodes += 1
                    self.bytes += nbytes


def _is_offload_node(node: Any) -> bool:
    import torch

    if str(node.name).startswith("cpu_offload_"):
        return True
    target = str(node.target)
    if "offload" in target:
        return True
    if node.target is torch.ops.prims.device_put.default and len(node.args) > 1:
        return torch.device(node.args[1]).type == "cpu"
    return False


def _node_bytes(node: Any) -> int | None:
    import torch

    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return int(val.numel()) * val.element_size()
    except Exception:  # symbolic sizes
        return None


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Trains one configuration as ``spec`` says; returns the result (never raises for
    training errors: they become its status)."""
    import torch

    result: dict[str, Any] = {"status": "error", "detail": "", "config": spec["config"]}
    device = torch.device(spec.get("device", "cuda"))
    cuda = device.type == "cuda"
    try:
        if cuda and not torch.cuda.is_available():
            result["detail"] = "no CUDA device"
            return result
        if spec["lms"]:  # before CUDA is initialized, as the drop-in extension expects
            from lmsbench.lms_setup import LmsUnavailable, ensure_lms_api

            try:
                result["lms_backend"] = ensure_lms_api()
            except LmsUnavailable as exc:
                result["status"], result["detail"] = "unavailable", str(exc)
                return result
        result["environment"] = _worker_environment(cuda)
        if not spec["amp"]:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        passes = _apply_compile_options(spec)
        _train(spec, device, result, passes)
    except Exception as exc:  # a configuration's failure is its result
        result["status"] = "oom" if _is_oom(exc) else "error"
        first = str(exc).strip().splitlines()
        result["detail"] = f"{type(exc).__name__}: {first[0] if first else ''}"[:400]
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-4000:]
            print(result["traceback"], file=sys.stderr)
    return result


def _worker_environment(cuda: bool) -> dict[str, Any]:
    env = record_environment(device=cuda)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def _apply_compile_options(spec: dict[str, Any]) -> tuple[OffloadMarker, OffloadCounter] | None:
    """Sets the functorch options of the budget and offload configurations (an unknown
    name raises AttributeError, which becomes the row's error)."""
    import torch._functorch.config as fc
    import torch._inductor.config as ic

    if spec.get("budget") is not None:
        setattr(fc, BUDGET_NAME, float(spec["budget"]))
    offload = spec.get("offload")
    if not offload:
        return None
    marker = OffloadMarker(int(offload["min_bytes"]))
    counter = OffloadCounter()
    setattr(fc, offload["enable"], True)
    setattr(fc, offload["mark_pass"], marker)
    for name, value in offload["flags"].items():
        setattr(fc, name, bool(value))
    if COUNT_PASS in config_names(ic):
        setattr(ic, COUNT_PASS, counter)
    return marker, counter


def _train(
    spec: dict[str, Any],
    device: Any,
    result: dict[str, Any],
    passes: tuple[OffloadMarker, OffloadCounter] | None,
) -> None:
    import contextlib

    import torch

    from benchmarks import models
    from lmsbench.lms_setup import memory_cap

    cuda = device.type == "cuda"
    cfg = models.GPTConfig(**spec["gpt"])
    make_batch = models.token_batch(cfg)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def allocated() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    def lms_snapshot() -> dict[str, Any] | None:
        return dict(torch.cuda.lms_stats()) if spec["lms"] else None

    amp = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec["amp"]
        else contextlib.nullcontext()
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cap = spec.get("cap_bytes")
    with memory_cap(cap) if cuda else contextlib.nullcontext():
        if spec["lms"]:
            torch.cuda.set_limit_lms(int(spec.get("lms_limit_bytes") or 0))
            if spec.get("lms_size_bytes") is not None:
                torch.cuda.set_size_lms(int(spec["lms_size_bytes"]))
            torch.cuda.set_prefetch_lms(int(spec.get("lms_prefetch", 0)))
            if spec.get("lms_schedule") is not None:
                torch.cuda.set_schedule_lms(bool(spec["lms_schedule"]))
            if spec.get("lms_graph_prefetch") is not None:
                torch.cuda.set_graph_prefetch_lms(bool(spec["lms_graph_prefetch"]))
            torch.cuda.set_enabled_lms(True)
            torch.cuda.reset_accumulated_lms_stats()
            torch.cuda.reset_peak_lms_stats()
        torch.manual_seed(0)
        with device:
            model = models.GPT(cfg)
        model.train()
        optimizer = models.make_optimizer(model, "adamw")
        step_fn: Any = model
        if spec["compile"]:
            step_fn = torch.compile(model, backend=spec.get("backend", "inductor"))
        warmup, iterations = int(spec["warmup"]), int(spec["iterations"])
        times: list[float] = []
        step_times: list[float] = []
        losses: list[float] = []
        activation = 0
        before: dict[str, Any] | None = None
        steps_schedule: list[dict[str, int]] = []
        for step in range(warmup + iterations):
            if step == warmup:
                sync()
                before = lms_snapshot()
                if cuda:  # the peak of training, not of compiling and autotuning
                    result["warmup_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
            inputs, targets = make_batch(spec["batch"], device, step)
            if spec.get("vary_seq"):
                length = sequence_length(cfg.seq, step)
                inputs, targets = inputs[:, :length], targets[:, :length]
            sync()
            start = time.perf_counter()
            at_start = allocated()
            with amp:
                loss = models.lm_loss(step_fn(inputs), targets)
            activation = max(activation, allocated() - at_start)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach().float().cpu()))
            del inputs, targets, loss
            sync()
            elapsed = time.perf_counter() - start
            step_times.append(elapsed)
            if step == 0:
                result["first_step_s"] = elapsed
            if step >= warmup:
                times.append(elapsed)
            schedule = ""
            if spec["lms"]:
                # The learned swap schedule after each step: how long it takes to settle is
                # part of what a row's timed steps measure.
                state = lms_snapshot() or {}
                steps_schedule.append({key: int(state.get(key, 0)) for key in SCHEDULE_STEP_KEYS})
                schedule = ", schedule " + describe_schedule(steps_schedule[-1])
            print(
                f"  step {step}: {elapsed:.3f} s, loss {losses[-1]:.4f}{schedule}",
                file=sys.stderr,
            )
        after = lms_snapshot()
        result["iteration_times"] = times
        result["step_times"] = step_times
        result["losses"] = losses
        if steps_schedule:
            result["schedule_steps"] = steps_schedule
        result["activation_bytes"] = activation
        if cuda:
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        if before is not None and after is not None:
            result["pageout_bytes_per_iter"] = (
                after["pageout_bytes"] - before["pageout_bytes"]
            ) / iterations
            result["pagein_bytes_per_iter"] = (
                after["pagein_bytes"] - before["pagein_bytes"]
            ) / iterations
            result["stall_ms_per_iter"] = (after["stall_ms"] - before["stall_ms"]) / iterations
            result["lms"] = {k: v for k, v in after.items() if isinstance(v, (int, float))}
        if passes is not None:
            marker, counter = passes
            result["offload_marked_nodes"] = marker.marked
            result["offload_joint_graphs"] = marker.calls
            result["offload_counted_graphs"] = counter.graphs
            result["offloaded_tensors"] = counter.nodes
            if counter.graphs:
                result["offloaded_bytes_per_iter"] = counter.bytes
                if not counter.bytes:
                    result["detail"] = "the partitioner offloaded nothing"
            else:
                result["detail"] = "offloaded bytes not counted (no graph reached the count pass)"
        result["status"] = "ok"


def worker_main(spec_path: Path) -> int:
    return serve_worker(spec_path, run_worker)


# ---------------------------------------------------------------------------------------
# The parent: every configuration in a subprocess, within a time budget
# ---------------------------------------------------------------------------------------

Runner = Callable[[dict[str, Any], Path, dict[str, str], float], dict[str, Any]]


def subprocess_runner(
    spec: dict[str, Any], log_path: Path, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Runs one configuration in a fresh Python process (its own process group, so that a
    timeout also stops Inductor's compile workers); returns its result."""
    return harness.run_worker(Path(__file__), spec, log_path, env, timeout_s)


def child_environment(cache: Path) -> dict[str, str]:
    return harness.worker_env(
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton")
    )


def run_benchmark(
    args: argparse.Namespace,
    runner: Runner = subprocess_runner,
    support: OffloadSupport | None = None,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
) -> int:
    """Runs the reference, then every configuration at every cap; writes the outputs."""
    deadline = Deadline(args.time_budget_s, clock)
    if support is None:
        support = discover_offload_support()
    log(f"== compile-time offloading options of torch {support.torch_version}:")
    log(f"   {support.describe()}")
    if not support.has_budget:
        log(f"   (torch._functorch.config has no {BUDGET_NAME}: the budget rows are skipped)")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.cache_dir is not None:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="lms-compile-peers-", dir=args.cache_dir))
    env = child_environment(cache)
    rows: list[Row] = []
    run_env: dict[str, Any] = {}
    meta = {
        "model": "gpt",
        "gpt": gpt_spec(args),
        "batch": args.batch,
        "caps": args.caps,
        "configs": args.configs,
        "descriptions": DESCRIPTIONS,
        "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "compile_cache": "one temporary folder shared by the run's configurations",
    }
    log(
        f"== GPT-style decoder: {args.gpt_layers} layers, width {args.gpt_dim}, "
        f"{args.gpt_heads} heads, sequence {args.gpt_seq}, vocabulary {args.gpt_vocab}, "
        f"batch {args.batch}; compile cache {cache}"
    )

    def save(final: bool) -> str:
        if rows:
            fill_ratios(rows, rows[0])
        env_row = dict(run_env)
        backends = {r.lms_backend for r in rows if r.lms_backend}
        env_row["lms_backend"] = ",".join(sorted(backends))
        return write_outputs(out, rows, env_row, support, meta, final=final)

    def measure(row: Row, specs: Sequence[dict[str, Any]], retry_on: str = "") -> Row:
        """Runs the first spec, then the next ones while the previous ended in ``retry_on``."""
        rows.append(row)
        for i, spec in enumerate(specs):
            if deadline.left() < args.min_config_s:
                if i == 0:
                    row.status, row.detail = "skipped", "time budget"
                else:  # keep the last attempt's outcome
                    row.attempts.pop()
                    row.detail = f"{row.detail} (retry not run: time budget)"[:400]
                break
            row.settings = describe_settings(spec)
            row.budget = spec.get("budget")
            name = f"{row.config}-{cap_label(row.share).replace('/', 'of')}"
            began = clock()
            result = runner(
                spec,
                out / "logs" / f"{name}-{i}.log",
                env,
                min(args.config_timeout_s, max(1.0, deadline.left())),
            )
            row.worker_seconds = clock() - began
            row.absorb(result)
            found = result.get("environment", {})
            run_env.update({k: v for k, v in found.items() if v is not None and v != ""})
            if row.status == retry_on and i + 1 < len(specs):
                row.attempts.append(f"{row.settings}: {row.status} ({row.detail[:120]})")
                continue
            break
        log(f"   {row.config:<17} {cap_label(row.share):<9} {_describe(row)}")
        save(final=False)
        return row

    try:
        log("== uncapped")
        ref = measure(Row(REFERENCE, None, None), [worker_spec(args, REFERENCE, None)])
        for config in UNCAPPED_EXTRAS:
            if config in args.configs:
                measure(Row(config, None, None), [worker_spec(args, config, None)])
        if ref.status != "ok" or not ref.peak_allocated_bytes or ref.activation_bytes is None:
            log(
                f"compile_peers.py: the uncapped compiled reference failed ({ref.status}: "
                f"{ref.detail}); nothing to cap against: lower --batch or --gpt-seq"
            )
            return 1
        peak = int(ref.peak_allocated_bytes)
        for share in args.caps:
            cap = int(share * peak)
            log(f"== cap {cap_label(share)} of the compiled peak: {cap / GiB:.2f} GiB")
            for config in (*CAPPED_CONFIGS, *SCHEDULE_VARIANTS):
                if config not in args.configs:
                    continue
                row = Row(config, share, cap)
                if config == "compiled_budget":
                    if not support.has_budget:
                        rows.append(row)
                        row.status = "unavailable"
                        row.detail = f"torch._functorch.config has no {BUDGET_NAME}"
                        continue
                    b = args.budget
                    if b is None:
                        b = choose_budget(cap, peak, int(ref.activation_bytes), args.budget_margin)
                    specs = [worker_spec(args, config, cap, budget_value=b)]
                    if b > 0 and args.budget is None:
                        specs.append(worker_spec(args, config, cap, budget_value=0.0))
                    measure(row, specs, retry_on="oom")
                elif config == "compiled_offload":
                    if not support.usable:
                        rows.append(row)
                        row.status, row.detail = "unavailable", support.reason
                        log(f"   {config:<17} {cap_label(share):<9} unavailable: {support.reason}")
                        continue
                    min_bytes = int(args.offload_min_mb * MiB)
                    variants = [args.offload_stream and bool(support.stream_flags)]
                    if variants[0]:
                        variants.append(False)
                    specs = [
                        worker_spec(args, config, cap, offload=offload_spec(support, v, min_bytes))
                        for v in variants
                    ]
                    measure(row, specs, retry_on="error")
                else:
                    measure(row, [worker_spec(args, config, cap)])
    finally:
        table = save(final=True)
        log("\n" + table)
        log(f"\nwrote {out / CSV_NAME}, {out / JSON_NAME}, logs in {out / 'logs'}")
        if args.keep_cache:
            log(f"compile cache kept in {cache}")
        else:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


def _describe(r: Row) -> str:
    if r.status != "ok":
        return f"{r.status}" + (f" ({r.detail[:200]})" if r.detail else "")
    parts = [f"{(r.s_per_iter or 0) * 1000:.1f} ms/iter"]
    if r.peak_allocated_bytes is not None:
        parts.append(f"peak {r.peak_allocated_bytes / GiB:.2f} GiB")
    if r.activation_bytes is not None:
        parts.append(f"activations {r.activation_bytes / GiB:.2f} GiB")
    if r.pageout_bytes_per_iter:
        parts.append(f"paged out {r.pageout_bytes_per_iter / GiB:.2f} GiB/iter")
    if r.offloaded_bytes_per_iter:
        parts.append(f"offloaded {r.offloaded_bytes_per_iter / GiB:.2f} GiB/iter")
    if r.stall_ms_per_iter:
        parts.append(f"stall {r.stall_ms_per_iter:.1f} ms/iter")
    if r.budget is not None:
        parts.append(f"budget {r.budget:g}")
    if r.first_step_s is not None:
        parts.append(f"first step {r.first_step_s:.1f} s")
    if r.detail:
        parts.append(r.detail)
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
