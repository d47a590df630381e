"""Topology graph, presets, YAML round trip, validation and the O(1) query API."""

import math
import time

import pytest
import yaml

from sp_plan.cost_models import CostModelError
from sp_plan.cost_models.gpu_spec import gpu_preset_names
from sp_plan.cost_models.topology import (
    LINK_CLASSES,
    NATURAL_NODE_PRESET,
    Topology,
    default_topology,
    get_preset_spec,
    load_spec_file,
    load_topology,
    preset_names,
    resize,
    save_topology,
    spec_from_dict,
    spec_to_yaml,
)

GB = 1e9


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_round_trips(name, tmp_path):
    topo = load_topology(name, num_gpus=16)
    assert topo.num_gpus == 16 and topo.num_nodes == 16 // get_preset_spec(name).node.gpus
    assert set(topo.links) <= set(LINK_CLASSES) and "fabric" in topo.links
    path = save_topology(topo, tmp_path / f"{name}.yaml")
    again = load_spec_file(path)
    assert again == topo.spec
    assert Topology(again).links == topo.links


def test_required_presets_and_their_numbers():
    names = set(preset_names())
    assert {"dgx-a100", "dgx-h100", "dgx-h200", "l40s-pcie"} <= names
    for preset, nvlink in [("dgx-a100", 300e9), ("dgx-h100", 450e9), ("dgx-h200", 450e9)]:
        topo = load_topology(preset)
        assert topo.links["nvlink"].nominal_bandwidth == nvlink
        assert topo.analysis.pair_class[0][7] == "nvlink"
    assert load_topology("dgx-h200").gpu.memory_bytes > load_topology("dgx-h100").gpu.memory_bytes


def test_l40s_pcie_classes_follow_the_pcie_tree():
    topo = load_topology("l40s-pcie")
    cls = topo.analysis.pair_class
    assert cls[0][1] == "pcie_switch"  # same PCIe switch (PIX)
    assert cls[0][2] == "pcie_host"  # same socket, other switch (PHB)
    assert cls[0][4] == "cross_socket"  # over UPI (SYS)
    assert "nvlink" not in topo.links
    # all 8 GPUs in one all-to-all share switch uplinks and UPI: slower than one pair alone
    span = topo.group(1, 8)
    assert span.intra_class == "cross_socket"
    assert span.a2a_bandwidth < topo.link_between(0, 1).bandwidth


@pytest.mark.parametrize(
    "ref, per_gpu",
    [
        ("dgx-h100", 50e9),  # 8 x NDR 400 Gb/s for 8 GPUs
        ("dgx-a100", 25e9),  # 8 x HDR 200 Gb/s
        ("dgx-h100@roce-400:8", 50e9),
        ("dgx-h100@ib-ndr:4", 25e9),  # two GPUs share a NIC
        ("aws-p5", 50e9),  # 32 x 100 Gb/s EFA
        ("aws-p4d", 6.25e9),  # 4 x 100 Gb/s EFA for 8 GPUs
        ("dgx-a100@efa:32", 32e9),  # 4 EFA per GPU = 50 GB/s, but the Gen4 x16 switch port caps at 32
    ],
)
def test_fabric_share_per_gpu_comes_from_the_graph(ref, per_gpu):
    topo = load_topology(ref, num_gpus=32)
    assert topo.analysis.fabric_share == pytest.approx(per_gpu)
    assert topo.link_class_between(0, 8) == "fabric"
    assert topo.num_nodes == 4


def test_default_topology_picks_the_natural_node():
    for gpu in gpu_preset_names():
        per_node = get_preset_spec(NATURAL_NODE_PRESET[gpu]).node.gpus
        topo = default_topology(gpu, 16)
        assert topo.gpu.name == gpu and topo.num_nodes == 16 // per_node
        assert NATURAL_NODE_PRESET[gpu] in topo.name
    small = default_topology("h100-80gb", 4)
    assert (small.num_nodes, small.gpus_per_node) == (1, 4)
    four = default_topology("h100-80gb", 12, gpus_per_node=4)
    assert (four.num_nodes, four.gpus_per_node, four.spec.fabric.nics_per_node) == (3, 4, 4)
    with pytest.raises(CostModelError, match="multiple of 8"):
        default_topology("h100-80gb", 12)
    with pytest.raises(CostModelError, match="unknown GPU"):
        default_topology("tpu-v5", 8)


