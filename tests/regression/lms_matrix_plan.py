"""Host-memory arithmetic and outcome classification of the matrix's rows beyond the device.

Pure functions (no torch, no device), checked on a CPU by
``tests/regression_cpu/test_host_budget_cpu.py``: the host memory that the no-cap and
shared-GPU rows of ``test_families.py`` need (they skip on a host with less), the host
budget of the row in which four processes share one, the environment variable that carries
a host budget to a worker, and what became of a worker process: it finished, it ended with
a clean ``torch.OutOfMemoryError`` of host or of device memory, it failed otherwise, or a
signal killed it (the kernel's OOM killer sends SIGKILL, and the process leaves no log).

Where the page-outs go: LMS copies what does not fit on the device to pinned host memory,
which the kernel can neither swap nor reclaim. A run whose page-outs and processes pass the
host's memory is ended by the OOM killer, without a word; with a host budget
(``torch.cuda.set_host_limit_lms``, ``lms_host_limit_mb``) LMS refuses page-outs beyond it
and the operator that needed one raises ``torch.OutOfMemoryError`` naming host memory.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmsbench.harness import first_line, signal_name

MiB = 1024**2
GiB = 1024**3

# Every LMS process leaves 5% of the device free: its limit is the device less what anything
# but its own caching allocator holds, less this headroom (docs/using-lms.md, "The limit").
LMS_HEADROOM_SHARE = 0.05
# Device memory a process holds outside its caching allocator: its CUDA context and the
# cuBLAS workspace (about 0.6 GB a process on an H100: the 1.1x no-cap row of 2026-11-23 ran
# under a limit of the device less 5% less 1.2 GB for the worker and the test session).
CONTEXT_BYTES = 1 * GiB
# Pinned host memory held beyond the least that must be off the device. The DeepMLP's
# page-outs are all of one size, so LMS's host pool reuses its buffers: the 1.1x row held
# 13.36e9 bytes for a need 13.96e9 above its limit. The margin covers early page-outs of the
# learned schedule and buffers the pool keeps between steps.
PAGEOUT_SLACK = 0.15
# Host memory of one worker process besides its page-outs: Python, torch and the CUDA
# libraries with a context (1-2 GiB resident), and the CPU copies of the gradients and
# parameters of its runs (64 MiB each for the DeepMLP).
PROCESS_HOST_BYTES = 3 * GiB
# Host memory for the kernel and for the test session itself (pytest with torch and a CUDA
# context of its own).
HOST_RESERVE_BYTES = 6 * GiB

# The environment variable that carries LMS settings to a process, by LMS backend: a stock
# caching allocator rejects keys it does not know in PYTORCH_CUDA_ALLOC_CONF, so the drop-in
# extension reads the same keys from PYTORCH_LMS_CONF.
LMS_CONF_VARIABLE = {"patched": "PYTORCH_CUDA_ALLOC_CONF", "extension": "PYTORCH_LMS_CONF"}

# The out-of-memory message of the LMS engine names pinned host memory when it lists the
# storages it could not page out ("... or without pinned host memory to page to"); that is a
# device out-of-memory error, not a refusal of the host budget.
DEVICE_OOM_HOST_PHRASE = "without pinned host memory to page to"


# ---------------------------------------------------------------------------------------
# Host memory of the rows
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostNeed:
    """Host memory a row needs: pinned page-outs, its worker processes, a reserve."""

    pinned_bytes: int
    processes_bytes: int
    reserve_bytes: int = HOST_RESERVE_BYTES

    @property
    def total_bytes(self) -> int:
        return self.pinned_bytes + self.processes_bytes + self.reserve_bytes

    def describe(self) -> str:
        return (
            f"{self.total_bytes / GiB:.0f} GiB ({self.pinned_bytes / GiB:.0f} GiB of pinned "
            f"page-outs, {self.processes_bytes / GiB:.0f} GiB for the worker processes, "
            f"{self.reserve_bytes / GiB:.0f} GiB for the system and the test session)"
        )


def lms_device_room(device_bytes: int, processes: int = 1) -> int:
    """Device memory that the tensors of ``processes`` LMS workers can hold together with no
    cap: the device less the 5% headroom, less a CUDA context for each worker and for the
    test session."""
    room = int(device_bytes * (1 - LMS_HEADROOM_SHARE)) - (processes + 1) * CONTEXT_BYTES
    return max(0, room)


def deficit_bytes(need_bytes: int, device_bytes: int, processes: int = 1) -> int:
    """What must be off the device at the peak: the need (of all processes together) less
    :func:`lms_device_room`."""
    return max(0, need_bytes - lms_device_room(device_bytes, processes))


def with_slack(nbytes: int) -> int:
    return math.ceil((1 + PAGEOUT_SLACK) * nbytes)


def nocap_host_need(factor: float, device_bytes: int) -> HostNeed:
    """Host memory of a no-cap row whose training needs ``factor`` x the device.

    Pinned: the deficit, ``(factor - 1) x device`` plus the 5% headroom and the two CUDA
    contexts, with :data:`PAGEOUT_SLACK`; the worker process (the micro-batched reference
    runs on the device, its CPU copies are small) and the reserve besides. On an 80 GB H100
    (79.2 GiB) that is 98 + 3 + 6 = 107 GiB at 2x and 30 + 9 = 39 GiB at 1.25x, where the
    earlier rule, (factor + 0.1) x device, asked 166 GiB for 2x.
    """
    need = int(factor * device_bytes)
    return HostNeed(with_slack(deficit_bytes(need, device_bytes)), PROCESS_HOST_BYTES)


def share_host_need(processes: int, fraction: float, device_bytes: int) -> HostNeed:
    """Host memory of ``processes`` workers on one GPU with no cap, each needing
    ``fraction`` of the device: their deficit together (the device is shared, so what does
    not fit of all of them is on the host at once), with slack, and the processes."""
    need = int(processes * fraction * device_bytes)
    pinned = with_slack(deficit_bytes(need, device_bytes, processes))
    return HostNeed(pinned, processes * PROCESS_HOST_BYTES)


def too_low_host_limit(need_bytes: int, device_bytes: int, share: float = 0.5) -> int:
    """A host limit of ``share`` of the deficit of one no-cap process (in whole MiB, as
    ``--host-limit-mb`` passes it): LMS cannot hold what must be off the device."""
    limit = int(share * deficit_bytes(need_bytes, device_bytes))
    return limit // MiB * MiB


@dataclass(frozen=True)
class ShareBudget:
    """The host budget of processes sharing one GPU under equal device caps, in waves.

    The first ``first_wave`` processes train up to the end of their forward pass and wait
    there, their page-outs held; then the others do the same. A process holds at least
    ``held_min_bytes`` on the host at that point (its tensors alive after the forward pass
    less the cap: the allocator holds no more than the cap) and at most
    ``pageout_max_bytes`` during its run (its need less the LMS limit under the cap, with
    slack). The budget lies between the two bounds:

    - ``low_bytes``: the first wave's page-outs, at most, fit: those processes finish;
    - ``high_bytes``: the first wave's held page-outs and one more process's do not fit:
      every later process is refused before the end of its forward pass, even alone.

    Every bound is above one process's page-outs, so a process alone would fit: a refusal
    shows that the budget counted the other processes' page-outs (one budget for the host).
    """

    need_bytes: int
    cap_bytes: int
    held_min_bytes: int
    pageout_max_bytes: int
    first_wave: int
    low_bytes: int
    high_bytes: int
    budget_bytes: int

    @property
    def budget_mib(self) -> int:
        return self.budget_bytes // MiB

    def describe(self) -> str:
        g = GiB
        return (
            f"host budget {self.budget_bytes / g:.1f} GiB, between {self.low_bytes / g:.1f} GiB "
            f"(the page-outs of the first {self.first_wave}, at most "
            f"{self.pageout_max_bytes / g:.1f} GiB each) and {self.high_bytes / g:.1f} GiB "
            f"(those held at the end of the forward pass, at least "
            f"{self.held_min_bytes / g:.1f} GiB each, by {self.first_wave + 1} processes); "
            f"each process needs {self.need_bytes / g:.1f} GiB under a cap of "
            f"{self.cap_bytes / g:.1f} GiB"
        )


# The drop-in's LMS limit under set_per_process_memory_fraction: 95% of the cap.
LMS_CAP_SHARE = 0.95


def share_host_budget(
    need_bytes: int, tensor_bytes: int, cap_bytes: int, first_wave: int
) -> ShareBudget:
    """The host budget of ``test_share_host_budget`` (see :class:`ShareBudget`).

    ``need_bytes`` is one process's peak need (``mlp_need_bytes``), ``tensor_bytes`` one of
    its ``tokens x width`` activations: after the forward pass the need less the two
    gradients of the backward is alive. Raises ValueError when no budget separates the
    waves (the cap leaves too little to page out).
    """
    held_min = need_bytes - 2 * tensor_bytes - cap_bytes
    pageout_max = with_slack(need_bytes - int(LMS_CAP_SHARE * cap_bytes))
    low = first_wave * pageout_max
    high = (first_wave + 1) * held_min
    if held_min <= 0 or low >= high:
        raise ValueError(
            f"no host budget separates the first {first_wave} process(es) from the others: "
            f"their page-outs, at most {low / GiB:.1f} GiB, reach what one more process "
            f"holds with them, {high / GiB:.1f} GiB"
        )
    budget = (low + high) // 2 // MiB * MiB
    return ShareBudget(
        need_bytes=need_bytes,
        cap_bytes=cap_bytes,
        held_min_bytes=held_min,
        pageout_max_bytes=pageout_max,
        first_wave=first_wave,
        low_bytes=low,
        high_bytes=high,
        budget_bytes=budget,
    )


def share_budget_host_need(budget: ShareBudget, processes: int) -> HostNeed:
    """Host memory of the shared-budget row: the budget bounds the page-outs of all."""
    return HostNeed(budget.budget_bytes, processes * PROCESS_HOST_BYTES)


def host_limit_env(
    backend: str,
    host_limit_mb: int,
    env: Mapping[str, str],
    host_wait_s: float | None = None,
    spill_dir: Path | None = None,
) -> dict[str, str]:
    """``env`` with ``lms_host_limit_mb:<MiB>`` (and ``lms_host_wait_s:<s>`` when
    ``host_wait_s`` is given, ``lms_spill_dir:<path>`` when ``spill_dir`` is) added to the
    LMS settings variable of ``backend`` (``"patched"`` or ``"extension"``), after any
    settings already there."""
    try:
        name = LMS_CONF_VARIABLE[backend]
    except KeyError:
        raise ValueError(f"unknown LMS backend {backend!r}") from None
    out = dict(env)
    setting = f"lms_host_limit_mb:{int(host_limit_mb)}"
    if host_wait_s is not None:
        setting += f",lms_host_wait_s:{host_wait_s:g}"
    if spill_dir is not None:
        if "," in str(spill_dir):
            raise ValueError(f"a spill directory in {name} cannot hold a comma: {spill_dir}")
        setting += f",lms_spill_dir:{spill_dir}"
    out[name] = f"{out[name]},{setting}" if out.get(name) else setting
    return out


# ---------------------------------------------------------------------------------------
# Host memory of this machine
# ---------------------------------------------------------------------------------------


def parse_meminfo_total(text: str) -> int:
    """``MemTotal`` of a /proc/meminfo text, in bytes."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemTotal line")


