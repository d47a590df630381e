"""DeepSpeed-Ulysses attention: all-to-all from sequence-split to head-split and back.

Each of the U ranks holds a contiguous 1/U of the sequence with all (local) heads. One all-to-all
turns that into the whole sequence for 1/U of the heads, attention runs locally (or, in USP, as ring
attention across the outer ring group), and a second all-to-all brings the output back to the
sequence split. Q, K and V travel in ONE all-to-all (packed per destination), so the forward issues
two all-to-alls per layer and the backward their mirror images (dO, then dQ/dK/dV packed), with the
same bytes: (U-1)/U x (|Q| + |K| + |V|) and (U-1)/U x |O| in each direction.

KV heads: when U divides the KV heads each rank gets KV/U of them. When the KV heads are fewer than
U (GQA/MQA at high degree), each KV head is repeated ``rep = U / KV`` times BEFORE the all-to-all
(``repeat_interleave``, so query head h still meets KV head h // group), and autograd sums the
replicas' gradients locally; no extra communication. Query heads must divide by U.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sp_plan.runtime import comm_counter
from sp_plan.runtime.errors import RuntimeConfigError


def valid_ulysses_degrees(q_heads: int, kv_heads: int) -> list[int]:
    """Degrees that split ``q_heads`` evenly and either split or replicate ``kv_heads``."""
    return [
        d for d in range(1, q_heads + 1) if q_heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    ]


def ulysses_kv_replication(q_heads: int, kv_heads: int, degree: int) -> int:
    """How many times each (local) KV head is repeated before the all-to-all; raises if impossible.

    Mirrors :meth:`sp_plan.cost_models.model_spec.ModelSpec.kv_replication` for the heads one TP rank holds.
    """
    if q_heads % degree:
        valid = ", ".join(map(str, valid_ulysses_degrees(q_heads, kv_heads)))
        raise RuntimeConfigError(
            f"ulysses={degree} does not divide {q_heads} query heads; valid Ulysses degrees for these heads: "
            f"{valid}, or move the extra degree to ring"
        )
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads == 0:
        return degree // kv_heads
    valid = ", ".join(map(str, valid_ulysses_degrees(q_heads, kv_heads)))
    raise RuntimeConfigError(
        f"ulysses={degree} neither divides nor is a multiple of {kv_heads} KV heads, so KV heads can be "
        f"neither split nor replicated evenly; valid Ulysses degrees: {valid}, or move the extra degree to ring"
    )


# ----- the two all-to-alls (each the other's adjoint) --------------------------------------------


def _all_to_all(send: torch.Tensor, group, world: int, phase: str) -> torch.Tensor:
    recv = torch.empty_like(send)
    comm_counter.record_all_to_all(send, world, phase)  # type: ignore[arg-type]
    dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_head(tensors: list[torch.Tensor], group, world: int, phase: str = "forward") -> list[torch.Tensor]:
    """Each ``(B, s, H_i, D)`` -> ``(B, world*s, H_i/world, D)``, all in one all-to-all.

    Destination j receives heads ``[j*H_i/world, (j+1)*H_i/world)`` of every tensor; the gathered
    sequence is ordered by source rank.
    """
    batch, seq, _, head_dim = tensors[0].shape
    widths = [x.shape[2] // world for x in tensors]
    send = torch.empty((world, batch, seq, sum(widths), head_dim), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for x, width in zip(tensors, widths):
        chunks = x.reshape(batch, seq, world, width, head_dim).permute(2, 0, 1, 3, 4)  # dim 0: destination
        send[..., offset : offset + width, :].copy_(chunks)
        offset += width
    recv = _all_to_all(send, group, world, phase)
    outs, offset = [], 0
    for width in widths:
        part = recv[..., offset : offset + width, :]  # (world, B, s, w, D), dim 0 = sequence chunk
        outs.append(part.permute(1, 0, 2, 3, 4).reshape(batch, world * seq, width, head_dim))
        offset += width
    return outs


def head_to_seq(tensors: list[torch.Tensor], group, world: int, phase: str = "forward") -> list[torch.Tensor]:
    """Each ``(B, S, h_i, D)`` -> ``(B, S/world, world*h_i, D)``: the inverse of :func:`seq_to_head`."""
    batch, seq, _, head_dim = tensors[0].shape
    local = seq // world
    widths = [y.shape[2] for y in tensors]
    send = torch.empty((world, batch, local, sum(widths), head_dim), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for y, width in zip(tensors, widths):
        chunks = y.reshape(batch, world, local, width, head_dim).permute(1, 0, 2, 3, 4)  # dim 0: destination
        send[..., offset : offset + width, :].copy_(chunks)
        offset += width
    recv = _all_to_all(send, group, world, phase)
    outs, offset = [], 0
    for width in widths:
        part = recv[..., offset : offset + width, :]  # (world, B, s, w, D), dim 0 = head group
        outs.append(part.permute(1, 2, 0, 3, 4).reshape(batch, local, world * width, head_dim))
        offset += width
    return outs


