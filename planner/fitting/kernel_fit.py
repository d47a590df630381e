"""Kernel truth: pin the kernel model from kernel-level measurements only.

``cost_models/data/calibration/kernels.yaml`` holds what one attention kernel or GEMM reaches on a named
GPU variant (FlashAttention-3 paper figures, an FA3 re-run, ring-flash-attention's single-GPU rates,
XLA's and pyptx's cuBLAS tables). Each figure is predicted with the kernel model's own shape functions
(:func:`sp_plan.cost_models.kernels.attention_seconds`, :func:`sp_plan.cost_models.kernels.gemm_seconds`) at the variant's
peak x clock factor, converted to the source's FLOP convention, and the per-family efficiencies and shape
constants are fitted to them: least squares on log(predicted / measured), each source weighted equally,
Gaussian priors around the kernel files' documented values (so a constant no figure constrains keeps its
prior), ``scipy.optimize.least_squares`` (trust-region reflective, soft-L1).

This module reads nothing else: end-to-end training runs (``published.yaml``) carry a stack's overheads,
a compiler's fusions and a power cap, and must never be learnt as a kernel's speed. The system-level fit
(:mod:`.parameters`) fits stack overheads and GPU-variant factors on top of what is pinned here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from sp_plan.cost_models import data as shipped_data
from sp_plan.cost_models.collectives import collective_cost
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.flops import FLASH_BACKWARD_RATIO
from sp_plan.cost_models.gpu_spec import GPUSpec, get_gpu_preset
from sp_plan.cost_models.kernels import (KernelModel, attention_seconds, gemm_seconds, grouped_gemm_seconds,
                                          kernel_family, prior_kernel_model)
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.placement import group_spans
from sp_plan.cost_models.topology import default_topology
from sp_plan.cost_models.yaml_io import safe_load

KERNEL_DATA_FILE = "kernels.yaml"
#: Weight of a kernel figure by confidence: printed numbers, bar labels and figures derived from printed
#: numbers count fully; a figure whose setting or GPU variant is unstated is evaluated, not fitted (and so is
#: an entry marked ``evaluation_only``: a kernel no priced stack runs, e.g. DeepGEMM's block-scaled FP8).
CONFIDENCE_WEIGHT = {"exact": 1.0, "label": 1.0, "derived": 1.0, "ambiguous": 0.0}
#: Residual (log) beyond which the robust loss grows linearly (a figure's transcription error, not signal).
ROBUST_SCALE = 0.1
#: Source FLOP conventions: the backward pass counts 2.5 x the forward's FLOPs (FlashAttention papers).
FA_PAPER_BACKWARD = 2.5
METHOD = ("kernel-level figures only (cost_models/data/calibration/kernels.yaml); scipy.optimize.least_squares "
          "(trf, soft-L1) on log(predicted/measured), each source weighted equally, Gaussian priors around the "
          "kernel files' values")


@dataclass(frozen=True)
class KernelFigure:
    """One kernel-level measurement and how the kernel model predicts it."""

    id: str
    source: str
    gpu: str
    family: str
    confidence: str
    value: float
    unit: str
    #: Predicts ``value`` (same unit) from a kernel model and the GPU spec.
    predict: Callable[[KernelModel, GPUSpec], float] = field(compare=False, repr=False)
    #: Why the figure is compared but never fitted (its entry's ``evaluation_only``); empty: fitted by confidence.
    evaluation_only: str = ""

    @property
    def weight(self) -> float:
        """The figure's weight in a kernel fit (0: evaluated only)."""
        return 0.0 if self.evaluation_only else CONFIDENCE_WEIGHT.get(self.confidence, 0.0)


@dataclass(frozen=True)
class KernelParameter:
    """One kernel-model value the kernel fit may move: a dotted path for a GPU family."""

    family: str
    path: str
    prior: float
    lower: float
    upper: float
    sigma: float = 1.0  # in log space: a factor of e at one sigma (the data decide)

    @property
    def name(self) -> str:
        return f"{self.path}@{self.family}"


