"""Model states per GPU: weights, gradients and optimizer states under TP, ZeRO 0-3 and CPU offload.

TP splits every matrix of a block (column-parallel Q/K/V and gate/up, row-parallel output and down),
the vocabulary of the embedding and of the lm_head (vocab-parallel), and replicates norms, row-parallel
biases and learned position embeddings; K/V projections are replicated when tp exceeds the KV heads.
ZeRO/FSDP then shards what a TP rank holds over ``Layout.shard_group`` (dp_shard x ulysses x ring):
stage 1 the optimizer states, stage 2 also the gradients, stage 3 also the weights.

Bytes per parameter follow the project convention (DESIGN/BRIEF): mixed-precision AdamW keeps weights
and gradients in the compute dtype and 12 B of fp32 master weights plus moments (8 B when the compute
dtype already is fp32: no separate master); ``adamw_bf16`` keeps two moments in the compute dtype and
no master copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import Layout
from ..memo import Memo
from ..model_spec import ModelSpec
from ..moe import layers_params_tp, routed_expert_params_tp
from ..train_spec import TrainSpec
from .assumptions import MemoryAssumptions
from .dims import ceil_div

FP32 = 4


@dataclass(frozen=True)
class TPParams:
    """Parameters one TP rank holds (before ZeRO sharding)."""

    per_layer: int
    vocab_matrix: int
    """Token-embedding rows of this rank (vocab-parallel); also the lm_head when embeddings are tied."""
    positions: int
    """Learned absolute position embeddings (replicated), 0 with RoPE."""
    lm_head: int
    """lm_head rows of this rank (vocab-parallel); 0 when tied to the embedding."""
    final_norm: int
    layers: int
    layers_total: int = 0
    """All layers' parameters when they differ by layer (MoE, MLA); ``per_layer`` is then their mean,
    rounded up. 0: every layer holds ``per_layer``."""
    routed_experts: int = 0
    """Routed-expert parameters of this rank in all layers (``num_experts / ep`` per MoE layer): ZeRO shards
    them over the expert data-parallel ranks (shard group / ep). 0 with ep=1 (they shard like the rest)."""

    @property
    def embedding(self) -> int:
        return self.vocab_matrix + self.positions

    @property
    def head(self) -> int:
        """Parameters of the output layer that are not the embedding: lm_head (untied) + final norm."""
        return self.lm_head + self.final_norm

    @property
    def total(self) -> int:
        return (self.layers_total or self.layers * self.per_layer) + self.embedding + self.head

    @property
    def output_matrix(self) -> int:
        """The matrix the loss multiplies with (lm_head, or the tied embedding)."""
        return self.lm_head or self.vocab_matrix


def tp_params(model: ModelSpec, tp: int, ep: int = 1) -> TPParams:
    h, hd = model.hidden_size, model.head_dim
    q = model.q_size // tp
    kv = model.num_kv_heads * model.kv_replication(tp) // tp * hd
    attention = h * q + 2 * h * kv + q * h
    attention += (q + 2 * kv) * model.qkv_bias + h * model.attn_out_bias + 2 * hd * model.qk_norm
    f = ceil_div(model.ffn_hidden_size, tp)
    if model.activation == "swiglu":
        mlp = 3 * h * f + (2 * f + h) * model.mlp_bias
    else:
        mlp = 2 * h * f + (f + h) * model.mlp_bias
    per_layer = attention + mlp + model.norms_per_layer * model.norm_params()
    vocab_rows = ceil_div(model.vocab_size, tp)
    positions = model.max_position_embeddings * h if model.position_embedding == "learned" else 0
    lm_head = 0 if model.tied_embeddings else vocab_rows * h
    layers_total = 0
    if model.moe is not None or model.mla is not None:  # MLA attention, dense and MoE layers mixed
        norms = model.norms_per_layer * model.norm_params()
        layers_total = math.ceil(layers_params_tp(model, tp, attention, mlp, ep)) + model.num_layers * norms
        per_layer = math.ceil(layers_total / model.num_layers)
    routed = math.ceil(routed_expert_params_tp(model, tp, ep)) if ep > 1 else 0
    return TPParams(per_layer, vocab_rows * h, positions, lm_head, model.norm_params(), model.num_layers, layers_total,
                    routed)


@dataclass(frozen=True)
class BlockMatrices:
    """A block's weight matrices per TP rank, as ZeRO-3 gathers and bucket-reduces them one at a time."""

    largest: int
    """Elements of the block's largest matrix (an MLP matrix, or q/o projection when larger)."""
    mlp: int
    """Elements of one MLP matrix (hidden x ffn/tp)."""
    mlp_count: int
    """MLP matrices (3 for SwiGLU: gate, up, down; 2 for GELU)."""


