"""Step time: kernels priced from their shapes, communication on the topology, and overlap.

Entry point: :func:`comm_and_time` (model, train, layout, topology, offload, profile) -> :class:`CommTime`.

Compute (per GPU): :mod:`sp_plan.cost_models.compute_time` prices every GEMM, attention call, ring step and
streaming kernel of a layer and of the output layer with the GPU's kernel model and the stack's time
properties (the ``profile``); the asymptotic fractions come from a calibration file, the topology's
``calibration.compute`` or the kernel model, in that order, so a probed, hand-tuned or calibrated file
changes predictions without code changes.

Communication: every op of :func:`sp_plan.cost_models.comm_volume.comm_ops` is costed with
:func:`sp_plan.cost_models.collectives.collective_cost` on the span of its process group
(:mod:`sp_plan.cost_models.placement`). Overlap rules:

- Ulysses all-to-alls, TP collectives, embedding/LM-head collectives and the loss reduction are
  exposed: the next kernel needs their result.
- Ring attention: hop i+1's K/V transfer runs while block i is computed, so each of the R-1 hops costs
  max(0, transfer - one ring step's kernel and merge). Backward hops carry K/V and the fp32 dK/dV; the
  last dK/dV hop home has nothing to hide behind.
- FSDP all-gathers (and, in backward, reduce-scatters) are prefetched: layer i+1's traffic hides behind
  layer i's compute; what exceeds it is exposed, plus one pipeline fill per pass (min(comm, compute)).
- Gradient reductions (DDP buckets, ZeRO-1/2 reduce-scatters, HSDP all-reduces) hide behind backward
  compute the same way; once-per-step reductions only behind the last micro-batch's backward.
- Once-per-step parameter all-gathers (ZeRO-1/2) and the optimizer step are exposed.
- Offload (inputs in :class:`OffloadTraffic`, normally the memory model's figures): parameter shards
  come in over PCIe ahead of use and checkpointed activations go out and come back asynchronously, so
  each pass's PCIe time hides behind that pass's compute; the CPU optimizer step (the slower of
  host-memory bandwidth and the stack's per-core optimizer throughput) and the copy of updated
  parameters back to the GPU are exposed, gradient copies to the host hide behind the last backward.

Overlapped collectives slow the compute they hide behind (NCCL kernels take SMs and HBM bandwidth): the
kernel model's ``nccl_compute_slowdown`` x the overlapped time, reported as ``interference_s``. They are
assumed not to contend with exposed collectives on the same links.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from .collectives import collective_cost
from .compute_time import compute_time, efficiency_sources
from .comm_volume import (
    LAYER_STRATEGIES,
    STEP_STRATEGIES,
    CommEstimate,
    comm_estimate,
    comm_ops,
    tp_local_layer_params,
    tp_local_other_params,
)
from .errors import CostModelError
from .flops import microbatch_work
from .layout import Layout
from .memo import Memo
from .memory.states import host_optimizer_bytes_per_param
from .model_spec import ModelSpec
from .placement import Placement, group_spans, place
from .profile import CostProfile, default_profile
from .topology.topology import Topology
from .train_spec import TrainSpec

#: Optimizer state bytes per parameter (brief convention): fp32 master + m + v, or bf16 m + v.
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 12, "adamw_bf16": 4}


def optimizer_step_traffic(optimizer: str, dtype_bytes: int) -> int:
    """Bytes an AdamW step reads and writes per parameter (it is memory-bound).

    ``adamw``: read and write master, m, v (2 x 12), read the gradient, write the low-precision
    weight. ``adamw_bf16``: read and write weight, m and v, read the gradient.
    """
    state = OPTIMIZER_STATE_BYTES[optimizer]
    if optimizer == "adamw":
        return 2 * state + 2 * dtype_bytes
    return 2 * state + 3 * dtype_bytes


class OffloadTraffic(BaseModel):
    """What lives in host memory, per GPU, in bytes (feed the memory model's figures).

    ``optimizer_bytes``: optimizer states on the host; the optimizer step then runs on the CPU and
    gradients go down / updated weights come back over PCIe once per step. ``param_bytes``: the
    parameter shard kept on the host (ZeRO-3 offload), copied to the GPU for forward and again for
    backward each micro-batch, gradients copied back. ``checkpoint_bytes``: checkpointed activations
    moved to the host during forward and fetched back during backward, per micro-batch.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    optimizer_bytes: float = Field(default=0.0, ge=0)
    param_bytes: float = Field(default=0.0, ge=0)
    checkpoint_bytes: float = Field(default=0.0, ge=0)

    @classmethod
    def estimate(cls, model: ModelSpec, train: TrainSpec, layout: Layout) -> "OffloadTraffic":
        """A first-order estimate from the train flags, for when the memory model's numbers are not
        at hand: TP-local parameters sharded over the ZeRO group, and per layer the checkpointed block
        input (plus, for selective, the attention output and its fp32 LSE)."""
        if not train.is_training:
            return cls()
        d = train.dtype_bytes
        params = tp_local_layer_params(model, layout.tp) * model.num_layers + tp_local_other_params(model, layout.tp)
        shard = layout.shard_group if train.zero_stage >= 1 else 1
        on_host = train.offload_optimizer or train.offload_params  # FSDP2's parameter offload moves the step too
        optimizer = params / shard * host_optimizer_bytes_per_param(train) if on_host else 0.0
        param = params / layout.shard_group * d if train.offload_params else 0.0
        checkpoint = 0.0
        if train.offload_checkpoints and train.checkpointing != "none":
            tokens = train.micro_batch * train.seq_len / layout.sp
            per_layer = tokens * model.hidden_size * d
            if layout.tp > 1 and train.tp_sequence_parallel:
                per_layer /= layout.tp
            if train.checkpointing == "selective":
                per_layer += tokens * model.num_heads / layout.tp * (model.head_dim * d + 4)
            checkpoint = per_layer * model.num_layers
        return cls(optimizer_bytes=optimizer, param_bytes=param, checkpoint_bytes=checkpoint)


def saved_activation_bytes(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """Bytes per GPU and micro-batch that autograd saves for backward in all layers without checkpointing,
    with a flash attention kernel: per token and layer the two norm inputs and outputs (4h), q/k/v and the
    attention output (2q + 2kv, the LSE aside) and the MLP's gate, activation, up and product (4f for
    SwiGLU, 2f for GELU), TP-local widths; Korthikanti et al. 2022 count 34h bytes for a GPT layer on the
    same basis. What a save_on_cpu-style offload moves to the host and back (the memory model owns the
    device-side accounting)."""
    tp = layout.tp
    tokens = train.micro_batch * train.seq_len / (layout.ulysses * layout.ring)
    q = model.q_size / tp
    kv = model.num_kv_heads * model.kv_replication(tp) / tp * model.head_dim
    f = model.ffn_hidden_size / tp * (4 if model.activation == "swiglu" else 2)
    h = model.hidden_size / (tp if (tp > 1 and train.tp_sequence_parallel) else 1)
    return model.num_layers * tokens * (4 * h + 2 * q + 2 * kv + f) * train.dtype_bytes


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
    step_s: float = Field(description="compute + exposed comm + optimizer + offload + interference + overhead")
    tokens_per_step: float
    tokens_per_s: float
    mfu: float = Field(description="model FLOPs (no recompute) / (step time x GPUs x peak)")
    hfu: float = Field(description="executed FLOPs (recompute, flash backward) / (step time x GPUs x peak)")
    model_flops_per_step: float
    peak_flops: float = Field(description="per GPU, dense, for the training dtype")
    comm_s_by_strategy: dict[str, float]
    exposed_comm_s_by_strategy: dict[str, float]
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
    comm = comm_estimate(model, train, layout)
    time = _time(model, train, layout, topology, offload, profile).estimate()
    return CommTime.model_construct(comm=comm, time=time, placement=place(layout, topology) if with_placement else None)


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
    layers = model.num_layers
    accum = train.grad_accum
    eff = topology.efficiency
    peak = topology.peak_flops(train.dtype)

    # ----- compute (shape-aware, kernel by kernel: sp_plan.cost_models.compute_time) ------------------------
    w = microbatch_work(model, train, layout)
    ct = compute_time(model, train, layout, topology, profile)
    hbm = topology.gpu.memory_bandwidth * ct.fractions["memory"]
    slow = profile.kernels.nccl_compute_slowdown
    c_fwd, c_bwd, c_re = ct.layer_forward, ct.layer_backward, ct.layer_recompute
    attn_f, attn_b = ct.attention_forward, ct.attention_backward
    head_f, head_b = ct.head_forward, ct.head_backward
    compute_mb = layers * (c_fwd + c_bwd) + head_f + head_b
    compute_s = accum * compute_mb

    # ----- communication ----------------------------------------------------------------------------
    cp = _comm_profile(model, train, layout, topology)
    lf_exposed, lb_exposed = cp.layer_fwd_exposed, cp.layer_bwd_exposed
    prefetch_f, prefetch_b, grad_mb, grad_step = cp.prefetch_f, cp.prefetch_b, cp.grad_mb, cp.grad_step
    ring_f, ring_b_kv, ring_b_dkv, ring_re = cp.ring_f, cp.ring_b_kv, cp.ring_b_dkv, cp.ring_re
    model_mb, model_step = cp.model_mb, cp.model_step

    # Ring attention: each hop hides behind one ring step's compute. Overlapped traffic also slows the
    # compute it hides behind (NCCL kernels take SMs and HBM bandwidth): ``slow`` x the overlapped time,
    # accounted as interference, not as exposed communication.
    r = layout.ring
    ring_exposed_f = ring_exposed_b = ring_slow_f = ring_slow_b = 0.0
    if r > 1:
        step_f, step_b = ct.ring_step_forward, ct.ring_step_backward
        ring_exposed_f = (r - 1) * max(0.0, ring_f - step_f)
        ring_slow_f = (r - 1) * slow * min(ring_f, step_f)
        if training:
            hop_b = ring_b_kv + ring_b_dkv
            ring_exposed_b = (r - 1) * max(0.0, hop_b - step_b) + ring_b_dkv
            ring_slow_b = (r - 1) * slow * min(hop_b, step_b)
            if ring_re:
                ring_exposed_b += (r - 1) * max(0.0, ring_re - step_f)
                ring_slow_b += (r - 1) * slow * min(ring_re, step_f)

    # Prefetched and gradient traffic: hidden behind layer compute, plus one pipeline fill per pass.
    def hidden(comm: float, compute: float) -> float:
        return layers * max(0.0, comm - compute) + min(comm, compute) if comm > 0 else 0.0

    def interference(comm: float, compute: float) -> float:
        return layers * slow * min(comm, compute)

    fwd_overlap = hidden(prefetch_f, c_fwd)
    bwd_overlap_mb = hidden(prefetch_b + grad_mb, c_bwd) if training else 0.0
    bwd_overlap_last = hidden(prefetch_b + grad_mb + grad_step, c_bwd) if training else 0.0
    overlap_slow_mb = interference(prefetch_f, c_fwd)  # prefetch/gradient traffic's, per micro-batch
    slow_last = 0.0  # the last micro-batch's extra (once-per-step gradient reductions)
    if training:
        overlap_slow_mb += interference(prefetch_b + grad_mb, c_bwd)
        slow_last = interference(prefetch_b + grad_mb + grad_step, c_bwd) - interference(prefetch_b + grad_mb, c_bwd)

    layer_f = c_fwd + lf_exposed + ring_exposed_f + ring_slow_f
    layer_b = c_bwd + lb_exposed + ring_exposed_b + ring_slow_b if training else 0.0
    microbatch_s = (layers * (layer_f + layer_b) + fwd_overlap + bwd_overlap_mb + head_f + head_b + model_mb
                    + overlap_slow_mb)
    interference_s = accum * (layers * (ring_slow_f + ring_slow_b) + overlap_slow_mb) + slow_last
    step_comm_exposed = (
        accum * (layers * (lf_exposed + lb_exposed + ring_exposed_f + ring_exposed_b) + model_mb + fwd_overlap)
        + (accum - 1) * bwd_overlap_mb + bwd_overlap_last + model_step
    )

    # ----- optimizer and offload ---------------------------------------------------------------------
    optimizer_s = offload_s = 0.0
    pcie = topology.pcie_bandwidth
    d = train.dtype_bytes
    if training:
        params = tp_local_layer_params(model, layout.tp) * layers + tp_local_other_params(model, layout.tp)
        local = params / (layout.shard_group if train.zero_stage >= 1 else 1)
        traffic = optimizer_step_traffic(train.optimizer, d)
        cpu_params = offload.optimizer_bytes / host_optimizer_bytes_per_param(train)
        gpu_params = max(0.0, local - cpu_params)
        optimizer_s = gpu_params * traffic / hbm
        if cpu_params > 0:
            cores = topology.spec.node.host.cpu_cores / topology.gpus_per_node
            optimizer_s += max(cpu_params * traffic / topology.host_memory_bandwidth_per_gpu,
                               cpu_params / (profile.stack.time.cpu_optimizer_params_per_s_per_core * cores))
            grads_down = cpu_params * d / pcie
            offload_s += cpu_params * d / pcie  # updated weights back to the GPU
            offload_s += max(0.0, grads_down - layers * c_bwd)  # gradient copies hide behind backward
    checkpoint_bytes = offload.checkpoint_bytes
    if (training and train.offload_checkpoints and train.checkpointing != "none"
            and not profile.stack.time.checkpoint_offload_recomputes):
        # save_on_cpu-style offload: every saved activation crosses PCIe (and nothing is recomputed).
        checkpoint_bytes = max(checkpoint_bytes, saved_activation_bytes(model, train, layout))
    if offload.param_bytes or checkpoint_bytes:
        fwd_pcie = (offload.param_bytes + checkpoint_bytes) / pcie
        bwd_pcie = ((2 * offload.param_bytes if training else 0.0) + checkpoint_bytes) / pcie
        per_mb = max(0.0, fwd_pcie - layers * c_fwd)
        if training:
            per_mb += max(0.0, bwd_pcie - layers * c_bwd)
        offload_s += accum * per_mb

    overhead_s = profile.stack.time.step_overhead_s
    step_s = (accum * microbatch_s + (bwd_overlap_last - bwd_overlap_mb) + slow_last
              + model_step + optimizer_s + offload_s + overhead_s)
    tokens_per_step = float(train.micro_batch * train.seq_len * accum * layout.dp)

    def build() -> TimeEstimate:
        comm_by = {k: accum * cp.comm_mb[k] + cp.comm_step[k] for k in STEP_STRATEGIES}
        exposed = {k: layers * accum * cp.exposed_layer[k] + accum * cp.model_mb_by[k] + cp.model_step_by[k]
                   for k in STEP_STRATEGIES}
        exposed["ring"] += (ring_exposed_f + ring_exposed_b) * layers * accum
        _split(exposed, fwd_overlap * accum, cp.prefetch_f_by)
        _split(exposed, bwd_overlap_mb * (accum - 1) + bwd_overlap_last, cp.overlapped_b_by)
        model_flops = w.model_flops * layout.world * accum
        denominator = step_s * layout.world * peak
        return TimeEstimate.model_construct(  # computed values; skip re-validation
            compute_s=compute_s,
            comm_s=sum(comm_by.values()),
            exposed_comm_s=step_comm_exposed,
            optimizer_s=optimizer_s,
            offload_s=offload_s,
            interference_s=interference_s,
            overhead_s=overhead_s,
            step_s=step_s,
            tokens_per_step=tokens_per_step,
            tokens_per_s=tokens_per_step / step_s,
            mfu=model_flops / denominator,
            hfu=w.executed_flops(layers) * layout.world * accum / denominator,
            model_flops_per_step=model_flops,
            peak_flops=peak,
            comm_s_by_strategy=comm_by,
            exposed_comm_s_by_strategy=exposed,
            fabric_bytes_per_step=accum * cp.fabric_mb + cp.fabric_step,
            breakdown={
                "layer_forward_compute_s": c_fwd,
                "layer_backward_compute_s": c_bwd if training else 0.0,
                "layer_recompute_s": c_re if training else 0.0,
                "layer_attention_forward_s": attn_f,
                "layer_attention_backward_s": attn_b if training else 0.0,
                "layer_forward_exposed_comm_s": lf_exposed + ring_exposed_f,
                "layer_backward_exposed_comm_s": lb_exposed + ring_exposed_b if training else 0.0,
                "head_compute_s": head_f + head_b,
                "microbatch_s": microbatch_s,
            },
            efficiencies={**ct.fractions, "pcie": eff.pcie, "host_memory": eff.host_memory,
                          "compute_overhead_fraction": profile.stack.time.compute_overhead_fraction},
            components={
                **{name: accum * seconds for name, seconds in ct.parts.items()},
                **{f"exposed_comm_{k}": v for k, v in exposed.items()},
                "interference": interference_s,
                "offload": offload_s,
                "optimizer": optimizer_s,
                "step_overhead": overhead_s,
            },
            efficiency_sources=efficiency_sources(topology, profile),
        )

    return StepTime(step_s, tokens_per_step, build)


def attention_forward_seconds(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
                              profile: CostProfile | None = None) -> float:
    """One attention layer's forward on its own (an attention benchmark: no projections or MLP): the
    Ulysses all-to-alls of Q, K, V and the output (exposed) plus the attention kernels, ring steps and
    their K/V hops (each hidden behind a step's compute, NCCL slowing it). ``train.mode`` must be
    ``prefill`` (forward only)."""
    if train.is_training:
        raise CostModelError("attention_forward_seconds times a forward pass: use mode='prefill'")
    profile = profile or default_profile(topology.gpu.name)
    ct = compute_time(model, train, layout, topology, profile)
    cp = _comm_profile(model, train, layout, topology)
    slow = profile.kernels.nccl_compute_slowdown
    r = layout.ring
    ring = 0.0
    if r > 1:
        ring = (r - 1) * (max(0.0, cp.ring_f - ct.ring_step_forward) + slow * min(cp.ring_f, ct.ring_step_forward))
    return cp.exposed_layer["ulysses"] + ct.attention_forward + ring


#: TrainSpec fields the collectives of a step depend on: comm_volume.comm_ops reads only these (a test
#: checks that changing any other field leaves the op list unchanged).
COMM_FIELDS = ("seq_len", "micro_batch", "dtype", "mode", "optimizer", "zero_stage", "checkpointing",
               "tp_sequence_parallel")


@dataclass(frozen=True, slots=True)
class _CommProfile:
    """A step's collectives priced on the topology and sorted by how they may overlap: seconds of one
    micro-batch (``_mb``) or once per step (``_step``), per layer where named. Shared by every option
    combination that moves the same bytes, so :func:`_time` only does the arithmetic that depends on
    compute time and gradient accumulation."""

    comm_mb: dict[str, float]  # strategy -> all occurrences in one micro-batch
    comm_step: dict[str, float]  # strategy -> once-per-step ops
    fabric_mb: float
    fabric_step: float
    exposed_layer: dict[str, float]  # non-overlapping per-layer ops, one layer and micro-batch
    layer_fwd_exposed: float
    layer_bwd_exposed: float
    model_mb: float  # whole-model ops per micro-batch (exposed)
    model_mb_by: dict[str, float]
    model_step: float  # whole-model ops once per step (exposed)
    model_step_by: dict[str, float]
    ring_f: float  # one hop
    ring_b_kv: float
    ring_b_dkv: float
    ring_re: float
    prefetch_f: float  # per layer
    prefetch_b: float
    grad_mb: float  # per layer, per micro-batch
    grad_step: float  # per layer, once per step
    prefetch_f_by: dict[str, float]
    overlapped_b_by: dict[str, float]  # backward prefetch and gradient traffic, by strategy


_PROFILES: Memo[_CommProfile] = Memo()


def _comm_profile(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology) -> _CommProfile:
    # The topology is keyed by identity (it is mutable and unhashable by value), which also keeps it
    # alive as long as its entries.
    key = (model, layout, topology, *(getattr(train, f) for f in COMM_FIELDS))
    return _PROFILES.get(key, lambda: _price_comm(model, train, layout, topology))


def _price_comm(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology) -> _CommProfile:
    """Every collective of a step priced on ``topology`` and classified (see :class:`_CommProfile`)."""
    spans = group_spans(layout, topology)
    layers = model.num_layers
    memo: dict[tuple[str, float, str], object] = {}
    zero = dict.fromkeys(STEP_STRATEGIES, 0.0)
    comm_mb, comm_step, exposed_layer = dict(zero), dict(zero), dict(zero)
    model_mb_by, model_step_by = dict(zero), dict(zero)
    fabric_mb = fabric_step = 0.0
    lf = lb = model_mb = model_step = 0.0
    ring_f = ring_b_kv = ring_b_dkv = ring_re = 0.0
    prefetch_f = prefetch_b = grad_mb = grad_step = 0.0
    prefetch_f_by: dict[str, float] = {}
    prefetch_b_by: dict[str, float] = {}
    grad_mb_by: dict[str, float] = {}
    grad_step_by: dict[str, float] = {}
    for op in comm_ops(model, train, layout):
        key = (op.collective, op.nbytes, op.group)
        cost = memo.get(key)
        if cost is None:
            cost = memo[key] = collective_cost(op.collective, op.nbytes, spans[op.group])
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
        elif op.overlap == "ring":
            if op.phase == "forward":
                ring_f = t
            elif op.recompute:
                ring_re = t
            elif op.count == layout.ring - 1:
                ring_b_kv = t
            else:
                ring_b_dkv = t
        elif op.overlap == "prefetch":
            if op.phase == "forward":
                prefetch_f += t
                prefetch_f_by[op.strategy] = prefetch_f_by.get(op.strategy, 0.0) + t
            else:
                prefetch_b += t
                prefetch_b_by[op.strategy] = prefetch_b_by.get(op.strategy, 0.0) + t
        else:  # grad
            table = grad_mb_by if op.per == "microbatch" else grad_step_by
            table[op.strategy] = table.get(op.strategy, 0.0) + t
            if op.per == "microbatch":
                grad_mb += t
            else:
                grad_step += t
    return _CommProfile(
        comm_mb=comm_mb, comm_step=comm_step, fabric_mb=fabric_mb, fabric_step=fabric_step,
        exposed_layer=exposed_layer, layer_fwd_exposed=lf, layer_bwd_exposed=lb,
        model_mb=model_mb, model_mb_by=model_mb_by, model_step=model_step, model_step_by=model_step_by,
        ring_f=ring_f, ring_b_kv=ring_b_kv, ring_b_dkv=ring_b_dkv, ring_re=ring_re,
        prefetch_f=prefetch_f, prefetch_b=prefetch_b, grad_mb=grad_mb, grad_step=grad_step,
        prefetch_f_by=prefetch_f_by, overlapped_b_by=_merge(prefetch_b_by, grad_mb_by, grad_step_by),
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
