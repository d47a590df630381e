"""Expert parallelism (issue 20 item 3): the ``ep`` layout field, its cost terms (expert states, routed-token
activations, dispatch/combine all-to-alls, expert data parallelism, per-rank expert GEMMs), hand-computed on
a tiny MoE spec."""

import math

import pytest
from sp_plan.cost_models import CostModelError, Layout, ModelSpec, TrainSpec, get_model_preset
from sp_plan.cost_models.comm_volume import comm_estimate, comm_ops
from sp_plan.cost_models.compute_time import _moe_ffn_seconds
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.memory import MemoryAssumptions
from sp_plan.cost_models.memory.block import block_graph
from sp_plan.cost_models.memory.dims import local_dims
from sp_plan.cost_models.memory.states import model_states, tp_params
from sp_plan.cost_models.moe import MoESpec
from sp_plan.cost_models.placement import group_shapes, place
from sp_plan.cost_models.topology import default_topology

H, E, K, FE, FS, F, L = 64, 8, 2, 32, 16, 128, 3


def tiny_moe(**moe_kw) -> ModelSpec:
    """3 layers (layer 0 dense FFN of 128), hidden 64, 8 experts of 32, top-2, one shared expert of 16."""
    moe = MoESpec(num_experts=E, top_k=K, expert_ffn_hidden_size=FE, num_shared_experts=1,
                  shared_expert_ffn_hidden_size=FS, dense_layers=(0,), **moe_kw)
    return ModelSpec(name="tiny-moe", num_layers=L, hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=F, vocab_size=100, moe=moe)


def dense() -> ModelSpec:
    return ModelSpec(name="tiny-dense", num_layers=2, hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=F, vocab_size=100)


# ----- representation -------------------------------------------------------------------------------------


def test_ep_defaults_to_one_and_old_layouts_read_the_same():
    old = {"dp_shard": 4, "ulysses": 2}  # a plan file written before expert parallelism
    layout = Layout(**old)
    assert layout.ep == 1 and "ep" not in layout.model_dump() and "ep" not in layout.as_dict()
    with_ep = Layout(**old, ep=4)
    assert with_ep.world == layout.world == 8  # ep does not multiply the world
    assert with_ep.degrees() == layout.degrees()  # nor is it a mesh dimension
    assert with_ep.model_dump()["ep"] == 4 and Layout(**with_ep.as_dict()) == with_ep
    assert with_ep != layout and hash(with_ep) != hash(layout)
    assert with_ep.describe() == "dp_shard=4 x ulysses=2 (ep=4)"
    assert with_ep.expert_data_parallel == 2
    assert Layout.for_world(8, ulysses=2, ep=4) == with_ep


@pytest.mark.parametrize("model, layout, message", [
    (dense(), Layout(dp_shard=8, ep=2), "dense model"),
    (tiny_moe(), Layout(dp_shard=6, ep=3), "ep=3 does not divide 8 routed experts; use one of 1, 2"),
    (tiny_moe(), Layout(dp_shard=2, tp=4, ep=4), "does not divide the 2 ranks of the shard group"),
])
def test_invalid_ep_is_refused_in_one_line(model, layout, message):
    with pytest.raises(CostModelError, match=message) as err:
        layout.check_against(model, 1024)
    assert "\n" not in str(err.value)


def test_ep_groups_are_the_innermost_shard_group_ranks():
    layout = Layout(dp_shard=4, ulysses=2, tp=2, ep=4)
    shapes = group_shapes(layout)
    assert shapes["shard"] == (2, 8)
    assert shapes["ep"] == (2, 4)  # 4 consecutive shard-group ranks, tp apart
    assert shapes["expert_data"] == (8, 2)  # the ranks holding the same experts
    assert "ep" not in group_shapes(Layout(dp_shard=4, ulysses=2, tp=2))  # plans without EP unchanged
    groups = place(layout, default_topology("h100-80gb", 16)).groups
    assert groups["ep"].nodes_spanned == 1 and groups["expert_data"].nodes_spanned == 2


# ----- model states ------------------------------------------------------------------------------------------


