// Host memory that operators use over the bus. Host placement: a request
// made inside an operator that the device cannot hold even with every
// reclaimable storage paged out goes to pinned host memory (placeOnHost;
// allocate() asks for it while host placement is on), and is paged out from
// birth once no operator uses it (parkPlaced). Host use: an operator whose
// input stays paged out reads and writes its host copy in place
// (beginHostUse, endHostUse).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <cstdio>
#include <string>
#include <unordered_set>

namespace c10::cuda::lms {

namespace detail {

// Pinned host memory for a request of `size` bytes that the running operator
// could not have on the device with every reclaimable storage paged out
// (setHostPlacementEnabled). Raises the out-of-memory error when the host
// budget refuses it too. The first time an operator needs it, a warning
// names the operator: it runs slower, over the bus.
HostBuffer placeOnHost(DeviceEngine& e, size_t size) {
  HostBuffer placed = hostPool().allocate(size);
  if (placed.ptr == nullptr) {
    t_host_refused = true;
    throwOutOfMemory(e, size);
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.host_placement_count;
    e.stats.host_placement_bytes += static_cast<int64_t>(size);
  }
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  std::string name(t_working_set.name);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert(name).second) {
      return placed;
    }
  }
  char request[32];
  std::snprintf(
      request,
      sizeof(request),
      "%.2f MiB",
      static_cast<double>(size) / static_cast<double>(kMiB));
  const std::string verdict = explainOutOfMemory(e.device, size).verdict;
  TORCH_WARN(
      "Large Model Support: ",
      name,
      " allocated ",
      request,
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
  return placed;
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

// A host-placed record that no operator uses any more is paged out from then
// on: its host buffer is its host copy, ready once the kernels that wrote it
// are done; its next use pages it in like any other. No copy is made, so no
// page-out is counted. Engine lock held.
void parkPlaced(DeviceEngine& e, Record& r) {
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
