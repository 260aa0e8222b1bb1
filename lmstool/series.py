"""Applying a committed patch series to a tree, and exporting a tree's commits as a series.

Both directions are deterministic: ``git am`` runs with a fixed committer and the committer
date set to the author date, so applying a series twice gives the same commit ids, and
``git format-patch`` runs with fixed options (:data:`FORMAT_PATCH_ARGS`) and no user
configuration, so a patch whose content did not change is byte-identical after re-export.
"""

from __future__ import annotations

import filecmp
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import git

from lmstool.errors import LmsToolError
from lmstool.gitutil import (
    applied_by_lmstool,
    open_repo,
    operation_in_progress,
    pinned_env,
    resolve_commit,
    run_git,
    tracked_changes,
)
from lmstool.hints import command, make_command, option, via_make

log = logging.getLogger(__name__)

# Options of every `git format-patch` that writes a committed series. Changing any of them
# changes every committed patch: regenerate all series (`make patches`) in the same commit.
FORMAT_PATCH_ARGS: tuple[str, ...] = (
    "--zero-commit",
    "--no-signature",
    "--no-numbered",
    "--full-index",
    "--no-renames",
    "--diff-algorithm=myers",
    "--encoding=UTF-8",
    "--no-color",
    "--no-thread",
    "--no-cover-letter",
    "--no-attach",
    "--no-notes",
    "--subject-prefix=PATCH",
    "--filename-max-length=64",
    "--stat=72",
    "--summary",
)

# Options of every `git am` that applies a series (3-way merging off: a patch either applies
# as written or the series must be rebased).
AM_ARGS: tuple[str, ...] = (
    "--no-3way",
    "--committer-date-is-author-date",
    "--whitespace=nowarn",
    "--no-message-id",
)

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@.*$")
_FAILED_RE = re.compile(r"^error: patch failed: (.+):(\d+)$", re.M)
_SUBJECT_RE = re.compile(r"^Subject: (.*(?:\n[ \t].*)*)", re.M)


def series_files(directory: Path) -> list[Path]:
    """The ``*.patch`` files of a series folder, in order."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix == ".patch" and p.is_file())


def patch_subject(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    m = _SUBJECT_RE.search(text.split("\n\n", 1)[0])
    if not m:
        return "(no subject)"
    subject = re.sub(r"\s*\n[ \t]+", " ", m.group(1)).strip()
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)


@dataclass(frozen=True)
class Hunk:
    file: str
    number: int  # 1-based, within that file's part of the patch
    header: str
    old_start: int


def patch_hunks(path: Path) -> list[Hunk]:
    """Every hunk of a patch file with the file it belongs to (the pre-image name)."""
    hunks: list[Hunk] = []
    current: str | None = None
    number = 0
    in_header = False
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("diff --git "):
            current, number, in_header = None, 0, True
            m = re.match(r"^diff --git a/(.+) b/(.+)$", line)
            if m:
                current = m.group(1)
            continue
        if in_header and line.startswith("--- "):
            if line != "--- /dev/null" and line.startswith("--- a/"):
                current = line[6:]
            continue
        if in_header and line.startswith("+++ "):
            if current is None and line.startswith("+++ b/"):
                current = line[6:]
            in_header = False
            continue
        m = _HUNK_RE.match(line)
        if m and current is not None:
            number += 1
            hunks.append(Hunk(current, number, line, int(m.group(1))))
    return hunks


@dataclass
class PatchFailure:
    """Where a series stopped applying, for the error message."""

    patch: Path | None
    subject: str
    index: int  # 1-based position in the series
    total: int
    git_errors: list[str]
    hunks: list[Hunk] = field(default_factory=list)

    def describe(self) -> str:
        name = self.patch.name if self.patch else f"patch {self.index}"
        lines = [f"patch {self.index}/{self.total} {name} ('{self.subject}') does not apply"]
        for h in self.hunks:
            lines.append(f"  failed hunk: {h.file} hunk #{h.number}: {h.header}")
        lines += [f"  git: {e}" for e in self.git_errors]
        return "\n".join(lines)


def adds_files_only(path: Path) -> bool:
    """True for a patch whose every file is a new file (an engine patch of the series)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    files = len(re.findall(r"^diff --git ", text, re.M))
    return files > 0 and files == len(re.findall(r"^new file mode ", text, re.M))


