"""How far a predicted step time, memory or length can be trusted: a band drawn from held-out residuals.

A prediction is only as good as the model's record on runs it did not see. The records
(:class:`Residual`, written by ``benchmarks/accuracy.py --write`` from the shipped fit's held-out errors; see
:mod:`sp_plan.planner.fitting.bands`) hold ``ln(predicted / measured)`` of every published figure, under three
ways of holding it out: its source, its GPU variant, or its stack left out of the fit. Which of them speaks for
a new prediction depends on what the fit has seen:

- a stack and GPU variant with published runs: the figures of that stack on that GPU whose *source* was left
  out (a new cluster running a known stack), narrowed to the regime (context length, dense or MoE, pipelined)
  when enough runs cover it;
- a known stack on a GPU variant the fit never saw: the figures held out by *GPU variant*;
- a stack the fit never saw (``hf-fsdp2``, a stack file of one's own): the figures held out by *stack*.

The band is a distribution-free prediction interval (split conformal): with ``n`` held-out errors, the
``ceil(q (n + 1))``-th smallest ``|ln(predicted / measured)|`` bounds a new one with probability at least ``q``
when the new run is like the old ones. ``q`` is 68.3% for "1 sigma" and 95.4% for "2 sigma"; 2 sigma needs 21
runs and is left unstated below that. Where no held-out runs of the right kind exist, :class:`Band` says so and
carries no number. After ``--calibration``, the calibration's own held-out check (``calibrate --check`` or its
leave-one-file-out folds) replaces all of this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from sp_plan.cost_models.kernels import kernel_family

Quantity = Literal["step_time", "memory", "max_length"]
Split = Literal["source", "gpu-variant", "stack"]

RESIDUALS_PATH = Path(__file__).resolve().parents[1] / "cost_models" / "data" / "calibration" / "residuals.yaml"
#: At or above this many tokens a run counts as long-context (attention dominates an 8B model's step here).
LONG_CONTEXT = 65_536
#: Fewest held-out runs a band is drawn from (the 1-sigma interval needs 3: ceil(0.683 x 4) = 3).
MIN_RUNS = 3
ONE_SIGMA = 0.6827
#: A band's runs that lean one way by this much (mean ln error) are said to (predicted x% high or low).
BIAS_NOTE = 0.05
TWO_SIGMA = 0.9545
#: Calibration metrics -> the quantity whose band they inform.
CALIBRATION_METRICS: dict[str, Quantity] = {
    "step_s": "step_time", "tps_per_gpu": "step_time", "tflops_per_gpu": "step_time",
    "peak_bytes": "memory", "allocated_gib": "memory", "reserved_gib": "memory", "nvml_used_gib": "memory",
    "hbm_gb": "memory", "max_seq_len": "max_length",
}
QUANTITY_NAMES: dict[Quantity, str] = {"step_time": "step time", "memory": "memory", "max_length": "max length"}


class Residual(BaseModel):
    """One published figure's held-out error: ``ln(predicted / measured)`` of its time, memory or length."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    source: str
    split: Split
    quantity: Quantity
    stack: str
    gpu: str
    family: str
    seq_len: int = Field(ge=1)
    moe: bool
    pipelined: bool
    log_error: float = Field(allow_inf_nan=False)


class ResidualFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["sp-plan-residuals"] = "sp-plan-residuals"
    version: Literal[1] = 1
    residuals: list[Residual] = Field(default_factory=list)


@lru_cache(maxsize=4)
def load_residuals(path: str | None = None) -> tuple[Residual, ...]:
    """The shipped held-out residuals (or another file's)."""
    target = Path(path) if path else RESIDUALS_PATH
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster on the ~200 records
    return tuple(ResidualFile.model_validate(yaml.load(target.read_text(), Loader=loader)).residuals)


def conformal_bound(errors: Sequence[float], q: float) -> float | None:
    """The ``ceil(q (n + 1))``-th smallest ``|error|``: a bound a new exchangeable error stays under with
    probability >= ``q``; ``None`` when ``n`` is too small for ``q``."""
    magnitudes = sorted(abs(e) for e in errors)
    k = math.ceil(q * (len(magnitudes) + 1) - 1e-9)
    return magnitudes[k - 1] if 1 <= k <= len(magnitudes) else None


