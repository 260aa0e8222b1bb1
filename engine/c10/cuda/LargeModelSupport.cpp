#include <c10/cuda/LargeModelSupport.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupportHostPool.h>
#include <c10/cuda/LargeModelSupportSchedule.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace c10::cuda::lms {

namespace {

constexpr size_t kMiB = 1024 * 1024;
constexpr size_t kDefaultSizeThreshold = 1 * kMiB;
// Share of the device's memory that every LMS process leaves free for
// memory taken outside the caching allocator: library handles and workspaces
// (cuBLAS, cuDNN, NCCL) of this process and of others sharing the device.
constexpr double kDeviceHeadroomFraction = 0.05;
// Share of the allocator's own cap (DeviceMemoryBackend::capacityBytes) that
// the limit leaves free for the allocator's fragmentation (effectiveLimit).
constexpr double kCapacityHeadroomFraction = 0.05;
// How long a reading of the memory other processes hold is trusted before the
// allocation path asks the driver again (cudaMemGetInfo costs microseconds,
// too much for every allocation).
constexpr std::chrono::milliseconds kDeviceSampleInterval{10};
// Least time between two returns of cached free blocks to the device: each
// one synchronizes the device.
constexpr std::chrono::milliseconds kCacheReleaseInterval{100};
// Share of the device by which what others hold must exceed the least this
// process has seen them hold before its cached free blocks go back to the
// device (releaseCacheOverShare): less is this process's own CUDA context and
// library handles settling, not a process that needs the memory.
constexpr double kOthersGrowthFraction = 0.01;
// Operators between two searches for victims to page out ahead of the
// iteration's peak after one found none (pageOutAheadOfPeak).
constexpr uint64_t kPeakRetryOps = 8;
// Room of the limit that an operator's expected working set, with what
// cannot be paged out, must leave for it not to be packed (beginWorkingSet):
// ten of the allocator's 20 MiB pages, what partly used pages can take,
// whatever the limit. The operator's own blocks land among storages that are
// paged out while it runs, and the pages they share stay mapped: under a
// 358 MiB cap a cuDNN LSTM whose working set was under three quarters of the
// limit ran out of memory inside itself with 118 MiB of its pages free
// (stress seed 395; seed 52, a DenseNet convolution, alike) when packing
// waited for three quarters of the limit. Above the margin, a pack costs
// more than it can save: paging out everything undoes the learned schedule
// (GPT at 2x an H200's cap: one pack an iteration made it 75% slower, 0.700
// against 0.400 s, and it trained without).
constexpr size_t kPackMarginBytes = 200 * kMiB;
// An operator not seen before, or not with inputs of this size, is expected
// to allocate at least this many times the bytes of its inputs (a backward
// operator's gradients are about as large as its inputs, and it needs room to
// place them). A share per byte learned at other sizes is no floor: cuDNN
// picks another algorithm, with another workspace, for another shape (stress
// seed 301: a convolution backward that had allocated 1.6 times its inputs at
// one size took 2.8 times at the next, and was not weighed).
constexpr size_t kUnseenInsidePerInput = 2;
// Room the allocator's layout must leave an operator beyond what it is
// expected to need before packing is skipped (packIfTight), per block it
// allocated inside itself: the 20 MiB page each block may leave partly used
// where it ends (a convolution backward allocates its gradients and cuDNN's
// workspace; the simulated-GPU test
// an_operator_of_several_blocks_is_spared_a_page_for_each shows three blocks
// landing in the holes of three cached segments, whose free rest the fourth
// cannot use).
constexpr size_t kPackSpareBytes = 20 * kMiB;
// Blocks counted for that room at most: ten pages, the band in which an
// operator is tight at all (kPackMarginBytes).
constexpr size_t kPackSpareBlocks = kPackMarginBytes / kPackSpareBytes;
// Blocks an operator allocates inside itself at this size or more are
// counted for that room: smaller ones come from the allocator's small pool,
// whose pages are 2 MiB.
constexpr size_t kPackBlockBytes = kMiB;
// PYTORCH_LMS_PACK_LOG leaves out what operators with fewer input and inside
// bytes than this measured: too small to make a working set tight.
constexpr size_t kPackLogBytes = 8 * kMiB;

std::atomic<bool> g_enabled{false};
std::atomic<size_t> g_size_threshold{kDefaultSizeThreshold};
std::atomic<int> g_prefetch_depth{0};
std::atomic<size_t> g_speculative_margin{0};
// Limit set through PYTORCH_CUDA_ALLOC_CONF for every device (0: default).
std::atomic<size_t> g_conf_limit{0};
std::atomic<DeviceMemoryBackend*> g_backend{nullptr};
std::atomic<EnabledObserver> g_enabled_observer{nullptr};
// Learned swap schedule (see LargeModelSupportSchedule.h and "Learned swap
// schedule" below): on by default, so that LMS with defaults is the fast path.
std::atomic<bool> g_schedule_enabled{true};
std::atomic<int> g_lookahead_ops{0}; // 0: derived from the period
std::atomic<size_t> g_prefetch_budget{0}; // 0: derived (prefetchBudget())
// Page-ins planned by compiled graphs (pageInAhead): on by default.
std::atomic<bool> g_graph_prefetch{true};
std::atomic<bool> g_recompute{false};
std::atomic<bool> g_packing{true};
std::atomic<bool> g_host_placement{true};
std::atomic<WorkspaceReleaser> g_workspace_releaser{nullptr};
std::atomic<const RecomputeHooks*> g_recompute_hooks{nullptr};
// Serializes recomputes: a replay may recompute its own inputs first (the
// same thread, again), and two threads must not both recompute one storage.
std::recursive_mutex g_recompute_mutex;
// Clock of the last operator the schedule recorded; stamps storages' touches
// without taking the schedule's lock.
std::atomic<uint64_t> g_op_clock{0};
// Allocations since the operator of g_op_clock began: an allocation's gap.
std::atomic<uint64_t> g_births_in_op{0};
// Set when the allocator's own malloc path reclaimed for this thread's
// allocation (reclaimForFailedAllocation), for the allocation-source stats.
thread_local bool t_reclaimed_in_malloc = false;
// Set while this thread allocates for a page-in ahead of use, which takes only
// memory that is free: were the allocator's failure path to reclaim for it,
// the storages it pages out could be the ones just paged in ahead, and the
// schedule would page them back in, out again, and so on without end.
thread_local bool t_no_reclaim = false;
// An operator on this thread could not make its inputs resident; its next
// LMS allocation raises this (see setPendingError()).
thread_local std::exception_ptr t_pending_error;
// The last reclaim on this thread stopped because the host pool gave no
// pinned memory (HostPool::lastRefusal() says why): an out-of-memory error
// that follows names host memory, the tier that ran out.
thread_local bool t_host_refused = false;
// Out-of-memory errors raised on this thread (outOfMemoryErrorsRaised()).
thread_local uint64_t t_oom_raised = 0;
thread_local size_t t_oom_request = 0;
thread_local std::string t_oom_verdict;

// The outermost operator running on this thread (beginWorkingSet): what it
// pinned, and what it allocated through allocate() and has not freed.
struct WorkingSet {
  bool active = false;
  c10::DeviceIndex device = -1;
  // The operator's name, valid while it runs (its schema owns the string).
  std::string_view name;
  uint64_t serial = 0; // stamps the records it allocates
  size_t pinned = 0;
  size_t inside = 0;
  size_t inside_peak = 0;
  // Blocks of kPackBlockBytes or more it allocated (kPackSpareBytes).
  size_t blocks = 0;
};
thread_local WorkingSet t_working_set;
std::atomic<uint64_t> g_working_set_serial{0};

// Keeps the allocator's failure path from reclaiming on this thread for a
// scope (see t_no_reclaim).
class NoReclaimScope {
 public:
  NoReclaimScope() : previous_(t_no_reclaim) {
    t_no_reclaim = true;
  }
  ~NoReclaimScope() {
    t_no_reclaim = previous_;
  }
  NoReclaimScope(const NoReclaimScope&) = delete;
  NoReclaimScope& operator=(const NoReclaimScope&) = delete;

 private:
  const bool previous_;
};

// Makes a device current for a scope. (CUDAGuard would pull in the caching
// allocator's headers, which include this one.)
class DeviceScope {
 public:
  explicit DeviceScope(c10::DeviceIndex device)
      : device_(device), previous_(c10::cuda::ExchangeDevice(device)) {}
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (previous_ != device_) {
      C10_CUDA_CHECK_WARN(c10::cuda::SetDevice(previous_));
    }
  }

 private:
  c10::DeviceIndex device_;
  c10::DeviceIndex previous_;
};

enum class State : uint8_t {
  Allocated,
  Active,
  Inactive,
  PagedOut,
  Dropped, // no copy: recomputed from its recipe when pinned
};

enum class Trigger { Limit, Speculative, AllocFailure, Explicit, Pack };

struct DeviceEngine;

// The LMS record of one storage allocation. It is the context of the
// storage's DataPtr, so it lives exactly as long as the allocation.
struct Record {
  DeviceEngine* engine = nullptr;
  size_t size = 0;
  void* device_ptr = nullptr; // resident memory; null while paged out
  HostBuffer host; // paged-out contents
  // Page-out copy done: the host buffer holds the contents after it.
  cudaEvent_t host_ready = nullptr;
  // Page-in copy done: the device memory holds the contents after it. A
  // stream other than the one that paged in waits on it before use.
  cudaEvent_t device_ready = nullptr;
  // Stream the device memory was allocated on: the caching allocator reuses
  // the memory in this stream's order once freed. Unknown for adopted
  // storages until their first page-in.
  cudaStream_t stream = nullptr;
  bool stream_known = true;
  // Other streams that used the memory; a page-out is ordered after them.
  std::vector<cudaStream_t> users;
  State state = State::Allocated;
  int pins = 0;
  bool busy = false; // a copy is being set up outside the engine lock
  bool prefetched = false;
  bool graph_owned = false; // used during CUDA graph capture: never paged
  // Placed in pinned host memory (`host`) by an operator the device could not
  // hold it for (setHostPlacementEnabled); device_ptr stays null. Paged out
  // from birth once no operator uses it (parkPlaced).
  bool on_host = false;
  // Has a recipe (setRecomputable): the recompute hooks know this context.
  bool recomputable = false;
  // Set by a page-out that dropped the storage instead of copying it, for
  // markPagedOut to file it as dropped.
  bool dropped = false;
  // Its memory went to another storage (fillDropped): its death is not the
  // death of a storage the learned schedule knows.
  bool moved = false;
  // Operator clock of the allocation or the last pin: what the learned
  // schedule identifies the storage by (see LargeModelSupportSchedule.h).
  std::atomic<uint64_t> touch{0};
  // The gap before that touch (AccessSchedule::Use::gap).
  std::atomic<uint64_t> gap{0};
  // The operator clock by which a dropped storage's recompute reads it (0:
  // none): an input of a recipe, paged in or kept for that recompute, is no
  // victim before then, although its own next use may come much later.
  // Cleared by its next use.
  std::atomic<uint64_t> needed_by{0};
  // Paged out early by the schedule: the copy to host is queued on the D2H
  // stream, and the device memory is kept until it is done (then freed with
  // no stream waiting), or until the storage is used again (then no copy
  // back is needed). On the engine's draining list meanwhile.
  bool draining = false;
  cudaEvent_t drain_copied = nullptr; // timing event after the copy
  // Paged out with a known next use: in the engine's `upcoming` map.
  bool upcoming = false;
  std::multimap<uint64_t, Record*>::iterator upcoming_at;
  // Allocated through allocate() and neither pinned nor accessed raw since:
  // when the operator that allocated it ends, it becomes reclaimable.
  bool fresh = false;
  // The working set (WorkingSet::serial) of the operator that allocated it,
  // 0 when none was running on the allocating thread.
  uint64_t working_set = 0;
  // The storage whose DataPtr carries this record, as last seen by pin() or
  // access(). Weak, so it never keeps a dead storage alive; page-out uses it
  // to take the stale address out of the DataPtr.
  c10::weak_intrusive_ptr<c10::StorageImpl> owner{
      c10::intrusive_ptr<c10::StorageImpl>()};
  // Intrusive list links (reclaim list or paged-out list).
  Record* prev = nullptr;
  Record* next = nullptr;
  struct List* list = nullptr;
};

struct List {
  Record* head = nullptr; // least recently used / earliest paged out
  Record* tail = nullptr;

  void push_back(Record* r) {
    TORCH_INTERNAL_ASSERT(r->list == nullptr);
    r->list = this;
    r->prev = tail;
    r->next = nullptr;
    (tail ? tail->next : head) = r;
    tail = r;
  }
  void remove(Record* r) {
    TORCH_INTERNAL_ASSERT(r->list == this);
    (r->prev ? r->prev->next : head) = r->next;
    (r->next ? r->next->prev : tail) = r->prev;
    r->prev = r->next = nullptr;
    r->list = nullptr;
  }
};

// Events are created lazily and reused; one pool per device because an event
// must be recorded on a stream of the device it was created on.
class EventPool {
 public:
  explicit EventPool(c10::DeviceIndex device) : device_(device) {}

  cudaEvent_t get(bool timing) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = timing ? timing_ : plain_;
      if (!free.empty()) {
        cudaEvent_t ev = free.back();
        free.pop_back();
        return ev;
      }
    }
    DeviceScope guard(device_);
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(
        &ev, timing ? cudaEventDefault : cudaEventDisableTiming));
    std::lock_guard<std::mutex> lock(mutex_);
    is_timing_.push_back({ev, timing});
    return ev;
  }

  void put(cudaEvent_t ev) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [e, timing] : is_timing_) {
      if (e == ev) {
        (timing ? timing_ : plain_).push_back(ev);
        return;
      }
    }
    TORCH_INTERNAL_ASSERT(false, "LMS: event not from this pool");
  }

 private:
  c10::DeviceIndex device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> plain_;
  std::vector<cudaEvent_t> timing_;
  std::vector<std::pair<cudaEvent_t, bool>> is_timing_;
};

// What a pair of timing events measures: time a compute stream waited for
// an LMS copy, or the duration of a copy to the host or to the device (the
// bus as LMS sees it: what paging a storage out and back costs).
enum class Timed { Stall, CopyOut, CopyIn, Recompute };

// A pair of timing events not read yet; `bytes`: the copy's size.
struct PendingTiming {
  cudaEvent_t start;
  cudaEvent_t end;
  Timed what;
  size_t bytes;
};

void add(LmsStat& stat, int64_t delta) {
  stat.current += delta;
  stat.peak = std::max(stat.peak, stat.current);
}

struct DeviceEngine {
  explicit DeviceEngine(c10::DeviceIndex d) : device(d), events(d) {}

  const c10::DeviceIndex device;
  std::mutex mutex;
  std::condition_variable settled; // a busy record finished its copy
  List reclaim_list; // inactive, resident
  List pagedout_list; // paged out, in page-out order
  List draining_list; // paged out early, device memory not yet released
  List dropped_list; // dropped, to be recomputed
  size_t draining_bytes = 0;
  // Paged-out storages by the clock of their next use (learned schedule),
  // valid for schedule generation `upcoming_generation`.
  std::multimap<uint64_t, Record*> upcoming;
  uint64_t upcoming_generation = 0;
  // Bytes paged in ahead by the schedule and not used yet.
  size_t prefetched_bytes = 0;
  // Page-in traffic per iteration of the schedule, which scales the derived
  // prefetch budget (prefetchBudget()): the clock and the page-in bytes at
  // the start of the iteration being measured, and the bytes paged in over
  // the last whole one.
  uint64_t iteration_began = 0;
  int64_t iteration_pagein_base = 0;
  size_t pagein_last_iteration = 0;
  // The iteration's peak of demand (the bytes its live storages would take
  // on the device: allocated plus paged out), which early page-outs work
  // towards (pageOutAheadOfPeak): the largest demand seen at an operator
  // boundary of the iteration being recorded and its phase, and those of
  // the last whole one (peak_bytes 0: none yet). Valid for schedule
  // generation `demand_generation`.
  uint64_t demand_generation = 0;
  uint64_t demand_began = 0;
  size_t demand_max = 0;
  uint64_t demand_max_phase = 0;
  size_t peak_bytes = 0;
  uint64_t peak_phase = 0;
  uint64_t peak_retry = 0; // no search for victims before this clock
  // Schedule and host pool statistics at the last resetAccumulatedStats().
  int64_t detections_base = 0;
  int64_t fallbacks_base = 0;
  int64_t host_refusals_base = 0;
  size_t user_limit = 0;
  // The device as last read from the driver: its size, and the bytes held by
  // anything other than this process's caching allocator (other processes,
  // this process's CUDA context and library handles).
  size_t device_total = 0;
  size_t device_others = 0;
  // The least device_others has been: what this process holds outside its
  // allocator, plus what other processes held when they held least.
  size_t device_others_floor = SIZE_MAX;
  size_t device_reserved = 0; // by this process's allocator, at the sample
  std::chrono::steady_clock::time_point device_sampled;
  std::chrono::steady_clock::time_point cache_released;
  LmsStats stats;
  cudaStream_t copy_stream = nullptr; // device to host (and demand prefetch)
  cudaStream_t h2d_stream = nullptr; // host to device, ahead of use
  EventPool events;
  std::mutex timing_mutex;
  std::deque<PendingTiming> timings;
  double stall_ms = 0.0;
  // Copies timed so far, each way: milliseconds and bytes.
  double copy_out_ms = 0.0;
  int64_t copy_out_bytes = 0;
  double copy_in_ms = 0.0;
  int64_t copy_in_bytes = 0;
  double recompute_ms = 0.0; // device time of the replays of dropped storages
  // The same copy timings for the recompute cost model (copyCost), which
  // statistics resets leave alone: behaviour must not depend on them.
  double bus_out_ms = 0.0;
  double bus_out_bytes = 0.0;
  double bus_in_ms = 0.0;
  double bus_in_bytes = 0.0;
  // Stall timed over the same copies: how much of their time streams waited.
  double bus_stall_ms = 0.0;

  cudaStream_t copyStream() {
    std::lock_guard<std::mutex> lock(mutex);
    if (copy_stream == nullptr) {
      // A stream of our own rather than one from PyTorch's pool, so LMS copies
      // never serialize with user work that happens to share a pool stream.
      DeviceScope guard(device);
      int least = 0;
      int greatest = 0;
      C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      C10_CUDA_CHECK(cudaStreamCreateWithPriority(
          &copy_stream, cudaStreamNonBlocking, greatest));
    }
    return copy_stream;
  }

