"""Tensor semantics under Large Model Support: every case pages storages out explicitly
(torch.cuda.reclaim_inactive) and checks that what comes back is bit-identical."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch

from lmsbench.harness import worker_env
from tests.regression.lms_regression_harness import (
    MiB,
    deterministic,
    host_bytes,
    lms_summary,
    settle,
    storage_state,
)

N = 1 << 20  # 4 MiB of float32: above the default 1 MiB size threshold


def _data(seed: int, n: int = N) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, device="cuda", generator=g)


def _use(*tensors: torch.Tensor) -> None:
    """Runs an operator on each tensor, so LMS manages it and it becomes inactive."""
    for t in tensors:
        t.add_(0)
    torch.cuda.synchronize()


def _page_out(*tensors: torch.Tensor) -> None:
    _use(*tensors)
    assert torch.cuda.reclaim_inactive() > 0
    for t in tensors:
        assert storage_state(t) == "paged out"


def test_views_inplace_and_foreach(record: Callable[[str, Any], None]) -> None:
    torch.cuda.set_enabled_lms(True)
    base = _data(1)
    expected = base.cpu()
    view = base[1::2]
    _page_out(base)
    # In-place through a view pages the storage in; the base sees the write.
    view.mul_(2)
    expected[1::2] *= 2
    assert storage_state(base) in ("inactive", "allocated")
    _page_out(base)
    assert torch.equal(base.cpu(), expected)

    # Tensor lists: every storage of every list is resident while the operator runs.
    xs = [_data(10 + i) for i in range(4)]
    ys = [_data(20 + i) for i in range(4)]
    want = [(x.cpu() + y.cpu()) * 2 for x, y in zip(xs, ys)]
    _page_out(*xs, *ys)
    torch._foreach_add_(xs, ys)
    _page_out(*xs)
    torch._foreach_mul_(xs, 2.0)
    _page_out(*xs)
    for x, w in zip(xs, want):
        assert torch.equal(x.cpu(), w)
    record("lms", lms_summary(torch.cuda.lms_stats()))


def test_side_stream_and_record_stream() -> None:
    torch.cuda.set_enabled_lms(True)
    x = _data(2)
    expected = (x * 3).cpu()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # A long kernel on the side stream: the page-out must wait for it.
        y = x * 3
        for _ in range(20):
            y = y * 1
        x.record_stream(side)
        y.record_stream(torch.cuda.current_stream())
    torch.cuda.current_stream().wait_stream(side)
    _use(y)
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(y) == "paged out"
    with torch.cuda.stream(side):
        z = y + 0
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(z.cpu(), expected)
    del x, y, z
    settle()


def test_raw_access_of_paged_out_tensors() -> None:
    torch.cuda.set_enabled_lms(True)
    t = _data(3)
    expected = t.cpu()
    _page_out(t)
    ptr = t.data_ptr()
    assert ptr != 0
    # Raw access makes it resident and keeps it off the reclaim list.
    assert storage_state(t) == "allocated"
    torch.cuda.reclaim_inactive()
    assert storage_state(t) == "allocated"
    assert t.data_ptr() == ptr
    assert torch.equal(t.cpu(), expected)

    u = _data(4)
    expected_u = u.cpu()
    _page_out(u)
    assert torch.equal(u.cpu(), expected_u)  # .cpu() is an operator: a page-in
    _page_out(u)
    assert u.untyped_storage().data_ptr() != 0
    assert storage_state(u) == "allocated"
    assert torch.equal(u.cpu(), expected_u)


def _mlp_grads(pages_out: bool) -> list[torch.Tensor]:
    deterministic()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    x = _data(5, 512 * 1024).view(512, 1024)
    loss = model(x).square().mean()
    if pages_out:
        # Saved activations and weights go to host memory between forward and backward;
        # autograd's device thread pages them in.
        torch.cuda.synchronize()
        assert torch.cuda.reclaim_inactive() > 0
    loss.backward()
    return [p.grad.cpu() for p in model.parameters()]


def test_backward_pages_in_saved_tensors_on_autograd_threads() -> None:
    expected = _mlp_grads(pages_out=False)
    torch.cuda.set_enabled_lms(True)
    actual = _mlp_grads(pages_out=True)
    assert torch.cuda.lms_stats()["pagein_count"] > 0
    for a, b in zip(expected, actual):
        assert torch.equal(a, b)

    # Backward started from another Python thread too.
    results: list[list[torch.Tensor]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(_mlp_grads(pages_out=True))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    for a, b in zip(expected, results[0]):
        assert torch.equal(a, b)


def _adam_params(pages_out: bool) -> list[torch.Tensor]:
    deterministic()
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):
        x = _data(100 + step, 256 * 2048).view(256, 2048)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if pages_out:
            torch.cuda.synchronize()
            torch.cuda.reclaim_inactive()
            state = optimizer.state[model.weight]
            assert storage_state(state["exp_avg"]) == "paged out"
            assert storage_state(model.weight) == "paged out"
    return [p.detach().cpu() for p in model.parameters()]


def test_adam_state_survives_page_outs() -> None:
    expected = _adam_params(pages_out=False)
    torch.cuda.set_enabled_lms(True)
    actual = _adam_params(pages_out=True)
    for a, b in zip(expected, actual):
        assert torch.equal(a, b)


def test_torch_compile_with_lms() -> None:
    pytest.importorskip("triton", reason="torch.compile needs Triton for CUDA kernels")
    deterministic()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w) * 2 + x.sum(dim=1, keepdim=True)

    compiled = torch.compile(f)
    x = _data(6, 1024 * 1024).view(1024, 1024)
    w = _data(7, 1024 * 1024).view(1024, 1024)
    expected = compiled(x, w).cpu()  # compiled once, LMS off

    torch.cuda.set_enabled_lms(True)
    _page_out(x, w)
    try:
        actual = compiled(x, w)
    except RuntimeError as exc:  # a clear error is acceptable, a wrong result is not
        assert "Large Model Support" in str(exc) or "LMS" in str(exc), exc
        return
    assert torch.equal(actual.cpu(), expected)
    _page_out(x, w)
    assert torch.equal(compiled(x, w).cpu(), expected)


def test_cuda_graph_capture_with_lms() -> None:
    torch.cuda.set_enabled_lms(True)
    static_x = _data(8)
    w = _data(9)
    _use(static_x, w)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph requires
        static_y = static_x * w + 1
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = static_x * w + 1

    for seed in (10, 11):
        static_x.copy_(_data(seed))
        # Memory a captured graph uses must never move: reclaim must leave it in place.
        torch.cuda.reclaim_inactive()
        assert storage_state(static_x) != "paged out"
        assert storage_state(w) != "paged out"
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y.cpu(), (static_x.cpu() * w.cpu() + 1))

    # Capturing while a tensor is paged out: a clear error, never a wrong graph.
    other = _data(12)
    _page_out(other)
    graph2 = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"(?i)paged out|large model support"):
        with torch.cuda.graph(graph2):
            _ = other * 2
    del graph, graph2, static_x, static_y, w, other
    settle()


# A child process that imports the drop-in while a routing to a private pool is open (inside
# torch.cuda.use_mem_pool), so that the routing's end reaches an allocator that never saw its
# beginning, then captures a CUDA graph with LMS on. The graph's output must be allocated in
# the capture's private pool, never managed by LMS: reclaim_inactive() would page a managed one
# out, and the replay would write where it no longer is.
_ROUTING_BEFORE_IMPORT = """
import torch
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    kept = torch.ones(1 << 20, device="cuda")
    import torch_lms  # noqa: F401  (its allocator is installed inside the routing)
