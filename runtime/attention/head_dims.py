"""Attention whose value head dim differs from the query/key head dim (MLA), run exactly by zero padding.

Multi-head latent attention (DeepSeek-V2/V3) scores with q/k heads of ``qk_nope_head_dim +
qk_rope_head_dim`` (192 in DeepSeek-V3) and mixes values of ``v_head_dim`` (128). The kernels under
:mod:`.kernel` take one head dim for q, k and v: PyTorch's CPU flash op
(``aten._scaled_dot_product_flash_attention_for_cpu`` raises "Q/K/V should have the same head size",
checked with torch 2.13), CUDA's flash op and flash-attn 2 need equal dims by their documented
constraints (not exercised without a GPU), and so do the runtime's own paths (Ulysses moves q, k and v
in ONE all-to-all of one head dim; ring attention keeps dK and dV in one stacked accumulator). CUDA's
memory-efficient op is documented to accept a different v dim, but one rule for every backend keeps
them interchangeable.

So the public entry points (:mod:`.api`) widen the narrower side with zeros before anything else runs:

- v narrower (MLA): ``v' = [v, 0]``. Each output row is ``softmax(q k^T) v'``, so its first
  ``v_dim`` columns are exactly ``softmax(q k^T) v`` and the rest are exactly 0; slicing them off gives
  the same output, and autograd through the pad and the slice hands v exactly its own gradient
  (the padding columns' gradient is dropped). The LSE depends on q and k only, so it is unchanged.
- q/k narrower: ``q' = [q, 0]``, ``k' = [k, 0]`` leave every score ``q . k`` unchanged; the default
  softmax scale is taken from the ORIGINAL q/k head dim first.

Cost: the padded columns are computed and, under Ulysses, sent (DeepSeek-V3: V and the output travel
at 192 instead of 128 columns, 1.5x their bytes). That is what the planner prices: an MLA ModelSpec's
``head_dim`` is the q/k head dim, and its Ulysses term moves Q, K, V and the output at that width
(:mod:`sp_plan.cost_models.strategies.ulysses`). Exactness first; a two-dim all-to-all and kernels that
take a narrower V (FA3's hdimV) are the way to drop that cost, in the runtime and the planner together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sp_plan.runtime.attention.kernel import default_scale


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def differing_head_dims(q: object, k: object, v: object) -> bool:
    """True when q, k, v are 4-D tensors of one (batch, seq, heads) layout for k and v, equal q/k head dims,
    and a different v head dim: the one mismatch :func:`equalize_head_dims` repairs. Anything else goes
    to the kernels' own checks unchanged (and is refused there with its reason)."""
    tensors = (q, k, v)
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in tensors):
        return False
    return k.shape[:3] == v.shape[:3] and q.shape[-1] == k.shape[-1] and v.shape[-1] != k.shape[-1]


def equalize_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None, int | None]:
    """``(q, k, v, scale, v_dim)`` with one head dim for all three (zeros appended to the narrower side)
    and the scale the unpadded q/k would get; ``v_dim`` is the output width to slice back to (None when
    nothing was padded)."""
    if not differing_head_dims(q, k, v):
        return q, k, v, scale, None
    v_dim, qk_dim = v.shape[-1], q.shape[-1]
    width = max(v_dim, qk_dim)
    if scale is None and width != qk_dim:
        scale = default_scale(qk_dim)  # the softmax temperature of the real q/k, not of the padded ones
    return _widen(q, width), _widen(k, width), _widen(v, width), scale, v_dim


def narrow_output(out: torch.Tensor, v_dim: int | None) -> torch.Tensor:
    """The attention output at v's own head dim (the padding columns, exactly zero, dropped)."""
    return out if v_dim is None or out.shape[-1] == v_dim else out[..., :v_dim]
