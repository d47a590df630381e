"""Calibration rows from the runs users already make (issue 33, item 2).

One spawn of 2 gloo ranks trains the tiny HF Llama of ``tests/test_hf_trainer_integration.py`` inside
transformers' Trainer (``SequenceParallelTrainer(..., calibration_csv=)``, planned on the machine it probes) and
inside TRL's SFTTrainer (``CalibrationCallback`` added by hand, planned on the probed topology's file), and the
runtime's own ``Trainer(calibration_csv=)``: each appends one row; a bad path is refused on both ranks before
training. Then ``sp-plan train --record-calibration`` (one CPU rank) appends a fourth row, and the real console
script ``sp-plan calibrate`` fits the file as written, with no editing. Unit tests: rows for a preset plan
(header merge, existing rows kept), and every bad input is one line before training.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.distributed import error_of, run_ranks
from tests.test_hf_trainer_integration import ACCUM, LR, MICRO, SEED, SEQ, SFT_VOCAB, _dataset, _model

ROOT = Path(__file__).resolve().parents[1]
SP_PLAN = Path(sys.executable).with_name("sp-plan")
STEPS = 4  # two warm-up steps, two timed
TIMEOUT_S = 150


def _configure(vocab: int, layout: dict, topology=None):
    from sp_plan.runtime.auto import auto_configure

    return auto_configure(_model(vocab), seq_len=SEQ, micro_batch=MICRO, global_batch=MICRO * ACCUM, dtype="fp32",
                          topology=topology, fixed_layout=layout, fixed_options={"zero_stage": 2})


def _args(setup, out_dir: str, cls=None, **extra):
    from sp_plan.runtime.integrations.transformers import training_arguments
    from transformers import TrainingArguments

    return (cls or TrainingArguments)(**training_arguments(
        setup.plan, output_dir=out_dir, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        optim="adamw_torch", logging_steps=1, report_to=[], seed=SEED, disable_tqdm=True, use_cpu=True, **extra))


def _rank(rank: int, world: int, out_dir: str, tokenizer_dir: str | None) -> dict:
    import torch
    import torch.distributed as dist
    from sp_plan.runtime.integrations import CalibrationCallback, SequenceParallelTrainer

    csv_path, lines = f"{out_dir}/runs.csv", []
    result: dict = {}
    # 1. transformers' Trainer, planned on the machine auto_configure probes; the probed topology saved for 2.
    setup = _configure(128, {"ulysses": 2})
    topology_file = f"{out_dir}/probed.yaml"
    if rank == 0:
        from sp_plan.cost_models.topology.presets import save_topology

        save_topology(setup.probed_topology, topology_file)
    result["refused"] = error_of(lambda: SequenceParallelTrainer(
        setup, _args(setup, f"{out_dir}/bad"), train_dataset=_dataset(), calibration_csv="/proc/no/runs.csv"))
    trainer = SequenceParallelTrainer(setup, _args(setup, f"{out_dir}/hf"), train_dataset=_dataset() * 2,
                                      calibration_csv=csv_path)
    trainer.calibration.recorder.print_fn = lines.append
    trainer.train()
    result["hf"] = {"row": trainer.calibration.row, "steps": [m.step for m in trainer.calibration.steps]}
    dist.barrier()
    # 2. TRL's SFTTrainer, planned on that topology file, the callback added by hand (ring this time).
    if tokenizer_dir is not None:
        import datasets
        from sp_plan.runtime.integrations import SequenceParallelSFTTrainer
        from transformers import PreTrainedTokenizerFast
        from trl import SFTConfig

        setup = _configure(SFT_VOCAB, {"ring": 2}, topology=topology_file)
        words = ["sequence", "parallel", "ring", "ulysses", "token", "loss", "plan", "mesh", "shard", "gather"]
        texts = [" ".join(words[(i + j) % len(words)] for j in range(2 + i % 9)) for i in range(STEPS * ACCUM * 2)]
        callback = CalibrationCallback(csv_path, setup, topology=topology_file, print_fn=lines.append)
        trainer = SequenceParallelSFTTrainer(setup, _args(setup, f"{out_dir}/sft", SFTConfig, max_length=SEQ),
                                             train_dataset=datasets.Dataset.from_dict({"text": texts}),
                                             processing_class=PreTrainedTokenizerFast.from_pretrained(tokenizer_dir),
                                             callbacks=[callback])
        callback.bind(trainer)
        trainer.train()
        result["sft"] = {"row": callback.row}
    dist.barrier()
    # 3. The runtime's own Trainer (the hook `sp-plan train --record-calibration` uses), on the runtime's Llama.
    from sp_plan.cost_models.model_spec import ModelSpec
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.data import TokenWindows
    from sp_plan.runtime.models import LlamaModel
    from sp_plan.runtime.text_data import GlobalBatches
    from sp_plan.runtime.trainer import Trainer

    spec = ModelSpec(name="byte-llama-1x32", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                     ffn_hidden_size=64, vocab_size=259)
    torch.manual_seed(0)
    setup = auto_configure(LlamaModel(spec), seq_len=SEQ, micro_batch=MICRO, global_batch=MICRO, dtype="fp32",
                           topology=topology_file, fixed_layout={"ulysses": 2})
    data = GlobalBatches.for_setup(setup, TokenWindows(torch.randint(0, 259, (SEQ * 16,)), SEQ), seed=SEED)
    runtime = Trainer(setup, setup.make_optimizer(lr=LR), data, max_steps=STEPS, progress=False, log_every=0,
                      print_fn=lines.append, calibration_csv=csv_path, calibration_topology=topology_file)
    runtime.fit()
    result["runtime"] = {"row": runtime.calibration.row}
    result["lines"] = lines
    return result


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("calibration_rows")
    tokenizer_dir = None
    if importlib.util.find_spec("trl") is not None:
        from sp_plan.runtime.text_data import build_bpe_tokenizer

        tokenizer_dir = str(out_dir / "tokenizer")
        build_bpe_tokenizer(["sequence parallel ring ulysses token loss plan mesh shard gather"] * 4, tokenizer_dir,
                            vocab_size=300)
    results = run_ranks(2, _rank, str(out_dir), tokenizer_dir, timeout=TIMEOUT_S)
    return results, out_dir


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SP_PLAN), "calibrate", *args], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.multiproc
def test_trainer_sft_and_runtime_rows_are_written_by_rank0_and_fitted_by_calibrate(recorded, tmp_path):
    results, out_dir = recorded
    rank0, rank1 = results
    csv_path = out_dir / "runs.csv"
    # A bad path is refused on both ranks, before training, in one line.
    for r in results:
        assert r["refused"].startswith("RuntimeConfigError: ") and "/proc/no/runs.csv" in r["refused"], r["refused"]
        assert "\n" not in r["refused"]
    frameworks = ["transformers.Trainer", "trl.SFTTrainer", "sp-plan Trainer"]
    if "sft" not in rank0:
        frameworks.remove("trl.SFTTrainer")
    assert rank1["hf"]["row"] is None and rank1["runtime"]["row"] is None  # only rank 0 records
    assert rank0["hf"]["steps"] == list(range(1, STEPS + 1))
    rows = _rows(csv_path)
    assert [r["framework"] for r in rows] == frameworks
    for row in rows:
        assert float(row["step_s"]) > 0 and float(row["tps_per_gpu"]) > 0, row
        assert row["timed_steps"] == str(STEPS - 2) and row["warmup_steps"] == "2"
        assert row["peak_allocated_gib"] == "" and row["reserved_gib"] == ""  # CPU: no CUDA statistics, not invented
        assert float(row["peak_rss_gib"]) > 0 and row["gpus"] == "2" and row["stack"] == "sp-plan"
        tokens = int(row["seq_len"]) * int(row["micro_batch"]) * int(row["grad_accum"])  # SP only: dp = 1
        assert float(row["tps_per_gpu"]) == pytest.approx(tokens / float(row["step_s"]) / 2, rel=1e-4)
        assert Path(row["model"], "config.json").is_file() and Path(row["topology"]).is_file()
    assert rows[0]["ulysses"] == "2" and rows[-1]["dp_shard"] == "1"
    # Printed beside the plan's prediction.
    summary = [line for line in rank0["lines"] if line.startswith("calibration: ")]
    assert len(summary) == len(frameworks) and all("predicted" in s and "n/a on CPU" in s for s in summary)
    assert any(line.startswith("calibration step 3:") and "(plan " in line for line in rank0["lines"])

    # sp-plan train --record-calibration appends to the same file (one CPU rank, the runtime's Llama).
    train = subprocess.run(
        [str(SP_PLAN), "train", "--seq-len", "64", "--steps", str(STEPS), "--layers", "1", "--hidden", "32",
         "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--corpus", str(ROOT / "cost_models" / "strategies"),
         "--corpus-bytes", "20000", "--no-progress", "--log-every", "0", "--record-calibration", str(csv_path)],
        check=False, capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert train.returncode == 0, train.stderr[-3000:] + train.stdout[-3000:]
    assert "row appended to" in train.stdout + train.stderr
    rows = _rows(csv_path)
    assert len(rows) == len(frameworks) + 1 and rows[-1]["gpus"] == "1" and rows[-1]["seq_len"] == "64"

    # The real console script fits the file as written, and reports every row.
    out = tmp_path / "calibration.yaml"
    fitted = _calibrate(str(csv_path), "--out", str(out), "--json")
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    report = json.loads(fitted.stdout)
    errors = {e["metric"]: e for e in report["errors"]}
    assert errors["step_s (fitted on)"]["runs"] == len(rows), errors
    assert out.is_file()


def _preset_plan():
    """A plan for llama3-8b with Ulysses 8 on a DGX H100 (one estimate: the plan file's content, no search)."""
    from types import SimpleNamespace

    from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
    from sp_plan.cost_models.estimate import estimate
    from sp_plan.cost_models.topology import load_topology
    from sp_plan.planner.plan import plan_from_ranked

    topology, model = load_topology("dgx-h100", 8), get_model_preset("llama3-8b")
    train, layout = TrainSpec(seq_len=8192, checkpointing="full"), Layout(ulysses=8)
    ranked = SimpleNamespace(train=train, layout=layout, estimate=estimate(model, train, layout, topology))
    return plan_from_ranked(ranked, model, topology, 8)


@pytest.fixture(scope="module")
def preset_plan():
    return _preset_plan()


def test_rows_for_a_preset_plan_merge_into_an_existing_csv(preset_plan, tmp_path):
    from sp_plan.planner.fitting.user_runs import runs_from_csv
    from sp_plan.runtime.calibration_rows import CalibrationRecorder

    path = tmp_path / "runs.csv"
    path.write_text("model,seq_len,gpus,topology,ulysses,step_s,note\nllama3-8b,8192,8,dgx-h100,8,2.5,by hand\n")
    lines: list[str] = []
    recorder = CalibrationRecorder(path, preset_plan, device_type="cuda", device_name="NVIDIA H100 80GB HBM3",
                                   print_fn=lines.append, framework="test")
    for step, seconds in enumerate([9.0, 5.0, 2.0, 2.2, 2.1], start=1):
        recorder.record_step(step, seconds, allocated=(40 + step) << 30, reserved=(50 + step) << 30)
    row = recorder.finish()
    assert row["model"] == "llama3-8b" and row["topology"] == "dgx-h100" and row["step_s"] == pytest.approx(2.1)
    assert row["peak_allocated_gib"] == pytest.approx(45) and row["reserved_gib"] == pytest.approx(55)
    rows = _rows(path)
    assert rows[0]["note"] == "by hand" and rows[0]["step_s"] == "2.5" and rows[1]["note"] == ""
    assert rows[1]["id"].startswith("test: llama3-8b") and rows[1]["timed_steps"] == "3"
    runs = runs_from_csv(path, "sp-plan")
    mine = [r for r in runs if r.id.startswith("test:")]
    assert {r.metric for r in mine} == {"step_s", "tps_per_gpu", "allocated_gib", "reserved_gib"}
    run = mine[0]
    assert run.layout == preset_plan.layout and run.train == preset_plan.train and run.topology == "dgx-h100"
    assert any("measured/predicted" in line for line in lines[-1].splitlines())
    assert recorder.finish() is not None and len(_rows(path)) == 3  # a second run appends


def test_bad_input_is_one_line_before_training(preset_plan, tmp_path):
    from sp_plan.runtime.calibration_rows import CalibrationRecorder
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.integrations import CalibrationCallback

    def refused(**kwargs) -> str:
        with pytest.raises(RuntimeConfigError) as exc:
            CalibrationRecorder(kwargs.pop("path"), preset_plan, **kwargs)
        message = str(exc.value)
        assert "\n" not in message
        return message

    assert "not writable" in refused(path="/proc/runs.csv")
    assert "cannot create its folder" in refused(path="/proc/no/runs.csv")
    assert ".csv suffix" in refused(path=tmp_path / "runs.txt")
    assert "is a folder" in refused(path=tmp_path)
    notes = tmp_path / "notes.csv"
    notes.write_text("a,b\n1,2\n")
    assert "not a runs table" in refused(path=notes) and notes.read_text() == "a,b\n1,2\n"  # never overwritten
    assert "on CPU" in refused(path=tmp_path / "ok.csv", device_type="cpu")  # an H100 plan timed on CPU
    odd = preset_plan.model_copy(update={"hardware": preset_plan.hardware.model_copy(update={"topology": "my-lab"})})
    with pytest.raises(RuntimeConfigError, match="not a shipped preset"):
        CalibrationRecorder(tmp_path / "ok.csv", odd)
    with pytest.raises(RuntimeConfigError, match="plan the run follows"):
        CalibrationCallback(tmp_path / "ok.csv")
    with pytest.raises(RuntimeConfigError, match="not writable|cannot create") as exc:
        CalibrationCallback("/proc/x/runs.csv", plan=preset_plan)  # a plain Trainer's callback: at construction
    assert "\n" not in str(exc.value)
    # sp-plan train refuses before building anything, in one line, exit 2.
    done = subprocess.run([str(SP_PLAN), "train", "--steps", "1", "--record-calibration", "/proc/x/runs.csv"],
                          check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "/proc/x/runs.csv" in errors[0] and "Traceback" not in done.stderr, done.stderr