@cache
def kernel_data() -> dict[str, Any]:
    """The kernel-level measurements file, parsed."""
    return safe_load(shipped_data.read_text("calibration", KERNEL_DATA_FILE.removesuffix(".yaml")))


def _peak(gpu: GPUSpec) -> float:
    return gpu.flops_for("bf16") * gpu.clock_factor


def fa_paper_flops(seqlen: int, batch_heads: float, head_dim: int, causal: bool, backward: bool) -> float:
    """FLOPs of one attention call in the FlashAttention papers' convention: 4 s^2 h d b, halved for causal,
    x2.5 for the backward."""
    flops = 4.0 * seqlen * seqlen * batch_heads * head_dim * (0.5 if causal else 1.0)
    return flops * (FA_PAPER_BACKWARD if backward else 1.0)


def attention_tflops(kernel: str, pass_: str, causal: bool, head_dim: int, seqlen: int, tokens: int,
                      hidden: int) -> Callable[[KernelModel, GPUSpec], float]:
    """FA-paper benchmark shape: batch = tokens / seqlen, heads = hidden / head_dim; TFLOP/s in the
    paper's convention (:func:`fa_paper_flops`) over the model's seconds."""
    batch_heads = (tokens / seqlen) * (hidden / head_dim)
    backward = pass_ == "backward"
    flops = fa_paper_flops(seqlen, batch_heads, head_dim, causal, backward)

    def predict(model: KernelModel, gpu: GPUSpec) -> float:
        p = model.attention_params(kernel)
        frac = p.backward_fraction if backward else p.forward_fraction
        ratio = FLASH_BACKWARD_RATIO if backward else 1.0
        t = attention_seconds(batch_heads, seqlen, seqlen, head_dim, causal, _peak(gpu), frac, p, model.sms, ratio)
        return flops / t / 1e12

    return predict


def _single_gpu_rate(kernel: str, pass_: str, causal: bool, head_dim: int, seqlen: int,
                     heads: int) -> Callable[[KernelModel, GPUSpec], float]:
    """Iterations per second of one call (forward, or forward + backward) on ``seqlen`` tokens."""

    def predict(model: KernelModel, gpu: GPUSpec) -> float:
        p = model.attention_params(kernel)
        t = attention_seconds(heads, seqlen, seqlen, head_dim, causal, _peak(gpu), p.forward_fraction, p, model.sms)
        if pass_ == "forward+backward":
            t += attention_seconds(heads, seqlen, seqlen, head_dim, causal, _peak(gpu), p.backward_fraction, p,
                                   model.sms, FLASH_BACKWARD_RATIO)
        return 1.0 / t

    return predict


def gemm_tflops(m: int, n: int, k: int, fp8: bool = False, groups: int = 1) -> Callable[[KernelModel, GPUSpec], float]:
    """A GEMM figure's TFLOP/s (2mnk per GEMM, ``groups`` GEMMs of m rows each in one grouped launch for a
    MoE grouped GEMM) at the bf16 or the fp8 peak and the kernel model's fraction for that dtype."""
    def predict(model: KernelModel, gpu: GPUSpec) -> float:
        if fp8:
            peak, fraction = gpu.flops_for("fp8") * gpu.clock_factor, model.gemm.fp8_peak_fraction
        else:
            peak, fraction = _peak(gpu), model.gemm.peak_fraction
        if groups == 1:
            t = gemm_seconds(m, n, k, peak, fraction, model.gemm, model.sms)
        else:
            t = grouped_gemm_seconds([(m, n, k, groups)], peak, fraction, model.gemm, model.sms)
        return 2.0 * m * n * k * groups / t / 1e12

    return predict