  // A second copy stream for page-ins ahead of use, so that they run while
  // page-outs run on copy_stream: the bus moves both directions at once.
  cudaStream_t h2dStream() {
    std::lock_guard<std::mutex> lock(mutex);
    if (h2d_stream == nullptr) {
      DeviceScope guard(device);
      int least = 0;
      int greatest = 0;
      C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      C10_CUDA_CHECK(cudaStreamCreateWithPriority(
          &h2d_stream, cudaStreamNonBlocking, greatest));
    }
    return h2d_stream;
  }
};

std::mutex g_engines_mutex;
std::vector<DeviceEngine*> g_engines; // never freed: used by late deleters

DeviceEngine& engineFor(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_engines_mutex);
  TORCH_CHECK(
      device >= 0, "LMS: invalid CUDA device index ", std::to_string(device));
  if (static_cast<size_t>(device) >= g_engines.size()) {
    g_engines.resize(device + 1, nullptr);
  }
  if (g_engines[device] == nullptr) {
    g_engines[device] = new DeviceEngine(device);
  }
  return *g_engines[device];
}

DeviceMemoryBackend& backend() {
  DeviceMemoryBackend* b = g_backend.load();
  TORCH_CHECK(
      b != nullptr,
      "LMS: no device memory backend is installed; the CUDA caching allocator "
      "must call c10::cuda::lms::setBackend() before LMS allocations");
  return *b;
}

void deleteRecord(void* ctx);

using StorageRef = c10::intrusive_ptr<c10::StorageImpl>;

Record* recordOf(const c10::DataPtr& dp) {
  if (dp.get_deleter() != &deleteRecord) {
    return nullptr;
  }
  return static_cast<Record*>(dp.get_context());
}

Record* recordOf(c10::StorageImpl& storage) {
  return recordOf(storage._mutable_data_ptr_no_checks());
}

bool isCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Whether the diagnostic environment variable `name` is set to anything but
// empty or "0".
bool isFlagSet(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' && std::string_view(value) != "0";
}

cudaStream_t currentStream(c10::DeviceIndex device) {
  return c10::cuda::getCurrentCUDAStream(device).stream();
}

void addUser(Record& r, cudaStream_t stream) {
  if (stream != r.stream &&
      std::find(r.users.begin(), r.users.end(), stream) == r.users.end()) {
    r.users.push_back(stream);
  }
}

// Storage hook (patched builds): armed while the storage is inactive or paged
// out, so raw data access comes to the engine first.
void arm(c10::StorageImpl& storage, bool armed) {
#ifdef C10_LMS_STORAGE_HOOK
  storage.set_lms_armed(armed);
#else
  (void)storage;
  (void)armed;
#endif
}

// The storage's DataPtr keeps the record as context while the memory moves:
// after a page-in, point it at the new device memory.
void refreshDataPtr(c10::StorageImpl& storage, Record& r) {
  c10::DataPtr& dp = storage._mutable_data_ptr_no_checks();
  void* const address = r.on_host ? r.host.ptr : r.device_ptr;
  if (dp.get() == address) {
    return;
  }
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(address, ctx, &deleteRecord, device);
}

// ---------------------------------------------------------------------------
// Stall and copy timing
// ---------------------------------------------------------------------------

void pollTimings(DeviceEngine& e, bool wait) {
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  while (!e.timings.empty()) {
    PendingTiming s = e.timings.front();
    if (wait) {
      C10_CUDA_CHECK(cudaEventSynchronize(s.end));
      C10_CUDA_CHECK(cudaEventSynchronize(s.start));
    } else {
      cudaError_t err = cudaEventQuery(s.end);
      if (err == cudaSuccess) {
        err = cudaEventQuery(s.start);
      }
      if (err == cudaErrorNotReady) {
        (void)cudaGetLastError(); // not an error: clear the sticky state
        break;
      }
      C10_CUDA_CHECK(err);
    }
    float ms = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, s.start, s.end));
    // Negative: the copy finished before the compute stream got there.
    const double elapsed = std::max(0.f, ms);
    switch (s.what) {
      case Timed::Stall:
        e.stall_ms += elapsed;
        e.bus_stall_ms += elapsed;
        break;
      case Timed::CopyOut:
        e.copy_out_ms += elapsed;
        e.copy_out_bytes += static_cast<int64_t>(s.bytes);
        e.bus_out_ms += elapsed;
        e.bus_out_bytes += static_cast<double>(s.bytes);
        break;
      case Timed::CopyIn:
        e.copy_in_ms += elapsed;
        e.copy_in_bytes += static_cast<int64_t>(s.bytes);
        e.bus_in_ms += elapsed;
        e.bus_in_bytes += static_cast<double>(s.bytes);
        break;
      case Timed::Recompute:
        e.recompute_ms += elapsed;
        break;
    }
    e.events.put(s.start);
    e.events.put(s.end);
    e.timings.pop_front();
  }
  // The cost model follows the recent copies: halving every accumulator
  // keeps the bandwidth and the stall share of roughly the last few seconds
  // of copy time, so a schedule that learns to hide copies lowers the price
  // of paging within an iteration or two.
  constexpr double kBusWindowMs = 2000.0;
  if (e.bus_out_ms + e.bus_in_ms > kBusWindowMs) {
    for (double* v :
         {&e.bus_out_ms,
          &e.bus_out_bytes,
          &e.bus_in_ms,
          &e.bus_in_bytes,
          &e.bus_stall_ms}) {
      *v /= 2.0;
    }
  }
}

void addTiming(
    DeviceEngine& e,
    Timed what,
    cudaEvent_t start,
    cudaEvent_t end,
    size_t bytes = 0) {
  constexpr size_t kMaxPending = 4096;
  bool flush = false;
  {
    std::lock_guard<std::mutex> lock(e.timing_mutex);
    e.timings.push_back({start, end, what, bytes});
    flush = e.timings.size() > kMaxPending;
  }
  pollTimings(e, /*wait=*/flush);
}

void addStall(DeviceEngine& e, cudaEvent_t start, cudaEvent_t end) {
  addTiming(e, Timed::Stall, start, end);
}

// Times the copy queued on `stream` between its construction and done():
// the events bracket the copy alone, since the stream reaches the first one
// only after the work and the waits queued before it.
struct CopyTimer {
  DeviceEngine& e;
  cudaStream_t stream;
  cudaEvent_t start;

  CopyTimer(DeviceEngine& engine, cudaStream_t s)
      : e(engine), stream(s), start(engine.events.get(/*timing=*/true)) {
    C10_CUDA_CHECK(cudaEventRecord(start, stream));
  }
  void done(Timed what, size_t bytes) {
    cudaEvent_t end = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(end, stream));
    addTiming(e, what, start, end, bytes);
  }
};

// ---------------------------------------------------------------------------
// Limit and reclaim
// ---------------------------------------------------------------------------

// Reads how much of the device anything but this process's caching allocator
// holds, and what this process reserves, at most every kDeviceSampleInterval.
// The first figure does not move when this process allocates or frees through
// the allocator, so a reading stays good for a while; it moves when other
// processes (or libraries, outside the allocator) take or return memory.
void sampleDevice(DeviceEngine& e) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.device_total != 0 && now - e.device_sampled < kDeviceSampleInterval) {
      return;
    }
  }
  DeviceScope guard(e.device);
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t reserved = backend().reservedBytes(e.device);
  const size_t used = total_bytes > free_bytes ? total_bytes - free_bytes : 0;
  std::lock_guard<std::mutex> lock(e.mutex);
  e.device_total = total_bytes;
  e.device_others = used > reserved ? used - reserved : 0;
  e.device_others_floor = std::min(e.device_others_floor, e.device_others);
  e.device_reserved = reserved;
  e.device_sampled = now;
}

// The device memory that anything but this process's caching allocator
// leaves (last sample). Engine lock held.
size_t leftByOthers(const DeviceEngine& e) {
  return e.device_total > e.device_others ? e.device_total - e.device_others
                                          : 0;
}

// This process's share of the device: the device, less what others hold, less
// the headroom every LMS process leaves free. Processes sharing a device each
// see the others' memory here, so their shares shrink as the others grow and
// the device never fills up with tensors of any one of them. Engine lock held.
size_t shareOf(const DeviceEngine& e) {
  const auto headroom = static_cast<size_t>(
      kDeviceHeadroomFraction * static_cast<double>(e.device_total));
  const size_t left = leftByOthers(e);
  return left > headroom ? left - headroom : 0;
}

// The limit set by the user (API or PYTORCH_CUDA_ALLOC_CONF), capped at this
// process's share of the device.
size_t limitOf(DeviceEngine& e) {
  sampleDevice(e);
  std::lock_guard<std::mutex> lock(e.mutex);
  const size_t share = shareOf(e);
  const size_t user = e.user_limit != 0 ? e.user_limit : g_conf_limit.load();
  return user != 0 ? std::min(user, share) : share;
}

// The limit in force: never more than the allocator may hold, less a
// headroom. The allocator's cap (a per-process memory fraction) bounds what
// it reserves, which exceeds what is allocated by the free pieces of its
// segments. Allocated memory right up to the cap therefore makes allocations
// fail, and recovering from that (the allocator empties its cache, LMS pages
// out with a hand-back) synchronizes the device: ResNet-152 trained 14%
// slower at 2x oversubscription with the limit at the cap than at 95% of it.
size_t effectiveLimit(DeviceEngine& e) {
  size_t capacity = backend().capacityBytes(e.device);
  if (capacity != SIZE_MAX) {
    capacity -= static_cast<size_t>(
        kCapacityHeadroomFraction * static_cast<double>(capacity));
  }
  return std::min(limitOf(e), capacity);
}

// When this process reserves more than its share of the device while others
// (another process sharing the device, or a library allocating outside the
// allocator) have grown, free blocks sit in its cache that they may be
// failing for: give them back to the device. Judged on the last device sample
// (sampleDevice), so the allocation path asks the allocator for nothing more;
// rate-limited, because returning cached memory synchronizes the device.
// Not while nothing else has grown: a process alone on a device with a model
// bigger than it reserves past its share whenever its allocated bytes near
// the limit with blocks cached beside them, and returning them made the
// allocator map the same memory again right after, every interval (ResNet-152
// at 1.5x the device: 3 to 13 returns and about 100 new device allocations
// an iteration). Nor against a limit the user set below the share: blocks
// cached above it stand in nobody's way either.
void releaseCacheOverShare(DeviceEngine& e) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.device_reserved <= shareOf(e)) {
      return;
    }
    const auto growth = static_cast<size_t>(
        kOthersGrowthFraction * static_cast<double>(e.device_total));
    if (e.device_others <= e.device_others_floor + growth) {
      return;
    }
    if (e.cache_released.time_since_epoch().count() != 0 &&
        now - e.cache_released < kCacheReleaseInterval) {
      return;
    }
    e.cache_released = now;
  }
  if (backend().releaseCachedMemory(e.device)) {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.cache_releases;
  }
}

// Raises the error an operator's pinning left for its first allocation.
void raisePendingError(size_t size) {
  if (C10_UNLIKELY(t_pending_error != nullptr)) {
    std::exception_ptr error = std::move(t_pending_error);
    t_pending_error = nullptr;
    ++t_oom_raised;
    t_oom_request = size;
    t_oom_verdict.clear();
    std::rethrow_exception(error);
  }
}

void enqueuePageOut(
    DeviceEngine& e,
    Record& r,
    const HostBuffer& host,
    StorageRef& keep_alive,
    bool hand_back);

// A paged-out storage must not keep pointing at memory the allocator may
// already have handed to someone else. It points at its pinned host copy
// instead, which unified addressing maps into every device's address space:
// code that reads the address without going through LMS (no StorageImpl hook
// in a stock build, or an operator whose inputs could not all be made
// resident) reads and writes the real contents over the bus and never faults.
// The storage reference comes back in `keep_alive`: if it is the last one,
// the storage must die only after the record is no longer busy.
void pointAtHostCopy(Record& r, void* host_ptr, StorageRef& keep_alive) {
  keep_alive = r.owner.lock();
  if (!keep_alive) {
    return; // dying: its deleter is waiting for this page-out to finish
  }
  c10::StorageImpl* storage = keep_alive.get();
  c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  if (dp.get_context() != &r || dp.get_deleter() != &deleteRecord) {
    return; // the DataPtr has moved to another storage
  }
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(host_ptr, ctx, &deleteRecord, device);
}

// Milliseconds per byte a copy takes one way at the bandwidth measured so
// far (the other way's where one way has none yet), or -1 before any copy was
// timed. Timing lock held.
double msPerByte(const DeviceEngine& e, bool to_device) {
  double ms = to_device ? e.bus_in_ms : e.bus_out_ms;
  double moved = to_device ? e.bus_in_bytes : e.bus_out_bytes;
  if (moved <= 0.0 || ms <= 0.0) {
    ms = to_device ? e.bus_out_ms : e.bus_in_ms;
    moved = to_device ? e.bus_out_bytes : e.bus_in_bytes;
  }
  return moved <= 0.0 || ms <= 0.0 ? -1.0 : ms / moved;
}

// The share of recent copy time that streams spent waiting for copies (at
// most 1; 1 before any copy was timed): what a copy costs the program per
// millisecond of copying. A copy the learned schedule hides behind compute
// costs nothing; a recompute always runs on the compute stream. Timing lock
// held.
double stallShareLocked(const DeviceEngine& e) {
  const double copying = e.bus_out_ms + e.bus_in_ms;
  return copying > 0.0 ? std::min(1.0, e.bus_stall_ms / copying) : 1.0;
}

double stallShare(DeviceEngine& e) {
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  return stallShareLocked(e);
}

// Milliseconds a copy of `bytes` takes one way (`to_device`), or both ways
// (out and back in) when `both_ways`; -1 before any copy was timed. With
// `stalled`, times the stall share: what the copy costs the program.
double copyCost(
    DeviceEngine& e,
    size_t bytes,
    bool to_device,
    bool both_ways = false,
    bool stalled = false) {
  pollTimings(e, /*wait=*/false);
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  double per_byte = msPerByte(e, to_device);
  if (both_ways && per_byte >= 0.0) {
    const double back = msPerByte(e, !to_device);
    per_byte = back < 0.0 ? -1.0 : per_byte + back;
  }
  if (per_byte < 0.0) {
    return -1.0;
  }
  return per_byte * static_cast<double>(bytes) *
      (stalled ? stallShareLocked(e) : 1.0);
}

// What paging `bytes` out and back in costs the program: both copies' time
// times the stall share.
double pagingCost(DeviceEngine& e, size_t bytes) {
  return copyCost(
      e, bytes, /*to_device=*/false, /*both_ways=*/true, /*stalled=*/true);
}

// Gives a record's device memory back to the allocator, to be reused only
// after the work queued so far on every stream that used it and after a
// page-in copy that may still be writing it. In a deleter (`in_deleter`) a
// CUDA error is a warning; elsewhere it throws.
void releaseDeviceMemory(DeviceEngine& e, Record& r, bool in_deleter) {
  const auto check = [in_deleter](cudaError_t err) {
    if (in_deleter) {
      C10_CUDA_CHECK_WARN(err);
    } else {
      C10_CUDA_CHECK(err);
    }
  };
  if (r.device_ready != nullptr) {
    check(cudaStreamWaitEvent(r.stream, r.device_ready, 0));
    e.events.put(r.device_ready);
    r.device_ready = nullptr;
  }
  if (r.device_ptr != nullptr) {
    // Reuse is ordered on the allocation stream, which the allocator knows
    // even for adopted storages. Other streams that used the memory since
    // LMS last moved it are unknown to the allocator: order after them too.
    if (!r.users.empty()) {
      cudaEvent_t used = e.events.get(/*timing=*/false);
      for (cudaStream_t s : r.users) {
        check(cudaEventRecord(used, s));
        check(cudaStreamWaitEvent(r.stream, used, 0));
      }
      e.events.put(used);
    }
    backend().free(r.device_ptr);
    r.device_ptr = nullptr;
  }
  r.users.clear();
}

// Drops a victim instead of copying it out, when it has a recipe and
// recomputing it costs less than paging it out and back in (pagingCost():
// the copies at the measured bandwidth, as far as they make streams wait;
// before any copy was timed, victims are paged out: that measures it). Its
// memory goes back to the allocator in the order of every stream that used it,
// and its DataPtr holds no address until it is recomputed. The victim is busy
// and on no list; the engine lock is not held. Returns false, nothing changed,
// when the victim is to be paged out.
bool dropInstead(DeviceEngine& e, Record& r, StorageRef& keep_alive) {
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  if (isRecomputeLogEnabled() && hooks != nullptr && g_recompute.load()) {
    std::fprintf(
        stderr,
        "LMS recompute: victim of %zu bytes: %s\n",
        r.size,
        !r.recomputable       ? "no recipe"
            : r.graph_owned   ? "graph memory"
            : r.draining      ? "draining"
            : !r.stream_known ? "stream unknown"
                              : "has a recipe");
  }
  if (!r.recomputable || hooks == nullptr || !g_recompute.load() ||
      r.graph_owned || r.draining || !r.stream_known ||
      r.device_ptr == nullptr) {
    return false;
  }
  const double paging = pagingCost(e, r.size);
  if (paging < 0.0) {
    return false;
  }
  StorageRef storage = r.owner.lock();
  if (!storage) {
    return false;
  }
  c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  if (dp.get_context() != &r || dp.get_deleter() != &deleteRecord) {
    return false;
  }
  const double cost = hooks->cost_ms(*storage);
  const bool drop = cost >= 0.0 && cost < paging && hooks->retain(*storage);
  if (isRecomputeLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS recompute: %zu bytes: recompute %.3f ms, paging %.3f ms (stall "
        "share %.2f): %s\n",
        r.size,
        cost,
        paging,
        stallShare(e),
        drop ? "dropped" : "paged out");
  }
  if (!drop) {
    return false;
  }
  DeviceScope guard(e.device);
  releaseDeviceMemory(e, r, /*in_deleter=*/false);
  r.dropped = true;
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(nullptr, ctx, &deleteRecord, device);
  keep_alive = std::move(storage);
  return true;
}

// Copies a victim's contents to pinned host memory and returns its device
// memory to the allocator. The victim is busy and on no list; the engine lock
// is not held. Returns false when no pinned host memory could be had.
//
// Without `hand_back` (an early page-out of the learned schedule) the device
// memory stays with the record, which goes on draining: it is released once
// the copy is done, so no compute stream waits for the copy (drainPageOuts).
bool pageOut(
    DeviceEngine& e,
    Record& r,
    StorageRef& keep_alive,
    bool hand_back = true) {
  if (dropInstead(e, r, keep_alive)) {
    return true;
  }
  DeviceScope guard(e.device);
  HostBuffer host = hostPool().allocate(r.size);
  if (host.ptr == nullptr) {
    return false;
  }
  try {
    enqueuePageOut(e, r, host, keep_alive, hand_back);
  } catch (...) {
    // Nothing was freed: the storage stays resident. Let any copy that did
    // start finish before the buffer can be handed out again.
    (void)cudaStreamSynchronize(e.copyStream());
    (void)cudaGetLastError();
    hostPool().release(host, nullptr, e.device);
    throw;
  }
  return true;
}

