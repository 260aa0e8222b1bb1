"""Trains one stress case in this process and writes its result as JSON.

Modes (``--mode``):

- ``reference``: LMS is neither imported nor enabled, no memory cap. With ``--measure-bound``
  one more iteration runs after the measured ones under a dispatch mode that records the
  largest working set of one operator (``WorkingSetMode``): the bound below which the cap
  must stay reachable, in tensor bytes and as the allocator maps them (``allocator.py``).
- ``capped``: LMS enabled with its default settings (through ``torch.cuda`` when PyTorch has
  it built in, else ``import torch_lms``) and the caching allocator capped at ``--cap-bytes``
  with ``torch.cuda.set_per_process_memory_fraction``.
- ``capped-no-lms``: the same cap, LMS not imported (does the cap bind without LMS?).
- ``reference-no-cudnn`` / ``capped-no-cudnn``: as ``reference`` / ``capped`` with
  ``torch.backends.cudnn.enabled = False`` (triage: is cuDNN's algorithm choice the cause?).
- ``capped-no-recompute``: as ``capped`` with LMS's recompute turned off
  (``torch.cuda.set_recompute_lms(False)``; triage of a run made with recompute on: is
  recompute the cause?).

A request's ``alloc_conf`` (``--alloc-conf``) is the allocator setting of the run: it goes
into ``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` before CUDA is initialized (and
its ``expandable_segments`` entry to the allocator's setter), so that the references run with
the setting the capped run uses; LMS leaves a setting made there alone. Every run records the
setting it ran with (``allocator``: from the segments' ``is_expandable``, else the
allocator's settings string, else the environment).

Every run is seeded and deterministic (``torch.use_deterministic_algorithms(True,
warn_only=True)``, cuDNN deterministic without benchmarking, no TF32,
``CUBLAS_WORKSPACE_CONFIG=:4096:8``). The result holds the loss of each iteration, SHA-256
hashes of every parameter's and of every buffer's bytes (BatchNorm running statistics) after
training, peak memory, seconds per iteration, LMS statistics, the bound, the allocator
setting, warnings, and the exception if one was raised. Exit status: 0 trained, 3 out of
memory, 4 another exception.

``--serve`` turns the process into a fork server for ``runner``: it imports torch once, then
for each JSON request on stdin forks a child that runs the case (the child initializes CUDA;
the server never does) in a process group of its own, waits for it with a timeout
(``lmsbench/harness.py``'s ``wait_pid``: at the limit the child's group is killed) and
answers one JSON line with the exit status. Every run still has a process of its own; only
the interpreter start and ``import torch`` are shared.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

# Deterministic cuBLAS needs this before the first cuBLAS handle is created.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lmsbench.harness import provenance as checkout_provenance
from lmsbench.harness import wait_pid, write_json
from lmsbench.lms_setup import deterministic, import_extension

from . import models
from .allocator import (
    ALLOC_CONF_NAMES,
    EXPANDABLE_KEY,
    block_bytes,
    expandable_in_conf,
    mapped_bytes,
    mapped_together,
    user_conf,
)
from .generator import Case, generate

MODES = (
    "reference",
    "capped",
    "capped-no-lms",
    "reference-no-cudnn",
    "capped-no-cudnn",
    "capped-no-recompute",
)
# Faults a test can inject to check how the runner classifies what happens to a worker.
FAULTS = (
    "segv",
    "abort",
    "exit",
    "hang",
    "exception",
    "oom",
    "cuda-error",
    "fork-broken",
    "perturb",
    "perturb-buffer",
    "fake-pageout",
)

EXIT_OK = 0
EXIT_OOM = 3
EXIT_EXCEPTION = 4

CUDA_ERROR_MARKERS = (
    "CUDA error",
    "illegal memory access",
    "misaligned address",
    "device-side assert",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUBLAS_STATUS_INTERNAL_ERROR",
    "CUDNN_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR",
    "unspecified launch failure",
)
OOM_MARKERS = (
    "CUDA out of memory",
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
)


def uses_lms(mode: str) -> bool:
    """Whether a mode enables Large Model Support."""
    return mode in ("capped", "capped-no-cudnn", "capped-no-recompute")


def is_capped(mode: str) -> bool:
    """Whether a mode caps device memory."""
    return mode.startswith("capped")


def is_oom(error: BaseException) -> bool:
    """Whether an exception means the device ran out of memory."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(m in text for m in OOM_MARKERS)


