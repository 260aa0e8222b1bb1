// Reclaim: victims, least recently used first or as the learned schedule
// picks them (pickVictim); the page-out copy to pinned host memory and the
// hand-back of the device memory with GPU-side ordering; paging out the
// storages that hold a range a failed request fits in (reclaimFragments);
// and the schedule's early page-outs, whose device memory is released once
// their copies are done (draining).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <limits>
#include <unordered_map>
#include <vector>

namespace c10::cuda::lms {

namespace detail {

namespace {

void enqueuePageOut(
    DeviceEngine& e,
    Record& r,
    const HostBuffer& host,
    StorageRef& keep_alive,
    bool hand_back);
bool pageOutToDiskNow(DeviceEngine& e, Record& r, StorageRef& keep_alive);

// A paged-out storage must not keep pointing at memory the allocator may
// already have handed to someone else. It points at its pinned host copy
// instead, which unified addressing maps into every device's address space:
// code that reads the address without going through LMS (no StorageImpl hook
// in a stock build, or an operator whose inputs could not all be made
// resident) reads and writes the real contents over the bus and never faults.
// The storage reference comes back in `keep_alive`: if it is the last one,
// the storage must die only after the record is no longer busy.
void pointAtHostCopy(Record& r, void* host_ptr, StorageRef& keep_alive) {
  keep_alive = r.owner.lock();
  if (!keep_alive) {
    return; // dying: its deleter is waiting for this page-out to finish
  }
  c10::StorageImpl* storage = keep_alive.get();
  c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  if (dp.get_context() != &r || dp.get_deleter() != &deleteRecord) {
    return; // the DataPtr has moved to another storage
  }
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(host_ptr, ctx, &deleteRecord, device);
}

// Copies a victim's contents to pinned host memory and returns its device
// memory to the allocator. The victim is busy and on no list; the engine lock
// is not held. Returns false when no pinned host memory could be had.
//
// Without `hand_back` (an early page-out of the learned schedule) the device
// memory stays with the record, which goes on draining: it is released once
// the copy is done, so no compute stream waits for the copy (drainPageOuts).
bool pageOut(
    DeviceEngine& e,
    Record& r,
    StorageRef& keep_alive,
    bool hand_back = true) {
  if (dropInstead(e, r, keep_alive)) {
    return true;
  }
  DeviceScope guard(e.device);
  // With the disk tier on, the coldest host copies go to disk to make room
  // (allocateHost); an early page-out, which only gets ahead, may then wait
  // for other processes as before, while a page-out that an allocation needs
  // goes to disk itself rather than wait.
  const bool spill = spillEnabled();
  HostBuffer host = spill ? allocateHost(e, r.size, /*wait=*/!hand_back)
                          : hostPool().allocate(r.size);
  if (host.ptr == nullptr && spill && hand_back) {
    if (pageOutToDiskNow(e, r, keep_alive)) {
      return true;
    }
    host = hostPool().allocate(r.size); // the host tier's wait and error
  }
  if (host.ptr == nullptr) {
    return false;
  }
  try {
    enqueuePageOut(e, r, host, keep_alive, hand_back);
  } catch (...) {
    // Nothing was freed: the storage stays resident. Let any copy that did
    // start finish before the buffer can be handed out again.
    (void)cudaStreamSynchronize(e.copyStream());
    (void)cudaGetLastError();
    hostPool().release(host, nullptr, e.device);
    throw;
  }
  return true;
}

// Orders the copy stream `copy` after all work already queued on every
// stream that used the memory of `r`. One event serves all waits:
// cudaStreamWaitEvent captures the event's state at the time of the call.
void orderAfterUsers(DeviceEngine& e, Record& r, cudaStream_t copy) {
  cudaEvent_t used = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(used, r.stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(copy, used, 0));
  for (cudaStream_t s : r.users) {
    C10_CUDA_CHECK(cudaEventRecord(used, s));
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, used, 0));
  }
  e.events.put(used);
  if (r.device_ready != nullptr) { // a prefetch copy may still be writing
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, r.device_ready, 0));
  }
}

