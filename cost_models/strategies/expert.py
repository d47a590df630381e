"""Expert parallelism (EP): the token dispatch and combine all-to-alls, and the experts' own data parallelism.

Reads ``Layout.ep`` (1: nothing to do) and the model's :class:`~sp_plan.cost_models.moe.MoESpec`. The ``ep``
ranks are the innermost ranks of the ZeRO/FSDP shard group (process group ``ep``, see
:func:`sp_plan.cost_models.placement.expert_group_shapes`); each holds ``num_experts / ep`` routed experts.

- **Dispatch and combine** (bucket ``ep``): per MoE layer and micro-batch, one all-to-all sends each rank's
  routed rows to the ranks holding their experts and one brings the expert outputs back: forward two, backward
  two (the combine's gradient is a dispatch, and the other way round), and two more when full recompute re-runs
  the forward. The buffer is the busiest rank's rows (:meth:`MoESpec.rank_routed_rows`: ``load_imbalance`` x
  ``tokens x top_k`` dropless, every local expert at its capacity with a capacity factor) of ``hidden``
  elements in the compute dtype; the all-to-all sends ``(ep - 1) / ep`` of it
  (:meth:`MoESpec.dispatch_bytes` at the mean). Under TP with sequence parallelism a rank dispatches its
  1/tp shard of the tokens, and the experts split over TP get the TP ranks' rows by an all-gather over TP
  (the combine reduce-scatters them back; :func:`sequence_parallel_dispatch`), as Megatron-Core does.
  Across nodes, a stack whose dispatcher sends each token once per remote node (``StackTime.moe_dispatcher``
  deepep/hybridep) moves only :func:`~sp_plan.cost_models.collectives.node_dedup_fabric_fraction` of the
  pairwise exchange's node-crossing bytes (the ops carry their ``(top_k, experts)`` fan-out; the NVLink part
  is priced as the pairwise exchange's, leaving out the fan-out forwarding inside the receiving node). The
  next op of the same micro-batch needs its result: exposed, unless the stack runs another micro-batch's
  compute beside it (``StackTime.moe_a2a_overlap``, overlap class ``ep``; :mod:`.overlap` prices the
  combined 1F1B schedule's slots and its unpaired passes).
  Ops are per layer, so their bytes are scaled by the MoE layers' share of the layers (DeepSeek-V3's 3 dense
  layers send nothing), as the cost model averages a mixed stack elsewhere.
- **Host synchronisation** (``StackTime.moe_host_sync_s``, :mod:`.moe_host`): the GPU idle a dropless
  dispatcher's wait for the token counts leaves per MoE layer pass, a ``host_sync`` term of the forward
  (scaled by the MoE layers' share the same way).
- **Expert data parallelism** (bucket ``fsdp``): the routed experts' ZeRO/FSDP traffic over the
  ``expert_data`` group (shard group / ep ranks, ``ep x tp`` apart), the same ops
  :mod:`.fsdp` issues for the dense weights over the shard group (which leaves the experts out when ep > 1):
  ZeRO-3 gathers forward and again backward and reduce-scatters the gradients (``prefetch``); ZeRO-1/2
  reduce-scatter the gradients (``grad``) and all-gather the updated experts once per step; HSDP all-reduces
  the reduced shard across ``dp_replicate``. ZeRO-0 keeps :mod:`.fsdp`'s data-group all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from .. import degrees
from ..layout import Layout
from ..model_spec import ModelSpec
from ..moe import expert_layer_params
from ..train_spec import TrainSpec
from .base import Strategy
from .gradients import fsdp_grad_bytes
from .moe_host import moe_host_sync_seconds
from .overlap import a2a_overlap_blocker, a2a_pair_exposure, unpaired_fraction
from .terms import CommOp, PricedOp, Term, TimeContext


def sequence_parallel_dispatch(train: TrainSpec, layout: Layout) -> bool:
    """Whether each TP rank dispatches only its 1/tp sequence shard: under TP with sequence parallelism the
    MoE block's input is that shard (Megatron-Core's MoELayer refuses TP without it in training), and the
    rows the TP ranks receive are all-gathered over TP for the experts split over it (``token_dispatcher.py``
    MoEAlltoAllTokenDispatcher: ``gather_from_sequence_parallel_region`` over the expert-TP group after the
    all-to-all, ``reduce_scatter_to_sequence_parallel_region`` before the combine)."""
    return layout.tp > 1 and train.tp_sequence_parallel


def dispatch_buffer_bytes(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """One dispatch (or combine) all-to-all's buffer on the busiest rank, per mean layer (bytes)."""
    moe = model.moe
    tokens = train.micro_batch * train.seq_len / layout.sp
    if sequence_parallel_dispatch(train, layout):
        tokens /= layout.tp
    rows = moe.rank_routed_rows(tokens, layout.ep)
    return rows * model.hidden_size * train.dtype_bytes * model.moe_layer_count / model.num_layers


class DispatchComm(NamedTuple):
    """Seconds of one dispatch (or combine) all-to-all of a mean layer, and one layer's all-to-alls per
    micro-batch: forward, backward (recompute included)."""

    one: float = 0.0
    forward: float = 0.0
    backward: float = 0.0


