// LMS host tier suite: the budget for pinned host memory, the ledger that
// the LMS processes of a host share, and the out-of-memory error that a
// refused page-out becomes. Runs on the simulated GPU in CI and on a real GPU
// (the budgets it sets are small either way).
//
// `test_lms_host --hold-pinned MIB` is a second LMS process for the ledger
// tests: it pages out MIB of storages, prints "held BYTES", then follows the
// lines of its input, and exits at their end:
//   release           frees its storages and pinned buffers; "released"
//   release-after MS  the same after MS milliseconds
//   idle              frees its storages, their pinned buffers cached idle;
//                     "idle"
//   tick MS           for MS milliseconds, a pool operation every 10 ms (a
//                     page-out of a training step); "ticked"
//   limit MIB         sets its host budget
//   wait SECONDS      sets its host wait
//   more-after MS MIB after MS milliseconds pages out MIB more; "more BYTES
//                     WAIT" (the bytes paged out, and how a wait ended:
//                     HostRefusal::Wait), then, when refused, frees
//                     everything as a training script that ends with the
//                     error would; "released"
//
// `test_lms_host --device-peer` is another LMS process of the GPU for the
// device ledger tests: it takes a slot in the GPU's device ledger and follows
// the lines of its input, and exits at their end:
//   claim HELD NEED   publishes HELD and NEED MiB; "claimed TICKET"
//   wait MIB          says it waits for MIB; "waiting"
//   share POOL        its part of POOL MiB among the ledger's live
//                     processes (deviceShares); "share MIB"

#include "lms_test.h"
#include "lms_test_allocator.h"
#include "lms_test_data.h"
#include "lms_test_storage.h"

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/cuda/LargeModelSupportHostPool.h>
#include <c10/util/Exception.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10_compat.h>
#pragma GCC diagnostic pop

#include <cuda_runtime_api.h>

#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

// Test-control API of the simulated GPU. Weak: a real CUDA runtime has none
// of these, and the tests that need them skip.
extern "C" {
__attribute__((weak)) void simgpu_inject_fault(
    int kind,
    int nth,
    int count,
    cudaError_t error);
__attribute__((weak)) void simgpu_clear_faults(void);
__attribute__((weak)) void simgpu_set_copy_bandwidth(double bytes_per_second);
__attribute__((weak)) size_t simgpu_call_count(const char* function);
}

