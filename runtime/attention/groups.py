"""Process groups for the attention ops: resolved by name through c10d, checked for agreement once.

**Names, not a registry.** Process groups cannot be arguments of ``torch.library`` custom ops, so the ops
take the group's c10d name (``group.group_name``) and resolve it when they run with
``torch.distributed.distributed_c10d._resolve_process_group``: c10d's own registry, which
``destroy_process_group()`` clears and ``init_process_group``/``new_group`` fill again, so a job that
tears its groups down and builds new ones (or a test doing so) always gets the live group.

**Agreement, once.** A collective whose ranks pass tensors of different sizes aborts inside gloo
("Received data size doesn't match expected size") or, for ring attention's send/recv, can even return
silently wrong numbers. Before the first attention call of a given (group, local shapes, dtype,
layout, causal) combination every rank all-gathers a small int64 descriptor of what it holds and
raises one :class:`RuntimeConfigError` naming each rank's shapes when they differ. The result is cached
per process-group object (weakly: a destroyed group drops out), so later calls with the same
description issue no extra collective. The cache key is what THIS rank holds: if a later batch gives
the ranks *different* shapes while one of them still finds its own in the cache, the check cannot
run on that rank (only a per-call collective could see it); the data path
(:class:`runtime.data.BatchSharder`) always gives every rank of a group the same shapes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from runtime.errors import RuntimeConfigError

#: Tensors described per check (q, k, v) and dims per tensor: the descriptor has a fixed length so the
#: all-gather itself can never mismatch.
_MAX_TENSORS = 3
_DIMS = 4
_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_NAMES = ("q", "k", "v")

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_name(group: dist.ProcessGroup | None) -> str:
    """The c10d name of ``group`` (None: the default group), which :func:`resolve_group` turns back into it."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeConfigError(
            "no default process group: call torch.distributed.init_process_group (or runtime.mesh.build_mesh) first"
        )
    return group.group_name


def resolve_group(name: str) -> dist.ProcessGroup:
    """The live process group registered in c10d under ``name``."""
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        raise RuntimeConfigError(
            f"process group {name!r} is not registered with torch.distributed (was it destroyed?): build the "
            "sequence-parallel context again from the current groups (SequenceParallel.from_mesh(build_mesh(...)))"
        ) from None


def _describe(tensors: Sequence[torch.Tensor], layout: str | None, causal: bool) -> list[int]:
    row: list[int] = []
    for i in range(_MAX_TENSORS):
        shape = list(tensors[i].shape) if i < len(tensors) else []
        row += [len(shape)] + (shape + [0] * _DIMS)[:_DIMS]
    dtype = tensors[0].dtype
    row.append(_DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES))
    row.append({None: 0, "zigzag": 1, "contiguous": 2}.get(layout, 3))
    row.append(int(causal))
    return row


def _decode(row: list[int], count: int) -> tuple[list[tuple[int, ...]], str, str, bool]:
    shapes = []
    for i in range(count):
        base = i * (_DIMS + 1)
        shapes.append(tuple(row[base + 1 : base + 1 + row[base]]))
    tail = _MAX_TENSORS * (_DIMS + 1)
    dtype = str(_DTYPES[row[tail]]).removeprefix("torch.") if row[tail] < len(_DTYPES) else "other"
    layout = {0: "none", 1: "zigzag", 2: "contiguous"}.get(row[tail + 1], "other")
    return shapes, dtype, layout, bool(row[tail + 2])


def check_agreement(group: dist.ProcessGroup, what: str, tensors: Sequence[torch.Tensor], *,
                    layout: str | None = None, causal: bool = False) -> None:
    """Raise one RuntimeConfigError on every rank of ``group`` unless all ranks hold the same shapes, dtype,
    layout and causal flag. One all-gather the first time this rank sees the combination, none after."""
    row = _describe(tensors, layout, causal)
    key = tuple(row)
    seen = _CHECKED.setdefault(group, set())
    if key in seen:
        return
    world = dist.get_world_size(group)
    device = tensors[0].device
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = [r.tolist() for r in rows]
    if any(r != row for r in table):
        raise RuntimeConfigError(_mismatch_message(what, table, len(tensors)))
    seen.add(key)


def _mismatch_message(what: str, table: list[list[int]], count: int) -> str:
    decoded = [_decode(r, count) for r in table]
    shapes = {tuple(d[0]) for d in decoded}
    parts = []
    if len(shapes) > 1:
        held = "; ".join(
            f"rank {rank} holds " + ", ".join(f"{name} {shape}" for name, shape in zip(_NAMES, d[0]))
            for rank, d in enumerate(decoded)
        )
        parts.append(
            f"{what}: the ranks of the group disagree on their local shapes ({held}); every rank must hold the "
            "same number of tokens (and heads): shard full sequences with SequenceParallel.shard or "
            "runtime.data.BatchSharder, which pad the sequence to the layout's multiple"
        )
    for index, label in ((1, "dtype"), (2, "layout"), (3, "causal")):
        values = [d[index] for d in decoded]
        if len(set(values)) > 1:
            listed = ", ".join(f"rank {rank} {label} {value!r}" for rank, value in enumerate(values))
            parts.append(f"{what}: the ranks were called with different {label}s ({listed}); pass the same on every rank")
    return "; ".join(parts) if parts else f"{what}: the ranks of the group disagree on their inputs"
