"""The host-memory arithmetic and worker outcomes of the matrix's rows beyond the device.

``tests/regression/lms_matrix_plan.py`` on a CPU: the host memory the no-cap and shared-GPU
rows need (they skip below it), the host budget of ``test_share_host_budget``, the
environment that carries a host budget to a worker, this machine's usable host memory, and
the classification of what became of a worker process. Sizes are those of an 80 GB H100
(the device of the GPU runs) and its 128 GiB host.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.regression import lms_matrix_plan as plan
from tests.regression.lms_matrix_plan import GiB, MiB

H100 = 85_017_493_504  # total_memory of an NVIDIA H100 80GB HBM3 (79.2 GiB)
HOST = 125 * GiB  # MemTotal of a 128 GiB host, less what the kernel keeps


# ---------------------------------------------------------------------------------------
# Host memory of the rows
# ---------------------------------------------------------------------------------------


def test_device_room_leaves_the_headroom_and_the_contexts() -> None:
    assert plan.lms_device_room(100 * GiB, 1) == 95 * GiB - 2 * plan.CONTEXT_BYTES
    assert plan.lms_device_room(100 * GiB, 4) == 95 * GiB - 5 * plan.CONTEXT_BYTES
    assert plan.lms_device_room(GiB, 8) == 0
    assert plan.deficit_bytes(50 * GiB, 100 * GiB) == 0
    assert plan.deficit_bytes(100 * GiB, 100 * GiB) == 5 * GiB + 2 * plan.CONTEXT_BYTES


@pytest.mark.parametrize("factor", [1.25, 2.0])
def test_nocap_needs_the_deficit_not_the_whole_need(factor: float) -> None:
    need = plan.nocap_host_need(factor, H100)
    deficit = (factor - 1) * H100
    # At least what must be off the device, at most that plus headroom, contexts and slack.
    assert (
        deficit < need.pinned_bytes < (1 + plan.PAGEOUT_SLACK) * (deficit + 0.05 * H100) + (3 * GiB)
    )
    assert need.processes_bytes == plan.PROCESS_HOST_BYTES
    assert need.total_bytes == need.pinned_bytes + plan.PROCESS_HOST_BYTES + plan.HOST_RESERVE_BYTES


def test_nocap_2x_runs_on_a_128_gib_host_with_an_80_gb_gpu() -> None:
    need = plan.nocap_host_need(2.0, H100)
    assert 80 * GiB < need.pinned_bytes < 100 * GiB  # about the device's size pinned
    assert need.total_bytes < HOST
    assert round(need.total_bytes / GiB) == 107  # the figure of test_nocap's docstring
    assert round(plan.nocap_host_need(1.25, H100).total_bytes / GiB) == 39
    # The earlier rule, (factor + 0.1) x device, skipped it.
    assert 2.1 * H100 > HOST
    assert "pinned page-outs" in need.describe()


def test_nocap_need_grows_with_the_factor() -> None:
    needs = [plan.nocap_host_need(f, H100).total_bytes for f in (1.0, 1.1, 1.25, 1.5, 2.0, 3.0)]
    assert needs == sorted(needs) and len(set(needs)) == len(needs)
    # A need of the device itself still pages out the headroom and the contexts.
    assert 0 < plan.nocap_host_need(1.0, H100).pinned_bytes < 7 * GiB


def test_share_needs_the_processes_deficit_together() -> None:
    two = plan.share_host_need(2, 0.6, H100)
    four = plan.share_host_need(4, 0.5, H100)
    assert round(two.total_bytes / GiB) == 38 and round(four.total_bytes / GiB) == 119
    assert four.processes_bytes == 4 * plan.PROCESS_HOST_BYTES
    assert four.total_bytes < HOST  # 4 x 50% runs on the 128 GiB host
    # Together 2x the device: what does not fit of all of them is pinned at once.
    assert four.pinned_bytes > plan.nocap_host_need(2.0, H100).pinned_bytes
    assert plan.share_host_need(2, 0.4, H100).pinned_bytes == 0


def test_too_low_host_limit_is_half_the_deficit_in_whole_mib() -> None:
    need = int(1.25 * H100)
    limit = plan.too_low_host_limit(need, H100)
    assert limit % MiB == 0
    assert abs(limit - plan.deficit_bytes(need, H100) / 2) < MiB
    # Below the deficit even where the contexts take less than assumed (0.6 GB measured).
    measured_deficit = need - (0.95 * H100 - 1.2e9)
    assert limit < measured_deficit / 2 + 2 * GiB < measured_deficit
    assert plan.too_low_host_limit(H100 // 2, H100) == 0


def mlp_sizes(fraction: float) -> tuple[int, int]:
    """Need and activation size of the shared-GPU DeepMLP, as the worker computes them."""
    pytest.importorskip("torch")
    from tests.regression.lms_families import mlp_need_bytes, mlp_tokens_for
    from tests.regression.lms_matrix_worker import MLP_LAYERS, MLP_WIDTH

    tokens = mlp_tokens_for(int(fraction * H100), MLP_WIDTH, MLP_LAYERS)
    return mlp_need_bytes(tokens, MLP_WIDTH, MLP_LAYERS), tokens * MLP_WIDTH * 4


def test_share_budget_of_the_row_separates_the_waves() -> None:
    need, tensor = mlp_sizes(0.5)
    budget = plan.share_host_budget(need, tensor, int(0.2 * H100), first_wave=1)
    # The figures of test_share_host_budget's docstring.
    assert round(need / 1e9, 1) == 42.5 and round(budget.cap_bytes / 1e9, 1) == 17.0
    assert round(budget.held_min_bytes / 1e9, 1) == 23.1
    assert round(budget.pageout_max_bytes / 1e9, 1) == 30.3
    assert round(budget.budget_bytes / 1e9, 1) == 38.2
    assert round(budget.budget_bytes / GiB, 1) == 35.6
    assert budget.budget_mib * MiB == budget.budget_bytes
    # The first process's page-outs fit, with room to spare...
    assert budget.budget_bytes - budget.pageout_max_bytes > 5 * GiB
    # ...and whatever it holds at the end of its forward pass, no later process fits beside it.
    left = budget.budget_bytes - budget.held_min_bytes
    assert budget.held_min_bytes - left > 5 * GiB
    # One process alone would fit: a refusal counts the others' page-outs.
    assert budget.budget_bytes > budget.pageout_max_bytes
    host = plan.share_budget_host_need(budget, 4)
    assert round(host.total_bytes / GiB) == 54 and host.total_bytes < HOST
    assert "35.6 GiB" in budget.describe()


@pytest.mark.parametrize("first_wave", [1, 2])
@pytest.mark.parametrize("cap_share", [0.1, 0.15, 0.2])
def test_share_budget_bounds(first_wave: int, cap_share: float) -> None:
    need, tensor = mlp_sizes(0.5)
    budget = plan.share_host_budget(need, tensor, int(cap_share * H100), first_wave)
    assert budget.low_bytes <= budget.budget_bytes < budget.high_bytes
    assert budget.low_bytes == first_wave * budget.pageout_max_bytes
    assert budget.high_bytes == (first_wave + 1) * budget.held_min_bytes
    # Every later process is refused before the end of its forward pass, even alone.
    assert budget.budget_bytes - first_wave * budget.held_min_bytes < budget.held_min_bytes


def test_share_budget_refuses_a_cap_that_leaves_nothing_to_separate() -> None:
    need, tensor = mlp_sizes(0.5)
    with pytest.raises(ValueError, match="no host budget separates"):
        plan.share_host_budget(need, tensor, int(0.45 * H100), first_wave=1)
    with pytest.raises(ValueError, match="no host budget separates"):
        plan.share_host_budget(need, tensor, int(0.3 * H100), first_wave=3)


def test_host_limit_env_uses_the_backends_variable() -> None:
    env = {"PATH": "/bin", "PYTORCH_LMS_CONF": "lms_size_mb:2"}
    out = plan.host_limit_env("extension", 36470, env)
    assert out["PYTORCH_LMS_CONF"] == "lms_size_mb:2,lms_host_limit_mb:36470"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in out and out["PATH"] == "/bin"
    assert env["PYTORCH_LMS_CONF"] == "lms_size_mb:2"  # not changed in place
    out = plan.host_limit_env("patched", 512, {"PYTORCH_CUDA_ALLOC_CONF": ""})
    assert out["PYTORCH_CUDA_ALLOC_CONF"] == "lms_host_limit_mb:512"
    out = plan.host_limit_env("patched", 512, {"PYTORCH_CUDA_ALLOC_CONF": "lms:True"})
    assert out["PYTORCH_CUDA_ALLOC_CONF"] == "lms:True,lms_host_limit_mb:512"
    out = plan.host_limit_env("extension", 512, {}, host_wait_s=0)
    assert out["PYTORCH_LMS_CONF"] == "lms_host_limit_mb:512,lms_host_wait_s:0"
    out = plan.host_limit_env("extension", 512, {}, host_wait_s=0, spill_dir=Path("/var/tmp"))
    assert out["PYTORCH_LMS_CONF"] == (
        "lms_host_limit_mb:512,lms_host_wait_s:0,lms_spill_dir:/var/tmp"
    )
    with pytest.raises(ValueError, match="cannot hold a comma"):
        plan.host_limit_env("extension", 512, {}, spill_dir=Path("/tmp/a,b"))
    with pytest.raises(ValueError, match="unknown LMS backend"):
        plan.host_limit_env("none", 1, {})


# ---------------------------------------------------------------------------------------
# This machine's host memory
# ---------------------------------------------------------------------------------------

MEMINFO = "MemTotal:       131841232 kB\nMemFree:        1000 kB\nMemAvailable:   2000 kB\n"


def test_parse_meminfo_and_cgroup_limits() -> None:
    assert plan.parse_meminfo_total(MEMINFO) == 131841232 * 1024
    with pytest.raises(ValueError):
        plan.parse_meminfo_total("MemFree: 1 kB\n")
    assert plan.parse_cgroup_limit("max\n") is None
    assert plan.parse_cgroup_limit("") is None
    assert plan.parse_cgroup_limit("9223372036854771712\n") is None  # v1: no limit
    assert plan.parse_cgroup_limit("68719476736\n") == 64 * GiB


def test_usable_host_memory_takes_the_lower_of_host_and_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    missing = tmp_path / "absent"
    assert plan.usable_host_memory(meminfo, [missing]) == 131841232 * 1024
    v2.write_text("max\n")
    assert plan.usable_host_memory(meminfo, [v2, missing]) == 131841232 * 1024
    v1.write_text(f"{64 * GiB}\n")
    assert plan.usable_host_memory(meminfo, [v2, v1]) == 64 * GiB
    v2.write_text("garbage\n")
    assert plan.usable_host_memory(meminfo, [v2]) == 131841232 * 1024
    assert plan.usable_host_memory() > 0  # this machine's


# ---------------------------------------------------------------------------------------
# What became of a worker
# ---------------------------------------------------------------------------------------

# The engine's device out-of-memory message (LargeModelSupportOutOfMemory.cpp,
# describeOutOfMemory):
# it names pinned host memory in its list of what could not be paged out.
DEVICE_OOM = (
    "CUDA out of memory with Large Model Support. Tried to allocate 1152.00 MiB on device 0 "
    "after paging out every reclaimable storage. 70000.00 MiB is allocated to tensors: "
    "2304.00 MiB pinned by the running operator(s), 0.00 MiB allocated by them and not "
    "released yet, 0.00 MiB inactive (0 storages below the LMS size threshold of 1.00 MiB "
    "or without pinned host memory to page to), the rest too small or not yet used by an "
    "operator."
)
HOST_OOM = (
    "CUDA out of memory with Large Model Support: paging out 1152.00 MiB would pass the "
    "host memory budget of 12928.00 MiB (12920.00 MiB pinned by LMS processes of this host)"
)


def oom(message: str, **extra: Any) -> dict[str, Any]:
    return {"stage": "lms", "error_type": "OutOfMemoryError", "error_message": message, **extra}


def test_names_host_memory_leaves_out_the_device_messages_list() -> None:
    assert plan.names_host_memory(HOST_OOM)
    assert plan.names_host_memory("Out of HOST MEMORY")
    assert not plan.names_host_memory(DEVICE_OOM)
    assert not plan.names_host_memory("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_classify_finished_and_errors() -> None:
    done = plan.classify(0, {"stage": "done"})
    assert (done.kind, done.label, done.clean) == (plan.FINISHED, "finished", True)
    host = plan.classify(1, oom(HOST_OOM))
    assert (host.kind, host.label, host.clean) == (plan.HOST_OOM, "host OOM", True)
    assert "paging out 1152.00 MiB" in host.detail and "stage 'lms'" in host.detail
    device = plan.classify(1, oom(DEVICE_OOM))
    assert device.kind == plan.DEVICE_OOM and device.label == "device OOM"
    # The device message with refused page-outs counted: the host budget stopped it.
    refused = plan.classify(1, oom(DEVICE_OOM, lms_at_error={"host_refusals": 2}))
    assert refused.kind == plan.HOST_OOM and "host refusals 2" in refused.detail
    # Only the traceback recorded (an older worker): its text is read.
    assert plan.classify(1, {"error_type": "OutOfMemoryError", "error": HOST_OOM}).kind == (
        plan.HOST_OOM
    )
    other = plan.classify(1, {"stage": "training", "error_type": "TimeoutError", "error": "x"})
    assert other.kind == plan.ERROR and "TimeoutError in stage 'training'" in other.detail
    silent = plan.classify(3, {"stage": "training"})
    assert silent.kind == plan.ERROR and "exit status 3" in silent.detail
    assert plan.classify(0, {"stage": "lms"}).kind == plan.ERROR  # exited 0 before the end
    assert plan.classify(None, {}).kind == plan.ERROR


def test_classify_signals_name_sigkill_and_the_oom_killer() -> None:
    killed = plan.classify(-signal.SIGKILL, {"stage": "training"})
    assert (killed.kind, killed.signal, killed.clean) == (plan.SIGNALLED, 9, False)
    assert killed.label == "killed by SIGKILL"
    assert "OOM killer" in killed.detail and "stage 'training'" in killed.detail
    # A signal decides even where the results say otherwise (written before it came).
    segv = plan.classify(-signal.SIGSEGV, {"stage": "done"})
    assert segv.label == "killed by SIGSEGV" and "OOM killer" not in segv.detail
    assert plan.classify(-200, {}).label == "killed by signal 200"
    assert plan.exit_description(-9) == "killed by SIGKILL (signal 9)"
    assert plan.exit_description(1) == "exit status 1"


def test_host_refusals_from_the_worker_results() -> None:
    assert plan.host_refusals({"lms_at_error": {"host_refusals": 4}, "lms": {}}) == 4
    assert plan.host_refusals({"lms": {"host_refusals": 0}}) == 0
    assert plan.host_refusals({"lms": {"host_refusals": {"current": 2, "peak": 3}}}) == 2
    assert plan.host_refusals({"lms_at_error": "unreadable: RuntimeError"}) is None
    assert plan.host_refusals({"lms": {"pageout_bytes": 1}}) is None  # a build without it
    assert plan.count_of(True) is None and plan.count_of("3") is None
