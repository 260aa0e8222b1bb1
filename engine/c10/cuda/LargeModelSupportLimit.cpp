// How much of the device LMS lets this process's tensors take, and the
// allocation path that keeps to it: this process's share of the device
// (what other processes and libraries leave, less a headroom), the limit in
// force, returning cached blocks when others need them, and the limit
// trigger and reclaim-and-retry of every LMS allocation (allocateDevice,
// reclaimForFailedAllocation for allocators that retry in their own malloc
// path, and reclaimBeforeMapping for those that ask before they map memory
// anew), and the last resort of that path: memory outside LMS that its owner
// gives back (setOutsideMemoryReleaser); the device ledger of the GPU's LMS
// processes, their shares of it (deviceShares) and the wait of a failed
// allocation for the others (waitForDevice).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <thread>

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

// How long what a process needed counts as its need (need_peak): a few
// training steps, so that the memory it frees between two steps does not go
// to the others only to be paged out of them again at its next step.
constexpr std::chrono::seconds kNeedWindow{5};
// How often a waiting allocation reads the ledger and tries again.
constexpr std::chrono::milliseconds kDeviceWaitPoll{20};
// How long every holder of the device must have waited before the last of
// them to join gives up (waitForDevice): the others' page-downs to their
// new parts take a few polls to free what the oldest waiter needs.
constexpr std::chrono::seconds kDeviceYieldGrace{2};
// Waits start often where processes take turns at every step: one line, then
// at most one a minute.
constexpr std::chrono::seconds kDeviceWaitWarnInterval{60};

std::string mib(size_t bytes) {
  char text[32];
  std::snprintf(
      text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / kMiB);
  return text;
}

// The ledger of the GPU of engine `e`, named by the GPU's UUID.
DeviceLedger& ledgerOf(DeviceEngine& e) {
  std::call_once(e.ledger_once, [&e] {
    e.ledger =
        std::make_unique<DeviceLedger>(DeviceLedger::pathForDevice(e.device));
  });
  return *e.ledger;
}

// This process's part of the device under deviceShares: the device, less the
// headroom, less what holders other than the LMS processes of the ledger take
// (this process's context and library handles among them), split among the
// live LMS processes. SIZE_MAX when no other LMS process uses the GPU: the
// share is then what the others leave, as without a ledger.
size_t lmsShare(
    size_t total,
    size_t others,
    const DeviceClaim& own,
    const std::vector<DeviceLedger::Peer>& peers) {
  if (peers.empty()) {
    return SIZE_MAX;
  }
  std::vector<DeviceClaim> claims{own};
  size_t lms_others = 0;
  for (const DeviceLedger::Peer& peer : peers) {
    claims.push_back(peer.claim);
    lms_others += peer.claim.held;
  }
  const size_t outside = others > lms_others ? others - lms_others : 0;
  const auto headroom =
      static_cast<size_t>(kDeviceHeadroomFraction * static_cast<double>(total));
  const size_t taken = headroom + outside;
  const size_t pool = total > taken ? total - taken : 0;
  return deviceShares(pool, claims)[0];
}

