"""Recompute instead of paging (``torch.cuda.set_recompute_lms``): storages whose producing
operator is pure are dropped where recomputing them beats the bus, and come back bit-identical
when an operator needs them. Every case drops explicitly (``torch.cuda.reclaim_inactive``) or
under a cap, and checks what was dropped, what was recomputed and what came back."""

from __future__ import annotations

from typing import Any, Callable

import pytest

pytest.importorskip("torch.nn", reason="PyTorch is not installed")
import torch

from tests.regression.lms_regression_harness import (
    MiB,
    check_capped_training,
    deterministic,
    lms_summary,
    storage_state,
)

F = torch.nn.functional

# Without a GPU or without LMS, the suite's conftest skips every test with its reason.
if hasattr(torch.cuda, "set_enabled_lms") and not hasattr(torch.cuda, "set_recompute_lms"):
    pytest.skip(
        "this LMS build has no recompute (torch.cuda.set_recompute_lms)",
        allow_module_level=True,
    )


def _small(seed: int, rows: int, cols: int) -> torch.Tensor:
    """Under the 1 MiB size threshold: never paged out, so a recipe's inputs stay resident."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(rows, cols, device="cuda", generator=g)
    assert t.numel() * t.element_size() < MiB
    return t


def _measure_bus() -> None:
    """Pages a tensor without a recipe out and in: the engine then knows the bus's speed,
    which a drop needs."""
    z = torch.randn(1 << 21, device="cuda")  # random: never a recipe
    z.add_(0)
    torch.cuda.synchronize()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(z) == "paged out"
    z.add_(0)
    torch.cuda.synchronize()
    stats = torch.cuda.lms_stats()
    assert stats["copy_out_ms"] > 0 and stats["copy_in_ms"] > 0


def _warm(op: Callable[[], Any]) -> None:
    """Runs ``op`` once: its first run includes libraries' lazy initialization (a cuBLAS
    handle), which LMS's cost model rightly sees as expensive; the runs after it price it."""
    op()
    torch.cuda.synchronize()


