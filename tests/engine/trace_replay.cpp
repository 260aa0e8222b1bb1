// Replays an operator trace (lmsbench/trace_gen.py describes the format)
// through the LMS engine and the patched caching allocator on the simulated
// GPU, and checks that nothing is lost, corrupted or leaked.
//
//   trace_replay TRACE [--fail-device-every N [--fail-device-count C]]
//                      [--fail-host-every N] [--fail-copy-every N]
//                      [--release-host-cache-every N] [--empty-cache-every N]
//                      [--hog-bytes B --hog-at EVENT [--hog-release-at EVENT]]
//                      [--corrupt-after EVENT --corrupt-id ID]
//                      [--continue-after-error] [--no-host-placement]
//
// Every operator pins its inputs and outputs, runs a "kernel" and unpins
// them. The kernel is a host function queued on the operator's stream, so it
// runs in stream order after the page-ins LMS queued for the operator, as a
// CUDA kernel would; it reads device memory directly, which only the
// simulated GPU allows. It checks that each input holds the pattern its last
// writer stored and writes a new pattern, derived from the event index and
// the storage id, into each output.
//
// A pinned storage is in device memory, or, where the device cannot hold it
// beside the operator's others, in the pinned host memory where the engine
// kept it (host placement, on unless --no-host-placement): the kernel then
// reads and writes it there, as a CUDA kernel would over the bus. The
// storages an operator finds in host memory must be exactly those the
// engine says it kept there (input_host_placement_count); the events where it
// kept any are reported.
//
// --corrupt-after flips a byte of a storage after an event, to show that the
// checks see it. An exception from the engine ends the trace (or, with
// --continue-after-error, drops the event and what depends on it):
// c10::OutOfMemoryError is reported as "oom", any other c10::Error as "error",
// with the event index. Then, with faults cleared, every live storage is read
// back and checked, everything is freed and device and pinned host memory must
// be back at zero. The last line of output is
//   trace-result {"outcome": ..., ...}
// with outcome ok, oom or error (exit status 0), or not_resident, stuck_pin,
// mismatch, leak, exception or bad_trace (exit status 1).

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10_compat.h>
#pragma GCC diagnostic pop

#include <cuda_runtime_api.h>
#include <simgpu.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace lms = c10::cuda::lms;
namespace cca = c10::cuda::CUDACachingAllocator;
using StoragePtr = c10::intrusive_ptr<c10::StorageImpl>;

// ---------------------------------------------------------------------------
// Trace

enum class Kind { Alloc, Op, SideOp, Access, Free };

struct Event {
  Kind kind = Kind::Alloc;
  int id = -1; // alloc, access, free
  size_t bytes = 0; // alloc
  bool side = false; // alloc: on the side stream
  std::string name; // op
  std::vector<int> inputs;
  std::vector<int> outputs;
};

struct Trace {
  size_t capacity = 0;
  size_t limit = 0;
  size_t threshold = 64 * 1024;
  int prefetch = 0;
  size_t speculative = 0;
  std::vector<Event> events;
};

struct BadTrace : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<int> parseIds(const std::string& word, const char* key) {
  const std::string prefix = std::string(key) + "=[";
  if (word.compare(0, prefix.size(), prefix) != 0 || word.back() != ']') {
    throw BadTrace("expected " + prefix + "ids]: " + word);
  }
  std::vector<int> ids;
  std::stringstream list(
      word.substr(prefix.size(), word.size() - prefix.size() - 1));
  std::string item;
  while (std::getline(list, item, ',')) {
    if (!item.empty()) {
      ids.push_back(std::stoi(item));
    }
  }
  return ids;
}

