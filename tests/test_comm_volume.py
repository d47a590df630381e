"""Bytes sent per GPU per layer and per step, against hand computations from the shared conventions.

Expected values are written out from BRIEF.md's conventions (not from the module's helpers), so the
runtime's byte counters and these numbers can be compared exactly.
"""

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.comm_volume import comm_estimate, comm_ops

LLAMA70 = get_model_preset("llama3-70b")
LLAMA8 = get_model_preset("llama3-8b")


def per_layer(model, train, layout, strategy):
    return comm_estimate(model, train, layout).per_layer_bytes[strategy]


# ----- DESIGN.md section 4 reference facts -----------------------------------------------------------


def test_reference_ulysses_vs_tp_llama70b_1m_tokens_prefill():
    train = TrainSpec(seq_len=1_000_000, mode="prefill", zero_stage=0)
    ulysses = per_layer(LLAMA70, train, Layout(ulysses=8), "ulysses")
    q = 125_000 * 8192 * 2  # 2.048 GB per GPU before the all-to-all
    kv = 125_000 * 8 * 128 * 2  # 0.256 GB each
    assert q == 2_048_000_000 and kv == 256_000_000
    assert ulysses.forward == pytest.approx((2 * q + 2 * kv) * 7 / 8)
    assert ulysses.forward == pytest.approx(4.032e9)
    assert "backward" not in ulysses.model_dump()  # prefill: forward only
    for sp in (True, False):
        tp_train = train.model_copy(update={"tp_sequence_parallel": sp})
        tp = per_layer(LLAMA70, tp_train, Layout(tp=8), "tp")
        assert tp.forward == pytest.approx(2 * 2 * 7 / 8 * 1_000_000 * 8192 * 2)  # 57.344 GB
        assert tp.forward / ulysses.forward == pytest.approx(14.2, abs=0.05)


# ----- Ulysses -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt, extra_q, extra_kv", [("none", 0, 0), ("selective", 1, 2), ("full", 2, 2)])
def test_ulysses_training_and_recompute(ckpt, extra_q, extra_kv):
    s = 128 * 1024
    train = TrainSpec(seq_len=s, checkpointing=ckpt, zero_stage=0)
    layer = per_layer(LLAMA70, train, Layout(ulysses=8), "ulysses")
    tokens = s // 8
    q = tokens * 64 * 128 * 2
    kv = tokens * 8 * 128 * 2
    fwd = 7 / 8 * (2 * q + 2 * kv)
    assert layer.forward == pytest.approx(fwd)
    recompute = 7 / 8 * (extra_q * q + extra_kv * kv)
    assert layer.backward_recompute == pytest.approx(recompute)
    assert layer.backward == pytest.approx(fwd + recompute)  # dO, dQ, dK, dV mirror the forward


@pytest.mark.parametrize(
    "model, layout, kv_heads_in_buffer",
    [
        (LLAMA70, Layout(ulysses=16), 16),  # 8 KV heads replicated x2 before the all-to-all
        (LLAMA70, Layout(ulysses=4), 8),  # no replication
        (LLAMA70, Layout(tp=2, ulysses=8), 8),  # head split 16: rep 2, tp keeps 8*2/2 heads locally
        (get_model_preset("starcoder-15b"), Layout(ulysses=8), 8),  # MQA: the single KV head x8
    ],
)
def test_ulysses_kv_replication_buffers(model, layout, kv_heads_in_buffer):
    s = 64 * 1024
    train = TrainSpec(seq_len=s, mode="prefill", zero_stage=0)
    ops = [o for o in comm_ops(model, train, layout) if o.strategy == "ulysses"]
    tokens = s / layout.sp
    kv_op = next(o for o in ops if o.label == "K + V")
    q_op = next(o for o in ops if o.label == "Q + output")
    assert kv_op.nbytes == tokens * kv_heads_in_buffer * model.head_dim * 2
    assert q_op.nbytes == tokens * model.num_heads / layout.tp * model.head_dim * 2
    assert kv_op.count == q_op.count == 2