def _product(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x @ w of two resident inputs: a 64 MiB output whose recipe (mm) costs next to nothing."""
    x, w = _small(seed, 4096, 32), _small(seed + 1, 32, 4096)
    return x, w, x @ w


def _on() -> None:
    deterministic()
    torch.cuda.set_enabled_lms(True)
    torch.cuda.set_recompute_lms(True)
    _measure_bus()
    torch.cuda.reset_accumulated_lms_stats()


def test_dropped_storages_are_recomputed_bit_identical_and_recursively(
    record: Callable[[str, Any], None],
) -> None:
    _on()
    x, w = _small(1, 4096, 32), _small(2, 32, 4096)
    F.gelu(x @ w)  # warm-up: see _warm
    torch.cuda.synchronize()
    y = x @ w  # 64 MiB, recipe: mm of two resident inputs
    g = F.gelu(y)  # 64 MiB, recipe: gelu of y
    want_y, want_g = y.cpu(), g.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "dropped"
    assert storage_state(g) == "dropped"
    stats = torch.cuda.lms_stats()
    assert stats["drop_count"] == 2
    assert stats["drop_bytes"] == 2 * 64 * MiB
    assert stats["dropped_bytes"]["current"] == 2 * 64 * MiB
    assert stats["pageout_count"] == 0
    # g's recompute needs y: it is recomputed first.
    assert torch.equal(g.cpu(), want_g)
    assert storage_state(y) != "dropped"
    assert torch.equal(y.cpu(), want_y)
    torch.cuda.synchronize()
    stats = torch.cuda.lms_stats()
    assert stats["recompute_count"] == 2
    assert stats["recompute_bytes"] == 2 * 64 * MiB
    assert stats["recompute_ms"] > 0
    assert stats["dropped_bytes"]["current"] == 0
    assert stats["pagein_count"] == 0
    record("lms", lms_summary(stats))
    del x, w, y, g
    torch.cuda.synchronize()
    assert torch.cuda.lms_stats()["dropped_bytes"]["current"] == 0


def test_a_write_to_an_input_recomputes_its_dependents_first() -> None:
    _on()
    x, _w, y = _product(3)
    want = y.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "dropped"
    x.add_(1)  # y's recipe would now make something else
    assert storage_state(y) != "dropped"
    assert torch.cuda.lms_stats()["recompute_count"] == 1
    assert torch.equal(y.cpu(), want)
    # Its recipe is gone with the write: y is paged out from now on.
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "paged out"
    assert torch.equal(y.cpu(), want)


def test_a_write_to_the_output_invalidates_its_recipe() -> None:
    _on()
    _x, _w, y = _product(5)  # kept: a recipe holds its inputs weakly
    y[0].mul_(2)  # through a view: the version counter is shared
    want = y.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "paged out"
    assert torch.equal(y.cpu(), want)


def test_costly_storages_are_paged_out() -> None:
    _on()
    big = torch.ones(1 << 24, device="cuda")
    # Recomputing s (16 MiB) would need all of big (64 MiB) paged in after it: dearer
    # than paging s out and in.
    s = big[: 1 << 22] * 3
    want_s = s.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(big) == "paged out"
    assert storage_state(s) == "paged out"
    assert torch.equal(s.cpu(), want_s)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_dropout_replays_with_its_saved_generator_state(autocast: bool) -> None:
    """A dropped dropout output comes back with the same mask although the program drew
    from the generator since, and the replay leaves the program's generator where it was.
    Under autocast the recipe is the inner native_dropout (dropout has no autocast kernel,
    native_dropout a CUDA kernel and none for autocast)."""
    _on()
    row = _small(3, 1, 4096)  # under the size threshold: stays resident
    h = row.expand(4096, 4096)  # kept: a recipe holds its inputs weakly

    def make() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return F.dropout(h, p=0.5, training=True)  # 64 MiB, contiguous

    _warm(make)
    torch.cuda.manual_seed(11)
    d = make()
    want = d.cpu()
    drawn = torch.cuda.get_rng_state()
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(d) == "dropped"
    torch.rand(1000, device="cuda")  # the program's random stream moves on
    moved = torch.cuda.get_rng_state()
    assert not torch.equal(moved, drawn)
    assert torch.equal(d.cpu(), want)  # recomputed: the same mask
    assert torch.equal(torch.cuda.get_rng_state(), moved), "the replay moved the generator"
    ops = torch.cuda.lms_recompute_operators()
    name = "aten::native_dropout" if autocast else "aten::dropout"
    assert name in ops, ops
    assert ops[name]["drop_count"] == 1 and ops[name]["recompute_count"] == 1, ops
    assert ops[name]["recompute_bytes"] == d.numel() * d.element_size()


BATCH_NORMS = (
    "aten::batch_norm",
    "aten::_batch_norm_impl_index",
    "aten::_batch_norm_with_update",
    "aten::native_batch_norm",
    "aten::_native_batch_norm_legit",
    "aten::cudnn_batch_norm",
)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_training_batch_norm_replays_without_updating_running_statistics(
    autocast: bool,
) -> None:
    """A training-mode batch norm output is dropped and comes back with the same bits, and
    the module's running statistics change once, in its own run: the replay updates copies
    of them. Its input (16 MiB, random: no recipe) is paged out after the drop and paged in
    for the replay. In evaluation mode the output reads the running statistics: no recipe,
    it is paged out."""
    _on()
    bn = torch.nn.BatchNorm2d(64).cuda().train()
    g = torch.Generator(device="cuda").manual_seed(21)
    x = torch.randn(16, 64, 64, 64, device="cuda", generator=g) * 3 + 1

    def make() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return bn(x)

    _warm(make)
    before = bn.running_mean.clone(), bn.running_var.clone()
    y = make()  # 16 MiB
    want = y.cpu()
    after = bn.running_mean.clone(), bn.running_var.clone()
    assert not torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(y) == "dropped"
    assert storage_state(x) == "paged out"
    assert torch.equal(y.cpu(), want)  # replayed: the same bits
    assert torch.equal(bn.running_mean, after[0]), "the replay updated running_mean"
    assert torch.equal(bn.running_var, after[1]), "the replay updated running_var"
    ops = torch.cuda.lms_recompute_operators()
    replayed = [n for n in BATCH_NORMS if ops.get(n, {}).get("recompute_count", 0) > 0]
    assert len(replayed) == 1, ops
    assert ops[replayed[0]]["drop_count"] == 1, ops
    assert torch.cuda.lms_stats()["recompute_count"] == 1
    bn.eval()
    z = make()
    want_z = z.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(z) == "paged out"
    assert torch.equal(z.cpu(), want_z)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_an_in_place_relu_extends_the_batch_norm_recipe(autocast: bool) -> None:
    """relu(inplace=True) on a training-mode batch norm's output (torchvision's ResNets)
    writes the output, which used to invalidate its recipe: the output was paged out. The
    in-place relu is now a step of the recipe, replayed after the batch norm: the output is
    dropped and comes back with the same bits, negatives clamped. A second write that is no
    step (a mul_) still invalidates it."""
    _on()
    bn = torch.nn.BatchNorm2d(64).cuda().train()
    g = torch.Generator(device="cuda").manual_seed(23)
    x = torch.randn(16, 64, 64, 64, device="cuda", generator=g) * 3 + 1

    def make() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return F.relu(bn(x), inplace=True)

    _warm(make)
    y = make()  # 16 MiB
    want = y.cpu()
    assert (want >= 0).all() and (want == 0).any()
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(y) == "dropped"
    assert torch.equal(y.cpu(), want)  # the batch norm, then the relu: the same bits
    ops = torch.cuda.lms_recompute_operators()
    replayed = [n for n in BATCH_NORMS if ops.get(n, {}).get("recompute_count", 0) > 0]
    assert len(replayed) == 1, ops
    assert torch.cuda.lms_stats()["recompute_count"] == 1
    y.mul_(2)
    want = y.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "paged out"
    assert torch.equal(y.cpu(), want)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_a_residual_add_and_relu_extend_the_batch_norm_recipe(autocast: bool) -> None:
    """A bottleneck's last batch norm output takes the residual in place and then the relu
    (torchvision: ``out += identity; out = relu(out)``): both writes are steps of the batch
    norm's recipe, so the block's output is dropped, not paged, and comes back with the same
    bits. The residual is held (as the next block's convolution holds it); a residual that
    died before the drop leaves the recipe nothing to replay from, and the output is paged
    out."""
    _on()
    bn = torch.nn.BatchNorm2d(64).cuda().train()
    g = torch.Generator(device="cuda").manual_seed(29)
    x = torch.randn(16, 64, 64, 64, device="cuda", generator=g) * 3 + 1
    identity = torch.randn(16, 64, 64, 64, device="cuda", generator=g)

    def make(residual: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = bn(x)
            out += residual()
            return F.relu(out, inplace=True)

    _warm(lambda: make(lambda: identity))
    y = make(lambda: identity)
    want = y.cpu()
    assert (want == 0).any() and (want > 0).any()
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(y) == "dropped"
    assert storage_state(identity) != "dropped"
    assert torch.equal(y.cpu(), want)  # batch norm, add_, relu_: the same bits
    assert torch.cuda.lms_stats()["recompute_count"] == 1
    ops = torch.cuda.lms_recompute_operators()
    assert sum(ops.get(n, {}).get("recompute_count", 0) for n in BATCH_NORMS) == 1, ops
    del y
    # The residual is a temporary (a flip of x) that dies after the add.
    z = make(lambda: x.flip(0))
    want = z.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(z) == "paged out"
    assert torch.equal(z.cpu(), want)


@pytest.mark.parametrize("autocast", [False, True], ids=["cast", "autocast-linear"])
def test_a_cast_of_a_recipe_output_gets_a_recipe_of_its_own(autocast: bool) -> None:
    """A layer norm's float output cast to bfloat16 (autocast does it for the matrix product
    after it, which saves the cast) dies after the cast; the cast gets a recipe of its own,
    the layer norm then the cast, and is dropped and comes back with the same bits. Under
    autocast the cast is the one the product saves for its backward."""
    _on()
    ln = torch.nn.LayerNorm(4096).cuda()
    # Requires grad: the product then saves its input (the cast) for the weight's gradient.
    w = _small(51, 16, 4096).requires_grad_()
    g = torch.Generator(device="cuda").manual_seed(52)
    x = torch.randn(2048, 4096, device="cuda", generator=g)  # 32 MiB

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        if not autocast:
            cast = ln(x).to(torch.bfloat16)
            return cast, cast
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.linear(ln(x), w)
        saved = y.grad_fn._saved_self  # type: ignore[union-attr]  # the bf16 cast mm saves
        return y, saved

    _warm(make)
    y, cast = make()
    assert cast.dtype == torch.bfloat16 and cast.shape == (2048, 4096)
    want = cast.cpu()
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(cast) == "dropped"
    assert torch.equal(cast.cpu(), want)
    assert torch.cuda.lms_stats()["recompute_count"] == 1
    ops = torch.cuda.lms_recompute_operators()
    assert any("layer_norm" in n and c.get("recompute_count", 0) for n, c in ops.items()), ops
    del y


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_a_copy_of_a_saved_tensor_gets_a_recipe_of_its_own(autocast: bool) -> None:
    """Attention's head merge: the attention's output, which its operator saves for its
    backward (here the test holds it), transposed and reshaped for the projection, which
    saves the copy. The copy (``aten::clone``, which ``reshape`` calls) is a recipe of its own
    with the held tensor as its argument: dropped, not paged, and back with the same bits. A
    copy whose source died before the drop is paged out. (Whether the output of
    ``scaled_dot_product_attention`` needs the copy depends on the backend's layout: the
    memory-efficient kernel's transposed output merges as a view.)"""
    _on()
    b, h, t, d = 8, 16, 512, 64
    g = torch.Generator(device="cuda").manual_seed(61)
    w = _small(62, 64, h * d).requires_grad_()

    def make(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            merged = y.transpose(1, 2).reshape(b, t, h * d)
            return F.linear(merged, w), merged

    y = torch.randn(b, h, t, d, device="cuda", generator=g)  # 16 MiB
    _warm(lambda: make(y))
    out, merged = make(y)
    assert merged.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    want = merged.cpu()
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(merged) == "dropped"
    assert torch.equal(merged.cpu(), want)
    assert torch.cuda.lms_stats()["recompute_count"] == 1
    ops = torch.cuda.lms_recompute_operators()
    assert ops.get("aten::clone", {}).get("recompute_count", 0) == 1, ops
    del out, merged
    # The source is a temporary that dies after the copy.
    _out, merged = make(torch.randn(b, h, t, d, device="cuda", generator=g))
    want = merged.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(merged) == "paged out"
    assert torch.equal(merged.cpu(), want)


def _residual_recipes(enable: bool) -> None:
    if not hasattr(torch.cuda, "set_residual_recipes_lms"):
        pytest.skip("this LMS build has no residual recipes (torch.cuda.set_residual_recipes_lms)")
    torch.cuda.set_residual_recipes_lms(enable)


@pytest.mark.parametrize("order", ["x+proj", "proj+x"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_a_residual_sum_gets_the_projections_recipe_then_the_sum(
    autocast: bool, order: str
) -> None:
    """A transformer block's residual, ``x + proj(a)``: the projection's output dies after the
    sum, while ``x`` (which the next layer norm saves) and ``a`` (which the projection saves)
    live on. With residual recipes on, the sum gets a recipe of its own, the projection then
    the sum, whichever side the projection is on: it is dropped, not paged out, and comes back
    with the same bits. Under autocast the sum is float32 ``x`` plus the bfloat16 projection.
    With residual recipes off the sum has no recipe and is paged out."""
    _on()
    _residual_recipes(True)
    a = _small(81, 2048, 64)
    w = _small(82, 2048, 64).requires_grad_()  # the projection saves its input
    g = torch.Generator(device="cuda").manual_seed(83)
    x = torch.randn(2048, 2048, device="cuda", generator=g)  # 16 MiB, random: no recipe

    def make() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            proj = F.linear(a, w)
            return x + proj if order == "x+proj" else proj + x

    _warm(make)
    out = make()
    assert out.dtype == torch.float32 and out.shape == (2048, 2048)
    want = out.detach().cpu()
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(out) == "dropped"
    assert torch.equal(out.detach().cpu(), want)
    stats = torch.cuda.lms_stats()
    assert stats["drop_count"] >= 1 and stats["recompute_count"] >= 1, lms_summary(stats)
    del out
    _residual_recipes(False)
    out = make()
    want = out.detach().cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(out) == "paged out"
    assert torch.equal(out.detach().cpu(), want)


def test_a_residual_stream_derives_from_each_projection() -> None:
    """Two blocks of a residual stream, ``x1 = x0 + proj(a)`` and ``x2 = x1 + proj(b)``: both
    sides of the second sum are recipes' outputs, and its recipe derives from the projection
    (no steps), not from ``x1``'s own sum, whose other side (the first projection's output)
    has died. Both sums are dropped; recomputing ``x2`` recomputes ``x1`` first, and both come
    back with their bits."""
    _on()
    _residual_recipes(True)
    a, b = _small(91, 2048, 64), _small(92, 2048, 64)
    w1 = _small(93, 2048, 64).requires_grad_()
    w2 = _small(94, 2048, 64).requires_grad_()
    g = torch.Generator(device="cuda").manual_seed(95)
    x0 = torch.randn(2048, 2048, device="cuda", generator=g)  # 16 MiB, random: no recipe

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        x1 = x0 + F.linear(a, w1)
        return x1, x1 + F.linear(b, w2)

    _warm(make)
    x1, x2 = make()
    want1, want2 = x1.detach().cpu(), x2.detach().cpu()
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    assert torch.cuda.reclaim_inactive() > 0
    assert storage_state(x1) == "dropped"
    assert storage_state(x2) == "dropped"
    assert torch.equal(x2.detach().cpu(), want2)
    assert storage_state(x1) != "dropped"  # recomputed first, as x2's input
    assert torch.equal(x1.detach().cpu(), want1)
    assert torch.cuda.lms_stats()["recompute_count"] >= 2


def test_a_foreach_write_to_an_input_recomputes_its_dependents_first() -> None:
    """The optimizers' fused foreach kernels (``torch._foreach_add_`` and the like) write a
    list of tensors with no operator per tensor: a dropped storage whose recipe reads one of
    them is recomputed before the write, as before any other write, with the bits it had."""
    _on()
    x, _w, y = _product(71)
    want = y.cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "dropped"
    torch._foreach_add_([x], [torch.ones_like(x)])
    assert storage_state(y) != "dropped"
    assert torch.cuda.lms_stats()["recompute_count"] == 1
    assert torch.equal(y.cpu(), want)


def test_a_cuda_graph_captures_while_recipes_are_recorded() -> None:
    """Recording a recipe times its operator with CUDA events, whose queries are illegal
    while a CUDA graph capture is under way, and a graph's memory is never dropped anyway:
    operators captured into a graph record no recipe, the capture and its replays work, and
    the same product outside the capture still gets a recipe and is dropped."""
    _on()  # recompute on; its bus measurement is a reclaim, so recipes are recorded
    x, w = _small(81, 4096, 32), _small(82, 32, 4096)

    def op() -> torch.Tensor:
        return x @ w  # 64 MiB, a recipe of two resident inputs

    _warm(op)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as graph capture asks
        op()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op()
    graph.replay()
    torch.cuda.synchronize()
    want = op()
    assert torch.equal(captured, want)
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_lms_stats()
    torch.cuda.reclaim_inactive()
    assert storage_state(want) == "dropped"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)
    del graph, captured


def test_chains_of_replays_stay_short() -> None:
    """Five storages each made from the one before (a product, then gelus), all held: a
    reclaim drops no more of them in a row than three replays (kMaxChainReplays in
    LmsRecipeReplay.cpp), so recomputing one never replays a long chain at once; the others are
    paged out. Every one comes back with its bits."""
    _on()
    x, w = _small(41, 4096, 32), _small(42, 32, 4096)
    _warm(lambda: F.gelu(x @ w))
    chain = [x @ w]  # 64 MiB each
    for _ in range(4):
        chain.append(F.gelu(chain[-1]))
    want = [t.cpu() for t in chain]
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    states = [storage_state(t) for t in chain]
    assert "dropped" in states and "paged out" in states, states
    run = longest = 0
    for state in states:
        run = run + 1 if state == "dropped" else 0
        longest = max(longest, run)
    assert longest <= 3, states
    for got, expected in zip(reversed(chain), reversed(want)):
        assert torch.equal(got.cpu(), expected)


def test_recompute_off_pages_out() -> None:
    _on()
    torch.cuda.set_recompute_lms(False)
    assert not torch.cuda.get_recompute_lms()
    _x, _w, y = _product(7)
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "paged out"
    assert torch.cuda.lms_stats()["drop_count"] == 0


def test_autocast_replays_the_inner_operator_with_its_casted_arguments() -> None:
    _on()
    x = _small(9, 4096, 32).requires_grad_()
    w = _small(10, 4096, 32).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _warm(lambda: F.linear(x, w))
        y = F.linear(x, w)  # bf16 32 MiB; autograd keeps the casted arguments
    assert y.dtype == torch.bfloat16
    want = y.detach().float().cpu()
    torch.cuda.synchronize()
    torch.cuda.reclaim_inactive()
    assert storage_state(y) == "dropped"
    # Replayed outside autocast, as the inner linear it was: the same bf16 bits.
    assert torch.equal(y.detach().float().cpu(), want)
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None


class TokenMLP(torch.nn.Module):
    """Residual blocks of layer norm, linear layers and GELU: every activation they save is
    the output of a pure operator that recomputes in far less time than the bus takes to move
    it. (Convolutions are covered by the models of test_models.py and the stress suite run
    with recompute on: a capped convolution here also meets cuDNN's workspace under the cap.)
    """

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=1))


class DropoutAttention(torch.nn.Module):
    """Attention blocks with dropout on the attention probabilities. Softmax's backward saves
    the probabilities, so dropping dropout's output keeps nothing alive that would have died;
    its replay must draw the same mask, or training diverges from the uncapped run."""

    def __init__(self, width: int = 256, depth: int = 6, p: float = 0.1) -> None:
        super().__init__()
        self.p = p
        self.scale = width**-0.5
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(depth))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(depth))
        self.out = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, qkv, out in zip(self.norms, self.qkv, self.out):
            q, k, v = qkv(norm(x)).chunk(3, dim=-1)
            probs = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
            x = x + out(F.dropout(probs, self.p, self.training) @ v)
        return self.head(x.mean(dim=1))


