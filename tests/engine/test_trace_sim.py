"""Random operator traces replayed through the LMS engine on the simulated GPU, under faults.

Each seed gives a random training run (``lmsbench/trace_gen.py``); ``trace_replay`` runs it
through the patched caching allocator and the engine on simgpu once per fault plan (none, failing
device allocations, failing pinned host allocations, a device partly taken by another process,
failing copies), each in a process of its own so that a segfault or an abort is seen as a crash
instead of ending the suite. What the engine must do is known from the trace: never crash, never
hand an operator a storage that is not resident, never lose or corrupt a byte, leave nothing
pinned and leak no device or pinned host memory after an error, and run out of memory only where
an unreclaimable working set cannot fit the device (or an injected fault fired). With host
placement (on by default) an operator whose storages cannot all be on the device runs with those
that do not fit kept in pinned host memory, where the engine must say it kept them; only what
runs outside operators (an allocation, a raw access) can run out of memory. Replays with host
placement off check that such an operator raises instead.

A wrong outcome is reported with the commands that regenerate and replay its trace.
``LMS_TRACE_SEEDS`` sets the number of seeds (default 100).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_engine_sim import executable

from lmsbench.trace_gen import FAULT_PLANS, REGIMES, Trace, fault_args, generate

pytestmark = pytest.mark.slow

SEEDS = range(int(os.environ.get("LMS_TRACE_SEEDS", "100")))
TIMEOUT_S = 120  # a trace takes well under a second; a hang is a failure of its own
# Outcomes that are a failure whatever the trace (the replayer's own verdicts and the driver's).
FAILURES = (
    "crash",
    "hang",
    "not_resident",
    "stuck_pin",
    "mismatch",
    "leak",
    "exception",
    "bad_trace",
)
FAULTING_PLANS = ("device_alloc", "host_alloc", "copy")  # the injected fault may be the cause


@dataclass
class Replay:
    """One trace under one fault plan, and what came of it."""

    seed: int
    plan: str
    trace: Trace
    trace_file: Path
    command: list[str]
    result: dict[str, Any]
    output: str
    problem: str | None = None
    gen_args: str = ""  # more trace_gen arguments that regenerate the trace
    placement: bool = True  # host placement on (the engine's default)

    @property
    def outcome(self) -> str:
        return str(self.result["outcome"])

    def reproduce(self) -> str:
        """The commands that regenerate the trace and replay it."""
        gen = (
            f"{sys.executable} -m lmsbench.trace_gen --seed {self.seed} --plan {self.plan} "
            f"{self.gen_args}--out {self.trace_file}"
        )
        return f"{gen}\nSIMGPU_SCRIBBLE=1 {' '.join(self.command)}"


def run_replay(
    binary: Path,
    seed: int,
    plan: str,
    trace: Trace,
    trace_file: Path,
    placement: bool = True,
) -> Replay:
    command = [str(binary), str(trace_file), *fault_args(plan, trace)]
    if not placement:
        command.append("--no-host-placement")
    # SIMGPU_VERBOSE: each failing CUDA call and why, in the output shown for a failure.
    env = {**os.environ, "SIMGPU_SCRIBBLE": "1", "SIMGPU_DEVICE_COUNT": "1", "SIMGPU_VERBOSE": "1"}
    env.pop("SIMGPU_CAPACITY_MB", None)  # the trace sets the capacity
    # Each replay is a simulated GPU of its own, but every simulated GPU has the same UUID:
    # replays run side by side would share the device ledger (and the host's) and wait for
    # one another's memory as LMS processes of one GPU do.
    env["PYTORCH_LMS_DEVICE_LEDGER"] = f"{trace_file}.{plan}.device-ledger"
    env["PYTORCH_LMS_HOST_LEDGER"] = f"{trace_file}.{plan}.host-ledger"
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        out = err.stdout or ""
        output = out.decode(errors="replace") if isinstance(out, bytes) else out
        return Replay(
            seed, plan, trace, trace_file, command, {"outcome": "hang"}, output, None, "", placement
        )
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("trace-result ")]
    if proc.returncode < 0 or not lines:
        how = (
            f"killed by {signal.Signals(-proc.returncode).name}"
            if proc.returncode < 0
            else f"exit {proc.returncode} without a result"
        )
        result: dict[str, Any] = {"outcome": "crash", "message": how}
    else:
        result = json.loads(lines[-1].split(" ", 1)[1])
    return Replay(seed, plan, trace, trace_file, command, result, output, None, "", placement)


def hog_window(replay: Replay) -> tuple[int, int, int]:
    """(bytes, first event, end event) of device memory another process held in this replay."""
    args = fault_args(replay.plan, replay.trace)
    if "--hog-at" not in args:
        return 0, 0, 0
    start = int(args[args.index("--hog-at") + 1])
    end = len(replay.trace.events)
    if "--hog-release-at" in args:
        end = int(args[args.index("--hog-release-at") + 1])
    return int(replay.result.get("hogged", 0)), start, end


def judge(replay: Replay) -> str | None:
    """Why the outcome is wrong for this trace and plan, or None when it is right."""
    outcome = replay.outcome
    message = str(replay.result.get("error", "")).splitlines()[:1]
    message = message[0] if message else ""
    if outcome in FAILURES:
        detail = replay.result.get("detail") or replay.result.get("message", "")
        return f"{outcome}: {detail} (error at event {replay.result.get('event')}: {message})"
    trace, analysis = replay.trace, replay.trace.analysis
    hogged, start, end = hog_window(replay)

    def capacity_at(event: int) -> int:
        return trace.capacity - (hogged if start <= event < end else 0)

    faulted = replay.plan in FAULTING_PLANS and replay.result.get("faults_fired", 0) > 0
    on_host = set(replay.result.get("host_events", [])) if replay.placement else set()
    if outcome == "ok":
        # Completing an event whose unreclaimable bytes exceed the device means an operator ran
        # on storages that were not all resident: the bug class LMS exists to rule out, unless
        # the engine kept what did not fit in host memory for it (host placement), which the
        # replayer checks storage by storage.
        over = [e for e, n in enumerate(analysis.need) if n > capacity_at(e) and e not in on_host]
        if over:
            e = over[0]
            return (
                f"completed, but event {e} ({trace.events[e].line()}) needs "
                f"{analysis.need[e]} bytes on a device of {capacity_at(e)}"
                + (", and nothing was kept in host memory for it" if replay.placement else "")
            )
        return None
    if outcome not in ("oom", "error"):
        return f"unknown outcome {outcome!r}: {message}"
    if faulted:
        return None  # a clean error caused by an injected fault
    if outcome == "error":
        return f"c10::Error without an injected fault at event {replay.result['event']}: {message}"
    e = int(replay.result["event"])
    if not 0 <= e < len(trace.events):
        return f"out of memory outside the trace (event {e}): {message}"
    if replay.placement and trace.events[e].kind in ("op", "side_stream"):
        return (
            f"out of memory at event {e} ({trace.events[e].line()}), an operator, although host "
            f"placement keeps what does not fit on the device in host memory: {message}"
        )
    if analysis.bound[e] <= capacity_at(e):
        return (
            f"out of memory at event {e} ({trace.events[e].line()}) although its unreclaimable "
            f"storages fit in {analysis.bound[e]} bytes of allocator segments on a device of "
            f"{capacity_at(e)}: {message}"
        )
    return None


def replay_seeds(
    binary: Path, folder: Path, seeds: range, gen_args: str = "", **generate_args: Any
) -> list[Replay]:
    """Generates each seed's trace (``generate_args`` for ``generate``, ``gen_args`` the same
    as trace_gen options for the reproduce command) and replays it under every fault plan,
    judged."""
    jobs = []
    for seed in seeds:
        trace = generate(seed, **generate_args)
        trace_file = folder / f"seed{seed}.trace"
        trace_file.write_text(trace.text())
        jobs += [(seed, plan, trace, trace_file) for plan in FAULT_PLANS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = list(pool.map(lambda job: run_replay(binary, *job), jobs))
    for replay in done:
        replay.gen_args = gen_args
        replay.problem = judge(replay)
    return done


def wrong_report(wrong: list[Replay]) -> str:
    """The first few wrongly ended replays, each with the commands that reproduce it."""
    return "\n\n".join(
        f"seed {r.seed}, plan {r.plan} ({r.trace.family}, {r.trace.optimizer}, "
        f"{r.trace.regime}): {r.problem}\n{r.reproduce()}\n{r.output[-3000:]}"
        for r in wrong[:5]
    )


@pytest.fixture(scope="module")
def replays(sim_build: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Replay]:
    binary = executable(sim_build, "trace_replay")
    return replay_seeds(binary, tmp_path_factory.mktemp("traces"), SEEDS)


def summary(replays: list[Replay]) -> str:
    """Outcome counts per fault plan, the wrongly ended replays, those that paged out and those
    whose operators found storages kept in host memory."""
    outcomes = ("ok", "oom", "error", *FAILURES)
    rows = [
        f"{'plan':<13}"
        + "".join(f"{o:>13}" for o in outcomes)
        + f"{'wrong':>8}{'paged':>8}{'on host':>9}"
    ]
    for plan in dict.fromkeys(r.plan for r in replays):
        mine = [r for r in replays if r.plan == plan]
        counts = Counter(r.outcome for r in mine)
        wrong = sum(r.problem is not None for r in mine)
        paged = sum(r.result.get("pageouts", 0) > 0 for r in mine)
        on_host = sum(r.result.get("input_host_placements", 0) > 0 for r in mine)
        rows.append(
            f"{plan:<13}"
            + "".join(f"{counts.get(o, 0):>13}" for o in outcomes)
            + f"{wrong:>8}{paged:>8}{on_host:>9}"
        )
    return "\n".join(rows)


@pytest.mark.parametrize("plan", FAULT_PLANS)
def test_every_trace_ends_as_its_needs_say(
    replays: list[Replay], plan: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No crash, hang, wrong data, stuck pin or leak; out of memory only where it may be."""
    mine = [r for r in replays if r.plan == plan]
    with capsys.disabled():  # the plan's row of the summary table, also when it passes
        table = summary(mine).splitlines()
        print(f"\n{len(SEEDS)} seeds, fault plan {plan}:\n{table[0]}\n{table[1]}")
    wrong = [r for r in mine if r.problem is not None]
    assert not wrong, (
        f"{len(wrong)} of {len(mine)} replays went wrong:\n{summary(replays)}\n\n"
        f"{wrong_report(wrong)}"
    )


