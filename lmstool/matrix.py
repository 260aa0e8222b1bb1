"""The tag and toolchain matrix: ``config/tags.yaml`` and ``config/toolchain.yaml``, one model.

``config/`` is the only place the supported tags, their sources and checksums, the Python and
CUDA versions of each, and the build toolchain facts are written down. Every command reads
them through :func:`load_matrix`, which validates both files once and names the exact key of
any mistake; the conda recipe's variant file and the generated blocks of ``meta.yaml`` and
``build.sh`` are written from this model (``lmstool recipe sync``), never by hand.

``config/tags.yaml`` alone is enough for the series commands (checkout, apply, patches,
verify); the build and packaging commands also need ``config/toolchain.yaml`` and say so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from lmstool.errors import LmsToolError
from lmstool.hints import option
from lmstool.naming import ARCHES, version_tuple

TAGS_PATH = Path("config") / "tags.yaml"
TOOLCHAIN_PATH = Path("config") / "toolchain.yaml"
SERIES_FILE = "series"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Tarball:
    """A release or distribution tarball of a tag's source, found in a local folder."""

    name: str
    sha256: str
    top: str
    # Whether the tarball carries the git submodules (third_party/). Distribution tarballs
    # (Debian's orig) do not; GitHub's pytorch-vX.Y.Z.tar.gz release assets do.
    submodules: bool
    # Where `lmstool fetch` downloads it from (checked against sha256 before it is kept).
    url: str | None = None


@dataclass(frozen=True)
class TagSource:
    git_ref: str
    tarballs: tuple[Tarball, ...]


@dataclass(frozen=True)
class GccRange:
    min: int
    max: int


@dataclass(frozen=True)
class TagConfig:
    name: str
    version: str
    series: Path  # relative to the project root
    integration: Path  # relative to the project root
    source: TagSource
    python: tuple[str, ...]
    cuda: Mapping[str, tuple[str, ...]]
    # From config/toolchain.yaml (None / empty when that file is absent).
    gcc: GccRange | None = None
    required_submodules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def series_dir(self, repo: Path) -> Path:
        return repo / self.series

    def integration_dir(self, repo: Path) -> Path:
        return repo / self.integration

    def series_file(self, repo: Path) -> Path:
        """``integration/<tag>/series``: the entries the committed series is generated from."""
        return self.integration_dir(repo) / SERIES_FILE

    def has_series(self, repo: Path) -> bool:
        """A tag without ``integration/<tag>/series`` is source only: nothing to apply."""
        return self.series_file(repo).is_file()

    def cudas(self, arch: str) -> tuple[str, ...]:
        return self.cuda.get(arch, ())

    def submodules_for(self, arch: str) -> tuple[str, ...]:
        subs = self.required_submodules
        return (*subs.get("common", ()), *subs.get(arch, ()))


@dataclass(frozen=True)
class CudaInfo:
    version: str
    max_gcc: int
    arch_list: Mapping[str, str]  # TORCH_CUDA_ARCH_LIST per architecture


@dataclass(frozen=True)
class Image:
    cuda: str
    gcc_toolset: int
    python: str


@dataclass(frozen=True)
class Toolchain:
    path: Path
    cuda: Mapping[str, CudaInfo]
    ppc64le_max_cuda: str
    manylinux: Mapping[str, str]
    images: Mapping[str, Image]
    conda_compiler_version: str
    gib_per_job: float
    min_disk_gib: float


@dataclass(frozen=True)
class Matrix:
    repo: Path
    path: Path
    github_remote: str
    default_tag: str
    tags: Mapping[str, TagConfig]
    toolchain_: Toolchain | None = None

    @property
    def tag_names(self) -> tuple[str, ...]:
        return tuple(self.tags)

    def get_tag(self, name: str) -> TagConfig:
        try:
            return self.tags[name]
        except KeyError:
            choices = ", ".join(option("tag", t) for t in self.tags)
            raise LmsToolError(
                f"unknown tag '{name}'; supported tags: {', '.join(self.tags)}. Use one of "
                f"{choices} (a new tag is added to {self.path} first, see CONTRIBUTING.md)"
            ) from None

    def tags_with_series(self) -> tuple[TagConfig, ...]:
        return tuple(t for t in self.tags.values() if t.has_series(self.repo))

    def require_series(self, name: str) -> TagConfig:
        """The tag, refused at once when it has no LMS series (it is source only)."""
        tag = self.get_tag(name)
        if not tag.has_series(self.repo):
            with_series = [t.name for t in self.tags_with_series()]
            choices = ", ".join(option("tag", t) for t in with_series) or "none yet"
            raise LmsToolError(
                f"{name} has no LMS series ({tag.series_file(self.repo)} does not exist): it is "
                f"listed for its source only, so there is nothing to apply or build. Use "
                f"{choices}, or port the series to {name} (CONTRIBUTING.md, 'Porting the "
                f"series to a new tag')"
            )
        return tag

    @property
    def toolchain(self) -> Toolchain:
        if self.toolchain_ is None:
            raise LmsToolError(
                f"{self.repo / TOOLCHAIN_PATH} is missing: the build and packaging commands "
                f"need it; run from a complete project checkout"
            )
        return self.toolchain_

    def cuda_info(self, cuda: str) -> CudaInfo:
        info = self.toolchain.cuda.get(cuda)
        if info is None:
            raise LmsToolError(
                f"{self.toolchain.path} has no entry for CUDA {cuda}: add its max_gcc and "
                f"arch_list under cuda:"
            )
        return info