namespace {

namespace lms = c10::cuda::lms;
namespace cca = c10::cuda::CUDACachingAllocator;
using lms_test::StoragePtr;

constexpr size_t kMiB = 1024 * 1024;
constexpr size_t kGiB = 1024 * kMiB;

int deviceCount() {
  int n = 0;
  C10_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

void initAllocator() {
  static bool initialized = [] {
    cca::init(deviceCount());
    return true;
  }();
  (void)initialized;
}

using lms_test::newStorage;

using lms_test::matches;
using lms_test::stream;
using lms_test::write;

bool contains(const std::string& text, const std::string& part) {
  const bool found = text.find(part) != std::string::npos;
  if (!found) {
    std::fprintf(stderr, "  '%s' not in: %s\n", part.c_str(), text.c_str());
  }
  return found;
}

// LMS on, no device limit of its own, a host budget of `host_limit` bytes
// (0: derived) and a host wait of `wait_s` seconds for the scope; on the way
// out the budget is derived again and every pinned buffer of the test is gone.
class HostEnv {
 public:
  explicit HostEnv(size_t host_limit, double wait_s = 0) {
    initAllocator();
    c10::cuda::set_device(0);
    lms::setEnabled(true);
    lms::setSizeThreshold(1 * kMiB);
    lms::setPrefetchDepth(0);
    lms::setSpeculativeMargin(0);
    lms::setLimit(0, size_t(1) << 50);
    cca::emptyCache(); // no pinned buffer of an earlier test stays cached
    lms::resetAccumulatedStats(0);
    lms::resetPeakStats(0);
    lms::setHostLimit(host_limit);
    lms::setHostWait(wait_s);
  }
  ~HostEnv() {
    lms::setHostLimit(0);
    lms::setHostWait(lms::kDefaultHostWaitSeconds);
  }
  HostEnv(const HostEnv&) = delete;
  HostEnv& operator=(const HostEnv&) = delete;

  // Call after every storage of the test is gone.
  void checkBaseline() {
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_EQ(lms::getStats(0).managed_bytes.current, 0);
    cca::emptyCache(); // also frees LMS's idle pinned host buffers
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.host_bytes.current, 0);
    CHECK_EQ(st.host_ledger_bytes, 0);
  }
};

// ---------------------------------------------------------------------------
// A second LMS process
// ---------------------------------------------------------------------------

// This binary run with --hold-pinned, talked to through pipes. Killed at the
// end of the scope if it still runs.
class Peer {
 public:
  explicit Peer(size_t mib)
      : Peer(std::vector<std::string>{"--hold-pinned", std::to_string(mib)}) {}
  explicit Peer(const std::vector<std::string>& args) {
    int to_child[2];
    int from_child[2];
    REQUIRE(::pipe(to_child) == 0 && ::pipe(from_child) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    const std::string self = "/proc/self/exe";
    std::vector<char*> argv = {const_cast<char*>(self.c_str())};
    for (const std::string& arg : args) {
      argv.push_back(const_cast<char*>(arg.c_str()));
    }
    argv.push_back(nullptr);
    const int err = posix_spawn(
        &pid_, self.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(to_child[0]);
    ::close(from_child[1]);
    to_ = to_child[1];
    from_ = ::fdopen(from_child[0], "r");
    REQUIRE(err == 0 && from_ != nullptr);
  }
  ~Peer() {
    if (to_ >= 0) {
      ::close(to_);
    }
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      (void)::waitpid(pid_, nullptr, 0);
    }
    if (from_ != nullptr) {
      std::fclose(from_);
    }
  }
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  // The next line the peer prints (empty at its end).
  std::string readLine() {
    char line[256];
    if (std::fgets(line, sizeof(line), from_) == nullptr) {
      return std::string();
    }
    std::string text(line);
    while (!text.empty() && text.back() == '\n') {
      text.pop_back();
    }
    return text;
  }

  void say(const char* line) {
    const size_t n = std::strlen(line);
    REQUIRE(::write(to_, line, n) == static_cast<ssize_t>(n));
  }

  // Ends the peer the way the OOM killer does: no cleanup of any kind.
  void killHard() {
    ::kill(pid_, SIGKILL);
    (void)::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // Ends the peer's input and waits for it to exit; its exit status.
  int finish() {
    ::close(to_);
    to_ = -1;
    int status = 0;
    (void)::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  FILE* from_ = nullptr;
};

// The peer's side (see the top of the file).
int holdPinned(size_t mib) {
  try {
    initAllocator();
    c10::cuda::set_device(0);
    lms::setEnabled(true);
    std::vector<StoragePtr> storages;
    for (size_t i = 0; i < mib / 4; ++i) {
      storages.push_back(newStorage(4 * kMiB));
      write(*storages.back(), i);
    }
    lms::reclaimInactive(0);
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    std::printf("held %lld\n", (long long)lms::getStats(0).host_bytes.current);
    std::fflush(stdout);
    const auto say = [](const std::string& text) {
      std::printf("%s\n", text.c_str());
      std::fflush(stdout);
    };
    const auto release = [&] {
      storages.clear();
      cca::emptyCache(); // frees the pinned buffers: cudaFreeHost
      say("released");
    };
    const auto sleepMs = [](long ms) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    };
    char line[64];
    while (std::fgets(line, sizeof(line), stdin) != nullptr) {
      long a = 0;
      long b = 0;
      double seconds = 0;
      if (std::sscanf(line, "release-after %ld", &a) == 1) {
        sleepMs(a);
        release();
      } else if (std::strncmp(line, "release", 7) == 0) {
        release();
      } else if (std::strncmp(line, "idle", 4) == 0) {
        storages.clear();
        C10_CUDA_CHECK(cudaDeviceSynchronize());
        say("idle");
      } else if (std::sscanf(line, "tick %ld", &a) == 1) {
        const auto end =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(a);
        while (std::chrono::steady_clock::now() < end) {
          lms::HostBuffer buffer = lms::hostPool().allocate(4096);
          if (buffer.ptr != nullptr) {
            lms::hostPool().release(buffer, nullptr, 0);
          }
          sleepMs(10);
        }
        say("ticked");
      } else if (std::sscanf(line, "limit %ld", &a) == 1) {
        lms::setHostLimit(static_cast<size_t>(a) * kMiB);
      } else if (std::sscanf(line, "wait %lf", &seconds) == 1) {
        lms::setHostWait(seconds);
      } else if (std::sscanf(line, "more-after %ld %ld", &a, &b) == 2) {
        sleepMs(a);
        for (long i = 0; i < b / 4; ++i) {
          storages.push_back(newStorage(4 * kMiB));
          write(*storages.back(), 1000 + i);
        }
        const size_t paged = lms::reclaimInactive(0);
        say("more " + std::to_string(paged) + " " +
            std::to_string(static_cast<int>(
                paged == 0 ? lms::HostPool::lastRefusal().wait
                           : lms::HostRefusal::Wait::None)));
        if (paged == 0) {
          release();
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
    std::fflush(stdout);
    return 1;
  }
}

// The name the engine gives the device ledger of device 0's GPU.
std::string deviceLedgerPath() {
  return lms::DeviceLedger::pathForDevice(0);
}

// The device peer's side (see the top of the file).
int devicePeer() {
  lms::DeviceLedger ledger(deviceLedgerPath());
  size_t held = 0;
  size_t need = 0;
  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    long a = 0;
    long b = 0;
    if (std::sscanf(line, "claim %ld %ld", &a, &b) == 2) {
      held = static_cast<size_t>(a) * kMiB;
      need = static_cast<size_t>(b) * kMiB;
      lms::DeviceClaim own;
      (void)ledger.update(held, need, &own);
      std::printf("claimed %llu\n", (unsigned long long)own.ticket);
    } else if (std::sscanf(line, "share %ld", &a) == 1) {
      lms::DeviceClaim own;
      const std::vector<lms::DeviceLedger::Peer> peers =
          ledger.update(held, need, &own);
      std::vector<lms::DeviceClaim> claims{own};
      for (const lms::DeviceLedger::Peer& peer : peers) {
        claims.push_back(peer.claim);
      }
      const std::vector<size_t> parts =
          lms::deviceShares(static_cast<size_t>(a) * kMiB, claims);
      std::printf("share %llu\n", (unsigned long long)(parts[0] / kMiB));
    } else if (std::sscanf(line, "wait %ld", &a) == 1) {
      (void)ledger.update(held, need, nullptr);
      std::printf(
          "%s\n",
          ledger.setWaiting(static_cast<size_t>(a) * kMiB) ? "waiting"
                                                           : "unshared");
    }
    std::fflush(stdout);
  }
  return 0;
}

// ---------------------------------------------------------------------------
// Fixture files for the readers
// ---------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    char name[] = "/tmp/lms-host-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path_ = name;
  }
  ~TempDir() {
    const std::string command = "rm -rf '" + path_ + "'";
    // Best effort; glibc marks system() warn_unused_result, which a (void)
    // cast does not silence in g++.
    const int status = std::system(command.c_str());
    (void)status;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const {
    return path_;
  }
  // Writes `text` to `relative` (its folders made as needed).
  std::string file(const std::string& relative, const std::string& text) {
    std::string dir = path_;
    size_t at = 0;
    while ((at = relative.find('/', at)) != std::string::npos) {
      dir = path_ + "/" + relative.substr(0, at);
      ::mkdir(dir.c_str(), 0700);
      ++at;
    }
    const std::string full = path_ + "/" + relative;
    std::ofstream(full) << text;
    return full;
  }

 private:
  std::string path_;
};

// ---------------------------------------------------------------------------

TEST_CASE(meminfo_reader_takes_total_and_available) {
  TempDir dir;
  lms::HostMemory memory;
  CHECK(lms::readMemInfo(
      dir.file(
          "meminfo",
          "MemTotal:       131072000 kB\n"
          "MemFree:         1024000 kB\n"
          "MemAvailable:   65536000 kB\n"
          "Buffers:          204800 kB\n"),
      memory));
  CHECK_EQ(memory.total, size_t(131072000) * 1024);
  CHECK_EQ(memory.available, size_t(65536000) * 1024);

  lms::HostMemory untouched;
  CHECK(!lms::readMemInfo(
      dir.file("old", "MemTotal: 1000 kB\nMemFree: 10 kB\n"), untouched));
  CHECK(!lms::readMemInfo(dir.path() + "/missing", untouched));
  CHECK_EQ(untouched.total, size_t(0));
}

TEST_CASE(cgroup_v2_limit_binds_at_the_tightest_level) {
  TempDir dir;
  const std::string proc = dir.file("self-cgroup", "0::/user.slice/job\n");
  dir.file("fs/memory.current", "123\n"); // the root has no memory.max
  dir.file("fs/user.slice/memory.max", "max\n");
  dir.file("fs/user.slice/memory.current", "7516192768\n");
  dir.file("fs/user.slice/job/memory.max", "8589934592\n");
  dir.file("fs/user.slice/job/memory.current", "6442450944\n");
  dir.file(
      "fs/user.slice/job/memory.stat",
      "anon 4294967296\nfile 2147483648\ninactive_file 1073741824\n");
  lms::HostMemory memory;
  lms::readCgroup(proc, dir.path() + "/fs", memory);
  // 8 GiB limit, 6 GiB used of which 1 GiB inactive file pages: 3 GiB room.
  CHECK_EQ(memory.cgroup_limit, 8 * kGiB);
  CHECK_EQ(memory.cgroup_room, 3 * kGiB);
  CHECK(memory.cgroup_path == "/user.slice/job");
  CHECK(memory.cgroup_id != 0);

  // A parent whose limit leaves less room binds instead.
  dir.file("fs/user.slice/memory.max", "8053063680\n"); // 7.5 GiB
  lms::HostMemory tighter;
  lms::readCgroup(proc, dir.path() + "/fs", tighter);
  CHECK_EQ(tighter.cgroup_limit, size_t(8053063680));
  CHECK_EQ(tighter.cgroup_room, kGiB / 2);
  CHECK(tighter.cgroup_path == "/user.slice");
  CHECK_EQ(tighter.cgroup_id, memory.cgroup_id); // the process's cgroup

  // "max" everywhere: no limit.
  dir.file("fs/user.slice/memory.max", "max\n");
  dir.file("fs/user.slice/job/memory.max", "max\n");
  lms::HostMemory none;
  lms::readCgroup(proc, dir.path() + "/fs", none);
  CHECK_EQ(none.cgroup_limit, lms::kNoHostLimit);
  CHECK_EQ(none.cgroup_room, lms::kNoHostLimit);
}

TEST_CASE(cgroup_v1_memory_controller_and_container_root) {
  TempDir dir;
  const std::string proc = dir.file(
      "self-cgroup",
      "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n0::/\n");
  dir.file("fs/memory/memory.limit_in_bytes", "9223372036854771712\n");
  dir.file("fs/memory/memory.usage_in_bytes", "50000000000\n");
  dir.file("fs/memory/docker/abc/memory.limit_in_bytes", "4294967296\n");
  dir.file("fs/memory/docker/abc/memory.usage_in_bytes", "3221225472\n");
  dir.file(
      "fs/memory/docker/abc/memory.stat",
      "cache 1073741824\ninactive_file 1\ntotal_inactive_file 536870912\n");
  lms::HostMemory memory;
  lms::readCgroup(proc, dir.path() + "/fs", memory);
  // 4 GiB limit, 3 GiB used of which 0.5 GiB inactive file pages; the root's
  // huge "limit" is none.
  CHECK_EQ(memory.cgroup_limit, 4 * kGiB);
  CHECK_EQ(memory.cgroup_room, kGiB + kGiB / 2);
  CHECK(memory.cgroup_path == "/docker/abc");

  // A container without a cgroup namespace sees its own cgroup at the mount
  // while /proc/self/cgroup names the host's path.
  TempDir container;
  const std::string proc2 =
      container.file("self-cgroup", "11:memory:/docker/abc\n");
  container.file("fs/memory/memory.limit_in_bytes", "2147483648\n");
  container.file("fs/memory/memory.usage_in_bytes", "1073741824\n");
  lms::HostMemory inside;
  lms::readCgroup(proc2, container.path() + "/fs", inside);
  CHECK_EQ(inside.cgroup_limit, 2 * kGiB);
  CHECK_EQ(inside.cgroup_room, kGiB);
  CHECK(inside.cgroup_path == "/");

  // No cgroup file: nothing changes.
  lms::HostMemory untouched;
  lms::readCgroup(dir.path() + "/missing", dir.path() + "/fs", untouched);
  CHECK_EQ(untouched.cgroup_room, lms::kNoHostLimit);
  CHECK_EQ(untouched.cgroup_id, uint64_t(0));
}

TEST_CASE(budget_is_available_plus_pinned_less_the_reserve) {
  CHECK_EQ(lms::hostReserve(128 * kGiB), 128 * kGiB / 20); // 5%
  CHECK_EQ(lms::hostReserve(16 * kGiB), 2 * kGiB); // at least 2 GiB
  CHECK_EQ(lms::hostReserve(4 * kGiB), kGiB / 2); // an eighth of a small one

  lms::HostMemory memory;
  memory.total = 128 * kGiB;
  memory.available = 60 * kGiB;
  lms::HostLedger::Totals held;
  held.all = 10 * kGiB;
  held.own = 6 * kGiB;
  held.cgroup = 8 * kGiB;
  lms::HostBudget budget = lms::deriveHostBudget(memory, held);
  lms::HostBudget::Source source = lms::HostBudget::Source::None;
  // MemAvailable no longer counts the 10 GiB LMS processes pinned.
  CHECK_EQ(budget.host_bytes, 70 * kGiB - 128 * kGiB / 20);
  CHECK_EQ(budget.inForce(held, &source), budget.host_bytes);
  CHECK(source == lms::HostBudget::Source::MemAvailable);

  // Within a cgroup of 32 GiB that has 4 GiB of room: 4 GiB + the 8 GiB its
  // LMS processes pinned - 2 GiB, and the 2 GiB pinned outside it take none
  // of that room.
  memory.cgroup_limit = 32 * kGiB;
  memory.cgroup_room = 4 * kGiB;
  budget = lms::deriveHostBudget(memory, held);
  CHECK_EQ(budget.cgroup_bytes, 10 * kGiB);
  CHECK_EQ(budget.inForce(held, &source), 12 * kGiB);
  CHECK(source == lms::HostBudget::Source::Cgroup);
  lms::HostLedger::Totals later = held; // a process outside pinned 1 GiB more
  later.all += kGiB;
  CHECK_EQ(budget.inForce(later), 13 * kGiB);

  budget.setting = 3 * kGiB;
  CHECK_EQ(budget.inForce(held, &source), 3 * kGiB);
  CHECK(source == lms::HostBudget::Source::Setting);

  // No reading at all: no budget.
  budget = lms::deriveHostBudget(lms::HostMemory{}, held);
  CHECK_EQ(budget.inForce(held, &source), lms::kNoHostLimit);
  CHECK(source == lms::HostBudget::Source::None);
}

// The message says where a derived budget comes from, with its figures.
TEST_CASE(refusal_message_names_the_budget_source) {
  lms::HostMemory memory;
  memory.total = 64 * kGiB;
  memory.available = 10 * kGiB;
  lms::HostLedger::Totals held;
  held.all = 6 * kGiB;
  held.own = 2 * kGiB;
  held.cgroup = 6 * kGiB;
  lms::HostRefusal refusal;
  refusal.cause = lms::HostRefusal::Cause::Budget;
  refusal.bytes = 256 * kMiB;
  refusal.held = held;
  refusal.reading = lms::deriveHostBudget(memory, held);
  refusal.budget = refusal.reading.inForce(held, &refusal.source);
  refusal.ledger_path = "/dev/shm/ledger";
  std::string text = lms::describeHostRefusal(refusal);
  CHECK(contains(text, "no room for a page-out of 256.00 MiB"));
  CHECK(contains(
      text,
      "hold 6144.00 MiB (this process 2048.00 MiB, other LMS processes "
      "4096.00 MiB) of a budget of 13107.20 MiB, derived from /proc/meminfo: "
      "MemAvailable 10240.00 MiB + 6144.00 MiB pinned by LMS processes - a "
      "reserve of 3276.80 MiB"));
  CHECK(contains(text, "torch.cuda.set_host_limit_lms(bytes)"));
  CHECK(text.find("could not use the host ledger") == std::string::npos);

  memory.cgroup_limit = 16 * kGiB;
  memory.cgroup_room = kGiB;
  memory.cgroup_path = "/slurm/job_42";
  refusal.reading = lms::deriveHostBudget(memory, held);
  refusal.budget = refusal.reading.inForce(held, &refusal.source);
  refusal.ledger_path.clear(); // this process's accounting alone
  text = lms::describeHostRefusal(refusal);
  CHECK(contains(
      text,
      "of a budget of 5120.00 MiB, derived from the memory limit of cgroup "
      "/slurm/job_42: 1024.00 MiB of its limit of 16384.00 MiB not in use + "
      "6144.00 MiB pinned by its LMS processes - a reserve of 2048.00 MiB"));
  CHECK(contains(text, "could not use the host ledger"));
}

// Pinning itself fails (the host, or the locked-memory limit, has no
// more): the error names host memory too.
TEST_CASE(failed_pinned_allocation_raises_oom_naming_host_memory) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("needs the simulated GPU's fault injection");
  }
  HostEnv env(0);
  {
    const lms_test::AllocatorCap cap(32 * kMiB);
    simgpu_inject_fault(1 /*host alloc*/, 1, -1, cudaSuccess);
    std::vector<StoragePtr> s;
    std::string message;
    for (int i = 0; i < 16 && message.empty(); ++i) {
      try {
        s.push_back(newStorage(4 * kMiB));
        write(*s.back(), i);
      } catch (const c10::OutOfMemoryError& e) {
        message = e.what();
      }
    }
    simgpu_clear_faults();
    REQUIRE(!message.empty());
    CHECK(contains(message, "host memory ran out"));
    CHECK(contains(message, "could not pin 4.00 MiB"));
    // The verdict an operator that caught the error would be warned with.
    CHECK(contains(lms::lastOutOfMemoryVerdict(), "Host memory ran out"));
    CHECK_EQ(lms::getStats(0).host_refusals, 0); // not the budget's doing
    int mismatches = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      mismatches += !matches(*s[i], i);
    }
    CHECK_EQ(mismatches, 0);
  }
  env.checkBaseline();
}

TEST_CASE(conf_key_sets_the_host_limit) {
  HostEnv env(0);
  CHECK_EQ(lms::getHostLimit(), size_t(0));
  lms::parseConfig("expandable_segments:True,lms_host_limit_mb:64");
  CHECK_EQ(lms::getHostLimit(), 64 * kMiB);
  CHECK(lms::parseConfigOption("lms_host_limit_mb", "0.5"));
  CHECK_EQ(lms::getHostLimit(), kMiB / 2);
  CHECK_THROWS_AS(
      lms::parseConfigOption("lms_host_limit_mb", "-1"),
      c10::Error,
      "non-negative number");
  CHECK_THROWS_AS(
      lms::parseConfig("lms_host_limit:1", true, "PYTORCH_LMS_CONF"),
      c10::Error,
      "lms_host_limit_mb");
  lms::setHostLimit(0);
  CHECK_EQ(lms::getHostLimit(), size_t(0));
}

TEST_CASE(statistics_report_the_budget_and_the_ledger) {
  HostEnv env(0);
  {
    // Derived from this host: something, and no more than it has.
    lms::HostMemory memory;
    const lms::LmsStats derived = lms::getStats(0);
    if (lms::readMemInfo("/proc/meminfo", memory)) {
      CHECK(derived.host_budget_bytes > 0);
      CHECK_LE(derived.host_budget_bytes, static_cast<int64_t>(memory.total));
    }
    lms::setHostLimit(48 * kMiB);
    auto s = newStorage(4 * kMiB);
    write(*s, 1);
    CHECK_EQ(lms::reclaimInactive(0), 4 * kMiB);
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.host_budget_bytes, int64_t(48 * kMiB));
    CHECK_EQ(st.host_ledger_bytes, int64_t(4 * kMiB));
    CHECK_EQ(st.host_refusals, 0);
    CHECK(matches(*s, 1));
  }
  env.checkBaseline();
}

