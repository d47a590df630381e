"""The topology file format: a homogeneous cluster of identical nodes, as pydantic models.

A topology file describes ONE node template (its GPUs, the GPU<->GPU interconnect, the PCIe tree, the
host) plus how many such nodes there are and the fabric between them. Real training clusters are
homogeneous, and describing a node once is what keeps a 4096-GPU topology small and fast to query.
The graph (:mod:`sp_plan.cost_models.topology.graph`) is built from this description.

Every size is bounded so a hostile or mistyped file fails validation instead of exhausting memory.
Units: bytes, bytes/s (per direction), seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..gpu_spec import GPUSpec

#: GPU<->GPU connection classes, fastest first. They follow ``nvidia-smi topo -m``'s vocabulary:
#: nvlink = NV#; pcie_switch = PIX/PXB (peer-to-peer under PCIe switches); pcie_host = PHB/NODE
#: (through a CPU's host bridge); cross_socket = SYS (over UPI/xGMI between sockets); loopback =
#: ranks that are processes on one CPU host (gloo over shared memory / TCP loopback); fabric = the
#: inter-node network (InfiniBand, RoCE, EFA).
LinkClass = Literal["nvlink", "pcie_switch", "pcie_host", "cross_socket", "loopback", "fabric"]
LINK_CLASSES: tuple[str, ...] = ("nvlink", "loopback", "pcie_switch", "pcie_host", "cross_socket", "fabric")

InterconnectKind = Literal["nvswitch", "pcie", "loopback"]
FabricKind = Literal["infiniband", "roce", "efa", "ethernet"]

#: Bounds. A node larger than an NVL72 rack x 3 or a cluster larger than 2^20 GPUs is a typo.
MAX_GPUS_PER_NODE = 256
MAX_NODES = 1 << 17
MAX_TOTAL_GPUS = 1 << 20
MAX_NICS_PER_NODE = 64
MAX_SOCKETS = 8
#: 1 PB/s per link and 1 s per hop bound bandwidths and latencies far beyond any real link; 1 MB/s is
#: below any link a GPU trains over (a 1e-300 bandwidth passed ``gt=0`` and made every step time infinite).
MAX_BANDWIDTH = 1e15
MIN_BANDWIDTH = 1e6
MAX_LATENCY = 1.0
MAX_RAM_BYTES = 1 << 50
#: Smallest efficiency (achieved / nominal) a topology may state. Probes and NCCL reach 0.3-0.95; below
#: 1/1000 the figure is a unit mix-up or a typo, and would turn into predictions of centuries per step.
MIN_EFFICIENCY = 1e-3
_Bandwidth = Field(ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH, description="bytes/s per direction")
_Latency = Field(ge=0, le=MAX_LATENCY, description="seconds per hop")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class InterconnectSpec(_Strict):
    """How GPUs inside one node reach each other.

    ``nvswitch``: every GPU has ``bandwidth`` per direction into a non-blocking NVSwitch (all DGX/HGX
    boards since A100). ``pcie``: no NVLink; peer traffic goes through the PCIe tree described in
    :class:`PCIeSpec` (``bandwidth`` is ignored). ``loopback``: CPU processes on one host (the probe's
    CPU topology); ``bandwidth`` is the measured process-to-process copy bandwidth.
    """

    kind: InterconnectKind
    generation: str = Field(default="", max_length=40, description="e.g. NVLink4; informational")
    bandwidth: float | None = Field(default=None, ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH, description="per GPU, bytes/s per direction")
    latency: float = Field(default=0.0, ge=0, le=MAX_LATENCY, description="seconds per hop (unused for pcie)")

    @model_validator(mode="after")
    def _bandwidth_needed(self) -> "InterconnectSpec":
        if self.kind in ("nvswitch", "loopback") and self.bandwidth is None:
            raise ValueError(f"interconnect kind {self.kind} needs a bandwidth (bytes/s per GPU per direction)")
        return self


class PCIeSpec(_Strict):
    """The PCIe tree: GPUs (and NICs) under PCIe switches under CPU sockets.

    ``bandwidth`` is one x16 link per direction (host<->GPU and GPU<->switch); the switch uplink to the
    CPU defaults to the same (one x16 uplink shared by the GPUs below it, as in most 8-GPU servers).
    """

    generation: str = Field(default="", max_length=40)
    bandwidth: float = _Bandwidth
    latency: float = _Latency
    gpus_per_switch: int = Field(default=2, ge=1, le=MAX_GPUS_PER_NODE)
    switch_uplink_bandwidth: float | None = Field(default=None, ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH)


class HostSpec(_Strict):
    """The CPU side of a node: what offloading can use and how fast the CPU optimizer runs."""

    sockets: int = Field(default=2, ge=1, le=MAX_SOCKETS)
    cpu_cores: int = Field(ge=1, le=1 << 14)
    cpu_model: str = Field(default="", max_length=200)
    ram_bytes: int = Field(gt=0, le=MAX_RAM_BYTES)
    reserved_fraction: float = Field(
        default=0.05, ge=0.0, lt=1.0,
        description="share of ram_bytes the training processes cannot have: the kernel's page structures "
                    "(64 B per 4 KiB page, 1.6%), firmware and kernel reservations (MemTotal below the "
                    "installed RAM), page cache of code and data, node daemons")
    memory_bandwidth: float = Field(ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH, description="whole host, bytes/s")
    socket_link_bandwidth: float = Field(default=64e9, ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH, description="UPI/xGMI per direction")
    socket_link_latency: float = Field(default=1e-6, ge=0, le=MAX_LATENCY)


class NodeSpec(_Strict):
    gpus: int = Field(ge=1, le=MAX_GPUS_PER_NODE)
    interconnect: InterconnectSpec
    #: ``None`` only for loopback (CPU-rank) nodes, which have no devices on a PCIe bus.
    pcie: PCIeSpec | None = None
    host: HostSpec

    @model_validator(mode="after")
    def _pcie_needed(self) -> "NodeSpec":
        if self.pcie is None and self.interconnect.kind != "loopback":
            raise ValueError("node.pcie is required unless interconnect.kind is loopback")
        return self


class FabricSpec(_Strict):
    """The inter-node network as seen from one node: its NICs and the switch fabric behind them.

    The fabric is modelled as one non-blocking switch (a full-bisection fat tree) whose per-NIC
    bandwidth is divided by ``oversubscription`` (2.0 = a 2:1 tapered tree) for traffic between nodes.
    """

    name: str = Field(default="", max_length=60, description="preset name, e.g. ib-ndr")
    kind: FabricKind
    nics_per_node: int = Field(ge=1, le=MAX_NICS_PER_NODE)
    nic_bandwidth: float = Field(ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH, description="one NIC port, bytes/s per direction")
    latency: float = Field(ge=0, le=MAX_LATENCY, description="NIC to fabric, one side, seconds")
    oversubscription: float = Field(default=1.0, ge=1.0, le=64.0)


class LinkCalibration(_Strict):
    """Measured or hand-tuned parameters of one link class.

    ``alpha``: seconds per algorithm step over this class (launch + wire + switch latency), replacing
    the latency summed along the graph path. ``efficiency``: achieved / nominal bandwidth.
    ``bandwidth``: achieved per-GPU bandwidth in bytes/s per direction; the topology converts it into
    an efficiency against the class's nominal bandwidth (for ``fabric``: each GPU's share of its node's
    NICs when all GPUs of the node communicate at once). Give ``efficiency`` or ``bandwidth``, not both.
    """

    alpha: float | None = Field(default=None, ge=0, le=MAX_LATENCY)
    efficiency: float | None = Field(default=None, ge=MIN_EFFICIENCY, le=1.5)
    bandwidth: float | None = Field(default=None, ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH)
    fitted_from: str = Field(default="", max_length=500, description="how these numbers were obtained")

    @model_validator(mode="after")
    def _one_bandwidth_form(self) -> "LinkCalibration":
        if self.efficiency is not None and self.bandwidth is not None:
            raise ValueError("give either efficiency or bandwidth for a link class, not both")
        return self


#: Upper bound of a measured host overhead per step (seconds): beyond a minute it is a measurement error.
MAX_HOST_STEP_OVERHEAD_S = 60.0


class ComputeCalibration(_Strict):
    """Achievable fractions of peak, measured on this machine (``sp-plan probe``) or hand-tuned.

    ``matmul``, ``attention_forward``, ``attention_backward`` and ``memory`` are the asymptotic
    fractions (large GEMMs, long attention blocks, streaming kernels) that the shape-aware kernel
    model (:mod:`sp_plan.cost_models.kernels`) scales by each kernel's shape; left out (None), they come from
    the GPU's kernel file, which is fitted to published runs. Pinned-memory copies default to ~80% of
    the PCIe link and a CPU AdamW to ~50% of the host memory bandwidth."""

    matmul: float | None = Field(default=None, ge=MIN_EFFICIENCY, le=1.5)
    attention_forward: float | None = Field(default=None, ge=MIN_EFFICIENCY, le=1.5)
    attention_backward: float | None = Field(default=None, ge=MIN_EFFICIENCY, le=1.5)
    memory: float | None = Field(default=None, ge=MIN_EFFICIENCY, le=1.5)
    pcie: float = Field(default=0.80, ge=MIN_EFFICIENCY, le=1.5)
    host_memory: float = Field(default=0.50, ge=MIN_EFFICIENCY, le=1.5)
    #: CPU ranks only: host-side seconds per optimizer step that do not grow with the sequence.
    host_step_overhead_s: float = Field(
        default=0.0, ge=0.0, le=MAX_HOST_STEP_OVERHEAD_S,
        description=("Seconds per optimizer step of host-side work that does not grow with the sequence (eager "
                     "dispatch, autograd bookkeeping, FSDP2 hooks, the latency of each gloo collective as a "
                     "step meets it), added once per step. On CPU ranks it is a large part of a short step and "
                     "no kernel rate predicts it, so `sp-plan validate` measures it by running the plan at a "
                     "sixteenth of its length (runtime/host_overhead.py); 0 elsewhere (GPUs launch kernels "
                     "asynchronously, and the stack file's overheads cover what shows)."))


class CalibrationSpec(_Strict):
    source: str = Field(default="defaults", max_length=500)
    compute: ComputeCalibration = ComputeCalibration()
    links: dict[LinkClass, LinkCalibration] = Field(default_factory=dict)


class ProvenanceSpec(_Strict):
    """Where a (probed) topology came from, and what the probe could not measure."""

    tool: str = Field(default="", max_length=200)
    created: str = Field(default="", max_length=100)
    hosts: list[str] = Field(default_factory=list, max_length=MAX_NODES)
    measured: list[str] = Field(default_factory=list, max_length=200)
    not_measured: list[str] = Field(default_factory=list, max_length=200)
    notes: list[str] = Field(default_factory=list, max_length=200)


class TopologySpec(_Strict):
    """A whole cluster: ``nodes`` copies of ``node`` joined by ``fabric``."""

    name: str = Field(min_length=1, max_length=200)
    description: str = Field(default="", max_length=2000)
    #: A GPU preset name (``cost_models/data/gpus/<name>.yaml``) or an inline GPU description.
    gpu: str | GPUSpec
    nodes: int = Field(default=1, ge=1, le=MAX_NODES)
    node: NodeSpec
    fabric: FabricSpec | None = None
    calibration: CalibrationSpec = CalibrationSpec()
    provenance: ProvenanceSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "TopologySpec":
        if self.nodes > 1 and self.fabric is None:
            raise ValueError(f"{self.nodes} nodes need a fabric section (NICs and network) to connect them")
        if self.nodes * self.node.gpus > MAX_TOTAL_GPUS:
            raise ValueError(f"{self.nodes} nodes x {self.node.gpus} GPUs exceeds {MAX_TOTAL_GPUS} GPUs")
        return self

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.node.gpus
