"""The GPU runners' shell scripts on the CPU: they parse, and their shared environment
report (scripts/gpu/environment.sh) prints what a run depends on."""

from __future__ import annotations

import json
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


def _first_commit(repo: Path) -> str:
    """Makes ``repo`` a git repository with everything in it committed; the commit."""
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    return _git(repo, "rev-parse", "HEAD").strip()


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
    base = _first_commit(repo)
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


# The interpreter run-ab.sh is given in the end-to-end test: it stands in for the build
# (setup.py build_ext makes the module file) and for compare.py (a record in its JSON
# layout whose rows name the engine file of the tree they ran in), and runs everything else
# (benchmarks.ab) with the real interpreter.
STUB_PYTHON = """#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args[:1] == ["-"]:
    sys.stdin.read()
    print("engine stub")
elif "setup.py" in args:
    Path("torch_lms").mkdir(exist_ok=True)
    Path("torch_lms/_C.stub.so").write_text("built")
elif args and args[0].endswith("compare.py"):
    opt = {{args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}}
    engine = Path("engine/x.cpp").read_text().strip()
    rows = [
        {{"method": m, "factor": float(opt["--factors"]), "batch": 10, "status": "ok",
          "iteration_times": [1.0 if engine == "int x = 1;" else 0.9], "detail": engine}}
        for m in opt["--methods"].split(",")
    ]
    record = {{
        "environment": {{"engine_commit": os.environ["LMS_ENGINE_COMMIT"],
                         "engine_dirty": os.environ["LMS_ENGINE_DIRTY"] == "1"}},
        "regime": opt["--regime"], "config": {{"model": opt["--model"]}}, "measurements": rows,
    }}
    out = Path(opt["--out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"nocap-{{opt['--model']}}.json").write_text(json.dumps(record))
    print(f"   {{rows[0]['method']}} x{{opt['--factors']}}        batch 10    stub")
else:
    os.execv({python!r}, [{python!r}, *args])
"""


def test_run_ab_runs_each_cell_on_the_base_then_the_head(tmp_path: Path) -> None:
    """run-ab.sh on a copy of this repository with a stub interpreter: both extensions are
    built, the base tree runs the base's engine and the head tree the head's, cell by cell,
    and benchmarks.ab sets their rows side by side (base 1.0 s, head 0.9 s: -10%)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    # What the script, its build and benchmarks.ab read; no results, no build outputs.
    subprocess.run(
        [
            "bash",
            "-c",
            'tar -C "$0" -cf - --exclude=benchmarks/results --exclude=extension/build '
            "--exclude='*.so' --exclude=__pycache__ scripts benchmarks lmsbench extension "
            '| tar -C "$1" -xf -',
            str(REPO_ROOT),
            str(repo),
        ],
        check=True,
    )
    (repo / "engine").mkdir()
    (repo / "engine" / "x.cpp").write_text("int x = 1;\n")
    (repo / ".gitignore").write_text("/out/\n__pycache__/\n*.so\n.sources.sha256\n")
    base = _first_commit(repo)
    (repo / "engine" / "x.cpp").write_text("int x = 2;\n")
    _git(repo, "commit", "-q", "-am", "head")
    script = repo / "scripts" / "gpu" / "run-ab.sh"
    subprocess.run(["bash", str(script), "--prepare", base], check=True, capture_output=True)
    stub = tmp_path / "python3"
    stub.write_text(STUB_PYTHON.format(python=sys.executable))
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": str(stub),
        "OUT": str(out),
        "AB_BASE_TREE": str(tmp_path / "base-tree"),
        "AB_PAIRS": "lms_residual=lms",
        "AB_MAX_SLOWDOWN": "3",
    }
    run = subprocess.run(
        ["bash", str(script), "gpt:nocap:1.5:lms,lms_residual", "resnet152:capped:2:lms"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = (out / "ab.md").read_text()
    assert f"Base engine {base[:7]}" in report
    assert "| gpt nocap 1.5x lms | 10 / 10 | 1.000 / 0.900 | -10.0% |" in report
    assert "| resnet152 capped 2x lms | 10 / 10 | 1.000 / 0.900 | -10.0% |" in report
    assert "| gpt nocap 1.5x lms_residual against lms | 10 / 10 | 0.900 / 0.900 | +0.0% |" in report
    assert "Slower than 3% per sample on the head: none" in report
    base_record = json.loads((out / "base" / "gpt-nocap-1.5" / "nocap-gpt.json").read_text())
    head_record = json.loads((out / "head" / "gpt-nocap-1.5" / "nocap-gpt.json").read_text())
    assert [m["detail"] for m in base_record["measurements"]] == ["int x = 1;"]
    assert [m["detail"] for m in head_record["measurements"]] == ["int x = 2;", "int x = 2;"]
    assert (out / "ab.tgz").stat().st_size > 0
    log = (out / "run-ab.log").read_text()
    assert "== both builds done" in log and f"base engine {base[:7]}" in log
    # The base tree is a copy: this tree's engine is untouched.
    assert (repo / "engine" / "x.cpp").read_text() == "int x = 2;\n"
