"""The DeepSpeed JSON from `sp-plan export --to deepspeed` runs unmodified in its real consumers.

Each test exports a 2-GPU plan and hands the JSON, untouched, to ``deepspeed.initialize`` or to
transformers' ``Trainer`` (``TrainingArguments(deepspeed=<the dict>)``) on 2 CPU ranks (gloo) with a
tiny Llama, then takes optimizer steps. What each one pins down is a way the export used to fail:
a ``train_batch_size`` the Trainer or DeepSpeed disagreed with, ``mics_shard_size`` (removed from
DeepSpeed), ``data_parallel_size`` next to ``sequence_parallel_size`` (ZeRO sharded over the
data-parallel ranks only), offload refused for a client optimizer.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.export import to_deepspeed
from sp_plan.planner.plan import Hardware, Plan
from tests.distributed import run_ranks

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
#: Bound for one 2-rank run (interpreter start, DeepSpeed import, one or two steps of a tiny model).
RANKS_TIMEOUT_S = 150
SEQ = 32


def make_plan(gpus: int = 2, dtype: str = "fp32", **options) -> Plan:
    degrees = {k: options.pop(k) for k in ("ulysses", "tp", "dp_replicate") if k in options}
    return Plan(
        model=get_model_preset("llama3-8b"),
        train=TrainSpec(seq_len=SEQ, dtype=dtype, **options),
        layout=Layout.for_world(gpus, **degrees),
        hardware=Hardware(num_gpus=gpus, gpus_per_node=gpus, gpu="h100-80gb", topology="hgx-h100"),
    )


# ----- in each rank ------------------------------------------------------------------------------------


def _deepspeed_on_cpu() -> None:
    """DeepSpeed on the CPU accelerator, without its shared-memory all-reduce kernel: a C++ op compiled on
    first use (about a minute on 2 cores) that only speeds up inference all-reduce; gloo does the rest."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    # Not `import deepspeed.comm.torch as ...`: that name resolves to the torch package deepspeed.comm imports.
    ds_comm = importlib.import_module("deepspeed.comm.torch")
    ds_comm.build_shm_op = lambda: None


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ)
    config._attn_implementation = "sdpa"  # what the export tells ALST to wrap
    return LlamaForCausalLM(config)


def _zero_ranks(engine) -> int:
    """How many ranks ZeRO partitions the optimizer state over."""
    import torch.distributed as dist

    return dist.get_world_size(group=engine.optimizer.dp_process_group)


def _initialize_rank(rank: int, world: int, config: dict, ulysses: int) -> dict:
    """deepspeed.initialize(model, optimizer=torch AdamW, config=<export>), plus the ALST handle for Ulysses."""
    _deepspeed_on_cpu()
    import deepspeed
    import torch
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    model = _tiny_llama()
    extra = {}
    if ulysses > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        extra["mpu"] = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=ulysses,
            micro_batch_size=config["train_micro_batch_size_per_gpu"], seq_length=SEQ, seq_length_is_variable=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, **extra)
    tp = config.get("tensor_parallel", {}).get("autotp_size", 1)  # a TP group reads the same batch
    ids = torch.randint(0, 128, (config["train_micro_batch_size_per_gpu"], SEQ // ulysses),
                        generator=torch.Generator().manual_seed(rank // tp))
    positions = torch.arange(SEQ // ulysses) + (rank % ulysses) * (SEQ // ulysses)
    losses = []
    for _ in range(2):
        out = engine(input_ids=ids, labels=ids, position_ids=positions[None])
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return {"losses": losses, "zero_ranks": _zero_ranks(engine), "sp": groups._get_sequence_parallel_world_size(),
            "autotp": engine.autotp_size(), "offloaded": bool(engine.zero_cpu_offload())}


def _trainer_rank(rank: int, world: int, config: dict, ulysses: int, out_dir: str) -> dict:
    """transformers' Trainer with TrainingArguments(deepspeed=<export>) and what the export's notes ask for.

    On CPU, Accelerate's state counts one process (no GPU backend), so every rank reads the whole dataset;
    DeepSpeed itself still runs on the 2-rank gloo world (ZeRO partitions are checked). The same count makes
    Accelerate's AutoTP batch sharding divide by zero, so AutoTP goes through deepspeed.initialize only."""
    _deepspeed_on_cpu()
    import torch
    from transformers import Trainer, TrainingArguments

    extra = {}
    if ulysses > 1:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=ulysses, dp_shard_size=world // ulysses,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ, sp_seq_length_is_variable=False,
                                                       sp_attn_implementation="sdpa"))
    args = TrainingArguments(
        output_dir=f"{out_dir}/rank{rank}", per_device_train_batch_size=config["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=config["gradient_accumulation_steps"], gradient_checkpointing=True,
        bf16=config["bf16"]["enabled"], fp16=config["fp16"]["enabled"],  # as the export's note says
        max_steps=2, deepspeed=config, report_to=[], save_strategy="no", logging_steps=1, **extra)
    ids = torch.randint(0, 128, (8, SEQ), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row, "position_ids": torch.arange(SEQ)} for row in ids]
    trainer = Trainer(model=_tiny_llama(), args=args, train_dataset=data)
    result = trainer.train()
    engine = trainer.model_wrapped
    return {"loss": result.training_loss, "zero_ranks": _zero_ranks(engine),
            "offloaded": bool(engine.zero_cpu_offload())}


def _run(fn, *args) -> list[dict]:
    start = time.monotonic()
    results = run_ranks(2, fn, *args, timeout=RANKS_TIMEOUT_S)
    assert time.monotonic() - start < RANKS_TIMEOUT_S
    return results


# ----- deepspeed.initialize ------------------------------------------------------------------------------


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage, dtype, optimizer", [(2, "fp32", "adamw"), (3, "bf16", "adamw"),
                                                      (2, "bf16", "adamw_bf16")])
