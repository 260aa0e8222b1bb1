"""Seeded generator of stress cases: one :class:`Case` per seed, no torch needed.

A case is a model family with its shape (width, depth, resolution, batch), an optimizer, an
autocast mode, a memory cap as a fraction of the case's own uncapped peak, and a number of
training iterations. ``generate(seed)`` always returns the same case for the same seed, so a
seed is all it takes to replay a case.

Sizing: the batch is chosen so that the estimated uncapped peak of activations lands at a
target drawn between 1 and 5 GiB (``estimate_peak_bytes``; within a factor of about two of the
measured peak, which is what the worker reports and the cap is computed from). Every cap is at
most 0.75 of that peak, so the allocation that would reach the peak does not fit and LMS has
to page out; most shapes keep one operator's working set (the bound the suite measures) below
a quarter of the peak, so the cap is usually reachable.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

FAMILIES = ("resnet_add", "densenet_cat", "mlp_tokens", "transformer", "conv3d", "lstm")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam_foreach", "adam_fused", "adamw_foreach")
AMP_MODES = ("off", "bf16", "fp16")

CAP_MIN = 0.25
CAP_MAX = 0.75
ITERATIONS = 3
TARGET_PEAK_MIN_BYTES = 1 << 30
TARGET_PEAK_MAX_BYTES = 5 << 30
MAX_BATCH = 512

GiB = float(1 << 30)


@dataclass(frozen=True)
class Case:
    """One stress case. Fields that a family does not use are 0.

    Attributes:
        seed: the seed the case was generated from (and the training seed).
        family: one of :data:`FAMILIES`.
        width: channels of the first stage (CNNs), model width (token models), LSTM hidden
            size, growth rate (``densenet_cat``).
        depth: blocks per stage (CNNs), layers (token models, LSTM), layers per dense block.
        stages: resolution stages (CNNs) or dense blocks (``densenet_cat``); 1 otherwise.
        resolution: image side (CNNs) or sequence length (token models, LSTM).
        frames: clip length of ``conv3d``.
        heads: attention heads of ``transformer``.
        batch: samples per iteration.
        classes: output classes of the cross-entropy loss.
        optimizer: one of :data:`OPTIMIZERS`.
        amp: one of :data:`AMP_MODES` (``fp16`` uses a GradScaler).
        cap_fraction: the memory cap as a fraction of the uncapped peak reserved memory.
        iterations: training iterations.
    """

    seed: int
    family: str
    width: int
    depth: int
    stages: int
    resolution: int
    frames: int
    heads: int
    batch: int
    classes: int
    optimizer: str
    amp: str
    cap_fraction: float
    iterations: int

    def to_dict(self) -> dict[str, Any]:
        """The case as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        """The inverse of :meth:`to_dict`; unknown keys are an error."""
        return cls(**data)

    def label(self) -> str:
        """A short human-readable description of the case."""
        shape = {
            "resnet_add": f"w{self.width} {self.stages}x{self.depth} blocks {self.resolution}px",
            "densenet_cat": f"growth {self.width} {self.stages}x{self.depth} layers "
            f"{self.resolution}px",
            "mlp_tokens": f"d{self.width} x{self.depth} seq {self.resolution}",
            "transformer": f"d{self.width} h{self.heads} x{self.depth} seq {self.resolution}",
            "conv3d": f"w{self.width} {self.stages}x{self.depth} blocks {self.frames}x"
            f"{self.resolution}px",
            "lstm": f"h{self.width} x{self.depth} seq {self.resolution}",
        }[self.family]
        return (
            f"{self.family} {shape} batch {self.batch}, {self.optimizer}, amp {self.amp}, "
            f"cap {self.cap_fraction:.2f}"
        )


