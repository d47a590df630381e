"""GPU-realism mechanisms of the memory model (MemoryAssumptions fields the hf-deepspeed and torchtitan
stacks set): exact arithmetic on small cases, and the monotonicity the planner relies on."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.memory import MemoryAssumptions, memory_core, memory_report
from sp_plan.cost_models.memory.allocator import fragmentation, replay, round_size, segment_size
from sp_plan.cost_models.memory.assumptions import NCCL_LL128_BYTES, NCCL_LL_BYTES, NCCL_SIMPLE_BYTES
from sp_plan.cost_models.memory.block import block_graph
from sp_plan.cost_models.memory.dims import local_dims
from sp_plan.cost_models.memory.graph import GraphBuilder, TensorSpec
from sp_plan.cost_models.memory.liveness import simulate
from sp_plan.cost_models.memory.output_layer import liger_chunk_tokens, output_graph
from sp_plan.cost_models.memory.overhead import communicator_bytes, process_groups, purpose_groups
from sp_plan.cost_models.memory.states import block_matrices, tp_params
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models import get_gpu_preset

MiB = 1 << 20
H100 = get_gpu_preset("h100-80gb")
LLAMA8 = get_model_preset("llama3-8b")


def stack(name: str, **overrides) -> MemoryAssumptions:
    return resolve_profile("h100-80gb", name, assume=overrides or None).memory


# ----- caching allocator model -------------------------------------------------------------------------


def test_allocator_hole_below_a_live_block():
    """A(100) B(50); free A; C(120) does not fit the 100 MiB hole below B.
    expandable: A and B map 100 + 60 (20 MiB pages, 10 free at the end); C extends that free tail by
    ceil(110/20) = 6 pages: 280 MiB mapped for a 170 MiB live peak.
    segments: cudaMalloc 100 + 50 + 120 (2 MiB multiples, never returned): 270 MiB."""
    events = [("a", "A", 100 * MiB), ("a", "B", 50 * MiB), ("f", "A", 0), ("a", "C", 120 * MiB)]
    exp, seg = replay(events, "expandable"), replay(events, "segments")
    assert exp.peak_allocated == seg.peak_allocated == 170 * MiB
    assert exp.peak_reserved == 280 * MiB and fragmentation(events, "expandable") == 110 * MiB
    assert seg.peak_reserved == 270 * MiB and fragmentation(events, "segments") == 100 * MiB


def test_allocator_reuses_and_merges_freed_blocks():
    """A freed 100 MiB block is split for 60 + 40 and, freed again, merges back into one that holds 100."""
    events = [("a", "A", 100 * MiB), ("f", "A", 0), ("a", "B", 60 * MiB), ("a", "C", 40 * MiB),
              ("f", "B", 0), ("f", "C", 0), ("a", "D", 100 * MiB)]
    for mode in ("expandable", "segments"):
        assert replay(events, mode).peak_reserved == 100 * MiB
        assert fragmentation(events, mode) == 0


def test_allocator_rounding():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(1 << 20) == 2 * MiB  # small pool
    assert segment_size(5 * MiB) == 20 * MiB  # below kMinLargeAlloc: one kLargeBuffer
    assert segment_size(11 * MiB + 1) == 12 * MiB  # 2 MiB multiples above it


# ----- reentrant checkpointing ---------------------------------------------------------------------------


def test_reentrant_checkpoint_holds_output_and_incoming_gradient():
    """y = x + f(x), f saves x, full checkpointing.
    non-reentrant: nothing to recompute; at f's backward x + dy + f's gradient for x = 30, added into dy
    in place. reentrant: recompute f and the add (fx 10, y 10 held by `outputs`); the incoming dy is
    also held by `args`, so f's gradient cannot be added in place: x + y + dy + grad + sum = 50."""
    g = GraphBuilder()
    g.input("x", 10)
    g.op("f", ["x"], [TensorSpec("fx", 10)], saves=["x"])
    g.op("add", ["x", "fx"], [TensorSpec("y", 10)], grad_passthrough=True)
    graph = g.build(outputs=("y",))
    assert simulate(graph, "full").backward_peak.total == 30
    reentrant = simulate(graph, "full", reentrant=True).backward_peak
    assert reentrant.total == 50 and reentrant.at == "backward:f:accumulate"
    # reentrant only changes full checkpointing
    assert simulate(graph, "none", reentrant=True).backward_peak == simulate(graph, "none").backward_peak


