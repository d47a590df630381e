"""The exactness harness shared by the HF mixture-of-experts runtime tests (test_hf_moe, test_hf_mla,
test_ep_runtime): the tiny Qwen3-MoE and Mixtral configs, the token batches, the single-process reference
run, the gradients a sharded run reads, and the comparison of a run with the reference."""

from __future__ import annotations

import pytest
import torch

STEPS, BATCH, SEQ, VOCAB, LR = 2, 2, 16, 128, 1e-3
#: Tiny Qwen3-MoE and Mixtral: 2 layers, 4 heads (2 KV heads), 4 experts, top-2.
MOE_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=VOCAB, max_position_embeddings=128, attention_dropout=0.0, tie_word_embeddings=False,
                  num_experts_per_tok=2)
MOE_FAMILIES = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, intermediate_size=48),
}


def moe_config(family: str, **overrides):
    import transformers

    config_cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[family]
    return config_cls(**{**MOE_COMMON, **MOE_FAMILIES[family], **overrides})


def moe_model(family: str, attn: str = "sdpa", **overrides):
    """A seeded tiny Qwen3-MoE or Mixtral in fp32."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family, **overrides), attn_implementation=attn)
    return model.float()


def token_batches() -> list[torch.Tensor]:
    """One ``BATCH x SEQ`` batch of token ids per step, the same in every process."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def reference_run(model) -> tuple[list[float], list[dict]]:
    """``model`` trained in one process on :func:`token_batches` (AdamW): each step's loss and gradients."""
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for ids in token_batches():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def full_grads(setup) -> dict:
    """Every parameter's whole gradient on this rank (sharded ones gathered), as numpy arrays."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().numpy().copy()
            for n, p in setup.named_parameters()}


def sharded_run(setup, **step_options) -> tuple[list[float], list[dict], object]:
    """``setup`` trained on :func:`token_batches` (each data-parallel rank its own sequences; AdamW, the
    gradients read before each step): each step's loss and whole gradients, and the optimizer."""
    from sp_plan.runtime.step import train_step

    optimizer = setup.make_optimizer(lr=LR)
    per_rank = BATCH // setup.dp_size
    losses, grads = [], []
    for ids in token_batches():
        mine = ids[setup.dp_rank * per_rank:(setup.dp_rank + 1) * per_rank]
        result = train_step(setup, [mine], **step_options)  # gradients only: read them, then step
        losses.append(result.loss)
        grads.append(full_grads(setup))
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, optimizer


def assert_matches_reference(results, ref_losses: list[float], ref_grads: list[dict]) -> None:
    """Every rank's ``(losses, grads)`` equal the reference's: losses and each gradient within 1e-5."""
    for losses, grads in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            assert sorted(got) == sorted(want)
            for name, grad in want.items():
                torch.testing.assert_close(torch.from_numpy(got[name]), grad, rtol=0, atol=1e-5,
                                           msg=f"step {step}: {name}")
