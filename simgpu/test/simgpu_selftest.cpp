// Self-test of simgpu on its own (no c10): stream ordering, events,
// asynchrony, capacity, fault injection, statistics and thread safety.

#include "harness.h"

#include <simgpu.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// A gate a stream can be parked on (through cudaLaunchHostFunc) so a test can
// observe the host side while the stream's later work is still pending.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;

  static void wait_cb(void* self) {
    auto* g = static_cast<Gate*>(self);
    std::unique_lock<std::mutex> lock(g->mu);
    g->cv.wait(lock, [&] { return g->open; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
};

void sleep_cb(void* ms) {
  std::this_thread::sleep_for(
      std::chrono::milliseconds(*static_cast<int*>(ms)));
}

// Restores the default state so cases stay independent.
struct Reset {
  Reset() {
    simgpu_clear_faults();
    simgpu_set_copy_bandwidth(0);
    (void)cudaGetLastError();
    (void)cudaSetDevice(0);
  }
  ~Reset() {
    simgpu_clear_faults();
    simgpu_set_copy_bandwidth(0);
    (void)cudaGetLastError();
    (void)cudaSetDevice(0);
  }
};

} // namespace

TEST_CASE(device_basics) {
  Reset reset;
  int n = 0;
  CHECK_CUDA(cudaGetDeviceCount(&n));
  CHECK(n == simgpu_device_count());
  CHECK(n >= 1);
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  CHECK(prop.totalGlobalMem == simgpu_capacity(0));
  CHECK(prop.major == 9);
  CHECK_CUDA_EQ(cudaGetDeviceProperties(&prop, n), cudaErrorInvalidDevice);
  CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK_CUDA_EQ(cudaSetDevice(n), cudaErrorInvalidDevice);
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidDevice);
  CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
  int v = 0;
  CHECK_CUDA(cudaDriverGetVersion(&v));
  CHECK(v >= CUDART_VERSION);
  CHECK_CUDA(cudaRuntimeGetVersion(&v));
  CHECK(v == CUDART_VERSION);
  int least = 1;
  int greatest = 1;
  CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  CHECK(least == 0 && greatest < 0);
  CHECK(
      std::strcmp(
          cudaGetErrorString(cudaErrorMemoryAllocation), "out of memory") == 0);
  CHECK(
      std::strcmp(cudaGetErrorName(cudaErrorNotReady), "cudaErrorNotReady") ==
      0);
}

TEST_CASE(async_copy_is_async) {
  Reset reset;
  const size_t n = 1 << 20;
  void* dev = nullptr;
  void* pinned = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, n));
  CHECK_CUDA(cudaHostAlloc(&pinned, n, cudaHostAllocDefault));
  std::memset(pinned, 0x5A, n);
  CHECK_CUDA(cudaMemset(dev, 0, n));
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Gate gate;
  CHECK_CUDA(cudaLaunchHostFunc(s, Gate::wait_cb, &gate));
  CHECK_CUDA(cudaMemcpyAsync(dev, pinned, n, cudaMemcpyHostToDevice, s));
  // The copy is queued behind the gate: the call returned, nothing copied.
  CHECK_CUDA_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  CHECK(cudaGetLastError() == cudaSuccess); // not-ready is not an error
  CHECK(static_cast<unsigned char*>(dev)[0] == 0);
  CHECK(static_cast<unsigned char*>(dev)[n - 1] == 0);
  gate.release();
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK_CUDA(cudaStreamQuery(s));
  CHECK(std::memcmp(dev, pinned, n) == 0);
  CHECK_CUDA(cudaStreamDestroy(s));
  CHECK_CUDA(cudaFree(dev));
  CHECK_CUDA(cudaFreeHost(pinned));
}