def test_reentrant_block_holds_its_recomputed_output():
    """Llama-3-8B block, 8K tokens per GPU, MLP-bound backward peak: the recomputed block output (the
    `outputs` a reentrant checkpoint keeps) is the difference: one hidden-sized tensor; saved bytes equal."""
    train, layout = TrainSpec(seq_len=65536, checkpointing="full"), Layout(ulysses=8)
    plain = memory_core(LLAMA8, train, layout, MemoryAssumptions())
    reentrant = memory_core(LLAMA8, train, layout, MemoryAssumptions(checkpoint_implementation="reentrant"))
    hidden = 8192 * 4096 * 2
    assert reentrant.block.saved == plain.block.saved
    assert reentrant.block.backward_peak.total - plain.block.backward_peak.total == hidden


# ----- block transients ---------------------------------------------------------------------------------


def _graph(model, train, layout, a, **kw):
    d = local_dims(model, train, layout)
    return block_graph(model, d, a, training=True, attention_kernel="flash", tiled_mlp=train.tiled_mlp, **kw)


def test_inplace_rope_has_no_op_and_saves_the_same():
    train, layout = TrainSpec(seq_len=65536, checkpointing="none"), Layout(ulysses=8)
    eager = _graph(LLAMA8, train, layout, MemoryAssumptions())
    inplace = _graph(LLAMA8, train, layout, MemoryAssumptions(rope_implementation="inplace"))
    assert {"q_rope", "k_rope"} <= {op.name for op in eager.ops}
    assert not {"q_rope", "k_rope"} & {op.name for op in inplace.ops}
    assert simulate(inplace, "none").saved == simulate(eager, "none").saved
    assert simulate(inplace, "none").forward_peak.total <= simulate(eager, "none").forward_peak.total


def test_deepspeed_head_major_copy_only_with_several_heads_per_gpu():
    """UlyssesSPAttentionHF .contiguous() after the all-to-all: a copy for q (4 heads per GPU at
    ulysses 8), none for k/v (1 head); the attention kernel saves the copy."""
    train, layout = TrainSpec(seq_len=65536, checkpointing="none"), Layout(ulysses=8)
    g = _graph(LLAMA8, train, layout, MemoryAssumptions(alltoall_head_major_copy=True))
    names = {op.name for op in g.ops}
    assert "q_head_major" in names and "k_head_major" not in names
    saved = simulate(g, "none").saved_tensors
    assert saved["q_head_major"] == 8192 * 32 * 128 * 2 and "q_alltoall" not in saved


def test_flash_varlen_padding_rows():
    """mha_varlen_bwd: dq_accum and softmax_d get 128 rows per packed sequence: 128 x sequences x heads x
    (head_dim + 1) x 4 B more workspace (64 documents of 1K tokens, 4 query heads per GPU)."""
    train, layout = TrainSpec(seq_len=65536, checkpointing="none", document_length=1024), Layout(ulysses=8)

    def workspace(pad):
        g = _graph(LLAMA8, train, layout, MemoryAssumptions(flash_varlen_pad_rows=pad))
        op = next(op for op in g.ops if op.name == "flash_attention")
        return sum(w.nbytes for w in op.bwd_workspace)
    assert workspace(128) - workspace(0) == 128 * 64 * 4 * (128 + 1) * 4


def test_deepspeed_tiled_mlp_concat_and_parameter_gradients():
    """TiledMLP: forward keeps every tile's output and concatenates (workspace >= one output); under
    bucketed ZeRO-3 its backward holds gate/up/down gradients plus the next tile's gradient of one."""
    train, layout = TrainSpec(seq_len=65536, tiled_mlp=True, zero_stage=3), Layout(ulysses=8)
    a = stack("hf-deepspeed")
    out = 8192 * 4096 * 2
    grads = (3 + 1) * 4096 * 14336 * 2
    g = _graph(LLAMA8, train, layout, a, mlp_param_grad_bytes=grads)
    op = next(op for op in g.ops if op.name == "tiled_mlp")
    assert op.fwd_workspace[0].nbytes >= out
    assert [w for w in op.bwd_workspace if w.kind == "grads"][0].nbytes == grads
    core = memory_core(LLAMA8, train, layout, a)
    assert core.block.backward_peak.by_kind["grads"] == grads  # the timeline hands them to the block


