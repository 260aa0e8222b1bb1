"""LMS setup shared by the examples, the benchmarks and the tests: the torch.cuda LMS API, its
knobs, memory caps, deterministic runs, versions and provenance, and the option types of their
command lines.

The same code runs on a PyTorch built with the Large Model Support patch series (the API is
``torch.cuda.set_enabled_lms`` and friends) and on a stock CUDA wheel with the drop-in
extension: when ``torch.cuda`` lacks the API, :func:`ensure_lms_api` imports ``torch_lms``,
looking in this checkout's ``extension/`` folder too (where ``setup.py build_ext --inplace``
leaves it). Nothing here imports torch at module level, so argument handling and the pure
helpers work without it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
GiB = 1024 * MiB

REPO_ROOT = Path(__file__).resolve().parent.parent
EXTENSION_DIR = REPO_ROOT / "extension"

# Exit status of a probe subprocess whose training ran out of device memory.
EXIT_OOM = 3


class LmsUnavailable(RuntimeError):
    """Neither a patched PyTorch nor the torch_lms extension provides the LMS API."""


@dataclass(frozen=True)
class LmsSettings:
    """The LMS knobs of the examples, in the units of their command-line flags."""

    enabled: bool = False
    limit_mb: int | None = None  # None: the build's default limit
    size_mb: float | None = None  # None: the build's default threshold (1 MiB)
    prefetch: int = 0
    speculative_mb: int = 0
    schedule: bool = True  # the learned swap schedule (builds that have it)
    packing: bool = True  # packing tight operators (builds that have it: set_packing_lms)
    # Recipes for residual sums (builds that have them: set_residual_recipes_lms), off by
    # default as in the engine.
    residual_recipes: bool = False

    def validate(self) -> None:
        if self.limit_mb is not None and self.limit_mb <= 0:
            raise ValueError(f"the LMS limit must be positive, got {self.limit_mb} MiB")
        if self.size_mb is not None and self.size_mb < 0:
            raise ValueError(f"the LMS size threshold must be >= 0, got {self.size_mb} MiB")
        if self.prefetch < 0:
            raise ValueError(f"the prefetch depth must be >= 0, got {self.prefetch}")
        if self.speculative_mb < 0:
            raise ValueError(f"the speculative margin must be >= 0, got {self.speculative_mb}")


def ensure_lms_api() -> str:
    """Makes ``torch.cuda.set_enabled_lms`` and friends available.

    Returns:
        ``"patched"`` when PyTorch has LMS built in, ``"extension"`` when the drop-in
        extension provides it.

    Raises:
        LmsUnavailable: with the reason, when neither does.
    """
    import torch

    if hasattr(torch.cuda, "set_enabled_lms"):
        return "patched" if hasattr(torch._C, "_cuda_lms_setEnabled") else "extension"
    if not torch.cuda.is_available():
        raise LmsUnavailable("no CUDA device: Large Model Support needs a GPU")
    try:
        import_extension()
    except ImportError as error:
        raise LmsUnavailable(_unavailable_message(error)) from error
    return "extension"


def import_extension() -> None:
    """Imports the drop-in extension ``torch_lms`` (which installs the ``torch.cuda`` LMS API)
    from the Python path or, where it is not there, from this checkout's ``extension/``
    folder, where ``setup.py build_ext --inplace`` leaves it: that folder then goes on
    ``sys.path``, as the extension's own imports expect of an installed package.

    Raises:
        ImportError: neither place has an extension that imports.
    """
    try:
        importlib.import_module("torch_lms")
    except ImportError:
        if str(EXTENSION_DIR) in sys.path or not (EXTENSION_DIR / "torch_lms").is_dir():
            raise
        sys.path.insert(0, str(EXTENSION_DIR))
        importlib.import_module("torch_lms")


def _unavailable_message(error: BaseException) -> str:
    return (
        "this PyTorch has no Large Model Support and the torch_lms extension cannot be "
        f"imported ({error}); build it with `cd extension && python setup.py build_ext "
        "--inplace` (or `pip install --no-build-isolation ./extension`)"
    )


# The LMS keys of a configuration string that apply_lms sets itself, and where the
# configuration comes from (the patched build reads the allocator's, the drop-in its own).
APPLIED_CONF_KEYS = (
    "lms",
    "lms_limit_mb",
    "lms_size_mb",
    "lms_prefetch",
    "lms_speculative_mb",
    "lms_schedule",
    "lms_pack",
    "lms_residual_recipes",
)
CONF_VARIABLES = ("PYTORCH_LMS_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def overridden_conf_keys(environ: dict[str, str] | None = None) -> list[str]:
    """The LMS settings the environment's configuration strings give (``VARIABLE: key``)
    that :func:`apply_lms` sets itself, so that the environment's values do not hold."""
    environ = dict(os.environ) if environ is None else environ
    found = []
    for variable in CONF_VARIABLES:
        for item in environ.get(variable, "").split(","):
            key = item.split(":", 1)[0].strip()
            if key in APPLIED_CONF_KEYS:
                found.append(f"{variable}: {key}")
    return found


