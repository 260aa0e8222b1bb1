"""torch/cuda/_lms_graph.py on the CPU: the lms::page_in_ahead operator, the post-grad pass that
inserts it into hand-built FX graphs and into graphs that torch.compile (Inductor) compiles,
and its installation into Inductor's configuration, against fake bindings."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fake_torch_lms import ENGINE, build_fake_torch_lms, load_engine_module, run_python

torch = pytest.importorskip("torch", reason="needs a torch wheel (the CPU one is enough)")

GRAPH_PY = ENGINE / "_lms_graph.py"
MODULE_NAME = "lms_graph_under_test"
HINT_CALL = "torch.ops.lms.page_in_ahead.default("
aten = torch.ops.aten


def load_graph_module() -> ModuleType:
    return load_engine_module(MODULE_NAME, GRAPH_PY)


class FakeBindings:
    """The _cuda_lms_* bindings the module reads; records page-in requests."""

    def __init__(self) -> None:
        self.enabled = True
        self.graph_prefetch = True
        self.size = 0
        self.page_ins: list[list[torch.Tensor]] = []

    def _cuda_lms_getEnabled(self) -> bool:
        return self.enabled

    def _cuda_lms_getGraphPrefetch(self) -> bool:
        return self.graph_prefetch

    def _cuda_lms_getSize(self) -> int:
        return self.size

    def _cuda_lms_pageInAhead(self, tensors: list[torch.Tensor]) -> None:
        self.page_ins.append(list(tensors))


@pytest.fixture
def lms_graph(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = load_graph_module()
    fake = FakeBindings()
    monkeypatch.setattr(module, "_lms_bindings", lambda: fake)
    module.fake = fake  # type: ignore[attr-defined]
    return module


@pytest.fixture
def cpu_pages(lms_graph: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    """Lets CPU tensors through to the fake page-in binding (the real filter keeps CUDA ones)."""
    monkeypatch.setattr(lms_graph, "_pageable", lambda tensors: list(tensors))
    return lms_graph.fake.page_ins


# ---------------------------------------------------------------------------------------------
# Hand-built graphs


def add_input(graph: torch.fx.Graph, name: str, numel: int = 256) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = torch.zeros(numel)  # 1 KiB by default
    return node


def sample_graph() -> torch.fx.Graph:
    r"""Inputs a..e of 1 KiB, s of 4 bytes, u used only by the output, k not a tensor.

    First uses: c (n0), a (n1), b (n3), e (n4), s (n4s), d (n5); a is used again by n3a.
    """
    graph = torch.fx.Graph()
    a, b, c, d, e = (add_input(graph, name) for name in "abcde")
    s = add_input(graph, "s", numel=1)
    u = add_input(graph, "u")
    k = graph.placeholder("k")
    k.meta["val"] = 3
    n0 = graph.call_function(aten.neg.default, (c,))
    n1 = graph.call_function(aten.add.Tensor, (n0, a))
    n2 = graph.call_function(aten.mul.Tensor, (n1, k))
    n3 = graph.call_function(aten.add.Tensor, (n2, b))
    n3a = graph.call_function(aten.add.Tensor, (n3, a))
    n4 = graph.call_function(aten.add.Tensor, (n3a, e))
    n4s = graph.call_function(aten.add.Tensor, (n4, s))
    n5 = graph.call_function(aten.add.Tensor, (n4s, d))
    for node, name in zip((n0, n1, n2, n3, n3a, n4, n4s, n5), "n0 n1 n2 n3 n3a n4 n4s n5".split()):
        node.name = name
    graph.output((n5, u))
    return graph


def layout(graph: torch.fx.Graph) -> list[Any]:
    """The compute nodes in order, each hint as the list of the input names it carries."""
    out: list[Any] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.lms.page_in_ahead.default:
            out.append([arg.name for arg in node.args[0]])
        else:
            out.append(node.name)
    return out


def test_hints_follow_first_use_strictly_after_each_node(lms_graph: ModuleType) -> None:
    graph = sample_graph()
    assert lms_graph.insert_page_in_hints(graph, window=2, min_bytes=1024) == 5
    graph.lint()
    # First-use order c, a, b, e, d (s is below the size threshold; u and k are left out).
    assert layout(graph) == [
        ["c", "a"],  # before the first compute node: the first window
        ["a", "b"],  # n0 first uses c: the next ones whose first use is after n0
        "n0",
        ["b", "e"],
        "n1",
        "n2",
        ["e", "d"],
        "n3",
        "n3a",  # a second use of a: no hint
        ["d"],
        "n4",
        "n4s",
        "n5",  # nothing is first used after n5: no hint
    ]


def test_hints_without_size_threshold_use_the_whole_window(lms_graph: ModuleType) -> None:
    graph = sample_graph()
    assert lms_graph.insert_page_in_hints(graph) == 6
    assert layout(graph) == [
        ["c", "a", "b", "e", "s", "d"],
        ["a", "b", "e", "s", "d"],
        "n0",
        ["b", "e", "s", "d"],
        "n1",
        "n2",
        ["e", "s", "d"],
        "n3",
        "n3a",
        ["s", "d"],
        "n4",
        ["d"],
        "n4s",
        "n5",
    ]


def test_window_caps_each_hint(lms_graph: ModuleType) -> None:
    assert lms_graph.PAGE_IN_AHEAD_WINDOW == 16
    graph = torch.fx.Graph()
    inputs = [add_input(graph, f"p{i}") for i in range(20)]
    acc = graph.call_function(aten.neg.default, (inputs[0],))
    for node in inputs[1:]:
        acc = graph.call_function(aten.add.Tensor, (acc, node))
    graph.output(acc)
    assert lms_graph.insert_page_in_hints(graph) == 20
    hints = [entry for entry in layout(graph) if isinstance(entry, list)]
    assert hints[0] == [f"p{i}" for i in range(16)]
    assert hints[1] == [f"p{i}" for i in range(1, 17)]
    assert hints[5] == [f"p{i}" for i in range(5, 20)]
    assert hints[-1] == ["p19"]
    assert max(len(hint) for hint in hints) == 16


def test_inputs_sharing_a_first_user(lms_graph: ModuleType) -> None:
    graph = torch.fx.Graph()
    x, y, z = (add_input(graph, name) for name in "xyz")
    n0 = graph.call_function(aten.add.Tensor, (y, x))
    n1 = graph.call_function(aten.add.Tensor, (n0, z))
    n0.name, n1.name = "n0", "n1"
    graph.output(n1)
    lms_graph.insert_page_in_hints(graph)
    # Ties keep the placeholder order; the hint before n0 leaves out what n0 uses.
    assert layout(graph) == [["x", "y", "z"], ["z"], "n0", "n1"]


def test_graphs_with_fewer_than_two_inputs_are_unchanged(lms_graph: ModuleType) -> None:
    graph = torch.fx.Graph()
    x = add_input(graph, "x")
    unused = add_input(graph, "unused")
    small = add_input(graph, "small", numel=1)
    graph.output((graph.call_function(aten.add.Tensor, (x, small)), unused))
    before = str(graph)
    assert lms_graph.insert_page_in_hints(graph, min_bytes=1024) == 0
    assert str(graph) == before
    # Without a threshold small counts; x and small share their first user: one hint.
    assert lms_graph.insert_page_in_hints(graph) == 1
    assert lms_graph.insert_page_in_hints(graph) == 0  # hints already there


def test_symbolic_sizes_use_their_hint_without_a_guard(lms_graph: ModuleType) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    traced = mode.from_tensor(torch.empty(8, 4), symbolic_context=context)
    assert not isinstance(traced.numel(), int)
    assert lms_graph._nbytes(traced) == 8 * 4 * 4
    with mode:
        unbacked = torch.empty(env.create_unbacked_symint(), 4)
    assert lms_graph._nbytes(unbacked) is None  # no hint: counts as large
    assert not env.guards


def test_hints_survive_dead_code_elimination_and_run_in_order(
    lms_graph: ModuleType, cpu_pages: list[list[torch.Tensor]]
) -> None:
    graph = sample_graph()
    lms_graph.insert_page_in_hints(graph, window=2, min_bytes=1024)
    op = torch.ops.lms.page_in_ahead.default
    assert str(op._schema) == "lms::page_in_ahead(Tensor[] tensors) -> ()"
    assert all(node.is_impure() for node in graph.nodes if node.target is op)
    graph.eliminate_dead_code()
    expected = [entry for entry in layout(graph) if isinstance(entry, list)]
    assert len(expected) == 5

    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = {name: torch.randn(256) for name in "abcdeu"}
    inputs["s"] = torch.randn(1)
    inputs["k"] = 3  # type: ignore[assignment]
    out, _ = module(*(inputs[name] for name in "abcdesuk"))
    reference = (-inputs["c"] + inputs["a"]) * 3 + inputs["b"] + inputs["a"]
    torch.testing.assert_close(out, reference + inputs["e"] + inputs["s"] + inputs["d"])
    names = {id(t): name for name, t in inputs.items()}
    assert [[names[id(t)] for t in call] for call in cpu_pages] == expected


def test_operator_kernel_filters_and_follows_the_bindings(
    lms_graph: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    lms_graph.register_op()
    op = torch.ops.lms.page_in_ahead.default
    x, y = torch.zeros(4), torch.ones(4)
    op([x, y])
    assert lms_graph.fake.page_ins == []  # CPU tensors never reach the engine

    monkeypatch.setattr(lms_graph, "_pageable", lambda tensors: list(tensors))
    lms_graph.fake.enabled = False
    op([x, y])
    assert lms_graph.fake.page_ins == []
    lms_graph.fake.enabled = True
    op([x, y])
    assert len(lms_graph.fake.page_ins) == 1 and lms_graph.fake.page_ins[0][1] is y

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the fake kernel: nothing reaches the bindings
        assert op([torch.empty(4), torch.empty(2)]) is None
    assert len(lms_graph.fake.page_ins) == 1

    monkeypatch.setattr(lms_graph, "_lms_bindings", lambda: None)
    op([x, y])  # no bindings: nothing to do, no error

    from torch._library.utils import is_impure

    assert is_impure(op)  # what Inductor's FallbackKernel.has_side_effects() asks


# ---------------------------------------------------------------------------------------------
# The pass and its cache identifier


def test_pass_follows_the_lms_settings(
    lms_graph: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph_pass = lms_graph.page_in_ahead_pass()
    fake = lms_graph.fake
    fake.size = 1024  # leaves out s

    for enabled, prefetch in ((False, True), (True, False)):
        fake.enabled, fake.graph_prefetch = enabled, prefetch
        graph = sample_graph()
        graph_pass(graph)
        assert all(isinstance(entry, str) for entry in layout(graph))

    fake.enabled = fake.graph_prefetch = True
    graph = sample_graph()
    graph_pass(graph)
    hints = [entry for entry in layout(graph) if isinstance(entry, list)]
    assert hints[0] == ["c", "a", "b", "e", "d"]

    monkeypatch.setattr(lms_graph, "_lms_bindings", lambda: None)
    graph = sample_graph()
    graph_pass(graph)
    assert all(isinstance(entry, str) for entry in layout(graph))


def test_uuid_follows_settings_and_source(lms_graph: ModuleType, tmp_path: Path) -> None:
    graph_pass = lms_graph.page_in_ahead_pass()
    fake = lms_graph.fake
    uuids = set()
    for enabled in (False, True):
        for prefetch in (False, True):
            fake.enabled, fake.graph_prefetch = enabled, prefetch
            uuids.add(graph_pass.uuid())
    assert len(uuids) == 4
    assert graph_pass.uuid() == graph_pass.uuid()
    fake.size = 4096
    assert graph_pass.uuid() not in uuids

    changed = tmp_path / "_lms_graph.py"
    changed.write_text(GRAPH_PY.read_text() + "\n# changed\n")
    spec = importlib.util.spec_from_file_location("lms_graph_changed", changed)
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    other._lms_bindings = lambda: fake  # type: ignore[attr-defined]
    assert other.PageInAheadPass().uuid() != graph_pass.uuid()


# ---------------------------------------------------------------------------------------------
# Installation


class Recorder:
    def __init__(self) -> None:
        self.seen_hints: list[bool] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        target = torch.ops.lms.page_in_ahead.default
        self.seen_hints.append(any(node.target is target for node in graph.nodes))


def user_pass(with_uuid: bool) -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if not with_uuid:
        return Recorder()

    class UserPass(Recorder, CustomGraphPass):
        def uuid(self) -> str:
            return "user-pass"

    return UserPass()


def test_install_is_idempotent(lms_graph: ModuleType) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    config = types.SimpleNamespace(post_grad_custom_post_pass=None)
    lms_graph.install(config)
    installed = config.post_grad_custom_post_pass
    assert installed is lms_graph.page_in_ahead_pass()
    assert isinstance(installed, CustomGraphPass)
    lms_graph.install(config)
    assert config.post_grad_custom_post_pass is installed


@pytest.mark.parametrize("with_uuid", [True, False])
def test_install_chains_a_user_pass(
    lms_graph: ModuleType, monkeypatch: pytest.MonkeyPatch, with_uuid: bool
) -> None:
    """An Inductor whose post_grad_custom_post_pass takes one pass."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    monkeypatch.setattr(lms_graph, "_accepts_pass_lists", lambda: False)
    theirs = user_pass(with_uuid)
    config = types.SimpleNamespace(post_grad_custom_post_pass=theirs)
    lms_graph.install(config)
    chained = config.post_grad_custom_post_pass
    assert isinstance(chained, CustomGraphPass)
    lms_graph.install(config)
    assert config.post_grad_custom_post_pass is chained

    graph = sample_graph()
    chained(graph)
    assert theirs.seen_hints == [False]  # theirs ran first
    assert any(isinstance(entry, list) for entry in layout(graph))  # then ours
    ours = lms_graph.page_in_ahead_pass().uuid()
    # A pass without an identifier: None, and Inductor bypasses its FX graph cache.
    assert chained.uuid() == (("user-pass", ours) if with_uuid else None)


