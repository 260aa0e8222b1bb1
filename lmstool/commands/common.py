"""Helpers shared by several commands: the source options and the default tree."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool.source import SourceSpec


def default_tree(repo: Path, tag: str) -> Path:
    """Where ``checkout`` puts a tag's tree unless told otherwise (``make patch`` uses it)."""
    return repo / "work" / f"pytorch-{tag}"


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Options choosing where a tag's pristine source comes from (shared by several commands)."""
    group = parser.add_argument_group(
        "source of the tag (default: clone from GitHub with the submodules)"
    )
    group.add_argument(
        "--sources",
        type=Path,
        metavar="DIR",
        help="folder of release tarballs listed in config/tags.yaml (checked by sha256); "
        "a blank value means the default, GitHub",
    )
    exclusive = group.add_mutually_exclusive_group()
    exclusive.add_argument("--remote", metavar="URL", help="git remote to clone the tag from")
    exclusive.add_argument("--mirror", type=Path, metavar="PATH", help="local clone to use")
    group.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="cache of imported pristine repositories ($LMS_CACHE, default: work/cache)",
    )


def spec_from_args(args: argparse.Namespace) -> SourceSpec:
    sources = args.sources if args.sources and str(args.sources).strip() else None
    return SourceSpec(sources=sources, remote=args.remote, mirror=args.mirror, cache=args.cache)
