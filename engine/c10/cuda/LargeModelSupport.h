#pragma once

// Large Model Support (LMS) for the CUDA caching allocator.
//
// LMS lets a program use more GPU memory than the device has by moving the
// storages that the running operator does not use to pinned host memory and
// bringing them back when an operator (or raw data access) needs them.
//
// A storage managed by LMS moves through these states:
//
//   allocated --pin--> active --unpin--> inactive --reclaim--> paged out
//       ^                 ^                  |                     |
//       |                 +------pin---------+<------pin-----------+
//       +---------------raw data access------+<--raw data access---+
//
// * allocated: resident, being written by the operator that allocated it, or
//              accessed raw; not reclaimable. An operator's outputs become
//              inactive when it ends (releaseOutput).
// * active:    pinned by at least one running operator; never reclaimed.
// * inactive:  resident, on the device's least-recently-used reclaim list.
// * paged out: the contents live in a pinned host buffer; the device memory
//              has been returned to the caching allocator.
//
// An allocation made inside an operator that the device cannot hold even
// with every other storage paged out is placed in pinned host memory
// (setHostPlacementEnabled): the operator's kernels use it there, over the
// bus, and it is paged out from birth once the operator ends. So is an input
// of an operator that cannot be paged in beside its other inputs: it stays
// in its host copy while the operator runs, and is paged out again with
// what the operator wrote when it ends.
//
// Reclaim runs inside the allocation path: when an allocation would push the
// bytes allocated on the device past the LMS limit, and when the device
// allocation itself fails. Victims are taken least recently used first and
// only among storages of at least the size threshold.
//
// While a storage is paged out its DataPtr holds the address of its pinned
// host copy, which unified addressing makes valid on every device: code that
// reads the address without going through LMS sees the right contents over
// the bus instead of faulting on freed device memory.
//
// Error and warning messages format numbers with std::to_string or snprintf,
// never by streaming them into c10::str: in the drop-in extension, built
// against a stock wheel with another toolchain, std::ostream's numeric
// insertion has crashed the process (a segmentation fault where an
// out-of-memory error was being raised).
//
// The engine depends only on c10 and the CUDA runtime. It talks to the
// allocator through DeviceMemoryBackend so the same code serves PyTorch's
// patched caching allocator and the drop-in extension for stock wheels.

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAMacros.h>
#include <c10/util/ArrayRef.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace c10::cuda::lms {

// ---------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------

// Each setting has a setter and a getter, declared here from
// LargeModelSupportSettingTable.h, which says what each does and names its
// PYTORCH_CUDA_ALLOC_CONF key and its Python functions.
#define C10_LMS_SETTING(stem, Camel, key, Kind, type, setter, getter, what) \
  C10_CUDA_API void setter(type value);                                     \
  C10_CUDA_API type getter();
#define C10_LMS_DEVICE_SETTING(                                      \
    stem, Camel, key, Kind, type, setter, getter, what, conf_setter) \
  C10_CUDA_API void setter(c10::DeviceIndex device, type value);     \
  C10_CUDA_API type getter(c10::DeviceIndex device);
#include <c10/cuda/LargeModelSupportSettingTable.h>

// Called with the new value whenever LMS is turned on or off (and at once,
// if LMS is already on). Operator-boundary pinning, which lives above c10,
// installs its callbacks through this so that it costs nothing while LMS is
// off, however LMS was enabled (API or PYTORCH_CUDA_ALLOC_CONF).
using EnabledObserver = void (*)(bool enabled);
C10_CUDA_API void setEnabledObserver(EnabledObserver observer);

// Forgets the learned schedule (LMS is reactive until it learns again).
C10_CUDA_API void resetSchedule();

// Whether operators record recipes for recompute now: recompute is on and,
// since it was last turned on, an allocation of some device wanted more than
// half its limit (or a reclaim ran). Before that nothing will be dropped
// soon, and recording would cost every operator of a model that fits well
// host time for nothing; from half the limit on, the outputs a first reclaim
// takes have recipes, and the first iteration drops them instead of paging.
C10_CUDA_API bool isRecordingRecipes();

