"""USP (ring 2 x ulysses 2) on 4 gloo ranks, and the SequenceParallel context: shard, gather, positions."""

from __future__ import annotations

import pytest
import torch

from sp_plan.runtime.context import check_seq_len, shard_segments
from sp_plan.runtime.errors import RuntimeConfigError
from tests.attention_checks import combine, run_case, sp_context
from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
CASES = [
    (dtype, causal, heads, kv_heads)
    for dtype in (torch.float64, torch.float32)
    for causal in (True, False)
    for heads, kv_heads in ((4, 4), (4, 2), (4, 1), (8, 2))
]
BF16_RATIO = 1.5


def _usp_rank(rank: int, world: int) -> dict:
    sp = sp_context(world, ring=2, ulysses=2)
    results: dict = {"cases": [], "layout": (sp.ring_rank, sp.ulysses_rank, sp.rank)}
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        stats = run_case(sp, seed=i, batch=2, seq=32, heads=heads, kv_heads=kv_heads, head_dim=8,
                         dtype=dtype, causal=causal)
        results["cases"].append(stats["dist"])
    results["bf16"] = run_case(sp, seed=99, batch=1, seq=256, heads=4, kv_heads=2, head_dim=32,
                               dtype=torch.bfloat16, causal=True, with_single=True)

    # The context API: shard/gather round trips on any dim, positions follow the shard, gather's grad.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, 5, generator=gen)
    results["roundtrip_dim1"] = torch.equal(sp.gather(sp.shard(x, dim=1), dim=1), x)
    y = torch.randn(16, 2, generator=gen)
    results["roundtrip_dim0"] = torch.equal(sp.gather(sp.shard(y, dim=0), dim=0), y)
    results["positions"] = sp.positions(16).tolist()
    results["positions_match_shard"] = torch.equal(sp.positions(16), sp.shard(torch.arange(16), dim=0))
    local = sp.shard(x, dim=1).clone().requires_grad_()
    weight = torch.randn(x.shape, generator=gen)
    (sp.gather(local, dim=1) * weight).sum().backward()
    # Each of the 4 SP ranks' loss depends on this shard: the summed gradient is 4 x shard(weight).
    results["gather_grad_ok"] = torch.allclose(local.grad, sp.size * sp.shard(weight, dim=1))
    try:
        sp.shard(torch.zeros(1, 12), dim=1)
    except RuntimeConfigError as exc:
        results["seq_error"] = str(exc)
    return results


@pytest.fixture(scope="module")
def usp_results():
    return run_ranks(4, _usp_rank)


def test_usp_matches_reference_forward_and_backward(usp_results):
    for i, (dtype, causal, heads, kv_heads) in enumerate(CASES):
        errors = combine([r["cases"][i] for r in usp_results])
        for name, (max_rel, _) in errors.items():
            assert max_rel <= TOL[dtype], (dtype, causal, heads, kv_heads, name, max_rel)


def test_usp_bf16_is_as_accurate_as_one_bf16_kernel_call(usp_results):
    dist_err = combine([r["bf16"]["dist"] for r in usp_results])
    single_err = combine([r["bf16"]["single"] for r in usp_results])
    for name in dist_err:
        assert dist_err[name][1] <= BF16_RATIO * single_err[name][1], (name, dist_err[name], single_err[name])


def test_context_layout_and_positions(usp_results):
    # Mesh ranks are ring-major with ulysses innermost: global rank 2 is ring rank 1, ulysses rank 0.
    assert [r["layout"] for r in usp_results] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    # 16 tokens, 4 zigzag chunks of 4: ring 0 holds chunks 0 and 3, ring 1 chunks 1 and 2; Ulysses halves those.
    assert [r["positions"] for r in usp_results] == [
        [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11],
    ]
    for r in usp_results:
        assert r["positions_match_shard"] and r["roundtrip_dim0"] and r["roundtrip_dim1"] and r["gather_grad_ok"]


def test_context_rejects_sequences_that_do_not_split(usp_results):
    expected = ("sequence length 12 is not divisible by ulysses x ring = 2 x 2 x 2 (zigzag ring) = 8; use 8 or 16 "
                "(or pad the data to that multiple)")
    assert [r["seq_error"] for r in usp_results] == [expected] * 4


def test_shard_segments_examples():
    # Ring only (4 ranks, 8 chunks of 2): rank r holds chunks r and 7 - r.
    assert [shard_segments(16, 4, r, 1, 0) for r in range(4)] == [
        [(0, 2), (14, 2)], [(2, 2), (12, 2)], [(4, 2), (10, 2)], [(6, 2), (8, 2)],
    ]
    # Ulysses only: contiguous quarters.
    assert [shard_segments(16, 1, 0, 4, u) for u in range(4)] == [[(0, 4)], [(4, 4)], [(8, 4)], [(12, 4)]]
    # ring 2 x ulysses 4, 32 tokens: ring rank 0 holds [0, 8) and [24, 32); Ulysses quarters of that.
    assert [shard_segments(32, 2, 0, 4, u) for u in range(4)] == [[(0, 4)], [(4, 4)], [(24, 4)], [(28, 4)]]
    # ring 2 x ulysses 3, 48 tokens: ring rank 1 holds [12, 24) and [24, 36); the middle third straddles them.
    assert shard_segments(48, 2, 1, 3, 1) == [(20, 4), (24, 4)]
    with pytest.raises(RuntimeConfigError, match="sequence length 10 is not divisible by ulysses x ring = 1 x 4"):
        check_seq_len(10, ring=4, ulysses=1)
    with pytest.raises(RuntimeConfigError, match="use 4 \\(or pad"):
        check_seq_len(3, ring=1, ulysses=4)
