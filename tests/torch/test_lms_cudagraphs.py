"""torch/cuda/_lms_cudagraphs.py on the CPU: compiled code runs without CUDA graphs once the
warm-up or capture of a CUDA graph ran out of memory in the graph pool while LMS is enabled,
and the pool of an idle tree goes back to the device when the LMS engine finds no other room.

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
import weakref
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
        # The tensors given to _cuda_lms_moveOutOfPool; "fail" makes the next call raise.
        self.moved: list[Any] = []
        self.fail: Exception | None = None

    def _cuda_lms_getEnabled(self) -> bool:
        return self.enabled

    def _cuda_lms_moveOutOfPool(self, tensor: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.moved.append(tensor)

    # The engine's graph pool steps (c10/cuda/LargeModelSupport.h): how many are under way,
    # and whether one ran out of memory since the outermost began.
    pool_steps = 0
    pool_step_ran_out = False

    def _cuda_lms_beginGraphPoolStep(self) -> None:
        if self.pool_steps == 0:
            self.pool_step_ran_out = False
        self.pool_steps += 1

    def _cuda_lms_endGraphPoolStep(self) -> bool:
        assert self.pool_steps > 0
        ran_out = self.pool_step_ran_out
        self.pool_steps -= 1
        return ran_out

    def out_of_memory(self, message: str) -> None:
        """An allocation that does not fit, raised as the engine raises it: inside a graph
        pool step, an error no library catches as out of memory."""
        if self.pool_steps > 0:
            self.pool_step_ran_out = True
            raise RuntimeError(
                f"Large Model Support: out of memory in a CUDA graph pool's "
                f"warm-up or capture on cuda:0; {message}"
            )
        raise torch.OutOfMemoryError(message)


@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The module, with fake LMS bindings and statistics, the CPU generator standing for the
    device's, and the release of the pool recorded instead of done."""
    module = load_fallback_module()
    bindings = FakeBindings()
    api = ModuleType("fake_lms_api")
    api._lms_bindings = lambda: bindings  # type: ignore[attr-defined]
    # lms.py's state that lets a capture of compiled code through the drop-in's capture guard.
    api._capture_state = SimpleNamespace(resident_inputs=False)  # type: ignore[attr-defined]
    api.lms_stats = lambda device: {  # type: ignore[attr-defined]
        "private_pool_bytes": {"current": 5 * MiB},
        "limit_bytes": 64 * MiB,
    }
    monkeypatch.setattr(module, "_lms_api", lambda: api)
    monkeypatch.setattr(module, "_default_generators", lambda device: [torch.default_generator])
    releases: list[Any] = []
    monkeypatch.setattr(module, "_release", releases.append)

    # Allocated in the pool once the failed call's memory is freed; "segments", when set, is
    # what the snapshot shows instead (with blocks).
    live: dict[str, Any] = {"bytes": 0, "segments": None}

    def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[Any]:
        assert mempool_id == POOL
        if live["segments"] is not None:
            return list(live["segments"])
        return [
            {"device": 0, "total_size": 3 * MiB, "allocated_size": live["bytes"]},
            {"device": 0, "total_size": 1 * MiB, "allocated_size": 0},
        ]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    # Process-wide state of the module (loaded once per process), fresh for each test.
    monkeypatch.setattr(module, "_TREES", weakref.WeakSet())
    monkeypatch.setattr(module, "_PENDING_WARNINGS", [])
    monkeypatch.setattr(module, "_RELEASES", {"count": 0, "bytes": 0, "outputs_moved": 0})
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


class LibraryThatFallsBack(Region):
    """In the graph pool, an allocation inside a library does not fit; the library catches an
    out-of-memory error and goes on another way, with other numbers (as cuDNN does with a
    smaller workspace, a plan it then keeps). ``error`` is what else the region raises there
    instead, if anything."""

    def __init__(self, stubs: Stubs, bindings: Any, error: Exception | None = None) -> None:
        super().__init__(stubs)
        self.bindings = bindings
        self.raise_instead = error

    def __call__(self, args: list[Any]) -> list[torch.Tensor]:
        other_plan = 0.0
        if self.stubs.in_pool:
            if self.raise_instead is not None:
                raise self.raise_instead
            try:
                self.bindings.out_of_memory("CUDA out of memory. Tried to allocate 2.00 MiB")
            except torch.OutOfMemoryError:
                self.calls.append("library fell back")
                other_plan = 1e-3
        outputs = super().__call__(args)
        return [outputs[0] + other_plan]


