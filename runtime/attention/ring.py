"""Ring attention with zigzag causal load balancing, exact forward and backward.

Each of the P ranks of the ring group keeps its query block and sees every K/V block once: at step
``i`` it computes attention against the block of rank ``(r - i) mod P`` while that block's successor
is already in flight (``batch_isend_irecv`` to rank r+1 / from rank r-1, posted before the compute,
waited after it). Partial outputs and LSEs are merged in fp32 (fp64 for fp64 inputs) with the stable
log-sum-exp merge (:mod:`sp_plan.runtime.attention.merge`).

Backward (its own custom op): K and V rotate again (P-1 sends in the compute dtype) and the dK/dV
accumulators (fp32) travel with their blocks, each rank adding its share; after P sends every
accumulator is back with its owner. Block gradients come from the kernel's backward given the
*merged* output and LSE, which makes them the exact gradients of the global softmax. The dK/dV send
of step ``i`` overlaps the compute of step ``i+1``.

**Layouts.** Causal attention depends on which global positions each rank holds, so a causal call
must say (``layout=``; :class:`sp_plan.runtime.context.SequenceParallel` always passes ``"zigzag"``, the
layout its shard function produces). There is no default: a contiguous split computed with the zigzag
schedule would be silently wrong. Every rank of the group must declare the same layout (checked once
per group, with the local shapes, see :mod:`sp_plan.runtime.attention.groups`).

``"zigzag"`` (load-balanced): the sequence is cut into 2P chunks and ring rank r holds chunks r and
2P-1-r, concatenated. With ``src`` the rank whose K/V block is visiting:

* ``src == r`` (step 0): local q against local k with a causal kernel (the only causal call);
* ``src <  r``: all local queries against the first chunk of the block (its second chunk is in the
  future of both query chunks), non-causal;
* ``src >  r``: the second query chunk against the whole block (the first query chunk precedes
  both key chunks), non-causal.

Every rank therefore does one causal 2c x 2c block plus P-1 blocks of c x 2c (c = chunk length):
equal work on every rank, and no kernel call ever sees a fully masked row.

``"contiguous"``: rank r holds the r-th contiguous 1/P of the sequence. Step 0 is the causal diagonal,
blocks from earlier ranks are fully visible, blocks from later ranks are skipped (nothing to compute;
the K/V and dK/dV blocks still travel). Exact but unbalanced: rank P-1 does 2P-1 times rank 0's work.

``"per_document"`` (packed rows, Megatron-Core's THD head-tail split): every document of a row (its
length a multiple of 2P: the data path pads it) is cut into 2P chunks and rank r holds chunks r and
2P-1-r of EVERY document, in row order, so each document's 2c rows sit at the same local offset on every
rank and local order still increases. Per document, the zigzag rule above applies
(:func:`per_document_pairs`): the diagonal step is the doc's causal 2c x 2c square, an earlier source's
head chunk is seen fully by all of the doc's queries, a later source's two chunks fully by the doc's
tail chunk. So every rank does the same work for any mix of document lengths (zigzag over the whole row
does not: the rank holding most of a long document does most of it). Without documents (or with one per
row) it is the zigzag layout.

Non-causal ring attention without documents is layout-agnostic: every step is the full block.

**Documents** (packed sequences, ``cu_seqlens``): each step's block is split per document
(:mod:`sp_plan.runtime.attention.documents`); a step whose block holds no (query, key) pair of a common
document is skipped. Needs the layout also when non-causal (to know the global positions).

**GPU path.** K and V travel as two P2P sends straight from the input tensors and two receive buffers
each (double buffering, allocated once per call, reused across the steps); no K/V stack. The kernels
get row slices without copies (flash-attn needs only the last dim contiguous); the LSE rows the
backward kernel reads are made contiguous once per call (at most two distinct row ranges), and with
the flash-attn backends the block gradients are written into three buffers allocated once per call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from sp_plan.runtime import comm_counter
from sp_plan.runtime.attention.documents import (
    Pair,
    RowBounds,
    block_pairs,
    documents_backward,
    documents_forward,
    row_bounds,
    single_document_rows,
    take,
)
from sp_plan.runtime.attention.groups import agree
from sp_plan.runtime.attention.kernel import (
    GRAD_BUFFER_BACKENDS,
    attention_backward,
    attention_forward,
    check_qkv,
    lse_dtype,
    select_backend,
)
from sp_plan.runtime.attention.merge import merge_into
from sp_plan.runtime.errors import RuntimeConfigError

#: P2P tags keep the K, V and dK/dV messages apart (NCCL ignores them; gloo matches on them).
_K_TAG = 0
_DKV_TAG = 1
_V_TAG = 2

#: Sequence layouts a causal (or document-masked) ring call may declare.
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous", "per_document")


class _Pending:
    """The outstanding isend/irecv ops of one ring step."""

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

    def exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], phase: str,
                 tags: list[int]) -> _Pending:
        """Post every ``sends[i]`` -> next and ``recvs[i]`` <- previous (tag ``tags[i]``); one handle."""
        comm_counter.record("send_recv", sum(comm_counter.tensor_bytes(t) for t in sends), phase)  # type: ignore[arg-type]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t, tag in zip(sends, tags)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t, tag in zip(recvs, tags)]
        return _Pending(dist.batch_isend_irecv(ops))


class BlockPlan(NamedTuple):
    """What one ring step computes: query rows, rows of the visiting K/V block, causal kernel or not."""

    q_rows: slice
    kv_rows: slice
    causal: bool


_ALL = slice(None)


def block_plan(step: int, rank: int, world: int, causal: bool, local_seq: int,
               layout: str | None = "zigzag") -> BlockPlan | None:
    """The schedule (see module docstring) for ring ``rank`` at ``step``; None: nothing to compute."""
    if not causal:
        return BlockPlan(_ALL, _ALL, False)
    if step == 0:
        return BlockPlan(_ALL, _ALL, True)
    source = (rank - step) % world
    if layout == "contiguous":
        return BlockPlan(_ALL, _ALL, False) if source < rank else None
    half = local_seq // 2
    if source < rank:
        return BlockPlan(_ALL, slice(0, half), False)
    return BlockPlan(slice(half, None), _ALL, False)


def ring_runs(layout: str, rank: int, world: int, local_seq: int) -> tuple[tuple[int, int], ...]:
    """Global (start, length) runs of the rows ring ``rank`` holds, in local order."""
    if layout == "contiguous":
        return ((rank * local_seq, local_seq),)
    chunk = local_seq // 2
    return ((rank * chunk, chunk), ((2 * world - 1 - rank) * chunk, chunk))


class _Step(NamedTuple):
    q_rows: slice
    kv_rows: slice
    causal: bool
    pairs: tuple | None  # document sub-blocks (None: no documents, one kernel call)


def per_document_length_problem(chunks: int, length: int) -> str:
    return (f"per-document ring sharding needs every document's length to be a multiple of 2 x ring = {chunks}, "
            f"got a document of {length} tokens: prepare the batch with sp_plan.runtime.data.BatchSharder over "
            "SequenceParallel(..., sharding='per_document'), which pads each document")


@functools.lru_cache(maxsize=1024)
def per_document_pairs(bounds: RowBounds, rank: int, source: int, world: int, causal: bool) -> tuple[Pair, ...]:
    """The sub-blocks of ring ``rank``'s queries against ring ``source``'s keys under the per-document layout:
    each document (its length a multiple of 2P, as the sharder pads it) in 2P chunks, rank r holding chunks r
    and 2P-1-r of every document, so the doc's rows sit at the same local offset on every rank. Per document:
    the diagonal step is the causal square; an earlier source's head chunk is visible to all of the document's
    queries; a later source's two chunks are visible to the document's tail chunk (the module docstring's
    zigzag rule, applied inside every document)."""
    chunks = 2 * world
    pairs = []
    for row, bounds_row in enumerate(bounds):
        offset = 0
        for lo, hi in zip(bounds_row, bounds_row[1:]):
            length = hi - lo
            if length % chunks:
                raise RuntimeConfigError(per_document_length_problem(chunks, length))
            c = length // chunks
            if c == 0:
                continue
            if not causal or source == rank:
                pairs.append(Pair(row, offset, offset + 2 * c, offset, offset + 2 * c, causal))
            elif source < rank:
                pairs.append(Pair(row, offset, offset + 2 * c, offset, offset + c, False))
            else:
                pairs.append(Pair(row, offset + c, offset + 2 * c, offset, offset + 2 * c, False))
            offset += 2 * c
    return tuple(pairs)


def _steps(comm: RingComm, causal: bool, layout: str | None, local_seq: int,
           bounds: RowBounds | None) -> list[_Step | None]:
    steps: list[_Step | None] = []
    if layout == "per_document" and bounds is not None:
        for step in range(comm.world):
            source = (comm.rank - step) % comm.world
            pairs = per_document_pairs(bounds, comm.rank, source, comm.world, causal)
            steps.append(_Step(_ALL, _ALL, causal and step == 0, pairs) if pairs else None)
        return steps
    if layout == "per_document":  # one document per row: the per-document split is the zigzag one
        layout = "zigzag"
    mine = ring_runs(layout, comm.rank, comm.world, local_seq) if bounds is not None else None
    for step in range(comm.world):
        plan = block_plan(step, comm.rank, comm.world, causal, local_seq, layout)
        if plan is None:
            steps.append(None)
            continue
        if bounds is None:
            steps.append(_Step(plan.q_rows, plan.kv_rows, plan.causal, None))
            continue
        source = (comm.rank - step) % comm.world
        theirs = ring_runs(layout, source, comm.world, local_seq)
        q_runs = take(mine, *plan.q_rows.indices(local_seq)[:2])
        k_runs = take(theirs, *plan.kv_rows.indices(local_seq)[:2])
        pairs = block_pairs(bounds, q_runs, k_runs, plan.causal)
        steps.append(_Step(plan.q_rows, plan.kv_rows, plan.causal, pairs) if pairs else None)
    return steps


def _block_forward(q, k, v, step: _Step, scale: float, backend: str | None):
    if step.pairs is None:
        return attention_forward(q, k, v, causal=step.causal, scale=scale, backend=backend)
    return documents_forward(q, k, v, step.pairs, scale=scale, backend=backend)


def _receive_buffers(k: torch.Tensor, v: torch.Tensor, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two K and two V receive buffers (double buffering; one for a ring of 2), contiguous: point-to-point
    receives refuse strided tensors, and ``empty_like`` would copy the strides of a permuted K/V (HF's
    MLA builds K as ``(B, H, S, D)``, so its ``(B, S, H, D)`` view is not contiguous)."""
    count = min(2, world - 1)
    return ([torch.empty_like(k, memory_format=torch.contiguous_format) for _ in range(count)],
            [torch.empty_like(v, memory_format=torch.contiguous_format) for _ in range(count)])