Trace readTrace(const char* path) {
  std::ifstream in(path);
  if (!in) {
    throw BadTrace(std::string("cannot read ") + path);
  }
  Trace t;
  bool have_meta = false;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string word;
    if (!(words >> word)) {
      continue;
    }
    try {
      Event ev;
      if (word == "meta") {
        have_meta = true;
        std::string kv;
        while (words >> kv) {
          const auto eq = kv.find('=');
          if (eq == std::string::npos) {
            throw BadTrace("expected key=value: " + kv);
          }
          const std::string key = kv.substr(0, eq);
          const unsigned long long value = std::stoull(kv.substr(eq + 1));
          if (key == "capacity") {
            t.capacity = value;
          } else if (key == "limit") {
            t.limit = value;
          } else if (key == "threshold") {
            t.threshold = value;
          } else if (key == "prefetch") {
            t.prefetch = static_cast<int>(value);
          } else if (key == "speculative") {
            t.speculative = value;
          } else {
            throw BadTrace("unknown meta key " + key);
          }
        }
        continue;
      }
      std::string stream;
      if (word == "alloc") {
        ev.kind = Kind::Alloc;
        if (!(words >> ev.id >> ev.bytes >> stream) ||
            (stream != "main" && stream != "side") || ev.bytes == 0) {
          throw BadTrace("expected: alloc ID BYTES main|side");
        }
        ev.side = stream == "side";
      } else if (word == "access" || word == "free") {
        ev.kind = word == "access" ? Kind::Access : Kind::Free;
        if (!(words >> ev.id)) {
          throw BadTrace("expected: " + word + " ID");
        }
      } else if (word == "op" || word == "side_stream") {
        ev.kind = Kind::Op;
        if (word == "side_stream") {
          ev.kind = Kind::SideOp;
          if (!(words >> word) || word != "op") {
            throw BadTrace("expected: side_stream op ...");
          }
        }
        std::string ins;
        std::string outs;
        if (!(words >> ev.name >> ins >> outs)) {
          throw BadTrace("expected: op NAME inputs=[ids] outputs=[ids]");
        }
        ev.inputs = parseIds(ins, "inputs");
        ev.outputs = parseIds(outs, "outputs");
      } else {
        throw BadTrace("unknown event " + word);
      }
      t.events.push_back(std::move(ev));
    } catch (const std::logic_error& e) { // std::stoi and friends
      throw BadTrace(
          std::string(path) + ":" + std::to_string(number) + ": " + e.what());
    } catch (const BadTrace& e) {
      throw BadTrace(
          std::string(path) + ":" + std::to_string(number) + ": " + e.what());
    }
  }
  if (!have_meta || t.capacity == 0) {
    throw BadTrace(std::string(path) + ": no meta line with capacity=");
  }
  return t;
}

// ---------------------------------------------------------------------------
// Contents

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The pattern an operator at `event` writes into storage `id`; never 0, which
// stands for "not written yet".
uint64_t patternSeed(size_t event, int id) {
  return splitmix((uint64_t(event) << 32) ^ uint32_t(id)) | 1;
}

uint64_t patternWord(uint64_t seed, size_t index) {
  return splitmix(seed * 0x100000001b3ULL + index);
}

void fillPattern(uint8_t* p, size_t bytes, uint64_t seed) {
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t w = patternWord(seed, i / 8);
    std::memcpy(p + i, &w, 8);
  }
  if (i < bytes) {
    const uint64_t w = patternWord(seed, i / 8);
    std::memcpy(p + i, &w, bytes - i);
  }
}

// Offset of the first byte that differs from the pattern, or `bytes`.
size_t firstMismatch(const uint8_t* p, size_t bytes, uint64_t seed) {
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t w = patternWord(seed, i / 8);
    const size_t n = std::min<size_t>(8, bytes - i);
    if (std::memcmp(p + i, &w, n) != 0) {
      for (size_t j = 0; j < n; ++j) {
        if (p[i + j] != reinterpret_cast<const uint8_t*>(&w)[j]) {
          return i + j;
        }
      }
    }
  }
  return bytes;
}

// Mismatches found by kernels, which run on stream worker threads.
struct Mismatches {
  std::mutex mu;
  size_t count = 0;
  std::vector<std::string> first;

  void add(std::string what) {
    std::lock_guard<std::mutex> lock(mu);
    ++count;
    if (first.size() < 5) {
      first.push_back(std::move(what));
    }
  }
  size_t total() {
    std::lock_guard<std::mutex> lock(mu);
    return count;
  }
};
Mismatches g_mismatches;

struct Read {
  int id;
  const uint8_t* ptr;
  size_t bytes;
  uint64_t seed;
};
struct Write {
  uint8_t* ptr;
  size_t bytes;
  uint64_t seed;
};
struct Kernel {
  size_t event;
  std::string name;
  std::vector<Read> reads;
  std::vector<Write> writes;
};

void CUDART_CB runKernel(void* arg) {
  std::unique_ptr<Kernel> k(static_cast<Kernel*>(arg));
  for (const Read& r : k->reads) {
    const size_t at = firstMismatch(r.ptr, r.bytes, r.seed);
    if (at != r.bytes) {
      std::ostringstream os;
      os << "event " << k->event << " (" << k->name << "): storage " << r.id
         << " differs from its last write at byte " << at << " of " << r.bytes;
      g_mismatches.add(os.str());
    }
  }
  for (const Write& w : k->writes) {
    fillPattern(w.ptr, w.bytes, w.seed);
  }
}

