"""TRL's ``SFTTrainer`` running a model that :func:`sp_plan.runtime.auto.auto_configure` parallelised.

TRL keeps what it is for (tokenising ``text`` / ``messages`` / prompt-completion datasets, packing,
completion-only and assistant-only labels) and the runtime does what
:mod:`sp_plan.runtime.integrations.transformers` describes (no DDP wrap, data-parallel sampling, sharding,
the step's token-weighted loss)::

    setup = auto_configure(model, seq_len=4096, ...)
    args = SFTConfig(output_dir="out", **training_arguments(setup.plan, max_length=4096))
    trainer = SequenceParallelSFTTrainer(setup, args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()

``calibration_csv="runs.csv"`` records the run for ``sp-plan calibrate`` as in
:class:`~sp_plan.runtime.integrations.transformers.SequenceParallelMixin` (framework ``trl.SFTTrainer``).

The loss is the token-mean cross-entropy over the labels TRL's collator leaves (its ``loss_type="nll"``);
TRL's other losses, its activation offloading (plan ``offload_checkpoints`` instead), Liger kernels and
PEFT adapters (added after FSDP2 sharded the model, they would be neither sharded nor reduced) are
refused. TRL's per-token metrics (entropy, token accuracy) are not logged: they need the whole logits.
"""

from __future__ import annotations

from typing import Any

from trl import SFTTrainer

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.integrations.transformers import ALTERNATIVES, SequenceParallelMixin


def unsupported_sft_reasons(args, kwargs: dict[str, Any]) -> list[str]:
    """Why TRL's options ``args`` (an SFTConfig) and trainer keywords cannot run sequence-parallel."""
    reasons = []
    if getattr(args, "loss_type", "nll") != "nll":
        reasons.append(f"loss_type={args.loss_type!r}: the runtime's loss is the token-mean cross-entropy ('nll')")
    if getattr(args, "activation_offloading", False):
        reasons.append("activation_offloading: plan offload_checkpoints instead (fixed_options)")
    if getattr(args, "use_liger_kernel", False):
        reasons.append("use_liger_kernel: the runtime computes the loss (the plan's tiled_loss is its chunked one)")
    if kwargs.get("peft_config") is not None:
        reasons.append("peft_config: adapters added after FSDP2 sharded the model would be neither sharded nor reduced")
    return reasons


class SequenceParallelSFTTrainer(SequenceParallelMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` over an :class:`~sp_plan.runtime.auto.AutoConfigured` setup (see the module doc)."""

    def __init__(self, setup, args, **kwargs: Any) -> None:
        reasons = unsupported_sft_reasons(args, kwargs)
        if reasons:
            raise RuntimeConfigError("SequenceParallelSFTTrainer cannot run these options: " + "; ".join(reasons)
                                     + f". Otherwise {ALTERNATIVES}.")
        super().__init__(setup, args, **kwargs)
