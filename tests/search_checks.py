"""The planner's exactness check, shared by the tests that make it under different layouts and stacks, and the
searcher those tests build."""

from __future__ import annotations

import pytest
from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.search import PlanSettings, SearchResult, _Searcher, brute_force_best, search
from sp_plan.planner.space import layout_space


def assert_search_equals_brute_force(model, train, topology, settings) -> SearchResult:
    """The search's best plan scores exactly what brute force finds (or neither finds a plan)."""
    best_score, _, _, _ = brute_force_best(model, train, topology, settings)
    result = search(model, train, topology, settings)
    if best_score == float("inf"):
        assert not result.plans
    else:
        assert result.plans[0].score == pytest.approx(best_score, rel=1e-12)
    return result


def searcher_and_layouts(name: str, gpus: int, seq: int, stack: str) -> tuple[_Searcher, list]:
    """A searcher for model preset ``name`` at ``seq`` tokens on ``gpus`` H100s under ``stack``, and the layouts
    of that world the stack can run (what the floor and walk-key tests sample from)."""
    model = get_model_preset(name)
    topology = default_topology("h100-80gb", gpus, min(8, gpus))
    train = TrainSpec(seq_len=seq)
    s = _Searcher(model, train, topology, PlanSettings(stack=stack), None)
    layouts = [layout for layout in layout_space(gpus, model, train, topology.gpus_per_node).layouts
               if not s.stack_refusal(layout)]
    return s, layouts
