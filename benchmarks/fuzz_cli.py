"""Thousands of hostile ``sp-plan`` runs (issue 35 "Done when": a 5,000-run fuzz with zero tracebacks, zero
exit-0 failures, zero non-JSON ``--json`` outputs and no run over 60 s of CPU).

The CI suite runs a derandomized few hundred (tests/test_fuzz_cli.py, tests/test_fuzz_round_two.py); this
draws ``--runs`` at random (seeded, so a failing run is reproduced by its number) from the same hostile
material: numbers, files, inline GPU specs, 5,000-digit integers, hostile model names in plan files for
every exporter, and edited plans and topologies. Each run goes through the real entry point in-process
(:func:`sp_plan.cli.main.main`, what the console script runs) in a worker process; an exception escaping it
is a traceback for a user. Counted per run: the exit code (0, 1, 2 allowed), a traceback, an exit 0 whose
stderr says ``error:``, a ``--json`` answer that is not strict JSON or holds a non-finite figure, and the
run's CPU seconds.

    python benchmarks/fuzz_cli.py --runs 5000 --workers 2     # about 30-60 minutes on 2 cores
    python benchmarks/fuzz_cli.py --runs 200 --seed 7          # a quick look
    python benchmarks/fuzz_cli.py --replay 1234                # one run, its arguments and output
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Over this many CPU seconds a run fails the target.
CPU_LIMIT_S = 60.0
HUGE_INT = "9" * 5000
MODELS = ["llama3-8b", "qwen3-4b", "mistral-7b", "mixtral-8x7b", "qwen3-30b-a3b", "gemma-2-9b", "nosuch", ""]
NAMES = ["$(touch PWNED)", "`id`", "a\nb", "'; rm -rf ~; '", '"q"', "x\x00y", "\x1b[2J", "--help", "-", "a b",
         "{{x}}", "*", "!!python/object", "ü" * 300, "", " ", "${HOME}", "$((1/0))"]
PHYSICAL = [0, -1, 1e-300, 1e300, float("inf"), float("nan"), "fast", None, [1], True, 3.0e12, 9.0e14, 80 << 30]


class Workspace:
    """Hostile files (written once per worker) and a valid plan to edit."""

    def __init__(self, root: Path) -> None:
        import yaml

        from sp_plan.cost_models.data import load
        from tests.test_fuzz_cli import HOSTILE_FILES, run_cli

        self.root = root
        self.files = {}
        for name, content in HOSTILE_FILES.items():
            self.files[name] = root / f"{name}.yaml"
            self.files[name].write_bytes(content)
        self.files["missing"] = root / "missing.yaml"
        self.topology = load("topologies", "dgx-h100")
        plan = root / "plan.yaml"
        code, _, err = run_cli(["plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--top", "1",
                                "--out", plan])
        assert code == 0, err
        self.plan = yaml.safe_load(plan.read_text())
        self.count = 0

    def file(self, text: str, suffix: str = ".yaml") -> Path:
        self.count += 1
        path = self.root / f"f{self.count}{suffix}"
        path.write_text(text)
        return path


def _number(rng: random.Random, plausible: bool = False) -> str:
    from tests.test_fuzz_cli import HOSTILE_NUMBERS

    if plausible or rng.random() < 0.6:
        return rng.choice(["1", "2", "4", "8", "16", "64", "4K", "32K", "128K", "1M", "8K"])
    return rng.choice([*HOSTILE_NUMBERS, HUGE_INT, "9" * 400, str(rng.randint(-5, 1 << 22))])


def _gpu_topology(ws: Workspace, rng: random.Random) -> Path:
    import yaml

    gpu = {"name": rng.choice(["x", *NAMES[:6]]), "memory_bytes": rng.choice(PHYSICAL),
           "peak_flops": {rng.choice(["bf16", "fp8", "fp32", "bogus"]): rng.choice(PHYSICAL)},
           "memory_bandwidth": rng.choice(PHYSICAL)}
    text = yaml.safe_dump({**ws.topology, "name": "fz", "gpu": gpu})
    if rng.random() < 0.2:
        text = text.replace("bandwidth: ", f"bandwidth: {HUGE_INT} #", 1)
    return ws.file(text)


def _edited_plan(ws: Workspace, rng: random.Random) -> Path:
    import yaml

    plan = copy.deepcopy(ws.plan)
    what = rng.choice(["name", "name", "layout", "train", "model", "huge", "cut"])
    if what == "name":
        plan["model"]["name"] = rng.choice(NAMES)
    elif what == "layout":
        plan["layout"][rng.choice(list(plan["layout"]))] = rng.choice([0, -1, 3, 1 << 20, "x", None])
    elif what == "train":
        plan["train"][rng.choice(list(plan["train"]))] = rng.choice([0, -1, 1 << 40, "x", None, float("nan")])
    elif what == "model":
        plan["model"][rng.choice(list(plan["model"]))] = rng.choice([0, -1, 1 << 40, "x", None, 3])
    text = yaml.safe_dump(plan)
    if what == "huge":
        text = text.replace("seq_len: ", f"seq_len: {HUGE_INT} #", 1)
    elif what == "cut":
        text = text[: rng.randint(0, len(text))]
    return ws.file(text)


def draw(ws: Workspace, rng: random.Random) -> list[Any]:
    """One run's arguments."""
    kind = rng.choice(["estimate", "estimate", "plan", "capacity", "topo", "export", "export", "calibrate",
                       "lengths"])
    plausible = rng.random() < 0.5  # half the runs reach the cost models with valid values (their answers checked)
    model = rng.choice(MODELS[:6] if plausible else MODELS)
    json_flag = ["--json"] if rng.random() < 0.6 else []
    topology: list[Any] = []
    if plausible:
        topology = ["--topology", "dgx-h100"] if rng.random() < 0.5 else []
    elif rng.random() < 0.5:
        topology = ["--topology", _gpu_topology(ws, rng)]
    elif rng.random() < 0.3:
        topology = ["--topology", ws.files[rng.choice(list(ws.files))]]
    if kind == "estimate":
        degree = rng.choice(["--ulysses", "--ring", "--tp", "--dp-shard", "--pp", "--ep"])
        value = rng.choice(["1", "2", "4", "8"]) if plausible else _number(rng)
        gpus = rng.choice(["8", "16", "32"]) if plausible else _number(rng)
        return ["estimate", "--model", model, "--seq-len", _number(rng, plausible), "--gpus", gpus, degree,
                value, *topology, *json_flag]
    if kind == "plan":
        return ["plan", "--model", rng.choice(["llama3-8b", "qwen3-4b", "mistral-7b", "nosuch"]), "--seq-len",
                _number(rng, plausible), "--gpus", rng.choice(["8", "16", "2", _number(rng, plausible)]), "--top", "1",
                *topology, *json_flag]
    if kind == "capacity":
        return ["capacity", "--model", rng.choice(["llama3-8b", "qwen3-4b"]), "--gpus",
                rng.choice(["8", _number(rng)]), *topology, *json_flag]
    if kind == "lengths":
        return _lengths_run(ws, rng, plausible, json_flag)
    if kind == "topo":
        source = topology[1] if topology else rng.choice(["dgx-h100", "dgx-h100@efa:1e9", "nosuch"])
        return ["topo", "show", source, *json_flag]
    if kind == "export":
        target = rng.choice(["megatron", "torchrun", "accelerate", "deepspeed"])
        return ["export", _edited_plan(ws, rng), "--to", target, *(["--json"] if rng.random() < 0.3 else [])]
    rows = "\n".join(",".join(rng.choice(["llama3-8b", "8", "32768", "2.5", _number(rng), ""]) for _ in range(6))
                     for _ in range(rng.randint(0, 3)))
    if plausible:  # valid measured runs (one fits, two or three calibrate), perhaps beside the hostile rows
        valid = [f"llama3-8b,{seq},8,{u},dgx-h100,{rng.uniform(0.5, 9):.3f}" for seq, u in
                 rng.sample([(32768, 8), (65536, 8), (131072, 8), (32768, 4), (65536, 2)], rng.randint(1, 3))]
        rows = "\n".join(valid + ([rows] if rows and rng.random() < 0.3 else []))
    runs = ws.file("model,seq_len,gpus,ulysses,topology,step_s\n" + rows + "\n", ".csv")
    return ["calibrate", runs, "--out", ws.root / "cal.yaml", *json_flag]