# ----- Ring and USP -------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_ring_forward_and_backward(ckpt):
    s, r = 64 * 1024, 4
    train = TrainSpec(seq_len=s, checkpointing=ckpt, zero_stage=0)
    layer = per_layer(LLAMA8, train, Layout(ring=r), "ring")
    block = s / r * 8 * 128  # local tokens x KV heads x head_dim
    fwd = (r - 1) * 2 * block * 2  # K and V, bf16, R-1 steps
    bwd = (r - 1) * 2 * block * 2 + r * 2 * block * 4  # K, V again + fp32 dK, dV R times
    again = fwd if ckpt == "full" else 0.0  # the ring pass is inside the attention op
    assert layer.forward == pytest.approx(fwd)
    assert layer.backward == pytest.approx(bwd + again)
    assert layer.backward_recompute == pytest.approx(again)


def test_usp_ulysses_inside_ring_outside():
    s = 64 * 1024
    train = TrainSpec(seq_len=s, checkpointing="selective", zero_stage=0)
    est = comm_estimate(LLAMA8, train, Layout(ulysses=4, ring=2))
    tokens = s / 8
    q, kv = tokens * 32 * 128 * 2, tokens * 8 * 128 * 2
    assert est.per_layer_bytes["ulysses"].forward == pytest.approx(3 / 4 * (2 * q + 2 * kv))
    ring_block = s / 2 * (8 / 4) * 128  # the ring-local sequence, the Ulysses rank's 2 KV heads
    assert est.per_layer_bytes["ring"].forward == pytest.approx(1 * 2 * ring_block * 2)
    assert est.per_layer_bytes["ring"].backward == pytest.approx(2 * ring_block * 2 + 2 * 2 * ring_block * 4)
    assert est.per_layer_bytes["tp"].forward == 0
    assert est.group_sizes["sp"] == 8 and est.group_sizes["ulysses"] == 4


# ----- tensor parallel ---------------------------------------------------------------------------


@pytest.mark.parametrize("sp, ckpt, recompute_collectives", [
    # Full checkpointing repeats the same TP collectives as selective: the block's last one (the MLP
    # output's reduce-scatter / all-reduce) is never re-run (checkpoint early stop; measured in test_tp).
    (True, "selective", 3), (True, "full", 3), (True, "none", 0),
    (False, "selective", 1), (False, "full", 1), (False, "none", 0),
])
def test_tp_megatron_and_sequence_parallel(sp, ckpt, recompute_collectives):
    s = 32 * 1024
    train = TrainSpec(seq_len=s, checkpointing=ckpt, tp_sequence_parallel=sp, zero_stage=0)
    layer = per_layer(LLAMA8, train, Layout(tp=4), "tp")
    x = s * 4096 * 2
    per_collective = (3 / 4 if sp else 2 * 3 / 4) * x  # AG/RS vs all-reduce
    n = 4 if sp else 2
    assert layer.forward == pytest.approx(n * per_collective)
    assert layer.backward_recompute == pytest.approx(recompute_collectives * per_collective)
    assert layer.backward == pytest.approx(n * per_collective + recompute_collectives * per_collective)
    by = comm_estimate(LLAMA8, train, Layout(tp=4)).per_layer_by_collective
    if sp:
        assert by["all_reduce"].forward == 0 and by["all_gather"].forward == by["reduce_scatter"].forward
    else:
        assert by["all_gather"].forward == 0


# ----- data parallel / ZeRO / FSDP ---------------------------------------------------------------


def test_zero3_fsdp_regathers_in_backward():
    train = TrainSpec(seq_len=4096, zero_stage=3, grad_accum=2)
    est = comm_estimate(LLAMA8, train, Layout(dp_shard=8))
    w = LLAMA8.params_per_layer() * 2  # bf16 parameters
    g = LLAMA8.params_per_layer() * 4  # fp32 gradients (FSDP2 reduce dtype)
    assert est.per_layer_bytes["fsdp"].forward == pytest.approx(7 / 8 * w)
    assert est.per_layer_bytes["fsdp"].backward == pytest.approx(7 / 8 * (w + g))  # re-gather + reduce-scatter
    params_other = LLAMA8.embedding_params() + LLAMA8.lm_head_params() + LLAMA8.norm_params()
    embedding = LLAMA8.embedding_params() * 2  # re-gathered for its gradient; the head stays gathered
    per_micro = 32 * 7 / 8 * (2 * w + g) + 7 / 8 * (params_other * 2 + embedding + params_other * 4)
    per_step = 2 * per_micro  # every micro-batch
    assert est.per_step_by_strategy["fsdp"] == pytest.approx(per_step)
    assert est.per_step_by_strategy["dp"] == 0


