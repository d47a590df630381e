"""examples/train_long_context.py runs under torchrun on CPU with a plan file, as `sp-plan export --to
torchrun` launches it (2 gloo ranks, tiny model, a handful of steps over the stdlib corpus)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from cost_models import Layout, ModelSpec, TrainSpec
from cost_models.topology import load_topology

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_example_trains_from_a_plan_file(tmp_path):
    from planner.export import to_torchrun
    from runtime.auto import plan_for

    spec = ModelSpec(name="byte-llama-tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_hidden_size=128, vocab_size=259)
    plan = plan_for(spec, TrainSpec(seq_len=512, dtype="fp32"), load_topology("dgx-h100", 2), 2,
                    fixed_layout={"ring": 2})
    path = tmp_path / "plan.yaml"
    plan.save(path)
    command = to_torchrun(plan, str(path)).content
    assert "examples/train_long_context.py" in command and "--plan" in command
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/train_long_context.py", "--plan", str(path), "--steps", "4", "--corpus-bytes", "200000"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "plan: ring=2 on 2 rank(s) for byte-llama-tiny" in out
    match = re.search(r"done: 4 steps .* loss ([\d.]+) -> ([\d.]+); ([\d,]+) tokens/s", out)
    assert match, out[-2000:]
    assert float(match.group(2)) < float(match.group(1))  # it learns
    assert int(match.group(3).replace(",", "")) > 0


def test_example_refuses_a_plan_the_runtime_cannot_run(tmp_path):
    from planner.plan import Hardware, Plan

    spec = ModelSpec(name="t", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=259)
    plan = Plan(model=spec, train=TrainSpec(seq_len=256, zero_stage=0), layout=Layout(),
                hardware=Hardware(num_gpus=1, gpus_per_node=1, gpu="h100-80gb", topology="dgx-h100"))
    path = tmp_path / "plan.yaml"
    plan.save(path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "examples/train_long_context.py", "--plan", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "zero_stage=0" in done.stderr and "DDP" in done.stderr



@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_example_trains_a_hugging_face_model_with_tensor_parallelism():
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/train_long_context.py", "--hf", "--tp", "2", "--tiled-mlp", "--layers", "2", "--hidden", "64",
           "--ffn", "128", "--seq-len", "512", "--steps", "4", "--corpus-bytes", "200000", "--topology", "dgx-h100"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert re.search(r"plan: tp=2 on 2 rank\(s\) for llama-2l-64h", out), out[-2000:]
    match = re.search(r"done: 4 steps .* loss ([\d.]+) -> ([\d.]+);", out)
    assert match and float(match.group(2)) < float(match.group(1)), out[-2000:]
