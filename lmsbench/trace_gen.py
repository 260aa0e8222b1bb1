"""Random operator traces for the LMS engine on the simulated GPU.

A trace is what the LMS engine sees of a training run: storages allocated on a stream, operators
that pin a set of storages while a "kernel" reads and writes them, raw data accesses and frees.
``tests/engine/trace_replay.cpp`` replays a trace through the real engine and caching allocator on
simgpu and checks every byte an operator reads; ``tests/engine/test_trace_sim.py`` runs many seeds
under fault plans and judges each outcome against what this module computes for the trace.

Trace format (text, one event a line; ``#`` starts a comment)::

    meta capacity=<bytes> limit=<bytes, 0: LMS default> threshold=<bytes>
         prefetch=<depth> speculative=<bytes>          (one line)
    alloc <id> <bytes> <main|side>     new storage, allocated on that stream
    op <name> inputs=[<ids>] outputs=[<ids>]
    side_stream op <name> inputs=[...] outputs=[...]   same, on a second stream (recordStream)
    access <id>                        raw data access outside an operator
    free <id>                          the last reference goes away

Events are numbered from 0 in file order (``meta`` and comments are not events). An operator pins
every input and output for its duration; the kernel checks each input's contents and writes a new
pattern into each output.

What a trace needs from the device is computed here, not measured, so the expected outcome is
known in advance. While an event runs, a storage cannot be paged out when it is pinned by the
running operator, smaller than the LMS size threshold (LMS does not manage it), or "allocated"
(created, or raw-accessed, and not pinned since: LMS keeps such storages off its reclaim list).
``need`` is the sum of their sizes: more than the device capacity and the event cannot run with
all of them on the device. Then an operator runs with those that do not fit kept in pinned host
memory (LMS host placement, on by default), and anything else (an allocation, a raw access), or
an operator with host placement off, must raise LMS's ``OutOfMemoryError``. ``bound`` is the
same set counted in caching allocator segments: the allocator rounds a request up to a segment
(2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB) and can return only segments with nothing
live in them, so in the worst case every unreclaimable storage holds a segment of its own. At or
below ``bound`` the event always fits, whatever the fragmentation; between ``need`` and ``bound``
an out-of-memory error (or, in an operator, host placement) is allowed but not required.

Command line (prints the trace and, on stderr, its summary and the replay command)::

    python -m lmsbench.trace_gen --seed 7 [--plan device_alloc] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

KIB = 1024
MIB = 1024 * KIB

# The caching allocator's size classes (c10/cuda/CUDACachingAllocator.cpp; the same in every
# tag with a series).
MIN_BLOCK = 512  # every block is rounded up to this
SMALL_SIZE = 1 * MIB  # largest request served from the small pool
SMALL_SEGMENT = 2 * MIB  # segment size of the small pool
LARGE_SEGMENT = 20 * MIB  # segment size for requests up to MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB  # larger requests get a segment of their own, rounded to this

FAMILIES = ("mlp", "residual", "dense", "attention")
OPTIMIZERS = ("sgd", "adam", "foreach_sgd", "foreach_adam")
# How the capacity is chosen relative to the trace's needs (see ``choose_device``).
REGIMES = ("fit", "tight", "over")
FAULT_PLANS = ("none", "device_alloc", "host_alloc", "device_full", "copy")


def block_bytes(size: int) -> int:
    """Bytes the caching allocator hands out for a request of ``size`` bytes."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_bytes(size: int) -> int:
    """Device bytes of the segment the caching allocator reserves for a request of ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True)
class Event:
    """One trace event; ``kind`` is alloc, op, side_stream, access or free."""

    kind: str
    sid: int = -1
    size: int = 0
    stream: str = "main"
    name: str = ""
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()

    def storages(self) -> tuple[int, ...]:
        """Storages the event touches, each once, in first-use order."""
        if self.kind in ("op", "side_stream"):
            return tuple(dict.fromkeys(self.inputs + self.outputs))
        return (self.sid,)

    def line(self) -> str:
        if self.kind == "alloc":
            return f"alloc {self.sid} {self.size} {self.stream}"
        if self.kind in ("access", "free"):
            return f"{self.kind} {self.sid}"
        ins = ",".join(map(str, self.inputs))
        outs = ",".join(map(str, self.outputs))
        prefix = "side_stream op" if self.kind == "side_stream" else "op"
        return f"{prefix} {self.name} inputs=[{ins}] outputs=[{outs}]"


@dataclass
class Analysis:
    """Per-event device needs of a trace (see the module docstring)."""

    working_set: list[int]  # bytes pinned by the event's operator (0 for other events)
    need: list[int]  # bytes that cannot be paged out while the event runs
    bound: list[int]  # the same storages counted in allocator segments
    peak_live: int  # most bytes of live storages at any point

    @property
    def ws_max(self) -> int:
        return max(self.working_set, default=0)

    @property
    def need_max(self) -> int:
        return max(self.need, default=0)

    @property
    def bound_max(self) -> int:
        return max(self.bound, default=0)

    def first_over(self, capacity: int) -> int | None:
        """The first event whose need exceeds ``capacity``: it cannot run."""
        return next((i for i, n in enumerate(self.need) if n > capacity), None)


def analyze(events: Sequence[Event], threshold: int) -> Analysis:
    """Computes what each event needs from the device; raises ValueError for a bad trace."""
    live: dict[int, int] = {}
    unreclaimable: set[int] = set()  # "allocated" storages and unmanaged ones
    working_set: list[int] = []
    need: list[int] = []
    bound: list[int] = []
    peak = 0
    for index, ev in enumerate(events):
        pinned: tuple[int, ...] = ()
        if ev.kind == "alloc":
            if ev.sid in live:
                raise ValueError(f"event {index}: storage {ev.sid} allocated twice")
            if ev.size <= 0:
                raise ValueError(f"event {index}: storage {ev.sid} has size {ev.size}")
            live[ev.sid] = ev.size
            unreclaimable.add(ev.sid)
            peak = max(peak, sum(live.values()))
        else:
            missing = [sid for sid in ev.storages() if sid not in live]
            if missing:
                raise ValueError(f"event {index} ({ev.line()}): storages {missing} are not live")
            if ev.kind in ("op", "side_stream"):
                pinned = ev.storages()
            elif ev.kind == "access":
                unreclaimable.add(ev.sid)
        held = unreclaimable.union(pinned)
        working_set.append(sum(live[sid] for sid in pinned))
        need.append(sum(live[sid] for sid in held))
        bound.append(sum(segment_bytes(live[sid]) for sid in held))
        if ev.kind in ("op", "side_stream"):
            # Unpinned at the end of the operator: reclaimable from now on, if LMS manages it.
            unreclaimable.difference_update(sid for sid in pinned if live[sid] >= threshold)
        elif ev.kind == "free":
            unreclaimable.discard(ev.sid)
            del live[ev.sid]
    return Analysis(working_set, need, bound, peak)


@dataclass
class Trace:
    """A trace and the device it is replayed on."""

    events: list[Event]
    capacity: int
    limit: int = 0  # 0: none set; the process's share of the device applies
    threshold: int = 64 * KIB
    prefetch: int = 0
    speculative: int = 0
    seed: int = -1
    family: str = "handmade"
    optimizer: str = ""
    regime: str = ""
    analysis: Analysis = field(init=False)

    def __post_init__(self) -> None:
        self.analysis = analyze(self.events, self.threshold)

    def meta_line(self) -> str:
        return (
            f"meta capacity={self.capacity} limit={self.limit} threshold={self.threshold} "
            f"prefetch={self.prefetch} speculative={self.speculative}"
        )

    def text(self) -> str:
        a = self.analysis
        first_over = a.first_over(self.capacity)
        head = [
            "# LMS operator trace (lmsbench/trace_gen.py)",
            f"# seed={self.seed} family={self.family} optimizer={self.optimizer} "
            f"regime={self.regime} events={len(self.events)}",
            f"# ws_max={a.ws_max} need_max={a.need_max} bound_max={a.bound_max} "
            f"peak_live={a.peak_live} first_over_capacity={first_over}",
            self.meta_line(),
        ]
        return "\n".join(head + [ev.line() for ev in self.events]) + "\n"


_META = re.compile(r"(\w+)=(\d+)")
_OP = re.compile(r"^(\S+) inputs=\[([\d,\s]*)\] outputs=\[([\d,\s]*)\]$")


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse_trace(text: str) -> Trace:
    """Reads a trace in the format above; raises ValueError with the line number when bad."""
    meta: dict[str, int] = {}
    events: list[Event] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        try:
            if word == "meta":
                meta.update((k, int(v)) for k, v in _META.findall(rest))
            elif word == "alloc":
                sid, size, stream = rest.split()
                if stream not in ("main", "side"):
                    raise ValueError(f"stream must be main or side, not {stream!r}")
                events.append(Event("alloc", sid=int(sid), size=int(size), stream=stream))
            elif word in ("access", "free"):
                events.append(Event(word, sid=int(rest)))
            elif word in ("op", "side_stream"):
                kind = "op"
                if word == "side_stream":
                    kind = "side_stream"
                    if not rest.startswith("op "):
                        raise ValueError("side_stream must be followed by op")
                    rest = rest[3:]
                match = _OP.match(rest.strip())
                if match is None:
                    raise ValueError("expected: op NAME inputs=[ids] outputs=[ids]")
                name, ins, outs = match.groups()
                events.append(Event(kind, name=name, inputs=_ids(ins), outputs=_ids(outs)))
            else:
                raise ValueError(f"unknown event {word!r}")
        except ValueError as err:
            raise ValueError(f"line {number}: {err}: {raw!r}") from None
    if "capacity" not in meta:
        raise ValueError("no meta line with capacity=")
    return Trace(
        events,
        capacity=meta["capacity"],
        limit=meta.get("limit", 0),
        threshold=meta.get("threshold", 64 * KIB),
        prefetch=meta.get("prefetch", 0),
        speculative=meta.get("speculative", 0),
    )


# ---------------------------------------------------------------------------------------------
# Random models


@dataclass
class _Node:
    """A forward operator and what its backward needs."""

    name: str
    inputs: list[int]
    outputs: list[int]
    saved: list[int]  # read again by the backward (activations and parameters)
    grad_inputs: list[int]  # inputs that get a gradient


class _Builder:
    """Builds the events of a training run from a forward graph, with autograd-like lifetimes."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.events: list[Event] = []
        self.size: dict[int, int] = {}
        self.live: set[int] = set()
        self.next_id = 0
        self.side_allreduce = rng.random() < 0.5
        self.side_batch = rng.random() < 0.5
        self.access_rate = rng.choice((0.0, 0.05, 0.15))

    # -- events ---------------------------------------------------------------------------
    def tensor(self, size: int) -> int:
        """A new storage id of ``size`` bytes, allocated later by ``allocate`` (no event yet)."""
        sid = self.next_id
        self.next_id += 1
        self.size[sid] = size
        return sid

    def alloc(self, size: int, stream: str = "main") -> int:
        """A new storage, allocated now."""
        return self.allocate(self.tensor(size), stream)

    def allocate(self, sid: int, stream: str = "main") -> int:
        self.live.add(sid)
        self.events.append(Event("alloc", sid=sid, size=self.size[sid], stream=stream))
        return sid

    def op(
        self, name: str, inputs: Iterable[int], outputs: Iterable[int], side: bool = False
    ) -> None:
        kind = "side_stream" if side else "op"
        self.events.append(Event(kind, name=name, inputs=tuple(inputs), outputs=tuple(outputs)))

    def free(self, sid: int) -> None:
        self.live.discard(sid)
        self.events.append(Event("free", sid=sid))

    def access(self, sid: int) -> None:
        self.events.append(Event("access", sid=sid))

    # -- sizes ----------------------------------------------------------------------------
    def odd(self, size: int) -> int:
        """Sometimes not a multiple of 8 or 512, so partial words and block rounding are used."""
        if self.rng.random() < 0.3:
            return size + self.rng.randrange(1, 700)
        return size

    # -- a training step ------------------------------------------------------------------
    def parameters(self, sizes: Sequence[int]) -> list[int]:
        params = []
        for size in sizes:
            p = self.alloc(size)
            self.op("init_param", [], [p])
            params.append(p)
        return params

    def run_forward_backward(
        self, nodes: list[_Node], batch: int, params: Sequence[int]
    ) -> list[int]:
        """Forward (freeing what nothing needs again), loss, backward in reverse order.

        Returns the gradient storage of each parameter.
        """
        param_set = set(params)
        last_forward_use: dict[int, int] = {}
        first_saver: dict[int, int] = {}  # the backward of the earliest saver frees it
        for i, node in enumerate(nodes):
            for t in node.inputs:
                last_forward_use[t] = i
            for t in node.saved:
                first_saver.setdefault(t, i)
        for i, node in enumerate(nodes):
            for t in node.outputs:  # allocated by the operator, just before it runs
                self.allocate(t)
            self.op(node.name, node.inputs, node.outputs)
            for t in dict.fromkeys(node.inputs):
                if t in param_set or t == batch:
                    continue
                if last_forward_use.get(t) == i and t not in first_saver:
                    self.free(t)
            for t in node.outputs:
                if t not in last_forward_use and t not in first_saver and t != nodes[-1].outputs[0]:
                    self.free(t)
            if self.access_rate and self.rng.random() < self.access_rate:
                # Raw access of something live, e.g. a debugging print or .item().
                candidates = sorted(t for t in node.outputs if t in self.live)
                if candidates:
                    self.access(self.rng.choice(candidates))
        if batch not in first_saver:
            self.free(batch)
        loss = nodes[-1].outputs[0]
        self.access(loss)  # loss.item()
        grads: dict[int, int] = {}
        grads[loss] = self.alloc(self.size[loss])
        self.op("ones_like", [], [grads[loss]])
        self.free(loss)
        for i in range(len(nodes) - 1, -1, -1):
            node = nodes[i]
            out_grads = [grads.pop(t) for t in node.outputs if t in grads]
            ins = [*out_grads, *node.saved]
            outs: list[int] = []
            for t in dict.fromkeys(node.grad_inputs):
                if t == batch:  # the data needs no gradient
                    continue
                if t in grads:  # accumulate into the existing gradient, in place
                    ins.append(grads[t])
                else:
                    grads[t] = self.alloc(self.size[t])
                outs.append(grads[t])
            self.op(node.name + "_backward", ins, outs)
            for g in out_grads:
                self.free(g)
            for t in dict.fromkeys(node.saved):
                if first_saver.get(t) == i and t not in param_set and t in self.live:
                    self.free(t)
            if self.side_allreduce:
                # Gradients of parameters this node was the first user of are final now.
                for t in node.grad_inputs:
                    if t in param_set and first_saver.get(t) == i:
                        self.op("allreduce", [grads[t]], [grads[t]], side=True)
        return [grads[p] for p in params]

    def optimizer_step(
        self, kind: str, params: Sequence[int], grads: Sequence[int], states: list[list[int]]
    ) -> None:
        """SGD with momentum or Adam, one operator per parameter or one for all (foreach).

        States are created by the first step, as PyTorch's optimizers do. The foreach form pins
        every parameter, gradient and state at once: the largest working set of a step.
        """
        per_param = 2 if kind.endswith("adam") else 1
        first = not states
        if first:
            for p in params:
                states.append([self.tensor(self.size[p]) for _ in range(per_param)])
        if kind.startswith("foreach"):
            all_states = [s for group in states for s in group]
            if first:
                for s in all_states:
                    self.allocate(s)
            ins = [*params, *grads, *([] if first else all_states)]
            self.op(f"{kind}_step", ins, [*params, *all_states])
        else:
            for p, g, group in zip(params, grads, states):
                if first:  # each parameter's state is created just before its update
                    for s in group:
                        self.allocate(s)
                ins = [p, g, *([] if first else group)]
                self.op(f"{kind}_step", ins, [p, *group])
        for g in grads:  # zero_grad(set_to_none=True)
            self.free(g)

    def load_batch(self, size: int) -> int:
        if self.side_batch:
            batch = self.alloc(size, "side")
            self.op("copy_batch", [], [batch], side=True)
        else:
            batch = self.alloc(size)
            self.op("load_batch", [], [batch])
        return batch


