"""The layout degrees: named mesh dimensions, each registered once with the roles it plays.

A layout factors the world into degrees (``dp_replicate x dp_shard x ring x ulysses x tp`` today). What
the rest of the project needs to know about a degree is said here, in one :class:`Degree` record, rather
than by naming the degree in every module:

- its **roles**, from which the layout's derived sizes follow: ``data`` degrees see different samples
  (:attr:`Layout.dp`), ``sequence`` degrees split one sequence (:attr:`Layout.sp`), ``heads`` degrees
  split the attention heads (:attr:`Layout.head_split`), ``shards_state`` degrees are the ranks ZeRO/FSDP
  shards parameters, gradients and optimizer state over (:attr:`Layout.shard_group`), ``weights``
  degrees hold different pieces of the weights (they stay out of the gradient-reducing data group), and
  ``stages`` degrees split the layer stack into pipeline stages (:attr:`Layout.pp`: each rank holds and
  runs only its stage's layers, micro-batches flow between stages; :mod:`sp_plan.cost_models.pipeline`);
- its **mesh position** (outermost first), which fixes the rank order, hence the links its groups use;
- how the planner **searches** it: ``model`` degrees are enumerated innermost first with the degree's own
  structural ``check``; ``split`` degrees take divisors of what the model degrees leave; the one
  ``fill`` degree (``dp_shard``) takes the rest;
- what the sequence length must be a multiple of, and the degree's command-line flag and help.

Costs are not here: a degree's communication, compute and exposed time come from its
:class:`~sp_plan.cost_models.strategies.base.Strategy`, registered beside it.

Adding a degree is one module that calls :func:`register_degree` (and, for its costs,
``register_strategy``). Degrees registered when :mod:`sp_plan.cost_models.layout` is first imported become
declared fields of :class:`~sp_plan.cost_models.layout.Layout`; degrees registered later (a plugin, a
test) are accepted as validated extra fields, with the same bounds and the same behaviour everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .errors import CostModelError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .model_spec import ModelSpec

Role = Literal["data", "sequence", "heads", "shards_state", "weights", "stages"]
#: ``stages``: the degree splits the layer stack (pipeline parallelism). Its ranks hold different layers, so
#: it also plays ``weights``; what it adds beyond that (layers per stage, the schedule's bubble, the
#: micro-batches a stage holds in flight) the cost model reads from :attr:`Layout.pp`, the product of the
#: ``stages`` degrees.
ROLES: tuple[str, ...] = ("data", "sequence", "heads", "shards_state", "weights", "stages")
SearchKind = Literal["model", "split", "fill"]

#: Bound on any one degree and on the world size: far above any cluster, low enough to stay sane.
MAX_DEGREE = 1 << 20


@dataclass(frozen=True)
class SpaceContext:
    """What a degree's structural check may look at: the model, the sequence and the hardware."""

    model: ModelSpec
    seq_len: int
    gpus_per_node: int
    tp_splits_sequence: bool = True
    ring_allowed: bool = True
    #: Model chunks per pipeline stage (interleaved 1F1B); every chunk needs at least one layer.
    virtual_stages: int = 1
    #: Pipeline stages are modelled for training (prefill plans keep pp=1).
    training: bool = True


#: A structural check: the degrees chosen so far (this one included, the rest of the model degrees at 1)
#: and the context; returns why the combination cannot run, or None.
StructuralCheck = Callable[[Mapping[str, int], SpaceContext], "str | None"]


def _no_multiple(degree: int, tp_splits_sequence: bool) -> int:
    return 1


@dataclass(frozen=True)
class Degree:
    name: str
    mesh_position: int
    roles: frozenset[str]
    help: str
    search: SearchKind = "model"
    check: StructuralCheck | None = None
    #: What the sequence length must be a multiple of for this degree at value ``d``.
    sequence_multiple: Callable[[int, bool], int] = field(default=_no_multiple)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def has(self, role: str) -> bool:
        return role in self.roles


_REGISTRY: dict[str, Degree] = {}
_version = 0


