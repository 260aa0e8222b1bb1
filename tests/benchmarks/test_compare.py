"""benchmarks/compare.py: roofline and efficiency arithmetic, goals, tables, files — from fake
measurements, no GPU."""

from __future__ import annotations

import csv
import importlib.util
import json
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import compare
from benchmarks.compare import (
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
# The environment columns of a run on no real machine.
FAKE_ENV = {
    "device": "Fake GPU",
    "torch": "9.9",
    "cuda": "13.0",
    "lms_backend": "extension",
    "date": "2030-01-01T00:00:00+00:00",
}


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
    deficit: float | None = None,
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
        deficit_bytes=None if deficit is None else int(deficit),
    )
    m.finish_timing()
    return m


def fake_rows() -> list[Measurement]:
    # 100 ms of compute per iteration (batch 8). Copies: D2H 50, H2D 40, both ways 80 GB/s.
    return [
        ok("baseline", None, 8, 0.100),
        ok("lms_fits", None, 8, 0.101),  # 1.5% slower than the mean of 0.100 and 0.099
        ok("baseline_repeat", None, 8, 0.099),
        # 2x: deficit 10 GB: its roofline 20 GB / 80 GB/s = 0.25 s, measured 0.3125 s -> 80%
        # (against its own 12 GB each way, 0.3 s: 96%); out 12 GB = 1.2x the deficit
        ok("lms", 2.0, 8, 0.3125, 12 * GB, 12 * GB, largest=40, note="within 10%", deficit=10 * GB),
        ok("save_on_cpu", 2.0, 8, 0.5, 12 * GB, 12 * GB, deficit=10 * GB),
        ok("checkpoint", 2.0, 8, 0.25, deficit=10 * GB),  # trains: no goal against it at 2x
        ok("no_lms", 2.0, 3, 0.04, largest=3),
        # 4x: deficit 20 GB: roofline 0.5 s, measured 0.55 s -> 90.9%; out 26 GB = 1.3x
        ok("lms", 4.0, 8, 0.55, 26 * GB, 26 * GB, largest=30, deficit=20 * GB),
        # save_on_cpu and checkpoint run out of memory; no-LMS trains nothing
        Measurement("gpt", "save_on_cpu", 4.0, 2 * GiB, 8, status="oom", detail="OOM"),
        Measurement("gpt", "checkpoint", 4.0, 2 * GiB, 8, status="oom", detail="OOM"),
        Measurement("gpt", "no_lms", 4.0, 2 * GiB, 0, status="oom", largest_batch=0),
        # 1.5x: LMS exactly as fast as offload (not faster) and as checkpointing (as fast)
        ok("lms", 1.5, 8, 0.2, 6 * GB, 6 * GB, deficit=5 * GB),
        ok("offload", 1.5, 8, 0.2, 6 * GB, 6 * GB, deficit=5 * GB),
        ok("save_on_cpu", 1.5, 8, 0.4, 8 * GB, 8 * GB, deficit=5 * GB),
        ok("checkpoint", 1.5, 8, 0.2, deficit=5 * GB),
    ]


def test_fill_roofline_and_efficiency() -> None:
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    by = {(m.method, m.factor): m for m in rows}
    assert by["baseline", None].efficiency == pytest.approx(1.0)
    assert by["lms", 2.0].roofline_s == pytest.approx(0.3)
    assert by["lms", 2.0].efficiency == pytest.approx(0.96)
    assert by["lms", 2.0].deficit_roofline_s == pytest.approx(0.25)
    assert by["lms", 2.0].deficit_efficiency == pytest.approx(0.8)
    assert by["checkpoint", 2.0].efficiency == pytest.approx(0.4)  # recompute: 0.1 s -> 0.25 s
    assert by["no_lms", 2.0].roofline_s == pytest.approx(0.0375)  # 3 samples of compute
    assert by["save_on_cpu", 4.0].efficiency is None  # not measured
    assert by["lms", 2.0].samples_per_s == pytest.approx(8 / 0.3125)


def test_goals_from_fake_measurements() -> None:
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    goal_list = evaluate_goals(rows, [1.5, 2.0, 4.0])
    goals = {(g.goal, g.factor): g for g in goal_list}
    assert len(goals) == len(goal_list)  # one row per goal and factor

    # Efficiency against the deficit roofline, not against the row's own traffic (96% at 2x).
    eff = goals["lms_efficiency", 2.0]
    assert eff.value == pytest.approx(0.8) and eff.met is False
    assert eff.target == ">= 85%" and eff.gap == "-5.0 points"
    assert goals["lms_efficiency", 4.0].value == pytest.approx(0.5 / 0.55)
    assert goals["lms_efficiency", 4.0].met is True
    assert goals["lms_efficiency", 4.0].gap == "+5.9 points"

    out2, out4 = goals["lms_out_vs_deficit", 2.0], goals["lms_out_vs_deficit", 4.0]
    assert out2.value == pytest.approx(1.2) and out2.met is True and out2.gap == "+0.05x"
    assert out4.value == pytest.approx(1.3) and out4.met is False and out4.gap == "-0.05x"
    assert out2.target == "<= 1.25x"

    soc = goals["lms_faster_than_save_on_cpu", 2.0]
    assert soc.value == pytest.approx(0.5 / 0.3125) and soc.met is True
    assert soc.target == "> 1.00x"
    soc4 = goals["lms_faster_than_save_on_cpu", 4.0]
    assert soc4.met is True and soc4.value is None and soc4.gap == "rival cannot train"
    assert "ran out of memory" in soc4.note
    # Equal speed is not faster...
    off = goals["lms_faster_than_offload", 1.5]
    assert off.value == pytest.approx(1.0) and off.met is False
    # ... but as fast as checkpointing is what the 1.5x goal asks.
    ck = goals["lms_vs_checkpoint", 1.5]
    assert ck.value == pytest.approx(1.0) and ck.met is True and ck.target == ">= 1.00x"
    # Offload was measured at 1.5x only: not measured at the other caps, not guessed.
    assert goals["lms_faster_than_offload", 2.0].met is None
    assert "offload: not run" in goals["lms_faster_than_offload", 2.0].note

    # Against checkpointing: the speed goal at 1.5x only; where it trains at 2x, no goal;
    # where it runs out of memory at 4x, LMS training is the goal.
    assert not [k for k in goals if k[0] == "lms_vs_checkpoint" and k[1] != 1.5]
    assert not [k for k in goals if "checkpoint" in k[0] and k[1] == 2.0]
    trains = goals["lms_trains_where_checkpoint_cannot", 4.0]
    assert trains.met is True and trains.value is None
    assert trains.gap == "checkpoint cannot train" and "ran out of memory" in trains.note
    assert ("lms_trains_where_checkpoint_cannot", 1.5) not in goals
    assert not [k for k in goals if k[0] == "lms_faster_than_checkpoint"]

    ratio = goals["largest_batch_ratio", 2.0]
    assert ratio.value == pytest.approx(40 / 3) and ratio.met is True
    assert ratio.note == "within 10%"
    nothing = goals["largest_batch_ratio", 4.0]
    assert nothing.value is None and nothing.met is True
    assert "not even batch 1" in nothing.note

    # 1.5% slower with everything fitting: over the 1% goal.
    over = goals["overhead_when_fitting", None]
    assert over.value == pytest.approx(0.101 / 0.0995 - 1)
    assert over.target == "<= 1%" and over.gap == "-0.5 points"
    assert over.met is False
    assert "differ by 1.0%" in over.note
    rows[1] = ok("lms_fits", None, 8, 0.1)  # 0.5% slower: met
    over = next(g for g in evaluate_goals(rows, [2.0]) if g.goal == "overhead_when_fitting")
    assert over.value == pytest.approx(0.1 / 0.0995 - 1) and over.met is True


