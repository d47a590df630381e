"""The adapter of the runtime's own :class:`~sp_plan.runtime.models.LlamaModel`.

It executes every option ``sp-plan plan`` can output for training, with the runtime's own pieces:
:func:`sp_plan.runtime.tp.apply_tensor_parallel`, the model's ``attention_fn``,
:meth:`LlamaModel.set_checkpointing` with :func:`sp_plan.runtime.offload.apply_checkpoint_offload`, and
:func:`sp_plan.runtime.tiled_mlp.apply_tiled_mlp`. The model code is imported inside the methods so
that naming the family (``adapter_named("llama")``) stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sp_plan.runtime.models.base import ModelAdapter, PartPaths, register_adapter

if TYPE_CHECKING:
    import torch
    from torch import nn

    from sp_plan.cost_models.model_spec import ModelSpec
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import RuntimeMesh


class LlamaAdapter(ModelAdapter):
    """:class:`sp_plan.runtime.models.LlamaModel`: a fused-style norm (the memory model's default
    assumptions), every training option supported."""

    name = "llama"
    hidden_states_method = "hidden_states"

    def matches(self, model: Any) -> bool:
        from sp_plan.runtime.models.llama.model import LlamaModel

        return isinstance(model, LlamaModel)

    def spec(self, model: nn.Module) -> ModelSpec:
        return model.spec

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.layers)

    def input_embedding(self, model: nn.Module) -> nn.Module:
        return model.embed_tokens

    def logits(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        return model(input_ids, position_ids, cu_seqlens)

    def part_paths(self, model: nn.Module) -> PartPaths:
        return PartPaths(layers="layers", embedding="embed_tokens", final_norm="norm", lm_head="lm_head")

    def swap_attention(self, model: nn.Module, sp: SequenceParallel, seq_len: int) -> None:
        from sp_plan.runtime.models.llama.attention import SequenceParallelAttention

        attention = SequenceParallelAttention(sp)
        model.attention_fn = attention
        for layer in model.layers:
            layer.attn.attention_fn = attention

    def apply_tensor_parallel(self, model: nn.Module, mesh: RuntimeMesh, sequence_parallel: bool) -> Any:
        from sp_plan.runtime.tp import apply_tensor_parallel

        return apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)

    def set_checkpointing(self, model: nn.Module, mode: str, offload_inputs: bool) -> Any:
        from sp_plan.runtime.offload import apply_checkpoint_offload

        model.set_checkpointing(mode)
        return apply_checkpoint_offload(model) if offload_inputs else None

    def apply_tiled_mlp(self, model: nn.Module) -> None:
        from sp_plan.runtime.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model)

    def model_from_spec(self, spec: ModelSpec, seq_len: int, seed: int) -> nn.Module:
        import torch

        from sp_plan.runtime.models.llama.model import LlamaModel

        model = LlamaModel(spec)
        model.init_weights(generator=torch.Generator().manual_seed(seed))
        return model


LLAMA = register_adapter(LlamaAdapter())
