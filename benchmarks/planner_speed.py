"""Planner speed: full plan time at 8, 64, 512, 4096 and 16,384 GPUs, and `sp-plan --help` startup.

Targets (issue 4): a full plan for 8 GPUs under 0.1 s, for 4096 GPUs under 2 s, `--help` under 0.5 s
without importing torch. Issue 34 adds: llama3-405b 128K on 16,384 GPUs under 1 s, qwen3-30b-a3b 32K on 64 GPUs
under 0.5 s, deepseek-v3 32K on 256 GPUs under 2 s, and two whole commands (:data:`COMMANDS`, cold, through the
CLI): the advice of a plan that does not fit (deepseek-v3 4K on 8 GPUs) under 3 s and ``capacity --seq-len`` for
deepseek-v3 32K under 5 s. Baseline, measured in the same run: a brute-force planner that evaluates
every (layout, option combination) — timed directly where that finishes in reasonable time, otherwise
extrapolated from its measured cost per combination on a sample of the workload's layouts and the exact
number of combinations (marked est.). It runs in a fresh process of its own, so it inherits no cache
the search warmed; "optimum" says whether both found the same best score (measured rows only).

Each plan is timed cold in a fresh process (imports done, caches empty: what a CLI user waits for
after start-up) and warm (best of 3 repeats in that process); ``--repeat N`` takes the minimum of each over
N fresh processes (on a shared machine the minimum is the figure least disturbed by other load), or with
``--statistic median`` their median. Beside the wall times, the process's CPU seconds
(``time.process_time``): on a machine other jobs share, they move far less with its load than the wall time.
The evaluation counts (time, memory and compute-only floor evaluations) do not depend on load at all.

``--against REV`` also plans every workload with the planner of git revision REV (its sources laid out
as the ``sp_plan`` package in a temporary directory), interleaved with this tree's runs, and prints
before/after times and counts from the same run: how a change to the search is measured.

    python benchmarks/planner_speed.py [--quick] [--repeat N] [--statistic min|median] [--against REV]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
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
    # Llama 3 405B's own scale (TP8 x CP16 x PP16 x DP8 on 16,384 H100s at 128K): the pipeline degree and its
    # schedules multiply the layouts; the plan must stay interactive.
    (16384, "llama3-405b", 128 * 1024, "train", 1.0),
    # Mixture-of-experts: every expert-parallel degree is a layout of its own (issue 20); targets of issue 34.
    (64, "qwen3-30b-a3b", 32 * 1024, "train", 0.5),
    (256, "deepseek-v3", 32 * 1024, "train", 2.0),
]
#: Whole commands timed as a user runs them (issue 34): (name, sp-plan arguments, target seconds). The advice
#: a plan that does not fit gives (nearest miss, fewest GPUs, longest sequence) and a capacity question each
#: run many searches and feasibility probes, so they are timed end to end, cold, in a fresh process.
COMMANDS = [
    ("no-fit advice deepseek-v3 4K", ["plan", "--model", "deepseek-v3", "--gpus", "8", "--seq-len", "4K"], 3.0),
    ("capacity --seq-len deepseek-v3 32K", ["capacity", "--model", "deepseek-v3", "--seq-len", "32K"], 5.0),
]
#: Brute force is run for real only up to this many combinations; beyond, it is extrapolated.
BRUTE_FORCE_LIMIT = 4000


def _setup(gpus: int, model_name: str, seq: int, mode: str):
    if "PLANNER_SPEED_TREE" not in os.environ:  # a baseline tree comes on PYTHONPATH instead
        sys.path.insert(0, str(ROOT))
    from sp_plan.cost_models import TrainSpec, get_model_preset
    from sp_plan.cost_models.topology import default_topology

    return get_model_preset(model_name), TrainSpec(seq_len=seq, mode=mode), lambda: default_topology("h100-80gb", gpus, 8)


def search_worker(gpus: int, model_name: str, seq: int, mode: str) -> dict:
    """In a fresh interpreter: the cold plan (topology construction included), then warm repeats."""
    from sp_plan.planner.search import PlanSettings, search

    model, train, make_topology = _setup(gpus, model_name, seq, mode)
    started, cpu_started = time.perf_counter(), time.process_time()
    topology = make_topology()
    result = search(model, train, topology, PlanSettings())
    cold, cold_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    warm = warm_cpu = math.inf
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        search(model, train, topology, PlanSettings())
        warm, warm_cpu = min(warm, time.perf_counter() - t0), min(warm_cpu, time.process_time() - c0)
    best = result.plans[0] if result.plans else None
    return {
        "layouts": result.stats.layouts, "evaluations": result.stats.time_evaluations,
        "memory_evaluations": result.stats.memory_evaluations,
        "floor_evaluations": getattr(result.stats, "floor_evaluations", 0), "cold_s": cold, "warm_s": warm,
        "cold_cpu_s": cold_cpu, "warm_cpu_s": warm_cpu,
        "source": str(Path(sys.modules[search.__module__].__file__).resolve()),
        "score": best.score if best else None, "best": best.layout.describe() if best else "none fits",
    }


def command_worker(index: int) -> dict:
    """In a fresh interpreter: one of :data:`COMMANDS` through the CLI (imports done first, as for a plan), its
    cold wall and CPU seconds, and a digest of its output with the run-time figures masked (the before/after
    comparison's "same best")."""
    import hashlib
    import re

    if "PLANNER_SPEED_TREE" not in os.environ:
        sys.path.insert(0, str(ROOT))
    from click.testing import CliRunner

    from sp_plan.cli.main import cli
    from sp_plan.planner.search import search

    _, argv, _ = COMMANDS[index]
    started, cpu_started = time.perf_counter(), time.process_time()
    result = CliRunner().invoke(cli, argv)
    cold, cold_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    text = re.sub(r"in [0-9.]+ s$", "in X s", result.output, flags=re.M)
    return {"cold_s": cold, "cold_cpu_s": cold_cpu, "exit": result.exit_code,
            "digest": hashlib.sha256(text.encode()).hexdigest()[:12],
            "source": str(Path(sys.modules[search.__module__].__file__).resolve())}


def brute_worker(gpus: int, model_name: str, seq: int, mode: str) -> dict:
    """In another fresh interpreter (so it gets no cache the search warmed): every (layout, valid option
    combination) timed and memory-checked, run when affordable, otherwise extrapolated from the cold
    cost per combination on a spread sample of this workload's layouts."""
    from sp_plan.planner.options import invalid_reason
    from sp_plan.planner.search import PlanSettings, _Searcher, brute_force_best
    from sp_plan.planner.space import layout_space

    model, train, make_topology = _setup(gpus, model_name, seq, mode)
    started = time.perf_counter()
    topology = make_topology()
    s = _Searcher(model, train, topology, PlanSettings(), None)
    space = layout_space(gpus, model, train, topology.gpus_per_node)

    def valid_combos(layout):
        lattice = s.lattice(layout)
        return lattice, [c for c in itertools.product(*(range(len(a.values)) for a in lattice.axes))
                         if not invalid_reason(lattice.values(c))
                         and not s.pipeline_invalid(layout, lattice.values(c))]

    combos = sum(len(valid_combos(layout)[1]) for layout in space.layouts)
    if combos <= BRUTE_FORCE_LIMIT:
        started = time.perf_counter()
        topology = make_topology()
        score, *_ = brute_force_best(model, train, topology)
        return {"combinations": combos, "brute_s": time.perf_counter() - started, "brute_kind": "measured",
                "brute_score": score}
    sample = space.layouts[:: max(1, len(space.layouts) // 20)]
    t0 = time.perf_counter()
    n = 0
    for layout in sample:
        lattice, valid = valid_combos(layout)
        for c in valid:
            scored = s.timed(layout, c, lattice)
            s.fits(scored.report)  # brute force checks memory for every combination
            n += 1
    return {"combinations": combos, "brute_s": (time.perf_counter() - t0) / n * combos, "brute_kind": "est.",
            "brute_score": None}


def help_startup() -> tuple[float, bool]:
    """Best of 5 wall times of `python -m sp_plan.cli --help`, and whether torch got imported."""
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sp_plan.cli", "--help"], cwd=ROOT, check=True,
                       capture_output=True)
        best = min(best, time.perf_counter() - t0)
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from sp_plan.cli.main import cli; from click.testing import CliRunner; "
                               "CliRunner().invoke(cli, ['--help']); print('torch' in sys.modules)"],
        cwd=ROOT, check=True, capture_output=True, text=True)
    return best, probe.stdout.strip() == "True"