def test_checkpoint_goal_where_lms_fails_too() -> None:
    rows = fake_rows()
    rows[7] = Measurement("gpt", "lms", 4.0, 2 * GiB, 8, status="oom", detail="OOM in conv")
    fill_roofline(rows, 0.100 / 8, BW)
    goals = {(g.goal, g.factor): g for g in evaluate_goals(rows, [4.0])}
    trains = goals["lms_trains_where_checkpoint_cannot", 4.0]
    assert trains.met is False and trains.gap == "neither trains"
    assert "OOM in conv" in trains.note
    rows[7].status = "skipped"
    goals = {(g.goal, g.factor): g for g in evaluate_goals(rows, [4.0])}
    assert goals["lms_trains_where_checkpoint_cannot", 4.0].met is None


def test_efficiency_above_the_roofline_is_reported_and_flagged() -> None:
    rows = fake_rows()
    rows[7] = ok("lms", 4.0, 8, 0.4, 20 * GB, 20 * GB, deficit=20 * GB)  # under 0.5 s of copies
    fill_roofline(rows, 0.100 / 8, BW)
    assert rows[7].deficit_efficiency == pytest.approx(1.25)
    goal = next(g for g in evaluate_goals(rows, [4.0]) if g.goal == "lms_efficiency")
    assert goal.value == pytest.approx(1.25) and goal.met is True
    assert "above the roofline" in goal.note


def test_goals_not_measured_are_not_guessed() -> None:
    rows = [
        ok("baseline", None, 8, 0.1),
        Measurement("gpt", "lms", 1.5, GiB, 8, status="skipped", detail="time budget"),
        Measurement("gpt", "lms", 2.0, GiB, 8, status="skipped", detail="time budget"),
    ]
    goals = evaluate_goals(rows, [1.5, 2.0])
    assert all(g.met is None and g.value is None for g in goals)
    assert {(g.goal, g.factor) for g in goals} == {
        *(
            (name, f)
            for f in (1.5, 2.0)
            for name in (
                "lms_efficiency",
                "lms_out_vs_deficit",
                "lms_faster_than_save_on_cpu",
                "largest_batch_ratio",
            )
        ),
        ("lms_vs_checkpoint", 1.5),
        # checkpointing not run at 2x: whether it would have run out of memory is unknown
        ("lms_trains_where_checkpoint_cannot", 2.0),
        ("overhead_when_fitting", None),
    }
    assert "time budget" in goals[0].note
    trains = next(g for g in goals if g.goal == "lms_trains_where_checkpoint_cannot")
    assert trains.note == "checkpoint: not run"
    # An LMS row that trained but records no deficit has no deficit goals.
    rows[2] = ok("lms", 2.0, 8, 0.3, 1 * GB, 1 * GB)
    fill_roofline(rows, 0.1 / 8, BW)
    goals = {g.goal: g for g in evaluate_goals(rows, [2.0])}
    for name in ("lms_efficiency", "lms_out_vs_deficit"):
        assert goals[name].met is None and goals[name].value is None
        assert "no deficit" in goals[name].note


def test_records_tables_and_csv(tmp_path: Path) -> None:
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    records = [compare.measurement_record(m) for m in rows]
    lms2 = records[3]
    assert lms2["method"] == "lms" and lms2["factor"] == "2"
    assert lms2["iteration_ms"] == "312.50"
    assert lms2["out_gib_per_iter"] == f"{12 * GB / GiB:.3f}"
    assert lms2["efficiency"] == "0.960" and lms2["deficit_efficiency"] == "0.800"
    assert lms2["out_vs_deficit"] == "1.20"
    assert records[0]["factor"] == "" and records[0]["cap_gib"] == ""
    table = compare.measurements_markdown(records)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("| model | method | oversubscription |")
    assert "| 96% | 80% / 144% |" in lines[5]
    assert "40 (within 10%)" in lines[5]
    assert "uncapped" in lines[2]
    assert "oom: OOM" in table

    goals = evaluate_goals(rows, [1.5, 2.0, 4.0])
    goal_records = [compare.goal_record("gpt", g) for g in goals]
    gtable = compare.goals_markdown(goal_records)
    assert "| gpt | lms_efficiency | 2x | 80.0% | >= 85% | no | -5.0 points |" in gtable
    assert "| gpt | lms_out_vs_deficit | 4x | 1.30x | <= 1.25x | no | -0.05x |" in gtable
    assert "| gpt | lms_vs_checkpoint | 1.5x | 1.00x | >= 1.00x | yes | +0.0% |" in gtable
    assert "| gpt | lms_trains_where_checkpoint_cannot | 4x |  | LMS trains | yes |" in gtable
    assert "| gpt | overhead_when_fitting | - | +1.51% | <= 1% | no |" in gtable
    assert "| not measured |" in gtable  # offload at 2x and 4x only

    path = tmp_path / "compare-gpt.csv"
    compare.write_csv(path, compare.MEASUREMENT_COLUMNS, records, FAKE_ENV)
    with path.open() as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(rows)
    assert back[3]["efficiency"] == "0.960" and back[3]["device"] == "Fake GPU"


def test_goal_targets_come_from_the_constants() -> None:
    """The --help text and the goal rows read the same constants."""
    text = compare.goals_help()
    for target in (
        ">= 85%",
        "<= 1.25x",
        "> 1.00x",
        "at 1.5x, LMS samples/s >= 1.00x",
        ">= 10x",
        "<= 1%",
    ):
        assert target in text, target
    assert "90%" not in text and "2%" not in text
    assert "lms_trains_where_checkpoint_cannot" in text
    assert "Goals (compare-MODEL-goals.csv" in compare.build_parser().format_help()


