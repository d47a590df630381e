"""Tensor parallelism (Megatron-LM style, with sequence parallelism) for the runtime Llama model.

:func:`apply_tensor_parallel` turns a (full, or meta) :class:`sp_plan.runtime.models.LlamaModel` into this TP
rank's shard, in place:

- attention: column-parallel Q/K/V (each rank keeps heads ``[r H/tp, (r+1) H/tp)`` and their KV heads),
  row-parallel output projection; the attention function sees ``heads / tp`` local heads, so
  Ulysses/Ring/USP compose on top (Ulysses splits the local heads further: heads split by tp x
  ulysses, DESIGN.md). When tp exceeds the KV heads, each rank keeps the one KV head its query heads
  use (replicated K/V weights, ``ModelSpec.kv_replication``);
- MLP: column-parallel gate/up, row-parallel down (the FFN may split unevenly);
- vocab-parallel embedding and lm_head (``vocab / tp`` rows each, tied or not) and a vocab-parallel
  cross-entropy (:func:`vocab_parallel_cross_entropy`; the tiled loss has the same option);
- with ``sequence_parallel`` (``TrainSpec.tp_sequence_parallel``, the default) norms, residuals and
  dropout run on ``seq / tp`` tokens: each TP region opens with an all-gather along the sequence and
  closes with a reduce-scatter (backward: reduce-scatter and all-gather); without it, regions open
  with an identity whose backward all-reduces and close with an all-reduce.

Why explicit autograd collectives rather than DTensor's ``parallelize_module``: DTensor does run on
CPU/gloo (a ColwiseParallel/RowwiseParallel/SequenceParallel plan on our block matched the
unparallelised block to 2e-7), but (1) column/row styles cannot express the KV-head replication that
plans with tp > KV heads need; (2) its collectives are functional collectives inside DTensor's
dispatch, invisible to the runtime's :class:`~sp_plan.runtime.comm_counter.CommCounter`, so TP bytes could not
be checked against the comm model the way Ulysses and Ring are; (3) gradients of replicated
parameters (norms under sequence parallelism) come out as ``Partial`` DTensors and are reduced
implicitly per parameter and micro-batch, where Megatron (and the comm model) all-reduce them once per
step; (4) the vocab-parallel tiled loss needs explicit code anyway. The price: parameters are plain
local shards, not DTensors (so checkpoints saved with ``torch.distributed.checkpoint`` are per TP
rank; FSDP2 on top works unchanged, it shards each rank's local shard over the FSDP dims).

Collectives are autograd functions that report their bytes to :mod:`sp_plan.runtime.comm_counter`.
Replicated parameters whose gradients are partial sums across TP ranks (norms and row-parallel
biases under sequence parallelism; q/k-norm weights; replicated K/V weights) are all-reduced by
:meth:`TensorParallel.sync_replicated_grads`, once per optimizer step, after the last backward and
before gradient clipping (:meth:`TensorParallel.attach` registers it as an optimizer pre-step hook).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import comm_counter
from .errors import RuntimeConfigError
from .loss import loss_dtype

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
SEQ_DIM = 1  # hidden states are (batch, seq, hidden)


# ----- collectives along the sequence dimension ---------------------------------------------------------


def _batch_one(x: torch.Tensor) -> bool:
    """All dims before the sequence are 1 (the usual long-context micro-batch) and x is contiguous:
    the sequence dim is then dim 0 of a free view, and collectives need no copies."""
    return all(size == 1 for size in x.shape[:SEQ_DIM]) and x.is_contiguous()


def _seq_major(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor whose dim 0 is the sequence: a view when the batch is 1, else a transposed copy."""
    if _batch_one(x):
        return x.view(x.shape[SEQ_DIM:])
    return x.movedim(SEQ_DIM, 0).contiguous()


