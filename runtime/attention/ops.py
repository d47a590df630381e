"""The attention steps selective checkpointing keeps, as dispatcher-level custom ops (``torch.library``).

Selective activation checkpointing (:mod:`runtime.models.checkpointing`) decides per *dispatcher op*
whether an output is kept or recomputed. A Python ``autograd.Function`` is invisible to it: only the
aten ops inside are seen, one by one. For ring attention that would mean replaying the whole ring
pass (every K/V send, every merge) in the recompute, and for Ulysses re-sending the output
all-to-all. Registering each step as one custom op gives the checkpoint one op whose outputs it can
keep (DESIGN.md: selective keeps the outputs of the attention op and the Ulysses output all-to-all;
the Q/K/V all-to-alls are recomputed):

- ``sp_plan::attention``: the local kernel (output, LSE);
- ``sp_plan::ring_attention``: the whole zigzag ring pass (output, LSE);
- ``sp_plan::ulysses_head_to_seq``: the output all-to-all of Ulysses (head split -> sequence split).

Each op's forward and backward are the plain functions of :mod:`.kernel`, :mod:`.ring` and
:mod:`.ulysses`; autograd is attached with ``torch.library.register_autograd`` and saves exactly what
the former ``autograd.Function`` saved (q, k, v, output, LSE; nothing for the all-to-all). Process
groups cannot be op arguments, so they travel by name (:func:`group_name` registers them).

:data:`KEPT_BY_SELECTIVE` lists the op overloads whose outputs selective checkpointing keeps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.attention.kernel import attention_backward, attention_forward, lse_dtype
from runtime.attention.ring import RingComm, _ring_backward, _ring_forward
from runtime.attention.ulysses import head_to_seq, seq_to_head
from runtime.errors import RuntimeConfigError

_GROUPS: dict[str, dist.ProcessGroup] = {}


def group_name(group: dist.ProcessGroup | None) -> str:
    """A name under which ``group`` (None: the default group) can be passed to the ops below."""
    group = group if group is not None else dist.group.WORLD
    name = group.group_name
    _GROUPS.setdefault(name, group)
    return name


def _group(name: str) -> dist.ProcessGroup:
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeConfigError(
            f"process group {name!r} was not registered: call runtime.attention.ops.group_name(group) first"
        ) from None


def _lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    return (q.shape[0], q.shape[2], q.shape[1])


# ----- local kernel ------------------------------------------------------------------------------


@torch.library.custom_op("sp_plan::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None, backend: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention: output ``(B, S, H, D)`` and LSE ``(B, H, S)``."""
    out, lse = attention_forward(q, k, v, causal=causal, scale=scale, backend=backend)
    return out, lse


@attention_op.register_fake
def _(q, k, v, causal, scale, backend):
    return torch.empty_like(q), q.new_empty(_lse_shape(q), dtype=lse_dtype(q.dtype))


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale, backend=ctx.backend)
    return dq, dk, dv, None, None, None


attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


# ----- ring attention ------------------------------------------------------------------------------


@torch.library.custom_op("sp_plan::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, causal: bool, scale: float, backend: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The zigzag ring pass over the named group: output in q's dtype and the merged LSE."""
    out, lse = _ring_forward(q, k, v, RingComm(_group(group)), causal, scale, backend)
    return out.to(q.dtype), lse


@ring_attention_op.register_fake
def _(q, k, v, group, causal, scale, backend):
    return torch.empty_like(q), q.new_empty(_lse_shape(q), dtype=lse_dtype(q.dtype))


def _ring_setup(ctx, inputs, output):
    q, k, v, group, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.group, ctx.causal, ctx.scale, ctx.backend = group, causal, scale, backend
    ctx.mark_non_differentiable(lse)


def _ring_attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    comm = RingComm(_group(ctx.group))
    dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, comm, ctx.causal, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None, None


ring_attention_op.register_autograd(_ring_attention_backward, setup_context=_ring_setup)


# ----- Ulysses output all-to-all -------------------------------------------------------------------


@torch.library.custom_op("sp_plan::ulysses_head_to_seq", mutates_args=())
def ulysses_head_to_seq_op(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """``(B, S, h, D)`` head-split -> ``(B, S/world, world*h, D)`` sequence-split (one all-to-all)."""
    (out,) = head_to_seq([x], _group(group), world, "forward")
    return out


@ulysses_head_to_seq_op.register_fake
def _(x, group, world):
    b, s, h, d = x.shape
    return x.new_empty((b, s // world, h * world, d))


def _head_to_seq_setup(ctx, inputs, output):
    _, group, world = inputs
    ctx.group, ctx.world = group, world


def _head_to_seq_backward(ctx, grad):
    (dx,) = seq_to_head([grad], _group(ctx.group), ctx.world, "backward")
    return dx, None, None


ulysses_head_to_seq_op.register_autograd(_head_to_seq_backward, setup_context=_head_to_seq_setup)


#: Op overloads whose outputs selective checkpointing keeps instead of recomputing.
KEPT_BY_SELECTIVE: tuple = (
    torch.ops.sp_plan.attention.default,
    torch.ops.sp_plan.ring_attention.default,
    torch.ops.sp_plan.ulysses_head_to_seq.default,
)
