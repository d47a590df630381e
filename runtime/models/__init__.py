"""Reference model implementations the runtime trains and the memory model mirrors."""

from .checkpointing import CHECKPOINT_MODES, keep_for_selective, register_selective_save_op, run_checkpointed
from .llama import (
    FlashAttention,
    LlamaBlock,
    LlamaModel,
    MaterializedAttention,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
)

__all__ = [
    "CHECKPOINT_MODES",
    "FlashAttention",
    "LlamaBlock",
    "LlamaModel",
    "MaterializedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rope",
    "keep_for_selective",
    "register_selective_save_op",
    "run_checkpointed",
]
