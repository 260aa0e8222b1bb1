r"""Page-in hints for graphs compiled with ``torch.compile`` under Large Model Support (LMS).

A compiled graph uses its inputs in an order fixed when it is compiled. The inputs of a
backward graph are mostly the activations that the forward saved, the bulk of what LMS pages
out to host memory. This module gives Inductor a post-grad pass that inserts calls to the
operator ``lms::page_in_ahead`` into the graph, each naming the graph inputs used next,
soonest first. While the compiled code runs, each call hands the CUDA tensors it names to the
LMS engine, which pages them in on its host-to-device stream ahead of their use instead of on
demand when the operator that reads them starts.

The pass is installed into ``torch._inductor.config.post_grad_custom_post_pass`` by
:func:`install` when Inductor's configuration is first imported. It inserts hints only when
LMS is enabled and its graph prefetch is on while a graph is compiled; otherwise it leaves the
graph unchanged. Its cache identifier (:meth:`PageInAheadPass.uuid`) carries both settings,
so Inductor's FX graph cache never serves a graph compiled with hints to a process without
them, nor the reverse.

The module imports nothing of Inductor when it is imported itself, so that it imports on a
PyTorch without Inductor.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

__all__ = [
    "PAGE_IN_AHEAD_WINDOW",
    "PageInAheadPass",
    "insert_page_in_hints",
    "install",
    "page_in_ahead_pass",
    "register_op",
]

# How many graph inputs one hint names at most. The engine pages in what a hint names in the
# order given, so a larger window starts copies earlier at the price of host-to-device traffic
# for tensors that are still far from their use (and of device memory while they wait).
PAGE_IN_AHEAD_WINDOW = 16

_NAMESPACE = "lms"
_OP_NAME = "page_in_ahead"
# No output and no alias annotation: the operator reads nothing of its tensors on the device,
# it only names them. The LMS operator-boundary pinning skips operators of the "lms::"
# namespace, so passing a tensor here does not make it resident.
_SCHEMA = f"{_OP_NAME}(Tensor[] tensors) -> ()"

# The torch.library.Library that holds the operator's registrations; they are removed when
# it is garbage collected, so it lives as long as the module.
_library: Any = None


def _lms_api() -> ModuleType:
    """The LMS API module beside this one (``torch.cuda.lms``, or ``torch_lms.lms`` in the
    drop-in extension)."""
    package = __name__.rpartition(".")[0] or "torch.cuda"
    return importlib.import_module(f"{package}.lms")


def _lms_bindings() -> Any | None:
    """The object that implements the ``_cuda_lms_*`` bindings, or ``None`` where this PyTorch
    has none."""
    try:
        return _lms_api()._lms_bindings()
    except (ImportError, RuntimeError, AttributeError):
        return None


def _pageable(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The CUDA tensors of ``tensors``: those LMS may page. (During a CUDA graph capture the
    engine does nothing with them: a page-in cannot be captured.)"""
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]


def _page_in_ahead(tensors: list[torch.Tensor]) -> None:
    """The kernel of ``lms::page_in_ahead`` for every device: hands the CUDA tensors of
    ``tensors`` to the LMS engine to page in ahead of use."""
    bindings = _lms_bindings()
    if bindings is None:
        return
    page_in = getattr(bindings, "_cuda_lms_pageInAhead", None)
    if page_in is None or not bindings._cuda_lms_getEnabled():
        return
    cuda = _pageable(tensors)
    if cuda:
        page_in(cuda)


def _page_in_ahead_fake(tensors: list[torch.Tensor]) -> None:
    """The fake (meta) kernel of ``lms::page_in_ahead``: no output to describe."""
    return None


def _lookup_op() -> Any | None:
    try:
        return getattr(torch.ops, _NAMESPACE).page_in_ahead.default
    except (AttributeError, RuntimeError):
        return None


