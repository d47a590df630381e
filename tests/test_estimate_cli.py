"""``sp-plan estimate``: table, JSON, and one-line errors with exit code 2 (CliRunner and a real process)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sp_plan.cli.main import main
from sp_plan.cli.commands.estimate import command

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ["--model", "llama3-70b", "--seq-len", "1000000", "--gpus", "8", "--ulysses", "8", "--mode", "prefill",
             "--zero", "3"]
MEMORY_KEYS = {"weights", "gradients", "optimizer", "activations", "logits", "kv_cache", "buffers", "overhead",
               "total", "peak_allocated", "capacity", "device_used"}


def run(args):
    return CliRunner().invoke(command, args, catch_exceptions=False)


def test_reference_json_reports_the_design_figures():
    result = run(REFERENCE + ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) >= {"layout", "memory", "host_memory", "fits", "detail", "comm", "time"}
    assert data["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "ring": 1, "ulysses": 8, "tp": 1}
    assert set(data["memory"]) == MEMORY_KEYS
    assert data["memory"]["kv_cache"] == 40_960_000_000
    assert data["memory"]["weights"] == 17_638_426_624
    u = data["detail"]["ulysses"]
    assert u["q_bytes_before"] == u["q_bytes_after"] == 2_048_000_000
    assert u["k_bytes_before"] == u["v_bytes_before"] == u["k_bytes_after"] == u["v_bytes_after"] == 256_000_000
    assert data["comm"]["per_layer_bytes"]["ulysses"]["forward"] > 0 and data["time"]["step_s"] > 0
    assert isinstance(data["fits"], bool)


def test_table_labels_units_and_names_the_peak_phase():
    result = run(REFERENCE)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "GB" in out and "GiB" in out
    for word in ("weights", "kv_cache", "peak allocated", "overhead", "capacity", "peak phase", "host memory",
                 "NCCL", "CUDA context", "fragmentation"):
        assert word in out
    assert "40.96" in out and "17.64" in out  # KV cache and weight shard, GB
    assert "Q 2.05 -> 2.05 GB, K 0.26 -> 0.26 GB, V 0.26 -> 0.26 GB" in out


def test_train_table_with_offload_shows_host_memory():
    result = run(["--model", "llama3-8b", "--seq-len", "128K", "--gpus", "8", "--ulysses", "8", "--offload-optimizer",
                  "--offload-checkpoints", "--tiled-loss", "--gpus-per-node", "8"])
    assert result.exit_code == 0, result.output
    assert "host memory: " in result.output and "nothing offloaded" not in result.output
    assert "per layer: saved" in result.output


BAD_INPUTS = [
    (["--model", "llama9-1t", "--seq-len", "1M", "--gpus", "8"], "llama3-70b"),  # lists the presets
    (["--model", "llama3-70b", "--seq-len", "1M", "--gpus", "8", "--ulysses", "8", "--dp-shard", "2"],
     "uses 16 GPUs but --gpus is 8"),
    (["--model", "llama3-70b", "--seq-len", "1M", "--gpus", "8", "--ulysses", "3"], "must divide the GPU count"),
    (["--model", "qwen2.5-7b", "--seq-len", "1M", "--gpus", "8", "--ulysses", "8"], "does not divide 28 query heads"),
    (["--model", "qwen2.5-7b", "--seq-len", "1M", "--gpus", "8", "--tp", "8"], "does not divide 28 query heads"),
    (["--model", "llama3-70b", "--seq-len", "1000001", "--gpus", "8", "--ulysses", "8"], "not divisible by"),
    (["--model", "llama3-70b", "--seq-len", "1M", "--gpus", "8", "--ring", "8", "--attention", "materialized"],
     "materialized attention cannot run with ring"),
    (["--model", "llama3-70b", "--seq-len", "1M", "--gpus", "8", "--checkpointing", "none", "--offload-checkpoints"],
     "needs checkpointing 'selective' or 'full'"),
    (["--model", "llama3-70b", "--seq-len", "1M", "--gpus", "8", "--offload-params", "--zero", "2"],
     "offload_params needs zero_stage=3"),
    (["--model", "llama3-70b", "--seq-len", "1M", "--gpus", "12", "--gpus-per-node", "8"], "whole nodes"),
]


@pytest.mark.parametrize("args, message", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert "Traceback" not in err


def test_pydantic_errors_become_one_line(capsys):
    """A degree beyond the Layout bound fails pydantic validation: still one line, exit 2."""
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--model", "llama3-70b", "--seq-len", "1M", "--gpus", "1", "--tp", str(1 << 21),
              "--dp-shard", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "tp" in err


def _subprocess(args):
    return subprocess.run([sys.executable, "-m", "sp_plan.cli", "estimate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_real_process_reference_and_error():
    ok = _subprocess(REFERENCE + ["--json"])
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["memory"]["kv_cache"] == 40_960_000_000
    bad = _subprocess(["--model", "qwen2.5-7b", "--seq-len", "1M", "--gpus", "8", "--ulysses", "8"])
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert "valid Ulysses degrees for this model: 1, 2, 4, 7, 14, 28" in bad.stderr


def test_estimate_imports_no_torch():
    code = ("import sys, cost_models, sp_plan.cli.main, sp_plan.cli.commands.estimate, sp_plan.cost_models.estimate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ----- communication and time in the estimate (issue 3) -------------------------------------------

def test_json_has_comm_and_time_for_reference_scenario():
    from click.testing import CliRunner

    from sp_plan.cli.main import cli

    args = ["estimate", "--model", "llama3-70b", "--seq-len", "1000000", "--gpus", "8", "--ulysses", "8",
            "--mode", "prefill", "--zero", "3", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ulysses = data["comm"]["per_layer_bytes"]["ulysses"]
    assert ulysses["forward"] == pytest.approx(4.032e9, rel=1e-3)
    assert "backward" not in ulysses  # prefill: forward only
    assert set(data["comm"]["per_layer_bytes"]) >= {"dp", "fsdp", "tp", "ulysses", "ring"}
    for key in ("per_step_bytes", "by_collective"):
        assert key in data["comm"]
    for key in ("compute_s", "comm_s", "exposed_comm_s", "step_s", "tokens_per_s", "mfu"):
        assert data["time"][key] > 0 or key == "exposed_comm_s"
    assert data["placement"]["groups"]["ulysses"]["link_class"] == "nvlink"


def test_topology_file_changes_predictions(tmp_path):
    """A hand-tuned calibration in a topology file changes the time prediction with no code change."""
    from click.testing import CliRunner

    from sp_plan.cost_models.topology import load_topology, save_topology
    from sp_plan.cli.main import cli

    topo = load_topology("dgx-h100", 8)
    slow = topo.spec.model_copy(update={"calibration": topo.spec.calibration.model_copy(
        update={"compute": topo.spec.calibration.compute.model_copy(update={"matmul": 0.1})})})
    path = tmp_path / "slow.yaml"
    save_topology(slow, path)
    base = ["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8", "--json"]
    fast = json.loads(CliRunner().invoke(cli, base + ["--topology", "dgx-h100"]).stdout)["time"]["step_s"]
    result = CliRunner().invoke(cli, base + ["--topology", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["time"]["step_s"] > 1.5 * fast


def test_unknown_topology_is_one_line_error():
    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "sp_plan.cli", "estimate", "--model", "llama3-8b", "--seq-len", "8K",
                           "--gpus", "8", "--topology", "nosuch-box"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_gpus_default_to_the_topology_and_are_required_without_one():
    """Without --gpus the machine --topology describes is planned; with neither, a usage error (click
    >= 8.3 would otherwise pass None through to the cost model)."""
    from sp_plan.cli.main import cli

    runner = CliRunner()
    for name in ("plan", "estimate"):
        missing = runner.invoke(cli, [name, "--model", "llama3-8b", "--seq-len", "8K"])
        assert missing.exit_code == 2 and "--gpus" in missing.output and missing.exception is not None
        assert not isinstance(missing.exception, TypeError)
        res = runner.invoke(cli, [name, "--model", "llama3-8b", "--seq-len", "8K", "--topology", "dgx-h100", "--json"])
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        layout = data["plans"][0]["layout"] if name == "plan" else data["layout"]
        assert math.prod(layout.values()) == 8


def test_memory_assumptions_can_be_overridden_from_the_command_line():
    """--assume KEY=VALUE reaches the memory model (estimate and plan alike); bad keys and values are one
    line each, exit 2."""
    from sp_plan.cli.main import cli

    runner = CliRunner()
    base = ["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8",
            "--checkpointing", "none", "--json"]
    fused = json.loads(runner.invoke(cli, base).stdout)["memory"]["activations"]
    eager = json.loads(runner.invoke(cli, base + ["--assume", "norm_implementation=eager"]).stdout)["memory"]
    tokens, hidden, layers = 32768 // 8, 4096, 32
    # HF's eager RMSNorm keeps an fp32 copy of its input: two norms per layer and the final norm.
    assert eager["activations"] - fused == (2 * layers + 1) * tokens * hidden * 4
    plan = ["plan", "--model", "llama3-8b", "--seq-len", "128K", "--gpus", "8", "--json", "--top", "1"]
    roomy = json.loads(runner.invoke(cli, plan).stdout)["plans"][0]["memory"]["overhead"]
    tight = json.loads(runner.invoke(cli, plan + ["--assume", "fragmentation_fraction=0.2"]).stdout)
    assert tight["plans"][0]["memory"]["overhead"] > roomy
    for bad, words in (("bogus=1", "unknown assumption"), ("norm_implementation=weird", "'fused' or 'eager'"),
                       ("nokv", "KEY=VALUE")):
        proc = subprocess.run([sys.executable, "-m", "sp_plan.cli", *plan, "--assume", bad], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
