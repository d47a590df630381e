"""``sp-plan validate`` for pipelined plans (``pp > 1``): per-stage predictions and a measured step of the schedule.

Stages hold different things, so a pipelined plan is compared stage by stage (each rank with the stage of its
``pp`` coordinate):

- **parameter, gradient and optimizer bytes** of the rank's model parts vs the memory model's states of that
  stage (:func:`sp_plan.cost_models.memory.states.model_states` with the stage's layers, the embedding on the
  first stage, the final norm and LM head on the last);
- **activations saved for backward**, metered inside the schedule (:mod:`sp_plan.runtime.pipeline_meter`):
  one micro-batch on the rank's stages vs the memory model's per-layer, output-layer and input terms; the
  micro-batches in flight at the stage's peak vs the schedule's count
  (:func:`sp_plan.cost_models.pipeline.in_flight`: stage 0 holds the most under 1F1B), and the saved bytes
  held then;
- **communication bytes per step by bucket**: the cost model's ops (:func:`sp_plan.cost_models.comm_volume.comm_ops`)
  attributed to the stage: per-layer ops times the stage's layers, FSDP's embedding/head ops by the stage's
  share of those parameters, the loss reduction on every stage, and the ``pipeline`` strategy's transfers as
  the stage makes them: it sends an activation forward unless it holds the last model chunk and a gradient
  back unless it holds the first (the cost model prices every stage as an interior one, both ways); TP's
  embedding collectives on the first stage, its LM-head and vocab-parallel loss ones on the last, its
  replicated-gradient all-reduces by the stage's share of those parameters. An op this attribution does not know
  leaves its row unpredicted per stage (the report says so).

The step measured is the second one (the first infers the stages' shapes and sends that metadata), run
through :func:`sp_plan.runtime.step.train_step` and so through the plan's torch.distributed.pipelining
schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from sp_plan.cost_models.collectives import bytes_sent
from sp_plan.cost_models.comm_volume import comm_ops
from sp_plan.cost_models.memory.states import model_states, stage_params, tp_params
from sp_plan.cost_models.memory.timeline import INDEX_BYTES
from sp_plan.cost_models.pipeline import stage_layers
from sp_plan.cost_models.placement import group_shapes
from sp_plan.cost_models.strategies.terms import issued
from sp_plan.cost_models.strategies.tp import tp_replicated_layer_params
from sp_plan.runtime.comm_counter import CommCounter
from sp_plan.runtime.pipeline import stage_indices
from sp_plan.runtime.pipeline_meter import ScheduleMeter
from sp_plan.runtime.step import train_step
from sp_plan.runtime.validate_meters import (
    FSDP_COLLECTIVES,
    LOSS_ROW,
    PIPELINE_ROW,
    SP_COLLECTIVES,
    TP_ROW,
    C10dTrace,
)

#: This runtime's stack-dependent traffic (``CommOp.only_if``): none. Its tensor parallelism
#: (:mod:`sp_plan.runtime.tp`) gathers a sequence-parallel input with an autograd function and the linear
#: after it saves the gathered tensor, so backward issues no re-gather.
RUNTIME_TRAFFIC: frozenset[str] = frozenset()

#: The communication rows of a pipelined report, in print order.
PIPELINE_COMM_ROWS = (*SP_COLLECTIVES, PIPELINE_ROW, LOSS_ROW, TP_ROW, *FSDP_COLLECTIVES)


@dataclass
class StagePrediction:
    """What the cost models predict for one pipeline stage (bytes; ``comm_bytes`` per step, None where the
    model's ops cannot be attributed to a stage)."""

    stage: int
    layers: int
    first: bool
    last: bool
    comm_bytes: dict[str, float | None]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    #: Saved for backward by one micro-batch on this stage.
    activation_bytes: int
    #: Micro-batches whose activations the stage holds at its peak (the schedule's count).
    in_flight: float
    held_activation_bytes: int


@dataclass
class StageMeasurement:
    """What one rank measured of its stage."""

    stage: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    in_flight: float
    held_activation_bytes: int


# ----- prediction -----------------------------------------------------------------------------------------


def _row(op) -> str | None:
    """The report row a cost-model op counts in (None: a bucket the report does not show)."""
    if op.group == "tp":
        return TP_ROW
    if op.strategy == "pipeline":
        return PIPELINE_ROW
    if op.strategy == "loss":
        return LOSS_ROW
    if op.strategy == "fsdp" and op.collective in FSDP_COLLECTIVES:
        return op.collective
    if op.collective in SP_COLLECTIVES:
        return op.collective
    return None


def _tp_model_share(op, model, layers: int, first: bool, last: bool) -> float | None:
    """The share of a whole-model TP op (the embedding's, the LM head's, the vocab-parallel loss's, the
    replicated-gradient all-reduces) that a stage issues, told by the op's label; None for an op not known here
    (the row is then not predicted per stage rather than guessed)."""
    label = op.label
    if label.startswith("embedding output"):
        return float(first)
    if label.startswith(("LM head input", "vocab-parallel cross-entropy")):
        return float(last)
    if label.startswith("replicated-parameter gradient"):  # every layer's norms, and the final norm
        per_layer, final = tp_replicated_layer_params(model), model.norm_params()
        return (per_layer * layers + final * last) / (per_layer * model.num_layers + final)
    if label.startswith("replicated K/V-head gradient"):
        return layers / model.num_layers
    return None


def stage_comm_bytes(plan, stage: int) -> dict[str, float | None]:
    """Bytes stage ``stage`` sends per step by report row, from the cost model's ops (module docstring)."""
    model, train, layout = plan.model, plan.train, plan.layout
    layers = stage_layers(model, train, layout)[stage]
    chunks = stage_indices(plan, stage)
    total_chunks = layout.pp * train.virtual_stages
    first, last = 0 in chunks, total_chunks - 1 in chunks
    every = tp_params(model, layout.tp, layout.ep)
    mine = stage_params(every, layers, first, last, model.tied_embeddings)
    other_share = (mine.embedding + mine.head) / max(every.embedding + every.head, 1)
    all_share = mine.total / every.total
    sizes = {name: size for name, (_, size) in group_shapes(layout).items()}
    rows: dict[str, float | None] = dict.fromkeys(PIPELINE_COMM_ROWS, 0.0)
    for op in comm_ops(model, train, layout):
        if not issued(op, RUNTIME_TRAFFIC):
            continue
        row = _row(op)
        if row is None or rows[row] is None:
            continue
        per = train.grad_accum if op.per == "microbatch" else 1
        if op.scope == "layer":
            times = op.count * layers * per
        elif op.strategy == "pipeline":  # one transfer per chunk that has a neighbour that way
            sends = sum(c < total_chunks - 1 for c in chunks) if op.phase == "forward" else sum(c > 0 for c in chunks)
            times = sends * per
        elif op.strategy in ("fsdp", "dp"):  # a step-phase op covers every parameter, the others the embedding/head
            times = op.count * per * (all_share if op.phase == "step" else other_share)
        elif op.strategy == "loss":
            times = op.count * per
        elif row == TP_ROW and (share := _tp_model_share(op, model, layers, first, last)) is not None:
            times = op.count * per * share
        else:
            rows[row] = None
            continue
        rows[row] += bytes_sent(op.collective, op.nbytes, sizes[op.group]) * times
    return rows


def predict_stages(plan, memory_detail, assumptions, unseen: Callable[[bool, bool], int]) -> list[StagePrediction]:
    """Every stage's prediction. ``memory_detail``: the estimate's memory detail (per-layer, output-layer and
    input terms; the pipeline's in-flight counts); ``unseen(first, last)``: bytes of one micro-batch on such a
    stage that the saved-tensor meter cannot see (on the device, but never saved by autograd)."""
    model, train, layout = plan.model, plan.train, plan.layout
    split = stage_layers(model, train, layout)
    total_chunks = layout.pp * train.virtual_stages
    out = []
    for s, layers in enumerate(split):
        chunks = stage_indices(plan, s)
        first, last = 0 in chunks, total_chunks - 1 in chunks
        states = model_states(model, train, layout, assumptions, stage=(layers, first, last))
        output = memory_detail.output_layer.saved_bytes if last else 0
        activations = layers * memory_detail.per_layer.saved_bytes + memory_detail.inputs_bytes + output - unseen(first, last)
        in_flight = memory_detail.pipeline.in_flight_microbatches[s]
        # As the memory model stashes them: the other micro-batches' blocks and inputs; the output layer's only for
        # the micro-batch whose loss is being computed.
        held = round(in_flight * (activations - output)) + output
        out.append(StagePrediction(stage=s, layers=layers, first=first, last=last, comm_bytes=stage_comm_bytes(plan, s),
                                   parameter_bytes=states.weights_device,
                                   gradient_bytes=states.grads_device(states.params.total),
                                   optimizer_bytes=states.optimizer_device, activation_bytes=activations,
                                   in_flight=in_flight, held_activation_bytes=held))
    return out


def unsaved_index_bytes(tokens: int, first: bool, last: bool) -> int:
    """Index tensors of a stage's micro-batch on the device that autograd never saves: the position ids on
    every stage, the token ids past the first stage (only the embedding saves them), the labels before the
    last (only the loss saves them)."""
    return tokens * INDEX_BYTES * (1 + (not first) + (not last))


# ----- measurement (every rank) ---------------------------------------------------------------------------


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's per-parameter state (AdamW's moments); its scalar ``step`` counters are left out, as the
    memory model leaves them out."""
    return _local_bytes(value for state in optimizer.state.values() for key, value in state.items()
                        if isinstance(value, torch.Tensor) and key != "step")


@dataclass
class PipelinedMeasurement:
    comm_bytes: dict[str, int]
    comm_calls: dict[str, int]
    stage: StageMeasurement
    step_seconds: list[float]
    loss: float


def measure_pipelined(setup, batches: Callable[[], list[torch.Tensor]], timed_steps: int,
                      stage: int) -> PipelinedMeasurement:
    """A warm-up step, then one step under every meter (gradients measured before the optimizer step, its
    states after), then ``timed_steps`` timed steps, all through the pipeline schedule."""
    optimizer = setup.make_optimizer(lr=1e-4)
    train_step(setup, batches(), optimizer)  # shape inference (its metadata sends), first allocations
    with CommCounter() as counter, C10dTrace() as trace, ScheduleMeter(setup.pipeline) as schedule:
        result = train_step(setup, batches(), None)
    gradients = _local_bytes(p.grad for p in setup.parameters())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    comm = {name: counter.bytes(name) for name in SP_COLLECTIVES}
    calls = {name: counter.calls(name) for name in SP_COLLECTIVES}
    comm[PIPELINE_ROW] = schedule.send_bytes
    calls[PIPELINE_ROW] = schedule.sends
    comm[LOSS_ROW] = counter.bytes("all_reduce", strategy="loss")
    calls[LOSS_ROW] = counter.calls("all_reduce", strategy="loss")
    comm[TP_ROW] = counter.bytes(strategy="tp")
    calls[TP_ROW] = counter.calls(strategy="tp")
    comm.update({name: trace.bytes[name] - counter.bytes(name, strategy="tp") for name in FSDP_COLLECTIVES})
    calls.update({name: trace.calls[name] - counter.calls(name, strategy="tp") for name in FSDP_COLLECTIVES})
    per_microbatch = schedule.microbatch_bytes(0)
    measured = StageMeasurement(
        stage=stage, parameter_bytes=_local_bytes(setup.parameters()), gradient_bytes=gradients,
        optimizer_bytes=_optimizer_bytes(optimizer), activation_bytes=per_microbatch,
        in_flight=schedule.peak_chunks / setup.train.virtual_stages, held_activation_bytes=schedule.peak_bytes)
    seconds = [train_step(setup, batches(), optimizer).seconds for _ in range(timed_steps)]
    return PipelinedMeasurement(comm_bytes=comm, comm_calls=calls, stage=measured, step_seconds=seconds,
                                loss=result.loss)


def stage_from_dict(data: dict[str, Any] | None, cls: type) -> Any:
    """A :class:`StagePrediction` or :class:`StageMeasurement` from its JSON form (None stays None)."""
    return None if data is None else cls(**data)
