"""``sp-plan estimate``: the per-GPU memory breakdown of one layout, as a table or JSON."""

from __future__ import annotations

from typing import Any

import click
from pydantic import ValidationError

from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.stack import DEFAULT_STACK
from sp_plan.planner.band_report import band_lines, bands_json, prediction_bands
from sp_plan.cost_models.errors import CostModelError, explain_validation_error
from sp_plan.cost_models.estimate import Estimate, estimate
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory.kernel_limits import within_row_kernel_limit
from sp_plan.cost_models.memory.report import ALLOCATED_COMPONENTS
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.pipeline import stack_stage_layers
from sp_plan.cost_models.profile import CostProfile
from sp_plan.cost_models.text_table import Column, format_table
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.cost_models.units import GB, GiB, format_tokens

from sp_plan.planner.data_report import choose_packing, data_lines, data_summary
from sp_plan.planner.sanity import check_figures
from sp_plan.planner.search import DEFAULT_HEADROOM
from ..plots import check_plot_path, draw_estimate_memory
from .common import (
    build_assume,
    build_cluster,
    build_layout,
    build_model,
    build_profile,
    build_train,
    check_output_path,
    check_pipeline_flags_need_pp,
    hardware_options,
    layout_options,
    model_options,
    split_options,
)


def _with_stack_split(model: ModelSpec, train: TrainSpec, layout: Layout, profile: CostProfile) -> TrainSpec:
    """The stage split the stack runs when ``--stage-layers`` pins none (Megatron sets only the first and last
    stages), as the planner prices it; refused when the stack has no split of its form for these stages."""
    search = profile.stack.search
    if layout.pp == 1 or train.stage_layers is not None:
        return train
    reason = search.stage_split_refusal(model.num_layers, layout.pp, train.virtual_stages)
    if reason:
        raise CostModelError(f"{reason}; pin --stage-layers, or change --pp or --virtual-stages")
    split = stack_stage_layers(model, train, layout, search.stage_split)
    return train if split is None else train.model_copy(update={"stage_layers": split})


def _with_packing(model: ModelSpec, train: TrainSpec, layout: Layout, topology, profile: CostProfile) -> TrainSpec:
    """``--lengths`` without ``--packing``: the packing the planner would choose at this layout (the fastest that
    fits, see :func:`sp_plan.planner.data_report.choose_packing`)."""
    if train.data is None or train.data.packing != "auto":
        return train
    def price(variant: TrainSpec) -> Estimate | None:
        try:
            return estimate(model, variant, layout, topology, profile=profile)
        except CostModelError:
            return None

    return choose_packing(train, layout, price)


def run_estimate(model_name: str, gpus: int | None, gpus_per_node: int | None, gpu_name: str,
                 topology_ref: str | None, options: dict[str, Any]) -> Estimate:
    """Build the specs from CLI values and estimate; pydantic errors become one-line CostModelErrors."""
    return estimate_with_inputs(model_name, gpus, gpus_per_node, gpu_name, topology_ref, options)[0]


def estimate_with_inputs(model_name: str, gpus: int | None, gpus_per_node: int | None, gpu_name: str,
                         topology_ref: str | None, options: dict[str, Any]) -> tuple[Estimate, ModelSpec, TrainSpec, Layout]:
    """:func:`run_estimate` with the model, training spec and layout it priced (the data report reads them)."""
    try:
        train_kwargs, layout_kwargs = split_options(options)
        model = build_model(model_name)
        train = build_train(**train_kwargs)
        topology, gpus = build_cluster(gpus, gpus_per_node, gpu_name, topology_ref)
        layout = build_layout(gpus, **layout_kwargs)
        check_pipeline_flags_need_pp(layout.pp, options.get("pipeline_schedule"), options.get("virtual_stages", 1))
        profile = build_profile(topology.gpu.name, options.get("stack"), options.get("calibration"),
                                build_assume(options.get("assume", ())))
        train = _with_stack_split(model, train, layout, profile)
        train = _with_packing(model, train, layout, topology, profile)
        return estimate(model, train, layout, topology, profile=profile), model, train, layout
    except ValidationError as exc:
        raise explain_validation_error(exc, "input") from exc


