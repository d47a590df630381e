"""The planner's exactness check, shared by the tests that make it under different layouts and stacks."""

from __future__ import annotations

import pytest
from sp_plan.planner.search import SearchResult, brute_force_best, search


def assert_search_equals_brute_force(model, train, topology, settings) -> SearchResult:
    """The search's best plan scores exactly what brute force finds (or neither finds a plan)."""
    best_score, _, _, _ = brute_force_best(model, train, topology, settings)
    result = search(model, train, topology, settings)
    if best_score == float("inf"):
        assert not result.plans
    else:
        assert result.plans[0].score == pytest.approx(best_score, rel=1e-12)
    return result
