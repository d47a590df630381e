"""How fast a GPU runs the kernels of a transformer step, as a function of their shapes.

A FLOP count divided by one "efficiency" makes every layout compute equally fast, which is wrong in
exactly the cases a sequence-parallel planner must get right: tensor parallelism and short local
sequences shrink GEMMs until tile and wave quantisation and fixed per-kernel costs dominate; ring
attention runs R calls on 1/R-long blocks, each with a launch, a synchronisation and an LSE merge;
causal blocks waste their diagonal tiles. This module prices each kernel from its shape:

GEMM ``(m x k) @ (k x n)`` (cuBLAS/CUTLASS): the library picks an output tile ``TM x TN`` from a few
configurations; a kernel runs ``ceil(m/TM) ceil(n/TN)`` tiles in waves of one tile per SM, so

    fill(tile) = m n / (waves x SMs x TM x TN),   waves = ceil(tiles / SMs)
    efficiency = peak_fraction x max_tile(tile_efficiency x fill) x k / (k + k_half)
    seconds    = 2 m n k / (peak x efficiency) + launch_s

(the ``k_half`` term is the prologue/epilogue of each tile, amortised over the k loop).

Attention (FlashAttention-style, one CTA per (batch, head, query tile)):

    fill       = ctas / (ceil(ctas / SMs) x SMs)
    kv         = L_kv / (L_kv + kv_len_half)              (L_kv: keys per query row on average)
    diagonal   = pairs / (pairs + L_q x TK / 2)           (causal: masked halves of diagonal tiles)
    head_dim   = (d / (d + head_dim_half)) / (128 / (128 + head_dim_half))
    seconds    = FLOPs / (peak x fraction x fill x kv x diagonal x head_dim) + launch_s

Parameters live in ``cost_models/data/kernels/<gpu>.yaml``, one file per GPU family, as documented
priors. The values predictions use are pinned by KERNEL-LEVEL measurements only
(``cost_models/data/calibration/kernels.yaml``: attention kernels by sequence length, head_dim,
causality and pass, GEMMs by shape) through ``planner/fitting/kernel_fit.py``; the result is the
``kernels:`` section of ``cost_models/data/calibration/fitted.yaml``. End-to-end training runs never
move a kernel efficiency: a power cap, a compiler or a framework's overheads are not the kernel's speed.

GPU variants: the same chip at another power cap is another GPU (``cost_models/data/gpus/``) with a
``clock_factor`` (sustained clock relative to the family's reference board); compute-bound kernels run
at ``peak x fraction x clock_factor`` (:attr:`KernelModel.clock_factor` overrides the GPU's value where a
fit or a calibration file sets it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache, lru_cache

from pydantic import BaseModel, ConfigDict, Field

from . import data
from .errors import CostModelError
from .fitted import FitRecord, fitted_parameters
from .yaml_io import safe_load, validated


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TileConfig(_Frozen):
    """One output-tile configuration the GEMM library may pick, with its relative per-SM efficiency
    (smaller tiles re-read operands more often and reach a lower fraction of peak)."""

    m: int = Field(ge=1, le=1024)
    n: int = Field(ge=1, le=1024)
    efficiency: float = Field(default=1.0, gt=0, le=1.0)


class GemmParams(_Frozen):
    peak_fraction: float = Field(gt=0, le=1.0, description="large, wave-aligned GEMMs, fraction of dense peak")
    fp8_peak_fraction: float = Field(gt=0, le=1.0, description="the same for float8 GEMMs, of the fp8 peak")
    tiles: tuple[TileConfig, ...] = Field(min_length=1, max_length=16)
    k_half: float = Field(ge=0, le=1e5, description="k at which per-tile prologue/epilogue halve efficiency")
    launch_s: float = Field(ge=0, le=1e-2, description="fixed seconds per GEMM (launch, tail)")


class AttentionParams(_Frozen):
    forward_fraction: float = Field(gt=0, le=1.0, description="long non-causal blocks, head_dim 128, of peak")
    backward_fraction: float = Field(gt=0, le=1.0)
    tile_q: int = Field(default=128, ge=16, le=1024)
    tile_k: int = Field(default=128, ge=16, le=1024)
    kv_len_half: float = Field(ge=0, le=1e6, description="keys per query row at which the key loop halves efficiency")
    head_dim_half: float = Field(default=32.0, ge=0, le=1024)
    launch_s: float = Field(ge=0, le=1e-2, description="fixed seconds per kernel call")


class KernelModel(_Frozen):
    """Per-GPU kernel performance: shape-aware GEMM and attention efficiency, streaming bandwidth,
    ring-step and overlap costs."""

    gpu: str = Field(min_length=1, max_length=100)
    description: str = Field(default="", max_length=4000)
    sms: int = Field(ge=1, le=4096)
    gemm: GemmParams
    attention: dict[str, AttentionParams] = Field(min_length=1)
    memory_fraction: float = Field(gt=0, le=1.0, description="streaming kernels, fraction of HBM bandwidth")
    ring_step_s: float = Field(ge=0, le=1e-1, description="per ring-attention step: P2P post/wait and merge launch")
    nccl_compute_slowdown: float = Field(
        ge=0, le=1.0, description="compute slowdown while NCCL kernels run beside it (SM and HBM sharing)")
    clock_factor: float | None = Field(
        default=None, gt=0, le=1.5,
        description=("sustained-clock factor of this GPU variant on compute-bound kernels, when a fit or a "
                     "calibration sets it (None: the GPU spec's clock_factor, cost_models/data/gpus/)"))
    fit: FitRecord | None = None

    def attention_params(self, family: str) -> AttentionParams:
        """The entry for a kernel family, falling back to FlashAttention-2's (every file has 'fa2')."""
        return self.attention.get(family) or self.attention["fa2"]

    def with_values(self, values: dict[str, float]) -> "KernelModel":
        """A copy with dotted-path parameters replaced, e.g. ``{"gemm.peak_fraction": 0.7,
        "attention.fa2.kv_len_half": 300}`` (the fitting code and calibration files use this form)."""
        data = self.model_dump()
        for path, value in values.items():
            parent, key = self._locate(data, path)
            parent[key] = value
        return validated(KernelModel, data, f"kernel parameters of {self.gpu}")

    def value(self, path: str) -> float:
        parent, key = self._locate(self.model_dump(), path)
        return float(parent[key])

    def _locate(self, data: dict, path: str) -> tuple[dict, str]:
        """The mapping holding a dotted path's last key (and the key), or a one-line error."""
        node: object = data
        *parents, last = path.split(".")
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            raise CostModelError(f"kernel parameter {path!r} does not exist for {self.gpu}")
        return node, last


