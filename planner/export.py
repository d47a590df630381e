"""Turn a plan into the configs other launchers read: Accelerate, DeepSpeed, Megatron-LM, torchrun.

The DeepSpeed JSON and the Accelerate YAML are meant to run unmodified in their consumers
(``deepspeed.initialize``, transformers' Trainer, ``accelerate launch``; tests/test_export_deepspeed.py
and tests/test_export_accelerate.py run them on CPU ranks). Field names follow the tools' own sources
(accelerate 1.15 ``ClusterConfig`` / ``ParallelismConfig`` / ``DeepSpeedSequenceParallelConfig``;
DeepSpeed 0.19 ``zero_optimization``, ``sequence_parallel_size``, ``tensor_parallel.autotp_size``).
Where a tool cannot express part of the plan, export refuses with the field and what to do instead of
writing a config that silently runs something else; what only the training script can set (micro-batch
in Accelerate, gradient checkpointing, the ALST handle) is returned as a note for the user.
docs/exports.md lists what each target writes, leaves out and refuses.

A plan that fits under sp-plan's runtime may not fit under the stack another launcher runs, so the
configuration is re-estimated under that stack (:func:`check_under_stack`) and refused when it does not
fit there. The stack each target runs (:func:`target_stack`; ``--stack`` overrides):

- ``deepspeed``: ``hf-deepspeed`` (transformers + DeepSpeed ZeRO, Ulysses as in ALST);
- ``accelerate`` with ``sp`` (Ulysses; Accelerate's DeepSpeed ALST backend): ``hf-deepspeed``;
- ``megatron``: ``megatron-core`` (Megatron-LM's pretrain_gpt.py with Transformer Engine; the exporter is
  :mod:`sp_plan.planner.export_megatron`);
- ``accelerate`` otherwise (FSDP2, with ``cp`` = torch context parallel for ring plans): ``hf-fsdp2``,
  a transformers model (eager norms, logits kept) under FSDP2 + torch context parallel;
- ``torchrun``: sp-plan's own runtime, so the plan's own stack (no re-estimate unless ``--stack`` or
  ``--calibration`` asks for one).
"""

from __future__ import annotations

from typing import Any

from sp_plan.cost_models.train_spec import TrainSpec

from .errors import PlannerError
from .export_megatron import MEGATRON_STACK, is_megatron_stack, to_megatron
from .export_result import Export, one_line_shell_word, shell_word
from .plan import Plan

#: Port used in the generated rendezvous endpoint; any free port on the master node works.
DEFAULT_MASTER_PORT = 29500
#: What the torchrun command launches by default: the installed package's ``sp-plan train`` (a module, so
#: a plain ``pip install`` runs it; no file of the source tree is needed).
TRAIN_ENTRY_POINT = ("-m", "sp_plan.cli", "train")

_MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}

#: HF decoder-layer class to wrap per model family (FSDP's transformer-based auto wrap).
_DECODER_LAYER = {"qwen3": "Qwen3DecoderLayer", "qwen2": "Qwen2DecoderLayer", "mistral": "MistralDecoderLayer"}


def _decoder_layer_class(plan: Plan) -> str:
    name = plan.model.name.lower()
    for family, cls in _DECODER_LAYER.items():
        if name.startswith(family):
            return cls
    return "LlamaDecoderLayer"


def _data_parallel_world(plan: Plan) -> int:
    """Ranks that see different samples: everything that is neither TP nor SP."""
    return plan.layout.dp


# ----- Accelerate ---------------------------------------------------------------------------------

#: The attention DeepSpeed ALST wraps (Accelerate's sp; the DeepSpeed export's note): transformers' default,
#: needs no extra package (torch's SDPA runs flash kernels on GPUs); ALST refuses eager (an O(S^2) 4D mask).
ALST_ATTENTION = "sdpa"


