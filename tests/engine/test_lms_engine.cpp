// LMS engine suite: runs against the patched libc10_cuda, on the simulated
// GPU (simgpu) in CI and on a real GPU. Tests that need fault injection or a
// small device capacity skip with a reason on a real GPU.

#include "lms_test.h"
#include "lms_test_allocator.h"
#include "lms_test_data.h"
#include "lms_test_recipes.h"
#include "lms_test_storage.h"

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10_compat.h>
#pragma GCC diagnostic pop

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

// Test-control API of the simulated GPU. Weak: a real CUDA runtime has none
// of these, and the tests that need them skip.
extern "C" {
__attribute__((weak)) void simgpu_fail_nth_device_alloc(int nth);
__attribute__((weak)) void simgpu_fail_nth_host_alloc(int nth);
__attribute__((weak)) void simgpu_fail_nth_copy(int nth);
__attribute__((weak)) void simgpu_inject_fault(
    int kind,
    int nth,
    int count,
    cudaError_t error);
__attribute__((weak)) void simgpu_clear_faults(void);
__attribute__((weak)) size_t simgpu_device_bytes_in_use(int device);
__attribute__((weak)) size_t simgpu_host_bytes_in_use(void);
__attribute__((weak)) void simgpu_set_copy_bandwidth(double bytes_per_second);
__attribute__((weak)) cudaError_t
simgpu_set_capturing(cudaStream_t stream, int capturing);
__attribute__((weak)) size_t simgpu_call_count(const char* function);
}

namespace {

namespace lms = c10::cuda::lms;
namespace cca = c10::cuda::CUDACachingAllocator;
using lms_test::StoragePtr;

constexpr size_t kMiB = 1024 * 1024;
constexpr int kSimFaultDeviceAlloc = 0;

bool simulated() {
  return simgpu_clear_faults != nullptr;
}

void requireSimulated(const char* what) {
  if (!simulated()) {
    SKIP(std::string(what) + " needs the simulated GPU's fault injection");
  }
}

int deviceCount() {
  int n = 0;
  C10_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

size_t allocatedBytes(c10::DeviceIndex device = 0) {
  return static_cast<size_t>(
      lms_compat::aggregate(cca::getDeviceStats(device).allocated_bytes));
}

// Each test starts from the same configuration and, on the way out, checks
// that device and host memory are back to where they started.
class Env {
 public:
  explicit Env(size_t limit, c10::DeviceIndex device = 0) : device_(device) {
    static bool initialized = [] {
      cca::init(deviceCount());
      return true;
    }();
    (void)initialized;
    c10::cuda::set_device(device);
    lms::setEnabled(true);
    lms::setSizeThreshold(1 * kMiB);
    lms::setPrefetchDepth(0);
    lms::setSpeculativeMargin(0);
    for (int d = 0; d < deviceCount(); ++d) {
      lms::setLimit(static_cast<c10::DeviceIndex>(d), limit);
      lms::resetAccumulatedStats(static_cast<c10::DeviceIndex>(d));
      lms::resetPeakStats(static_cast<c10::DeviceIndex>(d));
    }
  }
  Env(const Env&) = delete;
  Env& operator=(const Env&) = delete;

  ~Env() {
    if (simulated()) {
      simgpu_clear_faults();
    }
  }

  // Call after every storage of the test is gone.
  void checkBaseline() {
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    for (int d = 0; d < deviceCount(); ++d) {
      const auto dev = static_cast<c10::DeviceIndex>(d);
      CHECK_EQ(lms::getStats(dev).managed_bytes.current, 0);
      CHECK_EQ(lms::getStats(dev).pagedout_bytes.current, 0);
      CHECK_EQ(lms::getStats(dev).inactive_bytes.current, 0);
      CHECK_EQ(lms::getStats(dev).active_bytes.current, 0);
      CHECK_EQ(lms::getStats(dev).operator_output_bytes.current, 0);
      CHECK_EQ(allocatedBytes(dev), size_t(0));
    }
    cca::emptyCache(); // also releases LMS's idle pinned host buffers
    CHECK_EQ(lms::getStats(device_).host_bytes.current, 0);
    if (simulated()) {
      for (int d = 0; d < deviceCount(); ++d) {
        CHECK_EQ(simgpu_device_bytes_in_use(d), size_t(0));
      }
      CHECK_EQ(simgpu_host_bytes_in_use(), size_t(0));
    }
  }

 private:
  c10::DeviceIndex device_;
};

using lms_test::newStorage;

using lms_test::pattern;

using lms_test::matches;
using lms_test::stream;
using lms_test::write;

// An out-of-memory error as the engine would raise it.
std::exception_ptr oomError(const char* message) {
  try {
    TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

lms::StorageState state(const StoragePtr& s) {
  return lms::getState(*s);
}

// ---------------------------------------------------------------------------

TEST_CASE(config_options_parse_and_reject_bad_values) {
  Env env(64 * kMiB);
  lms::parseConfig("expandable_segments:False, lms_size_mb:0.5,lms_prefetch:3");
  CHECK_EQ(lms::getSizeThreshold(), size_t(512 * 1024));
  CHECK_EQ(lms::getPrefetchDepth(), 3);
  CHECK(lms::parseConfigOption("lms_speculative_mb", "8"));
  CHECK_EQ(lms::getSpeculativeMargin(), 8 * kMiB);
  CHECK(!lms::parseConfigOption("max_split_size_mb", "64"));
  CHECK(lms::parseConfigOption("lms_pack", "False"));
  CHECK(!lms::isPackingEnabled());
  CHECK(lms::parseConfigOption("lms_pack", "True"));
  CHECK(lms::isPackingEnabled());
  CHECK_THROWS_AS(
      lms::parseConfigOption("lms", "yes"), c10::Error, "True or False");
  CHECK_THROWS_AS(
      lms::parseConfigOption("lms_limit_mb", "-1"),
      c10::Error,
      "non-negative number");
  CHECK_THROWS_AS(
      lms::parseConfigOption("lms_prefetch", "1.5"),
      c10::Error,
      "whole number");
  CHECK_THROWS_AS(lms::setPrefetchDepth(-1), c10::Error, ">= 0");
}

TEST_CASE(small_storages_and_lms_off_are_unmanaged) {
  Env env(64 * kMiB);
  {
    auto small = newStorage(256 * 1024);
    CHECK(state(small) == lms::StorageState::Unmanaged);
    lms::setEnabled(false);
    auto off = newStorage(4 * kMiB);
    lms::setEnabled(true);
    CHECK(state(off) == lms::StorageState::Unmanaged);
    auto managed = newStorage(4 * kMiB);
    CHECK(state(managed) == lms::StorageState::Allocated);
    CHECK_EQ(lms::getStats(0).managed_bytes.current, int64_t(4 * kMiB));
  }
  env.checkBaseline();
}

TEST_CASE(state_machine_transitions) {
  Env env(64 * kMiB);
  {
    auto s = newStorage(2 * kMiB);
    CHECK(state(s) == lms::StorageState::Allocated);
    lms::pin(*s);
    lms::pin(*s);
    CHECK(state(s) == lms::StorageState::Active);
    lms::unpin(*s);
    CHECK(state(s) == lms::StorageState::Active); // still pinned once
    lms::unpin(*s);
    CHECK(state(s) == lms::StorageState::Inactive);
    CHECK_THROWS_AS(lms::unpin(*s), c10::Error, "not pinned");
    CHECK_EQ(lms::reclaimInactive(0), 2 * kMiB);
    CHECK(state(s) == lms::StorageState::PagedOut);
    lms::pin(*s);
    CHECK(state(s) == lms::StorageState::Active);
    lms::unpin(*s);
    CHECK(state(s) == lms::StorageState::Inactive);
  }
  env.checkBaseline();
}

TEST_CASE(contents_bit_identical_after_thousands_of_cycles) {
  Env env(24 * kMiB);
  {
    std::mt19937_64 rng(1234);
    std::vector<StoragePtr> storages;
    std::vector<uint64_t> seeds;
    for (int i = 0; i < 40; ++i) {
      const size_t bytes = (1 + rng() % 2) * kMiB + 512 * (rng() % 8);
      storages.push_back(newStorage(bytes));
      seeds.push_back(rng());
      write(*storages.back(), seeds.back());
    }
    int mismatches = 0;
    for (int iter = 0; iter < 2000; ++iter) {
      const size_t i = rng() % storages.size();
      switch (rng() % 3) {
        case 0:
          mismatches += !matches(*storages[i], seeds[i]);
          break;
        case 1:
          seeds[i] = rng();
          write(*storages[i], seeds[i]);
          break;
        case 2: {
          // Two storages pinned at once, as by a binary operator.
          const size_t j =
              (i + 1 + rng() % (storages.size() - 1)) % storages.size();
          lms::pin(*storages[j]);
          mismatches += !matches(*storages[i], seeds[i]);
          lms::unpin(*storages[j]);
          break;
        }
      }
    }
    for (size_t i = 0; i < storages.size(); ++i) {
      mismatches += !matches(*storages[i], seeds[i]);
    }
    CHECK_EQ(mismatches, 0);
    const auto st = lms::getStats(0);
    CHECK(st.pageout_count > 1000);
    CHECK(st.pagein_count > 1000);
    std::printf(
        "  %lld page-outs (%lld MiB), %lld page-ins (%lld MiB)\n",
        static_cast<long long>(st.pageout_count),
        static_cast<long long>(st.pageout_bytes / kMiB),
        static_cast<long long>(st.pagein_count),
        static_cast<long long>(st.pagein_bytes / kMiB));
  }
  env.checkBaseline();
}

TEST_CASE(device_memory_stays_under_limit_plus_pinned_working_set) {
  const size_t limit = 16 * kMiB;
  Env env(limit);
  {
    std::mt19937_64 rng(7);
    std::vector<StoragePtr> storages;
    size_t worst_excess = 0;
    for (int i = 0; i < 300; ++i) {
      if (storages.size() < 30) {
        storages.push_back(newStorage((1 + rng() % 3) * kMiB));
        write(*storages.back(), i);
      }
      // An "operator" pinning two or three inputs.
      std::vector<StoragePtr> inputs;
      size_t pinned = 0;
      for (int k = 0; k < 2 + static_cast<int>(rng() % 2); ++k) {
        auto s = storages[rng() % storages.size()];
        lms::pin(*s);
        inputs.push_back(s);
        pinned += s->nbytes();
      }
      const size_t allocated = allocatedBytes();
      CHECK_LE(allocated, limit + pinned);
      worst_excess = std::max(
          worst_excess, allocated > limit ? allocated - limit : size_t(0));
      for (auto& s : inputs) {
        lms::unpin(*s);
      }
      if (rng() % 4 == 0) {
        storages.erase(storages.begin() + rng() % storages.size());
      }
    }
    CHECK(lms::getStats(0).reclaim_limit > 0);
    std::printf(
        "  worst excess over the limit: %.1f MiB (pinned inputs)\n",
        static_cast<double>(worst_excess) / kMiB);
  }
  env.checkBaseline();
}

TEST_CASE(reclaim_is_lru_and_honours_size_threshold) {
  Env env(64 * kMiB);
  {
    auto a = newStorage(2 * kMiB);
    auto b = newStorage(2 * kMiB);
    auto small = newStorage(512 * 1024); // below the 1 MiB threshold
    auto c = newStorage(2 * kMiB);
    write(*a, 10);
    write(*b, 11);
    write(*small, 12);
    write(*c, 13);
    // LRU order is now a, b, c. Touching a makes b the oldest.
    write(*a, 1);
    const size_t used = allocatedBytes();
    // Room for exactly one more 2 MiB storage without reclaim.
    lms::setLimit(0, used + 2 * kMiB);
    auto d = newStorage(2 * kMiB);
    CHECK(state(b) == lms::StorageState::Inactive);
    write(*d, 2);
    auto e = newStorage(2 * kMiB); // must page out the LRU victim: b
    CHECK(state(b) == lms::StorageState::PagedOut);
    CHECK(state(c) == lms::StorageState::Inactive);
    CHECK(state(a) == lms::StorageState::Inactive);
    write(*e, 3);
    auto f = newStorage(2 * kMiB); // next victim: c
    CHECK(state(c) == lms::StorageState::PagedOut);
    CHECK(state(a) == lms::StorageState::Inactive);
    // A threshold above every size leaves nothing reclaimable.
    lms::setSizeThreshold(64 * kMiB);
    CHECK_EQ(lms::reclaimInactive(0), size_t(0));
    lms::setSizeThreshold(1 * kMiB);
    // a, d and e are inactive; f was never used by an operator.
    CHECK_EQ(lms::reclaimInactive(0), 3 * 2 * kMiB);
    CHECK(state(small) == lms::StorageState::Unmanaged);
    CHECK(state(e) == lms::StorageState::PagedOut);
    CHECK(state(f) == lms::StorageState::Allocated); // never pinned
    CHECK(matches(*a, 1));
    CHECK(matches(*b, 11));
    CHECK(matches(*small, 12));
    CHECK(matches(*c, 13));
    CHECK(matches(*d, 2));
    CHECK(matches(*e, 3));
  }
  env.checkBaseline();
}

TEST_CASE(statistics_match_what_happened) {
  Env env(64 * kMiB);
  {
    std::vector<StoragePtr> s;
    for (int i = 0; i < 4; ++i) {
      s.push_back(newStorage(3 * kMiB));
      write(*s.back(), i);
    }
    auto st = lms::getStats(0);
    CHECK_EQ(st.pageout_count, 0);
    CHECK_EQ(st.inactive_bytes.current, int64_t(12 * kMiB));
    CHECK_EQ(st.managed_bytes.current, int64_t(12 * kMiB));
    CHECK_EQ(lms::reclaimInactive(0), 12 * kMiB);
    st = lms::getStats(0);
    CHECK_EQ(st.pageout_count, 4);
    CHECK_EQ(st.pageout_bytes, int64_t(12 * kMiB));
    CHECK_EQ(st.reclaim_explicit, 1);
    CHECK_EQ(st.pagedout_bytes.current, int64_t(12 * kMiB));
    CHECK_EQ(st.inactive_bytes.current, 0);
    CHECK(st.host_bytes.current >= int64_t(12 * kMiB));
    lms::pin(*s[0]);
    lms::pin(*s[1]);
    st = lms::getStats(0);
    CHECK_EQ(st.pagein_count, 2);
    CHECK_EQ(st.pagein_bytes, int64_t(6 * kMiB));
    CHECK_EQ(st.active_bytes.current, int64_t(6 * kMiB));
    CHECK_EQ(st.pagedout_bytes.current, int64_t(6 * kMiB));
    lms::unpin(*s[0]);
    lms::unpin(*s[1]);
    s.clear();
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    st = lms::getStats(0);
    CHECK_EQ(st.managed_bytes.current, 0);
    CHECK_EQ(st.managed_bytes.peak, int64_t(12 * kMiB));
    CHECK_EQ(st.pagedout_bytes.peak, int64_t(12 * kMiB));
    CHECK(st.stall_ms >= 0.0);
    CHECK(st.alloc_from_cache + st.alloc_from_device > 0);
  }
  env.checkBaseline();
}

TEST_CASE(raw_access_pages_in_and_leaves_reclaim_list) {
  Env env(64 * kMiB);
  {
    auto s = newStorage(2 * kMiB);
    write(*s, 42);
    lms::reclaimInactive(0);
    REQUIRE(state(s) == lms::StorageState::PagedOut);
    // Raw access goes through the StorageImpl hook in a patched build.
#ifdef C10_LMS_STORAGE_HOOK
    CHECK(s->lms_armed());
    const void* p = s->data();
    CHECK(!s->lms_armed());
#else
    lms::access(*s);
    const void* p = s->data();
#endif
    CHECK(p != nullptr);
    CHECK(state(s) == lms::StorageState::Allocated);
    CHECK_EQ(lms::reclaimInactive(0), size_t(0)); // off the reclaim list
    std::vector<uint64_t> got(2 * kMiB / 8);
    C10_CUDA_CHECK(cudaMemcpy(got.data(), p, 2 * kMiB, cudaMemcpyDeviceToHost));
    CHECK(got == pattern(2 * kMiB, 42));
  }
  env.checkBaseline();
}

void sleepOnStream(void* ms) {
  std::this_thread::sleep_for(
      std::chrono::milliseconds(reinterpret_cast<uintptr_t>(ms)));
}

// A storage written on a side stream must not be paged out before that work
// is done: the page-out would copy stale contents.
void checkSideStreamOrdering(bool use_record_stream) {
  Env env(64 * kMiB);
  {
    auto s = newStorage(4 * kMiB);
    write(*s, 1);
    const auto fresh = pattern(4 * kMiB, 2);
    void* src = cca::raw_alloc(4 * kMiB);
    C10_CUDA_CHECK(
        cudaMemcpy(src, fresh.data(), 4 * kMiB, cudaMemcpyHostToDevice));
    auto side = c10::cuda::getStreamFromPool();
    lms::pin(*s);
    {
      c10::cuda::CUDAStreamGuard guard(side);
      // Delay the side stream, then overwrite the storage from it.
      C10_CUDA_CHECK(cudaLaunchHostFunc(
          side.stream(), &sleepOnStream, reinterpret_cast<void*>(200)));
      C10_CUDA_CHECK(cudaMemcpyAsync(
          lms_compat::mutableData(*s),
          src,
          4 * kMiB,
          cudaMemcpyDeviceToDevice,
          side.stream()));
      if (!use_record_stream) {
        lms::unpin(*s); // unpinned on the side stream: recorded as a user
      }
    }
    if (use_record_stream) {
      cca::recordStream(s->data_ptr(), side);
      lms::unpin(*s);
    }
    CHECK_EQ(lms::reclaimInactive(0), 4 * kMiB); // while the side sleeps
    CHECK(matches(*s, 2));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    cca::raw_delete(src);
  }
  env.checkBaseline();
}

TEST_CASE(side_stream_with_record_stream_orders_page_out) {
  checkSideStreamOrdering(/*use_record_stream=*/true);
}

TEST_CASE(side_stream_unpin_orders_page_out) {
  checkSideStreamOrdering(/*use_record_stream=*/false);
}

TEST_CASE(device_allocation_failure_triggers_reclaim) {
  Env env(size_t(1) << 50); // no limit: only the failure trigger
  {
    // Cap what the caching allocator may reserve at 48 MiB.
    const lms_test::AllocatorCap cap(48 * kMiB);
    std::vector<StoragePtr> s;
    for (int i = 0; i < 40; ++i) { // 160 MiB through a 48 MiB device
      s.push_back(newStorage(4 * kMiB));
      write(*s.back(), i);
    }
    const auto st = lms::getStats(0);
    CHECK(st.reclaim_alloc_failure > 0);
    CHECK_EQ(st.reclaim_limit, 0);
    CHECK(st.alloc_after_reclaim > 0);
    int mismatches = 0;
    for (int i = 0; i < 40; ++i) {
      mismatches += !matches(*s[i], i);
    }
    CHECK_EQ(mismatches, 0);
    s.clear();
  }
  env.checkBaseline();
}

// Several processes on one device: memory held outside this process's
// caching allocator (another process, simulated by raw cudaMalloc) shrinks the
// limit, and LMS keeps a headroom of the device free for allocations that do
// not go through the allocator (cuBLAS handles, say).
size_t deviceShareNow(size_t* headroom) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  *headroom = static_cast<size_t>(0.05 * static_cast<double>(total_bytes));
  const size_t reserved = lms::getBackend()->reservedBytes(0);
  return free_bytes + reserved - *headroom;
}

// The device's occupancy is read from the driver at most every 10 ms.
void waitForDeviceSample() {
  std::this_thread::sleep_for(std::chrono::milliseconds(25));
}

TEST_CASE(default_limit_is_the_share_other_processes_leave) {
  requireSimulated("a device whose size the test knows");
  Env env(0); // no limit set: the device share alone
  {
    size_t headroom = 0;
    waitForDeviceSample();
    const size_t alone = deviceShareNow(&headroom);
    CHECK_EQ(lms::getLimit(0), alone);

    // Another process takes 96 MiB: this process's limit shrinks by as much.
    void* other = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&other, 96 * kMiB));
    waitForDeviceSample();
    CHECK_EQ(lms::getLimit(0), alone - 96 * kMiB);

    // Training through more than the share pages out, loses nothing, and
    // leaves the headroom free for allocations outside the allocator. (The
    // storages are over 10 MiB, so each has a segment of its own: blocks of 1
    // to 10 MiB share 20 MiB segments, whose rounding can take up to one
    // segment of the headroom; expandable segments do not round.)
    std::vector<StoragePtr> s;
    for (int i = 0; i < 16; ++i) { // 192 MiB
      s.push_back(newStorage(12 * kMiB));
      write(*s.back(), 500 + i);
    }
    CHECK(lms::getStats(0).reclaim_limit > 0);
    CHECK_LE(allocatedBytes(), lms::getLimit(0));
    void* handle = nullptr; // a library's handle memory, in either process
    CHECK_EQ(cudaMalloc(&handle, headroom / 2), cudaSuccess);
    C10_CUDA_CHECK(cudaFree(handle));
    int mismatches = 0;
    for (int i = 0; i < 16; ++i) {
      mismatches += !matches(*s[i], 500 + i);
    }
    CHECK_EQ(mismatches, 0);

    // The other process ends: the limit grows back.
    C10_CUDA_CHECK(cudaFree(other));
    waitForDeviceSample();
    CHECK_EQ(lms::getLimit(0), deviceShareNow(&headroom));
    CHECK(lms::getLimit(0) > alone - 96 * kMiB);
    s.clear();
  }
  env.checkBaseline();
}

// Trains through 120 MiB of storages, then frees them: the allocator's cache
// holds the memory. Returns what the allocator reserves then.
size_t trainThenFree() {
  {
    std::vector<StoragePtr> s;
    for (int i = 0; i < 30; ++i) {
      s.push_back(newStorage(4 * kMiB));
      write(*s.back(), i);
    }
  }
  const size_t cached = lms::getBackend()->reservedBytes(0);
  CHECK(cached >= 120 * kMiB);
  return cached;
}

TEST_CASE(cached_blocks_go_back_when_another_process_needs_the_device) {
  requireSimulated("a device whose size the test knows");
  Env env(0);
  {
    // This process trains, then frees: its cache holds the memory.
    const size_t cached = trainThenFree();
    // Another process takes what is free and then needs 64 MiB more, which
    // only this process's cache can give.
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    void* other = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&other, free_bytes));
    void* more = nullptr;
    CHECK(cudaMalloc(&more, 64 * kMiB) != cudaSuccess);
    (void)cudaGetLastError();
    // This process's next allocation sees that it holds more than its share
    // and returns its cached free blocks (at most one return per 100 ms).
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    const auto releases = lms::getStats(0).cache_releases;
    auto small = newStorage(1 * kMiB);
    write(*small, 7);
    CHECK_EQ(lms::getStats(0).cache_releases, releases + 1);
    CHECK(lms::getBackend()->reservedBytes(0) < cached);
    CHECK_EQ(cudaMalloc(&more, 64 * kMiB), cudaSuccess);
    CHECK(matches(*small, 7));
    C10_CUDA_CHECK(cudaFree(more));
    C10_CUDA_CHECK(cudaFree(other));
  }
  env.checkBaseline();
}

