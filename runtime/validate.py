"""Measured vs predicted for a plan: run a few steps of the planned configuration and compare.

Every rank measures (one micro-batch, or one optimizer step, of :func:`sp_plan.runtime.step.train_step`):

- **activation bytes saved for backward** during one micro-batch's forward: autograd's saved tensors
  plus the selective checkpoint's cache (:class:`sp_plan.runtime.saved_tensor_meter.SavedTensorMeter`),
  deduplicated by storage, parameters excluded (FSDP2's gathered parameters too, by module hooks).
  Predicted: ``layers x per-layer saved bytes + output layer + inputs - position ids`` from the memory
  model (position ids live on the device but autograd does not save them);
- **communication bytes by collective, one optimizer step**: the SP collectives, tensor parallelism's
  collectives (all of them, as one ``tp`` row) and the loss reduction from
  :class:`sp_plan.runtime.comm_counter.CommCounter` (exact per the cost model's conventions); FSDP2's
  all-gathers and reduce-scatters counted at the c10d dispatcher (:class:`C10dTrace`, minus TP's,
  which go through the same c10d ops). Predicted: :func:`sp_plan.cost_models.comm_volume.comm_estimate` per
  step (FSDP2 pads each parameter's first dim to the shard count: small, explained differences);
- **peak memory**: CUDA ``max_memory_allocated`` over a step vs the memory model's peak allocated (on
  CPU there is no allocator counter: not measured);
- **step time**: median of the timed steps vs the time model on the prediction topology (on CPU a
  probed CPU topology, so the prediction is for this machine).

A pipelined plan (``pp > 1``) runs every step through its torch.distributed.pipelining schedule and is compared
stage by stage (:mod:`sp_plan.runtime.validate_pipeline`): each rank's parameter, gradient and optimizer bytes,
the activations its stage saves per micro-batch and holds at its peak (metered inside the schedule), the
micro-batches in flight, and the bytes it sends, the pipeline's P2P transfers included.

Rank 0 gathers everything; :func:`render` prints the table. ``sp-plan validate`` drives this.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sp_plan.cost_models.collectives import bytes_sent
from sp_plan.cost_models.comm_volume import comm_estimate, comm_ops, multiplier
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.memory.timeline import INDEX_BYTES, rope_table_bytes
from sp_plan.cost_models.placement import group_shapes
from sp_plan.cost_models.strategies.terms import issued
from sp_plan.cost_models.topology import default_topology, load_topology
from sp_plan.cost_models.units import GB
from sp_plan.runtime.auto import auto_configure
from sp_plan.runtime.capabilities import Family, memory_assumptions
from sp_plan.runtime.comm_counter import CommCounter
from sp_plan.runtime.distributed import init_distributed
from sp_plan.runtime.host_overhead import host_overhead, measure_step_seconds, short_length, with_host_overhead
from sp_plan.runtime.models.base import ModelAdapter, adapter_named, refuse_unbuildable
from sp_plan.runtime.planning import describe_plan
from sp_plan.runtime.probe.run import run_probe
from sp_plan.runtime.step import random_micro_batches, synchronize, train_step
from sp_plan.runtime.validate_meters import (
    FSDP_COLLECTIVES,
    LOSS_ROW,
    SP_COLLECTIVES,
    TP_ROW,
    C10dTrace,
    ParameterAwareMeter,
)
from sp_plan.runtime.validate_pipeline import (
    PIPELINE_COMM_ROWS,
    RUNTIME_TRAFFIC,
    StageMeasurement,
    StagePrediction,
    measure_pipelined,
    predict_stages,
    stage_from_dict,
    unsaved_index_bytes,
)

#: Step-time measurement: one warm-up step, then at least this many timed steps.
MIN_TIMED_STEPS = 2
#: Agreement bounds shown as verdicts (the tests enforce them on CPU).
ACTIVATION_TOLERANCE = 0.05
#: Seconds per compute measurement and for all link timings of the CPU probe that the step-time prediction
#: comes from: a few times auto_configure's quick probe, because the prediction is compared with steps
#: timed right after it and a 50 ms measurement window on cores shared by ranks (and other jobs) is a
#: lottery; still about 2 s, against the several seconds the timed steps take.
CPU_PROBE_BUDGETS = (0.2, 1.0)


# ----- results --------------------------------------------------------------------------------------------


@dataclass
class RankMeasurement:
    rank: int
    activation_bytes: int
    comm_bytes: dict[str, int]
    comm_calls: dict[str, int]
    peak_allocated: int | None
    step_seconds: list[float]
    loss: float
    #: With pp > 1: this rank's stage, measured inside the pipeline schedule (``activation_bytes`` is then one
    #: micro-batch's on this stage).
    stage: StageMeasurement | None = None


@dataclass
class Prediction:
    activation_bytes: int
    per_layer_saved_bytes: int
    comm_bytes: dict[str, float]
    peak_allocated: int
    step_seconds: float
    tokens_per_s: float
    topology: str
    topology_note: str


@dataclass
class ValidationReport:
    plan_lines: list[str]
    prediction: Prediction
    ranks: list[RankMeasurement]
    device: str
    notes: list[str] = field(default_factory=list)
    #: The configuration that ran (the plan file's content) and the topology the time prediction used,
    #: so ``sp-plan calibrate`` can re-predict the run under other parameters.
    plan: dict[str, Any] = field(default_factory=dict)
    time_topology: dict[str, Any] = field(default_factory=dict)
    #: The model family that ran (its registered adapter name).
    kind: str = "llama"
    #: The memory-assumption overrides the prediction used for this model family.
    memory_overrides: dict[str, Any] = field(default_factory=dict)
    #: With pp > 1: every pipeline stage's prediction, by ``pp`` coordinate (each rank is compared with its
    #: stage's; ``prediction`` then holds the busiest stage's activation and communication figures).
    stages: list[StagePrediction] = field(default_factory=list)

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----- prediction -----------------------------------------------------------------------------------------


def _step_bytes(model, train, layout, keep) -> float:
    """Bytes sent per GPU per step by the comm model's ops that ``keep(op)`` selects, as this runtime issues
    them (no stack-dependent traffic: its TP saves the gathered input)."""
    sizes = {name: size for name, (_, size) in group_shapes(layout).items()}
    return sum(bytes_sent(op.collective, op.nbytes, sizes[op.group]) * multiplier(op, model, train)
               for op in comm_ops(model, train, layout) if issued(op, RUNTIME_TRAFFIC) and keep(op))


def _rope_tables_unseen(adapter: ModelAdapter, train, model) -> bool:
    """Whether the run keeps RoPE tables alive that the saved-tensor meter cannot see (the family's
    checkpointing binds them into its recompute closures)."""
    return (adapter.checkpoint_binds_rope_tables and train.checkpointing != "none"
            and model.position_embedding == "rope")


def predict(plan, topology, family: Family = "llama") -> Prediction:
    """Memory, communication and time predicted for ``plan``'s configuration on ``topology``, with the
    memory assumptions of the model ``family`` that runs it (:func:`sp_plan.runtime.capabilities.memory_assumptions`)."""
    return predict_with_stages(plan, topology, family)[0]


def predict_with_stages(plan, topology, family: Family = "llama") -> tuple[Prediction, list[StagePrediction]]:
    """:func:`predict`, and with pp > 1 every pipeline stage's prediction (else an empty list)."""
    model, train, layout = plan.model, plan.train, plan.layout
    adapter = adapter_named(family)
    est = estimate(model, train, layout, topology, memory_assumptions(adapter), with_placement=False)
    detail = est.detail
    local_tokens = train.micro_batch * train.seq_len // layout.sp
    position_ids = local_tokens * INDEX_BYTES  # on the device, never saved by autograd
    activations = (model.num_layers * detail.per_layer.saved_bytes + detail.output_layer.saved_bytes
                   + detail.inputs_bytes - position_ids)
    if _rope_tables_unseen(adapter, train, model):
        # The family's checkpointing binds the RoPE cos/sin as keyword arguments of the recompute closure
        # (HF's does): alive as the model says, but never packed as saved tensors, so the meter cannot see them.
        activations -= rope_table_bytes(local_tokens, model.head_dim, train.dtype_bytes)
    comm = comm_estimate(model, train, layout)
    by_collective = {name: comm.by_collective.get(name, 0.0) for name in SP_COLLECTIVES}
    by_collective.update({name: _step_bytes(model, train, layout, lambda op, c=name: op.strategy == "fsdp"
                                            and op.collective == c) for name in FSDP_COLLECTIVES})
    by_collective["all_reduce (loss)"] = comm.per_step_by_strategy.get("loss", 0.0)
    # Everything on the TP group: the blocks' collectives and the embedding / LM head / vocab-parallel loss.
    by_collective[TP_ROW] = _step_bytes(model, train, layout, lambda op: op.group == "tp")
    prediction = Prediction(activation_bytes=activations, per_layer_saved_bytes=detail.per_layer.saved_bytes,
                            comm_bytes=by_collective, peak_allocated=est.memory.peak_allocated,
                            step_seconds=est.time.step_s, tokens_per_s=est.time.tokens_per_s,
                            topology=topology.name, topology_note="")
    stages: list[StagePrediction] = []
    if layout.pp > 1:
        stages = pipeline_stage_predictions(plan, detail, adapter, local_tokens)
        prediction.activation_bytes = max(s.activation_bytes for s in stages)
        prediction.comm_bytes = {row: max((s.comm_bytes[row] or 0.0) for s in stages) for row in PIPELINE_COMM_ROWS}
    return prediction, stages