def where_to_fix(failure: PatchFailure, tag: str) -> str:
    """Where the change that does not fit is made, for the message of a failed apply: an
    integration patch is kept only as its file in the series, an engine patch is generated
    from engine/."""
    regenerate = f"`{make_command(f'make patches TAG={tag}')}`"
    if failure.patch is None:
        return f"rebase it onto {tag} and run {regenerate} (CONTRIBUTING.md, 'Changing a patch')"
    if adds_files_only(failure.patch):
        return (
            f"{failure.patch} is an engine patch, generated from engine/: it only adds files, "
            f"so this tree has some of them already (engine files must be new files in {tag}; "
            f"start from a fresh checkout, or rename the engine file and run {regenerate})"
        )
    return (
        f"the failing hunk lives in {failure.patch}, the only copy of that integration patch: "
        f"rebase the patch onto {tag} there and run {regenerate} (CONTRIBUTING.md, 'Changing "
        f"a patch')"
    )


class SeriesApplyError(LmsToolError):
    def __init__(self, failure: PatchFailure, advice: str) -> None:
        super().__init__(f"{failure.describe()}\n{advice}")
        self.failure = failure


def _failure_from_am(
    repo: git.Repo, patches: Sequence[Path], output: str, offset: int, total: int
) -> PatchFailure:
    gitdir = Path(repo.git_dir)
    try:
        index = int((gitdir / "rebase-apply" / "next").read_text().strip())
    except (OSError, ValueError):
        index = 1
    patch = patches[index - 1] if 0 < index <= len(patches) else None
    errors = [
        line[len("error: ") :]
        for line in output.splitlines()
        if line.startswith("error: ") and "patch failed:" not in line
    ]
    hunks: list[Hunk] = []
    if patch is not None:
        all_hunks = patch_hunks(patch)
        for fname, lineno in _FAILED_RE.findall(output):
            match = [h for h in all_hunks if h.file == fname and h.old_start == int(lineno)]
            hunks += match or [Hunk(fname, 0, f"(hunk at line {lineno})", int(lineno))]
    subject = patch_subject(patch) if patch else "?"
    return PatchFailure(patch, subject, offset + index, total, errors, hunks)


def _status(repo: git.Repo) -> str:
    return repo.git.status("--porcelain", "--untracked-files=all")


def git_am(
    repo: git.Repo,
    patches: Sequence[Path],
    *,
    advice: str | Callable[[PatchFailure], str],
    offset: int = 0,
    total: int | None = None,
) -> None:
    """``git am`` the patch files onto HEAD; on failure restore HEAD and the tree and raise.

    ``advice`` ends the error: a text, or a function of the failure that names where to fix
    it. ``offset``/``total`` place ``patches`` within a longer series for the error message.
    """
    if not patches:
        return
    total = total if total is not None else len(patches)
    before_head = repo.head.commit.hexsha
    before_status = _status(repo)
    status, stdout, stderr = repo.git.am(
        *AM_ARGS,
        *[str(p) for p in patches],
        env=pinned_env(),
        with_extended_output=True,
        with_exceptions=False,
    )
    if status != 0:
        output = f"{stdout}\n{stderr}"
        failure = _failure_from_am(repo, patches, output, offset, total)
        try:
            repo.git.am("--abort", env=pinned_env())
        except git.GitCommandError as abort_exc:
            raise LmsToolError(
                f"{failure.describe()}\n`git am --abort` failed too ({abort_exc.stderr.strip()}); "
                f"the tree {repo.working_tree_dir} is left mid-`git am`: inspect it, run "
                f"`git am --abort` there, and check `git status`"
            ) from None
        restored = repo.head.commit.hexsha == before_head and _status(repo) == before_status
        if not restored:
            raise LmsToolError(
                f"{failure.describe()}\nafter `git am --abort` the tree is not as before "
                f"(HEAD was {before_head}); check {repo.working_tree_dir} with `git status`"
            ) from None
        text = advice if isinstance(advice, str) else advice(failure)
        raise SeriesApplyError(failure, text) from None


