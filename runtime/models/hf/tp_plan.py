"""Tensor parallelism on HF models, read from the family's table entry (picotron's habit).

The ``model_type``'s :class:`~sp_plan.runtime.models.hf.architectures.HFArchitecture` says which
decoder-layer child holds each projection and how it splits (column / row, along the q heads, the kv
heads or the FFN), which norms are replicated, and where the final norm, the embedding and the lm_head
live. :func:`apply_hf_tensor_parallel` applies it with the runtime's own sharding
(:mod:`sp_plan.runtime.tp`); HF's code is not changed: forward pre-hooks open each TP region (all-gather
along the sequence before the attention and the MLP, and before the lm_head), the row-parallel
projections close it. Attention reshapes with ``-1`` heads, so it runs on the local heads. The
state-dict rules of :meth:`sp_plan.runtime.tp.TensorParallel.local_slice` (checkpoints, full state
dicts) come from the same entry (:func:`sp_plan.runtime.tp.slice_rules`), so a new architecture whose
layers look like these is one table entry.

Mixture-of-experts families are refused: their experts are not split, so a TP region around the MoE
block would sum ``tp`` identical copies of its output.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.hf.architectures import HFArchitecture
from sp_plan.runtime.models.hf.model import hf_architecture, hf_decoder_layers, hf_model_spec, module_at
from sp_plan.runtime.tp import (
    Projection,
    TensorParallel,
    shard_projections,
    shard_vocabulary_modules,
    slice_rules,
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

    @classmethod
    def of(cls, arch: HFArchitecture) -> HFTensorParallelPlan:
        """The plan a table entry implies (Megatron's column/row split of its projections)."""
        return cls(projections=tuple(Projection(*p) for p in arch.tensor_parallel_projections()),
                   regions=(arch.attention, arch.mlp), block_norms=arch.block_norms,
                   head_norms=tuple((arch.attention, name) for name in arch.head_norms),
                   final_norm=arch.final_norm, embedding=arch.embedding, lm_head=arch.lm_head)

    def slice_rules(self) -> dict[tuple[str, str], tuple[int, str]]:
        """The state-dict rules of :meth:`TensorParallel.local_slice` for models cut by this plan."""
        vocabulary = (self.embedding.rpartition(".")[2], self.lm_head.rpartition(".")[2])
        return slice_rules(self.projections, vocabulary)


def tp_plan_for(model: nn.Module) -> HFTensorParallelPlan:
    """The TP plan of ``model``'s ``config.model_type`` table entry; refuses MLA and mixture-of-experts families."""
    arch = hf_architecture(model)
    if arch.latent_attention:
        raise RuntimeConfigError(
            f"{model.config.model_type}: tensor parallelism does not split multi-head latent attention (its q/k/v "
            "come from low-rank latents shared by all heads, which the runtime's TP plan has no cut for); use tp=1 "
            "(Ulysses/Ring and FSDP2 train it)"
        )
    if arch.is_moe:
        raise RuntimeConfigError(
            f"{model.config.model_type}: tensor parallelism does not split mixture-of-experts blocks (the experts "
            "would be replicated and the MoE output summed tp times); use tp=1 (Ulysses/Ring and FSDP2 train it)"
        )
    return HFTensorParallelPlan.of(arch)


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(module_at(root, parent) if parent else root, name, module)


def apply_hf_tensor_parallel(model: nn.Module, mesh_or_group, *, sequence_parallel: bool = True) -> TensorParallel:
    """Megatron tensor parallelism (with sequence parallelism) on an HF causal LM, in place, as its
    ``model_type``'s table entry says. Call before FSDP2, like
    :func:`sp_plan.runtime.tp.apply_tensor_parallel`; returns the state, also ``model.tensor_parallel``."""
    plan = tp_plan_for(model)
    spec = hf_model_spec(model)
    tp, split = tensor_parallel_state(spec, mesh_or_group, sequence_parallel)
    tp.rules = plan.slice_rules()
    if tp.size == 1:
        return tp
    object.__setattr__(model, "tensor_parallel", tp)  # state, not a submodule
    for layer in hf_decoder_layers(model):
        shard_projections(tp, split, spec, layer, plan.projections, plan.head_norms,
                          [module_at(layer, name) for name in plan.block_norms])
        for region in plan.regions:
            module_at(layer, region).register_forward_pre_hook(_enter_region(tp), with_kwargs=True)
    if tp.sequence_parallel:
        final_norm = module_at(model, plan.final_norm)
        tp.replicated += [(final_norm, name) for name, _ in final_norm.named_parameters()]
    embedding, lm_head = shard_vocabulary_modules(tp, module_at(model, plan.embedding),
                                                  module_at(model, plan.lm_head), spec.tied_embeddings)
    _set(model, plan.embedding, embedding)
    _set(model, plan.lm_head, lm_head)
    if not isinstance(lm_head, nn.Identity):  # a model part before the last keeps its hidden states
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
