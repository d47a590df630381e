"""Memo tables added for the planner's speed are keyed on exactly what they read: the stage split's LM-head
weight (pipeline.head_layer_equivalents) and a rank's communicators (memory.overhead.communicators) equal
their uncached values whatever else differs, and the local shapes' cached hash keeps equal shapes equal."""

import dataclasses
import pickle

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.flops import WORK_FIELDS
from sp_plan.cost_models.memory import MemoryAssumptions
from sp_plan.cost_models.memory.dims import local_dims
from sp_plan.cost_models.memory.overhead import _communicators, communicators
from sp_plan.cost_models.pipeline import _SPLIT_IGNORES, _head_layer_equivalents, head_layer_equivalents

from tests.test_cost_model_caches import MODELS, unkeyed, variants

#: What the stage split's head weight reads of a training run (the options it ignores are not read).
HEAD_FIELDS = tuple(f for f in WORK_FIELDS if f not in _SPLIT_IGNORES)
PIPELINED = [Layout.for_world(16, pp=2, ulysses=2, tp=2), Layout.for_world(16, pp=4, dp_shard=2, ring=2)]


@pytest.mark.parametrize("field", unkeyed(HEAD_FIELDS))
def test_the_head_weight_ignores_fields_outside_its_key(field):
    for model in MODELS:
        for layout in PIPELINED:
            trains = [t for t in variants(field) if t.is_training]
            results = [_head_layer_equivalents(model, t, layout) for t in trains]
            assert all(r == results[0] for r in results), (field, model.name, layout.describe())
            assert [head_layer_equivalents(model, t, layout) for t in trains] == results


def test_the_head_weight_reads_only_the_degrees_that_shape_a_rank():
    """Layouts with the same tp, ulysses and ring share the value (their pipeline and data degrees differ)."""
    model, train = MODELS[0], TrainSpec(seq_len=16384, checkpointing="full", tiled_loss=True)
    same = [Layout.for_world(32, pp=2, ulysses=2, tp=2), Layout.for_world(32, pp=4, ulysses=2, tp=2),
            Layout.for_world(32, pp=2, dp_replicate=2, ulysses=2, tp=2)]
    fresh = {_head_layer_equivalents(model, train, layout) for layout in same}
    assert len(fresh) == 1
    assert {head_layer_equivalents(model, train, layout) for layout in same} == fresh


@pytest.mark.parametrize("groups", ["mesh", "purposes"])
def test_communicators_equal_their_uncached_value(groups):
    a = MemoryAssumptions(nccl_groups=groups)
    layouts = [Layout.for_world(16, dp_replicate=2, ulysses=4, ring=2), Layout.for_world(16, dp_shard=2, tp=8),
               Layout.for_world(8, ulysses=8)]
    for layout in layouts:
        for zero in (0, 1, 2, 3):
            assert communicators(layout, a, zero) == _communicators(layout, a, zero), (layout.describe(), zero)


def test_local_dims_hash_like_their_fields():
    model = get_model_preset("llama3-8b")
    d = local_dims(model, TrainSpec(seq_len=32768), Layout.for_world(8, ulysses=2, tp=2))
    for twin in (dataclasses.replace(d), pickle.loads(pickle.dumps(d))):
        assert twin == d and hash(twin) == hash(d)
    other = dataclasses.replace(d, tokens=d.tokens * 2)
    assert other != d
    assert hash(d) == hash(tuple(getattr(d, f.name) for f in dataclasses.fields(d)))
