"""``lmstool conda-package``: turn a built torch wheel into a ``.conda`` (no conda needed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmstool import conda, recipe
from lmstool.errors import LmsToolError
from lmstool.matrix import load_matrix


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "conda-package",
        help="turn a built torch wheel into a .conda package (no conda needed)",
        description=(
            "Unpack WHEEL into a conda prefix layout, write info/ (index.json, paths.json, "
            "files, about.json) and create OUTPUT_DIR/<subdir>/<name>-<version>-<build>.conda "
            "with conda-package-handling. Run dependencies and about come from "
            "recipes/pytorch-lms/meta.yaml rendered for the same tag, arch, Python and CUDA. "
            "A torch wheel must be a CUDA build (of --cuda) of the tag with the LMS series; "
            "another is refused, saying which."
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
    matrix = load_matrix(Path(args.repo).resolve())
    tag = args.tag or matrix.default_tag
    wheel = conda.WheelInfo.parse(args.wheel)
    arch = args.arch or wheel.arch
    python = args.python or wheel.python
    if arch is None or python is None:
        raise LmsToolError(
            f"{args.wheel.name} does not say its architecture or Python; pass --arch and --python"
        )
    if wheel.name == "torch":
        conda.check_torch_wheel(args.wheel, tag, args.cuda)
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
