r"""Large Model Support (LMS) for the CUDA caching allocator.

LMS lets a program use more GPU memory than the device has. Storages that no
running operator uses are paged out to pinned host memory when an allocation
would pass the LMS limit (or when the device allocation fails), least recently
used first, and paged back in when an operator or raw data access needs them.
Every tensor an operator reads or writes is resident while the operator runs.

Enable LMS before the tensors it should manage are created, with
:func:`set_enabled_lms` or ``PYTORCH_CUDA_ALLOC_CONF=lms:True`` (further keys:
``lms_limit_mb``, ``lms_size_mb``, ``lms_prefetch``, ``lms_speculative_mb``,
``lms_schedule``, ``lms_lookahead``, ``lms_prefetch_budget_mb``,
``lms_graph_prefetch``, ``lms_host_limit_mb``, ``lms_recompute``, ``lms_pack``,
``lms_host_placement``).

Host memory, where storages are paged out to, has a budget shared by the LMS
processes of the host (see :func:`set_host_limit_lms`): a page-out that would
pass it is refused, and the allocation that needed the room raises
:class:`torch.OutOfMemoryError` naming host memory, instead of the kernel's
OOM killer ending a process.

Learned swap schedule (on by default): LMS records the order in which
operators use storages. Once a training iteration has repeated twice, it pages
out the storages used furthest in the future, early and on a device-to-host
stream, and pages them back in ahead of use on a host-to-device stream, so
copies in both directions overlap with computation. When the order changes
(other shapes, an evaluation step, another model) it falls back to
least-recently-used reclaim and demand page-in until it has learned the new
order; ``lms_stats()`` reports ``schedule_active`` and ``schedule_fallbacks``.

The functions are available as ``torch.cuda.<name>`` in a PyTorch built with the
Large Model Support patch series, and from the drop-in extension
(``import torch_lms``) on a stock PyTorch.

Compiled code: the Triton kernels that ``torch.compile`` generates are launched
from Python, outside the dispatcher, so each launch is an operator boundary of
its own: the storages of its tensor arguments are pinned for the launch and
reclaimable again after it (Inductor's ``CachingAutotuner.run``, wrapped when
its module is first imported). Before a region compiled with
``mode="reduce-overhead"`` is captured into a CUDA graph, its inputs are paged
in (Inductor's ``CUDAGraphNode._record``, wrapped likewise): the graph bakes in
their addresses, and a page-in cannot be captured. When a region's warm-up or
capture runs out of memory in the graph pool, which LMS never pages out, the
compiled code of that device runs without CUDA graphs from then on, paged like
eager code, with one warning (``_lms_cudagraphs.py`` beside this file).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import operator
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Callable, Optional, Union

import torch
from torch.cuda._utils import _get_device_index
from torch.types import Device

__all__ = [
    "get_enabled_lms",
    "get_graph_prefetch_lms",
    "get_host_limit_lms",
    "get_host_placement_lms",
    "get_limit_lms",
    "get_lookahead_lms",
    "get_packing_lms",
    "get_prefetch_budget_lms",
    "get_prefetch_lms",
    "get_recompute_lms",
    "get_schedule_lms",
    "get_size_lms",
    "get_speculative_lms",
    "lms_recompute_operators",
    "lms_stats",
    "lms_storage_state",
    "reclaim_inactive",
    "reset_accumulated_lms_stats",
    "reset_lms_schedule",
    "reset_peak_lms_stats",
    "set_enabled_lms",
    "set_graph_prefetch_lms",
    "set_host_limit_lms",
    "set_host_placement_lms",
    "set_limit_lms",
    "set_lookahead_lms",
    "set_packing_lms",
    "set_prefetch_budget_lms",
    "set_prefetch_lms",
    "set_recompute_lms",
    "set_schedule_lms",
    "set_size_lms",
    "set_speculative_lms",
]

_DeviceArg = Optional[Union[Device, int]]

# Keys of the dict that lms_stats() returns (and memory_stats() nests under
# "lms."): counters, then gauges, each gauge a {"current", "peak"} dict.
_COUNTER_KEYS = (
    "pageout_count",
    "pageout_bytes",
    "pagein_count",
    "pagein_bytes",
    "reclaim_limit",
    "reclaim_speculative",
    "reclaim_alloc_failure",
    "reclaim_explicit",
    "pack_count",
    "pack_bytes",
    "workspace_releases",
    "fragment_reclaims",
    "host_placement_count",
    "host_placement_bytes",
    "alloc_from_cache",
    "alloc_from_device",
    "alloc_after_reclaim",
    "prefetch_count",
    "prefetch_hits",
    "prefetch_late",
    "pagein_demand_count",
    "schedule_active",
    "schedule_period",
    "schedule_detections",
    "schedule_fallbacks",
    "schedule_victims",
    "schedule_prefetch_count",
    "schedule_rescues",
    "schedule_prefetch_budget_bytes",
    "early_pageout_count",
    "early_pageout_bytes",
    "peak_pageout_count",
    "peak_pageout_bytes",
    "graph_prefetch_count",
    "graph_prefetch_bytes",
    "graph_pageout_count",
    "stall_ms",
    "copy_out_bytes",
    "copy_out_ms",
    "copy_in_bytes",
    "copy_in_ms",
    "drop_count",
    "drop_bytes",
    "recompute_count",
    "recompute_bytes",
    "recompute_ms",
    "recompute_input_prefetch_count",
    "recompute_input_prefetch_bytes",
    "oom_count",
    "pin_failures",
    "cache_releases",
    "limit_bytes",
    "host_budget_bytes",
    "host_ledger_bytes",
    "host_refusals",
)
_GAUGE_KEYS = (
    "managed_bytes",
    "active_bytes",
    "inactive_bytes",
    "pagedout_bytes",
    "dropped_bytes",
    "host_bytes",
    "over_limit_bytes",
    "operator_output_bytes",
    "private_pool_bytes",
)
_STORAGE_STATES = ("unmanaged", "allocated", "active", "inactive", "paged out", "dropped")

_INT_MAX = 2**31 - 1
_MISSING_BINDINGS = (
    "Large Model Support is not available in this PyTorch: build PyTorch with "
    "the Large Model Support patch series, or `pip install` the drop-in "
    "extension (package torch_lms) and `import torch_lms` before using it."
)


def _lms_bindings() -> Any:
    r"""Return the object that implements the ``_cuda_lms_*`` bindings.

    That is ``torch._C`` in a PyTorch built with the Large Model Support patch
    series, otherwise the drop-in extension's module ``torch_lms._C``.

    Raises:
        RuntimeError: if neither provides the bindings.
    """
    if hasattr(torch._C, "_cuda_lms_setEnabled"):
        return torch._C
    try:
        module = importlib.import_module("torch_lms._C")
    except ImportError as e:
        raise RuntimeError(_MISSING_BINDINGS) from e
    if not hasattr(module, "_cuda_lms_setEnabled"):
        raise RuntimeError(_MISSING_BINDINGS)
    return module


# Inductor's runtime module, whose CachingAutotuner.run launches compiled Triton kernels.
_TRITON_RUNTIME = "torch._inductor.runtime.triton_heuristics"


def _pin_compiled_kernel_launches(module: ModuleType) -> None:
    """Wraps ``CachingAutotuner.run`` so that each launch pins its tensor arguments."""
    autotuner = getattr(module, "CachingAutotuner", None)
    if autotuner is None or getattr(autotuner.run, "_lms_launch_pins", False):
        return
    launch: Callable[..., Any] = autotuner.run

    @functools.wraps(launch)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        bindings = _lms_bindings()
        if not bindings._cuda_lms_getEnabled():
            return launch(self, *args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
        if not tensors:
            return launch(self, *args, **kwargs)
        name = getattr(getattr(self, "fn", None), "__name__", "a compiled Triton kernel")
        # Raises torch.OutOfMemoryError with the LMS message before the launch when the
        # kernel's arguments cannot all be resident.
        pins = bindings._cuda_lms_pinForLaunch(tensors, name)
        try:
            return launch(self, *args, **kwargs)
        finally:
            pins.release()

    run._lms_launch_pins = True  # type: ignore[attr-defined]
    autotuner.run = run


# Inductor's CUDA graph trees, whose CUDAGraphNode._record captures a compiled region.
_CUDAGRAPH_TREES = "torch._inductor.cudagraph_trees"

# Per thread: a CUDA graph trees capture whose inputs were made resident first.
_capture_state = threading.local()


def capturing_with_resident_inputs() -> bool:
    """Whether the running capture is one whose inputs LMS made resident before it began.

    The drop-in extension's capture guard refuses other captures while anything is paged
    out; these it lets through (see :func:`_resident_graph_inputs`).
    """
    return bool(getattr(_capture_state, "resident_inputs", False))


def _resident_graph_inputs(module: ModuleType) -> None:
    """Wraps ``CUDAGraphNode._record`` so that a compiled region's inputs are resident when
    its CUDA graph is captured.

    A captured graph bakes in the addresses it reads, and a page-in cannot be captured.
    The inputs of a region compiled with ``mode="reduce-overhead"`` (parameters, buffers,
    constants, the tensors it is called with) are known before the capture: they are paged
    in first and, once an operator inside the capture has used them, LMS never pages them
    out again. Other storages may stay paged out; the region does not read them.

    A page-out cannot be captured either, so the room the capture allocates in the graph's
    private pool must be there before it begins: every other inactive storage of the
    device is paged out and the cache returned to the device (once per captured graph;
    what the next operators need comes back on demand).
    """
    node = getattr(module, "CUDAGraphNode", None)
    record = getattr(node, "_record", None)
    if record is None or getattr(record, "_lms_resident_inputs", False):
        return

    @functools.wraps(record)
    def _record(self: Any, model: Any, inputs: list[Any]) -> Any:
        bindings = _lms_bindings()
        if not bindings._cuda_lms_getEnabled():
            return record(self, model, inputs)
        constants = getattr(getattr(self, "wrapped_function", None), "constants", ())
        for tensor in (*inputs, *constants):
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                bindings._cuda_lms_access(tensor)
        device = _get_device_index(getattr(self, "device", None), optional=True)
        bindings._cuda_lms_reclaimInactive(device)
        torch.cuda.empty_cache()
        _capture_state.resident_inputs = True
        try:
            return record(self, model, inputs)
        finally:
            _capture_state.resident_inputs = False

    _record._lms_resident_inputs = True  # type: ignore[attr-defined]
    node._record = _record


def _install_graph_pool_fallback(module: ModuleType, installer: str) -> None:
    """Makes compiled code run without CUDA graphs once their memory pool does not fit
    (``_lms_cudagraphs``, the module beside this one: ``installer`` of it wraps ``module``)."""
    package = __name__.rpartition(".")[0] or "torch.cuda"
    try:
        fallback = importlib.import_module(f"{package}._lms_cudagraphs")
    except ImportError:  # a build or package without it
        return
    try:
        getattr(fallback, installer)(module)
    except Exception as e:  # never break the import of Inductor
        import warnings

        warnings.warn(
            f"LMS: compiled code that runs out of memory in a CUDA graph pool will not fall "
            f"back to running without CUDA graphs: {e}",
            stacklevel=2,
        )


def _wrap_cudagraph_trees(module: ModuleType) -> None:
    _resident_graph_inputs(module)
    _install_graph_pool_fallback(module, "install_tree_fallback")


# Inductor's compiler, whose cudagraphify gives a region a CUDA graph of its own when CUDA
# graph trees are off.
_COMPILE_FX = "torch._inductor.compile_fx"


def _wrap_compile_fx(module: ModuleType) -> None:
    _install_graph_pool_fallback(module, "install_cudagraphify_fallback")


# Inductor's configuration, whose post_grad_custom_post_pass gets the LMS page-in hint pass.
_INDUCTOR_CONFIG = "torch._inductor.config"


def _install_graph_prefetch(module: ModuleType) -> None:
    """Installs the post-grad pass of ``_lms_graph`` (the module beside this one) that puts
    page-in hints into compiled graphs."""
    package = __name__.rpartition(".")[0] or "torch.cuda"
    try:
        graph = importlib.import_module(f"{package}._lms_graph")
    except ImportError:  # a build or package without it
        return
    try:
        graph.install(module)
    except Exception as e:  # never break the import of Inductor's configuration
        import warnings

        warnings.warn(f"LMS: page-in hints for compiled graphs not installed: {e}", stacklevel=2)


# Inductor modules LMS wraps when they are first imported, and how.
_WRAP_ON_IMPORT: dict[str, Callable[[ModuleType], None]] = {
    _TRITON_RUNTIME: _pin_compiled_kernel_launches,
    _CUDAGRAPH_TREES: _wrap_cudagraph_trees,
    _COMPILE_FX: _wrap_compile_fx,
    _INDUCTOR_CONFIG: _install_graph_prefetch,
}


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps Inductor's kernel launcher, CUDA graph recorder and cudagraphify when their
    modules are imported (never imports them).

    The spec comes from the finders after this one, asked directly: ``sys.meta_path`` is
    never changed while an import is in progress, since Inductor imports from several
    threads (its compile workers), and a module imported by another thread while this finder
    was out of the list would stay unwrapped."""

    def __init__(self) -> None:
        # Per thread, the modules this finder is finding: asked again for one of them (by a
        # finder of another copy of this module, which asks the finders after it), it
        # answers nothing, and the import goes on to the next finder.
        self._finding = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        wrap = _WRAP_ON_IMPORT.get(fullname)
        finding: set[str] = self._finding.__dict__.setdefault("names", set())
        if wrap is None or fullname in finding:
            return None
        finding.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_wrap(module: ModuleType) -> None:
            exec_module(module)
            wrap(module)

        loader.exec_module = exec_and_wrap
        return spec


