// Statistics: what getStats() reports for a device (the engine's counters
// and gauges, the copy timings, the learned schedule's and the host pool's
// figures), and the resets of peaks and of accumulated counts.

#include <c10/cuda/LargeModelSupportInternal.h>

#include <algorithm>

namespace c10::cuda::lms {

using namespace detail;

LmsStats getStats(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  pollTimings(e, /*wait=*/false);
  LmsStats s;
  size_t paged_in_last_iteration = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    s = e.stats;
    paged_in_last_iteration = e.pagein_last_iteration;
  }
  {
    std::lock_guard<std::mutex> lock(e.timing_mutex);
    s.stall_ms = e.stall_ms;
    s.copy_out_bytes = e.copy_out_bytes;
    s.copy_out_ms = e.copy_out_ms;
    s.copy_in_bytes = e.copy_in_bytes;
    s.copy_in_ms = e.copy_in_ms;
    s.recompute_ms = e.recompute_ms;
  }
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    const AccessSchedule& schedule = theSchedule();
    s.schedule_active = schedule.active() ? 1 : 0;
    s.schedule_period = static_cast<int64_t>(schedule.period());
    s.schedule_detections = schedule.detections() - e.detections_base;
    s.schedule_fallbacks = schedule.fallbacks() - e.fallbacks_base;
  }
  const HostPool::Usage host = hostPool().usage();
  s.host_bytes.current = host.held_bytes;
  s.host_bytes.peak = host.peak_held_bytes;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    s.host_refusals = host.budget_refusals - e.host_refusals_base;
    s.host_pin_count = host.pins - e.host_pins_base;
    s.host_pin_ms = host.pin_ms - e.host_pin_ms_base;
    s.host_wait_count = host.waits - e.host_waits_base;
    s.host_wait_ms = host.wait_ms - e.host_wait_ms_base;
    s.host_copy_wait_count = host.copy_waits - e.host_copy_waits_base;
    s.host_copy_wait_ms = host.copy_wait_ms - e.host_copy_wait_ms_base;
  }
  const HostPool::BudgetStatus budget = hostPool().budgetStatus();
  s.host_budget_bytes =
      budget.budget == kNoHostLimit ? 0 : static_cast<int64_t>(budget.budget);
  s.host_ledger_bytes = static_cast<int64_t>(budget.held.all);
  s.limit_bytes = g_backend.load() != nullptr ? effectiveLimit(e) : 0;
  if (s.schedule_active != 0) {
    s.schedule_prefetch_budget_bytes = static_cast<int64_t>(
        prefetchBudget(s.limit_bytes, paged_in_last_iteration));
  }
  if (DeviceMemoryBackend* b = g_backend.load()) {
    const auto pools = static_cast<int64_t>(b->privatePoolBytes(device));
    std::lock_guard<std::mutex> lock(e.mutex);
    e.stats.private_pool_bytes.current = pools;
    e.stats.private_pool_bytes.peak =
        std::max(e.stats.private_pool_bytes.peak, pools);
    s.private_pool_bytes = e.stats.private_pool_bytes;
  }
  return s;
}

void resetPeakStats(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  std::lock_guard<std::mutex> lock(e.mutex);
  for (LmsStat* stat :
       {&e.stats.managed_bytes,
        &e.stats.active_bytes,
        &e.stats.inactive_bytes,
        &e.stats.pagedout_bytes,
        &e.stats.spilled_bytes,
        &e.stats.dropped_bytes,
        &e.stats.over_limit_bytes,
        &e.stats.operator_output_bytes}) {
    stat->peak = stat->current;
  }
  hostPool().resetPeak();
}

void resetAccumulatedStats(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    // The prefetch budget's measurement of the iteration under way goes on
    // across the reset (statistics are the user's; the engine's behaviour
    // must not depend on when they are reset).
    e.iteration_pagein_base -= e.stats.pagein_bytes;
    LmsStats fresh;
    fresh.managed_bytes = e.stats.managed_bytes;
    fresh.active_bytes = e.stats.active_bytes;
    fresh.inactive_bytes = e.stats.inactive_bytes;
    fresh.pagedout_bytes = e.stats.pagedout_bytes;
    fresh.spilled_bytes = e.stats.spilled_bytes;
    fresh.dropped_bytes = e.stats.dropped_bytes;
    fresh.over_limit_bytes = e.stats.over_limit_bytes;
    fresh.operator_output_bytes = e.stats.operator_output_bytes;
    e.stats = fresh;
    const HostPool::Usage host = hostPool().usage();
    e.host_refusals_base = host.budget_refusals;
    e.host_pins_base = host.pins;
    e.host_pin_ms_base = host.pin_ms;
    e.host_waits_base = host.waits;
    e.host_wait_ms_base = host.wait_ms;
    e.host_copy_waits_base = host.copy_waits;
    e.host_copy_wait_ms_base = host.copy_wait_ms;
    std::lock_guard<std::mutex> schedule_lock(g_schedule_mutex);
    e.detections_base = theSchedule().detections();
    e.fallbacks_base = theSchedule().fallbacks();
  }
  pollTimings(e, /*wait=*/true);
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  e.stall_ms = 0.0;
  e.copy_out_bytes = 0;
  e.copy_out_ms = 0.0;
  e.copy_in_bytes = 0;
  e.copy_in_ms = 0.0;
  e.recompute_ms = 0.0;
}

} // namespace c10::cuda::lms
