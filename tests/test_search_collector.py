"""The search pauses CPython's cyclic garbage collector while it runs (sp_plan.planner.search.collector_paused)
and leaves it as it found it: on after a search and after a refused one, off if the caller had it off."""

import gc

import pytest

from sp_plan.cost_models import TrainSpec, get_model_preset
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.search import PlanSettings, search

MODEL = get_model_preset("llama3-8b")
TOPOLOGY = default_topology("h100-80gb", 8, 8)


def test_the_collector_is_off_during_a_search_and_on_after_it(monkeypatch):
    seen = []
    import sp_plan.planner.search as module

    real = module._Searcher.memory

    def spy(self, layout, train):
        seen.append(gc.isenabled())
        return real(self, layout, train)

    monkeypatch.setattr(module._Searcher, "memory", spy)
    assert gc.isenabled()
    assert search(MODEL, TrainSpec(seq_len=8192), TOPOLOGY, PlanSettings(top_k=1)).plans
    assert seen and not any(seen)
    assert gc.isenabled()


def test_the_collector_is_back_on_after_a_refused_search():
    with pytest.raises(PlannerError):
        search(MODEL, TrainSpec(seq_len=8192), TOPOLOGY, PlanSettings(fixed_layout={"tp": 3}))
    assert gc.isenabled()


def test_a_caller_who_turned_the_collector_off_keeps_it_off():
    gc.disable()
    try:
        search(MODEL, TrainSpec(seq_len=8192), TOPOLOGY, PlanSettings(top_k=1))
        assert not gc.isenabled()
    finally:
        gc.enable()
