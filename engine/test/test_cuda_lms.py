# Owner(s): ["module: cuda"]

# Large Model Support (LMS): the torch.cuda API, its statistics, and paging of
# tensors between the GPU and pinned host memory under a small limit.

import sys
import unittest

import torch
import torch.cuda
from torch.testing._internal.common_utils import NoTest, run_tests, TestCase


TEST_CUDA = torch.cuda.is_available()
if not TEST_CUDA:
    print("CUDA not available, skipping tests", file=sys.stderr)
    TestCase = NoTest  # noqa: F811

MiB = 1024 * 1024
# Tensors of this size are well above the default 1 MiB size threshold.
CHUNK_ELEMS = 4 * MiB // 4  # 4 MiB of float32

# The keys of lms_stats() (and, under "lms.", of memory_stats()): the counters,
# then the gauges, each gauge a {"current", "peak"} dict. They are exactly those
# of the stats dict of torch/csrc/cuda/LmsBindings.cpp.
COUNTERS = (
    "pageout_count",
    "pageout_bytes",
    "pagein_count",
    "pagein_bytes",
    "reclaim_limit",
    "reclaim_speculative",
    "reclaim_alloc_failure",
    "reclaim_explicit",
    "pack_count",
    "pack_bytes",
    "workspace_releases",
    "fragment_reclaims",
    "host_placement_count",
    "host_placement_bytes",
    "alloc_from_cache",
    "alloc_from_device",
    "alloc_after_reclaim",
    "prefetch_count",
    "prefetch_hits",
    "prefetch_late",
    "pagein_demand_count",
    "schedule_active",
    "schedule_period",
    "schedule_detections",
    "schedule_fallbacks",
    "schedule_victims",
    "schedule_prefetch_count",
    "schedule_rescues",
    "schedule_prefetch_budget_bytes",
    "early_pageout_count",
    "early_pageout_bytes",
    "peak_pageout_count",
    "peak_pageout_bytes",
    "graph_prefetch_count",
    "graph_prefetch_bytes",
    "graph_pageout_count",
    "stall_ms",
    "copy_out_bytes",
    "copy_out_ms",
    "copy_in_bytes",
    "copy_in_ms",
    "drop_count",
    "drop_bytes",
    "recompute_count",
    "recompute_bytes",
    "recompute_ms",
    "recompute_input_prefetch_count",
    "recompute_input_prefetch_bytes",
    "oom_count",
    "pin_failures",
    "cache_releases",
    "host_budget_bytes",
    "host_ledger_bytes",
    "host_refusals",
    "limit_bytes",
)
# The counters that are floats (milliseconds); every other counter is an int.
FLOAT_COUNTERS = (
    "stall_ms",
    "copy_out_ms",
    "copy_in_ms",
    "recompute_ms",
)
GAUGES = (
    "managed_bytes",
    "active_bytes",
    "inactive_bytes",
    "pagedout_bytes",
    "dropped_bytes",
    "host_bytes",
    "over_limit_bytes",
    "operator_output_bytes",
    "private_pool_bytes",
)


