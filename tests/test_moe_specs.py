"""Mixture-of-experts and MLA model specs (issue 20, item 1): HF config.json parsing, presets, parameter
counts total and active against the published ones, and the hand count of a tiny spec."""

import json
import pathlib
import subprocess

import pytest
from sp_plan.cost_models import CostModelError, get_model_preset, load_model
from sp_plan.cost_models.memory.states import tp_params
from sp_plan.cost_models.model_spec import ModelSpec, model_from_hf_dict
from sp_plan.cost_models.moe import MLASpec, MoESpec
from sp_plan.cost_models.strategies.tp import tp_local_layer_params, tp_local_other_params

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf_configs"
SP_PLAN = pathlib.Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sp-plan"

#: (fixture, preset, published total, published active, tolerance on active, convention of the active count).
#: Sources: Qwen3-30B-A3B and Qwen3-235B-A22B model cards ("30.5B in total and 3.3B activated", "235B / 22B");
#: Mixtral of Experts (Mistral AI, 2024: 46.7B / 12.9B); DeepSeek-V3 README_WEIGHTS.md (main model 671B,
#: 36.6B activated *without* the input embedding; the 11.5B MTP module is not counted); DeepSeek-V2 paper
#: (236B / 21B). Qwen3-30B-A3B's card rounds its active count: the architecture gives 3.353B, 1.6% above
#: "3.3B" (2.73B without the two 0.31B embeddings), so that one row is checked to 2%.
PUBLISHED = [
    ("qwen3-30b-a3b", "qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02, "all"),
    ("qwen3-235b-a22b", "qwen3-235b-a22b", 235e9, 22e9, 0.01, "all"),
    ("mixtral-8x7b", "mixtral-8x7b", 46.7e9, 12.9e9, 0.01, "all"),
    ("deepseek-v3", "deepseek-v3", 671e9, 36.6e9, 0.01, "no input embedding"),
    ("deepseek-v2", None, 236e9, 21e9, 0.01, "no input embedding"),
]


def _active(model: ModelSpec, convention: str) -> int:
    return model.active_params - (model.embedding_params() if convention == "no input embedding" else 0)


@pytest.mark.parametrize("fixture, preset, total, active, tol, convention", PUBLISHED)
def test_counts_match_published_totals(fixture, preset, total, active, tol, convention):
    model = load_model(FIXTURES / f"{fixture}.json")
    assert abs(model.num_params / total - 1) < 0.01
    assert abs(_active(model, convention) / active - 1) < tol
    assert model.active_params < model.num_params
    if preset:  # the shipped preset is the same architecture as the real config.json
        spec = get_model_preset(preset)
        assert spec.model_dump(exclude={"name", "published_params", "published_active_params"}) == model.model_dump(
            exclude={"name", "published_params", "published_active_params"})
        assert abs(spec.active_params / spec.published_active_params - 1) < max(tol, 0.015)


def test_deepseek_v3_exact_breakdown():
    """671,026,404,352 = 61 MLA layers + 3 dense FFNs + 58 MoE FFNs (256 routed + 1 shared + router) + embeddings."""
    m = get_model_preset("deepseek-v3")
    h = 7168
    mla = (h * 1536 + 1536 + 1536 * 128 * 192) + (h * 576 + 512 + 512 * 128 * 256) + 128 * 128 * h
    assert m.attention_params_per_layer() == mla == 187_107_328
    moe_ffn = 256 * 3 * h * 2048 + 3 * h * 2048 + 256 * h
    expected = 61 * (mla + 2 * h) + 3 * 3 * h * 18432 + 58 * moe_ffn + 2 * 129280 * h + h
    assert m.num_params == expected == 671_026_404_352
    active_ffn = 8 * 3 * h * 2048 + 3 * h * 2048 + 256 * h
    assert m.active_params == expected - 58 * moe_ffn + 58 * active_ffn


def test_tiny_moe_hand_count():
    """4 layers (layer 0 dense), hidden 8, 4 experts of width 6, top-2, one shared expert of width 4."""
    moe = MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=6, num_shared_experts=1,
                  shared_expert_ffn_hidden_size=4, dense_layers=(0,))
    m = ModelSpec(name="tiny-moe", num_layers=4, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                  ffn_hidden_size=16, vocab_size=10, moe=moe)
    attention = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k, v, o
    norms = 2 * 8
    dense_ffn = 3 * 8 * 16
    moe_ffn = 4 * (3 * 8 * 6) + 3 * 8 * 4 + 8 * 4  # experts, shared, router
    moe_active = 2 * (3 * 8 * 6) + 3 * 8 * 4 + 8 * 4
    embeddings = 2 * 10 * 8 + 8  # embedding, lm_head, final norm
    assert m.moe_layer_count == 3
    assert m.num_params == 4 * (attention + norms) + dense_ffn + 3 * moe_ffn + embeddings
    assert m.active_params == 4 * (attention + norms) + dense_ffn + 3 * moe_active + embeddings
    # TP ranks hold the model between them; FSDP's per-layer traffic sums to the same layers.
    assert tp_params(m, 1).total == m.num_params
    assert 4 * tp_local_layer_params(m, 1) + tp_local_other_params(m, 1) == m.num_params
    p2 = tp_params(m, 2)
    attention_tp2 = 8 * 4 + 2 * 8 * 4 + 4 * 8  # q and o split; the one KV head replicated on both ranks
    assert p2.layers_total == 4 * (attention_tp2 + norms) + dense_ffn // 2 + 3 * (4 * 3 * 8 * 3 + 3 * 8 * 2 + 8 * 4)


