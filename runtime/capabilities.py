"""What the runtime can execute, in ONE place: every plan option is either run or refused with a reason.

:func:`auto_configure <sp_plan.runtime.auto.auto_configure>` refuses a plan for which
:func:`unsupported_reasons` returns anything, and asks the planner only for plans it can run
(:func:`planner_constraints`), so a plan the runtime cannot execute is never silently approximated.

What runs depends on the model family, and each family's
:class:`~sp_plan.runtime.models.base.ModelAdapter` says what it cannot do (``unsupported_options``,
``unsupported_degrees``, with reasons) and how its code spends memory (``memory_assumptions``). The
runtime's own :class:`sp_plan.runtime.models.LlamaModel` (family ``"llama"``) executes every option
``sp-plan plan`` can output for training (tensor parallelism, tiled MLP and loss,
checkpoint/optimizer/parameter offload, ZeRO-1/2/3, every checkpointing mode); a Hugging Face
transformers model (``"hf"``) is driven through transformers' attention registry,
checkpointing hooks, its own MLP forward (run tiled) and the runtime's TP shards of its projections
(the families name them like the runtime's Llama; forward pre-hooks open the TP regions), so it runs
every option too, except on mixture-of-experts models (a ModelSpec with ``moe``): no tensor parallelism
and no tiled MLP there; and on MLA models (``mla``: DeepSeek-V2/V3, trained under Ulysses, Ring, USP and
FSDP2): no tensor parallelism. Expert parallelism (``Layout.ep``) runs for HF Qwen3-MoE and Mixtral when pinned
(the planner is otherwise held to ep 1), not with pipeline stages, HSDP or offloaded parameters/optimizer.
Plans the runtime never executes: ``prefill`` (for inference engines), the materialised-attention
kernel, and ZeRO-0 (plain DDP), which the planner does not recommend for training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sp_plan.cost_models import degrees
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory import MemoryAssumptions
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.base import ModelAdapter, adapter_named

#: A model family: its :class:`sp_plan.runtime.models.base.ModelAdapter`, or the name it is registered under.
Family = ModelAdapter | str


def memory_assumptions(family: Family = "llama") -> MemoryAssumptions:
    """The :class:`sp_plan.cost_models.memory.MemoryAssumptions` the planner uses for a model of ``family``
    (its adapter's ``memory_assumptions``: how the family's code spends activation memory, so plans for
    it are made with its real footprint)."""
    return MemoryAssumptions(**adapter_named(family).memory_assumptions)


#: ZeRO stages auto_configure runs, all with FSDP2 (see sp_plan.runtime.auto for how each is reproduced).
SUPPORTED_ZERO_STAGES: tuple[int, ...] = (1, 2, 3)

#: TrainSpec values the runtime executes, per option with a closed set of values.
SUPPORTED_VALUES: dict[str, tuple[Any, ...]] = {
    "mode": ("train",),
    "attention_kernel": ("flash",),
    "checkpointing": ("none", "selective", "full"),
}
_VALUE_REASONS: dict[str, str] = {
    "mode": "auto_configure sets up training; prefill plans are for inference engines",
    "attention_kernel": "the runtime's sequence-parallel attention is always the fused (flash-style) kernel with "
                        "its LSE; re-plan with --attention flash",
}


_TP_DROPOUT = ("the model uses dropout, which under tensor parallelism needs per-region RNG streams (Megatron's "
               "RNG tracker) the runtime does not implement; set hidden_dropout and attention_dropout to 0, or "
               "re-plan with --tp 1")


#: Layout degrees that change what a rank computes and that the runtime implements (TP shards, Ulysses and
#: ring attention, pipeline stages). Any other degree runs only if it is pure data parallelism (roles ``data`` and
#: ``shards_state``: the mesh, the sampler and FSDP2 take those from the registry).
EXECUTED_MODEL_DEGREES = frozenset({"tp", "ulysses", "ring", "pp"})
_DATA_ROLES = frozenset({"data", "shards_state"})

#: Pipeline parallelism (sp_plan.runtime.pipeline) runs stages of these families with these schedules, composed
#: with TP, Ulysses, ring and FSDP2; what it does not run yet, with the reason.
PIPELINE_FAMILIES = frozenset({"llama", "hf"})
PIPELINE_SCHEDULES = frozenset({"1f1b", "interleaved_1f1b", "zero_bubble"})
#: Families whose stage modules are the FSDP2 parts themselves (sp_plan.runtime.pipeline.PLAIN_FORWARD_FAMILIES),
#: the only ones the zero-bubble schedule's split backward is tested on.
ZERO_BUBBLE_FAMILIES = frozenset({"llama"})
_PIPELINE_SCHEDULE_REASON = ("the runtime wires torch's Schedule1F1B, ScheduleInterleaved1F1B and "
                             "ScheduleInterleavedZeroBubble only")
#: The zero-bubble schedule splits each backward into an input-gradient and a later weight-gradient pass.
_ZERO_BUBBLE_REASONS: dict[str, tuple[Any, str]] = {
    "checkpointing": ("selective", ("selective activation checkpointing allows one backward per region and the "
                                    "split backward runs two; re-plan with --checkpointing full or none, or "
                                    "--schedule 1f1b")),
}
_PIPELINE_OPTIONS: dict[str, str] = {
    "offload_checkpoints": "checkpoint offload under pipeline stages keeps one host buffer per micro-batch in flight, "
                           "which is not implemented",
}


def runtime_unexecuted_degrees() -> dict[str, str]:
    """Registered degrees the runtime cannot execute, with the reason (planning-only degrees)."""
    return {name: (f"this runtime has no implementation of the {name} degree (registered for planning only); "
                   f"re-plan with {d.flag} 1")
            for name, d in degrees.registered().items()
            if name not in EXECUTED_MODEL_DEGREES and not d.roles <= _DATA_ROLES}


_MOE_TP = ("tensor parallelism does not split mixture-of-experts blocks (the experts would be replicated and the "
           "MoE output summed tp times); re-plan with --tp 1")
_MOE_TILED_MLP = "the tiled MLP does not run mixture-of-experts blocks (a router picks experts per token)"
_MLA_TP = ("tensor parallelism does not split multi-head latent attention (q, k and v come from low-rank latents "
           "shared by all heads; the runtime's TP plan cuts q/k/v projections only); re-plan with --tp 1")


#: Families whose MoE experts the runtime splits over ``ep`` ranks (sp_plan.runtime.expert_parallel: token dispatch
#: and combine all-to-alls, experts sharded by FSDP2 over the expert data group), exact against one process for
#: HF Qwen3-MoE and Mixtral (tests/test_ep_runtime.py).
EXPERT_PARALLEL_FAMILIES = frozenset({"hf"})
#: What expert parallelism does not run with yet (besides ``tp``, refused for every MoE model), with the reason.
_EP_DEGREES: dict[str, str] = {
    "pp": "expert parallelism inside pipeline stages is not implemented (each stage would need its own ep group "
          "and dispatch per micro-batch); re-plan with --pp 1 or --ep 1",
    "dp_replicate": "expert parallelism with HSDP (replicas of the shard group) is not implemented: the experts "
                    "would need their own replicate dim; re-plan with --dp-replicate 1 or --ep 1",
}
_EP_OPTIONS: dict[str, str] = {
    "offload_params": "expert parallelism with parameter offload is not tested (FSDP2 would keep the ep-split "
                      "experts on the host); re-plan without --offload-params or with --ep 1",
    "offload_optimizer": "expert parallelism with the host optimizer (ZeRO-Offload) is not tested; re-plan without "
                         "--offload-optimizer or with --ep 1",
}


def _no_expert_parallel(family: str) -> str:
    return (f"this runtime splits experts over ep ranks for the {', '.join(sorted(EXPERT_PARALLEL_FAMILIES))} "
            f"famil{'y' if len(EXPERT_PARALLEL_FAMILIES) == 1 else 'ies'} only, not {family}; re-plan with --ep 1")


def expert_parallel_reasons(plan: Any, adapter: ModelAdapter) -> list[str]:
    """Why a plan with ``ep > 1`` cannot run (empty when it can, or when ep is 1)."""
    ep = getattr(plan.layout, "ep", 1)  # 1 on layouts written before expert parallelism
    if ep == 1:
        return []
    if adapter.name not in EXPERT_PARALLEL_FAMILIES:
        return [f"ep={ep}: {_no_expert_parallel(adapter.name)}"]
    reasons = [f"ep={ep} with {dim}={getattr(plan.layout, dim)}: {why}" for dim, why in _EP_DEGREES.items()
               if getattr(plan.layout, dim) > 1]
    return reasons + [f"ep={ep} with {option}: {why}" for option, why in _EP_OPTIONS.items()
                      if getattr(plan.train, option)]


def _is_moe(model: Any) -> bool:
    return getattr(model, "moe", None) is not None  # ModelSpec.moe: the sparse FFN, None when dense


def _is_mla(model: Any) -> bool:
    return getattr(model, "mla", None) is not None  # ModelSpec.mla: the latent attention, None for GQA/MHA


def _degrees_blocked(adapter: ModelAdapter, model: Any) -> dict[str, str]:
    """Degrees held at 1 for this family (and, with the model's spec, for its architecture)."""
    blocked = {**runtime_unexecuted_degrees(), **adapter.unsupported_degrees}
    if _is_moe(model) and adapter.name not in EXPERT_PARALLEL_FAMILIES:  # a dense model's layout refuses ep itself
        blocked["ep"] = _no_expert_parallel(adapter.name)
    if model is not None and (getattr(model, "hidden_dropout", 0) or getattr(model, "attention_dropout", 0)):
        blocked.setdefault("tp", _TP_DROPOUT)
    if _is_mla(model):
        blocked.setdefault("tp", _MLA_TP)
    if _is_moe(model):
        blocked.setdefault("tp", _MOE_TP)
    if adapter.name not in PIPELINE_FAMILIES:
        blocked.setdefault("pp", f"pipeline stages run the runtime's own Llama only, not the {adapter.name} family; "
                                 "re-plan with --pp 1")
    return blocked


def _options_blocked(adapter: ModelAdapter, model: Any) -> dict[str, str]:
    """Options held off for this family (and, with the model's spec, for its architecture)."""
    blocked = dict(adapter.unsupported_options)
    if _is_moe(model):
        blocked.setdefault("tiled_mlp", _MOE_TILED_MLP)
    return blocked


def pipeline_reasons(plan: Any, adapter: ModelAdapter) -> list[str]:
    """Why a plan with ``pp > 1`` cannot run (empty when it can, or when pp is 1)."""
    pp = plan.layout.pp
    if pp == 1:
        return []
    train: TrainSpec = plan.train
    reasons = []
    if train.pipeline_schedule not in PIPELINE_SCHEDULES:
        reasons.append(f"pipeline_schedule={train.pipeline_schedule}: {_PIPELINE_SCHEDULE_REASON}; re-plan with "
                       "--schedule 1f1b")
    if train.pipeline_schedule == "zero_bubble":
        for option, (value, why) in _ZERO_BUBBLE_REASONS.items():
            if getattr(train, option) == value:
                reasons.append(f"zero_bubble with {option}={value}: {why}")
        if adapter.name not in ZERO_BUBBLE_FAMILIES or train.tiled_loss:
            what = "the tiled loss" if train.tiled_loss else f"the {adapter.name} family"
            reasons.append(f"zero_bubble with {what}: its stages run inside a wrapper module, where the split backward "
                           "is not tested; re-plan with --schedule 1f1b")
    for option, why in _PIPELINE_OPTIONS.items():
        if getattr(train, option):
            reasons.append(f"{option} with pp={pp}: {why}; re-plan without it or with --pp 1")
    return reasons


def unsupported_reasons(plan: Any, family: Family = "llama") -> list[str]:
    """One line per plan option the runtime cannot execute for a model of ``family`` (empty: the plan
    runs as planned).

    ``plan`` is a :class:`sp_plan.planner.plan.Plan` or anything with ``train`` (TrainSpec) and ``layout``
    (Layout) attributes.
    """
    adapter = adapter_named(family)
    train: TrainSpec = plan.train
    layout: Layout = plan.layout
    reasons = []
    for dim, why in _degrees_blocked(adapter, getattr(plan, "model", None)).items():
        degree = getattr(layout, dim, 1)  # ``ep``: a layout field, 1 on layouts written before it
        if degree > 1 and dim != "ep":
            reasons.append(f"{dim}={degree}: {why}")
    reasons += expert_parallel_reasons(plan, adapter)
    for option, why in _options_blocked(adapter, getattr(plan, "model", None)).items():
        if getattr(train, option):
            reasons.append(f"{option}: {why}")
    for option, allowed in SUPPORTED_VALUES.items():
        value = getattr(train, option)
        if value not in allowed:
            reasons.append(f"{option}={value}: {_VALUE_REASONS.get(option, 'not supported')}")
    reasons += pipeline_reasons(plan, adapter)
    if train.is_training and train.zero_stage not in SUPPORTED_ZERO_STAGES:
        reasons.append(
            f"zero_stage={train.zero_stage}: plain DDP is not wired (FSDP2 runs ZeRO-1/2/3); re-plan with --zero 1"
        )
    return reasons


def planner_constraints(family: Family = "llama", model: Any = None) -> tuple[dict[str, int], dict[str, Any]]:
    """``(fixed_layout, fixed_options)`` for :class:`sp_plan.planner.search.PlanSettings` so that the planner only
    returns plans :func:`unsupported_reasons` accepts for a model of ``family`` (and ``model``, a
    ModelSpec, when given)."""
    adapter = adapter_named(family)
    fixed_layout = {dim: 1 for dim in _degrees_blocked(adapter, model)}
    if _is_moe(model):  # expert parallelism runs when asked for (a pinned ep: merge_constraints), never by default
        fixed_layout.setdefault("ep", 1)
    fixed_options: dict[str, Any] = {option: False for option in _options_blocked(adapter, model)}
    return fixed_layout, fixed_options


def _expert_pins(user_layout: Mapping[str, int], user_options: Mapping[str, Any]
                 ) -> tuple[dict[str, int], dict[str, Any]]:
    """What a user-pinned ``ep > 1`` needs pinned besides (see :func:`expert_parallel_reasons`); refuses a pin
    against it."""
    ep = user_layout["ep"]
    for dim, why in _EP_DEGREES.items():
        if user_layout.get(dim, 1) > 1:
            raise RuntimeConfigError(f"ep={ep} with {dim}={user_layout[dim]}: {why}")
    for option, why in _EP_OPTIONS.items():
        if user_options.get(option):
            raise RuntimeConfigError(f"ep={ep} with {option}: {why}")
    return {"ep": ep, **dict.fromkeys(_EP_DEGREES, 1)}, dict.fromkeys(_EP_OPTIONS, False)


def _pipeline_pins(user_layout: Mapping[str, int], user_options: Mapping[str, Any]
                   ) -> tuple[dict[str, int], dict[str, Any]]:
    """What a user-pinned ``pp > 1`` needs pinned besides (see :func:`pipeline_reasons`); refuses a pin against it."""
    pp = user_layout["pp"]
    interleaved = user_options.get("virtual_stages", 1) > 1
    schedule = user_options.get("pipeline_schedule", "interleaved_1f1b" if interleaved else "1f1b")
    if schedule not in PIPELINE_SCHEDULES:
        raise RuntimeConfigError(f"pipeline_schedule={schedule}: {_PIPELINE_SCHEDULE_REASON}; pin 1f1b")
    for option, why in _PIPELINE_OPTIONS.items():
        if user_options.get(option):
            raise RuntimeConfigError(f"{option} with pp={pp}: {why}; drop it or pin pp 1")
    pins: dict[str, Any] = {"pipeline_schedule": schedule, **{option: False for option in _PIPELINE_OPTIONS}}
    if schedule == "zero_bubble":  # what it cannot run with, pinned to the nearest value it can
        for option, (value, why) in _ZERO_BUBBLE_REASONS.items():
            if user_options.get(option) == value:
                raise RuntimeConfigError(f"zero_bubble with {option}={value}: {why}")
        if user_options.get("tiled_loss"):
            raise RuntimeConfigError("zero_bubble with the tiled loss: its last stage runs inside a wrapper module, "
                                     "where the split backward is not tested; pin 1f1b")
        pins.update({"checkpointing": user_options.get("checkpointing", "full"), "tiled_loss": False})
    return {}, pins


def merge_constraints(user_layout: Mapping[str, int], user_options: Mapping[str, Any], family: Family = "llama",
                      model: Any = None) -> tuple[dict[str, int], dict[str, Any]]:
    """The user's pinned degrees/options plus the runtime's constraints; a pin the runtime cannot run is
    refused here (before any search) with the reason."""
    adapter = adapter_named(family)
    fixed_layout, fixed_options = planner_constraints(adapter, model)
    blocked = _degrees_blocked(adapter, model)
    if user_layout.get("pp", 1) > 1 and "pp" not in blocked:
        layout_pins, option_pins = _pipeline_pins(user_layout, user_options)
        fixed_layout.update(layout_pins)
        fixed_options.update(option_pins)
    if user_layout.get("ep", 1) > 1 and "ep" not in blocked and _is_moe(model):
        layout_pins, option_pins = _expert_pins(user_layout, user_options)
        fixed_layout.update(layout_pins)
        fixed_options.update(option_pins)
    for dim, value in user_layout.items():
        if dim in fixed_layout and value != fixed_layout[dim]:
            raise RuntimeConfigError(f"{dim}={value}: {blocked[dim]}")
    for option, value in user_options.items():
        if option in fixed_options and value != fixed_options[option]:
            raise RuntimeConfigError(f"{option}: {_options_blocked(adapter, model)[option]}")
        if option == "zero_stage" and value not in SUPPORTED_ZERO_STAGES:
            raise RuntimeConfigError(
                f"zero_stage={value}: plain DDP is not wired (FSDP2 runs ZeRO-1/2/3); pin zero_stage 1, 2 or 3"
            )
    return {**fixed_layout, **user_layout}, {**fixed_options, **user_options}
