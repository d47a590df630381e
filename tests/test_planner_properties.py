"""Planner invariants over random models, sequences and clusters (hypothesis)."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sp_plan.cost_models import CostModelError, Layout, ModelSpec, TrainSpec
from sp_plan.cost_models.estimate import offload_capacity
from sp_plan.cost_models.memory import MemoryAssumptions, memory_core
from sp_plan.cost_models.topology import default_topology
from sp_plan.planner.search import PlanSettings, search

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def models(draw):
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * group
    head_dim = draw(st.sampled_from([64, 128]))
    hidden = heads * head_dim
    return ModelSpec(
        name="random",
        num_layers=draw(st.integers(1, 48)),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=hidden * draw(st.sampled_from([2, 3, 4])),
        vocab_size=draw(st.sampled_from([32000, 128256])),
        tied_embeddings=draw(st.booleans()),
    )


clusters = st.sampled_from([(1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (32, 8), (4, 2), (24, 8)])
seq_lens = st.sampled_from([256, 1024, 8192, 32 * 1024, 128 * 1024, 1 << 20])
modes = st.sampled_from(["train", "prefill"])


@SETTINGS
@given(model=models(), cluster=clusters, seq=seq_lens, mode=modes, gpu=st.sampled_from(["h100-80gb", "a100-40gb"]))
def test_every_plan_is_valid_fits_and_is_sorted(model, cluster, seq, mode, gpu):
    gpus, per_node = cluster
    topology = default_topology(gpu, gpus, per_node)
    plan_settings = PlanSettings(top_k=4)
    result = search(model, TrainSpec(seq_len=seq, mode=mode), topology, plan_settings)
    scores = [p.score for p in result.plans]
    assert scores == sorted(scores)
    for plan in result.plans:
        layout = plan.layout
        assert layout.world == gpus
        assert math.prod(layout.degrees().values()) == gpus
        layout.check_against(model, plan.train.seq_len, plan.train.tp_sequence_parallel)  # raises if invalid
        assert layout.tp <= topology.gpus_per_node and topology.gpus_per_node % layout.tp == 0
        assert seq % layout.seq_multiple(plan.train.tp_sequence_parallel) == 0
        core = memory_core(model, plan.train, layout)
        assert core.total <= topology.gpu.memory_bytes * (1 - plan_settings.headroom)
        assert core.host_total <= offload_capacity(topology, MemoryAssumptions())
        assert plan.estimate.fits
        if mode == "train":
            per_rank = plan.train.micro_batch * plan.train.grad_accum
            assert per_rank * layout.dp >= result.global_batch_sequences
    kinds = {r.kind for r in result.rejected}
    assert kinds <= {"structure", "memory", "bound", "slower"}


@SETTINGS
@given(
    heads=st.integers(1, 64), kv=st.integers(1, 64), ulysses=st.integers(1, 64), tp=st.integers(1, 16),
    ring=st.integers(1, 16), seq=st.integers(-10, 1 << 31), gpus=st.integers(-2, 1 << 21),
)
def test_invalid_inputs_raise_the_project_error(heads, kv, ulysses, tp, ring, seq, gpus):
    """Whatever the numbers, the cost model and planner either work or raise CostModelError."""
    try:
        model = ModelSpec(name="m", num_layers=2, hidden_size=heads * 64, num_heads=heads, num_kv_heads=kv,
                          head_dim=64, ffn_hidden_size=256, vocab_size=1000)
        layout = Layout.for_world(gpus, ulysses=ulysses, tp=tp, ring=ring)
        train = TrainSpec(seq_len=seq)
        layout.check_against(model, train.seq_len)
    except (CostModelError, ValueError):  # pydantic ValidationError is a ValueError
        return
    try:  # a GPU count that does not fill whole nodes is the topology's CostModelError, also fine
        topology = default_topology("h100-80gb", layout.world, min(8, layout.world))
        search(model, train, topology, PlanSettings(top_k=1, fixed_layout=layout.degrees()))
    except CostModelError:
        pass


@pytest.mark.parametrize("name, seq, gpus, mode", [
    ("llama3-8b", 128 * 1024, 8, "train"),
    ("llama3-8b", 2048, 8, "train"),
    ("qwen3-4b", 512 * 1024, 4, "train"),
    ("llama3-70b", 1_000_000, 8, "prefill"),
    ("mistral-7b", 64 * 1024, 16, "train"),
])
def test_search_finds_the_brute_force_optimum(name, seq, gpus, mode):
    """Pruning (floors, closures, branch and bound) never loses the best plan."""
    from sp_plan.cost_models import get_model_preset
    from sp_plan.planner.search import brute_force_best

    model = get_model_preset(name)
    topology = default_topology("h100-80gb", gpus, min(8, gpus))
    train = TrainSpec(seq_len=seq, mode=mode)
    best_score, _, _, evaluations = brute_force_best(model, train, topology)
    result = search(model, train, topology, PlanSettings(top_k=3))
    assert result.plans[0].score == pytest.approx(best_score, rel=1e-12)
    assert result.stats.time_evaluations < evaluations


@pytest.mark.parametrize("name, seq, gpus, layout_kw, mode", [
    ("llama3-8b", 128 * 1024, 8, {"ring": 8}, "train"),
    ("llama3-8b", 8192, 8, {"dp_shard": 4, "tp": 2}, "train"),
    ("llama3-70b", 256 * 1024, 16, {"ulysses": 8, "ring": 2}, "train"),
    ("qwen3-4b", 32 * 1024, 8, {"dp_replicate": 2, "dp_shard": 2, "ulysses": 2}, "train"),
    ("llama3-70b", 1_000_000, 8, {"ulysses": 8}, "prefill"),
])
def test_lattice_monotonicity_the_search_relies_on(name, seq, gpus, layout_kw, mode):
    """Up every lattice axis (ZeRO is a separate branch): device memory never grows and the step never
    gets faster. The floors, closures and the best-first order are exact only while this holds."""
    import itertools

    from sp_plan.cost_models import get_model_preset
    from sp_plan.planner.options import invalid_reason
    from sp_plan.planner.search import _Searcher

    model = get_model_preset(name)
    topology = default_topology("h100-80gb", gpus, min(8, gpus))
    layout = Layout.for_world(gpus, **layout_kw)
    s = _Searcher(model, TrainSpec(seq_len=seq, mode=mode), topology, PlanSettings(), None)
    for lattice in s.lattices(layout):
        scored = {}
        for combo in itertools.product(*(range(len(a.values)) for a in lattice.axes)):
            if invalid_reason(lattice.values(combo)) is None:
                scored[combo] = s.timed(layout, combo, lattice)
        for combo, low in scored.items():
            for nxt in lattice.successors(combo):
                high = scored.get(nxt)
                if high is None:
                    continue
                step = {a.name for a, i, j in zip(lattice.axes, combo, nxt) if i != j}
                assert high.report.total <= low.report.total, (step, lattice.values(combo))
                assert high.time.step_s / high.time.tokens_per_step >= \
                    low.time.step_s / low.time.tokens_per_step * (1 - 1e-12), (step, lattice.values(combo))


@pytest.mark.parametrize("stack, name, seq, gpus", [
    ("hf-deepspeed", "llama3-8b", 16 * 1024, 8),     # short: DeepSpeed's TiledMLP costs memory (not monotone)
    ("hf-deepspeed", "llama3-70b", 256 * 1024, 8),
    ("torchtitan", "llama3-8b", 128 * 1024, 8),
    ("hf-deepspeed", "llama3-8b", 500 * 1024, 1),    # one GPU: only ZeRO-3's parameter offload fits
])
def test_search_finds_the_brute_force_optimum_under_gpu_stacks(stack, name, seq, gpus):
    """The pruning stays exact under the GPU stacks' memory models too (the tiled MLP is not monotone under
    hf-deepspeed; the search's bounds try it both ways)."""
    from sp_plan.cost_models import get_model_preset
    from tests.search_checks import assert_search_equals_brute_force

    model = get_model_preset(name)
    topology = default_topology("h100-80gb", gpus, min(8, gpus))
    train = TrainSpec(seq_len=seq)
    assert_search_equals_brute_force(model, train, topology, PlanSettings(top_k=3, stack=stack))


