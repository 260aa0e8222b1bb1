"""The Makefile's own checks, run as `make -n` (they stop make before any recipe runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toolfakes import REPO_ROOT, run_make

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


@needs_make
def test_make_test_refuses_a_sources_folder_that_does_not_exist(tmp_path: Path) -> None:
    """A mistyped SOURCES would pass with every test of real PyTorch sources skipped."""
    missing = tmp_path / "no-such-folder"
    done = run_make("test", f"SOURCES={missing}")
    assert done.returncode != 0
    assert f"SOURCES={missing} is not a folder" in done.stderr
    assert f"`make sources SOURCES={missing}`" in done.stderr
    assert "leave out SOURCES=" in done.stderr
    assert "pytest" not in done.stdout, "nothing may run"
    # A file is no folder either.
    (tmp_path / "file").write_text("")
    assert run_make("test", f"SOURCES={tmp_path / 'file'}").returncode != 0
    # An existing folder, or none given, runs the suite with it.
    done = run_make("test", f"SOURCES={tmp_path}")
    assert done.returncode == 0, done.stderr
    assert f"LMS_SOURCES='{tmp_path}'" in done.stdout
    for no_sources in ((), ("SOURCES=",)):
        done = run_make("test", *no_sources)
        assert done.returncode == 0, done.stderr
        assert "LMS_SOURCES=''" in done.stdout
    # Other targets take SOURCES as where to put or find tarballs, checked where they are used.
    assert run_make("sources", f"SOURCES={missing}").returncode == 0


def test_pytest_refuses_lms_sources_that_does_not_exist(tmp_path: Path) -> None:
    """The same for pytest run directly with $LMS_SOURCES."""
    missing = tmp_path / "no-such-folder"
    # The child pytest must not write the report of this run (CI passes --junitxml here).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["LMS_SOURCES"] = str(missing)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q"]
    argv.append(str(Path(__file__).resolve().parent / "test_hints.py"))
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert f"LMS_SOURCES={missing} is not a folder" in done.stderr
    assert f"`make sources SOURCES={missing}`" in done.stderr
    env["LMS_SOURCES"] = str(tmp_path)
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _lmstool_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if " -m lmstool " in line]


@needs_make
@pytest.mark.parametrize("target", ["patch", "verify", "patches", "build"])
def test_one_source_wins_and_make_says_which(target: str) -> None:
    """SOURCES with MIRROR (or REMOTE): the checkout comes from one, and make says which in one
    line (SOURCES may be kept in the environment for `make test`)."""
    done = run_make(target, "PY=python3", "SOURCES=/tarballs", "MIRROR=/clone")
    assert done.returncode == 0, done.stderr
    notice = (
        "make: the tag comes from MIRROR=/clone; SOURCES=/tarballs not used for it (MIRROR wins "
        "over REMOTE, REMOTE over SOURCES)"
    )
    assert done.stdout.splitlines().count(notice) == 1
    first = _lmstool_lines(done.stdout)[0]
    assert "--mirror /clone" in first and "--sources" not in first
    done = run_make(target, "PY=python3", "SOURCES=/tarballs", "REMOTE=file:///r.git")
    assert "make: the tag comes from REMOTE=file:///r.git; SOURCES=/tarballs not used" in (
        done.stdout
    )
    assert "--remote file:///r.git" in _lmstool_lines(done.stdout)[0]
    # One source alone needs no word.
    for alone in ("SOURCES=/tarballs", "MIRROR=/clone", "REMOTE=file:///r.git"):
        assert "make: the tag comes from" not in run_make(target, "PY=python3", alone).stdout


@needs_make
def test_make_test_reads_sources_whatever_mirror_says(tmp_path: Path) -> None:
    done = run_make("test", f"SOURCES={tmp_path}", "MIRROR=/clone")
    assert done.returncode == 0, done.stderr
    assert "make: the tag comes from" not in done.stdout
    assert f"LMS_SOURCES='{tmp_path}'" in done.stdout


@needs_make
def test_make_help_says_which_source_wins() -> None:
    done = run_make("help", "SOURCES=/tarballs", "MIRROR=/clone")
    assert "source: MIRROR=/clone (SOURCES=/tarballs not used)" in done.stdout
    assert "from MIRROR=PATH, else REMOTE=URL, else SOURCES=DIR, else GitHub" in done.stdout
    assert "source: GitHub," in run_make("help").stdout
    lines = (REPO_ROOT / "Makefile").read_text().splitlines()
    header = " ".join(line.lstrip("# ") for line in lines[: lines.index("")] if line)
    assert "MIRROR wins over REMOTE and REMOTE over SOURCES" in header
