// How much of the device LMS lets this process's tensors take, and the
// allocation path that keeps to it: this process's share of the device
// (what other processes and libraries leave, less a headroom), the limit in
// force, returning cached blocks when others need them, and the limit
// trigger and reclaim-and-retry of every LMS allocation (allocateDevice, and
// reclaimForFailedAllocation for allocators that retry in their own malloc
// path), and the last resort of that path: memory outside LMS that its owner
// gives back (setOutsideMemoryReleaser).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <algorithm>
#include <chrono>

namespace c10::cuda::lms {

namespace detail {

namespace {

// Share of the device's memory that every LMS process leaves free for
// memory taken outside the caching allocator: library handles and workspaces
// (cuBLAS, cuDNN, NCCL) of this process and of others sharing the device.
constexpr double kDeviceHeadroomFraction = 0.05;
// Share of the allocator's own cap (DeviceMemoryBackend::capacityBytes) that
// the limit leaves free for the allocator's fragmentation (effectiveLimit).
constexpr double kCapacityHeadroomFraction = 0.05;
// How long a reading of the memory other processes hold is trusted before the
// allocation path asks the driver again (cudaMemGetInfo costs microseconds,
// too much for every allocation).
constexpr std::chrono::milliseconds kDeviceSampleInterval{10};
// How many times one allocation asks the releaser of memory outside LMS
// while it keeps giving memory back (a releaser that says it gave some but
// did not must not keep the allocation from failing).
constexpr int kOutsideReleaseRounds = 4;

std::atomic<OutsideMemoryReleaser> g_outside_releaser{nullptr};

// Reads how much of the device anything but this process's caching allocator
// holds, and what this process reserves, at most every kDeviceSampleInterval.
// The first figure does not move when this process allocates or frees through
// the allocator, so a reading stays good for a while; it moves when other
// processes (or libraries, outside the allocator) take or return memory.
void sampleDevice(DeviceEngine& e) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.device_total != 0 && now - e.device_sampled < kDeviceSampleInterval) {
      return;
    }
  }
  DeviceScope guard(e.device);
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t reserved = backend().reservedBytes(e.device);
  const size_t used = total_bytes > free_bytes ? total_bytes - free_bytes : 0;
  std::lock_guard<std::mutex> lock(e.mutex);
  e.device_total = total_bytes;
  e.device_others = used > reserved ? used - reserved : 0;
  e.device_others_floor = std::min(e.device_others_floor, e.device_others);
  e.device_reserved = reserved;
  e.device_sampled = now;
}

} // namespace

// The device memory that anything but this process's caching allocator
// leaves (last sample). Engine lock held.
size_t leftByOthers(const DeviceEngine& e) {
  return e.device_total > e.device_others ? e.device_total - e.device_others
                                          : 0;
}

// This process's share of the device: the device, less what others hold, less
// the headroom every LMS process leaves free. Processes sharing a device each
// see the others' memory here, so their shares shrink as the others grow and
// the device never fills up with tensors of any one of them. Engine lock held.
size_t shareOf(const DeviceEngine& e) {
  const auto headroom = static_cast<size_t>(
      kDeviceHeadroomFraction * static_cast<double>(e.device_total));
  const size_t left = leftByOthers(e);
  return left > headroom ? left - headroom : 0;
}

// The limit set by the user (API or PYTORCH_CUDA_ALLOC_CONF), capped at this
// process's share of the device.
size_t limitOf(DeviceEngine& e) {
  sampleDevice(e);
  std::lock_guard<std::mutex> lock(e.mutex);
  const size_t share = shareOf(e);
  const size_t user = e.user_limit != 0 ? e.user_limit : g_conf_limit.load();
  return user != 0 ? std::min(user, share) : share;
}

// The limit in force: never more than the allocator may hold, less a
// headroom. The allocator's cap (a per-process memory fraction) bounds what
// it reserves, which exceeds what is allocated by the free pieces of its
// segments. Allocated memory right up to the cap therefore makes allocations
// fail, and recovering from that (the allocator empties its cache, LMS pages
// out with a hand-back) synchronizes the device: ResNet-152 trained 14%
// slower at 2x oversubscription with the limit at the cap than at 95% of it.
size_t effectiveLimit(DeviceEngine& e) {
  size_t capacity = backend().capacityBytes(e.device);
  if (capacity != SIZE_MAX) {
    capacity -= static_cast<size_t>(
        kCapacityHeadroomFraction * static_cast<double>(capacity));
  }
  return std::min(limitOf(e), capacity);
}

namespace {

// Least time between two returns of cached free blocks to the device: each
// one synchronizes the device.
constexpr std::chrono::milliseconds kCacheReleaseInterval{100};
// Share of the device by which what others hold must exceed the least this
// process has seen them hold before its cached free blocks go back to the
// device (releaseCacheOverShare): less is this process's own CUDA context and
// library handles settling, not a process that needs the memory.
constexpr double kOthersGrowthFraction = 0.01;

// When this process reserves more than its share of the device while others
// (another process sharing the device, or a library allocating outside the
// allocator) have grown, free blocks sit in its cache that they may be
// failing for: give them back to the device. Judged on the last device sample
// (sampleDevice), so the allocation path asks the allocator for nothing more;
// rate-limited, because returning cached memory synchronizes the device.
// Not while nothing else has grown: a process alone on a device with a model
// bigger than it reserves past its share whenever its allocated bytes near
// the limit with blocks cached beside them, and returning them made the
// allocator map the same memory again right after, every interval (ResNet-152
// at 1.5x the device: 3 to 13 returns and about 100 new device allocations
// an iteration). Nor against a limit the user set below the share: blocks
// cached above it stand in nobody's way either.
void releaseCacheOverShare(DeviceEngine& e) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.device_reserved <= shareOf(e)) {
      return;
    }
    const auto growth = static_cast<size_t>(
        kOthersGrowthFraction * static_cast<double>(e.device_total));
    if (e.device_others <= e.device_others_floor + growth) {
      return;
    }
    if (e.cache_released.time_since_epoch().count() != 0 &&
        now - e.cache_released < kCacheReleaseInterval) {
      return;
    }
    e.cache_released = now;
  }
  if (backend().releaseCachedMemory(e.device)) {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.cache_releases;
  }
}

