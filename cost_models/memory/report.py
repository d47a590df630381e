"""The memory model's result types (pydantic, bytes throughout, per GPU unless named host)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Components the caching allocator hands out; their sum at the peak phase is ``peak_allocated``.
ALLOCATED_COMPONENTS: tuple[str, ...] = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "logits",
    "kv_cache",
    "buffers",
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MemoryBreakdown(_Frozen):
    """Device memory at the peak phase. ``total`` = peak_allocated + overhead is compared with capacity."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    buffers: int = Field(description="Communication staging, ZeRO-3 gathered parameters, unsharded gradients.")
    overhead: int = Field(description="CUDA context + NCCL communicators + caching-allocator fragmentation.")
    total: int = Field(description="What the device must hold: peak_allocated + overhead (fits = total <= capacity).")
    peak_allocated: int
    capacity: int
    device_used: int = Field(default=0, description=(
        "What NVML / nvidia-smi shows at the peak: total + blocks the caching allocator keeps cached at its "
        "high-water mark but would hand back before failing an allocation (allocator replay modes)."))


class HostMemory(_Frozen):
    """Host (CPU) memory per GPU's process for what was offloaded."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    checkpoints: int = 0
    total: int = 0


class PhaseMemory(_Frozen):
    """Allocated device bytes at the worst moment of one phase of the step."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    buffers: int
    allocated: int
    transient_peak_at: str = Field(description="The op inside the phase where the live set is largest.")


class LayerActivations(_Frozen):
    checkpointing: str
    saved_bytes: int = Field(description="Per block, kept on the device between its forward and backward.")
    offloaded_bytes: int = Field(description="Per block, moved to host memory (offload_checkpoints).")
    saved_tensors: dict[str, int] = Field(description="What the block keeps for backward, by tensor.")
    saved_bytes_by_mode: dict[str, int] = Field(description="Per-block saved bytes under each checkpointing mode.")
    forward_peak_bytes: int = Field(description="Live bytes inside one block's forward, its input included.")
    forward_peak_at: str
    backward_peak_bytes: int = Field(description="Live bytes inside one block's recompute + backward.")
    backward_peak_at: str


class OutputLayerMemory(_Frozen):
    saved_bytes: int
    retained_logits_bytes: int = Field(description="bf16 logits the caller keeps until the step ends.")
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_at: str


class UlyssesShapes(_Frozen):
    """Q/K/V bytes per GPU around the Ulysses all-to-all (DESIGN.md section 4)."""

    degree: int
    q_bytes_before: int
    k_bytes_before: int
    v_bytes_before: int
    q_bytes_after: int
    k_bytes_after: int
    v_bytes_after: int
    q_heads_after: int
    kv_heads_before: int
    kv_heads_after: int
    kv_replication: int
    tokens_before: int
    tokens_after: int


class CommunicatorInfo(_Frozen):
    name: str
    dims: list[str]
    size: int
    bytes: int = Field(default=0, description="Device bytes NCCL holds for this communicator.")


class OverheadDetail(_Frozen):
    cuda_context: int
    nccl: int
    nccl_bytes_per_communicator: int
    communicators: list[CommunicatorInfo]
    fragmentation: int = Field(description="Caching-allocator reserve above the allocated peak it cannot give back.")
    cached_reserve: int = Field(default=0, description=(
        "Reserve at the allocator's high-water mark that it hands back under memory pressure (expandable "
        "segments' holes, other streams' free blocks)."))
    peak_reserved: int = Field(description="torch.cuda.max_memory_reserved(): peak allocated + fragmentation.")
    allocator: str = Field(default="fraction", description="The allocator model behind `fragmentation`.")


class BufferDetail(_Frozen):
    comm_staging: int
    zero3_gathered_params: int
    unsharded_grads: int
    kernel_workspaces: int = Field(default=0, description="cuBLAS workspaces allocated through the allocator.")


class StatesDetail(_Frozen):
    params_per_tp_rank: int
    params_per_layer_per_tp_rank: int
    shard_group: int
    bytes_per_param: dict[str, int]
    optimizer_on_device: bool


class PipelineMemory(_Frozen):
    """Per-stage memory of a pipeline (the reported figures are the worst stage's)."""

    stage: int = Field(description="Index of the stage the memory figures are for (0 = first).")
    stage_layers: list[int] = Field(description="Layers of every stage, first to last.")
    in_flight_microbatches: list[float] = Field(description="Micro-batches whose activations each stage holds.")
    stage_totals: list[int] = Field(description="Device bytes of every stage, first to last.")


class MemoryDetail(_Frozen):
    mode: str
    tokens_per_gpu: int
    peak_phase: str
    phases: dict[str, PhaseMemory]
    per_layer: LayerActivations
    output_layer: OutputLayerMemory
    inputs_bytes: int = Field(description="Token ids, labels, position ids and RoPE tables on the device.")
    kv_cache_per_layer: int
    ulysses: UlyssesShapes
    buffers: BufferDetail
    overhead: OverheadDetail
    states: StatesDetail
    row_kernel_offset: int = Field(default=0, description=(
        "Largest element offset (row x row stride) at which the stack's Triton row kernels (fused norms, "
        "in-place RoPE) start a row on this GPU."))
    row_kernel_offset_limit: int | None = Field(default=None, description=(
        "The most those kernels can address (2^31 - 1 for int32 row offsets), None if unbounded; "
        "beyond it `fits` is false whatever the memory."))
    assumptions: dict
    pipeline: PipelineMemory | None = Field(default=None, description=(
        "With pp > 1: the stage these figures are for (the largest) and every stage's device total."))


class MemoryReport(_Frozen):
    memory: MemoryBreakdown
    host_memory: HostMemory
    fits: bool = Field(description="total <= capacity, and the stack's kernels can address the slice "
                                   "(detail.row_kernel_offset <= detail.row_kernel_offset_limit).")
    detail: MemoryDetail
