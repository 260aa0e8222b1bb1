"""``lmstool engine-files``: the engine manifest (lmstool.manifest), as every build uses it."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool import manifest
from lmstool.errors import LmsToolError


def cmd_engine_files(args: argparse.Namespace) -> int:
    engine = args.engine or Path(args.repo) / "engine"
    try:
        if args.sources:
            files = manifest.cxx_sources(engine, args.under)
        elif args.cxx:
            files = manifest.cxx_files(engine, args.under)
        else:
            files = manifest.engine_files(engine, args.under)
    except FileNotFoundError as exc:
        raise LmsToolError(f"{exc}; pass --engine DIR") from None
    for path in files:
        print(path.as_posix())
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "engine-files",
        help="list the engine files (the one manifest the series and every build use)",
        description=(
            "List the files under engine/ (relative paths, which are also their paths in the "
            "PyTorch tree): what the series carries, the extension and the standalone build "
            "compile, and the compile check requires."
        ),
    )
    p.add_argument("under", nargs="?", default="", help="only below this tree path, e.g. c10/cuda")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--sources", action="store_true", help="C++ translation units only")
    kind.add_argument("--cxx", action="store_true", help="C++ sources and headers only")
    p.add_argument("--engine", type=Path, metavar="DIR", help="engine folder (default: engine/)")
    p.set_defaults(func=cmd_engine_files)
