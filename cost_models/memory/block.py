"""The ops of one transformer block on one GPU, as a :class:`~.graph.Graph`.

It mirrors the forward code of the runtime (``runtime/models/llama/model.py``) and of HF Llama/torchtitan:

    x -> norm1 -> [all-gather over tp] -> q, k, v projections -> [q/k norm] -> RoPE
      -> [repeat KV heads] -> [Ulysses all-to-all of q, k, v] -> attention (flash, ring or materialized)
      -> [Ulysses all-to-all of the output] -> o_proj -> [reduce-scatter over tp] -> [dropout] -> + x = h1
    h1 -> norm2 -> [all-gather] -> MLP (SwiGLU or GELU; or tiled) -> [reduce-scatter] -> [dropout] -> + h1 = y

What each op saves is what PyTorch autograd saves for it:

- a linear saves its input (not its output); a fused norm saves its input and fp32 statistics;
- RoPE (x * cos + rotate_half(x) * sin) saves only cos and sin, shared by all layers (counted once per
  model, not here); views, repeats, casts, all-to-alls and residual adds save nothing;
- SiLU saves its input, a product saves both factors, GELU saves its input, dropout a 1-byte mask;
- a flash kernel saves q, k, v, its output and the fp32 log-sum-exp; materialized attention saves the
  (K/V-repeated) q, k, v copies it multiplies, the softmax output, the dropout mask and dropped
  probabilities, exactly as HF eager / Megatron do.
"""

from __future__ import annotations

from ..model_spec import ModelSpec
from .assumptions import MemoryAssumptions
from .dims import LocalDims
from .graph import ATTENTION, CORE_ATTENTION, MATMUL, SDPA, Graph, GraphBuilder, TensorSpec, Workspace
from .liveness import simulate
from .mla_block import mla_projections
from .moe_block import moe_ffn_ops

FP32 = 4
#: Bytes per element of a dropout mask (torch's native_dropout saves a bool mask).
MASK_BYTES = 1


