#include "StockAllocatorBackend.h"

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// The CUDAAllocator interface grows between releases; the LMS allocator
// forwards every virtual of the release it is built against, so a new
// method's default (often "not supported") never hides the stock one.
#define TORCH_LMS_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||            \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace torch_lms {

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
namespace lms = c10::cuda::lms;

// Profiler ranges (user annotations of torch.profiler) around LMS's handling
// of an allocation and, inside it, the caching allocator's own malloc, so
// that a profile tells the host time of each apart where the device sits idle
// (benchmarks/stream_profile.py). Recorded only while a profiler runs.
constexpr const char* kAllocateRange = "lms::allocate";
constexpr const char* kMallocRange = "lms::caching_allocator_malloc";

// The page in which the stock allocator maps expandable segments of its large
// pool (kLargeBuffer in CUDACachingAllocator.cpp, not exported).
constexpr size_t kExpandablePageBytes = 20 * 1024 * 1024;

size_t statCurrent(const c10::CachingDeviceAllocator::StatArray& stat) {
  const int64_t current =
      stat[static_cast<size_t>(
               c10::CachingDeviceAllocator::StatType::AGGREGATE)]
          .current;
  return current > 0 ? static_cast<size_t>(current) : 0;
}

// Whether `pool` is a private pool (a CUDA graph pool, a torch.cuda.MemPool)
// rather than the default one.
bool isPrivate(const c10::MempoolId_t& pool) {
  return pool.first != 0 || pool.second != 0;
}

// Every segment of the stock allocator with its blocks in address order. It
// walks every block: for statistics, error messages and the allocation-failure
// path, never the fast path.
alloc::SnapshotInfo snapshot() {
  return alloc::get()->snapshot(
      c10::MempoolId_t{0, 0}, /*include_traces=*/false);
}

// Whether the allocator's trace reaches this file (attachAllocatorHooks).
std::atomic<bool> g_hooks_attached{false};

// Device memory LMS must never adopt and move: blocks the caching allocator
// handed out into a private pool (CUDA graph pools, torch.cuda.MemPool),
// which the stock allocator reveals through its trace and its snapshot, and
// memory used during CUDA graph capture. A captured graph bakes in these
// addresses. Only storages allocated before LMS took the allocation path are
// ever adopted.
//
// The trace is attached when LMS is first enabled, but a pool may be older: a
// CUDA graph pool made while LMS was off (an uncapped first run), which later
// warm-ups and captures of the same CUDA graph tree reuse. What the pools hold
// is therefore read from the allocator's snapshot, not counted from the trace
// (which would miss such a pool's segments, and count below zero once they
// are freed), and the blocks they handed out before the trace was attached
// are taken from the snapshot once, before the first adoption.
class PrivatePoolTracker {
 public:
  void addGraphUsed(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    ptrs_.insert(reinterpret_cast<size_t>(ptr));
  }

  void onTrace(const alloc::TraceEntry& entry) {
    switch (entry.action_) {
      case alloc::TraceEntry::SEGMENT_ALLOC:
      case alloc::TraceEntry::SEGMENT_FREE:
      case alloc::TraceEntry::SEGMENT_MAP:
      case alloc::TraceEntry::SEGMENT_UNMAP:
        // What the pools reserve may have changed: the next reservedBytes()
        // reads a snapshot again.
        segment_changes_.fetch_add(1, std::memory_order_relaxed);
        break;
      case alloc::TraceEntry::ALLOC:
        if (isPrivate(entry.mempool_)) {
          std::lock_guard<std::mutex> lock(mutex_);
          ptrs_.insert(entry.addr_);
        }
        break;
      case alloc::TraceEntry::FREE_REQUESTED: {
        std::lock_guard<std::mutex> lock(mutex_);
        ptrs_.erase(entry.addr_);
        break;
      }
      default:
        break;
    }
  }

