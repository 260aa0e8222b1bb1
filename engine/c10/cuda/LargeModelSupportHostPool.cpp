#include <c10/cuda/LargeModelSupportHostPool.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace c10::cuda::lms {

namespace {
constexpr size_t kSmallPage = 4096;
constexpr size_t kLargeChunk = 2 * 1024 * 1024;
// Buffers of at least this size (two huge pages) are pinned by registering
// memory that the pool populated itself (populateAndRegister); smaller ones
// with cudaHostAlloc, whose fixed cost is small next to theirs. Under a cap
// the first iteration pins hundreds of buffers of tens of MiB (GPT at half
// its peak: 523 buffers, 2.4 s of a 2.85 s iteration with cudaHostAlloc).
constexpr size_t kRegisterMinBytes = 4 * 1024 * 1024;
// Threads that fault in the pages of one buffer: one per this many bytes,
// at most kMaxPopulateThreads.
constexpr size_t kPopulateBytesPerThread = 8 * 1024 * 1024;
constexpr unsigned kMaxPopulateThreads = 8;

// Cleared when the runtime refuses to register host memory (some platforms
// do not support it): every later buffer is allocated with cudaHostAlloc.
std::atomic<bool> g_register_supported{true};

// Whether every device can register host memory and use it at the address
// the host uses. A paged-out storage points at its host copy, which kernels
// may read at that address (see LargeModelSupport.h); cudaHostAlloc memory is
// always so mapped under unified addressing, registered memory only where the
// device says so.
bool registrationUsable() {
  static const bool usable = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      return false;
    }
    for (int d = 0; d < count; ++d) {
      int supported = 0;
      int same_pointer = 0;
      if (cudaDeviceGetAttribute(
              &supported, cudaDevAttrHostRegisterSupported, d) != cudaSuccess ||
          cudaDeviceGetAttribute(
              &same_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem, d) !=
              cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      if (supported == 0 || same_pointer == 0) {
        return false;
      }
    }
    return true;
  }();
  return usable;
}

// Faults in every page of [ptr, ptr + size) on several threads. The kernel
// zeroes each page on its first touch; cudaHostAlloc does that on one thread,
// so a page-out that needs tens of GiB of new pinned memory (the first
// iteration of a model bigger than the device) waited for it page by page.
void populate(char* ptr, size_t size) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const auto threads = static_cast<unsigned>(std::max<size_t>(
      1,
      std::min<size_t>(
          std::min(kMaxPopulateThreads, hw), size / kPopulateBytesPerThread)));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const auto touch = [ptr, page](size_t begin, size_t end) {
    for (size_t off = begin; off < end; off += page) {
      *reinterpret_cast<volatile char*>(ptr + off) = 0;
    }
  };
  const size_t chunk = (size / threads + kLargeChunk - 1) / kLargeChunk *
      kLargeChunk; // whole huge pages per thread
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned t = 1; t < threads; ++t) {
    const size_t begin = std::min(size, t * chunk);
    const size_t end = std::min(size, begin + chunk);
    if (begin < end) {
      workers.emplace_back(touch, begin, end);
    }
  }
  touch(0, std::min(size, chunk));
  for (auto& w : workers) {
    w.join();
  }
}

// Pinned memory for `size` bytes (a multiple of kLargeChunk): an anonymous
// mapping aligned to huge pages (fewer faults and page-table entries), its
// pages populated in parallel, then registered with the runtime. Returns
// nullptr when the host has no memory for it; throws for other errors.
// Sets `registered` to false when registration is unsupported, so that the
// caller falls back to cudaHostAlloc.
void* populateAndRegister(size_t size, bool& registered) {
  registered = false;
  const size_t span = size + kLargeChunk;
  void* raw = mmap(
      nullptr,
      span,
      PROT_READ | PROT_WRITE,
      MAP_PRIVATE | MAP_ANONYMOUS,
      -1,
      0);
  if (raw == MAP_FAILED) {
    registered = true; // supported; the host is out of memory
    return nullptr;
  }
  // Trim the mapping to a huge-page-aligned range of `size` bytes.
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + kLargeChunk - 1) & ~(kLargeChunk - 1);
  if (aligned > base) {
    munmap(raw, aligned - base);
  }
  const uintptr_t end = base + span;
  if (end > aligned + size) {
    munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
  }
  auto* ptr = reinterpret_cast<char*>(aligned);
