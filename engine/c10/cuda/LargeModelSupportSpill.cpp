// The disk tier (setSpillDir, lms_spill_dir; off by default): below the
// pinned host pool, a directory on local disk. When the host budget (or
// pinning itself) has no room for a page-out, the coldest paged-out host
// copies are written to files there and their pinned buffers go back to the
// pool; when none is left to move, the victim itself goes to disk. A page-in
// of a spilled storage reads its file back through a bounded staging buffer.
// Processes whose storages exceed device plus host memory thus finish,
// slower, instead of stopping with the host-memory error.
//
// Files are private: a subdirectory of the spill directory per process
// (mode 0700, named lms-spill.<pid>.<start time>), files of mode 0600. The
// process holds a write lock (fcntl) on the lock file of its subdirectory
// for its life; the kernel drops it however the process ends. The
// subdirectory is removed at exit; one whose lock no process holds (its
// owner crashed) is removed by the next LMS process that sets the same
// spill directory. The lock, not the pid, says whether the owner lives: a pid
// names no single process across pid namespaces and pid reuse.
//
// Bounded: by setSpillLimit (0: none of its own), and always by a reserve of
// the file system's free space (5% of it, at most 1 GiB), which other
// programs and the checkpoints of the training itself need. A write that
// fails (the bound, a full disk, an I/O error) removes its file and leaves
// the host copy or the device memory as it was: nothing already paged is
// lost, and the page-out falls back to the host tier (its wait, its error).
//
// Staging is pageable memory of a fixed size, not pinned: the disk tier
// serves exactly when the pinned budget has no room, and a pageable copy
// (16-20 GB/s) is faster than any disk.

#include <c10/cuda/LargeModelSupportInternal.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace c10::cuda::lms {

namespace detail {

namespace {

// Bytes read or written per call, and the size of the staging buffer.
constexpr size_t kSpillChunk = 16 * kMiB;
// Free space a spill never takes from the file system: 5% of it, at most
// 1 GiB.
constexpr size_t kSpillReserveMax = 1024 * kMiB;
constexpr const char* kSpillPrefix = "lms-spill.";
constexpr const char* kSpillLock = "lock";

std::string mibText(size_t bytes) {
  char text[32];
  std::snprintf(
      text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / kMiB);
  return text;
}

// Field 22 of /proc/<pid>/stat: the process's start time in clock ticks
// since boot (0: unknown). With the pid it names one process.
unsigned long long startTime(long pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) {
    return 0;
  }
  char buffer[1024];
  const size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  buffer[n] = '\0';
  // The command name (field 2) may hold spaces and parentheses: fields are
  // counted from the last ')'.
  const char* at = std::strrchr(buffer, ')');
  if (at == nullptr) {
    return 0;
  }
  ++at;
  for (int field = 3; field < 22 && at != nullptr; ++field) {
    at = std::strchr(at + 1, ' ');
  }
  return at == nullptr ? 0 : std::strtoull(at + 1, nullptr, 10);
}

bool lockFile(int fd) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = 0;
  lock.l_len = 1;
  return ::fcntl(fd, F_SETLK, &lock) == 0;
}

// Removes a process's spill subdirectory: its files (regular files only),
// then the directory.
void removeTree(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* entry = ::readdir(d)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") {
        (void)::unlink((dir + "/" + name).c_str());
      }
    }
    ::closedir(d);
  }
  (void)::rmdir(dir.c_str());
}

// Whether the owner of spill subdirectory `dir` (named for `pid` and
// `start`) has ended: no process holds its lock. A directory without a lock
// file yet (its owner is making it) counts as alive while its pid runs with
// that start time.
bool ownerEnded(const std::string& dir, long pid, unsigned long long start) {
  const int fd =
      ::open((dir + "/" + kSpillLock).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    return startTime(pid) != start;
  }
  const bool ended = lockFile(fd);
  ::close(fd); // drops the lock just taken
  return ended;
}

class SpillStore;
SpillStore& store();

class SpillStore {
 public:
  SpillStore() = default;
  SpillStore(const SpillStore&) = delete;
  SpillStore& operator=(const SpillStore&) = delete;

  // At exit: removes this process's subdirectories and turns the tier off.
  // Storages that die later (late deleters) find their files gone already.
  void removeOwn() {
    std::lock_guard<std::mutex> lock(mutex_);
    const long pid = static_cast<long>(::getpid());
    for (auto it = owned_.begin(); it != owned_.end();) {
      if (it->pid != pid) {
        ++it;
        continue;
      }
      removeTree(it->path);
      ::close(it->lock_fd);
      it = owned_.erase(it);
    }
    dir_.clear();
    own_.clear();
    own_pid_ = 0;
  }

