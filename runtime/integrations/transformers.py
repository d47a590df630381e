"""transformers' ``Trainer`` running a model that :func:`sp_plan.runtime.auto.auto_configure` parallelised.

A plain ``Trainer(model=setup.model, ...)`` cannot train such a model: Accelerate wraps the FSDP2-sharded
model in DDP ("got mixed torch.Tensor and DTensor"), its data loader gives every rank different samples
(sequence-parallel ranks must share theirs), and the model's loss averages each rank's slice of a sequence.
:class:`SequenceParallelTrainer` keeps the Trainer's loop (optimizer, scheduler, callbacks, logging) and
swaps the three parts that must be the runtime's (the overrides are :class:`SequenceParallelMixin`, which
also fits Trainer subclasses: :mod:`sp_plan.runtime.integrations.trl` puts it on TRL's ``SFTTrainer``)::

    setup = auto_configure(model, seq_len=4096, ...)              # plan, mesh, SP attention, FSDP2
    args = TrainingArguments(output_dir="out", **training_arguments(setup.plan, learning_rate=2e-5))
    trainer = SequenceParallelTrainer(setup, args, train_dataset=dataset)
    trainer.train()

1. **the model is not wrapped**: FSDP2 (applied by ``auto_configure``) already reduces the gradients over
   the data group, so Accelerate is told the model is prepared and wraps nothing (the optimizer and
   scheduler are still Accelerate's); the model stays where the runtime placed it;
2. **the data**: one sample stream per data-parallel rank (:meth:`AutoConfigured.sampler`: the ranks of one
   sequence-parallel group read the same rows), and each step's micro-batches pre-shifted, padded and
   sharded by the runtime's :class:`~sp_plan.runtime.data.BatchSharder` (:meth:`get_batch_samples`);
   packed, padding-free rows (TRL's ``packing=True``) are trained as documents: their ``position_ids``
   restarts become document boundaries (no label crosses one, attention is document-masked), and the
   flash-attention varlen keys that restate them are checked against them and dropped (:func:`runtime_batch`);
3. **the loss**: the step's token-weighted loss (:mod:`sp_plan.runtime.loss`, through
   :meth:`AutoConfigured.compute_loss`, so the plan's tiled loss too), normalised by the step's global
   valid-token count, with the plan's ZeRO-stage gradient sync per micro-batch, as
   :func:`sp_plan.runtime.step.train_step` does: the same numbers as ``sp-plan train`` on the same data.

What the Trainer cannot do with such a model is refused when the trainer is built
(:func:`unsupported_trainer_reasons`), each with what to use instead: tensor parallelism and the host
optimizer offload (the Trainer builds a plain optimizer and clips without the TP gradient sync),
fp16 (the Trainer's loss scaler does not know the sharded gradients), the Trainer's own gradient
checkpointing (the plan's is already applied), and checkpoint saving and evaluation (sharded states, SP
forward): use ``sp-plan train`` for those, or ``sp-plan export --to deepspeed`` for a Trainer-native run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from sp_plan.runtime.auto import AutoConfigured
from sp_plan.runtime.data import DOCUMENTS_KEY
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.loss import LossOutput, global_token_count
from sp_plan.runtime.step import set_micro_batch_flags

#: What to use instead, in every refusal.
ALTERNATIVES = ("use `sp-plan train` (the runtime's own loop), or `sp-plan export --to deepspeed` for a run the "
                "Trainer drives natively")


# ----- plan -> TrainingArguments -----------------------------------------------------------------------


def training_arguments(plan, **overrides: Any) -> dict[str, Any]:
    """``TrainingArguments`` keyword arguments that make the Trainer's step the plan's step.

    Per-device batch = the plan's micro-batch and gradient accumulation = its ``grad_accum``, so a step is
    ``micro_batch x grad_accum x dp`` sequences, as planned (the Trainer's own ``world_size`` counts the
    sequence-parallel ranks too; its printed "total batch size" overcounts by the SP degree, the data does
    not). ``bf16`` as the plan's dtype says (FSDP2's mixed precision does the casting; the flag keeps
    Accelerate's state truthful). The Trainer's activation (gradient) checkpointing is set off:
    ``auto_configure`` already applied the plan's checkpointing per block, and the Trainer's would checkpoint
    twice. Checkpoint saving and
    evaluation are off (see the module doc). ``overrides`` (learning rate, max_steps, output_dir, ...) win.
    """
    train = plan.train
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "bf16": train.dtype == "bf16",
        "fp16": False,
        _checkpointing_field(): False,
        "save_strategy": "no",
        "eval_strategy": "no",
    }
    kwargs.update(overrides)
    return kwargs


def _checkpointing_field() -> str:
    """The TrainingArguments field of the Trainer's own checkpointing: ``activation_checkpointing`` (transformers
    5) or ``gradient_checkpointing`` (older). Set explicitly: TRL's SFTConfig defaults it to True."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


