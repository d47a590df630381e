"""Kernel timings of one machine -> kernel-model overrides (``sp-plan probe --kernels``).

The probe (:mod:`sp_plan.runtime.probe.kernels`) times the GEMMs and attention calls the planner prices for
a model, sequence lengths and layouts (:func:`probe_shapes`: the layer's linears forward, input and weight
gradient at the rank's local tokens and tensor-parallel widths, :func:`sp_plan.cost_models.compute_time.
layer_gemm_shapes`; causal attention at the rank's local heads over the whole sequence, or a ring's two
call shapes). This module predicts each timing with the kernel model's own formulas at the topology's peak
(:class:`KernelPredictor`: the :func:`~sp_plan.cost_models.compute_time.fractions` the planner resolves and
:func:`~sp_plan.cost_models.kernels.gemm_seconds` / :func:`~sp_plan.cost_models.kernels.attention_seconds`),
and fits the GEMM and attention efficiencies and fixed costs by least squares on ln(predicted / measured)
(:func:`fit_kernels`), on all timings but a held-out one in five of each kind, which reports the fit's
error on shapes it did not see. The result is a :class:`~sp_plan.cost_models.profile.CalibrationFile` for
``--calibration``: kernel-level data move kernel parameters only (DESIGN.md section 5).

No torch here: the timings arrive as :class:`KernelTiming` records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from sp_plan.cost_models.compute_time import fractions, layer_gemm_shapes
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.flops import FLASH_BACKWARD_RATIO
from sp_plan.cost_models.kernels import attention_pairs, attention_seconds, gemm_seconds, kernel_family
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.profile import (
    CalibrationError,
    CalibrationFile,
    CalibrationResidual,
    CostProfile,
    resolve_profile,
)
from sp_plan.cost_models.stack import attention_kernel_for
from sp_plan.cost_models.topology import Topology

Kind = Literal["gemm", "attention_forward", "attention_backward"]
KINDS: tuple[Kind, ...] = ("gemm", "attention_forward", "attention_backward")
#: The calibration file's metric of each kind (seconds of one kernel call).
METRICS: dict[str, str] = {"gemm": "gemm_s", "attention_forward": "attention_forward_s",
                           "attention_backward": "attention_backward_s"}
#: One timing in this many of each kind is held out (at least one where a kind has three or more).
HOLD_OUT_EVERY = 5
#: A fixed cost is fitted only where it is at least this share of some fitted timing (d ln t / d ln launch_s);
#: below it the timings cannot tell it from noise, and it keeps the value the planner used.
MIN_ELASTICITY = 0.05
#: Residual (log) beyond which the robust loss grows linearly: a timing disturbed by another process.
ROBUST_SCALE = 0.1
#: Bounds of the fitted values (log space): fractions of peak as a calibration file accepts them, fixed costs
#: within the kernel model's own bounds.
FRACTION_BOUNDS = (1e-3, 1.0)
LAUNCH_BOUNDS = (1e-9, 1e-2)
#: Largest clock factor a kernel model holds (KernelModel.clock_factor): the room above a topology's peak.
MAX_CLOCK = 1.5
#: Largest shapes accepted (a typo'd 10^9-token GEMM is an error, not an hour of timing).
MAX_DIM = 1 << 22


# ----- shapes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmShape:
    """One ``(m x k) @ (k x n)`` GEMM."""

    m: int
    n: int
    k: int

    @property
    def kind(self) -> Kind:
        return "gemm"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def describe(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclass(frozen=True)
class AttentionShape:
    """One flash-attention call of one sequence (batch 1): ``heads`` query heads over ``kv_heads`` K/V heads
    (GQA), ``q_len`` queries against ``kv_len`` keys, forward or backward."""

    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool
    backward: bool

    @property
    def kind(self) -> Kind:
        return "attention_backward" if self.backward else "attention_forward"

    @property
    def flops(self) -> float:
        """The model's flash counting: 4 d pairs per head, backward 2.5x (flops.FLASH_BACKWARD_RATIO)."""
        ratio = FLASH_BACKWARD_RATIO if self.backward else 1.0
        return 4.0 * self.heads * self.head_dim * attention_pairs(self.q_len, self.kv_len, self.causal) * ratio

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"h{self.heads}/{self.kv_heads} {self.q_len}x{self.kv_len} d{self.head_dim} {mask}"


Shape = GemmShape | AttentionShape


