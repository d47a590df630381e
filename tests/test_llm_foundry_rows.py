"""llm-foundry's MPT-7B H100 rows are priced as the benchmark ran them (issue 21 item 3).

What ran, from llm-foundry's history (scripts/train/benchmarking at b2a43a1, the commit that added the "H100
80GB BF16" table): llm-foundry v0.3.0 with attn_impl triton, the 7b yaml's MPT (MPTConfig defaults: learned
positions, biases, no ALiBi), FSDP FULL_SHARD, the table's micro-batch and GradAccum columns.
"""

import pytest

from sp_plan.cost_models.stack import attention_kernel_for
from sp_plan.planner.fitting.fit import predict_all, profile_for
from sp_plan.planner.fitting.published import SOURCES, published_runs

#: The table's columns per SeqLen: (MicroBatchSize, GradAccum, Activation Checkpointing, NumParams).
TABLE = {
    65536: (1, 2, "full", 6_918_905_856),
    32768: (2, 2, "full", 6_784_688_128),
    8192: (8, 2, "full", 6_684_024_832),
    2048: (6, 1, "none", 6_658_859_008),
}


@pytest.fixture(scope="module")
def rows():
    return [r for r in published_runs()[0] if r.source == "llm-foundry-h100"]


def test_every_table_row_is_a_run(rows):
    assert sorted(r.train.seq_len for r in rows) == sorted(TABLE)


def test_the_model_is_the_benchmark_yaml_not_the_released_checkpoint(rows):
    """The table's NumParams grows by d_model per token of max_seq_len: a learned position table, so the
    benchmark's MPT had no ALiBi; with biases and the yaml's 50368-token vocabulary the count is exact."""
    for run in rows:
        assert run.model.num_params == TABLE[run.train.seq_len][3], run.id
        assert run.model.position_embedding == "learned"
        assert run.model.max_position_embeddings == run.train.seq_len
        assert (run.model.activation, run.model.norm, run.model.tied_embeddings) == ("gelu", "layernorm", True)


def test_rows_run_with_the_tables_batching_and_checkpointing(rows):
    for run in rows:
        micro, accum, checkpointing, _ = TABLE[run.train.seq_len]
        assert (run.train.micro_batch, run.train.grad_accum, run.train.checkpointing) == (micro, accum,
                                                                                           checkpointing), run.id
        assert run.train.zero_stage == 3 and run.layout.world == 8 and run.layout.shard_group == 8
        assert not (run.train.offload_checkpoints or run.train.compiled or run.train.fp8_linears)


def test_the_unpinned_triton_kernel_is_priced_as_fa2_and_says_so(rows):
    """attn_impl triton has no H100 kernel-level figures: the rows name FlashAttention-2 explicitly (not
    whatever the torchtitan stack file says for Hopper) and state the substitution in their assumptions."""
    assert SOURCES["llm-foundry-h100"].time_overrides == {"attention_kernel": "fa2"}
    for run in rows:
        assert run.stack == "torchtitan"
        profile = profile_for(run)
        assert attention_kernel_for(profile.stack.time, profile.kernels.gpu, "h100") == "fa2", run.id
        assert "triton" in run.assumed and "FlashAttention-2" in run.assumed


def test_one_table_and_longer_rows_are_slower(rows):
    """The four rows form one ordering table, and the predictions fall with length as the table does."""
    assert len({r.group for r in rows}) == 1
    by_len = sorted(zip(rows, predict_all(rows)), key=lambda rp: rp[0].train.seq_len)
    predicted = [p for _, p in by_len]
    assert predicted == sorted(predicted, reverse=True)
