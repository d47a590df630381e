"""Checkpoint and resume with ``torch.distributed.checkpoint`` (DCP), in a layout-independent form.

A checkpoint holds everything a run needs to continue: the model, the optimizer (plain, over FSDP2's
sharded parameters, or :class:`sp_plan.runtime.host_optimizer.HostOffloadOptimizer` with its fp32 host
masters), the LR scheduler, the data position (:class:`sp_plan.runtime.text_data.GlobalBatches`: sequences
consumed, a global count), every rank's RNG states (torch CPU/CUDA, Python, NumPy) and the step.

**Layout independence.** Every tensor is stored as the *unparallelised* model's tensor, keyed by its
parameter name: ``model::<fqn>``, ``optim::<fqn>::<state>`` (AdamW's ``exp_avg``, ``exp_avg_sq``,
``step``) and ``master::<fqn>`` (fp32 host masters). Each rank writes only the chunk it holds, at its
offsets in the full tensor:

- FSDP2 shards (DTensors over the ``fsdp`` dim, HSDP's replicas included) give their chunk with
  ``compute_local_shape_and_global_offset``;
- tensor parallelism (:mod:`sp_plan.runtime.tp`) is custom (plain local tensors, not DTensors), so its slice
  of the full tensor comes from :meth:`sp_plan.runtime.tp.TensorParallel.local_slice` (the one sharding rule
  TP itself uses) and is composed with the FSDP chunk: a TP-sharded, FSDP-sharded tensor is one chunk
  of the full tensor. K/V weights replicated over TP ranks (tp > KV heads) are identical chunks, which
  DCP's planner writes once.

Loading on any other layout (another SP/TP/dp split, another world size) asks DCP for this rank's
chunks; DCP reads the overlapping parts of the saved chunks (its resharding). The data position is a
global count of sequences, so another data-parallel size resumes at the same place. RNG states are
per rank: restored exactly on the same world size, else every rank takes rank 0's (resume on another
layout is exact up to float rounding, not bit-exact).

**Files.** ``<dir>/step_00000120/``: DCP's ``.metadata`` and ``__<rank>_0.distcp`` files,
``trainer_state.json`` (step, data position, scheduler, optimizer hyperparameters, the plan),
``rng/rank_<r>.json`` and, written last, ``manifest.json``.

**Verification.** ``manifest.json`` holds a SHA-256 digest of every tensor chunk (each byte range DCP
wrote for one chunk of one key, hashed by the rank that wrote it, from the file after DCP's fsync) and of
every other file, with the files' sizes. It is written last (atomically), so a step directory without a
complete manifest is incomplete. :func:`verify_checkpoint` re-hashes everything, the files spread over
the ranks, and gives every rank the same list of problems (which file, which key and chunk, expected vs
found digest); :func:`load_checkpoint` runs it before any tensor is used. SHA-256 and not CRC32 or
BLAKE2b: measured on a 200 MB buffer on this project's 2-core x86 machine (SHA-NI), SHA-256 ran at
0.86 GB/s, zlib.crc32 at 1.13 GB/s and BLAKE2b at 0.22 GB/s; reading a checkpoint back costs about the
same as the hash, so CRC32's small speed-up is not worth a 32-bit check, and hashlib releases the GIL
(the background saver's thread hashes while training runs).

**Atomicity.** Every rank writes into ``<dir>/.step_00000120.tmp-<id>``; after DCP's save every rank
hashes its files, rank 0 writes the bookkeeping and the manifest (fsynced) and renames the directory to
``step_00000120`` (atomic on POSIX), and every rank re-reads and verifies the published checkpoint
before anything older is pruned. :func:`latest_checkpoint` only considers ``step_*`` directories with a
manifest, so a save interrupted at any point (a killed rank, a full disk) is never picked up; the stale
temporary directory is removed by the next save. A step directory of the same number saved by another
run is replaced only once the new one verifies, and the replacement is reported. One job per checkpoint
directory.

**Untrusted files.** JSON files are size-bounded and parsed with :mod:`json`; DCP's ``.metadata`` is
a pickle, read here with an unpickler restricted to DCP's metadata classes; tensors are read by DCP
with ``torch.load(weights_only=True)``. No byte (pickled) items are written or read.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import hashlib
import secrets
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sp_plan.cost_models.atomic_io import atomic_write_text, fsync_directory
from sp_plan.runtime.errors import RuntimeConfigError

#: Version of the layout of a checkpoint directory (bumped on incompatible changes; 2: the manifest).
FORMAT_VERSION = 2
#: Written last: the list of files with their sizes and SHA-256 digests (whole files and tensor chunks).
MANIFEST = "manifest.json"
DIGEST = "sha256"
#: Bytes read per call while hashing (bounded memory whatever a chunk's size).
READ_BLOCK = 8 << 20
#: Problems quoted in one error message (the rest are counted).
MAX_PROBLEMS_SHOWN = 5
STATE_FILE = "trainer_state.json"
RNG_DIR = "rng"
STEP_PREFIX = "step_"
TMP_INFIX = ".tmp-"
#: JSON files of a checkpoint are small; anything larger is not one of ours and is not parsed.
JSON_MAX_BYTES = 64 << 20
MODEL, OPTIM, MASTER = "model", "optim", "master"
SEP = "::"
#: Architecture fields a checkpoint's model must share with the model it is loaded into.
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size",
    "tied_embeddings", "activation", "norm", "position_embedding", "qkv_bias", "attn_out_bias", "mlp_bias",
    "qk_norm",
)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


# ----- where each local tensor lies in the unparallelised model ------------------------------------------


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
        local = _local(tensor)
        if tuple(local.shape) != self.local_shape:
            raise RuntimeConfigError(
                f"{what} has local shape {tuple(local.shape)}, but its parameter's local shard is {self.local_shape}: "
                "only optimizers whose states have the parameters' shape (or are scalars) can be checkpointed"
            )
        return Chunk(local, self.offsets, self.shape, source)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view sharing its storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
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


def clean_fqn(name: str) -> str:
    """A parameter name without wrapper prefixes (activation-checkpoint wrappers, torch.compile)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def parameter_geometry(setup) -> dict[str, Geometry]:
    """Where this rank's local piece of every model state entry lies in the unparallelised tensor.

    Collective over the TP group when the plan has tensor parallelism (the full sizes of TP-split dims).
    """
    model = setup.model
    tp = getattr(setup, "tensor_parallel", None)
    entries = _model_state(model)
    cuts: dict[str, tuple[int, int, int]] = {}
    if tp is not None and tp.size > 1:
        cuts = {name: cut for name in entries if (cut := tp.local_slice(name)) is not None}
        everyone: list[Any] = [None] * tp.size
        dist.all_gather_object(everyone, {n: (c[0], c[2]) for n, c in cuts.items()}, group=tp.group)
        totals = {n: max(rank_cuts[n][1] for rank_cuts in everyone) for n in cuts}
    out = {}
    for name, value in entries.items():
        local, offsets, shape = _fsdp_geometry(value)
        if name in cuts:
            dim, start, _stop = cuts[name]
            offsets = tuple(o + start if d == dim else o for d, o in enumerate(offsets))
            shape = tuple(totals[name] if d == dim else s for d, s in enumerate(shape))
        out[name] = Geometry(offsets, shape, local)
    return out


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by clean name (FSDP2 DTensors as they are: they share storage
    with the parameters, so loading into their local tensors updates the model)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {clean_fqn(k): v for k, v in get_model_state_dict(model).items()}


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): clean_fqn(n) for n, p in model.named_parameters()}


