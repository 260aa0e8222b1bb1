"""CPU tests of the LMS stress suite in ``tests/regression/stress`` (no GPU needed).

They live outside ``tests/regression``, whose conftest marks every test there as a GPU test
and skips it without a GPU. Covered: the generator (deterministic per seed, every family,
optimizer and autocast mode within 200 seeds), the classification of synthetic results, the
worker trained end to end on the CPU, and the runner's handling of workers that crash
(killed by a signal), hang, fail or differ, through both launchers.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.regression.stress import generator, runner
from tests.regression.stress.generator import AMP_MODES, FAMILIES, OPTIMIZERS, Case, generate
from tests.regression.stress.runner import Outcome, classify, run_status

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30


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


# ---------------------------------------------------------------------- classification


def ok(
    param_hash: str = "a" * 64,
    losses: tuple[float, ...] = (2.0, 1.5, 1.0),
    bound: int | None = None,
    pageouts: int = 0,
    peak: int = 4 * GiB,
) -> Outcome:
    result: dict[str, Any] = {
        "status": "ok",
        "param_hash": param_hash,
        "losses": list(losses),
        "peak_reserved_bytes": peak,
        "s_per_iter": 0.1,
    }
    if bound is not None:
        result["bound"] = {"bytes": bound, "op": "aten.convolution_backward.default"}
    if pageouts:
        result["lms"] = {"pageout_count": pageouts, "pageout_bytes": pageouts << 20}
    return Outcome(0, False, 1.0, result, "")


def failed(exc_type: str, message: str, is_oom: bool = False, cuda: bool = False) -> Outcome:
    result = {
        "status": "exception",
        "losses": [],
        "exception": {
            "type": exc_type,
            "message": message,
            "is_oom": is_oom,
            "is_cuda_error": cuda,
        },
    }
    return Outcome(3 if is_oom else 4, False, 1.0, result, "Traceback ...")


CAP = 2 * GiB


def test_identical_when_capped_equals_repeatable_references() -> None:
    got = classify(ok(bound=GiB), ok(), ok(pageouts=10), CAP)
    assert got["class"] == "identical"
    assert got["paged_out"] is True
    unpaged = classify(ok(bound=GiB), ok(), ok(), CAP)
    assert unpaged["class"] == "identical" and "did not bind" in unpaged["reason"]


def test_mismatch_names_the_first_differing_iteration() -> None:
    got = classify(ok(bound=GiB), ok(), ok("b" * 64, losses=(2.0, 1.5, 1.1)), CAP)
    assert got["class"] == "mismatch"
    assert got["first_loss_difference"] == 2
    assert "iteration 2" in got["reason"]


def test_reference_not_repeatable() -> None:
    got = classify(ok(bound=GiB), ok("c" * 64), ok("b" * 64), CAP)
    assert got["class"] == "reference-not-repeatable"
    assert "neither" in got["reason"]
    got = classify(ok(bound=GiB), ok("c" * 64), ok(), CAP)
    assert "reference 1" in got["reason"]


def test_oom_is_expected_only_when_the_bound_exceeds_the_cap() -> None:
    lms_oom = failed(
        "torch.OutOfMemoryError",
        "CUDA out of memory with Large Model Support. Tried to allocate 2.00 GiB",
        is_oom=True,
    )
    expected = classify(ok(bound=3 * GiB), ok(), lms_oom, CAP)
    assert expected["class"] == "oom-expected"
    assert expected["bound_exceeds_cap"] is True
    assert "LMS" in expected["reason"]
    stock_oom = failed(
        "torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 512.00 MiB", True
    )
    unexpected = classify(ok(bound=GiB), ok(), stock_oom, CAP)
    assert unexpected["class"] == "oom-unexpected"
    assert "allocator" in unexpected["reason"]
    assert (
        "(1.00 GiB, aten.convolution_backward.default) fits the cap (2.00 GiB)"
        in (unexpected["reason"])
    )


def test_crashes_signal_timeout_cuda_error_no_result() -> None:
    refs = (ok(bound=GiB), ok())
    segv = Outcome(-11, False, 2.0, None, "stress: iteration 1 backward\n")
    got = classify(*refs, segv, CAP)
    assert got["class"] == "crash" and "SIGSEGV" in got["reason"]
    hang = Outcome(-9, True, 120.0, None, "")
    assert "killed after 120 s" in classify(*refs, hang, CAP)["reason"]
    illegal = failed(
        "RuntimeError", "CUDA error: an illegal memory access was encountered", cuda=True
    )
    assert classify(*refs, illegal, CAP)["class"] == "crash"
    gone = Outcome(1, False, 2.0, None, "")
    assert classify(*refs, gone, CAP)["class"] == "crash"
    exit_after = Outcome(-6, False, 2.0, ok().result, "")
    assert classify(*refs, exit_after, CAP)["class"] == "crash"
    nonzero_after = Outcome(1, False, 2.0, ok().result, "")
    assert run_status(nonzero_after)[0] == "exit"


def test_crash_after_an_lms_pin_failure_says_so() -> None:
    log = (
        "UserWarning: Large Model Support: the inputs of aten::_foreach_mul_ could not all be "
        "made resident; the operator runs without them and fails.\n"
    )
    got = classify(ok(bound=GiB), ok(), Outcome(-11, False, 3.0, None, log), CAP)
    assert got["class"] == "crash"
    assert "after an LMS pin failure (the inputs of aten::_foreach_mul_)" in got["reason"]
    # The extension's form of an LMS out-of-memory error: the operator raised afterwards.
    raised = failed("builtins.RuntimeError", "Expected a non-null data pointer")
    assert raised.result is not None
    raised.result["warnings"] = [log.strip()]
    expected = classify(ok(bound=3 * GiB), ok(), raised, CAP)
    assert expected["class"] == "oom-expected", expected
    assert expected["reason"].startswith("LMS pin failure: the inputs of aten::_foreach_mul_")
    assert classify(ok(bound=GiB), ok(), raised, CAP)["class"] == "oom-unexpected"


def test_other_exception_is_an_error_and_failed_reference_is_reported() -> None:
    got = classify(ok(bound=GiB), ok(), failed("builtins.ValueError", "bad"), CAP)
    assert got["class"] == "error"
    got = classify(Outcome(-11, False, 1.0, None, ""), ok(), None, None)
    assert got["class"] == "reference-failed" and "reference 1" in got["reason"]
    got = classify(ok(), failed("torch.OutOfMemoryError", "CUDA out of memory", True), None, None)
    assert got["class"] == "reference-failed" and "reference 2" in got["reason"]


def test_gate() -> None:
    records = [{"class": c, "seed": i} for i, c in enumerate(runner.CLASSES)]
    failing = {r["class"] for r in runner.gate_failures(records)}
    assert failing == {"crash", "error", "mismatch", "oom-unexpected", "reference-failed"}


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


def _outcome(oom_count: int) -> runner.Outcome:
    return runner.Outcome(
        returncode=0,
        timed_out=False,
        wall_s=1.0,
        result={"status": "ok", "lms": {"oom_count": oom_count}},
        log_tail="",
    )


def test_a_mismatch_is_explained_only_with_evidence() -> None:
    cudnn = {
        "capped_repeat": {"status": "ok", "equals": True},
        "no_lms": {"status": "oom", "equals": None},
        "no_cudnn": {"status": "ok", "equals": True},
    }
    # cuDNN caught a failed workspace allocation, and without cuDNN LMS is exact.
    assert "cuDNN" in (runner.explained_mismatch(cudnn, _outcome(2)) or "")
    # No allocation failed in the capped run: cuDNN had no reason to change algorithm.
    assert runner.explained_mismatch(cudnn, _outcome(0)) is None
    # The capped run does not repeat itself: never explained.
    racy = dict(cudnn, capped_repeat={"status": "ok", "equals": False})
    assert runner.explained_mismatch(racy, _outcome(2)) is None
    # Without cuDNN the capped LMS run still differs: LMS is suspect.
    suspect = dict(cudnn, no_cudnn={"status": "ok", "equals": False})
    assert runner.explained_mismatch(suspect, _outcome(2)) is None
    # The cap alone (no LMS, it fits) gives a difference as well.
    cap_alone = {
        "capped_repeat": {"status": "ok", "equals": True},
        "no_lms": {"status": "ok", "equals": False},
    }
    assert "without LMS" in (runner.explained_mismatch(cap_alone, _outcome(0)) or "")


# The message of a real LSTM case on an H100 (cap 383 MiB): everything LMS could page out
# was paged out; the running cuDNN backward held 242 MiB and asked for 108 MiB more.
LSTM_OOM = (
    "CUDA out of memory with Large Model Support. Tried to allocate 107.75 MiB on device 0 "
    "after paging out every reclaimable storage. 247.15 MiB is allocated to tensors: 129.00 "
    "MiB pinned by the running operator(s), 113.00 MiB allocated by them and not released "
    "yet, 0.00 MiB inactive (0 storages below the LMS size threshold of 1.00 MiB or without "
    "pinned host memory to page to), the rest too small or not yet used by an operator."
)


def test_an_operator_that_fills_the_cap_as_mapped_is_expected_to_run_out() -> None:
    mib = 1 << 20
    cap = 383 * mib
    at_failure = {
        "request_bytes": int(107.75 * mib),
        "reserved_bytes": 300 * mib,
        "segments": [{"largest_free_bytes": 36 * mib}, {"largest_free_bytes": 21 * mib}],
    }
    found = runner.mapped_working_set(LSTM_OOM, {"memory_at_oom": at_failure}, cap)
    assert found is not None
    assert found["largest_free_bytes"] == 36 * mib
    assert "holds 242 MiB" in found["why"] and "mapped 300 MiB" in found["why"]
    # The allocator had room for the request under the cap: not the operator's doing.
    roomy = dict(at_failure, reserved_bytes=200 * mib)
    assert runner.mapped_working_set(LSTM_OOM, {"memory_at_oom": roomy}, cap) is None
    # Something was left that LMS could have paged out.
    inactive = LSTM_OOM.replace("0.00 MiB inactive", "64.00 MiB inactive")
    assert runner.mapped_working_set(inactive, {"memory_at_oom": at_failure}, cap) is None
    # Other storages (not the running operator's) held a page or more.
    others = LSTM_OOM.replace("247.15 MiB is allocated", "290.00 MiB is allocated")
    assert runner.mapped_working_set(others, {"memory_at_oom": at_failure}, cap) is None
    # No picture of the allocator at the failure: no verdict.
    assert runner.mapped_working_set(LSTM_OOM, {}, cap) is None


def test_summary_and_merge(tmp_path: Path) -> None:
    def record(seed: int, cls: str, family: str) -> dict[str, Any]:
        case = dataclasses.replace(generate(seed), family=family)
        return {
            "seed": seed,
            "label": case.label(),
            "case": case.to_dict(),
            "class": cls,
            "reason": "why | not",
            "cap_bytes": GiB,
            "peak_reserved_bytes": 2 * GiB,
            "bound_bytes": GiB // 4,
            "paged_out": True,
            "runs": {"reference-1": {"s_per_iter": 0.1}, "capped": {"s_per_iter": 0.3}},
            "env": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"},
        }

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "results.jsonl").write_text(
        json.dumps(record(0, "identical", "lstm")) + "\n" + json.dumps(record(1, "crash", "lstm"))
    )
    (b / "results.jsonl").write_text(json.dumps(record(2, "identical", "conv3d")) + "\n")
    text = runner.summarize(runner.load_records([a, b]))
    assert "3 cases; gate: **FAIL (1 case(s))**" in text
    assert "| lstm | 2 | 1 | 1 |" in text
    assert runner.replay_command(1) in text
    merged = tmp_path / "merged"
    code = runner.main(["--merge", str(a), str(b), "--out", str(merged)])
    assert code == 1
    assert len((merged / "results.jsonl").read_text().splitlines()) == 3
    assert "device: NVIDIA H100 80GB HBM3 | torch: 2.11.0+cu130" in (
        (merged / "summary.md").read_text()
    )
    (a / "results.jsonl").write_text(json.dumps(record(0, "identical", "lstm")) + "\n")
    assert runner.main(["--merge", str(a), "--out", str(merged)]) == 0


class FakeLauncher(runner.Launcher):
    """Answers every run with a fixed result after a delay, without starting a process."""

    def __init__(self, delay: float) -> None:
        super().__init__(sys.executable, {})
        self.delay = delay
        self.runs: list[str] = []

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        time.sleep(self.delay)
        self.runs.append(request["mode"])
        bound = 1 if request["measure_bound"] else None
        return ok(bound=bound, pageouts=1 if request["mode"] == "capped" else 0)


def test_time_budget_stops_between_cases_and_results_are_incremental(tmp_path: Path) -> None:
    launcher = FakeLauncher(delay=0.05)
    settings = runner.Settings(out=tmp_path, device="cpu")
    messages: list[str] = []
    records = runner.run_suite(list(range(100)), settings, launcher, 1.0, messages.append)
    assert 2 <= len(records) < 100
    assert launcher.runs[:3] == ["reference", "reference", "capped"]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["seed"] for line in lines] == [r["seed"] for r in records]
    assert any(f"--start {len(records)}" in m for m in messages)
    assert "gate: **PASS**" in (tmp_path / "summary.md").read_text()
    # Continuing in the same folder: the summary covers both runs.
    more = runner.run_suite([500, 501], settings, launcher, None, messages.append)
    assert [r["seed"] for r in more] == [500, 501]
    assert f"{len(records) + 2} cases; gate" in (tmp_path / "summary.md").read_text()
    assert len(runner.load_records([tmp_path])) == len(records) + 2


def test_runner_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.regression.stress.runner", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    for option in ("--seeds", "--seed", "--start", "--time-budget-s", "--out", "--python"):
        assert option in out.stdout


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


@pytest.fixture(scope="module")
def fork_launcher() -> Any:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    launcher = runner.make_launcher("fork", sys.executable)
    yield launcher
    launcher.close()


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


def test_worker_trains_a_tiny_case_on_cpu_from_the_command_line(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    case = tiny(generate(0), "resnet_add")
    request = _request(tmp_path, case, "ref")
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
    assert len(result["param_hash"]) == 64
    assert result["bound"]["bytes"] > 0 and result["bound"]["op"].startswith("aten.")
    assert result["env"]["lms_backend"] is None
    assert "torch_lms" not in proc.stderr


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
    assert first.result["param_hash"] == second.result["param_hash"]
    # Through the fork server, or through new interpreters where the server cannot fork
    # safely (a torch that starts threads at import): the results must be the same.
    assert isinstance(fork_launcher, runner.ForkServerLauncher)
    assert first.result["losses"] == second.result["losses"]
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
) -> dict[str, Any]:
    settings = runner.Settings(
        out=tmp_path,
        device="cpu",
        run_timeout_s=timeout,
        faults=faults,
        case_override=lambda c: tiny(c, family),
    )
    return runner.run_case(3, launcher, settings)


@pytest.mark.parametrize(
    ("faults", "cls", "reason"),
    [
        ({}, "identical", "bit-identical"),
        ({"capped": "segv"}, "crash", "SIGSEGV"),
        ({"capped": "abort"}, "crash", "SIGABRT"),
        ({"capped": "exit"}, "crash", "without a result"),
        ({"capped": "cuda-error"}, "crash", "illegal memory access"),
        ({"capped": "oom"}, "oom-unexpected", "fits the cap"),
        ({"capped": "exception"}, "error", "ValueError"),
        ({"reference-2": "perturb"}, "reference-not-repeatable", "references differ"),
        ({"reference-1": "segv"}, "reference-failed", "SIGSEGV"),
    ],
)
def test_runner_classifies_real_worker_processes(
    fork_launcher: runner.Launcher, tmp_path: Path, faults: dict[str, str], cls: str, reason: str
) -> None:
    record = _suite(fork_launcher, tmp_path, faults)
    assert record["class"] == cls, record
    assert reason in record["reason"]
    if cls != "identical":
        assert record["replay"] == runner.replay_command(3)


def test_runner_kills_a_hung_worker(fork_launcher: runner.Launcher, tmp_path: Path) -> None:
    start = time.perf_counter()
    record = _suite(fork_launcher, tmp_path, {"capped": "hang"}, timeout=10)
    assert record["class"] == "crash" and "killed after" in record["reason"]
    assert time.perf_counter() - start < 60


def test_mismatch_is_triaged(fork_launcher: runner.Launcher, tmp_path: Path) -> None:
    record = _suite(fork_launcher, tmp_path, {"capped": "perturb"})
    assert record["class"] == "mismatch"
    triage = record["triage"]
    # Only the first capped run was perturbed: its repeat and the run without LMS are not.
    assert triage["capped_repeat"]["equals"] is False
    assert triage["no_lms"]["equals"] is True
    assert "does not repeat" in triage["verdict"]
    assert "no_cudnn" not in triage  # the MLP has no cuDNN operator


def test_spawn_launcher_reports_a_worker_killed_by_a_signal(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    launcher = runner.make_launcher("spawn", sys.executable)
    case = tiny(generate(0), "mlp_tokens")
    outcome = launcher.launch(_request(tmp_path, case, "segv", fault="segv"), 300)
    assert outcome.returncode == -11
    assert outcome.result is None
    assert run_status(outcome) == ("signal", "killed by SIGSEGV")


def test_fork_launcher_falls_back_to_spawning_when_forked_cuda_fails(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed")
    launcher = runner.make_launcher("fork", sys.executable)
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


def test_only_the_capped_lms_modes_enable_lms() -> None:
    worker = pytest.importorskip("tests.regression.stress.worker")
    assert [m for m in worker.MODES if worker.uses_lms(m)] == ["capped", "capped-no-cudnn"]
    assert [m for m in worker.MODES if worker.is_capped(m)] == [
        "capped",
        "capped-no-lms",
        "capped-no-cudnn",
    ]


def test_mismatch_of_a_cudnn_model_is_triaged_without_cudnn(
    fork_launcher: runner.Launcher, tmp_path: Path
) -> None:
    record = _suite(fork_launcher, tmp_path, {"capped": "perturb"}, family="resnet_add")
    assert record["class"] == "mismatch"
    triage = record["triage"]
    assert triage["reference_no_cudnn"]["status"] == "ok"
    assert triage["no_cudnn"]["equals"] is True
    assert "with cuDNN disabled" in triage["verdict"]
    runs = sorted(p.name for p in (tmp_path / "runs" / "3").glob("*.json"))
    assert "triage-capped-no-cudnn.json" in runs and "triage-reference-no-cudnn.json" in runs


def test_parallel_jobs_run_every_case_once_and_write_each_as_it_finishes(tmp_path: Path) -> None:
    made: list[FakeLauncher] = []

    def make() -> runner.Launcher:
        made.append(FakeLauncher(delay=0.02))
        return made[-1]

    settings = runner.Settings(out=tmp_path, device="cpu")
    messages: list[str] = []
    records = runner.run_suite(
        list(range(12)), settings, FakeLauncher(0.0), None, messages.append, 3, make
    )
    assert [r["seed"] for r in records] == list(range(12))
    assert 1 < len(made) <= 3  # one launcher per job thread
    assert sum(len(launcher.runs) for launcher in made) == 12 * 3
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["seed"] for line in lines) == list(range(12))
    assert "12 cases; gate" in (tmp_path / "summary.md").read_text()
    # A budget stops new cases; what ran is kept and the continuation point is printed.
    more = runner.run_suite(
        list(range(100, 200)), settings, FakeLauncher(0.0), 0.3, messages.append, 3, make
    )
    assert 0 < len(more) < 100
    assert any("--start" in m for m in messages)
