"""torch/cuda/lms.py on the CPU: argument checks, device resolution, binding calls, stats and
the memory_summary() section, against a fake bindings object."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lmstool import tables

torch = pytest.importorskip("torch", reason="needs a torch wheel (the CPU one is enough)")

ROOT = Path(__file__).resolve().parents[2]
LMS_PY = ROOT / "engine/torch/cuda/lms.py"
MiB = 1024 * 1024


def load_lms() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lms_under_test", LMS_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stats_dict(**overrides: Any) -> dict[str, Any]:
    stats: dict[str, Any] = {
        "pageout_count": 3,
        "pageout_bytes": 3 * 4 * MiB,
        "pagein_count": 2,
        "pagein_bytes": 2 * 4 * MiB,
        "reclaim_limit": 1,
        "reclaim_speculative": 0,
        "reclaim_alloc_failure": 0,
        "reclaim_explicit": 1,
        "pack_count": 1,
        "pack_bytes": 8 * MiB,
        "workspace_releases": 1,
        "fragment_reclaims": 1,
        "fragment_placements": 2,
        "host_placement_count": 1,
        "host_placement_bytes": 40 * MiB,
        "input_host_placement_count": 1,
        "input_host_placement_bytes": 64 * MiB,
        "alloc_from_cache": 5,
        "alloc_from_device": 7,
        "alloc_after_reclaim": 1,
        "prefetch_count": 4,
        "prefetch_hits": 3,
        "prefetch_late": 1,
        "pagein_demand_count": 2,
        "schedule_active": 1,
        "schedule_period": 312,
        "schedule_detections": 1,
        "schedule_fallbacks": 2,
        "schedule_victims": 5,
        "schedule_prefetch_count": 4,
        "schedule_rescues": 1,
        "schedule_prefetch_budget_bytes": 256 * MiB,
        "early_pageout_count": 2,
        "early_pageout_bytes": 2 * 4 * MiB,
        "peak_pageout_count": 1,
        "peak_pageout_bytes": 4 * MiB,
        "graph_prefetch_count": 3,
        "graph_prefetch_bytes": 3 * 4 * MiB,
        "graph_pageout_count": 1,
        "stall_ms": 1.25,
        "copy_out_bytes": 2 * 1024 * MiB,
        "copy_out_ms": 40.0,
        "copy_in_bytes": 0,
        "copy_in_ms": 0.0,
        "drop_count": 6,
        "drop_bytes": 6 * 4 * MiB,
        "recompute_count": 5,
        "recompute_bytes": 5 * 4 * MiB,
        "recompute_ms": 2.5,
        "recompute_input_prefetch_count": 1,
        "recompute_input_prefetch_bytes": 4 * MiB,
        "recompute_ahead_count": 2,
        "recompute_ahead_bytes": 2 * 4 * MiB,
        "oom_count": 0,
        "pin_failures": 0,
        "cache_releases": 0,
        "limit_bytes": 2048 * MiB,
        "host_budget_bytes": 96 * 1024 * MiB,
        "host_ledger_bytes": 40 * MiB,
        "host_refusals": 2,
        "host_pin_count": 4,
        "host_pin_ms": 310.5,
        "host_wait_count": 1,
        "host_wait_ms": 250.0,
        "host_copy_wait_count": 2,
        "host_copy_wait_ms": 3.5,
        "device_wait_count": 1,
        "device_wait_ms": 120.0,
        "spill_count": 3,
        "spill_out_bytes": 3 * 1024 * MiB,
        "spill_out_ms": 1500.0,
        "spill_in_bytes": 1024 * MiB,
        "spill_in_ms": 400.0,
    }
    for gauge in ("managed_bytes", "active_bytes", "inactive_bytes", "pagedout_bytes"):
        stats[gauge] = {"current": 4 * MiB, "peak": 12 * MiB}
    stats["dropped_bytes"] = {"current": 4 * MiB, "peak": 8 * MiB}
    stats["spilled_bytes"] = {"current": 2048 * MiB, "peak": 3072 * MiB}
    stats["host_bytes"] = {"current": 16 * MiB, "peak": 16 * MiB}
    stats["over_limit_bytes"] = {"current": 0, "peak": 2 * MiB}
    stats["operator_output_bytes"] = {"current": 0, "peak": 4 * MiB}
    stats["private_pool_bytes"] = {"current": 0, "peak": 0}
    stats.update(overrides)
    return stats


class FakeBindings:
    """Records calls; behaves like the _cuda_lms_* contract."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.enabled = False
        self.values: dict[str, int] = {
            "size": MiB,
            "prefetch": 0,
            "speculative": 0,
            "schedule": 1,
            "packing": 1,
            "host_placement": 1,
            "graph_prefetch": 1,
            "lookahead": 0,
            "budget": 0,
            "host_limit": 0,
            "recompute": 1,
            "residual_recipes": 0,
        }
        self.limits: dict[int, int] = {}
        self.host_wait = 60.0
        self.spill_dir = ""
        self.spill_limit = 0

    def _record(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def _cuda_lms_setEnabled(self, enabled: bool) -> None:
        self._record("setEnabled", enabled)
        self.enabled = enabled

    def _cuda_lms_getEnabled(self) -> bool:
        return self.enabled

    def _cuda_lms_setLimit(self, device: int, limit: int) -> None:
        self._record("setLimit", device, limit)
        self.limits[device] = limit

    def _cuda_lms_getLimit(self, device: int) -> int:
        self._record("getLimit", device)
        return self.limits.get(device, 1000)

    def _cuda_lms_setSize(self, size: int) -> None:
        self.values["size"] = size

    def _cuda_lms_getSize(self) -> int:
        return self.values["size"]

    def _cuda_lms_setPrefetch(self, depth: int) -> None:
        self.values["prefetch"] = depth

    def _cuda_lms_getPrefetch(self) -> int:
        return self.values["prefetch"]

    def _cuda_lms_setSpeculative(self, margin: int) -> None:
        self.values["speculative"] = margin

    def _cuda_lms_getSpeculative(self) -> int:
        return self.values["speculative"]

    def _cuda_lms_setSchedule(self, enabled: bool) -> None:
        self.values["schedule"] = int(enabled)

    def _cuda_lms_getSchedule(self) -> bool:
        return bool(self.values["schedule"])

    def _cuda_lms_setPacking(self, enabled: bool) -> None:
        self.values["packing"] = int(enabled)

    def _cuda_lms_getPacking(self) -> bool:
        return bool(self.values["packing"])

    def _cuda_lms_setHostPlacement(self, enabled: bool) -> None:
        self.values["host_placement"] = int(enabled)

    def _cuda_lms_getHostPlacement(self) -> bool:
        return bool(self.values["host_placement"])

    def _cuda_lms_setHostWait(self, seconds: float) -> None:
        self._record("setHostWait", seconds)
        self.host_wait = seconds

    def _cuda_lms_getHostWait(self) -> float:
        return self.host_wait

    def _cuda_lms_setSpillDir(self, path: str) -> None:
        self._record("setSpillDir", path)
        self.spill_dir = path

    def _cuda_lms_getSpillDir(self) -> str:
        return self.spill_dir

    def _cuda_lms_setSpillLimit(self, limit: int) -> None:
        self._record("setSpillLimit", limit)
        self.spill_limit = limit

    def _cuda_lms_getSpillLimit(self) -> int:
        return self.spill_limit

    def _cuda_lms_setLookahead(self, operators: int) -> None:
        self.values["lookahead"] = operators

    def _cuda_lms_getLookahead(self) -> int:
        return self.values["lookahead"]

    def _cuda_lms_setPrefetchBudget(self, budget: int) -> None:
        self.values["budget"] = budget

    def _cuda_lms_getPrefetchBudget(self) -> int:
        return self.values["budget"]

    def _cuda_lms_setGraphPrefetch(self, enabled: bool) -> None:
        self.values["graph_prefetch"] = int(enabled)

    def _cuda_lms_getGraphPrefetch(self) -> bool:
        return bool(self.values["graph_prefetch"])

    def _cuda_lms_setHostLimit(self, limit: int) -> None:
        self._record("setHostLimit", limit)
        self.values["host_limit"] = limit

    def _cuda_lms_getHostLimit(self) -> int:
        return self.values["host_limit"]

    def _cuda_lms_setRecompute(self, enabled: bool) -> None:
        self._record("setRecompute", enabled)
        self.values["recompute"] = int(enabled)

    def _cuda_lms_getRecompute(self) -> bool:
        return bool(self.values["recompute"])

    def _cuda_lms_setResidualRecipes(self, enabled: bool) -> None:
        self._record("setResidualRecipes", enabled)
        self.values["residual_recipes"] = int(enabled)

    def _cuda_lms_getResidualRecipes(self) -> bool:
        return bool(self.values["residual_recipes"])

    def _cuda_lms_resetSchedule(self) -> None:
        self._record("resetSchedule")

    def _cuda_lms_reclaimInactive(self, device: int) -> int:
        self._record("reclaimInactive", device)
        return 8 * MiB

    def _cuda_lms_stats(self, device: int) -> dict[str, Any]:
        self._record("stats", device)
        return stats_dict()

    def _cuda_lms_resetPeakStats(self, device: int) -> None:
        self._record("resetPeakStats", device)

    def _cuda_lms_resetAccumulatedStats(self, device: int) -> None:
        self._record("resetAccumulatedStats", device)

    def _cuda_lms_recomputeOperators(self, device: int) -> dict[str, dict[str, int]]:
        self._record("recomputeOperators", device)
        return {
            "aten::dropout": {
                "drop_count": 3,
                "drop_bytes": 3 * MiB,
                "recompute_count": 2,
                "recompute_bytes": 2 * MiB,
            }
        }

    def _cuda_lms_storageState(self, tensor: Any) -> str:
        return "unmanaged"

    def _cuda_lms_access(self, tensor: Any) -> None:
        self._record("access", tensor)


@pytest.fixture
def lms(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = load_lms()
    fake = FakeBindings()
    monkeypatch.setattr(module, "_lms_bindings", lambda: fake)
    # No CUDA here: device=None resolves to device 0 as the current device would.
    real = module._get_device_index
    monkeypatch.setattr(
        module, "_get_device_index", lambda d, optional=False: 0 if d is None else real(d, optional)
    )
    module.fake = fake  # type: ignore[attr-defined]
    settings: list[str] = []
    monkeypatch.setattr(
        module.torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False
    )
    module.allocator_settings = settings  # type: ignore[attr-defined]
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return module


def test_settings_reach_the_bindings(lms: ModuleType) -> None:
    lms.set_enabled_lms(True)
    assert lms.get_enabled_lms() is True
    lms.set_limit_lms(512 * MiB, device=1)
    assert lms.fake.calls[-1] == ("setLimit", (1, 512 * MiB))
    assert lms.get_limit_lms(1) == 512 * MiB
    lms.set_limit_lms(256 * MiB)
    assert lms.fake.calls[-1] == ("setLimit", (0, 256 * MiB))
    lms.set_limit_lms(MiB, device=torch.device("cuda", 2))
    assert lms.fake.calls[-1] == ("setLimit", (2, MiB))
    lms.set_limit_lms(MiB, device="cuda:3")
    assert lms.fake.calls[-1] == ("setLimit", (3, MiB))
    lms.set_size_lms(3 * MiB)
    assert lms.get_size_lms() == 3 * MiB
    lms.set_prefetch_lms(4)
    assert lms.get_prefetch_lms() == 4
    lms.set_speculative_lms(64 * MiB)
    assert lms.get_speculative_lms() == 64 * MiB
    assert lms.get_schedule_lms() is True
    lms.set_schedule_lms(False)
    assert lms.get_schedule_lms() is False
    assert lms.get_packing_lms() is True
    lms.set_packing_lms(False)
    assert lms.get_packing_lms() is False
    assert lms.get_host_placement_lms() is True
    lms.set_host_placement_lms(False)
    assert lms.get_host_placement_lms() is False
    lms.set_lookahead_lms(32)
    assert lms.get_lookahead_lms() == 32
    lms.set_prefetch_budget_lms(256 * MiB)
    assert lms.get_prefetch_budget_lms() == 256 * MiB
    assert lms.get_graph_prefetch_lms() is True
    lms.set_graph_prefetch_lms(False)
    assert lms.get_graph_prefetch_lms() is False
    assert lms.get_residual_recipes_lms() is False
    lms.set_residual_recipes_lms(True)
    assert lms.fake.calls[-1] == ("setResidualRecipes", (True,))
    assert lms.get_residual_recipes_lms() is True
    assert lms.get_host_limit_lms() == 0  # derived from the host's memory
    lms.set_host_limit_lms(64 * 1024 * MiB)
    assert lms.fake.calls[-1] == ("setHostLimit", (64 * 1024 * MiB,))
    assert lms.get_host_limit_lms() == 64 * 1024 * MiB
    lms.set_host_limit_lms(0)
    assert lms.get_host_limit_lms() == 0
    assert lms.get_host_wait_lms() == 60.0
    lms.set_host_wait_lms(0.5)
    assert lms.fake.calls[-1] == ("setHostWait", (0.5,))
    assert lms.get_host_wait_lms() == 0.5
    lms.set_host_wait_lms(0)
    assert lms.get_host_wait_lms() == 0.0
    assert lms.get_spill_dir_lms() == ""  # the disk tier is off by default
    lms.set_spill_dir_lms(Path("/var/tmp"))
    assert lms.fake.calls[-1] == ("setSpillDir", ("/var/tmp",))
    assert lms.get_spill_dir_lms() == "/var/tmp"
    lms.set_spill_dir_lms("")
    assert lms.get_spill_dir_lms() == ""
    assert lms.get_spill_limit_lms() == 0
    lms.set_spill_limit_lms(8 * 1024 * MiB)
    assert lms.fake.calls[-1] == ("setSpillLimit", (8 * 1024 * MiB,))
    assert lms.get_spill_limit_lms() == 8 * 1024 * MiB
    assert lms.get_recompute_lms() is True  # on by default
    lms.set_recompute_lms(False)
    assert lms.fake.calls[-1] == ("setRecompute", (False,))
    assert lms.get_recompute_lms() is False
    lms.set_recompute_lms(True)
    assert lms.get_recompute_lms() is True
    lms.reset_lms_schedule()
    assert lms.fake.calls[-1] == ("resetSchedule", ())
    assert lms.reclaim_inactive() == 8 * MiB
    lms.reset_peak_lms_stats(1)
    lms.reset_accumulated_lms_stats()
    assert lms.fake.calls[-2:] == [("resetPeakStats", (1,)), ("resetAccumulatedStats", (0,))]


def test_enabling_turns_on_expandable_segments_unless_the_user_chose(
    lms: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    lms.set_enabled_lms(False)
    assert lms.allocator_settings == []
    lms.set_enabled_lms(True)
    assert lms.allocator_settings == ["expandable_segments:True"]
    for value in ("expandable_segments:False", "max_split_size_mb:64,expandable_segments:True"):
        lms.allocator_settings.clear()
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
        lms.set_enabled_lms(True)
        assert lms.allocator_settings == [], value
    assert lms.get_enabled_lms() is True


def test_expandable_segments_left_alone_where_the_allocator_has_none(
    lms: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(setting: str) -> None:
        raise RuntimeError(f"Unrecognized key {setting!r}")

    monkeypatch.setattr(lms.torch._C, "_accelerator_setAllocatorSettings", refuse)
    assert lms._prefer_expandable_segments() is False
    monkeypatch.delattr(lms.torch._C, "_accelerator_setAllocatorSettings")
    monkeypatch.delattr(lms.torch.cuda.memory, "_set_allocator_settings", raising=False)
    assert lms._prefer_expandable_segments() is False
    lms.set_enabled_lms(True)  # enabling still works
    assert lms.get_enabled_lms() is True


def test_numpy_integers_are_sizes(lms: ModuleType) -> None:
    np = pytest.importorskip("numpy", reason="numpy integers")
    lms.set_size_lms(np.int64(2 * MiB))
    assert lms.get_size_lms() == 2 * MiB


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m: m.set_enabled_lms(1), TypeError, "enable must be a bool, got int"),
        (lambda m: m.set_enabled_lms("yes"), TypeError, "enable must be a bool, got str"),
        (lambda m: m.set_limit_lms(-1), ValueError, "limit_bytes must be >= 0, got -1"),
        (lambda m: m.set_limit_lms(1.5), TypeError, "limit_bytes must be an int, got float"),
        (lambda m: m.set_limit_lms(True), TypeError, "limit_bytes must be an int, got bool"),
        (lambda m: m.set_size_lms(-MiB), ValueError, "size_bytes must be >= 0"),
        (lambda m: m.set_size_lms("1M"), TypeError, "size_bytes must be an int, got str"),
        (lambda m: m.set_spill_dir_lms(3), TypeError, "path must be a str or os.PathLike"),
        (lambda m: m.set_spill_limit_lms(-1), ValueError, "limit_bytes must be >= 0, got -1"),
        (lambda m: m.set_prefetch_lms(-2), ValueError, "depth must be >= 0"),
        (lambda m: m.set_prefetch_lms(2**31), ValueError, "depth must be <= 2147483647"),
        (lambda m: m.set_speculative_lms(None), TypeError, "margin_bytes must be an int"),
        (lambda m: m.set_speculative_lms(-5), ValueError, "margin_bytes must be >= 0"),
        (lambda m: m.set_schedule_lms(1), TypeError, "enable must be a bool, got int"),
        (lambda m: m.set_packing_lms("no"), TypeError, "enable must be a bool, got str"),
        (lambda m: m.set_host_placement_lms(1), TypeError, "enable must be a bool, got int"),
        (lambda m: m.set_lookahead_lms(-1), ValueError, "operators must be >= 0"),
        (lambda m: m.set_lookahead_lms(2**31), ValueError, "operators must be <= 2147483647"),
        (lambda m: m.set_prefetch_budget_lms(-1), ValueError, "budget_bytes must be >= 0"),
        (lambda m: m.set_graph_prefetch_lms(1), TypeError, "enable must be a bool, got int"),
        (lambda m: m.set_host_limit_lms(-1), ValueError, "limit_bytes must be >= 0, got -1"),
        (lambda m: m.set_host_wait_lms(-1), ValueError, "seconds must be between 0 and 1e9"),
        (lambda m: m.set_host_wait_lms("5"), TypeError, "seconds must be a number, got str"),
        (lambda m: m.set_recompute_lms(1), TypeError, "enable must be a bool, got int"),
        (lambda m: m.set_recompute_lms("True"), TypeError, "enable must be a bool, got str"),
        (lambda m: m.set_residual_recipes_lms(1), TypeError, "enable must be a bool, got int"),
        (lambda m: m.set_host_limit_lms(2.5e9), TypeError, "limit_bytes must be an int, got float"),
        (lambda m: m.set_host_limit_lms(True), TypeError, "limit_bytes must be an int, got bool"),
        (lambda m: m.lms_storage_state([1, 2]), TypeError, "tensor must be a torch.Tensor"),
        (lambda m: m._lms_access(None), TypeError, "tensor must be a torch.Tensor"),
        (lambda m: m.set_limit_lms(MiB, device="cpu"), ValueError, "Expected a cuda device"),
    ],
)
def test_invalid_arguments(lms: ModuleType, call: Any, error: type, message: str) -> None:
    before = list(lms.fake.calls)
    with pytest.raises(error, match=message):
        call(lms)
    assert lms.fake.calls == before  # nothing reached the bindings


def test_stats_keys_and_copy(lms: ModuleType) -> None:
    stats = lms.lms_stats(device=1)
    assert lms.fake.calls[-1] == ("stats", (1,))
    assert set(stats) == set(lms._COUNTER_KEYS) | set(lms._GAUGE_KEYS)
    for gauge in lms._GAUGE_KEYS:
        assert set(stats[gauge]) == {"current", "peak"}


def test_recompute_operators_per_device(lms: ModuleType) -> None:
    counts = lms.lms_recompute_operators(device=1)
    assert lms.fake.calls[-1] == ("recomputeOperators", (1,))
    assert counts == {
        "aten::dropout": {
            "drop_count": 3,
            "drop_bytes": 3 * MiB,
            "recompute_count": 2,
            "recompute_bytes": 2 * MiB,
        }
    }


def test_storage_state(lms: ModuleType) -> None:
    assert lms.lms_storage_state(torch.zeros(1)) == "unmanaged"
    assert "unmanaged" in lms._STORAGE_STATES
    assert "dropped" in lms._STORAGE_STATES


def flat(stats: dict[str, Any], prefix: str = "lms.") -> dict[str, Any]:
    out: dict[str, Any] = {"num_ooms": 0}
    for key, value in stats.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                out[f"{prefix}{key}.{sub}"] = v
        else:
            out[prefix + key] = value
    return out


def test_summary_lines_format(lms: ModuleType) -> None:
    lines = lms._memory_summary_lines(flat(stats_dict()))
    assert lines, "LMS section expected once LMS managed memory"
    assert all(len(line) == 75 for line in lines), [len(x) for x in lines]
    text = "\n".join(lines)
    assert "Large Model Support, limit 2048 MiB" in text
    assert " Paged out             |       3    |  12288 KiB |" in text
    assert " Pinned host memory    |  16384 KiB |  16384 KiB |" in text
    assert " Dropped to recompute  |   4096 KiB |   8192 KiB |" in text
    assert " Dropped (no copy)     |       6    |  24576 KiB |" in text
    assert " Recomputed            |       5    |  20480 KiB |" in text
    assert "        Metric         | Cur Usage  | Peak Usage |" in text
    assert "Stalled: 1.2 ms" in text or "Stalled: 1.3 ms" in text
    # 2 GiB in 40 ms out; nothing timed in yet.
    assert "Copies: out 53.7 GB/s, in none timed | Recomputing: 2.5 ms" in text
    assert "1 at limit" in text and "1 explicit" in text
    assert "Allocations placed by paging out a range: 1 failed, 2 ahead" in text
    assert "Operators packed: 1 (8192 KiB paged out); workspaces freed: 1" in text
    assert "Prefetched: 4 (3 hits)" in text
    assert "Host budget: 98304 MiB, LMS processes hold 40960 KiB, refused 2" in text
    assert "Host buffers pinned: 4 in 310.5 ms | Waits for own copies: 2 in 3.5 ms" in text
    # 3 GiB written in 1.5 s, 1 GiB read in 0.4 s.
    assert "Disk tier: 3 spilled, out 2.1 GB/s, in 2.7 GB/s" in text
    # memory_summary() runs str.format over its lines: the section must survive it.
    assert "|".join(lines).format() == "|".join(lines)


def test_summary_lines_from_nested_stats(lms: ModuleType) -> None:
    assert lms._memory_summary_lines(stats_dict(), prefix="") == lms._memory_summary_lines(
        flat(stats_dict())
    )


def test_summary_lines_absent_without_lms(lms: ModuleType) -> None:
    assert lms._memory_summary_lines({"num_ooms": 0, "allocation.all.current": 1}) == []
    unused = stats_dict(pageout_count=0)
    unused["managed_bytes"] = {"current": 0, "peak": 0}
    assert lms._memory_summary_lines(flat(unused)) == []


def test_missing_bindings_message(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_lms()
    if hasattr(torch._C, "_cuda_lms_setEnabled"):
        pytest.skip("this torch is built with Large Model Support")
    monkeypatch.setitem(sys.modules, "torch_lms", None)  # import fails
    monkeypatch.setitem(sys.modules, "torch_lms._C", None)
    with pytest.raises(RuntimeError, match=r"Large Model Support patch series.*import torch_lms"):
        module.get_enabled_lms()


def test_extension_bindings_used(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_lms()
    if hasattr(torch._C, "_cuda_lms_setEnabled"):
        pytest.skip("this torch is built with Large Model Support")
    fake = FakeBindings()
    package = ModuleType("torch_lms")
    package.__path__ = []  # type: ignore[attr-defined]
    ext = ModuleType("torch_lms._C")
    for name in dir(fake):
        if name.startswith("_cuda_lms_"):
            setattr(ext, name, getattr(fake, name))
    monkeypatch.setitem(sys.modules, "torch_lms", package)
    monkeypatch.setitem(sys.modules, "torch_lms._C", ext)
    module.set_enabled_lms(True)
    assert fake.enabled is True
    assert module._lms_bindings() is ext


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device, for the launch wrapper's filter."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class _Pins:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def release(self) -> None:
        self.events.append("release")


def _autotuner_module(events: list[str], fail: bool = False) -> ModuleType:
    def triton_poi_fused_add_0() -> None:
        """Stands for the Triton JIT function the autotuner launches."""

    class CachingAutotuner:
        fn = staticmethod(triton_poi_fused_add_0)

        def run(self, *args: Any, stream: int, **kwargs: Any) -> str:
            events.append(f"launch:{len(args)}")
            if fail:
                raise RuntimeError("kernel failed")
            return "done"

    module = ModuleType("fake_triton_runtime")
    module.CachingAutotuner = CachingAutotuner  # type: ignore[attr-defined]
    return module


def test_compiled_kernel_launch_pins_its_tensor_arguments(lms: ModuleType) -> None:
    events: list[str] = []
    pinned: list[tuple[int, str]] = []

    def pin_for_launch(tensors: list[Any], name: str) -> _Pins:
        pinned.append((len(tensors), name))
        events.append("pin")
        return _Pins(events)

    lms.fake._cuda_lms_pinForLaunch = pin_for_launch
    module = _autotuner_module(events)
    lms._pin_compiled_kernel_launches(module)
    lms._pin_compiled_kernel_launches(module)  # wrapping twice is harmless
    cuda_like = torch.zeros(4).as_subclass(_CudaLike)
    args = (cuda_like, torch.zeros(4), 7, cuda_like)

    lms.fake.enabled = False
    assert module.CachingAutotuner().run(*args, stream=0) == "done"
    assert events == ["launch:4"] and pinned == []

    lms.fake.enabled = True
    events.clear()
    assert module.CachingAutotuner().run(*args, stream=0) == "done"
    # Only the CUDA tensors are pinned, before the launch, and released after it.
    assert events == ["pin", "launch:4", "release"]
    assert pinned == [(2, "triton_poi_fused_add_0")]


def test_compiled_kernel_launch_releases_after_a_failure_and_never_runs_unpinned(
    lms: ModuleType,
) -> None:
    events: list[str] = []
    lms.fake.enabled = True
    lms.fake._cuda_lms_pinForLaunch = lambda tensors, name: _Pins(events)
    module = _autotuner_module(events, fail=True)
    lms._pin_compiled_kernel_launches(module)
    cuda_like = torch.zeros(4).as_subclass(_CudaLike)
    with pytest.raises(RuntimeError, match="kernel failed"):
        module.CachingAutotuner().run(cuda_like, stream=0)
    assert events == ["launch:1", "release"]

    def no_room(tensors: list[Any], name: str) -> _Pins:
        raise torch.OutOfMemoryError(f"Large Model Support: the inputs of {name} ...")

    events.clear()
    lms.fake._cuda_lms_pinForLaunch = no_room
    module = _autotuner_module(events)
    lms._pin_compiled_kernel_launches(module)
    with pytest.raises(torch.OutOfMemoryError, match="Large Model Support"):
        module.CachingAutotuner().run(cuda_like, stream=0)
    assert events == []  # the kernel never launched


def test_inductor_launcher_is_wrapped_when_its_module_is_imported() -> None:
    """In a fresh interpreter: loading lms.py imports nothing of Inductor, and importing
    Inductor's runtime afterwards wraps its launcher."""
    import subprocess

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('lms', {str(LMS_PY)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"assert {'torch._inductor.runtime.triton_heuristics'!r} not in sys.modules\n"
        "from torch._inductor.runtime import triton_heuristics as th\n"
        "print(getattr(th.CachingAutotuner.run, '_lms_launch_pins', False))\n"
        f"assert {'torch._inductor.cudagraph_trees'!r} not in sys.modules\n"
        "from torch._inductor import cudagraph_trees as ct\n"
        "print(getattr(ct.CUDAGraphNode._record, '_lms_resident_inputs', False))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-2:] == ["True", "True"]


def _graph_trees_module(events: list[str], seen: list[bool], lms: ModuleType) -> ModuleType:
    class CUDAGraphNode:
        device = 0

        class wrapped_function:  # stands for Inductor's WrappedFunction
            constants = (torch.zeros(2).as_subclass(_CudaLike),)

        def _record(self, model: Any, inputs: list[Any]) -> str:
            events.append(f"record:{len(inputs)}")
            seen.append(lms.capturing_with_resident_inputs())
            return "outputs"

    module = ModuleType("fake_cudagraph_trees")
    module.CUDAGraphNode = CUDAGraphNode  # type: ignore[attr-defined]
    return module


def test_graph_capture_of_a_compiled_region_makes_its_inputs_resident_and_room_first(
    lms: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    seen: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    module = _graph_trees_module(events, seen, lms)
    lms._resident_graph_inputs(module)
    lms._resident_graph_inputs(module)  # wrapping twice is harmless
    cuda_like = torch.zeros(4).as_subclass(_CudaLike)
    inputs = [cuda_like, torch.zeros(3), 5]

    lms.fake.enabled = False
    assert module.CUDAGraphNode()._record(None, list(inputs)) == "outputs"
    assert events == ["record:3"] and lms.fake.calls == []

    lms.fake.enabled = True
    events.clear()
    assert module.CUDAGraphNode()._record(None, list(inputs)) == "outputs"
    # The CUDA inputs and the constant are paged in, the rest of the device is paged out
    # and its cache returned, all before the capture; the capture guard is told.
    names = [name for name, _ in lms.fake.calls]
    assert names == ["access", "access", "reclaimInactive"]
    assert lms.fake.calls[-1] == ("reclaimInactive", (0,))
    assert events == ["empty_cache", "record:3"]
    assert seen == [False, True]
    assert not lms.capturing_with_resident_inputs()  # reset after the capture


def test_graph_capture_flag_is_reset_when_the_capture_fails(lms: ModuleType) -> None:
    class CUDAGraphNode:
        device = 0

        def _record(self, model: Any, inputs: list[Any]) -> str:
            raise RuntimeError("capture failed")

    module = ModuleType("fake_cudagraph_trees")
    module.CUDAGraphNode = CUDAGraphNode  # type: ignore[attr-defined]
    lms._resident_graph_inputs(module)
    lms.fake.enabled = True
    with pytest.raises(RuntimeError, match="capture failed"):
        module.CUDAGraphNode()._record(None, [])
    assert not lms.capturing_with_resident_inputs()


def test_every_setting_of_the_table_is_parsed_and_documented() -> None:
    """The engine's parser of PYTORCH_CUDA_ALLOC_CONF keys and the list its errors give are
    made from the settings table; lms.py's docstring names every key with its setter, and
    lms.py has each setting's setter and getter."""
    settings = tables.read_settings(ROOT)
    assert "lms_host_limit_mb" in {s.key for s in settings}
    source = (ROOT / "engine/c10/cuda/LargeModelSupportOptions.cpp").read_text()
    include = "#include <c10/cuda/LargeModelSupportSettingTable.h>"
    assert include in _between(source, "bool parseConfigOption(", "\n}\n")
    assert include in _between(source, "const std::string& settingKeys()", "\n}\n")
    lms = load_lms()
    docstring = lms.__doc__ or ""
    for setting in settings:
        setter, getter = setting.functions
        assert f"``{setting.key}``" in docstring and f":func:`{setter}`" in docstring, setting
        assert callable(getattr(lms, setter)) and callable(getattr(lms, getter)), setting


def _between(text: str, start: str, end: str) -> str:
    begin = text.index(start)
    return text[begin : text.index(end, begin)]


def test_stats_keys_are_those_of_the_table() -> None:
    """The engine's LmsStats and the stats dict of the bindings are made from the statistics
    table; lms.py lists its counters and gauges, and lms_stats() documents each of them (the
    milliseconds as floats)."""
    rows = tables.read_stats(ROOT)
    include = "#include <c10/cuda/LargeModelSupportStatTable.h>"
    header = (ROOT / "engine/c10/cuda/LargeModelSupport.h").read_text()
    assert include in _between(header, "struct LmsStats {", "};")
    bindings = (ROOT / "engine/torch/csrc/cuda/LmsBindings.cpp").read_text()
    assert include in _between(bindings, "py::dict statsToDict(", "\n}\n")
    counters = tuple(row.name for row in rows if not row.gauge)
    gauges = tuple(row.name for row in rows if row.gauge)
    floats = {row.name for row in rows if row.type == "double"}
    assert "limit_bytes" in counters and "dropped_bytes" in gauges and "stall_ms" in floats
    lms = load_lms()
    assert lms._COUNTER_KEYS == counters
    assert lms._GAUGE_KEYS == gauges
    stats = stats_dict()
    assert set(stats) == set(counters + gauges)
    assert {key for key, value in stats.items() if isinstance(value, float)} == floats
    doc = lms.lms_stats.__doc__ or ""
    undocumented = [key for key in (*counters, *gauges) if f"``{key}``" not in doc]
    assert not undocumented, undocumented
    documented_floats = _between(doc, "The counters", "(floats)")
    assert all(f"``{key}``" in documented_floats for key in floats), documented_floats


def test_bindings_match_the_api_and_the_storage_states() -> None:
    """The bindings lms.py calls are those LmsBindings.cpp defines (less those the drop-in
    extension defines itself), each setting's setter and getter both; the fake bindings here
    stand for all of them; the storage states lms.py lists are the header's."""
    import re

    root = LMS_PY.parents[3]
    bindings = (root / "engine/torch/csrc/cuda/LmsBindings.cpp").read_text()
    defined = set(re.findall(r'm\.def\(\s*"(_cuda_lms_\w+)"', bindings))
    # Each setting's pair is registered from the settings table.
    assert "#include <c10/cuda/LargeModelSupportSettingTable.h>" in _between(
        bindings, "void initLmsBindings(", "\n}\n"
    )
    defined |= {name for setting in tables.read_settings(root) for name in setting.bindings}
    used = set(re.findall(r"\b(_cuda_lms_\w+)\b", LMS_PY.read_text()))
    assert used <= defined, used - defined
    for name in defined:
        if name.startswith("_cuda_lms_set"):
            getter = name.replace("_cuda_lms_set", "_cuda_lms_get", 1)
            assert getter in defined, name
            assert {name, getter} <= used, name
    faked = {name for name in dir(FakeBindings) if name.startswith("_cuda_lms_")}
    missing = (used - faked) - {"_cuda_lms_pinForLaunch"}  # set by the tests that use it
    assert not missing, missing
    header = (root / "engine/c10/cuda/LargeModelSupport.h").read_text()
    states = _between(header, "enum class StorageState : uint8_t {", "};")
    names = re.findall(r"^\s*([A-Z]\w*),", states, re.M)
    spelled = {"PagedOut": "paged out"}
    expected = tuple(spelled.get(name, name.lower()) for name in names)
    assert load_lms()._STORAGE_STATES == expected


def load_integration() -> ModuleType:
    path = LMS_PY.parents[3] / "extension/torch_lms/_integration.py"
    spec = importlib.util.spec_from_file_location("torch_lms_integration_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extension_exports_every_setting() -> None:
    """The drop-in extension puts each setter and getter of lms.py into torch.cuda."""
    integration = load_integration()
    settings = {name for name in load_lms().__all__ if name.startswith(("set_", "get_"))}
    assert settings <= set(integration.API_NAMES), settings - set(integration.API_NAMES)
    assert {"set_recompute_lms", "get_recompute_lms"} <= set(integration.API_NAMES)


def test_every_series_exports_every_setting() -> None:
    """Each tag's series lists every setter and getter of lms.py in torch.cuda's __all__."""
    import re

    settings = {name for name in load_lms().__all__ if name.startswith(("set_", "get_"))}
    patches = sorted(
        (LMS_PY.parents[3] / "patches").glob("*/*expose-the-Large-Model-Support-API.patch")
    )
    assert len(patches) >= 2, patches
    for patch in patches:
        added = "\n".join(line for line in patch.read_text().splitlines() if line.startswith("+"))
        listed = set(re.findall(r"[\"']((?:set|get)_\w+_lms)[\"']", added))
        assert settings <= listed, (patch.parent.name, sorted(settings - listed))


@pytest.mark.parametrize(
    ("paged_out", "dropped", "message"),
    [
        (0, 0, None),
        (4 * MiB, 0, r"\(4\.0 MiB paged out to host memory\)"),
        (0, 8 * MiB, r"\(8\.0 MiB dropped to be recomputed\)"),
        (4 * MiB, 8 * MiB, r"4\.0 MiB paged out to host memory, 8\.0 MiB dropped"),
    ],
)
def test_extension_refuses_a_capture_while_storages_are_paged_out_or_dropped(
    monkeypatch: pytest.MonkeyPatch, paged_out: int, dropped: int, message: str | None
) -> None:
    """The drop-in extension's guard of CUDA graph captures: a page-in or a recompute cannot
    be captured, so a capture waits until nothing of the device is paged out or dropped."""
    integration = load_integration()
    fake = FakeBindings()
    fake.enabled = True
    stats = stats_dict()
    stats["pagedout_bytes"] = {"current": paged_out, "peak": paged_out}
    stats["dropped_bytes"] = {"current": dropped, "peak": dropped}
    fake._cuda_lms_stats = lambda device: stats  # type: ignore[method-assign]
    api = ModuleType("lms_api")
    api.capturing_with_resident_inputs = lambda: False  # type: ignore[attr-defined]
    begun: list[str] = []
    monkeypatch.setattr(
        torch.cuda.graphs.CUDAGraph, "capture_begin", lambda self: begun.append("begin")
    )
    monkeypatch.setattr(torch.cuda.graphs.graph, "__enter__", lambda self: begun.append("enter"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    integration._guard_graph_capture(fake, api)
    if message is None:
        torch.cuda.graphs.CUDAGraph.capture_begin(object())
        assert begun == ["begin"]
        return
    with pytest.raises(RuntimeError, match=message):
        torch.cuda.graphs.CUDAGraph.capture_begin(object())
    with pytest.raises(RuntimeError, match="neither a page-in nor a recompute can be captured"):
        torch.cuda.graphs.graph.__enter__(object())
    assert begun == []