def pipeline_stage_predictions(plan, detail, adapter: ModelAdapter, local_tokens: int) -> list[StagePrediction]:
    """Every pipeline stage's prediction (:func:`sp_plan.runtime.validate_pipeline.predict_stages`), with what the
    saved-tensor meter cannot see on each stage taken out as for an unpipelined plan."""
    model, train = plan.model, plan.train
    rope = (rope_table_bytes(local_tokens, model.head_dim, train.dtype_bytes)
            if _rope_tables_unseen(adapter, train, model) else 0)
    return predict_stages(plan, detail, memory_assumptions(adapter),
                          lambda first, last: unsaved_index_bytes(local_tokens, first, last) + rope)


# ----- measurement (every rank) ---------------------------------------------------------------------------


def measure(setup, steps: int, seed: int = 0) -> RankMeasurement:
    """Run ``steps`` optimizer steps (the first one measured for bytes, the rest timed) on random tokens."""
    generator = torch.Generator().manual_seed(seed + setup.dp_rank)  # same sample on the SP ranks
    optimizer = setup.make_optimizer(lr=1e-4)

    # Activations: one micro-batch forward under the meter, then its backward (the saved tensors are used).
    shard = setup.shard(random_micro_batches(setup, generator)[0])
    with ParameterAwareMeter(setup.model) as meter:
        out = setup.compute_loss(shard)
    out.loss.backward()
    optimizer.zero_grad(set_to_none=True)

    # Communication and peak memory: one whole optimizer step.
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    synchronize(setup.device)
    with CommCounter() as counter, C10dTrace() as trace:
        result = train_step(setup, random_micro_batches(setup, generator), optimizer)
    peak = torch.cuda.max_memory_allocated(setup.device) if setup.device.type == "cuda" else None
    comm = {name: counter.bytes(name) for name in SP_COLLECTIVES}
    comm["all_reduce (loss)"] = counter.bytes("all_reduce", strategy="loss")
    comm[TP_ROW] = counter.bytes(strategy="tp")
    comm.update({name: trace.bytes[name] - counter.bytes(name, strategy="tp") for name in FSDP_COLLECTIVES})
    calls = {name: counter.calls(name) for name in SP_COLLECTIVES}
    calls["all_reduce (loss)"] = counter.calls("all_reduce", strategy="loss")
    calls[TP_ROW] = counter.calls(strategy="tp")
    calls.update({name: trace.calls[name] - counter.calls(name, strategy="tp") for name in FSDP_COLLECTIVES})

    # Time: the remaining steps (the step above was the warm-up).
    seconds = [train_step(setup, random_micro_batches(setup, generator), optimizer).seconds
               for _ in range(max(steps - 1, MIN_TIMED_STEPS))]
    return RankMeasurement(rank=dist.get_rank(), activation_bytes=meter.total_bytes, comm_bytes=comm,
                           comm_calls=calls, peak_allocated=peak, step_seconds=seconds, loss=result.loss)