// PYTORCH_LMS_RECOMPUTE_LOG=1 (a diagnostic, read once): every choice between
// dropping and paging out a victim with a recipe, and why a recipe cannot
// price its recompute, are printed to stderr.
C10_CUDA_API bool isRecomputeLogEnabled();

// Applies one PYTORCH_CUDA_ALLOC_CONF option. Returns false when `key` is not
// an LMS option; throws c10::Error for a bad value. The keys, and how their
// values are written, are those of LargeModelSupportSettingTable.h.
C10_CUDA_API bool parseConfigOption(
    std::string_view key,
    std::string_view value);

// Applies every LMS option found in a PYTORCH_CUDA_ALLOC_CONF string and
// ignores the others; with `only_lms_keys` (a configuration string of LMS
// options alone, named `source` in errors), any other key is an error.
C10_CUDA_API void parseConfig(
    const char* conf,
    bool only_lms_keys = false,
    const char* source = "PYTORCH_CUDA_ALLOC_CONF");

// ---------------------------------------------------------------------------
// Operator boundaries and raw access
// ---------------------------------------------------------------------------

enum class StorageState : uint8_t {
  Unmanaged, // not an LMS storage (small, allocated with LMS off, other device)
  Allocated,
  Active,
  Inactive,
  PagedOut,
  // No copy anywhere: the contents are recomputed from the storage's recipe
  // when an operator pins it. Its DataPtr holds no address meanwhile, so a
  // raw access outside LMS raises ("data is not allocated") instead of
  // reading memory that belongs to someone else.
  Dropped,
};
C10_CUDA_API const char* toString(StorageState state);

// Makes the storage resident (paging it in on the current stream if needed)
// and protects it from reclaim until the matching unpin(). An input of the
// running operator that the device cannot hold stays in its host copy
// instead (setHostPlacementEnabled).
C10_CUDA_API void pin(c10::StorageImpl& storage);

// pin() for a recompute's replay (RecomputeHooks::recompute), which reads
// the storage where the program does not: the learned schedule, which knows
// storages by when the program uses them, does not see this use.
C10_CUDA_API void pinForRecompute(c10::StorageImpl& storage);
// Ends one pin. When the last pin ends, the storage becomes inactive and
// reclaimable; the current stream is remembered as a user of its memory.
C10_CUDA_API void unpin(c10::StorageImpl& storage);
// The operator that allocated the storage has ended (one of its outputs):
// if nothing pinned or accessed it since its allocation, it becomes inactive
// and reclaimable, so that tensors an operator saves for backward and no
// later forward operator reads (a cuDNN RNN's reserve space, a dropout mask)
// can be paged out. The current stream is remembered as a user.
C10_CUDA_API void releaseOutput(c10::StorageImpl& storage);
// Raw data access outside an operator: pages the storage in if needed and
// takes it off the reclaim list until an operator pins and unpins it again.
C10_CUDA_API void access(c10::StorageImpl& storage);

C10_CUDA_API StorageState getState(const c10::StorageImpl& storage);
C10_CUDA_API bool isManaged(const c10::DataPtr& data_ptr);

// When an operator's inputs cannot all be made resident, operator-boundary
// pinning cannot always raise where it notices (a RecordFunction callback
// only logs what it throws). It hands the error to the engine instead, and
// the next LMS allocation on this thread raises it: inside the operator,
// before it launches a kernel on an output. Cleared when the operator ends.
// `device` is the device whose statistics count the failure.
C10_CUDA_API void setPendingError(
    c10::DeviceIndex device,
    std::exception_ptr error);
C10_CUDA_API void clearPendingError();
C10_CUDA_API bool hasPendingError();