// Pages a victim out straight to the disk tier when no pinned host memory
// could be had even after the coldest host copies went there: its contents
// go through the staging buffer, the host waiting for each copy, and its
// device memory is free at once. False, nothing changed, when the disk tier
// refuses it too.
bool pageOutToDiskNow(DeviceEngine& e, Record& r, StorageRef& keep_alive) {
  const cudaStream_t copy = e.copyStream();
  orderAfterUsers(e, r, copy);
  if (!pageOutToDisk(e, r, copy)) {
    return false;
  }
  // The copies are done: the memory may be reused in any stream's order.
  if (r.stream_known) {
    backend().free(r.device_ptr);
  } else {
    backend().freeAfter(r.device_ptr, e.device, copy);
  }
  if (r.device_ready != nullptr) {
    e.events.put(r.device_ready);
    r.device_ready = nullptr;
  }
  pointAtHostCopy(r, nullptr, keep_alive);
  r.device_ptr = nullptr;
  r.host = HostBuffer{};
  r.host_ready = nullptr;
  r.users.clear();
  return true;
}

void enqueuePageOut(
    DeviceEngine& e,
    Record& r,
    const HostBuffer& host,
    StorageRef& keep_alive,
    bool hand_back) {
  const cudaStream_t copy = e.copyStream();
  orderAfterUsers(e, r, copy);
  CopyTimer timer(e, copy);
  C10_CUDA_CHECK(cudaMemcpyAsync(
      host.ptr, r.device_ptr, r.size, cudaMemcpyDeviceToHost, copy));
  timer.done(Timed::CopyOut, r.size);
  cudaEvent_t done = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(done, copy));
  if (!hand_back) {
    // Draining: the memory is released after the copy (drainPageOuts). The
    // timing event lets a forced early release measure the wait it causes.
    r.drain_copied = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(r.drain_copied, copy));
    r.draining = true;
    pointAtHostCopy(r, host.ptr, keep_alive);
    r.host = host;
    r.host_ready = done;
    r.users.clear();
    if (r.device_ready != nullptr) {
      e.events.put(r.device_ready);
      r.device_ready = nullptr;
    }
    return;
  }
  // Hand the memory to the next allocation with GPU-side ordering: work the
  // allocation stream queues from now on waits for the copy; the host never
  // blocks. The timing pair measures how long that stream actually waited.
  if (r.stream_known) {
    cudaEvent_t reached = e.events.get(/*timing=*/true);
    cudaEvent_t copied = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(copied, copy));
    C10_CUDA_CHECK(cudaEventRecord(reached, r.stream));
    C10_CUDA_CHECK(cudaStreamWaitEvent(r.stream, done, 0));
    addStall(e, reached, copied);
    backend().free(r.device_ptr);
  } else {
    // The pool the memory returns to is unknown: let the allocator hold it
    // back until the copy is done.
    backend().freeAfter(r.device_ptr, e.device, copy);
  }
  if (r.device_ready != nullptr) {
    e.events.put(r.device_ready);
    r.device_ready = nullptr;
  }
  pointAtHostCopy(r, host.ptr, keep_alive);
  r.device_ptr = nullptr;
  r.host = host;
  r.host_ready = done;
  r.users.clear();
}

// A victim whose page-out copy is queued (or done) becomes paged out, on
// `list` (paged out, or draining for an early page-out). Engine lock held.
void markPagedOut(DeviceEngine& e, Record& r, List& list) {
  if (r.dropped) {
    r.dropped = false;
    r.state = State::Dropped;
    clearPrefetched(e, r);
    e.dropped_list.push_back(&r);
    // Filed by its next use too: the schedule pages its recipe's inputs in
    // ahead of the recompute (prefetchUpcoming).
    addUpcoming(e, r);
    ++e.stats.drop_count;
    e.stats.drop_bytes += static_cast<int64_t>(r.size);
    add(e.stats.inactive_bytes, -static_cast<int64_t>(r.size));
    add(e.stats.dropped_bytes, static_cast<int64_t>(r.size));
    return;
  }
  r.state = State::PagedOut;
  clearPrefetched(e, r);
  list.push_back(&r);
  addUpcoming(e, r);
  ++e.stats.pageout_count;
  e.stats.pageout_bytes += static_cast<int64_t>(r.size);
  add(e.stats.inactive_bytes, -static_cast<int64_t>(r.size));
  add(e.stats.pagedout_bytes, static_cast<int64_t>(r.size));
}

