"""benchmarks/compare.py --regime nocap: batches from the memory model, estimates, goals against
the capped results, the run's sequence and files with fake training, provenance — no GPU."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare
from benchmarks.compare import (
    Bandwidth,
    CappedPoint,
    CappedReference,
    DeviceMemory,
    Measurement,
    MemoryModel,
    NocapPlan,
    NocapRun,
    fill_roofline,
    fitted_memory_model,
    interpolate_capped_efficiency,
    nocap_plan,
    one_batch_memory_model,
    second_fit_batch,
)
from lmsbench import lms_setup

GB = 1e9
GiB = 1 << 30
BW = Bandwidth(d2h=50 * GB, h2d=40 * GB, bidirectional=80 * GB)
COMMITTED = compare.DEFAULT_CAPPED_RESULTS
ENV = {
    "device": "Fake GPU",
    "torch": "9.9",
    "cuda": "13.0",
    "lms_backend": "extension",
    "date": "2030-01-01T00:00:00+00:00",
    "driver": "999.1",
    "engine_commit": "0" * 40,
    "engine_dirty": False,
}


# ---------------------------------------------------------------------------------------
# Memory model and batches
# ---------------------------------------------------------------------------------------


def test_one_batch_memory_model() -> None:
    model = one_batch_memory_model(8, 10 * GiB, 2 * GiB)
    assert model.intercept_bytes == 2 * GiB and model.per_sample_bytes == GiB
    assert model.points == ((8, 10 * GiB),) and model.bytes_at(4) == 6 * GiB
    assert model.record()["points"] == [[8, 10 * GiB]]
    for batch, peak, static in ((0, 10, 2), (8, 2 * GiB, 2 * GiB), (8, GiB, 2 * GiB)):
        with pytest.raises(ValueError):
            one_batch_memory_model(batch, peak, static)


def test_fitted_memory_model_and_its_fallbacks() -> None:
    # Truth: 3 GiB + 0.5 GiB per sample, 2 GiB static: the one-batch slope at batch 8 counts
    # the gradients (1 GiB) as per-sample memory.
    first = one_batch_memory_model(8, 7 * GiB, 2 * GiB)
    assert first.per_sample_bytes == pytest.approx(0.625 * GiB)
    fit = fitted_memory_model(first, 32, 19 * GiB)
    assert fit.per_sample_bytes == pytest.approx(0.5 * GiB)
    assert fit.intercept_bytes == pytest.approx(3 * GiB)
    assert fit.points == ((8, 7 * GiB), (32, 19 * GiB))
    assert fit.source.startswith("fit of batches 8 and 32")
    # A smaller second batch fits the same line.
    assert fitted_memory_model(first, 4, 5 * GiB).per_sample_bytes == pytest.approx(0.5 * GiB)
    # Unusable lines keep the one-batch model and say why.
    same = fitted_memory_model(first, 8, 7 * GiB)
    assert same.per_sample_bytes == first.per_sample_bytes and "not fitted" in same.source
    flat = fitted_memory_model(first, 32, 7 * GiB)
    assert flat.per_sample_bytes == first.per_sample_bytes
    assert "does not grow" in flat.source and len(flat.points) == 2
    negative = fitted_memory_model(first, 16, 15 * GiB)  # slope 1 GiB: intercept -1 GiB
    assert negative.intercept_bytes == first.intercept_bytes
    assert "negative intercept" in negative.source


def test_second_fit_batch() -> None:
    # 2 GiB + 1 GiB per sample on a 40 GiB device: at most 4 x 8 = 32 ...
    model = one_batch_memory_model(8, 10 * GiB, 2 * GiB)
    assert second_fit_batch(model, 40 * GiB * 2) == 32
    # ... or the largest batch at 70% of the device: (28 - 2) / 1 = 26
    assert second_fit_batch(model, 40 * GiB) == 26
    # no room above the first: half of it; a first batch of 1 with no room: none
    assert second_fit_batch(model, 12 * GiB) == 4
    single = one_batch_memory_model(1, 10 * GiB, 2 * GiB)
    assert second_fit_batch(single, 12 * GiB) is None


def test_nocap_plan_batches_needs_and_deficits() -> None:
    model = MemoryModel(3 * GiB, 0.5 * GiB, "fit", ((8, 7 * GiB), (32, 19 * GiB)))
    limit = 40 * GiB
    plans = {f: nocap_plan(model, limit, f) for f in (1.25, 1.5, 2.0)}
    assert [p.batch for p in plans.values()] == [94, 114, 154]
    assert plans[1.25].need_bytes == 50 * GiB and plans[1.25].deficit_bytes == 10 * GiB
    assert plans[2.0].deficit_bytes == 40 * GiB
    # Rounded down: the need never exceeds f x D.
    odd = nocap_plan(MemoryModel(3 * GiB, 0.7 * GiB, "x", ((1, 1),)), limit, 1.5)
    assert odd.batch == 81 and odd.need_bytes <= 1.5 * limit
    record = plans[1.5].record()
    assert record["need_is_estimate"] is True and record["need_over_limit"] == pytest.approx(1.5)
    assert record["limit_bytes"] == limit and record["deficit_bytes"] == 20 * GiB


def test_nocap_plan_errors_say_why() -> None:
    limit = 40 * GiB
    huge_sample = MemoryModel(3 * GiB, 60 * GiB, "x", ((1, 1),))
    with pytest.raises(ValueError, match=r"1\.25x needs a batch below 1: one sample needs 60\.00"):
        nocap_plan(huge_sample, limit, 1.25)  # 47 GiB for samples of 60 GiB
    tiny_room = MemoryModel(39 * GiB, 12 * GiB, "x", ((1, 1),))
    with pytest.raises(ValueError, match="batch below 1"):
        nocap_plan(tiny_room, limit, 1.25)  # 50 - 39 = 11 GiB for a 12 GiB sample
    static = MemoryModel(50 * GiB, GiB, "x", ((1, 1),))
    with pytest.raises(ValueError, match=r"already 1\.25 x the device limit"):
        nocap_plan(static, limit, 1.25)  # S >= f x D
    with pytest.raises(ValueError, match="too close to 1"):
        # 1.01 x 40 - 3 = 37.4 GiB: one sample of 30 GiB, whose need (33 GiB) fits
        nocap_plan(MemoryModel(3 * GiB, 30 * GiB, "x", ((1, 1),)), limit, 1.01)
    with pytest.raises(ValueError, match="must be > 1"):
        nocap_plan(static, limit, 1.0)
    with pytest.raises(ValueError):
        nocap_plan(static, 0, 1.5)


def test_nocap_plan_huge_sample_first_case_is_batch_two() -> None:
    # The first case above: 1.25 x 40 - 3 = 47 GiB for samples of 20 GiB: batch 2, need 43.
    plan = nocap_plan(MemoryModel(3 * GiB, 20 * GiB, "x", ((1, 1),)), 40 * GiB, 1.25)
    assert plan.batch == 2 and plan.deficit_bytes == 3 * GiB


def test_device_memory() -> None:
    mem = DeviceMemory(total_bytes=80 * GiB, free_bytes=79 * GiB)
    assert mem.used_at_start_bytes == GiB and mem.limit_bytes == 79 * GiB
    assert mem.record() == {
        "total_bytes": 80 * GiB,
        "used_at_start_bytes": GiB,
        "limit_bytes": 79 * GiB,
    }


# ---------------------------------------------------------------------------------------
# Rooflines, estimates
# ---------------------------------------------------------------------------------------


def nocap_row(
    method: str, factor: float, batch: int, seconds: float, deficit: float, moved: float
) -> Measurement:
    m = Measurement("gpt", method, factor, None, batch)
    m.iteration_times = [seconds] * 3
    m.out_bytes_per_iter = m.in_bytes_per_iter = moved
    m.deficit_bytes = int(deficit)
    m.limit_bytes = int(40 * GB)
    m.need_bytes = m.limit_bytes + m.deficit_bytes
    m.finish_timing()
    return m


def test_nocap_rows_roofline_and_efficiency() -> None:
    # The fitting runs: batch 32 at 10 ms per sample sets the compute (not batch 8's 12 ms).
    fit8 = Measurement("gpt", "baseline", None, None, 8, iteration_times=[0.096])
    fit32 = Measurement("gpt", "baseline_fit", None, None, 32, iteration_times=[0.32])
    for m in (fit8, fit32):
        m.finish_timing()
    # 100 samples: 1 s of compute. Deficit 40 GB: both ways at once 80 / 80 = 1 s, one after
    # the other 0.8 + 1.0 = 1.8 s; LMS moved 44 GB each way (1.98 s serial, 1.1 s at once).
    lms = nocap_row("lms", 2.0, 100, 2.5, 40 * GB, 44 * GB)
    ckpt = nocap_row("checkpoint", 2.0, 100, 1.25, 40 * GB, 0.0)
    rows = [fit8, fit32, lms, ckpt]
    compute = compare.nocap_compute_s_per_sample(rows)
    assert compute is not None
    assert compute[0] == pytest.approx(0.01) and compute[1] == 32
    fill_roofline(rows, compute[0], BW)
    assert lms.deficit_roofline_s == pytest.approx(1.0)
    assert lms.deficit_efficiency == pytest.approx(0.4)
    assert lms.serial_roofline_s == pytest.approx(1.8)
    assert lms.serial_efficiency == pytest.approx(0.72)
    assert lms.roofline_s == pytest.approx(1.1) and lms.efficiency == pytest.approx(0.44)
    assert ckpt.deficit_efficiency == pytest.approx(0.8) and ckpt.efficiency == pytest.approx(0.8)
    assert fit8.efficiency == pytest.approx(0.08 / 0.096)  # against batch 32's rate
    assert compare.nocap_compute_s_per_sample([ckpt]) is None
    failed = Measurement("gpt", "baseline_fit", None, None, 64, status="oom")
    assert compare.nocap_compute_s_per_sample([fit8, failed]) == (pytest.approx(0.012), 8)


def test_host_and_time_estimates() -> None:
    plan = NocapPlan(2.0, 100, int(80 * GB), int(40 * GB))
    a = 0.5 * GB
    assert compare.nocap_host_bytes("lms", plan, a) == int(40 * GB + 0.05 * 40 * GB)
    assert compare.nocap_host_bytes("offload", plan, a) == int(50 * GB)
    assert compare.nocap_host_bytes("save_on_cpu", plan, a) == int(50 * GB)
    assert compare.nocap_host_bytes("checkpoint", plan, a) == 0
    # Measured saved bytes count where they exceed the memory model's per-sample bytes.
    assert compare.nocap_host_bytes("save_on_cpu", plan, a, 0.8 * GB) == int(80 * GB)
    assert compare.nocap_host_bytes("offload", plan, a, 0.1 * GB) == int(50 * GB)
    assert compare.nocap_host_bytes("lms", plan, a, 0.8 * GB) == int(42 * GB)
    # 7 steps of max(1 s compute, 40 GB out then in: 1.8 s), pinning 30 GB at 3 GB/s, setup.
    t = compare.estimate_row_seconds(1.0, 40 * GB, 40 * GB, 30 * GB, BW, 7)
    assert t == pytest.approx(compare.ROW_SETUP_S + 7 * 1.8 + 10.0)
    assert compare.estimate_row_seconds(1.0, 0, 0, 0, BW, 7, slowdown=2) == pytest.approx(
        2 * (compare.ROW_SETUP_S + 7.0)
    )
    with pytest.raises(ValueError):
        compare.estimate_row_seconds(1.0, 0, 0, 0, BW, 0)
    ckpt = compare.nocap_row_estimate("checkpoint", plan, a, 0.01, BW, 3)
    assert ckpt == pytest.approx(compare.ROW_SETUP_S + 3 * 4 / 3)
    lms = compare.nocap_row_estimate("lms", plan, a, 0.01, BW, 3)
    host = 42 * GB
    assert lms == pytest.approx(
        compare.ROW_SETUP_S + 3 * (host / BW.d2h + host / BW.h2d) + host / 3e9
    )


def test_measure_saved_bytes_on_the_cpu() -> None:
    torch = pytest.importorskip("torch", reason="counts what autograd saves")
    from benchmarks import models

    workload = models.gpt_workload(models.GPTConfig(vocab=64, seq=16, dim=32, layers=2, heads=2))
    args = nocap_args(Path("unused"))
    one, four = (
        compare.measure_saved_bytes(args, workload, b, torch.device("cpu")) for b in (1, 4)
    )
    assert 0 < one < four <= 4 * one  # weights are saved once per step, activations per sample


def test_proc_fields() -> None:
    text = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t1024 kB\nThreads:\t4\nMemAvailable: 8 kB\n"
    assert compare.parse_kib_fields(text) == {
        "VmHWM": 2048 * 1024,
        "VmRSS": 1024 * 1024,
        "MemAvailable": 8 * 1024,
    }
    assert compare.read_kib_fields("/nonexistent/status") == {}


# ---------------------------------------------------------------------------------------
# Against the capped results
# ---------------------------------------------------------------------------------------


POINTS = [(0.5, 0.44), (1.0, 0.45), (3.0, 0.47)]


def test_interpolate_capped_efficiency() -> None:
    value, how = interpolate_capped_efficiency(POINTS, 1.0)
    assert value == 0.45 and how == "capped at deficit/limit 1.00: 45.0%"
    value, how = interpolate_capped_efficiency(POINTS, 2.0)
    assert value == pytest.approx(0.46) and "interpolated" in how and "1.00 (45.0%)" in how
    value, how = interpolate_capped_efficiency(list(reversed(POINTS)), 0.75)
    assert value == pytest.approx(0.445)
    # Just below the first point (a batch rounded down): the end point, said so.
    value, how = interpolate_capped_efficiency(POINTS, 0.49)
    assert value == 0.44 and "this run 0.49, within 5%" in how
    value, _ = interpolate_capped_efficiency(POINTS, 3.1)
    assert value == 0.47
    for outside in (0.25, 0.47, 3.2):
        value, how = interpolate_capped_efficiency(POINTS, outside)
        assert value is None and "outside the capped results' 0.50 to 3.00" in how
    assert interpolate_capped_efficiency([], 1.0) == (None, "no capped LMS row trained")
    value, how = interpolate_capped_efficiency([(1.0, 0.5)], 1.2)
    assert value is None and "outside the capped results' 1.00:" in how


def test_capped_reference_from_the_committed_results(tmp_path: Path) -> None:
    path = COMMITTED / "compare-resnet152.json"
    if not path.is_file():
        pytest.skip("no committed ResNet-152 capped results")
    workload = json.loads(path.read_text())["workload"]
    ref = compare.capped_reference(path, workload, amp=True, optimizer=None)
    assert ref.reason == "" and ref.device.startswith("NVIDIA")
    ratios = [round(p.deficit_over_limit, 2) for p in ref.points]
    assert ratios == [0.5, 1.0, 3.0]  # factors 1.5, 2 and 4: deficit / cap = f - 1
    assert [p.factor for p in ref.points] == [1.5, 2.0, 4.0]
    assert all(0 < p.efficiency < 1 for p in ref.points)
    # Round trip through the no-cap JSON.
    back = CappedReference.from_record(json.loads(json.dumps(ref.record())))
    assert back == ref
    assert CappedReference.from_record(None) is None
    with pytest.raises(ValueError, match="capped_reference"):
        CappedReference.from_record({"points": [{"nope": 1}]})

    # Not comparable: another precision, another workload, no file, not a run record.
    fp32 = compare.capped_reference(path, workload, amp=False, optimizer=None)
    assert fp32.points == () and "used --amp, this run does not" in fp32.reason
    other = compare.capped_reference(path, "ResNet-152, 224x224", amp=True, optimizer=None)
    assert "the capped run trained" in other.reason
    adamw = compare.capped_reference(path, workload, amp=True, optimizer="adamw")
    assert "optimizer default in the capped run, adamw here" in adamw.reason
    missing = compare.capped_reference(tmp_path / "compare-x.json", workload, True, None)
    assert missing.reason.startswith("no capped results at")
    bad = tmp_path / "compare-bad.json"
    bad.write_text("{")
    assert "unreadable" in compare.capped_reference(bad, workload, True, None).reason


REFERENCE = CappedReference(
    "compare-gpt.json",
    "Fake GPU",
    "fake",
    tuple(CappedPoint(1 + r, r, e) for r, e in POINTS),
)


def test_nocap_goals() -> None:
    rows = [
        nocap_row("lms", 1.25, 100, 1.25, 10 * GB, 11 * GB),  # 1 s of compute: 80%
        nocap_row("lms", 1.5, 100, 1.0 / 0.9, 20 * GB, 30 * GB),  # 90%, 1.5x the deficit
        nocap_row("lms", 2.0, 100, 2.5, 40 * GB, 44 * GB),  # 40%
        nocap_row("checkpoint", 2.0, 100, 1.25, 40 * GB, 0.0),
    ]
    fill_roofline(rows, 0.01, BW)
    goals = {
        (g.goal, g.factor): g
        for g in compare.evaluate_nocap_goals(rows, [1.25, 1.5, 2.0], REFERENCE, "Fake GPU")
    }
    assert len(goals) == 9
    eff = goals["nocap_efficiency", 1.25]
    assert eff.value == pytest.approx(0.8) and eff.met is False and eff.target == ">= 85%"
    assert eff.gap == "-5.0 points"
    assert goals["nocap_efficiency", 1.5].met is True
    out = goals["nocap_out_vs_deficit", 1.5]
    assert out.value == pytest.approx(1.5) and out.met is False and out.target == "<= 1.25x"
    assert goals["nocap_out_vs_deficit", 2.0].met is True
    # 1.25x: deficit / limit 0.25, below the capped results (0.5 to 3): not comparable.
    low = goals["nocap_vs_capped", 1.25]
    assert low.met is None and low.value is None and low.gap == "not comparable"
    assert "outside the capped results" in low.note
    # 1.5x: 0.5, capped 44%: 90% is 2.05x it; 2x: 1.0, capped 45%: 40% is below.
    mid = goals["nocap_vs_capped", 1.5]
    assert mid.value == pytest.approx(0.9 / 0.44) and mid.met is True
    assert mid.target == ">= 1.00x capped" and mid.gap == "+46.0 points"
    assert "capped at deficit/limit 0.50: 44.0%" in mid.note
    high = goals["nocap_vs_capped", 2.0]
    assert high.value == pytest.approx(0.4 / 0.45) and high.met is False
    assert "the capped run was on" not in high.note

    other_device = compare.evaluate_nocap_goals(rows, [2.0], REFERENCE, "Other GPU")
    assert "the capped run was on Fake GPU" in other_device[2].note
    unusable = CappedReference("x", reason="the capped run trained 'a', this run 'b'")
    for reference, why in ((unusable, "the capped run trained"), (None, "no capped results")):
        goal = compare.evaluate_nocap_goals(rows, [2.0], reference)[2]
        assert goal.met is None and goal.gap == "not comparable" and why in goal.note

    # A row that did not train is not measured, whatever the reference.
    rows[2] = Measurement("gpt", "lms", 2.0, None, 100, status="oom", detail="OOM in conv")
    for g in compare.evaluate_nocap_goals(rows, [2.0], REFERENCE):
        assert g.met is None and g.gap == "not measured" and "OOM in conv" in g.note
    # Records and the goals table format the efficiency as a percentage.
    records = [compare.goal_record("gpt", g) for g in goals.values()]
    table = compare.goals_markdown(records)
    assert "| gpt | nocap_efficiency | 1.25x | 80.0% | >= 85% | no | -5.0 points |" in table
    assert "| gpt | nocap_vs_capped | 1.5x | 2.05x | >= 1.00x capped | yes |" in table


def test_goal_help_names_the_nocap_goals() -> None:
    text = compare.goals_help()
    for target in (
        "nocap_efficiency: LMS at >= 85%",
        "nocap_out_vs_deficit: bytes LMS pages out per iteration <= 1.25x",
        "nocap_vs_capped: that efficiency >= 1.00x capped",
        "not comparable",
    ):
        assert target in text, target
    assert "--regime nocap" in compare.build_parser().format_help()


# ---------------------------------------------------------------------------------------
# The run, with fake training
# ---------------------------------------------------------------------------------------

# The fake model's truth: peak 3 GiB + 0.5 GiB per sample, 2 GiB left after step 0; 10 ms of
# compute per sample. Device 42 GiB, 2 GiB used at start: D = 40 GiB.
MEMORY = DeviceMemory(total_bytes=42 * GiB, free_bytes=40 * GiB)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeGpu:
    """Trains nothing: fills each row as train_measure would, advancing the fake clock."""

    def __init__(self, clock: FakeClock, json_path: Path, stop_at: tuple[str, float] | None = None):
        self.clock = clock
        self.json_path = json_path
        self.stop_at = stop_at
        self.trained: list[tuple[str, float | None, int, bool]] = []

    def train(self, m: Measurement, lms: Any) -> None:
        # The row is on disk, marked as running, before it trains.
        on_disk = json.loads(self.json_path.read_text())["measurements"][-1]
        assert (on_disk["method"], on_disk["status"]) == (m.method, "running")
        assert on_disk["detail"] == compare.RUNNING_DETAIL
        assert m.status == "running" and m.detail == ""
        self.trained.append((m.method, m.factor, m.batch, lms is not None))
        self.clock.now += 20.0
        if self.stop_at == (m.method, m.factor):
            raise SystemExit("compare.py: stopped by signal 15")
        if m.method == "checkpoint" and m.factor == 2.0:
            m.status, m.detail = "oom", "OutOfMemoryError: fake"
            return
        compute = 0.01 * m.batch
        moved = 0.0
        if m.method in compare.FIT_METHODS:
            m.peak_allocated_bytes = 3 * GiB + m.batch * GiB // 2
            m.static_bytes = 2 * GiB
            seconds = compute
        elif m.method == "checkpoint":
            seconds = compute * 1.3
        else:
            assert m.deficit_bytes is not None
            moved = 1.1 * m.deficit_bytes if m.method == "lms" else 2.0 * m.deficit_bytes
            seconds = 1.25 * max(compute, compare.serial_copy_seconds(moved, moved, BW))
            m.stall_ms_per_iter = 10.0
            m.host_pinned_peak_bytes = int(moved)
            if m.method == "lms_hybrid":  # a quarter of the deficit dropped and recomputed
                m.drop_bytes_per_iter = m.recompute_bytes_per_iter = m.deficit_bytes / 4
                m.recompute_ms_per_iter = 12.0
        m.out_bytes_per_iter = m.in_bytes_per_iter = moved
        m.first_iteration_s = 3 * seconds
        m.warmup_times = [3 * seconds, seconds, seconds, seconds]
        m.iteration_times = [seconds] * 3
        m.alloc_retries, m.alloc_retries_timed = 2, 0
        m.finish_timing()


def nocap_args(out: Path, *extra: str) -> Any:
    parser = compare.build_parser()
    args = parser.parse_args(["--model", "gpt", "--regime", "nocap", "--out", str(out), *extra])
    compare.check_args(args)
    return args


def make_run(
    tmp_path: Path,
    *extra: str,
    stop_at: tuple[str, float] | None = None,
    saved_bytes: Any = None,
) -> tuple[NocapRun, FakeGpu, list[str]]:
    clock = FakeClock()
    gpu = FakeGpu(clock, tmp_path / "nocap-gpt.json", stop_at)
    lines: list[str] = []
    run = NocapRun(
        nocap_args(tmp_path, *extra),
        description="fake",
        batch=8,
        env=ENV,
        memory=MEMORY,
        bw=BW,
        train=gpu.train,
        lms_backend="extension",
        reference=REFERENCE,
        saved_bytes=saved_bytes,
        host_available=lambda: 64 * GiB,  # with 4 GiB kept free: 60 GiB of pinned memory
        clock=clock,
        log=lines.append,
    )
    return run, gpu, lines


def test_nocap_run_with_fake_training(tmp_path: Path) -> None:
    run, gpu, lines = make_run(tmp_path, "--time-budget-s", "100000")
    assert run.run() == 0
    # The fitting runs: batch 8, then 32 (4 x 8, under 70% of the device); the fit finds the
    # true 3 GiB + 0.5 GiB per sample, so the batches are those of test_nocap_plan.
    assert gpu.trained[:2] == [("baseline", None, 8, False), ("baseline_fit", None, 32, False)]
    assert run.model is not None and run.model.per_sample_bytes == pytest.approx(0.5 * GiB)
    by = {(m.method, m.factor): m for m in run.rows}
    assert [by["lms", f].batch for f in (1.25, 1.5, 2.0)] == [94, 114, 154]
    assert ("lms_reactive", 2.0) not in by  # not a default of this regime
    assert all(lms for method, _, _, lms in gpu.trained if method == "lms")
    # Offload at 2x would pin at least 154 x 0.5 = 77 GiB: over the 60 GiB the host allows.
    skipped = by["offload", 2.0]
    assert skipped.status == "skipped" and skipped.detail.startswith("host memory: needs about")
    assert by["checkpoint", 2.0].status == "oom"
    lms2 = by["lms", 2.0]
    assert (lms2.need_bytes, lms2.limit_bytes, lms2.deficit_bytes) == (80 * GiB, 40 * GiB, 40 * GiB)
    assert lms2.row_s == pytest.approx(20.0) and lms2.cap_bytes is None
    assert lms2.deficit_efficiency is not None and lms2.serial_efficiency is not None
    assert any("== 2x: batch 154, need 80.00 GiB (estimate), deficit 40.00 GiB" in x for x in lines)

    data = json.loads((tmp_path / "nocap-gpt.json").read_text())
    assert data["regime"] == "nocap" and data["batch"] == 8
    for key in ("engine_commit", "engine_dirty", "driver", "torch", "cuda", "device", "date"):
        assert key in data["environment"], key
    assert data["device_memory"] == MEMORY.record()
    assert data["memory_model"]["source"].startswith("fit of batches 8 and 32")
    assert [p["batch"] for p in data["plans"]] == [94, 114, 154]
    assert all(p["need_is_estimate"] for p in data["plans"])
    assert data["compute"]["s_per_sample"] == pytest.approx(0.01)
    assert data["compute"]["from_batch"] == 32
    assert data["capped_reference"] == REFERENCE.record()
    assert data["config"]["warmup"] == 4 and data["config"]["iterations"] == 3
    assert data["config"]["factors"] == [1.25, 1.5, 2.0]
    assert {e["method"] for e in data["time_estimates"]} >= {"baseline_fit", "lms"}
    record = next(r for r in data["measurements"] if r["method"] == "lms" and r["factor"] == 2.0)
    assert record["first_iteration_s"] == pytest.approx(3 * lms2.iteration_times[0])
    assert len(record["warmup_times"]) == 4 and record["alloc_retries"] == 2
    assert record["host_pinned_peak_bytes"] == int(1.1 * 40 * GiB)

    with (tmp_path / "nocap-gpt.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == (
            *compare.NOCAP_MEASUREMENT_COLUMNS,
            *compare.NOCAP_ENV_COLUMNS,
        )
        csv_rows = list(reader)
    assert len(csv_rows) == len(run.rows)
    lms_csv = next(r for r in csv_rows if r["method"] == "lms" and r["factor"] == "2")
    assert lms_csv["need_gib"] == "80.000" and lms_csv["limit_gib"] == "40.000"
    assert lms_csv["engine_commit"] == "0" * 40 and lms_csv["driver"] == "999.1"
    with (tmp_path / "nocap-gpt-goals.csv").open(newline="") as f:
        goal_rows = list(csv.DictReader(f))
    assert {(r["goal"], r["factor"]) for r in goal_rows} == {
        (g, f)
        for g in ("nocap_efficiency", "nocap_out_vs_deficit", "nocap_vs_capped")
        for f in ("1.25", "1.5", "2")
    }
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "nocap-gpt.png").read_bytes().startswith(b"\x89PNG")
    assert not list(tmp_path.glob(".*.tmp*"))  # every file replaced whole

    # --rescore reads the run back and writes the same goals (a nocap JSON alone, by folder
    # and model, or by path).
    written = (tmp_path / "nocap-gpt-goals.csv").read_text()
    (tmp_path / "nocap-gpt-goals.csv").unlink()
    assert compare.main(["--rescore", str(tmp_path)]) == 0
    assert (tmp_path / "nocap-gpt-goals.csv").read_text() == written
    assert compare.main(["--rescore", str(tmp_path), "--model", "gpt"]) == 0
    assert compare.main(["--rescore", str(tmp_path / "nocap-gpt.json")]) == 0
    assert (tmp_path / "nocap-gpt-goals.csv").read_text() == written
    back = compare.load_run(tmp_path / "nocap-gpt.json")
    assert back.regime == "nocap" and back.factors == [1.25, 1.5, 2.0]
    assert [asdict_row(m) for m in back.rows] == [asdict_row(m) for m in run.rows]


def asdict_row(m: Measurement) -> dict[str, Any]:
    from dataclasses import asdict

    return json.loads(json.dumps(asdict(m)))


def test_rescore_nocap_against_another_capped_folder(tmp_path: Path) -> None:
    run, _, _ = make_run(tmp_path, "--time-budget-s", "100000")
    run.run()
    capped = tmp_path / "capped"
    capped.mkdir()
    # A capped run of another workload: every comparison becomes "not comparable".
    path = COMMITTED / "compare-gpt.json"
    if not path.is_file():
        pytest.skip("no committed GPT capped results")
    shutil.copy(path, capped / "compare-gpt.json")
    assert compare.main(["--rescore", str(tmp_path), "--capped-results", str(capped)]) == 0
    with (tmp_path / "nocap-gpt-goals.csv").open(newline="") as f:
        vs = [r for r in csv.DictReader(f) if r["goal"] == "nocap_vs_capped"]
    assert {r["gap"] for r in vs} == {"not comparable"}
    assert all("the capped run trained" in r["note"] for r in vs)
    assert compare.main(["--rescore", str(tmp_path), "--model", "vit_l"]) == 2


def test_nocap_run_measures_saved_bytes_for_the_host_estimate(tmp_path: Path) -> None:
    # Autograd saves 0.6 GiB per sample (more than the 0.5 GiB of the memory model): offload
    # and save_on_cpu would pin 94 x 0.6 = 56.4 GiB at 1.25x (allowed: 60), 68.4 at 1.5x (not).
    calls: list[int] = []

    def saved(batch: int) -> int:
        calls.append(batch)
        return int(batch * 0.6 * GiB)

    run, gpu, lines = make_run(tmp_path, "--time-budget-s", "100000", saved_bytes=saved)
    assert run.run() == 0
    assert calls == [8]  # once, at the fitting batch
    assert run.saved_per_sample == pytest.approx(0.6 * GiB)
    by = {(m.method, m.factor): m for m in run.rows}
    for method in compare.HOST_COPY_METHODS:
        assert by[method, 1.25].status == "ok"
        assert by[method, 1.5].status == "skipped" and "68.4 GiB" in by[method, 1.5].detail
    assert any("autograd saves 4.80 GiB at batch 8" in x for x in lines)
    data = json.loads((tmp_path / "nocap-gpt.json").read_text())
    assert data["saved_bytes_per_sample"] == pytest.approx(0.6 * GiB)
    # The rows run method by method, LMS first.
    order = [(m, f) for m, f, _, _ in gpu.trained[2:]]
    assert order[:3] == [("lms", 1.25), ("lms", 1.5), ("lms", 2.0)]

    # Not measured (it failed, or no rival among the methods): the memory model's estimate.
    def broken(batch: int) -> int:
        raise RuntimeError("CUDA error")

    run, _, lines = make_run(tmp_path, "--time-budget-s", "100000", saved_bytes=broken)
    assert run.run() == 0 and run.saved_per_sample is None
    assert any("saved-tensor bytes not measured: RuntimeError: CUDA error" in x for x in lines)
    calls.clear()
    run, _, _ = make_run(tmp_path, "--methods", "lms,checkpoint", saved_bytes=saved)
    assert run.run() == 0 and calls == []


def test_nocap_run_plans_lms_hybrid_like_lms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, gpu, _ = make_run(tmp_path, "--time-budget-s", "100000")
    assert run.args.methods == compare.NOCAP_METHODS and "lms_hybrid" in run.args.methods
    settings: dict[tuple[str, float | None], Any] = {}
    train = run.train

    def spy(m: Measurement, lms: Any) -> None:
        settings[m.method, m.factor] = lms
        train(m, lms)

    run.train = spy
    assert run.run() == 0
    factors = (1.25, 1.5, 2.0)
    by = {(m.method, m.factor): m for m in run.rows}
    for f in factors:
        hybrid, lms = by["lms_hybrid", f], by["lms", f]
        assert hybrid.status == "ok" and hybrid.batch == lms.batch
        assert (hybrid.need_bytes, hybrid.deficit_bytes) == (lms.need_bytes, lms.deficit_bytes)
        # LMS's settings, learned schedule on (recompute is train_measure's to set).
        assert settings["lms_hybrid", f] == settings["lms", f] and settings["lms", f].schedule
        assert hybrid.deficit_efficiency is not None
    # Method by method, LMS first: lms, lms_hybrid, then the rivals.
    order = [(m, f) for m, f, _, _ in gpu.trained[2:]]
    assert order[:6] == [("lms", f) for f in factors] + [("lms_hybrid", f) for f in factors]
    # Its host and time estimates are lms's: it moves at most what lms moves.
    plan = NocapPlan(2.0, 154, 80 * GiB, 40 * GiB)
    host = compare.nocap_host_bytes("lms", plan, 0.5 * GiB)
    assert compare.nocap_host_bytes("lms_hybrid", plan, 0.5 * GiB) == host > 0
    assert compare.nocap_row_estimate(
        "lms_hybrid", plan, 0.5 * GiB, 0.01, BW, 7
    ) == compare.nocap_row_estimate("lms", plan, 0.5 * GiB, 0.01, BW, 7)
    # The recompute figures: in the JSON, the CSV and the printed table.
    data = json.loads((tmp_path / "nocap-gpt.json").read_text())
    record = next(
        r for r in data["measurements"] if r["method"] == "lms_hybrid" and r["factor"] == 2.0
    )
    assert record["drop_bytes_per_iter"] == 10 * GiB and record["recompute_ms_per_iter"] == 12.0
    with (tmp_path / "nocap-gpt.csv").open(newline="") as f:
        rows = {(r["method"], r["factor"]): r for r in csv.DictReader(f)}
    assert rows["lms_hybrid", "2"]["drop_gib_per_iter"] == "10.000"
    assert rows["lms_hybrid", "2"]["recompute_gib_per_iter"] == "10.000"
    assert rows["lms_hybrid", "2"]["recompute_ms_per_iter"] == "12.00"
    assert rows["lms", "2"]["drop_gib_per_iter"] == ""
    out = capsys.readouterr().out
    assert compare.RECOMPUTE_HEADER in out and "10.000 / 10.000, 12.00 ms" in out


def test_nocap_run_skips_what_the_time_budget_cannot_hold(tmp_path: Path) -> None:
    # 40 s: the baseline always runs (20 s of fake time); the fit's estimate, 2 x (10 s + 7 x
    # 0.32 s), does not fit the 5 s left after the final save's reserve: the batches come
    # from the one-batch model, and no factor's row starts.
    run, gpu, _ = make_run(tmp_path, "--time-budget-s", "40")
    assert run.run() == 0
    assert [t[0] for t in gpu.trained] == ["baseline"]
    assert run.model is not None and "second batch 32 not measured (skipped)" in run.model.source
    rest = run.rows[1:]
    assert len(rest) == 1 + 3 * len(compare.NOCAP_METHODS)
    for m in rest:
        assert m.status == "skipped", (m.method, m.factor, m.status)
    # offload and save_on_cpu at 2x (124 x 0.625 = 77.5 GiB) fail the host check first
    host = [m for m in rest if m.detail.startswith("host memory")]
    assert {(m.method, m.factor) for m in host} == {("offload", 2.0), ("save_on_cpu", 2.0)}
    others = [m for m in rest if m not in host]
    assert all(m.detail.startswith("time budget: needs about") for m in others)
    data = json.loads((tmp_path / "nocap-gpt.json").read_text())
    assert data["measurements"][0]["status"] == "ok"
    goals = {(g["goal"], g["factor"]): g for g in data["goals"]}
    assert goals["nocap_efficiency", 1.5]["met"] is None
    assert "time budget" in goals["nocap_efficiency", 1.5]["note"]


def test_nocap_run_stopped_during_a_row_leaves_valid_files(tmp_path: Path) -> None:
    run, gpu, _ = make_run(tmp_path, "--time-budget-s", "100000", stop_at=("lms", 1.5))
    with pytest.raises(SystemExit):
        run.run()
    data = json.loads((tmp_path / "nocap-gpt.json").read_text())
    last = data["measurements"][-1]
    assert (last["method"], last["factor"], last["status"]) == ("lms", 1.5, "stopped")
    assert last["iteration_times"] == [] and last["row_s"] == pytest.approx(20.0)
    goals = {(g["goal"], g["factor"]): g for g in data["goals"]}
    assert goals["nocap_efficiency", 1.25]["met"] is not None  # measured before the stop
    assert "stopped" in goals["nocap_efficiency", 1.5]["note"]
    assert gpu.trained[-1][:2] == ("lms", 1.5)


def test_nocap_run_without_a_baseline_or_lms(tmp_path: Path) -> None:
    run, _, lines = make_run(tmp_path, "--time-budget-s", "100000")

    def fail(m: Measurement, lms: Any) -> None:
        m.status, m.detail = "oom", "OutOfMemoryError: fake"

    run.train = fail
    assert run.run() == 1
    assert any("the uncapped baseline failed" in x for x in lines)
    assert json.loads((tmp_path / "nocap-gpt.json").read_text())["goals"] == []

    run, _, _ = make_run(tmp_path, "--time-budget-s", "100000", "--methods", "lms,lms_reactive")
    run.lms_backend, run.lms_reason = "", "no torch_lms"
    assert run.run() == 0
    lms_rows = [m for m in run.rows if m.method in compare.LMS_METHODS]
    assert len(lms_rows) == 6 and all(m.detail == "LMS unavailable: no torch_lms" for m in lms_rows)


def test_nocap_slowdown_learns_from_the_rows(tmp_path: Path) -> None:
    run, _, _ = make_run(tmp_path)
    assert run.slowdown("lms") == compare.NOCAP_PRIOR_SLOWDOWN
    run.observed = {"baseline_fit": [0.5], "lms": [1.2, 3.0]}
    assert run.slowdown("lms") == pytest.approx(compare.NOCAP_OBSERVED_MARGIN * 3.0)
    assert run.slowdown("checkpoint") == pytest.approx(3.0)  # the largest of another method
    run.observed = {"baseline_fit": [5.0]}  # the fitting runs say nothing of the methods
    assert run.slowdown("checkpoint") == compare.NOCAP_PRIOR_SLOWDOWN
    run.host_available = lambda: None
    assert run.host_room() == int(96 * GiB)


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------


def test_nocap_arguments() -> None:
    args = nocap_args(Path("unused"))
    assert args.factors == [1.25, 1.5, 2.0] and args.methods == compare.NOCAP_METHODS
    assert (args.warmup, args.iterations) == (4, 3)
    assert args.linearity_check is True and args.search is False and args.overhead is False
    args = nocap_args(Path("x"), "--methods", "lms,lms_reactive", "--factors", "3", "--warmup", "6")
    assert args.methods == ("lms", "lms_reactive") and args.factors == [3.0] and args.warmup == 6
    assert nocap_args(Path("x"), "--no-linearity-check").linearity_check is False
    parser = compare.build_parser()
    for extra, message in (
        (["--lms-limit-frac", "0.8"], "--regime nocap sets no cap"),
        (["--search"], "--search belongs to --regime capped"),
        (["--overhead"], "--overhead belongs to --regime capped"),
    ):
        with pytest.raises(ValueError, match=message):
            compare.check_args(parser.parse_args(["--model", "gpt", "--regime", "nocap", *extra]))
    with pytest.raises(ValueError, match="--linearity-check belongs to --regime nocap"):
        compare.check_args(parser.parse_args(["--model", "gpt", "--linearity-check"]))
    with pytest.raises(ValueError, match="--capped-results is what"):
        compare.check_args(parser.parse_args(["--model", "gpt", "--capped-results", "x"]))
    # --rescore takes --capped-results; the capped regime keeps its defaults.
    compare.check_args(parser.parse_args(["--rescore", "x", "--capped-results", "y"]))
    capped = parser.parse_args(["--model", "gpt"])
    compare.check_args(capped)
    assert capped.factors == [1.5, 2.0, 4.0, 8.0] and capped.linearity_check is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "gpt", "--regime", "none"])
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--model", "gpt", "--regime", "nocap", "--lms-limit-frac", "0.5"])
    assert exit_info.value.code == 2
    # The per-regime defaults are not shared lists.
    nocap_args(Path("x")).factors.append(9.0)
    assert compare.REGIME_DEFAULTS["nocap"]["factors"] == [1.25, 1.5, 2.0]


def test_help_shows_both_regimes_defaults() -> None:
    text = " ".join(compare.build_parser().format_help().split())
    assert "(default: capped 1.5,2,4,8, nocap 1.25,1.5,2)" in text
    assert "(default: capped 6, nocap 4)" in text and "(default: capped 5, nocap 3)" in text
    assert "(default: None)" not in text


# ---------------------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------------------


def test_porcelain_dirty() -> None:
    assert not lms_setup.porcelain_dirty("")
    assert not lms_setup.porcelain_dirty("?? out/x.json\n?? benchmarks/results/nocap/a.csv\n")
    assert lms_setup.porcelain_dirty("?? benchmarks/new.py\n")
    assert lms_setup.porcelain_dirty(
        " M benchmarks/results/compare/2026-11-24-h100-unrecorded/compare-gpt.csv\n"
    )
    assert lms_setup.porcelain_dirty("R  a.py -> b.py\n")


def test_provenance_without_git_or_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("no such program")

    monkeypatch.setattr(lms_setup.subprocess, "run", missing)
    monkeypatch.delenv("LMS_ENGINE_COMMIT", raising=False)
    found = lms_setup.provenance()
    assert len(found.pop("engine_sources_sha256")) == 64  # from the files, not git
    assert found == {"engine_commit": "unknown", "engine_dirty": "unknown", "driver": "unknown"}


def test_provenance_from_the_sender(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A copy whose .git is stale: the commit and dirty flag the sender gives win."""
    monkeypatch.setenv("LMS_ENGINE_COMMIT", "ac61784")
    monkeypatch.setenv("LMS_ENGINE_DIRTY", "0")
    found = lms_setup.provenance(tmp_path)
    assert found["engine_commit"] == "ac61784" and found["engine_dirty"] is False
    assert found["engine_sources_sha256"] == "unknown"  # no engine/ in tmp_path
    monkeypatch.setenv("LMS_ENGINE_DIRTY", "1")
    assert lms_setup.provenance(tmp_path)["engine_dirty"] is True
    monkeypatch.delenv("LMS_ENGINE_DIRTY")
    assert lms_setup.provenance(tmp_path)["engine_dirty"] == "unknown"


