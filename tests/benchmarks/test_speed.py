"""benchmarks/speed.py on the CPU: the selection's parsing, the plan and its estimates, the
budget shares, the calls it makes, and the table of merged result folders."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import speed, summarize

REPO = Path(__file__).resolve().parents[2]
SHA = "a" * 64


# ---------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------


def test_lists_parse_in_canonical_order_and_name_what_is_unknown() -> None:
    assert speed.parse_list("gpt, resnet152", speed.MODELS, "models") == ("resnet152", "gpt")
    with pytest.raises(argparse.ArgumentTypeError, match="models must be some of"):
        speed.parse_list("gpt,bert", speed.MODELS, "models")
    with pytest.raises(argparse.ArgumentTypeError):
        speed.parse_list(" , ", speed.MODELS, "models")
    # A cap of 1/1.5 of the peak is the factor 1.5; duplicates go, the order is ascending.
    assert speed.parse_factor_list("2,1/1.5,1.5") == (1.5, 2.0)
    assert speed.parse_factor_list("") == ()
    for bad in ("1", "0.5", "x", "1/1", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            speed.parse_factor_list(bad)


def test_the_parser_selects_a_subset_and_defaults_to_the_whole_table() -> None:
    parser = speed.build_parser()
    args = parser.parse_args(["plan"])
    assert args.models == speed.MODELS and args.regimes == speed.REGIMES
    assert args.nocap_factors == (1.25, 1.5, 2.0, 4.0)
    assert args.capped_factors == (1.5, 2.0, 4.0)
    assert set(args.methods) == {
        "lms",
        "lms_paging",
        "lms_hybrid",
        "checkpoint",
        "compile_budget",
        "offload",
    }
    assert (args.warmup, args.iterations) == (3, 10) and args.speed_args == ["--amp"]
    args = parser.parse_args(
        [
            "run",
            "--out",
            "x",
            "--models",
            "gpt",
            "--regimes",
            "capped",
            "--capped-factors",
            "1/2",
            "--methods",
            "lms_paging,checkpoint",
            "--speed-args=--gpt-dim 2048 --optimizer sgd",
        ]
    )
    assert args.models == ("gpt",) and args.regimes == ("capped",)
    assert args.capped_factors == (2.0,) and args.speed_args == [
        "--gpt-dim",
        "2048",
        "--optimizer",
        "sgd",
    ]
    groups = speed.plan_groups(
        args.models, args.regimes, args.nocap_factors, args.capped_factors, args.methods
    )
    # Checkpointing first: every ratio needs it, and a call out of time skips its last rows.
    assert groups == [speed.Group("gpt", "capped", (2.0,), ("checkpoint", "lms_paging"))]
    argv = groups[0].argv(Path("out"), 3, 10, 123.4, ["--amp"])
    assert argv == [
        "--model",
        "gpt",
        "--regime",
        "capped",
        "--factors",
        "2",
        "--methods",
        "checkpoint,lms_paging",
        "--warmup",
        "3",
        "--iterations",
        "10",
        "--out",
        "out/capped/gpt",
        "--time-budget-s",
        "123",
        "--no-search",
        "--no-overhead",
        "--amp",
    ]
    # compare.py takes every argument a call gets.
    from benchmarks import compare

    cargs = compare.build_parser().parse_args(argv)
    compare.check_args(cargs)
    assert cargs.methods == ("checkpoint", "lms_paging") and cargs.iterations == 10
    nocap = speed.Group("gpt", "nocap", (1.5,), ("lms",)).argv(Path("o"), 3, 10, 50, [])
    assert "--no-search" not in nocap and "nocap" in nocap
    assert nocap[nocap.index("--row-order") + 1] == "factors"
    assert "--host-budget-gib" not in nocap  # the host's memory unknown: compare.py's own
    sized = speed.Group("gpt", "nocap", (1.5,), ("lms",)).argv(Path("o"), 3, 10, 50, [], 250.0)
    assert sized[sized.index("--host-budget-gib") + 1] == "250"
    cargs = compare.build_parser().parse_args(["--regime", "nocap", *sized])
    compare.check_args(cargs)
    assert cargs.row_order == "factors" and cargs.prior_slowdown == speed.NOCAP_PRIOR_SLOWDOWN
    # ResNet-152 at the reference's batch 64; --speed-args come after and may override it.
    r152 = speed.Group("resnet152", "nocap", (1.5,), ("lms",)).argv(
        Path("o"), 3, 10, 50, ["--batch", "32"]
    )
    assert r152[-4:] == ["--batch", "64", "--batch", "32"]
    assert compare.build_parser().parse_args(r152).batch == 32


def test_help_runs() -> None:
    for argv in (["--help"], ["plan", "--help"], ["run", "--help"], ["table", "--help"]):
        with pytest.raises(SystemExit) as done:
            speed.build_parser().parse_args(argv)
        assert done.value.code == 0


# ---------------------------------------------------------------------------------------
# Estimates and shares
# ---------------------------------------------------------------------------------------


def test_estimates_come_from_the_committed_h200_reference() -> None:
    refs = speed.load_references()
    assert set(refs) == {(m, r) for m in speed.MODELS for r in speed.REGIMES}
    r152 = refs[("resnet152", "nocap")]
    # The reference's own cell: 1.5x is batch 473 there.
    assert speed.cell_batch(r152, "nocap", 1.5) == 473
    assert speed.cell_batch(r152, "nocap", 2.0) > 473
    assert speed.cell_batch(refs[("gpt", "capped")], "capped", 2.0) == 8

    def est(model: str, regime: str, f: float, method: str) -> float:
        return speed.estimate_cell(refs[(model, regime)], regime, f, method, 3, 10)

    # Paging pins its host memory in its first step (60 s there) and is slowest.
    assert est("resnet152", "nocap", 1.5, "checkpoint") < est(
        "resnet152", "nocap", 1.5, "lms_hybrid"
    )
    assert est("resnet152", "nocap", 1.5, "lms_hybrid") < est(
        "resnet152", "nocap", 1.5, "lms_paging"
    )
    assert est("resnet152", "nocap", 1.5, "lms_paging") > 100
    assert est("resnet152", "nocap", 2.0, "lms_paging") > est(
        "resnet152", "nocap", 1.5, "lms_paging"
    )
    # More timed iterations, a longer row.
    assert speed.estimate_cell(r152, "nocap", 1.5, "checkpoint", 3, 20) > est(
        "resnet152", "nocap", 1.5, "checkpoint"
    )
    # compile_budget: checkpointing's steps after compiling.
    assert est("gpt", "capped", 1.5, "compile_budget") == pytest.approx(
        est("gpt", "capped", 1.5, "checkpoint") + speed.compare.COMPILE_ESTIMATE_S
    )
    # Out of memory under a larger cap: out of memory at once under this one.
    assert est("gpt", "capped", 4.0, "checkpoint") == speed.OOM_ROW_S
    # Not so compile_budget: it compiles, and its budget may fit where checkpointing did not.
    assert est("gpt", "capped", 4.0, "compile_budget") > speed.compare.COMPILE_ESTIMATE_S
    # offload has no no-cap reference (host memory): the prior slowdown.
    assert est("resnet152", "nocap", 1.5, "offload") > est("resnet152", "nocap", 1.5, "checkpoint")


def test_shares_give_short_calls_their_need_and_split_the_rest() -> None:
    m = speed.SHARE_MARGIN
    assert speed.shares([10, 20], 1000) == [10 * m, 20 * m]
    given = speed.shares([10, 10, 100, 300], 200)
    assert given[:2] == [10 * m, 10 * m]
    assert given[2] == pytest.approx((200 - 20 * m) / 2) and given[2] == given[3]
    assert sum(given) == pytest.approx(200)
    assert speed.shares([], 100) == [] and speed.shares([5], 0) == [0.0]


def test_run_gives_each_call_its_share_of_what_is_left(tmp_path: Path) -> None:
    args = speed.build_parser().parse_args(
        ["run", "--out", str(tmp_path), "--models", "resnet152,gpt", "--regimes", "capped"]
    )
    args.budget_s = 200.0
    groups, cells = speed._selection(args)
    assert [g.folder for g in groups] == ["capped/resnet152", "capped/gpt"]
    now = {"t": 0.0}
    calls: list[tuple[list[str], float]] = []

    def call(argv: list[str], budget: float) -> int:
        calls.append((argv, budget))
        now["t"] += 150.0  # the first call takes most of the budget
        return 0

    lines: list[str] = []
    status = speed.run_groups(groups, cells, args, call, clock=lambda: now["t"], log=lines.append)
    first_budget = calls[0][1]
    estimates = [speed.group_estimate(g, cells) for g in groups]
    assert first_budget == pytest.approx(speed.shares(estimates, 200.0)[0])
    # 50 s left for the second: its share of that, no more.
    assert len(calls) == 2 and calls[1][1] == pytest.approx(speed.shares(estimates[1:], 50.0)[0])
    assert status == 0
    # Nothing left: the call is not made, and the status says so.
    calls.clear()
    now["t"] = 0.0

    def slow(argv: list[str], budget: float) -> int:
        calls.append((argv, budget))
        now["t"] += 1000.0
        return 1

    status = speed.run_groups(groups, cells, args, slow, clock=lambda: now["t"], log=lines.append)
    assert len(calls) == 1 and status == 3
    assert any("capped/gpt: not run" in line for line in lines)


def dry_run(tmp_path: Path, host_gib: str) -> str:
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "TOTAL_S": "540",
        "SPEED_HOST_GIB": host_gib,
    }
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu" / "run-speed.sh")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_runner_prints_its_plan_without_a_gpu(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "250")  # a host of 256 GiB
    assert out.startswith("host memory available for no-cap rows: 250 GiB")
    for folder in ("capped/resnet152", "capped/gpt", "nocap/resnet152", "nocap/gpt"):
        assert f"{folder}: about " in out
    assert "vit_l" not in out
    cells = [line for line in out.splitlines() if line.startswith("  ")]
    # 2 models x (2 no-cap factors + 1 cap) x 3 methods, each with its estimate, factor by
    # factor, checkpointing first.
    assert len(cells) == 18
    assert all(re.search(r" \d+ s, batch \d+$", line) for line in cells), cells
    nocap = [c.split()[-5] for c in cells if "no cap" in c][:6]
    assert nocap == ["checkpoint", "lms", "lms_paging"] * 2
    assert any("no cap, need 2x device" in c and "lms_paging" in c for c in cells)
    assert any("cap 1/2 of the peak" in c and "checkpoint" in c for c in cells)
    assert "budget of 540 s" in out and out.strip().splitlines()[-1].startswith("total about")
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
    # A one-GPU H200 host (128 GiB): LMS at 2x needs more pinned memory than it has.
    small = dry_run(tmp_path, "120")
    skipped = [line for line in small.splitlines() if "skipped: needs about" in line]
    assert len(skipped) == 4 and all("need 2x device" in line for line in skipped)
    assert all("checkpoint" not in line for line in skipped)
    help_text = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu" / "run-speed.sh"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "LMS_ENGINE_COMMIT" in help_text and "SPEED_METHODS" in help_text
    assert "SPEED_HOST_GIB" in help_text and "set -euo" not in help_text


def test_the_runner_splits_the_models_over_two_gpus(tmp_path: Path) -> None:
    """GPUS=2: every other model on GPU 1, each GPU's plan with the host memory given."""
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "GPUS": "2",
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "SPEED_MODELS": "resnet152,gpt,vit_l",
        "SPEED_HOST_GIB": "120",
    }
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu" / "run-speed.sh")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=tmp_path,
    ).stdout
    first, second = out.split("== GPU 1\n")
    assert first.startswith("== GPU 0\n")
    assert "nocap/resnet152: about" in first and "nocap/vit_l: about" in first
    assert "gpt" not in first
    assert "nocap/gpt: about" in second and "resnet152" not in second
    assert "vit_l" not in second
    assert first.count("available for no-cap rows: 120 GiB") == 1
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_the_runner_refuses_to_run_without_an_engine_to_name(tmp_path: Path) -> None:
    # A copy of the tree without .git and without LMS_ENGINE_COMMIT.
    copy = tmp_path / "tree"
    (copy / "scripts" / "gpu").mkdir(parents=True)
    script = copy / "scripts" / "gpu" / "run-speed.sh"
    script.write_text((REPO / "scripts" / "gpu" / "run-speed.sh").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMS_ENGINE")}
    env.update(
        PYTHON=sys.executable, OUT=str(tmp_path / "out"), GIT_CEILING_DIRECTORIES=str(tmp_path)
    )
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 2
    assert "LMS_ENGINE_COMMIT" in done.stderr and not (tmp_path / "out").exists()
    # A repository in a folder above the tree is not the tree's: the same.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    env.pop("GIT_CEILING_DIRECTORIES")
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 2 and "LMS_ENGINE_COMMIT" in done.stderr
    # With the engine named, the check passes (the run then stops at the missing environment
    # report of this partial copy, after the check).
    env.update(LMS_ENGINE_COMMIT="1234abc", LMS_ENGINE_DIRTY="0")
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, check=False
    )
    assert "no .git" not in done.stderr


