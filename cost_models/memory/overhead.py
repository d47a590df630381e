"""Device memory outside PyTorch's caching allocator (CUDA context, NCCL) and the allocator's reserve.

NCCL communicators allocate their channel buffers with cudaMalloc directly, per communicator, so a rank
pays for every process group it belongs to. The runtime builds one group per mesh dimension with more
than one rank, plus the flattened groups it needs: the FSDP shard group (dp_shard x ring x ulysses), the
sequence-parallel group (ring x ulysses) and the world. Groups with the same ranks are one communicator
(a flattened group over a single non-trivial dimension is that dimension's group).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..layout import MESH_DIMS, Layout
from .assumptions import MemoryAssumptions

#: Flattened groups the runtime builds besides the per-dimension ones, as (name, dims).
FLATTENED_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fsdp_shard", ("dp_shard", "ring", "ulysses")),
    ("sequence_parallel", ("ring", "ulysses")),
    ("world", MESH_DIMS),
)


@dataclass(frozen=True)
class ProcessGroup:
    name: str
    dims: tuple[str, ...]
    size: int


@lru_cache(maxsize=4096)
def process_groups(layout: Layout) -> tuple[ProcessGroup, ...]:
    """Distinct communicators one rank belongs to (deduplicated by their set of non-trivial dims)."""
    degrees = layout.degrees()
    seen: set[frozenset[str]] = set()
    groups: list[ProcessGroup] = []
    candidates = [(dim, (dim,)) for dim in MESH_DIMS] + list(FLATTENED_GROUPS)
    for name, dims in candidates:
        active = frozenset(d for d in dims if degrees[d] > 1)
        if not active or active in seen:
            continue
        seen.add(active)
        size = 1
        for d in active:
            size *= degrees[d]
        groups.append(ProcessGroup(name, tuple(d for d in MESH_DIMS if d in active), size))
    return tuple(groups)


@dataclass(frozen=True)
class Overhead:
    cuda_context: int
    nccl: int
    communicators: tuple[ProcessGroup, ...]
    fragmentation: int

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl + self.fragmentation


def overhead(layout: Layout, peak_allocated: int, a: MemoryAssumptions) -> Overhead:
    groups = process_groups(layout)
    return Overhead(
        cuda_context=a.cuda_context_bytes,
        nccl=len(groups) * a.nccl_bytes_per_communicator,
        communicators=groups,
        fragmentation=int(round(peak_allocated * a.fragmentation_fraction)),
    )
