"""A step's collectives priced on the topology and sorted by overlap class (the time model's communication
part; :mod:`sp_plan.cost_models.time_model` applies the overlap rules to it).

Every op of :func:`sp_plan.cost_models.comm_volume.comm_ops` is costed once with
:func:`sp_plan.cost_models.collectives.collective_cost` on the span of its process group and added to the
sums of its class: ``exposed`` per layer and whole-model, ``prefetch`` and ``grad`` per layer; any other class
goes to the strategy that claims it (``Strategy.overlap_classes``), condensed as that strategy wants it.
The result (:class:`CommProfile`) does not depend on compute time or gradient accumulation, so it is
memoised over the fields the ops depend on (:data:`COMM_FIELDS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .collectives import collective_cost, node_dedup_fabric_fraction
from .comm_volume import comm_ops
from .errors import CostModelError
from .layout import Layout
from .memo import Memo
from .model_spec import ModelSpec
from .placement import group_spans
from .strategies import on_change, registered, report_buckets
from .strategies.terms import CommOp, PricedOp, issued
from .topology.topology import Topology
from .train_spec import TrainSpec

#: TrainSpec fields the collectives of a step depend on: comm_volume.comm_ops reads only these (a test
#: checks that changing any other field leaves the op list unchanged).
COMM_FIELDS = ("seq_len", "micro_batch", "dtype", "mode", "optimizer", "zero_stage", "checkpointing",
               "tp_sequence_parallel", "virtual_stages")

#: Overlap classes priced here; any other belongs to the strategy that claims it.
GENERIC_OVERLAP = ("exposed", "prefetch", "grad")


@dataclass(frozen=True, slots=True)
class CommProfile:
    """A step's collectives priced on the topology and sorted by how they may overlap: seconds of one
    micro-batch (``_mb``) or once per step (``_step``), per layer where named. Shared by every option
    combination that moves the same bytes, so the time model only does the arithmetic that depends on
    compute time and gradient accumulation."""

    comm_mb: dict[str, float]  # bucket -> all occurrences in one micro-batch
    comm_step: dict[str, float]  # bucket -> once-per-step ops
    fabric_mb: float
    fabric_step: float
    exposed_layer: dict[str, float]  # non-overlapping per-layer ops, one layer and micro-batch
    layer_fwd_exposed: float
    layer_bwd_exposed: float
    model_mb: float  # whole-model ops per micro-batch (exposed)
    model_mb_by: dict[str, float]
    model_step: float  # whole-model ops once per step (exposed)
    model_step_by: dict[str, float]
    prefetch_f: float  # per layer
    prefetch_b: float
    grad_mb: float  # per layer, per micro-batch
    grad_step: float  # per layer, once per step
    prefetch_f_by: dict[str, float]
    overlapped_b_by: dict[str, float]  # backward prefetch and gradient traffic, by bucket
    priced: dict[str, object]  # ops of strategy-priced overlap classes, by class, as the strategy condensed them


_PROFILES: Memo[CommProfile] = Memo()
on_change(_PROFILES.clear)


def comm_profile(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
                 node_dedup: bool = False, traffic: frozenset[str] = frozenset()) -> CommProfile:
    """:func:`price_comm`, memoised over what the ops depend on."""
    # The topology is keyed by identity (it is mutable and unhashable by value), which also keeps it
    # alive as long as its entries.
    key = (model, layout, topology, node_dedup, traffic, *(getattr(train, f) for f in COMM_FIELDS))
    return _PROFILES.get(key, lambda: price_comm(model, train, layout, topology, node_dedup, traffic))


def price_comm(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
               node_dedup: bool = False, traffic: frozenset[str] = frozenset()) -> CommProfile:
    """Every collective of a step priced on ``topology`` and classified (see :class:`CommProfile`);
    ``node_dedup``: the stack's MoE dispatcher sends a token once per remote node (DeepEP, Hybrid-EP), so
    the dispatch ops that name their fan-out (``CommOp.node_dedup``) cross nodes with fewer bytes;
    ``traffic``: the stack's traffic facts (``comm_volume.stack_traffic``), which keep the ops only some stacks
    issue (``CommOp.only_if``)."""
    spans = group_spans(layout, topology)
    sums = _CommSums(model.num_layers, {c: s for s in registered() for c in s.overlap_classes})
    memo: dict[tuple[str, float, str, tuple[int, int]], object] = {}
    for op in comm_ops(model, train, layout):
        if not issued(op, traffic):
            continue
        key = (op.collective, op.nbytes, op.group, op.node_dedup)
        cost = memo.get(key)
        if cost is None:
            span = spans[op.group]
            share = node_dedup_fabric_fraction(*op.node_dedup, span.nodes) if node_dedup and op.node_dedup[0] else 1.0
            cost = memo[key] = collective_cost(op.collective, op.nbytes, span, share)
        sums.add(op, cost.time_s, cost.fabric_bytes)
    return sums.profile()


def _zero_buckets() -> dict[str, float]:
    return dict.fromkeys(report_buckets(), 0.0)


@dataclass(slots=True)
class _CommSums:
    """The running sums :func:`price_comm` classifies each priced op into (one op at a time, in the order
    ``comm_ops`` lists them, so every sum adds the same terms in the same order)."""

    layers: int
    owners: dict[str, object]
    comm_mb: dict[str, float] = field(default_factory=_zero_buckets)
    comm_step: dict[str, float] = field(default_factory=_zero_buckets)
    exposed_layer: dict[str, float] = field(default_factory=_zero_buckets)
    model_mb_by: dict[str, float] = field(default_factory=_zero_buckets)
    model_step_by: dict[str, float] = field(default_factory=_zero_buckets)
    fabric_mb: float = 0.0
    fabric_step: float = 0.0
    lf: float = 0.0
    lb: float = 0.0
    model_mb: float = 0.0
    model_step: float = 0.0
    prefetch_f: float = 0.0
    prefetch_b: float = 0.0
    grad_mb: float = 0.0
    grad_step: float = 0.0
    prefetch_f_by: dict[str, float] = field(default_factory=dict)
    prefetch_b_by: dict[str, float] = field(default_factory=dict)
    grad_mb_by: dict[str, float] = field(default_factory=dict)
    grad_step_by: dict[str, float] = field(default_factory=dict)
    priced: dict[str, list[PricedOp]] = field(default_factory=dict)

    def add(self, op: CommOp, t: float, fabric_bytes: float) -> None:
        """One op of ``t`` seconds and ``fabric_bytes`` across nodes per occurrence: into the per-bucket
        totals, then into the sums of its overlap class."""
        times = op.count * (self.layers if op.scope == "layer" else 1)
        if op.per == "microbatch":
            self.comm_mb[op.strategy] += t * times
            self.fabric_mb += fabric_bytes * times
        else:
            self.comm_step[op.strategy] += t * times
            self.fabric_step += fabric_bytes * times
        if op.scope == "model":
            if op.per == "microbatch":
                self.model_mb += t * op.count
                self.model_mb_by[op.strategy] += t * op.count
            else:
                self.model_step += t * op.count
                self.model_step_by[op.strategy] += t * op.count
        elif op.overlap == "exposed":
            if op.phase == "forward":
                self.lf += t * op.count
            else:
                self.lb += t * op.count
            self.exposed_layer[op.strategy] += t * op.count
        elif op.overlap == "prefetch":
            if op.phase == "forward":
                self.prefetch_f += t
                self.prefetch_f_by[op.strategy] = self.prefetch_f_by.get(op.strategy, 0.0) + t
            else:
                self.prefetch_b += t
                self.prefetch_b_by[op.strategy] = self.prefetch_b_by.get(op.strategy, 0.0) + t
        elif op.overlap == "grad":
            table = self.grad_mb_by if op.per == "microbatch" else self.grad_step_by
            table[op.strategy] = table.get(op.strategy, 0.0) + t
            if op.per == "microbatch":
                self.grad_mb += t
            else:
                self.grad_step += t
        elif op.overlap in self.owners:
            self.priced.setdefault(op.overlap, []).append(PricedOp(op, t, fabric_bytes))
        else:
            raise CostModelError(f"no registered strategy prices overlap class {op.overlap!r} ({op.strategy} "
                                 f"{op.label or op.collective})")

    def profile(self) -> CommProfile:
        return CommProfile(
            comm_mb=self.comm_mb, comm_step=self.comm_step, fabric_mb=self.fabric_mb, fabric_step=self.fabric_step,
            exposed_layer=self.exposed_layer, layer_fwd_exposed=self.lf, layer_bwd_exposed=self.lb,
            model_mb=self.model_mb, model_mb_by=self.model_mb_by, model_step=self.model_step,
            model_step_by=self.model_step_by, prefetch_f=self.prefetch_f, prefetch_b=self.prefetch_b,
            grad_mb=self.grad_mb, grad_step=self.grad_step, prefetch_f_by=self.prefetch_f_by,
            overlapped_b_by=merge(self.prefetch_b_by, self.grad_mb_by, self.grad_step_by),
            priced={k: self.owners[k].condense(k, tuple(v)) for k, v in self.priced.items()},
        )


def merge(*tables: dict[str, float]) -> dict[str, float]:
    """Sum tables key by key (in the order given)."""
    out: dict[str, float] = {}
    for table in tables:
        for k, v in table.items():
            out[k] = out.get(k, 0.0) + v
    return out


def split(exposed: dict[str, float], seconds: float, weights: dict[str, float]) -> None:
    """Attribute exposed overlapped time to strategies in proportion to their traffic time."""
    total = sum(weights.values())
    if seconds <= 0 or total <= 0:
        return
    for strategy, t in weights.items():
        exposed[strategy] += seconds * t / total
