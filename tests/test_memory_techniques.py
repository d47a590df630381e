"""Tiled MLP, tiled cross-entropy and checkpointed-input offload: same results as the plain paths.

Tolerances, and why:

- tiled MLP: outputs and input gradients are row-wise computations on the same rows (bitwise in bf16
  here; fp32 within 1e-6 relative: the matmul kernel may block a 7-row tile differently from 80 rows).
  Parameter gradients are sums over n tiles instead of one matmul: fp32 1e-5 relative; bf16 at most n
  ulps of the largest entry, because each tile's gradient and each addition round once (the untiled
  matmul rounds once);
- tiled loss: the loss and the weight gradient are sums over chunks (fp32: 1e-5 relative), the
  hidden-state gradient is per token (bf16: identical);
- offload: the block input comes back bit for bit, so everything is identical (``torch.equal``).
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from sp_plan.cost_models import ModelSpec  # noqa: E402
from sp_plan.runtime.errors import RuntimeConfigError  # noqa: E402
from sp_plan.runtime.models import LlamaModel  # noqa: E402
from sp_plan.runtime.offload import CheckpointOffload, apply_checkpoint_offload  # noqa: E402
from sp_plan.runtime.saved_tensor_meter import SavedTensorMeter  # noqa: E402
from sp_plan.runtime.tiled_loss import (  # noqa: E402
    DEFAULT_CHUNK_TOKENS,
    chunk_tokens_for,
    plain_cross_entropy,
    tiled_cross_entropy,
)
from sp_plan.runtime.tiled_mlp import apply_tiled_mlp, tile_tokens_for, tiled_mlp  # noqa: E402

BF16_ULP = 2.0**-7  # spacing of bf16 numbers relative to the leading power of two (8 significant bits)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def spec(layers=2, vocab=97, tied=False, bias=False) -> ModelSpec:
    return ModelSpec(name="tiny", num_layers=layers, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                     ffn_hidden_size=88, vocab_size=vocab, tied_embeddings=tied, mlp_bias=bias)


def model_pair(dtype, checkpointing="none", **kw):
    model = LlamaModel(spec(**kw), checkpointing=checkpointing, dtype=dtype)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model, copy.deepcopy(model)


def train_step(model, ids, dy_seed=3):
    logits = model(ids)
    dy = torch.randn(logits.shape, generator=torch.Generator().manual_seed(dy_seed), dtype=torch.float32)
    (logits.float() * dy).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# ----- tiled MLP ---------------------------------------------------------------------------------------


def test_tile_rule_is_the_memory_models():
    from sp_plan.cost_models.memory import MemoryAssumptions

    assert MemoryAssumptions().tiled_mlp_tile_tokens is None  # default: hidden_size tokens per tile
    assert tile_tokens_for(hidden_size=4096, tokens=32768) == 4096
    assert tile_tokens_for(hidden_size=4096, tokens=1000) == 1000
    assert tile_tokens_for(hidden_size=4096, tokens=32768, tile_tokens=512) == 512
    with pytest.raises(RuntimeConfigError, match="at least 1 token"):
        tile_tokens_for(64, 100, tile_tokens=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_mlp_matches_untiled(dtype, bias):
    plain, tiled = model_pair(dtype, bias=bias)
    apply_tiled_mlp(tiled, tile_tokens=7)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    y0, g0 = train_step(plain, ids)
    y1, g1 = train_step(tiled, ids)
    tiles = math.ceil(2 * 40 / 7)
    if dtype == torch.bfloat16:
        assert torch.equal(y0, y1)
    else:
        assert rel(y1, y0) < 1e-6
    for name, ref in g0.items():
        got = g1[name]
        if dtype == torch.float32:
            assert rel(got, ref) < 1e-5, name
        elif ".mlp." in name:
            # n tiles: n roundings of partial sums instead of one rounding of the whole matmul.
            assert (got.float() - ref.float()).abs().max() <= tiles * BF16_ULP * ref.float().abs().max(), name
        else:  # upstream of the MLP weights only per-token (row-wise) values flow: identical
            assert torch.equal(got, ref), name


def test_tiled_mlp_saves_only_its_input_and_composes_with_checkpointing():
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    for mode in ("none", "selective", "full"):
        plain, tiled = model_pair(torch.bfloat16, checkpointing=mode)
        apply_tiled_mlp(tiled, tile_tokens=16)
        _, g0 = train_step(plain, ids)
        _, g1 = train_step(tiled, ids)
        for name in g0:
            if ".mlp." not in name:
                assert torch.equal(g0[name], g1[name]), (mode, name)
    block = tiled.layers[0]
    block.checkpointing = "none"
    x = torch.randn(2, 40, 32, dtype=torch.bfloat16)
    with SavedTensorMeter(exclude=list(block.mlp.parameters())) as meter:
        y = block.mlp(x)
    y.sum().backward()
    assert [(s.shape, s.dtype) for s in meter.storages.values()] == [((2, 40, 32), torch.bfloat16)]


def test_tiled_mlp_function_gradcheck():
    w1 = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=True)

    def fn(t):
        return torch.tanh(t @ w1.t()) @ w2.t()

    assert torch.autograd.gradcheck(lambda a, b, c: tiled_mlp(fn, a, [b, c], tile_tokens=3), (x, w1, w2))


# ----- tiled loss ---------------------------------------------------------------------------------------


def _loss_case(dtype, tiled: bool, chunk: int, labels):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 150, 32, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(97, 32, generator=gen) * 0.2).to(dtype).requires_grad_()
    if tiled:
        loss, count = tiled_cross_entropy(h, w, labels, chunk_tokens=chunk)
    else:
        loss, count = plain_cross_entropy(torch.nn.functional.linear(h, w), labels)
    (loss / count).backward()
    return loss.detach(), count, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_loss_matches_plain_cross_entropy(dtype):
    labels = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(2))
    labels[0, :70] = -100  # chunks 0 and 1 (of 32 tokens) are fully ignored, chunk 2 partly
    labels[1, 120:] = -100
    ref = _loss_case(dtype, False, 0, labels)
    got = _loss_case(dtype, True, 32, labels)
    assert got[1] == ref[1] == int((labels != -100).sum())
    assert rel(got[0], ref[0]) < 1e-6
    if dtype == torch.bfloat16:
        assert torch.equal(got[2], ref[2])
        chunks = math.ceil(300 / 32)
        assert (got[3].float() - ref[3].float()).abs().max() <= chunks * BF16_ULP * ref[3].float().abs().max()
    else:
        assert rel(got[2], ref[2]) < 1e-5 and rel(got[3], ref[3]) < 1e-5


def test_tiled_loss_skips_ignored_chunks_and_handles_no_valid_tokens():
    from torch.profiler import ProfilerActivity, profile

    labels = torch.full((1, 256), -100)
    labels[0, 200:] = 5
    h = torch.randn(1, 256, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss, count = tiled_cross_entropy(h, w, labels, chunk_tokens=64)
    assert len([e for e in prof.events() if e.name == "aten::linear"]) == 1  # only the last chunk has labels
    loss.backward()
    assert count == 56 and torch.count_nonzero(h.grad[0, :192]) == 0
    none = torch.full((1, 256), -100)
    loss, count = tiled_cross_entropy(h, w, none, chunk_tokens=64)
    assert loss.item() == 0.0 and count.item() == 0
    loss.backward()  # a rank with no valid label still takes part in backward


def test_chunk_rule_is_the_memory_models():
    from sp_plan.cost_models.memory import MemoryAssumptions

    assert DEFAULT_CHUNK_TOKENS == MemoryAssumptions().loss_chunk_tokens
    assert chunk_tokens_for(100) == 100 and chunk_tokens_for(10**6) == DEFAULT_CHUNK_TOKENS
    with pytest.raises(RuntimeConfigError, match="at least 1 token"):
        chunk_tokens_for(10, 0)


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_loss_tiled_equals_plain_on_the_model(tied):
    from sp_plan.runtime.tiled_loss import causal_lm_loss

    plain, tiled = model_pair(torch.float32, tied=tied)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (2, 48), generator=gen)
    labels = torch.randint(0, 97, (2, 48), generator=gen)
    labels[:, -1] = -100
    results = []
    for model, is_tiled in ((plain, False), (tiled, True)):
        loss, count = causal_lm_loss(model, ids, labels, tiled=is_tiled, chunk_tokens=20)
        (loss / count).backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert rel(results[1][0], results[0][0]) < 1e-6
    for name, ref in results[0][1].items():
        assert rel(results[1][1][name], ref) < 1e-5, name


# ----- checkpointed-input offload ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_offload_is_exact_and_moves_each_block_input_to_the_host(mode):
    plain, offloaded = model_pair(torch.bfloat16, checkpointing=mode, layers=3)
    offload = apply_checkpoint_offload(offloaded)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    metered = []
    for model in (plain, offloaded):
        with SavedTensorMeter(exclude=list(model.parameters())) as meter:
            logits = model(ids)
        logits.float().square().mean().backward()
        metered.append((logits.detach(), meter.total_bytes, {n: p.grad for n, p in model.named_parameters()}))
    x_in = 2 * 40 * 32 * 2  # one block input, bf16
    assert torch.equal(metered[0][0], metered[1][0])
    assert all(torch.equal(metered[0][2][n], g) for n, g in metered[1][2].items())
    assert metered[0][1] - metered[1][1] == 3 * x_in  # what autograd keeps on the device shrinks by L inputs
    assert offload.offloaded_tensors == 3 and offload.offloaded_bytes == 3 * x_in
    assert offload.peak_host_bytes == 3 * x_in and offload.host_bytes == 0  # freed after backward


def test_offload_needs_checkpointing():
    model = LlamaModel(spec(), checkpointing="none")
    with pytest.raises(RuntimeConfigError, match="not checkpointed"):
        apply_checkpoint_offload(model)
    model.layers[0].checkpoint_offload = CheckpointOffload()
    with pytest.raises(RuntimeConfigError, match="checkpointing is 'none'"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_offload_composes_with_outer_saved_tensor_hooks():
    """Tensors the offload does not take go to the hooks active outside (here: a meter)."""
    plain, offloaded = model_pair(torch.float32, checkpointing="full", layers=1)
    apply_checkpoint_offload(offloaded)
    ids = torch.randint(0, 97, (1, 16))
    sizes = []
    for model in (plain, offloaded):
        with SavedTensorMeter(exclude=list(model.parameters())) as meter:
            y = model(ids)
        y.sum().backward()
        sizes.append(Counter((s.shape, s.dtype) for s in meter.storages.values()))
    assert sizes[0] - sizes[1] == Counter({((1, 16, 32), torch.float32): 1})  # only the block input left
    assert not sizes[1] - sizes[0]
