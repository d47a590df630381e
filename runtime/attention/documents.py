"""Document masking (packed sequences) for every attention path: local, Ulysses, zigzag Ring, USP.

A packed row holds several documents; each token may attend only to (earlier) tokens of its own
document. The documents travel as ONE small CPU tensor, ``cu_seqlens``: the cumulative document
boundaries over the flattened ``(batch x seq_len)`` full sequence, flash-attn's varlen convention
(``[0, end of doc 1, ..., batch * seq_len]``; every row boundary ``b * seq_len`` is a boundary too). It
is the same on every rank (it describes the whole sequence, not a shard), is made once per batch by
the data path (:class:`sp_plan.runtime.data.BatchSharder`) and passes through the custom ops as a tensor
argument, so nothing in it is traced by ``torch.compile``.

How a block is computed. Every path calls the kernel on blocks ``(query rows, key rows)`` of the
local tensors, and every rank knows which global positions its rows hold (the shard function of
:mod:`sp_plan.runtime.context`): the whole sequence (local, Ulysses), chunks r and 2R-1-r (zigzag Ring, USP),
or chunk r (contiguous Ring). Two facts make document masking exact and cheap:

1. local order is increasing in global position, so the rows of one document inside a block are a
   contiguous range of local rows, even when the block is two zigzag chunks with a gap between them;
2. a ring step's block is either the diagonal block (queries = keys, causal) or a block whose keys
   all precede its queries (zigzag steps 1..P-1), so within one document the pair is either the
   square causal diagonal or fully visible.

So a block splits into at most one sub-block per document: ``(query range, key range, causal)``
(:func:`block_pairs`). The exact fallback calls the kernel once per sub-block and writes its output
and LSE into the block's result; query rows that see no key of the block keep output 0 and LSE
``-inf``, which the ring's log-sum-exp merge treats as "contributes nothing"
(:mod:`sp_plan.runtime.attention.merge`). Backward calls the kernel's backward per sub-block with the merged
output and LSE. With flash-attn (2 or 3) importable on CUDA, the sub-blocks of one block go to ONE
varlen kernel call instead (:func:`sp_plan.runtime.attention.kernel.varlen_forward`): rows gathered (no copy
when they tile the block in order, as in the local and Ulysses paths), ``cu_seqlens_q/k`` built once
per block shape and cached.
"""

from __future__ import annotations

import bisect
import functools
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch

from sp_plan.runtime.attention import kernel
from sp_plan.runtime.errors import RuntimeConfigError

Run = tuple[int, int]  # (global start, length)
#: Per row: (0, end of doc 1, ..., seq_len), relative to the row.
RowBounds = tuple[tuple[int, ...], ...]


class Pair(NamedTuple):
    """One document's sub-block of a (query rows, key rows) block, in local row indices of that block."""

    row: int  # batch row
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool  # square diagonal (causal) or fully visible


# ----- cu_seqlens ---------------------------------------------------------------------------------------