// ---------------------------------------------------------------------------
// Replay

template <typename StatArray>
size_t aggregate(const StatArray& stat) {
  return static_cast<size_t>(lms_compat::aggregate(stat));
}

// Where device memory was when an error ended the trace (for diagnosis).
std::string memoryReport() {
  const auto st = cca::getDeviceStats(0);
  std::ostringstream os;
  os << " [device: " << simgpu_device_bytes_in_use(0) << " of "
     << simgpu_capacity(0)
     << " bytes in use; caching allocator: " << aggregate(st.allocated_bytes)
     << " allocated, " << aggregate(st.reserved_bytes) << " reserved in "
     << aggregate(st.segment) << " segments]";
  return os.str();
}

// Ends the replay with an outcome that is a failure of the engine.
struct ReplayFailure : std::runtime_error {
  ReplayFailure(std::string outcome_, const std::string& what)
      : std::runtime_error(what), outcome(std::move(outcome_)) {}
  std::string outcome;
};

struct Options {
  const char* trace = nullptr;
  int fail_device_every = 0;
  int fail_device_count = 1;
  int fail_host_every = 0;
  int fail_copy_every = 0;
  int release_host_cache_every = 0;
  int empty_cache_every = 0;
  size_t hog_bytes = 0;
  long hog_at = -1;
  long hog_release_at = -1;
  // Self-test of the checks: flip a byte of a storage behind LMS's back.
  long corrupt_after = -1;
  int corrupt_id = -1;
  bool continue_after_error = false;
  bool host_placement = true;
};

struct Live {
  StoragePtr storage;
  bool side = false; // allocated on the side stream
  uint64_t seed = 0; // pattern of the last write; 0: never written
};

