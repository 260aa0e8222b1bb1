"""Two engines side by side: compare.py runs of a base engine and of a head engine, made in
one call on one GPU (``scripts/gpu/run-ab.sh``), row by row.

Each row of a method at a factor that both sides measured (the same model and regime) gets its
steady-state time per sample on each side (the median of the timed iterations over the row's
batch: no-cap batches follow the memory free when each call started, so the two sides' may
differ a little), the change from base to head, and, where both rows were profiled
(``--profile-iterations``), each step phase's busy time and idle time while copying, per
iteration, and each side's iteration 0 (with the time LMS spent pinning host memory in
it). ``--pair A=B`` also sets method A against method B of the head's own run (a setting
turned on against the default, in one process). Rows only one side has are listed.

  python -m benchmarks.ab BASE HEAD [--pair lms_residual=lms] [--max-slowdown 3] [--out FILE]

``--max-slowdown PCT``: exit 1 where a base-against-head row of an LMS method is more than PCT
percent slower per sample on the head (the rows are named). The rule is the caller's, fixed
before the run; this only applies it to what was measured.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import compare
from benchmarks.speed import Run, load_runs, steady_median
from lmsbench.harness import markdown_table

# The step phases compare.py names (stream_profile.PHASE_PREFIX), in their order.
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True, order=True)
class Key:
    """A row of one side: model, regime, factor and method."""

    model: str
    regime: str
    factor: float
    method: str

    def label(self) -> str:
        return f"{self.model} {self.regime} {self.factor:g}x {self.method}"


@dataclass
class Side:
    """One side's rows (all but those skipped), by key, and the engines its runs record."""

    rows: dict[Key, dict[str, Any]]
    engines: list[str]


def engine_text(environment: dict[str, Any]) -> str:
    commit = str(environment.get("engine_commit") or "unknown")[:7]
    return f"{commit}{' (dirty)' if environment.get('engine_dirty') else ''}"


def load_side(folder: Path) -> Side:
    """The rows of every compare.py record under ``folder`` (the first of a key where two
    records have it)."""
    rows: dict[Key, dict[str, Any]] = {}
    engines: list[str] = []
    for run in load_runs([folder], str):
        engine = engine_text(run.record.get("environment", {}))
        if engine not in engines:
            engines.append(engine)
        for row in run.record.get("measurements", []):
            if row.get("factor") is None or row.get("status") == "skipped":
                continue
            key = Key(run.model, run.regime, float(row["factor"]), str(row["method"]))
            rows.setdefault(key, row | {"_run": run})
    return Side(rows, engines)


def per_sample_s(row: dict[str, Any]) -> float | None:
    """A row's steady-state seconds per sample; None where it did not train."""
    if row.get("status") != "ok":
        return None
    median = steady_median([float(x) for x in row.get("iteration_times") or []])
    if median is None and row.get("iteration_s") is not None:
        median = float(row["iteration_s"])
    batch = int(row.get("batch") or 0)
    return median / batch if median is not None and batch > 0 else None


