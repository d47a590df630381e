"""The layout space: every factorisation of the world that the hardware and the model allow.

The model degrees (:func:`sp_plan.cost_models.degrees.searched` ``"model"``: tp, ulysses, ring today) are
enumerated innermost first, each value checked by its degree's structural check before any cost is
evaluated; every combination that fails is kept with its reason so ``--explain`` can say why an
alternative was never considered. The data-parallel remainder is split afterwards: the ``split`` degrees
(dp_replicate) take divisors of it and the ``fill`` degree (dp_shard) the rest (structurally always
valid). A mixture-of-experts model's layouts come once more for every expert-parallel degree their shard
group allows (:func:`expert_degrees`; ``Layout.ep`` does not change the world).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from sp_plan.cost_models import degrees as registry
from sp_plan.cost_models.degrees import SpaceContext
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.train_spec import TrainSpec


def divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass(frozen=True)
class StructuralRejection:
    """A combination of model degrees that cannot run, and why (degrees not yet chosen are 1)."""

    degrees: Mapping[str, int]
    reason: str

    def __getattr__(self, name: str) -> int:
        try:
            return self.__dict__["degrees"][name]
        except KeyError:
            raise AttributeError(name) from None

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.degrees.items() if v > 1]
        return " x ".join(parts) or "no model/sequence parallelism"


@dataclass(frozen=True)
class LayoutSpace:
    layouts: list[Layout]
    rejected: list[StructuralRejection] = field(default_factory=list)


def enumerate_layouts(
    world: int,
    model: ModelSpec,
    seq_len: int,
    gpus_per_node: int,
    *,
    tp_splits_sequence: bool = True,
    max_dp_replicate: int | None = None,
    ring_allowed: bool = True,
    training: bool = True,
    virtual_stages: int = 1,
) -> LayoutSpace:
    """All structurally valid layouts for ``world`` GPUs.

    Constraints (each registered with its degree): TP groups stay inside one NVLink domain (a node); query
    heads divide by tp x ulysses; KV heads divide by it or are replicated (``ModelSpec.kv_replication``);
    the sequence divides by the sequence-parallel degree (2 x ring for zigzag; x tp with Megatron sequence
    parallelism). ``max_dp_replicate`` bounds the HSDP split (None: any divisor). ``ring_allowed`` False
    (materialized attention) rejects every ring degree above 1. ``training`` False (prefill) and
    ``virtual_stages`` bound the pipeline degree (at least one layer per model chunk).
    """
    ctx = SpaceContext(model, seq_len, gpus_per_node, tp_splits_sequence, ring_allowed, virtual_stages, training)
    limits = {"dp_replicate": max_dp_replicate} if max_dp_replicate is not None else {}
    model_dims = registry.searched("model")
    layouts: list[Layout] = []
    rejected: list[StructuralRejection] = []
    for chosen, rest in _model_degrees(world, model_dims, dict.fromkeys(model_dims, 1), 0, ctx, rejected):
        multiple = Layout(**chosen).seq_multiple(tp_splits_sequence)
        if seq_len % multiple:
            rejected.append(StructuralRejection(dict(chosen), f"sequence {seq_len} is not divisible by {multiple}"))
            continue
        for data in _data_degrees(rest, registry.searched("split"), {}, limits):
            layout = Layout(**data, **chosen)
            layouts += [layout] + [Layout(**data, **chosen, ep=ep) for ep in expert_degrees(model, layout.shard_group)]
    return LayoutSpace(layouts, rejected)


def expert_degrees(model: ModelSpec, shard_group: int) -> list[int]:
    """Expert-parallel degrees above 1 a layout with ``shard_group`` ZeRO ranks may take (each is a layout of
    its own: EP trades expert memory and FSDP traffic for dispatch all-to-alls, not monotonically, so it cannot
    be a lattice axis): the common divisors of the routed experts and the shard group; none for a dense model."""
    if model.moe is None:
        return []
    return [d for d in divisors(shard_group) if d > 1 and model.moe.num_experts % d == 0]


def _model_degrees(rest: int, dims: tuple[str, ...], chosen: dict[str, int], index: int, ctx: SpaceContext,
                   rejected: list[StructuralRejection]) -> Iterator[tuple[dict[str, int], int]]:
    """Every assignment of the model degrees (innermost first) that passes each degree's check, with the
    GPUs it leaves to data parallelism."""
    if index == len(dims):
        yield dict(chosen), rest
        return
    dim = dims[index]
    check = registry.degree(dim).check
    for value in divisors(rest):
        chosen[dim] = value
        reason = check(chosen, ctx) if check is not None else None
        if reason is not None:
            rejected.append(StructuralRejection(dict(chosen), reason))
            continue
        yield from _model_degrees(rest // value, dims, chosen, index + 1, ctx, rejected)
    chosen[dim] = 1


def _data_degrees(rest: int, split: tuple[str, ...], chosen: dict[str, int],
                  limits: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Divisors of ``rest`` for each ``split`` degree (up to its limit); the fill degree takes the rest."""
    if not split:
        yield {**chosen, registry.fill_degree(): rest}
        return
    dim, limit = split[0], limits.get(split[0])
    for value in divisors(rest):
        if limit is not None and value > limit:
            break
        yield from _data_degrees(rest // value, split[1:], {**chosen, dim: value}, limits)


def layout_space(world: int, model: ModelSpec, base: TrainSpec, gpus_per_node: int) -> LayoutSpace:
    """:func:`enumerate_layouts` with the constraints ``base`` implies (Megatron SP, attention kernel)."""
    return enumerate_layouts(world, model, base.seq_len, gpus_per_node, tp_splits_sequence=base.tp_sequence_parallel,
                             ring_allowed=base.attention_kernel == "flash", training=base.is_training,
                             virtual_stages=base.virtual_stages)
