"""Tests of examples/ and benchmarks/: their folders are put on sys.path, as the scripts do."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BENCHMARKS = REPO / "benchmarks"
for path in (EXAMPLES, BENCHMARKS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
