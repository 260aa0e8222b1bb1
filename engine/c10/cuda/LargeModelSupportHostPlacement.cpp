// Host memory that operators use over the bus. Host placement: a request
// made inside an operator that the device cannot hold even with every
// reclaimable storage paged out goes to pinned host memory (placeOnHost;
// allocate() asks for it while host placement is on), and an input of the
// operator whose page-in finds no such room stays in its host copy
// (keepInputOnHost; makeResident asks for it). Either is paged out once no
// operator uses it (parkPlaced). Host use: an operator whose input stays
// paged out after its pins failed (host placement off) reads and writes its
// host copy in place (beginHostUse, endHostUse).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <cstdio>
#include <string>
#include <unordered_set>

namespace c10::cuda::lms {

namespace detail {

// Says that host placement serves the running operator: once per operator
// name for what it allocates, and once for its inputs (`input`), so that a
// model that needs it every iteration is told once, and each operator that
// needs it is named. `size`: the request, or the input left on the host.
// Takes the engine lock (the verdict reads the statistics): call without it.
void warnPlacedOnHost(DeviceEngine& e, size_t size, bool input) {
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  const WorkingSet& ws = t_working_set;
  const std::string name(ws.name);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert(input ? name + " inputs" : name).second) {
      return;
    }
  }
  auto mib = [](size_t bytes) {
    char text[32];
    std::snprintf(
        text,
        sizeof(text),
        "%.2f MiB",
        static_cast<double>(bytes) / static_cast<double>(kMiB));
    return std::string(text);
  };
  if (input) {
    // The out-of-memory verdict would count the input twice (pinned, and
    // requested): the inputs' own figures say it.
    TORCH_WARN(
        "Large Model Support: an input of ",
        name,
        " (",
        mib(size),
        ") cannot be resident on the device beside the operator's other "
        "inputs (",
        mib(ws.pinned),
        " in all) with every other storage paged out. LMS left it in pinned "
        "host memory, where the operator's kernels read and write it over the "
        "bus: the operator runs slower and computes the same numbers, and the "
        "input is paged in when next used. Give the operator more room (a "
        "higher memory cap or LMS limit, a smaller batch) to run it on the "
        "device, or turn host placement off "
        "(torch.cuda.set_host_placement_lms(False), lms_host_placement:False) "
        "to have it raise the out-of-memory error.");
    return;
  }
  const std::string verdict = explainOutOfMemory(e.device, size).verdict;
  TORCH_WARN(
      "Large Model Support: ",
      name,
      " allocated ",
      mib(size),
      " that the device cannot hold with every other storage paged out. ",
      verdict.empty() ? std::string() : verdict + " ",
      "LMS placed it in pinned host memory, which the operator's kernels use "
      "over the bus: the operator runs slower and computes the same numbers "
      "(a library such as cuDNN keeps the algorithm it picks with more "
      "memory). Give the operator more room (a higher memory cap or LMS "
      "limit, a smaller batch) to run it on the device, or turn host "
      "placement off (torch.cuda.set_host_placement_lms(False), "
      "lms_host_placement:False) to let libraries pick an algorithm that "
      "needs less memory, whose results can differ in the last bits.");
}

// Pinned host memory for a request of `size` bytes that the running operator
// could not have on the device with every reclaimable storage paged out
// (setHostPlacementEnabled). Raises the out-of-memory error, naming host
// memory, when the host budget refuses it too. The first time an operator
// needs it, a warning names the operator: it runs slower, over the bus.
HostBuffer placeOnHost(DeviceEngine& e, size_t size) {
  HostBuffer placed = allocateHost(e, size, /*wait=*/true);
  if (placed.ptr == nullptr) {
    t_host_refused = true;
    throwOutOfMemory(e, size, /*placement_refused=*/true);
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.host_placement_count;
    e.stats.host_placement_bytes += static_cast<int64_t>(size);
  }
  warnPlacedOnHost(e, size, /*input=*/false);
  return placed;
}

// An input of the running operator whose page-in found no room on the device
// even with every reclaimable storage paged out stays in its host copy for
// the operator (setHostPlacementEnabled): pinned there, the operator's
// kernels read and write it over the bus, and when its last pin ends it is
// paged out with what they wrote (parkPlaced), like an output placed on the
// host. Nothing is copied: no host memory is asked for, and no device copy
// is left to go stale. Its page-out copy is what fills the host copy, so
// streams that use it wait for that copy as for a page-in (device_ready,
// waitUntilResident). Engine lock held; the record is paged out, off every
// list, and not draining.
void keepInputOnHost(DeviceEngine& e, Record& r) {
  TORCH_INTERNAL_ASSERT(
      r.state == State::PagedOut && !r.draining && r.host.ptr != nullptr &&
      r.device_ptr == nullptr);
  r.on_host = true;
  if (r.device_ready != nullptr) {
    e.events.put(r.device_ready); // none is expected: a page-out returns it
  }
  r.device_ready = r.host_ready;
  r.host_ready = nullptr;
  ++e.stats.input_host_placement_count;
  e.stats.input_host_placement_bytes += sz(r);
}

