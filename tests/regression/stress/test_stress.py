"""GPU entry of the randomized LMS stress suite: a few seeds through the runner, gate asserted.

``LMS_STRESS_SEEDS`` (default 8; 0 skips) seeds from ``LMS_STRESS_START`` (default 0); the
gate is ``runner.gate_verdict`` over their records (it also fails when the cap binds in none
of them). Like everything under ``tests/regression`` it is marked ``gpu`` and skipped, with
the reason, without a CUDA device or without LMS (``tests/regression/conftest.py``). With
``LMS_RESULTS_DIR`` set, the runner's output goes to ``$LMS_RESULTS_DIR/stress``. The full
suite (100+ cases) runs with ``scripts/gpu/run-stress.sh``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from . import runner


def test_stress_gate(record: Callable[[str, Any], None]) -> None:
    count = int(os.environ.get("LMS_STRESS_SEEDS", "8"))
    start = int(os.environ.get("LMS_STRESS_START", "0"))
    if count <= 0:
        pytest.skip("LMS_STRESS_SEEDS=0")
    results = os.environ.get("LMS_RESULTS_DIR", "").strip()
    out = Path(results) / "stress" if results else Path(tempfile.mkdtemp(prefix="lms-stress-"))
    launcher = runner.make_launcher("fork", sys.executable)
    try:
        records = runner.run_suite(
            list(range(start, start + count)), runner.Settings(out=out), launcher
        )
    finally:
        launcher.close()
    classes = Counter(r["class"] for r in records)
    record("stress_classes", dict(classes))
    record("stress_out", str(out))
    assert len(records) == count
    passed, why = runner.gate_verdict(records)
    assert passed, f"stress gate failed ({why}):\n" + "\n".join(
        f"seed {r['seed']} {r['class']}: {r['reason']} ({r['label']})\n"
        f"  replay: {runner.replay_command(r['seed'])}"
        for r in runner.gate_failures(records)
    )
