"""``lmstool checkout``, ``apply`` and ``export``: getting a tag's source and moving a series
between ``patches/<tag>/`` and a git tree."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool.config import load_matrix
from lmstool.series import apply_series, export_series
from lmstool.source import SourceSpec, checkout


def default_tree(repo: Path, tag: str) -> Path:
    """Where ``checkout`` puts a tag's tree unless told otherwise (``make patch`` uses it)."""
    return repo / "work" / f"pytorch-{tag}"


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Options choosing where a tag's pristine source comes from (shared by several commands)."""
    group = parser.add_argument_group("source of the tag (default: clone from GitHub)")
    group.add_argument(
        "--sources",
        type=Path,
        metavar="DIR",
        help="folder of release tarballs listed in config/tags.yaml (checked by sha256)",
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


def cmd_checkout(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    tag = matrix.get_tag(args.tag)
    dest = args.dest or default_tree(args.repo, tag.name)
    path = checkout(matrix, tag, dest, spec_from_args(args), args.repo)
    print(path)
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    tag = matrix.get_tag(args.tag)
    tree = args.tree or default_tree(args.repo, tag.name)
    patch_dir = args.series or tag.series_dir(args.repo)
    result = apply_series(tree, tag.name, patch_dir)
    print(result.message)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    tag = matrix.get_tag(args.tag)
    tree = args.tree or default_tree(args.repo, tag.name)
    dest = args.to or tag.series_dir(args.repo)
    result = export_series(tree, tag.name, dest)
    print(result.summary(dest))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "checkout",
        help="get a tag's source as a git tree (tag at HEAD, ready for `git am`)",
        description=(
            "Get TAG's PyTorch source as a git repository on branch lms-TAG at the tag, from "
            "GitHub (default, with submodules), a local mirror, or a release tarball in "
            "--sources (sha256 checked first; imported once into a cache). An existing clean "
            "checkout of TAG at DEST is reused; anything else there is left alone."
        ),
    )
    p.add_argument("tag", metavar="TAG", help="tag from config/tags.yaml, e.g. v2.6.0")
    p.add_argument(
        "--dest", type=Path, metavar="DIR", help="where to put the tree (default: work/pytorch-TAG)"
    )
    add_source_arguments(p)
    p.set_defaults(func=cmd_checkout)

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

    p = sub.add_parser(
        "export",
        help="write the commits above TAG in a tree as patches/TAG/*.patch",
        description=(
            "Write the commits above TAG in the tree as a numbered `git format-patch` series "
            "with stable options: unchanged patches stay byte-identical, only changed files "
            "are rewritten, and patches no longer in the series are removed."
        ),
    )
    p.add_argument("tag", metavar="TAG", help="tag from config/tags.yaml")
    p.add_argument(
        "--tree", type=Path, metavar="DIR", help="the checkout (default: work/pytorch-TAG)"
    )
    p.add_argument("--to", type=Path, metavar="DIR", help="series folder (default: patches/TAG)")
    p.set_defaults(func=cmd_export)
