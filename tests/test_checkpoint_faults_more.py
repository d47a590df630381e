"""More fault injection on checkpoints (issue 35 item 7): background saves, pipeline- and expert-parallel
checkpoints, and ranks killed at chosen moments of later saves. 2 gloo CPU ranks; the helpers, the tiny model
and the uninterrupted reference run (dp_shard 2, ZeRO-3, a save at every one of 4 steps) are
tests/test_checkpoint_faults.py's.

- ``--async-save``: a rank SIGKILLed while the background thread writes the step-3 save (steps 1 and 2
  saved): step 2 is the latest, nothing was pruned (keep 2), and the resumed run's losses equal the
  reference's bit for bit. The newest background save damaged after the run ends (bytes flipped in a tensor
  file): resume says so, falls back to step 3 and continues exactly. The background saves' run itself has the
  synchronous reference's losses.
- pp=2 (2 ranks, 1F1B) and ep=2 (a tiny transformers Qwen3-MoE, its 4 experts split over dp_shard 2): each
  has its own uninterrupted reference run. A flipped byte in the newest checkpoint is skipped with its reason
  and resume continues from the previous one exactly; a save that does not verify with keep_checkpoints=1
  leaves every older checkpoint in place; a rank killed while writing the step-3 save leaves step 2 the
  latest and the resumed run continues exactly.
- Kills at moments of later saves chosen with a fixed seed among DCP's write, after the hashing, before and
  after the rename in ``store.publish`` and in the middle of pruning (keep 1), at steps 2-4, in synchronous
  or background saves: the newest checkpoint that is left verifies (the interrupted one when it was already
  published, else the one before), resume gives the reference losses from there, and once the resumed run
  has saved, its checkpoint is all that is left (leftovers of the interrupted save removed).
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.test_checkpoint_faults import (
    LAYOUT,
    STEPS,
    _copy,
    _messages,
    _resume_scenarios,
    _same_on_both_ranks,
    _step,
    flip_bytes,
    reference,  # noqa: F401 - the module's uninterrupted run (dp_shard 2, saves at steps 1-4), as a fixture
)

pytestmark = pytest.mark.multiproc

PP_LAYOUT = ({"pp": 2}, {"zero_stage": 3})
EP_LAYOUT = ({"dp_shard": 2, "ep": 2}, {"zero_stage": 3, "checkpointing": "none"})


def _steps(root: Path) -> list[str]:
    """The directory listing of a checkpoint root (hidden leftovers included)."""
    return sorted(p.name for p in root.iterdir())


def _names(*steps: int) -> list[str]:
    return [f"step_{s:08d}" for s in steps]


# ----- runs on the ranks -------------------------------------------------------------------------------------


def _moe_configure(layout: dict, options: dict, *args, **kwargs):
    """A tiny fp32 Qwen3-MoE (tests/moe_checks.py: 2 layers, 4 experts, top 2) on the checkpoint tests' data
    (sequences of 64 tokens below 97 < its vocabulary of 128), 2 sequences per step."""
    from sp_plan.runtime.auto import auto_configure

    from tests.moe_checks import moe_model
    from tests.test_checkpoint import SEQ

    return auto_configure(moe_model("qwen3_moe", attn="eager"), seq_len=SEQ, micro_batch=1, global_batch=2,
                          dtype="fp32", topology="dgx-h100", fixed_layout=layout, fixed_options=options)


def _use_moe_for_ep() -> None:
    """Make tests/test_checkpoint_faults.py's runs (its ``configure``) build the MoE model for an ep layout."""
    import tests.test_checkpoint_faults as faults

    plain = faults.configure
    if getattr(plain, "moe_aware", False):
        return

    def configure(layout: dict, options: dict, *args, **kwargs):
        if layout.get("ep", 1) > 1:
            return _moe_configure(layout, options, *args, **kwargs)
        return plain(layout, options, *args, **kwargs)

    configure.moe_aware = True
    faults.configure = configure


def _scenarios(rank: int, world: int, scenarios: list[dict]) -> dict:
    """tests/test_checkpoint_faults.py's ``_resume_scenarios``, ep layouts on the MoE model."""
    _use_moe_for_ep()
    return _resume_scenarios(rank, world, scenarios)


def _train(rank: int, world: int, root: str, layout: tuple, async_save: bool = False, keep: int | None = None,
           steps: int = STEPS) -> tuple[list[float], str, str]:
    """An uninterrupted run saving at every step: its losses, layout and model class."""
    import tests.test_checkpoint_faults as faults
    from tests.test_checkpoint import trainer_for

    _use_moe_for_ep()
    setup = faults.configure(*layout)
    trainer = trainer_for(setup, steps=steps, checkpoint_dir=root, save_every=1, async_save=async_save,
                          keep_checkpoints=keep)
    return trainer.fit().losses, setup.plan.layout.describe(), type(setup.model).__name__