def test_install_appends_to_a_pass_list(lms_graph: ModuleType) -> None:
    """An Inductor whose post_grad_custom_post_pass takes a list (each pass keyed by itself)."""
    if not lms_graph._accepts_pass_lists():
        pytest.skip("this Inductor takes a single post-grad pass")
    theirs = user_pass(True)
    config = types.SimpleNamespace(post_grad_custom_post_pass=theirs)
    lms_graph.install(config)
    assert config.post_grad_custom_post_pass == [theirs, lms_graph.page_in_ahead_pass()]
    lms_graph.install(config)
    assert len(config.post_grad_custom_post_pass) == 2
    config.post_grad_custom_post_pass = (theirs,)
    lms_graph.install(config)
    assert config.post_grad_custom_post_pass == [theirs, lms_graph.page_in_ahead_pass()]


# ---------------------------------------------------------------------------------------------
# torch.compile (Inductor, CPU)


@pytest.fixture
def inductor(
    lms_graph: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    """Inductor with the pass installed and its caches in a temporary folder shared by the
    compile tests (compiled C++ kernels are reused; FX graphs are keyed by the pass)."""
    cache = tmp_path_factory.getbasetemp() / "inductor-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    import torch._dynamo
    import torch._inductor.config as config

    monkeypatch.setattr(config, "post_grad_custom_post_pass", None)
    lms_graph.install(config)
    torch._dynamo.reset()
    yield config
    torch._dynamo.reset()


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


def call_body(code: str) -> list[str]:
    """The statements of the compiled graph's ``call``, less comments, the unpacking of its
    arguments and the checks of their sizes."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("def call("))
    body = [line.strip() for line in lines[start + 1 :]]
    skip = ("#", "assert_size_stride(", "assert_alignment(", "args.clear()")
    return [line for line in body if line and not line.startswith(skip) and "= args" not in line]


def hint_names(line: str) -> list[str]:
    inside = line[len(HINT_CALL) :].rstrip(")").strip("[]")
    return [name.strip() for name in inside.split(",") if name.strip()]


def assert_hints_precede_uses(code: str) -> int:
    """Each input a hint names is used after the hint, and not before it; and the hints are
    spread among the kernels rather than all at the start (where Inductor's reordering for
    peak memory puts nodes that nothing orders)."""
    body = call_body(code)
    hint_lines = [i for i, line in enumerate(body) if line.startswith(HINT_CALL)]
    first = re.compile(rf"\b{re.escape(hint_names(body[hint_lines[0]])[0])}\b")
    first_use = next(
        i for i, line in enumerate(body) if first.search(line) and not line.startswith(HINT_CALL)
    )
    assert hint_lines[-1] > first_use, "the hints are not ordered among the kernels"
    hints = 0
    for index, line in enumerate(body):
        if not line.startswith(HINT_CALL):
            continue
        hints += 1
        for name in hint_names(line):
            word = re.compile(rf"\b{re.escape(name)}\b")
            uses = [
                i
                for i, other in enumerate(body)
                if word.search(other) and not other.startswith(HINT_CALL)
            ]
            assert uses, f"{name} hinted but never used"
            assert min(uses) > index, f"{name} used before its hint:\n" + "\n".join(body)
    return hints


def train_step(
    model: torch.nn.Module, x: torch.Tensor, pages: list[list[torch.Tensor]]
) -> tuple[torch.Tensor, int]:
    loss = model(x).square().sum()
    forward_pages = len(pages)
    loss.backward()
    return loss.detach(), forward_pages


def compiled_step(
    lms_graph: ModuleType, pages: list[list[torch.Tensor]], enabled: bool
) -> tuple[str, list[list[torch.Tensor]], torch.nn.Module]:
    from torch._inductor.utils import run_and_get_code

    lms_graph.fake.enabled = enabled
    pages.clear()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    eager, model = mlp(), mlp()
    expected = eager(x).square().sum()
    expected.backward()
    compiled = torch.compile(model, backend="inductor")
    (loss, forward_pages), codes = run_and_get_code(train_step, compiled, x, pages)
    torch.testing.assert_close(loss, expected.detach())
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)
    backward = [code for code in codes if "tangents_1" in code]
    assert len(codes) == 2 and len(backward) == 1, "expected a forward and a backward graph"
    return backward[0], pages[forward_pages:], model


def test_compiled_backward_pages_in_ahead(
    lms_graph: ModuleType, inductor: Any, cpu_pages: list[list[torch.Tensor]]
) -> None:
    backward, backward_pages, model = compiled_step(lms_graph, cpu_pages, enabled=True)
    hints = assert_hints_precede_uses(backward)
    assert hints >= 2
    # The hints ran inside the compiled backward, one request each, in order, soonest first:
    # the last layer's weight is the first saved input the backward reads.
    assert len(backward_pages) == hints
    lines = [line for line in call_body(backward) if line.startswith(HINT_CALL)]
    assert [len(page) for page in backward_pages] == [len(hint_names(line)) for line in lines]
    assert backward_pages[0][0].data_ptr() == model[4].weight.data_ptr()
    hinted = {t.data_ptr() for page in backward_pages for t in page}
    assert model[2].weight.data_ptr() in hinted

    # Compiled without LMS (the same FX graph cache): no hint, none run.
    backward, backward_pages, _ = compiled_step(lms_graph, cpu_pages, enabled=False)
    assert HINT_CALL not in backward
    assert cpu_pages == []

    # And with LMS again: the cached graph with hints comes back.
    backward, backward_pages, _ = compiled_step(lms_graph, cpu_pages, enabled=True)
    assert assert_hints_precede_uses(backward) == hints
    assert len(backward_pages) == hints


# ---------------------------------------------------------------------------------------------
# The hook in lms.py, as the drop-in extension ships both modules


# The bindings _lms_graph.py reads, besides those of lms.py.
GRAPH_BINDINGS = """
page_ins = []


def _cuda_lms_getGraphPrefetch():
    return True


def _cuda_lms_getSize():
    return 0


def _cuda_lms_pageInAhead(tensors):
    page_ins.append(len(tensors))
"""

HOOK_SCRIPT = """
import importlib.util
import sys

import torch

# The module imports without importing Inductor (a PyTorch may have none).
spec = importlib.util.spec_from_file_location("standalone", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
assert "torch._inductor" not in sys.modules, "importing _lms_graph imported Inductor"

import torch_lms

assert "torch._inductor.config" not in sys.modules, "imported before the hook was in place"
assert "torch_lms._lms_graph" not in sys.modules, "imported before Inductor was"
from torch._inductor.utils import run_and_get_code

fn = torch.compile(lambda a, b: (a * 2 + 1) @ b.relu(), backend="inductor")
_, codes = run_and_get_code(fn, torch.randn(8, 8), torch.randn(8, 8))
import torch._inductor.config as config

installed = config.post_grad_custom_post_pass
print("installed", type(installed).__module__, type(installed).__name__)
print("hints", sum(code.count("torch.ops.lms.page_in_ahead.default(") for code in codes))
"""


def test_lms_module_installs_the_pass_when_torch_compile_imports_inductor(
    tmp_path: Path,
) -> None:
    env = build_fake_torch_lms(
        tmp_path,
        [GRAPH_PY.name],
        init="from torch_lms import lms  # noqa: F401\n",
        bindings=GRAPH_BINDINGS,
    )
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor-cache")
    stdout = run_python(env, HOOK_SCRIPT, str(GRAPH_PY))
    assert "installed torch_lms._lms_graph PageInAheadPass" in stdout
    hints = int(re.search(r"hints (\d+)", stdout).group(1))  # type: ignore[union-attr]
    assert hints >= 2, stdout
