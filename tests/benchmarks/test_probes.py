"""benchmarks/nocap_probe.py, benchmarks/host_pinning.py and benchmarks/host_placed_kernels.py:
what runs without a GPU (the counter arithmetic, argument checks)."""

from __future__ import annotations

import ctypes
from typing import Any

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


def test_host_pinning_splits_a_buffer_into_whole_huge_pages_per_thread() -> None:
    mib = host_pinning.MiB
    assert host_pinning.thread_ranges(4 * mib, 8, 2 * mib) == [(0, 2 * mib), (2 * mib, 4 * mib)]
    assert host_pinning.thread_ranges(3 * mib, 1, 2 * mib) == [(0, 3 * mib)]
    shares = host_pinning.thread_ranges(256 * mib, 8, 2 * mib)
    assert len(shares) == 8 and all(e - b == 32 * mib for b, e in shares)
    assert shares[-1][1] == 256 * mib
    # Sizes that do not split evenly: every byte once, no empty share, at most 8.
    shares = host_pinning.thread_ranges(37 * mib, 8, 2 * mib)
    assert len(shares) <= 8 and shares[0][0] == 0 and shares[-1][1] == 37 * mib
    assert all(b < e for b, e in shares)
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))


def test_host_pinning_registers_aligned_populated_mappings() -> None:
    """The register path on the CPU, with the runtime faked: each buffer is registered once
    at a huge-page boundary, after its pages were faulted in (readable as zeros), and
    unregistered after the measurement."""
    calls: list[tuple[str, int, int]] = []

    class FakeRuntime:
        def cudaHostRegister(self, ptr: Any, size: Any, flags: Any) -> int:
            calls.append(("register", ptr.value, size.value))
            # The pages are there: read the first and last byte of the buffer.
            assert ctypes.c_char.from_address(ptr.value).value == b"\x00"
            assert ctypes.c_char.from_address(ptr.value + size.value - 1).value == b"\x00"
            return 0

        def cudaHostUnregister(self, ptr: Any) -> int:
            calls.append(("unregister", ptr.value, 0))
            return 0

    mib = host_pinning.MiB
    populate = host_pinning.Populator()
    elapsed = host_pinning.time_register(
        FakeRuntime(),  # type: ignore[arg-type]
        [4 * mib, 3 * mib],
        2,
        True,
        populate,
    )
    assert elapsed > 0 and populate.how in ("MADV_POPULATE_WRITE", "memset")
    registered = [c for c in calls if c[0] == "register"]
    assert [size for _, _, size in registered] == [4 * mib, 3 * mib]
    assert all(ptr % host_pinning.HUGE_PAGE == 0 for _, ptr, _ in registered)
    assert [c[1] for c in calls if c[0] == "unregister"] == [ptr for _, ptr, _ in registered]


def test_host_pinning_takes_a_list_of_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    args = host_pinning.build_parser().parse_args(["--buffer-mib", "2,32", "--no-huge-pages"])
    assert args.buffer_mib == [2, 32] and not args.huge_pages
    with pytest.raises(SystemExit):
        host_pinning.build_parser().parse_args(["--buffer-mib", "4,x"])
    assert "whole MiB, comma-separated" in capsys.readouterr().err


def test_host_placed_kernels_names_its_cases_when_one_is_unknown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        host_placed_kernels.main(["--case", "no_such_case"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case(s) no_such_case" in err
    assert "conv2d_fp32_b103_c32_128" in err and "cudnn_lstm_fwd_bwd" in err
