"""Fit kernel-model, stack and memory parameters to measured runs, and say how well they predict others.

The objective is least squares on log(predicted / measured), weighted by each figure's confidence, plus
a Gaussian prior on each parameter's log (or value) around its documented default: with a few dozen
published figures and a dozen parameters, the prior keeps a parameter that the data barely constrain
at its documented value instead of letting it chase noise. Solved with ``scipy.optimize.least_squares``
(trust-region reflective, bounded).

A fitted number means something only on figures it was not fitted to: :func:`leave_one_source_out`
refits without each source in turn and predicts that source, so every source's reported error is an
out-of-sample error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.kernels import kernel_family
from sp_plan.cost_models.profile import CalibrationFile, CostProfile, resolve_profile

from .runs import MeasuredRun, log_ratio, predict, run_topology

#: Weight of a figure in the fit by its confidence (a chart reading or an unstated unit counts less).
CONFIDENCE_WEIGHT = {"exact": 1.0, "measured": 1.0, "figure": 0.0, "ambiguous": 0.0}
#: Loss on the weighted log residuals, and the residual beyond which a robust loss grows linearly.
LOSS = "soft_l1"
ROBUST_SCALE = 0.3


class Parameter(BaseModel):
    """One fitted quantity: ``target`` is ``kernels.<dotted path>``, ``time.<StackTime field>`` or
    ``memory.<MemoryAssumptions field>``; ``family`` limits a kernel parameter to one GPU family (the
    kernel file's name: h100, a100, l20, ...), ``gpu`` to one GPU variant (a data/gpus/ file name: the
    variant's ``clock_factor``), ``stack`` a time/memory parameter to one stack."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    family: str | None = None
    gpu: str | None = None
    stack: str | None = None
    prior: float
    lower: float
    upper: float
    #: Prior width: in log space for ``log`` parameters (0.3 = about +-35%), in value units otherwise.
    sigma: float = Field(gt=0)
    space: Literal["log", "linear"] = "log"

    @property
    def name(self) -> str:
        scope = self.family or self.gpu or self.stack
        return f"{self.target}@{scope}" if scope else self.target

    def applies_to(self, run: MeasuredRun) -> bool:
        if self.target.startswith("kernels."):
            if self.gpu is not None:
                return self.gpu == run_gpu(run)
            return self.family is None or self.family == kernel_family(run_gpu(run))
        return self.stack is None or self.stack == run.stack

    def to_x(self, value: float) -> float:
        # Linear parameters are offset by 1: the solver's finite-difference steps are relative to x, and a
        # parameter whose value is near 0 would otherwise get steps too small to move any prediction.
        return math.log(value) if self.space == "log" else value + 1.0

    def from_x(self, x: float) -> float:
        return math.exp(x) if self.space == "log" else x - 1.0


def run_gpu(run: MeasuredRun) -> str:
    return run_topology(run.topology, run.layout.world).gpu.name


def overrides(run: MeasuredRun, params: Sequence[Parameter], values: Sequence[float]) -> CalibrationFile:
    """The calibration (kernel/time/memory overrides) that ``values`` of ``params`` mean for ``run``."""
    kernels: dict[str, float] = {}
    time: dict[str, float] = {}
    memory: dict[str, float] = {}
    for p, v in zip(params, values):
        if not p.applies_to(run):
            continue
        section, _, path = p.target.partition(".")
        {"kernels": kernels, "time": time, "memory": memory}[section][path] = float(v)
    return CalibrationFile(kernels=kernels, time=time, memory=memory)


def profile_for(run: MeasuredRun, params: Sequence[Parameter] = (), values: Sequence[float] = ()) -> CostProfile:
    cal = overrides(run, params, values)
    if run.time_overrides:  # the run's own software facts first; fitted values win where both speak
        cal = cal.model_copy(update={"time": {**run.time_overrides, **cal.time}})
    return resolve_profile(run_gpu(run), run.stack, calibration=cal, assume=run.memory_overrides or None)


def predict_all(runs: Sequence[MeasuredRun], params: Sequence[Parameter] = (),
                values: Sequence[float] = ()) -> list[float]:
    return [predict(r, profile_for(r, params, values)) for r in runs]


def log_residuals(runs: Sequence[MeasuredRun], predicted: Sequence[float]) -> list[float]:
    """log(predicted / measured) per run; for scale-free runs, minus the mean of their group's (so only
    the ratios inside a published table count)."""
    logs = [log_ratio(p, r.value) for p, r in zip(predicted, runs)]
    groups: dict[str, list[float]] = {}
    for r, v in zip(runs, logs):
        if r.scale_free and r.group:
            groups.setdefault(r.group, []).append(v)
    return [v - (sum(groups[r.group]) / len(groups[r.group]) if r.scale_free and r.group else 0.0)
            for r, v in zip(runs, logs)]


@dataclass
class FitResult:
    params: list[Parameter]
    values: list[float]
    fitted_on: list[str]
    rms_log_residual: float
    residuals: dict[str, float] = field(default_factory=dict)  # run id -> predicted / measured - 1
    success: bool = True
    message: str = ""

    def as_dict(self) -> dict[str, float]:
        return {p.name: v for p, v in zip(self.params, self.values)}


#: Relative change of a parameter used to find which figures depend on it.
_PROBE_STEP = 0.05
#: A figure "depends" on a parameter when that step changes its prediction by more than this.
_DEPENDENCE = 1e-3


def dependent_sources(runs: Sequence[MeasuredRun], params: Sequence[Parameter]) -> dict[str, set[str]]:
    """Parameter name -> the sources with at least one figure whose prediction moves with it (probed by
    a 5% step from the prior: a parameter can apply to a run, e.g. a backward efficiency to a
    forward-only benchmark, without the run depending on it). Figures the fit gives no weight (a chart
    reading, an unstated setting: :data:`CONFIDENCE_WEIGHT`) constrain nothing and are not counted."""
    runs = [r for r in runs if CONFIDENCE_WEIGHT.get(r.confidence, 1.0) > 0]
    base_values = [p.prior for p in params]
    base = log_residuals(runs, predict_all(runs, params, base_values))
    out: dict[str, set[str]] = {}
    for i, p in enumerate(params):
        if not any(p.applies_to(r) for r in runs):
            out[p.name] = set()
            continue
        values = list(base_values)
        up = p.prior * (1 + _PROBE_STEP) if p.prior else _PROBE_STEP
        values[i] = up if up <= p.upper else p.prior * (1 - _PROBE_STEP)  # stay inside the bounds
        moved = log_residuals(runs, predict_all(runs, params, values))
        # On the residuals the fit sees: a scale-free table depends on a parameter only through ratios.
        out[p.name] = {r.source for r, a, b in zip(runs, base, moved) if abs(b - a) > _DEPENDENCE}
    return out


def fit(runs: Sequence[MeasuredRun], params: Sequence[Parameter], *, min_sources: int = 1,
        max_nfev: int = 400) -> FitResult:
    """Least-squares fit of ``params`` to ``runs`` (log ratios, confidence-weighted, Gaussian priors).

    A parameter is fitted only when figures of at least ``min_sources`` sources depend on it; the others
    keep their prior (``min_sources=2``: no fitted constant rests on a single source).
    """
    from scipy.optimize import least_squares

    runs = list(runs)
    if not runs:
        raise CostModelError("no measured runs to fit: give at least one run per parameter")
    # Only figures the fit weighs count as a source constraining a parameter (dependent_sources drops the
    # rest): a chart reading (weight 0) beside one exact source must not let that one source ship a constant.
    depends = dependent_sources(runs, params)
    used = [p for p in params if len(depends[p.name]) >= max(1, min_sources)]
    per_source = {s: sum(r.source == s for r in runs) for s in {r.source for r in runs}}
    # Each source weighs about the same in total (a 12-point table must not outvote a 4-point one), and
    # the figures together weigh as many as they are.
    mean_n = len(runs) / len(per_source)
    weights = np.array([CONFIDENCE_WEIGHT.get(r.confidence, 1.0) * math.sqrt(mean_n / per_source[r.source])
                        for r in runs])
    x0 = np.array([p.to_x(p.prior) for p in used])
    lo = np.array([p.to_x(p.lower) for p in used])
    hi = np.array([p.to_x(p.upper) for p in used])
    sig = np.array([p.sigma for p in used])

    def values_of(x: np.ndarray) -> list[float]:
        return [p.from_x(float(v)) for p, v in zip(used, x)]

    def residuals(x: np.ndarray) -> np.ndarray:
        vals = values_of(x)
        preds = predict_all(runs, used, vals)
        data = weights * np.array(log_residuals(runs, preds))
        return np.concatenate([data, (x - x0) / sig])

    if used:
        sol = least_squares(residuals, np.clip(x0, lo, hi), bounds=(lo, hi), method="trf", x_scale="jac",
                            diff_step=1e-3, max_nfev=max_nfev, loss=LOSS, f_scale=ROBUST_SCALE,
                            ftol=1e-10, xtol=1e-10, gtol=1e-10)
        x, success, message = sol.x, bool(sol.success), str(sol.message)
    else:
        x, success, message = x0, True, "nothing to fit"
    vals = values_of(x)
    preds = predict_all(runs, used, vals)
    logs = log_residuals(runs, preds)
    return FitResult(
        params=used, values=vals, fitted_on=sorted({r.source for r in runs}),
        rms_log_residual=float(math.sqrt(sum(v * v for v in logs) / len(logs))),
        residuals={r.id: math.exp(v) - 1 for v, r in zip(logs, runs)}, success=success, message=message,
    )


@dataclass
class HeldOut:
    """One source's figures predicted by a fit that never saw them."""

    source: str
    fit: FitResult
    predictions: dict[str, float]  # run id -> predicted value


def leave_one_source_out(runs: Sequence[MeasuredRun], params: Sequence[Parameter],
                         sources: Iterable[str] | None = None,
                         progress: Callable[[str], None] | None = None) -> list[HeldOut]:
    """For each source: fit on every other source, predict this one."""
    return leave_one_group_out(runs, params, lambda r: r.source, sources, progress)


#: The held-out splits the accuracy report runs: what a prediction must generalise across.
SPLITS: dict[str, Callable[[MeasuredRun], str]] = {
    "source": lambda r: r.source,
    "gpu-variant": lambda r: run_gpu(r),
    "stack": lambda r: r.stack,
}


def leave_one_group_out(runs: Sequence[MeasuredRun], params: Sequence[Parameter],
                        key: Callable[[MeasuredRun], str], groups: Iterable[str] | None = None,
                        progress: Callable[[str], None] | None = None) -> list[HeldOut]:
    """For each group (a source, a GPU variant, a stack): fit on the runs outside it, predict it. A
    parameter only the held-out group constrains falls back to its prior, which is then what is tested."""
    runs = list(runs)
    out = []
    for group in groups if groups is not None else sorted({key(r) for r in runs}):
        train = [r for r in runs if key(r) != group]
        test = [r for r in runs if key(r) == group]
        if progress:
            progress(group)
        result = fit(train, params) if train else fit_nothing(params)
        # Every parameter at the fold's value or, where the fold could not fit it, at its prior (never at a
        # shipped value that the held-out group itself helped fit).
        values = {p.name: p.prior for p in params} | result.as_dict()
        preds = predict_all(test, list(params), [values[p.name] for p in params])
        out.append(HeldOut(group, result, {r.id: p for r, p in zip(test, preds)}))
    return out


def fit_nothing(params: Sequence[Parameter]) -> FitResult:
    """The priors, as a fit result (a fold with no training runs)."""
    return FitResult(params=[], values=[], fitted_on=[], rms_log_residual=0.0, message="priors only")


def kendall_tau(measured: Sequence[float], predicted: Sequence[float]) -> float:
    """Rank agreement of a published table's entries (1 = same order); ties count as in tau-b."""
    from scipy.stats import kendalltau

    if len(measured) < 2:
        return float("nan")
    tau = kendalltau(measured, predicted).statistic
    return float(tau) if tau == tau else float("nan")


__all__ = ["CONFIDENCE_WEIGHT", "FitResult", "HeldOut", "Parameter", "SPLITS", "fit", "fit_nothing", "kendall_tau",
           "leave_one_group_out", "leave_one_source_out",
           "dependent_sources", "log_residuals",
           "overrides", "predict_all", "profile_for", "run_gpu"]
