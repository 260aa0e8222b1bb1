"""The engine manifest: the files under ``engine/``, derived once, by a glob.

Every file under ``engine/`` is an engine file and goes to the same path in the PyTorch tree
(``engine/c10/cuda/X.cpp`` becomes ``c10/cuda/X.cpp``). This module is the only place that
list is made; the series generation (``lmstool patches``), the compile check
(``lmstool torchcheck``), the standalone c10 build (``standalone/``) and the drop-in
extension's build (``extension/setup.py``) all ask it, so a file added under ``engine/`` is
picked up everywhere without editing a list.

Standard library only: ``extension/setup.py`` and CMake load it without lmstool's
dependencies (``python3 lmstool/manifest.py --help``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

ENGINE_DIR = Path(__file__).resolve().parent.parent / "engine"
CXX_SOURCE_SUFFIXES = (".cpp", ".cc", ".cu")
CXX_HEADER_SUFFIXES = (".h", ".hpp", ".cuh")
# Never part of the engine: editor and build leftovers.
_SKIP_DIRS = {"__pycache__", ".git", "build"}
_SKIP_SUFFIXES = (".pyc", ".orig", ".rej", ".swp", "~")


def engine_files(engine_dir: Path = ENGINE_DIR, under: str = "") -> list[Path]:
    """Every engine file below ``engine_dir`` (relative to it, sorted), optionally only those
    below the tree path ``under`` (e.g. ``c10/cuda``)."""
    if not engine_dir.is_dir():
        raise FileNotFoundError(f"engine folder {engine_dir} does not exist")
    prefix = under.strip("/")
    files: list[Path] = []
    for path in sorted(engine_dir.rglob("*")):
        rel = path.relative_to(engine_dir)
        if any(part in _SKIP_DIRS or part.startswith(".") for part in rel.parts):
            continue
        if path.name.endswith(_SKIP_SUFFIXES) or not (path.is_file() or path.is_symlink()):
            continue
        if prefix and not (rel.as_posix() + "/").startswith(prefix + "/"):
            continue
        files.append(rel)
    return files


def cxx_sources(engine_dir: Path = ENGINE_DIR, under: str = "") -> list[Path]:
    """The C++ translation units of the engine (compiled by every integration)."""
    return [p for p in engine_files(engine_dir, under) if p.suffix in CXX_SOURCE_SUFFIXES]


def cxx_files(engine_dir: Path = ENGINE_DIR, under: str = "") -> list[Path]:
    """The C++ sources and headers of the engine."""
    suffixes = CXX_SOURCE_SUFFIXES + CXX_HEADER_SUFFIXES
    return [p for p in engine_files(engine_dir, under) if p.suffix in suffixes]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="manifest.py",
        description="Print the engine files (relative to engine/), one a line, or joined by "
        "--sep (CMake lists: --sep ';').",
    )
    parser.add_argument("under", nargs="?", default="", help="only below this tree path")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--sources", action="store_true", help="C++ translation units only")
    kind.add_argument("--cxx", action="store_true", help="C++ sources and headers only")
    parser.add_argument("--engine", type=Path, default=ENGINE_DIR, help="engine folder")
    parser.add_argument("--sep", default="\n", help="separator (default: newline)")
    args = parser.parse_args(argv)
    try:
        if args.sources:
            files = cxx_sources(args.engine, args.under)
        elif args.cxx:
            files = cxx_files(args.engine, args.under)
        else:
            files = engine_files(args.engine, args.under)
    except FileNotFoundError as exc:
        print(f"manifest.py: {exc}; pass --engine DIR", file=sys.stderr)
        return 2
    print(args.sep.join(p.as_posix() for p in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
