"""The one local attention kernel every parallel path uses: output AND log-sum-exp, with a backward.

Ring attention needs the LSE of each block to merge partial results exactly, and its backward calls the
kernel's backward with the *merged* output and LSE (the gradient of one block of a softmax that spans
all blocks). So this module exposes the kernel as a pair of plain functions::

    out, lse = attention_forward(q, k, v, causal=..., scale=...)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=..., scale=...)

plus :func:`local_attention`, the autograd-aware single-device attention built from the same pair.

Layout everywhere: q ``(batch, seq_q, heads, head_dim)``, k and v ``(batch, seq_k, kv_heads, head_dim)``
with ``heads % kv_heads == 0`` (GQA/MQA); the output has q's shape and dtype; the LSE is
``(batch, heads, seq_q)`` in fp32 (fp64 for fp64 inputs, so fp64 tests stay exact). ``causal=True``
requires ``seq_q == seq_k`` (a square, diagonal block): PyTorch aligns the causal mask top-left and
flash-attn bottom-right, and requiring a square block makes both mean the same thing.

Backends, chosen per call by :func:`select_backend` (override with the ``backend=`` argument or the
``SP_PLAN_ATTENTION_BACKEND`` environment variable):

``flash_attn``
    The flash-attn 2 package (lazy import), CUDA fp16/bf16, head_dim a multiple of 8 up to 256.
    Native GQA. Its backward is the package's private ``_flash_attn_backward``, whose argument list
    changed across 2.x releases; we bind it by parameter name (see :func:`_flash_attn_backward`).
``sdpa_flash`` / ``sdpa_efficient``
    PyTorch's CUDA SDPA ops that return the LSE (``aten._scaled_dot_product_flash_attention`` for
    fp16/bf16, ``aten._scaled_dot_product_efficient_attention`` otherwise) and their backward ops.
    KV heads are repeated for these (we do not rely on the ATen ops accepting fewer KV heads).
``sdpa_cpu_flash``
    ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward. Native GQA: the op
    accepts fewer KV heads and returns dK/dV with kv_heads (verified against the fp64 reference).
``math``
    Materialised scores in fp32 (fp64 for fp64 inputs), native GQA by grouping query heads. The
    fallback for anything the fused kernels do not take (e.g. fp64 on CUDA).

Dropout is not supported (modern long-context pre-training uses none, and ring attention would
have to replay each block's RNG state).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from runtime.errors import RuntimeConfigError

Backend = Literal["flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu_flash", "math"]
BACKENDS: tuple[str, ...] = ("flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu_flash", "math")
BACKEND_ENV = "SP_PLAN_ATTENTION_BACKEND"

#: Backends whose kernels take fewer KV heads than query heads without a materialised repeat.
_NATIVE_GQA = frozenset({"flash_attn", "sdpa_cpu_flash", "math"})
#: flash-attn 2 and PyTorch's flash kernel: head_dim limits (multiple of 8 for the direct backward call).
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8
#: The CUDA memory-efficient kernel pads its LSE (and expects it padded in backward) to this many rows.
EFFICIENT_LSE_ALIGNMENT = 32


def default_scale(head_dim: int) -> float:
    """The usual softmax scale 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE and accumulator dtype for inputs of ``dtype``: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----- validation ------------------------------------------------------------------------------


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise a one-line RuntimeConfigError when q, k, v cannot go through the kernel together."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeConfigError(
            f"attention expects 4-D (batch, seq, heads, head_dim) tensors, got q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)}: reshape the projections to that layout"
        )
    if k.shape != v.shape:
        raise RuntimeConfigError(f"k{tuple(k.shape)} and v{tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise RuntimeConfigError(
            f"q{tuple(q.shape)} and k{tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3)"
        )
    if q.shape[2] % k.shape[2]:
        raise RuntimeConfigError(
            f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads: grouped-query "
            "attention needs each KV head shared by a whole number of query heads"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise RuntimeConfigError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}): cast them to one dtype")
    if causal and q.shape[1] != k.shape[1]:
        raise RuntimeConfigError(
            f"causal attention needs as many queries as keys (got {q.shape[1]} and {k.shape[1]}): the "
            "causal diagonal is only unambiguous for a square block"
        )


