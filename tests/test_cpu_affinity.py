"""CPU ranks are pinned to their share of the cores at process-group start (runtime/cpu_affinity.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sp_plan.runtime.cpu_affinity import rank_cores


def test_ranks_split_the_allowed_cores_and_share_them_round_robin_when_fewer():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [rank_cores(cores, r, 2) for r in range(2)] == [{0, 1, 2, 3}, {4, 5, 6, 7}]  # threads stay together
    assert [rank_cores(cores, r, 3) for r in range(3)] == [{0, 1}, {2, 3}, {4, 5}]
    assert [rank_cores([2, 3], r, 4) for r in range(4)] == [{2}, {3}, {2}, {3}]  # a narrowed set, oversubscribed
    for world in range(1, 20):  # every rank gets at least one allowed core; no core goes to two ranks unless short
        got = [rank_cores(cores, r, world) for r in range(world)]
        assert all(g and g <= set(cores) for g in got)
        if world <= len(cores):
            assert sum(len(g) for g in got) == len(set().union(*got))


SCRIPT = """
import json, os
from sp_plan.runtime.distributed import init_distributed
init_distributed("cpu")
print(json.dumps({"rank": int(os.environ["RANK"]), "cores": sorted(os.sched_getaffinity(0))}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity API on this platform")
@pytest.mark.parametrize("switch, pinned", [(None, True), ("0", False)])
def test_torchrun_cpu_ranks_are_pinned_unless_switched_off(tmp_path, switch, pinned):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("SP_PLAN_CPU_AFFINITY", None)
    if switch is not None:
        env["SP_PLAN_CPU_AFFINITY"] = switch
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[int, list[int]] = {}
    for text in re.findall(r"\{[^{}]*\}", run.stdout):  # the two ranks' lines may interleave
        d = json.loads(text)
        seen[d["rank"]] = d["cores"]
    assert sorted(seen) == [0, 1]
    if not pinned:
        assert seen[0] == seen[1] == allowed
    else:
        assert [set(seen[r]) for r in (0, 1)] == [rank_cores(allowed, r, 2) for r in (0, 1)]