TEST_CASE(cross_stream_event_ordering) {
  Reset reset;
  const size_t n = 256 << 10;
  void* dev = nullptr;
  void* src = nullptr;
  void* dst = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, n));
  CHECK_CUDA(cudaMallocHost(&src, n));
  CHECK_CUDA(cudaMallocHost(&dst, n));
  std::memset(src, 0xA7, n);
  std::memset(dst, 0, n);
  cudaStream_t s1 = nullptr;
  cudaStream_t s2 = nullptr;
  CHECK_CUDA(cudaStreamCreateWithPriority(&s1, cudaStreamNonBlocking, -1));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t e = nullptr;
  CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventQuery(e)); // never recorded: complete
  Gate gate;
  CHECK_CUDA(cudaLaunchHostFunc(s1, Gate::wait_cb, &gate));
  CHECK_CUDA(cudaMemcpyAsync(dev, src, n, cudaMemcpyHostToDevice, s1));
  CHECK_CUDA(cudaEventRecord(e, s1));
  // s2 waits for e on the device side: this call must not block the host.
  CHECK_CUDA(cudaStreamWaitEvent(s2, e, 0));
  CHECK_CUDA(cudaMemcpyAsync(dst, dev, n, cudaMemcpyDeviceToHost, s2));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_CUDA_EQ(cudaEventQuery(e), cudaErrorNotReady);
  CHECK_CUDA_EQ(cudaStreamQuery(s2), cudaErrorNotReady);
  CHECK(static_cast<unsigned char*>(dst)[0] == 0);
  gate.release();
  CHECK_CUDA(cudaStreamSynchronize(s2));
  CHECK_CUDA(cudaEventQuery(e));
  CHECK(std::memcmp(dst, src, n) == 0);
  // A wait issued after the record completed needs nothing.
  CHECK_CUDA(cudaStreamWaitEvent(s2, e, 0));
  CHECK_CUDA(cudaStreamSynchronize(s2));
  CHECK_CUDA(cudaEventDestroy(e));
  CHECK_CUDA_EQ(cudaEventQuery(e), cudaErrorInvalidResourceHandle);
  CHECK_CUDA(cudaStreamDestroy(s1));
  CHECK_CUDA(cudaStreamDestroy(s2));
  CHECK_CUDA_EQ(cudaStreamQuery(s1), cudaErrorInvalidResourceHandle);
  CHECK_CUDA(cudaFree(dev));
  CHECK_CUDA(cudaFreeHost(src));
  CHECK_CUDA(cudaFreeHost(dst));
}

TEST_CASE(event_timing) {
  Reset reset;
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreate(&s));
  cudaEvent_t a = nullptr;
  cudaEvent_t b = nullptr;
  cudaEvent_t untimed = nullptr;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreateWithFlags(&b, cudaEventBlockingSync));
  CHECK_CUDA(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming));
  float ms = 0;
  CHECK_CUDA_EQ(
      cudaEventElapsedTime(&ms, a, b), cudaErrorInvalidResourceHandle);
  int sleep_ms = 30;
  CHECK_CUDA(cudaEventRecord(a, s));
  CHECK_CUDA(cudaLaunchHostFunc(s, sleep_cb, &sleep_ms));
  CHECK_CUDA(cudaEventRecord(b, s));
  CHECK_CUDA(cudaEventRecord(untimed, s));
  CHECK_CUDA(cudaEventSynchronize(b));
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  CHECK(ms >= 29.0f && ms < 2000.0f);
  CHECK_CUDA(cudaEventSynchronize(untimed));
  CHECK_CUDA_EQ(
      cudaEventElapsedTime(&ms, a, untimed), cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  // Re-recording moves the event to the new position.
  CHECK_CUDA(cudaEventRecord(a, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK_CUDA(cudaEventElapsedTime(&ms, b, a));
  CHECK(ms >= 0.0f);
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  CHECK_CUDA(cudaEventDestroy(untimed));
  CHECK_CUDA(cudaStreamDestroy(s));
}

TEST_CASE(legacy_stream_synchronizes_with_blocking_streams) {
  Reset reset;
  cudaStream_t blocking = nullptr;
  cudaStream_t nonblocking = nullptr;
  CHECK_CUDA(cudaStreamCreate(&blocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
  void* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, 4096));
  Gate gate;
  CHECK_CUDA(cudaLaunchHostFunc(blocking, Gate::wait_cb, &gate));
  // Work on stream 0 waits for the blocking stream ...
  CHECK_CUDA(cudaMemsetAsync(dev, 1, 4096, nullptr));
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK_CUDA_EQ(cudaStreamQuery(nullptr), cudaErrorNotReady);
  // ... but a non-blocking stream does not wait for stream 0.
  CHECK_CUDA(cudaMemsetAsync(dev, 2, 16, nonblocking));
  CHECK_CUDA(cudaStreamSynchronize(nonblocking));
  gate.release();
  CHECK_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
  CHECK(static_cast<unsigned char*>(dev)[100] == 1);
  // cudaStreamPerThread is a stream of its own that works like any other.
  CHECK_CUDA(cudaMemsetAsync(dev, 3, 4096, cudaStreamPerThread));
  CHECK_CUDA(cudaStreamSynchronize(cudaStreamPerThread));
  CHECK(static_cast<unsigned char*>(dev)[4095] == 3);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaFree(dev));
  CHECK_CUDA(cudaStreamDestroy(blocking));
  CHECK_CUDA(cudaStreamDestroy(nonblocking));
}

TEST_CASE(capacity_and_mem_get_info) {
  Reset reset;
  const size_t old_capacity = simgpu_capacity(0);
  const size_t base = simgpu_device_bytes_in_use(0);
  CHECK_CUDA(simgpu_set_capacity(0, base + (1 << 20)));
  void* a = nullptr;
  void* b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, 768 << 10));
  CHECK_CUDA_EQ(cudaMalloc(&b, 512 << 10), cudaErrorMemoryAllocation);
  CHECK(b == nullptr);
  CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
  CHECK(cudaGetLastError() == cudaSuccess);
  size_t free_b = 0;
  size_t total_b = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  CHECK(total_b == base + (1 << 20));
  CHECK(free_b == (256 << 10));
  CHECK_CUDA(cudaMalloc(&b, 256 << 10)); // exactly fits
  CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  CHECK(free_b == 0);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK(simgpu_device_bytes_in_use(0) == base);
  CHECK_CUDA(simgpu_set_capacity(0, old_capacity));
  // Zero-byte allocations succeed with NULL, like CUDA.
  CHECK_CUDA(cudaMalloc(&a, 0));
  CHECK(a == nullptr);
  // Freeing something that is not an allocation start is an error.
  CHECK_CUDA(cudaMalloc(&a, 1024));
  CHECK_CUDA_EQ(cudaFree(static_cast<char*>(a) + 16), cudaErrorInvalidValue);
  CHECK_CUDA(cudaFree(a));
  (void)cudaGetLastError();
}

