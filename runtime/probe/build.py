"""Assemble a topology file from what the probe discovered and measured (pure Python, no torch).

Order of work: describe the hardware from discovery (GPU model, NVLink/PCIe connectivity, host, NICs)
with nominal bandwidths; build that (uncalibrated) Topology; ask it the nominal per-GPU bandwidth of
every measured collective's traffic pattern on the measured group; fit alpha and the achieved
efficiency per link class against those nominal figures (scipy); write both into the file.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
import statistics
from dataclasses import dataclass, field

from sp_plan.cost_models.link_fit import AlphaBetaFit, TimingSample, fit_alpha_beta, link_calibration, model_terms
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.gpu_spec import GPUSpec, get_gpu_preset
from sp_plan.cost_models.kernels import attention_shape_efficiency, prior_kernel_model
from sp_plan.cost_models.topology import (
    CalibrationSpec,
    ComputeCalibration,
    FabricSpec,
    HostSpec,
    InterconnectSpec,
    NodeSpec,
    PCIeSpec,
    ProvenanceSpec,
    Topology,
    TopologySpec,
)
from sp_plan.cost_models.topology.spec import MAX_GPUS_PER_NODE, MAX_NICS_PER_NODE

from .connectivity import Connectivity
from .host import HostFacts, PcieLink

#: (pattern on the device name, GPU preset). Order matters: more specific first.
GPU_NAME_PRESETS: tuple[tuple[str, str], ...] = (
    (r"H200", "h200"),
    (r"H100", "h100-80gb"),
    (r"B200", "b200"),
    (r"A100.*80\s*GB", "a100-80gb"),
    (r"A100", "a100-40gb"),
    (r"L40S", "l40s"),
)
#: NVLink bandwidth per link per direction: NVLink3/4 25 GB/s (A100: 12 links, H100: 18), NVLink5
#: 50 GB/s (B200: 18 links).
NVLINK_LINK_BANDWIDTH = {"b200": 50e9}
NVLINK_LINK_BANDWIDTH_DEFAULT = 25e9
#: PCIe per-lane bandwidth per direction after encoding, bytes/s (gen3 8 GT/s 128b/130b, ...).
PCIE_LANE_BANDWIDTH = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
#: When NVML cannot tell: the PCIe generation each GPU preset ships with.
PRESET_PCIE_GEN = {"a100-40gb": 4, "a100-80gb": 4, "h100-80gb": 5, "h200": 5, "b200": 5, "l40s": 4}
#: Latencies used when a hop cannot be measured: NVLink/PCIe hop and NIC-to-fabric, typical values.
DEFAULT_HOP_LATENCY = 0.5e-6
DEFAULT_FABRIC_LATENCY = 2.0e-6
#: Host DRAM bandwidth when not measured: a conservative 10 GB/s per core.
HOST_BANDWIDTH_PER_CORE = 10e9


@dataclass
class DeviceFacts:
    """Rank 0's device and what its compute measured (achieved FLOP/s and bytes/s)."""

    kind: str  # "cuda" | "cpu"
    name: str
    memory_bytes: int
    matmul_flops: dict[str, float] = field(default_factory=dict)
    attention_forward_flops: float | None = None
    attention_backward_flops: float | None = None
    #: The dtype and (batch, heads, seq, head_dim) of the causal attention benchmark: the CPU fractions are
    #: taken against that dtype's matmul rate and corrected for the shape (see :func:`_cpu_attention`).
    attention_dtype: str = "bf16"
    attention_shape: tuple[int, int, int, int] | None = None
    memory_bandwidth: float | None = None
    host_to_device: float | None = None


@dataclass
class ProbeFacts:
    hosts: list[str]
    local_world: int
    host: HostFacts
    device: DeviceFacts
    connectivity: Connectivity | None = None
    pcie_links: list[PcieLink] = field(default_factory=list)
    host_memory_bandwidth: float | None = None
    intra_samples: list[TimingSample] = field(default_factory=list)
    inter_samples: list[TimingSample] = field(default_factory=list)
    measured: list[str] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return len(self.hosts)


