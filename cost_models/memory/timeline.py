"""The step as a sequence of phases; the device peak is the largest of them.

Training (per micro-batch, then the optimizer step):

- ``forward``: the last block runs, the saved tensors of all earlier blocks are resident;
- ``loss``: all blocks' saved tensors plus the output layer's forward and backward (logits, loss);
- ``backward (last block)``: the last block is recomputed (checkpointing) and differentiated while the
  other blocks' saved tensors are still resident and only the output layer's gradients exist;
- ``backward (first block)``: the same work for block 0, when the saved tensors are gone but the
  gradients of all later blocks exist. Between the two ends live bytes change linearly (one block's
  saved tensors traded for one block's gradients), so the ends bound every block in between;
- ``optimizer step``: weights, gradients, optimizer states and the step's temporaries.

Prefill: ``forward`` (one block's working set beside the KV cache, preallocated for all layers) and
``logits``.

Every phase adds the persistent model states and, for ZeRO-3, the gathered parameters (the block
computing plus the prefetched one) and unsharded gradients; transient tensors inside a block come from
the liveness simulation of its graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from ..errors import CostModelError
from ..gpu_spec import GPUSpec
from ..layout import Layout
from ..model_spec import ModelSpec
from ..pipeline import StageView, candidate_stages, check_pipeline, stages
from ..train_spec import TrainSpec
from .allocator import fragmentation as allocator_fragmentation
from .assumptions import MemoryAssumptions
from .block import block_graph, kv_cache_bytes_per_layer
from .dims import LocalDims, local_dims
from .graph import Graph
from .kernel_limits import row_kernel_last_offset, row_kernel_limit_text, within_row_kernel_limit
from .liveness import GraphMemory, Peak, simulate
from .output_layer import output_graph
from .overhead import Overhead, overhead
from .phases import _larger, _Phase, _prefill_phases, _train_phases
from .report import (
    ALLOCATED_COMPONENTS,
    BufferDetail,
    CommunicatorInfo,
    HostMemory,
    LayerActivations,
    MemoryBreakdown,
    MemoryDetail,
    MemoryReport,
    OutputLayerMemory,
    OverheadDetail,
    PipelineMemory,
    StatesDetail,
    UlyssesShapes,
)
from .states import ModelStates, block_matrices, model_states

#: Bytes of a token id, label or position id (int64, as tokenizers and HF collators produce them).
INDEX_BYTES = 8


def validate_options(train: TrainSpec, layout: Layout) -> None:
    """Combinations the memory model (and the runtime) cannot represent, as one-line errors."""
    if train.attention_kernel == "materialized" and layout.ring > 1:
        raise CostModelError(
            f"materialized attention cannot run with ring={layout.ring}: ring attention is blockwise with an "
            "LSE merge; use --attention flash or move the ring degree to ulysses/dp"
        )
    if train.is_training and train.offload_checkpoints and train.checkpointing == "none":
        raise CostModelError(
            "offload_checkpoints moves each block's checkpointed input to host memory, but checkpointing is "
            "'none'; use --checkpointing full or selective"
        )


def rope_table_bytes(tokens: int, head_dim: int, dtype_bytes: int) -> int:
    """The RoPE cos and sin tables of ``tokens`` positions, shared by all layers."""
    return 2 * tokens * head_dim * dtype_bytes


def _inputs_bytes(model: ModelSpec, d: LocalDims, training: bool) -> int:
    """Token ids, position ids (+ labels) and the RoPE cos/sin tables all layers share."""
    index_tensors = 3 if training else 2
    rope = rope_table_bytes(d.tokens, d.head_dim, d.compute_bytes) if model.position_embedding == "rope" else 0
    return index_tensors * d.tokens * INDEX_BYTES + rope


@dataclass(frozen=True)
class MemoryCore:
    """Everything the report is built from, as plain numbers and shared simulation results.

    The planner calls :func:`memory_core` thousands of times and needs only :attr:`total` and
    :attr:`host_total`; :func:`memory_report` dresses the same numbers up as the documented report.
    """

    dims: LocalDims
    states: ModelStates
    block: GraphMemory
    head: GraphMemory
    phases: list[_Phase]
    peak: _Phase
    extra: Overhead
    offloaded_per_layer: int
    inputs: int
    mode: str
    host_weights: int
    host_gradients: int
    host_optimizer: int
    host_checkpoints: int
    row_kernel_offset: int
    """Largest element offset at which the stack's Triton row kernels start a row (kernel_limits.py)."""
    row_kernel_offset_limit: int | None
    """The most they can address (``MemoryAssumptions.row_kernel_offset_limit``), None if unbounded."""
    stage: StageView | None = None
    """With pipeline parallelism: the stage these figures are for (the one with the largest total)."""

    @property
    def within_kernel_limits(self) -> bool:
        """The stack's kernels can address this GPU's slice: beyond it a run fails with an illegal memory
        access however much memory is free, so it does not fit either."""
        return within_row_kernel_limit(self.row_kernel_offset, self.row_kernel_offset_limit)

    def kernel_limit_reason(self) -> str | None:
        """Why the slice is out of the kernels' reach, in one line (None when it is not)."""
        if self.within_kernel_limits:
            return None
        return row_kernel_limit_text(self.row_kernel_offset, self.row_kernel_offset_limit, self.dims.tokens)

    @property
    def peak_allocated(self) -> int:
        return self.peak.allocated

    @property
    def total(self) -> int:
        return self.peak.allocated + self.extra.total

    @property
    def host_total(self) -> int:
        return self.host_weights + self.host_gradients + self.host_optimizer + self.host_checkpoints

    @property
    def host(self) -> HostMemory:
        """Host-resident bytes as the report's type (built without re-validation: computed values)."""
        return HostMemory.model_construct(weights=self.host_weights, gradients=self.host_gradients,
                                          optimizer=self.host_optimizer, checkpoints=self.host_checkpoints,
                                          total=self.host_total)


