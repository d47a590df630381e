"""Communication volume: every collective a training (or prefill) step issues, in bytes SENT per GPU.

One list of :class:`CommOp` is the single source of truth: :func:`comm_ops` collects it from the
registered strategies (:mod:`sp_plan.cost_models.strategies`), :func:`comm_estimate` sums it into the
``comm`` JSON section and the time model costs each op on the topology. The few ops only some stacks issue
carry ``CommOp.only_if`` (Megatron's backward re-gather of a column-parallel input); both keep them for the
stacks whose facts say so (:func:`stack_traffic`). The conventions are the
project's (``BRIEF.md``) and the runtime's byte counters follow the same ones:

Notation: b micro-batch, S sequence length, d bytes of the compute dtype, h hidden, q = heads x
head_dim, tp/U/R the TP, Ulysses and Ring degrees, T = b S / (U R) tokens per GPU (per TP group), rep =
``model.kv_replication(tp x U)``. Sizes are the collective's size argument (see
:mod:`sp_plan.cost_models.collectives`); sent bytes follow from the group size.

Each strategy's module documents its ops: per transformer layer and micro-batch, the Ulysses
all-to-alls (``strategies/ulysses.py``), the ring's K/V and fp32 dK/dV hops (``strategies/ring.py``),
Megatron TP's all-reduces or all-gather/reduce-scatter pairs (``strategies/tp.py``), and the FSDP /
ZeRO-1/2/3 / DDP / HSDP parameter and gradient traffic (``strategies/fsdp.py``). Gradients once per
step are listed in the layer's backward "as in the micro-batch that reduces them".

Recompute (training): ``full`` re-runs the block forward in backward, so its Ulysses, Ring and TP
forward traffic repeats; ``selective`` repeats the Q/K/V all-to-alls and the TP collectives needed to
rebuild the recomputed parts (QKV input gather, attention output projection, MLP input gather), but
not the attention op (ring pass, output all-to-all). FSDP traffic does not repeat (the backward
gather serves the recompute).

Per micro-batch outside the layers: with TP the vocab-parallel embedding, LM head and cross-entropy
(``strategies/tp.py``), FSDP of the embedding/head/final-norm weights, and the loss reduction (sum and
valid-token count, two fp32 scalars) over the data group (``strategies/loss.py``). With sequence
parallelism, replicated TP parameters (norms, row-parallel biases) get their gradients all-reduced
over TP once per step. Prefill computes logits for the last token only (all-gathered over TP).
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from .collectives import COLLECTIVES, bytes_sent
from .layout import Layout
from .memory.assumptions import MemoryAssumptions
from .model_spec import ModelSpec
from .placement import group_shapes
from .strategies import implementing, layer_buckets, on_change, report_buckets
from .strategies.gradients import FSDP_GRAD_BYTES, fsdp_grad_bytes
from .strategies.loss import LOSS_REDUCTION_BYTES
from .strategies.ring import DKV_ACCUMULATOR_BYTES
from .strategies.terms import TP_INPUT_REGATHER, CommOp, issued
from .strategies.tp import (
    FP32_BYTES,
    VOCAB_PARALLEL_CE_REDUCTIONS,
    tp_local_layer_params,
    tp_local_other_params,
    tp_replicated_layer_params,
)
from .train_spec import TrainSpec

#: Strategies reported per layer (issue 3's JSON keys), and the extra per-step buckets, of the default
#: strategies (a registered strategy adds its own: :func:`~sp_plan.cost_models.strategies.report_buckets`).
LAYER_STRATEGIES: tuple[str, ...] = layer_buckets()
STEP_STRATEGIES: tuple[str, ...] = report_buckets()


# ----- the op list ---------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def comm_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> tuple[CommOp, ...]:
    """Every collective of one step: each registered strategy's, in registration order (cached: the
    planner asks repeatedly)."""
    return tuple(op for strategy in implementing("comm_ops") for op in strategy.comm_ops(model, train, layout))


# ----- the comm JSON section -----------------------------------------------------------------------


class PhaseBytes(BaseModel):
    """Bytes sent per GPU in the forward and backward of one layer (backward absent in prefill).

    ``backward`` includes the forward traffic that recomputation repeats; ``backward_recompute`` is
    that part alone.
    """

    model_config = ConfigDict(frozen=True)

    forward: float = 0.0
    backward: float | None = None
    backward_recompute: float | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class CommEstimate(BaseModel):
    """Communication volume, bytes sent per GPU (see :mod:`sp_plan.cost_models.comm_volume`)."""

    model_config = ConfigDict(frozen=True)

    per_layer_bytes: dict[str, PhaseBytes] = Field(description="one transformer layer, one micro-batch")
    per_layer_by_collective: dict[str, PhaseBytes]
    per_step_bytes: float = Field(description="one optimizer step (all micro-batches), bytes sent per GPU")
    per_step_by_strategy: dict[str, float]
    by_collective: dict[str, float] = Field(description="per step, by collective kind")
    group_sizes: dict[str, int]


def multiplier(op: CommOp, model: ModelSpec, train: TrainSpec) -> int:
    """How many times ``op`` runs per optimizer step."""
    times = op.count * (model.num_layers if op.scope == "layer" else 1)
    return times * (train.grad_accum if op.per == "microbatch" else 1)


def stack_traffic(memory: MemoryAssumptions) -> frozenset[str]:
    """The stack-dependent traffic a stack issues (``CommOp.only_if``), from its memory assumptions: what a
    layer saves decides what backward must fetch again."""
    return frozenset({TP_INPUT_REGATHER}) if not memory.tp_saves_gathered_input else frozenset()


def comm_estimate(model: ModelSpec, train: TrainSpec, layout: Layout,
                  traffic: frozenset[str] = frozenset()) -> CommEstimate:
    """The bytes of one step's collectives; ``traffic``: the stack's (:func:`stack_traffic`; default: the
    ops every stack issues, as this project's runtime does)."""
    return _comm_estimate(model, train, layout, traffic)


@lru_cache(maxsize=4096)
def _comm_estimate(model: ModelSpec, train: TrainSpec, layout: Layout, traffic: frozenset[str]) -> CommEstimate:
    sizes = {name: size for name, (_, size) in group_shapes(layout).items()}
    training = train.is_training
    layer: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in layer_buckets()}
    layer_coll: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in COLLECTIVES}
    step_by: dict[str, float] = dict.fromkeys(report_buckets(), 0.0)
    by_coll: dict[str, float] = dict.fromkeys(COLLECTIVES, 0.0)
    accum, layers = train.grad_accum, model.num_layers
    for op in comm_ops(model, train, layout):
        if not issued(op, traffic):
            continue
        sent = bytes_sent(op.collective, op.nbytes, sizes[op.group])
        if op.scope == "layer":
            phase = 0 if op.phase == "forward" else 1
            for table, key in ((layer, op.strategy), (layer_coll, op.collective)):
                table[key][phase] += sent * op.count
                if op.recompute:
                    table[key][2] += sent * op.count
        total = sent * op.count * (layers if op.scope == "layer" else 1) * (accum if op.per == "microbatch" else 1)
        step_by[op.strategy] += total
        by_coll[op.collective] += total

    # Trusted, computed values: construct without re-validation (the planner scores thousands).
    def phases(v: list[float]) -> PhaseBytes:
        if not training:
            return PhaseBytes.model_construct(forward=v[0], backward=None, backward_recompute=None)
        return PhaseBytes.model_construct(forward=v[0], backward=v[1], backward_recompute=v[2])

    return CommEstimate.model_construct(
        per_layer_bytes={k: phases(v) for k, v in layer.items()},
        per_layer_by_collective={k: phases(v) for k, v in layer_coll.items()},
        per_step_bytes=sum(step_by.values()),
        per_step_by_strategy=step_by,
        by_collective=by_coll,
        group_sizes=sizes,
    )


on_change(comm_ops.cache_clear)
on_change(_comm_estimate.cache_clear)

__all__ = ["COLLECTIVES", "CommEstimate", "CommOp", "DKV_ACCUMULATOR_BYTES", "FP32_BYTES", "FSDP_GRAD_BYTES",
           "LAYER_STRATEGIES", "LOSS_REDUCTION_BYTES", "PhaseBytes", "STEP_STRATEGIES", "VOCAB_PARALLEL_CE_REDUCTIONS",
           "comm_estimate", "comm_ops", "fsdp_grad_bytes", "multiplier", "stack_traffic", "tp_local_layer_params",
           "tp_local_other_params", "tp_replicated_layer_params"]
