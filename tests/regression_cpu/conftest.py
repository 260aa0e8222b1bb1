"""CPU tests of the GPU regression matrix's helpers: ``tests/regression`` goes on sys.path.

``tests/regression`` itself is skipped without a GPU; what can be checked on a CPU (the
models at tiny sizes, the worker's run logic against a stand-in for the CUDA calls, the
summary table) is checked here, so continuous integration covers it.
"""

from __future__ import annotations

import sys
from pathlib import Path

REGRESSION = Path(__file__).resolve().parents[1] / "regression"
if str(REGRESSION) not in sys.path:
    sys.path.insert(0, str(REGRESSION))
