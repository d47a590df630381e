"""A save that failed part-way: remove what it wrote and say why in one line, on every rank.

A full disk was the common case: DCP raised a ``CheckpointException`` (a ``BaseException`` carrying every
failing rank's traceback) on every rank, the partial temporary directory kept the space it had taken, and
the free-space check before the next run (:func:`.store.check_checkpoint_dir`) then refused ``--resume``
until the user found and deleted it by hand. Here the partial save is removed by rank 0 as soon as every
rank knows the save failed, and the error names the directory, the space the checkpoint needs and the space
there is, so the fix (free space, another directory) is in the message and resuming works right after it.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from sp_plan.runtime.checkpoint.comm import all_gather, broadcast, rank_world
from sp_plan.runtime.checkpoint.geometry import Chunk
from sp_plan.runtime.checkpoint.store import latest_checkpoint
from sp_plan.runtime.errors import RuntimeConfigError

#: errnos that mean the filesystem (or the user's quota on it) has no room for the save.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def os_errors(exc: BaseException) -> Iterator[OSError]:
    """The OSErrors behind ``exc``: itself, its causes and contexts, and each rank's failure inside a DCP
    ``CheckpointException`` (its ``failures``: rank -> (exception, traceback))."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            yield current
        for wrapped in (getattr(current, "failures", None) or {}).values():
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(inner, BaseException):
                todo.append(inner)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def is_disk_full(exc: BaseException) -> bool:
    return any(e.errno in NO_SPACE for e in os_errors(exc))


def first_line(exc: BaseException) -> str:
    """A one-line account of ``exc``: its first OSError when it has one (DCP's text is a traceback per rank)."""
    for error in os_errors(exc):
        return f"{type(error).__name__}: {error.strerror or error}" + (f" ({error.filename})" if error.filename else "")
    if isinstance(exc, RuntimeConfigError):
        return str(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def chunk_bytes(entries: dict[str, Chunk]) -> int:
    """Bytes of tensor data this rank's chunks put on disk."""
    return sum(chunk.tensor.numel() * chunk.tensor.element_size() for chunk in entries.values())


def failures_of(exc: BaseException, rank: int) -> list[tuple[int, str, bool]]:
    """(rank, one line, disk full) for each rank ``exc`` reports a failure of: a DCP ``CheckpointException``
    (raised alike on every rank) names the ranks that failed; any other exception is this rank's."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        found = []
        for failed, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            inner = inner if isinstance(inner, BaseException) else exc
            found.append((int(failed), first_line(inner), is_disk_full(inner)))
        return found
    return [(rank, first_line(exc), is_disk_full(exc))]


def describe_failure(directory: Path, final: Path, needed: int, failures: list[tuple[int, str, bool]]) -> str:
    """Rank 0's line for a failed save of ``final``: ``failures`` is (rank, one line, disk full) per failing
    rank; ``needed`` the checkpoint's tensor bytes over all ranks."""
    latest = latest_checkpoint(directory)
    kept = f"{latest.name} is still the latest checkpoint" if latest else "no earlier checkpoint exists"
    ranks = ", ".join(str(rank) for rank, _, _ in failures)
    free = shutil.disk_usage(directory).free
    # A full disk does not always surface as ENOSPC: torch's writer checks its own file position and raises
    # "unexpected pos" after a short write. Less room than the checkpoint needs, with the partial save
    # removed, is the same diagnosis whatever the exception says.
    if any(full for _, _, full in failures) or free < needed:
        return (f"saving checkpoint {final.name} failed: no space left in {directory} (rank {ranks}): the "
                f"checkpoint needs {needed / 1e9:.3f} GB, {free / 1e9:.3f} GB is free with the partial save removed; "
                f"{kept}. Free space there or give another --checkpoint-dir (fewer --keep-checkpoints leaves room "
                "for later saves), then continue with --resume")
    reasons = "; ".join(sorted({line for _, line, _ in failures}))
    return f"saving checkpoint {final.name} in {directory} failed on rank {ranks}: {reasons}; the partial save was " \
           f"removed and {kept}"


def clean_up_failed_save(directory: Path, final: Path, tmp: Path, entries: dict[str, Chunk],
                         exc: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """Collective, after a step of the save where any rank may have failed (``exc`` its failure, None where
    it did not): when one did, rank 0 removes the temporary directory and every rank raises the same
    one-line :class:`RuntimeConfigError`. Returns when no rank failed."""
    rank, _ = rank_world(group)
    mine = failures_of(exc, rank) if exc is not None else []
    everyone = all_gather((mine, chunk_bytes(entries)), group)
    by_rank = {failure[0]: failure for failures, _ in everyone for failure in failures}
    if not by_rank:
        return
    message = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        message = describe_failure(directory, final, sum(size for _, size in everyone),
                                   [by_rank[r] for r in sorted(by_rank)])
    raise RuntimeConfigError(broadcast(message, group))


__all__ = ["NO_SPACE", "chunk_bytes", "clean_up_failed_save", "describe_failure", "failures_of", "first_line",
           "is_disk_full", "os_errors"]
