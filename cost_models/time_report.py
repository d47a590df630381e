"""The time model's report: :class:`TimeEstimate`, built from the sums of a priced step only when asked for
(the planner times thousands of combinations and reports a handful).

:func:`report` turns a :class:`PricedStep` (what :func:`sp_plan.cost_models.time_model.step_time` summed)
into the documented figures: communication and exposed communication by strategy, MFU/HFU, the per-layer
breakdown, the efficiencies in effect and the step by component (:func:`components`, the explain-time rows).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from .comm_time import CommProfile, split
from .compute_time import efficiency_sources
from .flops import microbatch_work
from .layout import Layout
from .model_spec import ModelSpec
from .pipeline_time import PipelineStep
from .profile import CostProfile
from .strategies import report_buckets
from .strategies.moe_host import moe_host_sync_note
from .strategies.overlap import overlap_sources
from .strategies.terms import ComputeTime
from .time_terms import LayerOverlap, StrategyTerms
from .topology.topology import Topology
from .train_spec import TrainSpec


class TimeEstimate(BaseModel):
    """One optimizer step (prefill: one forward pass), in seconds unless named otherwise."""

    model_config = ConfigDict(frozen=True)

    compute_s: float = Field(description="GPU compute per step, recompute included")
    comm_s: float = Field(description="all collectives per step as if run back to back")
    exposed_comm_s: float = Field(description="communication on the critical path")
    optimizer_s: float = Field(description="optimizer step (GPU, or CPU when offloaded)")
    offload_s: float = Field(description="exposed PCIe traffic of offloading")
    interference_s: float = Field(
        default=0.0, description="compute slowed by overlapped collectives (NCCL kernels sharing SMs and HBM)")
    overhead_s: float = Field(default=0.0, description="the stack's fixed host-side time per step")
    pipeline_bubble_s: float = Field(
        default=0.0, description="pipeline parallelism: the slowest stage's idle fill and drain (0 without PP)")
    step_s: float = Field(description=("compute + exposed comm + optimizer + offload + interference + overhead "
                                       "(+ pipeline bubble)"))
    tokens_per_step: float
    tokens_per_s: float
    mfu: float = Field(description="model FLOPs (no recompute) / (step time x GPUs x peak)")
    hfu: float = Field(description="executed FLOPs (recompute, flash backward) / (step time x GPUs x peak)")
    model_flops_per_step: float
    peak_flops: float = Field(description="per GPU, dense, for the training dtype")
    comm_s_by_strategy: dict[str, float]
    exposed_comm_s_by_strategy: dict[str, float]
    hidden_comm_s_by_strategy: dict[str, float] = Field(
        default_factory=dict,
        description=("communication a stack overlap hid behind compute, by strategy (TP inside its GEMMs, MoE "
                     "all-to-alls behind another micro-batch; sp_plan.cost_models.strategies.overlap), seconds "
                     "per step; not part of step_s"))
    fabric_bytes_per_step: float = Field(description="bytes per GPU per step that cross nodes")
    breakdown: dict[str, float] = Field(description="per-layer / per-micro-batch components, seconds")
    efficiencies: dict[str, float] = Field(description="calibration in effect")
    components: dict[str, float] = Field(
        default_factory=dict,
        description=("the step by component, seconds (compute parts of sp_plan.cost_models.compute_time.COMPUTE_PARTS, "
                     "exposed communication by strategy, interference, offload, optimizer, step overhead); "
                     "they add up to step_s"))
    efficiency_sources: dict[str, str] = Field(
        default_factory=dict, description="where each efficiency and stack overhead came from")


def components(ct: ComputeTime, accum: int, exposed: dict[str, float], interference_s: float, offload_s: float,
                optimizer_s: float, overhead_s: float, host_s: float, pipe: PipelineStep | None,
                host_sync_s: float = 0.0) -> dict[str, float]:
    """The step by component (they add up to the step). With pipeline stages: the slowest stage's compute
    parts, the bubble, and the exposed communication (the rest of the step, by strategy in proportion to
    the stage's exposed traffic). ``overhead_s`` holds the stack's per-step overhead and the topology's
    measured host overhead ``host_s``, listed apart; ``moe_host_sync`` (only where it is not 0) is the GPU idle
    of MoE layers waiting on the host (:mod:`sp_plan.cost_models.strategies.moe_host`)."""
    if pipe is None:
        return {
            **{name: accum * seconds for name, seconds in ct.parts.items()},
            **{f"exposed_comm_{k}": v for k, v in exposed.items()},
            "interference": interference_s,
            "offload": offload_s,
            "optimizer": optimizer_s,
            "step_overhead": overhead_s - host_s,
            "host_overhead": host_s,
            **host_sync_part(host_sync_s),
        }
    parts = {name: accum * seconds * pipe.compute_mb / max(pipe.compute_mb_parts, 1e-300)
             for name, seconds in ct.parts.items()}
    return {**parts, **{f"exposed_comm_{k}": v for k, v in exposed.items()}, "pipeline_bubble": pipe.bubble,
            "interference": interference_s, "offload": offload_s, "optimizer": optimizer_s,
            "step_overhead": overhead_s - host_s, "host_overhead": host_s, **host_sync_part(host_sync_s)}


def host_sync_part(host_sync_s: float) -> dict[str, float]:
    """The ``moe_host_sync`` component, listed only where a plan has it (MoE layers waiting on the host)."""
    return {"moe_host_sync": host_sync_s} if host_sync_s > 0 else {}


class StepSums(NamedTuple):
    """The step's seconds as :func:`sp_plan.cost_models.time_model.step_time` summed them: one layer's forward
    and backward (exposed per-layer communication, interference and host idle included), one micro-batch,
    and the step's compute, interference, host idle, exposed communication, total, useful tokens and
    overheads (``overhead_s`` includes the topology's measured host overhead ``host_s``)."""

    layer_f: float
    layer_b: float
    microbatch_s: float
    compute_s: float
    interference_s: float
    host_sync_s: float
    step_comm_exposed: float
    step_s: float
    tokens_per_step: float
    overhead_s: float
    host_s: float


class PricedStep(NamedTuple):
    """Everything one step was priced from (``model``: the priced stage's with pipeline stages, else
    ``whole_model``), with its sums: what :func:`report` dresses up as a :class:`TimeEstimate`."""

    model: ModelSpec
    whole_model: ModelSpec
    train: TrainSpec
    layout: Layout
    topology: Topology
    profile: CostProfile
    ct: ComputeTime
    cp: CommProfile
    st: StrategyTerms
    ov: LayerOverlap
    pipe: PipelineStep | None
    sums: StepSums


def report(p: PricedStep) -> TimeEstimate:
    """The documented :class:`TimeEstimate` of a priced step."""
    train, layout, ct, cp, st, s, pipe = p.train, p.layout, p.ct, p.cp, p.st, p.sums, p.pipe
    layers, accum = p.model.num_layers, train.grad_accum
    peak = p.topology.peak_flops(train.dtype)
    eff = p.topology.efficiency
    comm_by = {k: accum * cp.comm_mb[k] + cp.comm_step[k] for k in report_buckets()}
    exposed = exposed_by_strategy(p)
    w = microbatch_work(p.whole_model, train, layout)
    # Every rank runs its share of one replica's work: pp stages share the model's FLOPs.
    model_flops = w.model_flops * layout.world * accum / layout.pp
    denominator = s.step_s * layout.world * peak
    executed = w.executed_flops(p.whole_model.num_layers) * layout.world * accum / layout.pp
    return TimeEstimate.model_construct(  # computed values; skip re-validation
        compute_s=s.compute_s,
        comm_s=sum(comm_by.values()),
        exposed_comm_s=s.step_comm_exposed,
        optimizer_s=st.optimizer,
        offload_s=st.offload,
        interference_s=s.interference_s,
        overhead_s=s.overhead_s,
        pipeline_bubble_s=pipe.bubble if pipe is not None else 0.0,
        step_s=s.step_s,
        tokens_per_step=s.tokens_per_step,
        tokens_per_s=s.tokens_per_step / s.step_s,
        mfu=model_flops / denominator,
        hfu=executed / denominator,
        model_flops_per_step=model_flops,
        peak_flops=peak,
        comm_s_by_strategy=comm_by,
        exposed_comm_s_by_strategy=exposed,
        hidden_comm_s_by_strategy={k: v * layers * accum for k, v in st.hidden_layer_by.items()},
        fabric_bytes_per_step=accum * cp.fabric_mb + cp.fabric_step,
        breakdown=breakdown(p),
        efficiencies={**ct.fractions, "pcie": eff.pcie, "host_memory": eff.host_memory,
                      "compute_overhead_fraction": p.profile.stack.time.compute_overhead_fraction},
        components=components(ct, accum, exposed, s.interference_s, st.offload, st.optimizer, s.overhead_s, s.host_s,
                              pipe, s.host_sync_s),
        efficiency_sources={**efficiency_sources(p.topology, p.profile),
                            **overlap_sources(p.profile.stack, p.model, train, layout),
                            **host_sync_source(p.profile, p.model, train, layout)},
    )


def exposed_by_strategy(p: PricedStep) -> dict[str, float]:
    """Exposed communication seconds per step by report bucket: the non-overlapping ops, the strategies'
    exposed terms, the overlapped traffic's exposed excess in proportion to each strategy's traffic; with
    pipeline stages rescaled to the pipelined step's exposed time in the same proportions."""
    cp, st, pipe, ov = p.cp, p.st, p.pipe, p.ov
    layers, accum = p.model.num_layers, p.train.grad_accum
    exposed = {k: layers * accum * cp.exposed_layer[k] + accum * cp.model_mb_by[k] + cp.model_step_by[k]
               for k in report_buckets()}
    for k, v in st.layer_by.items():
        exposed[k] += v * layers * accum
    for k, v in st.microbatch_by.items():
        exposed[k] += v * accum
    for k, v in st.step_by.items():
        exposed[k] += v
    split(exposed, ov.fwd * accum, cp.prefetch_f_by)
    split(exposed, ov.bwd_mb * (accum - 1) + ov.bwd_last, cp.overlapped_b_by)
    if pipe is not None:  # the pipelined step's exposed time, attributed in the same proportions
        step_comm_exposed = p.sums.step_comm_exposed
        total = sum(exposed.values())
        for k in exposed:
            exposed[k] = exposed[k] * step_comm_exposed / total if total > 0 else 0.0
        if total <= 0:
            exposed["pipeline"] = step_comm_exposed
    return exposed


def breakdown(p: PricedStep) -> dict[str, float]:
    """Per-layer and per-micro-batch seconds (and the pipeline's, with stages)."""
    ct, cp, st, training = p.ct, p.cp, p.st, p.train.is_training
    return {
        "layer_forward_compute_s": ct.layer_forward,
        "layer_backward_compute_s": ct.layer_backward if training else 0.0,
        "layer_recompute_s": ct.layer_recompute if training else 0.0,
        "layer_attention_forward_s": ct.attention_forward,
        "layer_attention_backward_s": ct.attention_backward if training else 0.0,
        "layer_forward_exposed_comm_s": cp.layer_fwd_exposed + st.exposed_f,
        "layer_backward_exposed_comm_s": cp.layer_bwd_exposed + st.exposed_b if training else 0.0,
        "head_compute_s": ct.head_forward + ct.head_backward,
        "microbatch_s": p.sums.microbatch_s,
        **(p.pipe.breakdown() if p.pipe is not None else {}),
    }


def host_sync_source(profile: CostProfile, model: ModelSpec, train: TrainSpec, layout: Layout) -> dict[str, str]:
    """Where the MoE layers' host-sync idle comes from (or why there is none), for plans with experts split."""
    if model.moe is None or layout.ep == 1:
        return {}
    return {"moe_host_sync": moe_host_sync_note(profile.stack.time, profile.stack.name, model, train, layout)}
