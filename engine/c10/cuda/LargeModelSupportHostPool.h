#pragma once

// Pinned host memory for Large Model Support page-outs.
//
// Pinning costs milliseconds a buffer plus the time to fault in and lock every
// page, and freeing synchronizes with the device, so buffers are cached and
// reused. A released buffer may still be the source or target of an
// asynchronous copy: it carries an event and is handed out again only once
// that event has completed, without the host ever blocking on it.
//
// Host memory is a tier with a budget. Pinned memory cannot be swapped or
// reclaimed by the kernel: when the LMS processes of a host pin more than it
// has, the kernel's OOM killer ends one of them (SIGKILL, nothing logged).
// So before every new pinned buffer the pool checks that the pinned bytes of
// all LMS processes of the host, plus the request, stay within the host
// budget (HostBudget); if not, it frees its own idle cached buffers and, if
// that is not enough, refuses, and the allocation that needed the room raises
// c10::OutOfMemoryError naming host memory. The LMS processes of a host know
// each other's pinned bytes through a ledger in shared memory (HostLedger),
// updated whenever a buffer is pinned or freed (never on buffer reuse).
//
// Waiting for the others (setHostWait, lms_host_wait_s). Before it refuses,
// a process whose request fits the budget once other LMS processes of the
// host release their pinned bytes waits for them, up to the setting, polling
// the ledger every kHostWaitPoll (neither lock held while it sleeps, so its
// own threads go on releasing). Its slot says how much it waits for; every
// other process then frees its idle cached buffers at its next pool
// operation (allocate, release), so a process past its peak gives back what
// it no longer uses instead of holding its peak to the end. The wait ends
// when the budget has room, when no other process holds pinned bytes, at
// the setting (the refusal's error then says how long it waited), or by the
// rule below.
//
// When every LMS process of the host that holds pinned bytes is waiting, none
// of them will release anything: they would all wait out the setting and all
// fail. Then the one that joined the ledger last (the highest ticket) stops
// waiting at once and raises the refusal's error; the others keep waiting.
// Only raising frees pinned memory that is in use: a training script that
// does not catch the error ends, its memory goes to the others, and they go
// on; one that catches it (a smaller batch) drops the step's storages. Of the
// waiting processes the last to join has done the least work, so its loss
// costs least, and the older ones, closest to finishing and to releasing
// everything, go on; a process started again joins the queue behind them. The
// set thus finishes oldest first, as many as the budget can hold, instead of
// none. The tickets never change, so the choice never flips between processes
// (no livelock), and each such round ends one wait (no deadlock). Letting
// one go on past the budget was rejected: that is what the OOM killer ends.

#include <c10/core/Device.h>
#include <c10/cuda/CUDAMacros.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace c10::cuda::lms {

struct HostBuffer {
  void* ptr = nullptr;
  size_t capacity = 0; // bytes actually allocated (rounded up)
};

// ---------------------------------------------------------------------------
// What the host can give
// ---------------------------------------------------------------------------

constexpr size_t kNoHostLimit = SIZE_MAX;
// How long a refused allocation waits for the host's other LMS processes by
// default (setHostWait): a training step of theirs, with room to spare.
constexpr double kDefaultHostWaitSeconds = 60.0;
// How often a waiting process reads the ledger again.
constexpr std::chrono::milliseconds kHostWaitPoll{20};
// Waits start often where processes take turns at every training step: one
// warning, then at most one a minute.
constexpr std::chrono::seconds kHostWaitWarnInterval{60};

// One reading of the host's memory and of the memory limit of this process's
// cgroup. The readers take paths so that tests can point them at fixtures.
struct HostMemory {
  size_t total = 0; // MemTotal; 0 when /proc/meminfo could not be read
  size_t available = 0; // MemAvailable
  // The tightest memory limit of the process's cgroup and its ancestors
  // (cgroup v2 memory.max, v1 memory.limit_in_bytes; kNoHostLimit: none),
  // and the room it leaves: the limit less the usage (memory.current,
  // memory.usage_in_bytes) less the inactive file pages of memory.stat,
  // which the kernel reclaims before it kills anything (as kubelet and
  // docker count a container's working set).
  size_t cgroup_limit = kNoHostLimit;
  size_t cgroup_room = kNoHostLimit;
  std::string cgroup_path; // the limiting cgroup, as /proc/self/cgroup names it
  // The process's cgroup (the inode of its folder; 0: unknown): LMS processes
  // of one cgroup count against the same limit.
  uint64_t cgroup_id = 0;
};

