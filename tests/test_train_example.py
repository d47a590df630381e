"""examples/train_long_context.py runs under torchrun on CPU with a plan file, as `sp-plan export --to
torchrun` launches it (2 gloo ranks, tiny model, a handful of steps over the stdlib corpus); and on a
Hugging Face dataset with a tokenizer (both local), where a run whose rank is SIGKILLed mid-run resumes
from its last complete checkpoint bit-exactly (losses and every saved tensor equal an uninterrupted
run's), reusing the checkpoint's plan, and a 1-rank launch resumes the 2-rank checkpoint (resharded)
with the loss curve continuing within 1e-4."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import sysconfig
import time
import uuid

import pytest
import torch

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec
from sp_plan.cost_models.topology import load_topology

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_example_trains_from_a_plan_file(tmp_path):
    from sp_plan.planner.export import to_torchrun
    from sp_plan.runtime.auto import plan_for

    spec = ModelSpec(name="byte-llama-tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_hidden_size=128, vocab_size=259)
    plan = plan_for(spec, TrainSpec(seq_len=512, dtype="fp32"), load_topology("dgx-h100", 2), 2,
                    fixed_layout={"ring": 2})
    path = tmp_path / "plan.yaml"
    plan.save(path)
    command = to_torchrun(plan, str(path)).content
    assert "-m sp_plan.cli train --plan" in command  # the installed entry point this example wraps
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/train_long_context.py", "--plan", str(path), "--steps", "4", "--corpus-bytes", "200000"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "plan: ring=2 on 2 rank(s) for byte-llama-tiny" in out
    match = re.search(r"done: 4 steps .* loss ([\d.]+) -> ([\d.]+); ([\d,]+) tokens/s", out)
    assert match, out[-2000:]
    assert float(match.group(2)) < float(match.group(1))  # it learns
    assert int(match.group(3).replace(",", "")) > 0


def test_example_refuses_a_plan_the_runtime_cannot_run(tmp_path):
    from sp_plan.planner.plan import Hardware, Plan

    spec = ModelSpec(name="t", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=259)
    plan = Plan(model=spec, train=TrainSpec(seq_len=256, zero_stage=0), layout=Layout(),
                hardware=Hardware(num_gpus=1, gpus_per_node=1, gpu="h100-80gb", topology="dgx-h100"))
    path = tmp_path / "plan.yaml"
    plan.save(path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "examples/train_long_context.py", "--plan", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "zero_stage=0" in done.stderr and "DDP" in done.stderr



@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_example_trains_a_hugging_face_model_with_tensor_parallelism():
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/train_long_context.py", "--hf", "--tp", "2", "--tiled-mlp", "--layers", "2", "--hidden", "64",
           "--ffn", "128", "--seq-len", "512", "--steps", "4", "--corpus-bytes", "200000", "--topology", "dgx-h100"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert re.search(r"plan: tp=2 on 2 rank\(s\) for llama-2l-64h", out), out[-2000:]
    match = re.search(r"done: 4 steps .* loss ([\d.]+) -> ([\d.]+);", out)
    assert match and float(match.group(2)) < float(match.group(1)), out[-2000:]


# ----- real data, a killed rank, resume -----------------------------------------------------------------------

#: The tiny text model every launch below trains (ring 2 on 2 ranks unless a launch says otherwise).
TEXT_ARGS = ["--seq-len", "256", "--layers", "2", "--hidden", "64", "--ffn", "128", "--topology", "dgx-h100",
             "--no-progress", "--log-every", "0", "--lr", "3e-3"]
REFERENCE_STEPS = 12
LAYOUT_STEPS = 14


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    """A BPE tokenizer trained on 30 stdlib modules, and those modules as a JSON-lines dataset."""
    pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    from sp_plan.runtime.text_data import build_bpe_tokenizer

    root = tmp_path_factory.mktemp("text-example")
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = [f.read_text(errors="replace") for f in sorted(stdlib.glob("*.py"))[:30]]
    build_bpe_tokenizer(docs, root / "tokenizer", vocab_size=300)
    with open(root / "stdlib.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return root


def _text_command(root, *extra, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "examples/train_long_context.py", "--dataset", str(root / "stdlib.jsonl"), "--tokenizer",
            str(root / "tokenizer"), "--data-cache", str(root / "packed"), *TEXT_ARGS, *extra]


def _env(root, **extra) -> dict[str, str]:
    """Offline, with the datasets cache (the JSON files' Arrow conversion) under the test's directory."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                HF_DATASETS_CACHE=str(root / "hf-datasets"), **extra)


def _run(cmd, env, timeout=150) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _metrics(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, pathlib.Path(path).read_text().splitlines())}


