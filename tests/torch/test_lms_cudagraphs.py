"""torch/cuda/_lms_cudagraphs.py on the CPU: compiled code runs without CUDA graphs once the
warm-up or capture of a CUDA graph ran out of memory in the graph pool while LMS is enabled.

Inductor's own CUDA graph tree manager runs here with its CUDA steps stubbed (the pool routing
of a warm-up, the capture, streams, synchronization): an allocation that fails in the graph
pool is the compiled function raising torch.OutOfMemoryError while the stubbed routing or
capture is on. The compiled function is a stand-in with Inductor's calling convention (it
clears the list of inputs it is given) that mutates an input, as a batch norm's running
statistics, and draws random numbers: the fallback must leave both as a run without the
failure would."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable

import pytest
from fake_torch_lms import ENGINE, build_fake_torch_lms, load_engine_module, run_python

torch = pytest.importorskip("torch", reason="needs a torch wheel (the CPU one is enough)")

FALLBACK_PY = ENGINE / "_lms_cudagraphs.py"
MODULE_NAME = "lms_cudagraphs_under_test"
MiB = 1024 * 1024
POOL = (0, 7)


def load_fallback_module() -> ModuleType:
    return load_engine_module(MODULE_NAME, FALLBACK_PY)


class FakeBindings:
    def __init__(self) -> None:
        self.enabled = True

    def _cuda_lms_getEnabled(self) -> bool:
        return self.enabled


@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The module, with fake LMS bindings and statistics, the CPU generator standing for the
    device's, and the release of the pool recorded instead of done."""
    module = load_fallback_module()
    bindings = FakeBindings()
    api = ModuleType("fake_lms_api")
    api._lms_bindings = lambda: bindings  # type: ignore[attr-defined]
    api.lms_stats = lambda device: {  # type: ignore[attr-defined]
        "private_pool_bytes": {"current": 5 * MiB},
        "limit_bytes": 64 * MiB,
    }
    monkeypatch.setattr(module, "_lms_api", lambda: api)
    monkeypatch.setattr(module, "_default_generators", lambda device: [torch.default_generator])
    releases: list[Any] = []
    monkeypatch.setattr(module, "_release", releases.append)

    live = {"bytes": 0}  # allocated in the pool once the failed call's memory is freed

    def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[Any]:
        assert mempool_id == POOL
        return [
            {"device": 0, "total_size": 3 * MiB, "allocated_size": live["bytes"]},
            {"device": 0, "total_size": 1 * MiB, "allocated_size": 0},
        ]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    module.live = live  # type: ignore[attr-defined]
    module.bindings = bindings  # type: ignore[attr-defined]
    module.releases = releases  # type: ignore[attr-defined]
    return module


def fallback_warnings(caught: list[warnings.WarningMessage], module: ModuleType) -> list[str]:
    return [
        str(w.message) for w in caught if issubclass(w.category, module.GraphPoolFallbackWarning)
    ]


# ---------------------------------------------------------------------------------------------
# Inductor's tree manager with its CUDA steps stubbed


class Stubs:
    """Where the stubbed CUDA steps are: allocations routed to the graph pool (a warm-up, the
    copy of a capture's inputs), or a capture underway."""

    def __init__(self) -> None:
        self.in_pool = False
        self.capturing = False


class FakeStream:
    def wait_stream(self, stream: Any) -> None:
        pass


class FakeCUDAGraph:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def replay(self) -> None:
        pass

    def register_generator_state(self, *args: Any) -> None:
        pass


