"""The stat keys that engine/test/test_cuda_lms.py (the GPU test the series adds to PyTorch's
test/) expects of lms_stats() are exactly those of the bindings' stats dict.

That test runs inside a PyTorch tree, where this checkout's files are out of reach, so it keeps
its own literal lists; this check, on the CPU and without torch, keeps them from going stale."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_TEST = ROOT / "engine/test/test_cuda_lms.py"
BINDINGS = ROOT / "engine/torch/csrc/cuda/LmsBindings.cpp"
HEADER = ROOT / "engine/c10/cuda/LargeModelSupport.h"


def _between(text: str, start: str, end: str) -> str:
    begin = text.index(start)
    return text[begin : text.index(end, begin)]


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


def binding_entries() -> dict[str, str]:
    """Key -> value expression of each entry of statsToDict() in the bindings."""
    to_dict = _between(BINDINGS.read_text(), "py::dict statsToDict(", "\n}\n")
    entries = re.findall(r'dict\["(\w+)"\] = (.*);', to_dict)
    keys = [key for key, _ in entries]
    assert len(keys) == len(set(keys)), keys
    return dict(entries)


def test_gpu_test_stat_keys_are_the_bindings() -> None:
    lists = gpu_test_lists()
    counters, gauges = lists["COUNTERS"], lists["GAUGES"]
    assert len(counters) == len(set(counters)), counters
    assert len(gauges) == len(set(gauges)), gauges
    entries = binding_entries()
    binding_gauges = {key for key, value in entries.items() if value.startswith("gaugeToDict(")}
    binding_counters = set(entries) - binding_gauges
    assert set(counters) == binding_counters, set(counters) ^ binding_counters
    assert set(gauges) == binding_gauges, set(gauges) ^ binding_gauges
    for key in ("graph_prefetch_count", "drop_count", "recompute_ms", "dropped_bytes"):
        assert key in entries, key


def test_gpu_test_float_counters_are_the_header_doubles() -> None:
    """The counters the GPU test expects as floats are LmsStats' double fields."""
    fields = _between(HEADER.read_text(), "struct LmsStats {", "};")
    doubles = set(re.findall(r"^\s*double (\w+)", fields, re.M))
    floats = gpu_test_lists()["FLOAT_COUNTERS"]
    assert set(floats) == doubles, set(floats) ^ doubles
    assert set(floats) <= set(gpu_test_lists()["COUNTERS"])
