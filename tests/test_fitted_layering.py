"""fitted -> kernels, stack -> profile is a chain, not a cycle (issue 18): fitted.py imports no cost model,
kernels and stack import it at module level, and profile (above both) owns the cache clearing."""

import ast
import pathlib

import pytest

from sp_plan.cost_models import fitted, kernels, profile, stack
from sp_plan.cost_models.fitted import FitRecord, FittedParameters, fitted_parameters

COST_MODELS = pathlib.Path(__file__).resolve().parents[1] / "cost_models"


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level, function-level) modules a cost_models file imports relatively."""
    tree = ast.parse((COST_MODELS / f"{module}.py").read_text())
    top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.level and n.module}
    top |= {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.level and not n.module for a in n.names}
    nested = {
        n.module or "" for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f) if isinstance(n, ast.ImportFrom) and n.level
    }
    return top, nested


def test_fitted_imports_no_cost_model():
    top, nested = _imports("fitted")
    assert top <= {"data", "errors", "yaml_io"} and not nested


@pytest.mark.parametrize("module", ["kernels", "stack"])
def test_kernels_and_stack_import_fitted_at_module_level(module):
    top, nested = _imports(module)
    assert "fitted" in top and not nested


def test_fit_record_lives_in_fitted_and_is_still_importable_from_kernels():
    assert kernels.FitRecord is FitRecord
    assert FitRecord.__module__ == "sp_plan.cost_models.fitted"


def test_use_fitted_clears_every_cache_on_entry_and_exit():
    shipped = fitted_parameters()
    def current():
        default = profile.default_profile("h100-80gb")  # compared by identity: compare what it holds
        return kernels.kernel_model("h100-96gb"), stack.load_stack("torchtitan"), default.stack, default.kernels

    before = current()
    changed = shipped.model_copy(update={
        "variants": {"h100-96gb": {"clock_factor": 0.5}},
        "stacks": {"torchtitan": {"step_overhead_s": 1.25}},
        "kernels": {"h100": {"gemm.peak_fraction": 0.5}},
    })
    with profile.use_fitted(changed) as params:
        assert params is changed and fitted_parameters() is changed
        assert kernels.kernel_model("h100-96gb").clock_factor == 0.5
        assert stack.load_stack("torchtitan").time.step_overhead_s == 1.25
        assert profile.default_profile("h100-80gb").kernels.gemm.peak_fraction == 0.5
    assert fitted_parameters() == shipped  # re-read from the shipped file
    assert current() == before


def test_replaced_swaps_values_only():
    """fitted.replaced does not reach the caches above it (that is profile.use_fitted's job)."""
    model = kernels.kernel_model("h100-80gb")
    with fitted.replaced(FittedParameters()) as empty:
        assert fitted_parameters() is empty
        assert kernels.kernel_model("h100-80gb") is model  # still cached: nothing cleared
    profile.clear_caches()
    assert kernels.kernel_model("h100-80gb") == model and kernels.kernel_model("h100-80gb") is not model
