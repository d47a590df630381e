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

from ..memo import hash_once
from ..units import MiB

SelectivePolicy = Literal["attention_outputs", "attention_core_recompute", "op_sac"]
MLPImplementation = Literal["eager", "fused_swiglu"]
NormImplementation = Literal["fused", "eager"]
CheckpointImplementation = Literal["non_reentrant", "reentrant"]
RopeImplementation = Literal["eager", "inplace"]
TiledLossImplementation = Literal["chunked", "liger_flce"]
CrossEntropyImplementation = Literal["hf", "megatron", "megatron_fused", "te_fused"]
Allocator = Literal["fraction", "expandable", "segments"]
NcclMemory = Literal["flat", "buffers"]
NcclGroups = Literal["mesh", "purposes"]

#: NCCL's per-connection buffer sizes (src/init.cc, NCCL 2.18-2.27 defaults): SIMPLE protocol
#: ``DEFAULT_BUFFSIZE`` = 4 MiB (NCCL_BUFFSIZE), LL128 ``120 x 640 x 8 steps x 8 B`` = 4,915,200 B,
#: LL ``8 x 512 x 8 steps x 16 B`` = 512 KiB.
NCCL_SIMPLE_BYTES = 1 << 22
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
NCCL_LL_BYTES = 8 * 512 * 8 * 16