def measure_pipeline_stage(setup, steps: int, seed: int = 0) -> RankMeasurement:
    """:func:`measure` for a pipelined plan: every step runs through the plan's schedule
    (:func:`sp_plan.runtime.validate_pipeline.measure_pipelined`), one warm-up step more than unpipelined."""
    generator = torch.Generator().manual_seed(seed + setup.dp_rank)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    result = measure_pipelined(setup, lambda: random_micro_batches(setup, generator), max(steps - 1, MIN_TIMED_STEPS),
                               setup.mesh.local_rank("pp"))
    peak = torch.cuda.max_memory_allocated(setup.device) if setup.device.type == "cuda" else None
    return RankMeasurement(rank=dist.get_rank(), activation_bytes=result.stage.activation_bytes,
                           comm_bytes=result.comm_bytes, comm_calls=result.comm_calls, peak_allocated=peak,
                           step_seconds=result.step_seconds, loss=result.loss, stage=result.stage)


def prediction_topology(plan, topology: Any, device_type: str):
    """The topology step time is predicted on: the given one, the plan's on GPUs, a quick probe on CPU."""
    world = plan.layout.world
    if topology is not None:
        return load_topology(str(topology), world), f"topology {topology}"
    if device_type == "cuda":
        try:
            return load_topology(plan.hardware.topology, world), f"the plan's topology ({plan.hardware.topology})"
        except CostModelError:  # a topology file from another machine: the GPU's natural node instead
            return default_topology(plan.hardware.gpu, world), f"the natural node of {plan.hardware.gpu}"

    compute_s, link_s = CPU_PROBE_BUDGETS
    with tempfile.TemporaryDirectory() as tmp:
        result = run_probe(Path(tmp) / "cpu.yaml", compute_budget_s=compute_s, link_budget_s=link_s)
        topo = load_topology(str(result.path), world) if dist.get_rank() == 0 else None
    return topo, "probed on this machine: CPU ranks over gloo, so the time prediction is for this CPU"


