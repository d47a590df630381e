"""FSDP2 (``fully_shard``) settings from a plan: mesh, mixed precision, parameter offload, resharding.

:func:`fully_shard_kwargs` turns the plan's ZeRO stage and offload options into ``fully_shard``'s
keyword arguments, and :func:`apply_fsdp` wraps a runtime Llama model with them (each block, then
the root, the standard FSDP2 recipe). What the plan's options mean here:

- the mesh is the ``fsdp`` dim (dp_shard x ring x ulysses, ``Layout.shard_group``); with
  ``dp_replicate > 1`` it is the 2-D (dp_replicate, fsdp) mesh, i.e. HSDP;
- ``zero_stage=3``: parameters resharded after forward (gathered again in backward), except under
  pipeline stages, where a stage keeps them gathered through the step (as torchtitan; the cost model too);
  ``zero_stage`` 1 or 2: kept gathered from forward to backward (``reshard_after_forward=False``);
  FSDP2 always shards gradients and optimizer states, so 1 behaves as 2 (for ZeRO-1's single
  reduce-scatter per step, skip gradient sync on all but the last micro-batch:
  ``model.set_requires_gradient_sync(last)``); ``zero_stage=0`` is plain data parallelism (DDP), not
  FSDP, and is refused here;
- mixed precision: parameters are gathered in the compute dtype and gradients reduced in fp32
  (``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)``), the fp32 sharded parameters
  being the master weights (bf16 training keeps 2 + 2 + 12 bytes per parameter, as the memory model);
  ``adamw_bf16`` has no master copy: the model is cast to the compute dtype first and gradients are
  reduced in it;
- ``offload_params``: ``CPUOffloadPolicy``: sharded parameters, their gradients and the optimizer
  step live in host memory (pinned on CUDA), the memory model's
  ``offload_params_moves_grads_and_optimizer`` semantics; build the optimizer on ``model.parameters()``
  as usual (they are CPU tensors then);
- ``offload_optimizer`` without ``offload_params``: FSDP2 has no such mode (its offload policy moves
  parameters too). :class:`sp_plan.runtime.host_optimizer.HostOffloadOptimizer` provides it (ZeRO-Offload):
  device-resident parameters in the compute dtype and fp32 master weights, moments and gradients on the
  host. Create the model in the compute dtype for this mode (no parameter cast: ``param_dtype=None``).

Order: tensor parallelism first (:func:`sp_plan.runtime.tp.apply_tensor_parallel`), then
:func:`apply_fsdp`, then the optimizer. Activation checkpointing, checkpoint offload and the tiled MLP
live inside each block's forward and may be set before or after.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sp_plan.cost_models import degrees
from sp_plan.cost_models.train_spec import TrainSpec

from .errors import RuntimeConfigError

#: Compute dtypes of a TrainSpec.
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Gradients are reduced in fp32 (the memory model's fp32 gradient shards under mixed precision).
REDUCE_DTYPE = torch.float32


def data_parallel_mesh(mesh) -> Any:
    """The mesh FSDP2 shards over: ``fsdp`` (1-D), or (dp_replicate, fsdp) for HSDP."""
    replicas = [dim for dim in degrees.replicate_dims() if getattr(mesh.layout, dim) > 1]
    if len(replicas) > 1:
        raise RuntimeConfigError(f"FSDP2 replicates over one mesh dim, but this plan replicates over "
                                 f"{' x '.join(replicas)}: keep all but one of them at 1")
    if replicas:
        with warnings.catch_warnings():  # slicing a flattened dim from the root mesh: still the way in 2.13
            warnings.simplefilter("ignore", UserWarning)
            return mesh.device_mesh[(replicas[0], "fsdp")]
    return mesh["fsdp"]


def expert_data_parallel_mesh(mesh) -> Any:
    """The mesh FSDP2 shards a rank's experts over under expert parallelism: ``expert_data``, the shard group's
    ranks that hold the same experts. HSDP (a replicate dim above it) is not wired for the experts yet."""
    replicas = [dim for dim in degrees.replicate_dims() if getattr(mesh.layout, dim) > 1]
    if replicas:
        dim = replicas[0]
        raise RuntimeConfigError(f"expert parallelism with {dim}={getattr(mesh.layout, dim)} (HSDP) is not "
                                 f"implemented: the experts would need their own replicate dim; use --{dim.replace('_', '-')} 1")
    return mesh["expert_data"]


def needs_compute_dtype_params(train: TrainSpec) -> bool:
    """Whether the model's parameters must already be in the compute dtype before ``fully_shard``.

    ``adamw_bf16`` has no fp32 master copy (the parameters themselves are low precision), and
    ``offload_optimizer`` alone keeps its fp32 masters on the host (:mod:`sp_plan.runtime.host_optimizer`).
    """
    if train.dtype == "fp32":
        return False
    return train.optimizer == "adamw_bf16" or (train.offload_optimizer and not train.offload_params)


def fully_shard_kwargs(train: TrainSpec, mesh, *, params_in_compute_dtype: bool = False) -> dict[str, Any]:
    """``fully_shard`` keyword arguments for ``train`` (a TrainSpec) on ``mesh`` (a RuntimeMesh).

    ``params_in_compute_dtype``: the model was created in the compute dtype (required when
    :func:`needs_compute_dtype_params`), so FSDP2 must not cast parameters. Gradients are reduced in
    fp32 except under ``adamw_bf16``, where they stay in the parameters' dtype (the comm model's
    ``fsdp_grad_bytes``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    if train.zero_stage == 0:
        raise RuntimeConfigError(
            "zero_stage 0 replicates parameters (DDP), which FSDP2 does not do; use zero_stage 1-3 for fully_shard, "
            "or wrap the model with DistributedDataParallel"
        )
    if needs_compute_dtype_params(train) and not params_in_compute_dtype:
        why = ("adamw_bf16 keeps no fp32 master weights" if train.optimizer == "adamw_bf16" else
               "offload_optimizer keeps fp32 master weights on the host")
        raise RuntimeConfigError(
            f"{why}: create the model in the compute dtype ({train.dtype}) and pass params_in_compute_dtype=True"
            + ("" if train.optimizer == "adamw_bf16" else ", then use sp_plan.runtime.host_optimizer.HostOffloadOptimizer")
        )
    compute = DTYPES[train.dtype]
    cast = compute != torch.float32 and not params_in_compute_dtype
    # fp32 training reduces in the parameters' own dtype (fp32; fp64 in exactness tests).
    reduce = None if train.optimizer == "adamw_bf16" or compute == torch.float32 else REDUCE_DTYPE
    mp = MixedPrecisionPolicy(param_dtype=compute if cast else None, reduce_dtype=reduce)
    device_type = mesh.device.type
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if train.offload_params else OffloadPolicy()
    return {
        "mesh": data_parallel_mesh(mesh),
        "mp_policy": mp,
        "offload_policy": offload,
        # Under pipeline stages a stage's micro-batches interleave forwards and backwards; torchtitan keeps its
        # parameters gathered through the step (no reshard after forward under PP), and so does the cost model
        # (one gather per stage and step). Resharding would gather again for every micro-batch and backward.
        "reshard_after_forward": train.zero_stage == 3 and mesh.layout.pp == 1,
    }


