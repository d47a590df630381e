"""Hardware topology: a networkx graph of GPUs, switches, NICs and hosts, with calibrated link classes.

Public API::

    load_topology("dgx-h100", num_gpus=64)          # preset, NAME@FABRIC[:NICS], or a YAML path
    default_topology("h100-80gb", 64)               # the natural node for a GPU, enough nodes
    save_topology(topology, "my-cluster.yaml")
    topo.group(stride, size) -> GroupSpan            # O(1) after the first call per (stride, size)
    topo.link_between(rank_a, rank_b), topo.group_bottleneck(ranks), topo.pcie_bandwidth, ...
"""

from .presets import (
    NATURAL_NODE_PRESET,
    default_topology,
    fabric_names,
    get_preset_spec,
    load_spec_file,
    load_topology,
    preset_names,
    resize,
    save_topology,
    spec_from_dict,
    spec_to_yaml,
    with_fabric,
)
from .spec import (
    LINK_CLASSES,
    CalibrationSpec,
    ComputeCalibration,
    FabricSpec,
    HostSpec,
    InterconnectSpec,
    LinkCalibration,
    NodeSpec,
    PCIeSpec,
    ProvenanceSpec,
    TopologySpec,
)
from .topology import GroupSpan, LinkParams, Topology

__all__ = [
    "CalibrationSpec",
    "ComputeCalibration",
    "FabricSpec",
    "GroupSpan",
    "HostSpec",
    "InterconnectSpec",
    "LINK_CLASSES",
    "LinkCalibration",
    "LinkParams",
    "NATURAL_NODE_PRESET",
    "NodeSpec",
    "PCIeSpec",
    "ProvenanceSpec",
    "Topology",
    "TopologySpec",
    "default_topology",
    "fabric_names",
    "get_preset_spec",
    "load_spec_file",
    "load_topology",
    "preset_names",
    "resize",
    "save_topology",
    "spec_from_dict",
    "spec_to_yaml",
    "with_fabric",
]
