"""Communication volume: every collective a training (or prefill) step issues, in bytes SENT per GPU.

One list of :class:`CommOp` is the single source of truth: :func:`comm_estimate` sums it into the
``comm`` JSON section and the time model costs each op on the topology. The conventions are the
project's (``BRIEF.md``) and the runtime's byte counters follow the same ones:

Notation: b micro-batch, S sequence length, d bytes of the compute dtype, h hidden, q = heads x
head_dim, tp/U/R the TP, Ulysses and Ring degrees, T = b S / (U R) tokens per GPU (per TP group), rep =
``model.kv_replication(tp x U)``. Sizes below are the collective's size argument (see
:mod:`sp_plan.cost_models.collectives`); sent bytes follow from the group size.

Per transformer layer, per micro-batch:

- **Ulysses** (U > 1): forward all-to-alls of Q (T x heads/tp x head_dim x d), K and V (T x
  kv_heads x rep / tp x head_dim x d: KV heads are replicated *before* the all-to-all when the head
  split exceeds them) and of the output (same size as Q). Backward: dO, dQ, dK, dV, the same bytes
  (replica gradients are summed locally).
- **Ring** (R > 1): blocks of b S/R tokens x kv_heads x rep / (tp U) heads x head_dim. Forward:
  R-1 sends of the K and V blocks (dtype d). Backward: R-1 sends of K and V (dtype d) and R sends of
  the dK and dV accumulators in fp32 (they travel with their blocks and come home).
- **TP** (tp > 1), activation X = T x h x d: Megatron's two all-reduces forward (after the attention
  output projection and after the MLP down projection) and two backward (input gradients of the QKV
  and MLP up projections). With ``tp_sequence_parallel`` each all-reduce becomes an all-gather before
  and a reduce-scatter after the TP region, forward and (mirrored) backward; the gathered input is
  saved for the weight gradient, so it is not re-gathered in backward.
- **FSDP / ZeRO-3** over the shard group (dp_shard x ring x ulysses): all-gather of the layer's TP-local
  weights forward, again in backward (they were resharded), and a reduce-scatter of its gradients.
  With dp_replicate > 1 (HSDP) the reduced gradient shard is all-reduced across replicas ("dp").
  Outside the layers, the embedding, LM head and final norm are gathered once per forward; in
  backward only an untied input embedding is re-gathered (the head is used first, still gathered).
- **ZeRO-2**: reduce-scatter of the layer's gradients each micro-batch (+ HSDP all-reduce); the updated
  parameters are all-gathered once per step. **ZeRO-1**: the gradient reduce-scatter happens once per
  step (in the last micro-batch), then the parameter all-gather. **ZeRO-0 (DDP)**: one all-reduce of
  the gradients per step over the data group (all ranks but TP), bucketed during the last backward.
  Gradients once per step are listed in the layer's backward "as in the micro-batch that reduces them".

Recompute (training): ``full`` re-runs the block forward in backward, so its Ulysses, Ring and TP
forward traffic repeats; ``selective`` repeats the Q/K/V all-to-alls and the TP collectives needed to
rebuild the recomputed parts (QKV input gather, attention output projection, MLP input gather), but
not the attention op (ring pass, output all-to-all). FSDP traffic does not repeat (the backward
gather serves the recompute).

Per micro-batch outside the layers: with TP the vocab-parallel embedding (all-reduce, or
reduce-scatter with sequence parallelism) and LM head (input gradient all-reduce, or all-gather and
reduce-scatter), the vocab-parallel cross-entropy's three fp32 all-reduces of T values (max logit,
target logit, sum of exponentials), FSDP of the embedding/head/final-norm weights, and the loss
reduction (sum and valid-token count, two fp32 scalars) over the data group. With sequence
parallelism, replicated TP parameters (norms, row-parallel biases) get their gradients all-reduced
over TP once per step. Prefill computes logits for the last token only (all-gathered over TP).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from .collectives import COLLECTIVES, bytes_sent
from .layout import Layout
from .model_spec import ModelSpec
from .placement import group_shapes
from .train_spec import TrainSpec

#: Strategies reported per layer (issue 3's JSON keys), and the extra per-step buckets.
LAYER_STRATEGIES: tuple[str, ...] = ("dp", "fsdp", "tp", "ulysses", "ring")
STEP_STRATEGIES: tuple[str, ...] = LAYER_STRATEGIES + ("embedding", "loss")

#: Ring attention's dK/dV accumulators travel in fp32 (brief convention).
DKV_ACCUMULATOR_BYTES = 4
#: The vocab-parallel cross-entropy all-reduces three fp32 values per token (max, target, sum-exp).
VOCAB_PARALLEL_CE_REDUCTIONS = 3
FP32_BYTES = 4
#: Loss reduction: the loss sum and the valid-token count, two fp32 scalars.
LOSS_REDUCTION_BYTES = 2 * FP32_BYTES


class CommOp(NamedTuple):
    """One collective issued per layer (``scope="layer"``) or per model pass (``scope="model"``).

    ``per``: "microbatch" (every micro-batch) or "step" (once per optimizer step). ``overlap``:
    how the time model may hide it: ``exposed`` (on the critical path), ``ring`` (a ring-attention
    hop, hidden behind the next block's compute), ``prefetch`` (FSDP gathers/scatters, hidden behind
    layer compute), ``grad`` (gradient reductions, hidden behind backward compute).
    """

    strategy: str
    collective: str
    group: str
    nbytes: float
    phase: str  # forward | backward | step
    scope: str = "layer"
    per: str = "microbatch"
    count: int = 1
    recompute: bool = False
    overlap: str = "exposed"
    label: str = ""


# ----- parameter counts seen by one TP rank ---------------------------------------------------------


#: Gradient bytes per parameter in FSDP's reduce-scatter and everything downstream of it (sp_plan.runtime.fsdp
#: uses MixedPrecisionPolicy(reduce_dtype=fp32), torchtitan's default: summing bf16 gradients over
#: many ranks loses precision).
FSDP_GRAD_BYTES = 4


def fsdp_grad_bytes(train: TrainSpec) -> int:
    """Bytes per gradient element in FSDP's reductions: fp32 (:data:`FSDP_GRAD_BYTES`), except under
    ``adamw_bf16``, whose parameters, gradients and reductions all stay in the compute dtype."""
    return train.dtype_bytes if train.optimizer == "adamw_bf16" else FSDP_GRAD_BYTES


def tp_local_layer_params(model: ModelSpec, tp: int) -> float:
    """Parameters of one transformer layer held by one TP rank (column/row-parallel split, KV heads
    replicated when tp exceeds them, norms and row-parallel biases replicated)."""
    h, hd, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    q = model.q_size
    kv_local = model.num_kv_heads * model.kv_replication(tp) / tp * hd
    attn = h * q / tp + 2 * h * kv_local + q * h / tp
    attn += (q / tp + 2 * kv_local) * model.qkv_bias
    mlp = (3 if model.activation == "swiglu" else 2) * h * f / tp
    mlp += ((2 * f if model.activation == "swiglu" else f) / tp) * model.mlp_bias
    return attn + mlp + tp_replicated_layer_params(model)


def tp_replicated_layer_params(model: ModelSpec) -> float:
    """Layer parameters every TP rank holds in full: norms, qk-norms, row-parallel biases."""
    h = model.hidden_size
    return 2 * model.norm_params() + 2 * model.head_dim * model.qk_norm + h * model.attn_out_bias + h * model.mlp_bias


def tp_local_other_params(model: ModelSpec, tp: int) -> float:
    """Embedding (vocab-parallel), learned positions, LM head (vocab-parallel) and final norm."""
    h = model.hidden_size
    vocab = model.vocab_size * h / tp
    positions = model.embedding_params() - model.vocab_size * h
    head = 0 if model.tied_embeddings else vocab
    return vocab + positions + head + model.norm_params()


# ----- the op list ---------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def comm_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> tuple[CommOp, ...]:
    """Every collective of one step, per the module docstring (cached: the planner asks repeatedly)."""
    ops: list[CommOp] = []
    training = train.is_training
    d = train.dtype_bytes
    b, s = train.micro_batch, train.seq_len
    tp, u, r = layout.tp, layout.ulysses, layout.ring
    tokens = b * s / (u * r)  # per GPU, per TP group
    hd = model.head_dim
    rep = model.kv_replication(layout.head_split)
    sp_tp = train.tp_sequence_parallel
    ckpt = train.checkpointing if training else "none"

    def add(strategy: str, collective: str, group: str, nbytes: float, phase: str, **kw) -> None:
        ops.append(CommOp(strategy, collective, group, float(nbytes), phase, **kw))

    def add_many(strategy: str, group: str, phase: str, entries: list[tuple[str, float, str]], **kw) -> None:
        """Add (collective, size, label) entries, merging equal (collective, size) into one op with a
        count (fewer ops keep the planner's per-layout cost low; labels are joined)."""
        merged: dict[tuple[str, float], list[str]] = {}
        for coll, size, label in entries:
            merged.setdefault((coll, size), []).append(label)
        for (coll, size), labels in merged.items():
            add(strategy, coll, group, size, phase, count=len(labels), label=" + ".join(labels), **kw)

    # --- Ulysses -------------------------------------------------------------------------------
    if u > 1:
        q_buf = tokens * (model.num_heads / tp) * hd * d
        kv_buf = tokens * (model.num_kv_heads * rep / tp) * hd * d
        a2a = "all_to_all"
        fwd = [(a2a, q_buf, "Q"), (a2a, kv_buf, "K"), (a2a, kv_buf, "V"), (a2a, q_buf, "output")]
        add_many("ulysses", "ulysses", "forward", fwd)
        if training:
            bwd = [(a2a, q_buf, "dO"), (a2a, q_buf, "dQ"), (a2a, kv_buf, "dK"), (a2a, kv_buf, "dV")]
            add_many("ulysses", "ulysses", "backward", bwd)
            again = fwd if ckpt == "full" else fwd[:3] if ckpt == "selective" else []
            add_many("ulysses", "ulysses", "backward", [(c, n, f"{lb} (recompute)") for c, n, lb in again],
                     recompute=True)

    # --- Ring ----------------------------------------------------------------------------------
    if r > 1:
        block = b * (s / r) * (model.num_kv_heads * rep / (tp * u)) * hd
        kv = 2 * block * d
        add("ring", "send_recv", "ring", kv, "forward", count=r - 1, overlap="ring", label="K,V blocks")
        if training:
            add("ring", "send_recv", "ring", kv, "backward", count=r - 1, overlap="ring", label="K,V blocks")
            add("ring", "send_recv", "ring", 2 * block * DKV_ACCUMULATOR_BYTES, "backward", count=r,
                overlap="ring", label="dK,dV accumulators (fp32)")
            if ckpt == "full":
                add("ring", "send_recv", "ring", kv, "backward", count=r - 1, overlap="ring", recompute=True,
                    label="K,V blocks (recompute)")

    # --- Tensor parallel -----------------------------------------------------------------------
    if tp > 1:
        x = tokens * model.hidden_size * d
        ag, rs, ar = "all_gather", "reduce_scatter", "all_reduce"
        if sp_tp:
            fwd = [(ag, x, "attention input"), (rs, x, "attention output"), (ag, x, "MLP input"),
                   (rs, x, "MLP output")]
            bwd = [(rs, x, "attention input grad"), (ag, x, "attention output grad"), (rs, x, "MLP input grad"),
                   (ag, x, "MLP output grad")]
        else:
            fwd = [(ar, x, "attention output"), (ar, x, "MLP output")]
            bwd = [(ar, x, "attention input grad"), (ar, x, "MLP input grad")]
        add_many("tp", "tp", "forward", fwd)
        if training:
            add_many("tp", "tp", "backward", bwd)
            # Recompute re-runs the block's TP collectives except the last one (the MLP output's
            # reduce-scatter / all-reduce): PyTorch's non-reentrant checkpoint stops recomputing once the
            # last tensor backward needs is rebuilt, and nothing in backward needs the block's output.
            # Selective and full therefore repeat the same TP traffic.
            again = fwd[:-1] if ckpt in ("selective", "full") else []
            add_many("tp", "tp", "backward", [(c, n, f"{lb} (recompute)") for c, n, lb in again], recompute=True)

    # --- ZeRO / FSDP / DDP ---------------------------------------------------------------------
    _parameter_ops(add, model, train, layout)

    # --- embedding, LM head, loss ----------------------------------------------------------------
    if tp > 1:
        x = tokens * model.hidden_size * d
        if sp_tp:
            add("embedding", "reduce_scatter", "tp", x, "forward", scope="model", label="embedding output")
        else:
            add("embedding", "all_reduce", "tp", x, "forward", scope="model", label="embedding output")
        if training:
            if sp_tp:
                add("embedding", "all_gather", "tp", x, "backward", scope="model", label="embedding output grad")
                add("embedding", "all_gather", "tp", x, "forward", scope="model", label="LM head input")
                add("embedding", "reduce_scatter", "tp", x, "backward", scope="model", label="LM head input grad")
            else:
                add("embedding", "all_reduce", "tp", x, "backward", scope="model", label="LM head input grad")
            add("embedding", "all_reduce", "tp", tokens * FP32_BYTES, "forward", scope="model",
                count=VOCAB_PARALLEL_CE_REDUCTIONS, label="vocab-parallel cross-entropy: max, target, sum-exp")
        else:
            add("embedding", "all_gather", "tp", b * model.vocab_size * d, "forward", scope="model",
                label="last-token logits")
    if training and layout.world // tp > 1:
        add("loss", "all_reduce", "data", LOSS_REDUCTION_BYTES, "forward", scope="model",
            label="loss sum and valid-token count")
    return tuple(ops)


def _parameter_ops(add, model: ModelSpec, train: TrainSpec, layout: Layout) -> None:
    d = train.dtype_bytes  # parameters travel in the compute dtype (bf16; fp32 when training in fp32)
    tp = layout.tp
    layer = tp_local_layer_params(model, tp) * d
    other = tp_local_other_params(model, tp) * d
    # Gradients are reduced in fp32 under FSDP (sp_plan.runtime.fsdp: MixedPrecisionPolicy(reduce_dtype=fp32)).
    grad_bytes = fsdp_grad_bytes(train)
    layer_grads = tp_local_layer_params(model, tp) * grad_bytes
    other_grads = tp_local_other_params(model, tp) * grad_bytes
    shard = layout.shard_group
    replicate = layout.dp_replicate
    stage = train.zero_stage
    if not train.is_training:
        if stage == 3 and shard > 1:
            add("fsdp", "all_gather", "shard", layer, "forward", overlap="prefetch", label="parameter all-gather")
            add("fsdp", "all_gather", "shard", other, "forward", scope="model", label="embedding/head all-gather")
        return
    if stage == 0:
        if layout.world // tp > 1:
            add("dp", "all_reduce", "data", layer, "backward", per="step", overlap="grad", label="gradient all-reduce")
            add("dp", "all_reduce", "data", other, "backward", scope="model", per="step",
                label="embedding/head gradient all-reduce")
    else:
        grad_per = "step" if stage == 1 else "microbatch"
        if shard > 1:
            if stage == 3:
                add("fsdp", "all_gather", "shard", layer, "forward", overlap="prefetch", label="parameter all-gather")
                add("fsdp", "all_gather", "shard", layer, "backward", overlap="prefetch",
                    label="parameter re-gather")
                add("fsdp", "all_gather", "shard", other, "forward", scope="model", label="embedding/head all-gather")
                # The LM head and final norm are used first in backward, so FSDP keeps them gathered
                # after forward; only an untied input embedding is re-gathered for its gradient.
                embedding = model.vocab_size * model.hidden_size / tp * d
                if not model.tied_embeddings:
                    add("fsdp", "all_gather", "shard", embedding, "backward", scope="model",
                        label="embedding re-gather")
            add("fsdp", "reduce_scatter", "shard", layer_grads, "backward", per=grad_per,
                overlap="prefetch" if stage == 3 else "grad", label="gradient reduce-scatter")
            add("fsdp", "reduce_scatter", "shard", other_grads, "backward", scope="model", per=grad_per,
                label="embedding/head gradient reduce-scatter")
            if stage in (1, 2):
                add("fsdp", "all_gather", "shard", layer * model.num_layers + other, "step", scope="model",
                    per="step", label="updated parameter all-gather")
        if replicate > 1:
            add("dp", "all_reduce", "dp_replicate", layer_grads / shard, "backward", per=grad_per, overlap="grad",
                label="gradient shard all-reduce across replicas")
            add("dp", "all_reduce", "dp_replicate", other_grads / shard, "backward", scope="model", per=grad_per,
                label="embedding/head gradient shard all-reduce across replicas")
    # Gradients of weights every TP rank holds are summed over TP once per step. Under FSDP they are
    # the sharded fp32 gradients (FSDP2's reduce dtype); without it, full gradients in the compute dtype.
    grad_bytes, grad_shard = (grad_bytes, shard) if stage >= 1 else (d, 1)
    if tp > 1 and train.tp_sequence_parallel:
        # Norms (and row-parallel biases) see only this rank's sequence shard under Megatron SP.
        replicated = (tp_replicated_layer_params(model) * model.num_layers + model.norm_params())
        add("tp", "all_reduce", "tp", replicated * grad_bytes / grad_shard, "backward", scope="model", per="step",
            label="replicated-parameter gradient all-reduce (sequence parallel)")
    if tp > 1 and model.kv_replication(tp) > 1:
        # tp > KV heads: each KV head's K/V weights live on tp / kv ranks that each see other query heads;
        # one all-reduce of a slot per KV head sums the replicas' gradients (sp_plan.runtime.tp).
        kv_weights = 2 * model.num_kv_heads * model.head_dim * (model.hidden_size + model.qkv_bias)
        add("tp", "all_reduce", "tp", kv_weights * model.num_layers * grad_bytes / grad_shard, "backward",
            scope="model", per="step", label="replicated K/V-head gradient all-reduce (tp > KV heads)")


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


def comm_estimate(model: ModelSpec, train: TrainSpec, layout: Layout) -> CommEstimate:
    return _comm_estimate(model, train, layout)


@lru_cache(maxsize=4096)
def _comm_estimate(model: ModelSpec, train: TrainSpec, layout: Layout) -> CommEstimate:
    sizes = {name: size for name, (_, size) in group_shapes(layout).items()}
    training = train.is_training
    layer: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in LAYER_STRATEGIES}
    layer_coll: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in COLLECTIVES}
    step_by: dict[str, float] = dict.fromkeys(STEP_STRATEGIES, 0.0)
    by_coll: dict[str, float] = dict.fromkeys(COLLECTIVES, 0.0)
    accum, layers = train.grad_accum, model.num_layers
    for op in comm_ops(model, train, layout):
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