def _ring_forward(q, k, v, comm: RingComm, causal: bool, scale: float, backend: str | None,
                  layout: str | None = "zigzag", bounds: RowBounds | None = None):
    """This rank's merged output (accumulation dtype) and LSE."""
    steps = _steps(comm, causal, layout, q.shape[1], bounds)
    acc = lse_dtype(q.dtype)
    k_bufs, v_bufs = _receive_buffers(k, v, comm.world)
    k_cur, v_cur = k.contiguous(), v.contiguous()  # sent as they are (no copy unless a strided view)
    out = lse = None
    for index, step in enumerate(steps):
        pending = None
        if index + 1 < comm.world:
            k_next, v_next = k_bufs[index % 2], v_bufs[index % 2]
            pending = comm.exchange([k_cur, v_cur], [k_next, v_next], "forward", [_K_TAG, _V_TAG])
        if step is not None:
            block_out, block_lse = _block_forward(q[:, step.q_rows], k_cur[:, step.kv_rows], v_cur[:, step.kv_rows],
                                                  step, scale, backend)
            if out is None and step.q_rows == _ALL:  # the first block covering every row initialises
                lse = block_lse.to(acc).clone()
                # Rows with LSE -inf saw no key (output 0); NaN rows keep their NaN (it must not vanish).
                visible = (lse != float("-inf")).transpose(1, 2).unsqueeze(-1)
                out = torch.where(visible, block_out.to(acc), torch.zeros((), dtype=acc, device=q.device))
            else:
                if out is None:
                    out = torch.zeros(q.shape, dtype=acc, device=q.device)
                    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
                merge_into(out[:, step.q_rows], lse[:, :, step.q_rows], block_out, block_lse)
        if pending is not None:
            pending.wait()
            k_cur, v_cur = k_next, v_next
    if out is None:  # unreachable with a causal diagonal, kept for safety
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, comm: RingComm, causal: bool, scale: float, backend: str | None,
                   layout: str | None = "zigzag", bounds: RowBounds | None = None):
    steps = _steps(comm, causal, layout, q.shape[1], bounds)
    acc = lse_dtype(q.dtype)
    name = select_backend(q, backend)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_bufs, v_bufs = _receive_buffers(k, v, comm.world)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dkv_shape = (2, *k.shape)
    dkv = None
    dkv_spare = torch.empty(dkv_shape, dtype=acc, device=q.device)
    dkv_pending = None
    # Allocated once per call: the LSE rows each step's kernel reads (contiguous), and with flash-attn
    # the block gradient buffers the kernel writes into.
    lse_rows: dict[tuple, torch.Tensor] = {}
    grad_bufs = None
    if name in GRAD_BUFFER_BACKENDS and bounds is None:
        grad_bufs = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    for index, step in enumerate(steps):
        kv_pending = None
        if index + 1 < comm.world:
            k_next, v_next = k_bufs[index % 2], v_bufs[index % 2]
            kv_pending = comm.exchange([k_cur, v_cur], [k_next, v_next], "backward", [_K_TAG, _V_TAG])
        if dkv_pending is None:
            dkv = torch.zeros(dkv_shape, dtype=acc, device=q.device)  # our own block's accumulator
        else:
            dkv_pending.wait()  # the accumulator of the block we now hold, from the previous rank
            dkv, dkv_spare = dkv_spare, dkv
        if step is not None:
            rows, kv_rows = step.q_rows, step.kv_rows
            key = rows.indices(q.shape[1])
            if key not in lse_rows:
                lse_rows[key] = lse[:, :, rows].contiguous()
            args = (dout[:, rows], q[:, rows], k_cur[:, kv_rows], v_cur[:, kv_rows], out[:, rows], lse_rows[key])
            if step.pairs is not None:
                block_dq, block_dk, block_dv = documents_backward(*args, step.pairs, scale=scale, backend=name)
            else:
                grads = None
                if grad_bufs is not None:
                    n_q, n_k = args[1].shape[1], args[2].shape[1]
                    grads = (grad_bufs[0][:, :n_q], grad_bufs[1][:, :n_k], grad_bufs[2][:, :n_k])
                block_dq, block_dk, block_dv = attention_backward(*args, causal=step.causal, scale=scale,
                                                                  backend=name, grads=grads)
            dq[:, rows] += block_dq
            dkv[0][:, kv_rows] += block_dk
            dkv[1][:, kv_rows] += block_dv
        dkv_pending = comm.exchange([dkv], [dkv_spare], "backward", [_DKV_TAG])
        if kv_pending is not None:
            kv_pending.wait()
            k_cur, v_cur = k_next, v_next
    dkv_pending.wait()  # after P hops our own block's accumulator is home
    # dK and dV are two halves of one buffer: copies, so the op's outputs never alias each other.
    return dq.to(q.dtype), dkv_spare[0].to(k.dtype, copy=True), dkv_spare[1].to(v.dtype, copy=True)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will call this attention's backward (and its collectives) for these inputs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_layout(layout: str | None, causal: bool, world: int, documents: bool) -> None:
    """A causal or document-masked ring call must name the layout its shards are in."""
    if layout is not None and layout not in LAYOUTS:
        raise RuntimeConfigError(f"unknown ring layout {layout!r}; use one of {', '.join(map(repr, LAYOUTS))}")
    if layout is None and (causal or documents):
        why = "causal" if causal else "document-masked"
        raise RuntimeConfigError(
            f"{why} ring attention needs to know how the sequence was split across the {world} ring ranks: pass "
            "layout='zigzag' (the load-balanced layout of sp_plan.runtime.context.shard_segments / SequenceParallel.shard: "
            "rank r holds chunks r and 2P-1-r of 2P), layout='per_document' (the same inside every document) or "
            "layout='contiguous' (rank r holds the r-th contiguous 1/P); "
            "SequenceParallel.attention passes it for you"
        )


