"""A measured run (a configuration plus one measured figure) and what the cost model predicts for it.

Published measurements (:mod:`.published`) and the user's own runs (``sp-plan validate --json`` output
or a CSV, :mod:`.user_runs`) become the same :class:`MeasuredRun`, so one piece of code predicts,
fits and reports both. A figure only means something with its *semantics*, which :data:`METRICS`
spells out: nvidia-smi's used memory is not PyTorch's reserved memory, and a published "max length" is
the longest length that ran, a lower bound on the true limit.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.estimate import Estimate, estimate, offload_traffic
from sp_plan.cost_models.memo import Memo
from sp_plan.cost_models.memory import MemoryAssumptions, memory_report
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.profile import CostProfile
from sp_plan.cost_models.time_model import OffloadTraffic, TimeEstimate, attention_forward_seconds, comm_and_time
from sp_plan.cost_models.topology import Topology, load_topology
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.cost_models.units import GiB

Kind = Literal["memory", "max_length", "throughput", "attention_kernel", "layer_time"]
Confidence = Literal["exact", "figure", "ambiguous", "measured"]

#: Metric name -> (kind, what the figure is). Predictions are computed to match each definition.
METRICS: dict[str, tuple[Kind, str]] = {
    "nvml_used_gib": ("memory", "device-wide used memory (NVML / nvidia-smi) / 2^30: CUDA context, NCCL buffers, "
                                "the caching allocator's reserved segments"),
    "reserved_gib": ("memory", "torch.cuda.max_memory_reserved() / 2^30: the allocator's segments, no context/NCCL"),
    "allocated_gib": ("memory", "torch.cuda.max_memory_allocated() / 2^30: live tensors at the peak"),
    "hbm_gb": ("memory", "'HBM used' as a source reports it without saying how (compared with NVML-style total, GB)"),
    "peak_bytes": ("memory", "measured peak of live tensors in bytes (sp-plan validate: CUDA max allocated, or "
                             "the CPU live-bytes meter)"),
    "max_seq_len": ("max_length", "the longest sequence that ran with these options (a lower bound on the limit)"),
    "tps_per_gpu": ("throughput", "tokens per second per GPU"),
    "tflops_per_gpu": ("throughput", "TFLOP/s per GPU in the source's FLOP convention (run.flop_convention)"),
    "step_s": ("throughput", "seconds per optimizer step"),
    "iters_per_s": ("attention_kernel", "attention forward calls per second on the whole sequence"),
    "layer_fwd_ms": ("layer_time", "milliseconds per transformer layer, forward"),
    "layer_bwd_ms": ("layer_time", "milliseconds per transformer layer, backward (recompute included)"),
}

#: FLOP conventions of published TFLOP/s figures.
FlopConvention = Literal["model", "megatron_deepspeed", "nemo_llama"]


class MeasuredRun(BaseModel):
    """One configuration that ran and one figure measured on it."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    id: str = Field(min_length=1, max_length=300)
    source: str = Field(min_length=1, max_length=200)
    metric: str
    value: float = Field(gt=0)
    confidence: Confidence = "measured"
    caveat: str = ""
    #: Runs that one published table compares (their ordering is scored with Kendall tau).
    group: str | None = None
    #: Only ratios between the runs of ``group`` are meaningful (the table's absolute level is not
    #: consistent with the source's other tables): fits and reports use the figure relative to the
    #: group's geometric mean.
    scale_free: bool = False
    #: A max length published as a bracket: the shortest length that was tried and failed (the limit lies in
    #: [value, failed_at)); a prediction inside the bracket is right, outside it is off by the nearer end.
    failed_at: float | None = Field(default=None, gt=0)
    model: ModelSpec
    train: TrainSpec
    layout: Layout
    #: Topology preset / file reference (resized to the layout's GPUs) the run used.
    topology: str
    stack: str
    #: Memory-assumption overrides this run's own settings imply (e.g. no Liger: eager RMSNorm).
    memory_overrides: dict[str, Any] = Field(default_factory=dict)
    #: Stack time-property overrides the run's software implies (e.g. a fused ring merge).
    time_overrides: dict[str, Any] = Field(default_factory=dict)
    flop_convention: FlopConvention = "model"
    #: What was assumed where the source is silent (printed in the report).
    assumed: str = ""

    @property
    def kind(self) -> Kind:
        return METRICS[self.metric][0]


