"""MoE dispatchers that send a token once per remote node (DeepEP, Hybrid-EP; ``StackTime.moe_dispatcher``)
against NCCL's pairwise all-to-all of the permuted rows (Megatron-Core's ``alltoall`` dispatcher).

The saving is only on node-crossing bytes: an EP group inside one node is priced the same either way, and a
group that spans nodes is cheaper by the expected number of distinct remote nodes a token's top-k reaches."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.collectives import collective_cost, node_dedup_fabric_fraction
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.stack import prior_stack
from sp_plan.cost_models.topology import default_topology
from sp_plan.cost_models.placement import group_spans

MOE = get_model_preset("qwen3-30b-a3b")  # 128 experts, top-8


def test_dedup_share_closed_form():
    # 2 nodes of 64 experts each, top-8: a token reaches the other node unless all 8 picks stay home.
    reached = 1 - math.comb(64, 8) / math.comb(128, 8)
    assert node_dedup_fabric_fraction(8, 128, 2) == pytest.approx(reached / (8 * 1 / 2))
    assert node_dedup_fabric_fraction(8, 128, 2) == pytest.approx(0.249, abs=0.001)  # 4 copies -> ~1
    # DeepSeek-V3 over 4 nodes (256 experts, top-8): 6 copies cross in the pairwise exchange, ~2.7 here.
    reached4 = 3 * (1 - math.comb(192, 8) / math.comb(256, 8))
    assert node_dedup_fabric_fraction(8, 256, 4) == pytest.approx(reached4 / (8 * 3 / 4))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64), st.integers(1, 32))
def test_dedup_share_is_bounded_and_falls_with_top_k(top_k, experts_per_node, nodes):
    experts = experts_per_node * nodes
    share = node_dedup_fabric_fraction(top_k, experts, nodes)
    assert 0.0 < share <= 1.0 + 1e-12
    if top_k < experts:
        assert node_dedup_fabric_fraction(top_k + 1, experts, nodes) <= share + 1e-12
    assert node_dedup_fabric_fraction(1, experts, nodes) == 1.0  # one copy per token: nothing to merge
    assert node_dedup_fabric_fraction(top_k, experts, 1) == 1.0  # inside one node: no fabric bytes


def test_fabric_fraction_only_touches_the_node_crossing_part():
    topology = default_topology("h100-80gb", 16)
    span = group_spans(Layout(dp_shard=16, ep=16), topology)["ep"]
    full, half = collective_cost("all_to_all", 1e9, span), collective_cost("all_to_all", 1e9, span, 0.5)
    assert half.fabric_bytes == pytest.approx(full.fabric_bytes / 2)
    assert half.bytes_sent == full.bytes_sent  # the volume a rank hands the dispatcher is unchanged
    assert half.time_s < full.time_s


def _ep_time(layout: Layout, gpus: int, dispatcher: str):
    base = resolve_profile("h100-80gb", "megatron")
    profile = dataclasses.replace(base, stack=base.stack.with_overrides(
        time={"moe_dispatcher": dispatcher, "moe_a2a_overlap": False}))
    train = TrainSpec(seq_len=4096, zero_stage=1, fp8_linears=True, grad_accum=4)
    return estimate(MOE, train, layout, default_topology("h100-80gb", gpus), profile=profile)


def test_hierarchical_dispatch_is_cheaper_only_across_nodes():
    one_node = {d: _ep_time(Layout(dp_shard=8, ep=8), 8, d) for d in ("alltoall", "hybridep", "deepep")}
    steps = {d: e.time.step_s for d, e in one_node.items()}
    assert steps["alltoall"] == steps["hybridep"] == steps["deepep"]

    two = {d: _ep_time(Layout(dp_shard=16, ep=16), 16, d) for d in ("alltoall", "hybridep")}
    a2a, dedup = (two[d].time.exposed_comm_s_by_strategy["ep"] for d in ("alltoall", "hybridep"))
    assert dedup < a2a / 2  # ~4 node-crossing copies per token become ~1
    assert dedup > a2a * node_dedup_fabric_fraction(8, 128, 2) * 0.99  # never below the fabric share
    assert "Hybrid-EP" in two["hybridep"].time.efficiency_sources["ep_overlap"]  # --explain-time says which
    assert "NCCL all-to-all" in two["alltoall"].time.efficiency_sources["ep_overlap"]
    # Bytes a rank sends (the comm-volume report) are the dispatcher's input either way.
    assert two["alltoall"].comm.per_step_by_strategy["ep"] == two["hybridep"].comm.per_step_by_strategy["ep"]


def test_stacks_default_to_the_pairwise_all_to_all():
    for stack in ("megatron-core", "torchtitan", "sp-plan"):
        assert prior_stack(stack).time.moe_dispatcher == "alltoall"


def test_tp_ranks_dispatch_their_sequence_parallel_shard():
    """Megatron-Core under TP + sequence parallelism: each TP rank dispatches its 1/tp of the tokens, and
    the experts split over TP gather the TP ranks' rows (then reduce-scatter the outputs)."""
    from sp_plan.cost_models.comm_volume import comm_ops

    layout = Layout(tp=2, dp_shard=8, ep=8)
    sp, plain = TrainSpec(seq_len=4096), TrainSpec(seq_len=4096, tp_sequence_parallel=False)
    ops_sp = [op for op in comm_ops(MOE, sp, layout) if op.strategy == "ep"]
    ops_plain = [op for op in comm_ops(MOE, plain, layout) if op.strategy == "ep"]
    a2a_sp = {op.nbytes for op in ops_sp if op.collective == "all_to_all"}
    a2a_plain = {op.nbytes for op in ops_plain if op.collective == "all_to_all"}
    assert len(a2a_sp) == len(a2a_plain) == 1 and a2a_sp.pop() == pytest.approx(a2a_plain.pop() / 2)
    assert not [op for op in ops_plain if op.group == "tp"]
    gathers = [op for op in ops_sp if op.group == "tp"]
    assert {op.collective for op in gathers} == {"all_gather", "reduce_scatter"}
    assert {op.phase for op in gathers} == {"forward", "backward"}
    assert all(op.overlap == "ep" for op in gathers)  # part of the dispatch the combined schedule pairs



def test_a_stack_file_naming_a_dispatcher_through_the_console_script(tmp_path):
    """``--stack FILE`` with ``moe_dispatcher: hybridep``: the EP all-to-all across two nodes costs less
    than under Megatron-Core's shipped alltoall, and ``--explain-time`` names the dispatcher."""
    import subprocess
    import sys
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "cost_models" / "data" / "stacks" / "megatron-core.yaml"
    text = shipped.read_text()
    assert "  moe_dispatcher: alltoall" in text
    custom = tmp_path / "megatron-hybridep.yaml"
    custom.write_text(text.replace("name: megatron-core", "name: megatron-hybridep").replace(
        "aliases: [megatron, mcore]", "aliases: []").replace("  moe_dispatcher: alltoall", "  moe_dispatcher: hybridep"))
    sp_plan = Path(sys.executable).with_name("sp-plan")

    def ep_seconds(stack: str) -> tuple[float, str]:
        out = subprocess.run([str(sp_plan), "estimate", "--model", "qwen3-30b-a3b", "--seq-len", "4K", "--gpus", "16",
                              "--dp-shard", "16", "--ep", "16", "--stack", stack, "--explain-time"],
                             capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if x.strip().startswith("exposed communication: ep"))
        return float(line.split()[3]), out

    nccl, _ = ep_seconds("megatron")
    dedup, text_out = ep_seconds(str(custom))
    assert dedup < nccl / 2 and "Hybrid-EP" in text_out
