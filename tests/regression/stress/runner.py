"""Runs stress cases, classifies them and writes the results; exits nonzero when the gate fails.

Runs of a case, each a process of its own (a crash ends one run only):

- ``reference-1`` and ``reference-2``: uncapped, without LMS; the first also measures the
  case's peak reserved memory and the bound (below);
- ``capped``: LMS on (default settings) under a cap of ``cap_fraction`` x that peak;
- ``capped-no-lms``: the same cap without LMS (does the cap bind?).

The capped runs start only when both references trained. Every run of a case uses one
allocator setting, the one the capped run uses, passed to it in ``PYTORCH_CUDA_ALLOC_CONF``
(and recorded by each run as the setting it ran with): ``expandable_segments`` as the
environment's ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) gives it, else on, as
LMS sets it when enabled (``set_enabled_lms``, both builds), or as ``--expandable-segments``
says.

The bound, measured in ``reference-1`` (one more iteration after the measured ones, under a
dispatch mode that sees each ATen operator below autograd): the largest working set of one
operator call, that is its inputs plus the most it had allocated at once (outputs and
temporaries), or its inputs and outputs, whichever is larger. It is kept in tensor bytes
(``bound_bytes``) and as the caching allocator maps it at least (``mapped_bound_bytes``):
``allocator.mapped_together`` of the operator's tensors (its inputs, the outputs it
allocated, and the rest of what it had allocated at once counted as one allocation), which
puts a tensor of at most 1 MiB in 512-byte blocks and the larger ones each in a segment
rounded up to 2 MiB (fixed segments) or packed in the 20 MiB pages of expandable segments,
with the setting the capped run uses: the most compact placement there is, so that an
out-of-memory error that only a worse placement explains counts as unexpected. Both add the
library workspaces (cuBLAS, cuDNN) the process keeps from their first use
(``library_bytes``; mapped as one allocation).

The rules (nothing LMS says about itself, in messages, warnings or counters, decides a class;
its page-out counter only keeps a case out of the count, never excuses a failure):

- the cap binds when the capped run without LMS runs out of memory and, where the capped LMS
  run trained, LMS paged out at least once (``lms.pageout_count`` > 0);
- ``oom-expected``: the capped LMS run ran out of memory, the capped run without LMS did not
  train, and ``mapped_bound_bytes`` exceeds the cap, measured with the ``expandable_segments``
  setting that the capped run recorded it ran with;
- ``oom-unexpected``: any other out-of-memory error of the capped LMS run;
- ``identical``: the cap binds and the capped LMS run's parameters, buffers (BatchNorm
  running statistics) and losses all equal the references', which equal each other;
- ``mismatch``: the references agree and the capped LMS run trained with different
  parameters, buffers or losses (the reason says which, and from which iteration the losses
  differ); triage re-runs it (the capped run repeated, for models with cuDNN operators the
  case with cuDNN disabled, and where the capped run had LMS's recompute on, the capped run
  with it off) and prints a verdict, as information only;
- ``reference-not-repeatable``: the references differ in parameters, buffers or losses;
- ``cap-not-binding``: the capped LMS run trained without a mismatch, but the cap does not
  bind: reported, not counted among the cases;
- ``crash``: killed by a signal, a CUDA error, no result, or hung;
- ``error``: another exception in the capped LMS run;
- ``reference-failed``: a reference run did not train (the case is invalid).

Gate: every record is judged (a seed run again keeps its earlier records). It fails on any
record of class ``crash``, ``error``, ``mismatch``, ``oom-unexpected`` or
``reference-failed`` (or of a class it does not know, such as ``mismatch-explained`` of older
results), and when no case where the cap binds was run. The case count it quotes leaves out
``cap-not-binding``.

Throughput: a run's own process costs an interpreter start and ``import torch`` (seconds).
By default one fork server (``worker --serve``) imports torch once and forks a fresh child
per run; the child sets its allocator setting and initializes CUDA itself (the server never
does), so every run still has its own process and CUDA context. ``--launcher spawn`` starts
a new interpreter per run. Either way a run has a process group of its own, killed whole at
``--run-timeout-s``, and the records follow the shared schema of ``lmsbench/harness.py``
(its provenance fields, atomic JSON, markdown tables); the classes and the gate are
``lmsbench/stress_gate.py``'s.

Output in ``--out``: ``results.jsonl`` (one line per case and attempt, appended as each
finishes, with its attempt number, time, and provenance: engine commit, dirty flag, engine
sources hash, torch, CUDA, cuDNN, driver, device), ``summary.md`` (rewritten after each
case), ``runs/SEED/`` (each run's JSON result and log; ``runs/SEED/attempt-N/`` for a
seed's later attempts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lmsbench import harness
from lmsbench.stress_gate import (
    CLASSES,
    GATE_FAILURES,
    counted,
    gate_failures,
    gate_verdict,
    load_records,
    record_order,
    results_file,
)

from .allocator import conf_with_expandable, expandable_in_conf, user_conf
from .generator import Case, generate

REPO_ROOT = Path(__file__).resolve().parents[3]
WORKER_MODULE = "tests.regression.stress.worker"
RUNNER_MODULE = "tests.regression.stress.runner"

CUDNN_FAMILIES = ("resnet_add", "densenet_cat", "conv3d", "lstm")
PIN_FAILURE_MARKER = "could not all be made resident"
GiB = float(1 << 30)
# Provenance and versions every record and the summary header carry: the shared record
# schema's, and cuDNN's version.
PROVENANCE_KEYS = (*harness.RECORD_PROVENANCE, "cudnn")


@dataclass
class Outcome:
    """What became of one worker run."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    result: dict[str, Any] | None
    log_tail: str

    def to_dict(self) -> dict[str, Any]:
        """A compact JSON-ready summary (the full result stays in runs/)."""
        r = self.result or {}
        out: dict[str, Any] = {
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "wall_s": self.wall_s,
            "status": run_status(self)[0],
        }
        for key in (
            "param_hash",
            "buffer_hash",
            "losses",
            "s_per_iter",
            "peak_reserved_bytes",
            "peak_allocated_bytes",
            "lms",
            "lms_limit_bytes",
            "bound",
        ):
            if key in r:
                out[key] = r[key]
        allocator = r.get("allocator")
        if isinstance(allocator, dict):
            out["allocator"] = {
                k: allocator[k]
                for k in ("expandable_segments", "source", "error")
                if k in allocator
            }
        if "exception" in r:
            exc = r["exception"]
            out["exception"] = {
                "type": exc.get("type"),
                "message": str(exc.get("message", ""))[:600],
            }
        if out["status"] != "ok":
            out["log_tail"] = self.log_tail[-1500:]
        return out