// Set when the allocator's own malloc path reclaimed for this thread's
// allocation (reclaimForFailedAllocation), for the allocation-source stats.
thread_local bool t_reclaimed_in_malloc = false;

// Asks the releaser of memory outside LMS to give memory back for a request
// of `size` bytes that no page-out could place; keeps what it says about the
// rest for the error message.
bool releaseOutside(DeviceEngine& e, size_t size) {
  const OutsideMemoryReleaser release = g_outside_releaser.load();
  if (release == nullptr) {
    return false;
  }
  std::string note;
  const bool released = release(e.device, size, note);
  t_outside_note = std::move(note);
  return released;
}

// Makes room for an allocation of `size` bytes under the limit. Returns the
// bytes paged out for it.
size_t enforceLimit(DeviceEngine& e, size_t size) {
  const size_t limit = effectiveLimit(e);
  const size_t allocated = backend().allocatedBytes(e.device);
  const size_t wanted = allocated + size;
  size_t freed = 0;
  if (wanted > limit) {
    freed = reclaim(e, wanted - limit, Trigger::Limit);
    // What is left above the limit could not be paged out: it is pinned by
    // running operators, or not (yet) reclaimable.
    const size_t after = wanted > freed ? wanted - freed : 0;
    const auto over =
        static_cast<int64_t>(after > limit ? after - limit : size_t{0});
    std::lock_guard<std::mutex> lock(e.mutex);
    e.stats.over_limit_bytes.current = over;
    e.stats.over_limit_bytes.peak =
        std::max(e.stats.over_limit_bytes.peak, over);
  } else if (e.stats.over_limit_bytes.current != 0) {
    std::lock_guard<std::mutex> lock(e.mutex);
    e.stats.over_limit_bytes.current = 0;
  }
  // After the reclaim, whose page-outs return their memory to the cache.
  releaseCacheOverShare(e);
  if (wanted > limit) {
    return freed;
  }
  const size_t margin = g_speculative_margin.load();
  if (margin != 0 && limit > margin && wanted > limit - margin) {
    return reclaim(e, wanted - (limit - margin), Trigger::Speculative);
  }
  return 0;
}

} // namespace

thread_local std::string t_outside_note;

// Device memory for `size` bytes on `stream`, reclaiming as needed. When
// nothing more can be reclaimed and nothing outside LMS given back it raises
// the out-of-memory error, or with `or_null` returns null (the caller places
// the request elsewhere or raises it).
void* allocateDevice(
    DeviceEngine& e,
    size_t size,
    cudaStream_t stream,
    bool or_null) {
  DeviceMemoryBackend& b = backend();
  bool reclaimed = enforceLimit(e, size) > 0;
  const size_t reserved_before = b.reservedBytes(e.device);
  void* ptr = nullptr;
  t_reclaimed_in_malloc = false;
  if (C10_UNLIKELY(!t_outside_note.empty())) {
    t_outside_note.clear(); // said about an earlier allocation
  }
  int outside_rounds = 0;
  while (ptr == nullptr) {
    try {
      ptr = b.malloc(e.device, size, stream);
      reclaimed = reclaimed || t_reclaimed_in_malloc;
    } catch (const c10::OutOfMemoryError&) {
      // The allocator has already tried its free list, its free-memory
      // callbacks and releasing its cache. Page out the storages that hold a
      // range the request fits in, else what is left in reclaim order.
      if (reclaimFragments(e, size, stream) == 0 &&
          reclaim(e, size, Trigger::AllocFailure) == 0) {
        // Nothing LMS manages is left to page out. Memory outside it whose
        // owner can give it back comes before host placement and the error:
        // the allocator returns what was given back to the device when it
        // retries (its cache release frees the segments of a private pool
        // that no graph uses any more).
        if (outside_rounds < kOutsideReleaseRounds && releaseOutside(e, size)) {
          ++outside_rounds;
          continue;
        }
        if (or_null) {
          return nullptr;
        }
        throwOutOfMemory(e, size);
      }
      reclaimed = true;
    }
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  if (reclaimed) {
    ++e.stats.alloc_after_reclaim;
  } else if (b.reservedBytes(e.device) > reserved_before) {
    ++e.stats.alloc_from_device;
  } else {
    ++e.stats.alloc_from_cache;
  }
  return ptr;
}

} // namespace detail

using namespace detail;

size_t ensureHeadroom(c10::DeviceIndex device, size_t incoming_bytes) {
  if (!isEnabled() || g_backend.load() == nullptr) {
    return 0;
  }
  return enforceLimit(engineFor(device), incoming_bytes);
}

void setOutsideMemoryReleaser(OutsideMemoryReleaser releaser) {
  g_outside_releaser.store(releaser);
}

bool reclaimForFailedAllocation(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream) {
  if (!isEnabled() || t_no_reclaim) {
    return false;
  }
  DeviceEngine& e = engineFor(device);
  const bool freed = reclaimFragments(e, size, stream) > 0 ||
      reclaim(e, size, Trigger::AllocFailure) > 0;
  t_reclaimed_in_malloc = t_reclaimed_in_malloc || freed;
  return freed;
}

} // namespace c10::cuda::lms
