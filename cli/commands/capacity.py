"""``sp-plan capacity``: the longest trainable sequence, the fewest GPUs, and sweeps."""

from __future__ import annotations

from typing import Any

import click

from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.planner.band_report import CALIBRATE_HINT, band_lines, bands_json, prediction_bands
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.text_table import Column, format_table
from sp_plan.cost_models.units import GB, format_tokens, parse_seq_len

from sp_plan.planner.capacity import MAX_GPUS, SweepPoint, max_seq_len, min_gpus, sweep
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.report import describe_options
from sp_plan.planner.sanity import check_figures
from sp_plan.planner.uncertainty import pct, significant
from ..plots import check_plot_path, draw_sweep
from .common import build_model, build_topology, build_train, check_output_path, hardware_options, \
    layout_options, model_options_optional_seq
from .plan import planning_options, settings_from


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """``gpus=8,16,32`` or ``seq=128K,256K,1M``."""
    key, _, values = text.partition("=")
    key = key.strip().lower().replace("-", "_")
    if key not in ("gpus", "seq", "seq_len") or not values:
        raise PlannerError(f"cannot read --sweep {text!r}: use gpus=8,16,32 or seq=128K,256K,1M")
    try:
        if key == "gpus":
            points = [int(v) for v in values.split(",")]
            if any(p < 1 or p > MAX_GPUS for p in points):
                raise ValueError
        else:
            points = [parse_seq_len(v.strip()) for v in values.split(",")]
    except (ValueError, CostModelError) as exc:
        raise PlannerError(f"cannot read the values of --sweep {text!r}: {exc or 'expected positive integers'}") from exc
    return ("gpus" if key == "gpus" else "seq"), points


def _plan_json(plan) -> dict[str, Any] | None:
    return plan.to_json_dict() if plan is not None else None


def _stack_fields(settings, gpu_name: str) -> dict[str, Any]:
    """The stack and calibration the answers assume, as a plan file records them."""
    from sp_plan.planner.search import resolve_settings

    resolved = resolve_settings(settings, gpu_name)
    return {"stack": resolved.stack, "calibration": resolved.calibration}


def _stack_note(fields: dict[str, Any]) -> str:
    return f"stack {fields['stack']}" + (f", calibration {fields['calibration']}" if fields["calibration"] else "")


@click.command("capacity")
@model_options_optional_seq
@hardware_options
@layout_options
@planning_options
@click.option("--max-gpus", type=click.IntRange(1, MAX_GPUS), default=MAX_GPUS, show_default=True,
              help="Upper bound for the fewest-GPUs search.")
