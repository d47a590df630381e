"""Generate the shipped document-length presets (``cost_models/data/lengths/<name>.yaml``) from documented
parametric shapes: lognormal mixtures whose component means come from published dataset statistics (cited
in each preset's ``notes``) and whose spreads and token shares are stated assumptions where no source gave
them. See ``cost_models/data/lengths/README.md``.

    python benchmarks/make_length_presets.py           # print each preset's summary
    python benchmarks/make_length_presets.py --write   # ... and rewrite the YAML files

Method: each component is a lognormal of length in tokens with the given mean and sigma (mu = ln(mean) -
sigma^2/2); the mixture is cut to 1..MAX tokens and renormalised; the expected number of documents of each
whole length l is N * P(l - 0.5 < X < l + 0.5); these expectations go into the planner's bins
(:func:`sp_plan.cost_models.lengths.histogram_from_distribution`: exact lengths to 1024 tokens, then 1% log
bins, counts by rounded cumulative expectation so the long tail is kept). Deterministic: no sampling.

Component weights are given as *token* shares (how data mixes are published) and turned into document
shares by dividing by each component's mean length.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import numpy as np
from scipy.stats import lognorm

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "cost_models" / "data" / "lengths"
BYTES_PER_TOKEN = 4.0  # English text with a Llama/GPT-style BPE: about 4 bytes per token (an assumption)
KIB = 1024

PRESETS = {
    "sft-short": {
        "documents": 1_000_000,
        "max_length": 32_768,
        # (name, mean tokens, sigma, token share)
        "components": [
            ("single-turn instruction (Alpaca-like)", 150.0, 0.83, 0.08),
            ("multi-turn chat (UltraChat/ShareGPT-like)", 1_700.0, 1.0, 0.92),
        ],
        "source": "parametric short-SFT mix (lognormal mixture; see notes)",
        "notes": (
            "Chat/instruction SFT data: a mixture of single-turn instructions and multi-turn conversations, one "
            "document per example. Single-turn component: Alpaca (52,002 examples) averages 19.67 +- 15.19 user "
            "and 64.51 +- 64.85 assistant tokens per turn (ShareChat, Yan et al. 2025, arXiv 2512.17843, Table 1); "
            "with a chat template and system prompt that is about 150 tokens per example (assumed), and a "
            "coefficient of variation of about 1 (the table's std/mean) gives lognormal sigma = sqrt(ln 2) = "
            "0.83. Multi-turn component: UltraChat-200k's train_sft split is 1,397,058,554 bytes over 207,865 "
            "conversations (its dataset card), about 6.7 KB or 1,700 tokens at 4 bytes/token; ShareGPT averages "
            "3.51 turns per conversation (ShareChat Table 1); sigma = 1.0 is assumed (no source gave the spread). "
            "Token shares 8% single-turn / 92% multi-turn are assumed (about half the documents single-turn); "
            "documents above 32,768 tokens are cut off (renormalised). Resulting shape: median 250-350 tokens, "
            "p90 2,000-3,000, p99 6,000-10,000, mean about 900, max 32,000-32,768 (the cut-off)."
        ),
        "claims": {"p50": (250, 350), "p90": (2_000, 3_000), "p99": (6_000, 10_000), "max": (32_000, 32_768)},
    },
    "long-doc-mix": {
        "documents": 200_000,
        "max_length": 1_048_576,
        "components": [
            ("web text (Pile-CC-like)", 4.33 * KIB / BYTES_PER_TOKEN, 1.0, 0.40),
            ("arXiv papers", 46.61 * KIB / BYTES_PER_TOKEN, 0.7, 0.20),
            ("books (Books3/PG-19-like)", 538.36 * KIB / BYTES_PER_TOKEN, 0.8, 0.40),
        ],
        "source": "parametric long-document continued-pretraining mix (lognormal mixture; see notes)",
        "notes": (
            "Continued pre-training for long context: long documents (books, papers) mixed with short web text, "
            "as ProLong (Gao et al. 2024, arXiv 2410.02660) recommends (books and code repositories are the best "
            "long sources, and must be combined with high-quality short data). Component means are the Pile's "
            "mean document sizes (Gao et al. 2020, arXiv 2101.00027, Table 1) at 4 bytes/token: Pile-CC 4.33 KiB "
            "(about 1,100 tokens), ArXiv 46.61 KiB (about 11,900 tokens), Books3 538.36 KiB (about 138,000 tokens; "
            "PG-19 398.73 KiB, about 102,000). Sigmas (1.0 web, 0.7 arXiv, 0.8 books) and the token shares (40% "
            "web, 20% arXiv, 40% books: 60% long data by tokens) are assumptions, not sourced; documents above "
            "1,048,576 tokens are cut off (renormalised). Resulting shape: by documents mostly short web pages "
            "(median 600-850 tokens, p90 2,500-4,500, p99 20,000-35,000), under 1% books of 100K-1M tokens "
            "(max above 500,000); the token median (half the tokens lie in documents at least this long) is "
            "10,000-25,000 tokens."
        ),
        "claims": {"p50": (600, 850), "p90": (2_500, 4_500), "p99": (20_000, 35_000), "max": (500_000, 1_048_576),
                   "token_p50": (10_000, 25_000)},
    },
}


def expected_counts(spec: dict) -> tuple[np.ndarray, np.ndarray]:
    """Whole lengths 1..max and the expected number of documents of each."""
    top = spec["max_length"]
    edges = np.arange(0.5, top + 1.5)  # l - 0.5 .. l + 0.5
    doc_weights = np.array([share / mean for _, mean, _, share in spec["components"]])
    doc_weights /= doc_weights.sum()
    mass = np.zeros(top)
    for weight, (_, mean, sigma, _) in zip(doc_weights, spec["components"]):
        mu = math.log(mean) - sigma ** 2 / 2
        cdf = lognorm.cdf(edges, s=sigma, scale=math.exp(mu))
        mass += weight * np.diff(cdf)
    mass *= spec["documents"] / mass.sum()
    return np.arange(1, top + 1), mass


def build(name: str):
    sys.path.insert(0, str(ROOT))
    from sp_plan.cost_models.lengths import histogram_from_distribution

    spec = PRESETS[name]
    lengths, mass = expected_counts(spec)
    return histogram_from_distribution(zip(lengths.tolist(), mass.tolist()), spec["source"])


def to_yaml(name: str, histogram) -> str:
    import yaml

    spec = PRESETS[name]
    head = {
        "source": spec["source"],
        "notes": spec["notes"],
        "generated_by": "benchmarks/make_length_presets.py",
        "shape": {
            "documents": spec["documents"],
            "max_length": spec["max_length"],
            "components": [{"name": c, "mean_tokens": round(m, 1), "sigma": s, "token_share": w}
                           for c, m, s, w in spec["components"]],
        },
        "claims": {k: list(v) for k, v in spec["claims"].items()},
    }
    text = yaml.safe_dump(head, sort_keys=False, width=110)
    rows = "\n".join(f"- [{length}, {count}]" for length, count in histogram.bins)
    return f"# {name}: generated by benchmarks/make_length_presets.py, do not edit by hand\n{text}bins:\n{rows}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite cost_models/data/lengths/<name>.yaml")
    args = parser.parse_args()
    from sp_plan.cost_models.lengths import summarize

    for name in PRESETS:
        histogram = build(name)
        summary = summarize(histogram)
        print(f"{name}: {summary['documents']:,} documents, {summary['tokens']:,} tokens, mean "
              f"{summary['mean']:,.0f}, p50 {summary['p50']:,}, p90 {summary['p90']:,}, p99 {summary['p99']:,}, "
              f"max {summary['max']:,}, token p50 {summary['token_p50']:,}, {summary['bins']} bins")
        for key, (low, high) in PRESETS[name]["claims"].items():
            status = "ok" if low <= summary[key] <= high else "OUTSIDE THE NOTES' RANGE"
            print(f"  {key} {summary[key]:,} in [{low:,}, {high:,}]: {status}")
        if args.write:
            (OUT / f"{name}.yaml").write_text(to_yaml(name, histogram), encoding="utf-8")


if __name__ == "__main__":
    main()