// Pages out a victim of a reclaim, busy and off every list; the engine lock
// is not held. Returns false, the victim back on the reclaim list, when no
// pinned host memory could be had: the caller's allocation decides whether
// that is an error. `keep_alive` must outlive the call (see pageOut).
bool pageOutVictim(DeviceEngine& e, Record& victim, StorageRef& keep_alive) {
  bool ok = false;
  try {
    ok = pageOut(e, victim, keep_alive);
  } catch (...) {
    std::lock_guard<std::mutex> lock(e.mutex);
    victim.busy = false;
    e.reclaim_list.push_back(&victim);
    e.settled.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  victim.busy = false;
  if (!ok) {
    t_host_refused = true;
    e.reclaim_list.push_back(&victim);
    e.settled.notify_all();
    return false;
  }
  markPagedOut(e, victim, e.pagedout_list);
  e.settled.notify_all();
  return true;
}

void countReclaim(DeviceEngine& e, Trigger trigger) {
  switch (trigger) {
    case Trigger::Limit:
      ++e.stats.reclaim_limit;
      break;
    case Trigger::Speculative:
      ++e.stats.reclaim_speculative;
      break;
    case Trigger::AllocFailure:
      ++e.stats.reclaim_alloc_failure;
      break;
    case Trigger::Explicit:
      ++e.stats.reclaim_explicit;
      break;
    case Trigger::Pack: // counted as a pack (packWorkingSet)
      break;
  }
}

// Releases the device memory of a draining storage, busy and off every list.
// `done`: its copy has completed. Otherwise the storage's stream waits for
// the copy first (GPU-side, like a reclaim's hand-back), and the wait counts
// as stall time.
void releaseDrained(DeviceEngine& e, Record& r, bool done) {
  DeviceScope guard(e.device);
  if (!r.stream_known) {
    // The pool the memory returns to is unknown: the allocator holds it
    // back until the copy is done.
    backend().freeAfter(r.device_ptr, e.device, e.copyStream());
  } else {
    if (!done) {
      cudaEvent_t reached = e.events.get(/*timing=*/true);
      C10_CUDA_CHECK(cudaEventRecord(reached, r.stream));
      C10_CUDA_CHECK(cudaStreamWaitEvent(r.stream, r.host_ready, 0));
      addStall(e, reached, r.drain_copied);
      r.drain_copied = nullptr;
    }
    backend().free(r.device_ptr);
  }
  if (r.drain_copied != nullptr) {
    e.events.put(r.drain_copied);
    r.drain_copied = nullptr;
  }
}

} // namespace

// Gives a record's device memory back to the allocator, to be reused only
// after the work queued so far on every stream that used it and after a
// page-in copy that may still be writing it. In a deleter (`in_deleter`) a
// CUDA error is a warning; elsewhere it throws.
void releaseDeviceMemory(DeviceEngine& e, Record& r, bool in_deleter) {
  const auto check = [in_deleter](cudaError_t err) {
    if (in_deleter) {
      C10_CUDA_CHECK_WARN(err);
    } else {
      C10_CUDA_CHECK(err);
    }
  };
  if (r.device_ready != nullptr) {
    check(cudaStreamWaitEvent(r.stream, r.device_ready, 0));
    e.events.put(r.device_ready);
    r.device_ready = nullptr;
  }
  if (r.device_ptr != nullptr) {
    // Reuse is ordered on the allocation stream, which the allocator knows
    // even for adopted storages. Other streams that used the memory since
    // LMS last moved it are unknown to the allocator: order after them too.
    if (!r.users.empty()) {
      cudaEvent_t used = e.events.get(/*timing=*/false);
      for (cudaStream_t s : r.users) {
        check(cudaEventRecord(used, s));
        check(cudaStreamWaitEvent(r.stream, used, 0));
      }
      e.events.put(used);
    }
    backend().free(r.device_ptr);
    r.device_ptr = nullptr;
  }
  r.users.clear();
}

// The last reclaim on this thread stopped because the host pool gave no
// pinned memory (HostPool::lastRefusal() says why): an out-of-memory error
// that follows names host memory, the tier that ran out.
thread_local bool t_host_refused = false;

