// The table of Large Model Support settings: one row per setting, with what
// it does. A row is
//   C10_LMS_SETTING(stem, Camel, key, Kind, type, setter, getter, what)
//   C10_LMS_DEVICE_SETTING(stem, Camel, key, Kind, type, setter, getter, what,
//                          conf_setter)
//     stem    the Python API: torch.cuda.set_<stem>_lms(), get_<stem>_lms()
//     Camel   the bindings: _cuda_lms_set<Camel>(), _cuda_lms_get<Camel>()
//     key     its PYTORCH_CUDA_ALLOC_CONF key
//     Kind    how the key's value is written: Bool (True or False), Mebibytes
//             (a non-negative number of MiB, fractions allowed; bytes in the
//             API), Count (a whole number), Seconds (a non-negative number
//             of seconds, fractions allowed), Path (a directory; a
//             PYTORCH_CUDA_ALLOC_CONF value cannot hold a comma)
//     type    the value in the engine's API
//     setter, getter  the engine's functions (c10::cuda::lms), declared from
//             this table in LargeModelSupport.h
//     what    the value as error messages name it
// A device setting is set per device (setter(device, value)); its key sets
// the value of every device through the engine's conf_setter.
//
// Whoever includes this file defines both macros to make what it needs of
// every row (the engine's declarations and its PYTORCH_CUDA_ALLOC_CONF
// parser, the bindings); the file undefines them at its end, so it is
// included once per use and has no include guard. A new setting is a row
// here, its value and behaviour in the engine, and its Python functions in
// torch/cuda/lms.py; the Python lists of the settings (lms.py's __all__ and
// docstring, the drop-in extension's API_NAMES) are generated from this file:
// `python -m lmstool tables`.

// clang-format off

// Turns LMS on or off for allocations made from now on. Storages allocated
// while LMS was off are never paged out.
C10_LMS_SETTING(enabled, Enabled, lms, Bool, bool, setEnabled, isEnabled, "LMS")

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
// the rest is room for the allocator's fragmentation. Its key sets the limit
// of every device.
C10_LMS_DEVICE_SETTING(limit, Limit, lms_limit_mb, Mebibytes, size_t, setLimit, getLimit, "the limit", setLimitOfEveryDevice)

// Smallest storage, in bytes, that LMS may page out (default 1 MiB).
C10_LMS_SETTING(size, Size, lms_size_mb, Mebibytes, size_t, setSizeThreshold, getSizeThreshold, "the size threshold")

// Prefetch: when an operator pins a paged-out storage, also start paging in
// up to this many storages that were paged out just before it (a backward
// pass needs activations in the reverse of the order they were paged out),
// on the copy stream, within the limit's headroom.
// 0 (the default) turns prefetch off.
C10_LMS_SETTING(prefetch, Prefetch, lms_prefetch, Count, int, setPrefetchDepth, getPrefetchDepth, "the prefetch depth")

// Speculative page-out: once allocated bytes exceed (limit - margin), an
// allocation also pages out inactive storages down to that mark, so that
// copies overlap with compute before the limit is reached. 0 (the default)
// turns it off.
C10_LMS_SETTING(speculative, Speculative, lms_speculative_mb, Mebibytes, size_t, setSpeculativeMargin, getSpeculativeMargin, "the speculative page-out margin")

// Learned swap schedule (LargeModelSupportSchedule.h): LMS learns the
// repeating order in which operators use storages (a training iteration) and,
// once it has seen it twice, pages out the storages used furthest in the
// future, early and on a device-to-host stream, and pages them back in ahead
// of use on a host-to-device stream. When the order changes it falls back to
// least-recently-used reclaim and demand page-in until it has learned the new
// one. On by default.
C10_LMS_SETTING(schedule, Schedule, lms_schedule, Bool, bool, setScheduleEnabled, isScheduleEnabled, "the learned swap schedule")

// How many operators ahead the schedule pages storages in (and within which
// it never picks a victim while another will do). 0 (the default) derives it
// from the iteration: an eighth of its operators, between 4 and 512.
C10_LMS_SETTING(lookahead, Lookahead, lms_lookahead, Count, int, setLookahead, getLookahead, "the lookahead in operators")

// Bytes the schedule may have paged in ahead and not yet used, and the room
// it keeps free under the limit by paging out early. 0 (the default) derives
// it from the limit and the page-in traffic: an eighth of the limit, scaled
// up to a quarter as an iteration pages in one to two times the limit.
C10_LMS_SETTING(prefetch_budget, PrefetchBudget, lms_prefetch_budget_mb, Mebibytes, size_t, setPrefetchBudget, getPrefetchBudget, "the prefetch budget")

