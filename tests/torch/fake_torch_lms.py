"""A ``torch_lms`` package on disk, as the drop-in extension ships its Python modules, with a
pure-Python ``_C`` standing for the compiled bindings: for tests that import ``torch_lms`` in
a process of its own (``tests/torch`` is on ``sys.path`` when pytest imports its tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ENGINE = Path(__file__).resolve().parents[2] / "engine/torch/cuda"

# The bindings lms.py reads; a test adds those its modules read too.
FAKE_EXTENSION_C = '''
"""Stands for torch_lms._C: the bindings lms.py and the modules beside it read."""


def _cuda_lms_setEnabled(enabled):
    pass


def _cuda_lms_getEnabled():
    return True
'''


def build_fake_torch_lms(
    root: Path, modules: Sequence[str], *, init: str = "", bindings: str = ""
) -> dict[str, str]:
    """Writes ``root/site/torch_lms``: ``__init__.py`` holding ``init``, ``lms.py`` and the
    ``modules`` (file names) copied from ``engine/torch/cuda``, and ``_C.py`` with the bindings
    of :data:`FAKE_EXTENSION_C` and ``bindings`` (more of them). Returns this process's
    environment with ``root/site`` first on ``PYTHONPATH``, for a process that imports it."""
    package = root / "site" / "torch_lms"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    for name in ("lms.py", *modules):
        (package / name).write_bytes((ENGINE / name).read_bytes())
    (package / "_C.py").write_text(textwrap.dedent(FAKE_EXTENSION_C) + textwrap.dedent(bindings))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package.parent), env.get("PYTHONPATH")]))
    return env


def run_python(env: dict[str, str], script: str, *args: str) -> str:
    """Runs ``script`` with ``args`` in a fresh interpreter with ``env`` (from
    :func:`build_fake_torch_lms`); returns what it printed, after checking it succeeded."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def load_engine_module(name: str, path: Path) -> ModuleType:
    """The engine module at ``path`` imported under ``name``, once per process: it is put in
    ``sys.modules`` before it runs, so that pickle and Inductor find its classes, and a module
    that registers process-wide state (an operator) is not loaded twice."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
