"""Kernel-level data for the expert GEMMs' grouped term (issue 21 item 1, issue 20's MoE cost model).

DeepGEMM's README tables (H800 SXM5, FP8) give grouped GEMMs at 256-8192 rows per expert; the kernels are
not the cuBLASLt GEMMs a priced stack runs, so the figures are compared with the kernel model, never fitted."""

from __future__ import annotations

import pytest
from sp_plan.cost_models.gpu_spec import get_gpu_preset
from sp_plan.cost_models.kernels import gemm_seconds, grouped_gemm_seconds, kernel_model
from sp_plan.planner.fitting.kernel_fit import fit_kernels, kernel_figures


def test_grouped_gemm_figures_are_compared_not_fitted():
    figures = kernel_figures()
    deepgemm = [f for f in figures if f.source == "deepgemm-readme"]
    assert len(deepgemm) == 16 and all(f.weight == 0.0 and f.evaluation_only for f in deepgemm)
    assert "deepgemm-readme" not in fit_kernels(figures).sources
    assert any("contiguous 8x4096x4096x7168" in f.id for f in deepgemm)
    gpu, model = get_gpu_preset("h800"), kernel_model("h800")
    for f in deepgemm:  # the grouped term stays within 35% of the faster-than-cuBLAS kernel
        assert 0.65 < f.predict(model, gpu) / f.value < 1.35, f.id


def test_grouped_term_of_one_is_the_gemm_and_groups_share_waves():
    model = kernel_model("h800")
    g = model.gemm
    one = grouped_gemm_seconds([(1024, 4096, 7168, 1)], 1e15, 0.6, g, model.sms)
    assert one == pytest.approx(gemm_seconds(1024, 4096, 7168, 1e15, 0.6, g, model.sms))
    assert grouped_gemm_seconds([(1024, 4096, 7168, 8)], 1e15, 0.6, g, model.sms) <= 8 * one
    # A small per-expert M pays its padding: 8 experts of 64 rows cost more per FLOP than one of 512.
    small = grouped_gemm_seconds([(64, 4096, 7168, 8)], 1e15, 0.6, g, model.sms)
    assert small >= grouped_gemm_seconds([(512, 4096, 7168, 1)], 1e15, 0.6, g, model.sms)
