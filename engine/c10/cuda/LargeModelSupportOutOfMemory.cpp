// LMS out-of-memory errors: the message that says why no room could be made
// (the running operator's working set, the memory the allocator keeps mapped,
// or the host tier that ran out), the error that an operator's pinning
// hands to the next allocation on its thread, and the error that ends a
// CUDA graph pool step instead.

#include <c10/cuda/LargeModelSupportInternal.h>

#include <cstdio>
#include <exception>
#include <string>
#include <utility>

namespace c10::cuda::lms {

namespace detail {

namespace {

// An operator on this thread could not make its inputs resident; its next
// LMS allocation raises this (see setPendingError()).
thread_local std::exception_ptr t_pending_error;

// Out-of-memory errors raised on this thread (outOfMemoryErrorsRaised()).
thread_local uint64_t t_oom_raised = 0;
thread_local size_t t_oom_request = 0;
thread_local std::string t_oom_verdict;

// Graph pool steps under way on this thread (beginGraphPoolStep), and
// whether one ran out of memory since the outermost began.
thread_local int t_pool_steps = 0;
thread_local bool t_pool_step_ran_out = false;

// What the caching allocator maps for a new request of `size` bytes at least:
// requests up to 1 MiB come from 2 MiB segments, up to 10 MiB from 20 MiB
// segments, larger ones from segments rounded up to 2 MiB (its expandable
// segments map 2 and 20 MiB pages, the same or less for requests of these
// sizes).
size_t segmentBytes(size_t size) {
  constexpr size_t kSmallSegment = 2 * kMiB;
  constexpr size_t kLargeSegment = 20 * kMiB;
  if (size <= kMiB) {
    return kSmallSegment;
  }
  if (size <= 10 * kMiB) {
    return kLargeSegment;
  }
  return (size + kSmallSegment - 1) / kSmallSegment * kSmallSegment;
}

} // namespace

// Raises the error an operator's pinning left for its first allocation.
void raisePendingError(size_t size) {
  if (C10_UNLIKELY(t_pending_error != nullptr)) {
    std::exception_ptr error = std::move(t_pending_error);
    t_pending_error = nullptr;
    if (t_pool_steps > 0) {
      try {
        std::rethrow_exception(error);
      } catch (const c10::Error& pending) {
        raiseIfGraphPoolStep(-1, pending.what_without_backtrace());
      }
    }
    ++t_oom_raised;
    t_oom_request = size;
    t_oom_verdict.clear();
    std::rethrow_exception(error);
  }
}

[[noreturn]] void throwOutOfMemory(
    DeviceEngine& e,
    size_t size,
    bool placement_refused) {
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.oom_count;
  }
  const OutOfMemoryText text =
      explainOutOfMemory(e.device, size, placement_refused);
  raiseIfGraphPoolStep(e.device, text.message);
  ++t_oom_raised;
  t_oom_request = size;
  t_oom_verdict = text.verdict;
  TORCH_CHECK_WITH(OutOfMemoryError, false, text.message);
}

// `placement_refused`: the request was to go to pinned host memory (host
// placement, placeOnHost) and the host refused it; otherwise the host refused
// the page-outs that would have made room, if t_host_refused says so.
OutOfMemoryText explainOutOfMemory(
    c10::DeviceIndex device,
    size_t size,
    bool placement_refused) {
  DeviceEngine& e = engineFor(device);
  const size_t limit = effectiveLimit(e);
  const size_t allocated = backend().allocatedBytes(device);
  LmsStats s;
  size_t reclaimable_count = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    s = e.stats;
    for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
      ++reclaimable_count;
    }
  }
  // snprintf rather than a stream: a locale-dependent stream in a process
  // that mixes C++ runtimes (the drop-in extension) must not be what turns an
  // out-of-memory error into a crash.
  auto mib = [](int64_t bytes) {
    char text[32];
    std::snprintf(
        text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / kMiB);
    return std::string(text);
  };
  if (t_host_refused &&
      HostPool::lastRefusal().cause != HostRefusal::Cause::None) {
    // The device is full and the storages that could make room cannot be
    // paged out, or the request itself cannot be placed in host memory: the
    // host tier below the device has no room. Say so, rather than give the
    // device-side advice.
    const std::string why = placement_refused
        ? std::string(
              ", which the device cannot hold with every reclaimable storage "
              "paged out, and which host placement could not place in pinned "
              "host memory either. ")
        : std::string(
              ", which needs inactive storages paged out to pinned host "
              "memory. ");
    return {
        placement_refused
            ? "Host memory ran out: the device had no room for the request, "
              "and placing it in pinned host memory was refused (the host "
              "budget, or pinning failed)."
            : "Host memory ran out: the page-outs that would have made room "
              "were refused (the host budget, or pinning failed).",
        "CUDA out of memory with Large Model Support: host memory ran "
        "out. Tried to allocate " +
            mib(static_cast<int64_t>(size)) + " on device " +
            std::to_string(int(device)) + why +
            describeHostRefusal(HostPool::lastRefusal()) + " Device " +
            std::to_string(int(device)) + ": " +
            mib(static_cast<int64_t>(allocated)) + " allocated to tensors (" +
            mib(s.inactive_bytes.current) + " inactive), " +
            mib(s.pagedout_bytes.current) + " paged out to host, LMS limit " +
            mib(static_cast<int64_t>(limit)) + "." + spillNote(s)};
  }
  const size_t pools = backend().privatePoolBytes(device);
  // What holds the memory outside LMS that was not given back for this
  // request (idle CUDA graph pools are; see setOutsideMemoryReleaser).
  const std::string outside_note =
      t_outside_note.empty() ? std::string() : " " + t_outside_note;
  const std::string pool_note = pools == 0
      ? std::string()
      : " " + mib(static_cast<int64_t>(pools)) +
          " is reserved by private pools (CUDA graphs, torch.cuda.MemPool), "
          "which LMS never pages out: leave room for them under the cap, or "
          "compile without mode=\"reduce-overhead\".";
  // The allocator, not the LMS limit, is what failed: its cap (a per-process
  // memory fraction) or, without one, what the device has left for this
  // process. The limit only decides when LMS pages out ahead of that.
  const size_t capacity = backend().capacityBytes(device);
  size_t room = capacity;
  if (capacity == SIZE_MAX) {
    std::lock_guard<std::mutex> lock(e.mutex);
    room = leftByOthers(e);
  }
  const std::string room_name = capacity == SIZE_MAX
      ? std::string("the device memory other processes leave (")
      : std::string("the allocator's cap (");
  const size_t reserved = backend().reservedBytes(device);
  // What the running operators need at once: what they pinned, what they
  // allocated so far, and this request. When that alone passes the room, no
  // page-out can help; say so first. When it fits by bytes, the memory the
  // allocator keeps mapped for the tensors left (pieces of segments, or pages,
  // partly used by them) is what has no room for the request.
  const int64_t working_set = s.active_bytes.current +
      s.operator_output_bytes.current + static_cast<int64_t>(size);
  std::string verdict;
  if (working_set > static_cast<int64_t>(room)) {
    verdict = "The running operator's working set does not fit: " +
        mib(s.active_bytes.current) + " pinned + " +
        mib(s.operator_output_bytes.current) + " allocated by it so far + " +
        mib(static_cast<int64_t>(size)) + " requested = " + mib(working_set) +
        " > " + room_name + mib(static_cast<int64_t>(room)) + "). ";
  } else if (reserved + segmentBytes(size) > room) {
    verdict = "The tensors fit by bytes (" +
        mib(static_cast<int64_t>(allocated)) + " allocated + " +
        mib(static_cast<int64_t>(size)) + " requested <= " + room_name +
        mib(static_cast<int64_t>(room)) + ")), but the allocator keeps " +
        mib(static_cast<int64_t>(reserved)) +
        " mapped for them (segments or pages that tensors still in use "
        "occupy in part) and has no room for the request beside it; " +
        (capacity == SIZE_MAX ? "the device memory other processes leave"
                              : "the allocator's cap") +
        " would admit it from " +
        mib(static_cast<int64_t>(reserved + segmentBytes(size))) + " (" +
        mib(static_cast<int64_t>(reserved + segmentBytes(size) - room)) +
        " more). ";
  }
  std::string message =
      "CUDA out of memory with Large Model Support. Tried to allocate " +
      mib(static_cast<int64_t>(size)) + " on device " +
      std::to_string(int(device)) +
      " after paging out every reclaimable storage. " + verdict +
      mib(static_cast<int64_t>(allocated)) +
      " is allocated to tensors: " + mib(s.active_bytes.current) +
      " pinned by the running operator(s), " +
      mib(s.operator_output_bytes.current) +
      " allocated by them and not released yet, " +
      mib(s.inactive_bytes.current) + " inactive (" +
      std::to_string(reclaimable_count) +
      " storages below the LMS size threshold of " +
      mib(static_cast<int64_t>(g_size_threshold.load())) +
      " or without pinned host memory to page to), the rest too small or "
      "not yet used by an operator; the allocator maps " +
      mib(static_cast<int64_t>(reserved)) + ". LMS pages out ahead above " +
      mib(static_cast<int64_t>(limit)) + "; " + mib(s.pagedout_bytes.current) +
      " paged out to host. The working set of one operator must fit on the "
      "device: reduce the batch size or the operator's size, or lower the "
      "size threshold with torch.cuda.set_size_lms()." +
      pool_note + outside_note;
  // The verdict alone, for the warning about an operator that caught the
  // error: its sentence without the space that joins it to the rest.
  while (!verdict.empty() && verdict.back() == ' ') {
    verdict.pop_back();
  }
  return {std::move(verdict), std::move(message)};
}

} // namespace detail

