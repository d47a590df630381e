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
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from .collectives import collective_cost, node_dedup_fabric_fraction
from .comm_volume import LAYER_STRATEGIES, CommEstimate, comm_estimate, comm_ops, stack_traffic
from .compute_time import compute_time, efficiency_sources
from .data_balance import useful_fraction
from .errors import CostModelError
from .flops import microbatch_work
from .layout import Layout
from .memo import Memo
from .model_spec import ModelSpec
from .pipeline import bubble_seconds, check_pipeline, stage_layers
from .placement import Placement, group_spans, place
from .profile import CostProfile, default_profile
from .strategies import implementing, on_change, registered, report_buckets
from .strategies.moe_host import moe_host_sync_note
from .strategies.offload import OffloadTraffic, saved_activation_bytes
from .strategies.optimizer import OPTIMIZER_STATE_BYTES, optimizer_step_traffic
from .strategies.overlap import overlap_sources
from .strategies.terms import ComputeTime, PricedOp, TimeContext, issued
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
    profile = profile or default_profile(topology.gpu.name)
    training = train.is_training
    whole_model, split = model, None
    if layout.pp > 1:  # --- pipeline: price one stage (its layers), compose the schedule in _pipelined_step
        split = stage_layers(model, train, layout)
        model = _comm_model(model, train, layout)
    layers = model.num_layers
    accum = train.grad_accum
    eff = topology.efficiency
    peak = topology.peak_flops(train.dtype)

    # ----- compute (shape-aware, kernel by kernel: sp_plan.cost_models.compute_time) ------------------------
    w = microbatch_work(model, train, layout)
    ct = compute_time(model, train, layout, topology, profile)
    slow = profile.kernels.nccl_compute_slowdown
    c_fwd, c_bwd, c_re = ct.layer_forward, ct.layer_backward, ct.layer_recompute
    attn_f, attn_b = ct.attention_forward, ct.attention_backward
    head_f, head_b = ct.head_forward, ct.head_backward
    compute_mb = layers * (c_fwd + c_bwd) + head_f + head_b
    compute_s = accum * compute_mb

    # ----- communication: the generic overlap classes, then each strategy's own terms ---------------------
    cp = _comm_profile(model, train, layout, topology, profile.stack.time.moe_dispatcher != "alltoall",
                       stack_traffic(profile.memory))
    lf_exposed, lb_exposed = cp.layer_fwd_exposed, cp.layer_bwd_exposed
    model_mb, model_step = cp.model_mb, cp.model_step
    st = _strategy_terms(_context(model, train, layout, topology, profile, ct, offload, cp))

    ov = _layer_overlap(cp, c_fwd, c_bwd, layers, slow, training)
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
    tokens_per_step = float(train.micro_batch * train.seq_len * accum * layout.dp) * useful_fraction(model, train, layout)
    pipe = None
    if split is not None:
        pipe = _pipelined_step(train, layout, split, ct, cp, st, layer_f, layer_b, head_f, head_b, slow)
        step_s = pipe.work + pipe.bubble + pipe.fsdp + model_step + st.exposed_step + st.slow_step + optimizer_s \
            + offload_s + overhead_s
        compute_s = accum * pipe.compute_mb
        interference_s = accum * pipe.slow_mb + st.slow_step
        host_sync_s = accum * split[pipe.stage] * (st.host_f + st.host_b)  # the slowest stage's layers
        step_comm_exposed = (step_s - compute_s - pipe.bubble - optimizer_s - offload_s - overhead_s - interference_s
                             - host_sync_s)
        w = microbatch_work(whole_model, train, layout)

    def build() -> TimeEstimate:
        buckets = report_buckets()
        comm_by = {k: accum * cp.comm_mb[k] + cp.comm_step[k] for k in buckets}
        exposed = {k: layers * accum * cp.exposed_layer[k] + accum * cp.model_mb_by[k] + cp.model_step_by[k]
                   for k in buckets}
        for k, v in st.layer_by.items():
            exposed[k] += v * layers * accum
        for k, v in st.microbatch_by.items():
            exposed[k] += v * accum
        for k, v in st.step_by.items():
            exposed[k] += v
        _split(exposed, fwd_overlap * accum, cp.prefetch_f_by)
        _split(exposed, bwd_overlap_mb * (accum - 1) + bwd_overlap_last, cp.overlapped_b_by)
        if pipe is not None:  # the pipelined step's exposed time, attributed in the same proportions
            total = sum(exposed.values())
            for k in exposed:
                exposed[k] = exposed[k] * step_comm_exposed / total if total > 0 else 0.0
            if total <= 0:
                exposed["pipeline"] = step_comm_exposed
        # Every rank runs its share of one replica's work: pp stages share the model's FLOPs.
        model_flops = w.model_flops * layout.world * accum / layout.pp
        denominator = step_s * layout.world * peak
        executed = w.executed_flops(whole_model.num_layers) * layout.world * accum / layout.pp
        return TimeEstimate.model_construct(  # computed values; skip re-validation
            compute_s=compute_s,
            comm_s=sum(comm_by.values()),
            exposed_comm_s=step_comm_exposed,
            optimizer_s=optimizer_s,
            offload_s=offload_s,
            interference_s=interference_s,
            overhead_s=overhead_s,
            pipeline_bubble_s=pipe.bubble if pipe is not None else 0.0,
            step_s=step_s,
            tokens_per_step=tokens_per_step,
            tokens_per_s=tokens_per_step / step_s,
            mfu=model_flops / denominator,
            hfu=executed / denominator,
            model_flops_per_step=model_flops,
            peak_flops=peak,
            comm_s_by_strategy=comm_by,
            exposed_comm_s_by_strategy=exposed,
            hidden_comm_s_by_strategy={k: v * layers * accum for k, v in st.hidden_layer_by.items()},
            fabric_bytes_per_step=accum * cp.fabric_mb + cp.fabric_step,
            breakdown={
                "layer_forward_compute_s": c_fwd,
                "layer_backward_compute_s": c_bwd if training else 0.0,
                "layer_recompute_s": c_re if training else 0.0,
                "layer_attention_forward_s": attn_f,
                "layer_attention_backward_s": attn_b if training else 0.0,
                "layer_forward_exposed_comm_s": lf_exposed + st.exposed_f,
                "layer_backward_exposed_comm_s": lb_exposed + st.exposed_b if training else 0.0,
                "head_compute_s": head_f + head_b,
                "microbatch_s": microbatch_s,
                **(pipe.breakdown() if pipe is not None else {}),
            },
            efficiencies={**ct.fractions, "pcie": eff.pcie, "host_memory": eff.host_memory,
                          "compute_overhead_fraction": profile.stack.time.compute_overhead_fraction},
            components=_components(ct, accum, exposed, interference_s, offload_s, optimizer_s, overhead_s, host_s,
                                   pipe, host_sync_s),
            efficiency_sources={**efficiency_sources(topology, profile),
                                **overlap_sources(profile.stack, model, train, layout),
                                **_host_sync_source(profile, model, train, layout)},
        )

    if pipe is None:
        return StepTime(step_s, tokens_per_step, build)
    return StepTime(step_s, tokens_per_step, build, pipe.bubble, (pipe.forward_s, pipe.backward_s, pipe.weight_grad_s))


