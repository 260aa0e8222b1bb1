"""``lmstool torchcheck``: compile the LMS sources above c10 in a patched PyTorch tree."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmstool.torchcheck import UPSTREAM_SOURCES, check, engine_sources, report


def cmd_torchcheck(args: argparse.Namespace) -> int:
    build = args.build or (args.tree / "build-lms-torchcheck")
    results = check(args.tree, build, cuda_home=args.cuda_home, cxx=args.cxx, jobs=args.jobs)
    return 0 if report(results) else 1


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    units = [*engine_sources(), *UPSTREAM_SOURCES]  # from the engine manifest
    p = subparsers.add_parser(
        "torchcheck",
        help="run torchgen and compile "
        + ", ".join(Path(unit).name for unit in units)
        + " of a patched tree (object files only)",
        description="Compile check (no GPU, no full build) of the LMS sources above c10 in a "
        "PyTorch tree with the LMS series applied: torchgen's ATen headers, then object files "
        "for " + ", ".join(units) + ". LMS sources must be free of -Wall -Wextra warnings.",
    )
    p.add_argument("--tree", type=Path, required=True, help="patched PyTorch source tree")
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
    p.set_defaults(func=cmd_torchcheck)
