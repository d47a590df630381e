"""Pipeline parallelism in the planner and the CLI: the search equals the brute force on pipelined layouts
(under every stack), the schedule branches keep the lattice monotone, pins work, and the console script
estimates, plans and sizes PP runs with one-line errors."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.stack import stack_names
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.options import invalid_reason
from sp_plan.planner.pipeline_options import SCHEDULES
from sp_plan.planner.search import PlanSettings, _Searcher, brute_force_best, search
from sp_plan.planner.space import layout_space

from tests.search_checks import assert_search_equals_brute_force

SP_PLAN = str(Path(sys.executable).with_name("sp-plan"))


@pytest.mark.parametrize("name, seq, gpus, fixed", [
    ("llama3-8b", 8192, 8, {"pp": 2}),    # many micro-batches: micro-batch, schedule and chunk branches
    ("llama3-70b", 32768, 16, {"pp": 4}),  # memory-bound: interleaving and offloads compete
    ("qwen3-4b", 32768, 8, {}),           # pp free among every other degree
])
def test_search_finds_the_brute_force_optimum_with_pipelines(name, seq, gpus, fixed):
    model = get_model_preset(name)
    topology = default_topology("h100-80gb", gpus, 8)
    train = TrainSpec(seq_len=seq)
    settings = PlanSettings(top_k=3, fixed_layout=fixed)
    best_score, _, _, evaluations = brute_force_best(model, train, topology, settings)
    result = search(model, train, topology, settings)
    assert result.plans[0].score == pytest.approx(best_score, rel=1e-12)
    assert result.stats.time_evaluations < evaluations
    if fixed:
        assert result.plans[0].layout.pp == fixed["pp"]
        assert result.plans[0].options["pipeline_schedule"] in SCHEDULES


@pytest.mark.parametrize("stack", stack_names())
def test_search_equals_brute_force_with_pipelines_under_every_stack(stack):
    model = get_model_preset("llama3-8b")
    topology = default_topology("h100-80gb", 8, 8)
    train = TrainSpec(seq_len=16384)
    settings = PlanSettings(top_k=3, fixed_layout={"pp": 4}, stack=stack)
    assert_search_equals_brute_force(model, train, topology, settings)


def test_schedule_branches_keep_the_lattice_monotone():
    """Inside one (ZeRO, schedule, chunks, micro-batch) branch, up every axis memory never grows and the
    step never gets faster: what the floors and the best-first order rely on."""
    model = get_model_preset("llama3-8b")
    topology = default_topology("h100-80gb", 8, 8)
    layout = Layout(pp=4, dp_shard=2)
    s = _Searcher(model, TrainSpec(seq_len=8192), topology, PlanSettings(), None)
    branches = s.lattices(layout)
    seen = {(b.values(b.bottom)["pipeline_schedule"], b.values(b.bottom)["virtual_stages"]) for b in branches}
    assert seen == {("zero_bubble", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)}  # 8 chunks from pp=8 up
    for lattice in branches[:6]:
        scored = {}
        for combo in itertools.product(*(range(len(a.values)) for a in lattice.axes)):
            if invalid_reason(lattice.values(combo)) is None:
                scored[combo] = s.timed(layout, combo, lattice)
        for combo, low in scored.items():
            for nxt in lattice.successors(combo):
                high = scored.get(nxt)
                if high is None:
                    continue
                assert high.report.total <= low.report.total
                assert high.time.step_s / high.time.tokens_per_step >= \
                    low.time.step_s / low.time.tokens_per_step * (1 - 1e-12)


def test_1f1b_never_beats_zero_bubble_so_it_is_searched_only_when_pinned():
    model = get_model_preset("llama3-8b")
    topology = default_topology("h100-80gb", 8, 8)
    train = TrainSpec(seq_len=8192)
    free = search(model, train, topology, PlanSettings(top_k=1, fixed_layout={"pp": 2}))
    pinned = search(model, train, topology, PlanSettings(top_k=1, fixed_layout={"pp": 2},
                                                         fixed_options={"pipeline_schedule": "1f1b"}))
    assert pinned.plans[0].options["pipeline_schedule"] == "1f1b"
    assert pinned.plans[0].score >= free.plans[0].score


def test_metas_405b_layout_is_in_the_16384_gpu_space():
    model = get_model_preset("llama3-405b")
    space = layout_space(16384, model, TrainSpec(seq_len=131072), 8)
    assert Layout(pp=16, tp=8, ring=16, dp_shard=8) in set(space.layouts)
    assert max(layout.pp for layout in space.layouts) == 64  # 126 layers: at most 64 power-of-two stages


def _cli(*args):
    return subprocess.run([SP_PLAN, *args], capture_output=True, text=True, timeout=300, check=False)


def test_estimate_cli_reports_the_pipeline():
    out = _cli("estimate", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--pp", "4", "--ulysses", "2",
               "--grad-accum", "8", "--schedule", "interleaved_1f1b", "--virtual-stages", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["layout"]["pp"] == 4 and data["layout"]["ulysses"] == 2
    pipe = data["detail"]["pipeline"]
    assert sum(pipe["stage_layers"]) == 32 and len(pipe["stage_totals"]) == 4
    assert data["memory"]["total"] == max(pipe["stage_totals"])
    assert data["time"]["breakdown"]["pipeline_bubble_s"] > 0 and data["comm"]["per_step_by_strategy"]["pipeline"] > 0
    text = _cli("estimate", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--pp", "4",
                "--grad-accum", "8", "--stage-layers", "6,9,9,8")
    assert text.returncode == 0 and "pp=4" in text.stdout


@pytest.mark.parametrize("args, message", [
    (["--pp", "4", "--grad-accum", "6", "--virtual-stages", "2"], "multiple of pp=4"),
    (["--pp", "4", "--grad-accum", "8", "--schedule", "1f1b", "--virtual-stages", "2"],
     "needs pipeline_schedule interleaved_1f1b"),
    (["--pp", "4", "--stage-layers", "8,8,8"], "lists 3 stages but pp=4"),
    (["--pp", "4", "--stage-layers", "8,8,8,9"], "sum to 33"),
    (["--pp", "4", "--stage-layers", "8,x"], "comma-separated list"),
    (["--pp", "8", "--mode", "prefill"], "training only"),
])
def test_estimate_cli_errors_are_one_line(args, message):
    out = _cli("estimate", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", *args)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_plan_and_capacity_pin_the_pipeline():
    out = _cli("plan", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--pp", "2",
               "--schedule", "zero_bubble", "--json", "--top", "1")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["plans"][0]
    assert plan["layout"]["pp"] == 2 and plan["options"]["pipeline_schedule"] == "zero_bubble"
    bad = _cli("plan", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--stage-layers", "16,16")
    assert bad.returncode != 0 and "--pp 2" in bad.stderr and "Traceback" not in bad.stderr
    cap = _cli("capacity", "--model", "llama3-8b", "--gpus", "8", "--pp", "2", "--json")
    assert cap.returncode == 0, cap.stderr
    data = json.loads(cap.stdout)
    assert data["plan"]["layout"]["pp"] == 2 and data["plan"]["options"]["pipeline_schedule"] in SCHEDULES
    assert data["max_seq_len"] > 0 and "pp=2" in data["bound_by"]
    sweep = _cli("capacity", "--model", "llama3-8b", "--seq-len", "32K", "--sweep", "gpus=8,16", "--pp", "2")
    assert sweep.returncode == 0, sweep.stderr
    rows = [line for line in sweep.stdout.splitlines() if line.strip().startswith(("8 ", "16 "))]
    assert len(rows) == 2 and all("pp=2" in r and ("ZB-H1" in r or "interleaved 1F1B" in r) for r in rows)


def test_a_plan_file_written_before_pp_loads_with_pp_1(tmp_path):
    import yaml
    from sp_plan.planner.plan import load_plan

    path = tmp_path / "plan.yaml"
    out = _cli("plan", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--pp", "1", "--out", str(path))
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(path.read_text())
    assert data["layout"]["pp"] == 1
    for key in ("pipeline_schedule", "virtual_stages", "stage_layers"):  # as an older sp-plan wrote it
        data["train"].pop(key, None)
    del data["layout"]["pp"]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data))
    plan = load_plan(old)
    assert plan.layout.pp == 1 and plan.layout == load_plan(path).layout
    assert plan.train.pipeline_schedule == "1f1b" and plan.train.virtual_stages == 1
