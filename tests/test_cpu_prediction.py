"""The first prediction a CPU user sees: ``sp-plan validate`` on CPU ranks, with no calibration, predicts
the step time it then measures within 25% (issue 21 item 7), with as many ranks as cores and with more.

Each configuration runs as a user would run it: ``sp-plan validate`` launches gloo ranks on this machine,
they probe it quickly (compute with all ranks at once, gloo collectives), run the plan for a few steps at a
sixteenth of its length to measure the host overhead no kernel rate predicts (runtime/host_overhead.py),
and predict the full-length step from that, then time a few steps. Nothing here is fitted to these runs:
the probe measures kernel rates, the kernel model (cpu.yaml) prices shapes, the short run measures the
per-step host cost, the time model adds them up; the full-length step has 16x the tokens and 256x the
attention pairs of the short one.

Robustness on a shared machine: the probe and the steps run back to back under whatever else loads the
cores, so the ratio compares like with like, but ranks that wait on a collective can hand their core to
other jobs instead of to their peers, which a probe of busy ranks does not see. So each run also
measures how much CPU time other processes took while it ran (the machine's busy time from /proc/stat
minus this test's children's); a run that misses is run once more (timing on a time-sliced machine varies
by a third between runs even when nothing else runs).
Runs on a quiet machine (as in CI) must be within 25% and agree with one another as closely (the relative
costs the planner ranks by); runs that stayed loaded must still be within a factor of 2, which the 60x
error of issue 21 (attention priced with bf16 efficiencies at the fp32 rate, ranks timed alone) fails by far.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import pytest

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


def _env() -> dict:
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


def _validate(config: pathlib.Path, flags: list[str]) -> tuple[float, float, float]:
    """(predicted, measured step seconds, others' share of the machine) of one ``sp-plan validate`` run:
    the measured figure is the median over ranks of each rank's median timed step; the share is the CPU
    time processes other than this test's took during the run, over the machine's capacity."""
    busy, mine, start = _machine_busy_s(), _children_cpu_s(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "sp_plan.cli", "validate", "--model", str(config), "--dtype", "fp32",
                           *flags, "--steps", STEPS, "--json"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=240)
    others = (_machine_busy_s() - busy) - (_children_cpu_s() - mine)
    share = max(0.0, others) / ((time.monotonic() - start) * (os.cpu_count() or 1))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert "probe" in report["prediction"]["topology_note"]  # predicted from this machine, not a preset
    measured = statistics.median(statistics.median(r["step_seconds"]) for r in report["ranks"])
    return report["prediction"]["step_seconds"], measured, share


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_cpu_step_time_predicted_within_25_percent(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    quiet: dict[str, float] = {}
    loaded: dict[str, float] = {}
    lines = []
    for name, flags in CONFIGS.items():
        predicted, measured, share = _validate(config, flags)
        if abs(predicted / measured - 1) > TOLERANCE:
            # One more run for any miss: on an idle machine the same layout measured 0.70 s in one run and
            # 0.96 s in another (the probe and the steps are separate samples of a time-sliced machine).
            lines.append(f"{name}: predicted {predicted:.3f} s, measured {measured:.3f} s while other processes "
                         f"took {share:.0%} of the CPUs; retried")
            predicted, measured, share = _validate(config, flags)
        ratio = predicted / measured
        (quiet if share <= QUIET_SHARE else loaded)[name] = ratio
        lines.append(f"{name}: predicted {predicted:.3f} s, measured {measured:.3f} s ({ratio - 1:+.0%}; other "
                     f"processes took {share:.0%} of the CPUs)")
    summary = "\n".join(lines)
    print(summary)
    for name, ratio in loaded.items():
        assert 1 / LOADED_FACTOR <= ratio <= LOADED_FACTOR, f"{name} off by more than {LOADED_FACTOR}x:\n{summary}"
    for name, ratio in quiet.items():
        assert abs(ratio - 1) <= TOLERANCE, f"{name} off by more than {TOLERANCE:.0%}:\n{summary}"
    if len(quiet) >= 2:  # the relative costs of the layouts, which the planner ranks by, hold up too
        assert max(quiet.values()) / min(quiet.values()) <= 1 + TOLERANCE, summary