def apply_lms(settings: LmsSettings) -> None:
    """Sets every LMS knob, then enables or disables LMS.

    Call it before the model and its data are created: only storages created (patched build)
    or first used (extension) while LMS is enabled are paged out. The knobs it sets override
    the same keys of ``PYTORCH_LMS_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``: a warning names
    those (set them with the script's flags or methods instead).
    """
    import warnings

    import torch

    settings.validate()
    overridden = overridden_conf_keys()
    if overridden:
        warnings.warn(
            f"these LMS settings of the environment do not apply, the script sets them "
            f"itself: {', '.join(overridden)}; use its flags or methods instead (--help; "
            f"packing off, the schedule off, recompute on and residual recipes on are "
            f"compare.py's methods lms_nopack, lms_reactive, lms_hybrid and lms_residual)",
            stacklevel=2,
        )
    torch.cuda.set_limit_lms(0 if settings.limit_mb is None else int(settings.limit_mb * MiB))
    torch.cuda.set_size_lms(MiB if settings.size_mb is None else int(settings.size_mb * MiB))
    torch.cuda.set_prefetch_lms(settings.prefetch)
    torch.cuda.set_speculative_lms(int(settings.speculative_mb * MiB))
    if hasattr(torch.cuda, "set_schedule_lms"):
        torch.cuda.set_schedule_lms(settings.schedule)
        torch.cuda.reset_lms_schedule()  # each run learns its own iteration
    if hasattr(torch.cuda, "set_packing_lms"):
        torch.cuda.set_packing_lms(settings.packing)
    elif not settings.packing:
        raise LmsUnavailable(
            "packing cannot be turned off: this LMS (torch_lms extension or patched build) has "
            "no torch.cuda.set_packing_lms, and builds without it do not pack; leave the "
            "setting on (or lms_nopack out of compare.py's --methods)"
        )
    if hasattr(torch.cuda, "set_residual_recipes_lms"):
        torch.cuda.set_residual_recipes_lms(settings.residual_recipes)
    elif settings.residual_recipes:
        raise LmsUnavailable(
            "residual recipes cannot be turned on: this LMS (torch_lms extension or patched "
            "build) has no torch.cuda.set_residual_recipes_lms; build it from a newer engine, "
            "or leave lms_residual out of compare.py's --methods"
        )
    torch.cuda.set_enabled_lms(settings.enabled)
    torch.cuda.reset_accumulated_lms_stats()
    torch.cuda.reset_peak_lms_stats()


