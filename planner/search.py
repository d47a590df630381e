"""Find the fastest layout and memory options that fit.

Search, per layout, is a best-first walk of the option lattice (:mod:`sp_plan.planner.options`) in order of
predicted seconds per token: because step time never decreases and memory never increases up the
lattice, the first combination popped that fits is the fastest one that fits. Across layouts the
search is branch-and-bound: a layout's fastest conceivable combination (the lattice bottom, timed
without checking memory) bounds everything it can do, so once K plans are known, layouts whose bound
is worse are pruned without a memory evaluation (and reported as such). Most are pruned on a cheaper
bound still, which holds below that one: the bottom's compute alone
(:mod:`sp_plan.cost_models.step_floor`), shared by every layout with the same model degrees, so they are
never timed at all.

Objective: seconds per token for the same global token budget (every layout processes
``ceil(B / dp) x dp`` sequences per step, with B from ``global_batch_tokens``), multiplied by
``1 + tie_penalty x moving parts`` so that near-ties go to the simpler plan.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import time as wallclock
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sp_plan.cost_models import degrees
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.estimate import Estimate, estimate, offload_capacity, offload_traffic
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memo import Memo
from sp_plan.cost_models.memory import MemoryAssumptions, MemoryCore, host_memory, memory_core
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.pipeline import bubble_seconds, stack_stage_layers
from sp_plan.cost_models.profile import CostProfile, load_calibration, resolve_profile
from sp_plan.cost_models.stack import DEFAULT_STACK, shipped_stack_name
from sp_plan.cost_models.step_floor import StepFloor, step_floor
from sp_plan.cost_models.time_model import OffloadTraffic, StepTime, step_time
from sp_plan.cost_models.topology import Topology
from sp_plan.cost_models.train_spec import TrainSpec

from .errors import PlannerError
from .memory_memo import shared_memory_core
from .options import (
    CHEAP_AXES,
    Axis,
    Combo,
    OptionLattice,
    build_lattice,
    conflicting_pins,
    invalid_reason,
    moving_parts,
)
from .pipeline_options import PIPELINE_AXES, pipeline_axes, pipeline_branches, pipeline_invalid
from .space import LayoutSpace, StructuralRejection, layout_space

#: Default tokens per optimizer step (Llama 3 pre-training used 4M-16M tokens per batch).
DEFAULT_GLOBAL_BATCH_TOKENS = 1 << 22
#: Default fraction of device memory kept free beyond the modelled overheads.
DEFAULT_HEADROOM = 0.03


def _split_checkpoint_offload(lattice: OptionLattice) -> list[OptionLattice]:
    """``lattice`` as branches the search's monotone properties hold in, for a stack whose checkpoint offload
    keeps the saved activations instead of recomputing them (``checkpoint_offload_recomputes: false``, torch's
    ``save_on_cpu``): one without the offload, and with it one per tiled-MLP and tiled-loss choice.

    There, turning the offload on trades the recompute for PCIe traffic, so it can make a step faster:
    llama3-8b at 256K on 8 H100s under hf-fsdp2, ulysses 2 x dp_shard 4, full checkpointing took 1.270e-4 s
    per token recomputing and 1.016e-4 offloading, and the search, whose walk and branch bounds assume time
    never shrinks up the lattice, returned a plan 1.5% slower than brute force. Without the offload the
    lattice keeps that property (more checkpointing, more recompute). With it nothing is recomputed, so
    selective and full checkpointing are the same run and only full is searched (:func:`_same_run_as_full`);
    and what crosses PCIe is what a layer saves, which tiling shrinks, so tiling can make the step faster
    (ulysses 4 x dp_shard 2 at 256K: 1.081e-4 s per token untiled, 1.041e-4 with the MLP and loss tiled):
    fixing the tiling per branch leaves axes that only add time. Branches none of whose combinations is valid
    are dropped."""
    k = lattice.index("offload_checkpoints")
    if len(lattice.axes[k].values) < 2:
        return [lattice]
    c = lattice.index("checkpointing")
    tiling = [lattice.index(name) for name in ("tiled_mlp", "tiled_loss")]
    out = []
    for value in lattice.axes[k].values:
        axes = list(lattice.axes)
        axes[k] = Axis("offload_checkpoints", (value,))
        if not value:
            out.append(OptionLattice(tuple(axes)))
            continue
        if len(axes[c].values) > 1:
            axes[c] = Axis("checkpointing", tuple(v for v in axes[c].values if v != "selective"))
        for pins in itertools.product(*(lattice.axes[t].values for t in tiling)):
            for t, pin in zip(tiling, pins):
                axes[t] = Axis(lattice.axes[t].name, (pin,))
            out.append(OptionLattice(tuple(axes)))
    return [branch for branch in out
            if any(invalid_reason(branch.values(combo)) is None
                   for combo in itertools.product(*(range(len(a.values)) for a in branch.axes)))]


def _same_run_as_full(options: dict[str, Any], fixed: dict[str, Any]) -> bool:
    """Selective checkpointing with a checkpoint offload that keeps every saved activation (nothing is
    recomputed, whatever the policy): the run full checkpointing names, searched under that name (it has one
    moving part fewer for the near-tie rule), unless the user pinned selective."""
    return (options.get("offload_checkpoints") is True and options.get("checkpointing") == "selective"
            and fixed.get("checkpointing") != "selective")


def _can_offload_params(lattice: OptionLattice) -> bool:
    """Whether some valid combination of ``lattice`` offloads parameters: its axis offers it and the branch
    runs ZeRO-3 (the only stage that offloads parameters, see :func:`sp_plan.planner.options.invalid_reason`)."""
    names = [a.name for a in lattice.axes]
    if "offload_params" not in names or True not in lattice.axes[names.index("offload_params")].values:
        return False
    return "zero_stage" in names and 3 in lattice.axes[names.index("zero_stage")].values


class PlanSettings(BaseModel):
    """What the search may change, and how it scores."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    top_k: int = Field(default=5, ge=1, le=1000)
    #: Fraction of device capacity left free on top of the memory model's own overheads (allocator
    #: fragmentation, CUDA context, NCCL), to absorb what no model predicts.
    headroom: float = Field(default=DEFAULT_HEADROOM, ge=0.0, lt=0.9)
    global_batch_tokens: int = Field(default=DEFAULT_GLOBAL_BATCH_TOKENS, ge=1, le=1 << 40)
    #: Relative score penalty per moving part (extra parallel dim or optional mechanism): a tie-break.
    tie_penalty: float = Field(default=0.002, ge=0.0, le=0.1)
    #: Layout degrees the user pinned (e.g. {"ulysses": 8}).
    fixed_layout: dict[str, int] = Field(default_factory=dict)
    #: Memory options the user pinned (TrainSpec field -> value).
    fixed_options: dict[str, Any] = Field(default_factory=dict)
    micro_batch_fixed: bool = False
    #: The software stack the plan is for: a shipped profile's name (``sp-plan``, ``hf-deepspeed``,
    #: ``torchtitan``) or a stack YAML file (:mod:`sp_plan.cost_models.stack`). None: the calibration file's
    #: stack, else ``sp-plan``.
    stack: str | None = Field(default=None, max_length=4096)
    #: A calibration file (``sp-plan calibrate``) whose overrides apply on top of the stack.
    calibration: str | None = Field(default=None, max_length=4096)
    #: Memory-assumption overrides (``--assume KEY=VALUE``) applied on top of the stack and calibration.
    assume: dict[str, Any] = Field(default_factory=dict)
    #: Memory-model assumptions replacing the resolved profile's wholesale (None: the profile's). An
    #: explicit ``assumptions`` argument to :func:`search` takes precedence over this.
    assumptions: MemoryAssumptions | None = None
    #: Most host memory (bytes per GPU) offloaded state may use (``--max-offload-gb``); None: only the
    #: node's RAM bounds it. 0 forbids offloading.
    max_offload_bytes: float | None = Field(default=None, ge=0, le=1e15)


@dataclass(frozen=True)
class ResolvedSettings:
    """What a search assumes: the profile every evaluation uses, and how a plan file records it."""

    profile: CostProfile
    #: The stack as recorded in a plan: a shipped profile's name, or a stack file's absolute path.
    stack: str
    #: The calibration file's absolute path, or None.
    calibration: str | None


