"""Process groups for the attention ops: resolved by name through c10d, checked for agreement on every call.

**Names, not a registry.** Process groups cannot be arguments of ``torch.library`` custom ops, so the ops
take the group's c10d name (``group.group_name``) and resolve it when they run with
``torch.distributed.distributed_c10d._resolve_process_group``: c10d's own registry, which
``destroy_process_group()`` clears and ``init_process_group``/``new_group`` fill again, so a job that
tears its groups down and builds new ones (or a test doing so) always gets the live group.

**Agreement on every call, never a hang.** A collective whose ranks pass tensors of different sizes
aborts inside gloo ("Received data size doesn't match expected size"), hangs until the process-group
timeout, or (ring send/recv) returns silently wrong numbers. So before its first collective every
multi-rank attention op all-gathers a fixed-length int64 descriptor of what this rank holds (shapes,
dtype, device type, layout, causal, scale, a fingerprint of ``cu_seqlens``) plus a flag saying whether
the local validation found a problem, and every rank raises one :class:`RuntimeConfigError` when any
two descriptors differ (naming each rank's shapes) or any rank flagged a problem (that rank gives its
own message, the others name it). The decision to check never depends on what a rank has seen before
(an earlier version cached the check per rank and shape, and ranks that agreed once and disagreed later
waited in different collectives until the timeout), and a fixed-length all-gather can never mismatch.
Cost: one all-gather of ``DESCRIPTOR_LEN`` int64 per attention call (forward only: backward shapes follow
from the forward's), on CPU tensors whenever the group has a gloo backend (no GPU sync); see
docs/runtime_attention.md for the measured cost.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

from sp_plan.runtime.attention.documents import host_boundaries
from sp_plan.runtime.attention.kernel import SUPPORTED_DTYPES
from sp_plan.runtime.errors import RuntimeConfigError

#: Tensors described per check (q, k, v) and dims per tensor: the descriptor has a fixed length so the
#: all-gather itself can never mismatch.
_MAX_TENSORS = 3
_DIMS = 4
_DTYPES: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
_NAMES = ("q", "k", "v")
_DEVICE_TYPES = ("cpu", "cuda")
_LAYOUTS = {None: 0, "zigzag": 1, "contiguous": 2, "per_document": 3}
#: Layout of the descriptor after the per-tensor (ndim, 4 dims) blocks.
_DTYPE, _DEVICE, _LAYOUT, _CAUSAL, _SCALE, _DOCS, _GRAD, _PROBLEM = range(_MAX_TENSORS * (_DIMS + 1),
                                                                         _MAX_TENSORS * (_DIMS + 1) + 8)
DESCRIPTOR_LEN = _PROBLEM + 1
#: The single-tensor all-gather (``all_gather_into_tensor`` was renamed ``all_gather_single``).
#: Set to 1 to refuse non-finite q, k, v at every attention call (a debugging aid: it reads every element and
#: syncs a GPU, so it is off by default; NaN or inf inputs otherwise give NaN outputs, as any attention kernel).
CHECK_FINITE_ENV = "SP_PLAN_CHECK_FINITE"

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_name(group: dist.ProcessGroup | None) -> str:
    """The c10d name of ``group`` (None: the default group), which :func:`resolve_group` turns back into it."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeConfigError(
            "no default process group: call torch.distributed.init_process_group (or sp_plan.runtime.mesh.build_mesh) first"
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


def _scale_bits(scale: float | None, head_dim: int) -> int:
    """The effective softmax scale as the int64 of its float64 bits (None = 1/sqrt(head_dim))."""
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else math.nan
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = math.nan
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _documents_fingerprint(cu_seqlens: torch.Tensor | None) -> int:
    """0 without documents, else a 63-bit hash of the boundaries (ints hash alike in every process)."""
    if cu_seqlens is None:
        return 0
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        return 1  # not boundaries at all (the local validation says so)
    return (hash(host_boundaries(cu_seqlens)) & ((1 << 62) - 1)) + 2


