"""The sharder on packed rows (single process, no process groups): documents and labels stay aligned.

The documents of a packed batch (position ids restarting at 0, or a ``cu_seqlens`` entry) become the
shard's ``cu_seqlens``: boundaries over the whole padded batch, the same on every SP rank; labels never
cross a document start; padding joins the last document of its row; rows that are one document each
add nothing (the plain causal path).
"""

from __future__ import annotations

import pytest
import torch

from sp_plan.runtime.data import IGNORE_INDEX, BatchSharder, positions_from_starts
from sp_plan.runtime.errors import RuntimeConfigError
from tests.test_training_data import FakeSP

IDS = torch.arange(10, 24).view(2, 7)
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])


def test_restarting_positions_become_boundaries_over_the_padded_batch():
    full = BatchSharder(FakeSP(2, 1)).prepare({"input_ids": IDS, "position_ids": POSITIONS})
    # ring 2: multiple 4, rows padded 7 -> 8; the pad joins each row's last document.
    assert full["input_ids"].shape == (2, 8)
    assert full["cu_seqlens"].tolist() == [0, 3, 8, 13, 16]
    assert full["cu_seqlens"].dtype == torch.int32 and full["cu_seqlens"].device.type == "cpu"
    assert full["labels"].tolist() == [
        [11, 12, IGNORE_INDEX, 14, 15, 16, IGNORE_INDEX, IGNORE_INDEX],
        [18, 19, 20, 21, IGNORE_INDEX, 23, IGNORE_INDEX, IGNORE_INDEX],
    ]


def test_cu_seqlens_input_gives_restarting_positions_and_the_same_result():
    cu = torch.tensor([0, 3, 7, 12, 14])
    from_cu = BatchSharder(FakeSP(2, 1)).prepare({"input_ids": IDS, "cu_seqlens": cu})
    from_positions = BatchSharder(FakeSP(2, 1)).prepare({"input_ids": IDS, "position_ids": POSITIONS})
    for key in ("input_ids", "position_ids", "labels", "cu_seqlens"):
        assert torch.equal(from_cu[key], from_positions[key]), key
    starts = torch.tensor([[False, False, True, False, False, True]])
    assert positions_from_starts(starts).tolist() == [[0, 1, 0, 1, 2, 0]]


@pytest.mark.parametrize("ring,ulysses", [(2, 1), (1, 2), (2, 2)])
def test_every_rank_gets_the_same_boundaries_and_its_own_aligned_shard(ring, ulysses):
    full = BatchSharder(FakeSP(ring, ulysses)).prepare({"input_ids": IDS, "position_ids": POSITIONS})
    tokens = []
    for ring_rank in range(ring):
        for ulysses_rank in range(ulysses):
            sharder = BatchSharder(FakeSP(ring, ulysses, ring_rank, ulysses_rank))
            shard = sharder.shard(full)
            assert torch.equal(shard["cu_seqlens"], full["cu_seqlens"])
            for ids, pos, labels in zip(shard["input_ids"].flatten(), shard["position_ids"].flatten(),
                                        shard["labels"].flatten()):
                tokens.append((int(ids), int(pos), int(labels)))
    expected = list(zip(full["input_ids"].flatten().tolist(), full["position_ids"].flatten().tolist(),
                        full["labels"].flatten().tolist()))
    assert sorted(tokens) == sorted(expected)  # every (token, position, label) triple once, none split apart


def test_one_document_per_row_and_the_opt_in_add_no_boundaries():
    plain = BatchSharder(FakeSP(2, 1)).prepare(IDS)
    assert "cu_seqlens" not in plain
    opt_in = BatchSharder(FakeSP(2, 1), cross_document_attention=True)
    assert "cu_seqlens" not in opt_in.shard(opt_in.prepare({"input_ids": IDS, "position_ids": POSITIONS}))


def test_bad_cu_seqlens_is_one_clear_error():
    with pytest.raises(RuntimeConfigError, match="no boundary at the row start"):
        BatchSharder(FakeSP(1, 1)).prepare({"input_ids": IDS, "cu_seqlens": torch.tensor([0, 3, 9, 14])})
    with pytest.raises(RuntimeConfigError, match="1-D integer tensor"):
        BatchSharder(FakeSP(1, 1)).prepare({"input_ids": IDS, "cu_seqlens": torch.tensor([[0, 14]])})
