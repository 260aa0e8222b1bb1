"""Markdown table of the LMS regression matrix from ``regression-results.json``.

    python -m tests.regression.lms_matrix_summary out/matrix*/regression-results.json

One row per test of ``test_families.py`` (a skipped one is named by its test id): family,
cap, seconds per iteration (LMS run and uncapped reference), bytes paged out per iteration,
the deficit (uncapped peak minus cap, or need minus LMS limit without a cap), the largest
allocation seen inside an operator (a lower bound, from the uncapped run), stall time,
whether the LMS run is bit-identical to the reference and whether the reference repeats,
the host-memory budget of the row (``default``: the one LMS derives from the host), what
became of each worker process (finished, host OOM, device OOM, error, killed by a signal)
and the test's outcome. Values recorded per rank or per process are shown joined by ``/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lmsbench.harness import engine_words, markdown_table, write_text
from lmsbench.matrix_cells import gib, host_budget, ms, seconds, workers, yes

COLUMNS = (
    "family",
    "cap",
    "s/iter (LMS)",
    "s/iter (uncapped)",
    "paged out/iter",
    "deficit",
    "largest alloc",
    "stall ms",
    "bit-identical",
    "reference repeats",
    "host budget",
    "workers",
    "outcome",
)


def row(entry: dict[str, Any]) -> list[str]:
    """The table cells of one test entry of ``regression-results.json``."""
    test_id = str(entry.get("test", "")).rsplit("::", 1)[-1]
    return [
        str(entry.get("family", test_id)),
        str(entry.get("cap", "")),
        seconds(entry.get("s_per_iter"), collapse=False),
        seconds(entry.get("reference_s_per_iter"), collapse=False),
        gib(entry.get("pageout_bytes_per_iter"), collapse=False),
        gib(entry.get("deficit_bytes"), collapse=False),
        gib(entry.get("largest_alloc_bytes"), collapse=False),
        ms(entry.get("stall_ms"), collapse=False),
        yes(entry.get("bit_identical"), collapse=False),
        yes(entry.get("reference_repeatable"), collapse=False),
        host_budget(entry.get("host_limit_bytes"), collapse=False),
        workers(entry.get("worker_outcomes"), collapse=False),
        str(entry.get("outcome", "")),
    ]


def render(*documents: dict[str, Any]) -> str:
    """The markdown table of one or more results documents (runs of parts of the matrix,
    e.g. on a one-GPU and a two-GPU machine), after a line naming each one's device, versions
    and engine commit."""
    entries = [
        t
        for results in documents
        for t in results.get("tests", [])
        if "family" in t or "test_families.py" in t.get("test", "")
    ]
    lines = []
    for results in documents:
        env = results.get("environment", {})
        if env:
            lines.append(
                f"Device: {env.get('device', 'unknown')}, torch {env.get('torch', '?')}, "
                f"CUDA {env.get('cuda', '?')}, driver {env.get('driver', '?')}, "
                f"LMS backend {env.get('lms_backend', '?')}, {engine_words(env)}, "
                f"{env.get('date', '')}"
            )
            lines.append("")
    rows = [row(entry) for entry in entries]
    if not rows:
        rows = [["(no matrix results)"] + [""] * (len(COLUMNS) - 1)]
    lines.append(markdown_table(COLUMNS, rows))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="regression-results.json files")
    parser.add_argument("--output", type=Path, help="write the table here too")
    args = parser.parse_args(argv)
    table = render(*(json.loads(path.read_text()) for path in args.results))
    sys.stdout.write(table)
    if args.output is not None:
        write_text(args.output, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
