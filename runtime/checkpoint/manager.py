"""Save and load a checkpoint as a set of named stateful pieces (:mod:`~sp_plan.runtime.checkpoint.piece`).

:class:`CheckpointManager` holds the pieces by name and runs a save in two halves: :meth:`~CheckpointManager.
prepare_save` (collective, at the step: every piece's tensors, per-rank files and JSON captured, the
temporary directory made) and :func:`commit_save` (DCP's write, the manifest, the atomic rename, the
re-read verification, the pruning), which :class:`sp_plan.runtime.async_checkpoint.AsyncCheckpointer` runs in a
thread. Loading verifies the checkpoint, lets every piece check and restore its JSON state, then reads
every piece's tensors with one DCP load and lets the pieces install them.

:func:`save_checkpoint` / :func:`load_checkpoint` are the training set of pieces (:func:`training_pieces`:
model parts, optimizer, data position, LR scheduler, bookkeeping, RNG) plus any ``pieces=`` of the caller's.
The step and the world size are the checkpoint's own: ``trainer_state.json`` starts with ``format``,
``step`` and ``world_size``, then each piece's entries.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from sp_plan.runtime.checkpoint.comm import all_gather, barrier, broadcast, rank_world
from sp_plan.runtime.checkpoint.save_failure import clean_up_failed_save
from sp_plan.runtime.checkpoint.dcp_io import read_chunks, read_chunks_here, read_metadata, write_chunks
from sp_plan.runtime.checkpoint.files import (
    FORMAT_VERSION, MANIFEST, SEP, STATE_FILE, read_json, step_dir_name, step_of, write_json,
)
from sp_plan.runtime.checkpoint.geometry import Chunk
from sp_plan.runtime.checkpoint.manifest import (
    CheckpointCorruptError, hash_tensor_files, is_complete, read_manifest, require_verified, verify_checkpoint,
    write_manifest,
)
from sp_plan.runtime.checkpoint.model_piece import MODEL, ModelPiece
from sp_plan.runtime.checkpoint.optimizer_piece import OptimizerPiece
from sp_plan.runtime.checkpoint.piece import Loading, Piece
from sp_plan.runtime.checkpoint.state import DataPiece, RngPiece, SchedulerPiece, TrainStatePiece
from sp_plan.runtime.checkpoint.store import (
    discard, prune, publish, remove_stale, resolve_checkpoint, temporary_dir,
)
from sp_plan.runtime.errors import RuntimeConfigError

#: ``trainer_state.json`` entries the manager writes itself (no piece may).
OWN_ENTRIES = ("format", "step", "world_size")


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


#: This process's run identifier (rank 0's, shared by every rank), for runs that pass none.
_PROCESS_RUN_ID: str | None = None


def _default_run_id() -> str:
    global _PROCESS_RUN_ID
    if _PROCESS_RUN_ID is None:
        _PROCESS_RUN_ID = broadcast(secrets.token_hex(6))
    return _PROCESS_RUN_ID


def _say(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None:
        log(text)
    else:
        print(text, file=sys.stderr, flush=True)


def _merged(what: str, parts: Iterable[tuple[str, Mapping[str, Any]]],
            owners: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One dict from each piece's, refusing a key that two pieces (or a piece and the manager) both claim."""
    out: dict[str, Any] = {}
    owner = dict(owners or {})
    for name, entries in parts:
        for k, v in entries.items():
            if k in owner:
                raise RuntimeConfigError(f"checkpoint pieces {owner[k]!r} and {name!r} both save the {what} {k!r}: "
                                         "give one of them other keys")
            owner[k] = name
            out[k] = v
    return out


