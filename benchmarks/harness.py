"""What the benchmarks share: a workload in a process of its own under a time limit, the
options they all take (one name, one meaning and help each; the default is the tool's), and
one record schema with provenance.

- :func:`run_worker` runs ``SCRIPT --worker SPEC.json`` in a fresh Python process (its own
  process group, so that a timeout also stops what it started, such as Inductor's compile
  workers) and returns the result the worker wrote (:func:`serve_worker` is the worker's side).
- :class:`Deadline`: a time budget.
- :data:`ENV_COLUMNS` / :data:`RECORD_ENV_COLUMNS`: the environment columns every CSV row
  carries; :func:`csv_env_columns` picks them for an environment; :func:`write_csv` and
  :func:`write_json` replace a file whole, so a run stopped at any moment leaves valid files;
  :func:`record_environment` is what every JSON record's ``environment`` holds (versions,
  device and provenance: engine commit, dirty flag, engine sources hash, driver).
- ``add_*_options``: the options, declared once.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent / "examples"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _lms_setup import nonneg_int, positive_float, positive_int, provenance, versions  # noqa: E402

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


def record_environment(device: bool = True) -> dict[str, Any]:
    """Date, host, Python, torch, CUDA and (with ``device`` and a GPU) the device, then the
    provenance: engine commit, dirty flag, engine sources hash and driver."""
    env = versions(device=device)
    env.update(provenance())
    return env


def replace_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """Writes ``path`` through a temporary file beside it, renamed over it when complete: a
    run killed while writing leaves the previous complete file."""
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


def write_json(path: Path, record: dict[str, Any]) -> None:
    text = json.dumps(record, indent=2, default=str) + "\n"
    replace_atomically(path, lambda f: f.write(text))


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


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """Ends ``proc``'s process group: SIGTERM, then SIGKILL after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_leftovers(proc: subprocess.Popen[Any]) -> None:
    """Stops what a finished worker left in its process group (compile workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_worker(
    script: Path, spec: dict[str, Any], log_path: Path, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Runs ``python SCRIPT --worker SPEC`` in a fresh process of its own process group, its
    output in ``log_path``; ``spec`` (written beside the log as ``.spec.json``) gets the
    ``result_path`` the worker writes its result to (:func:`serve_worker`). Returns that
    result, ``{"status": "timeout"}`` for a worker past ``timeout_s`` (its group stopped) or
    ``{"status": "error"}`` with the log's tail for one that wrote none."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path = log_path.with_suffix(".spec.json")
    result_path = log_path.with_suffix(".result.json")
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}, indent=2) + "\n")
    command = [sys.executable, str(script.resolve()), "--worker", str(spec_path)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return {"status": "timeout", "detail": f"stopped after {timeout_s:.0f} s"}
        finally:
            if proc.poll() is None:
                stop_group(proc)
            else:
                stop_leftovers(proc)
    if result_path.exists():
        return dict(json.loads(result_path.read_text()))
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return {
        "status": "error",
        "detail": f"worker exited with {proc.returncode} and no result: {' / '.join(tail)}",
    }


def serve_worker(spec_path: Path, run: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The worker's side of :func:`run_worker`: runs ``run(spec)`` and writes its result to
    the spec's ``result_path``."""
    spec = json.loads(spec_path.read_text())
    result = run(spec)
    Path(spec["result_path"]).write_text(json.dumps(result, indent=2, default=str) + "\n")
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
