"""``sp-plan calibrate``: fit efficiencies and overheads to your own measured runs, write a calibration file.

Inputs are ``sp-plan validate --json`` reports (one run each, configuration included) and/or CSV files
(one run per row: configuration columns plus measured ``step_s`` / ``tps_per_gpu`` / memory columns; see
:mod:`sp_plan.planner.fitting.user_runs`). The fit (:mod:`sp_plan.planner.fitting.user_fit`) moves the GPU's
asymptotic GEMM/attention/HBM efficiencies, per-kernel and per-ring-step fixed costs and the stack's
overheads from their current values toward the measurements; the file it writes is what
``estimate``/``plan``/``capacity`` take with ``--calibration FILE``. Give ``--check`` runs to see the
calibration predict runs it was not fitted on; without them and with three or more files, each file is
predicted by a fit on the others.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import click
import yaml

from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.atomic_io import write_output
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.text_table import Column, format_table

#: A measurement this many times above or below the uncalibrated prediction is refused: calibrations move
#: predictions by a few times at most (the worst published miss is about 7x), while a wrong unit (ms typed as s)
#: or a wrong configuration column is 1000x; a fit to it pins every efficiency at its bound and still misses.
MAX_MEASURED_TO_PREDICTED = 100.0

#: The report's two tables: every run before and after the fit, then the error by metric.
RUN_COLUMNS = (Column("run"), Column("measured", ">"), Column("before", ">"), Column("after", ">"))
ERROR_COLUMNS = (Column("error"), Column("runs", ">"), Column("before", ">"), Column("after", ">"),
                 Column("tau before", ">"), Column("tau after", ">"))


def _refuse_implausible(runs: list, predictions: dict[str, tuple[float, float]]) -> None:
    """Refuse, before anything is written, a measured value no calibration can explain (see
    :data:`MAX_MEASURED_TO_PREDICTED`), naming the run and what to check."""
    for run in runs:
        before = predictions[run.id][0]
        ratio = max(run.value / before, before / run.value) if before > 0 and run.value > 0 else float("inf")
        if ratio > MAX_MEASURED_TO_PREDICTED:
            raise CostModelError(
                f"{run.id}: measured {run.value:.4g} is {ratio:,.0f}x off the uncalibrated prediction {before:.4g}, "
                "more than any calibration moves a real run; check the value's unit (step_s: seconds per step, "
                "tps_per_gpu: tokens/s per GPU, *_gib: GiB) and the run's configuration columns")


@click.command("calibrate")
@click.argument("runs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--check", "check", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Runs to predict but not fit on (repeatable): the honest test of the calibration.")
@click.option("--stack", default="sp-plan", show_default=True,
              help="Stack the runs used when a file does not say (validate reports record it).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), default=Path("calibration.yaml"),
              show_default=True, help="Calibration YAML to write (use it with --calibration FILE); - for standard output.")
@click.option("--json", "as_json", is_flag=True, help="Print the before/after errors as JSON.")
def command(runs: tuple[Path, ...], check: tuple[Path, ...], stack: str, out_file: Path, as_json: bool) -> None:
    """Fit a calibration to measured runs (validate --json reports or CSV) and print before/after errors."""
    from sp_plan.planner.fitting.user_fit import calibrate
    from sp_plan.planner.fitting.user_runs import load_runs
    from sp_plan.planner.fitting.fit import run_gpu

    from .common import check_output_path

    check_output_path(out_file, "--out")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        # realpath, not Path.resolve(): a symlink loop raised RuntimeError there; reading it below is an OSError
        # (too many levels of symbolic links) that names the file
        both = {os.path.realpath(p) for p in runs} & {os.path.realpath(p) for p in check}
        if both:
            raise CostModelError(f"--check {sorted(both)[0]} is also among the runs fitted on, so its 'held out' "
                                 "errors would not be held out; give the fitted and the checked runs in separate files")
        fit_runs = load_runs(list(runs), cache, stack)
        check_runs = load_runs(list(check), cache, stack)
        if not fit_runs:
            raise CostModelError("no measured runs to fit")
        gpus = {run_gpu(r) for r in fit_runs + check_runs}
        stacks = {r.stack for r in fit_runs + check_runs}
        if len(gpus) > 1 or len(stacks) > 1:
            raise CostModelError(f"calibrate one GPU type and stack at a time; these runs use GPUs {sorted(gpus)} "
                                 f"and stacks {sorted(stacks)}")
        result = calibrate(fit_runs, check_runs)
        _refuse_implausible(fit_runs + check_runs, result.predictions)
        sampled = len(result.fitted_runs)
        sample_note = "" if sampled == len(fit_runs) else f" (an evenly spread sample of {len(fit_runs)})"
        description = (f"fitted by `sp-plan calibrate` on {sampled} measurement(s){sample_note} from "
                       f"{len({r.source for r in fit_runs})} file(s)")
        cal = result.to_file(description)
    to_stdout = str(out_file) == "-"
    write_output(out_file, yaml.safe_dump(cal.model_dump(mode="json"), sort_keys=False, width=120))
    # With --out -, standard output is the calibration file: the report goes to standard error.
    say = functools.partial(click.echo, err=to_stdout)
    if as_json:
        say(strict_dumps({"calibration": str(out_file), "errors": [e.model_dump() for e in cal.errors],
                        "parameters": result.fit.as_dict(),
                        "kept_at_prior": {k: round(v, 4) for k, v in result.frozen.items()}}, indent=2))
        return
    say(f"fitted {len(result.fit.params)} parameter(s) on {sampled} measurement(s){sample_note}; "
        f"wrote {out_file}")
    considered = len(result.fit.params) + len(result.frozen)
    if sampled < considered:
        say(f"note: {sampled} measurement(s) cannot tell {considered} parameters apart: those the runs do "
            "not constrain keep their documented values; measure layouts that differ in sequence length and parallel "
            "degrees, and hold some out with --check")
    for name, value in result.fit.as_dict().items():
        say(f"  {name:<48} {value:.4g}")
    if result.frozen:
        say("kept at their documented values (these runs cannot pin them: largest share of a fitted run's figure, "
            "d ln predicted / d ln parameter): " + ", ".join(f"{k} {v:.2f}" for k, v in result.frozen.items()))
    checked, sampled_ids = {id(r) for r in check_runs}, {id(r) for r in result.fitted_runs}
    runs = []
    for r in fit_runs + check_runs:
        before, after = result.predictions[r.id]
        tag = (" (held out)" if id(r) in checked else "" if id(r) in sampled_ids else " (not in fit sample)")
        runs.append([r.id + tag, f"{r.value:.4g}", f"{before:.4g}", f"{after:.4g}"])
    say("\n".join(format_table(RUN_COLUMNS, runs)))
    errors = []
    for e in cal.errors:
        tb = "-" if e.before_kendall_tau is None else f"{e.before_kendall_tau:.2f}"
        ta = "-" if e.after_kendall_tau is None else f"{e.after_kendall_tau:.2f}"
        errors.append([e.metric, str(e.runs), f"{e.before_mean_abs_pct:.1f}%", f"{e.after_mean_abs_pct:.1f}%", tb, ta])
    say("\n".join(format_table(ERROR_COLUMNS, errors)))
    say(f"use it: sp-plan plan ... --calibration {out_file}")