  void setDir(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (dir.empty()) {
      dir_.clear(); // files spilled so far stay until read back
      return;
    }
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      const int err = errno;
      TORCH_CHECK_VALUE(
          false,
          "Large Model Support: the spill directory '",
          dir,
          "' (torch.cuda.set_spill_dir_lms(), PYTORCH_CUDA_ALLOC_CONF key "
          "lms_spill_dir) ",
          err == ENOENT ? std::string("does not exist")
                        : "cannot be read: " + std::string(std::strerror(err)),
          ". Create it first (mkdir -p '",
          dir,
          "') or name a directory on a local disk that exists, e.g. "
          "torch.cuda.set_spill_dir_lms('/var/tmp') or lms_spill_dir:/var/tmp; "
          "'' turns the disk tier off.");
    }
    TORCH_CHECK_VALUE(
        S_ISDIR(st.st_mode),
        "Large Model Support: the spill directory '",
        dir,
        "' (torch.cuda.set_spill_dir_lms(), PYTORCH_CUDA_ALLOC_CONF key "
        "lms_spill_dir) is not a directory. Name a directory on a local "
        "disk, e.g. torch.cuda.set_spill_dir_lms('/var/tmp') or "
        "lms_spill_dir:/var/tmp; '' turns the disk tier off.");
    removeEnded(dir);
    const std::string own = ownDir(dir);
    dir_ = dir;
    own_ = own;
  }

  std::string dir() {
    std::lock_guard<std::mutex> lock(mutex_);
    return dir_;
  }

  void setLimit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
  }

  size_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

  bool enabled() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !dir_.empty();
  }

  // Writes `size` bytes that `produce` puts into the staging buffer a chunk
  // at a time (produce(staging, offset, bytes)) to a new file; its path goes
  // to `path`. False, no file left and the reason in lastFailure(), when the
  // bound, the disk or the directory refuses it.
  bool write(
      size_t size,
      c10::function_ref<void(char*, size_t, size_t)> produce,
      std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (dir_.empty()) {
      return false;
    }
    if (limit_ != 0 && held_ + size > limit_) {
      failed(
          "the spill limit of " + mibText(limit_) + " has " +
          mibText(limit_ - std::min(limit_, held_)) +
          " left (torch.cuda.set_spill_limit_lms(), lms_spill_limit_mb)");
      return false;
    }
    struct statvfs fs {};
    if (::statvfs(dir_.c_str(), &fs) == 0) {
      const size_t block = fs.f_frsize != 0 ? fs.f_frsize : fs.f_bsize;
      const size_t total = static_cast<size_t>(fs.f_blocks) * block;
      const size_t free = static_cast<size_t>(fs.f_bavail) * block;
      const size_t reserve = std::min(kSpillReserveMax, total / 20);
      if (free < size + reserve) {
        failed(
            "its file system has " + mibText(free) +
            " free, and the disk tier leaves " + mibText(reserve) +
            " of it to the rest of the system");
        return false;
      }
    }
    if (static_cast<long>(::getpid()) != own_pid_) {
      own_ = ownDir(dir_); // a child after fork: a directory of its own
    }
    path = own_ + "/" + std::to_string(++serial_);
    const int fd = ::open(
        path.c_str(),
        O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
        0600);
    if (fd < 0) {
      failed("creating " + path + " failed: " + std::strerror(errno));
      return false;
    }
    char* stage = staging();
    size_t done = 0;
    int err = 0;
    try {
      while (done < size && err == 0) {
        const size_t n = std::min(kSpillChunk, size - done);
        produce(stage, done, n);
        size_t written = 0;
        while (written < n) {
          const ssize_t w = ::pwrite(
              fd,
              stage + written,
              n - written,
              static_cast<off_t>(done + written));
          if (w < 0 && errno == EINTR) {
            continue;
          }
          if (w <= 0) {
            err = w < 0 ? errno : ENOSPC;
            break;
          }
          written += static_cast<size_t>(w);
        }
        done += written;
      }
    } catch (...) {
      ::close(fd);
      (void)::unlink(path.c_str());
      throw;
    }
    if (::close(fd) != 0 && err == 0) {
      err = errno;
    }
    if (err != 0) {
      (void)::unlink(path.c_str());
      failed(
          "writing " + mibText(size) + " to " + path +
          " failed: " + std::strerror(err));
      return false;
    }
    held_ += size;
    ++files_;
    return true;
  }

  // Reads the `size` bytes of file `path` a chunk at a time into the staging
  // buffer and hands each to consume(staging, offset, bytes). Throws when
  // the file cannot be read (it is left in place).
  void read(
      const std::string& path,
      size_t size,
      c10::function_ref<void(const char*, size_t, size_t)> consume) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    TORCH_CHECK(
        fd >= 0,
        "Large Model Support: cannot open the spilled copy ",
        path,
        " of a paged-out storage: ",
        std::strerror(errno),
        " (was the spill directory cleaned while this process ran?)");
    char* stage = staging();
    size_t done = 0;
    try {
      while (done < size) {
        const size_t n = std::min(kSpillChunk, size - done);
        size_t got = 0;
        while (got < n) {
          const ssize_t r =
              ::pread(fd, stage + got, n - got, static_cast<off_t>(done + got));
          if (r < 0 && errno == EINTR) {
            continue;
          }
          TORCH_CHECK(
              r > 0,
              "Large Model Support: reading the spilled copy ",
              path,
              " failed: ",
              r < 0 ? std::strerror(errno)
                    : "the file is shorter than the "
                      "storage");
          got += static_cast<size_t>(r);
        }
        consume(stage, done, n);
        done += n;
      }
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }

  void remove(const std::string& path, size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    (void)::unlink(path.c_str());
    held_ -= std::min(held_, size);
    files_ -= files_ > 0 ? 1 : 0;
  }

  std::string lastFailure() {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_failure_;
  }

  // The bytes and files spilled now.
  std::pair<size_t, size_t> held() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {held_, files_};
  }

 private:
  struct Owned {
    std::string path;
    int lock_fd;
    long pid;
  };

  void failed(const std::string& why) {
    last_failure_ = why;
    if (!warned_) {
      warned_ = true;
      TORCH_WARN(
          "Large Model Support: the disk tier could not take a page-out: ",
          why,
          ". The host copy stays in pinned memory (nothing paged is lost); "
          "page-outs fall back to the host budget. Free space in the spill "
          "directory '",
          dir_,
          "', raise the bound (torch.cuda.set_spill_limit_lms(bytes), "
          "lms_spill_limit_mb:<MiB>), or name a larger local disk "
          "(torch.cuda.set_spill_dir_lms(path), lms_spill_dir:<path>).");
    }
  }

  // The staging buffer (pageable, kSpillChunk bytes), made on first use.
  char* staging() {
    if (!staging_) {
      void* p = nullptr;
      TORCH_CHECK(
          ::posix_memalign(&p, 4096, kSpillChunk) == 0,
          "Large Model Support: no memory for the disk tier's staging buffer");
      staging_.reset(static_cast<char*>(p));
    }
    return staging_.get();
  }

  // This process's subdirectory of `dir`, made (with its lock) if needed.
  std::string ownDir(const std::string& dir) {
    const long pid = static_cast<long>(::getpid());
    for (const Owned& own : owned_) {
      if (own.pid == pid &&
          own.path.compare(0, dir.size() + 1, dir + "/") == 0 &&
          own.path.find('/', dir.size() + 1) == std::string::npos) {
        own_pid_ = pid;
        return own.path;
      }
    }
    const std::string path = dir + "/" + kSpillPrefix + std::to_string(pid) +
        "." + std::to_string(startTime(pid));
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
      const int err = errno;
      TORCH_CHECK_VALUE(
          false,
          "Large Model Support: the spill directory '",
          dir,
          "' (torch.cuda.set_spill_dir_lms(), PYTORCH_CUDA_ALLOC_CONF key "
          "lms_spill_dir) is not writable by this process: making ",
          path,
          " failed: ",
          std::strerror(err),
          ". Name a directory on a local disk that you can write, e.g. "
          "torch.cuda.set_spill_dir_lms('/var/tmp') or lms_spill_dir:/var/tmp, "
          "or make this one writable (chmod u+w); '' turns the disk tier off.");
    }
    const int fd = ::open(
        (path + "/" + kSpillLock).c_str(),
        O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW,
        0600);
    TORCH_CHECK_VALUE(
        fd >= 0 && lockFile(fd),
        "Large Model Support: the spill directory '",
        dir,
        "' (lms_spill_dir) cannot hold the lock file of this process in ",
        path,
        ": ",
        std::strerror(errno),
        ". Name another directory on a local disk with "
        "torch.cuda.set_spill_dir_lms(path).");
    owned_.push_back({path, fd, pid});
    own_pid_ = pid;
    static const bool removed_at_exit = [] {
      // A function of its own rather than the store's destructor: storages
      // may die after static destructors have run, and the store must still
      // be there for them (store() is never destroyed).
      std::atexit([] { store().removeOwn(); });
      return true;
    }();
    (void)removed_at_exit;
    return path;
  }

  // Removes the subdirectories of `dir` whose owners have ended (this user's
  // only: another's cannot be removed, and is not ours to judge).
  void removeEnded(const std::string& dir) {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) {
      return;
    }
    std::vector<std::string> names;
    while (const dirent* entry = ::readdir(d)) {
      if (std::strncmp(
              entry->d_name, kSpillPrefix, std::strlen(kSpillPrefix)) == 0) {
        names.emplace_back(entry->d_name);
      }
    }
    ::closedir(d);
    const long self = static_cast<long>(::getpid());
    for (const std::string& name : names) {
      long pid = 0;
      unsigned long long start = 0;
      if (std::sscanf(
              name.c_str() + std::strlen(kSpillPrefix),
              "%ld.%llu",
              &pid,
              &start) != 2 ||
          pid == self) {
        continue;
      }
      const std::string path = dir + "/" + name;
      struct stat st {};
      if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
          st.st_uid != ::getuid()) {
        continue;
      }
      if (ownerEnded(path, pid, start)) {
        removeTree(path);
      }
    }
  }

  std::mutex mutex_;
  std::string dir_;
  std::string own_;
  long own_pid_ = 0;
  std::vector<Owned> owned_;
  size_t limit_ = 0;
  size_t held_ = 0;
  size_t files_ = 0;
  uint64_t serial_ = 0;
  bool warned_ = false;
  std::string last_failure_;
  struct FreeDeleter {
    void operator()(char* p) const {
      std::free(p);
    }
  };
  std::unique_ptr<char, FreeDeleter> staging_;
};

