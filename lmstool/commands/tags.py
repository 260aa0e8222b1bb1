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
    if args.json:
        print(json.dumps([_as_dict(matrix, t) for t in matrix.tags.values()], indent=2))
        return 0
    for tag in matrix.tags.values():
        series = tag.series.as_posix() if tag.has_series(matrix.repo) else "source only"
        default = " (default)" if tag.name == matrix.default_tag else ""
        print(f"{tag.name}{default}: {series}; Python {', '.join(tag.python)}; {_cuda_text(tag)}")
    return 0


def _cuda_text(tag: TagConfig) -> str:
    """The CUDA versions a build of ``tag`` supports, per architecture (they differ: NVIDIA's
    last ppc64le toolkit is older than the newest x86_64 one)."""
    per_arch = [f"on {arch}: {', '.join(cudas)}" for arch, cudas in tag.cuda.items() if cudas]
    return "CUDA " + "; ".join(per_arch) if per_arch else "no CUDA version listed"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tags",
        help="list the supported tags (config/tags.yaml)",
        description=(
            "List the supported tags with their series, Python versions and CUDA versions "
            "per architecture (config/tags.yaml), as JSON "
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
