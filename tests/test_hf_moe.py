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

pytest.importorskip("transformers")

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec  # noqa: E402
from tests.distributed import error_of, run_ranks  # noqa: E402
from tests.moe_checks import (  # noqa: E402
    BATCH, MOE_FAMILIES, SEQ, VOCAB, assert_matches_reference, moe_config, moe_model, reference_run,
    sharded_run)

pytestmark = pytest.mark.multiproc

FAMILIES = MOE_FAMILIES
#: (family, layout, options): each family under Ulysses or Ring alone and under USP (Ring x Ulysses).
CASES = [
    ("qwen3_moe", Layout(ulysses=2), {"zero_stage": 3, "checkpointing": "full"}),
    ("mixtral", Layout(ring=2), {"zero_stage": 2, "checkpointing": "none"}),
    ("qwen3_moe", Layout(ring=2, ulysses=2), {"zero_stage": 3, "checkpointing": "selective"}),
    ("mixtral", Layout(ring=2, ulysses=2), {"zero_stage": 1, "checkpointing": "full"}),
]


_config, _model = moe_config, moe_model


def _dense_stand_in(family: str) -> ModelSpec:
    """The dense ModelSpec of the same attention shape (what a plan can name until MoE specs exist)."""
    config = _config(family)
    return ModelSpec(name=f"{family}-attention-shape", num_layers=config.num_hidden_layers,
                     hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                     ffn_hidden_size=2 * config.hidden_size, vocab_size=VOCAB, tied_embeddings=False,
                     qk_norm=family == "qwen3_moe")


def _reference(family: str) -> tuple[list[float], list[dict]]:
    return reference_run(_model(family))


def _train(rank: int, world: int, family: str, layout: Layout, options: dict) -> tuple[list[float], list[dict]]:
    from sp_plan.runtime.auto import auto_configure

    model = _model(family, attn="eager")
    setup = auto_configure(model, seq_len=SEQ, micro_batch=BATCH, global_batch=BATCH, dtype="fp32",
                           topology="dgx-h100", fixed_layout=layout.degrees(), fixed_options=options)
    assert setup.model.config._attn_implementation == "sp_plan"
    assert setup.plan.model.moe is not None and setup.plan.model.moe.num_experts == 4
    assert setup.plan.layout == layout
    losses, grads, _ = sharded_run(setup)
    return losses, grads


@pytest.mark.parametrize(("family", "layout", "options"), CASES,
                         ids=[f"{f}-ring{lay.ring}-ulysses{lay.ulysses}" for f, lay, _ in CASES])
def test_moe_training_matches_one_process(family: str, layout: Layout, options: dict) -> None:
    assert_matches_reference(run_ranks(layout.world, _train, family, layout, options), *_reference(family))


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
