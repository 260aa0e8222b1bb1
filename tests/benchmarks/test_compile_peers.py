"""benchmarks/compile_peers.py without a GPU: the command line, the budget arithmetic, the
discovery of torch's offloading options, the run's order and time budget with a fake worker,
the table and the files; and one worker process on the CPU."""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compile_peers
from benchmarks.compile_peers import (
    OffloadSupport,
    Row,
    cap_label,
    choose_budget,
    discover_offload_support,
    fill_ratios,
    row_record,
    write_outputs,
)

REPO = Path(compile_peers.__file__).resolve().parents[1]
GiB = 1 << 30
TINY = [
    "--gpt-layers",
    "2",
    "--gpt-dim",
    "64",
    "--gpt-heads",
    "4",
    "--gpt-seq",
    "32",
    "--gpt-vocab",
    "128",
    "--batch",
    "2",
    "--warmup",
    "1",
    "--iterations",
    "2",
]


def parse(*argv: str) -> argparse.Namespace:
    args = compile_peers.build_parser().parse_args(list(argv))
    compile_peers.check_args(args)
    return args


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.compile_peers ARGV`` from the repository root, as documented."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.compile_peers", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def test_help_lists_the_options() -> None:
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    for flag in ("--caps", "--configs", "--budget", "--offload-stream", "--time-budget-s"):
        assert flag in done.stdout
    assert "--worker" not in done.stdout


def test_defaults() -> None:
    args = parse()
    assert args.caps == [0.5, 0.25]
    assert args.configs == list(compile_peers.DEFAULT_CONFIGS)
    assert (args.gpt_layers, args.gpt_dim, args.gpt_seq, args.batch) == (12, 1024, 2048, 8)
    assert args.budget is None and args.offload_stream
    assert (args.warmup, args.iterations) == (5, 5)


def test_caps_and_configs_parse() -> None:
    assert parse("--caps", "1/4,0.5,1/4").caps == [0.5, 0.25]
    assert parse("--caps", "0.3").caps == [0.3]
    # The reference always runs, and the order is the run's.
    assert parse("--configs", "eager_lms,compiled_lms").configs == [
        "compiled",
        "compiled_lms",
        "eager_lms",
    ]
    assert parse("--no-offload-stream").offload_stream is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--caps", "1.5"], "must be in (0, 1)"),
        (["--caps", "0"], "must be in (0, 1)"),
        (["--caps", "half"], "numbers or fractions"),
        (["--caps", "1/0"], "numbers or fractions"),
        (["--caps", ","], "at least one cap"),
        (["--configs", "compiled,bogus"], "unknown configuration(s) bogus"),
        (["--budget", "1.5"], "must be in [0, 1]"),
        (["--batch", "0"], "must be >= 1"),
        (["--lms-limit-frac", "0"], "must be in (0, 1]"),
        (["--gpt-dim", "1000"], "must be a multiple of --gpt-heads"),
        (["--min-config-s", "100", "--time-budget-s", "50"], "nothing could run"),
    ],
)
def test_argument_errors_are_clear(argv: list[str], message: str) -> None:
    done = run_cli(*argv)
    assert done.returncode == 2
    assert message in done.stderr, done.stderr


# ---------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------


def test_choose_budget_fits_the_cap() -> None:
    # peak 16, activations 12: 4 GiB stay whatever is recomputed
    assert choose_budget(8 * GiB, 16 * GiB, 12 * GiB, 1.0) == pytest.approx(4 / 12, abs=1e-3)
    assert choose_budget(8 * GiB, 16 * GiB, 12 * GiB, 0.5) == 0.0  # 4 GiB alone is the aim
    assert choose_budget(3 * GiB, 16 * GiB, 12 * GiB, 0.9) == 0.0  # cannot fit: recompute all
    assert choose_budget(15 * GiB, 16 * GiB, 1 * GiB, 1.0) == 0.0
    assert choose_budget(20 * GiB, 16 * GiB, 12 * GiB, 1.0) == 1.0
    assert choose_budget(8 * GiB, 16 * GiB, 0, 0.9) == 0.0
    with pytest.raises(ValueError):
        choose_budget(0, GiB, GiB, 0.9)


