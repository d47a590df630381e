"""FP8 weight casts once per step where the stack caches them (issue 21: the archived Megatron-Bridge 405B row).

Megatron-Core passes ``is_first_microbatch`` to Transformer Engine's linears, and TE quantizes each weight
into a cached workspace on the step's first micro-batch only; the other micro-batches reuse it. The
activation and output-gradient casts stay per micro-batch. A stack without the cache (torchao's Float8Linear
under torchtitan) casts the weights on every micro-batch."""

from __future__ import annotations

import pytest
from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.compute_time import compute_time, fractions
from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.topology import default_topology

MODEL = get_model_preset("llama3-8b")
TOPOLOGY = default_topology("h100-80gb", 8)
LAYOUT = Layout(tp=2, dp_shard=4)
MEGATRON = resolve_profile("h100-80gb", "megatron")
TORCHTITAN = resolve_profile("h100-80gb", "torchtitan")


def _casts(profile, grad_accum: int) -> float:
    train = TrainSpec(seq_len=8192, zero_stage=1, fp8_linears=True, grad_accum=grad_accum)
    return compute_time(MODEL, train, LAYOUT, TOPOLOGY, profile).parts["fp8_casts"]


def _weight_casts_per_step(profile) -> float:
    """Seconds the amax + cast passes over every weight of this TP rank take once: the stack's passes over
    each weight element (2 bytes read, 1 written) at the kernel model's HBM rate."""
    m, tp = MODEL, LAYOUT.tp
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    per_layer = (m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size) / tp
    hbm = TOPOLOGY.gpu.memory_bandwidth * fractions(TOPOLOGY, profile).memory
    return profile.stack.time.fp8_cast_passes * m.num_layers * per_layer * 3 / hbm


def test_megatron_casts_each_weight_once_per_step():
    assert MEGATRON.stack.time.fp8_weight_cache and not TORCHTITAN.stack.time.fp8_weight_cache
    one, eight = _casts(MEGATRON, 1), _casts(MEGATRON, 8)
    # per micro-batch: activations and gradients A, plus the weights W over the micro-batches of the step
    assert one - eight == pytest.approx(_weight_casts_per_step(MEGATRON) * 7 / 8, rel=1e-9)
    assert (one - _casts(MEGATRON, 4)) / (one - _casts(MEGATRON, 2)) == pytest.approx(1.5, rel=1e-9)


def test_a_stack_without_the_cache_casts_weights_every_micro_batch():
    assert _casts(TORCHTITAN, 8) == pytest.approx(_casts(TORCHTITAN, 1), rel=1e-12)


def test_one_micro_batch_per_step_pays_every_weight_cast():
    """With one micro-batch there is nothing to reuse: both stacks price the same elements (same passes)."""
    assert _casts(MEGATRON, 1) == pytest.approx(_casts(TORCHTITAN, 1), rel=1e-9)
