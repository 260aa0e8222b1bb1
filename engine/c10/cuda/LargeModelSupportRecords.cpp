// The LMS record of a storage allocation: the states it moves through, with
// the statistics of each; its place as the context of its storage's DataPtr;
// adopting a storage allocated without LMS; and the deleter that ends a
// record with its allocation.

#include <c10/cuda/LargeModelSupportInternal.h>

#include <algorithm>

namespace c10::cuda::lms {

namespace detail {

Record* recordOf(const c10::DataPtr& dp) {
  if (dp.get_deleter() != &deleteRecord) {
    return nullptr;
  }
  return static_cast<Record*>(dp.get_context());
}

Record* recordOf(c10::StorageImpl& storage) {
  return recordOf(storage._mutable_data_ptr_no_checks());
}

void addUser(Record& r, cudaStream_t stream) {
  if (stream != r.stream &&
      std::find(r.users.begin(), r.users.end(), stream) == r.users.end()) {
    r.users.push_back(stream);
  }
}

// Storage hook (patched builds): armed while the storage is inactive or paged
// out, so raw data access comes to the engine first.
void arm(c10::StorageImpl& storage, bool armed) {
#ifdef C10_LMS_STORAGE_HOOK
  storage.set_lms_armed(armed);
#else
  (void)storage;
  (void)armed;
#endif
}

// The storage's DataPtr keeps the record as context while the memory moves:
// after a page-in, point it at the new device memory.
void refreshDataPtr(c10::StorageImpl& storage, Record& r) {
  c10::DataPtr& dp = storage._mutable_data_ptr_no_checks();
  void* const address = r.on_host ? r.host.ptr : r.device_ptr;
  if (dp.get() == address) {
    return;
  }
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(address, ctx, &deleteRecord, device);
}

// The storage is no longer an unreleased output of a running operator.
// Called with the engine lock held.
void clearFresh(DeviceEngine& e, Record& r) {
  if (r.fresh) {
    r.fresh = false;
    add(e.stats.operator_output_bytes, -sz(r));
  }
}

StorageState publicState(State state) {
  switch (state) {
    case State::Allocated:
      return StorageState::Allocated;
    case State::Active:
      return StorageState::Active;
    case State::Inactive:
      return StorageState::Inactive;
    case State::PagedOut:
      return StorageState::PagedOut;
    case State::Dropped:
      return StorageState::Dropped;
  }
  return StorageState::Unmanaged;
}

// Leaves state `from` for accounting purposes.
void leave(DeviceEngine& e, Record& r) {
  switch (r.state) {
    case State::Active:
      add(e.stats.active_bytes, -sz(r));
      break;
    case State::Inactive:
      add(e.stats.inactive_bytes, -sz(r));
      break;
    case State::PagedOut:
      add(e.stats.pagedout_bytes, -sz(r));
      break;
    case State::Dropped:
      add(e.stats.dropped_bytes, -sz(r));
      break;
    case State::Allocated:
      break;
  }
}

void enter(DeviceEngine& e, Record& r, State state) {
  r.state = state;
  switch (state) {
    case State::Active:
      add(e.stats.active_bytes, sz(r));
      break;
    case State::Inactive:
      add(e.stats.inactive_bytes, sz(r));
      break;
    case State::PagedOut:
      add(e.stats.pagedout_bytes, sz(r));
      break;
    case State::Dropped:
      add(e.stats.dropped_bytes, sz(r));
      break;
    case State::Allocated:
      break;
  }
}

void rememberOwner(Record& r, c10::StorageImpl& storage) {
  if (r.owner._unsafe_get_target() != &storage) {
    r.owner = c10::weak_intrusive_ptr<c10::StorageImpl>(
        c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(
            &storage));
  }
}

void deleteRecord(void* ctx) {
  auto* r = static_cast<Record*>(ctx);
  DeviceEngine& e = *r->engine;
  WorkingSet& ws = t_working_set;
  if (r->working_set != 0 && ws.active && r->working_set == ws.serial) {
    ws.inside -= std::min(ws.inside, r->size); // a temporary of the operator
  }
  if (r->recomputable) {
    if (const RecomputeHooks* hooks = g_recompute_hooks.load()) {
      hooks->forget(ctx);
    }
  }
  // Only storages that may be paged out matter to victim choice: the small
  // ones, freed by the thousand, do not take the schedule's lock.
  if (g_schedule_enabled.load() && r->size >= g_size_threshold.load() &&
      !r->moved) {
    // Taken alone: no engine lock is held here, and the schedule's mutex is
    // never held while a storage is freed.
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    if (theSchedule().active()) {
      theSchedule().recordDeath(r->touch.load(), r->size, r->gap.load());
    }
  }
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy; });
    if (r->list != nullptr) {
      r->list->remove(r);
    }
    removeUpcoming(e, *r);
    clearPrefetched(e, *r);
    if (r->draining) {
      e.draining_bytes -= r->size;
    }
    leave(e, *r);
    clearFresh(e, *r);
    add(e.stats.managed_bytes, -sz(*r));
  }
  DeviceScope guard(e.device);
  if (r->draining) {
    // The device memory may be reused only after the copy that reads it.
    C10_CUDA_CHECK_WARN(cudaStreamWaitEvent(r->stream, r->host_ready, 0));
    e.events.put(r->drain_copied);
    r->drain_copied = nullptr;
    if (!r->stream_known) {
      backend().freeAfter(r->device_ptr, e.device, e.copyStream());
      r->device_ptr = nullptr;
    }
  }
  releaseDeviceMemory(e, *r, /*in_deleter=*/true);
  if (r->on_host) {
    // Freed while operators may still be using it (a workspace).
    r->host_ready = hostUseDone(e, *r, /*in_deleter=*/true);
  }
  removeSpilled(e, *r);
  if (r->host.ptr != nullptr) {
    // The page-out copy may still be writing into the buffer.
    hostPool().release(r->host, r->host_ready, e.device);
  } else if (r->host_ready != nullptr) {
    e.events.put(r->host_ready);
  }
  delete r;
}