#ifdef MADV_HUGEPAGE
  (void)madvise(ptr, size, MADV_HUGEPAGE); // a hint: fine if refused
#endif
  populate(ptr, size);
  const cudaError_t err = cudaHostRegister(
      ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (err == cudaSuccess) {
    registered = true;
    return ptr;
  }
  (void)cudaGetLastError(); // clear the sticky state
  munmap(ptr, size);
  if (err == cudaErrorMemoryAllocation) {
    registered = true; // supported; the host could not pin more
    return nullptr;
  }
  TORCH_CHECK(
      err == cudaErrorNotSupported || err == cudaErrorInvalidValue ||
          err == cudaErrorHostMemoryAlreadyRegistered,
      "LMS: cudaHostRegister of ",
      std::to_string(size),
      " bytes failed: ",
      cudaGetErrorString(err));
  return nullptr; // unsupported here: registered stays false
}

constexpr size_t kMiB = 1024 * 1024;
constexpr size_t kGiB = 1024 * kMiB;
// How long a reading of the host's memory is trusted. Pinning costs
// milliseconds, reading /proc/meminfo and the cgroup files tens of
// microseconds: read at most every 100 ms, the budget costs the allocation
// path nothing that shows, and the ledger counts what LMS processes pin in
// between exactly.
constexpr std::chrono::milliseconds kHostSampleInterval{100};
// Limits at or above this are no limit (cgroup v1 writes 2^63 - 4096 for
// none).
constexpr size_t kHugeLimit = size_t(1) << 62;

// Why this thread's last allocate() gave no buffer.
thread_local HostRefusal t_refusal;

std::string mib(size_t bytes) {
  char text[32];
  std::snprintf(
      text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / kMiB);
  return text;
}

size_t saturatingAdd(size_t a, size_t b) {
  return a > kNoHostLimit - b ? kNoHostLimit : a + b;
}

size_t saturatingSub(size_t a, size_t b) {
  return a > b ? a - b : 0;
}

// A whole file of /proc or /sys (small); empty when it cannot be read.
std::string readFile(const std::string& path) {
  std::string text;
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) {
    return text;
  }
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) {
    text.append(buffer, n);
  }
  std::fclose(f);
  return text;
}

// A number of bytes at the start of `text` (strtoull, no locale); false when
// there is none.
bool parseBytes(const char* text, size_t* out) {
  while (*text == ' ' || *text == '\t') {
    ++text;
  }
  if (*text < '0' || *text > '9') {
    return false;
  }
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text) {
    return false;
  }
  *out = static_cast<size_t>(v);
  return true;
}

// The value of `key` in a file of "key value" lines (/proc/meminfo with
// "key:", memory.stat without).
bool fieldOf(const std::string& text, const std::string& key, size_t* out) {
  size_t at = 0;
  while (at < text.size()) {
    const size_t eol = std::min(text.find('\n', at), text.size());
    if (text.compare(at, key.size(), key) == 0 && at + key.size() < eol &&
        (text[at + key.size()] == ' ' || text[at + key.size()] == ':')) {
      const size_t from = at + key.size() + 1;
      const std::string line = text.substr(from, eol - from);
      return parseBytes(line.c_str(), out);
    }
    at = eol + 1;
  }
  return false;
}

// One cgroup level's limit and the room it leaves (false: no limit there).
bool cgroupLevel(const std::string& dir, bool v2, size_t* limit, size_t* room) {
  const std::string max_text =
      readFile(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
  if (!parseBytes(max_text.c_str(), limit) || *limit >= kHugeLimit) {
    return false; // "max", missing (the root of v2), or a huge number
  }
  size_t usage = 0;
  if (!parseBytes(
          readFile(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"))
              .c_str(),
          &usage)) {
    return false;
  }
  size_t inactive_file = 0;
  (void)fieldOf(
      readFile(dir + "/memory.stat"),
      v2 ? "inactive_file" : "total_inactive_file",
      &inactive_file);
  *room = saturatingSub(*limit, saturatingSub(usage, inactive_file));
  return true;
}

bool isDirectory(const std::string& path, uint64_t* inode) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return false;
  }
  *inode = static_cast<uint64_t>(st.st_ino);
  return true;
}

} // namespace

