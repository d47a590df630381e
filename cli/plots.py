"""The pictures ``--plot FILE`` draws: memory per point of a capacity sweep, memory of one estimate by
component and phase of the step, and the step time of the top plans by component.

matplotlib (the ``[plot]`` extra, Agg backend) is imported only when a picture is drawn, so ``sp-plan
--help`` and every command without ``--plot`` stay fast. Each ``draw_*`` function returns the series it
plotted (GB or seconds, keyed by legend label), so a test can compare the picture's numbers with the
estimate's. Files are written whole or not at all (:func:`~sp_plan.cost_models.atomic_io.atomic_output`),
in the format the file's suffix names (:data:`PLOT_FORMATS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sp_plan.cost_models.atomic_io import atomic_output
from sp_plan.cost_models.estimate import Estimate
from sp_plan.cost_models.memory.report import ALLOCATED_COMPONENTS
from sp_plan.cost_models.units import GB, format_tokens
from sp_plan.planner.capacity import SweepPoint
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.search import RankedPlan

#: Formats --plot writes, by file suffix (matplotlib's Agg backend; PNG when the suffix names none).
PLOT_FORMATS = ("png", "svg", "pdf")

#: Memory components, bottom to top of a stacked bar (the estimate table's order).
MEMORY_COMPONENTS = (*ALLOCATED_COMPONENTS, "overhead")

#: Step-time groups of ``time.components`` (bottom to top); exposed communication follows, one group per
#: strategy, then ``interference``, ``offload``, ``optimizer`` and ``overhead``. A compute part not named
#: here lands in "other compute" so the bar still adds up to the step.
TIME_GROUPS: dict[str, tuple[str, ...]] = {
    "GEMMs": ("gemm_forward", "gemm_backward"),
    "attention forward": ("attention_forward",),
    "attention backward": ("attention_backward",),
    "recompute": ("recompute",),
    "other compute": ("streaming", "ulysses_copies", "fp8_casts"),
}
_TAIL_GROUPS: dict[str, tuple[str, ...]] = {
    "compute slowed by comm": ("interference",),
    "offload": ("offload",),
    "optimizer": ("optimizer",),
    "overhead": ("stack_overhead", "step_overhead", "moe_host_sync"),
}
_EXPOSED = "exposed_comm_"
#: Step-time parts below this fraction of the longest step in every plan are drawn as one series.
SMALL_PART = 0.005
SMALL_LABEL = "smaller parts (each < 0.5%)"

#: Fixed colours per legend label, so the same part looks the same in every picture.
_COLOURS = {
    "weights": "#1f77b4", "gradients": "#ff7f0e", "optimizer": "#2ca02c", "activations": "#d62728",
    "logits": "#9467bd", "kv_cache": "#8c564b", "buffers": "#e377c2", "overhead": "#7f7f7f",
    "GEMMs": "#1f77b4", "attention forward": "#ff7f0e", "attention backward": "#ffbb78", "recompute": "#d62728",
    "other compute": "#c7c7c7", SMALL_LABEL: "#dbdb8d", "compute slowed by comm": "#bcbd22", "offload": "#8c564b",
}
#: Behind a label drawn over bars or lines: white, slightly see-through, so the label stays readable.
_TEXT_BOX = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85}
_COMM_COLOURS = ("#9467bd", "#c5b0d5", "#17becf", "#9edae5", "#e377c2", "#f7b6d2")


def plot_format(path: str | Path) -> str:
    """The image format for ``path``: savefig into a file object cannot guess it from the name."""
    suffix = Path(path).suffix.lower().lstrip(".")
    return suffix if suffix in PLOT_FORMATS else "png"


def check_plot_path(path: str | Path | None) -> None:
    """Refuse a --plot file whose suffix names a format other than :data:`PLOT_FORMATS` (``mem.jpg``,
    ``mem.txt``) before any work: it would silently hold PNG bytes under the wrong name. No suffix: PNG."""
    if path is None:
        return
    if str(path) == "-":  # the command's report goes to standard output too: the two would interleave
        raise PlannerError("--plot - would mix the picture with the report on standard output; give a file name "
                           "(.png, .svg or .pdf)")
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix and suffix not in PLOT_FORMATS:
        raise PlannerError(f"--plot {path}: cannot draw .{suffix} files; name it .png, .svg or .pdf")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed), or a one-line error naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlannerError("--plot needs matplotlib: pip install 'sp-plan[plot]'") from exc
    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    """Write ``fig`` to ``path`` whole or not at all (matplotlib writes in place: a crash mid-write would
    leave half a PNG), then free it."""
    plt = pyplot()
    try:
        fig.tight_layout()
        with atomic_output(path, "wb") as handle:
            fig.savefig(handle, format=plot_format(path), dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def _stack(ax: Any, labels: Sequence[str], series: dict[str, list[float]], colours: dict[str, str]) -> list[float]:
    """Stacked bars of ``series`` (legend label -> one height per bar), all-zero series left out of the
    picture and legend; the bar totals."""
    bottoms = [0.0] * len(labels)
    for name, heights in series.items():
        if not any(heights):
            continue
        ax.bar(labels, heights, bottom=bottoms, label=name, color=colours.get(name), edgecolor="white", linewidth=0.5)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    return bottoms


def _label_totals(ax: Any, labels: Sequence[str], totals: Sequence[float], texts: Sequence[str]) -> None:
    """Each bar's total written just above it."""
    for x, (total, text) in enumerate(zip(totals, texts)):
        if text:
            ax.annotate(text, (x, total), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8, zorder=5, bbox=_TEXT_BOX)


