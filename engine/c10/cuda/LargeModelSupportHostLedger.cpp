// The ledgers of the LMS processes of a host (HostLedger: their pinned
// bytes) and of a GPU (DeviceLedger: their device memory, and the shares
// deviceShares makes of it), declared in LargeModelSupportHostPool.h: each a
// file in shared memory with a slot per process, locked with fcntl.

#include <c10/cuda/LargeModelSupportHostPool.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace c10::cuda::lms {

namespace {
constexpr char kLedgerMagic[8] = {'L', 'M', 'S', 'H', 'O', 'S', 'T', '\0'};
constexpr size_t kLedgerBytes =
    sizeof(HostLedgerHeader) + kHostLedgerSlots * sizeof(HostLedgerSlot);
static_assert(sizeof(HostLedgerHeader) == 32 && sizeof(HostLedgerSlot) == 48);
} // namespace

// ---------------------------------------------------------------------------
// HostLedger
// ---------------------------------------------------------------------------

namespace {

size_t slotOffset(int slot) {
  return sizeof(HostLedgerHeader) +
      static_cast<size_t>(slot) * sizeof(HostLedgerSlot);
}

} // namespace

HostLedger::HostLedger(std::string path, uint64_t cgroup_id)
    : path_(std::move(path)), cgroup_id_(cgroup_id) {
  owner_pid_ = static_cast<int64_t>(::getpid());
  (void)open();
}

