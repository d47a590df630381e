"""The layout space: every factorisation of the world that the hardware and the model allow.

Structural constraints are checked here, once per (tp, ulysses, ring) triple, before any cost is
evaluated; every triple that fails is kept with its reason so ``--explain`` can say why an
alternative was never considered. The data-parallel remainder is split between dp_shard and
dp_replicate afterwards (both always valid structurally).
"""

from __future__ import annotations

from dataclasses import dataclass

from sp_plan.cost_models.errors import CostModelError
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
    """A (tp, ulysses, ring) combination that cannot run, and why."""

    tp: int
    ulysses: int
    ring: int
    reason: str

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (("tp", self.tp), ("ulysses", self.ulysses), ("ring", self.ring)) if v > 1]
        return " x ".join(parts) or "no model/sequence parallelism"


@dataclass(frozen=True)
class LayoutSpace:
    layouts: list[Layout]
    rejected: list[StructuralRejection]


def enumerate_layouts(
    world: int,
    model: ModelSpec,
    seq_len: int,
    gpus_per_node: int,
    *,
    tp_splits_sequence: bool = True,
    max_dp_replicate: int | None = None,
    ring_allowed: bool = True,
) -> LayoutSpace:
    """All structurally valid layouts for ``world`` GPUs.

    Constraints: TP groups stay inside one NVLink domain (a node); query heads divide by tp x ulysses;
    KV heads divide by it or are replicated (``ModelSpec.kv_replication``); the sequence divides by the
    sequence-parallel degree (2 x ring for zigzag; x tp with Megatron sequence parallelism).
    ``max_dp_replicate`` bounds the HSDP split (None: any divisor). ``ring_allowed`` False (materialized
    attention) rejects every ring degree above 1.
    """
    layouts: list[Layout] = []
    rejected: list[StructuralRejection] = []
    for tp in divisors(world):
        if tp > 1 and (tp > gpus_per_node or gpus_per_node % tp):
            rejected.append(StructuralRejection(tp, 1, 1, f"tp={tp} would span nodes ({gpus_per_node} GPUs per node); "
                                                          "TP needs NVLink bandwidth"))
            continue
        if model.num_heads % tp:
            rejected.append(StructuralRejection(tp, 1, 1, f"tp={tp} does not divide {model.num_heads} query heads"))
            continue
        for ulysses in divisors(world // tp):
            if model.num_heads % (tp * ulysses):
                if ulysses > 1:
                    rejected.append(StructuralRejection(
                        tp, ulysses, 1, f"tp x ulysses = {tp * ulysses} does not divide {model.num_heads} query heads"))
                continue
            try:
                model.kv_replication(tp * ulysses)
            except CostModelError as exc:
                rejected.append(StructuralRejection(tp, ulysses, 1, str(exc)))
                continue
            for ring in divisors(world // (tp * ulysses)):
                if ring > 1 and not ring_allowed:
                    rejected.append(StructuralRejection(
                        tp, ulysses, ring, "ring attention needs the flash kernel (blockwise with an LSE merge); "
                                           "materialized attention runs only with ring=1"))
                    continue
                probe = Layout(tp=tp, ulysses=ulysses, ring=ring)
                multiple = probe.seq_multiple(tp_splits_sequence)
                if seq_len % multiple:
                    rejected.append(StructuralRejection(
                        tp, ulysses, ring, f"sequence {seq_len} is not divisible by {multiple}"))
                    continue
                rest = world // (tp * ulysses * ring)
                for dp_replicate in divisors(rest):
                    if max_dp_replicate is not None and dp_replicate > max_dp_replicate:
                        break
                    layouts.append(Layout(dp_replicate=dp_replicate, dp_shard=rest // dp_replicate,
                                          tp=tp, ulysses=ulysses, ring=ring))
    return LayoutSpace(layouts, rejected)


def layout_space(world: int, model: ModelSpec, base: TrainSpec, gpus_per_node: int) -> LayoutSpace:
    """:func:`enumerate_layouts` with the constraints ``base`` implies (Megatron SP, attention kernel)."""
    return enumerate_layouts(world, model, base.seq_len, gpus_per_node, tp_splits_sequence=base.tp_sequence_parallel,
                             ring_allowed=base.attention_kernel == "flash")
