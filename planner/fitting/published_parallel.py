"""How published pipelined and mixture-of-experts runs map onto sp-plan's layout and training options.

The published tables name a schedule, virtual stages, an expert-parallel size and a global batch; the
model needs micro-batches per step, a layer split per stage, ``Layout.ep`` and the routing balance. Where
the source's own code fixes one of them (torchtitan's generated split points at the benchmarked commit,
Megatron-Bridge's force-balanced routing) it is reproduced here; where sp-plan's layout cannot say what
the source ran (an expert-parallel group folded over tensor-parallel ranks) the nearest layout is used and
the difference is returned as text for the run's ``assumed`` note.
"""

from __future__ import annotations

from typing import Any

from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.model_spec import ModelSpec


def torchtitan_stage_layers(layers: int, pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """Layers per pipeline rank under torchtitan's generated split (``generate_split_points`` at commit
    9dec370, the one its December 2024 benchmark names): ``layers // stages`` on the first stage, one more
    on each following stage while the remainder lasts, the last stage takes what is left; a looped schedule
    puts stages ``r, r + pp, ...`` on rank ``r``. Why it matters: the split decides the slowest stage."""
    total = pp * stages_per_rank
    if total > layers:
        raise CostModelError(f"{total} pipeline stages for {layers} layers: torchtitan refuses more stages than layers")
    base, extra = divmod(layers, total)
    stages = [base]
    for _ in range(total - 2):
        stages.append(base + (1 if extra > 0 else 0))
        extra = max(0, extra - 1)
    stages.append(layers - sum(stages))
    return tuple(sum(stages[r + k * pp] for k in range(stages_per_rank)) for r in range(pp))


def pipeline_train(entry: dict[str, Any], model: ModelSpec) -> dict[str, Any]:
    """TrainSpec options of a pipelined entry: its schedule and virtual stages (a VP without a schedule
    means Megatron's interleaved 1F1B), the layers per rank where the entry gives them (``stage_layers``),
    and otherwise torchtitan's own layer split; torchtitan's sharding: under PP its FSDP2
    blocks do not reshard after forward (9dec370 ``apply_fsdp``: "avoid per-microbatch all-gathers"), so the
    weights stay gathered through the step, ZeRO-2 in sp-plan's terms. Keys the entry does not give are left
    to the source's defaults."""
    if entry.get("pipeline", 1) <= 1:
        return {}
    kw: dict[str, Any] = {}
    virtual = entry.get("virtual_stages", 1)
    if "schedule" in entry:
        kw["pipeline_schedule"] = entry["schedule"]
    elif virtual > 1:
        kw["pipeline_schedule"] = "interleaved_1f1b"
    if virtual > 1:
        kw["virtual_stages"] = virtual
    if "stage_layers" in entry:  # a split the source's recipe fixes (e.g. a Megatron pipeline layout string)
        kw["stage_layers"] = tuple(entry["stage_layers"])
    elif entry["source"].startswith("torchtitan"):
        kw["stage_layers"] = torchtitan_stage_layers(model.num_layers, entry["pipeline"], virtual)
    if entry["source"].startswith("torchtitan"):
        kw["zero_stage"] = 2
    return kw


def global_batch_accumulation(entry: dict[str, Any]) -> int:
    """Micro-batches per step of a Megatron table row: global batch / (micro-batch x data-parallel ranks)."""
    dp = entry.get("dp_shard", 1) * entry.get("dp_replicate", 1)
    return max(1, entry["global_batch"] // (entry.get("micro_batch", 1) * dp))


def expert_degree(entry: dict[str, Any]) -> tuple[int, str]:
    """sp-plan's ``ep`` for an entry's published expert-parallel size, and what differs (empty when nothing).

    sp-plan takes ``ep`` from the shard group (dp_shard x ring x ulysses); Megatron-Core folds its EP group
    over TP x DP with expert-tensor-parallel 1, so an EP of shard group x TP is priced as ``ep`` = shard group
    with the experts split over TP: the same expert weights and FLOPs per rank and the same all-to-all bytes
    (each TP rank dispatches its sequence-parallel shard either way), plus an all-gather of the received rows
    over TP and a reduce-scatter of the outputs (NVLink) that expert-tensor-parallel 1 does not run."""
    ep = entry.get("ep", 1)
    shard = entry.get("dp_shard", 1) * entry.get("ring", 1) * entry.get("ulysses", 1)
    tp = entry.get("tp", 1)
    if ep <= shard:
        return ep, ""
    if ep == shard * tp:
        return shard, (f"published EP {ep} spans TP x DP (expert tensor parallel 1); priced as ep={shard} over the "
                       f"data-parallel ranks with the experts split over TP {tp}: the same expert weights, FLOPs "
                       f"and all-to-all bytes per rank (each TP rank dispatches its sequence-parallel shard), plus "
                       f"a TP all-gather/reduce-scatter of the expert rows that expert-TP 1 does not run")
    raise CostModelError(f"published EP {ep} is neither within the shard group ({shard} ranks) nor shard group x TP "
                         f"({shard * tp}); add its mapping to planner/fitting/published_parallel.py")


def with_load_imbalance(model: ModelSpec, imbalance: float | None) -> ModelSpec:
    """The model with its MoE routing at ``imbalance`` (busiest expert / mean; None keeps the preset's)."""
    if imbalance is None or model.moe is None:
        return model
    return model.model_copy(update={"moe": model.moe.model_copy(update={"load_imbalance": imbalance})})


__all__ = ["expert_degree", "global_batch_accumulation", "pipeline_train", "torchtitan_stage_layers",
           "with_load_imbalance"]
