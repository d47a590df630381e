"""A SIGTERM (preemption) during ``sp-plan train`` on 2 gloo ranks: one line, exit 143, a checkpoint that resumes.

The real thing through the console script: ``sp-plan train --nproc-per-node 2`` launches the two ranks
(torchrun's launcher in-process), the test waits until a few steps have run, sends SIGTERM to the
launcher, as a scheduler preempting the job would, and checks that no traceback is printed, the status is
143 (128 + SIGTERM: a scheduler must not take a preempted run for a finished one), the ranks said where
they stopped, and the checkpoint they wrote verifies; a second launch with ``--resume`` continues from it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sp_plan.runtime.checkpoint import list_checkpoints, read_verified_state

SCRIPT = str(Path(sys.executable).parent / "sp-plan")
#: A tiny model on a small slice of the default corpus; --yes: the run is stopped long before its end.
TINY = ["--seq-len", "128", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--corpus-bytes", "100000", "--no-progress", "--log-every", "1", "--yes"]
#: Bound on waiting for the first steps (two interpreters start, plan and build the model on 2 busy cores).
FIRST_STEPS_S = 90.0


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_sigterm_stops_saves_and_exits_143_then_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = subprocess.Popen([SCRIPT, "train", "--nproc-per-node", "2", "--steps", "5000", "--checkpoint-dir",
                            str(ckpt), *TINY], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + FIRST_STEPS_S
    while not any(line.startswith("step 3 |") for line in lines) and time.monotonic() < deadline \
            and run.poll() is None:
        time.sleep(0.2)
    assert run.poll() is None, "".join(lines)[-3000:]
    assert any(line.startswith("step 3 |") for line in lines), "".join(lines)[-3000:]
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=90) == 143, "".join(lines)[-3000:]
    reader.join(timeout=10)
    out = "".join(lines)

    assert "Traceback" not in out and "SignalException" not in out and "ChildFailedError" not in out, out[-3000:]
    stopped = re.findall(r"^stopped by SIGTERM after step (\d+); checkpoint (\S+) saved: continue with --resume",
                         out, re.M)
    assert len(stopped) == 1, out[-3000:]  # one line, from rank 0
    step = int(stopped[0][0])
    assert step >= 3
    saved = list_checkpoints(ckpt)
    assert [s for s, _ in saved][-1] == step, saved
    state = read_verified_state(saved[-1][1])  # every file matches the manifest
    assert state["step"] == step and state["world_size"] == 2

    resumed = subprocess.run([SCRIPT, "train", "--nproc-per-node", "2", "--steps", str(step + 2), "--resume",
                              "--checkpoint-dir", str(ckpt), *TINY], cwd=tmp_path, env=_env(), capture_output=True,
                             text=True, timeout=150)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from {ckpt / f'step_{step:08d}'} at step {step} (same layout: exact continuation)" in out, \
        out[-3000:]
    assert re.search(rf"^step {step + 2} \|", out, re.M), out[-3000:]
    assert [s for s, _ in list_checkpoints(ckpt)][-1] == step + 2


def test_a_launch_inside_torchrun_is_refused(tmp_path):
    env = {**_env(), "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}
    done = subprocess.run([SCRIPT, "train", "--nproc-per-node", "2", "--steps", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--nproc-per-node launches the ranks itself: drop it under torchrun" in done.stderr


def test_worker_argv_drops_only_the_launch_option():
    from sp_plan.cli.commands.train import worker_argv

    assert worker_argv(["--steps", "3", "--nproc-per-node", "2", "--lr", "0.1"]) == ["--steps", "3", "--lr", "0.1"]
    assert worker_argv(["--nproc-per-node=4", "--plan", "p.yaml"]) == ["--plan", "p.yaml"]
