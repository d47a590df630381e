"""Model families the runtime trains: the runtime's own Llama (the reference the memory model mirrors),
Hugging Face causal LMs, and any family registered with :func:`register_adapter`.

Names are resolved on first access, so that :mod:`sp_plan.runtime.models.base` (the adapter registry)
and the built-in adapters can be imported without torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CHECKPOINT_MODES": "sp_plan.runtime.models.checkpointing",
    "keep_for_selective": "sp_plan.runtime.models.checkpointing",
    "register_selective_save_op": "sp_plan.runtime.models.checkpointing",
    "run_checkpointed": "sp_plan.runtime.models.checkpointing",
    "FlashAttention": "sp_plan.runtime.models.llama.model",
    "LlamaBlock": "sp_plan.runtime.models.llama.model",
    "LlamaModel": "sp_plan.runtime.models.llama.model",
    "MaterializedAttention": "sp_plan.runtime.models.llama.model",
    "RMSNorm": "sp_plan.runtime.models.llama.model",
    "RotaryEmbedding": "sp_plan.runtime.models.llama.model",
    "apply_rope": "sp_plan.runtime.models.llama.model",
    "ModelAdapter": "sp_plan.runtime.models.base",
    "adapter_for": "sp_plan.runtime.models.base",
    "adapter_named": "sp_plan.runtime.models.base",
    "adapter_names": "sp_plan.runtime.models.base",
    "register_adapter": "sp_plan.runtime.models.base",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sp_plan.runtime.models' has no attribute {name!r}")
