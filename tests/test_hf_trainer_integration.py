"""transformers' Trainer trains an auto-configured model exactly as the runtime's own loop does.

On 2 gloo ranks, a tiny random-init HF Llama under Ulysses 2 and under Ring 2 (fp32, 2 micro-batches per
step, right-padded rows with different valid-token counts, gradient clipping):
:class:`sp_plan.runtime.integrations.transformers.SequenceParallelTrainer` runs ``Trainer.train()`` and
:func:`sp_plan.runtime.step.train_step` runs the same model (rebuilt from the same seed) on the same
data order. The step losses and gradient norms agree within 1e-5, and the Trainer's own log shows the
step's global loss (not one rank's slice). Ulysses also saves with ``trainer.save_model`` and reloads the
checkpoint with plain transformers. ``use_cpu=True`` makes Accelerate multi-process on CPU (MULTI_CPU, 2
processes), so its DDP wrap is live as on GPUs: the model must come back unwrapped from ``accelerator.prepare``.
TRL's SFTTrainer (where TRL is installed) matches the runtime's step on the batches its own collator makes.
Plans and arguments the Trainer cannot run are refused with every reason named.
"""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed import run_ranks  # noqa: E402

STEPS, MICRO, ACCUM, SEQ, VOCAB, LR, SEED = 3, 1, 2, 32, 128, 1e-3, 7
SFT_VOCAB = 320  # the byte-level BPE tokenizer's 300 tokens fit
TIMEOUT_S = 90
#: (case, layout pins, option pins)
CASES = [
    ("ulysses2", {"ulysses": 2}, {"zero_stage": 2, "checkpointing": "selective", "tiled_loss": True}),
    ("ring2", {"ring": 2}, {"zero_stage": 1, "checkpointing": "none"}),
]


def _model(vocab: int = VOCAB):
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
                                      attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def _dataset() -> list[dict[str, torch.Tensor]]:
    """Right-padded rows of different lengths: micro-batches hold different valid-token counts."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(STEPS * MICRO * ACCUM):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=gen))
        mask = (torch.arange(SEQ) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def _configure(layout: dict, options: dict, vocab: int = VOCAB):
    from sp_plan.runtime.auto import auto_configure

    return auto_configure(_model(vocab), seq_len=SEQ, micro_batch=MICRO, global_batch=MICRO * ACCUM, dtype="fp32",
                          topology="dgx-h100", fixed_layout=layout, fixed_options=options)


def _runtime_loop(layout: dict, options: dict) -> dict:
    """The reference: the runtime's own step over the order the trainer's sampler yields."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from sp_plan.runtime.step import train_step

    setup = _configure(layout, options)
    dataset = _dataset()
    optimizer = setup.make_optimizer(lr=LR, weight_decay=0.0)
    loader = iter(DataLoader(dataset, batch_size=MICRO, collate_fn=default_data_collator,
                             sampler=setup.sampler(dataset, shuffle=True, seed=SEED)))
    results = [train_step(setup, [next(loader) for _ in range(ACCUM)], optimizer, max_grad_norm=1.0)
               for _ in range(STEPS)]
    return {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results]}


def _trainer_run(layout: dict, options: dict, out_dir: str, save: bool) -> dict:
    from transformers import TrainingArguments

    from sp_plan.runtime.integrations.transformers import SequenceParallelTrainer, training_arguments

    setup = _configure(layout, options)
    args = TrainingArguments(**training_arguments(
        setup.plan, output_dir=out_dir, max_steps=STEPS, learning_rate=LR, weight_decay=0.0,
        lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, report_to=[],
        seed=SEED, disable_tqdm=True, use_cpu=True))
    trainer = SequenceParallelTrainer(setup, args, train_dataset=_dataset())
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    prepared = trainer.accelerator.prepare(setup.model)
    result = {"losses": trainer.step_losses, "logged": [e["loss"] for e in logged],
              "logged_norms": [e["grad_norm"] for e in logged], "unwrapped": prepared is setup.model,
              "accelerate": (str(trainer.accelerator.distributed_type), trainer.accelerator.num_processes),
              "layout": setup.layout.describe()}
    if save:
        full = {k: v.cpu().numpy() for k, v in setup.full_state_dict().items()}
        trainer.save_model(f"{out_dir}/saved")
        result["full"] = full
    return result