def parse_cgroup_limit(text: str) -> int | None:
    """A cgroup memory limit file's value in bytes (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); ``None`` for no limit (``max``, or v1's page-rounded
    2**63)."""
    value = text.strip()
    if not value or value == "max":
        return None
    limit = int(value)
    return None if limit >= 2**62 else limit


CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def usable_host_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup_files: Iterable[Path] = CGROUP_LIMIT_FILES
) -> int:
    """The host memory this process may use: ``MemTotal``, or the cgroup's memory limit
    where that is lower (a container)."""
    usable = parse_meminfo_total(meminfo.read_text())
    for path in cgroup_files:
        try:
            limit = parse_cgroup_limit(path.read_text())
        except (OSError, ValueError):
            continue
        if limit is not None:
            usable = min(usable, limit)
    return usable


# ---------------------------------------------------------------------------------------
# What became of a worker
# ---------------------------------------------------------------------------------------

FINISHED = "finished"
HOST_OOM = "host OOM"
DEVICE_OOM = "device OOM"
ERROR = "error"
SIGNALLED = "signal"


def names_host_memory(message: str) -> bool:
    """Whether an error message names host memory (beyond the device out-of-memory
    message's list of storages without pinned host memory to page to)."""
    text = message.lower().replace(DEVICE_OOM_HOST_PHRASE, "")
    return "host memory" in text


