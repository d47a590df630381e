"""Issue 16, "Nothing lost, nothing silent": regression tests for each CLI / planner / cost-model defect.

Each test failed before its fix: a traceback where a one-line error belongs, exit 0 where nothing fit,
outputs written in place, plan files that loaded half or inconsistent, hostile config.json and run files
that crashed, absurd calibrations printed as successes, and a calibrate that was quadratic in its rows.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import yaml

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.model_spec import load_model
from sp_plan.cost_models.profile import load_calibration, resolve_profile
from sp_plan.cost_models.topology import load_topology
from sp_plan.cli.main import main
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.plan import load_plan

SMALL_PLAN = ["--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--top", "1"]


def sp(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI entry point in-process: (exit code, stdout, stderr), as the console script would."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code: int, err: str, needle: str = "") -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert needle in err, err


# ----- topo show --------------------------------------------------------------------------------------


def test_topo_show_prints_a_preset_with_unset_efficiencies_and_writes_out(tmp_path, capsys):
    out = tmp_path / "t.yaml"
    code, stdout, err = sp(["topo", "show", "dgx-h100", "--out", out], capsys)
    assert code == 0, err
    # The preset leaves the compute efficiencies unset: the kernel model's values are shown, labelled.
    line = next(ln for ln in stdout.splitlines() if "Compute efficiency" in ln)
    assert "(kernel model)" in line and "matmul 0." in line
    assert load_topology(out).spec == load_topology("dgx-h100").spec


def test_topo_show_renders_every_preset_and_a_file_with_its_own_efficiencies(tmp_path, capsys):
    from sp_plan.cost_models.topology import preset_names
    from sp_plan.cost_models.topology.presets import spec_to_yaml

    for name in preset_names():
        code, stdout, err = sp(["topo", "show", name], capsys)
        assert code == 0 and "Compute efficiency" in stdout, (name, err)
    data = yaml.safe_load(spec_to_yaml(load_topology("l40s-pcie").spec))
    data.setdefault("calibration", {})["compute"] = {"matmul": 0.42}
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(data))
    code, stdout, err = sp(["topo", "show", path], capsys)
    assert code == 0, err
    line = next(ln for ln in stdout.splitlines() if "Compute efficiency" in ln)
    assert "matmul 0.42," in line and "attention fwd" in line and "(kernel model)" in line


# ----- exit codes: "no plan fits" is 1 -----------------------------------------------------------------


def test_plan_that_fits_nowhere_exits_1_with_the_closest_miss(capsys):
    code, stdout, err = sp(["plan", "--model", "llama3-405b", "--seq-len", "1M", "--gpus", "8"], capsys)
    assert code == 1, (stdout, err)
    assert "No plan fits." in stdout and "closest:" in stdout and "suggestion:" in stdout


@pytest.mark.parametrize("args", [
    ["--gpus", "1"],                             # longest sequence: not even one granule fits
    ["--seq-len", "4M", "--max-gpus", "8"],      # fewest GPUs: none up to --max-gpus
])
def test_capacity_that_fits_nowhere_exits_1_not_2(args, capsys):
    code, _, err = sp(["capacity", "--model", "llama3-405b", *args], capsys)
    assert code == 1, err
    assert err.startswith("no fit: ") and "closest" in err and "Traceback" not in err


# ----- outputs are atomic --------------------------------------------------------------------------------


def _failing_fsync(monkeypatch):
    """Every write of an output fails at its fsync (a full disk, a crash): the old file must survive."""
    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)


def test_plan_out_is_written_atomically(tmp_path, capsys, monkeypatch):
    out = tmp_path / "plan.yaml"
    out.write_text("previous plan\n")
    _failing_fsync(monkeypatch)
    code, _, err = sp(["plan", *SMALL_PLAN, "--out", out], capsys)
    assert code == 2 and "No space left" in err, err
    assert out.read_text() == "previous plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]  # no temporary file left behind


def test_export_topo_and_calibrate_outputs_are_atomic(tmp_path, capsys, monkeypatch):
    plan = tmp_path / "plan.yaml"
    assert sp(["plan", *SMALL_PLAN, "--out", plan], capsys)[0] == 0
    runs = tmp_path / "runs.csv"
    runs.write_text("model,seq_len,gpus,ulysses,topology,step_s\nllama3-8b,32768,8,8,dgx-h100,2.5\n")
    commands = {
        "export.json": ["export", plan, "--to", "torchrun"],
        "topo.yaml": ["topo", "show", "dgx-h100"],
        "cal.yaml": ["calibrate", runs],
    }
    for name in commands:
        (tmp_path / name).write_text("old\n")
    _failing_fsync(monkeypatch)
    for name, args in commands.items():
        code, _, err = sp([*args, "--out", tmp_path / name], capsys)
        assert code == 2 and "No space left" in err, (name, err)
        assert (tmp_path / name).read_text() == "old\n", name
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_capacity_plot_is_written_atomically_in_the_format_its_suffix_names(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    args = ["capacity", "--model", "llama3-8b", "--seq-len", "32K", "--sweep", "gpus=8", "--plot"]
    svg = tmp_path / "sweep.svg"
    code, _, err = sp([*args, svg], capsys)
    assert code == 0, err
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
    png = tmp_path / "sweep.png"
    _failing_fsync(monkeypatch)
    code, _, err = sp([*args, png], capsys)
    assert code == 2 and not png.exists(), err


# ----- plan files are complete and consistent ------------------------------------------------------------


@pytest.fixture
def plan_file(tmp_path, capsys) -> Path:
    out = tmp_path / "plan.yaml"
    code, _, err = sp(["plan", *SMALL_PLAN, "--out", out], capsys)
    assert code == 0, err
    return out


def test_a_plan_file_cut_short_does_not_load(plan_file):
    lines = plan_file.read_text().splitlines(keepends=True)
    assert lines[-1].startswith("end_of_plan: true")
    for cut in (len(lines) // 2, len(lines) - 1):
        plan_file.write_text("".join(lines[:cut]))
        with pytest.raises(PlannerError, match="cut short"):
            load_plan(plan_file)


def test_a_plan_whose_gpu_count_disagrees_with_its_layout_is_refused_by_export(plan_file, capsys):
    data = yaml.safe_load(plan_file.read_text())
    data["hardware"]["num_gpus"] = 16
    plan_file.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(CostModelError, match="num_gpus is 16 but the layout"):
        load_plan(plan_file)
    code, stdout, err = sp(["export", plan_file, "--to", "torchrun"], capsys)
    one_line_error(code, err, "num_gpus is 16")
    assert stdout == ""


def test_a_plan_with_an_estimate_missing_its_sections_is_refused(plan_file):
    data = yaml.safe_load(plan_file.read_text())
    del data["estimate"]["time"]
    plan_file.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(CostModelError, match="estimate lacks time"):
        load_plan(plan_file)


# ----- outputs into a missing directory, empty --topology --------------------------------------------------


@pytest.mark.parametrize("args", [
    ["plan", *SMALL_PLAN, "--out", "{missing}/plan.yaml"],
    ["topo", "show", "dgx-h100", "--out", "{missing}/t.yaml"],
    ["capacity", "--model", "llama3-8b", "--seq-len", "32K", "--sweep", "gpus=8", "--plot", "{missing}/p.png"],
    ["calibrate", "{runs}", "--out", "{missing}/cal.yaml"],
    ["export", "{plan}", "--to", "torchrun", "--out", "{missing}/run.sh"],
])
def test_outputs_into_a_missing_directory_are_one_line_errors(args, tmp_path, capsys, plan_file):
    runs = tmp_path / "runs.csv"
    runs.write_text("model,seq_len,gpus,step_s\nllama3-8b,32768,8,2.5\n")
    fields = {"missing": tmp_path / "no" / "such", "runs": runs, "plan": plan_file}
    code, _, err = sp([a.format(**fields) for a in args], capsys)
    one_line_error(code, err, "does not exist")


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_an_empty_topology_is_a_one_line_error(command, capsys):
    args = [command, "--model", "llama3-8b", "--seq-len", "32K", "--topology", ""]
    code, _, err = sp(args + (["--gpus", "8", "--ulysses", "8"] if command == "estimate" else []), capsys)
    one_line_error(code, err, "--topology is empty")


# ----- hostile config.json ----------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 32000}


@pytest.mark.parametrize("text, message", [
    (json.dumps({**LLAMA, "num_attention_heads": 0}), "'num_attention_heads' is 0"),
    (json.dumps(LLAMA).replace('"hidden_size": 1024', '"hidden_size": Infinity'), "finite whole number"),
    (json.dumps(LLAMA).replace('"vocab_size": 32000', '"vocab_size": NaN'), "finite whole number"),
    (json.dumps({**LLAMA, "num_hidden_layers": 1e400}).replace("Infinity", "1e400"), "finite whole number"),
    (json.dumps({**LLAMA, "num_hidden_layers": "4"}), "whole number"),
    (json.dumps({**LLAMA, "num_hidden_layers": True}), "whole number"),
    (json.dumps({**LLAMA, "num_hidden_layers": 2.5}), "finite whole number"),
    (json.dumps({**LLAMA, "hidden_size": -1024}), "between 1 and"),
    (json.dumps({**LLAMA, "num_attention_heads": 7}), "not a multiple of num_attention_heads 7"),
    (json.dumps({**LLAMA, "num_key_value_heads": 3}), "not a multiple of num_key_value_heads 3"),
    (json.dumps({**LLAMA, "rope_scaling": {}})[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "nests deeper"),
    (b"\xff\xfe\x00garbage", "not a UTF-8 text file"),
])
def test_hostile_config_json_is_a_one_line_error(text, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CostModelError, match=message):
        load_model(path)
    code, _, err = sp(["estimate", "--model", path, "--seq-len", "4K", "--gpus", "1"], capsys)
    one_line_error(code, err)


def test_a_valid_config_json_still_loads(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "num_key_value_heads": None, "head_dim": None}))
    model = load_model(path)
    assert (model.num_heads, model.num_kv_heads, model.head_dim) == (8, 8, 128)


# ----- calibrate: measured runs are validated -------------------------------------------------------------

HEADER = "model,seq_len,gpus,ulysses,topology,step_s\n"


@pytest.mark.parametrize("body, message", [
    ("llama3-8b,32768,8,8\n", "runs.csv:2: the row has 4 cells but the header has 6"),
    ("llama3-8b,32768,8,8,dgx-h100,2.5,extra\n", "runs.csv:2: the row has 7 cells"),
    ("llama3-8b,32768,8,8,dgx-h100,inf\n", "runs.csv:2: step_s = inf is outside"),
    ("llama3-8b,32768,8,8,dgx-h100,nan\n", "runs.csv:2: step_s = nan is outside"),
    ("llama3-8b,32768,8,8,dgx-h100,1e-308\n", "runs.csv:2: step_s = 1e-308 is outside"),
    ("llama3-8b,32768,8,8,dgx-h100,-2\n", "runs.csv:2: step_s = -2 is outside"),
    ("llama3-8b,32768,8,8,dgx-h100,fast\n", "runs.csv:2: step_s 'fast' is not a number"),
])
def test_bad_measured_runs_are_one_line_errors_naming_file_and_row(body, message, tmp_path, capsys):
    runs = tmp_path / "runs.csv"
    runs.write_text(HEADER + body)
    code, _, err = sp(["calibrate", runs, "--out", tmp_path / "cal.yaml"], capsys)
    one_line_error(code, err, message)
    assert not (tmp_path / "cal.yaml").exists()


def test_non_utf8_and_binary_run_files_are_one_line_errors(tmp_path, capsys):
    latin = tmp_path / "runs.csv"
    latin.write_bytes(HEADER.encode() + "llama3-8b,32768,8,8,dgx-h100,2.5 # \xe9t\xe9\n".encode("latin-1"))
    one_line_error(*sp(["calibrate", latin], capsys)[::2], "not UTF-8")
    binary = tmp_path / "report.json"
    binary.write_bytes(bytes(range(256)))
    one_line_error(*sp(["calibrate", binary], capsys)[::2], "not UTF-8")


def test_validate_reports_with_bad_measurements_are_one_line_errors(tmp_path, capsys):
    report = {"plan": {"model": get_model_preset("llama3-8b").model_dump(),
                       "train": {"seq_len": 32768}, "layout": {"ulysses": 8}},
              "time_topology": load_topology("dgx-h100").spec.model_dump(mode="json"),
              "ranks": [{"step_seconds": [1.0, float("inf")]}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    one_line_error(*sp(["calibrate", path], capsys)[::2], "step_s = inf is outside")
    report["ranks"] = [{"step_seconds": "slow"}]
    path.write_text(json.dumps(report))
    one_line_error(*sp(["calibrate", path], capsys)[::2], "must be a list")


# ----- calibration values are sane, and no absurd figure is printed as an answer ------------------------------


@pytest.mark.parametrize("kernels, message", [
    ({"gemm.peak_fraction": 1e-300}, "not a fraction of peak"),
    ({"attention.fa2.forward_fraction": 0.0}, "not a fraction of peak"),
    ({"memory_fraction": 2.0}, "not a fraction of peak"),
    ({"gemm.launch_s": 1e9}, "not a fixed cost"),
    ({"ring_step_s": -1.0}, "not a fixed cost"),
])
def test_absurd_calibration_values_are_refused_on_load(kernels, message, tmp_path, capsys):
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump({"kind": "sp-plan-calibration", "version": 1, "kernels": kernels}))
    with pytest.raises(CostModelError, match=message):
        load_calibration(path)
    code, stdout, err = sp(["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8",
                            "--ulysses", "8", "--calibration", path, "--json"], capsys)
    one_line_error(code, err, message)
    assert stdout == ""


def test_absurd_topology_efficiencies_are_refused(tmp_path):
    from sp_plan.cost_models.topology.presets import spec_to_yaml

    data = yaml.safe_load(spec_to_yaml(load_topology("dgx-h100").spec))
    data.setdefault("calibration", {}).setdefault("compute", {})["matmul"] = 1e-300
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CostModelError, match="matmul"):
        load_topology(path)


def test_an_absurd_prediction_is_an_error_not_an_answer(tmp_path, capsys):
    """A stack value that passes its own bounds (a CPU optimizer of 1e-300 params/s) still makes the
    step absurd: the final check refuses to print it."""
    stack = tmp_path / "slow.yaml"
    stack.write_text(yaml.safe_dump({"name": "slow", "time": {"cpu_optimizer_params_per_s_per_core": 1e-300}}))
    code, stdout, err = sp(["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses",
                            "8", "--offload-optimizer", "--stack", stack, "--json"], capsys)
    one_line_error(code, err, "which no real run reaches")
    assert stdout == ""


def test_check_figures_names_nan_negative_and_absurd_values():
    from sp_plan.planner.sanity import check_figures

    check_figures({"time": {"step_s": 2.5}, "fits": True, "name": "x"}, "ok")
    for data, needle in [({"time": {"step_s": float("nan")}}, "time.step_s = nan is not a number"),
                         ({"memory": [1.0, -3.0]}, "memory[1] = -3 is negative"),
                         ({"time": {"step_s": 2e297}}, "exceeds 1e+06"),
                         ({"x": float("inf")}, "is infinite")]:
        with pytest.raises(PlannerError, match=needle.replace("[", r"\[").replace("+", r"\+")):
            check_figures(data, "answer")


# ----- calibrate scales ------------------------------------------------------------------------------------------


def _rows(n: int) -> list[dict]:
    layouts = [dict(ulysses=8), dict(ring=8), dict(tp=2, ulysses=4), dict(dp_shard=8)]
    return [{"model": "llama3-8b", "seq_len": 8192 * (1 + i // len(layouts)), "gpus": 8, "topology": "dgx-h100",
             **layouts[i % len(layouts)], "step_s": 1.0 + 0.01 * i} for i in range(n)]


def _write(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_a_csv_file_is_one_source_so_cross_validation_refits_per_file_not_per_row(tmp_path):
    from sp_plan.planner.fitting.user_runs import runs_from_csv

    runs = runs_from_csv(_write(tmp_path / "a.csv", _rows(5)), "sp-plan")
    assert {r.source for r in runs} == {str(tmp_path / "a.csv")}
    assert all(":" in r.id or "a.csv" in r.id for r in runs)


def test_the_fit_sees_at_most_max_fit_runs_and_the_rest_are_reported_held_out(tmp_path, monkeypatch):
    from sp_plan.planner.fitting import user_fit
    from sp_plan.planner.fitting.user_runs import runs_from_csv

    monkeypatch.setattr(user_fit, "MAX_FIT_RUNS", 6)
    seen: list[int] = []
    real_fit = user_fit.fit

    def counting_fit(runs, params, **kw):
        seen.append(len(runs))
        return real_fit(runs, params, **kw)

    monkeypatch.setattr(user_fit, "fit", counting_fit)
    runs = runs_from_csv(_write(tmp_path / "a.csv", _rows(16)), "sp-plan")
    result = user_fit.calibrate(runs)
    assert seen == [6]
    metrics = {e.metric: e.runs for e in result.errors}
    assert metrics == {"step_s (fitted on)": 6, "step_s (not in the fit sample)": 10}
    assert len(result.predictions) == 16
    sample = user_fit.fit_sample(runs, 6)
    assert sample == user_fit.fit_sample(list(reversed(runs)), 6)  # deterministic, order-free
    assert len({r.layout.describe() for r in sample}) == 4  # every layout keeps its share


def test_the_time_only_prediction_equals_the_full_estimate():
    from sp_plan.planner.fitting.runs import MeasuredRun, predict

    model = get_model_preset("llama3-8b")
    topo = load_topology("dgx-h100", 8)
    for degrees, extra in [(dict(ulysses=8), {}), (dict(ring=4, ulysses=2), {"offload_optimizer": True}),
                           (dict(tp=2, dp_shard=4), {"offload_checkpoints": True, "tiled_mlp": True})]:
        train = TrainSpec(seq_len=65536, checkpointing="full", **extra)
        layout = Layout.for_world(8, **degrees)
        profile = resolve_profile("h100-80gb")
        full = estimate(model, train, layout, topo, with_placement=False, profile=profile).time
        for metric, value in [("step_s", full.step_s), ("tps_per_gpu", full.tokens_per_s / 8)]:
            run = MeasuredRun(id="x", source="s", metric=metric, value=1.0, model=model, train=train, layout=layout,
                              topology="dgx-h100", stack="sp-plan")
            assert predict(run, profile) == value