// Reads MemTotal and MemAvailable from a /proc/meminfo file. Returns false
// (and leaves `out` alone) when the file or either field is missing.
C10_CUDA_API bool readMemInfo(const std::string& path, HostMemory& out);

// Reads the memory limit that binds this process from its cgroup: the
// controller file `proc_cgroup` (/proc/self/cgroup) names the cgroup, whose
// files are under `cgroup_mount` (/sys/fs/cgroup; the memory controller's
// hierarchy under `cgroup_mount`/memory for cgroup v1). Every level from the
// process's cgroup up to the mount is read; the one that leaves the least
// room binds. Fields stay as they are when nothing limits.
C10_CUDA_API void readCgroup(
    const std::string& proc_cgroup,
    const std::string& cgroup_mount,
    HostMemory& out);

// The memory LMS leaves to everything else of a host (or cgroup) of `total`
// bytes: 5% of it, at least 2 GiB (an eighth of hosts under 16 GiB). The
// budget is read at most every 100 ms, and what other programs, this
// process's own pageable allocations and data-loader workers take between two
// readings is invisible until the next one; the kernel needs some memory free
// for itself and for the page cache the system runs from. The OOM killer acts
// when that is gone.
C10_CUDA_API size_t hostReserve(size_t total);

// ---------------------------------------------------------------------------
// The ledger of the pinned bytes of a host's LMS processes
// ---------------------------------------------------------------------------

// Layout of the ledger file, shared by every LMS process of the host (any
// version of LMS that writes it must keep it, or change kHostLedgerVersion).
// Version 2 added the waits (HostLedgerHeader::waiting, next_ticket;
// HostLedgerSlot::waiting, ticket). A file of another layout that no live
// process has a slot in is laid out again; one in use makes the process count
// its own bytes alone (with a warning).
constexpr uint32_t kHostLedgerVersion = 2;
constexpr uint32_t kHostLedgerSlots = 511; // a 24 KiB file

struct HostLedgerHeader {
  char magic[8]; // "LMSHOST\0"
  uint32_t version;
  uint32_t slot_count;
  // Slots whose process is waiting (waiting != 0): read without the lock at
  // every pool operation, to learn cheaply whether anyone waits.
  uint64_t waiting;
  uint64_t next_ticket; // the ticket of the next slot claimed
};

// One process. A live process holds a write lock (fcntl) on the first byte
// of its slot; the kernel drops it when the process ends, however it ends, so
// a slot whose byte no process locks is free (its bytes no longer pinned).
// That holds across pid namespaces and pid reuse, where a pid does not name
// one process.
struct HostLedgerSlot {
  int64_t pid; // in the writer's pid namespace; 0: free
  uint64_t cgroup; // HostMemory::cgroup_id of the process
  int64_t bytes; // pinned host memory the process holds
  int64_t waiting; // bytes it waits for room for (0: not waiting)
  uint64_t ticket; // when it joined: higher is later (see the header)
  uint64_t reserved;
};

class C10_CUDA_API HostLedger {
 public:
  // Pinned bytes of the host's LMS processes.
  struct Totals {
    size_t all = 0;
    size_t own = 0; // of this process
    size_t cgroup = 0; // of the processes in this process's cgroup
  };

  // Opens (and creates, mode 0600) the ledger file at `path`. When it cannot
  // be used (a read-only or missing /dev/shm, a file of another layout, all
  // slots taken), the ledger counts this process's bytes alone and says so
  // once with a warning. One object per file and process: closing another
  // descriptor of the file would drop this process's locks on it.
  HostLedger(std::string path, uint64_t cgroup_id);
  ~HostLedger();
  HostLedger(const HostLedger&) = delete;
  HostLedger& operator=(const HostLedger&) = delete;

  // The ledger of the host: $PYTORCH_LMS_HOST_LEDGER, else a file of this
  // user's in /dev/shm.
  static std::string defaultPath();

  // Holds the ledger's lock (this process's threads and the other processes)
  // for a scope. Totals and changes go through it.
  class C10_CUDA_API Locked {
   public:
    explicit Locked(HostLedger& ledger);
    ~Locked();
    Locked(const Locked&) = delete;
    Locked& operator=(const Locked&) = delete;

