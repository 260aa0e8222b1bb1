"""``lmstool patches``: generate the committed series from engine/ and integration/<tag>/."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lmstool.commands.common import add_source_arguments, spec_from_args
from lmstool.errors import LmsToolError
from lmstool.generate import Sources, generate
from lmstool.matrix import load_matrix

log = logging.getLogger(__name__)


def cmd_patches(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    names = args.tags or list(matrix.tags)
    tags = [matrix.get_tag(n) for n in names]
    if args.to is not None and len(tags) != 1:
        raise LmsToolError("--to needs exactly one TAG; name the tag to generate")
    sources = Sources(matrix, spec_from_args(args), args.repo)
    for tag in tags:
        if not tag.has_series(args.repo):
            print(f"{tag.name}: source only, no series ({tag.series_file(args.repo)} absent)")
            continue
        dest = args.to or tag.series_dir(args.repo)
        result = generate(sources, tag, dest, engine_dir=args.engine)
        print(f"{tag.name}: {result.summary(dest)}")
    return 0


def add_tag_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "tags", nargs="*", metavar="TAG", help="tags from config/tags.yaml (default: all)"
    )
    p.add_argument(
        "--engine", type=Path, metavar="DIR", help="engine sources (default: engine/ of --repo)"
    )
    add_source_arguments(p)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "patches",
        help="generate patches/TAG/ from engine/ and integration/TAG/ (make patches)",
        description=(
            "Generate the committed series of each TAG: clone the pristine tag, commit the "
            "entries of integration/TAG/series in order (.engine entries copy engine/ into "
            "the tree, .patch entries are applied with git am) and write the commits to "
            "patches/TAG/ with stable format-patch options. Tags without "
            "integration/TAG/series are source only and are skipped."
        ),
    )
    add_tag_arguments(p)
    p.add_argument(
        "--to", type=Path, metavar="DIR", help="write here instead of patches/TAG (one tag)"
    )
    p.set_defaults(func=cmd_patches)