using namespace detail;

void setPendingError(c10::DeviceIndex device, std::exception_ptr error) {
  if (device >= 0) {
    DeviceEngine& e = engineFor(device);
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.pin_failures;
  }
  t_pending_error = std::move(error);
}

void clearPendingError() {
  t_pending_error = nullptr;
}

bool hasPendingError() {
  return t_pending_error != nullptr;
}

void beginGraphPoolStep() {
  if (t_pool_steps++ == 0) {
    t_pool_step_ran_out = false;
  }
}

bool endGraphPoolStep() {
  TORCH_INTERNAL_ASSERT(t_pool_steps > 0, "no graph pool step under way");
  const bool ran_out = t_pool_step_ran_out;
  if (--t_pool_steps == 0) {
    t_pool_step_ran_out = false;
  }
  return ran_out;
}

void raiseIfGraphPoolStep(c10::DeviceIndex device, const std::string& what) {
  if (t_pool_steps == 0) {
    return;
  }
  t_pool_step_ran_out = true;
  const std::string where = device >= 0
      ? " on cuda:" + std::to_string(static_cast<int>(device))
      : std::string();
  TORCH_CHECK(
      false,
      "Large Model Support: out of memory in a CUDA graph pool's warm-up or "
      "capture",
      where,
      "; the compiled code runs again without CUDA graphs. ",
      what);
}

uint64_t outOfMemoryErrorsRaised() {
  return t_oom_raised;
}

size_t lastOutOfMemoryRequest() {
  return t_oom_request;
}

std::string lastOutOfMemoryVerdict() {
  return t_oom_verdict;
}

std::string describeOutOfMemory(c10::DeviceIndex device, size_t size) {
  return explainOutOfMemory(device, size).message;
}

} // namespace c10::cuda::lms