#: Layout degrees each launcher expresses (Megatron's exporter keeps its own list). A plan using any other
#: degree (pipeline stages today) is refused rather than exported without it.
MAPPED_DEGREES: dict[str, frozenset[str]] = {
    "accelerate": frozenset({"dp_replicate", "dp_shard", "ring", "ulysses", "tp"}),
    "deepspeed": frozenset({"dp_replicate", "dp_shard", "ulysses", "tp"}),
    "torchrun": frozenset({"dp_replicate", "dp_shard", "ring", "ulysses", "tp", "pp", "ep"}),
}


def _refuse_unmapped_degrees(plan: Plan, target: str, who: str) -> None:
    """Refuse a degree above 1 (expert parallelism included) that the launcher's config cannot hold."""
    unmapped = {dim: d for dim, d in plan.layout.as_dict().items() if d > 1 and dim not in MAPPED_DEGREES[target]}
    if unmapped:
        pins = " ".join(f"--{dim.replace('_', '-')} 1" for dim in unmapped)
        raise PlannerError(f"{who} cannot run {', '.join(f'{k}={v}' for k, v in unmapped.items())} "
                           f"({plan.layout.describe()}): this export would drop it; re-plan with {pins}"
                           + (", or export --to megatron" if {"pp", "ep"} & set(unmapped) else ""))


def _refuse_prefill(plan: Plan, who: str) -> None:
    """Refuse a prefill plan for a launcher that trains: it was priced for a forward pass (no gradients, no
    optimizer states), so a training config built from it would silently run out of memory or mislead."""
    if plan.train.mode != "train":
        raise PlannerError(f"{who} trains, but this plan ({plan.layout.describe()}) is for {plan.train.mode}: a "
                           "forward pass priced without gradients or optimizer states; re-plan with --mode train "
                           "to train, or give its layout to your inference engine")


def _refuse_accelerate(plan: Plan) -> None:
    """Refuse the plans Accelerate cannot run as planned, naming the field and what to do instead."""
    layout = plan.layout
    if layout.ulysses > 1 and layout.ring > 1:
        raise PlannerError(
            f"Accelerate cannot express USP ({layout.describe()}): its sp (Ulysses) and cp (ring) sizes are "
            "mutually exclusive; export --to torchrun to run this plan with sp-plan's runtime"
        )
    if layout.ulysses > 1 and layout.tp > 1:
        raise PlannerError(
            f"Accelerate's DeepSpeed sequence parallelism does not combine with tensor parallelism ({layout.describe()}); "
            "export --to torchrun, or re-plan without tp"
        )
    if layout.ulysses == 1 and layout.ring == 1 and layout.dp_shard == 1 and layout.world > 1:
        raise PlannerError(
            f"layout.dp_shard=1 ({layout.describe() or 'no parallelism'}): Accelerate runs this plan under FSDP2, "
            "which needs dp_shard > 1 or cp > 1 to shard across (accelerate refuses the config: 'FSDP is enabled but "
            "the parallelism config has no dimension for FSDP to shard across'); export --to deepspeed (AutoTP) or "
            "--to torchrun, or re-plan with --tp below the GPU count"
        )
    if plan.train.offload_checkpoints and layout.ulysses > 1:
        raise PlannerError(
            "train.offload_checkpoints: Accelerate's DeepSpeed sequence parallelism has no checkpoint offload for "
            "transformers models (ALST's lives in ArcticTraining); re-plan with --no-offload-checkpoints, or "
            "export --to torchrun (sp-plan's runtime offloads them)"
        )


def _accelerate_script_notes(plan: Plan, deepspeed: bool) -> list[str]:
    """What the training script sets: Accelerate's YAML has no field for the micro-batch (the DataLoader's
    batch size), nor for gradient accumulation outside its DeepSpeed section."""
    train = plan.train
    notes = [f"micro-batch: build the training DataLoader with batch_size={train.micro_batch} per process "
             "(Accelerate's config has no micro-batch field)"]
    if not deepspeed:
        notes.append(f"gradient accumulation: create Accelerator(gradient_accumulation_steps={train.grad_accum}) "
                     "(or TrainingArguments(gradient_accumulation_steps=...)); Accelerate's FSDP config has no field "
                     "for it")
    if train.checkpointing != "none" and deepspeed:
        notes.append("activation checkpointing: call model.gradient_checkpointing_enable() (or "
                     "TrainingArguments(gradient_checkpointing=True)); Accelerate's DeepSpeed config has no switch "
                     "for transformers models")
    return notes


