"""Tensor parallelism on HF models, read from one table per ``model_type`` (picotron's habit).

An entry of :data:`TP_PLANS` says, for one HF architecture, which decoder-layer submodule holds each
projection and how it splits (:class:`sp_plan.runtime.tp.Projection`: column / row, along the q heads,
the kv heads or the FFN), which submodules open a TP region, which norms are replicated, and where the
final norm, the embedding and the lm_head live. :func:`apply_hf_tensor_parallel` applies an entry with
the runtime's own sharding (:mod:`sp_plan.runtime.tp`); HF's code is not changed: forward pre-hooks open
each TP region (all-gather along the sequence before the attention and the MLP, and before the
lm_head), the row-parallel projections close it. Attention reshapes with ``-1`` heads, so it runs on the
local heads. A new architecture whose layers look like these is one more table entry.

The state-dict rules of :meth:`sp_plan.runtime.tp.TensorParallel.local_slice` (checkpoints, full state
dicts) are keyed by the projection names the runtime's Llama uses (``q_proj`` ... ``down_proj``,
``embed_tokens``, ``lm_head``); an entry with other names needs rules there too.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.hf.model import SUPPORTED_MODEL_TYPES, hf_decoder_layers, hf_model_spec
from sp_plan.runtime.tp import (
    Projection,
    TensorParallel,
    llama_projections,
    shard_projections,
    shard_vocabulary,
    tensor_parallel_state,
)


@dataclass(frozen=True)
class HFTensorParallelPlan:
    """How tensor parallelism cuts one HF architecture (paths are attribute paths, dotted from the
    decoder layer for the block entries and from the causal LM for the others)."""

    #: Every projection of a decoder layer that is split.
    projections: tuple[Projection, ...]
    #: Decoder-layer submodules whose input opens a TP region (their first argument or ``hidden_states``).
    regions: tuple[str, ...]
    #: The decoder layer's pre-norms (replicated, partial-sum gradients, under sequence parallelism).
    block_norms: tuple[str, ...]
    #: ``(submodule, name)`` of norms inside the block that every TP rank holds whole (q/k norms).
    head_norms: tuple[tuple[str, str], ...] = ()
    final_norm: str = "model.norm"
    embedding: str = "model.embed_tokens"
    lm_head: str = "lm_head"


#: Llama and the families that copy its layer (Mistral, Qwen2, Qwen3 with its q/k norms).
LLAMA_LAYOUT = HFTensorParallelPlan(
    projections=llama_projections("self_attn", "mlp"),
    regions=("self_attn", "mlp"),
    block_norms=("input_layernorm", "post_attention_layernorm"),
    head_norms=(("self_attn", "q_norm"), ("self_attn", "k_norm")),
)

#: The table: HF ``model_type`` -> how TP cuts it.
TP_PLANS: dict[str, HFTensorParallelPlan] = {model_type: LLAMA_LAYOUT for model_type in SUPPORTED_MODEL_TYPES}


def tp_plan_for(model: nn.Module) -> HFTensorParallelPlan:
    """The table entry of ``model``'s ``config.model_type``."""
    model_type = str(getattr(model.config, "model_type", "")).lower()
    try:
        return TP_PLANS[model_type]
    except KeyError:
        raise RuntimeConfigError(
            f"HF model_type {model_type!r} has no tensor-parallel plan: add one to "
            f"sp_plan.runtime.models.hf.tp_plan.TP_PLANS (known: {', '.join(TP_PLANS)})"
        ) from None


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, module)


def apply_hf_tensor_parallel(model: nn.Module, mesh_or_group, *, sequence_parallel: bool = True) -> TensorParallel:
    """Megatron tensor parallelism (with sequence parallelism) on an HF causal LM, in place, as its
    ``model_type``'s :data:`TP_PLANS` entry says. Call before FSDP2, like
    :func:`sp_plan.runtime.tp.apply_tensor_parallel`; returns the state, also ``model.tensor_parallel``."""
    plan = tp_plan_for(model)
    spec = hf_model_spec(model)
    tp, split = tensor_parallel_state(spec, mesh_or_group, sequence_parallel)
    if tp.size == 1:
        return tp
    object.__setattr__(model, "tensor_parallel", tp)  # state, not a submodule
    for layer in hf_decoder_layers(model):
        shard_projections(tp, split, spec, layer, plan.projections, plan.head_norms,
                          [_get(layer, name) for name in plan.block_norms])
        for region in plan.regions:
            _get(layer, region).register_forward_pre_hook(_enter_region(tp), with_kwargs=True)
    if tp.sequence_parallel:
        final_norm = _get(model, plan.final_norm)
        tp.replicated += [(final_norm, name) for name, _ in final_norm.named_parameters()]
    head = None if spec.tied_embeddings else _get(model, plan.lm_head).weight
    embedding, lm_head = shard_vocabulary(tp, _get(model, plan.embedding).weight, head)
    _set(model, plan.embedding, embedding)
    _set(model, plan.lm_head, lm_head)
    lm_head.register_forward_pre_hook(_enter_region(tp), with_kwargs=True)
    return tp


def _enter_region(tp: TensorParallel):
    """A forward pre-hook opening a TP region on the module's input: its first positional argument, or
    the ``hidden_states`` keyword (HF calls attention modules with keywords)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (tp.enter(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": tp.enter(kwargs["hidden_states"])}

    return hook
