"""Software-stack profiles: what the framework that runs a plan does to memory and time.

The same layout costs different bytes and seconds under different training stacks: HF transformers +
DeepSpeed ZeRO-3 keeps gathered-parameter and gradient buckets of its own size, copies tensors around
its all-to-all and runs Python hooks per parameter; torchtitan's FSDP2 + torch context parallel keeps
per-block gathers and a fused optimizer; this project's runtime saves exactly what its tests measure.
A planner that assumes one of them while the user runs another answers wrongly (an exported DeepSpeed
plan that fits under sp-plan's runtime may not fit under DeepSpeed).

A stack profile is data, not code: a YAML file in ``cost_models/data/stacks/`` (or any path) with

- ``memory``: values for :class:`~sp_plan.cost_models.memory.assumptions.MemoryAssumptions` fields (every
  field not given keeps its default, which describes this project's runtime);
- ``time``: values for :class:`StackTime` (framework overheads and kernel choices that are properties
  of the software, not of the GPU; GPU kernel efficiencies live in ``cost_models/data/kernels/``).

Every value in a shipped profile carries a comment saying where it comes from.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import data, degrees
from .errors import explain_validation_error
from .fitted import fitted_parameters
from .layout import Layout
from .memory.assumptions import MemoryAssumptions
from .model_spec import ModelSpec
from .pipeline import first_even_last_split
from .yaml_io import parse_mapping, validated

#: The stack every command uses unless told otherwise: this project's runtime.
DEFAULT_STACK = "sp-plan"
#: A stack file larger than this is not a stack file (the bound every user data file has).
MAX_STACK_FILE_BYTES = data.MAX_USER_FILE_BYTES


#: Attention kernel families a stack may name: the kernel files' entries (fa2, fa3, cudnn; a GPU without its
#: own entry for one is priced as fa2) and torch SDPA. Any other name is a typo that would silently price fa2.
ATTENTION_KERNELS = ("fa2", "fa3", "cudnn", "sdpa")


class StackTime(BaseModel):
    """Time-model properties of a software stack (not of the GPU).

    Kernel efficiencies of the GPU itself (GEMM and attention fractions of peak, their shape
    dependence, launch costs) are per-GPU data (:mod:`sp_plan.cost_models.kernels`); the fields here scale or
    add to them where a stack's choice of kernels and its host-side work differ.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    attention_kernel: str = Field(
        default="fa2",
        max_length=40,
        description=(
            "Which attention kernel family the stack runs ('fa2', 'fa3', 'cudnn', 'sdpa'): selects the "
            "attention efficiency entry of the GPU's kernel file (falling back to 'fa2' where the GPU "
            "has no entry for it)."
        ),
    )
    attention_kernel_by_gpu: dict[str, str] = Field(
        default_factory=dict,
        max_length=32,
        description=(
            "Where the stack runs another attention kernel on some GPUs: GPU variant (a GPU preset name) or "
            "kernel family (kernel file name: h100, b200, ...) -> kernel family ('fa2', 'fa3', 'cudnn'); a "
            "variant's entry wins over its family's, and GPUs not listed run ``attention_kernel``. E.g. "
            "torch SDPA's fixed priority puts its FlashAttention-2-based flash backend first on Hopper, while "
            "torchtitan selects the cuDNN backend on Blackwell."
        ),
    )
    @field_validator("attention_kernel")
    @classmethod
    def _known_kernel(cls, value: str) -> str:
        if value not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {value!r} is not one sp-plan prices; use one of "
                             f"{', '.join(ATTENTION_KERNELS)}")
        return value

    @field_validator("attention_kernel_by_gpu")
    @classmethod
    def _known_kernels_by_gpu(cls, value: dict[str, str]) -> dict[str, str]:
        for kernel in value.values():
            cls._known_kernel(kernel)
        return value

    checkpoint_offload_recomputes: bool = Field(
        default=True,
        description=(
            "With checkpointed activations offloaded to the host (TrainSpec.offload_checkpoints): True when "
            "the stack offloads the checkpoints and still recomputes each layer in backward (ALST's "
            "CheckpointFunctionWithCPUOffload, sp-plan's runtime); False when it keeps every saved activation "
            "and moves it to the host instead of recomputing (torch.autograd.graph.save_on_cpu, Accelerate's "
            "activation offloading): no recompute, but all saved activations cross PCIe."
        ),
    )
    layer_overhead_s: float = Field(
        default=0.0,
        ge=0,
        le=1.0,
        description=(
            "Host-side framework time per transformer layer per pass (forward, backward, recompute) "
            "that the GPU waits for: Python hooks, parameter bookkeeping, launch gaps. DeepSpeed "
            "ZeRO-3's per-parameter fetch/release hooks cost far more than FSDP2's per-block ones."
        ),
    )
    compute_overhead_fraction: float = Field(
        default=0.0,
        ge=0,
        le=3.0,
        description=(
            "Extra GPU time per unit of kernel time that the stack's execution adds around the kernels of a "
            "layer and of the output layer (launch gaps, host synchronisation, allocator stalls, unfused "
            "glue kernels the model does not list): a system-level quantity fitted per stack from "
            "end-to-end runs, never folded into a kernel efficiency (issue 21)."
        ),
    )
    step_overhead_s: float = Field(
        default=0.0,
        ge=0,
        le=600.0,
        description="Fixed time per optimizer step outside the layers (engine bookkeeping, data loading).",
    )
    alltoall_copy_passes: float = Field(
        default=0.0,
        ge=0,
        le=8,
        description=(
            "Memory-bound passes over each Ulysses all-to-all buffer besides the collective itself "
            "(packing into a contiguous send buffer, transposing the received heads back): each pass "
            "reads and writes the buffer once at HBM speed."
        ),
    )
    ring_merge_bytes_per_element: float = Field(
        default=22.0,
        ge=0,
        le=256,
        description=(
            "HBM bytes one ring-attention step's LSE merge moves per output element (forward). This "
            "runtime's merge_into works in place on a bf16 block and fp32 accumulator: zero the block's "
            "dead rows (2+2), scale the accumulator (4+4), addcmul the weighted block (4+2+4): 22 B; an "
            "eager merge with temporaries, torch context parallel's _SDPAMerger (cast, subtract, "
            "sigmoid-weight, subtract), ~38 B; a fused merge kernel (TransformerEngine, ring-flash-attn's "
            "TorchScript one) reads the block and reads/writes the accumulator: ~10-12 B."
        ),
    )
    ring_grad_bytes_per_element: float = Field(
        default=14.0,
        ge=0,
        le=256,
        description=(
            "HBM bytes per element one ring-attention backward step moves to accumulate the block's "
            "dQ into the fp32 accumulator and dK/dV into the travelling fp32 accumulators (read the "
            "bf16 block gradient, read and write fp32: 2 + 8, plus the cast)."
        ),
    )
    cpu_optimizer_params_per_s_per_core: float = Field(
        default=2.0e7,
        gt=0,
        le=1e12,
        description=(
            "Parameters one host core updates per second in the CPU AdamW of an offloaded optimizer "
            "(the step is the slower of this and host-memory bandwidth). torch.optim.AdamW on CPU "
            "(FSDP2 CPUOffloadPolicy) manages a few 1e7 per core; DeepSpeed's vectorised cpu_adam "
            "several times that."
        ),
    )
    compiled_stream_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description=(
            "Fraction of the elementwise (norm, rotary, activation, residual) HBM traffic left when the "
            "blocks are compiled (``TrainSpec.compiled``): torch.compile fuses neighbouring "
            "elementwise kernels, so intermediate tensors are not written and re-read."
        ),
    )
    fp8_cast_passes: float = Field(
        default=2.0,
        ge=0,
        le=8,
        description=(
            "With Float8 linears (``TrainSpec.fp8_linears``): memory-bound passes over each linear's "
            "input and weight per GEMM for the dynamic-scaling amax and the cast to float8."
        ),
    )
    fp8_weight_cache: bool = Field(
        default=False,
        description=(
            "With Float8 linears: each weight is quantized once per step, on the step's first micro-batch, "
            "and the step's other micro-batches reuse that FP8 copy (Transformer Engine's weight workspace "
            "cache, which Megatron-Core enables through is_first_microbatch), so the weight casts are paid "
            "once per step rather than per micro-batch. False: every micro-batch casts the weights again."
        ),
    )
    tp_async_dgrad: bool = Field(
        default=False,
        description=(
            "The column-parallel linears' input-gradient all-reduce (reduce-scatter under sequence "
            "parallelism) runs asynchronously beside their weight-gradient GEMM, and under sequence "
            "parallelism the re-gather of their saved input shard (memory.tp_saves_gathered_input false) "
            "beside their input-gradient GEMM: Megatron-LM's --async-tensor-model-parallel-allreduce (on by "
            "default since 2021), Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication, Transformer "
            "Engine's Linear / LayerNormLinear backward. Without TP comm overlap (tp_comm_overlap) these "
            "collectives are then exposed only by what exceeds their GEMM; False: every backward TP "
            "collective is exposed."
        ),
    )
    tp_comm_overlap: Literal["none", "userbuffers", "async_tp"] = Field(
        default="none",
        description=(
            "How the stack hides sequence-parallel TP all-gathers and reduce-scatters behind the GEMMs they "
            "feed (cost_models/strategies/overlap.py prices it): 'none' (exposed), 'userbuffers' (Transformer "
            "Engine's comm+GEMM overlap, Megatron-Core --tp-comm-overlap: each collective split into chunks, "
            "a chunk's transfer running while the previous chunk's GEMM computes; Megatron asserts sequence "
            "parallelism), 'async_tp' (torch symmetric-memory micro-pipelining, torchtitan "
            "compile.enable_async_tensor_parallel: tp chunks; needs torch.compile, TrainSpec.compiled). Only "
            "with TrainSpec.tp_sequence_parallel: without it TP all-reduces stay exposed."
        ),
    )
    tp_overlap_reduce_scatter_chunks: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "Chunks an overlapped forward reduce-scatter is split into (0: the TP degree, a ring exchange). "
            "Transformer Engine runs proj_fprop and fc2_fprop with its 'pipeline' method, num_splits 4 "
            "(transformer_engine/pytorch/module/base.py get_default_config); all-gathers always use tp chunks."
        ),
    )
    tp_overlap_sm_margin: int = Field(
        default=0,
        ge=0,
        le=256,
        description=(
            "SMs an overlapped forward reduce-scatter takes from the GEMM it hides behind (Transformer "
            "Engine's 'pipeline' method: num_sm 16 with set_sm_margin, the GEMM runs on the rest); 0: the "
            "copy-engine transfers only slow the GEMM by the kernel model's nccl_compute_slowdown."
        ),
    )
    moe_dispatcher: Literal["alltoall", "deepep", "hybridep"] = Field(
        default="alltoall",
        description=(
            "How MoE tokens reach their experts across nodes. 'alltoall': one pairwise all-to-all of the "
            "permuted rows (Megatron-Core's alltoall dispatcher, NCCL): a token routed to j experts on a "
            "remote node crosses the fabric j times. 'deepep' / 'hybridep' (Megatron-Core's flex dispatcher): "
            "hierarchical kernels that send each token once per remote node over RDMA and fan it out to that "
            "node's GPUs over NVLink (DeepEP get_dispatch_layout counts num_tokens_per_rdma_rank; the combine "
            "reduces on the expert node before sending back), so fewer bytes cross nodes; the same within a node."
        ),
    )
    moe_a2a_overlap: bool = Field(
        default=False,
        description=(
            "Whether the MoE dispatch/combine all-to-alls of one micro-batch run while another micro-batch's "
            "layer computes (Megatron-Core --overlap-moe-expert-parallel-comm, the combined 1F1B schedule: "
            "combine-backward behind the other's attention forward, dispatch forward + backward behind the "
            "expert MLPs' backward and forward, combine-forward behind attention backward). Needs ep > 1, "
            "two micro-batches per step and no full recompute (transformer_config.py asserts); the first "
            "forward and last backward of a step (and a pipeline's warm-up and cool-down) run alone."
        ),
    )

    moe_host_sync_s: float = Field(
        default=0.0,
        ge=0,
        le=0.1,
        description=(
            "GPU idle per MoE layer pass (one micro-batch's forward and backward through one MoE layer) beyond "
            "layer_overhead_s: a dropless dispatcher copies the token counts to the host and waits for them "
            "every MoE layer (Megatron-Core's alltoall dispatcher _maybe_dtoh_and_synchronize, Hybrid-EP's "
            "tokens_per_expert.sum() when no upper bound is set, DeepEP's CPU wait for the receive counts), "
            "so the GPU drains and then waits while Python launches the layer's next kernels. Priced with "
            "ep > 1 in training when no other micro-batch's work fills the gap (moe_a2a_overlap off or not "
            "running; with it, only the unpaired passes) and the MoE layer is not in a CUDA graph "
            "(cuda_graph_scope without 'moe' or 'full_iteration'); cost_models/strategies/moe_host.py."
        ),
    )
    cuda_graph_scope: tuple[Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "full_iteration"], ...] = Field(
        default=(),
        max_length=6,
        description=(
            "What the stack captures in CUDA graphs (Megatron-Core --cuda-graph-impl transformer_engine with "
            "--cuda-graph-scope, or local full_iteration); empty: none (Megatron-Core's default "
            "cuda_graph_impl none). Only 'moe' (a static-shape, drop-and-pad MoE layer) and 'full_iteration' "
            "(sync-free MoE) take the MoE layer's host synchronisation off the step (moe_host_sync_s); the "
            "partial scopes of dropless recipes (attn, moe_router, moe_preprocess) leave it, as the published "
            "measurements do not separate them (docs/accuracy.md)."
        ),
    )


