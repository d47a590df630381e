"""The runtime half of length-adaptive SP (issue 32 item 5): rows of different length buckets on different
Ulysses x Ring groups inside one 4-rank job train exactly like one process on the same global batch.

Plans on 4 gloo ranks, tiny runtime Llama in fp64 (4 query heads, 2 KV heads), rows packed from a long-tailed
(lognormal) document-length distribution:

- ``u2+u4``: short rows on ulysses=2 (2 data-parallel groups), long rows on ulysses=4 (one group);
- ``dp4+u2+usp``: tiny rows data-parallel over 4 ranks, short rows on ulysses=2, long rows on ulysses=2 x ring=2
  (per-document ring sharding; again with zigzag sharding), two rows per micro-batch; one bucket leaves one of its
  groups without a row.

The reference is plain PyTorch with no runtime code on the path: every document run on its own (positions from 0,
plain causal attention), the step's loss the sum of token cross-entropies over all documents of the global batch
divided by their count. Checked: the loss, every parameter's gradient after one step, and the parameters after two
AdamW steps (fp64: exact to rounding, the 1e-10 of tests/test_training_equivalence.py); every rank ends with the
same parameters. One spawn per plan runs its cases and the error cases; the pure parts need no ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sp_plan.planner.adaptive_sp import AdaptiveSPPlan, LengthBucket
from sp_plan.runtime.adaptive_sp import (
    BucketAttention,
    PackedRow,
    assign_rows,
    bucket_coordinates,
    bucket_of,
    bucket_rank_sets,
    check_heads,
    check_world,
    group_creation_order,
    loss_tokens,
    row_labels,
    rows_batch,
)
from sp_plan.runtime.data import IGNORE_INDEX
from sp_plan.runtime.errors import RuntimeConfigError
from tests.distributed import error_of, run_ranks

VOCAB = 96
LR = 3e-3
TOL = 1e-10  # fp64: the parallel computation is exact (tests/test_training_equivalence.py's FP64_PARAM_TOL)

PLANS = {
    "u2+u4": AdaptiveSPPlan(world=4, buckets=[
        LengthBucket(max_document_tokens=16, row_tokens=48, ulysses=2),
        LengthBucket(max_document_tokens=160, row_tokens=160, ulysses=4)]),
    "dp4+u2+usp": AdaptiveSPPlan(world=4, buckets=[
        LengthBucket(max_document_tokens=8, row_tokens=24),
        LengthBucket(max_document_tokens=24, row_tokens=48, ulysses=2),
        LengthBucket(max_document_tokens=160, row_tokens=160, ulysses=2, ring=2)]),
}
#: per plan: (rows per bucket in step 1, in step 2), runner keyword arguments per case
ROW_COUNTS = {"u2+u4": ((5, 2), (3, 1)), "dp4+u2+usp": ((5, 3, 2), (4, 1, 1))}
CASES = {"u2+u4": {"per_document": {}},
         "dp4+u2+usp": {"per_document": {"micro_batch_rows": 2}, "zigzag": {"sharding": "zigzag"}}}


def _spec(heads: int = 4, kv_heads: int = 2):
    from sp_plan.cost_models import ModelSpec

    return ModelSpec(name="tiny-llama", num_layers=2, hidden_size=64, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=16, ffn_hidden_size=128, vocab_size=VOCAB)


def _model(heads: int = 4, kv_heads: int = 2):
    from sp_plan.runtime.models import LlamaModel

    model = LlamaModel(_spec(heads, kv_heads))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model.double()


def make_rows(plan: AdaptiveSPPlan, counts: tuple[int, ...], seed: int) -> list[PackedRow]:
    """``counts[b]`` rows per bucket b: one document in the bucket's length range (lognormal, clipped), filled
    with short lognormal documents; a 1-token document in the first row; one row with prompt-masked labels."""
    rng = np.random.default_rng(seed)
    rows = []
    for b, count in enumerate(counts):
        bucket = plan.buckets[b]
        lo = plan.buckets[b - 1].max_document_tokens + 1 if b else 1
        for _ in range(count):
            length = int(rng.integers(bucket.row_tokens // 2, bucket.row_tokens + 1))
            first = int(np.clip(np.exp(rng.normal(np.log(bucket.max_document_tokens), 0.6)), lo,
                                min(bucket.max_document_tokens, max(lo, length * 3 // 4))))
            docs = [first]
            while sum(docs) < length:
                docs.append(int(np.clip(np.exp(rng.normal(1.5, 1.0)), 1,
                                        min(bucket.max_document_tokens, length - sum(docs)))))
            rng.shuffle(docs)
            rows.append([int(d) for d in docs])
    rows[0].insert(0, 1)
    if sum(rows[0]) > plan.buckets[0].row_tokens:
        rows[0][-1] -= 1
        rows[0] = [d for d in rows[0] if d]
    order = rng.permutation(len(rows))  # the batch's order is not the buckets'
    out = []
    for k, i in enumerate(order):
        docs = rows[i]
        ids = rng.integers(0, VOCAB, sum(docs)).tolist()
        labels = None
        if k == 1:  # a prompt-masked row: its first 3 tokens carry no target
            labels = [IGNORE_INDEX] * 3 + ids[3:]
        out.append(PackedRow(input_ids=tuple(ids), documents=tuple(docs), labels=labels))
    return out


def reference_step(model, rows: list[PackedRow]) -> torch.Tensor:
    """One process, plain PyTorch: every document alone (positions from 0, causal), mean over all loss tokens."""
    total, count = 0.0, 0
    for row in rows:
        labels = row.labels if row.labels is not None else row.input_ids
        offset = 0
        for d in row.documents:
            if d > 1:
                ids = torch.tensor(row.input_ids[offset:offset + d])[None]
                target = torch.tensor(labels[offset + 1:offset + d])
                logits = model(ids)[0, :-1]
                total = total + F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
                count += int((target != IGNORE_INDEX).sum())
            offset += d
    loss = total / count
    loss.backward()
    return loss.detach()


def reference(plan_name: str) -> dict:
    plan = PLANS[plan_name]
    batches = [make_rows(plan, counts, seed) for seed, counts in enumerate(ROW_COUNTS[plan_name])]
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loss = reference_step(model, batches[0])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    loss2 = reference_step(model, batches[1])
    optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": float(loss), "loss2": float(loss2), "grads": grads, "params": params}


# ----- ranks --------------------------------------------------------------------------------------------------


def _train(plan_name: str, runner_kwargs: dict) -> dict:
    from sp_plan.runtime.adaptive_sp import AdaptiveSPRunner

    plan = PLANS[plan_name]
    batches = [make_rows(plan, counts, seed) for seed, counts in enumerate(ROW_COUNTS[plan_name])]
    model = _model()
    runner = AdaptiveSPRunner(model, plan, **runner_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first = runner.step(batches[0])  # gradients kept for inspection
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    second = runner.step(batches[1], optimizer)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return {"loss": first.loss, "loss2": second.loss, "tokens": first.tokens, "local_rows": first.local_rows,
            "local_rows2": second.local_rows, "grads": grads, "params": params,
            "slots": [b.slot for b in runner.buckets], "seconds": first.seconds + second.seconds}


def _errors(plan_name: str) -> dict:
    from sp_plan.runtime.adaptive_sp import AdaptiveSPRunner
    from torch.distributed.fsdp import fully_shard

    plan = PLANS[plan_name]
    wrong_world = AdaptiveSPPlan(world=2, buckets=[LengthBucket(max_document_tokens=8, row_tokens=8, ulysses=2)])
    out = {
        "world": error_of(lambda: AdaptiveSPRunner(_model(), wrong_world)),
        "heads": error_of(lambda: AdaptiveSPRunner(_model(heads=3, kv_heads=1), plan)),
    }
    runner = AdaptiveSPRunner(_model(), plan)
    too_long = PackedRow(input_ids=tuple(range(plan.buckets[0].row_tokens + 2)), documents=(2, plan.buckets[0].row_tokens),
                         bucket=0)
    out["row"] = error_of(lambda: runner.step([too_long]))
    sharded = _model()
    fully_shard(sharded)
    out["fsdp"] = error_of(lambda: AdaptiveSPRunner(sharded, plan))
    return out


def _rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    results = {}
    for plan_name in sorted(PLANS):
        results[plan_name] = {case: _train(plan_name, kwargs) for case, kwargs in CASES[plan_name].items()}
        results[plan_name]["errors"] = _errors(plan_name)
    return results


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    """One 4-rank spawn runs every plan's cases and error cases."""
    return run_ranks(4, _rank, timeout=150)


