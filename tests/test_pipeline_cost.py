"""Pipeline parallelism in the cost model: the schedule math (cost_models/pipeline.py), memory per stage,
the pipelined step, the point-to-point traffic, and layouts written before the pp degree existed."""

import math

import pytest
from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models import degrees as registry
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.gpu_spec import get_gpu_preset
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory import memory_core, memory_report
from sp_plan.cost_models.memory.states import model_states, tp_params
from sp_plan.cost_models.pipeline import (
    bubble_seconds,
    candidate_stages,
    check_pipeline,
    default_stage_layers,
    first_even_last_split,
    head_chunks,
    in_flight,
    p2p_bytes,
    stage_layers,
    stages,
)
from sp_plan.cost_models.topology import default_topology

MODEL = get_model_preset("llama3-8b")  # 32 layers
GPU = get_gpu_preset("h100-80gb")


# ----- schedule math -----------------------------------------------------------------------------------


def test_1f1b_stage_s_holds_min_p_minus_s_and_m_micro_batches():
    assert [in_flight("1f1b", 4, 8, 1, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, 1, s) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight("zero_bubble", 4, 8, 1, s) for s in range(4)] == [4, 3, 2, 1]  # ZB-H1: 1F1B's memory
    assert in_flight("1f1b", 1, 8, 1, 0) == 1


