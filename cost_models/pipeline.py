"""Pipeline-parallel schedule math: layers per stage, micro-batches in flight, the bubble.

A layout with ``pp > 1`` cuts the layer stack into ``pp`` stages (each ``virtual_stages`` model chunks under
the interleaved schedule); a step runs ``m = grad_accum`` micro-batches through them. This module holds the
arithmetic every schedule is known by; memory (:mod:`sp_plan.cost_models.memory.timeline`) and time
(:mod:`sp_plan.cost_models.time_model`) evaluate one stage at a time with it.

Sources:

- **1F1B** (PipeDream-Flush; Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC'21, section 2.2): after a warm-up of ``p - s - 1`` forwards, stage ``s`` alternates one
  forward and one backward, so it holds at most ``min(p - s, m)`` micro-batches' activations; the pipeline
  fill and drain leave a bubble of ``(p - 1) (t_f + t_b)`` per step.
- **Interleaved 1F1B** (same paper, section 2.2.2; Megatron-LM ``forward_backward_pipelining_with_interleaving``):
  ``v`` model chunks per stage shrink the bubble ``v``-fold to ``(p - 1)(t_f + t_b) / v`` at ``v`` times the
  point-to-point traffic; Megatron needs the micro-batches to be a multiple of ``p``. Its warm-up on rank ``s``
  is ``2 (p - s - 1) + (v - 1) p`` chunk forwards, so stage 0 holds ``p + (p - 1)/v`` micro-batches of its
  layers: the factor ``1 + (p - 1)/(p v)`` of Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models" (2022), section 4.2.3, over the 1F1B stage 0's ``p``.
- **Zero bubble, ZB-H1** (Qi et al., "Zero Bubble Pipeline Parallelism", 2023, section 3): the backward is
  split into the input gradient ``B`` (on the critical path to the previous stage) and the weight gradient
  ``W`` (deferred into the bubble). With 1F1B's memory (the same ``min(p - s, m)`` micro-batches in flight)
  the bubble falls from ``(p - 1)(T_F + T_B + T_W)`` to ``(p - 1)(T_F + T_B - T_W)``, about a third when the
  three are equal.

Uneven stages: the first stage also runs the embedding (a gather, next to no compute), the last the final
norm, the LM head and the loss. :func:`default_stage_layers` balances compute by giving the last stage fewer
layers, as Llama 3's 405B run did (one layer fewer on the first and last stages, "The Llama 3 Herd of
Models", 2024, section 3.3.2) and as Megatron's ``--decoder-last-pipeline-num-layers`` allows.

Chunks without a layer: with ``v >= 2`` chunks per stage the embedding and the loss may each fill a model
chunk of their own, so ``pp x v`` may reach the layers + 2 and the first and last stages may hold ``v - 1``
layers. Llama 3's 405B run is that layout: 126 layers over 16 stages of 8 chunks, "the first model chunk on
the first stage has only the embedding, and the last model chunk on the last stage has only output projection
and loss calculation" (section 3.3.2); Megatron-Core runs it with ``account_for_embedding_in_pipeline_split``
/ ``account_for_loss_in_pipeline_split`` (the embedding and the loss each count as a layer, every chunk then
holds ``(layers + 2) / (pp v)``), torchtitan with its pipeline split's input and output weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .degrees import chunk_slots, max_stages
from .errors import CostModelError
from .flops import WORK_FIELDS, microbatch_work
from .layout import Layout
from .memo import Memo
from .model_spec import ModelSpec
from .train_spec import TrainSpec


@dataclass(frozen=True, slots=True)
class StageView:
    """One pipeline stage as the memory and time models evaluate it."""

    index: int
    layers: int
    #: Holds the token embedding (stage 0).
    first: bool
    #: Holds the final norm, the LM head and the loss (the last stage).
    last: bool
    #: Micro-batches whose saved activations (of all this stage's layers) are resident at once.
    in_flight: float


def min_stage_layers(p: int, v: int, s: int) -> int:
    """The fewest layers stage ``s`` of ``p`` can hold with ``v`` chunks: one per chunk, less the chunk the
    embedding (stage 0) or the loss (the last stage) may fill alone; never none."""
    if v == 1:
        return 1
    return v - (s == 0) - (s == p - 1)


def in_flight(schedule: str, p: int, m: int, v: int, s: int) -> float:
    """Micro-batches of stage ``s``'s layers whose activations the stage holds at its peak (see the module
    docstring): ``min(p - s, m)`` under 1F1B and ZB-H1; interleaved, the warm-up's chunks over ``v``."""
    if p == 1:
        return 1.0
    if schedule == "interleaved_1f1b":
        chunks = min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)
        return chunks / v
    return float(min(p - s, m))


