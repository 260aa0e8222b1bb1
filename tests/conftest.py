"""Shared test configuration.

The repository root is on the Python path of every test session (``pythonpath`` in
pyproject.toml's pytest section), so that ``lmstool``, ``lmsbench``, ``benchmarks`` and the
helpers under ``tests/`` import from a plain checkout, installed or not.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# `make test` exports the make variables the user gave (LMSTOOL_MAKE_VARS, which lmstool adds
# to the make commands its messages suggest): the tests check those messages as a plain call
# writes them, whatever make was given.
os.environ.pop("LMSTOOL_MAKE_VARS", None)


def pytest_configure(config: pytest.Config) -> None:
    """Stops the run when $LMS_SOURCES names no folder: each test of real PyTorch sources would
    skip for want of its tarball, and the run would pass with them all left out."""
    sources = os.environ.get("LMS_SOURCES", "").strip()
    if sources and not Path(sources).is_dir():
        raise pytest.UsageError(
            f"LMS_SOURCES={sources} is not a folder, so the tests of real PyTorch sources would "
            f"all skip. Download their release tarballs there (`make sources SOURCES={sources}`), "
            f"name the folder that holds them, or unset LMS_SOURCES to run without them"
        )