def memory_core(model: ModelSpec, train: TrainSpec, layout: Layout,
                assumptions: MemoryAssumptions | None = None) -> MemoryCore:
    """Per-GPU memory of ``model`` trained (or prefilled) with ``train`` on ``layout``, without the
    report objects (see :class:`MemoryCore`). With pipeline parallelism, the worst stage's."""
    a = assumptions or MemoryAssumptions()
    if layout.pp == 1:
        return _memory_core(model, train, layout, a, None)
    candidates = candidate_stages(pipeline_stages(model, train, layout))
    if a.allocator == "fraction":
        # The overheads grow with the allocated peak alone (context, NCCL, a fraction of the peak), so the
        # stage with the largest peak has the largest total: only its report is built.
        # Each candidate's phases are built once: the worst one's go on into its report.
        built = [(st, _phases(model, train, layout, a, st)) for st in candidates]
        worst, phased = max(built, key=lambda item: max(p.allocated for p in item[1][-1]))
        return _memory_core(model, train, layout, a, worst, phased)
    return max((_memory_core(model, train, layout, a, st) for st in candidates), key=lambda core: core.total)


def pipeline_stages(model: ModelSpec, train: TrainSpec, layout: Layout) -> tuple[StageView, ...]:
    """The pipeline's stages (:mod:`sp_plan.cost_models.pipeline`), after its checks."""
    check_pipeline(model, train, layout)
    return stages(model, train, layout)


def stage_totals(model: ModelSpec, train: TrainSpec, layout: Layout,
                 assumptions: MemoryAssumptions | None = None) -> list[int]:
    """Device bytes of every pipeline stage, first to last (one entry without PP)."""
    a = assumptions or MemoryAssumptions()
    if layout.pp == 1:
        return [_memory_core(model, train, layout, a, None).total]
    return [_memory_core(model, train, layout, a, st).total for st in pipeline_stages(model, train, layout)]


def _phases(model: ModelSpec, train: TrainSpec, layout: Layout, a: MemoryAssumptions, stage: StageView | None):
    """The step's phases and what they are built from: (dims, states, block, head, inputs, offloaded bytes
    per layer, checkpointing mode, tiled-MLP gradient bytes, phases)."""
    validate_options(train, layout)
    d = local_dims(model, train, layout)
    states = model_states(model, train, layout, a, None if stage is None else (stage.layers, stage.first, stage.last))
    training = train.is_training
    mode = train.checkpointing if training else "inference"
    mlp_grads = _tiled_mlp_param_grad_bytes(model, train, layout.tp, a, states)
    block = _layers_block(model, d, a, training, train.attention_kernel, train.tiled_mlp, mode, mlp_grads)
    head = _head_memory(model, d, a, training, train.tiled_loss)
    inputs = _inputs_bytes(model, d, training)
    offloaded = _offloaded_checkpoint_bytes(d, train)
    if training:
        phases = _train_phases(model, train, a, states, block, head, inputs, offloaded, stage)
    else:
        phases = _prefill_phases(model, a, states, block, head, inputs, kv_cache_bytes_per_layer(d, _v_head_dim(model)))
    return d, states, block, head, inputs, offloaded, mode, mlp_grads, phases