def to_accelerate(plan: Plan) -> Export:
    """An ``accelerate launch --config_file`` YAML (as a dict) for the plan.

    Ulysses maps to Accelerate's ``sp`` (DeepSpeed ALST backend), Ring to ``cp`` (torch context
    parallel with FSDP2). Accelerate treats the two as mutually exclusive and does not combine DeepSpeed
    SP with TP, so USP plans and Ulysses x TP plans are refused with the alternative; so are plans that
    leave FSDP2 nothing to shard across (``dp_shard`` = ``cp`` = 1, e.g. TP over every GPU) and Ulysses plans
    that offload checkpointed activations (no equivalent under its DeepSpeed backend). Under FSDP2 the
    offload is TRL's activation offloading, which keeps the activations (a note says how to switch it on).
    """
    _refuse_accelerate(plan)
    _refuse_unmapped_degrees(plan, "accelerate", "Accelerate")
    _refuse_prefill(plan, "Accelerate")
    layout, train, hw = plan.layout, plan.train, plan.hardware
    notes: list[str] = []
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _MIXED_PRECISION[train.dtype],
        "num_machines": hw.num_nodes,
        "num_processes": hw.num_gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if hw.num_nodes > 1:
        config["main_process_ip"] = "MASTER_ADDR"
        config["main_process_port"] = DEFAULT_MASTER_PORT
        notes.append("set main_process_ip to the first node's address and machine_rank on every node")
    parallelism: dict[str, Any] = {
        "parallelism_config_dp_replicate_size": layout.dp_replicate,
        "parallelism_config_dp_shard_size": layout.dp_shard,
        "parallelism_config_tp_size": layout.tp,
    }
    if layout.ulysses > 1:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "zero_stage": train.zero_stage,
            "offload_optimizer_device": "cpu" if train.offload_optimizer else "none",
            "offload_param_device": "cpu" if train.offload_params else "none",
            "gradient_accumulation_steps": train.grad_accum,
            "gradient_clipping": 1.0,
            "zero3_init_flag": train.zero_stage == 3,
        }
        if hw.num_nodes > 1:
            config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        # A fixed length: ALST uses sp_seq_length only when sp_seq_length_is_variable is false.
        parallelism.update(
            {
                "parallelism_config_sp_size": layout.ulysses,
                "parallelism_config_sp_backend": "deepspeed",
                "parallelism_config_sp_seq_length": train.seq_len,
                "parallelism_config_sp_seq_length_is_variable": False,
                "parallelism_config_sp_attn_implementation": ALST_ATTENTION,
            }
        )
        notes.append(
            f"every batch must hold exactly {train.seq_len} tokens per sequence (pack or pad to the planned length) "
            "and carry position_ids; for varying lengths set parallelism_config_sp_seq_length_is_variable: true"
        )
        notes.append(
            f"attention: load the model with attn_implementation=\"{ALST_ATTENTION}\" (ALST checks that it "
            "matches); \"flash_attention_2\" also works where flash-attn is installed"
        )
        if layout.dp_replicate > 1:
            notes.append(
                "DeepSpeed ZeRO shards over all data-parallel ranks; the plan's dp_replicate split (HSDP) is not "
                "reproduced, which uses less memory and more inter-node traffic than planned"
            )
    else:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": _decoder_layer_class(plan),
            "fsdp_reshard_after_forward": train.zero_stage == 3,
            "fsdp_offload_params": train.offload_params or train.offload_optimizer,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            # An offload that keeps the activations replaces checkpointing (hf-fsdp2 prices no recompute).
            "fsdp_activation_checkpointing": train.checkpointing != "none" and not train.offload_checkpoints,
        }
        if train.offload_checkpoints:
            notes.append(
                "activation offload: the plan keeps every saved activation in host memory instead of recomputing "
                "it (how the hf-fsdp2 stack prices offload_checkpoints), which Accelerate's config cannot switch "
                "on: use TRL's SFTConfig(activation_offloading=True, gradient_checkpointing=False), or run the "
                "forward and loss inside trl.models.get_act_offloading_ctx_manager(model); activation "
                "checkpointing stays off"
            )
        if layout.ring > 1:
            parallelism.update(
                {
                    "parallelism_config_cp_size": layout.ring,
                    "parallelism_config_cp_backend": "torch",
                    "parallelism_config_cp_comm_strategy": "allgather",
                }
            )
            notes.append(
                "torch context parallel shards only inside accelerator.maybe_context_parallel (parallelism_config_cp_size "
                "alone shards nothing): every step, pre-shift the labels on the full sequence (shift_labels = labels[:, "
                "1:] padded with -100 at the end), then wrap the forward and backward in `with accelerator."
                "maybe_context_parallel(buffers=[input_ids, shift_labels, position_ids], buffer_seq_dims=[1, 1, 1], "
                "no_restore_buffers={input_ids, shift_labels, position_ids}):` run outputs = model(input_ids=input_ids, "
                "position_ids=position_ids) and loss = model.loss_function(logits=outputs.logits, labels=None, "
                "shift_labels=shift_labels, vocab_size=model.config.vocab_size) (passing labels would shift the shard "
                "again); load the model with attn_implementation=\"sdpa\" and give no attention_mask (torch CP takes "
                "only causal SDPA, no padding or document mask: pack or pad instead); transformers' Trainer builds "
                "these buffers itself; each rank then holds "
                f"{train.seq_len // layout.ring} of the {train.seq_len} tokens ({train.seq_len} must divide by "
                f"2 x {layout.ring}); average the loss over the valid tokens of all cp ranks"
            )
            notes.append(
                "torch context parallel balances causal work with its own round-robin sharding, not sp-plan's zigzag; "
                "the communication volume is the same"
            )
        if train.zero_stage < 2:
            notes.append(f"FSDP2 has no ZeRO-{train.zero_stage} mode; ZeRO-2 behaviour (reshard_after_forward: false) is used")
        if train.offload_optimizer and not train.offload_params:
            notes.append("FSDP2's CPU offload moves parameters, gradients and optimizer states together")
        if train.checkpointing == "selective":
            notes.append("Accelerate's FSDP activation checkpointing is per block (full); selective is not expressible")
    notes += _accelerate_script_notes(plan, deepspeed=layout.ulysses > 1)
    if train.tiled_mlp or train.tiled_loss:
        notes.append(
            "tiled MLP / tiled loss are model-side features: enable them in your training code "
            "(sp-plan's runtime applies them automatically)"
        )
    config["parallelism_config"] = parallelism
    return Export(config, notes)


