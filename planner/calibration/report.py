"""Accuracy of predictions against measured runs: per figure, per kind, per published table.

Used by ``benchmarks/accuracy.py`` (the published GPU measurements) and ``sp-plan calibrate`` (the
user's runs, before and after calibration). Errors are ``predicted / measured - 1``; for scale-free
tables (:attr:`MeasuredRun.scale_free`) the ratio is taken after dividing both sides by their table's
geometric mean. Kendall tau compares the order of the runs of one table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .fit import kendall_tau, log_residuals
from .runs import MeasuredRun

#: The issue's accuracy targets: |error| per kind, scored on exact-confidence figures (out of sample where
#: there is a held-out prediction), and Kendall tau per published table.
TARGETS = {"memory": 0.10, "max_length": 0.15, "throughput": 0.15}
TAU_TARGET = 0.8


@dataclass
class RunResult:
    run: MeasuredRun
    predicted: float
    held_out: float | None = None  # predicted by a fit that did not see this run's source
    other_stack: dict[str, float] = field(default_factory=dict)  # stack -> prediction
    error: float = 0.0
    held_out_error: float | None = None

    @property
    def best_error(self) -> float:
        """The out-of-sample error when there is one, else the in-sample one."""
        return self.held_out_error if self.held_out_error is not None else self.error


def errors_of(runs: Sequence[MeasuredRun], predicted: Sequence[float]) -> list[float]:
    """predicted / measured - 1, group-normalised for scale-free runs."""
    return [math.exp(v) - 1 for v in log_residuals(runs, predicted)]


def evaluate(runs: Sequence[MeasuredRun], predict: Callable[[MeasuredRun], float],
             held_out: dict[str, float] | None = None) -> list[RunResult]:
    runs = list(runs)
    preds = [predict(r) for r in runs]
    errs = errors_of(runs, preds)
    results = [RunResult(r, p, error=e) for r, p, e in zip(runs, preds, errs)]
    if held_out:
        known = [r for r in runs if r.id in held_out]
        ho_errs = dict(zip((r.id for r in known), errors_of(known, [held_out[r.id] for r in known])))
        for res in results:
            if res.run.id in held_out:
                res.held_out = held_out[res.run.id]
                res.held_out_error = ho_errs[res.run.id]
    return results


@dataclass
class KindSummary:
    kind: str
    runs: int
    mean_abs_error: float
    mean_abs_held_out: float | None
    within_target: int | None
    target: float | None


def summarise(results: Sequence[RunResult]) -> list[KindSummary]:
    out = []
    for kind in ("memory", "max_length", "throughput", "attention_kernel", "layer_time"):
        rs = [r for r in results if r.run.kind == kind]
        if not rs:
            continue
        ho = [abs(r.held_out_error) for r in rs if r.held_out_error is not None]
        target = TARGETS.get(kind)
        scored = [r for r in rs if r.run.confidence == "exact"]  # targets are for figures printed exactly
        within = sum(abs(r.best_error) <= target for r in scored) if target is not None else None
        out.append(KindSummary(kind, len(rs), sum(abs(r.error) for r in rs) / len(rs),
                               sum(ho) / len(ho) if ho else None, within, target))
    return out


@dataclass
class TableOrder:
    group: str
    runs: int
    tau: float
    tau_held_out: float | None


def table_orders(results: Sequence[RunResult]) -> list[TableOrder]:
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        if r.run.group:
            groups.setdefault(r.run.group, []).append(r)
    out = []
    for name, rs in sorted(groups.items()):
        if len(rs) < 2:
            continue
        measured = [r.run.value for r in rs]
        tau = kendall_tau(measured, [r.predicted for r in rs])
        ho = None
        if all(r.held_out is not None for r in rs):
            ho = kendall_tau(measured, [r.held_out for r in rs])  # type: ignore[misc]
        out.append(TableOrder(name, len(rs), tau, ho))
    return out


def _pct(x: float | None) -> str:
    return "      -" if x is None else f"{x:+7.1%}"


def render(results: Sequence[RunResult], *, other_stack: str | None = None) -> list[str]:
    """The per-figure table, the per-kind summary and the per-table orderings, as text lines."""
    lines = []
    head = f"{'kind':<11} {'figure':<72} {'conf':<9} {'stack':<12} {'measured':>10} {'predicted':>10} {'error':>7} {'held-out':>8}"
    if other_stack:
        head += f" {other_stack + ' err':>14}"
    lines.append(head)
    for r in results:
        run = r.run
        row = (f"{run.kind[:11]:<11} {run.id[:72]:<72} {run.confidence:<9} {run.stack[:12]:<12} {run.value:>10.4g} "
               f"{r.predicted:>10.4g} {_pct(r.error)} {_pct(r.held_out_error):>8}")
        if other_stack:
            alt = r.other_stack.get(other_stack)
            row += f" {_pct(alt / run.value - 1 if alt is not None and not run.scale_free else None):>14}"
        lines.append(row)
    lines.append("")
    lines.append(f"{'kind':<17}{'figures':>8}{'mean |err|':>12}{'held-out':>10}   target")
    for s in summarise(results):
        ho = f"{s.mean_abs_held_out:>10.1%}" if s.mean_abs_held_out is not None else f"{'-':>10}"
        target = ""
        if s.target is not None:
            scope = "exact-confidence figures"
            n = sum(1 for r in results if r.run.kind == s.kind and r.run.confidence == "exact")
            target = f"within {s.target:.0%}: {s.within_target}/{n} {scope}"
        lines.append(f"{s.kind:<17}{s.runs:>8}{s.mean_abs_error:>12.1%}{ho}   {target}")
    lines.append("")
    lines.append(f"{'published table (ordering)':<46}{'runs':>5}{'tau':>8}{'held-out':>10}   target tau >= {TAU_TARGET}")
    for t in table_orders(results):
        ho = f"{t.tau_held_out:>10.2f}" if t.tau_held_out is not None and t.tau_held_out == t.tau_held_out else f"{'-':>10}"
        ok = "ok" if (t.tau_held_out if t.tau_held_out is not None else t.tau) >= TAU_TARGET else "MISS"
        lines.append(f"{t.group[:46]:<46}{t.runs:>5}{t.tau:>8.2f}{ho}   {ok}")
    return lines


__all__ = ["KindSummary", "RunResult", "TAU_TARGET", "TARGETS", "TableOrder", "errors_of", "evaluate", "render",
           "summarise", "table_orders"]