def test_lms_paged_in_most_completed_traces(replays: list[Replay]) -> None:
    """The traces exercise paging: a run that never pages out proves little."""
    done = [r for r in replays if r.plan == "none" and r.outcome == "ok"]
    paged = [r for r in done if r.result["pageouts"] > 0 and r.result["pageins"] > 0]
    assert len(done) >= len(SEEDS) // 2, summary(replays)
    assert len(paged) > 0.8 * len(done), (
        f"only {len(paged)} of {len(done)} completed traces paged out and in"
    )


def test_traces_over_capacity_keep_what_does_not_fit_on_the_host(replays: list[Replay]) -> None:
    """Host placement on: an operator whose storages cannot all be on the device runs with the
    ones that do not fit kept in host memory (judge() checks every event over the capacity).
    Such a trace ends, or runs out of memory where an allocation or raw access outside an
    operator cannot fit (often its first allocation, whose segment the device cannot hold); each
    that got past its first event over the capacity kept storages on the host."""
    over = [r for r in replays if r.plan == "none" and r.trace.regime == "over"]
    assert over, f"no seed in {SEEDS} has the regime 'over' of {REGIMES}"
    wrong = [
        (r.seed, r.outcome, r.result.get("event"))
        for r in over
        if r.outcome not in ("ok", "oom")
        or (
            r.outcome == "oom"
            and r.trace.events[int(r.result["event"])].kind in ("op", "side_stream")
        )
    ]
    assert not wrong, f"(seed, outcome, event): {wrong}"
    first_over = {r.seed: r.trace.analysis.first_over(r.trace.capacity) for r in over}
    reached = [
        r for r in over if r.outcome == "ok" or int(r.result["event"]) > int(first_over[r.seed])
    ]
    assert reached, f"no trace over capacity in {SEEDS} ran past its first event over it"
    unkept = [r.seed for r in reached if r.result.get("input_host_placements", 0) == 0]
    assert not unkept, f"seeds that ran past an event over capacity keeping nothing: {unkept}"


