"""Running a length-adaptive SP plan (:class:`sp_plan.planner.adaptive_sp.AdaptiveSPPlan`): rows of different length
buckets on different Ulysses x Ring groups inside one job, with the token-weighted loss of one process.

What a step does (the plan's docstring fixes the shape; this module executes it):

1. **Groups, once, up front** (:func:`build_bucket_groups`). Bucket ``b`` with ``U = ulysses``, ``R = ring`` lays
   the world out as the runtime's mesh does (:mod:`sp_plan.runtime.mesh`: dims ``dp, ring, ulysses``, Ulysses
   innermost): rank ``= slot x (R U) + ring_rank x U + ulysses_rank``. So a Ulysses group is ``U`` consecutive
   ranks (the fast intra-node links), a ring group the ranks ``U`` apart inside one SP block, and ``slot`` is the
   data-parallel group the rank works for in that bucket. Every rank creates every group of every bucket, in one
   deterministic order (bucket order, then Ulysses sets, then ring sets, each set once), because
   ``torch.distributed.new_group`` is collective over the whole world.
2. **Rows to groups** (:func:`assign_rows`, pure, identical on every rank): a row goes to its own ``bucket`` if it
   names one, else to ``plan.bucket_for(longest document)``; inside a bucket, longest-processing-time first on the
   causal attention work of its documents (``sum L (L + 1) / 2``, the quadratic term that makes long rows slow):
   rows in decreasing work (ties: lower row index first), each to the group with the least work so far (ties: fewer
   rows, then lower slot).
3. **One attention, switched per bucket** (:class:`BucketAttention`): the model's attention is routed once, through
   the model family's own adapter (``swap_attention``, the same integration ``auto_configure`` uses: the runtime
   Llama's ``attention_fn``, transformers' attention registry), to a stand-in that forwards every call to the
   active bucket's :class:`sp_plan.runtime.context.SequenceParallel`. No new attention code.
4. **Forward and backward per bucket** (:meth:`AdaptiveSPRunner.accumulate`): each group shards its rows along the
   sequence with its bucket's context (:class:`sp_plan.runtime.data.BatchSharder`: pre-shifted labels, padding,
   per-document or zigzag ring sharding) and back-propagates ``local token-loss sum / N``, ``N`` the loss tokens of
   the WHOLE global batch (counted on every rank from the rows, no communication).
5. **One reduction** (:func:`reduce_gradients`): every gradient (plus the loss sum, one extra element) in one flat
   buffer, one ``all_reduce(SUM)`` over the world.

Why a plain sum over the world is exact. Inside an SP group every rank holds the same replica; the sequence-parallel
ops' backward (the all-to-all's adjoint, the ring's dK/dV pass) carries each token's gradient back to the rank that
holds that token's q/k/v, so a rank's parameter gradient is the contribution of ITS shard's activations, and the
group's gradient is the sum over its ranks (the existing runtime gets the same sum from FSDP2's reduce-scatter with
divide factor 1 over ``dp_shard x ring x ulysses``). Summing over the world therefore adds every group's rows once,
over every bucket, each scaled by ``1 / N``: ``d/dθ (sum of all token losses / N)``, the single-process gradient of
the global batch's mean loss. Ranks of a group with no row in a bucket contribute zeros.

Limits: replicated parameters only (DDP-style: every rank holds the whole model; FSDP2/TP/DTensor parameters are
refused), no pipeline stages, no tensor parallelism; one optimizer step per global batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_plan.planner.adaptive_sp import AdaptiveSPPlan, LengthBucket
from sp_plan.runtime.attention.ulysses import ulysses_kv_replication
from sp_plan.runtime.context import SHARDINGS, SequenceParallel
from sp_plan.runtime.data import DOCUMENTS_KEY, IGNORE_INDEX, BatchSharder, shift_labels
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.loss import cross_entropy_sum

RankSet = tuple[int, ...]


# ----- rows --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedRow:
    """One packed sequence of the global batch: its token ids and the lengths of the documents it holds, in order
    (attention is masked per document; nothing is predicted across a document boundary).

    ``labels``: HF-style (unshifted, ``-100`` ignored) targets; None = the input ids. ``bucket``: the plan's bucket
    this row was packed for (a packer that packs per bucket knows it); None = the bucket of its longest document.
    """

    input_ids: tuple[int, ...]
    documents: tuple[int, ...]
    labels: tuple[int, ...] | None = None
    bucket: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        object.__setattr__(self, "documents", tuple(int(d) for d in self.documents))
        if self.labels is not None:
            object.__setattr__(self, "labels", tuple(int(t) for t in self.labels))
        if not self.input_ids:
            raise RuntimeConfigError("a packed row has no tokens: drop empty rows before the step")
        if any(d < 1 for d in self.documents) or sum(self.documents) != len(self.input_ids):
            raise RuntimeConfigError(
                f"a packed row of {len(self.input_ids)} tokens has document lengths summing to {sum(self.documents)} "
                f"({list(self.documents[:4])}{'...' if len(self.documents) > 4 else ''}): give every document's "
                "length (each >= 1) so that they add up to the row")
        if self.labels is not None and len(self.labels) != len(self.input_ids):
            raise RuntimeConfigError(f"a packed row has {len(self.input_ids)} tokens but {len(self.labels)} labels")

    @property
    def tokens(self) -> int:
        return len(self.input_ids)

    @property
    def longest(self) -> int:
        return max(self.documents)

    @property
    def attention_work(self) -> int:
        """Causal query-key pairs under document masking: ``sum L (L + 1) / 2`` over the row's documents."""
        return sum(d * (d + 1) // 2 for d in self.documents)


def _starts(documents: Sequence[int], length: int) -> torch.Tensor:
    """Bool ``(length,)``: True at every document start after position 0."""
    starts = torch.zeros(length, dtype=torch.bool)
    offset = 0
    for d in documents[:-1]:
        offset += d
        starts[offset] = True
    return starts


def row_labels(row: PackedRow) -> torch.Tensor:
    """The row's pre-shifted labels (``(1, tokens)``, what the loss counts), exactly as the sharder shifts them."""
    labels = torch.tensor([row.labels if row.labels is not None else row.input_ids], dtype=torch.int64)
    return shift_labels(labels, starts=_starts(row.documents, row.tokens)[None])


def loss_tokens(rows: Sequence[PackedRow]) -> int:
    """Loss tokens of the global batch (the mean's denominator): computed from the rows, so every rank knows it
    without a collective."""
    return sum(int((row_labels(r) != IGNORE_INDEX).sum()) for r in rows)


def rows_batch(rows: Sequence[PackedRow], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """A full-sequence batch (``input_ids``, ``labels``, ``cu_seqlens``) of rows stacked to the longest: a shorter
    row's tail padding is a document of its own with ignored labels (the real tokens never see it: causal)."""
    length = max(r.tokens for r in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.int64)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.int64)
    points = [0]
    for i, r in enumerate(rows):
        ids[i, : r.tokens] = torch.tensor(r.input_ids)
        labels[i, : r.tokens] = torch.tensor(r.labels if r.labels is not None else r.input_ids)
        for d in r.documents:
            points.append(points[-1] + d)
        if r.tokens < length:
            points.append((i + 1) * length)
    return {"input_ids": ids, "labels": labels, DOCUMENTS_KEY: torch.tensor(points, dtype=torch.int32)}


# ----- layout and groups (pure parts first) --------------------------------------------------------------------


@dataclass(frozen=True)
class BucketCoordinates:
    """Where a rank sits in one bucket's layout: data-parallel ``slot`` (its group), ring rank, Ulysses rank."""

    slot: int
    ring_rank: int
    ulysses_rank: int


def bucket_coordinates(rank: int, ulysses: int, ring: int) -> BucketCoordinates:
    """The mesh order (dp, ring, ulysses; Ulysses innermost) of :mod:`sp_plan.runtime.mesh`, for one bucket."""
    sp = ulysses * ring
    return BucketCoordinates(slot=rank // sp, ring_rank=(rank % sp) // ulysses, ulysses_rank=rank % ulysses)


def bucket_rank_sets(world: int, ulysses: int, ring: int) -> tuple[list[RankSet], list[RankSet]]:
    """Every Ulysses group and every ring group of a bucket (as rank tuples, in creation order): Ulysses groups are
    ``U`` consecutive ranks; ring groups the ranks ``U`` apart inside one SP block of ``U x R`` ranks."""
    sp = ulysses * ring
    if world % sp:
        raise RuntimeConfigError(f"ulysses x ring = {sp} does not divide the {world} ranks")
    ulysses_sets = [tuple(range(block + r * ulysses, block + (r + 1) * ulysses))
                    for block in range(0, world, sp) for r in range(ring)]
    ring_sets = [tuple(block + u + r * ulysses for r in range(ring))
                 for block in range(0, world, sp) for u in range(ulysses)]
    return ulysses_sets, ring_sets


def group_creation_order(plan: AdaptiveSPPlan) -> list[RankSet]:
    """The rank sets :func:`build_bucket_groups` creates, in order: per bucket its Ulysses then its ring sets, each
    distinct set once (buckets with the same degrees share groups), size-1 sets never (degree 1 needs no group)."""
    order: list[RankSet] = []
    seen: set[RankSet] = set()
    for bucket in plan.buckets:
        ulysses_sets, ring_sets = bucket_rank_sets(plan.world, bucket.ulysses, bucket.ring)
        for ranks in ulysses_sets + ring_sets:
            if len(ranks) > 1 and ranks not in seen:
                seen.add(ranks)
                order.append(ranks)
    return order


@dataclass
class BucketGroups:
    """One bucket on this rank: its degrees, this rank's slot, and the SequenceParallel context of its SP group."""

    index: int
    bucket: LengthBucket
    data_parallel: int
    coordinates: BucketCoordinates
    ulysses_ranks: RankSet
    ring_ranks: RankSet
    sp: SequenceParallel = field(repr=False)

    @property
    def slot(self) -> int:
        return self.coordinates.slot


def check_world(plan: AdaptiveSPPlan, world: int) -> None:
    """The plan is for this many ranks."""
    if plan.world != world:
        raise RuntimeConfigError(
            f"the adaptive SP plan is for {plan.world} ranks but this job has {world}: launch with torchrun "
            f"--nproc-per-node {plan.world} (or across nodes), or plan for {world} ranks")


def build_bucket_groups(plan: AdaptiveSPPlan, *, sharding: str = "per_document",
                        backend: str | None = None) -> list[BucketGroups]:
    """Create every process group of every bucket (collective: every rank must call it, with the same plan) and
    return this rank's view of each bucket. ``sharding``: how a ring splits a packed row (``"per_document"``,
    balanced for any mix of document lengths, or ``"zigzag"`` over the whole row); ``backend``: the attention
    kernel backend (None: the runtime's choice)."""
    if sharding not in SHARDINGS:
        raise RuntimeConfigError(f"unknown sequence sharding {sharding!r}: choose one of {', '.join(SHARDINGS)}")
    if not dist.is_initialized():
        raise RuntimeConfigError("torch.distributed is not initialised: call init_process_group (torchrun) before "
                                 "building the adaptive SP groups")
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world(plan, world)
    groups: dict[RankSet, dist.ProcessGroup] = {}
    for ranks in group_creation_order(plan):  # the same order on every rank: new_group is collective
        groups[ranks] = dist.new_group(list(ranks))
    out = []
    for index, bucket in enumerate(plan.buckets):
        coords = bucket_coordinates(rank, bucket.ulysses, bucket.ring)
        ulysses_sets, ring_sets = bucket_rank_sets(world, bucket.ulysses, bucket.ring)
        mine_u = next(s for s in ulysses_sets if rank in s)
        mine_r = next(s for s in ring_sets if rank in s)
        sp = SequenceParallel(groups.get(mine_u), groups.get(mine_r), backend=backend, sharding=sharding)
        out.append(BucketGroups(index=index, bucket=bucket, data_parallel=bucket.data_parallel(world),
                                coordinates=coords, ulysses_ranks=mine_u, ring_ranks=mine_r, sp=sp))
    return out


# ----- rows to buckets and groups ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RowAssignment:
    """``groups[b][slot]``: the indices (into the global batch) of the rows data-parallel group ``slot`` of bucket
    ``b`` runs, in the order it runs them; ``work[b][slot]``: their attention work."""

    groups: tuple[tuple[tuple[int, ...], ...], ...]
    work: tuple[tuple[int, ...], ...]

    def rows_of(self, bucket: int, slot: int) -> tuple[int, ...]:
        return self.groups[bucket][slot]


def bucket_of(plan: AdaptiveSPPlan, row: PackedRow, index: int = 0) -> int:
    """The bucket ``row`` runs in: its own, or the bucket of its longest document; refuses rows longer than that
    bucket's rows."""
    if row.bucket is not None:
        if not 0 <= row.bucket < len(plan.buckets):
            raise RuntimeConfigError(f"row {index} names bucket {row.bucket} but the plan has {len(plan.buckets)} "
                                     f"(0..{len(plan.buckets) - 1})")
        b = row.bucket
    else:
        b = plan.bucket_for(row.longest)
    bucket = plan.buckets[b]
    if row.tokens > bucket.row_tokens:
        raise RuntimeConfigError(
            f"row {index} has {row.tokens} tokens, more than the {bucket.row_tokens}-token rows of bucket {b} (documents "
            f"up to {bucket.max_document_tokens} tokens, ulysses={bucket.ulysses} x ring={bucket.ring}): pack rows "
            "of at most the bucket's row_tokens, or give the row the bucket it was packed for")
    return b


def assign_rows(plan: AdaptiveSPPlan, rows: Sequence[PackedRow]) -> RowAssignment:
    """Deterministic assignment of the global batch's rows to buckets and, inside each, to data-parallel groups:
    longest-processing-time first on attention work (see the module docstring, step 2). Pure: every rank computes
    the same assignment from the same rows."""
    by_bucket: list[list[int]] = [[] for _ in plan.buckets]
    for i, row in enumerate(rows):
        by_bucket[bucket_of(plan, row, i)].append(i)
    groups, works = [], []
    for b, indices in enumerate(by_bucket):
        slots = plan.buckets[b].data_parallel(plan.world)
        load = [0] * slots
        taken: list[list[int]] = [[] for _ in range(slots)]
        for i in sorted(indices, key=lambda i: (-rows[i].attention_work, i)):
            slot = min(range(slots), key=lambda s: (load[s], len(taken[s]), s))
            taken[slot].append(i)
            load[slot] += rows[i].attention_work
        groups.append(tuple(tuple(t) for t in taken))
        works.append(tuple(load))
    return RowAssignment(groups=tuple(groups), work=tuple(works))


# ----- the model's attention, switched per bucket -----------------------------------------------------------


class BucketAttention:
    """Stands in for a :class:`SequenceParallel` inside the model's attention modules and forwards to the active
    bucket's context, so one swap (through the model family's adapter) serves every bucket. Outside
    :meth:`use` the active context is the one given at construction (degree 1: local attention)."""

    def __init__(self, default: SequenceParallel) -> None:
        self.__dict__["active"] = default

    def __getattr__(self, name: str) -> Any:  # size, rank, sharding, ...: the active context's
        return getattr(self.__dict__["active"], name)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  scale: float | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        return self.__dict__["active"].attention(q, k, v, causal=causal, scale=scale, cu_seqlens=cu_seqlens)

    @contextlib.contextmanager
    def use(self, sp: SequenceParallel) -> Iterator[SequenceParallel]:
        """Run the attention on ``sp`` inside the block (restored after, also on errors)."""
        previous = self.__dict__["active"]
        self.__dict__["active"] = sp
        try:
            yield sp
        finally:
            self.__dict__["active"] = previous

    def __repr__(self) -> str:
        return f"BucketAttention(active={self.__dict__['active']!r})"


def install_bucket_attention(model: nn.Module, seq_len: int, adapter: Any = None) -> BucketAttention:
    """Route ``model``'s attention through a :class:`BucketAttention` with the family's own ``swap_attention``
    (``seq_len``: the longest row the model will see, which some families check, e.g. against a sliding window)."""
    from sp_plan.runtime.models.base import adapter_for

    adapter = adapter if adapter is not None else adapter_for(model)
    switch = BucketAttention(SequenceParallel())
    adapter.swap_attention(model, switch, seq_len)
    return switch


# ----- checks -----------------------------------------------------------------------------------------------


def check_replicated(model: nn.Module) -> None:
    """Refuse FSDP2- or DTensor-sharded models: the step's single all-reduce assumes every rank holds whole
    parameters (plain DDP-style replicas)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FSDPModule) for m in model.modules()) or any(
            isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeConfigError(
            "length-adaptive SP runs replicated parameters only (one gradient all-reduce over the world): pass the "
            "plain model, not one wrapped by FSDP2/fully_shard or tensor parallelism")


def check_heads(plan: AdaptiveSPPlan, q_heads: int, kv_heads: int) -> None:
    """Every bucket's Ulysses degree must split the query heads (and split or replicate the KV heads)."""
    for i, bucket in enumerate(plan.buckets):
        try:
            ulysses_kv_replication(q_heads, kv_heads, bucket.ulysses)
        except RuntimeConfigError as exc:
            raise RuntimeConfigError(f"bucket {i} (documents up to {bucket.max_document_tokens} tokens): {exc}") from None


# ----- gradients --------------------------------------------------------------------------------------------


def reduce_gradients(params: Sequence[nn.Parameter], extra: torch.Tensor | None = None,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """Sum every parameter's gradient (missing ones count as zero) and ``extra`` (e.g. the loss sum) over ``group``
    (default: the world) in ONE all-reduce of one flat buffer (dtype: the widest gradient dtype, at least fp32);
    writes the sums back into ``.grad`` and returns the summed ``extra``. Every parameter in ``params`` leaves with
    a gradient (zeros where no rank produced one), as DDP's buckets do."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    tensors = grads + ([extra.reshape(-1)] if extra is not None else [])
    if not tensors:
        return None
    dtype = torch.float32
    for g in grads:  # the gradients decide (an fp64 loss sum does not double an fp32 model's traffic)
        dtype = torch.promote_types(dtype, g.dtype)
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(g.dtype).clone()
        offset += n
    return flat[offset:].view_as(extra).to(extra.dtype) if extra is not None else None


# ----- the runner -------------------------------------------------------------------------------------------


@dataclass
class AdaptiveStepResult:
    """``loss``: the global batch's token-mean loss (every rank); ``tokens``: its loss tokens; ``local_rows``: rows
    this rank's groups ran, per bucket; ``seconds``: wall time of the step."""

    loss: float
    tokens: int
    local_rows: tuple[int, ...]
    seconds: float


class AdaptiveSPRunner:
    """Trains a replicated model on an :class:`AdaptiveSPPlan` (collective constructor: every rank, same plan).

    ``sharding``: the ring's row split (``"per_document"`` or ``"zigzag"``); ``micro_batch_rows``: rows a group
    stacks into one forward (padded to the longest of them); ``sync_weights``: start every rank from rank 0's
    weights (one broadcast per tensor); ``adapter``: the model family (default: found from the model).
    """

    def __init__(self, model: nn.Module, plan: AdaptiveSPPlan, *, sharding: str = "per_document",
                 micro_batch_rows: int = 1, pad_token_id: int = 0, sync_weights: bool = True,
                 adapter: Any = None, backend: str | None = None) -> None:
        from sp_plan.runtime.models.base import adapter_for

        if not isinstance(plan, AdaptiveSPPlan):
            raise RuntimeConfigError(f"expected an AdaptiveSPPlan, got {type(plan).__name__}")
        if isinstance(micro_batch_rows, bool) or not isinstance(micro_batch_rows, int) or micro_batch_rows < 1:
            raise RuntimeConfigError(f"micro_batch_rows must be a positive integer, got {micro_batch_rows!r}")
        if not dist.is_initialized():
            raise RuntimeConfigError("torch.distributed is not initialised: run under torchrun (or "
                                     "init_process_group) before AdaptiveSPRunner")
        check_world(plan, dist.get_world_size())
        check_replicated(model)
        self.adapter = adapter if adapter is not None else adapter_for(model)
        spec = self.adapter.spec(model)
        check_heads(plan, spec.num_heads, spec.num_kv_heads)
        self.model, self.plan = model, plan
        self.micro_batch_rows, self.pad_token_id = micro_batch_rows, pad_token_id
        self.device = next(model.parameters()).device
        self.buckets = build_bucket_groups(plan, sharding=sharding, backend=backend)
        self.switch = install_bucket_attention(model, max(b.row_tokens for b in plan.buckets), self.adapter)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if sync_weights:
            from sp_plan.runtime.distributed import broadcast_parameters

            broadcast_parameters([model], self.device)

    def sharder(self, bucket: BucketGroups) -> BatchSharder:
        return BatchSharder(bucket.sp, pad_token_id=self.pad_token_id, device=self.device)

    def _micro_batches(self, indices: Sequence[int]) -> Iterator[tuple[int, ...]]:
        for start in range(0, len(indices), self.micro_batch_rows):
            yield tuple(indices[start : start + self.micro_batch_rows])

    def accumulate(self, rows: Sequence[PackedRow], assignment: RowAssignment | None = None,
                   tokens: int | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Forward and backward of this rank's share of every bucket, in bucket order, gradients accumulated into
        ``.grad`` scaled by ``1 / tokens`` (default: the global batch's loss tokens). Returns this rank's token-loss
        sum (detached; summing it over the world gives the batch's) and the rows it ran per bucket."""
        assignment = assignment if assignment is not None else assign_rows(self.plan, rows)
        tokens = tokens if tokens is not None else loss_tokens(rows)
        local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        ran = []
        for bucket in self.buckets:
            mine = assignment.rows_of(bucket.index, bucket.slot)
            ran.append(len(mine))
            sharder = self.sharder(bucket)
            with self.switch.use(bucket.sp):
                for micro in self._micro_batches(mine):
                    shard = sharder(rows_batch([rows[i] for i in micro], self.pad_token_id))
                    logits = self.adapter.logits(self.model, shard["input_ids"], shard["position_ids"],
                                                 shard.get(DOCUMENTS_KEY))
                    loss_sum = cross_entropy_sum(logits, shard["labels"])
                    (loss_sum / max(tokens, 1)).backward()
                    local_sum += loss_sum.detach().to(torch.float64)
        return local_sum, tuple(ran)

    def step(self, rows: Sequence[PackedRow], optimizer: torch.optim.Optimizer | None = None) -> AdaptiveStepResult:
        """One optimizer step on the global batch ``rows`` (the same list on every rank): :meth:`accumulate`, one
        all-reduce of the gradients and the loss sum, then ``optimizer.step()`` and ``zero_grad`` (with
        ``optimizer=None`` the reduced gradients stay in ``.grad`` for inspection)."""
        started = time.perf_counter()
        if not rows:
            raise RuntimeConfigError("the global batch has no rows: every step needs at least one packed row")
        tokens = loss_tokens(rows)
        local_sum, ran = self.accumulate(rows, assign_rows(self.plan, rows), tokens)
        total = reduce_gradients(self.params, local_sum)
        loss = float(total) / tokens if tokens else 0.0
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return AdaptiveStepResult(loss=loss, tokens=tokens, local_rows=ran, seconds=time.perf_counter() - started)


__all__ = [
    "AdaptiveSPRunner",
    "AdaptiveStepResult",
    "BucketAttention",
    "BucketCoordinates",
    "BucketGroups",
    "PackedRow",
    "RowAssignment",
    "assign_rows",
    "bucket_coordinates",
    "bucket_of",
    "bucket_rank_sets",
    "build_bucket_groups",
    "check_heads",
    "check_replicated",
    "check_world",
    "group_creation_order",
    "install_bucket_attention",
    "loss_tokens",
    "reduce_gradients",
    "row_labels",
    "rows_batch",
]
