"""``estimate``: everything the cost models predict for one model, run and layout, as one object.

Memory comes from :mod:`cost_models.memory`; communication and time are filled in by their own models
(``comm``/``time`` stay ``None`` until then, and are written as ``null`` in JSON).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from .gpu_spec import GPUSpec
from .layout import Layout
from .memory import HostMemory, MemoryAssumptions, MemoryBreakdown, MemoryDetail, memory_report
from .model_spec import ModelSpec
from .train_spec import TrainSpec


class EstimateDetail(MemoryDetail):
    """Memory detail plus what the estimate was computed for."""

    model: str
    gpu: str
    seq_len: int
    micro_batch: int
    dtype: str


class Estimate(BaseModel):
    """Per-GPU predictions for one layout. Bytes, seconds, FLOPs; see docs/memory_model.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layout: Layout
    memory: MemoryBreakdown
    host_memory: HostMemory
    fits: bool
    detail: EstimateDetail
    comm: dict[str, Any] | None = None
    time: dict[str, Any] | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict: raw units, keys as documented in the brief."""
        data = self.model_dump(mode="json")
        data["layout"] = self.layout.degrees()
        return data


def estimate(model: ModelSpec, train: TrainSpec, layout: Layout, gpu: GPUSpec,
             assumptions: MemoryAssumptions | None = None) -> Estimate:
    """Check the layout against the model and sequence, then predict per-GPU memory."""
    layout.check_against(model, train.seq_len, train.tp_sequence_parallel)
    report = memory_report(model, train, layout, gpu, assumptions)
    detail = EstimateDetail(
        **report.detail.model_dump(),
        model=model.name,
        gpu=gpu.name,
        seq_len=train.seq_len,
        micro_batch=train.micro_batch,
        dtype=train.dtype,
    )
    return Estimate(layout=layout, memory=report.memory, host_memory=report.host_memory, fits=report.fits,
                    detail=detail)