@pytest.fixture(scope="module")
def unplaced_replays(replays: list[Replay], sim_build: Path) -> list[Replay]:
    """The traces over capacity once more, without faults and with host placement off."""
    binary = executable(sim_build, "trace_replay")
    over = [r for r in replays if r.plan == "none" and r.trace.regime == "over"]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = list(
            pool.map(
                lambda r: run_replay(binary, r.seed, r.plan, r.trace, r.trace_file, False), over
            )
        )
    for replay in done:
        replay.problem = judge(replay)
    return done


def test_traces_over_capacity_run_out_of_memory_without_host_placement(
    unplaced_replays: list[Replay],
) -> None:
    """Host placement off: where an operator's working set cannot fit, LMS raises
    OutOfMemoryError, nothing else, and keeps nothing in host memory."""
    assert unplaced_replays, f"no seed in {SEEDS} has the regime 'over' of {REGIMES}"
    first_over = {r.seed: r.trace.analysis.first_over(r.trace.capacity) for r in unplaced_replays}
    wrong = [
        (r.seed, r.outcome, r.result.get("event"), first_over[r.seed], r.problem)
        for r in unplaced_replays
        if r.problem is not None
        or r.outcome != "oom"
        or int(r.result["event"]) > int(first_over[r.seed] or -1)
        or r.result.get("input_host_placements", 0) != 0
    ]
    assert not wrong, f"(seed, outcome, event, first event over capacity, problem): {wrong}"