# ----- output layer --------------------------------------------------------------------------------------


def test_liger_chunk_size_formula():
    # liger_kernel/ops/fused_linear_cross_entropy.py's own example: BT = 4096*4, V = 32000, H = 4096 -> 2048
    assert liger_chunk_tokens(4096 * 4, 32000, 4096) == 2048
    assert liger_chunk_tokens(125000, 128256, 8192) == 8192  # ALST 70B: ceil(125000/16) -> next pow2
    assert liger_chunk_tokens(100, 128256, 4096) == 4  # never more than T


def test_liger_fused_linear_cross_entropy_working_set():
    """Forward: last block output (saved by the final norm) + rstd + normed hidden + grad_input (T x h) +
    one chunk of logits (compute dtype) + chunk x h + fp32 per-token loss + the 4 B loss. Backward hands
    grad_input over."""
    train, layout = TrainSpec(seq_len=65536, tiled_loss=True), Layout(ulysses=8)
    d = local_dims(LLAMA8, train, layout)
    sim = simulate(output_graph(LLAMA8, d, MemoryAssumptions(tiled_loss_implementation="liger_flce"),
                                training=True, tiled_loss=True), "none")
    T, h, V, B = 8192, 4096, 128256, 2
    chunk = liger_chunk_tokens(T, V, h)
    assert sim.forward_peak.total == 3 * T * h * B + T * 4 + chunk * V * B + chunk * h * B + T * 4 + 4
    assert sim.saved_tensors == {"last_block_out": T * h * B, "final_norm.rstd": T * 4,
                                 "flce.grad_input": T * h * B}


@pytest.mark.parametrize("kw, forward, backward", [
    ({}, 10, 14),  # HF 4.46+: bf16 logits kept by the caller; fp32 copy; log-softmax
    ({"hf_logits_fp32_in_output": True}, 8, 16),  # HF <= 4.45: the output holds the fp32 logits (bf16 freed)
    ({"cross_entropy_implementation": "megatron"}, 10, 6),  # in-place vocab-parallel cross-entropy
    # Megatron-Core --cross-entropy-loss-fusion: native (one fp32 upcast, in place, cast back in backward) and
    # Transformer Engine's Triton kernel (the bf16 logits become their own gradient).
    ({"cross_entropy_implementation": "megatron_fused"}, 6, 6),
    ({"cross_entropy_implementation": "te_fused"}, 2, 2),
])
def test_untiled_loss_bytes_per_logit(kw, forward, backward):
    train, layout = TrainSpec(seq_len=65536), Layout(ulysses=8)
    d = local_dims(LLAMA8, train, layout)
    sim = simulate(output_graph(LLAMA8, d, MemoryAssumptions(**kw), training=True, tiled_loss=False), "none")
    logits = 8192 * 128256
    assert sim.forward_peak.by_kind["logits"] == forward * logits
    assert sim.backward_peak.by_kind["logits"] == backward * logits


def test_op_sac_keeps_attention_and_every_other_matmul():
    """torchtitan's per-op SAC: q_proj (1st mm), v_proj (3rd), gate (5th), down (7th) and the flash
    kernel's outputs are kept with the block input; k, o, up (even) are recomputed."""
    train, layout = TrainSpec(seq_len=8192, checkpointing="selective"), Layout()
    g = _graph(LLAMA8, train, layout, MemoryAssumptions(selective_policy="op_sac"))
    saved = set(simulate(g, "selective", "op_sac").saved_tensors)
    assert saved == {"x_in", "q_proj", "v_proj", "gate_proj", "down_proj", "attention", "attention.lse"}


# ----- model states and ZeRO buffers -------------------------------------------------------------------


