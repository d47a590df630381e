"""Ulysses attention on 2 and 4 gloo ranks: exact vs fp64 (KV replication included), clear rejections."""

from __future__ import annotations

import pytest
import torch

from sp_plan.runtime.attention.ulysses import ulysses_kv_replication, valid_ulysses_degrees
from sp_plan.runtime.errors import RuntimeConfigError
from tests.attention_checks import combine, run_case, sp_context
from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
#: (heads, kv_heads): MHA, GQA with KV split, GQA with kv < degree (replicated), MQA.
HEADS = [(4, 4), (8, 2), (4, 2), (4, 1)]
CASES = [
    (dtype, causal, heads, kv_heads)
    for dtype in (torch.float64, torch.float32)
    for causal in (True, False)
    for heads, kv_heads in HEADS
]


def _ulysses_rank(rank: int, world: int) -> dict:
    from sp_plan.runtime.attention.api import ulysses_attention

    sp = sp_context(world, ring=1, ulysses=world)
    results: dict = {"cases": []}
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        stats = run_case(sp, seed=i, batch=2, seq=8 * world, heads=heads, kv_heads=kv_heads, head_dim=8,
                         dtype=dtype, causal=causal, scale=None if causal else 0.25)
        results["cases"].append(stats["dist"])
    bad = torch.zeros(1, 4, 6, 8)
    try:
        ulysses_attention(bad, bad[:, :, :3], bad[:, :, :3], sp.ulysses_group)
    except RuntimeConfigError as exc:
        results["heads_error"] = str(exc)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"ulysses{w}")
def ulysses_results(request):
    return request.param, run_ranks(request.param, _ulysses_rank)


def test_ulysses_matches_reference_forward_and_backward(ulysses_results):
    world, per_rank = ulysses_results
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        errors = combine([r["cases"][i] for r in per_rank])
        for name, (max_rel, _) in errors.items():
            assert max_rel <= TOL[dtype], (world, dtype, causal, heads, kv_heads, name, max_rel)


def test_indivisible_query_heads_are_rejected_on_every_rank(ulysses_results):
    world, per_rank = ulysses_results
    if world == 2:  # 6 heads split 2 ways, 3 KV heads cannot: neither divides nor is a multiple
        expected = ("ulysses=2 neither divides nor is a multiple of 3 KV heads, so KV heads can be neither split nor "
                    "replicated evenly; valid Ulysses degrees: 1, 3, 6, or move the extra degree to ring")
    else:
        expected = ("ulysses=4 does not divide 6 query heads; valid Ulysses degrees for these heads: 1, 3, 6, "
                    "or move the extra degree to ring")
    assert [r["heads_error"] for r in per_rank] == [expected] * world


@pytest.mark.parametrize("heads,kv_heads,degree,rep", [(32, 8, 4, 1), (32, 8, 8, 1), (32, 8, 16, 2), (64, 8, 32, 4),
                                                       (8, 1, 8, 8), (4, 4, 1, 1)])
def test_kv_replication_factor(heads, kv_heads, degree, rep):
    assert ulysses_kv_replication(heads, kv_heads, degree) == rep


def test_valid_degrees_and_messages():
    assert valid_ulysses_degrees(40, 8) == [1, 2, 4, 8, 40]  # 5, 10, 20 split 40 heads but not 8 KV heads
    with pytest.raises(RuntimeConfigError, match="ulysses=16 does not divide 40 query heads"):
        ulysses_kv_replication(40, 8, 16)
    with pytest.raises(RuntimeConfigError, match="ulysses=5 neither divides nor is a multiple of 8 KV heads"):
        ulysses_kv_replication(40, 8, 5)
