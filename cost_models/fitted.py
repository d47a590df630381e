"""Parameter values fitted to the published GPU measurements, as shipped data.

``cost_models/data/calibration/fitted.yaml`` is written by ``python benchmarks/accuracy.py --fit --write``
(never by hand): the kernel-model parameters per GPU family (``all`` for those shared by every GPU),
the stack parameters per stack, the sources fitted on, the residual of every figure, and the
leave-one-source-out error of every source. The kernel files and stack files keep their documented
priors; :func:`cost_models.kernels.kernel_model` and :func:`cost_models.stack.load_stack` apply these
values on top. A missing or empty file means "priors only".
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import explain_validation_error
from .kernels import FitRecord
from .yaml_io import safe_load

FITTED_FILE = "fitted.yaml"


class FittedParameters(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = ""
    sources: list[str] = Field(default_factory=list)
    #: GPU family (kernel file name, e.g. h100) or "all" -> dotted kernel path -> value.
    kernels: dict[str, dict[str, float]] = Field(default_factory=dict)
    #: Stack name -> StackTime field -> value.
    stacks: dict[str, dict[str, float]] = Field(default_factory=dict)
    rms_log_residual: float | None = None
    #: Run id -> predicted / measured - 1 with the fitted values (in-sample).
    residuals: dict[str, float] = Field(default_factory=dict)
    #: Source -> run id -> predicted / measured - 1 by a fit that left the source out.
    held_out: dict[str, dict[str, float]] = Field(default_factory=dict)

    def record_for(self, parameters: list[str]) -> FitRecord:
        return FitRecord(method=self.method, sources=tuple(self.sources), parameters=tuple(parameters),
                         rms_log_residual=self.rms_log_residual, residuals=dict(self.residuals))


def fitted_path():
    return resources.files("cost_models.data").joinpath("calibration", FITTED_FILE)


@cache
def fitted_parameters() -> FittedParameters:
    path = fitted_path()
    if not path.is_file():
        return FittedParameters()
    data = safe_load(path.read_text()) or {}
    try:
        return FittedParameters(**data)
    except ValidationError as exc:
        raise explain_validation_error(exc, f"fitted parameters {FITTED_FILE}") from exc


def clear_cache() -> None:
    """Forget loaded fitted values (after rewriting the file)."""
    from . import kernels, profile, stack

    fitted_parameters.cache_clear()
    kernels.kernel_model.cache_clear()
    stack._shipped.cache_clear()
    profile.default_profile.cache_clear()


__all__ = ["FITTED_FILE", "FittedParameters", "clear_cache", "fitted_parameters", "fitted_path"]