# ----- backend selection ------------------------------------------------------------------------


@functools.cache
def flash_attn_available() -> bool:
    """True when the flash-attn 2 package imports (checked once; never imported at module load)."""
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_interface  # noqa: F401
    except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import
        return False
    return True


def select_backend(q: torch.Tensor, backend: str | None = None) -> str:
    """The backend for inputs like ``q``: the explicit choice, the env override, or the fastest that fits."""
    choice = backend or os.environ.get(BACKEND_ENV) or None
    if choice is not None:
        if choice not in BACKENDS:
            raise RuntimeConfigError(f"unknown attention backend {choice!r}; use one of {', '.join(BACKENDS)}")
        return choice
    head_dim = q.shape[-1]
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        flash_shape = head_dim <= FLASH_MAX_HEAD_DIM and head_dim % FLASH_HEAD_DIM_MULTIPLE == 0
        if half and flash_shape and flash_attn_available():
            return "flash_attn"
        if half and flash_shape:
            return "sdpa_flash"
        if q.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return "sdpa_efficient"
        return "math"
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "sdpa_cpu_flash"
    return "math"


# ----- work accounting ---------------------------------------------------------------------------


def attended_pairs(seq_q: int, seq_k: int, causal: bool) -> int:
    """(query, key) pairs that are not masked: all of them, or the lower triangle of a square block."""
    return seq_q * (seq_q + 1) // 2 if causal else seq_q * seq_k


#: Matmul FLOPs per attended (query, key) pair, per head and head_dim element: forward QK^T and PV
#: (2 FLOPs per multiply-add each); backward recomputes QK^T and adds dV, dP, dQ, dK (5 matmuls).
FORWARD_FLOPS_PER_PAIR = 4
BACKWARD_FLOPS_PER_PAIR = 10


@dataclass
class KernelWork:
    """Kernel calls and matmul FLOPs (over attended pairs only) issued by this rank."""

    forward_calls: int = 0
    backward_calls: int = 0
    forward_flops: int = 0
    backward_flops: int = 0
    per_call: list[tuple[str, int]] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops


_WORK_COUNTERS: list[KernelWorkCounter] = []


class KernelWorkCounter:
    """Context manager recording the kernel work of every forward/backward call (for load balance)."""

    def __enter__(self) -> KernelWork:
        self.work = KernelWork()
        _WORK_COUNTERS.append(self)
        return self.work

    def __exit__(self, *exc: object) -> None:
        _WORK_COUNTERS.remove(self)


