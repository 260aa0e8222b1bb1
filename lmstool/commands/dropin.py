"""``lmstool dropin``: prebuilt drop-in wheels (and conda packages) from CUDA torch wheels."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from lmstool import dropin, torchwheels
from lmstool.errors import LmsToolError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "dropin",
        help="build the drop-in torch_lms as a wheel per torch release (no GPU needed)",
        description="Compile the drop-in extension against the headers and libraries of a "
        "CUDA torch wheel (taken from the cache, a local folder pip is configured with, or "
        "downloaded once) and write OUT/cu<XY>/torch_lms-<torch>.<serial>+cu<XY>-...whl, "
        "requiring that torch release. Install on the GPU machine with "
        "`pip install --no-index --find-links OUT/cu130 torch-lms`. Supported torch: "
        + dropin.support().supported_text()
        + ".",
    )
    p.add_argument(
        "--torch",
        action="append",
        metavar="VERSION",
        help="torch release X.Y.Z to build for; repeat for several (default: "
        + ", ".join(dropin.RELEASES)
        + ")",
    )
    p.add_argument("--cuda", default="13.0", help="CUDA version of the torch build (default 13.0)")
    p.add_argument("--out", type=Path, required=True, help="folder for the wheels (OUT/cu<XY>/)")
    p.add_argument(
        "--python",
        help="Python X.Y to build for (default: that of --python-exe, or the running one)",
    )
    p.add_argument("--python-exe", help="interpreter whose headers and tags to build for")
    p.add_argument(
        "--python-include",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="headers of a Python absent here (with --python), e.g. a copy of the target "
        "machine's /usr/include/python3.12; repeat for a separate pyconfig.h folder",
    )
    p.add_argument(
        "--torch-wheel",
        type=Path,
        help="a CUDA torch wheel to build against instead of finding one (one --torch)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        help=f"torch wheel cache (${torchwheels.CACHE_ENV}, "
        "default ~/.cache/torch-lms/torch-wheels)",
    )
    p.add_argument(
        "--no-download", action="store_true", help="never download a torch wheel from the index"
    )
    p.add_argument("--channel", type=Path, help="also write the conda package into this channel")
    p.add_argument(
        "--cuda-home",
        type=Path,
        default=Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda"),
        help="CUDA toolkit with the runtime's headers and libcudart ($CUDA_HOME, default "
        "/usr/local/cuda)",
    )
    p.add_argument("--cxx", help="C++ compiler (default: $CXX or g++)")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compiles (default: 2)")
    p.add_argument("--work", type=Path, help="scratch folder (default: REPO/work/dropin)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    releases = [dropin.check_torch_version(v) for v in (args.torch or dropin.RELEASES)]
    cuda = dropin.check_cuda_version(args.cuda)
    if args.torch_wheel and len(releases) != 1:
        raise LmsToolError("--torch-wheel builds for one torch release: give exactly one --torch")
    python = dropin.python_target(args.python, args.python_include, args.python_exe)
    cache = args.cache or torchwheels.default_cache()
    work = args.work or Path(args.repo) / "work" / "dropin"
    for release in releases:
        if args.torch_wheel:
            wheel = torchwheels.read_wheel(args.torch_wheel)
            if wheel.release != release or wheel.cuda != cuda:
                built = f"CUDA {wheel.cuda}" if wheel.cuda else "CPU-only"
                raise LmsToolError(
                    f"{args.torch_wheel.name} is torch {wheel.version} ({built}), not torch "
                    f"{release} for CUDA {cuda}: pass --torch {wheel.release}"
                    + (f" --cuda {wheel.cuda}" if wheel.cuda else " and a CUDA build's wheel")
                )
        else:
            wheel = torchwheels.locate(
                release, cuda, cache=cache, allow_download=not args.no_download
            )
        root = torchwheels.unpack(wheel, cache / "unpacked", libraries=True)
        scratch = work / f"torch-{release}-cu{cuda.replace('.', '')}-py{python.version}"
        result = dropin.build_wheel(
            wheel,
            root,
            python,
            args.out,
            scratch,
            cuda_home=args.cuda_home,
            cxx=args.cxx,
            jobs=args.jobs,
        )
        print(
            f"{result.wheel} (torch {wheel.version}, Python {python.version}, "
            f"C++{wheel.cxx_standard}, needs glibc >= {result.glibc or '?'}; "
            f"{result.seconds:.0f} s)"
        )
        if args.channel:
            from lmstool import dropin_conda

            made = dropin_conda.package(
                Path(args.repo),
                result.wheel,
                args.channel,
                torch=release,
                cuda=cuda,
                python=python.version,
            )
            print(made.path)
    return 0