// Pinned host memory of `size` bytes (rounded by roundSize), portable to
// every device: a buffer paged out from one device may be paged in to
// another's memory pool later, and any device's copy engine may use it.
// Returns nullptr when the host has no more pinned memory to give.
void* HostPool::allocatePinned(size_t size, bool& registered) {
  registered = false;
  if (size >= kRegisterMinBytes && g_register_supported.load() &&
      registrationUsable()) {
    bool supported = false;
    void* ptr = populateAndRegister(size, supported);
    if (ptr != nullptr) {
      registered = true;
      return ptr;
    }
    if (supported) {
      return nullptr;
    }
    g_register_supported.store(false);
  }
  void* ptr = nullptr;
  const cudaError_t err = cudaHostAlloc(&ptr, size, cudaHostAllocPortable);
  if (err == cudaSuccess) {
    return ptr;
  }
  TORCH_CHECK(
      err == cudaErrorMemoryAllocation,
      "LMS: cudaHostAlloc of ",
      std::to_string(size),
      " bytes failed: ",
      cudaGetErrorString(err));
  (void)cudaGetLastError();
  return nullptr;
}

void HostPool::freePinned(void* ptr, size_t size, bool registered) {
  if (registered) {
    C10_CUDA_CHECK(cudaHostUnregister(ptr));
    TORCH_CHECK(
        munmap(ptr, size) == 0, "LMS: munmap of a pinned host buffer failed");
    return;
  }
  C10_CUDA_CHECK(cudaFreeHost(ptr));
}

bool readMemInfo(const std::string& path, HostMemory& out) {
  const std::string text = readFile(path);
  size_t total_kib = 0;
  size_t available_kib = 0;
  if (!fieldOf(text, "MemTotal", &total_kib) ||
      !fieldOf(text, "MemAvailable", &available_kib) || total_kib == 0) {
    return false;
  }
  out.total = total_kib * 1024;
  out.available = available_kib * 1024;
  return true;
}

