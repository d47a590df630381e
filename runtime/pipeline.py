"""Pipeline parallelism through ``torch.distributed.pipelining``: this rank's stage, its schedule, its loss.

A plan with ``pp > 1`` cuts the model's blocks into ``pp`` stages (the split the cost model priced,
:func:`sp_plan.cost_models.pipeline.stage_layers`). As torchtitan's ``pipeline_llm`` does, each rank keeps
the model part of its ``pp`` coordinate (:func:`sp_plan.runtime.model_parts.split_model`), parallelises it
like any model part (TP, SP attention, checkpointing, FSDP2: :func:`sp_plan.runtime.auto.configure_parts`),
wraps it in a :class:`~torch.distributed.pipelining.PipelineStage` over the ``pp`` process group and drives
it with PyTorch's own schedule for the plan's ``pipeline_schedule`` (:data:`SCHEDULE_NAMES`); no scheduling is
written here. The micro-batches of a step are the plan's ``grad_accum``.

The loss stays the token-count weighted one of :mod:`sp_plan.runtime.loss`: the last stage's loss
function returns ``local token-loss sum / step tokens`` for each micro-batch, so the schedule must not
rescale the gradients (``scale_grads=False``), and FSDP2 sums them over the data group as without PP. The
(sum, count) pairs the last stage saw are all-reduced once per step (over the data group, then over the
``pp`` group, where the other stages add zeros), so every rank reports the same loss. The gradient norm of
clipping is the norm over every stage's gradients (squares summed over the ``pp`` group, as torchtitan's
``clip_grad_norm_`` with a ``pp_mesh``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from sp_plan.cost_models.pipeline import stage_layers
from sp_plan.runtime import comm_counter
from sp_plan.runtime.data import DOCUMENTS_KEY, IGNORE_INDEX
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.loss import LOSS_REDUCTION_DTYPE, cross_entropy_sum
from sp_plan.runtime.mesh import RuntimeMesh
from sp_plan.runtime.models.base import ModelAdapter

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

#: The plan's ``pipeline_schedule`` -> the torch.distributed.pipelining schedule that runs it. 1F1B drives one
#: stage per rank; interleaved 1F1B drives ``virtual_stages`` stages per rank (rank ``r`` holds stages ``r``,
#: ``r + pp``, ...); zero bubble is torch's ScheduleInterleavedZeroBubble over one stage per rank (ZB-H1, as the
#: cost model prices ``zero_bubble``), which splits each backward into input and weight gradients: it runs
#: under ZeRO-1/2 without selective checkpointing (:mod:`sp_plan.runtime.capabilities` says why not otherwise).
#: torch.distributed.pipelining is imported when a pipeline is built: it imports torch._dynamo (~0.6 s), which
#: every other rank process (all of them without pp) would pay at start-up.
SCHEDULE_NAMES: dict[str, str] = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                                  "zero_bubble": "ScheduleInterleavedZeroBubble"}


def stage_indices(plan, pp_rank: int) -> list[int]:
    """The (global) stage indices rank ``pp_rank`` of the ``pp`` dim holds: one per virtual stage, ``pp`` apart
    (Megatron's and torchtitan's interleaved placement)."""
    pp, v = plan.layout.pp, plan.train.virtual_stages
    return [pp_rank + k * pp for k in range(v)]


def stage_bounds(plan) -> list[int]:
    """Block indices where the pipeline stages start (all but the first), in stage order. Rank ``r`` holds the
    layers the cost model gave it (the plan's ``stage_layers`` or the balanced default), cut into
    ``virtual_stages`` chunks as even as can be: the earlier chunks take the remainder, except on the first rank,
    whose first chunk, beside the embedding, stays the lightest (Megatron's placement when it counts the
    embedding as a layer). A rank with fewer layers than chunks leaves its first chunk (rank 0: the embedding
    alone) or its last (the last rank: the loss alone) without blocks, as Llama 3's 405B layout does
    (:mod:`sp_plan.cost_models.pipeline`)."""
    pp, v = plan.layout.pp, plan.train.virtual_stages
    per_rank = stage_layers(plan.model, plan.train, plan.layout)

    def chunk(r: int, k: int) -> int:
        base, extra = divmod(per_rank[r], v)
        return base + (k >= v - extra if r == 0 else k < extra)

    sizes = [chunk(r, k) for k in range(v) for r in range(pp)]
    return list(itertools.accumulate(sizes))[:-1]


#: Families whose model parts are a pipeline stage's module as they are: ``forward(token ids or the previous
#: stage's hidden states, position_ids=...)`` returns a tensor. Other families' parts run through
#: :class:`StageForward`.
PLAIN_FORWARD_FAMILIES = frozenset({"llama"})


class StageForward(nn.Module):
    """A model part as a PipelineStage's module, for families whose forward takes keywords or returns an output
    object (HF models): ``forward(x, position_ids)`` is the family adapter's ``logits`` (the part's output).
    The part's FSDP2 units sit inside; FSDP2 then reduces each micro-batch's gradients as it does without PP."""

    def __init__(self, part: nn.Module, adapter: ModelAdapter) -> None:
        super().__init__()
        self.part = part
        self.adapter = adapter

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.adapter.logits(self.part, x, position_ids)


class HiddenStatesStage(nn.Module):
    """The last stage under the plan's tiled loss: its output is the final hidden states (through the family's
    FSDP-registered hidden-states method), and the loss function multiplies them by the lm_head chunk by
    chunk (:func:`sp_plan.runtime.tiled_loss.tiled_cross_entropy`), so the logits never exist whole."""

    def __init__(self, part: nn.Module, adapter: ModelAdapter) -> None:
        super().__init__()
        self.part = part
        self.adapter = adapter

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.adapter.hidden_states(self.part, x, position_ids)


@dataclass
class StepLossRecorder:
    """The last stage's loss function: ``local token-loss sum / step tokens`` per micro-batch (what the
    schedule back-propagates), keeping each micro-batch's detached (sum, count) for the step's report.

    The schedule may call it once more, before the first step's micro-batches, while inferring the stages'
    tensor shapes; :meth:`take` therefore returns the last ``n`` records."""

    cross_entropy: object = None
    step_tokens: int = 1
    records: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.cross_entropy is None:
            local_sum, count = cross_entropy_sum(logits, labels), int((labels != IGNORE_INDEX).sum())
        else:
            local_sum, count = self.cross_entropy(logits, labels)
        self.records.append((local_sum.detach().to(LOSS_REDUCTION_DTYPE), int(count)))
        return local_sum / max(self.step_tokens, 1)

    def take(self, n: int) -> list[tuple[torch.Tensor, int]]:
        taken, self.records = self.records[-n:] if n else [], []
        return taken


@dataclass
class Pipeline:
    """This rank's stages of a pipelined plan and the schedule that runs them (``AutoConfigured.pipeline``)."""

    stages: list[PipelineStage]
    schedule: object
    loss: StepLossRecorder
    micro_batches: int
    group: dist.ProcessGroup

    @property
    def is_first(self) -> bool:
        """This rank holds stage 0 (it feeds the token ids)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        """This rank holds the last stage (it computes the loss)."""
        return any(stage.is_last for stage in self.stages)

    def run_step(self, shards: Sequence[Mapping[str, torch.Tensor]], step_tokens: int,
                 data_group: dist.ProcessGroup | None, device: torch.device) -> list[tuple[float, int]]:
        """Forward and backward of a step's micro-batch shards through the pipeline; returns each micro-batch's
        (global token-mean loss, global valid tokens), the same on every rank."""
        if len(shards) != self.micro_batches:
            raise RuntimeConfigError(
                f"this pipeline runs {self.micro_batches} micro-batches per step (the plan's grad_accum) but the step "
                f"got {len(shards)}: pass grad_accum micro-batches per train_step, or re-plan with that grad_accum"
            )
        if any(DOCUMENTS_KEY in s for s in shards):
            raise RuntimeConfigError(
                "packed documents (cu_seqlens) are not passed through pipeline stages yet: train with pp=1, or "
                "with cross_document_attention=True"
            )
        inputs = torch.cat([s["input_ids"] for s in shards])
        positions = torch.cat([s["position_ids"] for s in shards])
        labels = torch.cat([s["labels"] for s in shards])
        self.loss.step_tokens = step_tokens
        args = (inputs,) if self.is_first else ()
        self.schedule.step(*args, target=labels if self.is_last else None, position_ids=positions,
                           return_outputs=False)
        return self._step_losses(data_group, device)

    def _step_losses(self, data_group: dist.ProcessGroup | None, device: torch.device) -> list[tuple[float, int]]:
        stats = torch.zeros((self.micro_batches, 2), dtype=LOSS_REDUCTION_DTYPE, device=device)
        if self.is_last:
            for i, (local_sum, count) in enumerate(self.loss.take(self.micro_batches)):
                stats[i, 0], stats[i, 1] = local_sum.to(device), float(count)
        if data_group is not None and dist.get_world_size(data_group) > 1:
            # The loss reduction the cost model prices (two fp32 values per micro-batch over the data group),
            # here for all the step's micro-batches at once; metered as such for sp-plan validate.
            comm_counter.record_all_reduce(stats, dist.get_world_size(data_group), "forward", "loss")
            dist.all_reduce(stats, group=data_group)
        dist.all_reduce(stats, group=self.group)  # only the last stage's ranks hold non-zeros
        return [(float(s) / float(c) if c else 0.0, int(c)) for s, c in stats.tolist()]


def build_pipeline(parts: Sequence[nn.Module], adapter: ModelAdapter, plan, mesh: RuntimeMesh,
                   cross_entropy=None) -> Pipeline:
    """The PipelineStages of this rank's (parallelised) model parts, in :func:`stage_indices` order, and the
    plan's schedule over them."""
    total = plan.layout.pp * plan.train.virtual_stages
    indices = stage_indices(plan, mesh.local_rank("pp"))
    modules = []
    for part, index in zip(parts, indices, strict=True):
        if plan.train.tiled_loss and index == total - 1:
            modules.append(HiddenStatesStage(part, adapter))
        elif adapter.name not in PLAIN_FORWARD_FAMILIES:
            modules.append(StageForward(part, adapter))
        else:
            modules.append(part)
    from torch.distributed import pipelining

    schedule_name = plan.train.pipeline_schedule
    group = mesh.group("pp")
    stages = [pipelining.PipelineStage(module, index, total, mesh.device, group=group)
              for module, index in zip(modules, indices, strict=True)]
    loss = StepLossRecorder(cross_entropy)
    micro_batches = plan.train.grad_accum
    if schedule_name not in SCHEDULE_NAMES:
        raise RuntimeConfigError(f"pipeline_schedule={schedule_name} is not wired in the runtime; re-plan with "
                                 f"--schedule {' or '.join(SCHEDULE_NAMES)}")
    schedule_cls = getattr(pipelining, SCHEDULE_NAMES[schedule_name])
    if schedule_cls is pipelining.Schedule1F1B:
        schedule = schedule_cls(stages[0], n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    else:
        schedule = schedule_cls(stages, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    return Pipeline(stages=stages, schedule=schedule, loss=loss, micro_batches=micro_batches, group=group)


def norm_over_stages(stage_norm: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """The 2-norm of every stage's gradients from this stage's (over its FSDP and TP shards): the squares summed
    over the ``pp`` group, the same value on every rank."""
    squared = (stage_norm.detach().to(device=device, dtype=torch.float64) ** 2).reshape(1)
    dist.all_reduce(squared, group=group)
    return squared.sqrt()[0]


def clip_to_norm_(parameters: Sequence[nn.Parameter], max_norm: float, total: torch.Tensor) -> float:
    """Scale the parameters' gradients by ``max_norm / total`` when that is below 1 (the norm over every stage);
    returns ``total``."""
    with_grads = [p for p in parameters if p.grad is not None]
    if with_grads:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total.to(with_grads[0].grad.dtype))
    return float(total)


def gather_stage_state_dicts(state: Mapping[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every stage's full (unsharded) parameters, on the host, merged: each stage holds its own blocks under
    the whole model's names, so the union is the unsplit model's state dict."""
    gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {k: v.detach().cpu() for k, v in state.items()}, group=group)
    merged: dict[str, torch.Tensor] = {}
    for stage_state in gathered:
        merged.update(stage_state or {})
    return merged
