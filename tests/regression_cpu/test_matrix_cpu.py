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
import signal
import subprocess
import threading
import time
from collections.abc import Collection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
import torch
from torch import nn

from lmsbench.models import GPT
from tests.regression import lms_families, lms_matrix_summary
from tests.regression import lms_matrix_plan as plan
from tests.regression import lms_matrix_worker as worker
from tests.regression.lms_families import FAMILIES, family, train_step
from tests.regression.lms_regression_harness import (
    MiB,
    RunResult,
    first_difference,
    max_relative_difference,
)

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
    assert isinstance(model, GPT) and not model.blocks[0].attn.fused
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


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("lstm", "moe")])
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


def test_moe_gpu_size_has_large_logits_and_changing_expert_loads() -> None:
    """The mixture of experts' sizing (its routing needs real values: ``nonzero`` has no
    meta kernel): the head's logits, allocated inside its Linear, are larger than the
    headroom, and the tokens each expert gets change between the first batches."""
    fam = family("moe")
    with torch.device("meta"):
        model = fam.build()
    assert isinstance(model, lms_families.MoEStack)
    tokens = 32768
    logits = tokens * model.head.out_features * 4
    assert logits > worker.LARGE_ALLOCATION_BYTES
    tiny = family("moe", tiny=True)
    torch.manual_seed(0)
    layer = tiny.build().layers[0]
    loads = []
    for index in range(3):
        x, _ = tiny.make_batch(index, torch.device("cpu"))
        with torch.no_grad():
            choice = layer.router(layer.norm(x)).argmax(dim=-1)
        loads.append(torch.bincount(choice, minlength=len(layer.experts)).tolist())
    assert loads[0] != loads[1] != loads[2]


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
    """Stands in for the torch.cuda calls the worker makes; counts LMS being enabled.

    With ``host_budget``, it has the host-memory budget's API and statistics too (an LMS
    build with it); without, those names are absent.
    """

    def __init__(self, total: int, host_budget: bool = True) -> None:
        self.total = total
        self.host_budget = host_budget
        self.enabled: list[bool] = []
        self.host_limits: list[int] = []
        self.limits: list[int] = []
        self.fail_stats = False
        self.host_refusals = 0

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
        counters["limit_bytes"] = self.limits[-1] if self.limits else self.total
        gauges = {
            g: {"current": 0, "peak": 0} for g in ("managed_bytes", "pagedout_bytes", "host_bytes")
        }
        if self.host_budget:
            counters["host_budget_bytes"] = self.host_limits[-1] if self.host_limits else 0
            counters["host_refusals"] = self.host_refusals
            gauges["host_ledger_bytes"] = {"current": MiB, "peak": 2 * MiB}
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
            "set_limit_lms": self.limits.append,
            "is_initialized": lambda: True,
        }.items():
            monkeypatch.setattr(cuda, name, value, raising=False)
        if self.host_budget:
            monkeypatch.setattr(cuda, "set_host_limit_lms", self.host_limits.append, raising=False)
            monkeypatch.setattr(
                cuda,
                "get_host_limit_lms",
                lambda: self.host_limits[-1] if self.host_limits else 0,
                raising=False,
            )
        else:
            monkeypatch.delattr(cuda, "set_host_limit_lms", raising=False)
            monkeypatch.delattr(cuda, "get_host_limit_lms", raising=False)
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
    from tests.regression import test_families

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


HOST_OOM_MESSAGE = (
    "CUDA out of memory with Large Model Support: the host memory budget of 64.00 MiB is "
    "exhausted (stand-in)"
)


def test_nocap_command_with_a_host_limit_and_no_reference(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    out = tmp_path / "result.json"
    assert worker.run_nocap(1.25, 2, out, host_limit_mb=64, reference=False) == 0
    data = json.loads(out.read_text())
    assert data["stage"] == "done", data.get("error")
    assert fake_cuda.host_limits == [64 * MiB]
    assert data["host_limit_bytes"] == 64 * MiB
    assert data["lms_settings"]["host_limit_bytes"] == 64 * MiB
    assert data["reference"] == "none" and data["reference_chunks"] is None
    assert "reference_losses" not in data and "max_relative_difference" not in data
    assert data["limit_at_start_bytes"] == 4 * MiB
    assert data["deficit_at_start_bytes"] == data["need_bytes"] - 4 * MiB
    assert data["lms"]["host_refusals"] == 0
    assert data["lms"]["host_ledger_bytes"] == {"current": MiB, "peak": 2 * MiB}
    assert plan.classify(0, data).kind == plan.FINISHED


def raise_in_training(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException, when: Any = lambda: True
) -> None:
    """Makes the worker's training step raise ``exc`` in its forward pass while ``when()``."""
    real = worker.mlp_train_step

    def step(*args: Any, **kwargs: Any) -> Any:
        if when():
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "mlp_train_step", step)