def _is_host_offload(optimizer) -> bool:
    from sp_plan.runtime.host_optimizer import HostOffloadOptimizer

    return isinstance(optimizer, HostOffloadOptimizer)


def _optimizer_params(optimizer, model) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(optimizer's parameter object, its model name, the model parameter) for every parameter it steps."""
    names = _param_names(model)
    out = []
    if _is_host_offload(optimizer):
        for master, p in zip(optimizer.masters, optimizer.device_params):
            out.append((master, _name_of(names, p), p))
        return out
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append((p, _name_of(names, p), p))
    return out


def _name_of(names: dict[int, str], p: torch.Tensor) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise RuntimeConfigError(
            "the optimizer steps a tensor that is not a parameter of setup.model: build it after auto_configure "
            "on setup.model.parameters() (setup.make_optimizer does)"
        ) from None


def key(*parts: str) -> str:
    return SEP.join(parts)


def save_entries(setup, optimizer=None, geometry: dict[str, Geometry] | None = None) -> dict[str, Chunk]:
    """This rank's chunks of the model, optimizer states and host masters, by checkpoint key."""
    geometry = geometry or parameter_geometry(setup)
    entries = {key(MODEL, n): geometry[n].chunk(t, n) for n, t in _model_state(setup.model).items()}
    if optimizer is None:
        return entries
    host = _is_host_offload(optimizer)
    for opt_param, name, _ in _optimizer_params(optimizer, setup.model):
        g = geometry[name]
        for state_name, value in optimizer.state.get(opt_param, {}).items():
            k = key(OPTIM, name, state_name)
            if not isinstance(value, torch.Tensor):
                raise RuntimeConfigError(
                    f"optimizer state {state_name!r} of {name} is a {type(value).__name__}, not a tensor: "
                    "only tensor optimizer states are checkpointed"
                )
            entries[k] = Chunk(value, (), ()) if value.dim() == 0 else g.chunk(value, f"optimizer state {k}")
        if host:
            entries[key(MASTER, name)] = g.chunk(opt_param, f"host master of {name}")
    return entries


# ----- DCP planners over chunks ----------------------------------------------------------------------------


def _chunk_metadata(chunk: Chunk):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))


