"""Getting a tag's pristine PyTorch source as a git repository.

Three ways, picked by :class:`SourceSpec`:

* a git remote (GitHub by default): a shallow clone of the tag, submodules included;
* a local mirror (any clone holding the tag);
* a release or distribution tarball found in a local folder. The tarball's sha256 is checked
  against ``config/tags.yaml`` before anything is read from it; then it is streamed into
  ``git fast-import`` as one commit with a fixed identity and date (the newest member's
  mtime), tagged with the upstream tag name, so the import is reproducible: the same
  tarball always gives the same commit id. Imports are kept in a cache of bare repositories
  (``$LMS_CACHE``, default ``work/cache`` of the project), so later checkouts are a local
  clone.

Nothing is built in place: every repository is assembled in a temporary directory next to
its destination and renamed into place at the end, so a failure leaves nothing half-made.
"""

from __future__ import annotations

import hashlib
import logging
import lzma
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import git

from lmstool.errors import LmsToolError
from lmstool.gitutil import (
    applied_by_lmstool,
    operation_in_progress,
    pinned_env,
    resolve_commit,
    tracked_changes,
)
from lmstool.hints import option
from lmstool.matrix import Matrix, TagConfig, Tarball

log = logging.getLogger(__name__)

PRISTINE_BRANCH = "refs/heads/pristine"


@dataclass(frozen=True)
class SourceSpec:
    """Where a tag's source comes from: a tarball folder, a mirror, or a git remote.

    With none of ``sources``/``mirror``/``remote`` set, the matrix's GitHub remote is used.
    """

    sources: Path | None = None
    remote: str | None = None
    mirror: Path | None = None
    cache: Path | None = None

    def describe(self, matrix: Matrix) -> str:
        if self.mirror is not None:
            return f"mirror {self.mirror}"
        if self.sources is not None and self.remote is None:
            return f"tarballs in {self.sources}"
        return f"git remote {self.remote or matrix.github_remote}"


@dataclass(frozen=True)
class Pristine:
    """A git repository (often a bare cache) holding the tag, to clone working trees from."""

    path: Path
    tag: str  # the local tag name (the matrix key)
    ref: str  # what to clone: the tag in ``path``
    origin: str  # human-readable description recorded as lms.source
    submodules: bool
    # The files are a tarball's bytes, committed as they are. A tarball made by `git archive`
    # holds the working-tree form of files that .gitattributes converts (v1.13.1: `*.bat text
    # eol=crlf`), so checkouts must not convert them again: with the conversion, git sees such
    # files as modified whenever it re-reads them, and `git am` refuses the tree.
    verbatim: bool = False


class SourceUnavailable(LmsToolError):
    """The tag's source cannot be found with the given options (no tarball, no network)."""


def default_cache_dir(repo: Path) -> Path:
    env = os.environ.get("LMS_CACHE")
    return Path(env) if env else repo / "work" / "cache"


def branch_name(tag: str) -> str:
    """The local branch a checkout creates at the tag (the series is applied on it)."""
    return f"lms-{tag}"


# --------------------------------------------------------------------------------------------
# tarballs


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_tarball(tag: TagConfig, sources: Path) -> tuple[Path, Tarball]:
    if not sources.is_dir():
        raise SourceUnavailable(
            f"sources folder {sources} does not exist; pass {option('sources', 'DIR')} with the "
            f"folder holding the release tarballs, or run without "
            f"{option('sources', str(sources))} to clone from GitHub"
        )
    for tb in tag.source.tarballs:
        candidate = sources / tb.name
        if candidate.is_file():
            return candidate, tb
    wanted = ", ".join(tb.name for tb in tag.source.tarballs) or "(none listed in the matrix)"
    raise SourceUnavailable(
        f"no source tarball for {tag.name} in {sources}: expected {wanted}; put the tarball "
        f"there, or run without {option('sources', str(sources))} to clone "
        f"{tag.source.git_ref} from GitHub"
    )


def verify_tarball(path: Path, tb: Tarball) -> None:
    actual = sha256_file(path)
    if actual != tb.sha256:
        raise LmsToolError(
            f"sha256 mismatch for {path}: expected {tb.sha256} (config/tags.yaml), got "
            f"{actual}; the file is damaged or not the release tarball: download it again "
            f"(nothing was extracted)"
        )


