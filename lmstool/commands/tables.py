"""``lmstool tables``: the Python lists made from the engine's tables of settings and
statistics (lmstool.tables)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmstool import tables
from lmstool.errors import LmsToolError


def cmd_tables(args: argparse.Namespace) -> int:
    repo = Path(args.repo)
    try:
        stale = tables.regenerate(repo, check=args.check)
    except (OSError, ValueError) as exc:
        raise LmsToolError(str(exc)) from None
    for path in stale:
        if args.check:
            print(
                f"lmstool tables: {path} is stale: run `python -m lmstool tables`",
                file=sys.stderr,
            )
        else:
            print(f"updated {path}")
    return 1 if args.check and stale else 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tables",
        help="write the Python lists made from the engine's settings and stats tables",
        description=(
            "Rewrite, from engine/c10/cuda/LargeModelSupportSettingTable.h and "
            "LargeModelSupportStatTable.h, the generated blocks (between lms-tables markers) "
            "of torch/cuda/lms.py, the drop-in extension's API_NAMES and the GPU test's stat "
            "keys (--check: write nothing, exit 1 where a block is stale)."
        ),
    )
    p.add_argument("--check", action="store_true", help="fail if a generated block is stale")
    p.set_defaults(func=cmd_tables)
