"""Map the mesh (today dp_replicate, dp_shard, ring, ulysses, tp) onto a topology's ranks.

Ranks are numbered node by node (rank = node x gpus_per_node + local GPU), and the mesh is laid out
row-major with ``tp`` innermost, as ``torch.distributed.init_device_mesh`` does:

    rank = (((dp_replicate_i x dp_shard + dp_shard_i) x ring + ring_i) x ulysses + ulysses_i) x tp + tp_i

so a dimension's process group is ``size`` ranks ``stride`` apart, where ``stride`` is the product of the
degrees inside it. Flattened runs of adjacent dims are groups too: the sequence-parallel group
(ring x ulysses), the ZeRO/FSDP shard group (dp_shard x ring x ulysses) and the data group that
reduces gradients and the loss (everything but tp). With expert parallelism (``Layout.ep``) two more
groups are carved out of the shard group (:func:`expert_group_shapes`). Each group's placement says how many ranks share a
node, how many nodes it spans, and which link class its traffic crosses, so collectives on that
dimension are costed on the right links.
"""

from __future__ import annotations

import math
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

from . import degrees
from .errors import CostModelError
from .layout import Layout
from .topology.topology import GroupSpan, Topology


def group_dims() -> dict[str, tuple[str, ...]]:
    """Process groups the cost model uses: name -> the mesh dims it spans (adjacent, outermost first).

    One group per degree (innermost first), then the flattened groups that follow from the degrees' roles:
    ``sp`` (the sequence-splitting dims), ``shard`` (where ZeRO/FSDP shards state) and ``data`` (every dim
    that holds the same weights: the group that reduces gradients and the loss).
    """
    key = degrees.registry_version()
    if _GROUP_DIMS[0] != key:
        groups = {name: (name,) for name in degrees.innermost_first()}
        groups.update(sp=degrees.with_role("sequence"), shard=degrees.with_role("shards_state"),
                      data=degrees.without_role("weights"))
        for name, dims in groups.items():
            if not degrees.adjacent(dims):
                raise CostModelError(f"the {name} group spans {', '.join(dims)}, which are not adjacent in the mesh "
                                     f"order {', '.join(degrees.mesh_dims())}: register the degree at another position")
        _GROUP_DIMS[:] = [key, groups]
        group_shapes.cache_clear()
    return _GROUP_DIMS[1]


_GROUP_DIMS: list = [None, {}]


def group_shape(layout: Layout, dims: tuple[str, ...]) -> tuple[int, int]:
    """(stride, size) of the groups spanning the adjacent mesh dims ``dims``."""
    order = degrees.mesh_dims()
    inner = order[order.index(dims[-1]) + 1:]
    stride = math.prod(getattr(layout, d) for d in inner)
    size = math.prod(getattr(layout, d) for d in dims)
    return stride, size


def check_fits(layout: Layout, topology: Topology) -> None:
    if layout.world > topology.num_gpus:
        raise CostModelError(
            f"layout {layout.describe()} uses {layout.world} GPUs but topology {topology.name} has "
            f"{topology.num_gpus}: use a topology with at least {layout.world} GPUs (e.g. --gpus {layout.world})"
        )


@lru_cache(maxsize=65536)
def group_shapes(layout: Layout) -> dict[str, tuple[int, int]]:
    """(stride, size) of every cost-model group (:func:`group_dims`); cached, because the planner asks for
    every layout it scores. Callers must not mutate the returned dict."""
    shapes = {name: group_shape(layout, dims) for name, dims in group_dims().items()}
    if layout.ep > 1:
        shapes.update(expert_group_shapes(layout, shapes["shard"]))
    return shapes


def expert_group_shapes(layout: Layout, shard: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """(stride, size) of the expert-parallel groups, carved out of the shard group (stride s, size n):
    ``ep`` (the innermost ``ep`` shard-group ranks, ``s`` apart: the dispatch/combine all-to-all, on NVLink
    while ``ep x s`` fits a node, as torchtitan places it) and ``expert_data`` (the ``n / ep`` ranks holding
    the same experts, ``s x ep`` apart: the experts' ZeRO/FSDP group). Only layouts with ``ep > 1`` have them."""
    stride, size = shard
    return {"ep": (stride, layout.ep), "expert_data": (stride * layout.ep, size // layout.ep)}


def group_spans(layout: Layout, topology: Topology) -> dict[str, GroupSpan]:
    """The span of every cost-model group (fast: each (stride, size) is cached by the topology)."""
    check_fits(layout, topology)
    group = topology.group
    return {name: group(stride, size) for name, (stride, size) in group_shapes(layout).items()}


class GroupPlacement(BaseModel):
    """Where one process group of the mesh sits (the worst group when groups differ)."""

    model_config = ConfigDict(frozen=True)

    dims: list[str]
    size: int = Field(description="ranks per group")
    stride: int = Field(description="rank distance between consecutive members")
    ranks_per_node: int = Field(description="members sharing one node")
    nodes_spanned: int
    link_class: str = Field(description="slowest link class the group's traffic crosses")
    intra_node_class: str | None = Field(description="slowest class among same-node members")
    intra_node_bandwidth: float | None = Field(description="calibrated per-GPU ring bandwidth inside a node, B/s")
    fabric_bandwidth: float | None = Field(description="calibrated per-GPU fabric share, B/s")


class Placement(BaseModel):
    """Rank-to-mesh placement of a layout on a topology (goes into the plan JSON)."""

    model_config = ConfigDict(frozen=True)

    topology: str
    world: int
    gpus_per_node: int
    nodes: int
    mesh_order: list[str] = Field(default_factory=lambda: list(degrees.mesh_dims()))
    rank_formula: str = Field(default_factory=lambda: rank_formula(degrees.mesh_dims()))
    groups: dict[str, GroupPlacement]


def rank_formula(mesh: tuple[str, ...]) -> str:
    """Row-major rank of a mesh coordinate, e.g. ``rank = ((dp_shard)*ring + ring)*tp + tp``: each dim's
    name stands for its coordinate on the right of ``*`` and for its size on the left."""
    text = mesh[0]
    for dim in mesh[1:]:
        text = f"({text}*{dim} + {dim})"
    return "rank = " + text


def place(layout: Layout, topology: Topology) -> Placement:
    spans = group_spans(layout, topology)
    groups = {}
    for name, span in spans.items():
        groups[name] = GroupPlacement(
            dims=list(group_dims().get(name, group_dims()["shard"])),  # ep groups: inside the shard group
            size=span.size,
            stride=span.stride,
            ranks_per_node=span.ranks_per_node,
            nodes_spanned=span.nodes,
            link_class=span.link_class,
            intra_node_class=span.intra_class,
            intra_node_bandwidth=span.ring_bandwidth if math.isfinite(span.ring_bandwidth) else None,
            fabric_bandwidth=span.fabric_bandwidth if math.isfinite(span.fabric_bandwidth) else None,
        )
    return Placement(
        topology=topology.name,
        world=layout.world,
        gpus_per_node=topology.gpus_per_node,
        nodes=math.ceil(layout.world / topology.gpus_per_node),
        groups=groups,
    )
