"""``lmstool checkout``: get a tag's pristine source as a git tree on branch ``lms-TAG``."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool.commands.common import add_source_arguments, default_tree, spec_from_args
from lmstool.matrix import load_matrix
from lmstool.source import checkout


def cmd_checkout(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    tag = matrix.require_series(args.tag) if args.require_series else matrix.get_tag(args.tag)
    dest = args.dest or default_tree(args.repo, tag.name)
    path = checkout(matrix, tag, dest, spec_from_args(args), args.repo)
    print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "checkout",
        help="get a tag's source as a git tree (tag at HEAD, ready for `git am`)",
        description=(
            "Get TAG's PyTorch source as a git repository on branch lms-TAG at the tag, from "
            "GitHub (default, with submodules), a local mirror, or a release tarball in "
            "--sources (sha256 checked first; imported once into a cache). An existing "
            "checkout at DEST with TAG in its history and no uncommitted changes is reused as "
            "it is (the message says whether it holds a series or commits of your own); "
            "anything else there is left alone."
        ),
    )
    p.add_argument("tag", metavar="TAG", help="tag from config/tags.yaml, e.g. v2.6.0")
    p.add_argument(
        "--dest", type=Path, metavar="DIR", help="where to put the tree (default: work/pytorch-TAG)"
    )
    p.add_argument(
        "--require-series",
        action="store_true",
        help="refuse a tag without an LMS series before fetching anything (make patch)",
    )
    add_source_arguments(p)
    p.set_defaults(func=cmd_checkout)
