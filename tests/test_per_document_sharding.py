"""Per-document ("head-tail") ring sharding of packed rows (issue 32 item 4): every document in 2 x ring chunks,
ring rank r holding chunks r and 2R-1-r of each, exact against one process on rows packed from a long-tailed
length distribution (documents shorter than the chunk count, a 1-token document, a document longer than the row
that the packer split), with and without Ulysses, forward and backward, fp64 and fp32, GQA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sp_plan.cost_models.data_balance import rank_pairs
from sp_plan.cost_models.packing import pack
from sp_plan.runtime.attention.documents import row_bounds
from sp_plan.runtime.attention.ring import per_document_pairs
from sp_plan.runtime.context import per_document_segments
from tests.attention_checks import NAMES, combine, full_inputs, stats
from tests.distributed import run_ranks
from tests.test_attention_documents import document_reference

SEQ = 96  # a multiple of 2 x ring x ulysses for ring 2 and 4 and 2 x 2
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
CASES = [(torch.float64, True, 4, 2), (torch.float32, True, 4, 4), (torch.float64, False, 4, 1)]


def long_tailed_rows(ring: int, seed: int = 5, rows: int = 2) -> list[list[int]]:
    """Padded document lengths per row (multiples of 2 x ring), packed first-fit from lognormal lengths plus
    a 1-token document and one longer than the row."""
    rng = np.random.default_rng(seed)
    lengths = [1, 150, *np.clip(np.exp(rng.normal(2.5, 1.0, 12)), 1, 80).astype(int).tolist()]
    packed = pack(lengths, SEQ, "first_fit", multiple=2 * ring)[:rows]
    out = []
    for row in packed:
        docs = [p.padded for p in row]
        if sum(docs) < SEQ:
            docs.append(SEQ - sum(docs))  # the row's end padding, a document of its own
        out.append(docs)
    return out


def cu_from(rows: list[list[int]]) -> torch.Tensor:
    points = [0]
    for docs in rows:
        for length in docs:
            points.append(points[-1] + length)
    return torch.tensor(points, dtype=torch.int32)


def test_shard_function_covers_every_position_once_with_equal_counts():
    for ring, ulysses in ((2, 1), (4, 1), (2, 2)):
        for docs in long_tailed_rows(ring):
            bounds = tuple(np.cumsum([0, *docs]).tolist())
            seen = []
            for r in range(ring):
                for u in range(ulysses):
                    runs = per_document_segments(bounds, ring, r, ulysses, u)
                    assert sum(n for _, n in runs) == SEQ // (ring * ulysses)
                    seen += [p for start, n in runs for p in range(start, start + n)]
            assert sorted(seen) == list(range(SEQ))


def test_per_document_pairs_balance_causal_work_where_zigzag_does_not():
    """The runtime's sub-blocks count the pairs the planner prices, and every rank does the same work."""
    ring = 4
    docs = [8, 8, 64, 16]  # one long document in the middle of the row
    bounds = (tuple(np.cumsum([0, *docs]).tolist()),)
    work = []
    for rank in range(ring):
        total = 0
        for source in range(ring):
            for p in per_document_pairs(bounds, rank, source, ring, causal=True):
                n_q, n_k = p.q_hi - p.q_lo, p.k_hi - p.k_lo
                total += n_q * (n_q + 1) // 2 if p.causal else n_q * n_k
        work.append(total)
    assert work == pytest.approx(rank_pairs(tuple(docs), SEQ, ring, "per_document").tolist())
    assert max(work) == min(work)
    zigzag = rank_pairs(tuple(docs), SEQ, ring, "zigzag")
    assert zigzag.max() / zigzag.mean() > 1.2


