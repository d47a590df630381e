"""Choosing a length-adaptive SP plan (:class:`sp_plan.planner.adaptive_sp.AdaptiveSPPlan`): which document lengths
go to which bucket, each bucket's Ulysses x Ring degree, and what the step then costs against the best single layout.

Why: on a long-tailed set (``long-doc-mix``) most documents are short but most attention work is in the long ones.
One layout must be sized for the longest rows, so the short documents' rows also pay a large SP group's all-to-alls
and ring hops for attention they barely have. Splitting the documents by length (ByteScale, FlexSP) lets short rows
run data-parallel on small groups while long rows keep the large group.

How (each step a small function below):

1. **Buckets.** Candidate bounds are powers of two from :data:`MIN_ROW_TOKENS` up to, not including, ``--seq-len``;
   the last bucket's bound is ``--seq-len`` and it also takes every longer document (cut into rows, as one layout
   would). Each histogram bin goes to exactly one bucket (:func:`split_histogram`). A bucket's documents are packed
   first fit (:mod:`sp_plan.cost_models.packing`) into rows of its bound, raised to the tokens a rank holds in the
   single layout (:func:`row_tokens`): a power of two, which every zigzag ``2 x ring`` and ``ulysses`` degree divides.
2. **Rows per step.** The step trains the documents of the global batch the single-layout search is asked for:
   ``D = (global_batch_tokens // seq_len) x seq_len x (1 - padding)`` document tokens. Bucket ``b`` holds the share
   ``s_b`` of the histogram's tokens, so it packs ``D x s_b / (row_b x (1 - padding_b))`` rows, rounded up.
3. **A layout per bucket.** The existing search (:func:`sp_plan.planner.search.search`), restricted to what the
   runtime half runs: ``tp = pp = 1``, no HSDP split (``dp_replicate = 1``, so ZeRO shards the same state over the
   whole world in every bucket) and one row per micro-batch (the plan file has no micro-batch field); its rows are
   the bucket's rows (``global_batch_tokens = rows x row``) and its data the bucket's own documents, so attention
   and the balance over ranks are priced on them. One job holds one set of weights and optimizer state, so the
   memory options are the same in every bucket: pinned to the single-layout plan's (ZeRO stage, offloads,
   checkpointing, tiled MLP and loss), since the runtime cannot switch them between micro-batches.
4. **The step.** The time model composes a step as ``grad_accum x microbatch_s`` plus a once-per-step part (the
   last micro-batch's gradient-reduction tail, once-per-step collectives, the optimizer, offload and the stack's
   overhead): ``step_s = accum x microbatch_s + fixed``. A bucket's time is its micro-batches only,
   ``rows_per_group x microbatch_s_b`` on its slowest data-parallel group (:func:`rows_per_group`: the mean rows of a
   step spread over the groups, plus the expected idle row of the rounding; its data balance prices the groups'
   straggling), and the step is the sum over
   buckets plus the once-per-step part counted once: the largest of the buckets' (conservative: they differ only in
   how much of the reduction the last backward hides). Tokens per step are the buckets' useful tokens.
5. **Splits.** The one-bucket split (the restricted single layout), every two-bucket split, then three-bucket
   splits that add a bound on either side of the best two-bucket bound (a greedy refinement: every three-bucket
   split would cost a search per bucket pair, too slow to stay interactive). The answer is the split with the most
   tokens per second; it is compared with the unrestricted single-layout plan (``plan --lengths``'s answer). When
   no split beats that plan the report says so, and that is a valid answer.

Searches are cached per bucket (its bounds), and each multi-bucket bucket's data is a thinned sample of
:data:`BUCKET_SAMPLE_ROWS` rows' worth of documents (the data balance packs and scores every row of its sample per
ring degree, which dominated the search's time); the one-bucket split keeps the data exactly as given, so it prices
exactly what ``plan --lengths`` does.
"""

from __future__ import annotations

