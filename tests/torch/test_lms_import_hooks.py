"""torch/cuda/lms.py on the CPU: the Inductor modules LMS wraps (the Triton launcher, the CUDA
graph tree manager, cudagraphify, Inductor's configuration) are wrapped however and whenever
they were imported.

Each check runs in a fresh interpreter, where lms.py is imported from a package laid out as
the drop-in extension ships it (``torch_lms``) with stand-in bindings: whether Inductor is
imported already is part of what is tested."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from fake_torch_lms import build_fake_torch_lms, run_python

pytest.importorskip("torch", reason="needs a torch wheel (the CPU one is enough)")

# Prints whether each wrapped module carries LMS's wrapper.
REPORT = """
from torch._inductor import compile_fx, cudagraph_trees

print(
    getattr(cudagraph_trees.CUDAGraphTreeManager, "_lms_graph_pool_fallback", False),
    getattr(compile_fx.cudagraphify, "_lms_graph_pool_fallback", False),
    getattr(cudagraph_trees.CUDAGraphNode._record, "_lms_resident_inputs", False),
)
"""


def run_script(tmp_path: Path, *parts: str) -> list[str]:
    """Runs the parts of a script (each dedented) in a fresh interpreter that finds the
    package; returns what it printed, split into words."""
    script = "".join(textwrap.dedent(part) for part in parts)
    env = build_fake_torch_lms(tmp_path, ["_lms_cudagraphs.py", "_lms_graph.py"])
    return run_python(env, script).split()


def test_the_finder_stays_in_place_while_it_finds_a_module(tmp_path: Path) -> None:
    """Inductor imports from several threads: a module another thread imports while the
    finder would be out of sys.meta_path would stay unwrapped, so the finder never leaves."""
    setup = """
    import sys

    import torch_lms.lms

    seen = []


    class Last:
        def find_spec(self, fullname, path, target=None):
            if fullname == "torch._inductor.cudagraph_trees":
                seen.append(any(type(f).__name__ == "_WrapOnImport" for f in sys.meta_path))
            return None


    sys.meta_path.insert(1, Last())  # asked right after the finder of lms.py
    """
    assert run_script(tmp_path, setup, REPORT, "print(seen)\n") == [
        "True",
        "True",
        "True",
        "[True]",
    ]


def test_enabling_lms_wraps_modules_imported_past_the_finder(tmp_path: Path) -> None:
    """A module imported unwrapped (here: with the finder taken out) is wrapped when LMS is
    enabled, before LMS manages anything."""
    setup = """
    import sys

    import torch_lms.lms as lms

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_WrapOnImport"]
    """
    enable = "lms.set_enabled_lms(True)\n"
    assert run_script(tmp_path, setup, REPORT, enable, REPORT) == [
        "False",
        "False",
        "False",
        "True",
        "True",
        "True",
    ]


def test_modules_imported_before_lms_are_wrapped_when_it_is_imported(tmp_path: Path) -> None:
    setup = """
    import torch._inductor.compile_fx
    import torch._inductor.cudagraph_trees

    import torch_lms.lms
    """
    assert run_script(tmp_path, setup, REPORT) == ["True", "True", "True"]
