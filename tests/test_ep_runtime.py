"""Expert parallelism in the runtime: HF Qwen3-MoE and Mixtral (tiny fp32 configs: 2 layers, 4 experts, top-2)
with their experts split over ``ep`` ranks train exactly as one process trains them.

Each ``ep`` rank holds 2 of the 4 experts; tokens go to the rank holding their expert and back through two
all-to-alls per MoE layer (:mod:`sp_plan.runtime.expert_parallel`). The ``ep`` group is the innermost ``ep``
ranks of the shard group, as the planner prices it (checked against
:func:`sp_plan.cost_models.placement.group_shapes`): with dp_shard=2 the two data ranks, with dp_shard=2 x
ulysses=2 the two Ulysses ranks of each data rank. Two AdamW steps on 2 and 4 gloo ranks: each step's loss and
every gradient (the expert weights gathered to their full ``[experts, ...]`` shape) match a single process within
1e-5; the routing (top-k experts of every token) matches exactly.

A checkpoint saved under ep=2 holds the experts under the whole model's names and shapes, and resumes under ep=1.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import torch

pytest.importorskip("transformers")

from sp_plan.cost_models import Layout  # noqa: E402
from tests.distributed import error_of, run_ranks  # noqa: E402
from tests.moe_checks import (  # noqa: E402
    BATCH, LR, SEQ, STEPS, assert_matches_reference, moe_config, moe_model, reference_run, sharded_run)

pytestmark = pytest.mark.multiproc

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
#: (family, layout, options) with ep=2 inside dp_shard x ulysses (the ep group: each data rank's Ulysses pair).
SP_CASES = [
    ("mixtral", Layout(dp_shard=2, ulysses=2, ep=2), {"zero_stage": 2, "checkpointing": "full"}),
]


_config, _model = moe_config, moe_model


def _record_routing(model) -> list[torch.Tensor]:
    """Hooks that append each MoE router's top-k expert ids (per token, in sequence order) to the returned list."""
    routes: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: routes.append(out[2].detach().clone()))
    return routes


def _reference(family: str) -> tuple[list[float], list[dict], list[torch.Tensor]]:
    model = _model(family)
    routes = _record_routing(model)
    return (*reference_run(model), routes)


def _configure(family: str, layout: Layout, options: dict, micro_batch: int):
    from sp_plan.runtime.auto import auto_configure

    model = _model(family, attn="eager")
    setup = auto_configure(model, seq_len=SEQ, micro_batch=micro_batch, global_batch=BATCH, dtype="fp32",
                           topology="dgx-h100", fixed_layout=layout.as_dict(), fixed_options=options)
    assert setup.plan.layout == layout
    return setup


