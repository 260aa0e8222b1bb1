// simgpu: a host-memory stand-in for the CUDA runtime. See simgpu.h for the
// model and the differences from CUDA.
//
// Locking: `Sim::mu` guards the registries (devices, allocations, streams,
// events, pools, fault counters). Each stream and event has a mutex of its own
// for its queue or generation counters. Lock order is Sim::mu before a stream
// or event mutex; operations running on stream workers never hold their own
// stream's mutex, so they may take Sim::mu (stream-ordered frees do).

// Built with -fvisibility=hidden: only the functions declared by the CUDA
// runtime header and simgpu.h are exported.
#pragma GCC visibility push(default)
#include "simgpu.h"
#pragma GCC visibility pop

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxDevices = 16;
// cudaMalloc guarantees at least 256-byte alignment; pinned host allocations
// are page aligned.
constexpr size_t kDeviceAlignment = 256;
constexpr size_t kHostAlignment = 4096;
// Stream priorities of an H100: 0 (least) to -5 (greatest).
constexpr int kLeastPriority = 0;
constexpr int kGreatestPriority = -5;
constexpr int kDriverVersion = 13000;

// ---------------------------------------------------------------------------
// Per-thread error state, as CUDA keeps it per host thread.

thread_local cudaError_t tl_last_error = cudaSuccess;
thread_local std::string tl_detail;
thread_local int tl_device = 0;
thread_local cudaStreamCaptureMode tl_capture_mode =
    cudaStreamCaptureModeGlobal;

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") != 0 && *v != '\0';
}

struct Config {
  int device_count = 1;
  size_t capacity = size_t(256) << 20;
  bool scribble = false;
  bool verbose = false;
  double bandwidth = 0; // bytes per second; 0: unlimited
};

Config read_config() {
  Config c;
  if (const char* v = std::getenv("SIMGPU_DEVICE_COUNT")) {
    c.device_count = std::clamp(std::atoi(v), 0, kMaxDevices);
  }
  if (const char* v = std::getenv("SIMGPU_CAPACITY_MB")) {
    c.capacity = static_cast<size_t>(std::strtoull(v, nullptr, 10)) << 20;
  }
  if (const char* v = std::getenv("SIMGPU_COPY_GBPS")) {
    c.bandwidth = std::strtod(v, nullptr) * 1e9;
  }
  c.scribble = env_flag("SIMGPU_SCRIBBLE");
  c.verbose = env_flag("SIMGPU_VERBOSE");
  return c;
}

const Config& config() {
  static const Config c = read_config();
  return c;
}

cudaError_t ok() {
  tl_detail.clear();
  return cudaSuccess;
}

// Records a failure the way the CUDA runtime does (sticky until
// cudaGetLastError) and keeps the reason for simgpu_last_error_detail.
cudaError_t fail(cudaError_t err, std::string why) {
  tl_last_error = err;
  tl_detail = std::move(why);
  if (config().verbose) {
    std::fprintf(
        stderr, "simgpu: %s: %s\n", cudaGetErrorName(err), tl_detail.c_str());
  }
  return err;
}

// cudaErrorNotReady is a status, not an error: CUDA does not record it as the
// last error.
cudaError_t not_ready() {
  tl_detail = "work is still pending";
  return cudaErrorNotReady;
}

std::string fmt_ptr(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

// ---------------------------------------------------------------------------
// Streams.

struct Stream;
using StreamPtr = std::shared_ptr<Stream>;

// A stream is an ordered queue executed by a worker thread of its own,
// started at the first enqueue so idle streams (c10 creates pools of them)
// cost no thread.
struct Stream {
  int device = 0;
  unsigned flags = cudaStreamDefault;
  int priority = 0;
  unsigned long long id = 0;
  bool legacy = false;
  bool per_thread = false;

  std::mutex mu;
  std::condition_variable cv; // queue grew, work completed, or stopping
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
  bool stopping = false;
  bool started = false;
  // simgpu_set_capturing: the capture queries report an active capture.
  // Sim::mu guards it.
  bool capturing = false;

  // Blocking streams synchronize with the legacy default stream.
  bool blocking() const {
    return !legacy && (flags & cudaStreamNonBlocking) == 0;
  }
};

void worker_loop(StreamPtr s) {
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->cv.wait(lock, [&] { return s->stopping || !s->queue.empty(); });
    if (s->queue.empty()) {
      return; // stopping and drained
    }
    std::function<void()> op = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    op();
    lock.lock();
    ++s->completed;
    s->cv.notify_all();
  }
}

// Appends op; returns its position (1-based sequence number).
uint64_t push_op(const StreamPtr& s, std::function<void()> op) {
  std::lock_guard<std::mutex> lock(s->mu);
  s->queue.push_back(std::move(op));
  if (!s->started) {
    s->started = true;
    std::thread(worker_loop, s).detach();
  }
  s->cv.notify_all();
  return ++s->enqueued;
}

// Position of the last op enqueued so far, 0 when everything has completed.
uint64_t pending_position(const StreamPtr& s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return s->completed < s->enqueued ? s->enqueued : 0;
}

void wait_position(const StreamPtr& s, uint64_t pos) {
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait(lock, [&] { return s->completed >= pos; });
}

void wait_idle(const StreamPtr& s) {
  std::unique_lock<std::mutex> lock(s->mu);
  const uint64_t pos = s->enqueued;
  s->cv.wait(lock, [&] { return s->completed >= pos; });
}

// The worker drains what was enqueued, then exits; the op closures and the
// worker hold the last references.
void stop_stream(const StreamPtr& s) {
  std::lock_guard<std::mutex> lock(s->mu);
  s->stopping = true;
  s->cv.notify_all();
}

// ---------------------------------------------------------------------------
// Events.

struct Event {
  int device = 0;
  unsigned flags = cudaEventDefault;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0; // generation of the latest cudaEventRecord
  // Generations recorded but not yet executed by their stream. Tracked one by
  // one, as CUDA does: an event re-recorded on a faster stream must not
  // release waits on an earlier record that is still pending.
  std::set<uint64_t> pending;
  Clock::time_point time; // when the latest generation was executed

  bool reached(uint64_t gen) const {
    return pending.count(gen) == 0;
  }
};
using EventPtr = std::shared_ptr<Event>;

// ---------------------------------------------------------------------------
// Memory.

enum class AllocKind { Device, Managed, Async };

struct Allocation {
  size_t size = 0;
  AllocKind kind = AllocKind::Device;
  bool free_pending = false; // cudaFreeAsync enqueued
};

enum class HostKind { Pinned, Registered };

struct HostRange {
  size_t size = 0;
  HostKind kind = HostKind::Pinned;
  unsigned flags = 0;
  int device = 0; // current device when allocated or registered
};

struct MemPool {
  int device = 0;
  uint64_t release_threshold = 0;
  int reuse_follow_event = 1;
  int reuse_opportunistic = 1;
  int reuse_internal = 1;
  size_t used = 0;
  size_t used_high = 0;
};

struct Device {
  int index = 0;
  size_t capacity = 0;
  simgpu_device_stats stats{};
  std::map<uintptr_t, Allocation> allocs;
  StreamPtr legacy;
  // Every live stream of the device, for cudaDeviceSynchronize and the legacy
  // stream's implicit synchronization.
  std::unordered_map<Stream*, StreamPtr> streams;
  MemPool pool;
  unsigned flags = 0;
};

struct Fault {
  int countdown = 0; // operations left before the first failure; 0: disarmed
  int remaining = 0; // failures left once firing; < 0: forever
  cudaError_t error = cudaSuccess;
};

struct Sim {
  std::mutex mu;
  std::vector<Device> devices;
  std::map<uintptr_t, HostRange> host;
  simgpu_host_stats host_stats{};
  std::unordered_map<void*, StreamPtr> streams; // user-created handles
  std::unordered_map<void*, EventPtr> events;
  Fault faults[3];
  size_t faults_fired = 0;
  unsigned long long next_stream_id = 1;
  std::atomic<double> bandwidth{0};

  Sim() {
    const Config& c = config();
    devices.resize(c.device_count);
    for (int i = 0; i < c.device_count; ++i) {
      devices[i].index = i;
      devices[i].capacity = c.capacity;
      devices[i].stats.capacity = c.capacity;
      devices[i].pool.device = i;
    }
    bandwidth = c.bandwidth;
  }
};

// Never destroyed: stream workers may still run while static destructors do.
Sim& sim() {
  static Sim* s = new Sim();
  return *s;
}

int device_count() {
  return static_cast<int>(sim().devices.size());
}

bool valid_device(int d) {
  return d >= 0 && d < device_count();
}

cudaError_t bad_device(int d) {
  return fail(
      cudaErrorInvalidDevice,
      "device " + std::to_string(d) + " does not exist (" +
          std::to_string(device_count()) +
          " simulated; set SIMGPU_DEVICE_COUNT)");
}

// Checks the current device before it is used implicitly.
cudaError_t check_current_device() {
  if (device_count() == 0) {
    return fail(
        cudaErrorNoDevice, "SIMGPU_DEVICE_COUNT=0: no simulated devices");
  }
  if (!valid_device(tl_device)) {
    return bad_device(tl_device);
  }
  return cudaSuccess;
}

