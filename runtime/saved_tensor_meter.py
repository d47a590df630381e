"""Measure the bytes a forward pass keeps for backward, on any device (CPU included).

Two things keep activations alive between forward and backward:

1. tensors autograd saves (``ctx.save_for_backward``, the inputs a non-reentrant checkpoint keeps):
   seen through ``torch.autograd.graph.saved_tensors_hooks``;
2. outputs a selective checkpoint caches instead of recomputing (they are not autograd-saved):
   reported by the runtime's selective policy (:func:`sp_plan.runtime.models.checkpointing.observe_selective_cache`).

Tensors are deduplicated by storage (views of one buffer cost its bytes once) and the storages of
parameters and of constants the caller names (e.g. RoPE tables shared by all layers) are excluded.
Every recorded storage is alive until backward, so storage addresses cannot be reused meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .models.checkpointing import observe_selective_cache


@dataclass(frozen=True)
class SavedStorage:
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str
    """``autograd`` or ``selective_cache``."""


@dataclass
class SavedTensorMeter:
    """Context manager: ``with SavedTensorMeter(exclude=model.parameters()) as m: loss = model(x)``."""

    exclude: Iterable[torch.Tensor] = ()
    storages: dict[int, SavedStorage] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in self.exclude}

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())

    def _record(self, tensor: torch.Tensor, source: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if isinstance(tensor, torch.nn.Parameter):  # e.g. a weight a fused op saves without its module running
            return
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._excluded or ptr in self.storages:
            return
        self.storages[ptr] = SavedStorage(storage.nbytes(), tuple(tensor.shape), tensor.dtype, source)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._record(tensor, "autograd")
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _record_cached(self, output: Any) -> None:
        for item in output if isinstance(output, (tuple, list)) else (output,):
            self._record(item, "selective_cache")

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._observer = observe_selective_cache(self._record_cached)
        self._hooks.__enter__()
        self._observer.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._observer.__exit__(*exc)
        self._hooks.__exit__(*exc)
