"""Offloading to host memory: what crosses PCIe, and what is kept instead of recomputed.

Inputs are an :class:`OffloadTraffic` (normally the memory model's host-resident figures). Parameter
shards come in over PCIe ahead of use and checkpointed activations go out and come back
asynchronously, so each pass's PCIe time hides behind that pass's compute. With the optimizer on the
host, gradients go down once per step (hidden behind the last backward) and updated parameters come
back (exposed); the host optimizer step itself is :mod:`.optimizer`'s.

A stack whose checkpoint offload is ``save_on_cpu``-style (``checkpoint_offload_recomputes: false``)
moves every saved activation to the host and recomputes nothing: :meth:`Offload.keeps_activations`.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from ..flops import sparse_matmul_weights
from ..layout import Layout
from ..memory.states import host_optimizer_bytes_per_param
from ..model_spec import ModelSpec
from ..stack import StackTime
from ..train_spec import TrainSpec
from .base import Strategy
from .fsdp import optimizer_shard, parameter_shard_params
from .terms import Term, TimeContext
from .tp import tp_local_params


class OffloadTraffic(BaseModel):
    """What lives in host memory, per GPU, in bytes (feed the memory model's figures).

    ``optimizer_bytes``: optimizer states on the host; the optimizer step then runs on the CPU and
    gradients go down / updated weights come back over PCIe once per step. ``param_bytes``: the
    parameter shard kept on the host (ZeRO-3 offload), copied to the GPU for forward and again for
    backward each micro-batch, gradients copied back. ``checkpoint_bytes``: checkpointed activations
    moved to the host during forward and fetched back during backward, per micro-batch.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    optimizer_bytes: float = Field(default=0.0, ge=0)
    param_bytes: float = Field(default=0.0, ge=0)
    checkpoint_bytes: float = Field(default=0.0, ge=0)

    @classmethod
    def estimate(cls, model: ModelSpec, train: TrainSpec, layout: Layout) -> "OffloadTraffic":
        """A first-order estimate from the train flags, for when the memory model's numbers are not
        at hand: TP-local parameters sharded over the ZeRO group, and per layer the checkpointed block
        input (plus, for selective, the attention output and its fp32 LSE)."""
        if not train.is_training:
            return cls()
        d = train.dtype_bytes
        on_host = train.offload_optimizer or train.offload_params  # FSDP2's parameter offload moves the step too
        optimizer = (tp_local_params(model, layout) / optimizer_shard(train, layout)
                     * host_optimizer_bytes_per_param(train) if on_host else 0.0)
        param = parameter_shard_params(model, layout) * d if train.offload_params else 0.0
        checkpoint = 0.0
        if train.offload_checkpoints and train.checkpointing != "none":
            tokens = train.micro_batch * train.seq_len / layout.sp
            per_layer = tokens * model.hidden_size * d
            if layout.tp > 1 and train.tp_sequence_parallel:
                per_layer /= layout.tp
            if train.checkpointing == "selective":
                per_layer += tokens * model.num_heads / layout.tp * (model.head_dim * d + 4)
            checkpoint = per_layer * model.num_layers
        return cls(optimizer_bytes=optimizer, param_bytes=param, checkpoint_bytes=checkpoint)


def saved_activation_bytes(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """Bytes per GPU and micro-batch that autograd saves for backward in all layers without checkpointing,
    with a flash attention kernel: per token and layer the two norm inputs and outputs (4h), q/k/v and the
    attention output (2q + 2kv, the LSE aside) and the MLP's gate, activation, up and product (4f for
    SwiGLU, 2f for GELU), TP-local widths; Korthikanti et al. 2022 count 34h bytes for a GPT layer on the
    same basis. What a save_on_cpu-style offload moves to the host and back (the memory model owns the
    device-side accounting)."""
    tp = layout.tp
    tokens = train.micro_batch * train.seq_len / layout.sp
    q = model.q_size / tp
    kv = model.num_kv_heads * model.kv_replication(tp) / tp * model.head_dim
    f = model.ffn_hidden_size / tp * (4 if model.activation == "swiglu" else 2)
    if model.moe is not None:  # the mean layer's SwiGLU rows, plus the routed rows' input and output copies
        sparse = sparse_matmul_weights(model, tp, tokens)
        f = sparse.activation_width * 4 / 3 + sparse.permute_width / 2
    h = model.hidden_size / (tp if (tp > 1 and train.tp_sequence_parallel) else 1)
    return model.num_layers * tokens * (4 * h + 2 * q + 2 * kv + f) * train.dtype_bytes


def host_optimizer_params(ctx: TimeContext) -> float:
    """Parameters whose optimizer state lives on the host (their step runs on the CPU)."""
    on_host = ctx.offload.optimizer_bytes
    return on_host / host_optimizer_bytes_per_param(ctx.train) if on_host else 0.0


class Offload(Strategy):
    name = "offload"

    def keeps_activations(self, train: TrainSpec, stack: StackTime) -> bool:
        return train.offload_checkpoints and not stack.checkpoint_offload_recomputes

    def exposed(self, ctx: TimeContext) -> Iterator[Term]:
        train = ctx.train
        training = train.is_training
        if not (ctx.offload.optimizer_bytes or ctx.offload.param_bytes or ctx.offload.checkpoint_bytes
                or (training and train.offload_checkpoints)):
            return  # nothing on the host (the common case the planner times most)
        layers, c = ctx.layers, ctx.compute
        pcie = ctx.topology.pcie_bandwidth
        d = train.dtype_bytes
        if training:
            cpu_params = host_optimizer_params(ctx)
            if cpu_params > 0:
                grads_down = cpu_params * d / pcie
                yield Term("offload", cpu_params * d / pcie)  # updated weights back to the GPU
                yield Term("offload", max(0.0, grads_down - layers * c.layer_backward))  # hidden behind backward
        checkpoint_bytes = ctx.offload.checkpoint_bytes
        if (training and train.offload_checkpoints and train.checkpointing != "none"
                and self.keeps_activations(train, ctx.stack)):
            # save_on_cpu-style offload: every saved activation crosses PCIe (and nothing is recomputed).
            checkpoint_bytes = max(checkpoint_bytes, saved_activation_bytes(ctx.model, train, ctx.layout))
        params = ctx.offload.param_bytes
        if params or checkpoint_bytes:
            fwd_pcie = (params + checkpoint_bytes) / pcie
            bwd_pcie = ((2 * params if training else 0.0) + checkpoint_bytes) / pcie
            per_mb = max(0.0, fwd_pcie - layers * c.layer_forward)
            if training:
                per_mb += max(0.0, bwd_pcie - layers * c.layer_backward)
            yield Term("offload", ctx.accum * per_mb)


__all__ = ["Offload", "OffloadTraffic", "host_optimizer_params", "saved_activation_bytes"]
