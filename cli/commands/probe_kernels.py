"""``sp-plan probe --kernels``: time the kernels the planner prices on this device, fit, write a calibration file.

The machine kit of a lent GPU: this machine's topology (given with ``--topology``, or probed and written to
``--out``), the GEMM and attention timings at the planner's shapes (:mod:`sp_plan.runtime.probe.kernels`),
the kernel-model fit (:mod:`sp_plan.planner.fitting.probe_fit`) and a calibration file that
``estimate``/``plan``/``capacity`` take with ``--calibration FILE`` on that topology.
"""

from __future__ import annotations

import datetime as _dt
import platform
from pathlib import Path

import click
import yaml
from sp_plan.cost_models.atomic_io import write_output
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.text_table import Column, format_table
from sp_plan.cost_models.units import parse_token_count

#: Bounds on what one kernel probe may be asked to time.
MAX_SEQ_LENS, MAX_LAYOUTS, MAX_DEGREE, MAX_KERNEL_SEQ = 8, 8, 1024, 1 << 20
LAYOUT_KEYS = ("tp", "ulysses", "ring")
TABLE = (Column("kernel"), Column("shape"), Column("measured", ">"), Column("before", ">"), Column("after", ">"),
         Column("split"))


def parse_seq_lens(text: str) -> list[int]:
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    if not tokens or len(tokens) > MAX_SEQ_LENS:
        raise click.BadParameter(f"give 1 to {MAX_SEQ_LENS} comma-separated lengths, e.g. 4K,16K",
                                 param_hint="'--seq-lens'")
    try:
        return sorted({parse_token_count(t, "--seq-lens", MAX_KERNEL_SEQ) for t in tokens})
    except CostModelError as exc:
        raise click.BadParameter(str(exc), param_hint="'--seq-lens'") from None


def parse_layout(text: str) -> Layout:
    """``ulysses=8`` or ``tp=2,ring=4`` (``tp=1``: no parallelism) as a Layout."""
    degrees: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in LAYOUT_KEYS or key in degrees:
            raise click.BadParameter(f"{text!r}: use KEY=N pairs of {', '.join(LAYOUT_KEYS)}, e.g. tp=2,ring=4",
                                     param_hint="'--layout'")
        try:
            degrees[key] = int(value)
        except ValueError:
            degrees[key] = 0
        if not 1 <= degrees[key] <= MAX_DEGREE:
            raise click.BadParameter(f"{text!r}: {key} must be a whole number in 1..{MAX_DEGREE}", param_hint="'--layout'")
    return Layout(**degrees)


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


