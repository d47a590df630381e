"""Mixture-of-experts and MLA cost terms (issue 20, item 2), hand-computed on tiny specs, plus the MoE
presets through the console script and the planner's search-equals-brute-force guarantee."""

import json
import math
import pathlib
import subprocess

import pytest
from sp_plan.cost_models import Layout, ModelSpec, TrainSpec, get_gpu_preset, get_model_preset
from sp_plan.cost_models.compute_time import _moe_ffn_seconds
from sp_plan.cost_models.flops import microbatch_work
from sp_plan.cost_models.memory import MemoryAssumptions
from sp_plan.cost_models.memory.block import block_graph
from sp_plan.cost_models.memory.dims import local_dims
from sp_plan.cost_models.memory.liveness import simulate
from sp_plan.cost_models.moe import MLASpec, MoESpec
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.search import PlanSettings, brute_force_best, search

SP_PLAN = pathlib.Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sp-plan"
H, E, K, FE, FS, F = 64, 4, 2, 32, 16, 128


def tiny_moe(**moe_kw) -> ModelSpec:
    """2 layers (layer 0 dense FFN of 128), hidden 64, 4 experts of 32, top-2, one shared expert of 16."""
    moe = MoESpec(num_experts=E, top_k=K, expert_ffn_hidden_size=FE, num_shared_experts=1,
                  shared_expert_ffn_hidden_size=FS, dense_layers=(0,), **moe_kw)
    return ModelSpec(name="tiny-moe", num_layers=2, hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=F, vocab_size=100, moe=moe)


