"""Step time: kernels priced from their shapes, communication on the topology, and overlap.

Entry point: :func:`comm_and_time` (model, train, layout, topology, offload, profile) -> :class:`CommTime`.

Compute (per GPU): :mod:`sp_plan.cost_models.compute_time` prices every GEMM, attention call, ring step and
streaming kernel of a layer and of the output layer with the GPU's kernel model and the stack's time
properties (the ``profile``); the asymptotic fractions come from a calibration file, the topology's
``calibration.compute`` or the kernel model, in that order, so a probed, hand-tuned or calibrated file
changes predictions without code changes.

Communication: every op of :func:`sp_plan.cost_models.comm_volume.comm_ops` (each registered strategy's,
:mod:`sp_plan.cost_models.strategies`) is costed with :func:`sp_plan.cost_models.collectives.collective_cost`
on the span of its process group (:mod:`sp_plan.cost_models.placement`). The overlap rules, applied here
once to every strategy's ops by their ``overlap`` class:

- ``exposed`` (Ulysses all-to-alls, embedding/LM-head collectives, the loss reduction, and every op
  outside the layers): on the critical path, the next kernel needs their result.
- ``prefetch`` (FSDP all-gathers and, in backward, reduce-scatters) and ``grad`` (DDP buckets, ZeRO-1/2
  reduce-scatters, HSDP all-reduces): all strategies' traffic of one layer hides behind that layer's
  compute, layer i+1's behind layer i's; what exceeds it is exposed, plus one pipeline fill per pass
  (min(comm, compute)). Once-per-step reductions hide only behind the last micro-batch's backward. The
  exposed time is attributed to strategies in proportion to their traffic.
- Any other class is priced by the strategy that claims it (``Strategy.overlap_classes``): ring
  attention's hops each hide behind one ring step's compute (:mod:`sp_plan.cost_models.strategies.ring`);
  TP's layer collectives (``tp``) and MoE dispatch/combine all-to-alls (``ep``) are exposed unless the
  stack overlaps them (:mod:`sp_plan.cost_models.strategies.overlap`: chunked inside their GEMMs, or
  behind another micro-batch), reported as ``hidden_comm_s_by_strategy``.

Strategies add the terms no op covers (``Strategy.exposed``): the ring hops' exposed time, PCIe traffic
of offloading (:mod:`~sp_plan.cost_models.strategies.offload`: each pass's transfers hide behind that
pass's compute; updated weights coming back are exposed, gradient copies to the host hide behind the
last backward) and the optimizer step (:mod:`~sp_plan.cost_models.strategies.optimizer`: exposed, on
the GPU, or on the CPU at the slower of host-memory bandwidth and the stack's per-core throughput).
This module sums them: layer terms into each layer's time, micro-batch terms into each micro-batch's,
step terms once.

Overlapped collectives slow the compute they hide behind (NCCL kernels take SMs and HBM bandwidth): the
kernel model's ``nccl_compute_slowdown`` x the overlapped time, reported as ``interference_s``. They are
assumed not to contend with exposed collectives on the same links.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pydantic import BaseModel, ConfigDict

from .comm_time import _PROFILES, COMM_FIELDS, GENERIC_OVERLAP, CommProfile, comm_profile
from .comm_volume import LAYER_STRATEGIES, CommEstimate, comm_estimate, stack_traffic
from .compute_time import compute_time
from .data_balance import useful_fraction
from .errors import CostModelError
from .layout import Layout
from .model_spec import ModelSpec
from .pipeline import check_pipeline, stage_layers
from .pipeline_time import PipelineStep, pipelined_step
from .placement import Placement, place
from .profile import CostProfile, default_profile
from .strategies import registered
from .strategies.offload import OffloadTraffic, saved_activation_bytes
from .strategies.optimizer import OPTIMIZER_STATE_BYTES, optimizer_step_traffic
from .strategies.terms import ComputeTime, TimeContext
from .time_report import PricedStep, StepSums, TimeEstimate, report
from .time_terms import LayerOverlap, StrategyTerms, layer_overlap, strategy_terms
from .topology.topology import Topology
from .train_spec import TrainSpec


class CommTime(BaseModel):
    """What :func:`comm_and_time` returns: the ``comm`` and ``time`` JSON sections and the placement."""

    model_config = ConfigDict(frozen=True)

    comm: CommEstimate
    time: TimeEstimate
    placement: Placement | None = None


def comm_and_time(
    model: ModelSpec,
    train: TrainSpec,
    layout: Layout,
    topology: Topology,
    offload: OffloadTraffic | None = None,
    with_placement: bool = False,
    profile: CostProfile | None = None,
) -> CommTime:
    """Communication volume and step time of ``layout`` on ``topology``.

    ``offload``: bytes in host memory per GPU (the memory model's numbers); ``None`` estimates them
    from the TrainSpec flags (:meth:`OffloadTraffic.estimate`). ``with_placement`` adds the
    :class:`Placement` (slower; the planner asks for it only for the plan it reports).
    """
    if layout.world > topology.num_gpus:
        raise CostModelError(
            f"layout {layout.describe()} uses {layout.world} GPUs but topology {topology.name} has "
            f"{topology.num_gpus}: use a topology with at least {layout.world} GPUs (e.g. --gpus {layout.world})"
        )
    if offload is None:
        offload = OffloadTraffic.estimate(model, train, layout)
    traffic = stack_traffic((profile or default_profile(topology.gpu.name)).memory)
    comm = comm_estimate(_comm_model(model, train, layout), train, layout, traffic)
    time = _time(model, train, layout, topology, offload, profile).estimate()
    return CommTime.model_construct(comm=comm, time=time, placement=place(layout, topology) if with_placement else None)


def _comm_model(model: ModelSpec, train: TrainSpec, layout: Layout) -> ModelSpec:
    """The model one GPU's traffic is counted for: with pipeline stages, the largest stage's layers."""
    if layout.pp == 1:
        return model
    check_pipeline(model, train, layout)
    update: dict = {"num_layers": max(stage_layers(model, train, layout))}
    if model.moe is not None:  # the busiest stage's layers are all MoE (DeepSeek's dense layers lead stage 0)
        update["moe"] = model.moe.model_copy(update={"dense_layers": ()})
    return model.model_copy(update=update)


def time_estimate(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
                  offload: OffloadTraffic | None = None, profile: CostProfile | None = None) -> TimeEstimate:
    """Only the step time (no comm JSON section)."""
    if offload is None:
        offload = OffloadTraffic.estimate(model, train, layout)
    return _time(model, train, layout, topology, offload, profile).estimate()


@dataclass(frozen=True, slots=True)
class StepTime:
    """The two numbers the planner ranks by, with the full :class:`TimeEstimate` built on demand (the
    planner times thousands of combinations and reports a handful)."""

    step_s: float
    tokens_per_step: float
    _build: Callable[[], TimeEstimate]
    #: The pipeline bubble inside ``step_s`` (0 without PP).
    bubble_s: float = 0.0
    #: With PP: the slowest stage's forward, backward and weight-gradient seconds per micro-batch (what the
    #: schedules' bubbles are computed from; the planner bounds every schedule of a layout with them).
    stage_s: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def estimate(self) -> TimeEstimate:
        return self._build()


def step_time(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
              offload: OffloadTraffic, profile: CostProfile | None = None) -> StepTime:
    """:func:`time_estimate` for the planner's inner loop: the same model, the report deferred."""
    return _time(model, train, layout, topology, offload, profile)


def _time(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
          offload: OffloadTraffic, profile: CostProfile | None = None) -> StepTime:
    """The step's parts priced (compute, the collectives by overlap class, every strategy's terms, the
    prefetch/grad overlap), then summed once (:func:`_step_sums`; with pipeline stages recomposed on the
    slowest stage, :func:`_pipelined_sums`); the report is built from the same parts on demand."""
    profile = profile or default_profile(topology.gpu.name)
    whole_model, split = model, None
    if layout.pp > 1:  # --- pipeline: price one stage (its layers), compose the schedule in pipelined_step
        split = stage_layers(model, train, layout)
        model = _comm_model(model, train, layout)
    # compute (shape-aware, kernel by kernel: sp_plan.cost_models.compute_time)
    ct = compute_time(model, train, layout, topology, profile)
    # communication: the generic overlap classes, then each strategy's own terms
    cp = _comm_profile(model, train, layout, topology, profile.stack.time.moe_dispatcher != "alltoall",
                       stack_traffic(profile.memory))
    st = strategy_terms(_context(model, train, layout, topology, profile, ct, offload, cp))
    ov = layer_overlap(cp, ct.layer_forward, ct.layer_backward, model.num_layers, profile.kernels.nccl_compute_slowdown,
                       train.is_training)
    sums = _step_sums(model, train, layout, topology, profile, ct, cp, st, ov)
    pipe = None
    if split is not None:
        pipe = pipelined_step(train, layout, split, ct, cp, st, sums.layer_f, sums.layer_b, ct.head_forward,
                              ct.head_backward, profile.kernels.nccl_compute_slowdown)
        sums = _pipelined_sums(sums, pipe, split, train.grad_accum, cp, st)
    priced = PricedStep(model, whole_model, train, layout, topology, profile, ct, cp, st, ov, pipe, sums)
    if pipe is None:
        return StepTime(sums.step_s, sums.tokens_per_step, partial(report, priced))
    return StepTime(sums.step_s, sums.tokens_per_step, partial(report, priced), pipe.bubble,
                    (pipe.forward_s, pipe.backward_s, pipe.weight_grad_s))


def _step_sums(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology, profile: CostProfile,
               ct: ComputeTime, cp: CommProfile, st: StrategyTerms, ov: LayerOverlap) -> StepSums:
    """The overlap rules applied once: layer terms into each layer's time, micro-batch terms into each
    micro-batch's, step terms once; ``accum`` micro-batches per step."""
    training = train.is_training
    layers = model.num_layers
    accum = train.grad_accum
    c_fwd, c_bwd = ct.layer_forward, ct.layer_backward
    head_f, head_b = ct.head_forward, ct.head_backward
    compute_mb = layers * (c_fwd + c_bwd) + head_f + head_b
    compute_s = accum * compute_mb
    lf_exposed, lb_exposed = cp.layer_fwd_exposed, cp.layer_bwd_exposed
    model_mb, model_step = cp.model_mb, cp.model_step
    fwd_overlap, bwd_overlap_mb, bwd_overlap_last = ov.fwd, ov.bwd_mb, ov.bwd_last
    overlap_slow_mb, slow_last = ov.slow_mb, ov.slow_last

    layer_f = c_fwd + lf_exposed + st.exposed_f + st.slow_f + st.host_f
    layer_b = c_bwd + lb_exposed + st.exposed_b + st.slow_b + st.host_b if training else 0.0
    host_sync_s = accum * layers * (st.host_f + st.host_b)  # GPU idle on the host (strategies.moe_host)
    microbatch_s = (layers * (layer_f + layer_b) + fwd_overlap + bwd_overlap_mb + head_f + head_b + model_mb
                    + overlap_slow_mb + st.exposed_mb + st.slow_mb)
    interference_s = (accum * (layers * (st.slow_f + st.slow_b) + overlap_slow_mb + st.slow_mb) + slow_last
                      + st.slow_step)
    step_comm_exposed = (
        accum * (layers * (lf_exposed + lb_exposed + st.exposed_f + st.exposed_b) + model_mb + fwd_overlap
                 + st.exposed_mb)
        + (accum - 1) * bwd_overlap_mb + bwd_overlap_last + model_step + st.exposed_step
    )
    optimizer_s, offload_s = st.optimizer, st.offload

    host_s = topology.spec.calibration.compute.host_step_overhead_s  # CPU ranks' measured host work (0 on GPUs)
    overhead_s = profile.stack.time.step_overhead_s + host_s
    step_s = (accum * microbatch_s + (bwd_overlap_last - bwd_overlap_mb) + slow_last
              + model_step + optimizer_s + offload_s + overhead_s + st.exposed_step + st.slow_step)
    # Useful tokens: a packed dataset's padding (--lengths) is work that trains nothing.
    tokens_per_step = (float(train.micro_batch * train.seq_len * accum * layout.dp)
                       * useful_fraction(model, train, layout))
    return StepSums(layer_f, layer_b, microbatch_s, compute_s, interference_s, host_sync_s, step_comm_exposed,
                    step_s, tokens_per_step, overhead_s, host_s)


def _pipelined_sums(s: StepSums, pipe: PipelineStep, split: tuple[int, ...], accum: int, cp: CommProfile,
                    st: StrategyTerms) -> StepSums:
    """The step recomposed on the pipeline schedule: the slowest stage's work and bubble, the once-per-step
    ZeRO traffic PP leaves, then the step-level terms."""
    optimizer_s, offload_s, overhead_s = st.optimizer, st.offload, s.overhead_s
    step_s = pipe.work + pipe.bubble + pipe.fsdp + cp.model_step + st.exposed_step + st.slow_step + optimizer_s \
        + offload_s + overhead_s
    compute_s = accum * pipe.compute_mb
    interference_s = accum * pipe.slow_mb + st.slow_step
    host_sync_s = accum * split[pipe.stage] * (st.host_f + st.host_b)  # the slowest stage's layers
    step_comm_exposed = (step_s - compute_s - pipe.bubble - optimizer_s - offload_s - overhead_s - interference_s
                         - host_sync_s)
    return s._replace(compute_s=compute_s, interference_s=interference_s, host_sync_s=host_sync_s,
                      step_comm_exposed=step_comm_exposed, step_s=step_s)


def attention_forward_seconds(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
                              profile: CostProfile | None = None) -> float:
    """One attention layer's forward on its own (an attention benchmark: no projections or MLP): the
    attention kernels plus the forward traffic of the strategies that belong to the attention op
    (``Strategy.attention_traffic``): Ulysses' all-to-alls of Q, K, V and the output (exposed) and the
    ring's K/V hops (each hidden behind a step's compute, NCCL slowing it). ``train.mode`` must be
    ``prefill`` (forward only)."""
    if train.is_training:
        raise CostModelError("attention_forward_seconds times a forward pass: use mode='prefill'")
    profile = profile or default_profile(topology.gpu.name)
    ct = compute_time(model, train, layout, topology, profile)
    cp = _comm_profile(model, train, layout, topology, profile.stack.time.moe_dispatcher != "alltoall",
                       stack_traffic(profile.memory))
    ctx = _context(model, train, layout, topology, profile, ct, OffloadTraffic(), cp)
    seconds = ct.attention_forward
    for strategy in registered():
        if not strategy.attention_traffic:
            continue
        for bucket in strategy.layer_buckets:
            seconds += cp.exposed_layer[bucket]
        for term in strategy.exposed(ctx):
            if term.at == "layer_forward" and term.kind in ("exposed_comm", "interference"):
                seconds += term.seconds
    return seconds


#: The communication pricing under its former name here (step_floor and tests reach it as ``_comm_profile``).
_comm_profile = comm_profile


def _context(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology, profile: CostProfile,
             ct: ComputeTime, offload: OffloadTraffic, cp: CommProfile) -> TimeContext:
    return TimeContext(model=model, train=train, layout=layout, topology=topology, stack=profile.stack.time,
                       kernels=profile.kernels, compute=ct, offload=offload, priced=cp.priced)


__all__ = [
    "COMM_FIELDS",
    "OPTIMIZER_STATE_BYTES",
    "saved_activation_bytes",
    "CommTime",
    "OffloadTraffic",
    "attention_forward_seconds",
    "TimeEstimate",
    "comm_and_time",
    "optimizer_step_traffic",
    "time_estimate",
    "step_time",
    "StepTime",
    "LAYER_STRATEGIES",
    "GENERIC_OVERLAP",
    "_PROFILES",
]
