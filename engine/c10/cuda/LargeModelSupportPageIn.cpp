// Bringing storages back to the device: on demand, when an operator pins one
// or code reads it raw (makeResident); and ahead of use, within the limit and
// without reclaiming anything: storages paged out just before a pinned one
// (the prefetch depth), the learned schedule's upcoming uses (and the inputs
// of dropped storages' recipes), and the page-ins a compiled graph plans
// (pageInAhead).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <exception>
#include <vector>

namespace c10::cuda::lms {

namespace detail {

// Set while this thread allocates for a page-in ahead of use, which takes only
// memory that is free: were the allocator's failure path to reclaim for it,
// the storages it pages out could be the ones just paged in ahead, and the
// schedule would page them back in, out again, and so on without end.
thread_local bool t_no_reclaim = false;

namespace {

// Keeps the allocator's failure path from reclaiming on this thread for a
// scope (see t_no_reclaim).
class NoReclaimScope {
 public:
  NoReclaimScope() : previous_(t_no_reclaim) {
    t_no_reclaim = true;
  }
  ~NoReclaimScope() {
    t_no_reclaim = previous_;
  }
  NoReclaimScope(const NoReclaimScope&) = delete;
  NoReclaimScope& operator=(const NoReclaimScope&) = delete;

 private:
  const bool previous_;
};

// After the host-to-device copy of `r` into `ptr` was queued on `copied_on`:
// the host buffer goes back to the pool once the copy has read it, and the
// record points at its new memory, which belongs to `alloc_stream`'s pool and
// holds the contents once `device_ready` is reached.
void finishPageIn(
    DeviceEngine& e,
    Record& r,
    void* ptr,
    cudaStream_t alloc_stream,
    cudaStream_t copied_on) {
  if (r.host.ptr != nullptr) { // none when it came from the disk tier
    cudaEvent_t read = e.events.get(/*timing=*/false);
    C10_CUDA_CHECK(cudaEventRecord(read, copied_on));
    hostPool().release(r.host, read, e.device);
  }
  cudaEvent_t ready = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(ready, copied_on));
  if (r.host_ready != nullptr) {
    e.events.put(r.host_ready);
    r.host_ready = nullptr;
  }
  r.host = HostBuffer{};
  r.device_ptr = ptr;
  r.device_ready = ready;
  r.stream = alloc_stream;
  r.stream_known = true;
}

// Whether `size` bytes more cannot be had on the device even with every
// reclaimable storage paged out, by bytes alone: what cannot be paged out
// (pinned, allocated by running operators, unmanaged) and the request pass
// what the allocator may hold (its cap, or the device memory that others
// leave). A page-in that may stay on the host then pages nothing out to find
// that out. The engine lock is not held.
bool beyondTheDevice(DeviceEngine& e, size_t size) {
  DeviceMemoryBackend& b = backend();
  const size_t capacity = b.capacityBytes(e.device);
  if (capacity == SIZE_MAX) {
    (void)limitOf(e); // reads the device memory others hold, if stale
  }
  const size_t allocated = b.allocatedBytes(e.device);
  std::lock_guard<std::mutex> lock(e.mutex);
  const size_t room = capacity != SIZE_MAX ? capacity : leftByOthers(e);
  const size_t movable = e.draining_bytes +
      static_cast<size_t>(std::max<int64_t>(e.stats.inactive_bytes.current, 0));
  const size_t fixed = allocated > movable ? allocated - movable : 0;
  return fixed + size > room;
}

// Brings a busy, paged-out record back to the device on `stream`. The engine
// lock is not held. With `or_host`, returns false, nothing changed, when the
// device cannot hold it even with every reclaimable storage paged out (the
// caller keeps it in its host copy); otherwise that raises the out-of-memory
// error.
bool pageIn(DeviceEngine& e, Record& r, cudaStream_t stream, bool or_host) {
  // Kept in its host copy (the caller's keepInputOnHost): a copy spilled to
  // disk comes back to pinned memory first.
  const auto on_host = [&] {
    if (!r.spill_path.empty()) {
      restoreHostCopy(e, r);
    }
    return false;
  };
  if (or_host && beyondTheDevice(e, r.size)) {
    return on_host();
  }
  DeviceScope guard(e.device);
  void* ptr = allocateDevice(e, r.size, stream, /*or_null=*/or_host);
  if (ptr == nullptr) {
    return on_host();
  }
  try {
    cudaEvent_t start = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(start, stream));
    if (!r.spill_path.empty()) {
      readSpilled(e, r, ptr, stream);
    } else {
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream, r.host_ready, 0));
      CopyTimer timer(e, stream);
      C10_CUDA_CHECK(cudaMemcpyAsync(
          ptr, r.host.ptr, r.size, cudaMemcpyHostToDevice, stream));
      timer.done(Timed::CopyIn, r.size);
    }
    cudaEvent_t end = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(end, stream));
    addStall(e, start, end);
    finishPageIn(e, r, ptr, stream, stream);
  } catch (...) {
    // The storage stays paged out (its host copy is intact): give the memory
    // back, in the order of the stream the failed copy was queued on.
    backend().free(ptr);
    throw;
  }
  return true;
}