import math
import time as wallclock
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from sp_plan.cost_models.data_balance import DataShape
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.lengths import histogram_from_lengths
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.packing import sample_lengths
from sp_plan.cost_models.topology import Topology
from sp_plan.cost_models.train_spec import TrainSpec

from .adaptive_sp import AdaptiveSPPlan, LengthBucket
from .errors import PlannerError
from .search import PlanSettings, RankedPlan, SearchResult, search

#: The shortest bucket bound (and row) considered: below it a row is too short to keep the GEMMs efficient and
#: the gain over a 2K row is nil.
MIN_ROW_TOKENS = 2048
#: At most this many buckets (each costs a search; FlexSP and ByteScale report most of the gain with 2-3).
MAX_BUCKETS = 3
#: A multi-bucket bucket's data is thinned to about this many rows of documents (see the module docstring).
BUCKET_SAMPLE_ROWS = 128
#: Layout degrees the runtime half runs (runtime/adaptive_sp.py): SP groups side by side, no TP, no pipeline, no
#: HSDP replica split.
RUNTIME_LAYOUT = {"tp": 1, "pp": 1, "dp_replicate": 1, "ep": 1}
#: Memory options one job holds for all its buckets (pinned to the single-layout plan's).
SHARED_OPTIONS = ("zero_stage", "offload_optimizer", "offload_params", "offload_checkpoints", "checkpointing",
                  "tiled_mlp", "tiled_loss")


# ----- 1. buckets --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketDocs:
    """The documents of one bucket: lengths in ``(lower, upper]`` (the last bucket also those above ``upper``)."""

    lower: int
    upper: int
    bins: tuple[tuple[int, int], ...]

    @property
    def documents(self) -> int:
        return sum(count for _, count in self.bins)

    @property
    def tokens(self) -> int:
        return sum(length * count for length, count in self.bins)


def candidate_bounds(seq_len: int, min_row: int = MIN_ROW_TOKENS) -> list[int]:
    """Powers of two in ``[min_row, seq_len)``: the bounds a bucket other than the last may end at (a power of two
    is a row every Ulysses and zigzag ``2 x ring`` degree of a power-of-two world divides)."""
    bounds, bound = [], 1 << max(0, (min_row - 1).bit_length())
    while bound < seq_len:
        bounds.append(bound)
        bound *= 2
    return bounds


def split_histogram(bins: tuple[tuple[int, int], ...], bounds: tuple[int, ...]) -> list[BucketDocs]:
    """Each ``(length, count)`` bin into the first bucket whose bound holds it (the last takes longer ones): the same
    rule as :meth:`AdaptiveSPPlan.bucket_for`, so every document lands in exactly one bucket."""
    if not bounds or list(bounds) != sorted(set(bounds)):
        raise PlannerError(f"bucket bounds {list(bounds)} must be a non-empty, strictly increasing list")
    groups: list[list[tuple[int, int]]] = [[] for _ in bounds]
    for length, count in bins:
        index = next((i for i, bound in enumerate(bounds) if length <= bound), len(bounds) - 1)
        groups[index].append((length, count))
    lowers = (0, *bounds[:-1])
    return [BucketDocs(lower, upper, tuple(group)) for lower, upper, group in zip(lowers, bounds, groups)]


def bucket_shape(docs: BucketDocs, data: DataShape, row_tokens: int, exact: bool) -> DataShape:
    """The bucket's documents as the search's data, packed first fit (``stream`` would cut documents at row ends,
    which is what a bucket exists to avoid; ``auto`` too); thinned to :data:`BUCKET_SAMPLE_ROWS` rows' worth unless
    ``exact``."""
    packing = "first_fit" if data.packing in ("stream", "auto") else data.packing
    bins = docs.bins
    if not exact:
        bins = histogram_from_lengths(sample_lengths(bins, BUCKET_SAMPLE_ROWS * row_tokens)).bins
    return DataShape(bins=bins, packing=packing, sharding=data.sharding,
                     source=f"{data.source} [{docs.lower + 1}-{docs.upper} tokens]")