HostLedger::~HostLedger() {
  if (map_ != nullptr) {
    ::munmap(map_, kLedgerBytes);
  }
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

std::string HostLedger::defaultPath() {
  const char* env = std::getenv("PYTORCH_LMS_HOST_LEDGER");
  if (env != nullptr && *env != '\0') {
    return env;
  }
  // One file per user: a file of another user's could not be opened, and
  // one that every user may write would let any of them stop the others.
  return "/dev/shm/pytorch-lms-host-ledger-" +
      std::to_string(static_cast<unsigned long>(::geteuid()));
}

HostLedgerSlot* HostLedger::slots() {
  return reinterpret_cast<HostLedgerSlot*>(
      static_cast<char*>(map_) + sizeof(HostLedgerHeader));
}

namespace {

// A write lock on one byte of the file `fd` (waiting for it, or not).
bool lockFileByte(int fd, size_t offset, bool wait) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = static_cast<off_t>(offset);
  lock.l_len = 1;
  while (::fcntl(fd, wait ? F_SETLKW : F_SETLK, &lock) != 0) {
    if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

void unlockFileByte(int fd, size_t offset) {
  struct flock lock {};
  lock.l_type = F_UNLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = static_cast<off_t>(offset);
  lock.l_len = 1;
  (void)::fcntl(fd, F_SETLK, &lock);
}

// Whether no process locks the byte at `offset` (or the rest of the file
// from it, with `len` 0): a slot of a process that has ended.
bool unlockedByAll(int fd, size_t offset, off_t len) {
  struct flock probe {};
  probe.l_type = F_WRLCK;
  probe.l_whence = SEEK_SET;
  probe.l_start = static_cast<off_t>(offset);
  probe.l_len = len;
  return ::fcntl(fd, F_GETLK, &probe) == 0 && probe.l_type == F_UNLCK;
}

// Opens a ledger file of this user (created 0600 where missing) and takes the
// lock on its first byte, which serializes laying it out; `st` is the file's
// status once locked. Returns the descriptor, or -1 with why in `why`.
int openOwnLedgerFile(
    const std::string& path,
    struct stat& st,
    std::string& why) {
  const int fd = ::open(
      path.c_str(),
      O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC,
      S_IRUSR | S_IWUSR);
  if (fd < 0) {
    why = std::string("cannot open it: ") + std::strerror(errno);
    return -1;
  }
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      st.st_uid != ::geteuid()) {
    why = "it is not a regular file of this user";
  } else if (!lockFileByte(fd, 0, /*wait=*/true)) {
    why = std::string("cannot lock it: ") + std::strerror(errno);
  } else if (::fstat(fd, &st) != 0) {
    why = std::string("cannot read its size: ") + std::strerror(errno);
  } else {
    return fd;
  }
  ::close(fd);
  return -1;
}

// Maps `bytes` of a locked ledger file, first sizing it where this process
// lays it out (`fresh`). Returns the mapping, or null with why in `why`.
void* mapLedgerFile(int fd, size_t bytes, bool fresh, std::string& why) {
  if (fresh && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    why = std::string("cannot size it: ") + std::strerror(errno);
    return nullptr;
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    why = std::string("cannot map it: ") + std::strerror(errno);
    return nullptr;
  }
  return map;
}

} // namespace

bool HostLedger::lockByte(size_t offset, bool wait) {
  return lockFileByte(fd_, offset, wait);
}

void HostLedger::unlockByte(size_t offset) {
  unlockFileByte(fd_, offset);
}

bool HostLedger::open() {
  struct stat st {};
  std::string why;
  fd_ = openOwnLedgerFile(path_, st, why);
  if (fd_ < 0) {
    fallBack(why);
    return false;
  }
  bool fresh = st.st_size == 0;
  if (!fresh && !hasLayout(static_cast<size_t>(st.st_size))) {
    // A ledger of another version, left in /dev/shm by processes that have
    // ended (it outlives them): laid out again when no live process holds a
    // slot of it (a lock on any byte past the first, which this process
    // holds), so that an upgrade does not leave every process alone. A file
    // that is no ledger (a wrong PYTORCH_LMS_HOST_LEDGER) is never touched.
    char magic[sizeof(kLedgerMagic)] = {};
    if (::pread(fd_, magic, sizeof(magic), 0) !=
            static_cast<ssize_t>(sizeof(magic)) ||
        std::memcmp(magic, kLedgerMagic, sizeof(magic)) != 0) {
      fallBack("it is not a ledger of Large Model Support");
      return false;
    }
    if (!unlockedByAll(fd_, 1, 0) || ::ftruncate(fd_, 0) != 0) {
      fallBack(
          "it has another layout (another version of Large Model Support?) "
          "and a live process uses it");
      return false;
    }
    fresh = true;
  }
  // The first process to lock a new (empty) file lays it out.
  void* map = mapLedgerFile(fd_, kLedgerBytes, fresh, why);
  if (map == nullptr) {
    fallBack(why);
    return false;
  }
  map_ = map;
  auto* header = static_cast<HostLedgerHeader*>(map_);
  if (fresh) {
    std::memcpy(header->magic, kLedgerMagic, sizeof(kLedgerMagic));
    header->version = kHostLedgerVersion;
    header->slot_count = kHostLedgerSlots;
    header->waiting = 0;
    header->next_ticket = 0;
  }
  unlockByte(0);
  return true;
}

// Whether the file (of `size` bytes, locked) has this version's layout.
bool HostLedger::hasLayout(size_t size) {
  if (size != kLedgerBytes) {
    return false;
  }
  HostLedgerHeader header{};
  return ::pread(fd_, &header, sizeof(header), 0) ==
      static_cast<ssize_t>(sizeof(header)) &&
      std::memcmp(header.magic, kLedgerMagic, sizeof(kLedgerMagic)) == 0 &&
      header.version == kHostLedgerVersion &&
      header.slot_count == kHostLedgerSlots;
}

HostLedgerHeader* HostLedger::header() {
  return static_cast<HostLedgerHeader*>(map_);
}

void HostLedger::fallBack(const std::string& why) {
  if (map_ != nullptr) {
    ::munmap(map_, kLedgerBytes);
    map_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_); // drops this process's locks on the file
    fd_ = -1;
  }
  slot_ = -1;
  own_waiting_ = false;
  TORCH_WARN(
      "Large Model Support: the host ledger ",
      path_,
      " cannot be used (",
      why,
      "), so this process counts only its own pinned host memory against the "
      "host budget and does not see what other LMS processes of this host "
      "pin. Set PYTORCH_LMS_HOST_LEDGER to a file on a writable local file "
      "system (the same for every LMS process of the host) to share one.");
}

bool HostLedger::claimSlot() {
  for (int i = 0; i < static_cast<int>(kHostLedgerSlots); ++i) {
    if (!lockByte(slotOffset(i), /*wait=*/false)) {
      continue; // a live process holds it
    }
    HostLedgerSlot& slot = slots()[i];
    slot = HostLedgerSlot{};
    slot.pid = owner_pid_;
    slot.cgroup = cgroup_id_;
    slot.ticket = ++header()->next_ticket;
    slot_ = i;
    return true;
  }
  return false;
}

