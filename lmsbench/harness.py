"""What the benchmarks, the stress suite and the regression matrix share: a workload in a
process of its own under a time limit, the options they all take (one name, one meaning and
help each; the default is the tool's), and one record schema with provenance.

- :func:`start_process` starts a command in a process group of its own, so that
  :func:`stop_group` also stops what it started (Inductor's compile workers, DDP ranks);
  :func:`run_process` runs one to its end or its time limit, its output in a log;
  :func:`wait_pid` does the same for a child this process forked (the stress suite's fork
  server). :func:`run_worker` runs ``SCRIPT --worker SPEC.json`` in a fresh Python process
  and returns the result the worker wrote (:func:`serve_worker` is the worker's side);
  :func:`read_json` and :func:`log_tail` read what a run left; :func:`worker_env` is the
  environment of a worker.
- :class:`Deadline`: a time budget.
- :data:`ENV_COLUMNS` / :data:`RECORD_ENV_COLUMNS`: the environment columns every CSV row
  carries; :func:`csv_env_columns` picks them for an environment; :func:`write_csv`,
  :func:`write_json` and :func:`write_text` replace a file whole, so a run stopped at any
  moment leaves valid files;
  :func:`record_environment` is what every JSON record's ``environment`` holds (versions,
  device and provenance: engine commit, dirty flag, engine sources hash, driver);
  :data:`RECORD_PROVENANCE` the fields each row of a record names its run by
  (:func:`with_provenance`), :func:`engine_words` the engine of a record in words.
- ``add_*_options``: the options, declared once.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from lmsbench.lms_setup import (
    REPO_ROOT,
    UNKNOWN,
    nonneg_int,
    positive_float,
    positive_int,
    provenance,
    run_stamp,
    versions,
)
from lmsbench.lms_setup import utc_now as utc_now  # a record's date (the stress runner's)

# ---------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------

# The environment columns of every CSV row.
ENV_COLUMNS = ("device", "torch", "cuda", "lms_backend", "date")
# With the provenance of the figures (records written since they carry it).
PROVENANCE_COLUMNS = ("driver", "engine_commit", "engine_dirty")
RECORD_ENV_COLUMNS = (*ENV_COLUMNS, *PROVENANCE_COLUMNS)


def csv_env_columns(env: dict[str, Any]) -> tuple[str, ...]:
    """The environment columns of a CSV for ``env``: :data:`RECORD_ENV_COLUMNS`, or
    :data:`ENV_COLUMNS` for the environment of a run recorded before runs recorded their
    provenance (no ``engine_commit``), so that rewriting its CSVs keeps their columns."""
    return RECORD_ENV_COLUMNS if "engine_commit" in env else ENV_COLUMNS


# What every row of a record names its run by (a row's own value, e.g. the device a worker
# process trained on, wins over the session's).
RECORD_PROVENANCE = (
    "engine_commit",
    "engine_dirty",
    "engine_sources_sha256",
    "torch",
    "cuda",
    "driver",
    "device",
)


def record_environment(device: bool = True) -> dict[str, Any]:
    """Date, host, Python, torch, CUDA and (with ``device`` and a GPU) the device, then the
    provenance: engine commit, dirty flag, engine sources hash and driver. Without torch,
    date, host and Python only before the provenance."""
    try:
        env = versions(device=device)
    except ImportError:
        env = run_stamp()
    env.update(provenance())
    return env


def with_provenance(rows: Iterable[dict[str, Any]], env: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows``, each with the :data:`RECORD_PROVENANCE` fields of ``env`` it lacks
    ("unknown" where ``env`` has none either)."""
    return [{**{k: env.get(k, UNKNOWN) for k in RECORD_PROVENANCE}, **row} for row in rows]


def engine_words(record: Mapping[str, Any]) -> str:
    """The engine of a record's environment (or row) in words: "engine COMMIT" with "(tree
    with changes)" or "(dirty flag unknown)" where it was not clean, or "engine not recorded"
    for a record written before records recorded it."""
    commit = record.get("engine_commit")
    if commit is None:
        return "engine not recorded"
    if commit == UNKNOWN:
        return "engine unknown (no git and no LMS_ENGINE_COMMIT)"
    dirty = record.get("engine_dirty")
    short = str(commit)[:12]
    if dirty is False:
        return f"engine {short}"
    if dirty is True:
        return f"engine {short} (tree with changes)"
    return f"engine {short} (dirty flag unknown)"


