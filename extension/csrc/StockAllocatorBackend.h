#pragma once

// LMS on a stock PyTorch wheel. The extension owns the allocation path the
// way PyTorch's pluggable allocators do: an LMS CUDAAllocator is installed at
// c10::cuda::CUDACachingAllocator::allocator (and in c10's allocator registry)
// and forwards everything to the stock caching allocator, except that every
// allocation goes through the LMS engine first (limit trigger, reclaim and
// retry when the device allocation fails, LMS-managed DataPtrs). The engine's
// DeviceMemoryBackend talks to the stock allocator directly.

#include <c10/core/Device.h>

namespace torch_lms {

// Installs the LMS allocator in front of the stock caching allocator and the
// engine's backend on top of it. Safe to call more than once; does not
// initialize CUDA.
void installAllocator();

// Hooks that need an initialized caching allocator (allocation tracing, which
// tells which memory sits in private pools). Called once CUDA is initialized
// and LMS is first turned on; idempotent.
void attachAllocatorHooks();

// Applies PYTORCH_LMS_CONF (same syntax and keys as the patched build's
// PYTORCH_CUDA_ALLOC_CONF LMS options).
void applyEnvironmentConfig();

} // namespace torch_lms
