"""Planner speed: full plan time at 8, 64, 512 and 4096 GPUs, and `sp-plan --help` startup.

Targets (issue 4): a full plan for 8 GPUs under 0.1 s, for 4096 GPUs under 2 s, `--help` under 0.5 s
without importing torch. Baseline, measured in the same run: a brute-force planner that evaluates
every (layout, option combination) — timed directly where that finishes in reasonable time, otherwise
extrapolated from its measured cost per evaluation and the exact number of combinations (marked est.).

Each plan is timed cold in a fresh process (imports done, caches empty: what a CLI user waits for
after start-up) and warm (best of 3 repeats in that process).

    python benchmarks/planner_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = [
    # (gpus, model, seq_len, mode, target seconds)
    (8, "llama3-70b", 1_000_000, "prefill", 0.1),
    (8, "llama3-8b", 128 * 1024, "train", 0.1),
    (64, "llama3-70b", 1 << 20, "train", None),
    (512, "llama3-70b", 1 << 20, "train", None),
    (4096, "llama3-70b", 1 << 20, "train", 2.0),
    (4096, "llama3-405b", 1 << 20, "train", 2.0),
]
#: Brute force is run for real only up to this many combinations; beyond, it is extrapolated.
BRUTE_FORCE_LIMIT = 4000


def worker(gpus: int, model_name: str, seq: int, mode: str) -> dict:
    """Runs inside a fresh interpreter: cold plan, warm plans, brute-force baseline."""
    sys.path.insert(0, str(ROOT))
    from cost_models import TrainSpec, get_model_preset
    from cost_models.topology import default_topology
    from planner.options import invalid_reason
    from planner.search import PlanSettings, _Searcher, brute_force_best, search
    from planner.space import enumerate_layouts

    model = get_model_preset(model_name)
    train = TrainSpec(seq_len=seq, mode=mode)
    started = time.perf_counter()
    topology = default_topology("h100-80gb", gpus, 8)
    result = search(model, train, topology, PlanSettings())
    cold = time.perf_counter() - started
    warm = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        search(model, train, topology, PlanSettings())
        warm = min(warm, time.perf_counter() - t0)
    # Brute-force baseline: count the valid combinations, run it when affordable.
    s = _Searcher(model, train, topology, PlanSettings(), None)
    space = enumerate_layouts(gpus, model, seq, topology.gpus_per_node)
    combos = 0
    for layout in space.layouts:
        lattice = s.lattice(layout)
        import itertools

        combos += sum(1 for c in itertools.product(*(range(len(a.values)) for a in lattice.axes))
                      if not invalid_reason(lattice.values(c)))
    if combos <= BRUTE_FORCE_LIMIT:
        t0 = time.perf_counter()
        brute_score, *_ = brute_force_best(model, train, topology)
        brute = time.perf_counter() - t0
        brute_kind = "measured"
        same = result.plans and math.isclose(brute_score, result.plans[0].score, rel_tol=1e-12)
    else:
        # Cost per evaluation measured on a sample of this very workload.
        sample = space.layouts[: max(1, len(space.layouts) // 50)]
        t0 = time.perf_counter()
        n = 0
        for layout in sample:
            lattice = s.lattice(layout)
            for c in itertools.islice(itertools.product(*(range(len(a.values)) for a in lattice.axes)), 40):
                if s.timed(layout, c, lattice) is not None:
                    n += 1
        per_eval = (time.perf_counter() - t0) / max(n, 1)
        brute = per_eval * combos
        brute_kind = "est."
        same = None
    best = result.plans[0] if result.plans else None
    return {
        "gpus": gpus, "model": model_name, "seq": seq, "mode": mode, "layouts": result.stats.layouts,
        "evaluations": result.stats.time_evaluations, "memory_evaluations": result.stats.memory_evaluations,
        "cold_s": cold, "warm_s": warm, "combinations": combos, "brute_s": brute, "brute_kind": brute_kind,
        "same_optimum": same, "best": best.layout.describe() if best else "none fits",
    }


def help_startup() -> tuple[float, bool]:
    """Best of 5 wall times of `python -m planner.cli --help`, and whether torch got imported."""
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "planner.cli", "--help"], cwd=ROOT, check=True,
                       capture_output=True)
        best = min(best, time.perf_counter() - t0)
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from planner.cli import cli; from click.testing import CliRunner; "
                               "CliRunner().invoke(cli, ['--help']); print('torch' in sys.modules)"],
        cwd=ROOT, check=True, capture_output=True, text=True)
    return best, probe.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 GPUs only")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        gpus, model, seq, mode = args.worker
        print(json.dumps(worker(int(gpus), model, int(seq), mode)))
        return
    rows = []
    for gpus, model, seq, mode, target in WORKLOADS:
        if args.quick and gpus > 64:
            continue
        out = subprocess.run([sys.executable, __file__, "--worker", str(gpus), model, str(seq), mode],
                             cwd=ROOT, check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["target"] = target
        rows.append(row)
    print(f"{'GPUs':>5} {'workload':<28} {'layouts':>7} {'evals':>7} {'cold s':>8} {'warm s':>8} {'target':>7} "
          f"{'cold/target':>11} {'brute-force s':>15} {'speed-up':>9} {'optimum':>8}  best layout")
    for r in rows:
        work = f"{r['model']} {r['mode']} {r['seq']:,}"
        target = f"{r['target']:.1f}" if r["target"] else "-"
        ratio = f"{r['cold_s'] / r['target']:.2f}" if r["target"] else "-"
        brute = f"{r['brute_s']:.2f} {r['brute_kind']}"
        same = {True: "same", False: "DIFFERS", None: "-"}[r["same_optimum"]]
        print(f"{r['gpus']:>5} {work:<28} {r['layouts']:>7} {r['evaluations']:>7} {r['cold_s']:>8.3f} "
              f"{r['warm_s']:>8.3f} {target:>7} {ratio:>11} {brute:>15} {r['brute_s'] / r['cold_s']:>8.1f}x "
              f"{same:>8}  {r['best']}")
    startup, torch_loaded = help_startup()
    print(f"\n`sp-plan --help`: {startup:.3f} s (target 0.5 s, ratio {startup / 0.5:.2f}); "
          f"torch imported: {torch_loaded}")


if __name__ == "__main__":
    main()