def replace_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """Writes ``path`` through a temporary file beside it, renamed over it when complete: a
    run killed while writing leaves the previous complete file. Makes the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        write(f)
    os.replace(tmp, path)


def write_csv(
    path: Path,
    columns: Sequence[str],
    rows: Sequence[dict[str, str]],
    env: dict[str, Any],
    env_columns: Sequence[str] = ENV_COLUMNS,
) -> None:
    """One line per row: its ``columns``, then the ``env_columns`` of ``env``."""

    def write(f: Any) -> None:
        writer = csv.DictWriter(f, fieldnames=[*columns, *env_columns])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **{k: str(env.get(k, "")) for k in env_columns}})

    replace_atomically(path, write)


def write_text(path: Path, text: str) -> None:
    """``text`` as the whole of ``path`` (:func:`replace_atomically`)."""
    replace_atomically(path, lambda f: f.write(text))


def write_json(path: Path, record: dict[str, Any]) -> None:
    """``record`` as indented JSON (what JSON cannot hold, as its ``str``)."""
    write_text(path, json.dumps(record, indent=2, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object a run wrote to ``path``; None where there is none, or half of one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def log_tail(path: Path, max_bytes: int = 200_000) -> str:
    """The last ``max_bytes`` of a log, as text ("" where there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; ``|`` in cells is escaped."""

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
    ]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# A workload in a process of its own
# ---------------------------------------------------------------------------------------


class Deadline:
    """A time budget: :meth:`left` is the time that remains of it."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._end = clock() + seconds

    def left(self) -> float:
        return self._end - self._clock()


def first_line(text: str, limit: int = 300, mark: str = "") -> str:
    """The first line of ``text`` (of an error message), at most ``limit`` characters; one
    cut short ends with ``mark`` (within the limit)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - len(mark)] + mark


def signal_name(number: int) -> str:
    """``SIGKILL`` and the like; ``signal N`` for a number without a name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# The cuBLAS workspace setting that makes its kernels deterministic (read when the first
# cuBLAS handle is created).
DETERMINISTIC_CUBLAS_WORKSPACE = ":4096:8"


def checkout_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the checkout first on
    ``PYTHONPATH``, so that a script of the checkout started in a fresh interpreter (a worker,
    a probe) imports ``lmsbench``, ``benchmarks`` and ``tests`` as this process does: also
    where the checkout is not installed and this process found them in its working folder
    (``python -m benchmarks.compare`` from the repository root)."""
    env = dict(os.environ if env is None else env)
    root = str(REPO_ROOT)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def worker_env(deterministic: bool = False, **overrides: str) -> dict[str, str]:
    """This process's environment for a worker (:func:`checkout_env`): unbuffered output (its
    log is current when it is stopped), with ``deterministic`` cuBLAS's deterministic
    workspace unless the environment chose one, and ``overrides``."""
    env = checkout_env()
    env["PYTHONUNBUFFERED"] = "1"
    if deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS_WORKSPACE)
    env.update(overrides)
    return env


def start_process(
    command: Sequence[str],
    env: Mapping[str, str],
    output: IO[Any] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[Any]:
    """Starts ``command`` in a process group of its own (stopped whole by :func:`stop_group`),
    reading nothing (stdin is /dev/null). Its stdout and stderr go to ``output`` (an open
    file), or, without one, to two pipes read as text (``communicate``)."""
    pipe = output is None
    return subprocess.Popen(
        list(command),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if pipe else output,
        stderr=subprocess.PIPE if pipe else subprocess.STDOUT,
        text=pipe,
        start_new_session=True,
    )


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Sends ``sig`` to the process group ``pgid``; False where no such group is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a group whose processes are gone but one (a zombie's) remains
        return False
    return True


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Ends ``proc``'s process group: SIGTERM, then SIGKILL after ``grace_s`` (straight
    SIGKILL with ``grace_s`` 0), waiting up to 10 s for ``proc`` after the SIGKILL."""
    steps = ((signal.SIGTERM, grace_s),) if grace_s > 0 else ()
    for sig, wait_s in (*steps, (signal.SIGKILL, 10.0)):
        if not kill_group(proc.pid, sig):
            break
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.poll()  # reaps a leader whose group was gone


def stop_leftovers(proc: subprocess.Popen[Any]) -> None:
    """Stops what a finished worker left in its process group (compile workers)."""
    kill_group(proc.pid)


@dataclass(frozen=True)
class ProcessRun:
    """What became of a process run under a time limit."""

    returncode: int | None  # negative: the signal that ended it, as subprocess gives it
    timed_out: bool  # past its time limit, and stopped
    wall_s: float