void readCgroup(
    const std::string& proc_cgroup,
    const std::string& cgroup_mount,
    HostMemory& out) {
  // Lines "hierarchy:controllers:path". The memory controller's own line
  // (cgroup v1, or a hybrid host) wins over the unified one ("0::path").
  const std::string text = readFile(proc_cgroup);
  std::string path;
  bool v2 = false;
  bool found = false;
  size_t at = 0;
  while (at < text.size()) {
    const size_t eol = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, eol - at);
    at = eol + 1;
    const size_t first = line.find(':');
    const size_t second =
        first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) {
      continue;
    }
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string where = line.substr(second + 1);
    bool memory = false;
    for (size_t from = 0; from <= controllers.size();) {
      const size_t comma =
          std::min(controllers.find(',', from), controllers.size());
      memory = memory || controllers.compare(from, comma - from, "memory") == 0;
      from = comma + 1;
    }
    if (memory) {
      path = where;
      v2 = false;
      found = true;
      break;
    }
    if (controllers.empty() && line.compare(0, first, "0") == 0) {
      path = where;
      v2 = true;
      found = true;
    }
  }
  if (!found) {
    return;
  }
  const std::string base = v2 ? cgroup_mount : cgroup_mount + "/memory";
  if (path.empty() || path.front() != '/') {
    path = "/" + path;
  }
  uint64_t inode = 0;
  if (!isDirectory(base + path, &inode)) {
    // A container that sees its own cgroup at the mount, without a cgroup
    // namespace: /proc/self/cgroup names the host's path.
    path = "/";
    if (!isDirectory(base, &inode)) {
      return;
    }
  }
  out.cgroup_id = inode;
  // A limit anywhere above the process's cgroup binds it too.
  while (true) {
    size_t limit = 0;
    size_t room = 0;
    if (cgroupLevel(base + (path == "/" ? "" : path), v2, &limit, &room) &&
        room < out.cgroup_room) {
      out.cgroup_limit = limit;
      out.cgroup_room = room;
      out.cgroup_path = path;
    }
    if (path == "/") {
      break;
    }
    const size_t slash = path.find_last_of('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
}

size_t hostReserve(size_t total) {
  return std::max(std::min(2 * kGiB, total / 8), total / 20);
}

// ---------------------------------------------------------------------------
// HostBudget
// ---------------------------------------------------------------------------

size_t HostBudget::inForce(const Totals& now, Source* source) const {
  Source from = Source::None;
  size_t budget = kNoHostLimit;
  if (setting != 0) {
    from = Source::Setting;
    budget = setting;
  } else {
    if (host_bytes != kNoHostLimit) {
      from = Source::MemAvailable;
      budget = host_bytes;
    }
    if (cgroup_bytes != kNoHostLimit) {
      const size_t cgroup =
          saturatingAdd(cgroup_bytes, saturatingSub(now.all, now.cgroup));
      if (cgroup < budget) {
        from = Source::Cgroup;
        budget = cgroup;
      }
    }
  }
  if (source != nullptr) {
    *source = from;
  }
  return budget;
}

HostBudget deriveHostBudget(
    const HostMemory& memory,
    const HostLedger::Totals& held) {
  HostBudget budget;
  budget.memory = memory;
  budget.held = held;
  if (memory.total != 0) {
    // MemAvailable leaves out what is pinned already: what LMS processes may
    // pin in all is what is available plus what they hold.
    budget.host_reserve = hostReserve(memory.total);
    budget.host_bytes = saturatingSub(
        saturatingAdd(memory.available, held.all), budget.host_reserve);
  }
  if (memory.cgroup_room != kNoHostLimit) {
    budget.cgroup_reserve = hostReserve(memory.cgroup_limit);
    budget.cgroup_bytes = saturatingSub(
        saturatingAdd(memory.cgroup_room, held.cgroup), budget.cgroup_reserve);
  }
  return budget;
}

std::string describeHostRefusal(const HostRefusal& refusal) {
  const HostLedger::Totals& held = refusal.held;
  const std::string holders = mib(held.all) + " (this process " +
      mib(held.own) + ", other LMS processes " +
      mib(saturatingSub(held.all, held.own)) + ")";
  std::string ledger_note = refusal.ledger_path.empty()
      ? " This process could not use the host ledger (see the warning) and "
        "counts only its own pinned memory."
      : std::string();
  char waited[32];
  std::snprintf(waited, sizeof(waited), "%.1f s", refusal.waited_s);
  if (refusal.wait == HostRefusal::Wait::TimedOut) {
    ledger_note += std::string(" It waited ") + waited +
        " for other LMS processes of this host to release pinned memory "
        "(torch.cuda.set_host_wait_lms(), lms_host_wait_s).";
  } else if (refusal.wait == HostRefusal::Wait::Yielded) {
    ledger_note += std::string(" It waited ") + waited +
        " for other LMS processes of this host to release pinned memory, "
        "until every one of them that holds pinned memory waited too; of "
        "those, this process started last and gives up its wait so that the "
        "others can go on.";
  }
  const std::string remedies =
      " Free host memory (other programs, data-loader workers), train with a "
      "smaller batch, or, where the host has the memory, raise the budget "
      "with torch.cuda.set_host_limit_lms(bytes) or "
      "PYTORCH_CUDA_ALLOC_CONF=lms_host_limit_mb:<MiB> (PYTORCH_LMS_CONF with "
      "the drop-in extension).";
  if (refusal.cause == HostRefusal::Cause::Allocation) {
    return "The CUDA runtime could not pin " + mib(refusal.bytes) +
        " of host memory for a page-out (the host, or this process's "
        "locked-memory limit, has no more); the LMS processes of this host "
        "hold " +
        holders + " of pinned host memory, within a host budget of " +
        (refusal.budget == kNoHostLimit ? std::string("none")
                                        : mib(refusal.budget)) +
        "." + ledger_note + remedies;
  }
  const HostBudget& r = refusal.reading;
  std::string source;
  switch (refusal.source) {
    case HostBudget::Source::Setting:
      source = "set with torch.cuda.set_host_limit_lms() or lms_host_limit_mb";
      break;
    case HostBudget::Source::MemAvailable:
      source = "derived from /proc/meminfo: MemAvailable " +
          mib(r.memory.available) + " + " + mib(r.held.all) +
          " pinned by LMS processes - a reserve of " + mib(r.host_reserve) +
          " for the rest of the system (5% of MemTotal " + mib(r.memory.total) +
          ", at least 2 GiB)";
      break;
    case HostBudget::Source::Cgroup:
      source = "derived from the memory limit of cgroup " +
          r.memory.cgroup_path + ": " + mib(r.memory.cgroup_room) +
          " of its limit of " + mib(r.memory.cgroup_limit) + " not in use + " +
          mib(r.held.cgroup) + " pinned by its LMS processes - a reserve of " +
          mib(r.cgroup_reserve) + " (5% of the limit, at least 2 GiB)";
      break;
    case HostBudget::Source::None:
      source = "unknown";
      break;
  }
  return "The host budget for pinned memory has no room for a page-out of " +
      mib(refusal.bytes) + ": the LMS processes of this host hold " + holders +
      " of a budget of " + mib(refusal.budget) + ", " + source + "." +
      ledger_note + remedies;
}

// ---------------------------------------------------------------------------
// HostPool
// ---------------------------------------------------------------------------

HostPool::HostPool(EventRecycler recycle) : recycle_(std::move(recycle)) {}

size_t HostPool::roundSize(size_t size) {
  // Powers of two up to 2 MiB keep small buffers interchangeable; larger
  // ones round to 2 MiB so a 1 GiB storage does not cost 2 GiB of host memory.
  if (size <= kLargeChunk) {
    size_t rounded = kSmallPage;
    while (rounded < size) {
      rounded *= 2;
    }
    return rounded;
  }
  return (size + kLargeChunk - 1) / kLargeChunk * kLargeChunk;
}

bool HostPool::isReady(const Cached& c) {
  if (c.ready == nullptr) {
    return true;
  }
  const cudaError_t err = cudaEventQuery(c.ready);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); // not an error: clear the sticky state
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

// Reuses an idle buffer of at least `rounded` bytes and at most 25% larger.
// Called with the lock held.
HostBuffer HostPool::takeCached(size_t rounded) {
  const size_t most = rounded + rounded / 4;
  for (auto it = cached_.lower_bound(rounded);
       it != cached_.end() && it->first <= most;
       ++it) {
    if (!isReady(it->second)) {
      continue;
    }
    HostBuffer buffer{it->second.ptr, it->first};
    if (it->second.ready != nullptr) {
      recycle_(it->second.ready, it->second.device);
    }
    cached_.erase(it);
    usage_.in_use_bytes += static_cast<int64_t>(buffer.capacity);
    return buffer;
  }
  return {};
}

HostBuffer HostPool::allocate(size_t size, bool wait) {
  const size_t rounded = roundSize(size);
  t_refusal = HostRefusal{};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HostBuffer reused = takeCached(rounded);
    if (reused.ptr != nullptr) {
      return reused;
    }
  }
  // A new buffer is pinned: idle ones of other sizes go back first if
  // another process waits for room.
  yieldCacheIfWanted();
  WaitState state;
  do {
    HostBuffer buffer = allocateNew(rounded);
    if (buffer.ptr != nullptr) {
      return buffer;
    }
    // This pool's own buffers still in flight come back first: a host that
    // runs ahead of the copies finds every buffer it released still read by
    // a page-in or written by a page-out.
    while (t_refusal.cause == HostRefusal::Cause::Budget &&
           awaitCopy(rounded)) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        HostBuffer reused = takeCached(rounded);
        if (reused.ptr != nullptr) {
          t_refusal = HostRefusal{};
          return reused;
        }
      }
      buffer = allocateNew(rounded); // the released buffer made room
      if (buffer.ptr != nullptr) {
        return buffer;
      }
    }
  } while (wait && t_refusal.cause == HostRefusal::Cause::Budget &&
           waitForRoom(rounded, state));
  if (t_refusal.cause == HostRefusal::Cause::Budget) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++usage_.budget_refusals;
  }
  return {};
}

