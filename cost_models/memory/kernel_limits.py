"""Sizes a stack's kernels cannot address at all, whatever memory is free.

A kernel that computes a row's start as ``row index x row stride`` in 32-bit integers faults (an
illegal memory access, not an out-of-memory error) once that offset passes 2^31 - 1. Liger-Kernel
before 0.6.1 does so in its RMSNorm/LayerNorm and RoPE kernels (``tl.program_id(0)`` is int32:
liger_kernel/ops/rms_norm.py ``_rms_norm_forward_kernel``/``_rms_norm_backward_kernel``, layer_norm.py,
rope.py ``_triton_rope``; fixed by linkedin/Liger-Kernel#804 in 0.6.1). The ALST runs of the
calibration set used those versions (ArcticTraining raised its minimum to 0.6.1 "int64 indexing" after
them), so their longest lengths are bounded by the per-GPU slice those kernels see, before the
all-to-all: the norms' ``norm_tokens x hidden`` rows and RoPE's (and the q/k norms') rows of all local
query heads, ``tokens x q_heads x head_dim``. For Llama-8B (hidden 4096) that is 524,288 tokens per
GPU; for Qwen3-32B and Llama-70B (64 x 128 query width) 262,144.
"""

from __future__ import annotations

from ..model_spec import ModelSpec
from .assumptions import MemoryAssumptions
from .dims import LocalDims


def row_kernel_last_offset(model: ModelSpec, d: LocalDims, a: MemoryAssumptions) -> int:
    """Largest element offset at which one of the stack's Triton row kernels starts a row on this GPU:
    ``(rows - 1) x row stride`` over the tensors they run on (0 when the stack runs none)."""
    offsets = [0]
    if a.norm_implementation == "fused":
        # input, post-attention and final norm: one row per token, stride hidden
        offsets.append((d.norm_tokens - 1) * d.hidden)
        if model.qk_norm:
            # q_norm over [tokens, q_heads, head_dim] viewed as rows of head_dim (k_norm's are fewer)
            offsets.append((d.tokens * d.q_heads - 1) * d.head_dim)
    if a.rope_implementation == "inplace" and model.position_embedding == "rope":
        # one row per token of q [batch x seq, q_heads, head_dim], stride q_heads x head_dim (k's is narrower)
        offsets.append((d.tokens - 1) * d.q_width)
    return max(offsets)


def within_row_kernel_limit(offset: int, limit: int | None) -> bool:
    """Whether row kernels that address at most ``limit`` can start a row at element ``offset``."""
    return limit is None or offset <= limit


def row_kernel_limit_text(offset: int, limit: int | None, tokens: int) -> str:
    """The miss in one line (what the planner and the CLI print)."""
    return (f"the stack's Triton row kernels (norms, RoPE) compute row offsets in int32 (e.g. Liger-Kernel < 0.6.1; "
            f"--assume row_kernel_offset_limit=...): {tokens:,} tokens per GPU put the last row at element "
            f"{offset:,}, past {limit:,} (an illegal memory access, whatever memory is free)")


__all__ = ["row_kernel_last_offset", "row_kernel_limit_text", "within_row_kernel_limit"]
