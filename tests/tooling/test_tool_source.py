"""Getting a tag's source: tarball import (checksum first, atomic), reuse, mirrors."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
import tarfile
import time
from pathlib import Path

import git
import pytest
from toolfakes import (
    FAKE_TAG,
    FAKE_TARBALL,
    FAKE_TOP,
    MTIME,
    Fake,
    commit_edit,
    make_tarball,
    run_cli,
    write_matrix,
)

from lmstool.errors import LmsToolError
from lmstool.gitutil import pinned_env
from lmstool.matrix import load_matrix
from lmstool.source import SourceSpec, SourceUnavailable, checkout, pristine_repo


def test_checkout_from_tarball(fake: Fake, tmp_path: Path) -> None:
    tree = fake.checkout(tmp_path / "work" / "tree")
    repo = git.Repo(tree)
    assert repo.active_branch.name == f"lms-{FAKE_TAG}"
    assert repo.head.commit == repo.commit(FAKE_TAG)
    assert repo.tags[FAKE_TAG].tag is not None  # annotated, like upstream tags
    assert not repo.is_dirty(untracked_files=True)
    # top folder stripped, exec bit, symlink, hard link, ignored-but-shipped file all kept
    assert (tree / "README.md").read_text() == "fake upstream\n"
    assert os.access(tree / "tools" / "run.sh", os.X_OK)
    assert not os.access(tree / "README.md", os.X_OK)
    assert (tree / "link").is_symlink() and os.readlink(tree / "link") == "README.md"
    assert (tree / "hard.md").read_text() == "fake upstream\n"
    assert (tree / "docs" / "with space.txt").is_file()
    assert (tree / "kept.log").is_file()
    commit = repo.head.commit
    assert commit.author.name == f"PyTorch {FAKE_TAG} release source"
    assert commit.committed_date == commit.authored_date == MTIME
    reader = repo.config_reader("repository")
    assert reader.get_value("lms", "tag") == FAKE_TAG
    assert FAKE_TARBALL in reader.get_value("lms", "source")
    assert reader.get_value("lms", "submodules") is False
    # nothing but the tree (and the cache) was left next to it
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["tree"]


def test_import_is_reproducible(fake: Fake, tmp_path: Path) -> None:
    a = pristine_repo(fake.matrix, fake.tag, fake.spec, fake.project)
    other = SourceSpec(sources=fake.sources, cache=tmp_path / "cache2")
    b = pristine_repo(fake.matrix, fake.tag, other, fake.project)
    assert a.path != b.path
    assert git.Repo(a.path).commit(FAKE_TAG).hexsha == git.Repo(b.path).commit(FAKE_TAG).hexsha


def test_second_checkout_uses_cache(fake: Fake, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    fake.checkout(tmp_path / "one")
    caplog.set_level("INFO")
    fake.checkout(tmp_path / "two")
    assert "using cached import" in caplog.text
    assert "importing" not in caplog.text


def test_wrong_sha256_extracts_nothing(fake: Fake, tmp_path: Path) -> None:
    write_matrix(fake.project, "0" * 64)
    matrix = load_matrix(fake.project)
    dest = tmp_path / "work" / "tree"
    with pytest.raises(LmsToolError) as exc:
        checkout(matrix, matrix.get_tag(FAKE_TAG), dest, fake.spec, fake.project)
    msg = str(exc.value)
    actual = make_tarball(tmp_path / "again.tar.xz")  # same content, same bytes
    assert "sha256 mismatch" in msg and str(fake.sources / FAKE_TARBALL) in msg
    assert f"expected {'0' * 64}" in msg and f"got {actual}" in msg
    assert not dest.exists() and not dest.parent.exists()
    assert not fake.cache.exists()


def test_wrong_sha256_via_cli(fake: Fake, tmp_path: Path) -> None:
    write_matrix(fake.project, "1" * 64)
    dest = tmp_path / "tree"
    proc = run_cli(
        "--repo", str(fake.project), "checkout", FAKE_TAG, "--dest", str(dest),
        "--sources", str(fake.sources), cache=fake.cache,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "lmstool checkout: error: sha256 mismatch" in proc.stderr
    assert not dest.exists() and not fake.cache.exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_tarball_leaves_nothing(fake: Fake, tmp_path: Path, damage: str) -> None:
    tarball = fake.sources / FAKE_TARBALL
    data = tarball.read_bytes()
    if damage == "truncate":
        tarball.write_bytes(data[: len(data) // 2])
    else:
        tarball.write_bytes(data[:200] + b"\0garbage" * 50 + data[600:])
    import hashlib

    write_matrix(fake.project, hashlib.sha256(tarball.read_bytes()).hexdigest())
    matrix = load_matrix(fake.project)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(LmsToolError, match="is corrupt or truncated") as exc:
        checkout(matrix, matrix.get_tag(FAKE_TAG), work / "tree", fake.spec, fake.project)
    assert str(tarball) in str(exc.value)
    assert list(work.iterdir()) == []
    assert not fake.cache.exists() or list(fake.cache.iterdir()) == []


def test_missing_tarball_is_unavailable(fake: Fake, tmp_path: Path) -> None:
    (fake.sources / FAKE_TARBALL).unlink()
    with pytest.raises(SourceUnavailable, match=f"expected {FAKE_TARBALL}"):
        fake.checkout(tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def test_wrong_top_folder(fake: Fake, tmp_path: Path) -> None:
    sha = make_tarball(fake.sources / FAKE_TARBALL, top="other-top")
    write_matrix(fake.project, sha)
    matrix = load_matrix(fake.project)
    with pytest.raises(LmsToolError, match=re.escape("outside the top folder 'fake-0.1.0'")):
        checkout(matrix, matrix.get_tag(FAKE_TAG), tmp_path / "tree", fake.spec, fake.project)
    assert not (tmp_path / "tree").exists()


def test_existing_checkout_reused(fake: Fake, fake_tree: Path) -> None:
    marker = fake_tree / "untracked-build-output.o"
    marker.write_text("kept")
    head = git.Repo(fake_tree).head.commit.hexsha
    assert fake.checkout(fake_tree) == fake_tree
    assert marker.read_text() == "kept"
    assert git.Repo(fake_tree).head.commit.hexsha == head


def test_reused_checkout_is_called_what_it_is(
    fake: Fake, fake_tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reused checkout is named for what it holds: the tag alone, an applied series, or
    commits of the user's own (not "a clean checkout" for all three)."""
    caplog.set_level(logging.INFO, logger="lmstool.source")
    fake.checkout(fake_tree)
    assert f"{fake_tree} is a pristine checkout of v0.1.0; reusing it as it is" in caplog.text
    repo = git.Repo(fake_tree)
    commit_edit(
        repo, "README.md", "fake upstream\n", "mine\n", "my own change",
        "2025-02-05T00:00:00+00:00",
    )  # fmt: skip
    caplog.clear()
    fake.checkout(fake_tree)
    assert (
        "is a checkout of v0.1.0 with 1 commit of your own (newest: 'my own change') above the "
        "tag; reusing it as it is"
    ) in caplog.text
    assert "pristine" not in caplog.text and "clean" not in caplog.text
    env = pinned_env({"GIT_AUTHOR_NAME": "x", "GIT_AUTHOR_EMAIL": "x@x"})
    repo.git.commit("-q", "--allow-empty", "-m", "as git am of a series makes it", env=env)
    caplog.clear()
    fake.checkout(fake_tree)
    assert (
        "with 1 commit of an applied series and 1 commit of your own (newest: 'my own change') "
        "above the tag"
    ) in caplog.text