def run_process(
    command: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    timeout_s: float,
    cwd: Path | None = None,
    grace_s: float = 10.0,
) -> ProcessRun:
    """Runs ``command`` (:func:`start_process`) with its output in ``log_path`` until it ends
    or ``timeout_s`` passes; then, or when this process is interrupted, its process group is
    stopped (:func:`stop_group` with ``grace_s``). What it left running in its group after it
    ended is stopped too."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    timed_out = False
    with log_path.open("wb") as log:
        proc = start_process(command, env, log, cwd)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:
                stop_group(proc, grace_s)
            else:
                stop_leftovers(proc)
    return ProcessRun(proc.returncode, timed_out, round(time.perf_counter() - start, 3))


def wait_pid(pid: int, timeout_s: float) -> ProcessRun:
    """Waits for ``pid``, a child this process forked that leads a process group of its own
    (it called ``os.setpgid(0, 0)``); past ``timeout_s``, or when this process is
    interrupted, its group is killed (SIGKILL) and the child reaped."""
    start = time.perf_counter()
    deadline = Deadline(timeout_s)
    delay = 0.005
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return ProcessRun(
                    os.waitstatus_to_exitcode(status), False, round(time.perf_counter() - start, 3)
                )
            if deadline.left() < 0:
                break
            time.sleep(delay)
            delay = min(0.05, delay * 2)
    except BaseException:
        with contextlib.suppress(ChildProcessError):  # already reaped
            _kill_and_reap(pid)
        raise
    code = _kill_and_reap(pid)
    return ProcessRun(code, True, round(time.perf_counter() - start, 3))


def _kill_and_reap(pid: int) -> int:
    """Kills the group of the child ``pid`` (or the child alone, before it made its group)
    and returns its exit code."""
    if not kill_group(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def run_worker(
    script: Path, spec: dict[str, Any], log_path: Path, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Runs ``python SCRIPT --worker SPEC`` (:func:`run_process`) in ``env`` with the checkout
    on its ``PYTHONPATH`` (:func:`checkout_env`: the worker's side, :func:`serve_worker`, is
    in this package), its output in ``log_path``; ``spec`` (written beside the log as
    ``.spec.json``) gets the ``result_path`` the worker writes its result to. Returns that
    result, ``{"status": "timeout"}`` for a worker past ``timeout_s`` (its group stopped) or
    ``{"status": "error"}`` with the log's tail for one that wrote none."""
    spec_path = log_path.with_suffix(".spec.json")
    result_path = log_path.with_suffix(".result.json")
    result_path.unlink(missing_ok=True)
    write_json(spec_path, {**spec, "result_path": str(result_path)})
    command = [sys.executable, str(script.resolve()), "--worker", str(spec_path)]
    run = run_process(command, log_path, checkout_env(env), timeout_s)
    if run.timed_out:
        return {"status": "timeout", "detail": f"stopped after {timeout_s:.0f} s"}
    result = read_json(result_path)
    if result is not None:
        return result
    tail = log_tail(log_path).strip().splitlines()[-3:]
    return {
        "status": "error",
        "detail": f"worker exited with {run.returncode} and no result: {' / '.join(tail)}",
    }


def serve_worker(spec_path: Path, run: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The worker's side of :func:`run_worker`: runs ``run(spec)`` and writes its result to
    the spec's ``result_path``."""
    spec = json.loads(spec_path.read_text())
    result = run(spec)
    write_json(Path(spec["result_path"]), result)
    label = spec.get("config", spec_path.stem)
    print(f"{label}: {result['status']} {result.get('detail', '')}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------
# Options, declared once
# ---------------------------------------------------------------------------------------


def add_out_option(parser: argparse._ActionsContainer, default: Path) -> None:
    """``--out`` (``args.out``): the output folder."""
    parser.add_argument("--out", type=Path, default=default, help="output folder")


def add_gpt_options(
    parser: argparse._ActionsContainer,
    *,
    layers: int,
    dim: int,
    heads: int,
    seq: int,
    vocab: int,
) -> None:
    """The GPT-style decoder's shape: ``--gpt-layers``, ``--gpt-dim``, ``--gpt-heads``,
    ``--gpt-seq``, ``--gpt-vocab`` (the defaults are the tool's workload)."""
    parser.add_argument("--gpt-layers", type=positive_int, default=layers, help="GPT layers")
    parser.add_argument("--gpt-dim", type=positive_int, default=dim, help="GPT width")
    parser.add_argument("--gpt-heads", type=positive_int, default=heads, help="GPT attention heads")
    parser.add_argument("--gpt-seq", type=positive_int, default=seq, help="GPT sequence length")
    parser.add_argument("--gpt-vocab", type=positive_int, default=vocab, help="GPT vocabulary")


def add_amp_option(parser: argparse._ActionsContainer) -> None:
    """``--amp`` (``args.amp``): bf16 autocast instead of fp32 with TF32 matmuls."""
    parser.add_argument(
        "--amp", action="store_true", help="bf16 autocast (default fp32 with TF32 matmuls)"
    )


def add_step_options(
    parser: argparse._ActionsContainer,
    *,
    warmup: int | None,
    iterations: int | None,
    warmup_help: str,
    iterations_help: str,
    min_warmup: int = 0,
) -> None:
    """``--warmup`` (untimed steps; at least ``min_warmup``) and ``--iterations`` (timed
    steps) of each measurement; the help says what they mean to the tool."""
    parser.add_argument(
        "--warmup",
        type=positive_int if min_warmup >= 1 else nonneg_int,
        default=warmup,
        help=warmup_help,
    )
    parser.add_argument("--iterations", type=positive_int, default=iterations, help=iterations_help)


def add_time_budget_option(
    parser: argparse._ActionsContainer, default: float, what: str, more: str = ""
) -> None:
    """``--time-budget-s`` (``args.time_budget_s``): stop starting ``what`` after this long;
    what is left is reported as skipped (``more``: what else the tool does with it)."""
    parser.add_argument(
        "--time-budget-s",
        type=positive_float,
        default=default,
        help=f"stop starting {what} after this long (what is left is reported as skipped)"
        + (f"; {more}" if more else ""),
    )