def kernel_figures(data: dict[str, Any] | None = None) -> list[KernelFigure]:
    """Every attention and GEMM figure of the kernel data file as a :class:`KernelFigure`."""
    data = kernel_data() if data is None else data
    sources = data.get("sources", {})
    out: list[KernelFigure] = []

    def add(id_: str, entry: dict[str, Any], value: float, unit: str, predict) -> None:
        if entry["source"] not in sources:
            raise CostModelError(f"kernel figure {id_}: source {entry['source']!r} is not described under sources:")
        gpu = get_gpu_preset(entry["gpu"]).name
        out.append(KernelFigure(id_, entry["source"], gpu, kernel_family(gpu), entry.get("confidence", "exact"),
                                float(value), unit, predict, entry.get("evaluation_only", "")))

    for e in data.get("attention", []):
        shape = sources.get(e["source"], {})
        if "tokens" not in shape or "hidden" not in shape:
            raise CostModelError(f"attention figures of {e['source']}: give the benchmark's tokens (batch x seqlen) "
                                 "and hidden size under its source")
        tokens, hidden = int(shape["tokens"]), int(shape["hidden"])
        mask = "causal" if e["causal"] else "full"
        for seq, tflops in e["tflops_by_seqlen"].items():
            id_ = f"{e['source']}: {e['gpu']} {e['kernel']} {e['pass']} {mask} hd{e['head_dim']} {int(seq) // 1024 or seq}{'K' if int(seq) >= 1024 else ''}"
            add(id_, e, tflops, "TFLOP/s",
                attention_tflops(e["kernel"], e["pass"], e["causal"], e["head_dim"], int(seq), tokens, hidden))
    for e in data.get("single_gpu_iterations", []):
        rate = e["theoretic"] * e["ring"]
        id_ = f"{e['source']}: {e['gpu']} {e['kernel']} {e['pass']} causal hd{e['head_dim']} {e['seq_len'] // 1024}K"
        add(id_, e, rate, "iter/s",
            _single_gpu_rate(e["kernel"], e["pass"], e["causal"], e["head_dim"], e["seq_len"], e["heads"]))
    for e in data.get("gemm", []):
        fp8 = e.get("dtype", "bf16") == "fp8"
        label = "fp8 gemm" if fp8 else "gemm"
        for m, n, k, tflops in e.get("shapes", []):
            add(f"{e['source']}: {e['gpu']} {label} {m}x{n}x{k}", e, tflops, "TFLOP/s", gemm_tflops(m, n, k, fp8))
        for groups, m, n, k, tflops in e.get("grouped_shapes", []):  # [groups, m per group, n, k, TFLOP/s]
            add(f"{e['source']}: {e['gpu']} {label} {e.get('layout', 'grouped')} {groups}x{m}x{n}x{k}", e, tflops,
                "TFLOP/s", gemm_tflops(m, n, k, fp8, groups))
    return out


#: GPU of each kernel family the priors are read from.
_FAMILY_GPU = {"h100": "h100-80gb", "a100": "a100-80gb", "b200": "b200"}


def kernel_fit_parameters() -> list[KernelParameter]:
    """What the kernel data may pin, per family: GEMM asymptote, k prologue and launch cost; per attention
    kernel the forward and backward asymptotes, the key-loop half length and the head_dim constant."""
    params: list[KernelParameter] = []
    for family, gpu in _FAMILY_GPU.items():
        prior = prior_kernel_model(gpu)
        params.append(KernelParameter(family, "gemm.peak_fraction", prior.gemm.peak_fraction, 0.3, 0.98))
        params.append(KernelParameter(family, "gemm.k_half", prior.gemm.k_half, 4.0, 4096.0))
        params.append(KernelParameter(family, "gemm.launch_s", prior.gemm.launch_s, 1e-7, 1e-4))
        for kernel, p in prior.attention.items():
            params.append(KernelParameter(family, f"attention.{kernel}.forward_fraction", p.forward_fraction, 0.05, 0.95))
            params.append(KernelParameter(family, f"attention.{kernel}.backward_fraction", p.backward_fraction, 0.05, 0.95))
            params.append(KernelParameter(family, f"attention.{kernel}.kv_len_half", p.kv_len_half, 4.0, 8192.0))
            params.append(KernelParameter(family, f"attention.{kernel}.head_dim_half", p.head_dim_half, 1.0, 1024.0))
    return params


