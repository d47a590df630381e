"""Memory techniques on HF models: the runtime's checkpointing modes and the tiled MLP, on HF's own modules."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.checkpointing import check_mode, run_checkpointed
from sp_plan.runtime.models.hf.model import hf_architecture, hf_decoder_layers, transformers_module
from sp_plan.runtime.tiled_mlp import tile_tokens_for, tiled_gated_mlp

# ----- checkpointing ------------------------------------------------------------------------------------


def set_hf_checkpointing(model: nn.Module, mode: str, offload: Any = None) -> None:
    """Checkpoint every decoder layer with the runtime's ``none``/``selective``/``full`` modes;
    ``offload`` (a :class:`sp_plan.runtime.offload.CheckpointOffload`) keeps each layer's checkpointed input
    (its hidden states) in host memory until backward."""
    check_mode(mode)
    transformers = transformers_module()
    layer_type = transformers.modeling_layers.GradientCheckpointingLayer

    def checkpointed(function, *args):
        return run_checkpointed(function, mode, *args, offload=offload)

    for layer in hf_decoder_layers(model):
        if not isinstance(layer, layer_type):
            raise RuntimeConfigError(
                f"{type(layer).__name__} does not support checkpointing (not a GradientCheckpointingLayer)"
            )
        layer._gradient_checkpointing_func = checkpointed
        layer.gradient_checkpointing = mode != "none"


# ----- tiled MLP -----------------------------------------------------------------------------------------

#: Set on an HF MLP module whose forward runs tiled (so applying twice is harmless).
TILED_ATTRIBUTE = "_sp_plan_tiled"


def apply_hf_tiled_mlp(model: nn.Module, tile_tokens: int | None = None) -> int:
    """Run every decoder layer's MLP of an HF model over sequence tiles (:mod:`sp_plan.runtime.tiled_mlp`).

    The supported families' MLPs are ``down(act(gate(x)) * up(x))``, row-wise, over HF's own projections
    and activation, named by the family's :class:`~sp_plan.runtime.models.hf.architectures.HFArchitecture`:
    the forward is replaced by :func:`sp_plan.runtime.tiled_mlp.tiled_gated_mlp` on those modules (the
    runtime Llama's tiled path, row-parallel down projection under TP included), and the parameters get
    their gradients through the tiled op (FSDP2's gathered parameters during forward). Tile size: the
    memory model's rule (:func:`sp_plan.runtime.tiled_mlp.tile_tokens_for` with the model's hidden size).
    Mixture-of-experts blocks are refused (a router and experts, not one gated MLP). Returns the number of
    MLPs tiled.
    """
    arch = hf_architecture(model)
    hidden = model.config.hidden_size
    layers = hf_decoder_layers(model)
    mlps = []
    for layer in layers:
        mlp = getattr(layer, arch.mlp, None)
        if mlp is None:
            raise RuntimeConfigError(f"{type(layer).__name__} has no {arch.mlp} to tile")
        if arch.experts is not None and getattr(mlp, arch.experts, None) is not None:
            raise RuntimeConfigError(
                f"{model.config.model_type}: the tiled MLP does not run mixture-of-experts blocks (a router picks "
                "experts per token, not one gated MLP to recompute tile by tile): plan without tiled_mlp"
            )
        mlps.append(mlp)
    for mlp in mlps:
        if getattr(mlp, TILED_ATTRIBUTE, False):
            continue

        def forward(x: torch.Tensor, _mlp: nn.Module = mlp) -> torch.Tensor:
            tile = tile_tokens_for(hidden, x.numel() // x.shape[-1], tile_tokens)
            # Modules looked up at call time: TP may swap in row-parallel shards after tiling is applied.
            return tiled_gated_mlp(x, getattr(_mlp, arch.gate_proj), getattr(_mlp, arch.up_proj),
                                   getattr(_mlp, arch.down_proj), getattr(_mlp, arch.activation), tile)

        mlp.forward = forward
        setattr(mlp, TILED_ATTRIBUTE, True)
    return len(layers)
