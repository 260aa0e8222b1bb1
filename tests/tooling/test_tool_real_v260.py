"""The real PyTorch v2.6.0 source (Debian's orig tarball): import, checkout, a real series.

Slow: the first test imports the 27 MB tarball (15.5k files) once per session.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import git
import pytest
from test_tool_generate import ENGINE_HEADER
from toolfakes import REPO_ROOT, commit_edit, run_cli, sources_dir, tree_state

from lmstool.generate import Sources, generate, verify_tag
from lmstool.matrix import load_matrix
from lmstool.series import SeriesApplyError, apply_series, export_series, series_files
from lmstool.source import Pristine, SourceSpec, clone_tree, pristine_repo

SOURCES = sources_dir()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        SOURCES is None or not (SOURCES / "pytorch_2.6.0+dfsg.orig.tar.xz").is_file(),
        reason="needs the v2.6.0 tarball: `make test SOURCES=DIR` (or $LMS_SOURCES)",
    ),
]
TAG = "v2.6.0"
# The import is reproducible: this tarball always gives this commit.
PRISTINE_COMMIT = "cacea738eba9593138bd6cb5fbecbdf634f14061"
HOOK_OLD = "struct C10_API StorageImpl : public c10::intrusive_ptr_target {\n"
ALLOC_OLD = "namespace c10::cuda::CUDACachingAllocator {\n"


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lms-cache")


@pytest.fixture(scope="session")
def pristine(cache: Path) -> Pristine:
    matrix = load_matrix(REPO_ROOT)
    assert SOURCES is not None
    spec = SourceSpec(sources=SOURCES, cache=cache)
    return pristine_repo(matrix, matrix.get_tag(TAG), spec, REPO_ROOT)


@pytest.fixture(scope="module")
def series(pristine: Pristine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-patch series on c10/core/StorageImpl.h and c10/cuda/CUDACachingAllocator.h."""
    base = tmp_path_factory.mktemp("real-series")
    repo = clone_tree(pristine, base / "dev", shared=True)
    commit_edit(
        repo, "c10/core/StorageImpl.h", HOOK_OLD,
        "// LMS: a storage is paged back in before its data is accessed.\n" + HOOK_OLD,
        "c10/core: storage access hook for LMS", "2025-02-03T10:00:00+00:00",
    )  # fmt: skip
    commit_edit(
        repo, "c10/cuda/CUDACachingAllocator.h", ALLOC_OLD,
        ALLOC_OLD + "\n// LMS: reclaim inactive storages before a device allocation fails.\n",
        "c10/cuda: reclaim hook in the caching allocator", "2025-02-03T11:00:00+00:00",
    )  # fmt: skip
    out = base / "patches"
    export_series(Path(repo.working_tree_dir or ""), TAG, out)
    assert len(series_files(out)) == 2
    return out


