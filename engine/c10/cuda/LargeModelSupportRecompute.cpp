// Recompute instead of paging (setRecomputeEnabled): a victim with a recipe
// is dropped when replaying it costs less than paging it out and back in,
// and a dropped storage is recomputed when it is used, through the hooks of
// the layer that records recipes (RecomputeHooks).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <cstdio>
#include <mutex>
#include <utility>

namespace c10::cuda::lms {

namespace detail {

std::atomic<const RecomputeHooks*> g_recompute_hooks{nullptr};

// Pins made for a recompute's replay on this thread (pinForRecompute): uses
// the program does not make, which the learned schedule must not see.
thread_local int t_recompute_pins = 0;

// Drops a victim instead of copying it out, when it has a recipe and
// recomputing it costs less than paging it out and back in (pagingCost():
// the copies at the measured bandwidth, as far as they make streams wait;
// before any copy was timed, victims are paged out: that measures it). Its
// memory goes back to the allocator in the order of every stream that used it,
// and its DataPtr holds no address until it is recomputed. The victim is busy
// and on no list; the engine lock is not held. Returns false, nothing changed,
// when the victim is to be paged out.
bool dropInstead(DeviceEngine& e, Record& r, StorageRef& keep_alive) {
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  if (isRecomputeLogEnabled() && hooks != nullptr && g_recompute.load()) {
    std::fprintf(
        stderr,
        "LMS recompute: victim of %zu bytes: %s\n",
        r.size,
        !r.recomputable       ? "no recipe"
            : r.graph_owned   ? "graph memory"
            : r.draining      ? "draining"
            : !r.stream_known ? "stream unknown"
                              : "has a recipe");
  }
  if (!r.recomputable || hooks == nullptr || !g_recompute.load() ||
      r.graph_owned || r.draining || !r.stream_known ||
      r.device_ptr == nullptr) {
    return false;
  }
  const double paging = pagingCost(e, r.size);
  if (paging < 0.0) {
    return false;
  }
  StorageRef storage = r.owner.lock();
  if (!storage) {
    return false;
  }
  c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  if (dp.get_context() != &r || dp.get_deleter() != &deleteRecord) {
    return false;
  }
  const double cost = hooks->cost_ms(*storage);
  const bool drop = cost >= 0.0 && cost < paging && hooks->retain(*storage);
  if (isRecomputeLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS recompute: %zu bytes: recompute %.3f ms, paging %.3f ms (stall "
        "share %.2f): %s\n",
        r.size,
        cost,
        paging,
        stallShare(e),
        drop ? "dropped" : "paged out");
  }
  if (!drop) {
    return false;
  }
  DeviceScope guard(e.device);
  releaseDeviceMemory(e, r, /*in_deleter=*/false);
  r.dropped = true;
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(nullptr, ctx, &deleteRecord, device);
  keep_alive = std::move(storage);
  return true;
}

namespace {

// Serializes recomputes: a replay may recompute its own inputs first (the
// same thread, again), and two threads must not both recompute one storage.
std::recursive_mutex g_recompute_mutex;

// Recomputes a dropped storage (RecomputeHooks::recompute) on the current
// stream, timing the replay there. Returns the storage's record after it: a
// new one when the storage was dropped, `r` otherwise.
Record* rematerialize(c10::StorageImpl& storage, Record* r) {
  DeviceEngine& e = *r->engine;
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy; });
    if (r->state != State::Dropped) {
      return r;
    }
  }
  const std::lock_guard<std::recursive_mutex> serial(g_recompute_mutex);
  r = recordOf(storage);
  if (r == nullptr) {
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (r->state != State::Dropped) {
      return r; // another thread recomputed it meanwhile
    }
  }
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  const size_t size = r->size;
  TORCH_CHECK(
      hooks != nullptr,
      "LMS: a storage of ",
      std::to_string(size),
      " bytes was dropped to be recomputed, but no recompute hooks are "
      "installed any more");
  const cudaStream_t stream = currentStream(e.device);
  TORCH_CHECK(
      !isCapturing(stream),
      "LMS: a storage of ",
      std::to_string(size),
      " bytes was dropped to be recomputed, and CUDA graph capture is "
      "underway on the current stream; a recompute cannot be captured. Run "
      "the captured region once before capturing so its inputs are "
      "resident, or turn recompute off (torch.cuda.set_recompute_lms(False)).");
  DeviceScope guard(e.device);
  cudaEvent_t start = e.events.get(/*timing=*/true);
  C10_CUDA_CHECK(cudaEventRecord(start, stream));
  try {
    hooks->recompute(storage);
  } catch (...) {
    e.events.put(start);
    throw;
  }
  cudaEvent_t end = e.events.get(/*timing=*/true);
  C10_CUDA_CHECK(cudaEventRecord(end, stream));
  addTiming(e, Timed::Recompute, start, end, size);
  Record* now = recordOf(storage);
  TORCH_CHECK(
      now != nullptr && now != r,
      "LMS: recomputing a dropped storage of ",
      std::to_string(size),
      " bytes did not fill it");
  return now;
}

} // namespace

