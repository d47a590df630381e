"""The liveness simulation on small graphs whose answers can be worked out by hand."""

import pytest

from sp_plan.cost_models.memory.graph import ATTENTION, Graph, GraphBuilder, TensorSpec, Workspace
from sp_plan.cost_models.memory.liveness import checkpoint_plan, simulate


def chain() -> Graph:
    """x(10) -> A -> a(100) -> B -> b(100) -> C -> y(10); A saves x, B saves a, C saves b."""
    g = GraphBuilder()
    g.input("x", 10)
    g.op("A", ["x"], [TensorSpec("a", 100)], saves=["x"], fwd_workspace=[Workspace(7)])
    g.op("B", ["a"], [TensorSpec("b", 100)], saves=["a"], tags=(ATTENTION,))
    g.op("C", ["b"], [TensorSpec("y", 10)], saves=["b"])
    return g.build(outputs=("y",))


def test_saved_bytes_per_mode():
    g = chain()
    assert simulate(g, "none").saved_tensors == {"x": 10, "a": 100, "b": 100}
    assert simulate(g, "full").saved_tensors == {"x": 10}
    assert simulate(g, "selective").saved_tensors == {"x": 10, "b": 100}  # B's output kept
    assert simulate(g, "inference").saved_tensors == {}


def test_forward_peaks():
    g = chain()
    # none: x + a + workspace(7) at A = 117; at C: x + a + b + y = 220
    assert simulate(g, "none").forward_peak.total == 220
    # full: a is freed after B, b after C: peak at B = x + a + b = 210 (workspace 117 < 210)
    assert simulate(g, "full").forward_peak.total == 210
    # inference frees x after A: peak at B = a + b = 200
    assert simulate(g, "inference").forward_peak.total == 200


def test_backward_with_and_without_recompute():
    g = chain()
    none = simulate(g, "none").backward_peak
    # start: x, a, b + dy(10) = 220; at C: + db(100) = 320; then b, dy freed; at B: x, a, db + da(100) = 310
    assert none.total == 320 and none.at == "backward:C"
    full = simulate(g, "full").backward_peak
    # recompute A, B (C is not needed again: early stop) brings back a and b: x + dy + a + b + A's workspace
    assert checkpoint_plan(g, "full").recompute == (0, 1)
    assert full.total == 320


def test_residual_passthrough_and_in_place_accumulation():
    """y = x + f(x): the add hands dy to both branches; f's gradient is added into x's in place."""
    g = GraphBuilder()
    g.input("x", 10)
    g.op("f", ["x"], [TensorSpec("fx", 10)], saves=["x"])
    g.op("add", ["x", "fx"], [TensorSpec("y", 10)], grad_passthrough=True)
    graph = g.build(outputs=("y",))
    peak = simulate(graph, "none").backward_peak
    # x saved (10) + dy (10, shared by x and fx) + f's new gradient for x (10) before it is added in place
    assert peak.total == 30


def test_graph_rejects_undefined_and_duplicate_tensors():
    g = GraphBuilder()
    g.input("x", 1)
    g.op("A", ["nope"], [TensorSpec("a", 1)])
    with pytest.raises(ValueError, match="before it exists"):
        g.build(outputs=("a",))
    g = GraphBuilder()
    g.input("x", 1)
    g.op("A", ["x"], [TensorSpec("x", 1)])
    with pytest.raises(ValueError, match="produced twice"):
        g.build(outputs=("x",))


def test_categories_are_kept_apart():
    g = GraphBuilder()
    g.input("x", 10)
    g.op("A", ["x"], [TensorSpec("l", 50, kind="logits")], saves=["l"], fwd_workspace=[Workspace(5, "comm")])
    peak = simulate(g.build(outputs=("l",)), "none").forward_peak
    assert peak.by_kind == {"activation": 10, "logits": 50, "comm": 5, "kv_cache": 0, "grads": 0}
