"""Chunks to and from ``torch.distributed.checkpoint`` (DCP): planners, a safe metadata reader, read and write.

DCP's default planners flatten a state dict of DTensors; here every rank hands over plain
:class:`~sp_plan.runtime.checkpoint.geometry.Chunk` s (a local tensor, its offsets and the full shape) keyed by
checkpoint key, so the saved tensors are the unparallelised model's whatever the layout, and loading on
another layout asks DCP for this rank's chunks (DCP reads the overlapping parts of the saved ones: its
resharding).

**Untrusted files.** DCP's ``.metadata`` is a pickle, read here with an unpickler restricted to DCP's
metadata classes; tensors are read by DCP with ``torch.load(weights_only=True)``. No byte (pickled) items
are written or read.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sp_plan.runtime.checkpoint.geometry import Chunk
from sp_plan.runtime.errors import RuntimeConfigError


def _chunk_metadata(chunk: Chunk):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))


def save_planner(entries: dict[str, Chunk]):
    """A DCP save planner that writes each rank's chunks at their offsets in the full tensors."""
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


def load_planner(targets: dict[str, Chunk]):
    """A DCP load planner that reads, into each target chunk, the parts of the saved chunks overlapping it."""
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


def reader(path: Path):
    """DCP's file-system reader of a step directory, its ``.metadata`` read with the restricted unpickler."""
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
    return reader(path).read_metadata()


def write_chunks(directory: Path, entries: dict[str, Chunk], group: dist.ProcessGroup | None = None):
    """Every rank writes its chunks into ``directory`` (collective over ``group``); DCP's metadata of the
    whole save (which file and byte range holds each chunk)."""
    import torch.distributed.checkpoint as dcp

    return dcp.save({}, storage_writer=dcp.FileSystemWriter(str(directory)), planner=save_planner(entries),
                    process_group=group)


def read_chunks(path: Path, targets: dict[str, Chunk]) -> None:
    """Every rank reads the parts of the saved chunks that overlap its ``targets`` (collective). A failure is
    one :class:`RuntimeConfigError` naming the checkpoint on every rank, not DCP's multi-rank traceback."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load({}, storage_reader=reader(path), planner=load_planner(targets))
    except (Exception, CheckpointException) as exc:  # DCP raises one CheckpointException on every rank
        # (a BaseException: it carries every failing rank's traceback, which names no file)
        first = str(exc).strip().splitlines()
        raise RuntimeConfigError(
            f"reading the tensors of checkpoint {path} failed ({type(exc).__name__}: "
            f"{first[0] if first else ''}): the files changed since the checkpoint was verified, or it was "
            "loaded with verify=False; verify_checkpoint() names the damaged file"
        ) from None


def read_chunks_here(path: Path, targets: dict[str, Chunk]) -> None:
    """:func:`read_chunks` in this process alone (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({}, storage_reader=reader(path), planner=load_planner(targets), no_dist=True)