def is_cuda_error(error: BaseException) -> bool:
    """Whether an exception reports a failed kernel or a broken CUDA context (not an OOM)."""
    return not is_oom(error) and any(m in str(error) for m in CUDA_ERROR_MARKERS)


def ensure_lms_api() -> str:
    """Makes the ``torch.cuda`` LMS API available, as ``tests/regression/conftest.py`` does.

    Returns ``"patched"`` when PyTorch has LMS built in, else imports the drop-in extension
    (``torch_lms``, from ``PYTHONPATH`` or this checkout's ``extension/``) and returns
    ``"extension"``.
    """
    if hasattr(torch.cuda, "set_enabled_lms"):
        return "patched"
    import_extension()
    return "extension"


def param_hash(tensors: list[torch.Tensor]) -> str:
    """SHA-256 over the bytes of each tensor in order (dtype and shape included)."""
    digest = hashlib.sha256()
    for t in tensors:
        host = t.detach().to("cpu", copy=True).contiguous().reshape(-1)
        digest.update(f"{host.dtype}{tuple(t.shape)}".encode())
        nbytes = host.numel() * host.element_size()
        if nbytes:
            buffer = (ctypes.c_char * nbytes).from_address(host.data_ptr())
            digest.update(memoryview(buffer))
        del host
    return digest.hexdigest()


def op_working_set(
    inputs: dict[int, int], outputs: dict[int, int], transient: int | None, expandable: bool
) -> tuple[int, int]:
    """The working set of one operator call: (tensor bytes, bytes as the allocator maps them).

    ``inputs`` and ``outputs`` map each distinct storage (by address) to its size;
    ``transient`` is the most the call had allocated at once (CUDA; None elsewhere).

    Tensor bytes: the sizes of the storages of its inputs and outputs, or its inputs plus
    ``transient``, whichever is larger. Mapped: ``mapped_together`` of those storages, or,
    with ``transient``, of each input, each output the call allocated and the rest of
    ``transient`` (its temporaries, such as a workspace) as one allocation, whichever is
    larger: the least the allocator maps for them.
    """
    everything = dict(inputs)
    everything.update(outputs)
    raw = sum(everything.values())
    mapped = mapped_together(everything.values(), expandable)
    if transient is not None:
        # Inputs (in-place ones too) were there before; new outputs are in the peak.
        raw = max(raw, sum(inputs.values()) + transient)
        fresh = [n for ptr, n in outputs.items() if ptr not in inputs]
        rest = max(0, transient - sum(block_bytes(n) for n in fresh))
        mapped = max(mapped, mapped_together([*inputs.values(), *fresh, rest], expandable))
    return raw, mapped


def storages_of(tree: Any, device_type: str) -> dict[int, int]:
    """The storages of the tensors on ``device_type`` in ``tree`` (an operator's arguments
    or results): data pointer to bytes, each storage once."""
    found: dict[int, int] = {}
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device.type == device_type:
            try:
                storage = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            found[storage.data_ptr()] = storage.nbytes()
    return found