def test_tiny_mla_hand_count():
    mla = MLASpec(q_lora_rank=6, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3)
    m = ModelSpec(name="tiny-mla", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=6,
                  ffn_hidden_size=16, vocab_size=10, mla=mla)
    q = 8 * 6 + 6 + 6 * 2 * 6
    kv = 8 * (4 + 2) + 4 + 4 * 2 * (4 + 3)
    o = 2 * 3 * 8
    assert m.attention_params_per_layer() == q + kv + o
    assert m.num_params == 2 * (q + kv + o + 3 * 8 * 16 + 16) + 2 * 80 + 8
    assert m.active_params == m.num_params  # no experts: everything is active
    # tp=2: the latent down-projections and norms are replicated, the up- and output projections split.
    assert mla.params(8, 2, tp=2) == 8 * 6 + 6 + 6 * 6 + 8 * 6 + 4 + 4 * 7 + 3 * 8
    with pytest.raises(ValueError, match="num_kv_heads = num_heads"):
        ModelSpec(name="bad", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=6,
                  ffn_hidden_size=16, vocab_size=10, mla=mla)


def test_qwen_sparse_step_and_mlp_only_layers_make_dense_layers():
    config = json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text())
    config.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    m = model_from_hf_dict(config)
    # Qwen: layer i is sparse when (i + 1) % step == 0 and i is not listed: 1 and 5 are; 3 is listed.
    assert m.moe.dense_layers == (0, 2, 3, 4)
    assert m.moe_layer_count == 2


def test_dense_models_serialize_as_before():
    dump = get_model_preset("llama3-8b").model_dump()
    assert not {"moe", "mla", "published_active_params"} & set(dump)
    assert get_model_preset("llama3-8b").active_params == get_model_preset("llama3-8b").num_params
    deepseek = get_model_preset("deepseek-v3")
    assert ModelSpec(**deepseek.model_dump()) == deepseek  # MoE/MLA round-trip


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 200}, "top_k=200 exceeds num_experts=128"),
    ({"num_experts": "many"}, "'num_experts' must be a whole number"),
    ({"moe_intermediate_size": float("nan")}, "'moe_intermediate_size' must be a finite whole number"),
    ({"mlp_only_layers": [99]}, "names layers \\[99\\] outside 0..47"),
    ({"mlp_only_layers": list(range(48))}, "lists every layer"),
    ({"num_experts": None}, "lacks required field 'num_experts'"),
])
def test_bad_moe_configs_are_explained(tmp_path, change, message):
    config = json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text())
    config.update(change)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(CostModelError, match=message):
        load_model(path)


def test_a_bad_moe_config_through_the_console_script_is_one_line(tmp_path):
    config = json.loads((FIXTURES / "mixtral-8x7b.json").read_text())
    config["num_experts_per_tok"] = 9
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = subprocess.run([str(SP_PLAN), "estimate", "--model", str(tmp_path / "config.json"), "--seq-len", "4K",
                          "--gpus", "8"], check=False, capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "top_k=9 exceeds num_experts=8" in out.stderr


def test_a_deepseek_config_without_routed_experts_is_a_dense_mla_model():
    config = json.loads((FIXTURES / "deepseek-v2.json").read_text())
    config.update(n_routed_experts=None, num_hidden_layers=4, q_lora_rank=None)
    m = model_from_hf_dict(config)
    assert m.moe is None and m.mla.q_lora_rank is None
    assert (m.num_kv_heads, m.head_dim) == (128, 192)
    assert m.attention_params_per_layer() == 5120 * 128 * 192 + 5120 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 5120


def test_an_unknown_deepseek_routing_is_refused_with_the_known_ones():
    config = json.loads((FIXTURES / "deepseek-v3.json").read_text())
    config["topk_method"] = "expert_choice"
    with pytest.raises(CostModelError, match="topk_method 'expert_choice' is not modelled; use greedy"):
        model_from_hf_dict(config)


def test_a_real_config_json_and_its_preset_estimate_the_same_through_the_console_script():
    def estimate(model):
        out = subprocess.run([str(SP_PLAN), "estimate", "--model", model, "--seq-len", "32K", "--gpus", "8",
                              "--ulysses", "8", "--json"], check=False, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    from_file, from_preset = estimate(str(FIXTURES / "mixtral-8x7b.json")), estimate("mixtral-8x7b")
    assert from_file["memory"] == from_preset["memory"] and from_file["time"] == from_preset["time"]