def _mlp(b: _Builder, batch: int, params: list[int], act: int, depth: int) -> list[_Node]:
    nodes = []
    h = batch
    for i in range(depth):
        w, bias = params[2 * i], params[2 * i + 1]
        z = b.tensor(b.odd(act * b.rng.choice((1, 1, 2))))
        nodes.append(_Node(f"linear{i}", [h, w, bias], [z], [h, w], [h, w, bias]))
        y = b.tensor(b.size[z])
        nodes.append(_Node(f"gelu{i}", [z], [y], [z], [z]))
        h = y
    return nodes


def _residual(b: _Builder, batch: int, params: list[int], act: int, depth: int) -> list[_Node]:
    nodes = []
    x = b.tensor(b.odd(act))
    nodes.append(_Node("stem", [batch, params[0]], [x], [batch, params[0]], [params[0]]))
    for i in range(depth):
        w1, w2 = params[1 + 2 * i], params[2 + 2 * i]
        t1 = b.tensor(b.odd(act))
        nodes.append(_Node(f"conv{i}a", [x, w1], [t1], [x, w1], [x, w1]))
        t2 = b.tensor(b.size[t1])
        nodes.append(_Node(f"relu{i}", [t1], [t2], [t2], [t1]))
        t3 = b.tensor(b.size[x])
        nodes.append(_Node(f"conv{i}b", [t2, w2], [t3], [t2, w2], [t2, w2]))
        y = b.tensor(b.size[x])
        nodes.append(_Node(f"add{i}", [x, t3], [y], [], [x, t3]))
        x = y
    return nodes


