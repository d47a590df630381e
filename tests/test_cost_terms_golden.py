"""The step-time, communication and memory figures of a fixed grid of cases, and the planner's answer
for a few settings, equal the recorded golden numbers (tests/cost_terms_golden.py regenerates them)."""

import copy
import json

import pytest

from tests.cost_terms_golden import PLANS, REL_TOL, cases, compute, differences, load


@pytest.fixture(scope="module")
def golden():
    return load()


@pytest.fixture(scope="module")
def fresh():
    return json.loads(json.dumps(compute()))  # through JSON, as the fixture was written


def test_fixture_covers_the_grid(golden):
    assert list(golden["cases"]) == sorted(cid for cid, *_ in cases())
    assert set(golden["plans"]) == {name for name, *_ in PLANS}
    estimated = [c for c in golden["cases"].values() if "error" not in c]
    assert len(estimated) >= 200
    # The grid exercises every strategy's traffic and exposed time somewhere.
    for strategy in ("dp", "fsdp", "tp", "ulysses", "ring", "embedding", "loss"):
        assert any(c["exposed_comm_s_by_strategy"][strategy] > 0 for c in estimated), strategy
    assert any(c["components"]["offload"] > 0 for c in estimated)
    assert any(c["time"]["fabric_bytes_per_step"] > 0 for c in estimated)


def test_every_case_matches_its_golden_numbers(golden, fresh):
    moved = differences(golden["cases"], fresh["cases"], "cases")
    assert not moved, "\n".join(moved[:50])


def test_the_planner_answers_as_recorded(golden, fresh):
    moved = differences(golden["plans"], fresh["plans"], "plans")
    assert not moved, "\n".join(moved[:50])


def test_the_comparison_catches_a_moved_figure(golden):
    case = next(c for c in golden["cases"].values() if "error" not in c)
    moved = copy.deepcopy(case)
    moved["components"]["optimizer"] = case["components"]["optimizer"] * (1 + 100 * REL_TOL) + 1e-9
    moved["comm"]["per_layer_bytes"]["ulysses"]["forward"] += 1.0
    del moved["exposed_comm_s_by_strategy"]["ring"]
    found = differences(case, moved)
    assert len(found) == 3
    assert differences(case, copy.deepcopy(case)) == []
