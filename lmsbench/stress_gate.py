"""The stress suite's record classes and its gate, read by its runner
(``tests/regression/stress/runner.py``, which classifies each case and judges a run) and by
``benchmarks/summarize.py --stress`` (the gate's table of committed results). Standard
library only."""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

CLASSES = (
    "identical",
    "cap-not-binding",
    "reference-not-repeatable",
    "mismatch",
    "oom-expected",
    "oom-unexpected",
    "crash",
    "error",
    "reference-failed",
)
# Classes that pass the gate; every other class (those below, and any the runner does not
# know, e.g. "mismatch-explained" in results of older runners) fails it.
GATE_PASSES = ("identical", "cap-not-binding", "reference-not-repeatable", "oom-expected")
GATE_FAILURES = ("crash", "error", "mismatch", "oom-unexpected", "reference-failed")
NOT_COUNTED = ("cap-not-binding",)


def counted(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that count as cases: every class but ``cap-not-binding``."""
    return [r for r in records if r.get("class") not in NOT_COUNTED]


def gate_failures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that fail the gate: every record whose class does not pass."""
    return [r for r in records if r.get("class") not in GATE_PASSES]


def gate_verdict(records: list[dict[str, Any]]) -> tuple[bool, str]:
    """Whether the gate passes over every record, and why not."""
    failures = gate_failures(records)
    if failures:
        return False, f"{len(failures)} failing record(s)"
    if not counted(records):
        return False, "no case where the cap binds"
    return True, ""


def record_order(record: dict[str, Any]) -> tuple[int, str, int]:
    """The order of records: by seed, then time, then attempt."""
    return (
        int(record["seed"]),
        str(record.get("timestamp") or ""),
        int(record.get("attempt") or 0),
    )


RESULTS_NAMES = ("results.jsonl", "results.jsonl.xz")


def results_file(path: Path) -> Path | None:
    """The records file of ``path``: the file itself, or a folder's ``results.jsonl``, or
    its ``results.jsonl.xz`` (committed results are kept compressed); None when there is
    none."""
    if not path.is_dir():
        return path if path.is_file() else None
    return next((path / n for n in RESULTS_NAMES if (path / n).is_file()), None)


def read_results(file: Path) -> str:
    """The text of a records file, decompressed when it ends in ``.xz``."""
    if file.suffix == ".xz":
        with lzma.open(file, "rt") as f:
            return f.read()
    return file.read_text()


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Every record of results.jsonl files (compressed or not, or folders holding one), in
    seed and time order; a record found twice (the same folder given twice, or a merge merged
    again) is kept once."""
    seen: set[str] = set()
    records: list[dict[str, Any]] = []
    for path in paths:
        file = results_file(path)
        if file is None:
            raise FileNotFoundError(f"no results.jsonl or results.jsonl.xz in {path}")
        for line in read_results(file).splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            key = json.dumps(record, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                records.append(record)
    return sorted(records, key=record_order)