void enqueuePageOut(
    DeviceEngine& e,
    Record& r,
    const HostBuffer& host,
    StorageRef& keep_alive,
    bool hand_back) {
  const cudaStream_t copy = e.copyStream();
  // Order the copy after all work already queued on every stream that used
  // the memory. One event serves all waits: cudaStreamWaitEvent captures the
  // event's state at the time of the call.
  cudaEvent_t used = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(used, r.stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(copy, used, 0));
  for (cudaStream_t s : r.users) {
    C10_CUDA_CHECK(cudaEventRecord(used, s));
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, used, 0));
  }
  e.events.put(used);
  if (r.device_ready != nullptr) { // a prefetch copy may still be writing
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, r.device_ready, 0));
  }
  CopyTimer timer(e, copy);
  C10_CUDA_CHECK(cudaMemcpyAsync(
      host.ptr, r.device_ptr, r.size, cudaMemcpyDeviceToHost, copy));
  timer.done(Timed::CopyOut, r.size);
  cudaEvent_t done = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(done, copy));
  if (!hand_back) {
    // Draining: the memory is released after the copy (drainPageOuts). The
    // timing event lets a forced early release measure the wait it causes.
    r.drain_copied = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(r.drain_copied, copy));
    r.draining = true;
    pointAtHostCopy(r, host.ptr, keep_alive);
    r.host = host;
    r.host_ready = done;
    r.users.clear();
    if (r.device_ready != nullptr) {
      e.events.put(r.device_ready);
      r.device_ready = nullptr;
    }
    return;
  }
  // Hand the memory to the next allocation with GPU-side ordering: work the
  // allocation stream queues from now on waits for the copy; the host never
  // blocks. The timing pair measures how long that stream actually waited.
  if (r.stream_known) {
    cudaEvent_t reached = e.events.get(/*timing=*/true);
    cudaEvent_t copied = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(copied, copy));
    C10_CUDA_CHECK(cudaEventRecord(reached, r.stream));
    C10_CUDA_CHECK(cudaStreamWaitEvent(r.stream, done, 0));
    addStall(e, reached, copied);
    backend().free(r.device_ptr);
  } else {
    // The pool the memory returns to is unknown: let the allocator hold it
    // back until the copy is done.
    backend().freeAfter(r.device_ptr, e.device, copy);
  }
  if (r.device_ready != nullptr) {
    e.events.put(r.device_ready);
    r.device_ready = nullptr;
  }
  pointAtHostCopy(r, host.ptr, keep_alive);
  r.device_ptr = nullptr;
  r.host = host;
  r.host_ready = done;
  r.users.clear();
}

// A victim whose page-out copy is queued (or done) becomes paged out, on
// `list` (paged out, or draining for an early page-out). Engine lock held.
void markPagedOut(DeviceEngine& e, Record& r, List& list);

// Learned swap schedule (defined below).
Record* pickVictim(DeviceEngine& e, size_t threshold, uint64_t protect_until);
size_t drainPageOuts(DeviceEngine& e, size_t bytes);
void addUpcoming(DeviceEngine& e, Record& r);
void removeUpcoming(DeviceEngine& e, Record& r);
void clearPrefetched(DeviceEngine& e, Record& r);

// Pages out a victim of a reclaim, busy and off every list; the engine lock
// is not held. Returns false, the victim back on the reclaim list, when no
// pinned host memory could be had: the caller's allocation decides whether
// that is an error. `keep_alive` must outlive the call (see pageOut).
bool pageOutVictim(DeviceEngine& e, Record& victim, StorageRef& keep_alive) {
  bool ok = false;
  try {
    ok = pageOut(e, victim, keep_alive);
  } catch (...) {
    std::lock_guard<std::mutex> lock(e.mutex);
    victim.busy = false;
    e.reclaim_list.push_back(&victim);
    e.settled.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  victim.busy = false;
  if (!ok) {
    t_host_refused = true;
    e.reclaim_list.push_back(&victim);
    e.settled.notify_all();
    return false;
  }
  markPagedOut(e, victim, e.pagedout_list);
  e.settled.notify_all();
  return true;
}

void countReclaim(DeviceEngine& e, Trigger trigger) {
  switch (trigger) {
    case Trigger::Limit:
      ++e.stats.reclaim_limit;
      break;
    case Trigger::Speculative:
      ++e.stats.reclaim_speculative;
      break;
    case Trigger::AllocFailure:
      ++e.stats.reclaim_alloc_failure;
      break;
    case Trigger::Explicit:
      ++e.stats.reclaim_explicit;
      break;
    case Trigger::Pack: // counted as a pack (packWorkingSet)
      break;
  }
}

// Pages out inactive storages until `bytes` are freed or none is left: the
// one used furthest in the future while a learned schedule is active, else
// the least recently used. Returns the bytes freed.
size_t reclaim(DeviceEngine& e, size_t bytes, Trigger trigger) {
  t_host_refused = false;
  // Storages paged out early are on their way already: releasing their
  // memory costs at most the rest of a copy that is under way, where a new
  // victim's copy would queue behind them.
  size_t freed = drainPageOuts(e, bytes);
  bool counted = false;
  const size_t threshold = g_size_threshold.load();
  while (freed < bytes) {
    // Destroyed last in each round, after the victim is no longer busy.
    StorageRef keep_alive;
    Record* victim = nullptr;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      victim = pickVictim(e, threshold, /*protect_until=*/0);
      if (victim == nullptr) {
        break;
      }
      e.reclaim_list.remove(victim);
      victim->busy = true;
      if (!counted) {
        counted = true;
        countReclaim(e, trigger);
      }
    }
    if (!pageOutVictim(e, *victim, keep_alive)) {
      break;
    }
    freed += victim->size;
  }
  return freed;
}

// The reclaimable storages that are resident and not being moved, by device
// address. Call with e.mutex held.
std::unordered_map<uintptr_t, Record*> residentReclaimable(DeviceEngine& e) {
  std::unordered_map<uintptr_t, Record*> held;
  for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
    if (!r->busy && r->device_ptr != nullptr) {
      held.emplace(reinterpret_cast<uintptr_t>(r->device_ptr), r);
    }
  }
  return held;
}

// After an allocation of `size` bytes on `stream` failed: pages out the
// storages that hold the cheapest contiguous run of blocks, in one range the
// allocator has mapped, whose blocks are free or held by reclaimable storages
// and together hold `size` bytes. Once they are out, the allocator has a free
// range for the request. Victims picked by their next use free memory
// wherever they lie, scattered over segments that tensors still in use keep
// mapped; the allocator then returns its cache to the device and tries again,
// and so on until everything reclaimable is out. Returns the bytes freed, 0
// when no such run exists (or the allocator cannot tell).
size_t reclaimFragments(DeviceEngine& e, size_t size, cudaStream_t stream) {
  if (size <= kMiB) {
    return 0; // the small pool: its 2 MiB segments do not fragment this way
  }
  const std::vector<SegmentMap> maps = backend().segments(e.device, stream);
  if (maps.empty()) {
    return 0;
  }
  std::vector<Record*> victims;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    const std::unordered_map<uintptr_t, Record*> held = residentReclaimable(e);
    if (held.empty()) {
      return 0;
    }
    // Per range, a window [lo, hi] of blocks, none held by anything that
    // stays, shrunk from the left while it still holds `size` bytes.
    const SegmentMap* best_map = nullptr;
    size_t best_lo = 0;
    size_t best_hi = 0;
    size_t best_cost = SIZE_MAX;
    for (const SegmentMap& map : maps) {
      const size_t n = map.blocks.size();
      std::vector<Record*> owner(n, nullptr);
      uintptr_t address = map.base;
      for (size_t i = 0; i < n; ++i) {
        if (map.blocks[i].second) {
          const auto it = held.find(address);
          owner[i] = it != held.end() ? it->second : nullptr;
        }
        address += map.blocks[i].first;
      }
      size_t lo = 0;
      size_t bytes = 0;
      size_t cost = 0;
      for (size_t hi = 0; hi < n; ++hi) {
        const auto [block, allocated] = map.blocks[hi];
        if (allocated && owner[hi] == nullptr) {
          lo = hi + 1; // a block that stays splits the range
          bytes = 0;
          cost = 0;
          continue;
        }
        bytes += block;
        cost += allocated ? block : 0;
        while (lo < hi && bytes - map.blocks[lo].first >= size) {
          bytes -= map.blocks[lo].first;
          cost -= map.blocks[lo].second ? map.blocks[lo].first : 0;
          ++lo;
        }
        if (bytes >= size && cost > 0 && cost < best_cost) {
          best_map = &map;
          best_lo = lo;
          best_hi = hi;
          best_cost = cost;
        }
      }
    }
    if (best_map == nullptr) {
      return 0;
    }
    uintptr_t address = best_map->base;
    for (size_t i = 0; i <= best_hi; ++i) {
      if (i >= best_lo && best_map->blocks[i].second) {
        Record* r = held.at(address);
        e.reclaim_list.remove(r);
        r->busy = true;
        victims.push_back(r);
      }
      address += best_map->blocks[i].first;
    }
    countReclaim(e, Trigger::AllocFailure);
  }
  // The victims after the i-th go back, resident, when it cannot go out.
  auto put_back_after = [&](size_t i) {
    std::lock_guard<std::mutex> lock(e.mutex);
    for (size_t j = i + 1; j < victims.size(); ++j) {
      victims[j]->busy = false;
      e.reclaim_list.push_back(victims[j]);
    }
    e.settled.notify_all();
  };
  size_t freed = 0;
  for (size_t i = 0; i < victims.size(); ++i) {
    StorageRef keep_alive;
    bool ok = false;
    try {
      ok = pageOutVictim(e, *victims[i], keep_alive);
    } catch (...) {
      put_back_after(i);
      throw;
    }
    if (!ok) {
      put_back_after(i);
      break;
    }
    freed += victims[i]->size;
  }
  if (freed > 0) {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.fragment_reclaims;
  }
  return freed;
}

void markPagedOut(DeviceEngine& e, Record& r, List& list) {
  if (r.dropped) {
    r.dropped = false;
    r.state = State::Dropped;
    clearPrefetched(e, r);
    e.dropped_list.push_back(&r);
    // Filed by its next use too: the schedule pages its recipe's inputs in
    // ahead of the recompute (prefetchUpcoming).
    addUpcoming(e, r);
    ++e.stats.drop_count;
    e.stats.drop_bytes += static_cast<int64_t>(r.size);
    add(e.stats.inactive_bytes, -static_cast<int64_t>(r.size));
    add(e.stats.dropped_bytes, static_cast<int64_t>(r.size));
    return;
  }
  r.state = State::PagedOut;
  clearPrefetched(e, r);
  list.push_back(&r);
  addUpcoming(e, r);
  ++e.stats.pageout_count;
  e.stats.pageout_bytes += static_cast<int64_t>(r.size);
  add(e.stats.inactive_bytes, -static_cast<int64_t>(r.size));
  add(e.stats.pagedout_bytes, static_cast<int64_t>(r.size));
}

// Makes room for an allocation of `size` bytes under the limit. Returns the
// bytes paged out for it.
size_t enforceLimit(DeviceEngine& e, size_t size) {
  const size_t limit = effectiveLimit(e);
  const size_t allocated = backend().allocatedBytes(e.device);
  const size_t wanted = allocated + size;
  size_t freed = 0;
  if (wanted > limit) {
    freed = reclaim(e, wanted - limit, Trigger::Limit);
    // What is left above the limit could not be paged out: it is pinned by
    // running operators, or not (yet) reclaimable.
    const size_t after = wanted > freed ? wanted - freed : 0;
    const auto over =
        static_cast<int64_t>(after > limit ? after - limit : size_t{0});
    std::lock_guard<std::mutex> lock(e.mutex);
    e.stats.over_limit_bytes.current = over;
    e.stats.over_limit_bytes.peak =
        std::max(e.stats.over_limit_bytes.peak, over);
  } else if (e.stats.over_limit_bytes.current != 0) {
    std::lock_guard<std::mutex> lock(e.mutex);
    e.stats.over_limit_bytes.current = 0;
  }
  // After the reclaim, whose page-outs return their memory to the cache.
  releaseCacheOverShare(e);
  if (wanted > limit) {
    return freed;
  }
  const size_t margin = g_speculative_margin.load();
  if (margin != 0 && limit > margin && wanted > limit - margin) {
    return reclaim(e, wanted - (limit - margin), Trigger::Speculative);
  }
  return 0;
}

// An out-of-memory error's message, and its verdict: why no room could be
// made (describeOutOfMemory, lastOutOfMemoryVerdict).
struct OutOfMemoryText {
  std::string verdict;
  std::string message;
};
OutOfMemoryText explainOutOfMemory(c10::DeviceIndex device, size_t size);

[[noreturn]] void throwOutOfMemory(DeviceEngine& e, size_t size) {
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.oom_count;
  }
  const OutOfMemoryText text = explainOutOfMemory(e.device, size);
  ++t_oom_raised;
  t_oom_request = size;
  t_oom_verdict = text.verdict;
  TORCH_CHECK_WITH(OutOfMemoryError, false, text.message);
}

// Device memory for `size` bytes on `stream`, reclaiming as needed. When
// nothing more can be reclaimed it raises the out-of-memory error, or with
// `or_null` returns null (the caller places the request elsewhere or raises
// it).
void* allocateDevice(
    DeviceEngine& e,
    size_t size,
    cudaStream_t stream,
    bool or_null = false) {
  DeviceMemoryBackend& b = backend();
  bool reclaimed = enforceLimit(e, size) > 0;
  const size_t reserved_before = b.reservedBytes(e.device);
  void* ptr = nullptr;
  t_reclaimed_in_malloc = false;
  while (ptr == nullptr) {
    try {
      ptr = b.malloc(e.device, size, stream);
      reclaimed = reclaimed || t_reclaimed_in_malloc;
    } catch (const c10::OutOfMemoryError&) {
      // The allocator has already tried its free list, its free-memory
      // callbacks and releasing its cache. Page out the storages that hold a
      // range the request fits in, else what is left in reclaim order.
      if (reclaimFragments(e, size, stream) == 0 &&
          reclaim(e, size, Trigger::AllocFailure) == 0) {
        if (or_null) {
          return nullptr;
        }
        throwOutOfMemory(e, size);
      }
      reclaimed = true;
    }
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  if (reclaimed) {
    ++e.stats.alloc_after_reclaim;
  } else if (b.reservedBytes(e.device) > reserved_before) {
    ++e.stats.alloc_from_device;
  } else {
    ++e.stats.alloc_from_cache;
  }
  return ptr;
}

// ---------------------------------------------------------------------------
// Page-in and prefetch
// ---------------------------------------------------------------------------

// After the host-to-device copy of `r` into `ptr` was queued on `copied_on`:
// the host buffer goes back to the pool once the copy has read it, and the
// record points at its new memory, which belongs to `alloc_stream`'s pool and
// holds the contents once `device_ready` is reached.
void finishPageIn(
    DeviceEngine& e,
    Record& r,
    void* ptr,
    cudaStream_t alloc_stream,
    cudaStream_t copied_on) {
  cudaEvent_t read = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(read, copied_on));
  hostPool().release(r.host, read, e.device);
  cudaEvent_t ready = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(ready, copied_on));
  e.events.put(r.host_ready);
  r.host_ready = nullptr;
  r.host = HostBuffer{};
  r.device_ptr = ptr;
  r.device_ready = ready;
  r.stream = alloc_stream;
  r.stream_known = true;
}

// Brings a busy, paged-out record back to the device on `stream`. The engine
// lock is not held.
void pageIn(DeviceEngine& e, Record& r, cudaStream_t stream) {
  DeviceScope guard(e.device);
  void* ptr = allocateDevice(e, r.size, stream);
  try {
    cudaEvent_t start = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(start, stream));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, r.host_ready, 0));
    CopyTimer timer(e, stream);
    C10_CUDA_CHECK(cudaMemcpyAsync(
        ptr, r.host.ptr, r.size, cudaMemcpyHostToDevice, stream));
    timer.done(Timed::CopyIn, r.size);
    cudaEvent_t end = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(end, stream));
    addStall(e, start, end);
    finishPageIn(e, r, ptr, stream, stream);
  } catch (...) {
    // The storage stays paged out (its host copy is intact): give the memory
    // back, in the order of the stream the failed copy was queued on.
    backend().free(ptr);
    throw;
  }
}

// Starts paging in `r` on the copy stream, into memory allocated on `stream`,
// without reclaiming anything. Returns false when the limit leaves no room.
bool prefetchOne(DeviceEngine& e, Record& r, cudaStream_t stream) {
  DeviceMemoryBackend& b = backend();
  const size_t allocated = b.allocatedBytes(e.device);
  if (allocated + r.size > effectiveLimit(e)) {
    return false;
  }
  // Only memory the allocator can likely give without failing: at least the
  // request free in its cache, or room for a new segment. A failed allocation
  // is not cheap: before it fails, the allocator returns its whole cache to
  // the device, a device synchronization. (A fragmented cache can still fail
  // it; then nothing is reclaimed for it, see NoReclaimScope.)
  const size_t reserved = b.reservedBytes(e.device);
  const size_t capacity = b.capacityBytes(e.device);
  size_t room = capacity;
  if (capacity == SIZE_MAX) {
    std::lock_guard<std::mutex> lock(e.mutex);
    room = shareOf(e);
  }
  const bool cached = reserved >= allocated + r.size;
  const bool segment = reserved + r.size <= room;
  if (!cached && !segment) {
    return false;
  }
  DeviceScope guard(e.device);
  void* ptr = nullptr;
  try {
    const NoReclaimScope no_reclaim;
    ptr = b.malloc(e.device, r.size, stream);
  } catch (const c10::OutOfMemoryError&) {
    return false;
  }
  // Not the page-out stream: page-ins ahead of use overlap with page-outs.
  const cudaStream_t copy = e.h2dStream();
  try {
    // The memory belongs to `stream`'s pool: the copy may start only after
    // the work `stream` has queued so far (which may still use the memory's
    // previous owner).
    cudaEvent_t ev = e.events.get(/*timing=*/false);
    C10_CUDA_CHECK(cudaEventRecord(ev, stream));
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, ev, 0));
    C10_CUDA_CHECK(cudaStreamWaitEvent(copy, r.host_ready, 0));
    e.events.put(ev);
    CopyTimer timer(e, copy);
    C10_CUDA_CHECK(
        cudaMemcpyAsync(ptr, r.host.ptr, r.size, cudaMemcpyHostToDevice, copy));
    timer.done(Timed::CopyIn, r.size);
    finishPageIn(e, r, ptr, stream, copy);
  } catch (...) {
    // Reuse in `stream`'s order must also wait for the copy stream, which
    // may have started the copy.
    backend().freeAfter(ptr, e.device, copy);
    throw;
  }
  addUser(r, copy);
  return true;
}

