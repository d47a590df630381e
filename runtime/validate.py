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
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sp_plan.cost_models.collectives import bytes_sent
from sp_plan.cost_models.comm_volume import comm_estimate, comm_ops, multiplier
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.memory.timeline import INDEX_BYTES, rope_table_bytes
from sp_plan.cost_models.placement import group_shapes
from sp_plan.cost_models.topology import default_topology, load_topology
from sp_plan.cost_models.units import GB
from sp_plan.runtime.auto import auto_configure
from sp_plan.runtime.capabilities import Family, memory_assumptions
from sp_plan.runtime.comm_counter import CommCounter
from sp_plan.runtime.distributed import init_distributed
from sp_plan.runtime.models.base import ModelAdapter, adapter_named, refuse_unbuildable
from sp_plan.runtime.planning import describe_plan
from sp_plan.runtime.probe.run import run_probe
from sp_plan.runtime.step import synchronize, train_step
from sp_plan.runtime.saved_tensor_meter import SavedTensorMeter

#: Collectives compared with the cost model. SP and loss ones come from CommCounter, FSDP ones from C10dTrace.
SP_COLLECTIVES = ("all_to_all", "send_recv")
FSDP_COLLECTIVES = ("all_gather", "reduce_scatter")
#: Tensor parallelism's traffic (all-gathers, reduce-scatters, all-reduces) as one row.
TP_ROW = "tp (all collectives)"
#: Step-time measurement: one warm-up step, then at least this many timed steps.
MIN_TIMED_STEPS = 2
#: Agreement bounds shown as verdicts (the tests enforce them on CPU).
ACTIVATION_TOLERANCE = 0.05
#: Seconds per compute measurement and for all link timings of the CPU probe that the step-time prediction
#: comes from: a few times auto_configure's quick probe, because the prediction is compared with steps
#: timed right after it and a 50 ms measurement window on cores shared by ranks (and other jobs) is a
#: lottery; still about 2 s, against the several seconds the timed steps take.
CPU_PROBE_BUDGETS = (0.2, 1.0)


# ----- FSDP traffic at the dispatcher ---------------------------------------------------------------------