def test_query_api():
    topo = load_topology("dgx-h100", num_gpus=32)
    assert topo.ranks_per_node == 8 and topo.node_of(17) == 2 and topo.local_index(17) == 1
    assert topo.link_class_between(0, 7) == "nvlink"
    assert topo.link_class_between(7, 8) == "fabric"
    assert topo.link_between(0, 1).bandwidth == pytest.approx(450e9 * 0.8)
    assert topo.group_bottleneck([0, 1, 2]).link_class == "nvlink"
    assert topo.group_bottleneck([0, 9]).link_class == "fabric"
    assert topo.host_ram_bytes == 2 * 2**40 and topo.host_ram_per_gpu == 2**40 / 4
    assert topo.pcie_bandwidth_solo == 64e9
    # two GPUs share each PCIe switch uplink when all copy at once
    assert topo.pcie_bandwidth == pytest.approx(32e9 * 0.8)
    assert topo.fabric_bandwidth_per_gpu == pytest.approx(50e9 * 0.9)
    with pytest.raises(CostModelError, match="outside topology"):
        topo.node_of(32)
    with pytest.raises(CostModelError, match="same GPU"):
        topo.link_between(3, 3)


@pytest.mark.parametrize(
    "stride, size, k, nodes, cls",
    [
        (1, 8, 8, 1, "nvlink"),  # tp or ulysses inside a node
        (1, 4, 4, 1, "nvlink"),
        (8, 4, 1, 4, "fabric"),  # a dimension outside 8 inner GPUs: one rank per node
        (4, 8, 2, 4, "fabric"),  # 2 members per node, 4 nodes
        (1, 32, 8, 4, "fabric"),
        (3, 4, 3, 2, "fabric"),  # does not align with nodes: worst group
    ],
)
def test_group_spans(stride, size, k, nodes, cls):
    topo = load_topology("dgx-h100", num_gpus=32)
    span = topo.group(stride, size)
    assert (span.ranks_per_node, span.nodes, span.link_class) == (k, nodes, cls)
    assert topo.group(stride, size) is span  # cached


def test_group_larger_than_topology_is_an_actionable_error():
    with pytest.raises(CostModelError, match="--gpus 64"):
        load_topology("dgx-h100", num_gpus=32).group(8, 8)


def test_graph_carries_gpu_specs_host_ram_and_links():
    topo = load_topology("dgx-h100", num_gpus=16)
    g = topo.graph
    gpus = [n for n, a in g.nodes(data=True) if a["kind"] == "gpu"]
    assert len(gpus) == 16
    assert g.nodes["n1/gpu3"]["spec"].name == "h100-80gb" and g.nodes["n1/gpu3"]["rank"] == 11
    assert g.nodes["n0/host"]["ram_bytes"] == 2 * 2**40
    assert g.edges["n0/gpu0", "n0/nvswitch"]["bandwidth"] == 450e9
    assert g.edges["n0/nic0", "fabric"]["kind"] == "fabric"
    assert sum(1 for _, a in g.nodes(data=True) if a["kind"] == "nic") == 16


def test_4096_gpu_topology_builds_fast_and_queries_are_cached():
    start = time.perf_counter()
    topo = Topology(resize(get_preset_spec("dgx-h100"), 4096))
    topo.group(8, 512)
    topo.group(1, 8)
    assert time.perf_counter() - start < 0.5
    assert topo.num_nodes == 512
    start = time.perf_counter()
    for _ in range(10_000):
        topo.group(8, 512)
    assert time.perf_counter() - start < 0.1


