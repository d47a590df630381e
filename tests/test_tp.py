"""Tensor parallelism on gloo: equivalence with the unparallelised model, comm bytes vs the comm model,
FSDP2 on top.

- tp=2 (2 ranks) and tp=2 x ulysses=2 (4 ranks), fp32: logits (this rank's sequence shard and vocabulary
  columns), loss (plain vocab-parallel and tiled), and every parameter gradient (this rank's shard of
  the reference gradient, after the replicated-parameter sync), for Megatron sequence parallelism on
  and off, GQA with KV heads split and MQA with KV heads replicated, tied and untied embeddings, each
  checkpointing mode, and the tiled MLP on top of the row-parallel down projection;
- the bytes every collective sends (CommCounter) against ``sp_plan.cost_models.comm_volume``'s TP, Ulysses and
  embedding/LM-head/cross-entropy ops, term by term (phase x collective);
- dp_shard=2 x tp=2 (4 ranks): FSDP2 (``sp_plan.runtime.fsdp.apply_fsdp``) over TP-sharded parameters, three
  AdamW steps against the single-process model trained on the same global batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

HIDDEN, HEAD_DIM, HEADS, FFN, VOCAB, LAYERS, SEQ = 32, 8, 4, 90, 101, 2, 16
CHUNK = 5  # tiled-loss chunk: no chunk is fully ignored below, so its all-reduces cover every token


def _spec(kv: int = 2, tied: bool = False):
    from sp_plan.cost_models import ModelSpec

    return ModelSpec(name="tiny", num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=kv,
                     head_dim=HEAD_DIM, ffn_hidden_size=FFN, vocab_size=VOCAB, tied_embeddings=tied)


# (sequence_parallel, kv heads, tied, checkpointing, tiled loss, tiled MLP)
CASES_TP2 = [
    (True, 2, False, "none", False, False),
    (False, 2, True, "full", True, False),
    (True, 1, False, "selective", True, True),
    (False, 1, True, "selective", False, True),
]
CASES_TP2_ULYSSES2 = [
    (True, 2, False, "selective", True, False),
    (False, 1, True, "none", False, True),
    (True, 1, True, "full", False, False),
]


def _equivalence_case(mesh, sp, case) -> dict:
    import torch.distributed as dist

    from sp_plan.runtime.comm_counter import CommCounter
    from sp_plan.runtime.models import LlamaModel
    from sp_plan.runtime.tiled_loss import causal_lm_loss
    from sp_plan.runtime.tiled_mlp import apply_tiled_mlp
    from sp_plan.runtime.tp import apply_tensor_parallel

    sequence_parallel, kv, tied, mode, tiled_loss, tiled_mlp = case
    spec = _spec(kv, tied)
    reference = LlamaModel(spec, checkpointing=mode)
    reference.init_weights(generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    labels[0, :3] = -100
    ref_logits = reference(ids)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.view(-1, VOCAB), labels.view(-1), reduction="sum")
    count = int((labels != -100).sum())
    (ref_loss / count).backward()

    model = LlamaModel(spec, checkpointing=mode, attention_fn=sp.attention)
    model.load_state_dict(reference.state_dict())
    tp = apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    if tiled_mlp:
        apply_tiled_mlp(model, tile_tokens=3)
    local_ids, local_labels, pos = sp.shard(ids, dim=1), sp.shard(labels, dim=1), sp.positions(SEQ)[None]
    with CommCounter() as comm:
        loss, local_count = causal_lm_loss(model, local_ids, local_labels, pos, tiled=tiled_loss, chunk_tokens=CHUNK)
        (loss / count).backward()
        sync_bytes = tp.sync_replicated_grads()
    logits = model(local_ids, pos).detach()  # outside the counter: a second forward for the logits check
    expected_logits = sp.shard(ref_logits.detach(), dim=1)[..., tp.vocab_start : tp.vocab_end]
    totals = torch.stack([loss.detach(), local_count.float()])
    if sp.size > 1:  # SP ranks hold different tokens: sum the loss and sum the gradients of shared weights
        dist.all_reduce(totals, group=mesh.group("sp"))
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.group("sp"))
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        ref = dict(reference.named_parameters())[name].grad
        cut = tp.local_slice(name)
        if cut is not None:
            ref = ref.narrow(cut[0], cut[1], cut[2] - cut[1])
        assert p.grad.shape == ref.shape, name
        err = ((p.grad - ref).abs().max() / ref.abs().max()).item()
        if err > worst:
            worst, worst_name = err, name
    return {
        "logits_max_abs_err": (logits - expected_logits).abs().max().item(),
        "loss_rel_err": abs(totals[0].item() - ref_loss.item()) / ref_loss.item(),
        "count": int(totals[1].item()),
        "grad_max_rel_err": (worst, worst_name),
        "comm": {p: {c: b for c, b in d.items() if b} for p, d in comm.as_dict().items()},
        "sync_bytes": sync_bytes,
        "local_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
    }


def _equivalence_rank(rank: int, world: int, ulysses: int, cases) -> list[dict]:
    from sp_plan.cost_models import Layout
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import build_mesh

    mesh = build_mesh(Layout(tp=world // ulysses, ulysses=ulysses), device_type="cpu")
    sp = SequenceParallel.from_mesh(mesh)
    results = [_equivalence_case(mesh, sp, case) for case in cases]
    if ulysses == 1:  # refusals that need a real TP group
        from sp_plan.runtime.errors import RuntimeConfigError
        from sp_plan.runtime.models import LlamaModel
        from sp_plan.runtime.tp import apply_tensor_parallel

        from sp_plan.runtime.tp import gather_seq, scatter_seq

        checks = {}
        try:
            apply_tensor_parallel(LlamaModel(_spec().model_copy(update={"hidden_dropout": 0.1})), mesh)
        except RuntimeConfigError as exc:
            checks["dropout_error"] = str(exc)
        # Batch > 1 takes the transposing path of the sequence collectives.
        shards = [torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        gathered = gather_seq(shards[rank], mesh.group("tp"))
        checks["gather_ok"] = torch.equal(gathered, torch.cat(shards, dim=1)) and gathered.is_contiguous()
        checks["scatter_ok"] = torch.allclose(scatter_seq(gathered, mesh.group("tp")), world * shards[rank])
        results.append(checks)
    return results


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(2, _equivalence_rank, 1, CASES_TP2)


@pytest.fixture(scope="module")
def tp2_ulysses2():
    return run_ranks(4, _equivalence_rank, 2, CASES_TP2_ULYSSES2)


def _check_equivalence(results, cases):
    for r in results:
        for case, out in zip(cases, r):
            assert out["logits_max_abs_err"] < 1e-5, case
            assert out["loss_rel_err"] < 1e-6, case
            assert out["count"] == SEQ - 3, case
            assert out["grad_max_rel_err"][0] < 1e-5, (case, out["grad_max_rel_err"])


def test_tp2_matches_the_unparallelised_model(tp2):
    _check_equivalence(tp2, CASES_TP2)


def test_tp2_ulysses2_matches_the_unparallelised_model(tp2_ulysses2):
    _check_equivalence(tp2_ulysses2, CASES_TP2_ULYSSES2)


def test_tp_refusals_and_batched_sequence_collectives(tp2):
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.tp import _check_tp

    assert "RNG tracker" in tp2[0][-1]["dropout_error"]
    assert all(r[-1]["gather_ok"] and r[-1]["scatter_ok"] for r in tp2)
    assert _check_tp(_spec(kv=2), 4) == 2  # KV heads replicated 2x
    with pytest.raises(RuntimeConfigError, match="does not divide 4 query heads"):
        _check_tp(_spec(), 3)
    with pytest.raises(RuntimeConfigError, match="neither divides nor is a multiple of 2 KV heads"):
        _check_tp(_spec(kv=2).model_copy(update={"num_heads": 6}), 3)


def test_parameters_are_sharded_as_megatron_does(tp2):
    shapes = tp2[0][0]["local_shapes"]  # GQA, 2 KV heads split 1 per rank
    hd = HEAD_DIM
    assert shapes["layers.0.attn.q_proj.weight"] == (HEADS // 2 * hd, HIDDEN)
    assert shapes["layers.0.attn.k_proj.weight"] == (1 * hd, HIDDEN)
    assert shapes["layers.0.attn.o_proj.weight"] == (HIDDEN, HEADS // 2 * hd)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (FFN // 2, HIDDEN)
    assert shapes["layers.0.mlp.down_proj.weight"] == (HIDDEN, FFN // 2)
    assert shapes["embed_tokens.weight"] in {(51, HIDDEN), (50, HIDDEN)}  # 101 rows split 51 + 50
    assert shapes["layers.0.input_norm.weight"] == (HIDDEN,)
    assert [r[0]["local_shapes"]["lm_head.weight"][0] for r in tp2] == [51, 50]
    mqa = tp2[0][2]["local_shapes"]  # 1 KV head: replicated on both ranks
    assert mqa["layers.0.attn.k_proj.weight"] == (hd, HIDDEN)


def _expected_comm(case, tp: int, ulysses: int) -> dict[str, dict[str, float]]:
    """What sp_plan.cost_models.comm_volume predicts this rank sends, by phase and collective (TP, Ulysses and the
    embedding/LM head/cross-entropy ops; the sync of replicated gradients counts as backward)."""
    from sp_plan.cost_models import Layout, TrainSpec
    from sp_plan.cost_models.collectives import bytes_sent
    from sp_plan.cost_models.comm_volume import comm_ops
    from sp_plan.cost_models.strategies.terms import issued
    from sp_plan.runtime.validate_pipeline import RUNTIME_TRAFFIC

    sequence_parallel, kv, tied, mode, _, _ = case
    spec = _spec(kv, tied)
    train = TrainSpec(seq_len=SEQ, micro_batch=1, dtype="fp32", checkpointing=mode, zero_stage=0,
                      tp_sequence_parallel=sequence_parallel)
    layout = Layout(tp=tp, ulysses=ulysses)
    expected: dict[str, dict[str, float]] = {}
    for op in comm_ops(spec, train, layout):
        if op.strategy not in ("tp", "ulysses", "embedding") or not issued(op, RUNTIME_TRAFFIC):
            continue  # (this runtime saves the gathered TP input: it issues no backward re-gather)
        group = {"tp": tp, "ulysses": ulysses}[op.group]
        count = op.count
        sent = bytes_sent(op.collective, op.nbytes, group) * count * (LAYERS if op.scope == "layer" else 1)
        phase = "recompute" if op.recompute else "forward" if op.phase == "forward" else "backward"
        expected.setdefault(phase, {})
        expected[phase][op.collective] = expected[phase].get(op.collective, 0) + sent
    return expected


@pytest.mark.parametrize("which", ["tp2", "tp2_ulysses2"])
def test_tp_comm_bytes_match_the_comm_model(which, request):
    results = request.getfixturevalue(which)
    cases, ulysses = (CASES_TP2, 1) if which == "tp2" else (CASES_TP2_ULYSSES2, 2)
    tp = len(results) // ulysses
    for r in results:
        for case, out in zip(cases, r):
            expected = _expected_comm(case, tp, ulysses)
            measured = {p: d for p, d in out["comm"].items() if d}
            assert set(measured) == set(expected), case
            for phase in expected:
                assert measured[phase] == pytest.approx(expected[phase]), (case, phase)


# ----- FSDP2 on top of TP --------------------------------------------------------------------------------


STEPS, LR = 3, 1e-2


def _fsdp_tp_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from sp_plan.cost_models import Layout, TrainSpec
    from sp_plan.runtime.fsdp import apply_fsdp
    from sp_plan.runtime.mesh import build_mesh
    from sp_plan.runtime.models import LlamaModel
    from sp_plan.runtime.tiled_loss import causal_lm_loss
    from sp_plan.runtime.tp import apply_tensor_parallel

    spec = _spec(kv=2)
    mesh = build_mesh(Layout(dp_shard=2, tp=2), device_type="cpu")
    reference = LlamaModel(spec)
    reference.init_weights(generator=torch.Generator().manual_seed(0))
    model = LlamaModel(spec)
    model.load_state_dict(reference.state_dict())
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (STEPS, 2, SEQ), generator=gen)  # per step, one sample per dp rank
    labels = torch.randint(0, VOCAB, (STEPS, 2, SEQ), generator=gen)

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(STEPS):
        logits = reference(ids[step])
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels[step].view(-1))  # global mean
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    tp = apply_tensor_parallel(model, mesh)
    apply_fsdp(model, TrainSpec(seq_len=SEQ, dtype="fp32", zero_stage=3), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dp = mesh.local_rank("dp_shard")
    losses = []
    for step in range(STEPS):
        loss_sum, count = causal_lm_loss(model, ids[step, dp : dp + 1], labels[step, dp : dp + 1])
        (loss_sum / count).backward()  # FSDP2 averages over the 2 dp ranks: equal counts give the global mean
        tp.sync_replicated_grads()
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum.item() / count.item())
    worst = 0.0
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        local = p.full_tensor() if hasattr(p, "full_tensor") else p  # gather the FSDP shards: this TP shard
        ref = ref_params[name].detach()
        cut = tp.local_slice(name)
        if cut is not None:
            ref = ref.narrow(cut[0], cut[1], cut[2] - cut[1])
        worst = max(worst, ((local - ref).abs().max() / ref.abs().max()).item())
    dist.barrier()
    return {"param_max_rel_err": worst, "losses": losses,
            "sharded": all(hasattr(p, "to_local") for p in model.parameters())}


def test_fsdp2_over_tp_trains_like_the_unparallelised_model():
    results = run_ranks(4, _fsdp_tp_rank)
    for r in results:
        assert r["sharded"]
        assert r["param_max_rel_err"] < 1e-4, r
