"""The JSON pieces of a checkpoint: any ``state_dict()`` object (data position, LR scheduler), the training
loop's bookkeeping, and every rank's RNG states.

RNG states are per rank (``rng/rank_<r>.json``): restored exactly on the same world size, else every rank
takes rank 0's (resume on another layout is exact up to float rounding, not bit-exact). They are stored
as JSON (base64 for torch's byte states), never pickled.
"""

from __future__ import annotations

import base64
import random
import sys
from collections.abc import Mapping
from typing import Any

import torch

from sp_plan.runtime.checkpoint.files import read_json, rng_file
from sp_plan.runtime.checkpoint.piece import Loading, Piece
from sp_plan.runtime.errors import RuntimeConfigError


class StatefulPiece(Piece):
    """An object with ``state_dict()`` / ``load_state_dict()`` of plain JSON, saved under ``name`` in
    ``trainer_state.json``. ``obj`` None: saved as null and not loaded. Loading a checkpoint that holds no
    state for it is an error naming ``what`` (default: "<name> state")."""

    def __init__(self, name: str, obj: Any, what: str | None = None) -> None:
        self.name, self.obj, self.what = name, obj, what or f"{name} state"

    def save_json(self) -> dict[str, Any]:
        return {self.name: self.obj.state_dict() if self.obj is not None else None}

    def load_json(self, loading: Loading) -> None:
        if self.obj is None:
            return
        saved = loading.state.get(self.name)
        if saved is None:
            raise RuntimeConfigError(f"checkpoint {loading.path} has no {self.what}")
        self.obj.load_state_dict(saved)


class DataPiece(StatefulPiece):
    """The data position (e.g. :class:`sp_plan.runtime.text_data.GlobalBatches`: sequences consumed, a
    global count, so another data-parallel size resumes at the same place). Its ``load_state_dict`` refuses
    other data, before any tensor is touched."""

    def __init__(self, data: Any) -> None:
        super().__init__("data", data, "data position")


class SchedulerPiece(StatefulPiece):
    """The LR scheduler's state and its class (compared by the Trainer at resume)."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__("scheduler", scheduler, "LR scheduler state")

    def save_json(self) -> dict[str, Any]:
        return {**super().save_json(),
                "scheduler_class": type(self.obj).__name__ if self.obj is not None else None}


class TrainStatePiece(Piece):
    """The training loop's bookkeeping: tokens seen and ``extra`` (JSON-able, e.g. the Trainer's
    ``run_config``). The step is the checkpoint's own (its directory name); loading returns all of it in
    :class:`~sp_plan.runtime.checkpoint.manager.CheckpointState`."""

    name = "train_state"

    def __init__(self, tokens_seen: int = 0, extra: Mapping[str, Any] | None = None) -> None:
        self.tokens_seen, self.extra = int(tokens_seen), dict(extra or {})

    def save_json(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen, "extra": self.extra}

    def load_json(self, loading: Loading) -> None:
        self.tokens_seen = int(loading.state.get("tokens_seen", 0))
        self.extra = loading.state.get("extra") or {}


# ----- RNG -----------------------------------------------------------------------------------------------------


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


class RngPiece(Piece):
    """Every rank's RNG states, each rank in its own file, captured at the step being saved and restored
    once every tensor is loaded (the same rank's on the same world size, else rank 0's)."""

    name = "rng"

    def save_rank_files(self, rank: int) -> dict[str, Any]:
        return {rng_file(rank): rng_state()}

    def load_finish(self, loading: Loading) -> None:
        saved_rank = loading.rank if loading.same_world else 0
        set_rng_state(read_json(loading.path / rng_file(saved_rank), "RNG state"))