bool HostPool::awaitCopy(size_t rounded) {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t most = rounded + rounded / 4;
  const Cached* awaited = nullptr;
  for (auto it = cached_.lower_bound(rounded);
       it != cached_.end() && it->first <= most;
       ++it) {
    if (!isReady(it->second)) {
      awaited = &it->second;
      break;
    }
  }
  if (awaited == nullptr) {
    for (auto it = cached_.rbegin(); it != cached_.rend(); ++it) {
      if (!isReady(it->second)) {
        awaited = &it->second;
        break;
      }
    }
  }
  if (awaited == nullptr) {
    return false;
  }
  // Under the lock, so that no other thread takes the buffer and recycles
  // its event meanwhile: the wait is one copy's.
  const auto began = std::chrono::steady_clock::now();
  C10_CUDA_CHECK(cudaEventSynchronize(awaited->ready));
  const std::chrono::duration<double, std::milli> took =
      std::chrono::steady_clock::now() - began;
  ++usage_.copy_waits;
  usage_.copy_wait_ms += took.count();
  return true;
}

HostBuffer HostPool::allocateNew(size_t rounded) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    // Host memory is a tier with a budget (see the header): past it, the
    // kernel's OOM killer would end an LMS process of the host.
    PinnedReservation room(*this, rounded);
    if (!room) {
      // This process's idle cached buffers count against the budget too.
      releaseCached();
      continue;
    }
    bool registered = false;
    const auto began = std::chrono::steady_clock::now();
    void* ptr = allocatePinned(rounded, registered);
    if (ptr != nullptr) {
      const std::chrono::duration<double, std::milli> took =
          std::chrono::steady_clock::now() - began;
      room.keep();
      std::lock_guard<std::mutex> lock(mutex_);
      capacity_.emplace(ptr, Pinned{rounded, registered});
      ++usage_.pins;
      usage_.pin_ms += took.count();
      usage_.held_bytes += static_cast<int64_t>(rounded);
      usage_.in_use_bytes += static_cast<int64_t>(rounded);
      usage_.peak_held_bytes =
          std::max(usage_.peak_held_bytes, usage_.held_bytes);
      t_refusal = HostRefusal{}; // a refusal of the first attempt is past
      return {ptr, rounded};
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++usage_.alloc_failures;
    }
    t_refusal = HostRefusal{};
    t_refusal.cause = HostRefusal::Cause::Allocation;
    t_refusal.bytes = rounded;
    // Idle cached buffers of other sizes may be what stands in the way.
    releaseCached();
  }
  return {};
}