def _memory_core(model: ModelSpec, train: TrainSpec, layout: Layout, a: MemoryAssumptions,
                 stage: StageView | None, phased: tuple | None = None) -> MemoryCore:
    """The core of one stage (``stage`` None: the whole model); ``phased``: its :func:`_phases`, when the
    caller already built them."""
    if phased is None:
        phased = _phases(model, train, layout, a, stage)
    d, states, block, head, inputs, offloaded, mode, mlp_grads, phases = phased
    training = train.is_training
    row_offset = row_kernel_last_offset(model, d, a)
    peak = max(phases, key=lambda p: p.allocated)
    reserve = cached = None
    if a.allocator != "fraction":
        frag = _step_fragmentation(model, d, a, training, train.attention_kernel, train.tiled_mlp, train.tiled_loss,
                                   mode, mlp_grads, bool(offloaded), stage is None or stage.last)
        slack = int(a.allocator_slack_fraction * peak.allocated)
        # What the allocator holds at its high-water mark vs what it cannot hand back when an allocation
        # would fail (release_cached_blocks: free blocks of every stream's pool are released, and with
        # expandable segments the pages under free blocks are unmapped, so the replay's holes come back;
        # cudaMalloc'd segments that still hold a live block do not).
        held = reserved_above_peak(phases, frag) + slack
        reserve = slack + (frag if a.allocator == "segments" else 0)
        cached = held - reserve
    return MemoryCore(
        dims=d, states=states, block=block, head=head, phases=phases, peak=peak,
        extra=overhead(layout, peak.allocated, a, zero_stage=train.zero_stage if training else 0, fragmentation=reserve,
                       cached=cached),
        offloaded_per_layer=offloaded, inputs=inputs, mode=mode,
        host_weights=states.weights_host, host_gradients=states.gradients_host,
        host_optimizer=states.optimizer_host,
        host_checkpoints=(model.num_layers if stage is None else stage.layers) * _host_checkpoint_bytes(
            model, d, a, train),
        row_kernel_offset=row_offset, row_kernel_offset_limit=a.row_kernel_offset_limit, stage=stage,
    )


def reserved_above_peak(phases: list[_Phase], fragmentation: int) -> int:
    """Caching-allocator reserve above the allocated peak (allocator 'expandable'/'segments').

    The compute stream's pool holds, at its worst, a phase's allocated bytes minus the gathered
    parameters (the ZeRO-3 all-gather stream allocates those from its own pool) plus the
    ``fragmentation`` the step replay leaves; the all-gather pool keeps its own high-water mark,
    whenever it was reached. Reserved = compute-pool peak + all-gather-pool peak.
    """
    side = max(p.zero3_gathered_params for p in phases)
    compute = max(p.allocated - p.zero3_gathered_params for p in phases) + fragmentation
    return compute + side - max(p.allocated for p in phases)


def _tiled_mlp_param_grad_bytes(model: ModelSpec, train: TrainSpec, tp: int, a: MemoryAssumptions,
                                st: ModelStates) -> int:
    """Parameter gradients a tiled MLP holds through its backward under bucketed ZeRO-2/3 (DeepSpeed): its
    matrices' gradients accumulated across tiles plus the next tile's gradient of one matrix before it
    is added in place. FSDP2's per-block unsharded gradients already cover them (0 here)."""
    if not (train.is_training and train.tiled_mlp and a.zero_reduce_bucket_params is not None
            and st.zero_stage >= 2):
        return 0
    m = block_matrices(model, tp, st.ep)
    return (m.mlp_count + 1) * m.mlp * st.per_param.gradients


def _offloaded_checkpoint_bytes(d: LocalDims, train: TrainSpec) -> int:
    """Per layer: the checkpointed block input moved to the host (with checkpoint offload)."""
    if not (train.is_training and train.offload_checkpoints):
        return 0
    return d.norm_tokens * d.hidden * d.compute_bytes


