"""The planner's answers (``plan --json`` minus ``stats``) for a few small, varied workloads equal the recorded
golden answers byte for byte (tests/planner_outputs_golden.py regenerates them from the code as it was)."""

import copy

import pytest

from tests.planner_outputs_golden import WORKLOADS, canonical, compute, differences, load


@pytest.fixture(scope="module")
def golden():
    return load()


@pytest.fixture(scope="module")
def fresh():
    return compute()


def test_fixture_covers_the_workloads(golden):
    assert set(golden) == set(WORKLOADS)
    assert any(answer["exit_code"] != 0 for answer in golden.values())  # the no-fit advice is covered
    fitting = [a["output"] for a in golden.values() if a["exit_code"] == 0]
    assert all(len(out["plans"]) >= 1 for out in fitting)
    assert any(p["layout"]["pp"] > 1 for out in fitting for p in out["plans"])
    assert any(p["layout"].get("ep", 1) > 1 for out in fitting for p in out["plans"])
    assert any("data" in p for out in fitting for p in out["plans"])


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_planner_answers_as_recorded(golden, fresh, name):
    moved = differences({name: golden[name]}, {name: fresh[name]})
    assert not moved, "\n".join(moved)
    assert canonical(golden[name]) == canonical(fresh[name])


def test_the_comparison_catches_a_moved_figure(golden):
    name = next(n for n, a in golden.items() if a["exit_code"] == 0)
    moved = copy.deepcopy(golden[name])
    moved["output"]["plans"][0]["time"]["step_s"] *= 1 + 1e-15
    assert differences({name: golden[name]}, {name: moved})
    assert differences({name: golden[name]}, {name: copy.deepcopy(golden[name])}) == []
