"""Ring attention with zigzag causal load balancing, exact forward and backward.

Each of the P ranks of the ring group keeps its query block and sees every K/V block once: at step
``i`` it computes attention against the block of rank ``(r - i) mod P`` while that block's successor
is already in flight (``batch_isend_irecv`` to rank r+1 / from rank r-1, posted before the compute,
waited after it). Partial outputs and LSEs are merged in fp32 (fp64 for fp64 inputs) with the stable
log-sum-exp merge (:mod:`runtime.attention.merge`).

Backward (custom autograd): K and V rotate again (P-1 sends in the compute dtype) and the dK/dV
accumulators (fp32) travel with their blocks, each rank adding its share; after P sends every
accumulator is back with its owner. Block gradients come from the kernel's backward given the
*merged* output and LSE, which makes them the exact gradients of the global softmax. The dK/dV send
of step ``i`` overlaps the compute of step ``i+1``.

Zigzag layout (causal): the sequence is cut into 2P chunks and ring rank r holds chunks r and
2P-1-r, concatenated. With ``src`` the rank whose K/V block is visiting:

* ``src == r`` (step 0): local q against local k with a causal kernel (the only causal call);
* ``src <  r``: all local queries against the first chunk of the block (its second chunk is in the
  future of both query chunks), non-causal;
* ``src >  r``: the second query chunk against the whole block (the first query chunk precedes
  both key chunks), non-causal.

Every rank therefore does one causal 2c x 2c block plus P-1 blocks of c x 2c (c = chunk length):
equal work on every rank, and no kernel call ever sees a fully masked row.

Non-causal ring attention is layout-agnostic: every step is the full block, non-causal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from runtime import comm_counter
from runtime.attention.kernel import attention_backward, attention_forward, check_qkv, default_scale, lse_dtype
from runtime.attention.merge import merge_into
from runtime.errors import RuntimeConfigError

#: P2P tags keep the K/V rotation and the dK/dV rotation apart (NCCL ignores them; gloo matches on them).
_KV_TAG = 0
_DKV_TAG = 1


class _Pending:
    """The outstanding isend/irecv pair of one ring step."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class RingComm:
    """Neighbour exchange on a ring process group: send to rank r+1, receive from rank r-1."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, phase: str, tag: int) -> _Pending:
        """Post ``send`` -> next and ``recv`` <- previous; returns the handle to wait on."""
        comm_counter.record("send_recv", comm_counter.tensor_bytes(send), phase)  # type: ignore[arg-type]
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return _Pending(dist.batch_isend_irecv(ops))


class BlockPlan(NamedTuple):
    """What one ring step computes: query rows, rows of the visiting K/V block, causal kernel or not."""

    q_rows: slice
    kv_rows: slice
    causal: bool


_ALL = slice(None)


def block_plan(step: int, rank: int, world: int, causal: bool, local_seq: int) -> BlockPlan:
    """The zigzag schedule (see module docstring) for ring ``rank`` at ``step``."""
    if not causal:
        return BlockPlan(_ALL, _ALL, False)
    if step == 0:
        return BlockPlan(_ALL, _ALL, True)
    half = local_seq // 2
    source = (rank - step) % world
    if source < rank:
        return BlockPlan(_ALL, slice(0, half), False)
    return BlockPlan(slice(half, None), _ALL, False)


def _ring_forward(q, k, v, comm: RingComm, causal: bool, scale: float, backend: str | None):
    kv = torch.stack((k, v))  # the unit that travels: one message per step
    spare = torch.empty_like(kv)
    out = lse = None
    for step in range(comm.world):
        pending = comm.exchange(kv, spare, "forward", _KV_TAG) if step + 1 < comm.world else None
        plan = block_plan(step, comm.rank, comm.world, causal, q.shape[1])
        block_out, block_lse = attention_forward(
            q[:, plan.q_rows], kv[0][:, plan.kv_rows], kv[1][:, plan.kv_rows],
            causal=plan.causal, scale=scale, backend=backend,
        )
        if out is None:  # step 0 covers every query row
            lse = block_lse.clone()
            visible = torch.isfinite(lse).transpose(1, 2).unsqueeze(-1)
            out = torch.where(visible, block_out.to(lse.dtype), torch.zeros((), dtype=lse.dtype, device=q.device))
        else:
            merge_into(out[:, plan.q_rows], lse[:, :, plan.q_rows], block_out, block_lse)
        if pending is not None:
            pending.wait()
            kv, spare = spare, kv
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, comm: RingComm, causal: bool, scale: float, backend: str | None):
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack((k, v))
    kv_spare = torch.empty_like(kv)
    dkv = None
    dkv_spare = torch.empty(kv.shape, dtype=acc, device=q.device)
    dkv_pending = None
    for step in range(comm.world):
        kv_pending = comm.exchange(kv, kv_spare, "backward", _KV_TAG) if step + 1 < comm.world else None
        plan = block_plan(step, comm.rank, comm.world, causal, q.shape[1])
        rows, kv_rows = plan.q_rows, plan.kv_rows
        block_dq, block_dk, block_dv = attention_backward(
            dout[:, rows], q[:, rows], kv[0][:, kv_rows], kv[1][:, kv_rows], out[:, rows], lse[:, :, rows],
            causal=plan.causal, scale=scale, backend=backend,
        )
        dq[:, rows] += block_dq
        if dkv_pending is None:
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # our own block's accumulator
        else:
            dkv_pending.wait()  # the accumulator of the block we now hold, from the previous rank
            dkv, dkv_spare = dkv_spare, dkv
        dkv[0][:, kv_rows] += block_dk
        dkv[1][:, kv_rows] += block_dv
        dkv_pending = comm.exchange(dkv, dkv_spare, "backward", _DKV_TAG)
        if kv_pending is not None:
            kv_pending.wait()
            kv, kv_spare = kv_spare, kv
    dkv_pending.wait()  # after P hops our own block's accumulator is home
    return dq.to(q.dtype), dkv_spare[0].to(k.dtype), dkv_spare[1].to(v.dtype)


def check_ring_shapes(q: torch.Tensor, k: torch.Tensor, world: int, causal: bool) -> None:
    if q.shape[1] != k.shape[1]:
        raise RuntimeConfigError(
            f"ring attention needs local q and k/v shards of equal length (self-attention), got "
            f"{q.shape[1]} and {k.shape[1]} tokens"
        )
    if causal and q.shape[1] % 2:
        raise RuntimeConfigError(
            f"zigzag causal ring attention needs an even local sequence (two chunks per rank), got "
            f"{q.shape[1]} tokens: pad the sequence to a multiple of 2 x ring = {2 * world}"
        )


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the sequence split across ``group`` (ring degree P = its size).

    q ``(B, s, H, D)``, k/v ``(B, s, KVH, D)`` are this rank's shards (s = S/P tokens); with
    ``causal=True`` they must be in the zigzag layout (:func:`runtime.context.shard_segments`), with
    ``causal=False`` any layout works. Returns this rank's output ``(B, s, H, D)`` (and the fp32 LSE
    ``(B, H, s)`` if ``return_lse``; it carries no gradient).
    """
    from runtime.attention.kernel import local_attention

    check_qkv(q, k, v, causal)
    world = dist.get_world_size(group)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if world == 1:
        return local_attention(q, k, v, causal=causal, scale=scale, backend=backend, return_lse=return_lse)
    check_ring_shapes(q, k, world, causal)
    from runtime.attention.ops import group_name, ring_attention_op

    # One custom op (forward: the ring pass; backward: the dK/dV ring), so selective checkpointing keeps
    # its output and LSE and never replays the ring in the recompute.
    out, lse = ring_attention_op(q, k, v, group_name(group), causal, scale, backend)
    return (out, lse) if return_lse else out
