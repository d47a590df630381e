"""The option walk times a combination only when it pops (planner/search.py ``best_for``): successors enter
the queue on a lower bound of their score. These tests check what keeps that exact: the keys never exceed
the scores they stand for (without assuming that time never shrinks up the lattice: under some stacks one
step up can be a hair faster), and the lazy walk returns what an eager walk (every successor timed on
entry, as the walk did before) returns."""

import heapq
import itertools
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sp_plan.cost_models.stack import stack_names
from sp_plan.planner.options import invalid_reason, moving_parts
from sp_plan.planner.search import _Searcher

from tests.search_checks import searcher_and_layouts

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MODELS = ["llama3-8b", "qwen3-4b", "qwen3-30b-a3b"]
CLUSTERS = [8, 16]
SEQ_LENS = [4096, 32 * 1024, 128 * 1024]


def _valid(s: _Searcher, layout, lattice) -> list[tuple[int, ...]]:
    return [c for c in itertools.product(*(range(len(a.values)) for a in lattice.axes))
            if not invalid_reason(lattice.values(c)) and not s.pipeline_invalid(layout, lattice.values(c))]


def _eager_walk(s: _Searcher, layout, lattice, start, bound: float):
    """The walk as it was before successors were timed lazily: every successor timed when pushed (queued on the
    bound of it and its descendants; a fitting selective combination waits, at its own score, for its full-
    checkpointing successors, which the near-tie rule can rank ahead of it)."""
    tiebreak = itertools.count()
    queue = [(s.descendant_bound(layout, lattice, start), next(tiebreak), False, start)]
    seen = {start.combo}
    closure_fits = {}

    def push(combo):
        if combo in seen:
            return
        seen.add(combo)
        scored = s.timed(layout, combo, lattice)
        if scored is None:
            for deeper in lattice.successors(combo):
                push(deeper)
            return
        heapq.heappush(queue, (s.descendant_bound(layout, lattice, scored), next(tiebreak), False, scored))

    while queue:
        score, order, final, item = heapq.heappop(queue)
        if score > bound:
            return None, False
        if final:
            return item, False
        if s.fits(item.report):
            if score == item.score:
                return item, False
            heapq.heappush(queue, (item.score, order, True, item))
        closure = lattice.cheap_closure(item.combo)
        if closure not in closure_fits:
            closure_fits[closure] = s.saving_fits(layout, lattice.values(closure))
        for nxt in (lattice.successors if closure_fits[closure] else lattice.expensive_successors)(item.combo):
            push(nxt)
    return None, True


@SETTINGS
@given(name=st.sampled_from(MODELS), gpus=st.sampled_from(CLUSTERS), seq=st.sampled_from(SEQ_LENS),
       stack=st.sampled_from(stack_names()), pick=st.randoms(use_true_random=False))
def test_walk_keys_never_exceed_the_scores_they_stand_for(name, gpus, seq, stack, pick):
    """A combination's key (its compute-only floor per token, with its moving parts) is at most its score,
    for every valid combination of sampled branches, pipelined ones included."""
    s, layouts = searcher_and_layouts(name, gpus, seq, stack)
    penalty = s.settings.tie_penalty
    for layout in pick.sample(layouts, min(3, len(layouts))):
        branches = s.lattices(layout)
        for lattice in pick.sample(branches, min(2, len(branches))):
            for combo in _valid(s, layout, lattice):
                options = lattice.values(combo)
                parts = s.layout_parts(layout) + moving_parts(options) - s.near_tie_parts(lattice, options)
                key = s.combination_floor(layout, options) * (1 + penalty * parts)
                assert key <= s.timed(layout, combo, lattice).score, (layout.describe(), options)


@SETTINGS
@given(name=st.sampled_from(MODELS), gpus=st.sampled_from(CLUSTERS), seq=st.sampled_from(SEQ_LENS),
       stack=st.sampled_from(stack_names()), pick=st.randoms(use_true_random=False),
       cut=st.floats(min_value=1.0, max_value=1.3))
def test_the_lazy_walk_returns_what_the_eager_walk_returns(name, gpus, seq, stack, pick, cut):
    """From the same start and under the same bound (none, or a cut-off ``cut`` times the start's score),
    the same combination, or None for the same reason."""
    s, layouts = searcher_and_layouts(name, gpus, seq, stack)
    for layout in pick.sample(layouts, min(3, len(layouts))):
        for lattice in s.lattices(layout):
            top = s.most_saving_valid(lattice)
            if not s.device_fits(s.memory(layout, s.train_for(layout, lattice.values(top)))):
                continue
            start = s.timed(layout, s.floor(layout, lattice, top), lattice)
            for bound in (math.inf, start.score * cut):
                expected, exhausted = _eager_walk(s, layout, lattice, start, bound)
                got = s.best_for(layout, lattice, start, bound)
                assert s.exhausted == exhausted, (layout.describe(), bound)
                if expected is None:
                    assert got is None, (layout.describe(), bound)
                else:
                    assert got is not None and got.combo == expected.combo and got.score == expected.score