// Large buffers are pinned another way (populated, then registered): the
// ledger counts them, and gives them back when they are freed, all the same.
TEST_CASE(large_registered_buffers_are_counted_and_returned) {
  HostEnv env(80 * kMiB);
  {
    auto big = newStorage(64 * kMiB);
    write(*big, 5);
    CHECK_EQ(lms::reclaimInactive(0), 64 * kMiB);
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(64 * kMiB));
    auto more = newStorage(32 * kMiB);
    write(*more, 6);
    CHECK(matches(*big, 5)); // paged in: its buffer goes back to the cache
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    // 32 MiB more would pass the budget with the idle 64 MiB buffer, which
    // is freed first: no refusal.
    CHECK_EQ(lms::reclaimBytes(0, 32 * kMiB), 32 * kMiB);
    CHECK(lms::getState(*more) == lms::StorageState::PagedOut);
    lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.host_refusals, 0);
    CHECK_EQ(st.host_ledger_bytes, int64_t(32 * kMiB));
    // 64 MiB more would pass it with nothing idle to free.
    CHECK_EQ(lms::reclaimInactive(0), size_t(0));
    st = lms::getStats(0);
    CHECK_EQ(st.host_refusals, 1);
    CHECK_EQ(st.host_ledger_bytes, int64_t(32 * kMiB));
    CHECK(matches(*more, 6));
    CHECK(matches(*big, 5));
  }
  env.checkBaseline();
}