// Pages out inactive storages until `bytes` are freed or none is left: the
// one used furthest in the future while a learned schedule is active, else
// the least recently used. With recompute on, storages whose replay is cheap
// are dropped first, best ranked first (cheapDrops). Returns the bytes freed.
size_t reclaim(DeviceEngine& e, size_t bytes, Trigger trigger) {
  t_host_refused = false;
  if (bytes > 0) {
    noteNearLimit();
  }
  // Storages paged out early are on their way already: releasing their
  // memory costs at most the rest of a copy that is under way, where a new
  // victim's copy would queue behind them.
  size_t freed = drainPageOuts(e, bytes);
  bool counted = false;
  const size_t threshold = g_size_threshold.load();
  // Rounds of cheap drops, each priced afresh, until the bytes are freed or a
  // round takes nothing: one round prices only kPricedCandidates storages.
  size_t round = 1;
  while (freed < bytes && round > 0 && g_recompute.load()) {
    round = 0;
    // Destroyed after every victim is no longer busy.
    const std::vector<DropCandidate> drops = cheapDrops(e, threshold);
    for (const DropCandidate& c : drops) {
      if (freed >= bytes) {
        break;
      }
      {
        std::lock_guard<std::mutex> lock(e.mutex);
        // Taken meanwhile, or no longer its storage's allocation.
        if (recordOf(*c.storage) != c.r || c.r->busy ||
            c.r->list != &e.reclaim_list) {
          continue;
        }
        e.reclaim_list.remove(c.r);
        c.r->busy = true;
        if (!counted) {
          counted = true;
          countReclaim(e, trigger);
        }
      }
      StorageRef keep_alive;
      // Dropped, or paged out when its price has changed since it was
      // ranked (dropInstead decides again).
      if (!pageOutVictim(e, *c.r, keep_alive)) {
        return freed;
      }
      freed += c.r->size;
      round += c.r->size;
    }
  }
  while (freed < bytes) {
    // Destroyed last in each round, after the victim is no longer busy.
    StorageRef keep_alive;
    Record* victim = nullptr;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      victim = pickVictim(e, threshold, /*protect_until=*/0);
      if (victim == nullptr) {
        break;
      }
      e.reclaim_list.remove(victim);
      victim->busy = true;
      if (!counted) {
        counted = true;
        countReclaim(e, trigger);
      }
    }
    if (!pageOutVictim(e, *victim, keep_alive)) {
      break;
    }
    freed += victim->size;
  }
  return freed;
}

// The reclaimable storages that are resident and not being moved, by device
// address. Call with e.mutex held.
std::unordered_map<uintptr_t, Record*> residentReclaimable(DeviceEngine& e) {
  std::unordered_map<uintptr_t, Record*> held;
  for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
    if (!r->busy && r->device_ptr != nullptr) {
      held.emplace(reinterpret_cast<uintptr_t>(r->device_ptr), r);
    }
  }
  return held;
}