def match_gpu_preset(name: str, memory_bytes: int) -> str | None:
    for pattern, preset in GPU_NAME_PRESETS:
        if re.search(pattern, name, re.I):
            if preset == "a100-40gb" and memory_bytes > 60 * 2**30:
                return "a100-80gb"
            return preset
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "device"


def build_spec(facts: ProbeFacts, name: str | None = None) -> TopologySpec:
    """The topology file for the probed cluster (see the module docstring)."""
    facts.not_measured = list(dict.fromkeys(facts.not_measured))
    gpu, compute = _device(facts)
    node = _node(facts, gpu)
    fabric = _fabric(facts, node)
    spec = TopologySpec(
        name=name or f"probe-{_slug(facts.hosts[0])}",
        description=f"measured by sp-plan probe on {', '.join(facts.hosts[:4])}"
                    + (f" and {len(facts.hosts) - 4} more" if len(facts.hosts) > 4 else ""),
        gpu=gpu,
        nodes=facts.nodes,
        node=node,
        fabric=fabric,
        calibration=CalibrationSpec(source="sp-plan probe (uncalibrated links)", compute=compute),
    )
    links = {}
    topo = Topology(spec)
    for samples, label in ((facts.intra_samples, "intra"), (facts.inter_samples, "inter")):
        if not samples:
            continue
        try:
            cls, fit = _fit_class(topo, samples, label)
        except CostModelError as exc:  # e.g. latency-bound timings: keep nominal figures, say so
            facts.not_measured.append(f"{label}-node link calibration ({exc})")
            continue
        links[cls] = link_calibration(fit, f"probe {label}-node {', '.join(sorted({s.collective for s in samples}))}")
        facts.measured.append(f"{cls} link: {fit.describe()}")
    calibration = CalibrationSpec(
        source=f"sp-plan probe {_dt.date.today().isoformat()}" + (" (links fitted)" if links else ""),
        compute=compute,
        links=links,
    )
    return spec.model_copy(update={
        "calibration": calibration,
        "provenance": ProvenanceSpec(
            tool="sp-plan probe",
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            hosts=facts.hosts,
            measured=facts.measured,
            not_measured=facts.not_measured,
            notes=facts.notes,
        ),
    })


# ----- device and compute ------------------------------------------------------------------------


def _device(facts: ProbeFacts) -> tuple[str | GPUSpec, ComputeCalibration]:
    dev = facts.device
    measured_peak = max(dev.matmul_flops.values(), default=0.0)
    if dev.kind == "cuda":
        preset = match_gpu_preset(dev.name, dev.memory_bytes)
        if preset is not None:
            spec = get_gpu_preset(preset)
            peak = spec.flops_for("bf16")
            matmul = _ratio(dev.matmul_flops.get("bf16"), peak, 0.70, facts, "GPU matmul throughput")
            return preset, ComputeCalibration(
                matmul=matmul,
                attention_forward=_ratio(dev.attention_forward_flops, peak, 0.60, facts, "attention forward"),
                attention_backward=_ratio(dev.attention_backward_flops, peak, 0.50, facts, "attention backward"),
                memory=_ratio(dev.memory_bandwidth, spec.memory_bandwidth, 0.80, facts, "HBM bandwidth"),
                pcie=_pcie_efficiency(facts, preset),
            )
        facts.notes.append(f"GPU {dev.name!r} matches no preset; its peak is taken as the measured matmul rate")
    if measured_peak <= 0:
        raise CostModelError("the probe measured no matmul throughput, so it cannot describe this device")
    peaks = dict(dev.matmul_flops)
    if "bf16" in peaks:
        peaks.setdefault("fp16", peaks["bf16"])
    bandwidth = dev.memory_bandwidth or facts.host_memory_bandwidth or HOST_BANDWIDTH_PER_CORE
    gpu = GPUSpec(
        name=_slug(f"{'cpu' if dev.kind == 'cpu' else 'gpu'}-{dev.name}") if dev.name else dev.kind,
        memory_bytes=max(1, dev.memory_bytes),
        peak_flops=peaks,
        memory_bandwidth=bandwidth,
    )
    # The peak IS the measured rate, so matmul and memory run at efficiency 1; attention relative to it.
    matmul = 1.0
    if dev.kind == "cpu":
        attention_forward, attention_backward = _cpu_attention(dev, gpu.name, peaks, facts)
        # Ranks sharing cores can run attention (relative to its shape) faster than GEMMs, whose packed
        # blocks time slicing evicts from cache. Fractions above 1 are outside the kernel model's range
        # (sp-plan calibrate fits within it), so the peak is raised to the fastest kernel and the GEMM
        # fraction becomes rate / peak: every kernel keeps its measured rate.
        scale = max(1.0, attention_forward, attention_backward)
        if scale > 1.0:
            gpu = gpu.model_copy(update={"peak_flops": {k: v * scale for k, v in gpu.peak_flops.items()}})
            matmul, attention_forward, attention_backward = 1.0 / scale, attention_forward / scale, \
                attention_backward / scale
            facts.notes.append(f"attention ran at {scale:.2f}x the matmul rate (shape-corrected): peak FLOP/s "
                               f"raised by that factor, GEMMs at {matmul:.2f} of it")
    else:
        reference = peaks.get("bf16", measured_peak)
        attention_forward = _clamp((dev.attention_forward_flops or 0.6 * reference) / reference)
        attention_backward = _clamp((dev.attention_backward_flops or 0.5 * reference) / reference)
    return gpu, ComputeCalibration(
        matmul=matmul,
        attention_forward=attention_forward,
        attention_backward=attention_backward,
        memory=1.0,
        pcie=1.0,
        host_memory=1.0,
    )


