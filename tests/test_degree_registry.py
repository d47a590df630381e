"""A new layout degree is one module plus a registration (tests/toy_degree.py): the layout, the planner's
search, the cost model, the placement, the command line, plan files and the runtime's mesh, data sampler
and HSDP all take it from the registry. ``dp_outer`` has ``dp_replicate``'s roles, so every number must be
exactly what the same split priced as ``dp_replicate`` gives."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models import degrees as registry
from sp_plan.cost_models.degrees import Degree, register_degree, unregister_degree
from sp_plan.cost_models.errors import CostModelError, explain_validation_error
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.placement import group_shapes, place
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.space import divisors, enumerate_layouts

from tests import toy_degree
from tests.distributed import run_ranks

MODEL = get_model_preset("llama3-8b")
TRAIN = TrainSpec(seq_len=32768, zero_stage=3, checkpointing="full")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def dp_outer():
    toy_degree.register()
    try:
        yield
    finally:
        toy_degree.unregister()


def test_layout_takes_the_new_degree_with_the_same_bounds_and_roles(dp_outer):
    layout = Layout(dp_outer=2, dp_shard=2, ulysses=2)
    assert layout.dp_outer == 2 and layout.world == 8 and layout.dp == 4 and layout.sp == 2
    assert layout.shard_group == 4 and layout.data_ranks == 8
    assert registry.mesh_dims()[0] == "dp_outer" and layout.describe() == "dp_outer=2 x dp_shard=2 x ulysses=2"
    assert Layout.model_validate(layout.model_dump(mode="json")) == layout
    assert Layout(tp=2) != Layout(tp=2, dp_outer=2) and Layout(tp=2).dp_outer == 1
    assert Layout.for_world(16, dp_outer=2, tp=2).dp_shard == 4
    with pytest.raises(ValidationError) as bad:
        Layout(dp_outer=0)
    assert str(explain_validation_error(bad.value, "layout")) == (
        "invalid layout: dp_outer: Input should be greater than or equal to 1")
    with pytest.raises(ValidationError, match="not_a_degree\n  Extra inputs are not permitted"):
        Layout(not_a_degree=2)


def test_unregistering_restores_the_built_in_layout():
    toy_degree.register()
    toy_degree.unregister()
    assert "dp_outer" not in registry.mesh_dims()
    with pytest.raises(ValidationError, match="dp_outer\n  Extra inputs are not permitted"):
        Layout(dp_outer=2)
    with pytest.raises(CostModelError, match="built-in"):
        unregister_degree("tp")
    with pytest.raises(CostModelError, match="already registered"):
        register_degree(registry.degree("tp"))


def _brute_force(world: int, seq_len: int, gpus_per_node: int) -> set[tuple]:
    """Every factorisation of ``world`` over all registered degrees that the built-in checks allow."""
    names = registry.mesh_dims()
    found = set()

    def rec(i, rest, values):
        if i == len(names):
            if rest == 1:
                layout = Layout(**dict(zip(names, values)))
                tp, heads = layout.tp, MODEL.num_heads
                node_ok = tp == 1 or (tp <= gpus_per_node and gpus_per_node % tp == 0)
                try:
                    MODEL.kv_replication(layout.head_split)
                    kv_ok = True
                except CostModelError:
                    kv_ok = False
                if node_ok and heads % layout.head_split == 0 and kv_ok and seq_len % layout.seq_multiple() == 0:
                    found.add(tuple(sorted(layout.degrees().items())))
            return
        for d in divisors(rest):
            rec(i + 1, rest // d, values + [d])

    rec(0, world, [])
    return found


def test_the_search_space_enumerates_the_new_degree_like_brute_force(dp_outer):
    space = enumerate_layouts(16, MODEL, 32768, 8)
    got = {tuple(sorted(layout.degrees().items())) for layout in space.layouts}
    assert got == _brute_force(16, 32768, 8)
    outer = [layout for layout in space.layouts if layout.dp_outer > 1]
    assert outer and len(got) == len(space.layouts)
    capped = enumerate_layouts(16, MODEL, 32768, 8, max_dp_replicate=1)
    assert all(layout.dp_replicate == 1 for layout in capped.layouts)
    assert any(layout.dp_outer == 2 for layout in capped.layouts)


def test_a_model_degree_brings_its_own_structural_check():
    def at_most_two(chosen, ctx):
        return f"toy_split={chosen['toy_split']} is above 2" if chosen["toy_split"] > 2 else None

    register_degree(Degree("toy_split", 35, frozenset({"weights"}), "Toy.", check=at_most_two))
    try:
        space = enumerate_layouts(8, MODEL, 32768, 8)
        assert {layout.toy_split for layout in space.layouts} == {1, 2}
        reasons = {r.describe(): r.reason for r in space.rejected}
        assert reasons["toy_split=4"] == "toy_split=4 is above 2"
        assert registry.searched("model") == ("tp", "toy_split", "ulysses", "ring", "pp")
        # the runtime does not implement it: the planner is told to hold it at 1, a plan using it is refused
        from sp_plan.runtime.capabilities import merge_constraints, planner_constraints, unsupported_reasons
        from sp_plan.runtime.errors import RuntimeConfigError

        assert planner_constraints("llama")[0]["toy_split"] == 1
        assert "dp_outer" not in planner_constraints("llama")[0]

        class _Plan:
            train, layout, model = TRAIN, Layout(toy_split=2), MODEL

        assert any("toy_split=2: this runtime has no implementation" in r for r in unsupported_reasons(_Plan()))
        with pytest.raises(RuntimeConfigError, match="--toy-split 1"):
            merge_constraints({"toy_split": 2}, {})
    finally:
        unregister_degree("toy_split")


def test_the_cost_model_prices_the_new_degree_as_the_same_split_of_dp_replicate(dp_outer):
    topology = default_topology("h100-80gb", 64, 8)
    outer = Layout(dp_outer=2, dp_shard=4, ulysses=8)
    replicate = Layout(dp_replicate=2, dp_shard=4, ulysses=8)
    a = estimate(MODEL, TRAIN, outer, topology)
    b = estimate(MODEL, TRAIN, replicate, topology)
    assert a.time.step_s == pytest.approx(b.time.step_s, rel=1e-12)
    assert a.memory.total == pytest.approx(b.memory.total, rel=1e-12)
    assert a.comm.per_step_bytes == pytest.approx(b.comm.per_step_bytes, rel=1e-12)
    assert a.comm.per_step_bytes > estimate(MODEL, TRAIN, Layout(dp_shard=4, ulysses=8), topology).comm.per_step_bytes
    assert group_shapes(outer)["dp_outer"] == group_shapes(replicate)["dp_replicate"] == (32, 2)
    placement = place(outer, topology)
    assert placement.mesh_order[0] == "dp_outer" and placement.rank_formula.startswith("rank = ((((((dp_outer*pp + pp)*dp_replicate")
    assert placement.groups["dp_outer"].nodes_spanned == 2
    assert placement.groups["data"].dims == ["dp_outer", "dp_replicate", "dp_shard", "ring", "ulysses"]


def test_the_planner_pins_and_searches_the_new_degree(dp_outer):
    from sp_plan.planner.search import PlanSettings, search

    topology = default_topology("h100-80gb", 16, 8)
    pinned = search(MODEL, TRAIN, topology, PlanSettings(global_batch_tokens=16 * 32768, fixed_layout={"dp_outer": 2}))
    assert pinned.plans and all(p.layout.dp_outer == 2 for p in pinned.plans)
    free = search(MODEL, TRAIN, topology, PlanSettings(global_batch_tokens=16 * 32768))
    assert free.stats.layouts > pinned.stats.layouts


def test_the_command_line_gets_a_flag_for_the_new_degree(tmp_path):
    """Registered before the CLI is imported (as a plugin would be): --dp-outer exists and reaches the plan."""
    code = "import sys; from tests import toy_degree; toy_degree.register(); from sp_plan.cli.main import main; main()"
    plan = tmp_path / "plan.yaml"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code, "plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "16",
                          "--gpu", "h100-80gb", "--dp-outer", "2", "--ulysses", "8", "--out", str(plan)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "dp_outer=2" in run.stdout + run.stderr
    show = subprocess.run([sys.executable, "-c", code, "estimate", "--help"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert "--dp-outer" in show.stdout
    train = subprocess.run([sys.executable, "-c", code, "train", "--help"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert "--dp-outer" in train.stdout
    # a plan file with the degree loads back (the runtime reads the same mapping)
    toy_degree.register()
    try:
        from sp_plan.runtime.mesh import load_layout

        layout = load_layout(plan)
        assert layout.dp_outer == 2 and layout.ulysses == 8 and layout.world == 16
    finally:
        toy_degree.unregister()


def _hsdp_over_dp_outer(rank: int, world: int) -> tuple:
    import torch
    from sp_plan.runtime.data import data_parallel_coordinates
    from sp_plan.runtime.fsdp import data_parallel_mesh
    from sp_plan.runtime.mesh import build_mesh
    from torch.distributed.fsdp import fully_shard

    from tests import toy_degree as toy

    toy.register()
    mesh = build_mesh(Layout(dp_outer=2), device_type="cpu")
    coords = data_parallel_coordinates(mesh)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1, bias=False)
    fully_shard(layer, mesh=data_parallel_mesh(mesh))
    x = torch.full((1, 4), float(rank + 1))
    layer(x).sum().backward()
    grad = layer.weight.grad.full_tensor()
    return coords, mesh.device_mesh.mesh_dim_names, grad.tolist()


def test_the_runtime_builds_the_mesh_samples_and_reduces_over_the_new_degree():
    results = run_ranks(2, _hsdp_over_dp_outer)
    assert [r[0] for r in results] == [(0, 2), (1, 2)]
    assert results[0][1][0] == "dp_outer"
    # HSDP across dp_outer averages the two replicas' gradients: inputs 1 and 2 give 1.5 everywhere
    for _, _, grad in results:
        assert grad == [[1.5, 1.5, 1.5, 1.5]]
    assert math.isclose(results[0][2][0][0], results[1][2][0][0])
