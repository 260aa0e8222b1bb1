"""Where a committed result came from, in words: the engine commit its results record (else
the one its folder's name carries, said so), whether that engine is this checkout's (the
results' engine sources hash against this checkout's), and the device, versions, driver and
date of the run. Shared by every generated table (summarize.py, speed.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmsbench.lms_setup import engine_sources_sha256

ROOT = Path(__file__).resolve().parent.parent
UNKNOWN = "unknown"
_COMMIT_IN_NAME = re.compile(r"-([0-9a-f]{7,40})$")


def commit_from_folder(folder: Path) -> str | None:
    """The engine commit a results folder's name (or the name of a folder above it, up to
    ``results``) carries, e.g. ``2026-11-25-h100-59e7f86``; None where none does."""
    for part in (folder, *folder.parents):
        if part.name in ("results", ""):
            break
        found = _COMMIT_IN_NAME.search(part.name)
        if found:
            return found.group(1)
    return None


def engine_words(env: dict[str, Any], folder: Path, engine_sha256: str) -> str:
    """ "Engine COMMIT (...)": the commit the results record (else the one their folder's name
    carries, said so; else "unrecorded"), and whether it is the engine of this checkout
    (``engine_sha256``: the hash of this checkout's engine sources) where the results record
    the hash of theirs."""
    commit = str(env.get("engine_commit") or UNKNOWN)
    sha = str(env.get("engine_sources_sha256") or UNKNOWN)
    if commit == UNKNOWN:
        named = commit_from_folder(folder)
        where = (
            "from the folder name; the results record no engine"
            if named
            else "neither the results nor their folder name record it"
        )
        return (
            f"Engine {named or 'unrecorded'} ({where}, so whether it is the engine of this "
            "checkout is unknown)"
        )
    notes = []
    dirty = env.get("engine_dirty")
    if dirty is True:
        notes.append("a tree with changes")
    elif dirty is not False:
        notes.append("whether its tree had changes is not recorded")
    if sha == UNKNOWN:
        notes.append("whether it is the engine of this checkout is not recorded")
    elif sha == engine_sha256:
        notes.append("the engine of this checkout")
    else:
        notes.append("not the engine of this checkout (its engine/ sources differ)")
    return f"Engine {commit[:7]} ({'; '.join(notes)})"


def engine_lines(
    sources: Sequence[tuple[str, Path, dict[str, Any]]], engine_sha256: str
) -> list[str]:
    """One line per distinct run environment of ``sources`` ((shown path, folder,
    environment) each): its engine (:func:`engine_words`), device, versions, driver, date and
    folder, in the order first seen."""
    lines: list[str] = []
    for shown, folder, env in sources:
        line = (
            f"{engine_words(env, folder, engine_sha256)}, {env.get('device', UNKNOWN)}, "
            f"torch {env.get('torch', UNKNOWN)}, CUDA {env.get('cuda', UNKNOWN)}, "
            f"driver {env.get('driver') or 'unrecorded'}, {str(env.get('date', ''))[:10]}; "
            f"from `{shown}`."
        )
        if line not in lines:
            lines.append(line)
    return lines


def short_device(device: object) -> str:
    """ "H100" of "NVIDIA H100 80GB HBM3"; the name as recorded where it has no such model."""
    found = re.search(r"\b([A-Z]\d{2,3})\b", str(device or ""))
    return found.group(1) if found else str(device or UNKNOWN)


def shown(folder: Path) -> str:
    """``folder`` relative to the repository root where it is inside it."""
    try:
        return folder.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(folder)


def checkout_engine_sha256() -> str:
    """The hash of this checkout's engine sources."""
    return str(engine_sources_sha256(ROOT))