class TestCudaLms(TestCase):
    def setUp(self):
        super().setUp()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.device = torch.cuda.current_device()
        self.saved = (
            torch.cuda.get_enabled_lms(),
            torch.cuda.get_size_lms(),
            torch.cuda.get_prefetch_lms(),
            torch.cuda.get_speculative_lms(),
            torch.cuda.get_recompute_lms(),
        )
        torch.cuda.reset_accumulated_lms_stats()

    def tearDown(self):
        enabled, size, prefetch, speculative, recompute = self.saved
        torch.cuda.synchronize()
        torch.cuda.set_limit_lms(0)
        torch.cuda.set_host_limit_lms(0)
        torch.cuda.set_size_lms(size)
        torch.cuda.set_prefetch_lms(prefetch)
        torch.cuda.set_speculative_lms(speculative)
        torch.cuda.set_recompute_lms(recompute)
        torch.cuda.set_enabled_lms(enabled)
        torch.cuda.empty_cache()
        super().tearDown()

    def _limit_to(self, headroom_bytes):
        # The limit covers all memory allocated to tensors on the device.
        torch.cuda.set_limit_lms(torch.cuda.memory_allocated() + headroom_bytes)

    def _fill(self, count, seed=0):
        gen = torch.Generator().manual_seed(seed)
        host = [torch.randn(CHUNK_ELEMS, generator=gen) for _ in range(count)]
        return host, [h.cuda() for h in host]

    def _touch(self, tensors):
        # An operator pins its inputs and unpins them when it returns: the
        # storages become inactive and reclaimable.
        for t in tensors:
            t.sum()

    def test_settings_round_trip(self):
        torch.cuda.set_enabled_lms(True)
        self.assertTrue(torch.cuda.get_enabled_lms())
        torch.cuda.set_enabled_lms(False)
        self.assertFalse(torch.cuda.get_enabled_lms())

        torch.cuda.set_limit_lms(512 * MiB)
        self.assertEqual(torch.cuda.get_limit_lms(), 512 * MiB)
        torch.cuda.set_limit_lms(512 * MiB, device=self.device)
        self.assertEqual(torch.cuda.get_limit_lms(torch.device("cuda", self.device)), 512 * MiB)
        torch.cuda.set_limit_lms(0)  # back to the measured default
        self.assertGreater(torch.cuda.get_limit_lms(), 0)
        total = torch.cuda.get_device_properties(self.device).total_memory
        self.assertLessEqual(torch.cuda.get_limit_lms(), total)

        torch.cuda.set_size_lms(3 * MiB)
        self.assertEqual(torch.cuda.get_size_lms(), 3 * MiB)
        torch.cuda.set_prefetch_lms(2)
        self.assertEqual(torch.cuda.get_prefetch_lms(), 2)
        torch.cuda.set_speculative_lms(64 * MiB)
        self.assertEqual(torch.cuda.get_speculative_lms(), 64 * MiB)

        # The host budget: derived from the host's memory until set.
        self.assertEqual(torch.cuda.get_host_limit_lms(), 0)
        self.assertGreater(torch.cuda.lms_stats()["host_budget_bytes"], 0)
        torch.cuda.set_host_limit_lms(8 * 1024 * MiB)
        self.assertEqual(torch.cuda.get_host_limit_lms(), 8 * 1024 * MiB)
        self.assertEqual(torch.cuda.lms_stats()["host_budget_bytes"], 8 * 1024 * MiB)
        torch.cuda.set_host_limit_lms(0)

    def _switch_round_trip(self, name, values):
        # torch.cuda.set_<name>_lms / get_<name>_lms and the binding beneath them, through
        # `values` in order; the switch is put back as it was.
        setter = getattr(torch.cuda, f"set_{name}_lms")
        getter = getattr(torch.cuda, f"get_{name}_lms")
        camel = "".join(part.capitalize() for part in name.split("_"))
        binding = getattr(torch._C, f"_cuda_lms_get{camel}")
        previous = getter()
        try:
            for value in values:
                setter(value)
                self.assertIs(getter(), value)
                self.assertIs(bool(binding()), value)
        finally:
            setter(previous)

    def test_recompute_round_trip(self):
        self._switch_round_trip("recompute", (True, False))

    def test_packing_round_trip(self):
        self._switch_round_trip("packing", (False, True))

    def test_host_placement_round_trip(self):
        self._switch_round_trip("host_placement", (False, True))

    def test_invalid_arguments(self):
        with self.assertRaisesRegex(TypeError, "enable must be a bool"):
            torch.cuda.set_enabled_lms(1)
        with self.assertRaisesRegex(ValueError, "limit_bytes must be >= 0"):
            torch.cuda.set_limit_lms(-1)
        with self.assertRaisesRegex(TypeError, "limit_bytes must be an int"):
            torch.cuda.set_limit_lms(1.5)
        with self.assertRaisesRegex(ValueError, "size_bytes must be >= 0"):
            torch.cuda.set_size_lms(-MiB)
        with self.assertRaisesRegex(TypeError, "size_bytes must be an int, got bool"):
            torch.cuda.set_size_lms(True)
        with self.assertRaisesRegex(ValueError, "depth must be >= 0"):
            torch.cuda.set_prefetch_lms(-1)
        with self.assertRaisesRegex(ValueError, "depth must be <="):
            torch.cuda.set_prefetch_lms(2**31)
        with self.assertRaisesRegex(TypeError, "margin_bytes must be an int"):
            torch.cuda.set_speculative_lms("1M")
        with self.assertRaisesRegex(ValueError, "limit_bytes must be >= 0"):
            torch.cuda.set_host_limit_lms(-1)
        with self.assertRaisesRegex(TypeError, "enable must be a bool"):
            torch.cuda.set_recompute_lms(1)
        with self.assertRaisesRegex(TypeError, "enable must be a bool"):
            torch.cuda.set_packing_lms("no")
        with self.assertRaisesRegex(TypeError, "enable must be a bool"):
            torch.cuda.set_host_placement_lms(1)
        with self.assertRaisesRegex(ValueError, "invalid CUDA device index"):
            torch.cuda.set_limit_lms(MiB, device=torch.cuda.device_count())
        with self.assertRaisesRegex(TypeError, "tensor must be a torch.Tensor"):
            torch.cuda.lms_storage_state(None)
        # The bindings check on their own too.
        with self.assertRaisesRegex(ValueError, "non-negative"):
            torch._C._cuda_lms_setSize(-1)
        with self.assertRaisesRegex(ValueError, "invalid CUDA device index"):
            torch._C._cuda_lms_stats(torch.cuda.device_count())

    def test_stats_keys(self):
        stats = torch.cuda.lms_stats()
        self.assertEqual(set(stats), set(COUNTERS) | set(GAUGES))
        for key in COUNTERS:
            self.assertIsInstance(stats[key], float if key in FLOAT_COUNTERS else int)
        for key in GAUGES:
            self.assertEqual(set(stats[key]), {"current", "peak"})
        memory_stats = torch.cuda.memory_stats()
        for key in COUNTERS:
            self.assertIn("lms." + key, memory_stats)
        for key in GAUGES:
            self.assertIn(f"lms.{key}.current", memory_stats)
            self.assertIn(f"lms.{key}.peak", memory_stats)

    def test_paging_round_trip(self):
        torch.cuda.set_enabled_lms(True)
        host, dev = self._fill(8)
        self.assertEqual(torch.cuda.lms_storage_state(dev[0]), "allocated")
        self._touch(dev)
        self.assertEqual(torch.cuda.lms_storage_state(dev[0]), "inactive")
        # Room for two more chunks: allocating six pages the oldest out.
        self._limit_to(2 * CHUNK_ELEMS * 4)
        extra = [torch.ones(CHUNK_ELEMS, device="cuda") for _ in range(6)]
        self.assertEqual(torch.cuda.lms_storage_state(dev[0]), "paged out")
        stats = torch.cuda.lms_stats()
        self.assertGreater(stats["pageout_count"], 0)
        self.assertGreater(stats["reclaim_limit"], 0)
        self.assertGreater(stats["pagedout_bytes"]["current"], 0)
        self.assertGreater(stats["host_bytes"]["current"], 0)
        # Every tensor comes back bit-identical, through operators (pin) and
        # through raw data access (.cpu() of the original).
        for h, d in zip(host, dev):
            self.assertEqual(d.clone().cpu(), h, atol=0, rtol=0)
            self.assertEqual(d.cpu(), h, atol=0, rtol=0)
        self.assertGreater(torch.cuda.lms_stats()["pagein_count"], 0)
        for e in extra:
            self.assertEqual(e.sum().item(), CHUNK_ELEMS)
        summary = torch.cuda.memory_summary()
        self.assertIn("Large Model Support", summary)
        self.assertIn("Paged out", summary)
        del host, dev, extra
        torch.cuda.synchronize()
        self.assertEqual(torch.cuda.lms_stats()["managed_bytes"]["current"], 0)
        self.assertEqual(torch.cuda.lms_stats()["pagedout_bytes"]["current"], 0)

    def test_reclaim_inactive_and_access(self):
        torch.cuda.set_enabled_lms(True)
        host, dev = self._fill(2, seed=1)
        self._touch(dev)
        freed = torch.cuda.reclaim_inactive()
        self.assertGreaterEqual(freed, 2 * CHUNK_ELEMS * 4)
        self.assertEqual(torch.cuda.lms_storage_state(dev[1]), "paged out")
        self.assertEqual(torch.cuda.lms_stats()["reclaim_explicit"], 1)
        torch.cuda.lms._lms_access(dev[1])
        self.assertEqual(torch.cuda.lms_storage_state(dev[1]), "allocated")
        self.assertEqual(dev[1].cpu(), host[1], atol=0, rtol=0)
        self.assertEqual(dev[0].cpu(), host[0], atol=0, rtol=0)

    def test_unmanaged_below_threshold_or_disabled(self):
        small = torch.ones(16, device="cuda")
        torch.cuda.set_enabled_lms(True)
        before = torch.ones(CHUNK_ELEMS, device="cuda")  # LMS on: managed
        torch.cuda.set_enabled_lms(False)
        after = torch.ones(CHUNK_ELEMS, device="cuda")
        self.assertEqual(torch.cuda.lms_storage_state(small), "unmanaged")
        self.assertEqual(torch.cuda.lms_storage_state(before), "allocated")
        self.assertEqual(torch.cuda.lms_storage_state(after), "unmanaged")

    def test_views_and_inplace(self):
        torch.cuda.set_enabled_lms(True)
        host, dev = self._fill(3, seed=2)
        views = [d.view(-1, 1024)[1::2] for d in dev]
        self._touch(dev)
        torch.cuda.reclaim_inactive()
        self.assertEqual(torch.cuda.lms_storage_state(dev[0]), "paged out")
        # A view shares its base's storage: using it pages the base in.
        self.assertEqual(views[0].cpu(), host[0].view(-1, 1024)[1::2], atol=0, rtol=0)
        # In-place on a paged-out tensor, and on a view of one.
        dev[1].add_(1)
        views[2].mul_(2)
        torch.cuda.reclaim_inactive()
        expected2 = host[2].clone()
        expected2.view(-1, 1024)[1::2] *= 2
        self.assertEqual(dev[1].cpu(), host[1] + 1, atol=0, rtol=0)
        self.assertEqual(dev[2].cpu(), expected2, atol=0, rtol=0)

    def _train_step(self, seed, limit_headroom=None):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(1024, 1024) for _ in range(6)]
        model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])
        model = model.cuda()
        x = torch.randn(1024, 1024, device="cuda")
        if limit_headroom is not None:
            self._limit_to(limit_headroom)
        loss = model(x).square().mean()
        loss.backward()
        grads = [p.grad.cpu() for p in model.parameters()]
        return loss.item(), grads

    def test_backward_matches_without_lms(self):
        ref_loss, ref_grads = self._train_step(seed=3)
        torch.cuda.set_enabled_lms(True)
        # Activations of 4 MiB each; a 16 MiB headroom forces them out
        # during forward and back in for backward.
        loss, grads = self._train_step(seed=3, limit_headroom=16 * MiB)
        stats = torch.cuda.lms_stats()
        self.assertGreater(stats["pageout_count"], 0)
        self.assertGreater(stats["pagein_count"], 0)
        self.assertEqual(loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            self.assertEqual(g, r)

    def test_reset_stats(self):
        torch.cuda.set_enabled_lms(True)
        _, dev = self._fill(2, seed=4)
        self._touch(dev)
        torch.cuda.reclaim_inactive()
        self.assertGreater(torch.cuda.lms_stats()["pageout_count"], 0)
        torch.cuda.reset_accumulated_memory_stats()
        self.assertEqual(torch.cuda.lms_stats()["pageout_count"], 0)
        del dev
        peak = torch.cuda.lms_stats()["pagedout_bytes"]["peak"]
        self.assertGreater(peak, 0)
        torch.cuda.reset_peak_memory_stats()
        self.assertEqual(torch.cuda.lms_stats()["pagedout_bytes"]["peak"], 0)

    @unittest.skipIf(torch.cuda.device_count() < 2, "needs two CUDA devices")
    def test_limit_per_device(self):
        torch.cuda.set_limit_lms(256 * MiB, device=0)
        torch.cuda.set_limit_lms(128 * MiB, device=1)
        self.assertEqual(torch.cuda.get_limit_lms(0), 256 * MiB)
        self.assertEqual(torch.cuda.get_limit_lms(1), 128 * MiB)
        torch.cuda.set_limit_lms(0, device=1)


if __name__ == "__main__":
    run_tests()
