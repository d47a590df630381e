"""Bridges from other training loops to the sp-plan runtime.

:mod:`sp_plan.runtime.integrations.transformers`: transformers' ``Trainer`` (and TRL's trainers built on it)
running the model :func:`sp_plan.runtime.auto.auto_configure` parallelised. Each bridge imports its
framework lazily: ``import sp_plan.runtime.integrations`` needs neither transformers nor TRL.

:mod:`sp_plan.runtime.integrations.calibration_callback`: :class:`CalibrationCallback`, a ``TrainerCallback``
(Trainer, SFTTrainer) that appends the run's measured step time, tokens/s and peak memory as a row
``sp-plan calibrate`` reads (``SequenceParallelTrainer(..., calibration_csv="runs.csv")`` adds it).

The names below are resolved on first access (``from sp_plan.runtime.integrations import CalibrationCallback``).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CalibrationCallback": "sp_plan.runtime.integrations.calibration_callback",
    "SequenceParallelTrainer": "sp_plan.runtime.integrations.transformers",
    "SequenceParallelMixin": "sp_plan.runtime.integrations.transformers",
    "training_arguments": "sp_plan.runtime.integrations.transformers",
    "SequenceParallelSFTTrainer": "sp_plan.runtime.integrations.trl",
}

__all__ = ["CalibrationCallback", "SequenceParallelMixin", "SequenceParallelSFTTrainer", "SequenceParallelTrainer",
           "training_arguments"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
