"""Host-bound MoE layers: the GPU idle a dropless dispatcher's host synchronisation leaves in every MoE layer.

A dropless MoE layer does not know, until its router has run, how many rows each expert receives, and the
host needs that number to size the permuted buffer and the grouped GEMM's splits. Megatron-Core's
dispatchers therefore copy the counts to the host and wait for them once per MoE layer forward: the alltoall
dispatcher at its ``cuda_sync_point`` (``token_dispatcher.py`` ``_maybe_dtoh_and_synchronize``), Hybrid-EP
through ``tokens_per_expert.sum()`` when no upper bound is set ("None means no up-bound, will cause a CPU
sync"), DeepEP in ``fused_a2a.py`` ("the CPU will wait for GPU's signal to arrive"). While the host waits,
nothing is queued behind the layer; after it, the GPU waits while Python launches the layer's next kernels.
The combined 1F1B schedule (``StackTime.moe_a2a_overlap``) fills those gaps with another micro-batch's
work, except in the passes that run unpaired; a CUDA graph of the whole MoE layer (``moe`` scope, static
drop-and-pad shapes) or of the whole iteration (sync-free MoE) has no synchronisation to wait on.

The stack's ``moe_host_sync_s`` is that idle per MoE layer pass (forward and backward of one micro-batch)
beyond the per-layer ``layer_overhead_s`` the stack already charges. The term is the idle itself, added to
the layer's forward (where the host waits), not a ``max(device, host)`` floor: the published measurement it
comes from is a GPU-idle time (step time minus the union of GPU-active intervals), not a host launch time.
"""

from __future__ import annotations

from ..layout import Layout
from ..model_spec import ModelSpec
from ..stack import StackTime
from ..train_spec import TrainSpec
from .overlap import a2a_overlap_blocker, unpaired_fraction

#: CUDA graph scopes that capture the MoE layer's dispatch, so nothing waits on the host inside the step.
GRAPHED_MOE_SCOPES = frozenset({"moe", "full_iteration"})


def moe_host_sync_blocker(stack: StackTime, model: ModelSpec, train: TrainSpec, layout: Layout) -> str | None:
    """Why no MoE host-sync idle is priced for this plan, or None when it is."""
    if stack.moe_host_sync_s <= 0:
        return "the stack file sets no moe_host_sync_s"
    if model.moe is None or layout.ep == 1:
        return "ep = 1 (not priced: the measurement behind the value ran expert parallelism)"
    if not train.is_training:
        return "forward only (the value is per forward and backward pass)"
    graphed = GRAPHED_MOE_SCOPES.intersection(stack.cuda_graph_scope)
    if graphed:
        return f"the MoE layer is in a CUDA graph (scope {', '.join(sorted(graphed))}): no host synchronisation"
    return None


def moe_host_sync_share(stack: StackTime, model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """Share of the MoE layer passes whose host-sync idle stays on the critical path: all of them without
    the all-to-all overlap, the unpaired ones with it (0 when no idle is priced)."""
    if moe_host_sync_blocker(stack, model, train, layout) is not None:
        return 0.0
    if a2a_overlap_blocker(stack, model, train, layout) is not None:
        return 1.0
    return unpaired_fraction(layout.pp, train.grad_accum)


def moe_host_sync_seconds(stack: StackTime, model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """Idle seconds per mean layer and micro-batch (forward and backward together): ``moe_host_sync_s`` x the
    exposed share x the MoE layers' share of the layers (DeepSeek-V3's dense layers do not synchronise)."""
    share = moe_host_sync_share(stack, model, train, layout)
    if share == 0.0:
        return 0.0
    return stack.moe_host_sync_s * share * model.moe_layer_count / model.num_layers


def moe_host_sync_note(stack: StackTime, stack_name: str, model: ModelSpec, train: TrainSpec,
                       layout: Layout) -> str:
    """Where the priced host-sync idle comes from, or why there is none, for ``--explain-time``."""
    blocker = moe_host_sync_blocker(stack, model, train, layout)
    if blocker is not None:
        return f"none: {blocker}"
    share = moe_host_sync_share(stack, model, train, layout)
    scope = ", ".join(stack.cuda_graph_scope) or "nothing"
    return (f"stack file {stack_name}: moe_host_sync_s {stack.moe_host_sync_s * 1e3:.3g} ms per MoE layer pass, "
            f"{share:.0%} of passes exposed ({'no all-to-all overlap' if share == 1.0 else 'unpaired passes'}); "
            f"CUDA graphs capture {scope}")


__all__ = ["GRAPHED_MOE_SCOPES", "moe_host_sync_blocker", "moe_host_sync_note", "moe_host_sync_seconds",
           "moe_host_sync_share"]