@dataclass(frozen=True)
class Regime:
    """What a band is narrowed to besides stack and GPU."""

    seq_len: int
    moe: bool
    pipelined: bool

    @property
    def long(self) -> bool:
        return self.seq_len >= LONG_CONTEXT

    def matches(self, r: Residual) -> bool:
        return (r.seq_len >= LONG_CONTEXT) == self.long and r.moe == self.moe and r.pipelined == self.pipelined

    def describe(self) -> str:
        context = f">={LONG_CONTEXT // 1024}K" if self.long else f"<{LONG_CONTEXT // 1024}K"
        return f"{'MoE' if self.moe else 'dense'}, {context}{', pipelined' if self.pipelined else ''}"


@dataclass(frozen=True)
class Band:
    """A prediction's uncertainty: relative 1- and 2-sigma half-widths (``None``: not supported by data)."""

    quantity: Quantity
    one_sigma: float | None
    two_sigma: float | None
    runs: int
    sources: int
    #: What the band is drawn from, in words ("uncalibrated megatron-core on h100-80gb, dense, >=64K").
    basis: str
    #: Whether held-out runs of this very case (stack, GPU, regime) exist; else ``basis`` is the nearest set.
    covered: bool
    calibrated: bool = False
    #: Mean ln(predicted / measured) of the runs (the systematic part: > 0 means predictions ran high).
    bias: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def known(self) -> bool:
        return self.one_sigma is not None

    def describe(self) -> str:
        """``+/-28% (1 sigma, uncalibrated hf-fsdp2 on h100-80gb ...; 9 held-out runs from 2 sources)``."""
        if not self.known:
            return f"no band: {'; '.join(self.notes) or 'no held-out runs'}"
        two = f", +/-{pct(self.two_sigma)} at 2 sigma" if self.two_sigma is not None else ""
        runs = f"{self.runs} held-out run{'s' if self.runs != 1 else ''} from {self.sources} source" + (
            "s" if self.sources != 1 else "")
        text = f"+/-{pct(self.one_sigma)} (1 sigma{two}; {self.basis}; {runs})"
        notes = list(self.notes)
        if self.bias is not None and abs(self.bias) >= BIAS_NOTE and abs(self.bias) >= self.one_sigma / 2:
            ways = ("too slow", "too fast") if self.quantity == "step_time" else ("high", "low")
            notes.append(f"these runs were predicted {pct(abs(math.expm1(self.bias)))} "
                         f"{ways[0] if self.bias > 0 else ways[1]} on average")
        if self.quantity == "max_length" and not self.calibrated:
            notes.append("published maxima are the longest that ran (lower bounds), so this overstates the error")
        return text + "".join(f"; {n}" for n in notes)

    def to_json(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "one_sigma": _round(self.one_sigma), "two_sigma": _round(self.two_sigma),
                "runs": self.runs, "sources": self.sources, "basis": self.basis, "covered": self.covered,
                "calibrated": self.calibrated,
                # The runs' geometric-mean predicted / measured (the systematic part; 0.76: predictions 24% low).
                "mean_ratio": None if self.bias is None else _round(math.exp(self.bias)), "notes": list(self.notes)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def pct(fraction: float | None) -> str:
    return "?" if fraction is None else f"{100 * fraction:.0f}%"


def _band(quantity: Quantity, errors: Sequence[Residual], basis: str, covered: bool, notes: Sequence[str] = (),
          calibrated: bool = False) -> Band:
    values = [r.log_error for r in errors]
    one, two = conformal_bound(values, ONE_SIGMA), conformal_bound(values, TWO_SIGMA)
    return Band(quantity=quantity, one_sigma=None if one is None else math.expm1(one),
                two_sigma=None if two is None else math.expm1(two), runs=len(values),
                sources=len({r.source for r in errors}), basis=basis, covered=covered, calibrated=calibrated,
                bias=sum(values) / len(values) if values else None, notes=tuple(notes))


@dataclass(frozen=True)
class _Candidate:
    split: Split
    keep: Callable[[Residual], bool]
    basis: str
    covered: bool
    note: str = ""


def _candidates(quantity: Quantity, stack: str, gpu: str, family: str, regime: Regime,
                records: Sequence[Residual]) -> list[_Candidate]:
    """The sets a band may be drawn from, most specific first, each with what it says the fit has not seen."""
    seen = [r for r in records if r.split == "source"]
    stack_seen = any(r.stack == stack for r in seen)
    gpu_seen = any(r.stack == stack and r.gpu == gpu for r in seen)
    uncovered = f"no held-out runs cover {stack} on {gpu}, {regime.describe()}"
    if stack_seen and gpu_seen:
        same = lambda r: r.stack == stack and r.gpu == gpu
        base = f"uncalibrated {stack} on {gpu}"
        out = [_Candidate("source", lambda r: same(r) and regime.matches(r), f"{base}, {regime.describe()}", True),
               _Candidate("source", same, f"{base}, any regime", False, uncovered),
               _Candidate("source", lambda r: r.stack == stack and r.family == family,
                          f"uncalibrated {stack} on the {family} family", False, uncovered),
               _Candidate("source", lambda r: r.stack == stack, f"uncalibrated {stack}, any GPU", False, uncovered)]
    elif stack_seen:
        note = f"no published {stack} runs on {gpu}: band from runs whose GPU variant was held out of the fit"
        out = [_Candidate("gpu-variant", lambda r: r.stack == stack and r.family == family,
                          f"uncalibrated {stack}, {family}-family GPU variants held out", False, note),
               _Candidate("gpu-variant", lambda r: r.stack == stack,
                          f"uncalibrated {stack}, GPU variants held out", False, note),
               _Candidate("gpu-variant", lambda r: True, "uncalibrated, any stack, GPU variants held out", False,
                          note)]
    else:
        note = f"no published runs of stack {stack}: band from runs whose stack was held out of the fit"
        out = [_Candidate("stack", lambda r: r.family == family and regime.matches(r),
                          f"uncalibrated, stacks held out, {family} family, {regime.describe()}", False, note),
               _Candidate("stack", lambda r: r.family == family,
                          f"uncalibrated, stacks held out, {family} family", False, note),
               _Candidate("stack", lambda r: True, "uncalibrated, stacks held out, any GPU", False, note)]
    # Memory and length figures are held out by source only: a band for an unseen stack or GPU comes from every
    # stack's figures (the memory model is shared; the stacks differ by a few constants).
    out.append(_Candidate("source", lambda r: True, f"uncalibrated, any stack and GPU ({QUANTITY_NAMES[quantity]} "
                                                     "figures held out by source)", False, uncovered))
    return out


def source_floor(records: Sequence[Residual]) -> tuple[float | None, int]:
    """The 1-sigma bound on a *new source's* systematic error: the conformal bound over the sources' mean held-out
    ``ln(predicted / measured)``, and how many sources it is drawn from (``None`` below three).

    A user's cluster is a new source. The figures of one source share its hardware, software and way of
    measuring, so their errors move together: a cell whose two sources both happen to agree with the model says
    little about a third. No band claims less than this spread."""
    by_source: dict[str, list[float]] = {}
    for r in records:
        by_source.setdefault(r.source, []).append(r.log_error)
    means = [sum(v) / len(v) for v in by_source.values()]
    return conformal_bound(means, ONE_SIGMA), len(means)


def band_for(quantity: Quantity, stack: str, gpu: str, regime: Regime, *,
             records: Sequence[Residual] | None = None, exclude_source: str | None = None) -> Band:
    """The uncalibrated band of a prediction of ``quantity`` for ``stack`` on ``gpu`` in ``regime``: the most
    specific held-out set with :data:`MIN_RUNS` runs, never narrower than :func:`source_floor`.

    ``exclude_source`` drops one source's records (the coverage test scores each figure against a band its own
    source did not help draw)."""
    pool = [r for r in (load_residuals() if records is None else records)
            if r.quantity == quantity and r.source != exclude_source]
    family = kernel_family(gpu)
    floor, floor_sources = source_floor([r for r in pool if r.split == "source"])
    for c in _candidates(quantity, stack, gpu, family, regime, pool):
        chosen = [r for r in pool if r.split == c.split and c.keep(r)]
        if len(chosen) < MIN_RUNS:
            continue
        band = _band(quantity, chosen, c.basis, c.covered, [c.note] if c.note else [])
        if floor is not None and band.one_sigma is not None and math.expm1(floor) > band.one_sigma:
            # The set agrees better than sources do among themselves: widen to the new-source spread, and
            # leave 2 sigma unstated (the set's own 2-sigma bound would understate it the same way).
            band = replace(band, one_sigma=math.expm1(floor), two_sigma=None, notes=band.notes + (
                f"widened from +/-{pct(band.one_sigma)} to the spread of {floor_sources} sources' mean error",))
        return band
    return Band(quantity=quantity, one_sigma=None, two_sigma=None, runs=0, sources=0, basis="", covered=False,
                notes=(f"fewer than {MIN_RUNS} held-out {QUANTITY_NAMES[quantity]} figures cover {stack} on {gpu}",))


def calibrated_band(quantity: Quantity, calibration: Any, gpu: str, stack: str) -> Band:
    """The band after ``--calibration``: its own held-out check's errors of ``quantity`` (check runs, or the
    leave-one-file-out folds); with none, no band, saying how to get one."""
    residuals = [r for r in getattr(calibration, "residuals", ()) if CALIBRATION_METRICS.get(r.metric) == quantity]
    held = [r for r in residuals if r.split != "fitted on"]
    notes: list[str] = []
    if calibration.gpu and calibration.gpu != gpu:
        notes.append(f"calibrated on {calibration.gpu}, predicted for {gpu}")
    if len(held) < MIN_RUNS:
        fitted = [r for r in residuals if r.split == "fitted on"]
        inside = conformal_bound([r.log_error for r in fitted], ONE_SIGMA)
        fit_note = (f"fitted-on runs agree within {pct(math.expm1(inside))} (in sample, a lower bound)"
                    if inside is not None else "")
        return Band(quantity=quantity, one_sigma=None, two_sigma=None, runs=len(held), sources=0,
                    basis="calibrated", covered=False, calibrated=True,
                    notes=tuple(notes + [n for n in (fit_note,) if n] + [
                        (f"the calibration has {len(held)} held-out {QUANTITY_NAMES[quantity]} figure(s): "
                         "calibrate with --check FILE (or 3+ run files) to get a band")]))
    as_residuals = [Residual(id=r.id, source=r.source, split="source", quantity=quantity, stack=stack, gpu=gpu,
                             family=kernel_family(gpu), seq_len=1, moe=False, pipelined=False,
                             log_error=r.log_error) for r in held]
    return _band(quantity, as_residuals, f"calibrated {stack} on {calibration.gpu or gpu}, {held[0].split} check",
                 True, notes, calibrated=True)


def significant(value: float, band: Band | None) -> str:
    """``value`` to the digits the band supports: the last digit printed is about the band's size (two
    significant digits at +/-10-99%, three at +/-1-9.9%); full precision without a band."""
    if band is None or not band.known or value == 0 or not math.isfinite(value):
        return f"{value:,.4g}"
    width = max(band.one_sigma or 0.0, 1e-3)
    digits = max(2, 1 + math.ceil(-math.log10(width)))
    rounded = float(f"{value:.{digits}g}")
    if abs(rounded) >= 10 ** (digits - 1):
        return f"{rounded:,.0f}"
    return f"{rounded:#,.{digits}g}".rstrip(".")  # '#' keeps a significant trailing zero: 50.0, not 50


__all__ = [
    "CALIBRATION_METRICS",
    "LONG_CONTEXT",
    "MIN_RUNS",
    "Band",
    "Quantity",
    "Regime",
    "Residual",
    "ResidualFile",
    "band_for",
    "calibrated_band",
    "conformal_bound",
    "load_residuals",
    "significant",
]
