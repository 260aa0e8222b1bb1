"""Runs stress cases, classifies them and writes the results; exits nonzero when the gate fails.

For each seed: two uncapped reference runs without LMS (the first also measures the case's
peak reserved memory and the bound: the largest working set of one operator), then one run
with LMS on (default settings) under a cap of ``cap_fraction`` x that peak. Every run is a
process of its own, so a crash ends one run only. Outcomes:

- ``identical``: the capped run's parameters equal the references', which agree;
- ``reference-not-repeatable``: the two references differ (nothing to compare against);
- ``mismatch``: the references agree and the capped run differs, and the triage below does
  not explain it;
- ``mismatch-explained``: a mismatch that repeats bit for bit under the cap and that the cap
  alone (without LMS) reproduces, or that a caught allocation failure (cuDNN falling back to
  a smaller workspace) explains while LMS without cuDNN is exact;
- ``oom-expected``: out of memory, and one operator's own working set exceeds the cap: the
  bound does, or LMS's error says that the running operator's pinned inputs, what it
  allocated so far and its request pass the limit (the bound is measured per ATen kernel
  below autograd; LMS pins at the outermost operator, so a composite operator such as
  ``aten::lstm`` on its native path holds every step's tensors at once), or LMS had nothing
  left to page out and the allocator, at the failing allocation, had mapped so much for the
  running operator's tensors (20 MiB pages) that the request did not fit under the cap;
- ``oom-unexpected``: out of memory although one operator's working set fits the cap;
- ``crash``: killed by a signal, a CUDA error, no result, or hung;
- ``error``: another Python exception in the capped run;
- ``reference-failed``: a reference run did not train (the case is invalid).

Gate: no ``crash``, ``error``, ``mismatch``, ``oom-unexpected`` or ``reference-failed``.

Each mismatch is triaged: the capped run is repeated, run under the same cap without LMS and,
for models with cuDNN operators, run (with a reference) with cuDNN disabled; the verdict says
whether the cap alone or cuDNN's algorithm choice explains it.

Throughput: a run's own process costs an interpreter start and ``import torch`` (seconds).
By default one fork server (``worker --serve``) imports torch once and forks a fresh child
per run; the child initializes CUDA itself (the server never does), so every run still has
its own process and CUDA context. ``--launcher spawn`` starts a new interpreter per run.

Output in ``--out``: ``results.jsonl`` (one line per case, appended as each finishes),
``summary.md`` (rewritten after each case), ``runs/SEED/`` (each run's JSON result and log).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .generator import Case, generate

REPO_ROOT = Path(__file__).resolve().parents[3]
WORKER_MODULE = "tests.regression.stress.worker"
RUNNER_MODULE = "tests.regression.stress.runner"

CLASSES = (
    "identical",
    "reference-not-repeatable",
    "mismatch",
    "mismatch-explained",
    "oom-expected",
    "oom-unexpected",
    "crash",
    "error",
    "reference-failed",
)
# What LMS's out-of-memory error says when the running operator's own working set (pinned
# inputs, what it allocated so far, the request) passes the limit: no page-out could help.
OPERATOR_OVER_LIMIT = "working set does not fit under the LMS limit"

GATE_FAILURES = ("crash", "error", "mismatch", "oom-unexpected", "reference-failed")
CUDNN_FAMILIES = ("resnet_add", "densenet_cat", "conv3d", "lstm")
PIN_FAILURE_MARKER = "could not all be made resident"
GiB = float(1 << 30)


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

    Statuses: ``ok``; ``oom``; ``error`` (a Python exception that is neither an out-of-memory
    error nor a CUDA error); crash statuses ``signal``, ``cuda-error``, ``hang``, ``no-result``
    (exited without writing its result), ``exit`` (wrote a result but exited nonzero);
    ``not-run``.
    """
    if outcome is None:
        return "not-run", "not run"
    pin = _pin_failure(outcome)
    suffix = f" after an LMS pin failure ({pin})" if pin else ""
    if outcome.timed_out:
        return "hang", f"killed after {outcome.wall_s:.0f} s without finishing{suffix}"
    code = outcome.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return "signal", f"killed by {name}{suffix}"
    result = outcome.result
    if result is None:
        return "no-result", f"exited with status {code} without a result{suffix}"
    if result.get("status") == "exception":
        exc = result.get("exception", {})
        text = f"{exc.get('type', '?')}: {_first_line(exc.get('message', ''))}"
        if exc.get("is_oom"):
            return "oom", text
        if exc.get("is_cuda_error"):
            return "cuda-error", text + suffix
        if pin:
            # The drop-in extension's form of LMS running out of memory: the operator ran
            # without its paged-out inputs and raised (extension/README.md).
            return "oom", f"LMS pin failure: {pin}, then {text}"
        return "error", text
    if result.get("status") != "ok":
        return "no-result", f"result status {result.get('status')!r}, exit status {code}{suffix}"
    if code != 0:
        return "exit", f"trained, then exited with status {code}{suffix}"
    return "ok", "trained"