def _routed(tp: int = 1) -> int:
    """Routed-expert parameters of the whole model per TP rank (2 MoE layers)."""
    return (L - 1) * E * 3 * H * math.ceil(FE / tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_parameters_divide_by_ep(tp):
    m = tiny_moe()
    one, four = tp_params(m, tp), tp_params(m, tp, ep=4)
    assert one.total - four.total == _routed(tp) - _routed(tp) // 4
    assert four.routed_experts == _routed(tp) // 4 and one.routed_experts == 0


def test_zero_shards_experts_over_the_expert_data_parallel_ranks():
    m, a = tiny_moe(), MemoryAssumptions()
    dense_params = tp_params(m, 1).total - _routed()
    for zero in (1, 2, 3):
        train = TrainSpec(seq_len=1024, zero_stage=zero)
        base = model_states(m, train, Layout(dp_shard=8), a)
        ep = model_states(m, train, Layout(dp_shard=8, ep=4), a)
        per = base.per_param
        # ZeRO-sharded optimizer state: dense over 8 ranks, the rank's 2 of 8 experts over 8 / 4 = 2 ranks
        expected = -(-dense_params * per.optimizer // 8) + -(-(_routed() // 4) * per.optimizer // 2)
        assert ep.optimizer_device == pytest.approx(expected, abs=per.optimizer)
        assert ep.optimizer_device == pytest.approx(base.optimizer_device, abs=2 * per.optimizer)
        if zero < 3:  # unsharded weights: every dense weight, a quarter of the experts
            assert ep.weights_device == (dense_params + _routed() // 4) * per.weights
            assert base.weights_device == (dense_params + _routed()) * per.weights


# ----- activations, compute ------------------------------------------------------------------------------------


def test_routed_activations_on_the_busiest_rank():
    moe = tiny_moe().moe
    assert moe.rank_routed_rows(100) == 200  # without EP: this rank's own rows
    assert moe.rank_routed_rows(100, 4) == pytest.approx(200 * 1.15)  # busiest of 4 ranks
    capped = tiny_moe(capacity_factor=1.25).moe
    assert capped.rank_routed_rows(100, 4) == 2 * math.ceil(1.25 * 400 * 2 / 8)  # 2 local experts at capacity
    train = TrainSpec(seq_len=1024)
    m = tiny_moe()

    def expert_rows_bytes(layout):
        g = block_graph(m, local_dims(m, train, layout), MemoryAssumptions(), training=True, attention_kernel="flash",
                        tiled_mlp=False)
        return {t.name: t.nbytes for op in g.ops for t in op.outputs}

    one, four = expert_rows_bytes(Layout(dp_shard=4)), expert_rows_bytes(Layout(dp_shard=4, ep=4))
    rows = 1024 * K
    assert one["moe.dispatch"] == four["moe.dispatch"] == rows * H * 2
    assert "moe.dispatch_all_to_all" not in one
    assert four["moe.dispatch_all_to_all"] == int(rows * 1.15) * H * 2
    assert four["moe.combine_all_to_all"] == rows * H * 2


def test_expert_gemms_run_at_the_per_rank_shapes():
    m = tiny_moe()
    shapes = []

    def grouped(groups, fp8):
        shapes.append(groups)
        return 1.0

    _moe_ffn_seconds(m, 1024, 1, lambda g, fp8: 0.0, grouped, False, None, ep=4)
    # 2 local experts, each at 1.15 x the mean rows of 4 ranks' tokens (1024 x 4 x 2 / 8)
    assert shapes[0] == [(pytest.approx(1024 * 2 / 2 * 1.15), FE, H, 2.0)]


# ----- communication ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing, count", [("none", 4), ("full", 6)])
def test_dispatch_and_combine_all_to_alls(checkpointing, count):
    m = tiny_moe()
    train = TrainSpec(seq_len=1024, checkpointing=checkpointing)
    layout = Layout(dp_shard=4, ulysses=2, ep=4)
    ep_ops = [op for op in comm_ops(m, train, layout) if op.strategy == "ep"]
    assert {op.group for op in ep_ops} == {"ep"} and sum(op.count for op in ep_ops) == count
    tokens = 1024 / 2
    buffer = tokens * K * 1.15 * H * 2 * (L - 1) / L  # busiest rank's rows, MoE layers' share
    assert all(op.nbytes == pytest.approx(buffer) for op in ep_ops)
    sent = comm_estimate(m, train, layout).per_step_by_strategy["ep"]
    assert sent == pytest.approx(count * L * buffer * 3 / 4)  # (ep - 1) / ep leaves the rank
    assert comm_estimate(m, train, Layout(dp_shard=4, ulysses=2)).per_step_by_strategy["ep"] == 0


def test_expert_fsdp_traffic_moves_to_the_expert_data_group():
    m = tiny_moe()
    train = TrainSpec(seq_len=1024, zero_stage=3)
    base = [op for op in comm_ops(m, train, Layout(dp_shard=8)) if op.strategy == "fsdp"]
    split = [op for op in comm_ops(m, train, Layout(dp_shard=8, ep=4)) if op.strategy == "fsdp"]
    gather = {op.group: op.nbytes for op in split if op.label.endswith("all-gather") and op.phase == "forward"
              and op.scope == "layer"}
    base_gather = next(op.nbytes for op in base if op.label == "parameter all-gather")
    routed_layer = _routed() / L * 2  # bytes of the mean layer's routed experts
    assert gather["shard"] == pytest.approx(base_gather - routed_layer)
    assert gather["expert_data"] == pytest.approx(routed_layer / 4)


def test_ep_estimate_end_to_end_on_a_preset():
    model = get_model_preset("qwen3-30b-a3b")
    topo = default_topology("h100-80gb", 8)
    train = TrainSpec(seq_len=32768, checkpointing="full", zero_stage=2)
    one = estimate(model, train, Layout(dp_shard=8), topo)
    eight = estimate(model, train, Layout(dp_shard=8, ep=8), topo)
    assert eight.memory.weights < one.memory.weights  # ZeRO-2 keeps whole weights: experts split 8 ways
    assert eight.comm.per_step_by_strategy["ep"] > 0 and one.comm.per_step_by_strategy["ep"] == 0
    assert eight.time.exposed_comm_s_by_strategy["ep"] > 0
    assert eight.placement.groups["ep"].size == 8


# ----- planner -------------------------------------------------------------------------------------------------


def test_the_layout_space_offers_every_valid_ep_for_moe_models_only():
    from sp_plan.planner.space import enumerate_layouts

    moe_space = enumerate_layouts(8, tiny_moe(), 1024, 8).layouts
    assert {lay.ep for lay in moe_space} == {1, 2, 4, 8}
    for lay in moe_space:
        assert E % lay.ep == 0 and lay.shard_group % lay.ep == 0
        assert Layout(**lay.degrees()) in moe_space  # each EP layout comes with its ep=1 twin
    assert {lay.ep for lay in enumerate_layouts(8, dense(), 1024, 8).layouts} == {1}


@pytest.mark.parametrize("pins", [{}, {"ep": 4}])
def test_search_equals_brute_force_with_expert_parallelism(pins):
    from sp_plan.planner.search import PlanSettings, brute_force_best, search

    model = get_model_preset("mixtral-8x7b")
    topology = default_topology("h100-80gb", 8)
    train = TrainSpec(seq_len=32 * 1024)
    settings = PlanSettings(top_k=3, fixed_options={"zero_stage": 2}, fixed_layout=pins)
    best_score, best_layout, _, evaluations = brute_force_best(model, train, topology, settings)
    result = search(model, train, topology, settings)
    assert result.plans[0].score == pytest.approx(best_score, rel=1e-12)
    assert result.plans[0].layout.ep == best_layout.ep > 1  # under ZeRO-2 splitting the experts wins
    assert result.stats.time_evaluations < evaluations
    if pins:
        assert all(p.layout.ep == 4 for p in result.plans)


def test_ep_is_a_moving_part_for_near_ties():
    from sp_plan.planner.search import layout_moving_parts

    assert layout_moving_parts(Layout(dp_shard=8, ep=2)) == layout_moving_parts(Layout(dp_shard=8)) + 1


# ----- runtime capabilities ---------------------------------------------------------------------------------------


def test_the_runtime_runs_expert_parallel_hf_plans_and_refuses_the_others_with_ep_1():
    """The runtime splits HF MoE experts over ep ranks (tests/test_ep_runtime.py), only when ep is pinned; a
    family without expert parallelism (the runtime's own Llama) is refused with the reason and --ep 1."""
    from types import SimpleNamespace

    from sp_plan.runtime.capabilities import merge_constraints, planner_constraints, unsupported_reasons
    from sp_plan.runtime.errors import RuntimeConfigError

    moe = tiny_moe()
    assert planner_constraints("hf", moe)[0]["ep"] == 1  # never chosen unless pinned
    assert planner_constraints("llama", moe)[0]["ep"] == 1
    assert "ep" not in planner_constraints("llama", dense())[0]  # nothing to hold back on a dense model
    plan = SimpleNamespace(model=moe, train=TrainSpec(seq_len=1024), layout=Layout(dp_shard=8, ep=4))
    assert not any(r.startswith("ep=") for r in unsupported_reasons(plan, "hf"))
    reasons = unsupported_reasons(plan, "llama")
    assert any(r.startswith("ep=4: this runtime splits experts over ep ranks for the hf family only, not llama")
               and "--ep 1" in r for r in reasons)
    plan.layout = Layout(dp_shard=8)
    assert not any(r.startswith("ep=") for r in unsupported_reasons(plan, "llama"))
    assert merge_constraints({"ep": 2}, {}, "hf", moe)[0]["ep"] == 2
    with pytest.raises(RuntimeConfigError, match="expert"):
        merge_constraints({"ep": 2}, {}, "llama", moe)


# ----- the console script ---------------------------------------------------------------------------------------


def _sp_plan(*args):
    import pathlib
    import subprocess

    exe = pathlib.Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sp-plan"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, check=False)


def test_ep_pin_through_the_console_script():
    import json

    est = _sp_plan("estimate", "--model", "qwen3-30b-a3b", "--seq-len", "32K", "--gpus", "8", "--ep", "8", "--json")
    assert est.returncode in (0, 1), est.stderr  # 1: does not fit (the exit code the README documents)
    data = json.loads(est.stdout)
    assert data["layout"]["ep"] == 8 and data["comm"]["per_step_by_strategy"]["ep"] > 0
    assert data["placement"]["groups"]["ep"]["size"] == 8
    plan = _sp_plan("plan", "--model", "mixtral-8x7b", "--seq-len", "32K", "--gpus", "8", "--ep", "4", "--zero", "2",
                    "--json")
    assert plan.returncode == 0, plan.stderr
    assert all(p["layout"]["ep"] == 4 for p in json.loads(plan.stdout)["plans"])


@pytest.mark.parametrize("args, message", [
    (("--model", "llama3-8b", "--ep", "2"), "dense model"),
    (("--model", "qwen3-30b-a3b", "--ep", "3"), "ep=3 does not divide 128 routed experts"),
    (("--model", "qwen3-30b-a3b", "--ep", "16"), "does not divide the 8 ranks of the shard group"),
])
@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_invalid_ep_pins_fail_in_one_line(command, args, message):
    out = _sp_plan(command, *args, "--seq-len", "32K", "--gpus", "8")
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


def test_the_plan_report_names_the_expert_parallel_group():
    out = _sp_plan("plan", "--model", "mixtral-8x7b", "--seq-len", "32K", "--gpus", "8", "--ep", "4", "--zero", "2",
                   "--top", "2")
    assert out.returncode == 0, out.stderr
    assert "(ep=4)" in out.stdout and "ep x4 on nvlink, inside one node" in out.stdout
    assert "per layer (fwd): " in out.stdout and " ep " in out.stdout.split("per layer (fwd): ")[1].split("|")[0]


def test_capacity_answers_with_a_pinned_ep():
    from sp_plan.cost_models.topology import default_topology as topo_for
    from sp_plan.planner.capacity import probe_feasibility
    from sp_plan.planner.search import PlanSettings

    model, train = get_model_preset("qwen3-30b-a3b"), TrainSpec(seq_len=256 * 1024)
    probe = probe_feasibility(model, train, topo_for("h100-80gb", 8), PlanSettings(fixed_layout={"ep": 4}))
    assert probe.fits and probe.layout["ep"] == 4
    out = _sp_plan("capacity", "--model", "qwen3-30b-a3b", "--seq-len", "256K", "--ep", "4")
    assert out.returncode == 0, out.stderr
    assert "needs at least 8 x h100-80gb" in out.stdout and "(ep=4)" in out.stdout


def test_expert_parallel_communicators_are_counted():
    from sp_plan.cost_models.memory.overhead import _local_members, process_groups, purpose_groups

    plain, split = Layout(dp_shard=16), Layout(dp_shard=16, ep=4)
    assert [g.name for g in process_groups(plain)] == ["dp_shard"]
    groups = {g.name: g for g in process_groups(split)}
    assert list(groups) == ["dp_shard", "ep", "expert_data"]
    assert groups["ep"].size == 4 and groups["ep"].p2p and groups["expert_data"].size == 4
    assert _local_members(groups["ep"], split, 8) == 4  # 4 consecutive ranks: one node
    assert _local_members(groups["expert_data"], split, 8) == 2  # 4 ranks 4 apart: 2 per 8-GPU node
    assert [g.name for g in purpose_groups(split, 3)][-2:] == ["ep", "expert_data"]


def test_a_plan_file_keeps_ep_and_refuses_an_edited_invalid_one(tmp_path):
    import yaml
    from sp_plan.planner.plan import load_plan

    path = tmp_path / "plan.yaml"
    out = _sp_plan("plan", "--model", "mixtral-8x7b", "--seq-len", "32K", "--gpus", "8", "--ep", "4", "--zero", "2",
                   "--top", "1", "--out", str(path))
    assert out.returncode == 0, out.stderr
    assert load_plan(path).layout.ep == 4
    data = yaml.safe_load(path.read_text())
    data["layout"]["ep"] = 3
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CostModelError, match="layout: ep=3 does not divide 8 routed experts") as err:
        load_plan(path)
    assert "\n" not in str(err.value)
