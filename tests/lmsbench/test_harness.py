"""lmsbench/harness.py: a workload in a process of its own, shared options, one record
schema with provenance; compare.py, compile_peers.py, the stress suite and the regression
matrix use it."""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks import compare, compile_peers
from lmsbench import harness

WORKER = textwrap.dedent(
    """
    import sys, time
    from lmsbench import harness

    def run(spec):
        if spec["mode"] == "sleep":
            time.sleep(60)
        if spec["mode"] == "crash":
            print("dying now")
            sys.exit(7)
        return {"status": "ok", "detail": "done", "value": spec["value"] * 2}

    if __name__ == "__main__":
        sys.exit(harness.serve_worker(__import__("pathlib").Path(sys.argv[2]), run))
    """
)


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


def test_run_worker_returns_what_the_worker_wrote(worker: Path, tmp_path: Path) -> None:
    result = harness.run_worker(
        worker, {"mode": "ok", "value": 21}, tmp_path / "logs" / "a.log", {}, 60
    )
    assert result == {"status": "ok", "detail": "done", "value": 42}
    assert json.loads((tmp_path / "logs" / "a.spec.json").read_text())["value"] == 21
    assert "ok done" in (tmp_path / "logs" / "a.log").read_text()


def test_run_worker_timeout_and_crash(worker: Path, tmp_path: Path) -> None:
    slow = harness.run_worker(worker, {"mode": "sleep"}, tmp_path / "b.log", {}, 1)
    assert slow == {"status": "timeout", "detail": "stopped after 1 s"}
    crash = harness.run_worker(worker, {"mode": "crash"}, tmp_path / "c.log", {}, 60)
    assert crash["status"] == "error"
    assert "exited with 7 and no result: dying now" in crash["detail"]


def test_deadline() -> None:
    now = [100.0]
    deadline = harness.Deadline(10, clock=lambda: now[0])
    now[0] = 104.0
    assert deadline.left() == 6.0