def _record_work(pass_: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if not _WORK_COUNTERS:
        return
    batch, seq_q, heads, head_dim = q.shape
    pairs = attended_pairs(seq_q, k.shape[1], causal) * batch * heads * head_dim
    for counter in _WORK_COUNTERS:
        work = counter.work
        if pass_ == "forward":
            work.forward_calls += 1
            work.forward_flops += FORWARD_FLOPS_PER_PAIR * pairs
            work.per_call.append(("forward", FORWARD_FLOPS_PER_PAIR * pairs))
        else:
            work.backward_calls += 1
            work.backward_flops += BACKWARD_FLOPS_PER_PAIR * pairs
            work.per_call.append(("backward", BACKWARD_FLOPS_PER_PAIR * pairs))


# ----- the kernel pair ---------------------------------------------------------------------------


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output ``(B, Sq, H, D)`` in q's dtype and LSE ``(B, H, Sq)`` (fp32; fp64 for fp64)."""
    check_qkv(q, k, v, causal)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    name = select_backend(q, backend)
    _record_work("forward", q, k, causal)
    out, lse = _FORWARD[name](q, k, v, causal, scale)
    return out, lse.to(lse_dtype(q.dtype))


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for ``out = attention(q, k, v)`` given ``dout``, the output and its LSE.

    ``out`` and ``lse`` may be those of a larger softmax that contains this block (ring attention):
    the kernel then returns this block's share of the exact gradients. dq has q's shape, dk/dv k's.
    """
    check_qkv(q, k, v, causal)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    name = select_backend(q, backend)
    _record_work("backward", q, k, causal)
    dout = dout.to(q.dtype)
    out = out.to(q.dtype)
    return _BACKWARD[name](dout, q, k, v, out, lse, causal, scale)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Single-device attention (autograd-aware); the LSE, if returned, carries no gradient.

    Runs as the ``sp_plan::attention`` custom op (:mod:`runtime.attention.ops`), so selective
    checkpointing keeps its output and LSE instead of re-running the kernel.
    """
    from runtime.attention.ops import attention_op

    out, lse = attention_op(q, k, v, causal, scale, backend)
    return (out, lse) if return_lse else out


# ----- backends ---------------------------------------------------------------------------------


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B, H, S, D) view, the layout the SDPA ops take (no copy)."""
    return x.transpose(1, 2)


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _sum_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    batch, seq, heads, head_dim = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(batch, seq, kv_heads, heads // kv_heads, head_dim).sum(dim=3)


# -- CPU flash (PyTorch) --


def _cpu_flash_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.to(lse_dtype(q.dtype)), 0.0, causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# -- CUDA SDPA ops (PyTorch) --
# Not exercised by the CPU test suite. The backward ops are called with the dense-batch conventions
# (no cumulative sequence lengths: None becomes an undefined tensor) and empty RNG tensors, which
# the kernels read only when dropout_p > 0.


def _no_rng(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def _sdpa_flash_forward(q, k, v, causal, scale):
    group = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, group), _repeat_kv(v, group)
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale
    )
    return result[0].transpose(1, 2), result[1]


def _sdpa_flash_backward(dout, q, k, v, out, lse, causal, scale):
    kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, group), _repeat_kv(v, group)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.float().contiguous(), None, None,
        q.shape[1], k.shape[1], 0.0, causal, _no_rng(q.device), _no_rng(q.device), scale=scale,
    )
    dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
    return dq.transpose(1, 2), _sum_kv_grad(dk, kv_heads), _sum_kv_grad(dv, kv_heads)


def _sdpa_efficient_forward(q, k, v, causal, scale):
    group = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, group), _repeat_kv(v, group)
    result = torch.ops.aten._scaled_dot_product_efficient_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, scale=scale
    )
    return result[0].transpose(1, 2), result[1][..., : q.shape[1]]


def _sdpa_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, group), _repeat_kv(v, group)
    seq_q = q.shape[1]
    padded = -(-seq_q // EFFICIENT_LSE_ALIGNMENT) * EFFICIENT_LSE_ALIGNMENT
    lse_padded = lse.new_zeros(lse.shape[0], lse.shape[1], padded, dtype=torch.float32)
    lse_padded[..., :seq_q] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), None, _bhsd(out), lse_padded,
        _no_rng(q.device), _no_rng(q.device), 0.0, [True, True, True, False], causal, scale=scale,
    )
    dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
    return dq.transpose(1, 2), _sum_kv_grad(dk, kv_heads), _sum_kv_grad(dv, kv_heads)


# -- flash-attn 2 package --
# Not exercised by the CPU test suite (flash-attn needs CUDA). The forward uses the public
# ``flash_attn_func(..., return_attn_probs=True)``, stable across 2.x; the backward has no public
# form, so ``_flash_attn_backward`` is bound by parameter name: 2.3-2.5 take ``window_size``,
# 2.6 adds ``softcap``, 2.7+ split the window into ``window_size_left``/``window_size_right``.


def _flash_attn_forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out, lse[..., : q.shape[1]]


@functools.cache
def _flash_attn_backward_binding() -> tuple[object, frozenset[str]]:
    from flash_attn import flash_attn_interface

    fn = flash_attn_interface._flash_attn_backward
    original = getattr(fn, "_init_fn", fn)  # torch.library.custom_op wraps the function in 2.6+
    return fn, frozenset(inspect.signature(original).parameters)


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    if q.shape[-1] % FLASH_HEAD_DIM_MULTIPLE:
        raise RuntimeConfigError(
            f"backend 'flash_attn' needs head_dim a multiple of {FLASH_HEAD_DIM_MULTIPLE} (got {q.shape[-1]}): "
            "let select_backend choose, or pad head_dim"
        )
    fn, params = _flash_attn_backward_binding()
    options: dict[str, object] = {
        "dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "softcap": 0.0,
        "alibi_slopes": None, "deterministic": False, "rng_state": None,
    }
    if "window_size_left" in params:
        options.update(window_size_left=-1, window_size_right=-1)
    else:
        options["window_size"] = (-1, -1)
    options = {name: value for name, value in options.items() if name in params}
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn(dout, q, k, v, out, lse.float().contiguous(), dq, dk, dv, **options)
    return dq, dk, dv


# -- materialised fallback --


def _scores(q, k, causal, scale):
    """Scores (B, KVH, G, Sq, Sk) in the accumulation dtype, GQA by grouping (no repeat of k)."""
    acc = lse_dtype(q.dtype)
    batch, seq_q, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    qg = q.to(acc).view(batch, seq_q, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(acc)) * scale
    if causal:
        mask = torch.ones(seq_q, k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _probabilities(scores, lse_grouped):
    """exp(scores - lse), with fully masked rows (lse = -inf) giving zeros instead of NaN."""
    safe = torch.where(torch.isinf(lse_grouped), torch.zeros_like(lse_grouped), lse_grouped)
    return torch.exp(scores - safe.unsqueeze(-1))


def _math_forward(q, k, v, causal, scale):
    batch, seq_q, heads, head_dim = q.shape
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (B, KVH, G, Sq); -inf on fully masked rows
    probs = _probabilities(scores, lse)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(scores.dtype)).reshape(batch, seq_q, heads, head_dim)
    return out.to(q.dtype), lse.reshape(batch, heads, seq_q)


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    batch, seq_q, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scores = _scores(q, k, causal, scale)
    acc = scores.dtype
    probs = _probabilities(scores, lse.to(acc).view(batch, kv_heads, group, seq_q))
    do = dout.to(acc).view(batch, seq_q, kv_heads, group, head_dim)
    o = out.to(acc).view(batch, seq_q, kv_heads, group, head_dim)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", probs, do)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(acc))
    delta = (do * o).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # (B, KVH, G, Sq, 1)
    ds = probs * (dp - delta)
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(acc)).reshape(batch, seq_q, heads, head_dim) * scale
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q.to(acc).view(batch, seq_q, kv_heads, group, head_dim)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_FORWARD = {
    "flash_attn": _flash_attn_forward,
    "sdpa_flash": _sdpa_flash_forward,
    "sdpa_efficient": _sdpa_efficient_forward,
    "sdpa_cpu_flash": _cpu_flash_forward,
    "math": _math_forward,
}
_BACKWARD = {
    "flash_attn": _flash_attn_backward,
    "sdpa_flash": _sdpa_flash_backward,
    "sdpa_efficient": _sdpa_efficient_backward,
    "sdpa_cpu_flash": _cpu_flash_backward,
    "math": _math_backward,
}


# ----- exact reference ---------------------------------------------------------------------------


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in fp64 with plain autograd ops (materialised scores, repeated KV heads).

    Independent of every kernel above, for tests: returns fp64 ``(out, lse)``; backpropagate
    through ``out`` for fp64 reference gradients of the (upcast) inputs.
    """
    check_qkv(q, k, v, causal)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    group = q.shape[2] // k.shape[2]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v64)
    return out, torch.logsumexp(scores, dim=-1)
