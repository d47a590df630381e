"""A checkpoint offload that keeps the saved activations instead of recomputing them (torch's save_on_cpu;
the hf-fsdp2 stack, ``checkpoint_offload_recomputes: false``): the search stays exact although turning the
offload on can make a step faster, and host memory holds what the time model moves over PCIe."""

from __future__ import annotations

import pathlib

import pytest
from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory import host_memory, memory_core
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.stack import load_stack
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.search import PlanSettings, _Searcher, search

from tests.search_checks import assert_search_equals_brute_force

STACK = "hf-fsdp2"


def _flash_fsdp2(tmp_path) -> str:
    """hf-fsdp2 as torch <= 2.10 runs it (flash attention on H100 too): a stack file of one's own."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "cost_models" / "data" / "stacks" / f"{STACK}.yaml").read_text()
    path = tmp_path / "hf-fsdp2-flash.yaml"
    path.write_text(text.replace("attention_kernel_by_gpu: {h100: cudnn, b200: cudnn}", "attention_kernel_by_gpu: {}"))
    return str(path)


@pytest.mark.parametrize("name", ["qwen3-4b", "llama3-8b"])
def test_search_equals_brute_force_where_offload_is_faster_than_recompute(name, tmp_path):
    # At 256K on 4 H100s with flash attention (hf-fsdp2 under torch <= 2.10; current torch's cuDNN attention
    # makes recomputing the cheaper), keeping and offloading beats recomputing; the search's walk and branch
    # bounds, which assumed time never shrinks up the lattice, returned a plan ~1% slower than brute force.
    model = get_model_preset(name)
    result = assert_search_equals_brute_force(model, TrainSpec(seq_len=262144), default_topology("h100-80gb", 4, 4),
                                              PlanSettings(stack=_flash_fsdp2(tmp_path)))
    assert result.plans[0].train.offload_checkpoints  # the case exercises the offload branch


def test_offload_branches_fix_tiling_and_search_selective_as_full():
    model = get_model_preset("qwen3-4b")
    s = _Searcher(model, TrainSpec(seq_len=65536), default_topology("h100-80gb", 4, 4), PlanSettings(stack=STACK), None)
    branches = s.lattices(Layout(dp_shard=2, ulysses=2))
    offloading = [b for b in branches if b.values(b.bottom)["offload_checkpoints"]]
    plain = [b for b in branches if not b.values(b.bottom)["offload_checkpoints"]]
    assert plain and offloading
    for b in offloading:
        axes = {a.name: a.values for a in b.axes}
        assert "selective" not in axes["checkpointing"]
        assert len(axes["tiled_mlp"]) == 1 and len(axes["tiled_loss"]) == 1
    for b in plain:
        assert {a.name: a.values for a in b.axes}["checkpointing"] == ("none", "selective", "full")
    # a recomputing stack keeps one lattice per ZeRO stage
    other = _Searcher(model, TrainSpec(seq_len=65536), default_topology("h100-80gb", 4, 4),
                      PlanSettings(stack="hf-deepspeed"), None)
    assert all(len({a.name: a.values for a in b.axes}["offload_checkpoints"]) == 2
               for b in other.lattices(Layout(dp_shard=2, ulysses=2)))


def test_pinned_selective_with_offload_is_still_planned():
    model = get_model_preset("qwen3-4b")
    settings = PlanSettings(stack=STACK, fixed_options={"checkpointing": "selective", "offload_checkpoints": True})
    result = search(model, TrainSpec(seq_len=65536), default_topology("h100-80gb", 4, 4), settings)
    assert result.plans and result.plans[0].train.checkpointing == "selective"
    assert result.plans[0].train.offload_checkpoints


def test_host_memory_holds_every_saved_activation_when_the_offload_keeps_them():
    model = get_model_preset("llama3-8b")
    layout = Layout(dp_shard=2, ulysses=4)
    train = TrainSpec(seq_len=262144, checkpointing="full", offload_checkpoints=True)
    keeps = load_stack(STACK).memory
    recomputes = load_stack("sp-plan").memory
    assert keeps.checkpoint_offload_keeps_activations and not recomputes.checkpoint_offload_keeps_activations
    block_inputs = host_memory(model, train, layout, recomputes).checkpoints
    # the checkpointed input: tokens per GPU x hidden x bf16, per layer
    assert block_inputs == model.num_layers * (262144 // 4) * model.hidden_size * 2
    everything = host_memory(model, train, layout, keeps).checkpoints
    none_mode = memory_core(model, train.model_copy(update={"checkpointing": "none", "offload_checkpoints": False}),
                            layout, keeps)
    assert everything == model.num_layers * none_mode.block.saved["activation"]
    assert everything > 10 * block_inputs
    assert memory_core(model, train, layout, keeps).host.checkpoints == everything
    # the device model is unchanged by where the host copy lives
    assert memory_core(model, train, layout, keeps).total == memory_core(model, train, layout, recomputes.model_copy(
        update={k: v for k, v in keeps.model_dump().items() if k != "checkpoint_offload_keeps_activations"})).total


def test_one_switch_sets_both_models():
    stack = load_stack("sp-plan")
    assert not stack.memory.checkpoint_offload_keeps_activations
    flipped = stack.with_overrides(time={"checkpoint_offload_recomputes": False})
    assert flipped.memory.checkpoint_offload_keeps_activations
    profile = resolve_profile("h100-80gb", STACK)
    replaced = profile.with_assumptions(load_stack("sp-plan").memory)  # --assume from another stack's values
    assert replaced.memory.checkpoint_offload_keeps_activations


def test_a_stack_file_cannot_set_the_memory_side_against_the_time_side():
    from sp_plan.cost_models.errors import CostModelError
    from sp_plan.cost_models.stack import parse_stack

    with pytest.raises(CostModelError, match=r"follows time\.checkpoint_offload_recomputes.*set "
                                             r"time\.checkpoint_offload_recomputes instead"):
        parse_stack("name: x\nmemory:\n  checkpoint_offload_keeps_activations: true\n", "x.yaml")
    derived = parse_stack("name: x\ntime:\n  checkpoint_offload_recomputes: false\n", "x.yaml")
    assert derived.memory.checkpoint_offload_keeps_activations
