"""What a prediction assumes about the software and the silicon: one resolved :class:`CostProfile`.

Three layers, later ones win:

1. the GPU's kernel model (:mod:`sp_plan.cost_models.kernels`, shipped per GPU, fitted to published runs);
2. the software stack (:mod:`sp_plan.cost_models.stack`: memory assumptions and framework time properties);
3. a calibration file written by ``sp-plan calibrate`` from the user's own measured runs
   (``--calibration FILE``): overrides of any of the above, fitted on their cluster and stack.

``--assume KEY=VALUE`` overrides single memory assumptions on top of all three.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import stack as _stack
from .errors import CostModelError
from .fitted import FittedParameters, forget_shipped, replaced
from .kernels import KernelModel, clear_gemm_memos, kernel_model
from .memory.assumptions import MemoryAssumptions
from .stack import StackProfile, load_stack, synced_memory
from .yaml_io import parse_mapping, read_small_text, validated

MAX_CALIBRATION_FILE_BYTES = 1 << 22
CALIBRATION_KIND = "sp-plan-calibration"
#: Smallest fraction of peak (GEMM, attention, HBM efficiency) a calibration may set. Real kernels reach
#: 0.1-0.8 of peak; below 1/1000 a GPU would be slower than a CPU core, so such a value is a typo or a
#: unit mix-up, and would print a step of centuries as a prediction (1e-300 gave a 2e297 s step).
MIN_EFFICIENCY = 1e-3
#: Largest fixed cost per kernel launch, ring step or layer a calibration may set (seconds).
MAX_FIXED_COST_S = 1.0


class CalibrationError(BaseModel):
    """Prediction error of one metric over a set of runs: before and after the calibration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    runs: int = Field(ge=0)
    #: Finite: an infinite percentage means a measurement was not validated (calibrate refuses those).
    before_mean_abs_pct: float = Field(ge=0, allow_inf_nan=False)
    after_mean_abs_pct: float = Field(ge=0, allow_inf_nan=False)
    before_kendall_tau: float | None = None
    after_kendall_tau: float | None = None