class WorkingSetMode(TorchDispatchMode):
    """Records the largest working set of one operator on one device type.

    The working set of an operator call is given by ``op_working_set`` (its inputs and
    outputs, or on CUDA its inputs plus the most it had allocated at once), in tensor bytes
    and as mapped by the allocator with ``expandable`` segments or without; the largest of
    each is kept with its operator, as is the largest single output storage (the largest
    allocation an operator makes for its result).
    """

    def __init__(self, device_type: str, expandable: bool = False) -> None:
        super().__init__()
        self.device_type = device_type
        self.expandable = expandable
        self.max_bytes = 0
        self.max_op = ""
        self.max_mapped_bytes = 0
        self.max_mapped_op = ""
        self.max_alloc_bytes = 0
        self.max_alloc_op = ""
        self.max_inputs_bytes = 0
        self.max_outputs_bytes = 0
        self.max_transient_bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cuda = self.device_type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        outputs = storages_of(out, self.device_type)
        inputs = storages_of((args, kwargs), self.device_type)
        transient = torch.cuda.max_memory_allocated() - before if cuda else None
        total, mapped = op_working_set(inputs, outputs, transient, self.expandable)
        if total > self.max_bytes:
            self.max_bytes, self.max_op = total, str(func)
            self.max_inputs_bytes = sum(inputs.values())
            self.max_outputs_bytes = sum(outputs.values())
            self.max_transient_bytes = transient or 0
        if mapped > self.max_mapped_bytes:
            self.max_mapped_bytes, self.max_mapped_op = mapped, str(func)
        if outputs:
            largest = max(outputs.values())
            if largest > self.max_alloc_bytes:
                self.max_alloc_bytes, self.max_alloc_op = largest, str(func)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lms_stats() -> dict[str, Any]:
    """LMS counters and gauge peaks, from ``torch.cuda.lms_stats()`` or ``memory_stats()``."""
    if hasattr(torch.cuda, "lms_stats"):
        raw = dict(torch.cuda.lms_stats())
    else:
        raw = {
            k[len("lms.") :]: v
            for k, v in torch.cuda.memory_stats().items()
            if k.startswith("lms.")
        }
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out[f"{key}_peak"] = value.get("peak")
        elif isinstance(value, (int, float)):
            out[key] = value
    return out