def _train(rank: int, world: int, family: str, layout: Layout, options: dict, save_to: str | None = None):
    from sp_plan.runtime.checkpoint import save_checkpoint
    from sp_plan.runtime.checkpoint.geometry import parameter_geometry

    setup = _configure(family, layout, options, BATCH // layout.dp)
    routes = _record_routing(setup.model)
    experts = setup.model.model.layers[0].mlp.experts
    # 4 experts: 2 per ep rank, sharded again by FSDP2 over the expert data ranks; the parameter keeps all 4
    assert experts.gate_up_proj.shape[0] == 4 and experts.gate_up_proj.to_local().shape[0] == 4 // layout.shard_group
    losses, grads, optimizer = sharded_run(setup, max_grad_norm=1e6)  # clipping: the norm over both meshes
    per_rank = BATCH // setup.dp_size
    sp_rank, sp = setup.mesh.local_rank("sp"), setup.mesh.size("sp")
    groups = {name: torch.distributed.get_process_group_ranks(setup.mesh.group(name)) for name in ("ep", "expert_data")}
    resumed = None
    if save_to is not None:  # the checkpoint's expert geometry and weights, then the same ranks resume under ep=1
        save_checkpoint(save_to, step=STEPS, setup=setup, optimizer=optimizer)
        geometry = {n: tuple(g.shape) for n, g in parameter_geometry(setup).items() if n.endswith(EXPERT_WEIGHTS)}
        saved = {n: t.detach().numpy() for n, t in setup.full_state_dict().items()}
        resumed = geometry, saved, _resume_without_ep(family, save_to)
    return losses, grads, [r.numpy() for r in routes], (setup.dp_rank, per_rank, sp_rank, sp), groups, resumed


def _resume_without_ep(family: str, directory: str) -> tuple[int, dict]:
    """A fresh model under dp_shard=2 without expert parallelism, loaded from ``directory``: (step, weights)."""
    from sp_plan.runtime.checkpoint import load_checkpoint

    setup = _configure(family, Layout(dp_shard=2), {"zero_stage": 3, "checkpointing": "none"}, 1)
    optimizer = setup.make_optimizer(lr=LR)
    state = load_checkpoint(directory, setup=setup, optimizer=optimizer)
    return state.step, {n: t.detach().numpy() for n, t in setup.full_state_dict().items()}


def _my_routes(reference: torch.Tensor, where: tuple[int, int, int, int], layout: Layout) -> torch.Tensor:
    """The reference's top-k expert ids of this rank's tokens: its sequences, and its slice of them (in the
    sharder's order: contiguous under Ulysses, zigzag chunks under ring)."""
    dp_rank, per_rank, sp_rank, sp = where
    ids = reference.view(BATCH, SEQ, -1)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    if layout.ring > 1:
        chunks = ids.chunk(2 * sp, dim=1)
        return torch.cat([chunks[sp_rank], chunks[2 * sp - 1 - sp_rank]], dim=1).reshape(-1, ids.shape[-1])
    return ids.chunk(sp, dim=1)[sp_rank].reshape(-1, ids.shape[-1])


def _planned_group(rank: int, stride: int, size: int) -> list[int]:
    """The ranks of the planner's (stride, size) group that holds ``rank``."""
    start = rank - (rank // stride % size) * stride
    return [start + i * stride for i in range(size)]


def _check_against_one_process(results: list, family: str, layout: Layout, options: dict) -> None:
    from sp_plan.cost_models.placement import group_shapes

    ref_losses, ref_grads, ref_routes = _reference(family)
    assert_matches_reference([(losses, grads) for losses, grads, *_ in results], ref_losses, ref_grads)
    planned = group_shapes(layout)
    for rank, (_, _, routes, where, groups, _) in enumerate(results):
        for name in ("ep", "expert_data"):  # the groups the runtime built are the ones the planner priced
            assert groups[name] == _planned_group(rank, *planned[name]), name
        if options["checkpointing"] == "none":  # one router call per layer and step (recomputation adds calls)
            assert len(routes) == len(ref_routes)
            for got, want in zip(routes, ref_routes):
                torch.testing.assert_close(torch.from_numpy(got), _my_routes(want, where, layout), rtol=0, atol=0)


def test_ep_over_the_data_ranks_matches_one_process_and_resumes_under_ep_1(tmp_path: pathlib.Path) -> None:
    """ep=2 over dp_shard=2 (2 ranks): exact; its checkpoint holds the experts whole and loads under ep=1."""
    layout, options = Layout(dp_shard=2, ep=2), {"zero_stage": 3, "checkpointing": "none"}
    results = run_ranks(2, _train, "qwen3_moe", layout, options, str(tmp_path))
    _check_against_one_process(results, "qwen3_moe", layout, options)
    geometry, weights, _ = results[0][-1]
    config = _config("qwen3_moe")
    full = {"gate_up_proj": (4, 2 * config.moe_intermediate_size, config.hidden_size),
            "down_proj": (4, config.hidden_size, config.moe_intermediate_size)}
    assert len(geometry) == config.num_hidden_layers * len(EXPERT_WEIGHTS)
    for name, shape in geometry.items():
        assert shape == full[name.rsplit(".", 1)[1]], name
    for *_, (_, _, (step, restored)) in results:
        assert step == STEPS
        assert sorted(restored) == sorted(weights)
        for name, tensor in weights.items():
            torch.testing.assert_close(torch.from_numpy(restored[name]), torch.from_numpy(tensor), rtol=0, atol=0)


@pytest.mark.parametrize(("family", "layout", "options"), SP_CASES,
                         ids=[f"{f}-ring{lay.ring}-ulysses{lay.ulysses}" for f, lay, _ in SP_CASES])
def test_ep_inside_sequence_parallelism_matches_one_process(family: str, layout: Layout, options: dict) -> None:
    """ep=2 over the two sequence-parallel ranks of each of dp_shard=2 data ranks (4 ranks): exact."""
    _check_against_one_process(run_ranks(layout.world, _train, family, layout, options), family, layout, options)


def test_expert_parallel_refusals() -> None:
    """What expert parallelism does not run is refused with its reason; what it runs is not."""
    from types import SimpleNamespace

    from sp_plan.cost_models import TrainSpec
    from sp_plan.runtime.capabilities import merge_constraints, planner_constraints, unsupported_reasons

    moe = SimpleNamespace(moe=object())
    assert planner_constraints("hf", moe)[0]["ep"] == 1  # never chosen unless pinned
    layout, options = merge_constraints({"ep": 2}, {}, "hf", moe)
    assert layout["ep"] == 2 and layout["pp"] == 1 and options["offload_params"] is False

    def reasons(layout: Layout, family: str = "hf", **train) -> list[str]:
        plan = SimpleNamespace(model=moe, train=TrainSpec(seq_len=SEQ, **train), layout=layout)
        return unsupported_reasons(plan, family)

    assert reasons(Layout(dp_shard=4, ep=2)) == []
    assert any(r.startswith("ep=2: this runtime splits experts over ep ranks for the hf family only, not llama")
               for r in reasons(Layout(dp_shard=4, ep=2), "llama"))
    assert any(r.startswith("ep=2 with pp=2: expert parallelism inside pipeline stages") for r in
               reasons(Layout(dp_shard=2, pp=2, ep=2)))
    assert any(r.startswith("ep=2 with offload_params") for r in reasons(Layout(dp_shard=2, ep=2), offload_params=True))
    assert any(r.startswith("ep=2 with dp_replicate=2: expert parallelism with HSDP") for r in
               reasons(Layout(dp_replicate=2, dp_shard=2, ep=2)))
    assert any(r.startswith("tp=2: tensor parallelism does not split mixture-of-experts") for r in
               reasons(Layout(dp_shard=2, tp=2, ep=2)))
    assert "--pp 1 or --ep 1" in error_of(lambda: merge_constraints({"ep": 2, "pp": 2}, {}, "hf", moe))
    assert "--ep 1" in error_of(lambda: merge_constraints({"ep": 2}, {"offload_optimizer": True}, "hf", moe))
    assert "--ep 1" in error_of(lambda: merge_constraints({"ep": 2}, {}, "llama", moe))


def test_train_with_ep_through_the_console_script(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_config("qwen3_moe").to_dict(), "num_experts": 4, "vocab_size": 512}))
    exe = pathlib.Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sp-plan"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(exe), "train", "--model", str(config), "--ep", "2", "--dp-shard", "2",
                           "--nproc-per-node", "2", "--seq-len", "32", "--steps", "2", "--topology", "dgx-h100",
                           "--dtype", "fp32", "--corpus-bytes", "100000", "--no-progress", "--log-every", "1", "--yes"],
                          capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "(ep=2)" in out and "done: 2 steps" in out, out[-3000:]