def test_deepspeed_initialize_runs_the_exported_zero_config(zero_stage, dtype, optimizer):
    config = to_deepspeed(make_plan(zero_stage=zero_stage, dtype=dtype, optimizer=optimizer, grad_accum=2)).content
    results = _run(_initialize_rank, config, 1)
    for r in results:
        assert r["zero_ranks"] == 2 and r["sp"] == 1 and not r["offloaded"]
        assert all(loss == loss and loss > 0 for loss in r["losses"])


@needs_deepspeed
@pytest.mark.multiproc
def test_deepspeed_initialize_accepts_offload_with_a_client_optimizer():
    """Used to fail: 'You are using ZeRO-Offload with a client provided optimizer'."""
    config = to_deepspeed(make_plan(zero_stage=3, offload_optimizer=True, offload_params=True)).content
    for r in _run(_initialize_rank, config, 1):
        assert r["offloaded"] and r["zero_ranks"] == 2


@needs_deepspeed
@pytest.mark.multiproc
def test_deepspeed_initialize_ulysses_through_alst_shards_zero_over_every_rank():
    """With the ALST handle the sequence group is 2 and ZeRO still partitions over both ranks (a
    data_parallel_size of 1 in the JSON made DeepSpeed partition over the data-parallel rank only)."""
    config = to_deepspeed(make_plan(ulysses=2, zero_stage=3)).content
    assert config["sequence_parallel_size"] == 2 and "data_parallel_size" not in config
    for r in _run(_initialize_rank, config, 2):
        assert r["sp"] == 2 and r["zero_ranks"] == 2


@needs_deepspeed
@pytest.mark.multiproc
def test_deepspeed_initialize_runs_autotp_with_zero3():
    """AutoTP under ZeRO-3, with the batch size left for DeepSpeed to derive from its own world."""
    config = to_deepspeed(make_plan(tp=2, zero_stage=3)).content
    assert "train_batch_size" not in config
    for r in _run(_initialize_rank, config, 1):
        assert r["autotp"] == 2


# ----- transformers' Trainer ----------------------------------------------------------------------------


@needs_deepspeed
@pytest.mark.multiproc
def test_trainer_runs_the_exported_offload_config(tmp_path):
    # fp32: TrainingArguments(bf16=True) asks for a GPU or use_cpu (bf16 runs through deepspeed.initialize above).
    config = to_deepspeed(make_plan(zero_stage=3, offload_optimizer=True, grad_accum=2)).content
    for r in _run(_trainer_rank, config, 1, str(tmp_path)):
        assert r["offloaded"] and r["zero_ranks"] == 2 and r["loss"] > 0


@needs_deepspeed
@pytest.mark.multiproc
def test_trainer_runs_the_exported_ulysses_config(tmp_path):
    """The Trainer (through Accelerate's DeepSpeed sp) registers the ALST handle itself and derives the batch
    from its own count of data-parallel ranks; ZeRO still partitions over both ranks."""
    config = to_deepspeed(make_plan(ulysses=2, zero_stage=2)).content
    for r in _run(_trainer_rank, config, 2, str(tmp_path)):
        assert r["zero_ranks"] == 2 and r["loss"] > 0


# ----- what the JSON says, and what it refuses -------------------------------------------------------------


def test_deepspeed_json_has_no_removed_or_ignored_keys():
    """No MiCS (removed from DeepSpeed), no activation_checkpointing section (ignored for transformers models),
    no train_batch_size or data_parallel_size; gradient checkpointing and the Trainer's arguments are notes."""
    exported = to_deepspeed(make_plan(gpus=4, dp_replicate=2, ulysses=2, zero_stage=3, dtype="bf16", grad_accum=3))
    cfg = exported.content
    assert "mics_shard_size" not in cfg["zero_optimization"]
    assert not {"activation_checkpointing", "train_batch_size", "data_parallel_size"} & set(cfg)
    notes = "\n".join(exported.notes)
    assert "global batch: 6 sequences of 32 tokens" in notes  # 1 x 3 x 2 data-parallel ranks
    assert "TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=3, bf16=True, " \
           "gradient_checkpointing=True, deepspeed=<this file>)" in notes
    assert "UlyssesSPAttentionHF.register_with_transformers" in notes and "dp_replicate split" in notes
    assert "zero_force_ds_cpu_optimizer" not in cfg


def test_deepspeed_json_validates_with_deepspeeds_own_config_class():
    config_module = pytest.importorskip("deepspeed.runtime.config")
    for plan in (make_plan(zero_stage=3, offload_optimizer=True, offload_params=True, dtype="bf16"),
                 make_plan(ulysses=2, zero_stage=2), make_plan(tp=2, zero_stage=1),
                 make_plan(zero_stage=1, dtype="bf16", optimizer="adamw_bf16"),
                 make_plan(gpus=4, dp_replicate=2, zero_stage=3)):
        config_module.DeepSpeedConfig(dict(to_deepspeed(plan).content))


@pytest.mark.parametrize(
    "options, field",
    [({"offload_checkpoints": True, "zero_stage": 3}, "train.offload_checkpoints"),
     ({"offload_optimizer": True, "zero_stage": 0}, "train.offload_optimizer"),
     ({"optimizer": "adamw_bf16", "dtype": "bf16", "zero_stage": 0}, "train.optimizer")],
)
def test_deepspeed_refuses_what_it_cannot_run_and_names_the_field(options, field):
    with pytest.raises(PlannerError, match=field.replace(".", r"\.")):
        to_deepspeed(make_plan(**options))
