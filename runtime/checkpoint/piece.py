"""The protocol of one named stateful piece of a checkpoint (model, optimizer, scheduler, data, RNG, ...).

A checkpoint is a set of named pieces, saved and restored by
:class:`sp_plan.runtime.checkpoint.manager.CheckpointManager` (torchtitan's checkpointer keys its Stateful
objects the same way: MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE). A piece may hold three
kinds of state, each optional:

- **tensors**, as :class:`~sp_plan.runtime.checkpoint.geometry.Chunk` s keyed ``<prefix>::...``: written with
  DCP, each rank its own chunks, hashed chunk by chunk into the manifest, and resharded on load;
- **JSON entries** of ``trainer_state.json`` (rank 0's, written once);
- **per-rank JSON files** (the RNG states: every rank has its own).

Saving and loading call the hooks in a fixed order, piece after piece in registration order, so a piece
can rely on the pieces registered before it (the optimizer reads the model's geometry):

save: :meth:`Piece.begin` (every piece, collective) -> :meth:`Piece.save_chunks` ->
:meth:`Piece.save_rank_files` -> :meth:`Piece.save_json` (rank 0), all at the step being saved.

load: :meth:`Piece.load_json` (refuse a mismatch and restore JSON state before any tensor is touched) ->
:meth:`Piece.begin` -> :meth:`Piece.load_targets` -> DCP reads every piece's tensors at once ->
:meth:`Piece.load_finish` (install what was read).

A new piece is one class and one registration (``CheckpointManager.register``, or ``pieces=`` of
:func:`~sp_plan.runtime.checkpoint.manager.save_checkpoint` and ``Trainer(checkpoint_pieces=...)``). A piece
that holds only a ``state_dict()``/``load_state_dict()`` object of plain JSON is
:class:`~sp_plan.runtime.checkpoint.state.StatefulPiece`. Its state, like every other piece's, is covered by
the manifest, so a damaged piece fails verification as the others do, and a piece that a checkpoint lacks
is one error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sp_plan.runtime.checkpoint.geometry import Chunk


@dataclass
class Loading:
    """What a piece sees while a checkpoint loads: the step directory, its ``trainer_state.json``, this rank
    and the world size, and (from :meth:`Piece.load_targets` on) DCP's metadata of the saved tensors."""

    path: Path
    state: dict[str, Any]
    rank: int
    world: int
    metadata: Any = None

    @property
    def saved_tensors(self) -> dict[str, Any]:
        """Every saved tensor key to its DCP metadata (full size, dtype)."""
        return self.metadata.state_dict_metadata

    @property
    def same_world(self) -> bool:
        return self.state.get("world_size") == self.world


class Piece:
    """One named stateful piece of a checkpoint; every hook does nothing unless overridden.

    ``name`` keys the piece in its manager (one piece per name)."""

    name: str = ""

    def begin(self) -> None:
        """Collective preparation every rank runs before this piece's tensors are gathered or targeted (the
        model's tensor-parallel geometry)."""

    def save_chunks(self) -> dict[str, Chunk]:
        """This rank's tensors, by checkpoint key (keys unique across pieces)."""
        return {}

    def save_rank_files(self, rank: int) -> dict[str, Any]:
        """This rank's own JSON files, by path relative to the step directory."""
        return {}

    def save_json(self) -> dict[str, Any]:
        """Entries of ``trainer_state.json`` (called on rank 0 only; keys unique across pieces)."""
        return {}

    def load_json(self, loading: Loading) -> None:
        """Check the saved JSON state against this run (raise :class:`RuntimeConfigError` naming what
        differs or is missing) and restore it; before any tensor is read."""

    def load_targets(self, loading: Loading) -> dict[str, Chunk]:
        """Where this rank's part of each saved tensor is read into, by checkpoint key (``Chunk.source``: read
        from another key)."""
        return {}

    def load_finish(self, loading: Loading) -> None:
        """Install what was read (after every piece's tensors are in their targets)."""
