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
// bus, and it is paged out from birth once the operator ends.
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

// Turns LMS on or off for allocations made from now on. Storages allocated
// while LMS was off are never paged out.
C10_CUDA_API void setEnabled(bool enabled);
C10_CUDA_API bool isEnabled();

// Called with the new value whenever LMS is turned on or off (and at once,
// if LMS is already on). Operator-boundary pinning, which lives above c10,
// installs its callbacks through this so that it costs nothing while LMS is
// off, however LMS was enabled (API or PYTORCH_CUDA_ALLOC_CONF).
using EnabledObserver = void (*)(bool enabled);
C10_CUDA_API void setEnabledObserver(EnabledObserver observer);

// Soft limit, in bytes, of device memory allocated to tensors before LMS
// reclaims inactive storages. The limit in force is the smaller of the limit
// set here (0, the default, sets none) and this process's share of the
// device: its size, less the memory that anything but this process's caching
// allocator holds (other processes, CUDA contexts, library handles), less a
// headroom of 5% of the device that every LMS process leaves free for
// allocations outside the allocator (cuBLAS, cuDNN, NCCL). The share is read
// from the driver at most every few milliseconds, so processes that share a
// device shrink their limits as the others grow; a process that holds more
// than its share while the others grow also returns its cached free blocks
// to the device (alone, it keeps them: returning them would only make the
// allocator map the same memory again). The
// limit never exceeds 95% of what the allocator may hold either
// (DeviceMemoryBackend::capacityBytes, e.g. a per-process memory fraction):
// the rest is room for the allocator's fragmentation.
C10_CUDA_API void setLimit(c10::DeviceIndex device, size_t bytes);
C10_CUDA_API size_t getLimit(c10::DeviceIndex device);

// Smallest storage, in bytes, that LMS may page out (default 1 MiB).
C10_CUDA_API void setSizeThreshold(size_t bytes);
C10_CUDA_API size_t getSizeThreshold();

// Prefetch: when an operator pins a paged-out storage, also start paging in
// up to this many storages that were paged out just before it (a backward
// pass needs activations in the reverse of the order they were paged out),
// on the copy stream, within the limit's headroom.
// 0 (the default) turns prefetch off.
C10_CUDA_API void setPrefetchDepth(int depth);
C10_CUDA_API int getPrefetchDepth();

// Speculative page-out: once allocated bytes exceed (limit - margin), an
// allocation also pages out inactive storages down to that mark, so that
// copies overlap with compute before the limit is reached. 0 (the default)
// turns it off.
C10_CUDA_API void setSpeculativeMargin(size_t bytes);
C10_CUDA_API size_t getSpeculativeMargin();

// Learned swap schedule (LargeModelSupportSchedule.h): LMS learns the
// repeating order in which operators use storages (a training iteration) and,
// once it has seen it twice, pages out the storages used furthest in the
// future, early and on a device-to-host stream, and pages them back in ahead
// of use on a host-to-device stream. When the order changes it falls back to
// least-recently-used reclaim and demand page-in until it has learned the new
// one. On by default.
C10_CUDA_API void setScheduleEnabled(bool enabled);
C10_CUDA_API bool isScheduleEnabled();

// How many operators ahead the schedule pages storages in (and within which
// it never picks a victim while another will do). 0 (the default) derives it
// from the iteration: an eighth of its operators, between 4 and 512.
C10_CUDA_API void setLookahead(int operators);
C10_CUDA_API int getLookahead();

// Bytes the schedule may have paged in ahead and not yet used, and the room
// it keeps free under the limit by paging out early. 0 (the default) derives
// it from the limit and the page-in traffic: an eighth of the limit, scaled
// up to a quarter as an iteration pages in one to two times the limit.
C10_CUDA_API void setPrefetchBudget(size_t bytes);
C10_CUDA_API size_t getPrefetchBudget();

// Forgets the learned schedule (LMS is reactive until it learns again).
C10_CUDA_API void resetSchedule();

// Page-ins ahead of use planned by compiled code (pageInAhead below): a
// compiled graph knows the order in which it uses its inputs from the first
// iteration on, also where the learned schedule never settles (shapes that
// change every iteration); it steps aside while a learned schedule is active.
// On by default; off, pageInAhead does nothing.
C10_CUDA_API void setGraphPrefetchEnabled(bool enabled);
C10_CUDA_API bool isGraphPrefetchEnabled();

// Host budget, in bytes: the most pinned host memory that the LMS processes
// of this host may hold together (page-outs go there). Past it, a page-out
// is refused and the allocation that needed the room raises
// c10::OutOfMemoryError naming host memory, where pinning more would have
// the kernel's OOM killer end a process. 0 (the default) derives it from
// what the host can give, read at most every 100 ms: /proc/meminfo's
// MemAvailable plus what LMS processes have pinned already, within the
// memory limit of the process's cgroup, less a reserve for the rest of the
// system (LargeModelSupportHostPool.h). The LMS processes of a host share
// their pinned bytes through a ledger in /dev/shm ($PYTORCH_LMS_HOST_LEDGER
// names another file). A value set here replaces the derived budget, also
// above what the host can give.
C10_CUDA_API void setHostLimit(size_t bytes);
C10_CUDA_API size_t getHostLimit();