def register_op() -> Any:
    r"""Register the operator ``lms::page_in_ahead(Tensor[] tensors) -> ()`` and return its
    overload ``torch.ops.lms.page_in_ahead.default``.

    Called again, or after another copy of this module registered it, it returns the
    registered overload. The operator has no output; it is marked side-effecting so that the
    dead-code elimination of FX and of Inductor's scheduler keep it.
    """
    global _library
    op = _lookup_op()
    if op is None:
        from torch import library as torch_library

        # FRAGMENT rather than DEF: the engine's C++ side may define operators of the
        # namespace too.
        library = torch_library.Library(_NAMESPACE, "FRAGMENT")
        library.define(_SCHEMA)
        library.impl(_OP_NAME, _page_in_ahead, "CompositeExplicitAutograd")
        qualname = f"{_NAMESPACE}::{_OP_NAME}"
        if hasattr(torch_library, "register_fake"):
            torch_library.register_fake(qualname, _page_in_ahead_fake, lib=library)
        elif hasattr(torch_library, "impl_abstract"):
            torch_library.impl_abstract(qualname, _page_in_ahead_fake, lib=library)
        else:
            library.impl(_OP_NAME, _page_in_ahead_fake, "Meta")
        _library = library
        op = getattr(torch.ops, _NAMESPACE).page_in_ahead.default
    # FX's Node.is_impure() and Inductor's FallbackKernel.has_side_effects() (through
    # torch._library.utils.is_impure) both consult this set for an OpOverload.
    from torch.fx import node as fx_node

    has_side_effect = getattr(fx_node, "has_side_effect", None)
    if has_side_effect is not None:
        has_side_effect(op)
    return op


