"""A parallelism is additive: one Strategy subclass and one register() call put its collectives, kernels and
exposed time into every estimate (no edit of comm_volume, compute_time or time_model), and unregistering
it restores the previous numbers exactly."""

import pytest

from sp_plan.cost_models import CostModelError, Layout, TrainSpec, get_model_preset
from sp_plan.cost_models.collectives import bytes_sent, collective_cost
from sp_plan.cost_models.estimate import estimate
from sp_plan.cost_models.placement import group_spans
from sp_plan.cost_models.profile import default_profile
from sp_plan.cost_models.strategies import (
    DEFAULT_STRATEGIES,
    CommOp,
    Strategy,
    Term,
    layer_buckets,
    register,
    registered,
    report_buckets,
    unregister,
)
from sp_plan.cost_models.topology import default_topology

MODEL = get_model_preset("llama3-8b")
TRAIN = TrainSpec(seq_len=32768, grad_accum=2, zero_stage=3, checkpointing="none")
LAYOUT = Layout(ulysses=4, dp_shard=2)
TOPOLOGY = default_topology("h100-80gb", 8, 8)

SYNC_BYTES = 3e6  # per layer, forward, every micro-batch
STEP_PENALTY_S = 0.25  # exposed once per step
KERNELS_S = (1e-4, 3e-4)  # per layer, forward and backward


class ToySync(Strategy):
    """A made-up parallelism: one exposed all-reduce per layer over the data group, a fixed exposed
    wait per step, and a kernel of its own in every layer."""

    name = "toy"
    layer_buckets = ("toy",)

    def comm_ops(self, model, train, layout):
        yield CommOp("toy", "all_reduce", "data", SYNC_BYTES, "forward", label="toy sync")

    def layer_kernels(self, cc):
        return {"toy_kernels": KERNELS_S}

    def exposed(self, ctx):
        yield Term("exposed_comm", STEP_PENALTY_S, "step", "toy")


def run():
    return estimate(MODEL, TRAIN, LAYOUT, TOPOLOGY, with_placement=False)


@pytest.fixture
def toy():
    strategy = register(ToySync())
    try:
        yield strategy
    finally:
        if "toy" in {s.name for s in registered()}:
            unregister("toy")


def test_a_registered_strategy_enters_comm_volume_compute_and_step_time(toy):
    unregister("toy")
    base = run()
    register(toy)
    est = run()
    layers, accum = MODEL.num_layers, TRAIN.grad_accum
    sent = bytes_sent("all_reduce", SYNC_BYTES, LAYOUT.dp * LAYOUT.sp)
    seconds = collective_cost("all_reduce", SYNC_BYTES, group_spans(LAYOUT, TOPOLOGY)["data"]).time_s
    assert seconds > 0

    # Communication volume: its own bucket, per layer and per step; every other bucket unchanged.
    assert est.comm.per_layer_bytes["toy"].forward == pytest.approx(sent, rel=1e-12)
    assert est.comm.per_step_by_strategy["toy"] == pytest.approx(sent * layers * accum, rel=1e-12)
    assert est.comm.per_step_bytes == pytest.approx(base.comm.per_step_bytes + sent * layers * accum, rel=1e-12)
    assert {k: v for k, v in est.comm.per_step_by_strategy.items() if k != "toy"} == base.comm.per_step_by_strategy

    # Time: the op is exposed (the generic rule), plus the strategy's own step term.
    exposed = seconds * layers * accum + STEP_PENALTY_S
    t, b = est.time, base.time
    assert t.comm_s_by_strategy["toy"] == pytest.approx(seconds * layers * accum, rel=1e-12)
    assert t.exposed_comm_s_by_strategy["toy"] == pytest.approx(exposed, rel=1e-12)
    assert t.components["exposed_comm_toy"] == pytest.approx(exposed, rel=1e-12)
    assert t.exposed_comm_s == pytest.approx(b.exposed_comm_s + exposed, rel=1e-12)

    # Compute: its kernels, scaled by the stack's overhead like every kernel, under their own part.
    gaps = 1 + default_profile(TOPOLOGY.gpu.name).stack.time.compute_overhead_fraction
    kernels = layers * accum * sum(KERNELS_S)
    assert t.components["toy_kernels"] == pytest.approx(kernels, rel=1e-12)
    assert t.compute_s == pytest.approx(b.compute_s + kernels * gaps, rel=1e-12)
    assert t.step_s == pytest.approx(b.step_s + exposed + kernels * gaps, rel=1e-12)
    assert sum(t.components.values()) == pytest.approx(t.step_s, rel=1e-9)
    for name in ("offload", "optimizer", "interference", "exposed_comm_ulysses", "exposed_comm_fsdp", "gemm_forward"):
        assert t.components[name] == b.components[name], name


def test_unregistering_restores_the_previous_numbers(toy):
    with_toy = run()
    unregister("toy")
    without = run()
    assert "toy" not in without.comm.per_step_by_strategy
    assert "exposed_comm_toy" not in without.time.components
    assert without.time.step_s < with_toy.time.step_s
    register(toy)
    unregister("toy")
    assert run().to_json_dict() == without.to_json_dict()
    assert report_buckets() == ("dp", "fsdp", "tp", "ulysses", "ring", "ep", "embedding", "loss", "pipeline")


def test_the_defaults_are_registered_in_report_order():
    assert registered() == DEFAULT_STRATEGIES
    assert layer_buckets() == ("dp", "fsdp", "tp", "ulysses", "ring", "ep")
    assert report_buckets() == layer_buckets() + ("embedding", "loss", "pipeline")


def test_the_registry_refuses_clashes(toy):
    with pytest.raises(CostModelError, match="already registered"):
        register(ToySync())

    class Clash(Strategy):
        name = "clash"
        model_buckets = ("ring",)

    with pytest.raises(CostModelError, match="buckets already taken"):
        register(Clash())

    class Claims(Strategy):
        name = "claims"
        overlap_classes = ("ring",)

    with pytest.raises(CostModelError, match="overlap class"):
        register(Claims())
    with pytest.raises(CostModelError, match="no strategy named"):
        unregister("nonexistent")


def test_an_op_no_strategy_prices_is_an_error():
    class Unpriced(Strategy):
        name = "unpriced"
        layer_buckets = ("unpriced",)

        def comm_ops(self, model, train, layout):
            yield CommOp("unpriced", "send_recv", "ulysses", 1e6, "forward", overlap="pipelined")

    register(Unpriced())
    try:
        with pytest.raises(CostModelError, match="no registered strategy prices overlap class 'pipelined'"):
            run()
    finally:
        unregister("unpriced")
    run()  # and the registry is back to the defaults
