"""The pipeline schedule as the planner searches it: one branch per (schedule, virtual stages, micro-batch).

For a layout with ``pp > 1`` the search also chooses the schedule (:data:`SCHEDULES`) and, for interleaved
1F1B, the model chunks per stage (:data:`VIRTUAL_STAGES`). None of them is a lattice axis: a schedule trades
memory for bubble, not monotonically, and under PP a smaller micro-batch means more micro-batches, hence a
smaller bubble, so the micro-batch is not monotone in time either. Each combination is therefore its own
branch (one-value axes, like the ZeRO branches), inside which the lattice keeps both monotone properties.
The brute force enumerates the same combinations and skips the invalid ones with :func:`pipeline_invalid`.
"""

from __future__ import annotations

from typing import Any

from sp_plan.cost_models.degrees import chunk_slots
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec

from .options import Axis, OptionLattice

#: Schedules the planner tries unless one is pinned (TrainSpec.pipeline_schedule), and interleaved 1F1B's
#: chunks per stage. 1F1B is not among them: ZB-H1 holds the same micro-batches in flight (the same memory)
#: and its bubble, (p-1)(T_F + T_B - T_W), is never longer than 1F1B's (p-1)(T_F + T_B + T_W), so 1F1B can
#: never rank above it (``--schedule 1f1b`` pins it, e.g. for a stack without zero-bubble schedules).
SCHEDULES = ("zero_bubble", "interleaved_1f1b")
VIRTUAL_STAGES = (1, 2, 4, 8)
#: 8 chunks per stage are searched from this many stages up, where published runs use them (Llama 3 405B: 16
#: stages of 8 chunks, a layer each; Megatron-Bridge's 405B recipes: 8 x 8): with fewer stages the bubble 4
#: chunks leave is small already, and trying 8 there cost the 8-GPU search a fifth more time for nothing.
DEEP_CHUNKS_FROM_STAGES = 8
PIPELINE_AXES = ("pipeline_schedule", "virtual_stages")


def pipeline_axes(model: ModelSpec, layout: Layout, fixed: dict[str, Any],
                  stack_schedules: tuple[str, ...] | None = None) -> tuple[Axis, ...]:
    """The schedule axes of a pipelined layout (pins as one-value axes); none without PP. ``stack_schedules``:
    the schedules the stack runs (its ``search.options``; Megatron-LM has no zero-bubble schedule), which
    replace :data:`SCHEDULES`."""
    if layout.pp == 1:
        return ()
    schedules = (fixed["pipeline_schedule"],) if "pipeline_schedule" in fixed else (stack_schedules or SCHEDULES)
    chunks = (fixed["virtual_stages"],) if "virtual_stages" in fixed else tuple(
        v for v in VIRTUAL_STAGES
        if chunk_slots(model.num_layers, v) >= layout.pp * v and (v <= 4 or layout.pp >= DEEP_CHUNKS_FROM_STAGES))
    return Axis("pipeline_schedule", schedules), Axis("virtual_stages", chunks)


def pipeline_invalid(model: ModelSpec, layout: Layout, options: dict[str, Any], grad_accum: int) -> str | None:
    """Why a schedule choice cannot run on this layout (None when it can)."""
    schedule, v = options.get("pipeline_schedule"), options.get("virtual_stages")
    if schedule is None:
        return None
    if (schedule == "interleaved_1f1b") != (v > 1):
        return "virtual stages go with interleaved_1f1b only"
    if chunk_slots(model.num_layers, v) < layout.pp * v:
        return (f"pp x virtual stages = {layout.pp * v} exceeds {model.num_layers} layers"
                + (" and the embedding's and the loss's chunks" if v > 1 else ""))
    if schedule == "interleaved_1f1b" and grad_accum % layout.pp:
        return f"interleaved_1f1b needs micro-batches ({grad_accum}) divisible by pp={layout.pp}"
    return None


def pipeline_branches(lattice: OptionLattice, valid: Any) -> list[OptionLattice]:
    """Split ``lattice`` into one branch per (schedule, virtual stages, micro-batch) that ``valid(options)``
    accepts; a lattice without the schedule axes is returned as it is."""
    names = [a.name for a in lattice.axes]
    if PIPELINE_AXES[0] not in names:
        return [lattice]
    split = (*PIPELINE_AXES, "micro_batch")
    idx = [names.index(n) for n in split]
    out = []
    for schedule in lattice.axes[idx[0]].values:
        for v in lattice.axes[idx[1]].values:
            for mb in lattice.axes[idx[2]].values:
                if valid({"pipeline_schedule": schedule, "virtual_stages": v, "micro_batch": mb}):
                    pinned = dict(zip(split, (schedule, v, mb)))
                    out.append(OptionLattice(tuple(Axis(a.name, (pinned[a.name],)) if a.name in pinned else a
                                                   for a in lattice.axes)))
    return out
