"""Bytes each rank sends, counted at the collectives, against the brief's per-layer formulas (4 ranks).

Ulysses (degree P): forward (P-1)/P x (|Q| + |K| + |V|) + (P-1)/P x |O|, K and V after KV replication;
backward the same bytes. Ring (degree P): forward (P-1) x |K block + V block| in the compute dtype;
backward (P-1) x |KV block| + P x |dKV block| in fp32. USP: Ulysses over U on the local shards, then
Ring over R on the head-split, ring-local tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

B, S, D = 2, 32, 8
BF16, FP32 = 2, 4  # bytes per element


def _count(
    sp, heads: int, kv_heads: int, dtype: torch.dtype, checkpoint: bool = False, early_stop: bool = True
) -> dict:
    from torch.utils.checkpoint import checkpoint as ckpt
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from sp_plan.runtime.comm_counter import CommCounter
    from tests.attention_checks import full_inputs

    q, k, v, dout = full_inputs(0, B, S, heads, kv_heads, D, dtype)
    leaves = [sp.shard(x).detach().clone().requires_grad_() for x in (q, k, v)]
    with CommCounter() as counter:
        if checkpoint:
            with set_checkpoint_early_stop(early_stop):
                out = ckpt(lambda a, b, c: sp.attention(a, b, c), *leaves, use_reentrant=False)
                out.backward(sp.shard(dout))
        else:
            out = sp.attention(*leaves)
            out.backward(sp.shard(dout))
    calls = {phase: counter.calls(phase=phase) for phase in ("forward", "backward", "recompute")}
    return {"bytes": counter.as_dict(), "calls": calls}


def _comm_rank(rank: int, world: int) -> dict:
    from tests.attention_checks import sp_context

    results = {}
    ulysses = sp_context(world, ring=1, ulysses=4)
    results["ulysses"] = _count(ulysses, heads=8, kv_heads=2, dtype=torch.float32)  # KV replicated 2x
    results["ulysses_ckpt"] = _count(ulysses, heads=8, kv_heads=2, dtype=torch.float32, checkpoint=True,
                                     early_stop=False)
    results["ulysses_ckpt_early_stop"] = _count(ulysses, heads=8, kv_heads=2, dtype=torch.float32, checkpoint=True)
    results["ring"] = _count(sp_context(world, ring=4, ulysses=1), heads=4, kv_heads=2, dtype=torch.bfloat16)
    results["usp"] = _count(sp_context(world, ring=2, ulysses=2), heads=4, kv_heads=1, dtype=torch.bfloat16)
    return results


@pytest.fixture(scope="module")
def counts():
    return run_ranks(4, _comm_rank)


def _only(byte_counts: dict, expected: dict) -> None:
    """Every (phase, collective) is zero except the expected ones, which match exactly."""
    for phase, per_collective in byte_counts.items():
        for collective, nbytes in per_collective.items():
            assert nbytes == expected.get((phase, collective), 0), (phase, collective, nbytes, expected)


def test_ulysses_bytes(counts):
    p, heads, kv_replicated = 4, 8, 4  # 2 KV heads repeated to 4 = the Ulysses degree
    s = S // p
    q = o = B * s * heads * D * FP32
    kv = B * s * kv_replicated * D * FP32
    fwd = (p - 1) * (q + 2 * kv) // p + (p - 1) * o // p
    for r in counts:
        _only(r["ulysses"]["bytes"], {("forward", "all_to_all"): fwd, ("backward", "all_to_all"): fwd})
        assert r["ulysses"]["calls"] == {"forward": 2, "backward": 2, "recompute": 0}


def test_ulysses_under_activation_checkpointing_counts_the_recompute(counts):
    p, heads, kv_replicated = 4, 8, 4
    s = S // p
    qkv = (p - 1) * (B * s * (heads + 2 * kv_replicated) * D * FP32) // p
    base = counts[0]["ulysses"]["bytes"]["forward"]["all_to_all"]
    for r in counts:
        _only(r["ulysses_ckpt"]["bytes"], {("forward", "all_to_all"): base, ("recompute", "all_to_all"): base,
                                           ("backward", "all_to_all"): base})
        # torch's default early stop ends the recompute once the last saved tensor is rebuilt: when the
        # checkpointed region ends with attention, the output all-to-all (which saves nothing) is not re-run.
        _only(r["ulysses_ckpt_early_stop"]["bytes"], {("forward", "all_to_all"): base, ("recompute", "all_to_all"): qkv,
                                                      ("backward", "all_to_all"): base})


def test_ring_bytes(counts):
    p, kv_heads = 4, 2
    s = S // p
    kv_block = 2 * B * s * kv_heads * D * BF16
    dkv_block = 2 * B * s * kv_heads * D * FP32
    for r in counts:
        _only(r["ring"]["bytes"], {("forward", "send_recv"): (p - 1) * kv_block,
                                   ("backward", "send_recv"): (p - 1) * kv_block + p * dkv_block})
        assert r["ring"]["calls"] == {"forward": p - 1, "backward": (p - 1) + p, "recompute": 0}


def test_usp_bytes(counts):
    ring, uly, heads, kv_replicated = 2, 2, 4, 2  # 1 KV head repeated to the Ulysses degree 2
    s = S // (ring * uly)
    q = o = B * s * heads * D * BF16
    kv = B * s * kv_replicated * D * BF16
    a2a = (uly - 1) * (q + 2 * kv) // uly + (uly - 1) * o // uly
    ring_local = S // ring  # after the all-to-all: the ring-local sequence, kv_replicated / uly = 1 head
    kv_block = 2 * B * ring_local * 1 * D * BF16
    dkv_block = 2 * B * ring_local * 1 * D * FP32
    for r in counts:
        _only(r["usp"]["bytes"], {
            ("forward", "all_to_all"): a2a, ("backward", "all_to_all"): a2a,
            ("forward", "send_recv"): (ring - 1) * kv_block,
            ("backward", "send_recv"): (ring - 1) * kv_block + ring * dkv_block,
        })


def test_counter_arithmetic_nesting_and_phases():
    from sp_plan.runtime.comm_counter import (
        CommCounter,
        record,
        record_all_gather,
        record_all_reduce,
        record_all_to_all,
        record_reduce_scatter,
    )

    record("send_recv", 10**6, "forward")  # no counter active: nothing to record, no error
    buffer = torch.zeros(1024, dtype=torch.bfloat16)  # 2048 bytes
    with CommCounter() as outer:
        record_all_to_all(buffer, 8, "forward")  # 7/8 leaves the rank
        with CommCounter() as inner:
            record_all_gather(torch.zeros(256), 4, "forward")  # shard of 1 KiB to 3 peers
            record_reduce_scatter(torch.zeros(1024), 4, "backward")  # 3/4 of 4 KiB
            record_all_reduce(torch.zeros(1024), 4, "backward")  # 2 x 3/4 of 4 KiB
    assert inner.as_dict()["forward"]["all_gather"] == 3 * 1024
    assert inner.bytes("reduce_scatter", "backward") == 3072 and inner.bytes("all_reduce") == 6144
    assert inner.bytes("all_to_all") == 0
    assert outer.bytes("all_to_all", "forward") == 1792 and outer.bytes() == 1792 + 3072 + 3072 + 6144
    assert outer.calls() == 4 and inner.calls(phase="backward") == 2
    with pytest.raises(ValueError, match="unknown collective"), CommCounter():
        record("broadcast", 1, "forward")
