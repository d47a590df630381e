"""``sp-plan train --model config.json`` trains the Hugging Face architecture a config.json describes, through the
console script: a tiny DeepSeek-V3 (MLA attention with a v head dim unlike q/k's, YaRN RoPE given the way
DeepSeek's own config.json gives it, a dense first layer, then group-limited MoE with a shared expert) on 2
CPU gloo ranks under Ulysses 2 with FSDP2, a few steps. What the runtime cannot train exactly is refused in
one line before any step (tensor parallelism of the latent attention), and a config.json the runtime does not
drive, or with too small a vocabulary for the byte-level corpus, is refused with what to change.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

#: DeepSeek-V3's config.json fields at toy sizes, vocabulary = the byte-level corpus's 259 tokens.
TINY_DEEPSEEK = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 259, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 12, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
}
COMMON = ["--seq-len", "64", "--dtype", "fp32", "--topology", "dgx-h100", "--corpus-bytes", "100000",
          "--no-progress", "--log-every", "1"]


def _console_script() -> str:
    return str(Path(sys.executable).with_name("sp-plan"))


def _train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([_console_script(), "train", *args, *COMMON], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.multiproc
def test_a_deepseek_config_trains_under_ulysses_through_the_console_script(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
    done = _train(["--model", "config.json", "--ulysses", "2", "--nproc-per-node", "2", "--steps", "3"], tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "plan: ulysses=2 on 2 rank(s) for deepseek_v3-2l-64h" in out, out[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+ \| loss ([0-9.]+)", out)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), out[-3000:]
    assert losses[-1] < losses[0], losses  # three steps of AdamW on byte tokens learn something


def test_tensor_parallelism_of_mla_is_refused_before_any_step(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
    done = _train(["--model", "config.json", "--tp", "2", "--steps", "1"], tmp_path)  # one process: refused first
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "error: tp=2: tensor parallelism does not split multi-head latent attention" in out, out[-3000:]
    assert "re-plan with --tp 1" in out
    assert "Traceback" not in out, out[-3000:]
    assert "step 1 |" not in out


@pytest.mark.parametrize(("update", "message"), [
    ({"vocab_size": 128}, "vocab_size 128 is smaller than the tokenizer's 259"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not trained by the runtime"),
])
def test_configs_the_runtime_cannot_train_are_refused_in_one_line(tmp_path, update, message):
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.train_options import VOCAB, TrainRunOptions
    from sp_plan.runtime.train_run import build_configured_hf_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_DEEPSEEK, **update}))
    with pytest.raises(RuntimeConfigError, match=re.escape(message)):
        build_configured_hf_model(TrainRunOptions(model_config=path), VOCAB)
    with pytest.raises(RuntimeConfigError, match="no such file"):
        build_configured_hf_model(TrainRunOptions(model_config=tmp_path / "missing.json"), VOCAB)
