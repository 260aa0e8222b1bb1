#pragma once

// What the engine tests do to a storage as an operator would: make one with
// the caching allocator, write the pattern of a seed into it, or check that it
// holds it, pinned for the duration, on the current stream.

#include "lms_test_data.h"

#include <c10/core/StorageImpl.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#pragma GCC diagnostic pop
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10_compat.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace lms_test {

using StoragePtr = c10::intrusive_ptr<c10::StorageImpl>;

// A storage of `bytes` bytes from the caching allocator (an LMS storage
// while LMS is on and `bytes` is at least the size threshold).
inline StoragePtr newStorage(size_t bytes) {
  return c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(),
      static_cast<int64_t>(bytes),
      c10::cuda::CUDACachingAllocator::get(),
      /*resizable=*/false);
}

inline cudaStream_t stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

// What an operator does: pin, use the memory on the current stream, unpin.
// The copies name the storage as device memory, so that one LMS leaves on
// the host fails them; `anywhere` lets the runtime tell (a kernel that uses a
// storage placed on the host, setHostPlacementEnabled).
inline void write(c10::StorageImpl& s, uint64_t seed, bool anywhere = false) {
  const auto words = pattern(s.nbytes(), seed);
  c10::cuda::lms::pin(s);
  C10_CUDA_CHECK(cudaMemcpyAsync(
      lms_compat::mutableData(s),
      words.data(),
      s.nbytes(),
      anywhere ? cudaMemcpyDefault : cudaMemcpyHostToDevice,
      stream()));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream()));
  c10::cuda::lms::unpin(s);
}

inline bool matches(c10::StorageImpl& s, uint64_t seed, bool anywhere = false) {
  const auto expected = pattern(s.nbytes(), seed);
  std::vector<uint64_t> got(expected.size());
  c10::cuda::lms::pin(s);
  C10_CUDA_CHECK(cudaMemcpyAsync(
      got.data(),
      s.data(),
      s.nbytes(),
      anywhere ? cudaMemcpyDefault : cudaMemcpyDeviceToHost,
      stream()));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream()));
  c10::cuda::lms::unpin(s);
  return std::memcmp(got.data(), expected.data(), s.nbytes()) == 0;
}

} // namespace lms_test
