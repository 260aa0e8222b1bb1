"""Installs the Large Model Support API into a stock ``torch.cuda``.

A patched build has these hooks in its own sources; on a stock wheel they are put in place
here, at import time (the allocation path itself, ``empty_cache`` and ``record_stream`` go
through the LMS allocator that ``torch_lms._C`` installs in front of the caching allocator):

* the public functions of ``torch/cuda/lms.py`` become attributes of ``torch.cuda``;
* ``torch.cuda.memory_stats()`` gains ``lms.*`` keys and ``torch.cuda.memory_summary()`` an
  LMS section;
* ``torch.Tensor.data_ptr`` and ``torch.UntypedStorage.data_ptr`` page a swapped-out storage
  in before returning its address (a patched build does this in ``StorageImpl``), so code that
  launches kernels itself from Python, such as Triton kernels of ``torch.compile``, sees
  resident memory;
* Inductor's C++ static CUDA launcher, which reads tensor addresses without
  ``Tensor.data_ptr``, is turned off so compiled kernels launch through Triton's launcher;
* ``torch.cuda.CUDAGraph.capture_begin`` refuses to start a capture while storages of the
  device are paged out or dropped (``set_recompute_lms``): neither a page-in nor a recompute
  can be captured, and on a stock wheel an operator whose input could not be made resident
  would run (RecordFunction callbacks cannot stop it). Captures of
  ``torch.compile(mode="reduce-overhead")`` regions are let through: LMS makes their inputs
  resident before the capture begins (``torch/cuda/lms.py``).
"""

from __future__ import annotations

import collections
import functools
from types import ModuleType
from typing import Any, Callable

import torch

# The functions every build offers as torch.cuda.<name> (torch/cuda/lms.py has more).
API_NAMES: tuple[str, ...] = (
    "set_enabled_lms",
    "get_enabled_lms",
    "set_limit_lms",
    "get_limit_lms",
    "set_size_lms",
    "get_size_lms",
    "set_prefetch_lms",
    "get_prefetch_lms",
    "set_speculative_lms",
    "get_speculative_lms",
    "set_schedule_lms",
    "get_schedule_lms",
    "set_lookahead_lms",
    "get_lookahead_lms",
    "set_packing_lms",
    "get_packing_lms",
    "set_host_placement_lms",
    "get_host_placement_lms",
    "set_prefetch_budget_lms",
    "get_prefetch_budget_lms",
    "set_graph_prefetch_lms",
    "get_graph_prefetch_lms",
    "set_host_limit_lms",
    "get_host_limit_lms",
    "set_recompute_lms",
    "get_recompute_lms",
    "reset_lms_schedule",
    "reclaim_inactive",
    "lms_stats",
)

_installed = False


def _device_index(device: Any) -> int:
    if device is None:
        return torch.cuda.current_device()
    return torch.cuda._utils._get_device_index(device, optional=True)


def flat_stats(binding: ModuleType, device: int) -> dict[str, Any]:
    """LMS statistics of ``device`` as flat ``lms.*`` keys, as ``memory_stats()`` has them."""
    flat: dict[str, Any] = {}
    for key, value in binding._cuda_lms_stats(device).items():
        if isinstance(value, dict):
            for part, number in value.items():
                flat[f"lms.{key}.{part}"] = number
        else:
            flat[f"lms.{key}"] = value
    return flat


def _mib(n: float) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def _wrap_memory_stats(binding: ModuleType) -> None:
    original: Callable[..., Any] = torch.cuda.memory.memory_stats

    @functools.wraps(original)
    def memory_stats(device: Any = None) -> dict[str, Any]:
        stats = dict(original(device=device))
        if torch.cuda.is_initialized():
            stats.update(flat_stats(binding, _device_index(device)))
        return collections.OrderedDict(sorted(stats.items()))

    # memory_summary() and friends look the function up in torch.cuda.memory.
    torch.cuda.memory.memory_stats = memory_stats
    torch.cuda.memory_stats = memory_stats


def _wrap_memory_summary(binding: ModuleType, api: ModuleType) -> None:
    original: Callable[..., str] = torch.cuda.memory.memory_summary

    @functools.wraps(original)
    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        text = original(device=device, abbreviated=abbreviated)
        if not torch.cuda.is_initialized():
            return text
        stats = binding._cuda_lms_stats(_device_index(device))
        # The shared formatter doubles braces for memory_summary()'s own format pass,
        # which has already run here.
        rows = api._memory_summary_lines(stats, prefix="")
        lines = [f"|{row.replace('{{', '{').replace('}}', '}')}|" for row in rows]
        return text + "".join(line + "\n" for line in lines)

    torch.cuda.memory.memory_summary = memory_summary
    torch.cuda.memory_summary = memory_summary


