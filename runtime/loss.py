"""Token-weighted cross-entropy for sequence- and data-parallel training.

The data-parallel baseline's loss for one optimizer step is the mean over every valid token of the
step: ``sum of token losses / number of valid tokens``, over all data-parallel ranks and all
micro-batches. With sequence parallelism each rank holds a slice of each sequence, and some slices
may hold no valid token at all (padding, a prompt whose labels are ignored). Averaging per-rank means
would weight those slices wrongly (and 0/0 is NaN), so:

- every rank computes the SUM of its token losses and the COUNT of its valid tokens (zero tokens:
  sum 0, gradient 0, no NaN);
- the value to back-propagate is ``local_sum / N`` where N is the step's global valid-token count
  (given by the caller for gradient accumulation, see :func:`global_token_count`; else this
  micro-batch's global count);
- gradients are then SUMMED over the data group (``sp_plan.runtime.auto`` sets FSDP2's gradient divide
  factor to 1), which gives exactly ``d/dθ (sum of all token losses / N)``: the baseline's gradient.

For logging, the (sum, count) pair is all-reduced over the data group once per micro-batch: two
fp32 scalars, the ``loss`` all-reduce the communication model lists. The loss value reported is that
micro-batch's global token mean, identical to what a single device computes on the whole batch.

The per-token loss sum is :func:`cross_entropy_sum` on whole logits, the vocab-parallel cross-entropy
under tensor parallelism (:mod:`sp_plan.runtime.tp`), or the tiled cross-entropy that never materialises the
logits (:mod:`sp_plan.runtime.tiled_loss`, the plan's ``tiled_loss``); all three feed :meth:`TokenLoss.reduce`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_plan.runtime import comm_counter
from sp_plan.runtime.data import IGNORE_INDEX

#: Loss reduction payload: the loss sum and the valid-token count, two fp32 scalars (the cost model's 8
#: bytes). The count is exact up to 2**24 valid tokens per micro-batch over the data group; beyond that it
#: is rounded to fp32 (relative error < 1e-7 of the loss scale). Step-level counts
#: (:func:`global_token_count`) are int64 and always exact.
LOSS_REDUCTION_DTYPE = torch.float32


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype cross-entropy math runs in: fp32 for low-precision logits (HF's upcast), the logits' own
    dtype when wider (fp64 in exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies over valid labels, computed in fp32 (HF-style upcast).

    ``logits`` (..., vocab), ``labels`` (...) pre-shifted, ``ignore_index`` skipped. Returns 0 (with a
    zero gradient) when no label is valid.
    """
    upcast = logits.to(loss_dtype(logits.dtype))
    return F.cross_entropy(upcast.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


@dataclass
class LossOutput:
    """``loss``: back-propagate this. ``value``: the micro-batch's global token-mean loss (for logging).
    ``local_tokens`` / ``global_tokens``: valid tokens on this rank / over the data group."""

    loss: torch.Tensor
    value: float
    local_tokens: int
    global_tokens: int


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    comm_counter.record_all_reduce(tensor, dist.get_world_size(group), "forward", "loss")
    dist.all_reduce(tensor, group=group)
    return tensor


def global_token_count(labels: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None,
                       device: torch.device | str | None = None) -> int:
    """Valid tokens in all of this rank's micro-batches of a step, summed over the data group.

    Pass the result as ``num_items`` to :class:`TokenLoss` for every micro-batch of the step: the loss
    is then normalised by the step's token count, as the data-parallel baseline does (one int64
    all-reduce per step; not part of the cost model's per-micro-batch traffic).
    """
    local = sum(int((lab != IGNORE_INDEX).sum()) for lab in labels)
    count = torch.tensor([local], dtype=torch.int64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return int(count.item())


class TokenLoss:
    """``loss_fn(logits, labels, num_items=None) -> LossOutput`` over the data group (SP and DP ranks).

    ``group``: the ranks whose tokens form one batch (all but TP; None = single process).
    ``cross_entropy``: ``(logits, labels) -> (loss_sum, valid_tokens)`` for this rank's tokens; the
    default is :func:`cross_entropy_sum`; under tensor parallelism the vocab-parallel one. Losses that
    never materialise logits (the tiled loss) hand their ``(sum, count)`` to :meth:`reduce`.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, cross_entropy=None) -> None:
        self.group = group
        self.cross_entropy = cross_entropy

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, num_items: int | None = None) -> LossOutput:
        if self.cross_entropy is None:
            local_sum, local_tokens = cross_entropy_sum(logits, labels), int((labels != IGNORE_INDEX).sum())
        else:
            local_sum, count = self.cross_entropy(logits, labels)
            local_tokens = int(count)
        return self.reduce(local_sum, local_tokens, num_items)

    def reduce(self, local_sum: torch.Tensor, local_tokens: int, num_items: int | None = None) -> LossOutput:
        """The loss to back-propagate and the logged value from this rank's token-loss sum and count."""
        stats = torch.stack([local_sum.detach().to(LOSS_REDUCTION_DTYPE),
                             torch.tensor(float(local_tokens), dtype=LOSS_REDUCTION_DTYPE, device=local_sum.device)])
        stats = _all_reduce(stats, self.group)
        global_sum, global_tokens = stats[0].item(), int(stats[1].item())
        denominator = num_items if num_items is not None else global_tokens
        loss = local_sum / max(denominator, 1)
        value = global_sum / global_tokens if global_tokens else 0.0
        return LossOutput(loss=loss, value=value, local_tokens=local_tokens, global_tokens=global_tokens)
