"""apply / export on a small fake tag: conflicts, double application, round trips."""

from __future__ import annotations

import re
from pathlib import Path

import git
import pytest
from toolfakes import FAKE_TAG, Fake, commit_edit, run_cli, tree_state

from lmstool.errors import LmsToolError
from lmstool.series import SeriesApplyError, apply_series, export_series, series_files


def _make_series(fake: Fake, tmp_path: Path) -> Path:
    """A 2-patch series made the way a developer makes one: commit, then export."""
    dev = fake.checkout(tmp_path / "dev")
    repo = git.Repo(dev)
    commit_edit(
        repo, "c10/core/StorageImpl.h", "// StorageImpl line 20\n",
        "// StorageImpl line 20\n// LMS: page in on data access\n",
        "c10/core: storage access hook", "2025-02-03T10:00:00+00:00",
    )  # fmt: skip
    commit_edit(
        repo, "c10/cuda/CUDACachingAllocator.h", "// CUDACachingAllocator line 30\n",
        "// CUDACachingAllocator line 30\n// LMS: reclaim before cudaMalloc fails\n",
        "c10/cuda: reclaim in the allocator", "2025-02-03T11:00:00+00:00",
    )  # fmt: skip
    series = tmp_path / "series"
    result = export_series(dev, FAKE_TAG, series)
    assert result.written == [
        "0001-c10-core-storage-access-hook.patch",
        "0002-c10-cuda-reclaim-in-the-allocator.patch",
    ]
    return series