TEST_CASE(fault_injection) {
  Reset reset;
  simgpu_reset_counters();
  void* p[3] = {nullptr, nullptr, nullptr};
  simgpu_fail_nth_device_alloc(2);
  CHECK_CUDA(cudaMalloc(&p[0], 4096));
  CHECK_CUDA_EQ(cudaMalloc(&p[1], 4096), cudaErrorMemoryAllocation);
  CHECK(std::strstr(simgpu_last_error_detail(), "injected") != nullptr);
  CHECK_CUDA(cudaMalloc(&p[2], 4096));
  CHECK(simgpu_faults_fired() == 1);

  void* h = nullptr;
  simgpu_fail_nth_host_alloc(1);
  CHECK_CUDA_EQ(cudaHostAlloc(&h, 4096, 0), cudaErrorMemoryAllocation);
  CHECK_CUDA(cudaHostAlloc(&h, 4096, 0));

  // Two consecutive copy failures with a chosen code, starting at the first.
  simgpu_inject_fault(SIMGPU_FAULT_COPY, 1, 2, cudaErrorLaunchFailure);
  CHECK_CUDA_EQ(
      cudaMemcpy(p[0], h, 4096, cudaMemcpyHostToDevice),
      cudaErrorLaunchFailure);
  CHECK_CUDA_EQ(
      cudaMemcpyAsync(h, p[0], 4096, cudaMemcpyDeviceToHost, nullptr),
      cudaErrorLaunchFailure);
  CHECK_CUDA(cudaMemcpy(p[0], h, 4096, cudaMemcpyHostToDevice));
  CHECK(simgpu_faults_fired() == 4);

  // Failing forever until disarmed.
  simgpu_inject_fault(SIMGPU_FAULT_DEVICE_ALLOC, 1, -1, cudaSuccess);
  for (int i = 0; i < 5; ++i) {
    void* q = nullptr;
    CHECK_CUDA_EQ(cudaMalloc(&q, 64), cudaErrorMemoryAllocation);
  }
  simgpu_clear_faults();
  CHECK_CUDA(cudaMalloc(&p[1], 64));
  (void)cudaGetLastError();
  for (void* q : p) {
    CHECK_CUDA(cudaFree(q));
  }
  CHECK_CUDA(cudaFreeHost(h));
}