@pytest.fixture(scope="module", params=sorted(PLANS))
def run(request, spawned):
    name = request.param
    return name, reference(name), [r[name] for r in spawned]


def _max_rel(got: dict[str, np.ndarray], want: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, ref in want.items():
        scale = max(float(ref.abs().max()), 1e-30)
        worst = max(worst, float(np.abs(got[name] - ref.numpy()).max()) / scale)
    return worst


@pytest.mark.multiproc
def test_adaptive_sp_trains_like_one_process(run):
    name, ref, ranks = run
    for case in CASES[name]:
        r0 = ranks[0][case]
        loss_diff = max(abs(r[case]["loss"] - ref["loss"]) for r in ranks)
        loss2_diff = max(abs(r[case]["loss2"] - ref["loss2"]) for r in ranks)
        grad_rel = max(_max_rel(r[case]["grads"], ref["grads"]) for r in ranks)
        param_diff = max(float(np.abs(r[case]["params"][n] - p.numpy()).max()) for r in ranks
                         for n, p in ref["params"].items())
        print(f"{name} {case}: |loss diff| {loss_diff:.2e} / {loss2_diff:.2e}, grad max rel diff {grad_rel:.2e}, "
              f"param max diff after 2 steps {param_diff:.2e}, {r0['seconds']:.2f} s on rank 0")
        assert loss_diff <= TOL * max(1.0, ref["loss"]) and loss2_diff <= TOL * max(1.0, ref["loss2"]), (case,)
        assert grad_rel <= TOL, (case, grad_rel)
        assert param_diff <= TOL, (case, param_diff)
        for r in ranks:  # every rank the same replica
            assert all(np.array_equal(r[case]["params"][n], r0["params"][n]) for n in r0["params"]), case


@pytest.mark.multiproc
def test_every_row_runs_once_on_its_groups(run):
    name, _, ranks = run
    plan = PLANS[name]
    for case in CASES[name]:
        for step, key in enumerate(("local_rows", "local_rows2")):
            counts = ROW_COUNTS[name][step]
            for b, bucket in enumerate(plan.buckets):
                # each group's ranks ran the same rows; summed over the groups: the bucket's rows
                per_slot: dict[int, set[int]] = {}
                for r in ranks:
                    per_slot.setdefault(r[case]["slots"][b], set()).add(r[case][key][b])
                assert all(len(v) == 1 for v in per_slot.values()), (case, b, per_slot)
                assert sum(v.pop() for v in per_slot.values()) == counts[b]
                assert len(per_slot) == bucket.data_parallel(plan.world)


@pytest.mark.multiproc
def test_refusals_are_one_line_and_on_every_rank(run):
    _, _, ranks = run
    errors = [r["errors"] for r in ranks]
    assert all(e == errors[0] for e in errors)
    e = errors[0]
    assert e["world"].startswith("RuntimeConfigError") and "plan is for 2 ranks but this job has 4" in e["world"]
    assert "ulysses=" in e["heads"] and "does not divide 3 query heads" in e["heads"]
    assert "bucket 0" in e["row"] and "more than the" in e["row"]
    assert "replicated parameters only" in e["fsdp"]
    assert all("\n" not in v for v in e.values())


# ----- pure parts ---------------------------------------------------------------------------------------------


def test_bucket_layout_follows_the_runtime_mesh_order():
    # dp, ring, ulysses (ulysses innermost): rank = slot * (R U) + ring_rank * U + ulysses_rank
    assert bucket_rank_sets(8, 2, 2) == ([(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (1, 3), (4, 6), (5, 7)])
    assert bucket_rank_sets(4, 4, 1) == ([(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)])
    assert bucket_rank_sets(4, 1, 1)[0] == [(0,), (1,), (2,), (3,)]
    coords = [bucket_coordinates(r, 2, 2) for r in range(8)]
    assert [(c.slot, c.ring_rank, c.ulysses_rank) for c in coords[4:]] == [(1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    with pytest.raises(RuntimeConfigError, match="does not divide the 6 ranks"):
        bucket_rank_sets(6, 4, 1)


def test_every_group_is_created_once_in_a_fixed_order():
    plan = AdaptiveSPPlan(world=4, buckets=[
        LengthBucket(max_document_tokens=8, row_tokens=8),
        LengthBucket(max_document_tokens=16, row_tokens=16, ulysses=2),
        LengthBucket(max_document_tokens=32, row_tokens=32, ulysses=2),  # same degrees: shares the groups
        LengthBucket(max_document_tokens=64, row_tokens=64, ulysses=2, ring=2)])
    assert group_creation_order(plan) == [(0, 1), (2, 3), (0, 2), (1, 3)]


def _row(docs, bucket=None):
    return PackedRow(input_ids=tuple(range(sum(docs))), documents=tuple(docs), bucket=bucket)


def test_rows_go_to_the_bucket_of_their_longest_document_and_are_balanced_by_attention_work():
    plan = PLANS["u2+u4"]
    rows = [_row([4] * 10), _row([16, 16, 8]), _row([2, 3]), _row([100, 20]), _row([1]), _row([12, 12, 12, 12]),
            _row([5, 40], bucket=1)]
    assert [bucket_of(plan, r) for r in rows] == [0, 0, 0, 1, 0, 0, 1]
    a = assign_rows(plan, rows)
    assert a == assign_rows(plan, rows)  # deterministic
    # bucket 0: work 100 (row 0), 308 (1), 9 (2), 1 (4), 312 (5); in decreasing work, each to the lighter group:
    # 5 -> 0, 1 -> 1, 0 -> 1 (308 < 312), 2 -> 0, 4 -> 0
    assert a.groups[0] == ((5, 2, 4), (1, 0)) and a.work[0] == (322, 408)
    assert a.groups[1] == ((3, 6),)
    assert sorted(i for g in a.groups for s in g for i in s) == list(range(len(rows)))


def test_row_errors_are_clear():
    plan = PLANS["u2+u4"]
    with pytest.raises(RuntimeConfigError, match=r"row 0 has 50 tokens, more than the 48-token rows of bucket 0"):
        assign_rows(plan, [_row([10] * 5)])
    with pytest.raises(RuntimeConfigError, match="names bucket 5 but the plan has 2"):
        assign_rows(plan, [_row([3], bucket=5)])
    with pytest.raises(RuntimeConfigError, match="document lengths summing to 4"):
        PackedRow(input_ids=(1, 2, 3), documents=(2, 2))
    with pytest.raises(RuntimeConfigError, match="no tokens"):
        PackedRow(input_ids=(), documents=())


def test_loss_tokens_and_stacked_rows_match_the_sharder_rule():
    rows = [_row([3, 1, 4]), PackedRow(input_ids=(5, 6, 7, 8), documents=(4,), labels=(-100, -100, 7, 8))]
    assert row_labels(rows[0]).tolist() == [[1, 2, IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7, IGNORE_INDEX]]
    assert loss_tokens(rows) == 5 + 2
    batch = rows_batch(rows)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 8, 12, 16]  # row 1's tail padding is its own document
    assert batch["labels"][1].tolist() == [-100, -100, 7, 8] + [IGNORE_INDEX] * 4


def test_heads_and_world_checks():
    plan = PLANS["u2+u4"]
    check_heads(plan, 4, 2)  # ulysses 4 > 2 KV heads: replicated
    with pytest.raises(RuntimeConfigError, match=r"bucket 1 .*ulysses=4 does not divide 6 query heads"):
        check_heads(plan, 6, 2)
    with pytest.raises(RuntimeConfigError, match="plan is for 4 ranks but this job has 8"):
        check_world(plan, 8)


def test_bucket_attention_forwards_to_the_active_context():
    class Fake:
        def __init__(self, tag):
            self.tag, self.size = tag, len(tag)

        def attention(self, q, k, v, causal=True, scale=None, cu_seqlens=None):
            return self.tag

    switch = BucketAttention(Fake("local"))
    assert switch.attention(None, None, None) == "local"
    with switch.use(Fake("bucket1")):
        assert switch.attention(None, None, None) == "bucket1" and switch.size == 7
    assert switch.attention(None, None, None) == "local"
    with pytest.raises(ValueError), switch.use(Fake("x")):
        raise ValueError
    assert switch.tag == "local"