@pytest.mark.parametrize("p, v", [(4, 2), (8, 2), (8, 4), (16, 4)])
def test_interleaved_first_stage_holds_the_korthikanti_factor(p, v):
    """Stage 0 of the interleaved schedule holds p x (1 + (p-1)/(p v)) micro-batches of its layers
    (Korthikanti et al. 2022), given enough micro-batches to fill the warm-up."""
    assert in_flight("interleaved_1f1b", p, 4 * p, v, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    values = [in_flight("interleaved_1f1b", p, 4 * p, v, s) for s in range(p)]
    assert values == sorted(values, reverse=True) and values[-1] >= 1


def test_bubbles_of_the_three_schedules():
    p, t = 8, 1.0
    one = bubble_seconds("1f1b", p, 1, t, t, t)  # T_F = T_B(input) = T_W
    assert one == pytest.approx((p - 1) * 3 * t)
    assert bubble_seconds("interleaved_1f1b", p, 4, t, t, t) == pytest.approx(one / 4)
    zb = bubble_seconds("zero_bubble", p, 1, t, t, t)
    assert zb == pytest.approx((p - 1) * (t + t - t)) and zb == pytest.approx(one / 3)  # "about a third"
    assert bubble_seconds("zero_bubble", p, 1, 1.0, 0.1, 5.0) == 0.0  # W fills the bubble entirely
    assert bubble_seconds("1f1b", 1, 1, t, t, t) == 0.0


def test_default_split_balances_time_and_lightens_the_last_stage():
    split = default_stage_layers(126, 16, 1, 0.28)  # Llama 3 405B: the LM head ~0.28 of a layer
    assert sum(split) == 126 and len(split) == 16
    assert split[-1] == 7 and split[0] == 7 and max(split) == 8  # as Meta ran it: one layer fewer at both ends
    assert default_stage_layers(32, 4, 1, 0.0) == (8, 8, 8, 8)
    assert default_stage_layers(32, 4, 1, 1.5)[-1] < 8
    heavy = default_stage_layers(32, 4, 2, 3.0)
    assert min(heavy) >= 2 and sum(heavy) == 32  # every model chunk keeps a layer
    loads = [n + (3.0 if i == 3 else 0.0) for i, n in enumerate(heavy)]
    # no other split with at least 2 layers per stage has a lighter slowest stage
    best = min(max(a, b, c, d + 3.0) for a in range(2, 27) for b in range(2, 27) for c in range(2, 27)
               for d in [32 - a - b - c] if d >= 2)
    assert max(loads) == best


def test_the_embedding_and_the_loss_may_each_fill_a_model_chunk():
    """Llama 3's 405B layout ("The Llama 3 Herd of Models", section 3.3.2): 126 layers over 16 stages of 8 chunks,
    the first chunk of the first stage only the embedding, the last chunk of the last stage only the loss."""
    llama405 = get_model_preset("llama3-405b")
    interleaved = dict(seq_len=8192, grad_accum=16, pipeline_schedule="interleaved_1f1b", virtual_stages=8)
    train, layout = TrainSpec(**interleaved), Layout(pp=16, tp=8)
    check_pipeline(llama405, train, layout)
    assert stage_layers(llama405, train, layout) == (7, *[8] * 14, 7)
    assert default_stage_layers(127, 16, 8, 0.3) == (8, *[8] * 14, 7)  # one chunk short: the loss fills it
    assert default_stage_layers(126, 16, 4, 0.3)[0] >= 4  # enough layers: every chunk keeps one, as before
    with pytest.raises(CostModelError, match="use pp <= 16"):  # 17 x 8 = 136 > 126 + 2
        check_pipeline(llama405, train, Layout(pp=17))
    for bad in [(6, *[8] * 14, 8), (8, *[8] * 13, 7, 7)]:  # short by two on the first stage, or in the middle
        with pytest.raises(CostModelError, match="too few layers"):
            check_pipeline(llama405, TrainSpec(**interleaved, stage_layers=bad), layout)
    with pytest.raises(CostModelError, match="per model chunk but llama3-8b"):  # one chunk per stage keeps a layer
        check_pipeline(MODEL, TrainSpec(seq_len=4096, grad_accum=64), Layout(pp=33))
    assert [s.layers for s in stages(llama405, train, layout)][:2] == [7, 8]
    assert memory_report(llama405, train, layout, GPU).detail.assumptions  # memory prices the layout


def test_megatron_counts_the_embedding_and_the_loss_as_layers():
    """The splits Megatron-Core runs with account_for_embedding/loss_in_pipeline_split are of its form."""
    assert first_even_last_split(126, 8, 8, 0.3) == (15, *[16] * 6, 15)  # no multiple-of-8 split holds 126
    assert head_chunks((15, *[16] * 6, 15), 8) == (True, True)
    assert head_chunks((7, *[8] * 14, 7), 8) == (True, True)
    assert head_chunks((16, *[16] * 6, 15), 8) == (False, True)
    assert head_chunks((16, 16, 16), 8) is None and head_chunks((15, 16, 15), 1) is None
    assert head_chunks((14, 16, 16), 8) is None


def test_the_user_split_is_used_and_checked():
    layout = Layout(pp=4, dp_shard=2)
    train = TrainSpec(seq_len=4096, grad_accum=8, stage_layers=(6, 9, 9, 8))
    assert stage_layers(MODEL, train, layout) == (6, 9, 9, 8)
    assert [s.layers for s in stages(MODEL, train, layout)] == [6, 9, 9, 8]
    for bad, match in [((8, 8, 8), "lists 3 stages but pp=4"), ((8, 8, 8, 9), "sum to 33"),
                       ((1, 10, 11, 10), None)]:
        spec = TrainSpec(seq_len=4096, grad_accum=8, stage_layers=bad)
        if match is None:  # one layer is enough with one chunk per stage
            check_pipeline(MODEL, spec, layout)
            continue
        with pytest.raises(CostModelError, match=match):
            check_pipeline(MODEL, spec, layout)


def test_pipeline_errors_are_actionable():
    with pytest.raises(CostModelError, match="multiple of pp=4.*--grad-accum 8"):
        check_pipeline(MODEL, TrainSpec(seq_len=4096, grad_accum=6, pipeline_schedule="interleaved_1f1b",
                                        virtual_stages=2), Layout(pp=4))
    with pytest.raises(CostModelError, match="besides the embedding's and the loss's but llama3-8b has 32 layers; "
                                             "use pp <= 17"):
        check_pipeline(MODEL, TrainSpec(seq_len=4096, grad_accum=64, pipeline_schedule="interleaved_1f1b",
                                        virtual_stages=2), Layout(pp=32))
    # Too many chunks for any pp: the advice is fewer chunks, not "pp <= 0" (what it said before)
    with pytest.raises(CostModelError, match="32 layers; use at most 17 virtual stages with pp=2$"):
        check_pipeline(MODEL, TrainSpec(seq_len=4096, grad_accum=64, pipeline_schedule="interleaved_1f1b",
                                        virtual_stages=64), Layout(pp=2))
    with pytest.raises(CostModelError, match="use pp <= 4, or at most 4 virtual stages with pp=8$"):
        check_pipeline(MODEL, TrainSpec(seq_len=4096, grad_accum=64, pipeline_schedule="interleaved_1f1b",
                                        virtual_stages=8), Layout(pp=8))
    with pytest.raises(CostModelError, match="training only"):
        check_pipeline(MODEL, TrainSpec(seq_len=4096, mode="prefill"), Layout(pp=2))
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        TrainSpec(seq_len=4096, pipeline_schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match="needs pipeline_schedule interleaved_1f1b"):
        TrainSpec(seq_len=4096, virtual_stages=2)


def test_the_degree_is_registered_outermost_with_its_roles_and_check():
    pp = registry.degree("pp")
    assert pp.roles == {"stages", "weights"} and pp.search == "model" and pp.flag == "--pp"
    assert registry.mesh_dims()[0] == "pp"  # outside every data and model degree (torchtitan, Megatron)
    assert "stages" in registry.ROLES
    layout = Layout(pp=4, tp=2, ulysses=2, dp_shard=2)
    assert layout.world == 32 and layout.pipeline_stages == 4
    assert layout.dp == 2 and layout.shard_group == 4 and layout.data_ranks == 4  # pp holds different weights
    ctx = registry.SpaceContext(MODEL, 4096, 8)
    assert pp.check({"pp": 32, "tp": 1, "ulysses": 1, "ring": 1}, ctx) is None
    assert "at least one layer" in pp.check({"pp": 64, "tp": 1, "ulysses": 1, "ring": 1}, ctx)
    assert "training only" in pp.check({"pp": 2}, registry.SpaceContext(MODEL, 4096, 8, training=False))


def test_layouts_and_checkpoints_written_before_pp_still_load():
    from sp_plan.runtime.checkpoint.manager import _same_layout

    old = {"dp_replicate": 1, "dp_shard": 4, "ring": 1, "ulysses": 2, "tp": 1}  # no pp key
    assert Layout.model_validate(old) == Layout(dp_shard=4, ulysses=2) and Layout.model_validate(old).pp == 1
    assert Layout(dp_shard=4, ulysses=2).model_dump()["pp"] == 1
    assert _same_layout(old, Layout(dp_shard=4, ulysses=2))
    assert not _same_layout(old, Layout(pp=2, dp_shard=2, ulysses=2))
    assert not _same_layout({"not_a_degree": 2}, Layout()) and not _same_layout(None, Layout())


# ----- memory per stage --------------------------------------------------------------------------------


def _train(**kw):
    return TrainSpec(**{"seq_len": 8192, "grad_accum": 8, **kw})


def test_each_stage_holds_its_layers_and_the_ends_hold_embedding_and_head():
    layout = Layout(pp=4, dp_shard=2)
    train = _train(zero_stage=1)
    full = tp_params(MODEL, 1)
    a = memory_report(MODEL, train, layout, GPU).detail.assumptions
    from sp_plan.cost_models.memory import MemoryAssumptions

    assumptions = MemoryAssumptions(**a)
    for st in stages(MODEL, train, layout):
        params = model_states(MODEL, train, layout, assumptions, (st.layers, st.first, st.last)).params
        expected = st.layers * full.per_layer + (full.embedding if st.first else 0) + (full.head if st.last else 0)
        assert params.total == expected
    every = sum(model_states(MODEL, train, layout, assumptions, (s.layers, s.first, s.last)).params.total
                for s in stages(MODEL, train, layout))
    assert every == full.total  # the stages partition the model


def test_stage_zero_holds_the_most_activations_and_the_report_is_the_worst_stage():
    layout = Layout(pp=4, dp_shard=2)
    train = _train()
    report = memory_report(MODEL, train, layout, GPU)
    pipe = report.detail.pipeline
    assert pipe.stage_layers == [8, 8, 8, 8] or sum(pipe.stage_layers) == 32
    assert pipe.in_flight_microbatches == [4, 3, 2, 1]
    assert report.memory.total == max(pipe.stage_totals)
    assert pipe.stage_totals[pipe.stage] == report.memory.total
    # the activation term is largest on stage 0 (it stashes p micro-batches)
    from sp_plan.cost_models.memory.timeline import _memory_core

    a = memory_core(MODEL, train, layout).stage  # the evaluated worst stage
    assert a is not None
    from sp_plan.cost_models.memory import MemoryAssumptions

    cores = [_memory_core(MODEL, train, layout, MemoryAssumptions(), s) for s in stages(MODEL, train, layout)]
    acts = [max(p.activations for p in c.phases) for c in cores]
    assert acts[0] == max(acts) and acts[0] > acts[-1]
    # candidate_stages keeps the worst one
    cands = candidate_stages(stages(MODEL, train, layout))
    assert max(c.total for c in cores) == max(_memory_core(MODEL, train, layout, MemoryAssumptions(), s).total
                                              for s in cands)


@pytest.mark.parametrize("options", [
    {"checkpointing": "none"}, {"checkpointing": "selective"}, {"checkpointing": "full"},
    {"checkpointing": "full", "offload_checkpoints": True}, {"tiled_mlp": True, "tiled_loss": True},
    {"zero_stage": 1}, {"zero_stage": 2}, {"offload_optimizer": True},
])
@pytest.mark.parametrize("degrees", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}])
def test_in_flight_micro_batches_add_whole_stashes_under_every_option(options, degrees):
    """Stage 0 with p micro-batches in flight holds p - 1 more stashes (its layers' saved activations and
    its inputs) than with one micro-batch per step; the other phase terms do not change."""
    from sp_plan.cost_models.memory import MemoryAssumptions
    from sp_plan.cost_models.memory.timeline import _memory_core

    layout = Layout(pp=4, **degrees)
    many, one = _train(grad_accum=8, **options), _train(grad_accum=1, **options)
    a = MemoryAssumptions()
    s_many, s_one = stages(MODEL, many, layout)[0], stages(MODEL, one, layout)[0]
    assert (s_many.in_flight, s_one.in_flight) == (4, 1)
    c_many, c_one = _memory_core(MODEL, many, layout, a, s_many), _memory_core(MODEL, one, layout, a, s_one)
    block = c_one.block.saved["activation"] - c_one.offloaded_per_layer
    stash = 3 * (s_one.layers * block + c_one.inputs)
    fwd_many, fwd_one = c_many.phases[0], c_one.phases[0]
    assert fwd_many.activations - fwd_one.activations == stash
    assert fwd_many.weights == fwd_one.weights and fwd_many.optimizer == fwd_one.optimizer
    # each micro-batch's sequence is sharded: the per-layer stash shrinks with the SP degree
    if "ulysses" in degrees or "ring" in degrees:
        base = _memory_core(MODEL, one, Layout(pp=4), a, stages(MODEL, one, Layout(pp=4))[0])
        assert c_one.block.saved["activation"] < base.block.saved["activation"]


