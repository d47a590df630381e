"""The few collectives checkpointing uses, each a no-op without a process group (or on one rank).

Every function takes an optional ``group``: the background saver runs its collectives on a group of its
own so that they never interleave with training's.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(this rank, the number of ranks) in ``group`` (the default group when None); (0, 1) without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group) if group is not None else dist.get_rank(), dist.get_world_size(group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def broadcast(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` on one rank)."""
    _, world = rank_world(group)
    if world == 1:
        return [value]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, value, group=group)
    return everyone