def _host_sync_source(profile: CostProfile, model: ModelSpec, train: TrainSpec, layout: Layout) -> dict[str, str]:
    """Where the MoE layers' host-sync idle comes from (or why there is none), for plans with experts split."""
    if model.moe is None or layout.ep == 1:
        return {}
    return {"moe_host_sync": moe_host_sync_note(profile.stack.time, profile.stack.name, model, train, layout)}


def _components(ct: ComputeTime, accum: int, exposed: dict[str, float], interference_s: float, offload_s: float,
                optimizer_s: float, overhead_s: float, host_s: float, pipe: "_PipelineStep | None",
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
            **_host_sync_part(host_sync_s),
        }
    parts = {name: accum * seconds * pipe.compute_mb / max(pipe.compute_mb_parts, 1e-300)
             for name, seconds in ct.parts.items()}
    return {**parts, **{f"exposed_comm_{k}": v for k, v in exposed.items()}, "pipeline_bubble": pipe.bubble,
            "interference": interference_s, "offload": offload_s, "optimizer": optimizer_s,
            "step_overhead": overhead_s - host_s, "host_overhead": host_s, **_host_sync_part(host_sync_s)}


def _host_sync_part(host_sync_s: float) -> dict[str, float]:
    """The ``moe_host_sync`` component, listed only where a plan has it (MoE layers waiting on the host)."""
    return {"moe_host_sync": host_sync_s} if host_sync_s > 0 else {}


