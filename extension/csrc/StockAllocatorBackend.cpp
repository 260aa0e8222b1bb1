#include "StockAllocatorBackend.h"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>

namespace torch_lms {

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
namespace lms = c10::cuda::lms;

constexpr size_t kMiB = 1024 * 1024;
// Reclaims triggered by a free-list miss keep this much below the limit
// unless lms_headroom_mb says otherwise: a miss does not tell the size of
// the request, so the next few allocations of an operator need room.
constexpr size_t kDefaultHeadroom = 256 * kMiB;

std::atomic<size_t> g_headroom{kDefaultHeadroom};

size_t statCurrent(const c10::CachingDeviceAllocator::StatArray& stat) {
  const int64_t current =
      stat[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)]
          .current;
  return current > 0 ? static_cast<size_t>(current) : 0;
}

// Device memory LMS must never adopt and move: blocks the caching allocator
// handed out into a private pool (CUDA graph pools, torch.cuda.MemPool),
// which the stock allocator reveals only through its trace, and memory used
// during CUDA graph capture. A captured graph bakes in these addresses.
class PrivatePoolTracker {
 public:
  // Memory an operator used during CUDA graph capture: the graph bakes in
  // its address, so it must never be adopted afterwards. Forgotten when the
  // allocator frees it.
  void addGraphUsed(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    ptrs_.insert(reinterpret_cast<size_t>(ptr));
  }

  void onTrace(const alloc::TraceEntry& entry) {
    const auto& pool = entry.mempool_;
    if (entry.action_ == alloc::TraceEntry::ALLOC) {
      if (pool.first == 0 && pool.second == 0) {
        return;
      }
      std::lock_guard<std::mutex> lock(mutex_);
      ptrs_.insert(entry.addr_);
    } else if (entry.action_ == alloc::TraceEntry::FREE_REQUESTED) {
      std::lock_guard<std::mutex> lock(mutex_);
      ptrs_.erase(entry.addr_);
    }
  }

  bool contains(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return ptrs_.count(reinterpret_cast<size_t>(ptr)) != 0;
  }

 private:
  std::mutex mutex_;
  std::unordered_set<size_t> ptrs_;
};

PrivatePoolTracker& privatePools() {
  // Never destroyed: the allocator may trace during static destruction.
  static auto* tracker = new PrivatePoolTracker();
  return *tracker;
}

std::atomic<bool> g_hooks_attached{false};

bool captureUnderway(c10::DeviceIndex device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(
      c10::cuda::getCurrentCUDAStream(device).stream(), &status);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return true; // be safe: never page out while the state is unknown
  }
  return status != cudaStreamCaptureStatusNone;
}

class StockAllocatorBackend final : public lms::DeviceMemoryBackend {
 public:
  void* malloc(c10::DeviceIndex device, size_t size, cudaStream_t stream)
      override {
    // raw_alloc_with_stream allocates on the current device; it throws
    // c10::OutOfMemoryError when even an emptied cache cannot serve `size`.
    c10::cuda::CUDAGuard guard(device);
    return alloc::raw_alloc_with_stream(size, stream);
  }

  void free(void* ptr) override {
    alloc::raw_delete(ptr);
  }

  c10::DataPtr makeDataPtr(void* ptr, c10::DeviceIndex device) override {
    return {
        ptr,
        ptr,
        alloc::get()->raw_deleter(),
        c10::Device(c10::DeviceType::CUDA, device)};
  }

  size_t allocatedBytes(c10::DeviceIndex device) override {
    return statCurrent(alloc::getDeviceStats(device).allocated_bytes);
  }

  size_t reservedBytes(c10::DeviceIndex device) override {
    return statCurrent(alloc::getDeviceStats(device).reserved_bytes);
  }

  void freeAfter(void* ptr, c10::DeviceIndex device, cudaStream_t stream)
      override {
    // The stock allocator orders reuse after other streams through
    // recordStream on a DataPtr it recognises by its deleter. The temporary
    // DataPtr must not free the memory itself: its context is released
    // before it goes out of scope, and raw_delete() then returns the block,
    // to be reused once `stream`'s work so far is done.
    c10::cuda::CUDAGuard guard(device);
    c10::DataPtr data_ptr = makeDataPtr(ptr, device);
    try {
      alloc::recordStream(
          data_ptr, c10::cuda::getStreamFromExternal(stream, device));
    } catch (...) {
      (void)data_ptr.release_context();
      throw;
    }
    (void)data_ptr.release_context();
    alloc::raw_delete(ptr);
  }

  bool adoptable(const c10::DataPtr& data_ptr) override {
    if (data_ptr.get_deleter() != alloc::get()->raw_deleter() ||
        !g_hooks_attached.load()) {
      return false;
    }
    if (captureUnderway(data_ptr.device().index())) {
      // The engine does not adopt during capture; remember the address so
      // that it is not adopted (and moved) after the capture either.
      privatePools().addGraphUsed(data_ptr.get());
      return false;
    }
    return !privatePools().contains(data_ptr.get());
  }
};

// Called by the caching allocator, under its own (recursive) lock, whenever
// its free list cannot serve a request. Pages out inactive storages until
// the bytes allocated to tensors are `headroom` below the limit.
class LmsFreeMemoryCallback final : public c10::FreeMemoryCallback {
 public:
  bool Execute() override {
    if (!lms::isEnabled() || lms::getBackend() == nullptr) {
      return false;
    }
    try {
      const c10::DeviceIndex device = c10::cuda::current_device();
      if (captureUnderway(device)) {
        return false; // a page-out copy cannot join a capture
      }
      return makeHeadroom(device) > 0;
    } catch (const std::exception& e) {
      // The allocator goes on to cudaMalloc and, failing that, raises its
      // own out-of-memory error; a callback must not throw through it.
      TORCH_WARN_ONCE(
          "Large Model Support: reclaim on allocation failed: ", e.what());
      return false;
    }
  }
};

} // namespace

