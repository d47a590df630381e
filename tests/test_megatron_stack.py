"""The Megatron-Core stack (issue 19, item 4): ``--stack megatron`` resolves to ``megatron-core``, its memory is
what Megatron's distributed optimizer allocates (6 + 12/d bytes per parameter for bf16 parameters with fp32
main gradients, docs/user-guide/features/dist_optimizer.md), and the planner proposes under it only plans
Megatron-LM can run (ZeRO-1, no tiling or parameter/checkpoint offload, KV heads split without replication).

Pure planner tests (no torch).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.memory.states import model_states
from sp_plan.cost_models.stack import StackSearch, load_stack, parse_stack
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.search import PlanSettings, brute_force_best, search

SP_PLAN = str(Path(sys.executable).with_name("sp-plan"))
GPU = "h100-80gb"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SP_PLAN, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["megatron", "MEGATRON", "mcore", "megatron-core"])
def test_megatron_and_mcore_name_the_megatron_core_stack(name):
    assert load_stack(name).name == "megatron-core"


def test_a_plan_under_the_alias_records_the_stacks_own_name():
    result = run_cli("plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--top", "2", "--json",
                     "--stack", "megatron")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["stack"] == "megatron-core" and plan["plans"]


@pytest.mark.parametrize("shard", [1, 2, 8])
def test_model_states_are_the_distributed_optimizers_6_plus_12_over_d_bytes_per_parameter(shard):
    """bf16 parameters and fp32 main gradients full on every rank, fp32 master + Adam moments sharded over
    the data x context parallel ranks (here dp_shard x ulysses x ring)."""
    model = get_model_preset("llama3-8b")
    train = TrainSpec(seq_len=8192, zero_stage=1)
    layout = Layout.for_world(shard, ulysses=shard)
    st = model_states(model, train, layout, load_stack("megatron").memory)
    params = st.params.total
    assert st.weights_device == 2 * params
    assert st.grads_device(params) == 4 * params
    assert st.optimizer_device == pytest.approx(12 * params / shard, abs=1)
    # the default stack keeps gradients in the compute dtype: 2 B, so Megatron holds 2 B/param more
    plain = model_states(model, train, layout, load_stack("sp-plan").memory)
    assert st.grads_device(params) - plain.grads_device(params) == 2 * params


def test_search_under_megatron_proposes_only_what_megatron_runs():
    model = get_model_preset("llama3-8b")  # 32 query heads, 8 KV heads
    result = search(model, TrainSpec(seq_len=64 * 1024), default_topology(GPU, 16, 8),
                    PlanSettings(top_k=10, stack="megatron"))
    assert result.stack == "megatron-core" and result.plans
    for plan in result.plans:
        opts = plan.options
        assert opts["zero_stage"] == 1
        assert not (opts["tiled_mlp"] or opts["tiled_loss"] or opts["offload_params"] or opts["offload_checkpoints"])
        assert max(1, model.num_kv_heads // plan.layout.tp) % plan.layout.ulysses == 0
    refused = [r for r in result.rejected if r.kind == "structure" and "KV heads per TP rank" in r.reason]
    assert any(r.layout.get("ulysses") == 16 for r in refused)  # 8 KV heads cannot split 16 ways in an a2a
    # the default stack runs that layout (replicating KV heads): the restriction is the stack's
    free = search(model, TrainSpec(seq_len=64 * 1024), default_topology(GPU, 16, 8),
                  PlanSettings(top_k=10, stack="sp-plan", fixed_layout={"ulysses": 16}))
    assert free.plans


@pytest.mark.parametrize("name, seq, gpus", [("llama3-8b", 128 * 1024, 8), ("llama3-70b", 64 * 1024, 16)])
def test_search_finds_the_brute_force_optimum_under_megatron(name, seq, gpus):
    model = get_model_preset(name)
    topology = default_topology(GPU, gpus, min(8, gpus))
    settings = PlanSettings(top_k=3, stack="megatron")
    best_score, layout, options, _ = brute_force_best(model, TrainSpec(seq_len=seq), topology, settings)
    result = search(model, TrainSpec(seq_len=seq), topology, settings)
    assert best_score < float("inf") and options["zero_stage"] == 1
    assert result.plans[0].score == pytest.approx(best_score, rel=1e-12)


def test_a_pin_megatron_cannot_run_is_a_one_line_error():
    with pytest.raises(PlannerError, match=r"--zero 3 is not something the megatron-core stack runs \(zero_stage: 1\)"):
        search(get_model_preset("llama3-8b"), TrainSpec(seq_len=32768), default_topology(GPU, 8, 8),
               PlanSettings(stack="megatron", fixed_options={"zero_stage": 3}))
    result = run_cli("plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--stack", "megatron",
                     "--tiled-mlp")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tiled-mlp is not something the megatron-core stack runs (tiled_mlp: False)" in lines[0], lines


def test_the_estimate_of_a_megatron_layout_needs_no_search_restriction():
    """estimate evaluates what it is given (ZeRO-3 under megatron-core is a what-if, not a plan)."""
    result = run_cli("estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8",
                     "--zero", "1", "--stack", "megatron", "--json")
    assert result.returncode == 0, result.stderr
    est = json.loads(result.stdout)
    assert est["detail"]["stack"] == "megatron-core"


def test_a_stack_files_search_section_is_validated():
    with pytest.raises(Exception, match="unknown option 'zero'"):
        StackSearch(options={"zero": (1,)})
    with pytest.raises(Exception, match="option zero_stage takes distinct values"):
        StackSearch(options={"zero_stage": (5,)})
    with pytest.raises(Exception, match="option tiled_mlp takes distinct values"):
        StackSearch(options={"tiled_mlp": (0,)})  # an int is not a bool here
    profile = parse_stack("name: x\nsearch: {options: {checkpointing: [full]}}\n", "x.yaml")
    assert profile.search.options == {"checkpointing": ("full",)}


def test_search_under_megatron_needs_two_chunks_per_context_parallel_rank_even_without_ring():
    """Megatron cuts every sequence into 2 x CP chunks for a2a too; sp-plan's own Ulysses needs only ulysses."""
    model = get_model_preset("llama3-8b")
    topology = default_topology(GPU, 8, 8)
    odd = 8 * 1023  # 8,184 tokens: ulysses=8 leaves 1,023 per rank, which does not split into 2 chunks
    free = search(model, TrainSpec(seq_len=odd), topology,
                  PlanSettings(top_k=1, stack="sp-plan", fixed_layout={"ulysses": 8}))
    assert free.plans
    with pytest.raises(PlannerError, match="does not divide into 2 x 8 chunks"):
        search(model, TrainSpec(seq_len=odd), topology, PlanSettings(top_k=1, stack="megatron",
                                                                     fixed_layout={"ulysses": 8}))