def describe(tensors: Sequence[object], *, layout: str | None, causal: bool, scale: float | None,
             cu_seqlens: torch.Tensor | None, problem: bool, needs_grad: bool = False) -> list[int]:
    """The fixed-length int64 descriptor of one rank's call (``DESCRIPTOR_LEN`` values)."""
    row: list[int] = []
    for i in range(_MAX_TENSORS):
        x = tensors[i] if i < len(tensors) else None
        shape = list(x.shape) if isinstance(x, torch.Tensor) else []
        ndim = x.dim() if isinstance(x, torch.Tensor) else -1
        row += [ndim] + (shape + [0] * _DIMS)[:_DIMS]
    first = tensors[0] if tensors and isinstance(tensors[0], torch.Tensor) else None
    dtype = first.dtype if first is not None else None
    row.append(_DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES))
    device = first.device.type if first is not None else None
    row.append(_DEVICE_TYPES.index(device) if device in _DEVICE_TYPES else len(_DEVICE_TYPES))
    row.append(_LAYOUTS.get(layout, len(_LAYOUTS)))
    row.append(int(bool(causal)))
    head_dim = first.shape[-1] if first is not None and first.dim() > 0 else 0
    row.append(_scale_bits(scale, head_dim))
    row.append(_documents_fingerprint(cu_seqlens) if not problem else 0)
    row.append(int(bool(needs_grad)))
    row.append(int(problem))
    return row


