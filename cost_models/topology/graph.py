"""Build the networkx graph of a topology and answer path and congestion questions on it.

Vertices (``kind`` attribute): ``gpu`` (carries ``spec``, ``rank``, ``node``, ``local``), ``nvswitch``,
``pcie_switch``, ``cpu`` (one per socket), ``host`` (carries RAM and memory bandwidth), ``nic`` and one
``fabric`` vertex for the inter-node network. Edges carry ``kind`` (nvlink, pcie, socket, loopback,
fabric, memory), ``bandwidth`` (bytes/s per direction) and ``latency`` (seconds).

Cost queries never walk the full cluster graph: all nodes are identical, so :class:`NodeAnalysis`
routes traffic once on a *template* (node 0, plus node 1 and the fabric when there are several
nodes) and the cost model reuses those per-node results for every group of ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import networkx as nx

from ..gpu_spec import GPUSpec
from .spec import TopologySpec

FABRIC = "fabric"

Edge = tuple[str, str]  # directed (from, to)


def gpu_id(node: int, local: int) -> str:
    return f"n{node}/gpu{local}"


def host_id(node: int) -> str:
    return f"n{node}/host"


def _num_switches(spec: TopologySpec) -> int:
    pcie = spec.node.pcie
    return math.ceil(spec.node.gpus / pcie.gpus_per_switch) if pcie else 0


def add_node(g: nx.Graph, spec: TopologySpec, gpu: GPUSpec, n: int) -> None:
    """Add node ``n``'s GPUs, switches, sockets, host and NICs (and their edges) to ``g``."""
    node, host, pcie = spec.node, spec.node.host, spec.node.pcie
    p = f"n{n}/"
    g.add_node(
        host_id(n),
        kind="host",
        node=n,
        ram_bytes=host.ram_bytes,
        cpu_cores=host.cpu_cores,
        memory_bandwidth=host.memory_bandwidth,
    )
    cpus = [f"{p}cpu{s}" for s in range(host.sockets)]
    for cpu in cpus:
        g.add_node(cpu, kind="cpu", node=n)
        # Host memory is split across sockets; "memory" edges only carry host<->device traffic.
        g.add_edge(host_id(n), cpu, kind="memory", bandwidth=host.memory_bandwidth / host.sockets, latency=0.0)
    for a in range(len(cpus)):
        for b in range(a + 1, len(cpus)):
            g.add_edge(
                cpus[a], cpus[b], kind="socket", bandwidth=host.socket_link_bandwidth, latency=host.socket_link_latency
            )
    ic = node.interconnect
    for i in range(node.gpus):
        g.add_node(gpu_id(n, i), kind="gpu", node=n, local=i, rank=n * node.gpus + i, spec=gpu)
    if ic.kind == "nvswitch":
        g.add_node(f"{p}nvswitch", kind="nvswitch", node=n)
        for i in range(node.gpus):
            g.add_edge(gpu_id(n, i), f"{p}nvswitch", kind="nvlink", bandwidth=ic.bandwidth, latency=ic.latency)
    switches: list[str] = []
    if pcie is not None:
        count = _num_switches(spec)
        uplink = pcie.switch_uplink_bandwidth or pcie.bandwidth
        for j in range(count):
            sw = f"{p}pcie{j}"
            switches.append(sw)
            g.add_node(sw, kind="pcie_switch", node=n)
            g.add_edge(sw, cpus[j * host.sockets // count], kind="pcie", bandwidth=uplink, latency=pcie.latency)
        for i in range(node.gpus):
            g.add_edge(
                gpu_id(n, i), switches[i // pcie.gpus_per_switch], kind="pcie", bandwidth=pcie.bandwidth,
                latency=pcie.latency,
            )
    if ic.kind == "loopback":
        # CPU ranks: processes exchanging data through the host's memory.
        for i in range(node.gpus):
            g.add_edge(gpu_id(n, i), cpus[0], kind="loopback", bandwidth=ic.bandwidth, latency=ic.latency)
    fabric = spec.fabric
    if fabric is not None:
        if FABRIC not in g:
            g.add_node(FABRIC, kind="fabric", name=fabric.name, fabric_kind=fabric.kind)
        for m in range(fabric.nics_per_node):
            nic = f"{p}nic{m}"
            g.add_node(nic, kind="nic", node=n, local=m)
            if switches:
                # NICs are spread over the PCIe switches in order, next to the GPUs they serve.
                slot_bw = pcie.bandwidth  # type: ignore[union-attr]
                g.add_edge(nic, switches[m * len(switches) // fabric.nics_per_node], kind="pcie", bandwidth=slot_bw,
                           latency=pcie.latency)  # type: ignore[union-attr]
            else:
                g.add_edge(nic, cpus[m * host.sockets // fabric.nics_per_node], kind="pcie",
                           bandwidth=fabric.nic_bandwidth, latency=0.0)
            g.add_edge(nic, FABRIC, kind="fabric", bandwidth=fabric.nic_bandwidth / fabric.oversubscription,
                       latency=fabric.latency)


def build_graph(spec: TopologySpec, gpu: GPUSpec, nodes: int | None = None) -> nx.Graph:
    """The cluster graph with ``nodes`` nodes (default: all of them)."""
    g = nx.Graph(name=spec.name)
    for n in range(spec.nodes if nodes is None else nodes):
        add_node(g, spec, gpu, n)
    return g


# ----- routing -----------------------------------------------------------------------------------


def route(g: nx.Graph, src: str, dst: str) -> list[Edge]:
    """The widest-first path from ``src`` to ``dst`` as directed edges.

    Edge cost is 1/bandwidth, so traffic prefers NVLink over PCIe, as NCCL does. GPUs are endpoints,
    never transit hops (no PXN forwarding), host-memory edges are only used to reach a host, and
    traffic between two devices of one node never leaves the node through the fabric.
    """
    same_node = g.nodes[src].get("node") == g.nodes[dst].get("node")

    def cost(u: str, v: str, data: dict) -> float | None:
        if data["kind"] == "memory" and dst != u and dst != v:
            return None
        if v != dst and (g.nodes[v]["kind"] == "gpu" or (same_node and v == FABRIC)):
            return None
        return 1.0 / data["bandwidth"]

    try:
        nodes = nx.dijkstra_path(g, src, dst, weight=cost)
    except nx.NetworkXNoPath:
        raise ValueError(f"no path from {src} to {dst}") from None
    return list(zip(nodes[:-1], nodes[1:]))


def classify(g: nx.Graph, path: Sequence[Edge]) -> str:
    """The link class of a GPU-to-GPU path (``nvidia-smi topo -m`` vocabulary, see spec.LinkClass)."""
    kinds = {g.edges[e]["kind"] for e in path}
    if "fabric" in kinds:
        return "fabric"
    if "loopback" in kinds:
        return "loopback"
    if "nvlink" in kinds:
        return "nvlink"
    if "socket" in kinds:
        return "cross_socket"
    if any(g.nodes[v]["kind"] == "cpu" for _, v in path):
        return "pcie_host"
    return "pcie_switch"


def bottleneck(g: nx.Graph, path: Sequence[Edge]) -> float:
    return min(g.edges[e]["bandwidth"] for e in path)


def latency(g: nx.Graph, path: Sequence[Edge]) -> float:
    return sum(g.edges[e]["latency"] for e in path)


def seconds_per_unit(g: nx.Graph, flows: Iterable[tuple[Sequence[Edge], float]]) -> float:
    """Time for every flow to move ``amount`` bytes when all run at once, per byte of the unit.

    Each directed edge carries the sum of the flows routed over it; the most loaded edge relative to
    its bandwidth finishes last (fluid model, fair sharing, no protocol overhead).
    """
    load: dict[Edge, float] = defaultdict(float)
    for path, amount in flows:
        for e in path:
            load[e] += amount
    if not load:
        return 0.0
    return max(amount / g.edges[e]["bandwidth"] for e, amount in load.items())


class NodeAnalysis:
    """Routes, classes and shared-link bandwidths of one node template, computed once.

    Everything here is nominal (datasheet) bandwidth; calibration is applied by the Topology.
    """

    def __init__(self, spec: TopologySpec, gpu: GPUSpec):
        self.spec = spec
        gpn = spec.node.gpus
        self.gpus_per_node = gpn
        self.graph = build_graph(spec, gpu, nodes=min(spec.nodes, 2) if spec.fabric else 1)
        g = self.graph
        self.paths: list[list[list[Edge]]] = [[[] for _ in range(gpn)] for _ in range(gpn)]
        self.pair_class = [["self"] * gpn for _ in range(gpn)]
        self.pair_bandwidth = [[math.inf] * gpn for _ in range(gpn)]
        self.pair_latency = [[0.0] * gpn for _ in range(gpn)]
        for a in range(gpn):
            for b in range(gpn):
                if a == b:
                    continue
                if b < a:  # symmetric graph: reverse the path found for (b, a)
                    path = [(v, u) for u, v in reversed(self.paths[b][a])]
                else:
                    path = route(g, gpu_id(0, a), gpu_id(0, b))
                self.paths[a][b] = path
                self.pair_class[a][b] = classify(g, path)
                self.pair_bandwidth[a][b] = bottleneck(g, path)
                self.pair_latency[a][b] = latency(g, path)
        self._init_host()
        self._init_fabric()

    # ----- host <-> GPU ---------------------------------------------------------------------------
    def _init_host(self) -> None:
        g, gpn = self.graph, self.gpus_per_node
        self.host_paths = [route(g, gpu_id(0, i), host_id(0)) for i in range(gpn)]
        self.host_bandwidth_solo = bottleneck(g, self.host_paths[0])
        # All GPUs copying at once (offload traffic is SPMD): PCIe uplinks and host memory are shared.
        self.host_bandwidth_shared = 1.0 / seconds_per_unit(g, ((p, 1.0) for p in self.host_paths))

    # ----- GPU <-> fabric -------------------------------------------------------------------------
    def _init_fabric(self) -> None:
        g, spec, gpn = self.graph, self.spec, self.gpus_per_node
        self.nic_assignment: list[list[int]] = []
        self.fabric_share = 0.0
        self.fabric_solo = 0.0
        self.fabric_latency = 0.0
        self.fabric_class_bandwidth = 0.0
        if spec.fabric is None:
            return
        nics = spec.fabric.nics_per_node
        # NICs are numbered in PCIe order like GPUs, so proportional assignment is the local one:
        # GPU i uses NICs [i*nics/gpn, (i+1)*nics/gpn) when there are more NICs than GPUs, or shares
        # NIC floor(i*nics/gpn) with its neighbours when there are fewer.
        for i in range(gpn):
            lo, hi = (i * nics) // gpn, ((i + 1) * nics) // gpn
            self.nic_assignment.append(list(range(lo, hi)) if hi > lo else [lo])
        egress: list[list[tuple[list[Edge], float]]] = []
        for i, assigned in enumerate(self.nic_assignment):
            share = 1.0 / len(assigned)
            flows = []
            for m in assigned:
                nic = f"n0/nic{m}"
                flows.append((route(g, gpu_id(0, i), nic) + [(nic, FABRIC)], share))
            egress.append(flows)
        self.fabric_solo = 1.0 / seconds_per_unit(g, egress[0])
        self.fabric_share = 1.0 / seconds_per_unit(g, (f for flows in egress for f in flows))
        self.fabric_class_bandwidth = self.fabric_share
        if spec.nodes > 1:
            # Latency of one hop between nodes: GPU -> NIC -> fabric -> NIC -> GPU.
            path = route(g, gpu_id(0, 0), gpu_id(1, 0))
            self.fabric_latency = latency(g, path)
        else:
            first = egress[0][0][0]
            self.fabric_latency = 2 * latency(g, first)

    # ----- concurrency-aware bandwidth of traffic patterns inside a node ---------------------------
    def pattern_bandwidth(self, groups: Sequence[Sequence[int]], pattern: str) -> float:
        """Per-GPU send bandwidth (nominal) when every group in ``groups`` runs ``pattern`` at once.

        ``all_to_all``: each member sends an equal share of its bytes to every other member.
        ``ring``: each member sends all its bytes to the next member (cyclically), as in ring
        collectives and ring attention. Groups are local GPU indices of one node; all groups of a mesh
        dimension communicate simultaneously, so they share PCIe switches and sockets.
        """
        flows: list[tuple[Sequence[Edge], float]] = []
        for members in groups:
            k = len(members)
            if k < 2:
                continue
            if pattern == "all_to_all":
                share = 1.0 / (k - 1)
                flows.extend((self.paths[a][b], share) for a in members for b in members if a != b)
            elif pattern == "ring":
                flows.extend((self.paths[members[i]][members[(i + 1) % k]], 1.0) for i in range(k))
            else:
                raise ValueError(f"unknown traffic pattern {pattern!r}")
        per_unit = seconds_per_unit(self.graph, flows)
        return math.inf if per_unit == 0 else 1.0 / per_unit

    def class_nominal_bandwidth(self, link_class: str) -> float:
        """Fastest pair of ``link_class`` in the node (the class's nominal bandwidth)."""
        if link_class == "fabric":
            return self.fabric_class_bandwidth
        best = 0.0
        for a, row in enumerate(self.pair_class):
            for b, cls in enumerate(row):
                if cls == link_class:
                    best = max(best, self.pair_bandwidth[a][b])
        return best

    def class_latency(self, link_class: str) -> float:
        if link_class == "fabric":
            return self.fabric_latency
        worst = 0.0
        for a, row in enumerate(self.pair_class):
            for b, cls in enumerate(row):
                if cls == link_class:
                    worst = max(worst, self.pair_latency[a][b])
        return worst

    def classes_present(self) -> list[str]:
        found = {cls for row in self.pair_class for cls in row if cls != "self"}
        if self.spec.fabric is not None:
            found.add("fabric")
        from .spec import LINK_CLASSES

        return [c for c in LINK_CLASSES if c in found]