CRASH_STATUSES = ("signal", "cuda-error", "hang", "no-result", "exit")


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]


def _pin_failure(outcome: Outcome) -> str:
    """The LMS warning that an operator's inputs could not be made resident, if one was given.

    Looks in the warnings of the run's result and in its log.
    """
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
    """Which allocator ran out and for what, from an out-of-memory message."""
    first = _first_line(message, 200)
    if message.startswith("LMS pin failure"):
        return first
    if "Large Model Support" in message:
        return f"LMS: the pinned working set does not fit ({first})"
    if "CUDNN" in message or "CUBLAS" in message:
        return f"library workspace ({first})"
    return f"allocator: {first}"


LMS_HELD = re.compile(
    r"([\d.]+) MiB is allocated to tensors: ([\d.]+) MiB pinned by the running operator\(s\), "
    r"([\d.]+) MiB allocated by them and not released yet, ([\d.]+) MiB inactive"
)
# The caching allocator maps its expandable segments' large pool in pages of this size.
ALLOCATOR_PAGE_BYTES = 20 << 20
MiB = float(1 << 20)


def mapped_working_set(
    message: str, result: dict[str, Any] | None, cap_bytes: int | None
) -> dict[str, Any] | None:
    """Whether the running operator alone filled the cap as the allocator maps memory.

    True (a dict of the figures) when LMS's out-of-memory message says it had nothing left
    to page out (nothing inactive; all but less than one allocator page of the allocated
    bytes held by the running operator: its pinned inputs and what it allocated), and the
    allocator, when the last allocation failed, had mapped so much that the request did not
    fit under the cap: the operator's own tensors, in partly used pages that it holds, leave
    no room. Otherwise None.
    """
    held = LMS_HELD.search(message)
    picture = (result or {}).get("memory_at_oom") or {}
    request = picture.get("request_bytes")
    reserved = picture.get("reserved_bytes")
    if not held or not cap_bytes or request is None or reserved is None:
        return None
    allocated, pinned, own, inactive = (float(g) * MiB for g in held.groups())
    others = allocated - pinned - own
    if inactive > 0 or others >= ALLOCATOR_PAGE_BYTES or reserved + request <= cap_bytes:
        return None
    free = [seg.get("largest_free_bytes") or 0 for seg in picture.get("segments", [])]
    return {
        "operator_bytes": int(pinned + own + request),
        "reserved_bytes": int(reserved),
        "request_bytes": int(request),
        "largest_free_bytes": int(max(free, default=0)),
        "why": (
            f"the running operator holds {(pinned + own) / MiB:.0f} MiB (all LMS could not "
            f"page out) and asks for {request / MiB:.0f} MiB more; the allocator had mapped "
            f"{reserved / MiB:.0f} MiB (free pieces of at most "
            f"{max(free, default=0) / MiB:.0f} MiB, in pages of "
            f"{ALLOCATOR_PAGE_BYTES >> 20} MiB), so the operator's tensors as mapped pass the "
            f"cap ({cap_bytes / MiB:.0f} MiB)"
        ),
    }


