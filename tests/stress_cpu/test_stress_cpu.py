"""CPU tests of the LMS stress suite in ``tests/regression/stress`` (no GPU needed).

They live outside ``tests/regression``, whose conftest marks every test there as a GPU test
and skips it without a GPU. Covered: the generator (deterministic per seed, every family,
optimizer and autocast mode within 200 seeds); the allocator's rounding and settings; every
classification and gate rule on synthetic results (the bound as mapped against the cap,
whether the cap binds, parameters, buffers and losses compared, nothing LMS says deciding a
class); the worker trained end to end on the CPU (the bound in tensor and mapped bytes, the
allocator setting it ran with); the runner's handling of workers that crash (killed by a
signal), hang, fail or differ, through both launchers; records kept per attempt, merged,
and carrying their provenance.

The fork server's children run with one OpenMP thread (``OMP_NUM_THREADS=1``): a CPU build
of PyTorch that starts its OpenMP pool at import leaves the server with a second thread,
and the launcher would start a new interpreter per run instead of forking.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.regression.stress import allocator, generator, runner
from tests.regression.stress.generator import AMP_MODES, FAMILIES, OPTIMIZERS, Case, generate
from tests.regression.stress.runner import Outcome, classify, run_status

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------------------- generator


def test_generate_is_deterministic_per_seed() -> None:
    first = [generate(seed) for seed in range(60)]
    again = [generate(seed) for seed in range(60)]
    assert first == again
    assert len({dataclasses.replace(c, seed=0) for c in first}) > 50, "seeds give the same case"


def test_generate_is_the_same_in_a_new_interpreter() -> None:
    code = (
        "import json; from tests.regression.stress.generator import generate; "
        "print(json.dumps([generate(s).to_dict() for s in (0, 7, 123)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [generate(s).to_dict() for s in (0, 7, 123)]


def test_200_seeds_cover_every_family_optimizer_and_amp_mode() -> None:
    cases = [generate(seed) for seed in range(200)]
    assert {c.family for c in cases} == set(FAMILIES)
    assert {c.optimizer for c in cases} == set(OPTIMIZERS)
    assert {c.amp for c in cases} == set(AMP_MODES)
    pairs = {(c.family, c.optimizer) for c in cases}
    assert len(pairs) >= 0.9 * len(FAMILIES) * len(OPTIMIZERS)


def test_cases_are_within_the_ranges() -> None:
    for seed in range(200):
        case = generate(seed)
        assert generator.CAP_MIN <= case.cap_fraction <= generator.CAP_MAX
        assert case.iterations == generator.ITERATIONS
        assert 1 <= case.batch <= generator.MAX_BATCH
        assert case.width > 0 and case.depth > 0 and case.resolution > 0
        if case.family == "transformer":
            assert case.width % case.heads == 0
        peak = generator.estimate_peak_bytes(case)
        assert 0.5 * GiB <= peak <= 6 * GiB, (seed, case.label(), peak / GiB)


def test_most_cases_keep_the_estimated_bound_below_the_cap() -> None:
    within = 0
    for seed in range(200):
        case = generate(seed)
        peak = generator.estimate_peak_bytes(case)
        within += generator.estimate_bound_bytes(case) <= 0.7 * case.cap_fraction * peak
    assert within >= 180


def test_case_round_trips_and_rejects_bad_input() -> None:
    case = generate(5)
    assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case
    assert case.family in case.label()
    with pytest.raises(ValueError):
        generate(-1)
    with pytest.raises(TypeError):
        Case.from_dict({**case.to_dict(), "unknown": 1})


# ---------------------------------------------------------------------------- allocator


def test_mapped_bytes_rounds_each_tensor_as_the_allocator_maps_it() -> None:
    mapped = allocator.mapped_bytes
    for expandable in (False, True):
        assert mapped(0, expandable) == 0
        assert mapped(1, expandable) == 512
        assert mapped(512, expandable) == 512
        assert mapped(513, expandable) == 1024
        assert mapped(MiB, expandable) == MiB  # still the small pool
    assert mapped(MiB + 1, False) == 2 * MiB
    assert mapped(3 * MiB, False) == 4 * MiB
    assert mapped(21 * MiB, False) == 22 * MiB
    assert mapped(MiB + 1, True) == 20 * MiB
    assert mapped(21 * MiB, True) == 40 * MiB
    assert allocator.block_bytes(1000) == 1024


def test_allocator_settings_are_read_and_rewritten() -> None:
    conf = "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2],expandable_segments:True"
    assert allocator.conf_entries(conf)[1] == "roundup_power2_divisions:[256:1,512:2]"
    assert allocator.expandable_in_conf(conf) is True
    assert allocator.expandable_in_conf("expandable_segments:True,expandable_segments:False") is (
        False
    )
    assert allocator.expandable_in_conf("max_split_size_mb:128") is None
    assert allocator.expandable_in_conf("expandable_segments:yes") is None
    rewritten = allocator.conf_with_expandable(conf, False)
    assert rewritten == (
        "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2],expandable_segments:False"
    )
    assert allocator.conf_with_expandable("", True) == "expandable_segments:True"
    both = {"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "b:2"}
    assert allocator.user_conf(both) == "a:1"
    assert allocator.user_conf({"PYTORCH_ALLOC_CONF": "b:2"}) == "b:2"


def test_the_capped_runs_allocator_setting_is_resolved_for_every_run() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert runner.resolve_expandable_segments(env)[0] is False
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}
    assert runner.resolve_expandable_segments(env)[0] is True
    # Not chosen by the user: on, as LMS sets it when enabled.
    chosen, why = runner.resolve_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "a:1"})
    assert chosen is True and "as LMS sets it" in why


# ---------------------------------------------------------------------- classification


def ok(
    param_hash: str = "a" * 64,
    losses: tuple[float, ...] = (2.0, 1.5, 1.0),
    bound: int | None = None,
    pageouts: int = 0,
    peak: int = 4 * GiB,
    buffer_hash: str = "f" * 64,
    mapped: int | None = None,
    expandable: bool = True,
    library: int = 0,
) -> Outcome:
    """A run that trained; ``bound`` (and ``mapped``, default: the same) make it a reference
    that measured the bound with ``expandable`` segments."""
    result: dict[str, Any] = {
        "status": "ok",
        "param_hash": param_hash,
        "buffer_hash": buffer_hash,
        "losses": list(losses),
        "peak_reserved_bytes": peak,
        "s_per_iter": 0.1,
        "allocator": {"expandable_segments": expandable, "source": "segments"},
    }
    if bound is not None:
        result["bound"] = {
            "bytes": bound,
            "op": "aten.convolution_backward.default",
            "mapped_bytes": bound if mapped is None else mapped,
            "mapped_op": "aten.convolution_backward.default",
            "expandable_segments": expandable,
            "library_bytes": library,
            "library_mapped_bytes": library,
        }
    if pageouts:
        result["lms"] = {"pageout_count": pageouts, "pageout_bytes": pageouts << 20}
    return Outcome(0, False, 1.0, result, "")


def failed(
    exc_type: str,
    message: str,
    is_oom: bool = False,
    cuda: bool = False,
    expandable: bool | None = True,
) -> Outcome:
    result: dict[str, Any] = {
        "status": "exception",
        "losses": [],
        "exception": {
            "type": exc_type,
            "message": message,
            "is_oom": is_oom,
            "is_cuda_error": cuda,
        },
    }
    if expandable is not None:
        result["allocator"] = {"expandable_segments": expandable, "source": "segments"}
    return Outcome(3 if is_oom else 4, False, 1.0, result, "Traceback ...")


def oom(message: str = "CUDA out of memory. Tried to allocate 512.00 MiB", **kw: Any) -> Outcome:
    return failed("torch.OutOfMemoryError", message, is_oom=True, **kw)


CAP = 2 * GiB
BINDS = oom()  # the capped run without LMS runs out of memory: the cap binds


def test_identical_when_the_cap_binds_and_everything_equals_the_references() -> None:
    got = classify(ok(bound=GiB), ok(), ok(pageouts=10), BINDS, CAP)
    assert got["class"] == "identical", got
    assert got["cap_binds"] is True and got["paged_out"] is True
    assert "parameters, buffers and losses" in got["reason"]


def test_a_cap_that_does_not_bind_is_reported_not_counted() -> None:
    trains = classify(ok(bound=GiB), ok(), ok(pageouts=10), ok(), CAP)
    assert trains["class"] == "cap-not-binding"
    assert "the same cap without LMS trains" in trains["reason"]
    unpaged = classify(ok(bound=GiB), ok(), ok(), BINDS, CAP)
    assert unpaged["class"] == "cap-not-binding"
    assert "LMS paged nothing out" in unpaged["reason"]
    crashed = Outcome(-11, False, 1.0, None, "")
    other = classify(ok(bound=GiB), ok(), ok(pageouts=3), crashed, CAP)
    assert other["class"] == "cap-not-binding" and "SIGSEGV" in other["reason"]
    records = [{"seed": 0, "class": "cap-not-binding"}, {"seed": 1, "class": "identical"}]
    assert runner.counted(records) == records[1:]
    assert runner.gate_verdict(records) == (True, "")
    # Nothing but cases where the cap does not bind: the suite tested nothing.
    assert runner.gate_verdict(records[:1]) == (False, "no case where the cap binds")


def test_a_cap_that_does_not_bind_never_hides_a_failure() -> None:
    differs = ok("b" * 64)
    assert classify(ok(bound=GiB), ok(), differs, ok(), CAP)["class"] == "mismatch"
    assert classify(ok(bound=GiB), ok(), differs, BINDS, CAP)["class"] == "mismatch"
    segv = Outcome(-11, False, 2.0, None, "")
    assert classify(ok(bound=GiB), ok(), segv, ok(), CAP)["class"] == "crash"
    error = failed("builtins.ValueError", "bad")
    assert classify(ok(bound=GiB), ok(), error, ok(), CAP)["class"] == "error"


@pytest.mark.parametrize(
    ("capped", "which"),
    [
        (ok("b" * 64, pageouts=1), "parameters"),
        (ok(buffer_hash="e" * 64, pageouts=1), "buffers"),
        (ok(losses=(2.0, 1.5, 1.0000001), pageouts=1), "losses"),
    ],
)
def test_parameters_buffers_and_losses_must_all_equal(capped: Outcome, which: str) -> None:
    got = classify(ok(bound=GiB), ok(), capped, BINDS, CAP)
    assert got["class"] == "mismatch", got
    assert got["differences"] == [which]
    assert got["reason"].startswith(f"{which} differ from the repeatable references")
    assert runner.gate_failures([got]) == [got]


def test_losses_are_compared_exactly() -> None:
    got = classify(ok(bound=GiB), ok(), ok(losses=(2.0, 1.5, 1.1), pageouts=1), BINDS, CAP)
    assert got["first_loss_difference"] == 2 and "iteration 2" in got["reason"]
    nan = (2.0, math.nan, 1.0)
    same = classify(
        ok(bound=GiB, losses=nan), ok(losses=nan), ok(losses=nan, pageouts=1), BINDS, CAP
    )
    assert same["class"] == "identical", same
    signed = classify(ok(bound=GiB), ok(), ok(losses=(2.0, 1.5, -0.0), pageouts=1), BINDS, CAP)
    zero = classify(
        ok(bound=GiB, losses=(2.0, 1.5, 0.0)),
        ok(losses=(2.0, 1.5, 0.0)),
        ok(losses=(2.0, 1.5, -0.0), pageouts=1),
        BINDS,
        CAP,
    )
    assert signed["class"] == "mismatch" and zero["class"] == "mismatch"
    # A trained run without a buffer hash is not taken as equal.
    missing = ok(pageouts=1)
    assert missing.result is not None
    del missing.result["buffer_hash"]
    assert classify(ok(bound=GiB), ok(), missing, BINDS, CAP)["differences"] == ["buffers"]


def test_references_must_agree_in_parameters_buffers_and_losses() -> None:
    got = classify(ok(bound=GiB), ok("c" * 64), ok("b" * 64, pageouts=1), BINDS, CAP)
    assert got["class"] == "reference-not-repeatable"
    assert "neither" in got["reason"]
    got = classify(ok(bound=GiB), ok("c" * 64), ok(pageouts=1), BINDS, CAP)
    assert "reference 1" in got["reason"]
    buffers = classify(ok(bound=GiB), ok(buffer_hash="d" * 64), ok(pageouts=1), BINDS, CAP)
    assert buffers["class"] == "reference-not-repeatable" and "buffers" in buffers["reason"]
    losses = classify(ok(bound=GiB), ok(losses=(2.0, 1.5, 0.9)), ok(pageouts=1), BINDS, CAP)
    assert losses["class"] == "reference-not-repeatable" and "losses" in losses["reason"]


def test_oom_is_expected_only_when_the_mapped_bound_exceeds_the_cap() -> None:
    # In tensor bytes the operator fits (1.5 GiB); as the allocator maps it, it does not.
    expected = classify(ok(bound=3 * GiB // 2, mapped=5 * GiB // 2), ok(), oom(), BINDS, CAP)
    assert expected["class"] == "oom-expected", expected
    assert expected["mapped_bound_exceeds_cap"] is True
    assert (
        "(2.50 GiB, aten.convolution_backward.default; 1.50 GiB in tensor bytes"
        in (expected["reason"])
    )
    assert "exceeds the cap (2.00 GiB)" in expected["reason"]
    fits = classify(ok(bound=GiB, mapped=3 * GiB // 2), ok(), oom(), BINDS, CAP)
    assert fits["class"] == "oom-unexpected"
    assert "fits the cap (2.00 GiB)" in fits["reason"] and "allocator" in fits["reason"]
    # The library workspaces kept from their first use count as well.
    library = ok(bound=GiB, mapped=19 * GiB // 10, library=GiB // 5)
    assert classify(library, ok(), oom(), BINDS, CAP)["class"] == "oom-expected"


def test_oom_is_expected_only_with_the_capped_runs_allocator_setting() -> None:
    over = {"bound": GiB, "mapped": 3 * GiB}
    other = classify(ok(**over, expandable=False), ok(), oom(expandable=True), BINDS, CAP)
    assert other["class"] == "oom-unexpected"
    assert (
        "measured with expandable segments off, the capped run ran with them on"
        in (other["reason"])
    )
    unknown = classify(ok(**over), ok(), oom(expandable=None), BINDS, CAP)
    assert unknown["class"] == "oom-unexpected" and "unknown" in unknown["reason"]
    assert classify(ok(**over), ok(), oom(), BINDS, CAP)["class"] == "oom-expected"


def test_oom_is_unexpected_when_the_same_cap_without_lms_trains() -> None:
    got = classify(ok(bound=GiB, mapped=3 * GiB), ok(), oom(), ok(), CAP)
    assert got["class"] == "oom-unexpected"
    assert "the same cap without LMS trains" in got["reason"]


# The message of a real LSTM case on an H100 (cap 383 MiB): LMS's own account of why the
# operator did not fit. It decides nothing.
LSTM_OOM = (
    "CUDA out of memory with Large Model Support. Tried to allocate 107.75 MiB on device 0 "
    "after paging out every reclaimable storage. The running operator's working set does not "
    "fit under the LMS limit: 247.15 MiB is allocated to tensors: 129.00 MiB pinned by the "
    "running operator(s), 113.00 MiB allocated by them and not released yet, 0.00 MiB "
    "inactive."
)


def test_what_lms_says_about_itself_decides_no_class() -> None:
    capped = oom(LSTM_OOM)
    assert capped.result is not None
    capped.result["memory_at_oom"] = {
        "request_bytes": int(107.75 * MiB),
        "reserved_bytes": 300 * MiB,
        "segments": [{"largest_free_bytes": 16 * MiB}],
    }
    capped.result["lms"] = {"oom_count": 3, "pageout_count": 40, "pin_failures": 1}
    got = classify(ok(bound=330 * MiB, mapped=350 * MiB), ok(), capped, BINDS, 383 * MiB)
    assert got["class"] == "oom-unexpected", got
    assert "LMS out of memory" in got["reason"]  # quoted, not believed
    assert not hasattr(runner, "OPERATOR_OVER_LIMIT")
    assert not hasattr(runner, "mapped_working_set")
    assert not hasattr(runner, "explained_mismatch")


def test_a_pin_failure_warning_is_quoted_but_changes_no_class() -> None:
    log = (
        "UserWarning: Large Model Support: the inputs of aten::_foreach_mul_ could not all be "
        "made resident; the operator runs without them and fails.\n"
    )
    got = classify(ok(bound=GiB), ok(), Outcome(-11, False, 3.0, None, log), BINDS, CAP)
    assert got["class"] == "crash"
    assert "after an LMS pin failure (the inputs of aten::_foreach_mul_)" in got["reason"]
    raised = failed("builtins.RuntimeError", "Expected a non-null data pointer")
    assert raised.result is not None
    raised.result["warnings"] = [log.strip()]
    over = classify(ok(bound=3 * GiB), ok(), raised, BINDS, CAP)
    assert over["class"] == "error", over
    assert "after an LMS pin failure" in over["reason"]


def test_crashes_signal_timeout_cuda_error_no_result() -> None:
    refs = (ok(bound=GiB), ok())
    segv = Outcome(-11, False, 2.0, None, "stress: iteration 1 backward\n")
    got = classify(*refs, segv, BINDS, CAP)
    assert got["class"] == "crash" and "SIGSEGV" in got["reason"]
    hang = Outcome(-9, True, 120.0, None, "")
    assert "killed after 120 s" in classify(*refs, hang, BINDS, CAP)["reason"]
    illegal = failed(
        "RuntimeError", "CUDA error: an illegal memory access was encountered", cuda=True
    )
    assert classify(*refs, illegal, BINDS, CAP)["class"] == "crash"
    gone = Outcome(1, False, 2.0, None, "")
    assert classify(*refs, gone, BINDS, CAP)["class"] == "crash"
    exit_after = Outcome(-6, False, 2.0, ok().result, "")
    assert classify(*refs, exit_after, BINDS, CAP)["class"] == "crash"
    nonzero_after = Outcome(1, False, 2.0, ok().result, "")
    assert run_status(nonzero_after)[0] == "exit"


def test_other_exception_is_an_error_and_failed_reference_is_reported() -> None:
    got = classify(ok(bound=GiB), ok(), failed("builtins.ValueError", "bad"), BINDS, CAP)
    assert got["class"] == "error"
    got = classify(Outcome(-11, False, 1.0, None, ""), ok(), None, None, None)
    assert got["class"] == "reference-failed" and "reference 1" in got["reason"]
    got = classify(ok(), oom(), None, None, None)
    assert got["class"] == "reference-failed" and "reference 2" in got["reason"]


def test_gate() -> None:
    records = [{"class": c, "seed": i} for i, c in enumerate(runner.CLASSES)]
    failing = {r["class"] for r in runner.gate_failures(records)}
    assert failing == {"crash", "error", "mismatch", "oom-unexpected", "reference-failed"}
    # Every mismatch fails, whatever its triage says; so does a class the gate does not know
    # (older runners wrote "mismatch-explained").
    legacy = [{"class": "mismatch-explained", "seed": 0}, {"class": "identical", "seed": 1}]
    assert runner.gate_failures(legacy) == legacy[:1]
    assert runner.gate_verdict(legacy)[0] is False
    assert runner.gate_verdict([{"class": "surprise", "seed": 0}])[0] is False


def test_triage_verdicts() -> None:
    cap_alone = {
        "capped_repeat": {"status": "ok", "equals": True},
        "no_lms": {"status": "ok", "equals": False},
    }
    assert "the cap alone" in runner.triage_verdict(cap_alone)
    cudnn = {
        "capped_repeat": {"status": "ok", "equals": True},
        "no_lms": {"status": "oom", "equals": None},
        "no_cudnn": {"status": "ok", "equals": True},
    }
    assert "cuDNN" in runner.triage_verdict(cudnn)
    suspect = {
        "capped_repeat": {"status": "ok", "equals": True},
        "no_lms": {"status": "ok", "equals": True},
        "no_cudnn": {"status": "ok", "equals": False},
    }
    assert "suspect LMS" in runner.triage_verdict(suspect)
    racy = {"capped_repeat": {"status": "ok", "equals": False}, "no_lms": {"status": "oom"}}
    assert "does not repeat" in runner.triage_verdict(racy)
    recompute = {
        "capped_repeat": {"status": "ok", "equals": True},
        "no_lms": {"status": "oom"},
        "no_recompute": {"status": "ok", "equals": True},
    }
    assert "recompute changes the result" in runner.triage_verdict(recompute)
    not_recompute = {**recompute, "no_recompute": {"status": "ok", "equals": False}}
    assert "not recompute" in runner.triage_verdict(not_recompute)


# ------------------------------------------------------------- records, summary, merge


def record(seed: int, cls: str, family: str = "lstm", **extra: Any) -> dict[str, Any]:
    case = dataclasses.replace(generate(seed), family=family)
    return {
        "seed": seed,
        "attempt": 1,
        "timestamp": "2026-11-25T10:00:00+00:00",
        "label": case.label(),
        "case": case.to_dict(),
        "class": cls,
        "reason": "why | not",
        "cap_bytes": GiB,
        "peak_reserved_bytes": 2 * GiB,
        "bound_bytes": GiB // 4,
        "mapped_bound_bytes": GiB // 3,
        "paged_out": True,
        "allocator": {"expandable_segments": True, "source": "given"},
        "runs": {"reference-1": {"s_per_iter": 0.1}, "capped": {"s_per_iter": 0.3}},
        "env": {
            "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0+cu130",
            "engine_commit": "abc1234",
            "engine_dirty": False,
            "engine_sources_sha256": "5" * 64,
            "driver": "580.159.04",
        },
        **extra,
    }


def _write(folder: Path, records: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_summary_and_merge(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", [record(0, "identical"), record(1, "crash")])
    b = _write(tmp_path / "b", [record(2, "identical", "conv3d"), record(3, "cap-not-binding")])
    text = runner.summarize(runner.load_records([a, b]))
    assert "3 cases where the cap binds; gate: **FAIL (1 failing record(s))**" in text
    assert "1 more case(s) where the cap does not bind" in text
    assert "| lstm | 3 | 1 | 1 | 1 |" in text  # identical, cap-not-binding, crash
    assert runner.replay_command(1) in text
    assert "engine_commit: abc1234 | engine_dirty: False | engine_sources_sha256: 5555" in text
    assert "driver: 580.159.04 | device: NVIDIA H100 80GB HBM3" in text
    assert "expandable_segments on (given)" in text
    merged = tmp_path / "merged"
    assert runner.main(["--merge", str(a), str(b), "--out", str(merged)]) == 1
    assert len((merged / "results.jsonl").read_text().splitlines()) == 4
    _write(a, [record(0, "identical")])
    assert runner.main(["--merge", str(a), "--out", str(merged)]) == 0
    # Records from different engines: the header says so.
    other = record(5, "identical")
    other["env"]["engine_commit"] = "def5678"
    text = runner.summarize([record(0, "identical"), other])
    assert "engine_commit: abc1234 (1 records) / def5678 (1 records)" in text


def test_a_rerun_seed_keeps_every_record_in_summary_merge_and_gate(tmp_path: Path) -> None:
    first = record(7, "crash", attempt=1, timestamp="2026-11-25T10:00:00+00:00")
    again = record(7, "identical", attempt=2, timestamp="2026-11-25T11:00:00+00:00")
    a = _write(tmp_path / "a", [first, again, record(8, "identical")])
    b = _write(tmp_path / "b", [record(7, "oom-expected", timestamp="2026-11-25T12:00:00+00:00")])
    records = runner.load_records([a, b, a])  # a folder given twice counts once
    assert [(r["seed"], r["class"]) for r in records] == [
        (7, "crash"),
        (7, "identical"),
        (7, "oom-expected"),
        (8, "identical"),
    ]
    assert [r["class"] for r in runner.latest_per_seed(records)] == ["oom-expected", "identical"]
    text = runner.summarize(records)
    assert "gate: **FAIL (1 failing record(s))**" in text  # the earlier crash is judged
    assert "1 seed(s) ran more than once" in text
    assert (
        "- seed 7: attempt 1 at 2026-11-25T10:00:00+00:00: crash; attempt 2 at "
        "2026-11-25T11:00:00+00:00: identical; attempt 1 at 2026-11-25T12:00:00+00:00: "
        "oom-expected"
    ) in text
    assert "| 7 (3) |" in text  # the table shows the latest record with the count
    merged = tmp_path / "merged"
    assert runner.main(["--merge", str(a), str(b), "--out", str(merged)]) == 1
    assert len(runner.load_records([merged])) == 4


def test_compressed_results_read_as_plain_ones(tmp_path: Path) -> None:
    """Committed results keep their records xz-compressed: the gate, the merge and the
    failing-records reader read results.jsonl.xz as they read results.jsonl, and a folder
    with neither is an error naming it."""
    import lzma

    records = [record(0, "identical"), record(1, "mismatch")]
    plain = _write(tmp_path / "plain", records)
    packed = tmp_path / "packed"
    packed.mkdir()
    with lzma.open(packed / "results.jsonl.xz", "wt") as f:
        f.write((plain / "results.jsonl").read_text())
    assert runner.load_records([packed]) == runner.load_records([plain])
    assert [r["seed"] for r in runner.failing_records([packed])] == [1]
    assert runner.main(["--merge", str(packed), "--out", str(tmp_path / "merged")]) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"results\.jsonl\.xz"):
        runner.failing_records([empty])


class FakeLauncher(runner.Launcher):
    """Answers every run without starting a process: each trains, the capped run without LMS
    runs out of memory, the capped LMS run pages out; ``capped`` overrides the LMS run."""

    def __init__(self, delay: float, capped: Outcome | None = None) -> None:
        super().__init__(sys.executable, {})
        self.delay = delay
        self.capped = capped
        self.runs: list[str] = []
        self.requests: list[dict[str, Any]] = []

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        time.sleep(self.delay)
        self.runs.append(request["mode"])
        self.requests.append(request)
        if request["mode"] == "capped-no-lms":
            return oom()
        if request["mode"] == "capped" and self.capped is not None:
            return self.capped
        bound = 1 if request["measure_bound"] else None
        return ok(bound=bound, pageouts=1 if request["mode"] == "capped" else 0)


def test_every_case_runs_the_cap_without_lms(tmp_path: Path) -> None:
    launcher = FakeLauncher(0.0)
    settings = runner.Settings(out=tmp_path, device="cpu", provenance={})
    got = runner.run_case(4, launcher, settings)
    assert launcher.runs == ["reference", "reference", "capped", "capped-no-lms"]
    assert got["class"] == "identical" and got["runs"]["capped-no-lms"]["status"] == "oom"
    assert [r["cap_bytes"] for r in launcher.requests[2:]] == [got["cap_bytes"]] * 2
    # No capped run of either kind when a reference did not train.
    broken = SegfaultingLauncher(0.0)
    failed_refs = runner.run_case(5, broken, settings)
    assert failed_refs["class"] == "reference-failed"
    assert broken.runs == ["reference", "reference"]
    assert failed_refs["runs"]["capped-no-lms"] is None


class SegfaultingLauncher(FakeLauncher):
    """Every run is killed by SIGSEGV."""

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        self.runs.append(request["mode"])
        return Outcome(-11, False, 1.0, None, "")


def test_every_run_of_a_case_gets_the_capped_runs_allocator_setting(tmp_path: Path) -> None:
    launcher = FakeLauncher(0.0)
    launcher.env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}
    settings = runner.Settings(out=tmp_path, device="cuda", provenance={})
    runner.prepare(settings, launcher)
    assert settings.expandable_segments is True  # as LMS sets it
    got = runner.run_case(4, launcher, settings)
    assert len(launcher.requests) == 4
    confs = {r["alloc_conf"] for r in launcher.requests}
    assert confs == {"max_split_size_mb:256,expandable_segments:True"}
    assert got["allocator"]["conf"] == "max_split_size_mb:256,expandable_segments:True"
    # The user's own setting wins.
    launcher.env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    settings = runner.Settings(out=tmp_path, device="cuda", provenance={})
    runner.prepare(settings, launcher)
    assert settings.expandable_segments is False
    # On the CPU (the runner's tests), each run keeps its environment's.
    settings = runner.Settings(out=tmp_path, device="cpu", provenance={})
    runner.prepare(settings, launcher)
    assert settings.expandable_segments is None


def test_records_carry_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmsbench import lms_setup as setup

    assert setup.__file__ == str(REPO / "lmsbench" / "lms_setup.py")
    assert runner.harness.__file__ == str(REPO / "lmsbench" / "harness.py")
    monkeypatch.setenv("LMS_ENGINE_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("LMS_ENGINE_DIRTY", "1")
    settings = runner.Settings(out=tmp_path, device="cpu")
    records = runner.run_suite([1, 2], settings, FakeLauncher(0.0), None, lambda _: None)
    for r in records:
        for key in runner.PROVENANCE_KEYS:
            assert key in r["env"], key
        assert r["env"]["engine_commit"] == "0123456789abcdef"
        assert r["env"]["engine_dirty"] is True
        assert r["env"]["engine_sources_sha256"] == setup.engine_sources_sha256(REPO)
    text = (tmp_path / "summary.md").read_text()
    assert "engine_commit: 0123456789abcdef | engine_dirty: True" in text


def test_time_budget_stops_between_cases_and_results_are_incremental(tmp_path: Path) -> None:
    launcher = FakeLauncher(delay=0.05)
    settings = runner.Settings(out=tmp_path, device="cpu", provenance={})
    messages: list[str] = []
    records = runner.run_suite(list(range(100)), settings, launcher, 1.0, messages.append)
    assert 2 <= len(records) < 100
    assert launcher.runs[:4] == ["reference", "reference", "capped", "capped-no-lms"]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["seed"] for line in lines] == [r["seed"] for r in records]
    assert any(f"--start {len(records)}" in m for m in messages)
    assert "gate: **PASS**" in (tmp_path / "summary.md").read_text()
    # Continuing in the same folder: the summary covers both runs.
    more = runner.run_suite([500, 501], settings, launcher, None, messages.append)
    assert [r["seed"] for r in more] == [500, 501]
    summary = (tmp_path / "summary.md").read_text()
    assert f"{len(records) + 2} cases where the cap binds; gate" in summary
    assert len(runner.load_records([tmp_path])) == len(records) + 2


def test_a_seed_run_again_appends_an_attempt(tmp_path: Path) -> None:
    settings = runner.Settings(out=tmp_path, device="cpu", provenance={})
    crash = Outcome(-11, False, 1.0, None, "")
    first = runner.run_suite([7], settings, FakeLauncher(0.0, capped=crash), None, print)
    again = runner.run_suite([7], settings, FakeLauncher(0.0), None, print)
    assert (first[0]["attempt"], first[0]["class"]) == (1, "crash")
    assert (again[0]["attempt"], again[0]["class"]) == (2, "identical")
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["class"]) for r in lines] == [(1, "crash"), (2, "identical")]
    assert all(r["timestamp"] for r in lines)
    assert (tmp_path / "runs" / "7").is_dir() and (tmp_path / "runs" / "7" / "attempt-2").is_dir()
    assert lines[1]["runs_dir"] == "runs/7/attempt-2"
    summary = (tmp_path / "summary.md").read_text()
    assert "gate: **FAIL (1 failing record(s))**" in summary
    assert "- seed 7: attempt 1 at" in summary and ": crash; attempt 2 at" in summary


def test_runner_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.regression.stress.runner", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    for option in (
        "--seeds",
        "--seed",
        "--start",
        "--time-budget-s",
        "--out",
        "--python",
        "--jobs",
        "--merge",
        "--failed-of",
        "--expandable-segments",
    ):
        assert option in out.stdout


def test_parallel_jobs_run_every_case_once_and_write_each_as_it_finishes(tmp_path: Path) -> None:
    made: list[FakeLauncher] = []

    def make() -> runner.Launcher:
        made.append(FakeLauncher(delay=0.02))
        return made[-1]

    settings = runner.Settings(out=tmp_path, device="cpu", provenance={})
    messages: list[str] = []
    records = runner.run_suite(
        list(range(12)), settings, FakeLauncher(0.0), None, messages.append, 3, make
    )
    assert [r["seed"] for r in records] == list(range(12))
    assert 1 < len(made) <= 3  # one launcher per job thread
    runs = [mode for launcher in made for mode in launcher.runs]
    assert len(runs) == 12 * 4 and runs.count("capped-no-lms") == 12
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["seed"] for line in lines) == list(range(12))
    assert "12 cases where the cap binds; gate: **PASS**" in (tmp_path / "summary.md").read_text()
    # A budget stops new cases; what ran is kept and the continuation point is printed.
    more = runner.run_suite(
        list(range(100, 200)), settings, FakeLauncher(0.0), 0.3, messages.append, 3, make
    )
    assert 0 < len(more) < 100
    assert any("--start" in m for m in messages)
    # Seeds run again in parallel get their next attempt numbers.
    again = runner.run_suite([0, 1, 2], settings, FakeLauncher(0.0), None, messages.append, 3, make)
    assert [r["attempt"] for r in again] == [2, 2, 2]


# ------------------------------------------------------------------ worker and runner


def tiny(case: Case, family: str | None = None) -> Case:
    """A CPU-sized version of a case (its optimizer and autocast mode kept)."""
    family = family or case.family
    return dataclasses.replace(
        case,
        family=family,
        width=8 if family in ("resnet_add", "densenet_cat", "conv3d") else 32,
        depth=2,
        stages=2 if family in ("resnet_add", "densenet_cat", "conv3d") else 1,
        resolution=8,
        frames=4 if family == "conv3d" else 0,
        heads=2 if family == "transformer" else 0,
        batch=2,
        classes=10,
    )


def fork_server(python: str = sys.executable) -> runner.Launcher:
    """The fork launcher, its server with one OpenMP thread (see the module docstring)."""
    launcher = runner.make_launcher("fork", python)
    launcher.env["OMP_NUM_THREADS"] = "1"
    return launcher


@pytest.fixture(scope="module")
def fork_launcher() -> Any:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    launcher = fork_server()
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def worker() -> Any:
    return pytest.importorskip("tests.regression.stress.worker")


def _request(tmp_path: Path, case: Case, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "case": case.to_dict(),
        "mode": "reference",
        "device": "cpu",
        "cap_bytes": None,
        "measure_bound": True,
        "result": str(tmp_path / f"{name}.json"),
        "log": str(tmp_path / f"{name}.log"),
        **extra,
    }


def test_mapped_together_is_the_most_compact_placement() -> None:
    together = allocator.mapped_together
    assert together([], True) == together([0], False) == 0
    # Small tensors in 512-byte blocks, whatever the setting.
    assert together([100, MiB], True) == together([100, MiB], False) == 512 + MiB
    # Fixed segments: each large tensor in a segment of its own, rounded to 2 MiB.
    assert together([3 * MiB, 3 * MiB, 21 * MiB], False) == 4 * MiB + 4 * MiB + 22 * MiB
    # Expandable segments: packed side by side, only the last 20 MiB page partly used.
    assert together([3 * MiB, 3 * MiB, 21 * MiB], True) == 40 * MiB
    assert together([10 * MiB, 10 * MiB], True) == 20 * MiB
    assert together([10 * MiB, 10 * MiB + 1], True) == 40 * MiB
    # Never less than the tensor bytes, never more than each tensor rounded alone.
    sizes = [5 * MiB + 7, 700, 33 * MiB, 2 * MiB]
    for expandable in (False, True):
        least = together(sizes, expandable)
        assert sum(sizes) <= least <= sum(allocator.mapped_bytes(n, expandable) for n in sizes)


def test_an_operators_working_set_counts_its_tensors_as_mapped_together(worker: Any) -> None:
    inputs = {1: 3 * MiB, 2: 100}
    outputs = {3: 3 * MiB, 1: 3 * MiB}  # an in-place output is its input
    # Without an allocation peak (CPU): the storages of the inputs and outputs.
    assert worker.op_working_set(inputs, outputs, None, False) == (6 * MiB + 100, 8 * MiB + 512)
    assert worker.op_working_set(inputs, outputs, None, True) == (6 * MiB + 100, 20 * MiB + 512)
    # With one (CUDA): the new output and 5 MiB of temporaries on top of the inputs; the
    # temporaries count as one allocation.
    transient = 8 * MiB
    raw, mapped = worker.op_working_set(inputs, outputs, transient, False)
    assert raw == 3 * MiB + 100 + transient
    assert mapped == 4 * MiB + 512 + 4 * MiB + 6 * MiB
    _, mapped = worker.op_working_set(inputs, outputs, transient, True)
    assert mapped == 512 + 20 * MiB  # 11 MiB of large tensors in one page


def test_the_working_set_mode_measures_tensor_and_mapped_bytes(worker: Any) -> None:
    import torch

    a = torch.ones(3 * MiB // 8)  # 1.5 MiB of float32 each
    b = torch.ones(3 * MiB // 8)
    found = {}
    for expandable in (False, True):
        mode = worker.WorkingSetMode("cpu", expandable)
        with mode:
            _ = a + b
        found[expandable] = mode
    assert found[False].max_bytes == found[True].max_bytes == 9 * MiB // 2
    assert found[False].max_op == "aten.add.Tensor"
    assert found[False].max_mapped_bytes == 3 * 2 * MiB
    assert found[True].max_mapped_bytes == 20 * MiB  # 4.5 MiB in one page
    assert found[True].max_mapped_op == "aten.add.Tensor"


def test_worker_trains_a_tiny_case_on_cpu_from_the_command_line(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    case = tiny(generate(0), "resnet_add")
    request = _request(tmp_path, case, "ref", alloc_conf="expandable_segments:True")
    (tmp_path / "request.json").write_text(json.dumps(request))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.regression.stress.worker",
            "--request",
            str(tmp_path / "request.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "ref.json").read_text())
    assert result["status"] == "ok"
    assert len(result["losses"]) == case.iterations
    assert all(0 < loss < 100 for loss in result["losses"])
    assert len(result["param_hash"]) == 64 and len(result["buffer_hash"]) == 64
    assert result["bound"]["bytes"] > 0 and result["bound"]["op"].startswith("aten.")
    assert result["bound"]["mapped_bytes"] >= result["bound"]["bytes"]
    assert result["bound"]["expandable_segments"] is True
    assert result["allocator"]["expandable_segments"] is True
    assert result["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert result["env"]["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert result["env"]["lms_backend"] is None
    # A run's JSON names its engine without a runner to merge it in.
    from lmsbench import lms_setup as setup

    assert result["env"]["engine_sources_sha256"] == setup.engine_sources_sha256(REPO)
    assert result["env"]["engine_commit"] not in ("", None)
    assert "torch_lms" not in proc.stderr


def test_the_bound_is_mapped_with_the_allocator_setting_of_the_run(
    fork_launcher: runner.Launcher, tmp_path: Path
) -> None:
    # Weights of 4 MiB: the large pool, where the setting changes the rounding.
    case = dataclasses.replace(tiny(generate(3), "mlp_tokens"), width=512, depth=1)
    bounds = {}
    for expandable in (False, True):
        conf = f"max_split_size_mb:256,expandable_segments:{expandable}"
        outcome = fork_launcher.launch(
            _request(tmp_path, case, f"e{expandable}", alloc_conf=conf), 120
        )
        assert run_status(outcome)[0] == "ok", outcome.log_tail
        assert outcome.result is not None
        assert outcome.result["allocator"]["expandable_segments"] is expandable
        assert outcome.result["env"]["PYTORCH_CUDA_ALLOC_CONF"] == conf
        bounds[expandable] = outcome.result["bound"]
    assert bounds[False]["bytes"] == bounds[True]["bytes"]
    assert bounds[True]["mapped_bytes"] > bounds[False]["mapped_bytes"] > bounds[False]["bytes"]
    assert [bounds[e]["expandable_segments"] for e in (False, True)] == [False, True]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_repeatably_on_cpu(
    fork_launcher: runner.Launcher, tmp_path: Path, family: str
) -> None:
    seed = next(s for s in range(100) if generate(s).family == family)
    case = tiny(generate(seed))
    first = fork_launcher.launch(_request(tmp_path, case, "a"), 120)
    second = fork_launcher.launch(_request(tmp_path, case, "b", measure_bound=False), 120)
    assert run_status(first) == ("ok", "trained"), first.log_tail
    assert run_status(second)[0] == "ok", second.log_tail
    assert first.result is not None and second.result is not None
    assert not runner.differences(first.result, second.result)
    assert isinstance(fork_launcher, runner.ForkServerLauncher)
    assert first.result["bound"]["bytes"] >= first.result["bound"]["largest_alloc_bytes"] > 0
    other = tiny(generate(seed), family)
    other = dataclasses.replace(other, seed=other.seed + 1000)
    third = fork_launcher.launch(_request(tmp_path, other, "c", measure_bound=False), 120)
    assert third.result is not None and third.result["param_hash"] != first.result["param_hash"]


def _suite(
    launcher: runner.Launcher,
    tmp_path: Path,
    faults: dict[str, str],
    timeout: float = 120,
    family: str = "mlp_tokens",
    cap_bytes: int | None = None,
    triage: bool = True,
) -> dict[str, Any]:
    settings = runner.Settings(
        out=tmp_path,
        device="cpu",
        run_timeout_s=timeout,
        triage=triage,
        expandable_segments=True,
        provenance={},
        faults=faults,
        case_override=lambda c: tiny(c, family),
        cap_bytes=cap_bytes,
    )
    return runner.run_case(3, launcher, settings)


BOUND_NOT_MET = {"capped": "fake-pageout", "capped-no-lms": "oom"}


@pytest.mark.parametrize(
    ("faults", "cap", "cls", "reason"),
    [
        (BOUND_NOT_MET, None, "identical", "bit-identical"),
        ({}, None, "cap-not-binding", "the same cap without LMS trains"),
        ({"capped-no-lms": "oom"}, None, "cap-not-binding", "LMS paged nothing out"),
        ({"capped": "segv"}, None, "crash", "SIGSEGV"),
        ({"capped": "abort"}, None, "crash", "SIGABRT"),
        ({"capped": "exit"}, None, "crash", "without a result"),
        ({"capped": "cuda-error"}, None, "crash", "illegal memory access"),
        ({"capped": "oom"}, 1, "oom-unexpected", "the same cap without LMS trains"),
        ({"capped": "oom", "capped-no-lms": "oom"}, 1, "oom-expected", "exceeds the cap"),
        ({"capped": "oom", "capped-no-lms": "oom"}, GiB, "oom-unexpected", "fits the cap"),
        ({"capped": "exception"}, None, "error", "ValueError"),
        ({"reference-2": "perturb", **BOUND_NOT_MET}, None, "reference-not-repeatable", "in "),
        ({"reference-1": "segv"}, None, "reference-failed", "SIGSEGV"),
    ],
)
def test_runner_classifies_real_worker_processes(
    fork_launcher: runner.Launcher,
    tmp_path: Path,
    faults: dict[str, str],
    cap: int | None,
    cls: str,
    reason: str,
) -> None:
    got = _suite(fork_launcher, tmp_path, faults, cap_bytes=cap)
    assert got["class"] == cls, got
    assert reason in got["reason"]
    if cls != "identical":
        assert got["replay"] == runner.replay_command(3)
    if cls != "reference-failed":
        # Every run of the case ran with the capped run's allocator setting, set by each
        # forked child itself (the server's environment has none).
        assert "PYTORCH_CUDA_ALLOC_CONF" not in fork_launcher.env
        runs = got["runs"]
        assert set(runs) == {"reference-1", "reference-2", "capped", "capped-no-lms"}
        for name in ("reference-1", "reference-2", "capped-no-lms"):
            assert runs[name]["allocator"]["expandable_segments"] is True, name
        assert got["bound_expandable_segments"] is True


def test_the_fork_server_forks_every_run_of_a_case(
    fork_launcher: runner.Launcher, tmp_path: Path
) -> None:
    assert isinstance(fork_launcher, runner.ForkServerLauncher)
    _suite(fork_launcher, tmp_path / "first", BOUND_NOT_MET)
    if fork_launcher.fallback is not None:
        pytest.skip("this PyTorch leaves the fork server with several threads: spawning")
    server = fork_launcher.proc
    assert server is not None
    got = _suite(fork_launcher, tmp_path / "second", BOUND_NOT_MET)
    # The same server forked all four runs of the second case too, the run without LMS
    # included, each child with the case's allocator setting.
    assert fork_launcher.fallback is None and fork_launcher.proc is server
    assert server.poll() is None
    assert got["class"] == "identical"
    results = {
        p.stem: json.loads(p.read_text()) for p in (tmp_path / "second").glob("runs/3/*.json")
    }
    assert set(results) == {"reference-1", "reference-2", "capped", "capped-no-lms"}
    assert all(r["allocator"]["expandable_segments"] is True for r in results.values())


def test_runner_kills_a_hung_worker(fork_launcher: runner.Launcher, tmp_path: Path) -> None:
    start = time.perf_counter()
    got = _suite(fork_launcher, tmp_path, {"capped": "hang"}, timeout=4)
    assert got["class"] == "crash" and "killed after" in got["reason"]
    assert time.perf_counter() - start < 30


def test_mismatch_is_triaged_for_information_only(
    fork_launcher: runner.Launcher, tmp_path: Path
) -> None:
    got = _suite(fork_launcher, tmp_path, {"capped": "perturb"})
    assert got["class"] == "mismatch"
    assert got["reason"].startswith("parameters differ from the repeatable references")
    triage = got["triage"]
    # Only the first capped run was perturbed: its repeat and the run without LMS are not.
    assert triage["capped_repeat"]["equals"] is False
    assert triage["no_lms"]["equals"] is True
    assert "does not repeat" in triage["verdict"]
    assert "no_cudnn" not in triage  # the MLP has no cuDNN operator
    # The case's own run without LMS serves the triage: it is not run again.
    runs = sorted(p.name for p in (tmp_path / "runs" / "3").glob("*.json"))
    assert "capped-no-lms.json" in runs and "triage-capped-no-lms.json" not in runs
    assert runner.gate_failures([got]) == [got]


def test_a_buffer_that_differs_is_a_mismatch(
    fork_launcher: runner.Launcher, tmp_path: Path
) -> None:
    faults = {"capped": "perturb-buffer", "capped-no-lms": "oom"}
    got = _suite(fork_launcher, tmp_path, faults, family="resnet_add", triage=False)
    assert got["class"] == "mismatch", got
    assert got["differences"] == ["buffers"]
    assert got["reason"] == ("buffers differ from the repeatable references; losses equal")


def test_spawn_launcher_reports_a_worker_killed_by_a_signal(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    launcher = runner.make_launcher("spawn", sys.executable)
    case = tiny(generate(0), "mlp_tokens")
    outcome = launcher.launch(_request(tmp_path, case, "segv", fault="segv"), 300)
    assert outcome.returncode == -11
    assert outcome.result is None
    assert run_status(outcome) == ("signal", "killed by SIGSEGV")


def test_spawn_launcher_kills_a_hung_worker(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    launcher = runner.make_launcher("spawn", sys.executable)
    case = tiny(generate(0), "mlp_tokens")
    start = time.perf_counter()
    outcome = launcher.launch(_request(tmp_path, case, "hang", fault="hang"), 6)
    assert outcome.timed_out and outcome.returncode == -9
    assert run_status(outcome)[0] == "hang"
    assert time.perf_counter() - start < 30


def test_fork_launcher_falls_back_to_spawning_when_forked_cuda_fails(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    launcher = fork_server()
    assert isinstance(launcher, runner.ForkServerLauncher)
    case = tiny(generate(0), "mlp_tokens")
    try:
        broken = launcher.launch(_request(tmp_path, case, "a", fault="fork-broken"), 300)
        assert launcher.fallback is not None
        assert "forked subprocess" in broken.log_tail
        fine = launcher.launch(_request(tmp_path, case, "b"), 300)
        assert run_status(fine)[0] == "ok"
    finally:
        launcher.close()


def test_only_the_capped_lms_modes_enable_lms(worker: Any) -> None:
    assert [m for m in worker.MODES if worker.uses_lms(m)] == [
        "capped",
        "capped-no-cudnn",
        "capped-no-recompute",
    ]
    assert [m for m in worker.MODES if worker.is_capped(m)] == [
        "capped",
        "capped-no-lms",
        "capped-no-cudnn",
        "capped-no-recompute",
    ]


def test_mismatch_of_a_cudnn_model_is_triaged_without_cudnn(
    fork_launcher: runner.Launcher, tmp_path: Path
) -> None:
    got = _suite(fork_launcher, tmp_path, {"capped": "perturb"}, family="resnet_add")
    assert got["class"] == "mismatch"
    triage = got["triage"]
    assert triage["reference_no_cudnn"]["status"] == "ok"
    assert triage["no_cudnn"]["equals"] is True
    assert "with cuDNN disabled" in triage["verdict"]
    runs = sorted(p.name for p in (tmp_path / "runs" / "3").glob("*.json"))
    assert "triage-capped-no-cudnn.json" in runs and "triage-reference-no-cudnn.json" in runs


def test_failed_of_picks_every_seed_with_a_failing_record(tmp_path: Path) -> None:
    a = _write(
        tmp_path / "a",
        [
            record(3, "identical"),
            record(5, "mismatch"),
            record(7, "crash", attempt=1),
            record(7, "identical", attempt=2, timestamp="2026-11-25T11:00:00+00:00"),
        ],
    )
    b = _write(tmp_path / "b", [record(2, "oom-unexpected"), record(4, "oom-expected")])
    # An earlier failing attempt counts, as the gate counts it.
    assert runner.failed_seeds([a, b]) == [2, 5, 7]
    assert runner.failed_seeds([b / "results.jsonl"]) == [2]
    assert runner.failed_seeds([_write(tmp_path / "c", [record(1, "identical")])]) == []
    with pytest.raises(SystemExit, match=r"no results\.jsonl \(or results\.jsonl\.xz\) in"):
        runner.failed_seeds([tmp_path / "missing"])
    passing = tmp_path / "c"
    assert runner.main(["--failed-of", str(passing), "--out", str(tmp_path / "out")]) == 0


def test_page_use_tells_partly_used_pages_from_full_and_free_ones(worker: Any) -> None:
    page = 20 * MiB
    base = 7 * page  # a mapped range starts on a page of its segment
    layout = [
        (page, True),  # page 0: full
        (2 * MiB, True),  # page 1: 2 MiB used ...
        (page + 18 * MiB, False),  # ... the rest of it and all of page 2 free
        (5 * MiB, True),  # page 3: 5 MiB at its start ...
        (10 * MiB, False),
        (5 * MiB, True),  # ... and 5 MiB at its end
        (15 * MiB, True),  # page 4: 15 MiB, its last 5 MiB free
        (5 * MiB, False),
    ]
    use = worker.page_use(base, layout, page)
    assert use == {
        "pages": 5,
        "pages_full": 1,
        "pages_partly_used": 3,
        "pages_free": 1,
        "partly_used_free_bytes": 18 * MiB + 10 * MiB + 5 * MiB,
    }
    # A tensor across a page boundary counts in both pages.
    across = worker.page_use(0, [(10 * MiB, False), (20 * MiB, True), (10 * MiB, False)], page)
    assert across["pages_partly_used"] == 2 and across["partly_used_free_bytes"] == 20 * MiB


def test_replay_runs_the_capped_run_of_each_failing_seed_again_and_writes_no_record(
    tmp_path: Path,
) -> None:
    """--replay-capped-of: the capped LMS run of every failing seed once more, with the case,
    cap and allocator setting of its last failing record, into out/replay/SEED/; passing
    seeds and records without a capped run are left alone, and no record is written."""
    judged = tmp_path / "judged"
    settings = runner.Settings(out=judged, device="cpu", provenance={}, triage=False)
    # Seed 3 trains identical; 4 and 5 mismatch (the capped run's parameters differ).
    runner.run_suite([3], settings, FakeLauncher(0.0), None, lambda _: None)
    differs = FakeLauncher(0.0, capped=ok(param_hash="b" * 64, pageouts=1))
    runner.run_suite([4, 5], settings, differs, None, lambda _: None)
    runner.run_suite([6], settings, SegfaultingLauncher(0.0), None, lambda _: None)
    records = runner.load_records([judged])
    by_seed = {r["seed"]: r for r in records}
    assert by_seed[3]["class"] == "identical" and by_seed[4]["class"] == "mismatch"
    assert by_seed[6]["class"] == "reference-failed" and by_seed[6]["cap_bytes"] is None
    before = (judged / "results.jsonl").read_text()

    out = tmp_path / "replayed"
    launcher = FakeLauncher(0.0)
    told: list[int] = []
    replays = runner.replay_capped(
        [judged], out, launcher, 60.0, device="cpu", report=lambda seed, _: told.append(seed)
    )
    assert [seed for seed, _ in replays] == [4, 5] == told
    assert launcher.runs == ["capped", "capped"]
    for request, seed in zip(launcher.requests, (4, 5)):
        assert request["case"] == by_seed[seed]["case"]
        assert request["cap_bytes"] == by_seed[seed]["cap_bytes"]
        assert request["alloc_conf"] == by_seed[seed]["allocator"]["conf"]
        assert request["result"] == str(out / "replay" / str(seed) / "capped.json")
        assert request["log"] == str(out / "replay" / str(seed) / "capped.log")
    assert (judged / "results.jsonl").read_text() == before
    assert not (out / "results.jsonl").exists()


def test_replay_is_its_own_way_of_choosing_seeds(tmp_path: Path) -> None:
    args = runner.parse_args(["--replay-capped-of", str(tmp_path), "--out", str(tmp_path / "o")])
    assert args.replay_capped_of == [tmp_path]
    with pytest.raises(SystemExit):
        runner.parse_args(["--replay-capped-of", str(tmp_path), "--seed", "3"])
    # A folder without results is an error that says what to give.
    with pytest.raises(SystemExit, match=r"no results\.jsonl"):
        runner.replay_capped([tmp_path / "none"], tmp_path, FakeLauncher(0.0), 60.0, "cpu")


def test_a_run_names_the_engine_the_runner_found_once(worker: Any, tmp_path: Path) -> None:
    """The runner finds the checkout's provenance once and hands it to every run it requests;
    a run given none finds it itself (the command-line test above)."""
    import torch

    given = {"engine_commit": "abc1234", "engine_dirty": False, "driver": "unknown"}
    env = worker.environment(torch.device("cpu"), None, given)
    assert {k: env[k] for k in given} == given
    launcher = FakeLauncher(0.0)
    settings = runner.Settings(out=tmp_path, device="cpu", provenance=given)
    runner.run_case(4, launcher, settings)
    assert [r["provenance"] for r in launcher.requests] == [given] * len(launcher.requests)
