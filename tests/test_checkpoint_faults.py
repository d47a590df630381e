"""Fault injection on checkpoints (2 gloo CPU ranks, a tiny model, dp_shard 2: each rank writes its own file).

One uninterrupted run saves steps 1-4 (the reference: its losses and checkpoints). Each scenario copies
that directory, damages it the way disks, people and crashes do, and resumes (``Trainer.fit``) on two
fresh ranks:

- bytes flipped inside a tensor chunk, a truncated tensor file, a missing tensor file, a missing or a
  partial manifest in the newest checkpoint: resume skips it, says which file and chunk and why
  (expected vs found digest), and continues from step 3 exactly (the step-4 loss equals the reference);
  naming the damaged checkpoint explicitly is one error, the same on both ranks;
- every checkpoint damaged, or a mistyped directory: ``resume=True`` fails with one clear error and
  leaves the directory as it was; ``resume="auto"`` starts a new run only where there is no checkpoint;
- a directory renamed to another step, a ``trainer_state.json`` whose step disagrees with its directory;
- a rank SIGKILLed while writing the step-3 checkpoint: step 2 is the latest, the leftover is removed;
- an unwritable checkpoint directory (a path under a regular file: tests run as root, so permissions
  do not bite) and too little free space: refused before the first step;
- a save whose files are damaged after the write (synchronous and background): it fails verification,
  nothing older is pruned, the damaged step directory is removed;
- resuming with another lr is refused naming both values, and with ``override_hparams`` uses the new lr;
  a fresh run refuses a directory that holds checkpoints; another run's step is replaced, and said.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_checkpoint import configure, trainer_for

STEPS = 4
LAYOUT = ({"dp_shard": 2}, {"zero_stage": 3})
NEW_LR = 2e-2


def _step(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _reference(rank: int, world: int, root: str) -> list[float]:
    trainer = trainer_for(configure(*LAYOUT), steps=STEPS, checkpoint_dir=root, save_every=1)
    return trainer.fit().losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[float]]:
    root = tmp_path_factory.mktemp("faults") / "reference"
    losses = run_ranks(2, _reference, str(root), timeout=180)
    assert losses[0] == losses[1] and len(losses[0]) == STEPS
    return root, losses[0]


# ----- damage ---------------------------------------------------------------------------------------------


def _manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def flip_bytes(step_dir: Path, file: str = "__1_0.distcp") -> str:
    """Flip three bytes in the middle of the first model tensor chunk of ``file``; returns its key. (Without
    a manifest, as in checkpoints written before there was one, a tenth into the file: a model chunk.)"""
    if (step_dir / "manifest.json").is_file():
        chunk = next(c for c in _manifest(step_dir)["files"][file]["chunks"] if c["key"].startswith("model::"))
    else:
        chunk = {"key": "model::?", "at": 0, "bytes": (step_dir / file).stat().st_size // 5}
    middle = chunk["at"] + chunk["bytes"] // 2
    with open(step_dir / file, "r+b") as f:
        f.seek(middle)
        data = bytearray(f.read(3))
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data))
    return chunk["key"]


def truncate(path: Path, keep_fraction: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * keep_fraction))


def rewrite_state_step(step_dir: Path, step: int) -> None:
    """Give trainer_state.json another step and re-hash it into the manifest (a consistent-looking copy)."""
    rewrite_state(step_dir, lambda state: state.__setitem__("step", step))


def rewrite_state(step_dir: Path, edit) -> None:
    """Edit trainer_state.json in place and re-hash it into the manifest (a consistent-looking checkpoint)."""
    import hashlib

    state_file = step_dir / "trainer_state.json"
    state = json.loads(state_file.read_text())
    edit(state)
    state_file.write_text(json.dumps(state))
    if not (step_dir / "manifest.json").is_file():
        return
    manifest = _manifest(step_dir)
    data = state_file.read_bytes()
    manifest["files"]["trainer_state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


# ----- resuming under faults (one pair of ranks runs every scenario in turn) --------------------------------


def _resume_scenarios(rank: int, world: int, scenarios: list[dict]) -> dict:
    from sp_plan.runtime.checkpoint import manager, store
    from sp_plan.runtime.errors import RuntimeConfigError

    out = {}
    for sc in scenarios:
        messages: list[str] = []
        lrs: list[float] = []
        setup = configure(*sc.get("layout", LAYOUT))
        options = {"override_hparams": True} if sc.get("override") else {}
        trainer = trainer_for(setup, steps=sc.get("steps", STEPS), checkpoint_dir=sc["dir"],
                              resume=sc.get("resume", True), print_fn=messages.append,
                              save_every=sc.get("save_every", 0), keep_checkpoints=sc.get("keep"),
                              async_save=sc.get("async_save", False), on_step=lambda t, r: lrs.append(r.lr),
                              **options)
        if "lr" in sc:
            for group in trainer.optimizer.param_groups:  # as if built with another --lr
                group["initial_lr"] = sc["lr"]
            trainer.scheduler.base_lrs = [sc["lr"]]
        restore = []
        if sc.get("free_bytes") is not None:
            real = store.shutil.disk_usage
            store.shutil.disk_usage = lambda p, real=real: real(p)._replace(free=sc["free_bytes"])
            restore.append(lambda real=real: setattr(store.shutil, "disk_usage", real))
        if sc.get("damage_save") is not None and hasattr(manager, "verify_checkpoint"):
            real_verify = manager.verify_checkpoint

            def damaging_verify(path, group=None, *, collective=True, real=real_verify, target=sc["damage_save"]):
                if Path(path).name == target and rank == 0:
                    flip_bytes(Path(path), "__0_0.distcp")  # rank 0's own file: it re-reads it next
                return real(path, group, collective=collective)

            manager.verify_checkpoint = damaging_verify
            restore.append(lambda real=real_verify: setattr(manager, "verify_checkpoint", real))
        try:
            fit = trainer.fit()
            out[sc["name"]] = {"start": fit.start_step, "losses": fit.losses, "messages": messages, "lrs": lrs,
                               "resumed_from": str(fit.resumed_from), "base_lrs": list(trainer.scheduler.base_lrs)}
        except RuntimeConfigError as exc:
            trainer.checkpointer = None
            out[sc["name"]] = {"error": str(exc), "type": type(exc).__name__, "messages": messages,
                               "steps_run": len(lrs)}
        except BaseException as exc:  # anything else (a raw DCP traceback, ...) fails the test that reads it
            if isinstance(exc, KeyboardInterrupt):
                raise
            out[sc["name"]] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "type": type(exc).__name__,
                               "messages": messages, "steps_run": len(lrs)}
        finally:
            for undo in restore:
                undo()
    return out


def _copy(reference_root: Path, work: Path, name: str) -> Path:
    target = work / name
    shutil.copytree(reference_root, target)
    return target


@pytest.fixture(scope="module")
def faults(reference, tmp_path_factory):
    ref_root, _ = reference
    work = tmp_path_factory.mktemp("scenarios")
    dirs: dict[str, Path] = {}
    info: dict = {}

    def copy(name: str) -> Path:
        dirs[name] = _copy(ref_root, work, name)
        return dirs[name]

    info["flipped_key"] = flip_bytes(_step(copy("bitflip"), 4))
    flip_bytes(_step(copy("bitflip explicit"), 4))
    truncate(_step(copy("truncated"), 4) / "__0_0.distcp")
    truncate(_step(copy("truncated unverified"), 4) / "__0_0.distcp", 0.05)  # into the model chunks
    (_step(copy("missing file"), 4) / "__1_0.distcp").unlink()
    (_step(copy("missing manifest"), 4) / "manifest.json").unlink(missing_ok=True)
    partial = _step(copy("partial manifest"), 4) / "manifest.json"
    if partial.is_file():
        partial.write_bytes(partial.read_bytes()[:200])
    for step in range(1, STEPS + 1):
        flip_bytes(_step(copy("all damaged") if step == 1 else dirs["all damaged"], step))
    shutil.copytree(dirs["all damaged"], work / "all damaged auto")
    dirs["all damaged auto"] = work / "all damaged auto"
    os.rename(_step(copy("renamed"), 4), _step(dirs["renamed"], 6))
    rewrite_state_step(_step(copy("state step"), 4), 7)
    rewrite_state(_step(copy("no run_config"), 4), lambda state: state["extra"].pop("run_config"))
    for name in ("fresh into populated", "other lr", "override lr", "other layout", "replaced", "damaged save",
                 "damaged async save"):
        copy(name)
    blocker = work / "a-file"
    blocker.write_text("not a directory")
    dirs["unwritable"] = blocker / "ckpt"
    dirs["mistyped"] = work / "no-such-dir"
    dirs["auto fresh"] = work / "auto-fresh"
    copy("no space")
    scenarios = [
        {"name": n} for n in ("bitflip", "truncated", "missing file", "missing manifest", "partial manifest",
                              "all damaged", "mistyped", "renamed")
    ] + [
        {"name": "bitflip explicit", "resume": str(_step(dirs["bitflip explicit"], 4))},
        {"name": "truncated unverified", "load_unverified": True},
        {"name": "all damaged auto", "resume": "auto"},
        {"name": "auto fresh", "resume": "auto", "steps": 1},
        {"name": "state step", "resume": str(_step(dirs["state step"], 4))},
        {"name": "unwritable", "resume": False, "steps": 1},
        {"name": "no space", "free_bytes": 1000, "steps": 5},
        {"name": "fresh into populated", "resume": False, "steps": 1},
        {"name": "other lr", "lr": NEW_LR},
        {"name": "override lr", "lr": NEW_LR, "override": True, "steps": STEPS + 1},
        {"name": "other layout", "layout": ({"ulysses": 2}, {"zero_stage": 3})},
        {"name": "no run_config"},
        {"name": "replaced", "resume": str(_step(dirs["replaced"], 2)), "steps": 3},
        {"name": "damaged save", "steps": 5, "keep": 1, "damage_save": "step_00000005"},
        {"name": "damaged async save", "steps": 6, "save_every": 1, "keep": 1, "async_save": True,
         "damage_save": "step_00000006"},
    ]
    for sc in scenarios:
        sc["dir"] = str(dirs[sc["name"]])
    unverified = [sc for sc in scenarios if sc.get("load_unverified")]
    scenarios = [sc for sc in scenarios if not sc.get("load_unverified")]
    per_rank = run_ranks(2, _resume_scenarios, scenarios, timeout=400)
    loads = run_ranks(2, _load_unverified, [sc["dir"] for sc in unverified], timeout=120)
    return dirs, info, per_rank, loads


def _load_unverified(rank: int, world: int, roots: list[str]) -> list[str]:
    from sp_plan.runtime.checkpoint import load_checkpoint
    from sp_plan.runtime.errors import RuntimeConfigError

    setup = configure(*LAYOUT)
    errors = []
    for root in roots:
        try:
            load_checkpoint(_step(Path(root), 4), setup=setup, verify=False)
            errors.append("no error")
        except RuntimeConfigError as exc:
            errors.append(str(exc))
    return errors


def _same_on_both_ranks(per_rank: list[dict], name: str) -> dict:
    first, second = per_rank[0][name], per_rank[1][name]
    assert first.get("error") == second.get("error"), (first, second)
    return first


def _messages(out: dict) -> str:
    return "\n".join(out["messages"])


@pytest.mark.multiproc
@pytest.mark.parametrize("name, reason", [
    ("bitflip", "tensor model::"),
    ("truncated", "__0_0.distcp has"),
    ("missing file", "__1_0.distcp is missing"),
    ("missing manifest", "incomplete: no manifest.json"),
    ("partial manifest", "manifest.json is not valid JSON"),
])
def test_a_damaged_newest_checkpoint_is_skipped_and_resume_falls_back(name, reason, faults, reference):
    dirs, info, per_rank, _ = faults
    _, losses = reference
    out = _same_on_both_ranks(per_rank, name)
    assert "error" not in out, out
    assert out["start"] == STEPS - 1 and out["resumed_from"] == str(_step(dirs[name], STEPS - 1))
    assert out["losses"] == losses[STEPS - 1:]  # the continuation from step 3 is exact
    text = _messages(out)
    assert f"skipping {_step(dirs[name], STEPS)}: " in text and reason in text, text
    assert f"falling back to {_step(dirs[name], STEPS - 1)}" in text, text
    if name == "bitflip":
        assert f"tensor {info['flipped_key']} chunk at offsets" in text and "expected sha256" in text
        assert "found" in text, text
    if name == "truncated":
        assert "the manifest says" in text and "truncated" in text, text
    if name == "missing manifest":  # the resumed run's step 4 replaces the incomplete one, and says so
        assert f"replaced {_step(dirs[name], STEPS)}, an incomplete checkpoint: no manifest.json" in text, text


@pytest.mark.multiproc
def test_a_named_damaged_checkpoint_is_one_error_naming_file_and_chunk(faults):
    dirs, info, per_rank, loads = faults
    out = _same_on_both_ranks(per_rank, "bitflip explicit")
    error = out["error"]
    assert out["type"] == "CheckpointCorruptError" and out["steps_run"] == 0
    assert f"checkpoint {_step(dirs['bitflip explicit'], STEPS)} failed verification" in error
    assert "__1_0.distcp: tensor model::" in error and "expected sha256" in error and "found" in error
    # loaded without verification, a truncated file is still one error naming the checkpoint, every rank alike
    assert loads[0] == loads[1]
    assert f"reading the tensors of checkpoint {_step(dirs['truncated unverified'], STEPS)} failed" in loads[0][0]


@pytest.mark.multiproc
def test_nothing_verifiable_is_an_error_and_changes_nothing(faults):
    dirs, _, per_rank, _ = faults
    for name in ("all damaged", "all damaged auto"):
        out = _same_on_both_ranks(per_rank, name)
        assert "none of its 4 step directories verifies" in out["error"], out
        assert "--resume-or-start" in out["error"] and out["steps_run"] == 0
        assert sorted(p.name for p in dirs[name].iterdir()) == [f"step_{s:08d}" for s in range(1, STEPS + 1)]
    out = _same_on_both_ranks(per_rank, "mistyped")
    assert f"cannot resume from {dirs['mistyped']}: it does not exist" in out["error"]
    assert not dirs["mistyped"].exists()  # a mistyped path is not created
    fresh = _same_on_both_ranks(per_rank, "auto fresh")
    assert fresh["start"] == 0 and len(fresh["losses"]) == 1
    assert "starting a new run at step 0" in _messages(fresh)
    assert (_step(dirs["auto fresh"], 1) / "manifest.json").is_file()


@pytest.mark.multiproc
def test_the_step_comes_from_the_directory_and_must_agree(faults):
    dirs, _, per_rank, _ = faults
    renamed = _same_on_both_ranks(per_rank, "renamed")
    assert renamed["start"] == STEPS - 1  # step_6 (really step 4) is skipped
    assert f"its directory name says step 6, its manifest.json says step {STEPS}" in _messages(renamed)
    state = _same_on_both_ranks(per_rank, "state step")
    assert "its directory name says step 4, its trainer_state.json says step 7" in state["error"], state


@pytest.mark.multiproc
def test_an_unusable_checkpoint_directory_is_refused_before_training(faults):
    dirs, _, per_rank, _ = faults
    out = _same_on_both_ranks(per_rank, "unwritable")
    assert out["steps_run"] == 0 and f"checkpoint directory {dirs['unwritable']} is not writable" in out["error"]
    out = _same_on_both_ranks(per_rank, "no space")
    assert out["steps_run"] == 0 and "0.00 GB free, its last checkpoint (step_00000004) took" in out["error"], out


@pytest.mark.multiproc
def test_options_that_differ_from_the_checkpoint(faults, reference):
    dirs, _, per_rank, _ = faults
    _, losses = reference
    out = _same_on_both_ranks(per_rank, "other lr")
    assert "lr: checkpoint 0.01 vs now 0.02" in out["error"] and "--override-hparams" in out["error"]
    assert out["steps_run"] == 0
    out = _same_on_both_ranks(per_rank, "override lr")
    assert out["start"] == STEPS and len(out["losses"]) == 1
    # the warm-up (3 steps) is over at step 5: the scheduled lr is the new base lr, not the saved 0.01
    assert out["base_lrs"] == [NEW_LR] and out["lrs"] == [pytest.approx(NEW_LR, rel=1e-12)]
    assert "overriding the checkpoint's settings with this run's: lr: checkpoint 0.01 vs now 0.02" in \
        _messages(out)
    other = _same_on_both_ranks(per_rank, "other layout")
    text = _messages(other)
    assert "layout: checkpoint dp_shard=2 vs now ulysses=2" in text and "grad_accum: checkpoint 1 vs now 2" in text
    assert other["start"] == STEPS
    bare = _same_on_both_ranks(per_rank, "no run_config")  # saved by save_checkpoint directly: not compared
    assert bare["start"] == STEPS and "run_config: the checkpoint records none" in _messages(bare)
    out = _same_on_both_ranks(per_rank, "fresh into populated")
    assert "already holds 4 checkpoint(s) (newest step_00000004)" in out["error"] and out["steps_run"] == 0
    assert len(list(dirs["fresh into populated"].iterdir())) == STEPS


@pytest.mark.multiproc
def test_another_runs_step_is_replaced_and_said(faults, reference):
    dirs, _, per_rank, _ = faults
    ref_root, losses = reference
    out = _same_on_both_ranks(per_rank, "replaced")
    assert out["start"] == 2 and out["losses"] == losses[2:3]
    assert f"replaced {_step(dirs['replaced'], 3)}, saved by another run" in _messages(out)
    old, new = _manifest(_step(ref_root, 3)), _manifest(_step(dirs["replaced"], 3))
    assert old["run_id"] != new["run_id"]
    assert _step(dirs["replaced"], 4).is_dir()  # a later step is never pruned by an earlier run


@pytest.mark.multiproc
@pytest.mark.parametrize("name, step, kept_steps", [("damaged save", 5, [1, 2, 3, 4]),
                                                    ("damaged async save", 6, [5])])
def test_a_save_that_does_not_verify_prunes_nothing(name, step, kept_steps, faults):
    dirs, _, per_rank, _ = faults
    out = _same_on_both_ranks(per_rank, name)
    assert f"checkpoint {_step(dirs[name], step)} failed verification" in out["error"], out
    assert "__0_0.distcp: tensor model::" in out["error"]
    kept = sorted(p.name for p in dirs[name].iterdir())
    # keep=1 would have pruned everything older than the failed save (the async run's step 5, verified,
    # pruned 1-4 as it should); the damaged step directory itself is gone
    assert kept == [f"step_{s:08d}" for s in kept_steps], kept


# ----- a rank killed while writing ---------------------------------------------------------------------------


def _killed_while_saving(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    real = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        if rank == 1 and ".step_00000003.tmp-" in str(self.path):
            (Path(self.path) / "__1_0.distcp").write_bytes(b"\0" * 4096)  # a partial file, then SIGKILL
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_then_die
    trainer_for(configure(*LAYOUT), steps=STEPS, checkpoint_dir=root, save_every=1).fit()


@pytest.mark.multiproc
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_latest(tmp_path, reference):
    from sp_plan.runtime.checkpoint import latest_checkpoint

    _, losses = reference
    root = tmp_path / "ckpt"
    # the harness notices rank 1's death itself, or through rank 0's broken connection, whichever comes first
    with pytest.raises((RuntimeError, AssertionError), match="died without reporting|rank 0 failed"):
        run_ranks(2, _killed_while_saving, str(root), timeout=120)
    assert latest_checkpoint(root) == _step(root, 2)
    assert any(p.name.startswith(".step_00000003.tmp-") for p in root.iterdir())
    out = run_ranks(2, _resume_scenarios, [{"name": "after kill", "dir": str(root), "save_every": 1}],
                    timeout=120)
    after = _same_on_both_ranks(out, "after kill")
    assert after["start"] == 2 and after["losses"] == losses[2:]
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:08d}" for s in range(1, STEPS + 1)]


def test_hashing_covers_every_tensor_byte(reference):
    """The manifest's chunks tile each tensor file exactly: no byte DCP reads is left unchecked."""
    ref_root, _ = reference
    manifest = _manifest(_step(ref_root, STEPS))
    tensor_files = {n: e for n, e in manifest["files"].items() if n.endswith(".distcp")}
    assert sorted(tensor_files) == ["__0_0.distcp", "__1_0.distcp"]
    for name, entry in tensor_files.items():
        at = 0
        for chunk in entry["chunks"]:
            assert chunk["at"] == at and len(chunk["sha256"]) == 64
            at += chunk["bytes"]
        assert at == entry["bytes"] == (_step(ref_root, STEPS) / name).stat().st_size
    assert {"trainer_state.json", ".metadata", "rng/rank_0.json", "rng/rank_1.json"} <= set(manifest["files"])
    assert torch.tensor(0).numel() == 1  # torch imported: the module runs under the runtime extra


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_the_example_exits_non_zero_when_there_is_nothing_to_resume(tmp_path):
    """``--resume`` on a mistyped directory: exit 2 and one line from the worker, not a fresh run."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    missing = tmp_path / "typo"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "examples/train_long_context.py", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
           "--ffn", "128", "--seq-len", "256", "--steps", "2", "--corpus-bytes", "100000", "--topology", "dgx-h100",
           "--no-progress", "--checkpoint-dir", str(missing), "--resume"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=170)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "exitcode: 2" in out, out[-3000:]
    assert f"error: cannot resume from {missing}: it does not exist" in done.stderr, out[-3000:]
    assert "done:" not in out and not missing.exists()  # no step ran, nothing was created


def test_a_manifest_cannot_point_outside_its_checkpoint(tmp_path):
    """The manifest is an untrusted file: a listed path that leaves the directory is refused, not read."""
    from sp_plan.runtime.checkpoint import verify_checkpoint

    step_dir = tmp_path / "step_00000001"
    step_dir.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("not a checkpoint file")
    (step_dir / "manifest.json").write_text(json.dumps({
        "format": 2, "algorithm": "sha256", "step": 1,
        "files": {"../secret.txt": {"bytes": secret.stat().st_size, "sha256": "0" * 64}}}))
    problems = verify_checkpoint(step_dir, collective=False)
    assert len(problems) == 1 and "'../secret.txt', which is not a file inside the checkpoint directory" in \
        problems[0], problems


def test_the_bookkeeping_alone_is_checked_before_choosing_a_plan(reference, tmp_path):
    """The example reuses the plan saved in trainer_state.json before the collective verification: it
    reads it only if it matches the manifest."""
    from sp_plan.runtime.checkpoint import CheckpointCorruptError, read_verified_state

    ref_root, _ = reference
    good = read_verified_state(_step(ref_root, STEPS))
    assert good["step"] == STEPS and good["plan"]
    copy = tmp_path / "step_00000004"
    shutil.copytree(_step(ref_root, STEPS), copy)
    state_file = copy / "trainer_state.json"
    state_file.write_text(state_file.read_text().replace('"dp_shard": 2', '"dp_shard": 1'))
    with pytest.raises(CheckpointCorruptError, match="trainer_state.json: expected sha256"):
        read_verified_state(copy)


def test_a_checkpoint_moved_aside_for_replacement_survives_a_crash(tmp_path):
    """A save that replaces a step moves the old directory aside first; if it dies before its own rename,
    the next save puts the old one back (and removes the aside copy once a replacement is complete)."""
    from sp_plan.runtime.checkpoint import latest_checkpoint
    from sp_plan.runtime.checkpoint.store import remove_stale as _remove_stale

    root = tmp_path / "ckpt"
    aside = root / ".step_00000003.replaced-0a1b2c3d"
    aside.mkdir(parents=True)
    (aside / "manifest.json").write_text("{}")
    (root / ".step_00000003.tmp-0a1b2c3d").mkdir()  # the replacing save's own leftovers
    _remove_stale(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
    assert latest_checkpoint(root) == _step(root, 3)
    aside.mkdir()  # now the replacement completed: the aside copy is only garbage
    _remove_stale(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
