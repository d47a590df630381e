"""The planned sequence-parallel attention as the runtime Llama's ``attention_fn``."""

from __future__ import annotations

import torch
from torch import nn

from sp_plan.runtime.context import SequenceParallel


class SequenceParallelAttention(nn.Module):
    """``attention_fn`` for :class:`sp_plan.runtime.models.LlamaModel`: the planned SP attention on local shards."""

    def __init__(self, sp: SequenceParallel) -> None:
        super().__init__()
        self.sp = sp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        return self.sp.attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens)

    def extra_repr(self) -> str:
        return repr(self.sp)
