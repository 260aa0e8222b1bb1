// LMS disk tier suite (setSpillDir, lms_spill_dir): host copies that the
// host budget has no room for go to files of the spill directory and read
// back byte for byte; the bound (setSpillLimit); the errors for directories
// that cannot serve; the removal of a crashed process's files by the next
// one; and a failed write that leaves the host copy in place. Runs on the
// simulated GPU in CI and on a real GPU (the budgets it sets are small).
//
// `test_lms_spill --spill-and-wait DIR` is a second LMS process for the crash
// test: it spills to DIR, prints "spilled BYTES", and waits for its input to
// end (the test kills it instead).

#include "lms_test.h"
#include "lms_test_allocator.h"
#include "lms_test_data.h"
#include "lms_test_storage.h"

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/cuda/LargeModelSupportHostPool.h>
#include <c10/util/Exception.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10_compat.h>
#pragma GCC diagnostic pop

#include <cuda_runtime_api.h>

#include <dirent.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace {

namespace lms = c10::cuda::lms;
namespace cca = c10::cuda::CUDACachingAllocator;
using lms_test::matches;
using lms_test::newStorage;
using lms_test::StoragePtr;
using lms_test::write;

constexpr size_t kMiB = 1024 * 1024;

bool contains(const std::string& text, const std::string& part) {
  const bool found = text.find(part) != std::string::npos;
  if (!found) {
    std::fprintf(stderr, "  '%s' not in: %s\n", part.c_str(), text.c_str());
  }
  return found;
}

// The entries of a directory ("." and ".." left out).
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* entry = ::readdir(d)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") {
        names.push_back(name);
      }
    }
    ::closedir(d);
  }
  return names;
}

// This process's subdirectory of spill directory `dir` (empty: none).
std::string ownSubdir(const std::string& dir, long pid = ::getpid()) {
  const std::string prefix = "lms-spill." + std::to_string(pid) + ".";
  for (const std::string& name : entries(dir)) {
    if (name.compare(0, prefix.size(), prefix) == 0) {
      return dir + "/" + name;
    }
  }
  return std::string();
}

