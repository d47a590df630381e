"""The published GPU memory figures (cost_models/data/calibration/published.yaml) against the model, under
the stack each source ran: regression guards at the accuracy reached (docs/memory_model.md, "Accuracy").

What a figure means decides what is compared: NVML's used memory is what the caching allocator holds at
its high-water mark plus the CUDA context and NCCL (``memory.device_used``); torchtitan's "Memory(GiB)"
is torch.cuda.max_memory_reserved (``detail.overhead.peak_reserved``); a max length is the longest
sequence that ran (the model's answer must not be far below it, and not far above where the source ran
into the GPU limit)."""

import pytest

from sp_plan.cost_models.profile import resolve_profile
from sp_plan.cost_models.units import GiB
from sp_plan.planner.fitting.published import published_runs
from sp_plan.planner.fitting.runs import _estimate, max_seq_len, run_topology

RUNS, _ = published_runs()
EXACT_MEMORY = [r for r in RUNS if r.kind == "memory" and r.confidence == "exact"]
#: Accuracy reached on the exact memory figures (largest |error| 3.8%); the test allows 5%.
MEMORY_TOLERANCE = 0.05


def _profile(run, **assume):
    gpu = run_topology(run.topology, run.layout.world).gpu.name
    return resolve_profile(gpu, run.stack, assume={**run.memory_overrides, **assume} or None)


def predicted_memory(run, **assume) -> float:
    est = _estimate(run, _profile(run, **assume))
    if run.metric == "nvml_used_gib":
        return est.memory.device_used / GiB
    if run.metric == "reserved_gib":
        return est.detail.overhead.peak_reserved / GiB
    if run.metric == "hbm_gb":
        return est.memory.device_used / 1e9
    raise AssertionError(run.metric)


def test_there_are_exact_memory_figures_from_two_sources():
    assert len(EXACT_MEMORY) >= 5
    assert {r.source for r in EXACT_MEMORY} >= {"arctic-recipes", "torchtitan-h100"}


@pytest.mark.parametrize("run", EXACT_MEMORY, ids=lambda r: r.id)
def test_exact_memory_figures_within_tolerance(run):
    predicted = predicted_memory(run)
    assert abs(predicted / run.value - 1) <= MEMORY_TOLERANCE, (predicted, run.value)


def test_shipped_allocator_slack_is_the_least_squares_fit_and_holds_out():
    """allocator_slack_fraction is the one fitted memory constant: the relative-error least-squares fit
    over the exact figures (linear in it) must stay what the stacks ship (0.13), and fitted on one source
    it must predict the other within 6%."""
    rows = []
    for run in EXACT_MEMORY:
        p0, p1 = predicted_memory(run, allocator_slack_fraction=0.0), predicted_memory(run, allocator_slack_fraction=0.1)
        rows.append((run.source, run.value, p0, (p1 - p0) / 0.1))

    def fit(subset):
        return sum((m - p) * k / m**2 for _, m, p, k in subset) / sum(k * k / m**2 for _, m, p, k in subset)

    shipped = {_profile(r).memory.allocator_slack_fraction for r in EXACT_MEMORY}
    assert shipped == {0.13}
    assert fit(rows) == pytest.approx(0.13, abs=0.01)
    for source in {r[0] for r in rows}:
        f = fit([r for r in rows if r[0] != source])
        for _, m, p, k in (r for r in rows if r[0] == source):
            assert abs((p + f * k) / m - 1) <= 0.06


FACTORY = [r for r in RUNS if r.kind == "max_length" and r.source == "factory-360"]


@pytest.mark.parametrize("run", FACTORY, ids=lambda r: r.id)
def test_360_llama_factory_max_lengths_within_15_percent(run):
    predicted = max_seq_len(run, _profile(run))
    assert abs(predicted / run.value - 1) <= 0.15, predicted


def test_alst_gpu_bound_lengths_are_no_longer_far_over():
    """Qwen3-32B with the ALST recipe on 16-64 GPUs ran out of GPU memory (NV ~71 GiB of 79.6 at the
    published lengths): the model's limit sits 18-30% above the published (lower-bound) lengths, where it
    was 32-56% above before the GPU-realism terms. Guard the improvement."""
    for run in RUNS:
        if run.kind == "max_length" and run.source == "arctic-recipes" and run.model.name.startswith("qwen3") \
                and run.layout.world >= 16:
            ratio = max_seq_len(run, _profile(run)) / run.value
            assert 1.0 <= ratio <= 1.35, (run.id, ratio)


BLOG_MAX = [r for r in RUNS if r.kind == "max_length" and r.source == "hf-ulysses-blog"]


def test_ulysses_blog_max_length_lies_in_the_published_bracket():
    """The HF Ulysses blog's Qwen3-4B SP=4 run (4 x H100, ZeRO-3 + CPU Adam, HF checkpointing, no Liger or
    tiling) ran at 96K (98,304) and ran out of GPU memory at 128K (131,072): a limit bracketed on both sides.
    The model's longest fitting length, layout and options as the run had them, must fall inside it."""
    (run,) = BLOG_MAX
    predicted = max_seq_len(run, _profile(run))
    assert run.value <= predicted < 131072, predicted