# ---------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------


def row(method: str, factor: float | None, batch: int, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "method": method,
        "factor": factor,
        "batch": batch,
        "status": "ok",
        "detail": "",
        "iteration_times": [],
        "iteration_s": None,
        "warmup_times": [],
        "first_iteration_s": None,
    }
    base.update(kw)
    return base


def timed(steady: list[float], warm: list[float]) -> dict[str, Any]:
    return {
        "iteration_times": steady,
        "iteration_s": sorted(steady)[len(steady) // 2],
        "warmup_times": warm,
        "first_iteration_s": warm[0] if warm else None,
    }


def write_run(
    folder: Path, model: str, regime: str, measurements: list[dict[str, Any]], **env: Any
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stem = "nocap" if regime == "nocap" else "compare"
    record = {
        "environment": {
            "device": "NVIDIA H200",
            "torch": "2.11.0+cu130",
            "cuda": "13.0",
            "driver": "580",
            "date": "2026-11-29T10:00:00",
            "engine_commit": "abcdef0123456789",
            "engine_dirty": False,
            "engine_sources_sha256": SHA,
            **env,
        },
        "regime": regime,
        "config": {"model": model},
        "batch": 8,
        "measurements": measurements,
    }
    (folder / f"{stem}-{model}.json").write_text(json.dumps(record))


TEN = [2.0] * 9 + [9.0]  # median 2.0, one slow iteration that the median ignores


def fixture(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "a", tmp_path / "b"
    write_run(
        first / "nocap" / "gpt",
        "gpt",
        "nocap",
        [
            row("baseline", None, 8, **timed([0.4] * 10, [1.0])),
            row("baseline_fit", None, 32, **timed([1.0] * 10, [1.1])),  # 1/32 s per sample
            row("lms", 1.5, 64, recompute_on=True, **timed(TEN, [12.0, 4.0, 2.5])),
            row("checkpoint", 1.5, 64, **timed([2.5] * 10, [2.6, 2.5, 2.5])),
            row("lms_paging", 1.5, 64, **timed([4.0] * 5, [50.0, 34.0, 6.1])),
            row("compile_budget", 1.5, 64, status="skipped", detail="not run: no compile here"),
            row("offload", 1.5, 64, status="oom", detail="OutOfMemoryError: x"),
        ],
    )
    # A second folder: checkpointing measured again (replaces), lms skipped (does not).
    write_run(
        second / "nocap" / "gpt",
        "gpt",
        "nocap",
        [
            row("baseline", None, 8, **timed([0.4] * 10, [1.0])),
            row("checkpoint", 1.5, 64, **timed([3.0] * 10, [3.1, 3.0, 3.0])),
            row("lms", 1.5, 64, status="skipped", detail="time budget"),
        ],
    )
    write_run(
        second / "capped" / "gpt",
        "gpt",
        "capped",
        [
            row("baseline", None, 8, **timed([0.1] * 10, [1.0])),
            row("lms_hybrid", 2.0, 8, **timed([0.3] * 10, [1.5, 0.4, 0.3])),
            row("checkpoint", 2.0, 8, status="oom", detail="OutOfMemoryError: y"),
            row(
                "offload",
                2.0,
                8,
                detail="baseline: models.StreamOffload (torchtune not installed)",
                **timed([1.0] * 10, [1.2, 1.0, 1.0]),
            ),
        ],
    )
    return first, second


def cells_of(table: str) -> dict[str, dict[str, str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[cells["regime"]] = cells
    return rows


def test_median_and_warmup_bookkeeping() -> None:
    assert speed.steady_median(TEN) == 2.0 and speed.steady_median([]) is None
    assert speed.steady_median([1.0, 3.0]) == 2.0
    assert speed.warmup_times({"warmup_times": [3, 1.5]}) == [3.0, 1.5]
    # A record written before the warm-up times were kept: its first step alone.
    assert speed.warmup_times({"first_iteration_s": 7.0}) == [7.0]
    assert speed.warmup_times({}) == []
    # The median of the iterations kept, else the median recorded.
    assert speed._median_of(row("lms", 1.5, 4, **timed(TEN, []))) == 2.0
    assert speed._median_of(row("lms", 1.5, 4, iteration_s=1.25)) == 1.25
    assert speed._median_of(row("lms", 1.5, 4, status="oom")) is None
    text = speed.cell_text(row("lms", 1.5, 4, **timed([1.0] * 3, [5.0])), None)
    assert text == "**1.00** (median of 3); warm-up 5.00"
    text = speed.cell_text(row("lms", 1.5, 4, **timed([1.0] * 3, [5.0])), None, 4, 0.2)
    assert text == "**1.00** (median of 3); 80% of in-memory; warm-up 5.00"
    first = {"host_pin_ms": 1234.4, "stall_ms": 310.0, "allocator_retries": 12.0}
    text = speed.cell_text(
        row("lms", 1.5, 4, first_iteration=first, **timed([1.0] * 3, [5.0])), None
    )
    assert text == (
        "**1.00** (median of 3); warm-up 5.00; iteration 0 pinned host memory 1234 ms, "
        "stalled 310 ms, 12 allocator retries"
    )


def test_table_merges_folders_into_rows_with_ratios_and_in_memory_figures(tmp_path: Path) -> None:
    first, second = fixture(tmp_path)
    runs = speed.load_runs([first, second], lambda p: p.name)
    rows = cells_of(speed.speed_table(runs))
    assert list(rows) == ["no cap, need 1.5x device", "cap 1/2 of the peak"]
    nocap = rows["no cap, need 1.5x device"]
    assert nocap["model"] == "GPT" and nocap["GPU"] == "H200" and nocap["batch"] == "64"
    # In memory: the largest fitting batch's 1/32 s per sample, times 64; LMS at 2.0 s.
    assert nocap["in memory (s/iter)"] == "2.00"
    # The later folder's checkpointing (3.0) replaced the first's; its skipped lms did not.
    # The two cells come from two runs: no ratio between them.
    assert nocap["LMS default"] == (
        "**2.00**; 100% of in-memory; warm-up 12.0, 4.00, 2.50; recompute on"
    )
    # Each cell's share is of its own run's fitting batches: 0.4 s for 8 there, 3.2 s at 64.
    assert nocap["checkpointing (per block)"] == (
        "**3.00**; 107% of in-memory; warm-up 3.10, 3.00, 3.00"
    )
    assert (
        nocap["LMS paging only"]
        == "**4.00** (median of 5); 50% of in-memory; warm-up 50.0, 34.0, 6.10"
    )
    assert nocap["torch.compile activation_memory_budget"] == "not run: no compile here"
    assert nocap["offloading (torchtune-style)"] == "out of memory"
    assert nocap["LMS hybrid (recompute on)"] == "not measured"
    capped = rows["cap 1/2 of the peak"]
    assert capped["in memory (s/iter)"] == "0.10" and capped["LMS default"] == "not measured"
    # Checkpointing out of memory: no ratio.
    assert capped["LMS hybrid (recompute on)"] == (
        "**0.30**; 33% of in-memory; warm-up 1.50, 0.40, 0.30"
    )
    assert capped["offloading (torchtune-style)"].endswith("(torchtune not installed)")


def test_rows_of_another_gpu_or_batch_are_rows_of_their_own(tmp_path: Path) -> None:
    write_run(
        tmp_path / "h100",
        "gpt",
        "nocap",
        [
            row("baseline", None, 8, **timed([0.8] * 10, [1.0])),
            row("lms", 1.5, 40, **timed([3.0] * 10, [3.0])),
        ],
        device="NVIDIA H100 80GB HBM3",
    )
    write_run(
        tmp_path / "h200",
        "gpt",
        "nocap",
        [
            row("baseline", None, 8, **timed([0.4] * 10, [1.0])),
            row("checkpoint", 1.5, 64, **timed([2.0] * 10, [2.0])),
        ],
    )
    # A third call's paging row, one sample more (1% more free memory): the H200 row's.
    write_run(
        tmp_path / "h200b",
        "gpt",
        "nocap",
        [
            row("baseline", None, 8, **timed([0.4] * 10, [1.0])),
            row("lms_paging", 1.5, 65, **timed([4.0625] * 10, [9.0])),
        ],
    )
    table = speed.speed_table(speed.load_runs([tmp_path], str))
    lines = [line for line in table.splitlines() if line.startswith("| GPT")]
    assert len(lines) == 2
    h200 = next(line for line in lines if "| H200 |" in line)
    # Its checkpointing ran in another call: no ratio across runs.
    assert "**4.06**; 80% of in-memory; warm-up 9.00; batch 65" in h200
    h100 = next(line for line in lines if "| H100 |" in line)
    # Its lms row has no checkpointing of its own GPU to be compared with.
    assert "x ckpt" not in h100 and "| 4.00 |" in h100  # 0.1 s per sample x 40


def test_summary_names_the_engine_and_whether_it_is_this_checkouts(tmp_path: Path) -> None:
    first, second = fixture(tmp_path)
    text = speed.speed_summary([first, second], lambda p: p.name, SHA)
    assert text.startswith("Engine abcdef0 (the engine of this checkout), NVIDIA H200")
    assert "(10, 5 per row)" in text or "(5, 10 per row)" in text
    other = speed.speed_summary([first], lambda p: p.name, "b" * 64)
    assert "not the engine of this checkout" in other.splitlines()[0]
    empty = speed.speed_summary([tmp_path / "none"], lambda p: p.name, SHA)
    assert empty.startswith("No compare.py results in `none`") and "|" not in empty


def test_the_table_goes_between_its_markers_and_check_says_when_stale(tmp_path: Path) -> None:
    first, second = fixture(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{speed.SPEED_BEGIN}\nold\n{speed.SPEED_END}\n\nmore\n")
    argv = ["table", str(first), str(second), "--readme", str(readme)]
    assert speed.main([*argv, "--check"]) == 1
    assert speed.main(argv) == 0
    text = readme.read_text()
    assert "| GPT | H200 | no cap, need 1.5x device | 64 |" in text and "old" not in text
    assert text.endswith("more\n")
    assert speed.main([*argv, "--check"]) == 0
    # summarize.py writes the same section.
    assert (
        summarize.main(["--speed", str(first), str(second), "--readme", str(readme), "--check"])
        == 0
    )


def test_summarize_tables_leaves_the_speed_table_out_until_its_runs_are_named() -> None:
    if summarize.README_TABLES.get(summarize.SPEED_TABLE):
        assert "speed-table" in summarize.SECTION_FILES
    else:
        assert "speed-table" not in summarize.SECTION_FILES


def test_run_calls_compare_per_group_and_writes_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[list[str]] = []

    def fake_compare(argv: list[str], budget_s: float) -> int:
        made.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        model, regime = argv[argv.index("--model") + 1], argv[argv.index("--regime") + 1]
        factor = float(argv[argv.index("--factors") + 1])
        methods = argv[argv.index("--methods") + 1].split(",")
        rows = [row("baseline", None, 8, **timed([0.4] * 10, [1.0]))]
        rows += [row(m, factor, 64, **timed([1.0] * 10, [2.0, 1.5, 1.0])) for m in methods]
        write_run(out, model, regime, rows)
        return 0

    monkeypatch.setattr(speed, "_subprocess_call", fake_compare)
    out = tmp_path / "speed"
    argv = ["run", "--out", str(out), "--models", "gpt", "--methods", "checkpoint,lms_hybrid"]
    argv += ["--nocap-factors", "1.5", "--capped-factors", "2", "--host-gib", "200"]
    assert speed.main(argv) == 0
    assert [a[a.index("--regime") + 1] for a in made] == ["capped", "nocap"]
    assert all(a[a.index("--methods") + 1] == "checkpoint,lms_hybrid" for a in made)
    table = (out / "speed-table.md").read_text()
    assert table.startswith("Engine abcdef0")
    assert "| GPT | H200 | cap 1/2 of the peak | 64 |" in table
    assert "| GPT | H200 | no cap, need 1.5x device | 64 |" in table
    assert "**1.00**; 1.00x ckpt; 320% of in-memory; warm-up 2.00, 1.50, 1.00" in table
    printed = capsys.readouterr().out
    assert printed.startswith("host memory available for no-cap rows: 200 GiB")
    assert "== nocap/gpt: compare.py --model gpt --regime nocap" in printed
