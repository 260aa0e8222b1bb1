// The table of Large Model Support statistics: one row per field of LmsStats
// (LargeModelSupport.h), in the order lms_stats() reports them. A row is
//   C10_LMS_COUNTER(type, name)  a count or amount: int64_t, double for
//                                milliseconds, size_t for the limit
//   C10_LMS_GAUGE(name)          bytes held now and at most (LmsStat)
// Whoever includes this file defines both macros to make what it needs of
// every row (the fields of LmsStats, the entries of the bindings' stats dict);
// the file undefines them at its end, so it is included once per use and has
// no include guard. The Python lists of the keys (torch/cuda/lms.py and the
// GPU test) are generated from it: `python -m lmstool tables`.

// clang-format off

// Copies.
C10_LMS_COUNTER(int64_t, pageout_count)
C10_LMS_COUNTER(int64_t, pageout_bytes)
C10_LMS_COUNTER(int64_t, pagein_count)
C10_LMS_COUNTER(int64_t, pagein_bytes)
// Reclaim rounds, by what triggered them.
C10_LMS_COUNTER(int64_t, reclaim_limit) // an allocation would pass the limit
C10_LMS_COUNTER(int64_t, reclaim_speculative) // speculative page-out margin crossed
C10_LMS_COUNTER(int64_t, reclaim_alloc_failure) // the device allocation failed
C10_LMS_COUNTER(int64_t, reclaim_explicit) // reclaimInactive()
// Operators packed before they pinned their inputs (beginWorkingSet), and
// the bytes paged out for them.
C10_LMS_COUNTER(int64_t, pack_count)
C10_LMS_COUNTER(int64_t, pack_bytes)
// Tight operators (packed or not) for which libraries' cached workspaces
// were freed (setWorkspaceReleaser).
C10_LMS_COUNTER(int64_t, workspace_releases)
// Failed allocations placed by paging out the storages that held a range
// the request fits in (reclaimFragments).
C10_LMS_COUNTER(int64_t, fragment_reclaims)
// Allocations on a full device placed before the allocator failed them, by
// paging out (or dropping) the storages of a range they fit in: large ones
// before the allocator tried them (placeAhead), any whose search of the
// allocator's free list found nothing (reclaimBeforeMapping, the drop-in's
// free-memory callback). The allocator would have returned its whole cache to
// the device, synchronizing it, and mapped the request anew.
C10_LMS_COUNTER(int64_t, fragment_placements)
// Allocations inside operators placed in pinned host memory because the
// device could not hold them (setHostPlacementEnabled), and their bytes.
C10_LMS_COUNTER(int64_t, host_placement_count)
C10_LMS_COUNTER(int64_t, host_placement_bytes)
// Operators' inputs the device could not hold beside their other inputs,
// left in their host copies while the operator ran (host placement), and
// their bytes.
C10_LMS_COUNTER(int64_t, input_host_placement_count)
C10_LMS_COUNTER(int64_t, input_host_placement_bytes)
// Where allocations of the LMS path were satisfied from.
C10_LMS_COUNTER(int64_t, alloc_from_cache) // the caching allocator's free list
C10_LMS_COUNTER(int64_t, alloc_from_device) // a new device allocation
C10_LMS_COUNTER(int64_t, alloc_after_reclaim) // only after LMS reclaimed storages
// Prefetch.
C10_LMS_COUNTER(int64_t, prefetch_count)
C10_LMS_COUNTER(int64_t, prefetch_hits) // prefetched storages pinned while resident
// Prefetched storages an operator pinned while their copy was still
// running (the operator's stream waited for the rest of it).
C10_LMS_COUNTER(int64_t, prefetch_late)
// Page-ins made on the consumer's stream when an operator needed them.
C10_LMS_COUNTER(int64_t, pagein_demand_count)
// Learned swap schedule (process-wide, except where noted per device):
C10_LMS_COUNTER(int64_t, schedule_active) // 1 while a learned schedule is in use
C10_LMS_COUNTER(int64_t, schedule_period) // operators per iteration, 0 when inactive
C10_LMS_COUNTER(int64_t, schedule_detections) // schedules adopted
C10_LMS_COUNTER(int64_t, schedule_fallbacks) // schedules dropped: the pattern broke
// Per device: victims chosen by next use, page-ins issued ahead of use on
// the H2D stream, storages used again before their early page-out released
// the memory (no copy back), and the prefetch budget in force (set or
// derived; 0 while no schedule is active).
C10_LMS_COUNTER(int64_t, schedule_victims)
C10_LMS_COUNTER(int64_t, schedule_prefetch_count)
C10_LMS_COUNTER(int64_t, schedule_rescues)
C10_LMS_COUNTER(int64_t, schedule_prefetch_budget_bytes)
// Per device: page-outs made early (right after a last use before a long
// gap, without a hand-back), and of them those made ahead of the
// iteration's peak of demand, from the start of the iteration.
C10_LMS_COUNTER(int64_t, early_pageout_count)
C10_LMS_COUNTER(int64_t, early_pageout_bytes)
C10_LMS_COUNTER(int64_t, peak_pageout_count)
C10_LMS_COUNTER(int64_t, peak_pageout_bytes)
// Per device: page-ins ahead of use started by pageInAhead (a compiled
// graph's plan), and the early page-outs it made to find room for them.
C10_LMS_COUNTER(int64_t, graph_prefetch_count)
C10_LMS_COUNTER(int64_t, graph_prefetch_bytes)
C10_LMS_COUNTER(int64_t, graph_pageout_count)
// Time the compute streams waited on LMS copies (page-in copies on the
// consumer stream, and waits for page-outs whose memory they reuse).
C10_LMS_COUNTER(double, stall_ms)
// The copies LMS made, timed on their streams, each way: their bytes and
// the milliseconds they took (bytes / ms: the bandwidth that paging a
// storage out and back gets; timed copies only, so the bytes can trail
// pageout_bytes and pagein_bytes until the copies are done).
C10_LMS_COUNTER(int64_t, copy_out_bytes)
C10_LMS_COUNTER(double, copy_out_ms)
C10_LMS_COUNTER(int64_t, copy_in_bytes)
C10_LMS_COUNTER(double, copy_in_ms)
// Recompute (setRecomputeEnabled): victims dropped instead of paged out,
// and dropped storages recomputed (one operator replayed each), with the
// device time the replays took on their streams.
C10_LMS_COUNTER(int64_t, drop_count)
C10_LMS_COUNTER(int64_t, drop_bytes)
C10_LMS_COUNTER(int64_t, recompute_count)
C10_LMS_COUNTER(int64_t, recompute_bytes)
C10_LMS_COUNTER(double, recompute_ms)
// Inputs of dropped storages' recipes that the learned schedule paged in
// ahead of the recompute.
C10_LMS_COUNTER(int64_t, recompute_input_prefetch_count)
C10_LMS_COUNTER(int64_t, recompute_input_prefetch_bytes)
// Dropped storages the learned schedule recomputed ahead of their use, at
// an earlier operator boundary once their recipes' inputs were resident
// (also counted in recompute_count and recompute_bytes).
C10_LMS_COUNTER(int64_t, recompute_ahead_count)
C10_LMS_COUNTER(int64_t, recompute_ahead_bytes)
C10_LMS_COUNTER(int64_t, oom_count) // LMS out-of-memory errors raised
// Operators whose inputs could not all be made resident.
C10_LMS_COUNTER(int64_t, pin_failures)
// Times cached free blocks were returned to the device because this
// process held more than its share of it (see setLimit).
C10_LMS_COUNTER(int64_t, cache_releases)
// Host memory (process-wide): the host budget in force (setHostLimit; 0
// when none could be derived), the pinned bytes all LMS processes of the
// host hold as the ledger says, and pinned allocations the budget refused.
C10_LMS_COUNTER(int64_t, host_budget_bytes)
C10_LMS_COUNTER(int64_t, host_ledger_bytes)
C10_LMS_COUNTER(int64_t, host_refusals)
// New pinned buffers and the milliseconds pinning them took (mapping, faulting
// in and registering, or cudaHostAlloc): what a page-out waits for the first
// time the pool grows to a size, before any copy starts.
C10_LMS_COUNTER(int64_t, host_pin_count)
C10_LMS_COUNTER(double, host_pin_ms)
// Waits of refused allocations for other LMS processes of the host to
// release pinned memory (setHostWait), and the milliseconds they took.
C10_LMS_COUNTER(int64_t, host_wait_count)
C10_LMS_COUNTER(double, host_wait_ms)
// Waits of refused allocations for this process's own pinned buffers whose
// copies were still running (a host ahead of its copies), and their
// milliseconds: each ends within a copy's time.
C10_LMS_COUNTER(int64_t, host_copy_wait_count)
C10_LMS_COUNTER(double, host_copy_wait_ms)
// Waits of failed device allocations for other LMS processes of the GPU to
// release device memory (the same setting, setHostWait), and their
// milliseconds.
C10_LMS_COUNTER(int64_t, device_wait_count)
C10_LMS_COUNTER(double, device_wait_ms)
// The disk tier (setSpillDir): page-outs written to the spill directory
// (host copies moved there, and victims paged out straight to it), and the
// bytes and milliseconds of the writes and of the reads back (bytes / ms:
// the bandwidth of the disk tier, copies to and from the device included).
C10_LMS_COUNTER(int64_t, spill_count)
C10_LMS_COUNTER(int64_t, spill_out_bytes)
C10_LMS_COUNTER(double, spill_out_ms)
C10_LMS_COUNTER(int64_t, spill_in_bytes)
C10_LMS_COUNTER(double, spill_in_ms)
// The limit in force (getLimit; 0 before the allocator installed its
// backend).
C10_LMS_COUNTER(size_t, limit_bytes)
// Gauges, in bytes.
C10_LMS_GAUGE(managed_bytes) // every LMS storage, resident or not
C10_LMS_GAUGE(active_bytes) // pinned by running operators
C10_LMS_GAUGE(inactive_bytes) // resident and reclaimable
C10_LMS_GAUGE(pagedout_bytes) // contents held in host memory or on disk
C10_LMS_GAUGE(spilled_bytes) // of them, in the spill directory
C10_LMS_GAUGE(dropped_bytes) // contents to be recomputed
C10_LMS_GAUGE(host_bytes) // pinned host memory held by LMS (process-wide)
// Bytes allocated on the device beyond the limit after an allocation's
// reclaim: what running operators pin, and storages LMS cannot page out.
C10_LMS_GAUGE(over_limit_bytes)
// Allocated by running operators and not released yet: their outputs and
// temporaries so far, part of their working set like what they pin.
C10_LMS_GAUGE(operator_output_bytes)
// Device memory reserved by private pools (CUDA graphs, MemPool), which
// LMS never pages out: a captured graph bakes in its addresses.
C10_LMS_GAUGE(private_pool_bytes)

// clang-format on

#undef C10_LMS_COUNTER
#undef C10_LMS_GAUGE