def deterministic(cudnn_enabled: bool | None = None) -> None:
    """Settings under which seeded runs repeat bit for bit: deterministic algorithms (a
    warning, not an error, where an operator has none), cuDNN deterministic and without
    benchmarking, no TF32. ``cudnn_enabled`` turns cuDNN on or off too (None: as it is)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    if cudnn_enabled is not None:
        torch.backends.cudnn.enabled = cudnn_enabled
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def lms_available() -> bool:
    import torch

    return hasattr(torch.cuda, "lms_stats")


def lms_stats() -> dict[str, Any] | None:
    """``torch.cuda.lms_stats()`` of the current device, or None without LMS."""
    import torch

    if not lms_available() or not torch.cuda.is_initialized():
        return None
    return dict(torch.cuda.lms_stats())


def lms_recompute_operators() -> dict[str, dict[str, int]]:
    """``torch.cuda.lms_recompute_operators()`` of the current device (drops and recomputes
    per operator), or an empty dict without LMS or where this LMS has no such counts."""
    import torch

    counts = getattr(torch.cuda, "lms_recompute_operators", None)
    if counts is None or not lms_available() or not torch.cuda.is_initialized():
        return {}
    return {str(name): dict(entry) for name, entry in counts().items()}


def release_pinned_host_cache() -> None:
    """Returns the pinned host memory that PyTorch's caching host allocator keeps cached
    (``pin_memory=True`` tensors that died) to the system, where this PyTorch can."""
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()


def settle() -> None:
    """Waits for the device, frees what died and returns cached device (and LMS host) memory."""
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()


def cap_fraction(cap_bytes: int, total_bytes: int) -> float:
    """The ``set_per_process_memory_fraction`` value that caps the allocator at ``cap_bytes``."""
    if cap_bytes <= 0:
        raise ValueError(f"the memory cap must be positive, got {cap_bytes} bytes")
    if cap_bytes > total_bytes:
        raise ValueError(
            f"the memory cap ({cap_bytes / GiB:.2f} GiB) is above the device's memory "
            f"({total_bytes / GiB:.2f} GiB)"
        )
    return cap_bytes / total_bytes


@contextlib.contextmanager
def memory_cap(cap_bytes: int | None) -> Iterator[None]:
    """Caps the caching allocator of the current device at ``cap_bytes`` (None: no cap)."""
    import torch

    if cap_bytes is None:
        yield
        return
    settle()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_fraction(cap_bytes, total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def is_oom(error: BaseException) -> bool:
    """Whether an exception means the device ran out of memory (PyTorch's, cuBLAS', cuDNN's)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text
        for marker in (
            "CUDA out of memory",
            "out of memory",
            "CUBLAS_STATUS_ALLOC_FAILED",
            "CUDNN_STATUS_ALLOC_FAILED",
            "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
        )
    )


def utc_now() -> str:
    """Now, in UTC, to the second (ISO 8601): the date a record gives."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_stamp() -> dict[str, Any]:
    """When and where a run ran: the date (:func:`utc_now`), the host and the Python version."""
    import platform

    return {"date": utc_now(), "host": platform.node(), "python": platform.python_version()}


def versions(device: bool = True) -> dict[str, Any]:
    """Date, host, Python, torch and CUDA versions and, with ``device`` and a GPU, the
    device's name and memory: what every result file records."""
    import torch

    env = run_stamp()
    env.update(torch=torch.__version__, cuda=torch.version.cuda)
    if device and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["device"] = props.name
        env["device_memory_bytes"] = props.total_memory
    return env


# Untracked files under these folders (results a run writes, or is about to commit) do not
# make the checkout dirty for provenance().
PROVENANCE_UNTRACKED_OK = ("benchmarks/results/", "out/")
UNKNOWN = "unknown"


def porcelain_dirty(porcelain: str, untracked_ok: Sequence[str] = PROVENANCE_UNTRACKED_OK) -> bool:
    """Whether ``git status --porcelain`` output shows a change: any tracked file changed, or
    an untracked file outside the ``untracked_ok`` folders."""
    for line in porcelain.splitlines():
        if not line.strip():
            continue
        path = line[3:].strip().strip('"')
        if line.startswith("?? ") and any(path.startswith(ok) for ok in untracked_ok):
            continue
        return True
    return False


