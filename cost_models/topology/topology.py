"""The :class:`Topology` the cost model queries: link classes, group spans, host limits.

Construction analyses one node template on the graph (routes, classes, shared-link bandwidths) and
applies the file's calibration. Queries are then O(1) arithmetic on cached per-node results: a group
of ranks is classified by how many nodes it spans and how its members sit inside a node, never by
walking the graph per pair. The full cluster graph is built lazily, only when someone asks for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import numpy as np

from ..errors import CostModelError
from ..gpu_spec import GPUSpec, get_gpu_preset
from ..kernels import kernel_model
from .graph import NodeAnalysis, build_graph
from .spec import LINK_CLASSES, CalibrationSpec, ComputeCalibration, TopologySpec

#: Bandwidth efficiency of a link class with no calibration entry: the nominal (datasheet) figure.
#: Shipped presets carry typical measured efficiencies in their calibration section instead.
DEFAULT_LINK_EFFICIENCY = 1.0


@dataclass(frozen=True, slots=True)
class LinkParams:
    """Calibrated alpha-beta parameters of one link class.

    ``nominal_bandwidth``: per GPU, per direction, from the graph (for ``fabric``: a GPU's share of its
    node's NICs when every GPU of the node sends). ``bandwidth = nominal x efficiency`` is what the
    cost model uses (beta = 1 / bandwidth). ``alpha``: seconds per algorithm step over this class.
    """

    link_class: str
    nominal_bandwidth: float
    efficiency: float
    alpha: float

    @property
    def bandwidth(self) -> float:
        return self.nominal_bandwidth * self.efficiency

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth


@dataclass(frozen=True, slots=True)
class GroupSpan:
    """Where the process groups of one mesh dimension (or a flattened run of dims) sit.

    A group is ``size`` ranks ``base + i * stride``; all groups of the dimension communicate at once.
    Bandwidths are calibrated, per GPU and direction; ``inf`` where that part of the traffic is absent.

    - ``ranks_per_node`` (k) and ``nodes`` (N): the worst group's spread (k x N = size when the mesh
      aligns with node boundaries).
    - ``a2a_bandwidth`` / ``ring_bandwidth``: per-GPU send bandwidth among the k same-node members
      for all-to-all and ring patterns, with every group of the dimension in the node active
      (shared PCIe switches and sockets are accounted for on the graph).
    - ``fabric_bandwidth``: a GPU's share of its node's NICs with every GPU of the node sending.
    - ``fabric_p2p_bandwidth``: one crossing point-to-point flow per group and node (ring hops), which
      can use up to k GPUs' NIC share but not more than one GPU's NIC path can carry.
    """

    size: int
    stride: int
    ranks_per_node: int
    nodes: int
    intra_class: str | None
    a2a_bandwidth: float
    ring_bandwidth: float
    alpha_intra: float
    fabric_bandwidth: float
    fabric_p2p_bandwidth: float
    alpha_fabric: float

    @property
    def link_class(self) -> str:
        """The slowest class the group's traffic crosses ("self" for a group of one)."""
        if self.nodes > 1:
            return "fabric"
        return self.intra_class or "self"

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


