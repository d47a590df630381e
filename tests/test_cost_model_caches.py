"""The cost model's memo tables are keyed on the TrainSpec fields each computation reads; these tests
prove the key lists complete (any other field leaves the uncached result unchanged), so the planner's
shared results can never leak between option combinations that differ where it matters."""

import dataclasses

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.comm_volume import comm_ops
from sp_plan.cost_models.data_balance import DataShape
from sp_plan.cost_models.compute_time import COMPUTE_FIELDS, _compute
from sp_plan.cost_models.flops import WORK_FIELDS, _work
from sp_plan.cost_models.profile import default_profile
from sp_plan.cost_models.memory import MemoryAssumptions, host_memory, memory_core
from sp_plan.cost_models.memory.dims import DIMS_FIELDS, _local_dims
from sp_plan.cost_models.memory.report import ALLOCATED_COMPONENTS
from sp_plan.cost_models.memory.states import STATES_FIELDS, _model_states
from sp_plan.cost_models.memory.timeline import _Phase
from sp_plan.cost_models.time_model import COMM_FIELDS, OffloadTraffic, step_time, time_estimate
from sp_plan.cost_models.topology import default_topology

MODELS = [get_model_preset("llama3-8b"), get_model_preset("qwen3-4b")]
LAYOUTS = [Layout.for_world(8, ulysses=2, ring=2, tp=2), Layout.for_world(16, dp_replicate=2, ulysses=4, ring=2)]

#: For every TrainSpec field, values to switch between (each must be valid with the base below).
ALTERNATIVES = {
    "seq_len": (16384, 32768),
    "micro_batch": (1, 2),
    "grad_accum": (1, 4),
    "dtype": ("bf16", "fp32"),
    "mode": ("train", "prefill"),
    "optimizer": ("adamw", "adamw_bf16"),
    "zero_stage": (2, 3),
    "offload_optimizer": (False, True),
    "offload_params": (False, True),
    "offload_checkpoints": (False, True),
    "checkpointing": ("full", "selective", "none"),
    "tiled_mlp": (False, True),
    "tiled_loss": (False, True),
    "attention_kernel": ("flash", "materialized"),
    "tp_sequence_parallel": (True, False),
    "document_length": (None, 4096),
    "data": (None, DataShape(bins=((700, 400), (16384, 3)), sharding="zigzag")),
    "fp8_linears": (False, True),
    "compiled": (False, True),
    "pipeline_schedule": ("1f1b", "zero_bubble"),
    "virtual_stages": (1, 2),
    "stage_layers": (None, (16,)),
}


def test_every_train_field_has_alternatives():
    assert set(ALTERNATIVES) == set(TrainSpec.model_fields)


def variants(field: str):
    """TrainSpecs differing from a base only in ``field`` (skipping combinations TrainSpec rejects)."""
    base = dict(seq_len=16384, zero_stage=3, checkpointing="full")
    out = []
    for value in ALTERNATIVES[field]:
        spec = {**base, field: value}
        if field == "mode" and value == "prefill":
            spec.update(zero_stage=3, grad_accum=1)
        try:
            out.append(TrainSpec(**spec))
        except ValueError:
            continue
    return out


def unkeyed(keyed: tuple[str, ...]) -> list[str]:
    return [f for f in TrainSpec.model_fields if f not in keyed]


def ops_signature(model, train, layout):
    return [dataclasses.astuple(op) if dataclasses.is_dataclass(op) else op for op in comm_ops(model, train, layout)]


@pytest.mark.parametrize("field", unkeyed(COMM_FIELDS))
def test_collectives_ignore_fields_outside_their_key(field):
    for model in MODELS:
        for layout in LAYOUTS:
            results = [ops_signature(model, t, layout) for t in variants(field)]
            assert all(r == results[0] for r in results), (field, model.name, layout.describe())


@pytest.mark.parametrize("field", unkeyed(WORK_FIELDS))
def test_flops_ignore_fields_outside_their_key(field):
    for model in MODELS:
        for layout in LAYOUTS:
            results = [_work(model, layout.tp, layout.ulysses, layout.ring, t) for t in variants(field)]
            assert all(r == results[0] for r in results), (field, model.name)


