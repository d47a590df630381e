"""Run the probe: discover, measure (under torchrun: links too), fit, and write a topology file.

Launch alone for discovery and compute measurements, or under ``torchrun --nproc-per-node N`` (any
number of nodes) to also time all-reduce, all-to-all and ring send/recv inside nodes and across them.
Rank 0 writes the file; every rank must run the same command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from sp_plan.cost_models.topology import TopologySpec, save_topology
from sp_plan.runtime.cpu_affinity import pin_cpu_rank
from sp_plan.runtime.errors import RuntimeConfigError

from . import measure
from .build import DeviceFacts, ProbeFacts, build_spec
from .connectivity import Connectivity, connectivity_from_nvml, parse_nvidia_smi_topo
from .host import host_facts, load_nvml, nvidia_smi_topo, nvml_pcie_links

#: Default message sizes (bytes): small on CPU so the probe takes seconds, up to 256 MiB on GPUs.
DEFAULT_SIZES = {"cpu": [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20],
                 "cuda": [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]}
#: Seconds spent per compute measurement and on all collectives of one link class.
DEFAULT_BUDGET = {"cpu": (0.3, 3.0), "cuda": (1.0, 20.0)}


@dataclass
class ProbeResult:
    spec: TopologySpec | None  # None on ranks other than 0
    path: Path | None
    lines: list[str] = field(default_factory=list)


def run_probe(out: Path, sizes: list[int] | None = None, compute_budget_s: float | None = None,
              link_budget_s: float | None = None, name: str | None = None) -> ProbeResult:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device_kind = "cuda" if cuda else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    started_here = False
    if world > 1 and not dist.is_initialized():
        if not cuda:
            pin_cpu_rank()  # as the runtime's ranks run, so the rates probed are theirs
        dist.init_process_group("nccl" if cuda else "gloo")
        started_here = True
    try:
        return _probe(out, world, device, device_kind, sizes or DEFAULT_SIZES[device_kind],
                      compute_budget_s or DEFAULT_BUDGET[device_kind][0],
                      link_budget_s or DEFAULT_BUDGET[device_kind][1], name)
    finally:
        if started_here:
            dist.barrier()
            dist.destroy_process_group()


def _gather(obj: object, world: int) -> list:
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _probe(out: Path, world: int, device: torch.device, kind: str, sizes: list[int], compute_budget: float,
           link_budget: float, name: str | None) -> ProbeResult:
    rank = dist.get_rank() if world > 1 else 0
    host = host_facts()
    hostnames = _gather(host.hostname, world)
    hosts = list(dict.fromkeys(hostnames))
    counts = [hostnames.count(h) for h in hosts]
    if len(set(counts)) != 1 or any(hostnames[i] != hosts[i // counts[0]] for i in range(world)):
        raise RuntimeConfigError(
            "ranks must be numbered node by node with the same count per node (torchrun does this); got "
            + ", ".join(f"{h}: {c}" for h, c in zip(hosts, counts))
        )
    gpn = counts[0]
    measured: list[str] = []
    not_measured: list[str] = []
    notes: list[str] = []

    # ----- compute (every rank at once: CPU ranks share the host's cores as in training) -----
    threads = max(1, host.physical_cores // gpn)
    if kind == "cpu":
        # Measure with the threads this rank trains with (torchrun gives each rank OMP_NUM_THREADS=1):
        # the probe runs inside validate and auto_configure, so it must neither change the count nor
        # measure at another one. More threads than cores, or threads left idle, are the run's own.
        threads = torch.get_num_threads()
        notes.append(f"CPU rates measured per rank with {gpn} rank(s) x {threads} thread(s) on {host.physical_cores} "
                     "core(s), all ranks at once: a rank's share of the cores, valid for runs with as many ranks")
    matmul: dict[str, float] = {}
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32} if kind == "cpu" else {"bf16": torch.bfloat16}
    for label, dtype in dtypes.items():
        try:
            matmul[label] = measure.matmul_flops(device, dtype, compute_budget)
        except RuntimeError as exc:  # dtype unsupported on this device
            not_measured.append(f"{label} matmul ({exc.__class__.__name__})")
    attn_f = attn_b = None
    # GPUs: in bf16, like the matmul peak it is compared with. CPUs: in fp32, the dtype CPU ranks train in
    # (aten's CPU flash kernel computes in fp32 either way, so bf16 is no faster there).
    attention_dtype = "fp32" if kind == "cpu" else "bf16"
    try:
        attn_f, attn_b = measure.attention_flops(device, dtypes[attention_dtype], compute_budget)
    except RuntimeError as exc:
        not_measured.append(f"attention throughput ({exc.__class__.__name__})")
    copy_bw = measure.copy_bandwidth(device, compute_budget)
    h2d = measure.host_to_device_bandwidth(device, compute_budget) if kind == "cuda" else None
    cpu_copy = copy_bw if kind == "cpu" else _host_copy(threads, compute_budget)
    per_rank = _gather((matmul, attn_f, attn_b, copy_bw, h2d, cpu_copy), world)
    # The slowest rank sets the pace of SPMD work.
    matmul = {k: min(r[0].get(k, float("inf")) for r in per_rank) for k in matmul}
    attn_f = min((r[1] for r in per_rank if r[1]), default=None)
    attn_b = min((r[2] for r in per_rank if r[2]), default=None)
    copy_bw = min(r[3] for r in per_rank)
    h2d = min((r[4] for r in per_rank if r[4]), default=None)
    host_bw = sum(r[5] for r in per_rank[:gpn])  # node 0's ranks copying at once
    measured.append(
        "matmul " + ", ".join(f"{k} {v / 1e12:.3f} TFLOP/s" for k, v in matmul.items())
        + (f"; {attention_dtype} attention fwd {attn_f / 1e12:.3f}, bwd {attn_b / 1e12:.3f} TFLOP/s"
           if attn_f and attn_b else "")
        + f"; memory copy {copy_bw / 1e9:.1f} GB/s per rank; host memory {host_bw / 1e9:.1f} GB/s per node"
        + (f"; host-to-GPU {h2d / 1e9:.1f} GB/s" if h2d else "")
    )

    # ----- discovery (rank 0 describes its node; all nodes are assumed identical) -----
    connectivity: Connectivity | None = None
    pcie_links = []
    if kind == "cuda":
        nvml = load_nvml()
        if nvml is not None:
            connectivity = connectivity_from_nvml(nvml)
            pcie_links = nvml_pcie_links(nvml)
        else:
            text = nvidia_smi_topo()
            if text:
                connectivity = parse_nvidia_smi_topo(text)
                not_measured.append("PCIe link generation and width (NVML unavailable; nvidia-smi topo used)")
            else:
                not_measured.append("GPU connectivity (neither NVML nor nvidia-smi available)")
        name_ = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        not_measured.append("GPUs (no CUDA device: describing CPU ranks over gloo)")
        name_ = host.cpu_model or "cpu"
        memory = host.ram_bytes // gpn

    # ----- links -----
    intra: list = []
    inter: list = []
    if world == 1:
        not_measured.append("links (single process: launch under torchrun --nproc-per-node N to measure them)")
    else:
        nodes = len(hosts)
        groups = [dist.new_group(list(range(n * gpn, (n + 1) * gpn))) for n in range(nodes)] if gpn > 1 else []
        cross = [dist.new_group([n * gpn + i for n in range(nodes)]) for i in range(gpn)] if nodes > 1 else []
        if groups:
            mine = rank // gpn
            intra = measure.measure_collectives(groups[mine], list(range(mine * gpn, (mine + 1) * gpn)), sizes,
                                                device, link_budget)
        else:
            not_measured.append("intra-node links (one rank per node)")
        if cross:
            local = rank % gpn
            inter = measure.measure_collectives(cross[local], [n * gpn + local for n in range(nodes)], sizes,
                                                device, link_budget)

    if rank != 0:
        return ProbeResult(None, None)
    facts = ProbeFacts(
        hosts=hosts,
        local_world=gpn,
        host=host,
        device=DeviceFacts(kind=kind, name=name_, memory_bytes=memory, matmul_flops=matmul,
                           attention_forward_flops=attn_f, attention_backward_flops=attn_b,
                           attention_dtype=attention_dtype, attention_shape=measure.ATTENTION_SHAPE[kind],
                           memory_bandwidth=copy_bw, host_to_device=h2d),
        connectivity=connectivity,
        pcie_links=pcie_links,
        host_memory_bandwidth=host_bw,
        intra_samples=intra,
        inter_samples=inter,
        measured=measured,
        not_measured=not_measured,
        notes=notes,
    )
    spec = build_spec(facts, name)
    path = save_topology(spec, out)
    lines = [f"probed {len(hosts)} node(s) x {gpn} rank(s) ({kind}); wrote {path}"]
    lines += [f"  measured: {m}" for m in spec.provenance.measured]
    lines += [f"  not measured: {m}" for m in spec.provenance.not_measured]
    lines += [f"  note: {m}" for m in spec.provenance.notes]
    return ProbeResult(spec, path, lines)


def _host_copy(threads: int, budget: float) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure.copy_bandwidth(torch.device("cpu"), budget)
    finally:
        torch.set_num_threads(previous)


__all__ = ["ProbeResult", "run_probe"]
