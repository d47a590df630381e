"""The host-side cost of a CPU step that does not grow with the sequence, measured at a short length.

A step on CPU ranks pays, besides its kernels, for eager dispatch, autograd bookkeeping, FSDP2's hooks and
the latency of every gloo collective as the step meets it (ranks arriving a little apart, copies in and out
of the communication buffers). Measured on a 2-core box with the README's tiny Llama at 256 tokens, these
took 40-110 ms per step against 12-37 ms of priced kernels and transfers, and a torch profile of such a step
spends most of it in gloo calls (0.6-1.3 ms each, two to four times the probe's per-step latency for the
same collective timed alone) and in FSDP's pre/post hooks. No kernel rate predicts it, and at 4K tokens it is
still a fifth to a third of a CPU step, which is why CPU predictions ran 20-35% fast (issue 21 item 7).

So ``sp-plan validate`` on CPU runs the plan itself for a few steps at a sixteenth of its length, where
the kernels are small, and keeps what the time model does not price there as a per-step constant
(``calibration.compute.host_step_overhead_s`` of the probed topology); the kernels, which grow with the
length, stay priced by the kernel model. The prediction at the full length is therefore still a
prediction: 16x the tokens, the attention 256x the pairs. A plan too short to shrink 16x gets no
measurement (the prediction would be the measurement itself).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.topology.topology import Topology
from sp_plan.runtime.capabilities import memory_assumptions
from sp_plan.runtime.step import random_micro_batches, synchronize, train_step

#: The short run is this many times shorter than the plan: its kernels are then a small part of its step.
SHORT_FACTOR = 16
#: Plans predicted (kernels and transfers) at more than this many seconds per step are not measured: a host
#: overhead of ~0.1 s moves them by a few percent, and their short run would take seconds per step.
MEASURE_BELOW_STEP_S = 10.0
#: Steps of the short run: one warm-up, then these, their median kept (the slowest rank's).
SHORT_STEPS = 3


@dataclass(frozen=True)
class HostOverhead:
    """What the short run measured and what it leaves the time model to add per step."""

    seq_len: int
    measured_s: float
    predicted_s: float

    @property
    def per_step_s(self) -> float:
        """Host seconds per step the time model does not price (never negative: a model that overprices
        the short step keeps its own figure)."""
        return max(0.0, self.measured_s - self.predicted_s)

    def note(self) -> str:
        return (f"host overhead {self.per_step_s * 1e3:.1f} ms per step: the plan at {self.seq_len:,} tokens ran "
                f"{self.measured_s * 1e3:.1f} ms per step, the time model prices {self.predicted_s * 1e3:.1f} ms")


def short_length(plan) -> int | None:
    """The short run's sequence length: the plan's / :data:`SHORT_FACTOR`, down to the layout's sequence
    multiple; None when that leaves nothing."""
    multiple = plan.layout.seq_multiple(plan.train.tp_sequence_parallel)
    short = plan.train.seq_len // SHORT_FACTOR // multiple * multiple
    return short if short >= multiple else None


def measure_step_seconds(setup, seq_len: int, generator: torch.Generator, optimizer) -> float:
    """The median step time of ``setup`` at ``seq_len`` tokens over :data:`SHORT_STEPS` steps after one
    warm-up, the slowest rank's (every rank calls this)."""
    train_step(setup, random_micro_batches(setup, generator, seq_len), optimizer)
    seconds = [train_step(setup, random_micro_batches(setup, generator, seq_len), optimizer).seconds
               for _ in range(SHORT_STEPS)]
    median = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    synchronize(setup.device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def measure_without_updates(setup, seq_len: int, seed: int = 0) -> float:
    """:func:`measure_step_seconds` for a setup about to train: forward and backward only, the gradients
    dropped afterwards, so the weights, the optimizer and the data are as they were (the optimizer's own
    host time, a few milliseconds, is left to the time model's optimizer term)."""
    generator = torch.Generator().manual_seed(seed + 1_000_003 + setup.dp_rank)
    try:
        return measure_step_seconds(setup, seq_len, generator, None)
    finally:
        for part in setup.model_parts:
            part.zero_grad(set_to_none=True)


def host_overhead(plan, topology: Topology, seq_len: int, measured_s: float, assumptions) -> HostOverhead:
    """The host overhead the short run shows: its measured step less the time model's for the same plan at
    ``seq_len`` on ``topology`` (the probed CPU topology)."""
    document = plan.train.document_length
    short_train = plan.train.model_copy(update={"seq_len": seq_len,
                                                "document_length": min(document, seq_len) if document else None})
    predicted = estimate(plan.model, short_train, plan.layout, topology, assumptions, with_placement=False).time.step_s
    return HostOverhead(seq_len=seq_len, measured_s=measured_s, predicted_s=predicted)


def with_host_overhead_estimate(estimate_json: dict, overhead: HostOverhead) -> dict:
    """A plan's estimate (its JSON form) with the host overhead added to the step: the step time, tokens/s
    and the step's components (``host_overhead``)."""
    timing = dict(estimate_json.get("time") or {})
    step = timing.get("step_s")
    if not step:
        return estimate_json
    tokens_per_step = timing.get("tokens_per_s", 0.0) * step
    timing["step_s"] = step + overhead.per_step_s
    timing["tokens_per_s"] = tokens_per_step / timing["step_s"]
    components = dict(timing.get("components") or {})
    if components:
        components["host_overhead"] = components.get("host_overhead", 0.0) + overhead.per_step_s
        timing["components"] = components
    return {**estimate_json, "time": timing}


def add_measured_host_overhead(setup, seed: int = 0) -> HostOverhead | None:
    """Measure the host overhead of the plan ``setup`` runs (CPU ranks, a plan auto_configure made on the
    topology it probed) and fold it into the plan's estimate on every rank, with a note; None when the plan is
    too short to shrink or there is no probed topology to price the short run on. Collective."""
    short = short_length(setup.plan)
    step = ((setup.plan.estimate or {}).get("time") or {}).get("step_s") or 0.0
    if short is None or setup.plan.layout.pp > 1 or step > MEASURE_BELOW_STEP_S:
        return None
    measured = measure_without_updates(setup, short, seed)
    shared: list[HostOverhead | None] = [None]
    if dist.get_rank() == 0 and setup.probed_topology is not None:
        try:
            shared[0] = host_overhead(setup.plan, setup.probed_topology, short, measured,
                                      memory_assumptions(setup.adapter))
        except CostModelError as exc:  # the short plan is one the cost model refuses: keep the plan's figure
            setup.notes.append(f"host overhead not priced: {exc}")
    dist.broadcast_object_list(shared, src=0)  # every rank holds the same plan estimate
    overhead = shared[0]
    if overhead is not None:
        setup.plan = setup.plan.model_copy(update={"estimate": with_host_overhead_estimate(setup.plan.estimate,
                                                                                          overhead)})
        timing = setup.plan.estimate["time"]
        setup.notes.append(f"predicted step with the host overhead: {timing['step_s']:.3g} s, "
                           f"{timing['tokens_per_s']:,.0f} tokens/s ({overhead.note()}; the layouts were ranked "
                           "without it)")
    return overhead


def with_host_overhead(topology: Topology, overhead: HostOverhead) -> Topology:
    """``topology`` with the measured host overhead in its compute calibration."""
    spec = topology.spec
    compute = spec.calibration.compute.model_copy(update={"host_step_overhead_s": overhead.per_step_s})
    calibration = spec.calibration.model_copy(update={"compute": compute})
    return Topology(spec.model_copy(update={"calibration": calibration}))


__all__ = [
    "SHORT_FACTOR",
    "HostOverhead",
    "add_measured_host_overhead",
    "host_overhead",
    "measure_step_seconds",
    "measure_without_updates",
    "short_length",
    "with_host_overhead",
    "with_host_overhead_estimate",
]
