"""Part 2 of benchmarks/data_balance.py: zigzag vs per-document ring attention measured on CPU ranks (4, or as
many as there are cores, at least 2).

One packed batch (rows of ``seq`` tokens packed first-fit from the distribution's documents scaled to the row:
each length multiplied by ``seq / 131072`` so a 128K-row mix keeps its shape on a CPU-sized row), the same
q/k/v on every rank, forward + backward of ring attention over 4 ring ranks under both rules; the slowest
rank's median time over ``iters`` iterations, and beside it the planner's predicted busiest/mean rank work
for the same rows (:func:`sp_plan.cost_models.data_balance.rank_pairs`).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from sp_plan.cost_models.data_balance import rank_pairs
from sp_plan.cost_models.lengths import load_lengths
from sp_plan.cost_models.packing import pack, sample_lengths

import os

#: Ring ranks: 4, or fewer on a machine with fewer cores (ranks sharing a core measure total work, not the
#: busiest rank's).
RING = max(2, min(4, os.cpu_count() or 2))
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def packed_rows(lengths: str, seq: int, rows: int, scale_from: int = 131072) -> list[list[int]]:
    histogram = load_lengths(lengths)
    factor = seq / scale_from
    scaled = [max(1, round(n * factor)) for n in sample_lengths(histogram.bins, rows * scale_from * 4)]
    packed = pack(scaled, seq, "first_fit", multiple=2 * RING)
    chosen = packed[:rows]
    out = []
    for row in chosen:
        docs = [p.padded for p in row]
        if sum(docs) < seq:
            docs.append(seq - sum(docs))
        out.append(docs)
    return out


def _rank(rank: int, world: int, rows: list[list[int]], seq: int, iters: int) -> dict:
    import torch

    from sp_plan.cost_models.layout import Layout
    from sp_plan.runtime.attention.documents import row_bounds
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import build_mesh

    mesh = build_mesh(Layout(ring=world), device_type="cpu")
    points = [0]
    for docs in rows:
        for n in docs:
            points.append(points[-1] + n)
    cu = torch.tensor(points, dtype=torch.int32)
    documents = row_bounds(cu, len(rows), seq)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(rows), seq, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(len(rows), seq, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(len(rows), seq, KV_HEADS, HEAD_DIM, generator=gen)
    times = {}
    for rule in ("zigzag", "per_document"):
        sp = SequenceParallel.from_mesh(mesh, sharding=rule)
        shard = (lambda x: sp.shard(x, 1, documents)) if rule == "per_document" else (lambda x: sp.shard(x, 1))
        leaves = [shard(x).clone().requires_grad_() for x in (q, k, v)]
        samples = []
        for i in range(iters + 1):
            torch.distributed.barrier()
            start = time.perf_counter()
            out = sp.attention(*leaves, causal=True, cu_seqlens=cu)
            out.sum().backward()
            samples.append(time.perf_counter() - start)
        times[rule] = samples[1:]  # the first iteration warms the caches
    return times


def measured_lines(lengths: str, seq: int, iters: int, rows: int = 1, scale_from: int = 131072) -> list[str]:
    from tests.distributed import run_ranks

    packed = packed_rows(lengths, seq, rows, scale_from)
    per_rank = run_ranks(RING, _rank, packed, seq, iters, timeout=600)
    lines = [f"forward+backward ring attention, {RING} CPU ranks (gloo, 1 thread each), {rows} x {seq:,}-token packed "
             f"row(s) of {lengths} (lengths scaled by {seq}/{scale_from}), {HEADS} heads ({KV_HEADS} KV) x {HEAD_DIM}",
             f"{'rule':13s} {'slowest rank':>14s} {'measured':>9s} {'predicted busiest/mean':>23s}"]
    medians = {rule: statistics.median(max(r[rule][i] for r in per_rank) for i in range(iters))
               for rule in ("zigzag", "per_document")}
    for rule in ("zigzag", "per_document"):
        work = np.sum([rank_pairs(tuple(docs), seq, RING, rule) for docs in packed], axis=0)
        lines.append(f"{rule:13s} {medians[rule] * 1e3:11.1f} ms {medians[rule] / medians['per_document']:8.2f}x "
                     f"{work.max() / work.mean():22.2f}x")
    zig = np.sum([rank_pairs(tuple(d), seq, RING, "zigzag") for d in packed], axis=0)
    lines.append(f"measured speed-up of per-document over zigzag: {medians['zigzag'] / medians['per_document']:.2f}x; "
                 f"predicted (busiest-rank work ratio): {zig.max() / zig.mean():.2f}x")
    return lines
