"""Host-bound MoE layers (``StackTime.moe_host_sync_s``, :mod:`sp_plan.cost_models.strategies.moe_host`): the
GPU idle a dropless dispatcher's host synchronisation leaves in every MoE layer pass.

The term is the stack's idle per pass times the passes on the critical path: every MoE layer of every
micro-batch without the all-to-all overlap, only the unpaired passes with it, none when a CUDA graph holds the
whole MoE layer (no synchronisation left), with one rank per expert group, or in a forward-only pass."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.pipeline import stage_layers
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.stack import StackTime
from sp_plan.cost_models.strategies.overlap import unpaired_fraction
from sp_plan.cost_models.topology import default_topology

ROOT = Path(__file__).resolve().parents[1]
SPPLAN = ROOT / ".venv" / "bin" / "sp-plan"
QWEN = get_model_preset("qwen3-30b-a3b")  # 48 MoE layers
DEEPSEEK = get_model_preset("deepseek-v3")  # 3 dense layers lead
TOPOLOGY = default_topology("h100-80gb", 16)
LAYOUT = Layout(dp_shard=16, ep=16)


def _profile(**time):
    base = resolve_profile("h100-80gb", "megatron")
    return dataclasses.replace(base, stack=base.stack.with_overrides(time=time)) if time else base


def _time(train: TrainSpec, model=QWEN, layout: Layout = LAYOUT, topology=TOPOLOGY, **time):
    return estimate(model, train, layout, topology, profile=_profile(**time)).time


def _train(accum: int = 8, **kw) -> TrainSpec:
    return TrainSpec(seq_len=4096, micro_batch=1, grad_accum=accum, zero_stage=1, checkpointing="none",
                     fp8_linears=True, **kw)


def test_without_overlap_every_moe_pass_waits_once():
    value = _profile().stack.time.moe_host_sync_s
    assert value > 0
    t = _time(_train(accum=8), moe_a2a_overlap=False)
    assert t.components["moe_host_sync"] == pytest.approx(8 * QWEN.num_layers * value)
    assert sum(t.components.values()) == pytest.approx(t.step_s)
    assert "100% of passes exposed" in t.efficiency_sources["moe_host_sync"]


def test_the_overlap_leaves_only_the_unpaired_passes():
    value = _profile().stack.time.moe_host_sync_s
    t = _time(_train(accum=8), moe_a2a_overlap=True)
    share = unpaired_fraction(1, 8)
    assert 0 < share < 1
    assert t.components["moe_host_sync"] == pytest.approx(share * 8 * QWEN.num_layers * value)
    off = _time(_train(accum=8), moe_a2a_overlap=False)
    assert t.components["moe_host_sync"] < off.components["moe_host_sync"]


@pytest.mark.parametrize("scope", [("moe",), ("full_iteration",), ("attn", "moe")])
def test_a_graphed_moe_layer_has_no_host_wait(scope):
    t = _time(_train(), moe_a2a_overlap=False, cuda_graph_scope=scope)
    assert "moe_host_sync" not in t.components
    assert "CUDA graph" in t.efficiency_sources["moe_host_sync"]
    eager = _time(_train(), moe_a2a_overlap=False)
    assert eager.step_s - t.step_s == pytest.approx(eager.components["moe_host_sync"])


def test_partial_scopes_of_dropless_recipes_keep_it():
    # attn / moe_router / moe_preprocess graphs leave the dispatcher's synchronisation in the step.
    partial = _time(_train(), moe_a2a_overlap=False, cuda_graph_scope=("attn", "moe_router", "moe_preprocess"))
    eager = _time(_train(), moe_a2a_overlap=False)
    assert partial.components["moe_host_sync"] == pytest.approx(eager.components["moe_host_sync"])


def test_nothing_without_expert_parallelism_forward_only_or_a_zero_value():
    dense_ep = _time(_train(), layout=Layout(dp_shard=16), moe_a2a_overlap=False)
    assert "moe_host_sync" not in dense_ep.components
    prefill = TrainSpec(seq_len=4096, micro_batch=1, mode="prefill")
    assert "moe_host_sync" not in _time(prefill, moe_a2a_overlap=False).components
    assert "moe_host_sync" not in _time(_train(), moe_a2a_overlap=False, moe_host_sync_s=0.0).components
    llama = _time(_train(), model=get_model_preset("llama3-8b"), layout=Layout(dp_shard=16))
    assert "moe_host_sync" not in llama.components and "moe_host_sync" not in llama.efficiency_sources


def test_dense_layers_do_not_wait():
    """DeepSeek-V3's leading dense layers run no dispatcher: the idle is per MoE layer."""
    topology = default_topology("h100-80gb", 64)
    layout = Layout(dp_shard=64, ep=64)
    value = _profile().stack.time.moe_host_sync_s
    t = _time(_train(accum=2), model=DEEPSEEK, layout=layout, topology=topology, moe_a2a_overlap=False)
    moe_layers = DEEPSEEK.num_layers - len(DEEPSEEK.moe.dense_layers)
    assert t.components["moe_host_sync"] == pytest.approx(2 * moe_layers * value)


