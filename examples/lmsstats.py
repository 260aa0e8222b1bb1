#!/usr/bin/env python3
"""Per-iteration Large Model Support statistics: a CSV log and a PNG timeline.

As a library, in a training loop::

    from lmsstats import LmsStatsLogger

    with LmsStatsLogger("stats.csv") as log:
        for batch in data:
            with log.iteration():
                train_step(batch)
    log.plot("stats.png")          # needs matplotlib; the CSV never does

or call ``log.step()`` once at the end of every iteration (the first call opens the log).
Each row holds device memory allocated and reserved at the end of the iteration, the bytes
and storages LMS paged out and in during it, its reclaims, prefetches and the milliseconds
the compute stream waited for LMS copies (``stall_ms``), the gauges of host and paged-out
memory, and the iteration's wall time. Without LMS (or on a PyTorch without it) the LMS
columns are 0 and the memory columns still fill.

As a program::

    lmsstats.py plot stats.csv stats.png        # the timeline from a CSV (e.g. made on a GPU
                                                # machine without matplotlib)
    lmsstats.py summary stats.csv               # totals and per-iteration means

It stands alone (the standard library; torch while logging, matplotlib for the PNG): copy it
beside a training script, or import it from this folder (``ManyModel.py`` does).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Callable

# Cumulative LMS counters: a row holds their increase over the iteration.
COUNTERS = (
    "pageout_bytes",
    "pagein_bytes",
    "pageout_count",
    "pagein_count",
    "stall_ms",
    "prefetch_count",
    "prefetch_hits",
    "reclaims",
    "oom_count",
)
# Gauges: a row holds their value at the end of the iteration.
GAUGES = (
    "allocated_bytes",
    "reserved_bytes",
    "managed_bytes",
    "pagedout_bytes",
    "host_bytes",
)
COLUMNS = ("iteration", "start_s", "seconds", *GAUGES, *COUNTERS)
_RECLAIM_KEYS = (
    "reclaim_limit",
    "reclaim_speculative",
    "reclaim_alloc_failure",
    "reclaim_explicit",
)

Snapshot = dict[str, float]
Sampler = Callable[[], Snapshot]

GiB = float(1 << 30)


def snapshot_from(lms: Mapping[str, Any] | None, allocated: int, reserved: int) -> Snapshot:
    """A snapshot (the :data:`COUNTERS` and :data:`GAUGES`) from ``torch.cuda.lms_stats()``
    (None without LMS) and the allocator's allocated and reserved bytes."""
    snap: Snapshot = {"allocated_bytes": float(allocated), "reserved_bytes": float(reserved)}
    lms = lms or {}
    for key in COUNTERS:
        if key == "reclaims":
            snap[key] = float(sum(lms.get(k, 0) for k in _RECLAIM_KEYS))
        else:
            snap[key] = float(lms.get(key, 0))
    for key in ("managed_bytes", "pagedout_bytes", "host_bytes"):
        gauge = lms.get(key, {"current": 0})
        snap[key] = float(gauge["current"] if isinstance(gauge, Mapping) else gauge)
    return snap


def cuda_sampler(device: Any = None, synchronize: bool = True) -> Sampler:
    """Reads a CUDA device's statistics (after waiting for it, so times are complete)."""
    import torch

    def sample() -> Snapshot:
        if synchronize:
            torch.cuda.synchronize(device)
        lms = torch.cuda.lms_stats(device) if hasattr(torch.cuda, "lms_stats") else None
        return snapshot_from(
            lms, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        )

    return sample


def counter_delta(before: float, after: float) -> float:
    """The increase of a cumulative counter; a counter reset in between counts from 0."""
    return after - before if after >= before else after


