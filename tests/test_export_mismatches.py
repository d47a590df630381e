"""Exports that used to run something other than the plan without saying so (issue #35, item 10)."""

import inspect

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.planner.export import to_accelerate, to_deepspeed
from sp_plan.planner.plan import Hardware, Plan


def _plan(gpus=8, train=None, **degrees):
    return Plan(model=get_model_preset("llama3-8b"),
                train=train or TrainSpec(seq_len=131072, zero_stage=3, micro_batch=1, grad_accum=2),
                layout=Layout.for_world(gpus, **degrees),
                hardware=Hardware(num_gpus=gpus, gpus_per_node=min(gpus, 8), gpu="h100-80gb", topology="hgx-h100"))


def test_accelerate_ring_notes_say_what_to_wrap_in_maybe_context_parallel():
    exported = to_accelerate(_plan(ring=2, dp_shard=4))
    assert exported.content["parallelism_config"]["parallelism_config_cp_size"] == 2
    (note,) = [n for n in exported.notes if "maybe_context_parallel" in n]
    for word in ("buffers=[input_ids, shift_labels, position_ids]", "buffer_seq_dims=[1, 1, 1]",
                 "no_restore_buffers=", "shift_labels", "attention_mask", "65536 of the 131072 tokens"):
        assert word in note, word
    assert "\n" not in note


def test_accelerate_cp_note_matches_the_real_maybe_context_parallel_signature():
    accelerate = pytest.importorskip("accelerate")
    params = inspect.signature(accelerate.Accelerator.maybe_context_parallel).parameters
    assert {"buffers", "buffer_seq_dims", "no_restore_buffers"} <= set(params)
    (note,) = [n for n in to_accelerate(_plan(ring=2, dp_shard=4)).notes if "maybe_context_parallel" in n]
    for name in ("buffers", "buffer_seq_dims", "no_restore_buffers"):
        assert f"{name}=" in note


def test_deepspeed_tp_notes_give_the_autotp_rule_and_the_real_global_batch():
    plan = _plan(gpus=2, tp=2, train=TrainSpec(seq_len=8192, zero_stage=3, micro_batch=1, grad_accum=2))
    exported = to_deepspeed(plan)
    assert exported.content["tensor_parallel"] == {"autotp_size": 2}
    assert "train_batch_size" not in exported.content  # DeepSpeedConfig refuses anything but micro x GA x world
    (note,) = [n for n in exported.notes if n.startswith("AutoTP")]
    assert "must read identical rows" in note and "rank // 2" in note
    assert "train_batch_size = 1 x 2 x 2 = 4" in note and "real global batch is 2 distinct sequences" in note
    (batch,) = [n for n in exported.notes if n.startswith("global batch")]
    assert batch.startswith("global batch: 2 sequences")
