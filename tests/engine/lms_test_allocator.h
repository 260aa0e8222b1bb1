#pragma once

// Caps what the caching allocator may reserve on device 0 for a scope (a
// per-process memory fraction), so that the device fills at that size
// whatever the LMS limit: allocations then fail inside the allocator, and its
// failure path runs. The whole device is given back at the end of the scope,
// also when a check fails.

#include <c10/cuda/CUDAException.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#pragma GCC diagnostic pop

#include <cuda_runtime_api.h>

#include <cstddef>

namespace lms_test {

class AllocatorCap {
 public:
  explicit AllocatorCap(size_t bytes) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    c10::cuda::CUDACachingAllocator::setMemoryFraction(
        static_cast<double>(bytes) / static_cast<double>(total_bytes), 0);
  }
  ~AllocatorCap() {
    c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, 0);
  }
  AllocatorCap(const AllocatorCap&) = delete;
  AllocatorCap& operator=(const AllocatorCap&) = delete;
};

} // namespace lms_test
