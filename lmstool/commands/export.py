"""``lmstool export``: write the commits above a tag as the numbered series."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool.commands.common import default_tree
from lmstool.generate import read_series
from lmstool.matrix import load_matrix
from lmstool.series import export_series


def cmd_export(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    tag = matrix.get_tag(args.tag)
    tree = args.tree or default_tree(args.repo, tag.name)
    dest = args.to or tag.series_dir(args.repo)
    names = None
    if args.to is None and tag.has_series(args.repo):
        entries = read_series(tag.integration_dir(args.repo), tag.series_dir(args.repo))
        names = [entry.patch_name for entry in entries]
    result = export_series(tree, tag.name, dest, names)
    print(result.summary(dest))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export",
        help="write the commits above TAG in a tree as patches/TAG/*.patch",
        description=(
            "Write the commits above TAG in the tree as a numbered `git format-patch` series "
            "with stable options: unchanged patches stay byte-identical, only changed files "
            "are rewritten, and patches no longer in the series are removed. Into "
            "patches/TAG/ (the default) each commit is written under the name of its entry "
            "in integration/TAG/series; with --to, under format-patch's names."
        ),
    )
    p.add_argument("tag", metavar="TAG", help="tag from config/tags.yaml")
    p.add_argument(
        "--tree", type=Path, metavar="DIR", help="the checkout (default: work/pytorch-TAG)"
    )
    p.add_argument("--to", type=Path, metavar="DIR", help="series folder (default: patches/TAG)")
    p.set_defaults(func=cmd_export)
