"""examples/lmsstats.py: per-iteration rows from a synthetic statistics sequence, CSV, PNG."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from example_scripts import load

lmsstats = load("lmsstats")
COLUMNS = lmsstats.COLUMNS
LmsStatsLogger = lmsstats.LmsStatsLogger
read_csv = lmsstats.read_csv
snapshot_from = lmsstats.snapshot_from
summarize = lmsstats.summarize

MiB = 1 << 20


def lms_dict(out: int, inn: int, stall: float, host: int, pagedout: int, reclaims: int = 0):
    """A torch.cuda.lms_stats()-shaped dict with cumulative counters."""
    gauge = lambda v: {"current": v, "peak": v}  # noqa: E731
    return {
        "pageout_count": out // MiB,
        "pageout_bytes": out,
        "pagein_count": inn // MiB,
        "pagein_bytes": inn,
        "reclaim_limit": reclaims,
        "reclaim_speculative": 1,
        "reclaim_alloc_failure": 0,
        "reclaim_explicit": 0,
        "alloc_from_cache": 0,
        "alloc_from_device": 0,
        "alloc_after_reclaim": 0,
        "prefetch_count": 2,
        "prefetch_hits": 1,
        "stall_ms": stall,
        "oom_count": 0,
        "limit_bytes": 1 << 30,
        "managed_bytes": gauge(3 * MiB),
        "active_bytes": gauge(0),
        "inactive_bytes": gauge(0),
        "pagedout_bytes": gauge(pagedout),
        "host_bytes": gauge(host),
    }


class Fake:
    """A sampler and clock that replay a scripted sequence."""

    def __init__(self, snaps: list[dict[str, float]], times: list[float]) -> None:
        self.snaps, self.times = list(snaps), list(times)

    def sample(self) -> dict[str, float]:
        return self.snaps.pop(0)

    def clock(self) -> float:
        return self.times.pop(0)


def sequence() -> Fake:
    snaps = [
        snapshot_from(lms_dict(0, 0, 0.0, 0, 0), 100 * MiB, 200 * MiB),
        snapshot_from(
            lms_dict(64 * MiB, 16 * MiB, 5.5, 64 * MiB, 48 * MiB, 2), 150 * MiB, 256 * MiB
        ),
        snapshot_from(
            lms_dict(96 * MiB, 80 * MiB, 7.0, 96 * MiB, 16 * MiB, 3), 120 * MiB, 256 * MiB
        ),
        # the user reset the accumulated statistics: counters start again from 0
        snapshot_from(lms_dict(8 * MiB, 8 * MiB, 1.0, 96 * MiB, 16 * MiB, 1), 110 * MiB, 256 * MiB),
    ]
    return Fake(snaps, [10.0, 10.5, 11.25, 12.0])


def test_snapshot_without_lms_is_zero_for_lms_columns() -> None:
    snap = snapshot_from(None, 5, 7)
    assert snap["allocated_bytes"] == 5 and snap["reserved_bytes"] == 7
    assert all(snap[k] == 0 for k in lmsstats.COUNTERS)
    assert snap["host_bytes"] == 0


def test_rows_hold_deltas_and_gauges(tmp_path: Path) -> None:
    fake = sequence()
    path = tmp_path / "stats.csv"
    with LmsStatsLogger(path, sampler=fake.sample, clock=fake.clock) as log:
        assert log.step() is None  # the first call only opens the log
        rows = [log.step() for _ in range(3)]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["seconds"] for r in rows] == pytest.approx([0.5, 0.75, 0.75])
    assert [r["start_s"] for r in rows] == pytest.approx([0.0, 0.5, 1.25])
    assert [r["pageout_bytes"] for r in rows] == [64 * MiB, 32 * MiB, 8 * MiB]
    assert [r["pagein_bytes"] for r in rows] == [16 * MiB, 64 * MiB, 8 * MiB]
    assert [r["pageout_count"] for r in rows] == [64, 32, 8]
    assert [r["stall_ms"] for r in rows] == pytest.approx([5.5, 1.5, 1.0])
    assert [r["reclaims"] for r in rows] == [2, 1, 2]  # 1 speculative round in every snapshot
    assert [r["allocated_bytes"] for r in rows] == [150 * MiB, 120 * MiB, 110 * MiB]
    assert [r["pagedout_bytes"] for r in rows] == [48 * MiB, 16 * MiB, 16 * MiB]

    with path.open() as f:
        header = next(csv.reader(f))
    assert tuple(header) == COLUMNS
    back = read_csv(path)
    assert len(back) == 3
    for a, b in zip(rows, back):
        for key in COLUMNS:
            assert b[key] == pytest.approx(a[key], abs=1e-3)


def test_iteration_context_and_begin() -> None:
    fake = sequence()
    log = LmsStatsLogger(sampler=fake.sample, clock=fake.clock)
    with log.iteration():
        pass
    assert len(log.rows) == 1 and log.rows[0]["seconds"] == pytest.approx(0.5)
    assert log() is not None  # callback form: the iteration after the previous one
    assert len(log.rows) == 2


def test_summary_skips_warmup() -> None:
    fake = sequence()
    log = LmsStatsLogger(sampler=fake.sample, clock=fake.clock)
    for _ in range(4):
        log.step()
    s = summarize(log.rows, skip=1)
    assert s["iterations"] == 2
    assert s["total_pageout_bytes"] == 40 * MiB
    assert s["mean_pagein_bytes"] == 36 * MiB
    assert s["mean_seconds"] == pytest.approx(0.75)
    assert s["peak_host_bytes"] == 96 * MiB
    text = lmsstats.format_summary(s)
    assert "paged out:" in text and "0.04 GiB" in text
    assert lmsstats.format_summary(summarize([], 0)) == "no iterations"


def test_read_csv_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an LMS statistics CSV"):
        read_csv(bad)
    assert lmsstats.main(["summary", str(bad)]) == 2


def write_sequence(path: Path) -> None:
    fake = sequence()
    with LmsStatsLogger(path, sampler=fake.sample, clock=fake.clock) as log:
        for _ in range(4):
            log.step()


def test_plot_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib draws the PNG timeline")
    csv_path = tmp_path / "stats.csv"
    write_sequence(csv_path)
    png = tmp_path / "out" / "stats.png"
    assert lmsstats.main(["plot", str(csv_path), str(png), "--title", "synthetic"]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_plot_nothing_is_an_error(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib draws the PNG timeline")
    with pytest.raises(ValueError, match="nothing to plot"):
        lmsstats.plot_rows([], tmp_path / "x.png")


def test_summary_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path = tmp_path / "stats.csv"
    write_sequence(csv_path)
    assert lmsstats.main(["summary", str(csv_path), "--skip", "1"]) == 0
    out = capsys.readouterr().out
    assert "iterations:            2" in out
    assert lmsstats.main(["summary", str(csv_path), "--skip", "-1"]) == 2


def test_help_exits_cleanly() -> None:
    with pytest.raises(SystemExit) as info:
        lmsstats.main(["--help"])
    assert info.value.code == 0