def resolve_settings(settings: PlanSettings, gpu: str, assumptions: MemoryAssumptions | None = None) -> ResolvedSettings:
    """The one :class:`~sp_plan.cost_models.profile.CostProfile` a search with ``settings`` uses on ``gpu``:
    the stack, the GPU's kernel model, the calibration's overrides, ``settings.assume``; then
    ``assumptions`` (else ``settings.assumptions``), when given, replace its memory assumptions.

    Memoized on the references and the files' size and modification time, so the many searches of a
    capacity question share one resolution and one profile object (the cost model's memo tables key on
    the profile's identity), while an edited file is re-read.
    """
    try:
        assume = tuple(sorted(settings.assume.items()))
        hash(assume)
    except TypeError as exc:
        raise PlannerError(f"memory-assumption overrides must be plain values: {settings.assume}") from exc
    return _resolve(settings.stack, settings.calibration, gpu, assume, _stamp(settings.stack),
                    _stamp(settings.calibration), assumptions or settings.assumptions)


def _stamp(ref: str | None) -> tuple | None:
    """A file reference's identity for the memo: its resolved path, size and modification time."""
    if ref is None or shipped_stack_name(ref) is not None:
        return None
    try:
        path = Path(ref).expanduser()
        st = path.stat()
    except (OSError, ValueError):
        return None
    return str(path.resolve()), st.st_size, st.st_mtime_ns


@lru_cache(maxsize=64)
def _resolve(stack: str | None, calibration: str | None, gpu: str, assume: tuple, stack_stamp: tuple | None,
             calibration_stamp: tuple | None, override: MemoryAssumptions | None) -> ResolvedSettings:
    cal = load_calibration(Path(calibration).expanduser()) if calibration is not None else None
    ref = stack if stack is not None else (cal.stack if cal is not None and cal.stack else None)
    profile = resolve_profile(gpu, ref, cal, dict(assume) or None).with_assumptions(override)
    if ref is None:
        recorded = DEFAULT_STACK
    elif shipped_stack_name(ref) is not None:
        recorded = shipped_stack_name(ref)
    else:
        recorded = str(Path(ref).expanduser().resolve())
    cal_path = str(Path(calibration).expanduser().resolve()) if calibration is not None else None
    return ResolvedSettings(profile, recorded, cal_path)