def _cpu_attention(dev: DeviceFacts, name: str, peaks: dict[str, float], facts: ProbeFacts) -> tuple[float, float]:
    """Asymptotic attention fractions of CPU ranks, for the kernel model (cpu.yaml) to scale by shape.

    The time model prices attention as FLOPs / (peak[training dtype] x fraction x shape efficiency). The
    probe times one causal shape in ``dev.attention_dtype`` (fp32 on CPU), so the fraction is taken
    against that dtype's matmul rate, and divided by the shape efficiency the kernel model gives the
    benchmark's own shape, so that shape is not penalised twice. CPU attention is no faster in bf16
    (aten's CPU flash kernel accumulates in fp32 and is bound by its softmax, not its GEMMs), while bf16
    GEMMs run about twice as fast: a bf16 CPU run's attention is priced optimistically, and a note says so.
    """
    reference = peaks.get(dev.attention_dtype) or max(peaks.values())
    kernels = prior_kernel_model(name)
    params = kernels.attention_params("fa2")
    shape_eff = 1.0
    if dev.attention_shape is not None:
        b, h, s, d = dev.attention_shape
        shape_eff = attention_shape_efficiency(b * h, s, s, d, True, params, kernels.sms)
    out = []
    for measured, default, what in ((dev.attention_forward_flops, params.forward_fraction, "forward"),
                                    (dev.attention_backward_flops, params.backward_fraction, "backward")):
        if measured:
            out.append(_clamp(measured / (reference * shape_eff)))
        else:
            facts.not_measured.append(f"attention {what} (kept cpu.yaml's fraction {default:.2f})")
            out.append(default)
    if dev.attention_dtype != "bf16" and "bf16" in peaks:
        facts.notes.append(f"attention measured in {dev.attention_dtype}: its fractions are of the "
                           f"{dev.attention_dtype} matmul rate, so bf16 runs (whose GEMMs are faster) get "
                           "optimistic attention times")
    return out[0], out[1]


def _clamp(value: float) -> float:
    return min(max(value, 1e-3), 1.5)


def _ratio(measured: float | None, peak: float, default: float, facts: ProbeFacts, what: str) -> float:
    if not measured:
        facts.not_measured.append(f"{what} (kept the default efficiency {default:.2f})")
        return default
    return _clamp(measured / peak)