@click.command("estimate")
@model_options
@hardware_options
@layout_options
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON (bytes).")
@click.option("--explain-time", is_flag=True,
              help="Break the step time into GEMMs, attention, recompute, communication, offload, optimizer and "
                   "overheads, with each one's efficiency and where that value came from.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="Also draw the memory per GPU by component and by phase of the step, against the capacity and "
                   "the planner's usable memory (capacity minus its default headroom), to this PNG, SVG or PDF "
                   "(needs matplotlib).")
def command(model_name: str, gpus: int | None, gpus_per_node: int | None, gpu_name: str, topology_ref: str | None,
            as_json: bool, explain_time: bool, plot_file: str | None, **options: Any) -> None:
    """Per-GPU memory of one layout (weights, gradients, optimizer, activations, logits, KV cache,
    buffers and overheads at the peak phase of the step, host memory), its communication volume per
    layer and per step, and the predicted step time, tokens/s and MFU on the topology."""
    check_output_path(plot_file, "--plot")
    check_plot_path(plot_file)
    result, model, train, layout = estimate_with_inputs(model_name, gpus, gpus_per_node, gpu_name, topology_ref, options)
    data = result.to_json_dict()
    lengths = data_summary(model, train, layout, result)
    if lengths is not None:
        data["data"] = lengths
    bands = prediction_bands(model, train, layout, gpu=result.detail.gpu,
                             stack=options.get("stack") or DEFAULT_STACK, calibration=options.get("calibration"))
    trust = band_lines(bands, step_s=result.time.step_s, tokens_per_s=result.time.tokens_per_s,
                       memory_bytes=result.memory.total)
    check_figures(data, "the estimate")  # never print a NaN or a 10^297 s step as an answer
    data["uncertainty"] = bands_json(bands)  # after the check: a band's bias is signed
    if plot_file:
        draw_estimate_memory(result, plot_file, headroom=DEFAULT_HEADROOM)
    if as_json:
        click.echo(strict_dumps(data, indent=2))
    elif explain_time:
        click.echo("\n".join([render_time_explanation(result), *trust, *data_lines(model, train, layout, result)]))
    else:
        click.echo("\n".join([render_table(result), *trust, *data_lines(model, train, layout, result)]))
    if plot_file:
        click.echo(f"wrote {plot_file}", err=True)


def _gb(n: float) -> str:
    return f"{n / GB:10.2f} {n / GiB:10.2f}"


