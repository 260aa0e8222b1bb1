"""benchmarks.ab: two engines' compare.py runs of one call, row by row (no GPU: synthetic
records in compare.py's JSON layout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import ab


def _row(
    method: str, times: list[float], batch: int = 10, phases: dict[str, Any] | None = None
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "method": method,
        "factor": 1.5,
        "batch": batch,
        "status": "ok",
        "iteration_times": times,
    }
    if phases is not None:
        row["profile"] = {"iterations": 1, "phases": phases}
    return row


def _write(folder: Path, engine: str, rows: list[dict[str, Any]], model: str = "gpt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "environment": {"engine_commit": engine, "engine_dirty": False},
        "regime": "nocap",
        "config": {"model": model},
        "measurements": [
            {"method": "baseline", "factor": None, "status": "ok", "batch": 4},
            *rows,
            {"method": "no_lms", "factor": 1.5, "status": "skipped", "batch": 0},
        ],
    }
    (folder / f"nocap-{model}.json").write_text(json.dumps(record))
    return folder


def _phase(busy: float, idle: float) -> dict[str, float]:
    return {"busy_ms": busy, "idle_while_copying_ms": idle, "span_ms": busy + idle}


def test_rows_are_set_side_by_side_per_sample_with_their_phases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slow_start = _row("lms", [1.0, 1.2, 1.1], phases={"forward": _phase(180, 88)})
    slow_start["warmup_times"] = [2.5, 1.2, 1.1]
    slow_start["first_iteration"] = {"host_pin_ms": 1200.0}
    base = _write(tmp_path / "base", "a" * 40, [slow_start])
    # The head got a larger batch (more memory free): compared per sample.
    head = _write(
        tmp_path / "head",
        "b" * 40,
        [
            _row("lms", [1.2, 1.0, 1.0], batch=11, phases={"forward": _phase(181, 30)})
            | {"first_iteration_s": 1.5},
            _row("lms_residual", [0.9, 0.9, 0.9], batch=11),
            _row("checkpoint", [0.7, 0.7, 0.7], batch=11),
        ],
    )
    assert (
        ab.main(
            [str(base), str(head), "--pair", "lms_residual=lms", "--out", str(tmp_path / "r.md")]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text == (tmp_path / "r.md").read_text()
    assert "Base engine aaaaaaa; head engine bbbbbbb" in text
    # 1.1 s for 10 samples against 1.0 s for 11: 0.11 against 0.0909 s per sample.
    assert (
        "| gpt nocap 1.5x lms | 10 / 11 | 1.100 / 1.000 | -17.4% | 2.50 (1200 ms pinning) / "
        "1.50 | 180 / 181; 88 / 30 |" in text
    )
    assert "| gpt nocap 1.5x lms_residual against lms | 11 / 11 | 1.000 / 0.900 | -10.0% | " in text
    assert "head only: gpt nocap 1.5x checkpoint" in text
    assert "head only: gpt nocap 1.5x lms_residual" in text
    assert "no_lms" not in text  # skipped rows are no rows


def test_a_slower_lms_row_fails_the_rule_given_and_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _write(tmp_path / "base", "a" * 40, [_row("lms", [1.0]), _row("checkpoint", [1.0])])
    head = _write(tmp_path / "head", "b" * 40, [_row("lms", [1.04]), _row("checkpoint", [1.2])])
    assert ab.main([str(base), str(head), "--max-slowdown", "5"]) == 0
    assert "Slower than 5% per sample on the head: none" in capsys.readouterr().out
    # Checkpointing is no LMS row: its 20% is reported, not judged.
    assert ab.main([str(base), str(head), "--max-slowdown", "3"]) == 1
    out = capsys.readouterr().out
    assert "Slower than 3% per sample on the head: gpt nocap 1.5x lms: +4.0% per sample" in out


def test_a_row_that_failed_on_one_side_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _write(tmp_path / "base", "a" * 40, [_row("lms", [1.0])])
    failed = _row("lms", [])
    failed["status"] = "oom"
    head = _write(tmp_path / "head", "b" * 40, [failed])
    assert ab.main([str(base), str(head), "--max-slowdown", "3"]) == 0
    assert "| gpt nocap 1.5x lms | 10 / 10 | 1.000 / oom |  |" in capsys.readouterr().out


def test_bad_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ab.main([str(tmp_path / "missing"), str(tmp_path)]) == 2
    assert "no folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert ab.main([str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    assert "no compare.py results" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.build_parser().parse_args(["a", "b", "--pair", "lms"])
    assert "--pair wants METHOD=AGAINST" in capsys.readouterr().err
