"""Where the time of a training iteration goes, read from a PyTorch profiler trace.

A method that moves tensors between device and host is fast when the copies overlap compute
and each other. This module reads the Chrome trace that ``torch.profiler`` exports (Kineto's
format: ``traceEvents`` with ``kernel``, ``gpu_memcpy``, ``gpu_memset`` and ``cuda_runtime``
events) and answers, per iteration:

- how long the compute stream (the stream with the most kernel time) ran kernels, and how
  long it sat idle;
- of that idle time, how much passed while a copy ran on another stream (the compute stream
  most likely waited for it: a page-in or a page-out it depends on) and how much with the
  whole GPU idle (nothing was queued: the host was late, or blocked in a synchronizing call);
- how long each copy direction ran, how many bytes it moved and at what rate, and how long
  both directions ran at once;
- copies queued on the compute stream itself (they stall compute by construction);
- the host's time in the CUDA runtime calls that took longest in total (a
  ``cudaEventSynchronize`` or ``cudaStreamSynchronize`` there blocks the host, and with it
  the launch of everything after it; a launch or event record that waits for room in a full
  launch queue counts too, so a large figure there can also mean the host was far ahead);
- what the host was doing while the whole GPU sat idle: the innermost operators it was in
  (their own time, without the operators they called) and the runtime calls it was in, so a
  gap is traced to the operator, the replay or the synchronizing call that held the launches
  back. The drop-in extension marks its part of an allocation (``lms::allocate``) and, inside
  it, the caching allocator's own malloc (``lms::caching_allocator_malloc``), so an
  allocation's idle time splits into LMS's reclaim and the allocator's;
- the longest stretches of an idle GPU, each with the host operator at its middle and the GPU
  work that ended it.

No torch is needed: ``benchmarks/compare.py --profile-iterations N`` runs the profiler and
calls :func:`analyze`; it can also be run on a saved trace (``python -m
benchmarks.stream_profile TRACE.json --iterations N``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

Interval = tuple[float, float]  # start, end in microseconds


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint ``intervals``."""
    return sum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two sorted, disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` minus ``b``, both sorted and disjoint."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


@dataclass
class CopyDirection:
    busy_ms: float = 0.0
    gib: float = 0.0
    gb_per_s: float = 0.0  # while copying
    count: int = 0


@dataclass
class StreamBreakdown:
    """Per-iteration figures (milliseconds, GiB) of one profiled stretch of training."""

    iterations: int
    span_ms: float  # first to last GPU activity
    compute_stream: int
    compute_busy_ms: float  # kernels, memsets and copies on the compute stream
    compute_idle_ms: float
    idle_while_copying_ms: float  # compute idle while a copy ran on another stream
    idle_gpu_idle_ms: float  # compute idle with nothing running on the GPU
    idle_other_ms: float  # compute idle while only other streams' kernels ran
    d2h: CopyDirection = field(default_factory=CopyDirection)
    h2d: CopyDirection = field(default_factory=CopyDirection)
    both_directions_ms: float = 0.0  # D2H and H2D copies running at once
    copies_on_compute_ms: float = 0.0  # copies queued on the compute stream itself
    copies_on_compute_gib: float = 0.0
    runtime_calls_ms: dict[str, float] = field(default_factory=dict)  # host time, top calls
    # While the whole GPU was idle: the host's innermost operators (own time; "outside
    # operators" for the rest of the idle time no operator covered) and runtime calls. Summed
    # over host threads: two threads in operators at once both count.
    gpu_idle_host_ops_ms: dict[str, float] = field(default_factory=dict)
    gpu_idle_runtime_calls_ms: dict[str, float] = field(default_factory=dict)
    # The longest stretches of the whole GPU idle, longest first: their length (ms), the
    # innermost host operator at their middle and the GPU work that ended them.
    gpu_idle_gaps: list[dict[str, object]] = field(default_factory=list)
    # Per phase of the step (the record_function ranges named PHASE_PREFIX + phase, e.g.
    # "step: forward"), in the order they ran: its compute stream's time from its first to
    # its last kernel (span_ms), busy and idle while a copy ran elsewhere within that span,
    # and the copies launched in it each way (GiB) with their busy time (ms). The GPU work of
    # a phase is the work its host range launched, on any thread (autograd's too).
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> str:
        """A few lines for a log."""
        lines = [
            f"per iteration over {self.iterations}: span {self.span_ms:.1f} ms, compute stream "
            f"{self.compute_stream} busy {self.compute_busy_ms:.1f} ms, idle "
            f"{self.compute_idle_ms:.1f} ms (copy running elsewhere "
            f"{self.idle_while_copying_ms:.1f}, "
            f"GPU idle {self.idle_gpu_idle_ms:.1f}, other kernels {self.idle_other_ms:.1f})",
            f"D2H {self.d2h.busy_ms:.1f} ms, {self.d2h.gib:.2f} GiB at "
            f"{self.d2h.gb_per_s:.1f} GB/s; H2D {self.h2d.busy_ms:.1f} ms, {self.h2d.gib:.2f} GiB "
            f"at {self.h2d.gb_per_s:.1f} GB/s; both at once {self.both_directions_ms:.1f} ms; "
            f"copies on the compute stream {self.copies_on_compute_ms:.1f} ms "
            f"({self.copies_on_compute_gib:.2f} GiB)",
        ]
        if self.runtime_calls_ms:
            calls = ", ".join(f"{k} {v:.1f}" for k, v in self.runtime_calls_ms.items())
            lines.append(f"host in CUDA runtime calls (ms): {calls}")
        if self.gpu_idle_host_ops_ms:
            ops = ", ".join(f"{k} {v:.1f}" for k, v in self.gpu_idle_host_ops_ms.items())
            lines.append(f"while the GPU sat idle, the host was in (ms): {ops}")
        if self.gpu_idle_runtime_calls_ms:
            calls = ", ".join(f"{k} {v:.1f}" for k, v in self.gpu_idle_runtime_calls_ms.items())
            lines.append(f"while the GPU sat idle, in CUDA runtime calls (ms): {calls}")
        for name, p in self.phases.items():
            lines.append(
                f"{name}: span {p['span_ms']:.1f} ms, compute busy {p['busy_ms']:.1f}, idle "
                f"while copying {p['idle_while_copying_ms']:.1f}; launched D2H "
                f"{p['d2h_gib']:.2f} GiB ({p['d2h_busy_ms']:.1f} ms), H2D {p['h2d_gib']:.2f} "
                f"GiB ({p['h2d_busy_ms']:.1f} ms)"
            )
        if self.gpu_idle_gaps:
            gaps = "; ".join(
                f"{g['ms']:.1f} in {g['host_op']}, then {str(g['next'])[:48]}"
                for g in self.gpu_idle_gaps
            )
            lines.append(f"longest GPU idle gaps (ms): {gaps}")
        return "\n".join(lines)

    def record(self) -> dict[str, object]:
        return asdict(self)


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Host-side operator events: ATen operators and record_function ranges. The profiler's own
# per-step ranges (ProfilerStep#N) span everything and say nothing.
HOST_OP_CATEGORIES = ("cpu_op", "user_annotation")
OUTSIDE_OPERATORS = "outside operators"
# The step's phases are record_function ranges named so ("step: forward", "step: backward",
# "step: optimizer"): the breakdown splits by them and leaves them out of the host operators.
PHASE_PREFIX = "step: "
GiB = 1024**3


class Coverage:
    """How much of an interval sorted, disjoint ``intervals`` cover, in O(log n) a query."""

    def __init__(self, intervals: Sequence[Interval]) -> None:
        self.starts = [s for s, _ in intervals]
        self.ends = [e for _, e in intervals]
        self.before = [0.0]  # total length of the intervals before index i
        for s, e in intervals:
            self.before.append(self.before[-1] + e - s)

    def covered(self, start: float, end: float) -> float:
        if end <= start or not self.starts:
            return 0.0
        # The intervals that may overlap: from the last one starting at or before `start`
        # to the last one starting before `end`.
        first = max(bisect.bisect_right(self.starts, start) - 1, 0)
        last = bisect.bisect_left(self.starts, end)
        if last <= first:
            return 0.0
        total = self.before[last] - self.before[first]
        total -= max(0.0, min(start, self.ends[first]) - self.starts[first])  # cut the head
        total -= max(0.0, self.ends[last - 1] - end)  # and the tail
        return max(total, 0.0)


def host_during(
    ops: Sequence[tuple[object, float, float, str]], idle: Sequence[Interval]
) -> dict[str, float]:
    """Microseconds of ``idle`` each innermost host operator covered, by name: an operator's
    own time (without the operators nested in it on its thread) within ``idle``, plus
    ``OUTSIDE_OPERATORS``: the idle time no operator of any thread covered. ``ops`` are
    ``(thread, start, end, name)``."""
    cover = Coverage(idle)
    out: dict[str, float] = defaultdict(float)
    by_thread: dict[object, list[tuple[float, float, str]]] = defaultdict(list)
    for tid, start, end, name in ops:
        by_thread[tid].append((start, end, name))
    for spans in by_thread.values():
        # Parents before children: by start, the longer first.
        spans.sort(key=lambda op: (op[0], -op[1]))
        stack: list[tuple[float, str]] = []  # (end, name) of the open operators
        for start, end, name in spans:
            while stack and stack[-1][0] <= start:
                stack.pop()
            inside = cover.covered(start, end)
            out[name] += inside
            if stack:  # the parent's own time excludes this child
                out[stack[-1][1]] -= inside
            stack.append((end, name))
    covered_by_ops = merge((start, end) for _, start, end, _ in ops)
    out[OUTSIDE_OPERATORS] = length(subtract(list(idle), covered_by_ops))
    return {k: v for k, v in out.items() if v > 0.0}


def _top(totals: dict[str, float], n: int, iterations: int) -> dict[str, float]:
    """The ``n`` largest of ``totals`` (microseconds), in milliseconds per iteration."""
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return {k: v / 1000 / iterations for k, v in top}


def _direction(name: str) -> str:
    """'d2h', 'h2d' or '' for a Kineto memcpy event name such as 'Memcpy DtoH (Device ->
    Pinned)'."""
    if "DtoH" in name:
        return "d2h"
    if "HtoD" in name:
        return "h2d"
    return ""


def longest_gaps(
    gaps: Sequence[Interval],
    ops: Sequence[tuple[object, float, float, str]],
    gpu_events: Sequence[tuple[float, str]],
    count: int,
) -> list[dict[str, object]]:
    """The ``count`` longest of ``gaps`` (sorted, disjoint), longest first, each with its
    length in ms, the innermost host operator at its middle (the shortest one there, on any
    thread; ``OUTSIDE_OPERATORS`` when none) and the name of the first GPU work to start at
    or after its end (``"end of trace"`` when none)."""
    starts = sorted(gpu_events)
    out: list[dict[str, object]] = []
    for start, end in sorted(gaps, key=lambda g: g[0] - g[1])[:count]:
        middle = (start + end) / 2
        inside = [op for op in ops if op[1] <= middle <= op[2]]
        host = min(inside, key=lambda op: op[2] - op[1])[3] if inside else OUTSIDE_OPERATORS
        at = bisect.bisect_left(starts, (end, ""))
        after = starts[at][1] if at < len(starts) else "end of trace"
        out.append({"ms": (end - start) / 1000, "host_op": host, "next": after})
    return out


def analyze(
    trace: dict[str, object], iterations: int, top_calls: int = 6, top_gaps: int = 5
) -> StreamBreakdown:
    """The breakdown of a Chrome trace (``torch.profiler`` export) covering ``iterations``
    training iterations. Raises ValueError when the trace holds no GPU activity."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no 'traceEvents' list")
    kernel_time: dict[int, float] = defaultdict(float)
    by_stream: dict[int, list[Interval]] = defaultdict(list)
    copies: dict[str, list[tuple[int, Interval, float]]] = {"d2h": [], "h2d": []}
    calls: dict[str, float] = defaultdict(float)
    call_spans: list[tuple[object, float, float, str]] = []
    host_ops: list[tuple[object, float, float, str]] = []
    gpu_events: list[tuple[float, str]] = []  # start, name
    launched_at: dict[object, float] = {}  # runtime call's correlation id -> host start
    phase_ranges: list[tuple[float, float, str]] = []  # host start, end, phase
    # correlation id, stream, copy direction ('' for other work), interval, bytes copied
    gpu_launches: list[tuple[object, int, str, Interval, float]] = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat = ev.get("cat")
        try:
            start = float(ev["ts"])
            end = start + float(ev.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        assert isinstance(args, dict)
        if cat in RUNTIME_CATEGORIES:
            calls[str(ev.get("name", "?"))] += end - start
            call_spans.append((ev.get("tid"), start, end, str(ev.get("name", "?"))))
            if "correlation" in args:
                launched_at[args["correlation"]] = start
            continue
        if cat in HOST_OP_CATEGORIES:
            name = str(ev.get("name", "?"))
            if name.startswith(PHASE_PREFIX):
                phase_ranges.append((start, end, name[len(PHASE_PREFIX) :]))
            elif not name.startswith("ProfilerStep"):
                host_ops.append((ev.get("tid"), start, end, name))
            continue
        if cat not in GPU_CATEGORIES:
            continue
        try:
            stream = int(args.get("stream", -1))
        except (TypeError, ValueError):
            stream = -1
        by_stream[stream].append((start, end))
        gpu_events.append((start, str(ev.get("name", "?"))))
        direction = _direction(str(ev.get("name", ""))) if cat == "gpu_memcpy" else ""
        nbytes = float(args.get("bytes", 0)) if direction else 0.0
        if "correlation" in args:
            gpu_launches.append((args["correlation"], stream, direction, (start, end), nbytes))
        if cat == "kernel":
            kernel_time[stream] += end - start
        elif direction:
            copies[direction].append((stream, (start, end), nbytes))
    if not by_stream:
        raise ValueError("the trace holds no GPU activity (was CUDA profiled?)")
    compute = max(kernel_time, key=lambda s: kernel_time[s]) if kernel_time else -1
    all_gpu = merge(i for spans in by_stream.values() for i in spans)
    span = (all_gpu[0][0], all_gpu[-1][1])
    compute_busy = merge(by_stream.get(compute, []))
    idle = subtract([span], compute_busy)
    copy_elsewhere = merge(iv for d in copies.values() for stream, iv, _ in d if stream != compute)
    other = merge(iv for stream, spans in by_stream.items() if stream != compute for iv in spans)
    idle_copying = intersect(idle, copy_elsewhere)
    idle_rest = subtract(idle, copy_elsewhere)
    idle_other = intersect(idle_rest, other)
    n = float(iterations)

    def direction(name: str) -> CopyDirection:
        spans = merge(iv for _, iv, _ in copies[name])
        busy_us = length(spans)
        nbytes = sum(b for _, _, b in copies[name])
        return CopyDirection(
            busy_ms=busy_us / 1000 / n,
            gib=nbytes / GiB / n,
            gb_per_s=nbytes / (busy_us * 1e-6) / 1e9 if busy_us > 0 else 0.0,
            count=round(len(copies[name]) / n),
        )

    d2h_spans = merge(iv for _, iv, _ in copies["d2h"])
    h2d_spans = merge(iv for _, iv, _ in copies["h2d"])
    on_compute = [(iv, b) for d in copies.values() for stream, iv, b in d if stream == compute]
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:top_calls]
    gpu_idle = subtract(idle_rest, other)
    # Calls do not nest, so each one's time within the idle time is its own.
    cover = Coverage(gpu_idle)
    idle_calls: dict[str, float] = defaultdict(float)
    for _, start, end, name in call_spans:
        idle_calls[name] += cover.covered(start, end)
    return StreamBreakdown(
        iterations=iterations,
        span_ms=(span[1] - span[0]) / 1000 / n,
        compute_stream=compute,
        compute_busy_ms=length(compute_busy) / 1000 / n,
        compute_idle_ms=length(idle) / 1000 / n,
        idle_while_copying_ms=length(idle_copying) / 1000 / n,
        idle_gpu_idle_ms=(length(idle_rest) - length(idle_other)) / 1000 / n,
        idle_other_ms=length(idle_other) / 1000 / n,
        d2h=direction("d2h"),
        h2d=direction("h2d"),
        both_directions_ms=length(intersect(d2h_spans, h2d_spans)) / 1000 / n,
        copies_on_compute_ms=length(merge(iv for iv, _ in on_compute)) / 1000 / n,
        copies_on_compute_gib=sum(b for _, b in on_compute) / GiB / n,
        runtime_calls_ms={k: v / 1000 / n for k, v in top},
        gpu_idle_host_ops_ms=_top(host_during(host_ops, gpu_idle), top_calls + 2, iterations),
        gpu_idle_runtime_calls_ms=_top(
            {k: v for k, v in idle_calls.items() if v > 0.0}, top_calls, iterations
        ),
        gpu_idle_gaps=longest_gaps(gpu_idle, host_ops, gpu_events, top_gaps),
        phases=_phases(
            phase_ranges, launched_at, gpu_launches, compute, compute_busy, idle_copying, n
        ),
    )


def _phases(
    ranges: list[tuple[float, float, str]],
    launched_at: dict[object, float],
    launches: Sequence[tuple[object, int, str, Interval, float]],
    compute: int,
    compute_busy: Sequence[Interval],
    idle_copying: Sequence[Interval],
    n: float,
) -> dict[str, dict[str, float]]:
    """StreamBreakdown.phases: each GPU event goes to the run of a phase (one host range)
    that holds the runtime call that launched it (by correlation id); each run's span on the
    compute stream runs from its first kernel there to its last, and a phase's figures are
    the sums over its runs (one an iteration), per iteration over ``n``."""
    if not ranges:
        return {}
    ranges.sort()
    starts = [r[0] for r in ranges]
    spans: dict[int, list[Interval]] = defaultdict(list)  # by run (index into ranges)
    copies: dict[int, list[tuple[str, Interval, float]]] = defaultdict(list)
    for correlation, stream, direction, interval, nbytes in launches:
        at = launched_at.get(correlation)
        if at is None:
            continue
        i = bisect.bisect_right(starts, at) - 1
        if i < 0 or at > ranges[i][1]:
            continue
        if stream == compute:
            spans[i].append(interval)
        if direction:
            copies[i].append((direction, interval, nbytes))
    out: dict[str, dict[str, float]] = {}
    for i, (_, _, phase) in enumerate(ranges):  # in the order the phases first ran
        own = spans.get(i, [])
        window = [(min(s for s, _ in own), max(e for _, e in own))] if own else []
        record = out.setdefault(
            phase,
            {
                "span_ms": 0.0,
                "busy_ms": 0.0,
                "idle_while_copying_ms": 0.0,
                "d2h_gib": 0.0,
                "d2h_busy_ms": 0.0,
                "h2d_gib": 0.0,
                "h2d_busy_ms": 0.0,
            },
        )
        record["span_ms"] += length(window) / 1000 / n
        record["busy_ms"] += length(intersect(window, list(compute_busy))) / 1000 / n
        record["idle_while_copying_ms"] += length(intersect(window, list(idle_copying))) / 1000 / n
        for direction in ("d2h", "h2d"):
            moved = [(iv, b) for d, iv, b in copies.get(i, []) if d == direction]
            record[f"{direction}_gib"] += sum(b for _, b in moved) / GiB / n
            record[f"{direction}_busy_ms"] += length(merge(iv for iv, _ in moved)) / 1000 / n
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Per-iteration stream breakdown of a torch.profiler Chrome trace: compute "
        "busy and idle time, copy time and rate each way, host time in CUDA runtime calls."
    )
    parser.add_argument("trace", type=Path, help="Chrome trace (prof.export_chrome_trace)")
    parser.add_argument(
        "--iterations", type=int, default=1, help="training iterations the trace covers"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    try:
        trace = json.loads(args.trace.read_text())
        result = analyze(trace, args.iterations)
    except (OSError, json.JSONDecodeError, ValueError) as exc:
        print(f"stream_profile.py: {args.trace}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.record(), indent=1) if args.json else result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
