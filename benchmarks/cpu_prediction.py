"""Uncalibrated CPU step-time prediction against measurement (issue 21 item 7; moved out of the test suite by
issue 35 item 9, since a wall-time comparison fails whenever other processes share the cores).

Each configuration runs as a user would run it: ``sp-plan validate`` launches gloo ranks on this machine,
they probe it quickly (compute with all ranks at once, gloo collectives), run the plan for a few steps at a
sixteenth of its length to measure the host overhead no kernel rate predicts (runtime/host_overhead.py),
and predict the full-length step from that, then time a few steps. Nothing here is fitted to these runs.

Each run also measures how much CPU time other processes took while it ran (the machine's busy time from
/proc/stat minus this script's children's); a run that misses is run once more. On a quiet machine the
target is within 25% for every layout and the layouts' ratios as close (the relative costs the planner
ranks by); runs that stayed loaded are held to a factor of 2. The table prints both, with the verdict.

    python benchmarks/cpu_prediction.py            # three layouts, about three minutes on 2 cores
    python benchmarks/cpu_prediction.py --only ulysses-2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The README's tiny Llama (2 layers, hidden 128, 4 heads / 2 KV heads, vocab 512).
TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 352, "vocab_size": 512, "tie_word_embeddings": False}
#: Layouts whose costs differ in kind: Ulysses all-to-alls with a 2-step ring, a 4-step zigzag ring, and two
#: ranks of Ulysses (a different core share per rank).
CONFIGS = {
    "usp-2x2": ["--seq-len", "4K", "--gpus", "4", "--ulysses", "2", "--ring", "2"],
    "ring-4": ["--seq-len", "4K", "--gpus", "4", "--ring", "4"],
    "ulysses-2": ["--seq-len", "4K", "--gpus", "2", "--ulysses", "2"],
}


#: The issue's bound on |predicted / measured - 1| before any calibration, with or without more ranks than
#: cores (4 ranks on this machine kind's 2 cores: USP 2x2 and ring 4 were -24..-36% before the host overhead
#: was measured, 2026-11-25/27).
TOLERANCE = 0.25
#: One warm-up step (also measured for bytes), then three timed ones: their median per rank.
STEPS = "4"
#: Bound for runs that other jobs kept loading even on the retry (see the module docstring).
LOADED_FACTOR = 2.0
#: Share of the machine's CPU time other processes may take while a run counts as quiet.
QUIET_SHARE = 0.2


def env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("OMP_NUM_THREADS", None)  # torchrun's default (1 per rank), as a user's run gets it
    return env


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all CPUs: /proc/stat's first line less idle and iowait)."""
    fields = [float(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def validate(config: pathlib.Path, flags: list[str]) -> tuple[float, float, float]:
    """(predicted, measured step seconds, others' share of the machine) of one ``sp-plan validate`` run:
    the measured figure is the median over ranks of each rank's median timed step; the share is the CPU
    time processes other than this script's took during the run, over the machine's capacity."""
    busy, mine, start = _machine_busy_s(), _children_cpu_s(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "sp_plan.cli", "validate", "--model", str(config), "--dtype", "fp32",
                           *flags, "--steps", STEPS, "--json"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=240)
    others = (_machine_busy_s() - busy) - (_children_cpu_s() - mine)
    share = max(0.0, others) / ((time.monotonic() - start) * (os.cpu_count() or 1))
    if done.returncode != 0:
        raise RuntimeError(f"sp-plan validate failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    if "probe" not in report["prediction"]["topology_note"]:  # predicted from this machine, not a preset
        raise RuntimeError("the prediction did not come from this machine's probe")
    measured = statistics.median(statistics.median(r["step_seconds"]) for r in report["ranks"])
    return report["prediction"]["step_seconds"], measured, share




def measure(names: list[str]) -> list[dict]:
    """One row per layout: its prediction and measurement (the retry's, after a miss) and the load."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "config.json"
        config.write_text(json.dumps(TINY_LLAMA))
        for name in names:
            predicted, measured, share = validate(config, CONFIGS[name])
            retried = abs(predicted / measured - 1) > TOLERANCE
            if retried:
                predicted, measured, share = validate(config, CONFIGS[name])
            rows.append(dict(name=name, predicted=predicted, measured=measured, share=share, retried=retried))
    return rows


def verdict(rows: list[dict]) -> list[str]:
    """The misses: quiet runs beyond 25% (and quiet layouts' ratios apart by more), loaded ones beyond 2x."""
    misses = []
    quiet = {r["name"]: r["predicted"] / r["measured"] for r in rows if r["share"] <= QUIET_SHARE}
    for r in rows:
        ratio = r["predicted"] / r["measured"]
        within = abs(ratio - 1) <= TOLERANCE if r["name"] in quiet else 1 / LOADED_FACTOR <= ratio <= LOADED_FACTOR
        if not within:
            misses.append(f"{r['name']}: {ratio - 1:+.0%}")
    if len(quiet) >= 2 and max(quiet.values()) / min(quiet.values()) > 1 + TOLERANCE:
        misses.append(f"quiet layouts' ratios spread {max(quiet.values()) / min(quiet.values()):.2f}x")
    return misses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append", help="layouts to run (default all)")
    args = parser.parse_args()
    rows = measure(args.only or list(CONFIGS))
    print(f"{'layout':<10} {'predicted s':>11} {'measured s':>10} {'pred/meas':>9} {'others CPU':>10} retried")
    for r in rows:
        print(f"{r['name']:<10} {r['predicted']:>11.3f} {r['measured']:>10.3f} {r['predicted'] / r['measured']:>9.2f} "
              f"{r['share']:>10.0%} {'yes' if r['retried'] else 'no'}")
    misses = verdict(rows)
    print("verdict: " + ("within the targets" if not misses else "MISSED " + "; ".join(misses)))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
