"""The HF Ulysses blog rows of published.yaml (hf-ulysses-blog): how they are wired, and that one exact
source beside a chart-read one cannot ship a stack constant (docs/accuracy.md)."""

import pytest

from sp_plan.planner.fitting.fit import dependent_sources, fit
from sp_plan.planner.fitting.parameters import SHIPPED_MIN_SOURCES, published_fit_parameters
from sp_plan.planner.fitting.published import published_entries, published_runs

RUNS, _ = published_runs()
BLOG = [r for r in RUNS if r.source == "hf-ulysses-blog"]


def test_job_total_tokens_per_second_are_compared_per_gpu():
    entries = [e for e in published_entries()["throughput"] if e["source"] == "hf-ulysses-blog"]
    runs = [r for r in BLOG if r.kind == "throughput"]
    assert len(entries) == len(runs) == 4
    for entry, run in zip(entries, runs):
        assert entry["metric"] == "tps_total" and run.metric == "tps_per_gpu"
        assert run.value == pytest.approx(entry["value"] / entry["gpus"])
        assert run.train.grad_accum == 8 and run.layout.world == entry["gpus"]
        assert f"/ {entry['gpus']} GPUs" in run.assumed


def test_blog_runs_have_the_recipe_the_blog_states():
    """ZeRO-3 + CPU optimizer, HF checkpointing, no Liger (eager norms, SwiGLU, RoPE), no tiling or
    checkpoint offload, on the hf-deepspeed (DeepSpeed Ulysses) stack."""
    for run in BLOG:
        t = run.train
        assert run.stack == "hf-deepspeed" and run.model.name.startswith("qwen3-4b")
        assert (t.zero_stage, t.offload_optimizer, t.checkpointing) == (3, True, "full")
        assert not (t.tiled_mlp or t.tiled_loss or t.offload_checkpoints)
        assert run.memory_overrides == {"norm_implementation": "eager", "mlp_implementation": "eager",
                                        "rope_implementation": "eager"}
        assert run.layout.ulysses == run.layout.world


def test_one_exact_source_beside_a_chart_reading_ships_no_stack_constant():
    """hf-deepspeed's time figures come from this blog (ambiguous: how tokens/s was measured is not stated) and
    from the DeepSpeed-Ulysses blog's charts (figure): both have weight 0 and constrain nothing. Were the blog's
    rows exact, only they would count (a chart reading does not make a second source), so the shipped fit
    (two sources required) would still keep the stack file's priors."""
    runs = [r for r in RUNS if r.stack == "hf-deepspeed" and r.kind == "throughput"]
    params = [p for p in published_fit_parameters() if p.stack == "hf-deepspeed"]
    assert {r.confidence for r in runs} == {"ambiguous", "figure"}
    assert all(not sources for sources in dependent_sources(runs, params).values())
    promoted = [r.model_copy(update={"confidence": "exact"}) if r.source == "hf-ulysses-blog" else r for r in runs]
    depends = dependent_sources(promoted, params)
    assert all(depends[p.name] == {"hf-ulysses-blog"} for p in params)  # the chart reading is not counted ...
    assert fit(promoted, params, min_sources=SHIPPED_MIN_SOURCES).as_dict() == {}  # ... so nothing ships
    assert fit(promoted, params, min_sources=1).as_dict()  # while one exact source alone would move them