# ----- DeepSpeed ----------------------------------------------------------------------------------


def _refuse_deepspeed(plan: Plan) -> None:
    """Refuse the plans DeepSpeed cannot run as planned, naming the field and what to do instead."""
    layout, train = plan.layout, plan.train
    if layout.ring > 1:
        raise PlannerError(
            f"DeepSpeed has no ring attention ({layout.describe()}): export --to torchrun, or --to accelerate for "
            "pure ring (torch context parallel)"
        )
    if layout.ulysses > 1 and layout.tp > 1:
        raise PlannerError(
            f"DeepSpeed does not combine Ulysses sequence parallelism with AutoTP ({layout.describe()}): "
            "export --to torchrun, or re-plan without tp"
        )
    if train.offload_checkpoints:
        raise PlannerError(
            "train.offload_checkpoints: DeepSpeed offloads checkpointed activations (activation_checkpointing."
            "cpu_checkpointing) only for models that call deepspeed.checkpointing, not for transformers models; "
            "re-plan with --no-offload-checkpoints, or export --to torchrun (sp-plan's runtime offloads them)"
        )
    if train.optimizer == "adamw_bf16" and train.dtype == "bf16" and train.zero_stage == 0:
        raise PlannerError(
            "train.optimizer=adamw_bf16 with train.zero_stage=0: DeepSpeed keeps bf16 master weights and optimizer "
            "states (bf16_master_weights_and_grads) only under ZeRO stages 1-3; re-plan with --zero 1 or higher"
        )
    if train.offload_optimizer and train.zero_stage == 0:
        raise PlannerError(
            "train.offload_optimizer with train.zero_stage=0: DeepSpeed offloads optimizer state only under ZeRO "
            "stages 1-3; re-plan with --zero 1 or higher"
        )


