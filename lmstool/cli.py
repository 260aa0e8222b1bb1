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

# Modules that contribute sub-commands, in the order `--help` lists them; each is named after
# its command.
COMMAND_MODULES = (
    "lmstool.commands.fetch",
    "lmstool.commands.checkout",
    "lmstool.commands.apply",
    "lmstool.commands.export",
    "lmstool.commands.patches",
    "lmstool.commands.verify",
    "lmstool.commands.tags",
    "lmstool.commands.series_size",
    "lmstool.commands.engine_files",
    "lmstool.commands.tables",
    "lmstool.commands.build",
    "lmstool.commands.conda_package",
    "lmstool.commands.channel",
    "lmstool.commands.recipe",
    "lmstool.commands.torchcheck",
    "lmstool.commands.dropin",
)
# Packages the commands need (pyproject.toml's dependencies), by import name.
REQUIRED_MODULES = {"git": "GitPython", "yaml": "PyYAML", "jinja2": "Jinja2"}


def _missing_dependency(exc: ModuleNotFoundError) -> str | None:
    """The message for a missing dependency (the wrong Python), or None for other errors."""
    top = (exc.name or "").split(".")[0]
    if top not in REQUIRED_MODULES:
        return None
    venv = default_repo_root() / ".venv" / "bin" / "python"
    return (
        f"lmstool: the Python at {sys.executable} lacks {REQUIRED_MODULES[top]} (module "
        f"'{top}'). Run lmstool with the project's virtual environment: `make venv` creates "
        f"it, then `{venv} -m lmstool ...` (or `. .venv/bin/activate`); the make targets use "
        f"it already"
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
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ModuleNotFoundError as exc:
        message = _missing_dependency(exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
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
