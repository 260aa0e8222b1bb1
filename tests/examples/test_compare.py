"""benchmarks/compare.py: roofline and efficiency arithmetic, goals, tables, files — from fake
measurements, no GPU."""

from __future__ import annotations

import csv
from pathlib import Path

import compare
import pytest
from compare import (
    Bandwidth,
    Measurement,
    batch_bounds,
    cap_bytes,
    copy_seconds,
    efficiency,
    evaluate_goals,
    fill_roofline,
    overhead,
    roofline_seconds,
)

GB = 1e9
GiB = 1 << 30
BW = Bandwidth(d2h=50 * GB, h2d=40 * GB, bidirectional=80 * GB)


def test_copy_seconds_takes_the_binding_direction() -> None:
    assert copy_seconds(0, 0, BW) == 0
    assert copy_seconds(100 * GB, 0, BW) == pytest.approx(2.0)  # D2H alone
    assert copy_seconds(0, 100 * GB, BW) == pytest.approx(2.5)  # H2D alone
    # both ways: each direction alone would take 2.0 and 2.5 s, together 200/80 = 2.5 s
    assert copy_seconds(100 * GB, 100 * GB, BW) == pytest.approx(2.5)
    slow_both = Bandwidth(d2h=50 * GB, h2d=50 * GB, bidirectional=60 * GB)
    assert copy_seconds(100 * GB, 100 * GB, slow_both) == pytest.approx(200 / 60)


def test_allocator_flushes_per_iteration() -> None:
    before = {"num_alloc_retries": 10, "num_ooms": 4}
    after = {"num_alloc_retries": 40, "num_ooms": 9}
    assert compare.allocator_flushes(before, after, 5) == (", allocator 6 retries and 1 OOMs/iter")
    # A torch without the counters reports none rather than failing the row.
    assert compare.allocator_flushes({}, {}, 5) == ", allocator 0 retries and 0 OOMs/iter"