    // Frees the slots of processes that have ended, then adds up the rest;
    // `others` (may be null) gets the live slots of the other processes.
    Totals totals(std::vector<HostLedgerSlot>* others = nullptr);
    // Adds `delta` (negative: freed) to this process's pinned bytes.
    void add(int64_t delta);
    // Says in this process's slot that it waits for room for `bytes` (0: no
    // longer waits). Claims a slot if it has none; false when it cannot (the
    // ledger is not shared).
    bool setWaiting(size_t bytes);
    // This process's ticket (0: no slot).
    uint64_t ticket() const;

   private:
    HostLedger& ledger_;
    std::unique_lock<std::mutex> lock_;
  };

  bool shared() const {
    return map_ != nullptr;
  }
  // Whether another process waits for room (HostLedgerSlot::waiting): one
  // read of shared memory, without the ledger's lock.
  bool othersWaiting();
  const std::string& path() const {
    return path_;
  }

 private:
  bool open();
  void fallBack(const std::string& why);
  bool lockByte(size_t offset, bool wait);
  void unlockByte(size_t offset);
  bool claimSlot();
  bool hasLayout(size_t size);
  HostLedgerHeader* header();
  HostLedgerSlot* slots();

  const std::string path_;
  const uint64_t cgroup_id_;
  std::mutex mutex_;
  int fd_ = -1;
  void* map_ = nullptr;
  int64_t owner_pid_ = 0; // the process that holds slot_ (fork: not a child)
  int slot_ = -1;
  int64_t own_bytes_ = 0;
  bool own_waiting_ = false;
};

// ---------------------------------------------------------------------------
// The ledger of the device memory of a GPU's LMS processes
// ---------------------------------------------------------------------------

// The LMS processes of one GPU share a second ledger, of device memory, the
// same kind of file as the host's (a slot per process, its first byte locked
// while the process lives, so the slot of a process that ended is freed by
// whoever reads the ledger next). Its name carries the GPU's UUID, not a
// device index: processes with different CUDA_VISIBLE_DEVICES name one GPU
// by different indices. Each process publishes what its allocator reserves
// on the device (held), what it would take with no limit (need: allocated
// plus paged-out bytes, the most of the last few seconds), and, while an
// allocation of it waits for the others, how much it waits for.
//
// Shares (deviceShares): what the device leaves for LMS (less a headroom,
// less what holders other than LMS processes take) is split max-min fair:
// every live process gets an equal part, a process that needs less than its
// part gets its need, and what it leaves is split again among the others;
// when every need is met, what is left over is split equally among all (a
// part capped at a need measured before the next allocation would make every
// allocation past it page out, with the device free beside it).
// Equal rather than need-proportional parts: need grows with the model, so a
// process's part would grow the more memory it asks for, and the largest
// would starve the smallest (what first come, first served did); equal parts
// capped by need give each the same paging pressure, waste nothing on a
// process that needs little, and a process alone gets the whole device as
// before. The oldest waiting process (lowest ticket) goes first: it gets
// what it holds plus what it waits for, the others share the rest, so the
// others page down to their smaller parts at their next allocation and the
// one that waits goes on. Shares follow the ledger: a process that joins or
// ends changes every other's part at its next reading (every 10 ms at most),
// and a process over its new part pages down to it at its next allocation.
constexpr uint32_t kDeviceLedgerVersion = 1;
constexpr uint32_t kDeviceLedgerSlots = 255; // a 12 KiB file

struct DeviceLedgerHeader {
  char magic[8]; // "LMSDEVI\0"
  uint32_t version;
  uint32_t slot_count;
  uint64_t waiting; // slots whose process waits (read without the lock)
  uint64_t next_ticket;
};

struct DeviceLedgerSlot {
  int64_t pid; // in the writer's pid namespace; 0: free
  int64_t held; // bytes its caching allocator reserves on the device
  int64_t need; // bytes it would take with no limit (0: not known yet)
  int64_t waiting; // bytes an allocation of it waits for (0: none)
  uint64_t ticket; // when it joined: higher is later
  uint64_t reserved;
};

// One process's claim on the device, for deviceShares.
struct DeviceClaim {
  size_t held = 0;
  size_t need = 0; // 0: not known, counts as the whole pool
  size_t waiting = 0; // 0: not waiting
  uint64_t ticket = 0;
};

