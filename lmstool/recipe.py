"""Render and maintain the conda-build recipe in recipes/pytorch-lms/ without conda-build.

Rendering follows conda-build's order: the jinja template is evaluated first (with the
variant's variables and conda-build's helpers such as ``compiler()``), then each line carrying
a ``# [selector]`` comment is kept or dropped by evaluating the selector for the target
platform, then the text is parsed as YAML.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lmstool.errors import LmsToolError
from lmstool.matrix import Matrix, TagConfig
from lmstool.naming import ARCHES, CONDA_SUBDIRS, check_arch, version_tuple
from lmstool.plan import ARCH_ENV, COMMON_ENV, validate_versions

RECIPE_DIR = Path("recipes") / "pytorch-lms"
SELECTOR = re.compile(r"^(?P<body>.*?)\s*#\s*\[(?P<expr>.+)\]\s*$")
GENERATED = "written by `lmstool recipe sync` from config/ and patches/; do not edit"


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


def cuda_compiler_name(cuda: str) -> str:
    """conda-forge's CUDA compiler package: nvcc up to CUDA 11, cuda-nvcc from CUDA 12 on."""
    return "nvcc" if version_tuple(cuda) < (12,) else "cuda-nvcc"


def _compiler(variant: Variant) -> Any:
    def compiler(language: str) -> str:
        # conda-build renders compiler('c') as <compiler>_<subdir>, e.g. gcc_linux-64.
        names = {"c": "gcc", "cxx": "gxx", "cuda": "cuda-nvcc", "fortran": "gfortran"}
        if language not in names:
            raise LmsToolError(f"compiler({language!r}) is not a language conda-build knows")
        name = names[language]
        if language == "cuda":
            name = cuda_compiler_name(variant.cuda)
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


def render_for(matrix: Matrix, tag: str, arch: str, python: str, cuda: str) -> dict[str, Any]:
    """Validate the variant against the tag's matrix and render the project's recipe."""
    matrix.get_tag(tag)
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
# The generated parts: conda_build_config.yaml, blocks of meta.yaml and build.sh


def _ordered(versions: set[str]) -> list[str]:
    return sorted(versions, key=version_tuple)


def recipe_tags(matrix: Matrix) -> list[TagConfig]:
    """The tags the recipe builds: those with a committed series."""
    return [t for t in matrix.tags.values() if series_patches(matrix, t.name)]


def series_patches(matrix: Matrix, tag: str) -> list[Path]:
    series = matrix.get_tag(tag).series_dir(matrix.repo)
    return sorted(series.glob("*.patch")) if series.is_dir() else []


def _cudas_by_arch(matrix: Matrix) -> dict[str, list[str]]:
    tags = recipe_tags(matrix)
    return {arch: _ordered({c for t in tags for c in t.cudas(arch)}) for arch in ARCHES}


def _arch_selector(arches: set[str]) -> str:
    if arches == set(ARCHES):
        return ""
    return "  # [" + " or ".join(sorted(arches)) + "]"


def variant_config_text(matrix: Matrix) -> str:
    """conda_build_config.yaml: the recipe's variants, from the tag matrix."""
    tags = recipe_tags(matrix)
    by_arch = _cudas_by_arch(matrix)
    lines = [
        f"# Variants of recipes/pytorch-lms/meta.yaml, {GENERATED}.",
        "lms_tag:",
        *[f"  - {t.name}" for t in tags],
        "python:",
        *[f'  - "{p}"' for p in _ordered({p for t in tags for p in t.python})],
        "# conda-forge's CUDA compiler is nvcc up to CUDA 11 and cuda-nvcc from CUDA 12 on;",
        "# zipped with cuda_compiler_version, so compiler('cuda') picks the right one.",
        "cuda_compiler:",
    ]
    cudas = _ordered({c for versions in by_arch.values() for c in versions})
    selectors = {
        c: _arch_selector({a for a, versions in by_arch.items() if c in versions}) for c in cudas
    }
    lines += [f"  - {cuda_compiler_name(c)}{selectors[c]}" for c in cudas]
    lines.append("cuda_compiler_version:")
    lines += [f'  - "{c}"{selectors[c]}' for c in cudas]
    version = matrix.toolchain.conda_compiler_version
    lines += [
        "c_compiler_version:",
        f'  - "{version}"',
        "cxx_compiler_version:",
        f'  - "{version}"',
        "zip_keys:",
        "  - [cuda_compiler, cuda_compiler_version]",
    ]
    return "\n".join(lines) + "\n"