// Reads how much of the device anything but this process's caching allocator
// holds, and what this process reserves, at most every kDeviceSampleInterval.
// The first figure does not move when this process allocates or frees through
// the allocator, so a reading stays good for a while; it moves when other
// processes (or libraries, outside the allocator) take or return memory.
// The same reading publishes this process's claim in the device ledger and
// reads the others' (`force`: now, whenever the last reading was).
void sampleDevice(DeviceEngine& e, bool force = false) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (!force && e.device_total != 0 &&
        now - e.device_sampled < kDeviceSampleInterval) {
      return;
    }
  }
  DeviceScope guard(e.device);
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  DeviceMemoryBackend& b = backend();
  const size_t reserved = b.reservedBytes(e.device);
  const size_t allocated = b.allocatedBytes(e.device);
  const size_t used = total_bytes > free_bytes ? total_bytes - free_bytes : 0;
  size_t need = 0;
  {
    // What it would take with no limit: what is allocated, plus what LMS
    // moved off the device, at its most over the last kNeedWindow.
    std::lock_guard<std::mutex> lock(e.mutex);
    const size_t demand = allocated +
        static_cast<size_t>(std::max<int64_t>(
            e.stats.pagedout_bytes.current + e.stats.dropped_bytes.current, 0));
    if (demand >= e.need_peak || now - e.need_peak_at > kNeedWindow) {
      e.need_peak = demand;
      e.need_peak_at = now;
    }
    // At least a byte: a need of 0 in the ledger says "not known yet" and
    // counts as the whole device, so a process with LMS on that held
    // nothing kept a busy one of the same GPU to half of it.
    need = std::max<size_t>(e.need_peak, 1);
  }
  // Only a process with LMS on takes part in the shares (a process that
  // reads a limit without enabling LMS is one of the holders outside them).
  DeviceClaim own;
  std::vector<DeviceLedger::Peer> peers;
  if (isEnabled()) {
    peers = ledgerOf(e).update(reserved, need, &own);
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  e.device_total = total_bytes;
  e.device_others = used > reserved ? used - reserved : 0;
  e.device_others_floor = std::min(e.device_others_floor, e.device_others);
  e.device_reserved = reserved;
  e.device_sampled = now;
  e.device_lms_share = lmsShare(total_bytes, e.device_others, own, peers);
  e.device_peers = std::move(peers);
  e.device_ticket = own.ticket;
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
// With other LMS processes on the GPU, never more than this process's part
// under deviceShares (the device ledger): what the others hold over their
// parts they page down at their next allocation, so they do not keep it.
size_t shareOf(const DeviceEngine& e) {
  const auto headroom = static_cast<size_t>(
      kDeviceHeadroomFraction * static_cast<double>(e.device_total));
  const size_t left = leftByOthers(e);
  return std::min(left > headroom ? left - headroom : 0, e.device_lms_share);
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
    // Another LMS process of the GPU waiting for device memory needs them
    // whether or not what the others hold has grown.
    const bool peer_waits = std::any_of(
        e.device_peers.begin(),
        e.device_peers.end(),
        [](const DeviceLedger::Peer& peer) { return peer.claim.waiting != 0; });
    if (e.device_others <= e.device_others_floor + growth && !peer_waits) {
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

// Notes what is allocated once an allocation is made, after its reclaim:
// the most since the last operator boundary is part of the learned
// schedule's demand (recordDemand).
void noteAllocatedHigh(DeviceEngine& e, size_t bytes) {
  size_t seen = e.allocated_high.load(std::memory_order_relaxed);
  while (bytes > seen &&
         !e.allocated_high.compare_exchange_weak(
             seen, bytes, std::memory_order_relaxed)) {
  }
}

// Makes room for an allocation of `size` bytes under `limit` (the limit in
// force, effectiveLimit). Returns the bytes paged out for it.
size_t enforceLimit(DeviceEngine& e, size_t size, size_t limit) {
  const size_t allocated = backend().allocatedBytes(e.device);
  const size_t wanted = allocated + size;
  if (wanted > limit / 2) {
    // Recipes from here on: what is made past half the limit is what a
    // reclaim will need, and iteration 0 then drops instead of paging it.
    noteNearLimit();
  }
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
  noteAllocatedHigh(e, wanted > freed ? wanted - freed : 0);
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

// A failed allocation's wait for the other LMS processes of the GPU.
struct DeviceWait {
  bool begun = false; // the allocation has waited: the setting runs
  std::chrono::steady_clock::time_point begin;
  bool started = false; // waiting now (the ledger says so)
  std::chrono::steady_clock::time_point since;
  bool all_waiting = false; // every holder waited at the last poll
  std::chrono::steady_clock::time_point all_waiting_since;
  std::string whom; // the holders when the wait began
};

void endDeviceWait(DeviceEngine& e, DeviceWait& w) {
  if (!w.started) {
    return;
  }
  (void)ledgerOf(e).setWaiting(0);
  w.started = false;
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - w.since)
                        .count();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.stats.device_wait_ms += ms;
}

// Ends a wait unmet: the error of the allocation says how long it waited,
// for whom, and why it stopped.
bool giveUpDeviceWait(DeviceEngine& e, DeviceWait& w, const char* why) {
  endDeviceWait(e, w);
  if (w.begun) {
    char waited[32];
    std::snprintf(
        waited,
        sizeof(waited),
        "%.1f s",
        std::chrono::duration<double>(
            std::chrono::steady_clock::now() - w.begin)
            .count());
    t_outside_note += (t_outside_note.empty() ? "" : " ") +
        std::string("It waited ") + waited +
        " for other LMS processes of this GPU to release device memory (" +
        w.whom + ") and " + why +
        " (torch.cuda.set_host_wait_lms(), lms_host_wait_s: the one wait "
        "for host and device memory).";
  }
  return false;
}

// After an allocation failed with nothing of this process's left to page
// out: while other LMS processes of the GPU hold device memory that would
// make room, waits a poll for them (true: try again), up to the wait setting
// (setHostWait, the one wait for host and device memory). Its ledger slot
// says what it waits for; deviceShares then gives the oldest waiting process
// what it waits for, and the others page down to their smaller parts. When
// every holder waits and still nothing frees for kDeviceYieldGrace, the last
// to join gives up (false: the error of today), as the host's wait does
// (LargeModelSupportHostPool.h says why that one).
bool waitForDevice(DeviceEngine& e, size_t size, DeviceWait& w) {
  const double limit_s = hostPool().getWait();
  DeviceLedger& ledger = ledgerOf(e);
  if (limit_s <= 0 || !ledger.shared()) {
    return false;
  }
  sampleDevice(e, /*force=*/true);
  const auto now = std::chrono::steady_clock::now();
  std::string whom;
  size_t free_now = 0;
  DeviceWaitDecision decision = DeviceWaitDecision::NothingToWaitFor;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    for (const DeviceLedger::Peer& peer : e.device_peers) {
      if (peer.claim.held != 0) {
        whom += (whom.empty() ? "pid " : ", pid ") + std::to_string(peer.pid) +
            " holds " + mib(peer.claim.held) +
            (peer.claim.waiting != 0 ? ", waiting" : "");
      }
    }
    const size_t left = leftByOthers(e);
    free_now = left > e.device_reserved ? left - e.device_reserved : 0;
    decision =
        DeviceLedger::decide(size, free_now, e.device_ticket, e.device_peers);
  }
  if (decision == DeviceWaitDecision::NothingToWaitFor) {
    return giveUpDeviceWait(e, w, "nothing they hold would make room");
  }
  if (!w.started) {
    if (!ledger.setWaiting(size)) {
      return false;
    }
    w.started = true;
    w.since = now;
    if (!w.begun) {
      w.begun = true;
      w.begin = now;
      w.whom = whom;
      bool announce = false;
      {
        std::lock_guard<std::mutex> lock(e.mutex);
        ++e.stats.device_wait_count;
        if (e.stats.device_wait_count == 1 ||
            now - e.device_wait_warned >= kDeviceWaitWarnInterval) {
          e.device_wait_warned = now;
          announce = true;
        }
      }
      if (announce) {
        char limit[32];
        std::snprintf(limit, sizeof(limit), "%.1f s", limit_s);
        TORCH_WARN(
            "Large Model Support: device ",
            int(e.device),
            " has no room for an allocation of ",
            mib(size),
            "; waiting up to ",
            limit,
            " for other LMS processes of this GPU to release ",
            mib(size > free_now ? size - free_now : 0),
            " of device memory: ",
            whom,
            " (torch.cuda.set_host_wait_lms(), lms_host_wait_s).");
      }
    }
  }
  if (now - w.begin >= std::chrono::duration<double>(limit_s)) {
    return giveUpDeviceWait(e, w, "the wait ran out");
  }
  if (decision == DeviceWaitDecision::GiveWay) {
    if (!w.all_waiting) {
      w.all_waiting = true;
      w.all_waiting_since = now;
    } else if (now - w.all_waiting_since >= kDeviceYieldGrace) {
      return giveUpDeviceWait(
          e,
          w,
          "every one of them waited too: this process, the last to start, "
          "gave up so that the others go on");
    }
  } else {
    w.all_waiting = false;
  }
  std::this_thread::sleep_for(kDeviceWaitPoll);
  // An older waiting process may have been given part of this one's share:
  // page down to it, so that it goes on.
  (void)enforceLimit(e, 0, effectiveLimit(e));
  return true;
}

} // namespace

thread_local std::string t_outside_note;

namespace {

// Whether the allocator cannot map `size` more bytes: what it has mapped
// and the request pass the device that other processes leave this one, or
// its cap. False before the device was sampled.
bool cannotMapAnew(DeviceEngine& e, size_t size) {
  DeviceMemoryBackend& b = backend();
  size_t room = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    room = leftByOthers(e);
  }
  room = std::min(room, b.capacityBytes(e.device));
  return room != 0 && b.reservedBytes(e.device) + size > room;
}

// Requests of at least this share of the limit, and of at least
// kPlaceAheadMinBytes, are placed ahead (placeAhead).
constexpr size_t kPlaceAheadShare = 64;
constexpr size_t kPlaceAheadMinBytes = 16 * kMiB;

// After the limit's reclaim, before a large request on a device the
// allocator cannot grow on (what it maps plus the request passes the device
// left by others, or its cap): when no free run of its segments holds the
// request, the allocator would return its whole cache to the device,
// synchronizing with every stream, and map the request anew, page by page,
// the device idle meanwhile (GPT at 1.5x the device on an H100: 268 ms of a
// 972 ms iteration, the host in the allocations of the loss, 3.3 allocator
// retries an iteration). Vacating the cheapest run the request fits in costs
// no synchronization: dropped storages and page-outs hand their memory to the
// request's stream in the device's order. Only where the run moves at most
// half the request, storages to be dropped counting kDropCostShare less, plus
// what is still over `limit` (the limit in force). Returns the bytes freed.
size_t placeAhead(
    DeviceEngine& e,
    size_t size,
    cudaStream_t stream,
    size_t limit) {
  if (size < kPlaceAheadMinBytes || size < limit / kPlaceAheadShare ||
      !cannotMapAnew(e, size)) {
    return 0;
  }
  DeviceMemoryBackend& b = backend();
  const size_t wanted = b.allocatedBytes(e.device) + size;
  const size_t over = wanted > limit ? wanted - limit : 0;
  return reclaimFragments(e, size, stream, over + size / 2);
}

} // namespace

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
  // Read once for both: each read samples the device and takes the lock.
  const size_t limit = effectiveLimit(e);
  bool reclaimed = enforceLimit(e, size, limit) > 0;
  reclaimed = placeAhead(e, size, stream, limit) > 0 || reclaimed;
  const size_t reserved_before = b.reservedBytes(e.device);
  void* ptr = nullptr;
  t_reclaimed_in_malloc = false;
  if (C10_UNLIKELY(!t_outside_note.empty())) {
    t_outside_note.clear(); // said about an earlier allocation
  }
  int outside_rounds = 0;
  DeviceWait wait;
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
        // Then other LMS processes of the GPU that hold what it lacks, unless
        // the request has somewhere else to go (`or_null`: host placement, an
        // input kept in its host copy), which keeps the process going.
        if (!or_null && waitForDevice(e, size, wait)) {
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
  endDeviceWait(e, wait);
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
  DeviceEngine& e = engineFor(device);
  return enforceLimit(e, incoming_bytes, effectiveLimit(e));
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

bool reclaimBeforeMapping(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream) {
  if (!isEnabled() || t_no_reclaim || g_backend.load() == nullptr) {
    return false;
  }
  DeviceEngine& e = engineFor(device);
  if (isCapturing(stream) || !cannotMapAnew(e, size)) {
    return false; // nothing may move, or the allocator maps it anew
  }
  // Placed as placeAhead places a large request, with no bound on the cost:
  // the alternative is the cache's release.
  const bool freed =
      reclaimFragments(e, size, stream, std::numeric_limits<size_t>::max()) > 0;
  t_reclaimed_in_malloc = t_reclaimed_in_malloc || freed;
  return freed;
}

} // namespace c10::cuda::lms