def _wrap_data_ptr(binding: ModuleType) -> None:
    access = binding._torch_lms_access
    tensor_data_ptr = torch.Tensor.data_ptr
    storage_data_ptr = torch.UntypedStorage.data_ptr

    @functools.wraps(tensor_data_ptr)
    def data_ptr(self: torch.Tensor) -> int:
        if self.is_cuda:
            access(self)
        return tensor_data_ptr(self)

    @functools.wraps(storage_data_ptr)
    def untyped_storage_data_ptr(self: torch.UntypedStorage) -> int:
        if self.is_cuda:
            access(self)
        return storage_data_ptr(self)

    torch.Tensor.data_ptr = data_ptr  # type: ignore[method-assign]
    torch.UntypedStorage.data_ptr = untyped_storage_data_ptr  # type: ignore[method-assign]


def _use_triton_launcher() -> None:
    try:
        import torch._inductor.config as inductor_config
    except ImportError:  # an Inductor-less build: nothing to do
        return
    if hasattr(inductor_config, "use_static_cuda_launcher"):
        inductor_config.use_static_cuda_launcher = False


def _guard_graph_capture(binding: ModuleType, api: ModuleType) -> None:
    def check() -> None:
        if not binding._cuda_lms_getEnabled():
            return
        # A compiled region's CUDA graph (torch.compile mode="reduce-overhead"): LMS made
        # its inputs resident, and the storages still paged out are not read in it.
        if api.capturing_with_resident_inputs():
            return
        device = torch.cuda.current_device()
        stats = binding._cuda_lms_stats(device)
        paged_out = stats["pagedout_bytes"]["current"]
        # Dropped storages (set_recompute_lms) are brought back by replaying an operator,
        # which cannot be captured either.
        dropped = stats["dropped_bytes"]["current"]
        if paged_out > 0 or dropped > 0:
            away: list[str] = []
            if paged_out > 0:
                away.append(f"{_mib(paged_out)} paged out to host memory")
            if dropped > 0:
                away.append(f"{_mib(dropped)} dropped to be recomputed")
            raise RuntimeError(
                f"Large Model Support: tensors on cuda:{device} are not resident "
                f"({', '.join(away)}), and neither a page-in nor a recompute can be "
                "captured into a CUDA graph. Capture while the captured region's tensors "
                "fit on the device (e.g. before the memory-hungry part of training, or after "
                "freeing tensors), or capture with torch.cuda.set_enabled_lms(False)."
            )

    graph_class = torch.cuda.graphs.CUDAGraph
    capture_begin_original: Callable[..., Any] = graph_class.capture_begin

    @functools.wraps(capture_begin_original)
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        check()
        return capture_begin_original(self, *args, **kwargs)

    graph_class.capture_begin = capture_begin

    # torch.cuda.graph enters its capture stream before calling capture_begin: check
    # first, so that a refused capture leaves the current stream alone.
    context_class = torch.cuda.graphs.graph
    enter_original: Callable[..., Any] = context_class.__enter__

    @functools.wraps(enter_original)
    def graph_enter(self: Any) -> Any:
        check()
        return enter_original(self)

    context_class.__enter__ = graph_enter


def install(binding: ModuleType, api: ModuleType) -> None:
    """Puts the LMS API into ``torch.cuda`` (once)."""
    global _installed
    if _installed:
        return
    names = tuple(getattr(api, "__all__", API_NAMES))
    missing = [name for name in (*API_NAMES, "_memory_summary_lines") if not hasattr(api, name)]
    if missing:
        raise ImportError(
            f"torch_lms: the bundled torch.cuda LMS API ({api.__file__}) lacks {missing}; "
            "rebuild the extension from a matching checkout"
        )
    for name in names:
        setattr(torch.cuda, name, getattr(api, name))
    torch.cuda.lms = api  # type: ignore[attr-defined]
    _wrap_memory_stats(binding)
    _wrap_memory_summary(binding, api)
    _wrap_data_ptr(binding)
    _use_triton_launcher()
    _guard_graph_capture(binding, api)
    # LMS enabled through PYTORCH_LMS_CONF: finish what enabling through the API does
    # (initialize CUDA, attach the allocator hook that adoption needs).
    if binding._cuda_lms_getEnabled():
        api.set_enabled_lms(True)
    _installed = True
