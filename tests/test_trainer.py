"""sp_plan.runtime.trainer.Trainer: telemetry (printed lines, JSON lines, TensorBoard scalars, CPU memory, profiled
live bytes), achieved model FLOP/s and MFU from the plan's FLOPs and peak (n/a on CPU), and exit signals:
SIGTERM (twice) on one rank stops every rank after the same step with a checkpoint, from which a resumed
run continues exactly; a second SIGINT interrupts at once."""

from __future__ import annotations

import json
import math
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_checkpoint import configure, trainer_for


def _telemetry_rank(rank: int, world: int, root: str) -> dict:
    lines: list[str] = []
    setup = configure({}, {"zero_stage": 3})
    trainer = trainer_for(setup, steps=3, log_every=1, live_bytes_every=2, print_fn=lines.append,
                          tensorboard_dir=os.path.join(root, "tb"), metrics_file=os.path.join(root, "metrics.jsonl"))
    fit = trainer.fit()
    # A second SIGINT while the first is pending interrupts at once (the previous handler: KeyboardInterrupt).
    interrupted = "no"
    setup = configure({}, {"zero_stage": 3})
    twice = trainer_for(setup, steps=3, checkpoint_dir=os.path.join(root, "ckpt"),
                        on_step=lambda t, r: [os.kill(os.getpid(), signal.SIGINT) for _ in range(2)])
    try:
        twice.fit()
    except KeyboardInterrupt:
        interrupted = "KeyboardInterrupt"
    return {"lines": lines, "losses": fit.losses, "records": [r.memory for r in fit.records],
            "interrupted": interrupted,
            "sigint_restored": signal.getsignal(signal.SIGINT) is signal.default_int_handler}


@pytest.fixture(scope="module")
def telemetry(tmp_path_factory):
    root = tmp_path_factory.mktemp("telemetry")
    return root, run_ranks(1, _telemetry_rank, str(root), timeout=180)[0]


@pytest.mark.multiproc
def test_telemetry_is_printed_and_logged(telemetry):
    root, out = telemetry
    lines = [ln for text in out["lines"] for ln in text.splitlines()]
    assert lines[0].startswith("MFU n/a: the plan's peak is h100-80gb's")  # a GPU plan run on CPU: said so
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in steps] == ["step 1", "step 2", "step 3"]
    assert all("tok/s" in ln and "FLOP/s/rank" in ln and "RSS" in ln and "lr " in ln and "grad norm" in ln
               for ln in steps)
    assert "live tensors" in steps[1] and "live tensors" not in steps[0]
    assert any(ln.startswith("done: 3 steps") for ln in lines)
    assert any(ln.startswith("telemetry: model ") and "MFU n/a" in ln and "peak RSS" in ln and "peak live tensors" in ln
               for ln in lines)
    records = [json.loads(ln) for ln in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["loss"] for r in records] == out["losses"]  # exact floats
    assert all(r["memory"]["rss"] > 0 and r["memory"]["peak_rss"] >= r["memory"]["rss"] for r in records)
    assert records[1]["memory"]["live_peak"] > 0 and "live_peak" not in records[0]["memory"]
    assert all(r["mfu"] is None and r["tokens_per_s"] > 0 and r["model_flops_per_s"] > 0 for r in records)


@pytest.mark.multiproc
def test_tensorboard_scalars(telemetry):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, out = telemetry
    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "train/lr", "train/grad_norm", "train/model_flops_per_s_per_rank",
            "memory/rss_bytes"} <= tags
    losses = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert losses == pytest.approx(out["losses"], rel=1e-6)  # stored as float32


@pytest.mark.multiproc
def test_a_second_sigint_interrupts_at_once(telemetry):
    _, out = telemetry
    assert out["interrupted"] == "KeyboardInterrupt" and out["sigint_restored"]


def test_mfu_is_the_plans_model_flops_over_time_and_peak():
    from sp_plan.cost_models import ModelSpec, TrainSpec
    from sp_plan.cost_models.flops import model_flops_per_step
    from sp_plan.cost_models.topology import load_topology
    from sp_plan.runtime.auto import plan_for
    from sp_plan.runtime.step import StepResult
    from sp_plan.runtime.trainer import Telemetry, mfu_basis

    spec = ModelSpec(name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=300)
    plan = plan_for(spec, TrainSpec(seq_len=1024, dtype="fp32"), load_topology("dgx-h100", 2), 2,
                    fixed_layout={"ulysses": 2})
    gpu_setup = SimpleNamespace(plan=plan, device=torch.device("cuda"))
    flops, peak, note = mfu_basis(gpu_setup)
    assert flops == model_flops_per_step(plan.model, plan.train, plan.layout) > 0
    assert peak == plan.estimate["time"]["peak_flops"] and "h100-80gb" in note and "datasheet" in note
    telemetry = Telemetry(gpu_setup, total_steps=1, progress=False, log_every=0)
    telemetry.cuda = False  # no CUDA here: the arithmetic is what is tested
    step = StepResult(loss=2.0, tokens=2048, micro_batch_losses=[2.0], seconds=0.5)
    record = telemetry.record(1, step, 1e-3, [])
    assert math.isclose(record.model_flops_per_s, flops / (0.5 * 2))  # per rank: the plan's 2 ranks
    assert math.isclose(record.mfu, flops / (0.5 * 2 * peak))
    assert record.tokens_per_s == 4096
    # On CPU there is no per-rank peak (ranks share cores): MFU is n/a, the achieved FLOP/s are still reported.
    cpu_plan = plan.model_copy(update={"hardware": plan.hardware.model_copy(update={"gpu": "cpu-test"})})
    for p in (plan, cpu_plan):
        flops_cpu, peak_cpu, note_cpu = mfu_basis(SimpleNamespace(plan=p, device=torch.device("cpu")))
        assert flops_cpu == flops and peak_cpu is None and note_cpu.startswith("MFU n/a")
    assert "ranks share cores" in mfu_basis(SimpleNamespace(plan=cpu_plan, device=torch.device("cpu")))[2]
    cpu = Telemetry(SimpleNamespace(plan=cpu_plan, device=torch.device("cpu")), total_steps=1, progress=False,
                    log_every=0).record(1, step, 1e-3, [])
    assert cpu.mfu is None and math.isclose(cpu.model_flops_per_s, record.model_flops_per_s)