#: Where a save may be interrupted, in the order a save goes through them; the rank that dies (rank 0 alone
#: publishes and prunes).
STAGES = {"write_data": 1, "after hashing": 1, "before rename": 0, "after rename": 0, "pruning": 0}
#: Stages after which the interrupted checkpoint is complete (published): resume starts from it.
PUBLISHED = {"after rename", "pruning"}


def _killed_at(rank: int, world: int, root: str, layout: tuple, stage: str, step: int, async_save: bool,
               keep: int | None) -> None:
    """A run saving at every step whose rank ``STAGES[stage]`` SIGKILLs itself at ``stage`` of the save of
    ``step`` (in the background thread with ``async_save``)."""
    import torch.distributed.checkpoint as dcp
    from sp_plan.runtime.checkpoint import manager

    import tests.test_checkpoint_faults as faults
    from tests.test_checkpoint import trainer_for

    _use_moe_for_ep()
    target = f"step_{step:08d}"
    dying = rank == STAGES[stage]

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "write_data":
        real_write = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            if dying and f".{target}.tmp-" in str(self.path):
                (Path(self.path) / f"__{rank}_0.distcp").write_bytes(b"\0" * 4096)  # a partial file
                die()
            return real_write(self, plan, planner)

        dcp.FileSystemWriter.write_data = write_then_die
    elif stage == "after hashing":
        real_hash = manager.hash_tensor_files

        def hash_then_die(tmp, *args, **kwargs):
            digests = real_hash(tmp, *args, **kwargs)
            if dying and f".{target}.tmp-" in str(tmp):
                die()
            return digests

        manager.hash_tensor_files = hash_then_die
    elif stage in ("before rename", "after rename"):
        real_publish = manager.publish

        def publish_and_die(tmp, final):
            if dying and final.name == target and stage == "before rename":
                die()
            previous = real_publish(tmp, final)
            if dying and final.name == target:
                die()
            return previous

        manager.publish = publish_and_die
    else:  # pruning: the first directory pruning removes is left half removed (its manifest first)
        real_prune, real_rmtree = manager.prune, shutil.rmtree
        pruning = []

        def prune_watched(directory, saved_step, keep_):
            pruning.append(saved_step == step)
            try:
                return real_prune(directory, saved_step, keep_)
            finally:
                pruning.pop()

        def rmtree_then_die(path, *args, **kwargs):
            path = Path(path)
            if dying and pruning and pruning[-1] and path.is_dir():
                (path / "manifest.json").unlink(missing_ok=True)
                next(iter(sorted(path.glob("*.distcp"))), path / "none").unlink(missing_ok=True)
                die()
            return real_rmtree(path, *args, **kwargs)

        manager.prune = prune_watched
        shutil.rmtree = rmtree_then_die
    trainer = trainer_for(faults.configure(*layout), steps=STEPS, checkpoint_dir=root, save_every=1,
                          async_save=async_save, keep_checkpoints=keep)
    trainer.fit()


def _kill(root: Path, layout: tuple, stage: str, step: int, async_save: bool = False, keep: int | None = None,
          timeout: float = 120) -> None:
    # the harness notices the dead rank itself, or through the other rank's broken connection
    with pytest.raises((RuntimeError, AssertionError), match="died without reporting|rank [01] failed"):
        run_ranks(2, _killed_at, str(root), layout, stage, step, async_save, keep, timeout=timeout)


# ----- --async-save ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def async_runs(reference, tmp_path_factory) -> dict:  # noqa: F811
    """An uninterrupted run with background saves, then its newest save damaged; a run killed in the
    background write of its step-3 save; both resumed (with background saves) by one pair of ranks."""
    work = tmp_path_factory.mktemp("async")
    full, killed = work / "full", work / "killed"
    losses = [out[0] for out in run_ranks(2, _train, str(full), LAYOUT, True, timeout=120)]
    kept = _steps(full)
    damaged = _copy(full, work, "damaged")
    flipped = flip_bytes(_step(damaged, STEPS))
    _kill(killed, LAYOUT, "write_data", 3, async_save=True, keep=2)
    after_kill = _steps(killed)
    scenarios = [{"name": "damaged", "dir": str(damaged), "async_save": True},
                 {"name": "killed", "dir": str(killed), "async_save": True, "save_every": 1, "keep": 2}]
    per_rank = run_ranks(2, _scenarios, scenarios, timeout=120)
    return {"losses": losses, "kept": kept, "damaged": damaged, "flipped": flipped, "killed": killed,
            "after kill": after_kill, "per_rank": per_rank}


def test_async_saves_train_like_synchronous_ones(async_runs, reference):  # noqa: F811
    _, losses = reference
    assert async_runs["losses"][0] == async_runs["losses"][1] == losses
    assert async_runs["kept"] == _names(1, 2, 3, 4)