// The part of `pool` bytes of each claim, in the order of `claims` (see
// above): the oldest waiting claim first (what it holds plus what it waits
// for, at most the pool), then max-min fair parts of the rest, capped by
// need, plus an equal part of what is left when every need is met. The parts
// add up to at most the pool.
C10_CUDA_API std::vector<size_t> deviceShares(
    size_t pool,
    const std::vector<DeviceClaim>& claims);

class DeviceLedger;

// What a device allocation that failed with nothing of its own left to page
// out does about the other LMS processes of the GPU (the Peer list of
// DeviceLedger::update), needing `size` bytes with `free_now` free.
enum class DeviceWaitDecision : uint8_t {
  Wait, // others hold what would make room, and one of them goes on
  NothingToWaitFor, // no other holds device memory, or all of it is too little
  GiveWay, // every holder waits too, and this process joined last
};

class C10_CUDA_API DeviceLedger {
 public:
  // The other live processes of the GPU, as the ledger says.
  struct Peer {
    int64_t pid = 0;
    DeviceClaim claim;
  };

  // Opens (and creates, mode 0600) the ledger file at `path`. When it cannot
  // be used, the process sees no other LMS process of the GPU (shares are
  // first come, first served, as without a ledger) and says so once.
  explicit DeviceLedger(std::string path);
  ~DeviceLedger();
  DeviceLedger(const DeviceLedger&) = delete;
  DeviceLedger& operator=(const DeviceLedger&) = delete;

  // The ledger of the GPU whose UUID (or other stable name) is `key`:
  // $PYTORCH_LMS_DEVICE_LEDGER followed by "-" and the key when that is set,
  // else a file of this user's in /dev/shm.
  static std::string pathFor(const std::string& key);
  // The ledger of the GPU of `device`: pathFor its UUID ("GPU-<hex>"), the
  // same for every process whatever its CUDA_VISIBLE_DEVICES.
  static std::string pathForDevice(c10::DeviceIndex device);

  // Publishes this process's held and need (claiming its slot the first
  // time), frees the slots of processes that have ended, and returns the
  // other live processes; `own` gets this process's claim.
  std::vector<Peer> update(size_t held, size_t need, DeviceClaim* own);
  // Says that an allocation of this process waits for `bytes` (0: no
  // longer). False when the ledger is not shared.
  bool setWaiting(size_t bytes);
  // Whether another process waits: one read of shared memory.
  bool othersWaiting();

  // The rule of a failed allocation's wait (see DeviceWaitDecision):
  // `ticket` is this process's.
  static DeviceWaitDecision decide(
      size_t size,
      size_t free_now,
      uint64_t ticket,
      const std::vector<Peer>& peers);
  bool shared() const {
    return map_ != nullptr;
  }
  const std::string& path() const {
    return path_;
  }

 private:
  bool open();
  void fallBack(const std::string& why);
  bool claimSlot();
  DeviceLedgerHeader* header();
  DeviceLedgerSlot* slots();

  const std::string path_;
  std::mutex mutex_;
  int fd_ = -1;
  void* map_ = nullptr;
  int64_t owner_pid_ = 0;
  int slot_ = -1;
  bool own_waiting_ = false;
};

// ---------------------------------------------------------------------------
// The budget
// ---------------------------------------------------------------------------

// The budget for the pinned bytes of all LMS processes of the host together.
// Derived from a reading of HostMemory and the ledger's totals at that
// moment: MemAvailable no longer counts what LMS processes have pinned, so
// what they may pin in all is MemAvailable plus their pinned bytes, less the
// reserve; likewise within the cgroup limit (its room plus the pinned bytes
// of the LMS processes of the cgroup, less a reserve of the limit). Between
// readings the ledger moves whenever an LMS process pins or frees a buffer,
// so what they pin meanwhile is counted exactly.
struct C10_CUDA_API HostBudget {
  using Totals = HostLedger::Totals;

  enum class Source : uint8_t {
    None, // no reading (no /proc/meminfo) and no setting: no check
    Setting, // setHostLimit() or lms_host_limit_mb
    MemAvailable,
    Cgroup,
  };

  size_t setting = 0; // set explicitly (0: derived); replaces the rest
  HostMemory memory; // the reading
  Totals held; // the ledger at the reading
  size_t host_reserve = 0;
  size_t cgroup_reserve = 0;
  // What the reading allows all LMS processes to pin, each less its reserve
  // (kNoHostLimit: no bound of that kind).
  size_t host_bytes = kNoHostLimit;
  size_t cgroup_bytes = kNoHostLimit;