torch.cuda.set_enabled_lms(True)
static_x = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    static_y = static_x * 3 + 1
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_y = static_x * 3 + 1
for step in range(2):
    static_x.add_(1)
    torch.cuda.reclaim_inactive()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y.cpu(), static_x.cpu() * 3 + 1), step
print("managed", torch.cuda.lms_stats()["managed_bytes"]["current"])
"""


def test_a_capture_after_importing_inside_a_pool_routing_uses_its_pool() -> None:
    if "torch_lms" not in sys.modules:
        pytest.skip("the drop-in's allocator routing: a patched build installs no allocator")
    done = subprocess.run(
        [sys.executable, "-c", _ROUTING_BEFORE_IMPORT],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The 16 MiB output lives in the graph's pool: LMS manages static_x alone.
    managed = int(done.stdout.split("managed", 1)[1])
    assert managed < 24 * MiB, done.stdout


def test_memory_returns_to_baseline() -> None:
    settle()
    baseline = torch.cuda.memory_allocated()
    host_baseline = host_bytes()
    # Storages that earlier tests keep alive (compiled-code caches, a captured graph's
    # tensors) were LMS-managed from their allocation and stay so.
    managed_baseline = torch.cuda.lms_stats()["managed_bytes"]["current"]
    torch.cuda.set_enabled_lms(True)
    tensors = [_data(200 + i, 4 * N) for i in range(8)]
    _page_out(*tensors)
    stats = torch.cuda.lms_stats()
    assert stats["pagedout_bytes"]["current"] >= 8 * 16 * MiB
    assert stats["host_bytes"]["current"] >= 8 * 16 * MiB
    for t in tensors[:4]:
        t.add_(1)  # page some back in
    del tensors, t
    settle()
    assert torch.cuda.memory_allocated() == baseline
    stats = torch.cuda.lms_stats()
    assert stats["managed_bytes"]["current"] == managed_baseline
    # Only those earlier storages may still be paged out, and only they hold host memory.
    assert stats["pagedout_bytes"]["current"] <= managed_baseline
    # (a host buffer is rounded up to at most twice its storage)
    assert host_bytes() <= host_baseline + 2 * stats["pagedout_bytes"]["current"]
    summary = torch.cuda.memory_summary()
    assert "Large Model Support" in summary
    assert "lms.pageout_count" in torch.cuda.memory_stats()