def tiny_mla() -> ModelSpec:
    mla = MLASpec(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    return ModelSpec(name="tiny-mla", num_layers=2, hidden_size=H, num_heads=4, num_kv_heads=4, head_dim=24,
                     ffn_hidden_size=F, vocab_size=100, mla=mla)


# ----- routing ----------------------------------------------------------------------------------------------


def test_routed_rows_dropless_and_with_capacity():
    dropless = tiny_moe().moe
    assert dropless.routed_rows(100) == 200  # 100 tokens x top-2: the real count
    # busy half of the experts at 1.15 x the mean load (50 rows), the other half at 0.85 x: same total
    assert dropless.expert_row_groups(100) == [(pytest.approx(57.5), 2.0), (pytest.approx(42.5), 2.0)]
    capped = tiny_moe(capacity_factor=1.25).moe
    assert capped.expert_capacity(100) == math.ceil(1.25 * 100 * 2 / 4) == 63
    assert capped.routed_rows(100) == 4 * 63  # every expert padded to capacity
    assert capped.expert_row_groups(100) == [(63.0, 4.0)]
    # An expert-parallel degree (not in layouts yet): the busiest of 2 ranks, 2 experts, 2 ranks' tokens.
    assert dropless.expert_row_groups(100, ep=2) == [(pytest.approx(100 * 1.15), 2.0)]


# ----- FLOPs ----------------------------------------------------------------------------------------------


def test_flops_count_executed_rows_and_mfu_counts_active_parameters():
    m = tiny_moe()
    s = 256
    train = TrainSpec(seq_len=s, checkpointing="none")
    w = microbatch_work(m, train, Layout())
    attention = 2 * H * 64 + 2 * H * 32  # q, o (4 heads x 16) and k, v (2 KV heads x 16)
    dense_ffn = 3 * H * F
    moe_ffn = K * 3 * H * FE + 3 * H * FS + H * E  # top-2 experts, the shared expert, the router
    mean_ffn = (dense_ffn + moe_ffn) / 2
    assert w.layer_matmul_fwd == pytest.approx(2 * s * (attention + mean_ffn))
    pairs = s * (s + 1) / 2
    attn = 4 * 16 * 4 * pairs
    head = 2 * s * H * 100
    assert w.model_flops == pytest.approx(3 * (2 * (2 * s * (attention + mean_ffn) + attn) + head))
    # With a capacity factor the GPU computes the padded rows; the model FLOPs (MFU) still count top-k.
    capped = tiny_moe(capacity_factor=1.5)
    wc = microbatch_work(capped, train, Layout())
    rows = E * math.ceil(1.5 * s * K / E)
    padded_ffn = (dense_ffn + rows / s * 3 * H * FE + 3 * H * FS + H * E) / 2
    assert wc.layer_matmul_fwd == pytest.approx(2 * s * (attention + padded_ffn))
    assert wc.model_flops == pytest.approx(w.model_flops)


def test_mfu_numerator_of_a_preset_is_six_times_active_matmul_parameters_plus_attention():
    m = get_model_preset("mixtral-8x7b")
    s = 4096
    w = microbatch_work(m, TrainSpec(seq_len=s), Layout())
    matmul_active = m.active_params - m.embedding_params() - m.num_layers * 2 * m.norm_params() - m.norm_params()
    attention = 3 * m.num_layers * 4 * m.head_dim * m.num_heads * s * (s + 1) / 2
    assert w.model_flops == pytest.approx(6 * s * matmul_active + attention, rel=1e-12)


def test_mla_attention_flops_use_the_qk_and_v_head_dims():
    m = tiny_mla()
    s = 128
    w = microbatch_work(m, TrainSpec(seq_len=s, checkpointing="none"), Layout())
    pairs = s * (s + 1) / 2
    # The kernel runs QK^T and PV at the qk head dim 24 (V padded for flash_attention_2) ...
    assert w.layer_attn_fwd == pytest.approx(4 * 24 * 4 * pairs)
    projections = (H * 24 + 24 * 4 * 24) + (H * 24 + 16 * 4 * 32) + 4 * 16 * H
    assert w.layer_matmul_fwd == pytest.approx(2 * s * (projections + 3 * H * F))
    # ... while model FLOPs (MFU) count QK^T over 16 + 8 dims and PV over 16: 2 x (24 + 16) per head and pair.
    head = 2 * s * H * 100
    assert w.model_flops == pytest.approx(3 * (2 * (2 * s * (projections + 3 * H * F) + 2 * (24 + 16) * 4 * pairs)
                                               + head))


# ----- time -----------------------------------------------------------------------------------------------


def test_expert_gemms_run_at_their_per_expert_shapes():
    """Recording timers show what the MoE FFN asks the kernel model for: the router GEMM and the shared
    expert on every token, and one grouped GEMM per expert matrix with each expert at its own row count
    (uneven: the load imbalance)."""
    m = tiny_moe()
    plain, grouped = [], []

    def gemm_time(gemms, fp8=False, count=1.0):
        plain.extend(gemms)
        return count * sum(2 * a * b * c for a, b, c in gemms)  # FLOPs as "seconds"

    def grouped_time(shapes, fp8=False):
        grouped.append([tuple(round(v, 9) for v in shape) for shape in shapes])
        return sum(2 * a * b * c * n for a, b, c, n in shapes)

    fwd, bwd = _moe_ffn_seconds(m, 100, 1, gemm_time, grouped_time, False, None)
    assert grouped[0] == [(57.5, FE, H, 2.0), (42.5, FE, H, 2.0)]  # gate: busy and light halves of the experts
    assert grouped[2] == [(57.5, H, FE, 2.0), (42.5, H, FE, 2.0)]  # down
    assert (57.5, H, FE, 2.0) in grouped[3] and (H, FE, 57.5, 2.0) in grouped[4]  # gate's dX and dW (h x f, over the rows)
    assert (100, E, H) in plain and (100, FS, H) in plain  # router, shared expert
    routed = 2 * 200 * 3 * H * FE  # 200 rows in all, whatever the split
    assert fwd == pytest.approx(routed + 2 * 100 * E * H + 2 * 100 * 3 * H * FS)
    assert bwd == pytest.approx(2 * fwd)


def test_grouped_gemm_extends_the_kernel_model():
    from sp_plan.cost_models.compute_time import _grouped_gemm_timer, fractions
    from sp_plan.cost_models.kernels import gemm_seconds
    from sp_plan.cost_models.profile import default_profile

    topology = default_topology("h100-80gb", 8, 8)
    profile = default_profile(topology.gpu.name)
    fr, k = fractions(topology, profile), profile.kernels
    peak = topology.peak_flops("bf16") * fr.clock
    grouped = _grouped_gemm_timer(topology, fr, k.gemm, k.sms, peak)
    for shape in [(4096, 4096, 4096), (1000, 768, 2048), (37, 5000, 300)]:  # a group of one is one GEMM
        assert grouped([(*shape, 1)]) == pytest.approx(gemm_seconds(*shape, peak, fr.matmul, k.gemm, k.sms))
    # DeepSeek-V3's gate projection at 4,096 tokens: 256 experts x 128 rows x (2048 x 7168).
    experts = grouped([(128, 2048, 7168, 256)])
    one_big = gemm_seconds(128 * 256, 2048, 7168, peak, fr.matmul, k.gemm, k.sms)
    separate = 256 * gemm_seconds(128, 2048, 7168, peak, fr.matmul, k.gemm, k.sms)
    assert one_big <= experts < separate  # small experts cost their tile padding, not a wave each


def test_load_imbalance_reshapes_but_does_not_add_work_without_expert_parallelism():
    """With every expert on the GPU (no ep degree yet) the imbalance moves rows between experts of one
    grouped GEMM: the same FLOPs, a time that changes only through tile padding. The busiest rank's extra
    rows arrive with expert parallelism (``expert_row_groups(ep > 1)``, tested above)."""
    from sp_plan.cost_models.estimate import estimate

    topology = default_topology("h100-80gb", 8, 8)
    train = TrainSpec(seq_len=8192)
    base = get_model_preset("qwen3-30b-a3b")

    def run(imbalance):
        m = base.model_copy(update={"moe": base.moe.model_copy(update={"load_imbalance": imbalance})})
        return microbatch_work(m, train, Layout(dp_shard=8)).model_flops, estimate(
            m, train, Layout(dp_shard=8), topology).time.compute_s

    (flops_even, even), (flops_skewed, skewed) = run(1.0), run(1.5)
    assert flops_even == flops_skewed
    assert abs(skewed / even - 1) < 0.05


# ----- memory ---------------------------------------------------------------------------------------------


def _graph(model, seq, **train_kw):
    train = TrainSpec(seq_len=seq, **train_kw)
    d = local_dims(model, train, Layout())
    return block_graph(model, d, MemoryAssumptions(), training=True, attention_kernel="flash", tiled_mlp=False)


def test_moe_block_saves_router_logits_indices_and_routed_rows():
    s = 256
    g = _graph(tiny_moe(), s)
    t = g.tensors
    assert t["router.softmax"].nbytes == s * E * 4  # fp32 probabilities
    assert t["router.topk_indices"].nbytes == s * K * 8  # int64
    assert t["moe.dispatch"].nbytes == s * K * H * 2  # dropless: the real count of routed rows
    assert t["experts.gate_proj"].nbytes == s * K * FE * 2
    assert t["shared_experts.gate_proj"].nbytes == s * FS * 2
    saved = simulate(g, "none").saved["activation"]
    gc = _graph(tiny_moe(capacity_factor=2.0), s)
    assert gc.tensors["moe.dispatch"].nbytes == E * math.ceil(2.0 * s * K / E) * H * 2
    # The dispatched rows, gate, up, SiLU output, product and expert output are saved per routed row:
    # padding to capacity (2x the rows) adds saved bytes.
    assert simulate(gc, "none").saved["activation"] > saved


def test_mla_block_keeps_the_latents_and_hands_attention_multi_head_tensors():
    s = 128
    g = _graph(tiny_mla(), s)
    t = g.tensors
    assert t["q_a_proj"].nbytes == s * 24 * 2 and t["kv_a_proj_with_mqa"].nbytes == s * (16 + 8) * 2
    assert t["kv_b_proj"].nbytes == s * 4 * (16 + 16) * 2
    assert t["k_cat"].nbytes == t["q_cat"].nbytes == s * 4 * 24 * 2  # qk head dim 24 for every head
    assert t["v_pad"].nbytes == s * 4 * 24 * 2  # padded for flash_attention_2


def test_ulysses_splits_mla_heads_like_multi_head_attention():
    m = get_model_preset("deepseek-v3")
    layout = Layout(ulysses=8, dp_shard=1)
    d = local_dims(m, TrainSpec(seq_len=8192), layout)
    assert (d.q_heads_attn, d.kv_heads_attn, d.kv_replication) == (16, 16, 1)
    assert 128 in m.valid_head_split_degrees()


def test_dense_block_is_unchanged_by_the_moe_hooks():
    m = get_model_preset("llama3-8b")
    names = {op.name for op in _graph(m, 1024).ops}
    assert {"gate_proj", "up_proj", "down_proj", "q_proj"} <= names
    assert not {n for n in names if n.startswith(("router", "moe.", "experts.", "q_a_proj"))}


# ----- through the console script and the planner ---------------------------------------------------------------


def test_estimate_qwen3_moe_through_the_console_script():
    out = subprocess.run([str(SP_PLAN), "estimate", "--model", "qwen3-30b-a3b", "--seq-len", "128K", "--gpus", "8",
                          "--ulysses", "8", "--json"], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["layout"]["ulysses"] == 8
    assert report["memory"]["weights"] > 0 and report["time"]["step_s"] > 0


def test_plan_mixtral_through_the_console_script():
    out = subprocess.run([str(SP_PLAN), "plan", "--model", "mixtral-8x7b", "--seq-len", "32K", "--gpus", "16"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Recommended:" in out.stdout and "mixtral-8x7b" in out.stdout


@pytest.mark.parametrize("name, seq, gpus", [("mixtral-8x7b", 32 * 1024, 8), ("qwen3-30b-a3b", 128 * 1024, 8)])
def test_search_finds_the_brute_force_optimum_for_moe(name, seq, gpus):
    model = get_model_preset(name)
    topology = default_topology("h100-80gb", gpus, min(8, gpus))
    train = TrainSpec(seq_len=seq)
    best_score, _, _, evaluations = brute_force_best(model, train, topology)
    result = search(model, train, topology, PlanSettings(top_k=3))
    assert result.plans[0].score == pytest.approx(best_score, rel=1e-12)
    assert result.stats.time_evaluations < evaluations


# ----- terms an expert-parallel degree will use ---------------------------------------------------------------


def test_expert_weights_and_dispatch_traffic_divide_by_an_expert_parallel_degree():
    moe = tiny_moe().moe
    per_expert = 3 * H * FE
    assert moe.layer_params_tp(H, 1) == 4 * per_expert + 3 * H * FS + H * E
    assert moe.layer_params_tp(H, 1, ep=2) == 2 * per_expert + 3 * H * FS + H * E  # shared and router stay
    assert moe.dispatch_bytes(100, H, 2, ep=1) == 0  # all experts local: no all-to-all
    assert moe.dispatch_bytes(100, H, 2, ep=4) == 200 * H * 2 * 3 / 4  # routed rows x hidden x (ep-1)/ep


def test_saved_activation_offload_bytes_count_routed_rows():
    from sp_plan.cost_models.strategies.offload import saved_activation_bytes

    s = 256
    train = TrainSpec(seq_len=s, checkpointing="none")
    got = saved_activation_bytes(tiny_moe(), train, Layout())
    per_token_attention = 4 * H + 2 * 64 + 2 * 32
    dense_ffn = 4 * F
    moe_ffn = 4 * (K * FE + FS) + 2 * K * H  # SwiGLU of the routed rows and shared expert; rows in and out
    assert got == pytest.approx(s * (2 * per_token_attention + dense_ffn + moe_ffn) * 2)


def test_dense_and_moe_layers_save_their_mean_and_peak_with_the_larger_block():
    from sp_plan.cost_models.memory import memory_core

    mixed = tiny_moe()  # layer 0 dense, layer 1 MoE
    all_moe = tiny_moe().model_copy(update={"moe": tiny_moe().moe.model_copy(update={"dense_layers": ()})})
    all_dense = tiny_moe().model_copy(update={"moe": None})
    train = TrainSpec(seq_len=512, checkpointing="none")

    def saved(model):
        return memory_core(model, train, Layout()).block.saved["activation"]

    assert saved(mixed) == -(-(saved(all_moe) + saved(all_dense)) // 2)
    peaks = [memory_core(m, train, Layout()).block.backward_peak.total for m in (all_moe, all_dense)]
    assert memory_core(mixed, train, Layout()).block.backward_peak.total == max(peaks)


def test_mla_prefill_kv_cache_holds_k_at_the_qk_head_dim_and_v_unpadded():
    from sp_plan.cost_models.memory import memory_report

    m = get_model_preset("deepseek-v3")
    train = TrainSpec(seq_len=32768, mode="prefill")
    layout = Layout(ulysses=8)
    report = memory_report(m, train, layout, get_gpu_preset("h100-80gb"))
    # 128 heads / 8 per GPU, every token: K at 192 and V at 128 dims, bf16.
    assert report.detail.kv_cache_per_layer == 32768 * 16 * (192 + 128) * 2
    assert report.memory.kv_cache == 61 * 32768 * 16 * (192 + 128) * 2