@dataclass
class KernelFitResult:
    params: list[KernelParameter]
    values: list[float]
    sources: list[str]
    rms_log_residual: float
    residuals: dict[str, float]  # figure id -> predicted / measured - 1
    message: str = ""

    def by_family(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for p, v in zip(self.params, self.values):
            out.setdefault(p.family, {})[p.path] = v
        return out


def _per_family(params: Sequence[KernelParameter], values: Sequence[float]) -> dict[str, dict[str, float]]:
    per_family: dict[str, dict[str, float]] = {}
    for p, v in zip(params, values):
        per_family.setdefault(p.family, {})[p.path] = float(v)
    return per_family


def predict_figures(figures: Sequence[KernelFigure], params: Sequence[KernelParameter] = (),
                    values: Sequence[float] = ()) -> list[float]:
    """Each figure's prediction with the kernel files' priors and ``values`` of ``params`` on top."""
    per_family = _per_family(params, values)
    cache_: dict[str, KernelModel] = {}
    out = []
    for f in figures:
        model = cache_.get(f.gpu)
        if model is None:
            model = prior_kernel_model(f.gpu)
            if per_family.get(f.family):
                model = model.with_values(per_family[f.family])
            cache_[f.gpu] = model
        out.append(f.predict(model, get_gpu_preset(f.gpu)))
    return out


def _depends(figures: Sequence[KernelFigure], params: Sequence[KernelParameter]) -> dict[str, set[str]]:
    """Parameter -> sources whose figures move (by > 0.1%) when it moves 5% from its prior."""
    base = predict_figures(figures, params, [p.prior for p in params])
    out = {}
    for i, p in enumerate(params):
        vals = [q.prior for q in params]
        vals[i] = p.prior * 1.05 if p.prior * 1.05 <= p.upper else p.prior * 0.95
        moved = predict_figures([f for f in figures if f.family == p.family], params, vals)
        fam = [b for f, b in zip(figures, base) if f.family == p.family]
        out[p.name] = {f.source for f, a, b in zip([f for f in figures if f.family == p.family], fam, moved)
                       if abs(math.log(b / a)) > 1e-3}
    return out


def fit_kernels(figures: Sequence[KernelFigure] | None = None,
                params: Sequence[KernelParameter] | None = None) -> KernelFitResult:
    """Fit the kernel parameters that some fitted figure depends on; the rest keep their priors."""
    from scipy.optimize import least_squares

    figures = list(kernel_figures() if figures is None else figures)
    params = list(kernel_fit_parameters() if params is None else params)
    fitted_on = [f for f in figures if f.weight > 0]
    if not fitted_on:
        raise CostModelError("no kernel-level figures to fit")
    depends = _depends(fitted_on, params)
    used = [p for p in params if depends[p.name]]
    per_source: dict[str, int] = {}
    for f in fitted_on:
        per_source[f.source] = per_source.get(f.source, 0) + 1
    mean_n = len(fitted_on) / len(per_source)
    weights = np.array([f.weight * math.sqrt(mean_n / per_source[f.source])
                        for f in fitted_on])
    measured = np.array([f.value for f in fitted_on])
    x0 = np.log([p.prior for p in used])
    lo, hi = np.log([p.lower for p in used]), np.log([p.upper for p in used])
    sig = np.array([p.sigma for p in used])

    def residuals(x: np.ndarray) -> np.ndarray:
        preds = np.array(predict_figures(fitted_on, used, np.exp(x)))
        return np.concatenate([weights * np.log(preds / measured), (x - x0) / sig])

    message = "nothing to fit"
    x = x0
    if used:
        sol = least_squares(residuals, np.clip(x0, lo, hi), bounds=(lo, hi), method="trf", x_scale="jac",
                            diff_step=1e-4, loss="soft_l1", f_scale=ROBUST_SCALE, max_nfev=300)
        x, message = sol.x, str(sol.message)
    values = [float(v) for v in np.exp(x)]
    preds = predict_figures(figures, used, values)
    logs = [math.log(p / f.value) for p, f in zip(preds, figures)]
    scored = [v for v, f in zip(logs, figures) if f.weight > 0]
    return KernelFitResult(
        params=used, values=values, sources=sorted(per_source),
        rms_log_residual=math.sqrt(sum(v * v for v in scored) / len(scored)),
        residuals={f.id: math.exp(v) - 1 for v, f in zip(logs, figures)}, message=message,
    )


def leave_one_kernel_source_out(figures: Sequence[KernelFigure] | None = None,
                                params: Sequence[KernelParameter] | None = None) -> dict[str, dict[str, float]]:
    """Source -> figure id -> predicted / measured - 1 by a kernel fit without that source (a constant only
    that source constrained falls back to its prior: the test of the prior itself)."""
    figures = list(kernel_figures() if figures is None else figures)
    out: dict[str, dict[str, float]] = {}
    for source in sorted({f.source for f in figures}):
        train = [f for f in figures if f.source != source]
        test = [f for f in figures if f.source == source]
        result = fit_kernels(train, params)
        preds = predict_figures(test, result.params, result.values)
        out[source] = {f.id: p / f.value - 1 for f, p in zip(test, preds)}
    return out


@dataclass(frozen=True)
class CollectiveCheck:
    """One nccl-tests bus bandwidth against the collective model on the GPU's natural node (not fitted:
    link efficiencies are the topology presets' calibration)."""

    id: str
    measured_gbps: float
    predicted_gbps: float
    note: str = ""


#: nccl-tests op text -> the cost model's collectives it names (ring algorithms; NVLS is not modelled).
_NCCL_OPS = {"all-to-all / all-gather / ring all-reduce": ("all_to_all", "all_gather", "all_reduce"),
             "all-reduce (NVLS)": ("all_reduce",)}
#: Message size of the check: large enough to be bandwidth-bound (nccl-tests' plateau).
NCCL_CHECK_BYTES = float(1 << 30)


def collective_checks(data: dict[str, Any] | None = None) -> list[CollectiveCheck]:
    """Intra-node nccl-tests bus bandwidths (busbw = bytes sent per GPU / time, nccl-tests' definition for
    ring all-reduce, all-gather and all-to-all) vs the model's on the GPU's natural node."""
    data = kernel_data() if data is None else data
    out = []
    for e in data.get("collectives", []):
        ops = _NCCL_OPS.get(e.get("op", ""))
        if not ops or "gpu" not in e or "gpus" not in e:
            continue  # inter-node entries: the NIC count and node count of the measurement are not stated
        topo = default_topology(e["gpu"], e["gpus"])
        span = group_spans(Layout(ulysses=e["gpus"]), topo)["ulysses"]
        for op in ops:
            cost = collective_cost(op, NCCL_CHECK_BYTES, span)
            out.append(CollectiveCheck(f"{e['source']}: {e['gpu']} {e['gpus']} GPUs {op} ({e['op']})",
                                       float(e["busbw_GBps"]), cost.bytes_sent / cost.time_s / 1e9, e.get("note", "")))
    return out


#: Kernel-model paths that are kernel efficiencies or shape constants: only the kernel fit may set them.
KERNEL_TRUTH_PREFIXES = ("gemm.", "attention.", "memory_fraction", "sms")

__all__ = [
    "CONFIDENCE_WEIGHT",
    "KERNEL_TRUTH_PREFIXES",
    "CollectiveCheck",
    "KernelFigure",
    "KernelFitResult",
    "KernelParameter",
    "collective_checks",
    "fit_kernels",
    "kernel_data",
    "kernel_figures",
    "kernel_fit_parameters",
    "leave_one_kernel_source_out",
    "predict_figures",
]
