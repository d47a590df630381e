"""``sp-plan plan``: search every layout and memory option, recommend the fastest that fits."""

from __future__ import annotations

from typing import Any

import click
from pydantic import ValidationError

from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.atomic_io import write_output
from sp_plan.cost_models.errors import explain_validation_error
from sp_plan.cost_models.layout import Layout

from sp_plan.planner.capacity import probe_feasibility
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.plan import plan_from_ranked
from sp_plan.planner.band_report import band_lines, bands_json, prediction_bands
from sp_plan.planner.data_report import data_lines
from sp_plan.planner.adaptive_search import adaptive_json, adaptive_lines
from sp_plan.planner.report import explain_rejections, explain_winner, family_champions, headline, render_table, compare
from sp_plan.planner.sanity import check_figures
from sp_plan.planner.search import DEFAULT_GLOBAL_BATCH_TOKENS, DEFAULT_HEADROOM, PlanSettings, SearchResult, search
from ..plots import check_plot_path, draw_plan_times
from .common import (
    layout_keys,
    TokenCountType,
    SEARCHABLE_OPTIONS,
    build_assume,
    build_model,
    build_cluster,
    FiniteFloatRange,
    build_train,
    check_output_path,
    check_pipeline_flags_need_pp,
    hardware_options,
    layout_options,
    model_options,
    pinned,
    split_options,
)


def planning_options(func):
    """Flags shared by plan and capacity: --headroom, --global-batch-tokens, --max-offload-gb."""
    for option in reversed([
        click.option("--headroom", type=FiniteFloatRange(0.0, 0.9, max_open=True), default=DEFAULT_HEADROOM, show_default=True,
                     help="Fraction of GPU memory kept free beyond the modelled overheads."),
        click.option("--global-batch-tokens", type=TokenCountType("global batch", 1 << 40), default=DEFAULT_GLOBAL_BATCH_TOKENS,
                     show_default=True, help="Tokens per optimizer step every layout is compared at."),
        click.option("--max-offload-gb", type=FiniteFloatRange(0.0, 1e6), default=None, metavar="GB",
                     help="Most host memory (GB = 1e9 bytes) offloaded state may use per GPU; 0 forbids offloading. "
                          "Default: the node's RAM per GPU."),
    ]):
        func = option(func)
    return func


def _check_batch_holds_a_micro_batch(options: dict[str, Any], micro_pinned: bool) -> None:
    """Refuse a --global-batch-tokens below one (pinned) micro-batch of --seq-len tokens: every layout rounds the
    batch up to whole micro-batches per data-parallel rank, so 1K tokens at 32K planned steps of 32K-128K tokens
    under a headline of the asked-for batch."""
    seq_len, tokens = options.get("seq_len"), options["global_batch_tokens"]
    if seq_len is None:
        return
    micro = options.get("micro_batch", 1) if micro_pinned else 1
    least = micro * seq_len
    if tokens < least:
        what = (f"one micro-batch (--micro-batch {micro} x --seq-len {seq_len:,} = {least:,} tokens)" if micro > 1
                else f"one sequence of --seq-len {seq_len:,} tokens")
        raise PlannerError(f"--global-batch-tokens {tokens:,} is less than {what}, the least a step trains; give "
                           f"--global-batch-tokens {least} or more" + (", or a smaller --micro-batch" if micro > 1 else ""))