  // Bytes the private pools of `device` reserve now: the segments of the
  // allocator's snapshot that a private pool owns (those of pools waiting to
  // be freed included). A snapshot walks every block of the allocator, so once
  // the trace is attached the figure is kept until the allocator allocates,
  // frees, maps or unmaps a segment: torch.cuda.lms_stats() called every step
  // then costs a snapshot only after the segments changed.
  size_t reservedBytes(c10::DeviceIndex device) {
    const bool traced = g_hooks_attached.load();
    const uint64_t changes = segment_changes_.load(std::memory_order_relaxed);
    if (traced) {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = reserved_.find(device);
      if (it != reserved_.end() && it->second.first == changes) {
        return it->second.second;
      }
    }
    size_t bytes = 0;
    for (const auto& segment : snapshot().segments) {
      if (segment.device == device &&
          isPrivate(segment.owner_private_pool_id)) {
        bytes += segment.total_size;
      }
    }
    if (traced) {
      // Kept under the count read before the snapshot: a segment change
      // during it makes the next call read again.
      std::lock_guard<std::mutex> lock(mutex_);
      reserved_[device] = {changes, bytes};
    }
    return bytes;
  }

  bool contains(const void* ptr) {
    std::call_once(seeded_, [this] { addLiveBlocksOfPools(); });
    std::lock_guard<std::mutex> lock(mutex_);
    return ptrs_.count(reinterpret_cast<size_t>(ptr)) != 0;
  }

 private:
  // The blocks that private pools have handed out, as the snapshot lists
  // them (each segment's blocks in address order), so that those handed out
  // before the trace was attached are never adopted either. Blocks freed
  // between the snapshot and this insertion stay listed: their memory is
  // only left alone, never moved.
  void addLiveBlocksOfPools() {
    std::vector<size_t> live;
    try {
      for (const auto& segment : snapshot().segments) {
        if (!isPrivate(segment.owner_private_pool_id)) {
          continue;
        }
        size_t address = segment.address;
        for (const auto& block : segment.blocks) {
          if (block.allocated) {
            live.push_back(address);
          }
          address += block.size;
        }
      }
    } catch (const std::exception& e) {
      TORCH_WARN(
          "torch_lms: the caching allocator's snapshot failed (",
          e.what(),
          "); CUDA graph pool memory allocated before LMS was enabled is not "
          "protected from adoption");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ptrs_.insert(live.begin(), live.end());
  }

  std::mutex mutex_;
  std::once_flag seeded_;
  std::unordered_set<size_t> ptrs_;
  // Segment allocations, frees, maps and unmaps seen in the trace.
  std::atomic<uint64_t> segment_changes_{0};
  // Per device: reservedBytes() and the segment_changes_ it was read at.
  std::unordered_map<c10::DeviceIndex, std::pair<uint64_t, size_t>> reserved_;
};

PrivatePoolTracker& privatePools() {
  // Never destroyed: the allocator may trace during static destruction.
  static auto* tracker = new PrivatePoolTracker();
  return *tracker;
}

// Per device: how many routings of allocations into a private pool are open
// (beginAllocateToPool without its endAllocateToPool yet).
std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> g_pool_routing{};

std::atomic<int>& poolRouting(c10::DeviceIndex device) {
  TORCH_CHECK(
      device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS,
      "torch_lms: CUDA device index ",
      std::to_string(device),
      " is out of range");
  return g_pool_routing[device];
}

bool routedToPool(c10::DeviceIndex device) {
  return poolRouting(device).load(std::memory_order_relaxed) > 0;
}

// Of all devices: one load on the allocation path instead of one a device.
std::atomic<int> g_pool_routing_total{0};

bool anyPoolRouting() {
  return g_pool_routing_total.load(std::memory_order_relaxed) > 0;
}

// Counts a routing's end. One that began before this allocator was installed
// (inside torch.cuda.use_mem_pool, say) was never counted: its end must not
// take the count below zero, or a later capture's routing would read as none
// (its allocations would reach LMS, and the capture check be skipped).
void endRouting(std::atomic<int>& count) {
  int open = count.load();
  while (open > 0 && !count.compare_exchange_weak(open, open - 1)) {
  }
}

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

// The request the stock allocator is serving for the engine on this thread:
// its free-memory callbacks are told nothing of it.
struct Request {
  c10::DeviceIndex device = -1;
  size_t size = 0;
  cudaStream_t stream = nullptr;
};
thread_local Request t_request;

// Marks the request for its duration (the callback may free memory, never
// allocate it, but a nested request restores the outer one all the same).
class RequestScope {
 public:
  explicit RequestScope(Request request) : outer_(t_request) {
    t_request = request;
  }
  ~RequestScope() {
    t_request = outer_;
  }
  RequestScope(const RequestScope&) = delete;
  RequestScope& operator=(const RequestScope&) = delete;

