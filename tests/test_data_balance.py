"""Packing and per-rank balance of a long-tailed dataset (issue 32 items 2 and 3), against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_plan.cost_models.data_balance import DataShape, expected_max_normal, rank_pairs
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.packing import PACKINGS, pack, sample_lengths


def brute_rank_pairs(docs: list[int], seq_len: int, ring: int, rule: str) -> list[float]:
    """Each position's owner by the rule's definition, each query's visible keys counted one by one."""
    owner = [0] * seq_len
    doc_start = [None] * seq_len  # None: row padding (not priced)
    pos = 0
    chunks = 2 * ring
    for length in docs:
        for i in range(length):
            doc_start[pos + i] = pos
            if rule == "per_document":
                chunk = i // (length // chunks)
                owner[pos + i] = chunk if chunk < ring else chunks - 1 - chunk
        pos += length
    for p in range(seq_len):
        if rule == "contiguous":
            owner[p] = p // (seq_len // ring)
        elif rule == "zigzag":
            chunk = p // (seq_len // chunks)
            owner[p] = chunk if chunk < ring else chunks - 1 - chunk
    work = [0.0] * ring
    for p in range(seq_len):
        if doc_start[p] is not None:
            work[owner[p]] += p - doc_start[p] + 1
    return work


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.sampled_from([1, 2, 4]),
       st.sampled_from(["contiguous", "zigzag", "per_document"]))
def test_rank_pairs_equal_brute_force(raw, ring, rule):
    multiple = 2 * ring if rule == "per_document" else 1
    docs = [-(-d // multiple) * multiple for d in raw]
    seq_len = -(-sum(docs) // (2 * ring)) * (2 * ring) + 2 * ring  # room for some row padding
    got = rank_pairs(tuple(docs), seq_len, ring, rule)
    assert got == pytest.approx(brute_rank_pairs(docs, seq_len, ring, rule))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=60), st.sampled_from([64, 128, 256]),
       st.sampled_from(PACKINGS), st.sampled_from([1, 2, 8]))
def test_packing_keeps_every_token_and_fits_rows(lengths, seq_len, method, multiple):
    rows = pack(lengths, seq_len, method, multiple=multiple)
    seen: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        assert sum(p.padded for p in row) <= seq_len
        for p in row:
            assert p.length <= p.padded < p.length + multiple
            seen.setdefault(p.doc, []).append((p.start, p.length))
    for doc, length in enumerate(lengths):
        pieces = sorted(seen[doc])
        assert pieces[0][0] == 0 and sum(n for _, n in pieces) == length
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    if method != "stream":  # whole documents unless longer than a row
        assert all(len(seen[d]) == 1 for d, n in enumerate(lengths) if n <= seq_len)


def test_sorted_packing_wastes_no_more_than_first_fit():
    rng = np.random.default_rng(3)
    lengths = np.clip(np.exp(rng.normal(5, 1.2, 3000)), 1, 4000).astype(int).tolist()
    assert len(pack(lengths, 4096, "sorted")) <= len(pack(lengths, 4096, "first_fit"))


def test_long_documents_split_or_refused_with_advice():
    rows = pack([10, 300, 5], 128, "first_fit")
    assert sum(p.length for r in rows for p in r) == 315
    with pytest.raises(CostModelError, match="longer than --seq-len 128.*raise --seq-len to at least 300"):
        pack([10, 300], 128, "first_fit", split_long=False)


def long_tail_bins(seed: int = 1, n: int = 60_000) -> tuple[tuple[int, int], ...]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(np.exp(rng.normal(7, 1.6, n))), 1, 1 << 20).astype(int)
    values, counts = np.unique(lengths, return_counts=True)
    return tuple(zip(values.tolist(), counts.tolist()))


