"""benchmarks/summarize.py: markdown tables from compare.py's CSVs, README section upkeep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import compare
import pytest
import summarize
from compare import Bandwidth, Measurement, evaluate_goals, fill_roofline

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
    `python benchmarks/summarize.py --readme benchmarks/README.md`)."""
    assert summarize.main(["--readme", str(REPO / "benchmarks/README.md"), "--check"]) == 0


def test_readme_nocap_table_is_up_to_date() -> None:
    """README.md's no-cap table is what the committed no-cap results make (regenerate it with
    `python benchmarks/summarize.py --nocap benchmarks/results/nocap/<run> --readme
    README.md`)."""
    runs = sorted(p for p in (REPO / "benchmarks/results/nocap").iterdir() if p.is_dir())
    assert runs, "no committed no-cap results"
    readme = REPO / "README.md"
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
    committed compare-MODEL.json files (rescore them with
    `python benchmarks/compare.py --rescore benchmarks/results/compare`)."""
    runs = sorted(summarize.DEFAULT_RESULTS.glob("compare-*.json"))
    assert runs, "no committed runs"
    for run in runs:
        shutil.copy(run, tmp_path / run.name)
        out, _, goals = compare.rescore(tmp_path / run.name)
        assert goals
        committed = summarize.DEFAULT_RESULTS / out.name
        assert out.read_bytes() == committed.read_bytes(), committed
