"""Markdown cells of the regression matrix's rows (``regression-results.json``).

The one source of the cell formatting of two tables of the matrix:
``benchmarks/summarize.py --matrix`` (the tables of docs/results.md) and
``tests/regression/lms_matrix_summary.py`` (``matrix-summary.md`` of a GPU run). Standard
library only: it runs from a bare checkout.

A value is recorded once, or per rank or process (a list). The two tables show a list
differently, chosen by ``collapse``:

- ``collapse=True`` (summarize.py): one cell, "-" for a process that did not record the value,
  a single value where every process has the same, "" where none recorded it; the worker
  outcomes as runs ("finished / host OOM x3").
- ``collapse=False`` (lms_matrix_summary.py): every value joined by " / ", a missing one
  shown as "" ("n/a" for a yes/no flag); every worker outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GiB = 1 << 30


def many(value: Any) -> list[Any]:
    """``value`` as a list: the values of a list or tuple, else ``value`` alone."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def per_process(value: Any, fmt: Callable[[Any], str]) -> str:
    """A value recorded once, or per rank or process: one cell, "-" for a process that did
    not record it, a single value where every process has the same."""
    cells = ["-" if v is None else fmt(v) for v in many(value)]
    if value is None or all(c == "-" for c in cells):
        return ""
    return cells[0] if len(set(cells)) == 1 else " / ".join(cells)


def every_value(value: Any, fmt: Callable[[Any], str], missing: str = "") -> str:
    """Every value recorded (once, or per rank or process) joined by " / ", ``missing`` for
    one not recorded."""
    return " / ".join(missing if v is None else fmt(v) for v in many(value))


def _cell(value: Any, fmt: Callable[[Any], str], collapse: bool, missing: str = "") -> str:
    return per_process(value, fmt) if collapse else every_value(value, fmt, missing)


def _in_gib(v: Any) -> str:
    return f"{float(v) / GiB:.2f} GiB"


def seconds(value: Any, collapse: bool = True) -> str:
    return _cell(value, lambda v: f"{float(v):.3f}", collapse)


def gib(value: Any, collapse: bool = True) -> str:
    return _cell(value, _in_gib, collapse)


def ms(value: Any, collapse: bool = True) -> str:
    return _cell(value, lambda v: f"{float(v):.0f}", collapse)


def yes(value: Any, collapse: bool = True) -> str:
    return _cell(value, lambda v: "yes" if v else "no", collapse, missing="n/a")


def host_budget(value: Any, collapse: bool = True) -> str:
    """The host-memory budget: "default" for 0 (the one LMS derives from the host)."""
    return _cell(value, lambda v: "default" if v == 0 else _in_gib(v), collapse)


def workers(value: Any, collapse: bool = True) -> str:
    """What became of each worker process: "finished / host OOM x3" (``collapse``), else
    every process's outcome."""
    if not collapse:
        return every_value(value, str)
    words = [str(v) for v in many(value) if v is not None]
    runs: list[tuple[str, int]] = []
    for word in words:
        if runs and runs[-1][0] == word:
            runs[-1] = (word, runs[-1][1] + 1)
        else:
            runs.append((word, 1))
    return " / ".join(w if n == 1 else f"{w} x{n}" for w, n in runs)
