"""The format gradients are reduced in: what every strategy that sums gradients must agree on.

FSDP reduces in fp32 (:data:`FSDP_GRAD_BYTES`) and leaves each rank its shard; without parameter
sharding (ZeRO-0), gradients stay full and in the compute dtype. TP's reductions of replicated
weights' gradients run after the data-parallel ones, on whatever they left behind, so both the
data-parallel strategy and TP read this module (which reads only the ZeRO/FSDP shard group).
"""

from __future__ import annotations

from ..layout import Layout
from ..train_spec import TrainSpec

#: Gradient bytes per parameter in FSDP's reduce-scatter and everything downstream of it (sp_plan.runtime.fsdp
#: uses MixedPrecisionPolicy(reduce_dtype=fp32), torchtitan's default: summing bf16 gradients over
#: many ranks loses precision).
FSDP_GRAD_BYTES = 4


def fsdp_grad_bytes(train: TrainSpec) -> int:
    """Bytes per gradient element in FSDP's reductions: fp32 (:data:`FSDP_GRAD_BYTES`), except under
    ``adamw_bf16``, whose parameters, gradients and reductions all stay in the compute dtype."""
    return train.dtype_bytes if train.optimizer == "adamw_bf16" else FSDP_GRAD_BYTES


def reduced_gradients(train: TrainSpec, layout: Layout) -> tuple[int, int]:
    """(bytes per element, ranks sharing the tensor) of a gradient once the data-parallel reduction is
    done: FSDP's sharded, reduce-dtype gradients under ZeRO >= 1, else full gradients in the compute
    dtype."""
    if train.zero_stage >= 1:
        return fsdp_grad_bytes(train), layout.shard_group
    return train.dtype_bytes, 1


def data_ranks(layout: Layout) -> int:
    """Ranks that see different tokens and so reduce gradients and the loss: every rank but TP's."""
    return layout.data_ranks


__all__ = ["FSDP_GRAD_BYTES", "data_ranks", "fsdp_grad_bytes", "reduced_gradients"]
