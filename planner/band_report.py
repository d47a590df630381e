"""The error bands under a plan, an estimate or a capacity answer: what to print and what ``--json`` carries.

One place decides which band a prediction gets (:func:`prediction_bands`) so that ``plan``, ``estimate`` and
``capacity`` agree: the calibration's own held-out check when ``--calibration`` is given, else the shipped
held-out residuals for the stack, GPU and regime (:mod:`sp_plan.planner.uncertainty`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.cost_models.units import GB

from .uncertainty import Band, Quantity, Regime, band_for, calibrated_band, significant

#: Where a user learns to tighten a band (printed under an uncalibrated one).
CALIBRATE_HINT = "calibrate on 2-3 of your runs to tighten it: docs/calibrate-in-10-minutes.md"


def stack_name(stack: str) -> str:
    """A stack as the residuals name it: a shipped profile's name; a stack file is named by its file."""
    return Path(stack).stem if stack.endswith((".yaml", ".yml")) else stack


def prediction_bands(model: ModelSpec, train: TrainSpec, layout: Layout, *, gpu: str, stack: str,
                     calibration: Any = None, quantities: tuple[Quantity, ...] = ("step_time", "memory")
                     ) -> dict[Quantity, Band]:
    """The band of each of ``quantities`` for this prediction. ``calibration``: a loaded
    :class:`~sp_plan.cost_models.profile.CalibrationFile`, a path to one, or ``None``."""
    if isinstance(calibration, (str, Path)):
        from sp_plan.cost_models.profile import load_calibration

        calibration = load_calibration(calibration)
    name = stack_name(stack)
    if calibration is not None:
        return {q: calibrated_band(q, calibration, gpu, name) for q in quantities}
    regime = Regime(seq_len=train.seq_len, moe=model.moe is not None, pipelined=layout.pipeline_stages > 1)
    return {q: band_for(q, name, gpu, regime) for q in quantities}


def band_lines(bands: dict[Quantity, Band], *, step_s: float | None = None, tokens_per_s: float | None = None,
               memory_bytes: float | None = None, max_seq_len: int | None = None) -> list[str]:
    """``  trust: step ~120 s, ~35,600 tokens/s +/-33% (1 sigma; ...)`` and one line per other quantity."""
    lines = []
    step = bands.get("step_time")
    if step is not None:
        figures = ", ".join(f for f in (
            f"step ~{significant(step_s, step)} s" if step_s is not None else "",
            f"~{significant(tokens_per_s, step)} tokens/s" if tokens_per_s is not None else "") if f)
        lines.append(f"  trust: {figures} {step.describe()}" if step.known else f"  trust: {figures}: {step.describe()}")
    memory = bands.get("memory")
    if memory is not None:
        figure = f"memory ~{significant(memory_bytes / GB, memory)} GB " if memory_bytes is not None else "memory "
        lines.append(f"         {figure}{memory.describe()}")
    length = bands.get("max_length")
    if length is not None:
        figure = f"max length ~{significant(max_seq_len, length)} tokens " if max_seq_len is not None else "max length "
        lines.append(f"         {figure}{length.describe()}")
    if lines and not any(b.calibrated for b in bands.values()):
        lines.append(f"         {CALIBRATE_HINT}")
    return lines


def bands_json(bands: dict[Quantity, Band]) -> dict[str, Any]:
    return {q: b.to_json() for q, b in bands.items()}


__all__ = ["CALIBRATE_HINT", "band_lines", "bands_json", "prediction_bands", "stack_name"]
