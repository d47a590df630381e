"""What is being run: sequence length, batch, precision, mode and memory options."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .data_balance import DataShape
from .memo import hash_once
from .units import MAX_SEQ_LEN, parse_seq_len

Mode = Literal["train", "prefill"]
Checkpointing = Literal["none", "selective", "full"]
AttentionKernel = Literal["flash", "materialized"]
ComputeDType = Literal["bf16", "fp16", "fp32"]
#: ``adamw``: mixed precision with fp32 master weights and fp32 moments (12 B/param of optimizer
#: state). ``adamw_bf16``: pure bf16 training, moments in bf16 and no master copy (4 B/param).
Optimizer = Literal["adamw", "adamw_bf16"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Pipeline schedules (used when the layout has ``pp > 1``; see :mod:`sp_plan.cost_models.pipeline`):
#: ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021), ``interleaved_1f1b`` (Megatron-LM's virtual stages),
#: ``zero_bubble`` (ZB-H1, Qi et al. 2023: the backward split into input and weight gradients).
PipelineSchedule = Literal["1f1b", "interleaved_1f1b", "zero_bubble"]
#: Bound on model chunks per stage and on the stages a split may list (far above any published run).
MAX_VIRTUAL_STAGES = 64
MAX_STAGES = 4096


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
    #: The training data's document-length distribution and packing (``--lengths``): attention is priced on the
    #: packed rows' busiest rank (:mod:`sp_plan.cost_models.data_balance`); ``document_length`` then holds the
    #: rows' equivalent document length. None: one document per row, or uniform ``document_length`` documents.
    data: DataShape | None = None
    #: Float8 linear layers (torchao / TransformerEngine style dynamic scaling): the GEMMs run on the
    #: fp8 tensor cores, plus the amax and cast passes over their operands.
    fp8_linears: bool = False
    #: The transformer blocks run under torch.compile: neighbouring elementwise kernels are fused.
    compiled: bool = False
    #: How pipeline stages order the micro-batches (``grad_accum`` of them per step) when ``pp > 1``.
    pipeline_schedule: PipelineSchedule = "1f1b"
    #: Model chunks per pipeline stage: 1, or >= 2 with ``interleaved_1f1b``.
    virtual_stages: int = Field(default=1, ge=1, le=MAX_VIRTUAL_STAGES)
    #: Layers of each pipeline stage, first to last (None: the balanced default split of
    #: :func:`sp_plan.cost_models.pipeline.default_stage_layers`). Must sum to the model's layers.
    stage_layers: tuple[int, ...] | None = Field(default=None, min_length=1, max_length=MAX_STAGES)

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
        if self.data is not None and self.document_length is not None:
            raise ValueError("document_length and data (--lengths) both describe the documents; give one: the "
                             "length distribution prices the packed rows as they are")
        if self.document_length is not None and self.document_length > self.seq_len:
            raise ValueError(f"document_length={self.document_length} exceeds seq_len={self.seq_len}; leave it unset "
                             "for one document per sequence")
        if self.mode == "prefill" and self.grad_accum != 1:
            raise ValueError("grad_accum applies to training only; use grad_accum=1 with mode=prefill")
        if self.pipeline_schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise ValueError("interleaved_1f1b needs virtual_stages >= 2 (model chunks per stage); use 1f1b for one")
        if self.pipeline_schedule != "interleaved_1f1b" and self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs pipeline_schedule interleaved_1f1b; "
                             f"{self.pipeline_schedule} runs one model chunk per stage")
        if self.stage_layers is not None and min(self.stage_layers) < 1:
            raise ValueError(f"stage_layers {list(self.stage_layers)}: every stage needs at least one layer")
        return self

    #: Hashed once: the cost model's memo tables key on TrainSpecs (:func:`sp_plan.cost_models.memo.hash_once`).
    __slots__ = ("_hash",)
    __hash__ = hash_once

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def attention_document_length(self) -> int | None:
        """The document length attention is priced at: the data's equivalent length (``--lengths``), else
        ``document_length`` (None: one document per sequence)."""
        if self.data is not None:
            return self.data.equivalent_document_length(self.seq_len)
        return self.document_length

    @property
    def is_training(self) -> bool:
        return self.mode == "train"