def bubble_seconds(schedule: str, p: int, v: int, t_f: float, t_b_input: float, t_w: float) -> float:
    """Idle time per step of the slowest stage: ``t_f`` one micro-batch's forward on it, ``t_b_input`` its
    input-gradient backward (recompute included), ``t_w`` its weight-gradient backward."""
    if p == 1:
        return 0.0
    if schedule == "zero_bubble":
        return (p - 1) * max(0.0, t_f + t_b_input - t_w)
    full = (p - 1) * (t_f + t_b_input + t_w)
    return full / v if schedule == "interleaved_1f1b" else full


@lru_cache(maxsize=4096)
def default_stage_layers(layers: int, p: int, v: int, head_layers: float) -> tuple[int, ...]:
    """A split of ``layers`` over ``p`` stages (at least ``v`` each) that minimises the slowest stage's time,
    the last stage costing ``head_layers`` layers more (the LM head and loss). The embedding is a gather and
    costs nothing here. Among equal splits the last stage keeps as many layers as it can; the extra layers
    of an uneven remainder go to the stages just before the last, so stage 0, which holds the most
    micro-batches in flight, stays among the lightest. With fewer layers than chunks the embedding and the loss
    fill the missing chunks (Llama 3's 405B layout; one missing: the loss's, as the last stage also runs the
    head)."""
    if p == 1:
        return (layers,)
    missing = p * v - layers
    if missing > 0:
        if chunk_slots(layers, v) < p * v:
            raise CostModelError(f"{layers} layers cannot fill pp x virtual stages = {p} x {v} chunks")
        return (v - (missing == 2), *[v] * (p - 2), v - 1)
    best: tuple[float, int] | None = None
    for last in range(v, layers - (p - 1) * v + 1):
        load = max(last + head_layers, math.ceil((layers - last) / (p - 1)))
        if best is None or load < best[0] - 1e-12 or (abs(load - best[0]) <= 1e-12 and last > best[1]):
            best = (load, last)
    assert best is not None
    last = best[1]
    rest = layers - last
    base, extra = divmod(rest, p - 1)
    split = [base] * (p - 1)
    for i in range(extra):
        split[p - 2 - i] += 1
    return (*split, last)