def test_fault_plans_inject_faults(replays: list[Replay]) -> None:
    """A plan whose faults never fire tests nothing: each must fire in most of its runs."""
    for plan in FAULTING_PLANS:
        mine = [r for r in replays if r.plan == plan]
        fired = [r for r in mine if r.result.get("faults_fired", 0) > 0]
        assert len(fired) > 0.8 * len(mine), f"{plan}: faults fired in {len(fired)}/{len(mine)}"
    hogged = [r for r in replays if r.plan == "device_full" and r.result.get("hogged", 0) > 0]
    assert len(hogged) > 0.8 * len(SEEDS), f"device_full took memory in {len(hogged)} runs"


# Hand-made traces that put one injected copy failure where it matters. Limit 512 KiB, storages
# of 256 KiB: allocating storage 2 pages out storage 0 (copy 1), storage 3 pages out 1 (copy 2).
PAGING = """\
meta capacity=67108864 limit=524288 threshold=65536 prefetch={prefetch} speculative=0
alloc 0 262144 main
op w0 inputs=[] outputs=[0]
alloc 1 262144 main
op w1 inputs=[] outputs=[1]
alloc 2 262144 main
op w2 inputs=[] outputs=[2]
alloc 3 262144 main
op w3 inputs=[] outputs=[3]
free 2
free 3
op r1 inputs=[1] outputs=[]
op r0 inputs=[0] outputs=[]
free 0
free 1
"""


