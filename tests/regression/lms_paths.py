"""Where the regression suite, its matrix and the stress suite find what they share with the
benchmarks: ``benchmarks/harness.py`` (a workload in a process of its own under a time limit,
one record schema with provenance), ``benchmarks/matrix_cells.py`` (the cells of the matrix's
tables) and ``examples/_lms_setup.py`` (versions, provenance, option types).

Those folders hold scripts, not packages; their scripts find each other by putting the folder
on ``sys.path`` (``benchmarks/compare.py`` does so), and :func:`use_shared_modules` does the
same for the code here, before ``import harness``::

    from lms_paths import use_shared_modules  # tests/regression on sys.path

    use_shared_modules()
    import harness  # noqa: E402

The stress suite, a package run as ``python -m tests.regression.stress.runner`` from the
repository root, imports this module as ``tests.regression.lms_paths``. Nothing here imports
torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
EXAMPLES = REPO / "examples"


def use_shared_modules() -> None:
    """Puts ``benchmarks/`` and ``examples/`` on ``sys.path`` (once)."""
    for path in (EXAMPLES, BENCHMARKS):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