def run_status(outcome: Outcome | None) -> tuple[str, str]:
    """The status of one run and a one-line reason.

    Statuses: ``ok``; ``oom`` (the run raised an out-of-memory error); ``error`` (a Python
    exception that is neither an out-of-memory error nor a CUDA error); crash statuses
    ``signal``, ``cuda-error``, ``hang``, ``no-result`` (exited without writing its result),
    ``exit`` (wrote a result but exited nonzero); ``not-run``. An LMS warning that an
    operator's inputs could not be made resident is quoted in the reason; it changes no
    status.
    """
    if outcome is None:
        return "not-run", "not run"
    pin = _pin_failure(outcome)
    suffix = f" after an LMS pin failure ({pin})" if pin else ""
    if outcome.timed_out:
        return "hang", f"killed after {outcome.wall_s:.0f} s without finishing{suffix}"
    code = outcome.returncode
    if code is not None and code < 0:
        return "signal", f"killed by {harness.signal_name(-code)}{suffix}"
    result = outcome.result
    if result is None:
        return "no-result", f"exited with status {code} without a result{suffix}"
    if result.get("status") == "exception":
        exc = result.get("exception", {})
        text = f"{exc.get('type', '?')}: {harness.first_line(exc.get('message', ''))}"
        if exc.get("is_oom"):
            return "oom", text
        if exc.get("is_cuda_error"):
            return "cuda-error", text + suffix
        return "error", text + suffix
    if result.get("status") != "ok":
        return "no-result", f"result status {result.get('status')!r}, exit status {code}{suffix}"
    if code != 0:
        return "exit", f"trained, then exited with status {code}{suffix}"
    return "ok", "trained"


CRASH_STATUSES = ("signal", "cuda-error", "hang", "no-result", "exit")


def _pin_failure(outcome: Outcome) -> str:
    """The LMS warning that an operator's inputs could not be made resident, if one was given
    (quoted in reasons only). Looks in the warnings of the run's result and in its log."""
    lines = list((outcome.result or {}).get("warnings") or [])
    lines += outcome.log_tail.splitlines()
    for line in lines:
        if PIN_FAILURE_MARKER in line:
            start = line.find("the inputs of")
            text = line[start:] if start >= 0 else line
            end = text.find(" could not")
            return text[:end] if end > 0 else text[:120]
    return ""


def oom_reason(message: str) -> str:
    """Which allocator ran out and for what, from an out-of-memory message (for the reason
    text only)."""
    first = harness.first_line(message, 200)
    if "Large Model Support" in message:
        return f"LMS out of memory ({first})"
    if "CUDNN" in message or "CUBLAS" in message:
        return f"library workspace ({first})"
    return f"allocator: {first}"


