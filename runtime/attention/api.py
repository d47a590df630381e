"""The public sequence-parallel attention entry points: local, Ring, Ulysses and 2D USP.

Imports run one way: the implementations (:mod:`.kernel`, :mod:`.documents`, :mod:`.groups`,
:mod:`.ring`, :mod:`.ulysses`) know nothing of the custom ops; :mod:`.ops` registers the
``torch.library`` ops over them; this module screens a call's inputs and runs it through those ops (so
selective checkpointing keeps each op's output and LSE instead of replaying the kernel or the ring).

USP (unified sequence parallelism) is Ulysses inside, zigzag (or per-document) Ring outside.

The 2D SP mesh is ring x ulysses (ulysses innermost: its all-to-all wants the fast intra-node links;
the ring's neighbour sends tolerate slower ones). Sequence layout (see
:func:`sp_plan.runtime.context.shard_segments`): the zigzag split over the R ring ranks gives ring rank r the
ring-local sequence [chunk r ; chunk 2R-1-r] of the 2R chunks; Ulysses rank u then holds the u-th
contiguous 1/U slice of it. The Ulysses all-to-all therefore reassembles exactly the ring-local
sequence, in order, for 1/U of the heads, and zigzag ring attention across the ring group (ranks with
the same Ulysses rank hold the same heads) computes the exact result; the second all-to-all returns
the output to the (ring, ulysses) sequence split.

Every entry point takes a v head dim that differs from q/k's (MLA): v (or q and k) is widened with
zeros on the way in and the output narrowed back, which is exact (:mod:`.head_dims`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from sp_plan.runtime.attention.groups import group_name, resolve_group, screen
from sp_plan.runtime.attention.head_dims import equalize_head_dims, narrow_output
from sp_plan.runtime.attention.kernel import check_qkv
from sp_plan.runtime.attention.ops import attention_op, ring_attention_op, ulysses_head_to_seq_op, ulysses_qkv_to_heads_op
from sp_plan.runtime.attention.ring import LAYOUTS, check_layout, needs_grad

InnerAttention = Callable[..., torch.Tensor]


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Single-device attention (autograd-aware); the LSE, if returned, carries no gradient.

    ``cu_seqlens``: packed documents (:mod:`sp_plan.runtime.attention.documents`): cumulative document
    boundaries over the flattened ``(batch x seq)``; every token attends only within its document.
    Runs as the ``sp_plan::attention`` custom op (:mod:`sp_plan.runtime.attention.ops`), so selective
    checkpointing keeps its output and LSE instead of re-running the kernel.
    """
    q, k, v, scale, v_dim = equalize_head_dims(q, k, v, scale)
    scale = screen(None, "attention", (q, k, v), scale)
    out, lse = attention_op(q, k, v, causal, scale, backend, cu_seqlens)
    out = narrow_output(out, v_dim)
    return (out, lse) if return_lse else out


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    layout: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    _agreed: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the sequence split across ``group`` (ring degree P = its size).

    q ``(B, s, H, D)``, k/v ``(B, s, KVH, D)`` are this rank's shards (s = S/P tokens). ``layout``
    (``"zigzag"``, ``"contiguous"`` or ``"per_document"``, see :mod:`sp_plan.runtime.attention.ring`) is
    required with ``causal=True`` and with ``cu_seqlens``; non-causal attention without documents works with any split. ``cu_seqlens``:
    packed documents, the cumulative boundaries over the flattened full ``(B x S)`` sequence (the same
    on every rank). Returns this rank's output ``(B, s, H, D)`` (and the fp32 LSE ``(B, H, s)`` if
    ``return_lse``; it carries no gradient). All checks (shapes, scale and documents agreeing across the
    ranks, layout, even zigzag length, empty or mismatched tensors) meet in one agreement all-gather per
    call inside the op, so bad input raises a RuntimeConfigError on every rank, never a hang.
    ``_agreed`` (internal, USP): the caller already ran that check across the whole grid.
    """
    world = dist.get_world_size(group)
    q, k, v, scale, v_dim = equalize_head_dims(q, k, v, scale)
    scale = screen(group, "ring attention", (q, k, v), scale)
    if world == 1:
        if layout is not None and layout not in LAYOUTS:
            check_layout(layout, causal, world, cu_seqlens is not None)
        result = local_attention(q, k, v, causal=causal, scale=scale, backend=backend, return_lse=True,
                                 cu_seqlens=cu_seqlens)
        out, lse = narrow_output(result[0], v_dim), result[1]
        return (out, lse) if return_lse else out

    # One custom op (forward: the ring pass; backward: the dK/dV ring), so selective checkpointing keeps
    # its output and LSE and never replays the ring in the recompute.
    out, lse = ring_attention_op(q, k, v, group_name(group), causal, scale, backend, layout or "", cu_seqlens,
                                 _agreed, needs_grad(q, k, v))
    out = narrow_output(out, v_dim)
    return (out, lse) if return_lse else out


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    inner: InnerAttention | None = None,
    cu_seqlens: torch.Tensor | None = None,
    _outer: str = "",
) -> torch.Tensor:
    """Exact attention over the sequence split contiguously across ``group`` (Ulysses degree U).

    q ``(B, s, H, D)`` and k/v ``(B, s, KVH, D)`` hold this rank's s = S/U consecutive tokens with all
    local heads; returns this rank's output ``(B, s, H, D)``. ``inner(q, k, v, causal=, scale=,
    backend=, cu_seqlens=)`` computes attention on the head-split, full-sequence tensors (default: the
    local kernel; USP passes ring attention over the outer group). ``cu_seqlens``: packed documents over
    the flattened full ``(B x S)`` sequence (:mod:`sp_plan.runtime.attention.documents`), handed to ``inner``
    unchanged (after the all-to-all each rank holds the whole sequence for its heads). Every call first
    checks that every rank holds the same shapes and valid inputs (one small all-gather; bad input raises
    a RuntimeConfigError on every rank, never a hang).
    """
    world = dist.get_world_size(group)
    q, k, v, scale, v_dim = equalize_head_dims(q, k, v, scale)
    scale = screen(group, "Ulysses attention", (q, k, v), scale, outer=resolve_group(_outer) if _outer else None)
    if inner is None:
        inner = local_attention
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    if world == 1:
        check_qkv(q, k, v, causal=False, scale=scale)
        return narrow_output(inner(q, k, v, causal=causal, scale=scale, backend=backend, **extra), v_dim)

    name = group_name(group)
    # Q/K/V all-to-all (recomputed by selective checkpointing) and the output all-to-all (kept): custom ops.
    # ``_outer``: USP's ring group, checked together with this one (see sp_plan.runtime.attention.groups.agree).

    qh, kh, vh = ulysses_qkv_to_heads_op(q, k, v, name, world, causal, scale, cu_seqlens, _outer,
                                         needs_grad(q, k, v))
    out = inner(qh, kh, vh, causal=causal, scale=scale, backend=backend, **extra)
    return narrow_output(ulysses_head_to_seq_op(out, name, world), v_dim)


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    layout: str = "zigzag",
) -> torch.Tensor:
    """Exact attention with the sequence split over ring x ulysses (USP layout; ``layout`` is the ring's:
    ``"zigzag"``, or ``"per_document"`` for packed rows sharded per document).

    q ``(B, s, H, D)``, k/v ``(B, s, KVH, D)`` with s = S / (R*U) tokens in the USP layout. Query heads
    must divide by U; KV heads are split or replicated as in :func:`ulysses_attention`. ``cu_seqlens``:
    packed documents over the flattened full ``(B x S)`` sequence.
    """
    # The Ulysses step checks agreement over the whole ring x ulysses grid (both groups, one verdict), so the
    # ring step only runs its local checks: any problem anywhere raises on every rank, none waits.
    grid = dist.get_world_size(ulysses_group) > 1 and dist.get_world_size(ring_group) > 1
    inner = functools.partial(ring_attention, group=ring_group, layout=layout, _agreed=grid)
    return ulysses_attention(q, k, v, ulysses_group, causal=causal, scale=scale, backend=backend, inner=inner,
                             cu_seqlens=cu_seqlens, _outer=group_name(ring_group) if grid else "")