class _PipelineStep(NamedTuple):
    """The schedule applied to the slowest stage (:mod:`sp_plan.cost_models.pipeline`): ``work`` is every
    micro-batch's forward and backward on it, ``bubble`` its idle fill and drain, ``fsdp`` the ZeRO traffic
    that PP leaves once per step (gathered in the first forward, reduced after the last backward),
    ``compute_mb`` its pure compute per micro-batch (``compute_mb_parts``: what the compute parts sum to
    per micro-batch for the priced stage), ``slow_mb`` its interference per micro-batch."""

    work: float
    bubble: float
    fsdp: float
    compute_mb: float
    compute_mb_parts: float
    slow_mb: float
    stage: int
    forward_s: float
    backward_s: float
    weight_grad_s: float

    def breakdown(self) -> dict[str, float]:
        return {"pipeline_bubble_s": self.bubble, "pipeline_stage_forward_s": self.forward_s,
                "pipeline_stage_backward_s": self.backward_s, "pipeline_stage_weight_grad_s": self.weight_grad_s,
                "pipeline_slowest_stage": float(self.stage), "pipeline_fsdp_once_s": self.fsdp}


def _pipelined_step(train: TrainSpec, layout: Layout, split: tuple[int, ...], ct: ComputeTime, cp: _CommProfile,
                    st: _StrategyTerms, layer_f: float, layer_b: float, head_f: float, head_b: float,
                    slow: float) -> _PipelineStep:
    """Stage times from one layer's priced forward and backward (exposed per-layer communication included),
    the LM head and the whole-model ops on the last stage, the point-to-point transfers on every stage; the
    slowest stage sets the pace. ZB-H1's weight-gradient part ``W``: half of a layer's backward GEMM time
    (dX and dW are the same size), none of attention's (no weights)."""
    p, m, v = layout.pp, train.grad_accum, train.virtual_stages
    p2p = cp.model_mb_by.get("pipeline", 0.0)
    last_only = cp.model_mb - p2p
    per_mb = st.exposed_mb + st.slow_mb + p2p
    w_layer = max(0.0, ct.layer_backward - ct.layer_recompute - ct.attention_backward) / 2
    best: tuple[float, int, float, float, float, float] | None = None
    for s, n in enumerate(split):
        last = s == p - 1
        t_f = n * layer_f + per_mb / 2 + (head_f + last_only if last else 0.0)
        t_b = n * layer_b + per_mb / 2 + (head_b if last else 0.0)
        t_w = n * w_layer + (head_b / 2 if last else 0.0)
        compute = n * (ct.layer_forward + ct.layer_backward) + (head_f + head_b if last else 0.0)
        if best is None or t_f + t_b > best[0] + best[1]:
            best = (t_f, t_b, t_w, compute, float(s), float(n))
    assert best is not None
    t_f, t_b, t_w, compute, s_slow, n_slow = best
    bubble = bubble_seconds(train.pipeline_schedule, p, v, t_f, t_b - t_w, t_w)
    n = int(n_slow)

    def hidden(comm: float, compute_s: float) -> float:
        return n * max(0.0, comm - compute_s) + min(comm, compute_s) if comm > 0 else 0.0

    # Under PP the layer gathers and reductions are once per step (strategies.fsdp): the forward gathers hide
    # behind the first micro-batch's forward, the reductions behind the last one's backward.
    fsdp = hidden(cp.prefetch_f, ct.layer_forward) + hidden(cp.prefetch_b + cp.grad_mb + cp.grad_step,
                                                           ct.layer_backward)
    parts_mb = sum(ct.parts.values())
    return _PipelineStep(work=m * (t_f + t_b), bubble=bubble, fsdp=fsdp, compute_mb=compute,
                         compute_mb_parts=parts_mb, slow_mb=n * (st.slow_f + st.slow_b) + st.slow_mb,
                         stage=int(s_slow), forward_s=t_f, backward_s=t_b, weight_grad_s=t_w)


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


class _LayerOverlap(NamedTuple):
    """What the prefetch/gradient traffic costs: exposed seconds in one micro-batch's forward (``fwd``),
    its backward (``bwd_mb``) and the last micro-batch's backward, once-per-step reductions included
    (``bwd_last``); the interference it causes per micro-batch (``slow_mb``) and the last micro-batch's
    extra (``slow_last``)."""

    fwd: float
    bwd_mb: float
    bwd_last: float
    slow_mb: float
    slow_last: float