def test_a_damaged_newest_async_save_is_skipped_and_resume_falls_back(async_runs, reference):  # noqa: F811
    _, losses = reference
    damaged = async_runs["damaged"]
    out = _same_on_both_ranks(async_runs["per_rank"], "damaged")
    assert "error" not in out, out
    assert out["start"] == STEPS - 1 and out["resumed_from"] == str(_step(damaged, STEPS - 1))
    assert out["losses"] == losses[STEPS - 1:]
    text = _messages(out)
    assert f"skipping {_step(damaged, STEPS)}: " in text and f"tensor {async_runs['flipped']} chunk" in text, text
    assert f"falling back to {_step(damaged, STEPS - 1)}" in text, text
    # the resumed run's step 4 replaced the damaged one (and it verified: nothing else pruned, keep=None)
    assert _steps(damaged) == _names(1, 2, 3, 4)
    assert f"replaced {_step(damaged, STEPS)}, saved by another run" in text, text


def test_a_rank_killed_in_a_later_background_write_leaves_the_previous_save_latest(async_runs, reference):  # noqa: F811
    from sp_plan.runtime.checkpoint import latest_checkpoint

    _, losses = reference
    killed = async_runs["killed"]
    after = async_runs["after kill"]
    # steps 1 and 2 published (keep 2: nothing pruned for the save that never completed), step 3 only a leftover
    assert [n for n in after if not n.startswith(".")] == _names(1, 2), after
    assert [n for n in after if n.startswith(".")] and all(n.startswith(".step_00000003.tmp-") for n in after
                                                           if n.startswith(".")), after
    out = _same_on_both_ranks(async_runs["per_rank"], "killed")
    assert "error" not in out, out
    assert out["start"] == 2 and out["resumed_from"] == str(_step(killed, 2))
    assert out["losses"] == losses[2:]
    assert _steps(killed) == _names(3, 4) and latest_checkpoint(killed) == _step(killed, 4)


# ----- pipeline- and expert-parallel checkpoints ------------------------------------------------------------


def _parallel_faults(layout: tuple, work: Path, timeout: float) -> dict:
    """``layout``'s uninterrupted reference (saves at steps 1-4); copies with the newest checkpoint damaged and
    a run killed while writing step 3, resumed; a save of step 5 damaged after its write with keep 1."""
    ref = work / "reference"
    runs = run_ranks(2, _train, str(ref), layout, timeout=timeout)
    losses = [out[0] for out in runs]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS
    dirs = {name: _copy(ref, work, name) for name in ("bitflip", "damaged save")}
    flipped = flip_bytes(_step(dirs["bitflip"], STEPS))
    dirs["killed"] = work / "killed"
    _kill(dirs["killed"], layout, "write_data", 3, keep=2, timeout=timeout)
    after_kill = _steps(dirs["killed"])
    scenarios = [{"name": "bitflip", "layout": layout},
                 {"name": "damaged save", "layout": layout, "steps": 5, "keep": 1, "damage_save": "step_00000005"},
                 {"name": "killed", "layout": layout, "save_every": 1, "keep": 2}]
    for sc in scenarios:
        sc["dir"] = str(dirs[sc["name"]])
    per_rank = run_ranks(2, _scenarios, scenarios, timeout=timeout)
    return {"losses": losses[0], "layout": runs[0][1], "model": runs[0][2], "dirs": dirs, "flipped": flipped, "after kill": after_kill, "per_rank": per_rank}


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory) -> dict:
    return _parallel_faults(PP_LAYOUT, tmp_path_factory.mktemp("pp"), timeout=150)


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> dict:
    pytest.importorskip("transformers")
    return _parallel_faults(EP_LAYOUT, tmp_path_factory.mktemp("ep"), timeout=150)


@pytest.fixture(params=["pp", "ep"])
def parallel(request) -> dict:
    return request.getfixturevalue(f"{request.param}_runs")


def test_parallel_checkpoints_are_complete(parallel, request):
    """The runs are pp=2 on the tiny Llama and ep=2 on the Qwen3-MoE; each rank wrote its own tensor file,
    hashed chunk by chunk into the manifest (what the faults damage)."""
    from tests.test_checkpoint_faults import _manifest

    kind = request.node.callspec.params["parallel"]
    layout, model = {"pp": ("pp=2", "LlamaModel"), "ep": ("dp_shard=2 (ep=2)", "Qwen3MoeForCausalLM")}[kind]
    assert parallel["layout"] == layout and parallel["model"].endswith(model), (parallel["layout"], parallel["model"])
    assert len(set(parallel["losses"])) == STEPS  # it trains

    manifest = _manifest(_step(parallel["dirs"]["bitflip"], STEPS - 1))
    files = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"], files
    assert all(any(c["key"].startswith("model::") for c in manifest["files"][f]["chunks"]) for f in files)