def _install_compiled_code_hooks() -> None:
    """Wraps the Inductor modules of ``_WRAP_ON_IMPORT`` that are imported already, and
    puts the finder that wraps the others when they are. Every wrap is done once, so this
    runs again whenever LMS is enabled: a module that was imported unwrapped (past the
    finder, or before this module) is wrapped before LMS manages anything."""
    pending = False
    for name, wrap in _WRAP_ON_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            wrap(module)
        else:
            pending = True
    if pending and not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


_install_compiled_code_hooks()


def _check_int(name: str, value: Any, minimum: int = 0, maximum: int | None = None) -> int:
    # operator.index accepts Python and NumPy integers but not floats or
    # strings; bool is an int subclass but never a meaningful size.
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {result}")
    return result


def _device(device: _DeviceArg) -> int:
    return _get_device_index(device, optional=True)


def set_enabled_lms(enable: bool) -> None:
    r"""Enable or disable Large Model Support.

    Only storages allocated while LMS is enabled are ever paged out, so enable
    it before creating the tensors of the model it should manage. While LMS is
    disabled, operators pay nothing for it.

    Args:
        enable (bool): ``True`` to enable LMS, ``False`` to disable it.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    if enable:
        _prefer_expandable_segments()
        _install_compiled_code_hooks()
    _lms_bindings()._cuda_lms_setEnabled(enable)


def _user_chose_expandable_segments() -> bool:
    conf = ",".join(
        os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "expandable_segments" in conf


def _prefer_expandable_segments() -> bool:
    r"""Turn on the caching allocator's expandable segments for LMS, unless the user chose.

    Page-outs free memory in the middle of cached segments. With fixed segments, the live
    tensors of the running operator stay scattered over segments that the allocator can
    neither return nor give to a larger request: measured on an H100 (cuDNN LSTMs of the
    stress suite under caps of a few hundred MiB), the allocator held 754 MiB of segments
    for 153 MiB of tensors and could not place a 238 MiB request under a 780 MiB cap.
    Expandable segments map and unmap 20 MiB pages wherever they are free, so the same
    operators got further (486 MiB of tensors in 550 MiB mapped); a mixture of experts whose
    allocation sizes change every step paged out 8-21% less, and at 1/4 of its peak took
    3.17x its uncapped time against 3.82x with fixed segments. A setting in
    ``PYTORCH_CUDA_ALLOC_CONF`` (either value) is left alone, and so is a PyTorch whose
    allocator has no expandable segments.

    Returns:
        bool: whether expandable segments were turned on here.
    """
    if _user_chose_expandable_segments():
        return False
    # Newer releases move the setter to the accelerator-generic API.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False
    try:
        setter("expandable_segments:True")
    except RuntimeError:  # an allocator without the option (older releases)
        return False
    return True


def get_enabled_lms() -> bool:
    r"""Return whether Large Model Support is enabled.

    Returns:
        bool: ``True`` if LMS manages new allocations.
    """
    return bool(_lms_bindings()._cuda_lms_getEnabled())


def set_limit_lms(limit_bytes: int, device: _DeviceArg = None) -> None:
    r"""Set the LMS limit of a device: the GPU memory, in bytes, that tensors may
    occupy before LMS pages inactive storages out.

    The limit in force is the smaller of this one and the process's share of
    the device: the device memory, less what anything but this process's
    caching allocator holds (other processes sharing the GPU, CUDA contexts,
    library handles), less a headroom of 5% of the device that every LMS
    process leaves free for memory taken outside the allocator (cuBLAS, cuDNN,
    NCCL). The share follows other processes as they grow and shrink; a
    process that holds more than its share returns its cached free blocks to
    the device. Until a limit is set, the share alone is the limit. Where the
    allocator itself is capped (the drop-in extension under
    :func:`torch.cuda.set_per_process_memory_fraction`), the limit in force is
    also at most 95% of that cap: the rest is room for the allocator's
    fragmentation, since allocating right up to the cap makes allocations fail
    and recovering from that synchronizes the device.

    Args:
        limit_bytes (int): the limit in bytes; ``0`` removes it (the share
            applies alone).
        device (torch.device or int, optional): selected device. Sets the limit
            of the current device, given by :func:`~torch.cuda.current_device`,
            if :attr:`device` is ``None`` (default).
    """
    limit_bytes = _check_int("limit_bytes", limit_bytes)
    _lms_bindings()._cuda_lms_setLimit(_device(device), limit_bytes)


def get_limit_lms(device: _DeviceArg = None) -> int:
    r"""Return the LMS limit of a device in bytes (see :func:`set_limit_lms`).

    Args:
        device (torch.device or int, optional): selected device. Returns the
            limit of the current device, given by :func:`~torch.cuda.current_device`,
            if :attr:`device` is ``None`` (default).

    Returns:
        int: the limit in bytes.
    """
    return int(_lms_bindings()._cuda_lms_getLimit(_device(device)))


def set_size_lms(size_bytes: int) -> None:
    r"""Set the size, in bytes, of the smallest storage LMS may page out.

    Smaller storages always stay on the device: paging them costs more in
    copies than it frees. The default is 1 MiB.

    Args:
        size_bytes (int): the threshold in bytes.
    """
    size_bytes = _check_int("size_bytes", size_bytes)
    _lms_bindings()._cuda_lms_setSize(size_bytes)


def get_size_lms() -> int:
    r"""Return the size, in bytes, of the smallest storage LMS may page out.

    Returns:
        int: the threshold in bytes.
    """
    return int(_lms_bindings()._cuda_lms_getSize())


def set_prefetch_lms(depth: int) -> None:
    r"""Set how many storages LMS pages in ahead of need.

    When an operator needs a paged-out storage, LMS also starts paging in up to
    :attr:`depth` storages that were paged out just before it (a backward pass
    uses activations in the reverse of the order they were paged out), on its
    copy stream and within the limit.

    Args:
        depth (int): the number of storages; ``0`` (default) turns prefetch off.
    """
    depth = _check_int("depth", depth, maximum=_INT_MAX)
    _lms_bindings()._cuda_lms_setPrefetch(depth)


def get_prefetch_lms() -> int:
    r"""Return the LMS prefetch depth (see :func:`set_prefetch_lms`).

    Returns:
        int: the number of storages paged in ahead of need; ``0`` when off.
    """
    return int(_lms_bindings()._cuda_lms_getPrefetch())


def set_speculative_lms(margin_bytes: int) -> None:
    r"""Set the LMS speculative page-out margin.

    Once the memory allocated to tensors exceeds ``limit - margin_bytes``, LMS
    pages inactive storages out down to that mark, so that copies overlap with
    computation before the limit is reached.

    Args:
        margin_bytes (int): the margin in bytes; ``0`` (default) turns
            speculative page-out off.
    """
    margin_bytes = _check_int("margin_bytes", margin_bytes)
    _lms_bindings()._cuda_lms_setSpeculative(margin_bytes)


def get_speculative_lms() -> int:
    r"""Return the LMS speculative page-out margin in bytes (see :func:`set_speculative_lms`).

    Returns:
        int: the margin in bytes; ``0`` when off.
    """
    return int(_lms_bindings()._cuda_lms_getSpeculative())


def set_schedule_lms(enable: bool) -> None:
    r"""Enable or disable the learned swap schedule (enabled by default).

    With it, LMS learns the repeating order in which operators use storages
    and, once an iteration has repeated, chooses victims by next use (the one
    used furthest in the future), pages storages out early on a device-to-host
    stream and pages them in ahead of use on a host-to-device stream. Without
    it, reclaim is least recently used and page-ins happen when an operator
    needs them.

    Args:
        enable (bool): ``True`` to use the schedule, ``False`` to stay reactive.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    _lms_bindings()._cuda_lms_setSchedule(enable)