def _lengths_run(ws: Workspace, rng: random.Random, plausible: bool, json_flag: list[str]) -> list[Any]:
    """``lengths --show`` or a planning command with ``--lengths``: a preset, valid rows, or hostile ones."""
    cells = ["512", "1", "131072", "0", "-1", "1e9", HUGE_INT, "nan", "", "x", "2.5", str(1 << 62)]
    if plausible and rng.random() < 0.4:
        source: Any = rng.choice(["sft-short", "long-doc-mix"])
    else:
        rows = [f"{rng.choice(cells) if not plausible else rng.randint(1, 1 << 20)},"
                f"{rng.choice(cells) if not plausible else rng.randint(1, 10_000)}" for _ in range(rng.randint(0, 6))]
        header = "length,count" if plausible or rng.random() < 0.7 else rng.choice(["count", "", "len,count"])
        source = ws.file("\n".join([header, *rows]) + "\n", ".csv")
    if rng.random() < 0.4:
        return ["lengths", "--show", source, *json_flag]
    command = rng.choice(["plan", "estimate", "capacity"])
    data = ["--lengths", source, "--packing", rng.choice(["stream", "first_fit", "sorted"]),
            "--sharding", rng.choice(["auto", "zigzag", "per_document", "contiguous"])]
    if command == "plan":
        return ["plan", "--model", "llama3-8b", "--seq-len", rng.choice(["32K", "128K"]), "--gpus", "8", "--top", "1",
                *data, *json_flag]
    if command == "estimate":
        return ["estimate", "--model", "llama3-8b", "--seq-len", "64K", "--gpus", "8",
                rng.choice(["--ulysses", "--ring"]), "8", *data, *json_flag]
    return ["capacity", "--model", "llama3-8b", "--gpus", "8", *data, *json_flag]


