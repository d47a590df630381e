"""Stacks and calibration files everywhere a plan is made (issue 12): --stack/--calibration on estimate,
plan, capacity and export; one resolved CostProfile per search; memo tables never share an answer
between stacks; plans record what they assumed; techniques pinned off stay off; --max-offload-gb;
export re-checks a plan under the stack its launcher runs; one-line errors.

Pure planner tests (no torch) except the auto_configure ones at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.memory import MemoryAssumptions, memory_core
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.time_model import OffloadTraffic, step_time
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner import search as search_module
from sp_plan.cli.main import cli, main
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.export import check_under_stack, target_stack, to_deepspeed
from sp_plan.planner.options import conflicting_pins
from sp_plan.planner.plan import Hardware, Plan, load_plan
from sp_plan.planner.search import PlanSettings, resolve_settings, search

GPU = "h100-80gb"
TECHNIQUES = ("tiled_mlp", "tiled_loss", "offload_checkpoints", "offload_optimizer", "offload_params")
OFFLOADS = ("offload_checkpoints", "offload_optimizer", "offload_params")
ESTIMATE = ["--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8", "--json"]
PLAN = ["--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--top", "2", "--json"]


def invoke(*args: str):
    result = CliRunner().invoke(cli, list(args))
    return result


def ok_json(*args: str) -> dict:
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def stack_file(tmp_path: Path, name: str = "fat", memory: dict | None = None, time: dict | None = None) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "memory": memory or {}, "time": time or {}}))
    return str(path)


def calibration_file(tmp_path: Path, name: str = "cal", **fields) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"kind": "sp-plan-calibration", "version": 1, **fields}))
    return str(path)


# ----- every command takes --stack and --calibration ---------------------------------------------------


@pytest.mark.parametrize("stack", ["sp-plan", "hf-deepspeed", "torchtitan"])
def test_estimate_plan_and_capacity_accept_every_shipped_stack(stack):
    est = ok_json("estimate", *ESTIMATE, "--stack", stack)
    assert est["detail"]["stack"] == stack
    plan = ok_json("plan", *PLAN, "--stack", stack)
    assert plan["stack"] == stack and plan["calibration"] is None and plan["plans"]
    # ring: the sequence degree every shipped stack runs (torch context parallel has no Ulysses)
    cap = ok_json("capacity", "--model", "llama3-8b", "--gpus", "8", "--ring", "8", "--zero", "3",
                  "--checkpointing", "full", "--stack", stack, "--json")
    assert cap["stack"] == stack and cap["max_seq_len"] > 0


def test_every_command_takes_a_calibration_file_and_the_tables_name_it(tmp_path):
    cal = calibration_file(tmp_path, memory={"fragmentation_fraction": 0.2})
    est = ok_json("estimate", *ESTIMATE, "--calibration", cal)
    assert est["detail"]["stack"] == "sp-plan+calibration"
    plan = ok_json("plan", *PLAN, "--calibration", cal)
    assert plan["calibration"] == str(Path(cal).resolve()) and plan["stack"] == "sp-plan"
    cap = ok_json("capacity", "--model", "llama3-8b", "--seq-len", "32K", "--max-gpus", "8", "--calibration", cal,
                  "--json")
    assert cap["calibration"] == str(Path(cal).resolve())
    table = invoke("plan", *PLAN[:-1], "--stack", "hf-deepspeed", "--calibration", cal)
    assert table.exit_code == 0, table.output
    assert f"stack hf-deepspeed, calibration {Path(cal).resolve()}" in table.output.splitlines()[0]
    est_table = invoke("estimate", *ESTIMATE[:-1], "--stack", "torchtitan")
    assert "stack torchtitan" in est_table.output.splitlines()[0]


def test_a_calibrations_own_stack_is_used_when_no_stack_is_given(tmp_path):
    cal = calibration_file(tmp_path, stack="hf-deepspeed")
    plan = ok_json("plan", *PLAN, "--calibration", cal)
    assert plan["stack"] == "hf-deepspeed"
    est = ok_json("estimate", *ESTIMATE, "--calibration", cal)
    assert est["detail"]["stack"] == "hf-deepspeed"


# ----- stacks change predictions ---------------------------------------------------------------------


def test_a_stack_files_fragmentation_changes_memory_by_the_expected_amount(tmp_path):
    low = stack_file(tmp_path, "low", memory={"fragmentation_fraction": 0.05})
    high = stack_file(tmp_path, "high", memory={"fragmentation_fraction": 0.3})
    a = ok_json("estimate", *ESTIMATE, "--stack", low)
    b = ok_json("estimate", *ESTIMATE, "--stack", high)
    assert (a["detail"]["stack"], b["detail"]["stack"]) == ("low", "high")
    peak = a["memory"]["peak_allocated"]
    assert b["memory"]["peak_allocated"] == peak  # fragmentation is reserve above the allocated peak
    assert b["memory"]["total"] - a["memory"]["total"] == pytest.approx(0.25 * peak, abs=2)
    # The file's memory section is exactly the MemoryAssumptions the Python API takes.
    model, train = get_model_preset("llama3-8b"), TrainSpec(seq_len=32768)
    layout = Layout.for_world(8, ulysses=8)
    api = estimate(model, train, layout, default_topology(GPU, 8, 8),
                   MemoryAssumptions(fragmentation_fraction=0.3))
    assert api.memory.total == b["memory"]["total"]


def test_calibration_overrides_apply_on_top_of_the_stack_and_assume_on_top_of_both(tmp_path):
    base = stack_file(tmp_path, "base", memory={"fragmentation_fraction": 0.1})
    cal = calibration_file(tmp_path, memory={"fragmentation_fraction": 0.2})
    stack_only = ok_json("estimate", *ESTIMATE, "--stack", base)["memory"]
    calibrated = ok_json("estimate", *ESTIMATE, "--stack", base, "--calibration", cal)["memory"]
    assumed = ok_json("estimate", *ESTIMATE, "--stack", base, "--calibration", cal,
                      "--assume", "fragmentation_fraction=0.4")["memory"]
    peak = stack_only["peak_allocated"]
    assert calibrated["total"] - stack_only["total"] == pytest.approx(0.1 * peak, abs=2)
    assert assumed["total"] - stack_only["total"] == pytest.approx(0.3 * peak, abs=2)
    # --assume overrides only its key: the stack's other memory assumptions survive it.
    eager = stack_file(tmp_path, "eager", memory={"norm_implementation": "eager"})
    both = ok_json("estimate", *ESTIMATE, "--checkpointing", "none", "--stack", eager,
                   "--assume", "fragmentation_fraction=0.05")
    assert both["detail"]["assumptions"]["norm_implementation"] == "eager"


def test_the_hf_deepspeed_stack_costs_more_time_than_sp_plans_runtime(tmp_path):
    """DeepSpeed ZeRO-3's per-parameter hooks (StackTime.layer_overhead_s) cost time that FSDP2's do not;
    a stack file that only adds layer overhead makes the same layout strictly slower."""
    ours = ok_json("estimate", *ESTIMATE, "--stack", "sp-plan")["time"]["step_s"]
    ds = ok_json("estimate", *ESTIMATE, "--stack", "hf-deepspeed")["time"]["step_s"]
    assert ds > ours
    sp = yaml.safe_load((Path(__file__).parents[1] / "cost_models/data/stacks/sp-plan.yaml").read_text())
    slow = stack_file(tmp_path, "slow", memory=sp["memory"],
                      time={**sp["time"], "layer_overhead_s": sp["time"]["layer_overhead_s"] + 1e-2})
    assert ok_json("estimate", *ESTIMATE, "--stack", slow)["time"]["step_s"] > ours


# ----- one profile per search, and no cache shared between stacks -----------------------------------


def _pinned_settings(**kw) -> PlanSettings:
    fixed = {"zero_stage": 3, "checkpointing": "full", **{k: False for k in TECHNIQUES}}
    return PlanSettings(top_k=1, fixed_layout={"ulysses": 8}, fixed_options=fixed, micro_batch_fixed=True, **kw)


def test_search_resolves_one_profile_and_hands_it_to_every_evaluation(tmp_path, monkeypatch):
    cal = calibration_file(tmp_path, gpu=GPU, kernels={"gemm.peak_fraction": 0.5},
                           memory={"fragmentation_fraction": 0.2})
    seen: dict[str, list] = {"time": [], "memory": [], "host": [], "estimate": []}

    def spy(name, real, pick):
        def wrapper(*args, **kwargs):
            seen[name].append(pick(args, kwargs))
            return real(*args, **kwargs)
        monkeypatch.setattr(search_module, real.__name__, wrapper)

    spy("time", search_module.step_time, lambda a, k: a[5])
    spy("memory", search_module.memory_core, lambda a, k: a[3])
    spy("host", search_module.host_memory, lambda a, k: a[3])
    spy("estimate", search_module.estimate, lambda a, k: k["profile"])
    model = get_model_preset("llama3-70b")
    topology = default_topology(GPU, 8, 8)
    result = search(model, TrainSpec(seq_len=32768), topology,
                    PlanSettings(top_k=2, stack="hf-deepspeed", calibration=cal, assume={"cuda_context_bytes": 1 << 29}))
    assert result.plans and result.stack == "hf-deepspeed" and result.profile_name == "hf-deepspeed+calibration"
    profile = resolve_settings(PlanSettings(stack="hf-deepspeed", calibration=cal,
                                            assume={"cuda_context_bytes": 1 << 29}), GPU).profile
    assert seen["time"] and seen["memory"] and seen["host"] and len(seen["estimate"]) == len(result.plans)
    assert all(p is profile for p in seen["time"] + seen["estimate"])
    assert all(a is profile.memory for a in seen["memory"] + seen["host"])
    assert profile.kernels.gemm.peak_fraction == 0.5
    assert profile.memory.fragmentation_fraction == 0.2 and profile.memory.cuda_context_bytes == 1 << 29


def test_an_explicit_assumptions_argument_replaces_the_stacks_memory(tmp_path):
    fat = stack_file(tmp_path, memory={"fragmentation_fraction": 0.5})
    model, train, topology = get_model_preset("llama3-8b"), TrainSpec(seq_len=32768), default_topology(GPU, 8, 8)
    mine = MemoryAssumptions(fragmentation_fraction=0.0)
    result = search(model, train, topology, _pinned_settings(stack=fat), mine)
    plain = search(model, train, topology, _pinned_settings(assumptions=mine))
    assert result.plans[0].estimate.memory.total == plain.plans[0].estimate.memory.total
    assert result.plans[0].estimate.detail.stack == "fat"


def test_same_layout_under_two_stacks_never_shares_a_cached_answer(tmp_path):
    """Memory and time are memoized on their inputs; alternating between stacks whose assumptions differ
    must give each stack its own answer every time (a memo keyed without the assumptions would hand the
    second stack the first one's)."""
    low = stack_file(tmp_path, "low", memory={"fragmentation_fraction": 0.05})
    high = stack_file(tmp_path, "high", memory={"fragmentation_fraction": 0.3, "norm_implementation": "eager"})
    model, train, topology = get_model_preset("llama3-8b"), TrainSpec(seq_len=32768), default_topology(GPU, 8, 8)
    layout = Layout.for_world(8, ulysses=8)
    totals: dict[str, set] = {low: set(), high: set()}
    steps: dict[str, set] = {"sp-plan": set(), "hf-deepspeed": set()}
    for _ in range(3):
        for ref in (low, high):
            result = search(model, train, topology, _pinned_settings(stack=ref))
            totals[ref].add(result.plans[0].estimate.memory.total)
            # Fresh profile objects each time (equal values, new identities) and the planner's inner call.
            profile = resolve_profile(GPU, ref)
            totals[ref].add(memory_core(model, result.plans[0].train, layout, profile.memory).total)
        for ref in steps:
            profile = resolve_profile(GPU, ref)
            steps[ref].add(step_time(model, train, layout, topology, OffloadTraffic(), profile).step_s)
            steps[ref].add(estimate(model, train, layout, topology, profile=profile).time.step_s)
    assert len(totals[low]) == 1 and len(totals[high]) == 1
    assert totals[low] != totals[high]
    assert len(steps["sp-plan"]) == 1 and len(steps["hf-deepspeed"]) == 1
    assert steps["sp-plan"] != steps["hf-deepspeed"]


def test_an_edited_stack_file_is_read_again(tmp_path):
    path = stack_file(tmp_path, "edit", memory={"fragmentation_fraction": 0.05})
    first = resolve_settings(PlanSettings(stack=path), GPU).profile
    assert resolve_settings(PlanSettings(stack=path), GPU).profile is first  # memoized: one object
    Path(path).write_text(yaml.safe_dump({"name": "edit", "memory": {"fragmentation_fraction": 0.25}}))
    second = resolve_settings(PlanSettings(stack=path), GPU).profile
    assert second.memory.fragmentation_fraction == 0.25


# ----- plan files record the stack ---------------------------------------------------------------------


def test_plan_files_round_trip_the_stack_and_calibration(tmp_path):
    cal = calibration_file(tmp_path, memory={"fragmentation_fraction": 0.1})
    out = tmp_path / "plan.yaml"
    result = invoke("plan", *PLAN[:-1], "--stack", "hf-deepspeed", "--calibration", cal, "--out", str(out))
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.stack == "hf-deepspeed" and plan.calibration == str(Path(cal).resolve())
    assert plan.estimate["memory"]["total"] > 0
    again = tmp_path / "again.yaml"
    plan.save(again)
    assert load_plan(again) == plan
    # A stack file is recorded by absolute path, so the plan means the same from any directory.
    fat = stack_file(tmp_path, memory={"fragmentation_fraction": 0.06})
    out2 = tmp_path / "plan2.yaml"
    assert invoke("plan", *PLAN[:-1], "--stack", fat, "--out", str(out2)).exit_code == 0
    assert load_plan(out2).stack == str(Path(fat).resolve()) and load_plan(out2).calibration is None


def test_plan_files_from_before_stacks_load_as_sp_plan(tmp_path):
    plan = _plan_file(tmp_path, ulysses=8)
    data = yaml.safe_load(Path(plan).read_text())
    data.pop("stack"), data.pop("calibration")
    Path(plan).write_text(yaml.safe_dump(data))
    loaded = load_plan(plan)
    assert loaded.stack == "sp-plan" and loaded.calibration is None


# ----- techniques pinned off -----------------------------------------------------------------------------


def test_every_technique_has_an_off_switch_on_every_command():
    from sp_plan.cli.commands import capacity, estimate as estimate_cmd, plan, validate

    for command in (estimate_cmd.command, plan.command, capacity.command, validate.command):
        flags = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
        for technique in TECHNIQUES:
            name = technique.replace("_", "-")
            assert {f"--{name}", f"--no-{name}"} <= flags, (command.name, technique)
    for command in (plan.command, capacity.command):
        assert "--max-offload-gb" in {o for p in command.params for o in p.opts}


def test_plan_pinned_off_on_the_command_line_never_shows_the_technique():
    # 70B at 32K on 8 GPUs: the free search offloads and tiles; pinned off, nothing it picks does.
    free = ok_json("plan", "--model", "llama3-70b", "--seq-len", "32K", "--gpus", "8", "--top", "3", "--json")
    assert any(p["options"]["tiled_loss"] for p in free["plans"])
    off = ok_json("plan", "--model", "llama3-70b", "--seq-len", "32K", "--gpus", "8", "--top", "3", "--json",
                  "--no-tiled-loss", "--no-tiled-mlp")
    assert off["plans"]
    for p in off["plans"] + [r for r in off["rejected"] if "options" in r]:
        assert not p["options"]["tiled_loss"] and not p["options"]["tiled_mlp"]
    est = ok_json("estimate", *ESTIMATE, "--no-tiled-mlp", "--no-offload-optimizer")
    assert est["fits"] in (True, False)


def test_capacity_with_a_technique_pinned_off_reaches_no_further():
    args = ["capacity", "--model", "llama3-8b", "--gpus", "8", "--json"]
    free = ok_json(*args)["max_seq_len"]
    off = ok_json(*args, "--no-tiled-mlp", "--no-tiled-loss", "--no-offload-checkpoints")
    assert off["max_seq_len"] <= free
    opts = off["plan"]["options"]
    assert not (opts["tiled_mlp"] or opts["tiled_loss"] or opts["offload_checkpoints"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pins=st.dictionaries(st.sampled_from(TECHNIQUES), st.booleans(), min_size=1, max_size=5))
def test_property_pinned_techniques_hold_in_every_plan_and_rejection(pins):
    assume(conflicting_pins(pins) is None)
    model = get_model_preset("llama3-70b")
    result = search(model, TrainSpec(seq_len=16384), default_topology(GPU, 8, 8),
                    PlanSettings(top_k=3, fixed_options=pins))
    for plan in result.plans:
        assert all(plan.options[k] == v for k, v in pins.items()), (pins, plan.options)
    for rejection in result.rejected:
        if rejection.options:
            assert all(rejection.options.get(k, v) == v for k, v in pins.items()), (pins, rejection)


# ----- --max-offload-gb --------------------------------------------------------------------------------


def test_max_offload_gb_zero_forbids_offloading_and_says_so():
    args = ["plan", "--model", "llama3-70b", "--seq-len", "32K", "--gpus", "8", "--top", "3", "--json"]
    free = ok_json(*args)
    assert any(any(p["options"][k] for k in OFFLOADS) for p in free["plans"])
    result = invoke(*args, "--max-offload-gb", "0")
    assert result.exit_code == 1  # nothing fits 70B on 8 GPUs without offloading
    data = json.loads(result.stdout)
    assert not data["plans"]
    for r in data["rejected"]:
        if r.get("options"):
            assert not any(r["options"].get(k) for k in OFFLOADS), r
    assert any("--max-offload-gb 0" in r["reason"] for r in data["rejected"])
    assert any("--max-offload-gb 0" in s for s in data["suggestions"])
    # 32 GPUs fit without offloading: the plans then offload nothing.
    on16 = ok_json("plan", "--model", "llama3-70b", "--seq-len", "32K", "--gpus", "32", "--top", "3", "--json",
                   "--max-offload-gb", "0")
    assert on16["plans"] and all(p["host_memory"]["total"] == 0 for p in on16["plans"])


def test_max_offload_gb_bounds_host_memory_and_names_the_limit():
    model, train, topology = get_model_preset("llama3-70b"), TrainSpec(seq_len=32768), default_topology(GPU, 8, 8)
    free = search(model, train, topology, PlanSettings(top_k=3))
    need = min(p.estimate.host_memory.total for p in free.plans)
    assert need > 0
    roomy = search(model, train, topology, PlanSettings(top_k=3, max_offload_bytes=need))
    assert roomy.plans and all(p.estimate.host_memory.total <= need for p in roomy.plans)
    tight = search(model, train, topology, PlanSettings(top_k=3, max_offload_bytes=need / 4))
    assert all(p.estimate.host_memory.total <= need / 4 for p in tight.plans)
    assert any("--max-offload-gb limit" in r.reason for r in tight.rejected if r.kind == "memory")


def test_max_offload_gb_zero_with_an_offload_pinned_on_is_an_error():
    result = invoke("plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--offload-optimizer",
                    "--max-offload-gb", "0")
    assert result.exit_code != 0 and "forbids offloading" in str(result.exception)


# ----- export re-checks under the launcher's stack ----------------------------------------------------


def _plan_file(tmp_path: Path, name: str = "plan", stack: str = "sp-plan", **degrees) -> str:
    model, train = get_model_preset("llama3-8b"), TrainSpec(seq_len=131072, zero_stage=3, offload_optimizer=True)
    layout = Layout.for_world(8, **degrees)
    est = estimate(model, train, layout, default_topology(GPU, 8, 8)).to_json_dict()
    plan = Plan(model=model, train=train, layout=layout,
                hardware=Hardware(num_gpus=8, gpus_per_node=8, gpu=GPU, topology="dgx-h100"),
                estimate={k: est[k] for k in ("memory", "host_memory", "fits", "comm", "time")}, stack=stack)
    path = tmp_path / f"{name}.yaml"
    plan.save(path)
    return str(path)


def test_export_targets_default_to_the_stack_their_launcher_runs(tmp_path):
    ulysses = load_plan(_plan_file(tmp_path, "u", ulysses=8))
    ring = load_plan(_plan_file(tmp_path, "r", ring=8))
    assert target_stack(ulysses, "deepspeed") == "hf-deepspeed"
    assert target_stack(ulysses, "accelerate") == "hf-deepspeed"  # Accelerate's sp is DeepSpeed ALST
    assert target_stack(ring, "accelerate") == "hf-fsdp2"  # a transformers model under FSDP2; cp is torch CP
    assert target_stack(ring, "torchrun") == "sp-plan"
    own = load_plan(_plan_file(tmp_path, "own", stack="torchtitan", ring=8))
    assert target_stack(own, "torchrun") == "torchtitan"


def test_export_notes_the_memory_under_the_target_stack(tmp_path):
    plan = _plan_file(tmp_path, ulysses=8)
    result = invoke("export", plan, "--to", "deepspeed")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sequence_parallel_size"] == 8
    assert "under the hf-deepspeed stack (what deepspeed runs) this plan is predicted to need" in result.stderr
    ring = _plan_file(tmp_path, "ring", ring=8)
    result = invoke("export", ring, "--to", "accelerate")
    assert result.exit_code == 0, result.output
    assert "under the hf-fsdp2 stack (what accelerate runs)" in result.stderr
    # torchrun runs the plan's own stack: nothing to re-check unless asked.
    result = invoke("export", ring, "--to", "torchrun")
    assert result.exit_code == 0 and "predicted to need" not in result.stderr
    result = invoke("export", ring, "--to", "torchrun", "--stack", "hf-deepspeed")
    assert "under the hf-deepspeed stack this plan is predicted to need" in result.stderr


def test_export_refuses_a_plan_that_does_not_fit_under_the_target_stack(tmp_path):
    plan = _plan_file(tmp_path, ulysses=8)
    fat = stack_file(tmp_path, memory={"fragmentation_fraction": 2.0})
    with pytest.raises(PlannerError) as info:
        check_under_stack(load_plan(plan), "deepspeed", stack=fat)
    text = str(info.value)
    assert "under the fat stack this plan (ulysses=8) needs" in text and "GB usable" in text
    assert "(planned under sp-plan:" in text
    assert f"sp-plan plan --model llama3-8b --seq-len 131072 --gpus 8 --topology dgx-h100 --ring 1 --stack {fat}" in text
    # The CLI: one line on stderr, exit 2, nothing written.
    out = tmp_path / "ds.json"
    code, err = run_main(["export", plan, "--to", "deepspeed", "--stack", fat, "--out", str(out)])
    assert code == 2 and "re-plan for that stack" in err and not out.exists()
    # It would fit under sp-plan: the default-stack export of the same plan passes.
    assert to_deepspeed(load_plan(plan)).content["sequence_parallel_size"] == 8


# ----- errors: one line, exit 2 -----------------------------------------------------------------------


def run_main(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exc:
            return int(exc.code or 0), err.getvalue()
    return 0, err.getvalue()


@pytest.mark.parametrize("command", ["estimate", "plan", "capacity"])
def test_stack_and_calibration_errors_are_one_line_with_exit_2(tmp_path, command):
    args = {"estimate": ESTIMATE[:-1], "plan": PLAN[:-1],
            "capacity": ["--model", "llama3-8b", "--seq-len", "32K", "--max-gpus", "8"]}[command]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("kind: [unclosed")
    wrong_kind = calibration_file(tmp_path, "wrong")
    Path(wrong_kind).write_text("kind: something-else\n")
    other_gpu = calibration_file(tmp_path, "a100", gpu="a100-80gb", kernels={"gemm.peak_fraction": 0.6})
    bad_stack = stack_file(tmp_path, "badstack", memory={"fragmentation_fraction": -1})
    cases = [
        (["--stack", "no-such-stack"], "unknown stack 'no-such-stack'"),
        (["--stack", str(tmp_path / "missing.yaml")], "does not exist"),
        (["--stack", bad_stack], "fragmentation_fraction"),
        (["--calibration", str(tmp_path / "missing.yaml")], "calibration file"),
        (["--calibration", str(bad_yaml)], "not valid YAML"),
        (["--calibration", wrong_kind], "calibration file"),
        (["--calibration", other_gpu], "fitted on a100-80gb but this plan runs on h100-80gb"),
    ]
    for extra, words in cases:
        code, err = run_main([command, *args, *extra])
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and words in lines[0], (extra, err)
        assert lines[0].startswith("error: ") and "Traceback" not in err


def test_export_stack_errors_are_one_line_with_exit_2(tmp_path):
    plan = _plan_file(tmp_path, ulysses=8)
    code, err = run_main(["export", plan, "--to", "deepspeed", "--stack", "nope"])
    assert code == 2 and err.startswith("error: unknown stack") and len(err.strip().splitlines()) == 1


# ----- auto_configure (torch) ---------------------------------------------------------------------------


def _tiny_spec():
    from sp_plan.cost_models import ModelSpec

    return ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=64)


def test_plan_for_combines_the_stack_with_the_model_kinds_memory_overrides(tmp_path):
    pytest.importorskip("torch")
    from sp_plan.runtime.auto import plan_for

    fat = stack_file(tmp_path, memory={"fragmentation_fraction": 0.3})
    spec, base = _tiny_spec(), TrainSpec(seq_len=64, dtype="fp32")
    topology = default_topology(GPU, 2, 2)
    default = plan_for(spec, base, topology, 2, family="hf")
    assert default.stack == "sp-plan" and default.calibration is None
    hf = plan_for(spec, base, topology, 2, family="hf", stack=fat)
    assert hf.stack == str(Path(fat).resolve())
    expected = estimate(spec, hf.train, hf.layout, topology,
                        profile=resolve_profile(GPU, fat, assume={"norm_implementation": "eager"}))
    assert hf.estimate["memory"]["total"] == expected.memory.total
    assert hf.estimate["detail"]["assumptions"]["norm_implementation"] == "eager"
    assert hf.estimate["detail"]["assumptions"]["fragmentation_fraction"] == 0.3


def _auto_rank(rank: int, world: int, stack: str) -> dict:
    import torch

    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.models import LlamaModel

    model = LlamaModel(_tiny_spec())
    model.init_weights(generator=torch.Generator().manual_seed(0))
    setup = auto_configure(model, seq_len=64, topology="dgx-h100", stack=stack)
    return {"stack": setup.plan.stack, "detail_stack": setup.plan.estimate["detail"]["stack"]}


@pytest.mark.multiproc
def test_auto_configure_plans_with_the_stack_it_is_given(tmp_path):
    pytest.importorskip("torch")
    from tests.distributed import run_ranks

    fat = stack_file(tmp_path, memory={"fragmentation_fraction": 0.3})
    for r in run_ranks(2, _auto_rank, fat, timeout=120):
        assert r == {"stack": str(Path(fat).resolve()), "detail_stack": "fat"}


def test_export_of_a_plan_whose_topology_cannot_be_rebuilt_still_exports_with_a_note(tmp_path):
    plan = load_plan(_plan_file(tmp_path, ulysses=8))
    odd = plan.model_copy(update={"hardware": plan.hardware.model_copy(
        update={"topology": str(tmp_path / "gone.yaml"), "gpu": "cpu-probe"})})
    notes = check_under_stack(odd, "deepspeed")
    assert len(notes) == 1 and "not re-checked under the hf-deepspeed stack" in notes[0]
    # A missing topology file with a known GPU falls back to that GPU's natural machine.
    known = plan.model_copy(update={"hardware": plan.hardware.model_copy(update={"topology": str(tmp_path / "gone.yaml")})})
    assert "predicted to need" in check_under_stack(known, "deepspeed")[0]


@pytest.mark.parametrize("stack", ["torchtitan", "hf-fsdp2"])
def test_stacks_without_ulysses_never_plan_it_and_say_why_when_pinned(stack):
    plan = ok_json("plan", *PLAN, "--stack", stack)
    assert plan["plans"] and all(p["layout"].get("ulysses", 1) == 1 for p in plan["plans"])
    code, err = run_main(["plan", *PLAN[:-1], "--stack", stack, "--ulysses", "2"])
    assert code != 0 and "ulysses=2" in err and "ring" in err and "Traceback" not in err