bool HostPool::waitForRoom(size_t bytes, WaitState& state) {
  const double limit_s = wait_s_.load();
  if (limit_s <= 0) {
    return false;
  }
  const auto limit = std::chrono::duration<double>(limit_s);
  HostLedger& book = ledger();
  std::string whom;
  while (true) {
    {
      HostLedger::Locked locked(book);
      std::vector<HostLedgerSlot> others;
      const HostLedger::Totals held = locked.totals(&others);
      const HostBudget& budget = budgetFor(held);
      HostBudget::Source source = HostBudget::Source::None;
      const size_t in_force = budget.inForce(held, &source);
      const auto now = std::chrono::steady_clock::now();
      const auto refuse = [&](HostRefusal::Wait how) {
        t_refusal.held = held;
        t_refusal.budget = in_force;
        t_refusal.source = source;
        t_refusal.reading = budget;
        t_refusal.wait = how;
        if (state.begun) {
          t_refusal.waited_s =
              std::chrono::duration<double>(now - state.begin).count();
        }
        if (state.started) {
          endWait(locked, state);
        }
        return false;
      };
      if (bytes <= in_force && held.all <= in_force - bytes) {
        if (state.started) {
          endWait(locked, state);
        }
        return true; // try again (another process may take it first)
      }
      // What the others hold, and whether any of them is not waiting: a
      // process that is not waiting is making progress and will release.
      size_t others_hold = 0;
      bool all_wait = true;
      uint64_t youngest = locked.ticket();
      for (const HostLedgerSlot& slot : others) {
        if (slot.bytes <= 0) {
          continue;
        }
        others_hold += static_cast<size_t>(slot.bytes);
        all_wait = all_wait && slot.waiting != 0;
        youngest = std::max(youngest, slot.ticket);
      }
      // Nothing to wait for: no other process holds pinned bytes, or even
      // all of theirs would not make room.
      if (others_hold == 0 || bytes > in_force ||
          held.all - others_hold > in_force - bytes) {
        return refuse(
            state.begun ? HostRefusal::Wait::TimedOut
                        : HostRefusal::Wait::None);
      }
      if (!state.started) {
        if (!locked.setWaiting(bytes)) {
          return false; // not shared: no other process is seen
        }
        state.started = true;
        state.since = now;
        youngest = std::max(youngest, locked.ticket());
        if (!state.begun) {
          state.begun = true;
          state.begin = now;
          for (const HostLedgerSlot& slot : others) {
            if (slot.bytes > 0) {
              whom += (whom.empty() ? "pid " : ", pid ") +
                  std::to_string(slot.pid) + " (" +
                  mib(static_cast<size_t>(slot.bytes)) +
                  (slot.waiting != 0 ? ", waiting" : "") + ")";
            }
          }
          std::lock_guard<std::mutex> lock(mutex_);
          ++usage_.waits;
        }
      }
      // The setting bounds the allocation's waits together: room that
      // another process takes first does not start it again.
      if (now - state.begin >= limit) {
        return refuse(HostRefusal::Wait::TimedOut);
      }
      // Every holder waits: the last to join gives up (see the header).
      if (all_wait && youngest == locked.ticket()) {
        return refuse(HostRefusal::Wait::Yielded);
      }
      if (!whom.empty()) {
        warnWait(bytes, held, in_force, limit_s, whom);
        whom.clear();
      }
    }
    std::this_thread::sleep_for(kHostWaitPoll);
    // This process's other threads may have returned buffers meanwhile.
    releaseCached();
  }
}

