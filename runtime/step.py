"""One optimizer step over this rank's micro-batches: token-normalised loss, ZeRO-stage gradient sync.

:func:`train_step` is what the example, ``sp-plan validate`` and the equivalence tests run, so they
exercise one code path:

1. shard every micro-batch and count the step's valid tokens over the data group (one int64
   all-reduce), so each micro-batch's loss is ``local token-loss sum / step tokens`` (the
   data-parallel baseline's normalisation with gradient accumulation);
2. per micro-batch, tell FSDP2 what the plan's ZeRO stage does (see :mod:`sp_plan.runtime.auto`): ZeRO-1
   syncs gradients only on the last micro-batch; ZeRO-1/2 keep parameters gathered until then;
3. forward and loss as the plan says (:meth:`sp_plan.runtime.auto.AutoConfigured.compute_loss`: tiled,
   vocab-parallel under TP), backward; then the TP-replicated gradient all-reduce, clipping
   (optional, over FSDP and TP shards), ``optimizer.step()`` and ``zero_grad()``.

Under pipeline parallelism (``setup.pipeline``, :mod:`sp_plan.runtime.pipeline`) step 3 is one run of the
plan's torch.distributed.pipelining schedule over all the micro-batches (the stage keeps FSDP2 from
reducing gradients until the last one), with the same token-count normalisation; clipping uses the norm
over every stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sp_plan.runtime.loss import global_token_count


@dataclass
class StepResult:
    """``loss``: the step's global token-mean loss; ``tokens``: valid tokens in the step (all ranks);
    ``micro_batch_losses``: each micro-batch's global token-mean loss; ``seconds``: wall time."""

    loss: float
    tokens: int
    micro_batch_losses: list[float]
    seconds: float
    grad_norm: float | None = None
    #: The optimizer step was skipped: the loss or the gradient norm was NaN or infinite (``skip_nonfinite``).
    skipped: bool = False


def set_micro_batch_flags(setup, last: bool) -> None:
    """Tell every FSDP2 model part what the plan's ZeRO stage does for a micro-batch that is (or is not) the
    step's last (step 2 of the module doc); any loop that accumulates micro-batches calls it first."""
    from torch.distributed.fsdp import FSDPModule

    zero_stage = setup.train.zero_stage
    for part in setup.model_parts:
        if not isinstance(part, FSDPModule):
            continue
        if zero_stage in (1, 2):
            part.set_reshard_after_backward(last)  # keep parameters gathered between micro-batches of a step
        if zero_stage == 1:
            part.set_requires_gradient_sync(last)  # accumulate unsharded; reduce-scatter once per step


def random_micro_batches(setup, generator: torch.Generator, seq_len: int | None = None) -> list[torch.Tensor]:
    """One step's micro-batches of random token ids (the plan's micro-batch x ``seq_len``, by default the plan's
    length), for runs that measure a step rather than learn: validate's, and the host-overhead probe's at a
    shorter length."""
    t = setup.train
    length = t.seq_len if seq_len is None else seq_len
    vocab = setup.plan.model.vocab_size
    return [torch.randint(0, vocab, (t.micro_batch, length), generator=generator) for _ in range(t.grad_accum)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(setup, micro_batches: Sequence[Any], optimizer: torch.optim.Optimizer | None = None, *,
               max_grad_norm: float | None = None, sharded: bool = False, skip_nonfinite: bool = False,
               on_micro_batch: Callable[[int, int], None] | None = None) -> StepResult:
    """Run one optimizer step of ``setup`` (an :class:`sp_plan.runtime.auto.AutoConfigured`) over ``micro_batches``.

    ``micro_batches`` are this data-parallel rank's full-sequence batches (or shards, with
    ``sharded=True``). With ``optimizer=None`` only gradients are accumulated (for inspection).

    ``skip_nonfinite``: if the step's loss or global gradient norm is NaN or infinite, drop the gradients
    instead of stepping, so one bad batch or overflow cannot turn every weight (and every later checkpoint)
    into NaN. Both numbers are global (all-reduced over the ranks that share them), so every rank takes
    the same decision without another collective; the norm costs one pass over the gradients when not
    clipping.

    ``on_micro_batch(k, n)`` is called after the k-th of n micro-batches' backward: progress inside a
    step that accumulates many (telemetry of long steps).
    """
    synchronize(setup.device)
    started = time.perf_counter()
    shards = list(micro_batches) if sharded else [setup.shard(b) for b in micro_batches]
    step_tokens = global_token_count((s["labels"] for s in shards), setup.data_group, setup.device)
    losses, weighted = [], 0.0
    if getattr(setup, "pipeline", None) is not None:  # pp > 1: the schedule runs every micro-batch's fwd and bwd
        for value, tokens in setup.pipeline_step(shards, step_tokens):
            losses.append(value)
            weighted += value * tokens
        if on_micro_batch is not None:
            on_micro_batch(len(shards), len(shards))
    else:
        for i, shard in enumerate(shards):
            set_micro_batch_flags(setup, last=i == len(shards) - 1)
            out = setup.compute_loss(shard, num_items=step_tokens)
            out.loss.backward()
            losses.append(out.value)
            weighted += out.value * out.global_tokens
            if on_micro_batch is not None:
                on_micro_batch(i + 1, len(shards))
    setup.sync_gradients()
    if max_grad_norm is not None:
        grad_norm = setup.clip_grad_norm_(max_grad_norm)
    else:
        grad_norm = setup.grad_norm() if skip_nonfinite else None
    loss = weighted / step_tokens if step_tokens else 0.0
    finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
    skipped = skip_nonfinite and not finite
    if optimizer is not None:
        if not skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(setup.device)
    return StepResult(loss=loss, tokens=step_tokens, micro_batch_losses=losses,
                      seconds=time.perf_counter() - started, grad_norm=grad_norm, skipped=skipped)
