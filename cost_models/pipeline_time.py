"""Pipeline parallelism in the step time: the schedule composed on the slowest stage.

:func:`pipelined_step` takes one layer's priced forward and backward (from
:mod:`sp_plan.cost_models.time_model`), builds every stage's per-micro-batch times and applies the schedule's
bubble (:func:`sp_plan.cost_models.pipeline.bubble_seconds`) to the slowest.
"""

from __future__ import annotations

from typing import NamedTuple

from .comm_time import CommProfile
from .layout import Layout
from .pipeline import bubble_seconds
from .strategies.terms import ComputeTime
from .time_terms import StrategyTerms
from .train_spec import TrainSpec


class PipelineStep(NamedTuple):
    """The schedule applied to the slowest stage (:mod:`sp_plan.cost_models.pipeline`): ``work`` is every
    micro-batch's forward and backward on it, ``bubble`` its idle fill and drain, ``fsdp`` the ZeRO traffic
    that PP leaves once per step (gathered in the first forward, reduced after the last backward),
    ``compute_mb`` its pure compute per micro-batch (``compute_mb_parts``: what the compute parts sum to
    per micro-batch for the priced stage), ``slow_mb`` its interference per micro-batch."""

    work: float
    bubble: float
    fsdp: float
    compute_mb: float
    compute_mb_parts: float
    slow_mb: float
    stage: int
    forward_s: float
    backward_s: float
    weight_grad_s: float

    def breakdown(self) -> dict[str, float]:
        return {"pipeline_bubble_s": self.bubble, "pipeline_stage_forward_s": self.forward_s,
                "pipeline_stage_backward_s": self.backward_s, "pipeline_stage_weight_grad_s": self.weight_grad_s,
                "pipeline_slowest_stage": float(self.stage), "pipeline_fsdp_once_s": self.fsdp}


def pipelined_step(train: TrainSpec, layout: Layout, split: tuple[int, ...], ct: ComputeTime, cp: CommProfile,
                   st: StrategyTerms, layer_f: float, layer_b: float, head_f: float, head_b: float,
                   slow: float) -> PipelineStep:
    """Stage times from one layer's priced forward and backward (exposed per-layer communication included),
    the LM head and the whole-model ops on the last stage, the point-to-point transfers on every stage; the
    slowest stage sets the pace. ZB-H1's weight-gradient part ``W``: half of a layer's backward GEMM time
    (dX and dW are the same size), none of attention's (no weights)."""
    p, m, v = layout.pp, train.grad_accum, train.virtual_stages
    p2p = cp.model_mb_by.get("pipeline", 0.0)
    last_only = cp.model_mb - p2p
    per_mb = st.exposed_mb + st.slow_mb + p2p
    w_layer = max(0.0, ct.layer_backward - ct.layer_recompute - ct.attention_backward) / 2
    best: tuple[float, int, float, float, float, float] | None = None
    for s, n in enumerate(split):
        last = s == p - 1
        t_f = n * layer_f + per_mb / 2 + (head_f + last_only if last else 0.0)
        t_b = n * layer_b + per_mb / 2 + (head_b if last else 0.0)
        t_w = n * w_layer + (head_b / 2 if last else 0.0)
        compute = n * (ct.layer_forward + ct.layer_backward) + (head_f + head_b if last else 0.0)
        if best is None or t_f + t_b > best[0] + best[1]:
            best = (t_f, t_b, t_w, compute, float(s), float(n))
    assert best is not None
    t_f, t_b, t_w, compute, s_slow, n_slow = best
    bubble = bubble_seconds(train.pipeline_schedule, p, v, t_f, t_b - t_w, t_w)
    n = int(n_slow)

    def hidden(comm: float, compute_s: float) -> float:
        return n * max(0.0, comm - compute_s) + min(comm, compute_s) if comm > 0 else 0.0

    # Under PP the layer gathers and reductions are once per step (strategies.fsdp): the forward gathers hide
    # behind the first micro-batch's forward, the reductions behind the last one's backward.
    fsdp = hidden(cp.prefetch_f, ct.layer_forward) + hidden(cp.prefetch_b + cp.grad_mb + cp.grad_step,
                                                           ct.layer_backward)
    parts_mb = sum(ct.parts.values())
    return PipelineStep(work=m * (t_f + t_b), bubble=bubble, fsdp=fsdp, compute_mb=compute,
                         compute_mb_parts=parts_mb, slow_mb=n * (st.slow_f + st.slow_b) + st.slow_mb,
                         stage=int(s_slow), forward_s=t_f, backward_s=t_b, weight_grad_s=t_w)