// A storage whose page-in ahead of use is queued becomes inactive and
// reclaimable, counted as prefetched until an operator uses it. Engine lock
// held.
void markPrefetched(DeviceEngine& e, Record& r) {
  r.state = State::Inactive;
  r.prefetched = true;
  e.prefetched_bytes += r.size;
  e.reclaim_list.push_back(&r);
  ++e.stats.prefetch_count;
  ++e.stats.pagein_count;
  e.stats.pagein_bytes += static_cast<int64_t>(r.size);
  add(e.stats.pagedout_bytes, -static_cast<int64_t>(r.size));
  add(e.stats.inactive_bytes, static_cast<int64_t>(r.size));
}

// Prefetches up to the prefetch depth of storages paged out just before
// `anchor` was (a backward pass needs activations in reverse order).
void prefetchAfterPin(DeviceEngine& e, std::vector<Record*> candidates) {
  const cudaStream_t stream = currentStream(e.device);
  for (Record* r : candidates) {
    bool ok = false;
    try {
      ok = prefetchOne(e, *r, stream);
    } catch (...) {
      std::lock_guard<std::mutex> lock(e.mutex);
      for (Record* rest : candidates) {
        if (rest->busy) {
          rest->busy = false;
          e.pagedout_list.push_back(rest);
        }
      }
      e.settled.notify_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(e.mutex);
    r->busy = false;
    if (ok) {
      markPrefetched(e, *r);
    } else {
      e.pagedout_list.push_back(r);
    }
    e.settled.notify_all();
    if (!ok) {
      // No headroom left: put the rest back untouched.
      for (Record* rest : candidates) {
        if (rest->busy) {
          rest->busy = false;
          e.pagedout_list.push_back(rest);
        }
      }
      e.settled.notify_all();
      return;
    }
  }
}

int64_t sz(const Record& r) {
  return static_cast<int64_t>(r.size);
}

// The storage is no longer an unreleased output of a running operator.
// Called with the engine lock held.
void clearFresh(DeviceEngine& e, Record& r) {
  if (r.fresh) {
    r.fresh = false;
    add(e.stats.operator_output_bytes, -sz(r));
  }
}

StorageState publicState(State state) {
  switch (state) {
    case State::Allocated:
      return StorageState::Allocated;
    case State::Active:
      return StorageState::Active;
    case State::Inactive:
      return StorageState::Inactive;
    case State::PagedOut:
      return StorageState::PagedOut;
    case State::Dropped:
      return StorageState::Dropped;
  }
  return StorageState::Unmanaged;
}

// Leaves state `from` for accounting purposes.
void leave(DeviceEngine& e, Record& r) {
  switch (r.state) {
    case State::Active:
      add(e.stats.active_bytes, -sz(r));
      break;
    case State::Inactive:
      add(e.stats.inactive_bytes, -sz(r));
      break;
    case State::PagedOut:
      add(e.stats.pagedout_bytes, -sz(r));
      break;
    case State::Dropped:
      add(e.stats.dropped_bytes, -sz(r));
      break;
    case State::Allocated:
      break;
  }
}

void enter(DeviceEngine& e, Record& r, State state) {
  r.state = state;
  switch (state) {
    case State::Active:
      add(e.stats.active_bytes, sz(r));
      break;
    case State::Inactive:
      add(e.stats.inactive_bytes, sz(r));
      break;
    case State::PagedOut:
      add(e.stats.pagedout_bytes, sz(r));
      break;
    case State::Dropped:
      add(e.stats.dropped_bytes, sz(r));
      break;
    case State::Allocated:
      break;
  }
}

// An event after the work queued so far on every stream that used a
// host-placed record's memory (recorded on its allocation stream, which waits
// for the others, as releaseDeviceMemory orders a free): once it is reached,
// the buffer may be copied from or handed out again. `in_deleter` turns CUDA
// errors into warnings. Takes no engine lock.
cudaEvent_t hostUseDone(DeviceEngine& e, Record& r, bool in_deleter) {
  const auto check = [in_deleter](cudaError_t err) {
    if (in_deleter) {
      C10_CUDA_CHECK_WARN(err);
    } else {
      C10_CUDA_CHECK(err);
    }
  };
  if (!r.users.empty()) {
    cudaEvent_t used = e.events.get(/*timing=*/false);
    for (cudaStream_t s : r.users) {
      check(cudaEventRecord(used, s));
      check(cudaStreamWaitEvent(r.stream, used, 0));
    }
    e.events.put(used);
  }
  cudaEvent_t done = e.events.get(/*timing=*/false);
  check(cudaEventRecord(done, r.stream));
  return done;
}

// A host-placed record that no operator uses any more is paged out from then
// on: its host buffer is its host copy, ready once the kernels that wrote it
// are done; its next use pages it in like any other. No copy is made, so no
// page-out is counted. Engine lock held.
void parkPlaced(DeviceEngine& e, Record& r) {
  r.host_ready = hostUseDone(e, r, /*in_deleter=*/false);
  r.on_host = false;
  r.users.clear();
  leave(e, r);
  enter(e, r, State::PagedOut);
  e.pagedout_list.push_back(&r);
  addUpcoming(e, r);
}

void rememberOwner(Record& r, c10::StorageImpl& storage) {
  if (r.owner._unsafe_get_target() != &storage) {
    r.owner = c10::weak_intrusive_ptr<c10::StorageImpl>(
        c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(
            &storage));
  }
}

// Orders `stream` after the copy that last paged `r` in, which may have run on
// another stream (prefetch, or a page-in for another thread's operator).
// Called with the engine lock held.
void waitUntilResident(DeviceEngine& e, Record& r, cudaStream_t stream) {
  if (r.device_ready == nullptr) {
    return;
  }
  const cudaError_t err = cudaEventQuery(r.device_ready);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); // not an error: clear the sticky state
    // A page-in that has not finished: the stream's wait for it is stall.
    cudaEvent_t reached = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(reached, stream));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, r.device_ready, 0));
    cudaEvent_t waited = e.events.get(/*timing=*/true);
    C10_CUDA_CHECK(cudaEventRecord(waited, stream));
    addStall(e, reached, waited);
    return; // other streams may still need it
  }
  C10_CUDA_CHECK(err);
  e.events.put(r.device_ready);
  r.device_ready = nullptr;
}

// ---------------------------------------------------------------------------
// Learned swap schedule
// ---------------------------------------------------------------------------
//
// AccessSchedule (LargeModelSupportSchedule.h) learns the repeating order of
// operators and predicts each storage's next use. While it is active:
// - victims are the inactive storages used furthest in the future (Belady),
//   never one needed within the lookahead window if another will do;
// - at every operator boundary, storages whose next use is beyond the window
//   are paged out early, on the D2H stream, whenever less than the prefetch
//   budget is free under the limit; their memory is released once the copy
//   is done, so no compute stream waits for it (draining);
// - storages used within the window are paged in ahead, soonest first, on
//   the H2D stream, while no more than the budget of prefetched bytes waits
//   to be used; the consumer then waits only on a copy that has (almost
//   always) completed.
// Both directions run on their own streams, so they overlap each other and
// compute. Without a schedule, reclaim is least recently used and page-ins
// happen on demand on the consumer's stream.

std::mutex g_schedule_mutex;

// Process-wide: an operator's inputs may live on several devices, and the
// operator clock must be one.
AccessSchedule& theSchedule() {
  static AccessSchedule* schedule = [] {
    auto* made = new AccessSchedule(); // never destroyed
    // PYTORCH_LMS_SCHEDULE_LOG=1 prints every operator that breaks the
    // learned schedule to stderr (a diagnostic, not a setting);
    // PYTORCH_LMS_SCHEDULE_LOG=FIRST-LAST also prints the operators with
    // clocks FIRST to LAST, each with its inputs.
    const char* log = std::getenv("PYTORCH_LMS_SCHEDULE_LOG");
    const std::string_view text = log != nullptr ? log : "";
    made->setLogging(!text.empty() && text != "0");
    if (const size_t dash = text.find('-'); dash != std::string_view::npos) {
      const std::string first(text.substr(0, dash));
      const std::string last(text.substr(dash + 1));
      made->setTracedOperators(
          std::strtoull(first.c_str(), nullptr, 10),
          std::strtoull(last.c_str(), nullptr, 10));
    }
    return made;
  }();
  return *schedule;
}

uint64_t lookaheadOps(uint64_t period) {
  if (const int ops = g_lookahead_ops.load(); ops > 0) {
    return static_cast<uint64_t>(ops);
  }
  // An eighth of an iteration: far enough ahead for copies of the sizes one
  // layer uses to complete, near enough that prefetched storages do not
  // crowd out the allocations in between.
  return std::clamp<uint64_t>(period / 8, 4, 512);
}

size_t prefetchBudget(size_t limit, size_t paged_in_per_iteration) {
  if (const size_t bytes = g_prefetch_budget.load(); bytes > 0) {
    return bytes;
  }
  // An eighth of the limit, up to a quarter as an iteration pages in more
  // than the limit holds. Below that, copies rarely bound the iteration, and
  // a larger budget only pages out more early (the margin it keeps free).
  // Past it, they do: the H2D stream must never wait for room, and the extra
  // early page-outs pay for themselves. A quarter was faster than an eighth
  // where iterations paged in several times the limit and slower where they
  // paged in less; half was no faster than a quarter (measured on an H100:
  // benchmarks/results/probes/2026-11-24-h100-unrecorded/prefetch-budget/).
  const double scale = std::clamp(
      static_cast<double>(paged_in_per_iteration) /
          static_cast<double>(std::max<size_t>(limit, 1)),
      1.0,
      2.0);
  return static_cast<size_t>(static_cast<double>(limit / 8) * scale);
}

// Measures the page-in bytes of each whole iteration of the schedule (from
// one boundary a period after the last to the next). Engine lock held.
void measureIteration(DeviceEngine& e, uint64_t now, uint64_t period) {
  const int64_t paged_in = e.stats.pagein_bytes;
  if (now < e.iteration_began) {
    // A clock that went back (the schedule was reset): start over.
    e.iteration_began = now;
    e.iteration_pagein_base = paged_in;
    e.pagein_last_iteration = 0;
    return;
  }
  if (now - e.iteration_began < period) {
    return;
  }
  e.pagein_last_iteration =
      static_cast<size_t>(paged_in - e.iteration_pagein_base);
  e.iteration_began = now;
  e.iteration_pagein_base = paged_in;
}

void clearPrefetched(DeviceEngine& e, Record& r) {
  if (r.prefetched) {
    r.prefetched = false;
    e.prefetched_bytes -= std::min(e.prefetched_bytes, r.size);
  }
}

void removeUpcoming(DeviceEngine& e, Record& r) {
  if (r.upcoming) {
    e.upcoming.erase(r.upcoming_at);
    r.upcoming = false;
  }
}

// Files a paged-out storage under the clock of its next use. Engine lock held.
void addUpcoming(DeviceEngine& e, Record& r) {
  if (r.upcoming || !g_schedule_enabled.load()) {
    return;
  }
  uint64_t next = AccessSchedule::kNever;
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    next = theSchedule().nextUse(r.touch.load(), r.size, r.gap.load());
  }
  if (next != AccessSchedule::kNever) {
    r.upcoming_at = e.upcoming.emplace(next, &r);
    r.upcoming = true;
  }
}

// Next uses change with the schedule: refile every paged-out storage. Engine
// lock held.
void refileUpcoming(DeviceEngine& e, uint64_t generation) {
  for (auto& [next, r] : e.upcoming) {
    (void)next;
    r->upcoming = false;
  }
  e.upcoming.clear();
  for (List* list : {&e.pagedout_list, &e.draining_list, &e.dropped_list}) {
    for (Record* r = list->head; r != nullptr; r = r->next) {
      addUpcoming(e, *r);
    }
  }
  e.upcoming_generation = generation;
}

// The inactive storage to page out next, or null. With an active schedule:
// the one whose next use is furthest (storages the schedule never sees again
// first, least recently used first among equals); with `protect_until` set
// (an early page-out, which makes room ahead of need), only one whose next
// use comes after that clock, and none that the schedule expects to be freed
// unused by then: its memory comes back without a copy. (When memory is
// needed now, such a storage is the cheapest victim: one copy out, none
// back.) Without a schedule: the least recently used, and none when
// `protect_until` is set. Engine lock held.
Record* pickVictim(DeviceEngine& e, size_t threshold, uint64_t protect_until) {
  if (g_schedule_enabled.load()) {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    const AccessSchedule& schedule = theSchedule();
    if (schedule.active()) {
      Record* best = nullptr;
      uint64_t best_next = 0;
      for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
        if (r->size < threshold) {
          continue;
        }
        const uint64_t touch = r->touch.load();
        const uint64_t gap = r->gap.load();
        uint64_t next = schedule.nextUse(touch, r->size, gap);
        const uint64_t needed = r->needed_by.load(std::memory_order_relaxed);
        if (needed != 0) {
          if (protect_until != 0) {
            continue; // kept for a recompute: no early page-out
          }
          next = std::min(next, needed);
        }
        if (protect_until != 0 &&
            schedule.deathBeforeUse(touch, r->size, gap) <= protect_until) {
          continue;
        }
        if (best == nullptr || next > best_next) {
          best = r;
          best_next = next;
        }
      }
      if (best != nullptr && protect_until != 0 && best_next <= protect_until) {
        return nullptr;
      }
      if (best != nullptr) {
        ++e.stats.schedule_victims;
      }
      return best;
    }
  }
  if (protect_until != 0) {
    return nullptr;
  }
  for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
    if (r->size >= threshold) {
      return r;
    }
  }
  return nullptr;
}

// Releases the device memory of a draining storage, busy and off every list.
// `done`: its copy has completed. Otherwise the storage's stream waits for
// the copy first (GPU-side, like a reclaim's hand-back), and the wait counts
// as stall time.
void releaseDrained(DeviceEngine& e, Record& r, bool done) {
  DeviceScope guard(e.device);
  if (!r.stream_known) {
    // The pool the memory returns to is unknown: the allocator holds it
    // back until the copy is done.
    backend().freeAfter(r.device_ptr, e.device, e.copyStream());
  } else {
    if (!done) {
      cudaEvent_t reached = e.events.get(/*timing=*/true);
      C10_CUDA_CHECK(cudaEventRecord(reached, r.stream));
      C10_CUDA_CHECK(cudaStreamWaitEvent(r.stream, r.host_ready, 0));
      addStall(e, reached, r.drain_copied);
      r.drain_copied = nullptr;
    }
    backend().free(r.device_ptr);
  }
  if (r.drain_copied != nullptr) {
    e.events.put(r.drain_copied);
    r.drain_copied = nullptr;
  }
}

// Releases the memory of storages paged out early: every one whose copy is
// done, then, in page-out order, ones still copying until `bytes` are freed.
// Returns the bytes freed.
size_t drainPageOuts(DeviceEngine& e, size_t bytes) {
  size_t freed = 0;
  while (true) {
    Record* r = nullptr;
    bool done = false;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      r = e.draining_list.head;
      if (r == nullptr) {
        break;
      }
      const cudaError_t err = cudaEventQuery(r->host_ready);
      if (err == cudaErrorNotReady) {
        (void)cudaGetLastError(); // not an error: clear the sticky state
      } else {
        C10_CUDA_CHECK(err);
      }
      done = err == cudaSuccess;
      // Copies complete in the order of the one D2H stream: once one is
      // not done, the later ones are not either.
      if (!done && freed >= bytes) {
        break;
      }
      e.draining_list.remove(r);
      r->busy = true;
    }
    try {
      releaseDrained(e, *r, done);
    } catch (...) {
      std::lock_guard<std::mutex> lock(e.mutex);
      r->busy = false;
      e.draining_list.push_back(r);
      e.settled.notify_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(e.mutex);
    r->busy = false;
    r->draining = false;
    r->device_ptr = nullptr;
    e.draining_bytes -= r->size;
    e.pagedout_list.push_back(r);
    e.settled.notify_all();
    freed += r->size;
  }
  return freed;
}

// A draining storage is needed again while its device memory is still held:
// it becomes resident (inactive) with no copy back. Whoever uses the memory
// next waits for the page-out copy, which may still be reading it. Engine
// lock held; the record is not busy.
void rescueDrained(DeviceEngine& e, Record& r) {
  e.draining_list.remove(&r);
  removeUpcoming(e, r);
  e.draining_bytes -= r.size;
  r.draining = false;
  DeviceScope guard(e.device);
  // The host buffer may be reused after the copy; device_ready orders the
  // next user of the device memory after it too.
  cudaEvent_t read = e.events.get(/*timing=*/false);
  C10_CUDA_CHECK(cudaEventRecord(read, e.copy_stream));
  hostPool().release(r.host, read, e.device);
  r.host = HostBuffer{};
  r.device_ready = r.host_ready;
  r.host_ready = nullptr;
  if (r.drain_copied != nullptr) {
    e.events.put(r.drain_copied);
    r.drain_copied = nullptr;
  }
  // A later page-out or free is ordered after the copy stream's work.
  addUser(r, e.copy_stream);
  leave(e, r);
  enter(e, r, State::Inactive);
  e.reclaim_list.push_back(&r);
  ++e.stats.schedule_rescues;
}

// Takes a paged-out record off its lists for a page-in ahead of use and
// returns true; a draining one is rescued instead (its memory is still
// there: no copy back), counted as prefetched, and false returned. Engine
// lock held; the record is not busy.
bool takeForPrefetch(DeviceEngine& e, Record& r) {
  if (r.draining) {
    rescueDrained(e, r);
    r.prefetched = true;
    e.prefetched_bytes += r.size;
    return false;
  }
  e.pagedout_list.remove(&r);
  removeUpcoming(e, r);
  r.busy = true;
  return true;
}

