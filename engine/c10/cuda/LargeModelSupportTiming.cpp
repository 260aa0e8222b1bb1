// Timing of LMS copies and of the waits they cause, read back from CUDA
// events without blocking the host, and the cost model built on it: what a
// copy costs one way or both, and the share of copy time that streams spent
// waiting (recompute weighs paging against a replay with them).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <algorithm>

namespace c10::cuda::lms {

namespace detail {

void pollTimings(DeviceEngine& e, bool wait) {
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  while (!e.timings.empty()) {
    PendingTiming s = e.timings.front();
    if (wait) {
      C10_CUDA_CHECK(cudaEventSynchronize(s.end));
      C10_CUDA_CHECK(cudaEventSynchronize(s.start));
    } else {
      cudaError_t err = cudaEventQuery(s.end);
      if (err == cudaSuccess) {
        err = cudaEventQuery(s.start);
      }
      if (err == cudaErrorNotReady) {
        (void)cudaGetLastError(); // not an error: clear the sticky state
        break;
      }
      C10_CUDA_CHECK(err);
    }
    float ms = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, s.start, s.end));
    // Negative: the copy finished before the compute stream got there.
    const double elapsed = std::max(0.f, ms);
    switch (s.what) {
      case Timed::Stall:
        e.stall_ms += elapsed;
        e.bus_stall_ms += elapsed;
        break;
      case Timed::CopyOut:
        e.copy_out_ms += elapsed;
        e.copy_out_bytes += static_cast<int64_t>(s.bytes);
        e.bus_out_ms += elapsed;
        e.bus_out_bytes += static_cast<double>(s.bytes);
        break;
      case Timed::CopyIn:
        e.copy_in_ms += elapsed;
        e.copy_in_bytes += static_cast<int64_t>(s.bytes);
        e.bus_in_ms += elapsed;
        e.bus_in_bytes += static_cast<double>(s.bytes);
        break;
      case Timed::Recompute:
        e.recompute_ms += elapsed;
        break;
    }
    e.events.put(s.start);
    e.events.put(s.end);
    e.timings.pop_front();
  }
  // The cost model follows the recent copies: halving every accumulator
  // keeps the bandwidth and the stall share of roughly the last few seconds
  // of copy time, so a schedule that learns to hide copies lowers the price
  // of paging within an iteration or two.
  constexpr double kBusWindowMs = 2000.0;
  if (e.bus_out_ms + e.bus_in_ms > kBusWindowMs) {
    for (double* v :
         {&e.bus_out_ms,
          &e.bus_out_bytes,
          &e.bus_in_ms,
          &e.bus_in_bytes,
          &e.bus_stall_ms}) {
      *v /= 2.0;
    }
  }
}

void addTiming(
    DeviceEngine& e,
    Timed what,
    cudaEvent_t start,
    cudaEvent_t end,
    size_t bytes) {
  constexpr size_t kMaxPending = 4096;
  bool flush = false;
  {
    std::lock_guard<std::mutex> lock(e.timing_mutex);
    e.timings.push_back({start, end, what, bytes});
    flush = e.timings.size() > kMaxPending;
  }
  if (flush) {
    pollTimings(e, /*wait=*/true);
  } else {
    pollTimingsSometimes(e);
  }
}

// How often the engine polls pending timings on its busy paths: every
// tensor's allocation, every copy or replay it times, every price it
// weighs (a reclaim prices its candidates one by one). While a copy is in
// flight each poll queries its event (a few hundred nanoseconds of host
// time, twice that when it is not done) to learn nothing new: a copy LMS
// times moves at least a megabyte, and the cost model follows seconds of
// copies (kBusWindowMs).
constexpr std::chrono::microseconds kPollInterval{200};

void pollTimingsSometimes(DeviceEngine& e) {
  {
    std::lock_guard<std::mutex> lock(e.timing_mutex);
    if (e.timings.empty()) {
      return; // the common case, with no clock read
    }
    // Until a copy is timed every poll counts: the first timing is what
    // lets recompute weigh a replay against paging at all.
    if (e.bus_out_ms + e.bus_in_ms > 0.0) {
      const auto now = std::chrono::steady_clock::now();
      if (now - e.timings_polled < kPollInterval) {
        return;
      }
      e.timings_polled = now;
    }
  }
  pollTimings(e, /*wait=*/false);
}

void addStall(DeviceEngine& e, cudaEvent_t start, cudaEvent_t end) {
  addTiming(e, Timed::Stall, start, end);
}

namespace {

// Milliseconds per byte a copy takes one way at the bandwidth measured so
// far (the other way's where one way has none yet), or -1 before any copy was
// timed. Timing lock held.
double msPerByte(const DeviceEngine& e, bool to_device) {
  double ms = to_device ? e.bus_in_ms : e.bus_out_ms;
  double moved = to_device ? e.bus_in_bytes : e.bus_out_bytes;
  if (moved <= 0.0 || ms <= 0.0) {
    ms = to_device ? e.bus_out_ms : e.bus_in_ms;
    moved = to_device ? e.bus_out_bytes : e.bus_in_bytes;
  }
  return moved <= 0.0 || ms <= 0.0 ? -1.0 : ms / moved;
}

// The share of recent copy time that streams spent waiting for copies (at
// most 1; 1 before any copy was timed): what a copy costs the program per
// millisecond of copying. A copy the learned schedule hides behind compute
// costs nothing; a recompute always runs on the compute stream. Timing lock
// held.
double stallShareLocked(const DeviceEngine& e) {
  const double copying = e.bus_out_ms + e.bus_in_ms;
  return copying > 0.0 ? std::min(1.0, e.bus_stall_ms / copying) : 1.0;
}

// Milliseconds a copy of `bytes` takes one way (`to_device`), or both ways
// (out and back in) when `both_ways`; -1 before any copy was timed. With
// `stalled`, times the stall share: what the copy costs the program.
double copyCost(
    DeviceEngine& e,
    size_t bytes,
    bool to_device,
    bool both_ways = false,
    bool stalled = false) {
  pollTimingsSometimes(e);
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  double per_byte = msPerByte(e, to_device);
  if (both_ways && per_byte >= 0.0) {
    const double back = msPerByte(e, !to_device);
    per_byte = back < 0.0 ? -1.0 : per_byte + back;
  }
  if (per_byte < 0.0) {
    return -1.0;
  }
  return per_byte * static_cast<double>(bytes) *
      (stalled ? stallShareLocked(e) : 1.0);
}

} // namespace

// stallShareLocked(), taking the timing lock.
double stallShare(DeviceEngine& e) {
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  return stallShareLocked(e);
}

// What paging `bytes` out and back in costs the program: both copies' time
// times the stall share.
double pagingCost(DeviceEngine& e, size_t bytes) {
  return copyCost(
      e, bytes, /*to_device=*/false, /*both_ways=*/true, /*stalled=*/true);
}

} // namespace detail

using namespace detail;

double copyCostMs(c10::DeviceIndex device, size_t bytes, bool to_device) {
  return copyCost(engineFor(device), bytes, to_device);
}

double pagingCostMs(c10::DeviceIndex device, size_t bytes) {
  return pagingCost(engineFor(device), bytes);
}

double copyStallShare(c10::DeviceIndex device) {
  return stallShare(engineFor(device));
}

} // namespace c10::cuda::lms
