"""The one local attention kernel every parallel path uses: output AND log-sum-exp, with a backward.

Ring attention needs the LSE of each block to merge partial results exactly, and its backward calls the
kernel's backward with the *merged* output and LSE (the gradient of one block of a softmax that spans
all blocks). So this module exposes the kernel as a pair of plain functions::

    out, lse = attention_forward(q, k, v, causal=..., scale=...)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=..., scale=...)

which :func:`sp_plan.runtime.attention.api.local_attention` wraps as autograd-aware single-device attention.

Layout everywhere: q ``(batch, seq_q, heads, head_dim)``, k and v ``(batch, seq_k, kv_heads, head_dim)``
with ``heads % kv_heads == 0`` (GQA/MQA); the output has q's shape and dtype; the LSE is
``(batch, heads, seq_q)`` in fp32 (fp64 for fp64 inputs, so fp64 tests stay exact). ``causal=True``
requires ``seq_q == seq_k`` (a square, diagonal block): PyTorch aligns the causal mask top-left and
flash-attn bottom-right, and requiring a square block makes both mean the same thing.

Backends, chosen per call by :func:`select_backend` (override with the ``backend=`` argument or the
``SP_PLAN_ATTENTION_BACKEND`` environment variable):

``fa3``
    FlashAttention-3 (the ``flash_attn_interface`` module of flash-attn's ``hopper/`` build), CUDA
    compute capability 9.x (Hopper), fp16/bf16, head_dim a multiple of 8 up to 256. Native GQA.
    Forward through the public ``flash_attn_func(..., return_attn_probs=True)``, backward through
    the private ``_flash_attn_backward`` bound by parameter name (its argument list changed across
    FA3 releases). Varlen (document masking) through ``flash_attn_varlen_func``.
``flash_attn``
    The flash-attn 2 package (lazy import), CUDA fp16/bf16, head_dim a multiple of 8 up to 256.
    Native GQA. Its backward is the package's private ``_flash_attn_backward``, whose argument list
    changed across 2.x releases; we bind it by parameter name (see :func:`_flash_attn_backward`).
    Varlen (document masking) through ``flash_attn_varlen_func`` (flash-attn >= 2.5, whose varlen
    LSE is ``(heads, total_q)``).
``sdpa_cudnn``
    PyTorch's cuDNN attention (``aten._scaled_dot_product_cudnn_attention``, which returns the LSE,
    and its backward), CUDA compute capability >= 9.0 with cuDNN >= 9, fp16/bf16, head_dim a multiple
    of 8 up to 128. KV heads are repeated.
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

from sp_plan.runtime.errors import RuntimeConfigError

Backend = Literal["fa3", "flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu_flash", "math"]
BACKENDS: tuple[str, ...] = ("fa3", "flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu_flash",
                             "math")
BACKEND_ENV = "SP_PLAN_ATTENTION_BACKEND"

#: Backends whose kernels take fewer KV heads than query heads without a materialised repeat.
_NATIVE_GQA = frozenset({"fa3", "flash_attn", "sdpa_cpu_flash", "math"})
#: Backends that write the block gradients into buffers the caller passes (ring attention reuses them).
GRAD_BUFFER_BACKENDS = frozenset({"fa3", "flash_attn"})
#: flash-attn 2 and PyTorch's flash kernel: head_dim limits (multiple of 8 for the direct backward call).
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8
#: cuDNN attention: head_dim limit, and the compute capability / cuDNN version it is selected from.
CUDNN_MAX_HEAD_DIM = 128
CUDNN_MIN_CAPABILITY = (9, 0)
CUDNN_MIN_VERSION = 90000
#: FlashAttention-3 is selected on Hopper (compute capability 9.x) and later.
FA3_MIN_CAPABILITY = (9, 0)
#: flash-attn 2 releases whose varlen LSE is (heads, total_q) (older ones pad it per sequence).
FLASH_VARLEN_MIN_VERSION = (2, 5)
#: The CUDA memory-efficient kernel pads its LSE (and expects it padded in backward) to this many rows.
EFFICIENT_LSE_ALIGNMENT = 32


def default_scale(head_dim: int) -> float:
    """The usual softmax scale 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE and accumulator dtype for inputs of ``dtype``: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----- validation ------------------------------------------------------------------------------


#: Floating dtypes the kernels take (the agreement descriptor of :mod:`.groups` encodes them by index).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_NAMES = ("q", "k", "v")


