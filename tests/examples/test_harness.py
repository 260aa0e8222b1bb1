"""benchmarks/harness.py: a workload in a process of its own, shared options, one record
schema with provenance; compare.py and compile_peers.py use it."""

from __future__ import annotations

import argparse
import csv
import json
import textwrap
from pathlib import Path
from types import ModuleType

import compare
import compile_peers
import harness
import pytest

WORKER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {benchmarks!r})
    import harness

    def run(spec):
        if spec["mode"] == "sleep":
            time.sleep(60)
        if spec["mode"] == "crash":
            print("dying now")
            sys.exit(7)
        return {{"status": "ok", "detail": "done", "value": spec["value"] * 2}}

    if __name__ == "__main__":
        sys.exit(harness.serve_worker(__import__("pathlib").Path(sys.argv[2]), run))
    """
)


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(benchmarks=str(harness.HERE)))
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
