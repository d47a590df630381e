"""GPU connectivity inside one node, from ``nvidia-smi topo -m`` text or from NVML.

Both sources produce a :class:`Connectivity`: a GPU x GPU matrix of nvidia-smi codes (``X``,
``NV#``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``), the NICs and their codes, and NUMA affinity.
The codes map onto the cost model's link classes (see ``sp_plan.cost_models.topology.spec.LinkClass``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sp_plan.runtime.errors import RuntimeConfigError

#: nvidia-smi code -> cost-model link class
CODE_CLASS = {
    "PIX": "pcie_switch",
    "PXB": "pcie_switch",
    "PHB": "pcie_host",
    "NODE": "pcie_host",
    "SYS": "cross_socket",
}
_NV = re.compile(r"^NV(\d+)$")
_LABEL = re.compile(r"^(GPU|NIC)(\d+)$")
#: The largest output we parse: 64 GPUs and NICs are a few KB; anything larger is not topo output.
MAX_TEXT = 1 << 20


@dataclass
class Connectivity:
    gpu_matrix: list[list[str]]
    nic_names: list[str] = field(default_factory=list)
    gpu_nic: list[list[str]] = field(default_factory=list)
    numa: list[int | None] = field(default_factory=list)
    source: str = ""

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_matrix)

    def nvlinks(self, i: int, j: int) -> int:
        match = _NV.match(self.gpu_matrix[i][j])
        return int(match.group(1)) if match else 0

    def link_class(self, i: int, j: int) -> str:
        code = self.gpu_matrix[i][j]
        if code == "X":
            return "self"
        if _NV.match(code):
            return "nvlink"
        try:
            return CODE_CLASS[code]
        except KeyError:
            raise RuntimeConfigError(f"unknown GPU link code {code!r} between GPU{i} and GPU{j}") from None

    def all_pairs_nvlink(self) -> bool:
        n = self.num_gpus
        return n > 1 and all(self.nvlinks(i, j) > 0 for i in range(n) for j in range(n) if i != j)

    def min_nvlinks(self) -> int:
        n = self.num_gpus
        return min((self.nvlinks(i, j) for i in range(n) for j in range(n) if i != j), default=0)

    def gpus_per_switch(self) -> int:
        """Largest set of GPUs that reach each other under PCIe switches only (PIX/PXB)."""
        n, best = self.num_gpus, 1
        for i in range(n):
            peers = [j for j in range(n) if j != i and self.gpu_matrix[i][j] in ("PIX", "PXB")]
            best = max(best, 1 + len(peers))
        return best

    def sockets(self) -> int:
        """Distinct NUMA nodes the GPUs hang off (SYS pairs imply at least two)."""
        known = {n for n in self.numa if n is not None}
        if known:
            return len(known)
        n = self.num_gpus
        return 2 if any(self.gpu_matrix[i][j] == "SYS" for i in range(n) for j in range(n)) else 1


def parse_nvidia_smi_topo(text: str) -> Connectivity:
    """Parse ``nvidia-smi topo -m``. Tolerates tabs or runs of spaces between columns."""
    if len(text) > MAX_TEXT:
        raise RuntimeConfigError("nvidia-smi topo output is implausibly large; not parsing it")
    lines = [line.rstrip() for line in text.splitlines()]
    header_index = next(
        (i for i, line in enumerate(lines) if line[:1].isspace() and re.search(r"\bGPU0\b", line)), None
    )
    if header_index is None:
        raise RuntimeConfigError("no GPU0 column header in nvidia-smi topo -m output; is this the right command?")
    columns = [tok for tok in lines[header_index].split() if _LABEL.match(tok)]
    gpu_cols = [c for c in columns if c.startswith("GPU")]
    nic_cols = [c for c in columns if c.startswith("NIC")]
    has_numa = "NUMA Affinity" in lines[header_index]
    rows: dict[str, list[str]] = {}
    numa: dict[str, int | None] = {}
    for line in lines[header_index + 1:]:
        tokens = line.split()
        if not tokens or not _LABEL.match(tokens[0]):
            if tokens and tokens[0].rstrip(":") == "Legend":
                break
            continue
        codes = tokens[1:1 + len(columns)]
        if len(codes) < len(columns):
            raise RuntimeConfigError(f"row {tokens[0]} of nvidia-smi topo -m has {len(codes)} of {len(columns)} columns")
        rows[tokens[0]] = codes
        rest = tokens[1 + len(columns):]
        if has_numa and len(rest) >= 2 and tokens[0].startswith("GPU"):
            numa[tokens[0]] = int(rest[1]) if rest[1].isdigit() else None
    missing = [g for g in gpu_cols if g not in rows]
    if missing:
        raise RuntimeConfigError(f"nvidia-smi topo -m lists columns {', '.join(missing)} without rows")
    gpu_index = [columns.index(g) for g in gpu_cols]
    nic_index = [columns.index(c) for c in nic_cols]
    matrix = [[rows[g][k] for k in gpu_index] for g in gpu_cols]
    gpu_nic = [[rows[g][k] for k in nic_index] for g in gpu_cols]
    names = {}
    for line in lines:
        match = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if match:
            names[match.group(1)] = match.group(2)
    for i, row in enumerate(matrix):
        if row[i] != "X":
            raise RuntimeConfigError(f"nvidia-smi topo -m: GPU{i} is not 'X' with itself; output is malformed")
    return Connectivity(
        gpu_matrix=matrix,
        nic_names=[names.get(c, c) for c in nic_cols],
        gpu_nic=gpu_nic,
        numa=[numa.get(g) for g in gpu_cols],
        source="nvidia-smi topo -m",
    )


#: NVML topology levels (nvmlGpuTopologyLevel_t) -> nvidia-smi codes.
NVML_LEVEL_CODE = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def connectivity_from_nvml(nvml: Any) -> Connectivity:
    """Build the matrix with NVML (``pynvml`` from nvidia-ml-py): common PCIe ancestors for every pair,
    and NVLink counts (direct GPU-GPU links, or links into NVSwitches, which connect all such GPUs)."""
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    bus = [_bus_id(nvml.nvmlDeviceGetPciInfo(h)) for h in handles]
    direct = [[0] * count for _ in range(count)]
    to_switch = [0] * count
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    for i, h in enumerate(handles):
        for link in range(max_links):
            try:
                if nvml.nvmlDeviceGetNvLinkState(h, link) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                    continue
                remote = _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
            except Exception:  # NVMLError_NotSupported on PCIe-only GPUs, or past the last link
                continue
            if remote in bus:
                direct[i][bus.index(remote)] += 1
            else:
                to_switch[i] += 1
    matrix = []
    for i in range(count):
        row = []
        for j in range(count):
            if i == j:
                row.append("X")
            elif direct[i][j] or (to_switch[i] and to_switch[j]):
                row.append(f"NV{direct[i][j] or min(to_switch[i], to_switch[j])}")
            else:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                row.append(NVML_LEVEL_CODE.get(int(level), "SYS"))
        matrix.append(row)
    numa: list[int | None] = []
    for h in handles:
        try:
            numa.append(int(nvml.nvmlDeviceGetNumaNodeId(h)))
        except Exception:
            numa.append(None)
    return Connectivity(gpu_matrix=matrix, numa=numa, source="NVML")


def _bus_id(info: Any) -> str:
    value = getattr(info, "busId", info)
    if isinstance(value, bytes):
        value = value.decode()
    return str(value).lower()