// Recompute instead of paging (the hybrid): a victim whose contents an
// operator can reproduce (a recipe: operator-boundary pinning records, for
// the outputs of pure operators, the operator and its inputs) is dropped
// instead of paged out when recomputing it costs less than moving it over the
// bus both ways at the measured copy bandwidth, and is recomputed when an
// operator needs it (see RecomputeHooks below). Off by default.
C10_CUDA_API void setRecomputeEnabled(bool enabled);
C10_CUDA_API bool isRecomputeEnabled();

// PYTORCH_LMS_RECOMPUTE_LOG=1 (a diagnostic, read once): every choice between
// dropping and paging out a victim with a recipe, and why a recipe cannot
// price its recompute, are printed to stderr.
C10_CUDA_API bool isRecomputeLogEnabled();

// Applies one PYTORCH_CUDA_ALLOC_CONF option. Returns false when `key` is not
// an LMS option; throws c10::Error for a bad value. Keys:
//   lms:True|False            enable
//   lms_limit_mb:<MiB>        limit for every device
//   lms_size_mb:<MiB>         size threshold (fractions allowed, e.g. 0.5)
//   lms_prefetch:<count>      prefetch depth
//   lms_speculative_mb:<MiB>  speculative page-out margin
//   lms_schedule:True|False   learned swap schedule
//   lms_lookahead:<count>     schedule lookahead in operators (0: derived)
//   lms_prefetch_budget_mb:<MiB>  schedule prefetch budget (0: derived)
//   lms_graph_prefetch:True|False page-ins planned by compiled graphs
//   lms_host_limit_mb:<MiB>   host budget for pinned memory (0: derived)
//   lms_recompute:True|False  drop and recompute where cheaper than paging
//   lms_pack:True|False       pack operators that need most of the device
//   lms_host_placement:True|False  place in host memory what an operator
//                             cannot have on the device
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
// and protects it from reclaim until the matching unpin().
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

// Packing (beginWorkingSet) is on by default; off, working sets are still
// counted and learned. PYTORCH_CUDA_ALLOC_CONF key: lms_pack.
C10_CUDA_API void setPackingEnabled(bool enabled);
C10_CUDA_API bool isPackingEnabled();

// Host placement (on by default). A request of at least the size threshold
// made inside an operator (between beginWorkingSet and endWorkingSet) that
// the device cannot give even after every reclaimable storage is paged out is
// placed in pinned host memory within the host budget, instead of raising an
// out-of-memory error: unified addressing makes it valid on the device, so
// the operator's kernels read and write it over the bus. The operator runs
// slower and computes what it computes with device memory; a library that
// would have caught the error (cuDNN tries a plan with a smaller workspace)
// keeps the algorithm it picks with room to spare, and the numbers stay those
// of a run with more memory. What the operator still holds when it ends (an
// output) is paged out from then on, and paged in when next used. Counted in
// host_placement_count and host_placement_bytes; each operator that needs it
// is named once in a warning. Off, the request raises the out-of-memory
// error. PYTORCH_CUDA_ALLOC_CONF key: lms_host_placement.
C10_CUDA_API void setHostPlacementEnabled(bool enabled);
C10_CUDA_API bool isHostPlacementEnabled();

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

