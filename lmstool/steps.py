"""Running a build plan: one logged, stamped, resumable step after another.

A :class:`Step` is one command with its working directory, the environment variables it sets
and the files it produces. :func:`execute` runs the steps in order, logging each to
``logs/NN-step.log`` and writing a stamp keyed by the step's inputs when it succeeds, so a
rerun resumes after the last finished step and redoes a step (and everything after it) whose
inputs changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from lmstool.errors import LmsToolError


class StepFolders(Protocol):
    """Where a run keeps its logs and stamps (a build configuration has both)."""

    @property
    def logs(self) -> Path: ...

    @property
    def stamps(self) -> Path: ...


@dataclass
class Step:
    name: str
    title: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    outputs: list[Path] = field(default_factory=list)
    # Paths removed before the step runs again (a checkout starts from an empty folder).
    clean: list[Path] = field(default_factory=list)
    # Extra inputs hashed into the stamp key (file contents of the series, for example).
    input_digest: str = ""

    def command_line(self) -> str:
        return shlex.join(self.argv)


def step_key(step: Step, previous: str) -> str:
    data = {
        "argv": step.argv,
        "cwd": str(step.cwd),
        "env": step.env,
        "inputs": step.input_digest,
        "previous": previous,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def step_keys(steps: Sequence[Step]) -> list[str]:
    keys: list[str] = []
    previous = ""
    for step in steps:
        previous = step_key(step, previous)
        keys.append(previous)
    return keys


def file_stem(index: int, step: Step) -> str:
    return f"{index + 1:02d}-{step.name}"


def stamp_path(cfg: StepFolders, index: int, step: Step) -> Path:
    return cfg.stamps / f"{file_stem(index, step)}.done"


def log_path(cfg: StepFolders, index: int, step: Step) -> Path:
    return cfg.logs / f"{file_stem(index, step)}.log"


def is_done(cfg: StepFolders, index: int, step: Step, key: str) -> bool:
    stamp = stamp_path(cfg, index, step)
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8")).get("key")
    except (OSError, ValueError):
        return False
    return recorded == key and all(path.exists() for path in step.outputs)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - 4096))
            lines = handle.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def _tail(path: Path, count: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-count:])


def run_step(
    step: Step,
    log: Path,
    out: TextIO,
    heartbeat_s: float = 60.0,
) -> int:
    env = {**os.environ, **step.env}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as handle:
        handle.write(f"# cwd: {step.cwd}\n")
        for name, value in step.env.items():
            handle.write(f"# env: {name}={value}\n")
        handle.write(f"# run: {step.command_line()}\n")
        handle.flush()
        try:
            proc = subprocess.Popen(
                step.argv, cwd=step.cwd, env=env, stdout=handle, stderr=subprocess.STDOUT
            )
        except OSError as exc:
            handle.write(f"cannot start: {exc}\n")
            return 127
        start = last = time.monotonic()
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - last >= heartbeat_s:
                    last = now
                    print(
                        f"      ... {_duration(now - start)}: {_last_line(log)}",
                        file=out,
                        flush=True,
                    )
            except KeyboardInterrupt:
                proc.terminate()
                proc.wait()
                raise


def execute(
    cfg: StepFolders,
    steps: Sequence[Step],
    out: TextIO = sys.stdout,
    heartbeat_s: float = 60.0,
) -> None:
    """Run the steps that are not done; stamp each on success; stop at the first failure."""
    keys = step_keys(steps)
    cfg.logs.mkdir(parents=True, exist_ok=True)
    cfg.stamps.mkdir(parents=True, exist_ok=True)
    total = len(steps)
    redo = False
    for index, (step, key) in enumerate(zip(steps, keys)):
        label = f"[{index + 1}/{total}] {step.name}"
        if not redo and is_done(cfg, index, step, key):
            print(f"{label}: done earlier, skipped ({step.title})", file=out, flush=True)
            continue
        # From here on every step runs: later stamps were made from inputs now replaced.
        redo = True
        for later in range(index, total):
            stamp_path(cfg, later, steps[later]).unlink(missing_ok=True)
        for path in step.clean:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        log = log_path(cfg, index, step)
        print(f"{label}: {step.title} (log: {log})", file=out, flush=True)
        start = time.monotonic()
        code = run_step(step, log, out, heartbeat_s)
        elapsed = _duration(time.monotonic() - start)
        if code != 0:
            raise LmsToolError(
                f"step {step.name} failed with exit code {code} after {elapsed}.\n"
                f"last lines of {log}:\n{_tail(log, 25)}\n"
                f"Fix the cause and rerun the same command: finished steps are not repeated."
            )
        missing = [str(path) for path in step.outputs if not path.exists()]
        if missing:
            raise LmsToolError(
                f"step {step.name} succeeded but did not produce {', '.join(missing)}; see {log}"
            )
        stamp_path(cfg, index, step).write_text(
            json.dumps({"key": key, "step": step.name, "seconds": time.monotonic() - start}) + "\n",
            encoding="utf-8",
        )
        print(f"{label}: ok in {elapsed}", file=out, flush=True)
