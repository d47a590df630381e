import json

import pytest

from sp_plan.cost_models import CostModelError, Layout, TrainSpec, get_gpu_preset, get_model_preset, load_model
from sp_plan.cost_models.model_spec import model_preset_names
from sp_plan.cost_models.gpu_spec import gpu_preset_names
from sp_plan.cost_models.units import parse_seq_len

REQUIRED_MODELS = [
    "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b", "qwen3-4b", "qwen3-32b", "mistral-7b", "gpt3-6.7b",
]


@pytest.mark.parametrize("name", model_preset_names())
def test_param_count_matches_published_total(name):
    model = get_model_preset(name)
    assert model.published_params is not None
    assert abs(model.num_params / model.published_params - 1) < 0.01


def test_required_presets_present_and_mqa_example():
    names = set(model_preset_names())
    assert set(REQUIRED_MODELS) <= names
    assert any(get_model_preset(n).num_kv_heads == 1 for n in names)


def test_llama3_70b_architecture_exact():
    m = get_model_preset("llama3-70b")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_hidden_size) == (
        80, 8192, 64, 8, 128, 28672)
    assert m.num_params == 70_553_706_496


def test_unknown_model_lists_presets():
    with pytest.raises(CostModelError, match="llama3-70b"):
        get_model_preset("llama9-1t")


@pytest.mark.parametrize(
    "config, expected",
    [
        (dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
              num_key_value_heads=8, intermediate_size=14336, vocab_size=128256), 8_030_261_248),
        (dict(model_type="qwen3", num_hidden_layers=36, hidden_size=2560, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
              tie_word_embeddings=True), 4_022_468_096),
        (dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
              num_key_value_heads=4, intermediate_size=18944, vocab_size=152064), 7_615_616_512),
        (dict(model_type="mistral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
              num_key_value_heads=8, intermediate_size=14336, vocab_size=32000), 7_241_732_096),
    ],
)
def test_hf_config_json_loads_offline(tmp_path, config, expected):
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    model = load_model(str(path))
    assert model.num_params == expected
    assert load_model(str(path.parent)).num_params == expected  # folder works too


@pytest.mark.parametrize(
    "payload, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"model_type": "llama"}), "lacks required field"),
        (json.dumps({"model_type": "gpt_neox"}), "not supported"),
        (json.dumps([1, 2]), "JSON object"),
    ],
)
def test_bad_hf_config_is_explained(tmp_path, payload, message):
    path = tmp_path / "config.json"
    path.write_text(payload)
    with pytest.raises(CostModelError, match=message):
        load_model(str(path))


def test_missing_config_path():
    with pytest.raises(CostModelError, match="not found"):
        load_model("/nonexistent/config.json")


@pytest.mark.parametrize("name", ["a100-40gb", "a100-80gb", "h100-80gb", "h200", "b200", "l40s"])
def test_gpu_presets(name):
    gpu = get_gpu_preset(name)
    assert gpu.memory_bytes > 30 * 2**30
    assert gpu.flops_for("bf16") > 1e14
    assert name in gpu_preset_names()


def test_gpu_h100_numbers():
    gpu = get_gpu_preset("h100-80gb")
    assert gpu.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert gpu.memory_bytes == 81559 * 2**20


@pytest.mark.parametrize("text, value", [("128K", 131072), ("1M", 1 << 20), ("1000000", 1_000_000), (4096, 4096),
                                         ("1.5K", 1536)])
def test_parse_seq_len(text, value):
    assert parse_seq_len(text) == value


@pytest.mark.parametrize("text", ["0", "-5", "abc", "1e30", "2G", "1.3K"])
def test_parse_seq_len_rejects(text):
    with pytest.raises(CostModelError):
        parse_seq_len(text)


def test_layout_fills_dp_shard():
    layout = Layout.for_world(16, ulysses=8, tp=None)
    assert layout.dp_shard == 2 and layout.world == 16 and layout.shard_group == 16


def test_layout_product_mismatch():
    with pytest.raises(CostModelError, match="uses 32 GPUs but --gpus is 8"):
        Layout.for_world(8, ulysses=8, dp_shard=4)
    with pytest.raises(CostModelError, match="must divide the GPU count"):
        Layout.for_world(8, ulysses=3)


def test_layout_head_divisibility_message():
    qwen = get_model_preset("qwen2.5-7b")  # 28 heads
    with pytest.raises(CostModelError, match=r"ulysses=8 does not divide 28 query heads; valid Ulysses degrees "
                                             r"for this model: 1, 2, 4, 7, 14, 28"):
        Layout(ulysses=8).check_against(qwen, 8192)


def test_layout_kv_replication_allowed_and_sequence_divisibility():
    llama = get_model_preset("llama3-70b")  # 8 KV heads
    Layout(ulysses=16).check_against(llama, 16 * 1024)  # KV replicated x2
    assert llama.kv_replication(16) == 2
    with pytest.raises(CostModelError, match="not divisible by ulysses x ring = 8 x 2 \\(zigzag ring\\) = 16"):
        Layout(ulysses=4, ring=2).check_against(llama, 1000)


def test_train_spec_validation():
    assert TrainSpec(seq_len="128K").seq_len == 131072
    with pytest.raises(ValueError):
        TrainSpec(seq_len=1024, offload_params=True, zero_stage=2)
