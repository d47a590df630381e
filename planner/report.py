"""Human-readable planner output: the plan table, why the winner won, why alternatives lost, and what
would make an infeasible run fit. Every sentence is built from the estimates' numbers."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from sp_plan.cost_models import degrees as registry
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.topology import Topology
from sp_plan.cost_models.text_table import Column, format_table
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.cost_models.units import GB, format_tokens

from .search import RankedPlan, Rejection, SearchResult

STRATEGIES = ("tp", "ulysses", "ring", "ep", "fsdp", "dp")


def family(layout: Layout | dict[str, int]) -> str:
    """The kind of model/sequence parallelism a layout uses (data parallelism aside)."""
    degrees = layout.as_dict() if isinstance(layout, Layout) else layout
    parts = [name for name in registry.searched("model") if degrees.get(name, 1) > 1]
    experts = f" + ep={degrees['ep']}" if degrees.get("ep", 1) > 1 else ""
    if parts == ["ulysses", "ring"] or parts == ["ring", "ulysses"]:
        return "ulysses x ring (USP)" + experts
    return (" x ".join(parts) or "data parallel only") + experts


def describe_options(options: dict[str, Any], mode: str) -> str:
    parts = [f"ZeRO-{options['zero_stage']}"] if "zero_stage" in options else []
    if mode == "train":
        mode_ = options.get("checkpointing", "none")
        parts.append("no ckpt" if mode_ == "none" else f"{mode_} ckpt")
    for key, label in (("offload_checkpoints", "offload ckpt"), ("tiled_mlp", "tiled MLP"),
                       ("tiled_loss", "tiled loss"), ("offload_optimizer", "offload optim"),
                       ("offload_params", "offload params")):
        if options.get(key):
            parts.append(label)
    if mode == "train":
        parts.append(f"mb {options.get('micro_batch', 1)} x GA {options.get('grad_accum', 1)}")
    schedule = options.get("pipeline_schedule")  # pipelined plans only
    if schedule is not None:
        parts.append({"1f1b": "1F1B", "zero_bubble": "ZB-H1"}.get(
            schedule, f"interleaved 1F1B x{options.get('virtual_stages', 1)}"))
    return ", ".join(parts)


def headline(model: ModelSpec, train: TrainSpec, topology: Topology, world: int, result: SearchResult) -> str:
    nodes = max(1, -(-world // topology.gpus_per_node))
    batch = ""
    if train.is_training:
        batch = (f" | global batch {result.global_batch_sequences} x {format_tokens(train.seq_len)} tokens "
                 f"(per layout rounded up to whole sequences per data-parallel rank)")
    return (f"{model.name} | {train.mode} | {format_tokens(train.seq_len)} tokens | {train.dtype} | {world} x "
            f"{topology.gpu.name} ({topology.name}, {nodes} node{'s' if nodes > 1 else ''}){batch}"
            f" | {stack_text(result)}")


def stack_text(result: SearchResult) -> str:
    """What the predictions assume, for headers: the stack and the calibration file, if any."""
    text = f"stack {result.stack}"
    return text + (f", calibration {result.calibration}" if result.calibration else "")


PLAN_COLUMNS = (Column("#", ">"), Column("layout"), Column("options"), Column("mem/GPU", ">"), Column("step", ">"),
                Column("tokens/s", ">"), Column("MFU", ">"), Column("exposed comm", ">"))


def render_table(plans: Iterable[RankedPlan], mode: str) -> list[str]:
    rows = []
    for p in plans:
        t, m = p.estimate.time, p.estimate.memory
        rows.append([str(p.rank), p.layout.describe(), describe_options(p.options, mode), f"{m.total / GB:.1f} GB",
                     f"{t.step_s:.2f} s", f"{t.tokens_per_s:,.0f}", f"{t.mfu:.1%}", f"{t.exposed_comm_s:.3f} s"])
    return format_table(PLAN_COLUMNS, rows)


def _placement_text(plan: RankedPlan) -> str:
    placement = plan.estimate.placement
    if placement is None:
        return ""
    parts = []
    for dim in (*registry.innermost_first(), "ep"):  # ep: the expert-parallel group, inside the shard group
        group = placement.groups.get(dim)
        if group is None or group.size <= 1:
            continue
        where = f"{group.link_class}" + (f", spans {group.nodes_spanned} nodes" if group.nodes_spanned > 1 else
                                         ", inside one node")
        parts.append(f"{dim} x{group.size} on {where}")
    return "; ".join(parts)


def _exposed(plan: RankedPlan) -> dict[str, float]:
    return plan.estimate.time.exposed_comm_s_by_strategy


def _layer_bytes(plan: RankedPlan, strategy: str, phase: str = "forward") -> float:
    entry = plan.estimate.comm.per_layer_bytes.get(strategy)
    return float(getattr(entry, phase, 0.0) or 0.0) if entry is not None else 0.0


def compare(winner: RankedPlan, other: RankedPlan, indent: str = "    ") -> list[str]:
    """What separates two plans, one aligned line each: per-layer traffic by strategy, exposed
    communication per step, compute, memory options."""
    width = max(len(winner.layout.describe()), len(other.layout.describe()))
    lines = [f"{other.layout.describe()} {_standing(winner, other)}:"]
    for plan in (winner, other):
        traffic = ", ".join(
            f"{s} {_layer_bytes(plan, s) / GB:.2f} GB" for s in ("tp", "ulysses", "ring", "ep") if _layer_bytes(plan, s) > 0)
        exposed = ", ".join(f"{s} {v:.3f}" for s, v in sorted(_exposed(plan).items(), key=lambda kv: -kv[1])
                            if v > 1e-4)
        t = plan.estimate.time
        lines.append(
            f"{indent}{plan.layout.describe():<{width}} | per layer (fwd): {traffic or 'no SP/TP traffic'} | exposed "
            f"comm {t.exposed_comm_s:.3f} s/step" + (f" ({exposed})" if exposed else "")
            + f" | compute {t.compute_s:.2f} s | {describe_options(plan.options, plan.train.mode)}")
    return lines


def _standing(winner: RankedPlan, other: RankedPlan) -> str:
    """How ``other`` compares with the plan ranked above it, on the tokens/s the table shows. The ranking
    discounts each moving part slightly (the near-tie rule), so a plan can rank lower while being a
    little faster: then say that, not "+0.00% slower"."""
    slower = winner.estimate.time.tokens_per_s / other.estimate.time.tokens_per_s - 1
    if slower > 0.00005:
        return f"is {slower:+.2%} slower"
    behind = other.score / winner.score - 1
    pace = "as fast" if slower > -0.00005 else f"{-slower:.2%} faster"
    return (f"is {pace} but ranks {behind:+.3%} behind: the near-tie rule discounts each moving part "
            f"({other.moving_parts} vs {winner.moving_parts}) so that near-ties go to the simpler plan")


def explain_winner(result: SearchResult, model: ModelSpec) -> list[str]:
    best = result.plans[0]
    est, t, m = best.estimate, best.estimate.time, best.estimate.memory
    lines = [f"Recommended: {best.layout.describe()} with {describe_options(best.options, best.train.mode)}."]
    lines.append(
        f"  step {t.step_s:.3f} s = compute {t.compute_s:.3f} s + exposed communication {t.exposed_comm_s:.3f} s"
        f" + optimizer {t.optimizer_s:.3f} s + offload {t.offload_s:.3f} s"
        + (f" + pipeline bubble {t.pipeline_bubble_s:.3f} s" if t.pipeline_bubble_s > 0 else "")
        + f"; {t.tokens_per_s:,.0f} tokens/s, "
        f"MFU {t.mfu:.1%}")
    lines.append(
        f"  memory {m.total / GB:.1f} GB per GPU of {m.capacity / GB:.1f} GB (usable {result.usable_bytes / GB:.1f} GB "
        f"after headroom), peak in {est.detail.peak_phase}"
        + (f"; host {est.host_memory.total / GB:.1f} GB per GPU" if est.host_memory.total else ""))
    placement = _placement_text(best)
    if placement:
        lines.append(f"  placement: {placement}")
    rep = model.kv_replication(best.layout.head_split)
    if rep > 1:
        lines.append(f"  KV heads replicated x{rep}: {model.num_kv_heads} KV heads < tp x ulysses = "
                     f"{best.layout.head_split}; each rank holds a copy of its KV head")
    other = next((p for p in result.plans[1:] if family(p.layout) != family(best.layout)), None)
    if other is not None:
        first, *rest = compare(best, other)
        lines += [f"  vs the best {family(other.layout)} plan: {first}", *rest]
    return lines


def explain_rejections(result: SearchResult, limit: int = 12, explained: Collection[str] = ()) -> list[str]:
    """Grouped reasons the other layouts lost or were never viable. ``explained``: layouts (as
    :meth:`Rejection.describe_layout` writes them) already compared with the winner on their own, e.g. the
    best plan of each family under --explain's Alternatives: listing them again as "pruned" would contradict
    the comparison just shown."""
    lines: list[str] = []
    by_kind: dict[str, list[Rejection]] = {}
    for r in result.rejected:
        if r.describe_layout() not in explained:
            by_kind.setdefault(r.kind, []).append(r)
    titles = {
        "slower": "fit but ranked lower",
        "bound": "pruned: cannot beat the plans shown",
        "memory": "out of memory even with every allowed memory option",
        "structure": "invalid for this model / sequence / machine",
    }
    for kind in ("slower", "bound", "memory", "structure"):
        items = by_kind.get(kind, [])
        if not items:
            continue
        lines.append(f"{titles[kind]} ({len(items)}):")
        if kind == "bound":
            lines.append("  (discounted tokens/s: the ranking's figure, a small discount per moving part so that "
                         "near-ties go to the simpler plan; the table above shows undiscounted tokens/s)")
        if kind == "memory":
            items = sorted(items, key=lambda r: r.shortfall_bytes or 0.0)
        elif kind in ("slower", "bound"):
            items = sorted(items, key=lambda r: r.score if r.score is not None else float("inf"))
        seen_families: set[str] = set()
        shown = 0
        for r in items:
            fam = family(r.layout) if kind != "structure" else r.describe_layout()
            if fam in seen_families and kind != "structure":
                continue
            seen_families.add(fam)
            lines.append(f"  {r.describe_layout():<36} {r.reason}")
            shown += 1
            if shown >= limit:
                break
        if len(items) > shown:
            lines.append(f"  ... and {len(items) - shown} more (see --json)")
    return lines


def family_champions(result: SearchResult) -> dict[str, dict[str, int]]:
    """Best-scoring layout of each family that is not among the plans shown (for --explain)."""
    shown = {family(p.layout) for p in result.plans}
    champions: dict[str, tuple[float, dict[str, int]]] = {}
    for r in result.rejected:
        if r.kind not in ("slower", "bound") or r.score is None:
            continue
        fam = family(r.layout)
        if fam in shown:
            continue
        if fam not in champions or r.score < champions[fam][0]:
            champions[fam] = (r.score, r.layout)
    return {fam: layout for fam, (_, layout) in champions.items()}