def _elements_per_sample(family: str, p: dict[str, int]) -> float:
    """Estimated fp32 elements held per sample at the peak (saved activations + gradients)."""
    w, depth, stages, res = p["width"], p["depth"], p["stages"], p["resolution"]
    if family == "resnet_add":
        # Stem (3 tensors) and per block about 7 saved tensors of c * s^2 elements; stage i
        # has 2^i w channels at (res / 2^i)^2 pixels.
        total = 3.0 * w * res * res
        for i in range(stages):
            total += depth * 7.0 * (w << i) * (res >> i) ** 2
        return total
    if family == "densenet_cat":
        g = w
        channels = 2 * g
        total = 3.0 * channels * res * res
        side = res
        for b in range(stages):
            for _ in range(depth):
                # BN+ReLU of the input, 4g bottleneck (conv out, BN, ReLU), g out, concat.
                total += (2.0 * channels + 3.0 * 4 * g + g + channels + g) * side * side
                channels += g
            if b < stages - 1:
                total += 3.0 * channels * side * side
                channels //= 2
                side //= 2
        return total
    if family == "mlp_tokens":
        # Per layer: LayerNorm in/out, fc1 out (4d), GELU out (4d), fc2 out, residual.
        return res * (depth * 13.0 * w + 4.0 * w)
    if family == "transformer":
        heads = p["heads"]
        per_layer = 17.0 * w + 4.0 * w * 2 + 3.0 * heads * res
        return res * (depth * per_layer + 4.0 * w)
    if family == "conv3d":
        total = 3.0 * w * p["frames"] * res * res
        for i in range(stages):
            total += depth * 7.0 * (w << i) * max(1, p["frames"] >> i) * (res >> i) ** 2
        return total
    if family == "lstm":
        # cuDNN keeps gates and cell states per step (the reserve space, ~10 h per layer);
        # plus the projection between layers and the residual.
        return res * depth * 16.0 * w
    raise ValueError(f"unknown family {family!r}")


# Measured peak activations per sample over _elements_per_sample's estimate (fp32, CPU).
_CALIBRATION = {
    "resnet_add": 0.55,
    "densenet_cat": 0.65,
    "mlp_tokens": 0.8,
    "transformer": 0.55,
    "conv3d": 0.6,
    "lstm": 1.2,
}
_STATE_PER_PARAM = {"sgd": 0, "sgd_momentum": 1, "adam_foreach": 2, "adam_fused": 2}


def _fields(case: Case) -> dict[str, int]:
    return {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}


