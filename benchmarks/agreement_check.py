"""Cost of the per-call shape-agreement check (issue 16) next to the attention call it guards.

Every multi-rank attention call all-gathers a fixed-length int64 descriptor before its first collective
(:func:`sp_plan.runtime.attention.groups.agree`). This measures, on W gloo ranks (CPU, one intra-op thread per
rank), the median wall time of that check alone and of the attention call it precedes (forward, and
forward + backward; each iteration timed on the slowest rank after a barrier), for Ulysses and Ring at a
small and at an 8K-token shape::

    python benchmarks/agreement_check.py                      # 2 ranks, seq 256 and 8192
    python benchmarks/agreement_check.py --seq 1024 --iters 20

The check's cost is independent of the tensor sizes (it sends DESCRIPTOR_LEN int64 per rank), so its
share shrinks as the attention grows.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

from tests.distributed import run_ranks


def _slowest(fn, iters: int) -> list[float]:
    """Per-iteration wall time of ``fn()``, the max over ranks (barrier before, all-reduce of the time after)."""
    import torch.distributed as dist

    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return times


def _rank(rank: int, world: int, seqs: list[int], iters: int, heads: int, head_dim: int) -> list[dict]:
    import torch.distributed as dist

    from sp_plan.runtime.attention import ring_attention, ulysses_attention
    from sp_plan.runtime.attention.groups import DESCRIPTOR_LEN, agree

    group = dist.group.WORLD
    rows = []
    for seq in seqs:
        local = seq // world
        n = iters if seq <= 2048 else max(2, iters // 10)
        qkv = tuple(torch.randn(1, local, heads, head_dim, requires_grad=True) for _ in range(3))
        check = _slowest(functools.partial(agree, group, "benchmark", qkv, causal=True), max(n, 50))
        for path, call in (("ulysses", functools.partial(ulysses_attention, *qkv, group, causal=True)),
                           ("ring", functools.partial(ring_attention, *qkv, group, causal=True, layout="zigzag"))):
            call()  # warm-up
            with torch.no_grad():
                forward = _slowest(call, n)
            both = _slowest(lambda call=call: call().sum().backward(), n)
            rows.append({"path": path, "seq": seq, "local": local, "check": statistics.median(check),
                         "forward": statistics.median(forward), "both": statistics.median(both),
                         "iters": n, "descriptor": DESCRIPTOR_LEN})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    rows = run_ranks(args.world, _rank, args.seq, args.iters, args.heads, args.head_dim, timeout=1800)[0]
    print(f"# agreement check vs attention: CPU, gloo, {args.world} ranks x 1 thread, torch {torch.__version__}; "
          f"batch 1, heads {args.heads}, head_dim {args.head_dim}, fp32, causal; medians, slowest rank; "
          f"descriptor {rows[0]['descriptor']} int64 per rank")
    print("| path | seq (local) | iters | check us | forward ms | fwd+bwd ms | check / forward | check / fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['seq']} ({r['local']}) | {r['iters']} | {r['check'] * 1e6:.0f} | "
              f"{r['forward'] * 1e3:.2f} | {r['both'] * 1e3:.2f} | {r['check'] / r['forward']:.2%} | "
              f"{r['check'] / r['both']:.2%} |")


if __name__ == "__main__":
    main()