def fetch_tarballs(tag: TagConfig, dest: Path) -> list[Path]:
    """Download the tag's tarballs that have a ``url`` into ``dest`` (sha256 checked).

    A file already there with the right checksum is kept; a download is written next to its
    destination and renamed into place only once its checksum matches, so ``dest`` never
    holds a partial or wrong tarball.
    """
    wanted = [tb for tb in tag.source.tarballs if tb.url]
    if not wanted:
        raise LmsToolError(
            f"{tag.name} lists no tarball with a url in config/tags.yaml; add one (name, url, "
            f"sha256, top, submodules) or use a git checkout"
        )
    dest.mkdir(parents=True, exist_ok=True)
    fetched: list[Path] = []
    for tb in wanted:
        assert tb.url is not None
        target = dest / tb.name
        if target.is_file() and sha256_file(target) == tb.sha256:
            log.info("%s: already there, sha256 ok", target)
            fetched.append(target)
            continue
        tmp = dest / f".{tb.name}.part"
        log.info("downloading %s ...", tb.url)
        start = time.monotonic()
        try:
            with urllib.request.urlopen(tb.url, timeout=60) as response, tmp.open("wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
        except (OSError, urllib.error.URLError) as exc:
            tmp.unlink(missing_ok=True)
            raise SourceUnavailable(
                f"cannot download {tb.url} ({exc}); check the network, or put {tb.name} in "
                f"{dest} yourself"
            ) from None
        actual = sha256_file(tmp)
        if actual != tb.sha256:
            tmp.unlink()
            raise LmsToolError(
                f"sha256 mismatch for {tb.url}: expected {tb.sha256} (config/tags.yaml), got "
                f"{actual}; nothing was kept in {dest}. The file on the server changed or the "
                f"download was damaged: try again, or fix the checksum in config/tags.yaml if "
                f"the upstream file really changed"
            )
        os.replace(tmp, target)
        log.info("%s: %.1f MB in %.1f s, sha256 ok", target, target.stat().st_size / 1e6,
                 time.monotonic() - start)  # fmt: skip
        fetched.append(target)
    return fetched


def _fi_path(path: str) -> bytes:
    """A path as ``git fast-import`` reads it (C-style quoted where that is required)."""
    if path.startswith('"') or "\n" in path:
        quoted = path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{quoted}"'.encode()
    return path.encode()


def _member_path(name: str, top: str, tarball: Path) -> str | None:
    """The member's path below the top folder; None for the top folder itself."""
    name = name[2:] if name.startswith("./") else name
    name = name.rstrip("/")
    if name == top:
        return None
    if not name.startswith(top + "/"):
        raise LmsToolError(
            f"{tarball}: member '{name}' is outside the top folder '{top}' named in "
            f"config/tags.yaml; fix `top:` for this tarball"
        )
    rel = name[len(top) + 1 :]
    if rel.startswith("/") or ".." in rel.split("/") or not rel:
        raise LmsToolError(f"{tarball}: unsafe member path '{name}'; the tarball is not usable")
    return rel


def _stream_import(tarball: Path, tb: Tarball, tag: TagConfig, stdin: IO[bytes]) -> int:
    """Write the fast-import stream for ``tarball`` to ``stdin``; returns the member count."""
    files: dict[str, tuple[str, int]] = {}  # path -> (mode, blob mark)
    mark = 0
    newest = 0
    last_report = time.monotonic()
    stdin.write(b"feature done\n")
    with tarfile.open(tarball, mode="r|*") as tar:
        for member in tar:
            rel = _member_path(member.name, tb.top, tarball)
            newest = max(newest, int(member.mtime))
            if rel is None or member.isdir():
                continue
            if member.islnk():
                target = _member_path(member.linkname, tb.top, tarball)
                if target is None or target not in files:
                    raise LmsToolError(
                        f"{tarball}: hard link '{member.name}' points to '{member.linkname}', "
                        f"which comes later or is missing; the tarball is not usable"
                    )
                files[rel] = files[target]
                continue
            if member.issym():
                data = member.linkname.encode()
                mode = "120000"
            elif member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                data = f.read()
                mode = "100755" if member.mode & 0o111 else "100644"
            else:
                log.warning("skipping %s: not a file, link or folder", member.name)
                continue
            mark += 1
            stdin.write(b"blob\nmark :%d\ndata %d\n" % (mark, len(data)))
            stdin.write(data)
            stdin.write(b"\n")
            files[rel] = (mode, mark)
            if time.monotonic() - last_report > 5:
                log.info("  ... %d files read", len(files))
                last_report = time.monotonic()
    if not files:
        raise LmsToolError(f"{tarball}: no files below '{tb.top}/'; check `top:` in the matrix")
    ident = f"PyTorch {tag.name} release source <noreply> {newest} +0000".encode()
    message = (
        f"PyTorch {tag.name} release source\n\n"
        f"Imported from {tb.name}\n(sha256 {tb.sha256}).\n"
        + ("" if tb.submodules else "The tarball has no git submodules (third_party/).\n")
    ).encode()
    commit_mark = mark + 1
    stdin.write(b"commit %s\nmark :%d\n" % (PRISTINE_BRANCH.encode(), commit_mark))
    stdin.write(b"author %s\ncommitter %s\n" % (ident, ident))
    stdin.write(b"data %d\n%s\n" % (len(message), message))
    for path in sorted(files):
        mode, m = files[path]
        stdin.write(b"M %s :%d %s\n" % (mode.encode(), m, _fi_path(path)))
    stdin.write(b"\n")
    tag_msg = f"PyTorch {tag.name} (from {tb.name})\n".encode()
    stdin.write(b"tag %s\nfrom :%d\n" % (tag.name.encode(), commit_mark))
    stdin.write(b"tagger %s\ndata %d\n%s\n" % (ident, len(tag_msg), tag_msg))
    stdin.write(b"done\n")
    return len(files)


def import_tarball(tarball: Path, tb: Tarball, tag: TagConfig, dest: Path) -> Path:
    """Import ``tarball`` (already verified) into a new bare repository at ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.import-", dir=dest.parent))
    start = time.monotonic()
    log.info("importing %s into %s (one-time, cached) ...", tarball.name, dest)
    try:
        git.Repo.init(tmp, bare=True)
        env = {**os.environ, **pinned_env()}
        proc = subprocess.Popen(
            ["git", "fast-import", "--quiet", "--done"],
            cwd=tmp,
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert proc.stdin is not None
        try:
            count = _stream_import(tarball, tb, tag, proc.stdin)
            proc.stdin.close()
        except (tarfile.TarError, lzma.LZMAError, EOFError, zlib.error, OSError) as exc:
            proc.kill()
            proc.wait()
            raise LmsToolError(
                f"{tarball} is corrupt or truncated ({type(exc).__name__}: {exc}); download "
                f"it again (nothing was imported)"
            ) from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.wait() != 0:
            raise LmsToolError(f"git fast-import failed on {tarball}: {err.strip()}")
        repo = git.Repo(tmp)
        repo.git.symbolic_ref("HEAD", PRISTINE_BRANCH)
        with repo.config_writer() as cw:
            cw.set_value("lms", "tag", tag.name)
            cw.set_value("lms", "source", f"tarball {tb.name} sha256 {tb.sha256}")
            cw.set_value("lms", "submodules", str(tb.submodules).lower())
        repo.close()
        if dest.exists():  # imported meanwhile by another run: keep that one
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("imported %d files in %.1f s", count, time.monotonic() - start)
    return dest


def _cache_matches(path: Path, tag: str, source: str) -> bool:
    try:
        repo = git.Repo(path)
    except (git.NoSuchPathError, git.InvalidGitRepositoryError):
        return False
    with repo:
        reader = repo.config_reader("repository")
        ok = (
            reader.get_value("lms", "tag", "") == tag
            and reader.get_value("lms", "source", "") == source
            and resolve_commit(repo, tag) is not None
        )
    return ok


# --------------------------------------------------------------------------------------------
# pristine repositories


def pristine_repo(matrix: Matrix, tag: TagConfig, spec: SourceSpec, repo_root: Path) -> Pristine:
    """A repository holding ``tag``'s pristine source (cached), to clone working trees from."""
    cache = spec.cache or default_cache_dir(repo_root)
    if spec.mirror is not None:
        mirror = spec.mirror.resolve()
        try:
            mrepo = git.Repo(mirror)
        except (git.NoSuchPathError, git.InvalidGitRepositoryError):
            raise SourceUnavailable(
                f"mirror {mirror} is not a git repository; pass a clone of pytorch/pytorch"
            ) from None
        with mrepo:
            if resolve_commit(mrepo, tag.source.git_ref) is None:
                raise SourceUnavailable(
                    f"mirror {mirror} has no {tag.source.git_ref}; run `git fetch --tags` in "
                    f"it, or pass {option('sources', 'DIR')} or {option('remote', 'URL')}"
                )
        return Pristine(mirror, tag.name, tag.source.git_ref, f"mirror {mirror}", submodules=False)
    if spec.sources is not None and spec.remote is None:
        path, tb = find_tarball(tag, spec.sources)
        log.info("checking sha256 of %s", path)
        verify_tarball(path, tb)
        source = f"tarball {tb.name} sha256 {tb.sha256}"
        dest = cache / f"{tag.name}-{tb.sha256[:12]}.git"
        if not _cache_matches(dest, tag.name, source):
            if dest.exists():
                raise LmsToolError(
                    f"cache {dest} is not an import of {tb.name}; delete it and run again"
                )
            import_tarball(path, tb, tag, dest)
        else:
            log.info("using cached import %s", dest)
        return Pristine(
            dest,
            tag.name,
            tag.name,
            f"{source} ({path})",
            submodules=tb.submodules,
            verbatim=True,
        )
    url = spec.remote or matrix.github_remote
    source = f"git {url} {tag.source.git_ref}"
    dest = cache / f"{tag.name}-git.git"
    if not _cache_matches(dest, tag.name, source):
        if dest.exists():
            raise LmsToolError(f"cache {dest} is not a clone of {url}; delete it and run again")
        _clone_remote_bare(url, tag, dest, source)
    return Pristine(dest, tag.name, tag.name, source, submodules=False)


def _clone_remote_bare(url: str, tag: TagConfig, dest: Path, source: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.clone-", dir=dest.parent))
    log.info("cloning %s %s (shallow) into %s ...", url, tag.source.git_ref, dest)
    try:
        try:
            repo = git.Repo.clone_from(
                url, tmp, bare=True, depth=1, branch=tag.source.git_ref, env=pinned_env()
            )
        except git.GitCommandError as exc:
            raise SourceUnavailable(
                f"cannot clone {tag.source.git_ref} from {url}: {exc.stderr.strip()}; check the "
                f"network, or pass {option('sources', 'DIR')} (a folder with the release "
                f"tarball) or {option('mirror', 'PATH')} (a local clone)"
            ) from None
        with repo:
            _ensure_tag(repo, tag)
            with repo.config_writer() as cw:
                cw.set_value("lms", "tag", tag.name)
                cw.set_value("lms", "source", source)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _ensure_tag(repo: git.Repo, tag: TagConfig) -> None:
    if resolve_commit(repo, tag.name) is None:
        target = resolve_commit(repo, tag.source.git_ref) or repo.head.commit
        repo.create_tag(tag.name, ref=target)


@contextmanager
def building(dest: Path) -> Iterator[Path]:
    """A temporary directory next to ``dest``, renamed to ``dest`` when the block succeeds."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():  # only an empty directory gets here (checked by the caller)
            dest.rmdir()
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def clone_tree(pristine: Pristine, dest: Path, *, shared: bool = False) -> git.Repo:
    """Clone ``pristine`` into the new directory ``dest``, on branch lms-<tag> at the tag."""
    args = ["--quiet", "--branch", pristine.ref]
    if shared:
        args.append("--shared")
    if pristine.verbatim:
        # No end-of-line conversion at all (the highest-precedence attributes file), set
        # before the files are checked out.
        args += ["--no-checkout"]
    repo = git.Repo.clone_from(str(pristine.path), dest, multi_options=args)
    if pristine.verbatim:
        info = Path(repo.git_dir) / "info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "attributes").write_text("* -text\n", encoding="utf-8")
        repo.git.reset("--quiet", "--hard")  # fills the index and the working tree
    if resolve_commit(repo, pristine.tag) is None:
        repo.create_tag(pristine.tag, ref=repo.head.commit)
    repo.git.switch("--quiet", "-c", branch_name(pristine.tag))
    _record(repo, pristine.tag, pristine.origin, pristine.submodules)
    return repo


def _record(repo: git.Repo, tag: str, origin: str, submodules: bool) -> None:
    with repo.config_writer() as cw:
        cw.set_value("lms", "tag", tag)
        cw.set_value("lms", "source", origin)
        cw.set_value("lms", "submodules", str(submodules).lower())


# --------------------------------------------------------------------------------------------
# checkout


def _operation_in(dest: Path) -> str | None:
    """The git operation ``dest`` is in the middle of (a ``git am``, a rebase, ...), if any."""
    try:
        repo = git.Repo(dest)
    except (git.NoSuchPathError, git.InvalidGitRepositoryError):
        return None
    with repo:
        return operation_in_progress(repo)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _what_is_there(dest: Path, tag: TagConfig) -> tuple[bool, str]:
    """Whether the existing ``dest`` can serve as the checkout of ``tag`` (the tag in HEAD's
    history, no uncommitted changes to tracked files), and what it is, for the message: a
    pristine checkout, one with an applied series, one with commits of the user's own."""
    try:
        repo = git.Repo(dest)
    except (git.NoSuchPathError, git.InvalidGitRepositoryError):
        return False, "not a git checkout"
    with repo:
        top = Path(repo.working_tree_dir or "").resolve()
        if top != dest.resolve():
            return False, f"a folder inside the git checkout {top}, not a checkout itself"
        tag_commit = resolve_commit(repo, tag.name)
        if tag_commit is None or not repo.head.is_valid():
            return False, f"a git checkout without {tag.name}"
        if not repo.is_ancestor(tag_commit, repo.head.commit):
            return False, f"a git checkout whose HEAD does not contain {tag.name}"
        dirty = tracked_changes(repo)
        if dirty:
            return False, (
                f"a checkout of {tag.name} with uncommitted changes to "
                f"{_plural(len(dirty), 'file')} (e.g. {dirty[0].strip()})"
            )
        above = list(repo.iter_commits(f"{tag_commit.hexsha}..HEAD"))
        if not above:
            return True, f"a pristine checkout of {tag.name}"
        own = [c for c in above if not applied_by_lmstool(c)]  # newest first
        series = len(above) - len(own)
        parts = [_plural(series, "commit") + " of an applied series"] if series else []
        if own:
            newest = own[0].summary
            parts.append(f"{_plural(len(own), 'commit')} of your own (newest: {newest!r})")
        return True, f"a checkout of {tag.name} with {' and '.join(parts)} above the tag"


def checkout(matrix: Matrix, tag: TagConfig, dest: Path, spec: SourceSpec, repo_root: Path) -> Path:
    """Make ``dest`` a git checkout of ``tag`` (tag at HEAD, on branch lms-<tag>)."""
    dest = dest.absolute()
    if dest.exists():
        if not dest.is_dir():
            raise LmsToolError(
                f"{dest} exists and is not a directory; pass another {option('dest', 'DIR')}"
            )
        if any(dest.iterdir()):
            busy = _operation_in(dest)
            if busy:
                raise LmsToolError(
                    f"{dest} is in the middle of {busy} (an earlier apply stopped there?); it "
                    f"was left untouched: finish or abort it there (git -C {dest} am --abort), "
                    f"or move it away or pass another {option('dest', 'DIR')}"
                )
            reusable, what = _what_is_there(dest, tag)
            if reusable:
                log.info("%s is %s; reusing it as it is", dest, what)
                return dest
            raise LmsToolError(
                f"{dest} exists and is {what}; it was left untouched (a checkout is reused when "
                f"{tag.name} is in its history and it has no uncommitted changes): move it away "
                f"or pass another {option('dest', 'DIR')}"
            )
    start = time.monotonic()
    if spec.remote is not None or (spec.sources is None and spec.mirror is None):
        _checkout_remote(matrix, tag, dest, spec.remote or matrix.github_remote)
    else:
        pristine = pristine_repo(matrix, tag, spec, repo_root)
        log.info("checking out %s into %s ...", tag.name, dest)
        with building(dest) as tmp:
            clone_tree(pristine, tmp).close()
        if not pristine.submodules:
            log.info(
                "note: this source has no git submodules (third_party/); a full PyTorch build "
                "needs them (clone from GitHub for that: leave out %s)",
                option("sources", "DIR"),
            )
    log.info("%s ready at %s (%.1f s)", tag.name, dest, time.monotonic() - start)
    return dest


def _checkout_remote(matrix: Matrix, tag: TagConfig, dest: Path, url: str) -> None:
    log.info("cloning %s %s with submodules into %s ...", url, tag.source.git_ref, dest)
    with building(dest) as tmp:
        try:
            repo = git.Repo.clone_from(
                url,
                tmp,
                depth=1,
                branch=tag.source.git_ref,
                multi_options=["--recurse-submodules", "--shallow-submodules"],
            )
        except git.GitCommandError as exc:
            raise SourceUnavailable(
                f"cannot clone {tag.source.git_ref} from {url}: {str(exc.stderr).strip()}; check "
                f"the network, or pass {option('sources', 'DIR')} (a folder with the release "
                f"tarball) or {option('mirror', 'PATH')} (a local clone)"
            ) from None
        with repo:
            _ensure_tag(repo, tag)
            repo.git.switch("--quiet", "-c", branch_name(tag.name))
            _record(repo, tag.name, f"git {url} {tag.source.git_ref}", submodules=True)