def _patch_id(repo_path: Path, diff: bytes) -> str | None:
    out = run_git(repo_path, ["patch-id", "--stable"], input=diff).stdout.decode()
    return out.split()[0] if out.strip() else None


def series_patch_ids(repo_path: Path, patches: Sequence[Path]) -> list[str | None]:
    return [_patch_id(repo_path, p.read_bytes()) for p in patches]


def commit_patch_ids(repo: git.Repo, base: str) -> list[str | None]:
    """``git patch-id --stable`` of each commit in base..HEAD, oldest first."""
    shas: list[str] = repo.git.rev_list("--reverse", f"{base}..HEAD").split()
    ids: list[str | None] = []
    for sha in shas:
        diff = run_git(
            Path(repo.git_dir),
            ["show", "--no-renames", "--format=", "--no-color", sha],
            env=pinned_env(),
        ).stdout
        ids.append(_patch_id(Path(repo.git_dir), diff))
    return ids


def _reverse_applies(repo: git.Repo, patches: Sequence[Path]) -> bool:
    proc = run_git(
        Path(repo.working_tree_dir or "."),
        ["apply", "--check", "--reverse", *[str(p) for p in reversed(patches)]],
        env=pinned_env(),
        check=False,
    )
    return proc.returncode == 0


def fresh_checkout(tree: Path, tag: str) -> str:
    """How to get a new checkout of ``tag`` where ``tree`` is, as the user runs the tool."""
    return command(
        f"rm -rf {tree} && lmstool checkout {tag} --dest {tree}",
        f"rm -rf {tree} && make patch TAG={tag}",
    )


@dataclass(frozen=True)
class ApplyResult:
    applied: int
    already: bool
    message: str


