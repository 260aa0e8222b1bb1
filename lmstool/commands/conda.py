"""Conda commands: `conda-package`, `channel index|add|install`, `recipe render|sync|check`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from lmstool import conda, recipe
from lmstool.build import CONDA_SUBDIRS, BuildMatrix
from lmstool.errors import LmsToolError


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _register_package(subparsers)
    _register_channel(subparsers)
    _register_recipe(subparsers)


# --------------------------------------------------------------------------------------------
# conda-package


def _register_package(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "conda-package",
        help="turn a built torch wheel into a .conda package (no conda needed)",
        description=(
            "Unpack WHEEL into a conda prefix layout, write info/ (index.json, paths.json, "
            "files, about.json) and create OUTPUT_DIR/<subdir>/<name>-<version>-<build>.conda "
            "with conda-package-handling. Run dependencies and about come from "
            "recipes/pytorch-lms/meta.yaml rendered for the same tag, arch, Python and CUDA."
        ),
    )
    parser.add_argument("wheel", type=Path, help="the wheel, e.g. torch-2.6.0+lms.cu126-...whl")
    parser.add_argument("--output-dir", type=Path, required=True, help="channel folder")
    parser.add_argument("--arch", help="x86_64 or ppc64le (default: from the wheel's platform)")
    parser.add_argument("--cuda", required=True, help="CUDA version the wheel was built with")
    parser.add_argument("--tag", help="release tag (default: config/tags.yaml's default_tag)")
    parser.add_argument("--python", help="Python X.Y (default: from the wheel's cpXY tag)")
    parser.add_argument("--name", default="pytorch", help="package name (default: %(default)s)")
    parser.add_argument("--version", help="conda version (default: the wheel's public version)")
    parser.add_argument("--build-number", type=int, default=0, help="build number (default: 0)")
    parser.add_argument(
        "--no-recipe-depends",
        action="store_true",
        help="do not take run dependencies from the recipe (python is always pinned)",
    )
    parser.add_argument(
        "--depends", action="append", default=[], metavar="SPEC", help="add a run dependency"
    )
    parser.set_defaults(func=_run_package)


def _run_package(args: argparse.Namespace) -> int:
    matrix = BuildMatrix.load(Path(args.repo).resolve())
    tag = args.tag or matrix.default_tag
    wheel = conda.WheelInfo.parse(args.wheel)
    arch = args.arch or wheel.arch
    python = args.python or wheel.python
    if arch is None or python is None:
        raise LmsToolError(
            f"{args.wheel.name} does not say its architecture or Python; pass --arch and --python"
        )
    rendered = recipe.render_for(matrix, tag, arch, python, args.cuda)
    depends = [] if args.no_recipe_depends else recipe.run_depends(rendered)
    about = {
        key: value
        for key, value in (rendered.get("about") or {}).items()
        if key in ("home", "license", "license_family", "summary", "dev_url", "doc_url")
    }
    about["lms_tag"] = tag
    package = conda.wheel_to_conda(
        args.wheel,
        args.output_dir,
        arch=arch,
        cuda=args.cuda,
        depends=[*depends, *args.depends],
        name=args.name,
        version=args.version,
        build_number=args.build_number,
        about=about,
        python=python,
    )
    print(package.path)
    print(json.dumps(package.index, indent=2, sort_keys=True))
    return 0


# --------------------------------------------------------------------------------------------
# channel


def _register_channel(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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


# --------------------------------------------------------------------------------------------
# recipe


def _register_recipe(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "recipe",
        help="render or update the conda-build recipe recipes/pytorch-lms",
        description="Render the conda-build recipe for a variant or keep its patch list current.",
    )
    sub = parser.add_subparsers(dest="recipe_command", metavar="ACTION")
    sub.required = True

    rend = sub.add_parser(
        "render",
        help="print meta.yaml with jinja and selectors evaluated for a variant",
        description="Evaluate meta.yaml's jinja and # [selectors] as conda-build would.",
    )
    rend.add_argument("--tag", help="release tag (default: config/tags.yaml's default_tag)")
    rend.add_argument("--arch", default="x86_64", help="x86_64 or ppc64le (default: %(default)s)")
    rend.add_argument("--python", required=True, help="Python X.Y")
    rend.add_argument("--cuda", required=True, help="CUDA version")
    rend.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    rend.set_defaults(func=_run_render)

    sync = sub.add_parser(
        "sync",
        help="list patches/<tag>/*.patch in meta.yaml's source section",
        description="Rewrite the lms-series block of meta.yaml from the committed series.",
    )
    sync.add_argument(
        "--check", action="store_true", help="only report whether meta.yaml is out of date"
    )
    sync.set_defaults(func=_run_sync)


def _run_render(args: argparse.Namespace) -> int:
    matrix = BuildMatrix.load(Path(args.repo).resolve())
    data = recipe.render_for(
        matrix, args.tag or matrix.default_tag, args.arch, args.python, args.cuda
    )
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _run_sync(args: argparse.Namespace) -> int:
    matrix = BuildMatrix.load(Path(args.repo).resolve())
    changed = recipe.sync_series(matrix, check=args.check)
    meta = matrix.repo / recipe.RECIPE_DIR / "meta.yaml"
    if args.check:
        if changed:
            raise LmsToolError(
                f"{meta} does not list the committed series: run `lmstool recipe sync`"
            )
        print(f"{meta} lists the committed series")
        return 0
    print(f"{meta}: {'updated' if changed else 'already current'}")
    return 0