class _Reader:
    """Walks the parsed YAML, naming the exact key in every error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, msg: str) -> LmsToolError:
        return LmsToolError(f"{self.path}: {where}: {msg}; fix the file (see its header comment)")

    def mapping(self, node: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(node, dict):
            raise self.fail(where, f"expected a mapping, got {type(node).__name__}")
        return node

    def get(self, node: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in node:
            raise self.fail(where, f"missing key '{key}'")
        return node[key]

    def string(self, node: Mapping[str, Any], key: str, where: str) -> str:
        value = self.get(node, key, where)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"{where}.{key}", "expected a non-empty string")
        return value

    def integer(self, node: Mapping[str, Any], key: str, where: str) -> int:
        value = self.get(node, key, where)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(f"{where}.{key}", "expected a whole number")
        return value

    def number(self, node: Mapping[str, Any], key: str, where: str) -> float:
        value = self.get(node, key, where)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(f"{where}.{key}", "expected a number")
        return float(value)

    def strings(self, node: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
        value = self.get(node, key, where)
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise self.fail(f"{where}.{key}", "expected a list of strings (quote versions)")
        return tuple(str(v) for v in value)

    def arch(self, name: Any, where: str) -> str:
        if name not in ARCHES:
            raise self.fail(where, f"'{name}' is not an architecture ({', '.join(ARCHES)})")
        return str(name)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LmsToolError(
            f"{path} not found; run from a project checkout or pass --repo DIR"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LmsToolError(f"{path}: not valid YAML: {exc}; fix the file") from None


def _parse_tag(r: _Reader, name: str, node: Any) -> TagConfig:
    where = f"tags.{name}"
    node = r.mapping(node, where)
    known = {"version", "series", "integration", "source", "python", "cuda"}
    unknown = sorted(set(node) - known)
    if unknown:
        raise r.fail(where, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
    src = r.mapping(r.get(node, "source", where), f"{where}.source")
    tarballs: list[Tarball] = []
    raw_tarballs = src.get("tarballs", []) or []
    if not isinstance(raw_tarballs, list):
        raise r.fail(f"{where}.source.tarballs", "expected a list")
    for i, tb in enumerate(raw_tarballs):
        tw = f"{where}.source.tarballs[{i}]"
        tb = r.mapping(tb, tw)
        if not isinstance(r.get(tb, "sha256", tw), str):
            raise r.fail(f"{tw}.sha256", "expected a string (quote the checksum)")
        sha = r.string(tb, "sha256", tw).lower()
        if not _SHA256_RE.match(sha):
            raise r.fail(f"{tw}.sha256", f"'{sha}' is not a 64-digit hex sha256")
        tb_name = r.string(tb, "name", tw)
        if "/" in tb_name:
            raise r.fail(f"{tw}.name", "a file name, not a path, is expected")
        submodules = r.get(tb, "submodules", tw)
        if not isinstance(submodules, bool):
            raise r.fail(f"{tw}.submodules", "expected true or false")
        url = r.string(tb, "url", tw) if "url" in tb else None
        if url is not None and not url.startswith(("https://", "http://", "file://")):
            raise r.fail(f"{tw}.url", f"'{url}' is not an https://, http:// or file:// URL")
        if url is not None and url.rsplit("/", 1)[-1] != tb_name:
            raise r.fail(f"{tw}.url", f"'{url}' does not end in the file name '{tb_name}'")
        top = r.string(tb, "top", tw).strip("/")
        tarballs.append(Tarball(tb_name, sha, top, submodules, url))
    git_ref = r.string(src, "git_ref", f"{where}.source")
    cuda_node = r.mapping(node.get("cuda", {}) or {}, f"{where}.cuda")
    cuda = {
        r.arch(arch, f"{where}.cuda"): r.strings(cuda_node, arch, f"{where}.cuda")
        for arch in cuda_node
    }
    return TagConfig(
        name=name,
        version=r.string(node, "version", where),
        series=Path(r.string(node, "series", where)),
        integration=Path(r.string(node, "integration", where)),
        source=TagSource(git_ref=git_ref, tarballs=tuple(tarballs)),
        python=r.strings(node, "python", where) if "python" in node else (),
        cuda=cuda,
    )


def _parse_toolchain(
    path: Path, data: Any, tags: dict[str, TagConfig]
) -> tuple[Toolchain, dict[str, TagConfig]]:
    r = _Reader(path)
    root = r.mapping(data, "top level")
    per_tag = r.mapping(r.get(root, "tags", "top level"), "tags")
    merged: dict[str, TagConfig] = {}
    for name, tag in tags.items():
        if name not in per_tag:
            raise r.fail("tags", f"no entry for {name} (listed in {TAGS_PATH}): add its gcc range")
        where = f"tags.{name}"
        node = r.mapping(per_tag[name], where)
        gcc_node = r.mapping(r.get(node, "gcc", where), f"{where}.gcc")
        gcc = GccRange(r.integer(gcc_node, "min", f"{where}.gcc"),
                       r.integer(gcc_node, "max", f"{where}.gcc"))  # fmt: skip
        if gcc.min > gcc.max:
            raise r.fail(f"{where}.gcc", f"min {gcc.min} is above max {gcc.max}")
        subs_node = r.mapping(node.get("required_submodules") or {}, f"{where}.required_submodules")
        subs = {str(k): r.strings(subs_node, k, f"{where}.required_submodules") for k in subs_node}
        merged[name] = replace(tag, gcc=gcc, required_submodules=subs)
    extra = sorted(set(per_tag) - set(tags))
    if extra:
        raise r.fail("tags", f"{', '.join(extra)} not listed in {TAGS_PATH}; remove or add it")
    cuda: dict[str, CudaInfo] = {}
    for version, node in r.mapping(r.get(root, "cuda", "top level"), "cuda").items():
        where = f"cuda.{version}"
        node = r.mapping(node, where)
        lists = r.mapping(r.get(node, "arch_list", where), f"{where}.arch_list")
        cuda[str(version)] = CudaInfo(
            version=str(version),
            max_gcc=r.integer(node, "max_gcc", where),
            arch_list={r.arch(a, f"{where}.arch_list"): str(v) for a, v in lists.items()},
        )
    ppc_max = r.string(root, "ppc64le_max_cuda", "top level")
    for tag in merged.values():
        for arch, versions in tag.cuda.items():
            for version in versions:
                info = cuda.get(version)
                if info is None or arch not in info.arch_list:
                    raise r.fail(
                        f"cuda.{version}.arch_list",
                        f"{tag.name} supports CUDA {version} on {arch} ({TAGS_PATH}) but no "
                        f"TORCH_CUDA_ARCH_LIST for {arch} is given",
                    )
                if arch == "ppc64le" and version_tuple(version) > version_tuple(ppc_max):
                    raise LmsToolError(
                        f"{TAGS_PATH}: tags.{tag.name}.cuda.ppc64le lists CUDA {version}, but "
                        f"NVIDIA's last ppc64le toolkit is {ppc_max}; remove it"
                    )
    images: dict[str, Image] = {}
    for arch, node in r.mapping(r.get(root, "images", "top level"), "images").items():
        where = f"images.{r.arch(arch, 'images')}"
        node = r.mapping(node, where)
        images[arch] = Image(
            cuda=r.string(node, "cuda", where),
            gcc_toolset=r.integer(node, "gcc_toolset", where),
            python=r.string(node, "python", where),
        )
    manylinux = r.mapping(r.get(root, "manylinux", "top level"), "manylinux")
    resources = r.mapping(r.get(root, "resources", "top level"), "resources")
    toolchain = Toolchain(
        path=path,
        cuda=cuda,
        ppc64le_max_cuda=ppc_max,
        manylinux={r.arch(a, "manylinux"): str(v) for a, v in manylinux.items()},
        images=images,
        conda_compiler_version=r.string(root, "conda_compiler_version", "top level"),
        gib_per_job=r.number(resources, "gib_per_job", "resources"),
        min_disk_gib=r.number(resources, "min_disk_gib", "resources"),
    )
    return toolchain, merged


def load_matrix(repo: Path | None = None, path: Path | None = None) -> Matrix:
    """Load and validate the matrix of project checkout ``repo`` (or the tags file ``path``).

    ``config/toolchain.yaml`` beside the tags file is loaded too when it exists.
    """
    if path is None:
        if repo is None:
            from lmstool.cli import default_repo_root

            repo = default_repo_root()
        path = repo / TAGS_PATH
    elif repo is None:
        repo = path.resolve().parent.parent
    data = _read_yaml(path)
    r = _Reader(path)
    root = r.mapping(data, "top level")
    tags_node = r.mapping(r.get(root, "tags", "top level"), "tags")
    if not tags_node:
        raise r.fail("tags", "no tags listed")
    tags = {str(name): _parse_tag(r, str(name), node) for name, node in tags_node.items()}
    default_tag = r.string(root, "default_tag", "top level")
    if default_tag not in tags:
        raise r.fail("default_tag", f"'{default_tag}' is not one of the tags listed")
    toolchain: Toolchain | None = None
    toolchain_path = path.parent / TOOLCHAIN_PATH.name
    if toolchain_path.is_file():
        toolchain, tags = _parse_toolchain(toolchain_path, _read_yaml(toolchain_path), tags)
    return Matrix(
        repo=repo,
        path=path,
        github_remote=r.string(root, "github_remote", "top level"),
        default_tag=default_tag,
        tags=tags,
        toolchain_=toolchain,
    )
