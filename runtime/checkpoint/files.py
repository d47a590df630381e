"""The names inside a checkpoint root and a step directory, and the small JSON files a checkpoint holds.

Everything that decides what a checkpoint looks like on disk is named here, once: changing any of it is a
new :data:`FORMAT_VERSION` (checkpoints written before must keep loading).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sp_plan.cost_models.atomic_io import atomic_write_text
from sp_plan.cost_models.json_io import json_loads
from sp_plan.runtime.errors import RuntimeConfigError

#: Version of the layout of a checkpoint directory (bumped on incompatible changes; 2: the manifest).
FORMAT_VERSION = 2
#: Written last: the list of files with their sizes and SHA-256 digests (whole files and tensor chunks).
MANIFEST = "manifest.json"
#: The JSON bookkeeping (step, data position, scheduler, optimizer hyperparameters, the plan), written by rank 0.
STATE_FILE = "trainer_state.json"
#: Per-rank RNG states: ``rng/rank_<r>.json``.
RNG_DIR = "rng"
STEP_PREFIX = "step_"
TMP_INFIX = ".tmp-"
#: JSON files of a checkpoint are small; anything larger is not one of ours and is not parsed.
JSON_MAX_BYTES = 64 << 20
#: Separates the parts of a tensor key: ``model::<fqn>``, ``optim::<fqn>::<state>``.
SEP = "::"


def key(*parts: str) -> str:
    """A tensor key from its parts (``key("optim", fqn, "exp_avg")``)."""
    return SEP.join(parts)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(path: str | os.PathLike) -> int | None:
    """The step in a ``step_NNNNNNNN`` directory's name (None for any other name)."""
    name = Path(path).name
    digits = name[len(STEP_PREFIX):]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def rng_file(rank: int) -> str:
    """Where rank ``rank``'s RNG states lie, relative to the step directory."""
    return f"{RNG_DIR}/rank_{rank}.json"


def read_json(path: Path, what: str) -> Any:
    """A checkpoint's JSON file, size-bounded (it is untrusted); one clear error when missing or malformed."""
    if not path.is_file():
        raise RuntimeConfigError(f"{what} {path} is missing: the checkpoint is incomplete or not one of ours")
    if path.stat().st_size > JSON_MAX_BYTES:
        raise RuntimeConfigError(f"{what} {path} is larger than {JSON_MAX_BYTES} bytes: not a checkpoint file")
    try:
        return json_loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RuntimeConfigError(f"{what} {path} is not valid JSON: {str(exc).splitlines()[0]}") from None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON, whole or not at all (temporary file, fsync, rename)."""
    try:
        text = json.dumps(data, indent=1, sort_keys=False)
    except TypeError as exc:
        raise RuntimeConfigError(f"cannot write {path.name}: {exc} (scheduler and data states must be plain JSON)") \
            from None
    atomic_write_text(path, text, error=RuntimeConfigError)
