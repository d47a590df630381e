"""Calibrate on the user's runs: which parameters, the fit, before/after errors, the calibration file.

The parameters are the ones a cluster and a stack change: the GPU's asymptotic GEMM, attention and
HBM efficiencies (priors: what the prediction used before, i.e. a probed topology's measured values or
the kernel model's fitted ones), the fixed costs per GEMM, attention call and ring step, and the stack's
host-side overheads per layer and per step; with memory figures that include the allocator's cache
(reserved, nvml), also the fragmentation fraction and the CUDA context size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sp_plan.cost_models.compute_time import fractions
from sp_plan.cost_models.kernels import kernel_family
from sp_plan.cost_models.profile import CalibrationError, CalibrationFile, CalibrationResidual, resolve_profile
from sp_plan.cost_models.stack import attention_kernel_for

from .bands import step_log_error
from .fit import FitResult, Parameter, fit, kendall_tau, predict_all, run_gpu
from .report import errors_of
from .runs import MeasuredRun, run_topology

#: Prior width (log space) of every user parameter: wide enough that a handful of the user's own runs
#: outweigh the shipped values (their cluster and stack are the truth), narrow enough to keep parameters
#: that the runs barely constrain from wandering to their bounds.
USER_PRIOR_SIGMA = 100.0
#: Metrics that include the allocator's cache and the CUDA context.
_RESERVED_METRICS = ("reserved_gib", "nvml_used_gib")


def user_fit_parameters(runs: Sequence[MeasuredRun]) -> list[Parameter]:
    """Parameters worth fitting to ``runs`` (all on one GPU type and stack)."""
    first = runs[0]
    gpu = run_gpu(first)
    family = kernel_family(gpu)
    profile = resolve_profile(gpu, first.stack)
    topo = run_topology(first.topology, first.layout.world)
    fr = fractions(topo, profile)
    k = profile.kernels
    # The kernel this stack runs on this GPU variant (e.g. torchtitan runs cuDNN on B200), as the time model prices it.
    chosen = attention_kernel_for(profile.stack.time, gpu, family)
    attn = chosen if chosen in k.attention else "fa2"
    a = k.attention[attn]
    t = profile.stack.time
    params = [
        Parameter(target="kernels.gemm.peak_fraction", family=family, prior=fr.matmul, lower=0.01, upper=1.0, sigma=USER_PRIOR_SIGMA),
        Parameter(target=f"kernels.attention.{attn}.forward_fraction", family=family, prior=fr.attention_forward,
                  lower=0.005, upper=1.0, sigma=USER_PRIOR_SIGMA),
        Parameter(target=f"kernels.attention.{attn}.backward_fraction", family=family, prior=fr.attention_backward,
                  lower=0.005, upper=1.0, sigma=USER_PRIOR_SIGMA),
        Parameter(target="kernels.memory_fraction", family=family, prior=fr.memory, lower=0.01, upper=1.0, sigma=USER_PRIOR_SIGMA),
        Parameter(target="kernels.gemm.launch_s", family=family, prior=max(k.gemm.launch_s, 1e-7), lower=1e-8,
                  upper=1e-2, sigma=USER_PRIOR_SIGMA),
        Parameter(target=f"kernels.attention.{attn}.launch_s", family=family, prior=max(a.launch_s, 1e-7),
                  lower=1e-8, upper=1e-2, sigma=USER_PRIOR_SIGMA),
        Parameter(target="kernels.ring_step_s", family=family, prior=max(k.ring_step_s, 1e-7), lower=1e-8,
                  upper=0.1, sigma=USER_PRIOR_SIGMA),
        Parameter(target="time.layer_overhead_s", stack=first.stack, prior=max(t.layer_overhead_s, 1e-6),
                  lower=1e-8, upper=1.0, sigma=USER_PRIOR_SIGMA),
        Parameter(target="time.step_overhead_s", stack=first.stack, prior=max(t.step_overhead_s, 1e-4),
                  lower=1e-8, upper=600.0, sigma=USER_PRIOR_SIGMA),
    ]
    if any(r.metric in _RESERVED_METRICS for r in runs):
        m = profile.memory
        params.append(Parameter(target="memory.fragmentation_fraction", stack=first.stack,
                                prior=max(m.fragmentation_fraction, 1e-3), lower=1e-4, upper=2.0, sigma=USER_PRIOR_SIGMA))
        params.append(Parameter(target="memory.cuda_context_bytes", stack=first.stack,
                                prior=float(max(m.cuda_context_bytes, 1 << 20)), lower=float(1 << 20),
                                upper=float(1 << 34), sigma=1.0))
    return params


@dataclass
class Calibration:
    fit: FitResult
    fitted_runs: list[MeasuredRun]
    check_runs: list[MeasuredRun]
    #: Run id -> (before, after) predictions.
    predictions: dict[str, tuple[float, float]]
    #: Run id -> held-out prediction when no check runs were given (leave-one-file-out).
    cross_validated: dict[str, float]
    errors: list[CalibrationError]
    #: Every run's error after the calibration and how it was used (fitted on, held out, cross-validated).
    residuals: list[CalibrationResidual] = field(default_factory=list)
    #: Parameters the runs cannot pin (kept at their prior) -> their largest elasticity over the fitted runs.
    frozen: dict[str, float] = field(default_factory=dict)

    def to_file(self, description: str) -> CalibrationFile:
        kernels: dict[str, float] = {}
        time: dict[str, float] = {}
        memory: dict[str, float] = {}
        for p, v in zip(self.fit.params, self.fit.values):
            section, _, path = p.target.partition(".")
            value = round(v, 9) if abs(v) < 1e-3 else round(v, 6)
            if section == "memory" and path == "cuda_context_bytes":
                value = int(round(v))
            {"kernels": kernels, "time": time, "memory": memory}[section][path] = value
        first = self.fitted_runs[0]
        return CalibrationFile(description=description, gpu=run_gpu(first), stack=first.stack, kernels=kernels,
                               time=time, memory=memory, fitted_on=[r.id for r in self.fitted_runs],
                               held_out=[r.id for r in self.check_runs], errors=self.errors,
                               residuals=self.residuals)


def _mean_abs(errors: Sequence[float]) -> float:
    return 100.0 * sum(abs(e) for e in errors) / len(errors) if errors else float("nan")


def _tau(runs: Sequence[MeasuredRun], predicted: Sequence[float]) -> float | None:
    """Kendall tau of the step-time ordering (the layouts' ranking) among the step-time runs."""
    pairs = [(r.value, p) for r, p in zip(runs, predicted) if r.metric == "step_s"]
    if len(pairs) < 2:
        return None
    tau = kendall_tau([a for a, _ in pairs], [b for _, b in pairs])
    return None if math.isnan(tau) else tau


def _error_rows(label: str, runs: Sequence[MeasuredRun], before: Sequence[float],
                after: Sequence[float]) -> list[CalibrationError]:
    rows = []
    for metric in sorted({r.metric for r in runs}):
        idx = [i for i, r in enumerate(runs) if r.metric == metric]
        sub = [runs[i] for i in idx]
        b, a = [before[i] for i in idx], [after[i] for i in idx]
        rows.append(CalibrationError(
            metric=f"{metric} ({label})", runs=len(sub),
            before_mean_abs_pct=_mean_abs(errors_of(sub, b)), after_mean_abs_pct=_mean_abs(errors_of(sub, a)),
            before_kendall_tau=_tau(sub, b), after_kendall_tau=_tau(sub, a)))
    return rows


#: Most runs the optimizer fits on. Each fit evaluates every run's prediction 100-150 times
#: (finite-difference Jacobians of up to 11 parameters, 10-20 iterations); beyond about ten runs per
#: parameter more rows add little information but cost linear time (1,000 runs took minutes). Larger
#: sets are fitted on an evenly spread sample (:func:`fit_sample`); every run is still predicted before
#: and after, and the runs outside the sample are reported as held out.
MAX_FIT_RUNS = 120
#: Leave-one-file-out cross-validation refits once per fold; with more files than this, files are
#: grouped into this many folds (whole files stay together).
MAX_FOLDS = 5


def fit_sample(runs: Sequence[MeasuredRun], limit: int | None = None) -> list[MeasuredRun]:
    """At most ``limit`` (default :data:`MAX_FIT_RUNS`) of ``runs``, evenly spaced over them sorted by
    metric, source, layout and size, so every metric, file and layout keeps its share; deterministic (the
    same runs give the same sample)."""
    limit = MAX_FIT_RUNS if limit is None else max(2, limit)
    runs = list(runs)
    if len(runs) <= limit:
        return runs
    order = sorted(runs, key=lambda r: (r.metric, r.source, r.layout.describe(), r.train.seq_len,
                                        r.train.micro_batch, r.id))
    step = (len(order) - 1) / (limit - 1)
    return [order[round(i * step)] for i in range(limit)]


def _folds(runs: Sequence[MeasuredRun]) -> list[list[str]]:
    """Sources (files) grouped into at most :data:`MAX_FOLDS` folds, round-robin in sorted order."""
    sources = sorted({r.source for r in runs})
    folds = [sources[i::MAX_FOLDS] for i in range(min(MAX_FOLDS, len(sources)))]
    return [f for f in folds if f]


#: A parameter is fitted only where it governs at least this share of some fitted run's figure (its elasticity,
#: d ln predicted / d ln parameter): below it the runs cannot tell the parameter from noise, and a fit lets it
#: run to a bound (three 8K runs drove the attention efficiencies to 1.0 and a 262K prediction 2.5x off).
MIN_ELASTICITY = 0.05
_ELASTICITY_STEP = 0.05


def _configuration(run: MeasuredRun) -> str:
    """A run's configuration without its metric: step time and tokens/s of one run are one measurement."""
    return run.id.rsplit(" [", 1)[0]


def elasticities(runs: Sequence[MeasuredRun], params: Sequence[Parameter]) -> dict[str, float]:
    """Parameter name -> the largest |d ln predicted / d ln parameter| over ``runs`` (a 5% step from the prior)."""
    base_values = [p.prior for p in params]
    base = predict_all(runs, params, base_values)
    out = {}
    for i, p in enumerate(params):
        values = list(base_values)
        step = _ELASTICITY_STEP if p.prior * (1 + _ELASTICITY_STEP) <= p.upper else -_ELASTICITY_STEP
        values[i] = p.prior * (1 + step)
        moved = predict_all(runs, params, values)
        out[p.name] = max((abs(math.log(m / b)) / abs(math.log1p(step)) for m, b in zip(moved, base)
                           if m > 0 and b > 0), default=0.0)
    return out


def identifiable(runs: Sequence[MeasuredRun], params: Sequence[Parameter]) -> tuple[list[Parameter], dict[str, float]]:
    """The parameters ``runs`` can pin, and the others with their elasticity (they keep their prior).

    Time parameters: those with elasticity >= :data:`MIN_ELASTICITY`, the most influential first, at most one
    fewer than the distinct time configurations measured (n measurements fit at most n - 1 parameters and
    keep one degree of freedom; at least one parameter is fitted). Memory parameters are judged on the
    memory figures alone."""
    time_runs = [r for r in runs if r.kind != "memory"]
    memory_runs = [r for r in runs if r.kind == "memory"]
    kept: list[Parameter] = []
    frozen: dict[str, float] = {}
    for group, pool in ((time_runs, [p for p in params if not p.target.startswith("memory.")]),
                        (memory_runs, [p for p in params if p.target.startswith("memory.")])):
        if not pool:
            continue
        if not group:
            frozen.update({p.name: 0.0 for p in pool})
            continue
        share = elasticities(group, pool)
        ranked = sorted(pool, key=lambda p: -share[p.name])
        room = max(1, len({_configuration(r) for r in group}) - 1)
        chosen = [p for p in ranked if share[p.name] >= MIN_ELASTICITY][:room] or ranked[:1]
        kept += [p for p in pool if p in chosen]
        frozen.update({p.name: share[p.name] for p in pool if p not in chosen})
    return kept, frozen


def calibrate(fit_runs: Sequence[MeasuredRun], check_runs: Sequence[MeasuredRun] = ()) -> Calibration:
    """Fit the user parameters to ``fit_runs``; report before/after errors on them and on ``check_runs``
    (or, without check runs and with three or more files, leave-one-file-out predictions).

    More than :data:`MAX_FIT_RUNS` runs are fitted on an evenly spread sample; the rest are predicted by
    that fit without having been seen, and reported as held out ("not in the fit sample")."""
    fit_runs, check_runs = list(fit_runs), list(check_runs)
    sample = fit_sample(fit_runs)
    params, frozen = identifiable(sample, user_fit_parameters(fit_runs))
    result = fit(sample, params)
    everything = fit_runs + check_runs
    before = predict_all(everything)  # the uncalibrated prediction: the stack and kernel model as shipped
    after = predict_all(everything, result.params, result.values)
    predictions = {r.id: (b, a) for r, b, a in zip(everything, before, after)}
    in_sample = {id(r) for r in sample}
    fitted = [i for i, r in enumerate(fit_runs) if id(r) in in_sample]
    unseen = [i for i, r in enumerate(fit_runs) if id(r) not in in_sample]
    errors = _error_rows("fitted on", [fit_runs[i] for i in fitted], [before[i] for i in fitted],
                         [after[i] for i in fitted])
    if unseen:
        errors += _error_rows("not in the fit sample", [fit_runs[i] for i in unseen], [before[i] for i in unseen],
                              [after[i] for i in unseen])
    n = len(fit_runs)
    cross: dict[str, float] = {}
    if check_runs:
        errors += _error_rows("held out", check_runs, before[n:], after[n:])
    elif len({r.source for r in fit_runs}) >= 3:
        for fold in _folds(fit_runs):
            held = [r for r in fit_runs if r.source in fold]
            train = fit_sample([r for r in fit_runs if r.source not in fold])
            fold_fit = fit(train, params)
            cross.update({r.id: p for r, p in zip(held, predict_all(held, fold_fit.params, fold_fit.values))})
        ids = [r for r in fit_runs if r.id in cross]
        errors += _error_rows("leave-one-file-out", ids, [predictions[r.id][0] for r in ids],
                              [cross[r.id] for r in ids])
    splits = ([(r, "fitted on", after[i]) for i, r in enumerate(fit_runs) if id(r) in in_sample]
              + [(r, "not in the fit sample", after[i]) for i, r in enumerate(fit_runs) if id(r) not in in_sample]
              + [(r, "held out", after[n + i]) for i, r in enumerate(check_runs)]
              + [(r, "leave-one-file-out", cross[r.id]) for r in fit_runs if r.id in cross])
    return Calibration(result, sample, check_runs, predictions, cross, errors, _residuals(splits), frozen)


def _residuals(used: Sequence[tuple[MeasuredRun, str, float]]) -> list[CalibrationResidual]:
    """Each (run, how it was used, prediction) as a :class:`CalibrationResidual` (the band's input)."""
    out = []
    for run, split, predicted in used:
        error = errors_of([run], [predicted])[0]
        if math.isfinite(error) and error > -1:
            out.append(CalibrationResidual(id=run.id[:300], source=run.source, metric=run.metric, split=split,
                                           log_error=round(step_log_error(run, error), 6)))
    return out


__all__ = ["MAX_FIT_RUNS", "MIN_ELASTICITY", "Calibration", "calibrate", "elasticities", "fit_sample", "identifiable",
           "user_fit_parameters"]
