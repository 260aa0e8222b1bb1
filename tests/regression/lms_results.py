"""The results files of the GPU regression suite and matrix: ``regression-results.json`` and
``regression-results.csv`` (written by ``conftest.py`` where ``LMS_RESULTS_DIR`` is set).

Every row names what it was measured with: the engine commit, whether the checkout had
changes, the hash of the engine's sources, torch, CUDA, the NVIDIA driver and the device
(:data:`ROW_PROVENANCE`), in the record schema of ``lmsbench/harness.py``. The engine fields
come from ``lmsbench.lms_setup.provenance`` (git, or ``LMS_ENGINE_COMMIT`` /
``LMS_ENGINE_DIRTY`` for a copy of the checkout whose .git is not the sender's). Nothing here
imports torch at module level.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmsbench.harness import (
    RECORD_PROVENANCE,
    record_environment,
    with_provenance,
    write_csv,
    write_json,
)

# What each row of the results records about its run (the shared record schema's).
ROW_PROVENANCE = RECORD_PROVENANCE

# The first columns of the CSV.
CSV_COLUMNS = ("test", "outcome", "seconds")


def session_environment(backend: str, cudnn_enabled: bool = True) -> dict[str, Any]:
    """Date, host, versions and device of this test session and their provenance
    (``harness.record_environment``), with the LMS backend, cuDNN and torchvision."""
    env = record_environment()
    env["lms_backend"] = backend
    env.update(_library_versions(cudnn_enabled))
    return env


def _library_versions(cudnn_enabled: bool) -> dict[str, Any]:
    """cuDNN (its version, and whether the session enabled it) and torchvision (none
    without torch)."""
    try:
        import torch
    except ImportError:
        return {}
    env: dict[str, Any] = {
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "cudnn_enabled": cudnn_enabled,
    }
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = None
    return env


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def write_results(folder: Path, env: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """Writes ``regression-results.json`` (the environment and one entry per test, each with
    its provenance) and ``regression-results.csv`` (one line per test: its fields, then the
    environment's other fields) into ``folder``."""
    entries = with_provenance(rows, env)
    write_json(folder / "regression-results.json", {"environment": env, "tests": entries})
    extra = sorted({k for r in entries for k in r} - set(CSV_COLUMNS) - {"error"})
    columns = [*CSV_COLUMNS, *extra]
    write_csv(
        folder / "regression-results.csv",
        columns,
        [{c: _cell(r.get(c)) for c in columns} for r in entries],
        {k: _cell(v) for k, v in env.items()},
        [k for k in env if k not in extra],
    )
