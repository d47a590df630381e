"""The data path, the loss and the capability table, without process groups (fast, single process)."""

from __future__ import annotations

import pytest
import torch

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec
from sp_plan.runtime.capabilities import merge_constraints, planner_constraints, unsupported_reasons
from sp_plan.runtime.context import shard_segments
from sp_plan.runtime.data import (
    IGNORE_INDEX,
    BatchSharder,
    TokenWindows,
    data_parallel_coordinates,
    pack_documents,
    shift_labels,
)
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.loss import TokenLoss, cross_entropy_sum


class FakeSP:
    """The SequenceParallel sharding of one (ring rank, ulysses rank), without process groups."""

    def __init__(self, ring: int, ulysses: int, ring_rank: int = 0, ulysses_rank: int = 0) -> None:
        self.ring, self.ulysses, self.ring_rank, self.ulysses_rank = ring, ulysses, ring_rank, ulysses_rank

    @property
    def seq_multiple(self) -> int:
        return Layout(ring=self.ring, ulysses=self.ulysses).seq_multiple()

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        runs = shard_segments(x.shape[dim], self.ring, self.ring_rank, self.ulysses, self.ulysses_rank)
        return torch.cat([x.narrow(dim, s, n) for s, n in runs], dim=dim)


# ----- labels, padding, sharding ------------------------------------------------------------------------


def test_labels_are_shifted_on_the_full_sequence_before_sharding():
    ids = torch.arange(100, 160).view(1, 60)  # 60 tokens: padded to 64 for ring 2 x ulysses 2 (multiple 8)
    shards = [BatchSharder(FakeSP(2, 2, r, u))(ids) for r in range(2) for u in range(2)]
    positions = torch.cat([s["position_ids"] for s in shards], dim=1).flatten().sort().values
    assert positions.tolist() == list(range(64))  # every padded position exactly once
    for shard in shards:
        for pos, label, token in zip(shard["position_ids"][0], shard["labels"][0], shard["input_ids"][0]):
            if pos < 59:
                assert label == 100 + pos + 1 and token == 100 + pos  # label = the NEXT token, even across shards
            else:
                assert label == IGNORE_INDEX  # last real token and padding
    assert sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in shards) == 59