def test_rescore_recomputes_goals_from_a_run_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = fake_rows()
    fill_roofline(rows, 0.100 / 8, BW)
    env = {**FAKE_ENV, "host": "not a column"}
    records = []
    for m in rows:
        record = asdict(m)
        # Derived figures are recomputed, keys of a later version ignored, profiles kept.
        del record["deficit_efficiency"], record["roofline_s"]
        record["from_a_later_version"] = 1
        record["profile"] = {"compute_busy_s": 0.1} if m.method == "lms" else None
        records.append(record)
    run = {
        "environment": env,
        "workload": "fake",
        "batch": 8,
        "config": {"model": "gpt", "factors": [1.5, 2.0, 4.0], "out": "x"},
        "bandwidth_bytes_per_s": asdict(BW),
        "measurements": records,
        "goals": [{"goal": "stale"}],
        "searches": {},
    }
    (tmp_path / "compare-gpt.json").write_text(json.dumps(run))
    stale = tmp_path / "compare-gpt-goals.csv"
    stale.write_text("model,goal\ngpt,lms_faster_than_checkpoint\n")

    back = compare.measurement_from_record(records[3])
    assert (back.method, back.factor, back.deficit_bytes) == ("lms", 2.0, 10 * GB)
    assert back.profile == {"compute_busy_s": 0.1}
    assert back.deficit_efficiency is None and back.iteration_times == rows[3].iteration_times
    with pytest.raises(ValueError, match="'lms'"):
        compare.measurement_from_record({"method": "lms"})

    assert compare.main(["--rescore", str(tmp_path)]) == 0
    assert "== gpt: wrote" in capsys.readouterr().out
    with stale.open(newline="") as f:
        written = list(csv.DictReader(f))
    expected = [compare.goal_record("gpt", g) for g in evaluate_goals(rows, [1.5, 2.0, 4.0])]
    assert [{k: r[k] for k in compare.GOAL_COLUMNS} for r in written] == expected
    assert {r["device"] for r in written} == {"Fake GPU"}
    assert {r["date"] for r in written} == {env["date"]}
    assert "host" not in written[0]
    effs = {r["factor"]: r["value"] for r in written if r["goal"] == "lms_efficiency"}
    assert effs["2"] == "0.8000"  # recomputed: the record had no deficit_efficiency
    # The JSON itself is left as the run wrote it; the chart is redrawn where it can be.
    assert json.loads((tmp_path / "compare-gpt.json").read_text()) == run
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "compare-gpt.png").stat().st_size > 0

    # One JSON by path, or one model of a folder; nothing to rescore and bad files fail.
    assert compare.main(["--rescore", str(tmp_path / "compare-gpt.json")]) == 0
    assert compare.main(["--rescore", str(tmp_path), "--model", "gpt"]) == 0
    assert compare.main(["--rescore", str(tmp_path), "--model", "vit_l"]) == 2
    assert "no compare-vit_l.json" in capsys.readouterr().err
    (tmp_path / "compare-gpt.json").write_text(json.dumps({"config": {}}))
    assert compare.main(["--rescore", str(tmp_path)]) == 2
    assert "not a compare.py run record" in capsys.readouterr().err
    (tmp_path / "compare-gpt.json").write_text("{")
    assert compare.main(["--rescore", str(tmp_path)]) == 2
    # Without a measured baseline the run wrote no goals; neither does the rescore.
    run["measurements"] = records[1:]
    (tmp_path / "compare-gpt.json").write_text(json.dumps(run))
    assert compare.main(["--rescore", str(tmp_path)]) == 0
    assert stale.read_text().splitlines() == [
        ",".join((*compare.GOAL_COLUMNS, *compare.ENV_COLUMNS))
    ]


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
    compare.check_args(args)
    assert args.factors == [1.5, 2.0, 4.0]
    assert args.warmup == 6 and args.iterations == 5 and args.search
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
    with pytest.raises(ValueError, match="--model is required"):
        compare.check_args(parser.parse_args([]))
    compare.check_args(parser.parse_args(["--rescore", "results"]))
    with pytest.raises(SystemExit):
        compare.main(["--iterations", "3"])


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
    compare.check_args(args)
    assert args.methods == compare.CAPPED_DEFAULT_METHODS
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


# ---------------------------------------------------------------------------------------
# lms_hybrid: LMS with recompute instead of paging where that is cheaper
# ---------------------------------------------------------------------------------------


def test_lms_residual_is_lms_with_residual_recipes_on() -> None:
    """lms_residual keeps LMS's defaults (recompute as the build has it) and turns residual
    recipes on; no other method does, and only --methods names it."""
    parser = compare.build_parser()
    args = parser.parse_args(["--model", "gpt", "--methods", "lms,lms_residual"])
    compare.check_args(args)
    cap = 1000 * (1 << 20)
    residual = compare.method_lms_settings(args, "lms_residual", cap)
    default = compare.method_lms_settings(args, "lms", cap)
    assert residual is not None and default is not None
    assert residual.residual_recipes and not default.residual_recipes
    assert replace(residual, residual_recipes=False) == default
    for method in compare.LMS_METHODS:
        settings = compare.method_lms_settings(args, method, cap)
        assert settings is not None
        assert settings.residual_recipes == (method == "lms_residual"), method
    assert "lms_residual" in compare.DEFAULT_RECOMPUTE_METHODS
    assert "lms_residual" in compare.PROFILED_METHODS
    assert "lms_residual" not in compare.CAPPED_DEFAULT_METHODS
    assert "lms_residual" not in compare.NOCAP_METHODS


def test_lms_hybrid_is_planned_like_lms() -> None:
    # Everywhere lms is, right after it.
    for methods in (
        compare.CAPPED_METHODS,
        compare.PEER_METHODS,
        compare.PROFILED_METHODS,
        compare.NOCAP_METHODS,
        compare.LMS_METHODS,
    ):
        assert methods[methods.index("lms") + 1] == "lms_hybrid", methods
    assert compare.RECOMPUTE_METHODS == ("lms_hybrid",)
    parser = compare.build_parser()
    args = parser.parse_args(["--model", "resnet152"])
    compare.check_args(args)
    assert "lms_hybrid" in args.methods  # a default of the capped regime
    args = parser.parse_args(["--model", "resnet152", "--methods", "lms,lms_hybrid,checkpoint"])
    assert args.methods == ("lms", "lms_hybrid", "checkpoint")
    text = " ".join(parser.format_help().split())
    assert (
        "lms, lms_hybrid, lms_reactive, lms_nopack, lms_residual, offload, save_on_cpu, "
        "checkpoint" in text
    )
    assert "set_recompute_lms(True)" in text
    # The same LMS settings as lms (learned schedule on); lms_reactive turns the schedule off.
    args.lms_limit_frac, args.prefetch = 0.7, 2
    cap = 1000 * (1 << 20)
    hybrid = compare.method_lms_settings(args, "lms_hybrid", cap)
    assert hybrid is not None and hybrid == compare.method_lms_settings(args, "lms", cap)
    assert hybrid.enabled and hybrid.schedule and hybrid.limit_mb == 700 and hybrid.prefetch == 2
    reactive = compare.method_lms_settings(args, "lms_reactive", cap)
    assert reactive is not None and not reactive.schedule
    assert compare.method_lms_settings(args, "checkpoint", cap) is None