TEST_CASE(statistics) {
  Reset reset;
  simgpu_reset_counters();
  const size_t dev_base = simgpu_device_bytes_in_use(0);
  const size_t host_base = simgpu_host_bytes_in_use();
  void* d1 = nullptr;
  void* d2 = nullptr;
  void* h = nullptr;
  CHECK_CUDA(cudaMalloc(&d1, 1000));
  CHECK_CUDA(cudaMalloc(&d2, 3000));
  CHECK_CUDA(cudaHostAlloc(&h, 5000, cudaHostAllocPortable));
  CHECK(simgpu_device_bytes_in_use(0) == dev_base + 4000);
  CHECK(simgpu_host_bytes_in_use() == host_base + 5000);
  CHECK_CUDA(cudaMemcpy(d1, h, 1000, cudaMemcpyDefault));
  CHECK_CUDA(cudaMemcpy(h, d2, 3000, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(d2, d1, 1000, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaFree(d2));
  simgpu_device_stats st{};
  CHECK_CUDA(simgpu_get_device_stats(0, &st));
  CHECK(st.bytes_in_use == dev_base + 1000);
  CHECK(st.bytes_peak == dev_base + 4000);
  CHECK(st.alloc_count == 2 && st.free_count == 1);
  CHECK(st.copies_h2d == 1 && st.bytes_h2d == 1000);
  CHECK(st.copies_d2h == 1 && st.bytes_d2h == 3000);
  CHECK(st.copies_d2d == 1 && st.bytes_d2d == 1000);
  simgpu_reset_counters();
  CHECK(simgpu_device_bytes_peak(0) == dev_base + 1000);
  CHECK(simgpu_host_bytes_peak() == host_base + 5000);
  CHECK_CUDA(cudaFree(d1));
  CHECK_CUDA(cudaFreeHost(h));
  CHECK(simgpu_host_bytes_in_use() == host_base);
  // Copies are checked against allocation bounds and the stated kind.
  CHECK_CUDA(cudaMalloc(&d1, 100));
  char buf[200];
  CHECK_CUDA_EQ(
      cudaMemcpy(d1, buf, 200, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  CHECK_CUDA_EQ(
      cudaMemcpy(buf, d1, 100, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  CHECK_CUDA(cudaMemcpy(buf, d1, 100, cudaMemcpyDeviceToHost)); // pageable
  CHECK_CUDA(cudaFree(d1));
  (void)cudaGetLastError();
}

TEST_CASE(runtime_calls_are_counted_once_each) {
  Reset reset;
  cudaEvent_t event = nullptr;
  CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  simgpu_reset_counters();
  CHECK(simgpu_call_count("cudaEventRecord") == 0);
  for (int i = 0; i < 3; ++i) {
    CHECK_CUDA(cudaEventRecord(event, nullptr));
  }
  CHECK_CUDA(cudaEventSynchronize(event));
  CHECK_CUDA(cudaEventQuery(event));
  // cudaEventRecord is made of cudaEventRecordWithFlags: counted once.
  CHECK(simgpu_call_count("cudaEventRecord") == 3);
  CHECK(simgpu_call_count("cudaEventRecordWithFlags") == 0);
  CHECK(simgpu_call_count("cudaEventQuery") == 1);
  CHECK(simgpu_call_count("cudaNoSuchFunction") == 0);
  CHECK(simgpu_call_count(nullptr) == 0);
  simgpu_call_entry entries[2];
  CHECK(simgpu_call_counts(entries, 2) == 3);
  CHECK(std::string(entries[0].function) == "cudaEventRecord");
  CHECK(entries[0].calls == 3);
  CHECK(entries[1].calls == 1);
  CHECK(simgpu_call_counts(nullptr, 0) == 3);
  simgpu_reset_counters();
  CHECK(simgpu_call_count("cudaEventRecord") == 0);
  CHECK(simgpu_call_counts(nullptr, 0) == 0);
  CHECK_CUDA(cudaEventDestroy(event));
}

TEST_CASE(pointer_attributes_and_registration) {
  Reset reset;
  void* d = nullptr;
  void* h = nullptr;
  CHECK_CUDA(cudaMalloc(&d, 1024));
  CHECK_CUDA(cudaMallocHost(&h, 1024));
  cudaPointerAttributes a;
  CHECK_CUDA(cudaPointerGetAttributes(&a, static_cast<char*>(d) + 10));
  CHECK(a.type == cudaMemoryTypeDevice && a.device == 0);
  CHECK_CUDA(cudaPointerGetAttributes(&a, h));
  CHECK(a.type == cudaMemoryTypeHost && a.hostPointer == h);
  std::vector<char> pageable(8192);
  CHECK_CUDA(cudaPointerGetAttributes(&a, pageable.data()));
  CHECK(a.type == cudaMemoryTypeUnregistered);
  CHECK_CUDA(cudaHostRegister(pageable.data(), pageable.size(), 0));
  CHECK_CUDA_EQ(
      cudaHostRegister(pageable.data() + 100, 10, 0),
      cudaErrorHostMemoryAlreadyRegistered);
  CHECK_CUDA(cudaPointerGetAttributes(&a, pageable.data() + 4000));
  CHECK(a.type == cudaMemoryTypeHost);
  void* mapped = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(&mapped, pageable.data(), 0));
  CHECK(mapped == pageable.data());
  CHECK_CUDA(cudaHostUnregister(pageable.data()));
  CHECK_CUDA_EQ(
      cudaHostUnregister(pageable.data()), cudaErrorHostMemoryNotRegistered);
  CHECK_CUDA(cudaFree(d));
  CHECK_CUDA(cudaFreeHost(h));
  // No peers, no IPC.
  int can = 1;
  CHECK_CUDA(cudaDeviceCanAccessPeer(&can, 0, 0));
  CHECK(can == 0);
  cudaIpcMemHandle_t handle;
  CHECK_CUDA_EQ(cudaIpcGetMemHandle(&handle, d), cudaErrorNotSupported);
  CHECK(std::strlen(simgpu_last_error_detail()) > 0);
  (void)cudaGetLastError();
}

TEST_CASE(stream_ordered_allocation) {
  Reset reset;
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t base = simgpu_device_bytes_in_use(0);
  void* p = nullptr;
  CHECK_CUDA(cudaMallocAsync(&p, 1 << 20, s));
  CHECK(simgpu_device_bytes_in_use(0) == base + (1 << 20));
  cudaMemPool_t pool = nullptr;
  CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, 0));
  uint64_t used = 0;
  CHECK_CUDA(
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  CHECK(used == (1 << 20));
  Gate gate;
  CHECK_CUDA(cudaLaunchHostFunc(s, Gate::wait_cb, &gate));
  CHECK_CUDA(cudaFreeAsync(p, s));
  CHECK_CUDA_EQ(cudaFreeAsync(p, s), cudaErrorInvalidValue); // double free
  // Still allocated until the stream reaches the free.
  CHECK(simgpu_device_bytes_in_use(0) == base + (1 << 20));
  gate.release();
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK(simgpu_device_bytes_in_use(0) == base);
  CHECK_CUDA(cudaStreamDestroy(s));
  (void)cudaGetLastError();
}

// A stream reports a capture under way while the test says so, and its work
// still runs; other streams are not capturing.
TEST_CASE(capture_status_follows_set_capturing) {
  Reset reset;
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  CHECK_CUDA(cudaStreamIsCapturing(s, &status));
  CHECK(status == cudaStreamCaptureStatusNone);
  CHECK_CUDA(simgpu_set_capturing(s, 1));
  CHECK_CUDA(cudaStreamIsCapturing(s, &status));
  CHECK(status == cudaStreamCaptureStatusActive);
  unsigned long long id = 0;
  CHECK_CUDA(cudaStreamGetCaptureInfo(s, &status, &id));
  CHECK(status == cudaStreamCaptureStatusActive && id != 0);
  CHECK_CUDA(cudaStreamIsCapturing(nullptr, &status));
  CHECK(status == cudaStreamCaptureStatusNone);
  int value = 0;
  CHECK_CUDA(cudaLaunchHostFunc(
      s, [](void* p) { *static_cast<int*>(p) = 1; }, &value));
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK(value == 1);
  CHECK_CUDA(simgpu_set_capturing(s, 0));
  CHECK_CUDA(cudaStreamIsCapturing(s, &status));
  CHECK(status == cudaStreamCaptureStatusNone);
  CHECK_CUDA(cudaStreamDestroy(s));
  CHECK_CUDA_EQ(simgpu_set_capturing(s, 1), cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
}

TEST_CASE(copy_bandwidth_simulation) {
  Reset reset;
  const size_t n = 8 << 20;
  void* d = nullptr;
  void* h = nullptr;
  CHECK_CUDA(cudaMalloc(&d, n));
  CHECK_CUDA(cudaMallocHost(&h, n));
  simgpu_set_copy_bandwidth(1e9); // 8 MiB at 1 GB/s: about 8.4 ms
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreate(&s));
  cudaEvent_t a = nullptr;
  cudaEvent_t b = nullptr;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  const auto t0 = Clock::now();
  CHECK_CUDA(cudaEventRecord(a, s));
  CHECK_CUDA(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s));
  CHECK_CUDA(cudaEventRecord(b, s));
  const auto issue = Clock::now() - t0;
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  CHECK(ms >= 8.0f);
  CHECK(issue < std::chrono::milliseconds(8)); // the host did not wait
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  CHECK_CUDA(cudaStreamDestroy(s));
  CHECK_CUDA(cudaFree(d));
  CHECK_CUDA(cudaFreeHost(h));
}

TEST_CASE(multi_device) {
  Reset reset;
  if (simgpu_device_count() < 2) {
    std::printf("  (one device: set SIMGPU_DEVICE_COUNT=2 to run this)\n");
    return;
  }
  void* d0 = nullptr;
  void* d1 = nullptr;
  CHECK_CUDA(cudaMalloc(&d0, 4096));
  CHECK_CUDA(cudaSetDevice(1));
  CHECK_CUDA(cudaMalloc(&d1, 4096));
  cudaStream_t s1 = nullptr;
  CHECK_CUDA(cudaStreamCreate(&s1));
  int dev = -1;
  CHECK_CUDA(cudaStreamGetDevice(s1, &dev));
  CHECK(dev == 1);
  cudaPointerAttributes a;
  CHECK_CUDA(cudaPointerGetAttributes(&a, d1));
  CHECK(a.device == 1);
  CHECK(simgpu_device_bytes_in_use(1) >= 4096);
  CHECK_CUDA(cudaSetDevice(0));
  cudaEvent_t e0 = nullptr;
  CHECK_CUDA(cudaEventCreate(&e0));
  // An event records only on a stream of its own device ...
  CHECK_CUDA_EQ(cudaEventRecord(e0, s1), cudaErrorInvalidResourceHandle);
  // ... but any stream may wait for it.
  CHECK_CUDA(cudaMemsetAsync(d0, 7, 4096, nullptr));
  CHECK_CUDA(cudaEventRecord(e0, nullptr));
  CHECK_CUDA(cudaStreamWaitEvent(s1, e0, 0));
  CHECK_CUDA(cudaMemcpyPeerAsync(d1, 1, d0, 0, 4096, s1));
  CHECK_CUDA_EQ(
      cudaMemcpyPeerAsync(d1, 0, d0, 0, 4096, s1), cudaErrorInvalidValue);
  CHECK_CUDA(cudaStreamSynchronize(s1));
  CHECK(static_cast<unsigned char*>(d1)[4095] == 7);
  CHECK_CUDA_EQ(
      cudaDeviceEnablePeerAccess(1, 0), cudaErrorPeerAccessUnsupported);
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaStreamDestroy(s1));
  CHECK_CUDA(cudaFree(d0));
  CHECK_CUDA(cudaFree(d1));
  (void)cudaGetLastError();
}

TEST_CASE(concurrent_threads) {
  Reset reset;
  const size_t base = simgpu_device_bytes_in_use(0);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &errors] {
      cudaStream_t s = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        ++errors;
        return;
      }
      std::vector<unsigned char> out(4096);
      void* h = nullptr;
      if (cudaMallocHost(&h, 4096) != cudaSuccess) {
        ++errors;
        return;
      }
      for (int i = 0; i < 200; ++i) {
        void* d = nullptr;
        const int value = (t * 31 + i) & 0xFF;
        std::memset(h, value, 4096);
        if (cudaMalloc(&d, 4096) != cudaSuccess ||
            cudaMemcpyAsync(d, h, 4096, cudaMemcpyHostToDevice, s) !=
                cudaSuccess ||
            cudaMemcpyAsync(out.data(), d, 4096, cudaMemcpyDeviceToHost, s) !=
                cudaSuccess ||
            cudaStreamSynchronize(s) != cudaSuccess || out[4095] != value ||
            cudaFree(d) != cudaSuccess) {
          ++errors;
        }
      }
      (void)cudaFreeHost(h);
      (void)cudaStreamDestroy(s);
    });
  }
  for (std::thread& th : threads) {
    th.join();
  }
  CHECK(errors == 0);
  CHECK(simgpu_device_bytes_in_use(0) == base);
}

int main() {
  return simgpu_test::run_all();
}