def _layer_overlap(cp: _CommProfile, c_fwd: float, c_bwd: float, layers: int, slow: float,
                   training: bool) -> _LayerOverlap:
    """The overlap rule of the ``prefetch`` and ``grad`` classes, applied to every strategy's traffic at
    once: one layer's traffic hides behind one layer's compute (layer i+1's behind layer i's), what
    exceeds it is exposed, plus one pipeline fill per pass. Overlapped traffic also slows the compute it
    hides behind (NCCL kernels take SMs and HBM bandwidth): ``slow`` x the overlapped time, accounted as
    interference, not as exposed communication."""
    prefetch_f, prefetch_b, grad_mb, grad_step = cp.prefetch_f, cp.prefetch_b, cp.grad_mb, cp.grad_step

    def hidden(comm: float, compute: float) -> float:
        return layers * max(0.0, comm - compute) + min(comm, compute) if comm > 0 else 0.0

    def interference(comm: float, compute: float) -> float:
        return layers * slow * min(comm, compute)

    fwd = hidden(prefetch_f, c_fwd)
    if not training:
        return _LayerOverlap(fwd, 0.0, 0.0, interference(prefetch_f, c_fwd), 0.0)
    slow_mb = interference(prefetch_f, c_fwd) + interference(prefetch_b + grad_mb, c_bwd)
    slow_last = interference(prefetch_b + grad_mb + grad_step, c_bwd) - interference(prefetch_b + grad_mb, c_bwd)
    return _LayerOverlap(fwd, hidden(prefetch_b + grad_mb, c_bwd), hidden(prefetch_b + grad_mb + grad_step, c_bwd),
                         slow_mb, slow_last)


def _context(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology, profile: CostProfile,
             ct: ComputeTime, offload: OffloadTraffic, cp: _CommProfile) -> TimeContext:
    return TimeContext(model=model, train=train, layout=layout, topology=topology, stack=profile.stack.time,
                       kernels=profile.kernels, compute=ct, offload=offload, priced=cp.priced)


class _StrategyTerms(NamedTuple):
    """The registered strategies' :class:`Term` s summed by kind and by where they occur: exposed
    communication and interference per layer (forward, backward), per micro-batch and per step; offload
    and optimizer seconds per step; exposed communication by report bucket (layer terms per layer and
    micro-batch, micro-batch terms per micro-batch, step terms per step); GPU idle on host synchronisation
    per layer (forward, backward)."""

    exposed_f: float
    exposed_b: float
    slow_f: float
    slow_b: float
    exposed_mb: float
    slow_mb: float
    exposed_step: float
    slow_step: float
    offload: float
    optimizer: float
    layer_by: dict[str, float]
    microbatch_by: dict[str, float]
    step_by: dict[str, float]
    hidden_layer_by: dict[str, float]
    host_f: float = 0.0
    host_b: float = 0.0


