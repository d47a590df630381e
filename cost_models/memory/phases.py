"""The phases of a step (:mod:`sp_plan.cost_models.memory.timeline` lists them): what each holds of the
model states, the activations, the ZeRO buffers and the transient peak of the graph running in it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..model_spec import ModelSpec
from ..pipeline import StageView
from ..train_spec import TrainSpec
from .assumptions import MemoryAssumptions
from .liveness import GraphMemory, Peak
from .report import ALLOCATED_COMPONENTS, PhaseMemory
from .states import ModelStates, block_matrices


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
    kernel_workspaces: int = 0
    at: str = ""
    graph: str = ""
    """Which simulated sequence holds this phase's transient peak (for the allocator replay):
    'block_forward', 'block_backward', 'head' or '' (none)."""

    @property
    def buffers(self) -> int:
        return self.comm_staging + self.zero3_gathered_params + self.unsharded_grads + self.kernel_workspaces

    @property
    def allocated(self) -> int:
        # Spelled out (the sum over ALLOCATED_COMPONENTS, which a test keeps in step): the planner
        # reads this tens of thousands of times per search.
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.kv_cache
                + self.comm_staging + self.zero3_gathered_params + self.unsharded_grads + self.kernel_workspaces)

    def add_peak(self, peak: Peak, graph: str = "") -> None:
        self.activations += peak.by_kind["activation"]
        self.logits += peak.by_kind["logits"]
        self.comm_staging += peak.by_kind["comm"]
        self.kv_cache += peak.by_kind["kv_cache"]
        self.unsharded_grads += peak.by_kind["grads"]
        self.at = peak.at
        self.graph = graph

    def to_model(self) -> PhaseMemory:
        return PhaseMemory(**{c: getattr(self, c) for c in ALLOCATED_COMPONENTS}, allocated=self.allocated,
                           transient_peak_at=self.at)


def _larger(a: Peak, b: Peak | None) -> Peak:
    return a if b is None or a.total >= b.total else b


def _zero3_gathered(model: ModelSpec, st: ModelStates, a: MemoryAssumptions, tp: int) -> tuple[int, int, int]:
    """Gathered ZeRO-3 parameters (bytes) in (a block's phases, the first block's backward, the loss).

    FSDP2 (``zero3_prefetch_params`` None): the block computing plus ``zero3_prefetch_layers`` blocks;
    the output matrix plus the prefetched blocks in the loss. DeepSpeed: the block computing (kept
    gathered between its recompute and its backward by stage3_max_reuse_distance) plus what the
    prefetcher fetches ahead: stage3_prefetch_bucket_size elements, at least the next parameter whole
    (a block's largest matrix; the input embedding while the first block runs backward, the trace's
    last module).
    """
    if st.zero_stage != 3:
        return 0, 0, 0
    w, p = st.per_param.weights, st.params
    if a.zero3_prefetch_params is None:
        block = (1 + a.zero3_prefetch_layers) * p.per_layer * w
        return block, block, (p.output_matrix + a.zero3_prefetch_layers * p.per_layer) * w
    ahead = min(p.per_layer, max(a.zero3_prefetch_params, block_matrices(model, tp).largest))
    return (p.per_layer + ahead) * w, (p.per_layer + p.embedding) * w, (p.output_matrix + ahead) * w


def _unsharded_grads(model: ModelSpec, st: ModelStates, a: MemoryAssumptions, tp: int) -> tuple[int, int]:
    """ZeRO gradient buffers (bytes): (persistent through the step, during a block's backward).

    FSDP2 (``zero_reduce_bucket_params`` None): ``unsharded_grad_layers`` blocks of unsharded gradients
    in backward. DeepSpeed: the contiguous IPG bucket exists from initialisation; in backward the
    reduction's flat copy comes on top (``zero_reduce_bucket_copies``) and the gradient a parameter just
    produced (up to the block's largest matrix) until it is copied into the bucket.
    """
    g = st.per_param.gradients
    if a.zero_reduce_bucket_params is None:
        return 0, a.unsharded_grad_layers * st.layer_grads_unsharded if st.zero_stage >= 2 else 0
    if st.zero_stage < 1:
        return 0, 0
    # DeepSpeed stage 1 reduces through the same IPG bucket at the accumulation boundary (stage_1_and_2.py);
    # its full gradients are counted as gradients.
    bucket = a.zero_reduce_bucket_params * g
    persistent = int(min(1.0, a.zero_reduce_bucket_copies) * bucket)
    return persistent, int(a.zero_reduce_bucket_copies * bucket) + block_matrices(model, tp).largest * g


class _TrainBuffers(NamedTuple):
    """What every training phase holds besides the model states: one block's saved activations on the device
    (``saved``), other blocks' (and, with pipeline stages, other micro-batches') activations in flight, the
    gathered ZeRO-3 parameters in a block's phases, the first block's backward and the loss, the gradient
    bucket and the unsharded gradients of a block's backward."""

    saved: int
    in_flight: int
    gathered_block: int
    gathered_first: int
    gathered_loss: int
    bucket: int
    unsharded: int


def _train_buffers(model: ModelSpec, st: ModelStates, a: MemoryAssumptions, block: GraphMemory, inputs: int,
                   offloaded: int, stage: StageView | None, L: int) -> _TrainBuffers:
    tp = st.tp
    saved = block.saved["activation"] - offloaded  # per block, on the device
    in_flight = (a.checkpoint_offload_in_flight - 1) * offloaded  # other blocks' inputs being moved
    gathered_block, gathered_first, gathered_loss = _zero3_gathered(model, st, a, tp)
    bucket, unsharded = _unsharded_grads(model, st, a, tp)
    if stage is not None:
        # --- pipeline stage: other micro-batches' stashed activations; FSDP held unsharded (see _stage_buffers)
        in_flight += _stashed_microbatches(stage, L * saved + inputs)
        gathered_block, gathered_first, gathered_loss, bucket, unsharded = _stage_buffers(
            st, (gathered_block, gathered_first, gathered_loss, bucket, unsharded))
    return _TrainBuffers(saved, in_flight, gathered_block, gathered_first, gathered_loss, bucket, unsharded)


def _train_phases(model: ModelSpec, train: TrainSpec, a: MemoryAssumptions, st: ModelStates, block: GraphMemory,
                  head: GraphMemory, inputs: int, offloaded: int, stage: StageView | None = None) -> list[_Phase]:
    """The training step's phases (see the module docstring): forward, loss (on the stage with the output
    layer), the last and the first block's backward, the optimizer step."""
    L = model.num_layers if stage is None else stage.layers
    p = st.params
    saved, in_flight, gathered_block, gathered_first, gathered_loss, bucket, unsharded = _train_buffers(
        model, st, a, block, inputs, offloaded, stage, L)
    grads_all = st.grads_device(p.total)
    persistent = grads_all if (train.grad_accum > 1 or not a.grads_freed_between_steps) else 0
    head_params = p.head + (p.vocab_matrix if model.tied_embeddings else 0)  # tied: lm_head grads land there
    # Stage 0/1 keep full gradients, allocated as backward produces them (the block in progress
    # included); stage 2/3 keep shards, the block in progress is an unsharded buffer.
    in_progress = p.per_layer if st.zero_stage < 2 else 0
    ws = a.cublas_workspace_bytes

    def grads(params_done: int) -> int:
        return max(persistent, st.grads_device(params_done))

    def phase(name: str, **values: int) -> _Phase:
        return _Phase(name, weights=st.weights_device, optimizer=st.optimizer_device, kernel_workspaces=ws, **values)

    fwd = phase("forward", gradients=persistent, activations=inputs + (L - 1) * saved + in_flight,
                zero3_gathered_params=gathered_block, unsharded_grads=bucket)
    fwd.add_peak(block.forward_peak, "block_forward")

    head_peak = _larger(head.forward_peak, head.backward_peak)
    # A tiled loss accumulates the output matrix's gradient chunk by chunk inside the op; the untiled
    # loss produces it in lm_head's backward, after the log-softmax backward peak.
    head_grads_during = train.tiled_loss
    loss = phase(
        "loss",
        gradients=grads(head_params) if head_grads_during else persistent,
        activations=inputs + L * saved + in_flight,
        zero3_gathered_params=gathered_loss,
        unsharded_grads=bucket + (st.output_grads_unsharded if st.zero_stage >= 2 and head_grads_during else 0),
    )
    loss.add_peak(head_peak, "head")

    kept_logits = head.retained["logits"]
    if stage is not None and not stage.last:  # no output layer on this stage: its boundary sends the activation
        loss, kept_logits = None, 0
    last = phase("backward (last block)", gradients=grads(head_params + in_progress),
                 activations=inputs + (L - 1) * saved + in_flight, logits=kept_logits,
                 zero3_gathered_params=gathered_block, unsharded_grads=unsharded)
    last.add_peak(block.backward_peak, "block_backward")
    # The first block is the last one backward runs: no other block's input is prefetched behind it.
    first = phase("backward (first block)", gradients=grads(head_params + (L - 1) * p.per_layer + in_progress),
                  activations=inputs, logits=kept_logits,
                  zero3_gathered_params=gathered_first, unsharded_grads=unsharded)
    first.add_peak(block.backward_peak, "block_backward")

    step_temps = int(st.optimizer_step_params * a.optimizer_step_temp_bytes_per_param)
    opt = _Phase("optimizer step", weights=st.weights_device, gradients=grads_all,
                 optimizer=st.optimizer_device + step_temps, logits=kept_logits, unsharded_grads=bucket,
                 kernel_workspaces=ws, at="optimizer.step")
    return [fwd, loss, last, first, opt] if loss is not None else [fwd, last, first, opt]


def _stashed_microbatches(stage: StageView, per_microbatch: int) -> int:
    """Saved activations of the other micro-batches a pipeline stage holds while it works on one: in-flight
    count less one, each ``per_microbatch`` bytes (all the stage's blocks' saved tensors and its inputs)."""
    return int(max(0.0, stage.in_flight - 1) * per_microbatch)


def _stage_buffers(st: ModelStates, zero_buffers: tuple[int, int, int, int, int]) -> tuple[int, int, int, int, int]:
    """ZeRO-2/3 buffers of a pipeline stage: (gathered params in a block, first block, loss; gradient bucket,
    unsharded grads). torch.distributed.pipelining drives FSDP2 as torchtitan configures it: no reshard
    after forward under PP, no reshard after backward and no gradient reduce-scatter until the last
    micro-batch (``PipelineStage`` sets ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)`` and reduces in ``perform_reduce_grad``), because the stage's
    micro-batches interleave forwards and backwards. So the stage's parameters stay gathered and its
    gradients unsharded for the whole step; optimizer states stay sharded."""
    if st.zero_stage < 2 or st.shard_group == 1:
        return zero_buffers
    gathered = st.params.total * st.per_param.weights if st.zero_stage == 3 else 0
    grads = st.params.total * st.per_param.gradients
    return gathered, gathered, gathered, grads, grads


def _prefill_phases(model: ModelSpec, a: MemoryAssumptions, st: ModelStates, block: GraphMemory, head: GraphMemory,
                    inputs: int, kv_per_layer: int) -> list[_Phase]:
    kv = model.num_layers * kv_per_layer  # preallocated for the whole sequence and every layer
    zero3 = st.zero_stage == 3
    gathered_block = _zero3_gathered(model, st, a, st.tp)[0]
    fwd = _Phase("forward", weights=st.weights_device, activations=inputs, kv_cache=kv,
                 zero3_gathered_params=gathered_block, kernel_workspaces=a.cublas_workspace_bytes)
    fwd.add_peak(block.forward_peak, "block_forward")
    logits = _Phase("logits", weights=st.weights_device, activations=inputs, kv_cache=kv,
                    zero3_gathered_params=st.output_weights_unsharded if zero3 else 0,
                    kernel_workspaces=a.cublas_workspace_bytes)
    logits.add_peak(head.forward_peak, "head")
    return [fwd, logits]
