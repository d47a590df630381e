"""Runtime: turns a plan into process groups, sequence-parallel attention and a training setup.

Needs torch (the ``[runtime]`` extra). Heavy optional pieces (flash-attn, transformers) are imported
lazily where used. The names below are resolved on first access, so ``import runtime.errors`` (which
torch-free layers may do) never imports torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "SequenceParallel": "runtime.context",
    "RuntimeMesh": "runtime.mesh",
    "build_mesh": "runtime.mesh",
    "load_layout": "runtime.mesh",
    "CommCounter": "runtime.comm_counter",
    "local_attention": "runtime.attention",
    "ring_attention": "runtime.attention",
    "ulysses_attention": "runtime.attention",
    "usp_attention": "runtime.attention",
    "auto_configure": "runtime.auto",
    "AutoConfigured": "runtime.auto",
    "BatchSharder": "runtime.data",
    "TokenLoss": "runtime.loss",
    "train_step": "runtime.step",
    "unsupported_reasons": "runtime.capabilities",
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
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
