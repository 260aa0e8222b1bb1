"""benchmarks/observer_cost.py: its summary and command line, no GPU."""

from __future__ import annotations

import pytest

from benchmarks import observer_cost


def test_summary_gives_medians_and_the_difference_from_no_callback() -> None:
    rows = {
        r["config"]: r
        for r in observer_cost.summarize(
            {"plain": [10.0, 12.0, 11.0], "inputs_outputs": [14.0, 13.0, 20.0]}
        )
    }
    assert rows["plain"]["us_per_op"] == 11.0
    assert rows["inputs_outputs"]["us_per_op"] == 14.0
    assert rows["inputs_outputs"]["extra_us_per_op"] == pytest.approx(3.0)
    assert rows["inputs_outputs"]["rounds"] == 3


def test_without_a_gpu_it_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run")
    assert observer_cost.main(["--rounds", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