// Pages in ahead of use, on the H2D stream, a record takeForPrefetch() took,
// and counts it in `count` (and its bytes in `bytes`, if given). When the
// limit leaves no room, or the copy cannot be queued, the record goes back
// among the paged-out storages. The engine lock is not held.
bool prefetchTaken(
    DeviceEngine& e,
    Record& r,
    cudaStream_t stream,
    int64_t LmsStats::*count,
    int64_t LmsStats::*bytes = nullptr) {
  bool ok = false;
  try {
    ok = prefetchOne(e, r, stream);
  } catch (...) {
    std::lock_guard<std::mutex> lock(e.mutex);
    r.busy = false;
    e.pagedout_list.push_back(&r);
    addUpcoming(e, r);
    e.settled.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  r.busy = false;
  if (ok) {
    ++(e.stats.*count);
    if (bytes != nullptr) {
      e.stats.*bytes += static_cast<int64_t>(r.size);
    }
    markPrefetched(e, r);
  } else {
    e.pagedout_list.push_back(&r);
    addUpcoming(e, r);
  }
  e.settled.notify_all();
  return ok;
}

// Pages in, on the H2D stream, the paged-out inputs of the recipe of dropped
// `storage`, whose next use is at operator clock `next`, while the prefetched
// bytes not yet used stay within `budget`: its recompute, on demand, then
// finds them resident instead of paging them in on the compute stream. Every
// input is marked needed by `next`, so that no victim choice takes it away
// before. Returns false when the limit left no room. The engine lock is not
// held.
bool prefetchRecipeInputs(
    DeviceEngine& e,
    c10::StorageImpl& storage,
    uint64_t next,
    cudaStream_t stream,
    size_t budget,
    int depth = 0) {
  // A dropped input is recomputed first, from its own recipe's inputs: those
  // are paged in too, a few levels down (a GELU's output dropped with the
  // linear layer's output it is made from).
  constexpr int kMaxDepth = 4;
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  if (hooks == nullptr || hooks->inputs == nullptr) {
    return true;
  }
  std::vector<StorageRef> inputs; // destroyed after every lock is released
  hooks->inputs(storage, inputs);
  for (const StorageRef& input : inputs) {
    Record* r = recordOf(*input);
    if (r == nullptr || r->engine != &e) {
      continue;
    }
    bool dropped = false;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      const uint64_t needed = r->needed_by.load(std::memory_order_relaxed);
      if (needed == 0 || next < needed) {
        r->needed_by.store(next, std::memory_order_relaxed);
      }
      dropped = r->state == State::Dropped && !r->busy;
      if (dropped || r->busy || r->state != State::PagedOut ||
          e.prefetched_bytes + r->size > budget) {
        r = nullptr;
      } else if (!takeForPrefetch(e, *r)) {
        r = nullptr;
      }
    }
    if (dropped) {
      if (depth < kMaxDepth &&
          !prefetchRecipeInputs(e, *input, next, stream, budget, depth + 1)) {
        return false;
      }
      continue;
    }
    if (r == nullptr) {
      continue;
    }
    if (!prefetchTaken(
            e,
            *r,
            stream,
            &LmsStats::recompute_input_prefetch_count,
            &LmsStats::recompute_input_prefetch_bytes)) {
      return false;
    }
  }
  return true;
}

// Pages in, on the H2D stream, the paged-out storages used within the next
// `window` operators, soonest first, while the prefetched bytes not yet used
// stay within `budget` and the limit has room; for a dropped one, the inputs
// its recompute reads (prefetchRecipeInputs).
void prefetchUpcoming(
    DeviceEngine& e,
    uint64_t now,
    uint64_t window,
    size_t budget) {
  const cudaStream_t stream = currentStream(e.device);
  while (true) {
    Record* r = nullptr;
    bool was_dropped = false;
    uint64_t next = 0;
    StorageRef dropped; // released after the engine lock
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      // A predicted use that passed unseen: leave it to demand paging.
      while (!e.upcoming.empty() && e.upcoming.begin()->first < now) {
        e.upcoming.begin()->second->upcoming = false;
        e.upcoming.erase(e.upcoming.begin());
      }
      if (e.upcoming.empty() || e.upcoming.begin()->first > now + window) {
        return;
      }
      r = e.upcoming.begin()->second;
      if (r->state == State::Dropped) {
        was_dropped = true;
        next = e.upcoming.begin()->first;
        removeUpcoming(e, *r);
        if (!r->busy) {
          dropped = r->owner.lock();
        }
      } else {
        if (r->busy || e.prefetched_bytes + r->size > budget) {
          return;
        }
        if (!takeForPrefetch(e, *r)) {
          continue;
        }
      }
    }
    if (was_dropped) {
      if (dropped && !prefetchRecipeInputs(e, *dropped, next, stream, budget)) {
        return;
      }
      continue;
    }
    if (!prefetchTaken(e, *r, stream, &LmsStats::schedule_prefetch_count)) {
      // No room under the limit yet: early page-outs make some, and the
      // next operator boundary tries again.
      return;
    }
  }
}

// Pages out early, on the D2H stream and without a hand-back, victims that
// `pick` chooses (called with the engine lock held; nullptr when none is
// left) until `wanted` bytes are on their way out. Returns the page-outs made
// and adds their bytes to `bytes`.
template <typename Pick>
int64_t pageOutVictims(
    DeviceEngine& e,
    size_t wanted,
    const Pick& pick,
    size_t& bytes) {
  size_t freed = 0;
  int64_t count = 0;
  while (freed < wanted) {
    StorageRef keep_alive; // destroyed after the victim is no longer busy
    Record* victim = nullptr;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      victim = pick();
      if (victim == nullptr) {
        break;
      }
      e.reclaim_list.remove(victim);
      victim->busy = true;
    }
    bool ok = false;
    try {
      ok = pageOut(e, *victim, keep_alive, /*hand_back=*/false);
    } catch (...) {
      std::lock_guard<std::mutex> lock(e.mutex);
      victim->busy = false;
      e.reclaim_list.push_back(victim);
      e.settled.notify_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(e.mutex);
    victim->busy = false;
    if (!ok) {
      e.reclaim_list.push_back(victim);
      e.settled.notify_all();
      break;
    }
    if (!victim->dropped) {
      e.draining_bytes += victim->size;
      ++e.stats.early_pageout_count;
      e.stats.early_pageout_bytes += static_cast<int64_t>(victim->size);
    }
    markPagedOut(e, *victim, e.draining_list);
    e.settled.notify_all();
    freed += victim->size;
    ++count;
  }
  bytes += freed;
  return count;
}

// Pages out early victims that `pick` chooses until `room` bytes are free
// under `limit`, with `allocated` bytes allocated on the device (the caller
// reads it once per operator boundary: the drop-in's allocator copies its
// statistics under its lock to say), counting memory that draining page-outs
// are about to release. Returns the page-outs made.
template <typename Pick>
int64_t pageOutEarlyFor(
    DeviceEngine& e,
    size_t allocated,
    size_t limit,
    size_t room,
    const Pick& pick) {
  if (limit <= room) {
    return 0;
  }
  size_t pending = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    pending = e.draining_bytes;
  }
  const size_t expected = allocated > pending ? allocated - pending : 0;
  if (expected <= limit - room) {
    return 0;
  }
  size_t bytes = 0;
  return pageOutVictims(e, expected - (limit - room), pick, bytes);
}

// Keeps `margin` bytes free under the limit by paging out early the storages
// used furthest in the future, none used before `protect_until`.
void pageOutEarly(
    DeviceEngine& e,
    size_t allocated,
    uint64_t protect_until,
    size_t limit,
    size_t margin) {
  const size_t threshold = g_size_threshold.load();
  pageOutEarlyFor(e, allocated, limit, margin, [&] {
    return pickVictim(e, threshold, protect_until);
  });
}

// Records the demand at this operator boundary (the bytes the live storages
// would take on the device: allocated, plus paged out and no longer
// allocated) and, once a whole iteration has been seen, its peak. Engine
// lock held.
void recordDemand(
    DeviceEngine& e,
    uint64_t now,
    uint64_t period,
    uint64_t generation,
    size_t allocated) {
  if (e.demand_generation != generation || now < e.demand_began) {
    e.demand_generation = generation;
    e.demand_began = now;
    e.demand_max = 0;
    e.peak_bytes = 0;
    e.peak_retry = 0;
  }
  if (now - e.demand_began >= period) {
    e.peak_bytes = e.demand_max;
    e.peak_phase = e.demand_max_phase;
    e.demand_began = now;
    e.demand_max = 0;
  }
  const auto off =
      static_cast<size_t>(std::max<int64_t>(e.stats.pagedout_bytes.current, 0));
  const size_t demand =
      allocated + (off > e.draining_bytes ? off - e.draining_bytes : 0);
  if (demand > e.demand_max) {
    e.demand_max = demand;
    e.demand_max_phase = now % period;
  }
}

// Pages out early, from the start of the iteration, what must be off the
// device at its peak of demand: storages whose next use comes after the peak,
// furthest first, until the bytes off the device cover the peak's excess over
// the limit (pageOutEarly() still keeps the budget's room free as the peak
// nears). pageOutEarly() alone makes room only as the limit nears, so the
// D2H stream idled through the first part of a forward pass and then bounded
// the rest of it; the same storages leave earlier now, while compute runs (the
// victims are those Belady's choice takes at the peak: at any clock before
// it, the storages used furthest in the future that are still resident).
// The copies queued at once stay within the budget, so that a storage is
// not held on the device waiting for its turn longer than the budget takes
// to copy. Memory that dies before the peak is never paged out for it.
void pageOutAheadOfPeak(
    DeviceEngine& e,
    size_t allocated,
    uint64_t now,
    uint64_t period,
    uint64_t generation,
    size_t limit,
    size_t budget) {
  uint64_t peak_clock = 0;
  size_t wanted = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    recordDemand(e, now, period, generation, allocated);
    if (e.peak_bytes == 0 || now < e.peak_retry) {
      return;
    }
    const uint64_t ahead = (e.peak_phase + period - now % period) % period;
    const size_t must = e.peak_bytes > limit ? e.peak_bytes - limit : 0;
    const auto off = static_cast<size_t>(
        std::max<int64_t>(e.stats.pagedout_bytes.current, 0));
    if (ahead == 0 || must <= off || e.draining_bytes >= budget) {
      return;
    }
    peak_clock = now + ahead;
    wanted = std::min(must - off, budget - e.draining_bytes);
  }
  const size_t threshold = g_size_threshold.load();
  size_t bytes = 0;
  const int64_t made = pageOutVictims(
      e, wanted, [&] { return pickVictim(e, threshold, peak_clock); }, bytes);
  std::lock_guard<std::mutex> lock(e.mutex);
  e.stats.peak_pageout_count += made;
  e.stats.peak_pageout_bytes += static_cast<int64_t>(bytes);
  if (bytes < wanted) {
    // Nothing resident is used after the peak (yet): a search is a pass over
    // the reclaim list, so the next one waits for a few operators to add
    // storages to it.
    e.peak_retry = now + std::clamp<uint64_t>(period / 32, 1, kPeakRetryOps);
  }
}

// Page-ins planned by compiled code (pageInAhead): what it does on one
// device, for the records of `planned` that live there, soonest first.
size_t pageInAheadOn(DeviceEngine& e, const std::vector<Record*>& planned) {
  const cudaStream_t stream = currentStream(e.device);
  if (isCapturing(stream)) {
    // A CUDA graph captures the compiled code that says this: copies cannot
    // be captured, and the graph's inputs are resident for its replays.
    return 0;
  }
  if (g_schedule_enabled.load()) {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    if (theSchedule().active()) {
      // A learned schedule knows the whole iteration (the optimizer and the
      // eager code between compiled regions too) and already pages in ahead
      // what the graph would name: the plan only takes its budget. Measured
      // on a compiled GPT-style decoder (H100): with both, iterations were
      // up to 6% slower than with the schedule alone; before the schedule
      // settles, the plan alone made the first iterations faster
      // (benchmarks/results/compile/2026-11-24-h100-unrecorded/graph-prefetch/).
      return 0;
    }
  }
  // Early page-outs whose copies are done give their memory back first: it
  // is the room the page-ins below need.
  drainPageOuts(e, 0);
  const size_t limit = effectiveLimit(e);
  size_t budget = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    budget = prefetchBudget(limit, e.pagein_last_iteration);
  }
  size_t started = 0;
  size_t index = 0;
  for (; index < planned.size(); ++index) {
    Record* r = planned[index];
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      if (r->engine != &e || r->busy || r->state != State::PagedOut) {
        continue;
      }
      if (e.prefetched_bytes + r->size > budget) {
        return started;
      }
      if (!takeForPrefetch(e, *r)) {
        continue;
      }
    }
    if (!prefetchTaken(
            e,
            *r,
            stream,
            &LmsStats::graph_prefetch_count,
            &LmsStats::graph_prefetch_bytes)) {
      break;
    }
    started += r->size;
  }
  if (index == planned.size()) {
    return started;
  }
  // No room under the limit for the next page-ins of the plan: page out least
  // recently used storages that the plan does not name, so that a later call
  // finds the room.
  size_t wanted = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    size_t ahead = e.prefetched_bytes;
    for (size_t i = index; i < planned.size(); ++i) {
      const Record* r = planned[i];
      if (r->engine != &e || r->state != State::PagedOut || r->draining) {
        continue;
      }
      if (ahead + r->size > budget) {
        break;
      }
      ahead += r->size;
      wanted += r->size;
    }
  }
  const size_t threshold = g_size_threshold.load();
  const size_t allocated = backend().allocatedBytes(e.device);
  const int64_t made =
      pageOutEarlyFor(e, allocated, limit, wanted, [&]() -> Record* {
        for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
          if (r->size >= threshold && !r->prefetched &&
              std::find(planned.begin(), planned.end(), r) == planned.end()) {
            return r;
          }
        }
        return nullptr;
      });
  std::lock_guard<std::mutex> lock(e.mutex);
  e.stats.graph_pageout_count += made;
  return started;
}

// What the schedule does at an operator boundary for one device.
void scheduleTick(DeviceEngine& e) {
  drainPageOuts(e, 0);
  uint64_t now = 0;
  uint64_t period = 0;
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    const AccessSchedule& schedule = theSchedule();
    if (!schedule.active()) {
      return;
    }
    now = schedule.now();
    period = schedule.period();
    generation = schedule.generation();
  }
  const size_t limit = effectiveLimit(e);
  size_t budget = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.upcoming_generation != generation) {
      refileUpcoming(e, generation);
    }
    measureIteration(e, now, period);
    budget = prefetchBudget(limit, e.pagein_last_iteration);
  }
  const uint64_t window = lookaheadOps(period);
  prefetchUpcoming(e, now, window, budget);
  // Early page-outs keep their device memory until drained: both read the
  // bytes allocated after the page-ins above.
  const size_t allocated = backend().allocatedBytes(e.device);
  pageOutEarly(e, allocated, now + window, limit, budget);
  pageOutAheadOfPeak(e, allocated, now, period, generation, limit, budget);
}

// Pins made for a recompute's replay on this thread (pinForRecompute): uses
// the program does not make, which the learned schedule must not see.
thread_local int t_recompute_pins = 0;

// A use of `r` by the running operator, resident or over the bus: the
// learned schedule measures distances from the last one (see
// AccessSchedule::Use). A use for a recompute only ends what the recompute
// needed it for.
void noteUse(Record& r) {
  r.needed_by.store(0, std::memory_order_relaxed);
  if (t_recompute_pins > 0) {
    return;
  }
  const uint64_t now = g_op_clock.load(std::memory_order_relaxed);
  const uint64_t last = r.touch.load(std::memory_order_relaxed);
  if (now > last) {
    r.gap.store(now - last, std::memory_order_relaxed);
    r.touch.store(now, std::memory_order_relaxed);
  }
}

// Makes `r` resident for use on the current stream and moves it to `target`
// (Active for pin, Allocated for raw access). Called with `lock` held.
void makeResident(
    DeviceEngine& e,
    Record& r,
    c10::StorageImpl& storage,
    State target,
    std::unique_lock<std::mutex>& lock) {
  e.settled.wait(lock, [&] { return !r.busy; });
  const cudaStream_t stream = currentStream(e.device);
  std::vector<Record*> prefetch;
  if (target == State::Active) {
    noteUse(r);
  }
  if (r.state == State::Active && target == State::Active) {
    ++r.pins;
    waitUntilResident(e, r, stream);
    return;
  }
  if (r.state == State::PagedOut && r.draining) {
    // Used again before its early page-out released the memory: the
    // contents are still there, no copy back is needed.
    rescueDrained(e, r);
  }
  if (r.state == State::Inactive) {
    e.reclaim_list.remove(&r);
    if (r.prefetched) {
      ++e.stats.prefetch_hits;
      if (r.device_ready != nullptr &&
          cudaEventQuery(r.device_ready) == cudaErrorNotReady) {
        (void)cudaGetLastError(); // not an error: clear the sticky state
        ++e.stats.prefetch_late;
      }
      clearPrefetched(e, r);
    }
  } else if (r.state == State::PagedOut) {
    TORCH_CHECK(
        !isCapturing(stream),
        "LMS: a storage of ",
        std::to_string(r.size),
        " bytes is paged out while CUDA graph capture is underway on the "
        "current stream; a page-in cannot be captured. Run the captured "
        "region once before capturing so its inputs are resident, or "
        "capture with LMS disabled (torch.cuda.set_enabled_lms(False)).");
    const int depth = target == State::Active ? g_prefetch_depth.load() : 0;
    for (Record* p = r.prev;
         p != nullptr && static_cast<int>(prefetch.size()) < depth;
         p = p->prev) {
      prefetch.push_back(p);
    }
    e.pagedout_list.remove(&r);
    removeUpcoming(e, r);
    for (Record* p : prefetch) {
      e.pagedout_list.remove(p);
      removeUpcoming(e, *p);
      p->busy = true;
    }
    r.busy = true;
    lock.unlock();
    try {
      pageIn(e, r, stream);
    } catch (...) {
      lock.lock();
      r.busy = false;
      e.pagedout_list.push_back(&r);
      for (Record* p : prefetch) {
        p->busy = false;
        e.pagedout_list.push_back(p);
      }
      e.settled.notify_all();
      throw;
    }
    lock.lock();
    r.busy = false;
    ++e.stats.pagein_count;
    ++e.stats.pagein_demand_count;
    e.stats.pagein_bytes += sz(r);
    e.settled.notify_all();
  }
  waitUntilResident(e, r, stream);
  rememberOwner(r, storage);
  if (target == State::Allocated && isCapturing(stream)) {
    // Raw access during capture (a kernel launched outside the dispatcher):
    // the graph bakes in this address.
    r.graph_owned = true;
  }
  leave(e, r);
  enter(e, r, target);
  clearFresh(e, r);
  r.pins = target == State::Active ? 1 : 0;
  refreshDataPtr(storage, r);
  arm(storage, false);
  if (!prefetch.empty()) {
    lock.unlock();
    try {
      prefetchAfterPin(e, std::move(prefetch));
    } catch (const std::exception& error) {
      // Prefetch is speculative: the storage asked for is resident and
      // pinned, and the storages that were not prefetched stay paged out.
      TORCH_WARN_ONCE(
          "Large Model Support: a prefetch failed; storages are paged in on "
          "demand. ",
          error.what());
    }
    lock.lock();
  }
}

