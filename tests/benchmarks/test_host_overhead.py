"""benchmarks/host_overhead.py: its command line and the summary of its rounds, no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import host_overhead
from benchmarks.host_overhead import parse_args, summarize


def row(config: str, size: str, us_per_iter: float, operators: int = 100) -> dict[str, object]:
    return {
        "config": config,
        "size": size,
        "operators": operators,
        "us_per_iter": us_per_iter,
        "us_per_op": us_per_iter / operators,
    }


def test_summary_takes_the_median_of_the_rounds_and_the_difference_from_off() -> None:
    raw = [
        row("off", "small", 1000.0),
        row("on", "small", 1500.0),
        row("off", "small", 1400.0),  # a slow round: the median ignores it
        row("on", "small", 1300.0),
        row("off", "small", 1100.0),
        row("on", "small", 1400.0),
    ]
    rows = {r["config"]: r for r in summarize(raw)}
    assert rows["off"]["us_per_iter"] == 1100.0
    assert rows["on"]["us_per_iter"] == 1400.0
    assert rows["on"]["rounds"] == 3
    assert rows["on"]["us_per_op"] == pytest.approx(14.0)
    assert rows["on"]["extra_us_per_op"] == pytest.approx(3.0)
    assert rows["on"]["vs_off"] == pytest.approx(1400 / 1100, abs=1e-3)
    assert rows["off"]["spread"] == pytest.approx((1400 - 1000) / 1100, abs=1e-3)


def test_summary_compares_each_size_with_its_own_off_row() -> None:
    raw = [
        row("off", "small", 1000.0),
        row("on", "small", 1200.0),
        row("off", "managed", 2000.0),
        row("on", "managed", 2100.0),
    ]
    rows = {(r["config"], r["size"]): r for r in summarize(raw)}
    assert rows[("on", "small")]["extra_us_per_op"] == pytest.approx(2.0)
    assert rows[("on", "managed")]["extra_us_per_op"] == pytest.approx(1.0)


def test_summary_keeps_a_configuration_that_failed_in_every_round() -> None:
    raw = [row("off", "small", 1000.0), {"config": "on", "size": "small", "error": "exit 1: boom"}]
    rows = {r["config"]: r for r in summarize(raw)}
    assert rows["on"] == {"config": "on", "size": "small", "error": "exit 1: boom"}
    assert rows["off"]["extra_us_per_op"] == 0.0


def test_unknown_configuration_is_refused_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--configs", "on,fast"])
    err = capsys.readouterr().err
    assert "'fast'" in err and "no_schedule" in err


def test_every_configuration_and_size_is_measured_by_default() -> None:
    args = parse_args([])
    assert args.configs == list(host_overhead.CONFIGS)
    assert args.sizes == list(host_overhead.THRESHOLDS)
    assert args.rounds >= 2


def test_results_hold_the_summary_and_every_round(tmp_path: Path) -> None:
    raw = [row("off", "small", 1000.0), row("on", "small", 1500.0)]
    host_overhead.write_results(tmp_path, summarize(raw), raw)
    written = json.loads((tmp_path / "host-overhead.json").read_text())
    assert [r["config"] for r in written["rounds"]] == ["off", "on"]
    assert {r["config"] for r in written["rows"]} == {"off", "on"}
    assert "torch" in written
    lines = (tmp_path / "host-overhead.csv").read_text().splitlines()
    assert lines[0].startswith("config,size") and len(lines) == 3
