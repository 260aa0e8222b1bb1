"""The stat keys that engine/test/test_cuda_lms.py (the GPU test the series adds to PyTorch's
test/) expects of lms_stats() are exactly those of the statistics table, from which the
bindings make their stats dict.

That test runs inside a PyTorch tree, where this checkout's files are out of reach, so it keeps
its own literal lists (generated from the table by `python -m lmstool tables`); this check, on
the CPU and without torch, keeps them from going stale."""

from __future__ import annotations

import ast
from pathlib import Path

from lmstool import tables

ROOT = Path(__file__).resolve().parents[2]
GPU_TEST = ROOT / "engine/test/test_cuda_lms.py"


def gpu_test_lists() -> dict[str, tuple[str, ...]]:
    """The module-level tuples of string literals of the GPU test, by name."""
    lists: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(GPU_TEST.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    value = ast.literal_eval(node.value)
                    if all(isinstance(item, str) for item in value):
                        lists[target.id] = value
    return lists


def test_gpu_test_stat_keys_are_the_table() -> None:
    lists = gpu_test_lists()
    rows = tables.read_stats(ROOT)
    assert lists["COUNTERS"] == tuple(row.name for row in rows if not row.gauge)
    assert lists["GAUGES"] == tuple(row.name for row in rows if row.gauge)
    for key in ("graph_prefetch_count", "drop_count", "recompute_ms", "dropped_bytes"):
        assert key in lists["COUNTERS"] + lists["GAUGES"], key


def test_gpu_test_float_counters_are_the_table_doubles() -> None:
    """The counters the GPU test expects as floats are LmsStats' double fields."""
    rows = tables.read_stats(ROOT)
    floats = gpu_test_lists()["FLOAT_COUNTERS"]
    assert floats == tuple(row.name for row in rows if row.type == "double")
    assert set(floats) <= set(gpu_test_lists()["COUNTERS"])
