"""USP (unified sequence parallelism): Ulysses inside, zigzag Ring outside.

The 2D SP mesh is ring x ulysses (ulysses innermost: its all-to-all wants the fast intra-node links;
the ring's neighbour sends tolerate slower ones). Sequence layout (see
:func:`sp_plan.runtime.context.shard_segments`): the zigzag split over the R ring ranks gives ring rank r the
ring-local sequence [chunk r ; chunk 2R-1-r] of the 2R chunks; Ulysses rank u then holds the u-th
contiguous 1/U slice of it. The Ulysses all-to-all therefore reassembles exactly the ring-local
sequence, in order, for 1/U of the heads, and zigzag ring attention across the ring group (ranks with
the same Ulysses rank hold the same heads) computes the exact result; the second all-to-all returns
the output to the (ring, ulysses) sequence split.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from sp_plan.runtime.attention.ring import ring_attention
from sp_plan.runtime.attention.ulysses import ulysses_attention


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
) -> torch.Tensor:
    """Exact attention with the sequence split over ring x ulysses (USP layout).

    q ``(B, s, H, D)``, k/v ``(B, s, KVH, D)`` with s = S / (R*U) tokens in the USP layout. Query heads
    must divide by U; KV heads are split or replicated as in :func:`ulysses_attention`. ``cu_seqlens``:
    packed documents over the flattened full ``(B x S)`` sequence.
    """
    from sp_plan.runtime.attention.groups import group_name

    # The Ulysses step checks agreement over the whole ring x ulysses grid (both groups, one verdict), so the
    # ring step only runs its local checks: any problem anywhere raises on every rank, none waits.
    grid = dist.get_world_size(ulysses_group) > 1 and dist.get_world_size(ring_group) > 1
    inner = functools.partial(ring_attention, group=ring_group, layout="zigzag", _agreed=grid)
    return ulysses_attention(q, k, v, ulysses_group, causal=causal, scale=scale, backend=backend, inner=inner,
                             cu_seqlens=cu_seqlens, _outer=group_name(ring_group) if grid else "")