class BlockBuilder:
    """Builds the graph; methods mirror the runtime's modules."""

    def __init__(self, model: ModelSpec, d: LocalDims, a: MemoryAssumptions, training: bool, tiled_mlp: bool,
                 kernel: str, mlp_param_grad_bytes: int = 0) -> None:
        self.m, self.d, self.a = model, d, a
        self.training = training
        self.tiled_mlp = tiled_mlp
        self.kernel = kernel
        self.mlp_param_grad_bytes = mlp_param_grad_bytes
        self.B = d.compute_bytes
        self.g = GraphBuilder()

    # ----- building blocks --------------------------------------------------------------------------
    def norm(self, name: str, x: str, rows: int, width: int) -> str:
        """RMSNorm/LayerNorm over ``width`` for ``rows`` rows."""
        B, g = self.B, self.g
        stats_bytes = rows * FP32 * (2 if self.m.norm == "layernorm" else 1)  # (mean,) rstd
        out = TensorSpec(f"{name}.out", rows * width * B)
        stats = TensorSpec(f"{name}.rstd", stats_bytes, requires_grad=False)
        if self.a.norm_implementation == "fused" or self.m.norm == "layernorm":
            # torch's native_layer_norm is fused too: input, mean and rstd.
            g.op(name, [x], [out, stats], saves=[x, stats.name])
        else:
            # HF LlamaRMSNorm in eager torch ops: x.float() is saved by pow and mul, the bf16 normalised
            # tensor by the weight multiply, rstd by rsqrt; x * rstd in fp32 is a forward temporary and
            # backward works in fp32 (two fp32 temporaries of the input's size plus the bf16 cast).
            upcast = TensorSpec(f"{name}.x_fp32", rows * width * FP32, requires_grad=False)
            normed = TensorSpec(f"{name}.normed", rows * width * B, requires_grad=False)
            g.op(
                name,
                [x],
                [out, upcast, normed, stats],
                saves=[upcast.name, normed.name, stats.name],
                fwd_workspace=[Workspace(rows * width * FP32)],
                bwd_workspace=[Workspace(rows * width * (2 * FP32 + B))],
            )
        return out.name

    def linear(self, name: str, x: str, out_bytes: int, saved_input: str | None = None, regather: int = 0,
               kind: str = "activation", holds: tuple[str, ...] = ()) -> str:
        """A linear saves its input; Megatron-style TP saves the shard and re-gathers it in backward."""
        out = TensorSpec(name, out_bytes, kind)
        self.g.op(name, [x], [out], saves=[saved_input or x], bwd_workspace=[Workspace(regather)], holds=holds,
                  tags=(MATMUL,))
        return name

    def simple(self, name: str, inputs: list[str], out_bytes: int, saves: list[str] | None = None,
               fwd_ws: list[Workspace] | None = None, bwd_ws: list[Workspace] | None = None,
               tags: tuple[str, ...] = (), kind: str = "activation", passthrough: bool = False,
               holds: tuple[str, ...] = ()) -> str:
        self.g.op(name, inputs, [TensorSpec(name, out_bytes, kind)], saves or [], fwd_ws, bwd_ws, tags, passthrough,
                  holds)
        return name

    def tp_gather(self, name: str, x: str, full_bytes: int) -> str:
        """Sequence-parallel all-gather before a column-parallel region (no-op without it)."""
        if not self.d.sequence_parallel:
            return x
        return self.simple(f"{name}.allgather", [x], full_bytes)

    def tp_scatter(self, name: str, x: str) -> str:
        """Reduce-scatter after a row-parallel region (in-place all-reduce without sequence parallelism)."""
        if not self.d.sequence_parallel:
            return x
        return self.simple(f"{name}.reduce_scatter", [x], self.d.norm_tokens * self.d.hidden * self.B)

    def dropout(self, name: str, x: str, p: float, elems: int) -> str:
        if not self.training or p <= 0:
            return x
        mask = TensorSpec(f"{name}.mask", elems * MASK_BYTES, requires_grad=False)
        out = TensorSpec(name, elems * self.B)
        self.g.op(name, [x], [out, mask], saves=[mask.name])
        return name

    def rope(self, name: str, x: str, nbytes: int) -> str:
        """x * cos + rotate_half(x) * sin: two x-sized temporaries live at once, forward and backward.
        An in-place kernel (Liger's) rotates ``x`` itself: no op, no new tensor."""
        if self.m.position_embedding != "rope" or self.a.rope_implementation == "inplace":
            return x
        ws = [Workspace(nbytes), Workspace(nbytes)]
        return self.simple(name, [x], nbytes, fwd_ws=ws, bwd_ws=ws)

    def alltoall(self, name: str, x: str, nbytes: int, tags: tuple[str, ...] = (),
                 holds: tuple[str, ...] = ()) -> str:
        """Ulysses all-to-all (sequence <-> head split): same bytes out as in, plus staging copies."""
        if self.d.ulysses == 1:
            return x
        ws = [Workspace(int(self.a.alltoall_staging_copies * nbytes), "comm")]
        return self.simple(name, [x], nbytes, fwd_ws=ws, bwd_ws=ws, tags=tags, holds=holds)

    def head_major(self, name: str, x: str, nbytes: int, heads: int) -> str:
        """DeepSpeed Ulysses' [seq, batch, heads, dim] -> [batch, heads, seq, dim] .contiguous() after an
        all-to-all: a copy when this GPU holds more than one head; its backward hands the gradient through."""
        if self.d.ulysses == 1 or not self.a.alltoall_head_major_copy or heads <= 1 or self.d.batch * heads <= 1:
            return x
        return self.simple(name, [x], nbytes, passthrough=True)

    def module_input(self, shard: str, gathered: str) -> tuple[str, ...]:
        """What a TP module's caller keeps referenced until the module returns: its input, and with
        DTensor-style sequence parallelism also the gathered copy the module's input hook made."""
        return (shard, gathered) if self.a.tp_saves_gathered_input else (shard,)

    # ----- the block ------------------------------------------------------------------------------------
    def build(self, inference: bool) -> Graph:
        d, B, m = self.d, self.B, self.m
        h, hd = d.hidden, d.head_dim
        x = self.g.input("x_in", d.norm_tokens * h * B)

        # --- attention half ---
        n1 = self.norm("norm1", x, d.norm_tokens, h)
        n1g = self.tp_gather("norm1", n1, d.tokens * h * B)
        saved_in, regather = self._linear_input(n1, n1g)
        if m.mla is not None:  # latent projections (mla_block.py)
            q, k, v = mla_projections(self, n1g, saved_in, regather)
        else:
            q = self.linear("q_proj", n1g, d.q_bytes(), saved_in, regather)
            k = self.linear("k_proj", n1g, d.k_proj_bytes(), saved_in, regather)
            v = self.linear("v_proj", n1g, d.k_proj_bytes(), saved_in, regather)
            if m.qk_norm:
                q = self.norm("q_norm", q, d.tokens * d.q_heads, hd)
                k = self.norm("k_norm", k, d.tokens * d.kv_heads_proj, hd)
            q = self.rope("q_rope", q, d.q_bytes())
            k = self.rope("k_rope", k, d.k_proj_bytes())
        if d.kv_heads > d.kv_heads_proj:  # Ulysses KV replication, before the all-to-all (DESIGN.md)
            k = self.simple("k_repeat", [k], d.k_bytes())
            v = self.simple("v_repeat", [v], d.k_bytes())
        attention_args = (q, k, v)  # the attention function's arguments, referenced until it returns
        q = self.head_major("q_head_major", self.alltoall("q_alltoall", q, d.q_bytes()), d.q_bytes(), d.q_heads_attn)
        k = self.head_major("k_head_major", self.alltoall("k_alltoall", k, d.k_bytes()), d.k_bytes(), d.kv_heads_attn)
        v = self.head_major("v_head_major", self.alltoall("v_alltoall", v, d.k_bytes()), d.k_bytes(), d.kv_heads_attn)
        if inference:
            # The KV cache is preallocated for every layer (static/paged cache, counted by the timeline);
            # K and V are copied into this layer's slice and attention reads them from there.
            k = self.simple("k_cache_write", [k], 0, kind="kv_cache")
            v = self.simple("v_cache_write", [v], 0, kind="kv_cache")
        attn = self._attention(q, k, v)
        attn = self.alltoall("out_alltoall", attn, d.q_bytes(), tags=(ATTENTION,), holds=attention_args)
        # The attention module's input stays referenced until the module returns (Python scope).
        o = self.linear("o_proj", attn, d.tokens * h * B, holds=self.module_input(n1, n1g))
        o = self.tp_scatter("o_proj", o)
        o = self.dropout("attn_residual_dropout", o, m.hidden_dropout, d.norm_tokens * h)
        h1 = self.simple("residual1", [x, o], d.norm_tokens * h * B, passthrough=True)

        # --- MLP half ---
        n2 = self.norm("norm2", h1, d.norm_tokens, h)
        n2g = self.tp_gather("norm2", n2, d.tokens * h * B)
        out = self._mlp(n2, n2g)
        out = self.tp_scatter("mlp", out)
        out = self.dropout("mlp_residual_dropout", out, m.hidden_dropout, d.norm_tokens * h)
        # The block's input is referenced by the caller until the block returns.
        self.simple("residual2", [h1, out], d.norm_tokens * h * B, passthrough=True, holds=(x,))
        return self.g.build(outputs=("residual2",))

    def _linear_input(self, shard: str, gathered: str) -> tuple[str, int]:
        """(tensor the column-parallel linears save, bytes re-gathered in their backward)."""
        if self.d.sequence_parallel and not self.a.tp_saves_gathered_input:
            return shard, self.d.tokens * self.d.hidden * self.B
        return gathered, 0

    def _attention(self, q: str, k: str, v: str) -> str:
        d, a, B = self.d, self.a, self.B
        q_elems = d.tokens * d.q_width
        lse = TensorSpec("attention.lse", d.tokens * d.q_heads * FP32, requires_grad=False)
        if self.kernel == "materialized":
            return self._materialized_attention(q, k, v)
        bwd = []
        if a.flash_backward_dq_accum_fp32:
            # D = rowsum(dO*O) (softmax_d) and dq_accum, with flash-attn varlen's 128 padding rows per sequence
            pad_rows = a.flash_varlen_pad_rows * d.sequences * d.q_heads_attn
            bwd.append(Workspace((d.tokens * d.q_heads + pad_rows) * FP32))
            bwd.append(Workspace((q_elems + pad_rows * d.head_dim) * FP32))
        if a.flash_backward_expands_gqa and d.kv_heads_attn < d.q_heads_attn:
            bwd += [Workspace(q_elems * B), Workspace(q_elems * B)]  # dK, dV per query head before the group sum
        fwd = []
        if d.ring > 1:
            kv_bytes = 2 * d.k_bytes()
            kv_fp32 = 2 * d.tokens * d.kv_heads * d.head_dim * FP32
            # Forward: fp32 output/LSE accumulators, one block's output/LSE, K/V blocks in flight.
            fwd = [
                Workspace(q_elems * FP32 + 2 * d.tokens * d.q_heads * FP32 + q_elems * B),
                Workspace(a.ring_kv_buffers * kv_bytes, "comm"),
            ]
            # Backward: fp32 dQ accumulator, one block's dQ/dK/dV, K/V blocks and fp32 dK/dV accumulators
            # travelling around the ring.
            bwd += [
                Workspace(q_elems * FP32 + q_elems * B + kv_bytes),
                Workspace(a.ring_kv_buffers * (kv_bytes + kv_fp32), "comm"),
            ]
        out = TensorSpec("attention", d.q_bytes())
        name = "ring_attention" if d.ring > 1 else "flash_attention"
        self.g.op(name, [q, k, v], [out, lse], saves=[q, k, v, out.name, lse.name],
                  fwd_workspace=fwd, bwd_workspace=bwd, tags=frozenset({ATTENTION, CORE_ATTENTION, SDPA}))
        return out.name

    def _materialized_attention(self, q: str, k: str, v: str) -> str:
        """softmax(Q K^T / sqrt(d) + causal bias) V with K/V repeated to the query heads (HF eager)."""
        d, B, a = self.d, self.B, self.a
        core = (CORE_ATTENTION,)
        probs = d.batch * d.q_heads_attn * d.attn_seq * d.attn_seq
        q3 = self.simple("attn.q_bmm_layout", [q], d.q_bytes(), tags=core)
        k3 = self.simple("attn.k_repeat_bmm_layout", [k], d.q_bytes(), tags=core)
        mask = Workspace(d.attn_seq * d.attn_seq * B)  # additive causal bias, built per call
        scores = self.simple("attn.scores", [q3, k3], probs * B, saves=[q3, k3], fwd_ws=[mask], tags=core)
        softmax_bytes = FP32 if a.materialized_softmax_fp32 else B
        upcast = [Workspace(probs * FP32)] if a.materialized_softmax_fp32 and B != FP32 else []
        p = self.simple("attn.softmax", [scores], probs * softmax_bytes, saves=["attn.softmax"], fwd_ws=upcast,
                        tags=core)
        if softmax_bytes != B:
            p = self.simple("attn.softmax_cast", [p], probs * B, tags=core)
        if self.training and self.m.attention_dropout > 0:
            mask_t = TensorSpec("attn.dropout.mask", probs * MASK_BYTES, requires_grad=False)
            out = TensorSpec("attn.dropout", probs * B)
            self.g.op("attn.dropout", [p], [out, mask_t], saves=[mask_t.name], tags=frozenset(core))
            p = out.name
        v3 = self.simple("attn.v_repeat_bmm_layout", [v], d.q_bytes(), tags=core)
        o3 = self.simple("attn.pv", [p, v3], d.q_bytes(), saves=[p, v3], tags=(ATTENTION, CORE_ATTENTION))
        # q, k, v are the attention function's arguments: referenced until it returns.
        return self.simple("attn.out_layout", [o3], d.q_bytes(), tags=core, holds=(q, k, v))

    def _mlp(self, n2: str, n2g: str) -> str:
        d, B = self.d, self.B
        saved_in, regather = self._linear_input(n2, n2g)
        if self.tiled_mlp:
            fwd, bwd = self._tile_workspace()
            out_bytes = d.tokens * d.hidden * B
            if self.a.tiled_mlp_concat_outputs:
                # DeepSpeed's TiledMLP keeps every tile's output in a list and torch.cat's them: at the cat
                # the list (one output's worth) exists beside the result.
                fwd = max(fwd, out_bytes)
            bwd_ws = [Workspace(bwd + regather), Workspace(self.mlp_param_grad_bytes, "grads")]
            return self.simple("tiled_mlp", [n2g], out_bytes, saves=[saved_in],
                               fwd_ws=[Workspace(fwd)], bwd_ws=bwd_ws)
        return _mlp_ops(self, n2g, saved_in, regather, d.tokens, holds=self.module_input(n2, n2g))

    def _tile_workspace(self) -> tuple[int, int]:
        """Forward and backward working set of one MLP tile, from a simulation of the MLP on it.

        TiledMLP (ALST) runs the MLP tile by tile under no_grad in forward and, in backward, recomputes
        each tile with grad and back-propagates it, so only one tile's intermediates exist at a time.
        The tile's input and output gradient are slices of full tensors that exist anyway.
        """
        d, B = self.d, self.B
        tile = min(self.a.tiled_mlp_tile_tokens or d.hidden, d.tokens)
        sub = BlockBuilder(self.m, d, self.a, self.training, tiled_mlp=False, kernel=self.kernel)
        x = sub.g.input("tile_in", tile * d.hidden * B)
        _mlp_ops(sub, x, x, 0, tile, holds=(x,))
        mem = simulate(sub.g.build(outputs=(sub.g.ops[-1].name,)), "full")
        tile_in = tile * d.hidden * B
        fwd = mem.forward_peak.total - tile_in
        bwd = mem.backward_peak.total - 2 * tile_in  # minus the input slice and the output-gradient slice
        return fwd, max(bwd, 0)


