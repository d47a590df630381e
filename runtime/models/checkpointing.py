"""Per-block activation checkpointing: ``none``, ``selective`` and ``full``, all non-reentrant.

- ``full``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; only the block input is kept and
  the whole block is recomputed in backward.
- ``selective``: the same checkpoint with a selective-checkpoint policy
  (``create_selective_checkpoint_contexts``) that keeps the outputs of the attention op (output and
  LSE) and recomputes everything else. The attention op is recognised two ways: ops listed in a
  registry (PyTorch's flash/efficient/cuDNN attention ops, and the sequence-parallel custom ops of
  :mod:`sp_plan.runtime.attention.ops`: the local kernel, the whole ring pass and the Ulysses output
  all-to-all; other kernels can register theirs), and any op executed inside
  :func:`keep_for_selective` (used by composite attention implementations, e.g. the output product of
  materialized attention). Outputs of those ops are cached by the checkpoint and the ops are not re-run
  (no ring pass, no output all-to-all in the recompute); their inputs (q, k, v) are recomputed from
  the block input because their backward needs them (under Ulysses that re-runs the Q/K/V all-to-all).

Recomputation is exact: the same ops run on the same inputs with the forward's RNG state restored, so
gradients equal the non-checkpointed ones bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..attention.ops import KEPT_BY_SELECTIVE
from ..errors import RuntimeConfigError

CheckpointMode = Literal["none", "selective", "full"]
CHECKPOINT_MODES: tuple[str, ...] = ("none", "selective", "full")


def _attention_kernel_ops() -> set[Any]:
    """Attention ops whose outputs selective keeps: PyTorch's fused attention ops that exist in this build
    (their outputs are out, LSE, RNG state) and the sequence-parallel attention steps of
    :mod:`sp_plan.runtime.attention.ops` (local kernel, ring pass, Ulysses output all-to-all)."""
    names = (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    ops = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return ops | set(KEPT_BY_SELECTIVE)


_SAVE_OPS: set[Any] = _attention_kernel_ops()
_KEEP = threading.local()
_CACHE_OBSERVERS: list[Callable[[Any], None]] = []


def register_selective_save_op(op: Any) -> None:
    """Also keep the outputs of ``op`` (an OpOverload, e.g. a custom attention kernel) under selective."""
    _SAVE_OPS.add(op)


@contextlib.contextmanager
def keep_for_selective() -> Iterator[None]:
    """Ops run inside this block have their outputs kept (not recomputed) by selective checkpointing."""
    depth = getattr(_KEEP, "depth", 0)
    _KEEP.depth = depth + 1
    try:
        yield
    finally:
        _KEEP.depth = depth


@contextlib.contextmanager
def observe_selective_cache(callback: Callable[[Any], None]) -> Iterator[None]:
    """Call ``callback(op_output)`` for every output selective checkpointing caches (for measurement)."""
    _CACHE_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _CACHE_OBSERVERS.remove(callback)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _SAVE_OPS or getattr(_KEEP, "depth", 0) > 0:
        output = getattr(ctx, "op_output", None)
        if output is not None:
            for callback in list(_CACHE_OBSERVERS):
                callback(output)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_selective_context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)


def check_mode(mode: str) -> str:
    if mode not in CHECKPOINT_MODES:
        raise RuntimeConfigError(f"unknown checkpointing mode {mode!r}; use one of {', '.join(CHECKPOINT_MODES)}")
    return mode


def run_checkpointed(fn: Callable[..., torch.Tensor], mode: str, *args: Any, offload: Any = None) -> torch.Tensor:
    """Run ``fn(*args)`` (one transformer block) under the given checkpointing mode.

    ``offload`` (a :class:`sp_plan.runtime.offload.CheckpointOffload`) moves the block input the checkpoint keeps
    (``args[0]``) to host memory until backward; it needs ``selective`` or ``full``.
    """
    if mode == "none" or not torch.is_grad_enabled():
        if offload is not None and mode == "none" and torch.is_grad_enabled():
            raise RuntimeConfigError(
                "checkpoint offload moves each block's checkpointed input to host memory, but checkpointing is "
                "'none'; use checkpointing 'full' or 'selective'"
            )
        return fn(*args)
    if mode == "full":
        context_fn = None
    elif mode == "selective":
        context_fn = _selective_context
    else:
        raise RuntimeConfigError(f"unknown checkpointing mode {mode!r}; use one of {', '.join(CHECKPOINT_MODES)}")
    kwargs = {"use_reentrant": False} if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}
    if offload is None:
        return checkpoint(fn, *args, **kwargs)
    with offload.saving(args[0]):
        return checkpoint(fn, *args, **kwargs)
