"""benchmarks/nocap_probe.py, benchmarks/host_pinning.py and benchmarks/host_placed_kernels.py:
what runs without a GPU (the counter arithmetic, argument checks)."""

from __future__ import annotations

import pytest

from benchmarks import host_pinning, host_placed_kernels, nocap_probe

GiB = 1 << 30


def _snap(**over: float) -> dict[str, float]:
    base = {k: 0 for k in (*nocap_probe.ALLOCATOR_KEYS, *nocap_probe.LMS_KEYS)}
    base.update(reserved=0, allocated=0, limit=0, host=0)
    base.update(over)
    return base


def test_delta_counts_counters_and_reads_gauges() -> None:
    before = _snap(pageout_bytes=2 * GiB, num_device_alloc=10, stall_ms=5.0, reserved=GiB)
    after = _snap(
        pageout_bytes=5 * GiB,
        num_device_alloc=13,
        stall_ms=7.5,
        reserved=3 * GiB,
        host=4 * GiB,
        schedule_active=1,
    )
    d = nocap_probe.delta(before, after)
    assert d["pageout_bytes"] == 3.0  # GiB in this iteration
    assert d["num_device_alloc"] == 3
    assert d["stall_ms"] == 2.5
    assert d["reserved"] == 3.0  # a gauge: as read, not the change
    assert d["host"] == 4.0
    assert d["schedule_active"] == 1


@pytest.mark.parametrize(
    "argv", [["--batch", "0"], ["--iterations", "0"], ["--profile-iterations", "-1"]]
)
def test_nocap_probe_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        nocap_probe.main(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("argv", [["--total-gib", "0"], ["--threads", "0"], ["--buffer-mib", "-1"]])
def test_host_pinning_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        host_pinning.main(argv)
    assert exc.value.code == 2


def test_host_placed_kernels_names_its_cases_when_one_is_unknown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        host_placed_kernels.main(["--case", "no_such_case"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case(s) no_such_case" in err
    assert "conv2d_fp32_b103_c32_128" in err and "cudnn_lstm_fwd_bwd" in err