// Buffers of 4 MiB and more (a first iteration under a cap pins hundreds of
// tens of MiB) are pinned by populating and registering memory, on a thread
// per 8 MiB; smaller ones with cudaHostAlloc. Both come back to zero.
TEST_CASE(buffers_from_4_mib_are_registered_smaller_ones_allocated) {
  if (simgpu_call_count == nullptr) {
    SKIP("needs the simulated GPU's call counts");
  }
  HostEnv env(0);
  {
    const size_t registers = simgpu_call_count("cudaHostRegister");
    const size_t allocs = simgpu_call_count("cudaHostAlloc");
    auto mid = newStorage(4 * kMiB);
    auto small = newStorage(2 * kMiB);
    write(*mid, 3);
    write(*small, 4);
    CHECK_EQ(lms::reclaimInactive(0), 6 * kMiB);
    CHECK_EQ(simgpu_call_count("cudaHostRegister") - registers, size_t(1));
    CHECK_EQ(simgpu_call_count("cudaHostAlloc") - allocs, size_t(1));
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(6 * kMiB));
    CHECK(matches(*mid, 3));
    CHECK(matches(*small, 4));
  }
  env.checkBaseline();
}

// A page-out that needs a new pinned buffer counts it and the time pinning it
// took; one that reuses a cached buffer counts neither.
TEST_CASE(new_pinned_buffers_and_their_time_are_counted) {
  HostEnv env(80 * kMiB);
  {
    const lms::LmsStats before = lms::getStats(0);
    auto a = newStorage(64 * kMiB);
    write(*a, 7);
    CHECK_EQ(lms::reclaimInactive(0), 64 * kMiB);
    const lms::LmsStats pinned = lms::getStats(0);
    CHECK_EQ(pinned.host_pin_count - before.host_pin_count, 1);
    CHECK(pinned.host_pin_ms > before.host_pin_ms);
    CHECK(matches(*a, 7)); // paged in: its buffer goes back to the cache
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_EQ(lms::reclaimInactive(0), 64 * kMiB);
    const lms::LmsStats reused = lms::getStats(0);
    CHECK_EQ(reused.host_pin_count, pinned.host_pin_count);
    CHECK_EQ(reused.host_pin_ms, pinned.host_pin_ms);
    CHECK(matches(*a, 7));
  }
  env.checkBaseline();
}

// A host ahead of its copies: under a budget of one 8 MiB buffer, B's page-in
// (copied at 100 MB/s, about 84 ms) has released the pool's only buffer but
// still reads it when A's page-out needs one. The page-out waits for that
// copy and reuses the buffer instead of being refused (which would leave the
// device over its limit, or fail).
TEST_CASE(a_refused_page_out_waits_for_the_pools_own_copy_in_flight) {
  if (simgpu_set_copy_bandwidth == nullptr) {
    SKIP("needs the simulated GPU's copy bandwidth to keep a copy in flight");
  }
  HostEnv env(8 * kMiB);
  {
    auto a = newStorage(8 * kMiB);
    auto b = newStorage(8 * kMiB);
    write(*b, 2); // B is used longest ago
    write(*a, 1);
    CHECK_EQ(lms::reclaimBytes(0, 8 * kMiB), 8 * kMiB);
    REQUIRE(lms::getState(*b) == lms::StorageState::PagedOut);
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    const lms::LmsStats before = lms::getStats(0);
    simgpu_set_copy_bandwidth(100e6);
    lms::pin(*b); // its buffer goes back to the cache, read until the copy ends
    lms::unpin(*b);
    CHECK_EQ(lms::reclaimBytes(0, 8 * kMiB), 8 * kMiB); // A, least recent
    simgpu_set_copy_bandwidth(0);
    const lms::LmsStats after = lms::getStats(0);
    CHECK(lms::getState(*a) == lms::StorageState::PagedOut);
    CHECK_EQ(after.host_refusals, before.host_refusals);
    CHECK_EQ(after.host_copy_wait_count - before.host_copy_wait_count, 1);
    CHECK(after.host_copy_wait_ms > before.host_copy_wait_ms);
    CHECK_EQ(after.host_pin_count, before.host_pin_count);
    CHECK(matches(*a, 1));
    CHECK(matches(*b, 2));
  }
  env.checkBaseline();
}

// A loop of page-outs needs more pinned memory than the budget: the
// allocation that needs the room raises OutOfMemoryError naming host memory,
// nothing is lost, and once memory is freed allocations succeed again.
TEST_CASE(host_budget_refusal_raises_oom_naming_host_memory) {
  HostEnv env(24 * kMiB);
  {
    const lms_test::AllocatorCap cap(32 * kMiB);
    std::vector<StoragePtr> s;
    std::string message;
    for (int i = 0; i < 40 && message.empty(); ++i) { // 160 MiB wanted
      try {
        s.push_back(newStorage(4 * kMiB));
        write(*s.back(), i);
      } catch (const c10::OutOfMemoryError& e) {
        message = e.what();
      }
    }
    REQUIRE(!message.empty());
    CHECK(contains(message, "host memory ran out"));
    CHECK(contains(message, "Tried to allocate 4.00 MiB on device 0"));
    CHECK(contains(
        message,
        "hold 24.00 MiB (this process 24.00 MiB, other LMS processes "
        "0.00 MiB) of a budget of 24.00 MiB, set with "
        "torch.cuda.set_host_limit_lms()"));
    CHECK(contains(message, "PYTORCH_CUDA_ALLOC_CONF=lms_host_limit_mb:"));
    CHECK(contains(message, "smaller batch"));
    const lms::LmsStats st = lms::getStats(0);
    CHECK(st.host_refusals >= 1);
    CHECK(st.oom_count >= 1);
    CHECK_EQ(st.host_ledger_bytes, int64_t(24 * kMiB));
    CHECK_EQ(st.host_bytes.peak, int64_t(24 * kMiB));
    CHECK_EQ(st.pageout_count, 6); // the budget's worth

    // Nothing lost: with a little room on the device again, every storage
    // reads back as written.
    s.resize(s.size() - 2);
    int mismatches = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      mismatches += !matches(*s[i], i);
    }
    CHECK_EQ(mismatches, 0);

    // Once half of them are freed, training goes on.
    const size_t kept = s.size() / 2;
    s.resize(kept);
    for (int i = 0; i < 6; ++i) {
      s.push_back(newStorage(4 * kMiB));
      write(*s.back(), 100 + i);
    }
    for (size_t i = 0; i < s.size(); ++i) {
      mismatches += !matches(*s[i], i < kept ? i : 100 + (i - kept));
    }
    CHECK_EQ(mismatches, 0);
    CHECK_LE(lms::getStats(0).host_ledger_bytes, int64_t(24 * kMiB));
  }
  env.checkBaseline();
}

