"""The results files of the GPU regression suite and matrix: ``regression-results.json`` and
``regression-results.csv`` (written by ``conftest.py`` where ``LMS_RESULTS_DIR`` is set).

Every row names what it was measured with: the engine commit, whether the checkout had
changes, the hash of the engine's sources, torch, CUDA, the NVIDIA driver and the device
(:data:`ROW_PROVENANCE`). The engine fields come from ``examples/_lms_setup.provenance`` (git,
or ``LMS_ENGINE_COMMIT`` / ``LMS_ENGINE_DIRTY`` for a copy of the checkout whose .git is not
the sender's). Nothing here imports torch at module level.
"""

from __future__ import annotations

import csv
import datetime
import json
import platform
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_EXAMPLES = REPO / "examples"
if str(_EXAMPLES) not in sys.path:
    sys.path.insert(0, str(_EXAMPLES))

from _lms_setup import UNKNOWN, provenance  # noqa: E402

# What each row of the results records about its run (a row's own value, e.g. the device a
# worker process trained on, wins over the session's).
ROW_PROVENANCE = (
    "engine_commit",
    "engine_dirty",
    "engine_sources_sha256",
    "torch",
    "cuda",
    "driver",
    "device",
)

# The first columns of the CSV.
CSV_COLUMNS = ("test", "outcome", "seconds")


def session_environment(backend: str, cudnn_enabled: bool = True) -> dict[str, Any]:
    """Date, host, versions, LMS backend, device and provenance of this test session."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "lms_backend": backend,
    }
    env.update(_torch_versions(cudnn_enabled))
    env.update(provenance(REPO))
    return env


def _torch_versions(cudnn_enabled: bool) -> dict[str, Any]:
    """torch, CUDA, cuDNN and torchvision versions and the device (none without torch)."""
    try:
        import torch
    except ImportError:
        return {}
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "cudnn_enabled": cudnn_enabled,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device"] = props.name
        env["device_memory_bytes"] = props.total_memory
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = None
    return env


def with_provenance(rows: Iterable[dict[str, Any]], env: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows``, each with the :data:`ROW_PROVENANCE` fields of ``env`` it lacks ("unknown"
    where the session has none either)."""
    return [{**{k: env.get(k, UNKNOWN) for k in ROW_PROVENANCE}, **row} for row in rows]


def engine_words(record: dict[str, Any]) -> str:
    """The engine of a results environment (or row) in words: "engine COMMIT" with "(tree
    with changes)" or "(dirty flag unknown)" where it was not clean, or "engine not recorded"
    for results written before they recorded it."""
    commit = record.get("engine_commit")
    if commit is None:
        return "engine not recorded"
    if commit == UNKNOWN:
        return "engine unknown (no git and no LMS_ENGINE_COMMIT)"
    dirty = record.get("engine_dirty")
    short = str(commit)[:12]
    if dirty is False:
        return f"engine {short}"
    if dirty is True:
        return f"engine {short} (tree with changes)"
    return f"engine {short} (dirty flag unknown)"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def write_results(folder: Path, env: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """Writes ``regression-results.json`` (the environment and one entry per test, each with
    its provenance) and ``regression-results.csv`` (one line per test: its fields, then the
    environment's other fields) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = with_provenance(rows, env)
    (folder / "regression-results.json").write_text(
        json.dumps({"environment": env, "tests": entries}, indent=2, default=str) + "\n"
    )
    extra = sorted({k for r in entries for k in r} - set(CSV_COLUMNS) - {"error"})
    env_columns = [k for k in env if k not in extra]
    with (folder / "regression-results.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*CSV_COLUMNS, *extra, *env_columns])
        for r in entries:
            writer.writerow(
                [_cell(r.get(c)) for c in CSV_COLUMNS]
                + [_cell(r.get(k)) for k in extra]
                + [_cell(env[k]) for k in env_columns]
            )