class ExpertParallel(Strategy):
    name = "expert"
    layer_buckets = ("ep",)
    overlap_classes = ("ep",)

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
        if layout.ep == 1 or model.moe is None:
            return
        buf = dispatch_buffer_bytes(model, train, layout)
        fan = (model.moe.top_k, model.moe.num_experts)  # what a per-node deduplicating dispatcher saves on
        yield CommOp("ep", "all_to_all", "ep", buf, "forward", count=2, overlap="ep", label="token dispatch + combine",
                     node_dedup=fan)
        if train.is_training:
            yield CommOp("ep", "all_to_all", "ep", buf, "backward", count=2, overlap="ep",
                         label="combine gradient + dispatch gradient", node_dedup=fan)
            if train.checkpointing == "full":
                yield CommOp("ep", "all_to_all", "ep", buf, "backward", count=2, recompute=True, overlap="ep",
                             label="token dispatch + combine (recompute)", node_dedup=fan)
        if sequence_parallel_dispatch(train, layout):
            # The received rows gathered over TP (forward dispatch; backward: the combine's gradient) and the
            # expert outputs reduce-scattered back (forward combine; backward: the dispatch's gradient).
            gathered = buf * layout.tp
            passes = [("forward", False)] + ([("backward", False)] if train.is_training else [])
            if train.is_training and train.checkpointing == "full":
                passes.append(("backward", True))
            for phase, recompute in passes:
                for collective in ("all_gather", "reduce_scatter"):
                    yield CommOp("ep", collective, "tp", gathered, phase, recompute=recompute, overlap="ep",
                                 label=f"expert rows {collective.replace('_', '-')} over TP")
        yield from _expert_sharding_ops(model, train, layout)

    def condense(self, overlap_class: str, ops: tuple[PricedOp, ...]) -> DispatchComm:
        forward = backward = 0.0
        for priced in ops:
            t = priced.seconds * priced.op.count
            if priced.op.phase == "forward":
                forward += t
            else:
                backward += t
        # One slot of the combined schedule: a dispatch (all-to-all, then its TP gather) or a combine
        # (TP reduce-scatter, then the all-to-all); the forward has two.
        return DispatchComm(forward / 2, forward, backward)

    def exposed(self, ctx: TimeContext) -> Iterator[Term]:
        idle = moe_host_sync_seconds(ctx.stack, ctx.model, ctx.train, ctx.layout)
        if idle > 0:  # the dispatcher's host synchronisation, in the forward where the host waits
            yield Term("host_sync", idle, "layer_forward")
        comm = ctx.priced.get("ep")
        if not isinstance(comm, DispatchComm):
            return
        if a2a_overlap_blocker(ctx.stack, ctx.model, ctx.train, ctx.layout) is not None:
            yield Term("exposed_comm", comm.forward, "layer_forward", "ep")
            if ctx.training:
                yield Term("exposed_comm", comm.backward, "layer_backward", "ep")
            return
        # Paired passes: one forward and one backward of different micro-batches share the layer's slots.
        ct = ctx.compute
        ffn_f, ffn_b = ct.layer_ffn_forward, ct.layer_ffn_backward
        attention_f, attention_b = max(0.0, ct.layer_forward - ffn_f), max(0.0, ct.layer_backward - ffn_b)
        paired = a2a_pair_exposure(comm.one, attention_f, ffn_f, attention_b, ffn_b)
        alone = unpaired_fraction(ctx.layout.pp, ctx.train.grad_accum)
        exposed_f = alone * comm.forward + (1 - alone) * paired / 2
        exposed_b = alone * comm.backward + (1 - alone) * paired / 2
        for exposed, total, at in ((exposed_f, comm.forward, "layer_forward"),
                                   (exposed_b, comm.backward, "layer_backward")):
            yield Term("exposed_comm", exposed, at, "ep")
            yield Term("hidden_comm", total - exposed, at, "ep")
            yield Term("interference", ctx.slowdown * (total - exposed), at)


def _expert_sharding_ops(model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
    """The routed experts' ZeRO/FSDP traffic over the expert data-parallel group (see the module doc)."""
    params = expert_layer_params(model, layout.tp, layout.ep, layout.ep)
    stage, group = train.zero_stage, layout.expert_data_parallel
    layer, grads = params * train.dtype_bytes, params * fsdp_grad_bytes(train) if train.is_training else 0.0
    if not train.is_training:
        if stage == 3 and group > 1:
            yield CommOp("fsdp", "all_gather", "expert_data", layer, "forward", overlap="prefetch",
                         label="expert all-gather")
        return
    if stage == 0:
        return
    pipelined = layout.pp > 1
    grad_per = "step" if stage == 1 or pipelined else "microbatch"
    if group > 1:
        if stage == 3:
            yield CommOp("fsdp", "all_gather", "expert_data", layer, "forward", per="step" if pipelined else "microbatch",
                         overlap="prefetch", label="expert all-gather")
            if not pipelined:
                yield CommOp("fsdp", "all_gather", "expert_data", layer, "backward", overlap="prefetch",
                             label="expert re-gather")
        yield CommOp("fsdp", "reduce_scatter", "expert_data", grads, "backward", per=grad_per,
                     overlap="prefetch" if stage == 3 else "grad", label="expert gradient reduce-scatter")
        if stage in (1, 2):
            yield CommOp("fsdp", "all_gather", "expert_data", layer * model.num_layers, "step", scope="model",
                         per="step", label="updated expert all-gather")
    for dim in degrees.replicate_dims():
        if getattr(layout, dim) > 1:
            yield CommOp("dp", "all_reduce", dim, grads / group, "backward", per=grad_per, overlap="grad",
                         label="expert gradient shard all-reduce across replicas")


__all__ = ["DispatchComm", "ExpertParallel", "dispatch_buffer_bytes", "sequence_parallel_dispatch"]