@lru_cache(maxsize=256)
def run_topology(ref: str, gpus: int) -> Topology:
    """The run's topology, resized to ``gpus`` (cached: fits predict the same runs many times)."""
    per_node = None if gpus >= 8 else gpus
    return load_topology(ref, gpus, per_node)


#: Metrics read from the time model alone (no memory figure): :func:`predict` skips the memory report's
#: bookkeeping for them and reuses the offload traffic it implies (see :func:`_run_time`).
TIME_METRICS = frozenset({"tps_per_gpu", "step_s", "tflops_per_gpu", "layer_fwd_ms", "layer_bwd_ms"})


#: (model, train, layout, topology reference) -> [(memory assumptions, offload traffic)], newest last.
_OFFLOAD: Memo[list[tuple[MemoryAssumptions, OffloadTraffic]]] = Memo(4096)


def _offload(run: MeasuredRun, topology: Topology, assumptions: MemoryAssumptions) -> OffloadTraffic:
    """The host-resident bytes the time model charges PCIe traffic for: they depend on the memory
    assumptions only, not on the kernel and time parameters a calibration fit moves, so a fit that
    predicts the same run hundreds of times computes its memory report once. The assumptions hold a dict
    and cannot be hashed; each fit evaluation builds an equal copy, so they are compared by value among
    the few seen for the run."""
    seen = _OFFLOAD.get((run.model, run.train, run.layout, run.topology), list)
    for known, traffic in reversed(seen):
        if known is assumptions or known == assumptions:
            return traffic
    traffic = offload_traffic(memory_report(run.model, run.train, run.layout, topology.gpu, assumptions).host_memory)
    seen.append((assumptions, traffic))
    del seen[:-8]  # a fit of memory parameters sees new assumptions at every step: keep the latest few
    return traffic


def _run_time(run: MeasuredRun, profile: CostProfile) -> TimeEstimate:
    """``estimate(...).time`` for the run, without the parts of the estimate no time metric reads (the
    full memory breakdown, its JSON detail). The same functions in the same order as
    :func:`sp_plan.cost_models.estimate.estimate`, so the figure is identical (tested)."""
    run.layout.check_against(run.model, run.train.seq_len, run.train.tp_sequence_parallel)
    topology = run_topology(run.topology, run.layout.world)
    offload = _offload(run, topology, profile.memory)
    return comm_and_time(run.model, run.train, run.layout, topology, offload=offload, with_placement=False,
                         profile=profile).time


def _estimate(run: MeasuredRun, profile: CostProfile, seq_len: int | None = None) -> Estimate:
    train = run.train if seq_len is None else run.train.model_copy(update={"seq_len": seq_len})
    topology = run_topology(run.topology, run.layout.world)
    return estimate(run.model, train, run.layout, topology, with_placement=False, profile=profile)


def megatron_deepspeed_flops(model: ModelSpec, train: TrainSpec, sequences: int) -> float:
    """FLOPs per iteration as Megatron-DeepSpeed's throughput printout counts them:
    24 c B s L h^2 (1 + s / (6h) + V / (16 L h)) with c = 4 with activation checkpointing, else 3
    (recompute counted; attention over the full, unmasked s x s)."""
    h, s, layers = model.hidden_size, train.seq_len, model.num_layers
    c = 4 if train.checkpointing == "full" else 3
    return 24 * c * sequences * s * layers * h * h * (1 + s / (6 * h) + model.vocab_size / (16 * layers * h))


