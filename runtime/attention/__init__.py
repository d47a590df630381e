"""Exact sequence-parallel attention: the local kernel, Ulysses, zigzag Ring and 2D USP.

The entry points (:mod:`.api`) take (batch, seq, heads, head_dim) tensors and explicit process groups; the
:class:`sp_plan.runtime.context.SequenceParallel` context picks the right one for a mesh.
"""

from sp_plan.runtime.attention.kernel import (
    BACKENDS,
    KernelWorkCounter,
    attention_backward,
    attention_forward,
    reference_attention,
    select_backend,
)
from sp_plan.runtime.attention.ulysses import ulysses_kv_replication, valid_ulysses_degrees
from sp_plan.runtime.attention.api import local_attention, ring_attention, ulysses_attention, usp_attention

__all__ = [
    "BACKENDS",
    "KernelWorkCounter",
    "attention_backward",
    "attention_forward",
    "local_attention",
    "reference_attention",
    "ring_attention",
    "select_backend",
    "ulysses_attention",
    "ulysses_kv_replication",
    "usp_attention",
    "valid_ulysses_degrees",
]