// A fresh directory of the test's own, removed with what is left in it.
class TempDir {
 public:
  TempDir() {
    char path[] = "/tmp/lms-spill-test-XXXXXX";
    REQUIRE(::mkdtemp(path) != nullptr);
    path_ = path;
  }
  ~TempDir() {
    (void)std::system(("rm -rf '" + path_ + "'").c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const {
    return path_;
  }

 private:
  std::string path_;
};

void initAllocator() {
  static bool initialized = [] {
    int n = 0;
    C10_CUDA_CHECK(cudaGetDeviceCount(&n));
    cca::init(n);
    return true;
  }();
  (void)initialized;
}

// LMS on, a host budget of `host_limit` bytes, no host wait, and the disk
// tier in `dir` for the scope; off again on the way out.
class SpillEnv {
 public:
  SpillEnv(size_t host_limit, const std::string& dir, size_t spill_limit = 0) {
    initAllocator();
    c10::cuda::set_device(0);
    lms::setEnabled(true);
    lms::setSizeThreshold(1 * kMiB);
    lms::setPrefetchDepth(0);
    lms::setSpeculativeMargin(0);
    lms::setLimit(0, size_t(1) << 50);
    cca::emptyCache();
    lms::resetAccumulatedStats(0);
    lms::resetPeakStats(0);
    lms::setHostLimit(host_limit);
    lms::setHostWait(0);
    lms::setSpillLimit(spill_limit);
    lms::setSpillDir(dir);
  }
  ~SpillEnv() {
    lms::setSpillDir("");
    lms::setSpillLimit(0);
    lms::setHostLimit(0);
    lms::setHostWait(lms::kDefaultHostWaitSeconds);
  }
  SpillEnv(const SpillEnv&) = delete;
  SpillEnv& operator=(const SpillEnv&) = delete;
};

// `count` storages of 4 MiB, each written with its index, under a device
// cap of `cap` bytes; stops at the first out-of-memory error, whose message
// goes to `message`.
std::vector<StoragePtr> fill(int count, size_t cap, std::string& message) {
  const lms_test::AllocatorCap capped(cap);
  std::vector<StoragePtr> s;
  for (int i = 0; i < count && message.empty(); ++i) {
    try {
      StoragePtr storage = newStorage(4 * kMiB);
      write(*storage, i);
      s.push_back(std::move(storage));
    } catch (const c10::OutOfMemoryError& e) {
      message = e.what();
    }
  }
  return s;
}

int mismatches(std::vector<StoragePtr>& s, size_t cap) {
  const lms_test::AllocatorCap capped(cap);
  int bad = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    bad += !matches(*s[i], i);
  }
  return bad;
}

// 40 storages of 4 MiB under a 32 MiB cap and a 24 MiB host budget: without
// the disk tier the seventh page-out is refused (test_lms_host.cpp's
// host_budget_refusal_raises_oom_naming_host_memory); with it, the coldest
// host copies go to files and every storage is made and reads back as
// written, the files private to the user and gone once the storages are.
TEST_CASE(spilled_storages_read_back_byte_identical) {
  TempDir dir;
  {
    SpillEnv env(24 * kMiB, dir.path());
    CHECK_EQ(lms::getSpillDir(), dir.path());
    const std::string own = ownSubdir(dir.path());
    REQUIRE(!own.empty());
    struct stat st {};
    REQUIRE(::stat(own.c_str(), &st) == 0);
    CHECK_EQ(st.st_mode & 0777, 0700u);
    std::string message;
    std::vector<StoragePtr> s = fill(40, 32 * kMiB, message);
    CHECK(message.empty());
    CHECK_EQ(s.size(), 40u);
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    lms::LmsStats st1 = lms::getStats(0);
    CHECK(st1.spill_count >= 1);
    CHECK(st1.spill_out_bytes >= int64_t(st1.spill_count) * int64_t(4 * kMiB));
    CHECK(st1.spill_out_ms > 0);
    CHECK(st1.spilled_bytes.current > 0);
    CHECK_LE(st1.host_ledger_bytes, int64_t(24 * kMiB));
    // The files: one per spilled storage besides the lock, each 0600.
    const std::vector<std::string> files = entries(own);
    CHECK_EQ(
        int64_t(files.size()) - 1,
        st1.spilled_bytes.current / int64_t(4 * kMiB));
    for (const std::string& name : files) {
      REQUIRE(::stat((own + "/" + name).c_str(), &st) == 0);
      CHECK_EQ(st.st_mode & 0777, 0600u);
    }
    CHECK_EQ(mismatches(s, 32 * kMiB), 0);
    const lms::LmsStats st2 = lms::getStats(0);
    CHECK(st2.spill_in_bytes >= int64_t(4 * kMiB));
    CHECK(st2.spill_in_ms > 0);
    s.clear();
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_EQ(lms::getStats(0).spilled_bytes.current, 0);
    CHECK_EQ(lms::getStats(0).managed_bytes.current, 0);
    CHECK_EQ(entries(own).size(), 1u); // the lock alone
  }
  cca::emptyCache();
}

// A bound of 16 MiB: four storages more than the device and the host budget
// hold can be made, then the page-outs stop at the host budget with the
// host-memory error, which names the disk tier and its bound; what was made
// reads back as written.
TEST_CASE(spill_limit_bounds_the_disk_tier) {
  TempDir dir;
  size_t without = 0;
  {
    SpillEnv env(24 * kMiB, dir.path());
    lms::setSpillDir("");
    std::string message;
    without = fill(40, 32 * kMiB, message).size();
    REQUIRE(!message.empty());
  }
  cca::emptyCache();
  {
    SpillEnv env(24 * kMiB, dir.path(), 16 * kMiB);
    CHECK_EQ(lms::getSpillLimit(), 16 * kMiB);
    std::string message;
    std::vector<StoragePtr> s = fill(40, 32 * kMiB, message);
    REQUIRE(!message.empty());
    CHECK(contains(message, "host memory ran out"));
    CHECK(contains(message, "spill directory '" + dir.path() + "'"));
    CHECK(contains(message, "of a bound of 16.00 MiB; written 16.00 MiB at "));
    CHECK(contains(message, " GB/s, read back none timed"));
    CHECK(contains(message, "lms_spill_limit_mb"));
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.spilled_bytes.peak, int64_t(16 * kMiB));
    CHECK_EQ(st.spill_out_bytes, int64_t(16 * kMiB));
    CHECK_EQ(s.size(), without + 4);
    s.resize(s.size() - 2); // a little room on the device to read them
    CHECK_EQ(mismatches(s, 32 * kMiB), 0);
  }
  cca::emptyCache();
}