def test_a_data_source_without_a_position_is_refused():
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.trainer import Trainer

    with pytest.raises(RuntimeConfigError, match="next_step"):
        Trainer(SimpleNamespace(), None, [torch.zeros(2)], max_steps=1)


def _sigterm_rank(rank: int, world: int, root: str) -> dict:
    reference = trainer_for(configure({"ring": 2}, {"zero_stage": 2})).fit()

    def terminate(trainer, record):
        # Rank 1 only, once step 1 is done, twice (launchers repeat it): step 2 (in progress) finishes, and
        # every rank stops after it (the flag is all-reduced with step 2's telemetry).
        if record.step == 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    stopped = trainer_for(configure({"ring": 2}, {"zero_stage": 2}), checkpoint_dir=root, on_step=terminate).fit()
    restored = signal.getsignal(signal.SIGTERM) == before
    resumed = trainer_for(configure({"ring": 2}, {"zero_stage": 2}), checkpoint_dir=root, resume=True).fit()
    return {"reference": reference.losses, "stopped_by": stopped.stopped_by, "stopped_at": stopped.step,
            "checkpoint": str(stopped.checkpoint), "restored": restored, "resumed_from": str(resumed.resumed_from),
            "resumed": resumed.losses, "start": resumed.start_step}


@pytest.mark.multiproc
def test_sigterm_stops_every_rank_after_the_step_saves_and_resumes_exactly(tmp_path):
    results = run_ranks(2, _sigterm_rank, str(tmp_path / "ckpt"), timeout=180)
    for out in results:
        assert out["stopped_by"] == "SIGTERM" and out["stopped_at"] == 2, out
        assert out["checkpoint"].endswith("step_00000002") and out["restored"]
        assert out["resumed_from"].endswith("step_00000002") and out["start"] == 2
        assert out["resumed"] == out["reference"][2:]


def _poison(setup, rank: int, steps: set[int], trainer_step: list[int], on_rank: int = 1):
    """Make this rank's embedding output NaN during the given (1-based) steps: a bad batch or an overflow
    on one rank only."""
    embedding = next(m for m in setup.model.modules() if isinstance(m, torch.nn.Embedding))

    def hook(module, args, output):
        return output * float("nan") if rank == on_rank and trainer_step[0] + 1 in steps else output
    embedding.register_forward_hook(hook)


def _nonfinite_rank(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, poisoned, kwargs in [("one", {2}, {}), ("stop", {2, 3, 4}, {"checkpoint_dir": os.path.join(root, "ckpt")}),
                                   ("unguarded", {2}, {"skip_nonfinite": False})]:
        setup = configure({"ring": 2}, {"zero_stage": 2})
        current = [0]
        _poison(setup, rank, poisoned, current)
        sums = {}

        def on_step(trainer, record, sums=sums, current=current):
            current[0] = record.step
            sums[record.step] = sum(float(p.detach().double().sum()) for p in trainer.setup.model.parameters())

        trainer = trainer_for(setup, steps=6, on_step=on_step, **kwargs)
        fit = trainer.fit()
        out[name] = {"skipped": fit.skipped_steps, "stopped_by": fit.stopped_by, "step": fit.step, "sums": sums,
                     "lrs": [r.lr for r in fit.records], "losses": fit.losses,
                     "checkpoint": str(fit.checkpoint) if fit.checkpoint else None}
    return out


@pytest.mark.multiproc
def test_non_finite_steps_are_skipped_on_every_rank_and_stop_training(tmp_path):
    """A NaN on one rank's forward (rank 1 only) makes every rank skip that optimizer step: the weights and
    the learning-rate schedule stay as they were and training goes on. Three such steps in a row stop
    training with a checkpoint of the last finite weights. Without the guard the weights turn NaN."""
    results = run_ranks(2, _nonfinite_rank, str(tmp_path), timeout=240)
    for out in results:
        one = out["one"]
        assert one["skipped"] == [2] and one["stopped_by"] is None and one["step"] == 6
        assert one["sums"][2] == one["sums"][1] and one["sums"][3] != one["sums"][2]  # step 2 not applied
        assert one["lrs"][2] == one["lrs"][1]  # the warm-up did not advance on the skipped step
        assert math.isnan(one["losses"][1]) and all(math.isfinite(v) for i, v in enumerate(one["losses"]) if i != 1)

        stop = out["stop"]
        assert stop["skipped"] == [2, 3, 4] and stop["stopped_by"] == "non-finite" and stop["step"] == 4
        assert stop["sums"][4] == stop["sums"][1] and math.isfinite(stop["sums"][4])
        assert stop["checkpoint"].endswith("step_00000004")

        unguarded = out["unguarded"]
        assert unguarded["skipped"] == [] and math.isnan(unguarded["sums"][2]) and math.isnan(unguarded["sums"][6])
    # Every rank saw the same (global) losses: the same steps were skipped everywhere.
    assert results[0]["one"]["losses"][2:] == results[1]["one"]["losses"][2:]
