"""benchmarks/summarize.py: markdown tables from compare.py's CSVs, README section upkeep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import compare, speed, summarize
from benchmarks.compare import Bandwidth, Measurement, evaluate_goals, fill_roofline

REPO = Path(__file__).resolve().parents[2]
ENV = {
    "device": "Fake GPU",
    "torch": "9.9",
    "cuda": "13.0",
    "lms_backend": "extension",
    "date": "2030-01-01T00:00:00+00:00",
}


def write_results(folder: Path, model: str) -> None:
    rows = [
        Measurement(model, "baseline", None, None, 8, iteration_times=[0.1]),
        Measurement(
            model,
            "lms",
            2.0,
            4 << 30,
            8,
            iteration_times=[0.3],
            out_bytes_per_iter=5e9,
            in_bytes_per_iter=5e9,
            largest_batch=50,
            deficit_bytes=4_000_000_000,
        ),
        Measurement(model, "no_lms", 2.0, 4 << 30, 3, iteration_times=[0.04], largest_batch=3),
    ]
    for m in rows:
        m.finish_timing()
    fill_roofline(rows, 0.1 / 8, Bandwidth(50e9, 50e9, 100e9))
    goals = evaluate_goals(rows, [2.0])
    folder.mkdir(parents=True, exist_ok=True)
    compare.write_csv(
        folder / f"compare-{model}.csv",
        compare.MEASUREMENT_COLUMNS,
        [compare.measurement_record(m) for m in rows],
        ENV,
    )
    compare.write_csv(
        folder / f"compare-{model}-goals.csv",
        compare.GOAL_COLUMNS,
        [compare.goal_record(model, g) for g in goals],
        ENV,
    )


def test_without_results_says_nothing_was_measured(tmp_path: Path) -> None:
    text = summarize.summary(tmp_path / "missing")
    assert text.startswith("No GPU results have been measured yet.")
    assert "|" not in text


def test_tables_in_model_order(tmp_path: Path) -> None:
    write_results(tmp_path, "gpt")
    write_results(tmp_path, "resnet152")
    text = summarize.summary(tmp_path, "benchmarks/results/compare")
    assert "benchmarks/results/compare" in text
    assert text.index("| resnet152 | baseline") < text.index("| gpt | baseline")
    assert "| Fake GPU | 9.9 | 13.0 |" in text
    assert "### Goals" in text and "| largest_batch_ratio | 2x | 16.67x | >= 10x | yes |" in text
    # deficit 4 GB: its roofline is the 0.1 s of compute, measured 0.3 s; out 5 GB = 1.25x
    assert "| lms_efficiency | 2x | 33.3% | >= 85% | no | -51.7 points |" in text
    assert "| lms_out_vs_deficit | 2x | 1.25x | <= 1.25x | yes | +0.00x |" in text
    assert "| overhead_when_fitting | - |  | <= 1% | not measured |" in text


def test_readme_section_rewrite_and_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{summarize.BEGIN}\nold\n{summarize.END}\n\nafter\n")
    results = tmp_path / "results"
    assert summarize.main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert summarize.main(["--results", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and "No GPU results have been measured yet." in text
    assert text.startswith("# Title\n") and text.endswith("\nafter\n")
    assert summarize.main(["--results", str(results), "--readme", str(readme), "--check"]) == 0
    write_results(results, "vit_l")
    assert summarize.main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert "stale" in capsys.readouterr().err


def test_missing_markers_and_bad_csv(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    assert summarize.main(["--results", str(tmp_path), "--readme", str(readme)]) == 2
    (tmp_path / "compare-gpt.csv").write_text("a,b\n1,2\n")
    assert summarize.main(["--results", str(tmp_path)]) == 2


def test_committed_readme_is_up_to_date() -> None:
    """benchmarks/README.md's generated section matches the committed CSVs (regenerate it with
    `python -m benchmarks.summarize --readme benchmarks/README.md`)."""
    assert summarize.main(["--readme", str(REPO / "benchmarks/README.md"), "--check"]) == 0


def test_docs_nocap_table_is_up_to_date() -> None:
    """docs/results.md's no-cap table is what the committed no-cap results make (regenerate it
    with `python -m benchmarks.summarize --nocap benchmarks/results/nocap/<run> --readme
    docs/results.md`)."""
    runs = sorted(p for p in (REPO / "benchmarks/results/nocap").iterdir() if p.is_dir())
    assert runs, "no committed no-cap results"
    readme = REPO / summarize.SECTION_FILES["nocap-table"]
    assert summarize.main(["--nocap", str(runs[-1]), "--readme", str(readme), "--check"]) == 0


def test_nocap_table_says_which_engine_ran_it(tmp_path: Path) -> None:
    run = REPO / "benchmarks/results/nocap/2026-11-25-h100-cb6b81b"
    table = summarize.nocap_summary(run, "here", "0" * 64)
    assert "Engine cb6b81b (not the engine of this checkout" in table
    sha = json.loads((run / "gpt/nocap-gpt.json").read_text())["environment"]
    table = summarize.nocap_summary(run, "here", sha["engine_sources_sha256"])
    assert "Engine cb6b81b (the engine of this checkout)" in table
    assert table.count("\n| ") == 2 + 9  # header, separator, 3 models x 3 factors
    assert "No no-cap results" in summarize.nocap_summary(tmp_path, "here", "")


def test_committed_goals_are_rescored(tmp_path: Path) -> None:
    """The committed compare-MODEL-goals.csv files are what this version's goals make of the
    committed compare-MODEL.json files (rescore them with `python -m benchmarks.compare
    --rescore benchmarks/results/compare/2026-11-24-h100-unrecorded`)."""
    runs = sorted(summarize.DEFAULT_RESULTS.glob("compare-*.json"))
    assert runs, "no committed runs"
    for run in runs:
        shutil.copy(run, tmp_path / run.name)
        out, _, goals = compare.rescore(tmp_path / run.name)
        assert goals
        committed = summarize.DEFAULT_RESULTS / out.name
        assert out.read_bytes() == committed.read_bytes(), committed


def test_readme_tables_are_up_to_date() -> None:
    """README.md's summary, the tables of docs/results.md (no cap, the regression matrix, the
    comparison under a cap, the stress suite, recompute), benchmarks/README.md's summary and
    the index of benchmarks/results/ are what the committed results make (regenerate them
    with `python -m benchmarks.summarize --tables`)."""
    assert summarize.main(["--tables", "--check"]) == 0


def test_tables_takes_no_other_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert summarize.main(["--tables", "--readme", "README.md"]) == 2
    assert "--tables takes no other" in capsys.readouterr().err


def test_results_index(tmp_path: Path) -> None:
    """One row per run folder: the engine its results record, else its name's, else
    unrecorded; a folder off the layout is flagged."""
    run = tmp_path / "nocap" / "2030-01-01-h100-unrecorded" / "gpt"
    run.mkdir(parents=True)
    (run / "nocap-gpt.json").write_text(json.dumps({"environment": {"engine_commit": "c" * 40}}))
    (run.parent / "README.md").write_text("# A run\n\nmore\n")
    named = tmp_path / "stress" / "2030-01-02-h200-abc1234"
    named.mkdir(parents=True)
    (named / "results.jsonl").write_text("")
    (tmp_path / "stress" / "stress-h100-2030-01-01").mkdir()
    index = summarize.results_index(tmp_path)
    assert "| `nocap/2030-01-01-h100-unrecorded/` | 2030-01-01 | h100 | ccccccc (recorded) |" in (
        index
    )
    assert "| A run; `gpt/` |" in index
    assert "| `stress/2030-01-02-h200-abc1234/` | 2030-01-02 | h200 | abc1234 (folder name) | " in (
        index
    )
    assert "| `stress/stress-h100-2030-01-01/` |  |  | not in the layout |  |" in index


def test_committed_results_follow_the_layout() -> None:
    """benchmarks/results/<topic>/<date>-<device>-<commit>/ for every run folder; beside the
    topics only the index (README.md) and the narrative of the runs (HISTORY.md)."""
    assert "not in the layout" not in summarize.results_index()
    documents = ("README.md", "HISTORY.md")
    loose = [p.name for p in summarize.RESULTS.iterdir() if p.is_file() and p.name not in documents]
    assert not loose, loose


def test_readme_tables_name_committed_results() -> None:
    """Every folder summarize.README_TABLES names is committed, and the no-cap table is made
    of the newest no-cap run."""
    for folders in summarize.README_TABLES.values():
        for folder in folders:
            assert (REPO / folder).is_dir(), folder
    runs = sorted(p for p in (REPO / "benchmarks/results/nocap").iterdir() if p.is_dir())
    assert REPO / summarize.README_TABLES["nocap"][0] == runs[-1]


def test_commit_from_folder() -> None:
    results = Path("benchmarks/results")
    assert summarize.commit_from_folder(results / "matrix/2026-11-25-h100-59e7f86") == "59e7f86"
    assert summarize.commit_from_folder(results / "matrix/2026-11-25-h100-59e7f86/capped") == (
        "59e7f86"
    )
    assert summarize.commit_from_folder(results / "stress/2026-11-24-h100-42a6575") == "42a6575"
    assert summarize.commit_from_folder(results / "compare/2026-11-24-h100-unrecorded") is None
    assert summarize.commit_from_folder(results / "regression/2026-11-24-h100-unrecorded/x") is None


SHA = "a" * 64


def matrix_entry(test: str, outcome: str = "passed", **fields: object) -> dict[str, object]:
    return {"test": f"tests/regression/test_families.py::{test}", "outcome": outcome, **fields}


def write_matrix(folder: Path, env: dict[str, object], *entries: dict[str, object]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "regression-results.json").write_text(
        json.dumps({"environment": env, "tests": list(entries)})
    )


def test_matrix_tables(tmp_path: Path) -> None:
    """Capped rows and rows beyond the device in two tables; a later folder's test replaces
    an earlier one's unless skipped there; each table names the engine of each results file
    its rows come from."""
    gib = 1 << 30
    env = {"device": "GPU A", "torch": "9.9", "cuda": "13.0", "date": "2030-01-02T00:00:00"}
    old = tmp_path / "matrix" / "2030-01-01-a-abc1234"
    write_matrix(
        old,
        env,
        matrix_entry("test_capped[lstm-half]", family="lstm", cap="1/2", s_per_iter=1.0),
        matrix_entry(
            "test_share_host_budget",
            "failed",
            cap="budget",
            s_per_iter=[None, None],
            worker_outcomes=["host OOM", "host OOM"],
        ),
        matrix_entry("test_nocap[2x]", cap="none (2x)", s_per_iter=5.0, host_limit_bytes=0),
    )
    new_env = {
        **env,
        "engine_commit": "def5678" + "0" * 33,
        "engine_dirty": False,
        "engine_sources_sha256": SHA,
        "driver": "580.1",
    }
    write_matrix(
        tmp_path / "matrix" / "2030-01-02-a-unrecorded" / "part",
        new_env,
        matrix_entry(
            "test_capped[cnn2d-quarter]",
            family="cnn2d",
            cap="1/4",
            s_per_iter=0.5,
            reference_s_per_iter=0.25,
            pageout_bytes_per_iter=3 * gib,
            bit_identical=True,
        ),
        matrix_entry(
            "test_share_host_budget",
            cap="budget",
            s_per_iter=[1.5, None],
            host_limit_bytes=[2 * gib, 2 * gib],
            worker_outcomes=["finished", "host OOM"],
        ),
        matrix_entry("test_nocap[2x]", "skipped"),
        matrix_entry(
            "test_ddp_two_gpus",
            family="ddp_resnet50",
            cap="1/2 per GPU",
            reference_s_per_iter=[0.36, 0.36],
            bit_identical=[True, True],
        ),
    )
    write_matrix(tmp_path / "bare", env, matrix_entry("test_nocap[1.25x]", cap="none (1.25x)"))
    folders = [old, tmp_path / "matrix" / "2030-01-02-a-unrecorded", tmp_path / "bare"]
    capped, beyond = summarize.matrix_summaries(folders, lambda p: p.name, SHA)

    first, second, _, header, _, *rows = capped.splitlines()
    assert first.startswith("Engine def5678 (the engine of this checkout), GPU A, torch 9.9, ")
    assert "driver 580.1, 2030-01-02; from `part`." in first
    assert second.startswith("Engine abc1234 (from the folder name; the results record no")
    assert "driver unrecorded" in second
    assert header.startswith("| family | cap | s/iter LMS |")
    assert [r.split(" | ")[0] for r in rows] == [
        "| 2D CNN 1536²",
        "| cuDNN LSTM stack",
        "| ResNet-50, DDP on 2 GPUs (per rank)",
    ]
    assert rows[0] == ("| 2D CNN 1536² | 1/4 | 0.500 | 0.250 | 3.00 GiB |  |  |  | yes | passed |")
    assert "| 0.360 |" in rows[2] and "| yes |" in rows[2]  # the same on both ranks

    lines = beyond.splitlines()
    # In the order of the rows: test_nocap[1.25x], test_nocap[2x], test_share_host_budget.
    assert lines[0].startswith("Engine unrecorded (neither the results nor their folder name")
    assert lines[1].startswith("Engine abc1234 (from the folder name")
    assert lines[2].startswith("Engine def5678 (the engine of this checkout)")
    rows = lines[6:]
    assert rows[0].startswith("| none (1.25x) |")
    assert rows[1].startswith("| none (2x) | 5.000 |")  # the skipped rerun does not replace it
    assert rows[2] == "| budget | 1.500 / - |  |  | 2.00 GiB | finished / host OOM | passed |"

    other = summarize.matrix_summaries(folders, lambda p: p.name, "b" * 64)[0]
    assert "Engine def5678 (not the engine of this checkout (its engine/ sources differ))" in (
        other
    )
    empty = summarize.matrix_summaries([tmp_path / "none"], lambda p: p.name, SHA)
    assert empty[0].startswith("No capped matrix rows") and empty[1].startswith("No matrix rows")


CAPPED = REPO / "benchmarks/results/compare/2026-11-24-h100-unrecorded"


def test_capped_table_and_figures(tmp_path: Path) -> None:
    text = summarize.capped_summary(CAPPED, "here", SHA)
    lines = text.splitlines()
    assert lines[0].startswith("Engine unrecorded (neither the results nor their folder name")
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 9  # 3 models x 3 caps
    assert rows[0].startswith("| ResNet-152 512², batch 64 (0.239 s, 28.8 GiB) | 1.5x | 0.544 |")
    assert "LMS is faster than `save_on_cpu` in all 7 rows where both trained" in text
    assert "not in ViT-L at 1.5x, 280.6 against 280.4 ms" in text
    assert "Checkpointing is faster than LMS in all 6 rows where both trained" in text
    assert "`lms_faster_than_save_on_cpu` (> 1.00x) met in 9 of 9" in text

    # A run that records its engine says whether it is this checkout's.
    for path in CAPPED.glob("compare-*"):
        shutil.copy(path, tmp_path / path.name)
    run = tmp_path / "compare-gpt.json"
    data = json.loads(run.read_text())
    data["environment"].update(
        engine_commit="1234567abc", engine_dirty=True, engine_sources_sha256=SHA, driver="580"
    )
    run.write_text(json.dumps(data))
    text = summarize.capped_summary(tmp_path, "here", SHA)
    assert "Engine 1234567 (a tree with changes; the engine of this checkout)" in text
    assert "driver 580," in text and "Engine unrecorded" in text  # the other two runs
    assert "No capped comparison" in summarize.capped_summary(tmp_path / "x", "here", SHA)


def test_check_fails_when_readme_and_results_disagree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sections = "\n\n".join(
        f"{begin}\nold\n{end}"
        for begin, end in (
            (summarize.MATRIX_CAPPED_BEGIN, summarize.MATRIX_CAPPED_END),
            (summarize.MATRIX_BEYOND_BEGIN, summarize.MATRIX_BEYOND_END),
            (summarize.CAPPED_BEGIN, summarize.CAPPED_END),
        )
    )
    readme = tmp_path / "README.md"
    readme.write_text(f"# Results\n\n{sections}\n")
    results = tmp_path / "compare"
    shutil.copytree(CAPPED, results)
    matrix = tmp_path / "matrix"
    write_matrix(
        matrix,
        {"device": "GPU"},
        matrix_entry("test_capped[lstm-half]", family="lstm", cap="1/2", s_per_iter=1),
    )
    argv = ["--readme", str(readme), "--matrix", str(matrix), "--capped", str(results)]
    assert summarize.main([*argv, "--check"]) == 1
    assert "matrix-capped, matrix-beyond, capped-compare" in capsys.readouterr().err
    assert summarize.main(argv) == 0
    assert summarize.main([*argv, "--check"]) == 0
    # A result changes: the README is stale.
    run = results / "compare-gpt.json"
    data = json.loads(run.read_text())
    data["measurements"][3]["iteration_s"] = 0.5
    run.write_text(json.dumps(data))
    assert summarize.main([*argv, "--check"]) == 1
    assert "(capped-compare)" in capsys.readouterr().err
    # Without --readme the tables are printed.
    assert summarize.main(["--matrix", str(matrix)]) == 0
    assert "cuDNN LSTM stack" in capsys.readouterr().out


def test_stress_section_is_the_gate_over_every_record(tmp_path: Path) -> None:
    env = {
        "engine_commit": "abc1234def",
        "engine_dirty": False,
        "engine_sources_sha256": "5" * 64,
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "driver": "580.159.04",
    }

    def rec(seed: int, cls: str, attempt: int = 1, over_cap: bool | None = False) -> str:
        record = {"seed": seed, "attempt": attempt, "class": cls, "reason": "why"}
        record |= {"timestamp": f"2026-11-25T1{attempt}:00:00+00:00", "env": env}
        record["mapped_bound_exceeds_cap"] = over_cap
        return json.dumps(record) + "\n"

    folder = tmp_path / "stress"
    folder.mkdir()
    assert "No stress results" in summarize.stress_summary(folder, "stress", "5" * 64)
    records = [rec(0, "identical"), rec(1, "crash", over_cap=None), rec(1, "identical", 2)]
    records += [rec(2, "cap-not-binding"), rec(3, "oom-expected", over_cap=True)]
    records += [rec(5, "mismatch", over_cap=True), rec(6, "mismatch")]
    (folder / "results.jsonl").write_text("".join(records))
    text = summarize.stress_summary(folder, "stress", "5" * 64)
    assert text.startswith("Engine abc1234 (the engine of this checkout), NVIDIA H100")
    # The earlier crash of seed 1 is judged, as the runner's gate judges it.
    assert "6 cases where the cap binds, 1 where it does not (6 seeds: 0-3, 5-6, 7 records)" in text
    assert "gate: **FAIL** (3 failing record(s))." in text
    # Which seeds' reference working set exceeds the cap is shown beside, and judges nothing:
    # a mismatch over the cap fails as any other.
    assert "| crash | 1 | fails | 1 |  |" in text
    assert "| mismatch | 2 | fails | 5, 6 | 5 |" in text
    # Gaps between a run's parts show.
    assert summarize.seed_ranges([7, 0, 1, 2, 9, 10, 2]) == "6 seeds: 0-2, 7, 9-10"
    assert summarize.seed_ranges([]) == "no seeds"
    assert "| identical | 2 | passes |  |  |" in text
    assert "| oom-expected | 1 | passes | 3 | 3 |" in text
    (folder / "results.jsonl").write_text("".join(records[2:5]))
    assert "gate: **PASS**." in summarize.stress_summary(folder, "stress", "6" * 64)


def _hybrid_run(model: str, regime: str, rows: list[tuple[str, float, str, float]]) -> dict:
    """A compare.py JSON of ``rows`` (method, factor, status, seconds per iteration)."""
    measurements = []
    for method, factor, status, seconds in rows:
        m = {"method": method, "factor": factor, "status": status, "batch": 8}
        if status == "ok":
            m["iteration_s"] = seconds
        if method == "lms_hybrid":
            m.update(
                drop_bytes_per_iter=2 * (1 << 30),
                recompute_bytes_per_iter=1 << 30,
                recompute_ms_per_iter=12.5,
                pagein_demand_count_per_iter=30.0,
            )
        if method == "lms":
            m["pagein_demand_count_per_iter"] = 10.0
        measurements.append(m)
    env = {**ENV, "engine_commit": "abcdef1", "engine_dirty": False}
    env["engine_sources_sha256"] = SHA
    return {
        "environment": env,
        "regime": regime,
        "batch": 8,
        "config": {"model": model},
        "measurements": measurements,
    }


def test_hybrid_table_and_goals(tmp_path: Path) -> None:
    capped = _hybrid_run(
        "resnet152",
        "capped",
        [
            ("lms", 1.5, "ok", 0.5),
            ("lms_hybrid", 1.5, "ok", 0.25),
            ("checkpoint", 1.5, "ok", 0.3),
            ("lms", 4.0, "ok", 1.0),
            ("lms_hybrid", 4.0, "ok", 0.8),
            ("checkpoint", 4.0, "oom", 0.0),
        ],
    )
    nocap = _hybrid_run(
        "gpt",
        "nocap",
        [
            ("lms", 1.5, "ok", 4.0),
            ("lms_hybrid", 1.5, "ok", 3.0),
            ("checkpoint", 1.5, "ok", 2.0),
            ("offload", 1.5, "skipped", 0.0),
        ],
    )
    (tmp_path / "capped").mkdir()
    (tmp_path / "capped/compare-resnet152.json").write_text(json.dumps(capped))
    (tmp_path / "nocap").mkdir()
    (tmp_path / "nocap/nocap-gpt.json").write_text(json.dumps(nocap))
    text = summarize.hybrid_summary(tmp_path, "here", SHA)
    assert text.startswith("Engine abcdef1 (the engine of this checkout)")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1] == (
        "| ResNet-152 | cap 1/1.5 of the peak, batch 8 | 500.0 | 250.0 | 300.0 | not measured "
        "| 0.50 | 0.83 | 2.00 / 1.00 | 12.5 | 10 / 30 |"
    )
    assert rows[2].startswith("| ResNet-152 | cap 1/4 of the peak, batch 8 | 1000.0 | 800.0 ")
    assert "| out of memory |" in rows[2]
    assert rows[3].startswith("| GPT | no cap, need 1.5x the device, batch 8 | 4000.0 | 3000.0 ")
    assert "checkpointing under a 1.5x or 2x cap: ResNet-152 1.5x; above it: none." in text
    # 4x: faster than paging, checkpointing out of memory; no cap: slower than checkpointing.
    assert "out of memory) at 4x and with no cap: ResNet-152 4x; not: GPT no cap 1.5x." in text
    assert "No lms_hybrid results" in summarize.hybrid_summary(tmp_path / "x", "here", SHA)


def test_every_generated_section_lives_once_in_its_file() -> None:
    """Each section SECTION_FILES names has its markers once, in its file and in no other of
    the files it names, so --tables writes each table in one place."""
    files = {REPO / f for f in summarize.SECTION_FILES.values()}
    for name, where in summarize.SECTION_FILES.items():
        begin = f"<!-- {name}:begin"
        for path in files:
            count = path.read_text().count(begin)
            assert count == (1 if path == REPO / where else 0), (name, path)
    markers = (
        summarize.SUMMARY_BEGIN,
        summarize.NOCAP_BEGIN,
        summarize.MATRIX_CAPPED_BEGIN,
        summarize.MATRIX_BEYOND_BEGIN,
        summarize.CAPPED_BEGIN,
        summarize.STRESS_BEGIN,
        summarize.HYBRID_BEGIN,
        summarize.HYBRID_STRESS_BEGIN,
        summarize.BEGIN,
        summarize.INDEX_BEGIN,
        speed.SPEED_BEGIN,
    )
    assert sorted(summarize.section_name(m) for m in markers) == sorted(summarize.SECTION_FILES)


def test_engine_cell_says_which_engine() -> None:
    folder = Path("benchmarks/results/matrix/2030-01-01-h100-abc1234")
    env = {"device": "NVIDIA H100 80GB HBM3", "date": "2030-01-02T03:04:05"}
    recorded = {**env, "engine_commit": "def5678" + "0" * 33, "engine_sources_sha256": SHA}
    cell = summarize.engine_cell(
        [(folder, env), (folder, recorded), (folder, {**recorded, "engine_sources_sha256": "b"})],
        SHA,
    )
    assert cell == (
        "abc1234 (folder name), H100, 2030-01-02; def5678 (this checkout's), H100, 2030-01-02; "
        "def5678 (not this checkout's), H100, 2030-01-02"
    )
    bare = summarize.engine_cell([(Path("x"), {"device": "GPU A"})], SHA)
    assert bare == "unrecorded, GPU A, "


def test_lms_summary_rows(tmp_path: Path) -> None:
    """One row per kind of run, counted from the same results as the detailed tables."""
    capped = _hybrid_run(
        "resnet152",
        "capped",
        [
            ("baseline", None, "ok", 0.25),  # type: ignore[list-item]
            ("lms_fits", None, "ok", 0.26),  # type: ignore[list-item]
            ("lms", 2.0, "ok", 0.5),
            ("checkpoint", 2.0, "ok", 0.3),
            ("save_on_cpu", 2.0, "ok", 1.0),
            ("lms", 4.0, "ok", 1.0),
            ("checkpoint", 4.0, "oom", 0.0),
            ("save_on_cpu", 4.0, "oom", 0.0),
        ],
    )
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare/compare-resnet152.json").write_text(json.dumps(capped))
    gib = 1 << 30
    write_matrix(
        tmp_path / "matrix",
        {"device": "GPU A", "date": "2030-01-02", "engine_commit": "abcdef1"},
        matrix_entry(
            "test_capped[lstm-half]",
            family="lstm",
            cap="1/2",
            s_per_iter=1.0,
            reference_s_per_iter=0.5,
            bit_identical=True,
        ),
        matrix_entry(
            "test_ddp_two_gpus",
            family="ddp_resnet50",
            cap="1/2 per GPU",
            s_per_iter=0.9,
            reference_s_per_iter=[0.3, 0.3],
            bit_identical=[True, False],
        ),
        matrix_entry("test_nocap[2x]", cap="none (2x)", s_per_iter=5.0, deficit_bytes=gib),
    )
    tables = {
        "nocap": [tmp_path / "none"],
        "capped": [tmp_path / "compare"],
        "matrix": [tmp_path / "matrix"],
        "stress": [tmp_path / "none"],
    }
    text = summarize.lms_summary(tables, SHA)
    rows = [line for line in text.splitlines() if line.startswith("| ")][2:]
    assert len(rows) == 4  # capped, matrix capped, beyond, everything fits
    assert rows[0].startswith("| Under a memory cap of 1/2, 1/4 of the peak: ResNet-152 | ")
    assert "| trains 2 of 2 | 2.0x to 4.0x the uncapped time |" in rows[0]
    assert "`save_on_cpu`: LMS faster in 1 of 1, out of memory in 1 more" in rows[0]
    assert "checkpointing: LMS faster in 0 of 1, out of memory in 1 more" in rows[0]
    assert "| abcdef1 (this checkout's), Fake GPU, 2030-01-01 |" in rows[0]
    assert "| 2 of 2 pass; 1 of 2 bit-identical to the uncapped run | 2.0x to 3.0x " in rows[1]
    assert rows[2].startswith("| Beyond the device") and "| 1 of 1 pass " in rows[2]
    assert "| +4.0% against LMS off |" in rows[3]
    empty = {key: [tmp_path / "none"] for key in tables}
    assert summarize.lms_summary(empty, SHA) == "No GPU results are committed yet."