def test_an_allocation_that_fails_in_the_pool_ends_the_warm_up_before_a_library_catches_it(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    """The warm-up runs as a graph pool step: its first allocation that does not fit ends it
    with an error the library does not catch as out of memory, so the library never goes on
    with its other plan, and the plain code computes what a run that fits computes."""
    ct, stubs = trees
    region = LibraryThatFallsBack(stubs, fallback.bindings)
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, region, x, stats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = run_steps(fn, x, stats, steps=3)
    expected, expected_stats = reference(steps=3)
    for step, (a, b) in enumerate(zip(outputs, expected)):
        assert torch.equal(a, b), f"output of call {step} differs"
    assert torch.equal(stats, expected_stats)
    assert "library fell back" not in region.calls
    assert region.calls == ["plain", "plain", "plain"]  # the warm-up ended before the region ran
    messages = fallback_warnings(caught, fallback)
    assert len(messages) == 1 and "CUDA graph warm-up" in messages[0], messages
    assert fallback.bindings.pool_steps == 0  # every step that began ended
    # Outside a step, the same allocation raises the out-of-memory error a library catches.
    with pytest.raises(torch.OutOfMemoryError):
        fallback.bindings.out_of_memory("CUDA out of memory")


def test_an_error_in_the_pool_that_is_not_out_of_memory_is_raised_as_it_is(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    """A RuntimeError of the region that is not the end of a graph pool step (the engine
    reported no allocation that did not fit) is the program's error: no fallback."""
    ct, stubs = trees
    failure = RuntimeError("a shape mismatch in the region")
    region = LibraryThatFallsBack(stubs, fallback.bindings, error=failure)
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, region, x, stats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="shape mismatch") as raised:
            run_steps(fn, x, stats, steps=1)
    assert raised.value is failure
    assert not fallback_warnings(caught, fallback)
    assert fallback.bindings.pool_steps == 0


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
# The pools of idle trees go back to the device when the engine finds no other room


def yield_warnings(caught: list[warnings.WarningMessage], module: ModuleType) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, module.GraphPoolYieldWarning)]