TEST_CASE(cached_blocks_stay_while_nothing_else_grew) {
  requireSimulated("a device whose size the test knows");
  Env env(0);
  {
    // A process alone: 200 MiB of 4 MiB blocks cached in 20 MiB segments,
    // then a 48 MiB storage no cached segment holds. Reserved passes the
    // share (the device less the 5% headroom) with nothing else on the
    // device; its cache stands in nobody's way.
    CHECK(lms::getBackend()->releaseCachedMemory(0));
    {
      std::vector<StoragePtr> s;
      for (int i = 0; i < 50; ++i) {
        s.push_back(newStorage(4 * kMiB));
        write(*s.back(), i);
      }
    }
    const size_t cached = lms::getBackend()->reservedBytes(0);
    CHECK(cached >= 200 * kMiB);
    auto big = newStorage(48 * kMiB);
    write(*big, 3);
    size_t headroom = 0;
    waitForDeviceSample();
    const size_t reserved = lms::getBackend()->reservedBytes(0);
    CHECK(reserved > deviceShareNow(&headroom));
    const auto releases = lms::getStats(0).cache_releases;
    std::vector<StoragePtr> more;
    for (int i = 0; i < 3; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(110));
      more.push_back(newStorage(1 * kMiB));
      write(*more.back(), i);
    }
    CHECK_EQ(lms::getStats(0).cache_releases, releases);
    CHECK(lms::getBackend()->reservedBytes(0) >= reserved);
    CHECK(matches(*big, 3));
    for (int i = 0; i < 3; ++i) {
      CHECK(matches(*more[i], i));
    }
  }
  env.checkBaseline();
}

TEST_CASE(cached_blocks_stay_under_a_limit_below_the_share) {
  requireSimulated("a device whose size the test knows");
  Env env(0);
  {
    // Start from an empty cache: earlier tests' blocks would fill the share.
    CHECK(lms::getBackend()->releaseCachedMemory(0));
    const size_t cached = trainThenFree();
    // A limit the user set below what the cache holds, with the device free
    // otherwise: the cached blocks stand in nobody's way. Returning them
    // synchronizes the device, which in training would happen every
    // interval and stall it.
    lms::setLimit(0, allocatedBytes() + 16 * kMiB);
    size_t headroom = 0;
    waitForDeviceSample();
    CHECK(cached + 64 * kMiB < deviceShareNow(&headroom));
    const auto releases = lms::getStats(0).cache_releases;
    std::vector<StoragePtr> more;
    for (int i = 0; i < 3; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(110));
      more.push_back(newStorage(8 * kMiB));
      write(*more.back(), i);
    }
    CHECK_EQ(lms::getStats(0).cache_releases, releases);
    CHECK(lms::getBackend()->reservedBytes(0) >= cached);
    for (int i = 0; i < 3; ++i) {
      CHECK(matches(*more[i], i));
    }
  }
  env.checkBaseline();
}

// The allocator's cap, `bytes` above what it keeps once its cache is emptied
// (library memory of earlier cases), for the scope of a case.
class CapAboveBaseline {
 public:
  explicit CapAboveBaseline(size_t bytes) : cap_(emptiedBaseline() + bytes) {}

 private:
  static size_t emptiedBaseline() {
    lms::getBackend()->releaseCachedMemory(0);
    return lms::getBackend()->reservedBytes(0);
  }
  lms_test::AllocatorCap cap_;
};

// A request that fits under the cap by bytes but not beside the segments the
// allocator keeps for the tensors left: a small storage carved out of a large
// cached segment holds it. While that storage is inactive LMS pages it out and
// the allocator can return the segment; while the running operator has it
// pinned nothing can move it, and the error says that the tensors fit by
// bytes and what the allocator keeps mapped for them.
TEST_CASE(a_small_storage_in_a_large_segment_is_paged_out_to_place_a_request) {
  Env env(64 * kMiB);
  for (const bool pinned : {false, true}) {
    const CapAboveBaseline cap(64 * kMiB);
    auto a = newStorage(30 * kMiB);
    auto b = newStorage(30 * kMiB);
    a.reset(); // a's segment stays cached, free
    auto c = newStorage(4 * kMiB); // carved out of a's segment
    write(*c, 7);
    lms::releaseOutput(*c);
    if (pinned) {
      lms::pin(*c); // an input of the running operator
    }
    b.reset();
    bool threw = false;
    try {
      auto d = newStorage(40 * kMiB); // 44 MiB of tensors under the cap
      write(*d, 8);
      CHECK(matches(*d, 8));
    } catch (const c10::OutOfMemoryError& e) {
      threw = true;
      const std::string msg = e.what();
      CHECK(msg.find("The tensors fit by bytes") != std::string::npos);
      CHECK(
          msg.find("40.00 MiB requested <= the allocator's cap") !=
          std::string::npos);
      CHECK(msg.find("mapped for them") != std::string::npos);
      // What would have admitted it: the mapped memory plus the request.
      CHECK(
          msg.find("the allocator's cap would admit it from ") !=
          std::string::npos);
      // The verdict alone, for an operator that catches the error.
      const std::string verdict = lms::lastOutOfMemoryVerdict();
      CHECK(verdict.rfind("The tensors fit by bytes", 0) == 0);
      CHECK(verdict.find(" more).") == verdict.size() - 7);
      CHECK(msg.find(verdict) != std::string::npos);
    }
    CHECK_EQ(threw, pinned);
    if (pinned) {
      lms::unpin(*c);
    } else {
      CHECK(lms::getStats(0).pageout_count > 0);
    }
    CHECK(matches(*c, 7));
    c.reset();
  }
  env.checkBaseline();
}

