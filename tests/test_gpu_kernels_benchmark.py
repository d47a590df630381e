"""``benchmarks/gpu_kernels.py`` (issue 21): the kernel-level measurements a lent GPU takes are written in
``kernels.yaml``'s own format. Run here on the CPU at its smallest sizes, its output is read back by the kernel
fit's loader next to the shipped figures: every entry names a described source and the GPU variant, every
figure id is new, and the kernel model predicts each one."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

from sp_plan.planner.fitting.kernel_fit import kernel_data, kernel_figures  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_measurements_are_written_as_kernel_data_the_fit_reads(tmp_path, capsys):
    out = tmp_path / "measured.yaml"
    assert _script().main(["--gpu", "h100-80gb", "--quick", "--name", "cpu-check", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "model/measured" in printed and "fa2 backward causal" in printed

    measured = yaml.safe_load(out.read_text())
    assert set(measured["sources"]) >= {"cpu-check-attention", "cpu-check-gemm", "cpu-check-gemm-fp8",
                                        "cpu-check-gemm-fp8-fast-accum"}
    assert {e["pass"] for e in measured["attention"]} == {"forward", "backward"}
    assert all(source["software"].startswith("torch ") for source in measured["sources"].values())
    new = kernel_figures(measured)
    # GEMMs: 2 shapes x (bf16, fp8, fp8 fast accumulation); attention (flash only on a CPU): 2 lengths x 2 passes
    # x (causal, full)
    assert len(new) == len({f.id for f in new}) == 2 * 3 + 2 * 2 * 2
    assert all(f.value > 0 and f.gpu == "h100-80gb" and f.confidence == "exact" for f in new)
    from sp_plan.cost_models.gpu_spec import get_gpu_preset
    from sp_plan.cost_models.kernels import kernel_model

    model, gpu = kernel_model("h100-80gb"), get_gpu_preset("h100-80gb")
    assert all(math.isfinite(f.predict(model, gpu)) and f.predict(model, gpu) > 0 for f in new)

    shipped = kernel_data()  # merged as the script tells: new sources and entries beside the shipped ones
    merged = {"sources": {**shipped["sources"], **measured["sources"]},
              **{key: [*shipped.get(key, []), *measured.get(key, [])] for key in ("attention", "gemm")},
              **{key: value for key, value in shipped.items() if key not in ("sources", "attention", "gemm")}}
    ids = [f.id for f in kernel_figures(merged)]
    assert len(ids) == len(set(ids)) == len(kernel_figures(shipped)) + len(new)


def test_a_cpu_run_must_name_the_preset_it_compares_with(capsys):
    with pytest.raises(SystemExit) as exc:
        _script().main(["--quick"])
    assert exc.value.code == 2 and "no GPU here" in capsys.readouterr().err
