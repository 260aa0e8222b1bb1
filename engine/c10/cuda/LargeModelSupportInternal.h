#pragma once

// Not a public header: the Large Model Support engine's internal types (the
// record of a storage, its states and lists, the engine of a device) and what
// the engine's source files share, in namespace detail. Only the engine's own
// sources include it, and it is not installed; the API is
// LargeModelSupport.h.
//
// The engine, one concern a file:
//   LargeModelSupport.cpp               the engine of each device, enabling
//                                       LMS, the entry points of a storage's
//                                       life (allocate, pin, unpin, access)
//   LargeModelSupportRecords.cpp        record states, adopt, delete
//   LargeModelSupportTiming.cpp         copy and stall timing, paging costs
//   LargeModelSupportLimit.cpp          this process's device share, the
//                                       limit, the allocation path's triggers
//   LargeModelSupportReclaim.cpp        victims, page-out, fragments, the
//                                       draining of early page-outs
//   LargeModelSupportPageIn.cpp         page-in on demand and ahead of use
//   LargeModelSupportSchedule.cpp       the learned schedule and its policy
//   LargeModelSupportPacking.cpp        operator working sets, packing
//   LargeModelSupportRecompute.cpp      drop and recompute
//   LargeModelSupportHostPlacement.cpp  placement in host memory, host use
//   LargeModelSupportOptions.cpp        settings, PYTORCH_CUDA_ALLOC_CONF keys
//   LargeModelSupportStats.cpp          statistics
//   LargeModelSupportOutOfMemory.cpp    the out-of-memory explanation
//   LargeModelSupportHostPool.cpp       pinned host memory and its budget
//   LargeModelSupportSpill.cpp          the disk tier below the host pool
//   LargeModelSupportSettingTable.h     the settings, a row each (public)
//   LargeModelSupportStatTable.h        the statistics, a row each (public)
//
// Each piece of global state (settings, the engines, thread-local state) has
// one definition, in the file of the concern that owns it, and is declared
// extern below. None of their initializers reads another's, so the order in
// which the files are initialized does not matter.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/cuda/LargeModelSupportHostPool.h>
#include <c10/cuda/LargeModelSupportSchedule.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace c10::cuda::lms::detail {

constexpr size_t kMiB = 1024 * 1024;

// Blocks an operator allocates inside itself at this size or more are
// counted for the room packing leaves it beyond what it is expected to need
// (kPackSpareBytes, LargeModelSupportPacking.cpp): smaller ones come from the
// allocator's small pool, whose pages are 2 MiB.
constexpr size_t kPackBlockBytes = kMiB;

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
  // Recomputed ahead of use (recomputeAhead) and not used since: counted in
  // the engine's prefetched_bytes, as a page-in ahead of use is.
  bool replayed_ahead = false;
  bool graph_owned = false; // used during CUDA graph capture: never paged
  // In pinned host memory (`host`) for the operator(s) using it, because the
  // device could not hold it (setHostPlacementEnabled): allocated there by an
  // operator (placeOnHost), or an input kept in its host copy (Active,
  // keepInputOnHost); device_ptr stays null. Paged out once no operator uses
  // it (parkPlaced).
  bool on_host = false;
  // Has a recipe (setRecomputable): the recompute hooks know this context.
  bool recomputable = false;
  // Set by a page-out that dropped the storage instead of copying it, for
  // markPagedOut to file it as dropped.
  bool dropped = false;
  // Its memory went to another storage (fillDropped): its death is not the
  // death of a storage the learned schedule knows.
  bool moved = false;
  // Device milliseconds its replay cost when last priced (RecomputeHooks::
  // cost_ms; -1: never priced, or no longer recomputable): which candidates
  // a reclaim prices again first (cheapDrops).
  double replay_ms = -1.0;
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
  // Paged out to the disk tier (LargeModelSupportSpill.cpp): the file that
  // holds the contents (empty: none). `host` is empty and the storage's
  // DataPtr null meanwhile.
  std::string spill_path;
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