// Consumes one operation of `kind`; returns the error to fail with, or
// cudaSuccess. Call with Sim::mu held.
cudaError_t take_fault(Sim& s, simgpu_fault_kind kind) {
  Fault& f = s.faults[kind];
  if (f.countdown <= 0) {
    return cudaSuccess;
  }
  if (f.countdown > 1) {
    --f.countdown;
    return cudaSuccess;
  }
  // Firing.
  ++s.faults_fired;
  if (f.remaining > 0 && --f.remaining == 0) {
    f.countdown = 0;
  }
  return f.error;
}

// Locates the device allocation containing [p, p + n). Sim::mu held.
struct DeviceHit {
  Device* device = nullptr;
  uintptr_t base = 0;
  Allocation* alloc = nullptr;
};

DeviceHit find_device_alloc(Sim& s, const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  for (Device& d : s.devices) {
    auto it = d.allocs.upper_bound(addr);
    if (it == d.allocs.begin()) {
      continue;
    }
    --it;
    if (addr < it->first + std::max<size_t>(it->second.size, 1)) {
      return {&d, it->first, &it->second};
    }
  }
  return {};
}

const HostRange* find_host_range(Sim& s, const void* p, uintptr_t* base) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = s.host.upper_bound(addr);
  if (it == s.host.begin()) {
    return nullptr;
  }
  --it;
  if (addr < it->first + std::max<size_t>(it->second.size, 1)) {
    if (base != nullptr) {
      *base = it->first;
    }
    return &it->second;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// Stream handles.

// The legacy default stream of a device. Sim::mu held.
StreamPtr legacy_stream(Sim& s, int device) {
  Device& d = s.devices[device];
  if (!d.legacy) {
    d.legacy = std::make_shared<Stream>();
    d.legacy->device = device;
    d.legacy->legacy = true;
    d.legacy->id = 0;
    d.streams.emplace(d.legacy.get(), d.legacy);
  }
  return d.legacy;
}

// cudaStreamPerThread: one stream per host thread and device, released when
// the thread exits.
struct PerThreadStreams {
  StreamPtr by_device[kMaxDevices];
  ~PerThreadStreams() {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    for (StreamPtr& st : by_device) {
      if (st) {
        s.devices[st->device].streams.erase(st.get());
        stop_stream(st);
        st.reset();
      }
    }
  }
};
thread_local PerThreadStreams tl_streams;

StreamPtr per_thread_stream(Sim& s, int device) {
  StreamPtr& st = tl_streams.by_device[device];
  if (!st) {
    st = std::make_shared<Stream>();
    st->device = device;
    st->per_thread = true;
    st->id = s.next_stream_id++;
    s.devices[device].streams.emplace(st.get(), st);
  }
  return st;
}

// Resolves a handle (0, cudaStreamLegacy, cudaStreamPerThread or one from
// cudaStreamCreate*). Sim::mu held.
cudaError_t resolve_stream(Sim& s, cudaStream_t h, StreamPtr* out) {
  if (h == nullptr || h == cudaStreamLegacy || h == cudaStreamPerThread) {
    cudaError_t err = check_current_device();
    if (err != cudaSuccess) {
      return err;
    }
    *out = h == cudaStreamPerThread ? per_thread_stream(s, tl_device)
                                    : legacy_stream(s, tl_device);
    return cudaSuccess;
  }
  auto it = s.streams.find(static_cast<void*>(h));
  if (it == s.streams.end()) {
    return fail(
        cudaErrorInvalidResourceHandle,
        "stream " + fmt_ptr(h) + " was not created or was destroyed");
  }
  *out = it->second;
  return cudaSuccess;
}

// Enqueues op on s, first making s wait for what the legacy-stream rules
// require: work on the legacy stream waits for all blocking streams of the
// device, and work on a blocking stream waits for the legacy stream.
// Sim::mu held.
uint64_t enqueue(Sim& s, const StreamPtr& st, std::function<void()> op) {
  Device& d = s.devices[st->device];
  if (st->legacy) {
    for (auto& entry : d.streams) {
      const StreamPtr& other = entry.second;
      if (other == st || !other->blocking()) {
        continue;
      }
      if (uint64_t pos = pending_position(other)) {
        push_op(st, [other, pos] { wait_position(other, pos); });
      }
    }
  } else if (st->blocking() && d.legacy) {
    if (uint64_t pos = pending_position(d.legacy)) {
      StreamPtr legacy = d.legacy;
      push_op(st, [legacy, pos] { wait_position(legacy, pos); });
    }
  }
  return push_op(st, std::move(op));
}

// Waits for every stream of a device. Takes Sim::mu briefly.
void synchronize_device(int device) {
  std::vector<StreamPtr> streams;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto& entry : s.devices[device].streams) {
      streams.push_back(entry.second);
    }
  }
  for (const StreamPtr& st : streams) {
    wait_idle(st);
  }
}

void synchronize_all_devices() {
  for (int d = 0; d < device_count(); ++d) {
    synchronize_device(d);
  }
}

// ---------------------------------------------------------------------------
// Allocation.