def classify(
    ref1: Outcome | None,
    ref2: Outcome | None,
    capped: Outcome | None,
    cap_bytes: int | None,
) -> dict[str, Any]:
    """The class of a case from its three runs, with the reason and the figures behind it."""
    info: dict[str, Any] = {}
    for name, run in (("reference 1", ref1), ("reference 2", ref2)):
        status, reason = run_status(run)
        if status != "ok":
            return {"class": "reference-failed", "reason": f"{name}: {reason}"}
    assert ref1 is not None and ref2 is not None
    r1, r2 = ref1.result or {}, ref2.result or {}
    measured = r1.get("bound") or {}
    bound = measured.get("bytes")
    library = measured.get("library_bytes") or 0
    if bound is not None:
        # Library workspaces kept from their first use occupy the cap as well.
        bound += library
    info["bound_bytes"] = bound
    info["library_bytes"] = library
    info["bound_op"] = measured.get("op")
    info["largest_alloc_bytes"] = measured.get("largest_alloc_bytes")
    info["bound_exceeds_cap"] = bool(bound and cap_bytes and bound > cap_bytes)
    refs_agree = r1.get("param_hash") == r2.get("param_hash")
    info["references_agree"] = refs_agree
    status, reason = run_status(capped)
    if status == "not-run":
        return {"class": "reference-failed", "reason": "the capped run was not started", **info}
    if status in CRASH_STATUSES:
        return {"class": "crash", "reason": f"{status}: {reason}", **info}
    if status == "oom":
        assert capped is not None and capped.result is not None
        message = capped.result.get("exception", {}).get("message", "")
        if reason.startswith("LMS pin failure"):
            message = reason
        operator_over_limit = OPERATOR_OVER_LIMIT in message
        info["operator_over_limit"] = operator_over_limit
        mapped = mapped_working_set(message, capped.result, cap_bytes)
        info["mapped_working_set"] = mapped
        expected = info["bound_exceeds_cap"] or operator_over_limit or mapped is not None
        why = (
            f"the largest operator working set ({_fmt_gib(bound) or '?'} GiB, "
            f"{info['bound_op']}) "
            + ("exceeds" if info["bound_exceeds_cap"] else "fits")
            + f" the cap ({_fmt_gib(cap_bytes) or '?'} GiB)"
        )
        if operator_over_limit and not info["bound_exceeds_cap"]:
            why += "; LMS: the running operator's own working set exceeds the limit"
        elif mapped is not None and not info["bound_exceeds_cap"]:
            why += f"; {mapped['why']}"
        return {
            "class": "oom-expected" if expected else "oom-unexpected",
            "reason": f"{oom_reason(message)}; {why}",
            **info,
        }
    if status == "error":
        return {"class": "error", "reason": reason, **info}
    assert capped is not None and capped.result is not None
    c = capped.result
    lms = c.get("lms") or {}
    info["paged_out"] = bool(lms.get("pageout_count"))
    info["first_loss_difference"] = _first_difference(r1.get("losses"), c.get("losses"))
    if not refs_agree:
        same = [
            name
            for name, r in (("reference 1", r1), ("reference 2", r2))
            if r.get("param_hash") == c.get("param_hash")
        ]
        note = f"capped equals {' and '.join(same)}" if same else "capped equals neither"
        return {
            "class": "reference-not-repeatable",
            "reason": f"the two references differ; {note}",
            **info,
        }
    if c.get("param_hash") == r1.get("param_hash"):
        note = "" if info["paged_out"] else " (nothing was paged out: the cap did not bind)"
        return {"class": "identical", "reason": "parameters bit-identical" + note, **info}
    step = info["first_loss_difference"]
    where = f"loss differs from iteration {step}" if step is not None else "losses equal"
    return {
        "class": "mismatch",
        "reason": f"parameters differ from the repeatable reference; {where}",
        **info,
    }


def _first_difference(a: list[float] | None, b: list[float] | None) -> int | None:
    if not a or not b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def gate_failures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The case records that fail the gate."""
    return [r for r in records if r.get("class") in GATE_FAILURES]


class Launcher:
    """Starts worker runs; ``launch`` returns their :class:`Outcome`."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python = python
        self.env = env

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        raise NotImplementedError

    def close(self) -> None:
        """Releases whatever the launcher holds."""


def _read_outcome(
    request: dict[str, Any], code: int | None, timed_out: bool, wall_s: float
) -> Outcome:
    result_path, log_path = Path(request["result"]), Path(request["log"])
    result = None
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            result = None
    tail = ""
    if log_path.is_file():
        data = log_path.read_bytes()
        tail = data[-200_000:].decode("utf-8", "replace")
    return Outcome(code, timed_out, round(wall_s, 3), result, tail)