// A step of compiled code in a CUDA graph pool (an Inductor warm-up or
// capture) that the Python layer runs again without CUDA graphs when it runs
// out of memory (torch/cuda/_lms_cudagraphs.py). While one is under way on
// this thread, running out of memory ends it with c10::Error, not
// c10::OutOfMemoryError: a library that catches the latter and goes on
// another way (cuDNN with a smaller workspace, whose plan it keeps for the
// plain code that runs instead, with other numbers in the last bits) must
// not see it. Steps nest; the end of the outermost says whether one ran out
// of memory since it began.
C10_CUDA_API void beginGraphPoolStep();
C10_CUDA_API bool endGraphPoolStep();
// Where an out-of-memory error is about to be raised (LMS's own, an
// operator's pending one, the caching allocator's through its integration):
// inside a graph pool step, raises the c10::Error that ends it, with `what`
// (the out-of-memory message) in its text; outside one, does nothing.
// `device` is -1 where it is not known.
C10_CUDA_API void raiseIfGraphPoolStep(
    c10::DeviceIndex device,
    const std::string& what);

// Out-of-memory errors LMS has raised on this thread, the request of the
// last one, and why it had no room (its message's verdict: the running
// operator's working set passes the cap, or the tensors fit by bytes but the
// allocator's mapped memory leaves no room beside them; empty when the error
// was handed over by pinning or neither applies). An operator may catch them
// and go on another way (cuDNN tries an algorithm with a smaller workspace
// when its workspace does not fit), which can change its results:
// operator-boundary pinning compares the count at an operator's start and end
// to warn when that happened, and says which of the two it was.
C10_CUDA_API uint64_t outOfMemoryErrorsRaised();
C10_CUDA_API size_t lastOutOfMemoryRequest();
C10_CUDA_API std::string lastOutOfMemoryVerdict();

// Memory that LMS does not manage but that its owner can give back when no
// page-out makes room: the CUDA graph pools of compiled functions that are
// not running and whose outputs are all dead (torch.cuda's Python side
// registers their release). When an allocation of the LMS path fails with
// every reclaimable storage paged out, before it is placed in host memory or
// raises the out-of-memory error, the engine calls the releaser with the
// device and the request. It returns whether it gave memory back (the
// allocation is then tried again, and the releaser asked again while it
// gives some, a few times at most) and sets `note` to a sentence for the
// error message: what holds the memory it did not give back. It is called
// from the allocating thread with no engine lock held, never for an
// allocation of a CUDA graph capture (those do not take this path) nor for a
// page-in ahead of use. Null: none.
using OutsideMemoryReleaser =
    bool (*)(c10::DeviceIndex device, size_t size, std::string& note);
C10_CUDA_API void setOutsideMemoryReleaser(OutsideMemoryReleaser releaser);

// An operator whose input stays paged out reads and writes the pinned host
// copy in place (see the top of this file). beginHostUse() orders the
// current stream after the page-out copy that filled the host copy;
// endHostUse() orders a later page-in after the operator's work on it.
// Both do nothing for storages that are resident or unmanaged.
C10_CUDA_API void beginHostUse(c10::StorageImpl& storage);
C10_CUDA_API void endHostUse(c10::StorageImpl& storage);

// An operator boundary, for the learned swap schedule: operator-boundary
// pinning calls it when an outermost operator (or a compiled kernel launch)
// starts, with the storages of its inputs, before pinning them. Storages LMS
// does not manage are ignored. Pages out early and pages in ahead as the
// schedule says.
C10_CUDA_API void beginOperator(
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs);

