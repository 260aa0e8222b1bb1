// Large Model Support engine (the API: LargeModelSupport.h): the engine of
// each device, turning LMS on and off, the allocator backend, and the entry
// points of a storage's life: allocation, pin and unpin at operator
// boundaries, the release of an operator's outputs, and raw data access. They
// route into the files of the engine that LargeModelSupportInternal.h lists
// by concern.

#include <c10/cuda/LargeModelSupportInternal.h>

#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace c10::cuda::lms {

namespace detail {

namespace {

std::atomic<bool> g_enabled{false};

std::atomic<EnabledObserver> g_enabled_observer{nullptr};

#ifdef C10_LMS_STORAGE_HOOK
void storageAccessHook(c10::StorageImpl& storage) {
  access(storage);
}
#endif

} // namespace

std::atomic<DeviceMemoryBackend*> g_backend{nullptr};

std::mutex g_engines_mutex;
std::vector<DeviceEngine*> g_engines; // never freed: used by late deleters

DeviceEngine& engineFor(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_engines_mutex);
  TORCH_CHECK(
      device >= 0, "LMS: invalid CUDA device index ", std::to_string(device));
  if (static_cast<size_t>(device) >= g_engines.size()) {
    g_engines.resize(device + 1, nullptr);
  }
  if (g_engines[device] == nullptr) {
    g_engines[device] = new DeviceEngine(device);
  }
  return *g_engines[device];
}

DeviceMemoryBackend& backend() {
  DeviceMemoryBackend* b = g_backend.load();
  TORCH_CHECK(
      b != nullptr,
      "LMS: no device memory backend is installed; the CUDA caching allocator "
      "must call c10::cuda::lms::setBackend() before LMS allocations");
  return *b;
}

bool isCapturing(cudaStream_t stream) {
  DeviceMemoryBackend* b = g_backend.load(std::memory_order_relaxed);
  if (b != nullptr && !b->captureMayBeUnderway()) {
    return false;
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Whether the diagnostic environment variable `name` is set to anything but
// empty or "0".
bool isFlagSet(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' && std::string_view(value) != "0";
}

cudaStream_t currentStream(c10::DeviceIndex device) {
  return c10::cuda::getCurrentCUDAStream(device).stream();
}

} // namespace detail

using namespace detail;

DeviceMemoryBackend::~DeviceMemoryBackend() = default;

HostPool& hostPool() {
  // Never destroyed: deleters of storages may run during static destruction.
  static HostPool* pool = new HostPool(
      [](cudaEvent_t ev, c10::DeviceIndex d) { engineFor(d).events.put(ev); });
  return *pool;
}

void releaseCachedHostMemory() {
  hostPool().releaseCached();
}

void setEnabled(bool enabled) {
#ifdef C10_LMS_STORAGE_HOOK
  c10::impl::SetLmsStorageAccessHook(&storageAccessHook);
#endif
  g_enabled.store(enabled);
  if (EnabledObserver observer = g_enabled_observer.load()) {
    observer(enabled);
  }
}

void setEnabledObserver(EnabledObserver observer) {
  g_enabled_observer.store(observer);
  if (observer != nullptr && isEnabled()) {
    observer(true);
  }
}

bool isEnabled() {
  return g_enabled.load(std::memory_order_relaxed);
}

void setBackend(DeviceMemoryBackend* b) {
  g_backend.store(b);
}

DeviceMemoryBackend* getBackend() {
  return g_backend.load();
}

c10::DataPtr allocate(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream) {
  raisePendingError(size);
  DeviceEngine& e = engineFor(device);
  pollTimingsSometimes(e);
  if (isCapturing(stream)) {
    // Graph-private memory: the captured graph bakes in its address.
    void* ptr = backend().malloc(device, size, stream);
    return backend().makeDataPtr(ptr, device);
  }
  const bool managed = size >= g_size_threshold.load();
  WorkingSet& ws = t_working_set;
  const bool placeable =
      managed && ws.active && ws.device == device && g_host_placement.load();
  void* ptr = allocateDevice(e, size, stream, /*or_null=*/placeable);
  HostBuffer placed;
  if (ptr == nullptr) {
    placed = placeOnHost(e, size);
    ptr = placed.ptr;
  }
  if (!managed) {
    return backend().makeDataPtr(ptr, device);
  }
  auto* r = new Record();
  r->engine = &e;
  r->size = size;
  r->device_ptr = placed.ptr == nullptr ? ptr : nullptr;
  r->host = placed;
  r->on_host = placed.ptr != nullptr;
  r->stream = stream;
  r->fresh = true;
  // Born in the running operator: the schedule measures distances from here.
  r->touch.store(g_op_clock.load(std::memory_order_relaxed));
  // A replay's allocations are not the operator's own: whether it needs one
  // differs between iterations, and its ordinals must not.
  r->gap.store(
      AccessSchedule::kBirth +
      (t_replays > 0 ? g_births_in_op.load() : g_births_in_op.fetch_add(1)));
  if (ws.active && ws.device == device) {
    r->working_set = ws.serial;
    ws.inside += size;
    ws.inside_peak = std::max(ws.inside_peak, ws.inside);
    if (size >= kPackBlockBytes) {
      ++ws.blocks;
    }
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    add(e.stats.managed_bytes, sz(*r));
    add(e.stats.operator_output_bytes, sz(*r));
  }
  return c10::DataPtr(
      ptr, r, &deleteRecord, c10::Device(c10::DeviceType::CUDA, device));
}

void* allocateRaw(c10::DeviceIndex device, size_t size, cudaStream_t stream) {
  raisePendingError(size);
  if (isCapturing(stream)) {
    return backend().malloc(device, size, stream);
  }
  return allocateDevice(engineFor(device), size, stream);
}

void pin(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    r = adopt(storage);
    if (r == nullptr) {
      return;
    }
  }
  std::unique_lock<std::mutex> lock;
  r = settledResident(storage, r, lock);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  if (makeResident(e, *r, storage, State::Active, lock)) {
    // Kept in its host copy for the running operator (host placement).
    const size_t size = r->size;
    lock.unlock();
    warnPlacedOnHost(e, size, /*input=*/true);
  }
}

