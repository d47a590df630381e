"""Tiled (fused linear) cross-entropy: loss and gradients over chunks of tokens, logits never whole.

The plain causal-LM loss materialises ``tokens x vocab`` logits in bf16, their fp32 upcast and the
fp32 log-softmax (10-14 bytes per logit): 128K local tokens x 128K vocab is 160-230 GB. This op takes
the final hidden states and the output matrix instead and runs the lm_head matmul *inside* its chunk
loop (``MemoryAssumptions.loss_chunk_tokens`` tokens at a time):

- forward: per chunk, logits = h_c W^T in the compute dtype, upcast to fp32, log-sum-exp and target
  logit, ``sum(lse - target)`` over the chunk's valid tokens; saved for backward: the hidden states and
  the per-token LSE (4 bytes per token, so backward needs neither a max/sum pass nor, under TP,
  communication);
- backward: per chunk, the logits are recomputed, ``softmax - onehot`` (scaled by the incoming
  gradient) is cast to the compute dtype and multiplied back: ``dh_c = G W`` and ``dW += G^T h_c``
  (accumulated in W's dtype, as autograd and Liger's fused linear cross-entropy do);
- chunks whose labels are all ``ignore_index`` (padding, prompt masking) are skipped in both passes.

It returns ``(loss_sum, valid_tokens)``: the fp32 sum of per-token losses and the number of labels
that are not ignored, so the caller can weight ranks by tokens (sequence-parallel ranks may hold
different numbers of valid labels, or none).

Tensor parallelism (vocab-parallel lm_head, :mod:`sp_plan.runtime.tp`): with ``tp_group`` each rank holds rows
``[vocab_start, vocab_start + V_local)`` of the output matrix. Per chunk the target logit, the global
max and the sum of exponentials are all-reduced over ``tp_group`` (Megatron's vocab-parallel
cross-entropy: three fp32 values per token, the comm model's figure).

Working set per chunk (what the memory model budgets, ``chunk x vocab x (compute bytes + 4)``): the
chunk's logits in the compute dtype while they are upcast to fp32; everything after that happens in
place in the fp32 buffer (``exp(x - max)`` and its sum in forward; the softmax and its gradient in
backward), and backward adds the cast of that gradient to the compute dtype (the fp32 buffer
dies after it) plus one chunk of hidden-state gradient.

Numerics: each logit and each row of ``dh`` is computed by the same ops on the same values as the
plain path (lm_head in the compute dtype, softmax as ``exp(logit - lse)`` in fp32), so per-token
losses agree to rounding of the reductions and ``dh`` is identical in bf16; the loss sum and ``dW``
differ only by summation order over chunks (fp32: ~1e-6 relative; bf16 ``dW``: about one bf16 ulp per
chunk).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_plan.cost_models.memory.assumptions import MemoryAssumptions

from . import comm_counter
from .errors import RuntimeConfigError
from .loss import cross_entropy_sum, loss_dtype
from .tp import vocab_parallel_cross_entropy

#: Tokens per chunk, the memory model's assumption (``MemoryAssumptions.loss_chunk_tokens``).
DEFAULT_CHUNK_TOKENS: int = MemoryAssumptions.model_fields["loss_chunk_tokens"].default
IGNORE_INDEX = -100


def chunk_tokens_for(tokens: int, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk: ``chunk_tokens`` or the memory model's default, at most ``tokens`` (and >= 1)."""
    chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if chunk < 1:
        raise RuntimeConfigError(f"tiled loss chunk size must be at least 1 token, got {chunk}")
    return max(1, min(chunk, tokens))


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    comm_counter.record_all_reduce(t, dist.get_world_size(group), "forward", "tp")  # vocab-parallel (TP)
    dist.all_reduce(t, op=op, group=group)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of one chunk, computed like the plain path: lm_head in the compute dtype, then upcast."""
    return F.linear(h, weight).to(loss_dtype(h.dtype))


def _exp_in_place(logits: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn the fp32 ``logits`` into ``exp(logits - max)`` in place (max over the whole vocabulary: all-reduced
    under TP); returns ``(max, sum of exponentials)`` per token, the sum all-reduced under TP. No temporary
    of the chunk's size is allocated."""
    peak = logits.amax(dim=-1)
    if group is not None:
        _all_reduce(peak, group, dist.ReduceOp.MAX)
    sumexp = logits.sub_(peak[:, None]).exp_().sum(-1)
    if group is not None:
        _all_reduce(sumexp, group)
    return peak, sumexp