def _meta_blocks(matrix: Matrix, recipe_dir: Path) -> dict[str, list[str]]:
    versions = ", ".join(f'"{t.name}": "{t.version}"' for t in matrix.tags.values())
    ppc = _quoted(_cudas_by_arch(matrix)["ppc64le"])
    series: list[str] = []
    for tag in recipe_tags(matrix):
        series.append(f'  {{% if lms_tag == "{tag.name}" %}}')
        series.append("  patches:")
        for patch in series_patches(matrix, tag.name):
            series.append(f"    - {Path(_relpath(patch, recipe_dir)).as_posix()}")
        series.append("  {% endif %}")
    per_tag = " or ".join(_tag_skip(tag) for tag in recipe_tags(matrix))
    return {
        "versions": [f"{{% set versions = {{{versions}}} %}}"],
        "skip": [
            "  # CUDA has no ppc64le toolkit after "
            f"{matrix.toolchain.ppc64le_max_cuda}; the tags' ppc64le CUDA versions. The variants",
            "  # are the product of every tag's Pythons and CUDA versions; each tag builds only",
            "  # its own (config/tags.yaml).",
            f"  skip: true  # [not linux or (ppc64le and cuda_compiler_version not in "
            f"{_tuple(ppc)}){' or ' + per_tag if per_tag else ''}]",
        ],
        "series": series,
    }


def _quoted(items: Sequence[str]) -> list[str]:
    return [f'"{item}"' for item in items]


def _tuple(items: Sequence[str]) -> str:
    """A Python tuple literal for a selector."""
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _tag_skip(tag: TagConfig) -> str:
    """The selector that holds for variants of ``tag`` outside its Pythons and CUDA versions."""
    pys = _tuple([p.replace(".", "") for p in tag.python])
    cuda = " or ".join(
        f"({arch} and cuda_compiler_version not in {_tuple(_quoted(tag.cudas(arch)))})"
        for arch in ARCHES
    )
    return f'(lms_tag == "{tag.name}" and (py not in {pys} or {cuda}))'


def _build_sh_block(matrix: Matrix) -> list[str]:
    lines = [f"export {k}={v}" for k, v in COMMON_ENV.items()]
    lines.append('if [[ "${target_platform}" == "linux-ppc64le" ]]; then')
    lines += [f"  export {k}={v}" for k, v in ARCH_ENV["ppc64le"].items()]
    lines.append("else")
    lines += [f"  export {k}={v}" for k, v in ARCH_ENV["x86_64"].items()]
    lines.append("fi")
    lines.append('case "${target_platform}/${cuda_compiler_version}" in')
    for arch, cudas in _cudas_by_arch(matrix).items():
        for cuda in cudas:
            arch_list = matrix.cuda_info(cuda).arch_list[arch]
            lines.append(f'  {CONDA_SUBDIRS[arch]}/{cuda}) arch_list="{arch_list}" ;;')
    lines += [
        "  *)",
        '    echo "build.sh: no TORCH_CUDA_ARCH_LIST for ${target_platform} CUDA '
        '${cuda_compiler_version} in config/toolchain.yaml" >&2',
        "    exit 1",
        "    ;;",
        "esac",
        'export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${arch_list}}"',
    ]
    return lines


def _relpath(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve())


def replace_blocks(path: Path, text: str, blocks: dict[str, list[str]]) -> str:
    """``text`` with the lines between each ``BEGIN lms-NAME`` and ``END lms-NAME`` replaced."""
    lines = text.splitlines()
    for name, wanted in blocks.items():
        starts = [i for i, line in enumerate(lines) if f"BEGIN lms-{name} " in line + " "]
        ends = [i for i, line in enumerate(lines) if f"END lms-{name} " in line + " "]
        if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
            raise LmsToolError(
                f"{path} must contain one 'BEGIN lms-{name}' line followed by one "
                f"'END lms-{name}' line; restore them from the project"
            )
        lines = [*lines[: starts[0] + 1], *wanted, *lines[ends[0] :]]
    return "\n".join(lines) + "\n"


def generated_files(matrix: Matrix) -> dict[Path, str]:
    """Every file ``recipe sync`` writes, with the content it must have."""
    recipe_dir = matrix.repo / RECIPE_DIR
    meta = recipe_dir / "meta.yaml"
    build_sh = recipe_dir / "build.sh"
    try:
        meta_text = meta.read_text(encoding="utf-8")
        build_text = build_sh.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise LmsToolError(
            f"{exc.filename} is missing: restore recipes/ from the project"
        ) from None
    return {
        recipe_dir / "conda_build_config.yaml": variant_config_text(matrix),
        meta: replace_blocks(meta, meta_text, _meta_blocks(matrix, recipe_dir)),
        build_sh: replace_blocks(build_sh, build_text, {"env": _build_sh_block(matrix)}),
    }


def sync(matrix: Matrix, check: bool = False) -> list[Path]:
    """Write the generated parts; return the files that changed (with ``check``: would)."""
    changed: list[Path] = []
    for path, text in generated_files(matrix).items():
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current == text:
            continue
        changed.append(path)
        if not check:
            path.write_text(text, encoding="utf-8")
    return changed


def listed_patches(recipe: Mapping[str, Any]) -> list[str]:
    source = recipe.get("source") or {}
    return [str(p) for p in source.get("patches") or []]