// What stays mapped while some blocks of a range stay allocated: a segment
// of its own stays whole; an expandable segment keeps every 20 MiB page one of
// them lies in, and a last page shorter than that counts at its size. The
// second layout is the one a cuDNN LSTM backward ran out of memory in
// (stress seed 14): a 16 MiB input, then a 1 MiB block the operator keeps in
// the second page, and an 80 MiB input across five pages.
TEST_CASE(the_pages_that_blocks_still_in_use_keep_mapped) {
  lms::SegmentMap segment;
  segment.blocks = {{4 * kMiB, true}, {26 * kMiB, false}};
  CHECK_EQ(lms::mappedBytesHeld(segment, {true, false}), 30 * kMiB);
  CHECK_EQ(lms::mappedBytesHeld(segment, {false, false}), size_t(0));

  lms::SegmentMap pages;
  pages.page_bytes = 20 * kMiB;
  const size_t tail = 280 * kMiB - (260 * kMiB + 32 * 1024);
  pages.blocks = {
      {16 * kMiB, true}, // input
      {4 * kMiB, false},
      {kMiB + 4096, true}, // kept by the operator
      {15 * kMiB + 28 * 1024, false},
      {32 * kMiB, true},
      {32 * kMiB, true},
      {80 * kMiB, true}, // input
      {16 * kMiB, true},
      {16 * kMiB, true},
      {16 * kMiB, true},
      {16 * kMiB, true},
      {16 * kMiB, true},
      {tail, false}};
  std::vector<bool> held(pages.blocks.size(), false);
  held[0] = held[2] = held[6] = true;
  // Pages 0 and 1, and 5 to 9 (the 80 MiB input runs from 100.03 MiB).
  CHECK_EQ(lms::mappedBytesHeld(pages, held), 7 * 20 * kMiB);

  lms::SegmentMap short_tail;
  short_tail.page_bytes = 20 * kMiB;
  short_tail.blocks = {{20 * kMiB, true}, {25 * kMiB, false}, {5 * kMiB, true}};
  // A block that ends on a page boundary keeps no more; the 10 MiB last page
  // counts 10 MiB.
  CHECK_EQ(lms::mappedBytesHeld(short_tail, {true, false, true}), 30 * kMiB);
  CHECK_EQ(lms::mappedBytesHeld(short_tail, {true, false, false}), 20 * kMiB);
  CHECK_THROWS_AS(
      lms::mappedBytesHeld(short_tail, {true}),
      c10::Error,
      "one flag per block");
}

// Runs operator `name` once as operator-boundary pinning does: a fresh input
// of `input_bytes`, a temporary of `temporary_bytes` allocated and freed inside
// it (none when 0), then `inside_bytes` kept until it ends (none when 0). The
// engine learns what operators of that name allocate.
void runOperator(
    const char* name,
    size_t input_bytes,
    size_t inside_bytes,
    size_t temporary_bytes = 0) {
  auto input = newStorage(input_bytes);
  lms::releaseOutput(*input);
  c10::StorageImpl* inputs[] = {input.get()};
  lms::beginWorkingSet(name, inputs);
  lms::pin(*input);
  if (temporary_bytes > 0) {
    auto temporary = newStorage(temporary_bytes);
  }
  StoragePtr output;
  if (inside_bytes > 0) {
    output = newStorage(inside_bytes);
  }
  lms::unpin(*input);
  lms::endWorkingSet(name);
}

// Starts the working set of operator `name` over `input` where packing must
// leave it: nothing is packed and the input stays resident, not pinned yet.
// Returns the statistics from before, for what the operator pages out next.
lms::LmsStats beginWorkingSetUnpacked(
    const char* name,
    const StoragePtr& input) {
  const auto before = lms::getStats(0);
  c10::StorageImpl* inputs[] = {input.get()};
  lms::beginWorkingSet(name, inputs);
  CHECK_EQ(lms::getStats(0).pack_count, before.pack_count);
  CHECK(state(input) == lms::StorageState::Inactive);
  return before;
}

// Begins operator `name` over `input`, checks that it was packed (the input
// paged out), and returns the statistics from before.
lms::LmsStats beginWorkingSetPacked(const char* name, const StoragePtr& input) {
  const auto before = lms::getStats(0);
  c10::StorageImpl* inputs[] = {input.get()};
  lms::beginWorkingSet(name, inputs);
  CHECK_EQ(lms::getStats(0).pack_count, before.pack_count + 1);
  CHECK(state(input) == lms::StorageState::PagedOut);
  return before;
}

// Input C of a packing test (4 MiB, holding 1) carved out of a free cached
// 30 MiB segment, and X (20 MiB, holding 2) in a segment of its own, both
// inactive: pinned where it is, C keeps its whole segment mapped.
std::pair<StoragePtr, StoragePtr> inputInALargeSegment() {
  auto a = newStorage(30 * kMiB);
  a.reset(); // its segment stays cached, free
  auto c = newStorage(4 * kMiB); // carved out of a's segment
  auto x = newStorage(20 * kMiB);
  write(*c, 1);
  write(*x, 2);
  lms::releaseOutput(*c);
  lms::releaseOutput(*x);
  return std::make_pair(c, x);
}

// Not packed, C pinned in its segment leaves no room for `inside_bytes`.
void checkNoRoomBesidePinnedInput(size_t inside_bytes) {
  auto [c, x] = inputInALargeSegment();
  lms::pin(*c);
  CHECK_THROWS_AS(
      newStorage(inside_bytes), c10::OutOfMemoryError, "fit by bytes");
  lms::unpin(*c);
  CHECK(matches(*c, 1));
  CHECK(matches(*x, 2));
}

// Operator `name` over input C starts packed: C and X go out, C comes back
// into a segment of its own size and `inside_bytes` fit beside it. Returns
// the bytes the pack paged out.
int64_t checkPackedOperatorFits(const char* name, size_t inside_bytes) {
  auto [c, x] = inputInALargeSegment();
  const auto before = lms::getStats(0);
  c10::StorageImpl* inputs[] = {c.get()};
  lms::beginWorkingSet(name, inputs);
  const auto packed = lms::getStats(0);
  CHECK_EQ(packed.pack_count, before.pack_count + 1);
  CHECK(state(c) == lms::StorageState::PagedOut);
  CHECK(state(x) == lms::StorageState::PagedOut);
  lms::pin(*c);
  auto output = newStorage(inside_bytes);
  write(*output, 3);
  CHECK(matches(*c, 1));
  lms::unpin(*c);
  lms::endWorkingSet(name);
  CHECK(matches(*output, 3));
  CHECK(matches(*x, 2));
  return packed.pack_bytes - before.pack_bytes;
}

// An operator expected to need most of the device is packed before it pins
// its inputs. Its 4 MiB input C sits in a 30 MiB segment whose other 26 MiB
// are free, and X (20 MiB, inactive) has a segment of its own. The operator
// allocates 42 MiB inside itself, as it did the first time it ran: 46 MiB of
// tensors under a 64 MiB cap. Pinned where it is, C keeps its 30 MiB segment
// and the 42 MiB cannot be placed beside it even with X paged out. Packed, C
// and X are both paged out and their segments returned; C comes back into a
// segment of its own size, and the 42 MiB fits beside it.
TEST_CASE(an_operator_expected_to_need_most_of_the_device_is_packed_first) {
  Env env(64 * kMiB);
  const char* name = "lms_test::needs_most_of_the_device";
  {
    const CapAboveBaseline cap(64 * kMiB);
    // Its first run, with room: the engine learns what it allocates.
    runOperator(name, 4 * kMiB, 42 * kMiB, /*temporary_bytes=*/8 * kMiB);
    CHECK_EQ(lms::getStats(0).pack_count, 0);
    lms::getBackend()->releaseCachedMemory(0);
    checkNoRoomBesidePinnedInput(42 * kMiB);
    lms::getBackend()->releaseCachedMemory(0);
    { // With packing off, the working set is counted but nothing moves.
      auto [c, x] = inputInALargeSegment();
      lms::setPackingEnabled(false);
      c10::StorageImpl* inputs[] = {c.get()};
      lms::beginWorkingSet(name, inputs);
      lms::setPackingEnabled(true);
      CHECK(state(c) == lms::StorageState::Inactive);
      CHECK(state(x) == lms::StorageState::Inactive);
      lms::endWorkingSet(name);
      CHECK_EQ(lms::getStats(0).pack_count, 0);
    }
    lms::getBackend()->releaseCachedMemory(0);
    CHECK_EQ(checkPackedOperatorFits(name, 42 * kMiB), int64_t(24 * kMiB));
  }
  env.checkBaseline();
}

// Partly used pages can take ten of the allocator's 20 MiB pages whatever the
// limit, so an operator is packed when its working set leaves less than
// 200 MiB of the limit, however small a share of it that is. This one's 4 MiB
// input C sits in a 30 MiB segment, as above, and it allocates 36 MiB inside
// itself: 40 MiB of tensors, two thirds of the limit (95% of the 64 MiB cap),
// under the three quarters at which packing once began. Pinned where it is,
// C keeps its 30 MiB segment and the 36 MiB cannot be placed beside it under
// the cap; packed, C comes back into a segment of its own size.
TEST_CASE(an_operator_leaving_less_than_ten_pages_of_a_small_limit_is_packed) {
  Env env(64 * kMiB);
  const char* name = "lms_test::two_thirds_of_a_small_limit";
  {
    const CapAboveBaseline cap(64 * kMiB);
    runOperator(name, 4 * kMiB, 36 * kMiB); // the engine learns it
    lms::getBackend()->releaseCachedMemory(0);
    checkNoRoomBesidePinnedInput(36 * kMiB);
    lms::getBackend()->releaseCachedMemory(0);
    checkPackedOperatorFits(name, 36 * kMiB);
  }
  env.checkBaseline();
}

// A workspace a library keeps in the caching allocator between calls
// (cuBLAS: one per handle and stream), as the test's releaser sees it.
void* g_library_workspace = nullptr;
int g_workspace_releaser_calls = 0;

void releaseLibraryWorkspace() {
  ++g_workspace_releaser_calls;
  if (g_library_workspace != nullptr) {
    cca::raw_delete(g_library_workspace);
    g_library_workspace = nullptr;
  }
}

// The operator's 4 MiB input C in a 30 MiB segment, and a library's 4 MiB
// workspace carved from the same segment beside it.
StoragePtr inputBesideALibraryWorkspace() {
  auto a = newStorage(30 * kMiB);
  a.reset(); // its segment stays cached, free
  auto c = newStorage(4 * kMiB);
  g_library_workspace = cca::raw_alloc(4 * kMiB);
  write(*c, 1);
  lms::releaseOutput(*c);
  return c;
}

// A library's workspace is an allocation LMS cannot page out. In the segment
// of the operator's input, it keeps that segment mapped through a pack, the
// input comes back into it, and the 42 MiB the operator allocates find no
// room beside it under the 64 MiB cap (46 MiB of tensors and the workspace).
// With a releaser, the pack frees the workspace before it returns the cache:
// the segment goes back to the device, and the 42 MiB fit.
TEST_CASE(a_pack_frees_library_workspaces_that_hold_its_input_segment) {
  Env env(64 * kMiB);
  const char* name = "lms_test::beside_a_library_workspace";
  {
    const CapAboveBaseline cap(64 * kMiB);
    runOperator(name, 4 * kMiB, 42 * kMiB); // the engine learns it
    lms::getBackend()->releaseCachedMemory(0);
    { // No releaser: packed, but the workspace's segment stays (and with
      // host placement off, the request fails).
      auto c = inputBesideALibraryWorkspace();
      const auto before = beginWorkingSetPacked(name, c);
      CHECK_EQ(lms::getStats(0).workspace_releases, before.workspace_releases);
      lms::pin(*c);
      lms::setHostPlacementEnabled(false);
      CHECK_THROWS_AS(
          newStorage(42 * kMiB), c10::OutOfMemoryError, "fit by bytes");
      lms::setHostPlacementEnabled(true);
      lms::unpin(*c);
      lms::endWorkingSet(name);
      CHECK(matches(*c, 1));
      cca::raw_delete(g_library_workspace);
      g_library_workspace = nullptr;
    }
    lms::getBackend()->releaseCachedMemory(0);
    {
      g_workspace_releaser_calls = 0;
      lms::setWorkspaceReleaser(&releaseLibraryWorkspace);
      auto c = inputBesideALibraryWorkspace();
      const auto before = beginWorkingSetPacked(name, c);
      lms::setWorkspaceReleaser(nullptr);
      CHECK_EQ(
          lms::getStats(0).workspace_releases, before.workspace_releases + 1);
      CHECK_EQ(g_workspace_releaser_calls, 1);
      CHECK(g_library_workspace == nullptr);
      lms::pin(*c);
      auto output = newStorage(42 * kMiB);
      write(*output, 3);
      CHECK(matches(*c, 1));
      lms::unpin(*c);
      lms::endWorkingSet(name);
      CHECK(matches(*output, 3));
    }
  }
  env.checkBaseline();
}

// Operator `name`, which allocated `inside_bytes` beside its 40 MiB input C
// the first time it ran, is judged tight under the 128 MiB cap but not
// packed: C stays where it is, and X (40 MiB, inactive) goes out only when
// the operator's allocation needs its room. `prepare` runs after its first
// run, `after_begin` once it has begun again, before it pins C, with the
// statistics from before.
void checkTightOperatorNotPacked(
    const char* name,
    size_t inside_bytes,
    const std::function<void()>& prepare,
    const std::function<void(const lms::LmsStats&)>& after_begin) {
  runOperator(name, 40 * kMiB, inside_bytes); // the engine learns it
  lms::getBackend()->releaseCachedMemory(0);
  prepare();
  auto c = newStorage(40 * kMiB);
  auto x = newStorage(40 * kMiB);
  write(*c, 1);
  write(*x, 2);
  lms::releaseOutput(*x); // used longest ago
  lms::releaseOutput(*c);
  const auto before = beginWorkingSetUnpacked(name, c);
  CHECK(state(x) == lms::StorageState::Inactive);
  after_begin(before);
  lms::pin(*c);
  auto output = newStorage(inside_bytes); // X goes out
  write(*output, 3);
  CHECK(state(x) == lms::StorageState::PagedOut);
  CHECK_EQ(
      lms::getStats(0).pageout_bytes - before.pageout_bytes,
      int64_t(40 * kMiB));
  CHECK(matches(*c, 1));
  lms::unpin(*c);
  lms::endWorkingSet(name);
  CHECK(matches(*output, 3));
  CHECK(matches(*x, 2));
}