def _strategy_terms(ctx: TimeContext) -> _StrategyTerms:
    """Sum every strategy's terms (local accumulators: this runs once per combination the planner times)."""
    exposed_f = exposed_b = slow_f = slow_b = exposed_mb = slow_mb = exposed_step = slow_step = 0.0
    offload = optimizer = host_f = host_b = 0.0
    layer_by: dict[str, float] = {}
    microbatch_by: dict[str, float] = {}
    step_by: dict[str, float] = {}
    hidden_layer_by: dict[str, float] = {}
    buckets = report_buckets()
    for strategy in implementing("exposed"):
        for kind, t, at, bucket in strategy.exposed(ctx):
            if kind == "exposed_comm":
                if bucket not in buckets:
                    raise CostModelError(f"strategy {strategy.name!r} reports exposed time under unknown bucket "
                                         f"{bucket!r}; declare it in layer_buckets or model_buckets")
                if at == "layer_forward":
                    exposed_f += t
                    layer_by[bucket] = layer_by.get(bucket, 0.0) + t
                elif at == "layer_backward":
                    exposed_b += t
                    layer_by[bucket] = layer_by.get(bucket, 0.0) + t
                elif at == "microbatch":
                    exposed_mb += t
                    microbatch_by[bucket] = microbatch_by.get(bucket, 0.0) + t
                else:
                    exposed_step += t
                    step_by[bucket] = step_by.get(bucket, 0.0) + t
            elif kind == "hidden_comm":
                if at not in ("layer_forward", "layer_backward"):
                    raise CostModelError(f"strategy {strategy.name!r}: hidden communication is reported per layer")
                hidden_layer_by[bucket] = hidden_layer_by.get(bucket, 0.0) + t
            elif kind == "interference":
                if at == "layer_forward":
                    slow_f += t
                elif at == "layer_backward":
                    slow_b += t
                elif at == "microbatch":
                    slow_mb += t
                else:
                    slow_step += t
            elif kind == "host_sync":
                if at == "layer_forward":
                    host_f += t
                elif at == "layer_backward":
                    host_b += t
                else:
                    raise CostModelError(f"strategy {strategy.name!r}: host synchronisation is reported per layer")
            elif kind in ("offload", "optimizer"):
                if at != "step":
                    raise CostModelError(f"strategy {strategy.name!r}: an {kind} term is counted once per step, "
                                         f"not per {at}")
                if kind == "offload":
                    offload += t
                else:
                    optimizer += t
            else:
                raise CostModelError(f"strategy {strategy.name!r} returned a term of unknown kind {kind!r}")
    return _StrategyTerms(exposed_f, exposed_b, slow_f, slow_b, exposed_mb, slow_mb, exposed_step, slow_step,
                          offload, optimizer, layer_by, microbatch_by, step_by, hidden_layer_by, host_f, host_b)


#: TrainSpec fields the collectives of a step depend on: comm_volume.comm_ops reads only these (a test
#: checks that changing any other field leaves the op list unchanged).
COMM_FIELDS = ("seq_len", "micro_batch", "dtype", "mode", "optimizer", "zero_stage", "checkpointing",
               "tp_sequence_parallel", "virtual_stages")

#: Overlap classes priced here; any other belongs to the strategy that claims it.
GENERIC_OVERLAP = ("exposed", "prefetch", "grad")


@dataclass(frozen=True, slots=True)
class _CommProfile:
    """A step's collectives priced on the topology and sorted by how they may overlap: seconds of one
    micro-batch (``_mb``) or once per step (``_step``), per layer where named. Shared by every option
    combination that moves the same bytes, so :func:`_time` only does the arithmetic that depends on
    compute time and gradient accumulation."""

    comm_mb: dict[str, float]  # bucket -> all occurrences in one micro-batch
    comm_step: dict[str, float]  # bucket -> once-per-step ops
    fabric_mb: float
    fabric_step: float
    exposed_layer: dict[str, float]  # non-overlapping per-layer ops, one layer and micro-batch
    layer_fwd_exposed: float
    layer_bwd_exposed: float
    model_mb: float  # whole-model ops per micro-batch (exposed)
    model_mb_by: dict[str, float]
    model_step: float  # whole-model ops once per step (exposed)
    model_step_by: dict[str, float]
    prefetch_f: float  # per layer
    prefetch_b: float
    grad_mb: float  # per layer, per micro-batch
    grad_step: float  # per layer, once per step
    prefetch_f_by: dict[str, float]
    overlapped_b_by: dict[str, float]  # backward prefetch and gradient traffic, by bucket
    priced: dict[str, object]  # ops of strategy-priced overlap classes, by class, as the strategy condensed them


_PROFILES: Memo[_CommProfile] = Memo()
on_change(_PROFILES.clear)


def _comm_profile(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
                  node_dedup: bool = False, traffic: frozenset[str] = frozenset()) -> _CommProfile:
    # The topology is keyed by identity (it is mutable and unhashable by value), which also keeps it
    # alive as long as its entries.
    key = (model, layout, topology, node_dedup, traffic, *(getattr(train, f) for f in COMM_FIELDS))
    return _PROFILES.get(key, lambda: _price_comm(model, train, layout, topology, node_dedup, traffic))


