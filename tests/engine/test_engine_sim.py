"""The LMS engine suite (tests/engine/test_lms_engine.cpp) on the simulated GPU, against
libc10_cuda built from each tag's patched source (once per tag with a series, see conftest.py);
the same binary runs on a real GPU."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def executable(build: Path, name: str) -> Path:
    for candidate in (build / name, build / "bin" / name):
        if candidate.is_file():
            return candidate
    found = sorted(build.rglob(name))
    if not found:
        raise AssertionError(f"{name} was not built in {build}")
    return found[0]


SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed(?:, (\d+) skipped)?$", re.M)


def run_suite(binary: Path, env: dict[str, str], *args: str) -> tuple[str, int, int, int]:
    proc = subprocess.run(
        [str(binary), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    match = SUMMARY.search(proc.stdout)
    assert match, f"no summary line (exit {proc.returncode}):\n{out[-8000:]}"
    passed, failed, skipped = (int(g or 0) for g in match.groups())
    assert proc.returncode == (0 if failed == 0 else 1), out[-8000:]
    return out, passed, failed, skipped


def test_engine_suite_on_one_simulated_device(sim_build: Path) -> None:
    out, passed, failed, skipped = run_suite(
        executable(sim_build, "test_lms_engine"),
        {"SIMGPU_DEVICE_COUNT": "1", "SIMGPU_CAPACITY_MB": "256"},
    )
    assert failed == 0, out[-8000:]
    # Only the multi-device test may skip, and only for want of a second device.
    assert skipped <= 1, out
    assert passed >= 24, out


def test_engine_suite_on_two_simulated_devices(sim_build: Path) -> None:
    out, passed, failed, skipped = run_suite(
        executable(sim_build, "test_lms_engine"),
        {"SIMGPU_DEVICE_COUNT": "2", "SIMGPU_CAPACITY_MB": "256"},
        "--filter",
        "devices_reclaim_independently",
        "--filter",
        "multithreaded",
    )
    assert (failed, skipped) == (0, 0), out[-8000:]
    assert passed == 2, out


def test_pack_log_says_what_was_decided_and_what_was_measured(sim_build: Path) -> None:
    """PYTORCH_LMS_PACK_LOG=1: a line for every tight operator's decision with its figures,
    and one whenever an operator measures its inside bytes at an input size for the first
    time (or a page more than before), so that an expectation can be checked against what
    came. Two packing cases of tests/engine/test_lms_engine.cpp under caps of 64 and 128 MiB,
    where every operator leaves less than 200 MiB of the limit and so is judged: one packed
    after its first run, one whose third call is expected to need what it measured at that
    size and is not packed."""
    out, passed, failed, _ = run_suite(
        executable(sim_build, "test_lms_engine"),
        {"SIMGPU_DEVICE_COUNT": "1", "SIMGPU_CAPACITY_MB": "256", "PYTORCH_LMS_PACK_LOG": "1"},
        "--filter",
        "an_operator_expected_to_need_most_of_the_device_is_packed_first",
        "--filter",
        "an_operator_is_expected_to_allocate_what_it_did_with_inputs_of_that_size",
    )
    assert (passed, failed) == (2, 0), out[-8000:]
    lines = [line for line in out.splitlines() if line.startswith("LMS pack: ")]
    most = "lms_test::needs_most_of_the_device"
    many = "lms_test::matmul_of_many_shapes"
    # Its first run, with room beside its input, then what it measured, then its pack.
    first, measured_most, packed = [line for line in lines if f" {most}: " in line]
    assert first.startswith(f"LMS pack: not packed {most}: inputs 4.0 MiB, "), lines
    assert measured_most == (
        f"LMS pack: measured {most}: inputs 4.0 MiB, inside 42.0 MiB (first at this size)"
    ), lines
    assert packed.startswith(
        f"LMS pack: packed {most}: inputs 4.0 MiB, expected inside 42.0 MiB in 2 blocks, "
    ), lines
    measured = [line for line in lines if line.startswith(f"LMS pack: measured {many}:")]
    assert measured == [
        f"LMS pack: measured {many}: inputs 4.0 MiB, inside 36.0 MiB (first at this size)",
        f"LMS pack: measured {many}: inputs 40.0 MiB, inside 40.0 MiB (first at this size)",
    ], lines
    # Its 40 MiB call, not measured yet at that size, is judged per byte of input and packed;
    # the next, measured at that size, is expected to need 40 MiB and is not. Each allocated
    # one block of 1 MiB or more, and is spared a page for it.
    decided = [line for line in lines if f" {many}: inputs 40.0 MiB, expected" in line]
    assert [line.split(", not reclaimable")[0] for line in decided] == [
        f"LMS pack: packed {many}: inputs 40.0 MiB, expected inside 360.0 MiB in 1 block",
        f"LMS pack: not packed {many}: inputs 40.0 MiB, expected inside 40.0 MiB in 1 block",
    ], lines


def test_learned_swap_schedule_on_a_simulated_device(sim_build: Path) -> None:
    """Period detection, next-use victims, early page-out and page-in ahead of use
    (tests/engine/test_lms_schedule.cpp)."""
    out, passed, failed, skipped = run_suite(
        executable(sim_build, "test_lms_schedule"),
        {"SIMGPU_DEVICE_COUNT": "1", "SIMGPU_CAPACITY_MB": "256"},
    )
    assert (failed, skipped) == (0, 0), out[-8000:]
    assert passed >= 7, out


def test_host_tier_on_a_simulated_device(sim_build: Path) -> None:
    """The host budget for pinned memory, the ledger that LMS processes share (two processes:
    the suite runs itself a second time), and the out-of-memory error a refused page-out
    becomes (tests/engine/test_lms_host.cpp)."""
    out, passed, failed, skipped = run_suite(
        executable(sim_build, "test_lms_host"),
        {"SIMGPU_DEVICE_COUNT": "1", "SIMGPU_CAPACITY_MB": "256"},
    )
    assert (failed, skipped) == (0, 0), out[-8000:]
    assert passed >= 14, out


def test_disk_tier_on_a_simulated_device(sim_build: Path) -> None:
    """The spill directory under the host budget: read-back identity, its bound, the errors
    for directories that cannot serve, the removal of a killed process's files by the next
    process (the suite runs itself twice more), and a failed write that keeps the host copy
    (tests/engine/test_lms_spill.cpp)."""
    out, passed, failed, skipped = run_suite(
        executable(sim_build, "test_lms_spill"),
        {"SIMGPU_DEVICE_COUNT": "1", "SIMGPU_CAPACITY_MB": "256"},
    )
    assert (failed, skipped) == (0, 0), out[-8000:]
    assert passed == 5, out


def test_simgpu_selftest_and_unpatched_allocator_smoke(sim_build: Path) -> None:
    for name in ("simgpu_selftest", "simgpu_c10_smoke"):
        out, _, failed, _ = run_suite(executable(sim_build, name), {})
        assert failed == 0, out[-8000:]


def run_benchmark(
    sim_build: Path, name: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs one of benchmarks/engine's programs of the build."""
    return subprocess.run(
        [str(executable(sim_build, name)), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def test_copy_benchmark_runs(sim_build: Path) -> None:
    """The throughput benchmark runs end to end (figures on a simulated GPU mean nothing)."""
    proc = run_benchmark(
        sim_build,
        "bench_lms_copy",
        "--min-size",
        str(1 << 20),
        "--max-size",
        str(4 << 20),
        "--total",
        str(16 << 20),
        "--repeat",
        "1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^\s+1 MiB\s+\d+ \|", proc.stdout, re.M), proc.stdout
    assert "LMS totals:" in proc.stdout


def run_host_benchmark(sim_build: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """bench_lms_host for 5 iterations, one round, on a simulated GPU of 1 GiB (its paging
    rows need room beside packing's 200 MiB margin), with ``args``; it must exit 0 (its
    rows that fit paged nothing, its paging row paged, its recompute row dropped)."""
    proc = run_benchmark(
        sim_build,
        "bench_lms_host",
        "--iterations",
        "5",
        "--repeat",
        "1",
        *args,
        env={"SIMGPU_DEVICE_COUNT": "1", "SIMGPU_CAPACITY_MB": "1024"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_host_time_benchmark_counts_runtime_calls_and_pages_only_where_told(
    sim_build: Path,
) -> None:
    """The host-time benchmark drives every configuration. The rows that fit page nothing (the
    schedule learns the period), the paging row pages every iteration and the recompute row
    drops storages (it exits 1 otherwise); every row gives the CUDA runtime calls per operator
    that simgpu counted. With no CUDA graph capture underway the allocator tells the engine so
    (captureMayBeUnderway), and the engine asks CUDA whether a stream is capturing in no
    row: about four and a half calls an operator before it did."""
    proc = run_host_benchmark(sim_build)
    rows = {}
    for config in ("off", "reactive", "no-pack", "schedule", "paging", "recompute"):
        match = re.search(rf"^{config}\s+\d+\s+\S+\s+([\d.]+)\s+(.*)$", proc.stdout, re.M)
        assert match, proc.stdout
        rows[config] = (float(match.group(1)), match.group(2))
    assert all(calls > 0 for calls, _ in rows.values()), proc.stdout
    assert "cudaStreamIsCapturing" not in proc.stdout, proc.stdout
    assert rows["schedule"][0] < 4, proc.stdout
    period = re.search(r"schedule period (\d+) operators, 0 page-outs", proc.stdout)
    assert period and int(period.group(1)) > 0, proc.stdout
    paging = re.search(r"paging: ([\d.]+) page-outs per iteration", proc.stdout)
    assert paging and float(paging.group(1)) > 0, proc.stdout
    drops = re.search(r"recompute: ([\d.]+) drops", proc.stdout)
    assert drops and float(drops.group(1)) > 0, proc.stdout


def test_a_host_ahead_of_its_copies_waits_for_them_instead_of_refusing_page_outs(
    sim_build: Path,
) -> None:
    """The paging and recompute rows of the host-time benchmark with no synchronization an
    iteration (the host runs ahead of the copies) and a 120 MiB host budget, under the about
    200 MiB the pool pins without one: the pool's buffers are still in flight when page-outs
    need them. They wait for those copies; none is refused (before the pool waited, 504 were
    in 5 iterations at a budget of 400 MiB, which the pool then reached)."""
    proc = run_host_benchmark(sim_build, "--run-ahead", "--host-limit-mb", "120")
    host = re.search(
        r"host memory, paging and recompute rows: (\d+) refused page-outs, (\d+) waits",
        proc.stdout,
    )
    assert host, proc.stdout
    assert int(host.group(1)) == 0, proc.stdout
    assert int(host.group(2)) > 0, proc.stdout