cudaError_t device_alloc(void** ptr, size_t size, AllocKind kind, int device) {
  if (ptr == nullptr) {
    return fail(cudaErrorInvalidValue, "devPtr is NULL");
  }
  *ptr = nullptr;
  if (size == 0) {
    return ok(); // CUDA returns success and a NULL pointer
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  Device& d = s.devices[device];
  if (cudaError_t err = take_fault(s, SIMGPU_FAULT_DEVICE_ALLOC)) {
    return fail(
        err,
        "injected fault: device allocation of " + std::to_string(size) +
            " bytes on device " + std::to_string(device));
  }
  if (size > d.capacity || d.stats.bytes_in_use > d.capacity - size) {
    return fail(
        cudaErrorMemoryAllocation,
        "device " + std::to_string(device) + ": cannot allocate " +
            std::to_string(size) + " bytes, " +
            std::to_string(d.stats.bytes_in_use) + " of " +
            std::to_string(d.capacity) + " in use");
  }
  void* p = nullptr;
  const size_t rounded =
      (size + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
  if (posix_memalign(&p, kDeviceAlignment, rounded) != 0) {
    return fail(
        cudaErrorMemoryAllocation,
        "host memory backing " + std::to_string(size) +
            " bytes of device memory is exhausted");
  }
  if (config().scribble) {
    std::memset(p, 0xCD, rounded);
  }
  d.allocs[reinterpret_cast<uintptr_t>(p)] = Allocation{size, kind, false};
  d.stats.bytes_in_use += size;
  d.stats.bytes_peak = std::max(d.stats.bytes_peak, d.stats.bytes_in_use);
  ++d.stats.alloc_count;
  if (kind == AllocKind::Async) {
    d.pool.used += size;
    d.pool.used_high = std::max(d.pool.used_high, d.pool.used);
  }
  *ptr = p;
  return ok();
}

// Releases an allocation found under Sim::mu (which must be held).
void release_device_alloc(Device& d, uintptr_t base) {
  auto it = d.allocs.find(base);
  const Allocation a = it->second;
  d.allocs.erase(it);
  d.stats.bytes_in_use -= a.size;
  ++d.stats.free_count;
  if (a.kind == AllocKind::Async) {
    d.pool.used -= a.size;
  }
  void* p = reinterpret_cast<void*>(base);
  if (config().scribble) {
    std::memset(p, 0xDD, a.size);
  }
  std::free(p);
}

cudaError_t host_alloc(void** ptr, size_t size, unsigned flags) {
  if (ptr == nullptr) {
    return fail(cudaErrorInvalidValue, "pHost is NULL");
  }
  *ptr = nullptr;
  const unsigned known =
      cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined;
  if ((flags & ~known) != 0) {
    return fail(cudaErrorInvalidValue, "unknown cudaHostAlloc flags");
  }
  if (size == 0) {
    return ok();
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  if (cudaError_t err = take_fault(s, SIMGPU_FAULT_HOST_ALLOC)) {
    return fail(
        err,
        "injected fault: pinned host allocation of " + std::to_string(size) +
            " bytes");
  }
  void* p = nullptr;
  if (posix_memalign(&p, kHostAlignment, size) != 0) {
    return fail(
        cudaErrorMemoryAllocation,
        "cannot allocate " + std::to_string(size) + " bytes of host memory");
  }
  s.host[reinterpret_cast<uintptr_t>(p)] =
      HostRange{size, HostKind::Pinned, flags, tl_device};
  s.host_stats.bytes_in_use += size;
  s.host_stats.bytes_peak =
      std::max(s.host_stats.bytes_peak, s.host_stats.bytes_in_use);
  ++s.host_stats.alloc_count;
  *ptr = p;
  return ok();
}

// ---------------------------------------------------------------------------
// Copies.

enum class Where { Device, PinnedHost, PageableHost };

struct Side {
  Where where = Where::PageableHost;
  int device = -1;
};

// Classifies [p, p + n) and checks that device ranges stay inside their
// allocation. Sim::mu held.
cudaError_t classify(
    Sim& s,
    const void* p,
    size_t n,
    const char* what,
    Side* out) {
  DeviceHit hit = find_device_alloc(s, p);
  if (hit.alloc != nullptr) {
    const auto offset = reinterpret_cast<uintptr_t>(p) - hit.base;
    if (n > hit.alloc->size - offset) {
      return fail(
          cudaErrorInvalidValue,
          std::string(what) + " range of " + std::to_string(n) +
              " bytes at offset " + std::to_string(offset) +
              " overruns its device allocation of " +
              std::to_string(hit.alloc->size) + " bytes");
    }
    if (hit.alloc->free_pending) {
      return fail(
          cudaErrorInvalidValue,
          std::string(what) + " " + fmt_ptr(p) +
              " lies in memory already passed to cudaFreeAsync");
    }
    out->where = Where::Device;
    out->device = hit.device->index;
    return cudaSuccess;
  }
  out->where = find_host_range(s, p, nullptr) != nullptr ? Where::PinnedHost
                                                         : Where::PageableHost;
  return cudaSuccess;
}

bool is_host(const Side& side) {
  return side.where != Where::Device;
}

void throttle(Clock::time_point start, size_t n) {
  const double bw = sim().bandwidth.load();
  if (bw > 0) {
    const auto due = start +
        std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(double(n) / bw));
    std::this_thread::sleep_until(due);
  }
}

// Enqueues a copy on `stream`; waits for it when `sync` or when host memory
// on either side is pageable (see simgpu.h).
cudaError_t copy(
    void* dst,
    const void* src,
    size_t n,
    cudaMemcpyKind kind,
    cudaStream_t stream,
    bool sync,
    int dst_device_hint,
    int src_device_hint) {
  if (n == 0) {
    return ok();
  }
  if (dst == nullptr || src == nullptr) {
    return fail(cudaErrorInvalidValue, "copy with a NULL pointer");
  }
  Sim& s = sim();
  StreamPtr st;
  uint64_t pos = 0;
  bool pageable = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = resolve_stream(s, stream, &st)) {
      return err;
    }
    Side d;
    Side sr;
    if (cudaError_t err = classify(s, dst, n, "destination", &d)) {
      return err;
    }
    if (cudaError_t err = classify(s, src, n, "source", &sr)) {
      return err;
    }
    bool kind_ok = true;
    switch (kind) {
      case cudaMemcpyHostToHost:
        kind_ok = is_host(d) && is_host(sr);
        break;
      case cudaMemcpyHostToDevice:
        kind_ok = !is_host(d) && is_host(sr);
        break;
      case cudaMemcpyDeviceToHost:
        kind_ok = is_host(d) && !is_host(sr);
        break;
      case cudaMemcpyDeviceToDevice:
        kind_ok = !is_host(d) && !is_host(sr);
        break;
      case cudaMemcpyDefault:
        break;
      default:
        return fail(
            cudaErrorInvalidMemcpyDirection,
            "cudaMemcpyKind " + std::to_string(int(kind)) + " is not valid");
    }
    if (!kind_ok) {
      return fail(
          cudaErrorInvalidValue,
          std::string("pointers do not match the cudaMemcpyKind: dst is ") +
              (is_host(d) ? "host" : "device") + " memory, src is " +
              (is_host(sr) ? "host" : "device") + " memory");
    }
    if (dst_device_hint >= 0 && d.device != dst_device_hint) {
      return fail(
          cudaErrorInvalidValue,
          "dst is not memory of device " + std::to_string(dst_device_hint));
    }
    if (src_device_hint >= 0 && sr.device != src_device_hint) {
      return fail(
          cudaErrorInvalidValue,
          "src is not memory of device " + std::to_string(src_device_hint));
    }
    if (cudaError_t err = take_fault(s, SIMGPU_FAULT_COPY)) {
      return fail(
          err,
          "injected fault: copy of " + std::to_string(n) + " bytes from " +
              fmt_ptr(src) + " to " + fmt_ptr(dst));
    }
    pageable =
        d.where == Where::PageableHost || sr.where == Where::PageableHost;
    // Count the copy on the device whose memory it touches.
    if (!is_host(d) && !is_host(sr)) {
      simgpu_device_stats& stats = s.devices[d.device].stats;
      ++stats.copies_d2d;
      stats.bytes_d2d += n;
    } else if (!is_host(d)) {
      simgpu_device_stats& stats = s.devices[d.device].stats;
      ++stats.copies_h2d;
      stats.bytes_h2d += n;
    } else if (!is_host(sr)) {
      simgpu_device_stats& stats = s.devices[sr.device].stats;
      ++stats.copies_d2h;
      stats.bytes_d2h += n;
    } else {
      simgpu_device_stats& stats = s.devices[st->device].stats;
      ++stats.copies_h2h;
      stats.bytes_h2h += n;
    }
    pos = enqueue(s, st, [dst, src, n] {
      const auto start = Clock::now();
      std::memmove(dst, src, n);
      throttle(start, n);
    });
  }
  if (sync || pageable) {
    wait_position(st, pos);
  }
  return ok();
}

cudaError_t memset_impl(
    void* p,
    int value,
    size_t n,
    cudaStream_t stream,
    bool sync) {
  if (n == 0) {
    return ok();
  }
  Sim& s = sim();
  StreamPtr st;
  uint64_t pos = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = resolve_stream(s, stream, &st)) {
      return err;
    }
    Side side;
    if (cudaError_t err = classify(s, p, n, "memset", &side)) {
      return err;
    }
    if (side.where == Where::PageableHost) {
      return fail(
          cudaErrorInvalidValue,
          "cudaMemset on " + fmt_ptr(p) +
              ", which is neither device nor pinned host memory");
    }
    pos = enqueue(s, st, [p, value, n] { std::memset(p, value, n); });
  }
  if (sync) {
    wait_position(st, pos);
  }
  return ok();
}

cudaError_t create_stream(cudaStream_t* out, unsigned flags, int priority) {
  if (out == nullptr) {
    return fail(cudaErrorInvalidValue, "pStream is NULL");
  }
  if ((flags & ~unsigned(cudaStreamNonBlocking)) != 0) {
    return fail(cudaErrorInvalidValue, "unknown stream flags");
  }
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  auto st = std::make_shared<Stream>();
  st->device = tl_device;
  st->flags = flags;
  // CUDA clamps out-of-range priorities rather than failing.
  st->priority = std::clamp(priority, kGreatestPriority, kLeastPriority);
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  st->id = s.next_stream_id++;
  s.streams.emplace(st.get(), st);
  s.devices[st->device].streams.emplace(st.get(), st);
  *out = reinterpret_cast<cudaStream_t>(st.get());
  return ok();
}

cudaError_t lookup_event(Sim& s, cudaEvent_t h, EventPtr* out) {
  auto it = s.events.find(static_cast<void*>(h));
  if (it == s.events.end()) {
    return fail(
        cudaErrorInvalidResourceHandle,
        "event " + fmt_ptr(h) + " was not created or was destroyed");
  }
  *out = it->second;
  return cudaSuccess;
}

const char* ipc_reason() {
  return "CUDA IPC shares device memory between processes; simulated device "
         "memory is private to this process";
}

// cudaDeviceGetAttribute's answers, from the same properties as
// cudaGetDeviceProperties.
cudaDeviceProp make_props(int device, size_t capacity) {
  cudaDeviceProp p;
  std::memset(&p, 0, sizeof(p));
  std::snprintf(p.name, sizeof(p.name), "simgpu %d (host memory)", device);
  for (size_t i = 0; i < sizeof(p.uuid.bytes); ++i) {
    p.uuid.bytes[i] = static_cast<char>(0x5A ^ (i * 7) ^ device);
  }
  p.totalGlobalMem = capacity;
  p.sharedMemPerBlock = 48 << 10;
  p.regsPerBlock = 65536;
  p.warpSize = 32;
  p.memPitch = 2147483647;
  p.maxThreadsPerBlock = 1024;
  p.maxThreadsDim[0] = 1024;
  p.maxThreadsDim[1] = 1024;
  p.maxThreadsDim[2] = 64;
  p.maxGridSize[0] = 2147483647;
  p.maxGridSize[1] = 65535;
  p.maxGridSize[2] = 65535;
  p.totalConstMem = 64 << 10;
  p.major = 9;
  p.minor = 0;
  p.textureAlignment = 512;
  p.texturePitchAlignment = 32;
  p.multiProcessorCount = 132;
  p.canMapHostMemory = 1;
  p.concurrentKernels = 1;
  p.pciBusID = device + 1;
  p.pciDeviceID = 0;
  p.pciDomainID = 0;
  p.asyncEngineCount = 2;
  p.unifiedAddressing = 1;
  p.memoryBusWidth = 5120;
  p.l2CacheSize = 50 << 20;
  p.maxThreadsPerMultiProcessor = 2048;
  p.streamPrioritiesSupported = 1;
  p.globalL1CacheSupported = 1;
  p.localL1CacheSupported = 1;
  p.sharedMemPerMultiprocessor = 228 << 10;
  p.regsPerMultiprocessor = 65536;
  p.managedMemory = 1;
  p.concurrentManagedAccess = 1;
  p.computePreemptionSupported = 1;
  p.canUseHostPointerForRegisteredMem = 1;
  p.cooperativeLaunch = 1;
  p.sharedMemPerBlockOptin = 227 << 10;
  p.maxBlocksPerMultiProcessor = 32;
  p.hostRegisterSupported = 1;
  p.memoryPoolsSupported = 1;
  p.memoryPoolSupportedHandleTypes = 0; // no IPC handle types
  p.ipcEventSupported = 0;
  p.deviceNumaId = -1;
  p.hostNumaId = -1;
  return p;
}

MemPool* lookup_pool(cudaMemPool_t h) {
  for (Device& d : sim().devices) {
    if (reinterpret_cast<cudaMemPool_t>(&d.pool) == h) {
      return &d.pool;
    }
  }
  return nullptr;
}

