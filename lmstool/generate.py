"""Generating a tag's committed series from the engine sources and its integration hunks.

``integration/<tag>/series`` lists the entries in order, one a line (``#`` starts a comment);
entry ``NNNN`` is the NNNN-th line, because ``git am patches/<tag>/*.patch`` applies the series
in file-name order:

* ``NNNN-topic.patch``: an integration patch, kept once, as ``patches/<tag>/NNNN-topic.patch``
  (the committed series): an mbox patch (From:, Date:, Subject:, a body saying what and why,
  the ``Forwarded:`` field of CONTRIBUTING.md) against the tree after the previous entries;
* ``NNNN-topic.engine PATH...``: in ``integration/<tag>/``, the same header and body with no
  diff. Its diff is generated: the files under ``engine/PATH`` (a file or a folder, relative to
  ``engine/``; lmstool.manifest lists them) are copied to the same relative path in the tree
  (they must be new files there) and committed with that header's author, date and message.
  Every engine file belongs to exactly one such entry, so each topic (the c10 engine, operator
  pinning, the Python API, the tests) stays one patch.

Generation clones the pristine tag, makes one commit per entry, and writes the commits with
the same stable ``git format-patch`` options as ``lmstool export``, each under its entry's
name (``NNNN-topic.patch``). Two runs from the same inputs give byte-identical series.
"""

from __future__ import annotations

import filecmp
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import git

from lmstool import manifest
from lmstool.errors import LmsToolError
from lmstool.gitutil import pinned_env, run_git
from lmstool.hints import make_command
from lmstool.matrix import SERIES_FILE, Matrix, TagConfig
from lmstool.series import (
    ExportResult,
    apply_series,
    format_patches,
    git_am,
    series_files,
    sync_series,
)
from lmstool.source import (
    SourceSpec,
    SourceUnavailable,
    branch_name,
    clone_tree,
    pristine_repo,
)

log = logging.getLogger(__name__)

_ENTRY_RE = re.compile(r"^(\d{4})-[A-Za-z0-9][A-Za-z0-9._+-]*\.(patch|engine)$")


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str  # "patch" or "engine"
    line: int
    engine_paths: tuple[str, ...] = ()  # for "engine" entries: what they carry

    @property
    def patch_name(self) -> str:
        """The name of the entry's patch in the committed series."""
        return self.path.with_suffix(".patch").name