@pytest.fixture(scope="module")
def shared_tree(pristine: Pristine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("real-tree") / "pytorch"
    clone_tree(pristine, path, shared=True).close()
    return path


@pytest.fixture()
def tree(shared_tree: Path) -> Iterator[Path]:
    """The module's checkout, back at the pristine tag for each test (cheap reset)."""
    repo = git.Repo(shared_tree)
    repo.git.switch("--quiet", "--force", "-C", f"lms-{TAG}", TAG)
    repo.git.clean("-q", "-f", "-d", "-x")
    yield shared_tree


def test_import_is_the_pinned_commit(pristine: Pristine) -> None:
    repo = git.Repo(pristine.path)
    commit = repo.commit(TAG)
    assert commit.hexsha == PRISTINE_COMMIT
    files = repo.git.ls_tree("-r", TAG).splitlines()
    assert len(files) == 15552
    modes = {line.split()[3]: line.split()[0] for line in files}
    assert modes[".dockerignore"] == "120000"
    assert modes["c10/cuda/CUDACachingAllocator.h"] == "100644"
    assert modes["tools/nightly.py"] == "100755"
    assert ".github/workflows/lint.yml" not in modes  # Debian's orig drops .github/
    assert pristine.submodules is False


def test_cli_checkout_real(pristine: Pristine, cache: Path, tmp_path: Path) -> None:
    dest = tmp_path / "pytorch-v2.6.0"
    args = ("checkout", TAG, "--dest", str(dest), "--sources", str(SOURCES), "--cache", str(cache))
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "using cached import" in proc.stderr
    repo = git.Repo(dest)
    assert repo.head.commit.hexsha == PRISTINE_COMMIT
    assert repo.active_branch.name == "lms-v2.6.0" and not repo.is_dirty(untracked_files=True)
    again = run_cli(*args)  # a pristine checkout of the tag is reused
    assert again.returncode == 0 and "reusing it" in again.stderr


def test_real_series_applies_once(series: Path, tree: Path) -> None:
    result = apply_series(tree, TAG, series)
    assert result.applied == 2
    assert "LMS: a storage is paged back in" in (tree / "c10/core/StorageImpl.h").read_text()
    before = tree_state(tree)
    assert apply_series(tree, TAG, series).already
    assert tree_state(tree) == before
    out = tree.parent / "exported"
    export_series(tree, TAG, out)
    for patch in series_files(series):
        assert (out / patch.name).read_bytes() == patch.read_bytes()


def test_real_conflict_restores_tree(series: Path, tree: Path) -> None:
    repo = git.Repo(tree)
    commit_edit(
        repo, "c10/cuda/CUDACachingAllocator.h", ALLOC_OLD,
        "namespace c10::cuda::CUDACachingAllocator { // upstream moved on\n",
        "upstream change", "2025-02-01T00:00:00+00:00",
    )  # fmt: skip
    before = tree_state(tree)
    with pytest.raises(SeriesApplyError) as exc:
        apply_series(tree, TAG, series)
    msg = str(exc.value)
    assert "patch 2/2 0002-c10-cuda-reclaim-hook-in-the-caching-allocator.patch" in msg
    assert "failed hunk: c10/cuda/CUDACachingAllocator.h hunk #1: @@ -" in msg
    assert tree_state(tree) == before


def test_real_generate_and_verify(pristine: Pristine, series: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "config" / "tags.yaml", project / "config" / "tags.yaml")
    engine = project / "engine" / "c10" / "cuda"
    engine.mkdir(parents=True)
    (engine / "LargeModelSupportTest.h").write_text("#pragma once\n// engine stand-in\n")
    integ = project / "integration" / TAG
    integ.mkdir(parents=True)
    (integ / "0001-engine.engine").write_text(ENGINE_HEADER)
    hook = series_files(series)[0]
    committed = project / "patches" / TAG
    committed.mkdir(parents=True)
    shutil.copy(hook, committed / "0002-hook.patch")
    (integ / "series").write_text("0001-engine.engine c10/cuda\n0002-hook.patch\n")
    matrix = load_matrix(project)
    spec = SourceSpec(sources=SOURCES, cache=Path(pristine.path).parent)
    sources = Sources(matrix, spec, project)
    result = generate(sources, matrix.get_tag(TAG), committed)
    # The patches keep their entries' names; the integration patch is already its own output.
    assert [p.name for p in series_files(committed)] == ["0001-engine.patch", "0002-hook.patch"]
    assert result.written == ["0001-engine.patch"] and result.unchanged == ["0002-hook.patch"]
    assert (committed / "0002-hook.patch").read_bytes() == hook.read_bytes()
    report = verify_tag(sources, matrix.get_tag(TAG))
    assert report.ok, report.problems
    (engine / "LargeModelSupportTest.h").write_text("#pragma once\n// changed\n")
    stale = verify_tag(sources, matrix.get_tag(TAG))
    assert not stale.ok
    assert any(p.startswith("stale: ") and "0001-" in p for p in stale.problems)