def register_degree(degree: Degree) -> Degree:
    """Add a layout degree. Names, positions and roles are checked so a mistake fails here, at import,
    rather than as a wrong rank order or a silently ignored role."""
    if not degree.name.isidentifier() or degree.name != degree.name.lower():
        raise CostModelError(f"degree name {degree.name!r} must be a lower-case identifier")
    if degree.name in _REGISTRY:
        raise CostModelError(f"layout degree {degree.name!r} is already registered")
    unknown = set(degree.roles) - set(ROLES)
    if unknown:
        raise CostModelError(f"degree {degree.name!r}: unknown roles {sorted(unknown)}; use {', '.join(ROLES)}")
    if any(d.mesh_position == degree.mesh_position for d in _REGISTRY.values()):
        raise CostModelError(f"degree {degree.name!r}: mesh position {degree.mesh_position} is taken")
    if degree.search == "fill" and any(d.search == "fill" for d in _REGISTRY.values()):
        raise CostModelError(f"degree {degree.name!r}: only one degree may take the rest of the world")
    _REGISTRY[degree.name] = degree
    _bump()
    return degree


def unregister_degree(name: str) -> None:
    """Remove a degree registered after import (tests and plugins); the built-in ones stay."""
    if name in BUILTIN_NAMES:
        raise CostModelError(f"the built-in degree {name!r} cannot be unregistered")
    if _REGISTRY.pop(name, None) is not None:
        _bump()


def _bump() -> None:
    global _version, _tables
    _version += 1
    _tables = _Tables.build(_REGISTRY)


@dataclass(frozen=True)
class _Tables:
    """Orders and role lists derived from the registry, rebuilt when it changes: the layout's sizes read
    them for every layout the planner scores, so they are plain tuples, not recomputed per call."""

    mesh: tuple[str, ...]
    inner: tuple[str, ...]
    role: dict[str, tuple[str, ...]]
    no_role: dict[str, tuple[str, ...]]
    search: dict[str, tuple[str, ...]]
    replicate: tuple[str, ...]

    @classmethod
    def build(cls, reg: Mapping[str, Degree]) -> _Tables:
        mesh = tuple(d.name for d in sorted(reg.values(), key=lambda d: d.mesh_position))
        inner = tuple(reversed(mesh))
        return cls(
            mesh=mesh,
            inner=inner,
            role={r: tuple(n for n in mesh if reg[n].has(r)) for r in ROLES},
            no_role={r: tuple(n for n in mesh if not reg[n].has(r)) for r in ROLES},
            search={k: tuple(n for n in inner if reg[n].search == k) for k in ("model", "split", "fill")},
            replicate=tuple(n for n in mesh if reg[n].has("data") and not reg[n].has("shards_state")),
        )


_tables = _Tables.build({})


def registry_version() -> int:
    """Changes whenever a degree is registered or removed (for callers that cache derived tables)."""
    return _version


def registered() -> dict[str, Degree]:
    """Degrees in registration order (the order a layout's fields are written in)."""
    return _REGISTRY


def degree(name: str) -> Degree:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise CostModelError(f"unknown layout dimension {name!r}; use {', '.join(mesh_dims())}") from None


def mesh_dims() -> tuple[str, ...]:
    """Mesh order, outermost first: innermost dims are contiguous in rank order, so they land on the
    fastest links when ranks are numbered node by node."""
    return _tables.mesh


def innermost_first() -> tuple[str, ...]:
    """Mesh order reversed: the order the planner enumerates model degrees and reports them in."""
    return _tables.inner


def with_role(role: str) -> tuple[str, ...]:
    """Degrees playing ``role``, in mesh order."""
    return _tables.role[role]


def without_role(role: str) -> tuple[str, ...]:
    return _tables.no_role[role]


def searched(kind: SearchKind) -> tuple[str, ...]:
    """Degrees the planner searches as ``kind``, innermost first."""
    return _tables.search[kind]


def replicate_dims() -> tuple[str, ...]:
    """Data-parallel degrees that do not shard state (``dp_replicate``), in mesh order: their ranks hold
    whole replicas of the shard group's state, so gradients are all-reduced across them (HSDP)."""
    return _tables.replicate


def fill_degree() -> str:
    return searched("fill")[0]


def adjacent(dims: tuple[str, ...]) -> bool:
    """Whether ``dims`` are consecutive in mesh order (a group over them is ``size`` ranks ``stride`` apart).

    Pipeline (``stages``) degrees between them do not count: the built-in ``pp`` is outermost, so only a
    degree registered outside it (a data degree across pods) puts it inside a group's dims; the group is then
    priced as if contiguous, exact while that stage degree is 1."""
    order = [d for d in mesh_dims() if d in dims or "stages" not in _REGISTRY[d].roles]
    idx = [order.index(d) for d in dims]
    return idx == list(range(idx[0], idx[0] + len(idx))) if idx else True