def block_matrices(model: ModelSpec, tp: int, ep: int = 1) -> BlockMatrices:
    h = model.hidden_size
    q = model.q_size // tp
    kv = model.num_kv_heads * model.kv_replication(tp) // tp * model.head_dim
    mlp = h * ceil_div(model.ffn_hidden_size, tp)
    if model.moe is not None:
        # The MoE block's FFN: per-expert matrices (HF's nn.Linear experts; ZeRO gathers them one by one) and
        # as many of them as the routed and shared experts and the router hold together.
        mlp = h * ceil_div(model.moe.expert_ffn_hidden_size, tp)
        count = ceil_div(int(model.moe.layer_params_tp(h, tp, ep)), mlp)
        return BlockMatrices(max(h * q, h * kv, mlp), mlp, count)
    return BlockMatrices(max(h * q, h * kv, mlp), mlp, 3 if model.activation == "swiglu" else 2)


@dataclass(frozen=True)
class BytesPerParam:
    weights: int
    gradients: int
    optimizer: int


def bytes_per_param(train: TrainSpec) -> BytesPerParam:
    w = train.dtype_bytes
    if train.optimizer == "adamw":
        optimizer = 2 * FP32 + (FP32 if w < FP32 else 0)  # m, v (+ fp32 master)
    else:
        optimizer = 2 * w
    return BytesPerParam(w, w, optimizer)