class MemoryAssumptions(BaseModel):
    """Implementation choices and hardware constants behind the per-GPU memory model."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: Hashed once: the memory model's memo tables key on the assumptions
    #: (:func:`sp_plan.cost_models.memo.hash_once`).
    __slots__ = ("_hash",)
    __hash__ = hash_once

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
            "with a flash kernel that saves nothing beyond 'none'. 'op_sac': torchtitan's per-op selective "
            "activation checkpointing (selective_ac_option='op'): the outputs of the flash/SDPA kernel and of "
            "every other matmul of the block (1st, 3rd, ...) are kept, everything else recomputed."
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
    checkpoint_implementation: CheckpointImplementation = Field(
        default="non_reentrant",
        description=(
            "How activation checkpointing re-runs a block. 'non_reentrant' (torch.utils.checkpoint with "
            "use_reentrant=False, this project's runtime, torchtitan): saved-tensor hooks recompute at the "
            "first unpack and stop once every saved tensor is back; the block's output is not kept. "
            "'reentrant' (use_reentrant=True: HF transformers' default in 4.x gradient_checkpointing_enable, "
            "ALST's CheckpointFunctionWithCPUOffload, Megatron's CheckpointFunction): backward re-runs the "
            "whole block forward, holds its output (`outputs`) and the incoming gradient (`args`) until "
            "torch.autograd.backward over the block returns, so a gradient that would be accumulated into "
            "the incoming one in place gets a new buffer instead (+2 hidden-sized tensors per block)."
        ),
    )
    rope_implementation: RopeImplementation = Field(
        default="eager",
        description=(
            "'eager' (HF apply_rotary_pos_emb, this project's runtime): x * cos + rotate_half(x) * sin, two "
            "x-sized temporaries and a new output. 'inplace' (Liger-Kernel's LigerRopeFunction, used by "
            "ALST's 'liger' model type): a Triton kernel rotates the contiguous q/k projection outputs in "
            "place and saves only cos/sin: no temporaries, no new tensor (backward is in place too)."
        ),
    )
    row_kernel_offset_limit: int | None = Field(
        default=None,
        ge=1,
        le=(1 << 63) - 1,
        description=(
            "Largest element offset (row index x row stride) at which the stack's Triton row kernels (its "
            "fused norms, `norm_implementation='fused'`, and in-place RoPE, `rope_implementation='inplace'`) "
            "can start a row, or None when they index in 64 bits. Liger-Kernel before 0.6.1, the version of "
            "the ALST runs, computes `tl.program_id(0) * row_stride` in int32 in its RMSNorm/LayerNorm "
            "forward and backward and RoPE kernels (linkedin/Liger-Kernel#804, fixed in 0.6.1): a per-GPU "
            "slice whose last row starts past 2^31 - 1 elements faults with an illegal memory access "
            "(ArcticTraining's 1-GPU Llama-8B recipe: 555K tokens -> 'Triton Error [CUDA]: an illegal memory "
            "access was encountered'), however much memory is free. Such a length does not fit."
        ),
    )
    alltoall_head_major_copy: bool = Field(
        default=False,
        description=(
            "DeepSpeed's UlyssesSPAttentionHF: after each q/k/v all-to-all the received [seq, batch, "
            "heads, dim] tensor is rearranged to [batch, heads, seq, dim] with .contiguous(), a copy when a "
            "GPU holds more than one head (the received tensor is then freed); the attention kernel saves "
            "the copy. Its backward is a view (no buffer)."
        ),
    )
    flash_varlen_pad_rows: int = Field(
        default=0,
        ge=0,
        le=1024,
        description=(
            "FlashAttention-2's varlen backward (mha_varlen_bwd, used by HF for packed sequences given "
            "position_ids) allocates dq_accum and softmax_d with `total_q + 128 x sequences` rows (128 per "
            "packed sequence, so neighbouring sequences' atomic adds never overlap): 128 there, 0 for the "
            "dense kernel. Sequences = micro_batch x documents per sequence (TrainSpec.document_length)."
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
    tiled_loss_implementation: TiledLossImplementation = Field(
        default="chunked",
        description=(
            "What `tiled_loss` runs. 'chunked' (this project's sp_plan.runtime.tiled_loss, DeepSpeed's "
            "TiledFusedLogitsLoss): saves hidden states and fp32 LSE, recomputes each chunk's logits in "
            "backward (`loss_chunk_tokens`). 'liger_flce' (Liger-Kernel's LigerFusedLinearCrossEntropy, "
            "ALST's 'liger' model type): the forward computes the gradients: a full input-gradient buffer "
            "(T x hidden) and an unsharded output-matrix gradient in the compute dtype "
            "(torch.zeros_like(weight)) live from the loss forward to its backward, and one chunk of "
            "logits (next_pow2(ceil(T / ceil(vocab / hidden))) tokens, compute dtype) is written and turned "
            "into its gradient in place."
        ),
    )
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
    cross_entropy_implementation: CrossEntropyImplementation = Field(
        default="hf",
        description=(
            "Untiled loss. 'hf' (transformers' ForCausalLMLoss): logits.float(), log_softmax saves its fp32 "
            "output, backward allocates its gradient (14 B per logit at the log-softmax backward with the "
            "caller's bf16 logits). 'megatron' (Megatron-LM/-DeepSpeed vocab_parallel_cross_entropy on "
            "logits.float()): the max-subtracted copy is exponentiated and normalised in place, saved, and "
            "turned into the gradient in place (10 B per logit in forward, 6 B in backward). "
            "'megatron_fused' (Megatron-Core --cross-entropy-loss-fusion --cross-entropy-fusion-impl native, "
            "core/fusions/fused_cross_entropy.py): the fp32 upcast is the only logits-sized tensor, exponentiated, "
            "normalised and turned into the gradient in place, then cast to the logits' dtype (6 B per logit in "
            "forward with the caller's bf16 logits, 4 B saved, 6 B in backward). 'te_fused' (--cross-entropy-"
            "fusion-impl te: Transformer Engine's Triton parallel_cross_entropy): reads the bf16 logits, keeps 12 B "
            "of fp32 statistics and 4 B of loss per token, saves the logits and writes the gradient into them in "
            "place (2 B per logit, nothing more in backward)."
        ),
    )
    hf_logits_fp32_in_output: bool = Field(
        default=False,
        description=(
            "Untiled loss: the logits the caller keeps are the fp32 upcast (transformers <= 4.45: "
            "`logits = logits.float()` in LlamaForCausalLM.forward, returned in the output; the bf16 logits "
            "are freed) instead of the bf16 logits (4.46+: the loss function upcasts internally)."
        ),
    )
    hf_shift_logits_copy: bool = Field(
        default=False,
        description=(
            "Untiled loss: the loss shifts inside (`logits[..., :-1, :].contiguous()`, an fp32 copy; its "
            "backward builds the gradient in a zero-filled full-size tensor) instead of taking pre-shifted "
            "labels (shift_labels, what sequence parallelism needs)."
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
    tiled_mlp_concat_outputs: bool = Field(
        default=False,
        description=(
            "False (this project's runtime): each tile writes its slice of a preallocated output. True "
            "(DeepSpeed's TiledMLP, ALST): forward keeps every tile's output in a list and torch.cat's them, "
            "so at the cat a second hidden-sized tensor exists (also during a reentrant recompute)."
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
    zero3_prefetch_params: int | None = Field(
        default=None,
        ge=0,
        le=1 << 40,
        description=(
            "None: whole blocks are prefetched (FSDP2, `zero3_prefetch_layers`). A number: DeepSpeed "
            "ZeRO-3's stage3_prefetch_bucket_size (default 5e7 elements): the block being computed stays "
            "gathered (its parameters are reused within stage3_max_reuse_distance, 1e9, between its "
            "recompute and its backward) and the prefetcher gathers ahead until this many elements are in "
            "flight, always at least the next parameter of the trace whole: a block's largest matrix, and "
            "while the first block runs backward the input embedding (the trace's last module)."
        ),
    )
    zero_reduce_bucket_params: int | None = Field(
        default=None,
        ge=0,
        le=1 << 40,
        description=(
            "None: ZeRO-2/3 keep `unsharded_grad_layers` blocks of unsharded gradients (FSDP2). A number: "
            "DeepSpeed's reduce_bucket_size (default 5e8 elements) with contiguous_gradients: each "
            "parameter's gradient is copied into a persistent bucket of this many elements (compute dtype; "
            "ALST sets seq_parallel_communication_data_type bf16) and reduce-scattered when it fills; the "
            "gradient a parameter produces (its largest matrix) exists until it is copied. Under tiled MLP "
            "the MLP matrices' gradients accumulate across tiles before they are bucketed (TiledMLP sets "
            "ds_grad_is_ready=False until the last shard)."
        ),
    )
    zero_reduce_bucket_copies: float = Field(
        default=2.0,
        ge=0,
        le=8,
        description=(
            "With `zero_reduce_bucket_params`: buckets' worth of memory the reduction holds: the contiguous "
            "IPG bucket plus the interleaved, padded flat copy DeepSpeed's reduce_scatter_coalesced builds "
            "with torch.cat while the reduce-scatter runs."
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
    main_grad_bytes_per_param: int | None = Field(
        default=None,
        ge=1,
        le=8,
        description=(
            "Training: bytes per element of the gradients the stack keeps on the device. None: the compute "
            "dtype (PyTorch's .grad, FSDP2, DeepSpeed). 4: Megatron-Core's fp32 main-gradient buffer "
            "(accumulate_allreduce_grads_in_fp32, which validate_args turns on for bf16; the weight-gradient "
            "GEMM accumulates into it directly, so no compute-dtype copy exists beside it)."
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
    offload_optimizer_keeps_device_grads: bool = Field(
        default=True,
        description=(
            "With the optimizer offloaded: True (this project's runtime) keeps the ZeRO gradient shards on "
            "the device until the host step copies them; False (DeepSpeed ZeRO-Offload: stage 3 allocates "
            "grad_partitions_flat_buffer on the host when offload_optimizer is set, stage 1/2 copy each "
            "reduced partition to the host fp32 gradient) keeps none there between buckets."
        ),
    )
    offload_params_moves_grads_and_optimizer: bool = Field(
        default=True,
        description=(
            "FSDP2's CPUOffloadPolicy: with parameter offload the sharded parameters, their gradients "
            "and therefore the optimizer states and step all live on the host."
        ),
    )
    host_process_bytes: int = Field(
        default=4 << 30,
        ge=0,
        le=1 << 40,
        description=(
            "Host memory each training process holds besides offloaded state (not available to offloads): "
            "the interpreter, the torch/CUDA/NCCL libraries and the CUDA context's host mappings (~1.5-3 GiB "
            "resident for a CUDA PyTorch process), the data loader and its prefetched batches."
        ),
    )
    checkpoint_offload_keeps_activations: bool = Field(
        default=False,
        description=(
            "`offload_checkpoints` keeps every activation autograd saves and moves it to host memory instead of "
            "recomputing (torch's save_on_cpu, TRL's activation offloading): the host then holds each layer's "
            "saved activations, not only its checkpointed input. Not set in stack files: a stack profile derives "
            "it from its time section's `checkpoint_offload_recomputes` (one switch for both models)."
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
    nccl_memory: NcclMemory = Field(
        default="flat",
        description=(
            "'flat': `nccl_bytes_per_communicator` per communicator. 'buffers': from NCCL's buffer sizes: "
            "per communicator `nccl_channels` x (SIMPLE 4 MiB + LL128 4.69 MiB + LL 512 KiB) for its ring "
            "connections (twice when it spans nodes: tree connections too), plus, for groups that run "
            "all-to-all or send/recv (Ulysses, ring attention), per peer and P2P channel "
            "(`nccl_p2p_channels_per_peer`) a send and a receive buffer (NVLink: 512 KiB P2P chunk x 8 steps; "
            "network: 128 KiB x 8 steps), so it grows with the group size."
        ),
    )
    nccl_groups: NcclGroups = Field(
        default="mesh",
        description=(
            "'mesh': one communicator per distinct set of ranks (a DeviceMesh shares the communicator of "
            "identical groups). 'purposes': every process group the framework creates is its own "
            "communicator even when it holds the same ranks (DeepSpeed: the world group, the sequence-"
            "parallel group, the ZeRO partition (sequence-data-parallel) group, data-parallel and TP groups)."
        ),
    )
    nccl_channels: int = Field(
        default=24,
        ge=1,
        le=64,
        description=(
            "'buffers' mode: collective (ring) channels per communicator; NCCL picks 16-32 on NVSwitch "
            "H100/A100 nodes (NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS bound it)."
        ),
    )
    nccl_p2p_channels_per_peer: int = Field(
        default=2,
        ge=1,
        le=32,
        description=(
            "'buffers' mode: P2P channels per peer (NCCL's p2pnChannelsPerPeer: the pow2 of the fewest "
            "channels any peer path supports, 2 with network peers: NCCL_NCHANNELS_PER_NET_PEER)."
        ),
    )
    nccl_local_ranks: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="'buffers' mode: GPUs per node (peers reached over NVLink; a larger group spans nodes).",
    )
    cublas_workspace_bytes: int = Field(
        default=0,
        ge=0,
        le=1 << 32,
        description=(
            "cuBLAS/cuBLASLt workspace PyTorch allocates through its caching allocator per (handle, stream) "
            "that runs GEMMs: CUBLAS_WORKSPACE_CONFIG's default is 4096 KiB x 8 = 32 MiB on Hopper (sm90) "
            "and 4096 KiB x 2 + 16 KiB x 8 on other GPUs; one compute stream. Counted as allocated memory."
        ),
    )
    allocator: Allocator = Field(
        default="fraction",
        description=(
            "PyTorch caching-allocator model for the reserve above the allocated peak. 'fraction': "
            "`fragmentation_fraction` of the peak. 'expandable' (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True) and 'segments' (the default cudaMalloc'd segments): the peak "
            "phase's alloc/free sequence is replayed through a model of the allocator (512 B rounding, "
            "best-fit reuse of cached blocks with splitting, one growable segment per stream mapped in "
            "20 MiB pages vs. one cudaMalloc segment per miss rounded to 2 MiB) and the reserved high-water "
            "mark above the live peak is the fragmentation; memory other streams' pools cached at another "
            "moment (the parameter all-gather stream) is added."
        ),
    )
    allocator_slack_fraction: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Allocator 'expandable'/'segments' only: reserve the replay does not reproduce, as a fraction of "
            "the allocated peak (blocks whose reuse waits on another stream's event, e.g. NCCL's with "
            "recordStream; pools of side streams; the first step's and initialisation's allocations the "
            "miniature step leaves out). An empirical constant fitted to published runs, not a mechanism: "
            "see docs/memory_model.md (allocator) for the fit and its held-out error."
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
