// simgpu: a host-memory stand-in for the CUDA runtime.
//
// libsimgpu exports the CUDA runtime API functions that libc10_cuda and the
// LMS engine use, with the types and signatures of the toolkit's
// cuda_runtime_api.h. "Device" memory is ordinary host memory, so tests can
// read it directly, but it is accounted per device against a capacity, and
// every stream runs its operations in order on a worker thread of its own so
// asynchronous copies, events and cross-stream waits behave as on a GPU.
//
// This header adds the test-control API. All functions are thread-safe.
//
// Environment (read once, at the first call into the library):
//   SIMGPU_DEVICE_COUNT  number of devices (default 1, at most 16)
//   SIMGPU_CAPACITY_MB   capacity of each device in MiB (default 256)
//   SIMGPU_COPY_GBPS     simulated copy bandwidth in GB/s (default: none,
//                        copies run at memcpy speed)
//   SIMGPU_SCRIBBLE      when set to 1, fresh and freed device memory is
//                        filled with 0xCD / 0xDD so stale reads show up
//   SIMGPU_VERBOSE       when set to 1, every failing call prints its reason
//                        to stderr
//
// Differences from CUDA that code under test may notice:
//   - There is no kernel execution; simgpu models memory, copies, streams,
//     events and host functions.
//   - The legacy default stream (0 / cudaStreamLegacy) synchronizes with
//     blocking streams of its device as in CUDA; cudaStreamPerThread is a
//     separate ordered stream per host thread and device.
//   - Copies to or from pageable (unregistered) host memory complete before
//     the call returns, as CUDA does for device-to-pageable copies; CUDA may
//     return a little earlier for pageable-to-device copies.
//   - An injected copy fault is reported by the copy call itself, not later
//     at a synchronization point.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Operation classes that faults can be injected into.
typedef enum simgpu_fault_kind {
  // cudaMalloc, cudaMallocAsync, cudaMallocManaged, cudaMallocPitch
  SIMGPU_FAULT_DEVICE_ALLOC = 0,
  // cudaHostAlloc, cudaMallocHost, cudaHostRegister
  SIMGPU_FAULT_HOST_ALLOC = 1,
  // every cudaMemcpy*, cudaMemcpy*Async, cudaMemcpyPeer*
  SIMGPU_FAULT_COPY = 2,
} simgpu_fault_kind;

// Arms a fault: the nth next operation of `kind` (nth = 1: the very next one)
// and the count - 1 operations after it fail with `error` and have no effect.
// count < 0 makes every operation from the nth on fail until disarmed. error
// cudaSuccess picks the natural code (cudaErrorMemoryAllocation for
// allocations, cudaErrorUnknown for copies). Replaces any fault armed for
// `kind`. nth <= 0 or count == 0 disarms it.
void simgpu_inject_fault(
    simgpu_fault_kind kind,
    int nth,
    int count,
    cudaError_t error);

// Shorthands for a single fault with the natural error code.
void simgpu_fail_nth_device_alloc(int nth);
void simgpu_fail_nth_host_alloc(int nth);
void simgpu_fail_nth_copy(int nth);

// Disarms every injected fault.
void simgpu_clear_faults(void);

// Number of injected faults that have fired since the last reset.
size_t simgpu_faults_fired(void);

// Sets the capacity of `device` in bytes. Allocations already made stay; new
// ones fail once in-use bytes would pass the capacity. Returns
// cudaErrorInvalidDevice for a bad index.
cudaError_t simgpu_set_capacity(int device, size_t bytes);
size_t simgpu_capacity(int device);

// Statistics of one device. Copies are counted on the device whose memory
// they read or write (host-to-host copies on the stream's device).
typedef struct simgpu_device_stats {
  size_t bytes_in_use; // cudaMalloc* minus cudaFree*
  size_t bytes_peak; // highest bytes_in_use since the last reset
  size_t capacity;
  size_t alloc_count; // successful allocations since the last reset
  size_t free_count;
  size_t copies_h2d;
  size_t copies_d2h;
  size_t copies_d2d;
  size_t copies_h2h;
  size_t bytes_h2d;
  size_t bytes_d2h;
  size_t bytes_d2d;
  size_t bytes_h2h;
} simgpu_device_stats;

// Statistics of pinned host memory (cudaHostAlloc, cudaMallocHost; memory
// registered with cudaHostRegister is counted in registered_bytes only).
typedef struct simgpu_host_stats {
  size_t bytes_in_use;
  size_t bytes_peak;
  size_t alloc_count;
  size_t free_count;
  size_t registered_bytes;
} simgpu_host_stats;

// Returns cudaErrorInvalidDevice for a bad index, else fills *out.
cudaError_t simgpu_get_device_stats(int device, simgpu_device_stats* out);
void simgpu_get_host_stats(simgpu_host_stats* out);

// Convenience accessors (0 for a bad device index).
size_t simgpu_device_bytes_in_use(int device);
size_t simgpu_device_bytes_peak(int device);
size_t simgpu_host_bytes_in_use(void);
size_t simgpu_host_bytes_peak(void);

// Sets every peak to the current in-use value and zeroes every count (the
// runtime calls' too) and the fired-fault count. In-use bytes and capacities
// are unchanged.
void simgpu_reset_counters(void);

// Runtime calls the program made to `function` (e.g. "cudaEventQuery") since
// the last reset, on every thread; 0 for one never called. A call the library
// makes to itself is not counted (cudaEventRecord is one call).
size_t simgpu_call_count(const char* function);

// One runtime function and its calls since the last reset.
typedef struct simgpu_call_entry {
  const char* function;
  size_t calls;
} simgpu_call_entry;

// Fills `out` with up to `capacity` functions called since the last reset,
// most called first; returns how many functions were called.
size_t simgpu_call_counts(simgpu_call_entry* out, size_t capacity);

// Simulated copy bandwidth in bytes per second; 0 turns the simulation off.
// A copy of n bytes then takes at least n / bandwidth seconds on its stream.
void simgpu_set_copy_bandwidth(double bytes_per_second);

// While `capturing` is nonzero, cudaStreamIsCapturing and
// cudaStreamGetCaptureInfo report an active capture on `stream` (0: the
// current device's legacy default stream), so that code which must act
// otherwise during CUDA graph capture can be tested. Nothing is recorded: the
// stream's work runs as it is queued. Returns the error of an invalid stream.
cudaError_t simgpu_set_capturing(cudaStream_t stream, int capturing);

// Why the last failing CUDA call on this thread failed, in words (empty when
// the last call succeeded). The pointer stays valid until this thread's next
// CUDA call.
const char* simgpu_last_error_detail(void);

// Number of simulated devices.
int simgpu_device_count(void);

#ifdef __cplusplus
} // extern "C"
#endif
