"""What each stack overlaps (issues 20 and 21): TP collectives chunked inside their GEMMs (Transformer Engine
userbuffers, AsyncTP) and MoE all-to-alls behind another micro-batch (Megatron-Core's combined 1F1B).

The overlap never hides more than the compute it runs beside, always leaves the first chunk exposed, grows
with that compute, and is off wherever the stack or the plan's options do not enable it."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.compute_time import compute_time
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.stack import prior_stack, stack_names
from sp_plan.cost_models.strategies.overlap import a2a_pair_exposure, pipelined_exposure, unpaired_fraction
from sp_plan.cost_models.topology import default_topology

SP_PLAN = Path(sys.executable).with_name("sp-plan")
LLAMA8 = get_model_preset("llama3-8b")
MOE = get_model_preset("qwen3-30b-a3b")
seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
chunks = st.integers(min_value=1, max_value=16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(seconds, chunks), min_size=1, max_size=3), seconds, seconds)
def test_chunked_overlap_is_bounded_and_monotone(transfers, compute, more):
    exposed = pipelined_exposure(transfers, compute)
    total = sum(t for t, _ in transfers)
    first = sum(t / n for t, n in transfers)
    assert first - 1e-12 <= exposed <= total + 1e-12  # the first chunk of each is always exposed
    assert total - exposed <= compute + 1e-12  # never hides more than the GEMMs last
    assert pipelined_exposure(transfers, compute + more) <= exposed + 1e-12  # more compute hides more
    bigger = [(t * 1.5, n) for t, n in transfers]
    assert pipelined_exposure(bigger, compute) >= exposed - 1e-12
    # More compute never makes the step (compute + exposed transfer) shorter.
    assert compute + more + pipelined_exposure(transfers, compute + more) >= compute + exposed - 1e-12


def test_chunked_overlap_is_a_two_stage_pipeline():
    # 4 chunks of 1 s transfer beside 4 chunks of 2 s GEMM: only the first transfer chunk shows.
    assert pipelined_exposure([(4.0, 4)], 8.0) == pytest.approx(1.0)
    # Transfer-bound: (n-1) transfer chunks run beside GEMM chunks, the rest shows.
    assert pipelined_exposure([(8.0, 4)], 4.0) == pytest.approx(2.0 + 3 * (2.0 - 1.0))
    assert pipelined_exposure([(3.0, 1)], 100.0) == pytest.approx(3.0)  # one chunk: nothing overlaps


@settings(max_examples=200, deadline=None)
@given(seconds, seconds, seconds, seconds, seconds, seconds)
def test_paired_all_to_alls_are_bounded_and_monotone(a2a, att_f, ffn_f, att_b, ffn_b, more):
    exposed = a2a_pair_exposure(a2a, att_f, ffn_f, att_b, ffn_b)
    assert 0.0 <= exposed <= 4 * a2a + 1e-12
    assert 4 * a2a - exposed <= att_f + ffn_f + att_b + ffn_b + 1e-12
    assert a2a_pair_exposure(a2a, att_f + more, ffn_f + more, att_b + more, ffn_b + more) <= exposed + 1e-12


def test_unpaired_share_of_passes():
    assert unpaired_fraction(1, 4) == pytest.approx(1 / 4)  # the first forward and the last backward
    assert unpaired_fraction(4, 64) == pytest.approx(7 / 64)  # plus the pipeline's warm-up and cool-down
    assert unpaired_fraction(8, 8) == 1.0
    assert all(unpaired_fraction(p, m + 1) <= unpaired_fraction(p, m) for p in (1, 2, 8) for m in range(1, 40))


def _time(model, train, layout, stack, gpus=8, **time):
    profile = resolve_profile("h100-80gb", stack)
    if time:
        profile = dataclasses.replace(profile, stack=profile.stack.with_overrides(time=time))
    topology = default_topology("h100-80gb", gpus)
    return estimate(model, train, layout, topology, profile=profile).time, profile, topology


def test_tp_overlap_under_megatron_hides_at_most_the_gemms():
    train, layout = TrainSpec(seq_len=8192, fp8_linears=True, zero_stage=1), Layout(tp=8)
    on, profile, topology = _time(LLAMA8, train, layout, "megatron")
    off, _, _ = _time(LLAMA8, train, layout, "megatron", tp_comm_overlap="none", tp_async_dgrad=False)
    assert off.hidden_comm_s_by_strategy == {}
    exposed_on, exposed_off = on.exposed_comm_s_by_strategy["tp"], off.exposed_comm_s_by_strategy["tp"]
    hidden = on.hidden_comm_s_by_strategy["tp"]
    assert 0 < exposed_on < exposed_off
    assert hidden + exposed_on == pytest.approx(exposed_off, rel=1e-9)  # the same traffic, split
    # Exposed: at least the first chunk of each collective (all-gathers in tp chunks, reduce-scatters in 4).
    assert exposed_on >= exposed_off / 8 - 1e-12
    ct = compute_time(LLAMA8, train, layout, topology, profile)
    assert hidden <= LLAMA8.num_layers * (ct.layer_gemm_forward + ct.layer_gemm_backward) + 1e-12
    assert on.step_s < off.step_s
    assert on.interference_s > off.interference_s  # the hidden transfers slow the GEMMs (16 SMs taken)
    assert sum(on.components.values()) == pytest.approx(on.step_s, rel=1e-9)


def test_tp_overlap_needs_sequence_parallelism_and_asynctp_needs_compile():
    layout = Layout(tp=4, dp_shard=2)
    plain = TrainSpec(seq_len=8192, tp_sequence_parallel=False, zero_stage=1)
    on, _, _ = _time(LLAMA8, plain, layout, "megatron", tp_async_dgrad=False)
    off, _, _ = _time(LLAMA8, plain, layout, "megatron", tp_comm_overlap="none", tp_async_dgrad=False)
    assert on.step_s == off.step_s and on.hidden_comm_s_by_strategy == {}
    assert "sequence parallelism" in on.efficiency_sources["tp_overlap"]

    eager, compiled = TrainSpec(seq_len=8192), TrainSpec(seq_len=8192, compiled=True)
    t_eager, _, _ = _time(LLAMA8, eager, layout, "torchtitan")
    t_eager_off, _, _ = _time(LLAMA8, eager, layout, "torchtitan", tp_comm_overlap="none")
    assert t_eager.step_s == t_eager_off.step_s
    assert "compile" in t_eager.efficiency_sources["tp_overlap"]
    t_compiled, _, _ = _time(LLAMA8, compiled, layout, "torchtitan")
    t_compiled_off, _, _ = _time(LLAMA8, compiled, layout, "torchtitan", tp_comm_overlap="none")
    assert t_compiled.step_s < t_compiled_off.step_s
    assert t_compiled.hidden_comm_s_by_strategy["tp"] > 0


@pytest.mark.parametrize("stack", ["sp-plan", "hf-fsdp2", "hf-deepspeed"])
def test_stacks_without_an_overlap_leave_communication_exposed(stack):
    time = prior_stack(stack).time
    assert time.tp_comm_overlap == "none" and not time.moe_a2a_overlap
    t, _, _ = _time(LLAMA8, TrainSpec(seq_len=8192, compiled=True), Layout(tp=4, dp_shard=2), stack)
    assert t.hidden_comm_s_by_strategy == {}
    assert set(stack_names()) >= {"sp-plan", "hf-fsdp2", "hf-deepspeed", "megatron-core", "torchtitan"}


def test_moe_all_to_all_overlap_needs_two_micro_batches_and_no_full_recompute():
    layout = Layout(dp_shard=8, ep=8)

    def run(**kw):
        train = TrainSpec(seq_len=4096, zero_stage=1, **{"checkpointing": "selective", **kw})
        on, profile, topology = _time(MOE, train, layout, "megatron")
        off, _, _ = _time(MOE, train, layout, "megatron", moe_a2a_overlap=False)
        return on, off, compute_time(MOE, train, layout, topology, profile)

    single, single_off, _ = run(grad_accum=1)
    assert single.step_s == single_off.step_s and "ep" not in single.hidden_comm_s_by_strategy
    full, full_off, _ = run(grad_accum=4, checkpointing="full")
    assert full.step_s == full_off.step_s and "full recompute" in full.efficiency_sources["ep_overlap"]

    previous = None
    for m in (2, 4, 16):
        on, off, ct = run(grad_accum=m)
        hidden, exposed = on.hidden_comm_s_by_strategy["ep"], on.exposed_comm_s_by_strategy["ep"]
        total = off.exposed_comm_s_by_strategy["ep"]
        assert hidden + exposed == pytest.approx(total, rel=1e-9)
        assert exposed >= total / m - 1e-12  # the first forward and the last backward run alone
        assert hidden <= m * MOE.num_layers * (ct.layer_forward + ct.layer_backward) + 1e-12
        assert on.step_s < off.step_s
        share = exposed / total
        if previous is not None:
            assert share <= previous + 1e-12  # more micro-batches in flight: a smaller unpaired share
        previous = share


def test_moe_all_to_all_overlap_under_pipeline_stages_needs_virtual_stages_and_the_search_stays_exact():
    """Megatron-Core asserts virtual stages for the overlap when pp > 1: one chunk runs the all-to-alls exposed.
    The planner's pipelined bound then takes the faster of one and two chunks, so the search stays exact."""
    from sp_plan.cost_models.strategies.overlap import a2a_overlap_blocker
    from sp_plan.planner.search import PlanSettings, brute_force_best, search

    stack = prior_stack("megatron-core").time
    layout = Layout(pp=2, ulysses=2, dp_shard=4, ep=8)
    one = TrainSpec(seq_len=8192, zero_stage=1, checkpointing="none", grad_accum=4, pipeline_schedule="1f1b")
    two = one.model_copy(update={"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2})
    assert "virtual stages" in a2a_overlap_blocker(stack, MOE, one, layout)
    assert a2a_overlap_blocker(stack, MOE, two, layout) is None
    model = MOE.model_copy(update={"num_layers": 8})
    topology = default_topology("h100-80gb", 16, 8)
    settings = PlanSettings(top_k=3, stack="megatron", fixed_layout={"pp": 2, "ep": 8},
                            global_batch_tokens=8192 * 32)
    best, _, options, _ = brute_force_best(model, TrainSpec(seq_len=8192), topology, settings)
    result = search(model, TrainSpec(seq_len=8192), topology, settings)
    assert best < float("inf") and result.plans[0].score == pytest.approx(best, rel=1e-12)
    assert options["virtual_stages"] > 1  # the overlap makes interleaving win here


def _explain(stack: str) -> str:
    """``sp-plan estimate --explain-time`` through the console script, for llama3-8b at 8K on 8 GPUs, tp 8."""
    run = subprocess.run([str(SP_PLAN), "estimate", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--tp",
                          "8", "--stack", stack, "--explain-time"], check=False, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_explain_time_shows_hidden_and_exposed_parts_and_their_origin():
    out = _explain("megatron")
    line = next(x for x in out.splitlines() if x.strip().startswith("tp communication:"))
    exposed, hidden = (float(v) for v in re.findall(r"([\d.]+) s (?:exposed|hidden)", line))
    assert 0 < exposed < hidden
    assert "userbuffers" in line and "stack file megatron-core" in line and "first chunk" in line
    row = next(x for x in out.splitlines() if "exposed communication: tp" in x)
    assert float(row.split()[3]) == pytest.approx(exposed, abs=1e-4)

    eager = _explain("torchtitan")
    assert "0.0000 s hidden" in eager and "AsyncTP needs torch.compile" in eager


def test_async_dgrad_hides_the_column_reductions_behind_their_weight_gradients():
    """Megatron / TE run each column-parallel linear's input-gradient all-reduce beside its weight-gradient GEMM
    (StackTime.tp_async_dgrad): the same traffic, split into what exceeds those GEMMs and what they hide."""
    layout = Layout(tp=4, dp_shard=2)
    plain = TrainSpec(seq_len=8192, tp_sequence_parallel=False, zero_stage=1)
    on, profile, topology = _time(LLAMA8, plain, layout, "megatron")
    off, _, _ = _time(LLAMA8, plain, layout, "megatron", tp_async_dgrad=False)
    hidden = on.hidden_comm_s_by_strategy["tp"]
    assert hidden > 0 and on.step_s < off.step_s
    assert on.exposed_comm_s_by_strategy["tp"] + hidden == pytest.approx(off.exposed_comm_s_by_strategy["tp"],
                                                                         rel=1e-9)
    ct = compute_time(LLAMA8, plain, layout, topology, profile)
    per_pass = LLAMA8.num_layers * plain.grad_accum
    assert hidden <= per_pass * sum(ct.layer_column_wgrad) + 1e-12  # never more than the GEMMs beside them
    assert on.interference_s > off.interference_s
    assert "tp_async_dgrad" in on.efficiency_sources["tp_overlap"]
    # forward-only work has no backward to overlap with
    prefill = TrainSpec(seq_len=8192, tp_sequence_parallel=False, mode="prefill")
    assert _time(LLAMA8, prefill, layout, "megatron")[0].hidden_comm_s_by_strategy == {}


def test_a_stack_that_saves_the_shard_gathers_the_input_again_in_backward():
    """Under sequence parallelism Megatron and TE save the column-parallel linears' input shard and all-gather it
    again for the weight gradient: exposed (without async dgrad) it costs the forward's input all-gathers once
    more per layer pass; a stack that saves the gathered input (DTensor) does not pay it."""
    layout = Layout(tp=8)
    sp = TrainSpec(seq_len=8192, tp_sequence_parallel=True, zero_stage=1)
    plain = {"tp_comm_overlap": "none", "tp_async_dgrad": False}
    shard, _, _ = _time(LLAMA8, sp, layout, "megatron", **plain)
    profile = resolve_profile("h100-80gb", "megatron")
    profile = dataclasses.replace(profile, stack=profile.stack.with_overrides(
        memory={"tp_saves_gathered_input": True}, time=plain))
    gathered = estimate(LLAMA8, sp, layout, default_topology("h100-80gb", 8), profile=profile).time
    extra = shard.exposed_comm_s_by_strategy["tp"] - gathered.exposed_comm_s_by_strategy["tp"]
    # forward per layer pass: two input all-gathers and two output reduce-scatters of X each, priced alike
    forward_gathers = gathered.breakdown["layer_forward_exposed_comm_s"] / 2
    assert extra == pytest.approx(LLAMA8.num_layers * sp.grad_accum * forward_gathers, rel=1e-6)
    assert shard.comm_s - gathered.comm_s == pytest.approx(extra, rel=1e-6)  # reported as TP communication
    # and as bytes: two all-gathers of X per layer backward, (tp - 1) / tp of X sent each
    comm = {name: estimate(LLAMA8, sp, layout, default_topology("h100-80gb", 8), profile=prof).comm
            for name, prof in (("shard", resolve_profile("h100-80gb", "megatron")), ("gathered", profile))}
    x_bytes = sp.micro_batch * sp.seq_len * LLAMA8.hidden_size * sp.dtype_bytes
    per_layer = comm["shard"].per_layer_bytes["tp"].backward - comm["gathered"].per_layer_bytes["tp"].backward
    assert per_layer == pytest.approx(2 * x_bytes * (layout.tp - 1) / layout.tp)