 private:
  Request outer_;
};

// The engine's access to device memory: the stock caching allocator itself,
// never the LMS allocator in front of it (which would call the engine back).
class StockAllocatorBackend final : public lms::DeviceMemoryBackend {
 public:
  explicit StockAllocatorBackend(alloc::CUDAAllocator* stock) : stock_(stock) {}

  void* malloc(c10::DeviceIndex device, size_t size, cudaStream_t stream)
      override {
    // raw_alloc_with_stream allocates on the current device. When its free
    // list holds nothing for the request, its free-memory callbacks run
    // (ReclaimBeforeMapping, below, for this request). It throws
    // c10::OutOfMemoryError once its free list, a new segment and releasing
    // its cached blocks (which gives them back to other processes too) have
    // all failed; the engine then pages out and retries.
    RECORD_USER_SCOPE(kMallocRange); // a local named `guard`
    c10::cuda::CUDAGuard device_guard(device);
    const RequestScope request(Request{device, size, stream});
    return stock_->raw_alloc_with_stream(size, stream);
  }

  void free(void* ptr) override {
    stock_->raw_delete(ptr);
  }

  c10::DataPtr makeDataPtr(void* ptr, c10::DeviceIndex device) override {
    return {
        ptr,
        ptr,
        stock_->raw_deleter(),
        c10::Device(c10::DeviceType::CUDA, device)};
  }

  size_t allocatedBytes(c10::DeviceIndex device) override {
    return statCurrent(stock_->getDeviceStats(device).allocated_bytes);
  }

  size_t reservedBytes(c10::DeviceIndex device) override {
    return statCurrent(stock_->getDeviceStats(device).reserved_bytes);
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
      stock_->recordStream(
          data_ptr, c10::cuda::getStreamFromExternal(stream, device));
    } catch (...) {
      (void)data_ptr.release_context();
      throw;
    }
    (void)data_ptr.release_context();
    stock_->raw_delete(ptr);
  }

  // PyTorch opens a routing to a private pool before every CUDA graph
  // capture (CUDAGraph::capture_begin) and closes it after the capture ends,
  // and the stock allocator relies on it to keep a capture's memory apart.
  bool captureMayBeUnderway() override {
    return anyPoolRouting();
  }

