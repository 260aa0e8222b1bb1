"""``lmstool tags``: the supported tags and their matrix, for people and for scripts."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from lmstool.matrix import Matrix, TagConfig, load_matrix


def _as_dict(matrix: Matrix, tag: TagConfig) -> dict[str, object]:
    return {
        "tag": tag.name,
        "version": tag.version,
        "default": tag.name == matrix.default_tag,
        "has_series": tag.has_series(matrix.repo),
        "series": tag.series.as_posix(),
        "integration": tag.integration.as_posix(),
        "git_ref": tag.source.git_ref,
        "tarballs": [
            {"name": t.name, "sha256": t.sha256, "top": t.top, "submodules": t.submodules}
            for t in tag.source.tarballs
        ],
        "python": list(tag.python),
        "cuda": {arch: list(v) for arch, v in tag.cuda.items()},
    }


def cmd_tags(args: argparse.Namespace) -> int:
    matrix = load_matrix(Path(args.repo))
    if args.shell is not None:
        tag = matrix.get_tag(args.shell or matrix.default_tag)
        values = {
            "LMS_TAG": tag.name,
            "LMS_VERSION": tag.version,
            "LMS_SERIES": tag.series.as_posix() if tag.has_series(matrix.repo) else "",
            "LMS_TARBALLS": " ".join(t.name for t in tag.source.tarballs),
        }
        for key, value in values.items():
            print(f"{key}={shlex.quote(value)}")
        return 0
    rows = [_as_dict(matrix, t) for t in matrix.tags.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        series = row["series"] if row["has_series"] else "source only"
        default = " (default)" if row["default"] else ""
        print(f"{row['tag']}{default}: {series}; Python {', '.join(row['python'])}")  # type: ignore[arg-type]
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tags",
        help="list the supported tags (config/tags.yaml)",
        description=(
            "List the supported tags with their series and Python versions, as JSON "
            "(--json), or one tag as shell assignments (--shell [TAG]: LMS_TAG, "
            "LMS_VERSION, LMS_SERIES, LMS_TARBALLS) for scripts."
        ),
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the matrix as JSON")
    out.add_argument(
        "--shell",
        nargs="?",
        const="",
        metavar="TAG",
        help="print shell assignments for TAG (default: the default tag)",
    )
    p.set_defaults(func=cmd_tags)