def _host_checkpoint_bytes(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, train: TrainSpec) -> int:
    """Per layer, what checkpoint offload keeps in host memory: the checkpointed input, or, when the stack's
    offload keeps the activations instead of recomputing them (``a.checkpoint_offload_keeps_activations``),
    everything the layer saves for backward without checkpointing: the bytes the time model moves over PCIe
    for it. Counting only the input there let hf-fsdp2 plans at 256K tokens need ~700 GB of host memory per
    GPU while the report said 34 GB."""
    offloaded = _offloaded_checkpoint_bytes(d, train)
    if not offloaded or not a.checkpoint_offload_keeps_activations:
        return offloaded
    return _layers_block(model, d, a, True, train.attention_kernel, train.tiled_mlp, "none").saved["activation"]


def host_memory(model: ModelSpec, train: TrainSpec, layout: Layout,
                assumptions: MemoryAssumptions | None = None) -> HostMemory:
    """Bytes per GPU kept in host memory, the same figures :func:`memory_core` reports, without
    simulating the device: what the time model needs to price offload traffic."""
    a = assumptions or MemoryAssumptions()
    if layout.pp > 1:  # the stage whose device memory is the largest (the one the estimate reports)
        return memory_core(model, train, layout, a).host
    states = model_states(model, train, layout, a)
    checkpoints = model.num_layers * _host_checkpoint_bytes(model, local_dims(model, train, layout), a, train)
    return HostMemory.model_construct(
        weights=states.weights_host, gradients=states.gradients_host, optimizer=states.optimizer_host,
        checkpoints=checkpoints,
        total=states.weights_host + states.gradients_host + states.optimizer_host + checkpoints,
    )


def memory_report(model: ModelSpec, train: TrainSpec, layout: Layout, gpu: GPUSpec,
                  assumptions: MemoryAssumptions | None = None) -> MemoryReport:
    """Per-GPU memory of ``model`` trained (or prefilled) with ``train`` on ``layout``.

    Call ``layout.check_against(model, train.seq_len, train.tp_sequence_parallel)`` first (``estimate``
    does).
    """
    a = assumptions or MemoryAssumptions()
    core = memory_core(model, train, layout, a)
    d, states, block, head, peak, extra = core.dims, core.states, core.block, core.head, core.peak, core.extra
    phases, inputs, offloaded, mode = core.phases, core.inputs, core.offloaded_per_layer, core.mode
    training = train.is_training
    peak_allocated = peak.allocated
    memory = MemoryBreakdown(
        **{c: getattr(peak, c) for c in ALLOCATED_COMPONENTS},
        overhead=extra.total,
        total=core.total,
        peak_allocated=peak_allocated,
        capacity=gpu.memory_bytes,
        device_used=core.total + extra.cached,
    )
    host = core.host

    detail = MemoryDetail(
        mode=train.mode,
        tokens_per_gpu=d.tokens,
        peak_phase=peak.name,
        phases={p.name: p.to_model() for p in phases},
        per_layer=_layer_activations(model, train, d, a, block, offloaded, mode),
        output_layer=_output_layer_memory(head),
        inputs_bytes=inputs,
        kv_cache_per_layer=0 if training else kv_cache_bytes_per_layer(d, _v_head_dim(model)),
        ulysses=_ulysses_shapes(d),
        buffers=BufferDetail(comm_staging=peak.comm_staging, zero3_gathered_params=peak.zero3_gathered_params,
                             unsharded_grads=peak.unsharded_grads, kernel_workspaces=peak.kernel_workspaces),
        overhead=_overhead_detail(extra, a, peak_allocated),
        states=_states_detail(states),
        row_kernel_offset=core.row_kernel_offset,
        row_kernel_offset_limit=a.row_kernel_offset_limit,
        assumptions=a.model_dump(),
        pipeline=_pipeline_detail(model, train, layout, a, core),
    )
    fits = memory.total <= memory.capacity and core.within_kernel_limits
    return MemoryReport(memory=memory, host_memory=host, fits=fits, detail=detail)


def _layer_activations(model: ModelSpec, train: TrainSpec, d: LocalDims, a: MemoryAssumptions, block: GraphMemory,
                       offloaded: int, mode: str) -> LayerActivations:
    """What one block saves for backward (and would save in each checkpointing mode), and its peaks."""
    by_mode = {}
    if train.is_training:
        for m in ("none", "selective", "full"):
            by_mode[m] = _layers_block(model, d, a, True, train.attention_kernel, train.tiled_mlp, m).saved[
                "activation"]
    return LayerActivations(
        checkpointing=mode,
        saved_bytes=sum(block.saved.values()) - offloaded,
        offloaded_bytes=offloaded,
        saved_tensors=block.saved_tensors,
        saved_bytes_by_mode=by_mode,
        forward_peak_bytes=block.forward_peak.total,
        forward_peak_at=block.forward_peak.at,
        backward_peak_bytes=block.backward_peak.total if block.backward_peak else 0,
        backward_peak_at=block.backward_peak.at if block.backward_peak else "",
    )