#: TrainSpec options the planner searches over (:mod:`sp_plan.planner.options`) and the values each may take;
#: a stack's ``search.options`` narrows these to what the stack can run.
SEARCHABLE_OPTIONS: dict[str, tuple[Any, ...]] = {
    "zero_stage": (0, 1, 2, 3),
    "checkpointing": ("none", "selective", "full"),
    "offload_checkpoints": (False, True),
    "tiled_loss": (False, True),
    "tiled_mlp": (False, True),
    "offload_optimizer": (False, True),
    "offload_params": (False, True),
    "pipeline_schedule": ("zero_bubble", "interleaved_1f1b", "1f1b"),
}


class StackSearch(BaseModel):
    """What a stack can run, so that the planner proposes only plans the stack can launch.

    A plan that needs a technique the stack does not have (DeepSpeed-style tiling under Megatron-Core,
    parameter offload where the stack has none) is not a plan for that stack, however fast it would be.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    options: dict[str, tuple[Any, ...]] = Field(
        default_factory=dict,
        description=(
            "Training options the stack can run: option -> its values, fastest first (the planner's lattice "
            "order); options not listed keep every value. E.g. Megatron-Core's distributed optimizer is "
            "ZeRO-1 only: zero_stage: [1]."
        ),
    )
    kv_head_replication: bool = Field(
        default=True,
        description=(
            "Whether the stack's Ulysses all-to-all runs degrees larger than the KV heads a TP rank holds by "
            "replicating KV heads. False (Megatron-Core with Transformer Engine: its a2a context parallelism "
            "asserts num_heads % cp_size == 0 for Q, K and V): the KV heads per TP rank (one when TP itself "
            "replicates them, tp > KV heads) must divide by the Ulysses degree."
        ),
    )

    @field_validator("options")
    @classmethod
    def _known_values(cls, options: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        for name, values in options.items():
            if name not in SEARCHABLE_OPTIONS:
                raise ValueError(f"unknown option {name!r}: one of {', '.join(SEARCHABLE_OPTIONS)}")
            allowed = SEARCHABLE_OPTIONS[name]
            bad = [v for v in values if v not in allowed or type(v) is not type(allowed[0])]
            if not values or bad or len(set(values)) != len(values):
                raise ValueError(f"option {name} takes distinct values among {list(allowed)}, got {list(values)}")
        return options

    unsupported_degrees: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Parallel dimensions the stack has no implementation of -> why (the degree must stay 1): e.g. "
            "torch context parallel is ring attention only, so FSDP2 stacks list ulysses."
        ),
    )

    @field_validator("unsupported_degrees")
    @classmethod
    def _known_dimensions(cls, unsupported: dict[str, str]) -> dict[str, str]:
        known = (*degrees.registered(), "ep")  # the layout's degrees, and expert parallelism (a Layout field)
        for dim, why in unsupported.items():
            if dim not in known:
                raise ValueError(f"unknown parallel dimension {dim!r}: one of {', '.join(known)}")
            if not why.strip():
                raise ValueError(f"unsupported_degrees.{dim}: say why the stack cannot run it")
        return unsupported

    cp_chunks_per_rank: int = Field(
        default=1,
        ge=1,
        le=8,
        description=(
            "Chunks each context-parallel (ulysses x ring) rank's share of a sequence is cut into, whatever "
            "the CP kind: Megatron-Core load-balances causal attention by cutting every sequence into 2 x CP "
            "chunks for p2p, a2a and a2a+p2p alike (get_batch_on_this_cp_rank), so the sequence must divide "
            "by 2 x CP even without ring."
        ),
    )

    stage_split: Literal["balanced", "first_even_last"] = Field(
        default="balanced",
        description=(
            "How the stack splits layers over pipeline stages when the plan pins no split: 'balanced' (any "
            "split; sp-plan's runtime builds stages from the plan's list) or 'first_even_last' (Megatron-LM: "
            "only the first and last stages' layers are settable, the middle is split evenly, and with virtual "
            "stages every stage is a multiple of the chunks). Plans under the stack carry the split it runs."
        ),
    )

    def stage_split_refusal(self, num_layers: int, pp: int, virtual_stages: int) -> str | None:
        """Why no split of the stack's form exists for these stages and chunks, or None."""
        if pp == 1 or self.stage_split == "balanced" or first_even_last_split(num_layers, pp, virtual_stages, 0.0):
            return None
        return (f"no split of {num_layers} layers over pp={pp} with {virtual_stages} chunks per stage has an even "
                "middle with every stage a multiple of the chunks, or every stage the same with the embedding and "
                "the loss counted as a layer each (what this stack can express)")

    def refusal(self, model: ModelSpec, layout: Layout, seq_len: int) -> str | None:
        """Why the stack cannot run ``layout`` for ``model`` at ``seq_len`` tokens, or None when it can."""
        for dim, why in self.unsupported_degrees.items():
            if getattr(layout, dim) > 1:
                return f"{dim}={getattr(layout, dim)}: {why}"
        cp = layout.ulysses * layout.ring
        if cp > 1 and seq_len % (self.cp_chunks_per_rank * cp):
            return (f"sequence {seq_len} does not divide into {self.cp_chunks_per_rank} x {cp} chunks (this "
                    "stack's load-balanced context parallelism); pad the sequence")
        if self.kv_head_replication:
            return None
        kv_per_rank = max(1, model.num_kv_heads // layout.tp)
        if kv_per_rank % layout.ulysses:
            return (f"ulysses={layout.ulysses} does not divide the {kv_per_rank} KV heads per TP rank (this stack's "
                    "all-to-all over heads needs Q, K and V heads divisible by its degree); move the extra degree "
                    "to ring")
        return None


def attention_kernel_for(time: StackTime, gpu: str, family: str) -> str:
    """The attention kernel family a stack runs on a GPU variant of a kernel family."""
    by_gpu = time.attention_kernel_by_gpu
    return by_gpu.get(gpu) or by_gpu.get(family) or time.attention_kernel


class StackProfile(BaseModel):
    """A named, documented set of memory assumptions and time properties of one training stack."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    #: Other names of a shipped stack (``--stack megatron`` for ``megatron-core``): see
    #: :func:`sp_plan.cost_models.data.resolve`.
    aliases: tuple[str, ...] = Field(default=(), max_length=20)
    description: str = Field(default="", max_length=4000)
    references: tuple[str, ...] = Field(default=(), max_length=50)
    memory: MemoryAssumptions = MemoryAssumptions()
    time: StackTime = StackTime()
    search: StackSearch = StackSearch()

    @model_validator(mode="after")
    def _memory_follows_offload_semantics(self) -> "StackProfile":
        """The memory model's ``checkpoint_offload_keeps_activations`` is the time section's
        ``checkpoint_offload_recomputes`` negated: one switch decides what the offload moves (PCIe time) and
        what the host then holds (host memory), so the two models cannot disagree."""
        synced = synced_memory(self.memory, self.time)
        if synced is not self.memory:
            if "checkpoint_offload_keeps_activations" in self.memory.model_fields_set:
                raise ValueError(
                    "memory.checkpoint_offload_keeps_activations follows time.checkpoint_offload_recomputes (it is "
                    f"its negation, {not self.time.checkpoint_offload_recomputes} here); drop it and set "
                    "time.checkpoint_offload_recomputes instead")
            object.__setattr__(self, "memory", synced)  # frozen: set once, while validating
        return self

    def with_overrides(self, memory: dict[str, Any] | None = None, time: dict[str, Any] | None = None,
                       name: str | None = None) -> "StackProfile":
        """This profile with some memory/time fields replaced (validated like a file)."""
        try:
            mem = MemoryAssumptions(**{**self.memory.model_dump(), **(memory or {})})
            tim = StackTime(**{**self.time.model_dump(), **(time or {})})
        except ValidationError as exc:
            raise explain_validation_error(exc, f"overrides of stack {self.name}") from exc
        return self.model_copy(update={"memory": synced_memory(mem, tim), "time": tim, "name": name or self.name})


def synced_memory(memory: MemoryAssumptions, time: StackTime) -> MemoryAssumptions:
    """``memory`` with the checkpoint-offload semantics of ``time`` (see StackProfile)."""
    keeps = not time.checkpoint_offload_recomputes
    if memory.checkpoint_offload_keeps_activations == keeps:
        return memory
    return memory.model_copy(update={"checkpoint_offload_keeps_activations": keeps})


def stack_names() -> tuple[str, ...]:
    """Shipped stack profiles (``cost_models/data/stacks/<name>.yaml``), by name."""
    return data.names("stacks")


def shipped_stack_name(ref: str) -> str | None:
    """The shipped stack a name or alias means (``megatron`` -> ``megatron-core``), or None for a file or an
    unknown name."""
    return data.canonical("stacks", ref)


def parse_stack(text: str, origin: str) -> StackProfile:
    """A stack profile from YAML text (``origin`` names the file in error messages)."""
    what = f"stack file {origin}"
    return validated(StackProfile, parse_mapping(text, what, "name, memory and time sections"), what)


@cache
def prior_stack(name: str) -> StackProfile:
    """A shipped stack file as written (documented priors, no fitted values)."""
    return parse_stack(data.read_text("stacks", name), f"{name}.yaml")


@cache
def _shipped(name: str) -> StackProfile:
    """A shipped stack with the time values fitted to published runs (cost_models/data/calibration/
    fitted.yaml) applied."""
    prior = prior_stack(name)
    values = fitted_parameters().stacks.get(name)
    return prior.with_overrides(time=values) if values else prior


def load_stack(ref: str | Path | None = None) -> StackProfile:
    """A shipped profile by name (``sp-plan``, ``hf-deepspeed``, ``torchtitan``) or a YAML file path (which
    one is :func:`sp_plan.cost_models.data.resolve`'s rule); None gives the default stack."""
    if ref is None:
        return _shipped(DEFAULT_STACK)
    found = data.resolve("stacks", ref)
    if found.name is not None:
        return _shipped(found.name)
    return parse_stack(data.read_user_text("stacks", found.path), str(found.path))


__all__ = ["DEFAULT_STACK", "SEARCHABLE_OPTIONS", "StackProfile", "StackSearch", "StackTime", "attention_kernel_for", "load_stack",
           "parse_stack", "prior_stack", "shipped_stack_name", "stack_names"]
