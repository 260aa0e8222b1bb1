"""Small git helpers shared by the series commands.

Repository work goes through GitPython. Only operations that GitPython has no API for
(feeding a patch on stdin to ``git patch-id``/``git apply``/``git mailinfo``, streaming into
``git fast-import``) run the ``git`` executable directly, through :func:`run_git`.

Operations whose output must be byte-for-byte reproducible (``am``, ``format-patch``, commits
made while generating a series) run with :func:`pinned_env`: the user's global and system git
configuration is ignored and identities and dates are set explicitly.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import git

from lmstool.errors import LmsToolError

# Committer identity of every commit the tooling makes (applying or generating a series), so
# re-applying a series yields the same commit ids on every machine.
COMMITTER_NAME = "PyTorch LMS"
COMMITTER_EMAIL = "lms@noreply"


def pinned_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for reproducible git runs: no user/system config, C locale, no pager."""
    env = {
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "LC_ALL": "C",
        "LANG": "C",
        "TZ": "UTC",
        "GIT_PAGER": "cat",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_COMMITTER_NAME": COMMITTER_NAME,
        "GIT_COMMITTER_EMAIL": COMMITTER_EMAIL,
    }
    if extra:
        env.update(extra)
    return env


def run_git(
    cwd: Path,
    args: Sequence[str],
    *,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git ARGS`` in ``cwd`` with bytes on stdin (for commands GitPython cannot feed)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        ["git", *args],
        cwd=cwd,
        input=input,
        capture_output=True,
        env=full_env,
        check=False,
    )
    if check and proc.returncode != 0:
        raise LmsToolError(
            f"git {' '.join(args)} failed in {cwd} (exit {proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()}"
        )
    return proc


def open_repo(path: Path, what: str = "tree") -> git.Repo:
    """Open the git working tree at ``path`` or fail with what to do."""
    try:
        return git.Repo(path)
    except (git.NoSuchPathError, git.InvalidGitRepositoryError):
        raise LmsToolError(
            f"{what} {path} is not a git repository; create it with `lmstool checkout TAG "
            f"--dest {path}` (or `make patch TAG=...`)"
        ) from None


def resolve_commit(repo: git.Repo, rev: str) -> git.Commit | None:
    try:
        return repo.commit(rev)
    except (git.BadName, ValueError, git.GitCommandError):
        return None


def tracked_changes(repo: git.Repo) -> list[str]:
    """``git status --porcelain`` lines for tracked files (untracked files are not counted)."""
    out: str = repo.git.status("--porcelain", "--untracked-files=no")
    return [line for line in out.splitlines() if line.strip()]


def applied_by_lmstool(commit: git.Commit) -> bool:
    """True for a commit that ``git am`` of a series made here (its pinned committer)."""
    return commit.committer.name == COMMITTER_NAME and commit.committer.email == COMMITTER_EMAIL


def operation_in_progress(repo: git.Repo) -> str | None:
    gitdir = Path(repo.git_dir)
    for name, what in (
        ("rebase-apply", "a `git am` or rebase"),
        ("rebase-merge", "a rebase"),
        ("MERGE_HEAD", "a merge"),
        ("CHERRY_PICK_HEAD", "a cherry-pick"),
    ):
        if (gitdir / name).exists():
            return what
    return None
