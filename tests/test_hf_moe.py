"""HF mixture-of-experts models (Qwen3-MoE, Mixtral; tiny fp32 configs: 2 layers, 4 experts, top-2) train
under Ulysses, Ring and USP with FSDP2 exactly as one process trains them.

Routing is per token (the router scores each token's own hidden state), so sequence sharding keeps every
routing decision; FSDP2 shards the expert weights like any other parameter. Two AdamW steps on 2-4 gloo
ranks match a single process running the same model with transformers' own SDPA attention on the full
sequences: each step's loss and every gradient within 1e-5.

The runs go through :func:`sp_plan.runtime.auto.auto_configure`: the planner reads the model's config (its
MoE ModelSpec), is held to what the runtime executes for MoE blocks (tp 1, no tiled MLP), and plans with
the test's layout and options pinned.

What is not per token is refused with the reason: ``output_router_logits`` (the load-balancing loss
averages over all tokens, and a rank sees its shard) and Mixtral's ``router_jitter_noise``; so are
tensor parallelism (the experts are not split) and the tiled MLP (a router, not one gated MLP).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec  # noqa: E402
from tests.distributed import error_of, run_ranks  # noqa: E402

pytestmark = pytest.mark.multiproc

STEPS, BATCH, SEQ, VOCAB, LR = 2, 2, 16, 128, 1e-3
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=VOCAB, max_position_embeddings=128, attention_dropout=0.0, tie_word_embeddings=False,
              num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, intermediate_size=48),
}
#: (family, layout, options): each family under Ulysses or Ring alone and under USP (Ring x Ulysses).
CASES = [
    ("qwen3_moe", Layout(ulysses=2), {"zero_stage": 3, "checkpointing": "full"}),
    ("mixtral", Layout(ring=2), {"zero_stage": 2, "checkpointing": "none"}),
    ("qwen3_moe", Layout(ring=2, ulysses=2), {"zero_stage": 3, "checkpointing": "selective"}),
    ("mixtral", Layout(ring=2, ulysses=2), {"zero_stage": 1, "checkpointing": "full"}),
]


def _config(family: str, **overrides):
    import transformers

    config_cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[family]
    return config_cls(**{**COMMON, **FAMILIES[family], **overrides})


def _model(family: str, attn: str = "sdpa", **overrides):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **overrides), attn_implementation=attn)
    return model.float()


def _dense_stand_in(family: str) -> ModelSpec:
    """The dense ModelSpec of the same attention shape (what a plan can name until MoE specs exist)."""
    config = _config(family)
    return ModelSpec(name=f"{family}-attention-shape", num_layers=config.num_hidden_layers,
                     hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                     ffn_hidden_size=2 * config.hidden_size, vocab_size=VOCAB, tied_embeddings=False,
                     qk_norm=family == "qwen3_moe")


def _data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _reference(family: str) -> tuple[list[float], list[dict]]:
    import torch.nn.functional as F

    model = _model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for ids in _data():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def _train(rank: int, world: int, family: str, layout: Layout, options: dict) -> tuple[list[float], list[dict]]:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    model = _model(family, attn="eager")
    setup = auto_configure(model, seq_len=SEQ, micro_batch=BATCH, global_batch=BATCH, dtype="fp32",
                           topology="dgx-h100", fixed_layout=layout.degrees(), fixed_options=options)
    assert setup.model.config._attn_implementation == "sp_plan"
    assert setup.plan.model.moe is not None and setup.plan.model.moe.num_experts == 4
    assert setup.plan.layout == layout
    optimizer = setup.make_optimizer(lr=LR)
    losses, grads = [], []
    for ids in _data():
        result = train_step(setup, [ids])  # gradients only: read them, then step
        losses.append(result.loss)
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().numpy().copy()
                      for n, p in setup.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


@pytest.mark.parametrize(("family", "layout", "options"), CASES,
                         ids=[f"{f}-ring{lay.ring}-ulysses{lay.ulysses}" for f, lay, _ in CASES])
def test_moe_training_matches_one_process(family: str, layout: Layout, options: dict) -> None:
    ref_losses, ref_grads = _reference(family)
    results = run_ranks(layout.world, _train, family, layout, options)
    for losses, grads in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            assert sorted(got) == sorted(want)
            for name, grad in want.items():
                torch.testing.assert_close(torch.from_numpy(got[name]), grad, rtol=0, atol=1e-5,
                                           msg=f"step {step}: {name}")


def test_moe_refusals() -> None:
    from sp_plan.runtime.models.hf.moe import check_moe_training
    from sp_plan.runtime.models.hf.techniques import apply_hf_tiled_mlp
    from sp_plan.runtime.models.hf.tp_plan import tp_plan_for

    for family in FAMILIES:
        model = _model(family)
        assert check_moe_training(model) is None
        assert "does not split mixture-of-experts" in error_of(lambda m=model: tp_plan_for(m))
        assert "does not run mixture-of-experts blocks" in error_of(lambda m=model: apply_hf_tiled_mlp(m))
        routed = _model(family, output_router_logits=True)
        assert "set config.output_router_logits = False" in error_of(lambda m=routed: check_moe_training(m))
    jittery = _model("mixtral", router_jitter_noise=0.1)
    assert "set config.router_jitter_noise = 0" in error_of(lambda: check_moe_training(jittery))


def test_moe_plans_are_held_to_what_the_runtime_runs() -> None:
    """Once the planner describes MoE models (``ModelSpec.moe``), it is asked for tp 1 and no tiled MLP, and
    a plan with either is refused with the reason; a dense spec keeps both."""
    from types import SimpleNamespace

    from sp_plan.runtime.capabilities import merge_constraints, planner_constraints, unsupported_reasons

    moe_spec = SimpleNamespace(moe=object())  # what the runtime reads of a MoE ModelSpec: its sparse FFN is set
    layout, options = planner_constraints("hf", moe_spec)
    assert layout.get("tp") == 1 and options.get("tiled_mlp") is False
    dense_layout, dense_options = planner_constraints("hf", _dense_stand_in("mixtral"))
    assert "tp" not in dense_layout and "tiled_mlp" not in dense_options
    plan = SimpleNamespace(model=moe_spec, train=TrainSpec(seq_len=SEQ, tiled_mlp=True), layout=Layout(tp=2))
    reasons = unsupported_reasons(plan, "hf")
    assert any(r.startswith("tp=2: tensor parallelism does not split mixture-of-experts") for r in reasons)
    assert any(r.startswith("tiled_mlp: the tiled MLP does not run mixture-of-experts") for r in reasons)
    assert "re-plan with --tp 1" in error_of(lambda: merge_constraints({"tp": 2}, {}, "hf", moe_spec))


def test_config_dict_carries_the_config_json_names() -> None:
    """transformers stores Qwen3-MoE's expert count as ``num_local_experts`` and writes only that name, while
    Qwen3-MoE's config.json (what the cost models read) says ``num_experts``: the runtime hands both."""
    from sp_plan.runtime.models.hf.model import hf_config_dict

    config = _config("qwen3_moe")
    assert "num_experts" not in config.to_dict()
    assert hf_config_dict(config)["num_experts"] == hf_config_dict(config)["num_local_experts"] == 4
    assert hf_config_dict(_config("mixtral"))["num_local_experts"] == 4