std::string cuda_error_text(cudaError_t e, bool name);

// ---------------------------------------------------------------------------
// Runtime calls by function (simgpu_call_count): what a caller's host time
// per operation is made of, countable on a machine without a GPU. Only the
// outermost exported call of a thread counts: cudaEventRecord is one call,
// not also one of the cudaEventRecordWithFlags it is made of.

struct CallSite {
  const char* function;
  std::atomic<size_t> calls{0};
};

std::mutex& call_sites_mutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// Leaked, like the interned strings: counts stay readable at exit.
std::vector<CallSite*>& call_sites() {
  static std::vector<CallSite*>* sites = new std::vector<CallSite*>;
  return *sites;
}

CallSite& register_call_site(const char* function) {
  std::lock_guard<std::mutex> lock(call_sites_mutex());
  CallSite* site = new CallSite;
  site->function = function;
  call_sites().push_back(site);
  return *site;
}

thread_local int tl_call_depth = 0;

class CountedCall {
 public:
  explicit CountedCall(CallSite& site) {
    if (tl_call_depth++ == 0) {
      site.calls.fetch_add(1, std::memory_order_relaxed);
    }
  }
  ~CountedCall() {
    --tl_call_depth;
  }
  CountedCall(const CountedCall&) = delete;
  CountedCall& operator=(const CountedCall&) = delete;
};

#define SIMGPU_COUNT_CALL()                                         \
  static CallSite& simgpu_call_site = register_call_site(__func__); \
  const CountedCall simgpu_counted_call(simgpu_call_site)

} // namespace

// ===========================================================================
// CUDA runtime API.

extern "C" {

// ---- errors and versions ---------------------------------------------------

cudaError_t cudaGetLastError(void) {
  SIMGPU_COUNT_CALL();
  cudaError_t e = tl_last_error;
  tl_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  SIMGPU_COUNT_CALL();
  return tl_last_error;
}

const char* cudaGetErrorString(cudaError_t error) {
  SIMGPU_COUNT_CALL();
  // Interned so the pointer outlives the call, as CUDA's does.
  static std::mutex mu;
  static std::map<int, std::string>* strings = new std::map<int, std::string>;
  std::lock_guard<std::mutex> lock(mu);
  auto it = strings->find(error);
  if (it == strings->end()) {
    it = strings->emplace(error, cuda_error_text(error, false)).first;
  }
  return it->second.c_str();
}

const char* cudaGetErrorName(cudaError_t error) {
  SIMGPU_COUNT_CALL();
  static std::mutex mu;
  static std::map<int, std::string>* names = new std::map<int, std::string>;
  std::lock_guard<std::mutex> lock(mu);
  auto it = names->find(error);
  if (it == names->end()) {
    it = names->emplace(error, cuda_error_text(error, true)).first;
  }
  return it->second.c_str();
}

cudaError_t cudaDriverGetVersion(int* driverVersion) {
  SIMGPU_COUNT_CALL();
  if (driverVersion == nullptr) {
    return fail(cudaErrorInvalidValue, "driverVersion is NULL");
  }
  *driverVersion = kDriverVersion;
  return ok();
}

cudaError_t cudaRuntimeGetVersion(int* runtimeVersion) {
  SIMGPU_COUNT_CALL();
  if (runtimeVersion == nullptr) {
    return fail(cudaErrorInvalidValue, "runtimeVersion is NULL");
  }
  *runtimeVersion = CUDART_VERSION;
  return ok();
}

// ---- devices ---------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  SIMGPU_COUNT_CALL();
  if (count == nullptr) {
    return fail(cudaErrorInvalidValue, "count is NULL");
  }
  *count = device_count();
  if (*count == 0) {
    return fail(
        cudaErrorNoDevice, "SIMGPU_DEVICE_COUNT=0: no simulated devices");
  }
  return ok();
}

cudaError_t cudaGetDevice(int* device) {
  SIMGPU_COUNT_CALL();
  if (device == nullptr) {
    return fail(cudaErrorInvalidValue, "device is NULL");
  }
  *device = tl_device;
  return ok();
}

cudaError_t cudaSetDevice(int device) {
  SIMGPU_COUNT_CALL();
  if (!valid_device(device)) {
    return bad_device(device);
  }
  tl_device = device;
  return ok();
}

cudaError_t cudaInitDevice(int device, unsigned int deviceFlags, unsigned int) {
  SIMGPU_COUNT_CALL();
  if (!valid_device(device)) {
    return bad_device(device);
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  s.devices[device].flags = deviceFlags;
  return ok();
}

cudaError_t cudaSetDeviceFlags(unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  s.devices[tl_device].flags = flags;
  return ok();
}

cudaError_t cudaGetDeviceFlags(unsigned int* flags) {
  SIMGPU_COUNT_CALL();
  if (flags == nullptr) {
    return fail(cudaErrorInvalidValue, "flags is NULL");
  }
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  *flags = s.devices[tl_device].flags;
  return ok();
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  SIMGPU_COUNT_CALL();
  if (prop == nullptr) {
    return fail(cudaErrorInvalidValue, "prop is NULL");
  }
  if (!valid_device(device)) {
    return bad_device(device);
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  *prop = make_props(device, s.devices[device].capacity);
  return ok();
}

cudaError_t cudaDeviceGetAttribute(
    int* value,
    cudaDeviceAttr attr,
    int device) {
  SIMGPU_COUNT_CALL();
  if (value == nullptr) {
    return fail(cudaErrorInvalidValue, "value is NULL");
  }
  if (!valid_device(device)) {
    return bad_device(device);
  }
  const cudaDeviceProp p = make_props(device, 0);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = p.maxThreadsPerBlock;
      break;
    case cudaDevAttrMaxBlockDimX:
      *value = p.maxThreadsDim[0];
      break;
    case cudaDevAttrMaxBlockDimY:
      *value = p.maxThreadsDim[1];
      break;
    case cudaDevAttrMaxBlockDimZ:
      *value = p.maxThreadsDim[2];
      break;
    case cudaDevAttrMaxGridDimX:
      *value = p.maxGridSize[0];
      break;
    case cudaDevAttrMaxGridDimY:
      *value = p.maxGridSize[1];
      break;
    case cudaDevAttrMaxGridDimZ:
      *value = p.maxGridSize[2];
      break;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(p.sharedMemPerBlock);
      break;
    case cudaDevAttrWarpSize:
      *value = p.warpSize;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = p.multiProcessorCount;
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = p.major;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = p.minor;
      break;
    case cudaDevAttrIntegrated:
      *value = p.integrated;
      break;
    case cudaDevAttrCanMapHostMemory:
      *value = p.canMapHostMemory;
      break;
    case cudaDevAttrConcurrentKernels:
      *value = p.concurrentKernels;
      break;
    case cudaDevAttrPciBusId:
      *value = p.pciBusID;
      break;
    case cudaDevAttrPciDeviceId:
      *value = p.pciDeviceID;
      break;
    case cudaDevAttrPciDomainId:
      *value = p.pciDomainID;
      break;
    case cudaDevAttrAsyncEngineCount:
      *value = p.asyncEngineCount;
      break;
    case cudaDevAttrUnifiedAddressing:
      *value = p.unifiedAddressing;
      break;
    case cudaDevAttrGlobalMemoryBusWidth:
      *value = p.memoryBusWidth;
      break;
    case cudaDevAttrL2CacheSize:
      *value = p.l2CacheSize;
      break;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      *value = p.maxThreadsPerMultiProcessor;
      break;
    case cudaDevAttrStreamPrioritiesSupported:
      *value = p.streamPrioritiesSupported;
      break;
    case cudaDevAttrManagedMemory:
      *value = p.managedMemory;
      break;
    case cudaDevAttrConcurrentManagedAccess:
      *value = p.concurrentManagedAccess;
      break;
    case cudaDevAttrMemoryPoolsSupported:
      *value = p.memoryPoolsSupported;
      break;
    case cudaDevAttrMemoryPoolSupportedHandleTypes:
      *value = static_cast<int>(p.memoryPoolSupportedHandleTypes);
      break;
    case cudaDevAttrHostRegisterSupported:
      *value = p.hostRegisterSupported;
      break;
    case cudaDevAttrCanUseHostPointerForRegisteredMem:
      *value = p.canUseHostPointerForRegisteredMem;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(p.sharedMemPerBlockOptin);
      break;
    case cudaDevAttrMaxBlocksPerMultiprocessor:
      *value = p.maxBlocksPerMultiProcessor;
      break;
    case cudaDevAttrCooperativeLaunch:
      *value = p.cooperativeLaunch;
      break;
    default:
      return fail(
          cudaErrorNotSupported,
          "cudaDeviceGetAttribute: attribute " + std::to_string(int(attr)) +
              " is not simulated");
  }
  return ok();
}

cudaError_t cudaDeviceGetPCIBusId(char* pciBusId, int len, int device) {
  SIMGPU_COUNT_CALL();
  if (pciBusId == nullptr || len <= 0) {
    return fail(cudaErrorInvalidValue, "pciBusId buffer is empty");
  }
  if (!valid_device(device)) {
    return bad_device(device);
  }
  std::snprintf(pciBusId, size_t(len), "0000:%02x:00.0", device + 1);
  return ok();
}

cudaError_t cudaDeviceSynchronize(void) {
  SIMGPU_COUNT_CALL();
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  synchronize_device(tl_device);
  return ok();
}

cudaError_t cudaDeviceGetStreamPriorityRange(
    int* leastPriority,
    int* greatestPriority) {
  SIMGPU_COUNT_CALL();
  if (leastPriority != nullptr) {
    *leastPriority = kLeastPriority;
  }
  if (greatestPriority != nullptr) {
    *greatestPriority = kGreatestPriority;
  }
  return ok();
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  SIMGPU_COUNT_CALL();
  if (free == nullptr || total == nullptr) {
    return fail(cudaErrorInvalidValue, "free or total is NULL");
  }
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  const Device& d = s.devices[tl_device];
  *total = d.capacity;
  *free =
      d.stats.bytes_in_use < d.capacity ? d.capacity - d.stats.bytes_in_use : 0;
  return ok();
}

// ---- peers (simulated devices are never peers) ------------------------------

cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peer) {
  SIMGPU_COUNT_CALL();
  if (canAccessPeer == nullptr) {
    return fail(cudaErrorInvalidValue, "canAccessPeer is NULL");
  }
  if (!valid_device(device)) {
    return bad_device(device);
  }
  if (!valid_device(peer)) {
    return bad_device(peer);
  }
  *canAccessPeer = 0;
  return ok();
}

cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (flags != 0) {
    return fail(cudaErrorInvalidValue, "flags must be 0");
  }
  if (!valid_device(peerDevice)) {
    return bad_device(peerDevice);
  }
  return fail(
      cudaErrorPeerAccessUnsupported,
      "simulated devices have no peer access; copies between devices go "
      "through cudaMemcpyPeer*");
}

cudaError_t cudaDeviceDisablePeerAccess(int peerDevice) {
  SIMGPU_COUNT_CALL();
  if (!valid_device(peerDevice)) {
    return bad_device(peerDevice);
  }
  return fail(
      cudaErrorPeerAccessNotEnabled,
      "peer access to device " + std::to_string(peerDevice) +
          " was never enabled");
}

// ---- IPC (not possible across processes) -----------------------------------

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t*, void*) {
  SIMGPU_COUNT_CALL();
  return fail(cudaErrorNotSupported, ipc_reason());
}

cudaError_t cudaIpcOpenMemHandle(void** devPtr, cudaIpcMemHandle_t, unsigned) {
  SIMGPU_COUNT_CALL();
  if (devPtr != nullptr) {
    *devPtr = nullptr;
  }
  return fail(cudaErrorNotSupported, ipc_reason());
}

cudaError_t cudaIpcCloseMemHandle(void*) {
  SIMGPU_COUNT_CALL();
  return fail(cudaErrorNotSupported, ipc_reason());
}

cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t*, cudaEvent_t) {
  SIMGPU_COUNT_CALL();
  return fail(cudaErrorNotSupported, ipc_reason());
}

cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t) {
  SIMGPU_COUNT_CALL();
  if (event != nullptr) {
    *event = nullptr;
  }
  return fail(cudaErrorNotSupported, ipc_reason());
}

// ---- device memory ---------------------------------------------------------

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  SIMGPU_COUNT_CALL();
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  return device_alloc(devPtr, size, AllocKind::Device, tl_device);
}

cudaError_t cudaMallocManaged(void** devPtr, size_t size, unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost) {
    return fail(
        cudaErrorInvalidValue,
        "flags must be cudaMemAttachGlobal or "
        "cudaMemAttachHost");
  }
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  return device_alloc(devPtr, size, AllocKind::Managed, tl_device);
}

cudaError_t cudaFree(void* devPtr) {
  SIMGPU_COUNT_CALL();
  if (devPtr == nullptr) {
    return ok();
  }
  int device = -1;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    DeviceHit hit = find_device_alloc(s, devPtr);
    if (hit.alloc == nullptr ||
        hit.base != reinterpret_cast<uintptr_t>(devPtr)) {
      return fail(
          cudaErrorInvalidValue,
          "cudaFree(" + fmt_ptr(devPtr) +
              "): not the start of a device allocation");
    }
    if (hit.alloc->free_pending) {
      return fail(
          cudaErrorInvalidValue,
          "cudaFree(" + fmt_ptr(devPtr) + "): already passed to cudaFreeAsync");
    }
    // Claim it so a concurrent free of the same pointer fails.
    hit.alloc->free_pending = true;
    device = hit.device->index;
  }
  // cudaFree synchronizes the device: work in flight may still use the memory.
  synchronize_device(device);
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  release_device_alloc(s.devices[device], reinterpret_cast<uintptr_t>(devPtr));
  return ok();
}

cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream) {
  SIMGPU_COUNT_CALL();
  StreamPtr st;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = resolve_stream(s, hStream, &st)) {
      return err;
    }
  }
  // The memory exists from now on, which is a valid refinement of "usable
  // from this point of the stream".
  return device_alloc(devPtr, size, AllocKind::Async, st->device);
}

cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
  SIMGPU_COUNT_CALL();
  if (devPtr == nullptr) {
    return ok();
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, hStream, &st)) {
    return err;
  }
  DeviceHit hit = find_device_alloc(s, devPtr);
  if (hit.alloc == nullptr || hit.base != reinterpret_cast<uintptr_t>(devPtr) ||
      hit.alloc->free_pending) {
    return fail(
        cudaErrorInvalidValue,
        "cudaFreeAsync(" + fmt_ptr(devPtr) +
            "): not the start of a live device allocation");
  }
  hit.alloc->free_pending = true;
  const int device = hit.device->index;
  const uintptr_t base = hit.base;
  // Stream-ordered: the memory is released when the stream gets there.
  enqueue(s, st, [device, base] {
    Sim& sm = sim();
    std::lock_guard<std::mutex> l(sm.mu);
    release_device_alloc(sm.devices[device], base);
  });
  return ok();
}

// ---- memory pools (one default pool per device, no caching) ----------------

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* memPool, int device) {
  SIMGPU_COUNT_CALL();
  if (memPool == nullptr) {
    return fail(cudaErrorInvalidValue, "memPool is NULL");
  }
  if (!valid_device(device)) {
    return bad_device(device);
  }
  *memPool = reinterpret_cast<cudaMemPool_t>(&sim().devices[device].pool);
  return ok();
}

cudaError_t cudaDeviceGetMemPool(cudaMemPool_t* memPool, int device) {
  SIMGPU_COUNT_CALL();
  return cudaDeviceGetDefaultMemPool(memPool, device);
}