void HostPool::warnWait(
    size_t bytes,
    const HostLedger::Totals& held,
    size_t budget,
    double limit_s,
    const std::string& whom) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (warned_wait_ && now - last_wait_warning_ < kHostWaitWarnInterval) {
      return;
    }
    warned_wait_ = true;
    last_wait_warning_ = now;
  }
  char limit[32];
  std::snprintf(limit, sizeof(limit), "%.1f s", limit_s);
  TORCH_WARN(
      "Large Model Support: the host budget for pinned memory (",
      mib(budget),
      ", ",
      mib(held.all),
      " held) has no room for a page-out of ",
      mib(bytes),
      "; waiting up to ",
      limit,
      " for other LMS processes of this host to release pinned memory: ",
      whom,
      " (torch.cuda.set_host_wait_lms(), lms_host_wait_s).");
}

void HostPool::endWait(HostLedger::Locked& locked, WaitState& state) {
  (void)locked.setWaiting(0);
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - state.since)
                        .count();
  state.started = false;
  std::lock_guard<std::mutex> lock(mutex_);
  usage_.wait_ms += ms;
}

void HostPool::yieldCacheIfWanted() {
  if (ledger_open_.load() && ledger().othersWaiting()) {
    releaseCached();
  }
}

void HostPool::release(
    HostBuffer buffer,
    cudaEvent_t ready,
    c10::DeviceIndex device) {
  TORCH_INTERNAL_ASSERT(buffer.ptr != nullptr);
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(
      capacity_.count(buffer.ptr) == 1, "LMS: host buffer not from this pool");
  usage_.in_use_bytes -= static_cast<int64_t>(buffer.capacity);
  cached_.emplace(buffer.capacity, Cached{buffer.ptr, ready, device});
  lock.unlock();
  // Cached idle, the buffer would hold pinned memory that a waiting process
  // needs (see the header).
  yieldCacheIfWanted();
}

void HostPool::releaseCached() {
  std::vector<std::pair<void*, Pinned>> to_free;
  size_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = cached_.begin(); it != cached_.end();) {
      if (!isReady(it->second)) {
        ++it;
        continue;
      }
      if (it->second.ready != nullptr) {
        recycle_(it->second.ready, it->second.device);
      }
      const auto found = capacity_.find(it->second.ptr);
      to_free.emplace_back(found->first, found->second);
      usage_.held_bytes -= static_cast<int64_t>(it->first);
      freed += it->first;
      capacity_.erase(found);
      it = cached_.erase(it);
    }
  }
  for (const auto& [ptr, pinned] : to_free) {
    freePinned(ptr, pinned.capacity, pinned.registered);
  }
  if (freed != 0) {
    returnPinned(freed);
  }
}