def nemo_llama_flops(model: ModelSpec, train: TrainSpec, sequences: int) -> float:
    """FLOPs per iteration as NeMo's llama2/llama3 formula counts them (nemo/utils/flops_formulas.py):
    gbs s L h^2 (12 + 12 g/a + 18 f/h + 12 s/h + 6 V/(L h)): forward + backward of every GEMM, the full
    s x s attention (no causal halving), no recompute."""
    h, s, layers = model.hidden_size, train.seq_len, model.num_layers
    return sequences * s * layers * h * h * (
        12 + 12 * model.num_kv_heads / model.num_heads + 18 * model.ffn_hidden_size / h + 12 * s / h
        + 6 * model.vocab_size / (layers * h))


def predict(run: MeasuredRun, profile: CostProfile) -> float:
    """The cost model's value of ``run.metric`` for ``run`` under ``profile`` (same units as the figure)."""
    kind = run.kind
    if kind == "max_length":
        return float(max_seq_len(run, profile))
    if kind == "attention_kernel":
        topology = run_topology(run.topology, run.layout.world)
        return 1.0 / attention_forward_seconds(run.model, run.train, run.layout, topology, profile)
    if run.metric in TIME_METRICS:
        return _time_metric(run, _run_time(run, profile))
    est = _estimate(run, profile)
    m = est.memory
    if run.metric == "nvml_used_gib":  # NVML counts the allocator's cached holes too (device_used, not total)
        return m.device_used / GiB
    if run.metric == "reserved_gib":
        return est.detail.overhead.peak_reserved / GiB
    if run.metric == "allocated_gib":
        return m.peak_allocated / GiB
    if run.metric == "hbm_gb":
        return m.device_used / 1e9
    if run.metric == "peak_bytes":
        return float(m.peak_allocated)
    return _time_metric(run, est.time)


def _time_metric(run: MeasuredRun, t: TimeEstimate) -> float:
    """The run's time metric from a time estimate (same units as the figure)."""
    if run.metric == "tps_per_gpu":
        return t.tokens_per_s / run.layout.world
    if run.metric == "step_s":
        return t.step_s
    if run.metric == "tflops_per_gpu":
        sequences = run.train.micro_batch * run.train.grad_accum * run.layout.dp
        if run.flop_convention == "megatron_deepspeed":
            flops = megatron_deepspeed_flops(run.model, run.train, sequences)
        elif run.flop_convention == "nemo_llama":
            flops = nemo_llama_flops(run.model, run.train, sequences)
        else:
            flops = t.model_flops_per_step
        return flops / t.step_s / run.layout.world / 1e12
    if run.metric == "layer_fwd_ms":
        b = t.breakdown
        return 1e3 * (b["layer_forward_compute_s"] + b["layer_forward_exposed_comm_s"])
    if run.metric == "layer_bwd_ms":
        b = t.breakdown
        return 1e3 * (b["layer_backward_compute_s"] + b["layer_backward_exposed_comm_s"])
    raise CostModelError(f"run {run.id}: unknown metric {run.metric!r}; known: {', '.join(METRICS)}")


def max_seq_len(run: MeasuredRun, profile: CostProfile, upper: int = 1 << 26) -> int:
    """Longest sequence (a multiple of the layout's granule) whose estimate fits, layout and options as
    the run had them: the model's answer to "how long could this configuration go"."""
    multiple = run.layout.seq_multiple(run.train.tp_sequence_parallel)
    granule = multiple * max(1, 1024 // multiple)  # about 1K tokens of resolution

    def fits(n: int) -> bool:
        try:
            return _estimate(run, profile, n * granule).fits
        except CostModelError:
            return False

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * granule > upper:
            return lo * granule
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * granule


def log_ratio(predicted: float, measured: float) -> float:
    return math.log(max(predicted, 1e-30) / measured)


__all__ = ["METRICS", "MeasuredRun", "log_ratio", "max_seq_len", "megatron_deepspeed_flops", "nemo_llama_flops",
           "predict",
           "run_topology"]
