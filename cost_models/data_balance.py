"""What a dataset's length distribution does to a step: attention work per packed row, its balance over the
ring ranks for each sharding rule, and the straggling of data-parallel ranks that drew heavy rows.

With document masking a row's attention work is the sum of ``L (L + 1) / 2`` causal pairs over its documents.
The time model prices one row's attention as documents of one *equivalent* length (the length whose uniform
rows have the sample's mean pairs per row, :attr:`DataShape.equivalent_document_length`) and this module says
how much longer the busiest rank takes than that mean:

- **ring balance.** Each sharding rule gives every ring rank a set of positions: ``contiguous`` (rank r the
  r-th 1/R of the row), ``zigzag`` (chunks r and 2R-1-r of the row's 2R chunks: balanced for one document per
  row), ``per_document`` (chunks r and 2R-1-r of *every document*, Megatron-Core's THD split: balanced for any
  packing, at the price of rounding each document up to a multiple of 2R tokens). A rank's work is the
  document-masked causal pairs of its queries; a micro-batch waits for its busiest rank.
- **data-parallel balance.** Each data-parallel rank runs ``grad_accum`` micro-batches of its own rows, and the
  gradient reduction waits for the slowest. Rows drawn from a long-tailed set differ in work, so the expected
  slowest of ``dp`` ranks is above the mean: ``mean + sd x sqrt(grad_accum) x z(dp)``, with ``z`` the
  expected maximum of ``dp`` standard normals (Blom's approximation), ``mean``/``sd`` those of one
  micro-batch's busiest-rank work over the packed sample.

The factor the time model multiplies attention by is the expected slowest rank's work over the equivalent
mean's. Padding (unfilled rows, documents rounded up for ``per_document``) lowers the useful tokens per step
(:attr:`Balance.padding_fraction`).
"""

from __future__ import annotations

import functools
from statistics import NormalDist
from typing import Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .errors import CostModelError
from .memo import hash_once
from .packing import pack, sample_lengths

Sharding = Literal["contiguous", "zigzag", "per_document"]
SHARDINGS: tuple[str, ...] = ("contiguous", "zigzag", "per_document")
#: The rules the runtime's SequenceParallel runs (and so the ones the planner may choose).
RUNTIME_SHARDINGS: tuple[str, ...] = ("zigzag", "per_document")
#: Tokens of the planner's packed sample: enough rows for stable means and tails, small enough to pack in
#: well under a second.
SAMPLE_TOKENS = 1 << 27
MAX_SAMPLE_ROWS = 4096


class DataShape(BaseModel):
    """The training data's length distribution and how it is packed (a TrainSpec field: ``--lengths``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``(length, count)`` bins of the dataset's documents (:class:`sp_plan.cost_models.lengths.LengthHistogram`).
    bins: tuple[tuple[int, int], ...] = Field(min_length=1, max_length=100_000)
    #: How documents become rows (:mod:`sp_plan.cost_models.packing`); ``auto``: the planner's search tries each of
    #: :func:`auto_packings` with every layout and keeps the fastest (an ``auto`` shape is never priced itself).
    packing: Literal["auto", "stream", "first_fit", "sorted"] = "first_fit"
    #: True when ``packing`` was chosen by the search from ``auto`` (``--packing`` not given): reports say so.
    packing_auto: bool = False
    #: Sharding rule over the ring ranks; ``auto``: the one with the least work per useful token at each ring degree.
    sharding: Literal["auto", "contiguous", "zigzag", "per_document"] = "auto"
    #: Where the distribution comes from (shown in reports).
    source: str = ""

    __slots__ = ("_hash",)
    __hash__ = hash_once

    def rows(self, seq_len: int, multiple: int = 1) -> tuple[tuple[int, ...], ...]:
        """The packed sample: per row, the lengths its documents occupy (padded); the rest of a row is padding,
    which attends to nothing the planner prices (its labels are ignored)."""
        return _packed(self, seq_len, multiple).rows

    def equivalent_document_length(self, seq_len: int) -> int | None:
        """The document length whose uniform rows have the sample's mean causal pairs per row (None: one
        document per row, the time model's full causal attention)."""
        return _equivalent_length(self, seq_len)

    def balance(self, seq_len: int, ring: int, rule: str, dp: int = 1, grad_accum: int = 1,
                micro_batch: int = 1) -> "Balance":
        return _balance(self, seq_len, ring, rule, dp, grad_accum, micro_batch)

    def chosen(self, seq_len: int, ring: int, dp: int = 1, grad_accum: int = 1, micro_batch: int = 1,
               attention_share: float = 0.5) -> "Balance":
        """The balance of the configured rule, or under ``auto`` the runtime rule with the least expected
        busiest-rank work per useful token: ``(1 - a + a x factor) / (1 - padding)`` for attention share ``a``."""
        if self.sharding != "auto":
            return self.balance(seq_len, ring, self.sharding, dp, grad_accum, micro_batch)
        if ring == 1:
            return self.balance(seq_len, 1, "zigzag", dp, grad_accum, micro_batch)
        options = [self.balance(seq_len, ring, rule, dp, grad_accum, micro_batch) for rule in self.auto_rules(ring)]
        return min(options, key=lambda b: (1 - attention_share + attention_share * b.factor) / (1 - b.padding_fraction))


    def auto_rules(self, ring: int) -> tuple[str, ...]:
        """The rules ``auto`` sharding chooses from at ``ring``: the runtime's, except that stream rows the search
        chose (``packing_auto``) are split zigzag only. The runtime runs stream rows under per-document sharding by
        padding every document inside the row, which makes the row longer than ``seq_len`` (not what was priced);
        whole-document packings round their pieces while packing (:func:`sp_plan.cost_models.packing.pack`)."""
        if self.packing == "stream" and self.packing_auto and ring > 1:
            return ("zigzag",)
        return RUNTIME_SHARDINGS

    def runs_at(self, ring: int) -> bool:
        """Whether the runtime trains these rows at ``ring`` as they are priced (see :meth:`auto_rules`): False
        only for search-chosen stream rows under a pinned rule other than zigzag."""
        return not (self.packing == "stream" and self.packing_auto and ring > 1
                    and self.sharding not in ("auto", "zigzag"))


