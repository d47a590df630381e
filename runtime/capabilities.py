"""What the runtime can execute, in ONE place: every plan option is either run or refused with a reason.

:func:`auto_configure <runtime.auto.auto_configure>` refuses a plan for which
:func:`unsupported_reasons` returns anything, and asks the planner only for plans it can run
(:func:`planner_constraints`), so a plan the runtime cannot execute is never silently approximated.

Adding a technique (tensor parallelism, tiled MLP/loss, offloads) is a local change: delete its
entry from :data:`NOT_YET_SUPPORTED` and apply it in ``runtime.auto._apply_memory_techniques``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cost_models.layout import Layout
from cost_models.train_spec import TrainSpec

#: TrainSpec boolean options the runtime does not execute yet -> why (the option is refused when True).
NOT_YET_SUPPORTED: dict[str, str] = {
    "tiled_mlp": "the runtime has no tiled MLP yet (runtime/tiled_mlp.py, issue 7); re-plan without --tiled-mlp",
    "tiled_loss": "the runtime has no tiled cross-entropy yet (runtime/tiled_loss.py, issue 7); "
                  "re-plan without --tiled-loss",
    "offload_checkpoints": "checkpointed hidden states cannot be offloaded to host memory yet (runtime/offload.py, "
                           "issue 7); re-plan without --offload-checkpoints",
    "offload_optimizer": "FSDP2 CPU offload is not wired into auto_configure yet (issue 7); re-plan without "
                         "--offload-optimizer",
    "offload_params": "FSDP2 CPU offload is not wired into auto_configure yet (issue 7); re-plan without "
                      "--offload-params",
}

#: Layout degrees the runtime executes only at 1 -> why.
UNSUPPORTED_DEGREES: dict[str, str] = {
    "tp": "tensor parallelism is not wired into auto_configure yet (runtime/tp.py, issue 7); re-plan with --tp 1",
}

#: ZeRO stages auto_configure runs, all with FSDP2 (see runtime.auto for how each is reproduced).
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


def unsupported_reasons(plan: Any) -> list[str]:
    """One line per plan option the runtime cannot execute (empty: the plan runs as planned).

    ``plan`` is a :class:`planner.plan.Plan` or anything with ``train`` (TrainSpec) and ``layout``
    (Layout) attributes.
    """
    train: TrainSpec = plan.train
    layout: Layout = plan.layout
    reasons = []
    for dim, why in UNSUPPORTED_DEGREES.items():
        degree = getattr(layout, dim)
        if degree > 1:
            reasons.append(f"{dim}={degree}: {why}")
    for option, why in NOT_YET_SUPPORTED.items():
        if getattr(train, option):
            reasons.append(f"{option}: {why}")
    for option, allowed in SUPPORTED_VALUES.items():
        value = getattr(train, option)
        if value not in allowed:
            reasons.append(f"{option}={value}: {_VALUE_REASONS.get(option, 'not supported')}")
    if train.is_training and train.zero_stage not in SUPPORTED_ZERO_STAGES:
        reasons.append(
            f"zero_stage={train.zero_stage}: plain DDP is not wired (FSDP2 runs ZeRO-1/2/3); re-plan with --zero 1"
        )
    return reasons


def planner_constraints() -> tuple[dict[str, int], dict[str, Any]]:
    """``(fixed_layout, fixed_options)`` for :class:`planner.search.PlanSettings` so that the planner only
    returns plans :func:`unsupported_reasons` accepts."""
    fixed_layout = {dim: 1 for dim in UNSUPPORTED_DEGREES}
    fixed_options: dict[str, Any] = {option: False for option in NOT_YET_SUPPORTED}
    return fixed_layout, fixed_options


def merge_constraints(user_layout: Mapping[str, int], user_options: Mapping[str, Any]
                      ) -> tuple[dict[str, int], dict[str, Any]]:
    """The user's pinned degrees/options plus the runtime's constraints; a pin the runtime cannot run is
    refused here (before any search) with the reason."""
    from runtime.errors import RuntimeConfigError

    fixed_layout, fixed_options = planner_constraints()
    for dim, value in user_layout.items():
        if dim in fixed_layout and value != fixed_layout[dim]:
            raise RuntimeConfigError(f"{dim}={value}: {UNSUPPORTED_DEGREES[dim]}")
    for option, value in user_options.items():
        if option in fixed_options and value != fixed_options[option]:
            raise RuntimeConfigError(f"{option}: {NOT_YET_SUPPORTED[option]}")
    return {**fixed_layout, **user_layout}, {**fixed_options, **user_options}
