"""Generating a series from engine/ + integration/<tag>/, and verify's staleness checks."""

from __future__ import annotations

import shutil
from pathlib import Path

import git
import pytest
from toolfakes import FAKE_TAG, REPO_ROOT, Fake, commit_edit, run_cli

from lmstool.errors import LmsToolError
from lmstool.generate import (
    Sources,
    check_engine_coverage,
    generate,
    quick_staleness,
    read_series,
    verify_tag,
)
from lmstool.matrix import load_matrix
from lmstool.series import export_series, series_files

ENGINE_HEADER = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: PyTorch LMS <lms@example.org>
Date: Mon, 3 Feb 2025 10:00:00 +0000
Subject: [PATCH] c10/cuda: add the Large Model Support engine

The engine: storage states, reclaim policy, pinned host pool.

Forwarded: not-needed
"""


def setup_integration(fake: Fake, tmp_path: Path) -> None:
    """engine/ with two files, integration/<tag>/ with an .engine entry and its series file,
    and the .patch entry in patches/<tag>/ (where integration patches are kept, once)."""
    engine = fake.project / "engine" / "c10" / "cuda"
    engine.mkdir(parents=True)
    (engine / "LargeModelSupport.h").write_text("#pragma once\n// LMS engine API\n")
    (engine / "LargeModelSupport.cpp").write_text('#include "LargeModelSupport.h"\n')
    (engine / "__pycache__").mkdir()
    (engine / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    integ = fake.project / "integration" / FAKE_TAG
    integ.mkdir(parents=True)
    (integ / "0001-c10-cuda-add-engine.engine").write_text(ENGINE_HEADER)
    dev = fake.checkout(tmp_path / "dev")
    commit_edit(
        git.Repo(dev), "c10/core/StorageImpl.h", "// StorageImpl line 20\n",
        "// StorageImpl line 20\n// LMS: page in on data access\n",
        "c10/core: storage access hook", "2025-02-03T10:05:00+00:00",
    )  # fmt: skip
    export_series(dev, FAKE_TAG, tmp_path / "dev-out")
    committed = fake.project / "patches" / FAKE_TAG
    committed.mkdir(parents=True)
    shutil.copy(
        series_files(tmp_path / "dev-out")[0],
        committed / "0002-c10-core-storage-access-hook.patch",
    )
    (integ / "series").write_text(
        "# the LMS series\n0001-c10-cuda-add-engine.engine c10\n"
        "0002-c10-core-storage-access-hook.patch  # hook\n"
    )


def test_generate_is_deterministic(fake: Fake, tmp_path: Path) -> None:
    setup_integration(fake, tmp_path)
    sources = Sources(fake.matrix, fake.spec, fake.project)
    out = fake.project / "patches" / FAKE_TAG
    first = generate(sources, fake.tag, out)
    # Each patch keeps its entry's name; the integration patch is already there, byte for byte.
    assert first.written == ["0001-c10-cuda-add-engine.patch"]
    assert first.unchanged == ["0002-c10-core-storage-access-hook.patch"]
    engine_patch = (out / first.written[0]).read_text()
    assert "From: PyTorch LMS <lms@example.org>" in engine_patch
    assert "Date: Mon, 3 Feb 2025 10:00:00 +0000" in engine_patch
    assert engine_patch.count("Forwarded: not-needed") == 1
    assert "create mode 100644 c10/cuda/LargeModelSupport.h" in engine_patch
    assert "junk.pyc" not in engine_patch
    snapshot = {p.name: p.read_bytes() for p in series_files(out)}
    second = generate(sources, fake.tag, out)
    assert second.written == [] and len(second.unchanged) == 2
    assert {p.name: p.read_bytes() for p in series_files(out)} == snapshot
    # the CLI with a fresh cache gives the same bytes
    other = tmp_path / "cli-out"
    proc = run_cli(
        "--repo", str(fake.project), "patches", FAKE_TAG, "--to", str(other), "--sources",
        str(fake.sources), cache=tmp_path / "cache-cli",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.read_bytes() for p in series_files(other)} == snapshot
    # and the generated series applies with plain git am and verifies
    report = verify_tag(sources, fake.tag)
    assert report.ok, report.problems


def test_verify_detects_stale_missing_extra(fake: Fake, tmp_path: Path) -> None:
    setup_integration(fake, tmp_path)
    sources = Sources(fake.matrix, fake.spec, fake.project)
    committed = fake.project / "patches" / FAKE_TAG
    generate(sources, fake.tag, committed)
    engine_h = fake.project / "engine" / "c10" / "cuda" / "LargeModelSupport.h"
    engine_h.write_text(engine_h.read_text() + "// a change not regenerated\n")
    (committed / "0003-left-over.patch").write_text((committed.iterdir().__next__()).read_text())
    report = verify_tag(sources, fake.tag)
    assert not report.ok
    text = "\n".join(report.problems)
    assert "stale: " in text and "0001-c10-cuda-add-engine.patch" in text
    assert "extra: " in text and "0003-left-over.patch" in text
    assert f"run `make patches TAG={FAKE_TAG}` and commit" in text
    (committed / "0001-c10-cuda-add-engine.patch").unlink()
    args = ("--repo", str(fake.project), "verify", FAKE_TAG, "--sources", str(fake.sources))
    proc = run_cli(*args, cache=fake.cache)
    assert proc.returncode == 1
    assert "missing: " in proc.stdout and "0001-c10-cuda-add-engine.patch" in proc.stdout
    assert "verify failed for v0.1.0" in proc.stdout
    # An integration patch is its own source: without it there is nothing to regenerate from.
    (committed / "0002-c10-core-storage-access-hook.patch").unlink()
    proc = run_cli(*args, cache=fake.cache)
    assert proc.returncode == 1
    assert "0002-c10-core-storage-access-hook.patch does not exist" in proc.stdout


def test_quick_staleness_agrees_with_generation(fake: Fake, tmp_path: Path) -> None:
    """The check `apply` runs without the pristine tree finds what verify would."""
    setup_integration(fake, tmp_path)
    committed = fake.project / "patches" / FAKE_TAG
    generate(Sources(fake.matrix, fake.spec, fake.project), fake.tag, committed)
    assert quick_staleness(fake.project, fake.tag) == []
    engine_patch = committed / "0001-c10-cuda-add-engine.patch"
    # An engine file edited, or added, after the series was generated.
    engine_h = fake.project / "engine" / "c10" / "cuda" / "LargeModelSupport.h"
    original = engine_h.read_text()
    engine_h.write_text(original + "// a change not regenerated\n")
    assert quick_staleness(fake.project, fake.tag) == [
        f"stale: {engine_patch} differs from the generated patch"
    ]
    engine_h.write_text(original)
    added = engine_h.with_name("LargeModelSupportExtra.h")
    added.write_text("#pragma once\n")
    assert quick_staleness(fake.project, fake.tag) == [
        f"stale: {engine_patch} differs from the generated patch"
    ]
    added.unlink()
    # The .engine entry's header edited in integration/<tag>/.
    header = fake.project / "integration" / FAKE_TAG / "0001-c10-cuda-add-engine.engine"
    header.write_text(header.read_text().replace("pinned host pool", "pinned host buffers"))
    assert quick_staleness(fake.project, fake.tag) == [
        f"stale: {engine_patch} differs from the generated patch"
    ]
    header.write_text(ENGINE_HEADER)
    assert quick_staleness(fake.project, fake.tag) == []
    # A patch the series file does not list.
    (committed / "0003-left-over.patch").write_text(engine_patch.read_text())
    assert quick_staleness(fake.project, fake.tag) == [
        f"extra: {committed / '0003-left-over.patch'} (not in the generated series)"
    ]


def test_every_committed_series_is_current_with_engine() -> None:
    """Each committed series holds the engine patches engine/ makes now (`make patches`
    regenerates them; `make verify` checks the whole series against the pristine tag)."""
    matrix = load_matrix(REPO_ROOT)
    tags = matrix.tags_with_series()
    assert tags
    for tag in tags:
        assert quick_staleness(REPO_ROOT, tag) == [], f"run `make patches TAG={tag.name}`"


def test_apply_warns_of_a_stale_committed_series(fake: Fake, tmp_path: Path) -> None:
    """`make patch` after an engine edit says the committed series lacks it, whether the
    series is applied now or was before."""
    setup_integration(fake, tmp_path)
    generate(
        Sources(fake.matrix, fake.spec, fake.project), fake.tag, fake.project / "patches" / FAKE_TAG
    )
    tree = fake.checkout(tmp_path / "tree")
    args = ("--repo", str(fake.project), "apply", FAKE_TAG, "--tree", str(tree))
    proc = run_cli(*args)
    assert proc.returncode == 0 and "applied 2 patches" in proc.stdout
    assert "warning" not in proc.stderr
    engine_h = fake.project / "engine" / "c10" / "cuda" / "LargeModelSupport.h"
    engine_h.write_text(engine_h.read_text() + "// a change not regenerated\n")
    proc = run_cli(*args)
    assert proc.returncode == 0 and "already applied" in proc.stdout
    assert (
        f"warning: patches/{FAKE_TAG} is out of date with engine/ and integration/{FAKE_TAG}"
        in proc.stderr
    )
    assert "0001-c10-cuda-add-engine.patch differs from the generated patch" in proc.stderr
    assert f"Regenerate it with `lmstool patches {FAKE_TAG}`" in proc.stderr
    # Under make, the commands are make's, with the user's source.
    proc = run_cli(*args, env={"LMSTOOL_FRONTEND": "make", "LMSTOOL_MAKE_VARS": "SOURCES=/t"})
    assert f"`make patches TAG={FAKE_TAG} SOURCES=/t`" in proc.stderr
    assert f"then run `make patch TAG={FAKE_TAG} SOURCES=/t` again" in proc.stderr
    # A series folder given on the command line has no sources to be stale against.
    series = tmp_path / "series"
    shutil.copytree(fake.project / "patches" / FAKE_TAG, series)
    proc = run_cli(*args, "--series", str(series))
    assert proc.returncode == 0 and "warning" not in proc.stderr


def test_verify_source_only_and_unavailable(fake: Fake, tmp_path: Path) -> None:
    args = ("--repo", str(fake.project), "verify", "--sources", str(fake.sources))
    proc = run_cli(*args, cache=fake.cache)
    assert proc.returncode == 0, proc.stderr
    assert "v0.1.0: source only, no series" in proc.stdout
    assert "v0.0.9: source only, no series" in proc.stdout
    setup_integration(fake, tmp_path)
    (fake.sources / "fake_0.1.0.orig.tar.xz").unlink()
    proc = run_cli(*args, cache=tmp_path / "empty-cache")
    assert proc.returncode == 2 and "source unavailable" in proc.stderr
    assert proc.stderr.count("--skip-unavailable") == 1  # each hint once
    proc = run_cli(*args, "--skip-unavailable", cache=tmp_path / "empty-cache")
    assert proc.returncode == 0 and "v0.1.0: SKIPPED, source unavailable" in proc.stdout


def test_patches_for_source_only_tag(fake: Fake) -> None:
    proc = run_cli("--repo", str(fake.project), "patches", "v0.0.9")
    assert proc.returncode == 0 and "v0.0.9: source only, no series" in proc.stdout


def test_engine_file_must_be_new(fake: Fake, tmp_path: Path) -> None:
    setup_integration(fake, tmp_path)
    clash = fake.project / "engine" / "c10" / "core" / "StorageImpl.h"
    clash.parent.mkdir(parents=True)
    clash.write_text("// would overwrite upstream\n")
    sources = Sources(fake.matrix, fake.spec, fake.project)
    out = tmp_path / "out"
    with pytest.raises(LmsToolError, match="engine file c10/core/StorageImpl\\.h already"):
        generate(sources, fake.tag, out)
    assert not out.exists()


def test_failing_integration_patch_is_named(fake: Fake, tmp_path: Path) -> None:
    setup_integration(fake, tmp_path)
    patch = fake.project / "patches" / FAKE_TAG / "0002-c10-core-storage-access-hook.patch"
    patch.write_text(patch.read_text().replace(" // StorageImpl line 19", " // not there"))
    sources = Sources(fake.matrix, fake.spec, fake.project)
    with pytest.raises(LmsToolError) as exc:
        generate(sources, fake.tag, tmp_path / "out")
    msg = str(exc.value)
    assert "patch 2/2 0002-c10-core-storage-access-hook.patch" in msg
    assert "failed hunk: c10/core/StorageImpl.h hunk #1: @@ -18,6 +18,7 @@" in msg


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ("0001-a.engine x\n0001-a.engine x\n", "listed twice"),
        ("0001-a.engine\n", "names the engine/ paths it carries"),
        ("0001-a.engine x\n0002-b.patch y\n", "only .engine entries take paths"),
        ("0001 bad name.patch\n", "is not an entry name"),
        ("0001-absent.patch\n", "does not exist; add it or remove the line"),
        ("0001-a.engine x\n0003-b.patch\n", "number it 0002"),
        ("# only comments\n", "lists no entries"),
        ("0002-b.patch\n", "number it 0001"),
        ("0001-c.patch\n", "not listed in"),
    ],
)
def test_bad_series_file(tmp_path: Path, series: str, expected: str) -> None:
    integ = tmp_path / "integration"
    committed = tmp_path / "patches"
    integ.mkdir()
    committed.mkdir()
    (integ / "0001-a.engine").write_text(ENGINE_HEADER)
    (committed / "0002-b.patch").write_text("x")
    (committed / "0003-b.patch").write_text("x")
    (committed / "0001-c.patch").write_text("x")
    (integ / "series").write_text(series)
    with pytest.raises(LmsToolError, match=expected):
        read_series(integ, committed)


def test_integration_patch_is_kept_once(tmp_path: Path) -> None:
    integ = tmp_path / "integration"
    committed = tmp_path / "patches"
    integ.mkdir()
    committed.mkdir()
    (integ / "0001-a.engine").write_text(ENGINE_HEADER)
    (committed / "0002-b.patch").write_text("x")
    (integ / "series").write_text("0001-a.engine x\n0002-b.patch\n")
    assert [e.patch_name for e in read_series(integ, committed)] == ["0001-a.patch", "0002-b.patch"]
    (integ / "0002-b.patch").write_text("x")
    with pytest.raises(LmsToolError, match="integration patches are kept once"):
        read_series(integ, committed)


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ("0001-a.engine c10\n", "is carried by no .engine entry"),
        ("0001-a.engine c10 torch\n0002-b.engine torch/cuda\n", "several entries"),
    ],
)
def test_engine_files_belong_to_exactly_one_entry(
    tmp_path: Path, series: str, expected: str
) -> None:
    engine = tmp_path / "engine"
    (engine / "c10" / "cuda").mkdir(parents=True)
    (engine / "c10" / "cuda" / "X.cpp").write_text("//\n")
    (engine / "torch" / "cuda").mkdir(parents=True)
    (engine / "torch" / "cuda" / "lms.py").write_text("#\n")
    integ = tmp_path / "integration"
    integ.mkdir()
    for name in ("0001-a.engine", "0002-b.engine"):
        (integ / name).write_text(ENGINE_HEADER)
    if "0002-b.engine" not in series:
        (integ / "0002-b.engine").unlink()
    (integ / "series").write_text(series)
    with pytest.raises(LmsToolError, match=expected):
        check_engine_coverage(read_series(integ, tmp_path), engine)


def test_engine_manifest_is_one_glob(tmp_path: Path) -> None:
    """A file added under engine/ joins the manifest every build reads, with no list to edit."""
    from lmstool import manifest

    engine = tmp_path / "engine"
    (engine / "c10" / "cuda").mkdir(parents=True)
    (engine / "c10" / "cuda" / "A.h").write_text("//\n")
    (engine / "c10" / "cuda" / "A.cpp").write_text("//\n")
    (engine / "test").mkdir()
    (engine / "test" / "test_x.py").write_text("#\n")
    (engine / "c10" / "cuda" / "A.cpp.orig").write_text("//\n")
    assert [p.as_posix() for p in manifest.cxx_sources(engine)] == ["c10/cuda/A.cpp"]
    (engine / "c10" / "cuda" / "B.cpp").write_text("//\n")
    assert [p.as_posix() for p in manifest.cxx_sources(engine, "c10/cuda")] == [
        "c10/cuda/A.cpp",
        "c10/cuda/B.cpp",
    ]
    assert [p.as_posix() for p in manifest.cxx_files(engine)] == [
        "c10/cuda/A.cpp",
        "c10/cuda/A.h",
        "c10/cuda/B.cpp",
    ]
    assert "test/test_x.py" in [p.as_posix() for p in manifest.engine_files(engine)]
    proc = run_cli("engine-files", "c10/cuda", "--sources", "--engine", str(engine))
    assert proc.returncode == 0 and proc.stdout.split() == ["c10/cuda/A.cpp", "c10/cuda/B.cpp"]
    # The extension's build reads the same manifest.
    setup_py = (Path(__file__).resolve().parents[2] / "extension" / "setup.py").read_text()
    assert "manifest.py" in setup_py and "LargeModelSupport.cpp" not in setup_py