#: What ``packing: auto`` tries (:func:`auto_packings`), in this order (a tie keeps the earlier one): the
#: whole-document packings. Stream is not among them: it cuts documents at row ends, and the causal pairs that
#: saves are context the model no longer sees (a different training set, not a faster plan of the same one), so
#: the user pins ``--packing stream`` to choose it; the search prices it then (under :meth:`DataShape.runs_at`).
AUTO_PACKINGS: tuple[str, ...] = ("first_fit", "sorted")


def auto_packings(shape: DataShape) -> tuple[DataShape, ...]:
    """The concrete shapes the search tries for ``shape``: itself when its packing is pinned, else one per
    :data:`AUTO_PACKINGS` marked ``packing_auto``."""
    if shape.packing != "auto":
        return (shape,)
    return tuple(shape.model_copy(update={"packing": packing, "packing_auto": True}) for packing in AUTO_PACKINGS)


class Balance(BaseModel):
    """One sharding rule's balance at one layout (what ``--explain`` reports)."""

    model_config = ConfigDict(frozen=True)

    rule: str
    ring: int
    #: Expected busiest-rank work over the equivalent mean (>= about 1): what attention time is multiplied by.
    factor: float
    #: Busiest ring rank's pairs over the mean rank's, averaged over rows.
    ring_imbalance: float
    #: Expected slowest data-parallel rank over the mean one (rows of different work).
    dp_imbalance: float
    #: Share of the row tokens that are padding (unfilled rows, documents rounded up).
    padding_fraction: float
    #: Causal pairs per row over the sample: mean, p95, max.
    pairs_mean: float
    pairs_p95: float
    pairs_max: float
    rows: int


def _check_rule(rule: str, seq_len: int, ring: int) -> int:
    if rule not in SHARDINGS:
        raise CostModelError(f"unknown sharding rule {rule!r}: choose one of {', '.join(SHARDINGS)}")
    chunks = 2 * ring if ring > 1 and rule != "contiguous" else ring
    if seq_len % chunks:
        raise CostModelError(f"seq_len {seq_len} is not a multiple of {chunks} ({rule} over ring {ring})")
    return chunks


class _Packed(NamedTuple):
    rows: tuple[tuple[int, ...], ...]  # per row: the lengths its documents occupy (padded, in row order)
    real_tokens: int  # document tokens in those rows (no padding)


@functools.lru_cache(maxsize=64)
def _packed(shape: DataShape, seq_len: int, multiple: int) -> _Packed:
    if shape.packing == "auto":
        raise CostModelError("packing 'auto' is chosen by the planner's search (plan, capacity, estimate): pin "
                             "--packing stream, first_fit or sorted to price these rows directly")
    lengths = _sample(shape.bins, min(SAMPLE_TOKENS, MAX_SAMPLE_ROWS * seq_len))
    rows = pack(lengths, seq_len, shape.packing, multiple=multiple)
    if len(rows) > 1 and sum(piece.padded for piece in rows[-1]) < seq_len:
        rows = rows[:-1]  # the sample's last, partly filled row: an artefact of its end, not of the data
    rows = rows[:MAX_SAMPLE_ROWS]
    real = sum(piece.length for row in rows for piece in row)
    return _Packed(tuple(tuple(piece.padded for piece in row) for row in rows), real)