// Starts paging in `r` on the copy stream, into memory allocated on `stream`,
// without reclaiming anything. Returns false when the limit leaves no room.
bool prefetchOne(DeviceEngine& e, Record& r, cudaStream_t stream) {
  DeviceMemoryBackend& b = backend();
  const size_t allocated = b.allocatedBytes(e.device);
  if (allocated + r.size > effectiveLimit(e)) {
    return false;
  }
  // Only memory the allocator can likely give without failing: at least the
  // request free in its cache, or room for a new segment. A failed allocation
  // is not cheap: before it fails, the allocator returns its whole cache to
  // the device, a device synchronization. (A fragmented cache can still fail
  // it; then nothing is reclaimed for it, see NoReclaimScope.)
  const size_t reserved = b.reservedBytes(e.device);
  const size_t capacity = b.capacityBytes(e.device);
  size_t room = capacity;
  if (capacity == SIZE_MAX) {
    std::lock_guard<std::mutex> lock(e.mutex);
    room = shareOf(e);
  }
  const bool cached = reserved >= allocated + r.size;
  const bool segment = reserved + r.size <= room;
  if (!cached && !segment) {
    return false;
  }
  DeviceScope guard(e.device);
  void* ptr = nullptr;
  try {
    const NoReclaimScope no_reclaim;
    ptr = b.malloc(e.device, r.size, stream);
  } catch (const c10::OutOfMemoryError&) {
    return false;
  }
  // Not the page-out stream: page-ins ahead of use overlap with page-outs.
  const cudaStream_t copy = e.h2dStream();
  try {
    // The memory belongs to `stream`'s pool: the copy may start only after
    // the work `stream` has queued so far (which may still use the memory's
    // previous owner).
    cudaEvent_t ev = e.events.get(/*timing=*/false);
    C10_CUDA_CHECK(cudaEventRecord(ev, stream));
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, ev, 0));
    e.events.put(ev);
    if (!r.spill_path.empty()) {
      // From the disk tier: the host reads the file as the copies go.
      readSpilled(e, r, ptr, copy);
    } else {
      C10_CUDA_CHECK(cudaStreamWaitEvent(copy, r.host_ready, 0));
      CopyTimer timer(e, copy);
      C10_CUDA_CHECK(cudaMemcpyAsync(
          ptr, r.host.ptr, r.size, cudaMemcpyHostToDevice, copy));
      timer.done(Timed::CopyIn, r.size);
    }
    finishPageIn(e, r, ptr, stream, copy);
  } catch (...) {
    // Reuse in `stream`'s order must also wait for the copy stream, which
    // may have started the copy.
    backend().freeAfter(ptr, e.device, copy);
    throw;
  }
  addUser(r, copy);
  return true;
}

