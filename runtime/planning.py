"""The plan a run executes: ask the planner (restricted to what the model's family can execute), or
load one; make every rank hold the same one; refuse one made for another model or length, or one the
runtime cannot execute. No model is touched here."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sp_plan.cost_models.data_balance import RUNTIME_SHARDINGS, layout_balance
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.topology import Topology, load_topology
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.planner.plan import Hardware, Plan, load_plan, plan_from_dict
from sp_plan.planner.search import PlanSettings, search
from sp_plan.runtime.capabilities import Family, merge_constraints, unsupported_reasons
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.base import adapter_named
from sp_plan.runtime.probe.run import run_probe

#: Probe budgets (seconds per compute measurement, seconds for all link timings) when auto_configure has
#: to measure the machine itself: enough for a usable topology, short enough to run before every job.
AUTO_PROBE_BUDGETS = {"cpu": (0.05, 0.5), "cuda": (0.2, 5.0)}
#: Architecture fields a plan's model must share with the model being trained (names and published
#: totals may differ).
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size",
    "tied_embeddings", "activation", "norm", "position_embedding", "qkv_bias", "attn_out_bias", "mlp_bias",
    "qk_norm",
)
#: Memory techniques a plan may switch on (shown when on).
TECHNIQUES = ("tiled_mlp", "tiled_loss", "offload_checkpoints", "offload_optimizer", "offload_params")


# ----- where the plan comes from ----------------------------------------------------------------------------


def load_topology_for(topology: Any, world: int) -> Topology:
    """A Topology from a Topology, a preset (``dgx-h100``, ``dgx-h100@roce-400:8``) or a topology file."""
    return topology if isinstance(topology, Topology) else load_topology(str(topology), world)


def probe_topology(world: int, device_type: str) -> Topology | None:
    """Measure this machine with a quick probe (collective: every rank runs it); the Topology on rank 0."""
    compute_s, link_s = AUTO_PROBE_BUDGETS[device_type]
    with tempfile.TemporaryDirectory() as tmp:
        result = run_probe(Path(tmp) / "topology.yaml", compute_budget_s=compute_s, link_budget_s=link_s)
        return load_topology(str(result.path), world) if dist.get_rank() == 0 else None


#: Degrees the runtime's own planning holds at 1 unless the user pins them. The runtime runs a subset of
#: pipelined plans (capabilities.pipeline_reasons), which degree pins cannot express for a free search, so it
#: plans pp only when asked to (merge_constraints then pins what its pipelines need).
UNPINNED_DEFAULTS: dict[str, int] = {"pp": 1}


def plan_for(spec: ModelSpec, base: TrainSpec, topology, world: int, *, global_batch: int | None = None,
             fixed_layout: Mapping[str, int] | None = None, fixed_options: Mapping[str, Any] | None = None,
             family: Family = "llama", stack: str | None = None, calibration: str | None = None) -> Plan:
    """Ask the planner for the fastest plan this runtime can execute for a model of ``family`` (a
    :class:`~sp_plan.runtime.models.base.ModelAdapter` or its registered name; no torch.distributed
    involved), under ``stack`` (default sp-plan) and ``calibration``, with the family's memory
    assumptions (its adapter's ``memory_assumptions``) on top."""
    adapter = adapter_named(family)
    layout_pins, option_pins = merge_constraints(fixed_layout or {}, fixed_options or {}, adapter, spec)
    layout_pins = {**UNPINNED_DEFAULTS, **layout_pins}
    sequences = global_batch if global_batch is not None else base.micro_batch
    settings = PlanSettings(global_batch_tokens=sequences * base.seq_len, micro_batch_fixed=True,
                            fixed_layout=layout_pins, fixed_options=option_pins, stack=stack,
                            calibration=calibration, assume=dict(adapter.memory_assumptions))
    result = search(spec, base, topology, settings, world=world)
    best = result.best
    hardware = Hardware(num_gpus=world, gpus_per_node=min(topology.gpus_per_node, world), gpu=topology.gpu.name,
                        topology=topology.name)
    runner_up = result.plans[1] if len(result.plans) > 1 else None
    explanation = [f"fastest of {result.stats.layouts} layouts the runtime can execute "
                   f"({best.estimate.time.tokens_per_s:,.0f} tokens/s predicted)"]
    if runner_up is not None:
        explanation.append(f"next best: {runner_up.layout.describe()} "
                           f"({runner_up.estimate.time.tokens_per_s:,.0f} tokens/s)")
    est = best.estimate.to_json_dict()
    return Plan(model=spec, train=best.train, layout=best.layout, hardware=hardware, estimate=est,
                placement=est.get("placement") or {}, explanation=explanation, stack=result.stack,
                calibration=result.calibration)


def plan_from_argument(plan: Any) -> Plan:
    """A Plan from a Plan, a mapping (a plan file's content) or a plan file's path."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return plan_from_dict(dict(plan), "plan")
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise RuntimeConfigError(f"plan must be a Plan, a mapping or a path to a plan file, got {type(plan).__name__}")


# ----- every rank holds the same plan -----------------------------------------------------------------------


def _plan_digest(plan: Plan) -> str:
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()


def agree_on_plan(make_plan) -> Plan:
    """Run ``make_plan()`` on rank 0, broadcast the result (or its error) and check every rank holds it."""
    world = dist.get_world_size()
    if world == 1:
        return make_plan()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", make_plan().model_dump(mode="json"))
        except Exception as exc:  # every rank must learn why, not hang in the broadcast
            payload[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise RuntimeConfigError(f"rank 0 could not make a plan: {value}")
    plan = plan_from_dict(value, "the plan broadcast by rank 0")
    check_same_plan(plan)
    return plan


def check_same_plan(plan: Plan) -> None:
    """Raise on every rank if the ranks do not hold identical plans (e.g. different plan files per node)."""
    world = dist.get_world_size()
    if world == 1:
        return
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, _plan_digest(plan))
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeConfigError(
            f"ranks {differ} hold a different plan than rank 0: give every rank the same plan file (or plan=None "
            "to let rank 0 decide)"
        )


# ----- plans this model and this runtime cannot run -------------------------------------------------------


def check_plan_matches(plan: Plan, spec: ModelSpec, seq_len: int | None) -> None:
    """A plan made for another architecture or sequence length would mis-size everything: refuse it."""
    differ = [f"{name}: plan {getattr(plan.model, name)!r} vs model {getattr(spec, name)!r}"
              for name in ARCHITECTURE_FIELDS if getattr(plan.model, name) != getattr(spec, name)]
    if differ:
        raise RuntimeConfigError(
            f"the plan was made for {plan.model.name}, not this model ({'; '.join(differ[:3])}): re-plan for this "
            "model (or pass plan=None)"
        )
    if seq_len is not None and seq_len != plan.train.seq_len:
        raise RuntimeConfigError(
            f"seq_len={seq_len} but the plan is for {plan.train.seq_len} tokens: pass seq_len={plan.train.seq_len} "
            "(or omit it), or re-plan"
        )


def refuse_unsupported(plan: Plan, family: Family = "llama") -> None:
    """Raise, with every reason, if the runtime cannot execute ``plan`` for a model of ``family``."""
    reasons = unsupported_reasons(plan, family)
    if reasons:
        raise RuntimeConfigError(
            f"the runtime cannot execute this plan ({len(reasons)} option(s)): " + " | ".join(reasons)
        )


# ----- the data's sharding rule ---------------------------------------------------------------------------

def sharding_choice(plan: Plan) -> tuple[str, str]:
    """The ring's sharding rule for ``plan`` and how it was decided: the rule its data shape (``--lengths``,
    or the dataset's recorded lengths) resolves to at its layout, as the planner priced it (under ``auto`` the
    faster at its ring degree; ring 1 splits no row: zigzag), or zigzag for a plan without a data shape."""
    data = plan.train.data
    if data is None:
        return "zigzag", "the plan has no data shape"
    balance = layout_balance(plan.model, plan.train, plan.layout)
    rule = balance.rule if balance is not None else "zigzag"
    if rule not in RUNTIME_SHARDINGS:
        raise RuntimeConfigError(f"the plan shards rows {rule!r}, which the planner prices but the runtime does not run "
                                 f"(it runs {' and '.join(RUNTIME_SHARDINGS)}): re-plan with --sharding auto, zigzag "
                                 "or per_document")
    if plan.layout.ring == 1:
        return rule, "ring=1: no row is split"
    how = "chosen by auto" if data.sharding == "auto" else "as requested"
    return rule, f"{how} at ring={plan.layout.ring}"


def plan_sharding(plan: Plan) -> str:
    """The ring's sharding rule for ``plan`` (:func:`sharding_choice`)."""
    return sharding_choice(plan)[0]