def test_nocap_command_records_a_host_out_of_memory_error(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    fake_cuda.host_refusals = 3
    raise_in_training(monkeypatch, torch.OutOfMemoryError(HOST_OOM_MESSAGE))
    out = tmp_path / "result.json"
    assert worker.run_nocap(1.25, 2, out, host_limit_mb=64, reference=False) == 1
    data = json.loads(out.read_text())
    assert (data["stage"], data["error_type"]) == ("lms", "OutOfMemoryError")
    assert data["error_message"] == HOST_OOM_MESSAGE
    assert data["lms_at_error"]["host_refusals"] == 3
    assert data["host_limit_bytes"] == 64 * MiB  # saved before training
    outcome = plan.classify(1, data)
    assert outcome.kind == plan.HOST_OOM and outcome.clean
    assert "host refusals 3" in outcome.detail


def test_nocap_command_without_a_host_budget_in_this_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeCuda(total=4 * MiB, host_budget=False)
    fake.install(monkeypatch)
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    out = tmp_path / "result.json"
    assert not worker.has_host_budget()
    assert worker.run_nocap(1.25, 1, out, host_limit_mb=64, reference=False) == 1
    data = json.loads(out.read_text())
    assert data["error_type"] == "RuntimeError"
    assert "no host-memory budget" in data["error_message"]
    assert plan.classify(1, data).kind == plan.ERROR
    # Without a host limit the same build trains, and records no host figures.
    out = tmp_path / "default.json"
    assert worker.run_nocap(1.1, 1, out, reference=False) == 0
    data = json.loads(out.read_text())
    assert data["host_limit_bytes"] is None
    assert "host_limit_bytes" not in data["lms_settings"]
    assert "host_refusals" not in data["lms"]


def test_share_command_records_the_limit_over_time_under_a_cap(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    caps: list[int] = []

    @contextlib.contextmanager
    def cap(nbytes: int) -> Any:
        caps.append(nbytes)
        yield

    monkeypatch.setattr(worker, "memory_cap", cap)
    out = tmp_path / "rank0.json"
    assert (
        worker.run_share(
            0, 1, 0.6, 2, True, tmp_path / "barrier", out, cap_share=0.25, host_limit_mb=8
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["stage"] == "done", data.get("error")
    assert caps == [MiB] and data["cap_bytes"] == MiB
    assert fake_cuda.host_limits == [8 * MiB] and data["host_limit_bytes"] == 8 * MiB
    samples = data["lms_limit_samples"]
    assert [x["at"] for x in samples] == [
        "start",
        "step 0 forward",
        "step 0 end",
        "step 0 after the wait",
        "step 1 forward",
        "step 1 end",
    ]
    assert all(x["limit_bytes"] == 4 * MiB and x["host_ledger_bytes"] == MiB for x in samples)
    assert [x["t_s"] for x in samples] == sorted(x["t_s"] for x in samples)


def run_share_threads(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    waves: list[int],
    fail_ranks: Collection[int] = (),
) -> tuple[list[dict[str, Any]], list[str]]:
    """Runs ``run_share`` for each rank in a thread of its own (wave ``waves[rank]``); the
    ranks in ``fail_ranks`` raise a host out-of-memory error in their first forward pass.

    Returns the results and the order of events: ``f<rank>`` when a rank starts its first
    forward pass, ``p<rank>`` when it reached the end of it."""
    events: list[str] = []
    started: set[int] = set()
    lock = threading.Lock()
    real = worker.mlp_train_step

    def step(*args: Any) -> Any:
        *inputs, after = args
        rank = int(threading.current_thread().name)
        if rank in started:
            return real(*inputs, after)
        with lock:
            started.add(rank)
            events.append(f"f{rank}")
        time.sleep(0.05)  # a forward pass that takes a while
        if rank in fail_ranks:
            raise torch.OutOfMemoryError(HOST_OOM_MESSAGE)

        def after_forward() -> None:
            with lock:
                events.append(f"p{rank}")
            after()

        return real(*inputs, after_forward)

    monkeypatch.setattr(worker, "mlp_train_step", step)
    codes: dict[int, int] = {}

    def party(rank: int) -> None:
        codes[rank] = worker.run_share(
            rank,
            len(waves),
            0.3,
            2,
            True,
            tmp_path / "barrier",
            tmp_path / f"rank{rank}.json",
            wave=waves[rank],
            waves=max(waves) + 1,
        )

    threads = [threading.Thread(target=party, args=(r,), name=str(r)) for r in range(len(waves))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    results = []
    for rank in range(len(waves)):
        data = json.loads((tmp_path / f"rank{rank}.json").read_text())
        data["returncode"] = codes.get(rank)
        results.append(data)
    return results, events


def test_share_waves_reach_the_end_of_the_forward_pass_in_order(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    results, events = run_share_threads(monkeypatch, tmp_path, [0, 1, 1])
    assert [r["returncode"] for r in results] == [0, 0, 0], [r.get("error") for r in results]
    # Wave 1 starts its forward pass only once wave 0 is at the end of its own.
    assert events.index("p0") < events.index("f1") and events.index("p0") < events.index("f2")
    names = sorted(p.name for p in (tmp_path / "barrier").iterdir())
    assert names == sorted(
        f"{s}-{r}" for s in ("start", "wave0", "wave1", "step1") for r in range(3)
    )
    assert "step 0 after the waves" in [x["at"] for x in results[0]["lms_limit_samples"]]


def test_share_waves_go_on_when_a_later_wave_fails(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(worker, "MLP_WIDTH", 16)
    monkeypatch.setattr(worker, "MLP_LAYERS", 2)
    fake_cuda.host_refusals = 1
    results, _ = run_share_threads(monkeypatch, tmp_path, [0, 1, 1], fail_ranks={1, 2})
    outcomes = [plan.classify(r["returncode"], r) for r in results]
    assert [o.kind for o in outcomes] == [plan.FINISHED, plan.HOST_OOM, plan.HOST_OOM]
    assert results[1]["error_message"] == HOST_OOM_MESSAGE
    assert (tmp_path / "barrier" / "failed-1").exists()


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
from tests.regression.lms_matrix_worker import FileBarrier, parse_args
args = parse_args(sys.argv[1:])
if args.rank == 0:
    sys.exit(3)  # dies without marking the barrier, as a crash would
FileBarrier(args.barrier, args.processes, args.rank, timeout_s=60).wait("start")
args.out.write_text(json.dumps({"rank": args.rank, "stage": "done"}))
"""


def test_launch_share_marks_crashed_workers(
    families_test: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_SHARE_WORKER)
    monkeypatch.setattr(families_test, "WORKER", script)
    monkeypatch.setattr(families_test, "SHARE_TIMEOUT_S", 60)
    results = families_test.launch_share(2, 0.6, steps=1, lms=True, folder=tmp_path / "run")
    assert [r["returncode"] for r in results] == [3, 0]
    assert results[1]["stage"] == "done" and "stage" not in results[0]
    assert (tmp_path / "run" / "barrier" / "failed-0").exists()
    assert plan.classify(3, results[0]).kind == plan.ERROR


SIGNAL_SHARE_WORKER = """
import json, os, signal, sys
from tests.regression.lms_matrix_worker import parse_args
args = parse_args(sys.argv[1:])
args.out.write_text(json.dumps({
    "rank": args.rank, "stage": "training", "wave": args.wave, "waves": args.waves,
    "cap_share": args.cap_share, "conf": os.environ.get("PYTORCH_LMS_CONF"),
}))
if args.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
"""


def test_launch_share_passes_arguments_and_reports_a_signal(
    families_test: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = tmp_path / "signal_worker.py"
    script.write_text(SIGNAL_SHARE_WORKER)
    monkeypatch.setattr(families_test, "WORKER", script)
    monkeypatch.setattr(families_test, "SHARE_TIMEOUT_S", 60)
    env = plan.host_limit_env("extension", 512, families_test.worker_env())
    results = families_test.launch_share(
        2,
        0.5,
        steps=1,
        lms=True,
        folder=tmp_path / "run",
        extra_args=lambda rank: ["--cap-share", "0.2", "--waves", "2", "--wave", str(rank)],
        env=env,
    )
    assert [r["returncode"] for r in results] == [0, -signal.SIGKILL]
    assert [(r["wave"], r["waves"], r["cap_share"]) for r in results] == [(0, 2, 0.2), (1, 2, 0.2)]
    assert results[0]["conf"].endswith("lms_host_limit_mb:512")
    outcome = plan.classify(results[1]["returncode"], results[1])
    assert (outcome.kind, outcome.label, outcome.clean) == (
        plan.SIGNALLED,
        "killed by SIGKILL",
        False,
    )
    with pytest.raises(AssertionError, match="process 1 was killed by SIGKILL"):
        families_test.check_no_signals([plan.classify(0, {}), outcome], results)


# A stand-in for the worker in the rows beyond the device: what each run does comes from
# FAKE_PLAN (JSON): "finished", "host_oom", "device_oom" or "sigkill", by the nocap run
# ("limited" with a host limit, else "control") or by the share process ("lms/<rank>",
# "nolms/<rank>").
FAKE_ROW_WORKER = """
import json, os, signal, sys
from pathlib import Path
MiB = 1 << 20
command, argv = sys.argv[1], sys.argv[2:]
flags = {a for a in argv if a in ("--no-lms", "--no-reference")}
rest = [a for a in argv if a not in flags]
opts = dict(zip(rest[::2], rest[1::2]))  # without torch: quick to start
spec = json.loads(os.environ["FAKE_PLAN"])
conf = os.environ.get("PYTORCH_LMS_CONF", "")
settings = dict(kv.split(":", 1) for kv in conf.split(",") if ":" in kv)
env_limit = int(settings.get("lms_host_limit_mb", 0)) * MiB
host_limit = int(opts.get("--host-limit-mb", 0)) * MiB
if command == "nocap":
    what = spec["limited" if host_limit else "control"]
    data = {
        "need_bytes": spec["need"], "deficit_at_start_bytes": spec["deficit"],
        "host_limit_bytes": host_limit, "reference_run": "--no-reference" not in flags,
        "live_after_forward_bytes": spec["device"] + 1, "max_relative_difference": 0.0,
        "losses": [1.0], "reference_losses": [1.0], "finite": True,
    }
else:
    lms = "--no-lms" not in flags
    what = spec[("lms/" if lms else "nolms/") + opts["--rank"]]
    if "lms_spill_dir" in settings:  # the run with the disk tier
        what = spec.get("spill/" + opts["--rank"], what)
    data = {
        "rank": int(opts["--rank"]), "need_bytes": spec["need"], "host_limit_bytes": env_limit,
        "finite": True, "losses": [1.0], "pageout_bytes": 1 if lms else None,
        "wave": int(opts.get("--wave", 0)),
        "cap_bytes": int(float(opts.get("--cap-share", 0)) * spec["device"]) or None,
        "lms_limit_samples": [{"at": "start", "limit_bytes": 7}],
    }
out = Path(opts["--out"])
data["stage"] = "training"
out.write_text(json.dumps(data))
if what == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if what in ("finished", "finished_on_disk"):
    data.update(stage="done", lms={"pageout_bytes": 1, "host_refusals": 0})
    if what == "finished_on_disk":
        data["lms"].update(
            spill_count=2, spill_out_bytes=8 * MiB, spill_out_ms=4.0,
            spill_in_bytes=8 * MiB, spill_in_ms=2.0,
        )
    code = 0
else:
    host = what == "host_oom"
    data.update(
        error_type="OutOfMemoryError",
        error="Traceback ...",
        error_message="out of host memory: the LMS host budget is spent" if host
        else "CUDA out of memory. Tried to allocate 1.00 GiB",
        lms_at_error={"host_refusals": 2 if host else 0},
    )
    code = 1
out.write_text(json.dumps(data))
sys.exit(code)
"""

H100_BYTES = 85_017_493_504


@pytest.fixture
def fake_rows(families_test: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Runs the rows of test_families.py beyond the device against FAKE_ROW_WORKER on an
    80 GB stand-in device with a host budget API and a 125 GiB host; returns
    ``run(test, plan, **kwargs)``, which gives what the row recorded."""
    script = tmp_path / "fake_row_worker.py"
    script.write_text(FAKE_ROW_WORKER)
    monkeypatch.setattr(families_test, "WORKER", script)
    monkeypatch.setattr(families_test, "SHARE_TIMEOUT_S", 60)
    props = SimpleNamespace(name="stand-in", total_memory=H100_BYTES)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.cuda, "set_host_limit_lms", lambda n: None, raising=False)
    monkeypatch.setattr(plan, "usable_host_memory", lambda: 125 * plan.GiB)
    monkeypatch.setattr(families_test, "ensure_lms_api", lambda: "extension")
    monkeypatch.delenv("PYTORCH_LMS_CONF", raising=False)
    count = iter(range(100))

    def run(test: Any, spec: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        need = families_test.mlp_need_bytes(
            families_test.mlp_tokens_for(
                int(spec.pop("fraction") * H100_BYTES), worker.MLP_WIDTH, worker.MLP_LAYERS
            ),
            worker.MLP_WIDTH,
            worker.MLP_LAYERS,
        )
        spec.update(need=need, device=H100_BYTES)
        spec.setdefault("deficit", int(0.3 * H100_BYTES))
        monkeypatch.setenv("FAKE_PLAN", json.dumps(spec))
        recorded: dict[str, Any] = {}
        folder = tmp_path / f"run{next(count)}"
        folder.mkdir()
        test(record=recorded.__setitem__, tmp_path=folder, **kwargs)
        return recorded

    return run


def test_host_budget_too_low_row_logic(families_test: Any, fake_rows: Any) -> None:
    test = families_test.test_host_budget_too_low
    recorded = fake_rows(test, {"fraction": 1.25, "limited": "host_oom", "control": "finished"})
    assert recorded["worker_outcomes"] == ["host OOM"] and recorded["exit_code"] == 1
    assert recorded["control_outcome"] == "finished" and recorded["host_refusals"] == 2
    limit = recorded["host_limit_bytes"]
    assert limit % MiB == 0 and 12 * plan.GiB < limit < 14 * plan.GiB
    with pytest.raises(AssertionError, match=r"did not end with a torch\.OutOfMemoryError"):
        fake_rows(test, {"fraction": 1.25, "limited": "device_oom", "control": "finished"})
    with pytest.raises(AssertionError, match="killed by SIGKILL"):
        fake_rows(test, {"fraction": 1.25, "limited": "sigkill", "control": "finished"})
    with pytest.raises(AssertionError, match="the row proves nothing"):
        fake_rows(
            test, {"fraction": 1.25, "limited": "host_oom", "control": "finished", "deficit": 1}
        )
    with pytest.raises(pytest.fail.Exception, match=r"did not finish \(host OOM\)"):
        fake_rows(test, {"fraction": 1.25, "limited": "host_oom", "control": "host_oom"})


def test_host_budget_rows_skip_without_the_api(
    families_test: Any, fake_rows: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch.cuda, "set_host_limit_lms")
    for test in (families_test.test_host_budget_too_low, families_test.test_share_host_budget):
        with pytest.raises(pytest.skip.Exception, match="no host-memory budget"):
            fake_rows(test, {"fraction": 0.5})


def test_rows_skip_on_a_small_host(
    families_test: Any, fake_rows: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan, "usable_host_memory", lambda: 64 * plan.GiB)
    with pytest.raises(pytest.skip.Exception, match=r"less than the no-cap row at 2\.0x"):
        fake_rows(families_test.test_nocap, {"fraction": 2.0}, factor=2.0)
    with pytest.raises(pytest.skip.Exception, match="4 processes at 50%"):
        fake_rows(families_test.test_share_one_gpu, {"fraction": 0.5}, processes=4, fraction=0.5)


def test_nocap_row_logic(families_test: Any, fake_rows: Any) -> None:
    recorded = fake_rows(
        families_test.test_nocap, {"fraction": 2.0, "control": "finished"}, factor=2.0
    )
    assert recorded["worker_outcomes"] == ["finished"]
    assert recorded["host_need_bytes"] == plan.nocap_host_need(2.0, H100_BYTES).total_bytes
    with pytest.raises(
        pytest.fail.Exception, match=r"did not finish \(host OOM\): torch\.OutOfMemoryError"
    ):
        fake_rows(families_test.test_nocap, {"fraction": 2.0, "control": "host_oom"}, factor=2.0)


def share_spec(fraction: float, lms: list[str], nolms: list[str]) -> dict[str, Any]:
    spec: dict[str, Any] = {"fraction": fraction}
    spec.update({f"lms/{r}": what for r, what in enumerate(lms)})
    spec.update({f"nolms/{r}": what for r, what in enumerate(nolms)})
    return spec


def test_share_one_gpu_row_logic(families_test: Any, fake_rows: Any) -> None:
    test = families_test.test_share_one_gpu
    ok = share_spec(0.5, ["finished"] * 4, ["device_oom"] + ["finished"] * 3)
    recorded = fake_rows(test, ok, processes=4, fraction=0.5)
    assert recorded["worker_outcomes"] == ["finished"] * 4
    assert recorded["without_lms_outcomes"][0] == "device OOM"
    assert recorded["limit_bytes_at_end"] == [7] * 4
    assert recorded["host_limit_bytes"] == 0  # one value: the same for all
    killed = share_spec(0.5, ["finished", "sigkill", "finished", "sigkill"], ["device_oom"] * 4)
    with pytest.raises(AssertionError) as failure:
        fake_rows(test, killed, processes=4, fraction=0.5)
    assert "process 1 was killed by SIGKILL" in str(failure.value)
    assert "process 3 was killed by SIGKILL" in str(failure.value)
    refused = share_spec(0.6, ["finished", "host_oom"], ["device_oom"] * 2)
    with pytest.raises(AssertionError, match=r"process 1 \(exit 1\): torch\.OutOfMemoryError"):
        fake_rows(test, refused, processes=2, fraction=0.6)
    no_control_oom = share_spec(0.6, ["finished"] * 2, ["finished"] * 2)
    with pytest.raises(AssertionError, match="without LMS every process finished"):
        fake_rows(test, no_control_oom, processes=2, fraction=0.6)


def test_share_host_budget_row_logic(families_test: Any, fake_rows: Any) -> None:
    test = families_test.test_share_host_budget
    expected = ["finished", "host_oom", "host_oom", "host_oom"]
    recorded = fake_rows(test, share_spec(0.5, expected, []))
    assert recorded["worker_outcomes"] == ["finished", "host OOM", "host OOM", "host OOM"]
    assert recorded["host_refusals"] == [0, 2, 2, 2]
    budget = recorded["host_limit_bytes"]  # from the environment, the same for all
    assert round(budget / plan.GiB, 1) == 35.6
    assert recorded["cap_bytes"] == [int(0.2 * H100_BYTES)] * 4
    assert recorded["wave"] == [0, 1, 1, 1]  # the first process, then the other three
    for outcomes in (["finished"] * 4, ["host_oom"] * 4):
        with pytest.raises(AssertionError, match="the row proves nothing unless"):
            fake_rows(test, share_spec(0.5, outcomes, []))
    with pytest.raises(AssertionError, match="neither finished nor hit the host budget"):
        fake_rows(test, share_spec(0.5, ["finished", "device_oom", "host_oom", "host_oom"], []))
    with pytest.raises(AssertionError, match="process 2 was killed by SIGKILL"):
        fake_rows(test, share_spec(0.5, ["finished", "host_oom", "sigkill", "host_oom"], []))


def test_share_disk_tier_row_logic(
    families_test: Any, fake_rows: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    test = families_test.test_share_disk_tier
    monkeypatch.setattr(torch.cuda, "set_spill_dir_lms", lambda path: None, raising=False)

    def spec(disk: list[str], host: list[str]) -> dict[str, Any]:
        out = share_spec(0.08, host, [])
        out.update({f"spill/{r}": what for r, what in enumerate(disk)})
        return out

    on_disk = ["finished", "finished_on_disk", "finished_on_disk", "finished_on_disk"]
    without = ["finished", "host_oom", "host_oom", "host_oom"]
    recorded = fake_rows(test, spec(on_disk, without))
    assert recorded["worker_outcomes"] == ["finished"] * 4
    assert recorded["spill_count"] == [None, 2, 2, 2]
    assert recorded["without_disk_tier_outcomes"] == ["finished"] + ["host OOM"] * 3
    assert recorded["without_disk_tier_host_refusals"] == [0, 2, 2, 2]
    assert recorded["spill_files_left"] == []
    assert recorded["cap_bytes"] == [int(0.04 * H100_BYTES)] * 4
    assert recorded["beyond_device_and_host_bytes"] > 0
    with pytest.raises(AssertionError, match="process 2 did not finish with the disk tier"):
        fake_rows(test, spec(["finished", "finished_on_disk", "host_oom", "finished"], without))
    with pytest.raises(AssertionError, match="no process paged to disk"):
        fake_rows(test, spec(["finished"] * 4, without))
    with pytest.raises(AssertionError, match="without the disk tier every process finished"):
        fake_rows(test, spec(on_disk, ["finished"] * 4))
    with pytest.raises(AssertionError, match="process 3 was killed by SIGKILL"):
        fake_rows(test, spec(on_disk, ["finished", "host_oom", "host_oom", "sigkill"]))
    monkeypatch.delattr(torch.cuda, "set_spill_dir_lms")
    with pytest.raises(pytest.skip.Exception, match="no disk tier"):
        fake_rows(test, spec(on_disk, without))


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
    assert (args.cap_share, args.host_limit_mb, args.wave, args.waves) == (0.0, 0, 0, 1)
    args = worker.parse_args(["nocap", "--factor", "1.5", "--out", "o"])
    assert (args.steps, args.host_limit_mb, args.reference) == (2, 0, True)
    args = worker.parse_args(
        ["nocap", "--factor", "1.25", "--host-limit-mb", "13184", "--no-reference", "--out", "o"]
    )
    assert (args.factor, args.host_limit_mb, args.reference) == (1.25, 13184, False)
    budget = ["--cap-share", "0.2", "--host-limit-mb", "36470", "--waves", "2", "--wave", "1"]
    args = worker.parse_args([*share, *budget, "--barrier", "b", "--out", "o"])
    assert (args.cap_share, args.host_limit_mb, args.wave, args.waves) == (0.2, 36470, 1, 2)
    assert worker.parse_args(["ddp", "--out-dir", "d"]).cap_share == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        ["--wave", "2", "--waves", "2"],
        ["--waves", "0"],
        ["--wave", "-1"],
        ["--host-limit-mb", "-5"],
        ["--cap-share", "1.5"],
    ],
)
def test_worker_command_line_refuses(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    share = ["share", "--rank", "0", "--processes", "2", "--fraction", "0.5"]
    with pytest.raises(SystemExit):
        worker.parse_args([*share, *bad, "--barrier", "b", "--out", "o"])
    assert "error" in capsys.readouterr().err


def test_worker_main_passes_the_options_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(worker, "run_nocap", lambda *a: calls.append(("nocap", *a)) or 0)
    monkeypatch.setattr(worker, "run_share", lambda *a, **k: calls.append(("share", *a, k)) or 0)
    assert worker.main(["nocap", "--factor", "2", "--host-limit-mb", "7", "--out", "o"]) == 0
    assert calls[-1] == ("nocap", 2.0, 2, Path("o"), 7, True)
    share = ["share", "--rank", "3", "--processes", "4", "--fraction", "0.5", "--waves", "2"]
    assert worker.main([*share, "--wave", "1", "--barrier", "b", "--out", "o"]) == 0
    assert calls[-1] == (
        "share",
        3,
        4,
        0.5,
        3,
        True,
        Path("b"),
        Path("o"),
        {"cap_share": 0.0, "host_limit_mb": 0, "wave": 1, "waves": 2},
    )


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
        {"test": "tests/regression/test_families.py::test_nocap[2x]", "outcome": "skipped"},
        {
            "test": "tests/regression/test_families.py::test_share_host_budget",
            "outcome": "passed",
            "family": "deep_mlp",
            "cap": "20% of the device each",
            "host_limit_bytes": 36 * 1024**3,
            "worker_outcomes": ["finished", "host OOM", "host OOM", "host OOM"],
        },
        {
            "test": "tests/regression/test_families.py::test_nocap[1.25x]",
            "outcome": "failed",
            "family": "deep_mlp",
            "host_limit_bytes": 0,
            "worker_outcomes": ["killed by SIGKILL"],
        },
    ],
}


def test_summary_renders_a_markdown_table() -> None:
    table = lms_matrix_summary.render(SYNTHETIC)
    lines = table.splitlines()
    assert lines[0].startswith("Device: NVIDIA H100 80GB HBM3")
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    assert header == list(lms_matrix_summary.COLUMNS)
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 5  # test_gpt is no matrix row
    assert rows[0] == (
        "| cnn2d | 1/2 | 0.457 | 0.123 | 3.00 GiB | 3.50 GiB | 0.28 GiB | 812 | yes | yes "
        "|  |  | passed |"
    )
    assert "| 1.00 GiB / 2.00 GiB |" in rows[1]
    assert "| n/a | yes / no |  |  | failed |" in rows[1]
    assert rows[2].startswith("| test_nocap[2x] |") and rows[2].endswith("| skipped |")
    assert rows[3].endswith("| 36.00 GiB | finished / host OOM / host OOM / host OOM | passed |")
    assert rows[4].endswith("| default | killed by SIGKILL | failed |")


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


def test_summary_names_each_documents_engine() -> None:
    recorded = {
        **SYNTHETIC,
        "environment": {
            **SYNTHETIC["environment"],
            "cuda": "13.0",
            "driver": "580.1",
            "engine_commit": "59e7f86" + "0" * 33,
            "engine_dirty": False,
        },
    }
    first, _, second, *_ = lms_matrix_summary.render(recorded, SYNTHETIC).splitlines()
    assert "CUDA 13.0, driver 580.1," in first and "engine 59e7f8600000," in first
    assert "engine not recorded" in second
    dirty = {**recorded, "environment": {**recorded["environment"], "engine_dirty": True}}
    assert "(tree with changes)" in lms_matrix_summary.render(dirty).splitlines()[0]


def test_results_files_record_provenance_on_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """regression-results.json/.csv: every row names the engine commit, dirty flag, engine
    sources hash, torch, CUDA, driver and device it ran with."""
    import csv

    from tests.regression import lms_results

    monkeypatch.setenv("LMS_ENGINE_COMMIT", "abc1234")
    monkeypatch.setenv("LMS_ENGINE_DIRTY", "0")
    env = lms_results.session_environment("stand-in")
    assert env["engine_commit"] == "abc1234" and env["engine_dirty"] is False
    assert len(env["engine_sources_sha256"]) == 64 and env["torch"] == torch.__version__
    rows = [
        {"test": "t::a", "outcome": "passed", "seconds": 1.5, "device": "NVIDIA H200"},
        {"test": "t::b", "outcome": "skipped", "seconds": 0.0, "lms": {"pageout_count": 2}},
    ]
    lms_results.write_results(tmp_path, env, rows)
    written = json.loads((tmp_path / "regression-results.json").read_text())
    assert written["environment"]["engine_commit"] == "abc1234"
    for row in written["tests"]:
        assert set(lms_results.ROW_PROVENANCE) <= set(row), row
        assert row["engine_commit"] == "abc1234" and row["engine_dirty"] is False
    a, b = written["tests"]
    assert a["device"] == "NVIDIA H200"  # the row's own device wins
    assert b["device"] == env.get("device", "unknown")
    with (tmp_path / "regression-results.csv").open(newline="") as f:
        header, *lines = list(csv.reader(f))
    assert len(header) == len(set(header)), "a column twice"
    assert len(lines) == 2
    first = dict(zip(header, lines[0]))
    assert first["engine_commit"] == "abc1234" and first["engine_dirty"] == "false"
    assert first["device"] == "NVIDIA H200" and first["seconds"] == "1.5"
    assert json.loads(dict(zip(header, lines[1]))["lms"]) == {"pageout_count": 2}


def test_run_matrix_script_parses() -> None:
    script = REPO / "scripts" / "gpu" / "run-matrix.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