def apply_series(tree: Path, tag: str, patch_dir: Path) -> ApplyResult:
    """Apply the series in ``patch_dir`` onto the checkout ``tree`` of ``tag``."""
    patches = series_files(patch_dir)
    if not patches:
        raise LmsToolError(
            f"no series for {tag}: {patch_dir} has no *.patch files; the tag is source only "
            f"(generate its series with `{make_command(f'make patches TAG={tag}')}` once "
            f"integration/{tag}/series "
            f"exists)"
        )
    repo = open_repo(tree)
    with repo:
        tag_commit = resolve_commit(repo, tag)
        if tag_commit is None:
            raise LmsToolError(
                f"{tree} has no tag {tag}; is it a checkout of another tag? Create a fresh one "
                f"with {fresh_checkout(tree, tag)}"
            )
        busy = operation_in_progress(repo)
        if busy:
            raise LmsToolError(f"{tree} is in the middle of {busy}; finish or abort it there first")
        dirty = tracked_changes(repo)
        if dirty:
            raise LmsToolError(
                f"{tree} has uncommitted changes ({len(dirty)} files, e.g. {dirty[0].strip()}); "
                f"commit or stash them, then apply again"
            )
        if not repo.is_ancestor(tag_commit, repo.head.commit):
            raise LmsToolError(
                f"HEAD of {tree} does not contain {tag}; check out {tag} (or the lms-{tag} "
                f"branch) first"
            )
        n = len(patches)
        want = series_patch_ids(tree, patches)
        have = commit_patch_ids(repo, tag)
        if have[:n] == want:
            extra = f" (plus {len(have) - n} more commits)" if len(have) > n else ""
            msg = f"already applied: the {n} patches of {patch_dir} are the commits above {tag}"
            return ApplyResult(0, True, msg + extra + "; nothing done")
        k = len(have)
        if 0 < k < n and have == want[:k]:
            raise LmsToolError(
                f"the series is partially applied: patches 1-{k} of {n} are the commits above "
                f"{tag} (last: {patches[k - 1].name}); finish it with `git am "
                f"{' '.join(str(p) for p in patches[k : k + 1])} ...` (the remaining "
                f"{n - k} patches), or start over from a fresh checkout: "
                f"{fresh_checkout(tree, tag)}"
            )
        above = list(repo.iter_commits(f"{tag_commit.hexsha}..HEAD"))
        if above and all(applied_by_lmstool(c) for c in above):
            return _replace_series(repo, tree, tag, tag_commit, len(above), patches, patch_dir)
        if have:
            for m in range(n, 0, -1):
                if _reverse_applies(repo, patches[:m]):
                    if m == n:
                        return ApplyResult(
                            0,
                            True,
                            f"the changes of all {n} patches are already in {tree}, but not as "
                            f"the series' commits; nothing done (start from a fresh checkout "
                            f"to get the series as commits)",
                        )
                    raise LmsToolError(
                        f"the changes of patches 1-{m} of {n} (through {patches[m - 1].name}) "
                        f"are already in {tree} but not as the series' commits; start from a "
                        f"fresh checkout ({fresh_checkout(tree, tag)}) and apply again"
                    )
        own = [c for c in above if not applied_by_lmstool(c)]
        # The series is made for the tag itself: on commits of the user's own it may be those
        # that it does not fit.
        elsewhere = (
            f"`{make_command(f'make patch TAG={tag}')}` with another WORK=DIR"
            if via_make()
            else f"`lmstool checkout {tag} --dest DIR`, then `lmstool apply {tag} --tree DIR`"
        )
        yours = (
            f"{tree} has {len(own)} commit(s) of your own above {tag} (newest: "
            f"{own[0].hexsha[:12]} '{own[0].summary}'); the series is made for {tag} itself, so "
            f"they may be what it does not fit: to tell, apply it to a fresh checkout in "
            f"another folder ({elsewhere}). Otherwise, "
            if own
            else "The series does not fit this tree: "
        )
        log.info("applying %d patches from %s to %s", n, patch_dir, tree)
        git_am(
            repo,
            patches,
            advice=lambda failure: (
                f"nothing was applied: HEAD and the tree of {tree} are as before. {yours}"
                f"{where_to_fix(failure, tag)}"
            ),
        )
        return ApplyResult(n, False, f"applied {n} patches; HEAD is {repo.head.commit.hexsha[:12]}")


def _replace_series(
    repo: git.Repo,
    tree: Path,
    tag: str,
    tag_commit: git.Commit,
    replaced: int,
    patches: Sequence[Path],
    patch_dir: Path,
) -> ApplyResult:
    """Replaces another version of the series, applied here earlier (``replaced`` commits
    above ``tag``), with ``patches``.

    Every commit above ``tag`` was made by applying a series (an engine edited since, a hunk
    rebased): the tree goes back to ``tag`` and the series is applied anew. The earlier
    commits stay on a branch, so nothing is lost; a series that does not fit leaves the tree
    at ``tag``, with that branch named in the error.
    """
    keep = f"lms-{tag}-replaced"
    repo.create_head(keep, repo.head.commit, force=True)
    repo.git.reset("--quiet", "--hard", tag_commit.hexsha, env=pinned_env())
    log.info(
        "%s held another version of the series (%d commits above %s), kept on branch %s; "
        "applying %d patches from %s",
        tree,
        replaced,
        tag,
        keep,
        len(patches),
        patch_dir,
    )
    git_am(
        repo,
        patches,
        advice=lambda failure: (
            f"the tree is at {tag}; the series it held before is on branch {keep}. The "
            f"series does not fit {tag}: {where_to_fix(failure, tag)}"
        ),
    )
    return ApplyResult(
        len(patches),
        False,
        f"replaced the {replaced} commits of an earlier series (kept on branch {keep}): "
        f"applied {len(patches)} patches; HEAD is {repo.head.commit.hexsha[:12]}",
    )