def test_pipelined_step_counts_the_slowest_stage_layers():
    topology = default_topology("h100-80gb", 32)
    layout = Layout(dp_shard=16, pp=2, ep=16)
    value = _profile().stack.time.moe_host_sync_s
    train = _train(accum=8, pipeline_schedule="1f1b")
    t = _time(train, layout=layout, topology=topology, moe_a2a_overlap=False)
    split = stage_layers(QWEN, train, layout)
    slowest = split[int(t.breakdown["pipeline_slowest_stage"])]
    assert t.components["moe_host_sync"] == pytest.approx(8 * slowest * value)
    assert sum(t.components.values()) == pytest.approx(t.step_s)
    assert t.components.get("exposed_comm_ep", 0.0) > 0  # the idle is not booked as communication


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 5e-3), st.floats(0.0, 5e-3), st.integers(1, 32))
def test_monotone_and_bounded(a, b, accum):
    """More idle per pass never shortens the step; the term never exceeds value x passes."""
    lo, hi = sorted((a, b))
    t_lo = _time(_train(accum=accum), moe_a2a_overlap=False, moe_host_sync_s=lo)
    t_hi = _time(_train(accum=accum), moe_a2a_overlap=False, moe_host_sync_s=hi)
    assert t_hi.step_s >= t_lo.step_s - 1e-12
    assert t_hi.step_s - t_lo.step_s == pytest.approx(accum * QWEN.num_layers * (hi - lo), abs=1e-9)
    for t, v in ((t_lo, lo), (t_hi, hi)):
        assert 0.0 <= t.components.get("moe_host_sync", 0.0) <= accum * QWEN.num_layers * v + 1e-12


def test_more_micro_batches_more_idle():
    one, many = (_time(_train(accum=n), moe_a2a_overlap=False) for n in (4, 16))
    assert many.components["moe_host_sync"] == pytest.approx(4 * one.components["moe_host_sync"])


def test_the_field_is_validated():
    with pytest.raises(ValueError):
        StackTime(moe_host_sync_s=-1e-4)
    with pytest.raises(ValueError):
        StackTime(cuda_graph_scope=("everything",))


def test_megatron_value_is_the_cited_measurement():
    """megatron-core's prior is the Megatron-Bridge profile its comment cites: (step - GPU-active union) over
    64 micro-batches x 48 MoE layers, less the two layer_overhead_s the stack already charges per pass."""
    data = yaml.safe_load((ROOT / "cost_models/data/stacks/megatron-core.yaml").read_text())["time"]
    idle_per_pass = (24.7138 - 22.821) / (64 * 48)
    assert data["moe_host_sync_s"] == pytest.approx(idle_per_pass - 2 * data["layer_overhead_s"], rel=2e-3)
    assert data["cuda_graph_scope"] == []


def test_explain_time_prints_the_wait_through_the_console_script():
    out = subprocess.run([str(SPPLAN), "estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--ep", "16",
                          "--dp-shard", "16", "--seq-len", "4K", "--stack", "megatron-core", "--grad-accum", "1",
                          "--explain-time"], capture_output=True, text=True, timeout=120, check=True).stdout
    line = next(x for x in out.splitlines() if "MoE layers waiting on the host" in x)
    assert "moe_host_sync_s 0.516 ms per MoE layer pass" in line
    seconds = float(line.split("(dispatcher sync)")[1].split()[0])
    value = _profile().stack.time.moe_host_sync_s
    assert seconds == pytest.approx(QWEN.num_layers * value, abs=5e-5)  # one micro-batch, no overlap to pair