@pytest.fixture
def trees(
    fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ModuleType, Stubs]]:
    """torch._inductor.cudagraph_trees with the fallback installed into its tree manager (the
    class is restored afterwards) and its CUDA steps stubbed."""
    from torch._inductor import config
    from torch._inductor import cudagraph_trees as ct

    stubs = Stubs()

    @contextlib.contextmanager
    def pool_routing(device: int, mem_pool: Any, stream: Any) -> Iterator[None]:
        stubs.in_pool = True
        try:
            yield
        finally:
            stubs.in_pool = False

    class Capture:
        def __init__(self, graph: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> None:
            stubs.capturing = True

        def __exit__(self, *args: Any) -> None:
            stubs.capturing = False

    monkeypatch.setattr(ct, "_use_cuda_memory_pool_manager", pool_routing)
    monkeypatch.setattr(ct, "clear_cublas_manager", contextlib.nullcontext)
    monkeypatch.setattr(ct, "disable_conv_cache_emptying", contextlib.nullcontext)
    monkeypatch.setattr(
        ct.CUDAGraphNode,
        "_reconstruct_from_tensor_metadata",
        lambda self, metadata, storage=None: torch.empty(0),
    )
    # lms.py, loaded by other tests of this process, may have wrapped the capture to page
    # its inputs in through bindings that are not here.
    record = ct.CUDAGraphNode._record
    monkeypatch.setattr(ct.CUDAGraphNode, "_record", getattr(record, "__wrapped__", record))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "device", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: POOL)
    manager_class = ct.CUDAGraphTreeManager
    for name in ("run", "run_eager", "record_function"):
        monkeypatch.setattr(manager_class, name, getattr(manager_class, name))
    monkeypatch.setattr(manager_class, "_lms_graph_pool_fallback", False, raising=False)
    monkeypatch.setattr(ct, "cudagraphify_impl", ct.cudagraphify_impl)
    monkeypatch.setattr(fallback, "_TREES_WITHOUT_GRAPHS", {})
    fallback.install_tree_fallback(ct)
    no_asserts = {
        "triton.slow_path_cudagraph_asserts": False,
        "triton.fast_path_cudagraph_asserts": False,
    }
    try:
        with config.patch(no_asserts):
            yield ct, stubs
    finally:
        ct.reset_cudagraph_trees()


class Region:
    """Stands for a region Inductor compiled: takes [x, stats], clears the list, adds 1 to
    ``stats`` in place, draws noise, returns [x * 2 + noise + stats.sum()]. ``fail`` is where
    an allocation in the graph pool fails: "warm-up" (after the mutation and the draw), or
    "capture" (at once: a capture records, and runs nothing)."""

    def __init__(self, stubs: Stubs, fail: str | None = None, error: type = Exception) -> None:
        self.stubs = stubs
        self.fail = fail
        self.error: type[Exception] = (
            torch.OutOfMemoryError if error is Exception else error  # type: ignore[assignment]
        )
        self.calls: list[str] = []
        self.__name__ = "call"

    def __call__(self, args: list[Any]) -> list[torch.Tensor]:
        x, stats = args
        args.clear()
        where = "capture" if self.stubs.capturing else "pool" if self.stubs.in_pool else "plain"
        self.calls.append(where)
        if where == "capture" and self.fail == "capture":
            raise self.error("CUDA out of memory in a CUDA graph pool")
        stats.add_(1)
        noise = torch.rand(x.shape)
        if where == "pool" and self.fail == "warm-up":
            raise self.error("CUDA out of memory in a CUDA graph pool")
        return [x * 2 + noise + stats.sum()]


def tree_compile(ct: ModuleType, region: Region, x: torch.Tensor, stats: torch.Tensor) -> Any:
    """What Inductor does for a region under mode="reduce-overhead": the tree's deferred
    cudagraphify (stats, input 1, static and mutated, as a buffer)."""
    return ct.cudagraphify_impl(
        region,
        [x, stats],
        [1],
        device_index=0,
        is_backward=False,
        is_inference=False,
        stack_traces=[None],
        constants=(),
        placeholders=(),
        mutated_input_idxs=(1,),
    )