def _collective_into(x: torch.Tensor, seq_out: int, run) -> torch.Tensor:
    """Allocate the (batch, seq_out, ...) result, let ``run(send, recv)`` fill it through seq-major views, and
    return a base (not a view) tensor, so callers and FSDP2 hooks may treat it as a fresh activation."""
    shape = list(x.shape)
    shape[SEQ_DIM] = seq_out
    send = _seq_major(x)
    if _batch_one(x):
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        run(send, out.view(out.shape[SEQ_DIM:]))
        return out
    recv = torch.empty((seq_out, *send.shape[1:]), dtype=x.dtype, device=x.device)
    run(send, recv)
    return recv.movedim(0, SEQ_DIM).contiguous()


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup, phase: str = "forward") -> torch.Tensor:
    """Concatenate the ranks' equal shards along the sequence dim (an all-gather)."""
    world = dist.get_world_size(group)

    def run(send, recv):
        comm_counter.record_all_gather(send, world, phase, "tp")  # type: ignore[arg-type]
        _all_gather(recv, send, group=group)

    return _collective_into(x, x.shape[SEQ_DIM] * world, run)


def scatter_seq(x: torch.Tensor, group: dist.ProcessGroup, phase: str = "forward") -> torch.Tensor:
    """Sum over ranks and keep this rank's sequence shard (a reduce-scatter)."""
    world = dist.get_world_size(group)
    seq = x.shape[SEQ_DIM]
    if seq % world:
        raise RuntimeConfigError(
            f"tensor-parallel sequence parallelism splits the sequence over tp={world}, but this rank's "
            f"sequence has {seq} tokens; pad it to a multiple of {world} (Layout.seq_multiple)"
        )

    def run(send, recv):
        comm_counter.record_reduce_scatter(send, world, phase, "tp")  # type: ignore[arg-type]
        _reduce_scatter(recv, send, group=group)

    return _collective_into(x, seq // world, run)


def all_reduce_(x: torch.Tensor, group: dist.ProcessGroup, phase: str = "forward") -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (ring all-reduce bytes)."""
    comm_counter.record_all_reduce(x, dist.get_world_size(group), phase, "tp")  # type: ignore[arg-type]
    dist.all_reduce(x, group=group)
    return x


class _GatherSeq(torch.autograd.Function):
    """Open a sequence-parallel TP region: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return scatter_seq(grad, ctx.group, "backward"), None


class _ScatterSeq(torch.autograd.Function):
    """Close a sequence-parallel TP region: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad.contiguous(), ctx.group, "backward"), None


class _CopyToRegion(torch.autograd.Function):
    """Open a TP region without sequence parallelism: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # The engine's gradient buffer may be shared: reduce a copy, never the incoming tensor.
        return all_reduce_(grad.contiguous().clone(), ctx.group, "backward"), None


class _ReduceFromRegion(torch.autograd.Function):
    """Close a TP region without sequence parallelism: all-reduce forward (in place, as Megatron does:
    the row-parallel output is a fresh tensor no backward needs), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return all_reduce_(x.contiguous(), group)
        ctx.mark_dirty(x)
        return all_reduce_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ----- the TP state of a model --------------------------------------------------------------------------


@dataclass(eq=False)
class TensorParallel:
    """One model's tensor-parallel setup: group, sequence parallelism, vocabulary range, replicated params."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    sequence_parallel: bool
    vocab_start: int = 0
    vocab_end: int = 0
    #: Parameters every TP rank holds in full whose gradients are partial sums across TP ranks, as
    #: (module, parameter name): looked up at sync time, since FSDP2 replaces the parameter objects.
    replicated: list[tuple[nn.Module, str]] = field(default_factory=list)
    #: K/V weights replicated per KV head (tp > KV heads): (module, name, this rank's KV head, KV heads).
    head_replicated: list[tuple[nn.Module, str, int, int]] = field(default_factory=list)
    #: This rank's [start, stop) along the split dim of each kind of sharded tensor (set by apply).
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: ``(module name, tensor name) -> (dim, bounds key)`` of every sharded tensor kind: built from the
    #: model's projection table (:func:`slice_rules`); the runtime Llama's names unless told otherwise.
    rules: dict[tuple[str, str], tuple[int, str]] = field(default_factory=lambda: dict(LLAMA_SLICE_RULES))

    def local_slice(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` this rank keeps of the full model's tensor ``name`` (None: all of it).

        The one sharding rule, used to shard a model in place and to shard a full state dict (e.g. a
        Hugging Face checkpoint) for this rank with :meth:`shard_state_dict`.
        """
        if self.size == 1:
            return None
        rule = self.rules.get(_module_and_tensor(name))
        if rule is None:
            return None
        dim, key = rule
        return (dim, *self.bounds[key])

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of a full (unparallelised) state dict, with the same keys."""
        out = {}
        for name, tensor in full.items():
            cut = self.local_slice(name)
            out[name] = tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1])
        return out

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The unparallelised model's tensor ``name`` from every TP rank's ``local`` shard (collective
        over the TP group; the inverse of :meth:`shard_state_dict`). For exporting checkpoints and
        checking against an unparallelised model: it gathers through host memory."""
        cut = self.local_slice(name)
        if cut is None:
            return local
        dim = cut[0]
        pieces: list = [None] * self.size
        dist.all_gather_object(pieces, (cut[1], cut[2], local.detach().cpu()), group=self.group)
        shape = list(local.shape)
        shape[dim] = max(stop for _, stop, _ in pieces)
        full = torch.empty(shape, dtype=local.dtype)
        for start, stop, piece in pieces:  # K/V replicas (tp > KV heads) write the same rows
            full.narrow(dim, start, stop - start).copy_(piece)
        return full.to(local.device)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, valid_tokens)`` of this rank's vocabulary slice of the logits
        (:func:`vocab_parallel_cross_entropy` over this TP group)."""
        return vocab_parallel_cross_entropy(logits, labels, self.group, self.vocab_start)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Open a TP region (column-parallel consumers follow)."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return _GatherSeq.apply(x, self.group)
        return _CopyToRegion.apply(x, self.group)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """Close a TP region (the partial sums of a row-parallel producer)."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return _ScatterSeq.apply(x, self.group)
        return _ReduceFromRegion.apply(x, self.group)

    def sync_replicated_grads(self) -> int:
        """All-reduce the gradients of replicated parameters over TP; returns the bytes this rank sent.

        Call once per optimizer step, after the last micro-batch's backward and before clipping. Works on
        plain gradients and on FSDP2's sharded DTensor gradients (their local shards).
        """
        if self.size == 1:
            return 0
        sent = 0
        full = [g for g in (_local_grad(getattr(m, name)) for m, name in self.replicated) if g is not None]
        if full:  # one coalesced all-reduce, in the gradients' dtype (fp32 under FSDP2's reduce dtype)
            flat = torch.cat([g.reshape(-1) for g in full])
            sent += _ring_bytes(flat, self.size)
            all_reduce_(flat, self.group, "backward")
            offset = 0
            for g in full:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for module, name, head, heads in self.head_replicated:
            g = _local_grad(getattr(module, name))
            if g is None:
                continue
            slots = torch.zeros((heads, *g.shape), dtype=g.dtype, device=g.device)
            slots[head] = g
            sent += _ring_bytes(slots, self.size)
            all_reduce_(slots, self.group, "backward")  # each KV head's slot: the sum over its replicas
            g.copy_(slots[head])
        return sent

    def attach(self, optimizer: torch.optim.Optimizer):
        """Run :meth:`sync_replicated_grads` before every ``optimizer.step()`` (returns the hook handle).

        If you clip gradients, call :meth:`sync_replicated_grads` yourself before clipping instead.
        """
        return optimizer.register_step_pre_hook(lambda *_: self.sync_replicated_grads())


    def norm_weight(self, name: str) -> float:
        """How much of parameter ``name``'s squared gradient norm this TP rank contributes to the model's:
        1 for a sharded tensor (each element on one rank), ``1 / tp`` for one every rank holds in full
        (identical gradients after :meth:`sync_replicated_grads`), ``1 / replicas`` for K/V weights
        replicated per KV head."""
        cut = self.local_slice(name)
        if cut is None:
            return 1.0 / self.size
        if self.head_replicated and self.rules.get(_module_and_tensor(name), (0, ""))[1] == "kv":
            return 1.0 / (self.size // self.head_replicated[0][3])
        return 1.0

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip ``model``'s gradients to a global 2-norm of ``max_norm``; returns the norm before clipping
        (:meth:`grad_norm`). Call after :meth:`sync_replicated_grads`."""
        return clip_parts_grad_norm_([(self, model)], max_norm)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The unparallelised model's gradient 2-norm, the same on every rank.

        ``torch.nn.utils.get_total_norm`` would see only this rank's TP shards (FSDP2's DTensor gradients
        are reduced over the FSDP dims, but TP shards are plain local tensors), so TP ranks would clip by
        different norms and drift apart. Here each parameter's squared norm is weighted by
        :meth:`norm_weight` and summed over the TP group. Call after :meth:`sync_replicated_grads`.
        """
        return parts_grad_norm([(self, model)])

    def weighted_squared_grad_norm(self, model: nn.Module) -> torch.Tensor | None:
        """This TP rank's share of ``model``'s squared gradient norm (each parameter weighted by
        :meth:`norm_weight`, FSDP shards reduced, not yet summed over TP); None without gradients."""
        by_weight: dict[float, list[torch.Tensor]] = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                by_weight.setdefault(self.norm_weight(name), []).append(p.grad)
        squared = None
        for weight, grads in by_weight.items():
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            if hasattr(norm, "full_tensor"):  # FSDP2: a partial norm over the FSDP dims
                norm = norm.full_tensor()
            term = norm.square() * weight
            squared = term if squared is None else squared + term
        return squared


def parts_grad_norm(parts: Sequence[tuple[TensorParallel, nn.Module]]) -> torch.Tensor:
    """The unparallelised model's gradient 2-norm over model parts, each ``(its TP state, the part)``, the
    same on every rank (one scalar all-reduce over TP for all parts; see :meth:`TensorParallel.grad_norm`)."""
    terms = [t for t in (tp.weighted_squared_grad_norm(part) for tp, part in parts) if t is not None]
    if not terms:
        return torch.zeros(())
    squared = terms[0]
    for term in terms[1:]:
        squared = squared + term
    tp = parts[0][0]
    if tp.size > 1:
        if dist.get_backend(tp.group) == "nccl":
            squared = squared.to(torch.device("cuda", torch.cuda.current_device()))
        # One scalar, not model traffic: not priced by the comm model, so not counted (like the
        # step's token count).
        dist.all_reduce(squared, group=tp.group)
    return squared.sqrt()


def clip_parts_grad_norm_(parts: Sequence[tuple[TensorParallel, nn.Module]], max_norm: float) -> torch.Tensor:
    """Clip the gradients of every model part to one global 2-norm of ``max_norm`` (:func:`parts_grad_norm`);
    returns the norm before clipping. Call after each part's :meth:`TensorParallel.sync_replicated_grads`."""
    params = [p for _, part in parts for p in part.parameters() if p.grad is not None]
    total = parts_grad_norm(parts)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _module_and_tensor(name: str) -> tuple[str, str]:
    """``("q_proj", "weight")`` of ``"layers.0.attn.q_proj.weight"``: the key of a slicing rule."""
    parts = name.split(".")
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])


def _local_grad(p: nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    return g.to_local() if hasattr(g, "to_local") else g


def _ring_bytes(t: torch.Tensor, world: int) -> int:
    return 2 * t.numel() * t.element_size() * (world - 1) // world


# ----- sharded modules ------------------------------------------------------------------------------


class RowParallelLinear(nn.Module):
    """``y = reduce(x W_r^T) + b``: this rank's input columns of W; the bias is replicated and added after
    the reduction (all-reduce, or reduce-scatter along the sequence with sequence parallelism)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.tp = tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (what a tiled MLP computes per tile)."""
        return F.linear(x, self.weight)

    def partial_parameters(self) -> list[nn.Parameter]:
        return [self.weight]

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        y = self.tp.exit(y)
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(x))

    def extra_repr(self) -> str:
        return f"in_features(local)={self.weight.shape[1]}, out_features={self.weight.shape[0]}, tp={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[vocab_start, vocab_end)``; other tokens give zeros, summed over TP ranks on exit
    (reduce-scatter along the sequence with sequence parallelism, else all-reduce)."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.tp.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)  # rows of other ranks' tokens contribute nothing
        return self.tp.exit(out)


def _split_bounds(total: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.tensor_split`` bounds: the first ``total % parts`` parts get one extra row."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _new_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight)
    if bias is not None:
        linear.bias = nn.Parameter(bias)
    return linear


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """Column-parallel shard: output rows [start, stop)."""
    with torch.no_grad():
        weight = linear.weight[start:stop].clone()
        bias = linear.bias[start:stop].clone() if linear.bias is not None else None
    return _new_linear(weight, bias)


def _row_parallel(linear: nn.Linear, start: int, stop: int, tp: TensorParallel) -> RowParallelLinear:
    """Row-parallel shard: input columns [start, stop); the bias stays whole (added after the reduction)."""
    with torch.no_grad():
        weight = linear.weight[:, start:stop].clone()
        bias = linear.bias.detach().clone() if linear.bias is not None else None
    return RowParallelLinear(weight, bias, tp)


def _check_tp(spec, tp: int) -> int:
    """KV replication factor within TP; raises when TP cannot split this model's heads."""
    heads, kv = spec.num_heads, spec.num_kv_heads
    if heads % tp:
        raise RuntimeConfigError(
            f"tp={tp} does not divide {heads} query heads: tensor parallelism splits whole heads; use a tp that "
            f"divides {heads}"
        )
    if kv % tp == 0:
        return 1
    if tp % kv == 0:
        return tp // kv
    raise RuntimeConfigError(
        f"tp={tp} neither divides nor is a multiple of {kv} KV heads, so KV heads can be neither split nor "
        "replicated evenly across TP ranks; use a tp that divides or is a multiple of the KV heads"
    )


def _tp_group(mesh_or_group) -> dist.ProcessGroup | None:
    if mesh_or_group is None or isinstance(mesh_or_group, dist.ProcessGroup):
        return mesh_or_group
    if hasattr(mesh_or_group, "group"):  # sp_plan.runtime.mesh.RuntimeMesh
        return mesh_or_group.group("tp")
    raise RuntimeConfigError(
        f"apply_tensor_parallel needs a sp_plan.runtime.mesh.RuntimeMesh or a ProcessGroup, got {type(mesh_or_group).__name__}"
    )


@dataclass
class _Split:
    """How this TP rank splits a model's heads: the KV replication factor and this rank's first KV head."""

    kv_rep: int
    kv_first: int


def tensor_parallel_state(spec, mesh_or_group, sequence_parallel: bool) -> tuple[TensorParallel, _Split]:
    """This rank's :class:`TensorParallel` for a model of ``spec`` (bounds of every sharded tensor kind)
    and its head split; refuses what TP cannot split (heads, dropout) with the reason."""
    group = _tp_group(mesh_or_group)
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    kv_rep = _check_tp(spec, size)
    if size > 1 and (spec.hidden_dropout > 0 or spec.attention_dropout > 0):
        raise RuntimeConfigError(
            f"{spec.name} uses dropout, which under tensor parallelism needs per-region RNG streams (Megatron's "
            "RNG tracker: identical masks on replicated activations, different ones on sharded activations); the "
            "runtime does not implement them: set hidden_dropout and attention_dropout to 0 or use tp=1"
        )
    v_start, v_end = _split_bounds(spec.vocab_size, size, rank)
    tp = TensorParallel(group, size, rank, sequence_parallel and size > 1, v_start, v_end)
    hd = spec.head_dim
    q_local = spec.num_heads // size
    kv_local = spec.num_kv_heads // size if kv_rep == 1 else 1
    kv_first = rank * kv_local if kv_rep == 1 else rank // kv_rep
    tp.bounds = {
        "q": (rank * q_local * hd, (rank + 1) * q_local * hd),
        "kv": (kv_first * hd, (kv_first + kv_local) * hd),
        "ffn": _split_bounds(spec.ffn_hidden_size, size, rank),
        "vocab": (v_start, v_end),
    }
    return tp, _Split(kv_rep, kv_first)


@dataclass(frozen=True)
class Projection:
    """One linear layer of a block that tensor parallelism splits (picotron's ``(submodule, proj, style)``).

    ``submodule``: the block's child holding it (``attn``, ``self_attn``, ``mlp``); ``name``: the
    ``nn.Linear`` attribute there; ``style``: ``column`` (output rows split, bias split with them) or
    ``row`` (input columns split, output summed over TP); ``split``: the :attr:`TensorParallel.bounds` key
    it is cut along (``q`` heads, ``kv`` heads, ``ffn`` features).
    """

    submodule: str
    name: str
    style: Literal["column", "row"]
    split: Literal["q", "kv", "ffn"]


def llama_projections(attention: str, mlp: str) -> tuple[Projection, ...]:
    """Megatron's split of a Llama-style block whose attention and MLP children are called
    ``attention`` and ``mlp``: column-parallel q/k/v_proj and gate/up_proj, row-parallel o_proj and
    down_proj (the projection names the runtime's Llama and the HF Llama-family models share)."""
    return (
        Projection(attention, "q_proj", "column", "q"),
        Projection(attention, "k_proj", "column", "kv"),
        Projection(attention, "v_proj", "column", "kv"),
        Projection(attention, "o_proj", "row", "q"),
        Projection(mlp, "gate_proj", "column", "ffn"),
        Projection(mlp, "up_proj", "column", "ffn"),
        Projection(mlp, "down_proj", "row", "ffn"),
    )


def slice_rules(projections: Sequence[Projection], vocabulary: Sequence[str]) -> dict[tuple[str, str], tuple[int, str]]:
    """The state-dict slicing rules of a model cut by ``projections``, whose vocab-parallel modules
    (embedding, lm_head) are named ``vocabulary``: column projections split weight and bias along dim 0,
    row projections their weight along dim 1 (the bias stays whole), vocabulary weights along dim 0."""
    rules: dict[tuple[str, str], tuple[int, str]] = {}
    for p in projections:
        if p.style == "column":
            rules[(p.name, "weight")] = rules[(p.name, "bias")] = (0, p.split)
        else:
            rules[(p.name, "weight")] = (1, p.split)
    for module in vocabulary:
        rules[(module, "weight")] = (0, "vocab")
    return rules


#: The runtime Llama's blocks (``LlamaBlock.attn`` / ``LlamaBlock.mlp``).
LLAMA_PROJECTIONS = llama_projections("attn", "mlp")
#: The runtime Llama's slicing rules (its projections, ``embed_tokens`` and ``lm_head``).
LLAMA_SLICE_RULES = slice_rules(LLAMA_PROJECTIONS, ("embed_tokens", "lm_head"))
#: q/k norms of the runtime Llama's attention (replicated on every TP rank when the model has them).
LLAMA_HEAD_NORMS: tuple[tuple[str, str], ...] = (("attn", "q_norm"), ("attn", "k_norm"))


def shard_projections(tp: TensorParallel, split: _Split, spec, block: nn.Module,
                      projections: Sequence[Projection], head_norms: Sequence[tuple[str, str]] = (),
                      norms: Sequence[nn.Module] = ()) -> None:
    """Shard one block in place by its projection table: each ``column`` projection keeps this rank's
    output rows, each ``row`` projection becomes a :class:`RowParallelLinear`; then record the
    replicated parameters whose gradients are partial sums: K/V weights replicated per KV head (tp > KV
    heads), the ``head_norms`` (``(submodule, name)``, absent ones skipped) always, and under sequence
    parallelism the block's pre-``norms`` and the row projections' biases."""
    rows = []
    for p in projections:
        parent = getattr(block, p.submodule)
        linear = getattr(parent, p.name)
        bounds = tp.bounds[p.split]
        sharded = _rows(linear, *bounds) if p.style == "column" else _row_parallel(linear, *bounds, tp)
        setattr(parent, p.name, sharded)
        if p.style == "row":
            rows.append(sharded)
    if split.kv_rep > 1:
        for p in projections:
            if p.split == "kv" and p.style == "column":
                proj = getattr(getattr(block, p.submodule), p.name)
                tp.head_replicated += [(proj, name, split.kv_first, spec.num_kv_heads)
                                       for name, _ in proj.named_parameters()]
    replicated = [getattr(getattr(block, sub), name, None) for sub, name in head_norms]
    if tp.sequence_parallel:
        replicated += list(norms)
        tp.replicated += [(m, "bias") for m in rows if m.bias is not None]
    tp.replicated += [(m, name) for m in replicated if m is not None for name, _ in m.named_parameters()]


def shard_block(tp: TensorParallel, split: _Split, spec, block: nn.Module) -> None:
    """Shard one :class:`sp_plan.runtime.models.llama.model.LlamaBlock` in place
    (:data:`LLAMA_PROJECTIONS`; its two pre-norms replicated under sequence parallelism)."""
    shard_projections(tp, split, spec, block, LLAMA_PROJECTIONS, LLAMA_HEAD_NORMS,
                      [block.input_norm, block.post_attention_norm])


def shard_vocabulary(tp: TensorParallel, embedding: torch.Tensor, head: torch.Tensor | None
                     ) -> tuple[VocabParallelEmbedding, nn.Linear]:
    """The vocab-parallel embedding and lm_head (rows ``[vocab_start, vocab_end)``); ``head`` None: tied."""
    with torch.no_grad():
        rows = embedding[tp.vocab_start:tp.vocab_end].clone()
        head_rows = None if head is None else head[tp.vocab_start:tp.vocab_end].clone()
    embed = VocabParallelEmbedding(rows, tp)
    lm_head = _new_linear(rows if head_rows is None else head_rows, None)
    if head is None:
        lm_head.weight = embed.weight
    return embed, lm_head


def shard_vocabulary_modules(tp: TensorParallel, embedding: nn.Module, lm_head: nn.Module, tied: bool
                             ) -> tuple[nn.Module, nn.Module]:
    """:func:`shard_vocabulary` on a model or a model part: the embedding and lm_head it holds become
    vocab-parallel; those a part does not hold (``nn.Identity``, :mod:`sp_plan.runtime.model_parts`) stay."""
    has_embedding, has_head = (not isinstance(m, nn.Identity) for m in (embedding, lm_head))
    if has_embedding and has_head:
        return shard_vocabulary(tp, embedding.weight, None if tied else lm_head.weight)
    with torch.no_grad():
        if has_embedding:
            return VocabParallelEmbedding(embedding.weight[tp.vocab_start:tp.vocab_end].clone(), tp), lm_head
        if has_head:
            return embedding, _new_linear(lm_head.weight[tp.vocab_start:tp.vocab_end].clone(), None)
    return embedding, lm_head


def apply_tensor_parallel(model: nn.Module, mesh_or_group, *, sequence_parallel: bool = True) -> TensorParallel:
    """Shard ``model`` (a :class:`sp_plan.runtime.models.LlamaModel`) for this rank of the ``tp`` group, in place.

    Call on the full model (every rank holding the same weights, e.g. after a seeded init, or on the meta
    device before initialising), before FSDP2's ``fully_shard`` and before building the optimizer.
    Returns the :class:`TensorParallel` state, also stored as ``model.tensor_parallel``.
    (HF transformers models: :func:`sp_plan.runtime.models.hf.tp_plan.apply_hf_tensor_parallel`.)
    """
    spec = model.spec
    tp, split = tensor_parallel_state(spec, mesh_or_group, sequence_parallel)
    model.tensor_parallel = tp
    if tp.size == 1:
        return tp
    for layer in model.layers:
        shard_block(tp, split, spec, layer)
        layer.attn.num_heads = spec.num_heads // tp.size
        layer.attn.num_kv_heads = (tp.bounds["kv"][1] - tp.bounds["kv"][0]) // spec.head_dim
        layer.attn.tp_enter = tp.enter
        layer.mlp.tp_enter = tp.enter
    if tp.sequence_parallel:
        tp.replicated += [(model.norm, name) for name, _ in model.norm.named_parameters()]
    model.embed_tokens, model.lm_head = shard_vocabulary_modules(tp, model.embed_tokens, model.lm_head,
                                                                 spec.tied_embeddings)
    if not isinstance(model.lm_head, nn.Identity):  # a model part before the last keeps its hidden states
        model.head_tp_enter = tp.enter
    return tp


# ----- vocab-parallel cross-entropy ----------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy on this rank's logits ``(..., V_local)`` (fp32 math)."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, ignore_index):
        lf = logits.to(loss_dtype(logits.dtype)).reshape(-1, logits.shape[-1])
        if lf.data_ptr() == logits.data_ptr():
            lf = lf.clone()  # fp32 logits: work on our own copy (it becomes the saved softmax)
        y = labels.reshape(-1)
        local = y - vocab_start
        mine = (local >= 0) & (local < lf.shape[-1])
        target = lf.gather(-1, local.clamp(0, lf.shape[-1] - 1)[:, None]).squeeze(-1)
        target = torch.where(mine, target, torch.zeros((), device=lf.device))
        world = dist.get_world_size(group)
        comm_counter.record_all_reduce(target, world, "forward", "tp")
        dist.all_reduce(target, group=group)
        peak = lf.amax(dim=-1)
        comm_counter.record_all_reduce(peak, world, "forward", "tp")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        probs = lf.sub_(peak[:, None]).exp_()
        sumexp = probs.sum(-1)
        comm_counter.record_all_reduce(sumexp, world, "forward", "tp")
        dist.all_reduce(sumexp, group=group)
        probs.div_(sumexp[:, None])
        valid = y != ignore_index
        loss = torch.where(valid, sumexp.log() + peak - target, torch.zeros((), device=lf.device)).sum()
        count = valid.sum()
        ctx.save_for_backward(probs, y)
        ctx.vocab_start, ctx.ignore_index, ctx.shape, ctx.dtype = vocab_start, ignore_index, logits.shape, logits.dtype
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        probs, y = ctx.saved_tensors
        grad = probs.clone()
        local = y - ctx.vocab_start
        valid = y != ctx.ignore_index
        rows = torch.nonzero((local >= 0) & (local < grad.shape[-1]) & valid).squeeze(-1)
        grad[rows, local[rows]] -= 1.0
        grad.mul_(torch.where(valid, grad_loss.to(grad.dtype), torch.zeros((), device=grad.device))[:, None])
        return grad.to(ctx.dtype).view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup, vocab_start: int, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, valid_tokens)`` of cross-entropy over vocab-sharded logits (this rank: columns from
    ``vocab_start``). Three fp32 all-reduces of one value per token (target logit, max, sum of exponentials);
    backward needs none. Every TP rank returns the same loss."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, ignore_index)