SpillStore& store() {
  // Never destroyed: late deleters of spilled storages may still use it.
  static SpillStore* const instance = new SpillStore();
  return *instance;
}

double msSince(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now() - begin)
      .count();
}

// Points the storage of a record at `ptr` (see pointAtHostCopy). The storage
// reference comes back in `keep_alive`.
void pointStorageAt(Record& r, void* ptr, StorageRef& keep_alive) {
  keep_alive = r.owner.lock();
  if (!keep_alive) {
    return;
  }
  c10::DataPtr& dp = keep_alive->_mutable_data_ptr_no_checks();
  if (dp.get_context() != &r || dp.get_deleter() != &deleteRecord) {
    return;
  }
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(ptr, ctx, &deleteRecord, device);
}

void countSpillOut(DeviceEngine& e, size_t bytes, double ms) {
  std::lock_guard<std::mutex> lock(e.mutex);
  ++e.stats.spill_count;
  e.stats.spill_out_bytes += static_cast<int64_t>(bytes);
  e.stats.spill_out_ms += ms;
  add(e.stats.spilled_bytes, static_cast<int64_t>(bytes));
}

void countSpillIn(DeviceEngine& e, size_t bytes, double ms) {
  std::lock_guard<std::mutex> lock(e.mutex);
  e.stats.spill_in_bytes += static_cast<int64_t>(bytes);
  e.stats.spill_in_ms += ms;
  add(e.stats.spilled_bytes, -static_cast<int64_t>(bytes));
}

