"""``lmstool apply``: apply ``patches/<tag>/`` to a checkout of the tag with ``git am``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmstool.commands.common import default_tree
from lmstool.errors import LmsToolError
from lmstool.generate import quick_staleness
from lmstool.hints import command
from lmstool.matrix import TagConfig, load_matrix
from lmstool.series import apply_series


def stale_warning(repo: Path, tag: TagConfig, tree: Path) -> str | None:
    """The warning for a committed series that engine/ or integration/<tag>/ have moved past
    (an engine edited and not regenerated): what is applied then lacks those changes, and
    `apply` alone would say only that the series is there."""
    try:
        differences = quick_staleness(repo, tag)
    except LmsToolError as exc:
        return f"cannot compare {tag.series} with engine/ and {tag.integration}: {exc}"
    if not differences:
        return None
    regenerate = command(f"lmstool patches {tag.name}", f"make patches TAG={tag.name}")
    again = command(f"lmstool apply {tag.name} --tree {tree}", f"make patch TAG={tag.name}")
    lines = [
        f"{tag.series} is out of date with engine/ and {tag.integration}: the tree gets the "
        f"committed series, without the changes made there since",
        *[f"  {line}" for line in differences],
        f"Regenerate it with {regenerate}, then run {again} again (it replaces the series it "
        f"applied before)",
    ]
    return "\n".join(lines)


def cmd_apply(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    tag = matrix.get_tag(args.tag) if args.series else matrix.require_series(args.tag)
    tree = args.tree or default_tree(args.repo, tag.name)
    patch_dir = args.series or tag.series_dir(args.repo)
    # Only the committed series has sources to be out of date with.
    warning = None if args.series else stale_warning(args.repo, tag, tree)
    try:
        result = apply_series(tree, tag.name, patch_dir)
        print(result.message)
    finally:
        if warning:
            print(f"lmstool apply: warning: {warning}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "apply",
        help="apply patches/TAG/*.patch to a checkout with git am",
        description=(
            "Apply the committed series of TAG with `git am` to a checkout of TAG without "
            "uncommitted changes "
            "(no 3-way merge; fixed committer, committer date = author date, so re-applying "
            "gives the same commits). An already applied series is detected and left alone; "
            "on failure the tree is restored and the failing patch and hunk are named. A "
            "committed series that engine/ or integration/TAG/ have changed since it was "
            "generated is applied as committed, with a warning naming the stale patches."
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