def phases(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A profiled row's step phases: stream_profile's figures, per iteration."""
    profile = row.get("profile") or {}
    return {
        name: {k: float(v) for k, v in figures.items()}
        for name, figures in (profile.get("phases") or {}).items()
    }


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _s(value: float | None, batch: int) -> str:
    return "" if value is None else f"{value * batch:.3f}"


def first_iteration(row: dict[str, Any]) -> str:
    """A row's iteration 0 where it trained: its seconds, and the milliseconds LMS spent
    pinning host memory in it where the row has LMS's account of it."""
    warm = row.get("warmup_times") or []
    if row.get("status") != "ok" or (not warm and row.get("first_iteration_s") is None):
        return ""
    seconds = float(warm[0]) if warm else float(row["first_iteration_s"])
    account = row.get("first_iteration") or {}
    pinned = account.get("host_pin_ms")
    return f"{seconds:.2f}" + ("" if pinned is None else f" ({float(pinned):.0f} ms pinning)")


def comparison_row(label: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``label``, each side's batch and seconds per iteration, the change per sample, each
    side's iteration 0, and each phase's busy and idle-while-copying milliseconds, a side to
    b side."""
    sa, sb = per_sample_s(a), per_sample_s(b)
    change = "" if sa is None or sb is None else f"{(sb / sa - 1) * 100:+.1f}%"
    pa, pb = phases(a), phases(b)
    cells = []
    for phase in PHASES:
        fa, fb = pa.get(phase), pb.get(phase)
        if fa is None and fb is None:
            cells.append("")
            continue
        cells.append(
            f"{_ms(fa and fa.get('busy_ms'))} / {_ms(fb and fb.get('busy_ms'))}; "
            f"{_ms(fa and fa.get('idle_while_copying_ms'))} / "
            f"{_ms(fb and fb.get('idle_while_copying_ms'))}"
        )
    batch_a, batch_b = int(a.get("batch") or 0), int(b.get("batch") or 0)
    return [
        label,
        f"{batch_a} / {batch_b}",
        f"{_s(sa, batch_a) or str(a.get('status'))} / {_s(sb, batch_b) or str(b.get('status'))}",
        change,
        f"{first_iteration(a)} / {first_iteration(b)}",
        *cells,
    ]


HEADER = (
    "row",
    "batch",
    "s/iter",
    "change per sample",
    "iteration 0 (s)",
    *(f"{p}: busy; idle while copying (ms)" for p in PHASES),
)


def report(
    base: Side, head: Side, pairs: Iterable[tuple[str, str]], max_slowdown_pct: float | None
) -> tuple[str, list[str]]:
    """The comparison as Markdown, and the rows over ``max_slowdown_pct`` (base against
    head, LMS methods)."""
    lines = [
        f"Base engine {', '.join(base.engines) or 'unknown'}; head engine "
        f"{', '.join(head.engines) or 'unknown'}. Each cell is base / head.",
        "",
    ]
    rows, slower = [], []
    for key in sorted(set(base.rows) & set(head.rows)):
        a, b = base.rows[key], head.rows[key]
        rows.append(comparison_row(key.label(), a, b))
        sa, sb = per_sample_s(a), per_sample_s(b)
        if (
            max_slowdown_pct is not None
            and key.method in compare.LMS_METHODS
            and sa is not None
            and sb is not None
            and sb > sa * (1 + max_slowdown_pct / 100)
        ):
            slower.append(f"{key.label()}: {(sb / sa - 1) * 100:+.1f}% per sample")
    lines.append(markdown_table(HEADER, rows) if rows else "No row both sides measured.")
    paired = []
    for method, against in pairs:
        for key in sorted(head.rows):
            if key.method != method:
                continue
            other = Key(key.model, key.regime, key.factor, against)
            if other in head.rows:
                paired.append(
                    comparison_row(
                        f"{key.label()} against {against}", head.rows[other], head.rows[key]
                    )
                )
    if paired:
        lines += [
            "",
            "The head's methods against each other (each cell: AGAINST / METHOD):",
            "",
        ]
        lines.append(markdown_table(HEADER, paired))
    only = [f"base only: {k.label()}" for k in sorted(set(base.rows) - set(head.rows))]
    only += [f"head only: {k.label()}" for k in sorted(set(head.rows) - set(base.rows))]
    if only:
        lines += ["", *only]
    if max_slowdown_pct is not None:
        lines += [
            "",
            f"Slower than {max_slowdown_pct:g}% per sample on the head: "
            + ("; ".join(slower) if slower else "none"),
        ]
    return "\n".join(lines) + "\n", slower


def parse_pair(text: str) -> tuple[str, str]:
    method, sep, against = text.partition("=")
    if not sep or method not in compare.PEER_METHODS or against not in compare.PEER_METHODS:
        raise argparse.ArgumentTypeError(
            f"--pair wants METHOD=AGAINST of compare.py's methods "
            f"({', '.join(compare.PEER_METHODS)}), got {text!r}; e.g. --pair lms_residual=lms"
        )
    return method, against


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ab",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("base", type=Path, help="the base engine's compare.py results")
    parser.add_argument("head", type=Path, help="the head engine's compare.py results")
    parser.add_argument(
        "--pair",
        type=parse_pair,
        action="append",
        default=[],
        help="METHOD=AGAINST: also set the head's METHOD rows against its AGAINST rows",
    )
    parser.add_argument(
        "--max-slowdown",
        type=float,
        default=None,
        metavar="PCT",
        help="exit 1 where an LMS row is more than PCT percent slower per sample on the head",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for folder in (args.base, args.head):
        if not folder.is_dir():
            print(
                f"benchmarks.ab: no folder {folder}: give compare.py's --out folders",
                file=sys.stderr,
            )
            return 2
    base, head = load_side(args.base), load_side(args.head)
    if not base.rows or not head.rows:
        empty = args.base if not base.rows else args.head
        print(
            f"benchmarks.ab: no compare.py results (compare-*.json, nocap-*.json) under {empty}",
            file=sys.stderr,
        )
        return 2
    text, slower = report(base, head, args.pair, args.max_slowdown)
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Key", "Run", "Side", "load_side", "main", "per_sample_s", "phases", "report"]