// Operator working sets. Operator-boundary pinning calls beginWorkingSet
// when an outermost operator starts, with the storages of its inputs, before
// it pins them, and endWorkingSet when the operator ends (also when it
// throws). In between, the engine counts what the operator allocates and has
// not freed, and learns, per operator name, the most it allocated for each
// size of inputs it ran with, and per byte of input.
//
// An operator's tensors must fit together, and in the pages the allocator
// maps, not only by bytes: inputs resident since long ago sit in pages whose
// other blocks were paged out, and the operator's outputs land in the holes
// of pages whose neighbours are paged out next. That partly used memory stays
// mapped, and a request can fail with everything else paged out although its
// bytes fit. So when what the operator is expected to need (its inputs, what
// it allocated before with inputs of that size, else per byte of input but
// at least twice its inputs, or for an operator not seen yet twice its inputs
// or the most any operator allocated), with what cannot be
// paged out, leaves less than 200 MiB of the limit (ten of the allocator's
// 20 MiB pages, what partly used pages can take), beginWorkingSet reads the
// allocator's layout: the segments and pages that stay mapped once every
// other storage is out, because blocks of the inputs or of what cannot be
// paged out lie in them. When those, the inputs still paged out and what the
// operator allocates inside itself, with a page to spare for each block of
// 1 MiB or more it allocated inside itself before (each may leave the page it
// ends in partly used; ten at most), fit the limit, paging on demand makes
// the room and nothing moves ahead. Otherwise it
// packs: it pages out every inactive storage of the device, the operator's
// own inputs included, and returns the allocator's cached free memory to the
// device. The pins that follow page the inputs back in side by side, and the
// operator allocates from pages that nothing else holds. An allocator that
// cannot show its layout (DeviceMemoryBackend::segments) gets the pack. An
// operator measured before with inputs of this size is not packed when that
// cannot help: it allocated nothing inside itself, or its working set passes
// the allocator's cap by bytes once libraries' workspaces are freed (below).
// PYTORCH_LMS_PACK_LOG=1 prints each tight operator's figures and decision,
// and what an operator of 8 MiB or more (inputs and inside bytes) measured
// the first time at an input size and whenever it allocated a page more.
C10_CUDA_API void beginWorkingSet(
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs);
C10_CUDA_API void endWorkingSet(std::string_view name);

// Libraries that keep a workspace in the caching allocator between calls
// (cuBLAS: one per handle and stream, 32 MiB each under
// CUBLAS_WORKSPACE_CONFIG=:4096:8) keep it where it was first placed, and
// LMS cannot page it out: in the middle of the device's memory it keeps the
// pages around it mapped (a 32 MiB workspace spans two or three 20 MiB
// pages), and a packed operator's inputs come back into the holes beside
// it. So beginWorkingSet calls the releaser for every operator it judges
// tight that allocates inside itself, before it weighs whether to pack it:
// not packed, its blocks can take the workspaces' room; packed, the
// workspaces go back to the device with the allocator's cache; and they do
// not count among what cannot be paged out when it weighs whether a pack
// can help at all. The library allocates them again at its next use
// (one allocation, and the page-out that may make its room, per tight
// operator). The ATen glue sets it (at::cuda::clearCublasWorkspaces, where
// the release has it). Not called while more than one device has an engine:
// the library's record of its workspaces is not guarded in every release
// (v2.6.0's is not) against another device's thread using it meanwhile. A
// program that runs cuBLAS from two threads on one device at once is not
// guarded against either: turn packing off there (setPackingEnabled).
// Null: none.
using WorkspaceReleaser = void (*)();
C10_CUDA_API void setWorkspaceReleaser(WorkspaceReleaser releaser);

// Compiled code says which storages it uses next, soonest first: the
// paged-out ones are paged in ahead of use on the H2D stream, in that order,
// while the bytes paged in ahead and not yet used stay within the prefetch
// budget (setPrefetchBudget) and the limit has room, without reclaiming
// anything. When the limit leaves no room, storages of none of `storages`
// are paged out early, least recently used first, so that a later call
// finds it. Returns the bytes whose page-in was started. Unmanaged storages
// are ignored; does nothing while LMS or graph prefetch is off, and while a
// learned schedule is active (it pages in ahead what the graph would name,
// and knows the rest of the iteration too).
C10_CUDA_API size_t pageInAhead(c10::ArrayRef<c10::StorageImpl*> storages);

