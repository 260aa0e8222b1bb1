"""The drop-in's conda package, from recipes/torch-lms/meta.yaml and the wheel lmstool built.

The recipe is the package's one description (name, version, build string, run
dependencies, about). conda-build and rattler-build are not installable from PyPI, so
this machine and CI have neither; the package is then written by lmstool.conda from the
recipe rendered here for the variant, as conda-build would render it, and the channel is
indexed with py-rattler. On a machine with conda-build the recipe builds the same package
(its header gives the command).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lmstool import conda, dropin
from lmstool.errors import LmsToolError
from lmstool.recipe import Variant, apply_selectors, selector_namespace

RECIPE = Path("recipes") / "torch-lms" / "meta.yaml"
ABOUT_KEYS = ("home", "license", "license_family", "summary", "dev_url", "doc_url")


def render(repo: Path, *, torch: str, cuda: str, python: str, wheel: Path) -> dict[str, Any]:
    """The drop-in recipe as conda-build renders it for one variant (linux-64).

    The package version is the wheel's public version (torch release . drop-in serial,
    extension/torch_lms/_support.py), derived here rather than passed, so that the package
    cannot say one torch release and require another."""
    torch = dropin.check_torch_version(torch, "torch")
    cuda = dropin.check_cuda_version(cuda)
    version = str(dropin.support().package_version(torch))
    try:
        import jinja2
    except ModuleNotFoundError:
        raise LmsToolError("rendering the recipe needs Jinja2: pip install 'Jinja2>=3.0'") from None
    path = repo / RECIPE
    try:
        source = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LmsToolError(f"{path} is missing: restore recipes/ from the project") from None
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    context = {
        "torch_version": torch,
        "cuda_version": cuda,
        "dropin_version": version,
        "dropin_wheel": str(wheel.resolve()),
        "python": python,
        "PY_VER": python,
        "CONDA_PY": python.replace(".", ""),
        "PYTHON": "$PYTHON",
        "target_platform": "linux-64",
        "environ": {},
    }
    try:
        text = env.from_string(source).render(**context)
    except jinja2.TemplateError as exc:
        raise LmsToolError(f"{path}: jinja error: {exc}") from None
    variant = Variant(tag="", arch="x86_64", python=python, cuda=cuda)
    data = yaml.safe_load(apply_selectors(text, selector_namespace(variant)))
    if not isinstance(data, dict):
        raise LmsToolError(f"{path} does not render to a mapping")
    return data


def package(
    repo: Path, wheel: Path, channel: Path, *, torch: str, cuda: str, python: str
) -> conda.CondaPackage:
    """Write the drop-in's .conda into CHANNEL/linux-64 from the rendered recipe and index
    the channel."""
    recipe = render(repo, torch=torch, cuda=cuda, python=python, wheel=wheel)
    # The package's dependencies come from the release and CUDA given here, its files from
    # the wheel: a wheel built for another torch would be installed beside a torch it does
    # not load into.
    info = conda.WheelInfo.parse(wheel)
    name = dropin.support().DIST_NAME.replace("-", "_")
    expected = dropin.wheel_version(torch, cuda)
    if info.name != name or info.version != expected:
        raise LmsToolError(
            f"{wheel.name} is not the drop-in wheel for torch {torch} with CUDA {cuda} "
            f"({name} {expected}): pass the wheel `lmstool dropin --torch {torch} --cuda "
            f"{cuda}` built"
        )
    build = recipe.get("build") or {}
    if build.get("skip"):
        raise LmsToolError(f"{RECIPE} skips this variant (only linux-64 is built)")
    about = {k: v for k, v in (recipe.get("about") or {}).items() if k in ABOUT_KEYS}
    made = conda.wheel_to_conda(
        wheel,
        channel,
        arch="x86_64",
        cuda=cuda,
        depends=[str(dep) for dep in (recipe.get("requirements") or {}).get("run") or []],
        name=str(recipe["package"]["name"]),
        version=str(recipe["package"]["version"]),
        build_number=int(build.get("number", 0)),
        build=str(build["string"]),
        about=about,
        python=python,
    )
    conda.index_channel(channel)
    return made
