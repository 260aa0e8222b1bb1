"""Render and maintain the conda-build recipe in recipes/pytorch-lms/ without conda-build.

Rendering follows conda-build's order: the jinja template is evaluated first (with the
variant's variables and conda-build's helpers such as ``compiler()``), then each line carrying
a ``# [selector]`` comment is kept or dropped by evaluating the selector for the target
platform, then the text is parsed as YAML.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lmstool.build import CONDA_SUBDIRS, BuildMatrix, check_arch, validate_versions
from lmstool.errors import LmsToolError

RECIPE_DIR = Path("recipes") / "pytorch-lms"
SELECTOR = re.compile(r"^(?P<body>.*?)\s*#\s*\[(?P<expr>.+)\]\s*$")
BEGIN = "  # BEGIN lms-series"
END = "  # END lms-series"


@dataclass(frozen=True)
class Variant:
    tag: str
    arch: str
    python: str
    cuda: str

    @property
    def subdir(self) -> str:
        return CONDA_SUBDIRS[self.arch]


def selector_namespace(variant: Variant) -> dict[str, Any]:
    """The names conda-build lets a selector use, for a Linux target."""
    py = int(variant.python.replace(".", ""))
    x86 = variant.arch == "x86_64"
    return {
        "linux": True,
        "linux64": x86,
        "linux32": False,
        "unix": True,
        "osx": False,
        "win": False,
        "x86": x86,
        "x86_64": x86,
        "ppc64le": variant.arch == "ppc64le",
        "aarch64": False,
        "arm64": False,
        "s390x": False,
        "py": py,
        "py3k": py >= 300,
        "py2k": False,
        "target_platform": variant.subdir,
        "build_platform": variant.subdir,
        "cuda_compiler_version": variant.cuda,
        "lms_tag": variant.tag,
        "python": variant.python,
        "np": 0,
    }


def apply_selectors(text: str, namespace: Mapping[str, Any]) -> str:
    """Keep the lines whose ``# [expr]`` holds, without the selector; keep all other lines."""
    kept = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = SELECTOR.match(line)
        if match is None:
            kept.append(line)
            continue
        expr = match.group("expr")
        try:
            # Selectors are Python expressions by conda-build's definition.
            keep = eval(expr, {"__builtins__": {}}, dict(namespace))
        except Exception as exc:
            raise LmsToolError(
                f"line {number}: selector [{expr}] cannot be evaluated ({exc}); selectors may "
                f"use only {', '.join(sorted(namespace))}"
            ) from None
        if keep:
            kept.append(match.group("body"))
    return "\n".join(kept) + "\n"


def _compiler(variant: Variant) -> Any:
    def compiler(language: str) -> str:
        # conda-build renders compiler('c') as <compiler>_<subdir>, e.g. gcc_linux-64.
        names = {"c": "gcc", "cxx": "gxx", "cuda": "cuda-nvcc", "fortran": "gfortran"}
        if language not in names:
            raise LmsToolError(f"compiler({language!r}) is not a language conda-build knows")
        name = names[language]
        if language == "cuda" and variant.cuda.startswith("11."):
            name = "nvcc"
        return f"{name}_{variant.subdir}"

    return compiler


def render_text(recipe_dir: Path, variant: Variant) -> str:
    try:
        import jinja2
    except ModuleNotFoundError:
        raise LmsToolError("rendering the recipe needs Jinja2: pip install 'Jinja2>=3.0'") from None
    meta = recipe_dir / "meta.yaml"
    try:
        source = meta.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LmsToolError(f"{meta} is missing: restore recipes/ from the project") from None
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    py_nodot = variant.python.replace(".", "")
    context = {
        "lms_tag": variant.tag,
        "cuda_compiler_version": variant.cuda,
        "python": variant.python,
        "PY_VER": variant.python,
        "CONDA_PY": py_nodot,
        "target_platform": variant.subdir,
        "RECIPE_DIR": str(recipe_dir),
        "environ": {},
        "compiler": _compiler(variant),
        "pin_compatible": lambda name, **_: name,
    }
    try:
        rendered = env.from_string(source).render(**context)
    except jinja2.TemplateError as exc:
        raise LmsToolError(f"{meta}: jinja error: {exc}") from None
    return apply_selectors(rendered, selector_namespace(variant))


def render(recipe_dir: Path, variant: Variant) -> dict[str, Any]:
    """The recipe as conda-build would see it for one variant."""
    text = render_text(recipe_dir, variant)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LmsToolError(f"the rendered recipe is not valid YAML: {exc}\n{text}") from None
    if not isinstance(data, dict):
        raise LmsToolError("the rendered recipe is not a mapping")
    return data


def render_for(matrix: BuildMatrix, tag: str, arch: str, python: str, cuda: str) -> dict[str, Any]:
    """Validate the variant against the tag's matrix and render the project's recipe."""
    matrix.tag(tag)
    check_arch(arch)
    validate_versions(matrix, tag, arch, cuda, python)
    return render(matrix.repo / RECIPE_DIR, Variant(tag, arch, python, cuda))


def run_depends(recipe: Mapping[str, Any]) -> list[str]:
    reqs = recipe.get("requirements") or {}
    return [str(dep) for dep in reqs.get("run") or []]


def render_variant_config(recipe_dir: Path, variant: Variant) -> dict[str, Any]:
    """conda_build_config.yaml for one platform (selectors applied)."""
    path = recipe_dir / "conda_build_config.yaml"
    text = apply_selectors(path.read_text(encoding="utf-8"), selector_namespace(variant))
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise LmsToolError(f"{path} must hold a mapping")
    return data


# --------------------------------------------------------------------------------------------
# The series block in meta.yaml


def series_patches(matrix: BuildMatrix, tag: str) -> list[Path]:
    series = matrix.repo / str(matrix.tag(tag).get("series", f"patches/{tag}"))
    return sorted(series.glob("*.patch")) if series.is_dir() else []


def series_block(matrix: BuildMatrix, recipe_dir: Path) -> list[str]:
    """The generated lines between the BEGIN and END markers."""
    lines: list[str] = []
    for tag in sorted(matrix.tags):
        patches = series_patches(matrix, tag)
        if not patches:
            continue
        lines.append(f'  {{% if lms_tag == "{tag}" %}}')
        lines.append("  patches:")
        for patch in patches:
            rel = Path(_relpath(patch, recipe_dir))
            lines.append(f"    - {rel.as_posix()}")
        lines.append("  {% endif %}")
    return lines


def _relpath(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve())


def _split(meta: Path) -> tuple[list[str], list[str], list[str]]:
    lines = meta.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(BEGIN)]
    ends = [i for i, line in enumerate(lines) if line.startswith(END)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise LmsToolError(
            f"{meta} must contain one '{BEGIN.strip()}' line followed by one "
            f"'{END.strip()}' line inside source:; restore them from the project"
        )
    return lines[: starts[0] + 1], lines[starts[0] + 1 : ends[0]], lines[ends[0] :]


def sync_series(matrix: BuildMatrix, check: bool = False) -> bool:
    """Write the series block; return True when meta.yaml changed (or, with check, would)."""
    recipe_dir = matrix.repo / RECIPE_DIR
    meta = recipe_dir / "meta.yaml"
    head, current, tail = _split(meta)
    wanted = series_block(matrix, recipe_dir)
    if current == wanted:
        return False
    if not check:
        meta.write_text("\n".join([*head, *wanted, *tail]) + "\n", encoding="utf-8")
    return True


def listed_patches(recipe: Mapping[str, Any]) -> list[str]:
    source = recipe.get("source") or {}
    return [str(p) for p in source.get("patches") or []]