def qkv_problem(q: object, k: object, v: object, causal: bool) -> str | None:
    """Why q, k, v cannot go through the kernel together (one actionable sentence), or None.

    A function that returns instead of raising, so the multi-rank ops can first tell every rank of the
    group whether *any* rank has a problem (:func:`sp_plan.runtime.attention.groups.agree`) and then raise on all
    of them alike, instead of one rank raising while its peers wait in a collective.
    Every check reads only metadata (shapes, dtypes, devices): nothing syncs with a GPU.
    """
    tensors = (q, k, v)
    for name, x in zip(_NAMES, tensors):
        if not isinstance(x, torch.Tensor):
            return f"attention expects torch.Tensor inputs, got {name} of type {type(x).__name__}"
    shapes = f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"attention expects 4-D (batch, seq, heads, head_dim) tensors, got {shapes}: reshape the "
                "projections to that layout")
    for name, x in zip(_NAMES, tensors):
        if x.numel() == 0:
            return (f"attention got an empty {name} {tuple(x.shape)}: batch, sequence, heads and head_dim must all "
                    "be at least 1 (an empty sequence has nothing to attend to); drop empty batches before the "
                    "model (sp_plan.runtime.data.BatchSharder refuses them)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}): cast them to one dtype"
    if q.dtype not in SUPPORTED_DTYPES:
        return (f"attention needs floating-point q, k, v ({', '.join(str(d) for d in SUPPORTED_DTYPES)}), got "
                f"{q.dtype}: cast the projections")
    if q.device != k.device or q.device != v.device:
        return f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}): move them to one device"
    if k.shape != v.shape:
        return f"k{tuple(k.shape)} and v{tuple(v.shape)} must have the same shape"
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"q{tuple(q.shape)} and k{tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3)"
    if q.shape[2] % k.shape[2]:
        return (f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads: grouped-query attention "
                "needs each KV head shared by a whole number of query heads")
    if causal and q.shape[1] != k.shape[1]:
        return (f"causal attention needs as many queries as keys (got {q.shape[1]} and {k.shape[1]}): the causal "
                "diagonal is only unambiguous for a square block")
    return None


def scale_problem(scale: object) -> str | None:
    """Why ``scale`` is not a usable softmax scale (None = the default 1/sqrt(head_dim)), or None.

    A scale <= 0 or non-finite makes every kernel return NaN or garbage (scale 0 is NaN in the CPU
    flash kernel, uniform weights elsewhere), so it is refused up front rather than computed.
    """
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return f"attention scale must be a positive float (or None for 1/sqrt(head_dim)), got {type(scale).__name__}"
    if not math.isfinite(scale) or scale <= 0:
        return (f"attention scale must be finite and > 0 (the softmax temperature; None gives 1/sqrt(head_dim)), "
                f"got {scale}")
    return None


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: object = None) -> None:
    """Raise a one-line RuntimeConfigError when q, k, v (and ``scale``) cannot go through the kernel together."""
    problem = qkv_problem(q, k, v, causal) or scale_problem(scale)
    if problem:
        raise RuntimeConfigError(problem)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale to use: ``scale`` checked, or 1/sqrt(head_dim)."""
    problem = scale_problem(scale)
    if problem:
        raise RuntimeConfigError(problem)
    if scale is None:
        if head_dim < 1:
            raise RuntimeConfigError(f"attention needs head_dim >= 1, got {head_dim}")
        return default_scale(head_dim)
    return float(scale)


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


@functools.cache
def flash_attn_version() -> tuple[int, ...]:
    """The installed flash-attn 2 version as integers (() when it does not import)."""
    if not flash_attn_available():
        return ()
    import flash_attn

    parts = []
    for piece in str(getattr(flash_attn, "__version__", "0")).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.cache
def fa3_available() -> bool:
    """True when FlashAttention-3's ``flash_attn_interface`` imports and exposes the functions used here."""
    try:
        import flash_attn_interface
    except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import
        return False
    return all(hasattr(flash_attn_interface, name) for name in ("flash_attn_func", "_flash_attn_backward"))


