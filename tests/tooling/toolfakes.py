"""Small fake upstream projects for the tooling tests: a tarball, a matrix, a project root."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import git

from lmstool.matrix import Matrix, TagConfig
from lmstool.source import SourceSpec, checkout

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_TAG = "v0.1.0"
FAKE_TOP = "fake-0.1.0"
FAKE_TARBALL = "fake_0.1.0.orig.tar.xz"
MTIME = 1738170058  # 2025-01-29 17:00:58 UTC

STORAGE_H = "".join(f"// StorageImpl line {i}\n" for i in range(1, 41))
ALLOCATOR_H = "".join(f"// CUDACachingAllocator line {i}\n" for i in range(1, 61))


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", **kw: object) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = MTIME
    info.size = len(data)
    for key, value in kw.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if data else None)


def make_tarball(path: Path, top: str = FAKE_TOP) -> str:
    """Write a small release tarball (files, an exec file, a symlink, a hard link)."""
    with tarfile.open(path, "w:xz") as tar:
        _add(tar, f"{top}/", type=tarfile.DIRTYPE, mode=0o755)
        _add(tar, f"{top}/README.md", b"fake upstream\n", mode=0o644)
        _add(tar, f"{top}/c10/core/StorageImpl.h", STORAGE_H.encode(), mode=0o644)
        _add(tar, f"{top}/c10/cuda/CUDACachingAllocator.h", ALLOCATOR_H.encode(), mode=0o644)
        _add(tar, f"{top}/tools/run.sh", b"#!/bin/sh\necho run\n", mode=0o755)
        _add(tar, f"{top}/docs/with space.txt", b"space\n", mode=0o644)
        _add(tar, f"{top}/.gitignore", b"*.log\n", mode=0o644)
        _add(tar, f"{top}/kept.log", b"ignored by .gitignore but shipped\n", mode=0o644)
        _add(tar, f"{top}/link", type=tarfile.SYMTYPE, linkname="README.md", mode=0o777)
        _add(
            tar,
            f"{top}/hard.md",
            type=tarfile.LNKTYPE,
            linkname=f"{top}/README.md",
            mode=0o644,
        )
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_matrix(project: Path, sha256: str, tarball: str = FAKE_TARBALL) -> None:
    (project / "config").mkdir(parents=True, exist_ok=True)
    (project / "config" / "tags.yaml").write_text(
        f"""github_remote: https://invalid.example/fake.git
default_tag: {FAKE_TAG}
tags:
  {FAKE_TAG}:
    version: 0.1.0
    series: patches/{FAKE_TAG}
    integration: integration/{FAKE_TAG}
    source:
      git_ref: {FAKE_TAG}
      tarballs:
        - name: {tarball}
          sha256: "{sha256}"
          top: {FAKE_TOP}
          submodules: false
    python: ["3.11"]
    cuda:
      x86_64: ["12.6"]
  v0.0.9:
    version: 0.0.9
    series: patches/v0.0.9
    integration: integration/v0.0.9
    source:
      git_ref: v0.0.9
      tarballs: []
""",
        encoding="utf-8",
    )


def make_project(root: Path) -> tuple[Path, Path]:
    """A project root with a fake matrix and a sources folder holding its tarball."""
    project = root / "project"
    sources = root / "sources"
    project.mkdir()
    sources.mkdir()
    sha = make_tarball(sources / FAKE_TARBALL)
    write_matrix(project, sha)
    return project, sources


def commit_edit(
    repo: git.Repo, path: str, old: str, new: str, subject: str, date: str, body: str = ""
) -> None:
    """Replace ``old`` by ``new`` in ``path`` and commit with a fixed identity and date."""
    file = Path(repo.working_tree_dir or ".") / path
    text = file.read_text(encoding="utf-8")
    assert old in text, f"{old!r} not in {path}"
    file.write_text(text.replace(old, new, 1), encoding="utf-8")
    repo.git.add(path)
    env = {
        "GIT_AUTHOR_NAME": "LMS Dev",
        "GIT_AUTHOR_EMAIL": "dev@example.org",
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": "LMS Dev",
        "GIT_COMMITTER_EMAIL": "dev@example.org",
        "GIT_COMMITTER_DATE": date,
    }
    message = subject + (f"\n\n{body}" if body else "\n\nForwarded: not-needed")
    repo.git.commit("-q", "-m", message, env=env)


def run_cli(
    *args: str, cache: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m lmstool ARGS`` from this checkout (``env`` added to the environment);
    output captured as text."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if cache is not None:
        env["LMS_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "lmstool", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def tree_state(path: Path) -> tuple[str, str]:
    """HEAD and full `git status` of a tree, to prove a failed command changed nothing."""
    repo = git.Repo(path)
    with repo:
        return repo.head.commit.hexsha, repo.git.status("--porcelain", "--untracked-files=all")


def sources_dir() -> Path | None:
    """The folder of upstream release tarballs: $LMS_SOURCES (`make test SOURCES=DIR`)."""
    env = os.environ.get("LMS_SOURCES", "").strip()
    return Path(env) if env and Path(env).is_dir() else None


@dataclass
class Fake:
    project: Path
    sources: Path
    cache: Path
    matrix: Matrix
    tag: TagConfig

    @property
    def spec(self) -> SourceSpec:
        return SourceSpec(sources=self.sources, cache=self.cache)

    def checkout(self, dest: Path) -> Path:
        return checkout(self.matrix, self.tag, dest, self.spec, self.project)


# Variables an enclosing `make test SOURCES=...` passes down (MAKEFLAGS carries its
# command-line variables) or that a user may have exported: a make run by a test sees none.
_MAKE_INHERITED = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}
_MAKE_VARIABLES = {"SOURCES", "REMOTE", "MIRROR", "TAG", "WORK", "VENV", "LMS_SOURCES"}


def run_make(*args: str) -> subprocess.CompletedProcess[str]:
    """``make -n ARGS`` in this checkout with a clean environment (no variables of an
    enclosing make or of the user): prints the recipes and runs none of them."""
    skip = _MAKE_INHERITED | _MAKE_VARIABLES
    env = {k: v for k, v in os.environ.items() if k not in skip}
    return subprocess.run(
        ["make", "-n", "--no-print-directory", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
