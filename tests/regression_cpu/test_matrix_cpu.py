"""The regression matrix's models, worker logic and summary, checked on a CPU.

The GPU runs themselves are in ``tests/regression/test_families.py``. Here every family
trains at a tiny size; the GPU sizes are built on the meta device and checked against what
the matrix needs of them; the worker commands run end to end on the CPU with the CUDA calls
replaced by a stand-in (no paging happens, so only the logic is tested: stages, results
files, comparisons); and the summary table is rendered from a synthetic results file.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
import lms_families
import lms_matrix_summary
import lms_matrix_worker as worker
import torch
from lms_families import FAMILIES, family, train_step
from lms_regression_harness import (
    MiB,
    RunResult,
    first_difference,
    max_relative_difference,
)
from torch import nn

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------
# The families
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_at_tiny_size_on_cpu(name: str) -> None:
    fam = family(name, tiny=True)
    torch.manual_seed(0)
    model = fam.build()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = fam.make_optimizer(model)
    scaler = lms_families.make_scaler(fam, CPU)
    losses = []
    for step in range(2):
        losses += train_step(fam, model, optimizer, scaler, step, CPU)
    assert len(losses) == 2 * fam.accumulation
    assert all(torch.isfinite(loss).all() for loss in losses)
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert any(changed), "two optimizer steps changed no parameter"
    assert all(p.grad is None for p in model.parameters()), "gradients not cleared"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_build_and_batches_are_seeded(name: str) -> None:
    fam = family(name, tiny=True)
    torch.manual_seed(0)
    a = [p.detach().clone() for p in fam.build().parameters()]
    torch.manual_seed(0)
    b = [p.detach().clone() for p in fam.build().parameters()]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    x1, y1 = fam.make_batch(3, CPU)
    x2, y2 = fam.make_batch(3, CPU)
    x3, _ = fam.make_batch(4, CPU)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)


def test_tied_lm_shares_its_embedding() -> None:
    model = family("tied_lm", tiny=True).build()
    assert isinstance(model, lms_families.TransformerLM)
    assert model.head.weight is model.tokens.weight


def test_unet_concatenates_skips() -> None:
    model = family("unet3d", tiny=True).build()
    assert isinstance(model, lms_families.UNet3D)
    x = torch.randn(1, 1, 8, 8, 8)
    outputs: list[torch.Tensor] = []
    model.up1.register_forward_hook(lambda m, a, out: outputs.append(out))
    assert model(x).shape == x.shape
    # 2 upsampled channels and the 2 channels of the full-resolution skip.
    assert outputs[0].shape == (1, 4, 8, 8, 8)


def test_layerwise_adamw_groups_every_parameter_once() -> None:
    model = family("adamw_foreach", tiny=True).build()
    optimizer = lms_families.layerwise_adamw(model)
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(optimizer.param_groups) == len(linears) + 1  # + LayerNorms
    assert optimizer.defaults["foreach"] is True


def _meta_forward(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int]:
    """GPU-size model on the meta device: (largest module output, largest parameter,
    bytes of parameters plus the tensors autograd saves) in bytes."""
    monkeypatch.setattr(lms_families, "_generator", lambda device, seed: None)
    fam = family(name)
    meta = torch.device("meta")
    with meta:
        model = fam.build()
    found: dict[str, Any] = {"bytes": 0}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t)] = t.numel() * t.element_size()
        return t

    inputs, targets = fam.make_batch(0, meta)
    with worker.module_output_probe(model, found):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fam.loss(model(inputs), targets)
    params = [p.numel() * p.element_size() for p in model.parameters()]
    return found["bytes"], max(params), sum(params) + sum(saved.values())


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "lstm"])
def test_gpu_size_has_an_allocation_larger_than_the_headroom(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sizing the matrix relies on, without a GPU: some tensor made inside an operator
    (a module's output, or a parameter's gradient) is larger than the extension's default
    reclaim headroom, and parameters plus saved tensors are in the 2-12 GiB range.
    (cuDNN's LSTM does not run on the meta device; its reserve space is measured on the
    GPU.)"""
    largest_output, largest_param, footprint = _meta_forward(name, monkeypatch)
    assert max(largest_output, largest_param) > worker.LARGE_ALLOCATION_BYTES
    assert 2 * 1024 * MiB < footprint < 12 * 1024 * MiB


