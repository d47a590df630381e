"""Tensor parallelism (Megatron): its collectives, and the parameters one TP rank holds.

Reads the ``tp`` degree (and the sequence split, for the activation sizes). Per layer and micro-batch,
with X = T x h x d (T = b S / (U R) tokens per GPU): Megatron's two all-reduces forward (after the
attention output projection and after the MLP down projection) and two backward (input gradients of
the QKV and MLP up projections). With ``tp_sequence_parallel`` each all-reduce becomes an all-gather
before and a reduce-scatter after the TP region, forward and (mirrored) backward; DTensor saves the gathered
input for the weight gradient, while Megatron and Transformer Engine save its sequence shard and all-gather
it again in backward (two ops of X, ``CommOp.only_if = "tp_input_regather"``: kept for stacks whose
``memory.tp_saves_gathered_input`` is false). Recompute repeats the block's TP collectives except the last one.

Outside the layers (report bucket ``embedding``): the vocab-parallel embedding (all-reduce, or
reduce-scatter with sequence parallelism), the LM head (input gradient all-reduce, or all-gather and
reduce-scatter), the vocab-parallel cross-entropy's three fp32 all-reduces of T values; prefill
all-gathers the last token's logits. Once per step, the gradients of weights every TP rank holds are
summed over TP: replicated norms and biases under sequence parallelism, and replicated K/V heads when
tp exceeds the KV heads.

Time (overlap class ``tp``, the layer ops): exposed, unless the stack overlaps them with the GEMMs they
feed (``StackTime.tp_comm_overlap``; :mod:`.overlap` prices the chunked pipeline: each collective's first
chunk exposed, the rest hidden behind the pass's GEMMs as far as they last, slowing them). Without that,
a stack with ``StackTime.tp_async_dgrad`` (Megatron, Transformer Engine) still runs each column-parallel
linear's input-gradient reduction beside its weight-gradient GEMM, and its input re-gather beside its
input-gradient GEMM, exposing what exceeds them. The ops outside the layers stay exposed.

No other strategy issues TP traffic; the rest of the cost model sees TP through the TP-local parameter
counts here and the TP-local widths of the kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from ..layout import Layout
from ..model_spec import ModelSpec
from ..moe import mean_layer_params_tp
from ..train_spec import TrainSpec
from .base import Strategy
from .gradients import reduced_gradients
from .overlap import pipelined_exposure, tp_overlap_blocker
from .terms import TP_INPUT_REGATHER, CommOp, PricedOp, Term, TimeContext

#: The vocab-parallel cross-entropy all-reduces three fp32 values per token (max, target, sum-exp).
VOCAB_PARALLEL_CE_REDUCTIONS = 3
FP32_BYTES = 4


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
    if model.moe is not None or model.mla is not None:  # MLA attention, MoE FFNs: the mean layer (moe.py)
        return mean_layer_params_tp(model, tp, attn, mlp) + tp_replicated_layer_params(model)
    return attn + mlp + tp_replicated_layer_params(model)


def tp_replicated_layer_params(model: ModelSpec) -> float:
    """Layer parameters every TP rank holds in full: norms, qk-norms, row-parallel biases."""
    h = model.hidden_size
    return model.norms_per_layer * model.norm_params() + 2 * model.head_dim * model.qk_norm + h * model.attn_out_bias + h * model.mlp_bias


def tp_local_other_params(model: ModelSpec, tp: int) -> float:
    """Embedding (vocab-parallel), learned positions, LM head (vocab-parallel) and final norm."""
    h = model.hidden_size
    vocab = model.vocab_size * h / tp
    positions = model.embedding_params() - model.vocab_size * h
    head = 0 if model.tied_embeddings else vocab
    return vocab + positions + head + model.norm_params()


def tp_local_embedding_params(model: ModelSpec, tp: int) -> float:
    """The input embedding's vocab-parallel shard (the token table only)."""
    return model.vocab_size * model.hidden_size / tp