def test_engine_sources_hash_follows_the_files(tmp_path: Path) -> None:
    (tmp_path / "engine" / "c10").mkdir(parents=True)
    (tmp_path / "engine" / "c10" / "a.cpp").write_text("int a;\n")
    first = lms_setup.engine_sources_sha256(tmp_path)
    assert first == lms_setup.engine_sources_sha256(tmp_path)
    (tmp_path / "engine" / "c10" / "a.cpp").write_text("int b;\n")
    assert lms_setup.engine_sources_sha256(tmp_path) != first


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_provenance_of_a_checkout(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LMS_ENGINE_COMMIT", raising=False)

    def git(*argv: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *argv], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "r.json").write_text("{}")
    first = lms_setup.provenance(tmp_path)
    assert len(first["engine_commit"]) == 40 and first["engine_dirty"] is False
    assert first["driver"]  # a version, or "unknown" without nvidia-smi
    (tmp_path / "a.py").write_text("x = 2\n")
    assert lms_setup.provenance(tmp_path)["engine_dirty"] is True
    assert lms_setup.provenance(tmp_path / "out")["engine_dirty"] is True  # the same repo
    plain = lms_setup.provenance(tmp_path_factory.mktemp("not-a-checkout"))
    assert plain["engine_commit"] == "unknown" and plain["engine_dirty"] == "unknown"


