"""What-if questions: the longest sequence a cluster can train, the fewest GPUs for a sequence, sweeps.

Feasibility ("does any plan fit?") needs no timing: a layout can run iff its most memory-saving
allowed options fit, so each probe costs one memory evaluation per layout and stops at the first
fit. The longest sequence is monotone (a longer one needs more memory per GPU) and is found by
galloping + binary search; the GPU count is monotone only along doubling chains (see :func:`min_gpus`).
The plan that reaches the answer comes from a full :func:`sp_plan.planner.search.search` at that point.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory import MemoryAssumptions
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.topology import Topology
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.cost_models.units import MAX_SEQ_LEN

from .errors import NoFitError, PlannerError
from .memory_memo import shared_memory_core
from .search import PlanSettings, RankedPlan, SearchResult, _Searcher, packing_bases, search
from .space import layout_space

#: Largest cluster the GPU-count search considers.
MAX_GPUS = 1 << 16
#: Sequence lengths are searched in steps of at least this many tokens.
SEQ_GRANULE = 1024

TopologyFactory = Callable[[int], Topology]


class FeasibilityProbe(BaseModel):
    """The nearest miss of a feasibility check: the layout that came closest, and by how much."""

    model_config = ConfigDict(frozen=True)

    fits: bool
    layout: dict[str, int] | None = None
    options: dict[str, Any] | None = None
    total_bytes: float | None = None
    usable_bytes: float | None = None
    host_bytes: float | None = None
    host_capacity_bytes: float | None = None
    #: The host bound is ``--max-offload-gb`` (PlanSettings.max_offload_bytes), not the node's RAM.
    host_limited_by_setting: bool = False
    #: The stack's kernels cannot address the per-GPU slice (MemoryCore.kernel_limit_reason), else None,
    #: and by what factor the slice's last row offset overshoots what they address.
    kernel_limit: str | None = None
    kernel_overshoot: float = 0.0

    @property
    def miss_key(self) -> tuple[int, float]:
        """Order of nearness among misses: memory misses by shortfall, then kernel-limit misses by overshoot
        (the layout that splits the sequence most is the one to name)."""
        if self.kernel_limit is not None:
            return 1, self.kernel_overshoot
        return 0, self.shortfall_bytes

    @property
    def shortfall_bytes(self) -> float:
        if self.fits or self.total_bytes is None:
            return 0.0
        if self.kernel_limit is not None:  # not a memory miss: any layout short of memory is nearer
            return math.inf
        return max(self.total_bytes - self.usable_bytes, (self.host_bytes or 0) - (self.host_capacity_bytes or 0))

    def describe_miss(self) -> str:
        """The nearest miss in one line: which memory ran out (device, or host RAM for the offloads)."""
        layout = Layout(**(self.layout or {})).describe()
        if self.kernel_limit is not None:
            return f"{layout}: {self.kernel_limit}"
        device_short = self.total_bytes - self.usable_bytes
        if device_short <= 0:
            bound = ("the --max-offload-gb limit allows" if self.host_limited_by_setting
                     else "the host RAM available to offloads is")
            return (f"{layout} fits device memory ({self.total_bytes / 1e9:.1f} of {self.usable_bytes / 1e9:.1f} GB "
                    f"usable) only by offloading {self.host_bytes / 1e9:.1f} GB per GPU to host RAM; {bound} "
                    f"{self.host_capacity_bytes / 1e9:.1f} GB per GPU: short by {_shortfall_text(self.shortfall_bytes)}")
        return (f"{layout} needs {self.total_bytes / 1e9:.1f} GB per GPU (usable {self.usable_bytes / 1e9:.1f} GB), "
                f"short by {_shortfall_text(device_short)}, with every allowed memory option on")


def _shortfall_text(nbytes: float) -> str:
    """GB with one decimal, or MB when that would print 0.0 (a miss by one sequence-length step)."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 0.05e9 else f"{nbytes / 1e6:.1f} MB"


def probe_feasibility(model: ModelSpec, base: TrainSpec, topology: Topology, settings: PlanSettings,
                      assumptions: MemoryAssumptions | None = None, world: int | None = None) -> FeasibilityProbe:
    """Whether any layout fits with its most saving allowed options; if none, the nearest miss."""
    world = world or topology.num_gpus
    searchers = [_Searcher(model, b, topology, settings, assumptions) for b in packing_bases(base)]
    space = layout_space(world, model, base, topology.gpus_per_node)
    nearest: FeasibilityProbe | None = None
    for layout in space.layouts:
        if any(getattr(layout, k) != v for k, v in settings.fixed_layout.items()):
            continue
        # every packing the search would try (--lengths without --packing): any that fits is a fit
        branches = [(s, lattice) for s in searchers if s.base.data is None or s.base.data.runs_at(layout.ring)
                    for lattice in s.lattices(layout)]
        for s, lattice in branches:
            options = lattice.values(s.most_saving_valid(lattice))
            core = shared_memory_core(model, s.train_for(layout, options), layout, s.profile.memory)
            fits = s.fits(core)
            if s.device_fits(core) and not fits:
                # Offloading everything overflows the host: a combination with less offload may fit both.
                fits = s.any_fits(layout, lattice, s.most_saving_valid(lattice))
            probe = FeasibilityProbe(fits=fits, layout=layout.as_dict(), options=options,
                                     total_bytes=core.total, usable_bytes=s.usable, host_bytes=core.host_total,
                                     host_capacity_bytes=s.host_capacity,
                                     host_limited_by_setting=s.host_limited_by_setting,
                                     kernel_limit=core.kernel_limit_reason(),
                                     kernel_overshoot=core.row_kernel_offset / (core.row_kernel_offset_limit or 1))
            if probe.fits:
                return probe
            if nearest is None or probe.miss_key < nearest.miss_key:
                nearest = probe
    return nearest or FeasibilityProbe(fits=False)


