"""Numerically stable merge of partial attention results by their log-sum-exp.

Two partial softmax-attention results over disjoint key sets, ``(o1, l1)`` and ``(o2, l2)``, combine
exactly into ``o = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2)`` and ``l = log(e^l1 + e^l2)``. Evaluated as
``l = logaddexp(l1, l2)`` and weights ``e^(li - l)`` in [0, 1], nothing overflows; rows for which
both sides saw only masked keys (``l1 = l2 = -inf``) stay at output 0 and LSE -inf instead of
becoming NaN (``-inf - -inf``), and a block whose rows are fully masked contributes nothing even if
its kernel left NaN or garbage in those rows.
"""

from __future__ import annotations

import torch


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge ``(block_out, block_lse)`` into the accumulators ``(out, lse)`` in place.

    ``out`` is ``(B, S, H, D)`` in the accumulation dtype (fp32 or fp64), ``lse`` ``(B, H, S)`` in the
    same dtype; both may be views (ring attention merges into the second half of the rows). ``block_out``
    is consumed: its rows that contribute nothing are zeroed in place.

    No temporary of the output's size: zero the dead rows of the block (in place), scale the accumulator
    (in place), add the weighted block (``addcmul_``, which reads the block in its own dtype): ~22 bytes
    of memory traffic per element for a bf16 block and fp32 accumulator, the per-row weights aside.
    """
    block_lse = block_lse.to(lse.dtype)
    merged = torch.logaddexp(lse, block_lse)
    anchor = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    keep = torch.exp(lse - anchor).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1), 0 where lse = -inf
    take = torch.exp(block_lse - anchor).transpose(1, 2).unsqueeze(-1)
    block_out.masked_fill_(take == 0, 0)  # 0 x NaN would poison the sum
    out.mul_(keep).addcmul_(block_out, take)
    lse.copy_(merged)