# ----- what the Trainer cannot run ---------------------------------------------------------------------


def unsupported_trainer_reasons(setup: AutoConfigured, args) -> list[str]:
    """Why ``setup`` and ``args`` cannot train under :class:`SequenceParallelTrainer` (empty: they can)."""
    train, reasons = setup.train, []
    if setup.layout.tp > 1 or setup.tensor_parallel is not None:
        reasons.append(f"tensor parallelism (tp={setup.layout.tp}): the Trainer clips and steps without the TP "
                       "replicated-gradient all-reduce; plan without TP (fixed_layout={'tp': 1})")
    if train.offload_optimizer and not train.offload_params:
        reasons.append("offload_optimizer: the Trainer builds its own optimizer, not the runtime's host-offload one; "
                       "plan with fixed_options={'offload_optimizer': False}")
    if train.dtype == "fp16" or args.fp16:
        reasons.append("fp16: the Trainer's loss scaler does not unscale FSDP2-sharded gradients; plan bf16 or fp32")
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        reasons.append(f"activation_checkpointing (gradient_checkpointing)=True: the plan's checkpointing ({train.checkpointing!r}) is already "
                       "applied per block; leave the Trainer's off (training_arguments does)")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
        reasons.append("save_strategy: Trainer checkpoints would hold one rank's shards of the FSDP2 weights and "
                       "optimizer; pass save_strategy='no' and save with trainer.save_model() at the end")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        reasons.append("eval_strategy: evaluation is not sequence-parallel under the Trainer; pass eval_strategy='no'")
    if setup.train.micro_batch != args.per_device_train_batch_size:
        reasons.append(f"per_device_train_batch_size={args.per_device_train_batch_size} but the plan's micro-batch is "
                       f"{train.micro_batch} (its memory was planned for that): use training_arguments(plan)")
    return reasons


def check_trainer_supported(setup: AutoConfigured, args) -> None:
    """Raise :class:`RuntimeConfigError` naming every reason the Trainer cannot run this setup."""
    reasons = unsupported_trainer_reasons(setup, args)
    if reasons:
        raise RuntimeConfigError("SequenceParallelTrainer cannot run this plan and arguments: " + "; ".join(reasons)
                                 + f". Otherwise {ALTERNATIVES}.")


# ----- the data loader ---------------------------------------------------------------------------------

