"""HF DeepSeek models (MLA attention; dense first layers, then MoE with shared experts, routed scaling and
group-limited routing) train under Ulysses, Ring and USP with FSDP2 exactly as one process trains them.

Tiny fp32 configs built here (no download): 4 heads whose q/k head dim (16 nope + 8 rope = 24) differs from
the v head dim (12), q through a low-rank ``q_a``/``q_b`` pair (V3) or one ``q_proj`` (V2), 8 routed experts in
4 groups with top-2 groups and top-2 experts, one or two shared experts, ``first_k_dense_replace=1``. V3 uses
``noaux_tc`` routing with a non-zero ``e_score_correction_bias`` and YaRN RoPE, whose mscale changes the softmax
scale; V2 uses ``group_limited_greedy``. Two AdamW steps on 2-4 gloo ranks match a single process running the
same model with transformers' eager attention on the full sequences: each step's loss and every gradient
within 1e-5, so every routing decision agrees too (a flipped expert would move the gradients far more).

The sequence-parallel attention pads v with zeros to the q/k head dim and slices the output (exact; see
sp_plan.runtime.attention.head_dims): the kernels and the Ulysses all-to-all take one head dim.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from sp_plan.cost_models import Layout  # noqa: E402
from tests.distributed import error_of, run_ranks  # noqa: E402
from tests.moe_checks import (  # noqa: E402
    BATCH, SEQ, VOCAB, assert_matches_reference, reference_run, sharded_run)

pytestmark = pytest.mark.multiproc

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=12, n_group=4, topk_group=2, num_experts_per_tok=2,
              first_k_dense_replace=1, max_position_embeddings=128, attention_dropout=0.0, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
FAMILIES = {
    "deepseek_v3": dict(q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_parameters=YARN),
    "deepseek_v2": dict(q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
                        topk_method="group_limited_greedy"),
}
#: (family, layout, options): Ulysses, Ring, USP (ring x ulysses), and Ulysses with FSDP2 over dp_shard too.
CASES = [
    ("deepseek_v3", Layout(ulysses=2), {"zero_stage": 3, "checkpointing": "full"}),
    ("deepseek_v3", Layout(ring=2), {"zero_stage": 2, "checkpointing": "none"}),
    ("deepseek_v3", Layout(ring=2, ulysses=2), {"zero_stage": 3, "checkpointing": "selective"}),
    ("deepseek_v2", Layout(dp_shard=2, ulysses=2), {"zero_stage": 3, "checkpointing": "none"}),
]


def _config(family: str, **overrides):
    import transformers

    config_cls = {"deepseek_v3": transformers.DeepseekV3Config, "deepseek_v2": transformers.DeepseekV2Config}[family]
    return config_cls(**{**COMMON, **FAMILIES[family], **overrides})


def _model(family: str, attn: str = "eager", **overrides):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **overrides), attn_implementation=attn)
    for layer in model.model.layers:  # noaux_tc's load-balancing bias shifts the expert choice (not the weights)
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.05 * torch.randn(bias.shape))
    return model.float()


def _reference(family: str) -> tuple[list[float], list[dict]]:
    return reference_run(_model(family))


def _train(rank: int, world: int, family: str, layout: Layout, options: dict) -> tuple[list[float], list[dict]]:
    from sp_plan.runtime.auto import auto_configure

    model = _model(family)
    micro = BATCH // layout.dp
    setup = auto_configure(model, seq_len=SEQ, micro_batch=micro, global_batch=BATCH, dtype="fp32",
                           topology="dgx-h100", fixed_layout=layout.degrees(), fixed_options=options)
    assert setup.model.config._attn_implementation == "sp_plan"
    assert setup.plan.model.mla is not None and setup.plan.model.moe.num_experts == 8
    assert setup.plan.layout == layout
    losses, grads, _ = sharded_run(setup)
    return losses, grads


@pytest.mark.parametrize(("family", "layout", "options"), CASES,
                         ids=[f"{f}-dp{lay.dp_shard}-ring{lay.ring}-ulysses{lay.ulysses}" for f, lay, _ in CASES])
def test_mla_training_matches_one_process(family: str, layout: Layout, options: dict) -> None:
    assert_matches_reference(run_ranks(layout.world, _train, family, layout, options), *_reference(family))


@pytest.mark.parametrize("v_dim", [12, 40])
def test_attention_with_another_v_head_dim_is_exact(v_dim: int) -> None:
    """The local entry point widens the narrower side with zeros and narrows the output back: output, LSE and
    the gradients of q, k and v equal fp64 attention on the unpadded tensors (v narrower, as in MLA, and
    wider); the default scale is the unpadded q/k head dim's."""
    from sp_plan.runtime.attention import local_attention

    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 10, 4, 24, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 10, 4, v_dim, generator=gen, dtype=torch.float64, requires_grad=True)
    out, lse = local_attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 10, 4, v_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(24)
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-12)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(want, (q, k, v), dout)
    for name, g, e in zip("qkv", got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12, msg=name)


def test_mla_refusals() -> None:
    """What does not train exactly is refused with the reason: tensor parallelism (no cut for the latent
    attention), the tiled MLP on MoE layers, the router's load-balancing loss; the planner is held to tp 1."""
    from types import SimpleNamespace

    from sp_plan.cost_models import TrainSpec
    from sp_plan.runtime.capabilities import merge_constraints, planner_constraints, unsupported_reasons
    from sp_plan.runtime.models.hf.model import hf_model_spec
    from sp_plan.runtime.models.hf.moe import check_moe_training
    from sp_plan.runtime.models.hf.techniques import apply_hf_tiled_mlp
    from sp_plan.runtime.models.hf.tp_plan import tp_plan_for

    for family in FAMILIES:
        model = _model(family)
        assert check_moe_training(model) is None
        assert "does not split multi-head latent attention" in error_of(lambda m=model: tp_plan_for(m))
        assert "does not run mixture-of-experts blocks" in error_of(lambda m=model: apply_hf_tiled_mlp(m))
        routed = _model(family, output_router_logits=True)
        assert "set config.output_router_logits = False" in error_of(lambda m=routed: check_moe_training(m))
    spec = hf_model_spec(_model("deepseek_v3"))
    layout, options = planner_constraints("hf", spec)
    assert layout.get("tp") == 1 and layout.get("ep") == 1 and options.get("tiled_mlp") is False
    dense_mla = SimpleNamespace(mla=spec.mla, moe=None)  # MLA alone holds TP back too
    assert planner_constraints("hf", dense_mla)[0].get("tp") == 1
    assert "multi-head latent attention" in error_of(lambda: merge_constraints({"tp": 2}, {}, "hf", dense_mla))
    plan = SimpleNamespace(model=spec, train=TrainSpec(seq_len=SEQ), layout=Layout(tp=2, ulysses=2))
    assert any(r.startswith("tp=2: tensor parallelism does not split multi-head latent attention")
               for r in unsupported_reasons(plan, "hf"))
    runs = SimpleNamespace(model=spec, train=TrainSpec(seq_len=SEQ), layout=Layout(ring=2, ulysses=2, dp_shard=2))
    assert unsupported_reasons(runs, "hf") == []
