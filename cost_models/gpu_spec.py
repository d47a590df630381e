"""Accelerator descriptions: memory capacity and dense peak throughput per dtype."""

from __future__ import annotations

from functools import cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import CostModelError, explain_validation_error
from .yaml_io import safe_load

DType = str  # "bf16" | "fp16" | "fp32" | "tf32" | "fp8"


class GPUSpec(BaseModel):
    """One accelerator model.

    ``memory_bytes`` is the total device memory as ``nvidia-smi`` reports it (what the CUDA caching
    allocator can at most reserve, before the CUDA context takes its share); ``peak_flops`` is the
    dense (not 2:4-sparse) tensor-core peak per dtype from the vendor's datasheet.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    memory_bytes: int = Field(gt=0, le=1 << 44)
    peak_flops: dict[DType, float]
    memory_bandwidth: float = Field(gt=0, description="HBM/GDDR bandwidth, bytes/s")

    def flops_for(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise CostModelError(
                f"{self.name} has no {dtype} peak listed; choose one of {', '.join(sorted(self.peak_flops))}"
            ) from None


@cache
def _gpu_table() -> dict[str, dict]:
    return safe_load(resources.files("cost_models.data").joinpath("gpus.yaml").read_text())["gpus"]


def gpu_preset_names() -> list[str]:
    return sorted(_gpu_table())


def get_gpu_preset(name: str) -> GPUSpec:
    table = _gpu_table()
    key = name.strip().lower()
    if key not in table:
        raise CostModelError(f"unknown GPU {name!r}: choose one of {', '.join(gpu_preset_names())}")
    try:
        return GPUSpec(name=key, **table[key])
    except ValidationError as exc:
        raise explain_validation_error(exc, f"GPU preset {key}") from exc