def get_schedule_lms() -> bool:
    r"""Return whether the learned swap schedule is enabled (see :func:`set_schedule_lms`).

    Returns:
        bool: ``True`` if LMS learns and uses a swap schedule.
    """
    return bool(_lms_bindings()._cuda_lms_getSchedule())


def set_packing_lms(enable: bool) -> None:
    r"""Enable or disable packing operators before they pin their inputs (enabled by default).

    When an operator is expected to need most of the limit (its inputs, what
    operators of its name allocated inside themselves before, and what cannot
    be paged out) and the allocator's segments or pages around its inputs would
    leave it too little room, LMS pages out every inactive storage, the
    operator's inputs included, and returns the allocator's cache first, so
    that the inputs come back side by side and the operator allocates from
    pages nothing else holds. A pack costs a round of page-outs
    (``pack_count`` and ``pack_bytes`` in :func:`lms_stats`). For every such
    operator, packed or not, the workspaces cuBLAS keeps cached are freed
    (``workspace_releases``); cuBLAS allocates them again at its next call. Off,
    operators' working sets are still learned, nothing is packed and no
    workspace freed: turn it off in a program that runs cuBLAS from two threads
    on one device at once. The same setting as ``lms_pack`` in
    ``PYTORCH_CUDA_ALLOC_CONF``.

    Args:
        enable (bool): ``True`` to pack operators that need it, ``False`` never to.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    _lms_bindings()._cuda_lms_setPacking(enable)


def get_packing_lms() -> bool:
    r"""Return whether LMS packs operators (see :func:`set_packing_lms`).

    Returns:
        bool: ``True`` if packing is on.
    """
    return bool(_lms_bindings()._cuda_lms_getPacking())


def set_host_placement_lms(enable: bool) -> None:
    r"""Enable or disable host placement of what operators cannot have on the device (default on).

    When an operator allocates memory (an output, or a workspace such as
    cuDNN's) that the device cannot hold even with every other storage paged
    out, LMS places it in pinned host memory within the host budget instead of
    raising :class:`torch.OutOfMemoryError`. Unified addressing makes it valid
    on the device: the operator's kernels read and write it over the bus, so
    the operator runs slower and computes the same numbers as with device
    memory. A library that would have caught the error keeps its algorithm:
    cuDNN, refused a workspace, tries a plan that needs less memory, whose
    results can differ in the last bits. What the operator still holds when it
    ends is paged out from then on and paged in when next used. A warning
    names each operator that needed it, once; ``host_placement_count`` and
    ``host_placement_bytes`` in :func:`lms_stats` count the allocations.
    Disabled, such an allocation raises the error (and a library may pick
    another algorithm). The same setting as ``lms_host_placement`` in
    ``PYTORCH_CUDA_ALLOC_CONF``.

    Args:
        enable (bool): ``True`` to place such allocations in host memory,
            ``False`` to raise the out-of-memory error.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    _lms_bindings()._cuda_lms_setHostPlacement(enable)


def get_host_placement_lms() -> bool:
    r"""Return whether LMS places in host memory what operators cannot have on the device.

    See :func:`set_host_placement_lms`.

    Returns:
        bool: ``True`` if host placement is on.
    """
    return bool(_lms_bindings()._cuda_lms_getHostPlacement())


def set_lookahead_lms(operators: int) -> None:
    r"""Set how many operators ahead the learned schedule pages storages in.

    Storages used within this window are never chosen as victims while another
    storage will do.

    Args:
        operators (int): the window in operators; ``0`` (default) derives it
            from the learned iteration (an eighth of its operators, 4 to 512).
    """
    operators = _check_int("operators", operators, maximum=_INT_MAX)
    _lms_bindings()._cuda_lms_setLookahead(operators)


def get_lookahead_lms() -> int:
    r"""Return the schedule's lookahead in operators (see :func:`set_lookahead_lms`).

    Returns:
        int: the window in operators; ``0`` when derived from the iteration.
    """
    return int(_lms_bindings()._cuda_lms_getLookahead())


def set_prefetch_budget_lms(budget_bytes: int) -> None:
    r"""Set the learned schedule's prefetch budget.

    The schedule keeps at most this many bytes paged in ahead and not yet used,
    and pages storages out early to keep as much free under the LMS limit.

    Args:
        budget_bytes (int): the budget in bytes; ``0`` (default) derives it from
            the limit and the page-in traffic: one eighth of the limit, scaled up
            to a quarter as an iteration pages in one to two times the limit
            (``lms_stats()["schedule_prefetch_budget_bytes"]`` says which).
    """
    budget_bytes = _check_int("budget_bytes", budget_bytes)
    _lms_bindings()._cuda_lms_setPrefetchBudget(budget_bytes)


def get_prefetch_budget_lms() -> int:
    r"""Return the schedule's prefetch budget in bytes (see :func:`set_prefetch_budget_lms`).

    Returns:
        int: the budget in bytes; ``0`` when derived from the limit.
    """
    return int(_lms_bindings()._cuda_lms_getPrefetchBudget())


def set_graph_prefetch_lms(enable: bool) -> None:
    r"""Enable or disable page-ins planned by compiled graphs.

    ``torch.compile`` knows the order in which a compiled graph uses its inputs
    (for a backward graph, the activations its forward saved). With this on
    (the default) and LMS enabled when a graph is compiled, Inductor's
    generated code says, as the graph runs, which of its inputs come next
    (``torch.ops.lms.page_in_ahead``), and LMS pages the paged-out ones in
    ahead of use on a copy stream, within the prefetch budget
    (:func:`set_prefetch_budget_lms`). It acts from the first iteration and
    also where the learned schedule never settles (shapes that change every
    iteration); while a learned schedule is active it steps aside (the
    schedule pages in ahead what the graph would name, and knows the rest of
    the iteration). Graphs compiled while it is off carry no such calls;
    turning it off later makes the calls do nothing.

    Args:
        enable (bool): ``True`` to enable, ``False`` to disable.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    _lms_bindings()._cuda_lms_setGraphPrefetch(enable)


def get_graph_prefetch_lms() -> bool:
    r"""Return whether compiled graphs plan page-ins (see :func:`set_graph_prefetch_lms`)."""
    return bool(_lms_bindings()._cuda_lms_getGraphPrefetch())


def set_host_limit_lms(limit_bytes: int) -> None:
    r"""Set the host budget: the pinned host memory, in bytes, that the LMS
    processes of this host may hold together.

    Storages are paged out to pinned host memory, which the kernel can neither
    swap nor reclaim: when the processes of a host pin more than it has, the
    kernel's OOM killer ends one of them. LMS checks every new pinned buffer
    against the budget: past it, a process first frees its own idle cached
    buffers, then refuses the page-out, and the allocation that needed the
    room raises :class:`torch.OutOfMemoryError` naming host memory (what is
    needed, what the LMS processes of the host hold, the budget and where it
    comes from). The LMS processes of a host share their pinned bytes through
    a ledger file in ``/dev/shm``, one per user (the environment variable
    ``PYTORCH_LMS_HOST_LEDGER`` names another file; a process that cannot use
    it counts only its own, with a warning).

    By default the budget is derived from what the host can give, read at
    most every 100 ms: ``MemAvailable`` of ``/proc/meminfo`` plus what LMS
    processes have pinned already, within the memory limit of the process's
    cgroup (its room plus what the cgroup's LMS processes have pinned), less
    a reserve for the rest of the system of 5% of the memory (of the host, or
    the cgroup's limit), at least 2 GiB. A budget set here replaces the
    derived one, also above what the host can give; each process checks the
    host's total against its own setting, so set the same in every process.
    ``PYTORCH_CUDA_ALLOC_CONF=lms_host_limit_mb:<MiB>`` sets it too.
    ``lms_stats()`` reports ``host_budget_bytes``, ``host_ledger_bytes`` and
    ``host_refusals``.

    Args:
        limit_bytes (int): the budget in bytes; ``0`` (default) derives it.
    """
    limit_bytes = _check_int("limit_bytes", limit_bytes)
    _lms_bindings()._cuda_lms_setHostLimit(limit_bytes)


def get_host_limit_lms() -> int:
    r"""Return the host budget set with :func:`set_host_limit_lms`, in bytes.

    Returns:
        int: the budget in bytes; ``0`` when derived from the host's memory
        (``lms_stats()["host_budget_bytes"]`` is the budget in force).
    """
    return int(_lms_bindings()._cuda_lms_getHostLimit())


def set_recompute_lms(enable: bool) -> None:
    r"""Enable or disable recomputing instead of paging (disabled by default).

    Operator-boundary pinning records, for each output of an operator on an
    allow-list of pure operators, a recipe: the operator and its inputs. The
    list holds deterministic operators (convolution, matrix products,
    pointwise operators whose backward reads their inputs, layer and group
    normalization, pooling, embedding) and dropout, whose recipe saves the
    state of the device's default CUDA generator and replays with it. With
    this on, LMS decides per storage when it picks a victim: a storage with a
    recipe is dropped instead of paged out when recomputing it costs less than
    paging it. Recomputing costs its producing operator's measured duration,
    plus bringing back those of its inputs that are not resident. Paging
    costs moving the storage over the bus both ways at the copy bandwidth
    measured on the device, times the share of recent copy time that made
    streams wait (``stall_ms`` of :func:`lms_stats`, over the last few
    seconds of copies: copies the learned schedule hides behind compute cost
    nothing). A dropped storage has no copy
    anywhere (:func:`lms_storage_state` says ``"dropped"``); the inputs of its
    recipe are kept alive, and LMS may page them out like any other storage;
    the learned schedule pages them in ahead of the dropped storage's next
    use. When an operator needs the storage, LMS recomputes it by replaying
    its producing operator on those inputs (recomputing them first if they
    were dropped too), and an operator that writes one of those inputs has the
    storage recomputed before it runs. The recomputed contents are
    bit-identical to the dropped ones, unless the replay caught an
    out-of-memory error inside it (a library such as cuDNN then runs an
    algorithm that needs less memory); LMS warns when that happens.
    ``PYTORCH_CUDA_ALLOC_CONF=lms_recompute:True`` turns it on too.
    ``lms_stats()`` reports ``drop_count``, ``drop_bytes``,
    ``recompute_count``, ``recompute_bytes``, ``recompute_ms``,
    ``recompute_input_prefetch_count``, ``recompute_input_prefetch_bytes``
    and the gauge ``dropped_bytes``.

    A recipe follows the version counters of its tensors: an in-place write
    to an input or to the output (an in-place operator on the tensor or on a
    view of it) invalidates it, and the storage is paged out like any other.
    An in-place write through another tensor object that bypasses version
    counters (``.data``) is not seen, and a recompute after it reads the
    changed inputs: the same contract autograd's saved tensors have.

    Args:
        enable (bool): ``True`` to drop and recompute where it is cheaper than
            paging, ``False`` to page out every victim.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    _lms_bindings()._cuda_lms_setRecompute(enable)


def get_recompute_lms() -> bool:
    r"""Return whether LMS recomputes instead of paging (see :func:`set_recompute_lms`).

    Returns:
        bool: ``True`` if victims with a recipe may be dropped and recomputed.
    """
    return bool(_lms_bindings()._cuda_lms_getRecompute())


def reset_lms_schedule() -> None:
    r"""Forget the learned swap schedule.

    LMS is reactive until it has learned the order of operators again; useful
    after switching to another model when the switch is known.
    """
    _lms_bindings()._cuda_lms_resetSchedule()


def reclaim_inactive(device: _DeviceArg = None) -> int:
    r"""Page out every inactive storage of a device now.

    The memory goes back to the caching allocator; call
    :func:`~torch.cuda.empty_cache` as well to return it to the device.

    Args:
        device (torch.device or int, optional): selected device. Reclaims on the
            current device, given by :func:`~torch.cuda.current_device`, if
            :attr:`device` is ``None`` (default).

    Returns:
        int: the bytes paged out.
    """
    return int(_lms_bindings()._cuda_lms_reclaimInactive(_device(device)))


def lms_stats(device: _DeviceArg = None) -> dict[str, Any]:
    r"""Return the Large Model Support statistics of a device.

    The counters are ints except ``stall_ms``, ``copy_out_ms``, ``copy_in_ms``
    and ``recompute_ms`` (floats):

    - ``pageout_count``, ``pageout_bytes``, ``pagein_count``, ``pagein_bytes``:
      copies to and from host memory.
    - ``reclaim_limit``, ``reclaim_speculative``, ``reclaim_alloc_failure``,
      ``reclaim_explicit``: reclaim rounds, by what triggered them (an
      allocation would pass the limit, the speculative margin was crossed, the
      device allocation failed, :func:`reclaim_inactive`); ``fragment_reclaims``:
      failed allocations placed by paging out the storages that held a range of
      the allocator's memory the request fits in; ``pack_count`` and
      ``pack_bytes``: operators expected to need most of the device, for which
      every inactive storage (their own inputs included) was paged out and the
      cached free memory returned before they pinned their inputs, so that
      their tensors occupy as few of the allocator's pages as they need, and
      the bytes paged out for them; ``workspace_releases``: operators judged
      that tight, packed or not, for which the workspaces libraries keep
      cached (cuBLAS's) were freed; the libraries allocate them again at their
      next use.
    - ``host_placement_count``, ``host_placement_bytes``: allocations inside
      operators that the device could not hold with every other storage paged
      out, placed in pinned host memory instead (:func:`set_host_placement_lms`).
    - ``alloc_from_cache``, ``alloc_from_device``, ``alloc_after_reclaim``:
      where LMS allocations were satisfied from.
    - ``prefetch_count``, ``prefetch_hits``: storages prefetched, and those an
      operator then found resident; ``prefetch_late``: those whose copy was
      still running when the operator needed them (its stream waited for the
      rest); ``pagein_demand_count``: page-ins made on the operator's stream
      when it needed the storage.
    - Learned swap schedule (see :func:`set_schedule_lms`): ``schedule_active``
      (1 while a learned schedule is in use), ``schedule_period`` (operators
      per iteration), ``schedule_detections`` and ``schedule_fallbacks``
      (schedules adopted, and dropped because the pattern broke), and per
      device ``schedule_victims`` (victims chosen by next use),
      ``schedule_prefetch_count`` (page-ins issued ahead of use),
      ``early_pageout_count`` and ``early_pageout_bytes`` (page-outs made
      right after a last use, with no stream waiting for them; of them,
      ``peak_pageout_count`` and ``peak_pageout_bytes`` were made from the
      start of the iteration, ahead of its peak of demand, for storages used
      next after the peak) and
      ``schedule_rescues`` (storages used again before an early page-out
      released their memory: no copy back was needed), and
      ``schedule_prefetch_budget_bytes`` (the prefetch budget in force, set
      with :func:`set_prefetch_budget_lms` or derived; 0 while no schedule is
      active).
    - Page-ins planned by compiled graphs (see :func:`set_graph_prefetch_lms`),
      per device: ``graph_prefetch_count`` and ``graph_prefetch_bytes``
      (page-ins ahead of use started because a compiled graph said it uses the
      storage next) and ``graph_pageout_count`` (early page-outs made to find
      room for them while no learned schedule was active).
    - ``stall_ms``: time compute streams waited for LMS copies.
    - ``copy_out_bytes``, ``copy_out_ms``, ``copy_in_bytes``, ``copy_in_ms``: the
      copies to and from host memory timed on their streams, each way: their
      bytes and the milliseconds they took. Bytes over milliseconds is the
      bandwidth paging gets on this machine (what a storage costs to page out
      and back in); copies still running are not counted yet.
    - Recompute instead of paging (see :func:`set_recompute_lms`):
      ``drop_count`` and ``drop_bytes`` (victims dropped instead of paged out),
      ``recompute_count`` and ``recompute_bytes`` (dropped storages recomputed,
      one operator replayed each), ``recompute_ms`` (the device time the
      replays took, timed on their streams), and
      ``recompute_input_prefetch_count`` and ``recompute_input_prefetch_bytes``
      (inputs of dropped storages' recipes that the learned schedule paged in
      ahead of their recompute).
    - ``oom_count``: LMS out-of-memory errors raised.
    - ``pin_failures``: operators whose inputs could not all be made resident
      (each raised :class:`torch.OutOfMemoryError` at its first allocation, or,
      allocating nothing, ran on the host copies of the inputs left out).
    - ``cache_releases``: times cached free blocks were returned to the device
      because this process held more than its share of it (other processes or
      libraries needed the memory).
    - ``limit_bytes``: the limit in force (``0`` before CUDA is initialized):
      the one set with :func:`set_limit_lms` or this process's share of the
      device, whichever is smaller, and never more than the allocator may hold
      (e.g. under :func:`~torch.cuda.set_per_process_memory_fraction`).
    - Host memory (process-wide, see :func:`set_host_limit_lms`):
      ``host_budget_bytes`` (the host budget in force, set or derived; ``0``
      when none could be derived), ``host_ledger_bytes`` (the pinned host
      memory all LMS processes of the host hold, as their shared ledger says)
      and ``host_refusals`` (pinned allocations the budget refused).

    The gauges ``managed_bytes``, ``active_bytes``, ``inactive_bytes``,
    ``pagedout_bytes``, ``dropped_bytes`` (dropped storages, whose contents
    are to be recomputed), ``host_bytes`` (pinned host memory LMS holds,
    process-wide), ``over_limit_bytes`` (bytes allocated beyond the limit
    after an allocation's reclaim: pinned by running operators or not
    reclaimable), ``operator_output_bytes`` (allocated by running operators
    and not released yet: part of their working set) and
    ``private_pool_bytes`` (device memory reserved by CUDA graph pools and
    :class:`torch.cuda.MemPool`, which LMS never pages out) are dicts
    ``{"current": int, "peak": int}``.

    With LMS built in, :func:`~torch.cuda.memory_stats` reports the same values
    under ``"lms."`` keys.

    Args:
        device (torch.device or int, optional): selected device. Returns
            statistics for the current device, given by
            :func:`~torch.cuda.current_device`, if :attr:`device` is ``None``
            (default).

    Returns:
        dict: the statistics.
    """
    return dict(_lms_bindings()._cuda_lms_stats(_device(device)))


def lms_recompute_operators(device: _DeviceArg = None) -> dict[str, dict[str, int]]:
    r"""Return what recompute (see :func:`set_recompute_lms`) did on a device, per operator.

    Keys are operator names (``"aten::convolution"``, ``"aten::dropout"``); each value
    holds ``drop_count`` and ``drop_bytes`` (outputs of the operator dropped instead of
    paged out) and ``recompute_count`` and ``recompute_bytes`` (dropped outputs recomputed
    by replaying it), since the last :func:`reset_accumulated_lms_stats`. Their sums are
    ``drop_count`` and the other totals of :func:`lms_stats` (an operator's storage that is
    dropped again after a recompute counts again).

    Args:
        device (torch.device or int, optional): selected device. Returns the counts of the
            current device, given by :func:`~torch.cuda.current_device`, if
            :attr:`device` is ``None`` (default).

    Returns:
        dict: per operator name, its four counts (ints).
    """
    counts = _lms_bindings()._cuda_lms_recomputeOperators(_device(device))
    return {str(name): {k: int(v) for k, v in entry.items()} for name, entry in counts.items()}


def reset_peak_lms_stats(device: _DeviceArg = None) -> None:
    r"""Reset the ``"peak"`` values of the LMS gauges to their current values.

    With LMS built in, :func:`~torch.cuda.reset_peak_memory_stats` does this too.

    Args:
        device (torch.device or int, optional): selected device. Resets the
            current device, given by :func:`~torch.cuda.current_device`, if
            :attr:`device` is ``None`` (default).
    """
    _lms_bindings()._cuda_lms_resetPeakStats(_device(device))


def reset_accumulated_lms_stats(device: _DeviceArg = None) -> None:
    r"""Reset the LMS counters (copies, drops, reclaims, allocations, prefetch, stall time, OOMs).

    The per-operator counts of :func:`lms_recompute_operators` are reset too.

    With LMS built in, :func:`~torch.cuda.reset_accumulated_memory_stats` does
    this too.

    Args:
        device (torch.device or int, optional): selected device. Resets the
            current device, given by :func:`~torch.cuda.current_device`, if
            :attr:`device` is ``None`` (default).
    """
    _lms_bindings()._cuda_lms_resetAccumulatedStats(_device(device))


def lms_storage_state(tensor: torch.Tensor) -> str:
    r"""Return the LMS state of a tensor's storage.

    Args:
        tensor (torch.Tensor): a tensor with storage.

    Returns:
        str: one of ``"unmanaged"`` (LMS does not manage it), ``"allocated"``
        (resident, not yet used by an operator), ``"active"`` (in use by a
        running operator), ``"inactive"`` (resident and reclaimable),
        ``"paged out"`` (its contents are in host memory) or ``"dropped"``
        (no copy anywhere: recomputed when an operator needs it, see
        :func:`set_recompute_lms`).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    return str(_lms_bindings()._cuda_lms_storageState(tensor))


def _lms_access(tensor: torch.Tensor) -> None:
    r"""Make a tensor's storage resident and keep it off the reclaim list, as
    raw data access does, until an operator uses it again."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    _lms_bindings()._cuda_lms_access(tensor)


# ---------------------------------------------------------------------------
# memory_summary()
# ---------------------------------------------------------------------------

_WIDTH = 75


def _format_size(size: int) -> str:
    prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value = int(size)
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if abs(value) < 768 * 1024:
            break
        prefix = new_prefix
        value //= 1024
    return f"{value:6d} {prefix}"


def _format_count(count: int) -> str:
    prefixes = [" ", "K", "M"]
    value = int(count)
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if abs(value) < 750 * 1000:
            break
        prefix = new_prefix
        value //= 1000
    return f"{value:7d} {prefix} "


def _flatten_stats(stats: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, Mapping):
            flat.update(_flatten_stats(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _bandwidth(bytes_copied: Any, ms: Any) -> str:
    """Timed copies as words: their bandwidth, or that none was timed yet."""
    if float(ms) <= 0.0 or int(bytes_copied) <= 0:
        return "none timed"
    return f"{int(bytes_copied) / (float(ms) * 1e6):.1f} GB/s"


def _memory_summary_lines(stats: Mapping[str, Any], prefix: str = "lms.") -> list[str]:
    r"""Format the LMS section of :func:`~torch.cuda.memory_summary`.

    Args:
        stats (dict): statistics, either flat as from
            :func:`~torch.cuda.memory_stats` (keys ``prefix + "pageout_count"``,
            ``prefix + "managed_bytes.current"``, ...) or nested as from
            :func:`lms_stats` (then pass ``prefix=""``).
        prefix (str, optional): the prefix of the LMS keys (default ``"lms."``).

    Returns:
        list of str: table rows of the summary's width, without its ``|``
        borders, with ``{`` and ``}`` doubled for the summary's
        :meth:`str.format` pass. Empty if :attr:`stats` has no LMS statistics
        or LMS has never managed a storage on the device.
    """
    flat = _flatten_stats(stats)
    try:
        counters = {key: flat[prefix + key] for key in _COUNTER_KEYS}
        gauges = {
            key: (flat[f"{prefix}{key}.current"], flat[f"{prefix}{key}.peak"])
            for key in _GAUGE_KEYS
        }
    except KeyError:
        return []
    if gauges["managed_bytes"][1] == 0 and counters["pageout_count"] == 0:
        return []

    def row(name: str, first: str, second: str) -> str:
        return f" {name:<21} | {first} | {second} |".ljust(_WIDTH)

    lines = ["=" * _WIDTH]
    limit = _format_size(counters["limit_bytes"]).strip()
    lines.append(f" Large Model Support, limit {limit}".center(_WIDTH))
    lines.append("-" * _WIDTH)
    lines.append(row("       Metric", "Cur Usage ", "Peak Usage"))
    lines.append("-" * _WIDTH)
    for key, name in (
        ("managed_bytes", "Managed memory"),
        ("active_bytes", "Pinned by operators"),
        ("inactive_bytes", "Reclaimable memory"),
        ("pagedout_bytes", "Paged out to host"),
        ("dropped_bytes", "Dropped to recompute"),
        ("host_bytes", "Pinned host memory"),
        ("over_limit_bytes", "Over the limit"),
        ("operator_output_bytes", "Held by running ops"),
        ("private_pool_bytes", "Private pools (graphs)"),
    ):
        current, peak = gauges[key]
        lines.append(row(name, _format_size(current), _format_size(peak)))
    lines.append("-" * _WIDTH)
    lines.append(row("       Copies", "  Count   ", "   Size   "))
    lines.append("-" * _WIDTH)
    for name, count, size in (
        ("Paged out", "pageout_count", "pageout_bytes"),
        ("Paged in", "pagein_count", "pagein_bytes"),
        ("Dropped (no copy)", "drop_count", "drop_bytes"),
        ("Recomputed", "recompute_count", "recompute_bytes"),
    ):
        lines.append(row(name, _format_count(counters[count]), _format_size(counters[size])))
    lines.append("-" * _WIDTH)
    lines.append(
        f" Reclaims: {counters['reclaim_limit']} at limit, "
        f"{counters['reclaim_speculative']} speculative, "
        f"{counters['reclaim_alloc_failure']} on failed alloc, "
        f"{counters['reclaim_explicit']} explicit".ljust(_WIDTH)
    )
    lines.append(
        f" Failed allocations placed by paging out a range: "
        f"{counters['fragment_reclaims']}".ljust(_WIDTH)
    )
    lines.append(
        f" Operators packed: {counters['pack_count']} "
        f"({_format_size(counters['pack_bytes']).strip()} paged out); "
        f"workspaces freed: {counters['workspace_releases']}".ljust(_WIDTH)
    )
    lines.append(
        f" Allocations: {counters['alloc_from_cache']} from cache, "
        f"{counters['alloc_from_device']} from device, "
        f"{counters['alloc_after_reclaim']} after reclaim".ljust(_WIDTH)
    )
    lines.append(
        f" Prefetched: {counters['prefetch_count']} ({counters['prefetch_hits']} hits) | "
        f"Stalled: {float(counters['stall_ms']):.1f} ms".ljust(_WIDTH)
    )
    lines.append(
        f" Copies: out {_bandwidth(counters['copy_out_bytes'], counters['copy_out_ms'])}, "
        f"in {_bandwidth(counters['copy_in_bytes'], counters['copy_in_ms'])} | "
        f"Recomputing: {float(counters['recompute_ms']):.1f} ms".ljust(_WIDTH)
    )
    period = int(counters["schedule_period"])
    schedule = f"period {period} ops" if counters["schedule_active"] else "inactive"
    lines.append(
        f" Schedule: {schedule}, {counters['schedule_fallbacks']} fallbacks | "
        f"Early page-outs: {counters['early_pageout_count']}".ljust(_WIDTH)
    )
    lines.append(
        f" Ahead: {counters['schedule_prefetch_count']} ({counters['prefetch_late']} late) | "
        f"On demand: {counters['pagein_demand_count']}".ljust(_WIDTH)
    )
    lines.append(
        f" Host budget: {_format_size(counters['host_budget_bytes']).strip()}, "
        f"LMS processes hold {_format_size(counters['host_ledger_bytes']).strip()}, "
        f"refused {counters['host_refusals']}".ljust(_WIDTH)
    )
    lines.append(
        f" LMS OOMs: {counters['oom_count']} | "
        f"Operators whose inputs did not fit: {counters['pin_failures']} | "
        f"Cache returned: {counters['cache_releases']}".ljust(_WIDTH)
    )
    return [line.replace("{", "{{").replace("}", "}}") for line in lines]