def run_validation(plan, *, steps: int = 3, topology: Any = None, seed: int = 0,
                   family: Family = "llama") -> ValidationReport | None:
    """Build the plan's model (random weights), auto-configure it, measure; the report on rank 0 only.
    ``family``: the model family that builds the model (its adapter's ``model_from_spec``): ``llama``
    (the runtime's LlamaModel) or ``hf`` (a transformers model of the same shape,
    :func:`sp_plan.runtime.models.hf.model.hf_model_from_spec`)."""
    device_type = init_distributed()
    # what train --plan refuses before building: under torchrun by hand, validate built the whole model first
    # and ended in the kernel's OOM kill (a plan for 8 ranks on 2) or an allocator traceback
    from sp_plan.runtime.train_run import refuse_launch_before_building

    refuse_launch_before_building(plan)
    topo, note = prediction_topology(plan, topology, device_type)
    adapter = adapter_named(family)
    refuse_unbuildable(plan.model, plan.train.seq_len)
    torch.manual_seed(seed)
    model = adapter.model_from_spec(plan.model, plan.train.seq_len, seed)
    setup = auto_configure(model, plan=plan)
    pipelined = plan.layout.pp > 1
    short = short_length(plan) if device_type == "cpu" and topology is None and not pipelined else None
    short_s = None
    if short is not None:  # CPU ranks: the host overhead, measured at a short length (runtime/host_overhead.py)
        generator = torch.Generator().manual_seed(seed + 1_000_003 + setup.dp_rank)
        short_s = measure_step_seconds(setup, short, generator, setup.make_optimizer(lr=1e-4))
    mine = measure_pipeline_stage(setup, steps, seed) if pipelined else measure(setup, steps, seed)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    notes = []
    if short_s is not None:
        try:
            overhead = host_overhead(plan, topo, short, short_s, memory_assumptions(adapter))
        except CostModelError as exc:
            notes.append(f"step time: the host overhead measured at {short:,} tokens is not priced ({exc})")
        else:
            topo = with_host_overhead(topo, overhead)
            notes.append(f"step time: {overhead.note()}; added to the prediction (CPU ranks only)")
    elif device_type == "cpu" and topology is None and not pipelined:
        notes.append("step time: the plan is too short to measure its host overhead at 1/16 of its length; the "
                     "prediction prices kernels and transfers only")
    prediction, stages = predict_with_stages(plan, topo, adapter)
    prediction.topology_note = note
    if device_type == "cpu":
        notes.append("peak memory: not measured on CPU (no allocator statistics); the activation row is the "
                     "measured saved-tensor total")
    if pipelined:
        notes += pipeline_notes(plan, stages)
        held_longer = any(r.stage is not None and r.stage.in_flight > stages[r.stage.stage].in_flight for r in gathered)
        if plan.train.pipeline_schedule == "zero_bubble" and held_longer:
            notes.append("in flight under zero_bubble: torch's input-gradient pass keeps the graph (retain_graph=True) "
                         "until the micro-batch's weight-gradient pass, so its saved tensors stay alive until then; "
                         "the cost model gives ZB-H1 1F1B's count")
    if adapter.checkpoint_binds_rope_tables and plan.train.checkpointing != "none":
        notes.append("activations: HF keeps the RoPE cos/sin in its checkpoint closures (on the device, not saved "
                     "tensors the meter sees): left out of the prediction too")
    fsdp_differs = any(r.comm_bytes[c] != _predicted_comm(prediction, stages, r, c)
                       for r in gathered for c in FSDP_COLLECTIVES)
    if fsdp_differs:
        notes.append("FSDP2 bytes differ from the model where FSDP2 pads a parameter's first dim to a multiple of "
                     "the shard count")
    return ValidationReport(plan_lines=describe_plan(plan), prediction=prediction, ranks=gathered,
                            device=device_type, notes=notes, plan=plan.model_dump(mode="json"),
                            time_topology=topo.spec.model_dump(mode="json"), kind=adapter.name,
                            memory_overrides=dict(adapter.memory_assumptions), stages=stages)


