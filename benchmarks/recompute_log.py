"""Why the hybrid paged what it paged: a summary of the engine's recompute log.

With ``PYTORCH_LMS_RECOMPUTE_LOG=1`` the engine prints one line to stderr for each decision
recompute takes part in: each victim a reclaim chose (and why it has no recipe to be dropped
by), each victim it priced (replay against paging: dropped or paged out), each candidate of a
cheap drop, each recipe that could not be priced (and why), and each in-place step that
extended a recipe. A run prints thousands of them; this module counts them by kind and
reason, with their bytes, so that the bytes a run paged out can be split into "no recipe",
"replay dearer than paging" and each reason a recipe could not be priced::

    PYTORCH_LMS_RECOMPUTE_LOG=1 python -m benchmarks.compare ... 2> recompute.log
    python -m benchmarks.recompute_log recompute.log
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_PREFIX = "LMS recompute: "
_VICTIM = re.compile(r"victim of (\d+) bytes: (.+)$")
_PRICED = re.compile(
    r"(\d+) bytes: recompute (-?[\d.]+) ms, paging (-?[\d.]+) ms \(stall share [\d.]+\): (.+)$"
)
_CANDIDATE = re.compile(
    r"candidate of (\d+) bytes, next use in \d+ operators: recompute (-?[\d.]+) ms, "
    r"paging (-?[\d.]+) ms: (.+)$"
)
_CANNOT = re.compile(r"(\S+) cannot be recomputed now: (.+)$")
_EXTENDS = re.compile(r"(\S+) extends the recipe of (\S+)$")
_KEPT = re.compile(r"(\S+) output kept the recipe of (\S+)$")


@dataclass
class Tally:
    """Counts and bytes per key."""

    count: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    def add(self, key: str, nbytes: int = 0) -> None:
        self.count[key] += 1
        self.bytes[key] += nbytes


@dataclass
class Summary:
    """The log's lines by kind; ``unpriced`` counts the recipe lines with a negative price."""

    victims: Tally = field(default_factory=Tally)
    priced: Tally = field(default_factory=Tally)
    candidates: Tally = field(default_factory=Tally)
    cannot: Tally = field(default_factory=Tally)
    steps: Tally = field(default_factory=Tally)
    lines: int = 0
    other: int = 0


def summarize(lines: Iterable[str]) -> Summary:
    """Counts the engine's recompute log lines among ``lines`` (other lines are skipped)."""
    out = Summary()
    for raw in lines:
        at = raw.find(_PREFIX)
        if at < 0:
            continue
        out.lines += 1
        text = raw[at + len(_PREFIX) :].strip()
        if m := _VICTIM.match(text):
            out.victims.add(m[2], int(m[1]))
        elif m := _PRICED.match(text):
            replay, paging = float(m[2]), float(m[3])
            why = m[4] if replay >= 0 else f"{m[4]} (no price)"
            if m[4] == "paged out" and 0 <= paging <= replay:
                why = "paged out (replay dearer than paging)"
            out.priced.add(why, int(m[1]))
        elif m := _CANDIDATE.match(text):
            why = m[4] if float(m[2]) >= 0 else f"{m[4]} (no price)"
            out.candidates.add(why, int(m[1]))
        elif m := _CANNOT.match(text):
            out.cannot.add(f"{m[1]}: {m[2]}")
        elif m := _EXTENDS.match(text):
            out.steps.add(f"{m[1]} extends {m[2]}")
        elif m := _KEPT.match(text):
            out.steps.add(f"{m[1]} kept the recipe of {m[2]}")
        else:
            out.other += 1
    return out


def _table(title: str, tally: Tally, with_bytes: bool) -> list[str]:
    if not tally.count:
        return []
    rows = [f"{title}:"]
    for key, count in tally.count.most_common():
        gib = f"  {tally.bytes[key] / 2**30:10.2f} GiB" if with_bytes else ""
        rows.append(f"  {count:8d}{gib}  {key}")
    return rows


def render(summary: Summary) -> str:
    """The summary as text: one table per kind of line, most frequent first."""
    rows = [f"{summary.lines} recompute log lines ({summary.other} not understood)"]
    rows += _table("victims a reclaim chose", summary.victims, True)
    rows += _table("victims priced (replay against paging)", summary.priced, True)
    rows += _table("cheap-drop candidates", summary.candidates, True)
    rows += _table("recipes that could not be priced", summary.cannot, False)
    rows += _table("in-place steps", summary.steps, False)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.recompute_log",
        description="Summarize the engine's recompute log (PYTORCH_LMS_RECOMPUTE_LOG=1 on "
        "stderr): what reclaims dropped and paged, and why.",
    )
    parser.add_argument("log", type=Path, nargs="?", help="the log file (default: stdin)")
    args = parser.parse_args(argv)
    if args.log is None:
        summary = summarize(sys.stdin)
    else:
        if not args.log.is_file():
            parser.error(f"no such log file: {args.log}")
        with args.log.open(errors="replace") as f:
            summary = summarize(f)
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
