"""The runtime's sequence-parallel attention is full causal attention: models it cannot run as they are
defined (a sliding window shorter than the sequence, Gemma's and Phi-3's modules) are refused in one clear
line by auto_configure (2 CPU ranks, tiny configs) and by ``sp-plan train``'s model builder, never trained
as a different model and never a crash."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from sp_plan.cost_models import ModelSpec  # noqa: E402
from tests.distributed import error_of, run_ranks  # noqa: E402

SEQ = 64
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _models():
    import transformers

    return {
        "mistral window 16": transformers.MistralConfig(**TINY, sliding_window=16),
        "gemma2": transformers.Gemma2Config(**TINY, sliding_window=16),
        "gemma3_text": transformers.Gemma3TextConfig(**TINY, sliding_window=16),
        "phi3": transformers.Phi3Config(**{k: v for k, v in TINY.items() if k != "head_dim"}, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2),
    }


def _rank(rank: int, world: int) -> dict:
    import transformers

    from sp_plan.runtime.auto import auto_configure

    out = {}
    for case, config in _models().items():
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        out[case] = error_of(lambda: auto_configure(model, seq_len=SEQ, micro_batch=1, global_batch=2, dtype="fp32",
                                                    topology="dgx-h100", fixed_layout={"ulysses": 2}))
    return out


def test_auto_configure_refuses_what_it_cannot_run():
    results = run_ranks(2, _rank)
    for per_rank in results:
        assert "sliding-window attention (16 tokens) is not supported" in per_rank["mistral window 16"]
        for family in ("gemma2", "gemma3_text", "phi3"):
            error = per_rank[family]
            assert error is not None and error.startswith("RuntimeConfigError") and "\n" not in error
            assert f"{family!r} is not supported by the runtime" in error


@pytest.mark.parametrize("update, message", [
    ({"sliding_window": 16}, "within a 16-token window"),
    ({"extra_norms_per_layer": 2}, "post-attention and post-MLP norms"),
])
def test_sp_plan_train_refuses_a_planned_model_it_would_build_differently(update, message):
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.models.base import refuse_unbuildable

    spec = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=128)
    refuse_unbuildable(spec, SEQ)  # a plain model is built as planned
    refuse_unbuildable(spec.model_copy(update={"sliding_window": SEQ}), SEQ)  # a window as long as the sequence
    with pytest.raises(RuntimeConfigError, match=message):
        refuse_unbuildable(spec.model_copy(update=update), SEQ)


@pytest.mark.parametrize("preset, message", [
    ("qwen3-30b-a3b", "mixture-of-experts layers"),
    ("deepseek-v3", "MLA attention"),
])
def test_the_runtime_builders_refuse_moe_and_mla_specs_instead_of_building_a_dense_model(preset, message):
    from sp_plan.cost_models.model_spec import get_model_preset
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.models import LlamaModel
    from sp_plan.runtime.models.base import refuse_unbuildable

    spec = get_model_preset(preset)
    with pytest.raises(RuntimeConfigError, match="are not built by the runtime's models"):
        refuse_unbuildable(spec, SEQ)
    tiny = spec.model_copy(update={"num_layers": 1, "vocab_size": 16})
    with pytest.raises(RuntimeConfigError, match=message):
        LlamaModel(tiny)
