"""The compute-only step floor (sp_plan.cost_models.step_floor) is a lower bound, which is what keeps the
planner exact when branches enter its branch and bound on it: below the full step of the same options (any
layout, option combination, schedule and stack), and below every combination of a search branch."""

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.stack import stack_names
from sp_plan.cost_models.step_floor import step_floor
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.options import invalid_reason
from sp_plan.planner.search import PlanSettings, _Searcher
from sp_plan.planner.space import layout_space

from tests.search_checks import searcher_and_layouts

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Dense, grouped-query and mixture-of-experts (with expert parallelism in the layouts) models.
MODELS = ["llama3-8b", "qwen3-4b", "qwen3-30b-a3b"]
CLUSTERS = [(8, 8), (16, 8), (32, 8)]
SEQ_LENS = [4096, 32 * 1024, 128 * 1024]


@SETTINGS
@given(name=st.sampled_from(MODELS), cluster=st.sampled_from(CLUSTERS), seq=st.sampled_from(SEQ_LENS),
       stack=st.sampled_from(stack_names()), pick=st.randoms(use_true_random=False))
def test_the_floor_never_exceeds_the_full_step(name, cluster, seq, stack, pick):
    """For a random layout and random valid options (schedule and chunks included under PP): the floor under
    the options' own schedule is at most the step the full time model gives them."""
    gpus, _ = cluster
    s, layouts = searcher_and_layouts(name, gpus, seq, stack)
    for layout in pick.sample(layouts, min(4, len(layouts))):
        lattice = s.lattice(layout)
        combos = [c for c in itertools.product(*(range(len(a.values)) for a in lattice.axes))
                  if not invalid_reason(lattice.values(c)) and not s.pipeline_invalid(layout, lattice.values(c))]
        for combo in pick.sample(combos, min(6, len(combos))):
            scored = s.timed(layout, combo, lattice)
            train = scored.train
            floor = step_floor(s.model, train, layout, s.topology, s.profile)
            schedule = train.pipeline_schedule if layout.pp > 1 else None
            assert floor.step_s(schedule, train.virtual_stages) <= scored.time.step_s, (layout.describe(), combo)
            assert floor.tokens_per_step == scored.time.tokens_per_step


@SETTINGS
@given(name=st.sampled_from(MODELS), cluster=st.sampled_from(CLUSTERS), seq=st.sampled_from(SEQ_LENS),
       stack=st.sampled_from(stack_names()), pick=st.randoms(use_true_random=False))
def test_a_branch_floor_bounds_every_combination_of_the_branch(name, cluster, seq, stack, pick):
    """What the search prunes on: a branch's floor is at most its timed bound (the bottom's step, or the
    pipelined layout's bound) and at most the score of every valid combination in the branch."""
    gpus, _ = cluster
    s, layouts = searcher_and_layouts(name, gpus, seq, stack)
    for layout in pick.sample(layouts, min(3, len(layouts))):
        branches = s.lattices(layout)
        for lattice in pick.sample(branches, min(3, len(branches))):
            floor = s.floor_bound(layout, lattice)
            timed = s.pipeline_bound(layout, lattice) if layout.pp > 1 else s.bottom_bound(layout, lattice)
            assert floor <= timed, (layout.describe(), lattice)
            scores = [scored.score for combo in itertools.product(*(range(len(a.values)) for a in lattice.axes))
                      if (scored := s.timed(layout, combo, lattice)) is not None]
            assert all(floor <= score for score in scores), (layout.describe(), lattice)


def test_the_floor_is_shared_by_data_parallel_splits_and_prunes_a_large_search():
    """Layouts that split data parallelism differently share one floor, and at 512 GPUs most branches are
    pruned on it without a time evaluation (the counts are deterministic)."""
    model = get_model_preset("llama3-70b")
    topology = default_topology("h100-80gb", 512, 8)
    train = TrainSpec(seq_len=1 << 20)
    s = _Searcher(model, train, topology, PlanSettings(), None)
    layouts = [layout for layout in layout_space(512, model, train, 8).layouts if layout.model_degrees()
               == (1, 8, 1, 4, 1)]
    assert len(layouts) > 2
    for layout in layouts:
        for lattice in s.lattices(layout):
            s.floor_bound(layout, lattice)
    assert s.floor_evals == 1
