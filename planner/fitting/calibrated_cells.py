"""What calibrating on a few runs does to the held-out error, per published cell (``benchmarks/accuracy.py``).

Kept apart from :mod:`.bands` (which :mod:`.user_fit` imports for the residuals it stores): this runs the user fit.
"""

from __future__ import annotations

from collections.abc import Sequence

from .fit import run_gpu
from .report import errors_of
from .runs import MeasuredRun
from .user_fit import calibrate


def calibrated_cells(runs: Sequence[MeasuredRun], every: int = 3, fit_runs: int = 3) -> list[str]:
    """What calibrating on a few runs does, per published (stack, GPU, metric) cell of five or more step-time
    figures: ``sp-plan calibrate`` on ``fit_runs`` of them (every ``every``-th, sorted by id, from each of
    ``every`` offsets) predicting the others, mean |error| before and after. The same fit a user's
    ``calibrate fit.csv --check check.csv`` runs, on published rows instead of their own."""
    cells: dict[tuple[str, str, str], list[MeasuredRun]] = {}
    for r in runs:
        # Chart readings ("figure") weigh nothing in a fit (CONFIDENCE_WEIGHT): only exact figures calibrate.
        if r.kind == "throughput" and r.confidence in ("exact", "measured") and not r.scale_free:
            cells.setdefault((r.stack, run_gpu(r), r.metric), []).append(r)
    lines = [f"calibrated on {fit_runs} runs of a cell, the rest held out (mean |error| of the held-out runs):",
             f"  {'stack':<14} {'GPU':<10} {'metric':<15} {'runs':>4}  {'uncalibrated':>12}  {'calibrated':>10}"]
    for (stack, gpu, metric), cell in sorted(cells.items()):
        if len(cell) < 5:
            continue
        ordered = sorted(cell, key=lambda r: r.id)
        before, after = [], []
        for offset in range(every):
            fitted = ordered[offset::every][:fit_runs]
            check = [r for r in ordered if r not in fitted]
            result = calibrate(fitted, check)
            before += [abs(e) for e in errors_of(check, [result.predictions[r.id][0] for r in check])]
            after += [abs(e) for e in errors_of(check, [result.predictions[r.id][1] for r in check])]
        lines.append(f"  {stack:<14} {gpu:<10} {metric:<15} {len(cell):>4}  {sum(before) / len(before):>11.1%}  "
                     f"{sum(after) / len(after):>9.1%}")
    return lines


__all__ = ["calibrated_cells"]