# ---------------------------------------------------------------------------------------
# lms_nopack: LMS with packing off, for what packing costs or saves in one run
# ---------------------------------------------------------------------------------------


def test_lms_nopack_is_lms_with_packing_off_and_is_run_by_naming_it() -> None:
    assert compare.NOPACK_METHODS == ("lms_nopack",)
    for methods in (
        compare.CAPPED_METHODS,
        compare.PEER_METHODS,
        compare.PROFILED_METHODS,
        compare.LMS_METHODS,
    ):
        assert "lms_nopack" in methods, methods
    parser = compare.build_parser()
    for regime in ("capped", "nocap"):
        args = parser.parse_args(["--model", "gpt", "--regime", regime])
        compare.check_args(args)
        assert "lms" in args.methods and "lms_nopack" not in args.methods, (regime, args.methods)
    args = parser.parse_args(["--model", "gpt", "--methods", "lms,lms_nopack"])
    compare.check_args(args)
    assert args.methods == ("lms", "lms_nopack")
    assert "set_packing_lms(False)" in " ".join(parser.format_help().split())
    cap = 1000 * (1 << 20)
    lms = compare.method_lms_settings(args, "lms", cap)
    nopack = compare.method_lms_settings(args, "lms_nopack", cap)
    assert lms is not None and nopack is not None
    assert lms.packing and not nopack.packing
    assert replace(nopack, packing=True) == lms  # nothing else differs
    for method in ("lms_hybrid", "lms_reactive"):
        settings = compare.method_lms_settings(args, method, cap)
        assert settings is not None and settings.packing, method


def _fake_lms_api(monkeypatch: pytest.MonkeyPatch, *switches: str) -> list[tuple[str, Any]]:
    """torch.cuda's LMS functions that apply_lms calls always, and ``switches`` (the setters a
    build may lack), as fakes that record their calls; the schedule and packing setters
    absent unless named."""
    import torch

    calls: list[tuple[str, Any]] = []
    for name in (
        "set_limit_lms",
        "set_size_lms",
        "set_prefetch_lms",
        "set_speculative_lms",
        "set_enabled_lms",
        "reset_accumulated_lms_stats",
        "reset_peak_lms_stats",
        *switches,
    ):
        monkeypatch.setattr(
            torch.cuda, name, lambda *a, _n=name: calls.append((_n, a)), raising=False
        )
    for name in ("set_schedule_lms", "set_packing_lms", "set_residual_recipes_lms"):
        if name not in switches:
            monkeypatch.delattr(torch.cuda, name, raising=False)
    return calls


@pytest.mark.parametrize(
    ("setter", "field", "default"),
    [
        # A build without the switch does not pack: on is what it does, off is refused.
        ("set_packing_lms", "packing", True),
        # One without residual recipes has none: off is what it does, on is refused.
        ("set_residual_recipes_lms", "residual_recipes", False),
    ],
)
def test_apply_lms_sets_a_switch_and_refuses_what_a_build_lacks(
    monkeypatch: pytest.MonkeyPatch, setter: str, field: str, default: bool
) -> None:
    import torch

    from lmsbench import lms_setup

    calls = _fake_lms_api(monkeypatch, setter)
    lms_setup.apply_lms(lms_setup.LmsSettings(enabled=True, **{field: not default}))
    assert (setter, (not default,)) in calls
    # Set before LMS is enabled, like every other knob.
    names = [name for name, _ in calls]
    assert names.index(setter) < names.index("set_enabled_lms")
    # Every row sets it, to its default unless asked (rows share a process).
    calls.clear()
    lms_setup.apply_lms(lms_setup.LmsSettings(enabled=True))
    assert (setter, (default,)) in calls
    monkeypatch.delattr(torch.cuda, setter)
    lms_setup.apply_lms(lms_setup.LmsSettings(enabled=True))
    with pytest.raises(lms_setup.LmsUnavailable, match=setter):
        lms_setup.apply_lms(lms_setup.LmsSettings(enabled=True, **{field: not default}))


def test_apply_lms_names_the_environment_settings_it_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from lmsbench import lms_setup

    environ = {
        "PYTORCH_LMS_CONF": "lms_pack:False, lms_host_placement:False",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,lms_size_mb:4",
    }
    assert lms_setup.overridden_conf_keys(environ) == [
        "PYTORCH_LMS_CONF: lms_pack",
        "PYTORCH_CUDA_ALLOC_CONF: lms_size_mb",
    ]
    assert lms_setup.overridden_conf_keys({"PYTORCH_LMS_CONF": "lms_host_limit_mb:64"}) == []
    assert lms_setup.overridden_conf_keys({"PYTORCH_LMS_CONF": "lms_residual_recipes:True"}) == [
        "PYTORCH_LMS_CONF: lms_residual_recipes"
    ]
    for name in (
        "set_limit_lms",
        "set_size_lms",
        "set_prefetch_lms",
        "set_speculative_lms",
        "set_packing_lms",
        "set_enabled_lms",
        "reset_accumulated_lms_stats",
        "reset_peak_lms_stats",
    ):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None, raising=False)
    monkeypatch.delattr(torch.cuda, "set_schedule_lms", raising=False)
    for variable in lms_setup.CONF_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PYTORCH_LMS_CONF", "lms_pack:False")
    with pytest.warns(UserWarning, match=r"do not apply.*PYTORCH_LMS_CONF: lms_pack.*lms_nopack"):
        lms_setup.apply_lms(lms_setup.LmsSettings(enabled=True))


class FakeRecompute:
    """torch.cuda's recompute switch: set_recompute_lms and get_recompute_lms, calls logged."""

    def __init__(self, events: list[tuple[str, Any]], state: bool = False) -> None:
        self.events = events
        self.state = state

    def set_recompute_lms(self, enabled: bool) -> None:
        self.events.append(("set_recompute_lms", enabled))
        self.state = enabled

    def get_recompute_lms(self) -> bool:
        return self.state