@pytest.mark.parametrize(
    ("prefetch", "failing_copy", "expected", "what"),
    [
        (0, 1, "error", "page-out of storage 0 while allocating storage 2"),
        (0, 2, "error", "page-out of storage 1 while allocating storage 3"),
        (0, 3, "error", "page-in of storage 1 for operator r1"),
        # A prefetch is speculative: its failure leaves the storage paged out for an
        # on-demand page-in and does not fail the operator that triggered it.
        (1, 4, "ok", "prefetch of storage 0 after operator r1 paged storage 1 in"),
    ],
)
def test_a_failed_copy_loses_pins_and_leaks_nothing(
    sim_build: Path, tmp_path: Path, prefetch: int, failing_copy: int, expected: str, what: str
) -> None:
    """The copy fails, and the operator gets a c10::Error (or, for a prefetch, runs); afterwards
    nothing may stay pinned, every byte must read back and every device and pinned host byte
    must be returned."""
    trace_file = tmp_path / "paging.trace"
    trace_file.write_text(PAGING.format(prefetch=prefetch))
    replayer = executable(sim_build, "trace_replay")
    proc = subprocess.run(
        [str(replayer), str(trace_file), "--fail-copy-every", str(failing_copy)],
        capture_output=True,
        text=True,
        env={**os.environ, "SIMGPU_SCRIBBLE": "1"},
        timeout=TIMEOUT_S,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("trace-result "))
    result = json.loads(line.split(" ", 1)[1])
    assert result["faults_fired"] == 1, result
    assert (result["outcome"], result["detail"]) == (expected, ""), f"failed {what}: {result}"
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_checks_see_a_byte_changed_behind_lms(sim_build: Path, tmp_path: Path) -> None:
    """The data check is live: a byte flipped in storage 0 before it is paged out and in again is
    reported as a mismatch by the operator that reads it (r0, event 11)."""
    trace_file = tmp_path / "paging.trace"
    trace_file.write_text(PAGING.format(prefetch=0))
    replayer = executable(sim_build, "trace_replay")
    proc = subprocess.run(
        [str(replayer), str(trace_file), "--corrupt-after", "1", "--corrupt-id", "0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    result = json.loads(proc.stdout.splitlines()[-1].split(" ", 1)[1])
    assert result["outcome"] == "mismatch", result
    assert "event 11 (r0): storage 0 differs" in result["detail"], result
    # Storages 0 and 1 are paged out to make room for 2 and 3. Then r0, an operator not seen
    # before, is expected to need three times its 256 KiB input, over 3/4 of the 512 KiB limit:
    # it is packed first, which pages out storage 1 (inactive after r1) once more.
    assert result["pageouts"] == 3 and result["pageins"] == 2, result
    assert proc.returncode == 1


def test_a_crashing_replay_is_reported_as_a_crash(tmp_path: Path) -> None:
    """A replayer killed by a signal (or gone without its result line) is a crash, not a pass."""
    trace = generate(0)
    trace_file = tmp_path / "seed0.trace"
    trace_file.write_text(trace.text())
    for body, how in (("kill -SEGV $$", "killed by SIGSEGV"), ("exit 0", "exit 0 without")):
        fake = tmp_path / "fake_replay"
        fake.write_text(f"#!/bin/sh\n{body}\n")
        fake.chmod(0o755)
        replay = run_replay(fake, 0, "none", trace, trace_file)
        assert replay.outcome == "crash", replay.result
        assert how in replay.result["message"]
        assert judge(replay) is not None


# Training runs whose iterations repeat (the same operators and sizes after the optimizer's
# first step), so that the learned swap schedule becomes active: its early page-outs, Belady
# victims and page-ins ahead then run under the same fault plans and the same judgement.
SCHEDULE_SEEDS = range(int(os.environ.get("LMS_SCHEDULE_TRACE_SEEDS", "40")))
SCHEDULE_ITERATIONS = 5


@pytest.fixture(scope="module")
def schedule_replays(sim_build: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Replay]:
    return replay_seeds(
        executable(sim_build, "trace_replay"),
        tmp_path_factory.mktemp("schedule-traces"),
        SCHEDULE_SEEDS,
        gen_args=f"--iterations {SCHEDULE_ITERATIONS} --repeat ",
        iterations=SCHEDULE_ITERATIONS,
        repeat=True,
    )


def test_repeating_traces_with_the_learned_schedule_end_as_their_needs_say(
    schedule_replays: list[Replay], capsys: pytest.CaptureFixture[str]
) -> None:
    """The learned schedule active, under every fault plan: no crash, hang, wrong data, stuck
    pin or leak, out of memory only where it may be; and the schedule did act."""
    with capsys.disabled():
        print(f"\n{len(SCHEDULE_SEEDS)} repeating seeds:\n{summary(schedule_replays)}")
    wrong = [r for r in schedule_replays if r.problem is not None]
    assert not wrong, (
        f"{len(wrong)} of {len(schedule_replays)} replays went wrong:\n{wrong_report(wrong)}"
    )
    done = [r for r in schedule_replays if r.plan == "none" and r.outcome == "ok"]
    learned = [r for r in done if r.result.get("schedule_detections", 0) > 0]
    acted = [
        r
        for r in learned
        if r.result.get("schedule_victims", 0) + r.result.get("early_pageouts", 0) > 0
    ]
    assert len(learned) > 0.8 * len(done), (
        f"the schedule was learned in {len(learned)} of {len(done)} completed traces"
    )
    assert acted, "the learned schedule chose no victim and paged nothing out early"


def test_schedule_replay_benchmark_counts_demand_page_ins(
    sim_build: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/engine/schedule_replay.py replays repeating traces with a replayer given
    twice and prints one row per replayer, the second's ratio to the first."""
    from benchmarks.engine import schedule_replay

    binary = executable(sim_build, "trace_replay")
    argv = ["--replayer", str(binary), "--replayer", str(binary), "--seeds", "4"]
    status = schedule_replay.main([*argv, "--iterations", "6"])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line for line in out.splitlines() if line.startswith(f"| {binary} |")]
    assert len(rows) == 2, out
    cells = [int(c) for c in rows[0].strip("|").split("|")[1:5]]
    pageouts, pageins, ahead, demand = cells
    assert pageouts > 0 and pageins > 0, "the traces did not page anything out"
    assert demand == pageins - ahead >= 0