@lru_cache(maxsize=4096)
def first_even_last_split(layers: int, p: int, v: int, head_layers: float) -> tuple[int, ...] | None:
    """The fastest split a stack that sets only the first and last stages' layers can run (Megatron-LM:
    ``--decoder-first/last-pipeline-num-layers``, the middle split evenly; with ``v`` model chunks per stage
    every stage a multiple of ``v``; or, with ``v > 1``, ``--account-for-embedding/loss-in-pipeline-split``:
    the embedding and the loss each count as a layer and every chunk holds the same, see
    :func:`head_chunks`): the slowest stage, the last costing ``head_layers`` layers more, is fastest; among
    equals the first such split found. None when no split of that form exists (whether one exists does not
    depend on ``head_layers``)."""
    candidates: list[tuple[int, ...]] = []
    for first in range(v, layers + 1, v):
        for last in range(v, layers - first + 1, v):
            rest = layers - first - last
            if p == 2:
                if not rest:
                    candidates.append((first, last))
            elif rest > 0 and not rest % (p - 2) and not (rest // (p - 2)) % v:
                candidates.append((first, *[rest // (p - 2)] * (p - 2), last))
    if v > 1:
        for embedding, loss in ((1, 0), (0, 1), (1, 1)):
            slots = layers + embedding + loss
            if not slots % p and not (slots // p) % v:
                per = slots // p
                candidates.append((per - embedding, *[per] * (p - 2), per - loss))
    best: tuple[float, tuple[int, ...]] | None = None
    for split in candidates:
        load = max(max(split[:-1]), split[-1] + head_layers)
        if best is None or load < best[0] - 1e-12:
            best = (load, split)
    return best[1] if best else None


def head_chunks(split: tuple[int, ...], v: int) -> tuple[bool, bool] | None:
    """Whether ``split`` is the embedding and/or the loss counted as a layer of ``v``-chunk stages (Megatron-Core's
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``: every stage holds the
    same layers plus those, a multiple of ``v``): (embedding counted, loss counted), or None when it is not (or
    is the even split, which needs neither)."""
    if v == 1 or len(split) < 2:
        return None
    middle = split[1:-1]
    for embedding, loss in ((1, 0), (0, 1), (1, 1)):
        per = split[0] + embedding
        if split[-1] + loss == per and all(n == per for n in middle) and not per % v:
            return bool(embedding), bool(loss)
    return None


def stack_stage_layers(model: ModelSpec, train: TrainSpec, layout: Layout, rule: str) -> tuple[int, ...] | None:
    """The split a stack with split ``rule`` (its ``search.stage_split``: ``balanced``, any split, the default
    :func:`default_stage_layers`; or ``first_even_last``, :func:`first_even_last_split`) runs for this plan when
    ``train`` pins none. None: the plan's own split or the balanced default applies, or, under
    ``first_even_last``, no split of that form exists."""
    if layout.pp == 1 or rule == "balanced" or (train.stage_layers is not None
                                                 and len(train.stage_layers) == layout.pp):
        return None
    return first_even_last_split(model.num_layers, layout.pp, train.virtual_stages,
                                 round(head_layer_equivalents(model, train, layout), 6))


#: Options a stage split does not follow: they add recompute (checkpointing, tiling) and move the stages'
#: balance by a fraction of a layer, but a split that moved with them made memory rise up the planner's option
#: lattice: llama3-8b at 64K, pp=2 x tp=4, turning the tiled loss on moved a layer to the first stage, which then
#: held 83.3 GB against 80.3 GB without it, so a plan that fitted stopped fitting one step "up" the lattice.
_SPLIT_IGNORES = {"checkpointing": "none", "tiled_loss": False, "tiled_mlp": False, "offload_checkpoints": False}


def head_layer_equivalents(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """The LM head and loss in units of one layer's FLOPs (per micro-batch, forward + backward), what the stage
    splits balance: taken without recompute or tiling (:data:`_SPLIT_IGNORES`), so one layout and schedule keep
    one split whatever memory options a plan adds. Memoized on what it reads (every pipelined memory and time
    evaluation asks, and the copy without the options costs more than the answer)."""
    ignore = train.is_training
    key = (model, layout.tp, layout.ulysses, layout.ring, ignore,
           *(getattr(train, f) for f in WORK_FIELDS if not (ignore and f in _SPLIT_IGNORES)))
    return _HEAD_LAYERS.get(key, lambda: _head_layer_equivalents(model, train, layout))


_HEAD_LAYERS: Memo[float] = Memo()


def _head_layer_equivalents(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    if train.is_training and any(getattr(train, k) != v for k, v in _SPLIT_IGNORES.items()):
        train = train.model_copy(update=_SPLIT_IGNORES)
    w = microbatch_work(model, train, layout)
    layer = (w.layer_matmul_fwd + w.layer_matmul_bwd + w.layer_matmul_recompute + w.layer_attn_fwd
             + w.layer_attn_bwd + w.layer_attn_recompute)
    return (w.head_matmul_fwd + w.head_matmul_bwd) / layer if layer > 0 else 0.0


def check_pipeline(model: ModelSpec, train: TrainSpec, layout: Layout) -> None:
    """One-line actionable errors for a pipeline this model and run cannot use."""
    p, v, m = layout.pp, train.virtual_stages, train.grad_accum
    if p == 1:
        if train.stage_layers is not None and len(train.stage_layers) != 1:
            raise CostModelError(f"stage_layers lists {len(train.stage_layers)} stages but pp=1; drop it or set --pp "
                                 f"{len(train.stage_layers)}")
        return
    if not train.is_training:
        raise CostModelError(f"pp={p} is modelled for training only; plan prefill with --pp 1")
    slots = chunk_slots(model.num_layers, v)
    if slots < p * v:
        beside = " besides the embedding's and the loss's" if v > 1 else ""
        most_stages = max_stages(model.num_layers, v)
        fixes = [f"pp <= {most_stages}"] if most_stages >= 2 else []
        chunks = slots // p  # the most chunks per stage at this pp, if that many fit
        if chunks >= 1 and chunk_slots(model.num_layers, chunks) >= p * chunks:
            fixes.append(f"at most {chunks} virtual stage{'s' if chunks > 1 else ''} with pp={p}")
        fix = "use " + ", or ".join(fixes) if fixes else f"use fewer pipeline stages than its {model.num_layers} layers"
        raise CostModelError(f"pp x virtual stages = {p} x {v} = {p * v} needs at least one layer per model chunk"
                             f"{beside} but {model.name} has {model.num_layers} layers; {fix}")
    if train.pipeline_schedule == "interleaved_1f1b" and m % p:
        raise CostModelError(f"interleaved_1f1b needs the micro-batches per step (grad_accum={m}) to be a multiple "
                             f"of pp={p} (Megatron-LM's requirement); use --grad-accum {m + (-m) % p}")
    split = train.stage_layers
    if split is not None:
        if len(split) != p:
            raise CostModelError(f"stage_layers lists {len(split)} stages but pp={p}; give one layer count per stage")
        if sum(split) != model.num_layers:
            raise CostModelError(f"stage_layers {list(split)} sum to {sum(split)} but {model.name} has "
                                 f"{model.num_layers} layers; make them add up")
        short = [s for s, n in enumerate(split) if n < min_stage_layers(p, v, s)]
        if short:
            ends = ("; the first and the last stage one fewer (the embedding and the loss may fill a chunk alone)"
                    if v > 1 else "")
            raise CostModelError(f"stage_layers {list(split)}: stage {short[0]} has too few layers; every stage "
                                 f"needs at least virtual_stages={v} (one per model chunk){ends}")


def stage_layers(model: ModelSpec, train: TrainSpec, layout: Layout) -> tuple[int, ...]:
    """The user's split (``train.stage_layers``) or the balanced default."""
    if train.stage_layers is not None and len(train.stage_layers) == layout.pp:
        return train.stage_layers
    p, v = layout.pp, train.virtual_stages
    if p == 1:
        return (model.num_layers,)
    return default_stage_layers(model.num_layers, p, v, round(head_layer_equivalents(model, train, layout), 6))


def stages(model: ModelSpec, train: TrainSpec, layout: Layout) -> tuple[StageView, ...]:
    """Every stage, first to last."""
    p, m, v = layout.pp, train.grad_accum, train.virtual_stages
    split = stage_layers(model, train, layout)
    return tuple(StageView(s, n, s == 0, s == p - 1, in_flight(train.pipeline_schedule, p, m, v, s))
                 for s, n in enumerate(split))


def candidate_stages(all_stages: tuple[StageView, ...]) -> tuple[StageView, ...]:
    """The stages that can hold the most memory: the first and the last, and among the others, for each
    layer count, the lowest index (in-flight micro-batches only fall with the index)."""
    seen: set[int] = set()
    out = []
    for st in all_stages:
        if st.first or st.last:
            out.append(st)
        elif st.layers not in seen:
            seen.add(st.layers)
            out.append(st)
    return tuple(out)


def p2p_bytes(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """Bytes of one stage-boundary transfer (one micro-batch's activation forward, or its gradient back):
    ``micro_batch x seq_len / sp x hidden`` in the compute dtype, further split over TP when Megatron
    sequence parallelism keeps the hidden states sequence-sharded across the TP group."""
    tokens = train.micro_batch * train.seq_len / layout.sp
    if train.tp_sequence_parallel and layout.tp > 1:
        tokens /= layout.tp
    return tokens * model.hidden_size * train.dtype_bytes