// Takes over a storage the backend allocated without LMS (see
// DeviceMemoryBackend::adoptable). Its DataPtr is replaced by one whose
// context is the new record; the memory stays where it is.
Record* adopt(c10::StorageImpl& storage) {
  DeviceMemoryBackend* b = g_backend.load();
  c10::DataPtr& dp = storage._mutable_data_ptr_no_checks();
  if (!isEnabled() || b == nullptr || dp.get() == nullptr ||
      dp.device().type() != c10::DeviceType::CUDA ||
      storage.nbytes() < g_size_threshold.load() || !b->adoptable(dp)) {
    return nullptr;
  }
  const c10::DeviceIndex device = dp.device().index();
  if (isCapturing(currentStream(device))) {
    return nullptr; // graph memory must stay put
  }
  DeviceEngine& e = engineFor(device);
  auto* r = new Record();
  r->engine = &e;
  r->size = storage.nbytes();
  r->device_ptr = dp.get();
  r->stream = currentStream(device);
  r->stream_known = false;
  // The backend's deleter is dropped: the record frees the memory now.
  (void)dp.release_context();
  dp = c10::DataPtr(r->device_ptr, r, &deleteRecord, dp.device());
  rememberOwner(*r, storage);
  std::lock_guard<std::mutex> lock(e.mutex);
  add(e.stats.managed_bytes, sz(*r));
  return r;
}

} // namespace detail

using namespace detail;

const char* toString(StorageState state) {
  switch (state) {
    case StorageState::Unmanaged:
      return "unmanaged";
    case StorageState::Allocated:
      return "allocated";
    case StorageState::Active:
      return "active";
    case StorageState::Inactive:
      return "inactive";
    case StorageState::PagedOut:
      return "paged out";
    case StorageState::Dropped:
      return "dropped";
  }
  return "unknown";
}

StorageState getState(const c10::StorageImpl& storage) {
  Record* r = recordOf(
      const_cast<c10::StorageImpl&>(storage)._mutable_data_ptr_no_checks());
  if (r == nullptr) {
    return StorageState::Unmanaged;
  }
  std::lock_guard<std::mutex> lock(r->engine->mutex);
  return publicState(r->state);
}

bool isManaged(const c10::DataPtr& data_ptr) {
  return recordOf(data_ptr) != nullptr;
}

bool recordStream(const c10::DataPtr& data_ptr, cudaStream_t stream) {
  Record* r = recordOf(data_ptr);
  if (r == nullptr) {
    return true; // not LMS's: the allocator's own memory
  }
  std::lock_guard<std::mutex> lock(r->engine->mutex);
  addUser(*r, stream);
  return data_ptr.get() != nullptr && data_ptr.get() == r->device_ptr;
}

} // namespace c10::cuda::lms