# ----- pipeline stages: the split Megatron-LM can express ---------------------------------------------------


@pytest.mark.parametrize("layers, p, v", [(32, 4, 1), (61, 8, 1), (48, 2, 4), (32, 3, 4), (126, 16, 1), (80, 4, 2)])
def test_the_first_even_last_split_is_one_megatron_can_express(layers, p, v):
    from sp_plan.cost_models.pipeline import first_even_last_split

    split = first_even_last_split(layers, p, v, 1.5)
    assert split is not None and sum(split) == layers and len(split) == p
    assert len(set(split[1:-1])) <= 1 and all(n % v == 0 for n in split)

    def load(s):  # the slowest stage, the last carrying the head's 1.5 layers
        return max(max(s[:-1]), s[-1] + 1.5)

    forms = [(f, *[m] * (p - 2), last) for f in range(v, layers + 1, v) for m in range(v, layers + 1, v)
             for last in range(v, layers + 1, v) if f + m * (p - 2) + last == layers and (p > 2 or m == v)]
    assert load(split) == min(load(s) for s in forms)  # no split of Megatron's form is faster


def test_no_split_of_megatrons_form_is_refused_with_the_reason():
    from sp_plan.cost_models.pipeline import first_even_last_split

    # two stages of multiples of 4 cannot hold 13 layers, nor 14 or 15 slots with the embedding and the loss
    assert first_even_last_split(13, 2, 4, 0.0) is None
    assert first_even_last_split(7, 2, 4, 0.0) == (3, 4)  # the embedding counted as a layer: 8 slots of 4 chunks
    stack = load_stack("megatron-core").search
    assert "no split of 13 layers over pp=2 with 4 chunks" in stack.stage_split_refusal(13, 2, 4)
    assert stack.stage_split_refusal(8, 2, 4) is None and load_stack("sp-plan").search.stage_split_refusal(13, 2, 4) is None


def test_pipelined_plans_under_megatron_carry_a_split_megatron_can_run():
    """The planner's own Megatron plans must export: before the stack's split rule, a balanced split with an uneven
    middle (DeepSeek-V3's 61 layers over 8 stages: 7,7,8,...) or chunks that do not divide a stage (48 layers
    as 25/23 with 4 chunks) were recommended and then refused by the exporter."""
    from sp_plan.planner.export_megatron import megatron_refusal
    from sp_plan.planner.plan import Hardware, Plan

    model = get_model_preset("llama3-8b")
    topology = default_topology(GPU, 32, 8)
    result = search(model, TrainSpec(seq_len=32 * 1024), topology,
                    PlanSettings(top_k=5, stack="megatron", fixed_layout={"pp": 4, "tp": 8}))
    assert result.plans
    for ranked in result.plans:
        split = ranked.train.stage_layers
        assert split is not None and len(set(split[1:-1])) == 1 and sum(split) == model.num_layers
        plan = Plan(model=model, train=ranked.train, layout=ranked.layout,
                    hardware=Hardware(num_gpus=32, gpus_per_node=8, gpu=GPU, topology="dgx-h100"))
        assert megatron_refusal(plan) is None


def test_search_equals_brute_force_with_the_megatron_split():
    model = get_model_preset("llama3-8b")
    topology = default_topology(GPU, 16, 8)
    settings = PlanSettings(top_k=3, stack="megatron", fixed_layout={"pp": 2})
    best_score, layout, options, _ = brute_force_best(model, TrainSpec(seq_len=32 * 1024), topology, settings)
    result = search(model, TrainSpec(seq_len=32 * 1024), topology, settings)
    assert best_score < float("inf") and result.plans[0].score == pytest.approx(best_score, rel=1e-12)


def test_estimate_under_megatron_prices_the_split_megatron_runs():
    ran = run_cli("estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "32", "--pp", "4", "--tp", "8",
                  "--stack", "megatron", "--schedule", "1f1b", "--json")
    assert ran.returncode == 0, ran.stderr
    stages = json.loads(ran.stdout)["detail"]["pipeline"]["stage_layers"]
    assert len(set(stages[1:-1])) == 1 and sum(stages) == 32
    bad = run_cli("estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "16", "--pp", "2", "--tp", "8",
                  "--stack", "megatron", "--schedule", "interleaved_1f1b", "--virtual-stages", "3", "--grad-accum", "2")
    assert bad.returncode == 2 and "pin --stage-layers" in bad.stderr and "Traceback" not in bad.stderr
