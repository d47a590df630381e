"""The time model's overlap rules, applied once to every strategy's terms and priced traffic.

:func:`strategy_terms` sums the :class:`~sp_plan.cost_models.strategies.terms.Term` s every registered
strategy contributes (``Strategy.exposed``) by kind and by where they occur (per layer, micro-batch or
step); :func:`layer_overlap` applies the ``prefetch``/``grad`` overlap rule to the traffic of every strategy
at once. :mod:`sp_plan.cost_models.time_model` adds them into the step.
"""

from __future__ import annotations

from typing import NamedTuple

from .comm_time import CommProfile
from .errors import CostModelError
from .strategies import implementing, report_buckets
from .strategies.terms import TimeContext


class StrategyTerms(NamedTuple):
    """The registered strategies' :class:`Term` s summed by kind and by where they occur: exposed
    communication and interference per layer (forward, backward), per micro-batch and per step; offload
    and optimizer seconds per step; exposed communication by report bucket (layer terms per layer and
    micro-batch, micro-batch terms per micro-batch, step terms per step); GPU idle on host synchronisation
    per layer (forward, backward)."""

    exposed_f: float
    exposed_b: float
    slow_f: float
    slow_b: float
    exposed_mb: float
    slow_mb: float
    exposed_step: float
    slow_step: float
    offload: float
    optimizer: float
    layer_by: dict[str, float]
    microbatch_by: dict[str, float]
    step_by: dict[str, float]
    hidden_layer_by: dict[str, float]
    host_f: float = 0.0
    host_b: float = 0.0


def strategy_terms(ctx: TimeContext) -> StrategyTerms:
    """Sum every strategy's terms (local accumulators: this runs once per combination the planner times).

    One flat dispatch over (kind, at), 61 lines: it runs for every timed combination, and a helper call per
    term would cost more than the dispatch itself."""
    exposed_f = exposed_b = slow_f = slow_b = exposed_mb = slow_mb = exposed_step = slow_step = 0.0
    offload = optimizer = host_f = host_b = 0.0
    layer_by: dict[str, float] = {}
    microbatch_by: dict[str, float] = {}
    step_by: dict[str, float] = {}
    hidden_layer_by: dict[str, float] = {}
    buckets = report_buckets()
    for strategy in implementing("exposed"):
        for kind, t, at, bucket in strategy.exposed(ctx):
            if kind == "exposed_comm":
                if bucket not in buckets:
                    raise CostModelError(f"strategy {strategy.name!r} reports exposed time under unknown bucket "
                                         f"{bucket!r}; declare it in layer_buckets or model_buckets")
                if at == "layer_forward":
                    exposed_f += t
                    layer_by[bucket] = layer_by.get(bucket, 0.0) + t
                elif at == "layer_backward":
                    exposed_b += t
                    layer_by[bucket] = layer_by.get(bucket, 0.0) + t
                elif at == "microbatch":
                    exposed_mb += t
                    microbatch_by[bucket] = microbatch_by.get(bucket, 0.0) + t
                else:
                    exposed_step += t
                    step_by[bucket] = step_by.get(bucket, 0.0) + t
            elif kind == "hidden_comm":
                if at not in ("layer_forward", "layer_backward"):
                    raise CostModelError(f"strategy {strategy.name!r}: hidden communication is reported per layer")
                hidden_layer_by[bucket] = hidden_layer_by.get(bucket, 0.0) + t
            elif kind == "interference":
                if at == "layer_forward":
                    slow_f += t
                elif at == "layer_backward":
                    slow_b += t
                elif at == "microbatch":
                    slow_mb += t
                else:
                    slow_step += t
            elif kind == "host_sync":
                if at == "layer_forward":
                    host_f += t
                elif at == "layer_backward":
                    host_b += t
                else:
                    raise CostModelError(f"strategy {strategy.name!r}: host synchronisation is reported per layer")
            elif kind in ("offload", "optimizer"):
                if at != "step":
                    raise CostModelError(f"strategy {strategy.name!r}: an {kind} term is counted once per step, "
                                         f"not per {at}")
                if kind == "offload":
                    offload += t
                else:
                    optimizer += t
            else:
                raise CostModelError(f"strategy {strategy.name!r} returned a term of unknown kind {kind!r}")
    return StrategyTerms(exposed_f, exposed_b, slow_f, slow_b, exposed_mb, slow_mb, exposed_step, slow_step,
                          offload, optimizer, layer_by, microbatch_by, step_by, hidden_layer_by, host_f, host_b)


class LayerOverlap(NamedTuple):
    """What the prefetch/gradient traffic costs: exposed seconds in one micro-batch's forward (``fwd``),
    its backward (``bwd_mb``) and the last micro-batch's backward, once-per-step reductions included
    (``bwd_last``); the interference it causes per micro-batch (``slow_mb``) and the last micro-batch's
    extra (``slow_last``)."""

    fwd: float
    bwd_mb: float
    bwd_last: float
    slow_mb: float
    slow_last: float


def layer_overlap(cp: CommProfile, c_fwd: float, c_bwd: float, layers: int, slow: float,
                   training: bool) -> LayerOverlap:
    """The overlap rule of the ``prefetch`` and ``grad`` classes, applied to every strategy's traffic at
    once: one layer's traffic hides behind one layer's compute (layer i+1's behind layer i's), what
    exceeds it is exposed, plus one pipeline fill per pass. Overlapped traffic also slows the compute it
    hides behind (NCCL kernels take SMs and HBM bandwidth): ``slow`` x the overlapped time, accounted as
    interference, not as exposed communication."""
    prefetch_f, prefetch_b, grad_mb, grad_step = cp.prefetch_f, cp.prefetch_b, cp.grad_mb, cp.grad_step

    def hidden(comm: float, compute: float) -> float:
        return layers * max(0.0, comm - compute) + min(comm, compute) if comm > 0 else 0.0

    def interference(comm: float, compute: float) -> float:
        return layers * slow * min(comm, compute)

    fwd = hidden(prefetch_f, c_fwd)
    if not training:
        return LayerOverlap(fwd, 0.0, 0.0, interference(prefetch_f, c_fwd), 0.0)
    slow_mb = interference(prefetch_f, c_fwd) + interference(prefetch_b + grad_mb, c_bwd)
    slow_last = interference(prefetch_b + grad_mb + grad_step, c_bwd) - interference(prefetch_b + grad_mb, c_bwd)
    return LayerOverlap(fwd, hidden(prefetch_b + grad_mb, c_bwd), hidden(prefetch_b + grad_mb + grad_step, c_bwd),
                         slow_mb, slow_last)