def _pcie_efficiency(facts: ProbeFacts, preset: str) -> float:
    nominal = _pcie_bandwidth(facts, preset)
    if facts.device.host_to_device and nominal:
        return _clamp(facts.device.host_to_device / nominal)
    facts.not_measured.append("host-to-GPU copy bandwidth (kept the default PCIe efficiency 0.80)")
    return 0.80


def _pcie_bandwidth(facts: ProbeFacts, preset: str | None) -> float:
    link = next((p for p in facts.pcie_links if p.generation in PCIE_LANE_BANDWIDTH and p.width), None)
    if link is not None:
        return PCIE_LANE_BANDWIDTH[link.generation] * link.width
    gen = PRESET_PCIE_GEN.get(preset or "", 4)
    return PCIE_LANE_BANDWIDTH[gen] * 16


# ----- node --------------------------------------------------------------------------------------


def _node(facts: ProbeFacts, gpu: str | GPUSpec) -> NodeSpec:
    host = facts.host
    gpn = facts.local_world
    if not 1 <= gpn <= MAX_GPUS_PER_NODE:
        raise CostModelError(f"{gpn} ranks per node is outside 1..{MAX_GPUS_PER_NODE}")
    host_bw = facts.host_memory_bandwidth or HOST_BANDWIDTH_PER_CORE * host.physical_cores
    conn = facts.connectivity
    sockets = max(host.sockets, conn.sockets() if conn else 1)
    host_spec = HostSpec(
        sockets=sockets,
        cpu_cores=max(1, host.physical_cores),
        cpu_model=host.cpu_model[:200],
        ram_bytes=max(1, host.ram_bytes),
        memory_bandwidth=host_bw,
    )
    if facts.device.kind == "cpu":
        bandwidth, latency = _loopback(facts)
        return NodeSpec(gpus=gpn, interconnect=InterconnectSpec(kind="loopback", generation="gloo", bandwidth=bandwidth,
                                                               latency=latency), host=host_spec)
    preset = gpu if isinstance(gpu, str) else None
    pcie = PCIeSpec(
        generation=f"gen{facts.pcie_links[0].generation}" if facts.pcie_links and facts.pcie_links[0].generation else "",
        bandwidth=_pcie_bandwidth(facts, preset),
        latency=DEFAULT_HOP_LATENCY,
        gpus_per_switch=min(conn.gpus_per_switch(), gpn) if conn else min(2, gpn),
    )
    if conn is not None and conn.num_gpus != gpn:
        facts.notes.append(f"{conn.num_gpus} GPUs visible but {gpn} ranks per node; describing {gpn} of them")
    if conn is not None and conn.num_gpus >= 2 and conn.all_pairs_nvlink():
        per_link = NVLINK_LINK_BANDWIDTH.get(preset or "", NVLINK_LINK_BANDWIDTH_DEFAULT)
        interconnect = InterconnectSpec(kind="nvswitch", generation=f"NV{conn.min_nvlinks()}",
                                        bandwidth=conn.min_nvlinks() * per_link, latency=DEFAULT_HOP_LATENCY)
    else:
        if conn is not None and any(conn.nvlinks(i, j) for i in range(conn.num_gpus) for j in range(conn.num_gpus)):
            facts.notes.append("NVLink connects only some GPU pairs; modelled as PCIe peer-to-peer (conservative)")
        if conn is None and gpn > 1:
            facts.not_measured.append("GPU interconnect (no NVML, no nvidia-smi): assumed PCIe peer-to-peer")
        interconnect = InterconnectSpec(kind="pcie", generation=pcie.generation)
    return NodeSpec(gpus=gpn, interconnect=interconnect, pcie=pcie, host=host_spec)


