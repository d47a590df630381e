"""Golden answers of the planner, to prove a refactor or a speed-up of the search and the cost models moves none.

A few small, varied workloads (dense, pipeline, mixture-of-experts, a length distribution, prefill, a stack other
than the default, one that fits nowhere) run through ``sp-plan plan --json`` in-process, and the whole output is
recorded: the top plans with their layouts, options, memory, communication, step-time components, tokens/s, the
rejections, the no-fit advice. Only ``stats`` is left out (evaluation counts and seconds say how the search got
there, not what it answered).

    python tests/planner_outputs_golden.py --regenerate   # rewrite tests/data/planner_outputs_golden.json
    python tests/planner_outputs_golden.py                # compare, print the workloads whose output moved

The comparison is exact (the JSON text of each workload, byte for byte): regenerate only for an intended change of
the planner's answers, and say so in the commit. ``tests/test_planner_outputs_golden.py`` runs the comparison.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from click.testing import CliRunner  # noqa: E402

from sp_plan.cli.main import cli  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "planner_outputs_golden.json"

#: name -> the arguments of ``sp-plan plan`` (``--json`` is added). Small, so the whole set runs in a few seconds.
WORKLOADS: dict[str, list[str]] = {
    "dense-8b-32k-8": ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "32K"],
    "dense-70b-128k-16-pipeline": ["--model", "llama3-70b", "--gpus", "16", "--seq-len", "128K", "--pp", "2"],
    "moe-qwen3-30b-8k-16-ep8": ["--model", "qwen3-30b-a3b", "--gpus", "16", "--seq-len", "8K", "--ep", "8"],
    "lengths-8b-64k-8-long-doc-mix": ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "64K",
                                      "--lengths", "long-doc-mix"],
    "prefill-8b-256k-8": ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "256K", "--mode", "prefill"],
    "torchtitan-qwen2.5-7b-64k-8-a100": ["--model", "qwen2.5-7b", "--gpus", "8", "--seq-len", "64K",
                                         "--gpu", "a100-80gb", "--stack", "torchtitan"],
    "nofit-70b-1m-1": ["--model", "llama3-70b", "--gpus", "1", "--seq-len", "1M"],
}


def run(args: list[str]) -> dict[str, Any]:
    """One workload's ``plan --json`` answer without ``stats``, and its exit code."""
    result = CliRunner().invoke(cli, ["plan", *args, "--json"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    try:
        out = json.loads(result.output)
    except json.JSONDecodeError:
        return {"exit_code": result.exit_code, "text": result.output}
    out.pop("stats", None)
    return {"exit_code": result.exit_code, "output": out}


def compute(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    return {name: run(WORKLOADS[name]) for name in (names or WORKLOADS)}


def load() -> dict[str, dict[str, Any]]:
    return json.loads(FIXTURE.read_text())


def canonical(answer: dict[str, Any]) -> str:
    """The text a workload's answer is compared by (exact: floats print their shortest round-trip repr)."""
    return json.dumps(answer, indent=1, sort_keys=True, allow_nan=True)


def differences(golden: dict[str, dict[str, Any]], fresh: dict[str, dict[str, Any]]) -> list[str]:
    moved = [f"{name}: missing" for name in golden if name not in fresh]
    moved += [f"{name}: not in the fixture" for name in fresh if name not in golden]
    for name in golden.keys() & fresh.keys():
        if canonical(golden[name]) != canonical(fresh[name]):
            moved.append(f"{name}: {_first_difference(golden[name], fresh[name])}")
    return sorted(moved)


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b or canonical_value(a[key]) != canonical_value(b[key]):
                if key not in a or key not in b:
                    return f"{path}/{key} only in {'fresh' if key not in a else 'golden'}"
                return _first_difference(a[key], b[key], f"{path}/{key}")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries, now {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if canonical_value(x) != canonical_value(y):
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {a!r} -> {b!r}"


def canonical_value(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regenerate", action="store_true", help=f"rewrite {FIXTURE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    fresh = {}
    for name in WORKLOADS:
        start = time.process_time()
        fresh[name] = run(WORKLOADS[name])
        print(f"{name}: exit {fresh[name]['exit_code']}, {time.process_time() - start:.2f} CPU s", file=sys.stderr)
    if args.regenerate:
        FIXTURE.write_text(json.dumps(fresh, indent=1, sort_keys=True, allow_nan=True) + "\n")
        print(f"wrote {FIXTURE.relative_to(ROOT)} ({len(fresh)} workloads)")
        return 0
    moved = differences(load(), fresh)
    print("\n".join(moved) if moved else f"all {len(fresh)} workloads answer as recorded")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
