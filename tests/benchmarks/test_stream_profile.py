"""benchmarks/stream_profile.py: the stream breakdown of a profiler trace, from synthetic
Chrome traces, no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import stream_profile
from benchmarks.stream_profile import analyze, intersect, merge, subtract

GiB = 1 << 30


def kernel(stream: int, ts: float, dur: float) -> dict[str, object]:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": "k",
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream},
    }


def memcpy(stream: int, ts: float, dur: float, nbytes: int, kind: str) -> dict[str, object]:
    return {
        "ph": "X",
        "cat": "gpu_memcpy",
        "name": f"Memcpy {kind} (Device -> Pinned)",
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream, "bytes": nbytes},
    }


def call(name: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {}}


def test_interval_arithmetic() -> None:
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8), (4, 4)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert subtract([(0, 2), (4, 6)], []) == [(0, 2), (4, 6)]
    assert subtract([(0, 2)], [(0, 2)]) == []


def test_idle_time_is_split_by_what_the_rest_of_the_gpu_did() -> None:
    # Two iterations of 1000 us each. Compute stream 7: kernels 0-400 and 1000-1400
    # (busy 800 us in all). Stream 20 copies D2H 400-700 (2 GiB), stream 30 copies H2D
    # 600-900 (1 GiB) and 1400-1500 (1 GiB); another kernel on stream 9 at 1600-1700;
    # nothing on the GPU from 1700 to 1900, when a last kernel runs on stream 7 till 2000.
    events = [
        kernel(7, 0, 400),
        kernel(7, 1000, 400),
        kernel(7, 1900, 100),
        memcpy(20, 400, 300, 2 * GiB, "DtoH"),
        memcpy(30, 600, 300, GiB, "HtoD"),
        memcpy(30, 1400, 100, GiB, "HtoD"),
        kernel(9, 1600, 100),
        call("cudaEventSynchronize", 0, 150),
        call("cudaLaunchKernel", 0, 10),
        call("cudaEventSynchronize", 500, 50),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
    ]
    b = analyze({"traceEvents": events}, iterations=2)
    assert b.compute_stream == 7
    assert b.span_ms == pytest.approx(1.0)  # 2000 us over 2 iterations
    assert b.compute_busy_ms == pytest.approx(0.45)
    assert b.compute_idle_ms == pytest.approx(0.55)
    # idle while a copy ran elsewhere: 400-900 and 1400-1500 = 600 us
    assert b.idle_while_copying_ms == pytest.approx(0.3)
    # idle with stream 9's kernel only: 1600-1700
    assert b.idle_other_ms == pytest.approx(0.05)
    # idle with nothing on the GPU: 900-1000, 1500-1600, 1700-1900 = 400 us
    assert b.idle_gpu_idle_ms == pytest.approx(0.2)
    assert b.idle_while_copying_ms + b.idle_other_ms + b.idle_gpu_idle_ms == pytest.approx(
        b.compute_idle_ms
    )
    assert b.d2h.busy_ms == pytest.approx(0.15)
    assert b.d2h.gib == pytest.approx(1.0)
    assert b.d2h.gb_per_s == pytest.approx(2 * GiB / 300e-6 / 1e9)
    assert b.h2d.busy_ms == pytest.approx(0.2)
    assert b.both_directions_ms == pytest.approx(0.05)  # 600-700
    assert b.copies_on_compute_ms == 0
    assert list(b.runtime_calls_ms) == ["cudaEventSynchronize", "cudaLaunchKernel"]
    assert b.runtime_calls_ms["cudaEventSynchronize"] == pytest.approx(0.1)


def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}


def test_gpu_idle_time_is_traced_to_the_host_operator_and_call_it_was_in() -> None:
    # The GPU runs 0-100, 300-400 and 600-1000: idle 100-300 and 400-600. Thread 1 runs
    # aten::linear 50-350, inside it aten::mm 120-180 (whose cudaStreamSynchronize takes
    # 130-170), then aten::add 450-500; thread 2 runs aten::relu 500-550. Nothing covers
    # 400-450 and 550-600.
    events = [
        kernel(7, 0, 100),
        kernel(7, 300, 100),
        kernel(7, 600, 400),
        op("ProfilerStep#3", 0, 1000),
        op("aten::linear", 50, 300),
        op("aten::mm", 120, 60),
        call("cudaStreamSynchronize", 130, 40),
        call("cudaLaunchKernel", 320, 5),
        op("aten::add", 450, 50),
        op("aten::relu", 500, 50, tid=2),
    ]
    b = analyze({"traceEvents": events}, iterations=1)
    assert b.idle_gpu_idle_ms == pytest.approx(0.4)
    ops = b.gpu_idle_host_ops_ms
    # linear's own share: 100-300 less mm's 120-180
    assert ops["aten::linear"] == pytest.approx(0.14)
    assert ops["aten::mm"] == pytest.approx(0.06)
    assert ops["aten::add"] == pytest.approx(0.05)
    assert ops["aten::relu"] == pytest.approx(0.05)
    assert ops[stream_profile.OUTSIDE_OPERATORS] == pytest.approx(0.1)
    assert not any(name.startswith("ProfilerStep") for name in ops)
    assert next(iter(ops)) == "aten::linear"  # largest first
    calls = b.gpu_idle_runtime_calls_ms
    assert calls == pytest.approx({"cudaStreamSynchronize": 0.04})  # the launch is in a busy span
    summary = b.summary()
    assert "while the GPU sat idle, the host was in (ms): aten::linear 0.1" in summary
    assert "cudaStreamSynchronize 0.0" in summary


def test_the_longest_gaps_name_the_host_operator_and_what_ended_them() -> None:
    # GPU: "fwd" 0-100, "loss" 400-500, "bwd" 550-600: idle 100-400 (300 us) and 500-550
    # (50 us). The host: aten::linear 0-600, inside it aten::empty_strided 200-300 (at the
    # first gap's middle, 250); nothing but aten::linear at the second's (525).
    named = [
        {**kernel(7, 0, 100), "name": "fwd"},
        {**kernel(7, 400, 100), "name": "loss"},
        {**kernel(7, 550, 50), "name": "bwd"},
        op("aten::linear", 0, 600),
        op("aten::empty_strided", 200, 100),
    ]
    b = analyze({"traceEvents": named}, iterations=1, top_gaps=1)
    assert b.gpu_idle_gaps == [
        {"ms": pytest.approx(0.3), "host_op": "aten::empty_strided", "next": "loss"}
    ]
    both = analyze({"traceEvents": named}, iterations=1).gpu_idle_gaps
    assert [g["next"] for g in both] == ["loss", "bwd"]  # longest first
    assert both[1]["host_op"] == "aten::linear"
    assert "longest GPU idle gaps (ms): 0.3 in aten::empty_strided, then loss" in b.summary()
    lone = analyze({"traceEvents": [kernel(7, 0, 10), kernel(7, 30, 10)]}, iterations=1)
    assert lone.gpu_idle_gaps[0]["host_op"] == stream_profile.OUTSIDE_OPERATORS


def test_coverage_of_an_interval() -> None:
    cover = stream_profile.Coverage([(0, 10), (20, 30), (40, 50)])
    assert cover.covered(5, 45) == pytest.approx(5 + 10 + 5)
    assert cover.covered(10, 20) == 0
    assert cover.covered(-5, 100) == 30
    assert cover.covered(25, 26) == 1
    assert cover.covered(55, 60) == 0
    assert stream_profile.Coverage([]).covered(0, 1) == 0


def test_copies_on_the_compute_stream_count_as_its_busy_time() -> None:
    events = [kernel(7, 0, 100), memcpy(7, 100, 50, GiB, "HtoD"), kernel(7, 150, 100)]
    b = analyze({"traceEvents": events}, iterations=1)
    assert b.compute_idle_ms == 0
    assert b.copies_on_compute_ms == pytest.approx(0.05)
    assert b.copies_on_compute_gib == pytest.approx(1.0)
    assert b.h2d.count == 1


def test_a_trace_without_gpu_activity_is_an_error() -> None:
    with pytest.raises(ValueError, match="no GPU activity"):
        analyze({"traceEvents": [call("cudaMalloc", 0, 5)]}, iterations=1)
    with pytest.raises(ValueError, match="traceEvents"):
        analyze({}, iterations=1)
    with pytest.raises(ValueError, match="iterations"):
        analyze({"traceEvents": [kernel(7, 0, 1)]}, iterations=0)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [kernel(7, 0, 100), kernel(7, 300, 100)]}))
    assert stream_profile.main([str(trace), "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPU idle 100.0" in out or "GPU idle 0.1" in out
    assert stream_profile.main([str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compute_idle_ms"] == pytest.approx(0.2)
    assert stream_profile.main([str(tmp_path / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err


def annotation(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, object]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}


def launched(event: dict[str, object], correlation: int) -> dict[str, object]:
    args = dict(event["args"])  # type: ignore[call-overload]
    args["correlation"] = correlation
    return {**event, "args": args}


def launch(name: str, ts: float, correlation: int, tid: int = 1) -> dict[str, object]:
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": name,
        "ts": ts,
        "dur": 1,
        "tid": tid,
        "args": {"correlation": correlation},
    }


def test_phases_take_the_gpu_work_their_host_ranges_launched() -> None:
    # Forward: host 0-100 launches a kernel (GPU 10-300) and a 1 GiB D2H copy (GPU 100-400).
    # Backward: host 100-200 on the main thread; autograd's thread (tid 2) launches a kernel
    # at 150 (GPU 500-900) and a 2 GiB H2D copy at 160 (GPU 420-520). The compute stream is
    # idle 300-500, a copy running elsewhere for 300-400 (forward's window ends at 300) and
    # 420-500 (before backward's first kernel). Optimizer: host 200-250, kernel 950-1000.
    events = [
        annotation("step: forward", 0, 100),
        annotation("step: backward", 100, 100),
        annotation("step: optimizer", 200, 50),
        launch("cudaLaunchKernel", 10, 1),
        launch("cudaMemcpyAsync", 20, 2),
        launch("cudaLaunchKernel", 150, 3, tid=2),
        launch("cudaMemcpyAsync", 160, 4, tid=2),
        launch("cudaLaunchKernel", 210, 5),
        launched(kernel(7, 10, 290), 1),
        launched(memcpy(20, 100, 300, GiB, "DtoH"), 2),
        launched(kernel(7, 500, 400), 3),
        launched(memcpy(30, 420, 100, 2 * GiB, "HtoD"), 4),
        launched(kernel(7, 950, 50), 5),
    ]
    phases = analyze({"traceEvents": events}, 1).phases
    assert list(phases) == ["forward", "backward", "optimizer"]
    forward, backward, optimizer = phases["forward"], phases["backward"], phases["optimizer"]
    assert forward["span_ms"] == pytest.approx(0.290)
    assert forward["busy_ms"] == pytest.approx(0.290)
    assert forward["idle_while_copying_ms"] == 0.0
    assert forward["d2h_gib"] == pytest.approx(1.0) and forward["h2d_gib"] == 0.0
    assert forward["d2h_busy_ms"] == pytest.approx(0.300)
    assert backward["span_ms"] == pytest.approx(0.400)
    assert backward["h2d_gib"] == pytest.approx(2.0)
    assert backward["h2d_busy_ms"] == pytest.approx(0.100)
    assert optimizer["busy_ms"] == pytest.approx(0.050)
    # The phase ranges are not host operators.
    summary = analyze({"traceEvents": events}, 1).summary()
    assert "backward: span 0.4 ms" in summary
    assert "step: " not in json.dumps(analyze({"traceEvents": events}, 1).gpu_idle_host_ops_ms)


def test_a_trace_without_phase_ranges_has_no_phases() -> None:
    events = [launch("cudaLaunchKernel", 0, 1), launched(kernel(7, 0, 10), 1)]
    assert analyze({"traceEvents": events}, 1).phases == {}


def test_a_phase_of_several_iterations_sums_its_runs() -> None:
    # Two iterations: forward host 0-100 and 1000-1100 launch kernels at GPU 10-110 and
    # 1010-1110; backward host 100-200 and 1100-1200 launch kernels at 200-500 and
    # 1200-1500. Per iteration: forward spans 100 us, backward 300 us (a window over both
    # runs of the forward would span 1100 us and take the backward in).
    events = [
        annotation("step: forward", 0, 100),
        annotation("step: backward", 100, 100),
        annotation("step: forward", 1000, 100),
        annotation("step: backward", 1100, 100),
        launch("cudaLaunchKernel", 5, 1),
        launch("cudaLaunchKernel", 150, 2),
        launch("cudaLaunchKernel", 1005, 3),
        launch("cudaLaunchKernel", 1150, 4),
        launched(kernel(7, 10, 100), 1),
        launched(kernel(7, 200, 300), 2),
        launched(kernel(7, 1010, 100), 3),
        launched(kernel(7, 1200, 300), 4),
    ]
    phases = analyze({"traceEvents": events}, 2).phases
    assert list(phases) == ["forward", "backward"]
    assert phases["forward"]["span_ms"] == pytest.approx(0.100)
    assert phases["forward"]["busy_ms"] == pytest.approx(0.100)
    assert phases["backward"]["span_ms"] == pytest.approx(0.300)