# ----- loading ------------------------------------------------------------------------------------------


@cache
def _files() -> dict[str, str]:
    """GPU name -> kernel file name, including the aliases a file declares (``also_for``)."""
    table: dict[str, str] = {}
    for name in data.names("kernels"):
        entry = safe_load(data.read_text("kernels", name))
        table[entry["gpu"]] = f"{name}.yaml"
        for alias in entry.get("also_for", ()):
            table.setdefault(alias, f"{name}.yaml")
    return table


#: The file used for a GPU without one of its own (documented priors; see generic.yaml).
GENERIC = "generic"
#: Devices named like this are CPU ranks (the probe on a machine without GPUs): cpu.yaml.
CPU_PREFIX = "cpu"


def _file_for(gpu: str) -> str:
    files = _files()
    if gpu in files:
        return files[gpu]
    return files[CPU_PREFIX] if gpu.startswith(CPU_PREFIX) else files[GENERIC]


@cache
def prior_kernel_model(gpu: str) -> KernelModel:
    """A GPU's kernel file as written (the documented priors), without fitted values. Aliases resolve
    to their family's file; a GPU with no file, such as an inline GPU of a probed topology, gets the
    generic priors under its own name."""
    name = _file_for(gpu)
    values = safe_load(data.read_text("kernels", name.removesuffix(".yaml")))
    values.pop("also_for", None)
    return validated(KernelModel, {**values, "gpu": gpu}, f"kernel file {name}")


@cache
def kernel_model(gpu: str) -> KernelModel:
    """The kernel model predictions use: the GPU's priors with the values pinned by kernel-level
    measurements (``cost_models/data/calibration/fitted.yaml`` ``kernels:``, per GPU family and for all
    GPUs) and, where the system-level fit set one, the variant's clock factor (``variants:``), with the
    kernel fit's record attached."""
    prior = prior_kernel_model(gpu)
    fitted = fitted_parameters()
    family = kernel_family(gpu)
    values = {**fitted.kernels.get("all", {}), **fitted.kernels.get(family, {})}
    values.update(fitted.variants.get(gpu, {}))
    if not values:
        return prior
    model = prior.with_values(values)
    return model.model_copy(update={"fit": fitted.record_for(sorted(values))})