def tp_local_params(model: ModelSpec, layout: Layout) -> float:
    """Every parameter one TP rank holds (all layers, embedding, head, final norm)."""
    return tp_local_layer_params(model, layout.tp) * model.num_layers + tp_local_other_params(model, layout.tp)


def merged(strategy: str, group: str, phase: str, entries: list[tuple[str, float, str]], **kw) -> Iterator[CommOp]:
    """Ops for (collective, size, label) entries, merging equal (collective, size) into one op with a
    count (fewer ops keep the planner's per-layout cost low; labels are joined)."""
    groups: dict[tuple[str, float], list[str]] = {}
    for coll, size, label in entries:
        groups.setdefault((coll, size), []).append(label)
    for (coll, size), labels in groups.items():
        yield CommOp(strategy, coll, group, float(size), phase, count=len(labels), label=" + ".join(labels), **kw)


class TPLayerComm(NamedTuple):
    """One layer's TP collectives priced (seconds per micro-batch, counts included): forward all-gathers,
    reduce-scatters and all-reduces; in backward the column-parallel linears' input-gradient all-reduces
    (reduce-scatters under sequence parallelism) and everything else (the row-parallel output-gradient
    all-gathers, recompute)."""

    forward_gather: float = 0.0
    forward_scatter: float = 0.0
    forward_reduce: float = 0.0
    backward: float = 0.0
    backward_dgrad: float = 0.0
    backward_regather: float = 0.0


class TensorParallel(Strategy):
    name = "tp"
    layer_buckets = ("tp",)
    model_buckets = ("embedding",)
    overlap_classes = ("tp",)

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
        if layout.tp == 1:
            return
        yield from _layer_ops(model, train, layout)
        if train.is_training:
            yield from _replicated_gradient_ops(model, train, layout)
        yield from _embedding_ops(model, train, layout)

    def condense(self, overlap_class: str, ops: tuple[PricedOp, ...]) -> TPLayerComm:
        gather = scatter = reduce = backward = dgrad = regather = 0.0
        for priced in ops:
            t = priced.seconds * priced.op.count
            if priced.op.only_if == TP_INPUT_REGATHER:
                regather += t
            elif priced.op.phase != "forward":
                # The backward reductions of a layer are the column-parallel input gradients' (the
                # row-parallel ones' backward is an all-gather, or nothing without sequence parallelism).
                if not priced.op.recompute and priced.op.collective in ("all_reduce", "reduce_scatter"):
                    dgrad += t
                else:
                    backward += t
            elif priced.op.collective == "all_gather":
                gather += t
            elif priced.op.collective == "reduce_scatter":
                scatter += t
            else:
                reduce += t
        return TPLayerComm(gather, scatter, reduce, backward, dgrad, regather)

    def exposed(self, ctx: TimeContext) -> Iterator[Term]:
        comm = ctx.priced.get("tp")
        if not isinstance(comm, TPLayerComm):
            return
        forward = comm.forward_gather + comm.forward_scatter + comm.forward_reduce
        regather = comm.backward_regather
        backward = comm.backward + comm.backward_dgrad + regather
        if tp_overlap_blocker(ctx.stack, ctx.train, ctx.layout) is not None:
            yield Term("exposed_comm", forward, "layer_forward", "tp")
            if not ctx.training:
                return
            # tp_async_dgrad: each column-parallel linear issues its input re-gather before its input-gradient
            # GEMM and its input-gradient reduction before its weight-gradient GEMM, waiting only after them.
            exposed_b = (comm.backward + _column_exposure(ctx, comm, regather) if ctx.stack.tp_async_dgrad
                         else backward)
            yield Term("exposed_comm", exposed_b, "layer_backward", "tp")
            if backward > exposed_b:
                yield Term("hidden_comm", backward - exposed_b, "layer_backward", "tp")
                yield Term("interference", ctx.slowdown * (backward - exposed_b), "layer_backward")
            return
        tp, stack, ct = ctx.layout.tp, ctx.stack, ctx.compute
        rs_chunks = stack.tp_overlap_reduce_scatter_chunks or tp
        exposed_f = comm.forward_reduce + pipelined_exposure(
            ((comm.forward_gather, tp), (comm.forward_scatter, rs_chunks)), ct.layer_gemm_forward)
        hidden_f = forward - exposed_f
        yield Term("exposed_comm", exposed_f, "layer_forward", "tp")
        yield Term("hidden_comm", hidden_f, "layer_forward", "tp")
        yield Term("interference", _forward_interference(ctx, comm, hidden_f, rs_chunks), "layer_forward")
        if not ctx.training:
            return
        if stack.tp_comm_overlap == "userbuffers":
            # TE's bulk overlaps (qkv/fc1 dgrad and wgrad, get_default_config's "bulk" method): the input
            # re-gather beside the input-gradient GEMM, the input-gradient reduce-scatter beside the
            # weight-gradient GEMM; the row-parallel output-gradient all-gathers ring-exchange in tp chunks.
            row_gemms = max(0.0, ct.layer_gemm_backward - sum(ct.layer_column_dgrad) - sum(ct.layer_column_wgrad))
            exposed_b = (pipelined_exposure(((comm.backward, tp),), row_gemms)
                         + _column_exposure(ctx, comm, regather))
        else:
            exposed_b = pipelined_exposure(((backward, tp),), ct.layer_gemm_backward)
        yield Term("exposed_comm", exposed_b, "layer_backward", "tp")
        yield Term("hidden_comm", backward - exposed_b, "layer_backward", "tp")
        yield Term("interference", ctx.slowdown * (backward - exposed_b), "layer_backward")