class CheckpointManager:
    """Saves and loads the pieces registered with it, in registration order (see
    :mod:`sp_plan.runtime.checkpoint.piece`); collective: every rank registers the same pieces."""

    def __init__(self, pieces: Iterable[Piece] = ()) -> None:
        self._pieces: dict[str, Piece] = {}
        for piece in pieces:
            self.register(piece)

    def register(self, piece: Piece) -> Piece:
        """Add ``piece`` under its name (after those registered before it); returns it."""
        if not piece.name:
            raise RuntimeConfigError(f"a checkpoint piece needs a name ({type(piece).__name__} has none)")
        if piece.name in self._pieces:
            raise RuntimeConfigError(f"a checkpoint piece named {piece.name!r} is registered already "
                                     f"({type(self._pieces[piece.name]).__name__}): names key the pieces")
        self._pieces[piece.name] = piece
        return piece

    @property
    def pieces(self) -> Mapping[str, Piece]:
        return MappingProxyType(self._pieces)

    # -- save --------------------------------------------------------------------------------------------
    def prepare_save(self, directory: str | os.PathLike, *, step: int, keep: int | None = None,
                     run_id: str | None = None, log: Callable[[str], None] | None = None) -> SaveJob | Path:
        """The collective first half of a save: this rank's chunks, the temporary directory, the per-rank files
        and the bookkeeping, all as of now. Returns the final path instead when this run already saved that
        step."""
        directory = Path(directory)
        final = directory / step_dir_name(step)
        rank, world = rank_world()
        pieces = list(self._pieces.values())
        for piece in pieces:  # collective (the TP geometry): before anyone may return early
            piece.begin()
        run_id = run_id or _default_run_id()
        existing = None
        if rank == 0 and is_complete(final):
            try:
                existing = str(read_manifest(final).get("run_id"))
            except RuntimeConfigError as exc:
                existing = f"unreadable manifest ({exc})"
        elif rank == 0 and final.exists():
            existing = f"an incomplete checkpoint: no {MANIFEST}"
        existing = broadcast(existing)
        if existing == run_id:  # this run saved this step already
            return final
        entries = _merged("tensor", ((p.name, p.save_chunks()) for p in pieces))
        token = broadcast(secrets.token_hex(4) if rank == 0 else None)
        tmp = temporary_dir(directory, final, token)
        failure = None
        if rank == 0:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                remove_stale(directory)
                tmp.mkdir()
            except OSError as exc:  # a full disk, lost permissions: every rank must learn it
                failure = exc
        clean_up_failed_save(directory, final, tmp, entries, failure)  # collective: also the barrier
        try:
            for name, data in _merged("file", ((p.name, p.save_rank_files(rank)) for p in pieces)).items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                write_json(tmp / name, data)
        except Exception as exc:  # noqa: BLE001 - a full disk, mostly; any failure must reach every rank
            failure = exc
        clean_up_failed_save(directory, final, tmp, entries, failure)
        state = {"format": FORMAT_VERSION, "step": step, "world_size": world,
                 **_merged("trainer_state.json entry", ((p.name, p.save_json()) for p in pieces),
                           owners={k: "checkpoint" for k in OWN_ENTRIES})} if rank == 0 else {}
        return SaveJob(directory, final, tmp, step, entries, state, keep, run_id, existing, log)

    def save(self, directory: str | os.PathLike, *, step: int, keep: int | None = None, run_id: str | None = None,
             log: Callable[[str], None] | None = None) -> Path:
        """Both halves of a save (:meth:`prepare_save`, :func:`commit_save`); collective."""
        job = self.prepare_save(directory, step=step, keep=keep, run_id=run_id, log=log)
        return job if isinstance(job, Path) else commit_save(job)

    # -- load --------------------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, *, verify: bool = True) -> Loading:
        """Restore every registered piece from a checkpoint directory (or a checkpoint root's latest complete
        one); collective. ``verify``: check every file against the manifest first. Returns what was loaded
        (the step directory and its ``trainer_state.json``)."""
        path = resolve_checkpoint(path)
        rank, world = rank_world()
        if verify:
            require_verified(path)
        state = read_json(path / STATE_FILE, "checkpoint state")
        if state.get("format") != FORMAT_VERSION:
            raise RuntimeConfigError(f"checkpoint {path} has format {state.get('format')!r}; this runtime reads "
                                     f"format {FORMAT_VERSION}")
        check_state_step(path, state)
        loading = Loading(path, state, rank, world)
        pieces = list(self._pieces.values())
        for piece in pieces:  # before any tensor is touched: a mismatch (other data, ...) is refused
            piece.load_json(loading)
        for piece in pieces:
            piece.begin()
        loading.metadata = read_metadata(path)
        with torch.no_grad():
            targets = _merged("tensor", ((p.name, p.load_targets(loading)) for p in pieces))
            _check_targets(targets, loading.metadata, path)
            read_chunks(path, targets)
        for piece in pieces:
            piece.load_finish(loading)
        barrier()
        return loading


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