// Recomputes the storage if it was dropped and returns its record, not busy
// and not dropped, with its engine's lock taken in `lock`; null when the
// storage holds no LMS allocation any more. A reclaim on another thread may
// drop it again before the lock is taken: then it is recomputed again.
Record* settledResident(
    c10::StorageImpl& storage,
    Record* r,
    std::unique_lock<std::mutex>& lock) {
  for (;;) {
    r = rematerialize(storage, r);
    if (r == nullptr) {
      return nullptr;
    }
    lock = std::unique_lock<std::mutex>(r->engine->mutex);
    r->engine->settled.wait(lock, [&] { return !r->busy; });
    if (r->state != State::Dropped) {
      return r;
    }
    lock.unlock();
  }
}

} // namespace detail

using namespace detail;

bool isRecomputeLogEnabled() {
  static const bool on = isFlagSet("PYTORCH_LMS_RECOMPUTE_LOG");
  return on;
}

void pinForRecompute(c10::StorageImpl& storage) {
  ++t_recompute_pins;
  struct Leave {
    ~Leave() {
      --t_recompute_pins;
    }
  } leave_scope;
  pin(storage);
}

void setRecomputeHooks(const RecomputeHooks* hooks) {
  g_recompute_hooks.store(hooks);
}

void setRecomputable(c10::StorageImpl& storage, bool recomputable) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(r->engine->mutex);
  r->recomputable = recomputable;
}

void* fillDropped(c10::StorageImpl& dropped, c10::StorageImpl& fresh) {
  Record* r = recordOf(dropped);
  Record* f = recordOf(fresh);
  TORCH_CHECK(
      r != nullptr && f != nullptr && r->engine == f->engine,
      "LMS: fillDropped() needs two LMS storages of one device");
  TORCH_CHECK(
      dropped.nbytes() == fresh.nbytes() && r->size == f->size,
      "LMS: a recompute produced ",
      std::to_string(fresh.nbytes()),
      " bytes for a dropped storage of ",
      std::to_string(dropped.nbytes()),
      " bytes");
  DeviceEngine& e = *r->engine;
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy && !f->busy; });
    TORCH_CHECK(
        r->state == State::Dropped,
        "LMS: fillDropped() of a storage that is not dropped (state ",
        toString(publicState(r->state)),
        ")");
    TORCH_CHECK(
        f->state == State::Allocated && f->pins == 0,
        "LMS: a recompute's result is in use elsewhere (state ",
        toString(publicState(f->state)),
        ")");
    e.dropped_list.remove(r);
    removeUpcoming(e, *r);
    leave(e, *r);
    enter(e, *r, State::Allocated);
    clearFresh(e, *f);
    // The storage keeps its place in the learned schedule.
    f->touch.store(r->touch.load());
    f->gap.store(r->gap.load());
    r->moved = true;
    r->recomputable = false;
    ++e.stats.recompute_count;
    e.stats.recompute_bytes += sz(*r);
  }
  std::swap(
      dropped._mutable_data_ptr_no_checks(),
      fresh._mutable_data_ptr_no_checks());
  rememberOwner(*f, dropped);
  rememberOwner(*r, fresh);
  return f;
}

} // namespace c10::cuda::lms