def _sft_run(out_dir: str, tokenizer_dir: str) -> dict:
    """TRL's SFTTrainer on text rows (tokenised, truncated and right-padded by TRL) against the runtime's own
    step over the very batches TRL's collator makes, in the trainer's sampler order."""
    import datasets
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig

    from sp_plan.runtime.integrations.transformers import training_arguments
    from sp_plan.runtime.integrations.trl import SequenceParallelSFTTrainer
    from sp_plan.runtime.step import train_step

    layout, options = {"ulysses": 2}, {"zero_stage": 3, "checkpointing": "full"}
    reference, setup = _configure(layout, options, SFT_VOCAB), _configure(layout, options, SFT_VOCAB)
    gen = torch.Generator().manual_seed(5)
    words = ["sequence", "parallel", "ring", "ulysses", "token", "loss", "plan", "mesh", "shard", "gather"]
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=gen))
             for n in torch.randint(2, 12, (STEPS * MICRO * ACCUM,), generator=gen)]
    args = SFTConfig(**training_arguments(
        setup.plan, output_dir=out_dir, max_steps=STEPS, learning_rate=LR, weight_decay=0.0, max_length=SEQ,
        lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, report_to=[],
        seed=SEED, disable_tqdm=True, use_cpu=True))
    trainer = SequenceParallelSFTTrainer(setup, args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                                         processing_class=PreTrainedTokenizerFast.from_pretrained(tokenizer_dir))
    batches = list(trainer.get_train_dataloader())
    optimizer = reference.make_optimizer(lr=LR, weight_decay=0.0)
    want = [train_step(reference, batches[i * ACCUM:(i + 1) * ACCUM], optimizer, max_grad_norm=1.0).loss
            for i in range(STEPS)]
    trainer.train()
    return {"losses": trainer.step_losses, "reference": want, "keys": sorted(batches[0]),
            "lengths": sorted({b["input_ids"].shape[1] for b in batches})}


def _rank(rank: int, world: int, out_dir: str, tokenizer_dir: str | None) -> dict:
    results = {case: {"reference": _runtime_loop(layout, options),
                      "trainer": _trainer_run(layout, options, f"{out_dir}/{case}", save=case == "ulysses2")}
               for case, layout, options in CASES}
    if tokenizer_dir is not None:
        results["sft"] = _sft_run(f"{out_dir}/sft", tokenizer_dir)
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("hf_trainer"))
    tokenizer_dir = None
    if importlib.util.find_spec("trl") is not None:  # the SFTTrainer case runs where TRL is installed
        from sp_plan.runtime.text_data import build_bpe_tokenizer

        tokenizer_dir = f"{out_dir}/tokenizer"
        build_bpe_tokenizer(["sequence parallel ring ulysses token loss plan mesh shard gather"] * 4, tokenizer_dir,
                            vocab_size=300)
    start = time.monotonic()
    results = run_ranks(2, _rank, out_dir, tokenizer_dir, timeout=TIMEOUT_S)
    return results, out_dir, time.monotonic() - start


@pytest.mark.multiproc
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_trainer_matches_the_runtime_step(case, trained):
    results, _, seconds = trained
    assert seconds < TIMEOUT_S
    for rank in results:
        got, want = rank[case]["trainer"], rank[case]["reference"]
        assert len(got["losses"]) == STEPS and got["layout"] == ("ulysses=2" if case == "ulysses2" else "ring=2")
        for a, b in zip(got["losses"], want["losses"]):
            assert abs(a - b) < 1e-5, (case, got["losses"], want["losses"])
        for a, b in zip(got["logged_norms"], want["grad_norms"]):
            assert abs(a - b) < 1e-5 * max(1.0, b), (case, got["logged_norms"], want["grad_norms"])
        # The Trainer's log is the step's global token-mean loss on every rank (it rounds to 4 digits).
        assert got["logged"] == pytest.approx(got["losses"], abs=1e-4), (case, got["logged"], got["losses"])
        # Accelerate runs multi-process (its DDP wrap is live, as on GPUs) and leaves the FSDP2 model unwrapped.
        assert got["accelerate"] == ("DistributedType.MULTI_CPU", 2) and got["unwrapped"], got["accelerate"]
        assert want["losses"][-1] < want["losses"][0]  # it trains


