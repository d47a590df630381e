"""Per-document ("head-tail") ring sharding of packed rows (issue 32 item 4): every document in 2 x ring chunks,
ring rank r holding chunks r and 2R-1-r of each, exact against one process on rows packed from a long-tailed
length distribution (documents shorter than the chunk count, a 1-token document, a document longer than the row
that the packer split), with and without Ulysses, forward and backward, fp64 and fp32, GQA and MQA.

One spawn per topology (ring 2, ring 4, USP 2 x 2) runs every multi-rank case; the tests read its results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sp_plan.cost_models.data_balance import rank_pairs
from sp_plan.cost_models.packing import pack
from sp_plan.runtime.attention.documents import block_pairs, row_bounds, take
from sp_plan.runtime.attention.ring import block_plan, per_document_pairs, ring_runs
from sp_plan.runtime.context import SequenceParallel, per_document_segments
from sp_plan.runtime.data import IGNORE_INDEX, pad_documents
from sp_plan.runtime.errors import RuntimeConfigError
from tests.attention_checks import NAMES, combine, full_inputs, stats
from tests.distributed import run_ranks
from tests.test_attention_documents import document_reference

SEQ = 96  # a multiple of 2 x ring x ulysses for ring 2 and 4 and 2 x 2
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
#: (dtype, causal, query heads, KV heads) of the cases on already padded rows
CASES = [(torch.float64, True, 4, 2), (torch.float32, True, 4, 4), (torch.float64, False, 4, 1)]
#: the cases run end to end through BatchSharder (raw, unpadded documents)
E2E_CASES = [(torch.float64, 4, 2), (torch.float32, 2, 1)]
RAW_SEQ = 80  # raw packed row length (before the per-document padding)
TOPOLOGIES = {"ring2": (2, 2, 1), "ring4": (4, 4, 1), "usp2x2": (4, 2, 2)}


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


def raw_documents(seed: int = 11) -> list[int]:
    """Unpadded document lengths in data order: a document longer than the row first (the packer splits it),
    then a 1-token one, ones shorter than 2 x ring, and a lognormal tail."""
    rng = np.random.default_rng(seed)
    tail = np.clip(np.exp(rng.normal(2.3, 1.1, 10)), 1, 70).astype(int).tolist()
    return [130, 1, 3, 2, 7, *tail]


def cu_from(rows: list[list[int]]) -> torch.Tensor:
    points = [0]
    for docs in rows:
        for length in docs:
            points.append(points[-1] + length)
    return torch.tensor(points, dtype=torch.int32)


# ----- pure functions -----------------------------------------------------------------------------------


def test_shard_function_covers_every_position_once_with_equal_counts():
    for ring, ulysses in ((2, 1), (4, 1), (2, 2)):
        for docs in long_tailed_rows(ring):
            bounds = tuple(np.cumsum([0, *docs]).tolist())
            seen = []
            for r in range(ring):
                for u in range(ulysses):
                    runs = per_document_segments(bounds, ring, r, ulysses, u)
                    assert sum(n for _, n in runs) == SEQ // (ring * ulysses)
                    assert all(a + n <= b for (a, n), (b, _) in zip(runs, runs[1:]))  # increasing local order
                    seen += [p for start, n in runs for p in range(start, start + n)]
            assert sorted(seen) == list(range(SEQ))


def _pair_work(pairs) -> int:
    total = 0
    for p in pairs:
        n_q, n_k = p.q_hi - p.q_lo, p.k_hi - p.k_lo
        total += n_q * (n_q + 1) // 2 if p.causal else n_q * n_k
    return total


def _zigzag_work(bounds, rank: int, ring: int, seq: int) -> int:
    """Causal document-masked pairs ring ``rank`` computes under zigzag over the whole row (the ring's own plan)."""
    local = seq // ring
    mine, total = ring_runs("zigzag", rank, ring, local), 0
    for step in range(ring):
        plan = block_plan(step, rank, ring, True, local, "zigzag")
        theirs = ring_runs("zigzag", (rank - step) % ring, ring, local)
        q_runs = take(mine, *plan.q_rows.indices(local)[:2])
        k_runs = take(theirs, *plan.kv_rows.indices(local)[:2])
        total += _pair_work(block_pairs(bounds, q_runs, k_runs, plan.causal))
    return total


def test_per_document_pairs_balance_causal_work_where_zigzag_does_not():
    """The runtime's sub-blocks count the pairs the planner prices, and every rank does the same work."""
    ring = 4
    docs = [8, 8, 64, 16]  # one long document in the middle of the row
    bounds = (tuple(np.cumsum([0, *docs]).tolist()),)
    work = [sum(_pair_work(per_document_pairs(bounds, rank, source, ring, True)) for source in range(ring))
            for rank in range(ring)]
    assert work == pytest.approx(rank_pairs(tuple(docs), SEQ, ring, "per_document").tolist())
    assert max(work) == min(work)
    zigzag = rank_pairs(tuple(docs), SEQ, ring, "zigzag")
    assert zigzag.max() / zigzag.mean() > 1.2


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_long_tailed_row_equal_tokens_and_pairs_per_rank_only_per_document(ring):
    """A 1024-token row of lognormal documents (one long, many short; padded to 2 x ring each): per-document
    sharding gives every ring rank the same tokens and the same causal pairs; zigzag over the row gives the same
    tokens but not the same pairs. Both compute every causal in-document pair exactly once."""
    rng = np.random.default_rng(ring)
    chunks, seq = 2 * ring, 1024
    lengths = [600, *np.clip(np.exp(rng.normal(2.0, 1.0, 60)), 1, 200).astype(int).tolist()]
    docs, used = [], 0
    for n in lengths:
        padded = -(-n // chunks) * chunks
        if used + padded > seq:
            break
        docs.append(padded)
        used += padded
    docs.append(seq - used)
    bounds = (tuple(np.cumsum([0, *docs]).tolist()),)
    tokens = [sum(n for _, n in per_document_segments(bounds[0], ring, r, 1, 0)) for r in range(ring)]
    assert tokens == [seq // ring] * ring
    per_doc = [sum(_pair_work(per_document_pairs(bounds, r, s, ring, True)) for s in range(ring)) for r in range(ring)]
    zigzag = [_zigzag_work(bounds, r, ring, seq) for r in range(ring)]
    exact = sum(n * (n + 1) // 2 for n in docs)
    assert sum(per_doc) == exact and sum(zigzag) == exact
    assert max(per_doc) == min(per_doc)
    assert max(zigzag) / (sum(zigzag) / ring) > 1.1, zigzag


def test_pad_documents_pads_each_document_inside_itself():
    # one row: documents of 1, 3, 4 and 6 tokens (ring 2: multiples of 4), positions restarting HF-style
    lengths = [1, 3, 4, 6]
    ids = torch.arange(1, 15).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = torch.arange(101, 115).unsqueeze(0)
    starts = torch.zeros(1, 14, dtype=torch.bool)
    starts[0, [1, 4, 8]] = True
    out, new = pad_documents({"input_ids": ids, "position_ids": pos, "labels": labels}, starts, 4, 8, 0)
    assert out["input_ids"].shape == (1, 24)  # 4 + 4 + 4 + 8 = 20, rounded up to a multiple of 8
    assert out["input_ids"][0].tolist() == [1, 0, 0, 0, 2, 3, 4, 0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0,
                                            0, 0, 0, 0]
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7,
                                               0, 1, 2, 3]
    assert out["labels"][0].tolist() == [101] + [IGNORE_INDEX] * 3 + [102, 103, 104, IGNORE_INDEX] + list(
        range(105, 115)) + [IGNORE_INDEX] * 6
    assert new[0].nonzero().flatten().tolist() == [4, 8, 12, 20]  # the row end padding is its own document


def test_unknown_sharding_rule_is_refused():
    with pytest.raises(RuntimeConfigError, match="unknown sequence sharding 'head_tail'"):
        SequenceParallel(sharding="head_tail")


# ----- multi-rank cases (one spawn per topology) -----------------------------------------------------------


def _padded_rows_cases(sp, ring: int) -> list[dict]:
    """Attention on rows whose documents are already multiples of 2 x ring, against one process."""
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


def _raw_batch():
    """Rows packed from the raw documents (HF-style restarting positions); input ids are 1 + the flat index of
    each token, so the prepared batch says where every original token went (pads get id 0)."""
    from sp_plan.runtime.data import pack_documents

    docs = [list(range(n)) for n in raw_documents()]
    rows = list(pack_documents(docs, RAW_SEQ, reset_positions=True))[:3]
    positions = torch.stack([r["position_ids"] for r in rows])
    batch = len(rows)
    ids = torch.arange(1, batch * RAW_SEQ + 1).view(batch, RAW_SEQ)
    return ids, positions


def _end_to_end(sp) -> dict:
    """BatchSharder.prepare + shard on every rank, per-document attention on the shards, gather: equal to one
    process's document-masked attention on the UNPADDED rows at every real token (pads: random q/k/v, zero
    output gradient, as their ignored labels give); plus the token-weighted loss."""
    import torch.distributed as dist

    from sp_plan.runtime.data import BatchSharder, cu_seqlens_from_starts, document_starts, shift_labels, valid_tokens
    from sp_plan.runtime.loss import cross_entropy_sum

    ids, positions = _raw_batch()
    batch = ids.shape[0]
    cu_raw = cu_seqlens_from_starts(document_starts(positions))
    sharder = BatchSharder(sp, pad_token_id=0)
    full = sharder.prepare({"input_ids": ids, "position_ids": positions})
    local = sharder.shard(full)
    cu = full["cu_seqlens"]
    padded_seq = full["input_ids"].shape[1]
    documents = row_bounds(cu, batch, padded_seq)
    src = full["input_ids"].reshape(-1)
    real = src > 0
    result: dict = {"docs": [[b - a for a, b in zip(row, row[1:])] for row in documents],
                    "gather_ids": bool(torch.equal(sp.gather(local["input_ids"], 1, documents), full["input_ids"])),
                    "every_token_once": sorted(src[real].tolist()) == list(range(1, batch * RAW_SEQ + 1)),
                    "positions": bool(torch.equal(sp.positions(padded_seq, documents=cu),
                                                  sp.shard(torch.arange(padded_seq).expand(batch, -1), 1, cu)))}

    def padded(x: torch.Tensor, fill: str) -> torch.Tensor:
        flat = x.reshape(batch * RAW_SEQ, *x.shape[2:])
        gen = torch.Generator().manual_seed(99)
        out = (torch.randn((batch * padded_seq, *x.shape[2:]), generator=gen, dtype=torch.float64).to(x.dtype) * 3
               if fill == "random" else torch.zeros((batch * padded_seq, *x.shape[2:]), dtype=x.dtype))
        out[real] = flat[src[real] - 1]
        return out.view(batch, padded_seq, *x.shape[2:])

    cases = []
    for i, (dtype, heads, kv_heads) in enumerate(E2E_CASES):
        q, k, v, dout = full_inputs(70 + i, batch, RAW_SEQ, heads, kv_heads, 8, dtype)
        expected = document_reference(q, k, v, dout, cu_raw, True)
        leaves = [sp.shard(padded(x, "random"), 1, cu).clone().requires_grad_() for x in (q, k, v)]
        out = sp.attention(*leaves, causal=True, cu_seqlens=cu)
        out.backward(sp.shard(padded(dout, "zero"), 1, cu))
        entry = {}
        for name, mine, ref in zip(NAMES, (out.detach(), *(x.grad for x in leaves)), expected):
            whole = sp.gather(mine, 1, documents).reshape(batch * padded_seq, *mine.shape[2:])[real]
            ref = ref.reshape(batch * RAW_SEQ, *ref.shape[2:])[src[real] - 1]
            entry[name] = float((whole.double() - ref).abs().max() / ref.abs().max())
        cases.append(entry)
    result["cases"] = cases

    # token-weighted loss: logits a fixed function of the original token, summed over the ranks
    vocab = batch * RAW_SEQ + 1
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    logits = table[local["input_ids"]]
    totals = torch.stack([cross_entropy_sum(logits, local["labels"]),
                          torch.tensor(float(valid_tokens(local["labels"])), dtype=torch.float64)])
    dist.all_reduce(totals)
    labels = shift_labels(ids, position_ids=positions)
    reference_loss = torch.nn.functional.cross_entropy(table[ids].reshape(-1, vocab), labels.reshape(-1),
                                                       ignore_index=IGNORE_INDEX)
    result["loss"] = (float(totals[0] / totals[1]), float(reference_loss))
    result["tokens"] = (int(totals[1]), valid_tokens(labels))
    return result


def _errors(sp) -> dict:
    """What the per-document context refuses, on every rank alike."""
    x = torch.zeros(1, SEQ, 2)
    raised = {}
    for name, call in (("shard", lambda: sp.shard(x, 1)), ("gather", lambda: sp.gather(x[:, : SEQ // sp.size], 1)),
                       ("positions", lambda: sp.positions(SEQ)),
                       ("bad_rows", lambda: sp.shard(x, 1, ((0, 5, SEQ),)))):
        try:
            call()
            raised[name] = ""
        except RuntimeConfigError as exc:
            raised[name] = str(exc)
    # attention on documents that are not multiples of 2 x ring (not prepared by the sharder): refused by all
    local = torch.zeros(1, SEQ // sp.size, 2, 8, dtype=torch.float64)
    try:
        sp.attention(local, local, local, causal=True, cu_seqlens=torch.tensor([0, 3, SEQ], dtype=torch.int32))
        raised["attention"] = ""
    except RuntimeConfigError as exc:
        raised["attention"] = str(exc)
    return raised


def _sharder_details(sp) -> dict:
    from sp_plan.runtime.data import BatchSharder

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
    # an unpacked batch (no documents) under the per-document rule: one document per row, the zigzag split
    plain = sharder({"input_ids": ids})
    zigzag = SequenceParallel(sp.ulysses_group, sp.ring_group)
    return {"same": bool(torch.equal(back, full["input_ids"])), "docs": docs, "local": local["input_ids"].shape[1],
            "width": full["input_ids"].shape[1], "real_labels": int((full["labels"] != IGNORE_INDEX).sum()),
            "first_ids": full["input_ids"][0, :8].tolist(), "pos": full["position_ids"][0, :8].tolist(),
            "plain_is_zigzag": bool(torch.equal(plain["input_ids"], BatchSharder(zigzag)({"input_ids": ids})["input_ids"]))
            and "cu_seqlens" not in plain}


def _topology_rank(rank: int, world: int, ring: int, ulysses: int) -> dict:
    from sp_plan.runtime.mesh import build_mesh
    from tests.attention_checks import Layout

    mesh = build_mesh(Layout(ring=ring, ulysses=ulysses, dp_shard=world // (ring * ulysses)), device_type="cpu")
    sp = SequenceParallel.from_mesh(mesh, sharding="per_document")
    out = {"padded": _padded_rows_cases(sp, ring), "e2e": _end_to_end(sp), "errors": _errors(sp)}
    if ulysses == 1 and ring == 2:
        out["sharder"] = _sharder_details(sp)
    return out


_RESULTS: dict[str, list[dict]] = {}


def _results(topology: str) -> list[dict]:
    if topology not in _RESULTS:
        _RESULTS[topology] = run_ranks(TOPOLOGIES[topology][0], _topology_rank, *TOPOLOGIES[topology][1:], timeout=120)
    return _RESULTS[topology]


@pytest.mark.multiproc
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_per_document_ring_attention_is_exact(topology):
    per_rank = _results(topology)
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        errors = combine([{n: r["padded"][i][n] for n in NAMES} for r in per_rank])
        for tensor, (max_rel, _) in errors.items():
            assert max_rel <= TOL[dtype], (topology, dtype, causal, heads, kv_heads, tensor, max_rel)
        assert max(r["padded"][i]["gather"] for r in per_rank) <= 1e-4


@pytest.mark.multiproc
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_batch_sharder_end_to_end_is_exact_on_unpadded_documents(topology):
    ring = TOPOLOGIES[topology][1]
    for r in _results(topology):
        e2e = r["e2e"]
        assert e2e["gather_ids"] and e2e["every_token_once"] and e2e["positions"]
        assert all(n % (2 * ring) == 0 for row in e2e["docs"] for n in row)
        for (dtype, heads, kv_heads), case in zip(E2E_CASES, e2e["cases"]):
            tol = 1e-10 if dtype == torch.float64 else 1e-5
            assert max(case.values()) <= tol, (topology, dtype, heads, kv_heads, case)
        loss, reference_loss = e2e["loss"]
        assert loss == pytest.approx(reference_loss, rel=1e-12)
        assert e2e["tokens"][0] == e2e["tokens"][1]


@pytest.mark.multiproc
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_per_document_refusals_are_clear_and_on_every_rank(topology):
    for r in _results(topology):
        errors = r["errors"]
        for name in ("shard", "gather", "positions"):
            assert f"sharding='per_document').{name} needs the batch's document boundaries" in errors[name]
        assert "multiple of 2 x ring" in errors["bad_rows"]
        assert "multiple of 2 x ring" in errors["attention"], errors["attention"]


@pytest.mark.multiproc
def test_batch_sharder_pads_each_document_and_gathers_back():
    out = [r["sharder"] for r in _results("ring2")]
    for r in out:
        assert r["same"] and r["plain_is_zigzag"]
        assert all(length % 4 == 0 for row in r["docs"] for length in row)
        assert r["local"] * 2 == r["width"]
    first = out[0]
    # row 0: [1 | pad x3], [2..6 | pad x3], ...: pads carry the token 0 and continue their document's positions
    assert first["first_ids"][:4] == [1, 0, 0, 0] and first["pos"][:4] == [0, 1, 2, 3]
    assert first["first_ids"][4:8] == [2, 3, 4, 5] and first["pos"][4:8] == [0, 1, 2, 3]
    # labels: each document predicts its own next tokens only (4 + 16 + 22 = 42 targets in the batch)
    assert first["real_labels"] == (0 + 4 + 16) + 22