# ----- describing it --------------------------------------------------------------------------------------


def describe_plan(plan: Plan) -> list[str]:
    """Human-readable lines: the layout, the options and the prediction the plan was chosen on."""
    t, layout = plan.train, plan.layout
    lines = [
        f"plan: {layout.describe()} on {layout.world} rank(s) for {plan.model.name} "
        f"({plan.model.num_params / 1e6:,.1f}M params)",
        f"  seq_len {t.seq_len:,} x micro-batch {t.micro_batch} x grad-accum {t.grad_accum} | {t.dtype} | "
        f"ZeRO-{t.zero_stage} (FSDP2) | checkpointing {t.checkpointing} | optimizer {t.optimizer}"
        + "".join(f" | {name}" for name in TECHNIQUES if getattr(t, name)),
    ]
    est = plan.estimate or {}
    memory, timing = est.get("memory") or {}, est.get("time") or {}
    if memory and timing:
        lines.append(
            f"  predicted on {plan.hardware.topology}: {memory.get('total', 0) / 1e9:.2f} GB per rank, "
            f"step {timing.get('step_s', 0):.3g} s, {timing.get('tokens_per_s', 0):,.0f} tokens/s"
        )
    lines += [f"  why: {reason}" for reason in plan.explanation[:3]]
    return lines