def test_lstm_gpu_size_is_a_stack_of_multilayer_lstms() -> None:
    with torch.device("meta"):
        model = family("lstm").build()
    assert isinstance(model, lms_families.StackedLSTM)
    lstms = [m for m in model.lstms if isinstance(m, nn.LSTM)]
    assert len(lstms) >= 4 and all(m.num_layers >= 2 for m in lstms)
    seq, batch, hidden = 256, 64, lstms[0].hidden_size
    # Each LSTM's output alone is 64 MiB; its reserve space holds several of those.
    assert seq * batch * hidden * 4 == 64 * MiB


# ---------------------------------------------------------------------------------------
# The deep MLP of the no-cap and shared-GPU rows
# ---------------------------------------------------------------------------------------


def test_mlp_tokens_for_inverts_the_need() -> None:
    for need in (10**9, 88 * 10**9, 211 * 10**9):
        tokens = lms_families.mlp_tokens_for(need, 1024, 16)
        assert lms_families.mlp_need_bytes(tokens, 1024, 16) <= need
        assert lms_families.mlp_need_bytes(tokens + 1, 1024, 16) > need


def test_micro_batched_mlp_step_matches_the_full_batch() -> None:
    def run(chunks: int) -> RunResult:
        torch.manual_seed(0)
        model = lms_families.DeepMLP(32, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        result = RunResult()
        for step in range(2):
            x, y = lms_families.mlp_batch(300, 32, step, CPU)
            loss, grads = worker.mlp_train_step(model, optimizer, x, y, chunks)
            result.losses.append(loss)
            result.grads = grads
        result.params = [p.detach().clone() for p in model.parameters()]
        return result

    full, parts = run(1), run(4)
    assert max_relative_difference(full, parts) < 1e-5
    assert first_difference(full, run(1)) is None


# ---------------------------------------------------------------------------------------
# Comparison helpers
# ---------------------------------------------------------------------------------------


def _run(values: list[float]) -> RunResult:
    t = torch.tensor(values)
    return RunResult(losses=[t[:1]], grads=[t.clone()], params=[t * 2])


def test_first_difference_and_relative_difference() -> None:
    a, b = _run([1.0, 2.0]), _run([1.0, 2.0])
    assert first_difference(a, b) is None
    assert max_relative_difference(a, b) == 0.0
    c = _run([1.0, 2.0 + 1e-6])
    assert first_difference(a, c) == "gradient 0 differs"
    assert 0 < max_relative_difference(a, c) < 1e-5
    d = _run([1.0, float("inf")])
    assert max_relative_difference(a, d) == float("inf")
    e = RunResult(losses=[torch.zeros(2)], grads=[], params=[])
    assert "different tensors" in (first_difference(a, e) or "")
    # Compared as bits: NaNs of the same pattern match, -0.0 is not 0.0.
    nan = _run([float("nan"), 1.0])
    assert first_difference(nan, _run([float("nan"), 1.0])) is None
    assert first_difference(_run([0.0, 1.0]), _run([-0.0, 1.0])) == "loss 0 differs"
    scalar = RunResult(losses=[torch.tensor(1.5)], grads=[], params=[])
    assert first_difference(scalar, RunResult(losses=[torch.tensor(1.5)])) is None


# ---------------------------------------------------------------------------------------
# The worker commands, end to end on the CPU with a stand-in for the CUDA calls
# ---------------------------------------------------------------------------------------


class FakeCuda:
    """Stands in for the torch.cuda calls the worker makes; counts LMS being enabled."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.enabled: list[bool] = []
        self.fail_stats = False

    def stats(self) -> dict[str, Any]:
        if self.fail_stats:
            raise torch.OutOfMemoryError("stand-in out of memory")
        counters = dict.fromkeys(
            (
                "pageout_count",
                "pageout_bytes",
                "pagein_count",
                "pagein_bytes",
                "reclaim_limit",
                "reclaim_alloc_failure",
                "reclaim_explicit",
                "prefetch_count",
                "prefetch_hits",
                "stall_ms",
                "oom_count",
            ),
            0,
        )
        counters["pageout_bytes"] = 3 * MiB
        counters["limit_bytes"] = self.total
        gauges = {
            g: {"current": 0, "peak": 0} for g in ("managed_bytes", "pagedout_bytes", "host_bytes")
        }
        return {**counters, **gauges}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        props = SimpleNamespace(name="stand-in", total_memory=self.total)
        for name, value in {
            "current_device": lambda: 0,
            "get_device_properties": lambda *a: props,
            "synchronize": lambda *a: None,
            "reset_peak_memory_stats": lambda *a: None,
            "max_memory_reserved": lambda *a: 64 * MiB,
            "memory_allocated": lambda *a: 0,
            "memory_snapshot": lambda: [],
            "set_enabled_lms": self.enabled.append,
            "reset_accumulated_lms_stats": lambda *a: None,
            "reset_peak_lms_stats": lambda *a: None,
            "lms_stats": lambda *a: self.stats(),
            "get_limit_lms": lambda *a: 0,
            "get_size_lms": lambda: MiB,
            "get_prefetch_lms": lambda: 0,
            "get_speculative_lms": lambda: 0,
            "get_enabled_lms": lambda: bool(self.enabled and self.enabled[-1]),
            "is_initialized": lambda: True,
        }.items():
            monkeypatch.setattr(cuda, name, value, raising=False)
        monkeypatch.setattr(worker, "worker_device", lambda: CPU)
        monkeypatch.setattr(worker, "rank_device", lambda rank: CPU)
        monkeypatch.setattr(worker, "ensure_lms_api", lambda: "stand-in")
        monkeypatch.setattr(worker, "settle", lambda: None)
        monkeypatch.setattr(worker, "deterministic", lambda: None)
        monkeypatch.setattr(worker, "memory_cap", lambda cap: contextlib.nullcontext())


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(total=4 * MiB)
    fake.install(monkeypatch)
    return fake


@pytest.fixture
def families_test() -> Any:
    """test_families.py's checks, applied here to the stand-in results."""
    import test_families

    return test_families


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_command_on_cpu(
    name: str, fake_cuda: FakeCuda, families_test: Any, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    assert worker.run_family(name, 0.25, out, tiny=True) == 0
    data = json.loads(out.read_text())
    data["_tail"] = ""
    families_test.check_done(data)
    assert fake_cuda.enabled == [True]
    assert data["reference_repeatable"] is True  # CPU kernels are deterministic
    assert data["bit_identical"] is True
    families_test.check_against_reference(data)
    assert data["cap_bytes"] == 16 * MiB and data["deficit_bytes"] == 48 * MiB
    assert data["pageout_bytes_per_iter"] == MiB
    assert data["largest_alloc_bytes"] > 0 and data["largest_alloc_source"]
    assert len(data["capped_seconds_per_step"]) == family(name).steps
    assert data["lms_settings"]["size_bytes"] == MiB
    for key in families_test.FAMILY_KEYS:
        if key not in ("s_per_iter", "largest_alloc_over_cap", "error_type", "lms_at_error"):
            assert key in data, key


def test_family_command_records_a_failed_capped_run(
    fake_cuda: FakeCuda, families_test: Any, tmp_path: Path
) -> None:
    fake_cuda.fail_stats = True
    out = tmp_path / "result.json"
    assert worker.run_family("cnn2d", 0.5, out, tiny=True) == 1
    data = json.loads(out.read_text())
    assert data["stage"] == "capped" and data["error_type"] == "OutOfMemoryError"
    assert data["lms_at_error"] == "unreadable: OutOfMemoryError"
    assert data["reference_repeatable"] is True  # what was measured before is kept
    data["_tail"] = ""
    with pytest.raises(pytest.fail.Exception, match="stage 'capped'"):
        families_test.check_done(data)


def test_check_against_reference_when_the_reference_does_not_repeat(families_test: Any) -> None:
    data = {
        "reference_repeatable": False,
        "reference_difference": "loss 0 differs",
        "reference_max_relative_difference": 1e-6,
        "max_relative_difference": 5e-4,
        "bit_identical": False,
        "difference": "loss 0 differs",
    }
    families_test.check_against_reference(data)
    data["max_relative_difference"] = 0.5
    with pytest.raises(AssertionError, match="further off"):
        families_test.check_against_reference(data)
    data.update(reference_repeatable=True, max_relative_difference=1e-7)
    with pytest.raises(AssertionError, match="not"):
        families_test.check_against_reference(data)


def test_nocap_command_on_cpu(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    out = tmp_path / "result.json"
    assert worker.run_nocap(1.1, 2, out) == 0
    data = json.loads(out.read_text())
    assert data["stage"] == "done", data.get("error")
    assert data["reference_chunks"] == 3  # 1.1x in pieces of at most 0.4x
    assert 1.0 < data["need_over_device"] <= 1.1
    assert data["max_relative_difference"] < 1e-5
    assert data["finite"] and len(data["losses"]) == 2
    assert fake_cuda.enabled == [True]


def test_share_command_on_cpu(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    out = tmp_path / "rank0.json"
    assert worker.run_share(0, 1, 0.6, 3, True, tmp_path / "barrier", out) == 0
    data = json.loads(out.read_text())
    assert data["stage"] == "done", data.get("error")
    assert data["finite"] and len(data["seconds_per_step"]) == 3
    assert data["pageout_bytes"] == 3 * MiB
    assert sorted(p.name for p in (tmp_path / "barrier").iterdir()) == ["start-0", "step1-0"]

    out = tmp_path / "nolms.json"
    fake_cuda.enabled.clear()
    assert worker.run_share(0, 1, 0.6, 1, False, tmp_path / "barrier2", out) == 0
    assert fake_cuda.enabled == []
    assert "pageout_bytes" not in json.loads(out.read_text())


def test_file_barrier_waits_for_all_and_counts_failures(tmp_path: Path) -> None:
    folder = tmp_path / "barrier"
    done: list[int] = []

    def party(rank: int) -> None:
        worker.FileBarrier(folder, 3, rank, timeout_s=30).wait("start")
        done.append(rank)

    threads = [threading.Thread(target=party, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    threads[0].join(0.3)
    assert done == [], "the barrier let parties through before all arrived"
    worker.FileBarrier(folder, 3, 2).fail()  # a failed party counts as arrived
    for t in threads:
        t.join(30)
    assert sorted(done) == [0, 1]
    with pytest.raises(TimeoutError, match="1 of 2"):
        worker.FileBarrier(tmp_path / "alone", 2, 0, timeout_s=0.1).wait("start")


FAKE_SHARE_WORKER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {regression!r})
from lms_matrix_worker import FileBarrier, parse_args
args = parse_args(sys.argv[1:])
if args.rank == 0:
    sys.exit(3)  # dies without marking the barrier, as a crash would
FileBarrier(args.barrier, args.processes, args.rank, timeout_s=60).wait("start")
args.out.write_text(json.dumps({{"rank": args.rank, "stage": "done"}}))
"""


def test_launch_share_marks_crashed_workers(
    families_test: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = tmp_path / "fake_worker.py"
    regression = str(Path(families_test.__file__).resolve().parent)
    script.write_text(FAKE_SHARE_WORKER.format(regression=regression))
    monkeypatch.setattr(families_test, "WORKER", script)
    monkeypatch.setattr(families_test, "SHARE_TIMEOUT_S", 60)
    results = families_test.launch_share(2, 0.6, steps=1, lms=True, folder=tmp_path / "run")
    assert [r["returncode"] for r in results] == [3, 0]
    assert results[1]["stage"] == "done" and "stage" not in results[0]
    assert (tmp_path / "run" / "barrier" / "failed-0").exists()


SLOW_WORKER = """
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
Path(sys.argv[2]).write_text(str(child.pid))
time.sleep(60)
"""


def test_run_worker_ends_a_worker_and_its_children_at_the_timeout(
    families_test: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = tmp_path / "slow_worker.py"
    script.write_text(SLOW_WORKER)
    monkeypatch.setattr(families_test, "WORKER", script)
    pid_file = tmp_path / "child.pid"
    with pytest.raises(pytest.fail.Exception, match="ran past 3 s"):
        families_test.run_worker(["slow", str(pid_file)], 3)
    child = int(pid_file.read_text())
    for _ in range(100):  # the child is killed with its group; wait until it is reaped
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the worker's child {child} still runs")

    script.write_text("import sys; print('out'); sys.exit(5)")
    proc = families_test.run_worker(["quick"], 30)
    assert (proc.returncode, proc.stdout) == (5, "out\n")


def test_ddp_rank_on_cpu_with_gloo(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "DDP_BACKEND", "gloo")
    monkeypatch.setattr(worker, "DDP_BATCH", 2)
    monkeypatch.setattr(worker, "DDP_IMAGE", 16)
    monkeypatch.setattr(
        worker,
        "ddp_model",
        lambda: (lms_families.HighResCNN(4, 1, levels=1, classes=100), "small CNN"),
    )
    worker.ddp_rank(0, 1, 0.5, 2, str(tmp_path), worker.free_port())
    data = json.loads((tmp_path / "ddp-rank0.json").read_text())
    assert data["stage"] == "done", data.get("error")
    assert data["reference_repeatable"] and data["bit_identical"]
    assert data["model"] == "small CNN"
    assert data["cap_bytes"] == 32 * MiB


def test_worker_command_line() -> None:
    args = worker.parse_args(["family", "--family", "lstm", "--cap-share", "0.25", "--out", "x"])
    assert (args.family, args.cap_share, args.tiny) == ("lstm", 0.25, False)
    share = ["share", "--rank", "1", "--processes", "4", "--fraction", "0.4", "--no-lms"]
    args = worker.parse_args([*share, "--barrier", "b", "--out", "o"])
    assert (args.rank, args.processes, args.fraction, args.lms, args.steps) == (1, 4, 0.4, False, 3)
    assert worker.parse_args(["nocap", "--factor", "1.5", "--out", "o"]).steps == 2
    assert worker.parse_args(["ddp", "--out-dir", "d"]).cap_share == 0.5


def test_per_iteration_leaves_out_the_first_step() -> None:
    assert worker.per_iteration([10.0, 1.0, 3.0]) == 2.0
    assert worker.per_iteration([4.0]) == 4.0


# ---------------------------------------------------------------------------------------
# Summary table and the GPU script
# ---------------------------------------------------------------------------------------

SYNTHETIC = {
    "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "lms_backend": "ext"},
    "tests": [
        {
            "test": "tests/regression/test_families.py::test_capped[cnn2d-half]",
            "outcome": "passed",
            "family": "cnn2d",
            "cap": "1/2",
            "s_per_iter": 0.4567,
            "reference_s_per_iter": 0.1234,
            "pageout_bytes_per_iter": 3 * 1024**3,
            "deficit_bytes": 3.5 * 1024**3,
            "largest_alloc_bytes": 288 * MiB,
            "stall_ms": 812.4,
            "bit_identical": True,
            "reference_repeatable": True,
        },
        {
            "test": "tests/regression/test_families.py::test_ddp_two_gpus",
            "outcome": "failed",
            "family": "ddp_resnet50",
            "cap": "1/2 per GPU",
            "pageout_bytes_per_iter": [1024**3, 2 * 1024**3],
            "reference_repeatable": [True, False],
        },
        {"test": "tests/regression/test_models.py::test_gpt", "outcome": "passed"},
        {"test": "tests/regression/test_families.py::test_nocap[1.5x]", "outcome": "skipped"},
    ],
}


def test_summary_renders_a_markdown_table() -> None:
    table = lms_matrix_summary.render(SYNTHETIC)
    lines = table.splitlines()
    assert lines[0].startswith("Device: NVIDIA H100 80GB HBM3")
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    assert header == list(lms_matrix_summary.COLUMNS)
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 3  # test_gpt is no matrix row
    assert rows[0] == (
        "| cnn2d | 1/2 | 0.457 | 0.123 | 3.00 GiB | 3.50 GiB | 0.28 GiB | 812 | yes | yes "
        "| passed |"
    )
    assert "| 1.00 GiB / 2.00 GiB |" in rows[1]
    assert "| n/a | yes / no | failed |" in rows[1]
    assert rows[2].startswith("| test_nocap[1.5x] |") and rows[2].endswith("| skipped |")


def test_summary_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "regression-results.json"
    results.write_text(json.dumps({"tests": []}))
    out = tmp_path / "summary.md"
    assert lms_matrix_summary.main([str(results), "--output", str(out)]) == 0
    assert "(no matrix results)" in capsys.readouterr().out
    assert "(no matrix results)" in out.read_text()

    second = tmp_path / "two-gpus.json"
    second.write_text(json.dumps(SYNTHETIC))
    assert lms_matrix_summary.main([str(results), str(second)]) == 0
    table = capsys.readouterr().out
    assert "| cnn2d | 1/2 |" in table and "(no matrix results)" not in table


def test_run_matrix_script_parses() -> None:
    script = REPO / "scripts" / "gpu" / "run-matrix.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
