"""Split a model into parts along its blocks (the units pipeline stages are made of), in one process.

:func:`split_model` cuts a model at block boundaries, the way torchtitan's ``pipeline_module_split``
does: every part is a copy of the model's structure that keeps only its own blocks; the input embedding
lives in the first part and the final norm and the lm_head in the last, and the modules a part does not
hold become ``nn.Identity``, so each part's ordinary forward runs unchanged (a later part's "embedding"
passes the previous part's hidden states through; an earlier part's "norm" and "lm_head" return its last
block's output). Parts share the original's module objects (no weights are copied), and each part keeps
the whole model's parameter names (``layers.5...`` stays ``layers.5...``), so checkpoints and full state
dicts of a split model read like the unsplit one's.

:func:`sp_plan.runtime.auto.configure_parts` parallelises each part (TP, SP attention, checkpointing, tiled
MLP, FSDP2) and runs forward, loss, gradient sync and clipping over the list.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

from torch import nn

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.base import ModelAdapter, PartPaths


class BlockSubset(nn.ModuleList):
    """A ModuleList holding some of a model's blocks under their original indices (``"4"``, ``"5"``), so
    parameter names do not change. Iterating, ``len`` and slicing work as for a ModuleList; indexing by
    position is not offered (block ``i`` of the whole model may not be here)."""

    def __init__(self, blocks: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        for name, block in (blocks or {}).items():
            self.add_module(name, block)

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # HF iterates layers[: num_hidden_layers]
            return nn.ModuleList(list(self._modules.values())[idx])
        raise TypeError("a BlockSubset holds some blocks under their model-wide indices: iterate over it")


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s children, parameters and buffers, with its own registries
    (so replacing a child in the copy leaves the original alone)."""
    twin = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            object.__setattr__(twin, key, copy.copy(value))
    return twin


def _replace(root: nn.Module, path: str, make) -> None:
    """Replace the module at dotted ``path`` under ``root`` (itself a fresh copy) by ``make(old)``,
    shallow-copying every module on the way so the original model is untouched."""
    parent = root
    *steps, leaf = path.split(".")
    for step in steps:
        child = _shallow_copy(getattr(parent, step))
        setattr(parent, step, child)
        parent = child
    setattr(parent, leaf, make(getattr(parent, leaf)))


def _check_bounds(bounds: Sequence[int], num_blocks: int) -> list[int]:
    """Cuts strictly inside the blocks, increasing; the first may be 0 (a first part of the embedding alone) and
    the last ``num_blocks`` (a last part of the final norm, the head and the loss alone)."""
    cuts = [int(b) for b in bounds]
    if not cuts or cuts != sorted(set(cuts)) or cuts[0] < 0 or cuts[-1] > num_blocks or 0 in cuts[1:] \
            or num_blocks in cuts[:-1]:
        raise RuntimeConfigError(
            f"block boundaries {list(bounds)} do not cut {num_blocks} blocks into parts: give increasing indices "
            f"strictly between 0 and {num_blocks} (e.g. [{num_blocks // 2}] for two halves), or 0 first for a "
            f"part of the embedding alone and {num_blocks} last for one of the head and loss alone"
        )
    return cuts


def split_model(model: nn.Module, adapter: ModelAdapter, bounds: Sequence[int]) -> list[nn.Module]:
    """``len(bounds) + 1`` parts of ``model``: part ``i`` holds blocks ``[bounds[i-1], bounds[i])``; the first
    also the input embedding, the last the final norm and the lm_head (a first bound of 0 leaves the first part
    the embedding alone, a last bound at the block count the last part the norm and head alone). Refuses tied
    embeddings (the embedding and the lm_head would live in different parts)."""
    paths: PartPaths = adapter.part_paths(model)
    blocks = adapter.blocks(model)
    cuts = _check_bounds(bounds, len(blocks))
    if adapter.spec(model).tied_embeddings:
        raise RuntimeConfigError(
            "the model ties its input embedding and lm_head, which would sit in different parts: untie them "
            "(tie_word_embeddings=False) to split it"
        )
    edges = [0, *cuts, len(blocks)]
    parts = []
    for i, (start, stop) in enumerate(itertools.pairwise(edges)):
        part = _shallow_copy(model)
        _replace(part, paths.layers, lambda old, a=start, b=stop: BlockSubset(
            {n: m for n, m in list(old._modules.items())[a:b]}))
        if i > 0:
            _replace(part, paths.embedding, lambda old: nn.Identity())
        if i < len(edges) - 2:
            _replace(part, paths.final_norm, lambda old: nn.Identity())
            _replace(part, paths.lm_head, lambda old: nn.Identity())
        parts.append(part)
    return parts
