"""lmsbench/search.py: the largest-value search of ManyModel.py and compare.py, with fake and
real probes."""

from __future__ import annotations

import sys

import pytest

from lmsbench.lms_setup import EXIT_OOM
from lmsbench.search import (
    Outcome,
    Probe,
    ProbeError,
    classify_exit,
    find_largest,
    subprocess_probe,
)


def threshold_probe(limit: int, calls: list[int] | None = None):
    def probe(value: int) -> Probe:
        if calls is not None:
            calls.append(value)
        return Probe(value, Outcome.FITS if value <= limit else Outcome.OOM)

    return probe


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 9, 31, 100, 1000])
@pytest.mark.parametrize("start", [1, 4, 16, 500])
def test_finds_exact_threshold(limit: int, start: int) -> None:
    result = find_largest(threshold_probe(limit), start, upper=4096)
    assert result.largest == limit
    assert result.exact
    assert "upper bound" not in result.describe()


def test_probe_count_is_logarithmic_and_no_value_is_probed_twice() -> None:
    calls: list[int] = []
    result = find_largest(threshold_probe(777, calls), 8, upper=1 << 20)
    assert result.largest == 777
    assert len(calls) == len(set(calls))
    assert len(calls) <= 2 * 10 + 2  # 7 doublings to 1024, then 8 bisections of [512, 1024]


def test_nothing_fits() -> None:
    result = find_largest(threshold_probe(0), 64)
    assert result.largest == 0
    assert result.describe().startswith("nothing trains")
    assert [p.value for p in result.probes] == [64, 32, 16, 8, 4, 2, 1]


def test_upper_bound_reached_is_a_lower_bound() -> None:
    result = find_largest(threshold_probe(10**9), 3, upper=50)
    assert result.largest == 50
    assert result.upper_bound_hit and not result.exact
    assert result.describe() == ">= 50 (upper bound reached)"


def test_start_is_clamped_into_range() -> None:
    calls: list[int] = []
    result = find_largest(threshold_probe(20, calls), 1000, lower=2, upper=64)
    assert calls[0] == 64
    assert result.largest == 20
    calls.clear()
    assert find_largest(threshold_probe(20, calls), 0, lower=2, upper=64).largest == 20
    assert calls[0] == 2


def test_relative_tolerance_stops_early_with_a_value_that_fits() -> None:
    exact_calls: list[int] = []
    loose_calls: list[int] = []
    find_largest(threshold_probe(1000, exact_calls), 16, upper=1 << 20)
    loose = find_largest(threshold_probe(1000, loose_calls), 16, upper=1 << 20, rel_tol=0.1)
    assert len(loose_calls) < len(exact_calls)
    assert 1000 / 1.1 <= loose.largest <= 1000


def test_timeout_counts_as_not_fitting() -> None:
    def probe(value: int) -> Probe:
        return Probe(value, Outcome.FITS if value <= 5 else Outcome.TIMEOUT)

    result = find_largest(probe, 1, upper=100)
    assert result.largest == 5
    assert "timed out" in result.describe()


def test_error_aborts_the_search() -> None:
    def probe(value: int) -> Probe:
        if value > 8:
            return Probe(value, Outcome.ERROR, detail="ImportError: no torchvision")
        return Probe(value, Outcome.FITS)

    with pytest.raises(ProbeError, match="no torchvision") as info:
        find_largest(probe, 4)
    assert info.value.probe.value == 16


def test_budget_stops_with_a_lower_bound() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    def probe(value: int) -> Probe:
        now[0] += 10.0  # every probe takes 10 s
        return Probe(value, Outcome.FITS if value <= 300 else Outcome.OOM)

    result = find_largest(probe, 1, upper=4096, budget_s=35.0, clock=clock)
    assert result.budget_exhausted and not result.exact
    assert len(result.probes) == 4  # 1, 2, 4, 8: the budget ran out after the fourth
    assert result.largest == 8
    assert result.describe().startswith(">= 8")


@pytest.mark.parametrize(("lower", "upper", "tol"), [(0, 10, 0.0), (5, 4, 0.0), (1, 10, -0.1)])
def test_bad_arguments(lower: int, upper: int, tol: float) -> None:
    with pytest.raises(ValueError):
        find_largest(threshold_probe(3), 1, lower=lower, upper=upper, rel_tol=tol)


def test_classify_exit() -> None:
    assert classify_exit(0) is Outcome.FITS
    assert classify_exit(EXIT_OOM) is Outcome.OOM
    assert classify_exit(1) is Outcome.ERROR
    assert classify_exit(-9) is Outcome.ERROR


def test_subprocess_probe_runs_real_processes() -> None:
    # A stand-in training script: "fits" up to 6, "out of memory" above, crashes at 99.
    script = (
        "import sys; v = int(sys.argv[1]);"
        f"sys.exit(1 if v == 99 else (0 if v <= 6 else {EXIT_OOM}))"
    )
    lines: list[str] = []
    probe = subprocess_probe(lambda v: [sys.executable, "-c", script, str(v)], 60, log=lines.append)
    assert find_largest(probe, 2, upper=64).largest == 6
    assert any("probe 8: oom" in line for line in lines)
    crashed = probe(99)
    assert crashed.outcome is Outcome.ERROR and "exit status 1" in crashed.detail


def test_subprocess_probe_timeout() -> None:
    probe = subprocess_probe(lambda v: [sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert probe(1).outcome is Outcome.TIMEOUT