def test_deepspeed_zero3_gathered_parameters_and_buckets():
    """Llama-3-8B, ZeRO-3 over 8: gathered = block + max(5e7 prefetch, largest matrix) in block phases,
    block + input embedding while the first block runs backward, lm_head + prefetch in the loss; the IPG
    bucket (5e8 bf16) always, twice in backward plus a gradient in flight (largest matrix)."""
    train, layout = TrainSpec(seq_len=65536, zero_stage=3, checkpointing="full"), Layout(ulysses=8)
    a = MemoryAssumptions(zero3_prefetch_params=50_000_000, zero_reduce_bucket_params=500_000_000)
    phases = {p.name: p for p in memory_core(LLAMA8, train, layout, a).phases}
    p = tp_params(LLAMA8, 1)
    largest = block_matrices(LLAMA8, 1).largest
    assert largest == 4096 * 14336
    assert phases["forward"].zero3_gathered_params == (p.per_layer + largest) * 2
    assert phases["backward (last block)"].zero3_gathered_params == (p.per_layer + largest) * 2
    assert phases["backward (first block)"].zero3_gathered_params == (p.per_layer + p.embedding) * 2
    assert phases["loss"].zero3_gathered_params == (p.output_matrix + largest) * 2
    assert phases["forward"].unsharded_grads == 500_000_000 * 2
    assert phases["backward (first block)"].unsharded_grads == 2 * 500_000_000 * 2 + largest * 2


def test_deepspeed_offload_keeps_no_gradient_partition_on_the_device():
    train, layout = TrainSpec(seq_len=65536, zero_stage=3, offload_optimizer=True), Layout(ulysses=8)
    ours = memory_core(LLAMA8, train, layout, MemoryAssumptions())
    ds = memory_core(LLAMA8, train, layout, MemoryAssumptions(offload_optimizer_keeps_device_grads=False))
    assert max(p.gradients for p in ours.phases) > 0
    assert all(p.gradients == 0 for p in ds.phases)


def test_cublas_workspace_is_allocated_in_every_phase():
    train, layout = TrainSpec(seq_len=8192), Layout(dp_shard=8)
    base = memory_core(LLAMA8, train, layout, MemoryAssumptions())
    ws = memory_core(LLAMA8, train, layout, MemoryAssumptions(cublas_workspace_bytes=32 * MiB))
    assert all(b.allocated + 32 * MiB == w.allocated for b, w in zip(base.phases, ws.phases))


# ----- NCCL ----------------------------------------------------------------------------------------------


def test_nccl_buffers_of_an_intra_node_ulysses_group():
    """8 ranks on one node: 24 ring channels x (SIMPLE 4 MiB + LL128 4,915,200 B + LL 512 KiB), plus
    all-to-all P2P: 2 channels per peer x 2 directions x 7 NVLink peers x 4 MiB."""
    a = MemoryAssumptions(nccl_memory="buffers")
    (group,) = process_groups(Layout(ulysses=8))
    conn = NCCL_SIMPLE_BYTES + NCCL_LL128_BYTES + NCCL_LL_BYTES
    assert conn == 4_194_304 + 4_915_200 + 524_288 == 9_633_792
    assert communicator_bytes(group, Layout(ulysses=8), a) == 24 * conn + 2 * 2 * 7 * 4 * MiB
    # 32 ranks over 4 nodes: ring + tree connections, 7 NVLink and 24 network peers (1 MiB buffers)
    big = Layout(ulysses=32)
    assert communicator_bytes(process_groups(big)[0], big, a) == 2 * 24 * conn + 2 * 2 * (7 * 4 + 24 * 1) * MiB


def test_nccl_buffers_grow_with_the_group_and_across_nodes():
    a = MemoryAssumptions(nccl_memory="buffers")
    sizes = []
    for u in (8, 16, 32, 64):
        layout = Layout(ulysses=u)
        sizes.append(communicator_bytes(process_groups(layout)[0], layout, a))
    assert sizes == sorted(sizes) and sizes[1] > sizes[0]
    # a data-parallel group of the same size without P2P is smaller
    dp = Layout(dp_shard=64)
    assert communicator_bytes(process_groups(dp)[0], dp, a) < sizes[-1]


def test_deepspeed_communicators_are_one_per_purpose():
    layout = Layout(ulysses=32)
    assert [g.name for g in process_groups(layout)] == ["ulysses"]
    assert [g.name for g in purpose_groups(layout, 3)] == ["world", "sequence_parallel", "zero_partition"]
    assert [g.name for g in purpose_groups(Layout(dp_shard=2, ulysses=8), 0)] == [
        "world", "sequence_parallel", "data_parallel"]