def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def cudnn_attention_available(device: torch.device) -> bool:
    """cuDNN SDPA usable on ``device``: the ATen op exists, cuDNN >= 9 and compute capability >= 9.0."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    try:
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        return False
    return version is not None and version >= CUDNN_MIN_VERSION and _capability(device) >= CUDNN_MIN_CAPABILITY


def varlen_available(name: str) -> bool:
    """Whether backend ``name`` computes document-masked blocks in one varlen call (else one call each)."""
    if name == "fa3":
        import flash_attn_interface

        return hasattr(flash_attn_interface, "flash_attn_varlen_func")
    return name == "flash_attn" and flash_attn_version()[:2] >= FLASH_VARLEN_MIN_VERSION


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
        if half and flash_shape and fa3_available() and _capability(q.device) >= FA3_MIN_CAPABILITY:
            return "fa3"
        if half and flash_shape and flash_attn_available():
            return "flash_attn"
        cudnn_shape = head_dim <= CUDNN_MAX_HEAD_DIM and head_dim % FLASH_HEAD_DIM_MULTIPLE == 0
        if half and cudnn_shape and cudnn_attention_available(q.device):
            return "sdpa_cudnn"
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
    _record_pairs(pass_, attended_pairs(seq_q, k.shape[1], causal) * batch * heads * head_dim)


def _record_varlen_work(pass_: str, cu_q: torch.Tensor, cu_k: torch.Tensor, heads: int, head_dim: int,
                        causal: bool) -> None:
    if not _WORK_COUNTERS:
        return
    lengths_q, lengths_k = cu_q.diff().tolist(), cu_k.diff().tolist()
    pairs = sum(attended_pairs(lq, lk, causal) for lq, lk in zip(lengths_q, lengths_k))
    _record_pairs(pass_, pairs * heads * head_dim)


def _record_pairs(pass_: str, pairs: int) -> None:
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
    check_qkv(q, k, v, causal, scale)
    scale = resolve_scale(scale, q.shape[-1])
    name = select_backend(q, backend)
    _record_work("forward", q, k, causal)
    # The fused kernels are called below the public SDPA, which would make the last dim contiguous first:
    # PyTorch's CPU flash kernel ignores a strided last dim and returns wrong numbers (relative error ~1).
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out, lse = _FORWARD[name](q, k, v, causal, scale)
    lse = lse.to(lse_dtype(q.dtype))
    out, lse = propagate_nonfinite_queries(q, out, lse)
    return out, lse


def propagate_nonfinite_queries(q: torch.Tensor, out: torch.Tensor,
                                lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN output and LSE for every (row, head) whose query holds a NaN or inf, as exact attention gives.

    PyTorch's CPU flash kernel returns output 0 and LSE 0 for a query row with a NaN (its running max
    skips NaN scores), so a NaN in q would silently vanish; the materialised fallback gives a mix of
    NaN and inf for an inf in q, and the fused GPU kernels are not verified here, so every backend
    goes through this. Propagation, not detection (no host sync): ``poison`` is 0 for a finite row and
    NaN otherwise (0 x the row's max and min: amax/amin propagate NaN and show an inf, and unlike a
    row sum they cannot overflow), added in place to the kernel's fresh output and LSE, so finite rows
    are unchanged and dead rows (LSE -inf) stay dead. Measured on one CPU thread (8 heads, head_dim 64):
    3.0% of the causal forward at 256 tokens, 0.34% at 8K (an isfinite().all() mask with masked_fill
    cost 24% and 2.4%).
    """
    poison = q.amax(dim=-1) * 0 + q.amin(dim=-1) * 0  # (B, S, H): 0, or NaN for a non-finite row
    out.add_(poison.unsqueeze(-1).to(out.dtype))
    lse.add_(poison.transpose(1, 2).to(lse.dtype))
    return out, lse


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
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for ``out = attention(q, k, v)`` given ``dout``, the output and its LSE.

    ``out`` and ``lse`` may be those of a larger softmax that contains this block (ring attention):
    the kernel then returns this block's share of the exact gradients. dq has q's shape, dk/dv k's.
    ``grads``: buffers of those shapes (last dim contiguous) that the flash-attn backends write the
    gradients into, so a caller looping over blocks allocates them once; others ignore them.
    """
    check_qkv(q, k, v, causal, scale)
    scale = resolve_scale(scale, q.shape[-1])
    name = select_backend(q, backend)
    _record_work("backward", q, k, causal)
    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
    if name in GRAD_BUFFER_BACKENDS:
        return _BACKWARD[name](dout, q, k, v, out, lse, causal, scale, grads=grads)
    return _BACKWARD[name](dout, q, k, v, out, lse, causal, scale)


def varlen_forward(name: str, q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float):
    """One varlen kernel call: q ``(total_q, H, D)``, k/v ``(total_k, KVH, D)``, sequence i = rows
    ``cu_q[i]:cu_q[i+1]`` against ``cu_k[i]:cu_k[i+1]`` (causal: bottom-right aligned, used only for
    square sequences). Returns the output ``(total_q, H, D)`` and the fp32 LSE ``(H, total_q)``."""
    _record_varlen_work("forward", cu_q, cu_k, q.shape[1], q.shape[2], causal)
    return _VARLEN_FORWARD[name](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)


def varlen_backward(name: str, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool,
                    scale: float):
    """Gradients of one varlen call (``lse``: ``(H, total_q)`` fp32, contiguous)."""
    _record_varlen_work("backward", cu_q, cu_k, q.shape[1], q.shape[2], causal)
    return _VARLEN_BACKWARD[name](dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, cu_q, cu_k, max_q, max_k,
                                  causal, scale)


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


# -- cuDNN (PyTorch) --
# Not exercised by the CPU test suite. The LSE is (B, H, S, 1) fp32 in and out; the philox seed and
# offset are read by the kernel only with dropout, so zero scalars stand in for them in backward.


def _cudnn_forward(q, k, v, causal, scale):
    group = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, group), _repeat_kv(v, group)
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale
    )
    return result[0].transpose(1, 2), result[1].reshape(q.shape[0], q.shape[2], q.shape[1])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    # One layout for every operand: (B, S, H, D) contiguous, seen as (B, H, S, D) (the forward's layout).
    dout, q, out = dout.contiguous(), q.contiguous(), out.contiguous()
    k, v = _repeat_kv(k, group).contiguous(), _repeat_kv(v, group).contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.float().contiguous().unsqueeze(-1),
        seed, offset, None, None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale,
    )
    dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
    return dq.transpose(1, 2), _sum_kv_grad(dk, kv_heads), _sum_kv_grad(dv, kv_heads)


# -- flash-attn 2 package --
# Not exercised by the CPU test suite (flash-attn needs CUDA). The forward uses the public
# ``flash_attn_func(..., return_attn_probs=True)``, stable across 2.x; the backward has no public
# form, so ``_flash_attn_backward`` is bound by parameter name: 2.3-2.5 take ``window_size``,
# 2.6 adds ``softcap``, 2.7+ split the window into ``window_size_left``/``window_size_right``.
# The kernels need only the last dim contiguous (they take the other strides), so ring attention's
# row slices go in without copies; the LSE must be a contiguous (B, H, S) (the kernel indexes it
# densely).


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _flash_attn_forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out, lse[..., : q.shape[1]]


def _bind(fn) -> tuple[object, frozenset[str]]:
    original = getattr(fn, "_init_fn", fn)  # torch.library.custom_op wraps the function
    return fn, frozenset(inspect.signature(original).parameters)


@functools.cache
def _flash_attn_backward_binding(varlen: bool = False) -> tuple[object, frozenset[str]]:
    from flash_attn import flash_attn_interface

    return _bind(flash_attn_interface._flash_attn_varlen_backward if varlen else flash_attn_interface._flash_attn_backward)


def _flash_options(params: frozenset[str], causal: bool, scale: float) -> dict[str, object]:
    options: dict[str, object] = {
        "dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "softcap": 0.0,
        "alibi_slopes": None, "deterministic": False, "rng_state": None,
    }
    if "window_size_left" in params:
        options.update(window_size_left=-1, window_size_right=-1)
    else:
        options["window_size"] = (-1, -1)
    return {name: value for name, value in options.items() if name in params}


def _grad_buffers(q, k, v, grads):
    if grads is None:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return grads


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale, grads=None):
    if q.shape[-1] % FLASH_HEAD_DIM_MULTIPLE:
        raise RuntimeConfigError(
            f"backend 'flash_attn' needs head_dim a multiple of {FLASH_HEAD_DIM_MULTIPLE} (got {q.shape[-1]}): "
            "let select_backend choose, or pad head_dim"
        )
    fn, params = _flash_attn_backward_binding()
    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    dq, dk, dv = _grad_buffers(q, k, v, grads)
    fn(dout, q, k, v, out, lse.float().contiguous(), dq, dk, dv, **_flash_options(params, causal, scale))
    return dq, dk, dv


def _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    from flash_attn import flash_attn_varlen_func

    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                                         causal=causal, return_attn_probs=True)
    if lse.dim() != 2:  # releases before the (heads, total_q) layout pad the LSE per sequence
        raise RuntimeConfigError(
            f"flash-attn {'.'.join(map(str, flash_attn_version()))} returns a padded varlen LSE {tuple(lse.shape)}; "
            "document masking needs the (heads, total_q) layout of newer releases: upgrade flash-attn, or set "
            "SP_PLAN_ATTENTION_BACKEND=sdpa_flash"
        )
    return out, lse


def _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    fn, params = _flash_attn_backward_binding(varlen=True)
    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
       max_seqlen_k=max_k, **_flash_options(params, causal, scale))
    return dq, dk, dv


# -- FlashAttention-3 (flash_attn_interface, Hopper) --
# Not exercised by the CPU test suite. Forward through the public functions (``return_attn_probs=True``
# returns (out, lse); early FA3 releases returned both unconditionally), backward through the private
# ``_flash_attn_backward`` bound by parameter name: its arguments were renamed and reordered across FA3
# releases (``causal`` -> ``is_causal``, ``window_size`` -> ``window_size_left/right``, cu_seqlens added).


def _fa3_result(result) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(result, (tuple, list)) or len(result) < 2:
        raise RuntimeConfigError(
            "this flash_attn_interface (FlashAttention-3) does not return the softmax LSE that sequence-parallel "
            "attention needs: update it, or set SP_PLAN_ATTENTION_BACKEND=flash_attn (or sdpa_flash)"
        )
    return result[0], result[1]


def _fa3_call(fn, *args, **kwargs):
    params = frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
    if "return_attn_probs" in params:
        kwargs["return_attn_probs"] = True
    return _fa3_result(fn(*args, **kwargs))


def _fa3_forward(q, k, v, causal, scale):
    import flash_attn_interface

    out, lse = _fa3_call(flash_attn_interface.flash_attn_func, q, k, v, softmax_scale=scale, causal=causal)
    return out, lse[..., : q.shape[1]]


def _fa3_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    import flash_attn_interface

    return _fa3_call(flash_attn_interface.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max_q, max_k,
                     softmax_scale=scale, causal=causal)


@functools.cache
def _fa3_backward_binding() -> tuple[object, frozenset[str]]:
    import flash_attn_interface

    return _bind(flash_attn_interface._flash_attn_backward)


def _fa3_run_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, varlen=None):
    fn, params = _fa3_backward_binding()
    values: dict[str, object] = {
        "dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse, "dq": dq, "dk": dk, "dv": dv,
        "softmax_scale": scale, "causal": causal, "is_causal": causal, "window_size": (-1, -1),
        "window_size_left": -1, "window_size_right": -1, "softcap": 0.0, "deterministic": False, "sm_margin": 0,
        "cu_seqlens_q": None, "cu_seqlens_k": None, "sequed_q": None, "sequed_k": None, "seqused_q": None,
        "seqused_k": None, "max_seqlen_q": None, "max_seqlen_k": None,
    }
    if varlen is not None:
        values.update(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), varlen))
    unknown = [name for name in params if name not in values]
    if unknown or (varlen is not None and "cu_seqlens_q" not in params):
        raise RuntimeConfigError(
            f"this FlashAttention-3 build's _flash_attn_backward takes {sorted(params)}, which sp-plan does not know "
            f"({sorted(unknown) or 'no varlen arguments'}): set SP_PLAN_ATTENTION_BACKEND=flash_attn or sdpa_flash"
        )
    fn(**{name: values[name] for name in params})


def _fa3_backward(dout, q, k, v, out, lse, causal, scale, grads=None):
    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    dq, dk, dv = _grad_buffers(q, k, v, grads)
    _fa3_run_backward(dout, q, k, v, out, lse.float().contiguous(), dq, dk, dv, causal, scale)
    return dq, dk, dv


def _fa3_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _fa3_run_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, varlen=(cu_q, cu_k, max_q, max_k))
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
    "fa3": _fa3_forward,
    "flash_attn": _flash_attn_forward,
    "sdpa_cudnn": _cudnn_forward,
    "sdpa_flash": _sdpa_flash_forward,
    "sdpa_efficient": _sdpa_efficient_forward,
    "sdpa_cpu_flash": _cpu_flash_forward,
    "math": _math_forward,
}
_BACKWARD = {
    "fa3": _fa3_backward,
    "flash_attn": _flash_attn_backward,
    "sdpa_cudnn": _cudnn_backward,
    "sdpa_flash": _sdpa_flash_backward,
    "sdpa_efficient": _sdpa_efficient_backward,
    "sdpa_cpu_flash": _cpu_flash_backward,
    "math": _math_backward,
}
_VARLEN_FORWARD = {"fa3": _fa3_varlen_forward, "flash_attn": _flash_attn_varlen_forward}
_VARLEN_BACKWARD = {"fa3": _fa3_varlen_backward, "flash_attn": _flash_attn_varlen_backward}


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
    check_qkv(q, k, v, causal, scale)
    scale = resolve_scale(scale, q.shape[-1])
    group = q.shape[2] // k.shape[2]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v64)
    return out, torch.logsumexp(scores, dim=-1)
