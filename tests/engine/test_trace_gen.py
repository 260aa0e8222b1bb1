"""The operator-trace generator (lmsbench/trace_gen.py) on its own: no build, no simulated GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lmsbench.trace_gen import (
    FAMILIES,
    FAULT_PLANS,
    KIB,
    MIB,
    OPTIMIZERS,
    REGIMES,
    SMALL_SEGMENT,
    Event,
    analyze,
    fault_args,
    generate,
    parse_trace,
    segment_bytes,
)

REPO = Path(__file__).resolve().parents[2]
SEEDS = range(40)

# A hand-made trace with every kind of event. Threshold 64 KiB: storage 3 (4 KiB) is never managed.
HANDMADE = """\
# comment lines and trailing comments are ignored
meta capacity=8388608 limit=0 threshold=65536 prefetch=0 speculative=0
alloc 1 131072 main            # 0
op init inputs=[] outputs=[1]  # 1
alloc 2 262144 main            # 2
alloc 3 4096 main              # 3
op fwd inputs=[1,1] outputs=[2,3]
access 1                       # 5: raw access: unreclaimable until pinned again
alloc 4 1048576 side           # 6
side_stream op copy inputs=[2] outputs=[4]
free 2                         # 8
op step inputs=[4,3] outputs=[4]
free 1
free 3
free 4
"""


def test_handmade_trace_needs() -> None:
    """Working set, unreclaimable bytes and segment bound of every event, worked out by hand."""
    trace = parse_trace(HANDMADE)
    a = trace.analysis
    k128, k256, k4, m1 = 128 * KIB, 256 * KIB, 4 * KIB, 1 * MIB
    assert [e.kind for e in trace.events] == [
        "alloc", "op", "alloc", "alloc", "op", "access", "alloc",
        "side_stream", "free", "op", "free", "free", "free",
    ]  # fmt: skip
    assert a.working_set == [0, k128, 0, 0, k128 + k256 + k4, 0, 0, k256 + m1, 0, m1 + k4, 0, 0, 0]
    # Storage 1 is reclaimable once init has run, until the raw access at 5 (for good: it is
    # never pinned again); 2 and 4 from the end of the operator that wrote them; 3 never.
    assert a.need == [
        k128,  # 0: the new storage
        k128,  # 1: pinned
        k256,  # 2: the new storage; 1 is reclaimable
        k256 + k4,
        k128 + k256 + k4,  # 4: the op's storages
        k128 + k4,  # 5: 1 accessed, 3 unmanaged
        k128 + k4 + m1,
        k128 + k256 + k4 + m1,  # 7: 2 and 4 pinned, 1 and 3 held
        k128 + k4,  # 8: a free counts what it frees
        k128 + k4 + m1,
        k128 + k4,
        k4,
        0,  # 12: storage 4 was reclaimable
    ]
    seg = SMALL_SEGMENT
    assert a.bound[:8] == [seg, seg, seg, 2 * seg, 3 * seg, 2 * seg, 3 * seg, 4 * seg]
    assert a.ws_max == k256 + m1
    assert a.need_max == k128 + k256 + k4 + m1
    assert a.peak_live == k128 + k256 + k4 + m1
    assert a.first_over(a.need_max) is None
    assert a.first_over(a.need_max - 1) == 7


def test_segment_sizes_follow_the_caching_allocator() -> None:
    assert segment_bytes(1) == 2 * MIB
    assert segment_bytes(1 * MIB) == 2 * MIB
    assert segment_bytes(1 * MIB + 1) == 20 * MIB
    assert segment_bytes(10 * MIB - 1) == 20 * MIB
    assert segment_bytes(10 * MIB) == 10 * MIB
    assert segment_bytes(11 * MIB) == 12 * MIB


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("alloc 1 10 main\n", "no meta line"),
        ("meta capacity=1\nalloc 1 10 gpu\n", "line 2: stream must be main or side"),
        ("meta capacity=1\nop x inputs=[1]\n", "line 2: expected: op NAME"),
        ("meta capacity=1\nside_stream x inputs=[] outputs=[]\n", "followed by op"),
        ("meta capacity=1\nfree 1\n", "storages [1] are not live"),
        ("meta capacity=1\nalloc 1 8 main\nalloc 1 8 main\n", "allocated twice"),
        ("meta capacity=1\nalloc 1 0 main\n", "has size 0"),
        ("meta capacity=1\nalloc 1 8 main\nfree 1\naccess 1\n", "event 2 (access 1)"),
        ("meta capacity=1\nresize 1 8\n", "unknown event"),
    ],
)
def test_bad_traces_are_rejected(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_trace(text)


@pytest.mark.parametrize("seed", [0, 1, 7, 23])
def test_generation_is_deterministic(seed: int) -> None:
    assert generate(seed).text() == generate(seed).text()
    assert fault_args("device_full", generate(seed)) == fault_args("device_full", generate(seed))


def test_seeds_give_different_traces() -> None:
    texts = {generate(seed).text() for seed in SEEDS}
    assert len(texts) == len(SEEDS)


def test_text_round_trips() -> None:
    for seed in SEEDS:
        trace = generate(seed)
        back = parse_trace(trace.text())
        assert back.events == trace.events
        assert (back.capacity, back.limit, back.threshold, back.prefetch, back.speculative) == (
            trace.capacity,
            trace.limit,
            trace.threshold,
            trace.prefetch,
            trace.speculative,
        )


def test_seeds_cover_families_optimizers_regimes_and_event_kinds() -> None:
    traces = [generate(seed) for seed in SEEDS]
    assert {t.family for t in traces} == set(FAMILIES)
    assert {t.optimizer for t in traces} == set(OPTIMIZERS)
    assert {t.regime for t in traces} == set(REGIMES)
    kinds = Counter(e.kind for t in traces for e in t.events)
    assert {"alloc", "op", "side_stream", "access", "free"} <= set(kinds)
    assert any(e.stream == "side" for t in traces for e in t.events if e.kind == "alloc")
    assert any(t.prefetch > 0 for t in traces) and any(t.speculative > 0 for t in traces)
    # In-place operators: a storage both read and written (optimizer steps, accumulation).
    assert any(set(e.inputs) & set(e.outputs) for t in traces for e in t.events)


def test_dense_layers_read_every_earlier_output() -> None:
    trace = generate(2, family="dense", iterations=1)
    layers = [e for e in trace.events if e.kind == "op" and e.name.startswith("dense")]
    layers = [e for e in layers if not e.name.endswith("_backward")]
    assert len(layers) >= 4
    for before, after in zip(layers, layers[1:]):
        # The next layer reads what this one read (but its weight) plus this one's output.
        assert set(before.inputs[:-1]) | set(before.outputs) == set(after.inputs[:-1])


def test_foreach_step_pins_every_parameter_gradient_and_state() -> None:
    trace = generate(3, optimizer="foreach_adam", iterations=2)
    steps = [e for e in trace.events if e.name == "foreach_adam_step"]
    assert len(steps) == 2
    params = {e.outputs[0] for e in trace.events if e.name == "init_param"}
    first, second = steps
    # First step: params and grads in, params and two fresh states per param out.
    assert set(first.inputs) >= params and len(first.inputs) == 2 * len(params)
    assert len(set(first.outputs)) == 3 * len(params)
    assert len(set(second.inputs)) == 4 * len(params)
    index = trace.events.index(second)
    assert trace.analysis.working_set[index] == trace.analysis.ws_max


def test_every_storage_is_freed_and_backward_reads_saved_activations() -> None:
    for seed in SEEDS:
        trace = generate(seed)
        allocated = {e.sid for e in trace.events if e.kind == "alloc"}
        freed = [e.sid for e in trace.events if e.kind == "free"]
        assert sorted(freed) == sorted(allocated), seed
        backward = [e for e in trace.events if e.name.endswith("_backward")]
        assert backward, seed
        forward_outputs = {
            sid for e in trace.events if e.kind == "op" and "_" not in e.name for sid in e.outputs
        }
        assert any(set(e.inputs) & forward_outputs for e in backward), seed


def test_regimes_set_the_capacity_as_documented() -> None:
    for seed in range(120):
        trace = generate(seed)
        a = trace.analysis
        if trace.regime == "fit":
            assert trace.capacity >= a.bound_max
            assert a.need_max <= trace.limit < a.peak_live or trace.limit == a.need_max
        elif trace.regime == "tight":
            assert a.need_max < trace.capacity
        else:
            assert a.first_over(trace.capacity) is not None


def test_fault_args_for_every_plan() -> None:
    trace = generate(5)
    assert fault_args("none", trace) == []
    for plan in FAULT_PLANS[1:]:
        args = fault_args(plan, trace)
        assert args[-1] == "--continue-after-error", plan
        options = args[:-1]
        assert options and all(a.startswith("--") for a in options[::2]), plan
        assert all(int(v) >= 0 for v in options[1::2]), plan
    hog = fault_args("device_full", trace)
    at = int(hog[hog.index("--hog-at") + 1])
    assert 0 <= at < len(trace.events)
    with pytest.raises(ValueError, match="unknown fault plan"):
        fault_args("cosmic_rays", trace)


def test_analyze_keeps_managed_storages_reclaimable_after_their_operator() -> None:
    events = [
        Event("alloc", sid=1, size=MIB),
        Event("op", name="w", outputs=(1,)),
        Event("alloc", sid=2, size=MIB),
        Event("op", name="w", outputs=(2,)),
    ]
    # Managed (threshold 64 KiB): after its op, storage 1 no longer counts.
    assert analyze(events, 64 * KIB).need == [MIB, MIB, MIB, MIB]
    # Unmanaged (threshold 2 MiB): it stays on the device whatever happens.
    assert analyze(events, 2 * MIB).need == [MIB, MIB, 2 * MIB, 2 * MIB]


def test_command_line_writes_the_trace_and_the_replay_command(tmp_path: Path) -> None:
    out = tmp_path / "seed9.trace"
    args = ["--seed", "9", "--plan", "host_alloc", "--out", str(out), "--replayer", "/x/replay"]
    proc = subprocess.run(
        [sys.executable, "-m", "lmsbench.trace_gen", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    assert out.read_text() == generate(9).text()
    expected = " ".join(["/x/replay", str(out), *fault_args("host_alloc", generate(9))])
    assert f"replay: SIMGPU_SCRIBBLE=1 {expected}" in proc.stderr
