"""A layout's stage split does not move with memory options (recompute, tiling): if it did, turning an option on
could shift a layer onto the stage that holds the most memory, and memory would rise one step "up" the planner's
option lattice, which its floors and closures assume never happens."""

from __future__ import annotations

import itertools

from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory import memory_core
from sp_plan.cost_models.pipeline import stage_layers
from sp_plan.cost_models.stack import load_stack

SCHEDULE = {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2, "micro_batch": 1, "grad_accum": 8}


def test_split_is_the_same_for_every_memory_option():
    model = get_model_preset("llama3-8b")
    layout = Layout(pp=2, tp=4)
    splits = set()
    for ckpt, tiled_loss, tiled_mlp in itertools.product(("none", "selective", "full"), (False, True), (False, True)):
        train = TrainSpec(seq_len=65536, checkpointing=ckpt, tiled_loss=tiled_loss, tiled_mlp=tiled_mlp, **SCHEDULE)
        splits.add(stage_layers(model, train, layout))
    assert len(splits) == 1, splits


def test_tiled_loss_never_raises_the_pipelined_peak():
    # Was 80.35 GB without the tiled loss and 83.30 GB with it: the tiled loss's logits recompute moved a layer to
    # the first stage (17 + 15), whose 2.5 micro-batches in flight then set the peak.
    model = get_model_preset("llama3-8b")
    layout = Layout(pp=2, tp=4)
    memory = load_stack("sp-plan").memory
    base = dict(seq_len=65536, zero_stage=2, checkpointing="none", tiled_mlp=True, offload_optimizer=True, **SCHEDULE)
    off = memory_core(model, TrainSpec(**base), layout, memory).total
    on = memory_core(model, TrainSpec(**base, tiled_loss=True), layout, memory).total
    assert on <= off
