"""Golden numbers of the step-time and communication models, to prove a refactor moves none of them.

A fixed grid of cases (models with and without grouped-query attention, layouts covering Ulysses, Ring,
USP, TP, dp_replicate and dp_shard, ZeRO stages 0-3, offload options, checkpointing modes, train and
prefill, three stacks, one- and two-node topologies) is estimated end to end, and every figure of the
estimate a user sees from these models is recorded: step time and each ``time.components`` entry,
exposed communication by strategy, communication bytes by phase and collective, memory totals. The
planner's answer (winner and its step time) is recorded for a few settings too.

    python tests/cost_terms_golden.py --regenerate   # rewrite tests/data/cost_terms_golden.json
    python tests/cost_terms_golden.py                # compare, print the figures that moved

Regenerate only for an intended change of the models' numbers, and say so in the commit.
``tests/test_cost_terms_golden.py`` runs the comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sp_plan.cost_models import CostModelError, Layout, TrainSpec, get_model_preset  # noqa: E402
from sp_plan.cost_models.estimate import estimate  # noqa: E402
from sp_plan.cost_models.profile import resolve_profile  # noqa: E402
from sp_plan.cost_models.time_model import attention_forward_seconds, time_estimate  # noqa: E402
from sp_plan.cost_models.topology import default_topology  # noqa: E402
from sp_plan.planner.search import PlanSettings, search  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "cost_terms_golden.json"

#: Two figures agree when within this relative tolerance (a refactor may reorder a sum), or both are
#: within ABS_TOL of zero (a difference that cancels may leave a rounding residue instead of 0).
REL_TOL = 1e-12
ABS_TOL = 1e-18

SEQ_LEN = 65536
STACKS = ("sp-plan", "torchtitan", "hf-fsdp2")

#: (gpu, GPUs, GPUs per node) -> (model, layout degrees) pairs run on it.
GRID: dict[tuple[str, int, int], list[tuple[str, dict[str, int]]]] = {
    ("h100-80gb", 8, 8): [
        ("llama3-8b", {"ulysses": 8}),
        ("llama3-8b", {"ring": 8}),
        ("llama3-8b", {"ulysses": 2, "ring": 4}),
        ("llama3-8b", {"tp": 8}),
        ("llama3-8b", {"tp": 2, "ulysses": 2, "ring": 2}),
        ("llama3-8b", {"dp_shard": 8}),
        ("llama3-8b", {"dp_replicate": 2, "dp_shard": 2, "ulysses": 2}),
        ("qwen2.5-7b", {"tp": 2, "ulysses": 2, "dp_shard": 2}),
        ("qwen2.5-7b", {"dp_replicate": 8}),
        ("starcoder-15b", {"tp": 2, "ring": 4}),
    ],
    ("h100-80gb", 16, 8): [
        ("llama3-70b", {"ulysses": 8, "dp_shard": 2}),
        ("llama3-70b", {"ulysses": 4, "ring": 4}),
        ("llama3-70b", {"tp": 8, "ring": 2}),
        ("llama3-70b", {"dp_replicate": 2, "ulysses": 8}),
        ("llama3-8b", {"dp_replicate": 2, "tp": 2, "ulysses": 2, "ring": 2}),
        ("llama3-8b", {"ring": 16}),
        ("gpt3-6.7b", {"dp_replicate": 4, "dp_shard": 4}),
    ],
    ("a100-80gb", 8, 8): [
        ("gpt3-6.7b", {"ulysses": 4, "dp_shard": 2}),
        ("qwen2.5-7b", {"tp": 4, "ulysses": 1, "dp_shard": 2}),
        ("llama3-8b", {"ring": 4, "dp_replicate": 2}),
    ],
}

#: Train options per case (on top of ``seq_len=SEQ_LEN``); each (model, layout) runs all of them.
VARIANTS: list[dict[str, Any]] = [
    {},  # ZeRO-3, full checkpointing
    {"zero_stage": 0, "checkpointing": "none"},
    {"zero_stage": 1, "checkpointing": "selective", "grad_accum": 2},
    {"zero_stage": 2, "checkpointing": "full", "grad_accum": 3},
    {"zero_stage": 3, "offload_optimizer": True, "offload_params": True, "offload_checkpoints": True},
    {"zero_stage": 2, "offload_optimizer": True, "offload_checkpoints": True, "checkpointing": "selective",
     "grad_accum": 2},
    {"zero_stage": 3, "checkpointing": "selective", "tp_sequence_parallel": False, "tiled_mlp": True,
     "tiled_loss": True, "micro_batch": 2},
    {"mode": "prefill", "zero_stage": 3},
    {"mode": "prefill", "zero_stage": 0, "seq_len": 131072},
    {"zero_stage": 3, "optimizer": "adamw_bf16", "checkpointing": "none", "document_length": 4096,
     "compiled": True, "fp8_linears": True},
    {"zero_stage": 1, "attention_kernel": "materialized", "seq_len": 8192, "micro_batch": 2, "grad_accum": 2},
]

#: Planner settings whose answer is recorded: (name, model, gpu, GPUs, GPUs per node, train, stack).
PLANS: list[tuple[str, str, str, int, int, dict[str, Any], str]] = [
    ("llama3-8b train 128K on 8 H100", "llama3-8b", "h100-80gb", 8, 8, {"seq_len": 131072}, "sp-plan"),
    ("llama3-70b prefill 1M on 8 H100", "llama3-70b", "h100-80gb", 8, 8,
     {"seq_len": 1_000_000, "mode": "prefill"}, "sp-plan"),
    ("llama3-70b train 256K on 16 H100", "llama3-70b", "h100-80gb", 16, 8, {"seq_len": 262144}, "sp-plan"),
    ("qwen2.5-7b train 64K on 8 A100, torchtitan", "qwen2.5-7b", "a100-80gb", 8, 8, {"seq_len": 65536},
     "torchtitan"),
]


def cases() -> Iterator[tuple[str, str, tuple[str, int, int], dict[str, int], dict[str, Any], str]]:
    """(case id, model, (gpu, GPUs, per node), layout degrees, train options, stack), in a fixed order;
    the stack rotates over the cases so each stack meets every variant somewhere."""
    n = 0
    for hw, pairs in GRID.items():
        for model, degrees in pairs:
            for i, variant in enumerate(VARIANTS):
                stack = STACKS[n % len(STACKS)]
                n += 1
                layout = " ".join(f"{k}={v}" for k, v in degrees.items())
                yield (f"{hw[0]}x{hw[1]}/{model}/{layout}/v{i}/{stack}", model, hw, degrees, variant, stack)


def _case_figures(model_name: str, hw: tuple[str, int, int], degrees: dict[str, int], variant: dict[str, Any],
                  stack: str) -> dict[str, Any]:
    gpu, world, per_node = hw
    model = get_model_preset(model_name)
    topology = default_topology(gpu, world, per_node)
    profile = resolve_profile(gpu, stack)
    try:
        train = TrainSpec(**{"seq_len": SEQ_LEN, **variant})
        layout = Layout.for_world(world, **degrees)
        est = estimate(model, train, layout, topology, with_placement=False, profile=profile)
    except (CostModelError, ValueError) as exc:
        return {"error": str(exc)}
    t, c = est.time, est.comm
    scalars = ("compute_s", "comm_s", "exposed_comm_s", "optimizer_s", "offload_s", "interference_s", "overhead_s",
               "step_s", "tokens_per_step", "tokens_per_s", "mfu", "hfu", "model_flops_per_step", "peak_flops",
               "fabric_bytes_per_step")
    out: dict[str, Any] = {
        "time": {name: getattr(t, name) for name in scalars},
        "components": dict(t.components),
        "comm_s_by_strategy": dict(t.comm_s_by_strategy),
        "exposed_comm_s_by_strategy": dict(t.exposed_comm_s_by_strategy),
        "breakdown": dict(t.breakdown),
        "efficiencies": dict(t.efficiencies),
        "comm": {
            "per_step_bytes": c.per_step_bytes,
            "per_step_by_strategy": dict(c.per_step_by_strategy),
            "by_collective": dict(c.by_collective),
            "per_layer_bytes": {k: v.model_dump() for k, v in c.per_layer_bytes.items()},
            "per_layer_by_collective": {k: v.model_dump() for k, v in c.per_layer_by_collective.items()},
            "group_sizes": dict(c.group_sizes),
        },
        "memory_total": est.memory.total,
        "host_memory_total": est.host_memory.total,
        "fits": est.fits,
    }
    # The time model's own first-order offload estimate (what it prices when no memory figures are given).
    own = time_estimate(model, train, layout, topology, profile=profile)
    out["own_offload"] = {"step_s": own.step_s, "offload_s": own.offload_s, "optimizer_s": own.optimizer_s}
    if not train.is_training:
        out["attention_forward_s"] = attention_forward_seconds(model, train, layout, topology, profile)
    return out


def _plan_figures(model_name: str, gpu: str, world: int, per_node: int, train: dict[str, Any],
                  stack: str) -> dict[str, Any]:
    result = search(get_model_preset(model_name), TrainSpec(**train), default_topology(gpu, world, per_node),
                    PlanSettings(top_k=3, stack=stack))
    return {
        "plans": [
            {"layout": p.layout.degrees(), "options": p.options, "step_s": p.estimate.time.step_s, "score": p.score,
             "tokens_per_s": p.estimate.time.tokens_per_s}
            for p in result.plans
        ],
    }


def compute() -> dict[str, Any]:
    """Every golden figure, freshly computed."""
    return {
        "cases": {cid: _case_figures(m, hw, deg, var, st) for cid, m, hw, deg, var, st in cases()},
        "plans": {name: _plan_figures(m, gpu, world, per_node, train, stack)
                  for name, m, gpu, world, per_node, train, stack in PLANS},
    }


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where ``actual`` departs from ``expected``: missing or extra keys, other strings or booleans,
    numbers outside REL_TOL."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{path}/{k}: missing" for k in expected if k not in actual]
        out += [f"{path}/{k}: unexpected" for k in actual if k not in expected]
        for k in expected:
            if k in actual:
                out += differences(expected[k], actual[k], f"{path}/{k}")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{path}: {len(actual)} entries, expected {len(expected)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{path}[{i}]")]
    numbers = (int, float)
    if (isinstance(expected, numbers) and isinstance(actual, numbers)
            and not isinstance(expected, bool) and not isinstance(actual, bool)):
        if math.isclose(expected, actual, rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return []
        return [f"{path}: {actual!r}, expected {expected!r}"]
    return [] if expected == actual else [f"{path}: {actual!r}, expected {expected!r}"]


def dumps(figures: dict[str, Any]) -> str:
    """JSON with one case (or plan) per line: compact, and a moved figure shows as a one-line diff."""
    sections = []
    for name in sorted(figures):
        rows = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(figures[name].items())]
        sections.append(f"{json.dumps(name)}: {{\n" + ",\n".join(rows) + "\n }")
    return "{\n" + ",\n".join(sections) + "\n}\n"


def load() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regenerate", action="store_true", help=f"rewrite {FIXTURE.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    figures = compute()
    if args.regenerate:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(dumps(figures))
        print(f"wrote {FIXTURE.relative_to(ROOT)}: {len(figures['cases'])} cases, {len(figures['plans'])} plans")
        return 0
    diffs = differences(load(), json.loads(json.dumps(figures)))
    for line in diffs[:200]:
        print(line)
    print(f"{len(diffs)} figures moved")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