def test_bounds_try_the_tiled_mlp_both_ways_where_it_costs_memory():
    """Under hf-deepspeed a tiled MLP with one or two tiles costs memory. A pruning bound (floor, cheap
    closure) with the tiled MLP on must still say "fits" when the same options without it fit."""
    from sp_plan.cost_models import Layout, get_model_preset
    from sp_plan.planner.search import _Searcher

    model = get_model_preset("llama3-8b")
    topology = default_topology("h100-80gb", 8, 8)
    layout = Layout.for_world(8, ulysses=8)
    base = TrainSpec(seq_len=16 * 1024)
    options = dict(zero_stage=3, checkpointing="full", offload_checkpoints=False, tiled_loss=True,
                   offload_optimizer=False, offload_params=False, micro_batch=1)
    probe = _Searcher(model, base, topology, PlanSettings(stack="hf-deepspeed"), None)
    tiled = probe.memory(layout, probe.train_for(layout, {**options, "tiled_mlp": True})).total
    plain = probe.memory(layout, probe.train_for(layout, {**options, "tiled_mlp": False})).total
    assert tiled > plain  # the non-monotone case
    headroom = 1 - (plain + tiled) / 2 / topology.gpu.memory_bytes  # usable capacity between the two
    s = _Searcher(model, base, topology, PlanSettings(stack="hf-deepspeed", headroom=headroom), None)
    assert not s.device_fits(s.memory(layout, s.train_for(layout, {**options, "tiled_mlp": True})))
    assert s.saving_fits(layout, {**options, "tiled_mlp": True})
