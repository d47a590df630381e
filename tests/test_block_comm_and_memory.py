"""A Llama block under Ulysses, Ring and USP: the runtime's measured bytes equal the cost models' exactly.

For every (layout, checkpointing mode) on 2 and 4 gloo ranks, one ``LlamaBlock`` with the planned SP
attention runs forward and backward in bf16 under a ``CommCounter`` and a ``SavedTensorMeter``:

- communication: bytes sent per collective and phase (forward, backward, recompute) must equal
  ``comm_estimate(model, train, layout).per_layer_by_collective`` (forward; backward incl. recompute;
  recompute alone) EXACTLY for the SP collectives (all-to-all, send/recv), and nothing else is sent
  (the estimate's FSDP traffic belongs to the sharded model, checked by ``sp-plan validate``).
  Selective checkpointing re-sends only the Q/K/V all-to-all (never the ring pass or the output
  all-to-all: the attention steps are custom ops the checkpoint keeps); full re-runs the whole
  block's forward traffic;
- activations: bytes saved for backward must equal the memory model's per-layer saved bytes exactly.

GQA with 4 query and 2 KV heads, so Ulysses 4 replicates KV heads before the all-to-all.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

BATCH, SEQ = 2, 64
MODES = ("none", "selective", "full")
#: world -> (ring, ulysses) layouts
LAYOUTS = {2: [(1, 2), (2, 1)], 4: [(1, 4), (4, 1), (2, 2)]}


def _spec():
    from sp_plan.cost_models import ModelSpec

    return ModelSpec(name="block", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=256)


def _measure_rank(rank: int, world: int) -> dict:
    from sp_plan.cost_models import Layout, TrainSpec, get_gpu_preset
    from sp_plan.cost_models.comm_volume import comm_estimate
    from sp_plan.cost_models.estimate import estimate
    from sp_plan.runtime.auto import SequenceParallelAttention
    from sp_plan.runtime.comm_counter import CommCounter
    from sp_plan.runtime.models import LlamaBlock, RotaryEmbedding
    from sp_plan.runtime.saved_tensor_meter import SavedTensorMeter
    from tests.attention_checks import sp_context

    spec = _spec()
    results = {}
    for ring, ulysses in LAYOUTS[world]:
        sp = sp_context(world, ring=ring, ulysses=ulysses)
        layout = Layout(ring=ring, ulysses=ulysses)
        for mode in MODES:
            torch.manual_seed(0)
            block = LlamaBlock(spec, SequenceParallelAttention(sp), mode, dtype=torch.bfloat16)
            x = sp.shard(torch.randn(BATCH, SEQ, spec.hidden_size, dtype=torch.bfloat16)).clone().requires_grad_()
            cos, sin = RotaryEmbedding(spec.head_dim)(sp.positions(SEQ).expand(BATCH, -1), torch.bfloat16)
            with CommCounter() as counter:
                with SavedTensorMeter(exclude=[*block.parameters(), cos, sin]) as meter:
                    y = block(x, cos, sin)
                y.float().sum().backward()
            train = TrainSpec(seq_len=SEQ, micro_batch=BATCH, checkpointing=mode, dtype="bf16")
            predicted = comm_estimate(spec, train, layout).per_layer_by_collective
            saved = estimate(spec, train, layout, get_gpu_preset("h100-80gb")).detail.per_layer.saved_bytes
            results[(ring, ulysses, mode)] = {
                "measured": counter.as_dict(),
                "predicted": {c: v.model_dump() for c, v in predicted.items()},
                "saved": meter.total_bytes,
                "predicted_saved": saved,
            }
    return results


@pytest.fixture(scope="module")
def measured():
    results = {}
    for world in (2, 4):
        per_rank = run_ranks(world, _measure_rank)
        for key in per_rank[0]:
            results[(world, *key)] = [r[key] for r in per_rank]
    return results


CASES = [(world, ring, ulysses, mode) for world, layouts in LAYOUTS.items() for ring, ulysses in layouts
         for mode in MODES]


def _case_id(case) -> str:
    world, ring, ulysses, mode = case
    return f"w{world}-ring{ring}-ulysses{ulysses}-{mode}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_comm_bytes_per_layer_equal_the_cost_model_exactly(case, measured):
    for rank_result in measured[case]:
        got, want = rank_result["measured"], rank_result["predicted"]
        for collective in ("all_to_all", "send_recv"):  # the SP collectives (FSDP's are not in a bare block)
            forward = got["forward"][collective]
            backward = got["backward"][collective] + got["recompute"][collective]
            assert forward == want[collective]["forward"], (case, collective, got, want[collective])
            assert backward == want[collective]["backward"], (case, collective, got, want[collective])
            assert got["recompute"][collective] == want[collective]["backward_recompute"], (case, collective)
        for collective in ("all_gather", "reduce_scatter", "all_reduce"):  # nothing else leaves the rank
            assert all(got[phase][collective] == 0 for phase in got), (case, collective)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_saved_activation_bytes_equal_the_memory_model_exactly(case, measured):
    for rank_result in measured[case]:
        assert rank_result["saved"] == rank_result["predicted_saved"], (case, rank_result["saved"],
                                                                         rank_result["predicted_saved"])


def test_selective_recomputes_only_the_qkv_all_to_all_and_never_the_ring(measured):
    usp = measured[(4, 2, 2, "selective")][0]["measured"]
    assert usp["recompute"]["send_recv"] == 0 and usp["recompute"]["all_to_all"] > 0
    full = measured[(4, 2, 2, "full")][0]["measured"]
    assert full["recompute"]["send_recv"] == full["forward"]["send_recv"]
    assert full["recompute"]["all_to_all"] == full["forward"]["all_to_all"]
    assert usp["recompute"]["all_to_all"] < full["recompute"]["all_to_all"]  # output all-to-all kept