def _rank(rank: int, world: int, ring: int, ulysses: int) -> list:
    from tests.attention_checks import sp_context

    sp = sp_context(world, ring=ring, ulysses=ulysses)
    sp.sharding = "per_document"
    rows = long_tailed_rows(ring)
    cu = cu_from(rows)
    documents = row_bounds(cu, len(rows), SEQ)
    results = []
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        q, k, v, dout = full_inputs(40 + i, len(rows), SEQ, heads, kv_heads, 8, dtype)
        expected = document_reference(q, k, v, dout, cu, causal)
        leaves = [sp.shard(x, 1, documents).clone().requires_grad_() for x in (q, k, v)]
        out = sp.attention(*leaves, causal=causal, cu_seqlens=cu)
        out.backward(sp.shard(dout, 1, documents))
        mine = [sp.shard(e, 1, documents) for e in expected]
        actual = (out.detach(), *(x.grad for x in leaves))
        entry = dict(zip(NAMES, map(stats, actual, mine)))
        gathered = sp.gather(out.detach(), 1, documents)
        entry["gather"] = float((gathered.double() - expected[0]).abs().max())
        results.append(entry)
    return results


@pytest.mark.multiproc
@pytest.mark.parametrize("world,ring,ulysses", [(2, 2, 1), (4, 4, 1), (4, 2, 2)], ids=["ring2", "ring4", "usp2x2"])
def test_per_document_ring_attention_is_exact(world, ring, ulysses):
    per_rank = run_ranks(world, _rank, ring, ulysses, timeout=120)
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        errors = combine([{n: r[i][n] for n in NAMES} for r in per_rank])
        for tensor, (max_rel, _) in errors.items():
            assert max_rel <= TOL[dtype], (world, ring, ulysses, dtype, causal, heads, kv_heads, tensor, max_rel)
        assert max(r[i]["gather"] for r in per_rank) <= 1e-4


def _sharder_rank(rank: int, world: int) -> dict:
    from sp_plan.runtime.data import IGNORE_INDEX, BatchSharder
    from tests.attention_checks import sp_context

    sp = sp_context(world, ring=world, ulysses=1)
    sp.sharding = "per_document"
    # two rows of unpadded documents marked HF-style by restarting positions (lengths 1, 5, 17 and 23)
    lengths = [[1, 5, 17], [23]]
    ids = torch.arange(1, 24).reshape(1, 23).repeat(2, 1)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    sharder = BatchSharder(sp, pad_token_id=0)
    full = sharder.prepare({"input_ids": ids, "position_ids": positions})
    local = sharder.shard(full)
    documents = row_bounds(full["cu_seqlens"], *full["input_ids"].shape)
    back = sp.gather(local["input_ids"].unsqueeze(-1).double(), 1, documents).squeeze(-1).long()
    docs = [[b - a for a, b in zip(row, row[1:])] for row in documents]
    real = full["input_ids"][full["labels"] != IGNORE_INDEX]
    return {"same": bool(torch.equal(back, full["input_ids"])), "docs": docs, "local": local["input_ids"].shape[1],
            "width": full["input_ids"].shape[1], "real_labels": int((full["labels"] != IGNORE_INDEX).sum()),
            "first_ids": full["input_ids"][0, :8].tolist(), "pos": full["position_ids"][0, :8].tolist(),
            "ignored_real": int(real.numel())}


@pytest.mark.multiproc
def test_batch_sharder_pads_each_document_and_gathers_back():
    out = run_ranks(2, _sharder_rank, timeout=120)
    for r in out:
        assert r["same"]
        assert all(length % 4 == 0 for row in r["docs"] for length in row)
        assert r["local"] * 2 == r["width"]
    first = out[0]
    # row 0: [1 | pad x3], [2..6 | pad x3], ...: pads carry the token 0 and continue their document's positions
    assert first["first_ids"][:4] == [1, 0, 0, 0] and first["pos"][:4] == [0, 1, 2, 3]
    assert first["first_ids"][4:8] == [2, 3, 4, 5] and first["pos"][4:8] == [0, 1, 2, 3]
    # labels: each document predicts its own next tokens only (4 + 16 + 22 = 42 targets in the batch)
    assert first["real_labels"] == (0 + 4 + 16) + 22