def baseline_tree(rev: str, tmp: Path) -> Path:
    """The sources of git revision ``rev`` laid out as an importable ``sp_plan`` package (the folder mapping
    of its pyproject.toml) under ``tmp``; returns the directory to put on PYTHONPATH."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp / "src", filter="data")
    mapping = tomllib.loads((tmp / "src" / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items()):
        target = tmp / "pkg" / package.replace(".", "/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if package == "sp_plan":
            target.mkdir(exist_ok=True)
            (target / "__init__.py").write_bytes((tmp / "src" / folder / "__init__.py").read_bytes())
        else:
            target.symlink_to(tmp / "src" / folder, target_is_directory=True)
    return tmp / "pkg"


def run_worker(kind: str, gpus: int, model: str, seq: int, mode: str, tree: Path | None = None) -> dict:
    """One worker in a fresh interpreter: this tree's code, or a baseline ``tree`` (run from inside it, so
    the repository's own ``sp_plan`` folder cannot shadow it). Kind ``command``: :data:`COMMANDS` entry
    ``gpus``."""
    env = {**os.environ, "PYTHONPATH": str(tree if tree else ROOT)}
    if tree:
        env["PLANNER_SPEED_TREE"] = str(tree)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(gpus), model,
                          str(seq), mode], cwd=tree or ROOT, check=True, capture_output=True, text=True, env=env)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    if kind in ("search", "command") and tree and not row["source"].startswith(str(tree.parent)):
        raise RuntimeError(f"the baseline run imported {row['source']}, not the tree under {tree}")
    return row


def fastest(runs: list[dict], statistic: str = "min") -> dict:
    """Several fresh-process runs of one workload: the minimum (or the median) of the cold and warm times
    (the counts agree)."""
    pick = min if statistic == "min" else statistics.median
    best = dict(runs[0])
    for key in ("cold_s", "warm_s", "cold_cpu_s", "warm_cpu_s"):
        best[key] = pick([r[key] for r in runs])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 GPUs only, no whole commands")
    parser.add_argument("--repeat", type=int, default=1, help="fresh processes per figure (the minimum is kept)")
    parser.add_argument("--against", metavar="REV", help="also time the planner of this git revision")
    parser.add_argument("--no-brute", action="store_true", help="skip the brute-force baseline")
    parser.add_argument("--statistic", choices=("min", "median"), default="min",
                        help="how the --repeat processes' times combine (default: the minimum)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, gpus, model, seq, mode = args.worker
        if kind == "command":
            print(json.dumps(command_worker(int(gpus))))
            return
        job = search_worker if kind == "search" else brute_worker
        print(json.dumps(job(int(gpus), model, int(seq), mode)))
        return
    with tempfile.TemporaryDirectory(prefix="planner-speed-") as tmp:
        tree = baseline_tree(args.against, Path(tmp).resolve()) if args.against else None
        rows = measure(args, tree)
        commands = [] if args.quick else measure_commands(args, tree)
    report(args, rows)
    report_commands(args, commands)


def measure(args: argparse.Namespace, tree: Path | None) -> list[dict]:
    """Every workload's search (and, unless --no-brute, brute-force) figures; ``tree``: a baseline to time too."""
    rows = []
    for gpus, model, seq, mode, target in WORKLOADS:
        if args.quick and gpus > 64:
            continue
        row = {"gpus": gpus, "model": model, "seq": seq, "mode": mode, "target": target}
        runs, before = [], []
        for _ in range(max(1, args.repeat)):  # interleaved, so both see the same machine load
            if tree:
                before.append(run_worker("search", gpus, model, seq, mode, tree))
            runs.append(run_worker("search", gpus, model, seq, mode))
        row.update(fastest(runs, args.statistic))
        if tree:
            row["before"] = fastest(before, args.statistic)
        if args.no_brute:
            row.update({"brute_s": math.nan, "brute_kind": "skipped", "brute_score": None})
        else:
            row.update(run_worker("brute", gpus, model, seq, mode))
        if row["brute_score"] is None:
            row["same_optimum"] = None
        else:
            row["same_optimum"] = row["score"] is not None and math.isclose(row["brute_score"], row["score"],
                                                                            rel_tol=1e-12)
        rows.append(row)
    return rows


