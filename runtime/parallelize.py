"""Parallelise one model part for a plan: the concerns in a fixed order, one small ``apply_*`` each.

:func:`parallelize` runs, on a part (the whole model, or a pipeline stage):

1. :func:`apply_tp`: tensor parallelism over the ``tp`` dim, on the full, rank-0-synchronised weights,
   before anything shards them further;
2. :func:`apply_sp_attention`: the model's attention becomes the planned sequence-parallel attention;
3. :func:`apply_checkpointing`: the plan's checkpointing mode per block, with the checkpointed block
   inputs offloaded to host memory when the plan says ``offload_checkpoints``;
4. :func:`apply_tiled_mlp`: the MLP runs over sequence tiles when the plan says ``tiled_mlp``;
5. :func:`apply_expert_parallel`: with ``ep > 1``, each MoE block's experts split over the ``ep`` dim, tokens
   dispatched to them (:mod:`sp_plan.runtime.expert_parallel`);
6. :func:`apply_fsdp`: FSDP2 per experts module (over the expert data dim), per block, the untied embedding and
   the root.

Each step asks the part's :class:`~sp_plan.runtime.models.base.ModelAdapter` to do the family-specific
work, so the order lives here once (torchtitan's ``parallelize_<family>``, without one per family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.runtime.context import SequenceParallel
from sp_plan.runtime.fsdp import (DTYPES, expert_data_parallel_mesh, fully_shard_kwargs, fully_shard_units,
                                  needs_compute_dtype_params)
from sp_plan.runtime.mesh import RuntimeMesh
from sp_plan.runtime.models.base import ModelAdapter
from sp_plan.runtime.planning import refuse_unsupported


@dataclass
class ParallelizedPart:
    """A part after :func:`parallelize`: the (FSDP2-wrapped) module and the state its techniques keep."""

    module: nn.Module
    #: The TP state (sp_plan.runtime.tp.TensorParallel) when the plan has tp > 1, else None.
    tensor_parallel: Any = None
    #: The checkpoint offload (sp_plan.runtime.offload.CheckpointOffload) when the plan offloads checkpoints.
    checkpoint_offload: Any = None


def apply_tp(part: nn.Module, adapter: ModelAdapter, plan, mesh: RuntimeMesh) -> Any:
    """Shard the projections, vocabulary and loss over the ``tp`` dim; the TensorParallel state or None."""
    if plan.layout.tp == 1:
        return None
    refuse_unsupported(plan, adapter)
    return adapter.apply_tensor_parallel(part, mesh, plan.train.tp_sequence_parallel)


def apply_sp_attention(part: nn.Module, adapter: ModelAdapter, sp: SequenceParallel, seq_len: int) -> None:
    """Route the part's attention through the planned sequence-parallel attention."""
    adapter.swap_attention(part, sp, seq_len)


def apply_checkpointing(part: nn.Module, adapter: ModelAdapter, train: TrainSpec) -> Any:
    """Checkpointing mode per block and, with ``offload_checkpoints``, the host offload of each block's
    checkpointed input; returns the CheckpointOffload or None."""
    return adapter.set_checkpointing(part, train.checkpointing, train.offload_checkpoints)


def apply_tiled_mlp(part: nn.Module, adapter: ModelAdapter, plan) -> None:
    """Tile every block's MLP over the sequence when the plan says so."""
    if plan.train.tiled_mlp:
        refuse_unsupported(plan, adapter)
        adapter.apply_tiled_mlp(part)


def apply_expert_parallel(part: nn.Module, adapter: ModelAdapter, plan, mesh: RuntimeMesh) -> list[nn.Module]:
    """Split the part's experts over the ``ep`` dim (``ep > 1`` only); returns the experts modules."""
    if plan.layout.ep == 1:
        return []
    refuse_unsupported(plan, adapter)
    return adapter.apply_expert_parallel(part, mesh["ep"])


def apply_fsdp(part: nn.Module, adapter: ModelAdapter, plan, mesh: RuntimeMesh,
               experts: list[nn.Module] | None = None) -> nn.Module:
    """FSDP2 per block, untied input embedding, and root (:func:`sp_plan.runtime.fsdp.fully_shard_units`), with
    the plan's mixed precision, ZeRO stage and parameter offload; the tiled loss's hidden-states method
    registered as an FSDP forward method (so the root's norm and lm_head are gathered around it)."""
    train = plan.train
    in_compute_dtype = needs_compute_dtype_params(train)
    if in_compute_dtype:
        # No fp32 master copy on the device: adamw_bf16 has none, offload_optimizer keeps it on the host.
        part.to(DTYPES[train.dtype])
    if train.tiled_loss:
        adapter.prepare_hidden_states(part)
    kwargs = fully_shard_kwargs(train, mesh, params_in_compute_dtype=in_compute_dtype)
    embedding = None if plan.model.tied_embeddings else adapter.input_embedding(part)
    if embedding is not None and not any(True for _ in embedding.parameters()):
        embedding = None  # a later pipeline stage's stand-in (nn.Identity): nothing to shard
    fully_shard_units(part, adapter.blocks(part), embedding, kwargs, sum_gradients=True, experts=experts or (),
                      expert_mesh=expert_data_parallel_mesh(mesh) if experts else None)
    if train.tiled_loss:
        # Imported here: torch.distributed.fsdp pulls in DTensor and sympy (~1.5 s per rank process),
        # which a plan without FSDP never needs.
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(part, adapter.hidden_states_method)
    return part


def parallelize(part: nn.Module, adapter: ModelAdapter, plan, mesh: RuntimeMesh,
                sp: SequenceParallel) -> ParallelizedPart:
    """Apply the plan to one model part, in place, in the order above (TP, SP attention, checkpointing,
    tiled MLP, EP, FSDP2). The part's weights must already be the same on every rank."""
    tp = apply_tp(part, adapter, plan, mesh)
    apply_sp_attention(part, adapter, sp, plan.train.seq_len)
    offload = apply_checkpointing(part, adapter, plan.train)
    apply_tiled_mlp(part, adapter, plan)
    experts = apply_expert_parallel(part, adapter, plan, mesh)
    module = apply_fsdp(part, adapter, plan, mesh, experts)
    return ParallelizedPart(module=module, tensor_parallel=tp, checkpoint_offload=offload)
