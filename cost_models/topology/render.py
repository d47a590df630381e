"""Human-readable text for a topology (``sp-plan topo show``). GB = 1e9 bytes, GiB = 2^30 bytes."""

from __future__ import annotations

from ..compute_time import fractions
from ..errors import CostModelError
from ..profile import default_profile
from ..units import GB, GiB
from .topology import Topology

#: Pair-class abbreviations for the GPU matrix, in nvidia-smi's spirit.
_ABBREV = {
    "self": "X",
    "nvlink": "NVL",
    "pcie_switch": "PIX",
    "pcie_host": "PHB",
    "cross_socket": "SYS",
    "loopback": "LO",
    "fabric": "NET",
}
#: Larger nodes print the class counts instead of the full matrix.
MAX_MATRIX_GPUS = 16


def _gbs(value: float) -> str:
    return f"{value / GB:,.1f}"


def _tflops(value: float) -> str:
    """TFLOP/s with one decimal for GPUs, three significant digits for CPU-sized rates."""
    tera = value / 1e12
    return f"{tera:,.1f}" if tera >= 10 else f"{tera:.3g}"


def _compute_efficiencies(topology: Topology) -> str:
    """matmul / attention / HBM fractions the predictions use on this topology, each tagged with its origin.

    A topology leaves these unset (None) unless a probe or a user measured them; the prediction then uses
    the GPU's kernel model (fitted to published runs). Showing that value, labelled, tells the user what
    the estimates assume instead of failing on the unset field or hiding it.
    """
    c = topology.spec.calibration.compute
    try:
        used = fractions(topology, default_profile(topology.gpu.name))
        fallback = {"matmul": used.matmul, "attention_forward": used.attention_forward,
                    "attention_backward": used.attention_backward, "memory": used.memory}
    except CostModelError:  # an inline GPU without a kernel file: nothing to fall back on
        fallback = {}
    parts = []
    for label, field in (("matmul", "matmul"), ("attention fwd", "attention_forward"),
                         ("bwd", "attention_backward"), ("HBM", "memory")):
        own = getattr(c, field)
        if own is not None:
            parts.append(f"{label} {own:.2f}")
        elif field in fallback:
            parts.append(f"{label} {fallback[field]:.2f} (kernel model)")
        else:
            parts.append(f"{label} unset")
    return ", ".join(parts)


def topology_json(topology: Topology) -> dict:
    """What ``topo show`` prints, for machines: the spec as a topology file holds it, plus the figures the
    cost model derives from it (effective link bandwidths and latencies, PCIe and fabric shares), in bytes/s
    and seconds."""
    spec = topology.spec
    derived = {
        "num_gpus": spec.num_gpus,
        "nodes": spec.nodes,
        "gpus_per_node": spec.node.gpus,
        "link_classes": {cls: {"nominal_bandwidth": link.nominal_bandwidth, "efficiency": link.efficiency,
                               "bandwidth": link.bandwidth, "alpha_s": link.alpha}
                         for cls, link in topology.links.items()},
        "pcie_bandwidth_per_gpu": topology.pcie_bandwidth if spec.node.pcie is not None else None,
        "fabric_bandwidth_per_gpu": topology.analysis.fabric_share if spec.fabric is not None else None,
        "host_ram_per_gpu": topology.host_ram_per_gpu,
    }
    return {"name": spec.name, "derived": derived, "spec": spec.model_dump(mode="json")}