class Replayer {
 public:
  Replayer(const Trace& trace, const Options& opt)
      : trace_(trace),
        opt_(opt),
        main_(c10::cuda::getCurrentCUDAStream(0)),
        side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0)) {}

  // Runs the events; returns the index of the one that threw, or -1.
  // With --continue-after-error, an event that throws is dropped as a
  // program that catches the error would drop it (an operator that did not
  // run, a tensor never created), and the trace goes on; the first error is
  // the one reported.
  long run(std::string* outcome, std::string* message) {
    long first = -1;
    for (size_t i = 0; i < trace_.events.size(); ++i) {
      const Event& ev = trace_.events[i];
      current_ = static_cast<long>(i);
      if (dropsWithLostStorage(ev)) {
        continue;
      }
      std::string what;
      try {
        beforeEvent(i);
        execute(i, ev);
        if (static_cast<long>(i) == opt_.corrupt_after) {
          corrupt(opt_.corrupt_id);
        }
        continue;
      } catch (const c10::OutOfMemoryError& e) {
        what = "oom";
        *message =
            first < 0 ? e.what_without_backtrace() + memoryReport() : *message;
      } catch (const c10::Error& e) {
        what = "error";
        *message =
            first < 0 ? e.what_without_backtrace() + memoryReport() : *message;
      }
      ++errors_;
      if (first < 0) {
        first = static_cast<long>(i);
        *outcome = what;
      }
      const std::string stuck = stuckPins();
      if (!stuck.empty()) {
        throw ReplayFailure(
            "stuck_pin",
            "after the " + what + " at event " + std::to_string(i) + ": " +
                stuck);
      }
      if (!opt_.continue_after_error) {
        break;
      }
      if (ev.kind == Kind::Alloc) {
        lost_.insert(ev.id);
      }
    }
    return first;
  }

  size_t errors() const {
    return errors_;
  }
  // The event being run, or the last one.
  long current() const {
    return current_;
  }

  // Storages still pinned although no operator runs: a pin that threw must
  // leave nothing pinned, or the storage can never be paged out again.
  std::string stuckPins() const {
    std::string out;
    for (const auto& [id, live] : storages_) {
      if (lms::getState(*live.storage) == lms::StorageState::Active) {
        out += "storage " + std::to_string(id) + " is still pinned; ";
      }
    }
    return out;
  }

  // After run(), with faults cleared: reads back every live storage and
  // frees it. Throws on any error.
  void verifyAndFreeAll() {
    releaseHog();
    join();
    // Storages never written have nothing to check; LMS cannot page them out
    // (never pinned), so they go first to leave room for the checks.
    for (auto it = storages_.begin(); it != storages_.end();) {
      it = it->second.seed == 0 ? storages_.erase(it) : std::next(it);
    }
    for (auto& [id, live] : storages_) {
      c10::cuda::CUDAStreamGuard guard(main_);
      lms::pin(*live.storage);
      auto* k = new Kernel{trace_.events.size(), "final check", {}, {}};
      k->reads.push_back(Read{
          id,
          static_cast<const uint8_t*>(live.storage->data()),
          live.storage->nbytes(),
          live.seed});
      launch(main_, k);
      lms::unpin(*live.storage);
    }
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    storages_.clear();
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }

  size_t hogged() const {
    return hogged_;
  }
  // The events whose operator found storages kept in host memory.
  const std::vector<size_t>& hostEvents() const {
    return host_events_;
  }
  void releaseHog() {
    if (hog_ptr_ != nullptr) {
      C10_CUDA_CHECK(cudaFree(hog_ptr_));
      hog_ptr_ = nullptr;
    }
  }

 private:
  void beforeEvent(size_t i) {
    const long index = static_cast<long>(i);
    if (index == opt_.hog_at) {
      takeHog();
    }
    if (index == opt_.hog_release_at) {
      releaseHog();
    }
    // Dropping caches makes later page-outs allocate pinned host memory and
    // later allocations call cudaMalloc, where the faults are injected.
    if (opt_.release_host_cache_every > 0 &&
        i % static_cast<size_t>(opt_.release_host_cache_every) == 0) {
      lms::releaseCachedHostMemory();
    }
    if (opt_.empty_cache_every > 0 &&
        i % static_cast<size_t>(opt_.empty_cache_every) == 0) {
      cca::emptyCache();
    }
    // One fault kind per run: whenever the armed fault has fired, arm the
    // next one, N operations further on.
    const size_t fired = simgpu_faults_fired();
    if (i == 0 || fired != fired_seen_) {
      fired_seen_ = fired;
      if (opt_.fail_device_every > 0) {
        simgpu_inject_fault(
            SIMGPU_FAULT_DEVICE_ALLOC,
            opt_.fail_device_every,
            opt_.fail_device_count,
            cudaSuccess);
      } else if (opt_.fail_host_every > 0) {
        simgpu_inject_fault(
            SIMGPU_FAULT_HOST_ALLOC, opt_.fail_host_every, 1, cudaSuccess);
      } else if (opt_.fail_copy_every > 0) {
        simgpu_inject_fault(
            SIMGPU_FAULT_COPY, opt_.fail_copy_every, 1, cudaSuccess);
      }
    }
  }

  // Flips one byte in the device memory of a resident storage once the work
  // queued so far is done, as a stray kernel would; the next read must see it.
  void corrupt(int id) {
    Live& l = live(id);
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    auto* p =
        static_cast<uint8_t*>(l.storage->_mutable_data_ptr_no_checks().get());
    if (p == nullptr) {
      throw BadTrace(
          "--corrupt-after: storage " + std::to_string(id) + " is paged out");
    }
    p[l.storage->nbytes() / 2] ^= 0x5a;
  }

  // Device memory taken by "another process": a plain cudaMalloc, outside
  // the caching allocator, of what is asked or what is free.
  void takeHog() {
    if (opt_.hog_bytes == 0 || hog_ptr_ != nullptr) {
      return;
    }
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    hogged_ = std::min(opt_.hog_bytes, free_bytes);
    if (hogged_ > 0) {
      C10_CUDA_CHECK(cudaMalloc(&hog_ptr_, hogged_));
    }
  }

  // Whether an event uses a storage whose allocation failed earlier; such
  // events are dropped (the free of it ends its story).
  bool dropsWithLostStorage(const Event& ev) {
    if (lost_.empty()) {
      return false;
    }
    if (ev.kind == Kind::Free && lost_.erase(ev.id) != 0) {
      return true;
    }
    const auto lost = [&](int id) { return lost_.count(id) != 0; };
    return (ev.kind == Kind::Access && lost(ev.id)) ||
        std::any_of(ev.inputs.begin(), ev.inputs.end(), lost) ||
        std::any_of(ev.outputs.begin(), ev.outputs.end(), lost);
  }

  Live& live(int id) {
    auto it = storages_.find(id);
    if (it == storages_.end()) {
      throw BadTrace("storage " + std::to_string(id) + " is not live");
    }
    return it->second;
  }

  // The main stream waits for the side stream's work so far, as a program
  // does before it uses what a side stream produced (wait_stream).
  void join() {
    if (side_touched_.empty()) {
      return;
    }
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(ev, side_.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(main_.stream(), ev, 0));
    C10_CUDA_CHECK(cudaEventDestroy(ev));
    side_touched_.clear();
  }

  // The side stream waits for the main stream's work so far.
  void fork() {
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(ev, main_.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(side_.stream(), ev, 0));
    C10_CUDA_CHECK(cudaEventDestroy(ev));
  }

  bool touchesSideWork(const std::vector<int>& ids) const {
    return std::any_of(ids.begin(), ids.end(), [&](int id) {
      return side_touched_.count(id) != 0;
    });
  }

  void launch(const c10::cuda::CUDAStream& stream, Kernel* k) {
    const cudaError_t err = cudaLaunchHostFunc(stream.stream(), &runKernel, k);
    if (err != cudaSuccess) {
      delete k;
      C10_CUDA_CHECK(err);
    }
  }

  // What an operator needs of a pinned storage: resident device memory, or
  // the pinned host memory the engine kept it in (host placement), which
  // adds it to `on_host`. Looks without the raw-access hook, which would
  // itself page in.
  void checkResident(
      size_t i,
      int id,
      c10::StorageImpl& s,
      std::set<int>& on_host) {
    const auto state = lms::getState(s);
    const void* p = s._mutable_data_ptr_no_checks().get();
    cudaPointerAttributes attr{};
    const bool known =
        p != nullptr && cudaPointerGetAttributes(&attr, p) == cudaSuccess;
    const bool device_memory = known && attr.type == cudaMemoryTypeDevice;
    const bool host_memory = known && attr.type == cudaMemoryTypeHost &&
        state == lms::StorageState::Active;
    if (!(device_memory || host_memory) ||
        (state != lms::StorageState::Active &&
         state != lms::StorageState::Unmanaged)) {
      (void)cudaGetLastError();
      throw ReplayFailure(
          "not_resident",
          "event " + std::to_string(i) + ": storage " + std::to_string(id) +
              " is pinned but " +
              (device_memory ? std::string("in state ") + lms::toString(state)
                             : std::string("not in device memory")));
    }
    if (host_memory) {
      on_host.insert(id);
    }
  }

  // The storages an operator found in host memory are those the engine kept
  // there while it pinned them (`kept`, its count of inputs kept on the host
  // over the pins), no more and no fewer: a pinned storage whose address is
  // its host copy without that is one the engine lost track of.
  void checkKeptOnHost(size_t i, const std::set<int>& on_host, int64_t kept) {
    if (static_cast<int64_t>(on_host.size()) != kept) {
      std::string ids;
      for (int id : on_host) {
        ids += (ids.empty() ? "" : ", ") + std::to_string(id);
      }
      throw ReplayFailure(
          "not_resident",
          "event " + std::to_string(i) + ": " + std::to_string(on_host.size()) +
              " pinned storages in host memory (" + ids + "), but the engine " +
              "kept " + std::to_string(kept) + " there");
    }
    if (!on_host.empty()) {
      host_events_.push_back(i);
    }
  }

  void execute(size_t i, const Event& ev) {
    switch (ev.kind) {
      case Kind::Alloc: {
        if (storages_.count(ev.id) != 0) {
          throw BadTrace("storage " + std::to_string(ev.id) + " exists");
        }
        c10::cuda::CUDAStreamGuard guard(ev.side ? side_ : main_);
        auto s = c10::make_intrusive<c10::StorageImpl>(
            c10::StorageImpl::use_byte_size_t(),
            static_cast<int64_t>(ev.bytes),
            cca::get(),
            /*resizable=*/false);
        storages_[ev.id] = Live{std::move(s), ev.side, 0};
        break;
      }
      case Kind::Free:
        live(ev.id); // must exist
        storages_.erase(ev.id);
        break;
      case Kind::Access: {
        Live& l = live(ev.id);
        if (touchesSideWork({ev.id})) {
          join();
        }
        c10::cuda::CUDAStreamGuard guard(main_);
        // Raw data access: in a patched build the StorageImpl hook pages the
        // storage in; without it the program would have to call access().
#ifndef C10_LMS_STORAGE_HOOK
        lms::access(*l.storage);
#endif
        const void* p = l.storage->data();
        const auto state = lms::getState(*l.storage);
        if (p == nullptr ||
            (state != lms::StorageState::Allocated &&
             state != lms::StorageState::Unmanaged)) {
          throw ReplayFailure(
              "not_resident",
              "event " + std::to_string(i) + ": raw access left storage " +
                  std::to_string(ev.id) + " in state " + lms::toString(state));
        }
        if (l.seed != 0) {
          auto* k = new Kernel{i, "access", {}, {}};
          k->reads.push_back(Read{
              ev.id,
              static_cast<const uint8_t*>(p),
              l.storage->nbytes(),
              l.seed});
          launch(main_, k);
        }
        break;
      }
      case Kind::Op:
      case Kind::SideOp:
        runOp(i, ev);
        break;
    }
  }

  void runOp(size_t i, const Event& ev) {
    const bool side = ev.kind == Kind::SideOp;
    const c10::cuda::CUDAStream& stream = side ? side_ : main_;
    std::vector<int> all = ev.inputs;
    all.insert(all.end(), ev.outputs.begin(), ev.outputs.end());
    for (int id : all) {
      live(id);
    }
    if (side) {
      fork(); // its inputs may still be being written on the main stream
    } else if (touchesSideWork(all)) {
      join();
    }
    c10::cuda::CUDAStreamGuard guard(stream);
    // An operator boundary for the learned swap schedule, as operator-boundary
    // pinning reports it: it may page out early and page in ahead here.
    std::vector<c10::StorageImpl*> touched;
    for (int id : all) {
      touched.push_back(storages_.at(id).storage.get());
    }
    lms::beginOperator(ev.name, touched);
    // Its working set, as operator-boundary pinning reports it: the engine
    // may pack the operator here (page out everything inactive, its inputs
    // included, and return the allocator's cache). Packing only places
    // memory: as the pinning glue does, a failure (a failed copy) leaves the
    // inputs where they are and the operator goes on, its working set open
    // until it ends.
    std::vector<c10::StorageImpl*> inputs;
    for (int id : ev.inputs) {
      inputs.push_back(storages_.at(id).storage.get());
    }
    try {
      lms::beginWorkingSet(ev.name, inputs);
    } catch (const std::exception&) {
      // The glue warns; what the operator does next is replayed and checked.
    }
    // Pin every input, then every output (a storage may appear more than
    // once: pins are counted). On failure, unpin what was pinned, as an
    // operator-boundary guard does, and let the error end the trace.
    std::vector<c10::StorageImpl*> pinned;
    auto unpinAll = [&] {
      for (auto it = pinned.rbegin(); it != pinned.rend(); ++it) {
        lms::unpin(**it);
      }
      lms::endWorkingSet(ev.name);
    };
    try {
      const int64_t kept = lms::getStats(0).input_host_placement_count;
      for (int id : all) {
        c10::StorageImpl* s = storages_.at(id).storage.get();
        lms::pin(*s);
        pinned.push_back(s);
      }
      launchOp(
          i,
          ev,
          all,
          stream,
          lms::getStats(0).input_host_placement_count - kept);
    } catch (...) {
      unpinAll();
      throw;
    }
    unpinAll();
    for (c10::StorageImpl* s : pinned) {
      if (lms::getState(*s) == lms::StorageState::Active) {
        throw ReplayFailure(
            "stuck_pin",
            "event " + std::to_string(i) + " (" + ev.name +
                ") left a storage pinned after unpinning all it pinned");
      }
    }
  }

  // The kernel of an operator whose storages are pinned; the engine kept
  // `kept` of them in host memory.
  void launchOp(
      size_t i,
      const Event& ev,
      const std::vector<int>& all,
      const c10::cuda::CUDAStream& stream,
      int64_t kept) {
    const bool side = ev.kind == Kind::SideOp;
    auto owner = std::make_unique<Kernel>(Kernel{i, ev.name, {}, {}});
    Kernel* k = owner.get();
    std::set<int> seen;
    std::set<int> on_host;
    for (int id : ev.inputs) {
      Live& l = storages_.at(id);
      checkResident(i, id, *l.storage, on_host);
      if (seen.insert(id).second && l.seed != 0) {
        k->reads.push_back(Read{
            id,
            static_cast<const uint8_t*>(l.storage->data()),
            l.storage->nbytes(),
            l.seed});
      }
    }
    std::set<int> written;
    for (int id : ev.outputs) {
      Live& l = storages_.at(id);
      checkResident(i, id, *l.storage, on_host);
      if (written.insert(id).second) {
        l.seed = patternSeed(i, id);
        k->writes.push_back(Write{
            static_cast<uint8_t*>(lms_compat::mutableData(*l.storage)),
            l.storage->nbytes(),
            l.seed});
      }
    }
    checkKeptOnHost(i, on_host, kept);
    // Memory used on a stream other than its allocation stream must not be
    // reused before that work is done (Tensor.record_stream).
    for (int id : std::set<int>(all.begin(), all.end())) {
      Live& l = storages_.at(id);
      if (l.side != side) {
        cca::recordStream(l.storage->data_ptr(), stream);
      }
      if (side) {
        side_touched_.insert(id);
      }
    }
    launch(stream, owner.release());
  }

  const Trace& trace_;
  const Options& opt_;
  c10::cuda::CUDAStream main_;
  c10::cuda::CUDAStream side_;
  std::map<int, Live> storages_;
  std::set<int> side_touched_; // used on the side stream since the last join
  std::set<int> lost_; // storages whose allocation failed
  size_t errors_ = 0;
  long current_ = -1;
  size_t fired_seen_ = 0;
  void* hog_ptr_ = nullptr;
  size_t hogged_ = 0;
  std::vector<size_t> host_events_;
};

