"""The caching allocator's rounding and its ``expandable_segments`` setting (no torch needed).

PyTorch's CUDA caching allocator serves a request of at most 1 MiB from its small pool, in
blocks that are multiples of 512 bytes. A larger request comes from the large pool, whose
memory is mapped in whole segments: without expandable segments a large request's segment is
rounded up to a multiple of 2 MiB, with expandable segments the pool is mapped in pages of
20 MiB. :func:`mapped_bytes` charges one tensor that rounding; :func:`mapped_together` what
tensors held at once need at least, placed as compactly as the allocator can place them.
The stress suite's mapped bound (the largest working set of one operator, measured in the
reference run) is the latter, with the allocator setting that the capped run uses.

``expandable_segments`` is set in ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``), a
comma-separated list of ``key:value`` entries whose values may be bracketed lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# Requests of at most this many bytes come from the small pool.
SMALL_REQUEST_BYTES = 1 << 20
# The allocator's block granularity (kMinBlockSize).
BLOCK_BYTES = 512
# Large-pool segments without expandable segments are multiples of this (kRoundLarge).
LARGE_SEGMENT_ROUND_BYTES = 2 << 20
# Expandable segments map the large pool in pages of this size (kLargeBuffer).
EXPANDABLE_PAGE_BYTES = 20 << 20

# The variables the allocator reads its settings from; the worker sets both to one value.
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_KEY = "expandable_segments"


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def block_bytes(nbytes: int) -> int:
    """The allocator's block size for a request of ``nbytes`` (a multiple of 512 bytes)."""
    return _round_up(max(0, nbytes), BLOCK_BYTES)


def mapped_bytes(nbytes: int, expandable: bool) -> int:
    """The device memory the allocator maps for one tensor of ``nbytes``.

    Up to 1 MiB (small pool): rounded up to 512 bytes. Larger: rounded up to 2 MiB (the
    large pool's segments without expandable segments) or, with ``expandable``, to the
    20 MiB page of expandable segments. 0 for an empty tensor.
    """
    if nbytes <= 0:
        return 0
    if nbytes <= SMALL_REQUEST_BYTES:
        return _round_up(nbytes, BLOCK_BYTES)
    unit = EXPANDABLE_PAGE_BYTES if expandable else LARGE_SEGMENT_ROUND_BYTES
    return _round_up(nbytes, unit)


def mapped_together(sizes: Iterable[int], expandable: bool) -> int:
    """The least device memory the allocator maps for tensors of ``sizes`` held at once.

    Each tensor of at most 1 MiB in 512-byte blocks of the small pool. The larger ones:
    without expandable segments each in a segment of its own rounded up to 2 MiB; with
    them packed side by side in the large pool's 20 MiB pages, so that only the last page is
    partly used. This is the best placement there is: memory that a working set needs
    beyond it comes from where the allocator put the tensors, which the allocator and LMS
    decide, not from the working set itself.
    """
    small = 0
    large = 0
    for nbytes in sizes:
        if nbytes <= 0:
            continue
        if nbytes <= SMALL_REQUEST_BYTES:
            small += _round_up(nbytes, BLOCK_BYTES)
        elif expandable:
            large += block_bytes(nbytes)
        else:
            large += mapped_bytes(nbytes, expandable=False)
    if expandable:
        large = _round_up(large, EXPANDABLE_PAGE_BYTES)
    return small + large


def conf_entries(conf: str) -> list[str]:
    """The ``key:value`` entries of an allocator setting, split at commas outside brackets."""
    entries: list[str] = []
    depth = 0
    current = ""
    for char in conf:
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    entries.append(current)
    return [e.strip() for e in entries if e.strip()]


def expandable_in_conf(conf: str) -> bool | None:
    """The ``expandable_segments`` value an allocator setting gives (its last entry wins), or
    None where it gives none (or one that PyTorch would reject)."""
    found: bool | None = None
    for entry in conf_entries(conf):
        key, _, value = entry.partition(":")
        if key.strip() == EXPANDABLE_KEY:
            value = value.strip()
            found = True if value == "True" else False if value == "False" else None
    return found


def conf_with_expandable(conf: str, expandable: bool) -> str:
    """``conf`` with its ``expandable_segments`` entries replaced by one giving ``expandable``."""
    kept = [e for e in conf_entries(conf) if e.partition(":")[0].strip() != EXPANDABLE_KEY]
    return ",".join([*kept, f"{EXPANDABLE_KEY}:{expandable}"])


def user_conf(env: Mapping[str, str]) -> str:
    """The allocator setting of an environment: ``PYTORCH_CUDA_ALLOC_CONF``, else
    ``PYTORCH_ALLOC_CONF`` (the order in which the CUDA allocator reads them)."""
    for name in ALLOC_CONF_NAMES:
        value = env.get(name, "").strip()
        if value:
            return value
    return ""