def check_ring_shapes(q: torch.Tensor, k: torch.Tensor, world: int, causal: bool, layout: str | None = "zigzag") -> None:
    if q.shape[1] != k.shape[1]:
        raise RuntimeConfigError(
            f"ring attention needs local q and k/v shards of equal length (self-attention), got "
            f"{q.shape[1]} and {k.shape[1]} tokens"
        )
    if layout in ("zigzag", "per_document") and q.shape[1] % 2:
        raise RuntimeConfigError(
            f"zigzag causal ring attention needs an even local sequence (two chunks per rank), got "
            f"{q.shape[1]} tokens: pad the sequence to a multiple of 2 x ring = {2 * world}"
        )


def validate_ring_call(q, k, v, group: dist.ProcessGroup, causal: bool, layout: str | None,
                       cu_seqlens: torch.Tensor | None, scale: float | None = None, *,
                       agreed: bool = False, needs_grad: bool = False) -> RowBounds | None:
    """Everything a ring call must satisfy, raising on every rank alike: the local checks (q/k/v, scale,
    layout, even zigzag length, documents) are collected first, then one agreement all-gather tells every
    rank whether the ranks agree and whether any of them found a problem (unless ``agreed``: the caller
    already checked the grid, and the local checks, which depend only on what every rank agrees on, raise
    alike). Returns the document bounds."""

    world = dist.get_world_size(group)
    problem, bounds = None, None
    try:
        check_qkv(q, k, v, causal, scale)
        check_layout(layout, causal, world, cu_seqlens is not None)
        check_ring_shapes(q, k, world, causal, layout if (causal or cu_seqlens is not None) else None)
        if cu_seqlens is not None:
            batch, seq_len = q.shape[0], q.shape[1] * world
            if not single_document_rows(cu_seqlens, batch, seq_len):
                bounds = row_bounds(cu_seqlens, batch, seq_len)
                if layout == "per_document":
                    odd = next((b - a for row in bounds for a, b in zip(row, row[1:]) if (b - a) % (2 * world)), None)
                    if odd is not None:
                        raise RuntimeConfigError(per_document_length_problem(2 * world, odd))
    except RuntimeConfigError as exc:
        problem = str(exc)
    if not agreed:
        agree(group, "ring attention", (q, k, v), problem=problem, layout=layout, causal=causal, scale=scale,
              cu_seqlens=cu_seqlens, needs_grad=needs_grad)
    elif problem is not None:
        raise RuntimeConfigError(problem)
    return bounds