#: Keys padding-free collators (TRL's ``padding_free``/``packing=True``, transformers'
#: ``DataCollatorWithFlattening``) add for flash-attention's varlen kernel. They restate the document
#: boundaries the ``position_ids`` restarts already mark, which the runtime shards and attends by.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def runtime_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` without the varlen keys of a padding-free collator, after checking they say what its
    ``position_ids`` say (a row of documents, each restarting at position 0). A batch whose boundaries
    are only in those keys (no ``position_ids``), or that disagree, is refused: the runtime would
    attend across documents."""
    present = [k for k in VARLEN_KEYS if k in batch]
    if not present:
        return batch
    positions = batch.get("position_ids")
    if positions is None:
        raise RuntimeConfigError(
            f"the batch marks documents with {', '.join(present)} but has no position_ids: the sequence-parallel "
            "path finds document boundaries from position_ids restarting at 0; use a collator that returns them "
            "(TRL's padding_free/packing does)")
    cu = batch.get("cu_seq_lens_q", batch.get("cu_seq_lens_k"))
    if cu is not None:
        flat = positions.reshape(-1)
        starts = torch.nonzero(flat == 0).reshape(-1).to(torch.int64)
        implied = torch.cat([starts, torch.tensor([flat.numel()])])
        if not torch.equal(implied.cpu(), cu.reshape(-1).to(torch.int64).cpu()):
            raise RuntimeConfigError(
                f"the batch's cu_seq_lens ({cu.reshape(-1).tolist()}) disagree with the document starts its "
                f"position_ids imply ({implied.tolist()}): the runtime attends by position_ids; fix the collator")
    return {k: v for k, v in batch.items() if k not in VARLEN_KEYS}



class DataParallelLoader(DataLoader):
    """A DataLoader over a data-parallel sampler whose ``set_epoch`` (called by the Trainer each epoch)
    reaches the sampler, so every epoch reshuffles the same way on the ranks that share samples."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


@dataclass
class _StepTokens:
    """The optimizer step being run: its global valid-token count, micro-batch count, and progress."""

    tokens: int
    micro_batches: int
    done: int = 0
    weighted_loss: float = 0.0


# ----- the trainer -------------------------------------------------------------------------------------