def run(out: Path, out_calibration: Path, topology_ref: str | None, model_name: str | None, seq_lens: str | None,
        layouts: tuple[str, ...], stack: str | None, budget: float | None, dtype: str | None,
        compute_budget: float | None, name: str | None, as_json: bool) -> None:
    from sp_plan.cost_models.profile import resolve_profile
    from sp_plan.cost_models.stack import load_stack
    from sp_plan.planner.fitting.probe_fit import KernelPredictor, describe_layout, fit_kernels, probe_shapes

    from .common import build_model

    parsed_lens = parse_seq_lens(seq_lens) if seq_lens is not None else None
    if len(layouts) > MAX_LAYOUTS:
        raise click.BadParameter(f"at most {MAX_LAYOUTS} layouts", param_hint="'--layout'")
    parsed_layouts = [parse_layout(text) for text in layouts]
    stack_name = load_stack(stack).name  # a bad name fails before anything is timed
    try:
        import torch
        from sp_plan.runtime.probe import kernels as kernel_probe
    except ImportError as exc:
        raise CostModelError(f"sp-plan probe --kernels needs torch ({exc.name} is missing): pip install "
                             "'sp-plan[runtime]'") from exc
    kind = kernel_probe.device_kind()
    defaults = kernel_probe.DEFAULTS[kind]
    model = build_model(model_name or defaults.model)
    lens = parsed_lens or list(defaults.seq_lens)
    chosen_layouts = parsed_layouts or [Layout(**d) for d in defaults.layouts]
    planned = probe_shapes(model, lens, chosen_layouts)  # refuses bad shapes before anything is timed
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")

    probe_lines: list[str] = []
    if topology_ref is not None:
        from sp_plan.cost_models.topology import load_topology

        if not topology_ref.strip():
            raise CostModelError("--topology is empty: give the topology file `sp-plan probe` wrote on this machine")
        topology = load_topology(topology_ref)
        topology_label = topology_ref
    else:
        from sp_plan.cost_models.topology import Topology
        from sp_plan.runtime.probe.run import run_probe

        result = run_probe(out, compute_budget_s=compute_budget, name=name)
        topology = Topology(result.spec)
        topology_label = str(result.path)
        probe_lines = result.lines
    kernel_probe.check_topology_matches(topology, device)
    predictor = KernelPredictor(topology, stack_name, dtype or defaults.dtype)
    probe = kernel_probe.run_kernel_probe(planned, predictor, budget or defaults.budget_s, device)
    if len(probe.timings) < 2:
        raise CostModelError(f"only {len(probe.timings)} of {len(planned)} kernels fit in the {budget or defaults.budget_s:g} s "
                             "budget: raise --budget, or give shorter --seq-lens or layouts with higher degrees")
    fit = fit_kernels(probe.timings, predictor)
    when = _dt.date.today().isoformat()
    source = f"sp-plan probe --kernels on {platform.node() or 'this host'} ({probe.device}), {when}"
    description = (f"fitted by `sp-plan probe --kernels` on {len(probe.timings) - sum(fit.held)} kernel timing(s) of "
                   f"{model.name} ({predictor.dtype}; {', '.join(map(str, lens))} tokens; layouts "
                   f"{'; '.join(describe_layout(l) for l in chosen_layouts)}) on {probe.device}, attention through "
                   f"{probe.backend} ({predictor.family}); {sum(fit.held)} held out; kernel-level data only, for "
                   f"topology {topology.name} ({topology.gpu.name})")
    cal = fit.to_file(stack_name, description, source)
    write_output(out_calibration, yaml.safe_dump(cal.model_dump(mode="json"), sort_keys=False, width=120))
    resolve_profile(topology.gpu.name, stack_name, out_calibration)  # the file reads back as --calibration reads it

    rows = []
    for t, held, before, after in zip(fit.timings, fit.held, fit.before, fit.after, strict=True):
        rows.append([t.kernel.label, t.shape.describe(),
                     _seconds(t.seconds), _seconds(before), _seconds(after), "held out" if held else "fitted on"])
    before_err, after_err = fit.held_out_error("before"), fit.held_out_error("after")
    if as_json:
        click.echo(strict_dumps({
            "calibration": str(out_calibration), "topology": topology_label, "gpu": topology.gpu.name,
            "device": probe.device, "attention_backend": probe.backend, "attention_kernel": predictor.family,
            "dtype": predictor.dtype, "seconds": round(probe.seconds, 3),
            "parameters": {p: round(v, 12) for p, v in fit.values.items()},
            "before_values": {p: round(v, 12) for p, v in fit.before_values.items()},
            "kept": {p: round(v, 4) for p, v in fit.kept.items()}, "at_bound": fit.at_bound,
            "held_out_error": {"before": round(before_err, 6), "after": round(after_err, 6),
                               "kernels": sum(fit.held)},
            "errors": [e.model_dump() for e in cal.errors],
            "timings": [{"kernel": t.kernel.name, "kind": t.kind, "shape": t.shape.describe(), "flops": t.shape.flops,
                         "measured_s": t.seconds, "before_s": b, "after_s": a,
                         "split": "held out" if h else "fitted on", "uses": list(t.kernel.uses)}
                        for t, h, b, a in zip(fit.timings, fit.held, fit.before, fit.after, strict=True)],
            "skipped": [k.name for k in probe.skipped],
        }, indent=2))
        return
    for line in probe_lines:
        click.echo(line)
    click.echo(f"timed {len(probe.timings)} kernel(s) on {probe.device} in {probe.seconds:.1f} s ({predictor.dtype}, "
               f"attention through {probe.backend} for {predictor.family})"
               + (f"; {len(probe.skipped)} skipped (over the budget)" if probe.skipped else ""))
    click.echo("\n".join(format_table(TABLE, rows)))
    for path, value in fit.values.items():
        note = " (at its bound)" if path in fit.at_bound else ""
        click.echo(f"  {path:<40} {value:.4g}  (was {fit.before_values[path]:.4g}){note}")
    if "clock_factor" in fit.at_bound:
        click.echo(f"note: the kernels ran more than {fit.values['clock_factor']:g}x faster than the topology's peak "
                   f"({topology.name}); it was probed under other load or with other threads: probe it again, then "
                   "these kernels")
    if fit.kept:
        click.echo("kept (the timings do not depend on them by 5%: time smaller shapes to pin them): "
                   + ", ".join(f"{p} {fit.before_values[p]:.3g}" for p in fit.kept))
    click.echo(f"held-out error ({sum(fit.held)} kernels): {100 * before_err:.1f}% before, {100 * after_err:.1f}% after")
    click.echo(f"wrote {out_calibration}; use it: sp-plan estimate ... --topology {topology_label} "
               f"--calibration {out_calibration}")