class CalibrationResidual(BaseModel):
    """One run's ``ln(predicted / measured)`` after the calibration, of its time (rates inverted), memory or
    length, and how the run was used: ``fitted on``, ``held out`` (``--check``) or ``leave-one-file-out``. The
    CLI's band after ``--calibration`` is drawn from the held-out ones (:mod:`sp_plan.planner.uncertainty`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(max_length=300)
    source: str = Field(max_length=4096)
    metric: str = Field(max_length=100)
    split: Literal["fitted on", "held out", "leave-one-file-out", "not in the fit sample"]
    log_error: float = Field(allow_inf_nan=False)


class CalibrationFile(BaseModel):
    """Overrides fitted to measured runs (``sp-plan calibrate`` writes it; estimate/plan/capacity take
    it with ``--calibration FILE``). Keys of ``kernels`` are dotted paths into the GPU's kernel model
    (e.g. ``gemm.peak_fraction``, ``attention.fa2.forward_fraction``); ``time`` and ``memory`` hold
    fields of the stack's :class:`~sp_plan.cost_models.stack.StackTime` and
    :class:`~sp_plan.cost_models.memory.assumptions.MemoryAssumptions`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["sp-plan-calibration"] = CALIBRATION_KIND
    version: Literal[1] = 1
    description: str = Field(default="", max_length=4000)
    gpu: str | None = Field(default=None, max_length=100, description="the GPU the kernel overrides were fitted on")
    stack: str | None = Field(default=None, max_length=500, description="the stack the runs used")
    kernels: dict[str, float] = Field(default_factory=dict)
    time: dict[str, Any] = Field(default_factory=dict)
    memory: dict[str, Any] = Field(default_factory=dict)
    fitted_on: list[str] = Field(default_factory=list, max_length=10_000, description="runs used by the fit")
    held_out: list[str] = Field(default_factory=list, max_length=10_000, description="runs used to check it")
    errors: list[CalibrationError] = Field(default_factory=list)
    residuals: list[CalibrationResidual] = Field(default_factory=list, max_length=100_000)

    @field_validator("kernels")
    @classmethod
    def _sane_kernels(cls, kernels: dict[str, float]) -> dict[str, float]:
        """Fractions of peak in [MIN_EFFICIENCY, 1], fixed costs in [0, MAX_FIXED_COST_S], all finite."""
        for path, value in kernels.items():
            if not math.isfinite(value):
                raise ValueError(f"kernels.{path} = {value} is not a finite number")
            if path.endswith(("fraction", "efficiency")) and not MIN_EFFICIENCY <= value <= 1.0:
                raise ValueError(
                    f"kernels.{path} = {value:g} is not a fraction of peak in [{MIN_EFFICIENCY:g}, 1] (below "
                    f"{MIN_EFFICIENCY:g} a GPU would be slower than a CPU core: a typo or a unit mix-up)")
            if path.endswith("_s") and not 0 <= value <= MAX_FIXED_COST_S:
                raise ValueError(f"kernels.{path} = {value:g} s is not a fixed cost in [0, {MAX_FIXED_COST_S:g}] s")
            if value < 0:
                raise ValueError(f"kernels.{path} = {value:g} is negative")
        return kernels

    @field_validator("time", "memory")
    @classmethod
    def _finite(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Numbers must be finite (the stack's own bounds check the rest when the overrides apply)."""
        for key, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key} = {value} is not a finite number")
        return values


def load_calibration(path: str | Path) -> CalibrationFile:
    """Read and validate a calibration YAML (one-line errors for every problem)."""
    text = read_small_text(path, MAX_CALIBRATION_FILE_BYTES, "calibration file",
                           "does not exist (write one with `sp-plan calibrate`)")
    what = f"calibration file {path}"
    return validated(CalibrationFile, parse_mapping(text, what, f"kind: {CALIBRATION_KIND}, kernels, time, memory"),
                     what)


@dataclass(frozen=True, eq=False)
class CostProfile:
    """The resolved assumptions of one prediction: a stack (memory + time) and the GPU's kernels.

    Compared and hashed by identity: the cost model's memo tables key on the object (which keeps it
    alive as long as its entries), so resolve a profile once and pass the same object around.
    ``overridden``: kernel parameters a calibration file set (they win over a topology's own compute
    calibration).
    """

    stack: StackProfile
    kernels: KernelModel
    overridden: frozenset[str] = frozenset()

    @property
    def memory(self) -> MemoryAssumptions:
        return self.stack.memory

    @property
    def name(self) -> str:
        return self.stack.name

    def with_assumptions(self, assumptions: MemoryAssumptions | None) -> "CostProfile":
        """This profile with its memory assumptions replaced (``--assume`` / an explicit argument)."""
        if assumptions is None:
            return self
        assumptions = synced_memory(assumptions, self.stack.time)
        if assumptions == self.stack.memory:
            return self
        return CostProfile(self.stack.model_copy(update={"memory": assumptions}), self.kernels, self.overridden)


@cache
def default_profile(gpu: str) -> CostProfile:
    """The default stack on ``gpu`` with no calibration (cached: the planner asks per evaluation, and
    the cost model's memo tables key on the profile object)."""
    return CostProfile(load_stack(None), kernel_model(gpu))


def resolve_profile(gpu: str, stack: str | Path | StackProfile | None = None,
                    calibration: str | Path | CalibrationFile | None = None,
                    assume: dict[str, Any] | None = None) -> CostProfile:
    """The profile for ``gpu``: the stack (explicit, else the calibration's, else the default), the
    GPU's kernel model, the calibration's overrides, then ``assume`` (memory-assumption overrides)."""
    cal = load_calibration(calibration) if isinstance(calibration, (str, Path)) else calibration
    if isinstance(stack, StackProfile):
        base = stack
    else:
        base = load_stack(stack if stack is not None else (cal.stack if cal is not None else None))
    kernels = kernel_model(gpu)
    overridden: frozenset[str] = frozenset()
    if cal is not None:
        if cal.kernels:
            if cal.gpu is not None and cal.gpu != gpu:
                raise CostModelError(
                    f"the calibration was fitted on {cal.gpu} but this plan runs on {gpu}: calibrate on {gpu} runs, "
                    "or drop --calibration"
                )
            kernels = kernels.with_values(cal.kernels)
            overridden = frozenset(cal.kernels)
        if cal.time or cal.memory:
            base = base.with_overrides(memory=cal.memory, time=cal.time, name=f"{base.name}+calibration")
    if assume:
        base = base.with_overrides(memory=assume)
    return CostProfile(base, kernels, overridden)


# ----- caches of fitted values -------------------------------------------------------------------------


def clear_caches() -> None:
    """Forget the fitted values and everything cached from them (kernel models, shipped stacks with
    their fitted overheads, default profiles): after rewriting ``fitted.yaml``, or when other values
    take effect. This module sits above the kernel and stack modules, so it is the one that reaches
    every cache."""
    forget_shipped()
    kernel_model.cache_clear()
    clear_gemm_memos()
    _stack._shipped.cache_clear()
    default_profile.cache_clear()


@contextmanager
def use_fitted(params: FittedParameters) -> Iterator[FittedParameters]:
    """Predict with ``params`` instead of the shipped fitted values inside the block
    (``benchmarks/accuracy.py --fit`` pins the kernels, then fits the system level on top of the new
    kernel values); the caches are cleared on entry and on exit."""
    try:
        with replaced(params):
            clear_caches()
            yield params
    finally:
        clear_caches()


__all__ = [
    "CALIBRATION_KIND",
    "CalibrationError",
    "CalibrationFile",
    "CostProfile",
    "clear_caches",
    "default_profile",
    "load_calibration",
    "resolve_profile",
    "use_fitted",
]