def test_set_recompute_turns_it_on_and_puts_it_back() -> None:
    events: list[tuple[str, Any]] = []
    cuda = FakeRecompute(events)
    restore = compare.set_recompute(cuda, True)
    assert events == [("set_recompute_lms", True)] and cuda.state
    restore()
    assert events[-1] == ("set_recompute_lms", False) and not cuda.state
    # What was in force before comes back (lms_recompute:True in PYTORCH_CUDA_ALLOC_CONF):
    # an lms row runs with it off meanwhile.
    cuda.state = True
    restore = compare.set_recompute(cuda, False)
    assert not cuda.state
    restore()
    assert cuda.state
    # Without a getter: back to off, the default.
    events.clear()
    only_set = SimpleNamespace(set_recompute_lms=lambda on: events.append(("set", on)))
    compare.set_recompute(only_set, True)()
    assert events == [("set", True), ("set", False)]
    # A build without recompute: off sets nothing, on is an error that says what is missing.
    compare.set_recompute(SimpleNamespace(), False)()
    with pytest.raises(compare.RecomputeUnavailable, match="set_recompute_lms"):
        compare.set_recompute(SimpleNamespace(), True)


def test_check_recompute_ends_the_run_or_leaves_the_default_out() -> None:
    parser = compare.build_parser()
    lines: list[str] = []
    given = parser.parse_args(["--model", "gpt", "--methods", "lms,lms_hybrid"])
    error = compare.check_recompute(given, "extension", SimpleNamespace(), True, lines.append)
    assert "lms_hybrid needs torch.cuda.set_recompute_lms" in error
    assert "leave lms_hybrid out of --methods" in error
    default = parser.parse_args(["--model", "gpt"])
    compare.check_args(default)
    # The default methods: the run goes on without lms_hybrid, and says so.
    assert (
        compare.check_recompute(default, "extension", SimpleNamespace(), False, lines.append) == ""
    )
    assert "lms_hybrid" not in default.methods and "lms" in default.methods
    assert lines and lines[0].startswith("== lms_hybrid left out of the default methods")
    # With recompute, or without LMS at all (its rows are skipped for that): nothing to say.
    cuda = FakeRecompute([])
    for backend, api in (("extension", cuda), ("", SimpleNamespace())):
        args = parser.parse_args(["--model", "gpt", "--methods", "lms_hybrid"])
        assert compare.check_recompute(args, backend, api, True, lines.append) == ""
        assert args.methods == ("lms_hybrid",)


def test_lms_hybrid_without_recompute_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    from lmsbench import lms_setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(torch.cuda, "set_recompute_lms", raising=False)
    monkeypatch.setattr(lms_setup, "ensure_lms_api", lambda: "extension")
    argv = ["--model", "gpt", "--methods", "lms,lms_hybrid", "--out", str(tmp_path)]
    assert compare.main(argv) == 2
    assert "compare.py: lms_hybrid needs torch.cuda.set_recompute_lms" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # ended before measuring anything


# LMS statistics of a build with recompute, before and after 2 timed iterations.
STATS_BEFORE = {
    "pageout_bytes": 10 * GiB,
    "pagein_bytes": 9 * GiB,
    "stall_ms": 5.0,
    "drop_count": 3,
    "drop_bytes": GiB,
    "recompute_count": 2,
    "recompute_bytes": GiB // 2,
    "recompute_ms": 4.0,
    "limit_bytes": 8 * GiB,
}
STATS_AFTER = {
    **STATS_BEFORE,
    "pageout_bytes": 14 * GiB,
    "pagein_bytes": 13 * GiB,
    "stall_ms": 25.0,
    "drop_count": 43,
    "drop_bytes": 4 * GiB,
    "recompute_count": 42,
    "recompute_bytes": 3 * GiB + GiB // 2,
    "recompute_ms": 34.0,
    "dropped_bytes": {"current": 0, "peak": 2 * GiB},
}


def test_recompute_stats_in_the_row_the_csv_and_the_tables() -> None:
    m = Measurement("resnet152", "lms_hybrid", 2.0, 5 * GiB, 64, iteration_times=[0.5])
    m.finish_timing()
    m.out_bytes_per_iter = m.in_bytes_per_iter = 2 * GiB
    compare.record_recompute(m, STATS_BEFORE, STATS_AFTER, 2)
    assert (m.drop_count_per_iter, m.drop_bytes_per_iter) == (20, 1.5 * GiB)
    assert (m.recompute_count_per_iter, m.recompute_bytes_per_iter) == (20, 1.5 * GiB)
    assert m.recompute_ms_per_iter == 15.0 and m.dropped_peak_bytes == 2 * GiB
    assert "dropped 1.50 / recomputed 1.50 GiB, recompute 15.0 ms per iter" in compare.describe(m)
    record = compare.capped_measurement_record(m)
    assert tuple(record) == compare.CAPPED_CSV_COLUMNS
    assert (record["drop_gib_per_iter"], record["recompute_gib_per_iter"]) == ("1.500", "1.500")
    assert record["recompute_ms_per_iter"] == "15.00"
    plain = Measurement("resnet152", "checkpoint", 2.0, 5 * GiB, 64, iteration_times=[0.4])
    plain.finish_timing()
    table = compare.measurements_markdown([record, compare.capped_measurement_record(plain)])
    header, _, hybrid_line, plain_line = table.splitlines()
    cells = [c.strip() for c in header.split("|")]
    at = cells.index("GiB out/in per iter")
    assert cells[at + 1] == compare.RECOMPUTE_HEADER  # where the page-out figures are
    assert [c.strip() for c in hybrid_line.split("|")][at + 1] == "1.500 / 1.500, 15.00 ms"
    assert [c.strip() for c in plain_line.split("|")][at + 1] == ""
    # Statistics without recompute (an older build) leave the figures unset and the table as
    # it was; so do records written before the columns existed.
    old = Measurement("resnet152", "lms", 2.0, 5 * GiB, 64)
    compare.record_recompute(old, {}, {"pageout_bytes": 0}, 2)
    assert old.drop_bytes_per_iter is None and old.dropped_peak_bytes is None
    assert compare.recompute_record(old) == {c: "" for c in compare.RECOMPUTE_COLUMNS}
    before = compare.measurement_record(plain)
    assert compare.RECOMPUTE_HEADER not in compare.measurements_markdown([before])
    nocap = compare.nocap_measurement_record(m)
    assert tuple(nocap) == compare.NOCAP_MEASUREMENT_COLUMNS and nocap["drop_gib_per_iter"]
    assert compare.RECOMPUTE_HEADER in compare.nocap_measurements_markdown([nocap])


def test_packed_operators_per_iteration_in_the_row() -> None:
    m = Measurement("gpt", "lms", 4.0, 3 * GiB, 8, iteration_times=[0.9])
    m.finish_timing()
    compare.record_packs_and_placements(m, {"pack_count": 4}, {"pack_count": 19}, 5)
    assert m.pack_count_per_iter == 3.0
    assert "3 operators packed per iter" in compare.describe(m)
    # An engine without the counter leaves the figure unset and the line without it.
    old = Measurement("gpt", "lms", 4.0, 3 * GiB, 8, iteration_times=[0.9])
    old.finish_timing()
    compare.record_packs_and_placements(old, {}, {"pageout_bytes": 0}, 5)
    assert old.pack_count_per_iter is None and "packed" not in compare.describe(old)