def _loopback(facts: ProbeFacts) -> tuple[float, float]:
    """Nominal bandwidth and per-hop latency of CPU ranks talking through the host."""
    bandwidth = facts.device.memory_bandwidth or facts.host_memory_bandwidth or 1e9
    if facts.intra_samples:
        try:
            fit = fit_alpha_beta(facts.intra_samples)
        except CostModelError as exc:
            # Latency-bound timings still measure the latency: gloo's hundreds of microseconds per step,
            # not a GPU hop's half microsecond, which would price a CPU run's many small collectives at
            # nothing.
            alpha = _latency_only(facts.intra_samples)
            facts.not_measured.append(f"rank-to-rank bandwidth ({exc}; assumed the memory copy bandwidth)")
            facts.measured.append(f"loopback latency {alpha * 1e6:.1f} us per step (latency-bound timings)")
            return bandwidth, alpha / 2
        # Two hops (rank -> host -> rank) per step in the graph.
        return fit.bandwidth or bandwidth, fit.alpha / 2
    facts.not_measured.append("rank-to-rank bandwidth (one rank: assumed the memory copy bandwidth)")
    return bandwidth, DEFAULT_HOP_LATENCY


def _latency_only(samples: list[TimingSample]) -> float:
    """Seconds per algorithm step from timings that do not grow with size: the median over the smallest
    message of each collective of its time divided by its steps (all-reduce 2(P-1), send/recv 1, the
    rest P-1)."""
    smallest: dict[str, TimingSample] = {}
    for sample in samples:
        if sample.collective not in smallest or sample.nbytes < smallest[sample.collective].nbytes:
            smallest[sample.collective] = sample
    per_step = [s.seconds / max(1.0, model_terms(s.collective, s.group_size, s.nbytes)[0]) for s in smallest.values()]
    return statistics.median(per_step)


# ----- fabric ------------------------------------------------------------------------------------


def _fabric(facts: ProbeFacts, node: NodeSpec) -> FabricSpec | None:
    nics = facts.host.nics
    if nics:
        kinds = {n.link_layer.lower() for n in nics}
        rate = max(n.rate_bytes for n in nics)
        fast = [n for n in nics if n.rate_bytes >= rate / 2]  # ignore slow management/storage ports
        return FabricSpec(
            name=f"probed-{'ib' if 'infiniband' in kinds else 'roce'}",
            kind="infiniband" if "infiniband" in kinds else "roce",
            nics_per_node=min(len(fast), MAX_NICS_PER_NODE),
            nic_bandwidth=rate,
            latency=DEFAULT_FABRIC_LATENCY,
        )
    if facts.nodes == 1:
        facts.not_measured.append("inter-node fabric (single host, no RDMA NICs found)")
        return None
    if not facts.inter_samples:
        raise CostModelError("several hosts but no inter-node timings; rerun the probe with links measured")
    try:
        fit = fit_alpha_beta(facts.inter_samples)
    except CostModelError as exc:
        raise CostModelError(f"cannot describe the network between hosts: {exc}; rerun with larger --sizes") from exc
    per_gpu = fit.bandwidth or 1e9
    facts.notes.append("no RDMA NICs found: the fabric is described by its measured per-GPU bandwidth")
    return FabricSpec(name="probed-ethernet", kind="ethernet", nics_per_node=1,
                      nic_bandwidth=per_gpu * node.gpus, latency=fit.alpha / 2)


# ----- link fits ---------------------------------------------------------------------------------


def _fit_class(topo: Topology, samples: list[TimingSample], label: str) -> tuple[str, AlphaBetaFit]:
    gpn = topo.gpus_per_node
    if label == "intra":
        span = topo.group(1, gpn)
        cls = span.intra_class or "loopback"
        nominal = {"all_to_all": span.a2a_bandwidth, "all_reduce": span.ring_bandwidth,
                   "all_gather": span.ring_bandwidth, "reduce_scatter": span.ring_bandwidth,
                   "send_recv": span.ring_bandwidth}
    else:
        span = topo.group(gpn, topo.num_nodes)
        cls = "fabric"
        nominal = {"all_to_all": span.fabric_bandwidth, "all_reduce": span.fabric_bandwidth,
                   "all_gather": span.fabric_bandwidth, "reduce_scatter": span.fabric_bandwidth,
                   "send_recv": span.fabric_p2p_bandwidth}
    relative = [s.model_copy(update={"nominal_bandwidth": nominal[s.collective]}) for s in samples
                if math.isfinite(nominal[s.collective])]
    return cls, fit_alpha_beta(relative)