def _predicted_comm(prediction: Prediction, stages: list[StagePrediction], rank: RankMeasurement, row: str) -> float | None:
    """The bytes ``rank`` is predicted to send in ``row``: its stage's under pp > 1, else the plan's."""
    if rank.stage is not None and stages:
        return stages[rank.stage.stage].comm_bytes.get(row)
    return prediction.comm_bytes.get(row, 0.0)


def pipeline_notes(plan, stages: list[StagePrediction]) -> list[str]:
    """What a pipelined report's rows mean and which it cannot predict per stage."""
    p, m = plan.layout.pp, plan.train.grad_accum
    notes = [
        (f"pipeline: pp={p}, {plan.train.pipeline_schedule}, {m} micro-batch(es) per step; each rank is compared "
         "with its stage (parameters, gradients, optimizer states, activations, bytes it sends); the step ran "
         "through the torch.distributed.pipelining schedule (after one warm-up step)"),
        ("pipeline P2P: the cost model prices every stage as an interior one (an activation forward and a "
         "gradient back per micro-batch and model chunk); the first stage sends no gradient and the last no "
         "activation, so their predictions count only the transfers they make"),
        ("activations per micro-batch: one micro-batch's saved tensors on the rank's stages, metered inside the "
         "schedule; held at peak: the most saved bytes alive at once, in flight: the most micro-batches "
         "alive at once (the cost model's count: stage 0 holds the most under 1F1B)"),
    ]
    if any(s.comm_bytes.get(TP_ROW) is None for s in stages):
        notes.append("tp: some of the cost model's whole-model TP collectives could not be attributed to a stage: "
                     "measured, not predicted per stage")
    tokens = plan.train.micro_batch * plan.train.seq_len // plan.layout.sp
    notes.append(f"activations: the schedule cuts the step's batch into micro-batch views, so the token ids a first "
                 f"stage saves and the labels a last stage saves keep all {m} micro-batches' ids alive: "
                 f"{(m - 1) * tokens * INDEX_BYTES:,} B more per micro-batch on each than the model's inputs; the last "
                 "stage's nll_loss also saves a 4-byte scalar no memory model counts")
    v = plan.train.virtual_stages
    if v > 1 and plan.model.position_embedding == "rope":
        rope = rope_table_bytes(tokens, plan.model.head_dim, plan.train.dtype_bytes)
        notes.append(f"activations: each of a rank's {v} model chunks builds its own RoPE cos/sin, {(v - 1) * rope:,} B "
                     "more per micro-batch than the one set the model counts")
    if plan.train.zero_stage < 3 and plan.layout.shard_group > 1:
        notes.append(f"parameters: under ZeRO-{plan.train.zero_stage} the memory model counts the gathered "
                     "parameters a stage keeps through the step; FSDP2 keeps them sharded between steps, which is "
                     "when they are measured")
    notes.append("loss: the row is the data-group reduction the cost model prices; the runtime also all-reduces the "
                 f"micro-batches' (sum, count) over the pp group once per step ({m} x 2 fp32 values), which the cost "
                 "model does not price and the row leaves out")
    return notes