def _loss_keys(losses: Any) -> list[str]:
    """Losses as exact, comparable keys (``float.hex``: NaN equals NaN, -0.0 differs from 0.0)."""
    return [float(x).hex() for x in (losses or [])]


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What two trained runs' results differ in: ``parameters``, ``buffers`` (their SHA-256
    hashes; one missing from either counts as a difference) and ``losses`` (exactly)."""
    found = []
    for name, key in (("parameters", "param_hash"), ("buffers", "buffer_hash")):
        x, y = a.get(key), b.get(key)
        if x is None or y is None or x != y:
            found.append(name)
    if _loss_keys(a.get("losses")) != _loss_keys(b.get("losses")):
        found.append("losses")
    return found


def _first_difference(a: list[float] | None, b: list[float] | None) -> int | None:
    keys_a, keys_b = _loss_keys(a), _loss_keys(b)
    for i, (x, y) in enumerate(zip(keys_a, keys_b)):
        if x != y:
            return i
    if len(keys_a) != len(keys_b):
        return min(len(keys_a), len(keys_b))
    return None


def _setting(value: Any) -> str:
    if value is True:
        return "on"
    if value is False:
        return "off"
    return "unknown"


def cap_binds(no_lms: Outcome | None, lms_trained: bool, pageouts: int) -> tuple[bool, str]:
    """Whether the cap binds, and why not: the capped run without LMS must run out of memory,
    and a capped LMS run that trained must have paged out."""
    status, reason = run_status(no_lms)
    if status == "ok":
        return False, "the same cap without LMS trains"
    if status != "oom":
        return False, f"the same cap without LMS did not run out of memory ({status}: {reason})"
    if lms_trained and pageouts <= 0:
        return False, "LMS paged nothing out"
    return True, "the same cap without LMS runs out of memory"


def classify(
    ref1: Outcome | None,
    ref2: Outcome | None,
    capped: Outcome | None,
    no_lms: Outcome | None,
    cap_bytes: int | None,
) -> dict[str, Any]:
    """The class of a case from its runs, with the reason and the figures behind it (the
    rules are in this module's docstring)."""
    info: dict[str, Any] = {}
    for name, run in (("reference 1", ref1), ("reference 2", ref2)):
        status, reason = run_status(run)
        if status != "ok":
            return {"class": "reference-failed", "reason": f"{name}: {reason}"}
    assert ref1 is not None and ref2 is not None
    r1, r2 = ref1.result or {}, ref2.result or {}
    measured = r1.get("bound") or {}
    raw = measured.get("bytes")
    mapped = measured.get("mapped_bytes")
    library = int(measured.get("library_bytes") or 0)
    library_mapped = int(measured.get("library_mapped_bytes") or library)
    info["bound_bytes"] = raw + library if raw is not None else None
    info["mapped_bound_bytes"] = mapped + library_mapped if mapped is not None else None
    info["library_bytes"] = library
    info["bound_op"] = measured.get("op")
    info["mapped_bound_op"] = measured.get("mapped_op")
    info["largest_alloc_bytes"] = measured.get("largest_alloc_bytes")
    info["bound_expandable_segments"] = measured.get("expandable_segments")
    mapped_bound = info["mapped_bound_bytes"]
    info["mapped_bound_exceeds_cap"] = bool(mapped_bound and cap_bytes and mapped_bound > cap_bytes)
    ref_diff = differences(r1, r2)
    info["references_agree"] = not ref_diff
    info["no_lms_status"] = run_status(no_lms)[0]
    status, reason = run_status(capped)
    if status == "not-run":
        return {"class": "reference-failed", "reason": "the capped run was not started", **info}
    assert capped is not None
    c = capped.result or {}
    info["capped_expandable_segments"] = (c.get("allocator") or {}).get("expandable_segments")
    pageouts = int((c.get("lms") or {}).get("pageout_count") or 0)
    info["pageout_count"] = pageouts
    info["paged_out"] = pageouts > 0
    binds, why = cap_binds(no_lms, status == "ok", pageouts)
    info["cap_binds"] = binds
    info["cap_binding"] = why
    if status in CRASH_STATUSES:
        return {"class": "crash", "reason": f"{status}: {reason}", **info}
    if status == "error":
        return {"class": "error", "reason": reason, **info}
    if status == "oom":
        return _classify_oom(c, reason, cap_bytes, info)
    diff = differences(r1, c)
    info["differences"] = diff
    info["first_loss_difference"] = _first_difference(r1.get("losses"), c.get("losses"))
    if not ref_diff and diff:
        step = info["first_loss_difference"]
        where = f"losses differ from iteration {step}" if step is not None else "losses equal"
        return {
            "class": "mismatch",
            "reason": f"{', '.join(diff)} differ from the repeatable references; {where}",
            **info,
        }
    if not binds:
        return {"class": "cap-not-binding", "reason": f"the cap does not bind: {why}", **info}
    if ref_diff:
        same = [
            name for name, r in (("reference 1", r1), ("reference 2", r2)) if not differences(r, c)
        ]
        note = f"capped equals {' and '.join(same)}" if same else "capped equals neither"
        return {
            "class": "reference-not-repeatable",
            "reason": f"the two references differ in {', '.join(ref_diff)}; {note}",
            **info,
        }
    return {
        "class": "identical",
        "reason": "parameters, buffers and losses bit-identical",
        **info,
    }


def _classify_oom(
    capped: dict[str, Any], reason: str, cap_bytes: int | None, info: dict[str, Any]
) -> dict[str, Any]:
    """``oom-expected`` or ``oom-unexpected`` for a capped LMS run that ran out of memory."""
    message = str(capped.get("exception", {}).get("message", "")) or reason
    bound, mapped = info["bound_bytes"], info["mapped_bound_bytes"]
    measured_with = info["bound_expandable_segments"]
    ran_with = info["capped_expandable_segments"]
    figures = (
        f"the largest operator working set as mapped ({_fmt_gib(mapped) or '?'} GiB, "
        f"{info['mapped_bound_op']}; {_fmt_gib(bound) or '?'} GiB in tensor bytes, "
        f"{info['bound_op']}; expandable segments {_setting(measured_with)}) "
        + ("exceeds" if info["mapped_bound_exceeds_cap"] else "fits")
        + f" the cap ({_fmt_gib(cap_bytes) or '?'} GiB)"
    )
    expected = False
    if info["no_lms_status"] == "ok":
        why = f"the same cap without LMS trains; {figures}"
    elif mapped is None or not cap_bytes:
        why = "no bound or no cap was measured"
    elif not isinstance(ran_with, bool) or measured_with != ran_with:
        why = (
            f"the bound was measured with expandable segments {_setting(measured_with)}, the "
            f"capped run ran with them {_setting(ran_with)}: it does not apply; {figures}"
        )
    else:
        expected = info["mapped_bound_exceeds_cap"]
        why = figures
    return {
        "class": "oom-expected" if expected else "oom-unexpected",
        "reason": f"{oom_reason(message)}; {why}",
        **info,
    }


class Launcher:
    """Starts worker runs; ``launch`` returns their :class:`Outcome`."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python = python
        self.env = env

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        raise NotImplementedError

    def close(self) -> None:
        """Releases whatever the launcher holds."""


def _read_outcome(request: dict[str, Any], run: harness.ProcessRun) -> Outcome:
    """The outcome of a run: how its process ended, its result and the end of its log."""
    result = harness.read_json(Path(request["result"]))
    tail = harness.log_tail(Path(request["log"]))
    return Outcome(run.returncode, run.timed_out, round(run.wall_s, 3), result, tail)


class SpawnLauncher(Launcher):
    """A new interpreter per run (``python -m tests.regression.stress.worker --request``), in
    a process group of its own, killed whole at the time limit (``harness.run_process``)."""

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        request_path = Path(request["result"]).with_suffix(".request.json")
        request_path.write_text(json.dumps(request))
        command = [self.python, "-m", WORKER_MODULE, "--request", str(request_path)]
        run = harness.run_process(
            command, Path(request["log"]), self.env, timeout_s, cwd=REPO_ROOT, grace_s=0
        )
        return _read_outcome(request, run)


FORK_BROKEN_MARKERS = (
    "initialization error",
    "Cannot re-initialize CUDA in forked subprocess",
    "CUDA driver initialization failed",
)


class ForkServerLauncher(Launcher):
    """One ``worker --serve`` process that forks a fresh child per run.

    Should a forked child ever fail to initialize CUDA (the server must not have initialized
    it), the launcher falls back to :class:`SpawnLauncher` for that run and every later one.
    """

    def __init__(self, python: str, env: dict[str, str]) -> None:
        super().__init__(python, env)
        self.proc: subprocess.Popen[str] | None = None
        self.fallback: SpawnLauncher | None = None

    def _start(self) -> subprocess.Popen[str]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.proc = subprocess.Popen(
            [self.python, "-m", WORKER_MODULE, "--serve"],
            cwd=REPO_ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready:
            code = self.proc.wait()
            self.proc = None
            raise RuntimeError(f"the worker fork server exited with status {code} at start")
        state = json.loads(ready)
        if state.get("cuda_initialized"):
            self.close()
            raise RuntimeError("the worker fork server initialized CUDA before forking")
        if state.get("threads", 1) > 1:
            # A child forked from a multithreaded process may inherit a held lock and hang.
            self.close()
            raise RuntimeError(f"the worker fork server runs {state['threads']} threads")
        return self.proc

    def _use_spawn(self, why: str) -> SpawnLauncher:
        print(f"warning: {why}; starting a new interpreter per run from now on", file=sys.stderr)
        self.close()
        self.fallback = SpawnLauncher(self.python, self.env)
        return self.fallback

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        if self.fallback is not None:
            return self.fallback.launch(request, timeout_s)
        try:
            self._start()
        except RuntimeError as exc:
            return self._use_spawn(str(exc)).launch(request, timeout_s)
        outcome = self._launch(request, timeout_s)
        if run_status(outcome)[0] != "ok" and any(
            marker in outcome.log_tail for marker in FORK_BROKEN_MARKERS
        ):
            spawn = self._use_spawn("a forked worker could not initialize CUDA")
            return spawn.launch(request, timeout_s)
        return outcome

    def _launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        start = time.perf_counter()
        line = ""
        try:
            proc.stdin.write(json.dumps({**request, "timeout_s": timeout_s}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            # The server itself died: count the run as one without an exit status, start
            # a new server for the next run.
            self.close()
            return _read_outcome(
                request, harness.ProcessRun(None, False, time.perf_counter() - start)
            )
        answer = json.loads(line)
        run = harness.ProcessRun(answer["returncode"], bool(answer["timed_out"]), answer["wall_s"])
        return _read_outcome(request, run)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                proc.stdin.flush()
                proc.stdin.close()
            proc.wait(timeout=30)
        except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def make_launcher(kind: str, python: str) -> Launcher:
    """The launcher ``kind`` (``fork`` or ``spawn``) with the workers' environment."""
    env = harness.worker_env(deterministic=True)
    if kind == "fork":
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        return ForkServerLauncher(python, env)
    if kind == "spawn":
        return SpawnLauncher(python, env)
    raise ValueError(f"unknown launcher {kind!r}")


@dataclass
class Settings:
    """How cases are run (the runner's command-line options)."""

    out: Path
    device: str = "cuda"
    run_timeout_s: float = 120.0
    triage: bool = True
    # The allocator's expandable segments in every run of a case; None: resolved by run_suite
    # on CUDA (resolve_expandable_segments), left to each run's environment on the CPU.
    expandable_segments: bool | None = None
    allocator_source: str = ""  # why that setting
    provenance: dict[str, Any] | None = None  # None: run_suite (or run_case) finds it
    faults: dict[str, str] | None = None  # run name -> fault, for the runner's tests
    case_override: Callable[[Case], Case] | None = None  # for the runner's tests
    cap_bytes: int | None = None  # for the runner's tests: this cap instead of the case's


def checkout_provenance() -> dict[str, Any]:
    """What this checkout's results are measured with: the provenance of the shared record
    schema (``harness.provenance``: engine commit, dirty flag, engine sources hash, driver;
    ``LMS_ENGINE_COMMIT`` and ``LMS_ENGINE_DIRTY`` override git for a copy whose .git is
    stale)."""
    return dict(harness.provenance(REPO_ROOT))


def resolve_expandable_segments(env: Mapping[str, str]) -> tuple[bool, str]:
    """The ``expandable_segments`` setting the capped LMS run uses, and why: as the
    environment's allocator setting gives it, else on, as ``set_enabled_lms`` sets it in both
    builds when the user did not choose."""
    chosen = expandable_in_conf(user_conf(env))
    if chosen is not None:
        return chosen, "as the environment's PYTORCH_CUDA_ALLOC_CONF sets it"
    return True, "as LMS sets it when enabled"


def prepare(settings: Settings, launcher: Launcher) -> None:
    """Finds what ``settings`` leaves open, once per suite: the checkout's provenance and, on
    CUDA, the allocator setting of every run."""
    if settings.provenance is None:
        settings.provenance = checkout_provenance()
    if settings.expandable_segments is None and settings.device != "cpu":
        settings.expandable_segments, settings.allocator_source = resolve_expandable_segments(
            launcher.env
        )


def replay_command(seed: int) -> str:
    """The command that runs the case of ``seed`` again, from the repository root."""
    out = f"out/stress-seed-{seed}"
    return f"PYTHONPATH=extension python3 -m {RUNNER_MODULE} --seed {seed} --out {out}"


def runs_dir_of(out: Path, seed: int, attempt: int) -> Path:
    """Where the runs of one attempt of a seed write their results and logs."""
    base = out / "runs" / str(seed)
    return base if attempt <= 1 else base / f"attempt-{attempt}"


def launch_run(
    launcher: Launcher,
    timeout_s: float,
    folder: Path,
    name: str,
    *,
    case: dict[str, Any],
    mode: str,
    device: str,
    cap: int | None,
    alloc_conf: str | None,
    provenance: dict[str, Any] | None,
    bound: bool = False,
    fault: Any = None,
) -> Outcome:
    """Runs one worker process of a case (``mode``: reference, capped or capped-no-lms) into
    ``folder/NAME.json`` and ``NAME.log``, first removing what an earlier run left there."""
    request = {
        "case": case,
        "mode": mode,
        "device": device,
        "cap_bytes": cap,
        "measure_bound": bound,
        "alloc_conf": alloc_conf,
        "result": str(folder / f"{name}.json"),
        "log": str(folder / f"{name}.log"),
        "fault": fault,
        "provenance": provenance,
    }
    for stale in (request["result"], request["log"]):
        Path(stale).unlink(missing_ok=True)
    return launcher.launch(request, timeout_s)


def run_case(seed: int, launcher: Launcher, settings: Settings, attempt: int = 1) -> dict[str, Any]:
    """Runs the references and the capped runs of one seed; returns the case's record."""
    case = generate(seed)
    if settings.case_override is not None:
        case = settings.case_override(case)
    runs_dir = runs_dir_of(settings.out, seed, attempt)
    runs_dir.mkdir(parents=True, exist_ok=True)
    faults = settings.faults or {}
    provenance = settings.provenance
    if provenance is None:
        provenance = checkout_provenance()
    alloc_conf = None
    if settings.expandable_segments is not None:
        alloc_conf = conf_with_expandable(user_conf(launcher.env), settings.expandable_segments)
    started = time.perf_counter()

    def launch(name: str, mode: str, cap: int | None = None, bound: bool = False) -> Outcome:
        return launch_run(
            launcher,
            settings.run_timeout_s,
            runs_dir,
            name,
            case=case.to_dict(),
            mode=mode,
            device=settings.device,
            cap=cap,
            alloc_conf=alloc_conf,
            provenance=provenance,
            bound=bound,
            fault=faults.get(name),
        )

    ref1 = launch("reference-1", "reference", bound=True)
    ref2 = launch("reference-2", "reference")
    cap_bytes = None
    capped = no_lms = None
    r1 = ref1.result or {}
    if run_status(ref1)[0] == "ok" and run_status(ref2)[0] == "ok":
        peak = r1.get("peak_reserved_bytes")
        if settings.cap_bytes is not None:
            cap_bytes = settings.cap_bytes
        elif peak:
            cap_bytes = int(case.cap_fraction * peak)
        capped = launch("capped", "capped", cap=cap_bytes)
        no_lms = launch("capped-no-lms", "capped-no-lms", cap=cap_bytes)
    verdict = classify(ref1, ref2, capped, no_lms, cap_bytes)
    record: dict[str, Any] = {
        "seed": seed,
        "attempt": attempt,
        "label": case.label(),
        "case": case.to_dict(),
        **verdict,
        "cap_bytes": cap_bytes,
        "peak_reserved_bytes": r1.get("peak_reserved_bytes"),
        "peak_allocated_bytes": r1.get("peak_allocated_bytes"),
        "allocator": {
            "expandable_segments": settings.expandable_segments,
            "conf": alloc_conf,
            "source": settings.allocator_source
            or ("given" if alloc_conf is not None else "each run's environment"),
        },
        "runs": {
            "reference-1": ref1.to_dict(),
            "reference-2": ref2.to_dict(),
            "capped": capped.to_dict() if capped else None,
            "capped-no-lms": no_lms.to_dict() if no_lms else None,
        },
        "runs_dir": str(runs_dir.relative_to(settings.out)),
    }
    if verdict["class"] == "mismatch" and settings.triage:
        record["triage"] = triage(case, ref1, capped, no_lms, cap_bytes, launch)
    record["case_wall_s"] = round(time.perf_counter() - started, 3)
    record["timestamp"] = harness.utc_now()
    worker_env = environment_of(
        [{"env": (run.result or {}).get("env")} for run in (capped, no_lms, ref1) if run]
    )
    record["env"] = {
        **dict.fromkeys(PROVENANCE_KEYS),
        **worker_env,
        **{k: v for k, v in provenance.items() if v is not None},
    }
    if verdict["class"] != "identical":
        record["replay"] = replay_command(seed)
    return record


def triage(
    case: Case,
    ref1: Outcome,
    capped: Outcome | None,
    no_lms: Outcome | None,
    cap_bytes: int | None,
    launch: Callable[..., Outcome],
) -> dict[str, Any]:
    """Re-runs a mismatching case to find the cause; returns the findings and a verdict
    (information only: no finding changes the class)."""
    ref = ref1.result or {}
    capped_result = (capped.result if capped else None) or {}

    def summary(outcome: Outcome | None, compare_to: dict[str, Any] | None) -> dict[str, Any]:
        status, reason = run_status(outcome)
        result = (outcome.result if outcome else None) or {}
        diff = differences(result, compare_to) if status == "ok" and compare_to else None
        return {
            "status": status,
            "reason": reason,
            "param_hash": result.get("param_hash"),
            "equals": None if diff is None else not diff,
            "differences": diff,
        }

    found: dict[str, Any] = {}
    found["capped_repeat"] = summary(
        launch("triage-capped-repeat", "capped", cap=cap_bytes), capped_result
    )
    # The case's own run without LMS under the cap.
    found["no_lms"] = summary(no_lms, ref)
    if case.family in CUDNN_FAMILIES:
        # Without cuDNN the memory profile changes (other kernels, other workspaces): the
        # cap is the case's fraction of the peak of a reference without cuDNN.
        ref_nc = launch("triage-reference-no-cudnn", "reference-no-cudnn")
        ref_nc_result = ref_nc.result or {}
        found["reference_no_cudnn"] = summary(ref_nc, None)
        peak_nc = ref_nc_result.get("peak_reserved_bytes")
        if run_status(ref_nc)[0] == "ok" and peak_nc:
            cap_nc = int(case.cap_fraction * peak_nc)
            capped_nc = launch("triage-capped-no-cudnn", "capped-no-cudnn", cap=cap_nc)
            found["no_cudnn"] = summary(capped_nc, ref_nc_result)
            found["no_cudnn"]["cap_bytes"] = cap_nc
        elif settings_device_is_cpu(ref_nc_result):
            capped_nc = launch("triage-capped-no-cudnn", "capped-no-cudnn")
            found["no_cudnn"] = summary(capped_nc, ref_nc_result)
    if capped_result.get("recompute") is True:
        # Made with recompute on: the same capped run with it off.
        found["no_recompute"] = summary(
            launch("triage-capped-no-recompute", "capped-no-recompute", cap=cap_bytes), ref
        )
    found["verdict"] = triage_verdict(found)
    return found


def settings_device_is_cpu(result: dict[str, Any]) -> bool:
    """Whether a run result comes from the CPU (the runner's tests: no caps there)."""
    return result.get("device_type") == "cpu"


def triage_verdict(found: dict[str, Any]) -> str:
    """One sentence on the likely cause of a mismatch, from the triage runs (information
    only: every mismatch fails the gate)."""
    no_lms = found.get("no_lms", {})
    no_cudnn = found.get("no_cudnn")
    no_recompute = found.get("no_recompute")
    repeat = found.get("capped_repeat", {})
    parts = []
    if no_recompute is not None and no_recompute.get("status") == "ok":
        if no_recompute.get("equals"):
            parts.append(
                "with recompute off the capped LMS run equals its reference: recompute "
                "changes the result"
            )
        else:
            parts.append("with recompute off the capped LMS run differs too: not recompute")
    if no_lms.get("status") == "ok" and no_lms.get("equals") is False:
        parts.append(
            "the cap alone changes the result (it fits without LMS and differs too): an "
            "algorithm chosen under the cap, e.g. cuDNN falling back when its workspace does "
            "not fit, not LMS data"
        )
    if no_cudnn is not None and no_cudnn.get("status") == "ok" and no_cudnn.get("equals"):
        parts.append(
            "with cuDNN disabled the capped LMS run equals its reference: cuDNN's algorithm "
            "choice under the cap"
        )
    if repeat.get("status") == "ok" and repeat.get("equals") is False:
        parts.append("the capped run does not repeat itself: nondeterminism under LMS")
    if parts:
        return "; ".join(parts)
    if no_lms.get("status") == "ok" and no_lms.get("equals"):
        return (
            "unexplained: without LMS the same cap gives the reference result, and cuDNN "
            "does not explain it; suspect LMS data"
        )
    return "unexplained: the cap does not fit without LMS and cuDNN does not explain it"


def _fmt_gib(value: Any) -> str:
    return f"{value / GiB:.2f}" if isinstance(value, (int, float)) and value else ""


def latest_per_seed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest record of each seed (by time, then attempt), in seed order."""
    latest: dict[int, dict[str, Any]] = {}
    for record in sorted(records, key=record_order):
        latest[int(record["seed"])] = record
    return [latest[s] for s in sorted(latest)]


def rerun_seeds(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """The seeds with more than one record, each with its records in order."""
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for record in sorted(records, key=record_order):
        by_seed.setdefault(int(record["seed"]), []).append(record)
    return {s: rs for s, rs in by_seed.items() if len(rs) > 1}


def _values(records: list[dict[str, Any]], key: str) -> str:
    """The values of one provenance key over the records, with counts where they differ."""
    counts = Counter(str((r.get("env") or {}).get(key)) for r in records)
    if len(counts) == 1:
        return next(iter(counts))
    return " / ".join(f"{value} ({n} records)" for value, n in counts.most_common())


def provenance_lines(records: list[dict[str, Any]], extra: dict[str, Any] | None) -> list[str]:
    """The summary header: provenance and versions (every value, where records differ), the
    allocator setting, and ``extra`` (date, parallel jobs)."""
    if not records:
        return []
    keys = (*PROVENANCE_KEYS, "python", "lms_backend")
    lines = [" | ".join(f"{key}: {_values(records, key)}" for key in keys)]
    settings = Counter(
        f"expandable_segments {_setting((r.get('allocator') or {}).get('expandable_segments'))}"
        f" ({(r.get('allocator') or {}).get('source') or 'not recorded'})"
        for r in records
    )
    lines.append("allocator in every run of a case: " + "; ".join(sorted(settings)))
    if extra:
        lines.append(" | ".join(f"{k}: {v}" for k, v in extra.items() if v is not None))
    return lines


# The columns of the summary's table of cases.
CASE_COLUMNS = (
    "seed",
    "case",
    "class",
    "peak",
    "cap",
    "bound",
    "mapped",
    "alloc",
    "out",
    "s/iter",
    "reason",
)


def summarize(records: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
    """The markdown summary of case records: provenance, the gate over every record, counts
    per class and family, the latest record of each seed, and every record of a seed run
    more than once."""
    lines = ["# LMS stress suite: results", ""]
    header = provenance_lines(records, extra)
    if header:
        lines += [*(f"{line}  " for line in header[:-1]), header[-1], ""]
    cases = counted(records)
    passed, why = gate_verdict(records)
    verdict = "PASS" if passed else f"FAIL ({why})"
    lines.append(
        f"{len(cases)} cases where the cap binds; gate: **{verdict}** (judged on every "
        f"record: no {', '.join(GATE_FAILURES)}; parameters, buffers and losses compared)."
    )
    unbound = len(records) - len(cases)
    if unbound:
        lines.append(
            f"{unbound} more case(s) where the cap does not bind (cap-not-binding: the same cap "
            "without LMS does not run out of memory, or LMS paged nothing out): listed, not "
            "counted."
        )
    reruns = rerun_seeds(records)
    if reruns:
        lines.append(
            f"{len(reruns)} seed(s) ran more than once: each record counts and is judged "
            "(listed under Seeds run more than once)."
        )
    walls = [r["case_wall_s"] for r in records if isinstance(r.get("case_wall_s"), (int, float))]
    if walls:
        lines.append(
            f"Wall time {sum(walls):.0f} s, {sum(walls) / len(walls):.1f} s per case "
            "(references, capped runs with and without LMS, and any triage)."
        )
    counts = Counter(str(r["class"]) for r in records)
    present = [c for c in CLASSES if counts[c]] + sorted(set(counts) - set(CLASSES))
    lines += [
        "",
        harness.markdown_table(("class", "records"), [[c, str(counts[c])] for c in present]),
    ]
    for axis in ("family", "optimizer", "amp"):
        rows = []
        for v in sorted({r["case"][axis] for r in records}):
            rs = [r for r in records if r["case"][axis] == v]
            per = Counter(str(r["class"]) for r in rs)
            rows.append([str(v), str(len(rs)), *(str(per[c]) for c in present)])
        lines += ["", harness.markdown_table((axis, "records", *present), rows)]
    lines += [
        "",
        "## Cases",
        "",
        "The latest record of each seed (a seed's record count in parentheses where it ran "
        "more than once). GiB: peak = uncapped peak reserved, bound = largest operator working "
        "set (its inputs plus the most it had allocated at once, or its inputs and outputs) "
        "plus the library workspaces kept from their first use, in tensor bytes; mapped = the "
        "same as the allocator maps it (the oom-expected rule); alloc = largest single "
        "operator output; out = LMS page-out per capped run; s/iter reference / capped.",
        "",
    ]
    cases_rows = []
    for r in latest_per_seed(records):
        runs = r.get("runs", {})
        ref = runs.get("reference-1") or {}
        cap = runs.get("capped") or {}
        lms = cap.get("lms") or {}
        speed = ""
        if ref.get("s_per_iter") is not None and cap.get("s_per_iter") is not None:
            speed = f"{ref['s_per_iter']:.3f} / {cap['s_per_iter']:.3f}"
        reason = str(r.get("reason", "")).replace("|", "/")[:160]
        sizes = [
            _fmt_gib(v)
            for v in (
                r.get("peak_reserved_bytes"),
                r.get("cap_bytes"),
                r.get("bound_bytes"),
                r.get("mapped_bound_bytes"),
                r.get("largest_alloc_bytes"),
                lms.get("pageout_bytes"),
            )
        ]
        seed = str(r["seed"])
        if r["seed"] in reruns:
            seed += f" ({len(reruns[r['seed']])})"
        cases_rows.append([seed, str(r["label"]), str(r["class"]), *sizes, speed, reason])
    lines.append(harness.markdown_table(CASE_COLUMNS, cases_rows))
    if reruns:
        lines += ["", "## Seeds run more than once", ""]
        for seed, rs in reruns.items():
            each = "; ".join(
                f"attempt {r.get('attempt', '?')} at {r.get('timestamp') or 'unknown time'}: "
                f"{r['class']}"
                for r in rs
            )
            lines.append(f"- seed {seed}: {each}")
    others = [
        r
        for r in sorted(records, key=record_order)
        if r["class"] not in ("identical", "cap-not-binding")
    ]
    if others:
        lines += ["", "## Not identical: replay", ""]
        for r in others:
            attempt = f", attempt {r['attempt']}" if r["seed"] in reruns else ""
            lines.append(
                f"- seed {r['seed']} ({r['class']}{attempt}): `{replay_command(r['seed'])}`"
            )
            if "triage" in r:
                lines.append(f"  - triage (information only): {r['triage'].get('verdict')}")
            if str(r["class"]).startswith("oom"):
                why = str(r.get("reason", "")).split("; ", 1)[-1]
                lines.append(f"  - why: {why}")
    return "\n".join(lines) + "\n"


def environment_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Versions and device from the ``env`` of run results: the first value given for each."""
    env: dict[str, Any] = {}
    for record in records:
        for k, v in (record.get("env") or {}).items():
            if v is not None and k not in env:
                env[k] = v
    return env


def _log_record(log: Callable[[str], None], head: str, record: dict[str, Any]) -> None:
    attempt = f" (attempt {record['attempt']})" if record.get("attempt", 1) > 1 else ""
    cap = record["runs"].get("capped") or {}
    pageout = (cap.get("lms") or {}).get("pageout_bytes")
    sizes = ", ".join(
        f"{name} {_fmt_gib(record.get(key)) or '-'}"
        for name, key in (
            ("peak", "peak_reserved_bytes"),
            ("cap", "cap_bytes"),
            ("bound", "bound_bytes"),
            ("mapped", "mapped_bound_bytes"),
        )
    )
    log(
        f"{head} seed {record['seed']}{attempt}: {record['class']}: {record['reason']}"
        f" | {record['label']} | GiB: {sizes}, paged out {_fmt_gib(pageout) or 0}"
        f" | {record['case_wall_s']:.1f} s"
    )
    if "triage" in record:
        log(f"    triage (information only): {record['triage'].get('verdict')}")
    if record["class"] != "identical":
        log(f"    replay: {replay_command(record['seed'])}")


class _ResultsFile:
    """``out/results.jsonl`` and ``out/summary.md`` of a suite: every record of the folder,
    earlier ones included; a record is appended as its case finishes."""

    def __init__(self, out: Path, extra: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.path = out / "results.jsonl"
        self.extra = extra
        self.records = load_records([self.path]) if self.path.is_file() else []
        self.attempts = Counter(int(r["seed"]) for r in self.records)

    def next_attempt(self, seed: int) -> int:
        self.attempts[seed] += 1
        return self.attempts[seed]

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        harness.write_text(self.out / "summary.md", summarize(self.records, self.extra))


def run_suite(
    seeds: list[int],
    settings: Settings,
    launcher: Launcher,
    time_budget_s: float | None = None,
    log: Callable[[str], None] = print,
    jobs: int = 1,
    make_job_launcher: Callable[[], Launcher] | None = None,
) -> list[dict[str, Any]]:
    """Runs ``seeds`` in order until done or the time budget would be passed.

    With ``jobs`` > 1, that many cases run at once, each in threads of its own with a launcher
    from ``make_job_launcher`` (each run is still a process of its own; the memory cap is per
    process, so cases do not share it, but their times are not speed figures then).

    Returns the records of the cases run; ``out/results.jsonl`` gets one line per case as it
    finishes (a seed already there gets another, with the next attempt number) and
    ``out/summary.md`` is rewritten after each, over every record of the folder.
    """
    prepare(settings, launcher)
    if jobs > 1:
        assert make_job_launcher is not None
        return _run_suite_parallel(seeds, settings, make_job_launcher, jobs, time_budget_s, log)
    book = _ResultsFile(settings.out, {"date": harness.utc_now()})
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    run_timeout_s = settings.run_timeout_s
    for index, seed in enumerate(seeds):
        elapsed = time.perf_counter() - start
        if time_budget_s is not None and records:
            per_case = elapsed / len(records)
            if elapsed + 1.5 * per_case > time_budget_s:
                log(f"time budget: stopping before seed {seed} ({elapsed:.0f} s used)")
                log(f"continue with: --start {seed}")
                break
        if time_budget_s is not None:
            # A hung run must not carry the suite far past its budget.
            left = time_budget_s - (time.perf_counter() - start)
            settings.run_timeout_s = min(run_timeout_s, max(30.0, left + 30.0))
        record = run_case(seed, launcher, settings, book.next_attempt(seed))
        records.append(record)
        book.add(record)
        _log_record(log, f"[{index + 1}/{len(seeds)}]", record)
        if len(records) == 2 and all(r["class"] == "reference-failed" for r in records):
            log("the references of the first two cases failed: stopping (see runs/*/ logs)")
            break
    settings.run_timeout_s = run_timeout_s
    return records


def _run_suite_parallel(
    seeds: list[int],
    settings: Settings,
    make_job_launcher: Callable[[], Launcher],
    jobs: int,
    time_budget_s: float | None,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """``run_suite`` with ``jobs`` cases at once; records are written as cases finish."""
    import concurrent.futures
    import threading

    book = _ResultsFile(settings.out, {"date": harness.utc_now(), "parallel_jobs": jobs})
    local = threading.local()
    launchers: list[Launcher] = []
    lock = threading.Lock()

    def run_one(seed: int, attempt: int) -> dict[str, Any]:
        if not hasattr(local, "launcher"):
            local.launcher = make_job_launcher()
            with lock:
                launchers.append(local.launcher)
        return run_case(seed, local.launcher, settings, attempt)

    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    pending = list(seeds)
    running: dict[concurrent.futures.Future[dict[str, Any]], int] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            while pending or running:
                elapsed = time.perf_counter() - start
                # A case started now ends about one case's own wall time from now (cases
                # run side by side, so the suite's elapsed time per case is no estimate).
                per_case = (
                    sum(float(r.get("case_wall_s") or 0.0) for r in records) / len(records)
                    if records
                    else 0.0
                )
                while pending and len(running) < jobs:
                    if time_budget_s is not None and elapsed + 1.2 * per_case > time_budget_s:
                        log(f"time budget: no new case after {elapsed:.0f} s")
                        log(f"continue with: --start {pending[0]}")
                        pending.clear()
                        break
                    seed = pending.pop(0)
                    running[pool.submit(run_one, seed, book.next_attempt(seed))] = seed
                if not running:
                    break
                done, _ = concurrent.futures.wait(
                    running, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in done:
                    running.pop(future)
                    record = future.result()
                    records.append(record)
                    book.add(record)
                    _log_record(log, f"[{len(records)}]", record)
        finally:
            for launcher in launchers:
                launcher.close()
    records.sort(key=record_order)
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {RUNNER_MODULE}",
        description=(
            "Randomized LMS stress suite: generated models trained uncapped twice without LMS "
            "(the first also measures the largest operator working set, in tensor bytes and "
            "as the allocator maps it), then under a memory cap with LMS and without it, each "
            "run in its own process and all of a case's runs with the capped run's allocator "
            "setting. Classifies every case (the rules: the module's docstring) and exits 1 "
            "when the gate fails over every record of --out: any crash, error, mismatch of "
            "parameters, buffers or losses with repeatable references (whatever the triage "
            "says), out-of-memory error that the mapped working set does not explain, or "
            "failed reference, or no case where the cap binds. Cases where it does not bind "
            "(the run without LMS does not run out of memory, or LMS pages nothing out) are "
            "reported, not counted. A seed run again in the same --out keeps its earlier "
            "records."
        ),
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seed", type=int, help="run the case of this seed only (replay)")
    which.add_argument("--seeds", type=int, default=100, help="number of seeds (default 100)")
    which.add_argument(
        "--failed-of",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="run again every seed with a failing record in the results.jsonl of these "
        "folders (judged as the gate judges them), in order",
    )
    which.add_argument(
        "--replay-capped-of",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="do not judge: run again, once each, the capped LMS run of every seed with a "
        "failing record in the results.jsonl of these folders, with the cap and allocator "
        "setting it had, into --out/replay/SEED/ (capped.json, capped.log), for what the "
        "environment adds to its log (PYTORCH_LMS_PACK_LOG=1); writes no record",
    )
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop starting cases when the next one would pass this many seconds",
    )
    parser.add_argument("--out", type=Path, default=Path("out/stress"), help="output folder")
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter of the workers (default: this one)"
    )
    parser.add_argument(
        "--launcher",
        choices=("fork", "spawn"),
        default="fork",
        help="fork: one server imports torch once and forks each run (default); "
        "spawn: a new interpreter per run",
    )
    parser.add_argument(
        "--run-timeout-s", type=float, default=120.0, help="kill a run after this (default 120)"
    )
    parser.add_argument(
        "--no-triage", action="store_true", help="do not re-run mismatches (triage)"
    )
    parser.add_argument(
        "--expandable-segments",
        choices=("auto", "on", "off"),
        default="auto",
        help="the allocator's expandable segments in every run of a case (default auto: as "
        "PYTORCH_CUDA_ALLOC_CONF sets them, else on, as LMS sets them when enabled)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cases run at once, each run in a new interpreter (default 1); results are the "
        "same, times are not speed figures then",
    )
    parser.add_argument(
        "--device", default="cuda", help=argparse.SUPPRESS
    )  # cpu: the runner's tests only
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="do not run: merge every record of the results.jsonl of these folders into --out "
        "and summarize",
    )
    return parser.parse_args(argv)


def replay_capped(
    paths: list[Path],
    out: Path,
    launcher: Launcher,
    timeout_s: float,
    device: str = "cuda",
    report: Callable[[int, Outcome], None] | None = None,
) -> list[tuple[int, Outcome]]:
    """Runs again, once each, the capped LMS run of every seed with a failing record in the
    results.jsonl of ``paths`` (its last such record: the case, the cap and the allocator
    setting it ran with), into ``out/replay/SEED/capped.json`` and ``capped.log``. Writes no
    record and judges nothing: a replay is for what the environment adds to the run's log
    (``PYTORCH_LMS_PACK_LOG=1``, ``PYTORCH_LMS_SCHEDULE_LOG=1``). Records without a capped
    run (a reference that failed) are left out. ``report`` is told of each run as it ends."""
    provenance = checkout_provenance()
    last: dict[int, dict[str, Any]] = {}
    for record in failing_records(paths):
        if record.get("cap_bytes"):
            last[int(record["seed"])] = record
    outcomes: list[tuple[int, Outcome]] = []
    for seed, record in sorted(last.items()):
        folder = out / "replay" / str(seed)
        folder.mkdir(parents=True, exist_ok=True)
        outcome = launch_run(
            launcher,
            timeout_s,
            folder,
            "capped",
            case=record["case"],
            mode="capped",
            device=device,
            cap=record["cap_bytes"],
            alloc_conf=(record.get("allocator") or {}).get("conf"),
            provenance=provenance,
        )
        outcomes.append((seed, outcome))
        if report is not None:
            report(seed, outcome)
    return outcomes


def failing_records(paths: list[Path]) -> list[dict[str, Any]]:
    """The records that fail the gate in the results.jsonl files of ``paths`` (folders
    holding one, or the files); an error naming the paths without one."""
    missing = [str(p) for p in paths if results_file(p) is None]
    if missing:
        raise SystemExit(
            f"error: no results.jsonl (or results.jsonl.xz) in {', '.join(missing)}; give "
            "folders of earlier runs (--out of the runner) or their results files"
        )
    return gate_failures(load_records(paths))


def failed_seeds(paths: list[Path]) -> list[int]:
    """The seeds with a record that fails the gate in the results.jsonl files of ``paths``."""
    return sorted({int(r["seed"]) for r in failing_records(paths)})


def main(argv: list[str] | None = None) -> int:
    """Command line entry; returns 0 when the gate passes, 1 when it fails."""
    args = parse_args(argv)
    here = Path(__file__).resolve()
    if REPO_ROOT / "tests" / "regression" / "stress" / "runner.py" != here:
        print(f"error: the runner is not inside its checkout ({here})", file=sys.stderr)
        return 2
    out: Path = args.out
    if args.replay_capped_of:

        def said(seed: int, outcome: Outcome) -> None:
            status, reason = run_status(outcome)
            folder = out / "replay" / str(seed)
            print(f"replay: seed {seed} {status}: {reason}; log {folder}", flush=True)

        launcher = make_launcher(args.launcher, args.python)
        try:
            replays = replay_capped(
                args.replay_capped_of, out, launcher, args.run_timeout_s, args.device, said
            )
        finally:
            launcher.close()
        if not replays:
            print(f"no capped run to replay in {', '.join(map(str, args.replay_capped_of))}")
        return 0
    if args.merge:
        records = load_records(args.merge)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "results.jsonl").open("w") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
        harness.write_text(out / "summary.md", summarize(records))
    else:
        if args.failed_of:
            seeds = failed_seeds(args.failed_of)
            if not seeds:
                print(f"no seed fails the gate in {', '.join(map(str, args.failed_of))}")
                return 0
            print(f"running again {len(seeds)} failing seed(s): {' '.join(map(str, seeds))}")
        elif args.seed is not None:
            seeds = [args.seed]
        else:
            seeds = list(range(args.start, args.start + args.seeds))
        settings = Settings(
            out=out,
            device=args.device,
            run_timeout_s=args.run_timeout_s,
            triage=not args.no_triage,
        )
        if args.expandable_segments != "auto":
            settings.expandable_segments = args.expandable_segments == "on"
            settings.allocator_source = "--expandable-segments"
        if args.jobs < 1:
            print(f"error: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
            return 2
        launcher = make_launcher(args.launcher, args.python)
        try:
            ran = run_suite(
                seeds,
                settings,
                launcher,
                args.time_budget_s,
                jobs=args.jobs,
                make_job_launcher=lambda: make_launcher("spawn", args.python),
            )
        finally:
            launcher.close()
        if ran:
            last = max(r["seed"] for r in ran)
            print(f"ran seeds {min(r['seed'] for r in ran)}..{last}; next start: {last + 1}")
        results = out / "results.jsonl"
        # The gate judges every record of the folder, earlier attempts included.
        records = load_records([results]) if results.is_file() else []
    counts = Counter(str(r["class"]) for r in records)
    print("classes: " + ", ".join(f"{c} {n}" for c, n in sorted(counts.items())))
    failures = gate_failures(records)
    for record in failures:
        print(
            f"gate: seed {record['seed']} (attempt {record.get('attempt', '?')}) "
            f"{record['class']}: {record['reason']}"
        )
        if "triage" in record:
            print(f"      triage (information only): {record['triage'].get('verdict')}")
        print(f"      replay: {replay_command(record['seed'])}")
    print(f"summary: {out / 'summary.md'}")
    if not records:
        print("gate: no case ran")
        return 1
    passed, why = gate_verdict(records)
    print(
        f"gate: {'PASS' if passed else 'FAIL'} ({len(counted(records))} cases where the cap "
        f"binds{'' if passed else '; ' + why})"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