struct LmsStats {
  // Copies.
  int64_t pageout_count = 0;
  int64_t pageout_bytes = 0;
  int64_t pagein_count = 0;
  int64_t pagein_bytes = 0;
  // Reclaim rounds, by what triggered them.
  int64_t reclaim_limit = 0; // an allocation would pass the limit
  int64_t reclaim_speculative = 0; // speculative page-out margin crossed
  int64_t reclaim_alloc_failure = 0; // the device allocation failed
  int64_t reclaim_explicit = 0; // reclaimInactive()
  // Operators packed before they pinned their inputs (beginWorkingSet), and
  // the bytes paged out for them.
  int64_t pack_count = 0;
  int64_t pack_bytes = 0;
  // Tight operators (packed or not) for which libraries' cached workspaces
  // were freed (setWorkspaceReleaser).
  int64_t workspace_releases = 0;
  // Failed allocations placed by paging out the storages that held a range
  // the request fits in (reclaimFragments).
  int64_t fragment_reclaims = 0;
  // Allocations inside operators placed in pinned host memory because the
  // device could not hold them (setHostPlacementEnabled), and their bytes.
  int64_t host_placement_count = 0;
  int64_t host_placement_bytes = 0;
  // Where allocations of the LMS path were satisfied from.
  int64_t alloc_from_cache = 0; // the caching allocator's free list
  int64_t alloc_from_device = 0; // a new device allocation
  int64_t alloc_after_reclaim = 0; // only after LMS reclaimed storages
  // Prefetch.
  int64_t prefetch_count = 0;
  int64_t prefetch_hits = 0; // prefetched storages pinned while resident
  // Prefetched storages an operator pinned while their copy was still
  // running (the operator's stream waited for the rest of it).
  int64_t prefetch_late = 0;
  // Page-ins made on the consumer's stream when an operator needed them.
  int64_t pagein_demand_count = 0;
  // Learned swap schedule (process-wide, except where noted per device):
  int64_t schedule_active = 0; // 1 while a learned schedule is in use
  int64_t schedule_period = 0; // operators per iteration, 0 when inactive
  int64_t schedule_detections = 0; // schedules adopted
  int64_t schedule_fallbacks = 0; // schedules dropped: the pattern broke
  // Per device: victims chosen by next use, page-outs made early (right
  // after a last use before a long gap, without a hand-back), storages used
  // again before their early page-out released the memory (no copy back),
  // page-ins issued ahead of use on the H2D stream.
  int64_t schedule_victims = 0;
  int64_t early_pageout_count = 0;
  int64_t early_pageout_bytes = 0;
  int64_t schedule_rescues = 0;
  int64_t schedule_prefetch_count = 0;
  // Per device: the early page-outs made ahead of the iteration's peak of
  // demand, from the start of the iteration (part of the early page-outs
  // above).
  int64_t peak_pageout_count = 0;
  int64_t peak_pageout_bytes = 0;
  // Per device: the prefetch budget in force (set or derived; 0 while no
  // schedule is active).
  int64_t schedule_prefetch_budget_bytes = 0;
  // Per device: page-ins ahead of use started by pageInAhead (a compiled
  // graph's plan), and the early page-outs it made to find room for them.
  int64_t graph_prefetch_count = 0;
  int64_t graph_prefetch_bytes = 0;
  int64_t graph_pageout_count = 0;
  // Time the compute streams waited on LMS copies (page-in copies on the
  // consumer stream, and waits for page-outs whose memory they reuse).
  double stall_ms = 0.0;
  // The copies LMS made, timed on their streams, each way: their bytes and
  // the milliseconds they took (bytes / ms: the bandwidth that paging a
  // storage out and back gets; timed copies only, so the bytes can trail
  // pageout_bytes and pagein_bytes until the copies are done).
  int64_t copy_out_bytes = 0;
  double copy_out_ms = 0.0;
  int64_t copy_in_bytes = 0;
  double copy_in_ms = 0.0;
  // Recompute (setRecomputeEnabled): victims dropped instead of paged out,
  // and dropped storages recomputed (one operator replayed each), with the
  // device time the replays took on their streams.
  int64_t drop_count = 0;
  int64_t drop_bytes = 0;
  int64_t recompute_count = 0;
  int64_t recompute_bytes = 0;
  double recompute_ms = 0.0;
  // Inputs of dropped storages' recipes that the learned schedule paged in
  // ahead of the recompute.
  int64_t recompute_input_prefetch_count = 0;
  int64_t recompute_input_prefetch_bytes = 0;
  int64_t oom_count = 0; // LMS out-of-memory errors raised
  // Operators whose inputs could not all be made resident.
  int64_t pin_failures = 0;
  // Times cached free blocks were returned to the device because this
  // process held more than its share of it (see the limit below).
  int64_t cache_releases = 0;
  // Host memory (process-wide): the host budget in force (setHostLimit; 0
  // when none could be derived), the pinned bytes all LMS processes of the
  // host hold as the ledger says, and pinned allocations the budget refused.
  int64_t host_budget_bytes = 0;
  int64_t host_ledger_bytes = 0;
  int64_t host_refusals = 0;
  // Gauges, in bytes.
  LmsStat managed_bytes; // every LMS storage, resident or not
  LmsStat active_bytes; // pinned by running operators
  // Allocated by running operators and not released yet: their outputs and
  // temporaries so far, part of their working set like what they pin.
  LmsStat operator_output_bytes;
  LmsStat inactive_bytes; // resident and reclaimable
  LmsStat pagedout_bytes; // contents held in host memory
  LmsStat dropped_bytes; // contents to be recomputed
  LmsStat host_bytes; // pinned host memory held by LMS (process-wide)
  // Bytes allocated on the device beyond the limit after an allocation's
  // reclaim: what running operators pin, and storages LMS cannot page out.
  LmsStat over_limit_bytes;
  // Device memory reserved by private pools (CUDA graphs, MemPool), which
  // LMS never pages out: a captured graph bakes in its addresses.
  LmsStat private_pool_bytes;
  size_t limit_bytes = 0;
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

// Records that `stream` uses the memory of an LMS storage (recordStream): a
// page-out copy is ordered after the stream's work.
C10_CUDA_API void recordStream(
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
