"""How the world of GPUs is factored into the registered degrees (:mod:`sp_plan.cost_models.degrees`).

Today ``dp_replicate x dp_shard x ring x ulysses x tp``, in mesh order, outermost to innermost: innermost
dimensions are contiguous in rank order, so they land on the fastest links (NVLink) when ranks are
numbered node by node. The layout's derived sizes (data-parallel, sequence-parallel, shard group, head
split) follow from the roles each degree is registered with, not from a list of names here.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails

from . import degrees as registry
from .degrees import MAX_DEGREE
from .errors import CostModelError
from .model_spec import ModelSpec

#: Mesh order of the degrees registered at import, outermost first (:func:`degrees.mesh_dims` is the live
#: order, which also lists degrees registered later).
MESH_DIMS: tuple[str, ...] = registry.mesh_dims()

DegreeValue = Annotated[int, Field(default=1, ge=1, le=MAX_DEGREE)]
_DEGREE_VALUE: TypeAdapter[int] = TypeAdapter(DegreeValue)


class _LayoutBase(BaseModel):
    """The layout's behaviour; its fields are the registered degrees (see :data:`Layout`) and ``ep``.

    ``ep`` (expert parallelism) is a field of its own, not a registered degree: it does not multiply the
    world. Megatron-Core and torchtitan take the expert-parallel ranks from ranks that already hold the same
    weights; here they are the innermost ``ep`` ranks of the ZeRO/FSDP shard group (dp_shard x ring x
    ulysses, ``ep`` consecutive ranks ``tp`` apart, so the all-to-all stays on NVLink while ``ep x tp`` fits
    a node). A registered degree would be a mesh dimension (its own rank coordinate, a factor of the world,
    a runtime mesh dim); ``ep`` only regroups existing ranks, so it stays outside the degree registry and the
    mesh. It defaults to 1 and is left out of dumps at 1, so plans written before it load and read the same.
    """

    model_config = ConfigDict(frozen=True, extra="allow")

    #: Expert-parallel degree: ranks of the shard group that split each MoE layer's routed experts.
    ep: int = Field(default=1, ge=1, le=MAX_DEGREE, description="Expert-parallel degree (MoE models): ranks of the "
                    "ZeRO/FSDP shard group that split the routed experts; does not multiply the world.")

    @model_validator(mode="before")
    @classmethod
    def _registered_degrees_only(cls, data: Any) -> Any:
        """Degrees registered after import arrive as extra fields: refuse any name that is not a degree (as
        pydantic's ``extra="forbid"`` would, field by field), validate the late ones with the same bounds as
        the declared ones and default them to 1."""
        if not isinstance(data, dict):
            return data
        known = registry.registered()
        errors = [InitErrorDetails(type="extra_forbidden", loc=(key,), input=value)
                  for key, value in data.items() if key not in known and key not in _LayoutBase.model_fields]
        late = [name for name in known if name not in cls.model_fields]
        checked = dict(data)
        for name in late:
            try:
                checked[name] = _DEGREE_VALUE.validate_python(data.get(name, 1))
            except ValidationError as exc:
                errors += [InitErrorDetails(type=e["type"], loc=(name, *e["loc"]), input=e["input"],
                                            ctx=e.get("ctx", {})) for e in exc.errors()]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return checked

    #: world, sp, dp, shard group, head split, data ranks and the model degrees, computed once per layout (the
    #: cost model reads them for every (layout, option) combination the planner scores). A slot, not a
    #: private attribute: pydantic routes private attributes through ``__getattr__``, ten times slower.
    #: Copies and unpickled layouts do not carry it; :meth:`_derived` recomputes it on first use.
    __slots__ = ("_sizes",)

    def _derived(self) -> tuple:
        try:
            return self._sizes
        except AttributeError:
            pass
        values = {**self.__dict__, **(self.__pydantic_extra__ or {})}

        def product(names: tuple[str, ...]) -> int:
            return math.prod(values[n] for n in names)

        sizes = (
            product(registry.mesh_dims()), product(registry.with_role("sequence")), product(registry.with_role("data")),
            product(registry.with_role("shards_state")), product(registry.with_role("heads")),
            product(registry.without_role("weights")),
            tuple(values[n] for n in registry.without_role("data")) + (values["ep"],),
            product(registry.with_role("stages")),
        )
        object.__setattr__(self, "_sizes", sizes)
        return sizes

    def __hash__(self) -> int:
        extra = self.__pydantic_extra__
        return hash(tuple(self.__dict__.values()) + (tuple(extra.values()) if extra else ()))

    def model_degrees(self) -> tuple[int, ...]:
        """The degrees that change what one rank computes (all but the data-parallel ones, in mesh order, then
        ``ep``): the key of the per-rank compute and activation caches."""
        return self._derived()[6]

    @property
    def world(self) -> int:
        return self._derived()[0]

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages: the product of the degrees that split the layer stack (``pp``; 1 without PP)."""
        return self._derived()[7]

    @property
    def sp(self) -> int:
        """Sequence-parallel degree: ranks that split one sequence (Ulysses x Ring)."""
        return self._derived()[1]

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self._derived()[2]

    @property
    def shard_group(self) -> int:
        """Ranks across which ZeRO/FSDP shards parameters, grads and optimizer states.

        They hold the same TP shard of the weights and the same model replica: the data-parallel
        shard dim plus both sequence-parallel dims (SP ranks compute gradients of the same weights).
        """
        return self._derived()[3]

    @property
    def data_ranks(self) -> int:
        """Ranks that hold the same weights but see different tokens (every degree that does not split the
        weights): the group that reduces gradients and the loss."""
        return self._derived()[5]

    @property
    def head_split(self) -> int:
        """Ways the attention heads are split: TP splits them, and so does Ulysses' all-to-all."""
        return self._derived()[4]

    def seq_multiple(self, tp_splits_sequence: bool = True) -> int:
        """The sequence length must be a multiple of this.

        Ulysses x Ring split the sequence; zigzag ring attention cuts it into 2 x ring chunks; with
        Megatron sequence parallelism TP splits the local sequence again between attention blocks.
        """
        return math.prod(d.sequence_multiple(getattr(self, name), tp_splits_sequence)
                         for name, d in registry.registered().items())

    def degrees(self) -> dict[str, int]:
        """Every degree, in mesh order (outermost first)."""
        return {dim: getattr(self, dim) for dim in registry.mesh_dims()}

    def as_dict(self) -> dict[str, int]:
        """:meth:`degrees` plus ``ep`` when above 1: what a plan file records (``Layout(**as_dict())`` rebuilds
        the layout; files written before expert parallelism existed read as ``ep=1``)."""
        return self.degrees() | ({"ep": self.ep} if self.ep > 1 else {})

    @property
    def expert_data_parallel(self) -> int:
        """Ranks that hold the same experts (the shard group over ``ep``): ZeRO/FSDP shards expert state over them."""
        return self.shard_group // self.ep

    def describe(self) -> str:
        """Compact form listing only degrees above 1, e.g. ``ulysses=8`` or ``dp_shard=2 x ring=4`` (and
        ``(ep=8)`` when experts are split: in parentheses, as it does not multiply the GPUs)."""
        parts = [f"{dim}={deg}" for dim, deg in self.degrees().items() if deg > 1]
        text = " x ".join(parts) or "single GPU"
        return text + (f" (ep={self.ep})" if self.ep > 1 else "")

    @model_serializer(mode="wrap")
    def _dump_without_default_ep(self, handler: Any) -> Any:
        """Plans written with ``ep=1`` read exactly as before expert parallelism existed."""
        data = handler(self)
        if isinstance(data, dict) and data.get("ep") == 1:
            del data["ep"]
        return data

    def check_experts(self, model: ModelSpec) -> None:
        """Raise a one-line actionable error when ``ep`` cannot split ``model``'s experts on this layout."""
        reason = expert_parallel_invalid(model, self.ep, self.shard_group)
        if reason:
            raise CostModelError(reason)

    @classmethod
    def for_world(cls, world: int, **degrees: int | None) -> Layout:
        """Fill ``dp_shard`` so the product equals ``world`` when it was not given.

        The CLI lets users name only the interesting degrees; the rest of the GPUs become data-parallel
        shards, the standard FSDP default.
        """
        fill = registry.fill_degree()
        ep = degrees.pop("ep", None) or 1
        if world < 1 or world > MAX_DEGREE:
            raise CostModelError(f"GPU count {world} is out of range: use 1 .. {MAX_DEGREE}")
        given = {k: v for k, v in degrees.items() if v is not None}
        for name, value in given.items():
            registry.degree(name)  # unknown names: one error listing the degrees
            if value < 1:
                raise CostModelError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if fill not in given:
            others = math.prod(v for k, v in given.items())
            if world % others:
                raise CostModelError(
                    f"{world} GPUs cannot be split as {_product_text(given)} = {others}: "
                    f"the product of the layout degrees must divide the GPU count"
                )
            given[fill] = world // others
        if ep < 1:
            raise CostModelError(f"--ep must be at least 1, got {ep}")
        layout = cls(**given, ep=ep)
        if layout.world != world:
            raise CostModelError(
                f"layout {layout.describe()} uses {layout.world} GPUs but --gpus is {world}: "
                f"make {' x '.join(registry.registered())} equal the GPU count"
            )
        return layout

    def check_against(self, model: ModelSpec, seq_len: int, tp_splits_sequence: bool = True) -> None:
        """Raise a one-line actionable error if this layout cannot run ``model`` at ``seq_len``."""
        heads = model.num_heads
        if heads % self.head_split:
            valid = ", ".join(str(d) for d in model.valid_head_split_degrees())
            if self.tp == 1:
                raise CostModelError(
                    f"ulysses={self.ulysses} does not divide {heads} query heads; valid Ulysses degrees for "
                    f"this model: {valid}, or move the extra degree to ring"
                )
            raise CostModelError(
                f"tp x ulysses = {self.tp} x {self.ulysses} = {self.head_split} does not divide {heads} query "
                f"heads; tp x ulysses must be one of {valid} (move the extra degree to ring or dp)"
            )
        model.kv_replication(self.head_split)  # raises when KV heads neither divide nor replicate
        self.check_experts(model)
        multiple = self.seq_multiple(tp_splits_sequence)
        if seq_len % multiple:
            lower = seq_len - seq_len % multiple
            upper = lower + multiple
            why = f"ulysses x ring = {self.sp}" + (" x 2 (zigzag ring)" if self.ring > 1 else "")
            if tp_splits_sequence and self.tp > 1:
                why += f" x tp = {self.tp} (Megatron sequence parallelism)"
            suggestion = f"{lower} or {upper}" if lower else f"{upper}"
            raise CostModelError(
                f"sequence length {seq_len} is not divisible by {why} = {multiple}; use {suggestion} "
                "(or pad the data to that multiple)"
            )


def expert_parallel_invalid(model: ModelSpec, ep: int, shard_group: int) -> str | None:
    """Why expert-parallel degree ``ep`` cannot run ``model`` with a shard group of ``shard_group`` ranks
    (None when it can): the model must have routed experts, ``ep`` must divide their count (each rank holds
    ``num_experts / ep`` whole experts) and the shard group (the ranks it is taken from)."""
    if ep == 1:
        return None
    if model.moe is None:
        return f"ep={ep}: {model.name} is a dense model (no routed experts to split); use ep=1"
    experts = model.moe.num_experts
    if experts % ep:
        valid = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0 and shard_group % d == 0)
        return f"ep={ep} does not divide {experts} routed experts; use one of {valid}"
    if shard_group % ep:
        valid = ", ".join(str(d) for d in range(1, shard_group + 1) if experts % d == 0 and shard_group % d == 0)
        return (f"ep={ep} does not divide the {shard_group} ranks of the shard group (dp_shard x ring x ulysses) it "
                f"is taken from; use one of {valid}, or give dp_shard more GPUs")
    return None


def _product_text(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items()) or "1"


#: The layout: one field per degree registered at import (a degree registered later is an extra field with the
#: same bounds). Built from the registry so that no module lists the degrees by hand.
Layout = create_model(
    "Layout",
    __base__=_LayoutBase,
    __module__=__name__,
    **{name: (int, Field(default=1, ge=1, le=MAX_DEGREE, description=d.help))
       for name, d in registry.registered().items()},
)
Layout.__doc__ = """How the world is factored: one degree per registered mesh dimension (all default to 1)."""