def _save_planner(entries: dict[str, Chunk]):
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class ChunkSavePlanner(DefaultSavePlanner):
        """Writes each rank's chunks at their offsets in the full tensors (identical chunks once)."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> SavePlan:
            items = []
            for fqn, chunk in entries.items():
                if chunk.tensor.numel() == 0 and chunk.tensor.dim() > 0:
                    continue  # an empty FSDP shard (more ranks than rows) holds nothing
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(chunk.offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=_chunk_metadata(chunk),
                                                properties=TensorProperties.create_from_tensor(chunk.tensor),
                                                size=torch.Size(chunk.shape)),
                ))
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            return entries[write_item.index.fqn].tensor.detach()

    return ChunkSavePlanner()


def _load_planner(targets: dict[str, Chunk]):
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class ChunkLoadPlanner(DefaultLoadPlanner):
        """Reads, into each target, the parts of the saved chunks that overlap it (DCP's resharding)."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, target in targets.items():
                source = target.source or name
                md = self.metadata.state_dict_metadata[source]
                if target.tensor.numel() == 0 and target.tensor.dim() > 0:
                    continue
                for item in create_read_items_for_chunk_list(source, md, [_chunk_metadata(target)]):
                    items.append(replace(item, dest_index=MetadataIndex(name, item.dest_index.offset, 0)))
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return targets[index.fqn].tensor

    return ChunkLoadPlanner()


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch": {"Size", "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
              "bool", "complex64", "complex128", "strided", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
              "uint64"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: allow only the classes it is made of (no code from the file)."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise RuntimeConfigError(
            f"the checkpoint's .metadata refers to {module}.{name}, which DCP metadata never contains: "
            "refusing to read it (is it a checkpoint written by torch.distributed.checkpoint?)"
        )


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            file = Path(self._get_metadata_path(kwargs.get("rank")))
            with open(file, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def read_metadata(path: str | os.PathLike):
    """DCP's metadata of a checkpoint directory (what every key's full size, dtype and chunks are)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise RuntimeConfigError(f"{path} has no DCP .metadata file: not a complete checkpoint directory")
    return _reader(path).read_metadata()


# ----- JSON and RNG ------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise RuntimeConfigError(f"{what} {path} is missing: the checkpoint is incomplete or not one of ours")
    if path.stat().st_size > JSON_MAX_BYTES:
        raise RuntimeConfigError(f"{what} {path} is larger than {JSON_MAX_BYTES} bytes: not a checkpoint file")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RuntimeConfigError(f"{what} {path} is not valid JSON: {str(exc).splitlines()[0]}") from None


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON, whole or not at all (temporary file, fsync, rename)."""
    try:
        text = json.dumps(data, indent=1, sort_keys=False)
    except TypeError as exc:
        raise RuntimeConfigError(f"cannot write {path.name}: {exc} (scheduler and data states must be plain JSON)") \
            from None
    atomic_write_text(path, text, error=RuntimeConfigError)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA, when initialised), Python's ``random``, NumPy's
    global generator (when NumPy is imported)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()),
                             "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(_from_b64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [_from_b64(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ----- locating checkpoints --------------------------------------------------------------------------------


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` has a manifest (written last by a save: every other file was written before it).
    Complete is not verified: :func:`verify_checkpoint` checks the files against the manifest."""
    return (Path(path) / MANIFEST).is_file()


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``directory`` as ``(step, path)``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        step = step_of(path)
        if step is not None and is_complete(path):
            found.append((step, path))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The most recent complete checkpoint under ``directory`` (None if there is none); interrupted saves
    (temporary directories, directories without the completion marker) are never returned."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory itself, or the latest complete one under a checkpoint root."""
    path = Path(path)
    if not path.exists():
        raise RuntimeConfigError(f"checkpoint path {path} does not exist")
    if is_complete(path):
        return path
    if path.name.startswith(STEP_PREFIX) or (path / ".metadata").exists():
        raise RuntimeConfigError(
            f"checkpoint {path} is incomplete (no {MANIFEST}: its save was interrupted, or it was written before "
            f"checkpoints had manifests); resume from the checkpoint root to use the latest complete one"
        )
    latest = latest_checkpoint(path)
    if latest is None:
        raise RuntimeConfigError(f"no complete checkpoint under {path} (directories {STEP_PREFIX}NNNNNNNN with "
                                 f"a {MANIFEST})")
    return latest


def step_of(path: str | os.PathLike) -> int | None:
    """The step in a ``step_NNNNNNNN`` directory's name (None for any other name)."""
    name = Path(path).name
    digits = name[len(STEP_PREFIX):]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


# ----- save --------------------------------------------------------------------------------------------------


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def _broadcast(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _param_groups_json(optimizer) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        entry = {}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v.tolist()
            entry[k] = list(v) if isinstance(v, tuple) else v
        groups.append(entry)
    return groups


def _plan_json(setup) -> dict[str, Any]:
    """The plan's model, training options and layout (compared on load), and the whole plan (a resumed run
    on the same number of ranks may reuse it: ``sp_plan.planner.plan.plan_from_dict(state["plan"])``)."""
    plan = setup.plan
    return {"model": plan.model.model_dump(mode="json"), "train": plan.train.model_dump(mode="json"),
            "layout": plan.layout.model_dump(mode="json"), "plan": plan.model_dump(mode="json")}


@dataclass
class CheckpointState:
    """What :func:`load_checkpoint` restored besides the tensors: the step and the bookkeeping."""

    path: Path
    step: int
    world_size: int
    layout: dict[str, int]
    same_layout: bool
    tokens_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ----- verification -------------------------------------------------------------------------------------------


class CheckpointCorruptError(RuntimeConfigError):
    """A checkpoint whose files do not match its manifest (or that has none): which file, which chunk, and
    the expected vs found digest, the same on every rank."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
        more = f" (and {len(problems) - MAX_PROBLEMS_SHOWN} more)" if len(problems) > MAX_PROBLEMS_SHOWN else ""
        super().__init__(f"checkpoint {path} failed verification: {shown}{more}. It cannot be used: resume from "
                         f"an earlier checkpoint (resume=True / --resume picks the newest one that verifies)")


def _hash_range(path: Path, offset: int, length: int) -> str:
    """SHA-256 of ``length`` bytes of ``path`` from ``offset``, read in bounded blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(READ_BLOCK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _hash_file(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    return {"bytes": size, DIGEST: _hash_range(path, 0, size)}


def _owner(name: str, index: int, world: int) -> int:
    """The rank that hashes (and verifies) a tensor file: its writer (``__<rank>_<n>.distcp``) when the
    name says so (its bytes are in that rank's page cache), otherwise round robin."""
    parts = name.split("_")
    if name.startswith("__") and len(parts) > 2 and parts[2].isdigit() and int(parts[2]) < world:
        return int(parts[2])
    return index % world


def _chunk_layout(metadata) -> dict[str, list[dict[str, Any]]]:
    """Tensor file -> its chunks (key, offsets in the full tensor, byte range), from DCP's metadata."""
    files: dict[str, list[dict[str, Any]]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(info.relative_path, []).append(
            {"key": index.fqn, "offsets": list(index.offset or ()), "at": int(info.offset), "bytes": int(info.length)})
    for chunks in files.values():
        chunks.sort(key=lambda c: c["at"])
    return files


def _hash_tensor_files(root: Path, metadata, rank: int, world: int) -> dict[str, dict[str, Any]]:
    """This rank's share of the tensor files: each file's size and every chunk's digest, as written."""
    out = {}
    for i, (name, chunks) in enumerate(sorted(_chunk_layout(metadata).items())):
        if _owner(name, i, world) != rank:
            continue
        file = root / name
        out[name] = {"bytes": file.stat().st_size,
                     "chunks": [{**c, DIGEST: _hash_range(file, c["at"], c["bytes"])} for c in chunks]}
    return out


def _short(digest: Any) -> str:
    return f"{str(digest)[:16]}..." if digest else "nothing"


def _check_file(root: Path, name: str, entry: Mapping[str, Any]) -> list[str]:
    """Problems of one file against its manifest entry (existence, size, whole-file or chunk digests)."""
    file = root / name
    if not file.is_file():
        return [f"{file} is missing"]
    size = file.stat().st_size
    if size != entry.get("bytes"):
        return [f"{file} has {size} bytes, the manifest says {entry.get('bytes')} (truncated or overwritten)"]
    if "chunks" not in entry:
        found = _hash_range(file, 0, size)
        return [] if found == entry.get(DIGEST) else [
            f"{file}: expected {DIGEST} {_short(entry.get(DIGEST))}, found {_short(found)}"]
    problems = []
    for c in entry["chunks"]:
        found = _hash_range(file, int(c["at"]), int(c["bytes"]))
        if found != c.get(DIGEST):
            problems.append(f"{file}: tensor {c['key']} chunk at offsets {tuple(c['offsets'])} (bytes {c['at']}.."
                            f"{int(c['at']) + int(c['bytes'])}): expected {DIGEST} {_short(c.get(DIGEST))}, found "
                            f"{_short(found)}")
    return problems


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's manifest, checked for shape and for the step in the directory's name."""
    path = Path(path)
    manifest = _read_json(path / MANIFEST, "checkpoint manifest")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) \
            or manifest.get("algorithm") != DIGEST:
        raise RuntimeConfigError(f"checkpoint manifest {path / MANIFEST} is not a {DIGEST} manifest of this "
                                 "runtime (no 'files', or another algorithm)")
    for name, entry in manifest["files"].items():  # untrusted: never read outside the checkpoint directory
        parts = Path(name).parts
        if not isinstance(entry, dict) or Path(name).is_absolute() or ".." in parts or not parts:
            raise RuntimeConfigError(f"checkpoint manifest {path / MANIFEST} lists {name!r}, which is not a file "
                                     "inside the checkpoint directory: refusing it")
    named = step_of(path)
    if named is not None and manifest.get("step") != named:
        raise RuntimeConfigError(f"checkpoint {path}: its directory name says step {named}, its {MANIFEST} says "
                                 f"step {manifest.get('step')!r}; rename or remove the directory")
    return manifest


def read_verified_state(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json``, only if it matches the manifest (one process, reads that one
    small file: for choosing a plan before the collective verification of the whole checkpoint)."""
    path = Path(path)
    manifest = read_manifest(path)
    entry = manifest["files"].get(STATE_FILE)
    problems = ([f"{path / STATE_FILE} is not in the manifest"] if entry is None
                else _check_file(path, STATE_FILE, entry))
    if problems:
        raise CheckpointCorruptError(path, problems)
    return _read_json(path / STATE_FILE, "checkpoint state")


def verify_checkpoint(path: str | os.PathLike, group: dist.ProcessGroup | None = None, *,
                      collective: bool = True) -> list[str]:
    """Re-hash a checkpoint's files against its manifest; collective over ``group`` when a process group is
    initialised and ``collective`` (each rank checks a share of the files; False: this process checks all).
    Returns every problem found, the same list on every rank (empty: the checkpoint verifies)."""
    path = Path(path)
    rank, world = _rank_world(group) if collective else (0, 1)
    try:
        manifest: dict | str = read_manifest(path) if rank == 0 else {}
    except RuntimeConfigError as exc:
        manifest = str(exc)
    if world > 1:
        manifest = _broadcast(manifest, group)
    if isinstance(manifest, str):
        return [manifest]
    problems: list[str] = []
    try:
        for i, (name, entry) in enumerate(sorted(manifest["files"].items())):
            if _owner(name, i, world) == rank:
                problems.extend(_check_file(path, name, entry))
    except (OSError, KeyError, TypeError, ValueError) as exc:  # unreadable file, malformed entry
        problems.append(f"{path}: {type(exc).__name__}: {exc}")
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, problems, group=group)
        problems = [p for rank_problems in everyone for p in rank_problems]
    return problems


def require_verified(path: str | os.PathLike, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`CheckpointCorruptError` (on every rank) unless ``path`` verifies."""
    problems = verify_checkpoint(path, group)
    if problems:
        raise CheckpointCorruptError(Path(path), problems)


def _rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group) if group is not None else dist.get_rank(), dist.get_world_size(group)


def find_resumable(directory: str | os.PathLike, log: Callable[[str], None] | None = None) -> tuple[
        Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``directory`` that verifies, and the newer ones skipped with why (each
    also passed to ``log`` on rank 0); collective. ``(None, skipped)`` when none verifies."""
    directory = Path(directory)
    rank, _ = _rank_world()
    candidates = None
    if rank == 0:
        candidates = sorted((str(p) for p in directory.iterdir() if step_of(p) is not None and p.is_dir()),
                            key=lambda p: step_of(p), reverse=True) if directory.is_dir() else []
    skipped: list[tuple[Path, str]] = []
    for candidate in map(Path, _broadcast(candidates)):
        if not is_complete(candidate):
            reason = f"incomplete: no {MANIFEST} (its save was interrupted)"
        else:
            problems = verify_checkpoint(candidate)
            if not problems:
                return candidate, skipped
            reason = "; ".join(problems[:MAX_PROBLEMS_SHOWN]) + (
                f" (and {len(problems) - MAX_PROBLEMS_SHOWN} more)" if len(problems) > MAX_PROBLEMS_SHOWN else "")
        skipped.append((candidate, reason))
        if log is not None and rank == 0:
            log(f"resume: skipping {candidate}: {reason}")
    return None, skipped


def checkpoint_bytes(path: str | os.PathLike) -> int:
    """The bytes of a complete checkpoint, from its manifest (0 when it has none)."""
    try:
        return sum(int(e.get("bytes", 0)) for e in read_manifest(path)["files"].values())
    except (RuntimeConfigError, AttributeError, TypeError, ValueError):
        return 0


def check_checkpoint_dir(directory: str | os.PathLike) -> None:
    """Fail early, on every rank, when checkpoints could not be written to ``directory``: it cannot be created,
    is not a writable directory, or has less free space than its newest checkpoint took (collective)."""
    directory = Path(directory)
    rank, _ = _rank_world()
    error = None
    if rank == 0:
        error = _checkpoint_dir_problem(directory)
    error = _broadcast(error)
    if error is not None:
        raise RuntimeConfigError(error)


def _checkpoint_dir_problem(directory: Path) -> str | None:
    import tempfile

    fix = "choose another checkpoint directory (--checkpoint-dir) or fix its permissions"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"checkpoint directory {directory} is not writable ({exc.strerror or exc}): {fix}"
    latest = latest_checkpoint(directory)
    needed = checkpoint_bytes(latest) if latest is not None else 0
    free = shutil.disk_usage(directory).free
    if needed and free < needed:
        return (f"checkpoint directory {directory} has {free / 1e9:.2f} GB free, its last checkpoint ({latest.name}) "
                f"took {needed / 1e9:.2f} GB: free space there (or fewer --keep-checkpoints) or {fix.split(' or ')[0]}")
    return None


# ----- save (continued) -------------------------------------------------------------------------------------------


#: This process's run identifier (rank 0's, shared by every rank), for runs that pass none.
_PROCESS_RUN_ID: str | None = None


def _default_run_id() -> str:
    global _PROCESS_RUN_ID
    if _PROCESS_RUN_ID is None:
        _PROCESS_RUN_ID = _broadcast(secrets.token_hex(6))
    return _PROCESS_RUN_ID


def _say(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None:
        log(text)
    else:
        print(text, file=sys.stderr, flush=True)


@dataclass
class SaveJob:
    """A save whose temporary directory, RNG files and bookkeeping exist: what is left is writing the
    tensor chunks, the manifest, publishing and verifying (:func:`commit_save`). Everything in it was
    captured at the step being saved."""

    directory: Path
    final: Path
    tmp: Path
    step: int
    entries: dict[str, Chunk]
    state: dict[str, Any]
    keep: int | None
    run_id: str = ""
    #: Rank 0: the run id of a verified-looking checkpoint of the same step that this save replaces.
    replaces: str | None = None
    log: Callable[[str], None] | None = None


def prepare_save(directory: str | os.PathLike, *, step: int, setup, optimizer=None, scheduler=None, data=None,
                 tokens_seen: int = 0, extra: Mapping[str, Any] | None = None,
                 keep: int | None = None, run_id: str | None = None,
                 log: Callable[[str], None] | None = None) -> SaveJob | Path:
    """The collective first half of a save: this rank's chunks, the temporary directory, the RNG states and
    the bookkeeping, all as of now. Returns the final path instead when this run already saved that step."""
    directory = Path(directory)
    final = directory / step_dir_name(step)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    geometry = parameter_geometry(setup)  # collective under TP: before anyone may return early
    run_id = run_id or _default_run_id()
    existing = None
    if rank == 0 and is_complete(final):
        try:
            existing = str(read_manifest(final).get("run_id"))
        except RuntimeConfigError as exc:
            existing = f"unreadable manifest ({exc})"
    elif rank == 0 and final.exists():
        existing = f"an incomplete checkpoint: no {MANIFEST}"
    existing = _broadcast(existing)
    if existing == run_id:  # this run saved this step already
        return final
    entries = save_entries(setup, optimizer, geometry)
    token = _broadcast(secrets.token_hex(4) if rank == 0 else None)
    tmp = directory / f".{final.name}{TMP_INFIX}{token}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale(directory)
        tmp.mkdir()
    _barrier()
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    _write_json(tmp / RNG_DIR / f"rank_{rank}.json", rng_state())
    state = {
        "format": FORMAT_VERSION, "step": step, "world_size": world, "tokens_seen": int(tokens_seen),
        **_plan_json(setup),
        "optimizer": None if optimizer is None else {
            "class": type(getattr(optimizer, "inner", optimizer)).__name__,
            "host_offload": _is_host_offload(optimizer), "param_groups": _param_groups_json(optimizer)},
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scheduler_class": type(scheduler).__name__ if scheduler is not None else None,
        "data": data.state_dict() if data is not None else None,
        "extra": dict(extra or {}),
    } if rank == 0 else {}
    return SaveJob(directory, final, tmp, step, entries, state, keep, run_id, existing, log)


def commit_save(job: SaveJob, group: dist.ProcessGroup | None = None) -> Path:
    """The second half: every rank writes its chunks with DCP and hashes what it wrote; rank 0 writes the
    bookkeeping and the manifest (last) and renames the directory into place; every rank re-reads and
    verifies the published checkpoint; only then is an older checkpoint (or a replaced one of the same step)
    removed. Collective over ``group`` (all ranks; the default group when None), which is all it uses, so it
    may run in a background thread on a group of its own."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world(group)
    metadata = dcp.save({}, storage_writer=dcp.FileSystemWriter(str(job.tmp)), planner=_save_planner(job.entries),
                        process_group=group)
    error, digests = None, {}
    try:
        digests = _hash_tensor_files(job.tmp, metadata, rank, world)
    except OSError as exc:
        error = f"hashing the tensor files of {job.tmp} on rank {rank}: {exc}"
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (error, digests), group=group)
    else:
        everyone = [(error, digests)]
    errors = [e for e, _ in everyone if e]
    previous = None
    if rank == 0 and not errors:
        try:
            files = {name: entry for _, d in everyone for name, entry in d.items()}
            previous = _publish(job, files)
        except Exception as exc:  # every rank must learn it (not wait in a collective for rank 0)
            errors = [str(exc) if isinstance(exc, RuntimeConfigError) else f"{type(exc).__name__}: {exc}"]
    errors = _broadcast(errors, group)
    if errors:
        raise RuntimeConfigError(f"saving checkpoint {job.final} failed: {'; '.join(errors)}")
    problems = verify_checkpoint(job.final, group)  # re-read from disk before anything older is removed
    if rank == 0:
        try:
            _finish(job, previous, problems)
        except Exception as exc:
            errors = [str(exc) if isinstance(exc, RuntimeConfigError) else f"{type(exc).__name__}: {exc}"]
    errors = _broadcast(errors, group)  # also the final barrier
    if problems:
        raise CheckpointCorruptError(job.final, problems)
    if errors:
        raise RuntimeConfigError(f"saving checkpoint {job.final} failed: {'; '.join(errors)}")
    return job.final


def save_checkpoint(directory: str | os.PathLike, *, step: int, setup, optimizer=None, scheduler=None,
                    data=None, tokens_seen: int = 0, extra: Mapping[str, Any] | None = None,
                    keep: int | None = None, run_id: str | None = None,
                    log: Callable[[str], None] | None = None) -> Path:
    """Save a checkpoint of training after ``step`` optimizer steps; collective (every rank calls it).

    Returns ``<directory>/step_<step>``. ``data``: anything with ``state_dict()`` (JSON), e.g.
    :class:`sp_plan.runtime.text_data.GlobalBatches`; ``extra``: JSON-able bookkeeping; ``keep``: once this
    checkpoint verifies, keep only the newest ``keep`` complete checkpoints up to this step (None: keep all;
    checkpoints of later steps, from a run this one resumed before, are never pruned by it). ``run_id``
    identifies the run (default: one per process): saving a step this run already saved is a no-op; a
    step saved by another run is replaced once the new one verifies, reported through ``log`` (rank 0;
    default: stderr). :class:`sp_plan.runtime.async_checkpoint.AsyncCheckpointer` saves the same files while
    training goes on.
    """
    job = prepare_save(directory, step=step, setup=setup, optimizer=optimizer, scheduler=scheduler, data=data,
                       tokens_seen=tokens_seen, extra=extra, keep=keep, run_id=run_id, log=log)
    return job if isinstance(job, Path) else commit_save(job)


def _publish(job: SaveJob, tensor_files: dict[str, dict[str, Any]]) -> Path | None:
    """Rank 0: the bookkeeping, then the manifest (last), then the atomic rename. A checkpoint of the same
    step already there is moved aside (returned), to be removed once the new one verifies."""
    tmp = job.tmp
    _write_json(tmp / STATE_FILE, job.state)
    files = dict(tensor_files)
    for file in sorted(p for p in tmp.rglob("*") if p.is_file() and p.suffix != ".distcp"):
        files[file.relative_to(tmp).as_posix()] = _hash_file(file)
    _write_json(tmp / MANIFEST, {"format": FORMAT_VERSION, "algorithm": DIGEST, "step": job.step,
                                 "run_id": job.run_id, "created": time.time(), "files": files})
    previous = None
    if job.final.exists():  # an earlier save of this step: another run's, or one that never completed
        previous = job.directory / f".{job.final.name}.replaced-{tmp.name.rsplit('-', 1)[-1]}"
        os.replace(job.final, previous)
    os.replace(tmp, job.final)
    fsync_directory(job.directory)
    return previous


def _finish(job: SaveJob, previous: Path | None, problems: list[str]) -> None:
    """Rank 0, after verification: drop a checkpoint that does not verify (putting back the one it replaced),
    or remove the replaced one and prune older checkpoints."""
    if problems:
        shutil.rmtree(job.final, ignore_errors=True)
        if previous is not None:
            os.replace(previous, job.final)
        fsync_directory(job.directory)
        return
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
        if job.replaces is not None:
            what = job.replaces if job.replaces.startswith(("an incomplete", "unreadable")) else (
                f"saved by another run ({job.replaces})")
            _say(job.log, f"checkpoint: replaced {job.final}, {what}, with this run's step {job.step} ({job.run_id})")
    if job.keep is not None and job.keep > 0:
        older = [path for step, path in list_checkpoints(job.directory) if step < job.step]
        for old in older[:max(0, len(older) - (job.keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale(directory: Path) -> None:
    """Temporary directories of saves that never completed (one job per checkpoint directory). A checkpoint
    moved aside to be replaced is put back when the save that replaced it died before publishing, and
    removed once the replacement is complete."""
    for path in directory.iterdir():
        if not path.name.startswith(f".{STEP_PREFIX}") or not path.is_dir():
            continue
        if TMP_INFIX in path.name:
            shutil.rmtree(path, ignore_errors=True)
        elif ".replaced-" in path.name:
            final = directory / path.name[1:].split(".replaced-")[0]
            if is_complete(final):
                shutil.rmtree(path, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(path, final)


# ----- load --------------------------------------------------------------------------------------------------


def check_same_model(saved: Mapping[str, Any], spec, path: Path) -> None:
    """Refuse a checkpoint of another architecture, naming the first differing fields."""
    differ = [f"{name}: checkpoint {saved.get(name)!r} vs model {getattr(spec, name)!r}"
              for name in ARCHITECTURE_FIELDS if saved.get(name) != getattr(spec, name)]
    if differ:
        raise RuntimeConfigError(
            f"checkpoint {path} was saved for {saved.get('name', 'another model')}, not this model "
            f"({'; '.join(differ[:3])}): resume with the same architecture, or start a new checkpoint directory"
        )


def _load_targets(setup, optimizer, metadata, geometry: dict[str, Geometry], path: Path) -> tuple[
        dict[str, Chunk], dict]:
    """Destination chunks for this rank (model, optimizer states created here, host masters) and the new
    optimizer state to install once loaded."""
    saved = metadata.state_dict_metadata
    has_masters = any(k.startswith(MASTER + SEP) for k in saved)
    targets: dict[str, Chunk] = {}
    for name, t in _model_state(setup.model).items():
        source = key(MODEL, name)
        # fp32 weights of a host-offload run live in its masters (its device copies may be bf16)
        if has_masters and key(MASTER, name) in saved and t.dtype == torch.float32:
            source = key(MASTER, name)
        targets[key(MODEL, name)] = geometry[name].chunk(t, name, source)
    new_state: dict = {}
    if optimizer is None:
        return targets, new_state
    host = _is_host_offload(optimizer)
    for opt_param, name, _ in _optimizer_params(optimizer, setup.model):
        g = geometry[name]
        prefix = key(OPTIM, name) + SEP
        names = [k[len(prefix):] for k in saved if k.startswith(prefix)]
        if not names and any(k.startswith(OPTIM + SEP) for k in saved):
            raise RuntimeConfigError(f"checkpoint {path} has no optimizer state for parameter {name}")
        state = {}
        for state_name in names:
            md = saved[prefix + state_name]
            if len(md.size) == 0:
                on_device = any(group.get("capturable") or group.get("fused") for group in optimizer.param_groups)
                value = torch.zeros((), dtype=md.properties.dtype,
                                    device=_local(opt_param).device if on_device else "cpu")
                targets[prefix + state_name] = Chunk(value, (), ())
            else:
                value = torch.zeros_like(opt_param)
                targets[prefix + state_name] = g.chunk(value, prefix + state_name)
            state[state_name] = value
        new_state[opt_param] = state
        if host:
            source = key(MASTER, name) if has_masters else key(MODEL, name)
            targets[key(MASTER, name)] = g.chunk(opt_param, f"host master of {name}", source)
    return targets, new_state


def _check_targets(targets: dict[str, Chunk], metadata, path: Path) -> None:
    saved = metadata.state_dict_metadata
    for name, target in targets.items():
        source = target.source or name
        md = saved.get(source)
        if md is None or not hasattr(md, "size"):
            what = source.split(SEP)
            raise RuntimeConfigError(
                f"checkpoint {path} has no {' '.join(what[:1])} entry {SEP.join(what[1:])!r}: it was saved from "
                "another model (or without the optimizer)"
            )
        if tuple(md.size) != tuple(target.shape):
            raise RuntimeConfigError(
                f"checkpoint {path} holds {source} with shape {tuple(md.size)}, this model's is {tuple(target.shape)}: "
                "it was saved from another model"
            )


def check_state_step(path: Path, state: Mapping[str, Any]) -> int:
    """The step of a checkpoint, from its directory name, which its ``trainer_state.json`` must agree with."""
    named = step_of(path)
    saved = state.get("step")
    if not isinstance(saved, int) or (named is not None and saved != named):
        raise RuntimeConfigError(
            f"checkpoint {path}: its directory name says step {named}, its {STATE_FILE} says step {saved!r}; the "
            "two must agree (was a directory renamed or a file copied in from another checkpoint?)"
        )
    return saved


def load_checkpoint(path: str | os.PathLike, *, setup, optimizer=None, scheduler=None, data=None,
                    restore_rng: bool = True, verify: bool = True) -> CheckpointState:
    """Restore a checkpoint saved by :func:`save_checkpoint` into ``setup.model``, ``optimizer``,
    ``scheduler`` and ``data``; collective. ``path``: a checkpoint directory or a checkpoint root (its
    latest complete checkpoint). Works on any layout of the same model (DCP reshards). ``verify``: check
    every file against the manifest first (:func:`verify_checkpoint`; :class:`CheckpointCorruptError` on
    every rank); pass False only for a checkpoint verified just before (the Trainer does)."""
    path = resolve_checkpoint(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if verify:
        require_verified(path)
    state = _read_json(path / STATE_FILE, "checkpoint state")
    if state.get("format") != FORMAT_VERSION:
        raise RuntimeConfigError(f"checkpoint {path} has format {state.get('format')!r}; this runtime reads "
                                 f"format {FORMAT_VERSION}")
    step = check_state_step(path, state)
    check_same_model(state.get("model") or {}, setup.plan.model, path)
    if optimizer is not None and state.get("optimizer") is None:
        raise RuntimeConfigError(f"checkpoint {path} has no optimizer state: load it with optimizer=None")
    if data is not None:  # checked before any tensor is touched: resuming on other data is refused
        if state.get("data") is None:
            raise RuntimeConfigError(f"checkpoint {path} has no data position")
        data.load_state_dict(state["data"])
    if scheduler is not None:
        if state.get("scheduler") is None:
            raise RuntimeConfigError(f"checkpoint {path} has no LR scheduler state")
        scheduler.load_state_dict(state["scheduler"])
    geometry = parameter_geometry(setup)
    metadata = read_metadata(path)
    with torch.no_grad():
        targets, new_state = _load_targets(setup, optimizer, metadata, geometry, path)
        _check_targets(targets, metadata, path)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load({}, storage_reader=_reader(path), planner=_load_planner(targets))
        except (Exception, CheckpointException) as exc:  # DCP raises one CheckpointException on every rank
            # (a BaseException: it carries every failing rank's traceback, which names no file)
            first = str(exc).strip().splitlines()
            raise RuntimeConfigError(
                f"reading the tensors of checkpoint {path} failed ({type(exc).__name__}: "
                f"{first[0] if first else ''}): the files changed since the checkpoint was verified, or it was "
                "loaded with verify=False; verify_checkpoint() names the damaged file"
            ) from None
    if optimizer is not None:
        _restore_optimizer(optimizer, new_state, state["optimizer"], path)
    same_layout = state.get("world_size") == world and state.get("layout") == setup.plan.layout.model_dump(mode="json")
    if restore_rng:
        saved_rank = rank if state.get("world_size") == world else 0
        set_rng_state(_read_json(path / RNG_DIR / f"rank_{saved_rank}.json", "RNG state"))
    _barrier()
    return CheckpointState(path=path, step=step, world_size=int(state.get("world_size", 0)),
                           layout=state.get("layout") or {}, same_layout=same_layout,
                           tokens_seen=int(state.get("tokens_seen", 0)), extra=state.get("extra") or {})


def _restore_optimizer(optimizer, new_state: dict, saved: Mapping[str, Any], path: Path) -> None:
    groups = saved.get("param_groups") or []
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeConfigError(
            f"checkpoint {path} has {len(groups)} optimizer parameter group(s), the optimizer has "
            f"{len(optimizer.param_groups)}: build the optimizer the same way as the saved run"
        )
    for group, values in zip(optimizer.param_groups, groups):
        for k, v in values.items():
            current = group.get(k)
            if isinstance(current, tuple) and isinstance(v, list):
                v = tuple(v)
            elif isinstance(current, torch.Tensor):
                current.fill_(v)
                continue
            group[k] = v
    optimizer.state.clear()  # HostOffloadOptimizer: the wrapped optimizer's (shared) state dict
    for p, s in new_state.items():
        if s:
            optimizer.state[p] = s
    if _is_host_offload(optimizer):  # device parameters from the (fp32) masters, as after a step
        with torch.no_grad():
            for p, master in zip(optimizer.device_params, optimizer.masters):
                _local(p.data).copy_(master)


# ----- the unparallelised model from a checkpoint --------------------------------------------------------


def load_full_state_dict(path: str | os.PathLike, *, prefix: str = MODEL,
                         verify: bool = True) -> dict[str, torch.Tensor]:
    """The unparallelised model's tensors of a checkpoint (single process, no process group needed),
    keyed like the original model's ``state_dict``: for an unparallelised model, another tool, or tests.
    ``prefix``: ``"model"`` (default), ``"master"`` (fp32 host masters) or ``"optim"`` (keys
    ``<fqn>::<state>``). ``verify``: check the files against the manifest first (in this process)."""
    path = resolve_checkpoint(path)
    if verify:
        problems = verify_checkpoint(path, collective=False)
        if problems:
            raise CheckpointCorruptError(path, problems)
    metadata = read_metadata(path)
    head = prefix + SEP
    targets = {}
    for name, md in metadata.state_dict_metadata.items():
        if name.startswith(head) and hasattr(md, "size"):
            size = tuple(md.size)
            targets[name] = Chunk(torch.empty(size, dtype=md.properties.dtype), (0,) * len(size), size)
    if not targets:
        raise RuntimeConfigError(f"checkpoint {path} has no {prefix!r} entries")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({}, storage_reader=_reader(path), planner=_load_planner(targets), no_dist=True)
    return {name[len(head):]: chunk.tensor for name, chunk in targets.items()}


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON bookkeeping of a checkpoint (step, data position, plan's model/train/layout, ...)."""
    return _read_json(resolve_checkpoint(path) / STATE_FILE, "checkpoint state")


__all__ = [
    "CheckpointCorruptError", "CheckpointState", "Chunk", "check_checkpoint_dir", "find_resumable",
    "latest_checkpoint", "list_checkpoints", "load_checkpoint", "load_full_state_dict", "parameter_geometry",
    "read_manifest", "read_state", "read_verified_state", "resolve_checkpoint", "save_checkpoint",
    "verify_checkpoint",
]