// Pages out every inactive storage of `device` now; returns the bytes freed.
C10_CUDA_API size_t reclaimInactive(c10::DeviceIndex device);

// Pages out least-recently-used inactive storages of `device` totalling at
// least `bytes` (fewer if not enough are inactive); returns the bytes freed.
// Counted as a limit-triggered reclaim: for allocators that enforce a limit of
// their own (e.g. a memory-fraction cap) outside the allocation path.
C10_CUDA_API size_t reclaimBytes(c10::DeviceIndex device, size_t bytes);

// Pages out least-recently-used inactive storages of `device` until an
// allocation of `incoming_bytes` would stay under the limit (and under the
// speculative mark, if set); returns the bytes freed. The allocation path
// does this itself; allocators that cannot call LMS on every allocation call
// it where they can (e.g. when their free list misses).
C10_CUDA_API size_t
ensureHeadroom(c10::DeviceIndex device, size_t incoming_bytes);

// Frees cached pinned host buffers that no paged-out storage uses.
C10_CUDA_API void releaseCachedHostMemory();

// ---------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------

struct LmsStat {
  int64_t current = 0;
  int64_t peak = 0;
};

// The statistics of a device: a field for each row of
// LargeModelSupportStatTable.h, which says what each counts.
struct LmsStats {
#define C10_LMS_COUNTER(type, name) type name = 0;
#define C10_LMS_GAUGE(name) LmsStat name;
#include <c10/cuda/LargeModelSupportStatTable.h>
};

C10_CUDA_API LmsStats getStats(c10::DeviceIndex device);
C10_CUDA_API void resetPeakStats(c10::DeviceIndex device);
C10_CUDA_API void resetAccumulatedStats(c10::DeviceIndex device);

// ---------------------------------------------------------------------------
// Allocator integration
// ---------------------------------------------------------------------------

// A contiguous range of device memory that the allocator has mapped, with
// its blocks in address order: each block's size and whether it is allocated.
struct SegmentMap {
  uintptr_t base = 0;
  std::vector<std::pair<size_t, bool>> blocks;
  // 0: the range goes back to the device only whole (a segment of its own).
  // Otherwise the allocator maps and unmaps it in pages of this size from
  // `base` (expandable segments), and a page stays mapped while any block in
  // it is allocated.
  size_t page_bytes = 0;
};

// Bytes of `map` that stay mapped while the blocks flagged in `held` (one
// flag per block of map.blocks) stay allocated: the whole range when it goes
// back to the device only whole, else every page one of them lies in.
C10_CUDA_API size_t
mappedBytesHeld(const SegmentMap& map, const std::vector<bool>& held);

