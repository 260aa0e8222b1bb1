#pragma once

// LMS on a stock PyTorch wheel: the engine's DeviceMemoryBackend implemented
// on top of the unmodified CUDA caching allocator, plus the reclaim triggers
// the stock allocator offers to extensions (free-memory callbacks and
// out-of-memory observers).

#include <c10/core/Device.h>

#include <cstddef>

namespace torch_lms {

// Installs the backend into the engine (c10::cuda::lms::setBackend). Safe to
// call more than once; does not initialize CUDA.
void installBackend();

// Hooks that need an initialized caching allocator (allocation tracing, the
// out-of-memory observer). Called once CUDA is initialized and LMS is first
// turned on; idempotent.
void attachAllocatorHooks();

// Bytes kept free below the limit by reclaims that run when the caching
// allocator's free list misses (the request's size is unknown there).
void setHeadroom(size_t bytes);
size_t getHeadroom();

// The limit the free-memory callback enforces on `device`: the engine's LMS
// limit, lowered to the allocator's per-process memory fraction if that is
// smaller.
size_t effectiveLimit(c10::DeviceIndex device);

// Pages out least-recently-used inactive storages of `device` until the bytes
// allocated to tensors are at most `target`. Returns the bytes freed.
// Pages out inactive storages until the bytes allocated to tensors are the
// headroom below the limit and, under a memory-fraction cap, the reserved
// bytes are the headroom below the cap. Returns the bytes freed.
size_t makeHeadroom(c10::DeviceIndex device);

size_t reclaimDownTo(c10::DeviceIndex device, size_t target);

// Applies PYTORCH_LMS_CONF (same syntax and keys as the patched build's
// PYTORCH_CUDA_ALLOC_CONF LMS options, plus lms_headroom_mb).
void applyEnvironmentConfig();

} // namespace torch_lms