def _pids_with(marker: str, rank: int) -> list[int]:
    """Processes started with SP_PLAN_TEST_RUN=marker and RANK=rank in their environment (torchrun's workers)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SP_PLAN_TEST_RUN={marker}".encode() in env and f"RANK={rank}".encode() in env:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def killed_and_resumed(text_corpus, tmp_path_factory):
    from sp_plan.runtime.checkpoint import latest_checkpoint

    root = text_corpus
    work = tmp_path_factory.mktemp("killed")
    env = _env(root)
    # 1. the uninterrupted run (checkpoints at 6, 12 and 14 for the comparisons)
    reference = _run(_text_command(root, "--ring", "2", "--steps", str(LAYOUT_STEPS), "--checkpoint-dir",
                                   str(work / "reference"), "--save-every", "6", "--keep-checkpoints", "3",
                                   "--metrics-file", str(work / "reference.jsonl")), env)
    # 2. the same run (asked for far more steps), rank 1 SIGKILLed once a checkpoint at step >= 4 is complete
    marker = uuid.uuid4().hex
    killed_dir = work / "killed"
    job = subprocess.Popen(_text_command(root, "--ring", "2", "--steps", "1000", "--checkpoint-dir", str(killed_dir),
                                         "--save-every", "2"),
                           cwd=ROOT, env=_env(root, SP_PLAN_TEST_RUN=marker), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while (latest_checkpoint(killed_dir) is None or int(latest_checkpoint(killed_dir).name[5:]) < 4) \
                and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        victims = _pids_with(marker, 1)
        assert job.poll() is None and len(victims) == 1, (job.poll(), victims)
        os.kill(victims[0], signal.SIGKILL)
        killed_out, _ = job.communicate(timeout=90)  # torchrun stops the surviving rank and fails
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    latest = latest_checkpoint(killed_dir)
    # 3. resume on the same layout, no pins: the checkpoint's plan is reused
    resumed = _run(_text_command(root, "--steps", str(REFERENCE_STEPS), "--checkpoint-dir", str(killed_dir),
                                 "--resume", "--metrics-file", str(work / "resumed.jsonl")), env)
    return {"work": work, "reference": reference, "killed_code": job.returncode, "killed_out": killed_out,
            "latest_after_kill": latest, "resumed": resumed}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the rank to kill through /proc (Linux)")
def test_a_killed_run_resumes_bit_exactly(killed_and_resumed):
    from sp_plan.runtime.checkpoint import load_full_state_dict

    r = killed_and_resumed
    work, latest = r["work"], r["latest_after_kill"]
    assert r["killed_code"] != 0, r["killed_out"][-2000:]  # the job died
    killed_at = int(latest.name[5:])
    assert 4 <= killed_at < REFERENCE_STEPS, killed_at
    out = r["resumed"]
    assert "(the plan of the checkpoint being resumed)" in out and "plan: ring=2 on 2 rank(s)" in out, out[-2000:]
    assert f"resumed from {latest} at step {killed_at} (same layout: exact continuation)" in out
    assert re.search(r"data: \d+ documents .*stdlib.jsonl.*rows of 256", out), out[-2000:]
    reference, resumed = _metrics(work / "reference.jsonl"), _metrics(work / "resumed.jsonl")
    assert sorted(resumed) == list(range(killed_at + 1, REFERENCE_STEPS + 1))
    assert {s: reference[s] for s in resumed} == resumed  # bit-exact losses
    assert reference[REFERENCE_STEPS] < reference[1] - 0.5  # it learns
    for prefix in ("model", "optim"):
        ref = load_full_state_dict(work / "reference" / f"step_{REFERENCE_STEPS:08d}", prefix=prefix)
        got = load_full_state_dict(work / "killed" / f"step_{REFERENCE_STEPS:08d}", prefix=prefix)
        assert ref.keys() == got.keys()
        assert [k for k in ref if not torch.equal(ref[k], got[k])] == []


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the rank to kill through /proc (Linux)")
def test_a_two_rank_checkpoint_resumes_on_one_rank(killed_and_resumed, text_corpus):
    work = killed_and_resumed["work"]
    out = _run(_text_command(text_corpus, "--steps", str(LAYOUT_STEPS), "--checkpoint-dir", str(work / "killed"),
                             "--resume", "--metrics-file", str(work / "one-rank.jsonl"), nproc=1), _env(text_corpus))
    assert "plan: single device on 1 rank(s)" in out or "on 1 rank(s)" in out, out[-2000:]
    assert "saved on 2 rank(s) as ring=2, resharded" in out, out[-2000:]
    reference, one = _metrics(work / "reference.jsonl"), _metrics(work / "one-rank.jsonl")
    assert sorted(one) == list(range(REFERENCE_STEPS + 1, LAYOUT_STEPS + 1))
    assert max(abs(one[s] - reference[s]) for s in one) < 1e-4, (one, reference)


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_long_context", ROOT / "examples" / "train_long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_refuses_bad_data_arguments(text_corpus, tmp_path, capsys):
    from sp_plan.runtime.errors import RuntimeConfigError

    example = _example_module()
    with pytest.raises(RuntimeConfigError, match="dataset path .*missing.jsonl does not exist"):
        example.main(["--dataset", str(tmp_path / "missing.jsonl"), "--tokenizer", str(text_corpus / "tokenizer")])
    with pytest.raises(RuntimeConfigError, match="tokenizer path .* does not exist"):
        example.main(["--dataset", str(text_corpus / "stdlib.jsonl"), "--tokenizer", str(tmp_path / "nope")])
    for argv, message in ((["--tokenizer", "tok/"], "--dataset and --tokenizer go together"),
                          (["--resume"], "--resume and --resume-or-start need --checkpoint-dir")):
        with pytest.raises(SystemExit):
            example.parse_args(argv)
        assert message in capsys.readouterr().err