HostLedger::Locked::Locked(HostLedger& ledger)
    : ledger_(ledger), lock_(ledger.mutex_) {
  const auto pid = static_cast<int64_t>(::getpid());
  if (pid != ledger_.owner_pid_) {
    // A child after fork: its parent's slot and pinned bytes are not its own
    // (record locks are not inherited, so the slot stays the parent's).
    ledger_.owner_pid_ = pid;
    ledger_.slot_ = -1;
    ledger_.own_bytes_ = 0;
    ledger_.own_waiting_ = false;
  }
  if (ledger_.shared() && !ledger_.lockByte(0, /*wait=*/true)) {
    ledger_.fallBack(std::string("cannot lock it: ") + std::strerror(errno));
  }
}

HostLedger::Locked::~Locked() {
  if (ledger_.shared()) {
    ledger_.unlockByte(0);
  }
}

HostLedger::Totals HostLedger::Locked::totals(
    std::vector<HostLedgerSlot>* others) {
  Totals totals;
  const auto own =
      static_cast<size_t>(std::max<int64_t>(ledger_.own_bytes_, 0));
  totals.own = own;
  if (!ledger_.shared()) {
    totals.all = own;
    totals.cgroup = own;
    return totals;
  }
  HostLedgerSlot* slots = ledger_.slots();
  for (int i = 0; i < static_cast<int>(kHostLedgerSlots); ++i) {
    HostLedgerSlot& slot = slots[i];
    if (slot.pid == 0) {
      continue;
    }
    if (i != ledger_.slot_) {
      // A slot whose byte no process locks belongs to one that has ended:
      // its pinned memory went with it.
      struct flock probe {};
      probe.l_type = F_WRLCK;
      probe.l_whence = SEEK_SET;
      probe.l_start = static_cast<off_t>(slotOffset(i));
      probe.l_len = 1;
      if (::fcntl(ledger_.fd_, F_GETLK, &probe) == 0 &&
          probe.l_type == F_UNLCK) {
        if (slot.waiting != 0) { // it ended while it waited
          HostLedgerHeader* header = ledger_.header();
          __atomic_store_n(
              &header->waiting,
              header->waiting - std::min<uint64_t>(header->waiting, 1),
              __ATOMIC_RELEASE);
        }
        slot = HostLedgerSlot{};
        continue;
      }
      if (others != nullptr) {
        others->push_back(slot);
      }
    }
    const auto bytes = static_cast<size_t>(std::max<int64_t>(slot.bytes, 0));
    totals.all += bytes;
    if (slot.cgroup == ledger_.cgroup_id_) {
      totals.cgroup += bytes;
    }
  }
  if (ledger_.slot_ < 0) { // nothing pinned through the ledger yet
    totals.all += own;
    totals.cgroup += own;
  }
  return totals;
}

void HostLedger::Locked::add(int64_t delta) {
  ledger_.own_bytes_ = std::max<int64_t>(ledger_.own_bytes_ + delta, 0);
  if (!ledger_.shared()) {
    return;
  }
  if (ledger_.slot_ < 0) {
    if (ledger_.own_bytes_ == 0) {
      return;
    }
    if (!ledger_.claimSlot()) {
      ledger_.fallBack(
          "all " + std::to_string(kHostLedgerSlots) +
          " process slots are taken");
      return;
    }
  }
  ledger_.slots()[ledger_.slot_].bytes = ledger_.own_bytes_;
}

bool HostLedger::Locked::setWaiting(size_t bytes) {
  if (!ledger_.shared()) {
    return false;
  }
  if (ledger_.slot_ < 0 && !ledger_.claimSlot()) {
    return false; // all slots taken: this process waits unseen
  }
  ledger_.slots()[ledger_.slot_].waiting = static_cast<int64_t>(bytes);
  const bool waiting = bytes != 0;
  if (waiting != ledger_.own_waiting_) {
    HostLedgerHeader* header = ledger_.header();
    const uint64_t count = header->waiting;
    __atomic_store_n(
        &header->waiting,
        waiting ? count + 1 : count - std::min<uint64_t>(count, 1),
        __ATOMIC_RELEASE);
    ledger_.own_waiting_ = waiting;
  }
  return true;
}

