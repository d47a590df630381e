"""Device memory outside PyTorch's caching allocator (CUDA context, NCCL) and the allocator's reserve.

NCCL communicators allocate their channel buffers with cudaMalloc directly, per communicator, so a rank
pays for every process group it belongs to.

Which communicators (``MemoryAssumptions.nccl_groups``):

- ``mesh`` (this project's runtime, torchtitan): one group per mesh dimension with more than one rank,
  plus the flattened groups the runtime needs: the FSDP shard group (dp_shard x ring x ulysses), the
  sequence-parallel group (ring x ulysses) and the world. Groups with the same ranks are one
  communicator (a flattened group over a single non-trivial dimension is that dimension's group).
- ``purposes`` (DeepSpeed): every group the framework creates with ``dist.new_group`` is its own
  communicator, even with the same ranks: the world, TP, the sequence-parallel group, the ZeRO
  partition group (DeepSpeed's sequence-data-parallel group, ``Layout.shard_group``) and the data-
  parallel group.

How much each holds (``nccl_memory``): ``flat`` = ``nccl_bytes_per_communicator``; ``buffers`` = NCCL's
buffer sizes (src/init.cc defaults, NCCL 2.18-2.27): per channel one connection's SIMPLE (NCCL_BUFFSIZE
4 MiB) + LL128 (4,915,200 B) + LL (512 KiB) buffers for the ring and as many for the tree, and, for a
group that runs all-to-all or send/recv (Ulysses, ring attention), per peer and P2P channel a send and a
receive buffer of NCCL_P2P_NVL_CHUNKSIZE (512 KiB) x NCCL_STEPS (8) = 4 MiB over NVLink or
NCCL_P2P_NET_CHUNKSIZE (128 KiB) x 8 = 1 MiB over the network (p2pnChannelsPerPeer channels per peer,
src/graph/paths.cc: the pow2 of the fewest channels any peer path supports).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .. import degrees as registry
from ..layout import Layout
from ..memo import Memo
KiB = 1 << 10
from .assumptions import NCCL_LL128_BYTES, NCCL_LL_BYTES, NCCL_SIMPLE_BYTES, MemoryAssumptions

def flattened_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Flattened groups the runtime builds besides the per-dimension ones, as (name, dims), from the
    degrees' roles: the FSDP shard group, the sequence-parallel group and the world."""
    return (
        ("fsdp_shard", registry.with_role("shards_state")),
        ("sequence_parallel", registry.with_role("sequence")),
        ("world", registry.mesh_dims()),
    )


