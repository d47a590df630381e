"""Float8 casts of a MoE layer (issue 20's MoE cost model): the amax + cast passes run over the GEMMs that
run, i.e. the routed experts' grouped GEMMs on this rank's dispatched rows (top_k x the tokens of the ep
group, at the expert width, with the local experts' weights) and the shared experts, not a dense MLP of
``ffn_hidden_size`` that an all-MoE stack never runs."""

from __future__ import annotations

import pytest
from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.compute_time import compute_time
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.topology import default_topology

QWEN = get_model_preset("qwen3-30b-a3b")  # 48 MoE layers, no dense MLP layer
TOPOLOGY = default_topology("h100-80gb", 8)
PROFILE = resolve_profile("h100-80gb", "megatron")
TRAIN = TrainSpec(seq_len=4096, zero_stage=1, fp8_linears=True)


def _casts(model, layout=Layout(dp_shard=8, ep=8), train=TRAIN) -> float:
    return compute_time(model, train, layout, TOPOLOGY, PROFILE).parts["fp8_casts"]


def _with_moe(**kw):
    return QWEN.model_copy(update={"moe": QWEN.moe.model_copy(update=kw)})


def test_all_moe_casts_ignore_the_unused_dense_width():
    wider = QWEN.model_copy(update={"ffn_hidden_size": 2 * QWEN.ffn_hidden_size})
    assert _casts(wider) == pytest.approx(_casts(QWEN))


def test_casts_follow_the_routed_rows_and_the_expert_width():
    base = _casts(QWEN)
    assert _casts(_with_moe(top_k=4)) < base < _casts(_with_moe(top_k=16))
    assert _casts(_with_moe(expert_ffn_hidden_size=1536)) > base
    # Every rank casts its own share of the experts' weights: fewer experts per rank, fewer elements.
    assert _casts(QWEN, Layout(dp_shard=8, ep=2)) > _casts(QWEN, Layout(dp_shard=8, ep=8))


def test_no_casts_without_fp8():
    assert _casts(QWEN, train=TRAIN.model_copy(update={"fp8_linears": False})) == 0.0
