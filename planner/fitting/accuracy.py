"""Every published figure predicted with the shipped parameters, next to its out-of-sample prediction.

``benchmarks/accuracy.py`` prints what this computes, and the tests that hold the report to its targets
(and every miss to a recorded cause, :mod:`.misses`) compute the same thing, so there is one definition of
"held out": time figures take the held-out errors stored with the shipped fit (a refit that never saw the
figure's source, GPU variant or stack); memory and max-length figures are predicted with the allocator
slack refitted without their own source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sp_plan.cost_models.fitted import FittedParameters

from .fit import Parameter, fit, profile_for
from .parameters import TIME_KINDS
from .report import RunResult, evaluate
from .runs import MeasuredRun, predict

#: The stack every figure is also priced under, as shipped (the report's last column).
COMPARE_STACK = "sp-plan"


@dataclass
class PublishedAccuracy:
    results: list[RunResult]
    #: The harder held-out splits of the time figures: split -> left-out group -> figure id -> error.
    splits: dict[str, dict[str, dict[str, float]]]
    #: What the memory refit found (printed by the report).
    memory_lines: list[str] = field(default_factory=list)


def published_accuracy(runs: Sequence[MeasuredRun], shipped_fit: FittedParameters,
                       time_held_out: dict[str, float] | None = None,
                       splits: dict[str, dict[str, dict[str, float]]] | None = None) -> PublishedAccuracy:
    """Predict every run with ``shipped_fit`` in effect (the caller's ``use_fitted``) and attach the
    out-of-sample predictions: ``time_held_out`` (fresh leave-one-source-out predictions of the time
    figures, from ``--fit``) or else the errors stored in ``shipped_fit``; ``splits`` likewise."""
    runs = list(runs)

    def shipped(run: MeasuredRun) -> float:
        return predict(run, profile_for(run))

    # Memory: one constant is fitted, the allocator slack (the GPU stacks' files ship the fit's value).
    # Refit it here and hold each source's memory and max-length figures out of their own fit.
    memory_runs = [r for r in runs if r.kind == "memory" and r.confidence == "exact"]
    slack = [Parameter(target="memory.allocator_slack_fraction", prior=0.0, lower=0.0, upper=1.0, sigma=10.0,
                       space="linear")]
    slack_fit = fit(memory_runs, slack)
    lines = [(f"memory: allocator_slack_fraction fitted on {len(memory_runs)} exact memory figures "
              f"({', '.join(slack_fit.fitted_on)}): {slack_fit.values[0]:.3f} (stacks ship "
              f"{sorted({profile_for(r).memory.allocator_slack_fraction for r in memory_runs})})")]
    held_out = dict(time_held_out or {})
    memory_sources = sorted({r.source for r in memory_runs})
    for source in memory_sources:
        fold = fit([r for r in memory_runs if r.source != source], slack)
        lines.append(f"  without {source}: {fold.values[0]:.3f}")
        for r in runs:
            if r.source == source and r.kind in ("memory", "max_length"):
                held_out[r.id] = predict(r, profile_for(r, fold.params, fold.values))
    for r in runs:  # figures of sources no memory constant was fitted on are out of sample as they are
        if r.kind in ("memory", "max_length") and r.source not in memory_sources:
            held_out[r.id] = shipped(r)

    results = evaluate(runs, shipped, held_out or None)
    if time_held_out is None:
        # The shipped file stores each held-out error (group-normalised for scale-free tables); a value
        # scaled by it orders a table exactly as the held-out prediction did.
        flat = {k: v for errs in shipped_fit.held_out.values() for k, v in errs.items()}
        for r in results:
            if r.run.id in flat and r.run.kind in TIME_KINDS:
                r.held_out_error = flat[r.run.id]
                r.held_out = r.run.value * (1 + flat[r.run.id])
    for r in results:
        if r.run.stack != COMPARE_STACK:  # the comparison stack as shipped: the source stack's own facts
            # (memory_overrides, a row's stack_time such as Transformer Engine's attention kernel) stay out
            alt = r.run.model_copy(update={"stack": COMPARE_STACK, "memory_overrides": {}, "time_overrides": {}})
            r.other_stack[COMPARE_STACK] = predict(alt, profile_for(alt))
    return PublishedAccuracy(results, dict(splits if splits is not None else shipped_fit.held_out_splits), lines)


__all__ = ["COMPARE_STACK", "PublishedAccuracy", "published_accuracy"]
