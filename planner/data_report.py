"""What the user's data does to a plan (``--lengths``): the distribution, the packed rows, the balance over
ranks, what imbalance costs at the chosen layout and what fixed it.

Printed under the recommendation of ``plan`` and ``estimate`` whenever ``--lengths`` is given; with
``--explain`` it also re-prices the chosen layout under every sharding rule and packing, so the user sees
the step each alternative would take (the planner already chose the best of them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sp_plan.cost_models.data_balance import (
    RUNTIME_SHARDINGS,
    SHARDINGS,
    Balance,
    DataShape,
    auto_packings,
    layout_balance,
)
from sp_plan.cost_models.estimate import Estimate
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.lengths import LengthHistogram
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.packing import PACKINGS
from sp_plan.cost_models.train_spec import TrainSpec

#: Prices a training configuration at the chosen layout: its estimate (None when it does not fit or is invalid).
Pricer = Callable[[TrainSpec], Estimate | None]


def _tokens(n: float) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def attention_seconds(estimate: Estimate) -> float:
    parts = estimate.time.components
    return parts.get("attention_forward", 0.0) + parts.get("attention_backward", 0.0)


def data_summary(model: ModelSpec, train: TrainSpec, layout: Layout, estimate: Estimate) -> dict[str, Any] | None:
    """The data section of ``--json`` (None without ``--lengths``)."""
    data = train.data
    balance = layout_balance(model, train, layout)
    if data is None or balance is None:
        return None
    histogram = LengthHistogram(bins=data.bins)
    attention = attention_seconds(estimate)
    return {
        "source": data.source, "documents": histogram.documents, "tokens": histogram.tokens,
        "length_p50": histogram.percentile(50), "length_p99": histogram.percentile(99), "length_max": histogram.longest,
        "packing": data.packing, "packing_requested": "auto" if data.packing_auto else data.packing,
        "sharding": balance.rule, "sharding_requested": data.sharding,
        "equivalent_document_length": train.attention_document_length,
        "padding_fraction": balance.padding_fraction, "sampled_rows": balance.rows,
        "pairs_per_row": {"mean": balance.pairs_mean, "p95": balance.pairs_p95, "max": balance.pairs_max},
        "attention_factor": balance.factor, "ring_imbalance": balance.ring_imbalance,
        "dp_imbalance": balance.dp_imbalance,
        "imbalance_seconds_per_step": attention * (1 - 1 / balance.factor) if balance.factor > 0 else 0.0,
    }


def data_lines(model: ModelSpec, train: TrainSpec, layout: Layout, estimate: Estimate,
               price: Pricer | None = None) -> list[str]:
    """The data section under a recommendation; ``price`` (``--explain``) adds the alternatives' steps."""
    summary = data_summary(model, train, layout, estimate)
    if summary is None:
        return []
    data: DataShape = train.data  # type: ignore[assignment]
    s = summary
    pairs = s["pairs_per_row"]
    doc = s["equivalent_document_length"]
    lines = [
        f"data: {s['source'] or 'the --lengths histogram'}: {s['documents']:,} documents, {_tokens(s['tokens'])} tokens, "
        f"length p50 {_tokens(s['length_p50'])}, p99 {_tokens(s['length_p99'])}, max {_tokens(s['length_max'])}",
        f"  packed {data.packing}{' (chosen by auto)' if data.packing_auto else ''} into "
        f"{_tokens(train.seq_len)}-token rows ({s['sampled_rows']:,} sampled): padding "
        f"{s['padding_fraction']:.1%}; causal pairs per row mean {pairs['mean']:.3g}, p95 {pairs['p95']:.3g}, max "
        f"{pairs['max']:.3g} (priced as documents of {_tokens(doc) if doc else 'one row'} tokens at the mean)",
    ]
    rule = s["sharding"]
    how = "chosen by auto" if data.sharding == "auto" and layout.ring > 1 else (
        "one rank per sequence group: no ring split" if layout.ring == 1 else "as requested")
    lines.append(
        f"  balance: {rule} sharding over ring={layout.ring} ({how}): busiest ring rank {s['ring_imbalance']:.2f}x the "
        f"mean; slowest of dp={layout.dp} data-parallel ranks {s['dp_imbalance']:.2f}x (grad accumulation "
        f"{train.grad_accum}); attention runs {s['attention_factor']:.2f}x the mean row's, "
        f"{s['imbalance_seconds_per_step']:.3g} s of the {estimate.time.step_s:.3g} s step")
    if price is not None:
        lines += _alternatives(model, train, layout, estimate, price)
    return lines