def purpose_groups_dims() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Groups DeepSpeed creates, as (name, dims): each its own communicator."""
    return (
        ("world", registry.mesh_dims()),
        ("tp", ("tp",)),
        ("sequence_parallel", registry.with_role("sequence")),
        ("zero_partition", registry.with_role("shards_state")),
        ("data_parallel", registry.with_role("data")),
    )


def p2p_dims() -> frozenset[str]:
    """Dimensions whose groups exchange point-to-point (all-to-all or ring send/recv): the sequence-splitting
    ones."""
    return frozenset(registry.with_role("sequence"))


#: Bytes of one ring/tree connection's buffers per channel: SIMPLE + LL128 + LL.
NCCL_CONNECTION_BYTES = NCCL_SIMPLE_BYTES + NCCL_LL128_BYTES + NCCL_LL_BYTES
#: P2P buffer per peer, channel and direction: chunk x NCCL_STEPS.
NCCL_P2P_NVL_BYTES = 512 * KiB * 8
NCCL_P2P_NET_BYTES = 128 * KiB * 8


@dataclass(frozen=True)
class ProcessGroup:
    name: str
    dims: tuple[str, ...]
    size: int
    p2p: bool = False
    """The group exchanges point-to-point (Ulysses all-to-all, ring attention send/recv)."""
    carved: str | None = None
    """``inner`` / ``outer``: an expert-parallel group carved out of the shard group ``dims`` (its innermost
    ``size`` ranks, or the ranks ``ep`` apart); None: the group is the whole run of ``dims``."""


@lru_cache(maxsize=4096)
def process_groups(layout: Layout) -> tuple[ProcessGroup, ...]:
    """Distinct communicators one rank belongs to (deduplicated by their set of non-trivial dims)."""
    degrees = layout.degrees()
    seen: set[frozenset[str]] = set()
    groups: list[ProcessGroup] = []
    candidates = [(dim, (dim,)) for dim in registry.mesh_dims()] + list(flattened_groups())
    p2p = p2p_dims()
    for name, dims in candidates:
        active = frozenset(d for d in dims if degrees[d] > 1)
        if not active or active in seen:
            continue
        seen.add(active)
        groups.append(_group(name, active, degrees, p2p=name in p2p))
    return tuple(groups) + expert_groups(layout)


def expert_groups(layout: Layout) -> tuple[ProcessGroup, ...]:
    """The expert-parallel communicators (``Layout.ep`` > 1), both carved out of the shard group: ``ep`` (its
    innermost ep ranks; all-to-all, so point-to-point buffers) and ``expert_data`` (the shard group / ep ranks
    holding the same experts: the experts' ZeRO/FSDP group)."""
    if layout.ep == 1:
        return ()
    dims = tuple(d for d in registry.with_role("shards_state") if getattr(layout, d) > 1)
    groups = [ProcessGroup("ep", dims, layout.ep, p2p=True, carved="inner")]
    if layout.shard_group > layout.ep:
        groups.append(ProcessGroup("expert_data", dims, layout.shard_group // layout.ep, carved="outer"))
    return tuple(groups)


@lru_cache(maxsize=4096)
def purpose_groups(layout: Layout, zero_stage: int) -> tuple[ProcessGroup, ...]:
    """DeepSpeed's communicators: one per group it creates, identical rank sets not shared. The ZeRO
    partition group exists with ZeRO (stage >= 1)."""
    degrees = layout.degrees()
    groups = []
    for name, dims in purpose_groups_dims():
        if name == "zero_partition" and zero_stage < 1:
            continue
        active = frozenset(d for d in dims if degrees[d] > 1)
        if active:
            groups.append(_group(name, active, degrees, p2p=name == "sequence_parallel"))
    return tuple(groups) + expert_groups(layout)


def _group(name: str, active: frozenset[str], degrees: dict[str, int], p2p: bool) -> ProcessGroup:
    size = 1
    for d in active:
        size *= degrees[d]
    return ProcessGroup(name, tuple(d for d in registry.mesh_dims() if d in active), size, p2p)


def communicator_bytes(group: ProcessGroup, layout: Layout, a: MemoryAssumptions) -> int:
    """Device bytes NCCL allocates for one communicator (see the module docstring)."""
    if a.nccl_memory == "flat":
        return a.nccl_bytes_per_communicator
    local = _local_members(group, layout, a.nccl_local_ranks)
    spans_nodes = local < group.size
    # ring connections; a group across nodes connects its tree too
    collective = a.nccl_channels * NCCL_CONNECTION_BYTES * (2 if spans_nodes else 1)
    p2p = 0
    if group.p2p and group.size > 1:
        per_peer = a.nccl_p2p_channels_per_peer
        peers_local, peers_net = local - 1, group.size - local
        p2p = per_peer * 2 * (peers_local * NCCL_P2P_NVL_BYTES + peers_net * NCCL_P2P_NET_BYTES)
    return collective + p2p


def _local_members(group: ProcessGroup, layout: Layout, local_ranks: int) -> int:
    """Members of ``group`` on this rank's node: mesh dims are laid out innermost-first (tp, ulysses,
    ring, dp_shard, dp_replicate), so a dim's ranks are ``stride`` apart, ``stride`` = product of the
    inner dims; its members stay on the node while ``stride x size <= local_ranks``. A group carved out of
    the shard group (expert parallelism) takes its share of the shard group's members on the node."""
    if group.carved is not None:
        shard = _local_members(ProcessGroup("shard", group.dims, layout.shard_group), layout, local_ranks)
        return min(shard, group.size) if group.carved == "inner" else max(1, shard // layout.ep)
    degrees = layout.degrees()
    local, stride = 1, 1
    for dim in registry.innermost_first():
        size = degrees[dim]
        if dim in group.dims:
            if stride * size <= local_ranks:
                local *= size
            elif stride < local_ranks:
                local *= max(1, local_ranks // stride)
        stride *= size
    return min(local, group.size)


@dataclass(frozen=True)
class Overhead:
    cuda_context: int
    nccl: int
    communicators: tuple[ProcessGroup, ...]
    fragmentation: int
    communicator_bytes: tuple[int, ...] = ()
    cached: int = 0
    """Reserved at the allocator's high-water mark but handed back before an out-of-memory error (free
    blocks of other streams' pools, pages under expandable segments' holes): in what NVML shows, not in
    what must fit."""

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl + self.fragmentation


def communicators(layout: Layout, a: MemoryAssumptions, zero_stage: int = 0) -> tuple[tuple[ProcessGroup, ...],
                                                                                    tuple[int, ...]]:
    """The communicators one rank of ``layout`` holds and their device bytes. Memoized on what they read (the
    layout, the assumptions, and the ZeRO stage where DeepSpeed's groups depend on it): every memory evaluation
    of the planner asks, thousands per search, for a few dozen layouts."""
    key = (layout, a, zero_stage >= 1 if a.nccl_groups != "mesh" else None)
    return _COMMUNICATORS.get(key, lambda: _communicators(layout, a, zero_stage))


def _communicators(layout: Layout, a: MemoryAssumptions, zero_stage: int) -> tuple[tuple[ProcessGroup, ...],
                                                                                   tuple[int, ...]]:
    groups = process_groups(layout) if a.nccl_groups == "mesh" else purpose_groups(layout, zero_stage)
    return groups, tuple(communicator_bytes(g, layout, a) for g in groups)


_COMMUNICATORS: Memo[tuple[tuple[ProcessGroup, ...], tuple[int, ...]]] = Memo()


def overhead(layout: Layout, peak_allocated: int, a: MemoryAssumptions, *, zero_stage: int = 0,
             fragmentation: int | None = None, cached: int | None = None) -> Overhead:
    """Context, NCCL and the allocator's reserve above ``peak_allocated``: ``fragmentation`` (kept) and
    ``cached`` (returned under pressure) when the timeline computed them (allocator replay), else
    ``fragmentation_fraction`` of the peak."""
    groups, sizes = communicators(layout, a, zero_stage)
    return Overhead(
        cuda_context=a.cuda_context_bytes,
        nccl=sum(sizes),
        communicators=groups,
        fragmentation=int(round(peak_allocated * a.fragmentation_fraction)) if fragmentation is None else fragmentation,
        communicator_bytes=sizes,
        cached=cached or 0,
    )
