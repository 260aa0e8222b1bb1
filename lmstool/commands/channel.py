"""``lmstool channel index|add|install``: a private ``file://`` conda channel."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool import conda
from lmstool.naming import CONDA_SUBDIRS


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "channel",
        help="manage a private file:// conda channel",
        description="Index a local conda channel, add packages to it, install from it.",
    )
    sub = parser.add_subparsers(dest="channel_command", metavar="ACTION")
    sub.required = True

    index = sub.add_parser(
        "index",
        help="write repodata.json for every subdir (and noarch)",
        description="Write DIR/<subdir>/repodata.json for each subdir and an empty noarch.",
    )
    index.add_argument("channel", type=Path, help="channel folder")
    index.set_defaults(func=_run_index)

    add = sub.add_parser(
        "add",
        help="copy packages into the channel's subdirs and reindex",
        description="Copy each PACKAGE into the subdir its index.json names, then reindex.",
    )
    add.add_argument("channel", type=Path, help="channel folder")
    add.add_argument("packages", type=Path, nargs="+", help=".conda or .tar.bz2 files")
    add.set_defaults(func=_run_add)

    inst = sub.add_parser(
        "install",
        help="install packages from the channel into a prefix with py-rattler (offline)",
        description=(
            "Solve SPEC... against CHANNEL alone and link the packages into PREFIX with "
            "py-rattler, without network. --platform linux-ppc64le lays out a ppc64le "
            "environment on any host (files are linked, nothing is run)."
        ),
    )
    inst.add_argument("specs", nargs="+", metavar="SPEC", help="match specs, e.g. 'pytorch 2.6.*'")
    inst.add_argument("--channel", type=Path, required=True, help="channel folder")
    inst.add_argument("--prefix", type=Path, required=True, help="environment to create")
    inst.add_argument(
        "--platform", choices=sorted(CONDA_SUBDIRS.values()), help="target subdir (default: host)"
    )
    inst.add_argument(
        "--virtual",
        action="append",
        default=[],
        metavar="NAME=VERSION",
        help="a virtual package the target has, e.g. __cuda=12.6 or __glibc=2.28",
    )
    inst.add_argument("--cache-dir", type=Path, help="package cache (default: a temporary one)")
    inst.set_defaults(func=_run_install)


def _run_index(args: argparse.Namespace) -> int:
    counts = conda.index_channel(args.channel)
    for subdir, count in counts.items():
        print(f"{args.channel / subdir / 'repodata.json'}: {count} package(s)")
    return 0


def _run_add(args: argparse.Namespace) -> int:
    for path in conda.add_to_channel(args.channel, args.packages):
        print(path)
    return 0


def _run_install(args: argparse.Namespace) -> int:
    records = conda.install(
        args.channel,
        args.specs,
        args.prefix,
        platform=args.platform,
        cache_dir=args.cache_dir,
        virtual_packages=args.virtual,
    )
    for record in records:
        print(f"{record['name']} {record['version']} {record['build']} ({record['subdir']})")
    print(f"installed into {args.prefix}")
    return 0