def _target(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Per-token logit of the label (0 for ignored labels; all-reduced under TP: one rank holds it)."""
    local = labels - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    target = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(-1)
    target = torch.where(mine, target, torch.zeros((), dtype=logits.dtype, device=logits.device))
    if group is not None:
        _all_reduce(target, group)
    return target


class _TiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index, group, vocab_start):
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        if y.shape[0] != h.shape[0]:
            raise RuntimeConfigError(
                f"tiled loss got {h.shape[0]} hidden-state rows but {y.shape[0]} labels: shard labels like the "
                "hidden states (same batch and sequence dims)"
            )
        valid = y != ignore_index
        math = loss_dtype(h.dtype)
        loss = torch.zeros((), dtype=math, device=h.device)
        lse_all = torch.zeros(h.shape[0], dtype=math, device=h.device)
        active = []
        for start in range(0, h.shape[0], chunk):
            keep = valid[start : start + chunk]
            if not bool(keep.any()):
                continue  # every label ignored: no matmul, no contribution, no gradient
            active.append(start)
            logits = _chunk_logits(h[start : start + chunk], weight)
            target = _target(logits, y[start : start + chunk], vocab_start, group)
            peak, sumexp = _exp_in_place(logits, group)
            del logits
            lse = peak + sumexp.log()
            loss += torch.where(keep, lse - target, torch.zeros((), device=h.device)).sum()
            lse_all[start : start + chunk] = lse
        ctx.chunk, ctx.group, ctx.vocab_start, ctx.active = chunk, group, vocab_start, active
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(hidden, weight, labels, lse_all)
        count = valid.sum()
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        hidden, weight, labels, lse_all = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = grad_loss.to(lse_all.dtype)
        for start in ctx.active:
            hc = h[start : start + ctx.chunk]
            yc = y[start : start + ctx.chunk]
            # exp(logits - lse): the softmax, computed in place as the plain path's log-softmax backward does
            grad = _chunk_logits(hc, weight).sub_(lse_all[start : start + ctx.chunk, None]).exp_()
            local = yc - ctx.vocab_start
            mine = (local >= 0) & (local < grad.shape[-1]) & (yc != ctx.ignore_index)
            rows = torch.nonzero(mine).squeeze(-1)
            grad[rows, local[rows]] -= 1.0
            grad.mul_(torch.where(yc != ctx.ignore_index, scale, torch.zeros((), device=grad.device))[:, None])
            g = grad.to(hc.dtype)
            del grad
            if grad_h is not None:
                grad_h[start : start + ctx.chunk] = g @ weight
            if grad_w is not None:
                grad_w.addmm_(g.t(), hc)
            del g
        grad_h = grad_h.view(hidden.shape) if grad_h is not None else None
        return grad_h, grad_w, None, None, None, None, None


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, valid_tokens)`` of ``cross_entropy(hidden @ weight.T, labels)``, chunk by chunk.

    ``hidden`` ``(..., H)`` (the final-norm output, e.g. :meth:`sp_plan.runtime.models.LlamaModel.hidden_states`),
    ``weight`` ``(V, H)`` (the lm_head / tied embedding; with ``tp_group`` this rank's vocabulary rows
    starting at ``vocab_start``), ``labels`` the matching leading shape, already shifted, with
    ``ignore_index`` where no loss is taken. ``loss_sum`` is an fp32 scalar with gradients for
    ``hidden`` and ``weight``; ``valid_tokens`` an int64 scalar.
    """
    tokens = hidden.numel() // hidden.shape[-1]
    chunk = chunk_tokens_for(tokens, chunk_tokens)
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    return _TiledCrossEntropy.apply(hidden, weight, labels, chunk, ignore_index, tp_group, vocab_start)


def plain_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path (HF's causal-LM loss, summed): ``(loss_sum, valid_tokens)`` from whole logits."""
    return cross_entropy_sum(logits, labels, ignore_index), (labels != ignore_index).sum()


def causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    tiled: bool = False,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, valid_tokens)`` of a runtime :class:`~sp_plan.runtime.models.LlamaModel` on this rank's shard.

    Picks the right loss for how the model was set up: tiled (this module) or plain; vocab-parallel
    (:func:`sp_plan.runtime.tp.vocab_parallel_cross_entropy`) when :func:`sp_plan.runtime.tp.apply_tensor_parallel` split
    the lm_head. ``labels`` are pre-shifted and sharded like ``input_ids``.
    """
    tp = getattr(model, "tensor_parallel", None)
    group = tp.group if tp is not None and tp.size > 1 else None
    vocab_start = tp.vocab_start if group is not None else 0
    if tiled:
        hidden = model.hidden_states(input_ids, position_ids)
        return tiled_cross_entropy(hidden, model.lm_head.weight, labels, chunk_tokens=chunk_tokens,
                                   ignore_index=ignore_index, tp_group=group, vocab_start=vocab_start)
    logits = model(input_ids, position_ids)
    if group is not None:
        return vocab_parallel_cross_entropy(logits, labels, group, vocab_start, ignore_index=ignore_index)
    return plain_cross_entropy(logits, labels, ignore_index=ignore_index)