def test_written_csv_reads_back_with_the_committed_columns(tmp_path: Path) -> None:
    from benchmarks import summarize

    assert set(compare.MEASUREMENT_COLUMNS) < set(compare.CAPPED_CSV_COLUMNS)
    assert compare.CAPPED_CSV_COLUMNS[-1] == "detail"
    m = Measurement("gpt", "lms_hybrid", 2.0, GiB, 8)
    compare.record_recompute(m, STATS_BEFORE, STATS_AFTER, 2)
    path = tmp_path / "compare-gpt.csv"
    compare.write_csv(path, compare.CAPPED_CSV_COLUMNS, [compare.capped_measurement_record(m)], {})
    (row,) = summarize._read(path, compare.MEASUREMENT_COLUMNS)
    assert row["method"] == "lms_hybrid" and row["drop_gib_per_iter"] == "1.500"
    # A JSON record of this version reads back; one written before the fields existed too.
    back = compare.measurement_from_record(json.loads(json.dumps(asdict(m))))
    assert back.recompute_ms_per_iter == 15.0 and back.dropped_peak_bytes == 2 * GiB
    old = {k: v for k, v in asdict(m).items() if "drop" not in k and "recompute" not in k}
    assert compare.measurement_from_record(old).drop_bytes_per_iter is None


class TinyWorkload:
    """A workload of compare.make_workload's shape that trains on the CPU (its build ignores
    the CUDA device context), logging when the model is built."""

    description = "tiny"
    default_batch = 4

    def __init__(self, torch: Any, events: list[tuple[str, Any]], cuda: FakeRecompute) -> None:
        self.torch = torch
        self.events = events
        self.cuda = cuda

    def build(self) -> Any:
        self.events.append(("build", self.cuda.state))
        return self.torch.nn.Linear(4, 2, device="cpu")

    def checkpoint(self, model: Any) -> None:
        raise AssertionError("not a checkpoint row")

    def make_optimizer(self, model: Any, name: str | None) -> Any:
        return self.torch.optim.SGD(model.parameters(), lr=0.1)

    def make_batch(self, batch: int, device: Any, step: int) -> tuple[Any, Any]:
        return self.torch.randn(batch, 4), self.torch.randint(0, 2, (batch,))

    def loss(self, out: Any, targets: Any) -> Any:
        return self.torch.nn.functional.cross_entropy(out, targets)


def fake_cuda_training(
    monkeypatch: pytest.MonkeyPatch, recompute: bool, state: bool = False
) -> tuple[Any, list[tuple[str, Any]], FakeRecompute]:
    """torch.cuda and lms_setup faked so that train_measure runs on the CPU: LMS's calls go
    to the event log; ``recompute``: torch.cuda has set_recompute_lms (currently ``state``)."""
    torch = pytest.importorskip("torch")
    from lmsbench import lms_setup

    events: list[tuple[str, Any]] = []
    cuda = FakeRecompute(events, state)
    for name, fake in (
        ("current_device", lambda: 0),
        ("synchronize", lambda: None),
        ("reset_peak_memory_stats", lambda: None),
        ("memory_allocated", lambda: 0),
        ("max_memory_allocated", lambda: 0),
        ("memory_stats", lambda: {}),
    ):
        monkeypatch.setattr(torch.cuda, name, fake)
    if recompute:
        monkeypatch.setattr(torch.cuda, "set_recompute_lms", cuda.set_recompute_lms, raising=False)
        monkeypatch.setattr(torch.cuda, "get_recompute_lms", cuda.get_recompute_lms, raising=False)
    else:
        monkeypatch.delattr(torch.cuda, "set_recompute_lms", raising=False)
    # Read around iteration 0 (its account), then around the timed iterations.
    stats = iter([STATS_BEFORE, STATS_BEFORE, STATS_BEFORE, STATS_AFTER])
    monkeypatch.setattr(lms_setup, "lms_stats", lambda: dict(next(stats)))
    monkeypatch.setattr(
        lms_setup, "apply_lms", lambda s: events.append(("apply_lms", s.enabled, cuda.state))
    )
    monkeypatch.setattr(compare, "reset_rss_peak", lambda: False)
    return torch, events, cuda


def measure_tiny_workload(
    torch: Any, events: list[tuple[str, Any]], cuda: FakeRecompute, method: str, warmup: int
) -> tuple[Measurement, list[str]]:
    """train_measure of ``method`` on TinyWorkload (``warmup`` and two timed steps) under the
    fakes of fake_cuda_training; the row must come out ok. Returns it and the log's lines."""
    args = compare.build_parser().parse_args(["--model", "resnet152"])
    compare.check_args(args)
    m = Measurement("resnet152", method, None, None, 4)
    lines: list[str] = []
    compare.train_measure(
        args,
        TinyWorkload(torch, events, cuda),
        m,
        warmup=warmup,
        iterations=2,
        lms=compare.method_lms_settings(args, method, None),
        log=lines.append,
    )
    assert m.status == "ok", (m.detail, lines)
    return m, lines


def test_train_measure_sets_recompute_up_for_lms_hybrid_and_puts_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch, events, cuda = fake_cuda_training(monkeypatch, recompute=True)
    m, lines = measure_tiny_workload(torch, events, cuda, "lms_hybrid", warmup=1)
    assert m.first_iteration is not None and m.first_iteration["stall_ms"] == 0
    assert m.warmup_accounts == [m.first_iteration]
    assert any(line.strip().startswith("iteration 0 of lms_hybrid: ") for line in lines)
    # Recompute on before LMS is applied and the model built; LMS off, then recompute off.
    assert events == [
        ("set_recompute_lms", True),
        ("apply_lms", True, True),
        ("build", True),
        ("apply_lms", False, True),
        ("set_recompute_lms", False),
    ]
    assert len(m.iteration_times) == 2 and m.out_bytes_per_iter == 2 * GiB
    assert m.drop_bytes_per_iter == 1.5 * GiB and m.recompute_bytes_per_iter == 1.5 * GiB
    assert m.recompute_ms_per_iter == 15.0 and m.dropped_peak_bytes == 2 * GiB
    assert compare.capped_measurement_record(m)["recompute_ms_per_iter"] == "15.00"

    assert m.recompute_on is True
    # An lms_paging row runs with recompute off, also where it was on before, and puts it back.
    torch, events, cuda = fake_cuda_training(monkeypatch, recompute=True, state=True)
    m, _ = measure_tiny_workload(torch, events, cuda, "lms_paging", warmup=1)
    assert m.recompute_on is False
    assert [e for e in events if e[0] != "apply_lms"] == [
        ("set_recompute_lms", False),
        ("build", False),
        ("set_recompute_lms", True),
    ]
    # An lms row keeps LMS's own default, on or off, and says which it was.
    for default in (True, False):
        torch, events, cuda = fake_cuda_training(monkeypatch, recompute=True, state=default)
        m, _ = measure_tiny_workload(torch, events, cuda, "lms", warmup=1)
        assert m.recompute_on is default
        assert [e for e in events if e[0] != "apply_lms"] == [("build", default)]
        assert f"recompute {'on' if default else 'off'}" in compare.describe(m)
    # A row without LMS leaves recompute alone.
    torch, events, cuda = fake_cuda_training(monkeypatch, recompute=True)
    m = Measurement("resnet152", "baseline", None, None, 4)
    args = compare.build_parser().parse_args(["--model", "resnet152"])
    compare.check_args(args)
    compare.train_measure(
        args, TinyWorkload(torch, events, cuda), m, warmup=1, iterations=2, lms=None
    )
    assert m.status == "ok" and events == [("build", False)]
    assert m.drop_bytes_per_iter is None