// A storage whose page-in ahead of use is queued becomes inactive and
// reclaimable, counted as prefetched until an operator uses it. Engine lock
// held.
void markPrefetched(DeviceEngine& e, Record& r) {
  r.state = State::Inactive;
  r.prefetched = true;
  e.prefetched_bytes += r.size;
  e.reclaim_list.push_back(&r);
  ++e.stats.prefetch_count;
  ++e.stats.pagein_count;
  e.stats.pagein_bytes += static_cast<int64_t>(r.size);
  add(e.stats.pagedout_bytes, -static_cast<int64_t>(r.size));
  add(e.stats.inactive_bytes, static_cast<int64_t>(r.size));
}

// Prefetches up to the prefetch depth of storages paged out just before
// `anchor` was (a backward pass needs activations in reverse order).
void prefetchAfterPin(DeviceEngine& e, std::vector<Record*> candidates) {
  const cudaStream_t stream = currentStream(e.device);
  for (Record* r : candidates) {
    bool ok = false;
    try {
      ok = prefetchOne(e, *r, stream);
    } catch (...) {
      std::lock_guard<std::mutex> lock(e.mutex);
      for (Record* rest : candidates) {
        if (rest->busy) {
          rest->busy = false;
          e.pagedout_list.push_back(rest);
        }
      }
      e.settled.notify_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(e.mutex);
    r->busy = false;
    if (ok) {
      markPrefetched(e, *r);
    } else {
      e.pagedout_list.push_back(r);
    }
    e.settled.notify_all();
    if (!ok) {
      // No headroom left: put the rest back untouched.
      for (Record* rest : candidates) {
        if (rest->busy) {
          rest->busy = false;
          e.pagedout_list.push_back(rest);
        }
      }
      e.settled.notify_all();
      return;
    }
  }
}

// Takes a paged-out record off its lists for a page-in ahead of use and
// returns true; a draining one is rescued instead (its memory is still
// there: no copy back), counted as prefetched, and false returned. Engine
// lock held; the record is not busy.
bool takeForPrefetch(DeviceEngine& e, Record& r) {
  if (r.draining) {
    rescueDrained(e, r);
    r.prefetched = true;
    e.prefetched_bytes += r.size;
    return false;
  }
  e.pagedout_list.remove(&r);
  removeUpcoming(e, r);
  r.busy = true;
  return true;
}

// Pages in ahead of use, on the H2D stream, a record takeForPrefetch() took,
// and counts it in `count` (and its bytes in `bytes`, if given). When the
// limit leaves no room, or the copy cannot be queued, the record goes back
// among the paged-out storages. The engine lock is not held.
bool prefetchTaken(
    DeviceEngine& e,
    Record& r,
    cudaStream_t stream,
    int64_t LmsStats::*count,
    int64_t LmsStats::*bytes = nullptr) {
  bool ok = false;
  try {
    ok = prefetchOne(e, r, stream);
  } catch (...) {
    std::lock_guard<std::mutex> lock(e.mutex);
    r.busy = false;
    e.pagedout_list.push_back(&r);
    addUpcoming(e, r);
    e.settled.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  r.busy = false;
  if (ok) {
    ++(e.stats.*count);
    if (bytes != nullptr) {
      e.stats.*bytes += static_cast<int64_t>(r.size);
    }
    markPrefetched(e, r);
  } else {
    e.pagedout_list.push_back(&r);
    addUpcoming(e, r);
  }
  e.settled.notify_all();
  return ok;
}

// Pages in, on the H2D stream, the paged-out inputs of the recipe of dropped
// `storage`, whose next use is at operator clock `next`, while the prefetched
// bytes not yet used stay within `budget`: its recompute, on demand, then
// finds them resident instead of paging them in on the compute stream. Every
// input is marked needed by `next`, so that no victim choice takes it away
// before. Returns false when the limit left no room. The engine lock is not
// held.
bool prefetchRecipeInputs(
    DeviceEngine& e,
    c10::StorageImpl& storage,
    uint64_t next,
    cudaStream_t stream,
    size_t budget,
    int depth = 0) {
  // A dropped input is recomputed first, from its own recipe's inputs: those
  // are paged in too, a few levels down (a GELU's output dropped with the
  // linear layer's output it is made from).
  constexpr int kMaxDepth = 4;
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  if (hooks == nullptr || hooks->inputs == nullptr) {
    return true;
  }
  std::vector<StorageRef> inputs; // destroyed after every lock is released
  hooks->inputs(storage, inputs);
  for (const StorageRef& input : inputs) {
    Record* r = recordOf(*input);
    if (r == nullptr || r->engine != &e) {
      continue;
    }
    bool dropped = false;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      const uint64_t needed = r->needed_by.load(std::memory_order_relaxed);
      if (needed == 0 || next < needed) {
        r->needed_by.store(next, std::memory_order_relaxed);
      }
      dropped = r->state == State::Dropped && !r->busy;
      if (dropped || r->busy || r->state != State::PagedOut ||
          e.prefetched_bytes + r->size > budget) {
        r = nullptr;
      } else if (!takeForPrefetch(e, *r)) {
        r = nullptr;
      }
    }
    if (dropped) {
      if (depth < kMaxDepth &&
          !prefetchRecipeInputs(e, *input, next, stream, budget, depth + 1)) {
        return false;
      }
      continue;
    }
    if (r == nullptr) {
      continue;
    }
    if (!prefetchTaken(
            e,
            *r,
            stream,
            &LmsStats::recompute_input_prefetch_count,
            &LmsStats::recompute_input_prefetch_bytes)) {
      return false;
    }
  }
  return true;
}

// Page-ins planned by compiled code (pageInAhead): what it does on one
// device, for the records of `planned` that live there, soonest first.
size_t pageInAheadOn(DeviceEngine& e, const std::vector<Record*>& planned) {
  const cudaStream_t stream = currentStream(e.device);
  if (isCapturing(stream)) {
    // A CUDA graph captures the compiled code that says this: copies cannot
    // be captured, and the graph's inputs are resident for its replays.
    return 0;
  }
  if (g_schedule_enabled.load()) {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    if (theSchedule().active()) {
      // A learned schedule knows the whole iteration (the optimizer and the
      // eager code between compiled regions too) and already pages in ahead
      // what the graph would name: the plan only takes its budget. Measured
      // on a compiled GPT-style decoder (H100): with both, iterations were
      // up to 6% slower than with the schedule alone; before the schedule
      // settles, the plan alone made the first iterations faster
      // (benchmarks/results/compile/2026-11-24-h100-unrecorded/graph-prefetch/).
      return 0;
    }
  }
  // Early page-outs whose copies are done give their memory back first: it
  // is the room the page-ins below need.
  drainPageOuts(e, 0);
  const size_t limit = effectiveLimit(e);
  size_t budget = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    budget = prefetchBudget(limit, e.pagein_last_iteration);
  }
  size_t started = 0;
  size_t index = 0;
  for (; index < planned.size(); ++index) {
    Record* r = planned[index];
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      if (r->engine != &e || r->busy || r->state != State::PagedOut) {
        continue;
      }
      if (e.prefetched_bytes + r->size > budget) {
        return started;
      }
      if (!takeForPrefetch(e, *r)) {
        continue;
      }
    }
    if (!prefetchTaken(
            e,
            *r,
            stream,
            &LmsStats::graph_prefetch_count,
            &LmsStats::graph_prefetch_bytes)) {
      break;
    }
    started += r->size;
  }
  if (index == planned.size()) {
    return started;
  }
  // No room under the limit for the next page-ins of the plan: page out least
  // recently used storages that the plan does not name, so that a later call
  // finds the room.
  size_t wanted = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    size_t ahead = e.prefetched_bytes;
    for (size_t i = index; i < planned.size(); ++i) {
      const Record* r = planned[i];
      if (r->engine != &e || r->state != State::PagedOut || r->draining) {
        continue;
      }
      if (ahead + r->size > budget) {
        break;
      }
      ahead += r->size;
      wanted += r->size;
    }
  }
  const size_t threshold = g_size_threshold.load();
  const size_t allocated = backend().allocatedBytes(e.device);
  const int64_t made =
      pageOutEarlyFor(e, allocated, limit, wanted, [&]() -> Record* {
        for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
          if (r->size >= threshold && !r->prefetched &&
              std::find(planned.begin(), planned.end(), r) == planned.end()) {
            return r;
          }
        }
        return nullptr;
      });
  std::lock_guard<std::mutex> lock(e.mutex);
  e.stats.graph_pageout_count += made;
  return started;
}

} // namespace