// ---------------------------------------------------------------------------
// Result

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

size_t allocatedBytes() {
  return aggregate(cca::getDeviceStats(0).allocated_bytes);
}

// What is still held once every storage is gone; empty when nothing leaked.
std::string leaks() {
  std::ostringstream os;
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  const auto st = lms::getStats(0);
  if (st.managed_bytes.current != 0 || st.active_bytes.current != 0 ||
      st.inactive_bytes.current != 0 || st.pagedout_bytes.current != 0) {
    os << "LMS gauges not zero (managed " << st.managed_bytes.current
       << ", active " << st.active_bytes.current << ", inactive "
       << st.inactive_bytes.current << ", paged out "
       << st.pagedout_bytes.current << "); ";
  }
  if (allocatedBytes() != 0) {
    os << allocatedBytes() << " bytes still allocated; ";
  }
  cca::emptyCache(); // also releases LMS's cached pinned host buffers
  if (lms::getStats(0).host_bytes.current != 0) {
    os << "LMS holds " << lms::getStats(0).host_bytes.current
       << " pinned host bytes; ";
  }
  if (simgpu_device_bytes_in_use(0) != 0) {
    os << simgpu_device_bytes_in_use(0) << " device bytes in use; ";
  }
  if (simgpu_host_bytes_in_use() != 0) {
    os << simgpu_host_bytes_in_use() << " pinned host bytes in use; ";
  }
  return os.str();
}