def test_a_damaged_newest_parallel_checkpoint_is_skipped_and_resume_falls_back(parallel):
    bitflip = parallel["dirs"]["bitflip"]
    out = _same_on_both_ranks(parallel["per_rank"], "bitflip")
    assert "error" not in out, out
    assert out["start"] == STEPS - 1 and out["resumed_from"] == str(_step(bitflip, STEPS - 1))
    assert out["losses"] == parallel["losses"][STEPS - 1:]  # bit for bit the reference's step 4
    text = _messages(out)
    assert f"skipping {_step(bitflip, STEPS)}: " in text and f"tensor {parallel['flipped']} chunk" in text, text
    assert f"falling back to {_step(bitflip, STEPS - 1)}" in text, text


def test_a_parallel_save_that_does_not_verify_prunes_nothing(parallel):
    directory = parallel["dirs"]["damaged save"]
    out = _same_on_both_ranks(parallel["per_rank"], "damaged save")
    assert f"checkpoint {_step(directory, 5)} failed verification" in out["error"], out
    assert "__0_0.distcp: tensor model::" in out["error"], out
    assert _steps(directory) == _names(1, 2, 3, 4)  # keep 1, but the step-5 save never verified


def test_a_rank_killed_mid_parallel_save_leaves_the_previous_checkpoint_latest(parallel):
    killed = parallel["dirs"]["killed"]
    after = parallel["after kill"]
    assert [n for n in after if not n.startswith(".")] == _names(1, 2), after
    assert any(n.startswith(".step_00000003.tmp-") for n in after), after
    out = _same_on_both_ranks(parallel["per_rank"], "killed")
    assert "error" not in out, out
    assert out["start"] == 2 and out["losses"] == parallel["losses"][2:]
    assert _steps(killed) == _names(3, 4)


# ----- kills at moments of later saves (a fixed seed picks them) ---------------------------------------------


def _kill_points(seed: int = 38, count: int = 3) -> list[tuple[str, int, bool]]:
    """``count`` (stage, step, background save) triples: distinct stages, steps 2-4."""
    rng = random.Random(seed)
    stages = rng.sample(sorted(STAGES), count)
    return [(stage, rng.randint(2, STEPS), rng.random() < 0.5) for stage in stages]


#: SP_PLAN_KILL_SEED / SP_PLAN_KILL_POINTS pick other (or more) kill points for a longer search.
KILL_POINTS = _kill_points(int(os.environ.get("SP_PLAN_KILL_SEED", "38")),
                           int(os.environ.get("SP_PLAN_KILL_POINTS", "3")))


@pytest.mark.parametrize("stage, step, async_save", KILL_POINTS,
                         ids=[f"{s.replace(' ', '-')}-step{n}-{'async' if a else 'sync'}" for s, n, a in KILL_POINTS])
def test_a_kill_at_a_moment_of_a_later_save_resumes_to_the_reference_losses(stage, step, async_save,
                                                                          reference, tmp_path):  # noqa: F811
    from sp_plan.runtime.checkpoint import latest_checkpoint

    _, losses = reference
    root = tmp_path / "ckpt"
    _kill(root, LAYOUT, stage, step, async_save=async_save, keep=1)
    start = step if stage in PUBLISHED else step - 1
    assert latest_checkpoint(root) == _step(root, start), _steps(root)
    if stage not in PUBLISHED:  # keep 1: the save that never verified pruned nothing
        assert [n for n in _steps(root) if not n.startswith(".")] == _names(start), _steps(root)
    out = run_ranks(2, _scenarios, [{"name": "resume", "dir": str(root), "save_every": 1, "keep": 1,
                                     "async_save": async_save}], timeout=120)
    after = _same_on_both_ranks(out, "resume")
    assert "error" not in after, after
    assert after["start"] == start and after["resumed_from"] == str(_step(root, start))
    assert after["losses"] == losses[start:]
    # the resumed run's checkpoint is all that is left: no leftover of the interrupted save, no half-pruned one
    # (a kill after the rename at the last step leaves the step before unpruned: nothing ran to prune it)
    left = _names(STEPS - 1, STEPS) if (stage == "after rename" and step == STEPS) else _names(STEPS)
    assert _steps(root) == left, _steps(root)


def test_the_kill_points_are_spread_over_the_stages():
    assert len({stage for stage, _, _ in KILL_POINTS}) == len(KILL_POINTS) >= 2
    assert all(2 <= step <= STEPS for _, step, _ in KILL_POINTS)
    assert set(itertools.chain.from_iterable([s] for s, _, _ in _kill_points(count=len(STAGES)))) == set(STAGES)
