"""Process groups from a plan: a DeviceMesh with one dim per registered layout degree (today the 5-D
dp_replicate, dp_shard, ring, ulysses, tp; :mod:`sp_plan.cost_models.degrees`).

All dims are always present, size 1 included, so code can index any of them without checking
which parallelisms a plan uses. Rank order follows the mesh order (tp innermost), so consecutive
ranks, which torchrun places on the same node, share the innermost dims and their fast links.

Two flattened dims are added on top, from the degrees' roles:

* ``sp`` = ring x ulysses (the ``sequence`` degrees), the sequence-parallel group (Ulysses innermost, as
  the USP layout expects);
* ``fsdp`` = dp_shard x ring x ulysses (the ``shards_state`` degrees), the group ZeRO/FSDP shards
  parameters over
  (:attr:`sp_plan.cost_models.layout.Layout.shard_group`).

With expert parallelism (``Layout.ep > 1``) the ``fsdp`` dim is unflattened into ``expert_data`` x ``ep``
(:attr:`RuntimeMesh.expert_mesh`): ``ep`` is the innermost ``ep`` ranks of the shard group (the token dispatch
group the planner prices, :func:`sp_plan.cost_models.placement.expert_group_shapes`), ``expert_data`` the
ranks ``ep`` apart that hold the same experts (torchtitan's ``efsdp``).

Before creating any group, the launch is checked against the plan: world size, and on CUDA the
processes per node against the visible GPUs, each mismatch with a one-line fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from pydantic import ValidationError

from sp_plan.cost_models.errors import explain_validation_error
from sp_plan.cost_models import degrees
from sp_plan.cost_models.layout import Layout
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.cost_models.json_io import json_loads
from sp_plan.cost_models.yaml_io import safe_load
from sp_plan.runtime.cpu_affinity import pin_cpu_rank

#: Plan files are a few KB; anything much larger is not a plan (and is not parsed).
PLAN_FILE_MAX_BYTES = 4 << 20
SP_DIM = "sp"
FSDP_DIM = "fsdp"
#: The expert-parallel dims (named like the planner's process groups), present when ``Layout.ep > 1``.
EP_DIM = "ep"
EXPERT_DATA_DIM = "expert_data"


# ----- plan -> Layout ----------------------------------------------------------------------------


def _layout_from_mapping(data: Mapping, where: str) -> Layout:
    try:
        return Layout(**dict(data))
    except ValidationError as exc:
        raise RuntimeConfigError(str(explain_validation_error(exc, f"layout in {where}"))) from None
    except TypeError as exc:  # non-string keys
        raise RuntimeConfigError(f"invalid layout in {where}: {exc}") from None


def _read_plan_file(path: Path) -> object:
    if not path.is_file():
        raise RuntimeConfigError(f"plan file {path} does not exist: pass the path of a plan written by sp-plan")
    size = path.stat().st_size
    if size > PLAN_FILE_MAX_BYTES:
        raise RuntimeConfigError(
            f"plan file {path} is {size} bytes, more than the {PLAN_FILE_MAX_BYTES} a plan can be: "
            "is it the right file?"
        )
    text = path.read_text()
    try:
        return json_loads(text) if path.suffix.lower() == ".json" else safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
        raise RuntimeConfigError(f"plan file {path} is not valid {kind}: {first}") from None


def load_layout(plan: Layout | Mapping | str | os.PathLike) -> Layout:
    """The Layout of a plan: a Layout, a mapping (a plan with a ``layout`` key, or the degrees), or a file.

    Plan files are YAML or JSON (by suffix) with a ``layout:`` mapping of the degrees; other
    top-level keys (the planner's estimate, reasons, ...) are ignored here.
    """
    if isinstance(plan, Layout):
        return plan
    if isinstance(plan, Mapping):
        data = plan.get("layout", plan)
        where = "the plan"
    else:
        path = Path(plan)
        where = str(path)
        document = _read_plan_file(path)
        if not isinstance(document, Mapping) or not isinstance(document.get("layout"), Mapping):
            raise RuntimeConfigError(
                f"plan file {path} has no 'layout:' mapping; expected e.g. 'layout: {{ulysses: 4, ring: 2}}' "
                f"with keys among {', '.join(degrees.mesh_dims())}"
            )
        data = document["layout"]
    if not isinstance(data, Mapping):
        raise RuntimeConfigError(f"the layout in {where} must be a mapping of {', '.join(degrees.mesh_dims())} to "
                                 "degrees")
    return _layout_from_mapping(data, where)


# ----- launch checks -------------------------------------------------------------------------------


def _launch_hint(layout: Layout, gpus_per_node: int | None) -> str:
    world = layout.world
    if gpus_per_node and world > gpus_per_node and world % gpus_per_node == 0:
        return f"torchrun --nnodes {world // gpus_per_node} --nproc-per-node {gpus_per_node} ..."
    return f"torchrun --nproc-per-node {world} ..."


def check_launch(
    layout: Layout,
    world_size: int,
    *,
    device_type: str,
    local_world_size: int,
    visible_devices: int,
) -> None:
    """Raise a one-line RuntimeConfigError when the launched job cannot run ``layout``.

    Pure (no torch.distributed calls), so every branch is unit-testable without a cluster.
    """
    gpus = visible_devices if device_type == "cuda" else None
    if world_size != layout.world:
        raise RuntimeConfigError(
            f"plan needs {layout.world} ranks ({layout.describe()}) but torchrun launched {world_size}: launch "
            f"with {_launch_hint(layout, gpus)}, or make a plan for {world_size} GPUs"
        )
    if device_type == "cuda":
        if visible_devices < 1:
            raise RuntimeConfigError(
                "device 'cuda' requested but no GPU is visible (check CUDA_VISIBLE_DEVICES and the driver), "
                "or run on CPU with device_type='cpu'"
            )
        if local_world_size > visible_devices:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
            raise RuntimeConfigError(
                f"torchrun started {local_world_size} processes on this node but only {visible_devices} GPUs are "
                f"visible{where}: use --nproc-per-node {visible_devices} with more nodes, or expose more GPUs"
            )


# ----- mesh ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeMesh:
    """The plan's layout, its DeviceMesh (one dim per degree), and the flattened ``sp`` and ``fsdp`` 1-D meshes.

    The flattened meshes are kept here rather than looked up on the root mesh, which PyTorch is
    deprecating (2.11+).
    """

    layout: Layout
    device_mesh: dist.device_mesh.DeviceMesh
    sp_mesh: dist.device_mesh.DeviceMesh
    fsdp_mesh: dist.device_mesh.DeviceMesh
    device: torch.device
    #: The ``fsdp`` dim unflattened into (``expert_data``, ``ep``) when the plan has ``ep > 1``, else None.
    expert_mesh: dist.device_mesh.DeviceMesh | None = None

    def __getitem__(self, name: str):
        """The 1-D mesh of a mesh dim (``dp_replicate`` ... ``tp``), a flattened dim (``sp``, ``fsdp``) or, with
        expert parallelism, an expert dim (``ep``, ``expert_data``)."""
        if name == SP_DIM:
            return self.sp_mesh
        if name == FSDP_DIM:
            return self.fsdp_mesh
        if name in (EP_DIM, EXPERT_DATA_DIM):
            if self.expert_mesh is None:
                raise RuntimeConfigError(f"the {name} mesh dim exists only under expert parallelism; this plan has "
                                         "ep=1")
            return self.expert_mesh[name]
        if name not in degrees.mesh_dims():
            raise RuntimeConfigError(
                f"unknown mesh dim {name!r}; use one of {', '.join(degrees.mesh_dims() + (SP_DIM, FSDP_DIM))}"
            )
        return self.device_mesh[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()


def _flatten(sub_mesh, name: str):
    # DeviceMesh._flatten (torch >= 2.4) is private, but it is how torchtitan builds its flattened dims too.
    return sub_mesh._flatten(name)


def process_group_backend(device_type: str) -> str:
    """The default process group's backend: gloo on CPU; on CUDA, NCCL for GPU tensors *and* gloo for CPU
    tensors (as torchtitan does for async checkpoints). The attention ops' per-call shape agreement check
    all-gathers a few int64 on CPU: over gloo it never waits for the GPU, where an NCCL-only group would
    force a device-to-host copy (a stream sync) on every attention call."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init_default_group(device_type: str) -> None:
    """The default process group from torchrun's environment, or a one-rank group in a plain process."""
    backend = process_group_backend(device_type)
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        if device_type == "cpu":
            pin_cpu_rank()
        dist.init_process_group(backend)


def _init_process_group(layout: Layout, device_type: str) -> None:
    if "WORLD_SIZE" not in os.environ and layout.world != 1:
        raise RuntimeConfigError(
            f"plan needs {layout.world} ranks ({layout.describe()}) but this process was not started by "
            f"torchrun: launch with {_launch_hint(layout, None)}"
        )
    init_default_group(device_type)


def build_mesh(plan: Layout | Mapping | str | os.PathLike, *, device_type: str | None = None) -> RuntimeMesh:
    """Check the launch against ``plan`` and build its DeviceMesh (one dim per degree) plus the ``sp``/``fsdp`` dims.

    Initialises the default process group from torchrun's environment when needed (NCCL plus gloo for CPU
    tensors on CUDA, gloo on CPU) and, on CUDA, selects GPU ``LOCAL_RANK``. ``device_type`` defaults to CUDA when
    available.
    """
    from torch.distributed.device_mesh import init_device_mesh

    layout = load_layout(plan)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise RuntimeConfigError(f"device_type {device_type!r} is not supported: use 'cuda' or 'cpu'")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    visible = torch.cuda.device_count() if device_type == "cuda" else 0
    check_launch(layout, world, device_type=device_type, local_world_size=local_world, visible_devices=visible)
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        _init_process_group(layout, device_type)
    dims = degrees.mesh_dims()
    shape = tuple(layout.degrees()[dim] for dim in dims)
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=dims)
    sp_mesh = _flatten(device_mesh[degrees.with_role("sequence")], SP_DIM)
    fsdp_mesh = _flatten(device_mesh[degrees.with_role("shards_state")], FSDP_DIM)
    return RuntimeMesh(layout=layout, device_mesh=device_mesh, sp_mesh=sp_mesh, fsdp_mesh=fsdp_mesh, device=device,
                       expert_mesh=expert_mesh(fsdp_mesh, layout))


def expert_mesh(fsdp_mesh: dist.device_mesh.DeviceMesh, layout: Layout) -> dist.device_mesh.DeviceMesh | None:
    """The (``expert_data``, ``ep``) mesh: the shard group's rank order split with ``ep`` innermost (None at
    ``ep=1``). Derived from the root mesh, so FSDP2 can combine its dims with the others (HSDP)."""
    if layout.ep == 1:
        return None
    # DeviceMesh._unflatten is private too (torch >= 2.9); torchtitan builds its ep/efsdp dims with it.
    if layout.shard_group % layout.ep:
        raise RuntimeConfigError(f"ep={layout.ep} does not divide the {layout.shard_group} ranks of the shard group "
                                 "(dp_shard x ring x ulysses) it is taken from; use an ep that divides it")
    return fsdp_mesh._unflatten(0, (layout.expert_data_parallel, layout.ep), (EXPERT_DATA_DIM, EP_DIM))