def _bf16_section(train: TrainSpec) -> dict[str, Any]:
    """DeepSpeed's ``bf16`` block; ``adamw_bf16`` (no fp32 master, bf16 moments) is its bf16 master weights
    and optimizer states."""
    section: dict[str, Any] = {"enabled": train.dtype == "bf16"}
    if train.dtype == "bf16" and train.optimizer == "adamw_bf16":
        section.update({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})
    return section


def _deepspeed_usage_notes(plan: Plan) -> list[str]:
    """How to launch the JSON: the TrainingArguments that must match it and, for Ulysses, the ALST handle."""
    layout, train = plan.layout, plan.train
    dp = _data_parallel_world(plan)
    args = [f"per_device_train_batch_size={train.micro_batch}", f"gradient_accumulation_steps={train.grad_accum}"]
    if train.dtype in ("bf16", "fp16"):
        args.append(f"{train.dtype}=True")
    if train.checkpointing != "none":
        args.append("gradient_checkpointing=True")
    notes = [
        f"global batch: {train.micro_batch * train.grad_accum * dp} sequences of {train.seq_len} tokens per step "
        f"(micro-batch {train.micro_batch} x gradient accumulation {train.grad_accum} x {dp} data-parallel); "
        "train_batch_size is left for DeepSpeed to derive, because transformers' Trainer and DeepSpeed count the "
        "world differently under sequence and tensor parallelism",
        "transformers Trainer: TrainingArguments(" + ", ".join(args) + ", deepspeed=<this file>)",
    ]
    if layout.tp > 1:
        world = plan.hardware.num_gpus
        notes.append(
            f"AutoTP: all {layout.tp} TP ranks of a group must read identical rows (the same batch): shard the data "
            f"by data-parallel rank (rank // {layout.tp}, {dp} shards), not by global rank; DeepSpeed (without an "
            f"mpu) counts every TP rank as data-parallel and derives train_batch_size = {train.micro_batch} x "
            f"{train.grad_accum} x {world} = {train.micro_batch * train.grad_accum * world}, while the real global "
            f"batch is {train.micro_batch * train.grad_accum * dp} distinct sequences (do not add train_batch_size: "
            "DeepSpeed refuses any value but its own count)")
    if train.checkpointing != "none":
        notes.append("activation checkpointing is the model's: call model.gradient_checkpointing_enable() (the "
                     "Trainer does it for gradient_checkpointing=True); DeepSpeed's activation_checkpointing section "
                     "applies only to models that call deepspeed.checkpointing")
    if layout.ulysses > 1:
        handler = (f"sp_seq_length={train.seq_len}, sp_seq_length_is_variable=False, "
                   f"sp_attn_implementation=\"{ALST_ATTENTION}\"")
        notes.append(
            "Ulysses runs through DeepSpeed's ALST handle: mpu = UlyssesSPAttentionHF.register_with_transformers("
            f"model, core_attn_implementation=\"{ALST_ATTENTION}\", sequence_parallel_size={layout.ulysses}, "
            f"micro_batch_size={train.micro_batch}, seq_length={train.seq_len}, seq_length_is_variable=False), then "
            "deepspeed.initialize(..., mpu=mpu) and UlyssesSPDataLoaderAdapter, with position_ids in every batch; "
            "with the Trainer, TrainingArguments(parallelism_config=ParallelismConfig(sp_backend=\"deepspeed\", "
            f"sp_size={layout.ulysses}, sp_handler=DeepSpeedSequenceParallelConfig({handler}))). Without the handle "
            "DeepSpeed runs plain data parallelism (no sequence sharding)"
        )
    if train.offload_optimizer and "bf16_optimizer_states" in _bf16_section(train):
        notes.append(
            "adamw_bf16 with optimizer offload: DeepSpeed keeps offloaded bf16 moments only with "
            "deepspeed.ops.adam.DeepSpeedCPUAdam(params, fp32_optimizer_states=False) as the optimizer (it asserts "
            "otherwise, and transformers' Trainer cannot pass one: for the Trainer re-plan with --optimizer adamw)"
        )
    elif train.offload_optimizer:
        notes.append(
            "zero_force_ds_cpu_optimizer: false lets the offloaded optimizer be any torch optimizer; for speed pass "
            "deepspeed.ops.adam.DeepSpeedCPUAdam (or delete the key: Accelerate/Trainer then swap it in themselves)"
        )
    return notes