void deleteRecord(void* ctx) {
  auto* r = static_cast<Record*>(ctx);
  DeviceEngine& e = *r->engine;
  WorkingSet& ws = t_working_set;
  if (r->working_set != 0 && ws.active && r->working_set == ws.serial) {
    ws.inside -= std::min(ws.inside, r->size); // a temporary of the operator
  }
  if (r->recomputable) {
    if (const RecomputeHooks* hooks = g_recompute_hooks.load()) {
      hooks->forget(ctx);
    }
  }
  // Only storages that may be paged out matter to victim choice: the small
  // ones, freed by the thousand, do not take the schedule's lock.
  if (g_schedule_enabled.load() && r->size >= g_size_threshold.load() &&
      !r->moved) {
    // Taken alone: no engine lock is held here, and the schedule's mutex is
    // never held while a storage is freed.
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    if (theSchedule().active()) {
      theSchedule().recordDeath(r->touch.load(), r->size, r->gap.load());
    }
  }
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy; });
    if (r->list != nullptr) {
      r->list->remove(r);
    }
    removeUpcoming(e, *r);
    clearPrefetched(e, *r);
    if (r->draining) {
      e.draining_bytes -= r->size;
    }
    leave(e, *r);
    clearFresh(e, *r);
    add(e.stats.managed_bytes, -sz(*r));
  }
  DeviceScope guard(e.device);
  if (r->draining) {
    // The device memory may be reused only after the copy that reads it.
    C10_CUDA_CHECK_WARN(cudaStreamWaitEvent(r->stream, r->host_ready, 0));
    e.events.put(r->drain_copied);
    r->drain_copied = nullptr;
    if (!r->stream_known) {
      backend().freeAfter(r->device_ptr, e.device, e.copyStream());
      r->device_ptr = nullptr;
    }
  }
  releaseDeviceMemory(e, *r, /*in_deleter=*/true);
  if (r->on_host) {
    // Freed while operators may still be using it (a workspace).
    r->host_ready = hostUseDone(e, *r, /*in_deleter=*/true);
  }
  if (r->host.ptr != nullptr) {
    // The page-out copy may still be writing into the buffer.
    hostPool().release(r->host, r->host_ready, e.device);
  } else if (r->host_ready != nullptr) {
    e.events.put(r->host_ready);
  }
  delete r;
}

// Takes over a storage the backend allocated without LMS (see
// DeviceMemoryBackend::adoptable). Its DataPtr is replaced by one whose
// context is the new record; the memory stays where it is.
Record* adopt(c10::StorageImpl& storage) {
  DeviceMemoryBackend* b = g_backend.load();
  c10::DataPtr& dp = storage._mutable_data_ptr_no_checks();
  if (!isEnabled() || b == nullptr || dp.get() == nullptr ||
      dp.device().type() != c10::DeviceType::CUDA ||
      storage.nbytes() < g_size_threshold.load() || !b->adoptable(dp)) {
    return nullptr;
  }
  const c10::DeviceIndex device = dp.device().index();
  if (isCapturing(currentStream(device))) {
    return nullptr; // graph memory must stay put
  }
  DeviceEngine& e = engineFor(device);
  auto* r = new Record();
  r->engine = &e;
  r->size = storage.nbytes();
  r->device_ptr = dp.get();
  r->stream = currentStream(device);
  r->stream_known = false;
  // The backend's deleter is dropped: the record frees the memory now.
  (void)dp.release_context();
  dp = c10::DataPtr(r->device_ptr, r, &deleteRecord, dp.device());
  rememberOwner(*r, storage);
  std::lock_guard<std::mutex> lock(e.mutex);
  add(e.stats.managed_bytes, sz(*r));
  return r;
}

#ifdef C10_LMS_STORAGE_HOOK
void storageAccessHook(c10::StorageImpl& storage) {
  access(storage);
}
#endif

} // namespace

// ---------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------

DeviceMemoryBackend::~DeviceMemoryBackend() = default;

HostPool& hostPool() {
  // Never destroyed: deleters of storages may run during static destruction.
  static HostPool* pool = new HostPool(
      [](cudaEvent_t ev, c10::DeviceIndex d) { engineFor(d).events.put(ev); });
  return *pool;
}

void setEnabled(bool enabled) {
#ifdef C10_LMS_STORAGE_HOOK
  c10::impl::SetLmsStorageAccessHook(&storageAccessHook);
#endif
  g_enabled.store(enabled);
  if (EnabledObserver observer = g_enabled_observer.load()) {
    observer(enabled);
  }
}

void setEnabledObserver(EnabledObserver observer) {
  g_enabled_observer.store(observer);
  if (observer != nullptr && isEnabled()) {
    observer(true);
  }
}

bool isEnabled() {
  return g_enabled.load(std::memory_order_relaxed);
}

void setLimit(c10::DeviceIndex device, size_t bytes) {
  DeviceEngine& e = engineFor(device);
  std::lock_guard<std::mutex> lock(e.mutex);
  e.user_limit = bytes;
}

size_t getLimit(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  return g_backend.load() != nullptr ? effectiveLimit(e) : limitOf(e);
}

void setSizeThreshold(size_t bytes) {
  g_size_threshold.store(bytes);
}

size_t getSizeThreshold() {
  return g_size_threshold.load();
}

void setPrefetchDepth(int depth) {
  TORCH_CHECK(
      depth >= 0,
      "LMS: prefetch depth must be >= 0, got ",
      std::to_string(depth));
  g_prefetch_depth.store(depth);
}

int getPrefetchDepth() {
  return g_prefetch_depth.load();
}

void setSpeculativeMargin(size_t bytes) {
  g_speculative_margin.store(bytes);
}

size_t getSpeculativeMargin() {
  return g_speculative_margin.load();
}

void setScheduleEnabled(bool enabled) {
  g_schedule_enabled.store(enabled);
}

bool isScheduleEnabled() {
  return g_schedule_enabled.load();
}

void setLookahead(int operators) {
  TORCH_CHECK(
      operators >= 0,
      "LMS: the lookahead must be >= 0 operators, got ",
      std::to_string(operators));
  g_lookahead_ops.store(operators);
}

int getLookahead() {
  return g_lookahead_ops.load();
}

void setPrefetchBudget(size_t bytes) {
  g_prefetch_budget.store(bytes);
}

size_t getPrefetchBudget() {
  return g_prefetch_budget.load();
}

void setGraphPrefetchEnabled(bool enabled) {
  g_graph_prefetch.store(enabled);
}

bool isGraphPrefetchEnabled() {
  return g_graph_prefetch.load();
}

void setHostLimit(size_t bytes) {
  hostPool().setLimit(bytes);
}

void setRecomputeEnabled(bool enabled) {
  g_recompute.store(enabled);
}

bool isRecomputeLogEnabled() {
  static const bool on = isFlagSet("PYTORCH_LMS_RECOMPUTE_LOG");
  return on;
}

bool isRecomputeEnabled() {
  return g_recompute.load();
}

void setPackingEnabled(bool enabled) {
  g_packing.store(enabled);
}

bool isPackingEnabled() {
  return g_packing.load();
}

void setHostPlacementEnabled(bool enabled) {
  g_host_placement.store(enabled);
}

bool isHostPlacementEnabled() {
  return g_host_placement.load();
}

size_t getHostLimit() {
  return hostPool().getLimit();
}

size_t pageInAhead(c10::ArrayRef<c10::StorageImpl*> storages) {
  if (!isEnabled() || !g_graph_prefetch.load()) {
    return 0;
  }
  std::vector<Record*> planned;
  planned.reserve(storages.size());
  c10::SmallVector<DeviceEngine*, 2> engines;
  for (c10::StorageImpl* storage : storages) {
    if (Record* r = recordOf(*storage)) {
      planned.push_back(r);
      if (std::find(engines.begin(), engines.end(), r->engine) ==
          engines.end()) {
        engines.push_back(r->engine);
      }
    }
  }
  size_t started = 0;
  for (DeviceEngine* e : engines) {
    started += pageInAheadOn(*e, planned);
  }
  return started;
}

void resetSchedule() {
  std::lock_guard<std::mutex> lock(g_schedule_mutex);
  theSchedule().reset();
  g_op_clock.store(0);
}

void beginOperator(
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs) {
  if (!isEnabled() || !g_schedule_enabled.load()) {
    return;
  }
  c10::SmallVector<AccessSchedule::Use, 16> uses;
  DeviceEngine* device_engine = nullptr;
  for (c10::StorageImpl* storage : inputs) {
    if (Record* r = recordOf(*storage)) {
      uses.push_back(
          AccessSchedule::Use{r->touch.load(), r->size, r->gap.load()});
      device_engine = r->engine;
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    g_op_clock.store(theSchedule().record(name, uses.data(), uses.size()));
    g_births_in_op.store(0);
    if (theSchedule().logging()) {
      if (const std::string report = theSchedule().takeDropReport();
          !report.empty()) {
        std::fprintf(
            stderr,
            "Large Model Support: the swap schedule: %s\n",
            report.c_str());
      }
    }
  }
  if (device_engine != nullptr) {
    scheduleTick(*device_engine);
    return;
  }
  // No managed input says where the operator runs: serve every device that
  // has LMS storages (usually the one).
  std::vector<DeviceEngine*> engines;
  {
    std::lock_guard<std::mutex> lock(g_engines_mutex);
    engines = g_engines;
  }
  for (DeviceEngine* e : engines) {
    if (e == nullptr) {
      continue;
    }
    bool managed = false;
    {
      std::lock_guard<std::mutex> lock(e->mutex);
      managed = e->stats.managed_bytes.current > 0;
    }
    if (managed) {
      scheduleTick(*e);
    }
  }
}

namespace {

// What operators of one name allocated inside themselves, learned from every
// run: the most for each size of inputs seen (an iteration repeats its calls,
// and one name serves many: the matmul that makes a language model's logits
// allocates several times its inputs, the model's other matmuls about as
// much as theirs), and
// for inputs of a size not seen yet the most per byte of input (at least 1 MiB
// of input counted, so that an operator with tiny inputs does not scale up
// without bound).
struct Footprint {
  double inside_per_input = 0.0;
  std::unordered_map<size_t, size_t> inside_by_input;
  // The most blocks of kPackBlockBytes or more one call allocated.
  size_t blocks = 0;
};
// Input sizes remembered per operator name: models whose shapes change every
// step (a mixture of experts) fall back to the per-byte share past it.
constexpr size_t kFootprintSizes = 256;

std::mutex g_footprint_mutex;
std::unordered_map<std::string, Footprint> g_footprints;
// The most any operator allocated inside itself: what an operator not seen
// yet may need.
// Written under g_footprint_mutex, read without it.
std::atomic<size_t> g_largest_inside{0};
// The most any operator name allocated per byte of input: with
// g_largest_inside, a bound on every operator's expectation that
// packIfTight reads without the lock.
std::atomic<double> g_largest_inside_per_input{0.0};

// What an operator is expected to allocate inside itself.
struct Expectation {
  size_t inside = 0;
  // Whether an operator of its name ran with inputs of that size before;
  // otherwise `inside` is a bound.
  bool measured = false;
  // The most blocks of kPackBlockBytes or more that a call of its name
  // allocated (at least 1: an operator not seen yet, or one of small blocks,
  // counts one).
  size_t blocks = 1;
};

// What an operator about to pin `pinned` bytes of inputs is expected to
// allocate inside itself.
Expectation expectedInside(std::string_view name, size_t pinned) {
  const double input = static_cast<double>(std::max(pinned, kMiB));
  std::lock_guard<std::mutex> lock(g_footprint_mutex);
  const auto it = g_footprints.find(std::string(name));
  if (it == g_footprints.end()) {
    return {std::max(kUnseenInsidePerInput * pinned, g_largest_inside.load())};
  }
  const Footprint& footprint = it->second;
  const size_t blocks = std::max<size_t>(footprint.blocks, 1);
  if (const auto same = footprint.inside_by_input.find(pinned);
      same != footprint.inside_by_input.end()) {
    return {same->second, true, blocks};
  }
  const size_t scaled = static_cast<size_t>(footprint.inside_per_input * input);
  return {std::max(scaled, kUnseenInsidePerInput * pinned), false, blocks};
}

// `bytes` in MiB, for the diagnostic logs.
double inMiB(size_t bytes) {
  return static_cast<double>(bytes) / static_cast<double>(kMiB);
}

// PYTORCH_LMS_PACK_LOG=1 prints, for every operator whose expected working
// set is tight, what packIfTight weighed and decided, to stderr (a
// diagnostic, not a setting).
bool isPackLogEnabled() {
  static const bool on = isFlagSet("PYTORCH_LMS_PACK_LOG");
  return on;
}

} // namespace

size_t mappedBytesHeld(const SegmentMap& map, const std::vector<bool>& held) {
  TORCH_CHECK(
      held.size() == map.blocks.size(),
      "Large Model Support: mappedBytesHeld got ",
      held.size(),
      " flags for ",
      map.blocks.size(),
      " blocks; pass one flag per block");
  size_t total = 0;
  for (const auto& block : map.blocks) {
    total += block.first;
  }
  const size_t page = map.page_bytes > 0 ? map.page_bytes : total;
  if (page == 0) {
    return 0;
  }
  std::vector<bool> mapped((total + page - 1) / page, false);
  size_t offset = 0;
  for (size_t b = 0; b < map.blocks.size(); ++b) {
    const size_t size = map.blocks[b].first;
    if (held[b] && size > 0) {
      for (size_t i = offset / page; i <= (offset + size - 1) / page; ++i) {
        mapped[i] = true;
      }
    }
    offset += size;
  }
  size_t bytes = 0;
  for (size_t i = 0; i < mapped.size(); ++i) {
    if (mapped[i]) {
      bytes += std::min(page, total - i * page);
    }
  }
  return bytes;
}

namespace {

// The memory an operator about to pin `inputs` finds mapped beside it as the
// allocator's memory lies now, once on-demand paging has put every other
// reclaimable storage out: what stays mapped (each segment, or page of an
// expandable segment, in which a block of an input or of anything not
// reclaimable lies, and whatever the layout does not show: the small pool,
// other streams, private pools) and the inputs still to be paged in.
// SIZE_MAX when the allocator cannot show its layout: then only packing is
// sure to make the room.
size_t mappedBesideInputs(
    DeviceEngine& e,
    c10::ArrayRef<c10::StorageImpl*> inputs) {
  const std::vector<SegmentMap> maps =
      backend().segments(e.device, currentStream(e.device));
  if (maps.empty()) {
    return SIZE_MAX;
  }
  std::unordered_map<uintptr_t, Record*> movable;
  size_t paged_in_later = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    movable = residentReclaimable(e);
    for (c10::StorageImpl* storage : inputs) {
      Record* r = recordOf(*storage);
      if (r == nullptr || r->engine != &e) {
        continue; // unmanaged, or another device's memory
      }
      if (r->device_ptr != nullptr) {
        movable.erase(reinterpret_cast<uintptr_t>(r->device_ptr));
      } else {
        paged_in_later += r->size;
      }
    }
  }
  size_t shown = 0;
  size_t stays = 0;
  for (const SegmentMap& map : maps) {
    std::vector<bool> held(map.blocks.size(), false);
    uintptr_t address = map.base;
    for (size_t i = 0; i < map.blocks.size(); ++i) {
      const auto [size, allocated] = map.blocks[i];
      held[i] = allocated && movable.count(address) == 0;
      address += size;
      shown += size;
    }
    stays += mappedBytesHeld(map, held);
  }
  const size_t reserved = backend().reservedBytes(e.device);
  const size_t unshown = reserved > shown ? reserved - shown : 0;
  return stays + unshown + paged_in_later;
}

// Frees libraries' cached workspaces for an operator judged tight on `e`'s
// device (setWorkspaceReleaser), and counts it. Returns whether it did.
bool releaseWorkspaces(DeviceEngine& e) {
  const WorkspaceReleaser release = g_workspace_releaser.load();
  if (release == nullptr) {
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(g_engines_mutex);
    if (std::count_if(g_engines.begin(), g_engines.end(), [](auto* engine) {
          return engine != nullptr;
        }) > 1) {
      return false;
    }
  }
  release();
  std::lock_guard<std::mutex> lock(e.mutex);
  ++e.stats.workspace_releases;
  return true;
}

// Packs the operator about to pin `inputs` (`pinned` bytes) when its
// expected working set leaves too little of the limit for the pages it
// occupies partly (see beginWorkingSet in the header).
void packIfTight(
    DeviceEngine& e,
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs,
    size_t pinned) {
  const size_t limit = effectiveLimit(e);
  // What cannot be paged out: unmanaged and small allocations, and storages
  // pinned or just allocated by running operators.
  auto notReclaimable = [&] {
    const size_t allocated = backend().allocatedBytes(e.device);
    std::lock_guard<std::mutex> lock(e.mutex);
    const auto inactive = static_cast<size_t>(
        std::max<int64_t>(e.stats.inactive_bytes.current, 0));
    return allocated > inactive ? allocated - inactive : 0;
  };
  size_t fixed = notReclaimable();
  auto tight = [&](size_t inside) {
    return fixed + pinned + inside + kPackMarginBytes > limit;
  };
  // Most operators are far from tight even at the largest expectation any
  // operator has: they need neither the lock nor the name's footprint.
  const auto largest_scaled = static_cast<size_t>(
      g_largest_inside_per_input.load() *
      static_cast<double>(std::max(pinned, kMiB)));
  if (!tight(std::max(
          {kUnseenInsidePerInput * pinned,
           g_largest_inside.load(),
           largest_scaled}))) {
    return;
  }
  const auto [inside, measured, blocks] = expectedInside(name, pinned);
  if (!tight(inside)) {
    return;
  }
  // Packing makes room for what an operator allocates beside its inputs. One
  // that allocates nothing (an optimizer's in-place foreach step) has its
  // inputs paged in on demand, each where it fits; one whose inputs, inside
  // bytes and what cannot be paged out pass the allocator's cap fits under
  // no placement. For either a pack would only cost a round of page-outs
  // (GPT at 4x an H100's cap: the optimizer's three in-place steps, every
  // iteration). Only a figure measured at this size of inputs says so; a
  // bound does not.
  const bool allocates = !measured || inside > 0;
  // Libraries' cached workspaces are among what cannot be paged out until
  // they are freed, and where they lie they keep pages mapped: an operator
  // that allocates has them freed before it is weighed, so that its blocks
  // can take their room, packed or not (stress seed 218, a cuDNN LSTM not
  // packed: 2.63 MiB short with a cuBLAS workspace in the middle), and they
  // do not make it look as if no placement could fit it (seed 302, a
  // convolution backward: 66 MiB of cuBLAS workspaces took it past the cap
  // by 23 MiB, so it was not packed, and cuDNN's workspace failed).
  if (allocates && releaseWorkspaces(e)) {
    fixed = notReclaimable();
  }
  const size_t capacity = backend().capacityBytes(e.device);
  const size_t wall = capacity == SIZE_MAX ? limit : std::max(capacity, limit);
  const bool futile =
      !allocates || (measured && fixed + pinned + inside > wall);
  // The operator fits beside its inputs where they lie, with a page to
  // spare for each block it allocates: on-demand paging makes its room, and
  // nothing moves ahead.
  const size_t spare = kPackSpareBytes * std::min(blocks, kPackSpareBlocks);
  const size_t beside = futile ? SIZE_MAX : mappedBesideInputs(e, inputs);
  const bool pack =
      !futile && (beside == SIZE_MAX || beside + inside + spare > limit);
  if (isPackLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS pack: %s %.*s: inputs %.1f MiB, expected inside %.1f MiB "
        "in %zu block%s, not reclaimable %.1f MiB, mapped beside the inputs "
        "%.1f MiB, limit %.1f MiB\n",
        pack ? "packed" : (futile ? "cannot help" : "not packed"),
        static_cast<int>(name.size()),
        name.data(),
        inMiB(pinned),
        inMiB(inside),
        blocks,
        blocks == 1 ? "" : "s",
        inMiB(fixed),
        beside == SIZE_MAX ? -1.0 : inMiB(beside),
        inMiB(limit));
  }
  if (!pack) {
    return;
  }
  const size_t freed =
      reclaim(e, std::numeric_limits<size_t>::max(), Trigger::Pack);
  // Returning the cache synchronizes the device, but without it the freed
  // blocks that other streams used stay out of the allocator's free lists
  // until their events are polled, and the page-ins fill the holes of the
  // ranges the operator's inputs kept mapped (the simulated-GPU test
  // an_operator_expected_to_need_most_of_the_device_is_packed_first shows
  // it). Emptied, the allocator maps the inputs anew side by side.
  backend().releaseCachedMemory(e.device);
  std::lock_guard<std::mutex> lock(e.mutex);
  ++e.stats.pack_count;
  e.stats.pack_bytes += static_cast<int64_t>(freed);
}

} // namespace

