"""Tiled MLP: the FFN over sequence tiles, recomputed tile by tile in backward (ALST's TiledMLP).

At long context the SwiGLU intermediates dominate a block's activation memory: an eager MLP keeps
gate, silu(gate), up and their product, 4 x ffn values per token (8 x ffn bytes in bf16; ffn is about
3.5 x hidden), and even a checkpointed block re-creates all of them for the whole local sequence in
its recompute. :func:`tiled_mlp` runs the MLP on tiles of ``tile_tokens`` tokens:

- forward, under ``no_grad``: each tile's output is written into one output buffer; only the MLP
  input is saved for backward, no intermediate outlives its tile;
- backward: for each tile, the MLP is recomputed on that tile with grad enabled and differentiated
  with ``torch.autograd.grad`` against the tile's slice of the output gradient. The input gradient of
  the tile is written into its rows; the parameter gradients are summed over tiles in the parameter's
  dtype (as autograd itself accumulates, and as ALST does; an fp32 accumulator would add a transient
  twice the size of the MLP's bf16 weight gradients, which the memory model does not budget) and
  returned as the op's gradients, so autograd accumulates them exactly as for the untiled module
  (gradient hooks and FSDP2's reduce-scatter included).

Tile size (the memory model's assumption, ``MemoryAssumptions.tiled_mlp_tile_tokens``): by default
``hidden_size`` tokens, the shard count ALST uses (ceil(seq / hidden)), which makes one tile's
intermediate about the size of the block's hidden states; :func:`tile_tokens_for` is the one rule both
sides use. Tokens are the flattened batch x sequence rows, as in the memory model.

Numerics: every output row and every input-gradient row is computed from the same row of the same
inputs by the same ops, so forward and input gradients match the untiled module up to the matmul
kernel's blocking (bitwise in our bf16 CPU tests, ~1e-7 in fp32). Parameter gradients are sums over
tiles instead of one matmul over all tokens: in fp32 they differ by summation order (~1e-6
relative); in bf16 each tile's gradient is rounded once and each addition rounds again, so with n
tiles the difference is at most about n bf16 ulps of the gradient (tests check that bound).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sp_plan.cost_models.memory.assumptions import MemoryAssumptions

from .errors import RuntimeConfigError

TileFn = Callable[[torch.Tensor], torch.Tensor]

#: The memory model's tile size (``MemoryAssumptions.tiled_mlp_tile_tokens``; None: hidden_size tokens).
DEFAULT_TILE_TOKENS: int | None = MemoryAssumptions.model_fields["tiled_mlp_tile_tokens"].default


def tile_tokens_for(hidden_size: int, tokens: int, tile_tokens: int | None = None) -> int:
    """Tokens per tile: ``tile_tokens`` if given, else the memory model's default (``hidden_size``
    tokens, ALST's rule); at most ``tokens``.

    Mirrors ``sp_plan.cost_models.memory.block.BlockBuilder._tile_workspace``:
    ``min(tiled_mlp_tile_tokens or hidden, tokens)``.
    """
    if tile_tokens is None:
        tile_tokens = DEFAULT_TILE_TOKENS
    if tile_tokens is not None and tile_tokens < 1:
        raise RuntimeConfigError(f"tiled MLP tile size must be at least 1 token, got {tile_tokens}")
    return max(1, min(tile_tokens or hidden_size, tokens))


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: TileFn, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = out_rows = None
        with torch.no_grad():
            for start in range(0, rows.shape[0], tile):
                y = fn(rows[start : start + tile])
                if out is None:  # the output is a base tensor (not a view), so it may be reduced in place
                    out = torch.empty((*x.shape[:-1], y.shape[-1]), dtype=y.dtype, device=y.device)
                    out_rows = out.view(-1, y.shape[-1])
                out_rows[start : start + tile] = y
                del y
        ctx.fn, ctx.tile = fn, tile
        ctx.fn_params = params  # parameters, not activations: referenced, not saved for backward
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(rows) if ctx.needs_input_grad[2] else None
        needs = ctx.needs_input_grad[3:]
        wanted = [p for p, need in zip(ctx.fn_params, needs) if need]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        for start in range(0, rows.shape[0], ctx.tile):
            with torch.enable_grad():
                xt = rows[start : start + ctx.tile].detach().requires_grad_(grad_x is not None)
                yt = ctx.fn(xt)
                inputs = ([xt] if grad_x is not None else []) + wanted
                grads = list(torch.autograd.grad(yt, inputs, grad_rows[start : start + ctx.tile], allow_unused=True))
            del yt
            if grad_x is not None:
                grad_x[start : start + ctx.tile] = grads.pop(0)
            for i, g in enumerate(grads):  # summed in the parameter's dtype, as autograd accumulates
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
            del grads
        totals = iter(sums)
        param_grads = [next(totals) if need else None for need in needs]
        return (None, None, grad_x.view(x.shape) if grad_x is not None else None, *param_grads)


def tiled_mlp(fn: TileFn, x: torch.Tensor, params: Sequence[torch.Tensor], tile_tokens: int) -> torch.Tensor:
    """``fn(x)`` computed over tiles of ``tile_tokens`` rows of ``x`` (all dims but the last flattened).

    ``fn`` must be row-wise (each output row depends only on the same input row) and use only
    ``params`` as its trainable tensors; their gradients are returned through this op.
    """
    if tile_tokens < 1:
        raise RuntimeConfigError(f"tiled MLP tile size must be at least 1 token, got {tile_tokens}")
    return _TiledMLP.apply(fn, tile_tokens, x, *params)


def tiled_gated_mlp(x: torch.Tensor, gate_proj: torch.nn.Module, up_proj: torch.nn.Module, down_proj: torch.nn.Module,
                    act: TileFn, tile_tokens: int) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` over tiles. A row-parallel ``down_proj`` (one with ``partial`` /
    ``partial_parameters`` / ``finish``, :class:`sp_plan.runtime.tp.RowParallelLinear`) computes its partial sums
    per tile and reduces once, after all tiles. Shared by the runtime's Llama MLP and HF's."""
    partial = getattr(down_proj, "partial", down_proj)
    down_params = getattr(down_proj, "partial_parameters", down_proj.parameters)()
    params = [*gate_proj.parameters(), *up_proj.parameters(), *down_params]
    y = tiled_mlp(lambda t: partial(act(gate_proj(t)) * up_proj(t)), x, params, tile_tokens)
    finish = getattr(down_proj, "finish", None)
    return finish(y) if finish is not None else y


def apply_tiled_mlp(model: torch.nn.Module, tile_tokens: int | None = None) -> int:
    """Run every block's MLP of ``model`` (a :class:`sp_plan.runtime.models.LlamaModel`) tiled; returns the count.

    ``tile_tokens`` None uses the memory model's rule (:func:`tile_tokens_for`). Order relative to
    tensor parallelism, FSDP2 and checkpointing does not matter (it only sets attributes the MLP
    reads at forward time).
    """
    if tile_tokens is not None and tile_tokens < 1:
        raise RuntimeConfigError(f"tiled MLP tile size must be at least 1 token, got {tile_tokens}")
    layers = getattr(model, "layers", None)
    if layers is None:
        raise RuntimeConfigError(f"{type(model).__name__} has no 'layers': pass a runtime LlamaModel")
    for layer in layers:
        layer.mlp.tiled = True
        layer.mlp.tile_tokens = tile_tokens
    return len(layers)