def test_idle_tree_gives_its_pool_back_and_is_warmed_up_again(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree whose functions are not running, whose current outputs nobody holds and whose
    pool holds no tensor is released when the engine asks: its graphs go (and the pool's
    keeper), the engine is told to try again, and the tree's next call makes it new (a
    warm-up into a new pool, then the capture), warning once, with the results of a run
    without the release."""
    ct, stubs = trees
    region = Region(stubs)
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, region, x, stats)
    torch.manual_seed(0)
    first = fn([x, stats])[0]  # the warm-up, in the pool
    manager = ct.get_manager(0, create_if_none_exists=False)
    assert manager is not None and manager.graph is not None

    released, note = fallback.release_idle_graph_pools(0, 8 * MiB)

    assert released
    assert note.startswith("CUDA graph pools on cuda:0: the CUDA graph pool of 1 compiled")
    assert "'call' (forward" in note and "holds 4.00 MiB, released" in note
    # The LMS statistics' private pools (5 MiB) hold 1 MiB besides this tree's pool.
    assert "1.00 MiB in other private pools" in note
    assert manager.graph is None  # the pool's keeper is gone, and with it the pool
    assert fallback.graph_pool_releases() == {"count": 1, "bytes": 4 * MiB, "outputs_moved": 0}
    assert fallback.releases == []  # nothing synchronizes inside the allocation

    # The new pool's keeper is captured empty, let through the drop-in's capture guard.
    guard_state = fallback._lms_api()._capture_state
    seen: list[bool] = []

    class EmptyCapture:
        def __init__(self, graph: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> None:
            seen.append(guard_state.resident_inputs)

        def __exit__(self, *args: Any) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "graph", EmptyCapture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = fn([x, stats])[0]
    messages = yield_warnings(caught, fallback)
    assert len(messages) == 1, messages
    assert "(4.00 MiB) went back to the device" in messages[0]
    assert "an allocation of 8.00 MiB on cuda:0" in messages[0]
    assert "LMS limit of 64.00 MiB" in messages[0]
    assert "captured again when the functions are next called" in messages[0]
    assert fallback_warnings(caught, fallback) == []
    # Made new: warmed up again in a new pool, under the same manager, whose functions stay.
    assert region.calls == ["pool", "pool"]
    assert ct.get_manager(0, create_if_none_exists=False) is manager
    assert manager.graph is not None
    assert manager._lms_pool_released is None
    assert seen == [True] and guard_state.resident_inputs is False
    assert getattr(manager, "_lms_without_graphs", None) is None

    expected, expected_stats = reference(steps=2)
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
    assert torch.equal(stats, expected_stats)


def test_tree_with_tensors_alive_in_its_pool_is_kept_and_named(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    ct, stubs = trees
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, Region(stubs), x, stats)
    fn([x, stats])
    fallback.live["bytes"] = 2 * MiB
    manager = ct.get_manager(0, create_if_none_exists=False)

    released, note = fallback.release_idle_graph_pools(0, 8 * MiB)

    assert not released
    assert "holds 4.00 MiB, kept: 2.00 MiB of tensors are alive in it" in note
    assert manager.graph is not None
    assert fallback.graph_pool_releases() == {"count": 0, "bytes": 0, "outputs_moved": 0}
    assert fallback._PENDING_WARNINGS == []


def test_tree_whose_function_is_running_is_kept(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    """An allocation inside a function of the tree (its warm-up allocates in the pool, a
    replay writes to it) never releases that tree."""
    ct, stubs = trees
    answers: list[tuple[bool, str]] = []

    class AllocatingRegion(Region):
        def __call__(self, args: list[Any]) -> list[torch.Tensor]:
            answers.append(fallback.release_idle_graph_pools(0, MiB))
            return super().__call__(args)

    x, stats = torch.ones(3), torch.zeros(2)
    region = AllocatingRegion(stubs)
    fn = tree_compile(ct, region, x, stats)
    fn([x, stats])  # the warm-up, during which the region allocates
    assert region.calls == ["pool"]
    assert len(answers) == 1
    released, note = answers[0]
    assert not released
    assert "holds 4.00 MiB, kept: one of its functions is running" in note
    manager = ct.get_manager(0, create_if_none_exists=False)
    assert manager is not None and manager.graph is not None
    assert manager._lms_running == 0  # the call is over: it is idle again


def test_tree_released_twice_runs_without_graphs(
    trees: tuple[ModuleType, Stubs], fallback: ModuleType
) -> None:
    """A tree that has to give its pool back a second time would be captured again at every
    step: it runs without CUDA graphs from then on instead, as after a pool that did not fit."""
    from torch._dynamo.utils import counters

    ct, stubs = trees
    region = Region(stubs)
    x, stats = torch.ones(3), torch.zeros(2)
    fn = tree_compile(ct, region, x, stats)
    skips = counters["inductor"]["cudagraph_skips"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn([x, stats])
        assert fallback.release_idle_graph_pools(0, MiB)[0]
        fn([x, stats])  # made new
        assert fallback.release_idle_graph_pools(0, MiB)[0]
        fn([x, stats])
        fn([x, stats])
        # Its pool is gone: nothing is left to release.
        assert fallback.release_idle_graph_pools(0, MiB) == (
            False,
            "CUDA graph pools on cuda:0: 5.00 MiB in other private pools (torch.cuda.graph, "
            "torch.cuda.MemPool, regions compiled with a CUDA graph of their own), which LMS "
            "never releases.",
        )
    assert region.calls == ["pool", "pool", "plain", "plain"]
    assert len(yield_warnings(caught, fallback)) == 1
    messages = fallback_warnings(caught, fallback)
    assert len(messages) == 1 and "went back to the device a second time" in messages[0]
    assert "now run without CUDA graphs" in messages[0]
    assert counters["inductor"]["cudagraph_skips"] == skips + 1
    assert fallback.graph_pool_releases()["count"] == 2


def test_release_without_trees_names_the_other_pools(fallback: ModuleType) -> None:
    assert fallback.release_idle_graph_pools(0, MiB) == (
        False,
        "CUDA graph pools on cuda:0: 5.00 MiB in other private pools (torch.cuda.graph, "
        "torch.cuda.MemPool, regions compiled with a CUDA graph of their own), which LMS never "
        "releases.",
    )


def test_release_never_raises_into_the_allocation(
    fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = FakeManager()
    fallback._TREES.add(manager)

    def broken(manager: Any) -> Any:
        raise KeyError("segments")

    monkeypatch.setattr(fallback, "_pool_use", broken)
    assert fallback.release_idle_graph_pools(0, MiB) == (
        False,
        "(Releasing idle CUDA graph pools failed: KeyError('segments').)",
    )
    # Nor does an allocation made while it releases release again.
    monkeypatch.setattr(fallback._releasing, "active", True, raising=False)
    assert fallback.release_idle_graph_pools(0, MiB) == (False, "")


class FakeManager:
    """Stands for a tree manager whose graphs were recorded: its nodes and current path."""

    def __init__(self, roots: list[Any] | None = None, current: Any = None) -> None:
        self.device_index = 0
        self.cuda_graphs_thread_pool = POOL
        self.roots = {0: roots or []}
        self.current_node = current
        self.graph: Any = object()
        self.ids_to_funcs = {0: None, 1: None}
        self.id_to_mode: dict[int, Any] = {}
        self.id_to_compile_id: dict[int, Any] = {}

    def get_func_name(self, function_id: int) -> str:
        return ["fw", "bw"][function_id]


class Ref:
    """A StorageWeakRefWrapper: the storage while something beyond the tree holds it."""

    def __init__(self, address: int, alive: bool) -> None:
        self.address = address
        self.alive = alive

    def __call__(self) -> int | None:
        return self.address if self.alive else None

    def data_ptr(self) -> int:
        return self.address


def block(address: int, size: int, state: str = "active_allocated") -> dict[str, Any]:
    return {"address": address, "size": size, "state": state}


def recorded_tree(live_output: bool, other_tensor: bool) -> tuple[FakeManager, list[Any]]:
    """A forward and a backward recorded into one pool: the forward's output at 0x1000 (cached
    by the tree), the backward's at 0x2000 (cached) and 0x3000 (not cached, dead); the
    snapshot shows the cached ones allocated, and a tensor at 0x4000 when ``other_tensor``."""
    forward = FakeNode([Ref(0x1000, alive=False)])
    forward.cached_tensor_outputs = [torch.empty(0)]
    backward = FakeNode([Ref(0x2000, alive=live_output), Ref(0x3000, alive=False)])
    backward.cached_tensor_outputs = [torch.empty(0), None]
    backward.parent = forward
    forward.parent = None
    forward.children = {1: [backward]}
    blocks = [
        block(0x1000, 2 * MiB),
        block(0x2000, 1 * MiB),
        block(0x3000, 1 * MiB, "inactive"),
        block(0x4000, 2 * MiB, "active_allocated" if other_tensor else "inactive"),
    ]
    segments = [{"device": 0, "total_size": 6 * MiB, "allocated_size": 0, "blocks": blocks}]
    return FakeManager([forward], current=backward), segments


@pytest.mark.parametrize(
    ("live_output", "other_tensor", "expected", "released"),
    [
        (False, False, (0, 0, 0), True),
        (True, False, (1, 1 * MiB, 0), True),
        (False, True, (0, 0, 2 * MiB), False),
        (True, True, (1, 1 * MiB, 2 * MiB), False),
    ],
    ids=["only-the-trees-own-tensors", "an-output-held", "another-tensor", "both"],
)
def test_pool_use_leaves_out_the_trees_own_cached_tensors(
    fallback: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    live_output: bool,
    other_tensor: bool,
    expected: tuple[int, int, int],
    released: bool,
) -> None:
    """Inductor's cached tensors of each graph output are the tree's own references: they do
    not keep its pool from going back. Outputs of the current path that the program holds are
    copied out of the pool first (and stay valid: they are not fenced as stale); any other
    tensor allocated in the pool keeps it."""
    manager, segments = recorded_tree(live_output, other_tensor)
    fallback.live["segments"] = segments
    monkeypatch.setattr(fallback, "_storage_tensor", lambda ref: ("tensor over", ref()))
    use = fallback._pool_use(manager)
    assert use.reserved == 6 * MiB
    assert (use.outputs, use.output_bytes, use.tensors) == expected
    assert use.in_use() == (expected != (0, 0, 0))
    assert use.movable() == (live_output and not other_tensor)

    fallback._TREES.add(manager)
    done, note = fallback.release_idle_graph_pools(0, MiB)
    assert done == released
    assert "the CUDA graph pool of 2 compiled function(s) ('fw', 'bw') holds 6.00 MiB" in note
    if live_output and released:
        assert fallback.bindings.moved == [("tensor over", 0x2000)]
        assert "released (1 output(s) it held, 1.00 MiB, copied out first)" in note
        assert fallback.graph_pool_releases()["outputs_moved"] == 1
    else:
        assert fallback.bindings.moved == []
    if other_tensor:
        assert "kept:" in note and "2.00 MiB of tensors are alive in it" in note
    if released:
        assert manager.graph is None
        assert all(node.graph is None for node in fallback._tree_nodes(manager))
        assert all(node.cached_removed for node in fallback._tree_nodes(manager))


def test_pool_whose_forward_waits_for_its_backward_is_kept(
    fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs of a forward whose backward has not run are the backward's saved tensors: the
    pool stays under them, mid-step, and nothing is copied."""
    manager, segments = recorded_tree(live_output=True, other_tensor=False)
    manager.running_forwards_with_pending_backwards = True  # type: ignore[attr-defined]
    fallback.live["segments"] = segments
    monkeypatch.setattr(fallback, "_storage_tensor", lambda ref: ("tensor over", ref()))
    fallback._TREES.add(manager)
    done, note = fallback.release_idle_graph_pools(0, MiB)
    assert not done
    assert "(a forward's, whose backward has not run yet)" in note
    assert fallback.bindings.moved == []
    assert manager.graph is not None