@functools.lru_cache(maxsize=16)
def _sample(bins: tuple[tuple[int, int], ...], budget: int) -> tuple[int, ...]:
    """The sampled document lengths, shared by every packing and multiple of the same histogram and budget."""
    return tuple(sample_lengths(bins, budget))


def _multiple(rule: str, ring: int) -> int:
    return 2 * ring if rule == "per_document" and ring > 1 else 1


@functools.lru_cache(maxsize=256)
def _equivalent_length(shape: DataShape, seq_len: int) -> int | None:
    pairs = _mean_row_pairs(shape, seq_len)
    if pairs <= 0:
        return None
    length = round(2 * pairs / seq_len - 1)
    return None if length >= seq_len else max(1, length)


@functools.lru_cache(maxsize=256)
def _mean_row_pairs(shape: DataShape, seq_len: int) -> float:
    return float(np.mean(_row_pairs(shape.rows(seq_len))))


def _pairs(length: np.ndarray) -> np.ndarray:
    return length * (length + 1) / 2


def _row_pairs(rows: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Causal pairs per row (one flat pass: rows hold thousands of short documents)."""
    flat = np.fromiter((length for row in rows for length in row), dtype=np.float64)
    row_of = np.repeat(np.arange(len(rows)), [len(row) for row in rows])
    return np.bincount(row_of, weights=_pairs(flat), minlength=len(rows))


def _prefix_pairs(starts: np.ndarray, cum_pairs: np.ndarray, weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Causal pairs of the queries at positions ``< x`` under the row's document mask (``weight`` 0 for the
    row's padding, which the planner does not price)."""
    doc = np.searchsorted(starts, x, side="right") - 1
    inside = x - starts[doc]
    return cum_pairs[doc] + weight[doc] * inside * (inside + 1) / 2


def rank_pairs(row: tuple[int, ...], seq_len: int, ring: int, rule: str) -> np.ndarray:
    """Causal pairs of each ring rank's queries for one row of ``seq_len`` tokens holding documents of the
    given lengths in order (the rest of the row is padding)."""
    chunks = _check_rule(rule, seq_len, ring)
    lengths = np.asarray(row, dtype=np.float64)
    if ring == 1:
        return np.array([float(_pairs(lengths).sum())])
    if rule == "per_document":
        # every document in 2R chunks; rank r takes chunks r and 2R-1-r of each
        c = lengths / chunks  # chunk length per document
        r = np.arange(ring, dtype=np.float64)[:, None]
        mine = lambda j: c * (j * c) + c * (c + 1) / 2  # noqa: E731 - pairs of chunk j of each document
        return (mine(r) + mine(chunks - 1 - r)).sum(axis=1)
    tail = seq_len - float(lengths.sum())
    weight = np.ones(len(lengths) + 1)
    weight[-1] = 0.0
    lengths = np.append(lengths, tail)
    starts = np.concatenate([[0.0], np.cumsum(lengths)[:-1]])
    cum_pairs = np.concatenate([[0.0], np.cumsum(weight * _pairs(lengths))[:-1]])
    edges = np.arange(chunks + 1, dtype=np.float64) * (seq_len / chunks)
    per_chunk = np.diff(_prefix_pairs(starts, cum_pairs, weight, edges))
    if rule == "contiguous":
        return per_chunk
    return per_chunk[:ring] + per_chunk[::-1][:ring]


@functools.lru_cache(maxsize=4096)
def _rank_matrix(shape: DataShape, seq_len: int, ring: int, rule: str) -> np.ndarray:
    """:func:`rank_pairs` of every row of the packed sample, ``(rows, ring)``, in one flat pass over all rows' documents
    (every term is a whole number of pairs below 2^53, so the sums equal the per-row ones exactly)."""
    chunks = _check_rule(rule, seq_len, ring)
    rows = shape.rows(seq_len, _multiple(rule, ring))
    n = len(rows)
    counts = np.fromiter((len(row) for row in rows), dtype=np.int64, count=n)
    flat = np.fromiter((length for row in rows for length in row), dtype=np.float64, count=int(counts.sum()))
    row_of = np.repeat(np.arange(n), counts)
    if ring == 1:
        return np.bincount(row_of, weights=_pairs(flat), minlength=n)[:, None]
    if rule == "per_document":
        # chunks r and 2R-1-r of a document of c-token chunks: c^2 (2R - 1) + c (c + 1) pairs, the same for every r
        c = flat / chunks
        per_row = np.bincount(row_of, weights=c * c * (chunks - 1) + c * (c + 1), minlength=n)
        return np.repeat(per_row[:, None], ring, axis=1)
    # every row's documents then its padding tail (weight 0), rows end to end: row i spans [i seq_len, (i+1) seq_len)
    ends = np.cumsum(counts + 1)
    lengths = np.empty(int(ends[-1]) if n else 0)
    weight = np.ones_like(lengths)
    lengths[np.arange(len(flat)) + row_of] = flat
    lengths[ends - 1] = seq_len - np.bincount(row_of, weights=flat, minlength=n)
    weight[ends - 1] = 0.0
    starts = np.concatenate([[0.0], np.cumsum(lengths)[:-1]])
    cum_pairs = np.concatenate([[0.0], np.cumsum(weight * _pairs(lengths))[:-1]])
    edges = np.arange(n)[:, None] * float(seq_len) + np.arange(chunks + 1)[None, :] * float(seq_len // chunks)
    per_chunk = np.diff(_prefix_pairs(starts, cum_pairs, weight, edges.ravel()).reshape(n, chunks + 1), axis=1)
    if rule == "contiguous":
        return per_chunk
    return per_chunk[:, :ring] + per_chunk[:, ::-1][:, :ring]


def expected_max_normal(n: int) -> float:
    """E[max of n standard normals], Blom's approximation (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@functools.lru_cache(maxsize=4096)
def _balance(shape: DataShape, seq_len: int, ring: int, rule: str, dp: int, grad_accum: int,
             micro_batch: int) -> Balance:
    _check_rule(rule, seq_len, ring)
    matrix = _rank_matrix(shape, seq_len, ring, rule)  # (rows, ring)
    mean_pairs = _mean_row_pairs(shape, seq_len)  # what the equivalent document length prices
    rows = matrix.shape[0]
    # a micro-batch of b rows: each rank's work sums over its b rows, the busiest rank sets the time
    if micro_batch == 1:
        busiest = matrix.max(axis=1)
    else:
        rng = np.random.default_rng(0)
        draws = rng.integers(0, rows, size=(max(rows, 256), micro_batch))
        busiest = matrix[draws].sum(axis=1).max(axis=1)
    mean_busiest, sd_busiest = float(busiest.mean()), float(busiest.std())
    slowest = grad_accum * mean_busiest + sd_busiest * grad_accum ** 0.5 * expected_max_normal(dp)
    reference = grad_accum * micro_batch * mean_pairs / ring
    ring_means = matrix.mean(axis=1)
    ring_imbalance = float(np.mean(matrix.max(axis=1) / np.where(ring_means > 0, ring_means, 1.0)))
    packed = _packed(shape, seq_len, _multiple(rule, ring))
    padding = 1.0 - packed.real_tokens / (len(packed.rows) * seq_len)
    totals = matrix.sum(axis=1)
    return Balance(
        # never below 1: the mean-equivalent price is a lower bound the search's floors rely on
        rule=rule, ring=ring, factor=max(1.0, slowest / reference) if reference else 1.0, ring_imbalance=ring_imbalance,
        dp_imbalance=slowest / (grad_accum * mean_busiest) if mean_busiest else 1.0, padding_fraction=padding,
        pairs_mean=float(totals.mean()), pairs_p95=float(np.percentile(totals, 95)), pairs_max=float(totals.max()),
        rows=rows,
    )


# ----- what the time model reads ------------------------------------------------------------------------


def attention_share(model, train) -> float:
    """Attention's share of a row's forward FLOPs at the data's equivalent document length: the weight the
    ``auto`` rule gives attention balance against padding."""
    doc = train.attention_document_length or train.seq_len
    attention = 4 * model.head_dim * model.num_heads * model.num_layers * train.seq_len * (doc + 1) / 2
    linear = 2 * model.active_params * train.seq_len
    return attention / (attention + linear)


def layout_balance(model, train, layout) -> Balance | None:
    """The data's balance at this layout (None without ``--lengths``): the configured sharding rule, or the
    ``auto`` choice, at the layout's ring, data-parallel degree, micro-batch and accumulation."""
    data = train.data
    if data is None:
        return None
    return data.chosen(train.seq_len, layout.ring, layout.dp, train.grad_accum, train.micro_batch,
                       attention_share(model, train))


def attention_factor(model, train, layout) -> float:
    """What one micro-batch's attention seconds are multiplied by: the expected slowest rank's work over the
    equivalent-length mean (1 without ``--lengths``)."""
    balance = layout_balance(model, train, layout)
    return 1.0 if balance is None else balance.factor


def useful_fraction(model, train, layout) -> float:
    """Share of the row tokens that are the data's (1 - padding; 1 without ``--lengths``)."""
    balance = layout_balance(model, train, layout)
    return 1.0 if balance is None else 1.0 - balance.padding_fraction
