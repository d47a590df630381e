"""What NeMo 24.03.01 ran (issue 21, item 3): the LLAMA2-7B DGX-H100 rows of ``nemo-long-sequence`` are priced
with the attention kernel their Transformer Engine picked, read from its source (TE 1.3-1.6 on sm90: cuDNN
fused attention, with and without context parallelism; the comment above the rows in
cost_models/data/calibration/published.yaml cites the lines). The pin is per row, so the megatron-core stack
default that plans and exports use stays what it is, and the report's sp-plan comparison column prices the
sp-plan stack as shipped.

Pure planner tests (no torch).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.stack import attention_kernel_for, load_stack
from sp_plan.planner.fitting.fit import profile_for, run_gpu
from sp_plan.planner.fitting.published import published_entries, published_runs
from sp_plan.planner.fitting.runs import _run_time, predict

ROOT = Path(__file__).resolve().parents[1]
SP_PLAN = str(Path(sys.executable).with_name("sp-plan"))
#: The kernel Transformer Engine 1.3-1.6 runs for these rows (DotProductAttention on sm90).
TE_1X_KERNEL = "cudnn"


@pytest.fixture(scope="module")
def nemo_h100_runs():
    runs = [r for r in published_runs()[0]
            if r.source == "nemo-long-sequence" and r.id.startswith("nemo-long-sequence: llama2-7b")]
    assert len(runs) == 9  # 4K ... 1M, the NeMo 24.03.01 DGX-H100 table
    return runs


def test_every_nemo_24_03_row_in_the_file_pins_the_kernel_its_source_names():
    rows = [e for e in published_entries()["throughput"]
            if e["source"] == "nemo-long-sequence" and e["model"] == "llama2-7b"]
    assert len(rows) == 9
    assert all(e.get("stack_time", {}).get("attention_kernel") == TE_1X_KERNEL for e in rows), rows
    assert all(e["system"] == "h100" for e in rows)


def test_the_published_row_translation_prices_them_with_cudnn(nemo_h100_runs):
    for run in nemo_h100_runs:
        assert run.stack == "megatron-core"
        assert run.time_overrides.get("attention_kernel") == TE_1X_KERNEL, run.id
        profile = profile_for(run)  # what benchmarks/accuracy.py and the fit predict with
        gpu = run_gpu(run)
        assert gpu == "h100-80gb"
        assert attention_kernel_for(profile.stack.time, gpu, "h100") == TE_1X_KERNEL
        assert _run_time(run, profile).efficiency_sources["attention_kernel"] == TE_1X_KERNEL


def test_the_kernel_pin_moves_the_price_of_an_attention_bound_row(nemo_h100_runs):
    """The pin is read: the 1M row (attention ~87% of the step) priced with FlashAttention-2 instead is
    slower, so a translation that dropped the row's kernel would show here."""
    longest = max(nemo_h100_runs, key=lambda r: r.train.seq_len)
    as_published = predict(longest, profile_for(longest))
    with_fa2 = longest.model_copy(update={"time_overrides": {**longest.time_overrides, "attention_kernel": "fa2"}})
    assert predict(with_fa2, profile_for(with_fa2)) < 0.85 * as_published


def test_the_b200_rows_keep_the_stack_default():
    """NeMo 25.04 (Transformer Engine 2.x) rows are not pinned: they take the stack file's choice."""
    runs = [r for r in published_runs()[0] if r.source == "nemo-long-sequence" and "llama3.1-8b" in r.id]
    assert runs and all("attention_kernel" not in r.time_overrides for r in runs)


def test_the_megatron_core_default_for_plans_and_exports_is_unchanged():
    stack = load_stack("megatron")
    assert stack.time.attention_kernel == "cudnn" and stack.time.attention_kernel_by_gpu == {}
    profile = resolve_profile("h100-80gb", "megatron-core")
    assert attention_kernel_for(profile.stack.time, "h100-80gb", "h100") == "cudnn"
    result = subprocess.run([SP_PLAN, "estimate", "--model", "llama2-7b", "--seq-len", "32K", "--gpus", "8",
                             "--tp", "2", "--ring", "2", "--zero", "1", "--stack", "megatron", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    sources = json.loads(result.stdout)["time"]["efficiency_sources"]
    assert sources["attention_kernel"] == "cudnn"
    assert sources["attention_kernel_from"] == "stack file (megatron-core) for h100-80gb"


def test_the_report_compares_against_the_sp_plan_stack_as_shipped(tmp_path, nemo_h100_runs):
    """The comparison column drops the source stack's own facts (a row's TE kernel among them)."""
    out = tmp_path / "acc.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accuracy.py"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    figures = data["figures"] if isinstance(data, dict) else data
    by_id = {f["id"]: f for f in figures}
    run = max(nemo_h100_runs, key=lambda r: r.train.seq_len)
    plain = run.model_copy(update={"stack": "sp-plan", "memory_overrides": {}, "time_overrides": {}})
    expected = predict(plain, profile_for(plain))
    assert by_id[run.id]["other_stack"]["sp-plan"] == pytest.approx(expected, rel=1e-9)
    assert attention_kernel_for(profile_for(plain).stack.time, "h100-80gb", "h100") != TE_1X_KERNEL