def test_existing_dirty_checkout_left_alone(fake: Fake, fake_tree: Path) -> None:
    (fake_tree / "README.md").write_text("local edit\n")
    with pytest.raises(
        LmsToolError,
        match=r"is a checkout of v0\.1\.0 with uncommitted changes to 1 file \(e\.g\. M "
        r"README\.md\); it was left untouched",
    ):
        fake.checkout(fake_tree)
    assert (fake_tree / "README.md").read_text() == "local edit\n"


def test_checkout_in_the_middle_of_git_am_is_not_reused(fake: Fake, fake_tree: Path) -> None:
    """After an interrupted `git am`, the checkout is not called clean and reused: it says
    what it is in the middle of and how to get out of it."""
    (Path(git.Repo(fake_tree).git_dir) / "rebase-apply").mkdir()
    with pytest.raises(LmsToolError, match=r"in the middle of a `git am` or rebase .*am --abort"):
        fake.checkout(fake_tree)


def test_existing_other_directory_left_alone(fake: Fake, tmp_path: Path) -> None:
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("precious")
    with pytest.raises(LmsToolError, match="move it away or pass another --dest"):
        fake.checkout(dest)
    assert [p.name for p in dest.iterdir()] == ["notes.txt"]


def test_empty_directory_is_used(fake: Fake, tmp_path: Path) -> None:
    dest = tmp_path / "empty"
    dest.mkdir()
    fake.checkout(dest)
    assert (dest / "README.md").is_file()


