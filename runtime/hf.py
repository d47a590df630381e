"""The HF family's public helpers at their earlier address (tests, docs and user code import them from
here); they live in :mod:`sp_plan.runtime.models.hf`."""

from __future__ import annotations

from sp_plan.runtime.models.hf.attention import (
    ATTENTION_NAME,
    CONTEXT_ATTRIBUTE,
    register_attention,
    sequence_parallel_attention_forward,
    use_sequence_parallel_attention,
)
from sp_plan.runtime.models.hf.model import (
    HIDDEN_STATES_METHOD,
    SUPPORTED_MODEL_TYPES,
    add_hidden_states_method,
    hf_decoder_layers,
    hf_logits,
    hf_model_from_spec,
    hf_model_spec,
)
from sp_plan.runtime.models.hf.techniques import TILED_ATTRIBUTE, apply_hf_tiled_mlp, set_hf_checkpointing
from sp_plan.runtime.models.hf.tp_plan import apply_hf_tensor_parallel

__all__ = [
    "ATTENTION_NAME",
    "CONTEXT_ATTRIBUTE",
    "HIDDEN_STATES_METHOD",
    "SUPPORTED_MODEL_TYPES",
    "TILED_ATTRIBUTE",
    "add_hidden_states_method",
    "apply_hf_tensor_parallel",
    "apply_hf_tiled_mlp",
    "hf_decoder_layers",
    "hf_logits",
    "hf_model_from_spec",
    "hf_model_spec",
    "register_attention",
    "sequence_parallel_attention_forward",
    "set_hf_checkpointing",
    "use_sequence_parallel_attention",
]