// Page-ins ahead of use planned by compiled code (pageInAhead): a compiled
// graph knows the order in which it uses its inputs from the first iteration
// on, also where the learned schedule never settles (shapes that change every
// iteration); it steps aside while a learned schedule is active. On by
// default; off, pageInAhead does nothing.
C10_LMS_SETTING(graph_prefetch, GraphPrefetch, lms_graph_prefetch, Bool, bool, setGraphPrefetchEnabled, isGraphPrefetchEnabled, "graph prefetch")

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
C10_LMS_SETTING(host_limit, HostLimit, lms_host_limit_mb, Mebibytes, size_t, setHostLimit, getHostLimit, "the host limit")

// Host wait, in seconds (default 60): how long an allocation that the host
// budget refuses waits for other LMS processes of the host to release pinned
// memory before it raises the host-memory error, when what they hold would
// make room. While one waits, the others free their idle cached pinned
// buffers at their next page-out or page-in; when every process that holds
// pinned memory waits, the one that joined last stops waiting and raises at
// once, so the others go on (LargeModelSupportHostPool.h). 0 raises at once,
// as before the wait.
C10_LMS_SETTING(host_wait, HostWait, lms_host_wait_s, Seconds, double, setHostWait, getHostWait, "the host wait")

// The disk tier (off by default): a directory on a local disk below the
// pinned host memory (LargeModelSupportSpill.cpp). When the host budget (or
// pinning) has no room for a page-out, the coldest paged-out host copies are
// written to files there, giving their pinned memory back, and when none is
// left the page-out itself goes there instead of waiting or failing; a
// page-in reads the file back through a small staging buffer. Files are
// private (a subdirectory per process, mode 0700, files 0600), removed at
// exit, and removed by the next process that sets the directory when their
// owner crashed. Setting it checks that the directory exists and is
// writable; '' (the default) turns the tier off.
C10_LMS_SETTING(spill_dir, SpillDir, lms_spill_dir, Path, std::string, setSpillDir, getSpillDir, "the spill directory")

// Bound, in bytes, of what this process writes to the spill directory; a
// page-out past it stays in host memory (the host tier's wait and error). 0
// (the default) sets no bound of its own; a reserve of the file system's free
// space (5% of it, at most 1 GiB) is always left.
C10_LMS_SETTING(spill_limit, SpillLimit, lms_spill_limit_mb, Mebibytes, size_t, setSpillLimit, getSpillLimit, "the spill limit")

// Recompute instead of paging (the hybrid): a victim whose contents an
// operator can reproduce (a recipe: operator-boundary pinning records, for
// the outputs of pure operators, the operator and its inputs) is dropped
// instead of paged out when recomputing it costs less than moving it over the
// bus both ways at the measured copy bandwidth, and is recomputed when an
// operator needs it (see RecomputeHooks in LargeModelSupport.h). On by
// default; operators record recipes only once an allocation nears the limit
// (isRecordingRecipes).
C10_LMS_SETTING(recompute, Recompute, lms_recompute, Bool, bool, setRecomputeEnabled, isRecomputeEnabled, "recompute")

// Recipes for residual sums, with recompute on: a sum of two tensors of which
// one is the output of an operator with a recipe, as that operator made it
// (a transformer's residual stream, `x + proj(a)`), gets a recipe of its own:
// that operator followed by the sum. The sum's output can then be dropped and
// recomputed instead of paged out. Off by default: the regression suites
// check its replays bit for bit with it on before it becomes the default.
C10_LMS_SETTING(residual_recipes, ResidualRecipes, lms_residual_recipes, Bool, bool, setResidualRecipesEnabled, isResidualRecipesEnabled, "residual recipes")

// Packing (beginWorkingSet) is on by default; off, working sets are still
// counted and learned.
C10_LMS_SETTING(packing, Packing, lms_pack, Bool, bool, setPackingEnabled, isPackingEnabled, "packing")

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
// error.
//
// The same holds for the operator's inputs: when pin() of a paged-out input
// of the running operator (between beginWorkingSet and endWorkingSet, on the
// operator's device) cannot page it in even after every reclaimable storage
// is paged out, the input stays in its host copy, pinned there: its DataPtr
// holds the host address, the operator's kernels read and write it over the
// bus, and when its last pin ends it is paged out with what they wrote (no
// copy either way), and paged in when next used. Nothing is asked of the host
// budget: the host copy exists already. Operator-boundary pinning pins the
// inputs that are paged out smallest first, so that the ones left on the
// host are the largest, and only those the device cannot hold. Counted in
// input_host_placement_count and input_host_placement_bytes, and named once
// per operator in a warning. Never during CUDA graph capture (the page-in
// raises, as without host placement). Off, the pin raises the out-of-memory
// error.
C10_LMS_SETTING(host_placement, HostPlacement, lms_host_placement, Bool, bool, setHostPlacementEnabled, isHostPlacementEnabled, "host placement")

// clang-format on

#undef C10_LMS_SETTING
#undef C10_LMS_DEVICE_SETTING
