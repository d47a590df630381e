"""HF config.json families (cost_models/hf_config.py) and sliding-window attention priced as it runs.

Fixtures in tests/fixtures/hf_configs/ are the real config.json fields of published models; their parameter
counts are checked against each model's published total, and the presets against the same configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sp_plan.cost_models import CostModelError, Layout, TrainSpec, get_gpu_preset, get_model_preset, load_model
from sp_plan.cost_models.compute_time import compute_time
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.flops import attention_pairs, band_pairs, causal_pairs, microbatch_work
from sp_plan.cost_models.hf_config import HF_FAMILIES
from sp_plan.cost_models.model_spec import load_hf_config, model_from_hf_dict  # the re-exports

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"
H100 = get_gpu_preset("h100-80gb")

#: fixture -> (published total, where it is published, the preset with the same architecture or None).
PUBLISHED = {
    "mistral-7b-v0.1": (7_241_732_096, "safetensors total of mistralai/Mistral-7B-v0.1", "mistral-7b"),
    "gemma-7b": (8_540_000_000, "google/gemma-7b on the hub: 8.54B params", None),
    "gemma-2-9b": (9_241_705_984, "keras-hub gemma2_9b_en preset metadata", "gemma-2-9b"),
    "gemma-3-12b-pt": (11_765_788_416, "keras-hub gemma3_12b_text preset metadata (text decoder)", "gemma-3-12b"),
    "phi-3-mini-4k-instruct": (3_821_079_552, "keras-hub phi3_mini_4k_instruct_en preset metadata", "phi-3-mini"),
    "phi-3-medium-4k-instruct": (14_000_000_000, "model card: 14B parameters", "phi-3-medium"),
    "qwen2.5-7b": (7_615_616_512, "safetensors total of Qwen/Qwen2.5-7B", "qwen2.5-7b"),
}

#: fixture -> (sliding window, layers using it) as transformers reads the config.
WINDOWS = {
    "mistral-7b-v0.1": (4096, 32),
    "gemma-7b": (None, 0),
    "gemma-2-9b": (4096, 21),  # every other layer (Gemma2Config.layer_types)
    "gemma-3-12b-pt": (1024, 40),  # 5 of every 6 (sliding_window_pattern 6)
    "phi-3-mini-4k-instruct": (2047, 32),
    "phi-3-medium-4k-instruct": (2047, 40),
    "qwen2.5-7b": (None, 0),  # use_sliding_window false
}

SPEC_SHAPE = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size",
              "tied_embeddings", "activation", "qkv_bias", "attn_out_bias", "qk_norm", "extra_norms_per_layer",
              "sliding_window", "windowed_layers")


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_configs_count_their_published_parameters(name, tmp_path):
    published, _source, preset = PUBLISHED[name]
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text((FIXTURES / f"{name}.json").read_text())
    model = load_model(str(path))
    assert abs(model.num_params / published - 1) < 0.005
    assert (model.sliding_window, model.windowed_layers) == WINDOWS[name]
    if preset is not None:  # the shipped preset is the same architecture
        shipped = get_model_preset(preset)
        assert [getattr(model, f) for f in SPEC_SHAPE] == [getattr(shipped, f) for f in SPEC_SHAPE]
        assert model.num_params == shipped.num_params


def test_gemma_families_map_their_architecture():
    gemma2 = model_from_hf_dict(fixture("gemma-2-9b"))
    assert (gemma2.head_dim, gemma2.tied_embeddings, gemma2.norms_per_layer, gemma2.qk_norm) == (256, True, 4, False)
    gemma3 = model_from_hf_dict(fixture("gemma-3-12b-pt"))  # the decoder of the multimodal wrapper
    assert (gemma3.head_dim, gemma3.vocab_size, gemma3.qk_norm, gemma3.norms_per_layer) == (256, 262_208, True, 4)
    # the two extra norms per layer and the q/k norms are counted
    plain = gemma3.model_copy(update={"extra_norms_per_layer": 0, "qk_norm": False})
    assert gemma3.num_params - plain.num_params == 48 * (2 * 3840 + 2 * 256)
    # gemma3_text on its own reads the same fields
    text = {**fixture("gemma-3-12b-pt")["text_config"]}
    assert model_from_hf_dict(text).num_params == gemma3.num_params
    # Phi-3's fused qkv_proj / gate_up_proj hold exactly the separate projections' parameters
    phi = model_from_hf_dict(fixture("phi-3-mini-4k-instruct"))
    h, f = 3072, 8192
    fused_qkv, fused_gate_up, o, down = h * 3 * h, h * 2 * f, h * h, f * h
    assert phi.params_per_layer() == fused_qkv + o + fused_gate_up + down + 2 * h
    assert HF_FAMILIES["phi3"].fused == ("qkv_proj", "gate_up_proj")


def test_window_rules_and_layer_types():
    qwen = {**fixture("qwen2.5-7b"), "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    model = model_from_hf_dict(qwen)
    assert (model.sliding_window, model.windowed_layers) == (4096, 8)  # layers 20..27
    kinds = ["sliding_attention", "full_attention"] * 14
    assert model_from_hf_dict({**qwen, "layer_types": kinds}).windowed_layers == 14  # layer_types wins
    gemma3 = {**fixture("gemma-3-12b-pt")["text_config"], "sliding_window_pattern": 4}
    assert model_from_hf_dict(gemma3).windowed_layers == 36
    assert model_from_hf_dict({**fixture("mistral-7b-v0.1"), "sliding_window": None}).sliding_window is None
    without_key = {k: v for k, v in fixture("mistral-7b-v0.1").items() if k != "sliding_window"}
    assert model_from_hf_dict(without_key).sliding_window == 4096  # MistralConfig's default, as transformers runs it
    llama = {**fixture("mistral-7b-v0.1"), "model_type": "llama"}  # a stray key the family does not read
    assert model_from_hf_dict(llama).sliding_window is None


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 0}, "'sliding_window' is 0; it must be between 1"),
    ({"sliding_window": 1e400}, "finite whole number"),
    ({"sliding_window": "4K"}, "whole number"),
    ({"layer_types": ["sliding_attention"] * 3}, "one kind per layer"),
    ({"layer_types": ["chunked_attention"] * 32}, "chunked_attention are not modelled"),
    ({"model_type": "gemma3"}, "'text_config' object"),
    ({"num_local_experts": 8}, "mixture-of-experts"),
    ({"model_type": "gpt_neox"}, "supported families are deepseek_v2, deepseek_v3, gemma, gemma2, gemma3, gemma3_text, llama, mistral, mixtral, phi3"),
])
def test_hostile_window_fields_are_one_line_errors(change, message, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**fixture("mistral-7b-v0.1"), **change}).replace("Infinity", "1e400"))
    with pytest.raises(CostModelError, match=message):
        load_hf_config(path)


# ----- sliding-window attention, priced ---------------------------------------------------------------------


def test_pair_counts():
    assert causal_pairs(10) == 55 and causal_pairs(10, 10) == 55 and causal_pairs(10, 4) == 10 * 4 - 4 * 3 / 2
    brute = sum(1 for i in range(0, 9) for j in range(3, 12) if i - 5 < j <= i)
    assert band_pairs(0, 9, 3, 12, 5) == brute
    s, w = 1 << 15, 4096
    assert attention_pairs(s, True, window=w) == s * w - w * (w - 1) / 2
    assert attention_pairs(s, True, window=s) == attention_pairs(s, True) == s * (s + 1) / 2
    assert attention_pairs(s, False, window=w) == float(s) * s  # a materialized attention computes every pair
    assert attention_pairs(s, True, 8192, w) == s / 8192 * causal_pairs(8192, w)  # packed documents too
    # zigzag ring chunks cover every in-window pair exactly once
    r, c = 4, s / 8
    chunks = [k for rank in range(r) for k in (rank, 2 * r - 1 - rank)]
    total = sum(band_pairs(q * c, (q + 1) * c, k * c, (k + 1) * c, w) for q in chunks for k in range(2 * r))
    assert total == causal_pairs(s, w)


MISTRAL = get_model_preset("mistral-7b")
NO_WINDOW = MISTRAL.model_copy(update={"sliding_window": None})


@pytest.mark.parametrize("layout", [Layout(ulysses=4), Layout(ring=4), Layout(ring=2, ulysses=2), Layout(tp=2)])
def test_a_window_not_shorter_than_the_sequence_changes_nothing(layout):
    train = TrainSpec(seq_len=4096, checkpointing="full")
    assert microbatch_work(MISTRAL, train, layout) == microbatch_work(NO_WINDOW, train, layout)
    with_window = estimate(MISTRAL, train, layout, H100)
    without = estimate(NO_WINDOW, train, layout, H100)
    assert with_window.time.step_s == without.time.step_s
    assert with_window.memory.total == without.memory.total


@pytest.mark.parametrize("layout", [Layout(ulysses=8), Layout(ring=8), Layout(ring=4, ulysses=2)])
def test_a_shorter_window_prices_only_its_pairs(layout):
    train = TrainSpec(seq_len=128 * 1024)
    s, w = train.seq_len, 4096
    windowed, full = microbatch_work(MISTRAL, train, layout), microbatch_work(NO_WINDOW, train, layout)
    assert windowed.layer_attn_fwd / full.layer_attn_fwd == pytest.approx(causal_pairs(s, w) / causal_pairs(s))
    assert windowed.layer_matmul_fwd == full.layer_matmul_fwd
    e_w, e_f = estimate(MISTRAL, train, layout, H100), estimate(NO_WINDOW, train, layout, H100)
    assert e_w.time.step_s < e_f.time.step_s
    # flash attention's activations do not depend on the window: memory is unchanged
    assert e_w.memory.total == e_f.memory.total


def test_attention_time_is_the_mean_over_local_and_global_layers():
    from sp_plan.cost_models.profile import resolve_profile
    from sp_plan.cost_models.topology import default_topology

    gemma = get_model_preset("gemma-2-9b")  # 21 local (4096) + 21 global layers
    train, layout = TrainSpec(seq_len=64 * 1024), Layout(ulysses=8)
    topology = default_topology("h100-80gb", 8, 8)
    profile = resolve_profile(topology.gpu.name)
    local = gemma.model_copy(update={"sliding_window_layers": None})
    full = gemma.model_copy(update={"sliding_window": None, "sliding_window_layers": None})
    times = [compute_time(m, train, layout, topology, profile).attention_forward for m in (gemma, local, full)]
    assert times[0] == pytest.approx((times[1] + times[2]) / 2, rel=1e-12)
    assert times[1] < times[0] < times[2]
    ring = Layout(ring=8)
    ring_times = [compute_time(m, train, ring, topology, profile).attention_forward for m in (gemma, local, full)]
    assert ring_times[0] == pytest.approx((ring_times[1] + ring_times[2]) / 2, rel=1e-12)
    assert ring_times[1] < ring_times[2]


def test_ring_window_skipping_counts_each_steps_busiest_rank():
    from sp_plan.cost_models.strategies.ring import _busiest_step_pairs

    r, c, w = 4, 8, 11  # 64 tokens in 8 zigzag chunks of 8; rank i holds chunks i and 7 - i

    def owner(position):
        chunk = position // c
        return chunk if chunk < r else 2 * r - 1 - chunk

    work = [[0] * r for _ in range(r)]  # [rank][step]: pairs computed, by brute force
    for i in range(2 * r * c):
        for j in range(max(0, i - w + 1), i + 1):
            work[owner(i)][(owner(i) - owner(j)) % r] += 1
    busiest = [max(work[rank][step] for rank in range(r)) for step in range(r)]
    assert _busiest_step_pairs(r, c, w) == tuple(float(p) for p in busiest if p)


def test_a_gemma3_config_json_through_the_console_script(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "gemma-3-12b-pt" / "config.json"
    path.parent.mkdir()
    path.write_text((FIXTURES / "gemma-3-12b-pt.json").read_text())
    script = Path(sys.executable).with_name("sp-plan")
    runs = [subprocess.run([str(script), "estimate", "--model", model, "--seq-len", "32K", "--gpus", "8",
                            "--ulysses", "8", "--json"], capture_output=True, text=True, timeout=120)
            for model in (str(path), "gemma-3-12b")]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    local, preset = (json.loads(run.stdout) for run in runs)
    assert local["memory"] == preset["memory"] and local["time"]["step_s"] == preset["time"]["step_s"]
