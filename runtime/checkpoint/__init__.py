"""Checkpoint and resume with ``torch.distributed.checkpoint`` (DCP), in a layout-independent form.

A checkpoint holds everything a run needs to continue, as **named pieces** (:mod:`.piece`): the model
parts, the optimizer (plain, over FSDP2's sharded parameters, or
:class:`sp_plan.runtime.host_optimizer.HostOffloadOptimizer` with its fp32 host masters), the LR scheduler,
the data position (:class:`sp_plan.runtime.text_data.GlobalBatches`: sequences consumed, a global count),
the training loop's bookkeeping, every rank's RNG states (torch CPU/CUDA, Python, NumPy), and the step.
A new kind of state is one :class:`Piece` subclass and one registration.

**Layout independence.** Every tensor is stored as the *unparallelised* model's tensor, keyed by its
parameter name: ``model::<fqn>``, ``optim::<fqn>::<state>`` (AdamW's ``exp_avg``, ``exp_avg_sq``,
``step``) and ``master::<fqn>`` (fp32 host masters). Each rank writes only the chunk it holds, at its
offsets in the full tensor (:mod:`.geometry`: FSDP2 shards composed with the runtime's tensor-parallel
slices). Loading on any other layout (another SP/TP/dp split, another world size) asks DCP for this
rank's chunks; DCP reads the overlapping parts of the saved chunks (its resharding, :mod:`.dcp_io`). The
data position is a global count of sequences, so another data-parallel size resumes at the same place.
RNG states are per rank: restored exactly on the same world size, else every rank takes rank 0's
(resume on another layout is exact up to float rounding, not bit-exact).

**Files** (:mod:`.files`). ``<dir>/step_00000120/``: DCP's ``.metadata`` and ``__<rank>_0.distcp`` files,
``trainer_state.json`` (step, data position, scheduler, optimizer hyperparameters, the plan),
``rng/rank_<r>.json`` and, written last, ``manifest.json``.

**Verification** (:mod:`.manifest`). The manifest holds a SHA-256 digest of every tensor chunk and of
every other file, with the files' sizes; a step directory without a complete manifest is incomplete.
:func:`verify_checkpoint` re-hashes everything, the files spread over the ranks, and gives every rank the
same list of problems (which file, which key and chunk, expected vs found digest); :func:`load_checkpoint`
runs it before any tensor is used.

**Atomicity** (:mod:`.store`). Every rank writes into ``<dir>/.step_00000120.tmp-<id>``; after DCP's save
every rank hashes its files, rank 0 writes the bookkeeping and the manifest (fsynced) and renames the
directory to ``step_00000120`` (atomic on POSIX), and every rank re-reads and verifies the published
checkpoint before anything older is pruned. A save interrupted at any point is never picked up.

**Untrusted files.** JSON files are size-bounded and parsed with :mod:`json`; DCP's ``.metadata`` is a
pickle, read with an unpickler restricted to DCP's metadata classes; tensors are read by DCP with
``torch.load(weights_only=True)``. No byte (pickled) items are written or read.

Modules, each importing only those above it: :mod:`.files` (names, JSON), :mod:`.comm` (collectives),
:mod:`.geometry`, :mod:`.dcp_io`, :mod:`.manifest`, :mod:`.store`, :mod:`.piece` (the protocol),
:mod:`.model_piece`, :mod:`.optimizer_piece`, :mod:`.state` (JSON and RNG pieces), :mod:`.manager`.
"""

from sp_plan.runtime.checkpoint.dcp_io import read_metadata
from sp_plan.runtime.checkpoint.files import (
    FORMAT_VERSION, JSON_MAX_BYTES, MANIFEST, RNG_DIR, SEP, STATE_FILE, STEP_PREFIX, TMP_INFIX, key, step_dir_name,
    step_of,
)
from sp_plan.runtime.checkpoint.geometry import Chunk, Geometry, clean_fqn, model_parts, parameter_geometry
from sp_plan.runtime.checkpoint.manager import (
    CheckpointManager, CheckpointState, SaveJob, check_state_step, commit_save, load_checkpoint,
    load_full_state_dict, prepare_save, read_state, save_checkpoint, training_pieces,
)
from sp_plan.runtime.checkpoint.manifest import (
    DIGEST, MAX_PROBLEMS_SHOWN, READ_BLOCK, CheckpointCorruptError, checkpoint_bytes, is_complete, read_manifest,
    read_verified_state, require_verified, verify_checkpoint,
)
from sp_plan.runtime.checkpoint.model_piece import (
    ARCHITECTURE_FIELDS, MASTER, MODEL, OPTIM, ModelPiece, check_same_model,
)
from sp_plan.runtime.checkpoint.optimizer_piece import OptimizerPiece
from sp_plan.runtime.checkpoint.piece import Loading, Piece
from sp_plan.runtime.checkpoint.state import (
    DataPiece, RngPiece, SchedulerPiece, StatefulPiece, TrainStatePiece, rng_state, set_rng_state,
)
from sp_plan.runtime.checkpoint.store import (
    check_checkpoint_dir, find_resumable, latest_checkpoint, list_checkpoints, resolve_checkpoint,
)

__all__ = [
    "ARCHITECTURE_FIELDS", "CheckpointCorruptError", "CheckpointManager", "CheckpointState", "Chunk", "DIGEST",
    "DataPiece", "FORMAT_VERSION", "Geometry", "JSON_MAX_BYTES", "Loading", "MANIFEST", "MASTER",
    "MAX_PROBLEMS_SHOWN", "MODEL", "ModelPiece", "OPTIM", "OptimizerPiece", "Piece", "READ_BLOCK", "RNG_DIR",
    "RngPiece", "SEP", "STATE_FILE", "STEP_PREFIX", "SaveJob", "SchedulerPiece", "StatefulPiece", "TMP_INFIX",
    "TrainStatePiece", "check_checkpoint_dir", "check_same_model", "check_state_step", "checkpoint_bytes",
    "clean_fqn", "commit_save", "find_resumable", "is_complete", "key", "latest_checkpoint", "list_checkpoints",
    "load_checkpoint", "load_full_state_dict", "model_parts", "parameter_geometry", "prepare_save",
    "read_manifest", "read_metadata", "read_state", "read_verified_state", "require_verified",
    "resolve_checkpoint", "rng_state", "save_checkpoint", "set_rng_state", "step_dir_name", "step_of",
    "training_pieces", "verify_checkpoint",
]
