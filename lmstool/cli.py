"""Command-line entry point: ``lmstool <command> [options]``.

Each command lives in its own module, which exposes ``register(subparsers)``; the module adds
its sub-parser and sets ``func`` (a callable taking the parsed namespace and returning an exit
code). Keeping registration per module lets the series, generation and build commands grow
independently.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from lmstool import __version__
from lmstool.errors import LmsToolError

# Modules that contribute sub-commands, in the order `--help` lists them.
COMMAND_MODULES = (
    "lmstool.commands.series",
    "lmstool.commands.generate",
    "lmstool.commands.build",
    "lmstool.commands.conda",
    "lmstool.commands.torchcheck",
)


def default_repo_root() -> Path:
    """The project checkout this package was loaded from (holds config/ and patches/)."""
    return Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmstool",
        description="Patch series, build and packaging tooling for PyTorch Large Model Support.",
    )
    parser.add_argument("--version", action="version", version=f"lmstool {__version__}")
    parser.add_argument(
        "--repo",
        type=Path,
        default=default_repo_root(),
        help="project checkout holding config/tags.yaml and patches/ (default: %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print debug output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except LmsToolError as exc:
        print(f"lmstool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmstool {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