def _base():
    return yaml.safe_load(spec_to_yaml(get_preset_spec("dgx-h100")))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(nodes=4, fabric=None), "need a fabric section"),
        (lambda d: d["node"]["interconnect"].update(bandwidth=-1), "node.interconnect.bandwidth"),
        (lambda d: d["node"].update(gpus=0), "node.gpus"),
        (lambda d: d["node"].update(gpus=100_000), "node.gpus"),
        (lambda d: d.update(nodes=1 << 30), "nodes"),
        (lambda d: d["node"].update(colour="green"), "unknown field"),
        (lambda d: d["calibration"]["links"].update(nvlink={"efficiency": 0.5, "bandwidth": 1e9}), "not both"),
        (lambda d: d["calibration"]["links"].update(warp={"efficiency": 0.5}), "calibration.links.warp"),
        (lambda d: d["node"]["interconnect"].update(bandwidth=None), "needs a bandwidth"),
    ],
)
def test_validation_errors_are_one_actionable_line(mutate, message):
    data = _base()
    mutate(data)
    with pytest.raises(CostModelError, match=message) as err:
        spec_from_dict(data)
    assert "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(CostModelError, match="not found"):
        load_topology(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(CostModelError, match="not valid YAML at line"):
        load_topology(str(bad))
    bad.write_text("- just\n- a list\n")
    with pytest.raises(CostModelError, match="mapping"):
        load_topology(str(bad))
    bad.write_text("x" * (2 << 20))
    with pytest.raises(CostModelError, match="larger than 1 MiB"):
        load_topology(str(bad))
    data = _base()
    data["gpu"] = "gtx-480"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(CostModelError, match="unknown GPU 'gtx-480'"):
        load_topology(str(bad))
    # python-specific tags are refused by safe_load
    bad.write_text("name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(CostModelError, match="not valid YAML"):
        load_topology(str(bad))


def test_fabric_references_and_errors():
    assert load_topology("dgx-h100@efa:32", num_gpus=16).spec.fabric.nics_per_node == 32
    assert load_topology("dgx-h100@efa", num_gpus=16).links["fabric"].efficiency == pytest.approx(0.80)
    with pytest.raises(CostModelError, match="unknown fabric 'myrinet'"):
        load_topology("dgx-h100@myrinet")
    with pytest.raises(CostModelError, match="NICS after ':' must be an integer"):
        load_topology("dgx-h100@efa:many")


def test_file_with_inline_gpu_and_loopback_interconnect(tmp_path):
    data = {
        "name": "cpu-box",
        "gpu": {"name": "cpu", "memory_bytes": 8 << 30, "peak_flops": {"fp32": 1e11, "bf16": 5e10},
                "memory_bandwidth": 2e10},
        "node": {
            "gpus": 4,
            "interconnect": {"kind": "loopback", "bandwidth": 5e9, "latency": 2e-5},
            "host": {"sockets": 1, "cpu_cores": 4, "ram_bytes": 32 << 30, "memory_bandwidth": 2e10},
        },
    }
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    topo = load_topology(str(path))
    assert list(topo.links) == ["loopback"]
    assert topo.links["loopback"].nominal_bandwidth == 5e9
    assert topo.links["loopback"].alpha == pytest.approx(4e-5)  # two hops through the host
    assert topo.peak_flops("fp32") == 1e11
    with pytest.raises(CostModelError, match="no inter-node fabric"):
        load_topology(str(path), num_gpus=8)
    assert load_topology(str(path), num_gpus=2).num_gpus == 2


def test_resized_node_keeps_nics_per_gpu():
    spec = resize(get_preset_spec("dgx-h100"), 64, gpus_per_node=4)
    assert spec.node.gpus == 4 and spec.nodes == 16 and spec.fabric.nics_per_node == 4
    topo = Topology(spec)
    assert math.isclose(topo.analysis.fabric_share, 50e9)