// What the engine needs from the allocator that owns device memory.
class C10_CUDA_API DeviceMemoryBackend {
 public:
  virtual ~DeviceMemoryBackend();
  // Device memory for `size` bytes, safe to use in `stream` order. Throws
  // c10::OutOfMemoryError when the device cannot provide it.
  virtual void* malloc(
      c10::DeviceIndex device,
      size_t size,
      cudaStream_t stream) = 0;
  // Returns memory from malloc(). Reuse is safe in the order of the stream it
  // was allocated on.
  virtual void free(void* ptr) = 0;
  // DataPtr the backend itself would return for memory from malloc(); used
  // for allocations LMS does not manage.
  virtual c10::DataPtr makeDataPtr(void* ptr, c10::DeviceIndex device) = 0;
  // Bytes currently allocated to tensors / reserved from the device.
  virtual size_t allocatedBytes(c10::DeviceIndex device) = 0;
  virtual size_t reservedBytes(c10::DeviceIndex device) = 0;
  // Returns memory from malloc() whose allocation stream is unknown: it may
  // be reused only after the work queued on `stream` so far is done.
  virtual void freeAfter(
      void* ptr,
      c10::DeviceIndex device,
      cudaStream_t stream) = 0;
  // Whether LMS may take over a storage it did not allocate, the first time
  // an operator pins it (allocators that cannot return LMS DataPtrs). The
  // memory must be freeable with free()/freeAfter().
  virtual bool adoptable(const c10::DataPtr& data_ptr) {
    (void)data_ptr;
    return false;
  }
  // The most device memory the allocator may hold for `device` (a per-process
  // memory fraction, for instance); the LMS limit never exceeds it.
  virtual size_t capacityBytes(c10::DeviceIndex device) {
    (void)device;
    return SIZE_MAX;
  }
  // Device memory reserved by the allocator's private pools, when it knows.
  virtual size_t privatePoolBytes(c10::DeviceIndex device) {
    (void)device;
    return 0;
  }
  // Returns the allocator's cached free blocks of `device` to the device, so
  // that other processes (and libraries allocating outside the allocator) can
  // have the memory. Returns false when the allocator cannot.
  virtual bool releaseCachedMemory(c10::DeviceIndex device) {
    (void)device;
    return false;
  }
  // Whether a CUDA graph capture may be underway on any device. The engine
  // asks CUDA whether the stream is capturing on every allocation, pin and
  // unpin (about 0.5 us a call; GPT at 1.5x the device: 26 ms of host time an
  // iteration) unless this says no. An allocator that routes every capture's
  // allocations to a private pool, as PyTorch's CUDA graphs do, knows: true
  // from before a capture begins until after it ends. The patched caching
  // allocators and the drop-in's answer it; the default keeps the question.
  virtual bool captureMayBeUnderway() {
    return true;
  }
  // The ranges the allocator has mapped for requests of more than 1 MiB on
  // `stream` in its default pool (private pools left out), or none when it
  // cannot tell. Read when an allocation has failed or an operator is about
  // to need most of the limit (beginWorkingSet), never on the fast path.
  virtual std::vector<SegmentMap> segments(
      c10::DeviceIndex device,
      cudaStream_t stream) {
    (void)device;
    (void)stream;
    return {};
  }
};

// Installs the backend; must be called before the first LMS allocation.
C10_CUDA_API void setBackend(DeviceMemoryBackend* backend);
C10_CUDA_API DeviceMemoryBackend* getBackend();

// The LMS allocation path: reclaims when the allocation would pass the limit
// or when the device allocation fails, and returns a DataPtr that LMS manages
// when `size` is at least the size threshold.
C10_CUDA_API c10::DataPtr allocate(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream);

// Device memory for `size` bytes on `stream` that LMS does not manage
// (workspaces, raw allocations): the same limit trigger and reclaim-and-retry
// as allocate(). Free it with the backend's free().
C10_CUDA_API void* allocateRaw(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream);

// Failure trigger for allocators that can retry inside their own malloc
// path, after an allocation of `size` bytes on `stream` failed: pages out the
// storages that hold a range of the allocator's memory the request fits in,
// else inactive storages of `device` in reclaim order totalling at least
// `size` bytes. Returns true when anything was freed.
C10_CUDA_API bool reclaimForFailedAllocation(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream);

// For allocators whose free list held no block for `size` bytes on `stream`
// and that ask before they map memory anew (the caching allocator's
// free-memory callbacks). When the allocator cannot map the request (what it
// has mapped and the request pass this process's share of the device, or the
// allocator's cap) it would next return its whole cache to the device, a
// synchronization, and map the request anew: instead, pages out or drops the
// storages that hold the cheapest range of its memory the request fits in,
// handing their memory back in the request stream's order, so that its next
// search of the free list finds the range. Nothing moves while a CUDA graph
// capture may be underway. Returns true when anything was freed.
C10_CUDA_API bool reclaimBeforeMapping(
    c10::DeviceIndex device,
    size_t size,
    cudaStream_t stream);