// An operator whose inputs cannot all be resident under the cap leaves the
// one the device cannot hold in its host copy, which asks nothing more of the
// host; what the operator then allocates and the device cannot hold goes to
// pinned host memory within the budget. Under a 64 MiB cap and a 76 MiB
// budget, the 72 MiB of paged-out inputs (A 12, B 20, C 40 MiB) fit, C stays
// on the host for the operator, and a 40 MiB output has room neither on the
// device (A and B are pinned there) nor on the host (C and it would hold
// 80 MiB): the error names host memory, and nothing is lost.
TEST_CASE(an_operator_over_the_cap_and_the_host_budget_raises_naming_host) {
  HostEnv env(76 * kMiB);
  const char* name = "lms_test::over_the_device_and_the_host";
  {
    const lms_test::AllocatorCap cap(64 * kMiB);
    auto a = newStorage(12 * kMiB);
    write(*a, 1);
    auto b = newStorage(20 * kMiB);
    write(*b, 2);
    auto c = newStorage(40 * kMiB);
    write(*c, 3);
    lms::reclaimInactive(0);
    c10::StorageImpl* inputs[] = {a.get(), b.get(), c.get()};
    for (c10::StorageImpl* input : inputs) {
      REQUIRE(lms::getState(*input) == lms::StorageState::PagedOut);
    }
    lms::beginWorkingSet(name, inputs);
    for (c10::StorageImpl* input : inputs) {
      lms::pin(*input); // smallest first: C has no room
    }
    CHECK_EQ(lms::getStats(0).input_host_placement_count, 1);
    CHECK_EQ(lms::getStats(0).host_refusals, 0);
    std::string message;
    try {
      auto y = newStorage(40 * kMiB);
    } catch (const c10::OutOfMemoryError& e) {
      message = e.what();
    }
    REQUIRE(!message.empty());
    CHECK(contains(message, "host memory ran out"));
    CHECK(contains(message, "Tried to allocate 40.00 MiB on device 0"));
    CHECK(contains(message, "host placement could not place in pinned host"));
    CHECK(contains(message, "of a budget of 76.00 MiB"));
    CHECK(contains(
        lms::lastOutOfMemoryVerdict(),
        "Host memory ran out: the device had no room for the request"));
    CHECK(lms::getStats(0).host_refusals >= 1);
    for (c10::StorageImpl* input : inputs) {
      lms::unpin(*input);
    }
    lms::endWorkingSet(name);
    CHECK(lms::getState(*c) == lms::StorageState::PagedOut);
    CHECK(matches(*c, 3));
    CHECK(matches(*a, 1));
    CHECK(matches(*b, 2));
  }
  env.checkBaseline();
}

// Idle cached buffers of another size count against the budget: the pool
// frees them before it refuses anything.
TEST_CASE(idle_cached_buffers_are_freed_before_a_refusal) {
  HostEnv env(16 * kMiB);
  {
    {
      auto a = newStorage(8 * kMiB);
      auto b = newStorage(8 * kMiB);
      write(*a, 1);
      write(*b, 2);
      CHECK_EQ(lms::reclaimInactive(0), 16 * kMiB);
    } // their pinned buffers stay cached, idle
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(16 * kMiB));
    auto c = newStorage(2 * kMiB);
    write(*c, 3);
    CHECK_EQ(lms::reclaimInactive(0), 2 * kMiB);
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.host_refusals, 0);
    CHECK_EQ(st.host_bytes.current, int64_t(2 * kMiB));
    CHECK_EQ(st.host_ledger_bytes, int64_t(2 * kMiB));
    CHECK(matches(*c, 3));
  }
  env.checkBaseline();
}

// Two LMS processes of one host see each other's pinned bytes, and the
// second is refused once their sum would pass the budget.
TEST_CASE(processes_share_the_ledger_and_its_budget) {
  HostEnv env(0);
  {
    Peer peer(16);
    const std::string held = peer.readLine();
    REQUIRE(held == "held " + std::to_string(16 * kMiB));
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(16 * kMiB));

    std::vector<StoragePtr> s;
    for (int i = 0; i < 4; ++i) {
      s.push_back(newStorage(4 * kMiB));
      write(*s.back(), i);
    }
    // Room for 16 MiB of the peer and 12 of this process.
    lms::setHostLimit(28 * kMiB);
    for (int i = 0; i < 3; ++i) {
      CHECK_EQ(lms::reclaimBytes(0, 4 * kMiB), 4 * kMiB);
    }
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(28 * kMiB));
    CHECK_EQ(lms::reclaimInactive(0), size_t(0)); // the fourth is refused
    CHECK(lms::getState(*s[3]) == lms::StorageState::Inactive);
    const lms::HostRefusal& refusal = lms::HostPool::lastRefusal();
    CHECK(refusal.cause == lms::HostRefusal::Cause::Budget);
    CHECK(contains(
        lms::describeHostRefusal(refusal),
        "hold 28.00 MiB (this process 12.00 MiB, other LMS processes "
        "16.00 MiB) of a budget of 28.00 MiB"));
    CHECK_EQ(lms::getStats(0).host_refusals, 1);

    // The peer frees its buffers (cudaFreeHost): the ledger says so at once,
    // and the page-out goes through.
    peer.say("release\n");
    REQUIRE(peer.readLine() == "released");
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(12 * kMiB));
    CHECK_EQ(lms::reclaimInactive(0), 4 * kMiB);
    CHECK_EQ(peer.finish(), 0);
    int mismatches = 0;
    for (int i = 0; i < 4; ++i) {
      mismatches += !matches(*s[i], i);
    }
    CHECK_EQ(mismatches, 0);
  }
  env.checkBaseline();
}

// A process killed with its pinned memory (by the OOM killer, say) leaves a
// slot in the ledger: the next process to read the ledger frees it.
TEST_CASE(slot_of_a_dead_process_is_pruned) {
  HostEnv env(0);
  {
    auto mine = newStorage(4 * kMiB);
    write(*mine, 7);
    CHECK_EQ(lms::reclaimInactive(0), 4 * kMiB);
    Peer peer(8);
    REQUIRE(peer.readLine() == "held " + std::to_string(8 * kMiB));
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(12 * kMiB));
    peer.killHard();
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(4 * kMiB));
    // Its slot is free for the next process.
    Peer next(4);
    REQUIRE(next.readLine() == "held " + std::to_string(4 * kMiB));
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(8 * kMiB));
    CHECK_EQ(next.finish(), 0);
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(4 * kMiB));
    CHECK(matches(*mine, 7));
  }
  env.checkBaseline();
}

// ---------------------------------------------------------------------------
// Waiting for the other LMS processes of the host (setHostWait)
// ---------------------------------------------------------------------------

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// One 4 MiB storage of this process, paged out under a budget the peer
// fills: the bytes paged out, and the seconds it took.
struct PageOut {
  size_t bytes;
  double seconds;
};
PageOut pageOutOne(StoragePtr& storage, int value) {
  storage = newStorage(4 * kMiB);
  write(*storage, value);
  const auto start = std::chrono::steady_clock::now();
  const size_t bytes = lms::reclaimInactive(0);
  return {bytes, secondsSince(start)};
}

