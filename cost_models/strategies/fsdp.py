"""Data parallelism's parameter and gradient traffic: DDP, ZeRO-1/2, FSDP / ZeRO-3 and HSDP.

Reads the ZeRO/FSDP shard group (dp_shard x ring x ulysses: every rank holding the same TP shard of the
same replica) and the ``dp_replicate`` degree. Parameters travel in the compute dtype, gradients in
FSDP's reduce dtype (:mod:`.gradients`), sizes are TP-local (:mod:`.tp`).

- **FSDP / ZeRO-3** over the shard group: all-gather of the layer's weights forward, again in backward
  (they were resharded), and a reduce-scatter of its gradients (``prefetch``: hidden behind layer
  compute). With dp_replicate > 1 (HSDP) the reduced gradient shard is all-reduced across replicas
  ("dp"). Outside the layers, the embedding, LM head and final norm are gathered once per forward; in
  backward only an untied input embedding is re-gathered (the head is used first, still gathered).
- **ZeRO-2**: reduce-scatter of the layer's gradients each micro-batch (+ HSDP all-reduce); the updated
  parameters are all-gathered once per step. **ZeRO-1**: the gradient reduce-scatter happens once per
  step (in the last micro-batch), then the parameter all-gather. **ZeRO-0 (DDP)**: one all-reduce of
  the gradients per step over the data group (all ranks but TP), bucketed during the last backward.
- Prefill under ZeRO-3 gathers the weights once, forward.
- Under pipeline parallelism every layer's gather and reduction happens once per step (see
  :func:`_sharded_ops`).
"""

from __future__ import annotations

from collections.abc import Iterator

from .. import degrees
from ..layout import Layout
from ..model_spec import ModelSpec
from ..moe import expert_layer_params
from ..train_spec import TrainSpec
from .base import Strategy
from .gradients import data_ranks, fsdp_grad_bytes
from .terms import CommOp
from .tp import tp_local_embedding_params, tp_local_layer_params, tp_local_other_params, tp_local_params


def optimizer_shard(train: TrainSpec, layout: Layout) -> int:
    """Ranks one parameter's optimizer state is split over (ZeRO >= 1 shards it over the shard group)."""
    return layout.shard_group if train.zero_stage >= 1 else 1


def local_optimizer_params(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """Parameters whose optimizer step one GPU runs: its TP-local parameters over the ZeRO shard."""
    return tp_local_params(model, layout) / optimizer_shard(train, layout)


def parameter_shard_params(model: ModelSpec, layout: Layout) -> float:
    """Parameters in one GPU's FSDP shard (what ZeRO-3 parameter offload keeps on the host)."""
    return tp_local_params(model, layout) / layout.shard_group


class ParameterSharding(Strategy):
    name = "fsdp"
    layer_buckets = ("dp", "fsdp")

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
        d = train.dtype_bytes  # parameters travel in the compute dtype (bf16; fp32 when training in fp32)
        layer = tp_local_layer_params(model, layout.tp) * d
        other = tp_local_other_params(model, layout.tp) * d
        shard = layout.shard_group
        if not train.is_training:
            if train.zero_stage == 3 and shard > 1:
                yield _op("fsdp", "all_gather", "shard", layer, "forward", overlap="prefetch",
                          label="parameter all-gather")
                yield _op("fsdp", "all_gather", "shard", other, "forward", scope="model",
                          label="embedding/head all-gather")
            return
        if train.zero_stage == 0:
            yield from _ddp_ops(model, train, layout)
        else:
            yield from _sharded_ops(model, train, layout)


def _op(strategy: str, collective: str, group: str, nbytes: float, phase: str, **kw) -> CommOp:
    return CommOp(strategy, collective, group, float(nbytes), phase, **kw)


def _ddp_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
    if data_ranks(layout) == 1:
        return
    d = train.dtype_bytes
    layer = tp_local_layer_params(model, layout.tp) * d
    other = tp_local_other_params(model, layout.tp) * d
    yield _op("dp", "all_reduce", "data", layer, "backward", per="step", overlap="grad", label="gradient all-reduce")
    yield _op("dp", "all_reduce", "data", other, "backward", scope="model", per="step",
              label="embedding/head gradient all-reduce")


def _sharded_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
    d = train.dtype_bytes
    stage = train.zero_stage
    # Expert parallelism: the routed experts shard over their own group (expert.py prices that traffic).
    layer_params = tp_local_layer_params(model, layout.tp) - expert_layer_params(model, layout.tp, 1, layout.ep)
    layer = layer_params * d
    other = tp_local_other_params(model, layout.tp) * d
    # Gradients are reduced in fp32 under FSDP (sp_plan.runtime.fsdp: MixedPrecisionPolicy(reduce_dtype=fp32)).
    grad_bytes = fsdp_grad_bytes(train)
    layer_grads = layer_params * grad_bytes
    other_grads = tp_local_other_params(model, layout.tp) * grad_bytes
    shard = layout.shard_group
    # Pipeline stages interleave micro-batches: torch.distributed.pipelining keeps FSDP2 unsharded and its
    # gradients unreduced until the last micro-batch (torchtitan: no reshard after forward under PP), so a
    # stage gathers its parameters once per step, never re-gathers them, and reduces once.
    pipelined = layout.pp > 1
    grad_per = "step" if stage == 1 or pipelined else "microbatch"
    layer_per = "step" if pipelined else "microbatch"
    if shard > 1:
        if stage == 3:
            yield _op("fsdp", "all_gather", "shard", layer, "forward", per=layer_per, overlap="prefetch",
                      label="parameter all-gather")
            if not pipelined:
                yield _op("fsdp", "all_gather", "shard", layer, "backward", overlap="prefetch",
                          label="parameter re-gather")
            yield _op("fsdp", "all_gather", "shard", other, "forward", scope="model", per=layer_per,
                      label="embedding/head all-gather")
            # The LM head and final norm are used first in backward, so FSDP keeps them gathered after
            # forward; only an untied input embedding is re-gathered for its gradient.
            if not model.tied_embeddings and not pipelined:
                yield _op("fsdp", "all_gather", "shard", tp_local_embedding_params(model, layout.tp) * d, "backward",
                          scope="model", label="embedding re-gather")
        yield _op("fsdp", "reduce_scatter", "shard", layer_grads, "backward", per=grad_per,
                  overlap="prefetch" if stage == 3 else "grad", label="gradient reduce-scatter")
        yield _op("fsdp", "reduce_scatter", "shard", other_grads, "backward", scope="model", per=grad_per,
                  label="embedding/head gradient reduce-scatter")
        if stage in (1, 2):
            yield _op("fsdp", "all_gather", "shard", layer * model.num_layers + other, "step", scope="model",
                      per="step", label="updated parameter all-gather")
    for dim in degrees.replicate_dims():  # HSDP: the reduced shard is all-reduced across each replica dim
        if getattr(layout, dim) > 1:
            yield _op("dp", "all_reduce", dim, layer_grads / shard, "backward", per=grad_per, overlap="grad",
                      label="gradient shard all-reduce across replicas")
            yield _op("dp", "all_reduce", dim, other_grads / shard, "backward", scope="model", per=grad_per,
                      label="embedding/head gradient shard all-reduce across replicas")


__all__ = ["ParameterSharding", "local_optimizer_params", "optimizer_shard", "parameter_shard_params"]
