"""The CPU probe end to end: single process, and 2 gloo ranks under torchrun writing a usable topology."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.time_model import comm_and_time
from sp_plan.cost_models.topology import load_topology

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Small messages and budgets (seconds, not minutes), yet large enough for bandwidth to show.
FAST = ["--sizes", "16K,256K,2M", "--compute-budget", "0.05", "--link-budget", "1.0"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_probe_under_torchrun_with_two_gloo_ranks(tmp_path):
    out = tmp_path / "cpu.yaml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sp_plan.cli", "probe", "--out", str(out), *FAST]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "wrote" in done.stdout and "not measured" in done.stdout

    topo = load_topology(str(out))
    assert topo.num_gpus == 2 and topo.num_nodes == 1
    loopback = topo.links["loopback"]
    assert loopback.alpha > 0 and loopback.bandwidth > 1e6
    assert loopback.efficiency == pytest.approx(1.0, rel=0.05)
    entry = topo.calibration.links["loopback"]
    assert "all_reduce" in entry.fitted_from and "all_to_all" in entry.fitted_from
    assert topo.gpu.peak_flops["fp32"] > 1e8  # a measured CPU matmul rate
    assert any("GPUs" in m for m in topo.spec.provenance.not_measured)

    # The probed file drives predictions: compute time follows the measured FLOP/s.
    model = get_model_preset("qwen3-4b")
    train = TrainSpec(seq_len=2048, dtype="fp32", zero_stage=0, checkpointing="none")
    result = comm_and_time(model, train, Layout(ulysses=2), topo)
    t = result.time
    assert t.step_s > t.compute_s > 0 and t.comm_s > 0
    assert t.peak_flops == topo.gpu.peak_flops["fp32"]
    assert 0 < t.mfu <= 1.0
    shown = subprocess.run([sys.executable, "-m", "sp_plan.cli", "topo", "show", str(out)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "loopback" in shown.stdout
    # ... and `sp-plan estimate --topology` accepts it (issue 3's done-when).
    est = subprocess.run([sys.executable, "-m", "sp_plan.cli", "estimate", "--model", "qwen3-4b", "--seq-len", "2048",
                          "--gpus", "2", "--ulysses", "2", "--dtype", "fp32", "--topology", str(out), "--json"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert est.returncode == 0, est.stderr
    data = json.loads(est.stdout)
    assert data["time"]["step_s"] > 0 and data["comm"]["per_layer_bytes"]["ulysses"]["forward"] > 0


def test_probe_single_process_in_process(tmp_path, monkeypatch):
    from sp_plan.runtime.probe.run import run_probe

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    result = run_probe(tmp_path / "one.yaml", compute_budget_s=0.02)
    assert result.path is not None and result.path.exists()
    spec = load_topology(str(result.path)).spec
    assert spec.node.gpus == 1 and spec.node.interconnect.kind == "loopback"
    assert any("torchrun" in m for m in spec.provenance.not_measured)
    assert any(line.startswith("  not measured") for line in result.lines)