def test_apply_then_twice(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    series = _make_series(fake, tmp_path)
    result = apply_series(fake_tree, FAKE_TAG, series)
    assert result.applied == 2 and not result.already
    repo = git.Repo(fake_tree)
    assert [c.summary for c in repo.iter_commits(f"{FAKE_TAG}..HEAD")] == [
        "c10/cuda: reclaim in the allocator",
        "c10/core: storage access hook",
    ]
    assert "LMS: page in" in (fake_tree / "c10/core/StorageImpl.h").read_text()
    head = tree_state(fake_tree)
    again = apply_series(fake_tree, FAKE_TAG, series)
    assert again.already and again.applied == 0 and "already applied" in again.message
    assert tree_state(fake_tree) == head
    # a second tree gets the very same commits (fixed committer, committer date = author date)
    other = fake.checkout(tmp_path / "other")
    apply_series(other, FAKE_TAG, series)
    assert git.Repo(other).head.commit.hexsha == repo.head.commit.hexsha


def test_apply_via_cli_twice(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    series = _make_series(fake, tmp_path)
    args = ("--repo", str(fake.project), "apply", FAKE_TAG, "--tree", str(fake_tree))
    first = run_cli(*args, "--series", str(series))
    assert first.returncode == 0, first.stderr
    assert "applied 2 patches" in first.stdout
    second = run_cli(*args, "--series", str(series))
    assert second.returncode == 0 and "already applied" in second.stdout


def _applied_then_edited(fake: Fake, fake_tree: Path, tmp_path: Path) -> tuple[git.Repo, Path]:
    """The series of _make_series applied on ``fake_tree``, and that series with its second
    patch's change edited, as after a rebase: the tree's repository and the edited series."""
    series = _make_series(fake, tmp_path)
    apply_series(fake_tree, FAKE_TAG, series)
    dev = git.Repo(fake.checkout(tmp_path / "dev2"))
    dev.git.am(*[str(p) for p in series_files(series)])
    dev.git.reset("--quiet", "--hard", "HEAD~1")
    commit_edit(
        dev, "c10/cuda/CUDACachingAllocator.h", "// CUDACachingAllocator line 30\n",
        "// CUDACachingAllocator line 30\n// LMS: reclaim, then retry once\n",
        "c10/cuda: reclaim in the allocator", "2025-02-04T11:00:00+00:00",
    )  # fmt: skip
    edited = tmp_path / "series2"
    export_series(Path(dev.working_tree_dir or "."), FAKE_TAG, edited)
    return git.Repo(fake_tree), edited


def test_an_earlier_version_of_the_series_is_replaced_and_kept(
    fake: Fake, fake_tree: Path, tmp_path: Path
) -> None:
    repo, edited = _applied_then_edited(fake, fake_tree, tmp_path)
    earlier = repo.head.commit.hexsha
    result = apply_series(fake_tree, FAKE_TAG, edited)
    assert result.applied == 2 and not result.already
    assert "replaced the 2 commits of an earlier series" in result.message
    assert f"lms-{FAKE_TAG}-replaced" in result.message
    allocator = (fake_tree / "c10/cuda/CUDACachingAllocator.h").read_text()
    assert "reclaim, then retry once" in allocator
    assert "reclaim before cudaMalloc fails" not in allocator
    assert len(list(repo.iter_commits(f"{FAKE_TAG}..HEAD"))) == 2
    # nothing lost: the earlier commits stay on a branch
    assert repo.heads[f"lms-{FAKE_TAG}-replaced"].commit.hexsha == earlier
    again = apply_series(fake_tree, FAKE_TAG, edited)
    assert again.already


def test_a_series_below_commits_of_ones_own_is_not_replaced(
    fake: Fake, fake_tree: Path, tmp_path: Path
) -> None:
    repo, edited = _applied_then_edited(fake, fake_tree, tmp_path)
    commit_edit(
        repo, "README.md", "", "local note\n", "a commit of one's own",
        "2025-02-05T00:00:00+00:00",
    )  # fmt: skip
    before = tree_state(fake_tree)
    with pytest.raises(LmsToolError):
        apply_series(fake_tree, FAKE_TAG, edited)
    assert tree_state(fake_tree) == before
    assert f"lms-{FAKE_TAG}-replaced" not in [h.name for h in repo.heads]


def test_conflict_names_patch_and_hunk_and_restores(
    fake: Fake, fake_tree: Path, tmp_path: Path
) -> None:
    series = _make_series(fake, tmp_path)
    # the tree moved on: line 30 of the allocator header is different now
    repo = git.Repo(fake_tree)
    commit_edit(
        repo, "c10/cuda/CUDACachingAllocator.h", "// CUDACachingAllocator line 30\n",
        "// changed upstream\n", "upstream change", "2025-02-01T00:00:00+00:00",
    )  # fmt: skip
    (fake_tree / "build-output.o").write_text("untracked")
    before = tree_state(fake_tree)
    with pytest.raises(SeriesApplyError) as exc:
        apply_series(fake_tree, FAKE_TAG, series)
    msg = str(exc.value)
    assert "patch 2/2 0002-c10-cuda-reclaim-in-the-allocator.patch" in msg
    assert "('c10/cuda: reclaim in the allocator')" in msg
    assert "failed hunk: c10/cuda/CUDACachingAllocator.h hunk #1: @@ -28,6 +28,7 @@" in msg
    # The hunk lives in the series' own file, and the tree's own commit may be the cause.
    patch = series / "0002-c10-cuda-reclaim-in-the-allocator.patch"
    assert f"the failing hunk lives in {patch}, the only copy of that integration patch" in msg
    assert "integration/" not in msg and "CONTRIBUTING.md" in msg
    assert "has 1 commit(s) of your own above v0.1.0" in msg and "'upstream change'" in msg
    assert "to tell, apply it to a fresh checkout in another folder (`lmstool checkout" in msg
    assert "rm -rf" not in msg, "a tree with commits of one's own is never to be removed"
    assert exc.value.failure.hunks[0].number == 1
    assert tree_state(fake_tree) == before  # HEAD and `git status` exactly as before
    assert not (Path(repo.git_dir) / "rebase-apply").exists()


def test_failing_hunk_names_its_patch_file(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    """On the pristine tag, a hunk that does not fit sends the user to the file it lives in:
    an integration patch is kept only in the series (CONTRIBUTING.md), not in integration/."""
    series = _make_series(fake, tmp_path)
    patch = series / "0002-c10-cuda-reclaim-in-the-allocator.patch"
    patch.write_text(patch.read_text().replace(" // CUDACachingAllocator line 29", " // gone"))
    with pytest.raises(SeriesApplyError) as exc:
        apply_series(fake_tree, FAKE_TAG, series)
    msg = str(exc.value)
    assert f"The series does not fit this tree: the failing hunk lives in {patch}" in msg
    assert "rebase the patch onto v0.1.0 there and run `make patches TAG=v0.1.0`" in msg
    assert "integration/" not in msg and "of your own" not in msg


def test_engine_patch_meeting_its_files_says_so(
    fake: Fake, fake_tree: Path, tmp_path: Path
) -> None:
    """A patch that only adds files fails where the tree has them: it is generated from
    engine/, so there is no hunk to rebase."""
    dev = git.Repo(fake.checkout(tmp_path / "dev"))
    engine_h = Path(dev.working_tree_dir or ".") / "c10" / "cuda" / "LargeModelSupport.h"
    engine_h.write_text("#pragma once\n")
    dev.git.add(str(engine_h))
    dev.git.commit("-q", "-m", "c10/cuda: add the engine", env={"GIT_AUTHOR_NAME": "x"})
    series = tmp_path / "series"
    export_series(Path(dev.working_tree_dir or "."), FAKE_TAG, series)
    (fake_tree / "c10" / "cuda" / "LargeModelSupport.h").write_text("// left here\n")
    with pytest.raises(SeriesApplyError) as exc:
        apply_series(fake_tree, FAKE_TAG, series)
    msg = str(exc.value)
    patch = series_files(series)[0]
    assert f"{patch} is an engine patch, generated from engine/: it only adds files" in msg
    assert "integration/" not in msg


def test_conflict_via_cli(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    series = _make_series(fake, tmp_path)
    repo = git.Repo(fake_tree)
    commit_edit(
        repo, "c10/core/StorageImpl.h", "// StorageImpl line 21\n", "// moved\n",
        "upstream change", "2025-02-01T00:00:00+00:00",
    )  # fmt: skip
    before = tree_state(fake_tree)
    proc = run_cli(
        "--repo", str(fake.project), "apply", FAKE_TAG, "--tree", str(fake_tree),
        "--series", str(series),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "patch 1/2 0001-c10-core-storage-access-hook.patch" in proc.stderr
    assert "failed hunk: c10/core/StorageImpl.h hunk #1:" in proc.stderr
    assert tree_state(fake_tree) == before


def test_dirty_tree_refused(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    series = _make_series(fake, tmp_path)
    (fake_tree / "README.md").write_text("edited\n")
    with pytest.raises(LmsToolError, match="uncommitted changes"):
        apply_series(fake_tree, FAKE_TAG, series)
    assert git.Repo(fake_tree).head.commit == git.Repo(fake_tree).commit(FAKE_TAG)


def test_partially_applied_is_an_error(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    series = _make_series(fake, tmp_path)
    git.Repo(fake_tree).git.am(str(series_files(series)[0]))
    before = tree_state(fake_tree)
    with pytest.raises(LmsToolError, match=r"partially applied: patches 1-1 of 2"):
        apply_series(fake_tree, FAKE_TAG, series)
    assert tree_state(fake_tree) == before


def test_changes_present_not_as_commits(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    series = _make_series(fake, tmp_path)
    repo = git.Repo(fake_tree)
    for patch in series_files(series):
        repo.git.apply(str(patch))
    repo.git.commit("-q", "-am", "squashed LMS", env={"GIT_AUTHOR_NAME": "x"})
    before = tree_state(fake_tree)
    result = apply_series(fake_tree, FAKE_TAG, series)
    assert result.already and "not as the series' commits" in result.message
    assert tree_state(fake_tree) == before


def test_no_series_is_source_only(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(LmsToolError, match=r"has no \*\.patch files; the tag is source only"):
        apply_series(fake_tree, FAKE_TAG, tmp_path / "absent")


def test_export_round_trip_is_byte_identical(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    series = _make_series(fake, tmp_path)
    apply_series(fake_tree, FAKE_TAG, series)
    out = tmp_path / "out"
    result = export_series(fake_tree, FAKE_TAG, out)
    assert len(result.written) == 2
    for patch in series_files(series):
        assert (out / patch.name).read_bytes() == patch.read_bytes()
    text = series_files(out)[0].read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "\n-- \n" not in text  # no git version signature
    # re-export: nothing rewritten
    mtimes = {p.name: p.stat().st_mtime_ns for p in series_files(out)}
    again = export_series(fake_tree, FAKE_TAG, out)
    assert again.written == [] and len(again.unchanged) == 2
    assert {p.name: p.stat().st_mtime_ns for p in series_files(out)} == mtimes


def test_export_rewrites_changed_and_removes_stale(
    fake: Fake, fake_tree: Path, tmp_path: Path
) -> None:
    series = _make_series(fake, tmp_path)
    apply_series(fake_tree, FAKE_TAG, series)
    out = tmp_path / "out"
    export_series(fake_tree, FAKE_TAG, out)
    (out / "0003-old-topic.patch").write_text("stale\n")
    (out / "notes.txt").write_text("not a patch\n")
    repo = git.Repo(fake_tree)
    repo.git.reset("--hard", "HEAD~1")  # the series lost its second patch
    commit_edit(
        repo, "README.md", "fake upstream\n", "fake upstream (LMS)\n", "docs: mention LMS",
        "2025-02-04T10:00:00+00:00",
    )  # fmt: skip
    proc = run_cli(
        "--repo", str(fake.project), "export", FAKE_TAG, "--tree", str(fake_tree), "--to",
        str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "removed stale 0003-old-topic.patch" in proc.stdout
    assert "wrote 0002-docs-mention-LMS.patch" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "0001-c10-core-storage-access-hook.patch",
        "0002-docs-mention-LMS.patch",
        "notes.txt",
    ]


def test_export_refuses_dirty_or_empty(fake: Fake, fake_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(LmsToolError, match=re.escape("no commits above v0.1.0")):
        export_series(fake_tree, FAKE_TAG, tmp_path / "out")
    (fake_tree / "README.md").write_text("edited\n")
    with pytest.raises(LmsToolError, match="uncommitted changes"):
        export_series(fake_tree, FAKE_TAG, tmp_path / "out")
    assert not (tmp_path / "out").exists()