  bool adoptable(const c10::DataPtr& data_ptr) override {
    if (data_ptr.get_deleter() != stock_->raw_deleter() ||
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

  size_t privatePoolBytes(c10::DeviceIndex device) override {
    return privatePools().reservedBytes(device);
  }

  // Cached free blocks of the default pool go back to the device (the stock
  // emptyCache, which also unmaps free pages of expandable segments). Never
  // while allocations of any device are routed to a private pool (a CUDA
  // graph capture or its warm-up): the stock allocator synchronizes to free
  // blocks, and asserts that no capture is underway.
  bool releaseCachedMemory(c10::DeviceIndex device) override {
    if (anyPoolRouting() || captureUnderway(device)) {
      return false;
    }
    c10::cuda::CUDAGuard guard(device);
    stock_->emptyCache(c10::MempoolId_t{0, 0});
    return true;
  }

  // From the stock allocator's snapshot.
  std::vector<lms::SegmentMap> segments(
      c10::DeviceIndex device,
      cudaStream_t stream) override {
    std::vector<lms::SegmentMap> maps;
    for (const auto& segment : snapshot().segments) {
      if (segment.device != device || !segment.is_large ||
          segment.stream != stream ||
          isPrivate(segment.owner_private_pool_id)) {
        continue;
      }
      lms::SegmentMap map;
      map.base = static_cast<uintptr_t>(segment.address);
      // The stock allocator maps expandable segments of the large pool in
      // pages of its kLargeBuffer (20 MiB), from the start of each mapped
      // range it reports.
      map.page_bytes = segment.is_expandable ? kExpandablePageBytes : 0;
      map.blocks.reserve(segment.blocks.size());
      for (const auto& block : segment.blocks) {
        map.blocks.emplace_back(
            static_cast<size_t>(block.size), block.allocated);
      }
      maps.push_back(std::move(map));
    }
    return maps;
  }

  // Under torch.cuda.set_per_process_memory_fraction the stock allocator
  // refuses to reserve more than that share of the device: the LMS limit
  // stays within it, so reclaims happen before the allocator fails.
  size_t capacityBytes(c10::DeviceIndex device) override {
    const double fraction = stock_->getMemoryFraction(device);
    if (!(fraction > 0.0 && fraction < 1.0)) {
      return SIZE_MAX;
    }
    return static_cast<size_t>(
        fraction * static_cast<double>(deviceTotal(device)));
  }

 private:
  size_t deviceTotal(c10::DeviceIndex device) {
    TORCH_CHECK(
        device >= 0 && device < static_cast<c10::DeviceIndex>(totals_.size()),
        "torch_lms: CUDA device index ",
        std::to_string(device),
        " is out of range");
    size_t total = totals_[device].load(std::memory_order_relaxed);
    if (total == 0) {
      c10::cuda::CUDAGuard guard(device);
      size_t free_bytes = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
      totals_[device].store(total, std::memory_order_relaxed);
    }
    return total;
  }

  alloc::CUDAAllocator* stock_;
  std::array<std::atomic<size_t>, C10_COMPILE_TIME_MAX_GPUS> totals_{};
};

// The allocator PyTorch calls. It is what a pluggable allocator would be,
// except that it keeps the stock caching allocator underneath: statistics,
// snapshots, empty_cache, record_stream, CUDA graph pools, MemPool, IPC and
// expandable segments all stay the stock allocator's.
class LmsAllocator final : public alloc::CUDAAllocator {
 public:
  explicit LmsAllocator(alloc::CUDAAllocator* stock) : stock_(stock) {}

  alloc::CUDAAllocator* stock() const {
    return stock_;
  }

  // --- The allocation path --------------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    if (!lms::isEnabled() || size == 0) {
      return stock_->allocate(size);
    }
    const c10::DeviceIndex device = c10::cuda::current_device();
    if (routedToPool(device)) {
      return inPrivatePool(
          device, size, [&] { return stock_->allocate(size); });
    }
    RECORD_USER_SCOPE(kAllocateRange);
    return lms::allocate(
        device, size, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc(size_t size) override {
    return raw_alloc_with_stream(
        size, c10::cuda::getCurrentCUDAStream().stream());
  }

  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    // Workspaces (cuBLAS, cuDNN, NCCL) are never paged out, but they need
    // room like any tensor: the engine reclaims for them and retries.
    if (!lms::isEnabled() || size == 0) {
      return stock_->raw_alloc_with_stream(size, stream);
    }
    const c10::DeviceIndex device = c10::cuda::current_device();
    if (routedToPool(device)) {
      return inPrivatePool(device, size, [&] {
        return stock_->raw_alloc_with_stream(size, stream);
      });
    }
    RECORD_USER_SCOPE(kAllocateRange);
    return lms::allocateRaw(device, size, stream);
  }

  void raw_delete(void* ptr) override {
    stock_->raw_delete(ptr);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return stock_->raw_deleter();
  }

  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override {
    return !lms::isManaged(data_ptr) && stock_->is_simple_data_ptr(data_ptr);
  }

  void copy_data(void* dest, const void* src, std::size_t count)
      const override {
    stock_->copy_data(dest, src, count);
  }

  using alloc::CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream)
      override {
    if (lms::isManaged(ptr)) {
      // The stock allocator does not know LMS DataPtrs: the engine orders a
      // page-out, and the reuse of freed memory, after the stream.
      lms::recordStream(ptr, stream.stream());
      return;
    }
    stock_->recordStream(ptr, stream);
  }

