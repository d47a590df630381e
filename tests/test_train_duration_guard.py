"""``sp-plan train`` refuses to start a run whose predicted time is far beyond what was meant (a 4M-token
global batch on CPU: hours per step) unless told ``--yes``; the refusal names the prediction and how to
shrink it, and comes after planning, before any data is read or step is taken."""

from __future__ import annotations

import os
import re
import pathlib
import subprocess
import sys

import pytest

from sp_plan.cost_models import ModelSpec, TrainSpec
from sp_plan.cost_models.topology import load_topology
from sp_plan.runtime.train_options import PREDICTED_HOURS_LIMIT, TrainRunOptions
from sp_plan.runtime.train_run import predicted_duration_problem

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plan():
    from sp_plan.runtime.auto import plan_for

    spec = ModelSpec(name="byte-llama-tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_hidden_size=128, vocab_size=259)
    return plan_for(spec, TrainSpec(seq_len=512, dtype="fp32"), load_topology("dgx-h100", 2), 2,
                    fixed_layout={"ring": 2})


def with_step(plan, step_s: float):
    return plan.model_copy(update={"estimate": {**plan.estimate, "time": {**plan.estimate["time"], "step_s": step_s}}})


def test_the_bound_is_an_hour_on_cpu_and_a_week_on_gpus(plan):
    assert PREDICTED_HOURS_LIMIT == {"cpu": 1.0, "gpu": 168.0}
    assert predicted_duration_problem(with_step(plan, 36.0), 100, "cpu") is None  # exactly one hour
    assert predicted_duration_problem(with_step(plan, 36.1), 100, "cpu") is not None
    assert predicted_duration_problem(with_step(plan, 36.1), 100, "cuda") is None
    assert predicted_duration_problem(with_step(plan, 6048.0), 100, "cuda") is None  # exactly a week
    assert predicted_duration_problem(with_step(plan, 6049.0), 100, "cuda") is not None


def test_max_predicted_hours_replaces_the_bound(plan):
    assert predicted_duration_problem(with_step(plan, 360.0), 100, "cpu", max_hours=10.0) is None
    problem = predicted_duration_problem(with_step(plan, 360.0), 100, "cuda", max_hours=5.0)
    assert problem is not None and "over --max-predicted-hours 5" in problem


def test_the_refusal_names_the_prediction_and_how_to_shrink_it(plan):
    problem = predicted_duration_problem(with_step(plan, 1200.0), 30, "cpu")
    t = plan.train
    tokens = t.seq_len * t.micro_batch * t.grad_accum * plan.layout.dp
    assert f"1,200 s per step on {plan.hardware.topology}" in problem
    assert f"{tokens:,} tokens per step" in problem
    assert "30 steps take about 10 hours, over the 1 hour bound for a CPU run" in problem
    assert "--yes" in problem and "--steps" in problem and "--global-batch" in problem
    from_file = predicted_duration_problem(with_step(plan, 1200.0), 30, "cpu", planned_here=False)
    assert "sp-plan plan --global-batch-tokens" in from_file


def test_a_plan_without_a_time_estimate_is_not_judged(plan):
    assert predicted_duration_problem(plan.model_copy(update={"estimate": {}}), 10 ** 9, "cpu") is None
    assert predicted_duration_problem(with_step(plan, 0.0), 10 ** 9, "cpu") is None


def test_options_default_to_the_bound_and_no_yes():
    options = TrainRunOptions()
    assert options.yes is False and options.max_predicted_hours is None


def _train(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    # 2,048 sequences of 2,048 tokens per step (4M tokens) on this CPU: many minutes per step predicted.
    cmd = [sys.executable, "-m", "sp_plan.cli", "train", "--global-batch", "2048", "--steps", "1000",
           "--corpus-bytes", "100000", "--no-progress", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_train_refuses_a_run_predicted_to_take_days_before_reading_data(tmp_path):
    done = _train(tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "predicted on" in done.stdout  # planned and said so first
    # no data read, no step taken (a step's line starts "step N" then a separator or "loss"; the plan's summary
    # may print "step 1.4e+03 s", a predicted step time, which is not one)
    assert "data:" not in done.stdout and not re.search(r"^step \d+(?![.\de])", done.stdout, re.MULTILINE)
    err = done.stderr
    assert "error: the plan predicts" in err and "1,000 steps take about" in err
    assert "over the 1 hour bound for a CPU run" in err and "--yes" in err
    # --yes passes the guard: the run goes on to its data, which is too small for one step (no training).
    done = _train(tmp_path, "--yes")
    assert done.returncode == 2
    assert "predicts" not in done.stderr and "fewer than one step of 2048" in done.stderr, done.stderr[-2000:]