cudaError_t cudaMemPoolSetAttribute(
    cudaMemPool_t memPool,
    cudaMemPoolAttr attr,
    void* value) {
  SIMGPU_COUNT_CALL();
  if (value == nullptr) {
    return fail(cudaErrorInvalidValue, "value is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  MemPool* p = lookup_pool(memPool);
  if (p == nullptr) {
    return fail(cudaErrorInvalidValue, "unknown memory pool");
  }
  switch (attr) {
    case cudaMemPoolReuseFollowEventDependencies:
      p->reuse_follow_event = *static_cast<int*>(value);
      break;
    case cudaMemPoolReuseAllowOpportunistic:
      p->reuse_opportunistic = *static_cast<int*>(value);
      break;
    case cudaMemPoolReuseAllowInternalDependencies:
      p->reuse_internal = *static_cast<int*>(value);
      break;
    case cudaMemPoolAttrReleaseThreshold:
      p->release_threshold = *static_cast<uint64_t*>(value);
      break;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:
      // Only resetting to zero is allowed; the high mark restarts at the
      // current value.
      if (*static_cast<uint64_t*>(value) != 0) {
        return fail(cudaErrorInvalidValue, "high-water marks reset only to 0");
      }
      p->used_high = p->used;
      break;
    default:
      return fail(
          cudaErrorInvalidValue,
          "memory pool attribute " + std::to_string(int(attr)) +
              " is read-only or unknown");
  }
  return ok();
}

cudaError_t cudaMemPoolGetAttribute(
    cudaMemPool_t memPool,
    cudaMemPoolAttr attr,
    void* value) {
  SIMGPU_COUNT_CALL();
  if (value == nullptr) {
    return fail(cudaErrorInvalidValue, "value is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  MemPool* p = lookup_pool(memPool);
  if (p == nullptr) {
    return fail(cudaErrorInvalidValue, "unknown memory pool");
  }
  switch (attr) {
    case cudaMemPoolReuseFollowEventDependencies:
      *static_cast<int*>(value) = p->reuse_follow_event;
      break;
    case cudaMemPoolReuseAllowOpportunistic:
      *static_cast<int*>(value) = p->reuse_opportunistic;
      break;
    case cudaMemPoolReuseAllowInternalDependencies:
      *static_cast<int*>(value) = p->reuse_internal;
      break;
    case cudaMemPoolAttrReleaseThreshold:
      *static_cast<uint64_t*>(value) = p->release_threshold;
      break;
    // The pool caches nothing: reserved memory is the memory in use.
    case cudaMemPoolAttrReservedMemCurrent:
    case cudaMemPoolAttrUsedMemCurrent:
      *static_cast<uint64_t*>(value) = p->used;
      break;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:
      *static_cast<uint64_t*>(value) = p->used_high;
      break;
    default:
      return fail(
          cudaErrorInvalidValue,
          "memory pool attribute " + std::to_string(int(attr)) + " is unknown");
  }
  return ok();
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t memPool, size_t) {
  SIMGPU_COUNT_CALL();
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  if (lookup_pool(memPool) == nullptr) {
    return fail(cudaErrorInvalidValue, "unknown memory pool");
  }
  return ok(); // nothing is cached, so nothing to trim
}

cudaError_t cudaMemPoolSetAccess(
    cudaMemPool_t memPool,
    const cudaMemAccessDesc* descList,
    size_t count) {
  SIMGPU_COUNT_CALL();
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  MemPool* p = lookup_pool(memPool);
  if (p == nullptr) {
    return fail(cudaErrorInvalidValue, "unknown memory pool");
  }
  for (size_t i = 0; i < count; ++i) {
    const cudaMemAccessDesc& d = descList[i];
    if (d.location.type != cudaMemLocationTypeDevice ||
        !valid_device(d.location.id)) {
      return fail(cudaErrorInvalidValue, "access descriptor names no device");
    }
    if (d.location.id == p->device) {
      if (d.flags != cudaMemAccessFlagsProtReadWrite) {
        return fail(
            cudaErrorInvalidValue,
            "the owning device always has read-write access");
      }
    } else if (d.flags != cudaMemAccessFlagsProtNone) {
      return fail(
          cudaErrorInvalidDevice,
          "simulated devices have no peer access to each other's pools");
    }
  }
  return ok();
}

// ---- pinned and registered host memory -------------------------------------

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) {
  SIMGPU_COUNT_CALL();
  return host_alloc(pHost, size, flags);
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  SIMGPU_COUNT_CALL();
  return host_alloc(ptr, size, cudaHostAllocDefault);
}

cudaError_t cudaFreeHost(void* ptr) {
  SIMGPU_COUNT_CALL();
  if (ptr == nullptr) {
    return ok();
  }
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.host.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == s.host.end() || it->second.kind != HostKind::Pinned) {
      return fail(
          cudaErrorInvalidValue,
          "cudaFreeHost(" + fmt_ptr(ptr) +
              "): not a cudaHostAlloc/cudaMallocHost allocation");
    }
  }
  // Like cudaFree, cudaFreeHost waits for work that may still use the memory.
  synchronize_all_devices();
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.host.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.host.end()) {
    return fail(cudaErrorInvalidValue, "concurrent cudaFreeHost");
  }
  s.host_stats.bytes_in_use -= it->second.size;
  ++s.host_stats.free_count;
  s.host.erase(it);
  std::free(ptr);
  return ok();
}

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (ptr == nullptr || size == 0) {
    return fail(cudaErrorInvalidValue, "empty range");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  // Overlap with an existing range: the one starting at or before the end.
  auto it = s.host.lower_bound(addr + size);
  if (it != s.host.begin()) {
    --it;
    if (it->first + it->second.size > addr) {
      return fail(
          cudaErrorHostMemoryAlreadyRegistered,
          "range overlaps memory already pinned or registered");
    }
  }
  if (find_device_alloc(s, ptr).alloc != nullptr) {
    return fail(cudaErrorInvalidValue, "cannot register device memory");
  }
  if (cudaError_t err = take_fault(s, SIMGPU_FAULT_HOST_ALLOC)) {
    return fail(err, "injected fault: cudaHostRegister");
  }
  s.host[addr] = HostRange{size, HostKind::Registered, flags, tl_device};
  s.host_stats.registered_bytes += size;
  return ok();
}

cudaError_t cudaHostUnregister(void* ptr) {
  SIMGPU_COUNT_CALL();
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.host.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == s.host.end() || it->second.kind != HostKind::Registered) {
      return fail(
          cudaErrorHostMemoryNotRegistered,
          fmt_ptr(ptr) + " is not the start of a cudaHostRegister range");
    }
  }
  synchronize_all_devices();
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.host.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.host.end()) {
    return fail(cudaErrorHostMemoryNotRegistered, "concurrent unregister");
  }
  s.host_stats.registered_bytes -= it->second.size;
  s.host.erase(it);
  return ok();
}

cudaError_t cudaHostGetDevicePointer(
    void** pDevice,
    void* pHost,
    unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (pDevice == nullptr || flags != 0) {
    return fail(cudaErrorInvalidValue, "pDevice is NULL or flags are not 0");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  if (find_host_range(s, pHost, nullptr) == nullptr) {
    return fail(
        cudaErrorInvalidValue,
        fmt_ptr(pHost) + " is not pinned or registered host memory");
  }
  *pDevice = pHost; // unified addressing: the same address on both sides
  return ok();
}

cudaError_t cudaHostGetFlags(unsigned int* pFlags, void* pHost) {
  SIMGPU_COUNT_CALL();
  if (pFlags == nullptr) {
    return fail(cudaErrorInvalidValue, "pFlags is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  const HostRange* r = find_host_range(s, pHost, nullptr);
  if (r == nullptr || r->kind != HostKind::Pinned) {
    return fail(
        cudaErrorInvalidValue,
        fmt_ptr(pHost) + " was not allocated with cudaHostAlloc");
  }
  *pFlags = r->flags;
  return ok();
}

cudaError_t cudaPointerGetAttributes(
    cudaPointerAttributes* attributes,
    const void* ptr) {
  SIMGPU_COUNT_CALL();
  if (attributes == nullptr) {
    return fail(cudaErrorInvalidValue, "attributes is NULL");
  }
  std::memset(attributes, 0, sizeof(*attributes));
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  DeviceHit hit = find_device_alloc(s, ptr);
  if (hit.alloc != nullptr) {
    const bool managed = hit.alloc->kind == AllocKind::Managed;
    attributes->type = managed ? cudaMemoryTypeManaged : cudaMemoryTypeDevice;
    attributes->device = hit.device->index;
    attributes->devicePointer = const_cast<void*>(ptr);
    attributes->hostPointer = managed ? const_cast<void*>(ptr) : nullptr;
    return ok();
  }
  if (const HostRange* r = find_host_range(s, ptr, nullptr)) {
    attributes->type = cudaMemoryTypeHost;
    attributes->device = r->device;
    attributes->devicePointer = const_cast<void*>(ptr);
    attributes->hostPointer = const_cast<void*>(ptr);
    return ok();
  }
  // Since CUDA 11 unregistered host memory is reported, not an error.
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -2;
  return ok();
}

// ---- copies and memset -----------------------------------------------------

cudaError_t cudaMemcpy(
    void* dst,
    const void* src,
    size_t count,
    cudaMemcpyKind kind) {
  SIMGPU_COUNT_CALL();
  return copy(dst, src, count, kind, nullptr, true, -1, -1);
}

cudaError_t cudaMemcpyAsync(
    void* dst,
    const void* src,
    size_t count,
    cudaMemcpyKind kind,
    cudaStream_t stream) {
  SIMGPU_COUNT_CALL();
  return copy(dst, src, count, kind, stream, false, -1, -1);
}

cudaError_t cudaMemcpyPeer(
    void* dst,
    int dstDevice,
    const void* src,
    int srcDevice,
    size_t count) {
  SIMGPU_COUNT_CALL();
  if (!valid_device(dstDevice) || !valid_device(srcDevice)) {
    return bad_device(valid_device(dstDevice) ? srcDevice : dstDevice);
  }
  return copy(
      dst,
      src,
      count,
      cudaMemcpyDeviceToDevice,
      nullptr,
      true,
      dstDevice,
      srcDevice);
}

cudaError_t cudaMemcpyPeerAsync(
    void* dst,
    int dstDevice,
    const void* src,
    int srcDevice,
    size_t count,
    cudaStream_t stream) {
  SIMGPU_COUNT_CALL();
  if (!valid_device(dstDevice) || !valid_device(srcDevice)) {
    return bad_device(valid_device(dstDevice) ? srcDevice : dstDevice);
  }
  return copy(
      dst,
      src,
      count,
      cudaMemcpyDeviceToDevice,
      stream,
      false,
      dstDevice,
      srcDevice);
}

cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  SIMGPU_COUNT_CALL();
  return memset_impl(devPtr, value, count, nullptr, true);
}

cudaError_t cudaMemsetAsync(
    void* devPtr,
    int value,
    size_t count,
    cudaStream_t stream) {
  SIMGPU_COUNT_CALL();
  return memset_impl(devPtr, value, count, stream, false);
}

// ---- streams ---------------------------------------------------------------

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  SIMGPU_COUNT_CALL();
  return create_stream(pStream, cudaStreamDefault, 0);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned flags) {
  SIMGPU_COUNT_CALL();
  return create_stream(pStream, flags, 0);
}

cudaError_t cudaStreamCreateWithPriority(
    cudaStream_t* pStream,
    unsigned int flags,
    int priority) {
  SIMGPU_COUNT_CALL();
  return create_stream(pStream, flags, priority);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  SIMGPU_COUNT_CALL();
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.streams.find(static_cast<void*>(stream));
  if (it == s.streams.end()) {
    return fail(
        cudaErrorInvalidResourceHandle,
        "cudaStreamDestroy(" + fmt_ptr(stream) +
            "): not a stream from cudaStreamCreate*");
  }
  StreamPtr st = it->second;
  s.streams.erase(it);
  s.devices[st->device].streams.erase(st.get());
  // Returns at once; enqueued work still completes, as in CUDA.
  stop_stream(st);
  return ok();
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  SIMGPU_COUNT_CALL();
  StreamPtr st;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = resolve_stream(s, stream, &st)) {
      return err;
    }
  }
  std::lock_guard<std::mutex> lock(st->mu);
  return st->completed == st->enqueued ? ok() : not_ready();
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  SIMGPU_COUNT_CALL();
  StreamPtr st;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = resolve_stream(s, stream, &st)) {
      return err;
    }
  }
  wait_idle(st);
  return ok();
}