def _check_device(group: dist.ProcessGroup, tensors: Sequence[object]) -> torch.device:
    """CPU when the group can run a CPU collective (gloo, or a ``cpu:gloo,cuda:nccl`` group): no GPU sync.
    Otherwise (NCCL only) the inputs' device, which costs one small device-to-host copy per call."""
    if "gloo" in str(dist.get_backend(group)):
        return torch.device("cpu")
    for x in tensors:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return x.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gather_rows(group: dist.ProcessGroup, row: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``row`` (same length on all ranks), by group rank: one all-gather."""
    world = dist.get_world_size(group)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = torch.empty(world, len(row), dtype=torch.int64, device=device)
    # One flat output tensor: about 1/3 faster than the list form on gloo (230 vs 340 us on 2 CPU ranks).
    _GATHER(table.view(-1), mine, group=group)
    return table.tolist()


def agree(group: dist.ProcessGroup, what: str, tensors: Sequence[object], *, problem: str | None = None,
          layout: str | None = None, causal: bool = False, scale: float | None = None,
          cu_seqlens: torch.Tensor | None = None, outer: dist.ProcessGroup | None = None,
          needs_grad: bool = False) -> None:
    """Raise the same RuntimeConfigError on every rank of ``group`` unless every rank holds the same shapes,
    dtype, device type, layout, causal flag, scale and documents, and no rank found a ``problem`` (its local
    validation message). ``needs_grad`` must agree too: a rank whose inputs require grad runs the
    backward's collectives, and a peer that never does would leave it waiting. One all-gather of
    ``DESCRIPTOR_LEN`` int64, on every call.

    ``outer``: a second group (USP's ring group) whose ranks must agree too; its all-gather carries the
    first one's verdict, so every rank of the 2-D grid learns about a problem anywhere in it and all of
    them raise together (a rank that raised after the first gather would leave its ring peers waiting).
    """
    row = describe(tensors, layout=layout, causal=causal, scale=scale, cu_seqlens=cu_seqlens,
                   problem=problem is not None, needs_grad=needs_grad)
    device = _check_device(group, tensors)
    table = gather_rows(group, row, device)
    message = _verdict(what, table, problem, dist.get_rank(group), "")
    if outer is not None and dist.get_world_size(outer) > 1:
        summary = row[:]
        summary[_PROBLEM] = int(message is not None)
        outer_table = gather_rows(outer, summary, device)
        if message is None:
            message = _verdict(what, outer_table, None, dist.get_rank(outer), " (across the ring group)")
    if message is not None:
        raise RuntimeConfigError(message)


def screen(group: dist.ProcessGroup | None, what: str, tensors: Sequence[object], scale: object, *,
           outer: dist.ProcessGroup | None = None) -> float | None:
    """Python-level checks a custom op cannot even be called without (tensor inputs, a numeric scale), done
    in the public wrappers. A problem raises on every rank: with peers (world > 1), after one agreement
    all-gather carrying it, so ranks given valid inputs do not wait in their op's check until the timeout.
    ``outer``: USP's ring group, told too (see :func:`agree`). Returns ``scale`` as a float (or None).
    Under ``torch.compile`` these are static checks (no collective)."""
    problem = None
    for name, x in zip(_NAMES, tensors):
        if not isinstance(x, torch.Tensor):
            problem = f"attention expects torch.Tensor inputs, got {name} of type {type(x).__name__}"
            break
    if problem is None and len({x.device for x in tensors}) > 1:  # (the dispatcher would pick one device's kernel)
        devices = ", ".join(str(x.device) for x in tensors)
        problem = f"q, k, v are on different devices ({devices}): move them to one device"
    if problem is None and scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        problem = f"attention scale must be a positive float (or None for 1/sqrt(head_dim)), got {type(scale).__name__}"
    peers = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    if problem is None and peers and any(x.device.type == "meta" for x in tensors):
        problem = (f"{what} got tensors on the meta device (shapes, no data), which ranks cannot exchange: "
                   "materialise the model first (model.to_empty(device=...) and initialise its weights)")
    if problem is None and os.environ.get(CHECK_FINITE_ENV) == "1" and not torch.compiler.is_compiling():
        bad = [name for name, x in zip(_NAMES, tensors) if x.device.type != "meta" and not bool(torch.isfinite(x).all())]
        if bad:
            problem = (f"{what}: {', '.join(bad)} hold NaN or infinite values ({CHECK_FINITE_ENV}=1 checks every "
                       "call); look at the layer that produced them (learning rate, loss scale, bad data)")
    if problem is None:
        return None if scale is None else float(scale)
    if peers:
        agree(group, what, tensors, problem=problem, outer=outer)
    raise RuntimeConfigError(problem)


def _verdict(what: str, table: list[list[int]], problem: str | None, rank: int, where: str) -> str | None:
    """The error every rank raises for this table (None: all agree and nobody has a problem)."""
    flagged = [r for r, values in enumerate(table) if values[_PROBLEM]]
    if flagged:
        if problem is not None:
            return problem
        held = "; ".join(f"rank {r} holds {_held(table[r])}" for r in flagged)
        return (f"{what}: rank(s) {', '.join(map(str, flagged))} of the group{where} refused their inputs "
                f"(invalid, or not matching their peers': {held}); see the error on that rank: every rank stops "
                f"here (this is rank {rank}{where and ' of that group'})")
    compared = [values[:_PROBLEM] for values in table]
    if any(values != compared[0] for values in compared):
        return _mismatch_message(what + where, table)
    return None


def _held(row: list[int]) -> str:
    parts = []
    for i, name in enumerate(_NAMES):
        base = i * (_DIMS + 1)
        ndim = row[base]
        if ndim < 0:
            parts.append(f"{name} (not a tensor)")
        elif ndim == 0:
            parts.append(f"{name} ()")
        else:
            dims = row[base + 1 : base + 1 + min(ndim, _DIMS)]
            parts.append(f"{name} {tuple(dims)}" + (f" (+{ndim - _DIMS} more dims)" if ndim > _DIMS else ""))
    return ", ".join(parts)


def _decoded(row: list[int]) -> dict[str, object]:
    dtype = str(_DTYPES[row[_DTYPE]]).removeprefix("torch.") if row[_DTYPE] < len(_DTYPES) else "other"
    device = _DEVICE_TYPES[row[_DEVICE]] if row[_DEVICE] < len(_DEVICE_TYPES) else "other"
    layout = {0: "none", 1: "zigzag", 2: "contiguous", 3: "per_document"}.get(row[_LAYOUT], "other")
    scale = struct.unpack("<d", struct.pack("<q", row[_SCALE]))[0]
    docs = "none" if row[_DOCS] == 0 else f"boundaries #{row[_DOCS] % 100000:05d}"
    return {"dtype": dtype, "device type": device, "layout": layout, "causal": bool(row[_CAUSAL]),
            "scale": scale, "cu_seqlens": docs, "requires_grad": bool(row[_GRAD])}


def _mismatch_message(what: str, table: list[list[int]]) -> str:
    parts = []
    shapes = {tuple(r[: _MAX_TENSORS * (_DIMS + 1)]) for r in table}
    if len(shapes) > 1:
        held = "; ".join(f"rank {rank} holds {_held(r)}" for rank, r in enumerate(table))
        parts.append(
            f"{what}: the ranks of the group disagree on their local shapes ({held}); every rank must hold the "
            "same number of tokens (and heads): shard full sequences with SequenceParallel.shard or "
            "sp_plan.runtime.data.BatchSharder, which pad the sequence to the layout's multiple"
        )
    decoded = [_decoded(r) for r in table]
    for label in ("dtype", "device type", "layout", "causal", "scale", "cu_seqlens", "requires_grad"):
        values = [d[label] for d in decoded]
        if len(set(map(repr, values))) > 1:
            listed = ", ".join(f"rank {rank} {label} {value!r}" for rank, value in enumerate(values))
            hint = (" (with grad enabled): run the forward and backward on every rank, or under torch.no_grad() on "
                    "every rank" if label == "requires_grad" else "")
            parts.append(f"{what}: the ranks were called with different {label}s ({listed}); pass the same on every "
                         f"rank{hint}")
    return "; ".join(parts) if parts else f"{what}: the ranks of the group disagree on their inputs"