class RankedPlan(BaseModel):
    """One feasible plan: a layout, its options and everything predicted for it."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    rank: int
    layout: Layout
    options: dict[str, Any]
    train: TrainSpec
    estimate: Estimate
    score: float = Field(description="objective: seconds per token x (1 + tie penalty x moving parts)")
    moving_parts: int

    def to_json_dict(self) -> dict[str, Any]:
        est = self.estimate.to_json_dict()
        return {
            "rank": self.rank,
            "layout": self.layout.as_dict(),
            "options": self.options,
            "memory": est["memory"],
            "host_memory": est["host_memory"],
            "comm": est["comm"],
            "time": est["time"],
            "fits": est["fits"],
            "placement": est["placement"],
            "score": self.score,
            "moving_parts": self.moving_parts,
        }


RejectionKind = Literal["structure", "memory", "bound", "slower"]


class Rejection(BaseModel):
    model_config = ConfigDict(frozen=True)

    layout: dict[str, int]
    options: dict[str, Any] | None = None
    kind: RejectionKind
    reason: str
    #: For memory rejections: bytes over the usable capacity with every allowed memory option on.
    shortfall_bytes: float | None = None
    #: For slower plans: their seconds per token and tokens/s.
    score: float | None = None

    def describe_layout(self) -> str:
        parts = [f"{k}={v}" for k, v in self.layout.items() if v > 1]
        return " x ".join(parts) or "single GPU"


class SearchStats(BaseModel):
    layouts: int
    structural_rejections: int
    memory_evaluations: int
    time_evaluations: int
    #: Compute-only floors taken to bound branches (sp_plan.cost_models.step_floor; far cheaper than a time
    #: evaluation, and not counted among them).
    floor_evaluations: int = 0
    pruned_by_bound: int
    seconds: float


class SearchResult(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    plans: list[RankedPlan]
    rejected: list[Rejection]
    stats: SearchStats
    global_batch_sequences: int
    usable_bytes: float
    #: What the plans assume (see :func:`resolve_settings`): the stack as a shipped name or a file path,
    #: the calibration file (or None), and the resolved profile's display name.
    stack: str = DEFAULT_STACK
    calibration: str | None = None
    profile_name: str = DEFAULT_STACK

    @property
    def best(self) -> RankedPlan:
        if not self.plans:
            raise PlannerError("no plan fits")
        return self.plans[0]


@dataclass(order=True)
class _Scored:
    score: float
    combo: Combo = field(compare=False)
    train: TrainSpec = field(compare=False)
    time: StepTime = field(compare=False)
    #: The memory evaluation, or how to make it: the walk times many combinations it never pops, and
    #: only popped ones need their memory (see _Searcher.timed).
    _report: MemoryCore | Callable[[], MemoryCore] = field(compare=False, repr=False)
    #: Host bytes per GPU when the time evaluation already needed them (offloading combinations), else None: a
    #: combination over the host's capacity cannot fit, which the walk then knows without the device simulation.
    host_total: float | None = field(default=None, compare=False)

    @property
    def report(self) -> MemoryCore:
        if callable(self._report):
            self._report = self._report()
        return self._report


class _Searcher:
    """One search; holds the caches and counters."""

    def __init__(self, model: ModelSpec, base: TrainSpec, topology: Topology, settings: PlanSettings,
                 assumptions: MemoryAssumptions | None):
        self.model, self.base, self.topology, self.settings = model, base, topology, settings
        # One profile for the whole search: every memory, time and estimate call below gets this object.
        self.resolved = resolve_settings(settings, topology.gpu.name, assumptions)
        self.profile = self.resolved.profile
        self.assumptions = self.profile.memory
        self.gpu = topology.gpu
        self.usable = topology.gpu.memory_bytes * (1.0 - settings.headroom)
        host_available = offload_capacity(topology, self.assumptions)
        limit = settings.max_offload_bytes
        #: Host memory offloaded state may use per GPU: what the node's RAM leaves it, or --max-offload-gb below.
        self.host_capacity = host_available if limit is None else min(host_available, limit)
        self.host_limited_by_setting = limit is not None and limit < host_available
        self.fixed_options = dict(settings.fixed_options)
        offload_pins = [k for k in _OFFLOAD_OPTIONS if self.fixed_options.get(k)]
        if limit == 0 and offload_pins:
            raise PlannerError(
                f"--max-offload-gb 0 forbids offloading, but {', '.join('--' + k.replace('_', '-') for k in offload_pins)} "
                "is pinned on; drop one of them")
        if limit == 0:  # nothing may be offloaded: the offload axes are pinned off (pins on were refused)
            self.fixed_options.update({k: False for k in _OFFLOAD_OPTIONS})
        #: What the stack can run (its profile's ``search`` section): the option values and head splits
        #: plans under it may use.
        self.stack_search = self.profile.stack.search
        if base.is_training:
            self._check_pins_against_stack()
        self.memory_evals = 0
        self._trains: dict[tuple, TrainSpec] = {}
        self.time_evals = 0
        #: Compute-only floors taken (sp_plan.cost_models.step_floor): far cheaper than a time evaluation.
        self.floor_evals = 0
        #: The ZeRO (and pipeline schedule) branches, shared by layouts that split data parallelism differently.
        self._branches: dict[tuple, tuple[OptionLattice, ...]] = {}
        #: Compute-only floors by what they depend on (see floor_bound).
        self._floors: dict[tuple, StepFloor] = {}
        #: A branch's floor per token and its options' moving parts, by model degrees and branch (kept alive here).
        self._branch_floors: dict[tuple, tuple[OptionLattice, float, int]] = {}
        #: A pipelined layout's bottom, timed once per micro-batch (see pipeline_bound).
        self._pipeline_bottoms: dict[tuple, tuple[float, tuple[float, float, float], float] | None] = {}
        #: Each layout's moving parts (see layout_parts).
        self._layout_parts: dict[Layout, int] = {}
        if base.is_training:
            self.batch_sequences = max(1, settings.global_batch_tokens // base.seq_len)
        else:
            self.batch_sequences = base.micro_batch

    def _check_pins_against_stack(self) -> None:
        """A pinned option value the stack cannot run is refused (a plan with it would not launch there)."""
        for name, allowed in self.stack_search.options.items():
            value = self.fixed_options.get(name)
            if name in self.fixed_options and value not in allowed:
                option = "--" + _FLAG_NAMES.get(name, name.replace("_", "-"))
                pin = (option if value else option.replace("--", "--no-", 1)) if isinstance(value, bool) \
                    else f"{option} {value}"
                values = ", ".join(str(v) for v in allowed)
                raise PlannerError(
                    f"{pin} is not something the {self.profile.name} stack runs ({name}: {values}); drop the pin "
                    "or plan for another --stack")

    def stack_refusal(self, layout: Layout) -> str | None:
        """Why the stack cannot run ``layout`` for this model and sequence, or None."""
        reason = self.stack_search.refusal(self.model, layout, self.base.seq_len)
        return f"{reason} (the {self.profile.name} stack)" if reason else None

    # ----- evaluation ---------------------------------------------------------------------------
    def sequences_per_rank(self, layout: Layout) -> int:
        if not self.base.is_training:
            return self.base.micro_batch
        return max(1, math.ceil(self.batch_sequences / layout.dp))

    def lattice(self, layout: Layout) -> OptionLattice:
        full = build_lattice(self.base, self.fixed_options, self.sequences_per_rank(layout),
                             self.settings.micro_batch_fixed, self.stack_search.options)
        if self.base.is_training:
            full = OptionLattice(full.axes + pipeline_axes(self.model, layout, self.fixed_options,
                                                           self.stack_search.options.get("pipeline_schedule")))
        return full

    def pipeline_invalid(self, layout: Layout, options: dict[str, Any]) -> str | None:
        """Why the options' schedule cannot run on ``layout`` (see :mod:`.pipeline_options`)."""
        if layout.pp == 1:
            return None
        accum = max(1, self.sequences_per_rank(layout) // options["micro_batch"])
        return pipeline_invalid(self.model, layout, options, accum) or (
            None if self.base.stage_layers is not None else
            self.stack_search.stage_split_refusal(self.model.num_layers, layout.pp, options["virtual_stages"]))

    def lattices(self, layout: Layout) -> list[OptionLattice]:
        """One lattice per ZeRO stage to try (the stage is a branch, not a lattice axis).

        ZeRO is the one option that is not monotone in time: ZeRO-2's once-per-step parameter
        all-gather is exposed while ZeRO-3's re-gathers hide behind compute, so either can be faster;
        and with a shard group of one it changes nothing but buffers. Searching each stage as its own
        branch keeps the lattice's monotone properties exact.

        The branches depend on the layout only through its data-parallel degree (sequences per rank),
        pipeline degree and whether it shards at all, so the layouts that differ only in how they split
        data parallelism share them.
        """
        key = (layout.dp, layout.pp, layout.shard_group == 1)
        branches = self._branches.get(key)
        if branches is None:
            branches = self._branches[key] = tuple(self._build_branches(layout))
        return list(branches)

    def _build_branches(self, layout: Layout) -> list[OptionLattice]:
        full = self.lattice(layout)
        k = full.index("zero_stage")
        branches = [OptionLattice(full.axes[:k] + (Axis("zero_stage", (z,)),) + full.axes[k + 1:])
                    for z in full.axes[k].values]
        # A branch where no combination is valid (a pinned parameter offload needs ZeRO-3) is no branch.
        branches = [b for b in branches if not invalid_reason(b.values(self.most_saving_valid(b)))]
        if layout.shard_group == 1 and "zero_stage" not in self.fixed_options and branches:
            # Nothing to shard: the lowest stage is the same run without gathers, except that parameter
            # offload exists only under ZeRO-3, so a ZeRO-3 branch that can offload parameters stays
            # (on one GPU it is what lets the longest sequences fit).
            lowest, rest = branches[0], branches[1:]
            branches = [lowest] + [b for b in rest if b.axes[k].values == (3,) and _can_offload_params(b)
                                   and not _can_offload_params(lowest)]
        if not self.profile.stack.time.checkpoint_offload_recomputes:
            branches = [c for b in branches for c in _split_checkpoint_offload(b)]
        if layout.pp > 1:  # --- pipeline: a branch per schedule, chunks and micro-batch (pipeline_options)
            branches = [p for b in branches
                        for p in pipeline_branches(b, lambda o: self.pipeline_invalid(layout, o) is None)]
        return branches

    def train_for(self, layout: Layout, options: dict[str, Any]) -> TrainSpec:
        update = dict(options)
        if self.base.is_training:
            update["grad_accum"] = max(1, self.sequences_per_rank(layout) // update["micro_batch"])
        # One TrainSpec per distinct option set, shared by the layouts that ask for it (cheaper than
        # a copy, and the cost model's caches then hit by identity). Values come from the validated
        # lattice, so the copy skips re-validation.
        key = tuple(update.items())
        train = self._trains.get(key)
        if train is None:
            train = self._trains[key] = self.base.model_copy(update=update)
        if layout.pp > 1 and self.stack_search.stage_split != "balanced":
            train = self._stack_split(layout, train, key)
        return train

    def _stack_split(self, layout: Layout, train: TrainSpec, key: tuple) -> TrainSpec:
        """``train`` with the stage split the stack runs (its ``search.stage_split``) when none is pinned: the
        plan then carries, and is priced with, a split its launcher can express."""
        split = stack_stage_layers(self.model, train, layout, self.stack_search.stage_split)
        if split is None:
            return train
        key = (*key, ("stage_layers", split))
        with_split = self._trains.get(key)
        if with_split is None:
            with_split = self._trains[key] = train.model_copy(update={"stage_layers": split})
        return with_split

    def memory(self, layout: Layout, train: TrainSpec) -> MemoryCore:
        self.memory_evals += 1
        # memory_core looked up here, so a spy set on this module sees the evaluations the table makes.
        return shared_memory_core(self.model, train, layout, self.profile.memory, memory_core)

    def device_fits(self, core: MemoryCore) -> bool:
        """Device memory within capacity minus headroom. Monotone: never lost by moving up the lattice,
        which is what the floors and closures rely on. A slice the stack's kernels cannot address (int32
        row offsets) does not fit either; it depends on the layout alone, so monotonicity holds."""
        return core.total <= self.usable and core.within_kernel_limits

    def fits(self, core: MemoryCore) -> bool:
        """Device memory and offloaded host memory both fit (host use only grows with offloading, so
        this is not monotone; the search prunes on :meth:`device_fits` and filters on this)."""
        return self.device_fits(core) and core.host_total <= self.host_capacity

    def layout_parts(self, layout: Layout) -> int:
        """:func:`layout_moving_parts`, once per layout (every score of the layout reads it)."""
        parts = self._layout_parts.get(layout)
        if parts is None:
            parts = self._layout_parts[layout] = layout_moving_parts(layout)
        return parts

    def score(self, layout: Layout, options: dict[str, Any], t: StepTime) -> float:
        parts = self.layout_parts(layout) + moving_parts(options)
        return t.step_s / t.tokens_per_step * (1.0 + self.settings.tie_penalty * parts)

    def timed(self, layout: Layout, combo: Combo, lattice: OptionLattice) -> _Scored | None:
        options = lattice.values(combo)
        if invalid_reason(options) or self.pipeline_invalid(layout, options):
            return None
        train = self.train_for(layout, options)
        self.time_evals += 1
        host = None
        if any(options.get(k) for k in _OFFLOAD_OPTIONS):
            # Offload traffic is priced from the memory model's host bytes (no device simulation).
            held = host_memory(self.model, train, layout, self.profile.memory)
            offload, host = offload_traffic(held), held.total
        else:
            offload = _NO_OFFLOAD
        t = step_time(self.model, train, layout, self.topology, offload, self.profile)
        # Device memory waits until the walk pops the combination (most timed ones never are).
        return _Scored(self.score(layout, options, t), combo, train, t, lambda: self.memory(layout, train), host)

    def scored_fits(self, scored: _Scored) -> bool:
        """:meth:`fits` of a timed combination: False without its device memory when its host bytes, known from
        its time evaluation, already exceed the host's capacity (the same figures memory_core reports)."""
        if scored.host_total is not None and scored.host_total > self.host_capacity:
            return False
        return self.fits(scored.report)

    def host_overflows(self, layout: Layout, train: TrainSpec) -> bool:
        """Whether ``train``'s offloaded state exceeds the host's capacity, asked without the device simulation
        (:func:`~sp_plan.cost_models.memory.host_memory`, the same figures memory_core reports) where that is
        cheaper: without pipeline stages. With them host_memory runs memory_core itself, so False (unknown)."""
        if layout.pp > 1 or not any(getattr(train, k) for k in _OFFLOAD_OPTIONS):
            return False
        return host_memory(self.model, train, layout, self.profile.memory).total > self.host_capacity

    def bottom_bound(self, layout: Layout, lattice: OptionLattice) -> float:
        """Score of the lattice's fastest valid combination, timed without any memory evaluation (so
        without offload traffic, which the bottom has none of): a lower bound on every combination
        of the branch, since time never shrinks up the lattice."""
        combo = lattice.repair_up(lattice.bottom)
        options = lattice.values(combo)
        if invalid_reason(options):
            return 0.0  # no cheap bound: the floor decides
        train = self.train_for(layout, options)
        self.time_evals += 1
        return self.score(layout, options, step_time(self.model, train, layout, self.topology, _NO_OFFLOAD,
                                                     self.profile))

    def pipeline_bound(self, layout: Layout, lattice: OptionLattice) -> float:
        """A lower bound on every combination of a pipelined branch, one step time per layout and micro-batch:
        the slowest stage's forward, backward and weight-gradient times at the bottom of the lattice, on the
        branch's own chunks (one chunk: zero-bubble, the fewest transfers), bound every ZeRO stage's and
        schedule's stage work with those chunks (ZeRO moves only once-per-step traffic under PP), and the bound
        is that work times the micro-batches plus the branch's own bubble on those times (each bubble grows with
        them). So a layout's (ZeRO, schedule) branches of one chunk count cost one time evaluation."""
        options = lattice.values(lattice.repair_up(lattice.bottom))
        timed = self._pipeline_bottom(layout, options)
        if timed is None:
            return 0.0  # no cheap bound: the floor decides
        tokens, (t_f, t_b, t_w), m = timed
        bubble = bubble_seconds(options["pipeline_schedule"], layout.pp, options["virtual_stages"], t_f, t_b - t_w, t_w)
        parts = self.layout_parts(layout) + moving_parts(options)
        return (m * (t_f + t_b) + bubble) / tokens * (1.0 + self.settings.tie_penalty * parts)

    def _pipeline_bottom(self, layout: Layout, options: dict[str, Any]) -> tuple[float, tuple[float, float, float],
                                                                                   float] | None:
        """Tokens per step, the slowest stage's (forward, backward, weight-gradient) seconds and the
        micro-batches at the options every branch of ``layout`` with these non-schedule options and chunks is
        bounded at; timed once per layout, chunk count and micro-batch, None when the options are invalid."""
        chunks = options["virtual_stages"]
        key = (layout, chunks,
               tuple((k, v) for k, v in options.items() if k not in PIPELINE_AXES and k != "zero_stage"))
        if key not in self._pipeline_bottoms:
            # One chunk: zero-bubble, the fewest transfers, bounds 1F1B and zero-bubble alike. More chunks: the
            # branch's own interleaved split (layers dealt to chunks can leave the slowest stage lighter than
            # one chunk's split: llama3-8b 4K, pp=2 x dp_shard=4, 2 chunks, megatron-core, 9.29e-6 s per token
            # against a one-chunk bound of 9.80e-6), which also carries the MoE all-to-all overlap that
            # Megatron-Core runs only under virtual stages.
            schedule = "zero_bubble" if chunks == 1 else "interleaved_1f1b"
            bottom = {**options, "pipeline_schedule": schedule, "virtual_stages": chunks}
            if invalid_reason(bottom) or (chunks > 1 and self.pipeline_invalid(layout, bottom)):
                self._pipeline_bottoms[key] = None
            else:
                train = self.train_for(layout, bottom)
                self.time_evals += 1
                t = step_time(self.model, train, layout, self.topology, _NO_OFFLOAD, self.profile)
                self._pipeline_bottoms[key] = (t.tokens_per_step, t.stage_s, train.grad_accum)
        return self._pipeline_bottoms[key]

    def floor_bound(self, layout: Layout, lattice: OptionLattice) -> float:
        """A cheaper lower bound than :meth:`bottom_bound` (plain branches) or :meth:`pipeline_bound`
        (pipelined ones), and never above them: the same options' compute-only step
        (:func:`sp_plan.cost_models.step_floor.step_floor`), whose compute is shared by every layout with the
        same model degrees. Branches enter the search on it; the tighter bound is paid for when popped."""
        # Layouts that split data parallelism differently share their branches (see lattices) and their
        # floors: only the layout's own moving parts differ.
        key = (layout.model_degrees(), id(lattice))
        entry = self._branch_floors.get(key)
        if entry is None or entry[0] is not lattice:
            entry = self._branch_floors[key] = (lattice, *self._branch_floor(layout, lattice))
        _, per_token, option_parts = entry
        return per_token * (1.0 + self.settings.tie_penalty * (self.layout_parts(layout) + option_parts))

    def _branch_floor(self, layout: Layout, lattice: OptionLattice) -> tuple[float, int]:
        """:meth:`floor_bound` before the moving-parts penalty (seconds per token), and the moving parts of
        the options it is taken at."""
        options = lattice.values(lattice.repair_up(lattice.bottom))
        if invalid_reason(options):
            return 0.0, 0
        return self.floor_per_token(layout, options), moving_parts(options)

    def floor_per_token(self, layout: Layout, options: dict[str, Any]) -> float:
        """The compute-only floor (:func:`sp_plan.cost_models.step_floor.step_floor`) of ``options`` (valid) on
        ``layout``, in seconds per token: at most their step time per token. With pipeline stages it is taken
        on the options' own schedule and chunks (:meth:`combination_floor`): a zero-bubble, one-chunk floor,
        shared across a layout's schedules, can exceed an interleaved step, whose chunked stage split is
        better balanced (llama3-8b 32K, pp=16 x ring=2, 2 chunks, hf-fsdp2: 8.64e-6 s per token against a step
        of 8.61e-6; tests/test_step_floor.py), which would prune a branch holding a better plan."""
        if layout.pp > 1:
            return self.combination_floor(layout, options)
        # The floor reads the model degrees (compute), the data-parallel degree (tokens per step, micro-batches)
        # and the options other than ZeRO (no compute term reads it): layouts that only split data parallelism
        # differently, and a layout's ZeRO branches, share it.
        key = (layout.model_degrees(), layout.dp,
               tuple((k, v) for k, v in options.items() if k not in PIPELINE_AXES and k != "zero_stage"))
        floor = self._floors.get(key)
        if floor is None:
            self.floor_evals += 1
            floor = self._floors[key] = step_floor(self.model, self.train_for(layout, options), layout, self.topology,
                                                   self.profile)
        return floor.step_s() / floor.tokens_per_step

    def combination_floor(self, layout: Layout, options: dict[str, Any]) -> float:
        """The compute-only floor of exactly ``options`` (valid) on ``layout``, seconds per token: at most their
        step per token (tests/test_step_floor.py). Without pipeline stages it is :meth:`floor_per_token`'s
        (shared); with them it is taken on the options' own schedule and chunks, whose stage split and bubble
        are what the step is priced with (a zero-bubble, one-chunk floor can exceed an interleaved step)."""
        if layout.pp == 1:
            return self.floor_per_token(layout, options)
        key = (layout.model_degrees(), layout.dp, tuple((k, v) for k, v in options.items() if k != "zero_stage"))
        floor = self._floors.get(key)
        if floor is None:
            self.floor_evals += 1
            floor = self._floors[key] = step_floor(self.model, self.train_for(layout, options), layout, self.topology,
                                                   self.profile)
        return floor.step_s(options["pipeline_schedule"], options["virtual_stages"]) / floor.tokens_per_step

    # ----- per layout ---------------------------------------------------------------------------
    def most_saving_valid(self, lattice: OptionLattice) -> Combo:
        """The top of the lattice, stepped down on axes that would make it invalid."""
        combo = list(lattice.top)
        names = [a.name for a in lattice.axes]
        for _ in range(len(combo) + 1):
            options = lattice.values(tuple(combo))
            reason = invalid_reason(options)
            if reason is None:
                return tuple(combo)
            if "ZeRO-3" in reason:
                combo[names.index("offload_params")] = 0
            elif "checkpoint offload" in reason:
                combo[names.index("offload_checkpoints")] = 0
            else:  # parameter offload without optimizer offload: add the latter, or (pinned off) drop the former
                k = names.index("offload_optimizer")
                if combo[k] < len(lattice.axes[k].values) - 1:
                    combo[k] = len(lattice.axes[k].values) - 1
                else:
                    combo[names.index("offload_params")] = 0
        return tuple(combo)

    def saving_fits(self, layout: Layout, options: dict[str, Any]) -> bool:
        """Whether the most memory-saving options of a bound fit. One axis is not monotone under every
        stack: DeepSpeed's TiledMLP (``hf-deepspeed``) concatenates its tiles' outputs and holds per-tile
        parameter gradients, so with two tiles or fewer it costs memory. A bound that turned the tiled MLP
        on therefore also tries it off, so the pruning never discards a combination that fits."""
        if self.device_fits(self.memory(layout, self.train_for(layout, options))):
            return True
        if options.get("tiled_mlp") and "tiled_mlp" not in self.settings.fixed_options:
            return self.device_fits(self.memory(layout, self.train_for(layout, {**options, "tiled_mlp": False})))
        return False

    def floor(self, layout: Layout, lattice: OptionLattice, top: Combo) -> Combo:
        """Per expensive axis, the least value that fits with every other axis at its most saving (valid)
        value; cheap axes (:data:`sp_plan.planner.options.CHEAP_AXES`) start at their fastest value, which the
        walk's cheap closures explore at little cost.

        Memory is monotone, so no fitting combination lies below this floor on any axis: it is where
        the walk starts, and its time bounds everything the layout can do.

        The same monotony answers some probes from earlier ones without a memory evaluation
        (:func:`implied_fit`): the optimizer-offload probe drops the parameter offload too (one needs the
        other), so when it fits, the parameter-offload probe above it fits as well.
        """
        start = []
        decided: list[tuple[Combo, bool]] = []
        for k, axis in enumerate(lattice.axes):
            if axis.name in CHEAP_AXES:
                start.append(0)
                continue
            chosen = top[k]
            for v in range(top[k]):
                probe = lattice.repair_down(top[:k] + (v,) + top[k + 1:], keep=k)
                if invalid_reason(lattice.values(probe)):
                    continue
                fits = implied_fit(lattice, probe, decided)
                if fits is None:
                    fits = self.saving_fits(layout, lattice.values(probe))
                    decided.append((probe, fits))
                if fits:
                    chosen = v
                    break
            start.append(chosen)
        return lattice.repair_up(tuple(start))

    def near_tie_parts(self, lattice: OptionLattice, options: dict[str, Any]) -> int:
        """Moving parts a combination above ``options`` can have fewer of: one when it checkpoints selectively and
        full checkpointing lies above it (the only step up the lattice that drops a moving part), else none."""
        if options.get("checkpointing") != "selective":
            return 0
        k = lattice.index("checkpointing")
        return int("full" in lattice.axes[k].values[lattice.axes[k].values.index("selective") + 1:])

    def descendant_bound(self, layout: Layout, lattice: OptionLattice, scored: _Scored) -> float:
        """A lower bound on the score of ``scored`` and every combination above it: its own score, except that
        a selective combination's full-checkpointing successors recompute more (time never shrinks) but carry
        one moving part fewer, so they can rank up to the near-tie discount ahead of it."""
        options = lattice.values(scored.combo)
        fewer = self.near_tie_parts(lattice, options)
        if not fewer:
            return scored.score
        penalty = self.settings.tie_penalty
        parts = self.layout_parts(layout) + moving_parts(options)
        return scored.score / (1.0 + penalty * parts) * (1.0 + penalty * (parts - fewer))

    def successors_worth_walking(self, layout: Layout, lattice: OptionLattice, combo: Combo,
                                 closure_fits: dict[Combo, bool], decided: list[tuple[Combo, bool]]
                                 ) -> Iterator[Combo]:
        """The successors of a valid ``combo`` a walk up the lattice must visit: all of them, unless even the
        cheap axes at their most saving values do not fit, in which case no combination that differs from this
        one only in cheap axes fits and only the steps up an expensive axis are left. ``closure_fits`` and
        ``decided`` (see :func:`implied_fit`) carry what the walk already knows; both are updated."""
        closure = lattice.cheap_closure(combo)
        if closure not in closure_fits:
            fits = implied_fit(lattice, closure, decided)
            if fits is None:
                fits = self.saving_fits(layout, lattice.values(closure))
                decided.append((closure, fits))
            closure_fits[closure] = fits
        return lattice.successors(combo) if closure_fits[closure] else lattice.expensive_successors(combo)

    def any_fits(self, layout: Layout, lattice: OptionLattice, top: Combo) -> bool:
        """:meth:`_any_fits`, answered once per question for every searcher that asks it (see
        :data:`_ANY_FITS`): a plan that does not fit asks it of the same layouts in its search, its nearest
        miss and its fewest-GPUs and longest-sequence probes."""
        key = self._any_fits_key(layout, lattice, top)
        if key is None:
            return self._any_fits(layout, lattice, top)
        hit = _ANY_FITS.get(key, lambda: (self.profile, self._any_fits(layout, lattice, top)))
        if hit[0] is not self.profile:  # cannot happen while the entry holds the profile; kept as a guard
            return self._any_fits(layout, lattice, top)
        return hit[1]

    def _any_fits_key(self, layout: Layout, lattice: OptionLattice, top: Combo) -> tuple | None:
        """Everything :meth:`_any_fits` reads: the model, the base spec, the profile (by identity, kept alive by
        the entry), the device and host limits, the batch, the pins (None when a pin is unhashable)."""
        try:
            pins = tuple(sorted(self.settings.fixed_options.items()))
            hash(pins)
        except TypeError:
            return None
        return (self.model, self.base, id(self.profile), self.usable, self.host_capacity, self.batch_sequences,
                pins, self.settings.micro_batch_fixed, layout, lattice, top)

    def _any_fits(self, layout: Layout, lattice: OptionLattice, top: Combo) -> bool:
        """Whether some valid combination fits device and host memory together: :meth:`best_for`'s answer to
        "is there one" without its answer to "which is fastest", so nothing is timed.

        Feasibility probes (``capacity``, and the suggestions of a plan that does not fit) ask this of layouts
        whose most saving options fit the device but overflow the host, where no combination may fit at all:
        the timed walk then times every combination above the floor. This walk evaluates memory alone, from
        the same floor over the same successors (:meth:`successors_worth_walking`), so it finds a fitting
        combination exactly when the timed walk would (tests/test_any_fits.py)."""
        start = self.floor(layout, lattice, top)
        stack, seen = [start], {start}
        closure_fits: dict[Combo, bool] = {}
        decided: list[tuple[Combo, bool]] = []
        while stack:
            combo = stack.pop()
            options = lattice.values(combo)
            if invalid_reason(options) or self.pipeline_invalid(layout, options):
                successors = lattice.successors(combo)  # walked through to every successor
            elif (not self.host_overflows(layout, train := self.train_for(layout, options))
                  and self.fits(self.memory(layout, train))):
                return True
            else:
                successors = self.successors_worth_walking(layout, lattice, combo, closure_fits, decided)
            for nxt in successors:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def best_for(self, layout: Layout, lattice: OptionLattice, start: _Scored, bound: float) -> _Scored | None:
        """Best-first walk from the lattice bottom: the first fitting combination popped is optimal.

        Returns None once every remaining combination scores worse than ``bound`` (the K-th best plan
        so far): nothing this layout can still offer would make the top K. Sets ``self.exhausted`` when
        the walk ran out of combinations instead (none fits device and host memory together).

        Successors enter the queue untimed, keyed on their compute-only floor (:meth:`combination_floor`, with
        their moving parts: a lower bound on their score whatever the time model's monotonicity, and cheap,
        its compute shared by every layout with the same model degrees), and are timed only when popped;
        about half never are (a walk ends at its first fitting pop or at ``bound``). Timed, a combination goes
        back with its score and the tie-break number it was given on entry. Since no key exceeds its score,
        the timed combinations pop in exactly the (score, entry) order of a walk that timed every successor
        on entry, and the walk returns the same combination (tests/test_walk_keys.py).

        Time never shrinks up the lattice, but the near-tie rule's moving parts can: full checkpointing has one
        fewer than selective, so a full combination above a selective one can rank up to the discount ahead of
        it. A selective combination therefore enters, and is timed, at :meth:`descendant_bound`; fitting, it
        is not returned until the queue holds nothing below its own score (its full successors walked first).
        Without this the walk returned selective or no checkpointing where full ranked up to 0.15% ahead, in 49
        of 1,204 branches of qwen3-30b-a3b at 4K on 8 H100s under hf-deepspeed (tests/test_near_tie_walk.py).

        Fits already known answer others (:func:`implied_fit`): a closure at or above a fitting combination is
        not evaluated, nor a popped combination at or below a closure that does not fit (it is expanded as
        one that does not fit would be).
        """
        self.exhausted = False
        tiebreak = itertools.count()
        queue: list[tuple[float, int, _Scored | Combo | _Final]] = [
            (self.descendant_bound(layout, lattice, start), next(tiebreak), start)]
        seen = {start.combo}
        closure_fits: dict[Combo, bool] = {}
        #: Combinations whose saving_fits is known (closures, fitting pops), for implied_fit.
        decided: list[tuple[Combo, bool]] = []
        layout_parts = self.layout_parts(layout)
        penalty = self.settings.tie_penalty

        def push(combo: Combo) -> None:
            if combo in seen:
                return
            seen.add(combo)
            options = lattice.values(combo)
            if invalid_reason(options) or self.pipeline_invalid(layout, options):
                # invalid combination: walk through it to its successors
                for deeper in lattice.successors(combo):
                    push(deeper)
                return
            parts = layout_parts + moving_parts(options) - self.near_tie_parts(lattice, options)
            key = self.combination_floor(layout, options) * (1.0 + penalty * parts)
            heapq.heappush(queue, (key, next(tiebreak), combo))

        def expand(combo: Combo) -> None:
            for nxt in self.successors_worth_walking(layout, lattice, combo, closure_fits, decided):
                push(nxt)

        while queue:
            score, order, item = heapq.heappop(queue)
            if score > bound:
                return None
            if isinstance(item, _Final):  # a fitting combination nothing left in the queue can beat
                return item.scored
            if not isinstance(item, _Scored):  # entered untimed: time it, and queue it again on its score
                scored = self.timed(layout, item, lattice)
                heapq.heappush(queue, (self.descendant_bound(layout, lattice, scored), order, scored))
                continue
            if implied_fit(lattice, item.combo, decided) is False:  # below a closure that does not fit
                expand(item.combo)
                continue
            if self.scored_fits(item):
                decided.append((item.combo, True))
                if score == item.score:
                    return item
                # Selective checkpointing queued at its descendants' bound: its full-checkpointing successors
                # may rank ahead of it on the near-tie rule, so they are walked before it is returned.
                heapq.heappush(queue, (item.score, order, _Final(item)))
            expand(item.combo)
        self.exhausted = True
        return None


#: Axes along which :meth:`_Searcher.saving_fits` is not known to be monotone: the tiled MLP (DeepSpeed's
#: TiledMLP can cost memory, which saving_fits answers by trying it off too) and the pipeline schedule axes
#: (one value per branch in the search; no monotone order is claimed for them). Combinations compared by
#: :func:`implied_fit` must agree on these.
_NON_MONOTONE_AXES = frozenset({"tiled_mlp", *PIPELINE_AXES})


def implied_fit(lattice: OptionLattice, combo: Combo, decided: list[tuple[Combo, bool]]) -> bool | None:
    """Whether ``combo`` passes :meth:`_Searcher.saving_fits`, as far as combinations already decided on the
    same layout and ``lattice`` tell (None: they do not). Device memory never grows up the lattice, so a
    combination at or above one that fits fits too, and one at or below one that does not fit does not
    either; saving_fits keeps that order between combinations that agree on the tiled MLP (it tries the one
    given and, with the tiled MLP on, the same one with it off), so only those are compared."""
    fixed = [k for k, axis in enumerate(lattice.axes) if axis.name in _NON_MONOTONE_AXES]
    for other, fits in decided:
        if any(other[k] != combo[k] for k in fixed):
            continue
        if fits and all(c >= o for c, o in zip(combo, other)):
            return True
        if not fits and all(c <= o for c, o in zip(combo, other)):
            return False
    return None


@dataclass(frozen=True)
class _Final:
    """A fitting combination queued at its own score, returned when it pops (see ``best_for``)."""

    scored: _Scored


#: Command-line flags whose name is not the option's (for messages about pins).
_FLAG_NAMES = {"zero_stage": "zero", "pipeline_schedule": "schedule"}


def layout_moving_parts(layout: Layout) -> int:
    """Parallel dimensions beyond plain sharded data parallelism."""
    fill = degrees.fill_degree()
    return sum(value > 1 for dim, value in layout.degrees().items() if dim != fill) + (layout.ep > 1)


def packing_bases(base: TrainSpec) -> list[TrainSpec]:
    """The training specs a search tries: ``base`` itself, or, when its data's packing is ``auto`` (``--lengths``
    without ``--packing``), one per packing :func:`~sp_plan.cost_models.data_balance.auto_packings` gives. The
    packing changes only the data terms (attention work, balance, padding), but those feed every time and
    memory evaluation, so each packing is a branch of its own; the search keeps each layout's fastest."""
    if base.data is None or base.data.packing != "auto":
        return [base]
    from sp_plan.cost_models.data_balance import auto_packings

    return [base.model_copy(update={"data": shape}) for shape in auto_packings(base.data)]


def _matches(layout: Layout, fixed: dict[str, int]) -> bool:
    return all(getattr(layout, k) == v for k, v in fixed.items())


def search(model: ModelSpec, base: TrainSpec, topology: Topology, settings: PlanSettings | None = None,
           assumptions: MemoryAssumptions | None = None, *, world: int | None = None) -> SearchResult:
    """Rank every feasible (layout, options) for ``model`` on ``topology`` (``world`` GPUs of it)."""
    with collector_paused():
        return _search(model, base, topology, settings, assumptions, world)


@contextmanager
def collector_paused() -> Iterator[None]:
    """CPython's cyclic garbage collector off for the duration (as it was before, afterwards).

    A search allocates hundreds of thousands of objects that live on in the cost model's memo tables, so
    the collector's full passes keep re-traversing them while finding almost no cycles: measured with
    ``gc.callbacks``, 15-18% of the CPU time of a 4,096- or 16,384-GPU plan. Reference counting still
    frees everything acyclic at once; what cycles a search leaves are collected once it is re-enabled."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _search(model: ModelSpec, base: TrainSpec, topology: Topology, settings: PlanSettings | None,
            assumptions: MemoryAssumptions | None, world: int | None) -> SearchResult:
    settings = settings or PlanSettings()
    started = wallclock.perf_counter()
    world = world or topology.num_gpus
    if world > topology.num_gpus:
        raise PlannerError(f"{world} GPUs requested but topology {topology.name} has {topology.num_gpus}")
    conflict = conflicting_pins(settings.fixed_options)
    if conflict:
        pins = ", ".join(f"{k}={v}" for k, v in settings.fixed_options.items()
                         if k in ("zero_stage", "checkpointing", "offload_checkpoints", "offload_optimizer",
                                  "offload_params"))
        raise PlannerError(f"the pinned options cannot go together ({pins}): {conflict}; change or unpin one")
    # One searcher per packing to try (``--lengths`` without ``--packing``: see packing_bases), each with its own
    # caches; their branches share one queue, so a layout's best is its best over the packings and one cut-off
    # prunes them all.
    searchers = [_Searcher(model, b, topology, settings, assumptions) for b in packing_bases(base)]
    s = searchers[0]
    space: LayoutSpace = layout_space(world, model, base, topology.gpus_per_node)
    rejected: list[Rejection] = [_structural(r) for r in space.rejected]
    layouts = [layout for layout in space.layouts if _matches(layout, settings.fixed_layout)]
    if not layouts:
        raise PlannerError(_no_layout_message(world, settings.fixed_layout, space, model, base))
    refused = {layout: s.stack_refusal(layout) for layout in layouts}
    rejected += [Rejection(layout=layout.as_dict(), kind="structure", reason=reason)
                 for layout, reason in refused.items() if reason]
    layouts = [layout for layout in layouts if not refused[layout]]
    if not layouts:
        raise PlannerError(f"no layout of {world} GPUs runs under the {s.profile.name} stack: "
                           f"{sorted({r for r in refused.values() if r})[0]}; change the pinned degrees or --stack")

    # Branch and bound over the (layout, ZeRO stage) branches, visited best-first by a lower bound on
    # what each can do. A branch enters with the cheapest bound there is, the compute-only floor of its
    # lattice bottom (_Searcher.floor_bound: one compute evaluation serves every layout with the same model
    # degrees); when popped, the bottom timed without a memory check replaces it; when popped again, its
    # floor (see _Searcher.floor: memory evaluations) replaces that with the tighter bound of its fastest
    # fitting start, and only when popped a last time is it walked. Branches whose bound already exceeds
    # the K-th best plan are pruned at any stage, so most never pay for a time evaluation, fewer still for
    # a floor. A layout's result is its best branch.
    queue: list[tuple[float, int, int, Layout, OptionLattice, object, _Searcher]] = []
    order = itertools.count()
    nearest_miss: dict[Layout, Rejection] = {}
    viable: set[Layout] = set()
    for i, layout in enumerate(layouts):
        branches = s.lattices(layout)
        if not branches:  # invalid plans are explained, never silently dropped
            rejected.append(Rejection(layout=layout.as_dict(), kind="structure",
                                      reason="no valid combination of the pinned memory options on this layout"))
        for p in searchers:
            if p.base.data is not None and not p.base.data.runs_at(layout.ring):
                continue
            if layout.pp > 1:
                # --- pipelined branches (several per layout: schedules, chunks, micro-batches) enter on their
                # time bound alone; whether their most saving options fit is asked when they are popped, so
                # the many a better plan's bound prunes never cost a memory evaluation.
                for lattice in p.lattices(layout):
                    queue.append((p.floor_bound(layout, lattice), i, next(order), layout, lattice, _UNTIMED, p))
                continue
            for lattice in p.lattices(layout):
                if not _most_saving_fits(p, layout, lattice, nearest_miss):
                    continue
                viable.add(layout)
                queue.append((p.floor_bound(layout, lattice), i, next(order), layout, lattice, _UNTIMED, p))
    heapq.heapify(queue)
    rejected += [miss for layout, miss in nearest_miss.items() if layout not in viable]

    best_of: dict[Layout, tuple[float, _Scored]] = {}
    kth_best = math.inf
    pruned_reason: dict[Layout, Rejection] = {}
    late_miss: dict[Layout, Rejection] = {}  # pipelined branches found not to fit when popped
    while queue:
        bound, i, _, layout, lattice, start, s = heapq.heappop(queue)
        if len(best_of) >= settings.top_k and bound > kth_best:
            if layout in pruned_reason:  # a layout's first reason stands (built once: most branches end here)
                continue
            what = ("even its fastest fitting options" if isinstance(start, _Scored)
                    else "even its compute alone, with no memory-saving option and no communication,"
                    if start is _UNTIMED else "even with no memory-saving option at all it")
            pruned_reason[layout] = Rejection(
                layout=layout.as_dict(), kind="bound", score=bound,
                reason=f"not evaluated: {what} could reach only {_per_token(bound)}, below the top "
                       f"{settings.top_k} plans' cut-off of {_per_token(kth_best)}")
            continue
        if start is _UNTIMED:  # entered on its compute-only floor: replace it with the timed bound it stands for
            timed = s.pipeline_bound(layout, lattice) if layout.pp > 1 else s.bottom_bound(layout, lattice)
            heapq.heappush(queue, (max(bound, timed), i, next(order), layout, lattice,
                                   _UNCHECKED if layout.pp > 1 else None, s))
            continue
        if start is _UNCHECKED:  # a pipelined branch: does anything fit? (as the loop above asks the others)
            if not _most_saving_fits(s, layout, lattice, late_miss):
                continue
            start = None
        if start is None:
            top = s.most_saving_valid(lattice)
            start = s.timed(layout, s.floor(layout, lattice, top), lattice)
            heapq.heappush(queue, (max(bound, s.descendant_bound(layout, lattice, start)), i, next(order), layout,
                                   lattice, start, s))
            continue
        limit = min(kth_best, best_of[layout][0]) if layout in best_of else kth_best
        best = None if _known_exhausted(s, layout, lattice, limit) else s.best_for(layout, lattice, start, limit)
        if best is None and s.exhausted:  # device memory fits somewhere, but never with the host RAM too
            miss = _memory_rejection(layout, lattice.values(lattice.top), start.report, s, host_bound=True)
            pruned_reason.setdefault(layout, miss)
            continue
        if best is None:  # every fitting option set is slower than the top K (or this layout's best)
            pruned_reason.setdefault(layout, Rejection(
                layout=layout.as_dict(), kind="bound",
                reason=f"fits only with options slower than the top {settings.top_k} plans (cut-off "
                       f"{_per_token(kth_best)})"))
            continue
        if layout not in best_of or best.score < best_of[layout][0]:
            best_of[layout] = (best.score, best)
        if len(best_of) >= settings.top_k:
            kth_best = sorted(score for score, _ in best_of.values())[settings.top_k - 1]
    for layout, miss in late_miss.items():  # a pipelined layout none of whose branches fits: say so
        if layout not in best_of and layout not in pruned_reason:
            pruned_reason[layout] = miss
    pruned = sum(1 for layout, r in pruned_reason.items() if layout not in best_of and r.kind == "bound")
    rejected += [r for layout, r in pruned_reason.items() if layout not in best_of]
    found = sorted(((score, layout, best) for layout, (score, best) in best_of.items()),
                   key=lambda item: item[0])

    plans = []
    for rank, (score, layout, best) in enumerate(found[: settings.top_k], start=1):
        options = {k: v for k, v in best.train.model_dump().items()
                   if k in _OPTION_KEYS or (layout.pp > 1 and k in PIPELINE_AXES)}
        full = estimate(model, best.train, layout, topology, with_placement=True, profile=s.profile)
        plans.append(RankedPlan(rank=rank, layout=layout, options=options, train=best.train, estimate=full,
                                score=score, moving_parts=layout_moving_parts(layout) + moving_parts(options)))
    best_score = found[0][0] if found else None
    best_rate = plans[0].estimate.time.tokens_per_s if plans else None
    for score, layout, best in found[settings.top_k:]:
        rate = best.time.tokens_per_step / best.time.step_s
        rejected.append(Rejection(
            layout=layout.as_dict(), options={k: getattr(best.train, k) for k in _option_keys(layout)}, kind="slower",
            score=score, reason=f"fits, but {rate:,.0f} tokens/s vs {best_rate:,.0f} tokens/s for the best plan "
                                f"({rate / best_rate - 1:+.1%}; ranked {score / best_score - 1:+.1%} behind it with "
                                "the near-tie discount for moving parts)"))
    s = searchers[0]
    stats = SearchStats(layouts=len(layouts), structural_rejections=len(space.rejected),
                        memory_evaluations=sum(p.memory_evals for p in searchers),
                        time_evaluations=sum(p.time_evals for p in searchers),
                        floor_evaluations=sum(p.floor_evals for p in searchers), pruned_by_bound=pruned,
                        seconds=wallclock.perf_counter() - started)
    return SearchResult(plans=plans, rejected=rejected, stats=stats, global_batch_sequences=s.batch_sequences,
                        usable_bytes=s.usable, stack=s.resolved.stack, calibration=s.resolved.calibration,
                        profile_name=s.profile.name)


#: Answers of _Searcher.any_fits by everything they depend on (see _Searcher._any_fits_key), with the profile
#: they were asked under; cleared when full.
_ANY_FITS: Memo[tuple[CostProfile, bool]] = Memo(max_entries=4096)

#: Queue marker of a branch that entered on its compute-only floor (_Searcher.floor_bound) and has not been
#: timed yet.
_UNTIMED = object()
#: Queue marker of a pipelined branch whose most saving options have not been memory-checked yet.
_UNCHECKED = object()

#: Options that put bytes in host memory (and traffic on PCIe).
_OFFLOAD_OPTIONS = ("offload_checkpoints", "offload_optimizer", "offload_params")
_NO_OFFLOAD = OffloadTraffic()

_OPTION_KEYS = ("zero_stage", "checkpointing", "offload_checkpoints", "tiled_loss", "tiled_mlp",
                "offload_optimizer", "offload_params", "micro_batch", "grad_accum")


def _option_keys(layout: Layout) -> tuple[str, ...]:
    """The options a plan reports: the schedule too when the layout is pipelined."""
    return _OPTION_KEYS + PIPELINE_AXES if layout.pp > 1 else _OPTION_KEYS


def _per_token(score: float | None) -> str:
    """The objective's tokens/s: discounted for moving parts (the near-tie rule), so slightly below the
    tokens/s a plan's table row shows; the pruning texts compare on this scale and say so."""
    if score is None:
        return "n/a"
    return f"{1.0 / score:,.0f} discounted tokens/s"

def _structural(r: StructuralRejection) -> Rejection:
    return Rejection(layout=dict(r.degrees), kind="structure", reason=r.reason)


def _most_saving_fits(s: _Searcher, layout: Layout, lattice: OptionLattice, misses: dict[Layout, Rejection]) -> bool:
    """Whether the branch's most memory-saving valid options fit the device; when they do not, the miss is
    kept in ``misses`` if it is the layout's nearest so far (the one --explain reports)."""
    top = s.most_saving_valid(lattice)
    top_core = s.memory(layout, s.train_for(layout, lattice.values(top)))
    if s.device_fits(top_core):
        return True
    miss = _memory_rejection(layout, lattice.values(top), top_core, s)
    if layout not in misses or _shortfall_order(miss) < _shortfall_order(misses[layout]):
        misses[layout] = miss
    return False


def _known_exhausted(s: _Searcher, layout: Layout, lattice: OptionLattice, limit: float) -> bool:
    """Whether an unbounded walk of the branch would run out of combinations, known without it: its most saving
    options fit the device but overflow the host, and the memory-only walk (:meth:`_Searcher.any_fits`, which
    finds a fitting combination exactly when the timed walk does: tests/test_any_fits.py) finds none. Then
    ``s.exhausted`` is set as :meth:`_Searcher.best_for` would set it. A plan that does not fit asks this of
    every layout, and the timed walk would time every combination above the floor to learn the same."""
    if limit != math.inf:
        return False  # a bounded walk may stop at its bound first, which the result reports differently
    top = s.most_saving_valid(lattice)
    core = s.memory(layout, s.train_for(layout, lattice.values(top)))
    if s.fits(core) or not s.device_fits(core) or s.any_fits(layout, lattice, top):
        return False
    s.exhausted = True
    return True


def _shortfall_order(r: Rejection) -> float:
    """A rejection's bytes short, for picking a layout's nearest miss (a kernel-limit miss has none)."""
    return math.inf if r.shortfall_bytes is None else r.shortfall_bytes


def _memory_rejection(layout: Layout, options: dict[str, Any], core: MemoryCore, s: _Searcher,
                      host_bound: bool = False) -> Rejection:
    total, host = core.total, core.host_total
    kernel_reason = core.kernel_limit_reason()
    if kernel_reason is not None:  # no memory option changes the slice the kernels must address
        return Rejection(layout=layout.as_dict(), options=options, kind="memory", reason=kernel_reason)
    if host_bound:
        reason = ("device memory fits only with offloading, and then the offloaded state exceeds "
                  f"{host_limit_text(s.host_capacity, s.host_limited_by_setting)}")
        return Rejection(layout=layout.as_dict(), options=options, kind="memory", reason=reason,
                         shortfall_bytes=max(0.0, host - s.host_capacity))
    if total > s.usable:
        no_offload = " (offloading forbidden by --max-offload-gb 0)" if s.settings.max_offload_bytes == 0 else ""
        reason = (f"needs {total / 1e9:.1f} GB per GPU even with every allowed memory option "
                  f"({_describe_options(options)}){no_offload}; usable {s.usable / 1e9:.1f} GB "
                  f"(capacity minus {s.settings.headroom:.0%} headroom)")
        shortfall = total - s.usable
    else:
        reason = (f"offloaded state needs {host / 1e9:.1f} GB of host memory per GPU, over "
                  f"{host_limit_text(s.host_capacity, s.host_limited_by_setting)}")
        shortfall = host - s.host_capacity
    return Rejection(layout=layout.as_dict(), options=options, kind="memory", reason=reason, shortfall_bytes=shortfall)


def host_limit_text(limit: float, by_setting: bool) -> str:
    """The host-memory bound offloaded state met, in words: the node's RAM or ``--max-offload-gb``."""
    if by_setting:
        return f"the --max-offload-gb limit ({limit / 1e9:.1f} GB per GPU)"
    return f"the host RAM available to offloads ({limit / 1e9:.1f} GB per GPU)"


def _describe_options(options: dict[str, Any]) -> str:
    parts = []
    for key, value in options.items():
        if value is True:
            parts.append(key.replace("_", " "))
        elif key == "zero_stage":
            parts.append(f"ZeRO-{value}")
        elif key == "checkpointing":
            parts.append(f"{value} checkpointing")
        elif key == "micro_batch":
            parts.append(f"micro-batch {value}")
    return ", ".join(parts)


def _no_layout_message(world: int, fixed: dict[str, int], space: LayoutSpace, model: ModelSpec,
                       base: TrainSpec) -> str:
    if fixed:
        # The pinned degrees themselves are the usual culprit: let the layout check say exactly why.
        try:
            Layout.for_world(world, **fixed).check_against(model, base.seq_len, base.tp_sequence_parallel)
        except CostModelError as exc:
            return str(exc)
        pinned = " x ".join(f"{k}={v}" for k, v in fixed.items())
        reasons = "; ".join(sorted({r.reason for r in space.rejected})[:3])
        return (f"no valid layout of {world} GPUs has {pinned}" + (f" ({reasons})" if reasons else "")
                + "; drop or change the pinned degrees")
    return f"no valid layout for {world} GPUs: " + "; ".join(sorted({r.reason for r in space.rejected})[:3])


def brute_force_best(model: ModelSpec, base: TrainSpec, topology: Topology, settings: PlanSettings | None = None,
                     assumptions: MemoryAssumptions | None = None) -> tuple[float, Layout, dict[str, Any], int]:
    """Every layout x every valid option combination, timed and memory-checked: the reference the
    search's pruning is tested and benchmarked against. Returns (best score, layout, options,
    evaluations); score is ``inf`` when nothing fits."""
    settings = settings or PlanSettings()
    space = layout_space(topology.num_gpus, model, base, topology.gpus_per_node)
    best: tuple[float, Layout | None, dict[str, Any]] = (math.inf, None, {})
    evaluations = 0
    for b in packing_bases(base):  # each packing in turn (--lengths without --packing)
        s = _Searcher(model, b, topology, settings, assumptions)
        keeps_activations = not s.profile.stack.time.checkpoint_offload_recomputes
        for layout in space.layouts:
            if not _matches(layout, settings.fixed_layout) or s.stack_refusal(layout):
                continue
            if b.data is not None and not b.data.runs_at(layout.ring):
                continue
            lattice = s.lattice(layout)
            for combo in itertools.product(*(range(len(a.values)) for a in lattice.axes)):
                if keeps_activations and _same_run_as_full(lattice.values(combo), settings.fixed_options):
                    continue  # searched as full checkpointing (see _split_checkpoint_offload)
                scored = s.timed(layout, combo, lattice)
                if scored is not None and s.fits(scored.report) and scored.score < best[0]:
                    best = (scored.score, layout, lattice.values(combo))
        evaluations += s.time_evals
    return best[0], best[1], best[2], evaluations
