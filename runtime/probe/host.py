"""Facts about this host that need no torch: CPU, RAM, sockets, RDMA NICs, GPU inventory via NVML."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: sysfs and procfs roots (tests point them at fixtures).
SYS = Path("/sys")
PROC = Path("/proc")
#: nvidia-smi must answer quickly; a hung driver must not hang the probe.
NVIDIA_SMI_TIMEOUT_S = 20


@dataclass
class NicInfo:
    name: str
    rate_bytes: float  # per direction
    link_layer: str  # InfiniBand | Ethernet


@dataclass
class HostFacts:
    hostname: str
    cpu_model: str
    logical_cpus: int
    physical_cores: int
    sockets: int
    ram_bytes: int
    nics: list[NicInfo] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HostFacts":
        data = dict(data)
        data["nics"] = [NicInfo(**n) for n in data.get("nics", [])]
        return cls(**data)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def host_facts() -> HostFacts:
    cpuinfo = _read(PROC / "cpuinfo")
    models = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    packages = set(re.findall(r"^physical id\s*:\s*(\d+)$", cpuinfo, re.M))
    cores_per_pkg = re.findall(r"^cpu cores\s*:\s*(\d+)$", cpuinfo, re.M)
    logical = os.cpu_count() or 1
    sockets = max(1, len(packages) or _numa_nodes())
    physical = int(cores_per_pkg[0]) * sockets if cores_per_pkg else logical
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    return HostFacts(
        hostname=socket.gethostname(),
        cpu_model=models[0].strip() if models else "",
        logical_cpus=logical,
        physical_cores=min(physical, logical),
        sockets=sockets,
        ram_bytes=int(ram),
        nics=rdma_nics(),
    )


def _numa_nodes() -> int:
    root = SYS / "devices/system/node"
    try:
        return sum(1 for p in root.iterdir() if re.fullmatch(r"node\d+", p.name))
    except OSError:
        return 0


_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


def rdma_nics() -> list[NicInfo]:
    """RDMA ports from sysfs (``/sys/class/infiniband/<dev>/ports/<n>/{rate,link_layer,state}``)."""
    root = SYS / "class/infiniband"
    nics: list[NicInfo] = []
    try:
        devices = sorted(root.iterdir())
    except OSError:
        return nics
    for dev in devices:
        try:
            ports = sorted((dev / "ports").iterdir())
        except OSError:
            continue
        for port in ports:
            state = _read(port / "state")
            if state and "ACTIVE" not in state:
                continue
            match = _RATE.search(_read(port / "rate"))
            if not match:
                continue
            layer = _read(port / "link_layer").strip() or "InfiniBand"
            nics.append(NicInfo(name=f"{dev.name}/{port.name}", rate_bytes=float(match.group(1)) * 1e9 / 8,
                                link_layer=layer))
    return nics


def nvidia_smi_topo() -> str | None:
    """``nvidia-smi topo -m`` output, or None when the tool is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def load_nvml():
    """The ``pynvml`` module (nvidia-ml-py), initialised, or None when unavailable."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # driver not loaded, no GPU
        return None
    return pynvml


@dataclass
class PcieLink:
    generation: int
    width: int


def nvml_pcie_links(nvml) -> list[PcieLink]:
    links = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            links.append(PcieLink(int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                                  int(nvml.nvmlDeviceGetMaxPcieLinkWidth(h))))
        except Exception:
            links.append(PcieLink(0, 0))
    return links