void beginWorkingSet(
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs) {
  WorkingSet& ws = t_working_set;
  ws = WorkingSet{};
  if (!isEnabled() || g_backend.load() == nullptr) {
    return;
  }
  DeviceEngine* e = nullptr;
  size_t pinned = 0;
  for (c10::StorageImpl* storage : inputs) {
    if (Record* r = recordOf(*storage)) {
      pinned += r->size;
      e = r->engine;
    }
  }
  if (e == nullptr) {
    return; // no managed input says which device it runs on
  }
  ws.active = true;
  ws.device = e->device;
  ws.name = name;
  ws.serial = ++g_working_set_serial;
  ws.pinned = pinned;
  DeviceScope guard(e->device);
  // A captured graph bakes in addresses: nothing may move during a capture.
  if (!g_packing.load() || isCapturing(currentStream(e->device))) {
    return;
  }
  packIfTight(*e, name, inputs, pinned);
}

void endWorkingSet(std::string_view name) {
  WorkingSet& ws = t_working_set;
  if (!ws.active) {
    return;
  }
  ws.active = false;
  const double per_input = static_cast<double>(ws.inside_peak) /
      static_cast<double>(std::max(ws.pinned, kMiB));
  // What the figure of this size was before (SIZE_MAX: none), for the log.
  size_t before = SIZE_MAX;
  {
    std::lock_guard<std::mutex> lock(g_footprint_mutex);
    Footprint& footprint = g_footprints[std::string(name)];
    footprint.inside_per_input =
        std::max(footprint.inside_per_input, per_input);
    footprint.blocks = std::max(footprint.blocks, ws.blocks);
    if (const auto same = footprint.inside_by_input.find(ws.pinned);
        same != footprint.inside_by_input.end()) {
      before = same->second;
      same->second = std::max(same->second, ws.inside_peak);
    } else if (footprint.inside_by_input.size() < kFootprintSizes) {
      footprint.inside_by_input.emplace(ws.pinned, ws.inside_peak);
    }
    g_largest_inside.store(std::max(g_largest_inside.load(), ws.inside_peak));
    g_largest_inside_per_input.store(
        std::max(g_largest_inside_per_input.load(), per_input));
  }
  // The log's other half: what operators measured, the first time at a size
  // and whenever they allocate a page more than the figure packIfTight read,
  // so that an expectation can be checked against what came. Operators under
  // kPackLogBytes in all are left out.
  const bool first = before == SIZE_MAX;
  if (isPackLogEnabled() && ws.pinned + ws.inside_peak >= kPackLogBytes &&
      (first || ws.inside_peak > before + kPackSpareBytes)) {
    char was[48] = "first at this size";
    if (!first) {
      std::snprintf(was, sizeof(was), "was %.1f MiB", inMiB(before));
    }
    std::fprintf(
        stderr,
        "LMS pack: measured %.*s: inputs %.1f MiB, inside %.1f MiB (%s)\n",
        static_cast<int>(name.size()),
        name.data(),
        inMiB(ws.pinned),
        inMiB(ws.inside_peak),
        was);
  }
}

namespace {

double parseNonNegative(std::string_view key, std::string_view value) {
  const std::string text(value);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  TORCH_CHECK(
      !text.empty() && end == text.c_str() + text.size() && v >= 0,
      "PYTORCH_CUDA_ALLOC_CONF: ",
      key,
      " expects a non-negative number, got '",
      text,
      "'");
  return v;
}

size_t mebibytes(std::string_view key, std::string_view value) {
  return static_cast<size_t>(parseNonNegative(key, value) * kMiB);
}

bool parseBool(std::string_view key, std::string_view value) {
  TORCH_CHECK(
      value == "True" || value == "False",
      "PYTORCH_CUDA_ALLOC_CONF: ",
      key,
      " expects True or False, got '",
      std::string(value),
      "'");
  return value == "True";
}

int parseCount(std::string_view key, std::string_view value) {
  const double v = parseNonNegative(key, value);
  TORCH_CHECK(
      v == static_cast<int>(v),
      "PYTORCH_CUDA_ALLOC_CONF: ",
      key,
      " expects a whole number, got '",
      std::string(value),
      "'");
  return static_cast<int>(v);
}

} // namespace

bool parseConfigOption(std::string_view key, std::string_view value) {
  if (key == "lms") {
    setEnabled(parseBool(key, value));
  } else if (key == "lms_limit_mb") {
    g_conf_limit.store(mebibytes(key, value));
  } else if (key == "lms_size_mb") {
    setSizeThreshold(mebibytes(key, value));
  } else if (key == "lms_prefetch") {
    setPrefetchDepth(parseCount(key, value));
  } else if (key == "lms_speculative_mb") {
    setSpeculativeMargin(mebibytes(key, value));
  } else if (key == "lms_schedule") {
    setScheduleEnabled(parseBool(key, value));
  } else if (key == "lms_lookahead") {
    setLookahead(parseCount(key, value));
  } else if (key == "lms_prefetch_budget_mb") {
    setPrefetchBudget(mebibytes(key, value));
  } else if (key == "lms_graph_prefetch") {
    setGraphPrefetchEnabled(parseBool(key, value));
  } else if (key == "lms_host_limit_mb") {
    setHostLimit(mebibytes(key, value));
  } else if (key == "lms_recompute") {
    setRecomputeEnabled(parseBool(key, value));
  } else if (key == "lms_pack") {
    setPackingEnabled(parseBool(key, value));
  } else if (key == "lms_host_placement") {
    setHostPlacementEnabled(parseBool(key, value));
  } else {
    return false;
  }
  return true;
}

void parseConfig(const char* conf, bool only_lms_keys, const char* source) {
  if (conf == nullptr) {
    return;
  }
  constexpr const char* kKeys =
      "lms, lms_limit_mb, lms_size_mb, lms_prefetch, lms_speculative_mb, "
      "lms_schedule, lms_lookahead, lms_prefetch_budget_mb, "
      "lms_graph_prefetch, lms_host_limit_mb, lms_recompute, lms_pack, "
      "lms_host_placement";
  // Same syntax as the caching allocator: "key:value,key:value".
  std::string_view rest(conf);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view()
                                           : rest.substr(comma + 1);
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      TORCH_CHECK(
          !only_lms_keys || item.find_first_not_of(' ') == std::string::npos,
          source,
          ": expected key:value, got '",
          std::string(item),
          "' (keys: ",
          kKeys,
          ")");
      continue;
    }
    auto trim = [](std::string_view s) {
      while (!s.empty() && s.front() == ' ') {
        s.remove_prefix(1);
      }
      while (!s.empty() && s.back() == ' ') {
        s.remove_suffix(1);
      }
      return s;
    };
    const std::string_view key = trim(item.substr(0, colon));
    const bool known = parseConfigOption(key, trim(item.substr(colon + 1)));
    TORCH_CHECK(
        known || !only_lms_keys,
        source,
        ": unknown key '",
        std::string(key),
        "'; Large Model Support keys are ",
        kKeys);
  }
}

const char* toString(StorageState state) {
  switch (state) {
    case StorageState::Unmanaged:
      return "unmanaged";
    case StorageState::Allocated:
      return "allocated";
    case StorageState::Active:
      return "active";
    case StorageState::Inactive:
      return "inactive";
    case StorageState::PagedOut:
      return "paged out";
    case StorageState::Dropped:
      return "dropped";
  }
  return "unknown";
}

namespace {

// Recomputes a dropped storage (RecomputeHooks::recompute) on the current
// stream, timing the replay there. Returns the storage's record after it: a
// new one when the storage was dropped, `r` otherwise.
Record* rematerialize(c10::StorageImpl& storage, Record* r) {
  DeviceEngine& e = *r->engine;
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy; });
    if (r->state != State::Dropped) {
      return r;
    }
  }
  const std::lock_guard<std::recursive_mutex> serial(g_recompute_mutex);
  r = recordOf(storage);
  if (r == nullptr) {
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (r->state != State::Dropped) {
      return r; // another thread recomputed it meanwhile
    }
  }
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  const size_t size = r->size;
  TORCH_CHECK(
      hooks != nullptr,
      "LMS: a storage of ",
      std::to_string(size),
      " bytes was dropped to be recomputed, but no recompute hooks are "
      "installed any more");
  const cudaStream_t stream = currentStream(e.device);
  TORCH_CHECK(
      !isCapturing(stream),
      "LMS: a storage of ",
      std::to_string(size),
      " bytes was dropped to be recomputed, and CUDA graph capture is "
      "underway on the current stream; a recompute cannot be captured. Run "
      "the captured region once before capturing so its inputs are "
      "resident, or turn recompute off (torch.cuda.set_recompute_lms(False)).");
  DeviceScope guard(e.device);
  cudaEvent_t start = e.events.get(/*timing=*/true);
  C10_CUDA_CHECK(cudaEventRecord(start, stream));
  try {
    hooks->recompute(storage);
  } catch (...) {
    e.events.put(start);
    throw;
  }
  cudaEvent_t end = e.events.get(/*timing=*/true);
  C10_CUDA_CHECK(cudaEventRecord(end, stream));
  addTiming(e, Timed::Recompute, start, end, size);
  Record* now = recordOf(storage);
  TORCH_CHECK(
      now != nullptr && now != r,
      "LMS: recomputing a dropped storage of ",
      std::to_string(size),
      " bytes did not fill it");
  return now;
}

// Recomputes the storage if it was dropped and returns its record, not busy
// and not dropped, with its engine's lock taken in `lock`; null when the
// storage holds no LMS allocation any more. A reclaim on another thread may
// drop it again before the lock is taken: then it is recomputed again.
Record* settledResident(
    c10::StorageImpl& storage,
    Record* r,
    std::unique_lock<std::mutex>& lock) {
  for (;;) {
    r = rematerialize(storage, r);
    if (r == nullptr) {
      return nullptr;
    }
    lock = std::unique_lock<std::mutex>(r->engine->mutex);
    r->engine->settled.wait(lock, [&] { return !r->busy; });
    if (r->state != State::Dropped) {
      return r;
    }
    lock.unlock();
  }
}

} // namespace

void pin(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    r = adopt(storage);
    if (r == nullptr) {
      return;
    }
  }
  std::unique_lock<std::mutex> lock;
  r = settledResident(storage, r, lock);
  if (r != nullptr) {
    makeResident(*r->engine, *r, storage, State::Active, lock);
  }
}

void pinForRecompute(c10::StorageImpl& storage) {
  ++t_recompute_pins;
  struct Leave {
    ~Leave() {
      --t_recompute_pins;
    }
  } leave_scope;
  pin(storage);
}

void unpin(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  const cudaStream_t stream = currentStream(e.device);
  const bool capturing = isCapturing(stream);
  std::lock_guard<std::mutex> lock(e.mutex);
  TORCH_CHECK(
      r->state == State::Active && r->pins > 0,
      "LMS: unpin() of a storage that is not pinned (state ",
      toString(publicState(r->state)),
      "); every unpin() must match an earlier pin()");
  addUser(*r, stream);
  // Memory a captured CUDA graph uses must stay where the graph saw it.
  r->graph_owned = r->graph_owned || capturing;
  if (--r->pins > 0) {
    return;
  }
  if (r->on_host) {
    const WorkingSet& ws = t_working_set;
    if (ws.active && r->working_set == ws.serial) {
      // An operator nested in the one that placed it is done with it; the
      // placing operator may go on using it, at this address, and releases
      // it when it ends (releaseOutput).
      leave(e, *r);
      enter(e, *r, State::Allocated);
      if (!r->fresh) {
        r->fresh = true;
        add(e.stats.operator_output_bytes, sz(*r));
      }
      return;
    }
    parkPlaced(e, *r);
    arm(storage, true);
    return;
  }
  leave(e, *r);
  if (r->graph_owned) {
    enter(e, *r, State::Allocated);
    return;
  }
  enter(e, *r, State::Inactive);
  e.reclaim_list.push_back(r);
  arm(storage, true);
}

void releaseOutput(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  const cudaStream_t stream = currentStream(e.device);
  const bool capturing = isCapturing(stream);
  std::lock_guard<std::mutex> lock(e.mutex);
  if (r->state != State::Allocated || !r->fresh || r->busy) {
    return; // pinned, reclaimable already, or accessed raw since
  }
  clearFresh(e, *r);
  addUser(*r, stream);
  if (capturing || r->graph_owned) {
    r->graph_owned = true; // a captured graph bakes in its address
    return;
  }
  rememberOwner(*r, storage);
  if (r->on_host) {
    parkPlaced(e, *r);
  } else {
    leave(e, *r);
    enter(e, *r, State::Inactive);
    e.reclaim_list.push_back(r);
  }
  arm(storage, true);
}

void access(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    arm(storage, false);
    return;
  }
  std::unique_lock<std::mutex> lock;
  r = settledResident(storage, r, lock);
  if (r == nullptr) {
    return;
  }
  if (r->state == State::Active) {
    // Pinned: resident and off the reclaim list already, but perhaps paged
    // in on another stream a moment ago.
    waitUntilResident(*r->engine, *r, currentStream(r->engine->device));
    return;
  }
  makeResident(*r->engine, *r, storage, State::Allocated, lock);
}

StorageState getState(const c10::StorageImpl& storage) {
  Record* r = recordOf(
      const_cast<c10::StorageImpl&>(storage)._mutable_data_ptr_no_checks());
  if (r == nullptr) {
    return StorageState::Unmanaged;
  }
  std::lock_guard<std::mutex> lock(r->engine->mutex);
  return publicState(r->state);
}

bool isManaged(const c10::DataPtr& data_ptr) {
  return recordOf(data_ptr) != nullptr;
}

size_t reclaimInactive(c10::DeviceIndex device) {
  return reclaim(
      engineFor(device), std::numeric_limits<size_t>::max(), Trigger::Explicit);
}

size_t reclaimBytes(c10::DeviceIndex device, size_t bytes) {
  if (!isEnabled() || g_backend.load() == nullptr || bytes == 0) {
    return 0;
  }
  return reclaim(engineFor(device), bytes, Trigger::Limit);
}

size_t ensureHeadroom(c10::DeviceIndex device, size_t incoming_bytes) {
  if (!isEnabled() || g_backend.load() == nullptr) {
    return 0;
  }
  return enforceLimit(engineFor(device), incoming_bytes);
}

void releaseCachedHostMemory() {
  hostPool().releaseCached();
}

LmsStats getStats(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  pollTimings(e, /*wait=*/false);
  LmsStats s;
  size_t paged_in_last_iteration = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    s = e.stats;
    paged_in_last_iteration = e.pagein_last_iteration;
  }
  {
    std::lock_guard<std::mutex> lock(e.timing_mutex);
    s.stall_ms = e.stall_ms;
    s.copy_out_bytes = e.copy_out_bytes;
    s.copy_out_ms = e.copy_out_ms;
    s.copy_in_bytes = e.copy_in_bytes;
    s.copy_in_ms = e.copy_in_ms;
    s.recompute_ms = e.recompute_ms;
  }
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    const AccessSchedule& schedule = theSchedule();
    s.schedule_active = schedule.active() ? 1 : 0;
    s.schedule_period = static_cast<int64_t>(schedule.period());
    s.schedule_detections = schedule.detections() - e.detections_base;
    s.schedule_fallbacks = schedule.fallbacks() - e.fallbacks_base;
  }
  const HostPool::Usage host = hostPool().usage();
  s.host_bytes.current = host.held_bytes;
  s.host_bytes.peak = host.peak_held_bytes;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    s.host_refusals = host.budget_refusals - e.host_refusals_base;
  }
  const HostPool::BudgetStatus budget = hostPool().budgetStatus();
  s.host_budget_bytes =
      budget.budget == kNoHostLimit ? 0 : static_cast<int64_t>(budget.budget);
  s.host_ledger_bytes = static_cast<int64_t>(budget.held.all);
  s.limit_bytes = g_backend.load() != nullptr ? effectiveLimit(e) : 0;
  if (s.schedule_active != 0) {
    s.schedule_prefetch_budget_bytes = static_cast<int64_t>(
        prefetchBudget(s.limit_bytes, paged_in_last_iteration));
  }
  if (DeviceMemoryBackend* b = g_backend.load()) {
    const auto pools = static_cast<int64_t>(b->privatePoolBytes(device));
    std::lock_guard<std::mutex> lock(e.mutex);
    e.stats.private_pool_bytes.current = pools;
    e.stats.private_pool_bytes.peak =
        std::max(e.stats.private_pool_bytes.peak, pools);
    s.private_pool_bytes = e.stats.private_pool_bytes;
  }
  return s;
}