# ----- 2.-4. pricing a bucket and a split ----------------------------------------------------------------------


class BucketPrice(BaseModel):
    """One bucket at its best layout: what it trains per step and how long its micro-batches take."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    lower: int
    upper: int
    row_tokens: int
    layout: Layout
    documents_share: float
    tokens_share: float
    #: Rows per step (the mean, for a bucket of a multi-bucket split) and rows its slowest group runs.
    rows_per_step: float
    rows_per_group: float
    #: The bucket's micro-batches on its slowest group: ``rows_per_group x microbatch_s``.
    seconds: float
    #: The once-per-step part of the bucket's own priced step (counted once for the whole adaptive step).
    step_fixed_s: float
    tokens_per_step: float
    memory_bytes: float
    capacity_bytes: float
    plan: RankedPlan

    @property
    def bucket(self) -> LengthBucket:
        return LengthBucket(max_document_tokens=self.upper, row_tokens=self.row_tokens, ulysses=self.layout.ulysses,
                            ring=self.layout.ring)


class SplitPrice(BaseModel):
    """A split of the documents into buckets, priced as one step (module docstring, step 4)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    bounds: tuple[int, ...]
    buckets: tuple[BucketPrice, ...]
    #: Seconds per step: the buckets' micro-batches one after another, plus the once-per-step part once.
    step_s: float
    reduction_s: float
    tokens_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def plan(self, world: int) -> AdaptiveSPPlan:
        return AdaptiveSPPlan(world=world, buckets=[b.bucket for b in self.buckets])


