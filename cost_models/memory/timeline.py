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

from dataclasses import dataclass
from functools import lru_cache

from ..errors import CostModelError
from ..gpu_spec import GPUSpec
from ..layout import Layout
from ..model_spec import ModelSpec
from ..train_spec import TrainSpec
from .assumptions import MemoryAssumptions
from .block import block_graph, kv_cache_bytes_per_layer
from .dims import LocalDims, local_dims
from .graph import Graph
from .liveness import GraphMemory, Peak, simulate
from .output_layer import output_graph
from .overhead import Overhead, overhead
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
    PhaseMemory,
    StatesDetail,
    UlyssesShapes,
)
from .states import ModelStates, model_states

#: Bytes of a token id, label or position id (int64, as tokenizers and HF collators produce them).
INDEX_BYTES = 8


@dataclass(slots=True)
class _Phase:
    name: str
    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    kv_cache: int = 0
    comm_staging: int = 0
    zero3_gathered_params: int = 0
    unsharded_grads: int = 0
    at: str = ""

    @property
    def buffers(self) -> int:
        return self.comm_staging + self.zero3_gathered_params + self.unsharded_grads

    @property
    def allocated(self) -> int:
        # Spelled out (the sum over ALLOCATED_COMPONENTS, which a test keeps in step): the planner
        # reads this tens of thousands of times per search.
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.kv_cache
                + self.comm_staging + self.zero3_gathered_params + self.unsharded_grads)

    def add_peak(self, peak: Peak) -> None:
        self.activations += peak.by_kind["activation"]
        self.logits += peak.by_kind["logits"]
        self.comm_staging += peak.by_kind["comm"]
        self.kv_cache += peak.by_kind["kv_cache"]
        self.at = peak.at

    def to_model(self) -> PhaseMemory:
        return PhaseMemory(**{c: getattr(self, c) for c in ALLOCATED_COMPONENTS}, allocated=self.allocated,
                           transient_peak_at=self.at)


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


