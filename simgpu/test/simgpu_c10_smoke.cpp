// The tag's unpatched c10_cuda on simgpu: device discovery, the caching
// allocator's alloc/free/cache/stats paths, stream-ordered use, and its
// out-of-memory handling against simgpu's capacity and injected faults.
// The standalone build links standalone/support/c10_cuda_hooks.cpp, which
// installs the hook ATen would give c10_cuda.

#include "harness.h"

#include <simgpu.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <c10_compat.h>

#include <cstring>
#include <string>
#include <vector>

namespace alloc = c10::cuda::CUDACachingAllocator;

namespace {

constexpr size_t kMiB = size_t(1) << 20;
constexpr auto kAgg = static_cast<size_t>(lms_compat::StatType::AGGREGATE);

lms_compat::DeviceStats stats(c10::DeviceIndex d = 0) {
  return alloc::getDeviceStats(d);
}

// Every case starts from an empty cache and full capacity.
struct Fresh {
  size_t capacity;
  Fresh() : capacity(simgpu_capacity(0)) {
    alloc::emptyCache();
    simgpu_clear_faults();
  }
  ~Fresh() {
    simgpu_clear_faults();
    alloc::emptyCache();
    (void)simgpu_set_capacity(0, capacity);
  }
};

struct Init {
  Init() {
    alloc::init(c10::cuda::device_count());
  }
} init_allocator;

} // namespace

TEST_CASE(c10_sees_simulated_devices) {
  CHECK(c10::cuda::device_count() == simgpu_device_count());
  CHECK(c10::cuda::current_device() == 0);
  CHECK(lms_compat::allocatorName() == "native");
}

TEST_CASE(raw_alloc_roundtrip_and_cache) {
  Fresh fresh;
  const size_t base = simgpu_device_bytes_in_use(0);
  alloc::resetPeakStats(0);
  void* p = alloc::raw_alloc(kMiB);
  CHECK(p != nullptr);
  // Allocations of 1 MiB or less come from 2 MiB segments.
  CHECK(simgpu_device_bytes_in_use(0) == base + 2 * kMiB);
  CHECK(stats().allocated_bytes[kAgg].current == int64_t(kMiB));
  CHECK(stats().reserved_bytes[kAgg].current == int64_t(2 * kMiB));
  std::vector<unsigned char> in(kMiB);
  std::vector<unsigned char> out(kMiB);
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<unsigned char>(i * 13);
  }
  CHECK_CUDA(cudaMemcpy(p, in.data(), kMiB, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(out.data(), p, kMiB, cudaMemcpyDeviceToHost));
  CHECK(in == out);
  alloc::raw_delete(p);
  CHECK(stats().allocated_bytes[kAgg].current == 0);
  // Freed blocks stay cached in the allocator ...
  CHECK(simgpu_device_bytes_in_use(0) == base + 2 * kMiB);
  // ... and are reused without a new cudaMalloc.
  void* q = alloc::raw_alloc(512 * 1024);
  CHECK(simgpu_device_bytes_in_use(0) == base + 2 * kMiB);
  alloc::raw_delete(q);
  alloc::emptyCache();
  CHECK(simgpu_device_bytes_in_use(0) == base);
  CHECK(stats().reserved_bytes[kAgg].current == 0);
}

TEST_CASE(stream_ordered_use) {
  Fresh fresh;
  c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  const size_t n = 8 * kMiB;
  void* d = alloc::raw_alloc_with_stream(n, stream.stream());
  void* h = nullptr;
  CHECK_CUDA(cudaMallocHost(&h, n));
  std::memset(h, 0x3C, n);
  CHECK_CUDA(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cudaMemsetAsync(h, 0, n, stream));
  CHECK_CUDA(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, stream));
  stream.synchronize();
  CHECK(static_cast<unsigned char*>(h)[n - 1] == 0x3C);
  CHECK(stream.query());
  alloc::raw_delete(d);
  CHECK_CUDA(cudaFreeHost(h));
}

TEST_CASE(out_of_memory_beyond_capacity) {
  Fresh fresh;
  const size_t base = simgpu_device_bytes_in_use(0);
  CHECK_CUDA(simgpu_set_capacity(0, base + 64 * kMiB));
  const int64_t ooms = stats().num_ooms;
  bool thrown = false;
  try {
    alloc::raw_alloc(128 * kMiB);
  } catch (const c10::OutOfMemoryError& e) {
    thrown = true;
    CHECK(std::string(e.what()).find("out of memory") != std::string::npos);
  }
  CHECK(thrown);
  CHECK(stats().num_ooms == ooms + 1);
  CHECK(cudaPeekAtLastError() == cudaSuccess); // the allocator cleared it
  // Cached but unused segments are released to satisfy a later request.
  void* a = alloc::raw_alloc(40 * kMiB);
  alloc::raw_delete(a);
  void* b = alloc::raw_alloc(60 * kMiB);
  CHECK(simgpu_device_bytes_in_use(0) <= base + 64 * kMiB);
  // With b live, 40 MiB no longer fits.
  thrown = false;
  try {
    alloc::raw_alloc(40 * kMiB);
  } catch (const c10::OutOfMemoryError&) {
    thrown = true;
  }
  CHECK(thrown);
  alloc::raw_delete(b);
}

TEST_CASE(injected_device_fault_is_retried) {
  Fresh fresh;
  // A cached segment lets the allocator free something and retry.
  void* warm = alloc::raw_alloc(4 * kMiB);
  alloc::raw_delete(warm);
  const int64_t retries = stats().num_alloc_retries;
  simgpu_reset_counters();
  simgpu_fail_nth_device_alloc(1);
  void* p = alloc::raw_alloc(30 * kMiB);
  CHECK(p != nullptr);
  CHECK(simgpu_faults_fired() == 1);
  CHECK(stats().num_alloc_retries == retries + 1);
  alloc::raw_delete(p);
  // A persistent failure surfaces as OutOfMemoryError once nothing cached
  // can serve the request.
  alloc::emptyCache();
  simgpu_inject_fault(SIMGPU_FAULT_DEVICE_ALLOC, 1, -1, cudaSuccess);
  bool thrown = false;
  try {
    alloc::raw_alloc(30 * kMiB);
  } catch (const c10::OutOfMemoryError&) {
    thrown = true;
  }
  CHECK(thrown);
}

TEST_CASE(second_device) {
  if (simgpu_device_count() < 2) {
    std::printf("  (one device: set SIMGPU_DEVICE_COUNT=2 to run this)\n");
    return;
  }
  Fresh fresh;
  {
    c10::cuda::CUDAGuard guard(1);
    CHECK(c10::cuda::current_device() == 1);
    void* p = alloc::raw_alloc(3 * kMiB);
    cudaPointerAttributes a;
    CHECK_CUDA(cudaPointerGetAttributes(&a, p));
    CHECK(a.device == 1);
    CHECK(stats(1).allocated_bytes[kAgg].current == int64_t(3 * kMiB));
    alloc::raw_delete(p);
    alloc::emptyCache();
    CHECK(simgpu_device_bytes_in_use(1) == 0);
  }
  CHECK(c10::cuda::current_device() == 0);
}

int main() {
  return simgpu_test::run_all();
}
