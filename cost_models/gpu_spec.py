"""Accelerator descriptions: memory capacity and dense peak throughput per dtype."""

from __future__ import annotations

from functools import cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import CostModelError, explain_validation_error
from .yaml_io import safe_load

DType = str  # "bf16" | "fp16" | "fp32" | "tf32" | "fp8"


class GPUSpec(BaseModel):
    """One accelerator variant (the same chip at another power cap or memory size is another variant).

    ``memory_bytes`` is the total device memory as ``nvidia-smi`` reports it (what the CUDA caching
    allocator can at most reserve, before the CUDA context takes its share); ``peak_flops`` is the
    dense (not 2:4-sparse) tensor-core peak per dtype from the vendor's datasheet.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    memory_bytes: int = Field(gt=0, le=1 << 44)
    peak_flops: dict[DType, float]
    memory_bandwidth: float = Field(gt=0, description="HBM/GDDR bandwidth, bytes/s")
    power_w: float | None = Field(default=None, gt=0, le=5000, description="board power limit of this variant, W")
    clock_factor: float = Field(
        default=1.0, gt=0, le=1.5,
        description=(
            "sustained tensor-core clock under dense compute relative to the board the GPU family's kernel "
            "data were measured on: the same chip at a lower power cap is slower on compute-bound kernels "
            "only, so a 500 W board never makes a 700 W board's kernels slower"
        ),
    )

    def flops_for(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise CostModelError(
                f"{self.name} has no {dtype} peak listed; choose one of {', '.join(sorted(self.peak_flops))}"
            ) from None


@cache
def _gpu_file() -> dict:
    return safe_load(resources.files("sp_plan.cost_models.data").joinpath("gpus.yaml").read_text())


def _gpu_table() -> dict[str, dict]:
    return _gpu_file()["gpus"]


def gpu_aliases() -> dict[str, str]:
    """Other names of shipped variants (``h100-sxm`` -> ``h100-80gb``)."""
    return dict(_gpu_file().get("aliases") or {})


def gpu_preset_names() -> list[str]:
    return sorted(_gpu_table())


def canonical_gpu_name(name: str) -> str:
    """The preset name a GPU name or alias resolves to (unknown names are returned normalised)."""
    key = name.strip().lower()
    return gpu_aliases().get(key, key)


def get_gpu_preset(name: str) -> GPUSpec:
    table = _gpu_table()
    key = canonical_gpu_name(name)
    if key not in table:
        raise CostModelError(f"unknown GPU {name!r}: choose one of {', '.join(gpu_preset_names())}")
    try:
        return GPUSpec(name=key, **table[key])
    except ValidationError as exc:
        raise explain_validation_error(exc, f"GPU preset {key}") from exc