// Packing reads the allocator's layout first. The operator of this case is
// as tight as the one that needs most of the device (a 40 MiB input, 60 MiB
// allocated inside itself as it did the first time it ran: 100 MiB of a
// 128 MiB limit), but its input has a segment of its own: once X (40 MiB,
// inactive) is paged out on demand, 40 MiB stay mapped and the 60 MiB fit
// beside them with a 20 MiB page to spare under the limit (95% of the
// 128 MiB cap). Nothing is packed: the operator's input stays where it is,
// and only X goes out, when the operator's allocation needs its room.
TEST_CASE(an_operator_whose_inputs_leave_room_is_not_packed) {
  Env env(128 * kMiB);
  {
    const CapAboveBaseline cap(128 * kMiB);
    checkTightOperatorNotPacked(
        "lms_test::fits_beside_its_inputs",
        60 * kMiB,
        [] {},
        [](const lms::LmsStats&) {});
  }
  env.checkBaseline();
}

// An operator judged tight but not packed frees library workspaces too, so
// that its blocks can take their room: as above, with a library's 512 KiB
// workspace beside, and 56 MiB allocated inside (the workspace's 2 MiB
// segment stays mapped as well). The workspace is freed before the operator
// pins its input.
// checkTightOperatorNotPacked with a library workspace of `workspace_bytes`
// allocated after the operator's first run: it is freed before the operator
// pins its input, and counted once.
void checkTightOperatorFreesWorkspace(
    const char* name,
    size_t inside_bytes,
    size_t workspace_bytes) {
  checkTightOperatorNotPacked(
      name,
      inside_bytes,
      [workspace_bytes] {
        g_library_workspace = cca::raw_alloc(workspace_bytes);
        g_workspace_releaser_calls = 0;
        lms::setWorkspaceReleaser(&releaseLibraryWorkspace);
      },
      [](const lms::LmsStats& before) {
        lms::setWorkspaceReleaser(nullptr);
        CHECK_EQ(g_workspace_releaser_calls, 1);
        CHECK(g_library_workspace == nullptr);
        CHECK_EQ(
            lms::getStats(0).workspace_releases, before.workspace_releases + 1);
      });
}

TEST_CASE(a_tight_operator_that_is_not_packed_frees_library_workspaces) {
  Env env(128 * kMiB);
  {
    const CapAboveBaseline cap(128 * kMiB);
    checkTightOperatorFreesWorkspace(
        "lms_test::tight_beside_a_library_workspace", 56 * kMiB, 512 * 1024);
  }
  env.checkBaseline();
}

// A library's workspace counts among what cannot be paged out only until it
// is freed: an operator whose working set passes the cap with it, and not
// without it, is not given up on. As above, with a 30 MiB workspace: the
// operator's 40 MiB input, the 60 MiB it allocated the first time and the
// workspace pass the 128 MiB cap (130 MiB); without the workspace they fit.
// The workspace is freed before the operator is weighed, and its 60 MiB fit
// beside its input once X goes out; kept, they would not fit under the cap.
TEST_CASE(an_operator_over_the_cap_only_by_library_workspaces_frees_them) {
  Env env(128 * kMiB);
  {
    const CapAboveBaseline cap(128 * kMiB);
    checkTightOperatorFreesWorkspace(
        "lms_test::over_the_cap_with_a_library_workspace",
        60 * kMiB,
        30 * kMiB);
  }
  env.checkBaseline();
}

// Runs the rest of operator `name` once its working set has begun over
// `input` (holding 1): pins it, allocates `blocks`, and ends; then fills each
// block and reads it back.
void finishOperatorOfBlocks(
    const char* name,
    const StoragePtr& input,
    std::initializer_list<size_t> blocks) {
  lms::pin(*input);
  std::vector<StoragePtr> outputs;
  for (const size_t bytes : blocks) {
    outputs.push_back(newStorage(bytes));
  }
  CHECK(matches(*input, 1));
  lms::unpin(*input);
  lms::endWorkingSet(name);
  uint8_t value = 3;
  for (const auto& output : outputs) {
    write(*output, value);
    CHECK(matches(*output, value++));
  }
}

// Each block an operator allocates may leave the segment or page it lands in
// partly used, so the room its layout must leave grows with its blocks. This
// operator's 40 MiB input C has a segment of its own, and the allocator keeps
// three free 26 MiB segments cached. The first time it ran, it allocated four
// blocks (three of 14 MiB, then 20 MiB): 102 MiB of tensors, with one page
// to spare 122 MiB, under the limit (95% of the 134 MiB cap). Not packed,
// its 14 MiB blocks land in the cached segments, one each, and the 36 MiB of
// their free rest, mapped, leave no room for the 20 MiB under the cap. With
// a page spared for each of its four blocks it is packed: the cache goes
// back to the device, and all four fit beside C.
TEST_CASE(an_operator_of_several_blocks_is_spared_a_page_for_each) {
  Env env(134 * kMiB);
  const char* name = "lms_test::four_blocks";
  const std::initializer_list<size_t> blocks = {
      14 * kMiB, 14 * kMiB, 14 * kMiB, 20 * kMiB};
  {
    const CapAboveBaseline cap(134 * kMiB);
    { // Its first run, with room: the engine learns it.
      auto c = newStorage(40 * kMiB);
      write(*c, 1);
      lms::releaseOutput(*c);
      c10::StorageImpl* inputs[] = {c.get()};
      lms::beginWorkingSet(name, inputs);
      finishOperatorOfBlocks(name, c, blocks);
    }
    lms::getBackend()->releaseCachedMemory(0);
    auto c = newStorage(40 * kMiB);
    write(*c, 1);
    {
      auto f1 = newStorage(26 * kMiB);
      auto f2 = newStorage(26 * kMiB);
      auto f3 = newStorage(26 * kMiB);
    } // their segments stay cached, free
    lms::releaseOutput(*c);
    { // Where C lies, the 20 MiB block finds no room under the cap.
      lms::pin(*c);
      auto a = newStorage(14 * kMiB);
      auto b = newStorage(14 * kMiB);
      auto d = newStorage(14 * kMiB);
      CHECK_THROWS_AS(
          newStorage(20 * kMiB), c10::OutOfMemoryError, "fit by bytes");
      lms::unpin(*c);
    }
    beginWorkingSetPacked(name, c);
    finishOperatorOfBlocks(name, c, blocks);
  }
  env.checkBaseline();
}

// One operator name serves calls of different shapes: a matmul that makes a
// language model's logits allocates several times its inputs, the model's
// other matmuls about once. What a call is expected to allocate is what calls
// of its name with inputs of that size allocated: the 40 MiB call below is
// expected to allocate 40 MiB, not nine times its inputs as the 4 MiB call
// did, so it is not tight and nothing is packed.
TEST_CASE(
    an_operator_is_expected_to_allocate_what_it_did_with_inputs_of_that_size) {
  Env env(128 * kMiB);
  const char* name = "lms_test::matmul_of_many_shapes";
  {
    const CapAboveBaseline cap(128 * kMiB);
    runOperator(name, 4 * kMiB, 36 * kMiB); // nine times its inputs
    runOperator(name, 40 * kMiB, 40 * kMiB); // once
    lms::getBackend()->releaseCachedMemory(0);
    auto x = newStorage(60 * kMiB); // inactive: what a pack would page out
    lms::releaseOutput(*x);
    const auto before = lms::getStats(0);
    runOperator(name, 40 * kMiB, 40 * kMiB); // 140 MiB: X goes out on demand
    const auto after = lms::getStats(0);
    CHECK_EQ(after.pack_count, before.pack_count);
    CHECK_EQ(after.pageout_bytes - before.pageout_bytes, int64_t(60 * kMiB));
  }
  env.checkBaseline();
}

// A share per byte of input learned at one size is no floor at another:
// cuDNN picks another algorithm, with another workspace, for another shape.
// This operator allocated as much as its 10 MiB input the first time; its
// 40 MiB input C now sits in a cached 60 MiB segment whose other 20 MiB are
// free, and it allocates 80 MiB. Expected at the share (40 MiB), it fits
// beside C's segment with a page to spare (120 MiB, under the limit: 95% of
// the 128 MiB cap) and is not packed, and the 80 MiB find no room beside the
// segment C keeps. Expected at twice its inputs, as an operator not seen yet
// is, it is packed: C comes back into a segment of its own size, and the
// 80 MiB fit beside it.
TEST_CASE(an_input_size_not_seen_yet_is_expected_at_twice_its_inputs) {
  Env env(128 * kMiB);
  const char* name = "lms_test::another_algorithm_at_another_size";
  {
    const CapAboveBaseline cap(128 * kMiB);
    runOperator(name, 10 * kMiB, 10 * kMiB); // once its inputs
    lms::getBackend()->releaseCachedMemory(0);
    auto c = [] {
      auto a = newStorage(60 * kMiB);
      a.reset(); // its segment stays cached, free
      return newStorage(40 * kMiB); // carved out of a's segment
    }();
    write(*c, 1);
    lms::releaseOutput(*c);
    { // Where C lies, the 80 MiB find no room under the cap.
      lms::pin(*c);
      CHECK_THROWS_AS(
          newStorage(80 * kMiB), c10::OutOfMemoryError, "fit by bytes");
      lms::unpin(*c);
    }
    beginWorkingSetPacked(name, c);
    finishOperatorOfBlocks(name, c, {80 * kMiB});
  }
  env.checkBaseline();
}

// Packing makes room for what an operator allocates beside its inputs: an
// operator that allocates nothing (an optimizer's in-place step) is not
// packed, however tight its inputs, and they stay where they are. Its 100 MiB
// input sits in a 110 MiB segment, which with a page to spare passes the
// limit (95% of the 128 MiB cap): an operator that allocated 1 byte would be
// packed.
TEST_CASE(an_operator_that_allocates_nothing_is_not_packed) {
  Env env(128 * kMiB);
  const char* name = "lms_test::in_place_step";
  {
    const CapAboveBaseline cap(128 * kMiB);
    runOperator(name, 100 * kMiB, 0); // its first run allocates nothing
    lms::getBackend()->releaseCachedMemory(0);
    auto a = newStorage(110 * kMiB);
    a.reset(); // its segment stays cached, free
    auto c = newStorage(100 * kMiB); // carved out of a's segment
    write(*c, 1);
    lms::releaseOutput(*c);
    beginWorkingSetUnpacked(name, c);
    lms::pin(*c);
    CHECK(matches(*c, 1));
    lms::unpin(*c);
    lms::endWorkingSet(name);
  }
  env.checkBaseline();
}

// The tests of runs of blocks below: X (holding 1s) in a segment of its own,
// then Z (holding 2s) at the start of a cached free segment of `run` bytes,
// both inactive and X used longest ago; then a request D (holding 3s), with
// the statistics before and after it.
struct RunCase {
  StoragePtr x;
  StoragePtr z;
  StoragePtr d;
  lms::LmsStats before;
  lms::LmsStats after;

  bool contentsKept() const {
    return matches(*x, 1) && matches(*z, 2) && matches(*d, 3);
  }
};

RunCase requestBesideARun(
    size_t x_bytes,
    size_t run,
    size_t z_bytes,
    size_t request) {
  RunCase c;
  c.x = newStorage(x_bytes);
  auto y = newStorage(run);
  y.reset(); // its segment stays cached, free
  c.z = newStorage(z_bytes); // carved out of y's segment
  write(*c.x, 1);
  write(*c.z, 2);
  lms::releaseOutput(*c.x); // least recently used first
  lms::releaseOutput(*c.z);
  c.before = lms::getStats(0);
  c.d = newStorage(request);
  write(*c.d, 3);
  c.after = lms::getStats(0);
  return c;
}

// A failed allocation pages out the storage that holds the range the request
// fits in, not the least recently used one: X (12 MiB, used longest ago) has
// a segment of its own; Z (4 MiB) sits at the start of an 18 MiB segment whose
// other 14 MiB are free. A 15 MiB request (31 MiB of tensors, 45 MiB of
// segments) fits in Z's segment once Z is out. It is below the size placed
// before the allocator tries it (the next test), so the allocator fails first.
TEST_CASE(a_failed_allocation_pages_out_the_storage_in_its_way) {
  Env env(40 * kMiB);
  {
    const CapAboveBaseline cap(40 * kMiB);
    const RunCase c =
        requestBesideARun(12 * kMiB, 18 * kMiB, 4 * kMiB, 15 * kMiB);
    CHECK_EQ(c.after.fragment_reclaims, c.before.fragment_reclaims + 1);
    CHECK_EQ(c.after.fragment_placements, c.before.fragment_placements);
    CHECK_EQ(c.after.pageout_bytes - c.before.pageout_bytes, int64_t(4 * kMiB));
    CHECK(lms::getState(*c.z) == lms::StorageState::PagedOut);
    CHECK(lms::getState(*c.x) == lms::StorageState::Inactive);
    CHECK(c.contentsKept());
  }
  env.checkBaseline();
}

// What the drop-in registers with the caching allocator's free-memory
// callbacks (extension/csrc/StockAllocatorBackend.cpp): while a
// SearchCallbackRequest lives on this thread, a free-list search that finds
// nothing asks lms::reclaimBeforeMapping for its request.
struct SearchRequest {
  bool set = false;
  size_t size = 0;
};
thread_local SearchRequest t_search_request;

class SearchCallbackRequest {
 public:
  explicit SearchCallbackRequest(size_t size) {
    t_search_request = SearchRequest{true, size};
  }
  ~SearchCallbackRequest() {
    t_search_request = SearchRequest{};
  }
  SearchCallbackRequest(const SearchCallbackRequest&) = delete;
  SearchCallbackRequest& operator=(const SearchCallbackRequest&) = delete;
};

class ReclaimBeforeMappingForTest final : public c10::FreeMemoryCallback {
 public:
  bool Execute() override {
    const SearchRequest request = t_search_request;
    return request.set && lms::reclaimBeforeMapping(0, request.size, stream());
  }
};