# ----- rendering ------------------------------------------------------------------------------------------


def _ratio(measured: float, predicted: float) -> str:
    if not predicted:
        return "exact" if not measured else "n/a"
    error = measured / predicted - 1
    return "exact" if measured == predicted else f"{error:+.2%}"


def _worst(errors: list[str]) -> str:
    return max(errors, key=lambda e: 0 if e == "exact" else abs(float(e.rstrip("%"))) if e != "n/a" else 1e9)


def render(report: ValidationReport | dict) -> str:
    """The comparison table: one column per rank, predicted first, worst relative error last."""
    if isinstance(report, dict):
        report = _from_dict(report)
    if report.stages:
        return render_pipelined(report)
    p = report.prediction
    ranks = report.ranks
    header = f"{'':34}{'predicted':>14}" + "".join(f"{'rank ' + str(r.rank):>14}" for r in ranks) + f"{'worst':>10}"
    rows = [*report.plan_lines, f"time prediction: {p.topology} ({p.topology_note})", header]

    def row(label: str, predicted: float | None, measured: list[float | None], scale: float, fmt: str) -> None:
        cells = "".join(f"{'n/a' if m is None else format(m / scale, fmt):>14}" for m in measured)
        worst = "n/a"
        if predicted is not None and all(m is not None for m in measured):
            worst = _worst([_ratio(m, predicted) for m in measured])  # type: ignore[arg-type]
        pred = "n/a" if predicted is None else format(predicted / scale, fmt)
        rows.append(f"{label:34}{pred:>14}{cells}{worst:>10}")

    row("activations saved for backward MB", p.activation_bytes, [r.activation_bytes for r in ranks], 1e6, ".3f")
    for name in (*SP_COLLECTIVES, "all_reduce (loss)", TP_ROW, *FSDP_COLLECTIVES):
        scale, fmt = (1.0, ",.0f") if name == "all_reduce (loss)" else (1e6, ".3f")
        unit = "B" if scale == 1.0 else "MB"
        row(f"comm {name} {unit}/step", p.comm_bytes.get(name, 0.0), [r.comm_bytes.get(name, 0) for r in ranks],
            scale, fmt)
    row("peak allocated GB", p.peak_allocated, [r.peak_allocated for r in ranks], GB, ".3f")
    row("step time s (median)", p.step_seconds, [statistics.median(r.step_seconds) for r in ranks], 1.0, ".4f")
    rows += [f"note: {n}" for n in report.notes]
    return "\n".join(rows)


