"""``lmstool fetch``: download a tag's source tarballs into a SOURCES folder (sha256 checked)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool.hints import option
from lmstool.matrix import load_matrix
from lmstool.source import fetch_tarballs


def cmd_fetch(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    # Without tags: every tag that has a series, so that the tests of real sources (which
    # run for each of them) find all their tarballs.
    names = args.tags or [t.name for t in matrix.tags_with_series()] or [matrix.default_tag]
    dest = args.to or Path(args.repo) / "work" / "sources"
    for name in names:
        for path in fetch_tarballs(matrix.get_tag(name), dest):
            print(path)
    print(f"use them with {option('sources', str(dest))}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "fetch",
        help="download a tag's source tarballs (the url entries of config/tags.yaml)",
        description=(
            "Download each TAG's tarballs that config/tags.yaml gives a url for into DIR, "
            "check each against its sha256 and keep it only when it matches. A tarball "
            "already in DIR with the right checksum is kept. DIR then serves as --sources "
            "(make: SOURCES=) for checkout, patches, verify and the tests of real sources."
        ),
    )
    p.add_argument(
        "tags",
        nargs="*",
        metavar="TAG",
        help="tags from config/tags.yaml (default: every tag that has a series)",
    )
    p.add_argument(
        "--to", type=Path, metavar="DIR", help="where to put them (default: work/sources)"
    )
    p.set_defaults(func=cmd_fetch)