void unpin(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  const cudaStream_t stream = currentStream(e.device);
  const bool capturing = isCapturing(stream);
  std::lock_guard<std::mutex> lock(e.mutex);
  TORCH_CHECK(
      r->state == State::Active && r->pins > 0,
      "LMS: unpin() of a storage that is not pinned (state ",
      toString(publicState(r->state)),
      "); every unpin() must match an earlier pin()");
  addUser(*r, stream);
  // Memory a captured CUDA graph uses must stay where the graph saw it.
  r->graph_owned = r->graph_owned || capturing;
  if (--r->pins > 0) {
    return;
  }
  if (r->on_host) {
    const WorkingSet& ws = t_working_set;
    if (ws.active && r->working_set == ws.serial) {
      // An operator nested in the one that placed it is done with it; the
      // placing operator may go on using it, at this address, and releases
      // it when it ends (releaseOutput).
      leave(e, *r);
      enter(e, *r, State::Allocated);
      if (!r->fresh) {
        r->fresh = true;
        add(e.stats.operator_output_bytes, sz(*r));
      }
      return;
    }
    // Placed by an operator that has ended, or an input kept on the host for
    // the operator that ends now: paged out, its host buffer its host copy.
    parkPlaced(e, *r);
    arm(storage, true);
    return;
  }
  leave(e, *r);
  if (r->graph_owned) {
    enter(e, *r, State::Allocated);
    return;
  }
  enter(e, *r, State::Inactive);
  e.reclaim_list.push_back(r);
  arm(storage, true);
}

void releaseOutput(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  const cudaStream_t stream = currentStream(e.device);
  const bool capturing = isCapturing(stream);
  std::lock_guard<std::mutex> lock(e.mutex);
  if (r->state != State::Allocated || !r->fresh || r->busy) {
    return; // pinned, reclaimable already, or accessed raw since
  }
  clearFresh(e, *r);
  addUser(*r, stream);
  if (capturing || r->graph_owned) {
    r->graph_owned = true; // a captured graph bakes in its address
    return;
  }
  rememberOwner(*r, storage);
  if (r->on_host) {
    parkPlaced(e, *r);
  } else {
    leave(e, *r);
    enter(e, *r, State::Inactive);
    e.reclaim_list.push_back(r);
  }
  arm(storage, true);
}

void access(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    arm(storage, false);
    return;
  }
  std::unique_lock<std::mutex> lock;
  r = settledResident(storage, r, lock);
  if (r == nullptr) {
    return;
  }
  if (r->state == State::Active) {
    // Pinned: resident and off the reclaim list already, but perhaps paged
    // in on another stream a moment ago.
    waitUntilResident(*r->engine, *r, currentStream(r->engine->device));
    return;
  }
  makeResident(*r->engine, *r, storage, State::Allocated, lock);
}

} // namespace c10::cuda::lms
