"""The attention steps as dispatcher-level custom ops (``torch.library``): checkpointing and torch.compile.

Selective activation checkpointing (:mod:`sp_plan.runtime.models.checkpointing`) decides per *dispatcher op*
whether an output is kept or recomputed. A Python ``autograd.Function`` is invisible to it: only the
aten ops inside are seen, one by one. For ring attention that would mean replaying the whole ring
pass (every K/V send, every merge) in the recompute, and for Ulysses re-sending the output
all-to-all. Registering each step as one custom op gives the checkpoint one op whose outputs it can
keep (DESIGN.md: selective keeps the outputs of the attention op and the Ulysses output all-to-all;
the Q/K/V all-to-alls are recomputed):

- ``sp_plan::attention``: the local kernel (output, LSE), optionally document-masked;
- ``sp_plan::ring_attention``: the whole ring pass (output, LSE);
- ``sp_plan::ulysses_qkv_to_heads``: the Q/K/V all-to-all of Ulysses (with KV-head replication);
- ``sp_plan::ulysses_head_to_seq``: the output all-to-all of Ulysses (head split -> sequence split).

**torch.compile.** Each forward op's backward is itself a custom op (``sp_plan::attention_backward``,
``sp_plan::ring_attention_backward``, and the raw all-to-alls ``sp_plan::ulysses_a2a_*``), so
AOTAutograd traces both passes as opaque calls with fake implementations and never runs a collective
on fake tensors. Every op returns contiguous tensors and its fake implementation says so (the LSE of
the CPU flash kernel, for one, is not contiguous; a fake that guessed other strides than the real
output is what broke compilation before). Process groups cannot be op arguments: they travel by
c10d name and are resolved when the op runs (:mod:`sp_plan.runtime.attention.groups`), which also makes
destroyed and re-created groups work. Packed documents travel as the small CPU ``cu_seqlens``
tensor (:mod:`sp_plan.runtime.attention.documents`); it is only read inside the ops.

Every op's forward and backward are the plain functions of :mod:`.kernel`, :mod:`.ring`,
:mod:`.ulysses` and :mod:`.documents`; the autograd formulas save exactly what the former
``autograd.Function`` saved (q, k, v, output, LSE; nothing for the all-to-alls).

:data:`KEPT_BY_SELECTIVE` lists the op overloads whose outputs selective checkpointing keeps.
"""

from __future__ import annotations

import torch

from sp_plan.runtime.attention.documents import (
    block_pairs,
    check_cu_seqlens,
    documents_backward,
    documents_forward,
    row_bounds,
    single_document_rows,
)
from sp_plan.runtime.attention.groups import agree, group_name, resolve_group  # noqa: F401 (re-exported)
from sp_plan.runtime.attention.kernel import (
    attention_backward,
    attention_forward,
    check_qkv,
    lse_dtype,
    resolve_scale,
)
from sp_plan.runtime.attention.ring import RingComm, _ring_backward, _ring_forward, validate_ring_call
from sp_plan.runtime.attention.ulysses import head_to_seq, seq_to_head, ulysses_kv_replication
from sp_plan.runtime.errors import RuntimeConfigError


def _lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    return (q.shape[0], q.shape[2], q.shape[1])


