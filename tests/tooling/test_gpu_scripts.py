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