def check_cu_seqlens(cu_seqlens: torch.Tensor) -> None:
    """Type checks that need no shapes (done where the tensor enters the runtime)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise RuntimeConfigError(
            "cu_seqlens must be a 1-D integer tensor of cumulative document boundaries over the flattened "
            f"(batch x seq_len) sequence, got {getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}"
        )


@functools.lru_cache(maxsize=64)
def _row_bounds(cu: tuple[int, ...], batch: int, seq_len: int) -> RowBounds:
    total = batch * seq_len
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total:
        raise RuntimeConfigError(
            f"cu_seqlens must start at 0 and end at batch x seq_len = {batch} x {seq_len} = {total} (the whole "
            f"flattened sequence), got {list(cu[:3])}...{list(cu[-2:])}: build it from the full (unsharded) batch, "
            "e.g. with sp_plan.runtime.data.BatchSharder"
        )
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise RuntimeConfigError("cu_seqlens must be non-decreasing (cumulative document boundaries)")
    points = set(cu)
    missing = [b * seq_len for b in range(1, batch) if b * seq_len not in points]
    if missing:
        raise RuntimeConfigError(
            f"cu_seqlens has no boundary at the row start(s) {missing[:4]} (multiples of seq_len {seq_len}): a "
            "document cannot continue into the next batch row"
        )
    rows = []
    ordered = sorted(points)
    for b in range(batch):
        lo, hi = b * seq_len, (b + 1) * seq_len
        first = bisect.bisect_left(ordered, lo)
        last = bisect.bisect_right(ordered, hi)
        rows.append(tuple(p - lo for p in ordered[first:last]))
    return tuple(rows)


_HOST: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}


def host_boundaries(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` as Python ints. A device copy (FSDP2's root moves a module's tensor inputs to the
    GPU) is read once per tensor object, not once per layer: the result is cached until the tensor is
    freed, so a forward and its backward sync with the host once."""
    if cu_seqlens.device.type == "cpu":
        return tuple(cu_seqlens.tolist())
    key = id(cu_seqlens)
    cached = _HOST.get(key)
    if cached is not None and cached[0]() is cu_seqlens:
        return cached[1]
    values = tuple(cu_seqlens.tolist())
    _HOST[key] = (weakref.ref(cu_seqlens, lambda _, key=key: _HOST.pop(key, None)), values)
    return values