# ----- what must fit vs what NVML shows ----------------------------------------------------------------


def test_allocator_replay_reserve_is_reported_and_only_unrecoverable_part_must_fit():
    model, train, layout = get_model_preset("llama3-70b"), TrainSpec(
        seq_len=4_000_000, zero_stage=3, offload_optimizer=True, offload_checkpoints=True, tiled_mlp=True,
        tiled_loss=True), Layout(ulysses=32)
    for mode in ("expandable", "segments"):
        a = stack("hf-deepspeed", allocator=mode)
        r = memory_report(model, train, layout, H100, a)
        o, m = r.detail.overhead, r.memory
        assert o.allocator == mode
        assert m.total == m.peak_allocated + o.cuda_context + o.nccl + o.fragmentation
        assert m.device_used == m.total + o.cached_reserve
        assert o.peak_reserved == m.peak_allocated + o.fragmentation + o.cached_reserve
        assert o.fragmentation >= int(a.allocator_slack_fraction * m.peak_allocated)
    # sp-plan's flat fraction: nothing cached on top
    r = memory_report(model, train, layout, H100)
    assert r.memory.device_used == r.memory.total and r.detail.overhead.cached_reserve == 0


# ----- monotonicity the planner relies on ---------------------------------------------------------------

MODELS = ["llama3-8b", "qwen3-4b", "llama3-70b"]
FAST = settings(max_examples=20, deadline=None)


@st.composite
def scenarios(draw):
    model = get_model_preset(draw(st.sampled_from(MODELS)))
    layout = draw(st.sampled_from([Layout(ulysses=8), Layout(ring=4, ulysses=2), Layout(dp_shard=4, ulysses=2),
                                   Layout(dp_shard=8)]))
    seq = layout.seq_multiple() * 1024 * draw(st.sampled_from([8, 32, 128]))
    options = dict(zero_stage=draw(st.sampled_from([2, 3])), checkpointing=draw(st.sampled_from(["selective", "full"])),
                   tiled_loss=draw(st.booleans()), tiled_mlp=draw(st.booleans()),
                   offload_optimizer=draw(st.booleans()))
    return model, layout, seq, options, draw(st.sampled_from(["hf-deepspeed", "torchtitan"]))


def _total(model, layout, seq, a, **options):
    return memory_core(model, TrainSpec(seq_len=seq, **options), layout, a).total


@FAST
@given(scenarios())
def test_memory_never_grows_up_the_option_lattice(scenario):
    """Moving one option towards saving memory never raises what must fit, under the GPU stacks too
    (the allocator replay's holes are reported as cached, not added to `total`)."""
    model, layout, seq, options, name = scenario
    a = stack(name)
    base = _total(model, layout, seq, a, **options)
    moves = {"checkpointing": "full", "zero_stage": 3, "tiled_loss": True, "offload_optimizer": True,
             "offload_checkpoints": True}
    if name == "torchtitan":
        moves["tiled_mlp"] = True
    for key, value in moves.items():
        if key == "offload_checkpoints" and options["checkpointing"] == "none":
            continue
        assert _total(model, layout, seq, a, **{**options, key: value}) <= base, key


def test_deepspeed_tiled_mlp_costs_memory_at_two_tiles_and_saves_at_many():
    """DeepSpeed's TiledMLP holds the MLP matrices' gradients across its tiles and concatenates their
    outputs: at 2 tiles (8K tokens per GPU, hidden 4096) that outweighs the tiles' savings, at 16 tiles it
    does not. The hf-deepspeed stack is therefore not monotone along the planner's tiled_mlp axis."""
    a = stack("hf-deepspeed")
    layout = Layout.for_world(8, dp_shard=4, tp=2)
    common = dict(zero_stage=3, checkpointing="selective", tiled_loss=True)
    short = [_total(LLAMA8, layout, 8192, a, tiled_mlp=t, **common) for t in (False, True)]
    long = [_total(LLAMA8, layout, 65536, a, tiled_mlp=t, **common) for t in (False, True)]
    assert short[1] > short[0]
    assert long[1] < long[0]