def _memory_limits(ax: Any, capacity_gb: float, usable_gb: float | None, top_gb: float) -> None:
    """Capacity (and the planner's usable memory) as labelled lines, with room above the highest one so
    neither sits on the frame."""
    ax.axhline(capacity_gb, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"capacity {capacity_gb:.1f} GB", (0.0, capacity_gb), xycoords=("axes fraction", "data"),
                xytext=(3, 2), textcoords="offset points", fontsize=8, va="bottom", zorder=6, bbox=_TEXT_BOX)
    if usable_gb is not None and usable_gb < capacity_gb:
        ax.axhline(usable_gb, color="black", linestyle=":", linewidth=1)
        ax.annotate(f"usable {usable_gb:.1f} GB", (1.0, usable_gb), xycoords=("axes fraction", "data"),
                    xytext=(-3, -2), textcoords="offset points", fontsize=8, va="top", ha="right", zorder=6,
                    bbox=_TEXT_BOX)
    ax.set_ylim(0, max(capacity_gb, top_gb) * 1.15)


def _legend_outside(ax: Any, *, reverse: bool = True, title: str | None = None) -> None:
    """The legend to the right of the axes (it hides no bar), top entry first as the bars stack."""
    handles, names = ax.get_legend_handles_labels()
    if reverse:
        handles, names = handles[::-1], names[::-1]
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False, title=title,
              title_fontsize=8)


def draw_sweep(points: list[SweepPoint], key: str, path: str | Path, title: str,
               headroom: float | None = None) -> dict[str, list[Any]]:
    """Stacked memory-breakdown bars per sweep point (GB, total above each bar, "no fit" where none fits)
    against capacity, and the tokens/s curve on a second axis; returns the plotted series."""
    plt = pyplot()
    labels = [str(p.gpus) if key == "gpus" else format_tokens(p.seq_len) for p in points]
    series = {comp: [getattr(p.plan.estimate.memory, comp) / GB if p.plan else 0.0 for p in points]
              for comp in MEMORY_COMPONENTS}
    tokens = [p.plan.estimate.time.tokens_per_s if p.plan else float("nan") for p in points]
    # Two panels on one x axis: a tokens/s curve drawn over the bars would hide their tops and labels.
    fig, (ax, ax2) = plt.subplots(2, 1, sharex=True, figsize=(max(6.5, 1.2 * len(points) + 4), 6.0),
                                  gridspec_kw={"height_ratios": [3, 1.2]})
    totals = _stack(ax, labels, series, _COLOURS)
    _label_totals(ax, labels, totals, [f"{t:.1f} GB" if p.plan else "no fit" for p, t in zip(points, totals)])
    capacity = next((p.plan.estimate.memory.capacity / GB for p in points if p.plan), None)
    if capacity:
        _memory_limits(ax, capacity, capacity * (1 - headroom) if headroom else None, max(totals))
    ax.set_ylabel("memory per GPU (GB)")
    _legend_outside(ax)
    ax2.plot(labels, tokens, color="black", marker="o")
    for x, t in enumerate(tokens):
        if t == t:
            ax2.annotate(f"{t:,.0f}", (x, t), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    finite = [t for t in tokens if t == t]
    ax2.set_ylim(0, (max(finite) if finite else 1.0) * 1.3)
    ax2.set_ylabel("tokens/s (cluster)")
    ax2.set_xlabel("GPUs" if key == "gpus" else "sequence length")
    ax.set_title(f"{title}: best plan per point")
    save_figure(fig, path)
    return {**series, "total": totals, "tokens_per_s": tokens}


def draw_estimate_memory(est: Estimate, path: str | Path, headroom: float | None = None) -> dict[str, list[Any]]:
    """One stacked bar per phase of the step (its allocated components at the phase's worst moment, plus the
    overheads every phase carries), the peak phase marked, against capacity and the usable line
    (capacity minus ``headroom``, the planner's margin). The peak phase's bar is the estimate's breakdown;
    returns the plotted series (GB) with ``phases`` naming the bars."""
    plt = pyplot()
    det, mem = est.detail, est.memory
    phases = list(det.phases)
    series = {comp: [getattr(det.phases[ph], comp) / GB for ph in phases] for comp in MEMORY_COMPONENTS
              if comp != "overhead"}
    series["overhead"] = [mem.overhead / GB] * len(phases)
    labels = [f"{ph}\n(peak)" if ph == det.peak_phase else ph for ph in phases]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(phases) + 4), 4.8))
    totals = _stack(ax, labels, series, _COLOURS)
    _label_totals(ax, labels, totals, [f"{t:.1f} GB" for t in totals])
    capacity = mem.capacity / GB
    _memory_limits(ax, capacity, capacity * (1 - headroom) if headroom else None, max(totals))
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_xlabel("phase of the step (its worst moment)")
    ax.tick_params(axis="x", labelsize=8)
    _legend_outside(ax)
    verdict = "fits" if est.fits else "does NOT fit"
    ax.set_title(f"{det.model} | {format_tokens(det.seq_len)} tokens x {det.micro_batch} | {est.layout.world} x "
                 f"{det.gpu} | {est.layout.describe()}: {mem.total / GB:.1f} GB, {verdict}", fontsize=9)
    save_figure(fig, path)
    return {**series, "total": totals, "phases": phases}