def count_of(value: Any) -> int | None:
    """A counter of ``lms_stats()`` (an int, or a gauge's ``current``), else ``None``."""
    if isinstance(value, Mapping):
        value = value.get("current")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def host_refusals(data: Mapping[str, Any]) -> int | None:
    """``host_refusals`` of a worker's LMS statistics: at the error, else at the end;
    ``None`` where the worker recorded none (an LMS build without a host budget)."""
    for key in ("lms_at_error", "lms"):
        stats = data.get(key)
        if isinstance(stats, Mapping) and "host_refusals" in stats:
            return count_of(stats["host_refusals"])
    return None


def exit_description(returncode: int | None) -> str:
    """``exit status N``, or the signal that ended the process (a negative return code, as
    ``subprocess`` gives it)."""
    if returncode is not None and returncode < 0:
        return f"killed by {signal_name(-returncode)} (signal {-returncode})"
    return f"exit status {returncode}"


@dataclass(frozen=True)
class Outcome:
    """What became of one worker process."""

    kind: str  # FINISHED, HOST_OOM, DEVICE_OOM, ERROR or SIGNALLED
    returncode: int | None
    detail: str
    signal: int | None = None

    @property
    def label(self) -> str:
        """A few words for the results and the summary table."""
        if self.kind == SIGNALLED and self.signal is not None:
            return f"killed by {signal_name(self.signal)}"
        return self.kind

    @property
    def clean(self) -> bool:
        """Ended by itself, not by a signal."""
        return self.kind != SIGNALLED


