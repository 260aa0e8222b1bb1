"""CPU tests of ``tests/regression/stress/optrace.py``, the per-call allocation trace of a
stress case: what a trace keeps of the allocator's history, the line it prints per call,
and its command line's errors. The trace itself needs a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.regression.stress import optrace

MiB = 1024 * 1024


def test_trace_events_keep_allocations_failures_and_their_aten_frames() -> None:
    frames = [
        {"filename": "/src/aten/src/ATen/native/cudnn/ConvShared.cpp", "line": 7, "name": "conv"},
        {"filename": "/usr/lib/python3.12/threading.py", "line": 1, "name": "run"},
    ]
    snapshot = {
        "device_traces": [
            [
                {"action": "alloc", "size": 4 * MiB, "addr": 16, "frames": frames},
                {"action": "free_completed", "size": 4 * MiB, "addr": 16, "frames": []},
                {"action": "oom", "size": 118 * MiB, "addr": 0, "frames": frames},
                {"action": "snapshot", "size": 0, "addr": 0},
            ]
        ]
    }
    events = optrace.trace_events(snapshot)
    assert [e["action"] for e in events] == ["alloc", "oom"]
    assert events[1]["bytes"] == 118 * MiB
    assert events[0]["frames"] == ["ConvShared.cpp:7 conv"]


def test_a_call_is_described_by_what_it_allocated_and_could_not() -> None:
    call = {
        "op": "aten.convolution_backward.default",
        "input_bytes": [100 * MiB, 18 * MiB],
        "events": [
            {"action": "oom", "bytes": 118 * MiB, "address": 0, "frames": []},
            {"action": "alloc", "bytes": 59 * MiB, "address": 1, "frames": []},
            {"action": "free_requested", "bytes": 59 * MiB, "address": 1, "frames": []},
        ],
    }
    line = optrace.describe(call)
    assert line.startswith("aten.convolution_backward.default: inputs 118.0 MiB")
    assert "allocated 59.0 MiB" in line
    assert "could not allocate 118.0 MiB" in line


def test_capped_mode_needs_the_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        optrace.main(["--seed", "3", "--mode", "capped", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--mode capped needs --cap-bytes" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: it would trace")
def test_without_a_device_it_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert optrace.main(["--seed", "3", "--out", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