@pytest.mark.multiproc
def test_trainer_save_model_writes_the_full_unparallelised_weights(trained):
    import transformers

    results, out_dir, _ = trained
    loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{out_dir}/ulysses2/saved")
    params = dict(loaded.named_parameters())
    full = results[0]["ulysses2"]["trainer"]["full"]
    assert params.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(params[name].detach(), torch.from_numpy(value)), name


@pytest.mark.multiproc
def test_trl_sft_trainer_matches_the_runtime_step(trained):
    pytest.importorskip("trl")
    for rank in trained[0]:
        got = rank["sft"]
        assert got["keys"] == ["attention_mask", "input_ids", "labels"] and len(got["lengths"]) > 1, got
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], got["reference"]):
            assert abs(a - b) < 1e-5, (got["losses"], got["reference"])


def _plan(dtype: str = "fp32", tp: int = 1, **train):
    from sp_plan.cost_models.layout import Layout
    from sp_plan.cost_models.train_spec import TrainSpec

    return SimpleNamespace(layout=Layout(tp=tp, ulysses=2), train=TrainSpec(seq_len=SEQ, dtype=dtype, **train))


def test_training_arguments_follow_the_plan(tmp_path):
    from transformers import TrainingArguments

    from sp_plan.runtime.integrations.transformers import training_arguments

    kwargs = training_arguments(_plan("bf16", micro_batch=2, grad_accum=4, checkpointing="full"),
                                output_dir=str(tmp_path), learning_rate=2e-5, use_cpu=True)
    args = TrainingArguments(**kwargs)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.bf16 and not args.fp16 and not args.activation_checkpointing and args.learning_rate == 2e-5
    assert not training_arguments(_plan("fp32"), output_dir=str(tmp_path))["bf16"]


def test_trainer_refuses_what_it_cannot_run(tmp_path):
    from transformers import TrainingArguments

    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.integrations.transformers import check_trainer_supported, training_arguments

    plan = _plan("fp16", tp=2, offload_optimizer=True)
    setup = SimpleNamespace(layout=plan.layout, train=plan.train, tensor_parallel=None)
    args = TrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True, save_strategy="steps",
                             per_device_train_batch_size=4, use_cpu=True)
    with pytest.raises(RuntimeConfigError) as refused:
        check_trainer_supported(setup, args)
    message = str(refused.value)
    for reason in ("tensor parallelism", "offload_optimizer", "fp16", "activation_checkpointing", "save_strategy",
                   "per_device_train_batch_size=4", "sp-plan train", "export --to deepspeed"):
        assert reason in message, (reason, message)
    fine = _plan("fp32")
    ok = SimpleNamespace(layout=fine.layout, train=fine.train, tensor_parallel=None)
    check_trainer_supported(ok, TrainingArguments(**training_arguments(fine, output_dir=str(tmp_path))))


def test_sft_trainer_refuses_trl_options_the_runtime_does_not_run(tmp_path):
    trl = pytest.importorskip("trl")
    from sp_plan.runtime.integrations.trl import unsupported_sft_reasons

    args = trl.SFTConfig(output_dir=str(tmp_path), loss_type="dft", activation_offloading=True, use_cpu=True)
    reasons = " ".join(unsupported_sft_reasons(args, {"peft_config": object()}))
    for option in ("loss_type='dft'", "activation_offloading", "peft_config"):
        assert option in reasons, (option, reasons)
    assert unsupported_sft_reasons(trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True), {}) == []


def test_trainer_refuses_an_iterable_dataset():
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.integrations.transformers import SequenceParallelTrainer

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": torch.arange(4)}

    with pytest.raises(RuntimeConfigError, match="map-style train_dataset"):
        SequenceParallelTrainer.get_train_dataloader(SimpleNamespace(train_dataset=Stream()))
