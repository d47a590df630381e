"""Background checkpoint saves (sp_plan.runtime.async_checkpoint through Trainer(async_save=True)) on gloo CPU ranks.

The write of the step-2 checkpoint is held back (its commit waits 1.5 s) so that training runs steps 3
and 4, changing every parameter and optimizer state, while it is in flight: the step-2 checkpoint must
still hold step 2's state (tensor for tensor equal to a synchronous run's), training must not have waited
for it, and the run's losses must equal the synchronous run's. An error in the background write reaches
the training thread as one RuntimeConfigError, and the failed save is never the latest checkpoint.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_checkpoint import SAVE_AT, STEPS, _all_tensors, configure, trainer_for

HOLD_S = 1.5


def _delayed_commits(log: list):
    """Wrap the background commit: wait HOLD_S, then write; log when each write started and ended."""
    import sp_plan.runtime.async_checkpoint as ac

    real = ac.commit_save

    def commit(job, group=None):
        time.sleep(HOLD_S)
        started = time.perf_counter()
        path = real(job, group)
        log.append({"step": job.step, "write_started": started, "write_ended": time.perf_counter()})
        return path

    ac.commit_save = commit


def _runs(rank: int, world: int, root: str) -> dict:
    out = {}
    for mode in ("sync", "async"):
        torch.manual_seed(0)
        setup = configure({"ulysses": 2}, {"zero_stage": 3, "checkpointing": "selective"})
        log: list = []
        step_ends: dict[int, float] = {}
        if mode == "async":
            _delayed_commits(log)
        trainer = trainer_for(setup, checkpoint_dir=os.path.join(root, mode), save_every=SAVE_AT,
                              async_save=mode == "async",
                              on_step=lambda t, r: step_ends.__setitem__(r.step, time.perf_counter()))
        fit = trainer.fit()
        out[mode] = {"losses": fit.losses, "checkpoint": str(fit.checkpoint), "log": log, "step_ends": step_ends}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return root, run_ranks(2, _runs, str(root), timeout=240)


@pytest.mark.multiproc
def test_a_background_save_holds_the_state_of_its_step(runs):
    root, out = runs
    for step in (SAVE_AT, STEPS):
        name = f"step_{step:08d}"
        sync, background = _all_tensors(root / "sync" / name), _all_tensors(root / "async" / name)
        assert sync.keys() == background.keys() and len(sync) > 10
        for key, value in sync.items():
            assert torch.equal(value, background[key]), (step, key)
        states = [json.loads((root / mode / name / "trainer_state.json").read_text()) for mode in ("sync", "async")]
        assert states[0] == states[1]
    # the step-2 and step-4 states differ: equality above is not vacuous
    first, last = _all_tensors(root / "sync" / f"step_{SAVE_AT:08d}"), _all_tensors(root / "sync" / f"step_{STEPS:08d}")
    assert any(not torch.equal(v, last[k]) for k, v in first.items() if k.startswith("model::"))


@pytest.mark.multiproc
def test_training_goes_on_while_the_save_is_written(runs):
    _, out = runs
    for rank_out in out:
        assert rank_out["async"]["losses"] == rank_out["sync"]["losses"]
        writes = {w["step"]: w for w in rank_out["async"]["log"]}
        assert sorted(writes) == [SAVE_AT, STEPS]
        step_ends = rank_out["async"]["step_ends"]
        # step 3 (and 4) finished before the step-2 checkpoint's write began, let alone ended
        assert step_ends[SAVE_AT + 1] < writes[SAVE_AT]["write_started"]
        assert step_ends[STEPS] < writes[SAVE_AT]["write_ended"]
        assert rank_out["async"]["checkpoint"].endswith(f"step_{STEPS:08d}")


def _failing_write(rank: int, world: int, root: str) -> dict:
    import sp_plan.runtime.async_checkpoint as ac
    from sp_plan.runtime.checkpoint import latest_checkpoint
    from sp_plan.runtime.errors import RuntimeConfigError

    def broken(job, group=None):
        raise OSError(28, "No space left on device")

    ac.commit_save = broken
    setup = configure({"ulysses": 2}, {"zero_stage": 2})
    trainer = trainer_for(setup, checkpoint_dir=root, save_every=SAVE_AT, async_save=True)
    try:
        trainer.fit()
        error = None
    except RuntimeConfigError as exc:
        error = str(exc)
    return {"error": error, "step": trainer.step, "latest": latest_checkpoint(root)}


@pytest.mark.multiproc
def test_an_error_in_the_background_write_reaches_training(tmp_path):
    out = run_ranks(2, _failing_write, str(tmp_path / "ckpt"), timeout=180)
    for rank_out in out:
        assert rank_out["error"] is not None and "No space left on device" in rank_out["error"]
        assert rank_out["step"] == STEPS  # raised by the final save's wait, after the last step
        assert rank_out["latest"] is None


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_staging_copies_into_reused_host_buffers(device):
    """Staged chunks are host copies (pinned for device tensors) that later writes to the originals do not
    reach; the buffers are reused by the next save when shapes match and replaced when they do not."""
    from sp_plan.runtime.async_checkpoint import AsyncCheckpointer
    from sp_plan.runtime.checkpoint import Chunk

    saver = AsyncCheckpointer()
    weight = torch.arange(12.0, device=device).reshape(3, 4)
    entries = {"model::w": Chunk(weight, (0, 0), (6, 4)), "optim::w::step": Chunk(torch.tensor(3.0, device=device), (), ())}
    staged = saver._stage(entries)
    assert all(c.tensor.device.type == "cpu" for c in staged.values())
    assert staged["model::w"].tensor.is_pinned() == (device == "cuda")
    assert staged["model::w"].offsets == (0, 0) and staged["model::w"].shape == (6, 4)
    weight.add_(100.0)
    assert torch.equal(staged["model::w"].tensor, torch.arange(12.0).reshape(3, 4))
    again = saver._stage(entries)
    assert again["model::w"].tensor.data_ptr() == staged["model::w"].tensor.data_ptr()
    assert torch.equal(again["model::w"].tensor, weight.cpu())
    grown = saver._stage({"model::w": Chunk(torch.zeros(4, 4, device=device), (0, 0), (8, 4))})
    assert grown["model::w"].tensor.shape == (4, 4) and set(saver._buffers) == {"model::w"}
