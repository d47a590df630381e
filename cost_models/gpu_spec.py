"""Accelerator descriptions: memory capacity and dense peak throughput per dtype."""

from __future__ import annotations

import math
import re

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import data
from .errors import CostModelError, explain_validation_error

DType = str  # "bf16" | "fp16" | "fp32" | "tf32" | "fp8"

#: Physical bounds of any accelerator (or probed CPU rank), FLOP/s and bytes/s: from a slow CPU core under
#: time slicing to ten times a GB300's dense FP4. Outside them a spec file is wrong (0 divided a step time,
#: 1e-300 made it infinite, inf and NaN printed as non-JSON), so they are refused where the file is read.
MIN_PEAK_FLOPS, MAX_PEAK_FLOPS = 1e6, 1e17
MIN_MEMORY_BANDWIDTH, MAX_MEMORY_BANDWIDTH = 1e6, 1e14
_DTYPE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,15}$")


class GPUSpec(BaseModel):
    """One accelerator variant (the same chip at another power cap or memory size is another variant).

    ``memory_bytes`` is the total device memory as ``nvidia-smi`` reports it (what the CUDA caching
    allocator can at most reserve, before the CUDA context takes its share); ``peak_flops`` is the
    dense (not 2:4-sparse) tensor-core peak per dtype from the vendor's datasheet.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    memory_bytes: int = Field(gt=0, le=1 << 44)
    peak_flops: dict[DType, float] = Field(min_length=1, max_length=16)
    memory_bandwidth: float = Field(ge=MIN_MEMORY_BANDWIDTH, le=MAX_MEMORY_BANDWIDTH, allow_inf_nan=False,
                                    description="HBM/GDDR bandwidth, bytes/s")
    power_w: float | None = Field(default=None, gt=0, le=5000, description="board power limit of this variant, W")
    clock_factor: float = Field(
        default=1.0, gt=0, le=1.5,
        description=(
            "sustained tensor-core clock under dense compute relative to the board the GPU family's kernel "
            "data were measured on: the same chip at a lower power cap is slower on compute-bound kernels "
            "only, so a 500 W board never makes a 700 W board's kernels slower"
        ),
    )

    @field_validator("peak_flops")
    @classmethod
    def _physical_peaks(cls, peaks: dict[DType, float]) -> dict[DType, float]:
        for dtype, flops in peaks.items():
            if not _DTYPE_NAME.match(dtype):
                raise ValueError(f"peak_flops key {dtype[:40]!r} is not a dtype name such as bf16, fp8 or fp32")
            if not (math.isfinite(flops) and MIN_PEAK_FLOPS <= flops <= MAX_PEAK_FLOPS):
                raise ValueError(f"peak_flops {dtype} is {flops:g} FLOP/s; a device's dense peak lies between "
                                 f"{MIN_PEAK_FLOPS:g} and {MAX_PEAK_FLOPS:g} (an H100's bf16 is 989.4e12)")
        return peaks

    def flops_for(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise CostModelError(
                f"{self.name} has no {dtype} peak listed; choose one of {', '.join(sorted(self.peak_flops))}"
            ) from None


def gpu_aliases() -> dict[str, str]:
    """Other names of shipped variants (``h100-sxm`` -> ``h100-80gb``), as their files declare them."""
    return dict(data.aliases("gpus"))


def gpu_preset_names() -> list[str]:
    """Shipped GPU variants (``cost_models/data/gpus/<name>.yaml``), sorted."""
    return list(data.names("gpus"))


def canonical_gpu_name(name: str) -> str:
    """The preset name a GPU name or alias resolves to (unknown names are returned normalised)."""
    key = name.strip().lower()
    return data.canonical("gpus", key) or key


def get_gpu_preset(name: str) -> GPUSpec:
    """A shipped variant by name or alias (case-insensitive); an unknown name gets the closest ones."""
    key = data.canonical("gpus", name)
    if key is None:
        raise data.unknown_name("gpus", name)
    fields = {k: v for k, v in data.load("gpus", key).items() if k != "aliases"}
    try:
        return GPUSpec(name=key, **fields)
    except ValidationError as exc:
        raise explain_validation_error(exc, f"GPU preset {key}") from exc