def _mlp_ops(b: BlockBuilder, x: str, saved_in: str, regather: int, tokens: int, holds: tuple[str, ...] = (),
             width: int | None = None, prefix: str = "") -> str:
    """The MLP's ops on ``tokens`` tokens: eager/fused SwiGLU or GELU, or a MoE model's mixture of experts
    (:mod:`.moe_block`, which calls back here for the experts' SwiGLU: ``width`` and a name ``prefix``).
    ``holds``: the MLP module's input, referenced until the module returns."""
    if b.m.moe is not None and width is None:
        return moe_ffn_ops(b, x, saved_in, regather, tokens, holds, _mlp_ops)
    d, B = b.d, b.B
    f_bytes = tokens * (width or d.ffn) * B
    out_bytes = tokens * d.hidden * B
    if b.m.activation == "gelu" and width is None:
        f1 = b.linear("fc1", x, f_bytes, saved_in, regather)
        act = b.simple("gelu", [f1], f_bytes, saves=[f1])
        return b.linear("fc2", act, out_bytes, holds=holds)
    gate = b.linear(f"{prefix}gate_proj", x, f_bytes, saved_in, regather)
    if b.a.mlp_implementation == "fused_swiglu":
        up = b.linear(f"{prefix}up_proj", x, f_bytes, saved_in, regather)
        prod = b.simple(f"{prefix}silu_mul", [gate, up], f_bytes, saves=[gate, up])
    else:
        act = b.simple(f"{prefix}silu", [gate], f_bytes, saves=[gate])
        up = b.linear(f"{prefix}up_proj", x, f_bytes, saved_in, regather)
        prod = b.simple(f"{prefix}mul", [act, up], f_bytes, saves=[act, up])
    return b.linear(f"{prefix}down_proj", prod, out_bytes, holds=holds)


def kv_cache_bytes_per_layer(d: LocalDims, v_head_dim: int | None = None) -> int:
    """K and V of one layer for the whole ring-local sequence, KV heads after the Ulysses split. MLA
    (``v_head_dim``): HF's cache holds the up-projected K at the qk head dim and V at its own, unpadded."""
    if v_head_dim is not None:
        return d.batch * d.attn_seq * d.kv_heads_attn * (d.head_dim + v_head_dim) * d.compute_bytes
    return 2 * d.batch * d.attn_seq * d.kv_heads_attn * d.head_dim * d.compute_bytes


def block_graph(model: ModelSpec, dims: LocalDims, assumptions: MemoryAssumptions, *, training: bool,
                attention_kernel: str, tiled_mlp: bool, mlp_param_grad_bytes: int = 0) -> Graph:
    """One transformer block's graph; in inference K and V are written into the preallocated KV cache.
    ``mlp_param_grad_bytes``: parameter gradients the tiled MLP accumulates across its tiles before ZeRO
    takes them (DeepSpeed bucketed reduction), held during its backward."""
    return BlockBuilder(model, dims, assumptions, training, tiled_mlp, attention_kernel,
                        mlp_param_grad_bytes).build(inference=not training)
