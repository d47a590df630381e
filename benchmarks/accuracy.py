"""How well sp-plan's predictions agree with published GPU measurements, layer by layer.

1. Kernel truth: every kernel-level figure of ``cost_models/data/calibration/kernels.yaml`` (attention
   kernels by sequence length, head_dim, causality and pass; GEMMs by shape) pins the kernel model
   (:mod:`sp_plan.planner.fitting.kernel_fit`); each figure is reported in sample and held out by kernel
   source.
2. System level: every entry of ``cost_models/data/calibration/published.yaml`` (memory, max length,
   throughput, attention benchmarks and per-layer timings, with each source's metric semantics) becomes
   a measured run (:mod:`sp_plan.planner.fitting.published`), predicted under its source's software stack
   and, for comparison, under sp-plan's default stack. Throughput, attention-benchmark and per-layer
   figures fit only what they alone can tell (stack overheads, GPU-variant clock factors), on top of the
   pinned kernels. Their "held-out" column is the prediction of a fit that never saw the figure's
   source; the harder splits leave out a whole GPU variant or a whole stack. Memory has one fitted
   constant (the allocator slack the GPU stacks ship): each source's memory and max-length figures are
   held out of its fit the same way.

    python benchmarks/accuracy.py                 # report with the shipped (fitted) parameters
    python benchmarks/accuracy.py --fit           # refit both layers and recompute the held-out errors (~2 min)
    python benchmarks/accuracy.py --fit --write   # ... and rewrite cost_models/data/calibration/fitted.yaml
    python benchmarks/accuracy.py --write-residuals  # rewrite residuals.yaml (the CLI's error bands) only
    python benchmarks/accuracy.py --json out.json # machine-readable results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from dataclasses import asdict
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from sp_plan.cost_models.atomic_io import atomic_write_text  # noqa: E402
from sp_plan.cost_models.fitted import FittedParameters, KernelFitRecord, fitted_parameters  # noqa: E402
from sp_plan.cost_models.profile import clear_caches, use_fitted  # noqa: E402
from sp_plan.planner.fitting.accuracy import COMPARE_STACK, published_accuracy  # noqa: E402
from sp_plan.planner.fitting.fit import (  # noqa: E402
    SPLITS,
    FitResult,
    fit,
    leave_one_group_out,
)
from sp_plan.planner.fitting.kernel_fit import METHOD as KERNEL_METHOD  # noqa: E402
from sp_plan.planner.fitting.kernel_fit import (  # noqa: E402
    KernelFitResult,
    fit_kernels,
    kernel_figures,
    leave_one_kernel_source_out,
)
from sp_plan.planner.fitting.misses import explain, find_misses, render_misses  # noqa: E402
from sp_plan.planner.fitting.parameters import SHIPPED_MIN_SOURCES, TIME_KINDS, published_fit_parameters  # noqa: E402
from sp_plan.planner.fitting.published import published_runs  # noqa: E402
from sp_plan.planner.fitting.report import (  # noqa: E402
    errors_of,
    render,
    render_kernels,
    render_splits,
    summarise,
    table_orders,
)
from sp_plan.planner.fitting.runs import MeasuredRun  # noqa: E402

FIT_METHOD = ("system level: scipy.optimize.least_squares (trf, soft-L1) on confidence-weighted log(predicted/"
              "measured), each source weighted equally, Gaussian priors around the stack and GPU files' "
              "values; stack overheads and GPU-variant clock factors only, on top of the kernel-pinned model")


def _round(v: float) -> float:
    return round(v, 6 if abs(v) > 1e-3 else 9)


def kernel_section(result: KernelFitResult, held: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The ``kernels:`` and ``kernel_fit:`` content of fitted.yaml from the kernel-level fit."""
    kernels = {family: {k: _round(v) for k, v in values.items()} for family, values in result.by_family().items()}
    record = KernelFitRecord(method=KERNEL_METHOD, sources=result.sources,
                             rms_log_residual=round(result.rms_log_residual, 6),
                             residuals={k: round(v, 6) for k, v in result.residuals.items()},
                             held_out={s: {k: round(v, 6) for k, v in e.items()} for s, e in held.items()})
    return {"kernels": kernels, "kernel_fit": record}