def _column_exposure(ctx: TimeContext, comm: TPLayerComm, regather: float) -> float:
    """What the column-parallel linears' backward collectives expose when each runs beside one GEMM of its
    own linear (the re-gather beside the input gradient's, the input-gradient reduction beside the weight
    gradient's): the part of each that exceeds its GEMM. Two such linears per layer, equal traffic each."""
    ct = ctx.compute
    return sum(max(0.0, comm.backward_dgrad / 2 - wgrad_s) + max(0.0, regather / 2 - dgrad_s)
               for dgrad_s, wgrad_s in zip(ct.layer_column_dgrad, ct.layer_column_wgrad, strict=True))


def _forward_interference(ctx: TimeContext, comm: TPLayerComm, hidden: float, rs_chunks: int) -> float:
    """Compute slowed by the hidden forward transfers: the kernel model's NCCL slowdown per hidden second,
    except where the stack takes SMs from the GEMM for the reduce-scatter (its share of the hidden time then
    runs on the remaining SMs)."""
    margin, sms = ctx.stack.tp_overlap_sm_margin, ctx.kernels.sms
    if margin <= 0 or margin >= sms:
        return ctx.slowdown * hidden
    tp = ctx.layout.tp
    # The hidden time in proportion to the chunks each collective can hide (all but the first).
    gather, scatter = comm.forward_gather * (tp - 1) / tp, comm.forward_scatter * (rs_chunks - 1) / rs_chunks
    scatter_hidden = hidden * scatter / (gather + scatter) if gather + scatter > 0 else 0.0
    return ctx.slowdown * (hidden - scatter_hidden) + scatter_hidden * margin / (sms - margin)


