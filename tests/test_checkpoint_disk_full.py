"""A full disk during a save (issue 35, item 5): one line on every rank naming the directory and the space the
checkpoint needs, the partial save removed, and ``--resume`` working right after.

Before: DCP's ``CheckpointException`` (every rank's traceback) ended the run, the partial temporary directory
kept its space, and the free-space check then refused the resume until the user deleted it by hand.

``ENOSPC`` is injected where a save writes (rank 1's tensor file, rank 1's per-rank file, rank 0's manifest;
synchronous and background saves); ``test_a_real_full_filesystem`` fills a real tmpfs in a private mount
namespace (``unshare``) through the console script, where the machine allows one.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.test_checkpoint import configure, trainer_for
from tests.test_checkpoint_faults import LAYOUT, STEPS, reference  # noqa: F401 - the fixture

FAILING = ".step_00000003.tmp-"


def _no_space(path: object) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _inject(where: str, rank: int) -> list:
    """Make the save of step 3 run out of space at ``where``; the undo callbacks."""
    import torch.distributed.checkpoint as dcp

    from sp_plan.runtime.checkpoint import manager
    from sp_plan.runtime.errors import RuntimeConfigError

    undo = []
    if where == "tensor-file":
        real = dcp.FileSystemWriter.write_data

        def write_data(self, plan, planner, real=real):
            if rank == 1 and FAILING in str(self.path):
                (Path(self.path) / "__1_0.distcp").write_bytes(b"\0" * 4096)  # what fitted before the disk filled
                raise _no_space(Path(self.path) / "__1_0.distcp")
            return real(self, plan, planner)

        dcp.FileSystemWriter.write_data = write_data
        undo.append(lambda: setattr(dcp.FileSystemWriter, "write_data", real))
    elif where in ("rank-file", "manifest"):
        name = "write_json" if where == "rank-file" else "write_manifest"
        real = getattr(manager, name)
        failing_rank = 1 if where == "rank-file" else 0

        def write(path, *args, real=real, **kwargs):
            if rank == failing_rank and FAILING in str(path):
                try:  # as atomic_write_text reports it
                    raise _no_space(path)
                except OSError as exc:
                    raise RuntimeConfigError(f"cannot write {path}: {exc.strerror}") from exc
            return real(path, *args, **kwargs)

        setattr(manager, name, write)
        undo.append(lambda: setattr(manager, name, real))
    return undo


def _fill_then_resume(rank: int, world: int, root: str, where: str, async_save: bool) -> dict:
    from sp_plan.runtime.errors import RuntimeConfigError

    undo = _inject(where, rank)
    trainer = trainer_for(configure(*LAYOUT), steps=STEPS, checkpoint_dir=root, save_every=1, async_save=async_save)
    error = None
    try:
        trainer.fit()
    except RuntimeConfigError as exc:
        error = str(exc)
    except BaseException as exc:  # a raw DCP exception fails the test that reads it
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = f"RAW {type(exc).__name__}: {str(exc)[:400]}"
    finally:
        for step in undo:
            step()
    trainer.checkpointer = None
    left = sorted(p.name for p in Path(root).iterdir())
    resumed = trainer_for(configure(*LAYOUT), steps=STEPS, checkpoint_dir=root, resume=True, save_every=1).fit()
    return {"error": error, "left": left, "start": resumed.start_step, "losses": resumed.losses,
            "after": sorted(p.name for p in Path(root).iterdir())}


CASES = [("tensor-file", False), ("rank-file", False), ("manifest", False), ("tensor-file", True)]


@pytest.mark.multiproc
@pytest.mark.parametrize(("where", "async_save"), CASES,
                         ids=[f"{w}{'-async' if a else ''}" for w, a in CASES])
def test_a_full_disk_is_one_line_cleaned_up_and_resumable(where, async_save, tmp_path, reference):  # noqa: F811
    _, losses = reference
    root = tmp_path / "ckpt"
    out = run_ranks(2, _fill_then_resume, str(root), where, async_save, timeout=240)
    error = out[0]["error"]
    assert error is not None and error == out[1]["error"], out
    assert not error.startswith("RAW") and "Traceback" not in error and "\n" not in error, error
    assert "no space left in" in error and str(root) in error and "step_00000003" in error, error
    assert "GB free" in error or "is free" in error, error
    assert "step_00000002 is still the latest checkpoint" in error and "--resume" in error, error
    assert out[0]["left"] == ["step_00000001", "step_00000002"], out[0]["left"]  # the partial save is gone
    assert out[0]["start"] == 2 and out[0]["losses"] == losses[2:]
    assert out[0]["after"] == [f"step_{s:08d}" for s in range(1, STEPS + 1)]


def test_a_stale_partial_save_does_not_count_against_the_free_space(tmp_path) -> None:
    """The free-space check before a run ignores what a killed save left: it is removed first."""
    from sp_plan.runtime.checkpoint import store

    root = tmp_path / "ckpt"
    done = root / "step_00000002"
    done.mkdir(parents=True)
    (done / "data").write_bytes(b"\0" * 1000)
    stale = root / ".step_00000003.tmp-abcd"
    stale.mkdir()
    (stale / "__1_0.distcp").write_bytes(b"\0" * 5000)
    store.is_complete, real = (lambda path: path == done), store.is_complete
    try:
        usage = shutil.disk_usage(root)
        store.shutil.disk_usage = lambda p: usage._replace(free=1500 if stale.exists() else 6500)
        assert store._checkpoint_dir_problem(root) is None
    finally:
        store.is_complete = real
        store.shutil.disk_usage = shutil.disk_usage
    assert not stale.exists() and done.exists()


def test_the_failure_line_names_each_failing_rank() -> None:
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from sp_plan.runtime.checkpoint.save_failure import failures_of

    try:
        raise _no_space("/ckpt/.step_00000003.tmp-ab/__1_0.distcp")
    except OSError as exc:
        wrapped = _wrap_exception(exc)
    failures = failures_of(CheckpointException("save failed", {1: wrapped}), rank=0)
    assert failures == [(1, "OSError: No space left on device (/ckpt/.step_00000003.tmp-ab/__1_0.distcp)", True)]
    assert failures_of(ValueError("bad"), rank=3) == [(3, "ValueError: bad", False)]


# ----- a real filesystem that fills up --------------------------------------------------------------------

MIB = 1 << 20


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /tmp && df /tmp"],
                           capture_output=True, text=True, timeout=30, check=False)
    return probe.returncode == 0


def _train_args(root: str) -> str:
    exe = Path(sys.executable).parent / "sp-plan"
    return (f"{exe} train --nproc-per-node 2 --dp-shard 2 --seq-len 32 --steps 4 --corpus-bytes 100000 --no-progress "
            f"--log-every 0 --yes --dtype fp32 --topology dgx-h100 --checkpoint-dir {root} --save-every 1")


@pytest.mark.multiproc
def test_a_real_full_filesystem(tmp_path) -> None:
    """sp-plan train on 2 CPU ranks into a tmpfs with room for two and a half checkpoints: the third save fails
    in one line and leaves nothing behind; with the oldest checkpoint deleted, --resume finishes the run."""
    if not _can_mount_tmpfs():
        pytest.skip("no private mount namespace here (unshare -rm): the injected-ENOSPC tests cover the logic")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sizing = tmp_path / "sizing"
    one = subprocess.run(f"{_train_args(str(sizing))} --steps 1", shell=True, capture_output=True, text=True,
                         timeout=240, check=False, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    checkpoint = sum(f.stat().st_size for f in (sizing / "step_00000001").rglob("*") if f.is_file())
    size = max(1, int(checkpoint * 2.5 / 4096)) * 4096
    mount = tmp_path / "disk"
    mount.mkdir()
    root = mount / "ckpt"
    script = f"""set -u