cudaError_t cudaStreamWaitEvent(
    cudaStream_t stream,
    cudaEvent_t event,
    unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (flags != cudaEventWaitDefault && flags != cudaEventWaitExternal) {
    return fail(cudaErrorInvalidValue, "unknown cudaStreamWaitEvent flags");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, stream, &st)) {
    return err;
  }
  EventPtr e;
  if (cudaError_t err = lookup_event(s, event, &e)) {
    return err;
  }
  uint64_t target = 0;
  {
    std::lock_guard<std::mutex> elock(e->mu);
    // Waits for the latest record at the time of this call; an event never
    // recorded, or already reached, needs no wait.
    if (e->reached(e->recorded)) {
      return ok();
    }
    target = e->recorded;
  }
  enqueue(s, st, [e, target] {
    std::unique_lock<std::mutex> elock(e->mu);
    e->cv.wait(elock, [&] { return e->reached(target); });
  });
  return ok();
}

cudaError_t cudaLaunchHostFunc(
    cudaStream_t stream,
    cudaHostFn_t fn,
    void* userData) {
  SIMGPU_COUNT_CALL();
  if (fn == nullptr) {
    return fail(cudaErrorInvalidValue, "fn is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, stream, &st)) {
    return err;
  }
  enqueue(s, st, [fn, userData] { fn(userData); });
  return ok();
}

cudaError_t cudaStreamAddCallback(
    cudaStream_t stream,
    cudaStreamCallback_t callback,
    void* userData,
    unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (callback == nullptr || flags != 0) {
    return fail(cudaErrorInvalidValue, "callback is NULL or flags are not 0");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, stream, &st)) {
    return err;
  }
  enqueue(s, st, [stream, callback, userData] {
    callback(stream, cudaSuccess, userData);
  });
  return ok();
}

cudaError_t cudaStreamGetPriority(cudaStream_t hStream, int* priority) {
  SIMGPU_COUNT_CALL();
  if (priority == nullptr) {
    return fail(cudaErrorInvalidValue, "priority is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, hStream, &st)) {
    return err;
  }
  *priority = st->priority;
  return ok();
}

cudaError_t cudaStreamGetFlags(cudaStream_t hStream, unsigned int* flags) {
  SIMGPU_COUNT_CALL();
  if (flags == nullptr) {
    return fail(cudaErrorInvalidValue, "flags is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, hStream, &st)) {
    return err;
  }
  *flags = st->flags;
  return ok();
}

cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int* device) {
  SIMGPU_COUNT_CALL();
  if (device == nullptr) {
    return fail(cudaErrorInvalidValue, "device is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, hStream, &st)) {
    return err;
  }
  *device = st->device;
  return ok();
}

cudaError_t cudaStreamGetId(cudaStream_t hStream, unsigned long long* id) {
  SIMGPU_COUNT_CALL();
  if (id == nullptr) {
    return fail(cudaErrorInvalidValue, "streamId is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, hStream, &st)) {
    return err;
  }
  *id = st->id;
  return ok();
}

// ---- stream capture (graphs are not simulated: a stream reports a capture
// only while simgpu_set_capturing says so, and its work runs as it is queued)

cudaError_t cudaStreamIsCapturing(
    cudaStream_t stream,
    cudaStreamCaptureStatus* pCaptureStatus) {
  SIMGPU_COUNT_CALL();
  if (pCaptureStatus == nullptr) {
    return fail(cudaErrorInvalidValue, "pCaptureStatus is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, stream, &st)) {
    return err;
  }
  *pCaptureStatus = st->capturing ? cudaStreamCaptureStatusActive
                                  : cudaStreamCaptureStatusNone;
  return ok();
}

cudaError_t cudaStreamGetCaptureInfo(
    cudaStream_t stream,
    cudaStreamCaptureStatus* captureStatus_out,
    unsigned long long* id_out,
    cudaGraph_t* graph_out,
    const cudaGraphNode_t** dependencies_out,
    const cudaGraphEdgeData** edgeData_out,
    size_t* numDependencies_out) {
  SIMGPU_COUNT_CALL();
  if (captureStatus_out == nullptr) {
    return fail(cudaErrorInvalidValue, "captureStatus_out is NULL");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, stream, &st)) {
    return err;
  }
  *captureStatus_out = st->capturing ? cudaStreamCaptureStatusActive
                                     : cudaStreamCaptureStatusNone;
  if (id_out != nullptr) {
    *id_out = st->capturing ? st->id : 0;
  }
  if (graph_out != nullptr) {
    *graph_out = nullptr;
  }
  if (dependencies_out != nullptr) {
    *dependencies_out = nullptr;
  }
  if (edgeData_out != nullptr) {
    *edgeData_out = nullptr;
  }
  if (numDependencies_out != nullptr) {
    *numDependencies_out = 0;
  }
  return ok();
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  SIMGPU_COUNT_CALL();
  if (mode == nullptr) {
    return fail(cudaErrorInvalidValue, "mode is NULL");
  }
  std::swap(*mode, tl_capture_mode);
  return ok();
}

cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) {
  SIMGPU_COUNT_CALL();
  return fail(
      cudaErrorNotSupported,
      "CUDA graphs are not simulated: stream capture cannot begin");
}

// ---- events ----------------------------------------------------------------

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (event == nullptr) {
    return fail(cudaErrorInvalidValue, "event is NULL");
  }
  const unsigned known =
      cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if ((flags & ~known) != 0) {
    return fail(cudaErrorInvalidValue, "unknown event flags");
  }
  if (flags & cudaEventInterprocess) {
    return fail(cudaErrorNotSupported, ipc_reason());
  }
  if (cudaError_t err = check_current_device()) {
    return err;
  }
  auto e = std::make_shared<Event>();
  e->device = tl_device;
  e->flags = flags;
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  s.events.emplace(e.get(), e);
  *event = reinterpret_cast<cudaEvent_t>(e.get());
  return ok();
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  SIMGPU_COUNT_CALL();
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  SIMGPU_COUNT_CALL();
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.events.find(static_cast<void*>(event));
  if (it == s.events.end()) {
    return fail(
        cudaErrorInvalidResourceHandle,
        "cudaEventDestroy(" + fmt_ptr(event) + "): unknown event");
  }
  // Records and waits already enqueued keep the state alive.
  s.events.erase(it);
  return ok();
}

cudaError_t cudaEventRecordWithFlags(
    cudaEvent_t event,
    cudaStream_t stream,
    unsigned int flags) {
  SIMGPU_COUNT_CALL();
  if (flags != cudaEventRecordDefault && flags != cudaEventRecordExternal) {
    return fail(cudaErrorInvalidValue, "unknown cudaEventRecord flags");
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, stream, &st)) {
    return err;
  }
  EventPtr e;
  if (cudaError_t err = lookup_event(s, event, &e)) {
    return err;
  }
  if (e->device != st->device) {
    return fail(
        cudaErrorInvalidResourceHandle,
        "event of device " + std::to_string(e->device) +
            " recorded on a stream of device " + std::to_string(st->device));
  }
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> elock(e->mu);
    gen = ++e->recorded;
    e->pending.insert(gen);
  }
  enqueue(s, st, [e, gen] {
    std::lock_guard<std::mutex> elock(e->mu);
    e->pending.erase(gen);
    if (gen == e->recorded) {
      e->time = Clock::now();
    }
    e->cv.notify_all();
  });
  return ok();
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  SIMGPU_COUNT_CALL();
  return cudaEventRecordWithFlags(event, stream, cudaEventRecordDefault);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  SIMGPU_COUNT_CALL();
  EventPtr e;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = lookup_event(s, event, &e)) {
      return err;
    }
  }
  std::lock_guard<std::mutex> elock(e->mu);
  return e->reached(e->recorded) ? ok() : not_ready();
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  SIMGPU_COUNT_CALL();
  EventPtr e;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = lookup_event(s, event, &e)) {
      return err;
    }
  }
  std::unique_lock<std::mutex> elock(e->mu);
  const uint64_t target = e->recorded;
  e->cv.wait(elock, [&] { return e->reached(target); });
  return ok();
}

cudaError_t cudaEventElapsedTime(
    float* ms,
    cudaEvent_t start,
    cudaEvent_t end) {
  SIMGPU_COUNT_CALL();
  if (ms == nullptr) {
    return fail(cudaErrorInvalidValue, "ms is NULL");
  }
  EventPtr a;
  EventPtr b;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.mu);
    if (cudaError_t err = lookup_event(s, start, &a)) {
      return err;
    }
    if (cudaError_t err = lookup_event(s, end, &b)) {
      return err;
    }
  }
  if ((a->flags | b->flags) & cudaEventDisableTiming) {
    return fail(
        cudaErrorInvalidResourceHandle,
        "an event was created with cudaEventDisableTiming");
  }
  Clock::time_point times[2];
  const EventPtr* pair[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {
    Event& e = **pair[i];
    std::lock_guard<std::mutex> elock(e.mu);
    if (e.recorded == 0) {
      return fail(
          cudaErrorInvalidResourceHandle, "an event was never recorded");
    }
    if (!e.reached(e.recorded)) {
      return not_ready();
    }
    times[i] = e.time;
  }
  *ms = std::chrono::duration<float, std::milli>(times[1] - times[0]).count();
  return ok();
}

} // extern "C"

