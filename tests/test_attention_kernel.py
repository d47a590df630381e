"""The local attention kernel (out + LSE, backward) against the exact fp64 reference; the LSE merge."""

from __future__ import annotations

import math

import pytest
import torch

from sp_plan.runtime.attention.kernel import (
    BACKEND_ENV,
    KernelWorkCounter,
    attended_pairs,
    attention_backward,
    attention_forward,
    reference_attention,
    select_backend,
)
from sp_plan.runtime.attention.api import local_attention
from sp_plan.runtime.attention.merge import merge_into
from sp_plan.runtime.errors import RuntimeConfigError

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _rel(actual, expected):
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def _inputs(seed, batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, seq_k, kv_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, seq_k, kv_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    dout = torch.randn(batch, seq_q, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("backend", ["sdpa_cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_kernel_matches_reference_forward_and_backward(backend, dtype, causal, heads, kv_heads, scale):
    seq_k = 12 if causal else 20  # non-causal blocks need not be square (ring's half blocks are not)
    q, k, v, dout = _inputs(0, 2, 12, seq_k, heads, kv_heads, 8, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = local_attention(*leaves, causal=causal, scale=scale, backend=backend, return_lse=True)
    out.backward(dout)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_leaves, causal=causal, scale=scale)
    ref_out.backward(dout.double())
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (2, heads, 12) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert leaves[1].grad.shape == k.shape  # GQA gradients come back with kv_heads, not repeated
    actual_all = (out, lse, *(x.grad for x in leaves))
    expected_all = (ref_out, ref_lse, *(x.grad for x in ref_leaves))
    for actual, expected in zip(actual_all, expected_all):
        assert _rel(actual, expected) <= TOL[dtype]


def test_backward_with_a_larger_softmax_gives_that_blocks_share():
    """attention_backward with the merged out/LSE of two key blocks = exact gradient of each block."""
    q, k, v, dout = _inputs(1, 1, 8, 16, 2, 1, 8, torch.float64)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_leaves, causal=False)
    ref_out.backward(dout)
    dk_parts, dq_total = [], torch.zeros_like(q)
    for part in (slice(0, 8), slice(8, 16)):
        dq, dk, _ = attention_backward(dout, q, k[:, part], v[:, part], ref_out, ref_lse, causal=False)
        dq_total += dq
        dk_parts.append(dk)
    assert _rel(dq_total, ref_leaves[0].grad) < 1e-12
    assert _rel(torch.cat(dk_parts, 1), ref_leaves[1].grad) < 1e-12


def test_merge_of_blocks_is_exact_and_masked_rows_stay_finite():
    q, k, v, _ = _inputs(2, 1, 6, 12, 2, 2, 4, torch.float64)
    ref_out, ref_lse = reference_attention(q, k, v, causal=False)
    out, lse = attention_forward(q, k[:, :5], v[:, :5], causal=False)
    out = out.clone()
    for part in (slice(5, 9), slice(9, 12)):
        block_out, block_lse = attention_forward(q, k[:, part], v[:, part], causal=False)
        merge_into(out, lse, block_out, block_lse)
    assert _rel(out, ref_out) < 1e-13 and _rel(lse, ref_lse) < 1e-13

    # Fully masked rows: -inf LSE on either or both sides, and garbage (NaN) in a masked block's output.
    acc_out = torch.zeros(1, 3, 1, 2, dtype=torch.float64)
    acc_lse = torch.full((1, 1, 3), float("-inf"), dtype=torch.float64)
    block_out = torch.tensor([[[[1.0, 2.0]], [[float("nan"), float("nan")]], [[3.0, 4.0]]]], dtype=torch.float64)
    block_lse = torch.tensor([[[0.5, float("-inf"), 1.0]]], dtype=torch.float64)
    merge_into(acc_out, acc_lse, block_out, block_lse)
    assert torch.isfinite(acc_out).all()
    assert acc_out[0, 1].abs().sum() == 0 and acc_lse[0, 0, 1] == float("-inf")
    assert torch.equal(acc_out[0, 0, 0], torch.tensor([1.0, 2.0], dtype=torch.float64))
    merge_into(acc_out, acc_lse, torch.zeros_like(block_out), torch.full_like(block_lse, float("-inf")))
    assert torch.isfinite(acc_out).all() and acc_lse[0, 0, 0] == 0.5


def test_invalid_inputs_are_rejected_with_one_line_messages():
    q, k, v, _ = _inputs(3, 1, 8, 8, 6, 4, 8, torch.float32)
    with pytest.raises(RuntimeConfigError, match="6 query heads are not a multiple of 4 KV heads"):
        local_attention(q, k, v)
    q, k, v, _ = _inputs(3, 1, 8, 12, 4, 2, 8, torch.float32)
    with pytest.raises(RuntimeConfigError, match="causal attention needs as many queries as keys"):
        local_attention(q, k, v, causal=True)
    with pytest.raises(RuntimeConfigError, match="4-D"):
        local_attention(q[0], k[0], v[0], causal=False)
    with pytest.raises(RuntimeConfigError, match="dtypes differ"):
        local_attention(q, k.double(), v.double(), causal=False)


def test_backend_selection_and_override(monkeypatch):
    cpu = torch.zeros(1, 4, 2, 8)
    assert select_backend(cpu) == "sdpa_cpu_flash"
    assert select_backend(cpu, "math") == "math"
    monkeypatch.setenv(BACKEND_ENV, "math")
    assert select_backend(cpu) == "math"
    monkeypatch.setenv(BACKEND_ENV, "flash3")
    with pytest.raises(RuntimeConfigError, match="unknown attention backend 'flash3'"):
        select_backend(cpu)


def test_work_counter_counts_attended_pairs():
    q, k, v, dout = _inputs(4, 2, 10, 10, 4, 2, 8, torch.float32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with KernelWorkCounter() as work:
        local_attention(*leaves, causal=True).backward(dout)
    pairs = attended_pairs(10, 10, causal=True)
    assert pairs == 55
    assert work.forward_calls == 1 and work.backward_calls == 1
    assert work.forward_flops == 4 * 2 * 4 * 8 * pairs
    assert work.backward_flops == math.prod((10, 2, 4, 8)) * pairs
