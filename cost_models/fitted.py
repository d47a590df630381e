"""Parameter values fitted to published GPU measurements, as shipped data, in two layers.

``cost_models/data/calibration/fitted.yaml`` is written by ``python benchmarks/accuracy.py --fit --write``
(never by hand):

- ``kernels:`` kernel-model parameters per GPU family (``all`` for those shared by every GPU), pinned
  by KERNEL-LEVEL measurements only (``kernels.yaml``; ``kernel_fit:`` holds that fit's sources,
  residuals and leave-one-source-out errors);
- ``stacks:`` and ``variants:`` what system-level runs (``published.yaml``) alone can tell: a stack's
  overheads, a GPU variant's sustained-clock factor. Never a kernel efficiency.

The kernel files and stack files keep their documented priors; :func:`sp_plan.cost_models.kernels.kernel_model`
and :func:`sp_plan.cost_models.stack.load_stack` apply these values on top. A missing or empty file means
"priors only".

This module imports no cost model (the kernel and stack modules import it), so the provenance record a
kernel model carries, :class:`FitRecord`, lives here too. What depends on the fitted values caches them;
:func:`sp_plan.cost_models.profile.clear_caches` forgets all of it, and
:func:`sp_plan.cost_models.profile.use_fitted` predicts with other values inside a block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import data
from .errors import explain_validation_error
from .yaml_io import safe_load

FITTED_FILE = "fitted.yaml"


class FitRecord(BaseModel):
    """Where fitted parameters came from: the sources fitted on and the residuals left (a kernel model
    carries one when fitted values replaced its priors)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = Field(default="", max_length=500)
    sources: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()
    rms_log_residual: float | None = None
    residuals: dict[str, float] = Field(default_factory=dict)


class KernelFitRecord(BaseModel):
    """The kernel-level fit: which kernel benchmarks pinned the ``kernels:`` values, how well."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = ""
    sources: list[str] = Field(default_factory=list)
    rms_log_residual: float | None = None
    #: Figure id -> predicted / measured - 1 with the pinned values (in-sample).
    residuals: dict[str, float] = Field(default_factory=dict)
    #: Source -> figure id -> predicted / measured - 1 by a kernel fit that left the source out.
    held_out: dict[str, dict[str, float]] = Field(default_factory=dict)


class FittedParameters(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = ""
    #: Sources of the system-level fit (published.yaml).
    sources: list[str] = Field(default_factory=list)
    #: GPU family (kernel file name, e.g. h100) or "all" -> dotted kernel path -> value. Kernel-level fit only.
    kernels: dict[str, dict[str, float]] = Field(default_factory=dict)
    kernel_fit: KernelFitRecord = KernelFitRecord()
    #: GPU variant (a cost_models/data/gpus/ name) -> kernel-model key (``clock_factor``) -> value. System-level fit.
    variants: dict[str, dict[str, float]] = Field(default_factory=dict)
    #: Stack name -> StackTime field -> value. System-level fit.
    stacks: dict[str, dict[str, float]] = Field(default_factory=dict)
    rms_log_residual: float | None = None
    #: Run id -> predicted / measured - 1 with the fitted values (in-sample).
    residuals: dict[str, float] = Field(default_factory=dict)
    #: Source -> run id -> predicted / measured - 1 by a fit that left the source out.
    held_out: dict[str, dict[str, float]] = Field(default_factory=dict)
    #: Harder splits: split ("gpu-variant", "stack") -> held-out group -> run id -> predicted / measured - 1
    #: by a fit that left the whole group out.
    held_out_splits: dict[str, dict[str, dict[str, float]]] = Field(default_factory=dict)

    def record_for(self, parameters: list[str]) -> FitRecord:
        """The provenance a kernel model carries: the kernel-level fit (its sources and residuals)."""
        k = self.kernel_fit
        return FitRecord(method=k.method, sources=tuple(k.sources), parameters=tuple(parameters),
                         rms_log_residual=k.rms_log_residual, residuals=dict(k.residuals))


def fitted_path():
    """The shipped fitted-values file (``benchmarks/accuracy.py --fit --write`` rewrites it)."""
    return data.shipped_file("calibration", FITTED_FILE.removesuffix(".yaml"))


#: Values in effect instead of the shipped file (``replaced``): a refit predicts with what it just fitted.
_override: list[FittedParameters] = []


def fitted_parameters() -> FittedParameters:
    """The fitted values predictions use: the shipped file, unless :func:`replaced` replaced it."""
    return _override[-1] if _override else _shipped()


@contextmanager
def replaced(params: FittedParameters) -> Iterator[FittedParameters]:
    """:func:`fitted_parameters` answers ``params`` inside the block. Only the values: what was derived
    from the old ones stays cached, so predict through :func:`sp_plan.cost_models.profile.use_fitted`,
    which also clears those caches."""
    _override.append(params)
    try:
        yield params
    finally:
        _override.pop()


@cache
def _shipped() -> FittedParameters:
    path = fitted_path()
    if not path.is_file():
        return FittedParameters()
    values = safe_load(path.read_text(encoding="utf-8")) or {}
    try:
        return FittedParameters(**values)
    except ValidationError as exc:
        raise explain_validation_error(exc, f"fitted parameters {FITTED_FILE}") from exc


def forget_shipped() -> None:
    """Forget the shipped file's parsed values (re-read on next use; after rewriting the file).
    :func:`sp_plan.cost_models.profile.clear_caches` also forgets what was derived from them."""
    _shipped.cache_clear()


__all__ = ["FITTED_FILE", "FitRecord", "FittedParameters", "KernelFitRecord", "fitted_parameters", "fitted_path",
           "forget_shipped", "replaced"]
