"""``lmstool recipe render|sync``: the conda-build recipe recipes/pytorch-lms."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from lmstool import recipe
from lmstool.errors import LmsToolError
from lmstool.matrix import load_matrix


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
        help="write the recipe's generated parts from config/ and patches/",
        description=(
            "Write conda_build_config.yaml and the generated blocks of meta.yaml (tag "
            "versions, the ppc64le CUDA skip list, each tag's patches) and build.sh (build "
            "settings, TORCH_CUDA_ARCH_LIST) from config/tags.yaml, config/toolchain.yaml "
            "and patches/<tag>/. Run it after changing config/ or `make patches`."
        ),
    )
    sync.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 2 naming each file that is out of date (CI)",
    )
    sync.set_defaults(func=_run_sync)


def _run_render(args: argparse.Namespace) -> int:
    matrix = load_matrix(Path(args.repo).resolve())
    data = recipe.render_for(
        matrix, args.tag or matrix.default_tag, args.arch, args.python, args.cuda
    )
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _run_sync(args: argparse.Namespace) -> int:
    matrix = load_matrix(Path(args.repo).resolve())
    changed = recipe.sync(matrix, check=args.check)
    if args.check:
        if changed:
            raise LmsToolError(
                f"out of date with config/ and patches/: {', '.join(map(str, changed))}; run "
                f"`python -m lmstool recipe sync` (or `make recipe-sync`) and commit the result"
            )
        print(f"{matrix.repo / recipe.RECIPE_DIR}: generated parts are current")
        return 0
    for path in changed:
        print(f"{path}: updated")
    if not changed:
        print(f"{matrix.repo / recipe.RECIPE_DIR}: already current")
    return 0