def _larger(a: Peak, b: Peak | None) -> Peak:
    return a if b is None or a.total >= b.total else b


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
    report objects (see :class:`MemoryCore`)."""
    a = assumptions or MemoryAssumptions()
    validate_options(train, layout)
    d = local_dims(model, train, layout)
    states = model_states(model, train, layout, a)
    training = train.is_training
    mode = train.checkpointing if training else "inference"
    block = _block_memory(model, d, a, training, train.attention_kernel, train.tiled_mlp, mode)
    head = _head_memory(model, d, a, training, train.tiled_loss)
    inputs = _inputs_bytes(model, d, training)
    offloaded = _offloaded_checkpoint_bytes(d, train)
    if training:
        phases = _train_phases(model, train, a, states, block, head, inputs, offloaded)
    else:
        phases = _prefill_phases(model, a, states, block, head, inputs, kv_cache_bytes_per_layer(d))
    peak = max(phases, key=lambda p: p.allocated)
    return MemoryCore(
        dims=d, states=states, block=block, head=head, phases=phases, peak=peak,
        extra=overhead(layout, peak.allocated, a), offloaded_per_layer=offloaded, inputs=inputs, mode=mode,
        host_weights=states.weights_host, host_gradients=states.gradients_host,
        host_optimizer=states.optimizer_host, host_checkpoints=model.num_layers * offloaded,
    )


def _offloaded_checkpoint_bytes(d: LocalDims, train: TrainSpec) -> int:
    """Per layer: the checkpointed block input moved to the host (with checkpoint offload)."""
    if not (train.is_training and train.offload_checkpoints):
        return 0
    return d.norm_tokens * d.hidden * d.compute_bytes


def host_memory(model: ModelSpec, train: TrainSpec, layout: Layout,
                assumptions: MemoryAssumptions | None = None) -> HostMemory:
    """Bytes per GPU kept in host memory, the same figures :func:`memory_core` reports, without
    simulating the device: what the time model needs to price offload traffic."""
    a = assumptions or MemoryAssumptions()
    states = model_states(model, train, layout, a)
    checkpoints = model.num_layers * _offloaded_checkpoint_bytes(local_dims(model, train, layout), train)
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
    )
    host = core.host

    by_mode = {}
    if training:
        for m in ("none", "selective", "full"):
            by_mode[m] = _block_memory(model, d, a, True, train.attention_kernel, train.tiled_mlp, m).saved[
                "activation"]
    detail = MemoryDetail(
        mode=train.mode,
        tokens_per_gpu=d.tokens,
        peak_phase=peak.name,
        phases={p.name: p.to_model() for p in phases},
        per_layer=LayerActivations(
            checkpointing=mode,
            saved_bytes=sum(block.saved.values()) - offloaded,
            offloaded_bytes=offloaded,
            saved_tensors=block.saved_tensors,
            saved_bytes_by_mode=by_mode,
            forward_peak_bytes=block.forward_peak.total,
            forward_peak_at=block.forward_peak.at,
            backward_peak_bytes=block.backward_peak.total if block.backward_peak else 0,
            backward_peak_at=block.backward_peak.at if block.backward_peak else "",
        ),
        output_layer=OutputLayerMemory(
            saved_bytes=sum(head.saved.values()),
            retained_logits_bytes=head.retained["logits"],
            forward_peak_bytes=head.forward_peak.total,
            backward_peak_bytes=head.backward_peak.total if head.backward_peak else 0,
            peak_at=_larger(head.forward_peak, head.backward_peak).at,
        ),
        inputs_bytes=inputs,
        kv_cache_per_layer=0 if training else kv_cache_bytes_per_layer(d),
        ulysses=_ulysses_shapes(d),
        buffers=BufferDetail(comm_staging=peak.comm_staging, zero3_gathered_params=peak.zero3_gathered_params,
                             unsharded_grads=peak.unsharded_grads),
        overhead=OverheadDetail(
            cuda_context=extra.cuda_context,
            nccl=extra.nccl,
            nccl_bytes_per_communicator=a.nccl_bytes_per_communicator,
            communicators=[CommunicatorInfo(name=g.name, dims=list(g.dims), size=g.size) for g in extra.communicators],
            fragmentation=extra.fragmentation,
            peak_reserved=peak_allocated + extra.fragmentation,
        ),
        states=StatesDetail(
            params_per_tp_rank=states.params.total,
            params_per_layer_per_tp_rank=states.params.per_layer,
            shard_group=states.shard_group,
            bytes_per_param={"weights": states.per_param.weights, "gradients": states.per_param.gradients,
                             "optimizer": states.per_param.optimizer},
            optimizer_on_device=states.optimizer_on_device,
        ),
        assumptions=a.model_dump(),
    )
    return MemoryReport(memory=memory, host_memory=host, fits=memory.total <= memory.capacity, detail=detail)


@lru_cache(maxsize=8192)
def _block_memory(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool, attention_kernel: str,
                  tiled_mlp: bool, mode: str) -> GraphMemory:
    """One block's simulated memory. It depends only on the local shapes and options, not on how the
    data-parallel ranks are split, so the planner's many layouts that share local dims share it.
    Treat the result as read-only (it is shared)."""
    graph = _block_graph(model, d, a, training, attention_kernel, tiled_mlp)
    return simulate(graph, mode, a.selective_policy)


@lru_cache(maxsize=4096)
def _block_graph(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool, attention_kernel: str,
                 tiled_mlp: bool) -> Graph:
    """The block's graph, shared by the checkpointing modes simulated on it (read-only)."""
    return block_graph(model, d, a, training=training, attention_kernel=attention_kernel, tiled_mlp=tiled_mlp)


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