def sharded_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total norm of gradients that FSDP2 shards over one mesh or several (expert parallelism shards the
    experts over (expert_data, ep), the rest over the data dims): one partial norm per mesh, made whole over
    it, then combined. Plain tensors count as they are."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


def clip_sharded_grads_(parameters: Iterable[nn.Parameter], max_norm: float, total: torch.Tensor) -> float:
    """Scale the gradients by ``max_norm / total`` when below 1, one mesh at a time (a foreach over DTensors
    needs them on one mesh); ``total`` is :func:`sharded_grad_norm`'s. Returns ``total``."""
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.dtype))
    return float(total)


def fully_shard_units(root: nn.Module, blocks: Iterable[nn.Module], embedding: nn.Module | None,
                      kwargs: dict[str, Any], *, sum_gradients: bool = False,
                      experts: Iterable[nn.Module] = (), expert_mesh: Any = None) -> nn.Module:
    """``fully_shard`` in the units the comm model assumes; returns ``root``.

    Under expert parallelism, first each block's ``experts`` module on its own over ``expert_mesh``
    (:func:`expert_data_parallel_mesh`: its parameters are already split over ``ep``); each block; an untied
    input ``embedding`` on its own (resharded after forward like the blocks,
    gathered again for its gradient; None when tied); the root with the final norm and the lm_head
    (and a tied embedding), which backward uses first, so it stays gathered after forward.
    ``sum_gradients``: reduce gradients by a plain sum (divide factor 1) instead of FSDP2's mean, for
    losses already normalised by the global token count (:mod:`sp_plan.runtime.loss`); plain SUM collectives,
    which every backend has (gloo included).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for module in experts:
        fully_shard(module, **{**kwargs, "mesh": expert_mesh})
    if embedding is not None:
        fully_shard(embedding, **kwargs)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(root, **{**kwargs, "reshard_after_forward": False})
    if sum_gradients:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return root


def apply_fsdp(model: nn.Module, train: TrainSpec, mesh, *, params_in_compute_dtype: bool = False) -> nn.Module:
    """``fully_shard`` ``model`` (a runtime LlamaModel) in units (:func:`fully_shard_units`); returns it."""
    kwargs = fully_shard_kwargs(train, mesh, params_in_compute_dtype=params_in_compute_dtype)
    embedding = None if model.spec.tied_embeddings else model.embed_tokens
    return fully_shard_units(model, model.layers, embedding, kwargs)