// The layout of the test above, with the free-memory callback the drop-in
// registers: the allocator's search of its free list, which finds nothing for
// the 15 MiB request, asks LMS before it maps memory anew. The device has no
// room for it, so Z, in the way of the run the request fits in, is paged out
// then and the search finds the run: the allocator never tries the device
// (no cudaMalloc call fails) and LMS's failure path never runs. With room on
// the device the callback moves nothing and the allocator maps the request,
// although a storage it could page out is in the way of a run.
TEST_CASE(the_allocators_search_asks_lms_before_it_maps_anew) {
  Env env(40 * kMiB);
  {
    const CapAboveBaseline cap(40 * kMiB);
    auto x = newStorage(12 * kMiB);
    auto y = newStorage(18 * kMiB);
    y.reset(); // its segment stays cached, free
    auto z = newStorage(4 * kMiB); // carved out of y's segment
    write(*x, 1);
    write(*z, 2);
    lms::releaseOutput(*x);
    lms::releaseOutput(*z);
    const auto before = lms::getStats(0);
    const size_t mallocs =
        simulated() ? simgpu_call_count("cudaMalloc") : size_t(0);
    StoragePtr d;
    {
      const SearchCallbackRequest request(15 * kMiB);
      d = newStorage(15 * kMiB);
    }
    write(*d, 3);
    const auto after = lms::getStats(0);
    CHECK_EQ(after.fragment_placements, before.fragment_placements + 1);
    CHECK_EQ(after.fragment_reclaims, before.fragment_reclaims);
    CHECK_EQ(after.reclaim_alloc_failure, before.reclaim_alloc_failure);
    CHECK_EQ(after.pageout_bytes - before.pageout_bytes, int64_t(4 * kMiB));
    if (simulated()) {
      CHECK_EQ(simgpu_call_count("cudaMalloc"), mallocs);
    }
    CHECK(lms::getState(*z) == lms::StorageState::PagedOut);
    CHECK(lms::getState(*x) == lms::StorageState::Inactive);
    CHECK(matches(*x, 1));
    CHECK(matches(*z, 2));
    CHECK(matches(*d, 3));
  }
  {
    // Room to map a new segment (18 MiB mapped, 40 MiB of cap): X, in the
    // way of the only run the request would fit in, stays.
    cca::emptyCache();
    const CapAboveBaseline cap(40 * kMiB);
    auto y = newStorage(18 * kMiB);
    y.reset();
    auto x = newStorage(4 * kMiB);
    write(*x, 4);
    lms::releaseOutput(*x);
    const auto before = lms::getStats(0);
    StoragePtr d;
    {
      const SearchCallbackRequest request(15 * kMiB);
      d = newStorage(15 * kMiB);
    }
    const auto after = lms::getStats(0);
    CHECK_EQ(after.pageout_count, before.pageout_count);
    CHECK_EQ(after.fragment_placements, before.fragment_placements);
    CHECK(lms::getState(*x) == lms::StorageState::Inactive);
    CHECK(matches(*x, 4));
  }
  env.checkBaseline();
}

// A large request on a device the allocator cannot grow on is placed before
// the allocator tries it: the storage in the way of the run it fits in is
// paged out first, and the allocator never fails (failing, it would return its
// whole cache to the device, synchronizing it). The layout of the test above
// at about twice the size: X (24 MiB) in a segment of its own, Z (4 MiB) at
// the start of a 30 MiB segment, a 28 MiB request (56 MiB of tensors, 78 MiB
// of segments).
TEST_CASE(a_large_request_on_a_full_device_is_placed_ahead) {
  Env env(64 * kMiB);
  {
    const CapAboveBaseline cap(64 * kMiB);
    RunCase c = requestBesideARun(24 * kMiB, 30 * kMiB, 4 * kMiB, 28 * kMiB);
    CHECK_EQ(c.after.fragment_placements, c.before.fragment_placements + 1);
    CHECK_EQ(c.after.fragment_reclaims, c.before.fragment_reclaims);
    CHECK_EQ(c.after.reclaim_alloc_failure, c.before.reclaim_alloc_failure);
    CHECK_EQ(c.after.pageout_bytes - c.before.pageout_bytes, int64_t(4 * kMiB));
    CHECK(lms::getState(*c.z) == lms::StorageState::PagedOut);
    CHECK(lms::getState(*c.x) == lms::StorageState::Inactive);
    CHECK(c.contentsKept());
    // A free run that holds the request: nothing is moved ahead.
    c.d.reset();
    const auto again = lms::getStats(0);
    auto e = newStorage(28 * kMiB);
    write(*e, 4);
    const auto last = lms::getStats(0);
    CHECK_EQ(last.fragment_placements, again.fragment_placements);
    CHECK_EQ(last.pageout_bytes, again.pageout_bytes);
    CHECK(matches(*e, 4));
  }
  env.checkBaseline();
}

// A run that would move more than half the request beyond what the limit
// needs is not vacated ahead: the allocator gets the request first. X (24
// MiB, used longest ago) has a segment of its own; Z (20 MiB) sits at the
// start of a 30 MiB segment. For a 28 MiB request (72 MiB of tensors) the
// limit's reclaim pages X out (least recently used); the only run is then Z's
// segment, 20 MiB to move for a 28 MiB request, so nothing is placed ahead.
// The allocator fails, and its failure path, which has no such bound, vacates
// the same run.
TEST_CASE(a_run_dearer_than_half_the_request_is_not_vacated_ahead) {
  Env env(64 * kMiB);
  {
    const CapAboveBaseline cap(64 * kMiB);
    const RunCase c =
        requestBesideARun(24 * kMiB, 30 * kMiB, 20 * kMiB, 28 * kMiB);
    CHECK_EQ(c.after.fragment_placements, c.before.fragment_placements);
    CHECK_EQ(c.after.fragment_reclaims, c.before.fragment_reclaims + 1);
    CHECK(lms::getState(*c.x) == lms::StorageState::PagedOut);
    CHECK(lms::getState(*c.z) == lms::StorageState::PagedOut);
    CHECK(c.contentsKept());
  }
  env.checkBaseline();
}

// Whether `s` holds host memory (a paged-out storage's host copy, or an
// allocation placed on the host).
bool onHost(const StoragePtr& s) {
  cudaPointerAttributes attributes{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(
      &attributes, s->_mutable_data_ptr_no_checks().get()));
  return attributes.type == cudaMemoryTypeHost;
}

// An allocation inside an operator that the device cannot hold with every
// other storage paged out is placed in pinned host memory instead of failing
// (a library that would catch the error keeps its algorithm): under a 64 MiB
// cap, operator O pins its 40 MiB input C and allocates a 40 MiB workspace W
// and a 30 MiB output Y. Both go to the host; the device holds only C. A
// nested operator's pin and unpin of Y leave it where O writes it. W freed
// inside O returns its buffer; Y, once O ends, is paged out from birth (no
// copy is counted) and paged in, with what O wrote, when next used. Outside
// an operator, or with host placement off, the request fails as before; so
// it does when the host gives no pinned memory either.
TEST_CASE(
    an_allocation_the_device_cannot_hold_inside_an_operator_goes_to_host) {
  Env env(64 * kMiB);
  const char* name = "lms_test::over_the_device";
  {
    const CapAboveBaseline cap(64 * kMiB);
    auto c = newStorage(40 * kMiB);
    write(*c, 1);
    lms::releaseOutput(*c);
    CHECK_THROWS_AS(newStorage(70 * kMiB), c10::OutOfMemoryError, "");
    c10::StorageImpl* inputs[] = {c.get()};
    const auto before = lms::getStats(0);
    lms::beginWorkingSet(name, inputs);
    lms::pin(*c);
    const size_t device_bytes = allocatedBytes();
    auto w = newStorage(40 * kMiB);
    auto y = newStorage(30 * kMiB);
    CHECK(onHost(w));
    CHECK(onHost(y));
    CHECK_EQ(allocatedBytes(), device_bytes);
    auto placed = lms::getStats(0);
    CHECK_EQ(placed.host_placement_count, before.host_placement_count + 2);
    CHECK_EQ(
        placed.host_placement_bytes - before.host_placement_bytes,
        int64_t(70 * kMiB));
    write(*w, 2, /*anywhere=*/true); // nested operators: pin, write, unpin
    write(*y, 3, /*anywhere=*/true);
    CHECK(matches(*y, 3, /*anywhere=*/true));
    CHECK(state(y) == lms::StorageState::Allocated);
    CHECK(onHost(y));
    CHECK(matches(*w, 2, /*anywhere=*/true));
    w.reset();
    lms::setHostPlacementEnabled(false);
    CHECK_THROWS_AS(newStorage(40 * kMiB), c10::OutOfMemoryError, "");
    lms::setHostPlacementEnabled(true);
    lms::unpin(*c);
    lms::releaseOutput(*y); // O ends
    lms::endWorkingSet(name);
    CHECK(state(y) == lms::StorageState::PagedOut);
    CHECK_EQ(lms::getStats(0).pageout_count, placed.pageout_count);
    CHECK_EQ(lms::getStats(0).pagedout_bytes.current, int64_t(30 * kMiB));
    CHECK(matches(*y, 3)); // paged in: C goes out for its room
    CHECK(!onHost(y));
    CHECK(state(c) == lms::StorageState::PagedOut);
    CHECK(matches(*c, 1));

    // The host refuses too: the request fails, and nothing is lost.
    lms::releaseOutput(*c);
    c10::StorageImpl* again[] = {y.get()};
    lms::beginWorkingSet(name, again);
    lms::pin(*y);
    if (simulated()) {
      cca::emptyCache(); // no cached host buffer to fall back on
      simgpu_inject_fault(1 /*host alloc*/, 1, -1, cudaSuccess);
      CHECK_THROWS_AS(newStorage(60 * kMiB), c10::OutOfMemoryError, "");
      simgpu_clear_faults();
    }
    lms::unpin(*y);
    lms::endWorkingSet(name);
    CHECK(matches(*y, 3));
    CHECK(matches(*c, 1));
  }
  env.checkBaseline();
}

// Turns host placement off for a scope.
class HostPlacementOff {
 public:
  HostPlacementOff() {
    lms::setHostPlacementEnabled(false);
  }
  ~HostPlacementOff() {
    lms::setHostPlacementEnabled(true);
  }
  HostPlacementOff(const HostPlacementOff&) = delete;
  HostPlacementOff& operator=(const HostPlacementOff&) = delete;
};

// The simulated GPU reports a CUDA graph capture under way on the current
// stream for a scope, and the caching allocator is told of it as PyTorch's
// CUDA graphs tell it (the engine asks CUDA only while a capture may be
// underway: DeviceMemoryBackend::captureMayBeUnderway).
class SimulatedCapture {
 public:
  SimulatedCapture() : scope_(0, stream(), &simgpu_set_capturing) {}

 private:
  lms_compat::CaptureScope scope_;
};

// An operator whose inputs cannot all be resident under the cap runs with the
// ones the device cannot hold left in their host copies (host placement):
// under a 64 MiB cap, operator O reads A (12 MiB), B (20 MiB) and C (40 MiB),
// all paged out, and writes A and C in place. Pinned smallest first, as
// operator-boundary pinning pins them, A and B are paged in, and C, with no
// room for it even with everything else paged out, stays in its host copy:
// pinned there at the host copy's address, with nothing copied either way. A
// nested pin (the write) and another thread's operator use it there too, and
// O's output goes to the device beside A and B. When O ends, C is paged out
// with what O wrote (no page-out counted) and the next use pages it in. O
// runs twice (A and B resident the second time): counted each time, named in
// one warning. A stream recorded on C meanwhile is recorded by the engine
// alone: no allocator block holds host memory. With host placement off the
// pin raises as before, and during CUDA graph capture nothing is placed: the
// pin raises.
TEST_CASE(
    an_input_the_device_cannot_hold_stays_in_host_memory_for_its_operator) {
  Env env(64 * kMiB);
  const char* name = "lms_test::inputs_over_the_device";
  {
    const CapAboveBaseline cap(64 * kMiB);
    auto a = newStorage(12 * kMiB);
    write(*a, 1);
    auto b = newStorage(20 * kMiB);
    write(*b, 2);
    auto c = newStorage(40 * kMiB);
    write(*c, 3);
    lms::reclaimInactive(0);
    REQUIRE(state(a) == lms::StorageState::PagedOut);
    REQUIRE(state(b) == lms::StorageState::PagedOut);
    REQUIRE(state(c) == lms::StorageState::PagedOut);
    c10::StorageImpl* inputs[] = {a.get(), b.get(), c.get()};
    lms_compat::WarningCollector warnings;
    for (int round = 0; round < 2; ++round) {
      const auto before = lms::getStats(0);
      lms::beginWorkingSet(name, inputs);
      for (c10::StorageImpl* input : inputs) {
        lms::pin(*input);
      }
      const auto pinned = lms::getStats(0);
      CHECK(state(c) == lms::StorageState::Active);
      CHECK(onHost(c));
      CHECK(!onHost(a));
      CHECK(!onHost(b));
      CHECK_EQ(
          pinned.input_host_placement_count,
          before.input_host_placement_count + 1);
      CHECK_EQ(
          pinned.input_host_placement_bytes - before.input_host_placement_bytes,
          int64_t(40 * kMiB));
      CHECK_EQ(pinned.pagein_count - before.pagein_count, round == 0 ? 2 : 0);
      CHECK_EQ(pinned.pageout_count, before.pageout_count);
      CHECK_EQ(pinned.oom_count, before.oom_count);
      CHECK_EQ(allocatedBytes(), 32 * kMiB);
      // O reads its inputs and writes A and C in place; C over the bus.
      CHECK(matches(*c, round == 0 ? 3 : 10, /*anywhere=*/true));
      CHECK(matches(*b, 2));
      write(*c, 10 + round, /*anywhere=*/true);
      write(*a, 20 + round);
      bool seen = false;
      std::thread other([&] {
        c10::cuda::set_device(0);
        seen = matches(*c, 10 + round, /*anywhere=*/true);
      });
      other.join();
      CHECK(seen);
      CHECK(state(c) == lms::StorageState::Active);
      // Another stream used C (Tensor.record_stream): its host memory is no
      // block of the allocator, which records nothing; C's page-out waits.
      cca::recordStream(
          c->_mutable_data_ptr_no_checks(), c10::cuda::getStreamFromPool());
      if (simulated()) {
        // A graph captured now would bake in an address that is C's only
        // until O ends.
        const SimulatedCapture capture;
        CHECK_THROWS_AS(lms::pin(*c), c10::Error, "pinned host memory");
      }
      auto y = newStorage(16 * kMiB);
      CHECK(!onHost(y));
      write(*y, 30 + round);
      for (c10::StorageImpl* input : inputs) {
        lms::unpin(*input);
      }
      lms::releaseOutput(*y);
      lms::endWorkingSet(name);
      CHECK(state(c) == lms::StorageState::PagedOut);
      CHECK(state(a) == lms::StorageState::Inactive);
      const auto after = lms::getStats(0);
      CHECK_EQ(after.pageout_count, before.pageout_count);
      CHECK_EQ(after.host_placement_count, before.host_placement_count);
      CHECK_EQ(after.pagedout_bytes.current, int64_t(40 * kMiB));
      CHECK(matches(*y, 30 + round));
    }
    CHECK_EQ(warnings.count("an input of lms_test::inputs_over_the_device"), 1);
    CHECK(matches(*c, 11)); // paged in, A and B paged out for its room
    CHECK(!onHost(c));
    CHECK(matches(*a, 21));
    CHECK(matches(*b, 2));

    // Off, the pin raises the out-of-memory error, and C stays paged out.
    lms::reclaimInactive(0);
    {
      const HostPlacementOff off;
      const auto before = lms::getStats(0);
      lms::beginWorkingSet(name, inputs);
      lms::pin(*a);
      lms::pin(*b);
      CHECK_THROWS_AS(
          lms::pin(*c), c10::OutOfMemoryError, "Tried to allocate 40.00 MiB");
      CHECK(state(c) == lms::StorageState::PagedOut);
      lms::unpin(*a);
      lms::unpin(*b);
      lms::endWorkingSet(name);
      CHECK_EQ(
          lms::getStats(0).input_host_placement_count,
          before.input_host_placement_count);
    }

    // During capture a paged-out input raises, as a page-in would: nothing is
    // placed.
    if (simulated()) {
      const auto before = lms::getStats(0);
      lms::reclaimInactive(0);
      lms::beginWorkingSet(name, inputs);
      {
        const SimulatedCapture capture;
        CHECK_THROWS_AS(lms::pin(*c), c10::Error, "CUDA graph capture");
      }
      lms::endWorkingSet(name);
      CHECK(state(c) == lms::StorageState::PagedOut);
      CHECK_EQ(
          lms::getStats(0).input_host_placement_count,
          before.input_host_placement_count);
    }
    CHECK(matches(*c, 11));
    CHECK(matches(*a, 21));
    CHECK(matches(*b, 2));
  }
  env.checkBaseline();
}

