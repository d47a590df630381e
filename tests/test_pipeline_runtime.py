"""Pipeline parallelism in the runtime (:mod:`sp_plan.runtime.pipeline`) trains exactly like one process.

A tiny fp32 Llama (4 blocks, untied) is trained for 10 AdamW steps of 2 micro-batches (the plan's
grad_accum), with gradient clipping, once in a single process (pp=1) and once on CPU gloo ranks with pp=2
(1F1B) composed with Ulysses, with ring and FSDP2 (dp_shard), with TP (Megatron sequence parallelism), with
TP and the tiled loss, with ZeRO-2 and full checkpointing over dp_shard 2, with ZeRO-1, and alone, with the
zero-bubble schedule (ZeRO-2, dp_shard 2), and with interleaved 1F1B (two virtual stages per rank); a transformers Llama at pp=2 x Ulysses 2
(its stages run through StageForward). Each step's loss must match the single process's within 1e-4, the clipped norm
within 1e-4 relative, and the gathered final weights too. A plan the runtime plans itself with pp pinned
trains too; what the runtime does not run under pp (zero bubble with ZeRO-3 or selective checkpointing,
checkpoint offload, another micro-batch count) is refused with the reason. Through the console script, ``sp-plan train
--pp 2`` trains on 2 ranks and ``sp-plan validate`` refuses a pipelined plan the runtime cannot run in one line
(it measures the ones it can: tests/test_validate_pipeline.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec
from sp_plan.planner.plan import Hardware, Plan
from tests.distributed import error_of, run_ranks

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


def _train(rank: int, world: int, layout: Layout, train: dict | None = None) -> dict:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    setup = auto_configure(_llama(), plan=_plan(layout, **(train or {})), seq_len=SEQ)
    optimizer = setup.make_optimizer(lr=LR)
    losses, norms = [], []
    for batches in _steps():
        result = train_step(setup, batches, optimizer, max_grad_norm=CLIP)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    weights = {k: v.detach().cpu().numpy().copy() for k, v in setup.full_state_dict().items()}
    blocks = [sorted(int(name) for name, _ in part.layers.named_children()) for part in setup.model_parts]
    return {"losses": losses, "norms": norms, "weights": weights, "blocks": blocks}


@pytest.fixture(scope="module")
def single_process() -> dict:
    return run_ranks(1, _train, Layout())[0]


CASES = {
    "pp2": (Layout(pp=2), {}, [[[0, 1]], [[2, 3]]]),
    "pp2-ulysses2": (Layout(pp=2, ulysses=2), {}, [[[0, 1]]] * 2 + [[[2, 3]]] * 2),
    "pp2-ring2-dp_shard2": (Layout(pp=2, ring=2, dp_shard=2), {}, [[[0, 1]]] * 4 + [[[2, 3]]] * 4),
    "pp2-tp2": (Layout(pp=2, tp=2), {}, [[[0, 1]]] * 2 + [[[2, 3]]] * 2),
    "pp2-dp_shard2-zero2-full": (Layout(pp=2, dp_shard=2), {"zero_stage": 2, "checkpointing": "full"},
                                 [[[0, 1]]] * 2 + [[[2, 3]]] * 2),
    "pp2-zero1": (Layout(pp=2), {"zero_stage": 1}, [[[0, 1]], [[2, 3]]]),
    "pp2-tp2-tiled_loss": (Layout(pp=2, tp=2), {"tiled_loss": True}, [[[0, 1]]] * 2 + [[[2, 3]]] * 2),
    "pp2-dp_shard2-zero_bubble": (Layout(pp=2, dp_shard=2), {"pipeline_schedule": "zero_bubble", "zero_stage": 2,
                                                             "checkpointing": "none"}, [[[0, 1]]] * 2 + [[[2, 3]]] * 2),
    "pp2-dp_shard2-zero_bubble-zero3": (Layout(pp=2, dp_shard=2), {"pipeline_schedule": "zero_bubble", "zero_stage": 3,
                                                             "checkpointing": "none"}, [[[0, 1]]] * 2 + [[[2, 3]]] * 2),
    "pp2-interleaved": (Layout(pp=2), {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2},
                        [[[0], [2]], [[1], [3]]]),
    # 3 chunks per stage over 4 layers: the first chunk of stage 0 holds the embedding alone, the last of stage 1
    # the head and loss alone (Llama 3's 405B layout)
    "pp2-interleaved-head-chunks": (Layout(pp=2), {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 3},
                                    [[[], [1], [3]], [[0], [2], []]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_training_equals_single_process(case: str, single_process: dict) -> None:
    layout, train, blocks = CASES[case]
    results = run_ranks(layout.world, _train, layout, train, timeout=300)
    assert [r["blocks"] for r in results] == blocks  # this rank's stages (pp is the outermost mesh dim)
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["losses"], single_process["losses"], strict=True)):
            assert abs(got - want) < 1e-4, (rank, step, got, want)
        for step, (got, want) in enumerate(zip(result["norms"], single_process["norms"], strict=True)):
            assert got == pytest.approx(want, rel=1e-4), (rank, step)
        assert sorted(result["weights"]) == sorted(single_process["weights"])
        for name, want in single_process["weights"].items():
            torch.testing.assert_close(torch.from_numpy(result["weights"][name]), torch.from_numpy(want),
                                       rtol=1e-4, atol=1e-5, msg=name)
    assert single_process["losses"][-1] < single_process["losses"][0]  # it trains
    assert max(single_process["norms"]) > CLIP  # the clip is active


def _hf_llama():
    import transformers

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=4, vocab_size=VOCAB, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _train_hf(rank: int, world: int, layout: Layout) -> list[float]:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    setup = auto_configure(_hf_llama(), plan=_plan(layout), seq_len=SEQ)
    optimizer = setup.make_optimizer(lr=LR)
    return [train_step(setup, batches, optimizer, max_grad_norm=CLIP).loss for batches in _steps()]


def test_a_transformers_llama_trains_pipelined_like_one_process() -> None:
    pytest.importorskip("transformers")
    reference = run_ranks(1, _train_hf, Layout())[0]
    for losses in run_ranks(4, _train_hf, Layout(pp=2, ulysses=2), timeout=300):
        assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-4, (losses, reference)
    assert reference[-1] < reference[0]


def _planned_and_refused(rank: int, world: int) -> dict:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    out = {}
    setup = auto_configure(_llama(), seq_len=SEQ, global_batch=MICRO_BATCHES, topology="dgx-h100",
                           fixed_layout={"pp": 2})
    out["layout"] = (setup.layout.pp, setup.layout.tp, setup.train.pipeline_schedule, setup.train.grad_accum)
    batches = _steps()[0]
    out["loss"] = train_step(setup, batches, setup.make_optimizer(lr=LR)).loss
    out["one_batch"] = error_of(lambda: train_step(setup, batches[:1]))
    out["forward"] = error_of(lambda: setup.forward(setup.shard(batches[0])))
    out["offload_pin"] = error_of(lambda: auto_configure(_llama(), seq_len=SEQ, topology="dgx-h100",
                                                         fixed_layout={"pp": 2},
                                                         fixed_options={"offload_checkpoints": True}))
    out["zb_pin"] = error_of(lambda: auto_configure(_llama(), seq_len=SEQ, topology="dgx-h100", fixed_layout={"pp": 2},
                                                    fixed_options={"pipeline_schedule": "zero_bubble",
                                                                   "checkpointing": "selective"}))
    return out


def _first_step_loss(rank: int, world: int) -> float:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    setup = auto_configure(_llama(), plan=_plan(Layout()), seq_len=SEQ)
    return train_step(setup, _steps()[0]).loss


def test_a_plan_with_pp_pinned_trains_and_what_pp_cannot_run_is_refused() -> None:
    reference = run_ranks(1, _first_step_loss)[0]
    for out in run_ranks(2, _planned_and_refused, timeout=300):
        assert out["layout"] == (2, 1, "1f1b", MICRO_BATCHES)
        assert abs(out["loss"] - reference) < 1e-5
        assert "runs 2 micro-batches per step (the plan's grad_accum) but the step got 1" in out["one_batch"]
        assert "one stage of a pipeline" in out["forward"] and "train_step" in out["forward"]
        assert "offload_checkpoints with pp=2" in out["offload_pin"] and "pin pp 1" in out["offload_pin"]
        assert "zero_bubble with checkpointing=selective" in out["zb_pin"] and "--schedule 1f1b" in out["zb_pin"]


def test_unsupported_pipelined_plans_are_refused_with_reasons() -> None:
    from sp_plan.runtime.capabilities import merge_constraints, planner_constraints, unsupported_reasons

    assert unsupported_reasons(_plan(Layout(pp=2, ulysses=2))) == []
    assert unsupported_reasons(_plan(Layout(pp=2, tp=2))) == []
    assert unsupported_reasons(_plan(Layout(pp=2), pipeline_schedule="interleaved_1f1b", virtual_stages=2)) == []
    assert unsupported_reasons(_plan(Layout(pp=2), tiled_loss=True)) == []
    assert unsupported_reasons(_plan(Layout(pp=2), pipeline_schedule="zero_bubble", zero_stage=2,
                                     checkpointing="full")) == []
    # ZeRO-3 runs under zero-bubble: the stage keeps its parameters gathered through the step (no reshard between
    # the input- and the weight-gradient pass), exact in CASES
    assert unsupported_reasons(_plan(Layout(pp=2), pipeline_schedule="zero_bubble", zero_stage=3,
                                     checkpointing="full")) == []
    reasons = unsupported_reasons(_plan(Layout(pp=2), pipeline_schedule="zero_bubble", offload_checkpoints=True))
    assert not any(r.startswith("zero_bubble with zero_stage") for r in reasons)
    assert any(r.startswith("zero_bubble with checkpointing=selective:") for r in reasons)
    zero_bubble = _plan(Layout(pp=2), pipeline_schedule="zero_bubble", zero_stage=2, checkpointing="full")
    assert any(r.startswith("zero_bubble with the hf family:") for r in unsupported_reasons(zero_bubble, "hf"))
    assert any(r.startswith("offload_checkpoints with pp=2:") for r in reasons)
    assert unsupported_reasons(_plan(Layout(pp=2, ulysses=2)), "hf") == []
    assert "pp" not in planner_constraints("llama")[0]  # pp runs; the runtime's planning picks it only when pinned
    from sp_plan.runtime.planning import UNPINNED_DEFAULTS

    assert UNPINNED_DEFAULTS == {"pp": 1}
    layout, options = merge_constraints({"pp": 2}, {"virtual_stages": 2})
    assert layout == {"pp": 2} and options["pipeline_schedule"] == "interleaved_1f1b"
    assert not options["offload_checkpoints"] and "tiled_loss" not in options


SCRIPT = str(Path(sys.executable).parent / "sp-plan")
TINY_TRAIN = ["--seq-len", "128", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
              "--corpus-bytes", "100000", "--no-progress", "--log-every", "1", "--yes"]


@pytest.mark.timeout(240)
def test_the_console_script_trains_with_pp_and_validate_refuses_what_pp_cannot_run(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([SCRIPT, "train", "--nproc-per-node", "2", "--steps", "2", "--pp", "2", "--global-batch", "2",
                           *TINY_TRAIN], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "plan: pp=2 on 2 rank(s)" in out and "grad-accum 2" in out and "done: 2 steps" in out, out[-3000:]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
                                  "vocab_size": 256, "tie_word_embeddings": False}))
    refused = subprocess.run([SCRIPT, "validate", "--model", str(config), "--seq-len", "128", "--gpus", "2", "--pp",
                              "2", "--dtype", "fp32", "--offload-checkpoints"], check=False, cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and "offload_checkpoints with pp=2" in refused.stderr, refused.stderr
    assert "--pp 1" in refused.stderr