def test_zero3_under_pp_keeps_the_stage_gathered_for_the_step():
    """torch.distributed.pipelining + FSDP2 (torchtitan): no reshard between micro-batches and one gradient
    reduction after the last, so the stage's parameters stay gathered and its gradients unsharded."""
    layout = Layout(pp=2, dp_shard=4)
    train = _train(zero_stage=3)
    core = memory_core(MODEL, train, layout)
    st = core.states
    fwd = core.phases[0]
    assert fwd.zero3_gathered_params == st.params.total * st.per_param.weights
    assert fwd.unsharded_grads == st.params.total * st.per_param.gradients
    no_pp = memory_core(MODEL, train, Layout(dp_shard=4)).phases[0]
    assert no_pp.zero3_gathered_params < st.params.total * st.per_param.weights


# ----- time ------------------------------------------------------------------------------------------


def _estimate(layout, **kw):
    train = _train(**kw)
    return estimate(MODEL, train, layout, default_topology("h100-80gb", layout.world, 8), with_placement=False)


def test_the_pipelined_step_is_the_slowest_stage_times_m_plus_the_bubble():
    layout = Layout(pp=4, dp_shard=2)
    one = _estimate(layout, grad_accum=8)
    b = one.time.breakdown
    t_f, t_b, t_w = b["pipeline_stage_forward_s"], b["pipeline_stage_backward_s"], b["pipeline_stage_weight_grad_s"]
    assert b["pipeline_bubble_s"] == pytest.approx(3 * (t_f + t_b))
    assert one.time.step_s >= 8 * (t_f + t_b) + b["pipeline_bubble_s"]
    zb = _estimate(layout, grad_accum=8, pipeline_schedule="zero_bubble")
    assert zb.time.breakdown["pipeline_bubble_s"] == pytest.approx(3 * (t_f + t_b - 2 * t_w))
    assert zb.time.step_s < one.time.step_s and zb.memory.total == one.memory.total
    inter = _estimate(layout, grad_accum=8, pipeline_schedule="interleaved_1f1b", virtual_stages=2)
    bi = inter.time.breakdown
    assert bi["pipeline_bubble_s"] == pytest.approx(3 * (bi["pipeline_stage_forward_s"]
                                                         + bi["pipeline_stage_backward_s"]) / 2)
    assert inter.memory.total > one.memory.total  # stage 0 holds p + (p-1)/v micro-batches
    for e in (one, zb, inter):
        assert sum(e.time.components.values()) == pytest.approx(e.time.step_s, rel=1e-9)
        assert e.time.exposed_comm_s >= 0