def render_table(est: Estimate) -> str:
    """Readable breakdown: each component in GB and GiB, the peak phase and what decides it."""
    mem, det = est.memory, est.detail
    layout = est.layout.describe()
    kernel_line = (
        f"{det.model} | {det.mode} | {format_tokens(det.seq_len)} tokens x {det.micro_batch} | {det.dtype} | "
        f"{est.layout.world} x {det.gpu} | {layout} | stack {det.stack}"
    )
    rows = [kernel_line, f"{'per GPU':<28}{'GB':>11}{'GiB':>11}"]
    for name in ALLOCATED_COMPONENTS:
        rows.append(f"  {name:<26}{_gb(getattr(mem, name))}")
    rows.append(f"  {'= peak allocated':<26}{_gb(mem.peak_allocated)}")
    o = det.overhead
    comms = ", ".join(f"{c.name}({c.size})" for c in o.communicators) or "none"
    rows.append(f"  {'overhead':<26}{_gb(mem.overhead)}")
    rows.append(f"    {'CUDA context':<24}{_gb(o.cuda_context)}")
    rows.append(f"    {'NCCL':<24}{_gb(o.nccl)}   {len(o.communicators)} communicator(s): {comms}")
    rows.append(f"    {'fragmentation':<24}{_gb(o.fragmentation)}   allocator model: {o.allocator}")
    rows.append(f"  {'= total':<26}{_gb(mem.total)}   (what must fit)")
    if mem.device_used > mem.total:
        rows.append(f"  {'nvidia-smi shows':<26}{_gb(mem.device_used)}   (+ {o.cached_reserve / GB:.2f} GB cached "
                    "blocks the allocator releases before failing)")
    rows.append(f"  {'capacity':<26}{_gb(mem.capacity)}")
    margin = mem.capacity - mem.total
    verdict = f"fits, {margin / GB:.2f} GB to spare" if est.fits else f"does NOT fit: short by {-margin / GB:.2f} GB"
    if margin >= 0 and not within_row_kernel_limit(det.row_kernel_offset, det.row_kernel_offset_limit):
        verdict = (f"does NOT fit although memory has {margin / GB:.2f} GB to spare: the stack's row kernels compute "
                   f"offsets in int32 and this GPU's last row starts at element {det.row_kernel_offset:,}")
    rows.append(f"{verdict}; peak phase: {det.peak_phase} (at {det.phases[det.peak_phase].transient_peak_at})")
    rows.append("phases (allocated GB): " + ", ".join(f"{n} {p.allocated / GB:.2f}" for n, p in det.phases.items()))
    if det.pipeline is not None:
        pipe = det.pipeline
        rows.append(f"pipeline: figures above are stage {pipe.stage} of {len(pipe.stage_layers)} (the largest); per stage "
                    "(layers, micro-batches in flight, total GB): "
                    + ", ".join(f"{n}/{f:g}/{t / GB:.1f}" for n, f, t in zip(pipe.stage_layers, pipe.in_flight_microbatches,
                                                                             pipe.stage_totals)))
    b = det.buffers
    rows.append(
        f"buffers: comm staging {b.comm_staging / GB:.2f} GB, ZeRO-3 gathered params "
        f"{b.zero3_gathered_params / GB:.2f} GB, unsharded grads {b.unsharded_grads / GB:.2f} GB"
    )
    h = est.host_memory
    if h.total:
        rows.append(
            f"host memory: {h.total / GB:.2f} GB (weights {h.weights / GB:.2f}, gradients {h.gradients / GB:.2f}, "
            f"optimizer {h.optimizer / GB:.2f}, checkpoints {h.checkpoints / GB:.2f})"
        )
    else:
        rows.append("host memory: nothing offloaded")
    pl = det.per_layer
    if det.mode == "train":
        modes = ", ".join(f"{k} {v / GB:.3f}" for k, v in pl.saved_bytes_by_mode.items())
        rows.append(
            f"per layer: saved {pl.saved_bytes / GB:.3f} GB ({pl.checkpointing}; by mode: {modes}); "
            f"block forward peak {pl.forward_peak_bytes / GB:.2f} GB, "
            f"backward peak {pl.backward_peak_bytes / GB:.2f} GB"
        )
    else:
        rows.append(
            f"per layer: KV cache {det.kv_cache_per_layer / GB:.3f} GB; block forward peak "
            f"{pl.forward_peak_bytes / GB:.2f} GB (at {pl.forward_peak_at})"
        )
    u = det.ulysses
    if u.degree > 1:
        rows.append(
            f"ulysses all-to-all per GPU: Q {u.q_bytes_before / GB:.2f} -> {u.q_bytes_after / GB:.2f} GB, "
            f"K {u.k_bytes_before / GB:.2f} -> {u.k_bytes_after / GB:.2f} GB, V {u.v_bytes_before / GB:.2f} -> "
            f"{u.v_bytes_after / GB:.2f} GB; tokens {u.tokens_before:,} -> {u.tokens_after:,}; KV heads "
            f"{u.kv_heads_before} -> {u.kv_heads_after} (replication x{u.kv_replication})"
        )
    rows.extend(render_comm_time(est))
    return "\n".join(rows)