def test_ddp_all_reduce_once_per_step():
    train = TrainSpec(seq_len=4096, zero_stage=0, grad_accum=4)
    est = comm_estimate(LLAMA8, train, Layout(dp_shard=8))
    w = LLAMA8.params_per_layer() * 2
    assert est.per_layer_bytes["dp"].backward == pytest.approx(2 * 7 / 8 * w)
    assert est.per_step_by_strategy["dp"] == pytest.approx(2 * 7 / 8 * LLAMA8.num_params * 2)  # not x4


def test_hsdp_reduce_scatter_then_all_reduce_across_replicas():
    train = TrainSpec(seq_len=4096, zero_stage=3)
    est = comm_estimate(LLAMA8, train, Layout(dp_replicate=2, dp_shard=4))
    w = LLAMA8.params_per_layer() * 2
    g = LLAMA8.params_per_layer() * 4  # fp32 gradient shards are all-reduced across replicas
    assert est.per_layer_bytes["fsdp"].forward == pytest.approx(3 / 4 * w)
    assert est.per_layer_bytes["dp"].backward == pytest.approx(2 * 1 / 2 * g / 4)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_reduce_scatter_and_parameter_all_gather(stage):
    train = TrainSpec(seq_len=4096, zero_stage=stage, grad_accum=3)
    est = comm_estimate(LLAMA8, train, Layout(dp_shard=8))
    params = LLAMA8.num_params * 2  # updated bf16 parameters, gathered once per step
    grads = LLAMA8.num_params * 4  # fp32 gradients (FSDP2 reduce dtype)
    rs_times = 1 if stage == 1 else 3  # ZeRO-2 reduces every micro-batch
    assert est.per_layer_bytes["fsdp"].forward == 0
    assert est.per_step_by_strategy["fsdp"] == pytest.approx(7 / 8 * (grads * rs_times + params))


def test_sequence_parallel_ranks_share_the_fsdp_shard_group():
    train = TrainSpec(seq_len=65536, zero_stage=3)
    est = comm_estimate(LLAMA8, train, Layout(ulysses=4, dp_shard=2))
    w = LLAMA8.params_per_layer() * 2
    assert est.group_sizes["shard"] == 8
    assert est.per_layer_bytes["fsdp"].forward == pytest.approx(7 / 8 * w)


# ----- totals and JSON shape -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", [Layout(tp=2, ulysses=2, ring=2, dp_shard=2), Layout(ulysses=8, dp_replicate=2)])
def test_totals_are_consistent(layout):
    train = TrainSpec(seq_len=64 * 1024, grad_accum=2, checkpointing="full")
    est = comm_estimate(LLAMA8, train, layout)
    assert sum(est.by_collective.values()) == pytest.approx(est.per_step_bytes)
    assert sum(est.per_step_by_strategy.values()) == pytest.approx(est.per_step_bytes)
    for key in ("ulysses", "ring"):
        per = est.per_layer_bytes[key]
        assert est.per_step_by_strategy[key] == pytest.approx((per.forward + per.backward) * 32 * 2)
    data = est.model_dump(mode="json")
    assert set(data["per_layer_bytes"]) == {"dp", "fsdp", "tp", "ulysses", "ring", "ep"}
    assert set(data["by_collective"]) == {"all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert set(data["per_layer_bytes"]["ulysses"]) == {"forward", "backward", "backward_recompute"}


def test_single_gpu_sends_nothing():
    est = comm_estimate(LLAMA8, TrainSpec(seq_len=4096), Layout())
    assert est.per_step_bytes == 0
