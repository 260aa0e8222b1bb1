"""The GPU runners' shell scripts on the CPU: they parse, and their shared environment
report (scripts/gpu/environment.sh) prints what a run depends on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from toolfakes import REPO_ROOT

SCRIPTS = sorted((REPO_ROOT / "scripts" / "gpu").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_script_parses(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_environment_report_names_versions_and_what_is_missing() -> None:
    pytest.importorskip("torch", reason="the report imports torch")
    proc = subprocess.run(
        [
            "bash",
            str(REPO_ROOT / "scripts" / "gpu" / "environment.sh"),
            sys.executable,
            "pytest",
            "unused",
            "lms_no_such_module",
            "the run goes on without it",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = proc.stdout.splitlines()
    assert lines[0] == "== environment"
    assert any(line.startswith("torch ") and " gpus " in line for line in lines)
    assert f"pytest {pytest.__version__}" in lines
    assert "lms_no_such_module missing: the run goes on without it" in lines


def test_environment_report_names_the_engine_the_sender_gives() -> None:
    """A copy of the checkout sent to a GPU host names its engine in every log's header, so a
    run stopped before it writes results still says which engine it ran."""
    env = {**os.environ, "LMS_ENGINE_COMMIT": "1234abc", "LMS_ENGINE_DIRTY": "1"}
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "gpu" / "environment.sh"), sys.executable],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    engine = [line for line in proc.stdout.splitlines() if line.startswith("engine ")]
    assert len(engine) == 1, proc.stdout + proc.stderr
    words = engine[0].split()
    assert words[1:4] == ["1234abc", "dirty", "True"]
    assert words[4] == "sources" and len(words[5]) == 64


def test_every_runner_uses_the_shared_environment_report() -> None:
    # run-engine.sh builds and tests the engine without torch: it reports nvcc instead.
    runners = [p for p in SCRIPTS if p.name.startswith("run-") and p.name != "run-engine.sh"]
    assert runners
    for runner in runners:
        text = runner.read_text()
        assert "scripts/gpu/environment.sh" in text, runner.name
        assert "nvidia-smi" not in text, f"{runner.name} reports the environment itself"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def test_run_ab_prepares_the_diff_that_turns_this_tree_into_the_base(tmp_path: Path) -> None:
    """``run-ab.sh --prepare BASE`` writes what turns this tree's engine (uncommitted changes
    included) into BASE's, and the commits; applied with ``patch`` (as on the GPU host,
    which has no git) it gives BASE's files back. Without it, or with a malformed cell, the
    script says what to run."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    (repo / "engine").mkdir()
    script = repo / "scripts" / "gpu" / "run-ab.sh"
    script.write_text((REPO_ROOT / "scripts" / "gpu" / "run-ab.sh").read_text())
    (repo / "engine" / "a.cpp").write_text("int a = 1;\n")
    (repo / "engine" / "gone.cpp").write_text("int gone = 1;\n")
    (repo / "README").write_text("not the engine\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "engine" / "a.cpp").write_text("int a = 2;\n")
    (repo / "engine" / "gone.cpp").unlink()
    (repo / "engine" / "new.cpp").write_text("int n = 3;\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "head")
    head = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "engine" / "a.cpp").write_text("int a = 4;\n")  # uncommitted
    (repo / "README").write_text("changed, not the engine\n")

    cells = subprocess.run(
        ["bash", str(script), "gpt:nocap:1.5:lms"], capture_output=True, text=True
    )
    assert cells.returncode == 2 and "--prepare BASE" in cells.stderr
    done = subprocess.run(
        ["bash", str(script), "--prepare", base[:7]], capture_output=True, text=True, check=True
    )
    assert "dirty 1" in done.stdout
    prepared = repo / "out" / "ab"
    assert (prepared / "commits.env").read_text().splitlines() == [
        f"BASE_COMMIT={base}",
        f"HEAD_COMMIT={head}",
        "HEAD_DIRTY=1",
    ]
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(repo), str(copy)], check=True)
    subprocess.run(["rm", "-rf", str(copy / ".git")], check=True)
    with (prepared / "base.diff").open() as diff:
        subprocess.run(["patch", "-p1", "-s"], cwd=copy, stdin=diff, check=True)
    assert (copy / "engine" / "a.cpp").read_text() == "int a = 1;\n"
    assert (copy / "engine" / "gone.cpp").read_text() == "int gone = 1;\n"
    assert not (copy / "engine" / "new.cpp").exists()
    assert (copy / "README").read_text() == "changed, not the engine\n"

    # Another base in a folder of its own.
    subprocess.run(
        ["bash", str(script), "--prepare", head[:7]],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "AB_DIR": "out/ab-head"},
    )
    assert f"BASE_COMMIT={head}" in (repo / "out" / "ab-head" / "commits.env").read_text()
    assert f"BASE_COMMIT={base}" in (prepared / "commits.env").read_text()

    bad = subprocess.run(["bash", str(script), "gpt:nocap"], capture_output=True, text=True)
    assert bad.returncode == 2 and "is not MODEL:REGIME:FACTOR:METHODS" in bad.stderr
    missing = subprocess.run(
        ["bash", str(script), "--prepare", "no-such-commit"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "is no commit of this repository" in missing.stderr