def fitted_file_content(kernel: dict[str, Any], result: FitResult, held: dict[str, dict[str, float]],
                        splits: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    variants: dict[str, dict[str, float]] = {}
    stacks: dict[str, dict[str, float]] = {}
    for p, v in zip(result.params, result.values):
        section, _, path = p.target.partition(".")
        if section == "kernels":
            if p.gpu is None:
                raise ValueError(f"the system-level fit may not set kernel parameter {p.name}")
            variants.setdefault(p.gpu, {})[path] = _round(v)
        else:
            stacks.setdefault(p.stack or "all", {})[path] = _round(v)

    def rounded(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        return {s: {k: round(v, 6) for k, v in errs.items()} for s, errs in table.items()}

    return FittedParameters(
        method=FIT_METHOD, sources=result.fitted_on, **kernel, variants=variants, stacks=stacks,
        rms_log_residual=round(result.rms_log_residual, 6),
        residuals={k: round(v, 6) for k, v in result.residuals.items()},
        held_out=rounded(held), held_out_splits={split: rounded(t) for split, t in splits.items()},
    ).model_dump()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the time parameters and recompute held-out errors")
    ap.add_argument("--write", action="store_true", help="with --fit: rewrite cost_models/data/calibration/fitted.yaml")
    ap.add_argument("--write-residuals", action="store_true",
                    help="rewrite cost_models/data/calibration/residuals.yaml (the CLI's error bands) from the held-out "
                         "errors (implied by --fit --write)")
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write per-figure results as JSON")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    runs, skipped = published_runs()
    time_runs = [r for r in runs if r.kind in TIME_KINDS]
    params = published_fit_parameters()
    held_out: dict[str, float] = {}

    figures = kernel_figures()
    splits: dict[str, dict[str, dict[str, float]]] = {}
    if args.fit:
        # Layer 1, kernel truth: kernel-level figures only.
        kfit = fit_kernels(figures)
        kheld = leave_one_kernel_source_out(figures)
        print(f"kernel fit on {len(figures)} kernel-level figures from {len(kfit.sources)} sources: rms log "
              f"residual {kfit.rms_log_residual:.3f} ({kfit.message})")
        for p, v in zip(kfit.params, kfit.values):
            print(f"  {p.name:<50} {p.prior:>10.4g} -> {v:.4g}")
        kernel = kernel_section(kfit, kheld)
        # Layer 2, system level, on top of the pinned kernels: only parameters that figures of two or more
        # sources constrain are shipped.
        with use_fitted(FittedParameters(**kernel)):
            result = fit(time_runs, params, min_sources=SHIPPED_MIN_SOURCES)
            print(f"system fit on {len(time_runs)} figures from {len(result.fitted_on)} sources: rms log residual "
                  f"{result.rms_log_residual:.3f} ({result.message})")
            for name, value in result.as_dict().items():
                print(f"  {name:<50} {value:.4g}")
            held: dict[str, dict[str, float]] = {}
            for split, key in SPLITS.items():
                table: dict[str, dict[str, float]] = {}
                for h in leave_one_group_out(time_runs, params, key,
                                             progress=lambda g, s=split: print(f"  refit without {s} {g} ...")):
                    test = [r for r in time_runs if key(r) == h.source]
                    table[h.source] = dict(zip((r.id for r in test),
                                               errors_of(test, [h.predictions[r.id] for r in test])))
                    if split == "source":
                        held_out.update(h.predictions)
                if split == "source":
                    held = table
                else:
                    splits[split] = table
        content = fitted_file_content(kernel, result, held, splits)
        new = FittedParameters(**content)
        if args.write:
            from sp_plan.cost_models.fitted import fitted_path

            path = pathlib.Path(str(fitted_path()))
            header = ("# Generated by `python benchmarks/accuracy.py --fit --write` from kernels.yaml (kernels:) and\n"
                      "# published.yaml (variants:, stacks:); do not edit. Priors live in cost_models/data/kernels,\n"
                      "# cost_models/data/gpus and cost_models/data/stacks.\n")
            atomic_write_text(path, header + yaml.safe_dump(content, sort_keys=False, width=120))
            clear_caches()
            print(f"wrote {path}")
        context = use_fitted(new)
    else:
        new = fitted_parameters()
        splits = dict(new.held_out_splits)
        context = use_fitted(new)

    with context:
        _report(args, runs, skipped, figures, held_out, new, splits, started)
    return 0


def _report(args: argparse.Namespace, runs: list[MeasuredRun], skipped: list, figures: list,
            held_out: dict[str, float], shipped_fit: FittedParameters,
            splits: dict[str, dict[str, dict[str, float]]], started: float) -> None:
    """Predict every figure with ``shipped_fit`` in effect and print the layered report."""
    accuracy = published_accuracy(runs, shipped_fit, held_out if args.fit else None, splits)
    results, splits = accuracy.results, accuracy.splits
    print("\n".join(accuracy.memory_lines))
    print()
    if args.write or args.write_residuals:
        from sp_plan.planner.fitting.bands import residual_file, residual_yaml
        from sp_plan.planner.uncertainty import RESIDUALS_PATH

        atomic_write_text(RESIDUALS_PATH, residual_yaml(residual_file(results, splits)))
        print(f"wrote {RESIDUALS_PATH}")
    from sp_plan.planner.fitting.bands import render_bands, residual_records
    from sp_plan.planner.fitting.calibrated_cells import calibrated_cells

    print("\n".join(render_bands(residual_records(results, splits))))
    print()
    print("\n".join(calibrated_cells(runs)))
    print()
    print("\n".join(render_kernels(figures, shipped_fit.kernel_fit)))
    print()
    print("\n".join(render(results, other_stack=COMPARE_STACK)))
    print()
    print("\n".join(render_splits(results, splits)))
    print()
    misses = explain(find_misses(results, splits))
    print("\n".join(render_misses(misses)))
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
            "held_out_splits": splits,
            "misses": [{**asdict(m), "cause": c.name if c else None, "established": bool(c and c.established)}
                       for m, c in [*misses.explained, *((m, None) for m in misses.unexplained)]],
            "kernel_fit": shipped_fit.kernel_fit.model_dump(),
        }, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