def kernel_family(gpu: str) -> str:
    """The kernel file a GPU's model comes from (``h100`` for the H100 80/96 GB and H200, ...)."""
    return _file_for(gpu).removesuffix(".yaml")


def kernel_gpus() -> list[str]:
    """GPUs with kernel data of their own (not the generic fallback)."""
    return sorted(g for g in _files() if g not in (GENERIC, CPU_PREFIX))


# ----- GEMMs ----------------------------------------------------------------------------------------------


#: Each GEMM parameter set seen, by ``id``, with its tiles as plain numbers: (the object, kept alive so its id
#: cannot be reused while the entry exists, (m, n, efficiency) per tile). The GEMM timing memos below key on
#: that id, so they are cleared together with it (:func:`_gemm_token`).
_GEMM_PARAMS: dict[int, tuple[GemmParams, tuple[tuple[int, int, float], ...]]] = {}
_GEMM_SECONDS: dict[tuple, float] = {}
_GROUPED_SECONDS: dict[tuple, float] = {}
_MAX_GEMM_PARAMS = 1024
_MAX_GEMM_SECONDS = 1 << 17


def _gemm_tiles(gemm: GemmParams) -> tuple[tuple[int, int, float], ...]:
    """``gemm``'s tiles as plain numbers, registered under ``id(gemm)`` (see :data:`_GEMM_PARAMS`)."""
    entry = _GEMM_PARAMS.get(id(gemm))
    if entry is None or entry[0] is not gemm:
        if len(_GEMM_PARAMS) >= _MAX_GEMM_PARAMS:
            clear_gemm_memos()
        entry = _GEMM_PARAMS[id(gemm)] = (gemm, tuple((t.m, t.n, t.efficiency) for t in gemm.tiles))
    return entry[1]


def clear_gemm_memos() -> None:
    _GEMM_PARAMS.clear()
    _GEMM_SECONDS.clear()
    _GROUPED_SECONDS.clear()


