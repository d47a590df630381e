"""Pipeline parallelism through ``torch.distributed.pipelining``: this rank's stage, its schedule, its loss.

A plan with ``pp > 1`` cuts the model's blocks into ``pp`` stages (the split the cost model priced,
:func:`sp_plan.cost_models.pipeline.stage_layers`). As torchtitan's ``pipeline_llm`` does, each rank keeps
the model part of its ``pp`` coordinate (:func:`sp_plan.runtime.model_parts.split_model`), parallelises it
like any model part (TP, SP attention, checkpointing, FSDP2: :func:`sp_plan.runtime.auto.configure_parts`),
wraps it in a :class:`~torch.distributed.pipelining.PipelineStage` over the ``pp`` process group and drives
it with PyTorch's own schedule for the plan's ``pipeline_schedule`` (:data:`SCHEDULES`); no scheduling is
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from sp_plan.cost_models.pipeline import stage_layers
from sp_plan.runtime.data import DOCUMENTS_KEY, IGNORE_INDEX
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.loss import LOSS_REDUCTION_DTYPE, cross_entropy_sum
from sp_plan.runtime.mesh import RuntimeMesh

#: The plan's ``pipeline_schedule`` -> the torch.distributed.pipelining schedule that runs it (one stage per
#: rank). Interleaved 1F1B and the zero-bubble schedules are refused by
#: :func:`sp_plan.runtime.capabilities.pipeline_reasons` until they are wired and tested.
SCHEDULES = {"1f1b": Schedule1F1B}


def stage_bounds(plan) -> list[int]:
    """Block indices where the stages start (all but the first): the cumulative per-stage layer counts of the
    split the cost model priced (the plan's ``stage_layers`` or the balanced default)."""
    split = stage_layers(plan.model, plan.train, plan.layout)
    return list(itertools.accumulate(split))[:-1]


def stage_of(model_parts: Sequence[nn.Module], mesh: RuntimeMesh) -> tuple[int, nn.Module]:
    """This rank's stage index (its ``pp`` coordinate) and its model part."""
    index = mesh.local_rank("pp")
    return index, model_parts[index]


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
    """This rank's stage of a pipelined plan and the schedule that runs it (``AutoConfigured.pipeline``)."""

    stage: PipelineStage
    schedule: object
    loss: StepLossRecorder
    micro_batches: int
    group: dist.ProcessGroup

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

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
            dist.all_reduce(stats, group=data_group)
        dist.all_reduce(stats, group=self.group)  # only the last stage's ranks hold non-zeros
        return [(float(s) / float(c) if c else 0.0, int(c)) for s, c in stats.tolist()]


def build_pipeline(part: nn.Module, stage_index: int, plan, mesh: RuntimeMesh, cross_entropy=None) -> Pipeline:
    """The PipelineStage of this rank's (parallelised) model part and the plan's schedule over it."""
    schedule_cls = SCHEDULES.get(plan.train.pipeline_schedule)
    if schedule_cls is None:
        raise RuntimeConfigError(
            f"pipeline_schedule={plan.train.pipeline_schedule} is not wired in the runtime; re-plan with --schedule "
            f"{' or '.join(SCHEDULES)}"
        )
    group = mesh.group("pp")
    stage = PipelineStage(part, stage_index, plan.layout.pp, mesh.device, group=group)
    loss = StepLossRecorder(cross_entropy)
    micro_batches = plan.train.grad_accum
    schedule = schedule_cls(stage, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    return Pipeline(stage=stage, schedule=schedule, loss=loss, micro_batches=micro_batches, group=group)


def pipeline_grad_norm(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup,
                       device: torch.device) -> torch.Tensor:
    """The 2-norm of every stage's gradients: this stage's norm (over its FSDP shards), squared, summed over
    the ``pp`` group. The same value on every rank."""
    squared = torch.zeros(1, dtype=torch.float64, device=device)
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: a partial norm over the sharded dims
            norm = norm.full_tensor()
        squared += norm.detach().to(device=device, dtype=torch.float64) ** 2
    dist.all_reduce(squared, group=group)
    return squared.sqrt()[0]


def clip_pipeline_grad_norm_(parameters: Sequence[nn.Parameter], max_norm: float, group: dist.ProcessGroup,
                             device: torch.device) -> float:
    """Clip every stage's gradients by the one norm over all stages; returns that norm."""
    total = pipeline_grad_norm(parameters, group, device)
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