def _train_phases(model: ModelSpec, train: TrainSpec, a: MemoryAssumptions, st: ModelStates, block: GraphMemory,
                  head: GraphMemory, inputs: int, offloaded: int) -> list[_Phase]:
    L = model.num_layers
    p = st.params
    zero3 = st.zero_stage == 3
    saved = block.saved["activation"] - offloaded  # per block, on the device
    in_flight = (a.checkpoint_offload_in_flight - 1) * offloaded  # other blocks' inputs being moved
    gathered_layers = (1 + a.zero3_prefetch_layers) * st.layer_weights_unsharded if zero3 else 0
    unsharded = a.unsharded_grad_layers * st.layer_grads_unsharded if st.zero_stage >= 2 else 0
    grads_all = st.grads_device(p.total)
    persistent = grads_all if (train.grad_accum > 1 or not a.grads_freed_between_steps) else 0
    head_params = p.head + (p.vocab_matrix if model.tied_embeddings else 0)  # tied: lm_head grads land there
    # Stage 0/1 keep full gradients, allocated as backward produces them (the block in progress
    # included); stage 2/3 keep shards, the block in progress is an unsharded buffer.
    in_progress = p.per_layer if st.zero_stage < 2 else 0

    def grads(params_done: int) -> int:
        return max(persistent, st.grads_device(params_done))

    def phase(name: str, **values: int) -> _Phase:
        return _Phase(name, weights=st.weights_device, optimizer=st.optimizer_device, **values)

    fwd = phase("forward", gradients=persistent, activations=inputs + (L - 1) * saved + in_flight,
                zero3_gathered_params=gathered_layers)
    fwd.add_peak(block.forward_peak)

    head_peak = _larger(head.forward_peak, head.backward_peak)
    # A tiled loss accumulates the output matrix's gradient chunk by chunk inside the op; the untiled
    # loss produces it in lm_head's backward, after the log-softmax backward peak.
    head_grads_during = train.tiled_loss
    loss = phase(
        "loss",
        gradients=grads(head_params) if head_grads_during else persistent,
        activations=inputs + L * saved + in_flight,
        zero3_gathered_params=(st.output_weights_unsharded + a.zero3_prefetch_layers * st.layer_weights_unsharded)
        if zero3 else 0,
        unsharded_grads=st.output_grads_unsharded if st.zero_stage >= 2 and head_grads_during else 0,
    )
    loss.add_peak(head_peak)

    kept_logits = head.retained["logits"]
    last = phase("backward (last block)", gradients=grads(head_params + in_progress),
                 activations=inputs + (L - 1) * saved + in_flight, logits=kept_logits,
                 zero3_gathered_params=gathered_layers, unsharded_grads=unsharded)
    last.add_peak(block.backward_peak)
    first = phase("backward (first block)", gradients=grads(head_params + (L - 1) * p.per_layer + in_progress),
                  activations=inputs + in_flight, logits=kept_logits,
                  zero3_gathered_params=gathered_layers, unsharded_grads=unsharded)
    first.add_peak(block.backward_peak)

    step_temps = int(st.optimizer_step_params * a.optimizer_step_temp_bytes_per_param)
    opt = _Phase("optimizer step", weights=st.weights_device, gradients=grads_all,
                 optimizer=st.optimizer_device + step_temps, logits=kept_logits, at="optimizer.step")
    return [fwd, loss, last, first, opt]


def _prefill_phases(model: ModelSpec, a: MemoryAssumptions, st: ModelStates, block: GraphMemory, head: GraphMemory,
                    inputs: int, kv_per_layer: int) -> list[_Phase]:
    kv = model.num_layers * kv_per_layer  # preallocated for the whole sequence and every layer
    zero3 = st.zero_stage == 3
    fwd = _Phase("forward", weights=st.weights_device, activations=inputs, kv_cache=kv,
                 zero3_gathered_params=(1 + a.zero3_prefetch_layers) * st.layer_weights_unsharded if zero3 else 0)
    fwd.add_peak(block.forward_peak)
    logits = _Phase("logits", weights=st.weights_device, activations=inputs, kv_cache=kv,
                    zero3_gathered_params=st.output_weights_unsharded if zero3 else 0)
    logits.add_peak(head.forward_peak)
    return [fwd, logits]