def choose_packing(train: TrainSpec, layout: Layout, price: Pricer) -> TrainSpec:
    """``train`` with its data's ``auto`` packing resolved at one layout (``estimate``): the packing the search would
    choose there, the fastest fitting in useful tokens/s (the first of equals; the fastest at all when none fits)."""
    data = train.data
    if data is None or data.packing != "auto":
        return train
    best: tuple[tuple[bool, float], TrainSpec] | None = None
    for shape in auto_packings(data):
        if not shape.runs_at(layout.ring):
            continue
        variant = train.model_copy(update={"data": shape})
        priced = price(variant)
        key = (priced is not None and priced.fits, priced.time.tokens_per_s if priced is not None else -1.0)
        if best is None or key > best[0]:
            best = (key, variant)
    assert best is not None  # first_fit runs at every layout
    return best[1]


def _alternatives(model: ModelSpec, train: TrainSpec, layout: Layout, estimate: Estimate, price: Pricer) -> list[str]:
    data: DataShape = train.data  # type: ignore[assignment]
    base = estimate.time.tokens_per_s
    lines = ["  the same layout under other sharding rules and packings (useful tokens/s; * = this plan):"]
    rules = SHARDINGS if layout.ring > 1 else ("zigzag",)
    chosen = layout_balance(model, train, layout)
    runnable: dict[str, tuple[float, str, Balance]] = {}  # per packing: its fastest rule the runtime runs as priced
    ring_by_rule: dict[tuple[str, str], float] = {}
    for rule in rules:
        for packing in PACKINGS:
            variant = train.model_copy(update={"data": data.model_copy(update={"sharding": rule, "packing": packing})})
            balance: Balance | None = layout_balance(model, variant, layout)
            priced = price(variant)
            mark = "*" if chosen is not None and packing == data.packing and rule == chosen.rule else " "
            runs = "" if rule in RUNTIME_SHARDINGS else " (priced only: the runtime's SequenceParallel runs zigzag and per_document)"
            if packing == "stream" and rule == "per_document" and layout.ring > 1:
                runs = (" (the runtime pads each document of a stream row, so its rows grow past --seq-len: "
                        "auto does not choose it)")
            if priced is None or balance is None:
                lines.append(f"   {mark} {rule:12s} {packing:9s} does not fit or is invalid at this layout{runs}")
                continue
            rate = priced.time.tokens_per_s
            ring_by_rule[packing, rule] = balance.ring_imbalance
            if not runs and (packing not in runnable or rate > runnable[packing][0]):
                runnable[packing] = (rate, rule, balance)
            lines.append(
                f"   {mark} {rule:12s} {packing:9s} {rate:>12,.0f} tokens/s ({rate / base - 1:+.1%}): attention "
                f"{balance.factor:.2f}x, ring {balance.ring_imbalance:.2f}x, dp {balance.dp_imbalance:.2f}x, padding "
                f"{balance.padding_fraction:.1%}{runs}")
    if chosen is not None:
        lines += _worth(data, chosen, base, runnable, ring_by_rule, layout)
    return lines


def _worth(data: DataShape, chosen: Balance, base: float, runnable: dict[str, tuple[float, str, Balance]],
           ring_by_rule: dict[tuple[str, str], float], layout: Layout) -> list[str]:
    """What the packing choice is worth against the other packings (each at its fastest runnable rule), and what
    fixed the imbalance and the padding."""
    how = "chosen by auto" if data.packing_auto else "as requested"

    def terms(b: Balance) -> str:
        return f"padding {b.padding_fraction:.1%}, causal pairs per row {b.pairs_mean:.3g}, attention {b.factor:.2f}x"

    others = [f"{packing} {base / rate - 1:+.1%} ({rule}: {terms(b)})"
              for packing, (rate, rule, b) in runnable.items() if packing != data.packing]
    cut = " (stream cuts documents at row ends: fewer pairs, each piece sees only its own row)" \
        if data.packing == "stream" else ""
    lines = [f"  packing {data.packing} ({how}): {terms(chosen)}{cut}"
             + (f"; faster than the other packings at this layout by: {', '.join(others)}" if others else "")]
    if layout.ring > 1:
        zigzag = ring_by_rule.get((data.packing, "zigzag"))
        fixed = ("per-document sharding fixes the ring imbalance" if chosen.rule == "per_document"
                 else "zigzag sharding keeps the ring balanced")
        if zigzag is not None:
            lines.append(f"  {fixed}: busiest ring rank {chosen.ring_imbalance:.2f}x the mean under {chosen.rule}, "
                         f"{zigzag:.2f}x under zigzag")
    return lines

