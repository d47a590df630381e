"""`sp-plan calibrate` speed: wall seconds for 30, 100, 300 and 1,000 measured runs.

Target (issue 16): 1,000 runs in under a minute on a 2-core machine. Each row is a fresh
`sp-plan calibrate RUNS.csv` process (start-up, CSV parsing, the fit, before/after predictions and the
calibration file all included), on synthetic step times for Llama-3-8B on one DGX H100 node: every row
a distinct configuration (8 layouts x sequence lengths x micro-batches), step times drawn from the cost
model with a known calibration plus 5% noise (fixed seed), so the fit has something real to recover.
The ratio columns are each time over the 30-run time measured in the same run (linear scaling gives
runs / 30); CPU seconds are printed beside wall seconds because a shared machine stretches wall time.

    python benchmarks/calibrate_speed.py [--quick] [--runs 30,100,300,1000]
"""

from __future__ import annotations

import argparse
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sp_plan.planner.fitting.user_runs import write_runs_csv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [dict(ulysses=8), dict(ring=8), dict(tp=2, ulysses=4), dict(ring=4, ulysses=2), dict(dp_shard=8),
           dict(tp=8), dict(ring=2, ulysses=4), dict(tp=4, ring=2)]
#: The calibration the synthetic runs are drawn from (what a good fit recovers).
TRUTH = {"gemm.peak_fraction": 0.45, "attention.fa2.forward_fraction": 0.5, "attention.fa2.backward_fraction": 0.4}
TARGET_S = 60.0


def configurations(n: int) -> list[dict]:
    """``n`` distinct configurations: layouts x sequence lengths (8K steps) x micro-batches 1-2."""
    out = []
    for k in range(1, 10_000):
        for micro in (1, 2):
            for lay in LAYOUTS:
                out.append({"seq_len": 8192 * k, "micro_batch": micro, **lay})
                if len(out) == n:
                    return out
    raise ValueError(f"cannot make {n} distinct configurations")


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows whose step times the cost model predicts under :data:`TRUTH`, times 5% log-normal noise."""
    sys.path.insert(0, str(ROOT))
    from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
    from sp_plan.planner.fitting.fit import Parameter, predict_all
    from sp_plan.planner.fitting.runs import MeasuredRun

    rng = random.Random(seed)
    model = get_model_preset("llama3-8b")
    params = [Parameter(target=f"kernels.{k}", prior=1.0, lower=1e-9, upper=1e9, sigma=1.0) for k in TRUTH]
    runs, rows = [], []
    for cfg in configurations(n):
        degrees = {k: v for k, v in cfg.items() if k not in ("seq_len", "micro_batch")}
        train = TrainSpec(seq_len=cfg["seq_len"], micro_batch=cfg["micro_batch"], checkpointing="full")
        runs.append(MeasuredRun(id="x", source="s", metric="step_s", value=1.0, model=model, train=train,
                                layout=Layout.for_world(8, **degrees), topology="dgx-h100", stack="sp-plan"))
        rows.append({"model": "llama3-8b", "gpus": 8, "topology": "dgx-h100", "checkpointing": "full", **cfg})
    for row, step in zip(rows, predict_all(runs, params, list(TRUTH.values()))):
        row["step_s"] = f"{step * rng.lognormvariate(0.0, 0.05):.6g}"
    return rows


def time_calibrate(csv_path: Path, out: Path) -> tuple[float, float, str]:
    """Wall and CPU seconds of one `sp-plan calibrate` process, and its summary line (the fitted-on error
    row). CPU time (user + system of the child) is what the command costs; wall time is what a user waits
    and depends on what else the machine runs (a shared CI box), so both are printed."""
    cmd = [sys.executable, "-m", "sp_plan.cli", "calibrate", str(csv_path), "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"calibrate failed on {csv_path}:\n{done.stderr[-2000:]}")
    summary = next((ln for ln in done.stdout.splitlines() if ln.startswith("step_s (fitted on)")), "")
    return seconds, cpu, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="30,100,300,1000", help="comma-separated run counts (30 is the baseline)")
    parser.add_argument("--quick", action="store_true", help="30 and 100 runs only")
    args = parser.parse_args()
    counts = [30, 100] if args.quick else sorted({int(v) for v in args.runs.split(",")} | {30})
    print(f"{'runs':>6} {'wall s':>8} {'cpu s':>7} {'x 30 (wall)':>12} {'x 30 (cpu)':>11} {'linear':>7}  "
          "fit on the fitted runs (mean abs error before -> after)")
    base = base_cpu = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            path = Path(tmp) / f"runs{n}.csv"
            write_runs_csv(path, synthetic_rows(n))
            seconds, cpu, summary = time_calibrate(path, Path(tmp) / f"cal{n}.yaml")
            if n == 30:
                base, base_cpu = seconds, cpu
            fit = " -> ".join(summary.split()[4:6]) if summary else "?"
            print(f"{n:>6} {seconds:>8.1f} {cpu:>7.1f} {seconds / base:>12.2f} {cpu / base_cpu:>11.2f} {n / 30:>7.1f}  "
                  f"{fit}", flush=True)
            if n == 1000:
                verdict = "meets" if seconds < TARGET_S else "MISSES"
                print(f"1,000 runs: {seconds:.1f} s wall ({cpu:.1f} s CPU), {verdict} the {TARGET_S:.0f} s target")


if __name__ == "__main__":
    main()
