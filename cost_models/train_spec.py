"""What is being run: sequence length, batch, precision, mode and memory options."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .units import MAX_SEQ_LEN, parse_seq_len

Mode = Literal["train", "prefill"]
Checkpointing = Literal["none", "selective", "full"]
AttentionKernel = Literal["flash", "materialized"]
ComputeDType = Literal["bf16", "fp16", "fp32"]
#: ``adamw``: mixed precision with fp32 master weights and fp32 moments (12 B/param of optimizer
#: state). ``adamw_bf16``: pure bf16 training, moments in bf16 and no master copy (4 B/param).
Optimizer = Literal["adamw", "adamw_bf16"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class TrainSpec(BaseModel):
    """A training (or prefill) configuration independent of how it is parallelised."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int = Field(ge=1, le=MAX_SEQ_LEN)
    micro_batch: int = Field(default=1, ge=1, le=1 << 16)
    grad_accum: int = Field(default=1, ge=1, le=1 << 16)
    dtype: ComputeDType = "bf16"
    mode: Mode = "train"
    optimizer: Optimizer = "adamw"
    zero_stage: int = Field(default=3, ge=0, le=3)
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_checkpoints: bool = False
    checkpointing: Checkpointing = "full"
    tiled_mlp: bool = False
    tiled_loss: bool = False
    attention_kernel: AttentionKernel = "flash"
    #: Megatron-style sequence parallelism inside the TP group: norms/residuals are split over tp
    #: along the sequence, with all-gather/reduce-scatter instead of all-reduce. Standard with TP.
    tp_sequence_parallel: bool = True
    #: Packed sequences with document masking: each sequence holds documents of about this many tokens
    #: and attention stays inside a document (flash-attn varlen / cu_seqlens). None: one document per
    #: sequence (full causal attention). Attention work shrinks from S^2/2 to S x D/2 pairs.
    document_length: int | None = Field(default=None, ge=1, le=MAX_SEQ_LEN)
    #: Float8 linear layers (torchao / TransformerEngine style dynamic scaling): the GEMMs run on the
    #: fp8 tensor cores, plus the amax and cast passes over their operands.
    fp8_linears: bool = False
    #: The transformer blocks run under torch.compile: neighbouring elementwise kernels are fused.
    compiled: bool = False

    @field_validator("seq_len", mode="before")
    @classmethod
    def _parse_seq(cls, value: object) -> int:
        return parse_seq_len(value) if isinstance(value, (str, int)) else value  # type: ignore[return-value]

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> "TrainSpec":
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("offload_params needs zero_stage=3 (parameters are offloaded as FSDP shards)")
        if self.mode == "train" and self.offload_checkpoints and self.checkpointing == "none":
            raise ValueError("offload_checkpoints moves checkpointed block inputs to the host; it needs "
                             "checkpointing 'selective' or 'full'")
        if self.document_length is not None and self.document_length > self.seq_len:
            raise ValueError(f"document_length={self.document_length} exceeds seq_len={self.seq_len}; leave it unset "
                             "for one document per sequence")
        if self.mode == "prefill" and self.grad_accum != 1:
            raise ValueError("grad_accum applies to training only; use grad_accum=1 with mode=prefill")
        return self

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_training(self) -> bool:
        return self.mode == "train"