  // The budget in force for the ledger's totals `now` (kNoHostLimit: none),
  // and its source. The cgroup bound counts the pinned bytes of processes
  // outside the cgroup as they are now: they take no room under its limit.
  size_t inForce(const Totals& now, Source* source = nullptr) const;
};

// The budget derived from `memory` and the ledger's totals at that reading.
C10_CUDA_API HostBudget
deriveHostBudget(const HostMemory& memory, const HostLedger::Totals& held);

// Why the pool gave no buffer, for the out-of-memory message.
struct HostRefusal {
  enum class Cause : uint8_t {
    None,
    Budget, // the host budget had no room
    Allocation, // pinning failed (cudaHostAlloc, cudaHostRegister)
  };
  Cause cause = Cause::None;
  size_t bytes = 0; // the buffer that was asked for
  HostLedger::Totals held; // the ledger then
  size_t budget = 0; // the budget in force then
  HostBudget::Source source = HostBudget::Source::None;
  HostBudget reading;
  std::string ledger_path; // empty: this process's accounting alone
  // How a wait for other LMS processes to release pinned memory ended
  // before the refusal (see the top of the file).
  enum class Wait : uint8_t {
    None, // no wait: the setting is 0, or nothing the others hold would do
    TimedOut, // waited the whole setting
    Yielded, // every holder waited; this process, the last to join, gave up
  };
  Wait wait = Wait::None;
  double waited_s = 0; // seconds waited
};

// The sentence an out-of-memory error carries for a refusal: what was
// needed, what the LMS processes of the host hold, the budget and where it
// comes from, and what to change.
C10_CUDA_API std::string describeHostRefusal(const HostRefusal& refusal);

// ---------------------------------------------------------------------------
// The pool
// ---------------------------------------------------------------------------

class C10_CUDA_API HostPool {
 public:
  // Called with an event the pool no longer needs, and its device.
  using EventRecycler = std::function<void(cudaEvent_t, c10::DeviceIndex)>;

  struct Usage {
    int64_t held_bytes = 0; // allocated from CUDA, in use or cached
    int64_t peak_held_bytes = 0;
    int64_t in_use_bytes = 0;
    int64_t alloc_failures = 0;
    int64_t budget_refusals = 0; // allocations the host budget refused
    int64_t pins = 0; // new pinned buffers
    double pin_ms = 0; // time spent pinning them
    int64_t waits = 0; // waits for other processes to release (setHostWait)
    double wait_ms = 0; // time spent in them
    // Waits for this pool's buffers whose copies were still running, when
    // the budget had no room for a new one (awaitCopy), and their time.
    int64_t copy_waits = 0;
    double copy_wait_ms = 0;
  };

  // The budget in force and the ledger's totals now.
  struct BudgetStatus {
    size_t budget = 0; // kNoHostLimit: none
    HostBudget::Source source = HostBudget::Source::None;
    HostLedger::Totals held;
  };

  explicit HostPool(EventRecycler recycle);
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A buffer of at least `size` bytes, or {nullptr, 0} when pinned memory is
  // exhausted (the host budget, or pinning itself) even after freeing every
  // idle cached buffer; lastRefusal() then says why. A refusal by the budget
  // first waits for this pool's cached buffers whose copies are still
  // running (awaitCopy): they come back within a copy's time. Without
  // `wait`, it does not wait for other processes (setWait) after that: the
  // disk tier makes room instead (LargeModelSupportSpill.cpp).
  HostBuffer allocate(size_t size, bool wait = true);
  // Returns a buffer. `ready` (may be null) is an event after which no copy
  // touches the buffer any more; the pool takes ownership of it.
  void release(HostBuffer buffer, cudaEvent_t ready, c10::DeviceIndex device);
  // Frees every cached buffer whose copies have completed.
  void releaseCached();
  Usage usage();
  void resetPeak();

  // Budget for the pinned bytes of all LMS processes of the host, in bytes;
  // 0 (the default) derives it (HostBudget).
  void setLimit(size_t bytes);
  size_t getLimit() const;
  BudgetStatus budgetStatus();

  // How long an allocation the budget refuses waits for other LMS processes
  // of the host to release pinned memory, in seconds (0: it does not wait).
  void setWait(double seconds);
  double getWait() const;