uint64_t HostLedger::Locked::ticket() const {
  return ledger_.shared() && ledger_.slot_ >= 0
      ? ledger_.slots()[ledger_.slot_].ticket
      : 0;
}

bool HostLedger::othersWaiting() {
  // The process's lock only: fallBack() unmaps the file under it.
  std::lock_guard<std::mutex> lock(mutex_);
  if (map_ == nullptr) {
    return false;
  }
  const uint64_t waiting =
      __atomic_load_n(&header()->waiting, __ATOMIC_ACQUIRE);
  return waiting > (own_waiting_ ? 1u : 0u);
}

// ---------------------------------------------------------------------------
// DeviceLedger
// ---------------------------------------------------------------------------

namespace {
constexpr char kDeviceLedgerMagic[8] =
    {'L', 'M', 'S', 'D', 'E', 'V', 'I', '\0'};
constexpr size_t kDeviceLedgerBytes =
    sizeof(DeviceLedgerHeader) + kDeviceLedgerSlots * sizeof(DeviceLedgerSlot);
static_assert(
    sizeof(DeviceLedgerHeader) == 32 && sizeof(DeviceLedgerSlot) == 48);

size_t deviceSlotOffset(int slot) {
  return sizeof(DeviceLedgerHeader) +
      static_cast<size_t>(slot) * sizeof(DeviceLedgerSlot);
}

size_t nonNegative(int64_t value) {
  return static_cast<size_t>(std::max<int64_t>(value, 0));
}
} // namespace

namespace {

// Max-min fair parts of `left` bytes for the claims `open` (indices into
// `claims`), into `shares`: the claims that need less than an equal part get
// their need, the rest is split again, until every claim left needs at least
// its part (or has no need known yet). When every claim's need is met, what
// is left over is split equally among them: a part capped at a need measured
// before the next allocation would make every allocation past it page out
// (the need only grows once it has), however much of the device is free.
void splitFairly(
    size_t left,
    std::vector<size_t> open,
    const std::vector<DeviceClaim>& claims,
    std::vector<size_t>& shares) {
  const std::vector<size_t> all = open;
  while (!open.empty()) {
    const size_t part = left / open.size();
    std::vector<size_t> still;
    for (size_t i : open) {
      const size_t need = claims[i].need;
      if (need != 0 && need <= part) {
        shares[i] = need;
        left -= need;
      } else {
        still.push_back(i);
      }
    }
    if (still.size() == open.size()) {
      for (size_t i : still) {
        shares[i] = part;
      }
      return;
    }
    open = std::move(still);
  }
  if (!all.empty() && left > 0) {
    for (size_t i : all) {
      shares[i] += left / all.size();
    }
  }
}

} // namespace

std::vector<size_t> deviceShares(
    size_t pool,
    const std::vector<DeviceClaim>& claims) {
  std::vector<size_t> shares(claims.size(), 0);
  std::vector<size_t> all(claims.size());
  for (size_t i = 0; i < claims.size(); ++i) {
    all[i] = i;
  }
  splitFairly(pool, all, claims, shares);
  // The oldest waiting claim goes first: with equal parts alone, a process
  // whose operators need more than its part would wait until the others
  // end; this way the others page down and it goes on.
  int first = -1;
  for (size_t i = 0; i < claims.size(); ++i) {
    if (claims[i].waiting != 0 &&
        (first < 0 || claims[i].ticket < claims[first].ticket)) {
      first = static_cast<int>(i);
    }
  }
  if (first < 0) {
    return shares;
  }
  const DeviceClaim& waiter = claims[first];
  const size_t want = std::min(waiter.held + waiter.waiting, pool);
  if (shares[first] >= want) {
    return shares;
  }
  shares[first] = want;
  std::vector<size_t> rest;
  for (size_t i = 0; i < claims.size(); ++i) {
    if (static_cast<int>(i) != first) {
      rest.push_back(i);
    }
  }
  splitFairly(pool - want, rest, claims, shares);
  return shares;
}

DeviceLedger::DeviceLedger(std::string path) : path_(std::move(path)) {
  owner_pid_ = static_cast<int64_t>(::getpid());
  (void)open();
}