def test_train_measure_lms_hybrid_without_recompute_fails_the_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch, events, cuda = fake_cuda_training(monkeypatch, recompute=False)
    args = compare.build_parser().parse_args(["--model", "resnet152"])
    compare.check_args(args)
    m = Measurement("resnet152", "lms_hybrid", None, None, 4)
    settings = compare.method_lms_settings(args, "lms_hybrid", None)
    compare.train_measure(
        args,
        TinyWorkload(torch, events, cuda),
        m,
        warmup=1,
        iterations=2,
        lms=settings,
        log=lambda s: None,
    )
    assert m.status == "error" and "RecomputeUnavailable" in m.detail
    assert "set_recompute_lms" in m.detail
    assert events == [("apply_lms", False, False)]  # nothing built; LMS left off


def test_operator_counts_between_keeps_what_grew() -> None:
    before = {"aten::dropout": {"drop_count": 2, "recompute_count": 1}}
    after = {
        "aten::dropout": {"drop_count": 5, "recompute_count": 1},
        "aten::linear": {"drop_count": 1, "recompute_count": 1},
        "aten::gelu": {"drop_count": 0, "recompute_count": 0},
    }
    assert compare.operator_counts_between(before, after) == {
        "aten::dropout": {"drop_count": 3, "recompute_count": 0},
        "aten::linear": {"drop_count": 1, "recompute_count": 1},
    }
    assert compare.operator_counts_between(after, after) == {}


# ---------------------------------------------------------------------------------------
# The speed table's rows: lms_paging, compile_budget, warm-up bookkeeping
# ---------------------------------------------------------------------------------------


def test_named_only_methods_are_in_no_default_and_lms_paging_turns_recompute_off() -> None:
    parser = compare.build_parser()
    for regime in ("capped", "nocap"):
        args = parser.parse_args(["--model", "gpt", "--regime", regime])
        compare.check_args(args)
        for method in compare.NAMED_ONLY_METHODS:
            assert method not in args.methods, (regime, method)
    args = parser.parse_args(["--model", "gpt", "--methods", "lms_paging,compile_budget"])
    assert args.methods == ("lms_paging", "compile_budget")
    assert "lms_paging" in compare.LMS_METHODS and "lms_paging" in compare.PROFILED_METHODS
    assert "lms_paging" not in compare.RECOMPUTE_METHODS + compare.DEFAULT_RECOMPUTE_METHODS
    assert compare.method_lms_settings(args, "compile_budget", None) is None
    text = " ".join(parser.format_help().split())
    assert "activation_memory_budget" in text and "lms_paging" in text


def test_activation_budget_keeps_what_fits_beside_the_static_memory() -> None:
    # 0.85 x 100 - 25 = 60 of 75 activation bytes: 0.8.
    assert compare.activation_budget(100, 100, 25) == pytest.approx(0.8)
    assert compare.activation_budget(100, 50, 10) == 1.0  # fits whole: no recompute
    assert compare.activation_budget(100, 400, 90) == 0.0  # static alone over the margin
    assert compare.activation_budget(100, 10, 10) == 1.0  # no activation memory
    # No cap: twice the device's need, a tenth of it static.
    assert compare.activation_budget(1000, 2000, 100, margin=0.9) == pytest.approx(0.421)
    for bad in ((0, 10, 1), (10, 10, -1)):
        with pytest.raises(ValueError):
            compare.activation_budget(*bad)
    with pytest.raises(ValueError):
        compare.activation_budget(10, 10, 1, margin=0)


def test_compile_budget_unavailable_says_why() -> None:
    assert "no torch.compile" in compare.compile_budget_unavailable(SimpleNamespace())
    torch = pytest.importorskip("torch")
    assert compare.compile_budget_unavailable(torch) == ""  # torch 2.4+: it has the budget


def test_train_measure_keeps_each_warmup_time_and_the_median_of_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch, events, cuda = fake_cuda_training(monkeypatch, recompute=False)
    ticks = iter(float(t) for t in range(1000))
    clock = {"now": 0.0}

    def perf_counter() -> float:
        # Steps take 1, 2, 3, ... seconds: each start and end read the clock once.
        clock["now"] += next(ticks)
        return clock["now"]

    monkeypatch.setattr(compare.time, "perf_counter", perf_counter)
    args = compare.build_parser().parse_args(["--model", "resnet152"])
    compare.check_args(args)
    m = Measurement("resnet152", "baseline", None, None, 4)
    compare.train_measure(
        args, TinyWorkload(torch, events, cuda), m, warmup=3, iterations=10, lms=None
    )
    assert m.status == "ok", m.detail
    # Step k's elapsed time is the clock's (2k+1)th increment: 1, 3, 5, ...
    assert m.warmup_times == [1.0, 3.0, 5.0] and m.first_iteration_s == 1.0
    assert m.iteration_times == [float(2 * k + 1) for k in range(3, 13)]
    assert m.iteration_s == pytest.approx(16.0)  # median of 7, 9, ..., 25
    assert m.samples_per_s == pytest.approx(4 / 16.0)