class Topology:
    """A cluster of identical nodes: the graph, calibrated link classes and fast group queries."""

    def __init__(self, spec: TopologySpec):
        self.spec = spec
        self.gpu: GPUSpec = get_gpu_preset(spec.gpu) if isinstance(spec.gpu, str) else spec.gpu
        self.num_nodes = spec.nodes
        self.gpus_per_node = spec.node.gpus
        self.num_gpus = spec.num_gpus
        try:
            self.analysis = NodeAnalysis(spec, self.gpu)
        except ValueError as exc:  # a disconnected description
            raise CostModelError(f"topology {spec.name}: {exc}; check the node's interconnect and pcie sections") from exc
        self.links: dict[str, LinkParams] = {
            cls: self._calibrated(cls) for cls in self.analysis.classes_present()
        }
        self._groups: dict[tuple[int, int], GroupSpan] = {}
        self._patterns: dict[tuple[tuple[tuple[int, ...], ...], str], float] = {}

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, {self.num_nodes} x {self.gpus_per_node} {self.gpu.name})"

    # ----- identity ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node

    @property
    def calibration(self) -> CalibrationSpec:
        return self.spec.calibration

    @cached_property
    def efficiency(self) -> ComputeCalibration:
        """Achievable fractions of peak for compute, HBM, PCIe and host memory: the topology's
        calibration where it gives them, else the asymptotic fractions of the GPU's kernel model
        (FlashAttention-2 for attention; the time model picks the stack's kernel family itself)."""
        c = self.spec.calibration.compute
        k = kernel_model(self.gpu.name)
        fa = k.attention_params("fa2")
        return ComputeCalibration(
            matmul=c.matmul if c.matmul is not None else k.gemm.peak_fraction,
            attention_forward=c.attention_forward if c.attention_forward is not None else fa.forward_fraction,
            attention_backward=c.attention_backward if c.attention_backward is not None else fa.backward_fraction,
            memory=c.memory if c.memory is not None else k.memory_fraction,
            pcie=c.pcie,
            host_memory=c.host_memory,
        )

    @cached_property
    def graph(self) -> nx.Graph:
        """The full cluster graph (built on first use; cost queries use the node template)."""
        return build_graph(self.spec, self.gpu)

    @property
    def node_graph(self) -> nx.Graph:
        """The template graph the cost queries were derived from (node 0, node 1 and the fabric)."""
        return self.analysis.graph

    # ----- calibration ---------------------------------------------------------------------------
    def _calibrated(self, link_class: str) -> LinkParams:
        nominal = self.analysis.class_nominal_bandwidth(link_class)
        entry = self.spec.calibration.links.get(link_class)  # type: ignore[call-overload]
        efficiency = DEFAULT_LINK_EFFICIENCY
        alpha = self.analysis.class_latency(link_class)
        if entry is not None:
            if entry.efficiency is not None:
                efficiency = entry.efficiency
            elif entry.bandwidth is not None:
                efficiency = entry.bandwidth / nominal
            if entry.alpha is not None:
                alpha = entry.alpha
        return LinkParams(link_class, nominal, efficiency, alpha)

    def link(self, link_class: str) -> LinkParams:
        try:
            return self.links[link_class]
        except KeyError:
            raise CostModelError(
                f"topology {self.name} has no {link_class} links; it has {', '.join(self.links) or 'none'}"
            ) from None

    # ----- ranks ---------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_gpus:
            raise CostModelError(f"rank {rank} is outside topology {self.name} (ranks 0..{self.num_gpus - 1})")

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.gpus_per_node

    def local_index(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.gpus_per_node

    def link_class_between(self, a: int, b: int) -> str:
        """Class of the path between two ranks ("self" when a == b)."""
        if self.node_of(a) != self.node_of(b):
            return "fabric"
        return self.analysis.pair_class[self.local_index(a)][self.local_index(b)]

    def link_between(self, a: int, b: int) -> LinkParams:
        """Calibrated parameters of the link between two distinct ranks (pair bandwidth, not shared)."""
        cls = self.link_class_between(a, b)
        if cls == "self":
            raise CostModelError(f"ranks {a} and {b} are the same GPU; there is no link between them")
        params = self.links[cls]
        if cls == "fabric":
            nominal = self.analysis.fabric_solo
        else:
            nominal = self.analysis.pair_bandwidth[self.local_index(a)][self.local_index(b)]
        return LinkParams(cls, nominal, params.efficiency, params.alpha)

    def group_bottleneck(self, ranks: Sequence[int]) -> LinkParams:
        """The slowest class linking any two members of an arbitrary group of ranks.

        Cost: O(len(ranks)) to find the nodes, plus O(k^2) pair lookups on one node's k members.
        """
        if len(ranks) < 2:
            raise CostModelError("a group needs at least two ranks to have a bottleneck link")
        nodes = {self.node_of(r) for r in ranks}
        if len(nodes) > 1:
            return self.links["fabric"]
        local = [self.local_index(r) for r in ranks]
        return self.links[self._worst_class([local])]

    def _worst_class(self, groups: Sequence[Sequence[int]]) -> str:
        """The class of the slowest calibrated pair; on equal bandwidth, the farther class (a path
        over the CPU socket link is the bottleneck rather than one under a PCIe switch)."""
        a = self.analysis
        worst, worst_key = None, (math.inf, 0)
        for members in groups:
            for x in members:
                for y in members:
                    if x == y:
                        continue
                    cls = a.pair_class[x][y]
                    key = (a.pair_bandwidth[x][y] * self.links[cls].efficiency, -LINK_CLASSES.index(cls))
                    if key < worst_key:
                        worst, worst_key = cls, key
        return worst or "self"

    # ----- groups of a mesh dimension -------------------------------------------------------------
    def group(self, stride: int, size: int) -> GroupSpan:
        """Span of the groups ``{base + i * stride : i < size}`` that tile the first ``stride * size
        * m`` ranks (one mesh dimension, or several adjacent ones flattened). Cached."""
        key = (stride, size)
        span = self._groups.get(key)
        if span is None:
            span = self._groups[key] = self._compute_group(stride, size)
        return span

    def _compute_group(self, stride: int, size: int) -> GroupSpan:
        if stride < 1 or size < 1:
            raise CostModelError(f"a process group needs stride >= 1 and size >= 1, got {stride} and {size}")
        if stride * size > self.num_gpus:
            raise CostModelError(
                f"a group of {size} ranks {stride} apart needs {stride * size} GPUs; topology {self.name} has "
                f"{self.num_gpus}: use a topology with more GPUs (e.g. --gpus {stride * size})"
            )
        gpn = self.gpus_per_node
        if size == 1:
            return GroupSpan(1, stride, 1, 1, None, math.inf, math.inf, 0.0, math.inf, math.inf, 0.0)
        span = stride * size
        if span <= gpn and gpn % span == 0:  # whole groups inside one node
            k, nodes = size, 1
            partitions = [self._local_groups(stride, size, base) for base in (0,)]
        elif stride % gpn == 0:  # one member per node
            k, nodes, partitions = 1, size, []
        elif gpn % stride == 0 and span % gpn == 0:  # k consecutive members per node
            k, nodes = gpn // stride, span // gpn
            partitions = [self._local_groups(stride, k, 0)]
        else:
            k, nodes, partitions = self._irregular(stride, size)
        fabric = self.links.get("fabric")
        if nodes > 1 and fabric is None:  # cannot happen for a valid spec; guard anyway
            raise CostModelError(f"topology {self.name} spans nodes without a fabric")
        if k > 1:
            worst = self._worst_class([m for part in partitions for m in part])
            eff = self.links[worst].efficiency
            a2a = min(self._pattern(part, "all_to_all") for part in partitions) * eff
            ring = min(self._pattern(part, "ring") for part in partitions) * eff
            alpha_intra = self.links[worst].alpha
        else:
            worst, a2a, ring, alpha_intra = None, math.inf, math.inf, 0.0
        if nodes > 1:
            fabric_bw = fabric.bandwidth  # type: ignore[union-attr]
            solo = self.analysis.fabric_solo * fabric.efficiency  # type: ignore[union-attr]
            p2p = min(k * fabric_bw, solo)
            alpha_fabric = fabric.alpha  # type: ignore[union-attr]
        else:
            fabric_bw, p2p, alpha_fabric = math.inf, math.inf, 0.0
        return GroupSpan(size, stride, k, nodes, worst, a2a, ring, alpha_intra, fabric_bw, p2p, alpha_fabric)

    def _local_groups(self, stride: int, k: int, base: int) -> tuple[tuple[int, ...], ...]:
        """Local indices of the groups of ``k`` members ``stride`` apart inside one node."""
        gpn = self.gpus_per_node
        groups = []
        block = stride * k
        for start in range(0, gpn, block):
            for offset in range(stride):
                members = tuple(start + offset + i * stride for i in range(k) if start + offset + i * stride < gpn)
                if members:
                    groups.append(members)
        return tuple(groups)

    def _irregular(self, stride: int, size: int) -> tuple[int, int, list[tuple[tuple[int, ...], ...]]]:
        """Groups that do not align with node boundaries: enumerate them (numpy), keep the worst."""
        gpn = self.gpus_per_node
        span = stride * size
        world = (self.num_gpus // span) * span
        ranks = np.arange(world).reshape(-1, size, stride).transpose(0, 2, 1).reshape(-1, size)
        nodes = ranks // gpn
        spanned = 1 + (np.diff(nodes, axis=1) != 0).sum(axis=1)
        # ranks of one group on one node are consecutive members (ranks increase with i)
        counts = [np.unique(row, return_counts=True)[1].max() for row in nodes]
        k = int(max(counts))
        n_nodes = int(spanned.max())
        partitions: dict[tuple[tuple[int, ...], ...], None] = {}
        for node in range(min(self.num_nodes, world // gpn + 1)):
            members: dict[int, list[int]] = {}
            lo, hi = node * gpn, min((node + 1) * gpn, world)
            for r in range(lo, hi):
                gid = (r // span) * stride + r % stride
                members.setdefault(gid, []).append(r - lo)
            partitions[tuple(tuple(m) for m in members.values() if len(m) > 1)] = None
        parts = [p for p in partitions if p]
        return k, n_nodes, parts or [((0,),)]

    def _pattern(self, groups: tuple[tuple[int, ...], ...], pattern: str) -> float:
        key = (groups, pattern)
        value = self._patterns.get(key)
        if value is None:
            value = self._patterns[key] = self.analysis.pattern_bandwidth(groups, pattern)
        return value

    # ----- host side -----------------------------------------------------------------------------
    @property
    def host_ram_bytes(self) -> int:
        """RAM of one node's host (what offloading can fill, shared by its GPUs)."""
        return self.spec.node.host.ram_bytes

    @property
    def host_ram_per_gpu(self) -> float:
        return self.spec.node.host.ram_bytes / self.gpus_per_node

    @property
    def host_available_per_gpu(self) -> float:
        """One GPU's share of the host RAM the node's training processes can have (what the OS keeps
        excluded, ``host.reserved_fraction``)."""
        host = self.spec.node.host
        return host.ram_bytes * (1.0 - host.reserved_fraction) / self.gpus_per_node

    @property
    def host_memory_bandwidth_per_gpu(self) -> float:
        """Host DRAM bandwidth available to one GPU's CPU-side work (optimizer step), calibrated."""
        host = self.spec.node.host
        return host.memory_bandwidth / self.gpus_per_node * self.efficiency.host_memory

    @property
    def pcie_bandwidth(self) -> float:
        """Host<->GPU bandwidth per GPU per direction with every GPU copying at once, calibrated.

        This is what offloading gets: SPMD offload traffic hits all GPUs of a node together, so shared
        PCIe switch uplinks and host memory count.
        """
        return self.analysis.host_bandwidth_shared * self.efficiency.pcie

    @property
    def pcie_bandwidth_solo(self) -> float:
        """Host<->GPU bandwidth of one GPU copying alone (nominal, uncalibrated)."""
        return self.analysis.host_bandwidth_solo

    @property
    def fabric_bandwidth_per_gpu(self) -> float:
        """Calibrated per-GPU share of the node's NICs (0 for a single node without a fabric)."""
        fabric = self.links.get("fabric")
        return fabric.bandwidth if fabric else 0.0

    def peak_flops(self, dtype: str) -> float:
        return self.gpu.flops_for(dtype)