def _activation_bytes(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """X: one micro-batch's hidden states on this rank (T tokens x h x d)."""
    tokens = train.micro_batch * train.seq_len / layout.sp
    return tokens * model.hidden_size * train.dtype_bytes


def _layer_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
    x = _activation_bytes(model, train, layout)
    ag, rs, ar = "all_gather", "reduce_scatter", "all_reduce"
    if train.tp_sequence_parallel:
        fwd = [(ag, x, "attention input"), (rs, x, "attention output"), (ag, x, "MLP input"), (rs, x, "MLP output")]
        bwd = [(rs, x, "attention input grad"), (ag, x, "attention output grad"), (rs, x, "MLP input grad"),
               (ag, x, "MLP output grad")]
    else:
        fwd = [(ar, x, "attention output"), (ar, x, "MLP output")]
        bwd = [(ar, x, "attention input grad"), (ar, x, "MLP input grad")]
    yield from merged("tp", "tp", "forward", fwd, overlap="tp")
    if not train.is_training:
        return
    yield from merged("tp", "tp", "backward", bwd, overlap="tp")
    if train.tp_sequence_parallel:
        # Stacks that save only the column-parallel linears' input shard gather it again for the weight
        # gradient (Megatron, Transformer Engine); DTensor saves the gathered input.
        again_for_wgrad = [(ag, x, "attention input re-gather (weight gradient)"),
                           (ag, x, "MLP input re-gather (weight gradient)")]
        yield from merged("tp", "tp", "backward", again_for_wgrad, overlap="tp", only_if=TP_INPUT_REGATHER)
    # Recompute re-runs the block's TP collectives except the last one (the MLP output's reduce-scatter /
    # all-reduce): PyTorch's non-reentrant checkpoint stops recomputing once the last tensor backward
    # needs is rebuilt, and nothing in backward needs the block's output. Selective and full therefore
    # repeat the same TP traffic.
    again = fwd[:-1] if train.checkpointing in ("selective", "full") else []
    yield from merged("tp", "tp", "backward", [(c, n, f"{lb} (recompute)") for c, n, lb in again], recompute=True,
                      overlap="tp")


def _replicated_gradient_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
    # Gradients of weights every TP rank holds are summed over TP once per step, after the data-parallel
    # reduction: under FSDP the sharded fp32 gradients, without it full gradients in the compute dtype.
    grad_bytes, grad_shard = reduced_gradients(train, layout)
    if train.tp_sequence_parallel:
        # Norms (and row-parallel biases) see only this rank's sequence shard under Megatron SP.
        replicated = tp_replicated_layer_params(model) * model.num_layers + model.norm_params()
        yield CommOp("tp", "all_reduce", "tp", float(replicated * grad_bytes / grad_shard), "backward", scope="model",
                     per="step", label="replicated-parameter gradient all-reduce (sequence parallel)")
    if model.kv_replication(layout.tp) > 1:
        # tp > KV heads: each KV head's K/V weights live on tp / kv ranks that each see other query heads;
        # one all-reduce of a slot per KV head sums the replicas' gradients (sp_plan.runtime.tp).
        kv_weights = 2 * model.num_kv_heads * model.head_dim * (model.hidden_size + model.qkv_bias)
        yield CommOp("tp", "all_reduce", "tp", float(kv_weights * model.num_layers * grad_bytes / grad_shard),
                     "backward", scope="model", per="step",
                     label="replicated K/V-head gradient all-reduce (tp > KV heads)")


def _embedding_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
    x = _activation_bytes(model, train, layout)
    sp_tp = train.tp_sequence_parallel

    def op(collective: str, nbytes: float, phase: str, label: str, count: int = 1) -> CommOp:
        return CommOp("embedding", collective, "tp", float(nbytes), phase, scope="model", count=count, label=label)

    yield op("reduce_scatter" if sp_tp else "all_reduce", x, "forward", "embedding output")
    if not train.is_training:
        yield op("all_gather", train.micro_batch * model.vocab_size * train.dtype_bytes, "forward",
                 "last-token logits")
        return
    if sp_tp:
        yield op("all_gather", x, "backward", "embedding output grad")
        yield op("all_gather", x, "forward", "LM head input")
        yield op("reduce_scatter", x, "backward", "LM head input grad")
    else:
        yield op("all_reduce", x, "backward", "LM head input grad")
    tokens = train.micro_batch * train.seq_len / layout.sp
    yield op("all_reduce", tokens * FP32_BYTES, "forward", "vocab-parallel cross-entropy: max, target, sum-exp",
             count=VOCAB_PARALLEL_CE_REDUCTIONS)


__all__ = [
    "FP32_BYTES",
    "VOCAB_PARALLEL_CE_REDUCTIONS",
    "TPLayerComm",
    "TensorParallel",
    "merged",
    "tp_local_embedding_params",
    "tp_local_layer_params",
    "tp_local_other_params",
    "tp_local_params",
    "tp_replicated_layer_params",
]