  void emptyCache(c10::MempoolId_t mempool_id) override {
    stock_->emptyCache(mempool_id);
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      lms::releaseCachedHostMemory();
    }
  }

  // Private pools (CUDA graphs, MemPool): while allocations of a device are
  // routed into one, LMS leaves that device's allocations alone.
  void beginAllocateToPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    stock_->beginAllocateToPool(device, mempool_id, std::move(filter));
    poolRouting(device).fetch_add(1);
    g_pool_routing_total.fetch_add(1);
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id)
      override {
    stock_->endAllocateToPool(device, mempool_id);
    endRouting(poolRouting(device));
    endRouting(g_pool_routing_total);
  }

  // --- Forwarded unchanged
  // ----------------------------------------------------

  void init(int device_count) override {
    stock_->init(device_count);
  }
  bool initialized() override {
    return stock_->initialized();
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    return stock_->getMemoryFraction(device);
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    stock_->setMemoryFraction(fraction, device);
  }
  std::vector<alloc::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override {
    return stock_->getExpandableSegmentSizes(device);
  }
  void enable(bool value) override {
    stock_->enable(value);
  }
  bool isEnabled() const override {
    return stock_->isEnabled();
  }
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    stock_->cacheInfo(device, largestBlock);
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    return stock_->getBaseAllocation(ptr, size);
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(
      c10::DeviceIndex device) override {
    return stock_->getDeviceStats(device);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    stock_->resetAccumulatedStats(device);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    stock_->resetPeakStats(device);
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    return stock_->getMemoryInfo(device);
  }
  alloc::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces)
      override {
    return stock_->snapshot(mempool_id, include_traces);
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id)
      override {
    stock_->releasePool(device, mempool_id);
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id)
      override {
    return stock_->getPoolUseCount(device, mempool_id);
  }
  void createOrIncrefPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::shared_ptr<alloc::CUDAAllocator> allocator) override {
    stock_->createOrIncrefPool(device, mempool_id, std::move(allocator));
  }
  void setUseOnOOM(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      bool use_on_oom) override {
    stock_->setUseOnOOM(device, mempool_id, use_on_oom);
  }
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id)
      override {
    stock_->setNoSplit(device, mempool_id);
  }
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    return stock_->checkPoolLiveAllocations(
        device, mempool_id, expected_live_allocations);
  }
  alloc::ShareableHandle shareIpcHandle(void* ptr) override {
    return stock_->shareIpcHandle(ptr);
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return stock_->getIpcDevPtr(std::move(handle));
  }
  bool isHistoryEnabled() override {
    return stock_->isHistoryEnabled();
  }
  void recordHistory(
      bool enabled,
      alloc::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      alloc::RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override {
    stock_->recordHistory(
        enabled,
        context_recorder,
        alloc_trace_max_entries,
        when,
        clearHistory,
        skip_actions);
  }
  void recordAnnotation(
      const std::vector<std::pair<std::string, std::string>>& md) override {
    stock_->recordAnnotation(md);
  }
  void pushCompileContext(std::string& md) override {
    stock_->pushCompileContext(md);
  }
  void popCompileContext() override {
    stock_->popCompileContext();
  }
  void setUserMetadata(const std::string& metadata) override {
    stock_->setUserMetadata(metadata);
  }
  std::string getUserMetadata() override {
    return stock_->getUserMetadata();
  }
  void attachOutOfMemoryObserver(alloc::OutOfMemoryObserver observer) override {
    stock_->attachOutOfMemoryObserver(std::move(observer));
  }
  void attachAllocatorTraceTracker(
      alloc::AllocatorTraceTracker tracker) override {
    stock_->attachAllocatorTraceTracker(std::move(tracker));
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access)
      override {
    stock_->enablePeerAccess(dev, dev_to_access);
  }
  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    return stock_->memcpyAsync(
        dst, dstDevice, src, srcDevice, count, stream, p2p_enabled);
  }
  std::shared_ptr<alloc::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      c10::MempoolId_t id) override {
    return stock_->getCheckpointState(device, id);
  }
  alloc::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<alloc::AllocatorState> pps) override {
    return stock_->setCheckpointPoolState(device, std::move(pps));
  }
  // The stock name ("native", "cudaMallocAsync"): code that asks which
  // backend is in use must get the same answer with LMS.
  std::string name() override {
    return stock_->name();
  }

#if TORCH_LMS_TORCH_AT_LEAST(2, 12)
  std::shared_ptr<c10::GatheredContext> getContextForPointer(
      const void* ptr) override {
    return stock_->getContextForPointer(ptr);
  }
  void attachOomRejectionObserver(
      alloc::OomRejectionObserver observer) override {
    stock_->attachOomRejectionObserver(std::move(observer));
  }
#endif
#if TORCH_LMS_TORCH_AT_LEAST(2, 13)
  void markCaptureBegin(c10::DeviceIndex device) override {
    stock_->markCaptureBegin(device);
  }
  void markCaptureEnd(c10::DeviceIndex device) override {
    stock_->markCaptureEnd(device);
  }
  c10::DataPtr allocateWithAddress(size_t size, void* addr) override {
    return stock_->allocateWithAddress(size, addr);
  }
