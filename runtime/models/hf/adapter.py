"""The adapter of Hugging Face transformers causal LMs (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral,
DeepSeek-V2/V3).

Attention goes through transformers' attention registry (:mod:`.attention`), checkpointing through
each decoder layer's hook and the MLP runs tiled (:mod:`.techniques`), tensor parallelism follows the
``model_type``'s table (:mod:`.tp_plan`), and the tiled loss gets its hidden states from a method added
to the causal LM (:func:`.model.add_hidden_states_method`). Those modules import torch and transformers,
so they are imported inside the methods: naming the family (``adapter_named("hf")``) stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sp_plan.runtime.models.base import ModelAdapter, PartPaths, register_adapter
from sp_plan.runtime.models.hf.names import HIDDEN_STATES_METHOD

if TYPE_CHECKING:
    import torch
    from torch import nn

    from sp_plan.cost_models.model_spec import ModelSpec
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import RuntimeMesh

class HFAdapter(ModelAdapter):
    """Any model with an HF config (``config.to_dict``); :meth:`spec` refuses the ``model_type``s the
    runtime does not drive. HF's LlamaRMSNorm is written in eager torch ops and keeps an fp32 copy of
    its input for backward (measured equal in tests/test_hf_memory.py), hence the eager-norm memory
    assumption."""

    name = "hf"
    memory_assumptions = {"norm_implementation": "eager"}
    hidden_states_method = HIDDEN_STATES_METHOD
    checkpoint_binds_rope_tables = True  # HF passes cos/sin to each layer as keywords

    def matches(self, model: Any) -> bool:
        config = getattr(model, "config", None)
        return config is not None and hasattr(config, "to_dict")

    def spec(self, model: nn.Module) -> ModelSpec:
        from sp_plan.runtime.models.hf.model import hf_model_spec

        return hf_model_spec(model)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        from sp_plan.runtime.models.hf.model import hf_decoder_layers

        return hf_decoder_layers(model)

    def input_embedding(self, model: nn.Module) -> nn.Module:
        return model.get_input_embeddings()

    def logits(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        from sp_plan.runtime.models.hf.model import hf_logits

        return hf_logits(model, input_ids, position_ids, cu_seqlens)

    def prepare_hidden_states(self, model: nn.Module) -> None:
        from sp_plan.runtime.models.hf.model import add_hidden_states_method

        add_hidden_states_method(model)

    def part_paths(self, model: nn.Module) -> PartPaths:
        from sp_plan.runtime.models.hf.model import hf_architecture

        arch = hf_architecture(model)
        return PartPaths(layers=arch.layers, embedding=arch.embedding, final_norm=arch.final_norm,
                         lm_head=arch.lm_head)

    def swap_attention(self, model: nn.Module, sp: SequenceParallel, seq_len: int) -> None:
        from sp_plan.runtime.models.hf.attention import use_sequence_parallel_attention

        use_sequence_parallel_attention(model, sp, seq_len)

    def apply_tensor_parallel(self, model: nn.Module, mesh: RuntimeMesh, sequence_parallel: bool) -> Any:
        from sp_plan.runtime.models.hf.tp_plan import apply_hf_tensor_parallel

        return apply_hf_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)

    def set_checkpointing(self, model: nn.Module, mode: str, offload_inputs: bool) -> Any:
        from sp_plan.runtime.models.hf.techniques import set_hf_checkpointing
        from sp_plan.runtime.offload import CheckpointOffload

        offload = CheckpointOffload() if offload_inputs else None
        set_hf_checkpointing(model, mode, offload)
        return offload

    def apply_tiled_mlp(self, model: nn.Module) -> None:
        from sp_plan.runtime.models.hf.techniques import apply_hf_tiled_mlp

        apply_hf_tiled_mlp(model)

    def apply_expert_parallel(self, model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
        from sp_plan.runtime.models.hf.moe import apply_hf_expert_parallel

        return apply_hf_expert_parallel(model, ep_mesh)

    def model_from_spec(self, spec: ModelSpec, seq_len: int, seed: int) -> nn.Module:
        from sp_plan.runtime.models.hf.model import hf_model_from_spec

        return hf_model_from_spec(spec, seq_len)


HF = register_adapter(HFAdapter())