@dataclass(frozen=True)
class PlannedKernel:
    """A shape to time and where the planner prices it (e.g. ``up_proj forward @ 4K tp=8``)."""

    shape: Shape
    uses: tuple[str, ...]

    @property
    def label(self) -> str:
        """The kind and the first use's kernel, e.g. ``gemm up_proj forward``."""
        return f"{self.shape.kind} {self.uses[0].split(' @ ')[0]}"

    @property
    def name(self) -> str:
        """A short id: :attr:`label` and the shape."""
        return f"{self.label} {self.shape.describe()}"


@dataclass(frozen=True)
class KernelTiming:
    """A planned kernel and its measured seconds per call."""

    kernel: PlannedKernel
    seconds: float

    @property
    def shape(self) -> Shape:
        return self.kernel.shape

    @property
    def kind(self) -> Kind:
        return self.kernel.shape.kind


def describe_layout(layout: Layout) -> str:
    parts = [f"{name}={getattr(layout, name)}" for name in ("tp", "ulysses", "ring") if getattr(layout, name) > 1]
    return ",".join(parts) or "tp=1"


def probe_shapes(model: ModelSpec, seq_lens: Sequence[int], layouts: Sequence[Layout]) -> list[PlannedKernel]:
    """The distinct GEMM and attention shapes the planner prices for ``model`` at each sequence length and
    layout (micro-batch 1), each with the places it is used.

    GEMMs: :func:`~sp_plan.cost_models.compute_time.layer_gemm_shapes` at ``seq_len / (ulysses x ring)`` local
    tokens and the layout's tp. Attention: without ring, one causal call over the whole sequence at the
    rank's ``heads / (tp x ulysses)`` query heads; with ring degree R (zigzag, chunk c = S / 2R), the causal
    2c x 2c block and the full 2c x c block the ring strategy prices (cost_models/strategies/ring.py), forward
    and backward."""
    if model.moe is not None or model.mla is not None:
        raise CostModelError(f"{model.name}: --kernels times dense layers' GEMMs and attention; MoE experts' grouped "
                             "GEMMs and MLA projections are not probed yet: give a dense model (e.g. llama3-8b)")
    if not seq_lens or not layouts:
        raise CostModelError("--kernels needs at least one sequence length and one layout")
    found: dict[Shape, list[str]] = {}
    for seq_len in seq_lens:
        for layout in layouts:
            where = f"{_tokens(seq_len)} {describe_layout(layout)}"
            layout.check_against(model, seq_len)
            step = math.lcm(layout.sp, 2 * layout.ring if layout.ring > 1 else 1)  # zigzag: 2R chunks
            if seq_len % step:
                raise CostModelError(f"sequence length {seq_len} does not split over {describe_layout(layout)}: use a "
                                     f"multiple of {step}")
            tokens = seq_len // layout.sp
            for linear, pass_, (m, n, k) in layer_gemm_shapes(model, tokens, layout.tp):
                shape = GemmShape(*(_dim(x, "GEMM dimension") for x in (m, n, k)))
                found.setdefault(shape, []).append(f"{linear} {pass_} @ {where}")
            split = layout.head_split
            heads = model.num_heads // split
            kv_heads = max(1, model.num_kv_heads * model.kv_replication(split) // split)
            if layout.ring > 1:
                c = seq_len // (2 * layout.ring)
                calls = [(2 * c, 2 * c, True, "ring causal block"), (2 * c, c, False, "ring full block")]
            else:
                calls = [(seq_len, seq_len, True, "causal")]
            for q_len, kv_len, causal, what in calls:
                for backward in (False, True):
                    shape = AttentionShape(heads, kv_heads, _dim(q_len, "query length"), _dim(kv_len, "key length"),
                                           model.head_dim, causal, backward)
                    found.setdefault(shape, []).append(f"attention {what} {'backward' if backward else 'forward'} @ "
                                                       f"{where}")
    return [PlannedKernel(shape, tuple(uses)) for shape, uses in found.items()]


def _dim(value: float, what: str) -> int:
    n = round(value)
    if n < 1 or n > MAX_DIM or abs(n - value) > 1e-6:
        raise CostModelError(f"{what} {value:g} is not a whole number in 1..{MAX_DIM}: choose shorter or "
                             "divisible sequence lengths")
    return n


def _tokens(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ----- the planner's prediction of a timing ----------------------------------------------------------------


def attention_kernel_name(profile: CostProfile, topology: Topology) -> tuple[str, str]:
    """(the attention kernel family the stack runs on this GPU, the kernel-file entry that prices it), as
    :func:`sp_plan.cost_models.compute_time.fractions` resolves them (FlashAttention-2's entry where the file has
    none of its own; CPU files have only that one)."""
    gpu = topology.gpu.name
    family = attention_kernel_for(profile.stack.time, gpu, kernel_family(gpu))
    return family, family if family in profile.kernels.attention else "fa2"


class KernelPredictor:
    """Seconds the planner gives a kernel shape on ``topology`` with ``stack``'s profile, in ``dtype``, before
    and after a calibration's kernel overrides (the same profile ``--calibration`` resolves)."""

    def __init__(self, topology: Topology, stack: str | None, dtype: str) -> None:
        self.topology = topology
        self.dtype = dtype
        self.gpu = topology.gpu.name
        self.base = resolve_profile(self.gpu, stack)
        self.family, self.attention_name = attention_kernel_name(self.base, topology)
        self.peak_raw = topology.peak_flops(dtype)  # a one-line error naming the dtypes it lists
        self._profiles: dict[tuple[tuple[str, float], ...], CostProfile] = {}

    @property
    def clock(self) -> float:
        """The clock factor the planner uses now on this GPU (kernel model's, else the GPU spec's)."""
        return fractions(self.topology, self.base).clock

    def resolved(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` as a calibration file can hold them. A fitted fraction above 1 means the kernels ran faster
        than the topology's peak x clock (on CPU the peak is itself one measured matmul rate, taken at another
        moment): the excess goes to ``clock_factor`` (the kernel model's compute-rate factor, up to
        :data:`MAX_CLOCK`) and every fitted fraction is divided by it, which predicts the same seconds."""
        top = max((v for p, v in values.items() if p.endswith("fraction")), default=0.0)
        if top <= 1.0:
            return dict(values)
        clock = values.get("clock_factor", self.clock)
        out = {p: (v / top if p.endswith("fraction") else v) for p, v in values.items()}
        out["clock_factor"] = min(MAX_CLOCK, clock * top)
        return out

    def profile(self, values: dict[str, float] | None = None) -> CostProfile:
        """The base profile with ``values`` (dotted kernel paths, fractions above 1 allowed:
        :meth:`resolved`) applied as a calibration file applies them."""
        values = self.resolved(values) if values else values
        key = tuple(sorted((values or {}).items()))
        if key not in self._profiles:
            if values:
                kernels = self.base.kernels.with_values(values)
                self._profiles[key] = CostProfile(self.base.stack, kernels, frozenset(values))
            else:
                self._profiles[key] = self.base
            if len(self._profiles) > 4096:  # a fit evaluates a few hundred points; bound the cache anyway
                self._profiles = {key: self._profiles[key]}
        return self._profiles[key]

    def seconds(self, shape: Shape, values: dict[str, float] | None = None) -> float:
        profile = self.profile(values)
        fr = fractions(self.topology, profile)
        k = profile.kernels
        peak = self.peak_raw * fr.clock
        if isinstance(shape, GemmShape):
            return gemm_seconds(shape.m, shape.n, shape.k, peak, fr.matmul, k.gemm, k.sms)
        fraction = fr.attention_backward if shape.backward else fr.attention_forward
        ratio = FLASH_BACKWARD_RATIO if shape.backward else 1.0
        return attention_seconds(shape.heads, shape.q_len, shape.kv_len, shape.head_dim, shape.causal, peak,
                                 fraction, fr.attention, k.sms, ratio)

    def current(self, path: str) -> float:
        """The value the planner uses now for a fitted parameter: a fraction as :func:`fractions` resolves it
        (a probed topology's own compute calibration wins over the kernel file), a fixed cost from the file."""
        fr = fractions(self.topology, self.base)
        name = self.attention_name
        resolved = {"gemm.peak_fraction": fr.matmul, f"attention.{name}.forward_fraction": fr.attention_forward,
                    f"attention.{name}.backward_fraction": fr.attention_backward}
        return resolved[path] if path in resolved else self.base.kernels.value(path)

    def parameters(self, kinds: set[str]) -> list[str]:
        """The kernel paths timings of ``kinds`` can move."""
        name = self.attention_name
        paths = []
        if "gemm" in kinds:
            paths += ["gemm.peak_fraction", "gemm.launch_s"]
        if "attention_forward" in kinds:
            paths.append(f"attention.{name}.forward_fraction")
        if "attention_backward" in kinds:
            paths.append(f"attention.{name}.backward_fraction")
        if kinds & {"attention_forward", "attention_backward"}:
            paths.append(f"attention.{name}.launch_s")
        return paths


# ----- the fit ---------------------------------------------------------------------------------------------


def hold_out(timings: Sequence[KernelTiming]) -> list[bool]:
    """Which timings to hold out: in each kind sorted by FLOPs, one in :data:`HOLD_OUT_EVERY` (at least one
    where the kind has three or more), evenly spread and never the smallest or largest, so the held-out
    shapes are ones the fit interpolates to and at least two of each kind stay fitted."""
    held = [False] * len(timings)
    for kind in KINDS:
        idx = sorted((i for i, t in enumerate(timings) if t.kind == kind), key=lambda i: timings[i].shape.flops)
        n = len(idx)
        count = 0 if n < 3 else max(1, n // HOLD_OUT_EVERY)
        for j in range(count):
            held[idx[min(n - 2, max(1, round((j + 1) * (n - 1) / (count + 1))))]] = True
    return held


def _mean_abs_pct(ratios: Sequence[float]) -> float:
    return 100.0 * sum(abs(r - 1.0) for r in ratios) / len(ratios) if ratios else 0.0


@dataclass
class ProbeFit:
    """What :func:`fit_kernels` found, with every timing's prediction before and after."""

    predictor: KernelPredictor
    timings: list[KernelTiming]
    held: list[bool]
    values: dict[str, float]
    #: Parameters the timings cannot pin -> their largest elasticity (they keep the planner's value).
    kept: dict[str, float]
    #: The value each fitted parameter had before (what the planner used).
    before_values: dict[str, float]
    before: list[float]
    after: list[float]
    #: Fitted parameters that ended at a bound (the data would take them further).
    at_bound: list[str] = field(default_factory=list)

    def errors(self) -> list[CalibrationError]:
        """Mean |predicted / measured - 1| per kind, fitted on and held out, before and after."""
        rows = []
        for split, wanted in (("fitted on", False), ("held out", True)):
            for kind in KINDS:
                idx = [i for i, t in enumerate(self.timings) if t.kind == kind and self.held[i] == wanted]
                if not idx:
                    continue
                rows.append(CalibrationError(
                    metric=f"{METRICS[kind]} ({split})", runs=len(idx),
                    before_mean_abs_pct=round(_mean_abs_pct([self.before[i] / self.timings[i].seconds for i in idx]), 3),
                    after_mean_abs_pct=round(_mean_abs_pct([self.after[i] / self.timings[i].seconds for i in idx]), 3)))
        return rows

    def held_out_error(self, when: Literal["before", "after"]) -> float:
        """Mean |predicted / measured - 1| (a fraction) over every held-out timing."""
        predicted = self.before if when == "before" else self.after
        idx = [i for i, h in enumerate(self.held) if h]
        return _mean_abs_pct([predicted[i] / self.timings[i].seconds for i in idx]) / 100.0

    def residuals(self, source: str) -> list[CalibrationResidual]:
        return [CalibrationResidual(id=t.kernel.name[:300], source=source[:4096], metric=METRICS[t.kind],
                                    split="held out" if h else "fitted on",
                                    log_error=round(math.log(a / t.seconds), 6))
                for t, h, a in zip(self.timings, self.held, self.after, strict=True)]

    def to_file(self, stack: str, description: str, source: str) -> CalibrationFile:
        kernels = {path: (round(v, 9) if abs(v) < 1e-3 else round(v, 6)) for path, v in self.values.items()}
        return CalibrationFile(description=description[:4000], gpu=self.predictor.gpu, stack=stack, kernels=kernels,
                               fitted_on=[t.kernel.name for t, h in zip(self.timings, self.held) if not h],
                               held_out=[t.kernel.name for t, h in zip(self.timings, self.held) if h],
                               errors=self.errors(), residuals=self.residuals(source))


def _bounds(path: str, clock: float = 1.0) -> tuple[float, float]:
    """A parameter's fit bounds; fractions may exceed 1 up to :data:`MAX_CLOCK` / ``clock`` (see
    :meth:`KernelPredictor.resolved`)."""
    if path.endswith("_s"):
        return LAUNCH_BOUNDS
    return FRACTION_BOUNDS[0], max(FRACTION_BOUNDS[1], MAX_CLOCK / clock)


def _elasticity(predictor: KernelPredictor, shapes: Sequence[Shape], path: str, value: float,
                values: dict[str, float]) -> float:
    """Largest |d ln t / d ln value| over ``shapes`` (a 5% step) with the other parameters at ``values``."""
    base = [predictor.seconds(s, {**values, path: value}) for s in shapes]
    moved = [predictor.seconds(s, {**values, path: value * 1.05}) for s in shapes]
    return max((abs(math.log(m / b)) / math.log(1.05) for m, b in zip(moved, base) if m > 0 and b > 0), default=0.0)


def fit_kernels(timings: Sequence[KernelTiming], predictor: KernelPredictor, held: Sequence[bool] | None = None,
                ) -> ProbeFit:
    """Fit the GEMM and attention efficiencies and fixed costs to ``timings`` (all but ``held``; default
    :func:`hold_out`) by ``scipy.optimize.least_squares`` (trust-region reflective, soft-L1 at
    :data:`ROBUST_SCALE`) on ln(predicted / measured) in log-parameter space, starting from the values the
    planner uses now. A fixed cost that is under :data:`MIN_ELASTICITY` of every fitted timing at the fitted
    point keeps the planner's value (the others are refitted without it)."""
    from scipy.optimize import least_squares

    timings = list(timings)
    for t in timings:
        if not (math.isfinite(t.seconds) and t.seconds > 0):
            raise CostModelError(f"{t.kernel.name}: measured {t.seconds!r} s is not a positive time")
    held = list(hold_out(timings) if held is None else held)
    fit_idx = [i for i, h in enumerate(held) if not h]
    if not fit_idx:
        raise CostModelError("no kernel timings to fit: raise --budget or give shorter --seq-lens")
    kinds = {timings[i].kind for i in fit_idx}
    paths = predictor.parameters(kinds)
    clock = predictor.clock
    start = {p: min(max(predictor.current(p), _bounds(p, clock)[0]), _bounds(p, clock)[1]) for p in paths}
    fit_shapes = [timings[i].shape for i in fit_idx]
    measured = np.array([timings[i].seconds for i in fit_idx])

    def solve(free: list[str]) -> tuple[dict[str, float], list[str]]:
        lo = np.log([_bounds(p, clock)[0] for p in free])
        hi = np.log([_bounds(p, clock)[1] for p in free])
        x0 = np.clip(np.log([max(start[p], 1e-7) for p in free]), lo, hi)

        def residuals(x: np.ndarray) -> np.ndarray:
            values = dict(zip(free, np.exp(x).tolist()))
            return np.log([predictor.seconds(s, values) for s in fit_shapes]) - np.log(measured)

        sol = least_squares(residuals, x0, bounds=(lo, hi), method="trf", loss="soft_l1", f_scale=ROBUST_SCALE,
                            x_scale=1.0, diff_step=1e-4, xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=400)
        return dict(zip(free, np.exp(sol.x).tolist())), [p for p, x, a, b in zip(free, sol.x, lo, hi)
                                                          if min(x - a, b - x) < 1e-6]

    # Fit every parameter, then judge the fixed costs at the fitted point (at the starting values a CPU's
    # millisecond overheads look negligible): one that is under MIN_ELASTICITY of every fitted timing of its
    # kind is noise to these shapes, keeps the planner's value, and the rest are fitted again without it.
    values, at_bound = solve(paths)
    kept: dict[str, float] = {}
    for p in [p for p in paths if p.endswith("_s")]:
        share = _elasticity(predictor, [s for s in fit_shapes if _moves(p, s)], p, values[p], values)
        if share < MIN_ELASTICITY:
            kept[p] = share
    if kept:
        values, at_bound = solve([p for p in paths if p not in kept])
    before = [predictor.seconds(t.shape) for t in timings]
    after = [predictor.seconds(t.shape, values) for t in timings]
    values = predictor.resolved(values)
    previous = {p: predictor.current(p) for p in paths}
    if "clock_factor" in values:
        previous["clock_factor"] = clock
        at_bound = [p for p in at_bound if p.endswith("_s")] + (["clock_factor"] if values["clock_factor"] >= MAX_CLOCK
                                                                 else [])
    return ProbeFit(predictor, timings, held, values, kept, previous, before, after, at_bound)


def _moves(path: str, shape: Shape) -> bool:
    """Whether ``path`` can change the time of ``shape`` (GEMM parameters GEMMs, attention ones attention)."""
    return path.startswith("gemm.") == isinstance(shape, GemmShape)


__all__ = [
    "METRICS",
    "AttentionShape",
    "GemmShape",
    "KernelPredictor",
    "KernelTiming",
    "PlannedKernel",
    "ProbeFit",
    "attention_kernel_name",
    "describe_layout",
    "fit_kernels",
    "hold_out",
    "probe_shapes",
]