int usage(const char* argv0) {
  std::fprintf(
      stderr,
      "usage: %s TRACE [--fail-device-every N] [--fail-device-count C]\n"
      "       [--fail-host-every N] [--fail-copy-every N]\n"
      "       [--release-host-cache-every N] [--empty-cache-every N]\n"
      "       [--hog-bytes B --hog-at EVENT [--hog-release-at EVENT]]\n"
      "       [--corrupt-after EVENT --corrupt-id ID] [--continue-after-error]\n"
      "       [--no-host-placement]\n",
      argv0);
  return 2;
}

bool parseOptions(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--continue-after-error") {
      opt->continue_after_error = true;
      continue;
    }
    if (arg == "--no-host-placement") {
      opt->host_placement = false;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      if (opt->trace != nullptr) {
        return false;
      }
      opt->trace = argv[i];
      continue;
    }
    if (i + 1 >= argc) {
      return false;
    }
    const char* value = argv[++i];
    char* end = nullptr;
    const long long n = std::strtoll(value, &end, 10);
    if (*value == '\0' || *end != '\0' || n < 0) {
      return false;
    }
    if (arg == "--fail-device-every") {
      opt->fail_device_every = static_cast<int>(n);
    } else if (arg == "--fail-device-count") {
      opt->fail_device_count = static_cast<int>(n);
    } else if (arg == "--fail-host-every") {
      opt->fail_host_every = static_cast<int>(n);
    } else if (arg == "--fail-copy-every") {
      opt->fail_copy_every = static_cast<int>(n);
    } else if (arg == "--release-host-cache-every") {
      opt->release_host_cache_every = static_cast<int>(n);
    } else if (arg == "--empty-cache-every") {
      opt->empty_cache_every = static_cast<int>(n);
    } else if (arg == "--corrupt-after") {
      opt->corrupt_after = static_cast<long>(n);
    } else if (arg == "--corrupt-id") {
      opt->corrupt_id = static_cast<int>(n);
    } else if (arg == "--hog-bytes") {
      opt->hog_bytes = static_cast<size_t>(n);
    } else if (arg == "--hog-at") {
      opt->hog_at = static_cast<long>(n);
    } else if (arg == "--hog-release-at") {
      opt->hog_release_at = static_cast<long>(n);
    } else {
      return false;
    }
  }
  return opt->trace != nullptr;
}

} // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!parseOptions(argc, argv, &opt)) {
    return usage(argv[0]);
  }
  std::string outcome = "ok";
  std::string error; // the exception that ended the trace, if any
  std::string detail; // why the outcome is a failure, if it is one
  std::string stuck;
  size_t errors = 0;
  long at = -1;
  size_t hogged = 0;
  lms::LmsStats stats;
  size_t faults_fired = 0;
  std::vector<size_t> host_events;
  try {
    const Trace trace = readTrace(opt.trace);
    // Before anything allocates: the default LMS limit is measured at the
    // first LMS allocation.
    C10_CUDA_CHECK(simgpu_set_capacity(0, trace.capacity));
    cca::init(1);
    c10::cuda::set_device(0);
    lms::setEnabled(true);
    lms::setSizeThreshold(trace.threshold);
    lms::setPrefetchDepth(trace.prefetch);
    lms::setSpeculativeMargin(trace.speculative);
    lms::setLimit(0, trace.limit);
    lms::setHostPlacementEnabled(opt.host_placement);
    {
      Replayer replayer(trace, opt);
      bool failed = false;
      try {
        at = replayer.run(&outcome, &error);
      } catch (const ReplayFailure& e) {
        // The engine is in a state no program should see: report it with
        // the statistics so far, and check nothing more.
        failed = true;
        outcome = e.outcome;
        detail = e.what();
        at = replayer.current();
      }
      errors = replayer.errors();
      simgpu_clear_faults();
      faults_fired = simgpu_faults_fired();
      hogged = replayer.hogged();
      host_events = replayer.hostEvents();
      C10_CUDA_CHECK(cudaDeviceSynchronize());
      stats = lms::getStats(0);
      if (failed) {
        throw ReplayFailure(outcome, detail);
      }
      stuck = replayer.stuckPins();
      replayer.verifyAndFreeAll();
    }
    const std::string leaked = leaks();
    if (!stuck.empty()) {
      outcome = "stuck_pin";
      detail = stuck + leaked;
    } else if (g_mismatches.total() != 0) {
      outcome = "mismatch";
      std::lock_guard<std::mutex> lock(g_mismatches.mu);
      detail = std::to_string(g_mismatches.count) + " mismatches, first: ";
      for (const auto& m : g_mismatches.first) {
        detail += m + "; ";
      }
      detail += leaked;
    } else if (!leaked.empty()) {
      outcome = "leak";
      detail = leaked;
    }
  } catch (const BadTrace& e) {
    outcome = "bad_trace";
    detail = e.what();
  } catch (const ReplayFailure& e) {
    outcome = e.outcome;
    detail = e.what();
  } catch (const c10::Error& e) {
    // Not from a trace event (those are caught in run()): the final check or
    // the clean-up failed.
    outcome = "exception";
    detail = e.what_without_backtrace();
  } catch (const std::exception& e) {
    outcome = "exception";
    detail = e.what();
  }
  std::string host_list;
  for (size_t e : host_events) {
    host_list += (host_list.empty() ? "" : ", ") + std::to_string(e);
  }
  // One line: the driver parses it.
  std::printf(
      "trace-result {\"outcome\": %s, \"event\": %ld, \"error\": %s, "
      "\"detail\": %s, \"pageouts\": %lld, \"pageins\": %lld, "
      "\"reclaim_limit\": %lld, \"reclaim_alloc_failure\": %lld, "
      "\"reclaim_speculative\": %lld, \"prefetches\": %lld, "
      "\"oom_count\": %lld, \"faults_fired\": %zu, \"hogged\": %zu, "
      "\"errors\": %zu, \"schedule_detections\": %lld, "
      "\"schedule_victims\": %lld, \"early_pageouts\": %lld, "
      "\"schedule_prefetches\": %lld, \"input_host_placements\": %lld, "
      "\"host_events\": [%s]}\n",
      jsonString(outcome).c_str(),
      at,
      jsonString(error.substr(0, 2000)).c_str(),
      jsonString(detail.substr(0, 2000)).c_str(),
      static_cast<long long>(stats.pageout_count),
      static_cast<long long>(stats.pagein_count),
      static_cast<long long>(stats.reclaim_limit),
      static_cast<long long>(stats.reclaim_alloc_failure),
      static_cast<long long>(stats.reclaim_speculative),
      static_cast<long long>(stats.prefetch_count),
      static_cast<long long>(stats.oom_count),
      faults_fired,
      hogged,
      errors,
      static_cast<long long>(stats.schedule_detections),
      static_cast<long long>(stats.schedule_victims),
      static_cast<long long>(stats.early_pageout_count),
      static_cast<long long>(stats.schedule_prefetch_count),
      static_cast<long long>(stats.input_host_placement_count),
      host_list.c_str());
  std::fflush(stdout);
  const bool clean = outcome == "ok" || outcome == "oom" || outcome == "error";
  return clean ? 0 : 1;
}