def classify(returncode: int | None, data: Mapping[str, Any]) -> Outcome:
    """What became of a worker, from its exit status (negative: the signal that ended it,
    as ``subprocess`` reports it) and the results it wrote (``stage``, ``error_type``,
    ``error_message``, LMS statistics at the error)."""
    if returncode is not None and returncode < 0:
        number = -returncode
        detail = f"killed by {signal_name(number)} (signal {number}) in stage {data.get('stage')!r}"
        if number == signal.SIGKILL:
            detail += (
                ": the kernel's OOM killer ends processes so when host memory runs out "
                "(its log is in dmesg)"
            )
        return Outcome(SIGNALLED, returncode, detail, signal=number)
    stage = data.get("stage")
    error_type = data.get("error_type")
    message = str(data.get("error_message") or data.get("error") or "")
    if error_type == "OutOfMemoryError":
        refusals = host_refusals(data)
        host = names_host_memory(message) or (refusals is not None and refusals > 0)
        kind = HOST_OOM if host else DEVICE_OOM
        return Outcome(
            kind,
            returncode,
            f"torch.OutOfMemoryError in stage {stage!r} (host refusals {refusals}): "
            f"{first_line(message, mark='...')}",
        )
    if error_type:
        return Outcome(
            ERROR, returncode, f"{error_type} in stage {stage!r}: {first_line(message, mark='...')}"
        )
    if returncode == 0 and stage == "done":
        return Outcome(FINISHED, returncode, "finished")
    if returncode is None:
        return Outcome(ERROR, returncode, f"still running in stage {stage!r}")
    return Outcome(
        ERROR,
        returncode,
        f"exit status {returncode} in stage {stage!r} without a recorded error",
    )
