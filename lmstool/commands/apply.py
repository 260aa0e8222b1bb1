"""``lmstool apply``: apply ``patches/<tag>/`` to a checkout of the tag with ``git am``."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool.commands.common import default_tree
from lmstool.matrix import load_matrix
from lmstool.series import apply_series


def cmd_apply(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    tag = matrix.get_tag(args.tag) if args.series else matrix.require_series(args.tag)
    tree = args.tree or default_tree(args.repo, tag.name)
    patch_dir = args.series or tag.series_dir(args.repo)
    result = apply_series(tree, tag.name, patch_dir)
    print(result.message)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "apply",
        help="apply patches/TAG/*.patch to a checkout with git am",
        description=(
            "Apply the committed series of TAG to a clean checkout of TAG with `git am` "
            "(no 3-way merge; fixed committer, committer date = author date, so re-applying "
            "gives the same commits). An already applied series is detected and left alone; "
            "on failure the tree is restored and the failing patch and hunk are named."
        ),
    )
    p.add_argument("tag", metavar="TAG", help="tag from config/tags.yaml")
    p.add_argument(
        "--tree", type=Path, metavar="DIR", help="the checkout (default: work/pytorch-TAG)"
    )
    p.add_argument(
        "--series", type=Path, metavar="DIR", help="series folder (default: patches/TAG)"
    )
    p.set_defaults(func=cmd_apply)