def measure_commands(args: argparse.Namespace, tree: Path | None) -> list[dict]:
    """Every :data:`COMMANDS` entry's cold figures (``tree``: a baseline's too), interleaved like the plans."""
    rows = []
    for index, (name, argv, target) in enumerate(COMMANDS):
        runs, before = [], []
        for _ in range(max(1, args.repeat)):
            if tree:
                before.append(run_worker("command", index, "-", 0, "-", tree))
            runs.append(run_worker("command", index, "-", 0, "-"))
        pick = min if args.statistic == "min" else statistics.median
        row = {"name": name, "argv": argv, "target": target, **runs[0],
               **{k: pick([r[k] for r in runs]) for k in ("cold_s", "cold_cpu_s")}}
        if tree:
            row["before"] = {**before[0], **{k: pick([r[k] for r in before]) for k in ("cold_s", "cold_cpu_s")}}
        rows.append(row)
    return rows


def report_commands(args: argparse.Namespace, rows: list[dict]) -> None:
    """The whole-command rows: cold wall and CPU seconds against their targets (and the baseline's)."""
    if not rows:
        return
    print(f"\nWhole commands, cold ({args.statistic} of {max(1, args.repeat)} fresh processes):")
    print(f"{'command':<36} {'cold s':>8} {'cold cpu':>8} {'target':>7} {'cold/target':>11}"
          + (f" {'cold before':>11} {'cpu before':>10} {'ratio':>6} same output" if args.against else "")
          + "  sp-plan arguments")
    for r in rows:
        line = (f"{r['name']:<36} {r['cold_s']:>8.3f} {r['cold_cpu_s']:>8.3f} {r['target']:>7.1f} "
                f"{r['cold_s'] / r['target']:>11.2f}")
        if args.against:
            b = r["before"]
            same = "yes" if b["digest"] == r["digest"] and b["exit"] == r["exit"] else "NO"
            line += (f" {b['cold_s']:>11.3f} {b['cold_cpu_s']:>10.3f} {b['cold_cpu_s'] / r['cold_cpu_s']:>5.2f}x "
                     f"{same:>11}")
        print(line + "  " + " ".join(r["argv"]))


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    print(f"{'GPUs':>5} {'workload':<28} {'layouts':>7} {'evals':>7} {'floors':>6} {'mem':>6} {'cold s':>8} "
          f"{'warm s':>8} {'cold cpu':>8} {'warm cpu':>8} {'target':>7} {'cold/target':>11} {'brute-force s':>15} "
          f"{'speed-up':>9} {'optimum':>8}  best layout")
    for r in rows:
        work = f"{r['model']} {r['mode']} {r['seq']:,}"
        target = f"{r['target']:.1f}" if r["target"] else "-"
        ratio = f"{r['cold_s'] / r['target']:.2f}" if r["target"] else "-"
        brute = f"{r['brute_s']:.2f} {r['brute_kind']}"
        same = {True: "same", False: "DIFFERS", None: "-"}[r["same_optimum"]]
        print(f"{r['gpus']:>5} {work:<28} {r['layouts']:>7} {r['evaluations']:>7} {r['floor_evaluations']:>6} "
              f"{r['memory_evaluations']:>6} {r['cold_s']:>8.3f} {r['warm_s']:>8.3f} {r['cold_cpu_s']:>8.3f} "
              f"{r['warm_cpu_s']:>8.3f} {target:>7} {ratio:>11} "
              f"{brute:>15} {r['brute_s'] / r['cold_s']:>8.1f}x {same:>8}  {r['best']}")
    if args.against:
        print(f"\nAgainst {args.against} (same run, interleaved; {args.statistic} of {max(1, args.repeat)} fresh "
              "processes each):")
        print(f"{'GPUs':>5} {'model':<14} {'cold before':>11} {'cold after':>10} {'ratio':>6} {'warm before':>11} "
              f"{'warm after':>10} {'ratio':>6} {'cold cpu before':>15} {'after':>6} {'ratio':>6} "
              f"{'evals before':>12} {'after':>6} {'mem before':>10} {'after':>6} same best")
        for r in rows:
            b = r["before"]
            same = "yes" if b["score"] == r["score"] and b["best"] == r["best"] else "NO"
            print(f"{r['gpus']:>5} {r['model']:<14} {b['cold_s']:>11.3f} {r['cold_s']:>10.3f} "
                  f"{b['cold_s'] / r['cold_s']:>5.2f}x {b['warm_s']:>11.3f} {r['warm_s']:>10.3f} "
                  f"{b['warm_s'] / r['warm_s']:>5.2f}x {b['cold_cpu_s']:>15.3f} {r['cold_cpu_s']:>6.3f} "
                  f"{b['cold_cpu_s'] / r['cold_cpu_s']:>5.2f}x {b['evaluations']:>12} {r['evaluations']:>6} "
                  f"{b['memory_evaluations']:>10} {r['memory_evaluations']:>6} {same}")
    startup, torch_loaded = help_startup()
    print(f"\n`sp-plan --help`: {startup:.3f} s (target 0.5 s, ratio {startup / 0.5:.2f}); "
          f"torch imported: {torch_loaded}")


if __name__ == "__main__":
    main()