def reference(steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The region's outputs and statistics when every call runs it once, plainly."""
    torch.manual_seed(0)
    x, stats = torch.ones(3), torch.zeros(2)
    region = Region(Stubs())
    outputs = [region([x, stats])[0] for _ in range(steps)]
    return outputs, stats


def run_steps(fn: Any, x: torch.Tensor, stats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [fn([x, stats])[0] for _ in range(steps)]


@pytest.mark.parametrize("fail", ["warm-up", "capture"])
def test_pool_that_runs_out_of_memory_makes_the_tree_run_without_graphs(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType, fail: str
) -> None:
    ct, stubs = trees
    region = Region(stubs, fail=fail)
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, region, x, stats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = run_steps(fn, x, stats, steps=4)

    expected, expected_stats = reference(steps=4)
    for step, (a, b) in enumerate(zip(outputs, expected)):
        assert torch.equal(a, b), f"output of call {step} differs"
    # The failed warm-up's mutation was undone: each call added 1 once.
    assert torch.equal(stats, expected_stats)
    # The failed step, then the call again and every later one plainly, outside the pool.
    if fail == "warm-up":
        assert region.calls == ["pool", "plain", "plain", "plain", "plain"]
    else:  # the first call's warm-up ran in the pool
        assert region.calls == ["pool", "capture", "plain", "plain", "plain"]

    messages = fallback_warnings(caught, fallback)
    assert len(messages) == 1, messages
    message = messages[0]
    assert f"CUDA graph {fail} of the compiled function 'call' (forward" in message
    assert "the pool held 4.00 MiB" in message  # its segments in the allocator's snapshot
    assert "LMS limit of 64.00 MiB" in message
    assert "without CUDA graphs" in message and "cuda:0" in message

    manager = ct.get_manager(0, create_if_none_exists=False)
    assert manager is not None and manager.graph is None  # the pool's keeper is gone
    assert all(node.graph is None for node in fallback._tree_nodes(manager))
    assert fallback.releases == [0]


def test_skip_counter_counts_the_fallback(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    from torch._dynamo.utils import counters

    ct, stubs = trees
    before = counters["inductor"]["cudagraph_skips"]
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, Region(stubs, fail="warm-up"), x, stats)
    with pytest.warns(fallback.GraphPoolFallbackWarning):
        fn([x, stats])
    assert counters["inductor"]["cudagraph_skips"] == before + 1


def test_functions_compiled_after_the_fallback_run_without_graphs(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    ct, stubs = trees
    x, stats = torch.ones(3), torch.zeros(2)
    first = tree_compile(ct, Region(stubs, fail="warm-up"), x, stats)
    with pytest.warns(fallback.GraphPoolFallbackWarning):
        first([x, stats])

    # A region that would fail in the pool never goes there: no warm-up, no warning, and no
    # look at the addresses of its static inputs (which pages in every paged-out parameter).
    def no_address_probe(*args: Any) -> None:
        raise AssertionError("the tree probed the addresses of the static inputs")

    monkeypatch.setattr(ct, "remove_unaligned_input_idxs", no_address_probe)
    region = Region(stubs, fail="warm-up")
    second = tree_compile(ct, region, x, stats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second([x, stats])
        second([x, stats])
    assert region.calls == ["plain", "plain"]
    assert fallback_warnings(caught, fallback) == []


def test_without_lms_the_error_stands(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    ct, stubs = trees
    fallback.bindings.enabled = False
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, Region(stubs, fail="warm-up"), x, stats)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA graph pool"):
        fn([x, stats])
    manager = ct.get_manager(0, create_if_none_exists=False)
    assert getattr(manager, "_lms_without_graphs", None) is None
    assert fallback.releases == []


def test_no_fallback_while_tensors_live_in_the_pool(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    """Tensors of earlier graphs or warm-ups still in the pool: it cannot be released under
    them, and the error stands, saying so."""
    ct, stubs = trees
    fallback.live["bytes"] = 2 * MiB
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, Region(stubs, fail="warm-up"), x, stats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(torch.OutOfMemoryError, match="tensors still live in the CUDA graph"):
            fn([x, stats])
    assert fallback_warnings(caught, fallback) == []
    assert torch.equal(stats, torch.zeros(2))  # the failed warm-up's mutation undone
    manager = ct.get_manager(0, create_if_none_exists=False)
    assert getattr(manager, "_lms_without_graphs", None) is None
    assert fallback.releases == []


def test_a_call_that_reads_pool_tensors_is_not_retried(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A region reading tensors of the pool (a backward reading its forward's): they are not
    kept alive through the call, which frees them as it goes; its error stands."""
    ct, stubs = trees
    monkeypatch.setattr(
        ct.CUDAGraphTreeManager,
        "_get_cuda_graph_recorded_tensor_checker",
        lambda self: lambda tensor: tensor.dim() == 1 and tensor.numel() == 3,
    )
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, Region(stubs, fail="warm-up"), x, stats)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA graph pool") as raised:
        fn([x, stats])
    assert "did not fall back" not in str(raised.value)
    manager = ct.get_manager(0, create_if_none_exists=False)
    assert getattr(manager, "_lms_without_graphs", None) is None


def test_cudagraph_or_error_keeps_the_error(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    from torch._inductor import config

    ct, stubs = trees
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, Region(stubs, fail="capture"), x, stats)
    with config.patch({"triton.cudagraph_or_error": True}):
        fn([x, stats])  # the warm-up
        with pytest.raises(torch.OutOfMemoryError, match="CUDA graph pool"):
            fn([x, stats])


def test_other_errors_are_not_taken_for_a_pool_that_does_not_fit(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    ct, stubs = trees
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, Region(stubs, fail="warm-up", error=RuntimeError), x, stats)
    with pytest.raises(RuntimeError, match="CUDA graph pool") as raised:
        fn([x, stats])
    assert not isinstance(raised.value, torch.OutOfMemoryError)
    manager = ct.get_manager(0, create_if_none_exists=False)
    assert getattr(manager, "_lms_without_graphs", None) is None


# ---------------------------------------------------------------------------------------------
# Dropping the graphs of a tree


class FakeRef:
    """Stands for a StorageWeakRefWrapper: calling it gives the storage, or None once dead."""

    def __init__(self, storage: int | None) -> None:
        self.storage = storage

    def __call__(self) -> int | None:
        return self.storage


class FakeNode:
    def __init__(self, outputs: list[FakeRef | None]) -> None:
        self.graph: Any = object()
        self.children: dict[int, list[FakeNode]] = {}
        self.outputs_weakrefs = outputs
        self.cached_removed = False

    def remove_node_cached_tensors(self) -> None:
        self.cached_removed = True


def test_dropping_the_graphs_frees_the_pool_and_fences_stale_outputs(
    fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every recorded graph and the tree's own graph go (so does the pool with them); live
    outputs that own their memory stay valid, those that do not are made to raise on access."""
    owning = {11}
    fenced: list[tuple[int, str]] = []
    monkeypatch.setattr(torch._C, "_has_Standard_Deleter", owning.__contains__, raising=False)
    monkeypatch.setattr(
        torch._C,
        "_set_storage_data_ptr_access_error_msg",
        lambda storage, message: fenced.append((storage, message)),
        raising=False,
    )
    child = FakeNode([FakeRef(11), FakeRef(12), FakeRef(None), None])
    root = FakeNode([FakeRef(13)])
    root.children = {1: [child]}
    warm_up = SimpleNamespace(existing_cuda_graph=object(), parent=child)
    manager = SimpleNamespace(roots={0: [root]}, current_node=warm_up, graph=object())

    fallback._drop_graphs(manager)

    assert manager.graph is None and root.graph is None and child.graph is None
    assert warm_up.existing_cuda_graph is None
    assert root.cached_removed and child.cached_removed
    assert sorted(storage for storage, _ in fenced) == [12, 13]
    assert all("memory pool was released" in message for _, message in fenced)


# ---------------------------------------------------------------------------------------------
# A region's own CUDA graph (CUDA graph trees off)


@pytest.fixture
def compile_fx(fallback: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    from torch._inductor import compile_fx as module
    from torch._inductor import config

    monkeypatch.setattr(module, "cudagraphify", module.cudagraphify)
    fallback.install_cudagraphify_fallback(module)
    with config.patch({"triton.cudagraph_trees": False}):
        yield module


def single_graph_impl(stubs: Stubs) -> Callable[..., Any]:
    """Stands for compile_fx.cudagraphify_impl: warms the region up on its inputs (the static
    ones are the caller's) with the stubbed routing on, as the capture's allocations would be;
    its replays run the region again."""

    def impl(model: Any, inputs: list[Any], static_input_idxs: Any = ()) -> Any:
        stubs.in_pool = True
        try:
            model(list(inputs))
        finally:
            stubs.in_pool = False
        return lambda new_inputs: model(new_inputs)

    return impl


def single_compile(module: ModuleType, region: Region) -> Any:
    return module.cudagraphify(
        region,
        static_input_idxs=(1,),
        device_index=0,
        stack_traces=[None],
        is_backward=False,
        is_inference=False,
        mutated_input_idxs=(1,),
    )


def test_region_with_its_own_graph_runs_without_it_once_it_did_not_fit(
    compile_fx: ModuleType, fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    stubs = Stubs()
    monkeypatch.setattr(compile_fx, "cudagraphify_impl", single_graph_impl(stubs))
    region = Region(stubs, fail="warm-up")
    x, stats = torch.ones(3), torch.zeros(2)
    fn = single_compile(compile_fx, region)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = run_steps(fn, x, stats, steps=3)
    expected, expected_stats = reference(steps=3)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))
    assert torch.equal(stats, expected_stats)
    assert region.calls == ["pool", "plain", "plain", "plain"]
    messages = fallback_warnings(caught, fallback)
    assert len(messages) == 1 and "'call' on cuda:0" in messages[0], messages
    assert "runs without a CUDA graph" in messages[0]


def test_region_with_its_own_graph_that_fits_keeps_it(
    compile_fx: ModuleType, fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    stubs = Stubs()
    monkeypatch.setattr(compile_fx, "cudagraphify_impl", single_graph_impl(stubs))
    region = Region(stubs)
    x, stats = torch.ones(3), torch.zeros(2)
    fn = single_compile(compile_fx, region)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(fn, x, stats, steps=3)
    assert region.calls == ["pool", "plain", "plain", "plain"]
    assert fallback_warnings(caught, fallback) == []


def test_regions_of_graph_trees_are_left_to_the_tree_manager(
    compile_fx: ModuleType, fallback: ModuleType
) -> None:
    from torch._inductor import config

    with config.patch({"triton.cudagraph_trees": True}):
        fn = single_compile(compile_fx, Region(Stubs()))
    assert getattr(fn, "__self__", None) is None  # compile_fx's own closure, unwrapped


def test_a_region_of_graph_trees_has_the_tree_manager_wrapped_first(
    compile_fx: ModuleType, fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree manager's module may have been imported past LMS's import hook: making a
    region of a tree wraps what is imported before the region's first call."""
    from torch._inductor import config

    calls: list[str] = []
    api = ModuleType("fake_lms_api")
    api._install_compiled_code_hooks = lambda: calls.append("wrap")  # type: ignore[attr-defined]
    monkeypatch.setattr(fallback, "_lms_api", lambda: api)
    with config.patch({"triton.cudagraph_trees": True}):
        single_compile(compile_fx, Region(Stubs()))
    assert calls == ["wrap"]
    with config.patch({"triton.cudagraph_trees": False}):
        single_compile(compile_fx, Region(Stubs()))
    assert calls == ["wrap"]  # a region with a graph of its own needs no tree


# ---------------------------------------------------------------------------------------------
# Installation


def test_installing_twice_wraps_once_and_other_modules_are_left_alone(
    fallback: ModuleType,
) -> None:
    class CUDAGraphTreeManager:
        def run(self, new_inputs: list[Any], function_id: int) -> str:
            return "run"

        def run_eager(self, new_inputs: list[Any], function_id: int) -> str:
            return "warm-up"

        def record_function(self, new_inputs: list[Any], function_id: int) -> str:
            return "capture"

    module = ModuleType("fake_cudagraph_trees")
    module.CUDAGraphTreeManager = CUDAGraphTreeManager  # type: ignore[attr-defined]
    fallback.install_tree_fallback(module)
    wrapped = CUDAGraphTreeManager.run
    fallback.install_tree_fallback(module)
    assert CUDAGraphTreeManager.run is wrapped and wrapped.__wrapped__.__name__ == "run"

    other = ModuleType("no_manager")
    fallback.install_tree_fallback(other)
    fallback.install_cudagraphify_fallback(other)
    assert vars(other).keys() == {"__name__", "__doc__", "__package__", "__loader__", "__spec__"}


HOOK_SCRIPT = """
import sys

import torch_lms.lms

assert "torch._inductor.cudagraph_trees" not in sys.modules
assert "torch_lms._lms_cudagraphs" not in sys.modules, "imported before Inductor was"
from torch._inductor import compile_fx, cudagraph_trees

print(cudagraph_trees.CUDAGraphTreeManager._lms_graph_pool_fallback)
print(getattr(compile_fx.cudagraphify, "_lms_graph_pool_fallback", False))
print(getattr(cudagraph_trees.CUDAGraphNode._record, "_lms_resident_inputs", False))
"""


def test_lms_module_installs_the_fallback_when_inductor_is_imported(tmp_path: Path) -> None:
    """As the drop-in extension ships the modules: lms.py wraps Inductor's tree manager and
    cudagraphify when they are imported, through the module beside it."""
    env = build_fake_torch_lms(tmp_path, [FALLBACK_PY.name])
    assert run_python(env, HOOK_SCRIPT).split() == ["True", "True", "True"]


# ---------------------------------------------------------------------------------------------
# Input alignment without CUDA graphs


class _NoAddress(torch.Tensor):
    """A tensor whose address must not be asked for (it would page a paged-out storage in)."""

    def data_ptr(self) -> int:
        raise AssertionError("asked for the address of a paged-out storage")


def test_alignment_of_paged_out_inputs_comes_from_their_offsets(
    fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = {"paged out": "paged out", "unmanaged": "unmanaged"}
    namespace = ModuleType("fake_inductor")
    namespace.get_input_idxs_to_check = lambda inputs, static: [0, 1, 2]  # type: ignore[attr-defined]
    storage = torch.zeros(16)
    aligned = storage[4:].as_subclass(_NoAddress)  # 16 bytes in: aligned
    misaligned = storage[1:9].as_subclass(_NoAddress)  # 4 bytes in: misaligned, mutated
    unmanaged = torch.zeros(4)
    kinds = {id(aligned): "paged out", id(misaligned): "paged out", id(unmanaged): "unmanaged"}
    monkeypatch.setattr(fallback, "_storage_state", lambda: lambda t: states[kinds[id(t)]])
    seen: list[list[Any]] = []

    def model(args: list[Any]) -> list[Any]:
        seen.append(list(args))
        args[1].add_(1)
        args.clear()
        return ["out"]

    run = fallback._aligned(namespace, model, [aligned, misaligned, unmanaged], (), (1,))
    assert run([aligned, misaligned, unmanaged]) == ["out"]
    given = seen[0]
    assert given[0] is aligned and given[2] is unmanaged  # left as they are
    assert given[1] is not misaligned and given[1].storage_offset() == 0  # an aligned copy
    assert torch.equal(misaligned, torch.ones(8))  # the mutation written back
    assert torch.equal(storage[9:], torch.zeros(7))
