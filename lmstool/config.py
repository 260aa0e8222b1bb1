"""The supported-tag matrix (``config/tags.yaml``), loaded into typed, validated objects.

Every command that needs to know a tag (where its source comes from, where its series lives,
what a full build supports) goes through :func:`load_matrix` and :meth:`Matrix.get_tag`, so a
mistake in the YAML is reported once, with the key that is wrong and what to do about it.
Keys this module does not know are kept in ``TagConfig.extra`` for other commands to read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmstool.errors import LmsToolError

MATRIX_PATH = Path("config") / "tags.yaml"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_KNOWN_TAG_KEYS = {"version", "series", "integration", "source", "python", "cuda"}


@dataclass(frozen=True)
class Tarball:
    """A release or distribution tarball of a tag's source, found in a local folder."""

    name: str
    sha256: str
    top: str
    submodules: bool


@dataclass(frozen=True)
class TagSource:
    git_ref: str
    tarballs: tuple[Tarball, ...]


@dataclass(frozen=True)
class TagConfig:
    name: str
    version: str
    series: Path  # relative to the project root
    integration: Path  # relative to the project root
    source: TagSource
    python: tuple[str, ...]
    cuda: Mapping[str, tuple[str, ...]]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def series_dir(self, repo: Path) -> Path:
        return repo / self.series

    def integration_dir(self, repo: Path) -> Path:
        return repo / self.integration


@dataclass(frozen=True)
class Matrix:
    path: Path
    github_remote: str
    default_tag: str
    tags: Mapping[str, TagConfig]

    @property
    def tag_names(self) -> tuple[str, ...]:
        return tuple(self.tags)

    def get_tag(self, name: str) -> TagConfig:
        try:
            return self.tags[name]
        except KeyError:
            raise LmsToolError(
                f"unknown tag '{name}'; supported tags: {', '.join(self.tags)} "
                f"(add a new tag to {self.path} first, see CONTRIBUTING.md)"
            ) from None


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

    def strings(self, node: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
        value = self.get(node, key, where)
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise self.fail(f"{where}.{key}", "expected a list of strings (quote versions)")
        return tuple(str(v) for v in value)


def _parse_tag(r: _Reader, name: str, node: Any) -> TagConfig:
    where = f"tags.{name}"
    node = r.mapping(node, where)
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
        submodules = tb.get("submodules", False)
        if not isinstance(submodules, bool):
            raise r.fail(f"{tw}.submodules", "expected true or false")
        tarballs.append(Tarball(tb_name, sha, r.string(tb, "top", tw).strip("/"), submodules))
    git_ref = r.string(src, "git_ref", f"{where}.source")
    cuda_node = r.mapping(node.get("cuda", {}) or {}, f"{where}.cuda")
    cuda = {arch: r.strings(cuda_node, arch, f"{where}.cuda") for arch in cuda_node}
    return TagConfig(
        name=name,
        version=r.string(node, "version", where),
        series=Path(r.string(node, "series", where)),
        integration=Path(r.string(node, "integration", where)),
        source=TagSource(git_ref=git_ref, tarballs=tuple(tarballs)),
        python=r.strings(node, "python", where) if "python" in node else (),
        cuda=cuda,
        extra={k: v for k, v in node.items() if k not in _KNOWN_TAG_KEYS},
    )


def load_matrix(repo: Path | None = None, path: Path | None = None) -> Matrix:
    """Load and validate the tag matrix of project checkout ``repo`` (or the file ``path``)."""
    if path is None:
        if repo is None:
            from lmstool.cli import default_repo_root

            repo = default_repo_root()
        path = repo / MATRIX_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LmsToolError(
            f"tag matrix {path} not found; run from a project checkout or pass --repo DIR"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LmsToolError(f"{path}: not valid YAML: {exc}; fix the file") from None
    r = _Reader(path)
    root = r.mapping(data, "top level")
    tags_node = r.mapping(r.get(root, "tags", "top level"), "tags")
    if not tags_node:
        raise r.fail("tags", "no tags listed")
    tags = {str(name): _parse_tag(r, str(name), node) for name, node in tags_node.items()}
    default_tag = r.string(root, "default_tag", "top level")
    if default_tag not in tags:
        raise r.fail("default_tag", f"'{default_tag}' is not one of the tags listed")
    return Matrix(
        path=path,
        github_remote=r.string(root, "github_remote", "top level"),
        default_tag=default_tag,
        tags=tags,
    )


def get_tag(name: str, repo: Path | None = None) -> TagConfig:
    """The configuration of tag ``name``; LmsToolError naming the supported tags if unknown."""
    return load_matrix(repo).get_tag(name)