// After an allocation of `size` bytes on `stream` failed: pages out the
// storages that hold the cheapest contiguous run of blocks, in one range the
// allocator has mapped, whose blocks are free or held by reclaimable storages
// and together hold `size` bytes. Once they are out, the allocator has a free
// range for the request. Victims picked by their next use free memory
// wherever they lie, scattered over segments that tensors still in use keep
// mapped; the allocator then returns its cache to the device and tries again,
// and so on until everything reclaimable is out. Returns the bytes freed, 0
// when no such run exists (or the allocator cannot tell).
//
// With `max_cost` set, before the allocation (placeAhead): 0, nothing
// moved, when a free run already holds the request or the cheapest run costs
// more than `max_cost`. The cost then counts a storage whose replay was
// priced below its paging (it is dropped, not copied) at 1/kDropCostShare of
// its bytes.
size_t reclaimFragments(
    DeviceEngine& e,
    size_t size,
    cudaStream_t stream,
    std::optional<size_t> max_cost) {
  if (size <= kMiB) {
    return 0; // the small pool: its 2 MiB segments do not fragment this way
  }
  const bool ahead = max_cost.has_value();
  // Read once: a window's cost is added and taken off block by block, and
  // must take off what it added (the fields below change under e.mutex only).
  const double paging_per_byte = ahead && g_recompute.load()
      ? pagingCost(e, kMiB) / static_cast<double>(kMiB)
      : -1.0;
  // What moving `r` out costs, in bytes.
  const auto costOf = [&](const Record* r) -> size_t {
    const bool dropped = paging_per_byte > 0.0 && r->recomputable &&
        r->stream_known && r->replay_ms >= 0.0 &&
        r->replay_ms < paging_per_byte * static_cast<double>(r->size);
    return dropped ? r->size / kDropCostShare : r->size;
  };
  const std::vector<SegmentMap> maps = backend().segments(e.device, stream);
  if (maps.empty()) {
    return 0;
  }
  std::vector<Record*> victims;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    const std::unordered_map<uintptr_t, Record*> held = residentReclaimable(e);
    if (held.empty()) {
      return 0;
    }
    // Per range, a window [lo, hi] of blocks, none held by anything that
    // stays, shrunk from the left while it still holds `size` bytes.
    const SegmentMap* best_map = nullptr;
    size_t best_lo = 0;
    size_t best_hi = 0;
    size_t best_cost = SIZE_MAX;
    for (const SegmentMap& map : maps) {
      const size_t n = map.blocks.size();
      std::vector<Record*> owner(n, nullptr);
      uintptr_t address = map.base;
      for (size_t i = 0; i < n; ++i) {
        if (map.blocks[i].second) {
          const auto it = held.find(address);
          owner[i] = it != held.end() ? it->second : nullptr;
        }
        address += map.blocks[i].first;
      }
      size_t lo = 0;
      size_t bytes = 0;
      size_t cost = 0;
      for (size_t hi = 0; hi < n; ++hi) {
        const auto [block, allocated] = map.blocks[hi];
        if (allocated && owner[hi] == nullptr) {
          lo = hi + 1; // a block that stays splits the range
          bytes = 0;
          cost = 0;
          continue;
        }
        bytes += block;
        cost += allocated ? costOf(owner[hi]) : 0;
        while (lo < hi && bytes - map.blocks[lo].first >= size) {
          bytes -= map.blocks[lo].first;
          cost -= map.blocks[lo].second ? costOf(owner[lo]) : 0;
          ++lo;
        }
        if (bytes >= size && cost == 0 && ahead) {
          return 0; // the allocator has a free run for it
        }
        if (bytes >= size && cost > 0 && cost < best_cost) {
          best_map = &map;
          best_lo = lo;
          best_hi = hi;
          best_cost = cost;
        }
      }
    }
    if (best_map == nullptr || (ahead && best_cost > *max_cost)) {
      return 0;
    }
    uintptr_t address = best_map->base;
    for (size_t i = 0; i <= best_hi; ++i) {
      if (i >= best_lo && best_map->blocks[i].second) {
        Record* r = held.at(address);
        e.reclaim_list.remove(r);
        r->busy = true;
        victims.push_back(r);
      }
      address += best_map->blocks[i].first;
    }
    countReclaim(e, ahead ? Trigger::Limit : Trigger::AllocFailure);
  }
  // The victims after the i-th go back, resident, when it cannot go out.
  auto put_back_after = [&](size_t i) {
    std::lock_guard<std::mutex> lock(e.mutex);
    for (size_t j = i + 1; j < victims.size(); ++j) {
      victims[j]->busy = false;
      e.reclaim_list.push_back(victims[j]);
    }
    e.settled.notify_all();
  };
  size_t freed = 0;
  for (size_t i = 0; i < victims.size(); ++i) {
    StorageRef keep_alive;
    bool ok = false;
    try {
      ok = pageOutVictim(e, *victims[i], keep_alive);
    } catch (...) {
      put_back_after(i);
      throw;
    }
    if (!ok) {
      put_back_after(i);
      break;
    }
    freed += victims[i]->size;
  }
  if (freed > 0) {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++(ahead ? e.stats.fragment_placements : e.stats.fragment_reclaims);
  }
  return freed;
}

// Releases the memory of storages paged out early: every one whose copy is
// done, then, in page-out order, ones still copying until `bytes` are freed.
// Returns the bytes freed.
size_t drainPageOuts(DeviceEngine& e, size_t bytes) {
  size_t freed = 0;
  while (true) {
    Record* r = nullptr;
    bool done = false;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      r = e.draining_list.head;
      if (r == nullptr) {
        break;
      }
      const cudaError_t err = cudaEventQuery(r->host_ready);
      if (err == cudaErrorNotReady) {
        (void)cudaGetLastError(); // not an error: clear the sticky state
      } else {
        C10_CUDA_CHECK(err);
      }
      done = err == cudaSuccess;
      // Copies complete in the order of the one D2H stream: once one is
      // not done, the later ones are not either.
      if (!done && freed >= bytes) {
        break;
      }
      e.draining_list.remove(r);
      r->busy = true;
    }
    try {
      releaseDrained(e, *r, done);
    } catch (...) {
      std::lock_guard<std::mutex> lock(e.mutex);
      r->busy = false;
      e.draining_list.push_back(r);
      e.settled.notify_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(e.mutex);
    r->busy = false;
    r->draining = false;
    r->device_ptr = nullptr;
    e.draining_bytes -= r->size;
    e.pagedout_list.push_back(r);
    e.settled.notify_all();
    freed += r->size;
  }
  return freed;
}

