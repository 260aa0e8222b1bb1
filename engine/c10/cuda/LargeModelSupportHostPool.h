#pragma once

// Pinned host memory for Large Model Support page-outs.
//
// Pinning costs milliseconds a buffer plus the time to fault in and lock every
// page, and freeing synchronizes with the device, so buffers are cached and
// reused. A released buffer may still be the source or target of an
// asynchronous copy: it carries an event and is handed out again only once
// that event has completed, without the host ever blocking on it.

#include <c10/core/Device.h>
#include <c10/cuda/CUDAMacros.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>

namespace c10::cuda::lms {

struct HostBuffer {
  void* ptr = nullptr;
  size_t capacity = 0; // bytes actually allocated (rounded up)
};

class C10_CUDA_API HostPool {
 public:
  // Called with an event the pool no longer needs, and its device.
  using EventRecycler = std::function<void(cudaEvent_t, c10::DeviceIndex)>;

  struct Usage {
    int64_t held_bytes = 0; // allocated from CUDA, in use or cached
    int64_t peak_held_bytes = 0;
    int64_t in_use_bytes = 0;
    int64_t alloc_failures = 0;
  };

  explicit HostPool(EventRecycler recycle);
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A buffer of at least `size` bytes, or {nullptr, 0} when pinned memory is
  // exhausted even after freeing every idle cached buffer.
  HostBuffer allocate(size_t size);
  // Returns a buffer. `ready` (may be null) is an event after which no copy
  // touches the buffer any more; the pool takes ownership of it.
  void release(HostBuffer buffer, cudaEvent_t ready, c10::DeviceIndex device);
  // Frees every cached buffer whose copies have completed.
  void releaseCached();
  Usage usage();
  void resetPeak();

  static size_t roundSize(size_t size);

 private:
  // One pinned allocation: its size, and whether it is registered memory
  // (an anonymous mapping) rather than from cudaHostAlloc.
  struct Pinned {
    size_t capacity;
    bool registered;
  };
  struct Cached {
    void* ptr;
    cudaEvent_t ready;
    c10::DeviceIndex device;
  };

  static void* allocatePinned(size_t size, bool& registered);
  static void freePinned(void* ptr, size_t size, bool registered);
  bool isReady(const Cached& c);
  HostBuffer takeCached(size_t rounded);

  EventRecycler recycle_;
  std::mutex mutex_;
  std::multimap<size_t, Cached> cached_; // capacity -> idle buffer
  std::unordered_map<void*, Pinned> capacity_; // every buffer we allocated
  Usage usage_;
};

// The process-wide pool LMS uses (pinned memory is portable across devices).
C10_CUDA_API HostPool& hostPool();

} // namespace c10::cuda::lms
