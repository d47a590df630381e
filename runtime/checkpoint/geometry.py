"""Where each local tensor lies in the unparallelised model: the chunks a rank writes and reads.

Every tensor is stored as the *unparallelised* model's tensor. A rank holds one chunk of it, at some
offsets:

- FSDP2 shards (DTensors over the ``fsdp`` dim, HSDP's replicas included) give their chunk with
  ``compute_local_shape_and_global_offset``;
- tensor parallelism (:mod:`sp_plan.runtime.tp`) is custom (plain local tensors, not DTensors), so its slice
  of the full tensor comes from :meth:`sp_plan.runtime.tp.TensorParallel.local_slice` (the one sharding rule
  TP itself uses) and is composed with the FSDP chunk: a TP-sharded, FSDP-sharded tensor is one chunk
  of the full tensor. K/V weights replicated over TP ranks (tp > KV heads) are identical chunks, which
  DCP's planner writes once.

The model may be several parts (pipeline stages): :func:`model_parts` gives ``setup.model_parts`` when the
setup has them, else ``[setup.model]``, and every function here takes the list. Names are unique across
the parts (a parameter lives in one stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sp_plan.runtime.errors import RuntimeConfigError


@dataclass(frozen=True)
class Chunk:
    """A local tensor and where it lies in the full tensor: ``offsets`` per dim, the full ``shape``.

    ``source``: the checkpoint key to read it from when loading (defaults to its own key).
    """

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    source: str | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


@dataclass(frozen=True)
class Geometry:
    """Offsets and full shape of this rank's local piece of one parameter (shared by its optimizer states)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    def chunk(self, tensor: torch.Tensor, what: str, source: str | None = None) -> Chunk:
        local = local_tensor(tensor)
        if tuple(local.shape) != self.local_shape:
            raise RuntimeConfigError(
                f"{what} has local shape {tuple(local.shape)}, but its parameter's local shard is {self.local_shape}: "
                "only optimizers whose states have the parameters' shape (or are scalars) can be checkpointed"
            )
        return Chunk(local, self.offsets, self.shape, source)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view sharing its storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def model_parts(setup: Any) -> list[torch.nn.Module]:
    """The model's parts: ``setup.model_parts`` (pipeline stages) when the setup has them, else ``[setup.model]``."""
    parts = getattr(setup, "model_parts", None)
    return list(parts) if parts else [setup.model]


def clean_fqn(name: str) -> str:
    """A parameter name without wrapper prefixes (activation-checkpoint wrappers, torch.compile)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def model_state(parts: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of every part by clean name (FSDP2 DTensors as they are: they share
    storage with the parameters, so loading into their local tensors updates the model)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out: dict[str, torch.Tensor] = {}
    for index, part in enumerate(parts):
        for name, value in get_model_state_dict(part).items():
            name = clean_fqn(name)
            if name in out:
                raise RuntimeConfigError(
                    f"model part {index} has a state entry {name!r} that an earlier part has too: the parts of a "
                    "model must hold different parameters to be checkpointed by name")
            out[name] = value
    return out


def parameter_names(parts: Sequence[torch.nn.Module]) -> dict[int, str]:
    """Every part's parameters, by object id, to their clean names (to name what an optimizer steps)."""
    return {id(p): clean_fqn(n) for part in parts for n, p in part.named_parameters()}


def fsdp_geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(local shape, offsets, shape) of a DTensor (FSDP2 shard) within its (TP-local) tensor."""
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = tuple(t.to_local().shape)
        if tuple(sizes) != local:
            raise RuntimeConfigError(
                f"a DTensor's local shard has shape {local} but its placements say {tuple(sizes)}; "
                "cannot checkpoint it"
            )
        return local, tuple(offsets), tuple(t.shape)
    shape = tuple(t.shape)
    return shape, (0,) * len(shape), shape


def geometry_of(parts: Sequence[torch.nn.Module], tensor_parallel: Any = None) -> dict[str, Geometry]:
    """Where this rank's local piece of every model state entry lies in the unparallelised tensor.

    Collective over the TP group when ``tensor_parallel`` splits over more than one rank (the full sizes
    of TP-split dims)."""
    entries = model_state(parts)
    cuts: dict[str, tuple[int, int, int]] = {}
    if tensor_parallel is not None and tensor_parallel.size > 1:
        cuts = {name: cut for name in entries if (cut := tensor_parallel.local_slice(name)) is not None}
        everyone: list[Any] = [None] * tensor_parallel.size
        dist.all_gather_object(everyone, {n: (c[0], c[2]) for n, c in cuts.items()}, group=tensor_parallel.group)
        totals = {n: max(rank_cuts[n][1] for rank_cuts in everyone) for n in cuts}
    out = {}
    for name, value in entries.items():
        local, offsets, shape = fsdp_geometry(value)
        if name in cuts:
            dim, start, _stop = cuts[name]
            offsets = tuple(o + start if d == dim else o for d, o in enumerate(offsets))
            shape = tuple(totals[name] if d == dim else s for d, s in enumerate(shape))
        out[name] = Geometry(offsets, shape, local)
    return out


def parameter_geometry(setup: Any) -> dict[str, Geometry]:
    """:func:`geometry_of` the setup's model parts under its tensor parallelism (``setup.tensor_parallel``,
    if any); collective over the TP group when the plan has tensor parallelism."""
    return geometry_of(model_parts(setup), getattr(setup, "tensor_parallel", None))