  // Why this thread's last allocate() gave no buffer (Cause::None when it
  // gave one, or after clearRefusal()).
  static const HostRefusal& lastRefusal();
  static void clearRefusal();

  static size_t roundSize(size_t size);

 private:
  // One pinned allocation: its size, and whether it is registered memory
  // (an anonymous mapping) rather than from cudaHostAlloc.
  struct Pinned {
    size_t capacity;
    bool registered;
  };
  struct Cached {
    void* ptr;
    cudaEvent_t ready;
    c10::DeviceIndex device;
  };

  static void* allocatePinned(size_t size, bool& registered);
  static void freePinned(void* ptr, size_t size, bool registered);
  bool isReady(const Cached& c);
  HostBuffer takeCached(size_t rounded);
  // After a refusal by the budget: waits for one cached buffer whose copies
  // are still running (one of `rounded` bytes to 25% more, reusable for the
  // request, else the largest, whose release makes room). False when none
  // is running. The host blocks on the copy; the alternative is a refused
  // page-out, which leaves the device over its limit.
  bool awaitCopy(size_t rounded);
  HostLedger& ledger();
  // With the ledger locked: the budget (read again at most every
  // kHostSampleInterval) for the totals `held`.
  const HostBudget& budgetFor(const HostLedger::Totals& held);
  // Adds `bytes` to this process's pinned bytes in the ledger if the budget
  // has room for them; otherwise records the refusal.
  bool reservePinned(size_t bytes);
  void returnPinned(size_t bytes);
  // A wait under way in allocate().
  struct WaitState {
    bool begun = false; // the allocation has waited: its setting runs
    std::chrono::steady_clock::time_point begin;
    bool started = false; // waiting now (the slot says so)
    std::chrono::steady_clock::time_point since;
  };
  // After a refusal by the budget: waits until the budget may have room for
  // `bytes` (true: try again) or the wait ends unmet (false, the refusal
  // recorded with how the wait ended). See the top of the file.
  bool waitForRoom(size_t bytes, WaitState& state);
  // The one-line warning of a wait's start (see kHostWaitWarnInterval).
  void warnWait(
      size_t bytes,
      const HostLedger::Totals& held,
      size_t budget,
      double limit_s,
      const std::string& whom);
  // A new pinned buffer of `rounded` bytes within the budget, freeing this
  // process's idle cached buffers if that makes room ({} otherwise, the
  // refusal recorded).
  HostBuffer allocateNew(size_t rounded);
  // Ends a wait: clears the slot's waiting field and counts the time.
  void endWait(HostLedger::Locked& locked, WaitState& state);
  // Frees idle cached buffers when another process waits for room.
  void yieldCacheIfWanted();

  // The ledger's bytes for a buffer about to be pinned, if the budget has
  // room for them (false otherwise, the refusal recorded); given back at the
  // end of the scope unless the buffer was pinned (keep()).
  class PinnedReservation {
   public:
    PinnedReservation(HostPool& pool, size_t bytes);
    ~PinnedReservation();
    PinnedReservation(const PinnedReservation&) = delete;
    PinnedReservation& operator=(const PinnedReservation&) = delete;

    explicit operator bool() const {
      return reserved_;
    }
    void keep() {
      kept_ = true;
    }

   private:
    HostPool& pool_;
    const size_t bytes_;
    const bool reserved_;
    bool kept_ = false;
  };

  EventRecycler recycle_;
  std::mutex mutex_;
  std::multimap<size_t, Cached> cached_; // capacity -> idle buffer
  std::unordered_map<void*, Pinned> capacity_; // every buffer we allocated
  Usage usage_;

  std::atomic<size_t> limit_{0};
  std::atomic<double> wait_s_{kDefaultHostWaitSeconds};
  // When the last wait warning was given (at most one every
  // kHostWaitWarnInterval, the first always).
  std::chrono::steady_clock::time_point last_wait_warning_;
  bool warned_wait_ = false;
  std::once_flag ledger_once_;
  std::unique_ptr<HostLedger> ledger_;
  std::atomic<bool> ledger_open_{false};
  // Guarded by the ledger's lock.
  HostBudget budget_;
  std::chrono::steady_clock::time_point budget_read_;
  bool budget_valid_ = false;
};

// The process-wide pool LMS uses (pinned memory is portable across devices).
C10_CUDA_API HostPool& hostPool();

} // namespace c10::cuda::lms