def settings_from(ctx: click.Context, options: dict[str, Any], top: int = 5) -> tuple[PlanSettings, dict, dict]:
    """PlanSettings from the command line: explicit layout degrees and memory options are pinned."""
    if "grad_accum" in pinned(ctx, ("grad_accum",)):
        raise PlannerError("plan derives gradient accumulation from --global-batch-tokens; drop --grad-accum")
    fixed_layout = {k: v for k, v in pinned(ctx, layout_keys()).items() if v is not None}
    split = options.get("stage_layers")
    if split is not None and fixed_layout.get("pp") != len(split):
        raise PlannerError(f"--stage-layers lists {len(split)} stages: pin the pipeline degree with --pp {len(split)}")
    micro_fixed = "micro_batch" in pinned(ctx, ("micro_batch",))
    if "global_batch_tokens" in pinned(ctx, ("global_batch_tokens",)):  # the default is rounded up quietly
        _check_batch_holds_a_micro_batch(options, micro_pinned=micro_fixed)
    fixed_options = pinned(ctx, SEARCHABLE_OPTIONS)
    if fixed_layout.get("pp") == 1:  # a pinned pipeline schedule or chunking cannot apply without stages
        check_pipeline_flags_need_pp(1, fixed_options.get("pipeline_schedule"), fixed_options.get("virtual_stages", 1))
    try:
        settings = PlanSettings(top_k=top, headroom=options["headroom"],
                                global_batch_tokens=options["global_batch_tokens"], fixed_layout=fixed_layout,
                                fixed_options=fixed_options, micro_batch_fixed=micro_fixed,
                                stack=options.get("stack"), calibration=options.get("calibration"),
                                assume=build_assume(options.get("assume", ())),
                                max_offload_bytes=(None if options.get("max_offload_gb") is None
                                                   else options["max_offload_gb"] * 1e9))
    except ValidationError as exc:
        raise explain_validation_error(exc, "planner settings") from exc
    train_kwargs, _ = split_options(options)
    return settings, train_kwargs, fixed_layout


def _with_data(plan, model, result: SearchResult, gpu: str | None) -> dict[str, Any]:
    """A plan's JSON, with what its data does at its layout when planned from ``--lengths``, and the error bands
    of its predictions."""
    from sp_plan.planner.data_report import data_summary

    out = plan.to_json_dict()
    summary = None if model is None else data_summary(model, plan.train, plan.layout, plan.estimate)
    if summary is not None:
        out["data"] = summary
    if model is not None and gpu is not None:
        out["uncertainty"] = bands_json(prediction_bands(model, plan.train, plan.layout, gpu=gpu, stack=result.stack,
                                                         calibration=result.calibration))
    return out


def result_json(result: SearchResult, extra: dict[str, Any] | None = None, model=None,
                gpu: str | None = None) -> dict[str, Any]:
    data = {
        "plans": [_with_data(p, model, result, gpu) for p in result.plans],
        "rejected": [r.model_dump(exclude_none=True) for r in result.rejected],
        "stats": result.stats.model_dump(),
        "global_batch_sequences": result.global_batch_sequences,
        "stack": result.stack,
        "calibration": result.calibration,
    }
    data.update(extra or {})
    return data


