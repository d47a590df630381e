"""Runtime: turns a plan into process groups, sequence-parallel attention and a training setup.

Needs torch (the ``[runtime]`` extra). Heavy optional pieces (flash-attn, transformers) are imported
lazily where used. The names below are resolved on first access, so ``import sp_plan.runtime.errors`` (which
torch-free layers may do) never imports torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "SequenceParallel": "sp_plan.runtime.context",
    "RuntimeMesh": "sp_plan.runtime.mesh",
    "build_mesh": "sp_plan.runtime.mesh",
    "load_layout": "sp_plan.runtime.mesh",
    "CommCounter": "sp_plan.runtime.comm_counter",
    "local_attention": "sp_plan.runtime.attention",
    "ring_attention": "sp_plan.runtime.attention",
    "ulysses_attention": "sp_plan.runtime.attention",
    "usp_attention": "sp_plan.runtime.attention",
    "auto_configure": "sp_plan.runtime.auto",
    "AutoConfigured": "sp_plan.runtime.auto",
    "BatchSharder": "sp_plan.runtime.data",
    "TokenLoss": "sp_plan.runtime.loss",
    "train_step": "sp_plan.runtime.step",
    "unsupported_reasons": "sp_plan.runtime.capabilities",
}

__all__ = [
    "AutoConfigured",
    "BatchSharder",
    "CommCounter",
    "RuntimeMesh",
    "SequenceParallel",
    "TokenLoss",
    "auto_configure",
    "build_mesh",
    "load_layout",
    "local_attention",
    "ring_attention",
    "train_step",
    "ulysses_attention",
    "unsupported_reasons",
    "usp_attention",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sp_plan.runtime' has no attribute {name!r}")
