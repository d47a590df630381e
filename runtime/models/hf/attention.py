"""Sequence-parallel attention inside HF models, through transformers' attention registry.

:data:`ATTENTION_NAME` is registered in transformers' ``AttentionInterface`` and set as the model's
``attn_implementation``. Each attention module carries its :class:`sp_plan.runtime.context.SequenceParallel`
context; the registered function transposes HF's ``(batch, heads, seq, head_dim)`` to the runtime's
``(batch, seq, heads, head_dim)``, runs the planned Ulysses / Ring / USP attention on the local shards and
returns ``(batch, seq, heads, head_dim)`` as HF's own kernels do. The name is deliberately NOT registered
in ``AttentionMaskInterface``, so transformers builds no mask for it; the function refuses any mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.hf.model import hf_architecture, hf_decoder_layers, transformers_module
from sp_plan.runtime.models.hf.moe import check_moe_training

#: The attention implementation name registered with transformers.
ATTENTION_NAME = "sp_plan"
#: Attribute of each HF attention module holding its SequenceParallel context.
CONTEXT_ATTRIBUTE = "_sp_plan_context"


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's attention child, named by the family's table entry."""
    name = hf_architecture(model).attention
    modules = [getattr(layer, name, None) for layer in hf_decoder_layers(model)]
    if any(m is None for m in modules):
        raise RuntimeConfigError(f"{type(model).__name__}: a decoder layer has no {name} module")
    return modules


# ----- attention ------------------------------------------------------------------------------------------


def sequence_parallel_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: SP attention on this rank's shards, no mask."""
    sp = getattr(module, CONTEXT_ATTRIBUTE, None)
    if sp is None:
        raise RuntimeConfigError(
            f"attn_implementation={ATTENTION_NAME!r} on a module without a sequence-parallel context: configure the "
            "model with sp_plan.runtime.auto_configure (or sp_plan.runtime.hf.use_sequence_parallel_attention)"
        )
    if attention_mask is not None:
        raise RuntimeConfigError(
            f"a {tuple(attention_mask.shape)} attention mask reached sequence-parallel attention; the runtime never "
            "uses masks (position_ids carry the layout, padding becomes ignored labels): do not pass attention_mask"
        )
    if dropout:
        raise RuntimeConfigError(f"attention dropout {dropout} is not supported: set config.attention_dropout = 0")
    for unsupported in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise RuntimeConfigError(
                f"{unsupported}={kwargs[unsupported]!r} is not supported by the runtime's attention kernels"
            )
    causal = module.is_causal if is_causal is None else is_causal
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (b, h, s, d) -> (b, s, h, d)
    return sp.attention(q, k, v, causal=causal, scale=scaling, cu_seqlens=kwargs.get("cu_seqlens")), None


def register_attention() -> None:
    """Register :data:`ATTENTION_NAME` in transformers' attention registry (idempotent)."""
    transformers = transformers_module()
    transformers.AttentionInterface.register(ATTENTION_NAME, sequence_parallel_attention_forward)


def use_sequence_parallel_attention(model: nn.Module, sp, seq_len: int) -> None:
    """Route every attention of ``model`` through ``sp`` (a :class:`sp_plan.runtime.context.SequenceParallel`)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < seq_len:
        raise RuntimeConfigError(
            f"{config.model_type}: sliding-window attention ({window} tokens) is not supported by the runtime's "
            f"kernels at seq_len {seq_len}; set config.sliding_window = None (full causal attention)"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise RuntimeConfigError(f"attention_dropout={config.attention_dropout} is not supported: set it to 0")
    check_moe_training(model)  # router settings that are not per token
    register_attention()
    for module in _attention_modules(model):
        object.__setattr__(module, CONTEXT_ATTRIBUTE, sp)  # a plain attribute, not a submodule
        if hasattr(module, "sliding_window"):
            module.sliding_window = None  # checked above: equivalent to full attention at this length
    model.set_attn_implementation(ATTENTION_NAME)
    config.use_cache = False  # training: no KV cache