def test_shards_do_not_keep_the_full_batch_alive():
    ids = torch.arange(64).view(1, 64)
    shard = BatchSharder(FakeSP(1, 4, 0, 1))(ids)
    for tensor in shard.values():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_right_padding_mask_becomes_ignored_labels_and_left_padding_is_refused():
    ids = torch.arange(1, 9).view(1, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    full = BatchSharder(FakeSP(1, 1)).prepare({"input_ids": ids, "attention_mask": mask})
    assert full["labels"].tolist() == [[2, 3, 4, 5, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    with pytest.raises(RuntimeConfigError, match="left padding"):
        BatchSharder(FakeSP(1, 1)).prepare({"input_ids": ids, "attention_mask": mask.flip(1)})
    with pytest.raises(RuntimeConfigError, match="4-D masks"):
        BatchSharder(FakeSP(1, 1)).prepare({"input_ids": ids, "attention_mask": torch.ones(1, 1, 8, 8)})


def test_hf_labels_and_pre_shifted_labels():
    ids = torch.arange(10, 18).view(1, 8)
    hf = BatchSharder(FakeSP(1, 1)).prepare({"input_ids": ids, "labels": ids})
    assert hf["labels"][0, :-1].tolist() == list(range(11, 18)) and hf["labels"][0, -1] == IGNORE_INDEX
    aligned = torch.arange(1, 9).view(1, 8)
    same = BatchSharder(FakeSP(1, 1), labels_shifted=True).prepare((ids, aligned))
    assert torch.equal(same["labels"], aligned)


def test_packed_documents_are_document_masked_by_default_and_never_predict_across_a_boundary():
    ids = torch.arange(8).view(1, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    masked = BatchSharder(FakeSP(1, 1)).prepare({"input_ids": ids, "position_ids": positions})
    assert masked["cu_seqlens"].tolist() == [0, 3, 7, 8]  # the documents, for the attention
    full = BatchSharder(FakeSP(1, 1), cross_document_attention=True).prepare(
        {"input_ids": ids, "position_ids": positions})
    assert "cu_seqlens" not in full  # the explicit opt-in: causal attention over the whole row
    for prepared in (masked, full):
        assert prepared["labels"].tolist() == [[1, 2, IGNORE_INDEX, 4, 5, 6, IGNORE_INDEX, IGNORE_INDEX]]
        assert torch.equal(prepared["position_ids"], positions)  # RoPE sees the per-document positions
    assert shift_labels(ids, positions).tolist() == full["labels"].tolist()


def test_pack_documents_and_token_windows():
    docs = [[1] * 5, [2] * 3, [3] * 9]
    rows = list(pack_documents(docs, 6, separator=0, reset_positions=True))
    assert [r["input_ids"].tolist() for r in rows] == [[1, 1, 1, 1, 1, 0], [2, 2, 2, 0, 3, 3], [3] * 6]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    gpt = list(pack_documents(docs, 6, separator=0))
    assert all(r["position_ids"].tolist() == list(range(6)) for r in gpt)
    windows = TokenWindows(torch.arange(25), 8)
    assert len(windows) == 3 and windows[2].tolist() == list(range(16, 24))
    with pytest.raises(RuntimeConfigError, match="fewer than one sequence"):
        TokenWindows(torch.arange(5), 8)


def test_data_parallel_rank_ignores_the_sequence_parallel_dims():
    class Mesh:
        def __init__(self, coords, sizes):
            self.coords, self.sizes = coords, sizes

        def size(self, dim):
            return self.sizes[dim]

        def local_rank(self, dim):
            return self.coords[dim]

    sizes = {"dp_replicate": 2, "dp_shard": 3, "ring": 2, "ulysses": 2}
    seen = {}
    for rep in range(2):
        for shard in range(3):
            for ring in range(2):
                for uly in range(2):
                    coords = {"dp_replicate": rep, "dp_shard": shard, "ring": ring, "ulysses": uly}
                    seen.setdefault(data_parallel_coordinates(Mesh(coords, sizes)), set()).add((ring, uly))
    assert sorted(seen) == [(r, 6) for r in range(6)]
    assert all(len(sp_ranks) == 4 for sp_ranks in seen.values())  # the 4 SP ranks share one sample stream


def test_malformed_batches_are_refused_with_the_fix():
    with pytest.raises(RuntimeConfigError, match="input_ids"):
        BatchSharder(FakeSP(1, 1)).prepare({"tokens": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(RuntimeConfigError, match="batch dimension"):
        BatchSharder(FakeSP(1, 1)).prepare(torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeConfigError, match="not supported"):
        BatchSharder(FakeSP(1, 1)).prepare({"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": 1})


# ----- loss ---------------------------------------------------------------------------------------------


def test_token_loss_is_the_token_mean_and_a_rank_without_tokens_gives_zero_not_nan():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 2:] = IGNORE_INDEX
    out = TokenLoss()(logits, labels)
    reference = torch.nn.functional.cross_entropy(logits.view(-1, 11), labels.view(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.loss, reference)
    assert out.local_tokens == out.global_tokens == 7 and out.value == pytest.approx(reference.item())
    empty = torch.full((2, 5), IGNORE_INDEX)
    none = TokenLoss()(logits, empty, num_items=7)
    none.loss.backward()
    assert none.loss.item() == 0.0 and none.value == 0.0 and torch.isfinite(logits.grad).all()
    assert not logits.grad.any()


def test_step_normalisation_with_num_items():
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[1, 2, 3, IGNORE_INDEX]])
    out = TokenLoss()(logits, labels, num_items=30)
    torch.testing.assert_close(out.loss, cross_entropy_sum(logits, labels) / 30)


# ----- capabilities -------------------------------------------------------------------------------------


def _plan(**train):
    class P:
        pass

    plan = P()
    layout = train.pop("layout", Layout())
    plan.train, plan.layout = TrainSpec(seq_len=1024, **train), layout
    return plan


ALL_TECHNIQUES = {"tiled_mlp": True, "tiled_loss": True, "offload_checkpoints": True, "offload_optimizer": True,
                  "offload_params": True, "zero_stage": 3, "checkpointing": "full"}


def test_the_runtime_llama_model_runs_every_training_option_the_planner_outputs():
    assert unsupported_reasons(_plan(layout=Layout(tp=2, ulysses=2), **ALL_TECHNIQUES)) == []
    for stage in (1, 2, 3):
        assert unsupported_reasons(_plan(zero_stage=stage, checkpointing="selective", layout=Layout(tp=2, ring=2))) == []
    assert planner_constraints() == ({}, {})


def test_hf_models_run_every_training_option_too():
    assert unsupported_reasons(_plan(layout=Layout(tp=2, ulysses=2), **ALL_TECHNIQUES), "hf") == []
    assert planner_constraints("hf") == ({}, {})


def test_prefill_materialized_and_zero0_are_refused():
    assert any("prefill" in r for r in unsupported_reasons(_plan(mode="prefill", checkpointing="none")))
    assert any("attention_kernel" in r for r in unsupported_reasons(_plan(attention_kernel="materialized")))
    assert any("zero_stage=0" in r for r in unsupported_reasons(_plan(zero_stage=0)))


def test_tp_is_refused_for_a_model_with_dropout():
    from sp_plan.cost_models import ModelSpec

    spec = ModelSpec(name="drop", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=96, hidden_dropout=0.1)
    plan = _plan(layout=Layout(tp=2))
    plan.model = spec
    assert len(unsupported_reasons(plan)) == 1 and "dropout" in unsupported_reasons(plan)[0]
    assert planner_constraints("llama", spec)[0] == {"tp": 1}
    with pytest.raises(RuntimeConfigError, match="dropout"):
        merge_constraints({"tp": 2}, {}, "llama", spec)


def test_planner_constraints_only_allow_what_runs():
    merged_layout, merged_options = merge_constraints({"ulysses": 4}, {"zero_stage": 2, "tiled_mlp": True}, "hf")
    assert merged_layout == {"ulysses": 4} and merged_options == {"zero_stage": 2, "tiled_mlp": True}
    with pytest.raises(RuntimeConfigError, match="zero_stage=0"):
        merge_constraints({}, {"zero_stage": 0})


def test_plan_for_another_model_or_length_is_refused():
    from sp_plan.planner.plan import Hardware, Plan
    from sp_plan.runtime.auto import check_plan_matches

    spec = ModelSpec(name="a", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=96)
    plan = Plan(model=spec, train=TrainSpec(seq_len=256), layout=Layout(),
                hardware=Hardware(num_gpus=1, gpus_per_node=1, gpu="h100-80gb", topology="dgx-h100"))
    check_plan_matches(plan, spec.model_copy(update={"name": "renamed"}), 256)
    with pytest.raises(RuntimeConfigError, match="hidden_size"):
        check_plan_matches(plan, spec.model_copy(update={"hidden_size": 128}), None)
    with pytest.raises(RuntimeConfigError, match="seq_len=512"):
        check_plan_matches(plan, spec, 512)


def test_sharded_loader_over_a_dataloader_of_hf_dicts():
    from torch.utils.data import DataLoader

    from sp_plan.runtime.data import ShardedLoader

    rows = [{"input_ids": torch.arange(i, i + 12), "attention_mask": torch.ones(12, dtype=torch.long)}
            for i in range(4)]
    loader = ShardedLoader(DataLoader(rows, batch_size=2), BatchSharder(FakeSP(1, 2, 0, 1)))
    shards = list(loader)
    assert len(shards) == len(loader) == 2
    assert shards[0]["input_ids"].shape == (2, 6) and shards[0]["position_ids"][0].tolist() == list(range(6, 12))
    assert shards[1]["labels"][1].tolist() == [10, 11, 12, 13, 14, IGNORE_INDEX]


def test_plans_for_hf_models_use_their_memory_footprint():
    """auto_configure plans an HF model with the HF memory assumptions (eager RMSNorm's fp32 copies),
    so the same architecture needs more activation memory planned as HF than as the runtime's Llama."""
    from sp_plan.cost_models import get_model_preset
    from sp_plan.cost_models.topology import load_topology
    from sp_plan.runtime.auto import plan_for

    spec = get_model_preset("llama3-8b")
    base = TrainSpec(seq_len=32768)
    pins = {"checkpointing": "none", "tiled_mlp": False, "tiled_loss": False}
    plans = {kind: plan_for(spec, base, load_topology("dgx-h100", 8), 8, fixed_layout={"ulysses": 8},
                            fixed_options=pins, family=kind) for kind in ("llama", "hf")}
    act = {kind: plan.estimate["memory"]["activations"] for kind, plan in plans.items()}
    tokens = base.seq_len // 8
    extra_per_layer = 2 * tokens * spec.hidden_size * 4  # two norms, fp32 input copies
    assert act["hf"] - act["llama"] >= (spec.num_layers - 1) * extra_per_layer