@pytest.mark.parametrize("field", unkeyed(COMPUTE_FIELDS))
def test_compute_time_ignores_fields_outside_its_key(field):
    topology = default_topology("h100-80gb", 16, 8)
    profile = default_profile("h100-80gb")
    for model in MODELS:
        for layout in LAYOUTS:
            results = [_compute(model, t, layout, topology, profile) for t in variants(field)]
            assert all(r == results[0] for r in results), (field, model.name)


@pytest.mark.parametrize("field", unkeyed(DIMS_FIELDS))
def test_local_dims_ignore_fields_outside_their_key(field):
    for model in MODELS:
        for layout in LAYOUTS:
            results = [_local_dims(model, t, layout) for t in variants(field)]
            assert all(r == results[0] for r in results), (field, model.name)


@pytest.mark.parametrize("field", unkeyed(STATES_FIELDS))
def test_model_states_ignore_fields_outside_their_key(field):
    a = MemoryAssumptions()
    for model in MODELS:
        for layout in LAYOUTS:
            results = [_model_states(model, t, layout, a) for t in variants(field)]
            assert all(r == results[0] for r in results), (field, model.name)


@pytest.mark.parametrize("field", list(ALTERNATIVES))
def test_cached_and_fresh_estimates_agree(field):
    """Whatever was cached before, a result equals the one computed with every cache cleared."""
    from sp_plan.cost_models import compute_time, flops, time_model
    from sp_plan.cost_models.memory import dims, states

    topology = default_topology("h100-80gb", 16, 8)
    model, layout = MODELS[0], Layout.for_world(16, dp_replicate=2, dp_shard=2, ulysses=2, tp=2)  # no ring:
    for train in variants(field):  # materialized attention is one of the variants
        warm = (time_estimate(model, train, layout, topology), memory_core(model, train, layout).total)
        for memo in (flops._WORK, compute_time._COMPUTE, time_model._PROFILES, dims._DIMS, states._STATES):
            memo.clear()
        cold = (time_estimate(model, train, layout, topology), memory_core(model, train, layout).total)
        assert warm == cold


def test_phase_total_spells_out_every_component():
    phase = _Phase("p", **{name: 1 << i for i, name in enumerate(
        ["weights", "gradients", "optimizer", "activations", "logits", "kv_cache", "comm_staging",
         "zero3_gathered_params", "unsharded_grads"])})
    assert phase.allocated == sum(getattr(phase, c) for c in ALLOCATED_COMPONENTS)


@pytest.mark.parametrize("options", [
    dict(offload_optimizer=True),
    dict(offload_params=True, offload_optimizer=True, zero_stage=3),
    dict(offload_checkpoints=True, checkpointing="selective"),
    dict(),
])
def test_host_memory_matches_the_full_memory_model(options):
    train = TrainSpec(seq_len=32768, **options)
    for model in MODELS:
        for layout in LAYOUTS:
            assert host_memory(model, train, layout) == memory_core(model, train, layout).host


def test_step_time_is_the_time_estimate():
    topology = default_topology("h100-80gb", 16, 8)
    train = TrainSpec(seq_len=65536, grad_accum=4, offload_optimizer=True)
    offload = OffloadTraffic(optimizer_bytes=1e9)
    fast = step_time(MODELS[0], train, LAYOUTS[1], topology, offload)
    full = time_estimate(MODELS[0], train, LAYOUTS[1], topology, offload)
    assert fast.estimate() == full
    assert (fast.step_s, fast.tokens_per_step) == (full.step_s, full.tokens_per_step)


def test_bf16_optimizer_halves_fsdp_gradient_time():
    """adamw_bf16 reduces gradients in bf16, not fp32: the time model must see the smaller traffic."""
    topology = default_topology("h100-80gb", 16, 8)
    layout = Layout.for_world(16, dp_shard=16)
    by_opt = {}
    for optimizer in ("adamw", "adamw_bf16"):
        train = TrainSpec(seq_len=8192, zero_stage=3, optimizer=optimizer)
        by_opt[optimizer] = time_estimate(MODELS[0], train, layout, topology).comm_s_by_strategy["fsdp"]
    assert by_opt["adamw_bf16"] < by_opt["adamw"]