// An event after the work queued so far on every stream that used a
// host-placed record's memory (recorded on its allocation stream, which waits
// for the others, as releaseDeviceMemory orders a free): once it is reached,
// the buffer may be copied from or handed out again. `in_deleter` turns CUDA
// errors into warnings. Takes no engine lock.
cudaEvent_t hostUseDone(DeviceEngine& e, Record& r, bool in_deleter) {
  const auto check = [in_deleter](cudaError_t err) {
    if (in_deleter) {
      C10_CUDA_CHECK_WARN(err);
    } else {
      C10_CUDA_CHECK(err);
    }
  };
  if (!r.users.empty()) {
    cudaEvent_t used = e.events.get(/*timing=*/false);
    for (cudaStream_t s : r.users) {
      check(cudaEventRecord(used, s));
      check(cudaStreamWaitEvent(r.stream, used, 0));
    }
    e.events.put(used);
  }
  cudaEvent_t done = e.events.get(/*timing=*/false);
  check(cudaEventRecord(done, r.stream));
  return done;
}

// A host-placed record (an allocation placed there, or an input kept there)
// that no operator uses any more is paged out from then on: its host buffer
// is its host copy, ready once the kernels that wrote it are done; its next
// use pages it in like any other. No copy is made, so no page-out is
// counted. Engine lock held.
void parkPlaced(DeviceEngine& e, Record& r) {
  if (r.device_ready != nullptr) {
    // An input kept on the host (keepInputOnHost): the event below must come
    // after the copy that filled the host copy too.
    DeviceScope guard(e.device);
    C10_CUDA_CHECK(cudaStreamWaitEvent(r.stream, r.device_ready, 0));
    e.events.put(r.device_ready);
    r.device_ready = nullptr;
  }
  r.host_ready = hostUseDone(e, r, /*in_deleter=*/false);
  r.on_host = false;
  r.users.clear();
  leave(e, r);
  enter(e, r, State::PagedOut);
  e.pagedout_list.push_back(&r);
  addUpcoming(e, r);
}

} // namespace detail

using namespace detail;

void beginHostUse(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  std::unique_lock<std::mutex> lock(e.mutex);
  e.settled.wait(lock, [&] { return !r->busy; });
  // Used over the bus is used: a storage an operator reads on the host every
  // iteration (an optimizer's state beside parameters that leave no room for
  // it) would otherwise look unused for ever longer, and the schedule, whose
  // iterations touch every storage in use, would never confirm a period.
  noteUse(*r);
  if (r->state == State::PagedOut && r->draining) {
    // Paged out early and its device memory still held: it needs no room,
    // so it is made resident again rather than used over the bus.
    rescueDrained(e, *r);
    rememberOwner(*r, storage);
    refreshDataPtr(storage, *r);
    DeviceScope guard(e.device);
    C10_CUDA_CHECK(
        cudaStreamWaitEvent(currentStream(e.device), r->device_ready, 0));
    return;
  }
  if (r->state == State::PagedOut && !r->spill_path.empty()) {
    // On disk: the operator's kernels need its host copy back in pinned
    // memory (its page-in would need room the device did not have).
    e.pagedout_list.remove(r);
    removeUpcoming(e, *r);
    r->busy = true;
    lock.unlock();
    try {
      restoreHostCopy(e, *r);
    } catch (...) {
      lock.lock();
      r->busy = false;
      e.pagedout_list.push_back(r);
      addUpcoming(e, *r);
      e.settled.notify_all();
      throw;
    }
    lock.lock();
    r->busy = false;
    e.pagedout_list.push_back(r);
    addUpcoming(e, *r);
    e.settled.notify_all();
    // Nothing is copying into the buffer: an event that is reached at once.
    r->host_ready = e.events.get(/*timing=*/false);
    DeviceScope guard(e.device);
    C10_CUDA_CHECK(cudaEventRecord(r->host_ready, currentStream(e.device)));
  }
  if (r->state != State::PagedOut || r->host_ready == nullptr) {
    return;
  }
  rememberOwner(*r, storage);
  c10::DataPtr& dp = storage._mutable_data_ptr_no_checks();
  if (dp.get() != r->host.ptr) {
    const c10::Device device = dp.device();
    void* ctx = dp.release_context();
    dp = c10::DataPtr(r->host.ptr, ctx, &deleteRecord, device);
  }
  DeviceScope guard(e.device);
  C10_CUDA_CHECK(
      cudaStreamWaitEvent(currentStream(e.device), r->host_ready, 0));
}

void endHostUse(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  std::unique_lock<std::mutex> lock(e.mutex);
  e.settled.wait(lock, [&] { return !r->busy; });
  if (r->state != State::PagedOut || r->host_ready == nullptr) {
    return;
  }
  // A page-in waits for host_ready: move it past the operator's work, which
  // may have written the host copy.
  DeviceScope guard(e.device);
  C10_CUDA_CHECK(cudaEventRecord(r->host_ready, currentStream(e.device)));
}

} // namespace c10::cuda::lms