def render(topology: Topology) -> str:
    spec, gpu = topology.spec, topology.gpu
    node, host = spec.node, spec.node.host
    lines = [f"Topology {spec.name}"]
    if spec.description:
        lines.append(f"  {spec.description}")
    lines.append(
        f"  {spec.nodes} node{'s' if spec.nodes != 1 else ''} x {node.gpus} GPUs = {spec.num_gpus} GPUs"
    )
    peaks = ", ".join(f"{k} {_tflops(v)}" for k, v in sorted(gpu.peak_flops.items(), key=lambda kv: -kv[1]))
    lines.append(
        f"  GPU {gpu.name}: {gpu.memory_bytes / GiB:,.2f} GiB, {gpu.memory_bandwidth / GB:,.0f} GB/s memory, "
        f"peak TFLOP/s: {peaks}"
    )
    ic = node.interconnect
    what = {"nvswitch": "NVSwitch", "pcie": "PCIe peer-to-peer", "loopback": "host loopback"}[ic.kind]
    ic_bw = f", {_gbs(ic.bandwidth)} GB/s per GPU per direction" if ic.bandwidth else ""
    lines.append(f"  intra-node: {what}{f' ({ic.generation})' if ic.generation else ''}{ic_bw}")
    if node.pcie is not None:
        pcie = node.pcie
        lines.append(
            f"  PCIe {pcie.generation or ''}: {_gbs(pcie.bandwidth)} GB/s per x16 link, {pcie.gpus_per_switch} GPUs per "
            f"switch; host<->GPU {_gbs(topology.pcie_bandwidth_solo)} GB/s alone, "
            f"{_gbs(topology.pcie_bandwidth)} GB/s each with all GPUs copying (calibrated)"
        )
    lines.append(
        f"  host per node: {host.sockets} socket{'s' if host.sockets != 1 else ''}"
        f"{f' ({host.cpu_model})' if host.cpu_model else ''}, {host.cpu_cores} cores, "
        f"{host.ram_bytes / GiB:,.0f} GiB RAM ({topology.host_ram_per_gpu / GiB:,.0f} GiB per GPU), "
        f"{_gbs(host.memory_bandwidth)} GB/s memory"
    )
    if spec.fabric is not None:
        fab = spec.fabric
        over = f", {fab.oversubscription:g}:1 oversubscribed" if fab.oversubscription > 1 else ""
        lines.append(
            f"  fabric: {fab.name or fab.kind} ({fab.kind}), {fab.nics_per_node} NICs per node x "
            f"{_gbs(fab.nic_bandwidth)} GB/s{over}; per GPU {_gbs(topology.analysis.fabric_share)} GB/s "
            f"(all GPUs sending), {_gbs(topology.analysis.fabric_solo)} GB/s alone"
        )
    else:
        lines.append("  fabric: none (single node)")
    lines.append("")
    lines.append("  Link classes (per GPU, per direction; alpha = latency per algorithm step):")
    lines.append(f"    {'class':<13}{'nominal GB/s':>14}{'efficiency':>12}{'effective GB/s':>16}{'alpha us':>10}")
    for cls, link in topology.links.items():
        lines.append(
            f"    {cls:<13}{_gbs(link.nominal_bandwidth):>14}{link.efficiency:>12.2f}{_gbs(link.bandwidth):>16}"
            f"{link.alpha * 1e6:>10.2f}"
        )
    cal = spec.calibration
    c = cal.compute
    lines.append("")
    lines.append(
        f"  Compute efficiency (fraction of peak): {_compute_efficiencies(topology)}; PCIe {c.pcie:.2f}, "
        f"host memory {c.host_memory:.2f}"
    )
    lines.append(f"  Calibration source: {cal.source}")
    for cls, entry in cal.links.items():
        if entry.fitted_from:
            lines.append(f"    {cls}: {entry.fitted_from}")
    lines.append("")
    lines.extend(_matrix(topology))
    if spec.provenance is not None:
        prov = spec.provenance
        lines.append("")
        lines.append(f"  Probed by {prov.tool or 'sp-plan probe'} {prov.created}".rstrip())
        if prov.measured:
            lines.append(f"    measured: {'; '.join(prov.measured)}")
        if prov.not_measured:
            lines.append(f"    not measured: {'; '.join(prov.not_measured)}")
        for note in prov.notes:
            lines.append(f"    note: {note}")
    return "\n".join(lines)


def _matrix(topology: Topology) -> list[str]:
    a = topology.analysis
    gpn = topology.gpus_per_node
    if gpn > MAX_MATRIX_GPUS:
        counts: dict[str, int] = {}
        for row in a.pair_class:
            for cls in row:
                if cls != "self":
                    counts[cls] = counts.get(cls, 0) + 1
        text = ", ".join(f"{cls} {n // 2}" for cls, n in counts.items())
        return [f"  GPU pairs inside a node: {text}"]
    legend = ", ".join(f"{v} = {k}" for k, v in _ABBREV.items() if k != "self")
    lines = [f"  GPU pairs inside a node ({legend}):"]
    lines.append("    " + " " * 6 + "".join(f"{'GPU' + str(j):>6}" for j in range(gpn)))
    for i in range(gpn):
        lines.append("    " + f"{'GPU' + str(i):<6}" + "".join(f"{_ABBREV[a.pair_class[i][j]]:>6}" for j in range(gpn)))
    return lines