// ===========================================================================
// Error strings (CUDA's own wording for the codes simgpu and c10 use).

namespace {

std::string cuda_error_text(cudaError_t e, bool name) {
#define SIMGPU_ERRORS(_)                                                     \
  _(cudaSuccess, "no error")                                                 \
  _(cudaErrorInvalidValue, "invalid argument")                               \
  _(cudaErrorMemoryAllocation, "out of memory")                              \
  _(cudaErrorInitializationError, "initialization error")                    \
  _(cudaErrorCudartUnloading, "driver shutting down")                        \
  _(cudaErrorInvalidConfiguration, "invalid configuration argument")         \
  _(cudaErrorInvalidPitchValue, "invalid pitch argument")                    \
  _(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")    \
  _(cudaErrorInsufficientDriver,                                             \
    "CUDA driver version is insufficient for CUDA runtime version")          \
  _(cudaErrorNoDevice, "no CUDA-capable device is detected")                 \
  _(cudaErrorInvalidDevice, "invalid device ordinal")                        \
  _(cudaErrorDeviceUninitialized, "invalid device context")                  \
  _(cudaErrorMapBufferObjectFailed, "mapping of buffer object failed")       \
  _(cudaErrorAlreadyMapped, "resource already mapped")                       \
  _(cudaErrorNotMapped, "resource not mapped")                               \
  _(cudaErrorPeerAccessUnsupported,                                          \
    "peer access is not supported between these two devices")                \
  _(cudaErrorInvalidResourceHandle, "invalid resource handle")               \
  _(cudaErrorIllegalState,                                                   \
    "the operation cannot be performed in the present "                      \
    "state")                                                                 \
  _(cudaErrorNotReady, "device not ready")                                   \
  _(cudaErrorIllegalAddress, "an illegal memory access was encountered")     \
  _(cudaErrorPeerAccessAlreadyEnabled, "peer access is already enabled")     \
  _(cudaErrorPeerAccessNotEnabled, "peer access has not been enabled")       \
  _(cudaErrorSetOnActiveProcess,                                             \
    "cannot set while device is active in this process")                     \
  _(cudaErrorContextIsDestroyed, "context is destroyed")                     \
  _(cudaErrorHostMemoryAlreadyRegistered,                                    \
    "part or all of the requested memory range is already mapped")           \
  _(cudaErrorHostMemoryNotRegistered,                                        \
    "pointer does not correspond to a registered memory region")             \
  _(cudaErrorLaunchFailure, "unspecified launch failure")                    \
  _(cudaErrorNotPermitted, "operation not permitted")                        \
  _(cudaErrorNotSupported, "operation not supported")                        \
  _(cudaErrorStreamCaptureUnsupported,                                       \
    "operation not permitted when stream is capturing")                      \
  _(cudaErrorStreamCaptureImplicit,                                          \
    "operation would make the legacy stream depend on a capturing blocking " \
    "stream")                                                                \
  _(cudaErrorUnknown, "unknown error")
#define SIMGPU_ERROR_CASE(code, text) \
  case code:                          \
    return name ? #code : text;
  switch (e) {
    SIMGPU_ERRORS(SIMGPU_ERROR_CASE)
    default:
      return "unrecognized error code";
  }
#undef SIMGPU_ERROR_CASE
#undef SIMGPU_ERRORS
}

} // namespace

// ===========================================================================
// Test-control API.

extern "C" {

void simgpu_inject_fault(
    simgpu_fault_kind kind,
    int nth,
    int count,
    cudaError_t error) {
  if (kind < SIMGPU_FAULT_DEVICE_ALLOC || kind > SIMGPU_FAULT_COPY) {
    return;
  }
  if (error == cudaSuccess) {
    error = kind == SIMGPU_FAULT_COPY ? cudaErrorUnknown
                                      : cudaErrorMemoryAllocation;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  Fault& f = s.faults[kind];
  if (nth <= 0 || count == 0) {
    f = Fault{};
    return;
  }
  f.countdown = nth;
  f.remaining = count;
  f.error = error;
}

void simgpu_fail_nth_device_alloc(int nth) {
  simgpu_inject_fault(SIMGPU_FAULT_DEVICE_ALLOC, nth, 1, cudaSuccess);
}

void simgpu_fail_nth_host_alloc(int nth) {
  simgpu_inject_fault(SIMGPU_FAULT_HOST_ALLOC, nth, 1, cudaSuccess);
}

void simgpu_fail_nth_copy(int nth) {
  simgpu_inject_fault(SIMGPU_FAULT_COPY, nth, 1, cudaSuccess);
}

void simgpu_clear_faults(void) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  for (Fault& f : s.faults) {
    f = Fault{};
  }
}

size_t simgpu_faults_fired(void) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.faults_fired;
}

cudaError_t simgpu_set_capacity(int device, size_t bytes) {
  if (!valid_device(device)) {
    return cudaErrorInvalidDevice;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  s.devices[device].capacity = bytes;
  s.devices[device].stats.capacity = bytes;
  return cudaSuccess;
}

size_t simgpu_capacity(int device) {
  if (!valid_device(device)) {
    return 0;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.devices[device].capacity;
}

cudaError_t simgpu_get_device_stats(int device, simgpu_device_stats* out) {
  if (!valid_device(device) || out == nullptr) {
    return out == nullptr ? cudaErrorInvalidValue : cudaErrorInvalidDevice;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  *out = s.devices[device].stats;
  return cudaSuccess;
}

void simgpu_get_host_stats(simgpu_host_stats* out) {
  if (out == nullptr) {
    return;
  }
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  *out = s.host_stats;
}

size_t simgpu_device_bytes_in_use(int device) {
  simgpu_device_stats st{};
  return simgpu_get_device_stats(device, &st) == cudaSuccess ? st.bytes_in_use
                                                             : 0;
}

size_t simgpu_device_bytes_peak(int device) {
  simgpu_device_stats st{};
  return simgpu_get_device_stats(device, &st) == cudaSuccess ? st.bytes_peak
                                                             : 0;
}

size_t simgpu_host_bytes_in_use(void) {
  simgpu_host_stats st{};
  simgpu_get_host_stats(&st);
  return st.bytes_in_use;
}

size_t simgpu_host_bytes_peak(void) {
  simgpu_host_stats st{};
  simgpu_get_host_stats(&st);
  return st.bytes_peak;
}

void simgpu_reset_counters(void) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  for (Device& d : s.devices) {
    const size_t in_use = d.stats.bytes_in_use;
    d.stats = simgpu_device_stats{};
    d.stats.bytes_in_use = in_use;
    d.stats.bytes_peak = in_use;
    d.stats.capacity = d.capacity;
    d.pool.used_high = d.pool.used;
  }
  const size_t host_in_use = s.host_stats.bytes_in_use;
  const size_t registered = s.host_stats.registered_bytes;
  s.host_stats = simgpu_host_stats{};
  s.host_stats.bytes_in_use = host_in_use;
  s.host_stats.bytes_peak = host_in_use;
  s.host_stats.registered_bytes = registered;
  s.faults_fired = 0;
  std::lock_guard<std::mutex> calls_lock(call_sites_mutex());
  for (CallSite* site : call_sites()) {
    site->calls.store(0, std::memory_order_relaxed);
  }
}

size_t simgpu_call_count(const char* function) {
  if (function == nullptr) {
    return 0;
  }
  std::lock_guard<std::mutex> lock(call_sites_mutex());
  for (const CallSite* site : call_sites()) {
    if (std::strcmp(site->function, function) == 0) {
      return site->calls.load(std::memory_order_relaxed);
    }
  }
  return 0;
}

size_t simgpu_call_counts(simgpu_call_entry* out, size_t capacity) {
  std::vector<simgpu_call_entry> called;
  {
    std::lock_guard<std::mutex> lock(call_sites_mutex());
    for (const CallSite* site : call_sites()) {
      const size_t calls = site->calls.load(std::memory_order_relaxed);
      if (calls > 0) {
        called.push_back(simgpu_call_entry{site->function, calls});
      }
    }
  }
  std::sort(
      called.begin(),
      called.end(),
      [](const simgpu_call_entry& a, const simgpu_call_entry& b) {
        return a.calls != b.calls ? a.calls > b.calls
                                  : std::strcmp(a.function, b.function) < 0;
      });
  if (out != nullptr) {
    std::copy_n(called.begin(), std::min(capacity, called.size()), out);
  }
  return called.size();
}

void simgpu_set_copy_bandwidth(double bytes_per_second) {
  sim().bandwidth = bytes_per_second > 0 ? bytes_per_second : 0;
}

cudaError_t simgpu_set_capturing(cudaStream_t stream, int capturing) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.mu);
  StreamPtr st;
  if (cudaError_t err = resolve_stream(s, stream, &st)) {
    return err;
  }
  st->capturing = capturing != 0;
  return ok();
}

const char* simgpu_last_error_detail(void) {
  return tl_detail.c_str();
}

int simgpu_device_count(void) {
  return device_count();
}

} // extern "C"
