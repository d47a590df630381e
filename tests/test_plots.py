"""``--plot`` pictures: estimate (memory by component and phase), plan (step time of the top plans) and
capacity (sweep): valid image files of sensible size whose plotted numbers are the estimate's."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from sp_plan.cli.commands.estimate import run_estimate
from sp_plan.cli.main import cli, main
from sp_plan.cli.plots import (MEMORY_COMPONENTS, SMALL_LABEL, draw_estimate_memory, draw_plan_times, draw_sweep,
                               plot_format, time_groups)
from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.topology import default_topology
from sp_plan.cost_models.units import GB
from sp_plan.planner.capacity import sweep
from sp_plan.planner.search import PlanSettings, search

pytest.importorskip("matplotlib")

def llama():
    return get_model_preset("llama3-8b")


def h100s(n: int):
    return default_topology("h100-80gb", n, min(n, 8))


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path, min_bytes: int = 15_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert min_bytes < len(data) < 2_000_000, len(data)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 600 <= width <= 3000 and 400 <= height <= 2000, (width, height)


def test_estimate_plot_draws_every_phase_and_its_peak_bar_is_the_breakdown(tmp_path):
    est = run_estimate("llama3-8b", 8, None, "h100-80gb", None, {"seq_len": 131072, "ulysses": 8})
    png = tmp_path / "estimate.png"
    plotted = draw_estimate_memory(est, png, headroom=0.1)
    assert_png(png)
    det, mem = est.detail, est.memory
    assert plotted["phases"] == list(det.phases)
    for i, phase in enumerate(plotted["phases"]):
        for comp in MEMORY_COMPONENTS[:-1]:
            assert plotted[comp][i] == pytest.approx(getattr(det.phases[phase], comp) / GB)
        assert plotted["total"][i] == pytest.approx((det.phases[phase].allocated + mem.overhead) / GB)
    peak = plotted["phases"].index(det.peak_phase)
    for comp in MEMORY_COMPONENTS:
        assert plotted[comp][peak] == pytest.approx(getattr(mem, comp) / GB)
    assert plotted["total"][peak] == pytest.approx(mem.total / GB)
    assert max(plotted["total"]) == pytest.approx(mem.total / GB)


def test_plan_plot_bars_add_up_to_each_plans_step_time(tmp_path):
    result = search(llama(), TrainSpec(seq_len=32768), h100s(16), PlanSettings(top_k=4))
    assert len(result.plans) >= 2
    png = tmp_path / "plans.png"
    plotted = draw_plan_times(result.plans, png, "llama3-8b")
    assert_png(png)
    assert plotted["layouts"] == [p.layout.describe() for p in result.plans]
    parts = [k for k in plotted if k not in ("total", "layouts")]
    for i, plan in enumerate(result.plans):
        t = plan.estimate.time
        assert plotted["total"][i] == pytest.approx(t.step_s, rel=1e-6)
        assert sum(plotted[k][i] for k in parts) == pytest.approx(sum(t.components.values()), rel=1e-9)
        gemms = t.components.get("gemm_forward", 0.0) + t.components.get("gemm_backward", 0.0)
        assert plotted["GEMMs"][i] == pytest.approx(gemms)


def test_time_groups_keep_every_second_and_name_the_exposed_strategies():
    components = {"gemm_forward": 1.0, "gemm_backward": 2.0, "attention_forward": 0.5, "attention_backward": 1.5,
                  "recompute": 0.25, "streaming": 0.1, "a_new_part": 0.05, "exposed_comm_ulysses": 0.3,
                  "exposed_comm_fsdp": 0.2, "interference": 0.01, "offload": 0.4, "optimizer": 0.02,
                  "stack_overhead": 0.03, "step_overhead": 0.04}
    groups = time_groups(components)
    assert sum(groups.values()) == pytest.approx(sum(components.values()))
    assert groups["GEMMs"] == 3.0 and groups["other compute"] == pytest.approx(0.15)
    assert groups["exposed comm: ulysses"] == 0.3 and groups["exposed comm: fsdp"] == 0.2
    assert groups["overhead"] == pytest.approx(0.07) and groups["offload"] == 0.4


def test_plan_plot_folds_invisible_slivers_into_one_series(tmp_path):
    result = search(llama(), TrainSpec(seq_len=131072), h100s(16), PlanSettings(top_k=3))
    plotted = draw_plan_times(result.plans, tmp_path / "p.png", "x")
    if SMALL_LABEL in plotted:
        tallest = max(p.estimate.time.step_s for p in result.plans)
        assert max(plotted[SMALL_LABEL]) < 0.005 * tallest * len(plotted)
    named = [k for k in plotted if k not in ("total", "layouts", SMALL_LABEL)]
    assert all(max(plotted[k]) >= 0.005 * max(plotted["total"]) for k in named)


def test_sweep_plot_values_are_each_points_breakdown(tmp_path):
    points = sweep(llama(), TrainSpec(seq_len=262144), h100s, [(4, 262144), (8, 262144)], PlanSettings(top_k=1))
    png = tmp_path / "sweep.png"
    plotted = draw_sweep(points, "gpus", png, "llama3-8b", headroom=0.1)
    assert_png(png)
    for i, p in enumerate(points):
        assert p.plan is not None
        for comp in MEMORY_COMPONENTS:
            assert plotted[comp][i] == pytest.approx(getattr(p.plan.estimate.memory, comp) / GB)
        assert plotted["total"][i] == pytest.approx(p.plan.estimate.memory.total / GB)
        assert plotted["tokens_per_s"][i] == p.plan.estimate.time.tokens_per_s


@pytest.mark.parametrize("args", [
    ["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8"],
    ["plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--top", "3"],
])
def test_estimate_and_plan_write_the_plot_and_say_so(tmp_path, args):
    png = tmp_path / "out.png"
    res = CliRunner().invoke(cli, [*args, "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert_png(png)
    assert f"wrote {png}" in res.output
    svg = tmp_path / "out.svg"
    res = CliRunner().invoke(cli, [*args, "--json", "--plot", str(svg)])
    assert res.exit_code == 0, res.output
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_plot_into_a_missing_directory_fails_before_any_work(tmp_path, capsys, command):
    target = tmp_path / "missing" / "p.png"
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--plot", str(target)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--plot" in err and "does not exist" in err, err
    assert not target.parent.exists()


def test_plot_format_follows_the_suffix():
    assert [plot_format(p) for p in ("a.png", "b.SVG", "c.pdf", "d.jpg", "e")] == ["png", "svg", "pdf", "png", "png"]


def test_help_imports_neither_matplotlib_nor_torch():
    code = ("import sys; from click.testing import CliRunner; from sp_plan.cli.main import cli; "
            "r = CliRunner().invoke(cli, ['estimate', '--help']); assert r.exit_code == 0; "
            "r = CliRunner().invoke(cli, ['plan', '--help']); assert '--plot' in r.output; "
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
