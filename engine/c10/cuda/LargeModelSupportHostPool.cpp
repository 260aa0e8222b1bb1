#include <c10/cuda/LargeModelSupportHostPool.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace c10::cuda::lms {

namespace {
constexpr size_t kSmallPage = 4096;
constexpr size_t kLargeChunk = 2 * 1024 * 1024;
// Buffers of at least this size are pinned by registering memory that the
// pool populated itself (populateAndRegister); smaller ones with
// cudaHostAlloc, whose fixed cost is small next to theirs.
constexpr size_t kRegisterMinBytes = 64 * 1024 * 1024;
// Threads that fault in the pages of one large buffer.
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
  const auto threads = static_cast<unsigned>(std::min<size_t>(
      std::min(kMaxPopulateThreads, hw), size / kRegisterMinBytes + 1));
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

HostBuffer HostPool::allocate(size_t size) {
  const size_t rounded = roundSize(size);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HostBuffer reused = takeCached(rounded);
    if (reused.ptr != nullptr) {
      return reused;
    }
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool registered = false;
    void* ptr = allocatePinned(rounded, registered);
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      capacity_.emplace(ptr, Pinned{rounded, registered});
      usage_.held_bytes += static_cast<int64_t>(rounded);
      usage_.in_use_bytes += static_cast<int64_t>(rounded);
      usage_.peak_held_bytes =
          std::max(usage_.peak_held_bytes, usage_.held_bytes);
      return {ptr, rounded};
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++usage_.alloc_failures;
    }
    // Idle cached buffers of other sizes may be what stands in the way.
    releaseCached();
  }
  return {};
}

void HostPool::release(
    HostBuffer buffer,
    cudaEvent_t ready,
    c10::DeviceIndex device) {
  TORCH_INTERNAL_ASSERT(buffer.ptr != nullptr);
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(
      capacity_.count(buffer.ptr) == 1, "LMS: host buffer not from this pool");
  usage_.in_use_bytes -= static_cast<int64_t>(buffer.capacity);
  cached_.emplace(buffer.capacity, Cached{buffer.ptr, ready, device});
}

void HostPool::releaseCached() {
  std::vector<std::pair<void*, Pinned>> to_free;
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
      capacity_.erase(found);
      it = cached_.erase(it);
    }
  }
  for (const auto& [ptr, pinned] : to_free) {
    freePinned(ptr, pinned.capacity, pinned.registered);
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

} // namespace c10::cuda::lms