def test_pool_whose_held_outputs_cannot_be_copied_out_is_kept(
    fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room even for the copies of the held outputs: the pool stays, its graphs too (the
    outputs keep their data), and the out-of-memory note says why."""
    manager, segments = recorded_tree(live_output=True, other_tensor=False)
    fallback.live["segments"] = segments
    monkeypatch.setattr(fallback, "_storage_tensor", lambda ref: ("tensor over", ref()))
    fallback.bindings.fail = RuntimeError("CUDA out of memory")
    fallback._TREES.add(manager)
    done, note = fallback.release_idle_graph_pools(0, MiB)
    assert not done
    assert (
        "kept: 1 output(s) of its graphs (1.00 MiB) are still held by the program, and "
        "copying them out of it failed (CUDA out of memory)"
    ) in note
    assert manager.graph is not None
    assert fallback.graph_pool_releases() == {"count": 0, "bytes": 0, "outputs_moved": 0}


def test_pool_that_cannot_be_read_is_kept(
    fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fallback, "_pool_segments", lambda device, pool: None)
    manager = FakeManager()
    fallback._TREES.add(manager)
    released, note = fallback.release_idle_graph_pools(0, MiB)
    assert not released
    assert "kept: the allocator's snapshot does not show it" in note
    assert manager.graph is not None


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


def test_a_region_with_its_own_graph_ends_its_warm_up_before_a_library_catches_it(
    compile_fx: ModuleType, fallback: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for graph trees: the one graph's warm-up runs as a graph pool step, and its first
    allocation that does not fit ends it before the library can go on with its other plan."""
    stubs = Stubs()
    monkeypatch.setattr(compile_fx, "cudagraphify_impl", single_graph_impl(stubs))
    region = LibraryThatFallsBack(stubs, fallback.bindings)
    x, stats = torch.ones(3), torch.zeros(2)
    fn = single_compile(compile_fx, region)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = run_steps(fn, x, stats, steps=3)
    expected, expected_stats = reference(steps=3)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))
    assert torch.equal(stats, expected_stats)
    assert "library fell back" not in region.calls
    assert region.calls == ["plain", "plain", "plain"]
    assert len(fallback_warnings(caught, fallback)) == 1
    assert fallback.bindings.pool_steps == 0


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

