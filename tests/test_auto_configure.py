"""auto_configure on 2 gloo ranks: every rank learns rank 0's errors (no hang), ranks holding different plans
or a plan the runtime cannot run are refused, and packed documents (restarting position ids) train with
the positions they were given: document-masked by default, across documents with the opt-in."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import error_of, run_ranks

pytestmark = pytest.mark.multiproc


def _spec():
    from sp_plan.cost_models import ModelSpec

    return ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=64)


def _model():
    from sp_plan.runtime.models import LlamaModel

    model = LlamaModel(_spec())
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


def _plan(seq_len: int, **train):
    from sp_plan.cost_models import Layout, TrainSpec
    from sp_plan.planner.plan import Hardware, Plan

    return Plan(model=_spec(), train=TrainSpec(seq_len=seq_len, dtype="fp32", **train), layout=Layout(ulysses=2),
                hardware=Hardware(num_gpus=2, gpus_per_node=2, gpu="h100-80gb", topology="dgx-h100"))


def _packed_reference(ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> float:
    """Single process: causal attention over the whole row (or within each document of ``cu_seqlens``),
    RoPE with the per-document positions, no label across a document boundary."""
    import torch.nn.functional as F

    labels = ids[:, 1:].clone()
    labels[positions[:, 1:] == 0] = -100
    logits = _model()(ids, positions, cu_seqlens)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), ignore_index=-100).item()


def _rank(rank: int, world: int) -> dict:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    out = {}
    out["bad_topology"] = error_of(lambda: auto_configure(_model(), seq_len=64, topology="no-such-topology"))
    out["different_plans"] = error_of(lambda: auto_configure(_model(), plan=_plan(64 if rank == 0 else 128)))
    out["unsupported"] = error_of(lambda: auto_configure(_model(), plan=_plan(64, zero_stage=0)))
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)]).view(1, 64)
    batch = {"input_ids": ids, "position_ids": positions}
    setup = auto_configure(_model(), plan=_plan(64))
    out["masked_loss"] = train_step(setup, [batch]).loss
    out["masked_reference"] = _packed_reference(ids, positions, torch.tensor([0, 20, 50, 64]))
    setup = auto_configure(_model(), plan=_plan(64), cross_document_attention=True)
    out["packed_loss"] = train_step(setup, [batch]).loss
    out["packed_reference"] = _packed_reference(ids, positions)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _rank, timeout=120)


def test_rank_zero_errors_reach_every_rank(results):
    for r in results:
        assert "rank 0 could not make a plan" in r["bad_topology"] and "no-such-topology" in r["bad_topology"]


def test_ranks_with_different_plans_are_refused(results):
    for r in results:
        assert "hold a different plan" in r["different_plans"]


def test_plans_the_runtime_cannot_run_are_refused_on_every_rank(results):
    for r in results:
        assert "RuntimeConfigError" in r["unsupported"] and "zero_stage=0" in r["unsupported"]


def test_packed_documents_are_masked_by_default_and_attend_across_with_the_opt_in(results):
    for r in results:
        assert r["masked_loss"] == pytest.approx(r["masked_reference"], abs=1e-5)
        assert r["packed_loss"] == pytest.approx(r["packed_reference"], abs=1e-5)
