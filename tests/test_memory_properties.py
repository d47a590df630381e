"""Property-style sanity of the memory model over random models, sequences and layouts, plus the
parallelism-specific tensors (Ulysses output all-to-all, KV replication, TP sequence parallelism, ring)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_plan.cost_models import Layout, TrainSpec, get_gpu_preset, get_model_preset
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.memory import MemoryAssumptions, memory_report

H100 = get_gpu_preset("h100-80gb")
LLAMAS = ["llama2-7b", "llama3-8b", "llama3-70b", "qwen3-4b", "mistral-7b", "qwen2.5-7b"]
FAST = settings(max_examples=40, deadline=None)


def _degree_pairs(model):
    """(tp, ulysses) pairs that split the heads (KV replication allowed)."""
    pairs = []
    for tp in (1, 2, 4):
        for u in (1, 2, 4, 8):
            split = tp * u
            if model.num_heads % split == 0 and (model.num_kv_heads % split == 0 or split % model.num_kv_heads == 0):
                pairs.append((tp, u))
    return pairs


@st.composite
def scenarios(draw):
    model = get_model_preset(draw(st.sampled_from(LLAMAS)))
    tp, u = draw(st.sampled_from(_degree_pairs(model)))
    ring = draw(st.sampled_from([1, 2]))
    dp_shard = draw(st.sampled_from([1, 2, 4]))
    layout = Layout(tp=tp, ulysses=u, ring=ring, dp_shard=dp_shard)
    seq = layout.seq_multiple() * draw(st.integers(1, 64)) * 64
    train = dict(
        seq_len=seq,
        micro_batch=draw(st.sampled_from([1, 2])),
        zero_stage=draw(st.integers(0, 3)),
        tiled_mlp=draw(st.booleans()),
        tiled_loss=draw(st.booleans()),
        mode=draw(st.sampled_from(["train", "train", "prefill"])),
    )
    return model, layout, train


@FAST
@given(scenarios())
def test_components_add_up(scenario):
    model, layout, train = scenario
    e = estimate(model, TrainSpec(**train), layout, H100)
    m = e.memory
    parts = m.weights + m.gradients + m.optimizer + m.activations + m.logits + m.kv_cache + m.buffers
    assert m.peak_allocated == parts == max(p.allocated for p in e.detail.phases.values())
    assert m.total == m.peak_allocated + m.overhead
    assert e.fits == (m.total <= m.capacity)
    assert min(m.model_dump().values()) >= 0
    assert e.host_memory.total == (e.host_memory.weights + e.host_memory.gradients + e.host_memory.optimizer
                                   + e.host_memory.checkpoints)


@FAST
@given(scenarios())
def test_checkpointing_order_full_le_selective_le_none(scenario):
    model, layout, train = scenario
    train = {**train, "mode": "train"}
    saved = {}
    peaks = {}
    for mode in ("none", "selective", "full"):
        e = estimate(model, TrainSpec(**train, checkpointing=mode), layout, H100)
        saved[mode] = e.detail.per_layer.saved_bytes
        peaks[mode] = e.memory.peak_allocated
    assert saved["full"] <= saved["selective"] <= saved["none"]
    assert peaks["full"] <= peaks["selective"] <= peaks["none"]


@FAST
@given(scenarios())
def test_more_sharding_never_increases_model_states(scenario):
    model, layout, train = scenario
    train = {**train, "mode": "train"}

    def states(layout, stage):
        r = memory_report(model, TrainSpec(**{**train, "zero_stage": stage}), layout, H100)
        opt = r.detail.phases["optimizer step"]
        return opt.weights, opt.gradients, opt.optimizer

    wider = layout.model_copy(update={"dp_shard": layout.dp_shard * 2})
    for stage in range(4):
        assert all(a <= b for a, b in zip(states(wider, stage), states(layout, stage)))
    by_stage = [states(layout, stage) for stage in range(4)]
    for lower, higher in zip(by_stage, by_stage[1:]):
        assert all(h <= l for h, l in zip(higher, lower))


@FAST
@given(scenarios())
def test_more_sequence_parallelism_never_increases_activations(scenario):
    model, layout, train = scenario
    train = {**train, "mode": "train"}
    ring2 = layout.model_copy(update={"ring": layout.ring * 2})
    if train["seq_len"] % ring2.seq_multiple():
        train["seq_len"] *= 2
    base = estimate(model, TrainSpec(**train), layout, H100)
    more = estimate(model, TrainSpec(**train), ring2, H100)
    assert more.detail.per_layer.saved_bytes <= base.detail.per_layer.saved_bytes
    # Phase by phase (the peak phase itself may move: fewer states per GPU can make backward the peak).
    for name, phase in base.detail.phases.items():
        assert more.detail.phases[name].activations <= phase.activations


@pytest.mark.parametrize("seq", ["32K", "128K", "1M"])
def test_tiled_loss_beats_hf_logits_at_long_sequences(seq):
    model = get_model_preset("llama3-8b")
    layout = Layout(ulysses=8)
    plain = estimate(model, TrainSpec(seq_len=seq), layout, H100).detail.phases["loss"]
    tiled = estimate(model, TrainSpec(seq_len=seq, tiled_loss=True), layout, H100).detail.phases["loss"]
    assert tiled.logits < plain.logits / 2
    # HF: at the log-softmax backward the bf16 logits, the fp32 log-softmax, its gradient and the gradient
    # it produces are live at once: 14 B per logit.
    tokens = TrainSpec(seq_len=seq).seq_len // 8
    assert plain.logits == tokens * model.vocab_size * 14


# ----- parallelism-specific tensors -----------------------------------------------------------------------


def per_layer(model, layout, seq, mode, **assumptions):
    train = TrainSpec(seq_len=seq, checkpointing=mode)
    return memory_report(model, train, layout, H100, MemoryAssumptions(**assumptions)).detail.per_layer


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_ulysses_saves_the_output_alltoall_result(mode):
    """Same tokens per GPU; Ulysses adds the sequence-split attention output o_proj reads (kept by selective)."""
    model = get_model_preset("llama3-8b")
    single = per_layer(model, Layout(), 8192, mode)
    ulysses = per_layer(model, Layout(ulysses=8), 8 * 8192, mode)
    q_bytes = 8192 * model.q_size * 2
    assert ulysses.saved_bytes - single.saved_bytes == q_bytes
    assert ulysses.saved_tensors["out_alltoall"] == q_bytes


def test_kv_replication_doubles_saved_k_and_v():
    model = get_model_preset("llama3-8b")  # 8 KV heads
    u8 = per_layer(model, Layout(ulysses=8), 16 * 8192, "none")
    u16 = per_layer(model, Layout(ulysses=16), 16 * 8192, "none")
    tokens8, tokens16 = 16 * 8192 // 8, 16 * 8192 // 16
    assert u8.saved_tensors["k_alltoall"] == tokens8 * 8 * 128 * 2
    assert u16.saved_tensors["k_alltoall"] == tokens16 * 16 * 128 * 2  # 16 heads before, 1 after the all-to-all


@pytest.mark.parametrize("gathered", [True, False])
def test_tp_sequence_parallel_splits_norm_regions(gathered):
    model = get_model_preset("llama3-8b")
    t1 = per_layer(model, Layout(), 8192, "none")
    t2 = per_layer(model, Layout(tp=2), 8192, "none", tp_saves_gathered_input=gathered)
    h = model.hidden_size
    assert t2.saved_tensors["x_in"] == t1.saved_tensors["x_in"] // 2
    assert t2.saved_tensors["gate_proj"] == t1.saved_tensors["gate_proj"] // 2
    if gathered:  # DTensor/torchtitan: the all-gathered input is saved whole
        assert t2.saved_tensors["norm1.allgather"] == 8192 * h * 2
    else:  # Megatron: the shard is saved and re-gathered in backward
        assert "norm1.allgather" not in t2.saved_tensors and t2.saved_tensors["norm1.out"] == 8192 * h


def test_ring_buffers_are_reported_as_comm_staging():
    model = get_model_preset("llama3-8b")
    r = memory_report(model, TrainSpec(seq_len="128K"), Layout(ring=4, ulysses=2), H100)
    back = r.detail.phases["backward (last block)"]
    tokens = 131072 // 8
    kv = 2 * tokens * 8 * 128 * 2  # this GPU's K and V
    kv_fp32 = 2 * tokens * 8 * 128 * 4
    assert back.buffers >= 2 * (kv + kv_fp32)  # double-buffered K/V blocks and fp32 dK/dV accumulators


def test_ulysses_alltoall_staging_is_a_comm_buffer():
    from sp_plan.cost_models.memory.block import block_graph
    from sp_plan.cost_models.memory.dims import local_dims

    model = get_model_preset("llama3-8b")
    train = TrainSpec(seq_len="128K")
    dims = local_dims(model, train, Layout(ulysses=8))
    for copies in (1.0, 2.0):
        graph = block_graph(model, dims, MemoryAssumptions(alltoall_staging_copies=copies), training=True,
                            attention_kernel="flash", tiled_mlp=False)
        ops = {op.name: op for op in graph.ops}
        for name, nbytes in (("q_alltoall", dims.q_bytes()), ("k_alltoall", dims.k_bytes()),
                             ("out_alltoall", dims.q_bytes())):
            (ws,) = ops[name].fwd_workspace
            assert (ws.kind, ws.nbytes) == ("comm", copies * nbytes)
            assert ops[name].bwd_workspace == ops[name].fwd_workspace


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "mistral-7b", "llama2-7b"])
def test_closed_form_for_llama_blocks(name):
    """docs/memory_model.md section 5: B*(4h + 2ad + 2kd + 4f) + 4a + 8 bytes per token (none, flash, bf16)."""
    m = get_model_preset(name)
    h, a, k, d, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_hidden_size
    per_token = 2 * (4 * h + 2 * a * d + 2 * k * d + 4 * f) + 4 * a + 8
    assert per_layer(m, Layout(), 8192, "none").saved_bytes == 8192 * per_token
    if name == "llama3-8b":
        assert per_token == 168_072