class SpawnLauncher(Launcher):
    """A new interpreter per run (``python -m tests.regression.stress.worker --request``)."""

    def launch(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        request_path = Path(request["result"]).with_suffix(".request.json")
        request_path.write_text(json.dumps(request))
        start = time.perf_counter()
        timed_out = False
        with open(request["log"], "wb") as log:
            proc = subprocess.Popen(
                [self.python, "-m", WORKER_MODULE, "--request", str(request_path)],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            try:
                code: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                timed_out = True
        return _read_outcome(request, code, timed_out, time.perf_counter() - start)


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
            return _read_outcome(request, None, False, time.perf_counter() - start)
        answer = json.loads(line)
        return _read_outcome(
            request, answer["returncode"], bool(answer["timed_out"]), answer["wall_s"]
        )

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
    env = dict(os.environ)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["PYTHONUNBUFFERED"] = "1"
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
    faults: dict[str, str] | None = None  # run name -> fault, for the runner's tests
    case_override: Callable[[Case], Case] | None = None  # for the runner's tests


def replay_command(seed: int) -> str:
    """The command that runs the case of ``seed`` again, from the repository root."""
    out = f"out/stress-seed-{seed}"
    return f"PYTHONPATH=extension python3 -m {RUNNER_MODULE} --seed {seed} --out {out}"


def run_case(seed: int, launcher: Launcher, settings: Settings) -> dict[str, Any]:
    """Runs the references and the capped run of one seed; returns the case's record."""
    case = generate(seed)
    if settings.case_override is not None:
        case = settings.case_override(case)
    runs_dir = settings.out / "runs" / str(seed)
    runs_dir.mkdir(parents=True, exist_ok=True)
    faults = settings.faults or {}
    started = time.perf_counter()

    def launch(name: str, mode: str, cap: int | None = None, bound: bool = False) -> Outcome:
        request = {
            "case": case.to_dict(),
            "mode": mode,
            "device": settings.device,
            "cap_bytes": cap,
            "measure_bound": bound,
            "result": str(runs_dir / f"{name}.json"),
            "log": str(runs_dir / f"{name}.log"),
            "fault": faults.get(name),
        }
        for stale in (request["result"], request["log"]):
            Path(stale).unlink(missing_ok=True)
        return launcher.launch(request, settings.run_timeout_s)

    ref1 = launch("reference-1", "reference", bound=True)
    ref2 = launch("reference-2", "reference")
    cap_bytes = None
    capped = None
    r1 = ref1.result or {}
    if run_status(ref1)[0] == "ok" and run_status(ref2)[0] == "ok":
        peak = r1.get("peak_reserved_bytes")
        if peak:
            cap_bytes = int(case.cap_fraction * peak)
        capped = launch("capped", "capped", cap=cap_bytes)
    verdict = classify(ref1, ref2, capped, cap_bytes)
    record: dict[str, Any] = {
        "seed": seed,
        "label": case.label(),
        "case": case.to_dict(),
        **verdict,
        "cap_bytes": cap_bytes,
        "peak_reserved_bytes": r1.get("peak_reserved_bytes"),
        "peak_allocated_bytes": r1.get("peak_allocated_bytes"),
        "runs": {
            "reference-1": ref1.to_dict(),
            "reference-2": ref2.to_dict(),
            "capped": capped.to_dict() if capped else None,
        },
    }
    if verdict["class"] == "mismatch" and settings.triage:
        record["triage"] = triage(case, ref1, capped, cap_bytes, launch)
        explanation = explained_mismatch(record["triage"], capped)
        if explanation is not None:
            record["class"] = "mismatch-explained"
            record["reason"] = f"{record['reason']}; {explanation}"
    record["case_wall_s"] = round(time.perf_counter() - started, 3)
    record["env"] = environment_of(
        [{"env": (run.result or {}).get("env")} for run in (capped, ref1) if run]
    )
    if verdict["class"] != "identical":
        record["replay"] = replay_command(seed)
    return record


def triage(
    case: Case,
    ref1: Outcome,
    capped: Outcome | None,
    cap_bytes: int | None,
    launch: Callable[..., Outcome],
) -> dict[str, Any]:
    """Re-runs a mismatching case to find the cause; returns the findings and a verdict."""
    ref_hash = (ref1.result or {}).get("param_hash")
    capped_hash = ((capped.result if capped else None) or {}).get("param_hash")

    def summary(outcome: Outcome, compare_to: str | None) -> dict[str, Any]:
        status, reason = run_status(outcome)
        h = (outcome.result or {}).get("param_hash")
        return {
            "status": status,
            "reason": reason,
            "param_hash": h,
            "equals": None if status != "ok" else h == compare_to,
        }

    found: dict[str, Any] = {}
    found["capped_repeat"] = summary(
        launch("triage-capped-repeat", "capped", cap=cap_bytes), capped_hash
    )
    found["no_lms"] = summary(
        launch("triage-capped-no-lms", "capped-no-lms", cap=cap_bytes), ref_hash
    )
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
            found["no_cudnn"] = summary(capped_nc, ref_nc_result.get("param_hash"))
            found["no_cudnn"]["cap_bytes"] = cap_nc
        elif settings_device_is_cpu(ref_nc_result):
            capped_nc = launch("triage-capped-no-cudnn", "capped-no-cudnn")
            found["no_cudnn"] = summary(capped_nc, ref_nc_result.get("param_hash"))
    found["verdict"] = triage_verdict(found)
    return found


def explained_mismatch(found: dict[str, Any], capped: Outcome | None) -> str | None:
    """Why a mismatch is a property of training under the cap, not of LMS, or None.

    Explained only when the capped LMS run repeats itself bit for bit and either the same
    cap without LMS (where it fits) differs from the reference too, or the capped run had
    an allocation fail and carried on (``oom_count`` > 0 in a run that trained: cuDNN
    catches a failed workspace allocation and runs another algorithm) while with cuDNN
    disabled the capped LMS run equals its own reference.
    """
    if found.get("capped_repeat", {}).get("equals") is not True:
        return None
    no_lms = found.get("no_lms", {})
    if no_lms.get("status") == "ok" and no_lms.get("equals") is False:
        return "explained: the same cap without LMS gives the same difference"
    caught = int(((capped.result if capped else None) or {}).get("lms", {}).get("oom_count") or 0)
    no_cudnn = found.get("no_cudnn") or {}
    if caught > 0 and no_cudnn.get("status") == "ok" and no_cudnn.get("equals") is True:
        return (
            f"explained: {caught} allocation(s) failed inside the capped run and were caught "
            "(cuDNN runs another algorithm when its workspace does not fit), and without "
            "cuDNN the capped LMS run equals its reference"
        )
    return None


def settings_device_is_cpu(result: dict[str, Any]) -> bool:
    """Whether a run result comes from the CPU (the runner's tests: no caps there)."""
    return result.get("device_type") == "cpu"


def triage_verdict(found: dict[str, Any]) -> str:
    """One sentence on the likely cause of a mismatch, from the triage runs."""
    no_lms = found.get("no_lms", {})
    no_cudnn = found.get("no_cudnn")
    repeat = found.get("capped_repeat", {})
    parts = []
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


def summarize(records: list[dict[str, Any]], env: dict[str, Any] | None = None) -> str:
    """The markdown summary of case records: counts per class and family, each case."""
    lines = ["# LMS stress suite: results", ""]
    if env:
        keys = ("device", "torch", "cuda", "cudnn", "python", "lms_backend", "date")
        lines.append(" | ".join(f"{k}: {env[k]}" for k in keys if env.get(k) is not None))
        lines.append("")
    counts = Counter(r["class"] for r in records)
    failures = gate_failures(records)
    verdict = "PASS" if not failures else f"FAIL ({len(failures)} case(s))"
    lines.append(f"{len(records)} cases; gate: **{verdict}** (no {', '.join(GATE_FAILURES)}).")
    walls = [r["case_wall_s"] for r in records if isinstance(r.get("case_wall_s"), (int, float))]
    if walls:
        lines.append(
            f"Wall time {sum(walls):.0f} s, {sum(walls) / len(walls):.1f} s per case "
            "(references, capped run and any triage)."
        )
    unpaged = sum(1 for r in records if r["class"] == "identical" and not r.get("paged_out"))
    if unpaged:
        lines.append(f"{unpaged} identical case(s) paged nothing out (the cap did not bind).")
    lines += ["", "| class | cases |", "| --- | --- |"]
    lines += [f"| {c} | {counts[c]} |" for c in CLASSES if counts[c]]
    for axis in ("family", "optimizer", "amp"):
        values = sorted({r["case"][axis] for r in records})
        present = [c for c in CLASSES if counts[c]]
        lines += ["", f"| {axis} | cases | " + " | ".join(present) + " |"]
        lines.append("| --- " * (len(present) + 2) + "|")
        for v in values:
            rs = [r for r in records if r["case"][axis] == v]
            per = Counter(r["class"] for r in rs)
            lines.append(f"| {v} | {len(rs)} | " + " | ".join(str(per[c]) for c in present) + " |")
    lines += [
        "",
        "## Cases",
        "",
        "GiB: peak = uncapped peak reserved, bound = largest operator working set (its "
        "inputs plus the most it had allocated at once, or its inputs and outputs) plus the "
        "library workspaces kept from their first use, alloc = largest single operator "
        "output; out = LMS page-out per capped run; s/iter reference / capped.",
        "",
        "| seed | case | class | peak | cap | bound | alloc | out | s/iter | reason |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(records, key=lambda r: r["seed"]):
        runs = r.get("runs", {})
        ref = runs.get("reference-1") or {}
        cap = runs.get("capped") or {}
        lms = cap.get("lms") or {}
        speed = ""
        if ref.get("s_per_iter") is not None and cap.get("s_per_iter") is not None:
            speed = f"{ref['s_per_iter']:.3f} / {cap['s_per_iter']:.3f}"
        reason = str(r.get("reason", "")).replace("|", "/")[:160]
        sizes = " | ".join(
            _fmt_gib(v)
            for v in (
                r.get("peak_reserved_bytes"),
                r.get("cap_bytes"),
                r.get("bound_bytes"),
                r.get("largest_alloc_bytes"),
                lms.get("pageout_bytes"),
            )
        )
        lines.append(
            f"| {r['seed']} | {r['label']} | {r['class']} | {sizes} | {speed} | {reason} |"
        )
    others = [r for r in sorted(records, key=lambda r: r["seed"]) if r["class"] != "identical"]
    if others:
        lines += ["", "## Not identical: replay", ""]
        for r in others:
            lines.append(f"- seed {r['seed']} ({r['class']}): `{replay_command(r['seed'])}`")
            if "triage" in r:
                lines.append(f"  - triage: {r['triage'].get('verdict')}")
            if str(r["class"]).startswith("oom"):
                why = str(r.get("reason", "")).split("; ", 1)[-1]
                lines.append(f"  - why: {why}")
    return "\n".join(lines) + "\n"


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Case records from results.jsonl files (or folders holding one); a later seed wins."""
    by_seed: dict[int, dict[str, Any]] = {}
    for path in paths:
        file = path / "results.jsonl" if path.is_dir() else path
        for line in file.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                by_seed[record["seed"]] = record
    return [by_seed[s] for s in sorted(by_seed)]


def environment_of(records: list[dict[str, Any]], out: Path | None = None) -> dict[str, Any]:
    """Versions and device: from the records' ``env``, else from run results in ``out/runs``."""
    env: dict[str, Any] = {}
    for record in records:
        found: list[dict[str, Any]] = [record.get("env") or {}]
        for name in ("capped", "reference-1"):
            path = out / "runs" / str(record["seed"]) / f"{name}.json" if out else None
            if path is not None and path.is_file():
                try:
                    found.append(json.loads(path.read_text()).get("env") or {})
                except json.JSONDecodeError:
                    continue
        for one in found:
            for k, v in one.items():
                if v is not None and k not in env:
                    env[k] = v
        if "lms_backend" in env and "device" in env:
            break
    return env


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
    finishes and ``out/summary.md`` is rewritten after each.
    """
    if jobs > 1:
        assert make_job_launcher is not None
        return _run_suite_parallel(seeds, settings, make_job_launcher, jobs, time_budget_s, log)
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    # A folder that already holds results (an earlier run cut short, continued with
    # --start): the summary covers those cases too; a seed run again replaces its record.
    earlier = {r["seed"]: r for r in load_records([results])} if results.is_file() else {}
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
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
        record = run_case(seed, launcher, settings)
        records.append(record)
        with results.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        if index == 0 or "device" not in env:
            env.update({k: v for k, v in environment_of([record]).items() if k not in env})
        earlier[seed] = record
        (out / "summary.md").write_text(summarize([earlier[s] for s in sorted(earlier)], env))
        cap = record["runs"].get("capped") or {}
        pageout = (cap.get("lms") or {}).get("pageout_bytes")
        sizes = ", ".join(
            f"{name} {_fmt_gib(record.get(key)) or '-'}"
            for name, key in (
                ("peak", "peak_reserved_bytes"),
                ("cap", "cap_bytes"),
                ("bound", "bound_bytes"),
            )
        )
        log(
            f"[{index + 1}/{len(seeds)}] seed {seed}: {record['class']}: {record['reason']}"
            f" | {record['label']} | GiB: {sizes}, paged out {_fmt_gib(pageout) or 0}"
            f" | {record['case_wall_s']:.1f} s"
        )
        if record["class"] != "identical":
            log(f"    replay: {replay_command(seed)}")
        if len(records) == 2 and all(r["class"] == "reference-failed" for r in records):
            log("the references of the first two cases failed: stopping (see runs/*/ logs)")
            break
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

    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    earlier = {r["seed"]: r for r in load_records([results])} if results.is_file() else {}
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "parallel_jobs": jobs,
    }
    local = threading.local()
    launchers: list[Launcher] = []
    lock = threading.Lock()

    def run_one(seed: int) -> dict[str, Any]:
        if not hasattr(local, "launcher"):
            local.launcher = make_job_launcher()
            with lock:
                launchers.append(local.launcher)
        return run_case(seed, local.launcher, settings)

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
                    running[pool.submit(run_one, seed)] = seed
                if not running:
                    break
                done, _ = concurrent.futures.wait(
                    running, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in done:
                    seed = running.pop(future)
                    record = future.result()
                    records.append(record)
                    with results.open("a") as f:
                        f.write(json.dumps(record, default=str) + "\n")
                    if "device" not in env:
                        env.update(
                            {k: v for k, v in environment_of([record]).items() if k not in env}
                        )
                    earlier[seed] = record
                    (out / "summary.md").write_text(
                        summarize([earlier[s] for s in sorted(earlier)], env)
                    )
                    log(
                        f"[{len(records)}] seed {seed}: {record['class']}: {record['reason']}"
                        f" | {record['label']} | {record['case_wall_s']:.1f} s"
                    )
                    if record["class"] != "identical":
                        log(f"    replay: {replay_command(seed)}")
        finally:
            for launcher in launchers:
                launcher.close()
    records.sort(key=lambda r: r["seed"])
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {RUNNER_MODULE}",
        description=(
            "Randomized LMS stress suite: generated models trained uncapped twice without LMS "
            "and once with LMS under a memory cap, each run in its own process; classifies "
            "every case and exits 1 when the gate fails (any crash, error, mismatch with a "
            "repeatable reference, unexpected out-of-memory, or failed reference)."
        ),
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seed", type=int, help="run the case of this seed only (replay)")
    which.add_argument("--seeds", type=int, default=100, help="number of seeds (default 100)")
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
    parser.add_argument("--no-triage", action="store_true", help="do not re-run mismatches")
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
        help="do not run: merge the results.jsonl of these folders into --out and summarize",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command line entry; returns 0 when the gate passes, 1 when it fails."""
    args = parse_args(argv)
    here = Path(__file__).resolve()
    if REPO_ROOT / "tests" / "regression" / "stress" / "runner.py" != here:
        print(f"error: the runner is not inside its checkout ({here})", file=sys.stderr)
        return 2
    out: Path = args.out
    if args.merge:
        records = load_records(args.merge)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "results.jsonl").open("w") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
        env = environment_of(records)
        (out / "summary.md").write_text(summarize(records, env))
    else:
        seeds = (
            [args.seed]
            if args.seed is not None
            else list(range(args.start, args.start + args.seeds))
        )
        settings = Settings(
            out=out,
            device=args.device,
            run_timeout_s=args.run_timeout_s,
            triage=not args.no_triage,
        )
        if args.jobs < 1:
            print(f"error: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
            return 2
        launcher = make_launcher(args.launcher, args.python)
        try:
            records = run_suite(
                seeds,
                settings,
                launcher,
                args.time_budget_s,
                jobs=args.jobs,
                make_job_launcher=lambda: make_launcher("spawn", args.python),
            )
        finally:
            launcher.close()
        if records:
            last = records[-1]["seed"]
            print(f"ran seeds {records[0]['seed']}..{last}; next start: {last + 1}")
    counts = Counter(r["class"] for r in records)
    print("classes: " + ", ".join(f"{c} {counts[c]}" for c in CLASSES if counts[c]))
    failures = gate_failures(records)
    for record in failures:
        print(f"gate: seed {record['seed']} {record['class']}: {record['reason']}")
        print(f"      replay: {replay_command(record['seed'])}")
    print(f"summary: {out / 'summary.md'}")
    if not records:
        print("gate: no case ran")
        return 1
    print("gate: " + ("PASS" if not failures else "FAIL"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
