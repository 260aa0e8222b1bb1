#include <c10/cuda/LargeModelSupportHostPool.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

namespace c10::cuda::lms {

namespace {
constexpr size_t kSmallPage = 4096;
constexpr size_t kLargeChunk = 2 * 1024 * 1024;
} // namespace

HostPool::HostPool(EventRecycler recycle) : recycle_(std::move(recycle)) {}

size_t HostPool::roundSize(size_t size) {
  // Powers of two up to 2 MiB keep small buffers interchangeable; larger
  // ones round to 2 MiB so a 1 GiB storage does not cost 2 GiB of host memory.
  if (size <= kLargeChunk) {
    size_t rounded = kSmallPage;
    while (rounded < size) {
      rounded *= 2;
    }
    return rounded;
  }
  return (size + kLargeChunk - 1) / kLargeChunk * kLargeChunk;
}

bool HostPool::isReady(const Cached& c) {
  if (c.ready == nullptr) {
    return true;
  }
  const cudaError_t err = cudaEventQuery(c.ready);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); // not an error: clear the sticky state
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

// Reuses an idle buffer of at least `rounded` bytes and at most 25% larger.
// Called with the lock held.
HostBuffer HostPool::takeCached(size_t rounded) {
  const size_t most = rounded + rounded / 4;
  for (auto it = cached_.lower_bound(rounded);
       it != cached_.end() && it->first <= most;
       ++it) {
    if (!isReady(it->second)) {
      continue;
    }
    HostBuffer buffer{it->second.ptr, it->first};
    if (it->second.ready != nullptr) {
      recycle_(it->second.ready, it->second.device);
    }
    cached_.erase(it);
    usage_.in_use_bytes += static_cast<int64_t>(buffer.capacity);
    return buffer;
  }
  return {};
}

HostBuffer HostPool::allocate(size_t size) {
  const size_t rounded = roundSize(size);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HostBuffer reused = takeCached(rounded);
    if (reused.ptr != nullptr) {
      return reused;
    }
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    void* ptr = nullptr;
    // Portable: a buffer paged out from one device may be paged in to
    // another's memory pool later, and any device's copy engine may use it.
    const cudaError_t err = cudaHostAlloc(&ptr, rounded, cudaHostAllocPortable);
    if (err == cudaSuccess) {
      std::lock_guard<std::mutex> lock(mutex_);
      capacity_.emplace(ptr, rounded);
      usage_.held_bytes += static_cast<int64_t>(rounded);
      usage_.in_use_bytes += static_cast<int64_t>(rounded);
      usage_.peak_held_bytes =
          std::max(usage_.peak_held_bytes, usage_.held_bytes);
      return {ptr, rounded};
    }
    TORCH_CHECK(
        err == cudaErrorMemoryAllocation,
        "LMS: cudaHostAlloc of ",
        std::to_string(rounded),
        " bytes failed: ",
        cudaGetErrorString(err));
    (void)cudaGetLastError();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++usage_.alloc_failures;
    }
    // Idle cached buffers of other sizes may be what stands in the way.
    releaseCached();
  }
  return {};
}

void HostPool::release(
    HostBuffer buffer,
    cudaEvent_t ready,
    c10::DeviceIndex device) {
  TORCH_INTERNAL_ASSERT(buffer.ptr != nullptr);
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(
      capacity_.count(buffer.ptr) == 1, "LMS: host buffer not from this pool");
  usage_.in_use_bytes -= static_cast<int64_t>(buffer.capacity);
  cached_.emplace(buffer.capacity, Cached{buffer.ptr, ready, device});
}

void HostPool::releaseCached() {
  std::vector<void*> to_free;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = cached_.begin(); it != cached_.end();) {
      if (!isReady(it->second)) {
        ++it;
        continue;
      }
      if (it->second.ready != nullptr) {
        recycle_(it->second.ready, it->second.device);
      }
      to_free.push_back(it->second.ptr);
      usage_.held_bytes -= static_cast<int64_t>(it->first);
      capacity_.erase(it->second.ptr);
      it = cached_.erase(it);
    }
  }
  for (void* ptr : to_free) {
    C10_CUDA_CHECK(cudaFreeHost(ptr));
  }
}

HostPool::Usage HostPool::usage() {
  std::lock_guard<std::mutex> lock(mutex_);
  return usage_;
}

void HostPool::resetPeak() {
  std::lock_guard<std::mutex> lock(mutex_);
  usage_.peak_held_bytes = usage_.held_bytes;
}

} // namespace c10::cuda::lms