def commit_save(job: SaveJob, group: dist.ProcessGroup | None = None) -> Path:
    """The second half: every rank writes its chunks with DCP and hashes what it wrote; rank 0 writes the
    bookkeeping and the manifest (last) and renames the directory into place; every rank re-reads and
    verifies the published checkpoint; only then is an older checkpoint (or a replaced one of the same step)
    removed. Collective over ``group`` (all ranks; the default group when None), which is all it uses, so it
    may run in a background thread on a group of its own."""
    rank, world = rank_world(group)

    def failed(exc: BaseException | None) -> None:  # collective: the partial save removed, one line everywhere
        clean_up_failed_save(job.directory, job.final, job.tmp, job.entries, exc, group)

    try:
        metadata = write_chunks(job.tmp, job.entries, group)
    except (Exception, CheckpointException) as exc:  # DCP raises on every rank, with each rank's failure
        failed(exc)
        raise
    failure, digests = None, {}
    try:
        digests = hash_tensor_files(job.tmp, metadata, rank, world)
    except OSError as exc:
        failure = exc
    failed(failure)
    everyone = all_gather(digests, group)
    previous, failure = None, None
    if rank == 0:
        try:
            previous = _publish(job, {name: entry for d in everyone for name, entry in d.items()})
        except Exception as exc:  # every rank must learn it (not wait in a collective for rank 0)
            failure = exc
    failed(failure)
    errors: list[str] = []
    problems = verify_checkpoint(job.final, group)  # re-read from disk before anything older is removed
    if rank == 0:
        try:
            _finish(job, previous, problems)
        except Exception as exc:
            errors = [str(exc) if isinstance(exc, RuntimeConfigError) else f"{type(exc).__name__}: {exc}"]
    errors = broadcast(errors, group)  # also the final barrier
    if problems:
        raise CheckpointCorruptError(job.final, problems)
    if errors:
        raise RuntimeConfigError(f"saving checkpoint {job.final} failed: {'; '.join(errors)}")
    return job.final


def _publish(job: SaveJob, tensor_files: dict[str, dict[str, Any]]) -> Path | None:
    """Rank 0: the bookkeeping, then the manifest (last), then the atomic rename; the checkpoint it moved
    aside (an earlier save of the same step), if any."""
    write_json(job.tmp / STATE_FILE, job.state)
    write_manifest(job.tmp, tensor_files, step=job.step, run_id=job.run_id)
    return publish(job.tmp, job.final)


def _finish(job: SaveJob, previous: Path | None, problems: list[str]) -> None:
    """Rank 0, after verification: drop a checkpoint that does not verify (putting back the one it replaced),
    or remove the replaced one and prune older checkpoints."""
    if problems:
        discard(job.final, previous)
        return
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
        if job.replaces is not None:
            what = job.replaces if job.replaces.startswith(("an incomplete", "unreadable")) else (
                f"saved by another run ({job.replaces})")
            _say(job.log, f"checkpoint: replaced {job.final}, {what}, with this run's step {job.step} ({job.run_id})")
    prune(job.directory, job.step, job.keep)


# ----- the training set of pieces ----------------------------------------------------------------------------


def training_pieces(setup, optimizer=None, scheduler=None, data=None, *, tokens_seen: int = 0,
                    extra: Mapping[str, Any] | None = None, rng: bool = True) -> list[Piece]:
    """What a training checkpoint holds, in order: ``model`` (``setup``'s model parts and plan),
    ``optimizer``, ``data``, ``scheduler``, ``train_state`` (tokens seen, ``extra``) and ``rng``."""
    model = ModelPiece(setup)
    pieces: list[Piece] = [model, OptimizerPiece(optimizer, model), DataPiece(data), SchedulerPiece(scheduler),
                           TrainStatePiece(tokens_seen, extra)]
    if rng:
        pieces.append(RngPiece())
    return pieces