void resetPeakStats(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  std::lock_guard<std::mutex> lock(e.mutex);
  for (LmsStat* stat :
       {&e.stats.managed_bytes,
        &e.stats.active_bytes,
        &e.stats.inactive_bytes,
        &e.stats.pagedout_bytes,
        &e.stats.dropped_bytes,
        &e.stats.over_limit_bytes,
        &e.stats.operator_output_bytes}) {
    stat->peak = stat->current;
  }
  hostPool().resetPeak();
}

void resetAccumulatedStats(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    // The prefetch budget's measurement of the iteration under way goes on
    // across the reset (statistics are the user's; the engine's behaviour
    // must not depend on when they are reset).
    e.iteration_pagein_base -= e.stats.pagein_bytes;
    LmsStats fresh;
    fresh.managed_bytes = e.stats.managed_bytes;
    fresh.active_bytes = e.stats.active_bytes;
    fresh.inactive_bytes = e.stats.inactive_bytes;
    fresh.pagedout_bytes = e.stats.pagedout_bytes;
    fresh.dropped_bytes = e.stats.dropped_bytes;
    fresh.over_limit_bytes = e.stats.over_limit_bytes;
    fresh.operator_output_bytes = e.stats.operator_output_bytes;
    e.stats = fresh;
    e.host_refusals_base = hostPool().usage().budget_refusals;
    std::lock_guard<std::mutex> schedule_lock(g_schedule_mutex);
    e.detections_base = theSchedule().detections();
    e.fallbacks_base = theSchedule().fallbacks();
  }
  pollTimings(e, /*wait=*/true);
  std::lock_guard<std::mutex> lock(e.timing_mutex);
  e.stall_ms = 0.0;
  e.copy_out_bytes = 0;
  e.copy_out_ms = 0.0;
  e.copy_in_bytes = 0;
  e.copy_in_ms = 0.0;
  e.recompute_ms = 0.0;
}

void setBackend(DeviceMemoryBackend* b) {
  g_backend.store(b);
}

DeviceMemoryBackend* getBackend() {
  return g_backend.load();
}

namespace {

// Pinned host memory for a request of `size` bytes that the running operator
// could not have on the device with every reclaimable storage paged out
// (setHostPlacementEnabled). Raises the out-of-memory error when the host
// budget refuses it too. The first time an operator needs it, a warning
// names the operator: it runs slower, over the bus.
HostBuffer placeOnHost(DeviceEngine& e, size_t size) {
  HostBuffer placed = hostPool().allocate(size);
  if (placed.ptr == nullptr) {
    t_host_refused = true;
    throwOutOfMemory(e, size);
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.host_placement_count;
    e.stats.host_placement_bytes += static_cast<int64_t>(size);
  }
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  std::string name(t_working_set.name);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert(name).second) {
      return placed;
    }
  }
  char request[32];
  std::snprintf(
      request,
      sizeof(request),
      "%.2f MiB",
      static_cast<double>(size) / static_cast<double>(kMiB));
  const std::string verdict = explainOutOfMemory(e.device, size).verdict;
  TORCH_WARN(
      "Large Model Support: ",
      name,
      " allocated ",
      request,
      " that the device cannot hold with every other storage paged out. ",
      verdict.empty() ? std::string() : verdict + " ",
      "LMS placed it in pinned host memory, which the operator's kernels use "
      "over the bus: the operator runs slower and computes the same numbers "
      "(a library such as cuDNN keeps the algorithm it picks with more "
      "memory). Give the operator more room (a higher memory cap or LMS "
      "limit, a smaller batch) to run it on the device, or turn host "
      "placement off (torch.cuda.set_host_placement_lms(False), "
      "lms_host_placement:False) to let libraries pick an algorithm that "
      "needs less memory, whose results can differ in the last bits.");
  return placed;
}

} // namespace

c10::DataPtr allocate(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream) {
  raisePendingError(size);
  DeviceEngine& e = engineFor(device);
  pollTimings(e, /*wait=*/false);
  if (isCapturing(stream)) {
    // Graph-private memory: the captured graph bakes in its address.
    void* ptr = backend().malloc(device, size, stream);
    return backend().makeDataPtr(ptr, device);
  }
  const bool managed = size >= g_size_threshold.load();
  WorkingSet& ws = t_working_set;
  const bool placeable =
      managed && ws.active && ws.device == device && g_host_placement.load();
  void* ptr = allocateDevice(e, size, stream, /*or_null=*/placeable);
  HostBuffer placed;
  if (ptr == nullptr) {
    placed = placeOnHost(e, size);
    ptr = placed.ptr;
  }
  if (!managed) {
    return backend().makeDataPtr(ptr, device);
  }
  auto* r = new Record();
  r->engine = &e;
  r->size = size;
  r->device_ptr = placed.ptr == nullptr ? ptr : nullptr;
  r->host = placed;
  r->on_host = placed.ptr != nullptr;
  r->stream = stream;
  r->fresh = true;
  // Born in the running operator: the schedule measures distances from here.
  r->touch.store(g_op_clock.load(std::memory_order_relaxed));
  r->gap.store(AccessSchedule::kBirth + g_births_in_op.fetch_add(1));
  if (ws.active && ws.device == device) {
    r->working_set = ws.serial;
    ws.inside += size;
    ws.inside_peak = std::max(ws.inside_peak, ws.inside);
    if (size >= kPackBlockBytes) {
      ++ws.blocks;
    }
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    add(e.stats.managed_bytes, sz(*r));
    add(e.stats.operator_output_bytes, sz(*r));
  }
  return c10::DataPtr(
      ptr, r, &deleteRecord, c10::Device(c10::DeviceType::CUDA, device));
}

void* allocateRaw(c10::DeviceIndex device, size_t size, cudaStream_t stream) {
  raisePendingError(size);
  if (isCapturing(stream)) {
    return backend().malloc(device, size, stream);
  }
  return allocateDevice(engineFor(device), size, stream);
}

void setPendingError(c10::DeviceIndex device, std::exception_ptr error) {
  if (device >= 0) {
    DeviceEngine& e = engineFor(device);
    std::lock_guard<std::mutex> lock(e.mutex);
    ++e.stats.pin_failures;
  }
  t_pending_error = std::move(error);
}

void clearPendingError() {
  t_pending_error = nullptr;
}

bool hasPendingError() {
  return t_pending_error != nullptr;
}

uint64_t outOfMemoryErrorsRaised() {
  return t_oom_raised;
}

size_t lastOutOfMemoryRequest() {
  return t_oom_request;
}

std::string lastOutOfMemoryVerdict() {
  return t_oom_verdict;
}

void beginHostUse(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  std::unique_lock<std::mutex> lock(e.mutex);
  e.settled.wait(lock, [&] { return !r->busy; });
  // Used over the bus is used: a storage an operator reads on the host every
  // iteration (an optimizer's state beside parameters that leave no room for
  // it) would otherwise look unused for ever longer, and the schedule, whose
  // iterations touch every storage in use, would never confirm a period.
  noteUse(*r);
  if (r->state == State::PagedOut && r->draining) {
    // Paged out early and its device memory still held: it needs no room,
    // so it is made resident again rather than used over the bus.
    rescueDrained(e, *r);
    rememberOwner(*r, storage);
    refreshDataPtr(storage, *r);
    DeviceScope guard(e.device);
    C10_CUDA_CHECK(
        cudaStreamWaitEvent(currentStream(e.device), r->device_ready, 0));
    return;
  }
  if (r->state != State::PagedOut || r->host_ready == nullptr) {
    return;
  }
  rememberOwner(*r, storage);
  c10::DataPtr& dp = storage._mutable_data_ptr_no_checks();
  if (dp.get() != r->host.ptr) {
    const c10::Device device = dp.device();
    void* ctx = dp.release_context();
    dp = c10::DataPtr(r->host.ptr, ctx, &deleteRecord, device);
  }
  DeviceScope guard(e.device);
  C10_CUDA_CHECK(
      cudaStreamWaitEvent(currentStream(e.device), r->host_ready, 0));
}

void endHostUse(c10::StorageImpl& storage) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  DeviceEngine& e = *r->engine;
  std::unique_lock<std::mutex> lock(e.mutex);
  e.settled.wait(lock, [&] { return !r->busy; });
  if (r->state != State::PagedOut || r->host_ready == nullptr) {
    return;
  }
  // A page-in waits for host_ready: move it past the operator's work, which
  // may have written the host copy.
  DeviceScope guard(e.device);
  C10_CUDA_CHECK(cudaEventRecord(r->host_ready, currentStream(e.device)));
}

bool reclaimForFailedAllocation(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream) {
  if (!isEnabled() || t_no_reclaim) {
    return false;
  }
  DeviceEngine& e = engineFor(device);
  const bool freed = reclaimFragments(e, size, stream) > 0 ||
      reclaim(e, size, Trigger::AllocFailure) > 0;
  t_reclaimed_in_malloc = t_reclaimed_in_malloc || freed;
  return freed;
}

void setWorkspaceReleaser(WorkspaceReleaser releaser) {
  g_workspace_releaser.store(releaser);
}

void setRecomputeHooks(const RecomputeHooks* hooks) {
  g_recompute_hooks.store(hooks);
}

void setRecomputable(c10::StorageImpl& storage, bool recomputable) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(r->engine->mutex);
  r->recomputable = recomputable;
}

void* fillDropped(c10::StorageImpl& dropped, c10::StorageImpl& fresh) {
  Record* r = recordOf(dropped);
  Record* f = recordOf(fresh);
  TORCH_CHECK(
      r != nullptr && f != nullptr && r->engine == f->engine,
      "LMS: fillDropped() needs two LMS storages of one device");
  TORCH_CHECK(
      dropped.nbytes() == fresh.nbytes() && r->size == f->size,
      "LMS: a recompute produced ",
      std::to_string(fresh.nbytes()),
      " bytes for a dropped storage of ",
      std::to_string(dropped.nbytes()),
      " bytes");
  DeviceEngine& e = *r->engine;
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy && !f->busy; });
    TORCH_CHECK(
        r->state == State::Dropped,
        "LMS: fillDropped() of a storage that is not dropped (state ",
        toString(publicState(r->state)),
        ")");
    TORCH_CHECK(
        f->state == State::Allocated && f->pins == 0,
        "LMS: a recompute's result is in use elsewhere (state ",
        toString(publicState(f->state)),
        ")");
    e.dropped_list.remove(r);
    removeUpcoming(e, *r);
    leave(e, *r);
    enter(e, *r, State::Allocated);
    clearFresh(e, *f);
    // The storage keeps its place in the learned schedule.
    f->touch.store(r->touch.load());
    f->gap.store(r->gap.load());
    r->moved = true;
    r->recomputable = false;
    ++e.stats.recompute_count;
    e.stats.recompute_bytes += sz(*r);
  }
  std::swap(
      dropped._mutable_data_ptr_no_checks(),
      fresh._mutable_data_ptr_no_checks());
  rememberOwner(*f, dropped);
  rememberOwner(*r, fresh);
  return f;
}

double copyCostMs(c10::DeviceIndex device, size_t bytes, bool to_device) {
  return copyCost(engineFor(device), bytes, to_device);
}

double pagingCostMs(c10::DeviceIndex device, size_t bytes) {
  return pagingCost(engineFor(device), bytes);
}

double copyStallShare(c10::DeviceIndex device) {
  return stallShare(engineFor(device));
}

void recordStream(const c10::DataPtr& data_ptr, cudaStream_t stream) {
  Record* r = recordOf(data_ptr);
  if (r == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(r->engine->mutex);
  addUser(*r, stream);
}

namespace {

// What the caching allocator maps for a new request of `size` bytes at least:
// requests up to 1 MiB come from 2 MiB segments, up to 10 MiB from 20 MiB
// segments, larger ones from segments rounded up to 2 MiB (its expandable
// segments map 2 and 20 MiB pages, the same or less for requests of these
// sizes).
size_t segmentBytes(size_t size) {
  constexpr size_t kSmallSegment = 2 * kMiB;
  constexpr size_t kLargeSegment = 20 * kMiB;
  if (size <= kMiB) {
    return kSmallSegment;
  }
  if (size <= 10 * kMiB) {
    return kLargeSegment;
  }
  return (size + kSmallSegment - 1) / kSmallSegment * kSmallSegment;
}

} // namespace

namespace {

OutOfMemoryText explainOutOfMemory(c10::DeviceIndex device, size_t size) {
  DeviceEngine& e = engineFor(device);
  const size_t limit = effectiveLimit(e);
  const size_t allocated = backend().allocatedBytes(device);
  LmsStats s;
  size_t reclaimable_count = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    s = e.stats;
    for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
      ++reclaimable_count;
    }
  }
  // snprintf rather than a stream: a locale-dependent stream in a process
  // that mixes C++ runtimes (the drop-in extension) must not be what turns an
  // out-of-memory error into a crash.
  auto mib = [](int64_t bytes) {
    char text[32];
    std::snprintf(
        text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / kMiB);
    return std::string(text);
  };
  if (t_host_refused &&
      HostPool::lastRefusal().cause != HostRefusal::Cause::None) {
    // The device is full and the storages that could make room cannot be
    // paged out: the host tier below it has none. Say so, rather than give
    // the device-side advice.
    return {
        "Host memory ran out: the page-outs that would have made room were "
        "refused (the host budget, or pinning failed).",
        "CUDA out of memory with Large Model Support: host memory ran "
        "out. Tried to allocate " +
            mib(static_cast<int64_t>(size)) + " on device " +
            std::to_string(int(device)) +
            ", which needs inactive storages paged out to pinned host memory. " +
            describeHostRefusal(HostPool::lastRefusal()) + " Device " +
            std::to_string(int(device)) + ": " +
            mib(static_cast<int64_t>(allocated)) + " allocated to tensors (" +
            mib(s.inactive_bytes.current) + " inactive), " +
            mib(s.pagedout_bytes.current) + " paged out to host, LMS limit " +
            mib(static_cast<int64_t>(limit)) + "."};
  }
  const size_t pools = backend().privatePoolBytes(device);
  const std::string pool_note = pools == 0
      ? std::string()
      : " " + mib(static_cast<int64_t>(pools)) +
          " is reserved by private pools (CUDA graphs, torch.cuda.MemPool), "
          "which LMS never pages out: leave room for them under the cap, or "
          "compile without mode=\"reduce-overhead\".";
  // The allocator, not the LMS limit, is what failed: its cap (a per-process
  // memory fraction) or, without one, what the device has left for this
  // process. The limit only decides when LMS pages out ahead of that.
  const size_t capacity = backend().capacityBytes(device);
  size_t room = capacity;
  if (capacity == SIZE_MAX) {
    std::lock_guard<std::mutex> lock(e.mutex);
    room = leftByOthers(e);
  }
  const std::string room_name = capacity == SIZE_MAX
      ? std::string("the device memory other processes leave (")
      : std::string("the allocator's cap (");
  const size_t reserved = backend().reservedBytes(device);
  // What the running operators need at once: what they pinned, what they
  // allocated so far, and this request. When that alone passes the room, no
  // page-out can help; say so first. When it fits by bytes, the memory the
  // allocator keeps mapped for the tensors left (pieces of segments, or pages,
  // partly used by them) is what has no room for the request.
  const int64_t working_set = s.active_bytes.current +
      s.operator_output_bytes.current + static_cast<int64_t>(size);
  std::string verdict;
  if (working_set > static_cast<int64_t>(room)) {
    verdict = "The running operator's working set does not fit: " +
        mib(s.active_bytes.current) + " pinned + " +
        mib(s.operator_output_bytes.current) + " allocated by it so far + " +
        mib(static_cast<int64_t>(size)) + " requested = " + mib(working_set) +
        " > " + room_name + mib(static_cast<int64_t>(room)) + "). ";
  } else if (reserved + segmentBytes(size) > room) {
    verdict = "The tensors fit by bytes (" +
        mib(static_cast<int64_t>(allocated)) + " allocated + " +
        mib(static_cast<int64_t>(size)) + " requested <= " + room_name +
        mib(static_cast<int64_t>(room)) + ")), but the allocator keeps " +
        mib(static_cast<int64_t>(reserved)) +
        " mapped for them (segments or pages that tensors still in use "
        "occupy in part) and has no room for the request beside it; " +
        (capacity == SIZE_MAX ? "the device memory other processes leave"
                              : "the allocator's cap") +
        " would admit it from " +
        mib(static_cast<int64_t>(reserved + segmentBytes(size))) + " (" +
        mib(static_cast<int64_t>(reserved + segmentBytes(size) - room)) +
        " more). ";
  }
  std::string message =
      "CUDA out of memory with Large Model Support. Tried to allocate " +
      mib(static_cast<int64_t>(size)) + " on device " +
      std::to_string(int(device)) +
      " after paging out every reclaimable storage. " + verdict +
      mib(static_cast<int64_t>(allocated)) +
      " is allocated to tensors: " + mib(s.active_bytes.current) +
      " pinned by the running operator(s), " +
      mib(s.operator_output_bytes.current) +
      " allocated by them and not released yet, " +
      mib(s.inactive_bytes.current) + " inactive (" +
      std::to_string(reclaimable_count) +
      " storages below the LMS size threshold of " +
      mib(static_cast<int64_t>(g_size_threshold.load())) +
      " or without pinned host memory to page to), the rest too small or "
      "not yet used by an operator; the allocator maps " +
      mib(static_cast<int64_t>(reserved)) + ". LMS pages out ahead above " +
      mib(static_cast<int64_t>(limit)) + "; " + mib(s.pagedout_bytes.current) +
      " paged out to host. The working set of one operator must fit on the "
      "device: reduce the batch size or the operator's size, or lower the "
      "size threshold with torch.cuda.set_size_lms()." +
      pool_note;
  // The verdict alone, for the warning about an operator that caught the
  // error: its sentence without the space that joins it to the rest.
  while (!verdict.empty() && verdict.back() == ' ') {
    verdict.pop_back();
  }
  return {std::move(verdict), std::move(message)};
}

} // namespace

std::string describeOutOfMemory(c10::DeviceIndex device, size_t size) {
  return explainOutOfMemory(device, size).message;
}

} // namespace c10::cuda::lms