def _output_layer_memory(head: GraphMemory) -> OutputLayerMemory:
    return OutputLayerMemory(
        saved_bytes=sum(head.saved.values()),
        retained_logits_bytes=head.retained["logits"],
        forward_peak_bytes=head.forward_peak.total,
        backward_peak_bytes=head.backward_peak.total if head.backward_peak else 0,
        peak_at=_larger(head.forward_peak, head.backward_peak).at,
    )


def _overhead_detail(extra: Overhead, a: MemoryAssumptions, peak_allocated: int) -> OverheadDetail:
    return OverheadDetail(
        cuda_context=extra.cuda_context,
        nccl=extra.nccl,
        nccl_bytes_per_communicator=a.nccl_bytes_per_communicator,
        communicators=[CommunicatorInfo(name=g.name, dims=list(g.dims), size=g.size, bytes=b)
                       for g, b in zip(extra.communicators, extra.communicator_bytes)],
        fragmentation=extra.fragmentation,
        cached_reserve=extra.cached,
        peak_reserved=peak_allocated + extra.fragmentation + extra.cached,
        allocator=a.allocator,
    )


def _states_detail(states: ModelStates) -> StatesDetail:
    return StatesDetail(
        params_per_tp_rank=states.params.total,
        params_per_layer_per_tp_rank=states.params.per_layer,
        shard_group=states.shard_group,
        bytes_per_param={"weights": states.per_param.weights, "gradients": states.per_param.gradients,
                         "optimizer": states.per_param.optimizer},
        optimizer_on_device=states.optimizer_on_device,
    )


def _pipeline_detail(model: ModelSpec, train: TrainSpec, layout: Layout, a: MemoryAssumptions,
                     core: MemoryCore) -> PipelineMemory | None:
    if core.stage is None:
        return None
    every = pipeline_stages(model, train, layout)
    return PipelineMemory(stage=core.stage.index, stage_layers=[s.layers for s in every],
                          in_flight_microbatches=[s.in_flight for s in every],
                          stage_totals=[_memory_core(model, train, layout, a, s).total for s in every])


def _v_head_dim(model: ModelSpec) -> int | None:
    """MLA's value head dim (its KV cache holds V unpadded); None for ordinary attention."""
    return model.mla.v_head_dim if model.mla is not None else None


def _layers_block(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool, attention_kernel: str,
                  tiled_mlp: bool, mode: str, mlp_param_grads: int = 0) -> GraphMemory:
    """The simulated block all layers are costed with: the model's block, or for a MoE model with dense
    layers too (DeepSeek's first ``first_k_dense_replace``) the MoE and dense blocks combined."""
    block = _block_memory(model, d, a, training, attention_kernel, tiled_mlp, mode, mlp_param_grads)
    if model.moe is None or not model.moe.dense_layers:
        return block
    dense = _block_memory(model.model_copy(update={"moe": None}), d, a, training, attention_kernel, tiled_mlp, mode,
                          mlp_param_grads)
    return mixed_layers_block(block, dense, model.moe_layer_count, len(model.moe.dense_layers))


