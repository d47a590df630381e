"""Process groups from a plan: plan files, launch checks, and the 5-D mesh on 4 gloo ranks."""

from __future__ import annotations

import json

import pytest

from sp_plan.cost_models.layout import Layout
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.mesh import check_launch, load_layout
from tests.distributed import run_ranks


def test_load_layout_from_yaml_json_and_mappings(tmp_path):
    yaml_plan = tmp_path / "plan.yaml"
    yaml_plan.write_text("model: llama3-8b\nlayout:\n  ulysses: 4\n  ring: 2\nestimate: {fits: true}\n")
    assert load_layout(yaml_plan) == Layout(ulysses=4, ring=2)
    json_plan = tmp_path / "plan.json"
    json_plan.write_text(json.dumps({"layout": {"dp_shard": 2, "tp": 2}}))
    assert load_layout(str(json_plan)) == Layout(dp_shard=2, tp=2)
    assert load_layout({"layout": {"ring": 4}}) == Layout(ring=4)
    assert load_layout({"ulysses": 8}) == Layout(ulysses=8)
    assert load_layout(Layout(tp=8)) == Layout(tp=8)


def test_bad_plan_files_give_one_line_errors(tmp_path):
    with pytest.raises(RuntimeConfigError, match="does not exist"):
        load_layout(tmp_path / "missing.yaml")
    no_layout = tmp_path / "a.yaml"
    no_layout.write_text("ulysses: 4\n")
    with pytest.raises(RuntimeConfigError, match="has no 'layout:' mapping"):
        load_layout(no_layout)
    typo = tmp_path / "b.yaml"
    typo.write_text("layout: {ulyses: 4}\n")
    with pytest.raises(RuntimeConfigError, match="ulyses: unknown field"):
        load_layout(typo)
    zero = tmp_path / "c.json"
    zero.write_text('{"layout": {"ring": 0}}')
    with pytest.raises(RuntimeConfigError, match="ring: Input should be greater than or equal to 1"):
        load_layout(zero)
    broken = tmp_path / "d.json"
    broken.write_text('{"layout": ')
    with pytest.raises(RuntimeConfigError, match="is not valid JSON"):
        load_layout(broken)
    with pytest.raises(RuntimeConfigError) as info:
        load_layout(typo)
    assert "\n" not in str(info.value)


def test_launch_checks():
    check_launch(Layout(ulysses=8), 8, device_type="cuda", local_world_size=8, visible_devices=8)
    check_launch(Layout(ring=2, ulysses=2), 4, device_type="cpu", local_world_size=4, visible_devices=0)
    with pytest.raises(RuntimeConfigError) as info:
        check_launch(Layout(ulysses=8), 4, device_type="cpu", local_world_size=4, visible_devices=0)
    assert str(info.value) == (
        "plan needs 8 ranks (ulysses=8) but torchrun launched 4: launch with torchrun --nproc-per-node 8 ..., "
        "or make a plan for 4 GPUs"
    )
    with pytest.raises(RuntimeConfigError, match="launch with torchrun --nnodes 2 --nproc-per-node 8"):
        check_launch(Layout(ring=2, ulysses=8), 8, device_type="cuda", local_world_size=8, visible_devices=8)
    with pytest.raises(RuntimeConfigError, match="started 8 processes on this node but only 4 GPUs are visible"):
        check_launch(Layout(ulysses=8), 8, device_type="cuda", local_world_size=8, visible_devices=4)
    with pytest.raises(RuntimeConfigError, match="no GPU is visible"):
        check_launch(Layout(ulysses=2), 2, device_type="cuda", local_world_size=2, visible_devices=0)


DIMS = ("dp_replicate", "dp_shard", "ring", "ulysses", "tp", "sp", "fsdp")


def _mesh_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import build_mesh

    out = {}
    for name, layout in (("usp", Layout(ring=2, ulysses=2)), ("dp_ulysses", Layout(dp_shard=2, ulysses=2)),
                         ("tp_ring", Layout(dp_replicate=1, ring=2, tp=2))):
        mesh = build_mesh(layout, device_type="cpu")
        out[name] = {dim: dist.get_process_group_ranks(mesh.group(dim)) for dim in DIMS}
        out[name]["sizes"] = [mesh.size(dim) for dim in DIMS]
        sp = SequenceParallel.from_mesh(mesh)
        out[name]["ctx"] = (sp.ring_size, sp.ulysses_size, sp.rank)
    try:
        build_mesh(Layout(ulysses=8), device_type="cpu")
    except RuntimeConfigError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.multiproc
def test_mesh_groups_follow_the_dim_order():
    per_rank = run_ranks(4, _mesh_rank)
    usp = [r["usp"] for r in per_rank]
    assert [u["ulysses"] for u in usp] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # innermost: consecutive ranks
    assert [u["ring"] for u in usp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(u["sp"] == [0, 1, 2, 3] and u["fsdp"] == [0, 1, 2, 3] for u in usp)
    assert all(u["sizes"] == [1, 1, 2, 2, 1, 4, 4] for u in usp)  # size-1 dims are there and indexable
    assert [u["ctx"] for u in usp] == [(2, 2, 0), (2, 2, 1), (2, 2, 2), (2, 2, 3)]
    dp = [r["dp_ulysses"] for r in per_rank]
    assert [d["dp_shard"] for d in dp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [d["sp"] for d in dp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [d["ctx"] for d in dp] == [(1, 2, 0), (1, 2, 1), (1, 2, 0), (1, 2, 1)]  # SP group = ulysses pair
    assert all(d["fsdp"] == [0, 1, 2, 3] for d in dp)  # FSDP spans dp_shard x ulysses
    tp = [r["tp_ring"] for r in per_rank]
    assert [t["tp"] for t in tp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [t["ring"] for t in tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [t["fsdp"] for t in tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # TP ranks hold different shards
    expected = ("plan needs 8 ranks (ulysses=8) but torchrun launched 4: launch with torchrun --nproc-per-node 8 ..., "
                "or make a plan for 4 GPUs")
    assert [r["mismatch"] for r in per_rank] == [expected] * 4
