"""The processes benchmark's sizing and records (benchmarks/processes.py), on a CPU: the
batch from a calibration, what becomes of a worker, the records and their summary, and the
run folder's name. The GPU run itself is the regression row tests/regression/test_shared_gpu.py
and ``python -m benchmarks.processes``."""

from __future__ import annotations

import subprocess
import sys

from benchmarks import processes as bench

GB = 10**9


def test_batch_from_the_calibration_needs_the_target() -> None:
    cal = bench.calibrate_from(3 * GB, 4 * GB, "NVIDIA H200", 141 * GB)
    assert (cal.fixed_bytes, cal.sample_bytes) == (2 * GB, 1 * GB)
    view = bench.view_bytes(cal.total_bytes, 0.4)
    assert view == int(0.4 * 141 * GB)
    batch = bench.batch_for(cal, int(0.8 * view))
    assert batch == (int(0.8 * view) - 2 * GB) // GB
    assert 2 * GB + batch * GB <= 0.8 * view < 2 * GB + (batch + 1) * GB
    # A target below the model itself still trains one sample.
    assert bench.batch_for(cal, GB) == 1
    assert bench.view_bytes(80 * GB, None) == 80 * GB


def test_status_of_a_worker() -> None:
    assert bench.status_of(0, False, {"status": "finished"}) == "finished"
    assert bench.status_of(0, False, {"status": "oom"}) == "oom"
    assert bench.status_of(-9, False, None) == "killed"
    assert bench.status_of(-9, False, {"status": "finished"}) == "killed"
    assert bench.status_of(None, True, None) == "timeout"
    assert bench.status_of(1, False, None) == "error"
    assert bench.status_of(0, False, {"status": "strange"}) == "error"


def test_records_carry_the_waits_and_the_summary_the_ratio() -> None:
    stats = {
        "host_wait_ms": 1500.0,
        "device_wait_ms": 500.0,
        "pageout_bytes": 7 * GB,
        "pagein_bytes": 6 * GB,
        "host_refusals": 0,
        "limit_bytes": 30 * GB,
    }
    result = {"status": "finished", "steps_done": 4, "train_s": 9.5, "batch": 12, "lms": stats}
    together = [bench.process_record("together", i, 0, False, 20.0 + i, result) for i in range(3)]
    together.append(bench.process_record("together", 3, -9, False, 5.0, None))
    serial = [bench.process_record("serial", i, 0, False, 10.0, result) for i in range(4)]
    first = together[0]
    assert first["status"] == "finished"
    assert (first["wait_s"], first["host_wait_s"], first["device_wait_s"]) == (2.0, 1.5, 0.5)
    assert first["pages_to_disk"] == 0
    assert first["steps"] == 4 and first["pageout_bytes"] == 7 * GB
    assert together[3]["status"] == "killed" and together[3]["wait_s"] == 0.0
    summary = bench.summary_record([*together, *serial], together_s=30.0)
    assert summary == {
        "scenario": "summary",
        "processes": 4,
        "finished": 3,
        "killed": 1,
        "together_s": 30.0,
        "serial_s": 40.0,
        "together_over_serial": 0.75,
        "serial_finished": 4,
    }
    alone = bench.summary_record(together, together_s=30.0)
    assert alone["serial_s"] is None and alone["together_over_serial"] is None


def test_pages_to_disk_read_where_the_engine_counts_them() -> None:
    assert bench.pages_to_disk(None) == 0
    assert bench.pages_to_disk({"pageout_count": 9}) == 0
    assert bench.pages_to_disk({"spill_pageout_count": 3, "pageout_count": 9}) == 3
    assert bench.pages_to_disk({"disk_write_count": 2}) == 2


def test_run_folder_name() -> None:
    assert bench.device_slug("NVIDIA H200") == "h200"
    assert bench.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    env = {"engine_commit": "0123456789abcdef", "date": "2026-11-28T10:00:00+00:00"}
    out = bench.default_out(env, "NVIDIA H200")
    assert out.parts[-3:] == ("results", "processes", "2026-11-28-h200-0123456")
    unknown = bench.default_out({"engine_commit": "unknown", "date": env["date"]}, "NVIDIA H200")
    assert unknown.name == "2026-11-28-h200-unrecorded"


def test_help_lists_the_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.processes", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--processes", "--fraction", "--cap-share", "--host-limit-gb", "--no-serial"):
        assert option in proc.stdout