def render_pipelined(report: ValidationReport) -> str:
    """The table of a pipelined plan: one column per rank, each row predicted (the rank's stage's) over measured,
    worst relative error last."""
    p, ranks = report.prediction, report.ranks
    stage_of = [report.stages[r.stage.stage] if r.stage is not None else None for r in ranks]
    header = f"{'':50}" + "".join(f"{'rank ' + str(r.rank):>14}" for r in ranks) + f"{'worst':>10}"
    rows = [*report.plan_lines, f"time prediction: {p.topology} ({p.topology_note})", header,
            f"{'pipeline stage':50}" + "".join(f"{'n/a' if s is None else s.stage:>14}" for s in stage_of)]

    def pair(label: str, predicted: list[float | None], measured: list[float | None], scale: float, fmt: str) -> None:
        def cells(values: list[float | None]) -> str:
            return "".join(f"{'n/a' if v is None else format(v / scale, fmt):>14}" for v in values)

        worst = "n/a"
        if all(v is not None for v in [*predicted, *measured]):
            worst = _worst([_ratio(m, q) for m, q in zip(measured, predicted)])  # type: ignore[arg-type]
        rows.append(f"{label:50}{cells(predicted)}")
        rows.append(f"{'  measured':50}{cells(measured)}{worst:>10}")

    def stage_values(name: str) -> tuple[list, list]:
        return ([None if s is None else getattr(s, name) for s in stage_of],
                [None if r.stage is None else getattr(r.stage, name) for r in ranks])

    for label, name, scale, fmt in (("parameters MB", "parameter_bytes", 1e6, ".3f"),
                                    ("gradients MB", "gradient_bytes", 1e6, ".3f"),
                                    ("optimizer states MB", "optimizer_bytes", 1e6, ".3f"),
                                    ("activations / micro-batch MB", "activation_bytes", 1e6, ".3f"),
                                    ("micro-batches in flight", "in_flight", 1.0, ".2f"),
                                    ("activations held at peak MB", "held_activation_bytes", 1e6, ".3f")):
        pair(f"{label} (predicted)", *stage_values(name), scale, fmt)
    for name in PIPELINE_COMM_ROWS:
        scale, fmt, unit = (1.0, ",.0f", "B") if name == LOSS_ROW else (1e6, ".3f", "MB")
        predicted = [None if s is None else s.comm_bytes.get(name) for s in stage_of]
        pair(f"comm {name} {unit}/step (predicted)", predicted, [r.comm_bytes.get(name) for r in ranks], scale, fmt)
    if any(r.peak_allocated is not None for r in ranks):
        pair("peak allocated GB (predicted, worst stage)", [p.peak_allocated] * len(ranks),
             [r.peak_allocated for r in ranks], GB, ".3f")
    pair("step time s (median) (predicted)", [p.step_seconds] * len(ranks),
         [statistics.median(r.step_seconds) for r in ranks], 1.0, ".4f")
    rows += [f"note: {n}" for n in report.notes]
    return "\n".join(rows)


def _from_dict(data: dict) -> ValidationReport:
    ranks = [RankMeasurement(**{**r, "stage": stage_from_dict(r.get("stage"), StageMeasurement)})
             for r in data["ranks"]]
    return ValidationReport(plan_lines=data["plan_lines"], prediction=Prediction(**data["prediction"]),
                            ranks=ranks, device=data["device"],
                            notes=data.get("notes", []), plan=data.get("plan", {}),
                            time_topology=data.get("time_topology", {}), kind=data.get("kind", "llama"),
                            memory_overrides=data.get("memory_overrides", {}),
                            stages=[StagePrediction(**s) for s in data.get("stages", [])])
