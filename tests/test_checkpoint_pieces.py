"""Checkpoints as named stateful pieces (sp_plan.runtime.checkpoint.manager), on gloo CPU ranks.

A new kind of state is one :class:`Piece` class and one registration. The toy piece here keeps an
exponential moving average of the loss (JSON in ``trainer_state.json``) and of a vector (a tensor, the
same on every rank, written once by DCP):

- registered with the Trainer (``checkpoint_pieces``) on dp_shard 2, it is saved at step 2, restored by a
  resume in fresh processes, and the resumed run ends with the uninterrupted run's toy state, bit for bit
  (so the step-2 state came back exactly), beside the same losses;
- one rank, the functions directly: it round-trips through ``save_checkpoint``/``load_checkpoint``; a
  checkpoint without it, or without its tensor, is one error naming it; a flipped byte in its tensor
  chunk or an edited JSON entry fails verification naming the chunk or the file; a checkpoint with it
  still loads without it; names and keys are unique across pieces;
- the model piece takes the model's parts (``setup.model_parts``, as pipeline stages will be): two parts
  save the whole model's tensors under its names and load back into fresh parts; a name in two parts is
  refused.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_checkpoint import configure, trainer_for

LAYOUT = ({"dp_shard": 2}, {"zero_stage": 3})
STEPS, SAVE_AT = 4, 2


def _toy_class():
    """The toy piece (defined in the ranks, which import the runtime; the test module itself need not)."""
    from sp_plan.runtime.checkpoint import Chunk, Piece, key
    from sp_plan.runtime.errors import RuntimeConfigError

    class ToyEma(Piece):
        """An exponential moving average of the loss (JSON) and of a vector (a tensor, the same on every rank)."""

        name = "toy_ema"

        def __init__(self, size: int = 6, with_tensor: bool = True) -> None:
            self.updates, self.loss = 0, 0.0
            self.values = torch.zeros(size)
            self.with_tensor = with_tensor

        def update(self, loss: float) -> None:
            self.updates += 1
            self.loss = 0.9 * self.loss + 0.1 * loss
            self.values.mul_(0.9).add_(torch.arange(float(self.values.numel())) * (0.1 * loss))

        def _chunks(self) -> dict:
            if not self.with_tensor:
                return {}
            return {key(self.name, "values"): Chunk(self.values, (0,), tuple(self.values.shape))}

        def save_chunks(self) -> dict:
            return self._chunks()

        def save_json(self) -> dict:
            return {self.name: {"updates": self.updates, "loss": self.loss}}

        def load_json(self, loading) -> None:
            saved = loading.state.get(self.name)
            if saved is None:
                raise RuntimeConfigError(f"checkpoint {loading.path} has no {self.name} state")
            self.updates, self.loss = saved["updates"], saved["loss"]

        def load_targets(self, loading) -> dict:
            return self._chunks()

    return ToyEma


# ----- through the Trainer, two ranks ------------------------------------------------------------------------


def _train_with_toy(rank: int, world: int, root: str, resume: str | bool) -> dict:
    toy = _toy_class()()
    trainer = trainer_for(configure(*LAYOUT), steps=STEPS, checkpoint_dir=root, save_every=SAVE_AT, resume=resume,
                          checkpoint_pieces=[toy], on_step=lambda t, record: toy.update(record.loss))
    fit = trainer.fit()
    return {"losses": fit.losses, "start": fit.start_step, "updates": toy.updates, "loss": toy.loss,
            "values": toy.values.tolist()}


@pytest.mark.multiproc
def test_a_registered_piece_is_saved_and_resumed_by_the_trainer(tmp_path):
    full = run_ranks(2, _train_with_toy, str(tmp_path / "full"), False, timeout=180)
    resume = str(tmp_path / "full" / f"step_{SAVE_AT:08d}")
    resumed = run_ranks(2, _train_with_toy, str(tmp_path / "resumed"), resume, timeout=180)
    saved = json.loads((tmp_path / "full" / f"step_{SAVE_AT:08d}" / "trainer_state.json").read_text())
    assert saved["toy_ema"]["updates"] == SAVE_AT  # the piece's JSON, under its name
    for f, r in zip(full, resumed):
        assert f["start"] == 0 and r["start"] == SAVE_AT
        assert r["losses"] == f["losses"][SAVE_AT:]  # the training pieces still resume bit-exactly
        assert f["updates"] == STEPS and r["updates"] == STEPS  # 2 restored + 2 run after the resume
        assert r["loss"] == f["loss"] and r["values"] == f["values"], (f, r)  # float32 -> float: exact
        assert any(v != 0 for v in f["values"])  # not vacuous


# ----- the functions directly, one rank ----------------------------------------------------------------------


def _flip_chunk(step_dir, key: str) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for file, entry in manifest["files"].items():
        for chunk in entry.get("chunks", []):
            if chunk["key"] == key:
                with open(step_dir / file, "r+b") as f:
                    f.seek(chunk["at"] + chunk["bytes"] // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
                return
    raise AssertionError(f"no chunk {key} in the manifest")


def _error(fn) -> str:
    from sp_plan.runtime.errors import RuntimeConfigError

    try:
        fn()
    except RuntimeConfigError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _one_rank_pieces(rank: int, world: int, root: str) -> dict:
    import shutil
    from pathlib import Path

    from sp_plan.runtime.checkpoint import (
        CheckpointManager, Piece, StatefulPiece, load_checkpoint, load_full_state_dict, save_checkpoint,
    )

    ToyEma = _toy_class()
    root = Path(root)
    out: dict = {}
    setup = configure({}, {"zero_stage": 3})
    optimizer = setup.make_optimizer(lr=1e-2)
    toy = ToyEma()
    for loss in (3.0, 2.5, 2.0):
        toy.update(loss)
    with_toy = save_checkpoint(root, step=1, setup=setup, optimizer=optimizer, pieces=[toy])
    without = save_checkpoint(root, step=2, setup=setup, optimizer=optimizer)
    json_only = save_checkpoint(root, step=3, setup=setup, optimizer=optimizer, pieces=[ToyEma(with_tensor=False)])

    fresh = ToyEma()
    load_checkpoint(with_toy, setup=setup, optimizer=optimizer, pieces=[fresh])
    out["round_trip"] = (fresh.updates == toy.updates == 3 and fresh.loss == toy.loss
                         and torch.equal(fresh.values, toy.values) and bool(toy.values.abs().sum() > 0))
    out["ignored"] = _error(lambda: load_checkpoint(with_toy, setup=setup, optimizer=optimizer))
    out["missing"] = _error(lambda: load_checkpoint(without, setup=setup, optimizer=optimizer, pieces=[ToyEma()]))
    out["missing_tensor"] = _error(lambda: load_checkpoint(json_only, setup=setup, optimizer=optimizer,
                                                           pieces=[ToyEma()]))
    flipped = root / "flipped" / with_toy.name
    shutil.copytree(with_toy, flipped)
    _flip_chunk(flipped, "toy_ema::values")
    out["flipped"] = _error(lambda: load_checkpoint(flipped, setup=setup, pieces=[ToyEma()]))
    edited = root / "edited" / with_toy.name
    shutil.copytree(with_toy, edited)
    state = json.loads((edited / "trainer_state.json").read_text())
    state["toy_ema"]["updates"] = 9  # one digit for another: the same size, another digest
    (edited / "trainer_state.json").write_text(json.dumps(state, indent=1))
    out["edited"] = _error(lambda: load_checkpoint(edited, setup=setup, pieces=[ToyEma()]))

    class Impostor(Piece):  # claims an entry the manager writes itself
        name = "impostor"

        def save_json(self) -> dict:
            return {"step": 7}

    out["duplicate_name"] = _error(lambda: CheckpointManager([ToyEma(), ToyEma()]))
    out["no_name"] = _error(lambda: CheckpointManager([Piece()]))
    out["same_entry"] = _error(lambda: save_checkpoint(root, step=5, setup=setup, pieces=[Impostor()]))
    layout = SimpleNamespace(state_dict=lambda: {"tp": 1}, load_state_dict=lambda state: None)
    out["same_as_layout"] = _error(lambda: save_checkpoint(root, step=6, setup=setup,
                                                           pieces=[StatefulPiece("layout", layout)]))

    # the model as two parts (pipeline stages): every tensor under the whole model's names, and back
    model = setup.model
    names = [n for n, child in model.named_children() if child.state_dict()]  # the rotary table holds none
    parts = [torch.nn.ModuleDict({n: getattr(model, n) for n in names[:1]}),
             torch.nn.ModuleDict({n: getattr(model, n) for n in names[1:]})]
    staged = SimpleNamespace(plan=setup.plan, model=None, model_parts=parts)
    whole = {n: t.clone() for n, t in setup.full_state_dict().items()}
    two_parts = load_full_state_dict(save_checkpoint(root / "parts", step=1, setup=staged))
    one_part = load_full_state_dict(save_checkpoint(root / "whole", step=1, setup=setup))
    out["parts_keys"] = sorted(two_parts) == sorted(one_part) and set(whole) <= set(two_parts) and len(whole) > 5
    out["parts_equal"] = all(torch.equal(two_parts[n], one_part[n]) for n in one_part)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_checkpoint(root / "parts", setup=staged)
    out["parts_loaded"] = all(torch.equal(t, whole[n]) for n, t in setup.full_state_dict().items())
    overlapping = SimpleNamespace(plan=setup.plan, model=None, model_parts=[parts[0], parts[0]])
    out["parts_overlap"] = _error(lambda: save_checkpoint(root / "overlap", step=1, setup=overlapping))
    out["names"] = names
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_ranks(1, _one_rank_pieces, str(tmp_path_factory.mktemp("pieces") / "ckpt"), timeout=180)[0]


@pytest.mark.multiproc
def test_a_piece_round_trips_and_a_checkpoint_without_it_still_loads(one_rank):
    assert one_rank["round_trip"]
    assert one_rank["ignored"] == "no error"


@pytest.mark.multiproc
def test_a_missing_piece_is_one_error_naming_it(one_rank):
    assert one_rank["missing"].startswith("RuntimeConfigError: ") and "has no toy_ema state" in one_rank["missing"]
    assert "has no toy_ema entry 'values'" in one_rank["missing_tensor"], one_rank["missing_tensor"]


@pytest.mark.multiproc
def test_a_damaged_piece_fails_verification_like_the_others(one_rank):
    flipped, edited = one_rank["flipped"], one_rank["edited"]
    assert flipped.startswith("CheckpointCorruptError: ") and "tensor toy_ema::values chunk at offsets (0,)" in flipped
    assert "expected sha256" in flipped and "found" in flipped
    assert edited.startswith("CheckpointCorruptError: ") and "trainer_state.json: expected sha256" in edited


@pytest.mark.multiproc
def test_names_and_keys_are_unique_across_pieces(one_rank):
    assert "a checkpoint piece named 'toy_ema' is registered already" in one_rank["duplicate_name"]
    assert "needs a name (Piece has none)" in one_rank["no_name"]
    assert "pieces 'checkpoint' and 'impostor' both save the trainer_state.json entry 'step'" in one_rank["same_entry"]
    assert "pieces 'model' and 'layout' both save the trainer_state.json entry 'layout'" in one_rank["same_as_layout"]


@pytest.mark.multiproc
def test_the_model_piece_takes_the_model_parts(one_rank):
    assert len(one_rank["names"]) > 1, one_rank["names"]
    assert one_rank["parts_keys"] and one_rank["parts_equal"]
    assert one_rank["parts_loaded"]
    assert "state entry" in one_rank["parts_overlap"] and "an earlier part has too" in one_rank["parts_overlap"]