// Orders `stream` after the copy that last paged `r` in, which may have run on
// another stream (prefetch, or a page-in for another thread's operator).
// Called with the engine lock held.
void waitUntilResident(DeviceEngine& e, Record& r, cudaStream_t stream) {
  if (r.device_ready == nullptr) {
    return;
  }
  const cudaError_t err = cudaEventQuery(r.device_ready);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); // not an error: clear the sticky state
    // A page-in that has not finished: the stream's wait for it is stall.
    cudaEvent_t reached = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(reached, stream));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, r.device_ready, 0));
    cudaEvent_t waited = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(waited, stream));
    addStall(e, reached, waited);
    return; // other streams may still need it
  }
  C10_CUDA_CHECK(err);
  e.events.put(r.device_ready);
  r.device_ready = nullptr;
}

void clearPrefetched(DeviceEngine& e, Record& r) {
  if (r.prefetched || r.replayed_ahead) {
    r.prefetched = false;
    r.replayed_ahead = false;
    e.prefetched_bytes -= std::min(e.prefetched_bytes, r.size);
  }
}

// Makes `r` resident for use on the current stream and moves it to `target`
// (Active for pin, Allocated for raw access). Called with `lock` held.
// Returns true when the record, pinned for the running operator, stayed in
// its host copy instead (host placement of an input, keepInputOnHost): the
// caller warns once the lock is released.
bool makeResident(
    DeviceEngine& e,
    Record& r,
    c10::StorageImpl& storage,
    State target,
    std::unique_lock<std::mutex>& lock) {
  e.settled.wait(lock, [&] { return !r.busy; });
  const cudaStream_t stream = currentStream(e.device);
  if (r.on_host && r.state == State::Active) {
    // Pinned in host memory by a running operator (an input the device had
    // no room for): that address is good only until the operator ends (then
    // the storage is paged out, and paged in when next used), so a captured
    // graph must not bake it in.
    TORCH_CHECK(
        !isCapturing(stream),
        "LMS: a storage of ",
        std::to_string(r.size),
        " bytes is in pinned host memory for a running operator (host "
        "placement) while CUDA graph capture is underway on the current "
        "stream; a graph cannot keep that address. Give the captured region "
        "room on the device, or capture with LMS disabled "
        "(torch.cuda.set_enabled_lms(False)).");
  }
  std::vector<Record*> prefetch;
  if (target == State::Active) {
    noteUse(r);
  }
  if (r.state == State::Active && target == State::Active) {
    ++r.pins;
    waitUntilResident(e, r, stream);
    return false;
  }
  if (r.state == State::PagedOut && r.draining) {
    // Used again before its early page-out released the memory: the
    // contents are still there, no copy back is needed.
    rescueDrained(e, r);
  }
  bool kept_on_host = false;
  if (r.state == State::Inactive) {
    e.reclaim_list.remove(&r);
    if (r.prefetched) {
      ++e.stats.prefetch_hits;
      if (r.device_ready != nullptr &&
          cudaEventQuery(r.device_ready) == cudaErrorNotReady) {
        (void)cudaGetLastError(); // not an error: clear the sticky state
        ++e.stats.prefetch_late;
      }
      clearPrefetched(e, r);
    } else if (t_recompute_pins == 0) {
      // Recomputed ahead of use, and used now (a replay that reads it is not
      // the use it was recomputed for).
      clearPrefetched(e, r);
    }
  } else if (r.state == State::PagedOut) {
    TORCH_CHECK(
        !isCapturing(stream),
        "LMS: a storage of ",
        std::to_string(r.size),
        " bytes is paged out while CUDA graph capture is underway on the "
        "current stream; a page-in cannot be captured. Run the captured "
        "region once before capturing so its inputs are resident, or "
        "capture with LMS disabled (torch.cuda.set_enabled_lms(False)).");
    // An input of the running operator that the device cannot hold may stay
    // in its host copy for the operator (setHostPlacementEnabled). Raw
    // access outside an operator has no end at which to page it out again.
    const WorkingSet& ws = t_working_set;
    const bool or_host = target == State::Active && g_host_placement.load() &&
        ws.active && ws.device == e.device;
    const int depth = target == State::Active ? g_prefetch_depth.load() : 0;
    for (Record* p = r.prev;
         p != nullptr && static_cast<int>(prefetch.size()) < depth;
         p = p->prev) {
      prefetch.push_back(p);
    }
    e.pagedout_list.remove(&r);
    removeUpcoming(e, r);
    for (Record* p : prefetch) {
      e.pagedout_list.remove(p);
      removeUpcoming(e, *p);
      p->busy = true;
    }
    r.busy = true;
    lock.unlock();
    bool paged_in = false;
    try {
      paged_in = pageIn(e, r, stream, or_host);
    } catch (...) {
      lock.lock();
      r.busy = false;
      e.pagedout_list.push_back(&r);
      for (Record* p : prefetch) {
        p->busy = false;
        e.pagedout_list.push_back(p);
      }
      e.settled.notify_all();
      throw;
    }
    lock.lock();
    r.busy = false;
    if (paged_in) {
      ++e.stats.pagein_count;
      ++e.stats.pagein_demand_count;
      e.stats.pagein_bytes += sz(r);
    } else {
      keepInputOnHost(e, r);
      kept_on_host = true;
      // The device has no room for the storages paged out before it either.
      for (Record* p : prefetch) {
        p->busy = false;
        e.pagedout_list.push_back(p);
        addUpcoming(e, *p);
      }
      prefetch.clear();
    }
    e.settled.notify_all();
  }
  waitUntilResident(e, r, stream);
  rememberOwner(r, storage);
  if (target == State::Allocated && isCapturing(stream)) {
    // Raw access during capture (a kernel launched outside the dispatcher):
    // the graph bakes in this address.
    r.graph_owned = true;
  }
  leave(e, r);
  enter(e, r, target);
  clearFresh(e, r);
  r.pins = target == State::Active ? 1 : 0;
  refreshDataPtr(storage, r);
  arm(storage, false);
  if (!prefetch.empty()) {
    lock.unlock();
    try {
      prefetchAfterPin(e, std::move(prefetch));
    } catch (const std::exception& error) {
      // Prefetch is speculative: the storage asked for is resident and
      // pinned, and the storages that were not prefetched stay paged out.
      TORCH_WARN_ONCE(
          "Large Model Support: a prefetch failed; storages are paged in on "
          "demand. ",
          error.what());
    }
    lock.lock();
  }
  return kept_on_host;
}