def _empty(x: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """A contiguous tensor like ``x`` (what every real implementation below returns)."""
    return torch.empty(tuple(x.shape) if shape is None else shape, dtype=dtype or x.dtype, device=x.device)


# ----- local kernel ------------------------------------------------------------------------------


def _local_pairs(q: torch.Tensor, k: torch.Tensor, causal: bool, cu_seqlens: torch.Tensor | None):
    """Document sub-blocks of a whole local sequence, or None (no documents / one per row)."""
    if cu_seqlens is None:
        return None
    if q.shape[1] != k.shape[1]:
        raise RuntimeConfigError(
            f"document masking needs self-attention (as many keys as queries), got {q.shape[1]} and {k.shape[1]}"
        )
    bounds = row_bounds(cu_seqlens, q.shape[0], q.shape[1])
    if all(len(b) == 2 for b in bounds):
        return None
    whole = ((0, q.shape[1]),)
    return block_pairs(bounds, whole, whole, causal)


@torch.library.custom_op("sp_plan::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None, backend: str | None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention: output ``(B, S, H, D)`` and LSE ``(B, H, S)``; document-masked with ``cu_seqlens``."""
    check_qkv(q, k, v, causal, scale)
    pairs = _local_pairs(q, k, causal, cu_seqlens)
    if pairs is None:
        out, lse = attention_forward(q, k, v, causal=causal, scale=scale, backend=backend)
    else:
        scale = resolve_scale(scale, q.shape[-1])
        out, lse = documents_forward(q, k, v, pairs, scale=scale, backend=backend)
    return out.contiguous(), lse.to(lse_dtype(q.dtype)).contiguous()


@attention_op.register_fake
def _(q, k, v, causal, scale, backend, cu_seqlens=None):
    return _empty(q), _empty(q, _lse_shape(q), lse_dtype(q.dtype))


@torch.library.custom_op("sp_plan::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float | None, backend: str | None, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`attention_op`."""
    pairs = _local_pairs(q, k, causal, cu_seqlens)
    if pairs is None:
        grads = attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=backend)
    else:
        scale = resolve_scale(scale, q.shape[-1])
        grads = documents_backward(dout, q, k, v, out, lse, pairs, scale=scale, backend=backend)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, scale, backend, cu_seqlens=None):
    return _empty(q), _empty(k), _empty(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, backend, cu_seqlens = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.backend, cu_seqlens)
    return dq, dk, dv, None, None, None, None


attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


# ----- ring attention ------------------------------------------------------------------------------


@torch.library.custom_op("sp_plan::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, causal: bool, scale: float | None,
    backend: str | None, layout: str = "zigzag", cu_seqlens: torch.Tensor | None = None, agreed: bool = False,
    needs_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring pass over the named group: output in q's dtype and the merged LSE. ``layout`` "" = none
    declared (allowed for non-causal attention without documents). ``agreed``: the caller (USP's Ulysses
    step) has already checked agreement across the whole grid, so only the local checks run here.
    ``needs_grad``: whether the caller's inputs require grad (checked to agree across the ranks)."""
    pg = resolve_group(group)
    bounds = validate_ring_call(q, k, v, pg, causal, layout or None, cu_seqlens, scale, agreed=agreed,
                                needs_grad=needs_grad)
    scale = resolve_scale(scale, q.shape[-1])
    out, lse = _ring_forward(q, k, v, RingComm(pg), causal, scale, backend, layout or None, bounds)
    return out.to(q.dtype).contiguous(), lse.contiguous()


@ring_attention_op.register_fake
def _(q, k, v, group, causal, scale, backend, layout="zigzag", cu_seqlens=None, agreed=False, needs_grad=False):
    return _empty(q), _empty(q, _lse_shape(q), lse_dtype(q.dtype))


@torch.library.custom_op("sp_plan::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    group: str, causal: bool, scale: float | None, backend: str | None, layout: str = "zigzag",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`ring_attention_op` (the K/V and dK/dV rings)."""
    pg = resolve_group(group)
    comm = RingComm(pg)
    bounds = None
    if cu_seqlens is not None:
        batch, seq_len = q.shape[0], q.shape[1] * comm.world
        if not single_document_rows(cu_seqlens, batch, seq_len):
            bounds = row_bounds(cu_seqlens, batch, seq_len)
    grads = _ring_backward(dout, q, k, v, out, lse, comm, causal, resolve_scale(scale, q.shape[-1]), backend,
                           layout or None, bounds)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, group, causal, scale, backend, layout="zigzag", cu_seqlens=None):
    return _empty(q), _empty(k), _empty(v)


def _ring_setup(ctx, inputs, output):
    q, k, v, group, causal, scale, backend, layout, cu_seqlens, _agreed, _needs_grad = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.group, ctx.causal, ctx.scale, ctx.backend, ctx.layout = group, causal, scale, backend, layout
    ctx.mark_non_differentiable(lse)


def _ring_attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(dout, q, k, v, out, lse, ctx.group, ctx.causal, ctx.scale,
                                            ctx.backend, ctx.layout, cu_seqlens)
    return dq, dk, dv, None, None, None, None, None, None, None, None


ring_attention_op.register_autograd(_ring_attention_backward, setup_context=_ring_setup)


# ----- Ulysses all-to-alls -------------------------------------------------------------------------
# Shapes: sequence split (B, s, H, D) <-> head split (B, world*s, H/world, D).


def _head_split(shape, world: int) -> tuple[int, int, int, int]:
    b, s, h, d = shape
    return (b, s * world, h // world, d)


def _seq_split(shape, world: int) -> tuple[int, int, int, int]:
    b, s, h, d = shape
    return (b, s // world, h * world, d)


@torch.library.custom_op("sp_plan::ulysses_a2a_seq_to_head", mutates_args=())
def ulysses_a2a_seq_to_head(xs: list[torch.Tensor], group: str, world: int, phase: str) -> list[torch.Tensor]:
    """Raw all-to-all, sequence split -> head split, all tensors in one message (no autograd)."""
    return [y.contiguous() for y in seq_to_head(list(xs), resolve_group(group), world, phase)]


@ulysses_a2a_seq_to_head.register_fake
def _(xs, group, world, phase):
    return [_empty(x, _head_split(x.shape, world)) for x in xs]


@torch.library.custom_op("sp_plan::ulysses_a2a_head_to_seq", mutates_args=())
def ulysses_a2a_head_to_seq(xs: list[torch.Tensor], group: str, world: int, phase: str) -> list[torch.Tensor]:
    """Raw all-to-all, head split -> sequence split, all tensors in one message (no autograd)."""
    return [y.contiguous() for y in head_to_seq(list(xs), resolve_group(group), world, phase)]


@ulysses_a2a_head_to_seq.register_fake
def _(xs, group, world, phase):
    return [_empty(x, _seq_split(x.shape, world)) for x in xs]


@torch.library.custom_op("sp_plan::ulysses_qkv_to_heads", mutates_args=())
def ulysses_qkv_to_heads_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, world: int, causal: bool = False,
    scale: float | None = None, cu_seqlens: torch.Tensor | None = None, outer: str = "", needs_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V from the sequence split to the head split in ONE all-to-all, KV heads replicated first when
    the degree exceeds them. First, on every call, every rank of the group (and of ``outer``, USP's ring
    group, when given) learns whether all ranks hold the same shapes, dtype, scale, documents and valid
    inputs, and all raise together if not (:func:`sp_plan.runtime.attention.groups.agree`). ``causal``, ``scale``
    and ``cu_seqlens`` are only checked here; the inner attention uses them."""
    pg = resolve_group(group)
    problem = None
    try:
        check_qkv(q, k, v, causal, scale)
        ulysses_kv_replication(q.shape[2], k.shape[2], world)
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens)
    except RuntimeConfigError as exc:
        problem = str(exc)
    agree(pg, "Ulysses attention", (q, k, v), problem=problem, causal=causal, scale=scale, cu_seqlens=cu_seqlens,
          outer=resolve_group(outer) if outer else None, needs_grad=needs_grad)
    rep = ulysses_kv_replication(q.shape[2], k.shape[2], world)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    return tuple(y.contiguous() for y in seq_to_head([q, k, v], pg, world, "forward"))  # type: ignore[return-value]


def _kv_replication(q_heads: int, kv_heads: int, world: int) -> int:
    """The replication factor without raising (fake implementations run before any check)."""
    if kv_heads % world == 0 or world % kv_heads:
        return 1
    return world // kv_heads


@ulysses_qkv_to_heads_op.register_fake
def _(q, k, v, group, world, causal=False, scale=None, cu_seqlens=None, outer="", needs_grad=False):
    rep = _kv_replication(q.shape[2], k.shape[2], world)
    kv = (k.shape[0], k.shape[1], k.shape[2] * rep, k.shape[3])
    return _empty(q, _head_split(q.shape, world)), _empty(k, _head_split(kv, world)), _empty(v, _head_split(kv, world))


def _qkv_setup(ctx, inputs, output):
    q, k, v, group, world = inputs[:5]
    ctx.group, ctx.world = group, world
    ctx.kv_heads = k.shape[2]
    ctx.rep = _kv_replication(q.shape[2], k.shape[2], world)


def _qkv_backward(ctx, dq, dk, dv):
    dq, dk, dv = ulysses_a2a_head_to_seq([dq, dk, dv], ctx.group, ctx.world, "backward")
    if ctx.rep > 1:  # sum the gradients of each KV head's replicas (they sit next to each other)
        b, s, _, d = dk.shape
        dk = dk.view(b, s, ctx.kv_heads, ctx.rep, d).sum(dim=3)
        dv = dv.view(b, s, ctx.kv_heads, ctx.rep, d).sum(dim=3)
    return dq, dk, dv, None, None, None, None, None, None, None


ulysses_qkv_to_heads_op.register_autograd(_qkv_backward, setup_context=_qkv_setup)


@torch.library.custom_op("sp_plan::ulysses_head_to_seq", mutates_args=())
def ulysses_head_to_seq_op(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """``(B, S, h, D)`` head-split -> ``(B, S/world, world*h, D)`` sequence-split (one all-to-all)."""
    (out,) = head_to_seq([x], resolve_group(group), world, "forward")
    return out.contiguous()


@ulysses_head_to_seq_op.register_fake
def _(x, group, world):
    return _empty(x, _seq_split(x.shape, world))


def _head_to_seq_setup(ctx, inputs, output):
    _, group, world = inputs
    ctx.group, ctx.world = group, world


def _head_to_seq_backward(ctx, grad):
    (dx,) = ulysses_a2a_seq_to_head([grad], ctx.group, ctx.world, "backward")
    return dx, None, None


ulysses_head_to_seq_op.register_autograd(_head_to_seq_backward, setup_context=_head_to_seq_setup)


#: Op overloads whose outputs selective checkpointing keeps instead of recomputing.
KEPT_BY_SELECTIVE: tuple = (
    torch.ops.sp_plan.attention.default,
    torch.ops.sp_plan.ring_attention.default,
    torch.ops.sp_plan.ulysses_head_to_seq.default,
)
