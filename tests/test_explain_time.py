"""``sp-plan estimate --explain-time`` (issue 21): the step split into what it is spent on, each part's
efficiency and where that value came from."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.compute_time import COMPUTE_PARTS
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.topology import default_topology
from sp_plan.cli.main import cli

LLAMA8 = get_model_preset("llama3-8b")

CASES = [
    (TrainSpec(seq_len=32768, checkpointing="full"), Layout(ulysses=8)),
    (TrainSpec(seq_len=131072, checkpointing="selective", tiled_mlp=True, tiled_loss=True), Layout(ring=4, ulysses=2)),
    (TrainSpec(seq_len=65536, checkpointing="full", offload_checkpoints=True, offload_optimizer=True, zero_stage=3,
               grad_accum=4), Layout(ring=8)),
    (TrainSpec(seq_len=16384, fp8_linears=True, compiled=True), Layout(dp_shard=4, tp=2)),
    (TrainSpec(seq_len=65536, mode="prefill"), Layout(ulysses=4, ring=2)),
]


@pytest.mark.parametrize(("stack", "case"), list(itertools.product(["sp-plan", "torchtitan", "hf-deepspeed"], CASES)))
def test_components_add_up_to_the_step(stack, case):
    train, layout = case
    topology = default_topology("h100-80gb", 8)
    t = estimate(LLAMA8, train, layout, topology, profile=resolve_profile("h100-80gb", stack)).time
    parts = t.components
    assert sum(parts.values()) == pytest.approx(t.step_s, rel=1e-9)
    assert sum(parts[p] for p in COMPUTE_PARTS) == pytest.approx(t.compute_s, rel=1e-9)
    exposed = sum(v for k, v in parts.items() if k.startswith("exposed_comm_"))
    assert exposed == pytest.approx(t.exposed_comm_s, rel=1e-9, abs=1e-12)
    assert all(v >= 0 for v in parts.values())
    if train.is_training:
        assert parts["attention_backward"] > parts["attention_forward"] > 0
    else:
        assert parts["gemm_backward"] == parts["attention_backward"] == parts["recompute"] == 0


def test_sources_follow_the_layer_that_set_each_value(tmp_path: Path):
    topology = default_topology("h100-80gb", 8)
    train, layout = CASES[0]
    shipped = estimate(LLAMA8, train, layout, topology, profile=resolve_profile("h100-80gb", "torchtitan")).time
    src = shipped.efficiency_sources
    assert src["matmul"].startswith("kernel data")  # pinned by kernel benchmarks, not by system runs
    assert src["attention_backward"].startswith("kernel data")
    assert src["compute_overhead_fraction"].startswith("system-level fit")  # torchtitan's is fitted
    assert src["clock"].startswith("GPU spec")

    cal = tmp_path / "cal.yaml"
    cal.write_text(yaml.safe_dump({"kind": "sp-plan-calibration", "version": 1, "gpu": "h100-80gb",
                                   "kernels": {"gemm.peak_fraction": 0.5}}))
    calibrated = estimate(LLAMA8, train, layout, topology,
                          profile=resolve_profile("h100-80gb", "torchtitan", calibration=str(cal))).time
    assert calibrated.efficiency_sources["matmul"] == "calibration file"
    assert calibrated.efficiencies["matmul"] == pytest.approx(0.5)
    assert calibrated.components["gemm_forward"] > shipped.components["gemm_forward"] * 1.5


def test_cli_explains_every_part_and_adds_up():
    args = ["estimate", "--model", "llama3-8b", "--seq-len", "128K", "--gpus", "8", "--ulysses", "8",
            "--stack", "torchtitan", "--offload-optimizer", "--zero", "3", "--explain-time"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for label in ("GEMMs forward", "GEMMs backward", "attention forward (fa2)", "attention backward (fa2)",
                  "recompute", "exposed communication: ulysses", "optimizer step", "stack overhead"):
        assert label in out
    assert "kernel data (calibration/kernels.yaml)" in out
    assert "system-level fit (published torchtitan runs)" in out
    step = float(out.splitlines()[1].split()[1])
    total = next(line for line in out.splitlines() if line.strip().startswith("= step"))
    assert float(total.split()[2]) == pytest.approx(step, rel=1e-3)


@pytest.mark.parametrize("args", [
    ["--model", "llama3-8b", "--seq-len", "128K", "--gpus", "8", "--ulysses", "8", "--stack", "torchtitan"],
    # pipelined: the bubble is a part of the step like any other
    ["--model", "llama3-70b", "--seq-len", "32K", "--gpus", "64", "--tp", "8", "--pp", "4", "--grad-accum", "8",
     "--virtual-stages", "2", "--stack", "megatron-core"],
])
def test_the_rows_shown_add_up_to_the_step(args):
    """Every second of the step is on a row: the rows shown sum to the step (parts below 1e-5 of it are left off)."""
    result = CliRunner().invoke(cli, ["estimate", *args, "--explain-time"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    step = float(lines[1].split()[1])
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("part "))
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("= step"))
    shown = sum(float(line[line.index("  ", 2):].split()[0]) for line in lines[start + 1:end])
    assert shown == pytest.approx(step, rel=1e-3)
    if "--pp" in args:
        assert any("pipeline bubble" in line for line in lines[start:end])