def test_records_carry_provenance(tmp_path: Path) -> None:
    old = {"device": "GPU", "torch": "9.9", "cuda": None, "date": "d"}
    new = {**old, "engine_commit": "abc", "engine_dirty": False, "driver": "580"}
    assert harness.csv_env_columns(old) == harness.ENV_COLUMNS
    assert harness.csv_env_columns(new) == harness.RECORD_ENV_COLUMNS
    assert compare.NOCAP_ENV_COLUMNS == harness.RECORD_ENV_COLUMNS
    path = tmp_path / "x.csv"
    harness.write_csv(path, ("a",), [{"a": "1"}], new, harness.csv_env_columns(new))
    with path.open(newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row == {
        "a": "1",
        "device": "GPU",
        "torch": "9.9",
        "cuda": "None",
        "lms_backend": "",
        "date": "d",
        "driver": "580",
        "engine_commit": "abc",
        "engine_dirty": "False",
    }
    harness.write_json(tmp_path / "x.json", {"environment": new})
    assert json.loads((tmp_path / "x.json").read_text())["environment"]["engine_commit"] == "abc"
    assert not list(tmp_path.glob(".*.tmp"))


def test_record_environment_has_provenance() -> None:
    pytest.importorskip("torch", reason="versions() reads torch's")
    env = harness.record_environment(device=False)
    for key in ("torch", "cuda", "date", "engine_commit", "engine_dirty", "driver"):
        assert key in env, key
    assert len(env["engine_sources_sha256"]) == 64


def test_compile_peers_csv_names_the_engine(tmp_path: Path) -> None:
    env = {"device": "GPU", "torch": "9.9", "date": "d", "engine_commit": "abc"}
    env["engine_dirty"] = False
    compile_peers.write_outputs(tmp_path, [], env, None, {})
    with (tmp_path / compile_peers.CSV_NAME).open(newline="") as f:
        header = next(csv.reader(f))
    assert header[-3:] == ["driver", "engine_commit", "engine_dirty"]
    data = json.loads((tmp_path / compile_peers.JSON_NAME).read_text())
    assert data["environment"]["engine_commit"] == "abc"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.add_out_option(parser, Path("out/x"))
    harness.add_gpt_options(parser, layers=2, dim=8, heads=2, seq=16, vocab=32)
    harness.add_amp_option(parser)
    harness.add_step_options(
        parser, warmup=1, iterations=3, warmup_help="w", iterations_help="i", min_warmup=1
    )
    harness.add_time_budget_option(parser, 60.0, "rows", "more")
    return parser.parse_args(list(argv))


def test_shared_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse()
    assert (args.out, args.gpt_layers, args.gpt_seq, args.amp) == (Path("out/x"), 2, 16, False)
    assert (args.warmup, args.iterations, args.time_budget_s) == (1, 3, 60.0)
    with pytest.raises(SystemExit):
        parse("--warmup", "0")  # min_warmup 1
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("tool", [compare, compile_peers])
def test_tools_declare_the_shared_options_once(tool: ModuleType) -> None:
    """compare.py and compile_peers.py take the shared options under one name each."""
    parser: argparse.ArgumentParser = tool.build_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    for name in ("--out", "--gpt-layers", "--gpt-seq", "--amp", "--warmup", "--iterations"):
        assert name in options
    assert "--time-budget-s" in options and "--size-mb" in options


# A process that starts a child in its own process group, says the child's pid, and sleeps.
PARENT_OF_A_SLEEPER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path(sys.argv[1]).write_text(str(child.pid))
    print("started", flush=True)
    time.sleep(60)
    """
)


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` ended (or is a zombie waiting for its parent) within ``within_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_run_process_stops_the_whole_group_at_its_limit(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_OF_A_SLEEPER)
    pid_file = tmp_path / "child.pid"
    command = [sys.executable, str(script), str(pid_file)]
    run = harness.run_process(command, tmp_path / "logs" / "p.log", dict(os.environ), 3, grace_s=0)
    assert run.timed_out and run.returncode == -signal.SIGKILL
    assert 2.5 < run.wall_s < 30
    assert gone(int(pid_file.read_text())), "the child outlived its group's stop"
    assert harness.log_tail(tmp_path / "logs" / "p.log") == "started\n"
    quick = harness.run_process(
        [sys.executable, "-c", "import sys; sys.exit(4)"], tmp_path / "q.log", {}, 30
    )
    assert (quick.returncode, quick.timed_out) == (4, False)


def test_wait_pid_kills_a_forked_childs_group(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_OF_A_SLEEPER)
    pid_file = tmp_path / "child.pid"
    pid = os.fork()
    if pid == 0:  # the forked child: a group of its own, then the parent of a sleeper
        try:
            os.setpgid(0, 0)
            os.execv(sys.executable, [sys.executable, str(script), str(pid_file)])
        finally:
            os._exit(70)
    run = harness.wait_pid(pid, 3)
    assert run.timed_out and run.returncode == -signal.SIGKILL
    assert gone(int(pid_file.read_text()))
    pid = os.fork()
    if pid == 0:
        os._exit(5)
    run = harness.wait_pid(pid, 30)
    assert (run.returncode, run.timed_out) == (5, False)


def test_reading_what_a_run_left(tmp_path: Path) -> None:
    assert harness.read_json(tmp_path / "missing.json") is None
    (tmp_path / "half.json").write_text('{"status": "o')
    assert harness.read_json(tmp_path / "half.json") is None
    harness.write_json(tmp_path / "deep" / "ok.json", {"status": "ok"})
    assert harness.read_json(tmp_path / "deep" / "ok.json") == {"status": "ok"}
    (tmp_path / "log").write_bytes(b"x" * 10 + b"tail \xff")
    assert harness.log_tail(tmp_path / "log", 6) == "tail \ufffd"
    assert harness.log_tail(tmp_path / "none") == ""
    assert harness.signal_name(9) == "SIGKILL" and harness.signal_name(999) == "signal 999"


def test_worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in harness.worker_env()
    env = harness.worker_env(deterministic=True, EXTRA="1")
    assert env["PYTHONUNBUFFERED"] == "1" and env["EXTRA"] == "1"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert harness.worker_env(deterministic=True)["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_rows_carry_the_provenance_of_their_session() -> None:
    env = {"engine_commit": "0123456789abcdef", "engine_dirty": True, "device": "GPU"}
    own, plain = harness.with_provenance([{"device": "H200"}, {}], env)
    assert own["device"] == "H200" and plain["device"] == "GPU"
    assert plain["driver"] == "unknown" and set(harness.RECORD_PROVENANCE) <= set(plain)
    assert harness.engine_words(env) == "engine 0123456789ab (tree with changes)"
    assert harness.engine_words({}) == "engine not recorded"
    assert harness.engine_words({"engine_commit": "abc", "engine_dirty": False}) == "engine abc"


def test_record_environment_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_torch(device: bool = True) -> dict[str, object]:
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(harness, "versions", no_torch)
    env = harness.record_environment()
    assert {"date", "host", "python", "engine_commit"} <= set(env) and "torch" not in env
