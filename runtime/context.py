"""The small API user code needs for sequence parallelism: shard, gather, positions, attention.

One shard function defines the whole data layout (DESIGN/BRIEF "Zigzag layout"): with R ring ranks
and U Ulysses ranks, the sequence is cut into 2R chunks when R > 1, ring rank r takes chunks r and
2R-1-r (its ring-local sequence, in that order; the whole sequence when R = 1), and Ulysses rank u
takes the u-th contiguous 1/U slice of that. Token ids, position ids and (pre-shifted) labels must
all be sharded with it; :meth:`SequenceParallel.positions` gives the global position of every local
token, which is what RoPE needs (never a 4-D mask).

**Per-document sharding** (``SequenceParallel(..., sharding="per_document")``, Megatron-Core's THD
"head-tail" split): for packed rows (several documents per row, document masking through ``cu_seqlens``)
zigzag over the whole row is unbalanced, since the rank holding most of a long document does most of the
attention work. Under this rule every DOCUMENT is cut into 2R chunks (its length a multiple of 2R:
:class:`sp_plan.runtime.data.BatchSharder` pads each document inside itself) and ring rank r holds chunks
r and 2R-1-r of every document of the row, in row order (so local order still increases with the global
position); Ulysses rank u the u-th contiguous 1/U of that. Each row is split by its own documents, so
:meth:`SequenceParallel.shard`, :meth:`~SequenceParallel.gather` and :meth:`~SequenceParallel.positions`
take the batch's ``documents`` (its ``cu_seqlens``, or per-row bounds) and refuse to run without them;
:meth:`SequenceParallel.attention` runs the ring with ``layout="per_document"``. Rows of one document
each are split exactly as zigzag.

Example::

    mesh = build_mesh("plan.yaml")               # sp_plan.runtime.mesh
    sp = SequenceParallel.from_mesh(mesh)
    x = sp.shard(hidden_states, dim=1)           # (B, S/(R*U), hidden)
    pos = sp.positions(seq_len)                  # global position ids of the local tokens
    out = sp.attention(q, k, v, causal=True)     # q, k, v: (B, local_seq, heads, head_dim)
    full = sp.gather(out, dim=1)                 # back to the whole sequence (differentiable)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sp_plan.runtime import comm_counter
from sp_plan.runtime.attention.api import local_attention, ring_attention, ulysses_attention, usp_attention
from sp_plan.runtime.attention.documents import RowBounds, row_bounds
from sp_plan.runtime.errors import RuntimeConfigError

Segment = tuple[int, int]  # (global start, length)


def seq_multiple(ring: int, ulysses: int) -> int:
    """The sequence length must be a multiple of this: U x R, times 2 for zigzag when R > 1."""
    return ulysses * ring * (2 if ring > 1 else 1)


def check_seq_len(seq_len: int, ring: int, ulysses: int) -> None:
    multiple = seq_multiple(ring, ulysses)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise RuntimeConfigError(
            f"sequence length must be a positive integer, got {seq_len!r}: an empty sequence cannot be sharded "
            f"(drop empty batches; lengths must be multiples of {multiple} for this layout)"
        )
    if seq_len % multiple:
        lower = seq_len - seq_len % multiple
        upper = lower + multiple
        why = f"ulysses x ring = {ulysses} x {ring}" + (" x 2 (zigzag ring)" if ring > 1 else "")
        suggestion = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise RuntimeConfigError(
            f"sequence length {seq_len} is not divisible by {why} = {multiple}; use {suggestion} "
            "(or pad the data to that multiple)"
        )


def _take(runs: list[Segment], start: int, length: int) -> list[Segment]:
    """Sub-runs covering positions [start, start+length) of the concatenation of ``runs``."""
    taken, offset = [], 0
    for run_start, run_len in runs:
        lo, hi = max(start, offset), min(start + length, offset + run_len)
        if lo < hi:
            taken.append((run_start + lo - offset, hi - lo))
        offset += run_len
    return taken


def ring_local_segments(seq_len: int, ring: int, ring_rank: int) -> list[Segment]:
    """The ring-local sequence of ``ring_rank``: chunks r and 2R-1-r of 2R (everything when R = 1)."""
    if ring == 1:
        return [(0, seq_len)]
    chunk = seq_len // (2 * ring)
    return [(ring_rank * chunk, chunk), ((2 * ring - 1 - ring_rank) * chunk, chunk)]


#: How a row is split over the ring ranks: ``zigzag`` over the whole row, or ``per_document`` (chunks r and
#: 2R-1-r of every document of a packed row: balanced for any mix of document lengths).
SHARDINGS: tuple[str, ...] = ("zigzag", "per_document")


def per_document_segments(bounds_row: tuple[int, ...], ring: int, ring_rank: int, ulysses: int,
                          ulysses_rank: int) -> list[Segment]:
    """The per-document shard of one packed row with document boundaries ``bounds_row`` (0, ..., seq_len):
    ring rank r takes chunks r and 2R-1-r of each document's 2R chunks (every document a multiple of 2R,
    as :class:`sp_plan.runtime.data.BatchSharder` pads them), Ulysses rank u the u-th 1/U of that."""
    seq_len = bounds_row[-1]
    check_seq_len(seq_len, ring, ulysses)
    chunks = 2 * ring
    runs: list[Segment] = []
    for lo, hi in zip(bounds_row, bounds_row[1:]):
        if (hi - lo) % chunks:
            raise RuntimeConfigError(
                f"per-document sharding needs every document's length to be a multiple of 2 x ring = {chunks}, got "
                f"{hi - lo} tokens: prepare the batch with BatchSharder(sp) (it pads each document)")
        c = (hi - lo) // chunks
        if c:
            runs += [(lo + ring_rank * c, c), (lo + (chunks - 1 - ring_rank) * c, c)]
    piece = seq_len // ring // ulysses
    return _take(runs, ulysses_rank * piece, piece)


def document_rows(documents, batch: int | None, seq_len: int | None) -> RowBounds:
    """Per-row document boundaries ``((0, ..., seq_len), ...)`` from a ``cu_seqlens`` tensor over the flattened
    ``(batch x seq_len)`` (``batch`` None: inferred from its last boundary) or from per-row bounds (checked)."""
    if isinstance(documents, torch.Tensor):
        if seq_len is None:
            raise RuntimeConfigError("internal: per-document cu_seqlens need the row length")
        if batch is None:
            last = int(documents[-1]) if documents.numel() else 0
            batch = max(last // seq_len, 1) if seq_len else 1
        return row_bounds(documents, batch, seq_len)
    try:
        rows = tuple(tuple(int(p) for p in row) for row in documents)
    except (TypeError, ValueError):
        raise RuntimeConfigError(
            f"documents must be a cu_seqlens tensor or per-row boundaries (0, ..., seq_len), got "
            f"{type(documents).__name__}") from None
    for row in rows:
        if len(row) < 2 or row[0] != 0 or any(b < a for a, b in zip(row, row[1:])) or (
                seq_len is not None and row[-1] != seq_len):
            raise RuntimeConfigError(
                f"per-row document boundaries must run non-decreasing from 0 to the row length {seq_len}, got "
                f"{list(row[:4])}{'...' if len(row) > 4 else ''}")
    return rows


def shard_segments(seq_len: int, ring: int, ring_rank: int, ulysses: int, ulysses_rank: int) -> list[Segment]:
    """Global (start, length) runs of the tokens this rank holds, in local order (the shard function)."""
    check_seq_len(seq_len, ring, ulysses)
    piece = seq_len // ring // ulysses
    return _take(ring_local_segments(seq_len, ring, ring_rank), ulysses_rank * piece, piece)


class _AllGather(torch.autograd.Function):
    """Concatenate equal shards from every rank of ``group`` along ``dim``; backward sums and slices."""

    @staticmethod
    def forward(ctx, x, group, dim):
        world = dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        comm_counter.record_all_gather(x, world, "forward")
        dist.all_gather(parts, x, group=group)
        ctx.group, ctx.dim, ctx.world = group, dim, world
        ctx.rank, ctx.size = dist.get_rank(group), x.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's copy of the gathered tensor depends on this shard: sum their gradients.
        grad = grad.contiguous().clone()
        comm_counter.record_all_reduce(grad, ctx.world, "backward")
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class SequenceParallel:
    """Sequence-parallel context over a Ulysses group (inner) and a Ring group (outer).

    ``None`` for a group means degree 1. Build it with :meth:`from_mesh` (a :class:`sp_plan.runtime.mesh.RuntimeMesh`
    or a DeviceMesh with ``ring``/``ulysses`` dims) or :meth:`from_groups`. ``sharding``: how the ring splits a
    row, ``"zigzag"`` (default: chunks r and 2R-1-r of the whole row) or ``"per_document"`` (the same inside
    every document of a packed row; see the module docstring).
    """

    def __init__(
        self,
        ulysses_group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
        sharding: str = "zigzag",
    ) -> None:
        if sharding not in SHARDINGS:
            raise RuntimeConfigError(f"unknown sequence sharding {sharding!r}: choose one of {', '.join(SHARDINGS)}")
        self.sharding = sharding
        self.ulysses_group = ulysses_group if _group_size(ulysses_group) > 1 else None
        self.ring_group = ring_group if _group_size(ring_group) > 1 else None
        self.ulysses_size, self.ulysses_rank = _group_size(self.ulysses_group), _group_rank(self.ulysses_group)
        self.ring_size, self.ring_rank = _group_size(self.ring_group), _group_rank(self.ring_group)
        self.backend = backend

    @classmethod
    def from_groups(
        cls,
        ulysses_group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
        *,
        backend: str | None = None,
        sharding: str = "zigzag",
    ) -> SequenceParallel:
        return cls(ulysses_group, ring_group, backend=backend, sharding=sharding)

    @classmethod
    def from_mesh(cls, mesh, *, backend: str | None = None, sharding: str = "zigzag") -> SequenceParallel:
        """From a :class:`sp_plan.runtime.mesh.RuntimeMesh` or a DeviceMesh naming ``ulysses`` and/or ``ring`` dims."""
        device_mesh = getattr(mesh, "device_mesh", mesh)
        names = tuple(device_mesh.mesh_dim_names or ())
        if "ulysses" not in names and "ring" not in names:
            raise RuntimeConfigError(
                f"the device mesh has dims {names or '(unnamed)'} but no 'ulysses' or 'ring' dim: build it with "
                "sp_plan.runtime.mesh.build_mesh or name the sequence-parallel dims 'ulysses' and 'ring'"
            )
        groups = {name: device_mesh[name].get_group() if name in names else None for name in ("ulysses", "ring")}
        return cls(groups["ulysses"], groups["ring"], backend=backend, sharding=sharding)

    # ----- layout ----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Sequence-parallel degree R x U."""
        return self.ring_size * self.ulysses_size

    @property
    def rank(self) -> int:
        """Rank within the SP group, ring-major (Ulysses innermost), as in the flattened ``sp`` mesh dim."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    @property
    def seq_multiple(self) -> int:
        return seq_multiple(self.ring_size, self.ulysses_size)

    def segments(self, seq_len: int) -> list[Segment]:
        """Global runs this rank holds of every row (zigzag rule; the per-document rule's runs differ per row:
        :meth:`document_segments`)."""
        if self.per_document:
            raise RuntimeConfigError(self._needs_documents("segments"))
        return shard_segments(seq_len, self.ring_size, self.ring_rank, self.ulysses_size, self.ulysses_rank)

    @property
    def per_document(self) -> bool:
        """Whether packed rows are split per document (only a ring splits rows; Ulysses splits heads)."""
        return self.sharding == "per_document" and self.ring_size > 1

    def _needs_documents(self, what: str) -> str:
        return (f"SequenceParallel(sharding='per_document').{what} needs the batch's document boundaries: pass "
                "documents=cu_seqlens (the full batch's cumulative boundaries, as BatchSharder.prepare makes them; "
                "rows of one document each: [0, S, 2S, ..., B*S]) or per-row bounds (0, ..., S) from "
                "sp_plan.runtime.attention.documents.row_bounds; BatchSharder.shard passes them for you")

    def document_segments(self, documents, batch: int | None = None, seq_len: int | None = None) -> list[list[Segment]]:
        """Per row, the global runs this rank holds of a packed batch under the per-document rule. ``documents``:
        per-row boundaries ``(0, ..., seq_len)`` (:func:`sp_plan.runtime.attention.documents.row_bounds`) or a
        ``cu_seqlens`` tensor over the flattened batch (then ``batch`` and ``seq_len`` are required)."""
        rows = document_rows(documents, batch, seq_len)
        return [per_document_segments(row, self.ring_size, self.ring_rank, self.ulysses_size, self.ulysses_rank)
                for row in rows]

    def shard(self, x: torch.Tensor, dim: int = 1, documents=None) -> torch.Tensor:
        """This rank's shard of the full-sequence tensor ``x`` (sequence along ``dim``); differentiable.

        ``documents``: required by the per-document rule (and ignored by zigzag): the batch's document
        boundaries, a ``cu_seqlens`` tensor over the flattened ``(batch x seq)`` or per-row bounds; ``x`` is then
        ``(batch, seq, ...)`` and split along dim 1, each row by its own documents."""
        if self.per_document:
            if documents is None:
                raise RuntimeConfigError(self._needs_documents("shard"))
            return self._shard_per_document(x, dim, documents)
        if not isinstance(x, torch.Tensor):
            raise RuntimeConfigError(f"SequenceParallel.shard expects a torch.Tensor, got {type(x).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < max(x.dim(), 1) or x.dim() == 0:
            raise RuntimeConfigError(
                f"cannot shard dim {dim!r} of a {x.dim()}-D tensor {tuple(x.shape)}: pass the sequence dimension "
                "(dim=1 for (batch, seq, ...) tensors)"
            )
        runs = self.segments(x.shape[dim])
        pieces = [x.narrow(dim, start, length) for start, length in runs]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def _per_document_rows(self, x: torch.Tensor, dim: int, documents, what: str) -> RowBounds:
        if not isinstance(x, torch.Tensor):
            raise RuntimeConfigError(f"SequenceParallel.{what} expects a torch.Tensor, got {type(x).__name__}")
        if dim != 1 or x.dim() < 2:
            raise RuntimeConfigError(
                f"per-document sharding splits (batch, seq, ...) tensors along dim 1 (each row by its own documents); "
                f"got dim {dim!r} of a tensor of shape {tuple(x.shape)}")
        seq = x.shape[1] * (self.size if what == "gather" else 1)
        rows = document_rows(documents, x.shape[0], seq)
        if len(rows) != x.shape[0] or any(row[-1] != seq for row in rows):
            raise RuntimeConfigError(
                f"per-document {what}: the documents describe {len(rows)} row(s) of {sorted({r[-1] for r in rows})} "
                f"tokens but the tensor is {tuple(x.shape)} (batch {x.shape[0]}, full sequence {seq}): pass the "
                "boundaries of this (padded) batch")
        return rows

    def _shard_per_document(self, x: torch.Tensor, dim: int, documents) -> torch.Tensor:
        rows = self._per_document_rows(x, dim, documents, "shard")
        index = [torch.cat([torch.arange(s, s + n) for s, n in runs]) for runs in self.document_segments(rows)]
        # one gather along dim 1 (differentiable), with per-row indices
        idx = torch.stack(index).to(x.device)
        idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(idx.shape[0], idx.shape[1], *x.shape[2:])
        return torch.gather(x, 1, idx)

    def positions(self, seq_len: int, device: torch.device | str | None = None, documents=None) -> torch.Tensor:
        """Global position ids (int64) of this rank's local tokens, in local order: ``(local,)``, or under
        the per-document rule ``(batch, local)`` (each row by its ``documents``, as in :meth:`shard`)."""
        if self.per_document:
            if documents is None:
                raise RuntimeConfigError(self._needs_documents("positions"))
            rows = document_rows(documents, None, seq_len)
            return torch.stack([torch.cat([torch.arange(s, s + n, device=device) for s, n in runs])
                                for runs in self.document_segments(rows)])
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.segments(seq_len)])

    def gather(self, x: torch.Tensor, dim: int = 1, documents=None) -> torch.Tensor:
        """Inverse of :meth:`shard`: the full sequence on every rank (differentiable, all-gathers).
        ``documents``: required by the per-document rule, as in :meth:`shard`."""
        if self.per_document:
            if documents is None:
                raise RuntimeConfigError(self._needs_documents("gather"))
            return self._gather_per_document(x, dim, documents)
        local = x.shape[dim]
        if self.ulysses_group is not None:
            x = _AllGather.apply(x, self.ulysses_group, dim)  # the ring-local sequence, in order
        if self.ring_group is None:
            return x
        ring_local = _AllGather.apply(x, self.ring_group, dim)  # ring-local sequences by ring rank
        seq_len = local * self.size
        placed: list[tuple[int, torch.Tensor]] = []
        for ring_rank in range(self.ring_size):
            offset = ring_rank * local * self.ulysses_size
            for start, length in ring_local_segments(seq_len, self.ring_size, ring_rank):
                placed.append((start, ring_local.narrow(dim, offset, length)))
                offset += length
        placed.sort(key=lambda item: item[0])
        return torch.cat([piece for _, piece in placed], dim=dim)

    def _gather_per_document(self, x: torch.Tensor, dim: int, documents) -> torch.Tensor:
        rows = self._per_document_rows(x, dim, documents, "gather")
        parts = x
        if self.ulysses_group is not None:
            parts = _AllGather.apply(parts, self.ulysses_group, 1)  # the ring-local sequence, in order
        parts = _AllGather.apply(parts, self.ring_group, 1)  # ring-local sequences by ring rank
        inverse = []
        for bounds in rows:
            held = torch.cat([torch.arange(s, s + n) for r in range(self.ring_size)
                              for s, n in per_document_segments(bounds, self.ring_size, r, 1, 0)])
            inverse.append(torch.empty_like(held).scatter_(0, held, torch.arange(held.numel())))
        idx = torch.stack(inverse).to(parts.device)
        idx = idx.view(*idx.shape, *([1] * (parts.dim() - 2))).expand(idx.shape[0], idx.shape[1], *parts.shape[2:])
        return torch.gather(parts, 1, idx)

    # ----- attention ---------------------------------------------------------------------------
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = True,
        scale: float | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exact attention on local shards ``(batch, local_seq, heads, head_dim)`` in this context's layout.

        ``cu_seqlens``: packed documents, the cumulative document boundaries over the flattened FULL
        ``(batch x seq_len)`` sequence (the same tensor on every rank, as :class:`sp_plan.runtime.data.BatchSharder`
        makes it); every token then attends only to tokens of its own document.
        """
        backend = self.backend
        if self.ulysses_group is not None and self.ring_group is not None:
            return usp_attention(q, k, v, self.ulysses_group, self.ring_group, causal=causal, scale=scale,
                                 backend=backend, cu_seqlens=cu_seqlens, layout=self._ring_layout)
        if self.ulysses_group is not None:
            return ulysses_attention(q, k, v, self.ulysses_group, causal=causal, scale=scale, backend=backend,
                                     cu_seqlens=cu_seqlens)
        if self.ring_group is not None:
            return ring_attention(q, k, v, self.ring_group, causal=causal, scale=scale, backend=backend,
                                  layout=self._ring_layout, cu_seqlens=cu_seqlens)
        return local_attention(q, k, v, causal=causal, scale=scale, backend=backend, cu_seqlens=cu_seqlens)

    @property
    def _ring_layout(self) -> str:
        return "per_document" if self.sharding == "per_document" else "zigzag"

    def __repr__(self) -> str:
        return (
            f"SequenceParallel(ring={self.ring_size} (rank {self.ring_rank}), "
            f"ulysses={self.ulysses_size} (rank {self.ulysses_rank})"
            + (f", sharding={self.sharding!r})" if self.sharding != "zigzag" else ")")
        )
