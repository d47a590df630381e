"""CPU ranks' host overhead (runtime/host_overhead.py): measured at a sixteenth of the plan's length, priced
once per step by the time model, shown by ``--explain-time``, and kept out of GPU predictions."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import yaml

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.topology import load_topology
from types import SimpleNamespace

from sp_plan.planner.plan import plan_from_dict
from sp_plan.runtime.host_overhead import SHORT_FACTOR, HostOverhead, host_overhead, short_length, with_host_overhead

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 352, "vocab_size": 512, "tie_word_embeddings": False}


def _plan(seq_len: int, **degrees: int):
    """What the host-overhead helpers read of a plan: its model, training spec and layout."""
    return SimpleNamespace(model=get_model_preset("llama3-8b"), train=TrainSpec(seq_len=seq_len),
                           layout=Layout(**degrees))


def test_short_length_is_a_sixteenth_on_the_sequence_multiple():
    plan = _plan(4096, ring=4)
    short = short_length(plan)
    assert short == 4096 // SHORT_FACTOR
    assert short % plan.layout.seq_multiple(plan.train.tp_sequence_parallel) == 0
    odd = _plan(4096 + 8 * 13, ring=4)  # 4200 tokens: 262 is no multiple of the zigzag's 8 chunks
    assert short_length(odd) == 256
    # Too short to shrink: no measurement, rather than a prediction that is the measurement itself.
    assert short_length(_plan(64, ring=4)) is None


def test_time_model_adds_the_host_overhead_once_per_step():
    model, layout = get_model_preset("llama3-8b"), Layout(ulysses=8)
    train = TrainSpec(seq_len=32768, grad_accum=2)
    topo = load_topology("dgx-h100", 8)
    base = estimate(model, train, layout, topo)
    overhead = HostOverhead(seq_len=2048, measured_s=0.75, predicted_s=0.5)
    with_it = estimate(model, train, layout, with_host_overhead(topo, overhead))
    assert with_it.time.step_s == pytest.approx(base.time.step_s + 0.25, rel=1e-12)
    assert with_it.time.components["host_overhead"] == pytest.approx(0.25)
    assert base.time.components["host_overhead"] == 0.0
    assert sum(with_it.time.components.values()) == pytest.approx(with_it.time.step_s, rel=1e-9)
    # A model that overprices the short step keeps its own figure: no negative overhead.
    assert HostOverhead(seq_len=2048, measured_s=0.4, predicted_s=0.5).per_step_s == 0.0


def test_host_overhead_subtracts_the_model_at_the_short_length():
    plan = _plan(8192, ulysses=8)
    topo = load_topology("dgx-h100", 8)
    short = short_length(plan)
    priced = estimate(plan.model, plan.train.model_copy(update={"seq_len": short}), plan.layout, topo,
                      with_placement=False).time.step_s
    measured = priced + 0.125
    got = host_overhead(plan, topo, short, measured, None)
    assert got.predicted_s == pytest.approx(priced, rel=1e-12)
    assert got.per_step_s == pytest.approx(0.125, rel=1e-9)
    assert f"{short:,} tokens" in got.note()


def _explain(topology: pathlib.Path, model: str, *flags: str) -> str:
    done = subprocess.run([str(pathlib.Path(sys.executable).parent / "sp-plan"), "estimate", "--model", model,
                           *flags, "--topology", str(topology), "--explain-time"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_explain_time_shows_a_measured_host_overhead_or_says_it_is_missing(tmp_path):
    from sp_plan.cost_models.topology.presets import get_preset_spec

    spec = get_preset_spec("dgx-h100").model_dump(mode="json")
    spec["calibration"]["compute"]["host_step_overhead_s"] = 0.05
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = _explain(path, "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--ulysses", "8")
    row = next(line for line in out.splitlines() if "host overhead per step" in line)
    assert "0.0500" in row and "measured" in row
    # CPU ranks without a measured overhead: the explanation says what it leaves out (GPU ones do not).
    cpu = {"name": "cpu-box", "gpu": {"name": "cpu", "memory_bytes": 8 << 30, "peak_flops": {"fp32": 1e11, "bf16": 5e10},
                                      "memory_bandwidth": 2e10},
           "node": {"gpus": 4, "interconnect": {"kind": "loopback", "bandwidth": 5e9, "latency": 2e-5},
                    "host": {"sockets": 1, "cpu_cores": 4, "ram_bytes": 32 << 30, "memory_bandwidth": 2e10}}}
    cpu_path = tmp_path / "cpu.yaml"
    cpu_path.write_text(yaml.safe_dump(cpu))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = _explain(cpu_path, str(config), "--seq-len", "4K", "--gpus", "4", "--ring", "4", "--dtype", "fp32")
    assert "CPU ranks: not in this step: the host overhead" in out and "sp-plan validate" in out
    assert "host overhead per step" not in out
    assert "CPU ranks: not in this step" not in _explain(path, "llama3-8b", "--seq-len", "8K", "--gpus", "8")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_validate_on_cpu_measures_and_adds_the_host_overhead(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "sp_plan.cli", "validate", "--model", str(config), "--dtype", "fp32",
                           "--seq-len", "2K", "--gpus", "2", "--ring", "2", "--steps", "3", "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    overhead = report["time_topology"]["calibration"]["compute"]["host_step_overhead_s"]
    assert overhead > 0  # gloo calls and FSDP2 hooks cost milliseconds per step on CPU ranks
    note = next(n for n in report["notes"] if n.startswith("step time: host overhead"))
    assert "the plan at 128 tokens" in note
    # The prediction is the time model on the topology that carries it (what `sp-plan calibrate` re-predicts).
    from sp_plan.cost_models.topology.topology import Topology
    from sp_plan.cost_models.topology.spec import TopologySpec

    plan = plan_from_dict(report["plan"])
    topo = Topology(TopologySpec.model_validate(report["time_topology"]))
    from sp_plan.runtime.capabilities import memory_assumptions
    from sp_plan.runtime.models.base import adapter_named

    again = estimate(plan.model, plan.train, plan.layout, topo, memory_assumptions(adapter_named(report["kind"])),
                     with_placement=False)
    assert again.time.step_s == pytest.approx(report["prediction"]["step_seconds"], rel=1e-9)
    assert again.time.components["host_overhead"] == pytest.approx(overhead, rel=1e-12)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_train_on_cpu_prints_a_prediction_with_the_measured_host_overhead(tmp_path):
    exe = pathlib.Path(sys.executable).parent / "sp-plan"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(exe), "train", "--nproc-per-node", "2", "--seq-len", "512", "--steps", "2",
                           "--dtype", "fp32", "--corpus-bytes", "100000", "--no-progress", "--yes", "--json"],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    timing = summary["plan"]["estimate"]["time"]
    overhead = timing["components"]["host_overhead"]
    assert overhead > 0
    assert sum(timing["components"].values()) == pytest.approx(timing["step_s"], rel=1e-9)
    # The line the user reads carries the step the summary's plan holds.
    assert f"predicted step with the host overhead: {timing['step_s']:.3g} s" in done.stderr


def _measure_rank(rank: int, world: int) -> dict:
    from sp_plan.cost_models import Layout, ModelSpec
    from sp_plan.planner.plan import Hardware, Plan
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.host_overhead import measure_without_updates
    from sp_plan.runtime.models import LlamaModel

    spec = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=64)
    model = LlamaModel(spec)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    plan = Plan(model=spec, train=TrainSpec(seq_len=256, dtype="fp32"), layout=Layout(ulysses=2),
                hardware=Hardware(num_gpus=2, gpus_per_node=2, gpu="h100-80gb", topology="dgx-h100"))
    setup = auto_configure(model, plan=plan)
    before = [p.to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for p in setup.model.parameters()]
    seconds = measure_without_updates(setup, short_length(plan))
    after = [p.to_local() if hasattr(p, "to_local") else p.detach() for p in setup.model.parameters()]
    return {"seconds": seconds, "same": all(torch.equal(a, b) for a, b in zip(before, after)),
            "no_grads": all(p.grad is None for p in setup.model.parameters())}


@pytest.mark.multiproc
def test_the_short_run_before_training_leaves_weights_and_gradients_as_they_were():
    from tests.distributed import run_ranks

    results = run_ranks(2, _measure_rank, timeout=120)
    assert results[0]["seconds"] == results[1]["seconds"] > 0  # the slowest rank's median, agreed
    assert all(r["same"] and r["no_grads"] for r in results)
