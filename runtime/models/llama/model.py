"""A small, real Llama-style decoder built from a :class:`~sp_plan.cost_models.ModelSpec`.

embedding -> N x [RMSNorm -> attention (RoPE, GQA) -> residual -> RMSNorm -> SwiGLU MLP -> residual]
-> final RMSNorm -> lm_head (optionally tied to the embedding).

It is the reference the memory model's tensor graphs mirror, and the base later work extends
(Ulysses/Ring attention through ``attention_fn``, tensor parallelism, tiled MLP, HF integration), so it
stays generic:

- attention goes through a pluggable ``attention_fn(q, k, v, causal) -> out`` on (batch, seq, heads,
  head_dim) tensors; the default :class:`FlashAttention` saves exactly q, k, v, out and the fp32 LSE
  for backward; :class:`MaterializedAttention` computes softmax(QK^T)V in eager ops (HF eager /
  Megatron-style, for activation-accounting checks). Packed rows: ``forward(..., cu_seqlens=)``
  (the data path's document boundaries, :mod:`sp_plan.runtime.attention.documents`) reaches every layer's
  ``attention_fn`` as the keyword ``cu_seqlens`` (only when given, so other attention functions keep
  working), and each token attends only within its document;
- :class:`RMSNorm` is a custom autograd function that saves only its input and the fp32 rstd;
- every block runs under a checkpointing mode (none / selective / full; see
  :mod:`sp_plan.runtime.models.checkpointing`), optionally with its checkpointed input offloaded to host memory
  (:mod:`sp_plan.runtime.offload`);
- the MLP can run tiled over the sequence (:mod:`sp_plan.runtime.tiled_mlp`), and the model exposes the final
  hidden states for a chunked loss (:meth:`LlamaModel.hidden_states`, :mod:`sp_plan.runtime.tiled_loss`);
- tensor parallelism (:mod:`sp_plan.runtime.tp`) swaps in sharded projections and sets the ``tp_enter`` hooks
  (the all-gather / identity that opens a TP region); without it they are ``None`` and the default
  path, and what it saves for backward, are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.checkpointing import check_mode, keep_for_selective, run_checkpointed
from sp_plan.runtime.tiled_mlp import tile_tokens_for, tiled_gated_mlp

AttentionFn = Callable[..., torch.Tensor]


# ----- RMSNorm ---------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rstd).to(x.dtype), rstd = 1 / sqrt(mean(x^2) + eps), computed in (at least) fp32.

    Saves x (compute dtype) and rstd (fp32, one value per row) - what a fused kernel keeps - instead of
    the fp32 copies an eager implementation would leave to autograd. With ``chunk_elements`` the rows
    are processed in chunks of about that many elements, so the fp32 temporaries of the eager math
    (about 5 fp32 copies of the input in backward) exist for one chunk only: the working set stays
    bounded like a fused kernel's (which the memory model assumes: ``norm_implementation='fused'``)
    instead of growing with the sequence. Results are the same per row; the weight gradient is summed
    over chunks in fp32.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, *chunking: int | None):
        chunk_elements = chunking[0] if chunking else None  # optional 4th argument
        acc = _accumulate_dtype(x)
        width = x.shape[-1]
        rows = x.reshape(-1, width)
        chunk = _chunk_rows(rows.shape[0], width, chunk_elements)
        y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty((*x.shape[:-1], 1), dtype=acc, device=x.device)
        y_rows, rstd_rows = y.view(-1, width), rstd.view(-1, 1)
        for start in range(0, rows.shape[0], chunk):
            xf = rows[start : start + chunk].to(acc)
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y_rows[start : start + chunk] = weight * (xf * r).to(x.dtype)
            rstd_rows[start : start + chunk] = r
            del xf, r
        ctx.save_for_backward(x, weight, rstd)
        ctx.chunk, ctx.n_inputs = chunk, 3 + len(chunking)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        acc = _accumulate_dtype(x)
        width = x.shape[-1]
        rows, rstd_rows = x.reshape(-1, width), rstd.reshape(-1, 1)
        grad_rows = grad.reshape(-1, width)
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        grad_x_rows = grad_x.view(-1, width)
        grad_weight = torch.zeros(width, dtype=acc, device=x.device) if ctx.needs_input_grad[1] else None
        w = weight.to(acc)
        for start in range(0, rows.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            r = rstd_rows[start:stop]
            xhat = rows[start:stop].to(acc) * r
            g = grad_rows[start:stop].to(acc)
            if grad_weight is not None:
                grad_weight += (g * xhat.to(x.dtype).to(acc)).sum(0)
            gx = g * w
            grad_x_rows[start:stop] = r * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
            del xhat, g, gx
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return (grad_x, grad_weight) + (None,) * (ctx.n_inputs - 2)


def _chunk_rows(rows: int, width: int, chunk_elements: int | None) -> int:
    if chunk_elements is None:
        return max(rows, 1)
    return max(1, min(rows, chunk_elements // width))


def _accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def norm_chunk_elements(spec: ModelSpec) -> int:
    """Elements per RMSNorm chunk: one tiled-MLP tile of hidden states (hidden_size tokens x hidden_size)."""
    return spec.hidden_size * spec.hidden_size


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. ``chunk_elements`` bounds the eager fp32 working set (see
    :class:`_RMSNormFunction`); the Llama model sets it to ``hidden_size**2``: one tiled-MLP tile of hidden
    states (``hidden_size`` tokens), so the norm's temporaries stay below the MLP tile's."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, chunk_elements: int | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.chunk_elements = chunk_elements
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.chunk_elements)


# ----- rotary position embedding -----------------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given positions, computed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, theta: float = 500_000.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise RuntimeConfigError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # (batch, seq, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin: (batch, seq, head_dim). Saves only cos and sin."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


# ----- attention kernels ---------------------------------------------------------------------------------


class FlashAttention(nn.Module):
    """Local fused attention on (batch, seq, heads, head_dim); GQA without materialising repeated K/V.

    On CPU it calls ``aten._scaled_dot_product_flash_attention_for_cpu`` directly (PyTorch's CPU flash
    kernel: saves q, k, v, out and the fp32 LSE, handles fewer KV heads natively); elsewhere it uses
    ``scaled_dot_product_attention(..., enable_gqa=True)`` and lets PyTorch pick the fused backend.
    """

    def __init__(self, dropout_p: float = 0.0, scale: float | None = None) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        _check_heads(q, k, v)
        p = self.dropout_p if self.training else 0.0
        if cu_seqlens is not None:  # packed documents: the runtime's document-masked kernel (same saved tensors)
            if p > 0:
                raise RuntimeConfigError("attention dropout with packed documents (cu_seqlens) is not supported")
            from sp_plan.runtime.attention import local_attention

            return local_attention(q, k, v, causal=causal, scale=self.scale, cu_seqlens=cu_seqlens)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if q.device.type == "cpu":
            out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, p, causal, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal, scale=self.scale,
                                                 enable_gqa=True)
        return out.transpose(1, 2)


class MaterializedAttention(nn.Module):
    """softmax(Q K^T * scale + causal bias) V in eager ops, K/V repeated to the query heads (HF eager).

    Saves the q/k/v copies the two batched matmuls read, the softmax output (fp32 with
    ``softmax_fp32``, as HF does, plus its cast), the dropout mask and dropped probabilities.
    """

    def __init__(self, dropout_p: float = 0.0, softmax_fp32: bool = False, scale: float | None = None) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        self.softmax_fp32 = softmax_fp32
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        _check_heads(q, k, v)
        if cu_seqlens is not None:
            raise RuntimeConfigError(
                "MaterializedAttention has no document masking (packed cu_seqlens): use FlashAttention or the "
                "sequence-parallel attention"
            )
        b, s, hq, d = q.shape
        hk = k.shape[2]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        # Temporaries are deleted as soon as they are dead, so what stays alive is what autograd saves (the
        # memory model's accounting mirrors this code); the bias is built last, right before its use.
        rep = hq // hk
        q3 = q.transpose(1, 2).reshape(b * hq, s, d)
        k3t = _repeat_kv(k, rep).reshape(b * hq, s, d).transpose(1, 2)
        bias = _causal_bias(s, q) if causal else torch.zeros(s, s, dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(bias, q3, k3t, alpha=scale)
        del q3, k3t, bias
        if self.softmax_fp32:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            probs = torch.softmax(scores, dim=-1)
        del scores
        if self.softmax_fp32:
            probs = probs.to(q.dtype)
        if self.training and self.dropout_p > 0:
            probs = dropout(probs, self.dropout_p)
        v3 = _repeat_kv(v, rep).reshape(b * hq, s, d)
        with keep_for_selective():  # only the output product: kept by selective checkpointing
            out = torch.bmm(probs, v3)
        del probs, v3
        return out.view(b, hq, s, d).transpose(1, 2).contiguous()


def _causal_bias(s: int, like: torch.Tensor) -> torch.Tensor:
    """Additive causal mask: 0 on and below the diagonal, -inf above."""
    mask = torch.ones(s, s, dtype=torch.bool, device=like.device).triu(1)
    return torch.zeros(s, s, dtype=like.dtype, device=like.device).masked_fill_(mask, float("-inf"))


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout that saves a 1-byte bool mask on every device.

    ``F.dropout`` does that on CUDA (it calls ``native_dropout``) but on CPU saves its scaled noise in the
    input's dtype; calling ``native_dropout`` directly keeps CPU measurements equal to GPU behaviour.
    """
    return torch.native_dropout(x, p, True)[0]


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """(b, s, kv, d) -> (b, kv * rep, s, d) copy, each KV head repeated for its query group."""
    b, s, kv, d = x.shape
    x = x.transpose(1, 2)
    if rep == 1:
        return x
    return x[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[2] % k.shape[2]:
        raise RuntimeConfigError(
            f"attention expects (batch, seq, heads, head_dim) with query heads a multiple of KV heads; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


# ----- the model -----------------------------------------------------------------------------------------


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, attention_fn: AttentionFn, eps: float, **factory) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.qkv_bias, **factory)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias, **factory)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias, **factory)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=spec.attn_out_bias, **factory)
        chunk = norm_chunk_elements(spec)
        self.q_norm = RMSNorm(d, eps, chunk_elements=chunk, **factory) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, eps, chunk_elements=chunk, **factory) if spec.qk_norm else None
        self.attention_fn = attention_fn
        #: Opens a tensor-parallel region (all-gather over the sequence, or identity with an all-reduce in
        #: backward); None without TP. Heads below are whatever the (possibly sharded) projections give.
        self.tp_enter: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp_enter is not None:
            x = self.tp_enter(x)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        documents = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        out = self.attention_fn(q, k, v, causal=True, **documents)
        del q, k, v  # free what autograd did not save before the output projection runs
        return self.o_proj(out.reshape(b, s, -1))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): saves gate, silu(gate), up and their product (eager SwiGLU).

    With ``tiled`` set (:func:`sp_plan.runtime.tiled_mlp.apply_tiled_mlp`) the same computation runs over tiles
    of ``tile_tokens`` tokens (None: the memory model's default rule) and saves only its input.
    """

    def __init__(self, spec: ModelSpec, **factory) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.gate_proj = nn.Linear(h, f, bias=spec.mlp_bias, **factory)
        self.up_proj = nn.Linear(h, f, bias=spec.mlp_bias, **factory)
        self.down_proj = nn.Linear(f, h, bias=spec.mlp_bias, **factory)
        self.tp_enter: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.tiled = False
        self.tile_tokens: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_enter is not None:
            x = self.tp_enter(x)
        if not self.tiled:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        tile = tile_tokens_for(x.shape[-1], x.numel() // x.shape[-1], self.tile_tokens)
        return tiled_gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, F.silu, tile)


class LlamaBlock(nn.Module):
    """Pre-norm decoder block; ``checkpointing`` is 'none', 'selective' or 'full'."""

    def __init__(self, spec: ModelSpec, attention_fn: AttentionFn, checkpointing: str = "none",
                 eps: float = 1e-5, **factory) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, eps, chunk_elements=norm_chunk_elements(spec), **factory)
        self.attn = LlamaAttention(spec, attention_fn, eps, **factory)
        self.post_attention_norm = RMSNorm(spec.hidden_size, eps, chunk_elements=norm_chunk_elements(spec), **factory)
        self.mlp = LlamaMLP(spec, **factory)
        self.hidden_dropout = spec.hidden_dropout
        self.checkpointing = check_mode(checkpointing)
        #: Moves the checkpointed block input to host memory between forward and backward
        #: (:class:`sp_plan.runtime.offload.CheckpointOffload`); None keeps it on the device.
        self.checkpoint_offload = None

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            return dropout(x, self.hidden_dropout)
        return x

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self._dropout(self.attn(self.input_norm(x), cos, sin, cu_seqlens))
        return h + self._dropout(self.mlp(self.post_attention_norm(h)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        return run_checkpointed(self._forward, self.checkpointing, x, cos, sin, cu_seqlens,
                                offload=self.checkpoint_offload)


def check_llama_spec(spec: ModelSpec) -> None:
    """The runtime model implements Llama-family architectures; say which field disagrees."""
    wrong = [
        f"{field}={getattr(spec, field)!r} (need {need!r})"
        for field, need in (("activation", "swiglu"), ("norm", "rmsnorm"), ("position_embedding", "rope"))
        if getattr(spec, field) != need
    ]
    wrong += ["mixture-of-experts layers (need dense MLPs)"] * (spec.moe is not None)
    wrong += ["MLA attention (need grouped-query attention)"] * (spec.mla is not None)
    wrong += ["extra norms per layer (need two)"] * bool(spec.extra_norms_per_layer)
    if wrong:
        raise RuntimeConfigError(
            f"{spec.name}: the runtime Llama model supports SwiGLU + RMSNorm + RoPE decoders; "
            f"this spec has {', '.join(wrong)}"
        )


class LlamaModel(nn.Module):
    """Decoder-only Llama-style LM. ``forward(input_ids, position_ids=None, cu_seqlens=None) -> logits``.

    :meth:`hidden_states` stops before the lm_head (the input of a chunked loss, which multiplies by
    ``lm_head.weight`` chunk by chunk). ``cu_seqlens``: packed documents (cumulative boundaries over the
    flattened full batch, as :class:`sp_plan.runtime.data.BatchSharder` makes them): document-masked attention.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        attention_fn: AttentionFn | None = None,
        checkpointing: str = "none",
        rope_theta: float = 500_000.0,
        norm_eps: float = 1e-5,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_llama_spec(spec)
        factory = {"dtype": dtype, "device": device}
        self.spec = spec
        self.attention_fn = attention_fn if attention_fn is not None else FlashAttention(spec.attention_dropout)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, **factory)
        self.rotary = RotaryEmbedding(spec.head_dim, rope_theta, device=device)
        self.layers = nn.ModuleList(
            LlamaBlock(spec, self.attention_fn, checkpointing, norm_eps, **factory) for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, norm_eps, chunk_elements=norm_chunk_elements(spec), **factory)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, **factory)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        #: Opens the lm_head's tensor-parallel region (all-gather of the sequence-parallel hidden states, or
        #: identity with an all-reduce in backward); None without TP.
        self.head_tp_enter: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_checkpointing(self, mode: str) -> None:
        check_mode(mode)
        for layer in self.layers:
            layer.checkpointing = mode

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) matrices, zero biases, unit norm weights (deterministic with ``generator``)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm output the lm_head multiplies (all tokens of this rank's sequence shard)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cu_seqlens)
        x = self.norm(x)
        return self.head_tp_enter(x) if self.head_tp_enter is not None else x

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, position_ids, cu_seqlens))