def _price_comm(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
                node_dedup: bool = False, traffic: frozenset[str] = frozenset()) -> _CommProfile:
    """Every collective of a step priced on ``topology`` and classified (see :class:`_CommProfile`);
    ``node_dedup``: the stack's MoE dispatcher sends a token once per remote node (DeepEP, Hybrid-EP), so
    the dispatch ops that name their fan-out (``CommOp.node_dedup``) cross nodes with fewer bytes;
    ``traffic``: the stack's traffic facts (``comm_volume.stack_traffic``), which keep the ops only some stacks
    issue (``CommOp.only_if``)."""
    spans = group_spans(layout, topology)
    layers = model.num_layers
    owners = {c: s for s in registered() for c in s.overlap_classes}
    memo: dict[tuple[str, float, str, tuple[int, int]], object] = {}
    zero = dict.fromkeys(report_buckets(), 0.0)
    comm_mb, comm_step, exposed_layer = dict(zero), dict(zero), dict(zero)
    model_mb_by, model_step_by = dict(zero), dict(zero)
    fabric_mb = fabric_step = 0.0
    lf = lb = model_mb = model_step = 0.0
    prefetch_f = prefetch_b = grad_mb = grad_step = 0.0
    prefetch_f_by: dict[str, float] = {}
    prefetch_b_by: dict[str, float] = {}
    grad_mb_by: dict[str, float] = {}
    grad_step_by: dict[str, float] = {}
    priced: dict[str, list[PricedOp]] = {}
    for op in comm_ops(model, train, layout):
        if not issued(op, traffic):
            continue
        key = (op.collective, op.nbytes, op.group, op.node_dedup)
        cost = memo.get(key)
        if cost is None:
            span = spans[op.group]
            share = node_dedup_fabric_fraction(*op.node_dedup, span.nodes) if node_dedup and op.node_dedup[0] else 1.0
            cost = memo[key] = collective_cost(op.collective, op.nbytes, span, share)
        t = cost.time_s
        times = op.count * (layers if op.scope == "layer" else 1)
        if op.per == "microbatch":
            comm_mb[op.strategy] += t * times
            fabric_mb += cost.fabric_bytes * times
        else:
            comm_step[op.strategy] += t * times
            fabric_step += cost.fabric_bytes * times
        if op.scope == "model":
            if op.per == "microbatch":
                model_mb += t * op.count
                model_mb_by[op.strategy] += t * op.count
            else:
                model_step += t * op.count
                model_step_by[op.strategy] += t * op.count
        elif op.overlap == "exposed":
            if op.phase == "forward":
                lf += t * op.count
            else:
                lb += t * op.count
            exposed_layer[op.strategy] += t * op.count
        elif op.overlap == "prefetch":
            if op.phase == "forward":
                prefetch_f += t
                prefetch_f_by[op.strategy] = prefetch_f_by.get(op.strategy, 0.0) + t
            else:
                prefetch_b += t
                prefetch_b_by[op.strategy] = prefetch_b_by.get(op.strategy, 0.0) + t
        elif op.overlap == "grad":
            table = grad_mb_by if op.per == "microbatch" else grad_step_by
            table[op.strategy] = table.get(op.strategy, 0.0) + t
            if op.per == "microbatch":
                grad_mb += t
            else:
                grad_step += t
        elif op.overlap in owners:
            priced.setdefault(op.overlap, []).append(PricedOp(op, t, cost.fabric_bytes))
        else:
            raise CostModelError(f"no registered strategy prices overlap class {op.overlap!r} ({op.strategy} "
                                 f"{op.label or op.collective})")
    return _CommProfile(
        comm_mb=comm_mb, comm_step=comm_step, fabric_mb=fabric_mb, fabric_step=fabric_step,
        exposed_layer=exposed_layer, layer_fwd_exposed=lf, layer_bwd_exposed=lb,
        model_mb=model_mb, model_mb_by=model_mb_by, model_step=model_step, model_step_by=model_step_by,
        prefetch_f=prefetch_f, prefetch_b=prefetch_b, grad_mb=grad_mb, grad_step=grad_step,
        prefetch_f_by=prefetch_f_by, overlapped_b_by=_merge(prefetch_b_by, grad_mb_by, grad_step_by),
        priced={k: owners[k].condense(k, tuple(v)) for k, v in priced.items()},
    )


def _merge(*tables: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for table in tables:
        for k, v in table.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _split(exposed: dict[str, float], seconds: float, weights: dict[str, float]) -> None:
    """Attribute exposed overlapped time to strategies in proportion to their traffic time."""
    total = sum(weights.values())
    if seconds <= 0 or total <= 0:
        return
    for strategy, t in weights.items():
        exposed[strategy] += seconds * t / total


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
]