// A missing directory, a file, and a directory the user cannot write: each
// raises at once, naming the setting, the value and what to give instead,
// and the disk tier stays as it was. The PYTORCH_CUDA_ALLOC_CONF key goes
// through the same checks.
TEST_CASE(bad_spill_directories_are_refused_naming_the_setting) {
  TempDir dir;
  lms::setSpillDir("");
  const auto refusal = [](const std::string& path) {
    try {
      lms::setSpillDir(path);
    } catch (const c10::ValueError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string missing = dir.path() + "/missing";
  std::string message = refusal(missing);
  CHECK(contains(message, "'" + missing + "'"));
  CHECK(contains(message, "lms_spill_dir"));
  CHECK(contains(message, "does not exist"));
  CHECK(contains(message, "mkdir -p '" + missing + "'"));
  CHECK(contains(message, "torch.cuda.set_spill_dir_lms("));
  CHECK_EQ(lms::getSpillDir(), std::string());

  const std::string file = dir.path() + "/file";
  std::FILE* f = std::fopen(file.c_str(), "w");
  REQUIRE(f != nullptr);
  std::fclose(f);
  message = refusal(file);
  CHECK(contains(message, "is not a directory"));
  CHECK(contains(message, "lms_spill_dir"));

  bool conf_raised = false;
  try {
    lms::parseConfig(
        ("lms_spill_dir:" + missing).c_str(), true, "PYTORCH_CUDA_ALLOC_CONF");
  } catch (const c10::ValueError& e) {
    conf_raised = contains(e.what(), "does not exist");
  }
  CHECK(conf_raised);
  CHECK_EQ(lms::getSpillDir(), std::string());

  // A directory this user cannot write: one made read-only, or, for root,
  // who writes any, one of sysfs (mkdir there fails with EPERM).
  std::string locked = dir.path() + "/read-only";
  REQUIRE(::mkdir(locked.c_str(), 0500) == 0);
  if (::geteuid() == 0) {
    locked = "/sys/fs";
  }
  message = refusal(locked);
  CHECK(contains(message, "'" + locked + "'"));
  CHECK(contains(message, "is not writable by this process"));
  CHECK(contains(message, "lms_spill_dir"));
  CHECK(contains(message, "torch.cuda.set_spill_dir_lms("));
  CHECK_EQ(lms::getSpillDir(), std::string());
}

// A second LMS process spills to the directory and is killed (SIGKILL: no
// exit handler runs); its subdirectory is left. The next process to set the
// directory removes it, but not that of a process that still runs.
TEST_CASE(a_crashed_process_spill_directory_is_removed_by_the_next) {
  TempDir dir;
  const auto spawn = [&](int& to, std::FILE*& from) {
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
    std::vector<char*> argv = {
        const_cast<char*>(self.c_str()),
        const_cast<char*>("--spill-and-wait"),
        const_cast<char*>(dir.path().c_str()),
        nullptr};
    pid_t pid = 0;
    const int err = posix_spawn(
        &pid, self.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(to_child[0]);
    ::close(from_child[1]);
    to = to_child[1];
    from = ::fdopen(from_child[0], "r");
    REQUIRE(err == 0 && from != nullptr);
    char line[128] = {0};
    REQUIRE(std::fgets(line, sizeof(line), from) != nullptr);
    long long bytes = 0;
    CHECK(std::sscanf(line, "spilled %lld", &bytes) == 1 && bytes > 0);
    return pid;
  };
  int to_crashed = -1;
  std::FILE* from_crashed = nullptr;
  const pid_t crashed = spawn(to_crashed, from_crashed);
  int to_live = -1;
  std::FILE* from_live = nullptr;
  const pid_t live = spawn(to_live, from_live);
  const std::string crashed_dir = ownSubdir(dir.path(), crashed);
  const std::string live_dir = ownSubdir(dir.path(), live);
  REQUIRE(!crashed_dir.empty() && !live_dir.empty());
  CHECK(entries(crashed_dir).size() >= 2u); // the lock and a spilled copy
  ::kill(crashed, SIGKILL);
  (void)::waitpid(crashed, nullptr, 0);
  ::close(to_crashed);
  std::fclose(from_crashed);
  CHECK(!entries(crashed_dir).empty()); // nothing removed it

  lms::setSpillDir(dir.path());
  CHECK(entries(crashed_dir).empty());
  struct stat st {};
  CHECK(::stat(crashed_dir.c_str(), &st) != 0);
  CHECK(entries(live_dir).size() >= 2u);
  lms::setSpillDir("");

  ::close(to_live); // its input ends: it exits and removes its own
  int status = 0;
  (void)::waitpid(live, &status, 0);
  std::fclose(from_live);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(::stat(live_dir.c_str(), &st) != 0);
}

// A write to the spill directory that fails (here: a file-size limit of
// 2 MiB, EFBIG, as a full disk gives ENOSPC) removes its file and keeps the
// host copy: page-outs stop at the host budget with the host-memory error,
// which says why the disk tier took nothing, and every storage made reads
// back as written.
TEST_CASE(a_failed_write_keeps_the_host_copy) {
  TempDir dir;
  {
    SpillEnv env(24 * kMiB, dir.path());
    struct rlimit before {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
    struct rlimit small = before;
    small.rlim_cur = 2 * kMiB;
    void (*previous)(int) = ::signal(SIGXFSZ, SIG_IGN);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string message;
    std::vector<StoragePtr> s = fill(40, 32 * kMiB, message);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &before) == 0);
    ::signal(SIGXFSZ, previous);
    REQUIRE(!message.empty());
    CHECK(contains(message, "host memory ran out"));
    CHECK(contains(message, "it took no more: writing 4.00 MiB to "));
    CHECK(contains(message, "File too large"));
    const lms::LmsStats st = lms::getStats(0);
    CHECK_EQ(st.spill_count, 0);
    CHECK_EQ(st.spilled_bytes.peak, 0);
    CHECK_EQ(st.pageout_count, 6); // the host budget's worth, as without it
    CHECK_EQ(entries(ownSubdir(dir.path())).size(), 1u); // the lock alone
    s.resize(s.size() - 2);
    CHECK_EQ(mismatches(s, 32 * kMiB), 0);
  }
  cca::emptyCache();
}

// The second process of the crash test.
int spillAndWait(const std::string& dir) {
  try {
    SpillEnv env(8 * kMiB, dir);
    std::string message;
    std::vector<StoragePtr> s = fill(12, 32 * kMiB, message);
    if (!message.empty()) {
      std::fprintf(stderr, "%s\n", message.c_str());
      return 1;
    }
    std::printf("spilled %lld\n", (long long)lms::getStats(0).spill_out_bytes);
    std::fflush(stdout);
    char line[64];
    while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

} // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--spill-and-wait") == 0) {
    return spillAndWait(argv[2]);
  }
  std::string own_ledger;
  if (std::getenv("PYTORCH_LMS_HOST_LEDGER") == nullptr) {
    own_ledger =
        "/tmp/lms-spill-test-ledger-" + std::to_string((long)::getpid());
    ::setenv("PYTORCH_LMS_HOST_LEDGER", own_ledger.c_str(), 1);
  }
  const int status = lms_test::run(argc, argv);
  if (!own_ledger.empty()) {
    ::unlink(own_ledger.c_str());
  }
  return status;
}
