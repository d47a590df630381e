"""Model states (TP split, ZeRO 0-3, offload), NCCL communicators and overheads."""

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_gpu_preset, get_model_preset, model_preset_names
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.memory import MemoryAssumptions, memory_report
from sp_plan.cost_models.memory.dims import ceil_div
from sp_plan.cost_models.memory.overhead import process_groups
from sp_plan.cost_models.memory.states import bytes_per_param, model_states, tp_params

H100 = get_gpu_preset("h100-80gb")


@pytest.mark.parametrize("name", model_preset_names())
def test_tp1_params_equal_model_count(name):
    model = get_model_preset(name)
    assert tp_params(model, 1).total == model.num_params


def test_tp_splits_blocks_and_vocab_replicates_norms():
    m = get_model_preset("llama3-70b")
    p8 = tp_params(m, 8)
    h = m.hidden_size
    assert p8.embedding == ceil_div(m.vocab_size, 8) * h  # vocab-parallel embedding
    assert p8.head == ceil_div(m.vocab_size, 8) * h + h  # vocab-parallel lm_head + replicated final norm
    assert p8.output_matrix == ceil_div(m.vocab_size, 8) * h
    # Blocks: every matrix / 8, both norms replicated.
    assert p8.per_layer == (m.params_per_layer() - 2 * h) // 8 + 2 * h
    # KV projections are replicated once tp exceeds the KV heads: 1 KV head per rank at tp=16.
    p16 = tp_params(m, 16)
    q = m.q_size // 16
    assert p16.per_layer == 2 * h * q + 2 * h * 128 + 3 * h * (m.ffn_hidden_size // 16) + 2 * h


@pytest.mark.parametrize("dtype, optimizer, expected", [
    ("bf16", "adamw", (2, 2, 12)), ("fp32", "adamw", (4, 4, 8)), ("bf16", "adamw_bf16", (2, 2, 4)),
])
def test_bytes_per_param(dtype, optimizer, expected):
    per = bytes_per_param(TrainSpec(seq_len=1024, dtype=dtype, optimizer=optimizer))
    assert (per.weights, per.gradients, per.optimizer) == expected


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_shard_over_dp_shard_ulysses_ring(stage):
    model = get_model_preset("llama3-8b")
    layout = Layout(dp_shard=2, ulysses=2, ring=2)  # shard group 8
    train = TrainSpec(seq_len=8192, zero_stage=stage)
    st = model_states(model, train, layout, MemoryAssumptions())
    P = model.num_params
    assert st.shard_group == 8
    assert st.weights_device == (-(-2 * P // 8) if stage == 3 else 2 * P)
    assert st.grads_device(P) == (-(-2 * P // 8) if stage >= 2 else 2 * P)
    assert st.optimizer_device == (-(-12 * P // 8) if stage >= 1 else 12 * P)
    opt = estimate(model, train, layout, H100).detail.phases["optimizer step"]
    assert opt.weights == st.weights_device and opt.gradients == st.grads_device(P)
    assert opt.optimizer == st.optimizer_device + 4 * st.optimizer_step_params  # + foreach AdamW temporaries


def test_offload_optimizer_moves_states_to_host():
    model = get_model_preset("llama3-8b")
    P = model.num_params
    e = estimate(model, TrainSpec(seq_len=8192, offload_optimizer=True), Layout(dp_shard=8), H100)
    assert e.memory.optimizer == 0
    assert e.host_memory.optimizer == -(-12 * P // 8)
    assert e.host_memory.gradients == 4 * (-(-P // 8))  # fp32 gradient shard for the CPU step
    assert e.detail.phases["optimizer step"].optimizer == 0  # no device step temporaries either
    assert e.host_memory.total == e.host_memory.optimizer + e.host_memory.gradients


def test_offload_params_follows_fsdp2_cpu_offload_policy():
    model = get_model_preset("llama3-8b")
    P = model.num_params
    e = estimate(model, TrainSpec(seq_len=8192, offload_params=True), Layout(dp_shard=8), H100)
    phases = e.detail.phases
    assert all(p.weights == 0 and p.gradients == 0 and p.optimizer == 0 for p in phases.values())
    # One fp32 shard is both parameter and master copy (16 B/param on the host with the gradients).
    assert e.host_memory.weights == -(-4 * P // 8)
    assert e.host_memory.optimizer == -(-8 * P // 8)
    assert e.host_memory.gradients == 4 * (-(-P // 8))
    # Gathered blocks and unsharded gradients still live on the device.
    per_layer = tp_params(model, 1).per_layer
    assert phases["backward (last block)"].buffers >= 2 * per_layer * 2 + 2 * per_layer * 2
    # Without the FSDP2 coupling only the parameters move.
    a = MemoryAssumptions(offload_params_moves_grads_and_optimizer=False)
    r = memory_report(model, TrainSpec(seq_len=8192, offload_params=True), Layout(dp_shard=8), H100, a)
    assert r.memory.optimizer > 0 and r.host_memory.optimizer == 0


def test_offload_checkpoints_moves_block_inputs():
    model = get_model_preset("llama3-8b")
    layout = Layout(ulysses=8)
    base = estimate(model, TrainSpec(seq_len=65536, checkpointing="full"), layout, H100)
    off = estimate(model, TrainSpec(seq_len=65536, checkpointing="full", offload_checkpoints=True), layout, H100)
    x_in = 65536 // 8 * model.hidden_size * 2
    assert off.host_memory.checkpoints == model.num_layers * x_in
    assert off.detail.per_layer.saved_bytes == base.detail.per_layer.saved_bytes - x_in == 0
    assert off.detail.per_layer.offloaded_bytes == x_in
    fwd_saving = base.detail.phases["forward"].activations - off.detail.phases["forward"].activations
    assert fwd_saving == (model.num_layers - 1) * x_in - x_in  # minus the one block in flight


def test_grad_accumulation_keeps_gradients_through_forward():
    model = get_model_preset("llama3-8b")
    one = estimate(model, TrainSpec(seq_len=8192, grad_accum=1), Layout(dp_shard=8), H100)
    many = estimate(model, TrainSpec(seq_len=8192, grad_accum=4), Layout(dp_shard=8), H100)
    assert one.detail.phases["forward"].gradients == 0
    assert many.detail.phases["forward"].gradients == -(-2 * model.num_params // 8)


@pytest.mark.parametrize("degrees, names", [
    (dict(ulysses=8), ["ulysses"]),
    (dict(dp_shard=2, ulysses=4), ["dp_shard", "ulysses", "fsdp_shard"]),
    (dict(dp_replicate=2, dp_shard=2, ring=2, ulysses=2, tp=2),
     ["dp_replicate", "dp_shard", "ring", "ulysses", "tp", "fsdp_shard", "sequence_parallel", "world"]),
    (dict(tp=8), ["tp"]),
    (dict(), []),
])
def test_process_groups_deduplicated_by_ranks(degrees, names):
    assert [g.name for g in process_groups(Layout(**degrees))] == names


def test_overhead_parameters_change_the_total():
    model = get_model_preset("llama3-8b")
    layout = Layout(dp_shard=2, ulysses=4)
    train = TrainSpec(seq_len=32768)
    base = memory_report(model, train, layout, H100)
    big = memory_report(model, train, layout, H100, MemoryAssumptions(nccl_bytes_per_communicator=2 << 30,
                                                                      cuda_context_bytes=1 << 30,
                                                                      fragmentation_fraction=0.25))
    o = big.detail.overhead
    assert o.nccl == 3 * (2 << 30) and o.cuda_context == 1 << 30
    assert o.fragmentation == round(0.25 * big.memory.peak_allocated)
    assert big.memory.peak_allocated == base.memory.peak_allocated
    assert big.memory.total == big.memory.peak_allocated + o.nccl + o.cuda_context + o.fragmentation
    assert o.peak_reserved == big.memory.peak_allocated + o.fragmentation


def test_assumptions_reject_bad_values():
    with pytest.raises(ValueError):
        MemoryAssumptions(fragmentation_fraction=-0.1)
    with pytest.raises(ValueError):
        MemoryAssumptions(not_a_field=1)
    assert all(MemoryAssumptions().describe().values())  # every assumption is documented


def test_tied_embeddings_gather_the_embedding_for_the_loss():
    model = get_model_preset("qwen3-4b")  # tied
    p = tp_params(model, 2)
    vocab_matrix = ceil_div(model.vocab_size, 2) * model.hidden_size
    assert p.lm_head == 0 and p.output_matrix == vocab_matrix and p.head == model.hidden_size
    e = estimate(model, TrainSpec(seq_len=16384, zero_stage=3), Layout(tp=2, dp_shard=4), H100)
    layer = tp_params(model, 2).per_layer * 2
    assert e.detail.phases["loss"].buffers >= vocab_matrix * 2 + layer  # gathered embedding + prefetched block