@click.option("--sweep", "sweep_spec", default=None, help="gpus=8,16,32 (needs --seq-len) or seq=128K,1M (needs --gpus).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="With --sweep: draw memory breakdown bars and tokens/s to this PNG (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def command(ctx: click.Context, model_name: str, gpus: int | None, gpus_per_node: int | None, gpu_name: str,
            topology_ref: str | None, max_gpus: int, sweep_spec: str | None, plot_file: str | None, as_json: bool,
            **options: Any) -> None:
    """What-if capacity questions.

    Without --seq-len: the longest sequence --gpus can train (and the plan that reaches it).
    With --seq-len: the fewest GPUs that can train it. --sweep prints the best plan at each point.
    """
    check_output_path(plot_file, "--plot")
    check_plot_path(plot_file)
    settings, train_kwargs, _ = settings_from(ctx, options, top=1)
    model = build_model(model_name)
    seq_len = train_kwargs.pop("seq_len", None)
    per_node = gpus_per_node

    def topology_for(n: int):
        return build_topology(n, per_node, gpu_name, topology_ref)

    if plot_file and not sweep_spec:
        raise PlannerError("--plot draws a sweep: add --sweep gpus=... or --sweep seq=...")
    if sweep_spec:
        key, values = parse_sweep(sweep_spec)
        if key == "gpus":
            if seq_len is None:
                raise PlannerError("--sweep gpus=... needs --seq-len")
            points = [(g, seq_len) for g in values]
        else:
            if gpus is None:
                raise PlannerError("--sweep seq=... needs --gpus")
            points = [(gpus, s) for s in values]
        base = build_train(seq_len=points[0][1], **train_kwargs)
        results = sweep(model, base, topology_for, points, settings)
        check_figures([_plan_json(p.plan) for p in results if p.plan is not None], "the sweep")
        stack = _stack_fields(settings, topology_for(points[0][0]).gpu.name)
        bands = [sweep_bands(model, p, stack) for p in results]
        if plot_file:
            draw_sweep(results, key, plot_file, model.name, headroom=settings.headroom)
        if as_json:
            click.echo(strict_dumps({"sweep": [
                {"gpus": p.gpus, "seq_len": p.seq_len, "plan": _plan_json(p.plan),
                 "nearest": p.nearest.model_dump(exclude_none=True) if p.nearest else None,
                 **({"refused": p.refused} if p.refused else {}),
                 **({"uncertainty": bands_json(b)} if b else {})} for p, b in zip(results, bands)],
                **stack}, indent=2))
        else:
            click.echo(f"{model.name}: best plan per point ({_stack_note(stack)})")
            click.echo(render_sweep(results, base.mode, bands))
        if plot_file:
            click.echo(f"wrote {plot_file}", err=True)
        if not any(p.plan for p in results):  # every point is a "no plan fits" answer: exit 1 (README)
            ctx.exit(1)
        return
    if seq_len is None:
        if gpus is None:
            raise PlannerError("give --gpus (for the longest sequence) or --seq-len (for the fewest GPUs)")
        topology = topology_for(gpus)
        # Validated at a length that holds one --document-length document: the search itself starts at the
        # granule (1,024 tokens on 8 GPUs), and a shorter sequence is simply one document.
        base = build_train(seq_len=max(seq_granule_start(gpus), train_kwargs.get("document_length") or 0),
                           **train_kwargs)
        answer = max_seq_len(model, base, topology, settings)
        stack = _stack_fields(settings, topology.gpu.name)
        data = {"max_seq_len": answer.max_seq_len, "granule": answer.granule, "gpus": gpus,
                "bound_by": answer.bound_by, "plan": _plan_json(answer.plan), **stack}
        text = (f"{model.name} on {gpus} x {topology.gpu.name}: longest sequence {answer.max_seq_len:,} tokens "
                f"({format_tokens(answer.max_seq_len)}; searched in steps of {answer.granule:,}; {_stack_note(stack)})")
        plan = answer.plan
    else:
        base = build_train(seq_len=seq_len, **train_kwargs)
        if per_node is None:
            per_node = topology_for(min(8, max_gpus)).gpus_per_node
        answer = min_gpus(model, base, topology_for, per_node, settings, max_gpus=max_gpus)
        gpu = topology_for(answer.min_gpus).gpu.name
        stack = _stack_fields(settings, gpu)
        data = {"min_gpus": answer.min_gpus, "seq_len": seq_len, "plan": _plan_json(answer.plan), **stack}
        text = f"{model.name} at {seq_len:,} tokens needs at least {answer.min_gpus} x {gpu} ({_stack_note(stack)})"
        plan = answer.plan
    check_figures(data, "the capacity answer")
    bands = {}
    if plan is not None:
        wanted = ("max_length", "memory", "step_time") if seq_len is None else ("memory", "step_time")
        bands = prediction_bands(model, plan.train, plan.layout, gpu=plan.estimate.detail.gpu, stack=stack["stack"],
                                 calibration=stack["calibration"], quantities=wanted)
        data["uncertainty"] = bands_json(bands)  # after the check: a band's bias is signed
    if as_json:
        click.echo(strict_dumps(data, indent=2))
        return
    click.echo(text)
    if plan is not None:
        t, m = plan.estimate.time, plan.estimate.memory
        click.echo(f"  plan: {plan.layout.describe()} with {describe_options(plan.options, plan.train.mode)}; "
                   f"{m.total / GB:.1f} GB per GPU, step {t.step_s:.2f} s, {t.tokens_per_s:,.0f} tokens/s, "
                   f"MFU {t.mfu:.1%}")
    if data.get("bound_by"):
        click.echo(f"  limit: {data['bound_by']}")
    if plan is not None:
        t = plan.estimate.time
        click.echo("\n".join(band_lines(bands, step_s=t.step_s, tokens_per_s=t.tokens_per_s,
                                        memory_bytes=plan.estimate.memory.total,
                                        max_seq_len=data.get("max_seq_len"))))


def seq_granule_start(gpus: int) -> int:
    from sp_plan.planner.capacity import seq_granule

    return seq_granule(gpus)


SWEEP_COLUMNS = (Column("GPUs", ">"), Column("seq", ">"), Column("layout"), Column("options"), Column("mem/GPU", ">"),
                 Column("step", ">"), Column("tokens/s", ">"), Column("MFU", ">"))
#: The sweep's band column, shown only when the rows' bands differ (else one footnote states the band).
BAND_COLUMN = Column("+/- (1 sigma)", ">")
#: What a sweep row's band covers: the same quantities as the fewest-GPUs answer.
SWEEP_QUANTITIES = ("memory", "step_time")


def sweep_bands(model, point: SweepPoint, stack: dict[str, Any]) -> dict | None:
    """The trust band of a sweep row's plan (as a single capacity answer's), or None for a point without one."""
    plan = point.plan
    if plan is None:
        return None
    return prediction_bands(model, plan.train, plan.layout, gpu=plan.estimate.detail.gpu, stack=stack["stack"],
                            calibration=stack["calibration"], quantities=SWEEP_QUANTITIES)


def _band_text(bands: dict) -> str:
    """One band set in words: ``step, tokens/s +/-33% (1 sigma; ...); memory +/-4% (...)``."""
    step, memory = bands["step_time"], bands["memory"]
    return f"step, tokens/s, MFU {step.describe()}; memory {memory.describe()}"


def _band_cell(bands: dict) -> str:
    step, memory = bands["step_time"], bands["memory"]
    return " / ".join(f"{what} {'+/-' + pct(b.one_sigma) if b.known else '?'}"
                      for what, b in (("step", step), ("mem", memory)))


def render_sweep(points: list[SweepPoint], mode: str, bands: list[dict | None] | None = None) -> str:
    """The sweep table. ``bands``: each row's trust band (:func:`sweep_bands`); the figures are rounded to what
    it supports, and the band is stated once under the table when every row has the same one, else in a column
    keyed to footnotes."""
    bands = bands or [None] * len(points)
    texts = {_band_text(b): None for b in bands if b}  # distinct bands, in row order
    keyed = len(texts) > 1
    keys = {text: chr(ord("a") + i) for i, text in enumerate(texts)}
    rows, notes = [], []
    for p, band in zip(points, bands):
        where = [str(p.gpus), format_tokens(p.seq_len)]
        if p.plan is None:
            if p.refused is not None:  # a footnote: a long reason in the layout column would widen every row
                notes.append(f"[{len(notes) + 1}] {format_tokens(p.seq_len)} on {p.gpus} GPUs: {p.refused}")
                rows.append([*where, f"no plan [{len(notes)}]"])
                continue
            if p.nearest is not None and p.nearest.kernel_limit is not None:
                rows.append([*where, f"does not fit ({p.nearest.kernel_limit})"])
                continue
            miss = (f" (closest is short by {p.nearest.shortfall_bytes / GB:.1f} GB)"
                    if p.nearest and p.nearest.layout is not None else "")
            rows.append([*where, f"does not fit{miss}"])
            continue
        t, m = p.plan.estimate.time, p.plan.estimate.memory
        if band is None:
            figures = [f"{m.total / GB:.1f} GB", f"{t.step_s:.2f} s", f"{t.tokens_per_s:,.0f}", f"{t.mfu:.1%}"]
        else:
            step, memory = band["step_time"], band["memory"]
            figures = [f"{significant(m.total / GB, memory)} GB", f"{significant(t.step_s, step)} s",
                       significant(t.tokens_per_s, step), f"{significant(100 * t.mfu, step)}%"]
        row = [*where, p.plan.layout.describe(), describe_options(p.plan.options, mode), *figures]
        if keyed:
            row.append(f"{_band_cell(band)} [{keys[_band_text(band)]}]" if band else "")
        rows.append(row)
    columns = (*SWEEP_COLUMNS, BAND_COLUMN) if keyed else SWEEP_COLUMNS
    if keyed:
        trust = [f"[{key}] {text}" for text, key in keys.items()]
    else:
        trust = [f"trust (every row): {text}" for text in texts]
    hint = [CALIBRATE_HINT] if any(b and not any(x.calibrated for x in b.values()) for b in bands) else []
    return "\n".join([*format_table(columns, rows), *notes, *trust, *hint])
