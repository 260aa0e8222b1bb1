#pragma once

// The c10 APIs that the standalone build's tests and benchmarks use where the
// supported PyTorch releases differ. standalone/CMakeLists.txt probes the tree
// and defines the LMS_C10_HAS_* macros. The LMS engine needs none of this: it
// builds unchanged against every release, whose series supplies what it uses.

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#if LMS_C10_HAS_CACHING_DEVICE_ALLOCATOR
#include <c10/core/CachingDeviceAllocator.h>
#endif

namespace lms_compat {

namespace cca = c10::cuda::CUDACachingAllocator;

// The caching allocator's statistics of one device.
using DeviceStats = decltype(cca::getDeviceStats(0));

#if LMS_C10_HAS_CACHING_DEVICE_ALLOCATOR
using StatType = c10::CachingDeviceAllocator::StatType;
#else
using StatType = cca::StatType;
#endif

// The AGGREGATE entry of a per-pool statistic (allocated_bytes, segment, ...).
template <typename StatArray>
int64_t aggregate(const StatArray& stat) {
  return stat[static_cast<size_t>(StatType::AGGREGATE)].current;
}

// The address to write a storage's contents at: mutable_data() where
// StorageImpl separates it from data(), data() before.
inline void* mutableData(c10::StorageImpl& storage) {
#if LMS_C10_HAS_MUTABLE_DATA
  return storage.mutable_data();
#else
  return storage.data();
#endif
}

// The caching allocator's backend; releases without name() have only the
// native one.
inline std::string allocatorName() {
#if LMS_C10_HAS_ALLOCATOR_NAME
  return cca::name();
#else
  return "native";
#endif
}

// Collects the messages of c10 warnings (TORCH_WARN) instead of printing
// them, while it lives. Releases whose warning handler takes a Warning object
// keep the handler functions in WarningUtils; earlier ones take the message
// and keep them in the Warning namespace.
class WarningCollector : public c10::WarningHandler {
 public:
  WarningCollector() : previous_(handlers::get_warning_handler()) {
    handlers::set_warning_handler(this);
  }
  ~WarningCollector() override {
    handlers::set_warning_handler(previous_);
  }
  WarningCollector(const WarningCollector&) = delete;
  WarningCollector& operator=(const WarningCollector&) = delete;

#if LMS_C10_HAS_WARNING_OBJECT
  void process(const c10::Warning& warning) override {
    add(warning.msg());
  }
#else
  void process(
      const c10::SourceLocation& /*source_location*/,
      const std::string& msg,
      const bool /*verbatim*/) override {
    add(msg);
  }
#endif

  // How many of the warnings collected contain `text`.
  int count(const std::string& text) const {
    std::lock_guard<std::mutex> lock(mutex_);
    int n = 0;
    for (const std::string& message : messages_) {
      n += message.find(text) != std::string::npos ? 1 : 0;
    }
    return n;
  }

 private:
#if LMS_C10_HAS_WARNING_OBJECT
  struct handlers {
    static c10::WarningHandler* get_warning_handler() {
      return c10::WarningUtils::get_warning_handler();
    }
    static void set_warning_handler(c10::WarningHandler* handler) {
      c10::WarningUtils::set_warning_handler(handler);
    }
  };
#else
  struct handlers {
    static c10::WarningHandler* get_warning_handler() {
      return c10::Warning::get_warning_handler();
    }
    static void set_warning_handler(c10::WarningHandler* handler) {
      c10::Warning::set_warning_handler(handler);
    }
  };
#endif

  void add(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    messages_.push_back(message);
  }

  c10::WarningHandler* previous_;
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
};

// A CUDA graph capture of `stream` for a scope, as the caching allocator
// sees one: what the release's CUDAGraph::capture_begin tells the allocator,
// in its order around beginning the capture, and what capture_end tells it
// around ending it. Releases with beginAllocateToPool route the stream's
// allocations to a private pool from before the capture begins to after it
// ends; earlier ones are told of the capture (notifyCaptureBegin) right after
// it begins and of its end right before. `set_capturing` begins and ends the
// capture itself (the simulated GPU's simgpu_set_capturing).
class CaptureScope {
 public:
  using SetCapturing = cudaError_t (*)(cudaStream_t, int);

  CaptureScope(
      c10::DeviceIndex device,
      cudaStream_t stream,
      SetCapturing set_capturing)
      : device_(device), stream_(stream), set_capturing_(set_capturing) {
    // A pool of its own each time, as graph_pool_handle() makes one (the
    // simulated GPU's capture ids repeat: they are the stream's).
    static std::atomic<c10::cuda::CaptureId_t> next{1};
    pool_ = {0, next.fetch_add(1)};
#if LMS_C10_HAS_ALLOCATE_TO_POOL
    cca::beginAllocateToPool(
        device_, pool_, [stream](cudaStream_t s) { return s == stream; });
    C10_CUDA_CHECK(set_capturing_(stream_, 1));
#else
    C10_CUDA_CHECK(set_capturing_(stream_, 1));
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream_, &status, &graph_));
    cca::notifyCaptureBegin(device_, graph_, pool_);
#endif
  }

  ~CaptureScope() {
#if LMS_C10_HAS_ALLOCATE_TO_POOL
    C10_CUDA_CHECK_WARN(set_capturing_(stream_, 0));
    cca::endAllocateToPool(device_, pool_);
    cca::releasePool(device_, pool_);
#else
    cca::notifyCaptureEnd(device_, graph_);
    C10_CUDA_CHECK_WARN(set_capturing_(stream_, 0));
    cca::notifyCaptureDestroy(device_, pool_);
#endif
  }

  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  c10::DeviceIndex device_;
  cudaStream_t stream_;
  SetCapturing set_capturing_;
  c10::cuda::MempoolId_t pool_{0, 0};
#if !LMS_C10_HAS_ALLOCATE_TO_POOL
  c10::cuda::CaptureId_t graph_ = 0;
#endif
};

} // namespace lms_compat
