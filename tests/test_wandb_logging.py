"""Telemetry through ``logging`` and Weights & Biases.

- The ``sp_plan`` logger hierarchy: INFO lines are the program's output (bare, on stdout), other levels
  carry their level; rank 0 only unless every rank is asked for (then prefixed); ``--log-level``.
- W&B for real, offline: ``sp-plan train --wandb-project`` through the console script with
  ``WANDB_MODE=offline`` and ``WANDB_DIR=tmp_path``; the run file wandb writes (its record log,
  ``run-<id>.wandb``) is read back and every step's loss, tokens/s, step time, predicted step time and
  memory must be there, equal to the JSON lines the same run wrote (``--metrics-file``). Skipped where
  ``wandb`` (the ``[wandb]`` extra, not in ``[test]``: about 60 MB) is not installed.
- Without the package, the flag is one usage line (exit 2) before any work.
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sp_plan.runtime.log import configure_logging, get_logger

SCRIPT = str(Path(sys.executable).parent / "sp-plan")
TINY = ["--seq-len", "128", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--corpus-bytes", "100000", "--no-progress", "--log-every", "1"]


@pytest.fixture
def restore_sp_plan_logger():
    logger = logging.getLogger("sp_plan")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.mark.parametrize("rank, all_ranks, shown", [("0", False, True), ("1", False, False), ("1", True, True)])
def test_lines_are_rank_0_only_unless_every_rank_is_asked(rank, all_ranks, shown, monkeypatch,
                                                          restore_sp_plan_logger):
    monkeypatch.setenv("RANK", rank)
    out = io.StringIO()
    configure_logging("info", all_ranks=all_ranks, stream=out)
    get_logger("sp_plan.runtime.trainer").info("step 1 | loss 2.0")
    get_logger("sp_plan.runtime.trainer").warning("slow")
    expected = "step 1 | loss 2.0\nwarning: slow\n"
    if all_ranks:
        expected = f"[rank {rank}] step 1 | loss 2.0\n[rank {rank}] warning: slow\n"
    assert out.getvalue() == (expected if shown else "")


def test_the_level_filters(monkeypatch, restore_sp_plan_logger):
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    configure_logging("warning", stream=out)
    get_logger("sp_plan.runtime.train_run").info("plan: ...")
    get_logger("sp_plan.runtime.train_run").error("bad")
    assert out.getvalue() == "error: bad\n"
    with pytest.raises(ValueError, match="not one of debug, info, warning, error"):
        configure_logging("loud")


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a LevelDB-style log (7-byte file header ``:W&B``, 32 KiB
    blocks, each record a 7-byte header (crc32, length, type: full/first/middle/last) plus its data)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, header = 32768, 7
    pos, pending = header, b""
    while pos + header <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if left < header or (kind == 0 and length == 0):  # block trailer / padding
            pos += left
            continue
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            raw, pending = pending + chunk, b""
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            yield record
        else:
            pending = chunk if kind == 2 else pending + chunk


@pytest.mark.timeout(180)
def test_wandb_offline_run_has_every_steps_telemetry(tmp_path):
    pytest.importorskip("wandb")
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([SCRIPT, "--log-level", "warning", "train", "--steps", "3", *TINY, "--wandb-project",
                           "sp-plan-test", "--metrics-file", str(metrics)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 1 |" not in done.stdout and "done:" not in done.stdout  # --log-level warning: no INFO lines
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history, config = {}, {}
    for record in _wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    expected = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sorted(history) == [1, 2, 3]
    for rec in expected:
        row = history[rec["step"]]
        assert row["train/loss"] == pytest.approx(rec["loss"], rel=1e-12)
        assert row["train/tokens_per_s"] == pytest.approx(rec["tokens_per_s"], rel=1e-12)
        assert row["train/step_seconds"] == pytest.approx(rec["seconds"], rel=1e-12)
        assert row["train/predicted_step_seconds"] > 0
        assert row["memory/rss_bytes"] == rec["memory"]["rss"] and row["memory/peak_rss_bytes"] > 0
    assert config["layout"]["ulysses"] * config["layout"]["ring"] >= 1 and config["predicted_step_s"] > 0


def test_wandb_flag_without_the_package_is_one_usage_line(tmp_path):
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}
    done = subprocess.run([SCRIPT, "train", "--steps", "1", "--wandb-project", "x"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--wandb-project needs the wandb package: pip install 'sp-plan[wandb]'" in done.stderr
    assert "Traceback" not in done.stderr and "step 1" not in done.stdout