@dataclass(frozen=True)
class ModelStates:
    """Per-GPU bytes of model states, where they live, and the unit sizes ZeRO gathers."""

    params: TPParams
    per_param: BytesPerParam
    shard_group: int
    zero_stage: int
    weights_device: int
    optimizer_device: int
    weights_host: int
    gradients_host: int
    optimizer_host: int
    grads_sharded: bool
    grads_on_device: bool
    optimizer_on_device: bool
    optimizer_step_params: int
    """Parameters the device optimizer step updates (0 when it runs on the host)."""
    tp: int = 1
    """The tensor-parallel degree the parameters are split by."""
    ep: int = 1
    """The expert-parallel degree the routed experts are split by."""

    def grads_device(self, params: float) -> int:
        """Persistent device gradient bytes once ``params`` TP-rank parameters have gradients."""
        if not self.grads_on_device:
            return 0
        div = self.shard_group if self.grads_sharded else 1
        return int(-(-params * self.per_param.gradients // div))

    @property
    def layer_weights_unsharded(self) -> int:
        return self.params.per_layer * self.per_param.weights

    @property
    def layer_grads_unsharded(self) -> int:
        return self.params.per_layer * self.per_param.gradients

    @property
    def output_weights_unsharded(self) -> int:
        return self.params.output_matrix * self.per_param.weights

    @property
    def output_grads_unsharded(self) -> int:
        return self.params.output_matrix * self.per_param.gradients


#: Bytes of the fp32 master copy inside mixed-precision ``adamw``'s 12 B/param of optimizer state.
MASTER_BYTES = 4


def separate_master_bytes(train: TrainSpec) -> int:
    """Bytes per parameter of an fp32 master copy kept apart from the parameters: mixed-precision
    ``adamw`` only (fp32 training updates the parameters themselves; ``adamw_bf16`` has none)."""
    return MASTER_BYTES if train.optimizer == "adamw" and train.dtype_bytes < FP32 else 0


def host_optimizer_bytes_per_param(train: TrainSpec, moves_everything: bool = True) -> int:
    """Optimizer-state bytes per parameter in host memory when the optimizer runs there.

    With FSDP2's parameter offload (``moves_everything``: the memory assumption
    ``offload_params_moves_grads_and_optimizer``) the fp32 parameter shard on the host *is* the master
    copy, counted once as weights: only the moments remain optimizer state.
    """
    per = bytes_per_param(train).optimizer
    return per - separate_master_bytes(train) if train.offload_params and moves_everything else per


#: TrainSpec fields model states depend on: the memo key (see :mod:`sp_plan.cost_models.memo`).
STATES_FIELDS = ("mode", "dtype", "optimizer", "zero_stage", "offload_params", "offload_optimizer")
_STATES: Memo[ModelStates] = Memo()


def stage_params(params: TPParams, layers: int, first: bool, last: bool, tied: bool) -> TPParams:
    """What one pipeline stage holds of ``params``: its ``layers``, the token (and position) embedding on the
    first stage, the final norm and LM head on the last (tied embeddings: the last stage keeps its own copy
    of the embedding matrix as the head, as Megatron-LM does, their gradients all-reduced between the two)."""
    vocab = params.vocab_matrix if first or (last and tied) else 0
    return TPParams(params.per_layer, vocab, params.positions if first else 0, params.lm_head if last else 0,
                    params.final_norm if last else 0, layers, 0, params.routed_experts * layers // params.layers)


def model_states(model: ModelSpec, train: TrainSpec, layout: Layout, a: MemoryAssumptions,
                 stage: tuple[int, bool, bool] | None = None) -> ModelStates:
    """Per-GPU bytes of weights, gradients and optimizer states (memoized; read-only). ``stage``: (layers,
    first, last) of the pipeline stage this GPU runs (None: the whole model)."""
    key = (model, a, layout.tp, layout.shard_group, layout.ep, *(getattr(train, f) for f in STATES_FIELDS), stage)
    return _STATES.get(key, lambda: _model_states(model, train, layout, a, stage))


def _model_states(model: ModelSpec, train: TrainSpec, layout: Layout, a: MemoryAssumptions,
                  stage: tuple[int, bool, bool] | None = None) -> ModelStates:
    params = tp_params(model, layout.tp, layout.ep)
    if stage is not None:
        params = stage_params(params, *stage, tied=model.tied_embeddings)
    per = bytes_per_param(train)
    if train.is_training and a.main_grad_bytes_per_param is not None:
        per = BytesPerParam(per.weights, a.main_grad_bytes_per_param, per.optimizer)
    group = layout.shard_group
    stage = train.zero_stage
    total = params.total

    expert_fraction = params.routed_experts / total if params.routed_experts else 0.0
    expert_group = group // layout.ep

    def shard(nbytes: int, sharded: bool) -> int:
        """ZeRO's share of ``nbytes`` (state of all ``total`` parameters): dense weights over the shard group,
        routed experts (already split over ep) over the expert data-parallel ranks, shard group / ep."""
        if not sharded:
            return nbytes
        if not expert_fraction:
            return -(-nbytes // group)
        experts = round(nbytes * expert_fraction)
        return -(-(nbytes - experts) // group) + -(-experts // expert_group)

    weights = shard(total * per.weights, stage >= 3)
    offload_params = train.offload_params
    moves_everything = offload_params and a.offload_params_moves_grads_and_optimizer
    weights_device, weights_host = (0, weights) if offload_params else (weights, 0)
    if not train.is_training:
        return ModelStates(params, per, group, stage, weights_device, 0, weights_host, 0, 0,
                           stage >= 2, False, False, 0, layout.tp)
    optimizer = shard(total * per.optimizer, stage >= 1)
    optimizer_on_device = not (train.offload_optimizer or moves_everything)
    if moves_everything and separate_master_bytes(train):
        # FSDP2's CPUOffloadPolicy keeps one fp32 shard on the host that is both the parameter and the
        # optimizer's master copy: count it once, as weights (4 B/param), and only m and v as optimizer.
        weights_host = shard(total * MASTER_BYTES, True)
        optimizer = shard(total * host_optimizer_bytes_per_param(train), stage >= 1)
    opt_params = shard(total, stage >= 1)
    host_grads = 0 if optimizer_on_device else int(opt_params * a.host_grad_bytes_per_param)
    return ModelStates(
        params=params,
        per_param=per,
        shard_group=group,
        zero_stage=stage,
        weights_device=weights_device,
        optimizer_device=optimizer if optimizer_on_device else 0,
        weights_host=weights_host,
        gradients_host=host_grads,
        optimizer_host=0 if optimizer_on_device else optimizer,
        grads_sharded=stage >= 2,
        # DeepSpeed ZeRO-Offload keeps the gradient partitions in host memory (offload_optimizer_keeps_device_grads)
        grads_on_device=not (moves_everything or (train.offload_optimizer and not a.offload_optimizer_keeps_device_grads)),
        optimizer_on_device=optimizer_on_device,
        optimizer_step_params=opt_params if optimizer_on_device else 0,
        tp=layout.tp,
        ep=layout.ep,
    )