def test_mfu_counts_the_model_once_and_more_micro_batches_shrink_the_bubble():
    pp, flat = _estimate(Layout(pp=2, dp_shard=4)), _estimate(Layout(dp_shard=8))
    assert pp.time.model_flops_per_step == pytest.approx(flat.time.model_flops_per_step / 2)  # half the dp
    assert pp.time.tokens_per_step == flat.time.tokens_per_step / 2
    few, many = _estimate(Layout(pp=4, dp_shard=2), grad_accum=4), _estimate(Layout(pp=4, dp_shard=2), grad_accum=32)
    bubble_share = [e.time.breakdown["pipeline_bubble_s"] / e.time.step_s for e in (few, many)]
    assert bubble_share[1] < bubble_share[0]


def test_p2p_traffic_is_one_activation_each_way_per_micro_batch_and_chunk():
    layout = Layout(pp=4, ulysses=2)
    for kw, hops in [({}, 1), ({"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}, 2)]:
        e = _estimate(layout, grad_accum=8, **kw)
        per = 8192 / 2 * MODEL.hidden_size * 2  # micro_batch x seq/sp x hidden x bf16
        assert p2p_bytes(MODEL, _train(**kw), layout) == per
        assert e.comm.per_step_by_strategy["pipeline"] == pytest.approx(2 * 8 * hops * per)
        assert e.time.comm_s_by_strategy["pipeline"] > 0
    tp = Layout(pp=4, tp=2)
    assert p2p_bytes(MODEL, _train(), tp) == 8192 / 2 * MODEL.hidden_size * 2  # sequence-parallel TP shards it
    assert _estimate(Layout(dp_shard=8)).comm.per_step_by_strategy["pipeline"] == 0


def test_pp_groups_cross_nodes_and_tp_stays_inside():
    from sp_plan.cost_models.placement import place

    layout = Layout(pp=4, tp=8, ulysses=2)  # 64 GPUs, 8 per node
    placement = place(layout, default_topology("h100-80gb", 64, 8))
    assert placement.groups["pp"].link_class == "fabric" and placement.groups["pp"].nodes_spanned == 4
    assert placement.groups["tp"].nodes_spanned == 1
    assert placement.groups["pp"].stride == 16


def test_meta_405b_layout_is_estimated():
    model = get_model_preset("llama3-405b")
    train = TrainSpec(seq_len=131072, grad_accum=16)
    layout = Layout(pp=16, tp=8, ring=16, dp_shard=8)
    e = estimate(model, train, layout, default_topology("h100-80gb", 16384, 8), with_placement=False)
    assert e.fits and e.detail.pipeline.stage_layers[0] == 7 and e.detail.pipeline.stage_layers[-1] == 7
    assert 0 < e.time.mfu < 1 and math.isfinite(e.time.step_s)


def test_the_step_adds_up_with_the_bubble():
    e = _estimate(Layout(pp=4, dp_shard=2), grad_accum=8, pipeline_schedule="zero_bubble")
    t = e.time
    assert t.pipeline_bubble_s == t.breakdown["pipeline_bubble_s"] > 0
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.optimizer_s + t.offload_s + t.interference_s
                                     + t.overhead_s + t.pipeline_bubble_s, rel=1e-9)
    assert _estimate(Layout(dp_shard=8)).time.pipeline_bubble_s == 0.0


def test_the_runtime_executes_pp_but_plans_it_only_when_pinned():
    """Runtime PP (issue 19 item 3, sp_plan.runtime.pipeline) runs a subset of pipelined plans: the runtime's own
    planning keeps pp at 1 unless the user pins it (tests/test_pipeline_runtime.py covers the rest)."""
    from sp_plan.runtime.capabilities import merge_constraints, runtime_unexecuted_degrees
    from sp_plan.runtime.planning import UNPINNED_DEFAULTS

    assert "pp" not in runtime_unexecuted_degrees()
    assert UNPINNED_DEFAULTS["pp"] == 1 and "pp" not in merge_constraints({}, {}, "llama")[0]
    assert merge_constraints({"pp": 2}, {}, "llama")[0]["pp"] == 2


def test_fsdp_under_pp_gathers_and_reduces_once_per_step_for_the_stage():
    layout = Layout(pp=4, dp_shard=2)
    few, many = _estimate(layout, grad_accum=4, zero_stage=3), _estimate(layout, grad_accum=16, zero_stage=3)
    assert few.comm.per_step_by_strategy["fsdp"] == pytest.approx(many.comm.per_step_by_strategy["fsdp"])
    assert few.comm.per_layer_by_collective["all_gather"].backward == 0  # no re-gather between micro-batches
    flat = _estimate(Layout(pp=1, dp_shard=8), grad_accum=4, zero_stage=3)  # without PP: per micro-batch
    assert flat.comm.per_layer_by_collective["all_gather"].backward > 0
    assert few.time.breakdown["pipeline_fsdp_once_s"] > 0
