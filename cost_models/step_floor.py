"""A lower bound on a step's time from compute alone, for the planner's branch and bound.

The planner bounds every (layout, options) branch by the step time of the branch's fastest combination
(:func:`sp_plan.cost_models.time_model.step_time` on the lattice bottom). That costs a full evaluation per
layout: the layout's collectives are priced on the topology, which depends on how the data-parallel ranks
are split. Most layouts are then pruned by that bound without ever being walked. This module gives a
cheaper bound that holds below it, so a branch can enter the search on it and pay for the full evaluation
only if the search ever gets that far:

* the compute seconds of :func:`sp_plan.cost_models.compute_time.compute_time` depend on the model degrees
  only (tp, ulysses, ring, pp, ep; memoized on them), not on the data-parallel split, so every layout that
  shares them shares one compute evaluation;
* every other term of the step (exposed communication, interference, offload, optimizer, overlap
  remainders) is a non-negative addend of :func:`sp_plan.cost_models.time_model._time`'s sum, so dropping
  them gives a lower bound. Without pipeline stages: ``accum x (layers x (forward + backward) + LM head) +
  the stack's step overhead``. With them: the stages' pure compute per micro-batch (the slowest stage's
  time is at least any stage's compute) times the micro-batches, plus the smallest bubble any stage's
  compute alone would leave (the schedule's bubble grows with the forward and backward times it is
  computed from, and the weight-gradient part is pure compute, the same here as there).

Tested against the full model over random layouts and options (tests/test_step_floor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .compute_time import compute_time
from .layout import Layout
from .model_spec import ModelSpec
from .pipeline import bubble_seconds, stage_layers
from .profile import CostProfile
from .time_model import _comm_model
from .topology.topology import Topology
from .train_spec import TrainSpec

#: Relative slack taken off every floor, so that a different order of the same floating-point additions
#: can never put it a rounding error above the full model's step (where every other term is zero).
ROUNDING_SLACK = 1e-12


@dataclass(frozen=True, slots=True)
class StepFloor:
    """What a step cannot go below. ``work_s``: without pipeline stages the whole step's compute plus the
    stack's step overhead; with them every micro-batch's compute on the busiest stage. ``stages``: per
    pipeline stage, its compute-only forward, backward and weight-gradient seconds per micro-batch (what the
    schedule's bubble is computed from); empty without PP."""

    work_s: float
    tokens_per_step: float
    stages: tuple[tuple[float, float, float], ...] = ()

    def step_s(self, schedule: str | None = None, virtual_stages: int = 1) -> float:
        """The floor under ``schedule`` with ``virtual_stages`` chunks (ignored without pipeline stages)."""
        seconds = self.work_s
        if self.stages and schedule is not None:
            p = len(self.stages)
            seconds += min(bubble_seconds(schedule, p, virtual_stages, t_f, t_b - t_w, t_w)
                           for t_f, t_b, t_w in self.stages)
        return seconds * (1.0 - ROUNDING_SLACK)


def step_floor(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
               profile: CostProfile) -> StepFloor:
    """The compute-only floor of ``train`` on ``layout`` (see the module docstring): at most the ``step_s``
    of :func:`sp_plan.cost_models.time_model.step_time` for the same arguments (any offload traffic)."""
    training = train.is_training
    accum = train.grad_accum
    tokens = float(train.micro_batch * train.seq_len * accum * layout.dp)
    if layout.pp == 1:
        ct = compute_time(model, train, layout, topology, profile)
        c_bwd = ct.layer_backward if training else 0.0
        compute_mb = model.num_layers * (ct.layer_forward + c_bwd) + ct.head_forward + ct.head_backward
        return StepFloor(accum * compute_mb + profile.stack.time.step_overhead_s, tokens)
    split = stage_layers(model, train, layout)
    ct = compute_time(_comm_model(model, train, layout), train, layout, topology, profile)
    c_bwd = ct.layer_backward if training else 0.0
    w_layer = max(0.0, ct.layer_backward - ct.layer_recompute - ct.attention_backward) / 2
    stages = []
    for s, n in enumerate(split):
        last = s == len(split) - 1
        t_f = n * ct.layer_forward + (ct.head_forward if last else 0.0)
        t_b = n * c_bwd + (ct.head_backward if last else 0.0)
        t_w = n * w_layer + (ct.head_backward / 2 if last else 0.0)
        stages.append((t_f, t_b, t_w))
    work = accum * max(t_f + t_b for t_f, t_b, _ in stages)
    return StepFloor(work, tokens, tuple(stages))
