"""Shared test configuration: makes the project importable from a plain checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

# `make test` exports the make variables the user gave (LMSTOOL_MAKE_VARS, which lmstool adds
# to the make commands its messages suggest): the tests check those messages as a plain call
# writes them, whatever make was given.
os.environ.pop("LMSTOOL_MAKE_VARS", None)