def render_comm_time(est: Estimate) -> list[str]:
    """Communication per layer by strategy and per step by collective; then the time breakdown."""
    comm, t = est.comm, est.time
    rows = [f"communication per GPU (bytes sent; topology {est.detail.topology})"]
    phases = ("forward", "backward", "backward_recompute")
    titles = ("forward", "backward (all)", "of which recompute")
    active = {k: v for k, v in comm.per_layer_bytes.items() if any(getattr(v, p, 0) or 0 for p in phases)}
    if active:
        rows.append(f"  {'per layer':<20}" + "".join(f"{p:>20}" for p in titles))
        for name, v in active.items():
            rows.append(f"  {name:<20}" + "".join(f"{(getattr(v, p, 0) or 0) / GB:>17.3f} GB" for p in phases))
    else:
        rows.append("  no per-layer communication")
    per_step = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in comm.by_collective.items() if v)
    rows.append(f"  per step: {comm.per_step_bytes / GB:.2f} GB" + (f" ({per_step})" if per_step else ""))
    exposed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.exposed_comm_s_by_strategy.items() if v > 0)
    rows.append("time per step")
    rows.append(f"  compute {t.compute_s:.3f} s, communication {t.comm_s:.3f} s of which exposed "
                f"{t.exposed_comm_s:.3f} s" + (f" ({exposed})" if exposed else ""))
    rows.append(f"  optimizer {t.optimizer_s:.3f} s, offload {t.offload_s:.3f} s")
    if t.pipeline_bubble_s > 0:
        b = t.breakdown
        rows.append(f"  pipeline bubble {t.pipeline_bubble_s:.3f} s; slowest stage {int(b['pipeline_slowest_stage'])}: "
                    f"{b['pipeline_stage_forward_s'] * 1e3:.1f} ms forward + {b['pipeline_stage_backward_s'] * 1e3:.1f} ms "
                    "backward per micro-batch")
    rows.append(f"  step {t.step_s:.3f} s | {t.tokens_per_s:,.0f} tokens/s | MFU {t.mfu:.1%} (HFU {t.hfu:.1%})")
    return rows


EXPLAIN_COLUMNS = (Column("part"), Column("seconds", ">"), Column("share", ">"), Column("efficiency"),
                   Column("from"))
#: (component, label, efficiency key or None) in the order the explanation lists them.
_EXPLAINED = (
    ("gemm_forward", "GEMMs forward (layers + LM head)", "matmul"),
    ("gemm_backward", "GEMMs backward", "matmul"),
    ("attention_forward", "attention forward", "attention_forward"),
    ("attention_backward", "attention backward", "attention_backward"),
    ("recompute", "recompute (checkpointing, tiling)", None),
    ("streaming", "norms, rotary, activations, residuals", "memory"),
    ("ulysses_copies", "Ulysses all-to-all copies", "memory"),
    ("fp8_casts", "fp8 amax and casts", "memory"),
    ("stack_overhead", "stack overhead (launch gaps, hooks)", "compute_overhead_fraction"),
)


#: (strategy, efficiency_sources key) of the communication a stack may hide behind compute
#: (sp_plan.cost_models.strategies.overlap): each gets a line with its exposed and hidden seconds and its origin.
_OVERLAPPED = (("tp", "tp_overlap"), ("ep", "ep_overlap"))