// Writes the host copy of `r` (busy, off every list, its page-out copy
// done) to a file and gives its pinned buffer back to the pool. False,
// nothing changed, when the disk tier refuses it.
bool spillHostCopy(DeviceEngine& e, Record& r, StorageRef& keep_alive) {
  const auto begin = std::chrono::steady_clock::now();
  const char* src = static_cast<const char*>(r.host.ptr);
  std::string path;
  if (!store().write(
          r.size,
          [src](char* stage, size_t offset, size_t n) {
            std::memcpy(stage, src + offset, n);
          },
          path)) {
    return false;
  }
  countSpillOut(e, r.size, msSince(begin));
  pointStorageAt(r, nullptr, keep_alive);
  hostPool().release(r.host, nullptr, e.device);
  r.host = HostBuffer{};
  if (r.host_ready != nullptr) {
    e.events.put(r.host_ready);
    r.host_ready = nullptr;
  }
  r.spill_path = std::move(path);
  return true;
}

// Whether the page-out copy into `r`'s host buffer is done. Engine lock held.
bool hostCopyDone(Record& r) {
  if (r.host_ready == nullptr) {
    return true;
  }
  const cudaError_t err = cudaEventQuery(r.host_ready);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); // not an error: clear the sticky state
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

// The coldest paged-out record of `e` whose host copy may go to disk: first
// those with no known next use, earliest paged out first, then those the
// learned schedule expects, furthest next use first. Engine lock held.
Record* coldest(DeviceEngine& e) {
  const auto eligible = [](Record& r) {
    return r.state == State::PagedOut && !r.busy && !r.draining && !r.on_host &&
        r.host.ptr != nullptr && r.spill_path.empty() && hostCopyDone(r);
  };
  for (Record* r = e.pagedout_list.head; r != nullptr; r = r->next) {
    if (!r->upcoming && eligible(*r)) {
      return r;
    }
  }
  for (auto it = e.upcoming.rbegin(); it != e.upcoming.rend(); ++it) {
    if (it->second->list == &e.pagedout_list && eligible(*it->second)) {
      return it->second;
    }
  }
  return nullptr;
}