// By bytes the input fits, but not beside the segment that a pinned input
// keeps mapped: its page-in pages out what it can, the allocation still
// fails, and the input stays in its host copy all the same. Operator O reads
// C (4 MiB), which holds a 30 MiB segment, and D (40 MiB, paged out); X
// (20 MiB) is inactive in a segment of its own. 44 MiB of inputs fit the
// 64 MiB cap by bytes, but D finds no room beside C's segment once X is out.
// (Not packed: a pack would page C out and place it anew.)
TEST_CASE(an_input_with_no_room_beside_the_pinned_ones_stays_in_host_memory) {
  Env env(64 * kMiB);
  const char* name = "lms_test::no_room_beside_an_input";
  {
    const CapAboveBaseline cap(64 * kMiB);
    auto d = newStorage(40 * kMiB);
    write(*d, 4);
    lms::reclaimInactive(0);
    lms::getBackend()->releaseCachedMemory(0);
    auto [c, x] = inputInALargeSegment();
    c10::StorageImpl* inputs[] = {c.get(), d.get()};
    const auto before = lms::getStats(0);
    lms::setPackingEnabled(false);
    lms::beginWorkingSet(name, inputs);
    lms::setPackingEnabled(true);
    lms::pin(*c);
    lms::pin(*d);
    CHECK(state(d) == lms::StorageState::Active);
    CHECK(onHost(d));
    CHECK(state(x) == lms::StorageState::PagedOut); // tried to make room
    CHECK_EQ(
        lms::getStats(0).input_host_placement_count,
        before.input_host_placement_count + 1);
    CHECK(matches(*d, 4, /*anywhere=*/true));
    write(*d, 5, /*anywhere=*/true);
    lms::unpin(*c);
    lms::unpin(*d);
    lms::endWorkingSet(name);
    CHECK(state(d) == lms::StorageState::PagedOut);
    CHECK(matches(*d, 5));
    CHECK(matches(*c, 1));
    CHECK(matches(*x, 2));
  }
  env.checkBaseline();
}

TEST_CASE(oom_names_the_running_operators_working_set) {
  Env env(16 * kMiB);
  {
    const lms_test::AllocatorCap cap(20 * kMiB);
    std::vector<StoragePtr> inputs;
    for (int i = 0; i < 3; ++i) { // 12 MiB pinned by the operator
      inputs.push_back(newStorage(4 * kMiB));
      lms::pin(*inputs.back());
    }
    auto output = newStorage(4 * kMiB); // its first output, not released yet
    CHECK_EQ(lms::getStats(0).operator_output_bytes.current, int64_t(4 * kMiB));
    bool threw = false;
    try {
      auto more = newStorage(8 * kMiB); // 24 MiB at once under a 20 MiB cap
    } catch (const c10::OutOfMemoryError& e) {
      threw = true;
      const std::string msg = e.what();
      CHECK(msg.find("working set does not fit") != std::string::npos);
      CHECK(msg.find("4.00 MiB allocated by it so far") != std::string::npos);
      CHECK(
          msg.find("= 24.00 MiB > the allocator's cap (20.00 MiB)") !=
          std::string::npos);
    }
    CHECK(threw);
    CHECK_EQ(lms::lastOutOfMemoryRequest(), 8 * kMiB);
    CHECK_EQ(
        lms::lastOutOfMemoryVerdict(),
        std::string("The running operator's working set does not fit: "
                    "12.00 MiB pinned + 4.00 MiB allocated by it so far + "
                    "8.00 MiB requested = 24.00 MiB > the allocator's cap "
                    "(20.00 MiB)."));
    lms::releaseOutput(*output); // the operator ends
    CHECK_EQ(lms::getStats(0).operator_output_bytes.current, int64_t(0));
    for (auto& s : inputs) {
      lms::unpin(*s);
    }
    inputs.clear();
    output.reset();
  }
  env.checkBaseline();
}

// Memory outside LMS that its owner can give back (in PyTorch, the pools of
// idle CUDA graph trees: torch/cuda/_lms_cudagraphs.py) is the last resort of
// the allocation path: asked only once nothing is left to page out, the
// allocation is tried again when it gave memory back, and the error says what
// it kept.
namespace outside_memory {

void* g_held = nullptr; // the block "outside LMS": allocated while LMS is off
int g_asked = 0;

bool giveBack(c10::DeviceIndex /*device*/, size_t /*size*/, std::string& note) {
  ++g_asked;
  if (g_held == nullptr) {
    note = "Nothing is left outside LMS.";
    return false;
  }
  cca::raw_delete(g_held); // to the allocator's cache, which its retry frees
  g_held = nullptr;
  return true;
}

bool keep(c10::DeviceIndex /*device*/, size_t /*size*/, std::string& note) {
  ++g_asked;
  note = "The test's pool holds 16.00 MiB and is in use.";
  return false;
}

struct NoReleaser {
  NoReleaser() = default;
  NoReleaser(const NoReleaser&) = delete;
  NoReleaser& operator=(const NoReleaser&) = delete;
  ~NoReleaser() {
    lms::setOutsideMemoryReleaser(nullptr);
  }
};

} // namespace outside_memory

TEST_CASE(memory_outside_lms_is_given_back_when_nothing_is_left_to_page_out) {
  namespace om = outside_memory;
  Env env(size_t(1) << 50); // no limit: only the failure trigger
  {
    // Requests over 10 MiB map segments of their own size, so that the
    // figures below are what the allocator reserves.
    const lms_test::AllocatorCap cap(40 * kMiB);
    const om::NoReleaser reset;
    lms::setEnabled(false);
    om::g_held = cca::raw_alloc(16 * kMiB);
    lms::setEnabled(true);
    om::g_asked = 0;
    lms::setOutsideMemoryReleaser(&om::giveBack);

    auto a = newStorage(16 * kMiB);
    write(*a, 1);
    // 16 outside + 16 + 16 > 40: paging `a` out makes the room, and the
    // releaser is not asked.
    auto b = newStorage(16 * kMiB);
    write(*b, 2);
    CHECK(state(a) == lms::StorageState::PagedOut);
    CHECK_EQ(om::g_asked, 0);
    // 16 outside + 30 > 40 with `a` and `b` paged out: the memory outside
    // LMS is given back and the allocation succeeds.
    auto c = newStorage(30 * kMiB);
    write(*c, 3);
    CHECK(state(b) == lms::StorageState::PagedOut);
    CHECK_EQ(om::g_asked, 1);
    CHECK(om::g_held == nullptr);

    // Nothing given back: the error says what the releaser kept.
    lms::setOutsideMemoryReleaser(&om::keep);
    lms::pin(*c); // in use: 30 + 20 > 40, and nothing else to page out
    bool threw = false;
    try {
      auto d = newStorage(20 * kMiB);
    } catch (const c10::OutOfMemoryError& e) {
      threw = true;
      const std::string msg = e.what();
      CHECK(
          msg.find("The test's pool holds 16.00 MiB and is in use.") !=
          std::string::npos);
    }
    CHECK(threw);
    CHECK_EQ(om::g_asked, 2);
    lms::unpin(*c);
    // What was paged out around it is intact.
    c.reset();
    CHECK(matches(*a, 1));
    CHECK(matches(*b, 2));
    a.reset();
    b.reset();
    // The note belongs to the allocation that failed, not to the next one.
    lms::setOutsideMemoryReleaser(nullptr);
    auto e = newStorage(4 * kMiB);
    CHECK(
        lms::describeOutOfMemory(0, 4 * kMiB).find("The test's pool") ==
        std::string::npos);
    e.reset();
  }
  env.checkBaseline();
}

TEST_CASE(pinned_working_set_too_large_gives_lms_oom) {
  Env env(size_t(1) << 50);
  {
    const lms_test::AllocatorCap cap(32 * kMiB);
    std::vector<StoragePtr> pinned;
    bool threw = false;
    try {
      for (int i = 0; i < 16; ++i) { // 64 MiB pinned at once
        pinned.push_back(newStorage(4 * kMiB));
        lms::pin(*pinned.back());
      }
    } catch (const c10::OutOfMemoryError& e) {
      threw = true;
      const std::string msg = e.what();
      CHECK(msg.find("Large Model Support") != std::string::npos);
      CHECK(msg.find("pinned by the running operator") != std::string::npos);
      CHECK(msg.find("LMS pages out ahead above") != std::string::npos);
    }
    CHECK(threw);
    CHECK(lms::getStats(0).oom_count >= 1);
    for (auto& s : pinned) {
      lms::unpin(*s);
    }
    pinned.clear();
  }
  env.checkBaseline();
}

// A paged-out storage's address is its pinned host copy, which unified
// addressing makes valid on the device: code that reads it without going
// through LMS sees the contents instead of freed device memory.
TEST_CASE(paged_out_storage_points_at_its_host_copy) {
  Env env(64 * kMiB);
  {
    auto s = newStorage(2 * kMiB);
    write(*s, 11);
    const void* resident = s->_mutable_data_ptr_no_checks().get();
    lms::reclaimInactive(0);
    REQUIRE(state(s) == lms::StorageState::PagedOut);
    const void* paged_out = s->_mutable_data_ptr_no_checks().get();
    REQUIRE(paged_out != nullptr);
    CHECK(paged_out != resident);
    C10_CUDA_CHECK(cudaDeviceSynchronize()); // the page-out copy is done
    CHECK(std::memcmp(paged_out, pattern(2 * kMiB, 11).data(), 2 * kMiB) == 0);
    CHECK(matches(*s, 11)); // and it pages back in
    CHECK(s->_mutable_data_ptr_no_checks().get() != paged_out);
  }
  env.checkBaseline();
}

// An operator whose inputs did not all fit runs on the host copy of those
// left out: what it writes there is what the next page-in brings back.
TEST_CASE(host_use_of_a_paged_out_storage_is_ordered_and_kept) {
  Env env(64 * kMiB);
  {
    auto s = newStorage(2 * kMiB);
    write(*s, 21);
    lms::reclaimInactive(0);
    REQUIRE(state(s) == lms::StorageState::PagedOut);
    lms::beginHostUse(*s);
    void* host = s->_mutable_data_ptr_no_checks().get();
    const auto fresh = pattern(2 * kMiB, 22);
    C10_CUDA_CHECK(cudaMemcpyAsync(
        host, fresh.data(), 2 * kMiB, cudaMemcpyDefault, stream()));
    lms::endHostUse(*s);
    CHECK(state(s) == lms::StorageState::PagedOut);
    CHECK(matches(*s, 22));
    // Resident and unmanaged storages are left alone.
    lms::beginHostUse(*s);
    lms::endHostUse(*s);
    CHECK(matches(*s, 22));
  }
  env.checkBaseline();
}

// Pinning hands an operator's failure to the engine; the operator's next LMS
// allocation on this thread raises it, once.
TEST_CASE(pending_error_is_raised_by_the_next_allocation) {
  Env env(64 * kMiB);
  {
    const auto failures = lms::getStats(0).pin_failures;
    const uint64_t raised = lms::outOfMemoryErrorsRaised();
    CHECK(!lms::hasPendingError());
    lms::setPendingError(0, oomError("op did not fit"));
    CHECK(lms::hasPendingError());
    CHECK_EQ(lms::getStats(0).pin_failures, failures + 1);
    CHECK_EQ(lms::outOfMemoryErrorsRaised(), raised); // not raised yet
    CHECK_THROWS_AS(
        newStorage(2 * kMiB), c10::OutOfMemoryError, "op did not fit");
    // Counted where it is raised, with its request: an operator that catches
    // it is told apart from one that never saw it.
    CHECK_EQ(lms::outOfMemoryErrorsRaised(), raised + 1);
    CHECK_EQ(lms::lastOutOfMemoryRequest(), 2 * kMiB);
    CHECK(lms::lastOutOfMemoryVerdict().empty()); // pinning's own error
    CHECK(!lms::hasPendingError());
    auto s = newStorage(2 * kMiB); // raised once only
    write(*s, 1);
    CHECK(matches(*s, 1));
    // Raw allocations raise it too; clearPendingError() drops it.
    lms::setPendingError(0, oomError("raw"));
    CHECK_THROWS_AS(
        lms::allocateRaw(0, 2 * kMiB, stream()), c10::OutOfMemoryError, "raw");
    lms::setPendingError(0, oomError("dropped"));
    lms::clearPendingError();
    void* raw = lms::allocateRaw(0, 2 * kMiB, stream());
    CHECK(raw != nullptr);
    lms::getBackend()->free(raw);
  }
  env.checkBaseline();
}

