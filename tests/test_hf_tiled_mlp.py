"""The tiled MLP on Hugging Face models (single process): the model's own MLP forward runs over sequence
tiles; loss and every gradient equal the untiled model's (fp64, several tiles, with and without
checkpointing), and the MLP's intermediates are no longer saved for backward."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sp_plan.runtime.hf import TILED_ATTRIBUTE, apply_hf_tiled_mlp, set_hf_checkpointing  # noqa: E402
from sp_plan.runtime.saved_tensor_meter import SavedTensorMeter  # noqa: E402

COMMON = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=128, tie_word_embeddings=False)
BATCH, SEQ, TILE = 2, 40, 16  # 80 tokens in tiles of 16: five tiles, the last one partial


def _model(family: str):
    config = {"llama": transformers.LlamaConfig(**COMMON),
              "qwen3": transformers.Qwen3Config(**COMMON, head_dim=8)}[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_tiled_hf_mlp_gives_the_untiled_loss_and_gradients(family, checkpointing):
    ids = torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    plain = _model(family)
    tiled = copy.deepcopy(plain)
    assert apply_hf_tiled_mlp(tiled, tile_tokens=TILE) == COMMON["num_hidden_layers"]
    assert all(getattr(layer.mlp, TILED_ATTRIBUTE) for layer in tiled.model.layers)
    for model in (plain, tiled):
        set_hf_checkpointing(model, checkpointing)
        model.train()
    loss_a, grads_a = _loss_and_grads(plain, ids)
    loss_b, grads_b = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-13, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-11, atol=1e-14, msg=name)


def test_tiled_hf_mlp_saves_only_its_input():
    """Per layer the eager SwiGLU saves gate, act(gate), up and their product (4 x ffn values per token);
    tiled, only the MLP input (already saved by the norm) stays: the saved bytes drop by those four."""
    ids = torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))

    def saved_bytes(model):
        with SavedTensorMeter(exclude=list(model.parameters())) as meter:
            model(input_ids=ids, use_cache=False).logits.sum()
        return meter.total_bytes

    plain = _model("llama")
    tiled = copy.deepcopy(plain)
    apply_hf_tiled_mlp(tiled, tile_tokens=TILE)
    intermediates = 4 * BATCH * SEQ * COMMON["intermediate_size"] * 8  # fp64
    assert saved_bytes(plain) - saved_bytes(tiled) == COMMON["num_hidden_layers"] * intermediates