// Refused while another process holds the budget, a page-out waits for it
// and goes through once the other releases.
TEST_CASE(refused_page_out_waits_for_another_process_to_release) {
  HostEnv env(16 * kMiB, /*wait_s=*/5);
  {
    Peer peer(16);
    REQUIRE(peer.readLine() == "held " + std::to_string(16 * kMiB));
    peer.say("release-after 200\n");
    StoragePtr s;
    const PageOut out = pageOutOne(s, 5);
    CHECK_EQ(out.bytes, 4 * kMiB);
    CHECK(out.seconds >= 0.15);
    CHECK(out.seconds < 2.0);
    REQUIRE(peer.readLine() == "released");
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.host_refusals, 0);
    CHECK_EQ(st.host_wait_count, 1);
    CHECK(st.host_wait_ms >= 150.0);
    CHECK(matches(*s, 5));
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// A wait that the other never ends ends at the setting, with the error of
// the refusal saying how long it waited.
TEST_CASE(host_wait_ends_at_its_setting_with_the_refusal) {
  HostEnv env(16 * kMiB, /*wait_s=*/0.3);
  {
    Peer peer(16);
    REQUIRE(peer.readLine() == "held " + std::to_string(16 * kMiB));
    StoragePtr s;
    const PageOut out = pageOutOne(s, 6);
    CHECK_EQ(out.bytes, size_t(0));
    CHECK(out.seconds >= 0.3);
    CHECK(out.seconds < 1.5);
    const lms::HostRefusal& refusal = lms::HostPool::lastRefusal();
    CHECK(refusal.cause == lms::HostRefusal::Cause::Budget);
    CHECK(refusal.wait == lms::HostRefusal::Wait::TimedOut);
    const std::string text = lms::describeHostRefusal(refusal);
    CHECK(contains(text, "It waited 0.3 s for other LMS processes"));
    CHECK(contains(text, "lms_host_wait_s"));
    CHECK(contains(
        text,
        "hold 16.00 MiB (this process 0.00 MiB, other LMS processes "
        "16.00 MiB) of a budget of 16.00 MiB"));
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.host_refusals, 1);
    CHECK_EQ(st.host_wait_count, 1);
    CHECK(st.host_wait_ms >= 300.0);
    CHECK(matches(*s, 6));
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// A process past its peak holds its idle cached buffers; one that waits
// makes it free them at its next pool operation.
TEST_CASE(waiting_process_makes_others_free_their_idle_cache) {
  HostEnv env(16 * kMiB, /*wait_s=*/5);
  {
    Peer peer(16);
    REQUIRE(peer.readLine() == "held " + std::to_string(16 * kMiB));
    peer.say("idle\n");
    REQUIRE(peer.readLine() == "idle");
    // Idle, its buffers still count: the ledger says 16 MiB.
    CHECK_EQ(lms::getStats(0).host_ledger_bytes, int64_t(16 * kMiB));
    peer.say("tick 800\n");
    StoragePtr s;
    const PageOut out = pageOutOne(s, 7);
    CHECK_EQ(out.bytes, 4 * kMiB);
    CHECK(out.seconds < 0.7);
    // The peer kept only the small buffer of its ticks, if that.
    CHECK_LE(lms::getStats(0).host_ledger_bytes, int64_t(4 * kMiB + 4096));
    CHECK_EQ(lms::getStats(0).host_wait_count, 1);
    REQUIRE(peer.readLine() == "ticked");
    CHECK(matches(*s, 7));
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// Both processes wait for each other: the one that joined the ledger last
// (the peer) gives up at once with the refusal, and the other goes on once it
// has released, in far less than the setting.
TEST_CASE(when_every_holder_waits_the_last_to_join_gives_up) {
  HostEnv env(16 * kMiB, /*wait_s=*/5);
  {
    StoragePtr first;
    REQUIRE(pageOutOne(first, 8).bytes == 4 * kMiB); // joins before the peer
    StoragePtr second;
    REQUIRE(pageOutOne(second, 9).bytes == 4 * kMiB);
    Peer peer(8);
    REQUIRE(peer.readLine() == "held " + std::to_string(8 * kMiB));
    peer.say("limit 16\nwait 5\nmore-after 150 4\n");
    StoragePtr s;
    const PageOut out = pageOutOne(s, 10);
    CHECK_EQ(out.bytes, 4 * kMiB);
    CHECK(out.seconds >= 0.1);
    CHECK(out.seconds < 2.0);
    CHECK_EQ(
        peer.readLine(),
        "more 0 " +
            std::to_string(static_cast<int>(lms::HostRefusal::Wait::Yielded)));
    REQUIRE(peer.readLine() == "released");
    CHECK_EQ(lms::getStats(0).host_wait_count, 1);
    CHECK_EQ(lms::getStats(0).host_refusals, 0);
    CHECK(matches(*first, 8));
    CHECK(matches(*second, 9));
    CHECK(matches(*s, 10));
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// A wait of 0 refuses at once, as before the wait.
TEST_CASE(host_wait_of_zero_refuses_at_once) {
  HostEnv env(16 * kMiB, /*wait_s=*/0);
  {
    Peer peer(16);
    REQUIRE(peer.readLine() == "held " + std::to_string(16 * kMiB));
    StoragePtr s;
    const PageOut out = pageOutOne(s, 11);
    CHECK_EQ(out.bytes, size_t(0));
    CHECK(out.seconds < 0.2);
    const lms::HostRefusal& refusal = lms::HostPool::lastRefusal();
    CHECK(refusal.wait == lms::HostRefusal::Wait::None);
    CHECK(
        lms::describeHostRefusal(refusal).find("waited") == std::string::npos);
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.host_refusals, 1);
    CHECK_EQ(st.host_wait_count, 0);
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

TEST_CASE(conf_key_sets_the_host_wait) {
  CHECK_EQ(lms::getHostWait(), lms::kDefaultHostWaitSeconds);
  lms::parseConfig("lms_host_wait_s:2.5");
  CHECK_EQ(lms::getHostWait(), 2.5);
  CHECK(lms::parseConfigOption("lms_host_wait_s", "0"));
  CHECK_EQ(lms::getHostWait(), 0.0);
  bool rejected = false;
  try {
    lms::parseConfigOption("lms_host_wait_s", "-1");
  } catch (const c10::Error&) {
    rejected = true;
  }
  CHECK(rejected);
  lms::setHostWait(lms::kDefaultHostWaitSeconds);
}

// A ledger file of the layout before the waits, left by processes that have
// ended, is laid out again rather than leaving this process alone.
TEST_CASE(unused_ledger_of_an_older_layout_is_laid_out_again) {
  TempDir dir;
  std::string old(16 * 1024, '\0');
  old.replace(0, 8, std::string("LMSHOST\0", 8));
  old[8] = 1; // version 1, little-endian
  old[12] = static_cast<char>(511 & 0xff);
  old[13] = static_cast<char>(511 >> 8);
  const std::string path = dir.file("ledger", old);
  lms::HostLedger ledger(path, 0);
  CHECK(ledger.shared());
  lms::HostLedger::Locked locked(ledger);
  locked.add(int64_t(2 * kMiB));
  CHECK_EQ(locked.totals().all, 2 * kMiB);
  CHECK_EQ(locked.ticket(), uint64_t(1));
  struct stat st {};
  CHECK(::stat(path.c_str(), &st) == 0);
  CHECK_EQ(
      static_cast<size_t>(st.st_size),
      sizeof(lms::HostLedgerHeader) +
          lms::kHostLedgerSlots * sizeof(lms::HostLedgerSlot));
}

TEST_CASE(ledger_that_cannot_be_used_counts_this_process_alone) {
  TempDir dir;
  {
    // A folder that does not exist (as with no /dev/shm).
    lms::HostLedger ledger(dir.path() + "/missing/ledger", 0);
    CHECK(!ledger.shared());
    lms::HostLedger::Locked locked(ledger);
    locked.add(int64_t(5 * kMiB));
    const lms::HostLedger::Totals totals = locked.totals();
    CHECK_EQ(totals.all, 5 * kMiB);
    CHECK_EQ(totals.own, 5 * kMiB);
  }
  {
    // A file that is no ledger: left as it is.
    const std::string other = dir.file("other", "not a ledger\n");
    lms::HostLedger ledger(other, 0);
    CHECK(!ledger.shared());
    std::ifstream in(other);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    CHECK_EQ(text, std::string("not a ledger\n"));
  }
  {
    // A usable one (its own file: one object per file and process).
    lms::HostLedger ledger(dir.path() + "/ledger", 0);
    CHECK(ledger.shared());
    lms::HostLedger::Locked locked(ledger);
    locked.add(int64_t(3 * kMiB));
    CHECK_EQ(locked.totals().all, 3 * kMiB);
    struct stat st {};
    CHECK(::stat((dir.path() + "/ledger").c_str(), &st) == 0);
    CHECK_EQ(st.st_mode & 0777, mode_t(0600));
  }
}

// ---------------------------------------------------------------------------
// The device ledger: shares of the GPU and waits for its other LMS processes
// ---------------------------------------------------------------------------

lms::DeviceClaim claim(
    size_t need_mib,
    uint64_t ticket,
    size_t waiting_mib = 0,
    size_t held_mib = 0) {
  lms::DeviceClaim c;
  c.need = need_mib * kMiB;
  c.ticket = ticket;
  c.waiting = waiting_mib * kMiB;
  c.held = held_mib * kMiB;
  return c;
}

// Equal parts, a need under its part capped at the need and what it leaves
// split among the others; a process alone gets the whole pool.
TEST_CASE(device_shares_are_equal_parts_capped_by_need) {
  const size_t pool = 1000 * kMiB;
  std::vector<size_t> s = lms::deviceShares(pool, {claim(0, 1)});
  CHECK_EQ(s[0], pool);
  s = lms::deviceShares(pool, {claim(5000, 1)});
  CHECK_EQ(s[0], pool);
  s = lms::deviceShares(
      pool, {claim(0, 1), claim(0, 2), claim(0, 3), claim(0, 4)});
  for (size_t part : s) {
    CHECK_EQ(part, 250 * kMiB);
  }
  // One needs 100: the other three split the 900 it leaves.
  s = lms::deviceShares(
      pool, {claim(900, 1), claim(100, 2), claim(2000, 3), claim(0, 4)});
  CHECK_EQ(s[1], 100 * kMiB);
  CHECK_EQ(s[0], 300 * kMiB);
  CHECK_EQ(s[2], 300 * kMiB);
  CHECK_EQ(s[3], 300 * kMiB);
  // Needs under their parts at every round: each gets its need.
  s = lms::deviceShares(pool, {claim(100, 1), claim(200, 2), claim(900, 3)});
  CHECK_EQ(s[0], 100 * kMiB);
  CHECK_EQ(s[1], 200 * kMiB);
  CHECK_EQ(s[2], 700 * kMiB);
  size_t sum = 0;
  for (size_t part : s) {
    sum += part;
  }
  CHECK_LE(sum, pool);
  // Every need met: what they leave is split among them, not left to no one
  // (a small process beside a larger one got exactly its need, and every
  // allocation past it paged out).
  s = lms::deviceShares(pool, {claim(36, 1), claim(300, 2)});
  CHECK_EQ(s[0], 36 * kMiB + (pool - 336 * kMiB) / 2);
  CHECK_EQ(s[1], 300 * kMiB + (pool - 336 * kMiB) / 2);
  CHECK(s[0] + s[1] <= pool);
}

// The oldest waiting process gets what it holds plus what it waits for; the
// others share the rest, a younger waiter among them.
TEST_CASE(device_shares_give_the_oldest_waiter_what_it_waits_for) {
  const size_t pool = 1000 * kMiB;
  std::vector<size_t> s = lms::deviceShares(
      pool,
      {claim(900, 3, /*waiting=*/400, /*held=*/250),
       claim(900, 1, /*waiting=*/300, /*held=*/250),
       claim(900, 2)});
  CHECK_EQ(s[1], 550 * kMiB);
  CHECK_EQ(s[0], 225 * kMiB);
  CHECK_EQ(s[2], 225 * kMiB);
  // Never more than the pool.
  s = lms::deviceShares(pool, {claim(0, 1, 5000, 100), claim(0, 2)});
  CHECK_EQ(s[0], pool);
  CHECK_EQ(s[1], size_t(0));
  // A waiter whose equal part already covers its wait keeps that part.
  s = lms::deviceShares(pool, {claim(0, 1, 10, 100), claim(0, 2)});
  CHECK_EQ(s[0], 500 * kMiB);
  CHECK_EQ(s[1], 500 * kMiB);
}

lms::DeviceLedger::Peer peerOf(
    size_t held_mib,
    uint64_t ticket,
    size_t waiting_mib = 0) {
  lms::DeviceLedger::Peer p;
  p.pid = 100 + static_cast<int64_t>(ticket);
  p.claim = claim(0, ticket, waiting_mib, held_mib);
  return p;
}

// Who waits, who goes on: a failed allocation waits while another process
// holds what would make room and is not itself waiting; with every holder
// waiting the last to join gives way; with nothing to wait for it fails.
TEST_CASE(device_wait_decisions) {
  using D = lms::DeviceWaitDecision;
  const size_t need = 100 * kMiB;
  CHECK(lms::DeviceLedger::decide(need, 0, 2, {}) == D::NothingToWaitFor);
  CHECK(
      lms::DeviceLedger::decide(need, 0, 2, {peerOf(0, 1)}) ==
      D::NothingToWaitFor);
  // What the others hold and what is free would not make room.
  CHECK(
      lms::DeviceLedger::decide(need, 20 * kMiB, 2, {peerOf(50, 1)}) ==
      D::NothingToWaitFor);
  CHECK(
      lms::DeviceLedger::decide(need, 60 * kMiB, 2, {peerOf(50, 1)}) ==
      D::Wait);
  // A holder that does not wait goes on, and will release.
  CHECK(
      lms::DeviceLedger::decide(
          need, 0, 3, {peerOf(200, 1, 10), peerOf(200, 2)}) == D::Wait);
  // Every holder waits: the youngest gives way, the older ones wait.
  CHECK(
      lms::DeviceLedger::decide(
          need, 0, 3, {peerOf(200, 1, 10), peerOf(200, 2, 10)}) == D::GiveWay);
  CHECK(
      lms::DeviceLedger::decide(
          need, 0, 1, {peerOf(200, 2, 10), peerOf(200, 3, 10)}) == D::Wait);
  // A waiting process that holds nothing is no holder.
  CHECK(
      lms::DeviceLedger::decide(
          need, 0, 3, {peerOf(200, 1, 10), peerOf(0, 4, 10)}) == D::GiveWay);
}

// LMS on with no limit of its own and a wait of `wait_s` (the one setting
// of host and device waits), on a GPU whose ledger this process has joined.
// The limit once the engine has read the ledger again (it reads it at most
// every 10 ms).
size_t limitAfterReading() {
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  return lms::getLimit(0);
}

class DeviceEnv : public HostEnv {
 public:
  // The limit alone from a fresh reading of the device: the engine's last
  // one may date from an earlier test, while its peer still held memory.
  explicit DeviceEnv(double wait_s)
      : HostEnv(0, wait_s), limit_alone_(limitAfterReading()) {}
  size_t limitAlone() const {
    return limit_alone_;
  }

 private:
  size_t limit_alone_ = 0;
};

// A process that joins the GPU's ledger halves this one's share; a need it
// publishes under its part gives the rest back; when it dies, its slot is
// freed and the share is the whole device again. This process needs more
// than the device (a quarter of it paged out), so its part is never capped
// by its own need.
TEST_CASE(device_shares_follow_processes_that_join_and_end) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("fills the whole device: sized for the simulated one");
  }
  DeviceEnv env(0);
  const size_t alone = env.limitAlone();
  REQUIRE(alone > 64 * kMiB);
  {
    std::vector<StoragePtr> mine;
    for (size_t i = 0; i < (alone * 5 / 4) / (8 * kMiB); ++i) {
      mine.push_back(newStorage(8 * kMiB));
      write(*mine.back(), 40 + i);
    }
    REQUIRE(lms::getStats(0).pagedout_bytes.current > 0);
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 0 0\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    const size_t half = limitAfterReading();
    CHECK_LE(half, alone / 2 + kMiB);
    CHECK_LE(alone / 2, half + kMiB);
    peer.say("claim 16 16\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    const size_t rest = limitAfterReading();
    CHECK_LE(rest + 16 * kMiB, alone + kMiB);
    CHECK_LE(alone, rest + 16 * kMiB + kMiB);
    peer.killHard();
    CHECK_EQ(limitAfterReading(), alone);
    int mismatches = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      mismatches += !matches(*mine[i], 40 + i);
    }
    CHECK_EQ(mismatches, 0);
  }
  env.checkBaseline();
}

// A process with LMS on that holds nothing, once it has read the device,
// publishes a need of its own (at least a byte): a need of 0 says "not known
// yet" and counts as the whole device, so it held a busy process of the same
// GPU to half of it. The peer needs more than any pool and gets all of one
// but what this process needs.
TEST_CASE(an_idle_process_leaves_a_busy_one_the_device) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("reads the device ledger of device 0's GPU: the simulated one's");
  }
  DeviceEnv env(0);
  {
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 0 2000000\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    (void)limitAfterReading(); // this process reads the device again
    peer.say("share 1000000\n");
    const std::string line = peer.readLine();
    unsigned long long part = 0;
    REQUIRE(std::sscanf(line.c_str(), "share %llu", &part) == 1);
    // With this process's need counted as the whole pool: 500000.
    CHECK(part > 900000);
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// A process over its new share pages down to it at its next allocation.
TEST_CASE(process_over_its_new_share_pages_down_at_its_next_allocation) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("fills the whole device: sized for the simulated one");
  }
  DeviceEnv env(0);
  const size_t alone = env.limitAlone();
  {
    std::vector<StoragePtr> s;
    const size_t count = (alone * 3 / 4) / (8 * kMiB);
    for (size_t i = 0; i < count; ++i) {
      s.push_back(newStorage(8 * kMiB));
      write(*s.back(), 20 + i);
    }
    CHECK_EQ(lms::getStats(0).pagedout_bytes.current, 0);
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 0 0\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    s.push_back(newStorage(8 * kMiB));
    write(*s.back(), 20 + count);
    const lms::LmsStats st = lms::getStats(0);
    CHECK(st.pagedout_bytes.current > 0);
    CHECK_LE(
        lms_compat::aggregate(cca::getDeviceStats(0).allocated_bytes),
        int64_t(alone / 2 + kMiB));
    int mismatches = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      mismatches += !matches(*s[i], 20 + i);
    }
    CHECK_EQ(mismatches, 0);
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// Device memory that something else took (raw cudaMalloc: what another
// process's allocations are to this one) leaves `room` bytes free.
class DeviceFiller {
 public:
  explicit DeviceFiller(size_t room) {
    size_t free_bytes = 0;
    size_t total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    REQUIRE(free_bytes > room);
    C10_CUDA_CHECK(cudaMalloc(&ptr_, free_bytes - room));
  }
  ~DeviceFiller() {
    release();
  }
  DeviceFiller(const DeviceFiller&) = delete;
  DeviceFiller& operator=(const DeviceFiller&) = delete;
  void release() {
    if (ptr_ != nullptr) {
      C10_CUDA_CHECK(cudaFree(ptr_));
      ptr_ = nullptr;
    }
  }

 private:
  void* ptr_ = nullptr;
};

// An allocation the device cannot hold while another LMS process holds
// device memory: it waits, and goes on once the memory is released.
TEST_CASE(failed_device_allocation_waits_for_another_process) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("needs the simulated GPU: the other process's memory is simulated");
  }
  DeviceEnv env(5);
  {
    cca::emptyCache();
    DeviceFiller filler(16 * kMiB);
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 200 200\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    std::thread releaser([&filler] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      filler.release();
    });
    const auto start = std::chrono::steady_clock::now();
    StoragePtr s = newStorage(64 * kMiB);
    const double seconds = secondsSince(start);
    releaser.join();
    write(*s, 30);
    CHECK(matches(*s, 30));
    CHECK(seconds >= 0.15);
    CHECK(seconds < 2.0);
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.device_wait_count, 1);
    CHECK(st.device_wait_ms >= 150.0);
    CHECK_EQ(st.oom_count, 0);
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// The error of today, and how long it waited.
std::string deviceError(size_t bytes, double& seconds) {
  const auto start = std::chrono::steady_clock::now();
  try {
    StoragePtr s = newStorage(bytes);
  } catch (const c10::OutOfMemoryError& e) {
    seconds = secondsSince(start);
    return e.what();
  }
  seconds = secondsSince(start);
  return std::string();
}

// A wait the other never ends ends at the setting with the error of today,
// which says how long it waited and for whom.
TEST_CASE(device_wait_ends_at_its_setting_with_the_error) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("needs the simulated GPU: the other process's memory is simulated");
  }
  DeviceEnv env(0.3);
  {
    cca::emptyCache();
    DeviceFiller filler(16 * kMiB);
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 200 200\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    double seconds = 0;
    const std::string text = deviceError(64 * kMiB, seconds);
    CHECK(
        contains(text, "It waited 0.3 s for other LMS processes of this GPU"));
    CHECK(contains(text, "holds 200.00 MiB"));
    CHECK(contains(text, "the wait ran out"));
    CHECK(seconds >= 0.3);
    CHECK(seconds < 1.5);
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.device_wait_count, 1);
    CHECK(st.device_wait_ms >= 300.0);
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// The other process dies while this one waits: its slot is freed and the
// wait ends at once with the error, far before the setting.
TEST_CASE(device_wait_ends_when_the_holder_dies) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("needs the simulated GPU: the other process's memory is simulated");
  }
  DeviceEnv env(10);
  {
    cca::emptyCache();
    DeviceFiller filler(16 * kMiB);
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 200 200\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    std::thread killer([&peer] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      peer.killHard();
    });
    double seconds = 0;
    const std::string text = deviceError(64 * kMiB, seconds);
    killer.join();
    CHECK(contains(text, "nothing they hold would make room"));
    CHECK(seconds >= 0.15);
    CHECK(seconds < 3.0);
    CHECK_EQ(lms::getStats(0).device_wait_count, 1);
  }
  env.checkBaseline();
}