// Inside a CUDA graph pool step (a warm-up or capture that the Python layer
// runs again without graphs), running out of memory raises c10::Error, which
// a library catching c10::OutOfMemoryError does not catch, and the step's end
// says so: the allocator's error or LMS's own, and an operator's pending one.
// Outside a step the errors are as before.
TEST_CASE(a_graph_pool_step_ends_with_an_error_no_library_catches_as_oom) {
  Env env(64 * kMiB);
  {
    const auto is_oom = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const c10::OutOfMemoryError&) {
        return 1;
      } catch (const c10::Error& e) {
        CHECK(
            std::string(e.what()).find(
                "CUDA graph pool's warm-up or capture") != std::string::npos);
        return 0;
      }
      return -1;
    };
    const CapAboveBaseline cap(32 * kMiB);
    // Nothing inactive to page out, the request over the cap: the caching
    // allocator's error after LMS's retry (where the tag's allocator reclaims
    // through LMS), or LMS's own.
    lms::beginGraphPoolStep();
    CHECK_EQ(is_oom([] { (void)newStorage(40 * kMiB); }), 0);
    CHECK(lms::endGraphPoolStep());
    CHECK_EQ(is_oom([] { (void)newStorage(40 * kMiB); }), 1);
    // An operator's pending error, raised by its next allocation.
    lms::beginGraphPoolStep();
    lms::setPendingError(0, oomError("op did not fit"));
    CHECK_EQ(is_oom([] { (void)newStorage(2 * kMiB); }), 0);
    CHECK(!lms::hasPendingError());
    CHECK(lms::endGraphPoolStep());
    // Steps nest: the outermost's end says whether any ran out; a step that
    // did not run out says so.
    lms::beginGraphPoolStep();
    lms::beginGraphPoolStep();
    CHECK_EQ(
        is_oom([] { lms::raiseIfGraphPoolStep(0, "CUDA out of memory"); }), 0);
    CHECK(lms::endGraphPoolStep());
    CHECK(lms::endGraphPoolStep());
    lms::beginGraphPoolStep();
    auto s = newStorage(2 * kMiB);
    CHECK(!lms::endGraphPoolStep());
    CHECK_EQ(
        is_oom([] { lms::raiseIfGraphPoolStep(0, "CUDA out of memory"); }),
        -1); // outside a step: nothing raised
  }
  env.checkBaseline();
}

// Raw allocations (workspaces) are not managed, but they get room the same
// way tensors do: the limit trigger pages out inactive storages first.
TEST_CASE(raw_allocation_reclaims_under_the_limit) {
  Env env(16 * kMiB);
  {
    std::vector<StoragePtr> s;
    for (int i = 0; i < 3; ++i) {
      s.push_back(newStorage(4 * kMiB));
      write(*s.back(), 30 + i);
    }
    void* raw = lms::allocateRaw(0, 8 * kMiB, stream());
    REQUIRE(raw != nullptr);
    const auto st = lms::getStats(0);
    CHECK(st.reclaim_limit > 0);
    CHECK(st.pageout_bytes >= int64_t(4 * kMiB));
    CHECK_LE(allocatedBytes(), size_t(16 * kMiB));
    CHECK(!lms::isManaged(c10::DataPtr(raw, c10::Device(c10::kCUDA, 0))));
    lms::getBackend()->free(raw);
    for (int i = 0; i < 3; ++i) {
      CHECK(matches(*s[i], 30 + i));
    }
  }
  env.checkBaseline();
}

// What the limit cannot hold back (pinned by running operators) is reported.
TEST_CASE(bytes_over_the_limit_are_reported) {
  Env env(8 * kMiB);
  {
    std::vector<StoragePtr> pinned;
    for (int i = 0; i < 3; ++i) { // 12 MiB pinned under an 8 MiB limit
      pinned.push_back(newStorage(4 * kMiB));
      lms::pin(*pinned.back());
    }
    const auto st = lms::getStats(0);
    CHECK(st.over_limit_bytes.peak >= int64_t(4 * kMiB));
    CHECK_LE(st.over_limit_bytes.peak, int64_t(4 * kMiB));
    for (auto& s : pinned) {
      lms::unpin(*s);
    }
    pinned.clear();
    auto s = newStorage(4 * kMiB); // back under the limit
    CHECK_EQ(lms::getStats(0).over_limit_bytes.current, int64_t(0));
  }
  env.checkBaseline();
}

// An operator's outputs become reclaimable when it ends, unless something
// pinned or accessed them since their allocation.
TEST_CASE(operator_outputs_become_reclaimable_when_it_ends) {
  Env env(64 * kMiB);
  {
    auto out = newStorage(2 * kMiB);
    CHECK(state(out) == lms::StorageState::Allocated);
    CHECK_EQ(lms::reclaimInactive(0), size_t(0)); // being written: kept
    lms::releaseOutput(*out);
    CHECK(state(out) == lms::StorageState::Inactive);
    lms::releaseOutput(*out); // a second release changes nothing
    CHECK(state(out) == lms::StorageState::Inactive);
    CHECK_EQ(lms::reclaimInactive(0), size_t(2 * kMiB));
    CHECK(state(out) == lms::StorageState::PagedOut);
    CHECK(out->_mutable_data_ptr_no_checks().get() != nullptr);

    auto raw = newStorage(2 * kMiB);
    lms::access(*raw); // a raw pointer is out: never released
    lms::releaseOutput(*raw);
    CHECK(state(raw) == lms::StorageState::Allocated);
  }
  env.checkBaseline();
}

TEST_CASE(host_allocation_failure_keeps_storage_resident) {
  requireSimulated("failing pinned host allocations");
  Env env(64 * kMiB);
  {
    auto s = newStorage(2 * kMiB);
    write(*s, 5);
    cca::emptyCache(); // no cached host buffer to fall back on
    simgpu_inject_fault(1 /*host alloc*/, 1, -1, cudaSuccess);
    CHECK_EQ(lms::reclaimInactive(0), size_t(0));
    CHECK(state(s) == lms::StorageState::Inactive);
    simgpu_clear_faults();
    CHECK(matches(*s, 5));
    CHECK_EQ(lms::reclaimInactive(0), 2 * kMiB); // works once memory is back
    CHECK(matches(*s, 5));
  }
  env.checkBaseline();
}

TEST_CASE(page_in_failure_loses_nothing) {
  requireSimulated("failing device allocations");
  Env env(64 * kMiB);
  {
    auto s = newStorage(4 * kMiB);
    write(*s, 9);
    lms::reclaimInactive(0);
    cca::emptyCache(); // the page-in must ask the device for memory
    simgpu_inject_fault(kSimFaultDeviceAlloc, 1, -1, cudaSuccess);
    CHECK_THROWS_AS(lms::pin(*s), c10::OutOfMemoryError, "Large Model Support");
    CHECK(state(s) == lms::StorageState::PagedOut);
    simgpu_clear_faults();
    CHECK(matches(*s, 9));
  }
  env.checkBaseline();
}

TEST_CASE(copy_failure_during_page_out_loses_nothing) {
  requireSimulated("failing copies");
  Env env(64 * kMiB);
  {
    auto s = newStorage(2 * kMiB);
    write(*s, 11);
    simgpu_fail_nth_copy(1);
    CHECK_THROWS_AS(lms::reclaimInactive(0), c10::Error, "CUDA error");
    simgpu_clear_faults();
    CHECK(state(s) == lms::StorageState::Inactive);
    CHECK(matches(*s, 11));
  }
  env.checkBaseline();
}

TEST_CASE(prefetch_pages_in_ahead_and_counts_hits) {
  Env env(64 * kMiB);
  {
    std::vector<StoragePtr> s;
    for (int i = 0; i < 4; ++i) {
      s.push_back(newStorage(2 * kMiB));
      write(*s.back(), 100 + i);
    }
    lms::reclaimInactive(0); // paged out in order 0, 1, 2, 3
    lms::setPrefetchDepth(2);
    // A backward pass wants them in reverse order.
    CHECK(matches(*s[3], 103)); // pages in 3, prefetches 2 and 1
    CHECK(state(s[2]) == lms::StorageState::Inactive);
    CHECK(state(s[1]) == lms::StorageState::Inactive);
    CHECK(state(s[0]) == lms::StorageState::PagedOut);
    CHECK(matches(*s[2], 102));
    CHECK(matches(*s[1], 101));
    CHECK(matches(*s[0], 100));
    const auto st = lms::getStats(0);
    CHECK(st.prefetch_count >= 2);
    CHECK(st.prefetch_hits >= 2);
  }
  env.checkBaseline();
}

// Every page-out and page-in copy is timed on its stream: the bytes and
// milliseconds each way give the bandwidth paging gets. On the simulated GPU,
// whose copies run at a set bandwidth, the measured one must be that one.
TEST_CASE(copies_are_timed_each_way) {
  Env env(64 * kMiB);
  constexpr double kBytesPerSecond = 2e9;
  if (simulated()) {
    simgpu_set_copy_bandwidth(kBytesPerSecond);
  }
  {
    lms::resetAccumulatedStats(0);
    std::vector<StoragePtr> s;
    for (int i = 0; i < 4; ++i) {
      s.push_back(newStorage(8 * kMiB));
      write(*s.back(), 40 + i);
    }
    CHECK_EQ(lms::reclaimInactive(0), 32 * kMiB);
    CHECK(matches(*s[0], 40)); // a page-in on demand
    lms::setPrefetchDepth(2);
    CHECK(matches(*s[3], 43)); // and prefetches ahead of use
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    const auto st = lms::getStats(0);
    CHECK_EQ(st.copy_out_bytes, st.pageout_bytes);
    CHECK_EQ(st.copy_in_bytes, st.pagein_bytes);
    CHECK(st.copy_in_bytes >= int64_t(16 * kMiB));
    CHECK(st.copy_out_ms > 0.0 && st.copy_in_ms > 0.0);
    if (simulated()) {
      for (const double measured :
           {st.copy_out_bytes / (st.copy_out_ms * 1e-3),
            st.copy_in_bytes / (st.copy_in_ms * 1e-3)}) {
        // Sleeps only overshoot: never faster, and not much slower.
        CHECK(measured <= kBytesPerSecond * 1.01);
        CHECK(measured >= kBytesPerSecond * 0.5);
      }
    }
    lms::resetAccumulatedStats(0);
    const auto reset = lms::getStats(0);
    CHECK_EQ(reset.copy_out_bytes, 0);
    CHECK(reset.copy_in_ms == 0.0);
  }
  if (simulated()) {
    simgpu_set_copy_bandwidth(0);
  }
  env.checkBaseline();
}

TEST_CASE(speculative_margin_pages_out_before_the_limit) {
  Env env(32 * kMiB);
  {
    lms::setSpeculativeMargin(8 * kMiB);
    std::vector<StoragePtr> s;
    for (int i = 0; i < 16; ++i) { // 32 MiB: crosses the 24 MiB mark
      s.push_back(newStorage(2 * kMiB));
      write(*s.back(), i);
      CHECK_LE(allocatedBytes(), 24 * kMiB);
    }
    const auto st = lms::getStats(0);
    CHECK(st.reclaim_speculative > 0);
    CHECK_EQ(st.reclaim_limit, 0);
    for (int i = 0; i < 16; ++i) {
      CHECK(matches(*s[i], i));
    }
  }
  env.checkBaseline();
}

TEST_CASE(multithreaded_stress_with_random_operations) {
  Env env(32 * kMiB);
  {
    constexpr int kThreads = 4;
    constexpr int kShared = 8;
    std::vector<StoragePtr> shared;
    for (int i = 0; i < kShared; ++i) {
      shared.push_back(newStorage(2 * kMiB));
      write(*shared.back(), 1000 + i);
    }
    std::atomic<int> mismatches{0};
    std::atomic<int> errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        try {
          c10::cuda::set_device(0);
          c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
          std::mt19937_64 rng(t);
          std::map<int, std::pair<StoragePtr, uint64_t>> mine;
          for (int iter = 0; iter < 400; ++iter) {
            const int key = static_cast<int>(rng() % 10);
            auto it = mine.find(key);
            switch (rng() % 5) {
              case 0: // allocate (or replace) and write
                mine[key] = {newStorage((1 + rng() % 3) * kMiB), rng()};
                write(*mine[key].first, mine[key].second);
                break;
              case 1: // verify
                if (it != mine.end()) {
                  mismatches += !matches(*it->second.first, it->second.second);
                }
                break;
              case 2: // free
                if (it != mine.end()) {
                  mine.erase(it);
                }
                break;
              case 3: { // read a shared storage
                const int i = static_cast<int>(rng() % kShared);
                mismatches += !matches(*shared[i], 1000 + i);
                break;
              }
              case 4: // raw access
                if (it != mine.end()) {
                  lms::access(*it->second.first);
                  (void)it->second.first->data();
                }
                break;
            }
          }
          for (auto& [key, entry] : mine) {
            mismatches += !matches(*entry.first, entry.second);
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "  thread %d: %s\n", t, e.what());
          ++errors;
        }
      });
    }
    for (auto& th : threads) {
      th.join();
    }
    CHECK_EQ(errors.load(), 0);
    CHECK_EQ(mismatches.load(), 0);
    CHECK(lms::getStats(0).pageout_count > 0);
    for (int i = 0; i < kShared; ++i) {
      CHECK(matches(*shared[i], 1000 + i));
    }
  }
  env.checkBaseline();
}

TEST_CASE(devices_reclaim_independently) {
  if (deviceCount() < 2) {
    SKIP("needs two devices (simulated: SIMGPU_DEVICE_COUNT=2)");
  }
  Env env(16 * kMiB);
  {
    std::vector<std::thread> threads;
    std::atomic<int> mismatches{0};
    std::atomic<int> errors{0};
    for (int d = 0; d < 2; ++d) {
      threads.emplace_back([&, d] {
        try {
          c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
          std::vector<StoragePtr> s;
          for (int i = 0; i < 16; ++i) {
            s.push_back(newStorage(2 * kMiB));
            write(*s.back(), d * 100 + i);
          }
          for (int i = 0; i < 16; ++i) {
            mismatches += !matches(*s[i], d * 100 + i);
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "  device %d: %s\n", d, e.what());
          ++errors;
        }
      });
    }
    for (auto& th : threads) {
      th.join();
    }
    CHECK_EQ(errors.load(), 0);
    CHECK_EQ(mismatches.load(), 0);
    CHECK(lms::getStats(0).pageout_count > 0);
    CHECK(lms::getStats(1).pageout_count > 0);
  }
  env.checkBaseline();
}

} // namespace

// ---------------------------------------------------------------------------
// Recompute: storages with a recipe are dropped instead of paged out where
// recomputing costs less, and recomputed when pinned. The recipes here are
// a fake of what operator-boundary pinning records: a storage's contents are
// the pattern of a seed, and "replaying its operator" writes that pattern
// into a new storage.
// ---------------------------------------------------------------------------

using lms_test::FakeRecipes;
using lms_test::recipes;

// The fake recipes installed for a test, and the bus measured (a drop is
// priced against it).
class RecomputeEnv : public lms_test::FakeRecipesInstalled {
 public:
  RecomputeEnv() {
    measureBus();
  }