def test_cap_labels() -> None:
    assert cap_label(None) == "uncapped"
    assert cap_label(0.5) == "1/2"
    assert cap_label(0.25) == "1/4"
    assert cap_label(0.3) == "0.3"


def test_schedule_state_in_words() -> None:
    active = {
        "schedule_active": 1,
        "schedule_period": 984,
        "schedule_detections": 3,
        "schedule_fallbacks": 2,
    }
    assert compile_peers.describe_schedule(active) == "period 984 (3 adopted, 2 dropped)"
    inactive = {**active, "schedule_active": 0, "schedule_period": 0}
    assert compile_peers.describe_schedule(inactive) == "inactive (3 adopted, 2 dropped)"


def test_varying_sequence_lengths() -> None:
    lengths = [compile_peers.sequence_length(2048, step) for step in range(40)]
    assert all(1024 <= n <= 2048 and n % 64 == 0 for n in lengths)
    assert len(set(lengths)) > 10  # many lengths: the loop never repeats with a short period
    assert all(a != b for a, b in zip(lengths, lengths[1:]))
    assert lengths == [compile_peers.sequence_length(2048, step) for step in range(40)]
    assert compile_peers.sequence_length(48, 3) == 48


@pytest.mark.parametrize(
    ("config", "schedule", "graph", "words"),
    [
        ("compiled_lms", None, None, None),
        ("compiled_learned_lms", None, False, "graph prefetch off"),
        ("compiled_graph_lms", False, None, "schedule off"),
        ("compiled_reactive_lms", False, False, "schedule and graph prefetch off"),
    ],
)
def test_schedule_variants(config: str, schedule: Any, graph: Any, words: str | None) -> None:
    args = parse(*TINY, "--configs", config, "--vary-seq")
    assert config in args.configs
    spec = compile_peers.worker_spec(args, config, 1 << 30)
    assert spec["lms"] and spec["compile"] and spec["vary_seq"]
    assert (spec["lms_schedule"], spec["lms_graph_prefetch"]) == (schedule, graph)
    described = compile_peers.describe_settings(spec)
    assert "varying sequence length" in described
    if words:
        assert words in described
    else:
        assert " off" not in described