def _run_text(argv: Sequence[str], timeout_s: float = 20.0) -> str | None:
    """The standard output of ``argv``, or None where it cannot run or fails."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def provenance(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """What the results of this checkout were measured with: the engine commit (``git
    rev-parse HEAD`` of ``repo``), whether the checkout had changes (``engine_dirty``; untracked
    files under PROVENANCE_UNTRACKED_OK do not count) and the NVIDIA driver version
    (nvidia-smi). ``LMS_ENGINE_COMMIT`` (and ``LMS_ENGINE_DIRTY``: 1 or 0) in the environment
    override git, for a copy of the checkout whose .git is not the sender's. The hash of the
    engine's sources (``engine_sources_sha256``) is recorded either way. Each is "unknown"
    where it cannot be found (no git, not a checkout, no nvidia-smi); never raises."""
    git = ["git", "-c", "safe.directory=*", "-C", str(repo)]
    given = os.environ.get("LMS_ENGINE_COMMIT", "").strip()
    if given:
        # A copy of the checkout (a GPU host the tree was sent to) may carry a stale .git:
        # the sender says which commit it sent, and whether its tree had changes.
        commit = given
        dirty: bool | str = os.environ.get("LMS_ENGINE_DIRTY", UNKNOWN).strip().lower() in (
            "1",
            "true",
            "yes",
        )
        if "LMS_ENGINE_DIRTY" not in os.environ:
            dirty = UNKNOWN
    else:
        head = _run_text([*git, "rev-parse", "HEAD"])
        commit = head.strip() if head and head.strip() else UNKNOWN
        status = _run_text([*git, "status", "--porcelain"]) if commit != UNKNOWN else None
        dirty = UNKNOWN if status is None else porcelain_dirty(status)
    smi = _run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    drivers = [line.strip() for line in (smi or "").splitlines() if line.strip()]
    return {
        "engine_commit": commit,
        "engine_dirty": dirty,
        "engine_sources_sha256": engine_sources_sha256(repo),
        "driver": drivers[0] if drivers else UNKNOWN,
    }


def engine_sources_sha256(repo: Path = REPO_ROOT) -> str:
    """One hash of every file under ``engine/`` (path and contents, in path order): names the
    engine that ran whatever git says, so a result can be matched to a commit by hashing
    that commit's ``engine/``. "unknown" where the folder is missing."""
    root = repo / "engine"
    if not root.is_dir():
        return UNKNOWN
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> dict[str, Any]:
    """Device, versions, LMS backend and provenance (engine commit, dirty flag, driver), for
    result files."""
    import torch

    env = versions()
    env.update(provenance())
    env["pytorch_lms_conf"] = os.environ.get("PYTORCH_LMS_CONF")
    if torch.cuda.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = None
    try:
        env["lms_backend"] = ensure_lms_api()
    except LmsUnavailable as exc:
        env["lms_backend"] = f"unavailable: {exc}"
    return env


# argparse value types shared by the example and benchmark CLIs.
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def add_lms_tuning_options(
    parser: argparse._ActionsContainer,
    *,
    speculative: bool = True,
    old_names: bool = False,
) -> None:
    """The LMS settings every example and benchmark script takes, declared once:
    ``--size-mb`` (``args.size_mb``, None: the build's threshold), ``--prefetch``
    (``args.prefetch``) and, with ``speculative``, ``--speculative-mb``
    (``args.speculative_mb``). ``old_names`` also accepts ``--lms-size-mb`` and
    ``--lms-prefetch``, the spellings benchmarks/compile_peers.py used first."""
    size = ["--size-mb"] + (["--lms-size-mb"] if old_names else [])
    prefetch = ["--prefetch"] + (["--lms-prefetch"] if old_names else [])
    parser.add_argument(
        *size,
        dest="size_mb",
        type=nonneg_float,
        default=None,
        help="smallest storage LMS pages out, MiB (unset: the build's, 1 MiB)",
    )
    parser.add_argument(
        *prefetch, dest="prefetch", type=nonneg_int, default=0, help="LMS prefetch depth"
    )
    if speculative:
        parser.add_argument(
            "--speculative-mb",
            type=nonneg_int,
            default=0,
            help="LMS speculative page-out margin, MiB",
        )


def add_limit_share_option(parser: argparse._ActionsContainer, default: float | None) -> None:
    """``--lms-limit-frac`` (``args.lms_limit_frac``): the LMS limit as a share of the memory
    cap a benchmark sets; None sets no limit, as a user would run (under a cap, LMS keeps 5% of
    it free for the allocator's fragmentation)."""
    parser.add_argument(
        "--lms-limit-frac",
        type=fraction,
        default=default,
        help="LMS limit as a share of the cap (unset: no limit, as a user would run; under a "
        "cap, LMS keeps 5%% of it free for the allocator's fragmentation)",
    )