def gemm_shape_efficiency(m: int, n: int, k: int, gemm: GemmParams, sms: int) -> float:
    """Fraction of ``peak_fraction`` a GEMM of this shape reaches (tile/wave quantisation, small k)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 1.0
    return _shape_efficiency(m, n, k, _gemm_tiles(gemm), gemm.k_half, sms)


@lru_cache(maxsize=65536)
def _shape_efficiency(m: int, n: int, k: int, tiles: tuple[tuple[int, int, float], ...], k_half: float,
                      sms: int) -> float:
    # Keyed on plain numbers: hashing the pydantic parameter objects would cost more than the arithmetic.
    best = 0.0
    for tm, tn, efficiency in tiles:
        count = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / sms)
        best = max(best, efficiency * (m * n) / (waves * sms * tm * tn))
    return best * k / (k + k_half)


def gemm_seconds(m: float, n: float, k: float, peak: float, fraction: float, gemm: GemmParams, sms: int) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM at ``peak`` FLOP/s x ``fraction`` (asymptotic).

    Memoised on the numbers and the (frozen) parameter set's identity: the planner prices the same shapes for
    thousands of layouts and option combinations. A pure function of its arguments, so a hit is the value the
    arithmetic gives."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    _gemm_tiles(gemm)  # registers id(gemm) (kept alive) before the memo keys on it
    key = (m, n, k, peak, fraction, id(gemm), sms)
    seconds = _GEMM_SECONDS.get(key)
    if seconds is None:
        if len(_GEMM_SECONDS) >= _MAX_GEMM_SECONDS:
            _GEMM_SECONDS.clear()
        eff = fraction * gemm_shape_efficiency(max(1, round(m)), max(1, round(n)), max(1, round(k)), gemm, sms)
        seconds = _GEMM_SECONDS[key] = 2.0 * m * n * k / (peak * eff) + gemm.launch_s
    return seconds


def grouped_gemm_seconds(shapes: Sequence[tuple[float, float, float, float]], peak: float, fraction: float,
                         gemm: GemmParams, sms: int) -> float:
    """Seconds of one grouped-GEMM launch (CUTLASS/cuBLAS grouped, torch._grouped_mm, DeepGEMM) over
    ``(m, n, k, count)`` expert GEMMs (``count`` experts of that shape) at ``peak`` x ``fraction``.

    The single-GEMM terms of :func:`gemm_seconds` extended to a group: every expert's ``m`` and ``n`` are cut
    into the tile configuration's tiles, all experts' tiles share the waves over the SMs (so one expert's
    small ``m``, e.g. tokens x top_k / experts, costs its padding to the tile height, not a wave of its own),
    each expert's ``k`` pays the per-tile prologue/epilogue, and the launch is paid once. The tile
    configuration is the fastest one for the whole group. A group of one GEMM equals :func:`gemm_seconds`.
    Memoised like :func:`gemm_seconds`."""
    _gemm_tiles(gemm)
    key = (tuple(shapes), peak, fraction, id(gemm), sms)
    seconds = _GROUPED_SECONDS.get(key)
    if seconds is None:
        if len(_GROUPED_SECONDS) >= _MAX_GEMM_SECONDS:
            _GROUPED_SECONDS.clear()
        seconds = _GROUPED_SECONDS[key] = _grouped_gemm_seconds(shapes, peak, fraction, gemm, sms)
    return seconds


def _grouped_gemm_seconds(shapes: Sequence[tuple[float, float, float, float]], peak: float, fraction: float,
                          gemm: GemmParams, sms: int) -> float:
    items = [(max(1, round(m)), max(1, round(n)), max(1, round(k)), c, 2.0 * m * n * k)
             for m, n, k, c in shapes if m > 0 and n > 0 and k > 0 and c > 0]
    if not items:
        return 0.0
    best = math.inf
    for tile in gemm.tiles:
        tiles = sum(c * math.ceil(m / tile.m) * math.ceil(n / tile.n) for m, n, _, c, _ in items)
        waves = math.ceil(tiles / sms)
        fill = sum(c * m * n for m, n, _, c, _ in items) / (waves * sms * tile.m * tile.n)
        work = sum(c * flops * (k + gemm.k_half) / k for _, _, k, c, flops in items)
        best = min(best, work / (peak * fraction * tile.efficiency * fill))
    return best + gemm.launch_s


# ----- attention ------------------------------------------------------------------------------------------


def attention_pairs(q_len: float, kv_len: float, causal: bool) -> float:
    """(query, key) pairs one call computes per (batch, head); causal calls are square blocks."""
    return q_len * (kv_len + 1) / 2 if causal else q_len * kv_len


def attention_shape_efficiency(batch_heads: float, q_len: float, kv_len: float, head_dim: int, causal: bool,
                               p: AttentionParams, sms: int) -> float:
    """Fraction of the asymptotic attention efficiency a call of this shape reaches."""
    if q_len <= 0 or kv_len <= 0:
        return 1.0
    ctas = max(1.0, batch_heads * math.ceil(q_len / p.tile_q))
    fill = ctas / (math.ceil(ctas / sms) * sms)
    pairs = attention_pairs(q_len, kv_len, causal)
    keys_per_row = pairs / q_len
    kv = keys_per_row / (keys_per_row + p.kv_len_half)
    diagonal = pairs / (pairs + q_len * p.tile_k / 2) if causal else 1.0
    hd = (head_dim / (head_dim + p.head_dim_half)) / (128 / (128 + p.head_dim_half))
    return fill * kv * diagonal * hd


def attention_seconds(batch_heads: float, q_len: float, kv_len: float, head_dim: int, causal: bool,
                      peak: float, fraction: float, p: AttentionParams, sms: int, backward_ratio: float = 1.0,
                      calls: float = 1.0) -> float:
    """Seconds of ``calls`` attention kernel calls (forward, or backward with ``backward_ratio`` x the
    forward FLOPs and ``fraction`` the backward fraction)."""
    if calls <= 0 or q_len <= 0 or kv_len <= 0:
        return 0.0
    flops = 4.0 * batch_heads * head_dim * attention_pairs(q_len, kv_len, causal) * backward_ratio
    eff = fraction * attention_shape_efficiency(batch_heads, q_len, kv_len, head_dim, causal, p, sms)
    return calls * (flops / (peak * eff) + p.launch_s)


__all__ = [
    "AttentionParams",
    "FitRecord",
    "GemmParams",
    "KernelModel",
    "TileConfig",
    "attention_seconds",
    "attention_shape_efficiency",
    "gemm_seconds",
    "gemm_shape_efficiency",
    "grouped_gemm_seconds",
    "kernel_family",
    "prior_kernel_model",
    "kernel_gpus",
    "kernel_model",
]