DeviceLedger::~DeviceLedger() {
  if (map_ != nullptr) {
    ::munmap(map_, kDeviceLedgerBytes);
  }
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

std::string DeviceLedger::pathFor(const std::string& key) {
  const char* env = std::getenv("PYTORCH_LMS_DEVICE_LEDGER");
  if (env != nullptr && *env != '\0') {
    return std::string(env) + "-" + key;
  }
  // One file per user and GPU, for the reasons of the host's.
  return "/dev/shm/pytorch-lms-device-ledger-" +
      std::to_string(static_cast<unsigned long>(::geteuid())) + "-" + key;
}

std::string DeviceLedger::pathForDevice(c10::DeviceIndex device) {
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::string key = "GPU-";
  char hex[3];
  for (size_t i = 0; i < sizeof(prop.uuid.bytes); ++i) {
    std::snprintf(
        hex,
        sizeof(hex),
        "%02x",
        static_cast<unsigned char>(prop.uuid.bytes[i]));
    key += hex;
  }
  return pathFor(key);
}

DeviceLedgerHeader* DeviceLedger::header() {
  return static_cast<DeviceLedgerHeader*>(map_);
}

DeviceLedgerSlot* DeviceLedger::slots() {
  return reinterpret_cast<DeviceLedgerSlot*>(
      static_cast<char*>(map_) + sizeof(DeviceLedgerHeader));
}

bool DeviceLedger::open() {
  struct stat st {};
  std::string why;
  fd_ = openOwnLedgerFile(path_, st, why);
  if (fd_ < 0) {
    fallBack(why);
    return false;
  }
  bool fresh = st.st_size == 0;
  if (!fresh) {
    DeviceLedgerHeader h{};
    const bool read =
        ::pread(fd_, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h));
    if (!read ||
        std::memcmp(h.magic, kDeviceLedgerMagic, sizeof(h.magic)) != 0) {
      fallBack("it is not a ledger of Large Model Support");
      return false;
    }
    if (static_cast<size_t>(st.st_size) != kDeviceLedgerBytes ||
        h.version != kDeviceLedgerVersion ||
        h.slot_count != kDeviceLedgerSlots) {
      // Another version's, laid out again once no live process uses it (as
      // the host's ledger).
      if (!unlockedByAll(fd_, 1, 0) || ::ftruncate(fd_, 0) != 0) {
        fallBack(
            "it has another layout (another version of Large Model "
            "Support?) and a live process uses it");
        return false;
      }
      fresh = true;
    }
  }
  void* map = mapLedgerFile(fd_, kDeviceLedgerBytes, fresh, why);
  if (map == nullptr) {
    fallBack(why);
    return false;
  }
  map_ = map;
  if (fresh) {
    std::memcpy(
        header()->magic, kDeviceLedgerMagic, sizeof(kDeviceLedgerMagic));
    header()->version = kDeviceLedgerVersion;
    header()->slot_count = kDeviceLedgerSlots;
    header()->waiting = 0;
    header()->next_ticket = 0;
  }
  unlockFileByte(fd_, 0);
  return true;
}