def _dense(b: _Builder, batch: int, params: list[int], act: int, depth: int) -> list[_Node]:
    """DenseNet-like: every layer reads the outputs of all layers before it."""
    nodes = []
    x0 = b.tensor(b.odd(act))
    nodes.append(_Node("stem", [batch, params[0]], [x0], [batch, params[0]], [params[0]]))
    features = [x0]
    growth = max(8 * KIB, act // b.rng.choice((2, 3, 4)))
    for i in range(depth):
        w = params[1 + i]
        x = b.tensor(b.odd(growth))
        nodes.append(_Node(f"dense{i}", [*features, w], [x], [*features, w], [*features, w]))
        features.append(x)
    return nodes


def _attention(b: _Builder, batch: int, params: list[int], act: int, depth: int) -> list[_Node]:
    """Transformer-like blocks with big temporaries (scores and probabilities)."""
    nodes = []
    x = b.tensor(b.odd(act))
    nodes.append(_Node("embed", [batch, params[0]], [x], [batch, params[0]], [params[0]]))
    big = min(SMALL_SIZE, act * b.rng.choice((2, 3, 4)))
    for i in range(depth):
        wq, wk, wv, wo = params[1 + 4 * i : 5 + 4 * i]
        q, k, v = (b.tensor(b.size[x]) for _ in range(3))
        nodes.append(_Node(f"qkv{i}", [x, wq, wk, wv], [q, k, v], [x, wq, wk, wv], [x, wq, wk, wv]))
        scores = b.tensor(b.odd(big))
        nodes.append(_Node(f"scores{i}", [q, k], [scores], [q, k], [q, k]))
        probs = b.tensor(b.size[scores])
        nodes.append(_Node(f"softmax{i}", [scores], [probs], [probs], [scores]))
        ctx = b.tensor(b.size[x])
        nodes.append(_Node(f"context{i}", [probs, v], [ctx], [probs, v], [probs, v]))
        out = b.tensor(b.size[x])
        nodes.append(_Node(f"proj{i}", [ctx, wo], [out], [ctx, wo], [ctx, wo]))
        y = b.tensor(b.size[x])
        nodes.append(_Node(f"residual{i}", [x, out], [y], [], [x, out]))
        x = y
    return nodes


def _param_sizes(b: _Builder, family: str, act: int, depth: int) -> list[int]:
    def weight() -> int:
        return b.odd(b.rng.choice((32, 64, 96, 128, 192, 256)) * KIB)

    if family == "mlp":
        # Weight and bias per layer; biases are below the threshold: LMS never moves them.
        return [s for _ in range(depth) for s in (weight(), b.rng.choice((1, 2, 4)) * KIB)]
    if family == "residual":
        return [weight() for _ in range(1 + 2 * depth)]
    if family == "dense":
        return [weight() for _ in range(1 + depth)]
    return [weight() for _ in range(1 + 4 * depth)]


def _forward(
    b: _Builder, family: str, batch: int, params: list[int], act: int, depth: int
) -> list[_Node]:
    build = {"mlp": _mlp, "residual": _residual, "dense": _dense, "attention": _attention}
    nodes = build[family](b, batch, params, act, depth)
    last = nodes[-1].outputs[0]
    loss = b.tensor(8)  # a scalar: below any threshold
    nodes.append(_Node("loss", [last], [loss], [last], [last]))
    return nodes


def choose_device(rng: random.Random, analysis: Analysis, regime: str) -> tuple[int, int]:
    """Capacity and LMS limit for a trace.

    fit: capacity at least ``bound_max`` (every event fits whatever the fragmentation) and a low
         explicit limit, so LMS pages out through its limit trigger;
    tight: capacity a little above ``need_max`` and usually the default limit, so LMS pages out
         when device allocations fail, with fragmentation in play (out of memory allowed only
         where ``bound`` exceeds the capacity);
    over: capacity below ``need_max``: some event cannot run with its storages on the device;
         an operator keeps what does not fit in host memory (host placement), anything else,
         or an operator with host placement off, runs out of memory.
    """

    def mib_up(n: float) -> int:
        return int(-(-int(n) // MIB) * MIB)

    if regime == "fit":
        capacity = mib_up(analysis.bound_max + SMALL_SEGMENT)
        # Below the peak of live bytes, so storages must be paged out; never below the
        # largest working set, which the limit cannot push out anyway.
        limit = max(analysis.need_max, int(analysis.peak_live * rng.uniform(0.35, 0.7)))
        return capacity, -(-limit // (64 * KIB)) * 64 * KIB
    if regime == "tight":
        # One spare segment for each stream: the caching allocator keeps a stream's free blocks
        # for that stream, so a side-stream allocation needs a segment of its own.
        capacity = int(analysis.need_max * rng.uniform(1.1, 1.5)) + 2 * SMALL_SEGMENT
        capacity = -(-capacity // (64 * KIB)) * 64 * KIB
        limit = 0 if rng.random() < 0.7 else mib_up(capacity * rng.uniform(0.5, 0.9))
        return capacity, limit
    capacity = int(analysis.need_max * rng.uniform(0.55, 0.9)) // (64 * KIB) * 64 * KIB
    return max(64 * KIB, capacity), 0


def generate(
    seed: int,
    family: str | None = None,
    optimizer: str | None = None,
    regime: str | None = None,
    iterations: int = 2,
    repeat: bool = False,
) -> Trace:
    """A random training run: parameters, then ``iterations`` of forward, backward, step.

    With ``repeat``, every iteration draws the same random choices (sizes, raw accesses), so
    iterations after the optimizer's first step are the same sequence of operators, as in real
    training: what LMS's learned swap schedule needs to become active.
    """
    rng = random.Random(seed)
    family = family or FAMILIES[seed % len(FAMILIES)]
    optimizer = optimizer or rng.choice(OPTIMIZERS)
    regime = regime or rng.choices(REGIMES, weights=(6, 3, 1))[0]
    threshold = rng.choice((16, 32, 64)) * KIB
    b = _Builder(rng)
    act = rng.choice((64, 96, 128, 192, 256, 384)) * KIB
    depth = rng.randint(2, 4) if family == "attention" else rng.randint(4, 8)
    params = b.parameters(_param_sizes(b, family, act, depth))
    states: list[list[int]] = []
    iteration_seed = rng.getrandbits(64) if repeat else 0
    for _ in range(iterations):
        if repeat:
            b.rng = random.Random(iteration_seed)
        batch = b.load_batch(b.odd(act))
        nodes = _forward(b, family, batch, params, act, depth)
        grads = b.run_forward_backward(nodes, batch, params)
        b.optimizer_step(optimizer, params, grads, states)
    b.rng = rng
    if rng.random() < 0.5:
        b.access(rng.choice(params))  # e.g. saving a checkpoint
    for sid in sorted(b.live):
        b.free(sid)
    trace = Trace(
        b.events,
        capacity=1,
        threshold=threshold,
        prefetch=rng.choice((0, 0, 1, 2)),
        seed=seed,
        family=family,
        optimizer=optimizer,
        regime=regime,
    )
    trace.capacity, trace.limit = choose_device(rng, trace.analysis, regime)
    if rng.random() < 0.25:
        trace.speculative = max(MIB, (trace.limit or trace.capacity) // 4) // MIB * MIB
    return trace


# ---------------------------------------------------------------------------------------------
# Fault plans and the replay command


def fault_args(plan: str, trace: Trace) -> list[str]:
    """Replayer options for a fault plan, derived from the trace's seed (deterministic).

    none:         no faults.
    device_alloc: every Nth device allocation (cudaMalloc) fails, once or twice in a row, and
                  the caching allocator's cache is emptied every few events so that
                  allocations reach cudaMalloc.
    host_alloc:   every Nth pinned host allocation (cudaHostAlloc) fails, and LMS's cached
                  pinned buffers are released every few events so that page-outs allocate.
    device_full:  another process takes device memory (a cudaMalloc outside the caching
                  allocator) at some event, from the start or mid-run, maybe giving it back later.
    copy:         every Nth copy fails (page-out and page-in copies; the kernels do not copy).

    Under a fault the replay goes on after an error, dropping what failed, as a program that
    catches OutOfMemoryError does (a batch-size search, a retry): the engine must be sound after
    an error, not only report it. Without faults the first error ends the replay.
    """
    if plan not in FAULT_PLANS:
        raise ValueError(f"unknown fault plan {plan!r}; one of {', '.join(FAULT_PLANS)}")
    if plan == "none":
        return []
    return [*_fault_options(plan, trace), "--continue-after-error"]


def _fault_options(plan: str, trace: Trace) -> list[str]:
    rng = random.Random(f"{trace.seed}:{plan}")
    n = len(trace.events)
    if plan == "device_alloc":
        every, count, empty = rng.randint(1, 4), rng.choice((1, 1, 2)), rng.randint(3, 12)
        return [
            "--fail-device-every",
            str(every),
            "--fail-device-count",
            str(count),
            "--empty-cache-every",
            str(empty),
        ]
    if plan == "host_alloc":
        every, release = rng.randint(1, 3), rng.randint(3, 12)
        return ["--fail-host-every", str(every), "--release-host-cache-every", str(release)]
    if plan == "device_full":
        keep = int(trace.analysis.need_max * rng.uniform(1.0, 1.6)) + SMALL_SEGMENT
        hog = max(trace.capacity // 4, trace.capacity - keep)
        at = 0 if rng.random() < 0.4 else rng.randrange(n // 2)
        args = ["--hog-bytes", str(hog), "--hog-at", str(at)]
        if rng.random() < 0.5:
            args += ["--hog-release-at", str(rng.randrange(at + 1, n))]
        return args
    return ["--fail-copy-every", str(rng.randint(1, 10))]


def replay_command(
    trace_file: str, plan: str, trace: Trace, replayer: str = "trace_replay"
) -> list[str]:
    """The command line that replays ``trace_file`` under ``plan``."""
    return [replayer, trace_file, *fault_args(plan, trace)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--family", choices=FAMILIES)
    parser.add_argument("--optimizer", choices=OPTIMIZERS)
    parser.add_argument("--regime", choices=REGIMES)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument(
        "--repeat", action="store_true", help="every iteration the same operators and sizes"
    )
    parser.add_argument("--plan", choices=FAULT_PLANS, default="none")
    parser.add_argument("--out", type=Path, help="write the trace here (default: stdout)")
    parser.add_argument("--replayer", default="trace_replay", help="path shown in the command")
    args = parser.parse_args(argv)
    trace = generate(
        args.seed, args.family, args.optimizer, args.regime, args.iterations, args.repeat
    )
    if args.out:
        args.out.write_text(trace.text())
    else:
        sys.stdout.write(trace.text())
    a = trace.analysis
    cmd = replay_command(str(args.out or "TRACE"), args.plan, trace, args.replayer)
    print(
        f"seed {trace.seed}: {trace.family}, {trace.optimizer}, {trace.regime}; "
        f"{len(trace.events)} events; capacity {trace.capacity}, limit {trace.limit}; "
        f"ws_max {a.ws_max}, need_max {a.need_max}, bound_max {a.bound_max}, "
        f"peak_live {a.peak_live}\n"
        f"replay: SIMGPU_SCRIBBLE=1 {' '.join(cmd)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
