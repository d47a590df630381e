"""Rank-side helpers shared by the multi-rank attention tests: distributed vs the fp64 reference.

Every rank builds the same full-sequence inputs from a seed, computes the fp64 reference of the
whole problem, runs the distributed attention on its shards and reports error statistics of its
shard. The parent combines them over ranks into global errors (max-norm and RMS relative), so the
numbers describe the whole output, not one rank's piece.
"""

from __future__ import annotations

import torch

from sp_plan.cost_models.layout import Layout
from sp_plan.runtime.attention.api import local_attention
from sp_plan.runtime.attention.kernel import reference_attention
from sp_plan.runtime.context import SequenceParallel

NAMES = ("out", "dq", "dk", "dv")
#: (max |err|, max |ref|, sum err^2, sum ref^2) of one tensor on one rank.
Stats = tuple[float, float, float, float]


def sp_context(world: int, ring: int, ulysses: int, backend: str | None = None) -> SequenceParallel:
    """A SequenceParallel context from a mesh built for ring x ulysses (the rest of the world is dp_shard)."""
    from sp_plan.runtime.mesh import build_mesh

    mesh = build_mesh(Layout(ring=ring, ulysses=ulysses, dp_shard=world // (ring * ulysses)), device_type="cpu")
    return SequenceParallel.from_mesh(mesh, backend=backend)


def full_inputs(seed: int, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """The same full-sequence q, k, v, dout on every rank (values exactly representable in ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    q_shape, kv_shape = (batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def stats(actual: torch.Tensor, expected: torch.Tensor) -> Stats:
    err = actual.double() - expected.double()
    ref = expected.double()
    return err.abs().max().item(), ref.abs().max().item(), (err * err).sum().item(), (ref * ref).sum().item()


def reference(q, k, v, dout, causal: bool, scale: float | None):
    """fp64 output and gradients of the full problem."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, _ = reference_attention(*leaves, causal=causal, scale=scale)
    out.backward(dout.double())
    return (out.detach(), *(x.grad for x in leaves))


def distributed(sp: SequenceParallel, q, k, v, dout, causal: bool, scale: float | None):
    """This rank's output and gradients (local shards) through ``sp.attention``."""
    leaves = [sp.shard(x).detach().clone().requires_grad_() for x in (q, k, v)]
    out = sp.attention(*leaves, causal=causal, scale=scale)
    out.backward(sp.shard(dout))
    return (out.detach(), *(x.grad for x in leaves))


def single_device(q, k, v, dout, causal: bool, scale: float | None):
    """One local kernel call on the whole problem, in the inputs' dtype."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = local_attention(*leaves, causal=causal, scale=scale)
    out.backward(dout)
    return (out.detach(), *(x.grad for x in leaves))


def run_case(sp: SequenceParallel, *, seed: int, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype, causal: bool, scale: float | None = None,
             with_single: bool = False) -> dict[str, dict[str, Stats]]:
    """Error stats of this rank's shard of out, dq, dk, dv (and of a single-device call, if asked)."""
    q, k, v, dout = full_inputs(seed, batch, seq, heads, kv_heads, head_dim, dtype)
    expected = [sp.shard(e) for e in reference(q, k, v, dout, causal, scale)]
    result = {"dist": dict(zip(NAMES, map(stats, distributed(sp, q, k, v, dout, causal, scale), expected)))}
    if with_single:
        single = [sp.shard(s) for s in single_device(q, k, v, dout, causal, scale)]
        result["single"] = dict(zip(NAMES, map(stats, single, expected)))
    return result


def combine(per_rank: list[dict[str, Stats]]) -> dict[str, tuple[float, float]]:
    """Global (max-norm relative, RMS relative) error per tensor from every rank's shard stats."""
    combined = {}
    for name in NAMES:
        rows = [r[name] for r in per_rank]
        max_err = max(r[0] for r in rows)
        max_ref = max(r[1] for r in rows)
        sq_err = sum(r[2] for r in rows)
        sq_ref = sum(r[3] for r in rows)
        combined[name] = (max_err / max_ref, (sq_err / sq_ref) ** 0.5)
    return combined
