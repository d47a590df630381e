"""Config files are read as transformers reads them (``AutoConfig``) when it is installed: the class fills
what config.json leaves out, as the training run will; without transformers the file is read as written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sp_plan.cli.autoconfig import load_config_file, through_autoconfig
from sp_plan.cost_models.errors import CostModelError

pytest.importorskip("transformers")

SPARSE_LLAMA = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 16}


def _write(tmp_path: Path, config: dict, folder: str = "my-model") -> Path:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def test_class_defaults_fill_what_config_json_leaves_out(tmp_path):
    spec = load_config_file(_write(tmp_path, SPARSE_LLAMA))
    # LlamaConfig's defaults: intermediate_size 11008, vocab 32000, one KV head per query head
    assert (spec.ffn_hidden_size, spec.vocab_size, spec.num_kv_heads, spec.name) == (11008, 32000, 16, "my-model")


def test_without_transformers_the_file_is_read_as_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    assert through_autoconfig(dict(SPARSE_LLAMA)) == SPARSE_LLAMA
    with pytest.raises(CostModelError, match="lacks required field 'intermediate_size'"):
        load_config_file(_write(tmp_path, SPARSE_LLAMA))


def test_the_class_decides_the_window_as_transformers_runs_it(tmp_path):
    qwen2 = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "sliding_window": 32, "use_sliding_window": False}
    assert load_config_file(_write(tmp_path, qwen2)).sliding_window is None
    mistral = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}
    assert load_config_file(_write(tmp_path, mistral, "m")).sliding_window == 4096  # MistralConfig's default


def test_moe_aliases_come_through(tmp_path):
    qwen3_moe = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256}
    spec = load_config_file(_write(tmp_path, qwen3_moe))
    assert spec.moe is not None and spec.moe.num_experts == 4 and spec.moe.top_k == 2


@pytest.mark.parametrize("config, message", [
    ({"model_type": "my_arch", "hidden_size": 64}, "model_type 'my_arch' is not supported"),
    ({**SPARSE_LLAMA, "num_hidden_layers": "four"}, "'num_hidden_layers' must be a whole number"),
    ({**SPARSE_LLAMA, "num_attention_heads": 0}, "num_attention_heads"),
])
def test_what_the_class_accepts_or_rejects_still_gets_one_line(tmp_path, config, message):
    with pytest.raises(CostModelError, match=message) as error:
        load_config_file(_write(tmp_path, config))
    assert "\n" not in str(error.value)


def test_the_console_script_plans_from_an_incomplete_config(tmp_path):
    path = _write(tmp_path, SPARSE_LLAMA)
    run = subprocess.run([str(Path(sys.executable).with_name("sp-plan")), "estimate", "--model", str(path),
                          "--seq-len", "8K", "--gpus", "8", "--ulysses", "8", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr  # read as written, the file lacks intermediate_size and vocab_size
    assert json.loads(run.stdout)["layout"]["ulysses"] == 8