void DeviceLedger::fallBack(const std::string& why) {
  if (map_ != nullptr) {
    ::munmap(map_, kDeviceLedgerBytes);
    map_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  slot_ = -1;
  own_waiting_ = false;
  TORCH_WARN(
      "Large Model Support: the device ledger ",
      path_,
      " cannot be used (",
      why,
      "), so this process does not see the other LMS processes of its GPU: "
      "its share of the device is what they leave, and it does not wait for "
      "them. Set PYTORCH_LMS_DEVICE_LEDGER to a path prefix on a writable "
      "local file system (the same for every LMS process of the host).");
}

bool DeviceLedger::claimSlot() {
  for (int i = 0; i < static_cast<int>(kDeviceLedgerSlots); ++i) {
    if (!lockFileByte(fd_, deviceSlotOffset(i), /*wait=*/false)) {
      continue; // a live process holds it
    }
    DeviceLedgerSlot& slot = slots()[i];
    slot = DeviceLedgerSlot{};
    slot.pid = owner_pid_;
    slot.ticket = ++header()->next_ticket;
    slot_ = i;
    return true;
  }
  return false;
}

std::vector<DeviceLedger::Peer> DeviceLedger::update(
    size_t held,
    size_t need,
    DeviceClaim* own) {
  std::lock_guard<std::mutex> guard(mutex_);
  std::vector<Peer> peers;
  const auto pid = static_cast<int64_t>(::getpid());
  if (pid != owner_pid_) { // a child after fork: the slot is its parent's
    owner_pid_ = pid;
    slot_ = -1;
    own_waiting_ = false;
  }
  if (map_ == nullptr) {
    return peers;
  }
  if (!lockFileByte(fd_, 0, /*wait=*/true)) {
    fallBack(std::string("cannot lock it: ") + std::strerror(errno));
    return peers;
  }
  if (slot_ < 0 && !claimSlot()) {
    unlockFileByte(fd_, 0);
    fallBack(
        "all " + std::to_string(kDeviceLedgerSlots) +
        " process slots are taken");
    return peers;
  }
  DeviceLedgerSlot* all = slots();
  all[slot_].held = static_cast<int64_t>(held);
  all[slot_].need = static_cast<int64_t>(need);
  for (int i = 0; i < static_cast<int>(kDeviceLedgerSlots); ++i) {
    DeviceLedgerSlot& slot = all[i];
    if (slot.pid == 0 || i == slot_) {
      continue;
    }
    if (unlockedByAll(fd_, deviceSlotOffset(i), 1)) {
      // Its process ended, and its device memory with it.
      if (slot.waiting != 0) { // it ended while it waited
        const uint64_t count = header()->waiting;
        __atomic_store_n(
            &header()->waiting,
            count - std::min<uint64_t>(count, 1),
            __ATOMIC_RELEASE);
      }
      slot = DeviceLedgerSlot{};
      continue;
    }
    Peer peer;
    peer.pid = slot.pid;
    peer.claim.held = nonNegative(slot.held);
    peer.claim.need = nonNegative(slot.need);
    peer.claim.waiting = nonNegative(slot.waiting);
    peer.claim.ticket = slot.ticket;
    peers.push_back(peer);
  }
  if (own != nullptr) {
    own->held = held;
    own->need = need;
    own->waiting = nonNegative(all[slot_].waiting);
    own->ticket = all[slot_].ticket;
  }
  unlockFileByte(fd_, 0);
  return peers;
}

bool DeviceLedger::setWaiting(size_t bytes) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (map_ == nullptr || slot_ < 0 || !lockFileByte(fd_, 0, /*wait=*/true)) {
    return false;
  }
  slots()[slot_].waiting = static_cast<int64_t>(bytes);
  const bool waiting = bytes != 0;
  if (waiting != own_waiting_) {
    const uint64_t count = header()->waiting;
    __atomic_store_n(
        &header()->waiting,
        waiting ? count + 1 : count - std::min<uint64_t>(count, 1),
        __ATOMIC_RELEASE);
    own_waiting_ = waiting;
  }
  unlockFileByte(fd_, 0);
  return true;
}

DeviceWaitDecision DeviceLedger::decide(
    size_t size,
    size_t free_now,
    uint64_t ticket,
    const std::vector<Peer>& peers) {
  size_t others_hold = 0;
  bool all_wait = true;
  uint64_t youngest = ticket;
  for (const Peer& peer : peers) {
    if (peer.claim.held == 0) {
      continue; // nothing to release
    }
    others_hold += peer.claim.held;
    all_wait = all_wait && peer.claim.waiting != 0;
    youngest = std::max(youngest, peer.claim.ticket);
  }
  if (others_hold == 0 || size > free_now + others_hold) {
    return DeviceWaitDecision::NothingToWaitFor;
  }
  // Every holder waits: none releases unless one gives way, and the last to
  // join has done the least work (the host's rule).
  return all_wait && youngest == ticket ? DeviceWaitDecision::GiveWay
                                        : DeviceWaitDecision::Wait;
}

bool DeviceLedger::othersWaiting() {
  std::lock_guard<std::mutex> guard(mutex_);
  if (map_ == nullptr) {
    return false;
  }
  const uint64_t waiting =
      __atomic_load_n(&header()->waiting, __ATOMIC_ACQUIRE);
  return waiting > (own_waiting_ ? 1u : 0u);
}

} // namespace c10::cuda::lms