def to_deepspeed(plan: Plan) -> Export:
    """A DeepSpeed JSON config (as a dict): ZeRO stage, offload, Ulysses degree, AutoTP, precision.

    Written to run unmodified both through ``deepspeed.initialize`` and through transformers' Trainer
    (``TrainingArguments(deepspeed=...)``): ``train_batch_size`` is left out (each derives it from its own
    data-parallel world, and the Trainer's differs from DeepSpeed's under SP and TP), the Ulysses degree
    is given without ``data_parallel_size`` (which would make DeepSpeed build a data x sequence mesh and
    shard ZeRO over the data-parallel ranks only), there is no ``activation_checkpointing`` section
    (transformers models checkpoint with torch, not deepspeed.checkpointing) and no MiCS (removed from
    DeepSpeed). What the JSON cannot say is returned as notes (:func:`_deepspeed_usage_notes`).
    """
    _refuse_deepspeed(plan)
    _refuse_unmapped_degrees(plan, "deepspeed", "DeepSpeed (with transformers)")
    _refuse_prefill(plan, "a DeepSpeed config")
    layout, train = plan.layout, plan.train
    notes: list[str] = []
    zero: dict[str, Any] = {
        "stage": train.zero_stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    if train.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if train.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if layout.dp_replicate > 1:
        notes.append(
            "ZeRO shards over all data-parallel ranks (DeepSpeed has no hybrid sharding since MiCS was removed); the "
            "plan's dp_replicate split is not reproduced, which uses less memory and more inter-node traffic than "
            "planned"
        )
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": _bf16_section(train),
        "fp16": {"enabled": train.dtype == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if train.offload_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False
    if layout.ulysses > 1:
        config["sequence_parallel_size"] = layout.ulysses
        config["seq_parallel_communication_data_type"] = "fp16" if train.dtype == "fp16" else "bf16"
    if layout.tp > 1:
        config["tensor_parallel"] = {"autotp_size": layout.tp}
    notes += _deepspeed_usage_notes(plan)
    if train.checkpointing == "selective":
        notes.append("DeepSpeed checkpoints whole blocks; selective checkpointing needs model-side support")
    if train.tiled_mlp or train.tiled_loss:
        notes.append("tiled MLP / tiled loss: use DeepSpeed ALST's TiledMLP and a fused/tiled loss in the model code")
    return Export(config, notes)


# ----- torchrun -----------------------------------------------------------------------------------


def _needs_model_config(plan: Plan) -> str | None:
    """Why ``sp-plan train --plan`` alone cannot build the plan's model (it rebuilds a dense Llama/Qwen from
    the plan's sizes), or None: experts and latent attention live only in the config.json."""
    if plan.model.moe is not None:
        return "mixture-of-experts"
    if plan.model.mla is not None:
        return "multi-head latent attention"
    return None


def to_torchrun(plan: Plan, plan_path: str = "plan.yaml", script: str | None = None,
                model_config: str | None = None) -> Export:
    """The torchrun command line that runs the plan with sp-plan's own runtime: ``-m sp_plan.cli train
    --plan PLAN`` (:data:`TRAIN_ENTRY_POINT`), or ``script`` when given (a training script of the user's
    that takes ``--plan``); ``--model CONFIG.JSON`` when ``model_config`` is given, which a plan whose model
    the runtime cannot rebuild from its sizes (MoE, MLA) requires. The caller checks that the file is the
    plan's model (:meth:`ModelSpec.architecture_differences`)."""
    _refuse_unmapped_degrees(plan, "torchrun", "sp-plan's runtime")
    _refuse_prefill(plan, "sp-plan's runtime (sp-plan train)")
    needs = _needs_model_config(plan)
    if needs and model_config is None and script is None:
        raise PlannerError(
            f"{plan.model.name} has {needs} blocks, which `sp-plan train --plan` cannot rebuild from the plan's "
            "sizes (it would train a dense model, or refuse the layout): give the config.json the plan was made "
            f"from: sp-plan export {plan_path} --to torchrun --model CONFIG.JSON"
        )
    hw = plan.hardware
    procs = min(hw.gpus_per_node, hw.num_gpus)
    args = ["torchrun"]
    if hw.num_nodes == 1:
        args += ["--standalone", f"--nproc-per-node={procs}"]
    else:
        args += [
            f"--nnodes={hw.num_nodes}",
            f"--nproc-per-node={procs}",
            "--node-rank=$NODE_RANK",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=$MASTER_ADDR:{DEFAULT_MASTER_PORT}",
        ]
    args += [script] if script else list(TRAIN_ENTRY_POINT)
    args += ["--plan", plan_path]
    if model_config is not None:
        args += ["--model", model_config]
    # Only the two fixed rendezvous words are left for the shell to expand; the paths and the script are
    # one quoted word each, whatever they hold (a NUL byte, which no argument can carry, is refused).
    expanded = {"--node-rank=$NODE_RANK", f"--rdzv-endpoint=$MASTER_ADDR:{DEFAULT_MASTER_PORT}"}
    command = " ".join(a if a in expanded else shell_word(a, "torchrun argument") for a in args)
    notes = []
    if hw.num_nodes > 1:
        notes.append("run the same command on every node with NODE_RANK=0..N-1 and MASTER_ADDR=<first node>")
    return Export(command, notes)


EXPORTERS = {"accelerate": to_accelerate, "deepspeed": to_deepspeed, "megatron": to_megatron, "torchrun": to_torchrun}


# ----- the stack that runs the export ----------------------------------------------------------------


def target_stack(plan: Plan, target: str) -> str:
    """The stack a launcher runs the plan with (see the module docstring)."""
    if target == "deepspeed":
        return "hf-deepspeed"
    if target == "megatron":
        return plan.stack if is_megatron_stack(plan.stack) else MEGATRON_STACK
    if target == "accelerate":
        return "hf-deepspeed" if plan.layout.ulysses > 1 else "hf-fsdp2"
    return plan.stack


def _plan_topology(plan: Plan):
    """The plan's cluster: its topology preset or file, else (a file from another machine) the natural
    machine of its GPU; None when neither can be built here."""
    from sp_plan.cost_models.errors import CostModelError
    from sp_plan.cost_models.topology import default_topology, load_topology

    hw = plan.hardware
    try:
        return load_topology(hw.topology, hw.num_gpus, hw.gpus_per_node)
    except CostModelError:
        pass
    try:
        return default_topology(hw.gpu, hw.num_gpus, hw.gpus_per_node)
    except CostModelError:
        return None


def replan_command(plan: Plan, target: str, stack: str) -> str:
    """The ``sp-plan plan`` command that plans the same run under ``stack``, kept within what ``target``
    can express (DeepSpeed has no ring; Accelerate's DeepSpeed path no ring, its FSDP path no Ulysses)."""
    train, hw = plan.train, plan.hardware
    args = ["sp-plan", "plan", "--model", plan.model.name, "--seq-len", str(train.seq_len), "--gpus", str(hw.num_gpus)]
    if hw.topology:
        args += ["--topology", hw.topology]
    else:
        args += ["--gpu", hw.gpu, "--gpus-per-node", str(hw.gpus_per_node)]
    if train.mode != "train":
        args += ["--mode", train.mode]
    if train.dtype != "bf16":
        args += ["--dtype", train.dtype]
    if train.optimizer != "adamw":
        args += ["--optimizer", train.optimizer]
    if target == "deepspeed" or (target == "accelerate" and stack == "hf-deepspeed"):
        args += ["--ring", "1"]
    elif target == "accelerate":
        args += ["--ulysses", "1"]
    args += ["--stack", stack, "--out", "plan.yaml"]
    return " ".join(one_line_shell_word(a, "model name") for a in args)


def check_under_stack(plan: Plan, target: str, stack: str | None = None, calibration: str | None = None) -> list[str]:
    """Re-estimate the plan's configuration under the stack ``target`` runs (``stack`` overrides it).

    Raises :class:`PlannerError` with the numbers and the command that re-plans under that stack when
    the configuration does not fit there (device memory beyond capacity minus the planner's default
    headroom, or offloaded state beyond the host RAM); otherwise returns a note with the predicted
    memory. ``calibration``: a calibration file for the target stack; without one, the plan's own
    calibration is used only when the target stack is the plan's own.
    """
    from sp_plan.cost_models.estimate import estimate
    from sp_plan.cost_models.profile import resolve_profile

    from .search import DEFAULT_HEADROOM

    ref = stack or target_stack(plan, target)
    if calibration is None and ref == plan.stack and plan.calibration:
        calibration = plan.calibration
    topology = _plan_topology(plan)
    if topology is None:  # a probed topology file that is not on this machine, for a GPU without a preset
        return [f"not re-checked under the {ref} stack: topology {plan.hardware.topology!r} cannot be loaded here "
                "and its GPU has no preset; run the export where the topology file is"]
    profile = resolve_profile(topology.gpu.name, ref, calibration, plan.assume or None)
    est = estimate(plan.model, plan.train, plan.layout, topology, with_placement=False, profile=profile)
    total, capacity = est.memory.total, est.memory.capacity
    usable = capacity * (1.0 - DEFAULT_HEADROOM)
    host, host_ram = est.host_memory.total, est.detail.host_capacity
    under = f"under the {profile.name} stack" + (f" (what {target} runs)" if stack is None else "")
    if total > usable or host > host_ram:
        if total > usable:
            numbers = (f"needs {total / 1e9:.1f} GB per GPU, over the {usable / 1e9:.1f} GB usable "
                       f"({capacity / 1e9:.1f} GB capacity minus {DEFAULT_HEADROOM:.0%} headroom)")
        else:
            numbers = (f"offloads {host / 1e9:.1f} GB per GPU to host memory, over the host RAM available to "
                       f"offloads ({host_ram / 1e9:.1f} GB per GPU)")
        planned = plan.estimate.get("memory", {}).get("total")
        was = (f" (planned under {plan.stack}: {planned / 1e9:.1f} GB)" if planned and ref != plan.stack else "")
        raise PlannerError(
            f"{under} this plan ({plan.layout.describe()}) {numbers}{was}; re-plan for that stack: "
            f"{replan_command(plan, target, ref)}")
    note = (f"{under} this plan is predicted to need {total / 1e9:.1f} GB per GPU of {usable / 1e9:.1f} GB usable "
            f"({capacity / 1e9:.1f} GB capacity minus {DEFAULT_HEADROOM:.0%} headroom)")
    if host:
        note += f", and {host / 1e9:.1f} GB of host memory per GPU of {host_ram / 1e9:.1f} GB available to offloads"
    return [note]
