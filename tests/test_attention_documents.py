"""Document masking (packed sequences, ``cu_seqlens``) through every attention path, exact.

The reference is independent of the runtime's kernels: per-document attention with materialised fp64
scores and an explicit mask (same document, and causal), differentiated by autograd. Checked forward
(output) and backward (dq, dk, dv), MHA and GQA, causal and non-causal, fp64 (<= 1e-12) and fp32
(<= 1e-5):

- single device (``local_attention``), both CPU backends, documents of length 1 included;
- Ulysses 2 and 4, zigzag Ring 2, 3 and 4, contiguous Ring 2, USP 2 x 2 on gloo ranks, with documents
  that straddle rank boundaries and the two zigzag halves of a rank, rows with different documents,
  and a row that is one document;
- cu_seqlens errors, and the planner of per-document sub-blocks (pure combinatorics: every visible
  (query, key) pair computed exactly once, nothing else).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from sp_plan.runtime.attention import local_attention
from sp_plan.runtime.attention.documents import block_pairs, row_bounds, take
from sp_plan.runtime.attention.ring import block_plan, ring_runs
from sp_plan.runtime.errors import RuntimeConfigError
from tests.attention_checks import NAMES, combine, full_inputs, stats
from tests.distributed import run_ranks

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
SEQ = 48  # divisible by every layout below (2 x ring x ulysses for ring 2, 3, 4 and 2 x 2)
#: Per row: document boundaries. Row 0 straddles rank and zigzag-half boundaries for every layout
#: (chunks of 6 for ring 4, 8 for ring 3, 12 for ring 2); row 1 has tiny documents; row 2 is one document.
ROWS = [(0, 5, 7, 19, 20, 41, 48), (0, 1, 2, 3, 30, 31, 48), (0, 48)]


def cu_seqlens(rows=ROWS, seq=SEQ) -> torch.Tensor:
    points = sorted({b * seq + p for b, row in enumerate(rows) for p in row})
    return torch.tensor(points, dtype=torch.int32)


def document_reference(q, k, v, dout, cu: torch.Tensor, causal: bool):
    """fp64 out, dq, dk, dv of per-document attention (materialised scores, explicit mask)."""
    batch, seq, heads, head_dim = q.shape
    doc = torch.zeros(batch * seq, dtype=torch.int64)
    doc[cu[1:-1].long()] = 1
    doc = doc.cumsum(0).view(batch, seq)
    mask = doc[:, :, None] == doc[:, None, :]
    if causal:
        mask &= torch.ones(seq, seq, dtype=torch.bool).tril()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    group = heads // k.shape[2]
    kk, vv = (x.repeat_interleave(group, 2) for x in leaves[1:])
    scores = torch.einsum("bqhd,bkhd->bhqk", leaves[0], kk) / head_dim**0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv)
    out.backward(dout.double())
    return (out.detach(), *(x.grad for x in leaves))


# ----- single device --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa_cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_local_document_attention_is_exact(backend, dtype, causal, heads, kv_heads):
    q, k, v, dout = full_inputs(3, len(ROWS), SEQ, heads, kv_heads, 8, dtype)
    expected = document_reference(q, k, v, dout, cu_seqlens(), causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = local_attention(*leaves, causal=causal, backend=backend, cu_seqlens=cu_seqlens())
    out.backward(dout)
    for name, actual, ref in zip(NAMES, (out, *(x.grad for x in leaves)), expected):
        err = ((actual.double() - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL[dtype], (name, err)


def test_one_document_per_row_is_the_plain_causal_path():
    q, k, v, _ = full_inputs(4, 2, 16, 4, 2, 8, torch.float64)
    plain = local_attention(q, k, v, causal=True)
    docs = local_attention(q, k, v, causal=True, cu_seqlens=torch.tensor([0, 16, 32]))
    assert torch.equal(plain, docs)


def test_cu_seqlens_errors_are_actionable():
    q = torch.zeros(2, 8, 2, 4)
    cases = [
        (torch.tensor([0, 3, 15]), "end at batch x seq_len = 2 x 8 = 16"),
        (torch.tensor([0, 3, 9, 16]), "no boundary at the row start(s) [8]"),
        (torch.tensor([0.0, 16.0]), "1-D integer tensor"),
        (torch.tensor([0, 9, 8, 16]), "non-decreasing"),
    ]
    for cu, message in cases:
        with pytest.raises(RuntimeConfigError, match=re.escape(message)):
            local_attention(q, q, q, cu_seqlens=cu)


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "zigzag"), (4, "zigzag"), (3, "contiguous")])
def test_document_sub_blocks_cover_each_visible_pair_exactly_once(world, layout):
    """Pure combinatorics over the ring schedule: the sub-blocks of every (rank, step) tile the causal
    document mask exactly."""
    seq = 2 * world * 6
    rows = ((0, 3, 4, 11, 23, seq), (0, seq))
    bounds = row_bounds(cu_seqlens(rows, seq), len(rows), seq)
    local = seq // world
    covered: dict = {}
    for rank, step in itertools.product(range(world), range(world)):
        plan = block_plan(step, rank, world, True, local, layout)
        if plan is None:
            continue
        source = (rank - step) % world
        q_runs = take(ring_runs(layout, rank, world, local), *plan.q_rows.indices(local)[:2])
        k_runs = take(ring_runs(layout, source, world, local), *plan.kv_rows.indices(local)[:2])
        q_pos = [p for s, n in q_runs for p in range(s, s + n)]
        k_pos = [p for s, n in k_runs for p in range(s, s + n)]
        for pair in block_pairs(bounds, q_runs, k_runs, plan.causal):
            for qi, ki in itertools.product(range(pair.q_lo, pair.q_hi), range(pair.k_lo, pair.k_hi)):
                if pair.causal and ki - pair.k_lo > qi - pair.q_lo:
                    continue
                key = (pair.row, q_pos[qi], k_pos[ki])
                covered[key] = covered.get(key, 0) + 1
    expected = {}
    for row, b in enumerate(rows):
        for lo, hi in zip(b, b[1:]):
            for qp in range(lo, hi):
                for kp in range(lo, qp + 1):
                    expected[(row, qp, kp)] = 1
    assert covered == expected


# ----- multi-rank -------------------------------------------------------------------------------------

#: (dtype, causal, heads, kv_heads)
CASES = [(dtype, causal, heads, kv_heads) for dtype in (torch.float64, torch.float32) for causal in (True, False)
         for heads, kv_heads in ((4, 4), (4, 2))]


def _documents_rank(rank: int, world: int, ring: int, ulysses: int, layout: str) -> list:
    import torch.distributed as dist

    from sp_plan.runtime.attention import ring_attention
    from tests.attention_checks import sp_context

    sp = sp_context(world, ring=ring, ulysses=ulysses)
    cu = cu_seqlens()
    results = []
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        q, k, v, dout = full_inputs(10 + i, len(ROWS), SEQ, heads, kv_heads, 8, dtype)
        expected = document_reference(q, k, v, dout, cu, causal)
        if layout == "contiguous":  # the low-level API on a contiguous split
            rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
            leaves = [x[:, rows].clone().requires_grad_() for x in (q, k, v)]
            out = ring_attention(*leaves, dist.group.WORLD, causal=causal, layout="contiguous", cu_seqlens=cu)
            out.backward(dout[:, rows])
            mine = [e[:, rows] for e in expected]
        else:
            leaves = [sp.shard(x).clone().requires_grad_() for x in (q, k, v)]
            out = sp.attention(*leaves, causal=causal, cu_seqlens=cu)
            out.backward(sp.shard(dout))
            mine = [sp.shard(e) for e in expected]
        actual = (out.detach(), *(x.grad for x in leaves))
        results.append(dict(zip(NAMES, map(stats, actual, mine))))
    return results


LAYOUTS = [
    ("ulysses2", 2, 1, 2, "zigzag"),
    ("ulysses4", 4, 1, 4, "zigzag"),
    ("ring2", 2, 2, 1, "zigzag"),
    ("ring3", 3, 3, 1, "zigzag"),
    ("ring4", 4, 4, 1, "zigzag"),
    ("ring2-contiguous", 2, 2, 1, "contiguous"),
    ("usp2x2", 4, 2, 2, "zigzag"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("name,world,ring,ulysses,layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_document_masking_is_exact_on_every_parallel_path(name, world, ring, ulysses, layout):
    per_rank = run_ranks(world, _documents_rank, ring, ulysses, layout, timeout=120)
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        errors = combine([r[i] for r in per_rank])
        for tensor, (max_rel, _) in errors.items():
            assert max_rel <= TOL[dtype], (name, dtype, causal, heads, kv_heads, tensor, max_rel)
