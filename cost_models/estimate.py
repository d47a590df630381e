"""``estimate``: everything the cost models predict for one model, run and layout, as one object.

Memory comes from :mod:`sp_plan.cost_models.memory`, communication volume from :mod:`sp_plan.cost_models.comm_volume`,
step time from :mod:`sp_plan.cost_models.time_model` on a :class:`~sp_plan.cost_models.topology.Topology`. The time
model is fed the memory model's host-memory figures, so offload traffic is priced on exactly the bytes
the memory model moved off the GPU.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from .comm_volume import CommEstimate
from .errors import CostModelError
from .gpu_spec import GPUSpec
from .layout import Layout
from .memory import HostMemory, MemoryAssumptions, MemoryBreakdown, MemoryDetail, memory_report
from .model_spec import ModelSpec
from .placement import Placement
from .profile import CostProfile, default_profile
from .time_model import OffloadTraffic, TimeEstimate, comm_and_time
from .topology import Topology, default_topology
from .train_spec import TrainSpec


class EstimateDetail(MemoryDetail):
    """Memory detail plus what the estimate was computed for."""

    model: str
    gpu: str
    seq_len: int
    micro_batch: int
    dtype: str
    topology: str
    #: The software stack the prediction assumes (``--stack``; ``+calibration`` when a calibration file
    #: overrides it).
    stack: str
    #: Host RAM one GPU's process may use for offloaded state (see :func:`offload_capacity`).
    host_capacity: float


class Estimate(BaseModel):
    """Per-GPU predictions for one layout. Bytes, seconds, FLOPs; see docs/memory_model.md and
    docs/topology_and_time.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layout: Layout
    memory: MemoryBreakdown
    host_memory: HostMemory
    #: Device memory fits (``memory.total <= memory.capacity``) and offloaded state fits in host RAM.
    fits: bool
    #: The device side: memory within capacity and the slice within the stack's kernels' reach
    #: (``detail.row_kernel_offset``, docs/memory_model.md section 15).
    device_fits: bool
    host_fits: bool
    detail: EstimateDetail
    comm: CommEstimate
    time: TimeEstimate
    placement: Placement | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict: raw units, keys as documented in the issues."""
        data = self.model_dump(mode="json")
        data["layout"] = self.layout.as_dict()
        return data


def offload_traffic(host: HostMemory) -> OffloadTraffic:
    """The memory model's host-resident bytes, as the time model's PCIe traffic inputs."""
    return OffloadTraffic(optimizer_bytes=host.optimizer, param_bytes=host.weights, checkpoint_bytes=host.checkpoints)


def offload_capacity(topology: Topology, assumptions: MemoryAssumptions) -> float:
    """Host bytes per GPU offloaded state may fill: the GPU's share of the RAM the OS leaves
    (``host.reserved_fraction``), less what its training process holds anyway (``host_process_bytes``).
    Planning to the node's full RAM would fail in practice: the long-context runs that offload every
    checkpoint are the ones bounded by host RAM."""
    return max(0.0, topology.host_available_per_gpu - assumptions.host_process_bytes)


def as_topology(hardware: Topology | GPUSpec, world: int) -> Topology:
    """A topology for ``hardware``: itself, or the natural cluster of that GPU preset for ``world`` GPUs."""
    if isinstance(hardware, Topology):
        return hardware
    return default_topology(hardware.name, world)


def estimate(model: ModelSpec, train: TrainSpec, layout: Layout, hardware: Topology | GPUSpec,
             assumptions: MemoryAssumptions | None = None, *, with_placement: bool = True,
             profile: CostProfile | None = None) -> Estimate:
    """Check the layout against the model and sequence, then predict memory, communication and time.

    ``profile``: the stack and kernel model to assume (default: this project's runtime on the topology's
    GPU); ``assumptions``, when given, replace the profile's memory assumptions.
    """
    layout.check_against(model, train.seq_len, train.tp_sequence_parallel)
    topology = as_topology(hardware, layout.world)
    if layout.world > topology.num_gpus:
        raise CostModelError(
            f"layout {layout.describe()} needs {layout.world} GPUs but topology {topology.name} has "
            f"{topology.num_gpus}; pass --gpus {layout.world} or a larger topology"
        )
    gpu = topology.gpu
    profile = (profile or default_profile(gpu.name)).with_assumptions(assumptions)
    report = memory_report(model, train, layout, gpu, profile.memory)
    host_capacity = offload_capacity(topology, profile.memory)
    host_fits = report.host_memory.total <= host_capacity
    detail = EstimateDetail(
        **report.detail.model_dump(),
        model=model.name,
        gpu=gpu.name,
        seq_len=train.seq_len,
        micro_batch=train.micro_batch,
        dtype=train.dtype,
        topology=topology.name,
        stack=profile.name,
        host_capacity=host_capacity,
    )
    ct = comm_and_time(model, train, layout, topology, offload=offload_traffic(report.host_memory),
                       with_placement=with_placement, profile=profile)
    return Estimate(
        layout=layout,
        memory=report.memory,
        host_memory=report.host_memory,
        fits=report.fits and host_fits,
        device_fits=report.fits,
        host_fits=host_fits,
        detail=detail,
        comm=ct.comm,
        time=ct.time,
        placement=ct.placement,
    )