// Spills the coldest host copies of every device's engine (`first`'s
// first) until `wanted` bytes of pinned memory are back in the pool or none
// is left. Returns the pinned bytes given back.
size_t spillCold(DeviceEngine& first, size_t wanted) {
  std::vector<DeviceEngine*> engines{&first};
  {
    std::lock_guard<std::mutex> lock(g_engines_mutex);
    for (DeviceEngine* e : g_engines) {
      if (e != nullptr && e != &first) {
        engines.push_back(e);
      }
    }
  }
  size_t freed = 0;
  for (DeviceEngine* e : engines) {
    while (freed < wanted) {
      StorageRef keep_alive; // destroyed after the record is no longer busy
      Record* r = nullptr;
      {
        std::lock_guard<std::mutex> lock(e->mutex);
        r = coldest(*e);
        if (r == nullptr) {
          break;
        }
        e->pagedout_list.remove(r);
        removeUpcoming(*e, *r);
        r->busy = true;
      }
      const size_t capacity = r->host.capacity;
      bool ok = false;
      try {
        ok = spillHostCopy(*e, *r, keep_alive);
      } catch (...) {
        std::lock_guard<std::mutex> lock(e->mutex);
        r->busy = false;
        e->pagedout_list.push_back(r);
        addUpcoming(*e, *r);
        e->settled.notify_all();
        throw;
      }
      {
        std::lock_guard<std::mutex> lock(e->mutex);
        r->busy = false;
        e->pagedout_list.push_back(r);
        addUpcoming(*e, *r);
        e->settled.notify_all();
      }
      if (!ok) {
        return freed; // the disk tier is full: the others would fail too
      }
      freed += capacity;
    }
  }
  return freed;
}

} // namespace

// Whether a spill directory is set (new page-outs may go to disk).
bool spillEnabled() {
  return store().enabled();
}

// Pinned host memory for `size` bytes. With the disk tier on, a refusal
// first spills the coldest host copies (of `e`'s engine first) until the
// pool can give it; then, with `wait`, the host tier's wait for other
// processes. Without the tier, hostPool().allocate() as it is.
HostBuffer allocateHost(DeviceEngine& e, size_t size, bool wait) {
  if (!spillEnabled()) {
    return hostPool().allocate(size);
  }
  // The disk before a wait: what other processes hold may not come back
  // for a long time, and the disk always can take it.
  HostBuffer buffer = hostPool().allocate(size, /*wait=*/false);
  const size_t rounded = HostPool::roundSize(size);
  while (buffer.ptr == nullptr &&
         HostPool::lastRefusal().cause != HostRefusal::Cause::None &&
         spillCold(e, rounded) > 0) {
    buffer = hostPool().allocate(size, /*wait=*/false);
  }
  if (buffer.ptr == nullptr && wait) {
    buffer = hostPool().allocate(size);
  }
  return buffer;
}

// Writes the device contents of `r` (busy; `copy` ordered after its users)
// to a file of the disk tier, the host waiting for each chunk's copy. False,
// nothing changed, when the tier refuses it. The caller frees the memory.
bool pageOutToDisk(DeviceEngine& e, Record& r, cudaStream_t copy) {
  const auto begin = std::chrono::steady_clock::now();
  const char* src = static_cast<const char*>(r.device_ptr);
  std::string path;
  // Device to pageable memory: each copy returns once it is done.
  if (!store().write(
          r.size,
          [src, copy](char* stage, size_t offset, size_t n) {
            C10_CUDA_CHECK(cudaMemcpyAsync(
                stage, src + offset, n, cudaMemcpyDeviceToHost, copy));
            C10_CUDA_CHECK(cudaStreamSynchronize(copy));
          },
          path)) {
    return false;
  }
  countSpillOut(e, r.size, msSince(begin));
  r.spill_path = std::move(path);
  return true;
}

