"""``sp-plan train --json`` through the console script: stdout is exactly one JSON object, the run's summary.

Two ranks launched by the command itself (pp=2, so both ranks hold different stages and only rank 0 may print):
stdout parses with ``json.loads`` as a whole; the plan in it loads as a plan file; its losses are the ones the
run's ``--metrics-file`` recorded step by step; its tokens/s is the metrics' (all ranks' tokens over the steps after
the first); the checkpoint it names exists; the log lines went to stderr. A command-line error leaves stdout empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sp_plan.planner.plan import plan_from_dict

SCRIPT = str(Path(sys.executable).parent / "sp-plan")
TINY = ["--seq-len", "128", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--corpus-bytes", "100000", "--no-progress", "--log-every", "1", "--yes"]


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([SCRIPT, "train", *args], check=False, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=200)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_train_json_prints_only_the_summary_on_stdout(tmp_path):
    done = _train(tmp_path, "--nproc-per-node", "2", "--pp", "2", "--global-batch", "2", "--steps", "3",
                  "--checkpoint-dir", "ck", "--metrics-file", "metrics.jsonl", "--json", *TINY)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout)  # the whole of stdout: one object, nothing else
    assert isinstance(summary, dict)
    plan = plan_from_dict(summary["plan"], "the --json summary")
    assert plan.layout.pp == 2 and plan.train.grad_accum == 2
    assert summary["layout"] == "pp=2" and summary["world_size"] == 2
    assert (summary["start_step"], summary["step"], summary["steps_run"]) == (0, 3, 3)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["losses"] == [m["loss"] for m in metrics] and len(metrics) == 3
    timed = metrics[1:]
    assert summary["tokens"] == sum(m["tokens"] for m in metrics) > 0
    assert summary["tokens_per_s"] == pytest.approx(sum(m["tokens"] for m in timed) / sum(m["seconds"] for m in timed))
    assert summary["tokens_per_s_steps"] == [2, 3]
    assert summary["exit_reason"] == "completed" and summary["exit_code"] == 0 and summary["skipped_steps"] == []
    assert (tmp_path / summary["checkpoint"]).is_dir() and summary["checkpoint"].endswith("step_00000003")
    assert "done: 3 steps" in done.stderr and "plan: pp=2" in done.stderr


def test_train_json_leaves_stdout_empty_on_a_command_line_error(tmp_path):
    done = _train(tmp_path, "--json", "--steps", "0")
    assert done.returncode == 2 and done.stdout == "" and "--steps" in done.stderr