  // A storage of `bytes` holding the pattern of `seed`, with a recipe.
  StoragePtr withRecipe(size_t bytes, uint64_t seed) {
    auto s = newStorage(bytes);
    write(*s, seed);
    {
      FakeRecipes& r = recipes();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.seed[s->_mutable_data_ptr_no_checks().get_context()] = seed;
    }
    lms::setRecomputable(*s, true);
    return s;
  }

  // withRecipe(), then dropped by a reclaim of everything inactive.
  StoragePtr dropped(size_t bytes, uint64_t seed) {
    auto s = withRecipe(bytes, seed);
    lms::reclaimInactive(0);
    REQUIRE(state(s) == lms::StorageState::Dropped);
    return s;
  }

  // Pages one storage without a recipe out and in: the copy bandwidth is
  // then measured.
  void measureBus() {
    auto s = newStorage(4 * kMiB);
    write(*s, 99);
    lms::reclaimInactive(0);
    CHECK(matches(*s, 99));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    REQUIRE(lms::copyCostMs(0, kMiB, false) > 0.0);
    REQUIRE(lms::copyCostMs(0, kMiB, true) > 0.0);
  }
};

TEST_CASE(cheap_recipes_are_dropped_and_recomputed_bit_identical) {
  Env env(64 * kMiB);
  {
    RecomputeEnv recompute;
    lms::resetAccumulatedStats(0);
    std::vector<StoragePtr> s;
    for (int i = 0; i < 4; ++i) {
      s.push_back(recompute.withRecipe(8 * kMiB, 200 + i));
    }
    const int64_t host_before = lms::getStats(0).host_bytes.current;
    CHECK_EQ(lms::reclaimInactive(0), 32 * kMiB);
    for (const auto& storage : s) {
      CHECK(state(storage) == lms::StorageState::Dropped);
      // No address while dropped: raw access outside LMS cannot read
      // memory that belongs to someone else.
      CHECK(storage->_mutable_data_ptr_no_checks().get() == nullptr);
    }
    auto st = lms::getStats(0);
    CHECK_EQ(st.drop_count, 4);
    CHECK_EQ(st.drop_bytes, int64_t(32 * kMiB));
    CHECK_EQ(st.pageout_count, 0);
    CHECK_EQ(st.dropped_bytes.current, int64_t(32 * kMiB));
    CHECK_EQ(st.host_bytes.current, host_before); // nothing went to the host
    for (int i = 0; i < 4; ++i) {
      CHECK(matches(*s[i], 200 + i)); // pinned: recomputed
      CHECK(state(s[i]) == lms::StorageState::Inactive);
    }
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    st = lms::getStats(0);
    CHECK_EQ(st.recompute_count, 4);
    CHECK_EQ(st.recompute_bytes, int64_t(32 * kMiB));
    CHECK(st.recompute_ms >= 0.0);
    CHECK_EQ(st.dropped_bytes.current, 0);
    CHECK_EQ(st.pagein_count, 0);
    // The recipe follows the storage: it can be dropped again.
    CHECK_EQ(lms::reclaimInactive(0), 32 * kMiB);
    CHECK_EQ(lms::getStats(0).drop_count, 8);
    CHECK(matches(*s[2], 202));
    s.clear();
    FakeRecipes& r = recipes();
    std::lock_guard<std::mutex> lock(r.mutex);
    CHECK(r.seed.empty()); // every recipe forgotten with its storage
    CHECK_EQ(r.replays, 5);
  }
  CHECK_EQ(lms::getStats(0).dropped_bytes.current, 0);
  env.checkBaseline();
}

TEST_CASE(recipes_costlier_than_the_bus_invalid_or_off_are_paged_out) {
  Env env(64 * kMiB);
  {
    RecomputeEnv recompute;
    auto check_paged_out = [&](uint64_t seed) {
      lms::resetAccumulatedStats(0);
      auto s = recompute.withRecipe(8 * kMiB, seed);
      lms::reclaimInactive(0);
      CHECK(state(s) == lms::StorageState::PagedOut);
      CHECK_EQ(lms::getStats(0).drop_count, 0);
      CHECK_EQ(lms::getStats(0).pageout_count, 1);
      CHECK(matches(*s, seed));
    };
    recipes().cost_ms = 1e9; // slower than any bus
    check_paged_out(300);
    recipes().cost_ms = 0.0;
    recipes().valid = false; // e.g. an input was written in place
    check_paged_out(301);
    recipes().valid = true;
    lms::setRecomputeEnabled(false);
    check_paged_out(302);
    lms::setRecomputeEnabled(true);
    // Without a recipe, too.
    lms::resetAccumulatedStats(0);
    auto plain = newStorage(8 * kMiB);
    write(*plain, 303);
    lms::reclaimInactive(0);
    CHECK(state(plain) == lms::StorageState::PagedOut);
    CHECK(matches(*plain, 303));
  }
  env.checkBaseline();
}

TEST_CASE(recompute_pins_its_inputs_recomputing_them_first) {
  Env env(64 * kMiB);
  {
    RecomputeEnv recompute;
    auto a = recompute.withRecipe(4 * kMiB, 400);
    auto b = recompute.withRecipe(8 * kMiB, 401);
    recipes().input_of[b.get()] = a.get();
    lms::reclaimInactive(0);
    REQUIRE(state(a) == lms::StorageState::Dropped);
    REQUIRE(state(b) == lms::StorageState::Dropped);
    CHECK(matches(*b, 401));
    CHECK(state(a) == lms::StorageState::Inactive); // recomputed for b
    CHECK_EQ(lms::getStats(0).recompute_count, 2);
    CHECK(matches(*a, 400));
  }
  env.checkBaseline();
}

TEST_CASE(a_failed_recompute_leaves_the_storage_dropped_and_retries) {
  Env env(64 * kMiB);
  {
    RecomputeEnv recompute;
    auto s = recompute.dropped(8 * kMiB, 500);
    recipes().fail_next = true;
    bool threw = false;
    try {
      lms::pin(*s);
    } catch (const c10::Error&) {
      threw = true;
    }
    CHECK(threw);
    CHECK(state(s) == lms::StorageState::Dropped);
    CHECK(matches(*s, 500));
  }
  env.checkBaseline();
}

TEST_CASE(a_dropped_storage_that_dies_leaves_nothing_behind) {
  Env env(64 * kMiB);
  {
    RecomputeEnv recompute;
    { auto s = recompute.dropped(8 * kMiB, 600); }
    CHECK_EQ(recipes().forgotten, 1);
    CHECK(recipes().seed.empty());
    CHECK_EQ(lms::getStats(0).dropped_bytes.current, 0);
  }
  env.checkBaseline();
}

// The allocation path drops as it pages out: a limit that leaves room for
// one storage makes each new one push the last out.
TEST_CASE(limit_reclaim_drops_recomputable_victims) {
  Env env(20 * kMiB);
  {
    RecomputeEnv recompute;
    lms::resetAccumulatedStats(0);
    std::vector<StoragePtr> s;
    for (int i = 0; i < 6; ++i) {
      s.push_back(recompute.withRecipe(8 * kMiB, 700 + i));
    }
    const auto st = lms::getStats(0);
    CHECK(st.drop_count >= 4);
    CHECK_EQ(st.pageout_count, 0);
    for (int i = 0; i < 6; ++i) {
      CHECK(matches(*s[i], 700 + i));
    }
    CHECK(lms::getStats(0).recompute_count >= 4);
  }
  env.checkBaseline();
}

// Recompute first: a reclaim drops the storages whose replay is cheap before
// it pages anything out, the most bytes per millisecond of replay first and,
// among equals, the one whose next use is furthest (here, without a learned
// schedule: the least recently used). The storage without a recipe at the
// head of the reclaim order is paged out only once nothing cheap is left.
TEST_CASE(reclaims_drop_cheap_replays_first_best_priced_first) {
  Env env(64 * kMiB);
  {
    RecomputeEnv recompute;
    lms::resetAccumulatedStats(0);
    const double paging = lms::pagingCostMs(0, 8 * kMiB);
    std::printf("  paging 8 MiB out and back in: %.3f ms\n", paging);
    REQUIRE(paging > 0.4); // p/40 above the least price of a replay
    auto plain = newStorage(8 * kMiB); // least recently used
    write(*plain, 800);
    auto dear = recompute.withRecipe(8 * kMiB, 801); // 10x the replay
    auto cheap = recompute.withRecipe(8 * kMiB, 802);
    auto costly = recompute.withRecipe(8 * kMiB, 803); // dearer than paging
    auto stale = recompute.withRecipe(8 * kMiB, 804);
    auto fresh = recompute.withRecipe(8 * kMiB, 805);
    auto cost = [&](const StoragePtr& s, double ms) {
      FakeRecipes& r = recipes();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.cost_of[s->_mutable_data_ptr_no_checks().get_context()] = ms;
    };
    cost(dear, paging / 4);
    cost(cheap, paging / 40);
    cost(costly, paging * 10);
    cost(stale, paging / 20);
    cost(fresh, paging / 20);
    // `stale` and `fresh` cost the same: `fresh` was used later.
    for (int i = 0; i < 3; ++i) {
      lms::beginOperator("recompute_first_" + std::to_string(i), {});
    }
    lms::pin(*fresh);
    lms::unpin(*fresh);
    const auto reclaim_one = [&](const StoragePtr& expected) {
      CHECK_EQ(lms::reclaimBytes(0, 8 * kMiB), 8 * kMiB);
      CHECK(state(expected) == lms::StorageState::Dropped);
    };
    reclaim_one(cheap);
    reclaim_one(stale);
    reclaim_one(fresh);
    reclaim_one(dear);
    CHECK(state(plain) == lms::StorageState::Inactive);
    CHECK(state(costly) == lms::StorageState::Inactive);
    CHECK_EQ(lms::getStats(0).pageout_count, 0);
    // Nothing cheap is left: the reclaim order pages out.
    CHECK_EQ(lms::reclaimBytes(0, 8 * kMiB), 8 * kMiB);
    CHECK(state(plain) == lms::StorageState::PagedOut);
    CHECK(state(costly) == lms::StorageState::Inactive);
    const auto st = lms::getStats(0);
    CHECK_EQ(st.drop_count, 4);
    CHECK_EQ(st.pageout_count, 1);
    CHECK(matches(*plain, 800));
    CHECK(matches(*dear, 801));
    CHECK(matches(*cheap, 802));
    CHECK(matches(*costly, 803));
    CHECK(matches(*stale, 804));
    CHECK(matches(*fresh, 805));
  }
  env.checkBaseline();
}

// One round of cheap drops prices kPricedCandidates (16) storages; a reclaim
// that needs more bytes than one round frees prices again, and drops every
// cheap storage before it pages out the one without a recipe, although that
// one heads the reclaim order.
TEST_CASE(a_reclaim_drops_cheap_replays_beyond_one_round) {
  Env env(128 * kMiB);
  {
    RecomputeEnv recompute;
    lms::resetAccumulatedStats(0);
    const double paging = lms::pagingCostMs(0, 4 * kMiB);
    REQUIRE(paging > 0.0);
    auto plain = newStorage(4 * kMiB); // least recently used
    write(*plain, 900);
    constexpr int kCheap = 20; // more than one round
    std::vector<StoragePtr> cheap;
    for (int i = 0; i < kCheap; ++i) {
      cheap.push_back(recompute.withRecipe(4 * kMiB, 901 + i));
      FakeRecipes& r = recipes();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.cost_of[cheap.back()->_mutable_data_ptr_no_checks().get_context()] =
          paging / 40;
    }
    CHECK_EQ(lms::reclaimBytes(0, kCheap * 4 * kMiB), kCheap * 4 * kMiB);
    const auto st = lms::getStats(0);
    CHECK_EQ(st.drop_count, kCheap);
    CHECK_EQ(st.pageout_count, 0);
    CHECK(state(plain) == lms::StorageState::Inactive);
    for (int i = 0; i < kCheap; ++i) {
      CHECK(state(cheap[i]) == lms::StorageState::Dropped);
    }
    CHECK(matches(*plain, 900));
    for (int i = 0; i < kCheap; ++i) {
      CHECK(matches(*cheap[i], 901 + i));
    }
  }
  env.checkBaseline();
}

// Operators record recipes (isRecordingRecipes) once an allocation wants
// more than half the limit: a model that fits well pays nothing for them,
// and what a first reclaim takes was made with recipes. Turning recompute on
// again starts over.
TEST_CASE(recipes_are_recorded_from_half_the_limit_on) {
  Env env(64 * kMiB);
  {
    lms::setRecomputeEnabled(false);
    CHECK(!lms::isRecordingRecipes());
    lms::setRecomputeEnabled(true);
    CHECK(!lms::isRecordingRecipes());
    auto quarter = newStorage(16 * kMiB);
    CHECK(!lms::isRecordingRecipes());
    auto past_half = newStorage(24 * kMiB); // 40 of 64 MiB
    CHECK(lms::isRecordingRecipes());
    CHECK_EQ(lms::getStats(0).pageout_count, 0); // no reclaim was needed
    lms::setRecomputeEnabled(false);
    CHECK(!lms::isRecordingRecipes());
    lms::setRecomputeEnabled(true);
    CHECK(!lms::isRecordingRecipes()); // until the next allocation past half
    auto more = newStorage(2 * kMiB);
    CHECK(lms::isRecordingRecipes());
  }
  env.checkBaseline();
}

// With recompute off the same storages are paged out in the reclaim order,
// the storage without a recipe first: recompute first changes nothing else.
TEST_CASE(with_recompute_off_reclaims_keep_the_reclaim_order) {
  Env env(64 * kMiB);
  {
    RecomputeEnv recompute;
    lms::setRecomputeEnabled(false);
    lms::resetAccumulatedStats(0);
    auto plain = newStorage(8 * kMiB);
    write(*plain, 810);
    auto cheap = recompute.withRecipe(8 * kMiB, 811);
    CHECK_EQ(lms::reclaimBytes(0, 8 * kMiB), 8 * kMiB);
    CHECK(state(plain) == lms::StorageState::PagedOut);
    CHECK(state(cheap) == lms::StorageState::Inactive);
    CHECK_EQ(lms::getStats(0).drop_count, 0);
    CHECK(matches(*plain, 810));
    CHECK(matches(*cheap, 811));
  }
  env.checkBaseline();
}

namespace c10 {
// The registry's names are unqualified in the macro.
REGISTER_FREE_MEMORY_CALLBACK(
    lms_test_reclaim_before_mapping,
    ::ReclaimBeforeMappingForTest);
} // namespace c10

LMS_TEST_MAIN()
