"""Packing documents into training sequences of ``seq_len`` tokens, the way the runtime will.

The planner prices the packed sequences as they are: with document masking, a sequence's attention work
is the sum over its documents of ``L (L + 1) / 2`` causal pairs, so a row holding one 128K-token document
costs about 128x a row of 128 one-K documents. How documents are packed decides that spread (and the
padding), so packing is a planned option. The same functions pack the runtime's real documents
(:mod:`sp_plan.runtime.packed_data`), so the plan and the run agree on what a row holds.

Methods (``PACKINGS``):

- ``stream``: documents in data order are concatenated and cut every ``seq_len`` tokens (the GPT-style
  default of most trainers, and of :class:`sp_plan.runtime.text_data.PackedTextDataset`): no padding, but a
  document cut at a row end becomes two documents;
- ``first_fit``: documents in data order, each into the first row with room for it (a document longer
  than ``seq_len`` is cut into full rows and a remainder, which is then placed like any document): whole
  documents, some padding;
- ``sorted``: first-fit over the documents sorted longest first (first-fit decreasing): the least
  padding, and rows of similar documents (one long document per row, short ones together).

A row's ``multiple`` rounds every document's length up before it is placed: the per-document sharding
rule needs every document to be a multiple of 2 x ring tokens (:mod:`sp_plan.cost_models.data_balance`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal, NamedTuple

from sp_plan.cost_models.errors import CostModelError

Packing = Literal["stream", "first_fit", "sorted"]
PACKINGS: tuple[str, ...] = ("stream", "first_fit", "sorted")


class Piece(NamedTuple):
    """Tokens ``[start, start + length)`` of document ``doc`` (its index in the input) placed in a row;
    ``padded`` is the length it occupies (``length`` rounded up to the row's multiple)."""

    doc: int
    start: int
    length: int
    padded: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check(seq_len: int, multiple: int, method: str) -> None:
    if method not in PACKINGS:
        raise CostModelError(f"unknown packing {method!r}: choose one of {', '.join(PACKINGS)}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise CostModelError(f"seq_len must be a positive whole number of tokens, got {seq_len!r}")
    if multiple < 1 or seq_len % multiple:
        raise CostModelError(f"seq_len {seq_len} is not a multiple of the per-document multiple {multiple}: "
                             "round --seq-len to a multiple of 2 x ring")


def _cut(doc: int, length: int, seq_len: int, multiple: int) -> list[Piece]:
    """A document as pieces no longer than a row: full rows, then the remainder (rounded to ``multiple``)."""
    pieces = []
    start = 0
    while length - start > seq_len:
        pieces.append(Piece(doc, start, seq_len, seq_len))
        start += seq_len
    rest = length - start
    pieces.append(Piece(doc, start, rest, _round_up(rest, multiple)))
    return pieces


class _FirstFit:
    """First-fit over rows of equal capacity in O(log n) per placement: a segment tree of the rows' free
    space answers "the first row with at least ``size`` free"."""

    def __init__(self, capacity: int, rows: int) -> None:
        self.capacity = capacity
        self.size = 1
        while self.size < max(rows, 1):
            self.size *= 2
        self.free = [capacity] * (2 * self.size)
        self.used = 0  # rows opened so far (a prefix of the slots)

    def place(self, need: int) -> int:
        free, size = self.free, self.size
        if free[1] < need:
            raise CostModelError("internal: first-fit ran out of rows")
        node = 1
        while node < size:
            node *= 2
            if free[node] < need:
                node += 1
        row = node - size
        free[node] -= need
        while node > 1:
            node //= 2
            left, right = free[2 * node], free[2 * node + 1]
            best = left if left > right else right
            if free[node] == best:
                break  # the ancestors' maxima do not change
            free[node] = best
        self.used = max(self.used, row + 1)
        return row


def pack(lengths: Sequence[int], seq_len: int, method: str = "first_fit", *, multiple: int = 1,
         split_long: bool = True) -> list[list[Piece]]:
    """The rows ``method`` makes of documents of ``lengths`` tokens (in data order), each a list of pieces.

    ``split_long=False`` refuses a document longer than ``seq_len`` instead of cutting it (its later
    pieces would not see its earlier ones)."""
    _check(seq_len, multiple, method)
    longest = max(lengths, default=0)
    if not lengths or longest < 1:
        raise CostModelError("no documents to pack: the length distribution is empty")
    if not split_long and longest > seq_len:
        raise CostModelError(
            f"a document of {longest} tokens is longer than --seq-len {seq_len} and splitting is off: raise --seq-len "
            f"to at least {longest}, allow splitting, or drop documents longer than {seq_len} tokens")
    if method == "stream":
        return _stream(lengths, seq_len, multiple)
    pieces = [piece for doc, length in enumerate(lengths) for piece in _cut(doc, length, seq_len, multiple)]
    if method == "sorted":
        pieces.sort(key=lambda p: -p.padded)
    fit = _FirstFit(seq_len, len(pieces))
    rows: list[list[Piece]] = []
    for piece in pieces:
        row = fit.place(piece.padded)
        while len(rows) <= row:
            rows.append([])
        rows[row].append(piece)
    return rows


def _stream(lengths: Sequence[int], seq_len: int, multiple: int) -> list[list[Piece]]:
    rows: list[list[Piece]] = [[]]
    room = seq_len
    for doc, length in enumerate(lengths):
        start = 0
        while start < length:
            take = min(length - start, room)
            padded = min(_round_up(take, multiple), room)
            rows[-1].append(Piece(doc, start, take, padded))
            start += take
            room -= padded
            if room == 0:
                rows.append([])
                room = seq_len
    if not rows[-1]:
        rows.pop()
    return rows


# ----- the planner's sample ---------------------------------------------------------------------------


def sample_lengths(bins: Sequence[tuple[int, int]], max_tokens: int, max_documents: int = 1 << 14,
                   seed: int = 0) -> list[int]:
    """Document lengths in a shuffled data order, at most about ``max_tokens`` tokens and ``max_documents``
    documents of them, drawn from the histogram ``bins`` with counts scaled down (stochastic rounding with a
    fixed seed, so the long tail keeps its expected share instead of rounding to nothing). Deterministic for
    the same inputs."""
    total = sum(length * count for length, count in bins)
    documents = sum(count for _, count in bins)
    factor = min(1.0, max_tokens / total if total else 1.0, max_documents / documents if documents else 1.0)
    rng = random.Random(seed)
    out: list[int] = []
    for length, count in bins:
        kept = count * factor
        whole = math.floor(kept)
        if rng.random() < kept - whole:
            whole += 1
        out.extend([length] * whole)
    if not out:  # a histogram of documents each far above the budget: keep the most common one
        out = [max(bins, key=lambda item: item[1])[0]]
    rng.shuffle(out)
    return out