def time_groups(components: dict[str, float]) -> dict[str, float]:
    """``time.components`` (seconds) gathered into the picture's groups; they add up to the same step."""
    groups = {name: sum(components.get(k, 0.0) for k in keys) for name, keys in TIME_GROUPS.items()}
    named = {k for keys in (*TIME_GROUPS.values(), *_TAIL_GROUPS.values()) for k in keys}
    for key, seconds in components.items():
        if key.startswith(_EXPOSED):
            label = f"exposed comm: {key.removeprefix(_EXPOSED)}"
            groups[label] = groups.get(label, 0.0) + seconds
        elif key not in named:
            groups["other compute"] += seconds
    groups.update({name: sum(components.get(k, 0.0) for k in keys) for name, keys in _TAIL_GROUPS.items()})
    return groups


def draw_plan_times(plans: Sequence[RankedPlan], path: str | Path, title: str) -> dict[str, list[Any]]:
    """One stacked bar per plan (best first, labelled with its layout): the step time split into GEMMs,
    attention, recompute, exposed communication by strategy, offload, optimizer and overheads, the step
    and tokens/s above each bar; returns the plotted series (seconds) with ``layouts`` naming the bars."""
    plt = pyplot()
    grouped = [time_groups(p.estimate.time.components) for p in plans]
    names: list[str] = []
    for g in grouped:
        names += [n for n in g if n not in names]
    series = {n: [g.get(n, 0.0) for g in grouped] for n in names}
    tallest = max((sum(g.values()) for g in grouped), default=0.0)
    small = [n for n, v in series.items() if max(v) < SMALL_PART * tallest]
    if len(small) > 1:  # slivers no one can see, each with a legend entry: one series instead
        series = {n: v for n, v in series.items() if n not in small} | {
            SMALL_LABEL: [sum(vals) for vals in zip(*(series[n] for n in small))]}
    layouts = [p.layout.describe() for p in plans]
    labels = [f"#{p.rank} {lay.replace(' x ', chr(10))}" for p, lay in zip(plans, layouts)]
    comm = [n for n in series if n.startswith("exposed comm")]
    colours = {**_COLOURS, **{n: _COMM_COLOURS[i % len(_COMM_COLOURS)] for i, n in enumerate(comm)},
               "optimizer": "#2ca02c", "overhead": "#7f7f7f"}
    fig, ax = plt.subplots(figsize=(max(7.0, 1.4 * len(plans) + 4.5), 4.8))
    totals = _stack(ax, labels, series, colours)
    _label_totals(ax, labels, totals, [f"{t:.2f} s\n{p.estimate.time.tokens_per_s:,.0f} tok/s"
                                       for p, t in zip(plans, totals)])
    ax.set_ylim(0, max(totals) * 1.2 if totals and max(totals) > 0 else 1.0)
    ax.set_ylabel("step time (s)")
    ax.tick_params(axis="x", labelsize=8)
    _legend_outside(ax)
    ax.set_title(f"{title}: step time of the top plans", fontsize=9)
    save_figure(fig, path)
    return {**series, "total": totals, "layouts": layouts}