def test_checkout_from_mirror(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror.git"
    git.Repo.clone_from(str(fake_tree), mirror, bare=True)
    dest = tmp_path / "from-mirror"
    spec = SourceSpec(mirror=mirror, cache=fake.cache)
    checkout(fake.matrix, fake.tag, dest, spec, fake.project)
    repo = git.Repo(dest)
    assert repo.head.commit.hexsha == git.Repo(fake_tree).commit(FAKE_TAG).hexsha
    assert repo.config_reader("repository").get_value("lms", "source") == f"mirror {mirror}"
    missing = SourceSpec(mirror=tmp_path / "nope", cache=fake.cache)
    with pytest.raises(SourceUnavailable, match="is not a git repository"):
        checkout(fake.matrix, fake.tag, tmp_path / "x", missing, fake.project)


def test_checkout_from_remote_url(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    remote = tmp_path / "remote.git"
    git.Repo.clone_from(str(fake_tree), remote, bare=True)
    dest = tmp_path / "from-remote"
    spec = SourceSpec(remote=f"file://{remote}", cache=fake.cache)
    checkout(fake.matrix, fake.tag, dest, spec, fake.project)
    repo = git.Repo(dest)
    assert repo.head.commit.hexsha == git.Repo(fake_tree).commit(FAKE_TAG).hexsha
    assert repo.active_branch.name == f"lms-{FAKE_TAG}"
    bad = SourceSpec(remote=f"file://{tmp_path}/absent.git", cache=fake.cache)
    with pytest.raises(SourceUnavailable, match=re.escape("cannot clone v0.1.0")):
        checkout(fake.matrix, fake.tag, tmp_path / "y", bad, fake.project)
    assert not (tmp_path / "y").exists()
    shutil.rmtree(dest)


def test_default_source_is_the_remote_with_submodules(
    fake: Fake, fake_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No SOURCES/REMOTE/MIRROR: the matrix's GitHub remote, cloned with its submodules."""
    sub = tmp_path / "third_party_lib"
    sub_repo = git.Repo.init(sub)
    (sub / "lib.h").write_text("// a third_party submodule\n")
    sub_repo.git.add("lib.h")
    sub_repo.git.commit("-q", "-m", "lib", env={**pinned_env(), "GIT_AUTHOR_NAME": "a",
                                              "GIT_AUTHOR_EMAIL": "a@b"})  # fmt: skip
    # git refuses file:// submodules unless told (real ones come over https).
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "protocol.file.allow")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "always")
    upstream = git.Repo(fake_tree)
    upstream.git.switch("-q", "-c", "with-sub")
    upstream.git.submodule("add", "-q", f"file://{sub}", "third_party/lib")
    upstream.git.commit("-q", "-m", "add submodule", env={**pinned_env(), "GIT_AUTHOR_NAME": "a",
                                                        "GIT_AUTHOR_EMAIL": "a@b"})  # fmt: skip
    upstream.git.tag("-f", FAKE_TAG)
    remote = tmp_path / "github.git"
    git.Repo.clone_from(str(fake_tree), remote, bare=True)
    tags = fake.project / "config" / "tags.yaml"
    tags.write_text(
        tags.read_text().replace("https://invalid.example/fake.git", f"file://{remote}")
    )
    matrix = load_matrix(fake.project)
    dest = tmp_path / "default"
    checkout(matrix, matrix.get_tag(FAKE_TAG), dest, SourceSpec(cache=fake.cache), fake.project)
    assert (dest / "third_party" / "lib" / "lib.h").read_text() == "// a third_party submodule\n"
    reader = git.Repo(dest).config_reader("repository")
    assert reader.get_value("lms", "submodules") is True
    assert reader.get_value("lms", "source") == f"git file://{remote} {FAKE_TAG}"


def test_fetch_downloads_checks_and_keeps(fake: Fake, tmp_path: Path) -> None:
    """`lmstool fetch` (make sources): download by url, keep only a matching checksum."""
    served = fake.sources / FAKE_TARBALL
    tags = fake.project / "config" / "tags.yaml"
    text = tags.read_text()
    tags.write_text(
        text.replace(f"        - name: {FAKE_TARBALL}\n",
                     f"        - name: {FAKE_TARBALL}\n          url: file://{served}\n")
    )  # fmt: skip
    dest = tmp_path / "downloads"
    args = ("--repo", str(fake.project), "fetch", FAKE_TAG, "--to", str(dest))
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert (dest / FAKE_TARBALL).read_bytes() == served.read_bytes()
    assert f"use them with --sources {dest}" in proc.stdout
    # Without a tag: the tarballs of every tag that has a series.
    every = tmp_path / "every"
    proc = run_cli("--repo", str(fake.project), "fetch", "--to", str(every))
    assert proc.returncode == 0, proc.stderr
    assert (every / FAKE_TARBALL).read_bytes() == served.read_bytes()
    # A second run keeps the file that is there.
    proc = run_cli(*args)
    assert proc.returncode == 0 and "already there, sha256 ok" in proc.stderr
    # The served file changed: nothing is kept, and the message says why.
    (dest / FAKE_TARBALL).unlink()
    served.write_bytes(served.read_bytes() + b"tampered")
    proc = run_cli(*args)
    assert proc.returncode == 2 and "sha256 mismatch for file://" in proc.stderr
    assert sorted(p.name for p in dest.iterdir()) == []
    # A tag with no url says what to add.
    proc = run_cli("--repo", str(fake.project), "fetch", "v0.0.9", "--to", str(dest))
    assert proc.returncode == 2 and "lists no tarball with a url" in proc.stderr


def test_tarball_url_is_checked(fake: Fake) -> None:
    tags = fake.project / "config" / "tags.yaml"
    tags.write_text(
        tags.read_text().replace(f"        - name: {FAKE_TARBALL}\n",
                                 f"        - name: {FAKE_TARBALL}\n          url: https://x/y.tar\n")
    )  # fmt: skip
    with pytest.raises(LmsToolError, match="does not end in the file name"):
        load_matrix(fake.project)


def test_tarball_files_converted_by_gitattributes_stay_clean(tmp_path: Path) -> None:
    """A tarball made by `git archive` holds the working-tree form of files .gitattributes
    converts (v1.13.1: `*.bat text eol=crlf`). A checkout keeps the tarball's bytes and git does
    not see such files as modified, even when it re-reads them (a later `git am` refuses a dirty
    tree)."""
    sources = tmp_path / "sources"
    sources.mkdir()
    tarball = sources / FAKE_TARBALL
    bat = b"@echo off\r\necho build\r\n"
    with tarfile.open(tarball, "w:xz") as tar:
        for name, data in (
            (f"{FAKE_TOP}/.gitattributes", b"*.bat text eol=crlf\n"),
            (f"{FAKE_TOP}/scripts/build.bat", bat),
            (f"{FAKE_TOP}/README.md", b"fake upstream\n"),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    project = tmp_path / "project"
    write_matrix(project, hashlib.sha256(tarball.read_bytes()).hexdigest())
    matrix = load_matrix(project)
    spec = SourceSpec(sources=sources, cache=tmp_path / "cache")
    tree = checkout(matrix, matrix.get_tag(FAKE_TAG), tmp_path / "tree", spec, project)
    assert (tree / "scripts/build.bat").read_bytes() == bat
    repo = git.Repo(tree)
    old = time.time() - 3600
    os.utime(tree / "scripts/build.bat", (old, old))  # git must hash the file again
    repo.git.update_index("--really-refresh")
    assert repo.git.status("--porcelain") == ""
