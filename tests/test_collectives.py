"""Alpha-beta collective costs on topology groups, including hierarchical (multi-node) behaviour."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_plan.cost_models import CostModelError
from sp_plan.cost_models.collectives import COLLECTIVES, bytes_sent, collective_cost
from sp_plan.cost_models.topology import CalibrationSpec, LinkCalibration, Topology, get_preset_spec, resize

IDEAL = CalibrationSpec(
    source="test: nominal bandwidth, no latency",
    links={"nvlink": LinkCalibration(efficiency=1.0, alpha=0.0), "fabric": LinkCalibration(efficiency=1.0, alpha=0.0)},
)


def ideal(preset: str, gpus: int, gpus_per_node: int | None = None) -> Topology:
    spec = resize(get_preset_spec(preset), gpus, gpus_per_node)
    return Topology(spec.model_copy(update={"calibration": IDEAL}))


@pytest.mark.parametrize(
    "collective, factor",
    [("all_to_all", 7 / 8), ("all_reduce", 2 * 7 / 8), ("all_gather", 7 / 8), ("reduce_scatter", 7 / 8),
     ("send_recv", 1.0)],
)
def test_bytes_sent_conventions(collective, factor):
    assert bytes_sent(collective, 1000.0, 8) == pytest.approx(1000 * factor)
    assert bytes_sent(collective, 1000.0, 1) == 0.0


def test_unknown_collective():
    with pytest.raises(CostModelError, match="unknown collective"):
        bytes_sent("broadcast", 1.0, 2)


def test_intra_node_alpha_beta():
    topo = Topology(resize(get_preset_spec("dgx-h100"), 8))
    span = topo.group(1, 8)
    link = topo.links["nvlink"]
    n = 1e9
    a2a = collective_cost("all_to_all", n, span)
    assert a2a.time_s == pytest.approx(7 * link.alpha + 7 / 8 * n / link.bandwidth)
    ar = collective_cost("all_reduce", n, span)
    assert ar.time_s == pytest.approx(14 * link.alpha + 2 * 7 / 8 * n / link.bandwidth)
    assert ar.fabric_bytes == 0 and ar.bytes_sent == pytest.approx(1.75e9)
    p2p = collective_cost("send_recv", n, span)
    assert p2p.time_s == pytest.approx(link.alpha + n / link.bandwidth)


def test_all_to_all_across_nodes_is_about_12x_slower_at_25_gbs_per_gpu():
    """DESIGN.md section 4: 300 GB/s NVLink vs ~25 GB/s per GPU across nodes."""
    inside = ideal("dgx-a100", 8).group(1, 8)
    across = ideal("dgx-a100", 8, gpus_per_node=1).group(1, 8)  # one GPU per node, HDR 200 Gb/s each
    assert (inside.link_class, across.link_class, across.nodes) == ("nvlink", "fabric", 8)
    n = 4.608e9  # Q + K + V + output of one Llama-70B layer at 1M tokens, per GPU
    t_in = collective_cost("all_to_all", n, inside).time_s
    t_out = collective_cost("all_to_all", n, across).time_s
    assert t_in == pytest.approx(7 / 8 * n / 300e9)
    assert t_out / t_in == pytest.approx(12.0)


def test_hierarchical_all_to_all_splits_intra_and_fabric_traffic():
    topo = ideal("dgx-h100", 16)
    span = topo.group(1, 16)  # 8 per node, 2 nodes
    n = 1.6e9
    cost = collective_cost("all_to_all", n, span)
    intra = 7 / 16 * n / 450e9
    inter = 8 / 16 * n / 50e9
    assert cost.time_s == pytest.approx(max(intra, inter))
    assert cost.fabric_bytes == pytest.approx(8 / 16 * n)


def test_ring_collectives_across_nodes_spread_over_the_groups_nics():
    topo = ideal("dgx-h100", 32)
    n = 1e9
    per_node = topo.group(8, 4)  # one rank per node: each GPU's own NIC share
    full = topo.group(1, 32)  # 8 ranks per node: the ring's crossing uses all 8 NICs
    sent = 2 * 3 / 4 * n
    assert collective_cost("all_reduce", n, per_node).time_s == pytest.approx(sent / 50e9)
    sent32 = 2 * 31 / 32 * n
    assert collective_cost("all_reduce", n, full).time_s == pytest.approx(max(sent32 / 450e9, sent32 / (8 * 50e9)))


def test_ring_all_reduce_latency_uses_tree_across_many_nodes():
    topo = Topology(resize(get_preset_spec("dgx-h100"), 1024))
    span = topo.group(8, 128)
    alpha = topo.links["fabric"].alpha
    tiny = collective_cost("all_reduce", 8.0, span)
    assert tiny.time_s < 2 * 127 * alpha / 10  # far below the ring's 2(P-1) steps
    assert tiny.time_s >= 2 * math.log2(128) * alpha


def test_send_recv_ring_crossing_nodes():
    topo = ideal("dgx-h100", 16)
    span = topo.group(8, 2)  # ring of 2 over 2 nodes
    cost = collective_cost("send_recv", 1e9, span)
    assert cost.time_s == pytest.approx(1e9 / 50e9)
    assert cost.fabric_bytes == 1e9


@settings(max_examples=60, deadline=None)
@given(
    collective=st.sampled_from(COLLECTIVES),
    shape=st.sampled_from([(1, 2), (1, 8), (2, 4), (8, 2), (4, 8), (1, 32), (16, 2)]),
    n=st.floats(1.0, 1e11),
)
def test_time_is_monotone_and_bounded_by_the_fastest_link(collective, shape, n):
    topo = Topology(resize(get_preset_spec("dgx-h100"), 32))
    span = topo.group(*shape)
    small = collective_cost(collective, n, span)
    big = collective_cost(collective, 2 * n, span)
    assert big.time_s > small.time_s > 0
    fastest = topo.links["nvlink"].bandwidth
    assert small.time_s >= small.bytes_sent / fastest * (1 - 1e-12)