// Records that `stream` uses the memory of an LMS storage (recordStream): a
// page-out copy is ordered after the stream's work. Returns whether the
// DataPtr's address is the storage's device memory, a block of the allocator
// that the allocator may record the stream on too; false while it is the
// storage's pinned host memory (paged out, or in host memory for a running
// operator: setHostPlacementEnabled), which no allocator block holds.
C10_CUDA_API bool recordStream(
    const c10::DataPtr& data_ptr,
    cudaStream_t stream);

// ---------------------------------------------------------------------------
// Recompute
// ---------------------------------------------------------------------------

// What the engine needs from the layer that records recipes (operator-boundary
// pinning, which sees operators' inputs and outputs). Each hook receives a
// storage whose record setRecomputable() marked.
struct RecomputeHooks {
  // Device milliseconds that recomputing `storage` now would take (its
  // producing operator's measured duration, plus bringing back inputs that
  // are not resident), or a negative value when its recipe is no longer
  // valid. Called from the allocation path with no engine lock held: it must
  // neither allocate device memory nor run operators.
  double (*cost_ms)(c10::StorageImpl& storage);
  // `storage` is about to be dropped: keep alive what recomputing it needs.
  // Returns false when it can no longer be recomputed. Same rules as
  // cost_ms.
  bool (*retain)(c10::StorageImpl& storage);
  // Recomputes dropped `storage` on the current stream and hands the result
  // to fillDropped(). Throws when it cannot (the storage stays dropped).
  void (*recompute)(c10::StorageImpl& storage);
  // The allocation whose DataPtr context is `context` is gone: forget its
  // recipe. Called from the storage's deleter.
  void (*forget)(void* context);
  // Appends to `out` the CUDA storages that recomputing dropped `storage`
  // reads, so that the learned schedule can page them in ahead of its
  // recompute. Same rules as cost_ms.
  void (*inputs)(
      c10::StorageImpl& storage,
      std::vector<c10::intrusive_ptr<c10::StorageImpl>>& out);
};
C10_CUDA_API void setRecomputeHooks(const RecomputeHooks* hooks);

// Marks a managed storage's current allocation as having a recipe (or not):
// only such storages are offered to the hooks.
C10_CUDA_API void setRecomputable(c10::StorageImpl& storage, bool recomputable);

// A dropped storage's contents were recomputed into `fresh` (a storage of the
// same size, just allocated by the replayed operator): `dropped` takes over
// fresh's memory, and `fresh` is left holding nothing. The record the
// storage had (and its DataPtr context) goes with `fresh`; the new one is
// returned, for the caller to move the recipe to.
C10_CUDA_API void* fillDropped(
    c10::StorageImpl& dropped,
    c10::StorageImpl& fresh);

// What paging `bytes` out and back in costs the program on `device`, in
// milliseconds: the copies' time both ways at the bandwidth measured so far,
// times the share of copy time that recent copies made streams wait (the
// learned schedule hides the rest behind compute). A storage is dropped
// instead of paged out when recomputing it costs less. Negative before any
// copy was timed.
C10_CUDA_API double pagingCostMs(c10::DeviceIndex device, size_t bytes);

// The share of recent copy time on `device` that made streams wait (0 to 1;
// 1 before any copy was timed): what a copy costs the program, per
// millisecond of copying. pagingCostMs() is the copies' time times this.
C10_CUDA_API double copyStallShare(c10::DeviceIndex device);

// Milliseconds that copying `bytes` to the host (or back to the device)
// takes at the bandwidth measured on `device` so far, or a negative value
// before any copy was timed.
C10_CUDA_API double copyCostMs(
    c10::DeviceIndex device,
    size_t bytes,
    bool to_device);

// The message an out-of-memory error carries when even reclaiming every
// inactive storage cannot make room.
C10_CUDA_API std::string describeOutOfMemory(
    c10::DeviceIndex device,
    size_t size);

} // namespace c10::cuda::lms
