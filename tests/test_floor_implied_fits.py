"""The search's floor answers some of its memory probes from earlier ones (sp_plan.planner.search.implied_fit):
a combination at or above one that fits fits too, one at or below one that does not fit does not. What it
infers must be what the memory model says (any model, sequence, layout and stack), so the floor, where the
walk starts and which bounds the branch, is the one that evaluates every probe."""

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sp_plan.cost_models.stack import stack_names
from sp_plan.planner.options import CHEAP_AXES, invalid_reason
from sp_plan.planner.search import implied_fit

from tests.search_checks import searcher_and_layouts

SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MODELS = ["llama3-8b", "qwen3-4b", "qwen3-30b-a3b"]
CLUSTERS = [8, 16]
SEQ_LENS = [4096, 32 * 1024, 128 * 1024, 256 * 1024]


def _every_probe_floor(s, layout, lattice, top):
    """The floor as it was before inference: every probe evaluated."""
    start = []
    for k, axis in enumerate(lattice.axes):
        if axis.name in CHEAP_AXES:
            start.append(0)
            continue
        chosen = top[k]
        for v in range(top[k]):
            probe = lattice.repair_down(top[:k] + (v,) + top[k + 1:], keep=k)
            if invalid_reason(lattice.values(probe)):
                continue
            if s.saving_fits(layout, lattice.values(probe)):
                chosen = v
                break
        start.append(chosen)
    return lattice.repair_up(tuple(start))


@SETTINGS
@given(name=st.sampled_from(MODELS), gpus=st.sampled_from(CLUSTERS), seq=st.sampled_from(SEQ_LENS),
       stack=st.sampled_from(stack_names()), pick=st.randoms(use_true_random=False))
def test_what_the_floor_infers_is_what_the_memory_model_says(name, gpus, seq, stack, pick):
    """Over random branches: every valid combination's fit as implied by every other evaluated one agrees with
    its own evaluation, and the floor with inference is the floor that evaluates every probe."""
    s, layouts = searcher_and_layouts(name, gpus, seq, stack)
    for layout in pick.sample(layouts, min(3, len(layouts))):
        branches = s.lattices(layout)
        for lattice in pick.sample(branches, min(2, len(branches))):
            combos = [c for c in itertools.product(*(range(len(a.values)) for a in lattice.axes))
                      if not invalid_reason(lattice.values(c)) and not s.pipeline_invalid(layout, lattice.values(c))]
            combos = pick.sample(combos, min(24, len(combos)))
            decided = [(c, s.saving_fits(layout, lattice.values(c))) for c in combos]
            for combo, fits in decided:
                others = [d for d in decided if d[0] != combo]
                assert implied_fit(lattice, combo, others) in (None, fits), (layout.describe(), combo)
            top = s.most_saving_valid(lattice)
            assert s.floor(layout, lattice, top) == _every_probe_floor(s, layout, lattice, top), layout.describe()


def test_the_floor_infers_the_parameter_offload_probe():
    """llama3-8b at 128K on 8 H100s: the optimizer-offload probe, which drops the parameter offload too, fits on
    some branch, so the parameter-offload probe above it is inferred instead of evaluated."""
    s, layouts = searcher_and_layouts("llama3-8b", 8, 128 * 1024, "sp-plan")
    inferred = 0
    for layout in layouts:
        for lattice in s.lattices(layout):
            top = s.most_saving_valid(lattice)
            before = s.memory_evals
            floor = s.floor(layout, lattice, top)
            evaluated = s.memory_evals - before
            before = s.memory_evals
            assert floor == _every_probe_floor(s, layout, lattice, top)
            inferred += (s.memory_evals - before) - evaluated
    assert inferred > 0


def _walks(s, layouts, pick):
    """Every sampled branch's floor and walk result (combination and score, or None and whether it ran out)."""
    out = []
    for layout in layouts:
        for lattice in pick.sample(s.lattices(layout), min(3, len(s.lattices(layout)))):
            top = s.most_saving_valid(lattice)
            if not s.device_fits(s.memory(layout, s.train_for(layout, lattice.values(top)))):
                continue
            start = s.timed(layout, s.floor(layout, lattice, top), lattice)
            best = s.best_for(layout, lattice, start, float("inf"))
            out.append((layout, start.combo, None if best is None else (best.combo, best.score), s.exhausted))
    return out


@SETTINGS
@given(name=st.sampled_from(MODELS), gpus=st.sampled_from(CLUSTERS), seq=st.sampled_from(SEQ_LENS),
       stack=st.sampled_from(stack_names()), pick=st.randoms(use_true_random=False))
def test_the_walk_returns_what_it_returns_without_inference(name, gpus, seq, stack, pick):
    """The walk also infers (a popped combination below a closure that does not fit is not evaluated, a
    closure above a fitting pop is not either): the same starts and results as with every one evaluated."""
    import random

    from sp_plan.planner import search as search_module

    s, layouts = searcher_and_layouts(name, gpus, seq, stack)
    layouts = pick.sample(layouts, min(4, len(layouts)))
    seed = pick.random()
    inferred = _walks(s, layouts, random.Random(seed))
    plain, _ = searcher_and_layouts(name, gpus, seq, stack)
    original = search_module.implied_fit
    search_module.implied_fit = lambda *args: None
    try:
        evaluated = _walks(plain, layouts, random.Random(seed))
    finally:
        search_module.implied_fit = original
    assert inferred == evaluated
    assert s.memory_evals <= plain.memory_evals