def read_series(integration_dir: Path, series_dir: Path) -> list[Entry]:
    """Parse and check ``integration_dir/series``; ``.patch`` entries live in ``series_dir``."""
    series = integration_dir / SERIES_FILE
    entries: list[Entry] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(series.read_text(encoding="utf-8").splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        name, paths = fields[0], tuple(p.strip("/") for p in fields[1:])
        where = f"{series}:{lineno}"
        match = _ENTRY_RE.match(name)
        if not match:
            raise LmsToolError(
                f"{where}: '{name}' is not an entry name; use NNNN-topic.patch (a file in "
                f"{series_dir}) or NNNN-topic.engine (a file in {integration_dir})"
            )
        stem = name.rsplit(".", 1)[0]
        if stem in seen:
            raise LmsToolError(f"{where}: '{stem}' is listed twice; list each entry once")
        seen.add(stem)
        number = len(entries) + 1
        if int(match.group(1)) != number:
            raise LmsToolError(
                f"{where}: entry {number} is named '{name}'; number it {number:04d} (`git am "
                f"patches/<tag>/*.patch` applies the series in file-name order)"
            )
        kind = match.group(2)
        path = (series_dir if kind == "patch" else integration_dir) / name
        if not path.is_file():
            raise LmsToolError(f"{where}: {path} does not exist; add it or remove the line")
        if kind == "engine" and not paths:
            raise LmsToolError(
                f"{where}: an .engine entry names the engine/ paths it carries, e.g. "
                f"'{name} c10/cuda'"
            )
        if kind == "patch" and paths:
            raise LmsToolError(
                f"{where}: only .engine entries take paths; remove {' '.join(paths)}"
            )
        entries.append(Entry(path, kind, lineno, paths))
    if not entries:
        raise LmsToolError(f"{series} lists no entries; list the series' patches in order")
    unlisted = sorted(
        p.name for p in integration_dir.iterdir() if p.suffix == ".engine" and p.stem not in seen
    )
    if unlisted:
        raise LmsToolError(
            f"{integration_dir} has entries not listed in {series}: {', '.join(unlisted)}; "
            f"add them to the series file or delete them"
        )
    strays = sorted(p.name for p in integration_dir.iterdir() if p.suffix == ".patch")
    if strays:
        raise LmsToolError(
            f"{integration_dir} holds {', '.join(strays)}: integration patches are kept once, "
            f"in {series_dir}; move them there"
        )
    return entries


def engine_files(engine_dir: Path) -> list[Path]:
    """The engine's files (relative to ``engine_dir``) that go into the tree (the manifest)."""
    try:
        return manifest.engine_files(engine_dir)
    except FileNotFoundError:
        raise LmsToolError(
            f"engine folder {engine_dir} does not exist; pass --engine DIR"
        ) from None


def _mailinfo(work: Path, entry: Entry) -> tuple[dict[str, str], str, bytes]:
    """Author fields, message and diff of an mbox file, parsed the way ``git am`` does."""
    msg_file = work / ".lms-msg"
    patch_file = work / ".lms-patch"
    try:
        proc = run_git(
            work,
            ["mailinfo", "-u", str(msg_file), str(patch_file)],
            input=entry.path.read_bytes(),
            env=pinned_env(),
        )
        body = msg_file.read_text(encoding="utf-8")
        diff = patch_file.read_bytes()
    finally:
        msg_file.unlink(missing_ok=True)
        patch_file.unlink(missing_ok=True)
    info: dict[str, str] = {}
    for line in proc.stdout.decode("utf-8").splitlines():
        key, _, value = line.partition(": ")
        info[key] = value
    for key in ("Author", "Email", "Subject", "Date"):
        if not info.get(key):
            raise LmsToolError(
                f"{entry.path}: no {key} in the mail header; start the file with From:, Date: "
                f"and Subject: lines (see CONTRIBUTING.md)"
            )
    message = info["Subject"] + ("\n\n" + body.strip("\n") if body.strip() else "") + "\n"
    return info, message, diff


def _carries(entry: Entry, rel: Path) -> bool:
    text = rel.as_posix()
    return any(text == p or text.startswith(p + "/") for p in entry.engine_paths)


def check_engine_coverage(entries: Sequence[Entry], engine_dir: Path) -> None:
    """Every engine file belongs to exactly one ``.engine`` entry."""
    engine_entries = [e for e in entries if e.kind == "engine"]
    if not engine_entries:
        return
    for rel in engine_files(engine_dir):
        owners = [e.path.name for e in engine_entries if _carries(e, rel)]
        if len(owners) != 1:
            where = "no .engine entry" if not owners else f"several entries ({', '.join(owners)})"
            raise LmsToolError(
                f"engine file {rel} is carried by {where} of the series; give each engine file "
                f"exactly one .engine entry (paths after the entry name in the series file)"
            )


def _commit_engine(repo: git.Repo, entry: Entry, engine_dir: Path) -> None:
    work = Path(repo.working_tree_dir or ".")
    info, message, diff = _mailinfo(work, entry)
    if diff.strip():
        raise LmsToolError(
            f"{entry.path}: an .engine entry is a header only, but it has a diff; move the diff "
            f"to a .patch entry"
        )
    files = [rel for rel in engine_files(engine_dir) if _carries(entry, rel)]
    if not files:
        raise LmsToolError(
            f"engine/{' engine/'.join(entry.engine_paths)} has no files; nothing to put in "
            f"{entry.path.name}"
        )
    for rel in files:
        target = work / rel
        if target.exists() or target.is_symlink():
            raise LmsToolError(
                f"engine file {rel} already exists in the {repo.head.commit.hexsha[:12]} tree; "
                f"engine files must be new files: rename it, or change the tree's file with a "
                f".patch entry instead"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(engine_dir / rel, target, follow_symlinks=False)
    repo.git.add("--", *[str(rel) for rel in files])
    env = pinned_env(
        {
            "GIT_AUTHOR_NAME": info["Author"],
            "GIT_AUTHOR_EMAIL": info["Email"],
            "GIT_AUTHOR_DATE": info["Date"],
            "GIT_COMMITTER_DATE": info["Date"],
        }
    )
    repo.git.commit("--quiet", "--no-verify", "--cleanup=verbatim", "-m", message, env=env)


def build_series(
    repo: git.Repo, tag: TagConfig, entries: Sequence[Entry], engine_dir: Path
) -> None:
    """Commit ``entries`` in order on top of the pristine tag checked out in ``repo``."""
    check_engine_coverage(entries, engine_dir)
    for i, entry in enumerate(entries):
        log.info("  %s", entry.path.name)
        if entry.kind == "engine":
            _commit_engine(repo, entry, engine_dir)
        else:
            git_am(
                repo,
                [entry.path],
                offset=i,
                total=len(entries),
                advice=(
                    f"{entry.path} does not apply after the entries before it in the series; "
                    f"rebase it onto {tag.name} (see CONTRIBUTING.md, 'Changing a patch')"
                ),
            )


@dataclass
class Sources:
    """How generation and verification get pristine trees (shared by all tags of one run)."""

    matrix: Matrix
    spec: SourceSpec
    repo_root: Path

    def clone(self, tag: TagConfig, dest: Path) -> git.Repo:
        pristine = pristine_repo(self.matrix, tag, self.spec, self.repo_root)
        return clone_tree(pristine, dest, shared=True)


def generate(
    sources: Sources,
    tag: TagConfig,
    out_dir: Path,
    *,
    integration_dir: Path | None = None,
    engine_dir: Path | None = None,
    tree: Path | None = None,
) -> ExportResult:
    """Generate ``tag``'s series into ``out_dir`` (only files whose bytes change are written).

    ``tree``, when given, is a scratch clone of the tag to reuse (it is reset to the tag);
    otherwise a fresh clone is made and removed afterwards.
    """
    repo_root = sources.repo_root
    integration_dir = integration_dir or tag.integration_dir(repo_root)
    engine_dir = engine_dir or repo_root / "engine"
    if not (integration_dir / SERIES_FILE).is_file():
        raise LmsToolError(
            f"{tag.name} is source only: {integration_dir / SERIES_FILE} does not exist, so "
            f"there is no series to generate"
        )
    entries = read_series(integration_dir, tag.series_dir(repo_root))
    log.info("generating %s series (%d entries)", tag.name, len(entries))
    with tempfile.TemporaryDirectory(prefix=f"lms-gen-{tag.name}-") as tmp:
        if tree is None:
            repo = sources.clone(tag, Path(tmp) / "tree")
        else:
            # a scratch clone of the tag: back to the pristine tag, untracked files removed
            repo = git.Repo(tree)
            repo.git.switch("--quiet", "--force", "-C", branch_name(tag.name), tag.name)
            repo.git.clean("-q", "-f", "-d", "-x")
        with repo:
            build_series(repo, tag, entries, engine_dir)
            out = Path(tmp) / "out"
            out.mkdir()
            generated = name_patches(format_patches(repo, tag.name, out), entries)
            return sync_series(generated, out_dir)


def name_patches(generated: Sequence[Path], entries: Sequence[Entry]) -> list[Path]:
    """Rename format-patch's files (named after the subjects) to their entries' names."""
    if len(generated) != len(entries):
        raise LmsToolError(
            f"format-patch wrote {len(generated)} patches for {len(entries)} entries; an entry "
            f"made no commit (an empty .patch?)"
        )
    named: list[Path] = []
    for path, entry in zip(generated, entries):
        target = path.with_name(entry.patch_name)
        os.replace(path, target)
        named.append(target)
    return named


@dataclass
class VerifyReport:
    tag: str
    problems: list[str]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def compare_series(committed: Path, fresh: Path) -> list[str]:
    """Differences between two series folders, one line each."""
    a = {p.name: p for p in series_files(committed)}
    b = {p.name: p for p in series_files(fresh)}
    out: list[str] = []
    for name in sorted(a.keys() | b.keys()):
        if name not in a:
            out.append(f"missing: {committed / name} (the generated series has it)")
        elif name not in b:
            out.append(f"extra: {committed / name} (not in the generated series)")
        elif not filecmp.cmp(a[name], b[name], shallow=False):
            out.append(f"stale: {committed / name} differs from the generated patch")
    return out


def regenerate_fix(tag: TagConfig) -> str:
    """What brings a committed series up to date with engine/ and integration/<tag>/."""
    return f"run `{make_command(f'make patches TAG={tag.name}')}` and commit {tag.series}"


def quick_staleness(
    repo_root: Path, tag: TagConfig, *, engine_dir: Path | None = None
) -> list[str]:
    """How ``tag``'s committed series differs from what engine/ and integration/<tag>/ give
    now, one line each (:func:`compare_series`'s), found without the pristine tree.

    An engine patch only adds new files, so its bytes do not depend on the tree it is made
    on: the ``.engine`` entries are committed (by the code that generates the series) onto an
    empty commit and formatted with the series' options, then compared with the committed
    ones; the integration patches, kept only in the committed series, are compared as they
    are. That covers an edited engine file or ``.engine`` header and a series file that lists
    other entries, in well under a second. Whether the integration patches still apply is
    :func:`verify_tag`'s to check (``make verify``).
    """
    engine_dir = engine_dir or repo_root / "engine"
    committed = tag.series_dir(repo_root)
    entries = read_series(tag.integration_dir(repo_root), committed)
    check_engine_coverage(entries, engine_dir)
    engine_entries = [e for e in entries if e.kind == "engine"]
    with tempfile.TemporaryDirectory(prefix=f"lms-check-{tag.name}-") as tmp:
        fresh = Path(tmp) / "fresh"
        fresh.mkdir()
        if engine_entries:
            with git.Repo.init(Path(tmp) / "tree") as repo:
                empty = pinned_env({"GIT_AUTHOR_NAME": "-", "GIT_AUTHOR_EMAIL": "-"})
                repo.git.commit("--quiet", "--allow-empty", "-m", "empty", env=empty)
                base = repo.head.commit.hexsha
                for entry in engine_entries:
                    _commit_engine(repo, entry, engine_dir)
                out = Path(tmp) / "out"
                out.mkdir()
                for path in name_patches(format_patches(repo, base, out), engine_entries):
                    os.replace(path, fresh / path.name)
        for entry in entries:
            if entry.kind == "patch":
                shutil.copyfile(entry.path, fresh / entry.patch_name)
        return compare_series(committed, fresh)


def verify_tag(sources: Sources, tag: TagConfig, *, engine_dir: Path | None = None) -> VerifyReport:
    """Check that ``tag``'s committed series applies and equals a fresh generation."""
    repo_root = sources.repo_root
    committed_dir = tag.series_dir(repo_root)
    committed = series_files(committed_dir)
    report = VerifyReport(tag.name, [], [])
    if not tag.has_series(repo_root):
        if committed:
            report.problems.append(
                f"{committed_dir} has {len(committed)} patches but "
                f"{tag.series_file(repo_root)} does not exist, so they cannot be regenerated; "
                f"add the integration series or remove the patches"
            )
        else:
            report.notes.append("source only, no series")
        return report
    fix = regenerate_fix(tag)
    with tempfile.TemporaryDirectory(prefix=f"lms-verify-{tag.name}-") as tmp:
        tree = Path(tmp) / "tree"
        sources.clone(tag, tree).close()
        if committed:
            try:
                result = apply_series(tree, tag.name, committed_dir)
                report.notes.append(f"committed series applies to pristine {tag.name}")
                log.debug(result.message)
            except LmsToolError as exc:
                report.problems.append(f"committed series does not apply: {exc}")
        else:
            report.problems.append(f"{committed_dir} has no patches; {fix}")
        fresh = Path(tmp) / "fresh"
        try:
            generate(sources, tag, fresh, engine_dir=engine_dir, tree=tree)
        except SourceUnavailable:
            raise
        except LmsToolError as exc:
            report.problems.append(f"cannot regenerate the series: {exc}")
            return report
        diffs = compare_series(committed_dir, fresh)
        if diffs:
            report.problems += diffs
            report.problems.append(f"the committed series is out of date: {fix}")
        else:
            report.notes.append(f"committed series matches engine/ + {tag.integration}")
    return report