// A younger process that waits too does not make this one give up: an
// older waiter keeps waiting (here until the setting), the rule that keeps
// one of them going.
TEST_CASE(older_process_keeps_waiting_when_a_younger_one_waits) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("needs the simulated GPU: the other process's memory is simulated");
  }
  DeviceEnv env(1.0);
  {
    cca::emptyCache();
    (void)lms::getLimit(0); // this process is in the ledger before the peer
    DeviceFiller filler(16 * kMiB);
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 200 200\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    peer.say("wait 100\n");
    REQUIRE(peer.readLine() == "waiting");
    double seconds = 0;
    const std::string text = deviceError(64 * kMiB, seconds);
    CHECK(contains(text, "the wait ran out"));
    CHECK(contains(text, "holds 200.00 MiB, waiting"));
    CHECK(seconds >= 1.0);
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

// A wait of 0 raises at once, as before the wait.
TEST_CASE(device_wait_of_zero_raises_at_once) {
  if (simgpu_inject_fault == nullptr) {
    SKIP("needs the simulated GPU: the other process's memory is simulated");
  }
  DeviceEnv env(0);
  {
    cca::emptyCache();
    DeviceFiller filler(16 * kMiB);
    Peer peer(std::vector<std::string>{"--device-peer"});
    peer.say("claim 200 200\n");
    REQUIRE(peer.readLine().rfind("claimed ", 0) == 0);
    double seconds = 0;
    const std::string text = deviceError(64 * kMiB, seconds);
    CHECK(!text.empty());
    CHECK(text.find("It waited") == std::string::npos);
    CHECK(seconds < 0.5);
    CHECK_EQ(lms::getStats(0).device_wait_count, 0);
    CHECK_EQ(peer.finish(), 0);
  }
  env.checkBaseline();
}

} // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--hold-pinned") == 0) {
    return holdPinned(std::strtoull(argv[2], nullptr, 10));
  }
  if (argc == 2 && std::strcmp(argv[1], "--device-peer") == 0) {
    return devicePeer();
  }
  // A ledger of the suite's own unless the caller names one: other LMS
  // processes of this user must not move the figures it checks.
  std::string own_ledger;
  if (std::getenv("PYTORCH_LMS_HOST_LEDGER") == nullptr) {
    own_ledger =
        "/tmp/lms-host-test-ledger-" + std::to_string((long)::getpid());
    ::setenv("PYTORCH_LMS_HOST_LEDGER", own_ledger.c_str(), 1);
  }
  // The same for the ledger of the GPU's device memory: the GPU tier runs
  // this suite beside other LMS processes, whose shares must not move.
  std::string own_device_ledger;
  if (std::getenv("PYTORCH_LMS_DEVICE_LEDGER") == nullptr) {
    ::setenv(
        "PYTORCH_LMS_DEVICE_LEDGER",
        ("/tmp/lms-device-test-ledger-" + std::to_string((long)::getpid()))
            .c_str(),
        1);
    own_device_ledger = deviceLedgerPath();
  }
  const int status = lms_test::run(argc, argv);
  if (!own_ledger.empty()) {
    ::unlink(own_ledger.c_str());
  }
  if (!own_device_ledger.empty()) {
    ::unlink(own_device_ledger.c_str());
  }
  return status;
}
