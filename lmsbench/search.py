"""Largest-value search (batch size, image size) over a probe that says whether a value trains.

The search is exponential, then binary: from a start value it doubles while the probe
succeeds (or halves while it fails) to bracket the boundary, then bisects the bracket until
it is no wider than ``max(1, rel_tol * lower)``. It assumes that fitting is monotone (if a
value trains, every smaller one does). Each probe of the examples runs in a subprocess, so
an out-of-memory error or a fragmented caching allocator cannot poison later probes; the
search itself is pure and is tested with fake probes.
"""

from __future__ import annotations

import enum
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from lmsbench.lms_setup import EXIT_OOM


class Outcome(enum.Enum):
    FITS = "fits"
    OOM = "oom"
    TIMEOUT = "timeout"  # counted as not fitting: slower than the probe's time limit
    ERROR = "error"  # anything else: the search stops


@dataclass(frozen=True)
class Probe:
    value: int
    outcome: Outcome
    seconds: float = 0.0
    detail: str = ""


class ProbeError(RuntimeError):
    """A probe failed for a reason other than memory or time: the search cannot go on."""

    def __init__(self, probe: Probe) -> None:
        super().__init__(f"probe at {probe.value} failed: {probe.detail or probe.outcome.value}")
        self.probe = probe


@dataclass
class SearchResult:
    largest: int  # 0: not even the smallest value trains
    probes: list[Probe] = field(default_factory=list)
    upper_bound_hit: bool = False  # the largest value allowed trains: the true limit may be more
    budget_exhausted: bool = False  # stopped by the time budget: `largest` is a lower bound

    @property
    def exact(self) -> bool:
        return not (self.upper_bound_hit or self.budget_exhausted)

    def describe(self) -> str:
        if self.largest == 0:
            text = "nothing trains"
        else:
            text = str(self.largest) if self.exact else f">= {self.largest}"
        notes = []
        if self.upper_bound_hit:
            notes.append("upper bound reached")
        if self.budget_exhausted:
            notes.append("time budget exhausted")
        timeouts = sum(p.outcome is Outcome.TIMEOUT for p in self.probes)
        if timeouts:
            notes.append(f"{timeouts} probe(s) timed out")
        return f"{text} ({', '.join(notes)})" if notes else text


ProbeFn = Callable[[int], Probe]


def find_largest(
    probe: ProbeFn,
    start: int,
    *,
    lower: int = 1,
    upper: int = 1 << 20,
    rel_tol: float = 0.0,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult:
    """Finds the largest value in ``[lower, upper]`` for which ``probe`` reports FITS.

    Args:
        probe: runs one trial; FITS means the value trains, OOM and TIMEOUT that it does not,
            ERROR aborts the search with :class:`ProbeError`.
        start: the first value tried (clamped into ``[lower, upper]``).
        lower, upper: the range searched.
        rel_tol: stop bisecting once the bracket is at most ``max(1, rel_tol * lo)`` wide
            (0: exact).
        budget_s: stop starting new probes after this many seconds; the result is then a
            lower bound (``budget_exhausted``).
        clock: the time source (tests pass a fake one).
    """
    if lower < 1 or upper < lower:
        raise ValueError(f"bad search range [{lower}, {upper}]")
    if rel_tol < 0:
        raise ValueError(f"rel_tol must be >= 0, got {rel_tol}")
    began = clock()
    result = SearchResult(largest=0)
    known: dict[int, bool] = {}

    def over_budget() -> bool:
        return budget_s is not None and clock() - began >= budget_s

    def fits(value: int) -> bool:
        if value in known:
            return known[value]
        p = probe(value)
        result.probes.append(p)
        if p.outcome is Outcome.ERROR:
            raise ProbeError(p)
        known[value] = p.outcome is Outcome.FITS
        return known[value]

    value = min(max(start, lower), upper)
    # Bracket: lo fits (0 when nothing known fits), hi does not (None while unknown).
    lo, hi = 0, None
    if fits(value):
        lo = value
        while lo < upper:
            if over_budget():
                result.budget_exhausted = True
                break
            nxt = min(lo * 2, upper)
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
                break
        else:
            result.upper_bound_hit = True
    else:
        hi = value
        while hi > lower:
            if over_budget():
                result.budget_exhausted = True
                break
            nxt = max(hi // 2, lower)
            if fits(nxt):
                lo = nxt
                break
            hi = nxt
    if hi is not None and not result.budget_exhausted:
        while lo > 0 and hi - lo > max(1, int(rel_tol * lo)):
            if over_budget():
                result.budget_exhausted = True
                break
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    result.largest = lo
    return result


def classify_exit(returncode: int) -> Outcome:
    """The outcome of a probe subprocess from its exit status."""
    if returncode == 0:
        return Outcome.FITS
    if returncode == EXIT_OOM:
        return Outcome.OOM
    return Outcome.ERROR


def subprocess_probe(
    make_command: Callable[[int], Sequence[str]],
    timeout_s: float,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] | None = None,
) -> ProbeFn:
    """A probe that runs ``make_command(value)`` in a fresh Python process.

    Exit status 0 means the value trains, :data:`lmsbench.lms_setup.EXIT_OOM` that it ran out of
    memory; running past ``timeout_s`` is a TIMEOUT; anything else is an ERROR carrying the
    end of the process's output.
    """

    def probe(value: int) -> Probe:
        command = list(make_command(value))
        began = time.monotonic()
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            p = Probe(value, Outcome.TIMEOUT, time.monotonic() - began, f"over {timeout_s:.0f} s")
        else:
            outcome = classify_exit(done.returncode)
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            detail = "" if outcome is Outcome.FITS else "\n".join(tail)
            if outcome is Outcome.ERROR:
                detail = f"exit status {done.returncode}: {detail}"
            p = Probe(value, outcome, time.monotonic() - began, detail)
        if log is not None:
            log(f"  probe {value}: {p.outcome.value} ({p.seconds:.1f} s)")
        return p

    return probe


def python_command(script: str, args: Sequence[str]) -> list[str]:
    """``[sys.executable, -u, script, *args]``."""
    return [sys.executable, "-u", script, *args]