namespace {

// Dropped storages whose recompute ahead of use waits for its inputs: filed
// again under their next use when prefetchUpcoming() returns, so that a
// later operator boundary tries again (this one would pick them again).
class RefileLater {
 public:
  explicit RefileLater(DeviceEngine& e) : e_(e) {}
  ~RefileLater() {
    if (storages_.empty()) {
      return;
    }
    std::lock_guard<std::mutex> lock(e_.mutex);
    for (const StorageRef& storage : storages_) {
      Record* r = recordOf(*storage);
      if (r != nullptr && r->engine == &e_ && r->state == State::Dropped &&
          !r->busy) {
        addUpcoming(e_, *r);
      }
    }
    // The storages are released after the engine lock, in the members'
    // destructor: a last reference runs the deleter.
  }
  RefileLater(const RefileLater&) = delete;
  RefileLater& operator=(const RefileLater&) = delete;

  void add(StorageRef storage) {
    storages_.push_back(std::move(storage));
  }

 private:
  DeviceEngine& e_;
  std::vector<StorageRef> storages_;
};

} // namespace

// Pages in, on the H2D stream, the paged-out storages used within the next
// `window` operators, soonest first, while the prefetched bytes not yet used
// stay within `budget` and the limit has room; for a dropped one, the inputs
// its recompute reads (prefetchRecipeInputs), and, once they are resident,
// the storage itself, recomputed ahead of its use (recomputeAhead: at most
// kAheadReplaysPerBoundary replays here).
void prefetchUpcoming(
    DeviceEngine& e,
    uint64_t now,
    uint64_t window,
    size_t budget) {
  const cudaStream_t stream = currentStream(e.device);
  int replays_left = kAheadReplaysPerBoundary;
  RefileLater later(e);
  while (true) {
    Record* r = nullptr;
    bool was_dropped = false;
    uint64_t next = 0;
    StorageRef dropped; // released after the engine lock
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      // A predicted use that passed unseen: leave it to demand paging.
      while (!e.upcoming.empty() && e.upcoming.begin()->first < now) {
        e.upcoming.begin()->second->upcoming = false;
        e.upcoming.erase(e.upcoming.begin());
      }
      if (e.upcoming.empty() || e.upcoming.begin()->first > now + window) {
        return;
      }
      r = e.upcoming.begin()->second;
      if (r->state == State::Dropped) {
        was_dropped = true;
        next = e.upcoming.begin()->first;
        removeUpcoming(e, *r);
        if (!r->busy) {
          dropped = r->owner.lock();
        }
      } else {
        if (r->busy || e.prefetched_bytes + r->size > budget) {
          return;
        }
        if (!takeForPrefetch(e, *r)) {
          continue;
        }
      }
    }
    if (was_dropped) {
      if (!dropped) {
        continue;
      }
      if (!prefetchRecipeInputs(e, *dropped, next, stream, budget)) {
        later.add(std::move(dropped));
        return;
      }
      // Used by the operator starting now: its pin recomputes it.
      if (next > now &&
          recomputeAhead(
              e, *dropped, next, now + window, budget, replays_left) ==
              Ahead::NotYet) {
        later.add(std::move(dropped));
      }
      continue;
    }
    if (!prefetchTaken(e, *r, stream, &LmsStats::schedule_prefetch_count)) {
      // No room under the limit yet: early page-outs make some, and the
      // next operator boundary tries again.
      return;
    }
  }
}

} // namespace detail

using namespace detail;

size_t pageInAhead(c10::ArrayRef<c10::StorageImpl*> storages) {
  if (!isEnabled() || !g_graph_prefetch.load()) {
    return 0;
  }
  std::vector<Record*> planned;
  planned.reserve(storages.size());
  c10::SmallVector<DeviceEngine*, 2> engines;
  for (c10::StorageImpl* storage : storages) {
    if (Record* r = recordOf(*storage)) {
      planned.push_back(r);
      if (std::find(engines.begin(), engines.end(), r->engine) ==
          engines.end()) {
        engines.push_back(r->engine);
      }
    }
  }
  size_t started = 0;
  for (DeviceEngine* e : engines) {
    started += pageInAheadOn(*e, planned);
  }
  return started;
}

} // namespace c10::cuda::lms
