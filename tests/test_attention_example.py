"""The documented example runs under torchrun on CPU and agrees with single-device attention."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.distributed import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_example_under_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
         str(ROOT / "examples" / "sp_attention.py"), "--seq", "64"],
        capture_output=True, text=True, timeout=170, env=env, cwd=ROOT, check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "layout ring=2 x ulysses=2" in result.stdout
    assert result.stdout.count("-> OK") == 2 and "packed (4 documents per row)" in result.stdout