def _strict_json(text: str) -> str | None:
    """Why ``text`` is not a sane strict-JSON answer, or None."""
    def constant(name: str) -> None:
        raise ValueError(f"non-JSON constant {name}")

    try:
        data = json.loads(text, parse_constant=constant)
    except ValueError as exc:
        return str(exc)[:120]
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float) and not math.isfinite(item):
            return "non-finite number"
    return None


_WS: Workspace | None = None


def _init_worker(root: str) -> None:
    global _WS
    worker = Path(root) / f"w{multiprocessing.current_process().pid}"
    worker.mkdir()
    _WS = Workspace(worker)


def run_one(index: int, seed: int) -> dict[str, Any]:
    from tests.test_fuzz_cli import run_cli

    rng = random.Random(seed * 1_000_003 + index)
    args = draw(_WS, rng)
    start = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter()
    problem = None
    try:
        code, stdout, stderr = run_cli(args)
    except BaseException as exc:  # noqa: BLE001 - escaping main() is the traceback a user would see
        if isinstance(exc, KeyboardInterrupt):
            raise
        code, stdout, stderr = -1, "", f"{type(exc).__name__}: {str(exc)[:300]}"
        problem = "traceback"
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    if problem is None:
        if "Traceback" in stderr or "Traceback" in stdout:
            problem = "traceback"
        elif code not in (0, 1, 2):
            problem = f"exit {code}"
        elif code == 0 and "error:" in stderr:
            problem = "exit-0 failure"
        elif code == 0 and "--json" in [str(a) for a in args] and stdout.strip():
            why = _strict_json(stdout)
            problem = f"non-JSON --json ({why})" if why else None
        elif code == 2 and stderr.startswith("error: ") and stderr.count("\n") > 1:
            problem = "multi-line error"
        if problem is None and cpu > CPU_LIMIT_S:
            problem = f"over {CPU_LIMIT_S:.0f} s CPU"
    return {"index": index, "command": str(args[0]) if args else "", "code": code, "cpu_s": cpu,
            "wall_s": time.perf_counter() - wall, "problem": problem,
            "args": [str(a)[:200] for a in args] if problem else None, "stderr": stderr[-600:] if problem else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--replay", type=int, default=None, help="run one index in this process and print it")
    parser.add_argument("--out", type=Path, default=None, help="write every run's record as JSON lines here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay is not None:
            _init_worker(tmp)
            print(json.dumps(run_one(args.replay, args.seed), indent=1))
            return 0
        started = time.perf_counter()
        records = []
        with multiprocessing.get_context("forkserver").Pool(args.workers, _init_worker, (tmp,),
                                                            maxtasksperchild=200) as pool:
            for record in pool.starmap(run_one, [(i, args.seed) for i in range(args.runs)], chunksize=4):
                records.append(record)
        elapsed = time.perf_counter() - started
    if args.out is not None:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    by_command = Counter(r["command"] for r in records)
    codes = Counter((r["command"], r["code"]) for r in records)
    problems = [r for r in records if r["problem"]]
    print(f"{'command':<10} {'runs':>6} {'exit 0':>7} {'exit 1':>7} {'exit 2':>7} {'max CPU s':>10} {'problems':>9}")
    for command in sorted(by_command):
        mine = [r for r in records if r["command"] == command]
        print(f"{command:<10} {by_command[command]:>6} {codes[(command, 0)]:>7} {codes[(command, 1)]:>7} "
              f"{codes[(command, 2)]:>7} {max(r['cpu_s'] for r in mine):>10.2f} "
              f"{sum(1 for r in mine if r['problem']):>9}")
    kinds = Counter(r["problem"].split(" (")[0] for r in problems)
    print(f"\n{len(records)} runs in {elapsed:.0f} s (seed {args.seed}); problems: {dict(kinds) or 'none'}")
    for r in problems[:20]:
        print(f"  run {r['index']}: {r['problem']}: {' '.join(r['args'])[:300]}\n    {r['stderr']!r}")
    print("verdict:", "PASS" if not problems else "FAIL")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
