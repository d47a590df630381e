"""How well sp-plan's predictions agree with published GPU measurements.

Every entry of ``cost_models/data/calibration/published.yaml`` (memory, max length, throughput,
attention kernel and per-layer timings, with each source's metric semantics) becomes a measured run
(:mod:`planner.calibration.published`), predicted under its source's software stack and, for
comparison, under sp-plan's default stack. Throughput, kernel and per-layer figures are also used to
fit the GPU kernel models' efficiencies and the stacks' overheads; their "held-out" column is the
prediction of a fit that never saw the figure's source (leave-one-source-out), which is the number to
believe. Memory has one fitted constant (the allocator slack the GPU stacks ship, fitted on the exact
memory figures): each source's memory and max-length figures are held out of its fit the same way, and
figures of sources it was not fitted on are out of sample as they are.

    python benchmarks/accuracy.py                 # report with the shipped (fitted) parameters
    python benchmarks/accuracy.py --fit           # refit and recompute the held-out errors (~1 min)
    python benchmarks/accuracy.py --fit --write   # ... and rewrite cost_models/data/calibration/fitted.yaml
    python benchmarks/accuracy.py --json out.json # machine-readable results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from cost_models.fitted import FittedParameters, clear_cache, fitted_parameters  # noqa: E402
from planner.calibration.fit import FitResult, Parameter, fit, leave_one_source_out, profile_for  # noqa: E402
from planner.calibration.parameters import SHIPPED_MIN_SOURCES, TIME_KINDS, published_fit_parameters  # noqa: E402
from planner.calibration.published import published_runs  # noqa: E402
from planner.calibration.report import errors_of, evaluate, render, summarise, table_orders  # noqa: E402
from planner.calibration.runs import MeasuredRun, predict  # noqa: E402

COMPARE_STACK = "sp-plan"
FIT_METHOD = ("scipy.optimize.least_squares (trf, soft-L1) on confidence-weighted log(predicted/measured), each "
              "source weighted equally, Gaussian priors on each parameter around the kernel/stack files' values")


def fitted_file_content(result: FitResult, held: dict[str, dict[str, float]]) -> dict[str, Any]:
    kernels: dict[str, dict[str, float]] = {}
    stacks: dict[str, dict[str, float]] = {}
    for p, v in zip(result.params, result.values):
        section, _, path = p.target.partition(".")
        if section == "kernels":
            kernels.setdefault(p.family or "all", {})[path] = round(v, 6 if v > 1e-3 else 9)
        else:
            stacks.setdefault(p.stack or "all", {})[path] = round(v, 6 if v > 1e-3 else 9)
    return FittedParameters(
        method=FIT_METHOD, sources=result.fitted_on, kernels=kernels, stacks=stacks,
        rms_log_residual=round(result.rms_log_residual, 6),
        residuals={k: round(v, 6) for k, v in result.residuals.items()},
        held_out={s: {k: round(v, 6) for k, v in errs.items()} for s, errs in held.items()},
    ).model_dump()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the time parameters and recompute held-out errors")
    ap.add_argument("--write", action="store_true", help="with --fit: rewrite cost_models/data/calibration/fitted.yaml")
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write per-figure results as JSON")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    runs, skipped = published_runs()
    time_runs = [r for r in runs if r.kind in TIME_KINDS]
    params = published_fit_parameters()
    held_out: dict[str, float] = {}

    if args.fit:
        # The shipped values: only parameters that figures of two or more sources constrain are fitted.
        result = fit(time_runs, params, min_sources=SHIPPED_MIN_SOURCES)
        print(f"fit on {len(time_runs)} figures from {len(result.fitted_on)} sources: rms log residual "
              f"{result.rms_log_residual:.3f} ({result.message})")
        for name, value in result.as_dict().items():
            print(f"  {name:<50} {value:.4g}")
        held = {}
        for h in leave_one_source_out(time_runs, params, progress=lambda s: print(f"  refit without {s} ...")):
            test = [r for r in time_runs if r.source == h.source]
            held[h.source] = dict(zip((r.id for r in test), errors_of(test, [h.predictions[r.id] for r in test])))
            held_out.update(h.predictions)
        values = result.values
        fitted_params = result.params

        def predict_time(run: MeasuredRun) -> float:
            return predict(run, profile_for(run, fitted_params, values))

        if args.write:
            from cost_models.fitted import fitted_path

            path = pathlib.Path(str(fitted_path()))
            header = ("# Generated by `python benchmarks/accuracy.py --fit --write` from published.yaml; do not edit.\n"
                      "# Kernel/stack priors live in cost_models/data/kernels and cost_models/data/stacks.\n")
            path.write_text(header + yaml.safe_dump(fitted_file_content(result, held), sort_keys=False, width=120))
            clear_cache()
            print(f"wrote {path}")
    else:
        def predict_time(run: MeasuredRun) -> float:
            return predict(run, profile_for(run))

    def shipped(run: MeasuredRun) -> float:
        return predict_time(run) if run.kind in TIME_KINDS else predict(run, profile_for(run))

    # Memory: one constant is fitted, the allocator slack (the GPU stacks' files ship the fit's value).
    # Refit it here and hold each source's memory and max-length figures out of their own fit.
    memory_runs = [r for r in runs if r.kind == "memory" and r.confidence == "exact"]
    slack = [Parameter(target="memory.allocator_slack_fraction", prior=0.0, lower=0.0, upper=1.0, sigma=10.0,
                       space="linear")]
    slack_fit = fit(memory_runs, slack)
    print(f"memory: allocator_slack_fraction fitted on {len(memory_runs)} exact memory figures "
          f"({', '.join(slack_fit.fitted_on)}): {slack_fit.values[0]:.3f} (stacks ship "
          f"{sorted({profile_for(r).memory.allocator_slack_fraction for r in memory_runs})})")
    memory_sources = sorted({r.source for r in memory_runs})
    for source in memory_sources:
        fold = fit([r for r in memory_runs if r.source != source], slack)
        print(f"  without {source}: {fold.values[0]:.3f}")
        for r in runs:
            if r.source == source and r.kind in ("memory", "max_length"):
                held_out[r.id] = predict(r, profile_for(r, fold.params, fold.values))
    for r in runs:  # figures of sources no memory constant was fitted on are out of sample as they are
        if r.kind in ("memory", "max_length") and r.source not in memory_sources:
            held_out[r.id] = shipped(r)

    results = evaluate(runs, shipped, held_out or None)
    if not args.fit:  # (the time figures' held-out values come from the shipped file)
        # The shipped file stores each held-out error (group-normalised for scale-free tables); a value
        # scaled by it orders a table exactly as the held-out prediction did.
        flat = {k: v for errs in fitted_parameters().held_out.values() for k, v in errs.items()}
        for r in results:
            if r.run.id in flat and r.run.kind in TIME_KINDS:
                r.held_out_error = flat[r.run.id]
                r.held_out = r.run.value * (1 + flat[r.run.id])
    for r in results:
        if r.run.stack != COMPARE_STACK:
            alt = r.run.model_copy(update={"stack": COMPARE_STACK, "memory_overrides": {}})
            r.other_stack[COMPARE_STACK] = predict(alt, profile_for(alt))

    print()
    print("\n".join(render(results, other_stack=COMPARE_STACK)))
    print()
    for s in skipped:
        print(f"skipped: {s.id}: {s.reason}")
    print("assumptions per source:")
    for source in sorted({r.source for r in runs}):
        note = next(r.assumed for r in runs if r.source == source)
        print(f"  {source}: {note}")
    print(f"({time.perf_counter() - started:.1f} s)")

    if args.json:
        args.json.write_text(json.dumps({
            "figures": [{"id": r.run.id, "kind": r.run.kind, "source": r.run.source, "confidence": r.run.confidence,
                         "stack": r.run.stack, "metric": r.run.metric, "measured": r.run.value,
                         "predicted": r.predicted, "error": r.error, "held_out_error": r.held_out_error,
                         "other_stack": r.other_stack} for r in results],
            "summary": [s.__dict__ for s in summarise(results)],
            "tables": [t.__dict__ for t in table_orders(results)],
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
