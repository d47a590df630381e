"""The archived Megatron-Bridge dense rows (source megatron-bridge-archive, issue 21): each release's H100/B200
Llama rows run with the layout, batch and sharding its table and recipe state, and compare like with like."""

import math

import pytest
from sp_plan.planner.fitting.fit import predict_all, profile_for
from sp_plan.planner.fitting.published import published_entries, published_runs
from sp_plan.planner.fitting.runs import predict

SOURCE = "megatron-bridge-archive"
#: The NeMo container releases the archive publishes dense H100/B200 rows for (26.04.01's are megatron-bridge-perf).
RELEASES = {"25.09", "25.11", "26.02", "26.02.01", "26.04", "26.06"}


@pytest.fixture(scope="module")
def archive():
    runs, _ = published_runs()
    entries = [e for e in published_entries()["throughput"] if e["source"] == SOURCE]
    made = [r for r in runs if r.source == SOURCE]
    assert len(made) == len(entries) == 20
    return list(zip(entries, made))


def test_every_row_runs_with_its_published_layout_and_batch(archive):
    """Degrees multiply to the GPUs, gradient accumulation is GBS / (MBS x DP), VP means interleaved 1F1B, a
    Megatron-FSDP row shards like ZeRO-3 and the others use the distributed optimizer (ZeRO-1)."""
    for entry, run in archive:
        assert entry["release"] in RELEASES and run.stack == "megatron-core"
        assert run.topology == {"h100": "dgx-h100", "b200": "dgx-b200"}[entry["system"]]
        lay = run.layout
        assert (lay.tp, lay.pp, lay.ring, lay.dp_shard) == (entry["tp"], entry["pipeline"], entry["ring"],
                                                           entry["dp_shard"])
        assert lay.world == entry["gpus"] == lay.tp * lay.pp * lay.ring * lay.dp_shard
        assert run.train.micro_batch == entry["micro_batch"]
        assert run.train.grad_accum * entry["micro_batch"] * entry["dp_shard"] == entry["global_batch"]
        assert run.train.zero_stage == entry.get("zero", 1)
        assert run.train.fp8_linears and run.train.checkpointing == "none"
        assert run.time_overrides == entry.get("stack_time", {})
        if entry.get("virtual_stages", 1) > 1:
            assert (run.train.pipeline_schedule, run.train.virtual_stages) == ("interleaved_1f1b",
                                                                               entry["virtual_stages"])


def test_rows_of_one_layout_in_several_releases_stay_separate_figures(archive):
    """The same layout measured in several releases (or in FP8-CS and MXFP8) is one figure per measurement."""
    ids = [run.id for _, run in archive]
    assert len(set(ids)) == len(ids)
    seventy = [e for e, _ in archive if e["model"] == "llama3.1-70b" and e["gpus"] == 64]
    assert sorted(e["release"] for e in seventy) == ["25.09", "25.11", "26.02", "26.02.01", "26.04"]
    b200_8b = [(e["release"], e["precision"]) for e, _ in archive if e["system"] == "b200" and e["gpus"] == 8]
    assert sorted(b200_8b) == [("25.09", "fp8"), ("25.09", "mxfp8"), ("25.11", "fp8"), ("25.11", "mxfp8")]


def test_exact_rows_state_every_degree_and_batch(archive):
    """confidence exact only where the table gives every degree and batch and the recipe agrees; the 25.11 H100
    8B row (table FSDP 8, recipe DDP with partial recompute) is ambiguous."""
    keys = ("gpus", "tp", "pipeline", "ring", "dp_shard", "micro_batch", "global_batch", "seq_len")
    for entry, _ in archive:
        assert all(k in entry for k in keys)
    ambiguous = [(e["release"], e["model"]) for e, _ in archive if e["confidence"] != "exact"]
    assert ambiguous == [("25.11", "llama3.1-8b")]


def test_the_sft_row_re_casts_fp8_weights_every_micro_batch(archive):
    """26.06's SFT recipe sets disable_parameter_transpose_cache, so Megatron-Core passes no is_first_microbatch and
    TE quantizes the weights on every micro-batch: the row turns the stack's FP8 weight cache off, which prices
    more cast time than the same run with the cache."""
    (entry, run), = [(e, r) for e, r in archive if e["gpus"] == 32]
    assert entry["stack_time"] == {"fp8_weight_cache": False} and run.train.grad_accum == 16
    cached = run.model_copy(update={"time_overrides": {}})
    assert predict(run, profile_for(run)) < predict(cached, profile_for(cached))


def test_flop_convention_matches_sp_plans_model_flops(archive):
    """Model TFLOP/s over tokens/s is Megatron-Bridge's FLOPs per token: sp-plan's model FLOPs per token agree
    within 4% on every archived row, so tokens/s compare like with like."""
    for entry, run in archive:
        as_tflops = run.model_copy(update={"metric": "tflops_per_gpu", "flop_convention": "model"})
        ours = predict(as_tflops, profile_for(run)) * 1e12 / predict(run, profile_for(run))
        theirs = entry["model_tflops"] * 1e12 / entry["value"]
        assert ours == pytest.approx(theirs, rel=0.04), run.id


def test_every_archived_row_gets_a_finite_prediction(archive):
    runs = [run for _, run in archive]
    for run, value in zip(runs, predict_all(runs)):
        assert math.isfinite(value) and value > 0, run.id
