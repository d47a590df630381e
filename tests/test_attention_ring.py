"""Zigzag ring attention on 2 and 4 gloo ranks: exact vs fp64, bf16 accuracy, balance, rejections."""

from __future__ import annotations

import itertools

import pytest
import torch

from sp_plan.runtime.attention.ring import block_plan
from tests.attention_checks import combine, run_case, sp_context
from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
#: (dtype, causal, heads, kv_heads, scale): MHA, GQA and MQA, default and explicit softmax scale.
CASES = [
    (dtype, causal, heads, kv_heads, scale)
    for dtype in (torch.float64, torch.float32)
    for causal in (True, False)
    for (heads, kv_heads), scale in (((4, 4), None), ((4, 2), 0.3), ((4, 1), None))
]
#: The brief's bound: distributed bf16 error at most this multiple of one single-device bf16 call's.
BF16_RATIO = 1.5


def _ring_rank(rank: int, world: int) -> dict:
    from sp_plan.runtime.attention.kernel import KernelWorkCounter
    from sp_plan.runtime.attention.api import ring_attention
    from sp_plan.runtime.errors import RuntimeConfigError
    from tests.attention_checks import distributed, full_inputs

    sp = sp_context(world, ring=world, ulysses=1)
    results: dict = {"cases": []}
    for i, (dtype, causal, heads, kv_heads, scale) in enumerate(CASES):
        stats = run_case(sp, seed=i, batch=2, seq=16 * world, heads=heads, kv_heads=kv_heads, head_dim=8,
                         dtype=dtype, causal=causal, scale=scale)
        results["cases"].append(stats["dist"])
    results["bf16"] = run_case(sp, seed=99, batch=1, seq=64 * world, heads=4, kv_heads=2, head_dim=32,
                               dtype=torch.bfloat16, causal=True, with_single=True)
    q, k, v, dout = full_inputs(7, 1, 16 * world, 4, 2, 8, torch.float32)
    with KernelWorkCounter() as work:
        distributed(sp, q, k, v, dout, True, None)
    results["work"] = (work.forward_calls, work.backward_calls, work.forward_flops + work.backward_flops)
    odd = torch.zeros(1, 7, 2, 8)
    try:
        ring_attention(odd, odd, odd, sp.ring_group, causal=True, layout="zigzag")
    except RuntimeConfigError as exc:
        results["odd_error"] = str(exc)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"ring{w}")
def ring_results(request):
    return request.param, run_ranks(request.param, _ring_rank)


def test_ring_matches_reference_forward_and_backward(ring_results):
    world, per_rank = ring_results
    for i, (dtype, causal, heads, kv_heads, scale) in enumerate(CASES):
        errors = combine([r["cases"][i] for r in per_rank])
        for name, (max_rel, _) in errors.items():
            assert max_rel <= TOL[dtype], (world, dtype, causal, heads, kv_heads, name, max_rel)


def test_ring_bf16_is_as_accurate_as_one_bf16_kernel_call(ring_results):
    """RMS error vs fp64 over the whole sequence; the max-norm error is dominated by single elements."""
    _, per_rank = ring_results
    dist_err = combine([r["bf16"]["dist"] for r in per_rank])
    single_err = combine([r["bf16"]["single"] for r in per_rank])
    for name in dist_err:
        assert dist_err[name][1] <= BF16_RATIO * single_err[name][1], (name, dist_err[name], single_err[name])


def test_zigzag_gives_every_rank_the_same_kernel_work(ring_results):
    world, per_rank = ring_results
    calls = {(fwd, bwd) for fwd, bwd, _ in (r["work"] for r in per_rank)}
    assert calls == {(world, world)}  # one kernel call per ring step, forward and backward
    flops = [r["work"][2] for r in per_rank]
    assert max(flops) / min(flops) <= 1.05


def test_odd_local_sequence_is_rejected(ring_results):
    world, per_rank = ring_results
    for r in per_rank:
        assert r["odd_error"] == (
            "zigzag causal ring attention needs an even local sequence (two chunks per rank), got 7 tokens: "
            f"pad the sequence to a multiple of 2 x ring = {2 * world}"
        )


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_schedule_covers_each_causal_pair_exactly_once(world):
    """Pure combinatorics: the blocks the schedule computes tile the causal mask with no overlap or gap."""
    chunk = 3
    local = 2 * chunk
    positions = {
        r: list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * world - 1 - r) * chunk, (2 * world - r) * chunk))
        for r in range(world)
    }
    covered: dict[tuple[int, int], int] = {}
    for rank, step in itertools.product(range(world), range(world)):
        plan = block_plan(step, rank, world, True, local)
        source = (rank - step) % world
        q_pos = positions[rank][plan.q_rows]
        k_pos = positions[source][plan.kv_rows]
        for qi, qp in enumerate(q_pos):
            for ki, kp in enumerate(k_pos):
                if plan.causal and ki > qi:  # the kernel's own (local, top-left) causal mask
                    continue
                assert kp <= qp, f"rank {rank} step {step} computes a masked pair ({qp}, {kp})"
                covered[(qp, kp)] = covered.get((qp, kp), 0) + 1
    seq = 2 * world * chunk
    assert covered == {(qp, kp): 1 for qp in range(seq) for kp in range(qp + 1)}