HostPool::Usage HostPool::usage() {
  std::lock_guard<std::mutex> lock(mutex_);
  return usage_;
}

void HostPool::resetPeak() {
  std::lock_guard<std::mutex> lock(mutex_);
  usage_.peak_held_bytes = usage_.held_bytes;
}

HostLedger& HostPool::ledger() {
  std::call_once(ledger_once_, [this] {
    HostMemory memory;
    readCgroup("/proc/self/cgroup", "/sys/fs/cgroup", memory);
    ledger_ = std::make_unique<HostLedger>(
        HostLedger::defaultPath(), memory.cgroup_id);
    ledger_open_.store(true);
  });
  return *ledger_;
}

const HostBudget& HostPool::budgetFor(const HostLedger::Totals& held) {
  const size_t setting = limit_.load();
  const auto now = std::chrono::steady_clock::now();
  // A setting replaces the reading; without one, read the host again once
  // the last reading is older than the interval.
  if (setting == 0 &&
      (!budget_valid_ || now - budget_read_ >= kHostSampleInterval)) {
    HostMemory memory;
    (void)readMemInfo("/proc/meminfo", memory);
    readCgroup("/proc/self/cgroup", "/sys/fs/cgroup", memory);
    budget_ = deriveHostBudget(memory, held);
    budget_read_ = now;
    budget_valid_ = true;
  }
  budget_.setting = setting;
  return budget_;
}

bool HostPool::reservePinned(size_t bytes) {
  HostLedger& book = ledger();
  HostLedger::Locked locked(book);
  const HostLedger::Totals held = locked.totals();
  const HostBudget& budget = budgetFor(held);
  HostBudget::Source source = HostBudget::Source::None;
  const size_t in_force = budget.inForce(held, &source);
  if (bytes > in_force || held.all > in_force - bytes) {
    t_refusal = HostRefusal{};
    t_refusal.cause = HostRefusal::Cause::Budget;
    t_refusal.bytes = bytes;
    t_refusal.held = held;
    t_refusal.budget = in_force;
    t_refusal.source = source;
    t_refusal.reading = budget;
    t_refusal.ledger_path = book.shared() ? book.path() : std::string();
    return false;
  }
  locked.add(static_cast<int64_t>(bytes));
  return true;
}

void HostPool::returnPinned(size_t bytes) {
  HostLedger::Locked locked(ledger());
  locked.add(-static_cast<int64_t>(bytes));
}

void HostPool::setLimit(size_t bytes) {
  limit_.store(bytes);
}

size_t HostPool::getLimit() const {
  return limit_.load();
}

void HostPool::setWait(double seconds) {
  TORCH_CHECK(
      seconds >= 0 && seconds < 1e9,
      "LMS: the host wait must be between 0 and 1e9 seconds, got ",
      std::to_string(seconds));
  wait_s_.store(seconds);
}

double HostPool::getWait() const {
  return wait_s_.load();
}

HostPool::BudgetStatus HostPool::budgetStatus() {
  BudgetStatus status;
  if (!ledger_open_.load()) {
    // Nothing pinned yet: no ledger file is made for a question.
    const HostBudget budget = [&] {
      HostBudget b;
      if (limit_.load() == 0) {
        HostMemory memory;
        (void)readMemInfo("/proc/meminfo", memory);
        readCgroup("/proc/self/cgroup", "/sys/fs/cgroup", memory);
        b = deriveHostBudget(memory, status.held);
      }
      b.setting = limit_.load();
      return b;
    }();
    status.budget = budget.inForce(status.held, &status.source);
    return status;
  }
  HostLedger::Locked locked(ledger());
  status.held = locked.totals();
  status.budget = budgetFor(status.held).inForce(status.held, &status.source);
  return status;
}

const HostRefusal& HostPool::lastRefusal() {
  return t_refusal;
}

void HostPool::clearRefusal() {
  t_refusal = HostRefusal{};
}

HostPool::PinnedReservation::PinnedReservation(HostPool& pool, size_t bytes)
    : pool_(pool), bytes_(bytes), reserved_(pool.reservePinned(bytes)) {}

HostPool::PinnedReservation::~PinnedReservation() {
  if (reserved_ && !kept_) {
    pool_.returnPinned(bytes_);
  }
}

} // namespace c10::cuda::lms