class SequenceParallelMixin:
    """The overrides that make a ``transformers.Trainer`` (or a subclass of it, such as TRL's ``SFTTrainer``)
    train an :class:`~sp_plan.runtime.auto.AutoConfigured` setup (see the module doc). Put it first in the
    bases: ``class MyTrainer(SequenceParallelMixin, Trainer)``.

    ``setup``: what ``auto_configure`` returned (its model is the one trained); the other arguments are the
    Trainer's. ``step_losses`` collects each optimizer step's exact global token-mean loss (the Trainer's
    log rounds to 4 digits). ``calibration_csv``: also record the run for ``sp-plan calibrate`` (adds a
    :class:`~sp_plan.runtime.integrations.calibration_callback.CalibrationCallback`, kept as ``self.calibration``;
    ``calibration_topology``: the topology file the plan was made on, when it is no shipped preset and was
    not probed); an unwritable path or a plan no row describes is refused here, on every rank.
    """

    #: compute_loss returns the step-normalised loss: the Trainer must not divide by the accumulation steps.
    loss_is_scaled_for_ga = True

    def __init__(self, setup: AutoConfigured, args, *, calibration_csv: str | os.PathLike | None = None,
                 calibration_topology: Any = None, **kwargs: Any) -> None:
        if "model" in kwargs:
            raise RuntimeConfigError("SequenceParallelTrainer trains setup.model; do not pass model=")
        check_trainer_supported(setup, args)
        self.calibration = None
        if calibration_csv is not None:  # before the Trainer is built: a bad path is refused first
            from sp_plan.runtime.integrations.calibration_callback import CalibrationCallback, trainer_framework

            self.calibration = CalibrationCallback(calibration_csv, setup, topology=calibration_topology,
                                                   framework=trainer_framework(self))
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.calibration]
        self.setup = setup
        self.step_losses: list[float] = []
        self._step: _StepTokens | None = None
        # FSDP2 already reduces gradients over the data group: Accelerate must neither wrap it in DDP nor move it.
        setup.model._is_accelerate_prepared = True
        super().__init__(model=setup.model, args=args, **kwargs)

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """The runtime placed the model (FSDP2 shards, possibly offloaded to the host): leave it there."""

    # -- data ---------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """Full-sequence batches of this data-parallel rank's samples (SP ranks of one group read the same)."""
        if self.train_dataset is None:
            raise RuntimeConfigError("SequenceParallelTrainer.train needs a train_dataset")
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise RuntimeConfigError(
                "SequenceParallelTrainer needs a map-style train_dataset (len and indexing): the data-parallel sampler "
                "gives the ranks of one sequence-parallel group the same rows; materialise or index the iterable one")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:  # datasets is optional; without it there are no column-based datasets to prune
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return DataParallelLoader(
            dataset, batch_size=self._train_batch_size, collate_fn=collator,
            sampler=self.setup.sampler(dataset, shuffle=True, seed=seed, drop_last=True),
            drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and self.setup.device.type == "cuda",
        )

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list[dict[str, torch.Tensor]], int]:
        """One step's micro-batches, as this rank's shards, and the step's global valid-token count (the
        ``num_items_in_batch`` every micro-batch's loss is divided by)."""
        shards = []
        for _ in range(num_batches):
            try:
                shards.append(self.setup.shard(runtime_batch(next(epoch_iterator))))
            except StopIteration:
                break
        tokens = global_token_count((s["labels"] for s in shards), self.setup.data_group, self.setup.device)
        self._step = _StepTokens(tokens=tokens, micro_batches=len(shards))
        return shards, tokens

    # -- loss -----------------------------------------------------------------------------------------------
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        """The runtime's loss of one sharded micro-batch, with the plan's ZeRO-stage sync for its place in the
        step. The returned tensor back-propagates this rank's ``local token-loss sum / step tokens`` and has
        the value of the micro-batch's share of the step's GLOBAL loss, so what the Trainer logs (summed
        over micro-batches, averaged over ranks) is the step's token-mean loss."""
        step = self._step
        if step is None:
            raise RuntimeConfigError("SequenceParallelTrainer.compute_loss runs inside train() only (see evaluate)")
        shard = dict(inputs)
        if shard.get(DOCUMENTS_KEY) is not None:  # the attention reads the document boundaries on the host
            shard[DOCUMENTS_KEY] = shard[DOCUMENTS_KEY].to("cpu", torch.int32)
        last = step.done == step.micro_batches - 1
        set_micro_batch_flags(self.setup, last=last)
        out: LossOutput = self.setup.compute_loss(shard, num_items=step.tokens)
        share = out.value * out.global_tokens / max(step.tokens, 1)
        step.done += 1
        step.weighted_loss += share
        if last:
            self.step_losses.append(step.weighted_loss)
        loss = out.loss + (share - out.loss.detach())  # value: the global share; gradient: this rank's
        return (loss, None) if return_outputs else loss

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """The runtime's clipping: the global norm over the FSDP shards, the same on every rank."""
        return torch.tensor(self.setup.clip_grad_norm_(self.args.max_grad_norm))

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None) -> float:
        """The global gradient norm (the clipped one when clipping ran) as a float, for the Trainer's log."""
        if grad_norm is None:
            return self.setup.grad_norm()
        return float(grad_norm)

    # -- what is refused --------------------------------------------------------------------------------------
    def evaluate(self, *args: Any, **kwargs: Any):
        raise RuntimeConfigError(
            "SequenceParallelTrainer does not evaluate: the Trainer's evaluation loop would run the sequence-parallel "
            "model on unsharded batches; compute validation losses with setup.compute_loss(setup.shard(batch)) under "
            f"torch.no_grad(), or {ALTERNATIVES}")

    def predict(self, *args: Any, **kwargs: Any):
        raise RuntimeConfigError(
            "SequenceParallelTrainer does not predict: generation and prediction need the unsharded model; save it "
            "(trainer.save_model) and load it without sp-plan")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Gather the full weights over the FSDP shards (every rank takes part) and save them, on global rank
        0, as the unparallelised model's ``save_pretrained`` checkpoint (loadable without sp-plan)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = {name: tensor.cpu() for name, tensor in self.setup.full_state_dict().items()}
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            self.setup.model.save_pretrained(output_dir, state_dict=state)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """``transformers.Trainer`` over an :class:`~sp_plan.runtime.auto.AutoConfigured` setup (see the module doc)."""