def seq_granule(world: int) -> int:
    """Step for sequence lengths: every layout of ``world`` GPUs can split a multiple of it
    (2 x world covers ulysses x ring x tp x 2 for zigzag)."""
    step = 2 * world
    return step * math.ceil(SEQ_GRANULE / step) if step < SEQ_GRANULE else step


class MaxSeqAnswer(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    max_seq_len: int
    plan: RankedPlan | None
    granule: int
    #: Why one granule more does not fit: the nearest miss there (device memory, or host RAM for the
    #: offloads), in one line; None at the search's upper limit.
    bound_by: str | None = None


def _check_pins_split(model: ModelSpec, base: TrainSpec, topology: Topology, settings: PlanSettings,
                      world: int) -> None:
    """Refuse pinned degrees that no layout of ``world`` GPUs has (``--ulysses 16`` on 8 GPUs) as bad input, as
    ``plan`` does: without this the longest-sequence search answered "does not fit even at 1024 tokens; use
    more GPUs", a wrong reason and exit code for a typo."""
    fixed = settings.fixed_layout
    space = layout_space(world, model, base, topology.gpus_per_node)
    if not fixed or any(all(getattr(layout, k) == v for k, v in fixed.items()) for layout in space.layouts):
        return
    Layout.for_world(world, **fixed).check_against(model, base.seq_len, base.tp_sequence_parallel)
    pins = " x ".join(f"{k}={v}" for k, v in fixed.items())
    raise PlannerError(f"no valid layout of {world} GPUs has {pins}; drop or change the pinned degrees")


def max_seq_len(model: ModelSpec, base: TrainSpec, topology: Topology, settings: PlanSettings,
                assumptions: MemoryAssumptions | None = None) -> MaxSeqAnswer:
    """Longest sequence (a multiple of :func:`seq_granule`) for which some plan fits on ``topology``."""
    world = topology.num_gpus
    step = seq_granule(world)

    def feasible(n_steps: int) -> bool:
        train = base.model_copy(update={"seq_len": n_steps * step})
        return probe_feasibility(model, train, topology, settings, assumptions).fits

    if not feasible(1):
        _check_pins_split(model, base.model_copy(update={"seq_len": step}), topology, settings, world)
        closest = probe_feasibility(model, base.model_copy(update={"seq_len": step}), topology, settings,
                                    assumptions)
        miss = f" (closest: {closest.describe_miss()})" if closest.layout else ""
        raise NoFitError(
            f"{model.name} does not fit on {world} x {topology.gpu.name} even at {step} tokens{miss}; "
            "use more GPUs (see `sp-plan capacity --seq-len ...`) or allow offloading"
        )
    lo, hi = 1, 2
    limit = MAX_SEQ_LEN // step
    while hi <= limit and feasible(hi):
        lo, hi = hi, min(hi * 2, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    best_len = lo * step
    result = search(model, base.model_copy(update={"seq_len": best_len}), topology,
                    settings.model_copy(update={"top_k": 1}), assumptions)
    bound_by = None
    if lo < limit:
        miss = probe_feasibility(model, base.model_copy(update={"seq_len": (lo + 1) * step}), topology, settings,
                                 assumptions)
        bound_by = f"at {(lo + 1) * step:,} tokens {miss.describe_miss()}" if miss.total_bytes is not None else None
    return MaxSeqAnswer(max_seq_len=best_len, plan=result.plans[0] if result.plans else None, granule=step,
                        bound_by=bound_by)


def candidate_gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """Cluster sizes worth asking about: divisors of a node, then whole nodes."""
    small = [g for g in range(1, gpus_per_node) if gpus_per_node % g == 0]
    return small + list(range(gpus_per_node, max_gpus + 1, gpus_per_node))


class MinGpusAnswer(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    min_gpus: int
    plan: RankedPlan | None
    #: A layout that fits there with its most saving options (the feasibility probe's), when the fastest plan
    #: was not asked for (``plan`` None).
    fitting_layout: dict[str, int] | None = None


#: Between two doubling steps the GPU-count search probes at most this many cluster sizes.
MAX_SCAN = 64


def doubling_chain(gpus_per_node: int, max_gpus: int) -> list[int]:
    """1, 2, 4, ... up to a node, then the node times powers of two: each divides the next, so a plan
    that fits one also fits the next (the extra GPUs become data-parallel replicas)."""
    chain = [1]
    while chain[-1] * 2 < gpus_per_node and gpus_per_node % (chain[-1] * 2) == 0:
        chain.append(chain[-1] * 2)
    n = gpus_per_node
    while n <= max_gpus:
        chain.append(n)
        n *= 2
    return sorted(set(chain))


def min_gpus(model: ModelSpec, base: TrainSpec, topology_for: TopologyFactory, gpus_per_node: int,
             settings: PlanSettings, assumptions: MemoryAssumptions | None = None,
             max_gpus: int = MAX_GPUS, with_plan: bool = True) -> MinGpusAnswer:
    """Fewest GPUs (whole nodes beyond one node) on which some plan fits ``base``.

    Feasibility is not monotone in the GPU count: a sequence of 2^22 tokens splits over 64 GPUs but not
    over 72 (no sequence-parallel degree of 72 divides it, and 9 data-parallel groups of 8 hold 512K
    tokens each). It is monotone along :func:`doubling_chain`, so the search gallops and bisects over the
    chain to the first size P that fits (its predecessor Q does not), then probes the sizes between Q
    and P in increasing order (at most :data:`MAX_SCAN` of them, evenly spaced in whole nodes when more
    exist). Sizes below Q are not probed: one that fits while Q does not would need a split with an odd
    factor that Q's power of two cannot mirror.

    ``with_plan=False`` skips the final search for the fastest plan at that size (a full search of a large
    model on many GPUs: the slowest part when a plan's "no plan fits" advice only needs the count) and
    answers with the layout the feasibility probe found fitting there instead.
    """
    probes: dict[int, FeasibilityProbe] = {}

    def feasible(world: int) -> bool:
        try:
            topology = topology_for(world)
        except CostModelError:
            return False
        probes[world] = probe_feasibility(model, base, topology, settings, assumptions)
        return probes[world].fits

    chain = doubling_chain(gpus_per_node, max_gpus)
    hi = 0
    while hi < len(chain) and not feasible(chain[hi]):
        hi = hi * 2 + 1
    if hi >= len(chain):
        if not feasible(chain[-1]):
            miss = ""
            try:
                closest = probe_feasibility(model, base, topology_for(chain[-1]), settings, assumptions)
                miss = f" (closest on {chain[-1]} GPUs: {closest.describe_miss()})" if closest.layout else ""
            except CostModelError:
                pass  # no topology of that size: the message below still says what to change
            raise NoFitError(
                f"{model.name} at {base.seq_len:,} tokens does not fit on up to {chain[-1]} x "
                f"{topology_for(gpus_per_node).gpu.name}{miss}; shorten the sequence, raise --max-gpus or allow "
                "more memory options"
            )
        hi = len(chain) - 1
    lo = (hi - 1) // 2 if hi > 0 else -1  # last index known (or assumed) infeasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(chain[mid]) else (mid, hi)
    world = chain[hi]
    below = chain[lo] if lo >= 0 else 0
    between = [c for c in candidate_gpu_counts(gpus_per_node, world - 1) if c > below]
    if len(between) > MAX_SCAN:
        stride = math.ceil(len(between) / MAX_SCAN)
        between = between[stride - 1::stride]
    for count in between:
        if feasible(count):
            world = count
            break
    if not with_plan:
        return MinGpusAnswer(min_gpus=world, plan=None, fitting_layout=probes[world].layout)
    result = search(model, base, topology_for(world), settings.model_copy(update={"top_k": 1}), assumptions)
    return MinGpusAnswer(min_gpus=world, plan=result.plans[0] if result.plans else None)


class SweepPoint(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    gpus: int
    seq_len: int
    plan: RankedPlan | None
    nearest: FeasibilityProbe | None = None
    #: Why the planner refused this point outright (a pinned degree no layout of these GPUs has, a length the
    #: pins cannot split): bad input at that point, not a memory miss. None when it searched.
    refused: str | None = None


def sweep(model: ModelSpec, base: TrainSpec, topology_for: TopologyFactory, points: list[tuple[int, int]],
          settings: PlanSettings, assumptions: MemoryAssumptions | None = None) -> list[SweepPoint]:
    """The best plan at each (gpus, seq_len) point, or the nearest miss where none fits."""
    out = []
    for gpus, seq in points:
        train = base.model_copy(update={"seq_len": seq})
        topology = topology_for(gpus)
        try:
            result: SearchResult = search(model, train, topology, settings.model_copy(update={"top_k": 1}),
                                          assumptions)
        except PlannerError as exc:
            out.append(SweepPoint(gpus=gpus, seq_len=seq, plan=None, refused=str(exc)))
            continue
        if result.plans:
            out.append(SweepPoint(gpus=gpus, seq_len=seq, plan=result.plans[0]))
        else:
            out.append(SweepPoint(gpus=gpus, seq_len=seq, plan=None,
                                  nearest=probe_feasibility(model, train, topology, settings, assumptions)))
    return out