class C10dTrace(TorchDispatchMode):
    """Bytes this rank sends in c10d all-gathers and reduce-scatters (FSDP2's), by the project's conventions.

    FSDP2 issues them from its hooks through ``torch.distributed``; they reach the dispatcher as c10d ops
    (``_allgather_base_``, ``_reduce_scatter_base_`` and coalesced variants), where this mode sees them.
    All-gather: the local shard goes to P-1 peers; reduce-scatter: (P-1)/P of the full input. P follows
    from the output/input sizes, so no process group lookup is needed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = dict.fromkeys(FSDP_COLLECTIVES, 0)
        self.calls = dict.fromkeys(FSDP_COLLECTIVES, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("c10d::"):
            self._record(name, args)
        return func(*args, **(kwargs or {}))

    def _record(self, name: str, args: tuple) -> None:
        tensors = [a for a in args[:2]]
        outs = tensors[0] if isinstance(tensors[0], (list, tuple)) else [tensors[0]]
        ins = tensors[1] if isinstance(tensors[1], (list, tuple)) else [tensors[1]]
        if not all(isinstance(t, torch.Tensor) for t in [*outs, *ins]):
            return
        out_bytes = sum(t.numel() * t.element_size() for t in outs)
        in_bytes = sum(t.numel() * t.element_size() for t in ins)
        if "allgather" in name and in_bytes:
            world = out_bytes // in_bytes
            self.bytes["all_gather"] += in_bytes * (world - 1)
            self.calls["all_gather"] += 1
        elif "reduce_scatter" in name and out_bytes:
            world = in_bytes // out_bytes
            self.bytes["reduce_scatter"] += in_bytes * (world - 1) // world
            self.calls["reduce_scatter"] += 1


# ----- saved activations under FSDP2 ----------------------------------------------------------------------


class ParameterAwareMeter(SavedTensorMeter):
    """A SavedTensorMeter that also skips the parameters FSDP2 gathers for a module's forward.

    FSDP2 swaps each module's sharded parameters for freshly gathered full ones just before the
    module runs and frees them after, so their storages are unknown in advance and their addresses are
    reused later: a forward pre-hook excludes a module's parameter storages while the module runs and a
    forward hook lifts the exclusion (parameters a linear layer saves for backward are the weights,
    not activations).
    """

    def __init__(self, model: nn.Module) -> None:
        # FSDP2's sharded parameters are DTensors: their local shards own the storage.
        super().__init__(exclude=[getattr(p, "_local_tensor", p) for p in model.parameters()])
        self._model = model
        self._module_hooks: list = []
        self._permanent = set(self._excluded)
        self._running: dict[int, int] = {}
        self._by_module: dict[int, list[int]] = {}

    def _pre(self, module, _args) -> None:
        # Remembered per module: after the forward FSDP2 has freed (resharded) these parameters.
        ptrs = [p.untyped_storage().data_ptr() for p in module.parameters(recurse=False)]
        self._by_module[id(module)] = ptrs
        for ptr in ptrs:
            self._running[ptr] = self._running.get(ptr, 0) + 1
            self._excluded.add(ptr)

    def _post(self, module, _args, _output) -> None:
        for ptr in self._by_module.pop(id(module), []):
            self._running[ptr] -= 1
            if self._running[ptr] == 0:
                del self._running[ptr]
                if ptr not in self._permanent:
                    self._excluded.discard(ptr)

    def __enter__(self) -> ParameterAwareMeter:
        for module in self._model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._module_hooks.append(module.register_forward_pre_hook(self._pre))
                self._module_hooks.append(module.register_forward_hook(self._post))
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks.clear()


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

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----- prediction -----------------------------------------------------------------------------------------


def _step_bytes(model, train, layout, keep) -> float:
    """Bytes sent per GPU per step by the comm model's ops that ``keep(op)`` selects."""
    sizes = {name: size for name, (_, size) in group_shapes(layout).items()}
    return sum(bytes_sent(op.collective, op.nbytes, sizes[op.group]) * multiplier(op, model, train)
               for op in comm_ops(model, train, layout) if keep(op))


def _rope_tables_unseen(adapter: ModelAdapter, train, model) -> bool:
    """Whether the run keeps RoPE tables alive that the saved-tensor meter cannot see (the family's
    checkpointing binds them into its recompute closures)."""
    return (adapter.checkpoint_binds_rope_tables and train.checkpointing != "none"
            and model.position_embedding == "rope")


def predict(plan, topology, family: Family = "llama") -> Prediction:
    """Memory, communication and time predicted for ``plan``'s configuration on ``topology``, with the
    memory assumptions of the model ``family`` that runs it (:func:`sp_plan.runtime.capabilities.memory_assumptions`)."""
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
    return Prediction(activation_bytes=activations, per_layer_saved_bytes=detail.per_layer.saved_bytes,
                      comm_bytes=by_collective, peak_allocated=est.memory.peak_allocated,
                      step_seconds=est.time.step_s, tokens_per_s=est.time.tokens_per_s, topology=topology.name,
                      topology_note="")


# ----- measurement (every rank) ---------------------------------------------------------------------------


def _micro_batches(setup, generator: torch.Generator) -> list[torch.Tensor]:
    t = setup.train
    vocab = setup.plan.model.vocab_size
    return [torch.randint(0, vocab, (t.micro_batch, t.seq_len), generator=generator) for _ in range(t.grad_accum)]


