"""A misspelt ``--tokenizer`` fails in seconds with one actionable line, through the console script.

Before, ``sp-plan train --tokenizer gpt2-typo`` spent about 56 s in transformers' hub retries, on every
rank. Now the name is checked before any rank plans or builds a model: a local path, then the local hub
cache, then (unless offline) one hub query with a short timeout and no retries. Every case here runs
without network: ``HF_HUB_OFFLINE=1``, or an endpoint on a closed loopback port (connection refused, the
same answer a machine without network gets), and a private, empty or hand-made hub cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sp_plan.runtime.text_data import build_bpe_tokenizer
from tests.distributed import free_port
from tests.test_train_entry_point import _torchrun

#: Bound on one failing launch: interpreter and torch start-up on a busy 2-core machine; the check itself
#: takes well under a second (the old behaviour took about 56 s).
FAIL_FAST_S = 20.0
SCRIPT = Path(sys.executable).parent / "sp-plan"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """An environment with its own, empty Hugging Face home (nothing cached) and one thread per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", **extra}


def _train(args: list[str], env: dict[str, str], cwd: Path, launcher: list[str] | None = None) -> tuple[
        subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([*(launcher or [str(SCRIPT)]), "train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    return done, time.monotonic() - started


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "hello world"}\n{"text": "a second document"}\n')
    return path


def _error_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


def test_misspelt_tokenizer_offline_fails_fast_with_one_line(tmp_path, docs):
    done, wall = _train(["--dataset", str(docs), "--tokenizer", "gpt2-typoo", "--steps", "1", "--seq-len", "64"],
                        _env(tmp_path, HF_HUB_OFFLINE="1"), tmp_path)
    lines = _error_lines(done)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1, lines
    assert "'gpt2-typoo'" in lines[0] and "offline" in lines[0] and "save_pretrained" in lines[0], lines
    assert "Traceback" not in done.stderr
    assert wall < FAIL_FAST_S, f"took {wall:.1f} s"


def test_unreachable_hub_is_one_query_not_a_retry_storm(tmp_path, docs):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused at once, as with no network
    done, wall = _train(["--dataset", str(docs), "--tokenizer", "acme/no-such-tokenizer", "--steps", "1"],
                        _env(tmp_path, HF_ENDPOINT=closed), tmp_path)
    lines = _error_lines(done)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1, lines
    assert "cannot be reached" in lines[0] and closed in lines[0] and "HF_HUB_OFFLINE=1" in lines[0], lines
    assert "Retrying" not in done.stderr
    assert wall < FAIL_FAST_S, f"took {wall:.1f} s"


def test_missing_local_path_and_invalid_name_are_named(tmp_path, docs):
    env = _env(tmp_path, HF_HUB_OFFLINE="1")
    done, _ = _train(["--dataset", str(docs), "--tokenizer", str(tmp_path / "tok"), "--steps", "1"], env, tmp_path)
    assert done.returncode == 2 and f"tokenizer path {tmp_path / 'tok'} does not exist" in done.stderr
    done, _ = _train(["--dataset", str(docs), "--tokenizer", "not a name!", "--steps", "1"], env, tmp_path)
    assert done.returncode == 2 and "neither an existing local path nor a valid Hugging Face hub name" in done.stderr


def test_a_cached_hub_tokenizer_loads_offline(tmp_path):
    """A hub name present in the local cache is accepted and loaded from it, with the hub unreachable."""
    snapshot = tmp_path / "hf" / "hub" / "models--acme--tiny-tok" / "snapshots" / ("0" * 40)
    build_bpe_tokenizer(["hello world", "a second document"] * 20, snapshot, vocab_size=300)
    repo = snapshot.parent.parent
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    # What the hub cache records after a download of a tokenizer-only repository: no config.json upstream.
    (repo / ".no_exist" / ("0" * 40)).mkdir(parents=True)
    (repo / ".no_exist" / ("0" * 40) / "config.json").touch()
    code = ("from sp_plan.runtime.text_data import load_tokenizer, tokenizer_source_problem as p; "
            "assert p('acme/tiny-tok') is None; t = load_tokenizer('acme/tiny-tok'); print(len(t), t.eos_token)")
    done = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path, HF_HUB_OFFLINE="1"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    size, eos = done.stdout.split()
    assert int(size) > 256 and eos == "<|endoftext|>"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_under_torchrun_the_reason_is_printed_once(tmp_path, docs):
    launcher = [*_torchrun(), "--standalone", "--nproc-per-node=2", "-m", "sp_plan.cli"]
    done, _ = _train(["--dataset", str(docs), "--tokenizer", "gpt2-typoo", "--steps", "1"],
                     _env(tmp_path, HF_HUB_OFFLINE="1"), tmp_path, launcher)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count("'gpt2-typoo' is not a local directory") == 1, out[-3000:]
    assert "exitcode  : 2" in out, out[-3000:]
