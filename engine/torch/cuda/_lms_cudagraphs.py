r"""CUDA graph pools of compiled code under Large Model Support (LMS): pools of idle compiled
functions go back to the device when nothing else makes room, and compiled code runs without
CUDA graphs when its pool does not fit.

``torch.compile(mode="reduce-overhead")`` records compiled regions into CUDA graphs. Their
memory lives in a private pool that Large Model Support never pages out: a graph bakes in its
addresses. Inductor's CUDA graph trees warm each region up in that pool (its first call runs
the compiled code with its allocations routed to the pool), then capture it (the second call).
Under a memory cap the pool may not fit even after LMS paged out everything else, and the
warm-up or the capture raises :class:`torch.OutOfMemoryError`.

With LMS enabled, such a failure no longer ends training where nothing else lives in the
pool (the first region of a step: a forward, whose warm-up keeps its activations in the
pool). The tree of the failing region's device then stops using CUDA graphs: the region, and
every other region of the tree, runs from then on as the plain compiled function, whose
tensors LMS pages like those of eager code, until ``torch._dynamo.reset()``. The whole tree,
because its regions share one pool: the pool goes back to the device only once every graph
recorded in it is gone, and a region left recording into it would keep the memory the plain
code needs. One warning names the region,
the bytes its pool held and the limits it did not fit under, and Inductor's skip counter
counts it (``counters["inductor"]["cudagraph_skips"]``). Under Inductor's
``triton.cudagraph_or_error`` setting the error is raised instead.

Where tensors of the pool still live (a backward that reads what its forward left in the
pool), the pool cannot be released under them, and such a region is not kept from freeing
them as it runs: the error stands, as without LMS, saying so. The tree's own references to the
outputs of its graphs (Inductor's cached tensors, which no program holds) do not count.

The pool of a tree that is idle also goes back to the device when something else needs the
room (:func:`release_idle_graph_pools`). A tree keeps its graphs and their pool between calls,
for the life of its compiled functions: a process that compiled and ran other functions
before (or the same model uncapped) holds their pool, which LMS never pages, and under a cap
nothing is left for the rest. The LMS engine asks this module, as its last resort, when an
allocation fails with every reclaimable storage paged out, before it places the allocation in
host memory or raises the out-of-memory error. The pool of every tree of that device that is
idle is then released: no function of the tree is running (warming up, being captured,
replaying) and no tensor lives in its pool but the outputs of its current graphs. Those
outputs that the program still holds (the last loss, logits kept for a metric) are first
copied to memory of their own, with their data, and stay valid. Its graphs are dropped (so
is the pool with them, which the allocator returns to the device when it retries the
allocation), and the tree is made new at its next call: its
functions are warmed up and captured again, into a new pool, with the same compiled code and
the same results. A tree released once and again short of room later runs without CUDA graphs
from then on, rather than being captured again at every step. The warnings (a
:class:`GraphPoolYieldWarning`, or a :class:`GraphPoolFallbackWarning` for a tree that goes on
without graphs) come at the tree's next call, outside the allocation that needed the room. A
pool that is kept is named in the out-of-memory error, with what holds it; so are the other
private pools of the device (``torch.cuda.graph``, ``torch.cuda.MemPool``, regions with a
CUDA graph of their own), which LMS never releases.

Results stay those of CUDA graphs, which run the same compiled code: a warm-up or capture
ends at its first allocation that does not fit, with an error that no library catches as out
of memory (the engine raises it while the step is under way; cuDNN would otherwise go on with
a smaller workspace and keep that plan, with other numbers, for the plain code too); the
failed call runs again on its own inputs, kept for this (Inductor's compiled functions clear
the list they are given); a failed warm-up, which ran part of the region, first gets back the
inputs the region mutates (copied before it) and the states of the random number generators
it uses. A failed capture ran nothing: a capture only records.

Inductor's tree manager (``CUDAGraphTreeManager``) is wrapped where it warms a region up
(``run_eager``), captures one (``record_function``) and runs one (``run``), when
``torch._inductor.cudagraph_trees`` is imported (``torch/cuda/lms.py``). Regions compiled
with ``torch._inductor.config.triton.cudagraph_trees = False`` get one CUDA graph each from
``torch._inductor.compile_fx.cudagraphify``; its wrapper does the same for the one region.

The module imports nothing of Inductor when it is imported itself.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Callable

import torch

__all__ = [
    "GraphPoolFallbackWarning",
    "GraphPoolYieldWarning",
    "graph_pool_releases",
    "install_cudagraphify_fallback",
    "install_tree_fallback",
    "release_idle_graph_pools",
]

_MiB = 1024 * 1024

# Set on what this module wrapped, so that wrapping again changes nothing.
_MARK = "_lms_graph_pool_fallback"
# Set on a tree manager that runs without CUDA graphs: the warning it gave.
_WITHOUT_GRAPHS = "_lms_without_graphs"
# Set on a tree manager whose pool went back to the device while it was idle, until its next
# call makes it new: the warning that call gives.
_RELEASED = "_lms_pool_released"
# On a tree manager: how many of its calls are under way (on any thread), and how many times
# its pool went back to the device while it was idle.
_RUNNING = "_lms_running"
_YIELDS = "_lms_pool_yields"
# Set on a tree manager once it is among the trees whose pools may be released (_TREES).
_KNOWN = "_lms_known"

# The state of a tree manager that a new one starts with, except what identifies the
# functions it serves (their partials hold the manager and their ids) and what it warned
# about already.
_KEPT_ON_RENEWAL = frozenset(
    {
        "ids_to_funcs",
        "ids_to_stack_traces",
        "id_to_mode",
        "id_to_compile_id",
        "func_counter",
        "graph_counter",
        "warmup_node_counter",
        "warned_functions",
        "warned_mutation",
    }
)

# What a storage reads as once its CUDA graph pool went back to the device.
_STALE_OUTPUT = (
    "Error: accessing a tensor output of CUDA graphs whose memory pool was released: "
    "Large Model Support ran the compiled code without CUDA graphs from the next call on, "
    "since the pool did not fit on the device. Clone outputs that must outlive the next "
    "call of the compiled code, or call torch.compiler.cudagraph_mark_step_begin() before "
    "each step."
)

_OutOfMemoryError: type[Exception] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# Per device: the tree manager that runs without CUDA graphs, if any. Looked up by every call
# of a compiled region of a tree (an empty dict on the hot path); only where it names a
# manager is the current one of the device (per thread) asked for.
_TREES_WITHOUT_GRAPHS: dict[int, weakref.ReferenceType[Any]] = {}


class GraphPoolFallbackWarning(UserWarning):
    """Compiled code runs without CUDA graphs: their memory pool did not fit on the device."""


class GraphPoolYieldWarning(UserWarning):
    """The CUDA graph pool of idle compiled functions went back to the device to make room;
    their CUDA graphs are captured again when they are next called."""


# Every tree manager that ran a function while this module's wrapper was installed.
_TREES: weakref.WeakSet[Any] = weakref.WeakSet()

# Warnings about trees whose pool went back to the device, given at the next call of a tree
# (not inside the allocation that needed the room, where a warning filter that raises would
# turn the release into an error).
_PENDING_WARNINGS: list[tuple[str, type[Warning]]] = []

# Pools released so far in this process, their bytes, and the held outputs copied out of
# them first (graph_pool_releases()).
_RELEASES = {"count": 0, "bytes": 0, "outputs_moved": 0}

# Per thread: set while idle pools are being released (an allocation made meanwhile that
# fails does not release again).
_releasing = threading.local()


class _PoolStep:
    """A warm-up or capture of compiled code in a CUDA graph pool that LMS falls back from:
    while it runs on this thread, the engine raises its first allocation that does not fit
    (LMS's own, an operator's pending one, the caching allocator's) as a ``RuntimeError``
    that no library catches as :class:`torch.OutOfMemoryError`. ``ran_out`` says, once it
    ended, whether that happened."""

    def __init__(self) -> None:
        self.ran_out = False

    def __enter__(self) -> _PoolStep:
        _lms_api()._lms_bindings()._cuda_lms_beginGraphPoolStep()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ran_out = bool(_lms_api()._lms_bindings()._cuda_lms_endGraphPoolStep())


def _run_pool_step(step: Callable[[], Any]) -> tuple[Any, str | None]:
    """Runs ``step`` as a :class:`_PoolStep`: its result and ``None``, or, where it ran out of
    memory, ``None`` and the error's message. Other errors propagate."""
    pool_step = _PoolStep()
    try:
        with pool_step:
            return step(), None
    except _PoolDidNotFit:
        raise
    except _OutOfMemoryError as error:
        return None, str(error)
    except RuntimeError as error:
        if not pool_step.ran_out:
            raise
        return None, str(error)


class _PoolDidNotFit(_OutOfMemoryError):  # type: ignore[misc,valid-type]
    """Carries a failed warm-up or capture, and what is needed to run the call again, from the
    tree manager's step up to its ``run``. Raised outside the handler of the original error,
    so that the frames of the failed call (and the pool memory they hold) are freed."""

    def __init__(self, message: str, attempt: _Attempt, step: str) -> None:
        super().__init__(message)
        self.attempt = attempt
        self.step = step


def _lms_api() -> ModuleType:
    """The LMS API module beside this one (``torch.cuda.lms``, or ``torch_lms.lms`` in the
    drop-in extension)."""
    package = __name__.rpartition(".")[0] or "torch.cuda"
    return importlib.import_module(f"{package}.lms")


def _wrap_imported_inductor() -> None:
    """Wraps the Inductor modules that LMS wraps (``torch/cuda/lms.py``) and that are imported
    already; each is wrapped once, so this is cheap once they are."""
    try:
        install = _lms_api()._install_compiled_code_hooks
    except (ImportError, AttributeError):  # an API module without it
        return
    install()


def _lms_enabled() -> bool:
    try:
        return bool(_lms_api()._lms_bindings()._cuda_lms_getEnabled())
    except (ImportError, RuntimeError, AttributeError):
        return False


def _errors_wanted() -> bool:
    """Whether the user asked Inductor to raise rather than skip CUDA graphs."""
    config = sys.modules.get("torch._inductor.config")
    triton = getattr(config, "triton", None)
    return bool(getattr(triton, "cudagraph_or_error", False))


def _trees_in_use() -> bool:
    config = sys.modules.get("torch._inductor.config")
    triton = getattr(config, "triton", None)
    return bool(getattr(triton, "cudagraph_trees", False))


def _storage_state() -> Callable[[torch.Tensor], str] | None:
    """LMS's state of a tensor's storage ("unmanaged", "paged out", ...), where it can tell."""
    try:
        state = _lms_api()._lms_bindings()._cuda_lms_storageState
    except (ImportError, RuntimeError, AttributeError):
        return None
    return lambda tensor: str(state(tensor))


def _aligned(
    namespace: ModuleType,
    model: Callable[..., Any],
    inputs: Sequence[Any],
    static_input_idxs: Sequence[int],
    mutated_input_idxs: Sequence[int],
) -> Callable[..., Any]:
    """``model`` with the input alignment that Inductor gives a compiled function that runs
    without CUDA graphs: an input whose alignment the compiled code assumed but cannot be sure
    of (Inductor's ``get_input_idxs_to_check`` in ``namespace``, the module of the CUDA graph
    path) is copied at each call when it is misaligned, and a mutated one written back.

    Inductor tells by the input's address; asked of a paged-out storage, the address pages it
    in, and at a call's start that would page in every such input at once (all the
    activations a backward reads). The storages LMS manages are blocks of the caching
    allocator, aligned far beyond what the compiled code needs: their tensors are aligned
    exactly when their storage offsets are. The address decides for the others."""
    get_idxs = getattr(namespace, "get_input_idxs_to_check", None)
    check = list(get_idxs(inputs, static_input_idxs)) if get_idxs is not None else []
    if not check:
        return model
    utils = sys.modules.get("torch._inductor.utils")
    alignment = int(getattr(utils, "ALIGNMENT", 16))
    clone: Callable[[torch.Tensor], torch.Tensor] = getattr(
        utils, "clone_preserve_strides", torch.clone
    )
    mutated = set(mutated_input_idxs)
    state = _storage_state()

    def misaligned(tensor: torch.Tensor) -> bool:
        if state is None or state(tensor) == "unmanaged":
            return tensor.data_ptr() % alignment != 0
        return (tensor.storage_offset() * tensor.element_size()) % alignment != 0

    @functools.wraps(model)
    def run(new_inputs: list[Any]) -> Any:
        originals: list[torch.Tensor] = []
        copies: list[torch.Tensor] = []
        for index in check:
            tensor = new_inputs[index]
            if isinstance(tensor, torch.Tensor) and misaligned(tensor):
                new_inputs[index] = clone(tensor)
                if index in mutated:
                    originals.append(tensor)
                    copies.append(new_inputs[index])
        outputs = model(new_inputs)
        if originals:
            torch._foreach_copy_(originals, copies)
        return outputs

    return run


def _default_generators(device: int | None) -> list[torch.Generator]:
    """The default CUDA generator of ``device``, where CUDA is initialized."""
    if device is None or not torch.cuda.is_initialized():
        return []
    return [torch.cuda.default_generators[device]]


class _Attempt:
    """What a call into a CUDA graph pool may change before it fails, kept to undo it.

    The call's inputs (Inductor's compiled functions clear the list they are given, and drop
    each input after its last use), copies of the inputs that it mutates, made before it runs,
    and the states of the random number generators it may draw from (those among its inputs
    and the device's default one).

    A call that reads tensors of the graph pool (a backward reading what its forward's
    warm-up or graph left there) is not retried: kept alive, they would hold pool memory that
    the call frees as it goes, and the pool can only be released once nothing in it lives.
    ``in_pool`` tells such tensors; ``retry`` is then false and nothing is kept.
    """

    def __init__(
        self,
        inputs: list[Any],
        mutated: Sequence[int],
        device: int | None,
        in_pool: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        self.retry = in_pool is None or not any(
            isinstance(value, torch.Tensor) and in_pool(value) for value in inputs
        )
        self.inputs = list(inputs) if self.retry else []
        self.backups: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []
        if not self.retry:
            return
        with torch.no_grad():
            for index in mutated:
                if 0 <= index < len(inputs) and isinstance(inputs[index], torch.Tensor):
                    tensor = inputs[index].detach()
                    self.backups.append((tensor, tensor.clone()))
        generators = [g for g in inputs if isinstance(g, torch.Generator)]
        generators += _default_generators(device)
        seen: set[int] = set()
        for generator in generators:
            if id(generator) not in seen:
                seen.add(id(generator))
                self.generators.append((generator, generator.get_state()))

    def undo(self) -> list[Any]:
        """Puts the mutated inputs and the generators back; returns the call's inputs."""
        with torch.no_grad():
            for tensor, backup in self.backups:
                tensor.copy_(backup)
        for generator, state in self.generators:
            generator.set_state(state)
        self.backups.clear()
        self.generators.clear()
        inputs, self.inputs = self.inputs, []
        return inputs


def _mib(size: int) -> str:
    return f"{size / _MiB:.2f} MiB"


def _pool_segments(device: int, pool: Any) -> list[dict[str, Any]] | None:
    """The segments of the private pool ``pool`` on ``device`` in the allocator's snapshot, or
    ``None`` where the snapshot cannot tell."""
    if pool is None:
        return None
    snapshot: Callable[..., Any] = torch.cuda.memory_snapshot
    pool = tuple(pool)
    for call in (
        lambda: snapshot(pool, include_traces=False),
        lambda: snapshot(pool),
        lambda: [s for s in snapshot() if tuple(s.get("segment_pool_id", ())) == pool],
    ):
        try:
            segments = call()
        except (TypeError, RuntimeError, AttributeError):  # older signature; no CUDA
            continue
        return [s for s in segments if s.get("device", device) == device]
    return None


def _pool_bytes(device: int, pool: Any) -> int | None:
    """Device memory that the private pool ``pool`` reserves on ``device``, else what LMS
    reports for all private pools of the device."""
    segments = _pool_segments(device, pool)
    if segments is not None:
        return sum(int(segment.get("total_size", 0)) for segment in segments)
    try:
        stats = _lms_api().lms_stats(device)
        return int(stats["private_pool_bytes"]["current"])
    except (ImportError, RuntimeError, AttributeError, KeyError, TypeError):
        return None


def _alive(ref: Any) -> bool:
    """Whether a storage reference of Inductor's (``StorageWeakRefWrapper``) names a storage
    that something beyond the tree's own cached tensor holds; where it cannot tell, yes."""
    try:
        return ref() is not None
    except Exception:  # an Inductor of other internals: assume it is in use
        return True


def _address(ref: Any) -> int:
    data_ptr = getattr(ref, "data_ptr", None)
    try:
        return int(data_ptr()) if callable(data_ptr) else -1
    except Exception:
        return -1


def _current_path(manager: Any) -> list[Any]:
    """The nodes from the tree's current node up to its root: the graphs and warm-ups of the
    step under way, whose outputs are the valid ones (Inductor takes those of earlier paths
    for overwritten)."""
    path: list[Any] = []
    node = getattr(manager, "current_node", None)
    while node is not None and len(path) < 100_000:
        path.append(node)
        node = getattr(node, "parent", None)
    return path


@dataclasses.dataclass
class _PoolUse:
    """What the pool of a tree manager holds: the bytes it reserves (``None`` where the
    allocator's snapshot cannot tell), the outputs of the current path's graphs and warm-ups
    that the program still holds (and the bytes of those found in the pool), and the bytes of
    other tensors alive in the pool (outputs of warm-ups and captures, which own their memory)
    beside the tree's cached tensors that nothing else holds."""

    reserved: int | None
    outputs: int = 0
    output_bytes: int = 0
    tensors: int = 0
    held: list[Any] = dataclasses.field(default_factory=list)
    # A forward ran whose backward has not: its outputs are the backward's saved tensors,
    # mid-step; the pool is kept rather than copied out under them.
    pending_backward: bool = False

    def in_use(self) -> bool:
        return self.reserved is None or self.outputs > 0 or self.tensors > 0

    def movable(self) -> bool:
        """Whether all that keeps the pool are outputs the program holds, which can be copied
        out of it (:func:`_move_held_outputs`)."""
        return (
            self.reserved is not None
            and self.outputs > 0
            and self.tensors == 0
            and not self.pending_backward
        )

    def holders(self) -> str:
        """What keeps the pool from going back to the device, as words."""
        if self.reserved is None:
            return "the allocator's snapshot does not show it"
        parts: list[str] = []
        if self.outputs:
            parts.append(
                f"{self.outputs} output(s) of its graphs ({_mib(self.output_bytes)}) are "
                "still held by the program"
                + (
                    " (a forward's, whose backward has not run yet)"
                    if self.pending_backward
                    else ""
                )
            )
        if self.tensors:
            parts.append(f"{_mib(self.tensors)} of tensors are alive in it")
        return " and ".join(parts)


def _pool_use(manager: Any) -> _PoolUse:
    """What the pool of ``manager`` holds (see :class:`_PoolUse`)."""
    device = int(getattr(manager, "device_index", 0))
    segments = _pool_segments(device, getattr(manager, "cuda_graphs_thread_pool", None))
    if segments is None:
        return _PoolUse(None)
    use = _PoolUse(sum(int(segment.get("total_size", 0)) for segment in segments))
    use.pending_backward = bool(getattr(manager, "running_forwards_with_pending_backwards", False))
    sizes = {
        int(block["address"]): int(block.get("size", 0))
        for segment in segments
        for block in segment.get("blocks") or ()
        if "address" in block
    }
    # The tree keeps a tensor of each output of its recorded graphs (Inductor's cached
    # tensors): memory of the pool that the tree itself holds, and drops with its graphs.
    own: set[int] = set()
    for node in _tree_nodes(manager):
        refs = getattr(node, "outputs_weakrefs", ()) or ()
        for index, cached in enumerate(getattr(node, "cached_tensor_outputs", ()) or ()):
            if cached is not None and index < len(refs) and refs[index] is not None:
                if not _alive(refs[index]):
                    own.add(_address(refs[index]))
    # Held outputs are counted as outputs, not as other tensors of the pool: they can be
    # copied out of it.
    for node in _current_path(manager):
        for ref in getattr(node, "outputs_weakrefs", ()) or ():
            if ref is not None and _alive(ref):
                use.outputs += 1
                use.output_bytes += sizes.get(_address(ref), 0)
                use.held.append(ref)
                own.add(_address(ref))
    for segment in segments:
        blocks = segment.get("blocks")
        if blocks is None:  # the segment's figure alone: its cached tensors count too
            use.tensors += int(segment.get("allocated_size", 0))
            continue
        for block in blocks:
            if (
                block.get("state") == "active_allocated"
                and int(block.get("address", -1)) not in own
            ):
                use.tensors += int(block.get("size", 0))
    return use


def _limits(device: int) -> str:
    """The LMS limit in force on ``device`` and the allocator's cap, as words."""
    parts: list[str] = []
    try:
        limit = int(_lms_api().lms_stats(device)["limit_bytes"])
    except (ImportError, RuntimeError, AttributeError, KeyError, TypeError):
        limit = 0
    if limit > 0:
        parts.append(f"the LMS limit of {_mib(limit)}")
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:
        fraction = float(get_fraction(device)) if get_fraction is not None else 1.0
        if 0.0 < fraction < 1.0:
            total = torch.cuda.get_device_properties(device).total_memory
            parts.append(f"the allocator's cap of {_mib(int(fraction * total))}")
    except (RuntimeError, AssertionError, TypeError, ValueError):
        pass
    return " and ".join(parts) if parts else "the memory of the device"


def _count_skip(message: str) -> None:
    """Inductor's record of a skipped CUDA graph: its skip counter
    (``counters["inductor"]["cudagraph_skips"]``) and its CUDA graph log, at info level.

    Inductor's ``log_cudagraph_skip_and_bump_counter`` would log at warning level, a second
    message besides the warning users get here (and raises under ``cudagraph_or_error``,
    which is honoured before any fallback)."""
    utils = sys.modules.get("torch._inductor.cudagraph_utils")
    log = getattr(utils, "cudagraphs_log", None) or getattr(utils, "perf_hint_log", None)
    if log is not None:
        log.info(message)
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    if counters is not None:
        counters["inductor"]["cudagraph_skips"] += 1


def _tree_nodes(manager: Any) -> list[Any]:
    """Every graph node recorded in a tree manager's tree."""
    roots = getattr(manager, "roots", None) or {}
    pending = [node for nodes in roots.values() for node in nodes]
    found: list[Any] = []
    while pending:
        node = pending.pop()
        found.append(node)
        for children in getattr(node, "children", {}).values():
            pending.extend(children)
    return found


def _storage_tensor(ref: Any) -> torch.Tensor | None:
    """A tensor over the whole storage that a storage reference of Inductor's names, or
    ``None`` once nothing holds it."""
    cdata = ref()
    if cdata is None:
        return None
    storage = torch.UntypedStorage._new_with_weak_ptr(cdata)
    if storage is None:
        return None
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _move_held_outputs(use: _PoolUse) -> set[int]:
    """Copies the outputs of a tree's current graphs that the program holds to memory of
    their own (``_cuda_lms_moveOutOfPool``), so that the pool can go back with their data
    kept. Returns the storages moved (as Inductor's references name them), which
    :func:`_drop_graphs` must leave valid."""
    move = _lms_api()._lms_bindings()._cuda_lms_moveOutOfPool
    moved: set[int] = set()
    for ref in use.held:
        tensor = _storage_tensor(ref)
        if tensor is None:
            continue
        move(tensor)
        moved.add(int(ref()))
        del tensor
    return moved


def _drop_graphs(manager: Any, moved: frozenset[int] | set[int] = frozenset()) -> None:
    """Drops every CUDA graph of a tree, so that its pool goes back to the device.

    What graph outputs a program still holds stay valid where they own their memory (the
    outputs of warm-ups and recordings, and those of replays that Inductor checkpointed
    before this warm-up or capture); the outputs of earlier replays do not own theirs, and
    Inductor counts them overwritten already: they are made to raise on access, as Inductor
    does, instead of reading memory that the device may have given to something else.
    """
    owning = getattr(torch._C, "_has_Standard_Deleter", None)
    invalidate = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)
    for node in _tree_nodes(manager):
        remove_cached = getattr(node, "remove_node_cached_tensors", None)
        if remove_cached is not None:
            remove_cached()
        if owning is not None and invalidate is not None:
            for ref in getattr(node, "outputs_weakrefs", ()):
                storage = ref() if ref is not None else None
                if storage is not None and storage not in moved and not owning(storage):
                    invalidate(storage, _STALE_OUTPUT)
        node.graph = None
    # Warm-up nodes hold the tree's own graph, which keeps the pool alive.
    node = getattr(manager, "current_node", None)
    while node is not None:
        if hasattr(node, "existing_cuda_graph"):
            node.existing_cuda_graph = None
        node = getattr(node, "parent", None)
    manager.graph = None


def _function_label(manager: Any, function_id: Any) -> str:
    """A compiled function of a tree as words: its name, mode and compile id."""
    try:
        name = str(manager.get_func_name(function_id))
    except (AttributeError, KeyError):
        name = "unknown"
    details: list[str] = []
    mode = getattr(getattr(manager, "id_to_mode", {}).get(function_id), "name", None)
    if mode:
        details.append(str(mode).lower())
    compile_id = getattr(manager, "id_to_compile_id", {}).get(function_id)
    if compile_id is not None:
        details.append(f"compile id {compile_id}")
    suffix = f" ({', '.join(details)})" if details else ""
    return f"{name!r}{suffix}"


def _describe_tree_function(manager: Any, function_id: Any) -> str:
    return f"the compiled function {_function_label(manager, function_id)}"


def _describe_tree(manager: Any) -> str:
    """The pool of a tree manager and the compiled functions it serves, as words."""
    ids = list(getattr(manager, "ids_to_funcs", None) or ())
    shown = ", ".join(_function_label(manager, function_id) for function_id in ids[:3])
    more = f" and {len(ids) - 3} more" if len(ids) > 3 else ""
    return f"the CUDA graph pool of {len(ids)} compiled function(s) ({shown}{more})"


def _release(device: int | None) -> None:
    """Frees what the failed call left (its frames may sit in reference cycles) and returns
    the cached memory, the released pool's with it, to the device."""
    gc.collect()
    if torch.cuda.is_initialized():
        if device is not None:
            torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _fall_back(message: str) -> None:
    _count_skip(message)
    warnings.warn(message, GraphPoolFallbackWarning, stacklevel=4)


def _without_graphs(manager: Any, function_id: Any, step: str) -> None:
    """Makes a tree manager run every function without CUDA graphs, releases its pool and
    warns once."""
    device = int(getattr(manager, "device_index", 0))
    pool = getattr(manager, "cuda_graphs_thread_pool", None)
    held = _pool_bytes(device, pool)
    what = _describe_tree_function(manager, function_id)
    released = True
    try:
        _drop_graphs(manager)
    except Exception:  # an Inductor of other internals: still never use the graphs again
        released = False
    message = (
        f"Large Model Support: the CUDA graph {step} of {what} on cuda:{device} ran out of "
        "memory in the graph pool, which LMS never pages out"
        + (f" (the pool held {_mib(held)})" if held else "")
        + f", under {_limits(device)}. It and every other function compiled with "
        f'mode="reduce-overhead" on cuda:{device} now run without CUDA graphs, until '
        "torch._dynamo.reset(): plain compiled code, whose tensors LMS pages like those of "
        "eager code, with the same results. "
        + (
            "The pool's cached memory went back to the device. "
            if released
            else "The pool could not be released. "
        )
        + "To keep CUDA graphs, leave room for the pool under the cap."
    )
    _set_without_graphs(manager, message)
    _release(device)
    _fall_back(message)


def _private_pool_bytes(device: int) -> int | None:
    """What every private pool of ``device`` reserves, as LMS reports it."""
    try:
        return int(_lms_api().lms_stats(device)["private_pool_bytes"]["current"])
    except (ImportError, RuntimeError, AttributeError, KeyError, TypeError):
        return None


def _set_without_graphs(manager: Any, message: str) -> None:
    """Marks a tree manager whose graphs are gone to run every function plainly from now on."""
    device = int(getattr(manager, "device_index", 0))
    setattr(manager, _WITHOUT_GRAPHS, message)
    _TREES_WITHOUT_GRAPHS[device] = weakref.ref(manager)


def _yield_pool(
    manager: Any, reserved: int, size: int, moved: frozenset[int] | set[int] = frozenset()
) -> bool:
    """Releases the pool of an idle tree manager (its graphs go; so does the pool, once the
    allocator frees its cache); ``moved``: the held outputs copied out of it already. A tree
    released before goes on without CUDA graphs instead of being captured again at every
    step. Returns whether the graphs went."""
    device = int(getattr(manager, "device_index", 0))
    what = _describe_tree(manager)
    try:
        _drop_graphs(manager, moved)
    except Exception:  # an Inductor of other internals: no graphs of it are used again
        _set_without_graphs(
            manager, f"Large Model Support: the graphs of {what} could not be dropped."
        )
        return False
    _RELEASES["count"] += 1
    _RELEASES["bytes"] += reserved
    yields = int(getattr(manager, _YIELDS, 0)) + 1
    setattr(manager, _YIELDS, yields)
    reason = (
        f"an allocation of {_mib(size)} on cuda:{device} found no room under "
        f"{_limits(device)} with every reclaimable storage paged out, and no tensor of the "
        "pool was in use"
    )
    if yields == 1:
        message = (
            f"Large Model Support: {what} on cuda:{device} ({_mib(reserved)}) went back to "
            f"the device: {reason}. Its CUDA graphs are captured again when the functions are "
            "next called (a warm-up, then a capture), with the same results. Should its pool "
            "have to go back again, the functions run without CUDA graphs from then on."
        )
        setattr(manager, _RELEASED, message)
        _PENDING_WARNINGS.append((message, GraphPoolYieldWarning))
        return True
    message = (
        f"Large Model Support: {what} on cuda:{device} ({_mib(reserved)}) went back to the "
        f"device a second time: {reason}. It and every other function compiled with "
        f'mode="reduce-overhead" on cuda:{device} now run without CUDA graphs, until '
        "torch._dynamo.reset(): plain compiled code, whose tensors LMS pages like those of "
        "eager code, with the same results. To keep CUDA graphs, leave room for the pool "
        "under the cap."
    )
    _set_without_graphs(manager, message)
    _count_skip(message)
    _PENDING_WARNINGS.append((message, GraphPoolFallbackWarning))
    return True


def _release_idle(device: int, size: int) -> tuple[bool, str]:
    trees = [tree for tree in list(_TREES) if int(getattr(tree, "device_index", -1)) == device]
    released = False
    notes: list[str] = []
    counted = 0
    for manager in trees:
        gone = (
            getattr(manager, _WITHOUT_GRAPHS, None) is not None
            or getattr(manager, _RELEASED, None) is not None
            or getattr(manager, "graph", None) is None
        )
        if gone:  # its pool went back already
            continue
        use = _pool_use(manager)
        what = _describe_tree(manager)
        if use.reserved is not None:
            counted += use.reserved
            if use.reserved == 0:
                continue
        held = f"{what} holds {_mib(use.reserved)}" if use.reserved is not None else what
        if int(getattr(manager, _RUNNING, 0)) > 0:
            notes.append(f"{held}, kept: one of its functions is running")
        elif use.in_use() and not use.movable():
            notes.append(f"{held}, kept: {use.holders()}")
        else:
            moved: set[int] = set()
            if use.movable():
                try:
                    moved = _move_held_outputs(use)
                except Exception as error:  # no room even for the copies: keep the pool
                    notes.append(
                        f"{held}, kept: {use.holders()}, and copying them out of it failed "
                        f"({error})"
                    )
                    continue
                _RELEASES["outputs_moved"] += len(moved)
            if _yield_pool(manager, int(use.reserved or 0), size, moved):
                released = True
                copied = (
                    f" ({len(moved)} output(s) it held, {_mib(use.output_bytes)}, copied out first)"
                    if moved
                    else ""
                )
                notes.append(f"{held}, released{copied}")
            else:
                notes.append(f"{held}, kept: its graphs could not be dropped")
    others = _private_pool_bytes(device)
    if others is not None and others > counted:
        notes.append(
            f"{_mib(others - counted)} in other private pools (torch.cuda.graph, "
            "torch.cuda.MemPool, regions compiled with a CUDA graph of their own), which LMS "
            "never releases"
        )
    note = f"CUDA graph pools on cuda:{device}: {'; '.join(notes)}." if notes else ""
    return released, note


def release_idle_graph_pools(device: int, size: int) -> tuple[bool, str]:
    r"""Releases the CUDA graph pools of the idle trees of ``device`` for an allocation of
    ``size`` bytes that found no room with every reclaimable storage paged out.

    The LMS engine calls it as its last resort (``_cuda_lms_registerOutsideReleaser``), from the
    allocating thread with the GIL taken. A tree is idle when none of its functions is
    running, the program holds no output of its current graphs and no other tensor lives in
    its pool; its graphs are dropped, and its next call makes it new (see the module's
    description). Returns whether a pool was released (the engine then tries the allocation
    again) and a sentence for the out-of-memory error: which pools of the device hold what, and
    why those kept were kept. Never raises."""
    if getattr(_releasing, "active", False):
        return False, ""
    _releasing.active = True
    try:
        return _release_idle(int(device), int(size))
    except Exception as error:  # the allocation path must not see an error of this module
        return False, f"(Releasing idle CUDA graph pools failed: {error!r}.)"
    finally:
        _releasing.active = False


def graph_pool_releases() -> dict[str, int]:
    """How many CUDA graph pools of idle trees went back to the device in this process, their
    bytes, and how many outputs of their graphs that the program held were copied out of them
    first: ``{"count": ..., "bytes": ..., "outputs_moved": ...}``."""
    return dict(_RELEASES)


def _register_release() -> None:
    """Hands :func:`release_idle_graph_pools` to the LMS engine, where its bindings have the
    hook (once per process: registering again replaces it with itself)."""
    try:
        bindings = _lms_api()._lms_bindings()
    except (ImportError, RuntimeError, AttributeError):
        return
    register = getattr(bindings, "_cuda_lms_registerOutsideReleaser", None)
    if callable(register):
        register(release_idle_graph_pools)


def _renew(manager: Any) -> None:
    """Makes a tree manager whose pool went back to the device new: a new pool and stream,
    no graphs and no function warmed up, as Inductor makes one; the functions it serves and
    what it warned about stay.

    Inductor's manager keeps its pool alive with a graph captured empty into it. That capture
    is let through the drop-in's capture guard (which refuses a capture while storages are
    paged out) as those of compiled regions are: it captures no operator, so no page-in."""
    try:
        capture_state = _lms_api()._capture_state
    except (ImportError, AttributeError):  # an API module without the guard's state
        capture_state = None
    previous = getattr(capture_state, "resident_inputs", False)
    if capture_state is not None:
        capture_state.resident_inputs = True
    try:
        fresh = type(manager)(int(getattr(manager, "device_index", 0)))
    finally:
        if capture_state is not None:
            capture_state.resident_inputs = previous
    vars(manager).update(
        {key: value for key, value in vars(fresh).items() if key not in _KEPT_ON_RENEWAL}
    )
    setattr(manager, _RELEASED, None)


def _warn_pending() -> None:
    """Gives the warnings about pools released inside allocations (see ``_PENDING_WARNINGS``)."""
    pending = list(_PENDING_WARNINGS)
    _PENDING_WARNINGS.clear()
    for message, category in pending:
        warnings.warn(message, category, stacklevel=4)


def install_tree_fallback(module: ModuleType) -> None:
    r"""Wrap the CUDA graph tree manager of ``module`` (``torch._inductor.cudagraph_trees``)
    so that a warm-up or capture that runs out of memory while LMS is enabled makes the tree
    run without CUDA graphs (see the module's description). Wrapping again changes nothing;
    a module without the manager's methods is left alone.

    The pools of idle trees are handed to the LMS engine to release as its last resort
    (:func:`release_idle_graph_pools`)."""
    manager_class = getattr(module, "CUDAGraphTreeManager", None)
    if manager_class is None or getattr(manager_class, _MARK, False):
        return
    _register_release()
    run = getattr(manager_class, "run", None)
    run_eager = getattr(manager_class, "run_eager", None)
    record_function = getattr(manager_class, "record_function", None)
    if not (callable(run) and callable(run_eager) and callable(record_function)):
        return

    def guarded(step: Callable[..., Any], name: str, executes: bool) -> Callable[..., Any]:
        @functools.wraps(step)
        def call(self: Any, new_inputs: list[Any], function_id: Any) -> Any:
            if not _lms_enabled() or _errors_wanted():
                return step(self, new_inputs, function_id)
            wrapped = self.ids_to_funcs[function_id]
            # A capture only records, and runs nothing of the region before it succeeded.
            mutated = getattr(wrapped, "mutated_input_idxs", ()) if executes else ()
            checker = getattr(self, "_get_cuda_graph_recorded_tensor_checker", None)
            in_pool = checker() if callable(checker) else None
            attempt = _Attempt(new_inputs, mutated, getattr(self, "device_index", None), in_pool)
            if not attempt.retry:
                return step(self, new_inputs, function_id)
            result, message = _run_pool_step(lambda: step(self, new_inputs, function_id))
            if message is None:
                return result
            raise _PoolDidNotFit(message, attempt, name)

        return call

    @functools.wraps(run)
    def run_or_fall_back(self: Any, new_inputs: list[Any], function_id: Any) -> Any:
        if _PENDING_WARNINGS:
            _warn_pending()
        if getattr(self, _WITHOUT_GRAPHS, None) is not None:
            return self.ids_to_funcs[function_id].model(new_inputs)
        if not getattr(self, _KNOWN, False):
            _TREES.add(self)
            setattr(self, _KNOWN, True)
        if getattr(self, _RELEASED, None) is not None:
            _renew(self)
        # Counted on the manager, for every thread: a tree with a call under way is never
        # released (its warm-up or capture allocates in the pool, a replay writes to it).
        setattr(self, _RUNNING, getattr(self, _RUNNING, 0) + 1)
        try:
            return run(self, new_inputs, function_id)
        except _PoolDidNotFit as failure:
            attempt, step, message = failure.attempt, failure.step, str(failure)
        finally:
            setattr(self, _RUNNING, getattr(self, _RUNNING, 1) - 1)
        gc.collect()  # the failed call's memory first
        use = _pool_use(self)
        if use.in_use():
            # Tensors of the pool still live (outputs of earlier graphs or warm-ups): the pool
            # cannot go back to the device under them, nor could the plain code find room.
            attempt.undo()
            raise _OutOfMemoryError(
                f"{message} (Large Model Support did not fall back to running without CUDA "
                f"graphs: tensors still live in the CUDA graph pool; {_describe_tree(self)}"
                + (f" holds {_mib(use.reserved)}" if use.reserved is not None else "")
                + f" and {use.holders()}.)"
            )
        inputs = attempt.undo()
        _without_graphs(self, function_id, step)
        return self.ids_to_funcs[function_id].model(inputs)

    manager_class.run_eager = guarded(run_eager, "warm-up", executes=True)
    manager_class.record_function = guarded(record_function, "capture", executes=False)
    manager_class.run = run_or_fall_back
    setattr(manager_class, _MARK, True)

    impl = getattr(module, "cudagraphify_impl", None)
    get_manager = getattr(module, "get_manager", None)
    if not callable(impl) or not callable(get_manager):
        return

    def without_graphs(device: int) -> bool:
        ref = _TREES_WITHOUT_GRAPHS.get(device)
        manager = ref() if ref is not None else None
        if manager is None:  # gone with torch._dynamo.reset()
            _TREES_WITHOUT_GRAPHS.pop(device, None)
            return False
        return get_manager(device, create_if_none_exists=False) is manager

    @functools.wraps(impl)
    def cudagraphify_impl(
        model: Callable[..., Any],
        inputs: list[Any],
        static_input_idxs: Sequence[int],
        *args: Any,
        **kwargs: Any,
    ) -> Callable[..., Any]:
        deferred = impl(model, inputs, static_input_idxs, *args, **kwargs)
        device = kwargs.get("device_index")
        mutated = kwargs.get("mutated_input_idxs", ())
        plain: list[Callable[..., Any]] = []

        # Once the device's tree runs without CUDA graphs, so does a region first called
        # afterwards (the backward of a forward whose warm-up did not fit), without the tree's
        # first look at the address of every static input.
        def run(new_inputs: list[Any]) -> Any:
            if device in _TREES_WITHOUT_GRAPHS and without_graphs(device):
                if _PENDING_WARNINGS:
                    _warn_pending()
                if not plain:
                    plain.append(_aligned(module, model, new_inputs, static_input_idxs, mutated))
                return plain[0](new_inputs)
            return deferred(new_inputs)

        return run

    module.cudagraphify_impl = cudagraphify_impl


class _SingleGraph:
    """A region that ``compile_fx.cudagraphify`` gave one CUDA graph of its own (no trees):
    its first call in each thread warms it up and captures it; one that runs out of memory
    while LMS is enabled makes the region run without the graph from then on."""

    def __init__(
        self,
        namespace: ModuleType,
        model: Callable[..., Any],
        run: Callable[..., Any],
        static_input_idxs: Sequence[int],
        mutated: Sequence[int],
        device: int | None,
    ) -> None:
        self.namespace = namespace
        self.model = model
        self.run = run
        self.static_input_idxs = tuple(static_input_idxs)
        self.mutated = tuple(mutated)
        self.device = device
        self.plain: Callable[..., Any] | None = None
        self.captured = threading.local()

    def __call__(self, new_inputs: list[Any]) -> Any:
        if self.plain is not None:
            return self.plain(new_inputs)
        if getattr(self.captured, "done", False) or not _lms_enabled() or _errors_wanted():
            return self.run(new_inputs)
        attempt = _Attempt(new_inputs, self.mutated, self.device)
        outputs, message = _run_pool_step(lambda: self.run(new_inputs))
        if message is None:
            self.captured.done = True
            return outputs
        inputs = attempt.undo()
        plain = _aligned(self.namespace, self.model, inputs, self.static_input_idxs, self.mutated)
        self.plain = plain
        device = self.device if self.device is not None else 0
        message = (
            f"Large Model Support: the CUDA graph of the compiled function "
            f"{getattr(self.model, '__name__', 'unknown')!r} on cuda:{device} ran out of "
            f"memory while it was warmed up or captured, under {_limits(device)}. It now "
            "runs without a CUDA graph: plain compiled code, whose tensors LMS pages like "
            "those of eager code, with the same results. To keep CUDA graphs, leave room "
            "for them under the cap."
        )
        _release(self.device)
        _fall_back(message)
        return plain(inputs)


def install_cudagraphify_fallback(module: ModuleType) -> None:
    r"""Wrap ``cudagraphify`` of ``module`` (``torch._inductor.compile_fx``): a region it
    gives a CUDA graph of its own (``torch._inductor.config.triton.cudagraph_trees`` off) runs
    without it once its warm-up or capture ran out of memory while LMS is enabled. Regions of
    CUDA graph trees are left to :func:`install_tree_fallback`. Wrapping again changes
    nothing."""
    cudagraphify = getattr(module, "cudagraphify", None)
    if not callable(cudagraphify) or getattr(cudagraphify, _MARK, False):
        return

    @functools.wraps(cudagraphify)
    def cudagraphify_or_fall_back(model: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        run = cudagraphify(model, *args, **kwargs)
        if _trees_in_use():
            # The region's tree function is made at its first call, by the tree manager's
            # module, which cudagraphify has imported by now: it must carry the fallback
            # then, however it was imported.
            _wrap_imported_inductor()
            return run
        static_input_idxs = args[0] if args else kwargs.get("static_input_idxs", ())
        graph = _SingleGraph(
            module,
            model,
            run,
            static_input_idxs,
            kwargs.get("mutated_input_idxs", ()),
            kwargs.get("device_index"),
        )
        return graph.__call__

    setattr(cudagraphify_or_fall_back, _MARK, True)
    module.cudagraphify = cudagraphify_or_fall_back
