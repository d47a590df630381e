"""Balance of packed long-tailed rows over ring ranks, predicted and measured (issue 32 item 6).

Part 1 (the cost model, no torch): on a long-tailed length distribution (a shipped preset or any
``--lengths`` file), for every packing and ring degree 2/4/8, the busiest ring rank's document-masked causal
attention work divided by the mean rank's, for the three sharding rules (contiguous, zigzag over the whole
row, per-document head-tail), averaged over the packed rows. Target: per-document <= 1.05 where zigzag is
far above it.

Part 2 (the runtime, ``--measure``): one packed batch drawn from the same distribution (scaled to a CPU
row), forward + backward of ring attention on 4 CPU ranks (gloo) with the zigzag and the per-document rule on
the same batch, side by side in one run: the slowest rank's median time, the measured ratio, and the planner's
predicted ratio of busiest-rank work for the same rows beside it. On a CPU the attention kernels dominate
these shapes, so the time ratio tracks the work ratio; communication is the same for both rules.

    python benchmarks/data_balance.py [--lengths long-doc-mix] [--seq-len 128K] [--measure]

Measured on this project's 2-core CPU machine (2 ring ranks, lengths unscaled, ``--scale-from 8192``): on an
11-document 8,192-token row zigzag 559-572 ms vs per-document 599-713 ms (0.80-0.93x), predicted busiest/mean
work 1.25x for zigzag; on a 4,096-token row per-document was 1.80x faster (predicted 1.24x). The CPU path is exact
but calls the kernel once per document sub-block, and per-document sharding puts every document on every rank
at every step (44 calls per rank vs 5-7 for zigzag on the 8K row): on CPU that call overhead is of the order of
the balance it buys, and the runs are noisy. The flash-attn varlen path on GPUs makes one call per step; the GPU measurement is still to be made.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sp_plan.cost_models.data_balance import SHARDINGS, DataShape  # noqa: E402
from sp_plan.cost_models.lengths import load_lengths  # noqa: E402
from sp_plan.cost_models.packing import PACKINGS  # noqa: E402
from sp_plan.cost_models.units import parse_seq_len  # noqa: E402


def predicted_table(lengths: str, seq_len: int, rings: tuple[int, ...]) -> list[str]:
    histogram = load_lengths(lengths)
    lines = [f"busiest ring rank / mean rank, document-masked causal pairs ({lengths}, {seq_len:,}-token rows)",
             f"{'packing':10s} {'ring':>4s} " + " ".join(f"{rule:>13s}" for rule in SHARDINGS) + "   padding(per_doc)"]
    for packing in PACKINGS:
        shape = DataShape(bins=histogram.bins, packing=packing, source=lengths)
        for ring in rings:
            balances = [shape.balance(seq_len, ring, rule) for rule in SHARDINGS]
            cells = " ".join(f"{b.ring_imbalance:13.3f}" for b in balances)
            lines.append(f"{packing:10s} {ring:4d} {cells}   {balances[-1].padding_fraction:.2%}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="long-doc-mix")
    parser.add_argument("--seq-len", default="128K")
    parser.add_argument("--rings", default="2,4,8")
    parser.add_argument("--measure", action="store_true", help="also time zigzag vs per-document on 4 CPU ranks")
    parser.add_argument("--cpu-seq", type=int, default=4096, help="row length of the measured CPU batch")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--scale-from", type=int, default=131072,
                        help="document lengths are scaled by --cpu-seq / this (131072: a 128K row's mix on a CPU row)")
    args = parser.parse_args(argv)
    seq_len = parse_seq_len(args.seq_len)
    rings = tuple(int(r) for r in args.rings.split(","))
    print("\n".join(predicted_table(args.lengths, seq_len, rings)))
    if args.measure:
        from benchmarks.data_balance_measure import measured_lines

        print()
        print("\n".join(measured_lines(args.lengths, args.cpu_seq, args.iters, scale_from=args.scale_from)))


if __name__ == "__main__":
    main()