import torch_lms._C
import torch_lms.lms

assert "torch._inductor.cudagraph_trees" not in sys.modules
assert "torch_lms._lms_cudagraphs" not in sys.modules, "imported before Inductor was"
from torch._inductor import compile_fx, cudagraph_trees

import torch_lms._lms_cudagraphs as fallback

print(cudagraph_trees.CUDAGraphTreeManager._lms_graph_pool_fallback)
print(getattr(compile_fx.cudagraphify, "_lms_graph_pool_fallback", False))
print(getattr(cudagraph_trees.CUDAGraphNode._record, "_lms_resident_inputs", False))
print(torch_lms._C.releasers == [fallback.release_idle_graph_pools])
"""

# The engine's hook for the last resort of its allocation path, as the bindings have it.
RELEASER_BINDING = """
releasers = []


def _cuda_lms_registerOutsideReleaser(release):
    releasers.append(release)
"""


def test_lms_module_installs_the_fallback_when_inductor_is_imported(tmp_path: Path) -> None:
    """As the drop-in extension ships the modules: lms.py wraps Inductor's tree manager and
    cudagraphify when they are imported, through the module beside it, which hands the release
    of idle graph pools to the engine once."""
    env = build_fake_torch_lms(tmp_path, [FALLBACK_PY.name], bindings=RELEASER_BINDING)
    assert run_python(env, HOOK_SCRIPT).split() == ["True", "True", "True", "True"]


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