void installBackend() {
  // Never destroyed: storage deleters may run during static destruction.
  static auto* backend = new StockAllocatorBackend();
  if (lms::getBackend() == nullptr) {
    lms::setBackend(backend);
  }
  TORCH_CHECK(
      lms::getBackend() == backend,
      "torch_lms: another Large Model Support backend is already installed; "
      "is this PyTorch built with LMS? Use its torch.cuda LMS API instead of "
      "torch_lms.");
}

void attachAllocatorHooks() {
  static std::once_flag once;
  std::call_once(once, [] {
    alloc::attachAllocatorTraceTracker(
        [](const alloc::TraceEntry& entry) { privatePools().onTrace(entry); });
    // After an out-of-memory error inside an operator, make room for a retry
    // of the same request and keep that much headroom from now on.
    alloc::attachOutOfMemoryObserver([](int64_t device,
                                        size_t /*allocated*/,
                                        size_t /*device_total*/,
                                        size_t /*device_free*/) {
      if (!lms::isEnabled()) {
        return;
      }
      try {
        const auto index = static_cast<c10::DeviceIndex>(device);
        if (captureUnderway(index)) {
          return;
        }
        const size_t limit = effectiveLimit(index);
        const size_t headroom = g_headroom.load();
        const size_t grown = std::min(limit / 4, headroom * 2);
        if (grown > headroom) {
          g_headroom.store(grown);
        }
        (void)makeHeadroom(index);
      } catch (const std::exception& e) {
        TORCH_WARN_ONCE(
            "Large Model Support: reclaim after out-of-memory failed: ",
            e.what());
      }
    });
    g_hooks_attached.store(true);
  });
}

void setHeadroom(size_t bytes) {
  g_headroom.store(bytes);
}

size_t getHeadroom() {
  return g_headroom.load();
}

size_t effectiveLimit(c10::DeviceIndex device) {
  size_t limit = lms::getLimit(device);
  const double fraction = alloc::get()->getMemoryFraction(device);
  if (fraction > 0.0 && fraction < 1.0) {
    c10::cuda::CUDAGuard guard(device);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const auto capped =
        static_cast<size_t>(fraction * static_cast<double>(total_bytes));
    limit = std::min(limit, capped);
  }
  return limit;
}

size_t makeHeadroom(c10::DeviceIndex device) {
  lms::DeviceMemoryBackend* backend = lms::getBackend();
  TORCH_CHECK(
      backend != nullptr,
      "torch_lms: the LMS backend is not installed; import torch_lms first");
  const size_t headroom = g_headroom.load();
  // Allocated bytes against the LMS limit...
  const size_t limit = effectiveLimit(device);
  const size_t allocated = backend->allocatedBytes(device);
  size_t excess = allocated + headroom > limit ? allocated + headroom - limit : 0;
  // ...and, under a memory-fraction cap, reserved bytes against the cap: a
  // request the cached segments cannot serve needs a new segment, which the
  // cap refuses once fragmentation has used it up. Paging out inactive
  // storages frees space inside the segments for the free list instead.
  const double fraction = alloc::get()->getMemoryFraction(device);
  if (fraction > 0.0 && fraction < 1.0) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    }
    const auto cap =
        static_cast<size_t>(fraction * static_cast<double>(total_bytes));
    const size_t reserved = backend->reservedBytes(device);
    if (reserved + headroom > cap) {
      excess = std::max(excess, reserved + headroom - cap);
    }
  }
  return excess == 0 ? 0 : lms::reclaimBytes(device, excess);
}

size_t reclaimDownTo(c10::DeviceIndex device, size_t target) {
  lms::DeviceMemoryBackend* backend = lms::getBackend();
  TORCH_CHECK(
      backend != nullptr,
      "torch_lms: the LMS backend is not installed; import torch_lms first");
  const size_t before = backend->allocatedBytes(device);
  if (before <= target) {
    return 0;
  }
  // The engine pages out least-recently-used inactive storages totalling at
  // least the excess (counted as a limit-triggered reclaim).
  (void)lms::reclaimBytes(device, before - target);
  const size_t after = backend->allocatedBytes(device);
  return before > after ? before - after : 0;
}

void applyEnvironmentConfig() {
  const char* conf = std::getenv("PYTORCH_LMS_CONF");
  if (conf == nullptr) {
    return;
  }
  lms::parseConfig(conf);
  // The extension's own key, same syntax.
  std::string_view rest(conf);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view()
                                           : rest.substr(comma + 1);
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      continue;
    }
    std::string key(item.substr(0, colon));
    std::string value(item.substr(colon + 1));
    key.erase(0, key.find_first_not_of(' '));
    key.erase(key.find_last_not_of(' ') + 1);
    if (key != "lms_headroom_mb") {
      continue;
    }
    char* end = nullptr;
    const double mib = std::strtod(value.c_str(), &end);
    TORCH_CHECK(
        end != value.c_str() && *end == '\0' && mib >= 0,
        "PYTORCH_LMS_CONF: lms_headroom_mb expects a non-negative number of "
        "MiB, got '",
        value,
        "'");
    setHeadroom(static_cast<size_t>(mib * kMiB));
  }
}

} // namespace torch_lms

namespace c10 {
// The caching allocator runs every registered callback when its free list
// misses, before it asks the device for more memory.
REGISTER_FREE_MEMORY_CALLBACK(
    LargeModelSupportReclaim,
    torch_lms::LmsFreeMemoryCallback);
} // namespace c10