class AdaptiveResult(BaseModel):
    """The adaptive answer beside the single-layout one."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    world: int
    best: SplitPrice | None
    #: The unrestricted single-layout plan (``plan --lengths``'s recommendation).
    single: RankedPlan
    candidates: tuple[SplitPrice, ...]
    #: Splits that could not be priced (a bucket with no fitting layout), with why.
    unpriced: tuple[tuple[tuple[int, ...], str], ...]
    pinned_options: dict[str, Any]
    document_tokens_per_step: float
    seconds: float

    @property
    def speedup(self) -> float | None:
        return None if self.best is None else self.best.tokens_per_s / self.single.estimate.time.tokens_per_s

    @property
    def beats_single(self) -> bool:
        """Whether a split of two or more buckets trains more tokens per second than the single layout."""
        return self.best is not None and len(self.best.buckets) > 1 and (self.speedup or 0.0) > 1.0

    @property
    def plan(self) -> AdaptiveSPPlan | None:
        return None if self.best is None else self.best.plan(self.world)

    @property
    def best_multi(self) -> SplitPrice | None:
        """The fastest split of two or more buckets (what the table shows when one bucket won)."""
        return max((c for c in self.candidates if len(c.buckets) > 1), key=lambda c: c.tokens_per_s, default=None)


@dataclass
class _Context:
    """What every bucket search of one adaptive search shares."""

    model: ModelSpec
    train: TrainSpec
    topology: Topology
    settings: PlanSettings
    world: int
    document_tokens: float
    total_tokens: int
    total_documents: int
    prices: dict[tuple[int, int], BucketPrice | str]
    #: Tokens each GPU holds of a row in the single-layout plan (``seq_len / (ulysses x ring)``): the least row a
    #: bucket of short documents is packed into (see :func:`row_tokens`).
    rank_tokens: int = 1


def document_tokens_per_step(train: TrainSpec, settings: PlanSettings) -> float:
    """The document tokens of the global batch the single-layout search trains: its rows of ``seq_len`` less the
    padding first-fit packing leaves (at ring 1: rounding documents for a ring's rule is the bucket layout's cost)."""
    rows = max(1, settings.global_batch_tokens // train.seq_len)
    data = train.data if train.data.packing != "auto" else train.data.model_copy(update={"packing": "first_fit"})
    padding = data.balance(train.seq_len, 1, "zigzag").padding_fraction
    return rows * train.seq_len * (1.0 - padding)


def row_tokens(bound: int, seq_len: int, rank_tokens: int) -> int:
    """The row a bucket of documents up to ``bound`` tokens is packed into: its bound, raised to the smallest power of
    two that gives a rank at least the tokens the single layout gives it (``rank_tokens``), never above ``seq_len``.

    Why: a bucket runs one row per micro-batch, and a micro-batch pays fixed costs (ZeRO's gradient reduce-scatter
    and FSDP's gathers hide behind its compute only when it has enough tokens; kernel launches; the LM head). A
    bucket of 2K documents in 2K rows on groups of one GPU gives each micro-batch a quarter of the tokens a 32K row
    on Ulysses 8 gives each rank, and was priced slower per token than the single layout (sft-short, 8 x H100);
    packing them into rows of the single layout's per-rank tokens keeps every micro-batch as large as it was."""
    if bound >= seq_len:
        return seq_len
    row = bound
    while row < rank_tokens and row * 2 <= seq_len:
        row *= 2
    return row


def _expected_rows(ctx: _Context, docs: BucketDocs, row_tokens: int, useful: float) -> float:
    """Rows the bucket packs per step on average: its share of the step's document tokens over a row's useful
    tokens (``useful``: 1 - padding of the bucket's packing under its layout's sharding rule)."""
    return ctx.document_tokens * docs.tokens / ctx.total_tokens / (row_tokens * useful)


def rows_per_group(rows: float, groups: int) -> float:
    """Rows the slowest of ``groups`` data-parallel groups runs per step, on average, when a step's rows of a bucket
    vary from step to step around ``rows`` (the documents of a global batch fall into buckets by chance): the runtime
    deals them out so groups differ by at most one row, so the slowest runs ``ceil(R / groups)``, whose mean over
    residues spread evenly is ``rows / groups + (groups - 1) / (2 groups)``; one group runs exactly the mean."""
    return rows / groups + (groups - 1) / (2 * groups)


def price_bucket(ctx: _Context, docs: BucketDocs) -> BucketPrice | str:
    """The bucket at the fastest runtime layout that fits (cached by bounds), or why none does.

    The whole histogram in one bucket is the single-layout question under the runtime's restrictions: a step of
    exactly ``global_batch_tokens // seq_len`` rows, ``ceil(rows / dp)`` per group, priced and counted as the
    search does. A bucket of a multi-bucket split holds a varying number of rows per step: its search runs on the
    mean rounded up (a whole number of micro-batches for the data balance's straggling), and it is priced at the
    mean (:func:`rows_per_group`) with the data's document tokens."""
    key = (docs.lower, docs.upper)
    if key in ctx.prices:
        return ctx.prices[key]
    whole = docs.lower == 0 and docs.upper == ctx.train.seq_len
    row = row_tokens(docs.upper, ctx.train.seq_len, ctx.rank_tokens)
    shape = ctx.train.data if whole else bucket_shape(docs, ctx.train.data, row, exact=False)
    if whole:
        rows = float(max(1, ctx.settings.global_batch_tokens // row))
    else:
        rows = _expected_rows(ctx, docs, row, 1.0 - shape.balance(row, 1, "zigzag").padding_fraction)
    train = ctx.train.model_copy(update={"seq_len": row, "data": shape, "micro_batch": 1})
    settings = ctx.settings.model_copy(update={"global_batch_tokens": math.ceil(rows * (1 - 1e-9)) * row,
                                               "top_k": 1})
    reason = f"no layout with tp=1, pp=1 and the shared memory options fits {row:,}-token rows"
    try:
        result = search(ctx.model, train, ctx.topology, settings, world=ctx.world)
    except (PlannerError, CostModelError) as exc:
        result, reason = None, str(exc)
    if result is None or not result.plans:
        price: BucketPrice | str = reason
    else:
        price = _bucket_price(ctx, docs, result, None if whole else rows)
    ctx.prices[key] = price
    return price


def _bucket_price(ctx: _Context, docs: BucketDocs, result: SearchResult, rows: float | None) -> BucketPrice:
    """``rows`` None: the step's rows are fixed (the one-bucket split), priced as the search priced them."""
    best = result.best
    t = best.estimate.time
    microbatch_s = t.breakdown["microbatch_s"]
    fixed = max(0.0, t.step_s - best.train.grad_accum * microbatch_s)
    if rows is None:
        rows, per_group, tokens = float(result.global_batch_sequences), float(best.train.grad_accum), t.tokens_per_step
    else:  # the rows the layout's own padding (its sharding rule) needs for the bucket's documents
        useful = t.tokens_per_step / (best.train.grad_accum * best.layout.dp * best.train.seq_len)
        rows = _expected_rows(ctx, docs, best.train.seq_len, useful)
        per_group, tokens = rows_per_group(rows, best.layout.dp), rows * best.train.seq_len * useful
    return BucketPrice(
        lower=docs.lower, upper=docs.upper, row_tokens=best.train.seq_len, layout=best.layout,
        documents_share=docs.documents / ctx.total_documents, tokens_share=docs.tokens / ctx.total_tokens,
        rows_per_step=rows, rows_per_group=per_group, seconds=per_group * microbatch_s, step_fixed_s=fixed,
        tokens_per_step=tokens, memory_bytes=best.estimate.memory.total, capacity_bytes=result.usable_bytes,
        plan=best)


def price_split(ctx: _Context, bounds: tuple[int, ...]) -> SplitPrice | str:
    """The step of one split (module docstring, step 4), or why a bucket of it has no plan."""
    buckets = []
    for docs in split_histogram(ctx.train.data.bins, bounds):
        if not docs.bins:
            return f"no document falls in {docs.lower + 1:,}-{docs.upper:,} tokens"
        price = price_bucket(ctx, docs)
        if isinstance(price, str):
            return f"{docs.lower + 1:,}-{docs.upper:,} tokens: {price}"
        buckets.append(price)
    reduction = max(b.step_fixed_s for b in buckets)
    return SplitPrice(bounds=bounds, buckets=tuple(buckets), step_s=sum(b.seconds for b in buckets) + reduction,
                      reduction_s=reduction, tokens_per_step=sum(b.tokens_per_step for b in buckets))


# ----- 5. the search over splits --------------------------------------------------------------------------------


def shared_options(single: RankedPlan, settings: PlanSettings) -> dict[str, Any]:
    """The memory options every bucket runs with: the single-layout plan's (one job, one set of weights and optimizer
    state; the runtime cannot switch them between micro-batches), over the user's own pins."""
    return {**settings.fixed_options, **{k: single.options[k] for k in SHARED_OPTIONS if k in single.options}}


def adaptive_search(model: ModelSpec, train: TrainSpec, topology: Topology, settings: PlanSettings | None = None, *,
                    world: int | None = None, single: SearchResult | None = None, max_buckets: int = MAX_BUCKETS,
                    min_row: int = MIN_ROW_TOKENS) -> AdaptiveResult:
    """The best length-adaptive plan for ``train.data`` (``--lengths``) next to the best single layout.

    ``single``: the single-layout search already run for the same question (``plan`` has it), else it is run here.
    """
    if train.data is None:
        raise PlannerError("length-adaptive SP buckets the documents by length: give --lengths FILE|PRESET")
    if not train.is_training:
        raise PlannerError("length-adaptive SP plans a training step (buckets share one gradient reduction): drop "
                           "--mode prefill")
    if not 1 <= max_buckets <= 8:
        raise PlannerError(f"max_buckets {max_buckets} is outside 1..8")
    settings = settings or PlanSettings()
    world = world or topology.num_gpus
    started = wallclock.perf_counter()
    single = single if single is not None else search(model, train, topology, settings, world=world)
    if not single.plans:
        raise PlannerError("no single-layout plan fits, so no adaptive one does either (its last bucket holds the "
                           "longest rows with the same memory options)")
    pins = shared_options(single.best, settings)
    bucket_settings = settings.model_copy(update={"fixed_layout": dict(RUNTIME_LAYOUT), "fixed_options": pins,
                                                  "micro_batch_fixed": True})
    histogram_tokens = sum(length * count for length, count in train.data.bins)
    ctx = _Context(model, train, topology, bucket_settings, world, document_tokens_per_step(train, settings),
                   histogram_tokens, sum(count for _, count in train.data.bins), {},
                   max(1, train.seq_len // single.best.layout.sp))
    priced, unpriced = _walk_splits(ctx, candidate_bounds(train.seq_len, min_row), max_buckets)
    best = max(priced, key=lambda p: p.tokens_per_s, default=None)
    return AdaptiveResult(world=world, best=best, single=single.best, candidates=tuple(priced),
                          unpriced=tuple(unpriced), pinned_options=pins, document_tokens_per_step=ctx.document_tokens,
                          seconds=wallclock.perf_counter() - started)


def _walk_splits(ctx: _Context, bounds: list[int], max_buckets: int
                 ) -> tuple[list[SplitPrice], list[tuple[tuple[int, ...], str]]]:
    """One bucket, every two-bucket split, then three-bucket splits around the best two-bucket bound."""
    seq_len = ctx.train.seq_len
    priced: list[SplitPrice] = []
    unpriced: list[tuple[tuple[int, ...], str]] = []

    def attempt(split: tuple[int, ...]) -> SplitPrice | None:
        price = price_split(ctx, split)
        if isinstance(price, str):
            unpriced.append((split, price))
            return None
        priced.append(price)
        return price

    attempt((seq_len,))
    if max_buckets < 2:
        return priced, unpriced
    pairs = [p for p in (attempt((b, seq_len)) for b in bounds) if p is not None]
    if max_buckets < 3 or not pairs:
        return priced, unpriced
    middle = max(pairs, key=lambda p: p.tokens_per_s).bounds[0]
    for b in bounds:
        if b != middle:
            attempt(tuple(sorted((b, middle))) + (seq_len,))
    return priced, unpriced


# ----- reports ----------------------------------------------------------------------------------------------------


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 and tokens >= 1024 else f"{tokens:,}"


def _range(b: BucketPrice, last: bool) -> str:
    return f"{b.lower + 1:,}-{b.upper:,}" + ("+" if last else "")


def adaptive_lines(result: AdaptiveResult) -> list[str]:
    """The table ``plan --adaptive-sp`` prints under the recommendation."""
    single = result.single.estimate.time
    lines = ["", f"Length-adaptive SP (buckets of document length, each on its own Ulysses x Ring groups; "
                 f"memory options shared: {_options_text(result.pinned_options)}):"]
    if result.best is None:
        reasons = "; ".join(reason for _, reason in result.unpriced[:2])
        return lines + [f"  no adaptive split could be priced: {reasons}"]
    best = result.best
    lines.append(f"  {'documents (tokens)':22s} {'row':>5s} {'layout':24s} {'groups':>6s} {'rows/step':>9s} "
                 f"{'rows/group':>10s} {'tok share':>9s} {'seconds':>8s} {'memory GiB':>10s}")
    for i, b in enumerate(best.buckets):
        lines.append(f"  {_range(b, i == len(best.buckets) - 1):22s} {_k(b.row_tokens):>5s} {b.layout.describe():24s} "
                     f"{b.layout.dp:6d} {b.rows_per_step:9.1f} {b.rows_per_group:10.1f} {b.tokens_share:9.1%} "
                     f"{b.seconds:8.3f} {b.memory_bytes / 2**30:10.1f}")
    lines.append(f"  {'once per step (gradient reduction, optimizer, overhead)':78s} {best.reduction_s:8.3f}")
    lines.append(f"  adaptive step {best.step_s:.3f} s, {best.tokens_per_s:,.0f} tokens/s; single layout "
                 f"({result.single.layout.describe()}) {single.step_s:.3f} s, {single.tokens_per_s:,.0f} tokens/s: "
                 f"{result.speedup:.2f}x")
    if result.beats_single:
        lines.append(f"  -> the {len(best.buckets)}-bucket plan is predicted {result.speedup:.2f}x the single layout "
                     "(write it with --adaptive-out FILE)")
    else:
        lines.append("  -> no adaptive split beats the single layout for this data: keep the single plan")
        multi = result.best_multi
        if multi is not None:
            parts = ", ".join(f"<= {_k(b.upper)} on {b.layout.describe()}" for b in multi.buckets)
            lines.append(f"     (best split of {len(multi.buckets)} buckets: {parts}: {multi.tokens_per_s:,.0f} tokens/s, "
                         f"{multi.tokens_per_s / single.tokens_per_s:.2f}x)")
    lines.append(f"  ({len(result.candidates)} splits priced, {len(result.unpriced)} without a fitting layout, in "
                 f"{result.seconds:.2f} s)")
    return lines


def _options_text(options: dict[str, Any]) -> str:
    parts = [f"ZeRO-{options.get('zero_stage', 0)}", f"checkpointing {options.get('checkpointing', 'none')}"]
    parts += [name.replace("_", " ") for name in ("offload_optimizer", "offload_params", "offload_checkpoints",
                                                   "tiled_mlp", "tiled_loss") if options.get(name)]
    return ", ".join(parts) + ", one row per micro-batch"


def _bucket_json(b: BucketPrice) -> dict[str, Any]:
    return {"min_document_tokens": b.lower + 1, "max_document_tokens": b.upper, "row_tokens": b.row_tokens,
            "layout": b.layout.as_dict(), "data_parallel_groups": b.layout.dp, "rows_per_step": b.rows_per_step,
            "rows_per_group": b.rows_per_group, "documents_share": b.documents_share, "tokens_share": b.tokens_share,
            "seconds": b.seconds, "step_fixed_s": b.step_fixed_s, "tokens_per_step": b.tokens_per_step,
            "memory_bytes": b.memory_bytes, "capacity_bytes": b.capacity_bytes}


def _split_json(split: SplitPrice) -> dict[str, Any]:
    return {"bounds": list(split.bounds), "step_s": split.step_s, "reduction_s": split.reduction_s,
            "tokens_per_step": split.tokens_per_step, "tokens_per_s": split.tokens_per_s,
            "buckets": [_bucket_json(b) for b in split.buckets]}


def adaptive_json(result: AdaptiveResult) -> dict[str, Any]:
    """The ``adaptive_sp`` section of ``plan --json`` (raw units: seconds, bytes, tokens)."""
    single = result.single.estimate.time
    best = result.best
    return {
        "plan": None if best is None else result.plan.model_dump(),
        "best": None if best is None else _split_json(best),
        "single": {"layout": result.single.layout.as_dict(), "step_s": single.step_s,
                   "tokens_per_step": single.tokens_per_step, "tokens_per_s": single.tokens_per_s},
        "speedup": result.speedup,
        "best_multi_bucket": None if result.best_multi is None else _split_json(result.best_multi),
        "beats_single": result.beats_single,
        "pinned_options": result.pinned_options,
        "document_tokens_per_step": result.document_tokens_per_step,
        "candidates": [_split_json(c) for c in result.candidates],
        "unpriced": [{"bounds": list(bounds), "reason": reason} for bounds, reason in result.unpriced],
        "seconds": result.seconds,
    }


def plan_yaml(plan: AdaptiveSPPlan) -> str:
    """The plan as the YAML file the runtime reads (``--adaptive-out``)."""
    import yaml

    return yaml.safe_dump(plan.model_dump(), sort_keys=False)


__all__ = ["AdaptiveResult", "BucketDocs", "BucketPrice", "SplitPrice", "adaptive_json", "adaptive_lines",
           "adaptive_search", "bucket_shape", "candidate_bounds", "document_tokens_per_step", "plan_yaml",
           "price_split", "shared_options", "split_histogram"]