inline void add(LmsStat& stat, int64_t delta) {
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
  // The most bytes allocated after an allocation since the last operator
  // boundary (noteAllocatedHigh): what an operator allocates and frees
  // inside itself counts in the demand, which the boundary alone misses.
  std::atomic<size_t> allocated_high{0};
  // Schedule and host pool statistics at the last resetAccumulatedStats().
  int64_t detections_base = 0;
  int64_t fallbacks_base = 0;
  int64_t host_refusals_base = 0;
  int64_t host_pins_base = 0;
  double host_pin_ms_base = 0;
  int64_t host_waits_base = 0;
  double host_wait_ms_base = 0;
  int64_t host_copy_waits_base = 0;
  double host_copy_wait_ms_base = 0;
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
  // The ledger of the GPU's LMS processes (DeviceLedger; opened at the first
  // sample) and what it said at the last one: this process's part of what
  // the device leaves for LMS (deviceShares; SIZE_MAX while no other LMS
  // process uses the GPU), the other live processes, and this process's
  // ticket. `need_peak` is the most this process needed (allocated plus paged
  // out) since `need_peak_at`, what it publishes as its need.
  std::once_flag ledger_once;
  std::unique_ptr<DeviceLedger> ledger;
  size_t device_lms_share = SIZE_MAX;
  std::vector<DeviceLedger::Peer> device_peers;
  uint64_t device_ticket = 0;
  size_t need_peak = 0;
  std::chrono::steady_clock::time_point need_peak_at;
  // When the last device wait was announced (at most one a minute).
  std::chrono::steady_clock::time_point device_wait_warned;
  std::chrono::steady_clock::time_point cache_released;
  LmsStats stats;
  cudaStream_t copy_stream = nullptr; // device to host (and demand prefetch)
  cudaStream_t h2d_stream = nullptr; // host to device, ahead of use
  EventPool events;
  std::mutex timing_mutex;
  std::deque<PendingTiming> timings;
  // When a busy path last polled them (pollTimingsSometimes).
  std::chrono::steady_clock::time_point timings_polled;
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

using StorageRef = c10::intrusive_ptr<c10::StorageImpl>;

// An out-of-memory error's message, and its verdict: why no room could be
// made (describeOutOfMemory, lastOutOfMemoryVerdict).
struct OutOfMemoryText {
  std::string verdict;
  std::string message;
};

inline int64_t sz(const Record& r) {
  return static_cast<int64_t>(r.size);
}

// ---------------------------------------------------------------------------
// What the engine's files share, by the file that defines it (each
// definition carries its comment)
// ---------------------------------------------------------------------------

// LargeModelSupport.cpp: the engine of each device, the backend, helpers
extern std::atomic<DeviceMemoryBackend*> g_backend;
extern std::mutex g_engines_mutex;
extern std::vector<DeviceEngine*> g_engines;
DeviceEngine& engineFor(c10::DeviceIndex device);
DeviceMemoryBackend& backend();
bool isCapturing(cudaStream_t stream);
bool isFlagSet(const char* name);
cudaStream_t currentStream(c10::DeviceIndex device);

// LargeModelSupportRecords.cpp: record states, adopt, delete
Record* recordOf(const c10::DataPtr& dp);
Record* recordOf(c10::StorageImpl& storage);
void addUser(Record& r, cudaStream_t stream);
void arm(c10::StorageImpl& storage, bool armed);
void refreshDataPtr(c10::StorageImpl& storage, Record& r);
void clearFresh(DeviceEngine& e, Record& r);
StorageState publicState(State state);
void leave(DeviceEngine& e, Record& r);
void enter(DeviceEngine& e, Record& r, State state);
void rememberOwner(Record& r, c10::StorageImpl& storage);
void deleteRecord(void* ctx);
Record* adopt(c10::StorageImpl& storage);

// LargeModelSupportTiming.cpp: copy and stall timing, paging costs
void pollTimings(DeviceEngine& e, bool wait);
void pollTimingsSometimes(DeviceEngine& e);
void addTiming(
    DeviceEngine& e,
    Timed what,
    cudaEvent_t start,
    cudaEvent_t end,
    size_t bytes = 0);
void addStall(DeviceEngine& e, cudaEvent_t start, cudaEvent_t end);
double stallShare(DeviceEngine& e);
double pagingCost(DeviceEngine& e, size_t bytes);

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

// LargeModelSupportLimit.cpp: device share, limit, allocation path
size_t leftByOthers(const DeviceEngine& e);
size_t shareOf(const DeviceEngine& e);
size_t limitOf(DeviceEngine& e);
size_t effectiveLimit(DeviceEngine& e);
void* allocateDevice(
    DeviceEngine& e,
    size_t size,
    cudaStream_t stream,
    bool or_null = false);
// What the releaser of memory outside LMS (setOutsideMemoryReleaser) said
// about the memory it did not give back for this thread's failing
// allocation, for its error message; empty when it was not asked.
extern thread_local std::string t_outside_note;

// LargeModelSupportReclaim.cpp: victims, page-out, draining
void releaseDeviceMemory(DeviceEngine& e, Record& r, bool in_deleter);
extern thread_local bool t_host_refused;
size_t reclaim(DeviceEngine& e, size_t bytes, Trigger trigger);
std::unordered_map<uintptr_t, Record*> residentReclaimable(DeviceEngine& e);
// A storage dropped, not copied, counts this share of its bytes in the cost
// of a run placeAhead vacates: its replay is priced below its paging.
constexpr size_t kDropCostShare = 8;
size_t reclaimFragments(
    DeviceEngine& e,
    size_t size,
    cudaStream_t stream,
    std::optional<size_t> max_cost = std::nullopt);
size_t drainPageOuts(DeviceEngine& e, size_t bytes);
void rescueDrained(DeviceEngine& e, Record& r);
int64_t pageOutVictims(
    DeviceEngine& e,
    size_t wanted,
    c10::function_ref<Record*()> pick,
    size_t& bytes);
int64_t pageOutEarlyFor(
    DeviceEngine& e,
    size_t allocated,
    size_t limit,
    size_t room,
    c10::function_ref<Record*()> pick);
size_t earlyPageOutNeed(
    DeviceEngine& e,
    size_t allocated,
    size_t limit,
    size_t room);

// LargeModelSupportPageIn.cpp: page-in on demand and ahead of use
extern thread_local bool t_no_reclaim;
void waitUntilResident(DeviceEngine& e, Record& r, cudaStream_t stream);
void clearPrefetched(DeviceEngine& e, Record& r);
bool makeResident(
    DeviceEngine& e,
    Record& r,
    c10::StorageImpl& storage,
    State target,
    std::unique_lock<std::mutex>& lock);
void prefetchUpcoming(
    DeviceEngine& e,
    uint64_t now,
    uint64_t window,
    size_t budget);

// LargeModelSupportSchedule.cpp: the learned schedule's policy
extern std::mutex g_schedule_mutex;
AccessSchedule& theSchedule();
extern std::atomic<uint64_t> g_op_clock;
extern std::atomic<uint64_t> g_births_in_op;
void noteUse(Record& r);
size_t prefetchBudget(size_t limit, size_t paged_in_per_iteration);
void removeUpcoming(DeviceEngine& e, Record& r);
void addUpcoming(DeviceEngine& e, Record& r);
Record* pickVictim(
    DeviceEngine& e,
    size_t threshold,
    uint64_t protect_until,
    double cheap_ms_per_byte = -1.0);

// LargeModelSupportPacking.cpp: operator working sets
extern thread_local WorkingSet t_working_set;

// LargeModelSupportRecompute.cpp: drop and recompute
extern std::atomic<const RecomputeHooks*> g_recompute_hooks;
extern thread_local int t_recompute_pins;
extern thread_local int t_replays;
bool dropInstead(DeviceEngine& e, Record& r, StorageRef& keep_alive);
// A storage a reclaim may drop before it pages anything out: its record,
// the storage (kept alive while the reclaim runs) and its rank (the bytes
// its drop frees per millisecond of replay, times its distance to its next
// use).
struct DropCandidate {
  Record* r = nullptr;
  StorageRef storage;
  double score = 0.0;
};
// Candidates one call prices (cheapDrops): pricing asks the recipes (a
// lookup, and an event query and a state per input), so a call asks again
// only about those that ranked best by their last price, not about every
// inactive storage. A reclaim that needs more calls again.
constexpr size_t kPricedCandidates = 16;
std::vector<DropCandidate> cheapDrops(
    DeviceEngine& e,
    size_t threshold,
    uint64_t protect_until = 0,
    size_t count = kPricedCandidates);
Record* settledResident(
    c10::StorageImpl& storage,
    Record* r,
    std::unique_lock<std::mutex>& lock);
// Recompute ahead of use (recomputeAhead): at most this many replays at one
// operator boundary (a chain's replays each count), and dropped inputs at
// most this deep below the storage recomputed ahead. A longer chain is left
// to the recompute on demand.
constexpr int kAheadReplaysPerBoundary = 4;
constexpr int kAheadDepth = 2;
enum class Ahead { Replayed, NotYet, Never };
Ahead recomputeAhead(
    DeviceEngine& e,
    c10::StorageImpl& storage,
    uint64_t next,
    uint64_t horizon,
    size_t budget,
    int& replays_left);

// LargeModelSupportHostPlacement.cpp: placement in host memory, host use
void warnPlacedOnHost(DeviceEngine& e, size_t size, bool input);
HostBuffer placeOnHost(DeviceEngine& e, size_t size);
void keepInputOnHost(DeviceEngine& e, Record& r);
cudaEvent_t hostUseDone(DeviceEngine& e, Record& r, bool in_deleter);
void parkPlaced(DeviceEngine& e, Record& r);

// LargeModelSupportOptions.cpp: settings
extern std::atomic<size_t> g_size_threshold;
extern std::atomic<int> g_prefetch_depth;
extern std::atomic<size_t> g_speculative_margin;
extern std::atomic<size_t> g_conf_limit;
extern std::atomic<bool> g_schedule_enabled;
extern std::atomic<int> g_lookahead_ops;
extern std::atomic<size_t> g_prefetch_budget;
extern std::atomic<bool> g_graph_prefetch;
extern std::atomic<bool> g_recompute;
// Set once an allocation of any device wants more than half its limit, or a
// reclaim runs (isRecordingRecipes, noteNearLimit).
extern std::atomic<bool> g_near_limit;
inline void noteNearLimit() {
  if (!g_near_limit.load(std::memory_order_relaxed)) {
    g_near_limit.store(true, std::memory_order_relaxed);
  }
}
extern std::atomic<bool> g_packing;
extern std::atomic<bool> g_host_placement;

// LargeModelSupportSpill.cpp: the disk tier
bool spillEnabled();
HostBuffer allocateHost(DeviceEngine& e, size_t size, bool wait);
bool pageOutToDisk(DeviceEngine& e, Record& r, cudaStream_t copy);
void readSpilled(DeviceEngine& e, Record& r, void* ptr, cudaStream_t stream);
void restoreHostCopy(DeviceEngine& e, Record& r);
void removeSpilled(DeviceEngine& e, Record& r);
std::string spillNote(const LmsStats& stats);

// LargeModelSupportOutOfMemory.cpp: the out-of-memory explanation
void raisePendingError(size_t size);
[[noreturn]] void throwOutOfMemory(
    DeviceEngine& e,
    size_t size,
    bool placement_refused = false);
OutOfMemoryText explainOutOfMemory(
    c10::DeviceIndex device,
    size_t size,
    bool placement_refused = false);

} // namespace c10::cuda::lms::detail
