"""A rank killed mid-run (issue 35, item 6): the survivors say so in one line, not gloo's traceback.

torchrun with a slow monitor (``--monitor-interval 5``) gives the surviving rank time to reach its next
collective and fail in gloo ("Connection closed by peer"), as on a busy machine or with a launcher of the
user's own; ``sp-plan train --nproc-per-node`` reports the killed rank itself, in one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
TRAIN = ["train", "--dp-shard", "2", "--seq-len", "64", "--steps", "100000", "--corpus-bytes", "300000",
         "--no-progress", "--log-every", "1", "--yes"]


def _rank_pids(launcher: int, deadline: float) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes, from their environments."""
    while time.monotonic() < deadline:
        found = {}
        for child in Path("/proc").iterdir():
            if not child.name.isdigit():
                continue
            try:
                stat = (child / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) != launcher:
                    continue
                env = dict(e.split("=", 1) for e in (child / "environ").read_text().split("\0") if "=" in e)
            except (OSError, ValueError, IndexError):
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = int(child.name)
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("the two ranks did not start")


def _kill_rank_1_once_training(argv: list[str], tmp_path: Path) -> str:
    log = tmp_path / "out.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with log.open("w") as out:
        launcher = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
        try:
            deadline = time.monotonic() + 180
            ranks = _rank_pids(launcher.pid, deadline)
            while "step 2" not in log.read_text() and "step     2" not in log.read_text():
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            os.kill(ranks[1], signal.SIGKILL)
            launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    return log.read_text()


@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_a_survivor_of_a_killed_peer_prints_one_line(tmp_path: Path) -> None:
    argv = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "5",
            "-m", "sp_plan.cli", *TRAIN]
    out = _kill_rank_1_once_training(argv, tmp_path)
    assert "[rank0]: Traceback" not in out and "[rank0]:" not in out, out[-4000:]
    assert "error: rank 0 lost its connection to another rank in a collective (Connection" in out, out[-4000:]


@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_the_built_in_launcher_names_the_killed_rank(tmp_path: Path) -> None:
    out = _kill_rank_1_once_training([str(BIN / "sp-plan"), *TRAIN[:1], "--nproc-per-node", "2", *TRAIN[1:]],
                                     tmp_path)
    assert "Traceback" not in out and "[rank0]:" not in out, out[-4000:]
    assert "error: rank 1 was killed by SIGKILL" in out, out[-4000:]
    assert "failed (exitcode" not in out, out[-4000:]  # torchrun's own log line: the one above says it


def test_only_a_lost_peer_is_shortened() -> None:
    from sp_plan.runtime.peer_loss import peer_lost_line

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:20375. This is typically caused by a remote worker crashing. GLHF!")
    line = peer_lost_line(gloo)
    assert line is not None and "(Connection closed by peer [127.0.0.1]:20375)" in line and "GLHF" not in line
    try:
        try:
            raise RuntimeError("NCCL communicator was aborted on rank 3.")
        except RuntimeError as inner:
            raise ValueError("collective failed") from inner
    except ValueError as chained:
        assert "NCCL communicator was aborted on rank 3" in (peer_lost_line(chained) or "")
    assert peer_lost_line(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