def measure(setup, steps: int, seed: int = 0) -> RankMeasurement:
    """Run ``steps`` optimizer steps (the first one measured for bytes, the rest timed) on random tokens."""
    generator = torch.Generator().manual_seed(seed + setup.dp_rank)  # same sample on the SP ranks
    optimizer = setup.make_optimizer(lr=1e-4)

    # Activations: one micro-batch forward under the meter, then its backward (the saved tensors are used).
    shard = setup.shard(_micro_batches(setup, generator)[0])
    with ParameterAwareMeter(setup.model) as meter:
        out = setup.compute_loss(shard)
    out.loss.backward()
    optimizer.zero_grad(set_to_none=True)

    # Communication and peak memory: one whole optimizer step.
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    synchronize(setup.device)
    with CommCounter() as counter, C10dTrace() as trace:
        result = train_step(setup, _micro_batches(setup, generator), optimizer)
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
    seconds = [train_step(setup, _micro_batches(setup, generator), optimizer).seconds
               for _ in range(max(steps - 1, MIN_TIMED_STEPS))]
    return RankMeasurement(rank=dist.get_rank(), activation_bytes=meter.total_bytes, comm_bytes=comm,
                           comm_calls=calls, peak_allocated=peak, step_seconds=seconds, loss=result.loss)


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
    topo, note = prediction_topology(plan, topology, device_type)
    adapter = adapter_named(family)
    refuse_unbuildable(plan.model, plan.train.seq_len)
    torch.manual_seed(seed)
    model = adapter.model_from_spec(plan.model, plan.train.seq_len, seed)
    setup = auto_configure(model, plan=plan)
    mine = measure(setup, steps, seed)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    prediction = predict(plan, topo, adapter)
    prediction.topology_note = note
    notes = []
    if device_type == "cpu":
        notes.append("peak memory: not measured on CPU (no allocator statistics); the activation row is the "
                     "measured saved-tensor total")
    if adapter.checkpoint_binds_rope_tables and plan.train.checkpointing != "none":
        notes.append("activations: HF keeps the RoPE cos/sin in its checkpoint closures (on the device, not saved "
                     "tensors the meter sees): left out of the prediction too")
    fsdp_differs = any(r.comm_bytes[c] != prediction.comm_bytes[c] for r in gathered for c in FSDP_COLLECTIVES)
    if fsdp_differs:
        notes.append("FSDP2 bytes differ from the model where FSDP2 pads a parameter's first dim to a multiple of "
                     "the shard count")
    return ValidationReport(plan_lines=describe_plan(plan), prediction=prediction, ranks=gathered,
                            device=device_type, notes=notes, plan=plan.model_dump(mode="json"),
                            time_topology=topo.spec.model_dump(mode="json"), kind=adapter.name,
                            memory_overrides=dict(adapter.memory_assumptions))


# ----- rendering ------------------------------------------------------------------------------------------


def _ratio(measured: float, predicted: float) -> str:
    if not predicted:
        return "exact" if not measured else "n/a"
    error = measured / predicted - 1
    return "exact" if measured == predicted else f"{error:+.2%}"


def render(report: ValidationReport | dict) -> str:
    """The comparison table: one column per rank, predicted first, worst relative error last."""
    if isinstance(report, dict):
        report = _from_dict(report)
    p = report.prediction
    ranks = report.ranks
    header = f"{'':34}{'predicted':>14}" + "".join(f"{'rank ' + str(r.rank):>14}" for r in ranks) + f"{'worst':>10}"
    rows = [*report.plan_lines, f"time prediction: {p.topology} ({p.topology_note})", header]

    def row(label: str, predicted: float | None, measured: list[float | None], scale: float, fmt: str) -> None:
        cells = "".join(f"{'n/a' if m is None else format(m / scale, fmt):>14}" for m in measured)
        worst = "n/a"
        if predicted is not None and all(m is not None for m in measured):
            errors = [_ratio(m, predicted) for m in measured]  # type: ignore[arg-type]
            worst = max(errors, key=lambda e: 0 if e == "exact" else abs(float(e.rstrip("%"))) if e != "n/a" else 1e9)
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


def _from_dict(data: dict) -> ValidationReport:
    return ValidationReport(plan_lines=data["plan_lines"], prediction=Prediction(**data["prediction"]),
                            ranks=[RankMeasurement(**r) for r in data["ranks"]], device=data["device"],
                            notes=data.get("notes", []), plan=data.get("plan", {}),
                            time_topology=data.get("time_topology", {}), kind=data.get("kind", "llama"),
                            memory_overrides=data.get("memory_overrides", {}))
