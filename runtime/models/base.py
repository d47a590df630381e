"""Model adapters: everything the runtime asks of a model family, behind one registered object.

The runtime never asks which family a model is. :func:`adapter_for` finds the registered
:class:`ModelAdapter` whose :meth:`~ModelAdapter.matches` accepts the model, and every step of
:func:`sp_plan.runtime.auto.auto_configure` (planning, tensor parallelism, the attention swap,
checkpointing, the tiled MLP, FSDP2, the loss) goes through that adapter. A new family is one folder
under ``runtime/models/`` with an adapter plus one :func:`register_adapter` call (torchtitan's
``register_train_spec`` / ``ModelSpec`` bundle, in the runtime's own terms).

This module imports no torch (nor do the built-in adapters at import time), so torch-free callers
such as ``sp-plan validate``'s up-front refusal can ask a family what it cannot do
(:mod:`sp_plan.runtime.capabilities`) by name.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from sp_plan.runtime.errors import RuntimeConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from sp_plan.cost_models.model_spec import ModelSpec
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import RuntimeMesh

#: Modules of the families the runtime ships, imported (and so registered) on the first lookup: the
#: runtime's own Llama first, then the generic Hugging Face adapter (which accepts any model with an HF
#: config, so it must not shadow a more specific family registered later).
BUILTIN_ADAPTER_MODULES: tuple[str, ...] = (
    "sp_plan.runtime.models.llama.adapter",
    "sp_plan.runtime.models.hf.adapter",
)

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def refuse_unbuildable(spec: ModelSpec, seq_len: int) -> None:
    """Refuse a planned architecture the runtime's models (``model_from_spec``, ``sp-plan train``) would build
    differently, and so train another model: their attention is full causal, and they have two norms a layer."""
    if spec.attention_layer_groups(seq_len) != ((None, spec.num_layers),):
        raise RuntimeConfigError(
            f"{spec.name}: {spec.windowed_layers} layers attend within a {spec.sliding_window}-token window, shorter "
            f"than seq_len {seq_len}; the runtime's attention is full causal, so it would train a different model: "
            f"train at seq_len <= {spec.sliding_window} or plan a model without a window")
    if spec.extra_norms_per_layer:
        raise RuntimeConfigError(f"{spec.name}: post-attention and post-MLP norms (Gemma 2/3) are not built by the "
                                 "runtime's models; plan a Llama/Mistral/Qwen-style model")
    if spec.moe is not None or spec.mla is not None:
        kind = "mixture-of-experts layers" if spec.moe is not None else "MLA attention"
        raise RuntimeConfigError(
            f"{spec.name}: {kind} are not built by the runtime's models (they would train a dense Llama of the same "
            "width); train the Hugging Face model itself with auto_configure, or plan a dense model")


@dataclass(frozen=True)
class PartPaths:
    """Where a model keeps what :func:`sp_plan.runtime.model_parts.split_model` distributes over parts
    (dotted attribute paths from the model): the block list, the input embedding, the final norm and
    the lm_head."""

    layers: str
    embedding: str
    final_norm: str
    lm_head: str


class ModelAdapter(ABC):
    """What the runtime needs from one model family. Subclass, fill in the methods, and
    :func:`register_adapter` an instance.

    Class attributes describe the family without touching a model (torch-free):

    - ``name``: the registry key (``sp-plan validate --hf`` and reports show it);
    - ``memory_assumptions``: :class:`sp_plan.cost_models.memory.MemoryAssumptions` fields that describe
      how the family's code spends activation memory, so plans for it use its real footprint;
    - ``unsupported_options``: TrainSpec boolean options the family does not execute -> why;
    - ``unsupported_degrees``: Layout degrees the family executes only at 1 -> why;
    - ``hidden_states_method``: the model method returning the final hidden states (the tiled loss's
      input); FSDP2 registers it as a forward method;
    - ``checkpoint_binds_rope_tables``: the family's checkpointing binds the RoPE cos/sin into its
      recompute closures (alive on the device, but not saved tensors a meter sees), so
      ``sp-plan validate`` leaves them out of the activations it predicts.

    Methods take the model (a part of it, once pipeline stages exist) and change it in place; they are
    called in the order :func:`sp_plan.runtime.parallelize.parallelize` fixes.
    """

    name: ClassVar[str]
    memory_assumptions: ClassVar[Mapping[str, Any]] = _EMPTY
    unsupported_options: ClassVar[Mapping[str, str]] = _EMPTY
    unsupported_degrees: ClassVar[Mapping[str, str]] = _EMPTY
    hidden_states_method: ClassVar[str] = "hidden_states"
    checkpoint_binds_rope_tables: ClassVar[bool] = False

    # -- recognising and describing a model ---------------------------------------------------------
    @abstractmethod
    def matches(self, model: nn.Module) -> bool:
        """Whether this adapter drives ``model`` (cheap; no errors for foreign models)."""

    @abstractmethod
    def spec(self, model: nn.Module) -> ModelSpec:
        """The cost models' ModelSpec of ``model`` (what the planner plans for)."""

    @abstractmethod
    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer blocks, in order (the FSDP2 and checkpointing units)."""

    @abstractmethod
    def input_embedding(self, model: nn.Module) -> nn.Module:
        """The token embedding module (its own FSDP2 unit when untied)."""

    # -- running it ----------------------------------------------------------------------------------
    @abstractmethod
    def logits(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the local tokens for global ``position_ids`` (no mask, no cache); ``cu_seqlens``:
        packed-document boundaries over the whole batch."""

    def hidden_states(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states the lm_head multiplies (inside its TP region), through
        :attr:`hidden_states_method` so that FSDP2's hooks around that method run."""
        return getattr(model, self.hidden_states_method)(input_ids, position_ids, cu_seqlens)

    def prepare_hidden_states(self, model: nn.Module) -> None:
        """Make :attr:`hidden_states_method` exist on ``model`` before FSDP2 registers it (a no-op for
        families whose models define it)."""

    def lm_head_weight(self, model: nn.Module) -> torch.Tensor:
        """The output projection's weight (the tiled loss multiplies by it chunk by chunk)."""
        return model.lm_head.weight

    # -- the parallelisms and memory techniques -----------------------------------------------------
    @abstractmethod
    def swap_attention(self, model: nn.Module, sp: SequenceParallel, seq_len: int) -> None:
        """Route every attention of ``model`` through ``sp`` (the planned sequence-parallel attention)."""

    def apply_tensor_parallel(self, model: nn.Module, mesh: RuntimeMesh, sequence_parallel: bool) -> Any:
        """Shard the model over the mesh's ``tp`` dim (Megatron column/row split); returns the
        :class:`sp_plan.runtime.tp.TensorParallel` state. Families that cannot say so in
        ``unsupported_degrees = {"tp": why}`` and the planner never asks them."""
        raise RuntimeConfigError(f"the {self.name} model family has no tensor parallelism")

    @abstractmethod
    def set_checkpointing(self, model: nn.Module, mode: str, offload_inputs: bool) -> Any:
        """Checkpoint every block in ``mode`` (none / selective / full); with ``offload_inputs`` keep each
        block's checkpointed input in host memory. Returns the
        :class:`sp_plan.runtime.offload.CheckpointOffload` or None."""

    def apply_tiled_mlp(self, model: nn.Module) -> None:
        """Run every block's MLP over sequence tiles. Families that cannot say so in
        ``unsupported_options = {"tiled_mlp": why}``."""
        raise RuntimeConfigError(f"the {self.name} model family has no tiled MLP")

    def apply_expert_parallel(self, model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
        """Split the model's experts over ``ep_mesh`` and dispatch tokens to them; returns the experts modules
        (FSDP2 shards them over the expert data dim). Families without it are refused by
        :mod:`sp_plan.runtime.capabilities` (:data:`~sp_plan.runtime.capabilities.EXPERT_PARALLEL_FAMILIES`)."""
        raise RuntimeConfigError(f"the {self.name} model family has no expert parallelism")

    def part_paths(self, model: nn.Module) -> PartPaths:
        """Where ``model`` keeps its blocks, embedding, final norm and lm_head, so that it can be split
        into model parts (:func:`sp_plan.runtime.model_parts.split_model`). A model part's forward takes
        the previous part's hidden states in place of token ids (its embedding is an identity) and returns
        hidden states until the last part (whose norm and lm_head are real)."""
        raise RuntimeConfigError(f"the {self.name} model family cannot be split into model parts")

    # -- building one ---------------------------------------------------------------------------------
    def model_from_spec(self, spec: ModelSpec, seq_len: int, seed: int) -> nn.Module:
        """A randomly initialised model of ``spec``'s shape on CPU (``sp-plan validate`` runs it)."""
        raise RuntimeConfigError(f"the {self.name} model family cannot build a model from a ModelSpec")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_ADAPTERS: dict[str, ModelAdapter] = {}
_builtins_loaded = False


def _load_builtins() -> None:
    """Import the shipped families once (each registers itself); lazily, so that importing this module
    (and asking a registered name) stays cheap and torch-free."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTIN_ADAPTER_MODULES:
        importlib.import_module(module)


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Make ``adapter`` known to :func:`adapter_for` and :func:`adapter_named`; returns it. Registering
    a name again replaces the earlier adapter. Later registrations are asked first by
    :func:`adapter_for`, so a specific family wins over a generic one (e.g. over the HF adapter)."""
    _load_builtins()  # the shipped families first, so that this one is asked before them
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"register_adapter takes a ModelAdapter instance, got {type(adapter).__name__}")
    name = getattr(adapter, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{type(adapter).__name__} needs a non-empty class attribute `name`")
    _ADAPTERS.pop(name, None)  # re-registered: it moves to the end (asked first)
    _ADAPTERS[name] = adapter
    return adapter


def adapter_names() -> tuple[str, ...]:
    """The registered family names, in registration order."""
    _load_builtins()
    return tuple(_ADAPTERS)


def adapter_named(name: str | ModelAdapter) -> ModelAdapter:
    """The adapter registered under ``name`` (an adapter is returned as is)."""
    if isinstance(name, ModelAdapter):
        return name
    _load_builtins()
    try:
        return _ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}: expected one of {', '.join(_ADAPTERS)}") from None


def adapter_for(model: Any) -> ModelAdapter:
    """The adapter that drives ``model``: the most recently registered one whose ``matches`` accepts it."""
    _load_builtins()
    for adapter in reversed(list(_ADAPTERS.values())):
        if adapter.matches(model):
            return adapter
    raise RuntimeConfigError(
        f"auto_configure does not know how to parallelise a {type(model).__name__}: pass a "
        "sp_plan.runtime.models.LlamaModel or a transformers Llama/Qwen2/Qwen3/Mistral causal LM"
    )
