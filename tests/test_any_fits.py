"""The feasibility probes' untimed walk (``_Searcher.any_fits``) answers "does any combination fit device and
host memory" exactly as the timed best-first walk (``best_for`` with no bound) does, on layouts whose most saving
options fit the device but overflow the host: the case where it replaced the timed walk."""

from __future__ import annotations

import math

import pytest

from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.space import layout_space
from sp_plan.planner.search import PlanSettings, _Searcher

#: (model, GPUs, sequence length, stack, host bytes per GPU allowed for offloads): host limits tight enough
#: that the most saving options overflow them on some layouts, loose enough that a smaller offload fits on others.
CASES = [
    ("llama3-8b", 1, 262144, "sp-plan", 60e9),
    ("llama3-8b", 2, 524288, "hf-deepspeed", 40e9),
    ("llama3-70b", 8, 131072, "sp-plan", 60e9),
    ("llama3-70b", 8, 65536, "hf-deepspeed", 100e9),
    ("qwen3-30b-a3b", 8, 131072, "sp-plan", 30e9),
]


@pytest.mark.parametrize("model_name,gpus,seq,stack,host", CASES)
def test_the_untimed_walk_agrees_with_the_timed_walk(model_name, gpus, seq, stack, host):
    model = get_model_preset(model_name)
    train = TrainSpec(seq_len=seq)
    topology = default_topology("h100-80gb", gpus, min(gpus, 8))
    s = _Searcher(model, train, topology, PlanSettings(stack=stack, max_offload_bytes=host), None)
    answers = []
    for layout in layout_space(gpus, model, train, topology.gpus_per_node).layouts:
        for lattice in s.lattices(layout):
            top = s.most_saving_valid(lattice)
            core = s.memory(layout, s.train_for(layout, lattice.values(top)))
            if not s.device_fits(core) or s.fits(core):
                continue  # the probe asks the walk only where the host alone overflows
            start = s.timed(layout, s.floor(layout, lattice, top), lattice)
            timed = s.best_for(layout, lattice, start, math.inf) is not None
            assert s.any_fits(layout, lattice, top) == timed, (layout.describe(), lattice.values(top))
            answers.append(timed)
    assert answers, "no layout overflowed the host: the case exercises nothing"
    print(f"{len(answers)} layouts, {sum(answers)} with a fitting combination")
