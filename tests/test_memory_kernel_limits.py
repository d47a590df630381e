"""The stack's int32 row kernels bound the per-GPU slice (cost_models/memory/kernel_limits.py).

Liger-Kernel < 0.6.1 (the ALST runs' version; the hf-deepspeed stack) computes ``row x row stride`` in
int32 in its RMSNorm and RoPE kernels, so the last row of a per-GPU slice must start at or below
2^31 - 1 elements. Every expected number below is computed by hand from the model shapes.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory import memory_core
from sp_plan.cost_models.model_spec import get_model_preset
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.topology import load_topology
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.planner.fitting.published import published_runs
from sp_plan.planner.fitting.runs import max_seq_len
from sp_plan.planner.fitting.fit import profile_for
from sp_plan.planner.capacity import max_seq_len as capacity_max_seq_len
from sp_plan.planner.search import PlanSettings

INT32_MAX = (1 << 31) - 1
ALST = dict(mode="train", zero_stage=3, offload_optimizer=True, checkpointing="full", tiled_mlp=True,
            tiled_loss=True, offload_checkpoints=True, micro_batch=1)


def _core(model: str, seq_len: int, ulysses: int, stack: str = "hf-deepspeed", **assume):
    profile = resolve_profile("h100-80gb", stack, assume=assume or None)
    return memory_core(get_model_preset(model), TrainSpec(seq_len=seq_len, **ALST),
                       Layout.for_world(ulysses, ulysses=ulysses), profile.memory)


def test_hf_deepspeed_ships_the_int32_limit_and_sp_plan_none():
    assert resolve_profile("h100-80gb", "hf-deepspeed").memory.row_kernel_offset_limit == INT32_MAX
    assert resolve_profile("h100-80gb", "sp-plan").memory.row_kernel_offset_limit is None


def test_llama8b_norm_rows_bound_at_524288_tokens_per_gpu():
    """Hidden 4096 (= 32 x 128 query width): the input norm's last row starts at (T - 1) x 4096."""
    at = _core("llama3-8b", 8 * 524_288, 8)
    assert at.row_kernel_offset == (524_288 - 1) * 4096 == INT32_MAX + 1 - 4096
    assert at.within_kernel_limits and at.kernel_limit_reason() is None
    past = _core("llama3-8b", 8 * 524_289, 8)
    assert past.row_kernel_offset == 524_288 * 4096 == INT32_MAX + 1
    assert not past.within_kernel_limits
    assert "524,289 tokens per GPU" in past.kernel_limit_reason()


def test_qwen3_q_norm_rows_bound_at_262144_tokens_per_gpu():
    """Qwen3-32B: hidden 5120 but 64 query heads x 128 = 8192; q_norm's rows are one head of one token
    (stride 128), so its last row starts at (T x 64 - 1) x 128, beyond RoPE's (T - 1) x 8192."""
    at = _core("qwen3-32b", 32 * 262_144, 32)
    assert at.row_kernel_offset == (262_144 * 64 - 1) * 128 == INT32_MAX + 1 - 128
    assert at.within_kernel_limits
    assert not _core("qwen3-32b", 32 * 262_145, 32).within_kernel_limits


def test_no_limit_without_the_limited_kernels():
    """The sp-plan stack indexes in 64 bits; with HF's eager norm and RoPE (no Liger) nothing is bounded."""
    assert _core("llama3-8b", 8 * 600_000, 8, stack="sp-plan").within_kernel_limits
    no_liger = _core("llama3-8b", 8 * 600_000, 8, norm_implementation="eager", rope_implementation="eager")
    assert no_liger.row_kernel_offset == 0 and no_liger.within_kernel_limits
    assert _core("llama3-8b", 8 * 600_000, 8, row_kernel_offset_limit=(1 << 63) - 1).within_kernel_limits


def test_estimate_does_not_fit_past_the_limit_even_with_memory_to_spare():
    model, layout = get_model_preset("llama3-8b"), Layout.for_world(8, ulysses=8)
    topology = load_topology("aws-p5", 8, None)
    profile = resolve_profile("h100-80gb", "hf-deepspeed")
    est = estimate(model, TrainSpec(seq_len=8 * 524_289, **ALST), layout, topology, with_placement=False,
                   profile=profile)
    assert est.memory.total < est.memory.capacity  # memory alone would fit ...
    assert not est.fits and not est.device_fits  # ... the kernels cannot address the slice
    assert est.detail.row_kernel_offset == 524_288 * 4096
    assert est.detail.row_kernel_offset_limit == INT32_MAX


def test_capacity_names_the_kernel_limit_and_lifting_it_lengthens_the_answer():
    """Llama-8B on one 8-GPU node: the int32 bound (8 x 524,288 tokens) binds before memory does."""
    model, topology = get_model_preset("llama3-8b"), load_topology("aws-p5", 8, None)
    base = TrainSpec(seq_len=1 << 14, mode="train")
    limited = capacity_max_seq_len(model, base, topology, PlanSettings(stack="hf-deepspeed"))
    assert limited.max_seq_len == 8 * 524_288
    assert "int32" in limited.bound_by and "524,416 tokens per GPU" in limited.bound_by
    lifted = capacity_max_seq_len(model, base, topology,
                                  PlanSettings(stack="hf-deepspeed", assume={"row_kernel_offset_limit": (1 << 63) - 1}))
    assert lifted.max_seq_len > limited.max_seq_len
    assert "int32" not in (lifted.bound_by or "")


ALST_GPU_BOUND = [r for r in published_runs()[0] if r.kind == "max_length" and r.source == "arctic-recipes"
                  and r.model.name.startswith("qwen3") and r.layout.world >= 16]


@pytest.mark.parametrize("run", ALST_GPU_BOUND, ids=lambda r: r.id)
def test_alst_qwen3_lengths_are_the_int32_bound(run):
    """Qwen3-32B on 16-64 GPUs: the model's longest length is 262,144 tokens per GPU (the int32 bound,
    within the search's 1K-token resolution), at or above the recipes' lengths (lower bounds)."""
    n = max_seq_len(run, profile_for(run))
    per_gpu = 262_144 * run.layout.world
    assert per_gpu - 1024 < n <= per_gpu
    assert n >= run.value


@settings(max_examples=30, deadline=None)
@given(tiled_mlp=st.booleans(), tiled_loss=st.booleans(), checkpointing=st.sampled_from(["selective", "full"]),
       offload_checkpoints=st.booleans(), zero_stage=st.sampled_from([1, 2, 3]),
       tokens_per_gpu=st.sampled_from([524_287, 524_288, 524_289]))
def test_the_bound_depends_on_the_slice_not_on_memory_options(tiled_mlp, tiled_loss, checkpointing,
                                                              offload_checkpoints, zero_stage, tokens_per_gpu):
    """The planner prunes on it like on device memory: no memory option may change it (monotone lattice)."""
    profile = resolve_profile("h100-80gb", "hf-deepspeed")
    train = TrainSpec(seq_len=8 * tokens_per_gpu, mode="train", zero_stage=zero_stage, checkpointing=checkpointing,
                      tiled_mlp=tiled_mlp, tiled_loss=tiled_loss,
                      offload_checkpoints=offload_checkpoints and checkpointing != "none", micro_batch=1)
    core = memory_core(get_model_preset("llama3-8b"), train, Layout.for_world(8, ulysses=8), profile.memory)
    assert core.row_kernel_offset == (tokens_per_gpu - 1) * 4096
    assert core.within_kernel_limits == (tokens_per_gpu <= 524_288)