#endif

 private:
  // Memory in a private pool is never paged out (a graph bakes in its
  // addresses), but LMS makes room for the pool by paging out other inactive
  // storages, except while a capture is underway (a page-out copy cannot join
  // a capture). When that is not enough the error says why.
  template <typename Allocate>
  auto inPrivatePool(c10::DeviceIndex device, size_t size, Allocate&& allocate)
      -> decltype(allocate()) {
    while (true) {
      try {
        return allocate();
      } catch (const c10::OutOfMemoryError& e) {
        const bool capturing = captureUnderway(device);
        if (!capturing && lms::reclaimBytes(device, size) > 0) {
          continue;
        }
        const std::string message = c10::str(
            "Large Model Support: out of memory for a private memory pool "
            "(a CUDA graph or torch.cuda.MemPool), whose memory LMS never pages "
            "out. ",
            capturing
                ? "A CUDA graph capture is underway, and page-outs cannot "
                  "be captured. "
                : "Every inactive storage outside the pools is already "
                  "paged out. ",
            "Private pools hold ",
            mebibytes(privatePools().reservedBytes(device)),
            " on this device. Leave room for them under the cap (a higher "
            "memory fraction or LMS limit, a smaller batch), or compile "
            "without mode=\"reduce-overhead\". ",
            e.what_without_backtrace());
        // A warm-up or capture of compiled code ends here, before a library
        // that would catch an out-of-memory error sees one.
        lms::raiseIfGraphPoolStep(device, message);
        TORCH_CHECK_WITH(OutOfMemoryError, false, message);
      }
    }
  }

  static std::string mebibytes(size_t bytes) {
    char text[32];
    std::snprintf(
        text,
        sizeof(text),
        "%.2f MiB",
        static_cast<double>(bytes) / (1024.0 * 1024.0));
    return text;
  }

  alloc::CUDAAllocator* stock_;
};

} // namespace

// Called by the stock malloc when its free list holds no block for a request,
// before it maps memory anew and, when that fails, returns its whole cache to
// the device (a synchronization, counted as num_alloc_retries) and maps the
// request page by page. Where the device has no room to map it, the engine
// vacates the cheapest range of the allocator's memory the request fits in
// (lms::reclaimBeforeMapping), and the free list holds it at the next search.
// A patched build reclaims at about that point of its malloc: after its
// first device allocation fails, before it releases its cache. The stock
// allocator runs its callbacks under its device lock, which is recursive
// (its own IPC callback frees memory there too): the page-outs free blocks
// through it. Requests the engine is not serving (t_request unset, such as
// allocations routed to a CUDA graph's private pool) are left to it.
class ReclaimBeforeMapping final : public c10::FreeMemoryCallback {
 public:
  bool Execute() override {
    const Request request = t_request;
    if (request.device < 0) {
      return false;
    }
    return lms::reclaimBeforeMapping(
        request.device, request.size, request.stream);
  }
};

void installAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    alloc::CUDAAllocator* stock = alloc::allocator.load();
    TORCH_CHECK(
        stock != nullptr,
        "torch_lms: this PyTorch has no CUDA caching allocator to build on");
    TORCH_CHECK(
        lms::getBackend() == nullptr,
        "torch_lms: another Large Model Support backend is already "
        "installed; is this PyTorch built with LMS? Use its torch.cuda LMS "
        "API instead of torch_lms.");
    // Never destroyed: storage deleters may run during static destruction.
    static auto* backend = new StockAllocatorBackend(stock);
    static auto* allocator = new LmsAllocator(stock);
    lms::setBackend(backend);
    // Where PyTorch's pluggable-allocator mechanism installs an allocator:
    // the CUDA allocator pointer, and c10's registry (c10::GetAllocator,
    // torch.accelerator). Memory the stock allocator handed out before keeps
    // its stock deleter and returns to it directly.
    alloc::allocator.store(allocator);
    c10::SetAllocator(c10::DeviceType::CUDA, allocator, /*priority=*/255);
  });
}

void attachAllocatorHooks() {
  static std::once_flag once;
  std::call_once(once, [] {
    alloc::attachAllocatorTraceTracker(
        [](const alloc::TraceEntry& entry) { privatePools().onTrace(entry); });
    g_hooks_attached.store(true);
  });
}

void applyEnvironmentConfig() {
  lms::parseConfig(
      std::getenv("PYTORCH_LMS_CONF"),
      /*only_lms_keys=*/true,
      "PYTORCH_LMS_CONF");
}

} // namespace torch_lms

namespace c10 {
// The registry's names are unqualified in the macro.
REGISTER_FREE_MEMORY_CALLBACK(
    torch_lms_reclaim_before_mapping,
    torch_lms::ReclaimBeforeMapping);
} // namespace c10