@click.command("plan")
@model_options
@hardware_options
@layout_options
@planning_options
@click.option("--top", type=click.IntRange(1, 100), default=5, show_default=True, help="How many plans to show.")
@click.option("--explain", is_flag=True, help="Also explain why the main alternatives lost or were rejected.")
@click.option("--json", "as_json", is_flag=True, help="Print plans and rejections as JSON.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="Write the winning plan to this YAML file (for the runtime and `sp-plan export`); - writes it "
                   "to standard output and the report to standard error.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="Also draw the step time of the --top plans by component (GEMMs, attention, recompute, exposed "
                   "communication by strategy, offload, optimizer, overheads) to this PNG, SVG or PDF (needs "
                   "matplotlib).")
@click.option("--adaptive-sp", "adaptive_sp", is_flag=True,
              help="Also plan length-adaptive SP (needs --lengths): buckets of document length, each on its own "
                   "Ulysses x Ring groups, priced against the single layout (table, or 'adaptive_sp' in --json).")
@click.option("--adaptive-out", "adaptive_out", type=click.Path(dir_okay=False), default=None,
              help="With --adaptive-sp: write the length-adaptive plan (buckets and their degrees) to this YAML file "
                   "for the runtime; --out still writes the single plan.")
@click.pass_context
def command(ctx: click.Context, model_name: str, gpus: int | None, gpus_per_node: int | None, gpu_name: str,
            topology_ref: str | None, top: int, explain: bool, as_json: bool, out_file: str | None,
            plot_file: str | None, adaptive_sp: bool = False, adaptive_out: str | None = None,
            **options: Any) -> None:
    """Recommend the fastest layout and memory options that fit.

    Layout degrees (--tp, --ulysses, ...) and memory options (--zero, --checkpointing, --tiled-mlp, ...)
    given on the command line are pinned; everything else is searched.
    """
    check_output_path(out_file, "--out")
    check_output_path(plot_file, "--plot")
    check_plot_path(plot_file)
    _check_adaptive_flags(adaptive_sp, adaptive_out, options)
    settings, train_kwargs, _ = settings_from(ctx, options, top)
    model = build_model(model_name)
    train = build_train(**train_kwargs)
    topology, gpus = build_cluster(gpus, gpus_per_node, gpu_name, topology_ref)
    result = search(model, train, topology, settings, world=gpus)
    if not result.plans:
        report = no_fit_report(model, train, topology, settings, result, gpus)
        if as_json:
            click.echo(strict_dumps(result_json(result, {"nearest": report["nearest"],
                                                       "suggestions": report["suggestions"]}), indent=2))
        else:
            click.echo(headline(model, train, topology, gpus, result))
            click.echo("\n".join(report["lines"]))
        ctx.exit(1)
    check_figures([p.to_json_dict() for p in result.plans], "the plans")
    adaptive = _adaptive(model, train, topology, settings, result, gpus, adaptive_out) if adaptive_sp else None
    explanation = explain_winner(result, model)
    to_stdout = out_file == "-"  # the plan file is standard output; the report goes to standard error
    if out_file:
        chosen = plan_from_ranked(result.plans[0], model, topology, gpus, explanation, stack=result.stack,
                                  calibration=result.calibration, assume=settings.assume)
        write_output(out_file, chosen.to_yaml(), error=PlannerError)
    if plot_file:
        draw_plan_times(result.plans, plot_file, f"{model.name} on {gpus} x {topology.gpu.name}")
    if as_json:
        extra = None if adaptive is None else {"adaptive_sp": adaptive_json(adaptive)}
        click.echo(strict_dumps(result_json(result, extra, model=model, gpu=topology.gpu.name), indent=2), err=to_stdout)
    else:
        best = result.plans[0]
        price = _pricer(model, best.layout, topology, settings) if explain else None
        bands = prediction_bands(model, best.train, best.layout, gpu=topology.gpu.name, stack=result.stack,
                                 calibration=result.calibration)
        t = best.estimate.time
        lines = [headline(model, train, topology, gpus, result), *render_table(result.plans, train.mode), "",
                 *explanation, *band_lines(bands, step_s=t.step_s, tokens_per_s=t.tokens_per_s,
                                           memory_bytes=best.estimate.memory.total),
                 *data_lines(model, best.train, best.layout, best.estimate, price)]
        if explain:
            lines += ["", *explain_alternatives(model, train, topology, settings, result, gpus)]
        s = result.stats
        lines.append(
            f"searched {s.layouts} layouts ({s.structural_rejections} structurally invalid combinations skipped, "
            f"{s.memory_evaluations} memory / {s.time_evaluations} time evaluations, {s.pruned_by_bound} pruned "
            f"by bound) in {s.seconds:.2f} s")
        if adaptive is not None:
            lines += adaptive_lines(adaptive)
        click.echo("\n".join(lines), err=to_stdout)
    if out_file and not to_stdout:
        click.echo(f"wrote plan to {out_file}", err=True)
    if plot_file:
        click.echo(f"wrote {plot_file}", err=True)
    if adaptive_out:
        click.echo(f"wrote length-adaptive SP plan to {adaptive_out}", err=True)


def _check_adaptive_flags(adaptive_sp: bool, adaptive_out: str | None, options: dict[str, Any]) -> None:
    """--adaptive-sp buckets the --lengths documents; --adaptive-out writes what it chose."""
    if adaptive_out is not None and not adaptive_sp:
        raise PlannerError("--adaptive-out writes the length-adaptive plan: add --adaptive-sp (and --lengths)")
    if adaptive_sp and options.get("lengths") is None:
        raise PlannerError("--adaptive-sp buckets the training documents by length: give --lengths FILE|PRESET "
                           "(see `sp-plan lengths --help`)")
    if adaptive_out == "-":
        raise PlannerError("--adaptive-out needs a file name (standard output carries the report): give a .yaml path")
    check_output_path(adaptive_out, "--adaptive-out")


def _adaptive(model, train, topology, settings: PlanSettings, result: SearchResult, world: int,
              adaptive_out: str | None):
    """The length-adaptive answer beside ``result`` (its single-layout plan), written to ``adaptive_out`` if asked."""
    from sp_plan.planner.adaptive_search import adaptive_search, plan_yaml

    adaptive = adaptive_search(model, train, topology, settings, world=world, single=result)
    if adaptive_out:
        if adaptive.plan is None:
            raise PlannerError("no length-adaptive split could be priced, so there is no plan to write to "
                               f"--adaptive-out {adaptive_out}: {adaptive.unpriced[0][1] if adaptive.unpriced else ''}")
        write_output(adaptive_out, plan_yaml(adaptive.plan), error=PlannerError)
    return adaptive


def _pricer(model, layout, topology, settings: PlanSettings):
    """Prices a variant of the recommended run at its layout (the data report's alternatives), None when it
    does not fit or is invalid there."""
    from sp_plan.cost_models.errors import CostModelError
    from sp_plan.cost_models.estimate import estimate
    from sp_plan.planner.search import resolve_settings

    profile = resolve_settings(settings, topology.gpu.name).profile

    def price(train):
        try:
            result = estimate(model, train, layout, topology, profile=profile)
        except CostModelError:
            return None
        return result if result.fits else None

    return price


def explain_alternatives(model, train, topology, settings: PlanSettings, result: SearchResult, world: int) -> list[str]:
    """Why the main alternatives lost: each other family's best layout is planned on its own and compared
    with the winner; then the grouped rejection reasons."""
    lines = ["Alternatives:"]
    best = result.plans[0]
    compared: set[str] = set()
    for fam, layout in sorted(family_champions(result).items()):
        fixed = settings.model_copy(update={"fixed_layout": layout, "top_k": 1})
        alt = search(model, train, topology, fixed, world=world)
        if alt.plans:
            first, *rest = compare(best, alt.plans[0])
            lines += [f"  best {fam} plan: {first}", *rest]
            compared.add(alt.plans[0].layout.describe())
    lines += explain_rejections(result, explained=compared)
    return lines


def no_fit_report(model, train, topology, settings: PlanSettings, result: SearchResult, world: int) -> dict:
    """What came closest and what would make the run fit: more GPUs, memory options, a shorter sequence."""
    from sp_plan.planner.capacity import max_seq_len, min_gpus
    from sp_plan.cost_models.topology import load_topology

    nearest = probe_feasibility(model, train, topology, settings, world=world)
    lines = ["No plan fits."]
    if nearest.layout:
        lines.append(f"  closest: {nearest.describe_miss()}")
    suggestions: list[str] = []
    limit = settings.max_offload_bytes
    if settings.fixed_options or settings.fixed_layout or limit is not None:
        free = settings.model_copy(update={"fixed_options": {}, "fixed_layout": {}, "max_offload_bytes": None})
        if probe_feasibility(model, train, topology, free, world=world).fits:
            pins = [f"{k}={v}" for k, v in {**settings.fixed_layout, **settings.fixed_options}.items()]
            if limit is not None:
                pins.append(f"--max-offload-gb {limit / 1e9:g}")
            suggestions.append(f"drop the pinned choices ({', '.join(pins)}): the planner finds a fitting plan "
                               "without them")
    try:
        answer = min_gpus(model, train, lambda n: load_topology(topology.name, n, topology.gpus_per_node)
                          if topology.name else topology, topology.gpus_per_node, settings, with_plan=False)
        example = Layout.for_world(answer.min_gpus, **answer.fitting_layout) if answer.fitting_layout else None
        suggestions.append(f"use at least {answer.min_gpus} GPUs" + (
            f" (e.g. {example.describe()}; `sp-plan plan --gpus {answer.min_gpus}` ranks the layouts)"
            if example else ""))
    except Exception as exc:  # noqa: BLE001 - advice is best effort; the error text is the advice
        suggestions.append(str(exc))
    try:
        seq = max_seq_len(model, train, topology, settings)
        suggestions.append(f"or shorten the sequence to at most {seq.max_seq_len:,} tokens on these {world} GPUs")
    except PlannerError as exc:
        suggestions.append(str(exc))
    if train.is_training and not settings.fixed_options and limit is None:
        suggestions.append("every memory option (ZeRO-3, full checkpointing, checkpoint/optimizer/parameter offload, "
                           "tiled MLP and loss) was already considered")
    lines += [f"  suggestion: {s}" for s in suggestions]
    return {"lines": lines, "suggestions": suggestions,
            "nearest": nearest.model_dump(exclude_none=True)}
