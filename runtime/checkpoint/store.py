"""Step directories under a checkpoint root: finding them, publishing one atomically, pruning old ones.

**Atomicity.** Every rank writes into ``<dir>/.step_00000120.tmp-<id>``; once the manifest is written
(last), rank 0 renames the directory to ``step_00000120`` (:func:`publish`: atomic on POSIX).
:func:`latest_checkpoint` only considers ``step_*`` directories with a manifest, so a save interrupted at any
point (a killed rank, a full disk) is never picked up; the stale temporary directory is removed by the next
save (:func:`remove_stale`). A step directory of the same number saved by another run is moved aside and
replaced only once the new one verifies (:func:`discard` puts it back otherwise). One job per checkpoint
directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from sp_plan.cost_models.atomic_io import fsync_directory
from sp_plan.runtime.checkpoint.comm import broadcast, rank_world
from sp_plan.runtime.checkpoint.files import MANIFEST, STEP_PREFIX, TMP_INFIX, step_of
from sp_plan.runtime.checkpoint.manifest import checkpoint_bytes, is_complete, summarize, verify_checkpoint
from sp_plan.runtime.errors import RuntimeConfigError

#: Infix of a checkpoint moved aside while a save of the same step replaces it.
REPLACED_INFIX = ".replaced-"

# ----- locating checkpoints --------------------------------------------------------------------------------


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


def find_resumable(directory: str | os.PathLike, log: Callable[[str], None] | None = None) -> tuple[
        Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``directory`` that verifies, and the newer ones skipped with why (each
    also passed to ``log`` on rank 0); collective. ``(None, skipped)`` when none verifies."""
    directory = Path(directory)
    rank, _ = rank_world()
    candidates = None
    if rank == 0:
        candidates = sorted((str(p) for p in directory.iterdir() if step_of(p) is not None and p.is_dir()),
                            key=lambda p: step_of(p), reverse=True) if directory.is_dir() else []
    skipped: list[tuple[Path, str]] = []
    for candidate in map(Path, broadcast(candidates)):
        if not is_complete(candidate):
            reason = f"incomplete: no {MANIFEST} (its save was interrupted)"
        else:
            problems = verify_checkpoint(candidate)
            if not problems:
                return candidate, skipped
            reason = summarize(problems)
        skipped.append((candidate, reason))
        if log is not None and rank == 0:
            log(f"resume: skipping {candidate}: {reason}")
    return None, skipped


# ----- before the first save ---------------------------------------------------------------------------------


def check_checkpoint_dir(directory: str | os.PathLike) -> None:
    """Fail early, on every rank, when checkpoints could not be written to ``directory``: it cannot be created,
    is not a writable directory, or has less free space than its newest checkpoint took (collective)."""
    directory = Path(directory)
    rank, _ = rank_world()
    error = None
    if rank == 0:
        error = _checkpoint_dir_problem(directory)
    error = broadcast(error)
    if error is not None:
        raise RuntimeConfigError(error)


def _checkpoint_dir_problem(directory: Path) -> str | None:
    fix = "choose another checkpoint directory (--checkpoint-dir) or fix its permissions"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"checkpoint directory {directory} is not writable ({exc.strerror or exc}): {fix}"
    # A save that died (a killed rank) left its temporary directory: the next save removes it anyway, and the
    # free space it holds must count, or a full disk would refuse --resume until the user found it by hand.
    remove_stale(directory)
    latest = latest_checkpoint(directory)
    needed = checkpoint_bytes(latest) if latest is not None else 0
    free = shutil.disk_usage(directory).free
    if needed and free < needed:
        return (f"checkpoint directory {directory} has {free / 1e9:.2f} GB free, its last checkpoint ({latest.name}) "
                f"took {needed / 1e9:.2f} GB: free space there (or fewer --keep-checkpoints) or {fix.split(' or ')[0]}")
    return None


# ----- publishing (rank 0) -----------------------------------------------------------------------------------


def temporary_dir(directory: Path, final: Path, token: str) -> Path:
    """Where a save of ``final`` writes until it is published."""
    return directory / f".{final.name}{TMP_INFIX}{token}"


def publish(tmp: Path, final: Path) -> Path | None:
    """Rename a complete temporary directory to its step directory (atomic). A checkpoint of the same step
    already there is moved aside (returned), to be removed once the new one verifies."""
    directory = final.parent
    previous = None
    if final.exists():  # an earlier save of this step: another run's, or one that never completed
        previous = directory / f".{final.name}{REPLACED_INFIX}{tmp.name.rsplit('-', 1)[-1]}"
        os.replace(final, previous)
    os.replace(tmp, final)
    fsync_directory(directory)
    return previous


def discard(final: Path, previous: Path | None) -> None:
    """Drop a published checkpoint that does not verify, putting back the one it replaced."""
    shutil.rmtree(final, ignore_errors=True)
    if previous is not None:
        os.replace(previous, final)
    fsync_directory(final.parent)


def prune(directory: Path, step: int, keep: int | None) -> None:
    """Keep only the newest ``keep`` complete checkpoints up to ``step`` (None or 0: keep all); later steps,
    from a run this one resumed before, are never pruned. Each is renamed to a temporary name (atomic) before
    it is removed: a job killed while removing it leaves a stale temporary directory, which the next save (or
    resume) removes, never a half-removed step directory (without its manifest nothing would prune it)."""
    if keep is not None and keep > 0:
        older = [path for s, path in list_checkpoints(directory) if s < step]
        for old in older[:max(0, len(older) - (keep - 1))]:
            doomed = directory / f".{old.name}{TMP_INFIX}pruned-{secrets.token_hex(4)}"
            try:
                os.replace(old, doomed)
            except FileNotFoundError:  # removed meanwhile (by hand): nothing to prune
                continue
            fsync_directory(directory)
            shutil.rmtree(doomed, ignore_errors=True)


def remove_stale(directory: Path) -> None:
    """Temporary directories of saves that never completed (one job per checkpoint directory). A checkpoint
    moved aside to be replaced is put back when the save that replaced it died before publishing, and
    removed once the replacement is complete."""
    for path in directory.iterdir():
        if not path.name.startswith(f".{STEP_PREFIX}") or not path.is_dir():
            continue
        if TMP_INFIX in path.name:
            shutil.rmtree(path, ignore_errors=True)
        elif REPLACED_INFIX in path.name:
            final = directory / path.name[1:].split(REPLACED_INFIX)[0]
            if is_complete(final):
                shutil.rmtree(path, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(path, final)
