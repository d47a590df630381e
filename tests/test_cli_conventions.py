"""Command-line conventions a first-time user runs into (issue 17): every token count takes K/M suffixes,
model names get suggestions, common names resolve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sp_plan.cost_models import CostModelError, get_model_preset
from sp_plan.cli.main import cli, main
from sp_plan.cost_models.topology import load_topology


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def console(args: list[str], capsys) -> tuple[int, str]:
    """The console script's exit code and stderr (``main`` turns the project's errors into one line, exit 2)."""
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    return code, capsys.readouterr().err


def test_global_batch_tokens_take_suffixes_like_seq_len():
    base = ["plan", "--model", "llama3-8b", "--seq-len", "128K", "--gpus", "8", "--top", "1", "--json"]
    with_suffix = run(*base, "--global-batch-tokens", "1M")
    with_number = run(*base, "--global-batch-tokens", str(1 << 20))
    assert with_suffix.exit_code == 0, with_suffix.output
    assert json.loads(with_suffix.stdout)["plans"] == json.loads(with_number.stdout)["plans"]
    bad = run(*base, "--global-batch-tokens", "1.5X")
    assert bad.exit_code == 2 and "global batch" in bad.output and "Traceback" not in bad.output


@pytest.mark.parametrize(("alias", "canonical"), [("llama3.1-8b", "llama3-8b"), ("Llama3.1-70B", "llama3-70b"),
                                                  ("llama3.1-405b", "llama3-405b")])
def test_llama_3_1_names_resolve_to_their_architecture(alias, canonical):
    assert get_model_preset(alias) == get_model_preset(canonical)


def test_qwen3_8b_and_14b_presets_match_their_published_sizes():
    for name in ("qwen3-8b", "qwen3-14b"):
        model = get_model_preset(name)
        assert abs(model.num_params / model.published_params - 1) < 0.005


def test_unknown_model_suggests_the_closest_names(capsys):
    with pytest.raises(CostModelError, match="did you mean llama3-70b"):
        get_model_preset("lama3-70b")
    code, err = console(["estimate", "--model", "qwen3-8", "--seq-len", "8K", "--gpus", "8"], capsys)
    assert code == 2 and err.startswith("error: ") and "did you mean qwen3-8b" in err


def _console_script() -> str:
    script = Path(sys.executable).with_name("sp-plan")
    return str(script) if script.exists() else shutil.which("sp-plan") or "sp-plan"


def _sh(args: list[str], stdin: str | None = None):
    return subprocess.run([_console_script(), *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_dash_is_stdout_and_stdin_through_the_console_script(tmp_path):
    """`plan --out -` writes the plan file to stdout (the report to stderr), `export -` reads it from stdin,
    `topo show --out -` and `calibrate --out -` write their YAML to stdout; nothing named `-` appears."""
    import os

    import yaml

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        plan = _sh(["plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--top", "1", "--out", "-"])
        assert plan.returncode == 0, plan.stderr
        assert yaml.safe_load(plan.stdout)["end_of_plan"] is True
        assert "Recommended:" in plan.stderr
        exported = _sh(["export", "-", "--to", "deepspeed"], stdin=plan.stdout)
        assert exported.returncode == 0, exported.stderr
        assert json.loads(exported.stdout)["train_micro_batch_size_per_gpu"] >= 1
        refused = _sh(["export", "-", "--to", "torchrun"], stdin=plan.stdout)
        assert refused.returncode == 2 and "standard input" in refused.stderr and "Traceback" not in refused.stderr
        cut = _sh(["export", "-", "--to", "deepspeed"], stdin=plan.stdout[: len(plan.stdout) // 2])
        assert cut.returncode == 2 and "Traceback" not in cut.stderr
        topo = _sh(["topo", "show", "dgx-h100", "--out", "-"])
        assert topo.returncode == 0 and yaml.safe_load(topo.stdout)["name"] == "dgx-h100"
        assert not (tmp_path / "-").exists()
    finally:
        os.chdir(cwd)


def test_calibrate_out_dash_writes_the_calibration_to_stdout(tmp_path):
    import yaml

    from sp_plan.planner.fitting.user_runs import write_runs_csv
    from tests.test_calibrate import synthetic_rows

    rows = synthetic_rows({"gemm.peak_fraction": 0.45, "attention.fa2.forward_fraction": 0.5,
                           "attention.fa2.backward_fraction": 0.4})
    write_runs_csv(tmp_path / "runs.csv", rows)
    done = _sh(["calibrate", str(tmp_path / "runs.csv"), "--out", "-"])
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["kind"] == "sp-plan-calibration"
    assert "fitted" in done.stderr


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_a_missing_seq_len_is_named_not_a_pydantic_message(command):
    """Current click (8.5 here) takes an explicit default=None as a value, so a required --seq-len went unchecked and the
    user read pydantic's "seq_len: Input should be a valid integer"."""
    done = _sh([command, "--model", "llama3-8b", "--gpus", "8"])
    assert done.returncode == 2
    assert "Missing option '--seq-len'" in done.stderr and "valid integer" not in done.stderr


def test_topo_show_and_list_print_json():
    shown = _sh(["topo", "show", "dgx-h100", "--gpus", "16", "--json"])
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    topo = load_topology("dgx-h100", num_gpus=16)
    assert data["derived"]["num_gpus"] == 16 and data["derived"]["nodes"] == 2
    for cls, link in topo.links.items():
        assert data["derived"]["link_classes"][cls]["bandwidth"] == pytest.approx(link.bandwidth)
    assert data["spec"]["name"] == topo.spec.name
    listed = json.loads(_sh(["topo", "list", "--json"]).stdout)
    assert "dgx-h100" in {p["name"] for p in listed["topologies"]} and listed["fabrics"]
    clash = _sh(["topo", "show", "dgx-h100", "--json", "--out", "-"])
    assert clash.returncode == 2 and "both write standard output" in clash.stderr


def test_probe_prints_json(tmp_path):
    out = tmp_path / "topo.yaml"
    done = subprocess.run([_console_script(), "probe", "--out", str(out), "--json", "--sizes", "16K,256K,2M",
                           "--compute-budget", "0.05", "--link-budget", "0.5"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["path"] == str(out) and out.exists()
    assert data["topology"]["provenance"]["measured"]


def test_help_shows_no_default_for_what_plan_and_capacity_search():
    """plan --help said '--zero [default: 3]' and '--checkpointing [default: full]' for options it searches."""
    searched = {"zero_stage", "checkpointing", "micro_batch", "grad_accum"}

    def records(name: str) -> dict[str, str]:
        command = cli.get_command(click.Context(cli), name)
        ctx = click.Context(command, info_name=name)
        return {p.name: p.get_help_record(ctx)[1] for p in command.params if p.name in searched}

    for name in ("plan", "capacity"):
        for option, text in records(name).items():
            assert "default" not in text and "searched unless given" in text, (name, option, text)
    estimate = records("estimate")
    assert "[default: 3;" in estimate["zero_stage"] and "default: full" in estimate["checkpointing"]
    assert not any("searched" in text for text in estimate.values())
