"""Length-adaptive SP against the best single layout, predicted (issue 32 item 5, the planner half).

For each length distribution, sequence length and GPU count: the single-layout plan's predicted tokens/s (what
``sp-plan plan --lengths`` recommends), the best length-adaptive split's (``--adaptive-sp``: buckets of document
length, each on its own Ulysses x Ring groups), their ratio, the split and its layouts, and how long the adaptive
search took. Both are predictions of the same cost model, computed in the same run; nothing is measured on GPUs.

    python benchmarks/adaptive_sp.py [--model llama3-8b] [--gpu h100-80gb] [--lengths sft-short,long-doc-mix]
                                     [--seq-lens 32K,128K] [--gpus 8,16,64]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sp_plan.cost_models.data_balance import DataShape  # noqa: E402
from sp_plan.cost_models.lengths import load_lengths  # noqa: E402
from sp_plan.cost_models.model_spec import load_model  # noqa: E402
from sp_plan.cost_models.topology import default_topology  # noqa: E402
from sp_plan.cost_models.topology.presets import natural_gpus_per_node  # noqa: E402
from sp_plan.cost_models.train_spec import TrainSpec  # noqa: E402
from sp_plan.cost_models.units import parse_seq_len  # noqa: E402
from sp_plan.planner.adaptive_search import adaptive_search  # noqa: E402
from sp_plan.planner.errors import PlannerError  # noqa: E402
from sp_plan.planner.search import PlanSettings  # noqa: E402


def _split_text(split) -> str:
    if split is None:
        return "none priced"
    return " | ".join(f"<={b.upper // 1024}K {b.layout.describe()}" for b in split.buckets)


def row(model_name: str, gpu: str, lengths: str, seq_len: int, gpus: int) -> str:
    model = load_model(model_name)
    histogram = load_lengths(lengths)
    topology = default_topology(gpu, gpus, min(natural_gpus_per_node(gpu), gpus))
    train = TrainSpec(seq_len=seq_len, data=DataShape(bins=histogram.bins, source=lengths))
    started = time.perf_counter()
    try:
        result = adaptive_search(model, train, topology, PlanSettings(), world=gpus)
    except PlannerError as exc:
        return f"{lengths:13s} {seq_len // 1024:4d}K {gpus:4d}  {exc}"
    single = result.single.estimate.time.tokens_per_s
    adaptive = result.best.tokens_per_s if result.best else float("nan")
    multi = result.best_multi.tokens_per_s if result.best_multi else float("nan")
    return (f"{lengths:13s} {seq_len // 1024:4d}K {gpus:4d} {single:9,.0f} {adaptive:9,.0f} {adaptive / single:6.3f} "
            f"{multi / single:6.3f} {time.perf_counter() - started:6.1f}  {result.single.layout.describe():30s} "
            f"{_split_text(result.best_multi)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--lengths", default="sft-short,long-doc-mix")
    parser.add_argument("--seq-lens", default="32K,128K")
    parser.add_argument("--gpus", default="8,16,64")
    args = parser.parse_args(argv)
    print(f"{args.model} on {args.gpu}, default global batch (4M tokens), single layout vs length-adaptive SP "
          "(predicted tokens/s)")
    print("single: plan --lengths's layout; adaptive: the best split (1 bucket = the single question under the runtime's "
          "tp=pp=1 restriction); multi: the best split of 2-3 buckets; ratios over single; search: seconds")
    print(f"{'lengths':13s} {'seq':>5s} {'gpus':>4s} {'single':>9s} {'adaptive':>9s} {'ratio':>6s} {'multi':>6s} "
          f"{'search':>6s}  {'single layout':30s} best multi-bucket split (document bound, layout)")
    for lengths in args.lengths.split(","):
        for seq in args.seq_lens.split(","):
            for gpus in (int(g) for g in args.gpus.split(",")):
                print(row(args.model, args.gpu, lengths, parse_seq_len(seq), gpus), flush=True)


if __name__ == "__main__":
    main()