def test_compile_budget_row_compiles_under_its_budget_or_says_it_does_not_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch, events, cuda = fake_cuda_training(monkeypatch, recompute=False)
    args = compare.build_parser().parse_args(["--model", "resnet152"])
    compare.check_args(args)
    calls: list[tuple[str, Any]] = []

    def compiles(model: Any, budget: float) -> tuple[Any, Any]:
        calls.append(("compile", budget))
        return model, lambda: calls.append(("restore", None))

    monkeypatch.setattr(compare, "compile_with_budget", compiles)
    m = Measurement("resnet152", "compile_budget", 2.0, None, 4, activation_budget=0.3)
    compare.train_measure(
        args, TinyWorkload(torch, events, cuda), m, warmup=1, iterations=2, lms=None
    )
    assert m.status == "ok" and calls == [("compile", 0.3), ("restore", None)]
    assert "activation_memory_budget 0.3" in compare.describe(m)

    def fails(model: Any, budget: float) -> tuple[Any, Any]:
        def forward(inputs: Any) -> Any:
            raise RuntimeError("backend compiler failed\nmore")

        return forward, lambda: calls.append(("restore", None))

    calls.clear()
    monkeypatch.setattr(compare, "compile_with_budget", fails)
    m = Measurement("resnet152", "compile_budget", 2.0, None, 4, activation_budget=0.3)
    compare.train_measure(
        args,
        TinyWorkload(torch, events, cuda),
        m,
        warmup=1,
        iterations=2,
        lms=None,
        log=lambda s: None,
    )
    assert m.status == "error" and calls == [("restore", None)]
    assert m.detail == "not run: does not compile: RuntimeError: backend compiler failed"
    # No budget chosen for the row: not run, nothing built.
    events.clear()
    m = Measurement("resnet152", "compile_budget", 2.0, None, 4)
    compare.train_measure(
        args, TinyWorkload(torch, events, cuda), m, warmup=1, iterations=2, lms=None
    )
    assert m.status == "skipped" and m.detail.startswith("not run: no activation budget")
    assert events == []


def test_nocap_row_estimate_of_compile_budget_adds_the_compile() -> None:
    plan = compare.NocapPlan(1.5, 100, 150 * GiB, 100 * GiB)
    bw = compare.Bandwidth(50e9, 50e9, 90e9)
    ckpt = compare.nocap_row_estimate("checkpoint", plan, GiB, 0.01, bw, 13)
    compiled = compare.nocap_row_estimate("compile_budget", plan, GiB, 0.01, bw, 13)
    assert compiled == pytest.approx(ckpt + compare.COMPILE_ESTIMATE_S)
    assert compare.nocap_host_bytes("compile_budget", plan, GiB) == 0


def test_iteration_account_takes_the_step_s_deltas() -> None:
    before = {"host_pin_ms": 10.0, "host_pin_count": 2, "stall_ms": 5.0, "pageout_bytes": 0}
    after = {
        "host_pin_ms": 2110.0,
        "host_pin_count": 37,
        "stall_ms": 305.0,
        "recompute_ms": 40.0,
        "pageout_bytes": 6 * GiB,
        "pagein_bytes": 3 * GiB,
        "drop_bytes": GiB // 2,
        "pagein_demand_count": 43,
        "cache_releases": 1,
        "device_wait_ms": 7.0,
    }
    account = compare.iteration_account(
        before, after, {"num_alloc_retries": 1}, {"num_alloc_retries": 13, "num_ooms": 6}
    )
    assert account["host_pin_ms"] == 2100.0
    assert account["host_pins"] == 35
    assert account["stall_ms"] == 300.0
    assert account["recompute_ms"] == 40.0
    assert account["wait_ms"] == 7.0
    assert account["out_gib"] == 6.0 and account["in_gib"] == 3.0
    assert account["dropped_gib"] == 0.5
    assert account["demand_pageins"] == 43
    assert account["allocator_retries"] == 12 and account["allocator_failures"] == 6
    assert account["schedules_adopted"] == 0 and account["schedule_active"] == 0
    line = compare.describe_iteration("lms", 0, 4.4, account)
    assert line.startswith(
        "iteration 0 of lms: 4.40 s, no schedule yet; pinning host memory 2100 ms (35 buffers)"
    )
    assert "stalls 300 ms" in line and "(43 on demand)" in line
    assert "allocator 12 retries, 6 failures" in line


def test_iteration_account_of_a_build_without_the_keys_counts_zero() -> None:
    account = compare.iteration_account({}, {"stall_ms": 1.5}, {}, {})
    assert account["stall_ms"] == 1.5
    assert account["host_pin_ms"] == 0 and account["allocator_retries"] == 0


@pytest.mark.parametrize(
    ("before", "after", "said"),
    [
        ({}, {"schedule_active": 1}, "schedule in use"),
        (
            {"schedule_detections": 0},
            {"schedule_detections": 1, "schedule_active": 1},
            "schedule adopted 1x, in use at the end",
        ),
        (
            {"schedule_detections": 1, "schedule_fallbacks": 0},
            {"schedule_detections": 2, "schedule_fallbacks": 2, "schedule_active": 0},
            "schedule adopted 1x, dropped 2x, none at the end",
        ),
    ],
)
def test_an_iteration_s_account_says_what_the_learned_schedule_did(
    before: dict[str, float], after: dict[str, float], said: str
) -> None:
    account = compare.iteration_account(before, after, {}, {})
    assert compare.describe_iteration("lms", 2, 0.5, account).startswith(
        f"iteration 2 of lms: 0.50 s, {said}; "
    )


def test_train_measure_accounts_for_every_warm_up_step(monkeypatch: pytest.MonkeyPatch) -> None:
    torch, events, cuda = fake_cuda_training(monkeypatch, recompute=True)
    from lmsbench import lms_setup

    # Around each of the three warm-up steps (before, after), then the timed ones, in which
    # the schedule falls back once.
    timed = {"schedule_active": 1, "schedule_period": 10, "pagein_demand_count": 0}
    steps = [
        {**STATS_BEFORE, "schedule_detections": 0, "schedule_active": 0},
        {**STATS_BEFORE, "schedule_detections": 0, "schedule_active": 0},
        {**STATS_BEFORE, "schedule_detections": 0, "schedule_active": 0},
        {**STATS_BEFORE, "schedule_detections": 1, "schedule_active": 1},
        {**STATS_BEFORE, "schedule_detections": 1, "schedule_active": 1},
        {**STATS_BEFORE, "schedule_detections": 1, "schedule_active": 1},
        {**STATS_BEFORE, **timed, "schedule_fallbacks": 2},
        {**STATS_AFTER, **timed, "schedule_fallbacks": 3},
    ]
    stats = iter(steps)
    monkeypatch.setattr(lms_setup, "lms_stats", lambda: dict(next(stats)))
    m, lines = measure_tiny_workload(torch, events, cuda, "lms", warmup=3)
    assert [a["schedule_active"] for a in m.warmup_accounts] == [0, 1, 1]
    assert [a["schedules_adopted"] for a in m.warmup_accounts] == [0, 1, 0]
    assert m.first_iteration == m.warmup_accounts[0]
    said = [line.strip() for line in lines if " of lms: " in line]
    assert [line.split(":")[0] for line in said] == [f"iteration {i} of lms" for i in range(3)]
    assert "schedule adopted 1x, in use at the end" in said[1]
    assert "schedule in use" in said[2]
    assert m.lms_schedule.startswith("period 10, 3 fallbacks (1 timed), ")