def _is_hint(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and getattr(schema, "name", None) == (
        f"{_NAMESPACE}::{_OP_NAME}"
    )


def _nbytes(value: torch.Tensor) -> int | None:
    """``numel * element_size`` of a (fake) tensor, or ``None`` when its size is symbolic
    without a hint. Never adds a guard on a symbolic size."""
    numel: Any = value.numel()
    if not isinstance(numel, int):
        # SymNode.has_hint() and .hint read the size the symbol was traced with, without a
        # guard, the same on every PyTorch with symbolic shapes (the module-level helpers for
        # it were renamed between releases).
        node = getattr(numel, "node", None)
        has_hint = getattr(node, "has_hint", None)
        if has_hint is None or not has_hint():
            return None
        numel = node.hint
        if not isinstance(numel, int):
            return None
    return numel * value.element_size()


def insert_page_in_hints(
    graph: torch.fx.Graph, window: int = PAGE_IN_AHEAD_WINDOW, min_bytes: int = 0
) -> int:
    r"""Insert ``lms::page_in_ahead`` calls into ``graph``; return how many.

    The graph inputs considered are the placeholders whose ``meta["val"]`` is a tensor of at
    least ``min_bytes`` bytes (``numel * element_size``; a symbolic size without a hint
    counts as large) and that a ``call_function`` node uses. They are ordered by their first
    use. One hint before the first ``call_function`` node names the first ``window`` of them;
    one before each node that is the first user of an input names the next ``window`` inputs
    whose first use comes strictly after that node. A graph with fewer than two such inputs,
    or one that has hints already, is left unchanged.

    Args:
        graph (torch.fx.Graph): the graph, changed in place.
        window (int, optional): most inputs a hint names. Default:
            :data:`PAGE_IN_AHEAD_WINDOW`.
        min_bytes (int, optional): smaller inputs are left out: LMS never pages out storages
            below its size threshold. Default: ``0``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    nodes = list(graph.nodes)
    if any(_is_hint(node) for node in nodes):
        return 0
    position = {node: index for index, node in enumerate(nodes)}
    first_uses: list[tuple[int, int, torch.fx.Node]] = []
    for index, node in enumerate(nodes):
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        if min_bytes > 0:
            size = _nbytes(value)
            if size is not None and size < min_bytes:
                continue
        uses = [position[user] for user in node.users if user.op == "call_function"]
        if uses:
            first_uses.append((min(uses), index, node))
    if len(first_uses) < 2:
        return 0
    first_uses.sort(key=lambda entry: (entry[0], entry[1]))
    use_positions = [use for use, _, _ in first_uses]
    op = register_op()

    def hint_before(node: torch.fx.Node, start: int) -> int:
        names = [placeholder for _, _, placeholder in first_uses[start : start + window]]
        if not names:
            return 0
        with graph.inserting_before(node):
            hint = graph.call_function(op, (names,))
        hint.meta["val"] = None
        return 1

    first_compute = next(node for node in nodes if node.op == "call_function")
    inserted = hint_before(first_compute, 0)
    for use in sorted(set(use_positions)):
        inserted += hint_before(nodes[use], bisect.bisect_right(use_positions, use))
    return inserted


def _settings() -> tuple[bool, bool, int]:
    """LMS enabled, graph prefetch on, size threshold in bytes: what the pass reads when it
    runs, and what its cache identifier carries."""
    bindings = _lms_bindings()
    if bindings is None:
        return False, False, 0
    # An engine without graph prefetch has no page-in hint binding either: no hints.
    get_graph_prefetch: Callable[[], bool] | None = getattr(
        bindings, "_cuda_lms_getGraphPrefetch", None
    )
    try:
        enabled = bool(bindings._cuda_lms_getEnabled())
        graph_prefetch = bool(get_graph_prefetch()) if get_graph_prefetch is not None else False
        size = int(bindings._cuda_lms_getSize()) if enabled and graph_prefetch else 0
    except RuntimeError:  # the bindings cannot answer (no usable CUDA): nothing to page
        return False, False, 0
    return enabled, graph_prefetch, size


_source_digest: str | None = None


def _source_hash() -> str:
    """SHA-256 of this module's source: a changed pass is a new pass for Inductor's caches."""
    global _source_digest
    if _source_digest is None:
        try:
            data = Path(__file__).read_bytes()
        except OSError:  # no source file (a frozen or zipped install): the version stands in
            data = torch.__version__.encode()
        _source_digest = hashlib.sha256(data).hexdigest()
    return _source_digest


class PageInAheadPass:
    r"""Inductor post-grad pass that inserts ``lms::page_in_ahead`` hints (see
    :func:`insert_page_in_hints`) when LMS is enabled and its graph prefetch is on.

    Inductor calls it with the post-grad FX graph of each graph it compiles, forward and
    backward. It is a ``torch._inductor.custom_graph_pass.CustomGraphPass`` once
    :func:`install` has run: registered as a virtual subclass, so that this module does not
    import Inductor when it is imported; Inductor only tests ``isinstance``.
    """

    # Lets install() recognize the pass, also one made by another copy of this module.
    _lms_page_in_ahead = True

    def __call__(self, graph: torch.fx.Graph) -> None:
        enabled, graph_prefetch, size = _settings()
        if not (enabled and graph_prefetch):
            return
        _register_lowering()
        insert_page_in_hints(graph, PAGE_IN_AHEAD_WINDOW, size)

    def uuid(self) -> tuple[Any, ...]:
        r"""Identify the pass for Inductor's FX graph and AOTAutograd caches: its source, its
        window and the LMS settings that decide what it inserts."""
        return (__name__, _source_hash(), PAGE_IN_AHEAD_WINDOW, *_settings())


class _ChainedGraphPass:
    r"""Runs the post-grad pass a user had configured, then the LMS pass.

    For an Inductor whose ``post_grad_custom_post_pass`` takes one pass only. Its identifier
    combines both; it is ``None`` when the user's pass is not a ``CustomGraphPass`` with an
    identifier, and Inductor then bypasses its FX graph cache, as it does for that pass
    alone.
    """

    # It contains the LMS pass: install() leaves it as it is.
    _lms_page_in_ahead = True

    def __init__(self, first: Callable[[torch.fx.Graph], Any], second: PageInAheadPass) -> None:
        self.first = first
        self.second = second

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> tuple[Any, ...] | None:
        uuid = getattr(self.first, "uuid", None)
        first = uuid() if callable(uuid) and _is_custom_graph_pass(self.first) else None
        if not first:
            return None
        return (first, self.second.uuid())


def _custom_graph_pass_base() -> type | None:
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None
    return CustomGraphPass


def _is_custom_graph_pass(value: Any) -> bool:
    base = _custom_graph_pass_base()
    return base is not None and isinstance(value, base)


def _last_buffer_name(graph: Any, ir: ModuleType) -> str | None:
    """The buffer that the lowering of ``graph`` created last, not counting buffers without
    data (void operations, multi-output parents) and removed ones."""
    for buffer in reversed(graph.buffers):
        layout = getattr(buffer, "layout", None)
        if isinstance(layout, (ir.NoneLayout, ir.MultiOutputLayout)):
            continue
        name = buffer.get_name()
        if name not in graph.removed_buffers:
            return name
    return None


def _register_lowering() -> None:
    """Lower the operator to a fallback kernel, ordered after the last buffer computed before
    it.

    A hint has no output, and its inputs are graph inputs, present from the start: nothing
    orders it among the kernels, and Inductor's reordering for peak memory would move every
    hint to the start of the graph. An ordering-only dependency (Inductor's
    ``additional_buffer_deps``, as its ``control_deps`` lowering uses; it extends no buffer's
    lifetime and forces no buffer to be computed) on the last buffer that the lowering had
    created keeps each hint after the kernels that precede it in the graph.

    The fallback is registered explicitly, the same on every Inductor, also when
    ``implicit_fallbacks`` is off, and with no layout constraint: a constraint could copy an
    input only to name it.
    """
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings, make_fallback
    from torch._inductor.virtualized import V

    op = register_op()
    if getattr(lowerings.get(op), "_lms_page_in_ahead", False):
        return
    make_fallback(op, layout_constraint=None, warn=False)
    fallback = lowerings[op]

    @functools.wraps(fallback)
    def lower_page_in_ahead(*args: Any, **kwargs: Any) -> Any:
        graph = V.graph
        anchor = _last_buffer_name(graph, ir)
        first = len(graph.operations)
        result = fallback(*args, **kwargs)
        if anchor is not None:
            for operation in graph.operations[first:]:
                graph.additional_buffer_deps[operation.get_operation_name()].add(anchor)
        return result

    lower_page_in_ahead._lms_page_in_ahead = True  # type: ignore[attr-defined]
    lowerings[op] = lower_page_in_ahead


_pass: PageInAheadPass | None = None


def page_in_ahead_pass() -> PageInAheadPass:
    """The pass that :func:`install` installs (one per process)."""
    global _pass
    if _pass is None:
        _pass = PageInAheadPass()
    return _pass


def _is_ours(value: Any) -> bool:
    return bool(getattr(value, "_lms_page_in_ahead", False))


def _contains_ours(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_contains_ours(item) for item in value)
    return _is_ours(value)


def _accepts_pass_lists() -> bool:
    """Whether Inductor's post-grad pass settings take a list of passes (newer Inductor
    runs each and caches by each one's identifier; older ones take a single pass)."""
    try:
        from torch._inductor import custom_graph_pass
    except ImportError:
        return False
    return hasattr(custom_graph_pass, "get_custom_graph_passes")


def install(config_module: Any) -> None:
    r"""Install the LMS page-in hint pass into Inductor's configuration.

    Sets ``config_module.post_grad_custom_post_pass`` (``torch._inductor.config``) to the
    pass of :func:`page_in_ahead_pass` when it is ``None``. A pass set before keeps running,
    first: with an Inductor that takes a list of passes, the setting becomes
    ``[user_pass, lms_pass]``; otherwise a pass that runs the user's, then the LMS one. A user
    pass that is not a ``CustomGraphPass`` with an identifier makes Inductor bypass its FX
    graph cache, with or without the LMS pass. Installing again changes nothing, so a pass set
    after the first installation is chained by calling this again.

    Also registers the operator ``lms::page_in_ahead``, which compiled code loaded from
    Inductor's caches calls.

    Args:
        config_module: Inductor's configuration module, ``torch._inductor.config``.
    """
    register_op()
    base = _custom_graph_pass_base()
    if base is not None:
        for cls in (PageInAheadPass, _ChainedGraphPass):
            if not issubclass(cls, base):
                base.register(cls)
    current = getattr(config_module, "post_grad_custom_post_pass", None)
    if _contains_ours(current):
        return
    ours = page_in_ahead_pass()
    if current is None:
        config_module.post_grad_custom_post_pass = ours
    elif _accepts_pass_lists():
        theirs = list(current) if isinstance(current, (list, tuple)) else [current]
        config_module.post_grad_custom_post_pass = [*theirs, ours]
    else:
        config_module.post_grad_custom_post_pass = _ChainedGraphPass(current, ours)