def test_per_document_is_balanced_where_zigzag_is_not():
    shape = DataShape(bins=long_tail_bins(), packing="stream")
    for ring in (2, 4, 8):
        zigzag = shape.balance(131072, ring, "zigzag")
        per_doc = shape.balance(131072, ring, "per_document")
        contiguous = shape.balance(131072, ring, "contiguous")
        assert per_doc.ring_imbalance == pytest.approx(1.0, abs=1e-9)
        assert zigzag.ring_imbalance > 1.2 and contiguous.ring_imbalance > zigzag.ring_imbalance
        assert per_doc.padding_fraction >= zigzag.padding_fraction  # documents rounded to 2R


def test_one_document_per_row_is_balanced_by_zigzag():
    shape = DataShape(bins=((8192, 1000),), packing="first_fit")
    assert shape.equivalent_document_length(8192) is None
    balance = shape.balance(8192, 4, "zigzag", dp=16)
    assert balance.factor == pytest.approx(1.0) and balance.ring_imbalance == pytest.approx(1.0)


def test_equivalent_length_matches_the_histogram():
    bins = tuple((length, count) for length, count in long_tail_bins() if length < 2000)
    exact = sum(c * length * (length + 1) for length, c in bins) / sum(c * length for length, c in bins) - 1
    shape = DataShape(bins=bins, packing="first_fit")
    assert shape.equivalent_document_length(131072) == pytest.approx(exact, rel=0.03)


def test_data_parallel_straggling_grows_with_dp_and_shrinks_with_accumulation():
    shape = DataShape(bins=long_tail_bins(), sharding="per_document")
    one = shape.balance(131072, 2, "per_document", dp=1)
    many = shape.balance(131072, 2, "per_document", dp=64)
    accumulated = shape.balance(131072, 2, "per_document", dp=64, grad_accum=16)
    assert one.dp_imbalance == pytest.approx(1.0)
    assert many.dp_imbalance > accumulated.dp_imbalance > 1.0
    assert expected_max_normal(2) == pytest.approx(0.5642, abs=0.03)  # E[max of 2 normals] = 1/sqrt(pi)


def test_sample_keeps_the_tail_and_is_deterministic():
    bins = ((100, 10**7), (1 << 20, 3))
    first, again = sample_lengths(bins, 1 << 24), sample_lengths(bins, 1 << 24)
    assert first == again
    assert sum(1 for n in first if n == 1 << 20) <= 3
    many = [sample_lengths(bins, 1 << 24, seed=s).count(1 << 20) for s in range(200)]
    expected = 3 * min(1.0, (1 << 24) / (100 * 10**7 + 3 * (1 << 20)), (1 << 14) / (10**7 + 3))
    assert np.mean(many) == pytest.approx(expected, rel=0.6, abs=0.01)


def test_ring_prices_documents_longer_than_its_chunks_by_their_pairs():
    """Documents of at least 2 x the ring chunk once priced as full causal attention (a 1.66x jump at ring 2
    when the equivalent length crossed seq/ring): the attention time now grows with the document length,
    continuously, up to the full causal pass at one document per row."""
    from sp_plan.cost_models import get_model_preset
    from sp_plan.cost_models.estimate import estimate
    from sp_plan.cost_models.layout import Layout
    from sp_plan.cost_models.topology import load_topology
    from sp_plan.cost_models.train_spec import TrainSpec

    model, topology, s = get_model_preset("llama3-8b"), load_topology("dgx-h100", 8), 131072
    layout = Layout.for_world(8, ring=2, ulysses=4)

    def attention(doc):
        est = estimate(model, TrainSpec(seq_len=s, document_length=doc, checkpointing="full"), layout, topology)
        return est.time.components["attention_forward"] + est.time.components["attention_backward"]

    docs = [16384, 65535, 65536, 65537, 98304, 131071]
    times = [attention(d) for d in docs]
    assert times == sorted(times)
    assert times[2] / times[1] < 1.001 and times[3] / times[2] < 1.001  # no jump at seq / ring = 64K
    assert attention(131071) == pytest.approx(attention(None), rel=1e-4)
    # Between 2c and s the extra work is linear in the length: the midpoint sits halfway.
    assert times[4] == pytest.approx((times[2] + times[5]) / 2, rel=0.01)
