"""Ring attention (zigzag): K/V blocks passed around the ring, each hop hidden behind a block's compute.

Reads the ``ring`` degree R (and the head split, for the heads one rank attends over).

Traffic, per layer and micro-batch: blocks of b S/R tokens x kv_heads x rep / (tp U) heads x head_dim.
Forward: R-1 sends of the K and V blocks (dtype d). Backward: R-1 sends of K and V (dtype d) and R sends
of the dK and dV accumulators in fp32 (they travel with their blocks and come home). Full recompute
passes K and V around once more (selective recompute keeps the attention output: no ring pass).

Compute: R calls per pass on chunks of c = S / 2R tokens (one causal 2c x 2c block, R-1 full c x 2c
blocks; packed documents shorter than 2c run as variable-length calls), each followed by an LSE merge
(fp32 accumulators, memory-bound: the stack's bytes per element) and a ring step's fixed cost. A layer
with a sliding window shorter than the sequence skips the blocks wholly outside its window: each step
computes the in-window pairs of its busiest rank and a step with none costs only its fixed cost (no
kernel, no merge); the K/V hops are all still made (see :func:`_windowed_ring_kernels`).

Time (overlap class ``ring``): hop i+1's transfer runs while block i is computed, so each of the R-1
hops costs max(0, transfer - one ring step's kernel and merge), and slows that compute by the NCCL
slowdown x the overlapped time. Backward hops carry K/V and the fp32 dK/dV; the last dK/dV hop home
has nothing to hide behind.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

from ..flops import band_pairs, mean_over_layers, windowed_attention_seconds
from ..layout import Layout
from ..model_spec import ModelSpec
from ..train_spec import TrainSpec
from .base import Strategy
from .terms import CommOp, ComputeContext, PricedOp, Term, TimeContext

#: Ring attention's dK/dV accumulators travel in fp32 (brief convention).
DKV_ACCUMULATOR_BYTES = 4
#: The label of the K/V block hops (forward, backward and, with " (recompute)", recompute).
KV_BLOCKS = "K,V blocks"


class RingHops(NamedTuple):
    """Seconds of one hop of each kind: forward K/V, backward K/V, backward dK/dV, recompute K/V."""

    forward: float = 0.0
    kv: float = 0.0
    dkv: float = 0.0
    recompute: float = 0.0


class RingAttention(Strategy):
    name = "ring"
    layer_buckets = ("ring",)
    overlap_classes = ("ring",)
    attention_traffic = True

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
        r = layout.ring
        if r == 1:
            return
        rep = model.kv_replication(layout.head_split)
        heads = model.num_kv_heads * rep / layout.head_split  # this rank's K/V heads
        block = train.micro_batch * (train.seq_len / r) * heads * model.head_dim
        kv = 2 * block * train.dtype_bytes

        def hop(nbytes: float, phase: str, count: int, label: str, recompute: bool = False) -> CommOp:
            return CommOp("ring", "send_recv", "ring", float(nbytes), phase, count=count, overlap="ring",
                          recompute=recompute, label=label)

        yield hop(kv, "forward", r - 1, KV_BLOCKS)
        if not train.is_training:
            return
        yield hop(kv, "backward", r - 1, KV_BLOCKS)
        yield hop(2 * block * DKV_ACCUMULATOR_BYTES, "backward", r, "dK,dV accumulators (fp32)")
        if train.checkpointing == "full":
            yield hop(kv, "backward", r - 1, f"{KV_BLOCKS} (recompute)", recompute=True)

    def attention_pass(self, cc: ComputeContext, backward: bool) -> tuple[float, float] | None:
        r = cc.layout.ring
        if r == 1:
            return None
        # A model mixing local and global layers gets the mean pass and the mean per-step share; the
        # exposed part of each hop (max(0, hop - step)) is then taken on the mean step, an approximation
        # that is exact when every layer has the same kind.
        return mean_over_layers(cc.model, cc.train.seq_len, lambda window: self._pass(cc, backward, window))

    @staticmethod
    def _pass(cc: ComputeContext, backward: bool, window: int | None) -> tuple[float, float]:
        """(seconds of one pass over the R ring steps, the share of one step a K/V hop hides behind) for a
        layer attending within ``window`` (``None``: full causal attention)."""
        r = cc.layout.ring
        train, model = cc.train, cc.model
        b, s, hd = train.micro_batch, train.seq_len, model.head_dim
        bh = b * cc.heads
        c = s / (2 * r)
        doc = train.attention_document_length
        steps = r  # steps with attention work (and an LSE merge)
        if doc is not None and doc < 2 * c:
            kernel = windowed_attention_seconds(cc.attention_seconds, cc.attention.launch_s, bh * 2 * c / doc, doc, window, backward)
            kernel += (r - 1) * cc.attention.launch_s
        elif window is None:
            off = cc.attention_seconds(bh, 2 * c, c, False, backward, calls=r - 1)
            if doc is not None and doc < s:
                # Documents of doc >= 2c tokens fill the diagonal step but only part of the others: a row holds
                # s (doc + 1) / 2 causal pairs, not s (s + 1) / 2, so the off-diagonal steps do a share
                # (doc - 2c) / (s - 2c) of their full work (continuous with the branch above at doc = 2c, the
                # full causal pass at doc = s); their launches stay.
                launches = (r - 1) * cc.attention.launch_s
                off = launches + (doc - 2 * c) / (s - 2 * c) * (off - launches)
            kernel = cc.attention_seconds(bh, 2 * c, 2 * c, True, backward) + off
        else:
            kernel, steps = _windowed_ring_kernels(cc, bh, r, c, window, backward)
        seq = s / r
        split = cc.layout.head_split
        q_elems = b * seq * cc.heads * hd  # this rank's queries after the head split
        kv_elems = b * seq * model.num_kv_heads * model.kv_replication(split) / split * hd
        if backward:  # dQ into its accumulator, dK/dV into the travelling ones
            merge_bytes = (q_elems + 2 * kv_elems) * cc.stack.ring_grad_bytes_per_element
        else:
            merge_bytes = q_elems * cc.stack.ring_merge_bytes_per_element
        hideable = kernel + steps * merge_bytes / cc.hbm  # a K/V hop hides behind a step's kernel and merge,
        return hideable + r * cc.kernels.ring_step_s, hideable / r  # not behind the step's post/wait itself

    def condense(self, overlap_class: str, ops: tuple[PricedOp, ...]) -> RingHops:
        forward = kv = dkv = again = 0.0
        for priced in ops:
            op, t = priced.op, priced.seconds
            if op.phase == "forward":
                forward = t
            elif op.recompute:
                again = t
            elif op.label == KV_BLOCKS:
                kv = t
            else:
                dkv = t
        return RingHops(forward, kv, dkv, again)

    def exposed(self, ctx: TimeContext) -> Iterator[Term]:
        r = ctx.layout.ring
        hops = ctx.priced.get("ring")
        if r == 1 or hops is None:
            return
        fwd, kv, dkv, again = hops
        slow = ctx.slowdown
        step_f, step_b = ctx.compute.ring_step_forward, ctx.compute.ring_step_backward
        yield Term("exposed_comm", (r - 1) * max(0.0, fwd - step_f), "layer_forward", "ring")
        yield Term("interference", (r - 1) * slow * min(fwd, step_f), "layer_forward")
        if not ctx.training:
            return
        hop = kv + dkv
        exposed = (r - 1) * max(0.0, hop - step_b) + dkv
        interference = (r - 1) * slow * min(hop, step_b)
        if again:
            exposed += (r - 1) * max(0.0, again - step_f)
            interference += (r - 1) * slow * min(again, step_f)
        yield Term("exposed_comm", exposed, "layer_backward", "ring")
        yield Term("interference", interference, "layer_backward")


def _windowed_ring_kernels(cc: ComputeContext, batch_heads: float, r: int, c: float, window: int,
                           backward: bool) -> tuple[float, int]:
    """(kernel seconds of one pass, steps with work) of zigzag ring attention with window skipping.

    Rank i holds chunks i and 2R-1-i (c tokens each); at step j it has the K/V chunks of rank (i - j) mod
    R. A step computes only the (query, key) pairs inside the window (:func:`..flops.band_pairs`) and
    skips a block with none. Zigzag balances full causal work, not windowed work, so each step costs what
    its busiest rank computes (ranks wait for each other at every hop): priced as one call of the rank's
    2c queries over that many pairs. The K/V blocks still make all R-1 hops (the comm ops are unchanged):
    rank i's late chunk 2R-1-i needs chunk 2R-2-i, which rank i+1 holds, R-1 hops away in ring order.
    """
    active = _busiest_step_pairs(r, c, window)
    kernel = sum(cc.attention_seconds(batch_heads, 2 * c, pairs / (2 * c), False, backward) for pairs in active)
    return kernel, len(active)


@functools.lru_cache(maxsize=4096)
def _busiest_step_pairs(r: int, c: float, window: int) -> tuple[float, ...]:
    """In-window (query, key) pairs of the busiest rank at each ring step that has any (per sequence and
    head; steps without work left out). Depends on the geometry only: cached across passes and layouts."""
    busiest = [0.0] * r
    for rank in range(r):
        work = [0.0] * r
        for q in (rank, 2 * r - 1 - rank):
            first = max(0, math.floor((q * c - window + 1) / c))  # the earliest key chunk in reach
            for k in range(first, q + 1):
                owner = k if k < r else 2 * r - 1 - k
                work[(rank - owner) % r] += band_pairs(q * c, (q + 1) * c, k * c, (k + 1) * c, window)
        busiest = [max(a, w) for a, w in zip(busiest, work)]
    return tuple(pairs for pairs in busiest if pairs > 0)


__all__ = ["DKV_ACCUMULATOR_BYTES", "RingAttention", "RingHops"]