@pytest.mark.parametrize(
    ("config", "graph"),
    [("compiled_uncapped_lms", None), ("compiled_uncapped_learned_lms", False)],
)
def test_uncapped_lms_rows(config: str, graph: Any, tmp_path: Path) -> None:
    args = parse(*TINY, "--configs", config)
    spec = compile_peers.worker_spec(args, config, None)
    assert spec["lms"] and spec["compile"] and spec["cap_bytes"] is None
    assert spec["lms_limit_bytes"] is None and spec["lms_graph_prefetch"] == graph
    # They run beside the reference, uncapped, and before any cap.
    seen: list[tuple[str, Any]] = []

    def runner(spec: dict[str, Any], log: Path, env: dict[str, str], t: float) -> dict[str, Any]:
        seen.append((spec["config"], spec["cap_bytes"]))
        return {
            "status": "ok",
            "iteration_times": [0.1],
            "peak_allocated_bytes": GiB,
            "activation_bytes": GiB // 2,
        }

    args = parse(
        *TINY, "--configs", f"{config},compiled_lms", "--caps", "1/2", "--out", str(tmp_path)
    )
    assert (
        compile_peers.run_benchmark(args, runner=runner, support=SUPPORT, log=lambda _: None) == 0
    )
    assert seen == [("compiled", None), (config, None), ("compiled_lms", GiB // 2)]


# ---------------------------------------------------------------------------------------
# Discovery of the offloading options
# ---------------------------------------------------------------------------------------


class FakeConfig(types.SimpleNamespace):
    def get_config_copy(self) -> dict[str, Any]:
        return dict(vars(self))


def test_discovery_with_offloading() -> None:
    fc = FakeConfig(
        activation_memory_budget=1.0,
        enable_activation_offloading=False,
        joint_custom_pass=None,
        activation_offload_separate_stream=False,
        activation_reload_prefetch=False,
    )
    ic = FakeConfig(cpu_backend="cpp")
    s = discover_offload_support(fc, ic, "9.9")
    assert s.usable and s.has_budget and s.reason == ""
    assert s.found["torch._functorch.config"] == [
        "activation_offload_separate_stream",
        "activation_reload_prefetch",
        "enable_activation_offloading",
    ]
    assert s.found["torch._inductor.config"] == []
    assert s.stream_flags == ["activation_offload_separate_stream", "activation_reload_prefetch"]
    assert "usable" in s.describe() and "separate stream" in s.describe()


def test_discovery_without_offloading_says_why() -> None:
    s = discover_offload_support(
        FakeConfig(activation_memory_budget=1.0, joint_custom_pass=None), FakeConfig(), "2.4.0"
    )
    assert not s.usable
    assert "no torch._functorch.config.enable_activation_offloading" in s.reason
    assert "no config option containing 'offload'" in s.reason
    s = discover_offload_support(
        FakeConfig(), types.SimpleNamespace(cpu_offload_thing=1, other=2), "x"
    )
    assert not s.usable and not s.has_budget
    assert s.found["torch._inductor.config"] == ["cpu_offload_thing"]  # dir() fallback
    assert "cpu_offload_thing" in s.reason and "does not know how to drive" in s.reason


def test_discovery_on_the_installed_torch() -> None:
    pytest.importorskip("torch._functorch.config", reason="needs a torch wheel")
    s = discover_offload_support()
    assert s.has_budget  # activation_memory_budget is in every torch 2.4+
    if s.usable:
        assert compile_peers.OFFLOAD_ENABLE in s.found["torch._functorch.config"]
    else:
        assert s.reason


# ---------------------------------------------------------------------------------------
# Rows, ratios, table and files
# ---------------------------------------------------------------------------------------


def synthetic_rows() -> list[Row]:
    ref = Row("compiled", None, None, status="ok", settings="compiled")
    ref.absorb(
        {
            "status": "ok",
            "iteration_times": [0.2, 0.1, 0.1],
            "peak_allocated_bytes": 16 * GiB,
            "activation_bytes": 12 * GiB,
            "losses": [9.0, 8.0],
            "first_step_s": 60.0,
        }
    )
    lms = Row("compiled_lms", 0.5, 8 * GiB, settings="compiled, LMS limit 6.40 GiB")
    lms.absorb(
        {
            "status": "ok",
            "iteration_times": [0.5, 0.4, 0.6],
            "step_times": [9.5, 0.7, 0.5, 0.4, 0.6],
            "peak_allocated_bytes": 7 * GiB,
            "activation_bytes": 12 * GiB,
            "pageout_bytes_per_iter": 9 * GiB,
            "pagein_bytes_per_iter": 9 * GiB,
            "stall_ms_per_iter": 120.5,
            "losses": [9.0, 8.0],
            "lms_backend": "extension",
        }
    )
    budget = Row("compiled_budget", 0.25, 4 * GiB, budget=0.0)
    budget.attempts.append("budget 0.1: oom (CUDA out of memory)")
    budget.absorb({"status": "oom", "detail": "OutOfMemoryError: CUDA out of memory"})
    offload = Row("compiled_offload", 0.25, 4 * GiB, status="unavailable", detail="no flag")
    skipped = Row("eager_lms", 0.25, 4 * GiB, status="skipped", detail="time budget")
    return [ref, lms, budget, offload, skipped]


def test_ratios_against_the_reference() -> None:
    rows = synthetic_rows()
    fill_ratios(rows, rows[0])
    ref, lms, budget = rows[0], rows[1], rows[2]
    assert ref.s_per_iter == pytest.approx(0.1) and ref.time_vs_ref == pytest.approx(1.0)
    assert lms.s_per_iter == pytest.approx(0.5)
    assert lms.time_vs_ref == pytest.approx(5.0)
    assert lms.peak_vs_ref == pytest.approx(7 / 16)
    assert lms.loss_rel_diff_vs_ref == 0.0
    assert budget.time_vs_ref is None and budget.trains_at_cap is False
    assert rows[3].trains_at_cap is None and rows[4].trains_at_cap is None
    assert lms.trains_at_cap is True


def test_table_csv_and_json(tmp_path: Path) -> None:
    rows = synthetic_rows()
    fill_ratios(rows, rows[0])
    env = {"device": "Fake GPU", "torch": "2.11.0", "cuda": "13.0", "date": "today"}
    support = OffloadSupport(found={"torch._functorch.config": []}, usable=False, reason="none")
    table = write_outputs(tmp_path, rows, env, support, {"model": "gpt"})
    lines = table.splitlines()
    assert lines[0].startswith("| config | cap | trains | s/iter |")
    assert len(lines) == 2 + len(rows)
    assert (
        "| compiled_lms | 1/2 (8.000 GiB) | yes | 0.5000 | 5.00 | 7.000 | 0.44 | 9.000 |"
        in (lines[3])
    )
    assert "oom: budget 0.1: oom (CUDA out of memory)" in lines[4]
    assert "unavailable: no flag" in lines[5]
    with (tmp_path / compile_peers.CSV_NAME).open() as f:
        records = list(csv.DictReader(f))
    assert [r["config"] for r in records] == [r.config for r in rows]
    assert records[1]["pageout_gib_per_iter"] == "9.000"
    assert records[1]["stall_ms_per_iter"] == "120.5"
    assert records[1]["device"] == "Fake GPU"
    assert records[2]["budget"] == "0" and records[2]["trains_at_cap"] == "no"
    assert records[0]["cap"] == "uncapped" and records[0]["cap_gib"] == ""
    data = json.loads((tmp_path / compile_peers.JSON_NAME).read_text())
    assert data["model"] == "gpt" and data["offload_support"]["reason"] == "none"
    assert data["rows"][1]["trains_at_cap"] is True
    assert data["rows"][1]["iteration_times"] == [0.5, 0.4, 0.6]
    assert data["rows"][1]["step_times"] == [9.5, 0.7, 0.5, 0.4, 0.6]


def test_row_record_has_every_column() -> None:
    assert set(row_record(Row("compiled", None, None))) == set(compile_peers.ROW_COLUMNS)


# ---------------------------------------------------------------------------------------
# The run with a fake worker
# ---------------------------------------------------------------------------------------


class FakeWorker:
    """Answers each spec like a GPU would, and advances a fake clock."""

    def __init__(self, clock: list[float], seconds: float = 30.0) -> None:
        self.clock = clock
        self.seconds = seconds
        self.specs: list[dict[str, Any]] = []

    def __call__(
        self, spec: dict[str, Any], log: Path, env: dict[str, str], timeout: float
    ) -> dict[str, Any]:
        self.specs.append(spec)
        assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("inductor")
        assert env["TRITON_CACHE_DIR"].endswith("triton")
        assert 0 < timeout <= 240
        self.clock[0] += self.seconds
        base = {"environment": {"device": "Fake GPU", "torch": "2.11.0"}, "losses": [5.0]}
        if spec["cap_bytes"] is None:
            return {
                **base,
                "status": "ok",
                "iteration_times": [0.1],
                "peak_allocated_bytes": 16 * GiB,
                "activation_bytes": 12 * GiB,
            }
        if spec["config"] == "compiled_budget" and spec["budget"] > 0:
            return {"status": "oom", "detail": "OutOfMemoryError: CUDA out of memory"}
        if spec["config"] == "compiled_offload" and any(spec["offload"]["flags"].values()):
            return {"status": "error", "detail": "RuntimeError: stream variant failed"}
        return {
            **base,
            "status": "ok",
            "iteration_times": [0.3],
            "peak_allocated_bytes": spec["cap_bytes"] - 1,
            "activation_bytes": GiB,
            "lms_backend": "extension" if spec["lms"] else "",
        }


SUPPORT = OffloadSupport(
    found={"torch._functorch.config": ["enable_activation_offloading"]},
    usable=True,
    reason="",
    stream_flags=["activation_offload_separate_stream"],
    has_budget=True,
    torch_version="fake",
)


def test_run_order_retries_and_outputs(tmp_path: Path) -> None:
    clock = [0.0]
    worker = FakeWorker(clock)
    args = parse("--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"))
    lines: list[str] = []
    status = compile_peers.run_benchmark(
        args, runner=worker, support=SUPPORT, clock=lambda: clock[0], log=lines.append
    )
    assert status == 0
    order = [(s["config"], s["cap_bytes"]) for s in worker.specs]
    half, quarter = 8 * GiB, 4 * GiB
    assert order == [
        ("compiled", None),
        ("compiled_lms", half),
        ("compiled_budget", half),
        ("compiled_budget", half),  # retried at 0 after running out of memory
        ("compiled_offload", half),
        ("compiled_offload", half),  # retried synchronously after an error
        ("eager_lms", half),
        ("compiled_lms", quarter),
        ("compiled_budget", quarter),
        ("compiled_offload", quarter),
        ("compiled_offload", quarter),
        ("eager_lms", quarter),
    ]
    budgets = [s["budget"] for s in worker.specs if s["config"] == "compiled_budget"]
    # cap 8: (0.85 * 8 - 4) / 12; cap 4: 0.85 * 4 < 4, so 0 at once (no retry)
    assert budgets == [pytest.approx(0.233, abs=1e-3), 0.0, 0.0]
    lms = next(s for s in worker.specs if s["config"] == "compiled_lms")
    assert lms["lms"] and lms["compile"] and lms["lms_limit_bytes"] == int(half * 0.8)
    eager = next(s for s in worker.specs if s["config"] == "eager_lms")
    assert eager["lms"] and not eager["compile"]
    ref = worker.specs[0]
    assert not ref["lms"] and ref["compile"] and ref["budget"] is None and not ref["offload"]

    data = json.loads((tmp_path / "out" / compile_peers.JSON_NAME).read_text())
    rows = {(r["config"], r["share"]): r for r in data["rows"]}
    assert len(rows) == 9
    b = rows[("compiled_budget", 0.5)]
    assert b["status"] == "ok" and b["budget"] == 0.0 and "oom" in b["attempts"][0]
    o = rows[("compiled_offload", 0.5)]
    assert o["status"] == "ok" and "stream variant failed" in o["attempts"][0]
    assert "synchronous" in o["settings"]
    assert rows[("compiled_lms", 0.5)]["time_vs_ref"] == pytest.approx(3.0)
    assert data["environment"]["device"] == "Fake GPU"
    assert data["environment"]["lms_backend"] == "extension"
    assert any("enable_activation_offloading" in line for line in lines)
    assert any(line.startswith("\n| config |") for line in lines)
    # The run's compile cache folder is removed at the end.
    assert list((tmp_path / "cache").iterdir()) == []


def test_time_budget_skips_what_does_not_fit(tmp_path: Path) -> None:
    clock = [0.0]
    worker = FakeWorker(clock, seconds=100.0)
    args = parse("--out", str(tmp_path), "--time-budget-s", "250", "--min-config-s", "40")
    compile_peers.run_benchmark(
        args, runner=worker, support=SUPPORT, clock=lambda: clock[0], log=lambda s: None
    )
    # 0 s: reference; 100 s: compiled_lms; 200 s: budget (50 s left); then nothing fits.
    assert [s["config"] for s in worker.specs] == ["compiled", "compiled_lms", "compiled_budget"]
    with (tmp_path / compile_peers.CSV_NAME).open() as f:
        records = list(csv.DictReader(f))
    skipped = [r for r in records if r["status"] == "skipped"]
    assert len(skipped) == 2 + 4  # offload and eager at 1/2, every row at 1/4
    assert all(r["detail"] == "time budget" for r in skipped)
    budget = next(r for r in records if r["config"] == "compiled_budget")
    assert budget["status"] == "oom" and budget["trains_at_cap"] == "no"
    assert budget["detail"].endswith("(retry not run: time budget)")


def test_unavailable_offloading_is_a_row_with_the_reason(tmp_path: Path) -> None:
    clock = [0.0]
    worker = FakeWorker(clock)
    support = OffloadSupport(
        found={"torch._functorch.config": []},
        usable=False,
        reason="torch 2.4 has no torch._functorch.config.enable_activation_offloading",
        has_budget=False,
    )
    args = parse("--out", str(tmp_path), "--caps", "1/2", "--configs", "compiled_offload")
    compile_peers.run_benchmark(
        args, runner=worker, support=support, clock=lambda: clock[0], log=lambda s: None
    )
    assert [s["config"] for s in worker.specs] == ["compiled"]
    data = json.loads((tmp_path / compile_peers.JSON_NAME).read_text())
    offload = data["rows"][1]
    assert (
        offload["status"] == "unavailable" and "enable_activation_offloading" in (offload["detail"])
    )


def test_failed_reference_stops_the_run(tmp_path: Path) -> None:
    def failing(spec: dict[str, Any], log: Path, env: dict[str, str], t: float) -> dict[str, Any]:
        return {"status": "oom", "detail": "OutOfMemoryError: CUDA out of memory"}

    args = parse("--out", str(tmp_path))
    lines: list[str] = []
    assert compile_peers.run_benchmark(args, runner=failing, support=SUPPORT, log=lines.append) == 1
    assert any("reference failed" in line for line in lines)
    assert (tmp_path / compile_peers.CSV_NAME).exists()


# ---------------------------------------------------------------------------------------
# One worker process on the CPU (eager, and compiled with aot_eager + the budget)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "extra"),
    [("eager", {"vary": True}), ("compiled_budget", {"budget": 0.3})],
)
def test_worker_process_on_the_cpu(config: str, extra: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("torch.nn", reason="needs a torch wheel (the CPU one is enough)")
    args = parse(*TINY, *(["--vary-seq"] if extra.get("vary") else []))
    spec = compile_peers.worker_spec(args, config, None, budget_value=extra.get("budget"))
    spec.update(device="cpu", backend="aot_eager")
    env = compile_peers.child_environment(tmp_path / "cache")
    result = compile_peers.subprocess_runner(spec, tmp_path / "w.log", env, 300)
    assert result["status"] == "ok", (result, (tmp_path / "w.log").read_text()[-3000:])
    assert len(result["iteration_times"]) == 2 and len(result["losses"]) == 3
    assert len(result["step_times"]) == 3
    assert result["environment"]["torch"]
    assert result.get("lms_backend") is None


def test_offload_passes_mark_and_count() -> None:
    torch = pytest.importorskip("torch")
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        return torch.ops.prims.device_put.default(y, torch.device("cpu"))

    gm = make_fx(f)(torch.ones(64, 64))
    marker = compile_peers.OffloadMarker(min_bytes=64 * 64 * 4)
    marker(gm, None)
    assert marker.calls == 1 and marker.marked >= 1
    assert any(n.meta.get("should_offload") for n in gm.graph.nodes)
    counter = compile_peers.OffloadCounter()
    counter(gm.graph)
    assert counter.graphs == 1 and counter.nodes == 1 and counter.bytes == 64 * 64 * 4


def test_lms_options_are_the_shared_ones_and_keep_the_old_spellings() -> None:
    # One declaration (lms_setup.add_lms_tuning_options) for compare.py, ManyModel.py and
    # this script; the spellings this script used first still parse.
    new = compile_peers.build_parser().parse_args(["--size-mb", "2", "--prefetch", "1"])
    old = compile_peers.build_parser().parse_args(["--lms-size-mb", "2", "--lms-prefetch", "1"])
    assert (new.size_mb, new.prefetch) == (old.size_mb, old.prefetch) == (2.0, 1)
    assert new.lms_limit_frac == 0.8
    with pytest.raises(SystemExit):
        compile_peers.build_parser().parse_args(["--size-mb", "-1"])
