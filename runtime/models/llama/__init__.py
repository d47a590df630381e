"""The runtime's own Llama-style decoder (:mod:`.model`) and its adapter (:mod:`.adapter`).

Names are resolved on first access (``from sp_plan.runtime.models.llama import LlamaModel`` imports
:mod:`.model` then), so that importing the adapter to ask what the family supports never imports torch.
"""

from __future__ import annotations

import importlib

#: Public names and the submodule holding each; anything else is looked up in :mod:`.model`.
_LAZY = {
    "LlamaAdapter": "adapter",
    "SequenceParallelAttention": "attention",
}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    module = importlib.import_module(f"{__name__}.{_LAZY.get(name, 'model')}")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