def estimate_param_count(case: Case) -> int:
    """The number of parameters of the case's model (exact up to biases and norms)."""
    w, depth, stages = case.width, case.depth, case.stages
    if case.family in ("resnet_add", "conv3d"):
        k = 9 if case.family == "resnet_add" else 27
        total, cin = 3 * w * k, w
        for i in range(stages):
            cout = w << i
            total += depth * 2 * cout * cout * k + cin * cout * (k + 1) - cout * cout * k
            cin = cout
        return total + cin * case.classes
    if case.family == "densenet_cat":
        total, channels = 3 * 2 * w * 9, 2 * w
        for b in range(stages):
            for _ in range(depth):
                total += channels * 4 * w + 4 * w * w * 9
                channels += w
            if b < stages - 1:
                total += channels * (channels // 2)
                channels //= 2
        return total + channels * case.classes
    if case.family in ("mlp_tokens", "transformer"):
        per_layer = 8 * w * w + (4 * w * w if case.family == "transformer" else 0)
        return depth * per_layer + 64 * w + w * case.classes
    if case.family == "lstm":
        return depth * (8 * w * w + w * w) + 64 * w + w * case.classes
    raise ValueError(f"unknown family {case.family!r}")


def estimate_peak_bytes(case: Case) -> int:
    """A rough estimate of the case's uncapped peak allocated memory, in bytes.

    Activations (calibrated against the peak of live tensors measured on the CPU) plus
    parameters, gradients and optimizer state.
    """
    per_sample = _elements_per_sample(case.family, _fields(case)) * 4.0
    per_sample *= _CALIBRATION[case.family]
    if case.amp != "off":
        per_sample *= 0.6
    static = estimate_param_count(case) * 4 * (2 + _STATE_PER_PARAM.get(case.optimizer, 2))
    return int(per_sample * case.batch) + static


def estimate_bound_bytes(case: Case) -> int:
    """A rough estimate of the largest working set of one operator (inputs plus outputs).

    The optimizer's multi-tensor operators touch every parameter, gradient and state tensor
    at once (fused Adam: four of each); a convolution's backward holds its input, the
    output gradient and the input gradient; a concatenation its inputs and output; softmax's
    backward three attention-score tensors; a cuDNN LSTM layer its reserve space and
    sequences.
    """
    params = estimate_param_count(case) * 4
    b, w, r = case.batch, case.width, case.resolution
    scale = 0.6 if case.amp != "off" else 1.0
    if case.family == "resnet_add":
        act = 3.0 * b * w * r * r
    elif case.family == "conv3d":
        act = 3.0 * b * w * case.frames * r * r
    elif case.family == "densenet_cat":
        act = 2.2 * b * (2 * w + case.depth * w) * r * r
    elif case.family == "mlp_tokens":
        act = 2.5 * b * r * 4 * w
    elif case.family == "transformer":
        act = 3.0 * b * case.heads * r * r + 2.5 * b * r * 4 * w
    else:
        # Reserve space or workspace of one layer (~10 h per step and sample) plus its
        # input and output sequences; the LSTMs run in fp32 under bf16 autocast.
        act = 16.0 * b * r * w
        scale = 0.6 if case.amp == "fp16" else 1.0
    return int(max(4.2 * params, 4.0 * act * scale))


def _pick(rng: random.Random, values: tuple[Any, ...]) -> Any:
    return values[rng.randrange(len(values))]


def _shape(rng: random.Random, family: str) -> dict[str, int]:
    """Architecture hyperparameters of a family (everything but the batch)."""
    p = {"width": 0, "depth": 0, "stages": 1, "resolution": 0, "frames": 0, "heads": 0}
    if family == "resnet_add":
        p.update(
            width=_pick(rng, (16, 24, 32, 48, 64)),
            stages=rng.randint(2, 3),
            depth=rng.randint(2, 4),
            resolution=_pick(rng, (32, 48, 64, 96, 128)),
        )
    elif family == "densenet_cat":
        p.update(
            width=_pick(rng, (12, 16, 24, 32)),
            stages=rng.randint(2, 3),
            depth=rng.randint(4, 10),
            resolution=_pick(rng, (32, 48, 64, 96)),
        )
    elif family == "mlp_tokens":
        p.update(
            width=_pick(rng, (256, 384, 512, 768, 1024)),
            depth=rng.randint(3, 8),
            resolution=_pick(rng, (64, 128, 256, 512)),
        )
    elif family == "transformer":
        width = _pick(rng, (128, 192, 256, 384, 512))
        p.update(
            width=width,
            heads=_pick(rng, tuple(h for h in (2, 4, 8) if width % h == 0)),
            depth=rng.randint(3, 6),
            resolution=_pick(rng, (128, 256, 512)),
        )
    elif family == "conv3d":
        p.update(
            width=_pick(rng, (8, 16, 24, 32)),
            stages=2,
            depth=rng.randint(2, 3),
            frames=_pick(rng, (8, 16)),
            resolution=_pick(rng, (32, 48, 64)),
        )
    elif family == "lstm":
        p.update(
            width=_pick(rng, (128, 256, 384, 512)),
            depth=rng.randint(4, 8),
            resolution=_pick(rng, (64, 128, 256)),
        )
    else:
        raise ValueError(f"unknown family {family!r}")
    return p


def generate(seed: int) -> Case:
    """The case of ``seed``: the same seed always gives the same case.

    The family, optimizer, autocast mode, cap and target peak are drawn first; then shapes of
    the family are drawn until one reaches the target with a batch of at most
    :data:`MAX_BATCH` and an estimated largest operator working set below 70% of the cap
    (after 20 draws the last one is kept: such a case may rightly run out of memory).
    """
    if seed < 0:
        raise ValueError(f"seeds are >= 0, got {seed}")
    rng = random.Random(f"lms-stress-{seed}")
    family = _pick(rng, FAMILIES)
    optimizer = _pick(rng, OPTIMIZERS)
    amp = _pick(rng, AMP_MODES)
    cap_fraction = round(rng.uniform(CAP_MIN, CAP_MAX), 3)
    classes = _pick(rng, (10, 100, 1000))
    target = math.exp(rng.uniform(math.log(TARGET_PEAK_MIN_BYTES), math.log(TARGET_PEAK_MAX_BYTES)))
    case = None
    for _ in range(20):
        case = Case(
            seed=seed,
            family=family,
            batch=1,
            classes=classes,
            optimizer=optimizer,
            amp=amp,
            cap_fraction=cap_fraction,
            iterations=ITERATIONS,
            **_shape(rng, family),
        )
        one = estimate_peak_bytes(case)
        static = estimate_peak_bytes(dataclasses.replace(case, batch=0))
        batch = max(1, min(MAX_BATCH, round((target - static) / max(1, one - static))))
        case = dataclasses.replace(case, batch=batch)
        peak = estimate_peak_bytes(case)
        if (
            static <= 0.25 * target
            and peak >= 0.6 * target
            and estimate_bound_bytes(case) <= 0.7 * cap_fraction * peak
        ):
            break
    assert case is not None
    return case