def test_roofline_is_compute_or_copies() -> None:
    # 10 ms per sample, batch 8: 80 ms of compute
    assert roofline_seconds(0.010, 8, 1 * GB, 1 * GB, BW) == pytest.approx(0.080)
    assert roofline_seconds(0.010, 8, 10 * GB, 10 * GB, BW) == pytest.approx(0.25)
    assert efficiency(0.25, 0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        roofline_seconds(0.0, 8, 0, 0, BW)
    with pytest.raises(ValueError):
        efficiency(1.0, 0.0)
    with pytest.raises(ValueError):
        copy_seconds(-1, 0, BW)
    with pytest.raises(ValueError):
        copy_seconds(1, 0, Bandwidth(0.0, 1.0, 1.0))


def test_overhead_and_caps() -> None:
    assert overhead(1.02, [1.0, 1.0]) == pytest.approx(0.02)
    assert overhead(0.99, [1.0]) == pytest.approx(-0.01)
    with pytest.raises(ValueError):
        overhead(1.0, [])
    assert cap_bytes(40 * GiB, 2) == 20 * GiB
    assert cap_bytes(30 * GiB, 1.5) == 20 * GiB
    with pytest.raises(ValueError):
        cap_bytes(GiB, 1.0)


def test_batch_bounds_linear_memory_model() -> None:
    # batch 8, 2 GiB static, 1 GiB per sample: peak 10 GiB
    start, upper = batch_bounds(8, 10 * GiB, 2 * GiB, 5 * GiB, 32 * GiB)
    assert start == 3  # (5 - 2) GiB / 1 GiB
    assert upper == 35  # (5 + 32 - 2) GiB / 1 GiB
    start, _ = batch_bounds(8, 10 * GiB, 2 * GiB, GiB, 0)
    assert start == 1  # never below 1
    with pytest.raises(ValueError):
        batch_bounds(8, GiB, 2 * GiB, GiB, 0)


def ok(
    method: str,
    factor: float | None,
    batch: int,
    seconds: float,
    out: float = 0.0,
    inn: float = 0.0,
    largest: int | None = None,
    note: str = "",
) -> Measurement:
    m = Measurement(
        "gpt",
        method,
        factor,
        None if factor is None else int(8 * GiB / factor),
        batch,
        iteration_times=[seconds * 1.1, seconds, seconds * 0.9],
        out_bytes_per_iter=out,
        in_bytes_per_iter=inn,
        largest_batch=largest,
        largest_batch_note=note,
    )
    m.finish_timing()
    return m


def fake_rows() -> list[Measurement]:
    return [
        ok("baseline", None, 8, 0.100),
        ok("lms_fits", None, 8, 0.101),
        ok("baseline_repeat", None, 8, 0.099),
        # 2x: LMS moves 10 GB each way: roofline 0.25 s, measured 0.3125 s -> 80%
        ok("lms", 2.0, 8, 0.3125, 10 * GB, 10 * GB, largest=40, note="within 10%"),
        ok("save_on_cpu", 2.0, 8, 0.5, 12 * GB, 12 * GB),
        ok("checkpoint", 2.0, 8, 0.25),
        ok("no_lms", 2.0, 3, 0.04, largest=3),
        # 4x: save_on_cpu and checkpoint run out of memory; no-LMS trains nothing
        # 4x: 20 GB each way: roofline 40 GB / 80 GB/s = 0.5 s, measured 0.625 s -> 80%
        ok("lms", 4.0, 8, 0.625, 20 * GB, 20 * GB, largest=30),
        Measurement("gpt", "save_on_cpu", 4.0, 2 * GiB, 8, status="oom", detail="OOM"),
        Measurement("gpt", "checkpoint", 4.0, 2 * GiB, 8, status="oom", detail="OOM"),
        Measurement("gpt", "no_lms", 4.0, 2 * GiB, 0, status="oom", largest_batch=0),
    ]


def test_fill_roofline_and_efficiency() -> None:
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    by = {(m.method, m.factor): m for m in rows}
    assert by["baseline", None].efficiency == pytest.approx(1.0)
    assert by["lms", 2.0].roofline_s == pytest.approx(0.25)
    assert by["lms", 2.0].efficiency == pytest.approx(0.8)
    assert by["checkpoint", 2.0].efficiency == pytest.approx(0.4)  # recompute: 0.1 s -> 0.25 s
    assert by["no_lms", 2.0].roofline_s == pytest.approx(0.0375)  # 3 samples of compute
    assert by["save_on_cpu", 4.0].efficiency is None  # not measured
    assert by["lms", 2.0].samples_per_s == pytest.approx(8 / 0.3125)


def test_goals_from_fake_measurements() -> None:
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    goals = {(g.goal, g.factor): g for g in evaluate_goals(rows, [2.0, 4.0])}

    eff = goals["lms_efficiency", 2.0]
    assert eff.value == pytest.approx(0.8) and eff.met is False
    assert eff.gap == "-10.0 points"
    assert goals["lms_efficiency", 4.0].value == pytest.approx(0.8)
    assert goals["lms_efficiency", 4.0].met is False

    soc = goals["lms_faster_than_save_on_cpu", 2.0]
    assert soc.value == pytest.approx(0.5 / 0.3125) and soc.met is True
    ck = goals["lms_faster_than_checkpoint", 2.0]
    assert ck.value == pytest.approx(0.25 / 0.3125) and ck.met is False
    assert ck.gap == "-20.0%"
    assert goals["lms_faster_than_checkpoint", 4.0].met is True
    assert goals["lms_faster_than_checkpoint", 4.0].value is None
    assert "ran out of memory" in goals["lms_faster_than_checkpoint", 4.0].note

    ratio = goals["largest_batch_ratio", 2.0]
    assert ratio.value == pytest.approx(40 / 3) and ratio.met is True
    assert ratio.note == "within 10%"
    nothing = goals["largest_batch_ratio", 4.0]
    assert nothing.value is None and nothing.met is True
    assert "not even batch 1" in nothing.note

    over = goals["overhead_when_fitting", None]
    assert over.value == pytest.approx(0.101 / 0.0995 - 1)
    assert over.gap == "+0.5 points"
    assert over.met is True
    assert "differ by 1.0%" in over.note


def test_efficiency_above_the_roofline_is_reported_and_flagged() -> None:
    rows = fake_rows()
    rows[7] = ok("lms", 4.0, 8, 0.4, 20 * GB, 20 * GB)  # faster than 0.5 s of copies
    fill_roofline(rows, 0.100 / 8, BW)
    assert rows[7].efficiency == pytest.approx(1.25)
    goal = next(g for g in evaluate_goals(rows, [4.0]) if g.goal == "lms_efficiency")
    assert goal.value == pytest.approx(1.25) and goal.met is True
    assert "above the roofline" in goal.note


def test_goals_not_measured_are_not_guessed() -> None:
    rows = [
        ok("baseline", None, 8, 0.1),
        Measurement("gpt", "lms", 2.0, GiB, 8, status="skipped", detail="time budget"),
    ]
    goals = evaluate_goals(rows, [2.0])
    assert all(g.met is None and g.value is None for g in goals)
    assert {g.goal for g in goals} == {
        "lms_efficiency",
        "lms_faster_than_save_on_cpu",
        "lms_faster_than_checkpoint",
        "largest_batch_ratio",
        "overhead_when_fitting",
    }
    assert "time budget" in goals[0].note


def test_records_tables_and_csv(tmp_path: Path) -> None:
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    records = [compare.measurement_record(m) for m in rows]
    lms2 = records[3]
    assert lms2["method"] == "lms" and lms2["factor"] == "2"
    assert lms2["iteration_ms"] == "312.50"
    assert lms2["out_gib_per_iter"] == f"{10 * GB / GiB:.3f}"
    assert lms2["efficiency"] == "0.800"
    assert records[0]["factor"] == "" and records[0]["cap_gib"] == ""
    table = compare.measurements_markdown(records)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("| model | method | oversubscription |")
    assert "| 80% |" in lines[5]
    assert "40 (within 10%)" in lines[5]
    assert "uncapped" in lines[2]
    assert "oom: OOM" in table

    goals = evaluate_goals(rows, [2.0, 4.0])
    goal_records = [compare.goal_record("gpt", g) for g in goals]
    gtable = compare.goals_markdown(goal_records)
    assert "| gpt | lms_efficiency | 2x | 80.0% | >= 90% | no | -10.0 points |" in gtable
    assert "not measured" not in gtable

    env = {
        "device": "Fake GPU",
        "torch": "9.9",
        "cuda": "13.0",
        "lms_backend": "extension",
        "date": "2030-01-01T00:00:00+00:00",
    }
    path = tmp_path / "compare-gpt.csv"
    compare.write_csv(path, compare.MEASUREMENT_COLUMNS, records, env)
    with path.open() as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(rows)
    assert back[3]["efficiency"] == "0.800" and back[3]["device"] == "Fake GPU"


def test_markdown_escapes_pipes() -> None:
    table = compare.markdown_table(("a", "b"), [("x|y", "multi\nline")])
    assert "x\\|y" in table and "multi line" in table


def test_plot_results_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib draws the benchmark chart")
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    png = compare.plot_results(rows, BW, tmp_path / "c.png", "fake")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")
    assert compare.plot_results(rows[:3], BW, tmp_path / "d.png", "uncapped only") is None


def test_parser_and_checks() -> None:
    parser = compare.build_parser()
    args = parser.parse_args(["--model", "gpt", "--factors", "4,1.5,2,2"])
    assert args.factors == [1.5, 2.0, 4.0]
    assert args.warmup == 6 and args.iterations == 5 and args.search
    compare.check_args(args)
    for bad in (
        ["--factors", "1"],
        ["--factors", "x"],
        ["--iterations", "0"],
        ["--lms-limit-frac", "1.5"],
        ["--model", "bert"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "gpt", *bad])
    with pytest.raises(ValueError, match="multiple of --gpt-heads"):
        compare.check_args(parser.parse_args(["--model", "gpt", "--gpt-dim", "100"]))
    with pytest.raises(ValueError, match="divisible by 16"):
        compare.check_args(parser.parse_args(["--model", "vit_l", "--image-size", "200"]))
    with pytest.raises(ValueError, match="go together"):
        compare.check_args(parser.parse_args(["--model", "gpt", "--probe-batch", "2"]))


def test_probe_arguments_rebuild_the_same_configuration() -> None:
    parser = compare.build_parser()
    args = parser.parse_args(
        [
            "--model",
            "vit_l",
            "--image-size",
            "384",
            "--vit-layers",
            "12",
            "--amp",
            "--prefetch",
            "2",
            "--size-mb",
            "4",
            "--optimizer",
            "sgd",
            "--lms-limit-frac",
            "0.7",
        ]
    )
    probe = parser.parse_args(
        [
            *compare.model_argv(args),
            "--probe-batch",
            "5",
            "--probe-cap-bytes",
            "1000",
            "--probe-lms",
        ]
    )
    for key in (
        "model",
        "image_size",
        "vit_layers",
        "amp",
        "prefetch",
        "size_mb",
        "optimizer",
        "lms_limit_frac",
        "classes",
        "oom_retries",
        "probe_iterations",
    ):
        assert getattr(probe, key) == getattr(args, key), key
    assert probe.probe_batch == 5 and probe.probe_lms
    settings = compare.lms_settings(probe, 1000 * (1 << 20))
    assert settings.enabled and settings.limit_mb == 700 and settings.prefetch == 2


def test_no_gpu_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch.cuda", reason="the GPU check needs torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the message on machines without one")
    assert compare.main(["--model", "gpt", "--out", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_methods_option_and_deficit_columns() -> None:
    parser = compare.build_parser()
    args = parser.parse_args(["--model", "gpt"])
    assert args.methods == compare.PEER_METHODS
    assert args.factors == [1.5, 2.0, 4.0, 8.0]
    args = parser.parse_args(["--model", "gpt", "--methods", "lms,offload"])
    assert args.methods == ("lms", "offload")
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "gpt", "--methods", "lms,magic"])
    m = Measurement("gpt", "lms", 4.0, GiB, 8)
    m.out_bytes_per_iter, m.in_bytes_per_iter = 3 * GiB, 3 * GiB
    m.deficit_bytes = 2 * GiB
    m.stall_ms_per_iter = 12.5
    m.lms_schedule = "period 812, 0 fallbacks, 0 demand page-ins/iter"
    record = compare.measurement_record(m)
    assert record["deficit_gib"] == "2.000"
    assert record["out_vs_deficit"] == "1.50"
    assert record["lms_schedule"].startswith("period 812")
    table = compare.measurements_markdown([record])
    assert "deficit GiB" in table and "stall ms/iter" in table and "| 12.50 |" in table


def test_deficit_rooflines_bound_both_ways_and_one_way_at_a_time() -> None:
    # 100 ms of compute (10 ms per sample, batch 10); deficit 4 GB: out at 50 GB/s takes
    # 80 ms, in at 40 GB/s 100 ms, both at once 8 GB / 80 GB/s = 100 ms, one after the other
    # 180 ms.
    m = Measurement("gpt", "lms", 2.0, 10 * GiB, 10)
    m.iteration_s = 0.36
    m.deficit_bytes = int(4 * GB)
    uncapped = Measurement("gpt", "baseline", None, None, 10)
    uncapped.iteration_s = 0.1
    fill_roofline([m, uncapped], 0.01, BW)
    assert m.deficit_roofline_s == pytest.approx(0.1)
    assert m.deficit_efficiency == pytest.approx(0.1 / 0.36)
    assert m.serial_roofline_s == pytest.approx(0.18)
    assert m.serial_efficiency == pytest.approx(0.5)
    assert uncapped.deficit_roofline_s is None and uncapped.serial_efficiency is None
    record = compare.measurement_record(m)
    assert record["serial_efficiency"] == "0.500"
    assert "28% / 50%" in compare.measurements_markdown([record])
    # A record written before these columns existed still renders.
    new = ("deficit_roofline_ms", "deficit_efficiency", "serial_roofline_ms", "serial_efficiency")
    old = {k: v for k, v in record.items() if k not in new}
    assert "| lms |" in compare.measurements_markdown([old])
    with pytest.raises(ValueError):
        compare.serial_copy_seconds(-1, 0, BW)