class LmsStatsLogger:
    """Records one row of statistics per training iteration; optionally streams them to a CSV.

    Args:
        csv_path: where to write rows as they come (None: keep them in memory only).
        sampler: returns a snapshot of the device statistics (default: :func:`cuda_sampler`).
        clock: the wall clock (default ``time.perf_counter``).
    """

    def __init__(
        self,
        csv_path: str | Path | None = None,
        *,
        sampler: Sampler | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self._sampler = sampler
        self._clock = clock
        self.rows: list[dict[str, float]] = []
        self._origin: float | None = None
        self._last: tuple[float, Snapshot] | None = None
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None

    # -- recording ---------------------------------------------------------------------
    def _sample(self) -> Snapshot:
        if self._sampler is None:
            self._sampler = cuda_sampler()
        return self._sampler()

    def begin(self) -> None:
        """Marks the start of an iteration (optional when iterations follow each other)."""
        snap = self._sample()
        now = self._clock()
        if self._origin is None:
            self._origin = now
        self._last = (now, snap)

    def step(self) -> dict[str, float] | None:
        """Marks the end of an iteration and records its row.

        The iteration started at :meth:`begin` or, without one, at the previous :meth:`step`;
        the very first call without :meth:`begin` only opens the log and returns None.
        """
        snap = self._sample()
        now = self._clock()
        if self._last is None:
            self._origin = now
            self._last = (now, snap)
            return None
        start, before = self._last
        assert self._origin is not None
        row: dict[str, float] = {
            "iteration": float(len(self.rows)),
            "start_s": start - self._origin,
            "seconds": now - start,
        }
        for key in GAUGES:
            row[key] = snap[key]
        for key in COUNTERS:
            row[key] = counter_delta(before[key], snap[key])
        self.rows.append(row)
        self._write(row)
        self._last = (now, snap)
        return row

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """``with log.iteration(): step(...)`` records that block as one iteration."""
        self.begin()
        yield
        self.step()

    def __call__(self) -> dict[str, float] | None:
        """Callback form of :meth:`step`."""
        return self.step()

    # -- output ------------------------------------------------------------------------
    def _write(self, row: Mapping[str, float]) -> None:
        if self.csv_path is None:
            return
        if self._writer is None:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.csv_path.open("w", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=list(COLUMNS))
            self._writer.writeheader()
        assert self._file is not None
        self._writer.writerow(format_row(row))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._writer = None

    def __enter__(self) -> LmsStatsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def summary(self, skip: int = 0) -> dict[str, float]:
        return summarize(self.rows, skip=skip)

    def plot(self, png_path: str | Path, title: str = "") -> Path:
        return plot_rows(self.rows, png_path, title=title)


def format_row(row: Mapping[str, float]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in COLUMNS:
        value = float(row.get(key, 0.0))
        if key in ("seconds", "start_s"):
            out[key] = f"{value:.6f}"
        elif key == "stall_ms":
            out[key] = f"{value:.3f}"
        else:
            out[key] = str(int(value))
    return out


def read_csv(path: str | Path) -> list[dict[str, float]]:
    """Reads a CSV written by :class:`LmsStatsLogger`."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not an LMS statistics CSV (missing columns {missing})")
        return [{key: float(r[key]) for key in COLUMNS} for r in reader]


def summarize(rows: Sequence[Mapping[str, float]], skip: int = 0) -> dict[str, float]:
    """Totals of the counters and means per iteration, after ``skip`` warm-up iterations."""
    used = list(rows[skip:])
    out: dict[str, float] = {"iterations": float(len(used))}
    if not used:
        return out
    n = len(used)
    for key in COUNTERS:
        out[f"total_{key}"] = sum(r[key] for r in used)
    out["mean_seconds"] = sum(r["seconds"] for r in used) / n
    out["mean_pageout_bytes"] = out["total_pageout_bytes"] / n
    out["mean_pagein_bytes"] = out["total_pagein_bytes"] / n
    out["mean_stall_ms"] = out["total_stall_ms"] / n
    out["peak_allocated_bytes"] = max(r["allocated_bytes"] for r in used)
    out["peak_reserved_bytes"] = max(r["reserved_bytes"] for r in used)
    out["peak_host_bytes"] = max(r["host_bytes"] for r in used)
    return out


def plot_rows(rows: Sequence[Mapping[str, float]], png_path: str | Path, title: str = "") -> Path:
    """Draws the timeline (device memory; bytes paged out and in; stall and iteration time).

    Raises:
        ImportError: matplotlib is not installed (the CSV does not need it).
        ValueError: there are no rows.
    """
    if not rows:
        raise ValueError("no iterations recorded: nothing to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    it = [int(r["iteration"]) for r in rows]
    fig, (ax_mem, ax_bytes, ax_time) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax_mem.plot(it, [r["allocated_bytes"] / GiB for r in rows], marker=".", label="allocated")
    ax_mem.plot(it, [r["reserved_bytes"] / GiB for r in rows], marker=".", label="reserved")
    ax_mem.plot(
        it, [r["pagedout_bytes"] / GiB for r in rows], marker=".", label="paged out (held on host)"
    )
    ax_mem.set_ylabel("GiB at iteration end")
    ax_mem.set_title("device memory")
    ax_mem.legend(loc="best", fontsize="small")

    width = 0.4
    ax_bytes.bar(
        [i - width / 2 for i in it],
        [r["pageout_bytes"] / GiB for r in rows],
        width,
        label="paged out (D2H)",
    )
    ax_bytes.bar(
        [i + width / 2 for i in it],
        [r["pagein_bytes"] / GiB for r in rows],
        width,
        label="paged in (H2D)",
    )
    ax_bytes.set_ylabel("GiB per iteration")
    ax_bytes.set_title("LMS copies")
    ax_bytes.legend(loc="best", fontsize="small")

    ax_time.bar(
        it,
        [r["stall_ms"] for r in rows],
        0.6,
        color="tab:red",
        label="compute stream waiting on copies",
    )
    ax_time.set_ylabel("stall ms per iteration")
    ax_time.set_xlabel("iteration")
    ax_time.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_time.set_title("time")
    ax_iter = ax_time.twinx()
    ax_iter.plot(
        it, [r["seconds"] * 1000 for r in rows], color="black", marker="o", label="iteration time"
    )
    ax_iter.set_ylabel("iteration ms")
    ax_iter.set_ylim(bottom=0)
    handles = ax_time.get_legend_handles_labels()[0] + ax_iter.get_legend_handles_labels()[0]
    labels = ax_time.get_legend_handles_labels()[1] + ax_iter.get_legend_handles_labels()[1]
    ax_time.legend(handles, labels, loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_summary(summary: Mapping[str, float]) -> str:
    n = int(summary.get("iterations", 0))
    if n == 0:
        return "no iterations"
    lines = [
        f"iterations:            {n}",
        f"mean iteration:        {summary['mean_seconds'] * 1000:.1f} ms",
        f"paged out:             {summary['total_pageout_bytes'] / GiB:.2f} GiB in "
        f"{int(summary['total_pageout_count'])} copies "
        f"({summary['mean_pageout_bytes'] / GiB:.2f} GiB per iteration)",
        f"paged in:              {summary['total_pagein_bytes'] / GiB:.2f} GiB in "
        f"{int(summary['total_pagein_count'])} copies "
        f"({summary['mean_pagein_bytes'] / GiB:.2f} GiB per iteration)",
        f"stall:                 {summary['total_stall_ms']:.1f} ms "
        f"({summary['mean_stall_ms']:.1f} ms per iteration)",
        f"prefetched:            {int(summary['total_prefetch_count'])} "
        f"({int(summary['total_prefetch_hits'])} hits)",
        f"reclaims:              {int(summary['total_reclaims'])}",
        f"peak allocated:        {summary['peak_allocated_bytes'] / GiB:.2f} GiB",
        f"peak reserved:         {summary['peak_reserved_bytes'] / GiB:.2f} GiB",
        f"peak pinned host:      {summary['peak_host_bytes'] / GiB:.2f} GiB",
    ]
    if not math.isclose(summary.get("total_oom_count", 0.0), 0.0):
        lines.append(f"LMS out-of-memory:     {int(summary['total_oom_count'])}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmsstats.py",
        description="Plot or summarize per-iteration Large Model Support statistics "
        "written by LmsStatsLogger (examples/lmsstats.py) or ManyModel.py --stats-csv.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="draw the PNG timeline of a statistics CSV")
    plot.add_argument("csv", type=Path, help="statistics CSV")
    plot.add_argument("png", type=Path, help="PNG to write")
    plot.add_argument("--title", default="", help="figure title")
    summary = sub.add_parser("summary", help="print totals and per-iteration means")
    summary.add_argument("csv", type=Path, help="statistics CSV")
    summary.add_argument(
        "--skip", type=int, default=0, help="leave out this many warm-up iterations (default 0)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rows = read_csv(args.csv)
    except (OSError, ValueError, KeyError) as exc:
        print(f"lmsstats.py: {exc}", file=sys.stderr)
        return 2
    if args.command == "plot":
        try:
            path = plot_rows(rows, args.png, title=args.title or args.csv.stem)
        except ImportError:
            print(
                "lmsstats.py: matplotlib is not installed (pip install matplotlib)", file=sys.stderr
            )
            return 2
        except ValueError as exc:
            print(f"lmsstats.py: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
        return 0
    if args.skip < 0:
        print("lmsstats.py: --skip must be >= 0", file=sys.stderr)
        return 2
    print(format_summary(summarize(rows, skip=args.skip)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
