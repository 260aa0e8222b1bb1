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

namespace c10::cuda::lms {

struct HostBuffer {
  void* ptr = nullptr;
  size_t capacity = 0; // bytes actually allocated (rounded up)
};

// ---------------------------------------------------------------------------
// What the host can give
// ---------------------------------------------------------------------------

constexpr size_t kNoHostLimit = SIZE_MAX;

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
constexpr uint32_t kHostLedgerVersion = 1;
constexpr uint32_t kHostLedgerSlots = 511; // a 16 KiB file

struct HostLedgerHeader {
  char magic[8]; // "LMSHOST\0"
  uint32_t version;
  uint32_t slot_count;
  uint64_t reserved[2];
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

    // Frees the slots of processes that have ended, then adds up the rest.
    Totals totals();
    // Adds `delta` (negative: freed) to this process's pinned bytes.
    void add(int64_t delta);

   private:
    HostLedger& ledger_;
    std::unique_lock<std::mutex> lock_;
  };

  bool shared() const {
    return map_ != nullptr;
  }
  const std::string& path() const {
    return path_;
  }

 private:
  bool open();
  void fallBack(const std::string& why);
  bool lockByte(size_t offset, bool wait);
  void unlockByte(size_t offset);
  bool claimSlot();
  HostLedgerSlot* slots();

  const std::string path_;
  const uint64_t cgroup_id_;
  std::mutex mutex_;
  int fd_ = -1;
  void* map_ = nullptr;
  int64_t owner_pid_ = 0; // the process that holds slot_ (fork: not a child)
  int slot_ = -1;
  int64_t own_bytes_ = 0;
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
  // idle cached buffer; lastRefusal() then says why.
  HostBuffer allocate(size_t size);
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
  HostLedger& ledger();
  // With the ledger locked: the budget (read again at most every
  // kHostSampleInterval) for the totals `held`.
  const HostBudget& budgetFor(const HostLedger::Totals& held);
  // Adds `bytes` to this process's pinned bytes in the ledger if the budget
  // has room for them; otherwise records the refusal.
  bool reservePinned(size_t bytes);
  void returnPinned(size_t bytes);

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