def row_bounds(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> RowBounds:
    """Validated per-row document boundaries of a ``(batch, seq_len)`` full sequence."""
    check_cu_seqlens(cu_seqlens)
    return _row_bounds(host_boundaries(cu_seqlens), batch, seq_len)


def cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` (int32, CPU) from a bool ``(batch, seq)`` tensor that is True at document starts
    (position 0 of each row counts as a start whatever it says)."""
    starts = starts.detach().to("cpu", torch.bool).clone()
    batch, seq = starts.shape
    starts[:, 0] = True
    points = starts.reshape(-1).nonzero().flatten()
    return torch.cat([points, torch.tensor([batch * seq])]).to(torch.int32)


def single_document_rows(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> bool:
    """True when every row is one document (masking changes nothing: the plain causal path applies)."""
    return all(len(bounds) == 2 for bounds in row_bounds(cu_seqlens, batch, seq_len))


# ----- planning ---------------------------------------------------------------------------------------


def take(runs: tuple[Run, ...], start: int, stop: int) -> tuple[Run, ...]:
    """Global runs of local rows ``[start, stop)`` of a tensor whose rows are ``runs`` in order."""
    taken, offset = [], 0
    for run_start, run_len in runs:
        lo, hi = max(start, offset), min(stop, offset + run_len)
        if lo < hi:
            taken.append((run_start + lo - offset, hi - lo))
        offset += run_len
    return tuple(taken)


def _local_range(runs: tuple[Run, ...], lo: int, hi: int) -> tuple[int, int] | None:
    """Local rows holding global positions ``[lo, hi)``: contiguous because ``runs`` increase."""
    first = last = None
    offset = 0
    for start, length in runs:
        a, b = max(start, lo), min(start + length, hi)
        if a < b:
            if first is None:
                first = offset + a - start
            last = offset + b - start
        offset += length
    return None if first is None else (first, last)


def _check_increasing(runs: tuple[Run, ...]) -> None:
    for (s1, n1), (s2, _) in zip(runs, runs[1:]):
        if s2 < s1 + n1:
            raise RuntimeConfigError(f"internal: document masking needs increasing local runs, got {runs}")


@functools.lru_cache(maxsize=1024)
def block_pairs(bounds: RowBounds, q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], causal: bool) -> tuple[Pair, ...]:
    """The per-document sub-blocks of the block (queries at ``q_runs``, keys at ``k_runs``).

    ``causal=True`` is the diagonal block (``q_runs == k_runs``): each document's rows form a square
    causal sub-block. ``causal=False`` means every key of the block is visible to every query of the
    block apart from the document mask (non-causal attention, or ring steps whose keys all precede
    the queries): each document's queries see all of its keys in the block.
    """
    _check_increasing(q_runs)
    _check_increasing(k_runs)
    if causal and q_runs != k_runs:
        raise RuntimeConfigError(f"internal: a causal block must be diagonal, got q {q_runs} and k {k_runs}")
    pairs = []
    for row, bounds_row in enumerate(bounds):
        docs: list[int] = []
        for start, length in q_runs:
            i = bisect.bisect_right(bounds_row, start) - 1
            while i < len(bounds_row) - 1 and bounds_row[i] < start + length:
                if not docs or docs[-1] < i:
                    docs.append(i)
                i += 1
        for i in docs:
            lo, hi = bounds_row[i], bounds_row[i + 1]
            q_range = _local_range(q_runs, lo, hi)
            k_range = _local_range(k_runs, lo, hi)
            if q_range is not None and k_range is not None:
                pairs.append(Pair(row, *q_range, *k_range, causal))
    return tuple(pairs)


# ----- execution ----------------------------------------------------------------------------------------


def documents_forward(q, k, v, pairs: tuple[Pair, ...], *, scale: float, backend: str | None):
    """Output ``(B, Sq, H, D)`` (q's dtype) and LSE ``(B, H, Sq)`` of the block under the document mask:
    rows that see no key keep output 0 and LSE -inf (the contract of ``attention_forward``)."""
    name = kernel.select_backend(q, backend)
    batch, seq_q, heads, _ = q.shape
    acc = kernel.lse_dtype(q.dtype)
    if kernel.varlen_available(name):
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse_hbs = torch.full((heads, batch, seq_q), float("-inf"), dtype=acc, device=q.device)  # varlen layout
        for causal in (True, False):
            group = tuple(p for p in pairs if p.causal == causal)
            if group:
                _varlen_block_forward(name, q, k, v, group, causal, scale, out, lse_hbs)
        return out, lse_hbs.transpose(0, 1)
    lse = torch.full((batch, heads, seq_q), float("-inf"), dtype=acc, device=q.device)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for p in pairs:
        rows = slice(p.q_lo, p.q_hi)
        block_out, block_lse = kernel.attention_forward(
            q[p.row : p.row + 1, rows], k[p.row : p.row + 1, p.k_lo : p.k_hi], v[p.row : p.row + 1, p.k_lo : p.k_hi],
            causal=p.causal, scale=scale, backend=name,
        )
        out[p.row, rows] = block_out[0]
        lse[p.row, :, rows] = block_lse[0].to(acc)
    return out, lse


def documents_backward(dout, q, k, v, out, lse, pairs: tuple[Pair, ...], *, scale: float, backend: str | None):
    """dq, dk, dv of the block under the document mask, given the (merged) output and LSE of its rows."""
    name = kernel.select_backend(q, backend)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if kernel.varlen_available(name):
        for causal in (True, False):
            group = tuple(p for p in pairs if p.causal == causal)
            if group:
                _varlen_block_backward(name, dout, q, k, v, out, lse, group, causal, scale, dq, dk, dv)
        return dq, dk, dv
    for p in pairs:
        b, rows, keys = slice(p.row, p.row + 1), slice(p.q_lo, p.q_hi), slice(p.k_lo, p.k_hi)
        block_dq, block_dk, block_dv = kernel.attention_backward(
            dout[b, rows], q[b, rows], k[b, keys], v[b, keys], out[b, rows], lse[b, :, rows],
            causal=p.causal, scale=scale, backend=name,
        )
        dq[b, rows] += block_dq
        dk[b, keys] += block_dk
        dv[b, keys] += block_dv
    return dq, dk, dv


# -- varlen (flash-attn 2 / 3, CUDA; not exercised by the CPU test suite) --


class _Packing(NamedTuple):
    """How the sub-blocks of one block map onto a varlen call: row indices, cu_seqlens, max lengths."""

    q_rows: torch.Tensor | None  # flat row indices into (B*Sq); None: the sub-blocks tile all rows in order
    k_rows: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


_PACKINGS: OrderedDict = OrderedDict()
_MAX_PACKINGS = 256


def _packing(pairs: tuple[Pair, ...], seq_q: int, seq_k: int, batch: int, device: torch.device) -> _Packing:
    key = (pairs, seq_q, seq_k, batch, str(device))
    cached = _PACKINGS.get(key)
    if cached is not None:
        _PACKINGS.move_to_end(key)
        return cached

    def flat(lo_hi, seq):
        spans = [(p.row * seq + lo, p.row * seq + hi) for p, (lo, hi) in lo_hi]
        tiles = spans[0][0] == 0 and spans[-1][1] == batch * seq and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        lengths = [hi - lo for lo, hi in spans]
        cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32)
        rows = None if tiles else torch.cat([torch.arange(lo, hi) for lo, hi in spans])
        return rows, cu, max(lengths)

    q_rows, cu_q, max_q = flat([(p, (p.q_lo, p.q_hi)) for p in pairs], seq_q)
    k_rows, cu_k, max_k = flat([(p, (p.k_lo, p.k_hi)) for p in pairs], seq_k)
    packing = _Packing(
        None if q_rows is None else q_rows.to(device), None if k_rows is None else k_rows.to(device),
        cu_q.to(device), cu_k.to(device), max_q, max_k,
    )
    _PACKINGS[key] = packing
    if len(_PACKINGS) > _MAX_PACKINGS:
        _PACKINGS.popitem(last=False)
    return packing


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total


def _gather(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """(B, S, H, D) -> (n, H, D) of the given flat rows (a view when rows is None and x is contiguous)."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return flat if rows is None else flat.index_select(0, rows)


def _lse_rows(lse: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """(B, H, S) -> (H, n) contiguous, the varlen kernels' LSE layout."""
    flat = lse.transpose(0, 1).reshape(lse.shape[1], -1)
    return (flat if rows is None else flat.index_select(1, rows)).float().contiguous()


def _scatter(target: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    flat = target.view(target.shape[0] * target.shape[1], *target.shape[2:])
    if rows is None:
        flat.copy_(values)
    else:
        flat.index_copy_(0, rows, values.to(flat.dtype))


def _varlen_block_forward(name, q, k, v, pairs, causal, scale, out, lse_hbs) -> None:
    """Write the varlen call's output into ``out`` (B, S, H, D) and its LSE into ``lse_hbs`` (H, B, S)."""
    batch, seq_q = q.shape[:2]
    packing = _packing(pairs, seq_q, k.shape[1], batch, q.device)
    out_p, lse_p = kernel.varlen_forward(
        name, _gather(q, packing.q_rows), _gather(k, packing.k_rows), _gather(v, packing.k_rows),
        packing.cu_q, packing.cu_k, packing.max_q, packing.max_k, causal=causal, scale=scale,
    )
    _scatter(out, packing.q_rows, out_p)
    lse_flat = lse_hbs.view(lse_hbs.shape[0], batch * seq_q)
    if packing.q_rows is None:
        lse_flat.copy_(lse_p)
    else:
        lse_flat.index_copy_(1, packing.q_rows, lse_p.to(lse_flat.dtype))


def _varlen_block_backward(name, dout, q, k, v, out, lse, pairs, causal, scale, dq, dk, dv) -> None:
    batch, seq_q = q.shape[:2]
    packing = _packing(pairs, seq_q, k.shape[1], batch, q.device)
    dq_p, dk_p, dv_p = kernel.varlen_backward(
        name, _gather(dout, packing.q_rows), _gather(q, packing.q_rows), _gather(k, packing.k_rows),
        _gather(v, packing.k_rows), _gather(out, packing.q_rows), _lse_rows(lse, packing.q_rows),
        packing.cu_q, packing.cu_k, packing.max_q, packing.max_k, causal=causal, scale=scale,
    )
    _scatter(dq, packing.q_rows, dq_p)
    _scatter(dk, packing.k_rows, dk_p)
    _scatter(dv, packing.k_rows, dv_p)