def _train_tokens_at_half_the_peak(
    make_model: Callable[[], torch.nn.Module],
    shape: tuple[int, int, int],
    seed: int,
    record: Callable[[str, Any], None],
) -> None:
    """check_capped_training with recompute on, on random tokens of ``shape`` (batch,
    sequence, width) and ten classes, capped at half the peak."""
    deterministic()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(seed + step)
        tokens = torch.randn(*shape, device="cuda", generator=g)
        return tokens, torch.randint(0, 10, (shape[0],), device="cuda", generator=g)

    check_capped_training(
        make_model,
        batch,
        F.cross_entropy,
        steps=4,
        record=record,
        cap_share=0.5,
        recompute=True,
    )


def test_training_with_dropout_under_a_cap_is_bit_identical_with_recompute(
    record: Callable[[str, Any], None],
) -> None:
    _train_tokens_at_half_the_peak(lambda: DropoutAttention().cuda(), (16, 1024, 256), 700, record)
    # The capped run's counts (the run without LMS after it drops nothing).
    ops = torch.cuda.lms_recompute_operators()
    record("recompute_operators", ops)
    dropout = ops.get("aten::dropout", {})
    assert dropout.get("recompute_count", 0) > 0, f"no dropout output was recomputed: {ops}"


def test_training_under_a_cap_is_bit_identical_with_recompute(
    record: Callable[[str, Any], None],
) -> None:
    _train_tokens_at_half_the_peak(lambda: TokenMLP().cuda(), (32, 512, 1024), 500, record)