def _inject(fault: str | None, where: str) -> None:
    """Fault injection for the runner's tests: misbehaves the way a broken run would."""
    if fault is None:
        return
    if where == "start":
        if fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "abort":
            os.abort()
        if fault == "exit":
            os._exit(9)
        if fault == "hang":
            time.sleep(3600)
        if fault == "exception":
            raise ValueError("injected failure")
        if fault == "oom":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 1.00 GiB (injected)"
            )
        if fault == "fork-broken":
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess (injected)")
        if fault == "cuda-error":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def train(case: Case, mode: str, device: torch.device, result: dict[str, Any], **opts: Any) -> None:
    """Trains ``case`` and fills ``result`` (also on failure: what was measured so far)."""
    measure_bound = bool(opts.get("measure_bound"))
    fault = opts.get("fault")
    torch.manual_seed(case.seed)
    with torch.device(device):  # initialized where it trains: no host-side init, no copy
        model = models.build_model(case)
    model.train()
    optimizer = models.build_optimizer(case, list(model.parameters()))
    dtype = models.autocast_dtype(case)
    scaler = None
    if case.amp == "fp16":
        scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        result["static_setup_bytes"] = torch.cuda.memory_allocated(device)

    def step(i: int) -> float:
        inputs, targets = models.make_batch(case, i, device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = models.loss_fn(case, model(inputs), targets)
        del inputs
        print(f"stress: iteration {i} backward", file=sys.stderr, flush=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            print(f"stress: iteration {i} optimizer", file=sys.stderr, flush=True)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            print(f"stress: iteration {i} optimizer", file=sys.stderr, flush=True)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    losses: list[float] = result["losses"]
    seconds: list[float] = result["iteration_seconds"]
    for i in range(case.iterations):
        print(f"stress: iteration {i} forward", file=sys.stderr, flush=True)
        start = time.perf_counter()
        losses.append(step(i))  # float() synchronizes with the device
        _sync(device)
        seconds.append(round(time.perf_counter() - start, 4))
    if fault == "perturb":
        with torch.no_grad():
            next(model.parameters()).view(-1)[0].add_(1.0)
    if fault == "perturb-buffer":
        with torch.no_grad():
            next(b for b in model.buffers() if b.is_floating_point()).view(-1)[0].add_(1.0)
    result["param_hash"] = param_hash(list(model.parameters()))
    result["buffer_hash"] = param_hash(list(model.buffers()))
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    _sync(device)
    if device.type == "cuda":
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    if device.type == "cuda":
        # What the process keeps allocated besides the model and its optimizer: workspaces
        # that libraries (cuBLAS, cuDNN) allocate through the caching allocator on first
        # use, inside an operator, and keep. They occupy the cap in every run but are in
        # no operator's working set once allocated, so the bound adds them.
        state = [
            t
            for group in optimizer.state.values()
            for t in group.values()
            if isinstance(t, torch.Tensor) and t.device.type == "cuda"
        ]
        model_bytes = sum(
            t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers(), *state)
        )
        result["library_bytes"] = max(0, torch.cuda.memory_allocated(device) - model_bytes)
    if measure_bound:
        # One more iteration, after the hash: the dispatch mode must not touch measured runs.
        # The mapped bound uses the allocator setting this process runs with (the runner
        # gives the references the capped run's).
        allocator = allocator_state(device)
        expandable = bool(allocator["expandable_segments"])
        mode_ = WorkingSetMode(device.type, expandable)
        with mode_:
            step(case.iterations)
        _sync(device)
        library = int(result.get("library_bytes", 0))
        result["bound"] = {
            "bytes": mode_.max_bytes,
            "op": mode_.max_op,
            "mapped_bytes": mode_.max_mapped_bytes,
            "mapped_op": mode_.max_mapped_op,
            "expandable_segments": allocator["expandable_segments"],
            "allocator_source": allocator["source"],
            "library_mapped_bytes": mapped_bytes(library, expandable),
            "largest_alloc_bytes": mode_.max_alloc_bytes,
            "largest_alloc_op": mode_.max_alloc_op,
            "ops_per_iteration": mode_.ops,
            "inputs_bytes": mode_.max_inputs_bytes,
            "outputs_bytes": mode_.max_outputs_bytes,
            "transient_bytes": mode_.max_transient_bytes,
            "library_bytes": result.get("library_bytes", 0),
        }


def apply_alloc_conf(conf: str | None) -> None:
    """Makes ``conf`` this process's allocator setting; call it before CUDA is initialized.

    Sets both variables the allocator reads, and hands the ``expandable_segments`` entry to
    the allocator's setter as well (the setting takes effect even where the allocator had
    read its environment before). LMS leaves a setting made there alone.
    """
    if conf is None:
        return
    for name in ALLOC_CONF_NAMES:
        os.environ[name] = conf
    expandable = expandable_in_conf(conf)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None and torch.cuda.is_available():
        setter = torch.cuda.memory._set_allocator_settings
    if expandable is not None and setter is not None:
        setter(f"{EXPANDABLE_KEY}:{expandable}")


def allocator_state(device: torch.device) -> dict[str, Any]:
    """The allocator setting this process runs with.

    ``expandable_segments``: from the ``is_expandable`` of the device's segments when CUDA
    has any (None where they are of both kinds), else from the allocator's settings string,
    else from the environment, else False (the allocator's default); ``source`` says which.
    """
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        settings = str(getter()) if getter is not None else ""
    except RuntimeError:
        settings = ""
    state: dict[str, Any] = {
        "settings": settings,
        "conf": {name: os.environ[name] for name in ALLOC_CONF_NAMES if name in os.environ},
    }
    if device.type == "cuda" and torch.cuda.is_initialized():
        index = device.index if device.index is not None else torch.cuda.current_device()
        kinds = {
            bool(seg.get("is_expandable"))
            for seg in torch.cuda.memory_snapshot()
            if seg.get("device") in (None, index)
        }
        if kinds:
            state["expandable_segments"] = kinds.pop() if len(kinds) == 1 else None
            state["source"] = "segments" if state["expandable_segments"] is not None else "mixed"
            return state
    for source, text in (("allocator settings", settings), ("environment", user_conf(os.environ))):
        value = expandable_in_conf(text)
        if value is not None:
            state.update(expandable_segments=value, source=source)
            return state
    state.update(expandable_segments=False, source="default")
    return state


# The page an expandable segment of the large pool maps at a time (the caching allocator's
# kLargeBuffer).
LARGE_PAGE_BYTES = 20 << 20


def page_use(address: int, blocks: list[tuple[int, bool]], page: int) -> dict[str, int]:
    """How the pages of a mapped range starting at ``address`` (its blocks in address order:
    size, allocated) are used: pages wholly used, partly used and free, and the free bytes of
    the partly used ones, which the allocator keeps mapped for the tensors in them."""
    used: dict[int, int] = {}
    at = address
    for size, allocated in blocks:
        end = at + size
        while allocated and at < end:
            index = (at - address) // page
            upto = min(end, address + (index + 1) * page)
            used[index] = used.get(index, 0) + upto - at
            at = upto
        at = end
    pages = -(-(at - address) // page)
    partly = [index for index, n in used.items() if n < page]
    return {
        "pages": pages,
        "pages_full": sum(1 for n in used.values() if n >= page),
        "pages_partly_used": len(partly),
        "pages_free": pages - len(used),
        "partly_used_free_bytes": sum(page - used[index] for index in partly),
    }


def memory_picture(device: torch.device) -> dict[str, Any]:
    """The caching allocator at an out-of-memory error: allocated and reserved bytes, and
    its segments (stream, pool, mapped size, bytes allocated, the largest free block, and for
    the large pool's expandable segments how its 20 MiB pages are used, with the block
    layout): what tells a working set that does not fit from one that fits but not in one
    piece, and where the pieces lie."""
    try:
        picture: dict[str, Any] = {
            "allocated_bytes": torch.cuda.memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device),
        }
        segments = []
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") not in (None, device.index or 0):
                continue
            blocks = seg.get("blocks", [])
            free = [b["size"] for b in blocks if b.get("state") == "inactive"]
            entry = {
                "stream": seg.get("stream"),
                "pool": seg.get("segment_type"),
                "expandable": seg.get("is_expandable"),
                "total_bytes": seg.get("total_size"),
                "allocated_bytes": seg.get("allocated_size"),
                "blocks": len(blocks),
                "free_blocks": len(free),
                "largest_free_bytes": max(free, default=0),
            }
            if seg.get("is_expandable") and seg.get("segment_type") == "large":
                layout = [(int(b["size"]), b.get("state") != "inactive") for b in blocks]
                entry["address"] = seg.get("address")
                entry["layout"] = [[size, int(allocated)] for size, allocated in layout]
                entry.update(page_use(int(seg.get("address", 0)), layout, LARGE_PAGE_BYTES))
            segments.append(entry)
        picture["segments"] = segments[:40]
        picture["segment_count"] = len(segments)
        picture["partly_used_free_bytes"] = sum(
            int(s.get("partly_used_free_bytes", 0)) for s in segments
        )
        return picture
    except Exception as exc:  # a broken CUDA context: say so, keep the result
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def environment(
    device: torch.device, lms_backend: str | None, provenance: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Versions and device of this run, and the engine it ran (commit, dirty flag, sources
    hash, driver), so that a run's JSON names its engine also where no runner merges it into a
    record: ``provenance`` as the runner found it once for all its runs (a request's
    ``provenance``), else ``harness.provenance()`` of this checkout (a replay of one run with
    ``--request`` or ``--seed``)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_type": device.type,
        "lms_backend": lms_backend,
        "host": platform.node(),
    }
    for name in ("PYTORCH_LMS_CONF", *ALLOC_CONF_NAMES, "CUBLAS_WORKSPACE_CONFIG"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    env["device"] = device.type
    env["cudnn"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device"] = props.name
        env["device_memory_bytes"] = props.total_memory
        env["cudnn"] = torch.backends.cudnn.version()
    env.update(provenance if provenance is not None else checkout_provenance())
    return env


def run(request: dict[str, Any]) -> int:
    """Runs one request (see ``main``), writes its JSON result, returns the exit status."""
    case = Case.from_dict(request["case"])
    mode = request["mode"]
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    device = torch.device(request.get("device", "cuda"))
    cap_bytes = request.get("cap_bytes")
    result_path = Path(request["result"])
    started = time.perf_counter()
    result: dict[str, Any] = {
        "seed": case.seed,
        "mode": mode,
        "device_type": device.type,
        "cap_bytes": cap_bytes,
        "status": "running",
        "losses": [],
        "iteration_seconds": [],
        "warnings": [],
    }
    seen_warnings: list[str] = result["warnings"]
    show = warnings.showwarning

    def record_warning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        text = f"{category.__name__}: {message}"
        if len(seen_warnings) < 20 and text[:300] not in seen_warnings:
            seen_warnings.append(text[:300])
        show(message, category, *args, **kwargs)

    warnings.showwarning = record_warning
    status = EXIT_OK
    lms_backend: str | None = None
    last_failure: dict[str, Any] = {}

    def observe_failure(device_index: int, request_bytes: int, *_: Any) -> None:
        # Called by the caching allocator when an allocation fails, before it raises
        # (LMS may still page out and retry): the last call describes the final failure.
        last_failure.clear()
        last_failure.update(memory_picture(device))
        last_failure["request_bytes"] = int(request_bytes)

    try:
        # Before anything initializes CUDA (the fork server never does).
        apply_alloc_conf(request.get("alloc_conf"))
        _inject(request.get("fault"), "start")
        if device.type == "cuda":
            if uses_lms(mode):
                lms_backend = ensure_lms_api()
                torch.cuda.set_enabled_lms(True)
                if hasattr(torch.cuda, "set_recompute_lms"):
                    if mode == "capped-no-recompute":
                        torch.cuda.set_recompute_lms(False)
                    # Recompute may be on through PYTORCH_LMS_CONF: the triage reads it.
                    result["recompute"] = bool(torch.cuda.get_recompute_lms())
            if is_capped(mode):
                if not cap_bytes:
                    raise ValueError(f"mode {mode} needs --cap-bytes")
                total = torch.cuda.get_device_properties(device).total_memory
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), index)
                result["cap_fraction_of_device"] = cap_bytes / total
                attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
                if attach is not None:
                    attach(observe_failure)
        elif uses_lms(mode) or is_capped(mode):
            result["note"] = "no memory cap and no LMS on the CPU: a test-only run"
        deterministic(cudnn_enabled="no-cudnn" not in mode)
        with warnings.catch_warnings():
            warnings.filterwarnings("default")
            train(
                case,
                mode,
                device,
                result,
                measure_bound=bool(request.get("measure_bound")),
                fault=request.get("fault"),
            )
        result["status"] = "ok"
    except Exception as exc:
        result["status"] = "exception"
        result["exception"] = {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc)[:4000],
            "is_oom": is_oom(exc),
            "is_cuda_error": is_cuda_error(exc),
            "traceback": traceback.format_exc()[-3000:],
        }
        traceback.print_exc()
        status = EXIT_OOM if is_oom(exc) else EXIT_EXCEPTION
        if status == EXIT_OOM and device.type == "cuda":
            # The allocator as it was when its last allocation failed (the observer), and
            # after the exception freed what the failing operator held.
            result["memory_at_oom"] = dict(last_failure) or memory_picture(device)
            result["memory_after_oom"] = memory_picture(device)
    finally:
        warnings.showwarning = show
    if device.type == "cuda" and lms_backend is not None:
        try:
            result["lms"] = _lms_stats()
            result["lms_limit_bytes"] = int(torch.cuda.get_limit_lms())
        except Exception as exc:  # a broken CUDA context: keep the result of the run
            result["lms_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if request.get("fault") == "fake-pageout":
        result["lms"] = {"pageout_count": 1, "pageout_bytes": 1 << 20}  # the runner's tests
    try:
        result["allocator"] = allocator_state(device)
    except Exception as exc:  # a broken CUDA context: keep the result of the run
        result["allocator"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    times = result["iteration_seconds"]
    steady = times[1:] if len(times) > 1 else times
    result["s_per_iter"] = round(sum(steady) / len(steady), 4) if steady else None
    result["wall_s"] = round(time.perf_counter() - started, 3)
    try:
        result["env"] = environment(device, lms_backend, request.get("provenance"))
    except Exception as exc:
        result["env"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    result["case"] = case.to_dict()
    write_json(result_path, result)
    return status


def _child(request: dict[str, Any]) -> None:
    """In a forked child: a process group of its own (the server stops it whole at the time
    limit), output to the request's log file, run, exit without cleanup."""
    status = 70
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setpgid(0, 0)
        status = run(request)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _thread_count() -> int:
    """Threads of this process (forking is only safe with one); 1 where /proc is missing."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def serve() -> int:
    """The fork server: one JSON request per line on stdin, one JSON answer per line."""
    out = sys.stdout
    # Modules the optimizers import on first use (about a second): once, here. Nothing
    # here may initialize CUDA (the runner sets PYTORCH_NVML_BASED_CUDA_CHECK=1 so that an
    # availability check uses NVML), or no forked child could use it.
    try:
        import torch._dynamo
    except ImportError:
        pass
    ready = {
        "ready": True,
        "pid": os.getpid(),
        "torch": torch.__version__,
        "cuda_initialized": torch.cuda.is_initialized(),
        "threads": _thread_count(),
    }
    print(json.dumps(ready), file=out)
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("op") == "exit":
            break
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        try:
            os.setpgid(pid, pid)  # as the child does: whichever runs first
        except OSError:
            pass  # the child has its group already, or has ended
        run = wait_pid(pid, float(request.get("timeout_s", 300)))
        answer = {
            "returncode": run.returncode,
            "timed_out": run.timed_out,
            "wall_s": run.wall_s,
            "pid": pid,
        }
        print(json.dumps(answer), file=out)
        out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: one run in this process, or ``--serve``."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.regression.stress.worker",
        description="Train one LMS stress case in this process and write its JSON result.",
    )
    parser.add_argument("--serve", action="store_true", help="run as the runner's fork server")
    parser.add_argument("--request", type=Path, help="a JSON request file (what runner sends)")
    parser.add_argument("--seed", type=int, help="the case to run (see generator.generate)")
    parser.add_argument("--mode", choices=MODES, default="reference")
    parser.add_argument("--cap-bytes", type=int, help="memory cap of the capped modes")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for tests")
    parser.add_argument("--measure-bound", action="store_true", help="record the bound")
    parser.add_argument(
        "--alloc-conf",
        help="allocator setting of the run (PYTORCH_CUDA_ALLOC_CONF), e.g. "
        "expandable_segments:True (default: the environment's)",
    )
    parser.add_argument("--result", type=Path, help="where to write the JSON result")
    parser.add_argument("--fault", choices=FAULTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve()
    if args.request is not None:
        request = json.loads(args.request.read_text())
    else:
        if args.seed is None or args.result is None:
            parser.error("give --serve, --request FILE, or --seed S --result FILE")
        request = {
            "case": generate(args.seed).to_dict(),
            "mode": args.mode,
            "cap_bytes": args.cap_bytes,
            "device": args.device,
            "measure_bound": args.measure_bound,
            "alloc_conf": args.alloc_conf,
            "result": str(args.result),
            "fault": args.fault,
        }
    return run(request)


if __name__ == "__main__":
    sys.exit(main())
