"""Every assumption the memory model makes, in one validated, documented place.

Memory figures depend on implementation choices that no architecture description fixes: what a norm
kernel saves, whether the MLP is eager or fused, how many parameter layers FSDP keeps gathered, what a
CUDA context and an NCCL communicator cost. Each such choice is a field here with a default that
matches the runtime this project ships (and the mainstream PyTorch stack: HF transformers, torchtitan,
FSDP2, flash-attention), and a description of why. A user, or a calibration file written after
measuring a real run, changes them without touching code::

    MemoryAssumptions(nccl_bytes_per_communicator=1 << 30, fragmentation_fraction=0.15)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..units import MiB

SelectivePolicy = Literal["attention_outputs", "attention_core_recompute"]
MLPImplementation = Literal["eager", "fused_swiglu"]
NormImplementation = Literal["fused", "eager"]


class MemoryAssumptions(BaseModel):
    """Implementation choices and hardware constants behind the per-GPU memory model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # ----- what the transformer block saves for backward ------------------------------------------
    selective_policy: SelectivePolicy = Field(
        default="attention_outputs",
        description=(
            "What `checkpointing=selective` keeps. 'attention_outputs' (the project's definition, "
            "DESIGN.md): the block input plus the outputs of the attention op (output and LSE; under "
            "Ulysses also the result of the output all-to-all); norms, projections, RoPE and the MLP are "
            "recomputed in backward, the attention kernel is not. 'attention_core_recompute': "
            "Megatron-LM's selective recompute (Korthikanti et al. 2022): keep everything except the "
            "tensors saved inside core attention (QK^T, softmax, dropout, PV), which are recomputed; "
            "with a flash kernel that saves nothing beyond 'none'."
        ),
    )
    mlp_implementation: MLPImplementation = Field(
        default="eager",
        description=(
            "SwiGLU MLP. 'eager' (HF transformers, torchtitan, this project's runtime): "
            "down(silu(gate(x)) * up(x)) saves gate, silu(gate), up and their product: 4 x ffn values "
            "per token (8 x ffn bytes in bf16). 'fused_swiglu' (a fused silu-mul kernel such as "
            "Liger's): saves gate, up and the product: 3 x ffn values per token."
        ),
    )
    norm_implementation: NormImplementation = Field(
        default="fused",
        description=(
            "RMSNorm/LayerNorm. 'fused' (this project's runtime, Apex, TransformerEngine, Liger): saves "
            "its input in the compute dtype plus fp32 statistics (rstd; mean and rstd for LayerNorm). "
            "'eager' (HF LlamaRMSNorm written in torch ops): saves the fp32 upcast of its input, the "
            "normalised bf16 tensor and fp32 rstd, i.e. 6 bytes per element instead of 2."
        ),
    )
    materialized_softmax_fp32: bool = Field(
        default=False,
        description=(
            "Materialized attention only. False (Megatron's fused scale-mask-softmax): the softmax "
            "output is saved in the compute dtype. True (HF eager attention: softmax(..., "
            "dtype=float32).to(dtype)): the fp32 softmax output is saved and its bf16 cast too."
        ),
    )
    tp_saves_gathered_input: bool = Field(
        default=True,
        description=(
            "With TP sequence parallelism, the column-parallel linears see the all-gathered input. True "
            "(DTensor/torchtitan): autograd saves that full tensor. False (Megatron-LM): only the "
            "sequence shard is saved and re-gathered in backward."
        ),
    )
    # ----- transient buffers inside one layer ------------------------------------------------------
    flash_backward_dq_accum_fp32: bool = Field(
        default=True,
        description=(
            "FlashAttention-2/3 backward accumulates dQ in an fp32 buffer of the size of Q (plus the "
            "fp32 row statistic D = rowsum(dO * O)); both live while the attention backward runs."
        ),
    )
    flash_backward_expands_gqa: bool = Field(
        default=True,
        description=(
            "FlashAttention-2 backward with GQA computes dK and dV for every query head and sums each "
            "group afterwards, so two query-sized temporaries exist during the attention backward."
        ),
    )
    alltoall_staging_copies: float = Field(
        default=1.0,
        ge=0,
        le=4,
        description=(
            "Extra copies of a tensor that one Ulysses all-to-all needs beyond its input and output: "
            "the packed (contiguous, per-destination) send buffer. 1 for DeepSpeed-Ulysses and "
            "yunchang; 0 for an all-to-all that reads the input in place."
        ),
    )
    ring_kv_buffers: int = Field(
        default=2,
        ge=1,
        le=4,
        description=(
            "K/V blocks (and, in backward, fp32 dK/dV accumulators) a ring-attention rank holds beyond "
            "its own: the block being computed on and the one arriving (double buffering)."
        ),
    )
    # ----- output layer ----------------------------------------------------------------------------
    loss_chunk_tokens: int = Field(
        default=1024,
        ge=1,
        le=1 << 24,
        description=(
            "Tokens per chunk of the tiled/fused cross-entropy (`tiled_loss`): its working set is one "
            "chunk of logits in the compute dtype and in fp32 (the rest happens in place), "
            "~6 B x chunk x vocab/tp in bf16."
        ),
    )
    hf_keeps_logits: bool = Field(
        default=True,
        description=(
            "Untiled loss only: a HF causal-LM forward returns the bf16 logits in its output object, "
            "which the training loop holds until the step ends, so they stay allocated through "
            "backward and the optimizer step."
        ),
    )
    prefill_logits_all_tokens: bool = Field(
        default=False,
        description=(
            "Prefill computes logits for the last token only (HF generate's logits_to_keep=1, vLLM). "
            "True: logits for every token of the local sequence (e.g. scoring a whole document)."
        ),
    )
    tiled_mlp_tile_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 24,
        description=(
            "Tokens per MLP tile with `tiled_mlp`. None: hidden_size tokens, the number of shards "
            "ALST's TiledMLP uses (ceil(seq / hidden)), which makes one tile's intermediate about the "
            "size of the hidden states."
        ),
    )
    # ----- model states and ZeRO -------------------------------------------------------------------
    zero3_prefetch_layers: int = Field(
        default=1,
        ge=0,
        le=8,
        description=(
            "ZeRO-3/FSDP: transformer blocks gathered ahead of the one computing (FSDP2's implicit "
            "forward/backward prefetch gathers the next block while the current one runs)."
        ),
    )
    unsharded_grad_layers: int = Field(
        default=2,
        ge=1,
        le=8,
        description=(
            "ZeRO-2/3: blocks whose full (unsharded, TP-split) gradients exist at once in backward: the "
            "block being differentiated and the previous one whose reduce-scatter is in flight."
        ),
    )
    grads_freed_between_steps: bool = Field(
        default=True,
        description=(
            "optimizer.zero_grad(set_to_none=True), PyTorch's default: no gradient memory exists "
            "during the forward of the first micro-batch. With grad_accum > 1 gradients persist."
        ),
    )
    optimizer_step_temp_bytes_per_param: float = Field(
        default=4.0,
        ge=0,
        le=32,
        description=(
            "Device temporaries of the optimizer step per parameter it updates: torch.optim.AdamW "
            "(foreach) materialises the fp32 denominator sqrt(v)/bias_correction + eps for the whole "
            "parameter group. 0 for fused=True or when the optimizer runs on the host."
        ),
    )
    host_grad_bytes_per_param: float = Field(
        default=4.0,
        ge=0,
        le=16,
        description=(
            "With the optimizer on the host, the fp32 gradient shard it reads (DeepSpeed ZeRO-Offload "
            "and FSDP2's CPUOffloadPolicy both copy gradients to host memory)."
        ),
    )
    offload_params_moves_grads_and_optimizer: bool = Field(
        default=True,
        description=(
            "FSDP2's CPUOffloadPolicy: with parameter offload the sharded parameters, their gradients "
            "and therefore the optimizer states and step all live on the host."
        ),
    )
    checkpoint_offload_in_flight: int = Field(
        default=2,
        ge=1,
        le=8,
        description=(
            "`offload_checkpoints`: blocks whose checkpointed input is on the device at once (the one "
            "being copied out or prefetched back, and the one in use)."
        ),
    )
    # ----- hardware constants outside the caching allocator ----------------------------------------
    nccl_bytes_per_communicator: int = Field(
        default=512 * MiB,
        ge=0,
        le=1 << 36,
        description=(
            "Device memory one NCCL communicator holds (channels x buffers x peers, outside PyTorch's "
            "allocator). NVIDIA/nccl#964 measured 544 MB (2 GPUs) to 688 MB (4 GPUs) per group on "
            "NVLink A100s; NVLS on H100 can take more. NCCL_BUFFSIZE / NCCL_NCHANNELS lower it."
        ),
    )
    cuda_context_bytes: int = Field(
        default=512 * MiB,
        ge=0,
        le=1 << 36,
        description=(
            "CUDA context plus kernel images loaded lazily by a PyTorch training process (about 0.4-0.6 "
            "GiB on Hopper with CUDA 12 lazy loading), outside the caching allocator."
        ),
    )
    fragmentation_fraction: float = Field(
        default=0.05,
        ge=0,
        le=2,
        description=(
            "Caching-allocator reserve above the peak of allocated tensors, as a fraction of it: "
            "reserved = allocated x (1 + f). A few percent with expandable_segments:True; 10-30% are "
            "common without it when tensor sizes vary (long-context training)."
        ),
    )

    def describe(self) -> dict[str, str]:
        """Field name -> description, for documentation and ``--explain`` style output."""
        return {name: field.description or "" for name, field in type(self).model_fields.items()}