def test_environment_records_provenance() -> None:
    pytest.importorskip("torch", reason="environment() reads torch's versions")
    env = lms_setup.environment()
    for key in ("engine_commit", "engine_dirty", "driver", "torch", "cuda", "date"):
        assert key in env, key


def test_nocap_row_order_and_prior_slowdown_are_options(tmp_path: Path) -> None:
    args = ("--time-budget-s", "100000", "--methods", "checkpoint,lms", "--factors", "1.5,2")
    run, gpu, _ = make_run(tmp_path, *args)
    assert run.run() == 0
    measured = [(m, f) for m, f, _, _ in gpu.trained if f is not None]
    assert measured == [("checkpoint", 1.5), ("checkpoint", 2.0), ("lms", 1.5), ("lms", 2.0)]
    run, gpu, _ = make_run(tmp_path, *args, "--row-order", "factors", "--prior-slowdown", "1.1")
    assert run.slowdown("lms") == pytest.approx(1.1)
    assert run.run() == 0
    measured = [(m, f) for m, f, _, _ in gpu.trained if f is not None]
    assert measured == [("checkpoint", 1.5), ("lms", 1.5), ("checkpoint", 2.0), ("lms", 2.0)]
    parser = compare.build_parser()
    for option in (["--row-order", "factors"], ["--prior-slowdown", "1.5"]):
        capped = parser.parse_args(["--model", "gpt", *option])
        with pytest.raises(ValueError, match="belongs to --regime nocap"):
            compare.check_args(capped)