// A draining storage is needed again while its device memory is still held:
// it becomes resident (inactive) with no copy back. Whoever uses the memory
// next waits for the page-out copy, which may still be reading it. Engine
// lock held; the record is not busy.
void rescueDrained(DeviceEngine& e, Record& r) {
  e.draining_list.remove(&r);
  removeUpcoming(e, r);
  e.draining_bytes -= r.size;
  r.draining = false;
  DeviceScope guard(e.device);
  // The host buffer may be reused after the copy; device_ready orders the
  // next user of the device memory after it too.
  cudaEvent_t read = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(read, e.copy_stream));
  hostPool().release(r.host, read, e.device);
  r.host = HostBuffer{};
  r.device_ready = r.host_ready;
  r.host_ready = nullptr;
  if (r.drain_copied != nullptr) {
    e.events.put(r.drain_copied);
    r.drain_copied = nullptr;
  }
  // A later page-out or free is ordered after the copy stream's work.
  addUser(r, e.copy_stream);
  leave(e, r);
  enter(e, r, State::Inactive);
  e.reclaim_list.push_back(&r);
  ++e.stats.schedule_rescues;
}

// Pages out early, on the D2H stream and without a hand-back, victims that
// `pick` chooses (called with the engine lock held; nullptr when none is
// left) until `wanted` bytes are on their way out. Returns the page-outs made
// and adds their bytes to `bytes`.
int64_t pageOutVictims(
    DeviceEngine& e,
    size_t wanted,
    c10::function_ref<Record*()> pick,
    size_t& bytes) {
  size_t freed = 0;
  int64_t count = 0;
  while (freed < wanted) {
    StorageRef keep_alive; // destroyed after the victim is no longer busy
    Record* victim = nullptr;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      victim = pick();
      if (victim == nullptr) {
        break;
      }
      e.reclaim_list.remove(victim);
      victim->busy = true;
    }
    bool ok = false;
    try {
      ok = pageOut(e, *victim, keep_alive, /*hand_back=*/false);
    } catch (...) {
      std::lock_guard<std::mutex> lock(e.mutex);
      victim->busy = false;
      e.reclaim_list.push_back(victim);
      e.settled.notify_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(e.mutex);
    victim->busy = false;
    if (!ok) {
      e.reclaim_list.push_back(victim);
      e.settled.notify_all();
      break;
    }
    if (!victim->dropped) {
      e.draining_bytes += victim->size;
      ++e.stats.early_pageout_count;
      e.stats.early_pageout_bytes += static_cast<int64_t>(victim->size);
    }
    markPagedOut(e, *victim, e.draining_list);
    e.settled.notify_all();
    freed += victim->size;
    ++count;
  }
  bytes += freed;
  return count;
}

// Pages out early victims that `pick` chooses until `room` bytes are free
// under `limit`, with `allocated` bytes allocated on the device (the caller
// reads it once per operator boundary: the drop-in's allocator copies its
// statistics under its lock to say), counting memory that draining page-outs
// are about to release. Returns the page-outs made.
int64_t pageOutEarlyFor(
    DeviceEngine& e,
    size_t allocated,
    size_t limit,
    size_t room,
    c10::function_ref<Record*()> pick) {
  const size_t wanted = earlyPageOutNeed(e, allocated, limit, room);
  if (wanted == 0) {
    return 0;
  }
  size_t bytes = 0;
  return pageOutVictims(e, wanted, pick, bytes);
}

// The bytes pageOutEarlyFor() would page out to keep `room` bytes free under
// `limit` (0: none). The engine lock is not held.
size_t earlyPageOutNeed(
    DeviceEngine& e,
    size_t allocated,
    size_t limit,
    size_t room) {
  if (limit <= room) {
    return 0;
  }
  size_t pending = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    pending = e.draining_bytes;
  }
  const size_t expected = allocated > pending ? allocated - pending : 0;
  return expected > limit - room ? expected - (limit - room) : 0;
}

} // namespace detail

using namespace detail;

size_t reclaimInactive(c10::DeviceIndex device) {
  return reclaim(
      engineFor(device), std::numeric_limits<size_t>::max(), Trigger::Explicit);
}

size_t reclaimBytes(c10::DeviceIndex device, size_t bytes) {
  if (!isEnabled() || g_backend.load() == nullptr || bytes == 0) {
    return 0;
  }
  return reclaim(engineFor(device), bytes, Trigger::Limit);
}

} // namespace c10::cuda::lms