def render_time_explanation(est: Estimate) -> str:
    """The step split into what it is spent on, each part's efficiency and that value's origin, so a
    user can see why a step takes what it takes and which figure a ``calibrate`` run on their own
    cluster should move."""
    t, det = est.time, est.detail
    parts, sources, eff = t.components, t.efficiency_sources, t.efficiencies
    peak = t.peak_flops / 1e12
    rows = [
        f"{det.model} | {format_tokens(det.seq_len)} tokens x {det.micro_batch} | {det.dtype} | "
        f"{est.layout.world} x {det.gpu} | {est.layout.describe()} | stack {det.stack}",
        f"step {t.step_s:.3f} s = what each part takes on the critical path (peak {peak:,.4g} TFLOP/s per GPU, "
        f"sustained clock x{eff.get('clock', 1.0):.3f}: {sources.get('clock', '')})",
    ]
    table: list[list[str]] = []

    def row(label: str, seconds: float, efficiency: str = "", source: str = "") -> None:
        share = seconds / t.step_s if t.step_s > 0 else 0.0
        if share < 1e-5:  # a few microseconds of a long step: noise in a table meant to explain it
            return
        table.append([label, f"{seconds:.4f}", f"{share:.1%}", efficiency, source])

    for key, label, eff_key in _EXPLAINED:
        seconds = parts.get(key, 0.0)
        if seconds <= 0:
            continue
        if key.startswith("attention"):
            label = f"{label} ({sources.get('attention_kernel', '?')})"
        if eff_key == "compute_overhead_fraction":
            text, source = f"+{eff.get(eff_key, 0.0):.1%} of kernel time", sources.get(eff_key, "")
        elif eff_key == "memory":
            text, source = f"{eff['memory']:.3f} of HBM bandwidth", sources.get("memory", "")
        elif eff_key is not None:
            text, source = f"{eff[eff_key]:.3f} of peak (asymptotic)", sources.get(eff_key, "")
        else:
            text, source = "forward kernels run again", ""
        row(label, seconds, text, source)
    for name, seconds in parts.items():
        if name.startswith("exposed_comm_") and seconds > 0:
            strategy = name.removeprefix("exposed_comm_")
            row(f"exposed communication: {strategy}", seconds, "link bandwidth x efficiency",
                f"topology ({det.topology})")
    notes = []
    for strategy, note_key in _OVERLAPPED:
        hidden = t.hidden_comm_s_by_strategy.get(strategy, 0.0)
        note = sources.get(note_key)
        if note is None:
            continue
        exposed = parts.get(f"exposed_comm_{strategy}", 0.0)
        notes.append(f"  {strategy} communication: {exposed:.4f} s exposed, {hidden:.4f} s hidden (not in the step); "
                     f"{note}")
    if parts.get("pipeline_bubble", 0.0) > 0:
        row("pipeline bubble (stages idle in fill and drain)", parts["pipeline_bubble"],
            f"{est.layout.pp} stages, slowest stage {int(t.breakdown['pipeline_slowest_stage'])}",
            "schedule math (cost_models/pipeline.py)")
    if parts.get("interference", 0.0) > 0:
        row("compute slowed by overlapped collectives", parts["interference"], "", "kernel model")
    if parts.get("offload", 0.0) > 0:
        row("offload (exposed PCIe traffic)", parts["offload"], f"{eff.get('pcie', 0.0):.3f} of PCIe",
            f"topology ({det.topology})")
    if parts.get("optimizer", 0.0) > 0:
        row("optimizer step", parts["optimizer"], "HBM / host CPU", "kernel model, stack file")
    if parts.get("step_overhead", 0.0) > 0:
        row("stack overhead per step", parts["step_overhead"], "", sources.get("step_overhead_s", ""))
    if parts.get("moe_host_sync", 0.0) > 0:
        row("MoE layers waiting on the host (dispatcher sync)", parts["moe_host_sync"], "per MoE layer pass",
            sources.get("moe_host_sync", ""))
    if parts.get("host_overhead", 0.0) > 0:
        row("host overhead per step (CPU ranks)", parts["host_overhead"], "measured",
            f"topology ({det.topology}): the plan run at a short length")
    elif str(det.gpu).startswith("cpu"):
        notes.append("  CPU ranks: not in this step: the host overhead of each step (gloo calls as the step meets "
                     "them, FSDP2 hooks, eager dispatch; 40-150 ms per step for the README's tiny Llama on 2 cores), "
                     "which no kernel rate predicts; `sp-plan validate` measures it by running the plan short")
    total = sum(parts.values())
    table.append(["= step", f"{total:.4f}", f"{total / t.step_s if t.step_s > 0 else 0.0:.1%}"])
    rows += format_table(EXPLAIN_COLUMNS, table, indent="  ")
    rows += notes
    rows.append(f"  {t.tokens_per_s:,.0f} tokens/s | MFU {t.mfu:.1%} (HFU {t.hfu:.1%}); efficiencies are the "
                "asymptotic fractions, each kernel's shape lowers them (GEMM tiles and waves, attention length)")
    if sources.get("kernel_data_sources"):
        rows.append(f"  kernel data: {sources['kernel_data_sources']} (cost_models/data/calibration/kernels.yaml); "
                    f"attention kernel from the {sources.get('attention_kernel_from', 'stack file')}")
    rows.append("  to move a value for your cluster: sp-plan validate ... --json, then sp-plan calibrate")
    return "\n".join(rows)