// Reads the spilled copy of `r` (busy) into device memory `ptr` on
// `stream`, then removes the file. Throws, the file kept, when it cannot be
// read.
void readSpilled(DeviceEngine& e, Record& r, void* ptr, cudaStream_t stream) {
  const auto begin = std::chrono::steady_clock::now();
  char* dst = static_cast<char*>(ptr);
  // Pageable memory to the device: each copy returns once the staging
  // buffer has been read.
  store().read(
      r.spill_path,
      r.size,
      [dst, stream](const char* stage, size_t o, size_t n) {
        C10_CUDA_CHECK(
            cudaMemcpyAsync(dst + o, stage, n, cudaMemcpyHostToDevice, stream));
      });
  store().remove(r.spill_path, r.size);
  r.spill_path.clear();
  countSpillIn(e, r.size, msSince(begin));
}

// Brings the spilled copy of `r` (busy, engine lock not held) back into a
// pinned host buffer, for an operator that uses it in host memory. Raises
// the host-memory error when no pinned memory can be had.
void restoreHostCopy(DeviceEngine& e, Record& r) {
  HostBuffer host = allocateHost(e, r.size, /*wait=*/true);
  if (host.ptr == nullptr) {
    t_host_refused = true;
    throwOutOfMemory(e, r.size);
  }
  const auto begin = std::chrono::steady_clock::now();
  char* dst = static_cast<char*>(host.ptr);
  try {
    store().read(
        r.spill_path, r.size, [dst](const char* stage, size_t o, size_t n) {
          std::memcpy(dst + o, stage, n);
        });
  } catch (...) {
    hostPool().release(host, nullptr, e.device);
    throw;
  }
  store().remove(r.spill_path, r.size);
  r.spill_path.clear();
  r.host = host;
  countSpillIn(e, r.size, msSince(begin));
}

// Removes the spilled copy of a record that dies (its deleter).
void removeSpilled(DeviceEngine& e, Record& r) {
  if (r.spill_path.empty()) {
    return;
  }
  store().remove(r.spill_path, r.size);
  r.spill_path.clear();
  std::lock_guard<std::mutex> lock(e.mutex);
  add(e.stats.spilled_bytes, -static_cast<int64_t>(r.size));
}

// What the host-memory error says of the disk tier: how to turn it on, or
// what it holds and why it took no more.
std::string spillNote(const LmsStats& stats) {
  const std::string dir = store().dir();
  if (dir.empty()) {
    return " Where device plus host memory cannot hold what the processes "
           "need, a spill directory on a local disk takes the coldest page-outs "
           "(torch.cuda.set_spill_dir_lms(path), lms_spill_dir:<path>).";
  }
  const auto [bytes, files] = store().held();
  const size_t limit = store().limit();
  const std::string failure = store().lastFailure();
  // The disk tier's bandwidth on this device so far, each way.
  const auto rate = [](int64_t moved, double ms) {
    if (moved <= 0 || ms <= 0) {
      return std::string("none timed");
    }
    char text[64];
    std::snprintf(
        text,
        sizeof(text),
        "%s at %.2f GB/s",
        mibText(static_cast<size_t>(moved)).c_str(),
        static_cast<double>(moved) / ms / 1e6);
    return std::string(text);
  };
  return " The disk tier (spill directory '" + dir + "') holds " +
      mibText(bytes) + " in " + std::to_string(files) + " files" +
      (limit != 0 ? " of a bound of " + mibText(limit) : std::string()) +
      "; written " + rate(stats.spill_out_bytes, stats.spill_out_ms) +
      ", read back " + rate(stats.spill_in_bytes, stats.spill_in_ms) +
      (failure.empty() ? std::string(".")
                       : "; it took no more: " + failure + ".");
}

} // namespace detail

using namespace detail;

void setSpillDir(std::string path) {
  store().setDir(path);
}

std::string getSpillDir() {
  return store().dir();
}

void setSpillLimit(size_t bytes) {
  store().setLimit(bytes);
}

size_t getSpillLimit() {
  return store().limit();
}

} // namespace c10::cuda::lms
