"""DESIGN.md section 4 reference facts: Llama-70B, bf16, 1,000,000 tokens, 8 GPUs, Ulysses 8, prefill, ZeRO-3."""

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_gpu_preset, get_model_preset
from sp_plan.cost_models.estimate import estimate

GB = 1e9


@pytest.fixture(scope="module")
def reference():
    model = get_model_preset("llama3-70b")
    train = TrainSpec(seq_len=1_000_000, mode="prefill", zero_stage=3)
    return estimate(model, train, Layout.for_world(8, ulysses=8), get_gpu_preset("h100-80gb"))


def test_q_before_and_after_alltoall(reference):
    u = reference.detail.ulysses
    # 125,000 tokens x 8192 (64 heads x 128) x 2 B before; 1M tokens x 8 heads x 128 x 2 B after.
    assert u.q_bytes_before == 125_000 * 8192 * 2 == 2_048_000_000
    assert u.q_bytes_after == 1_000_000 * 8 * 128 * 2 == 2_048_000_000
    assert round(u.q_bytes_before / GB, 2) == 2.05


def test_k_and_v_before_and_after_alltoall(reference):
    u = reference.detail.ulysses
    for nbytes in (u.k_bytes_before, u.v_bytes_before, u.k_bytes_after, u.v_bytes_after):
        assert nbytes == 256_000_000  # 0.26 GB: 8 KV heads x 125K tokens, or 1 KV head x 1M tokens
    assert (u.kv_heads_before, u.kv_heads_after, u.kv_replication) == (8, 1, 1)
    assert (u.tokens_before, u.tokens_after) == (125_000, 1_000_000)


def test_kv_cache_41_gb(reference):
    # 80 layers x 1M tokens x 1 KV head x 128 x 2 (K and V) x 2 B
    assert reference.memory.kv_cache == 80 * 1_000_000 * 128 * 2 * 2 == 40_960_000_000
    assert reference.detail.kv_cache_per_layer == 512_000_000


def test_fsdp_weight_shard(reference):
    # 70,553,706,496 params x 2 B / 8 = 17.64 GB (DESIGN.md rounds 140 GB / 8 to 17.5 GB)
    assert reference.memory.weights == 70_553_706_496 * 2 // 8
    assert reference.memory.weights / GB == pytest.approx(17.64, abs=0.005)
    assert reference.memory.gradients == reference.memory.optimizer == 0


def test_prefill_totals_are_consistent(reference):
    m = reference.memory
    allocated = m.weights + m.gradients + m.optimizer + m.activations + m.logits + m.kv_cache + m.buffers
    assert m.peak_allocated == allocated
    assert m.total == m.peak_allocated + m.overhead
    assert m.capacity == get_gpu_preset("h100-80gb").memory_bytes
    assert reference.fits == (m.total <= m.capacity)
    assert reference.detail.peak_phase in reference.detail.phases
    # One communicator: every flattened group (FSDP, SP, world) has the ulysses group's ranks.
    assert [c.name for c in reference.detail.overhead.communicators] == ["ulysses"]


def test_prefill_mlp_intermediates_dominate_untiled_and_tiling_fits():
    """Untiled, three 125K x 28672 bf16 MLP tensors (21.5 GB) are live at once; tiling removes them."""
    model = get_model_preset("llama3-70b")
    gpu = get_gpu_preset("h100-80gb")
    layout = Layout.for_world(8, ulysses=8)
    plain = estimate(model, TrainSpec(seq_len=1_000_000, mode="prefill"), layout, gpu)
    tiled = estimate(model, TrainSpec(seq_len=1_000_000, mode="prefill", tiled_mlp=True), layout, gpu)
    assert plain.detail.phases["forward"].transient_peak_at == "forward:mul"
    assert plain.memory.activations >= 3 * 125_000 * 28672 * 2
    assert tiled.memory.activations < plain.memory.activations / 2
    assert tiled.fits and tiled.memory.kv_cache == plain.memory.kv_cache