mount -t tmpfs -o size={size} tmpfs {mount} || exit 90
{_train_args(str(root))} --keep-checkpoints 100 > {tmp_path}/first.log 2>&1; echo $? > {tmp_path}/first.rc
ls -a {root} > {tmp_path}/left.txt
rm -rf {root}/step_00000001
{_train_args(str(root))} --keep-checkpoints 1 --resume > {tmp_path}/second.log 2>&1; echo $? > {tmp_path}/second.rc
ls {root} > {tmp_path}/after.txt
"""
    done = subprocess.run(["unshare", "-rm", "bash", "-c", script], capture_output=True, text=True, timeout=480,
                          check=False, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    first = (tmp_path / "first.log").read_text()
    assert (tmp_path / "first.rc").read_text().strip() != "0", first[-2000:]
    assert "Traceback" not in first and "CheckpointException" not in first, first[-3000:]
    assert "no space left in" in first and "step_00000003" in first, first[-2000:]
    left = (tmp_path / "left.txt").read_text().split()
    assert [n for n in left if n.startswith(".step")] == [], left  # the partial save is gone
    assert "step_00000002" in left
    second = (tmp_path / "second.log").read_text()
    assert (tmp_path / "second.rc").read_text().strip() == "0", second[-3000:]
    assert "done:" in second, second[-2000:]
    assert (tmp_path / "after.txt").read_text().split() == ["step_00000004"]


def test_a_short_write_on_a_full_disk_is_called_a_full_disk(tmp_path, monkeypatch) -> None:
    """torch's writer may report a full disk as "unexpected pos" (its own position check after a short write),
    not ENOSPC: with less room than the checkpoint needs, the line still says so."""
    from sp_plan.runtime.checkpoint import save_failure

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(save_failure.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    line = save_failure.describe_failure(tmp_path, tmp_path / "step_00000003", 5000,
                                         [(1, "RuntimeError: unexpected pos 704 vs 598", False)])
    assert "no space left in" in line and "0.000 GB is free" in line, line
    monkeypatch.setattr(save_failure.shutil, "disk_usage", lambda p: usage._replace(free=10_000))
    line = save_failure.describe_failure(tmp_path, tmp_path / "step_00000003", 5000,
                                         [(1, "RuntimeError: unexpected pos 704 vs 598", False)])
    assert "no space" not in line and "unexpected pos" in line, line