def prepare_save(directory: str | os.PathLike, *, step: int, setup, optimizer=None, scheduler=None, data=None,
                 tokens_seen: int = 0, extra: Mapping[str, Any] | None = None,
                 keep: int | None = None, run_id: str | None = None,
                 log: Callable[[str], None] | None = None, pieces: Iterable[Piece] = ()) -> SaveJob | Path:
    """:meth:`CheckpointManager.prepare_save` over :func:`training_pieces` and ``pieces``."""
    manager = CheckpointManager([*training_pieces(setup, optimizer, scheduler, data, tokens_seen=tokens_seen,
                                                  extra=extra), *pieces])
    return manager.prepare_save(directory, step=step, keep=keep, run_id=run_id, log=log)


def save_checkpoint(directory: str | os.PathLike, *, step: int, setup, optimizer=None, scheduler=None,
                    data=None, tokens_seen: int = 0, extra: Mapping[str, Any] | None = None,
                    keep: int | None = None, run_id: str | None = None,
                    log: Callable[[str], None] | None = None, pieces: Iterable[Piece] = ()) -> Path:
    """Save a checkpoint of training after ``step`` optimizer steps; collective (every rank calls it).

    Returns ``<directory>/step_<step>``. ``data``: anything with ``state_dict()`` (JSON), e.g.
    :class:`sp_plan.runtime.text_data.GlobalBatches`; ``extra``: JSON-able bookkeeping; ``pieces``: more named
    pieces to save beside the training ones (:mod:`sp_plan.runtime.checkpoint.piece`); ``keep``: once this
    checkpoint verifies, keep only the newest ``keep`` complete checkpoints up to this step (None: keep all;
    checkpoints of later steps, from a run this one resumed before, are never pruned by it). ``run_id``
    identifies the run (default: one per process): saving a step this run already saved is a no-op; a
    step saved by another run is replaced once the new one verifies, reported through ``log`` (rank 0;
    default: stderr). :class:`sp_plan.runtime.async_checkpoint.AsyncCheckpointer` saves the same files while
    training goes on.
    """
    job = prepare_save(directory, step=step, setup=setup, optimizer=optimizer, scheduler=scheduler, data=data,
                       tokens_seen=tokens_seen, extra=extra, keep=keep, run_id=run_id, log=log, pieces=pieces)
    return job if isinstance(job, Path) else commit_save(job)


def load_checkpoint(path: str | os.PathLike, *, setup, optimizer=None, scheduler=None, data=None,
                    restore_rng: bool = True, verify: bool = True, pieces: Iterable[Piece] = ()) -> CheckpointState:
    """Restore a checkpoint saved by :func:`save_checkpoint` into ``setup``'s model parts, ``optimizer``,
    ``scheduler``, ``data`` and ``pieces``; collective. ``path``: a checkpoint directory or a checkpoint root
    (its latest complete checkpoint). Works on any layout of the same model (DCP reshards). ``verify``: check
    every file against the manifest first (:func:`verify_checkpoint`; :class:`CheckpointCorruptError` on
    every rank); pass False only for a checkpoint verified just before (the Trainer does)."""
    manager = CheckpointManager([*training_pieces(setup, optimizer, scheduler, data, rng=restore_rng), *pieces])
    loading = manager.load(path, verify=verify)
    state = loading.state
    same_layout = loading.same_world and _same_layout(state.get("layout"), setup.plan.layout)
    return CheckpointState(path=loading.path, step=state["step"], world_size=int(state.get("world_size", 0)),
                           layout=state.get("layout") or {}, same_layout=same_layout,
                           tokens_seen=int(state.get("tokens_seen", 0)), extra=state.get("extra") or {})


def _same_layout(saved: object, layout) -> bool:
    """Whether a checkpoint's recorded layout is ``layout``. Compared as layouts, not as dicts: a checkpoint
    written before a degree was registered (``pp``) omits it, and a missing degree is 1."""
    if not isinstance(saved, dict):
        return False
    try:
        return type(layout).model_validate(saved) == layout
    except ValueError:  # pydantic's ValidationError: a degree this build does not know
        return False


# ----- outside a run -----------------------------------------------------------------------------------------


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
    read_chunks_here(path, targets)
    return {name[len(head):]: chunk.tensor for name, chunk in targets.items()}


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON bookkeeping of a checkpoint (step, data position, plan's model/train/layout, ...)."""
    return read_json(resolve_checkpoint(path) / STATE_FILE, "checkpoint state")
