"""The recompute log summary counts each kind of engine line by reason, with its bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.recompute_log import main, render, summarize

LOG = """\
some other output
LMS recompute: victim of 1048576 bytes: no recipe
LMS recompute: victim of 2097152 bytes: no recipe
LMS recompute: victim of 4194304 bytes: has a recipe
LMS recompute: 4194304 bytes: recompute 0.500 ms, paging 0.200 ms (stall share 1.00): paged out
LMS recompute: 4194304 bytes: recompute 0.100 ms, paging 0.200 ms (stall share 1.00): dropped
LMS recompute: 4194304 bytes: recompute -1.000 ms, paging 0.200 ms (stall share 1.00): paged out
LMS recompute: candidate of 8388608 bytes, next use in 12 operators: recompute 0.010 ms, \
paging 0.400 ms: drop first
LMS recompute: aten::gelu cannot be recomputed now: a running operator uses an input
LMS recompute: aten::gelu cannot be recomputed now: a running operator uses an input
LMS recompute: aten::add_ extends the recipe of aten::batch_norm
LMS recompute: something new
"""


def test_lines_are_counted_by_kind_and_reason() -> None:
    s = summarize(LOG.splitlines())
    assert s.lines == 11 and s.other == 1
    assert s.victims.count["no recipe"] == 2
    assert s.victims.bytes["no recipe"] == 3 * 2**20
    assert s.priced.count["paged out (replay dearer than paging)"] == 1
    assert s.priced.count["dropped"] == 1
    assert s.priced.count["paged out (no price)"] == 1
    assert s.candidates.bytes["drop first"] == 8 * 2**20
    assert s.cannot.count["aten::gelu: a running operator uses an input"] == 2
    assert s.steps.count["aten::add_ extends aten::batch_norm"] == 1
    text = render(s)
    assert "victims a reclaim chose:" in text and "0.00 GiB" in text


def test_cli_reads_a_file_and_refuses_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "recompute.log"
    log.write_text(LOG)
    assert main([str(log)]) == 0
    assert "11 recompute log lines (1 not understood)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.log")])
    assert "no such log file" in capsys.readouterr().err