# ----- the built-in degrees ----------------------------------------------------------------------


def _tp_sequence_multiple(d: int, tp_splits_sequence: bool) -> int:
    return d if tp_splits_sequence else 1


def _check_tp(chosen: Mapping[str, int], ctx: SpaceContext) -> str | None:
    tp, gpn, heads = chosen["tp"], ctx.gpus_per_node, ctx.model.num_heads
    if tp > 1 and (tp > gpn or gpn % tp):
        return f"tp={tp} would span nodes ({gpn} GPUs per node); TP needs NVLink bandwidth"
    if heads % tp:
        return f"tp={tp} does not divide {heads} query heads"
    return None


def _check_ulysses(chosen: Mapping[str, int], ctx: SpaceContext) -> str | None:
    split = chosen["tp"] * chosen["ulysses"]
    if ctx.model.num_heads % split:
        return f"tp x ulysses = {split} does not divide {ctx.model.num_heads} query heads"
    try:
        ctx.model.kv_replication(split)
    except CostModelError as exc:
        return str(exc)
    return None


def _check_ring(chosen: Mapping[str, int], ctx: SpaceContext) -> str | None:
    if chosen["ring"] > 1 and not ctx.ring_allowed:
        return ("ring attention needs the flash kernel (blockwise with an LSE merge); "
                "materialized attention runs only with ring=1")
    return None


def chunk_slots(layers: int, v: int) -> int:
    """Model chunks ``layers`` can fill with ``v`` chunks per stage: one layer each, plus, when there are several
    chunks per stage, one chunk for the embedding alone and one for the loss alone (Llama 3's 405B layout,
    Megatron-Core's account_for_embedding/loss_in_pipeline_split: :mod:`sp_plan.cost_models.pipeline`). With one
    chunk per stage every stage keeps a layer."""
    return layers + 2 if v > 1 else layers


def max_stages(layers: int, v: int) -> int:
    """The largest pipeline degree ``layers`` allow with ``v`` chunks per stage."""
    return chunk_slots(layers, v) // v


def _check_pp(chosen: Mapping[str, int], ctx: SpaceContext) -> str | None:
    pp, v, layers = chosen["pp"], ctx.virtual_stages, ctx.model.num_layers
    if pp > 1 and not ctx.training:
        return f"pp={pp}: pipeline stages are modelled for training only (prefill keeps pp=1)"
    if pp > 1 and chunk_slots(layers, v) < pp * v:
        chunks = (f"pp x virtual stages = {pp} x {v} = {pp * v} needs at least one layer per model chunk besides "
                  "the embedding's and the loss's" if v > 1 else f"pp={pp} needs at least one layer per stage")
        return f"{chunks} but the model has {layers} layers; use pp <= {max_stages(layers, v)}"
    return None


BUILTIN: tuple[Degree, ...] = (
    # Outermost of the built-in degrees, as torchtitan (ParallelDims: pp, dp_replicate, dp_shard, cp, tp) and Megatron place it: a
    # stage boundary sends one activation per micro-batch, the least traffic of any degree, so stages span
    # nodes and TP/Ulysses stay inside.
    Degree("pp", -5, frozenset({"stages", "weights"}), "Pipeline-parallel degree (stages of the layer stack).",
           check=_check_pp),
    Degree("dp_replicate", 0, frozenset({"data"}), "Replicated data-parallel degree.", search="split"),
    Degree("dp_shard", 10, frozenset({"data", "shards_state"}), "FSDP/ZeRO shard degree (default: the rest).",
           search="fill"),
    Degree("tp", 40, frozenset({"heads", "weights"}), "Tensor-parallel degree.", check=_check_tp,
           sequence_multiple=_tp_sequence_multiple),
    Degree("ulysses", 30, frozenset({"sequence", "heads", "shards_state"}), "Ulysses (all-to-all) sequence-parallel degree.",
           check=_check_ulysses, sequence_multiple=lambda d, _: d),
    Degree("ring", 20, frozenset({"sequence", "shards_state"}), "Ring-attention sequence-parallel degree.", check=_check_ring,
           sequence_multiple=lambda d, _: 2 * d if d > 1 else 1),
)
BUILTIN_NAMES = frozenset(d.name for d in BUILTIN)
for _d in BUILTIN:
    register_degree(_d)