def mixed_layers_block(moe: GraphMemory, dense: GraphMemory, moe_layers: int, dense_layers: int) -> GraphMemory:
    """One block standing for a model whose layers differ in their FFN (MoE and dense): saved bytes are the
    layers' mean (``layers x`` it is what all blocks save together), the working-set peaks are the larger
    block's (any layer may be the one running when the step peaks)."""
    layers = moe_layers + dense_layers
    saved = {k: -(-(moe_layers * moe.saved.get(k, 0) + dense_layers * dense.saved.get(k, 0)) // layers)
             for k in moe.saved.keys() | dense.saved.keys()}

    def larger(a: Peak | None, b: Peak | None) -> Peak | None:
        if a is None or b is None:
            return a or b
        return a if a.total >= b.total else b

    return replace(moe, saved=saved, forward_peak=larger(moe.forward_peak, dense.forward_peak),
                   backward_peak=larger(moe.backward_peak, dense.backward_peak))


@lru_cache(maxsize=8192)
def _block_memory(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool, attention_kernel: str,
                  tiled_mlp: bool, mode: str, mlp_param_grads: int = 0) -> GraphMemory:
    """One block's simulated memory. It depends only on the local shapes and options, not on how the
    data-parallel ranks are split, so the planner's many layouts that share local dims share it.
    Treat the result as read-only (it is shared)."""
    graph = _block_graph(model, d, a, training, attention_kernel, tiled_mlp, mlp_param_grads)
    return simulate(graph, mode, a.selective_policy, reentrant=a.checkpoint_implementation == "reentrant")


@lru_cache(maxsize=4096)
def _block_graph(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool, attention_kernel: str,
                 tiled_mlp: bool, mlp_param_grads: int = 0) -> Graph:
    """The block's graph, shared by the checkpointing modes simulated on it (read-only)."""
    return block_graph(model, d, a, training=training, attention_kernel=attention_kernel, tiled_mlp=tiled_mlp,
                       mlp_param_grad_bytes=mlp_param_grads)


#: Blocks the allocator replay runs forward and backward (the pattern repeats; a few reach steady state).
REPLAY_BLOCKS = 4
#: Tensors up to this size (the allocator's small pool) are left out of the replay.
SMALL_TENSOR_BYTES = 1 << 20


@lru_cache(maxsize=2048)
def _step_fragmentation(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool, attention_kernel: str,
                        tiled_mlp: bool, tiled_loss: bool, mode: str, mlp_param_grads: int, offloaded: bool,
                        with_head: bool = True) -> int:
    """Reserved bytes above the live peak when the allocator (:mod:`.allocator`, ``a.allocator``) replays
    a step in miniature: ``REPLAY_BLOCKS`` blocks forward (each block's input is the previous one's output,
    saved tensors stay allocated, an offloaded checkpoint leaves the device when its block returns), the
    output layer forward and backward, and the blocks' recompute + backward in reverse (each starting from
    the gradient the later one produced, the offloaded checkpoint brought back). Tensors allocated before
    the step and kept through it (weights, buffers) sit below and are left out; the reserve the replay
    leaves above its own live peak is the fragmentation. Cached: one replay per distinct local shape.
    ``with_head`` False: a pipeline stage without the output layer (not the last): its blocks' output goes to
    the next stage and their gradient arrives from it, one hidden-sized tensor, so the output layer's tensors
    (logits, their chunks under a tiled loss) are not in its replay; they were, and made a first stage's
    reserve depend on a loss it never computes."""
    reentrant = a.checkpoint_implementation == "reentrant"
    graph = _block_graph(model, d, a, training, attention_kernel, tiled_mlp, mlp_param_grads)
    blk = simulate(graph, mode, a.selective_policy, reentrant=reentrant, trace=True)
    head_graph = output_graph(model, d, a, training=training, tiled_loss=tiled_loss) if with_head else None
    head = simulate(head_graph, "none" if training else "inference", trace=True) if with_head else None
    kept = set(blk.saved_tensors)
    replay = _Replay()
    inputs = _replay_forward(replay, graph, blk, kept, offloaded)
    hkey = _replay_head_forward(replay, head_graph, head, inputs) if with_head else None
    # Without the head the last block's output stays: the schedule keeps a stage's output for its backward.
    if training:
        _replay_backward(replay, graph, blk, head, hkey, inputs, kept, offloaded)
    return allocator_fragmentation(replay.events, a.allocator)


class _Replay:
    """The allocator events of :func:`_step_fragmentation`'s miniature step, and the tensors live in it
    (insertion-ordered: the replay must not depend on hash order)."""

    __slots__ = ("events", "live")

    def __init__(self) -> None:
        self.events: list = []
        self.live: dict = {}

    def emit(self, kind: str, key: object, nbytes: int) -> None:
        live = self.live
        if kind == "a":
            if key in live or nbytes <= SMALL_TENSOR_BYTES:
                return  # small tensors live in the small pool's 2 MiB segments: no GB-scale fragmentation
            live[key] = None
        elif live.pop(key, 0) is not None:
            return  # not live: nothing to free
        self.events.append((kind, key, nbytes))


def _replay_forward(replay: _Replay, graph: Graph, blk: GraphMemory, kept: set, offloaded: bool) -> list:
    """The blocks' forward, each on the previous one's output; returns the blocks' inputs (the last entry: the
    last block's output)."""
    emit = replay.emit
    inp, out = graph.inputs[0].name, graph.outputs[0]
    first_input = ("embedding output",)
    emit("a", first_input, graph.inputs[0].nbytes)
    inputs = [first_input]
    for j in range(REPLAY_BLOCKS):
        def fkey(name: object, j: int = j) -> object:
            return inputs[j] if name == inp else ("f", j, name)
        for kind, name, nbytes in blk.forward_trace:
            emit(kind, fkey(name), nbytes)
        if offloaded:  # the checkpointed input went to the host; the caller drops it when the block returns
            for name in kept:
                emit("f", fkey(name), 0)
        inputs.append(("f", j, out))
    if first_input in replay.live and (offloaded or inp not in kept):
        emit("f", first_input, 0)  # HF keeps inputs_embeds referenced until the model's forward returns
    return inputs


def _replay_head_forward(replay: _Replay, head_graph: Graph, head: GraphMemory, inputs: list) -> Callable:
    """The output layer's forward on the last block's output; returns the key of a head tensor by name."""
    head_in = head_graph.inputs[0].name

    def hkey(name: object) -> object:
        return inputs[-1] if name == head_in else ("h", name)
    for kind, name, nbytes in head.forward_trace:
        replay.emit(kind, hkey(name), nbytes)
    return hkey


def _replay_backward(replay: _Replay, graph: Graph, blk: GraphMemory, head: GraphMemory | None,
                     hkey: Callable | None, inputs: list, kept: set, offloaded: bool) -> None:
    """The output layer's backward (or, without it, the gradient received from the next stage), then the
    blocks' recompute + backward in reverse, each from the gradient the later one produced."""
    emit, live = replay.emit, replay.live
    inp = graph.inputs[0].name
    if head is not None:
        for kind, name, nbytes in head.backward_trace or ():
            emit(kind, hkey(name), nbytes)
        carried = hkey(head.grad_keys[1][0]) if head.grad_keys[1] else None
    else:  # the output's gradient is received from the next stage
        carried = ("received gradient",)
        emit("a", carried, graph.inputs[0].nbytes)
    out_grad, in_grad = blk.grad_keys[0][0], blk.grad_keys[1][0]
    for j in reversed(range(REPLAY_BLOCKS)):
        incoming = carried

        def bkey(name: object, j: int = j) -> object:
            if name == out_grad:
                return incoming
            if name == inp:
                return ("b", j, name) if offloaded else inputs[j]
            if name in kept:
                return ("f", j, name)
            return ("b", j, name)
        for kind, name, nbytes in blk.backward_trace:
            emit(kind, bkey(name), nbytes)
        carried = bkey(in_grad)
        for key in [k for k in live if (isinstance(k, tuple) and k[:2] == ("b", j)) or k == incoming]:
            if key != carried:
                emit("f", key, 0)


@lru_cache(maxsize=8192)
def _head_memory(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool,
                 tiled_loss: bool) -> GraphMemory:
    """The output layer's simulated memory (logits and loss), cached like :func:`_block_memory`."""
    graph = output_graph(model, d, a, training=training, tiled_loss=tiled_loss)
    return simulate(graph, "none" if training else "inference")


def _ulysses_shapes(d: LocalDims) -> UlyssesShapes:
    """Q/K/V per GPU before (sequence-split) and after (head-split) the all-to-all, computed separately."""
    B, hd = d.compute_bytes, d.head_dim
    before_tokens, after_tokens = d.tokens, d.batch * d.attn_seq
    return UlyssesShapes(
        degree=d.ulysses,
        q_bytes_before=before_tokens * d.q_heads * hd * B,
        k_bytes_before=before_tokens * d.kv_heads * hd * B,
        v_bytes_before=before_tokens * d.kv_heads * hd * B,
        q_bytes_after=after_tokens * d.q_heads_attn * hd * B,
        k_bytes_after=after_tokens * d.kv_heads_attn * hd * B,
        v_bytes_after=after_tokens * d.kv_heads_attn * hd * B,
        q_heads_after=d.q_heads_attn,
        kv_heads_before=d.kv_heads,
        kv_heads_after=d.kv_heads_attn,
        kv_replication=d.kv_replication,
        tokens_before=before_tokens,
        tokens_after=after_tokens,
    )