@dataclass(frozen=True)
class ExportResult:
    written: list[str]
    unchanged: list[str]
    removed: list[str]

    def summary(self, dest: Path) -> str:
        parts = [
            f"{len(self.written)} written, {len(self.unchanged)} unchanged, "
            f"{len(self.removed)} removed in {dest}"
        ]
        parts += [f"  wrote {n}" for n in self.written]
        parts += [f"  removed stale {n}" for n in self.removed]
        return "\n".join(parts)


def format_patches(repo: git.Repo, base: str, out_dir: Path) -> list[Path]:
    """``git format-patch`` base..HEAD into the empty folder ``out_dir`` (stable options)."""
    out: str = repo.git.format_patch(
        *FORMAT_PATCH_ARGS, "-o", str(out_dir), f"{base}..HEAD", env=pinned_env()
    )
    return [Path(line) for line in out.splitlines() if line.strip()]


def sync_series(generated: Sequence[Path], dest: Path) -> ExportResult:
    """Make ``dest``'s *.patch files exactly ``generated``, rewriting only changed files."""
    dest.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    unchanged: list[str] = []
    names = {p.name for p in generated}
    for src in generated:
        target = dest / src.name
        if target.is_file() and filecmp.cmp(src, target, shallow=False):
            unchanged.append(src.name)
            continue
        tmp = dest / f".{src.name}.tmp"
        shutil.copyfile(src, tmp)
        os.replace(tmp, target)
        written.append(src.name)
    removed = [p.name for p in series_files(dest) if p.name not in names]
    for name in removed:
        (dest / name).unlink()
    return ExportResult(written, unchanged, removed)


def export_series(
    tree: Path, tag: str, dest: Path, names: Sequence[str] | None = None
) -> ExportResult:
    """Write the commits above ``tag`` in ``tree`` as the numbered series in ``dest``.

    ``names``, when given, are the file names of the patches in order (the entries of
    ``integration/<tag>/series``); otherwise ``git format-patch`` names them by subject.
    """
    repo = open_repo(tree)
    with repo:
        if resolve_commit(repo, tag) is None:
            raise LmsToolError(
                f"{tree} has no tag {tag}; pass the checkout of {tag} ({option('tree', 'DIR')})"
            )
        dirty = tracked_changes(repo)
        if dirty:
            raise LmsToolError(
                f"{tree} has uncommitted changes ({dirty[0].strip()} ...); they would not be "
                f"exported: commit them (or stash them) and export again"
            )
        count = int(repo.git.rev_list("--count", f"{tag}..HEAD"))
        if count == 0:
            raise LmsToolError(
                f"no commits above {tag} in {tree}; apply the series or commit changes first"
            )
        if names is not None and len(names) != count:
            raise LmsToolError(
                f"{tree} has {count} commits above {tag} but the series lists {len(names)} "
                f"entries; export to another folder (--to DIR) and add or remove the entry in "
                f"integration/{tag}/series first (CONTRIBUTING.md, 'Changing a patch')"
            )
        with tempfile.TemporaryDirectory(prefix="lms-export-") as tmp:
            generated = format_patches(repo, tag, Path(tmp))
            if names is not None:
                renamed = []
                for path, name in zip(generated, names):
                    target = path.with_name(name)
                    os.replace(path, target)
                    renamed.append(target)
                generated = renamed
            return sync_series(generated, dest)
