"""``lmstool torchcheck``: compile the LMS sources above c10 in a patched PyTorch tree, or
(``--dropin``) the drop-in extension against each supported torch release's headers."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool import dropin
from lmstool.errors import LmsToolError
from lmstool.torchcheck import (
    UPSTREAM_SOURCES,
    check,
    check_dropin,
    engine_sources,
    report,
    report_dropin,
)


def cmd_torchcheck(args: argparse.Namespace) -> int:
    if args.dropin:
        if args.tree:
            raise LmsToolError("--dropin checks torch wheels' headers, not a tree: drop --tree")
        releases = [dropin.check_torch_version(v) for v in (args.torch or [])]
        checks = check_dropin(
            releases or dropin.newest_per_minor(),
            cache=args.cache,
            allow_download=not args.no_download,
            cuda_home=args.cuda_home,
            cxx=args.cxx,
            jobs=args.jobs,
        )
        return 0 if report_dropin(checks) else 1
    if args.torch:
        raise LmsToolError("--torch goes with --dropin (the drop-in's check per torch release)")
    if args.tree is None:
        raise LmsToolError(
            "give --tree with a patched PyTorch tree, or --dropin to check the drop-in "
            "extension against torch wheels"
        )
    build = args.build or (args.tree / "build-lms-torchcheck")
    results = check(args.tree, build, cuda_home=args.cuda_home, cxx=args.cxx, jobs=args.jobs)
    return 0 if report(results) else 1


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    units = [*engine_sources(), *UPSTREAM_SOURCES]  # from the engine manifest
    p = subparsers.add_parser(
        "torchcheck",
        help="run torchgen and compile "
        + ", ".join(Path(unit).name for unit in units)
        + " of a patched tree (object files only); --dropin: the drop-in per torch release",
        description="Compile check (no GPU, no full build) of the LMS sources above c10 in a "
        "PyTorch tree with the LMS series applied: torchgen's ATen headers, then object files "
        "for " + ", ".join(units) + ". LMS sources must be free of -Wall -Wextra warnings. "
        "With --dropin: every source of the drop-in extension checked (-fsyntax-only, "
        "-Werror) against each torch release's own wheel headers, with the C++ standard the "
        "wheel names (default: the newest release of each supported minor, "
        + ", ".join(dropin.newest_per_minor())
        + "); wheels come from the cache, pip's local folders, or are downloaded once.",
    )
    p.add_argument("--tree", type=Path, help="patched PyTorch source tree")
    p.add_argument(
        "--build",
        type=Path,
        default=None,
        help="output folder for generated headers and objects (default: TREE/build-lms-torchcheck)",
    )
    p.add_argument(
        "--cuda-home",
        type=Path,
        default=Path("/usr/local/cuda"),
        help="CUDA toolkit (default: %(default)s)",
    )
    p.add_argument("--cxx", default=None, help="C++ compiler (default: $CXX or g++)")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compiles (default: 2)")
    p.add_argument(
        "--dropin", action="store_true", help="check the drop-in extension per torch release"
    )
    p.add_argument(
        "--torch", action="append", metavar="VERSION", help="with --dropin: release X.Y.Z"
    )
    p.add_argument("--cache", type=Path, help="with --dropin: torch wheel cache")
    p.add_argument(
        "--no-download",
        action="store_true",
        help="with --dropin: report a release without a local wheel as not checked",
    )
    p.set_defaults(func=cmd_torchcheck)
