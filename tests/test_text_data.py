"""sp_plan.runtime.text_data: a Hugging Face text dataset and tokenizer (both local, offline), packed to the sequence
length exactly as sp_plan.runtime.data.pack_documents packs, cached, and served as a deterministic, resumable,
data-parallel stream of global batches; bad inputs get one RuntimeConfigError."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sp_plan.runtime.data import IGNORE_INDEX, BatchSharder, pack_documents  # noqa: E402
from sp_plan.runtime.errors import RuntimeConfigError  # noqa: E402
from sp_plan.runtime.text_data import (  # noqa: E402
    GlobalBatches,
    PackedTextDataset,
    build_bpe_tokenizer,
    check_vocabulary,
    load_text_dataset,
    load_tokenizer,
)

SEQ = 48


def documents(count: int = 120) -> list[str]:
    """Python-like snippets of varied length, some empty, some longer than a row."""
    out = []
    for i in range(count):
        body = "".join(f"    y{j} = x * {i + j} + {j % 7}\n" for j in range(i % 9))
        out.append("" if i % 17 == 5 else f"def f{i}(x):\n{body}    return x - {i}\n")
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer directory and the same documents as JSON lines, text lines and a save_to_disk dataset."""
    import datasets

    root = tmp_path_factory.mktemp("text-data")
    docs = documents()
    build_bpe_tokenizer(docs, root / "tokenizer", vocab_size=320)
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": len(d)}) + "\n")
    datasets.Dataset.from_dict({"content": docs}).save_to_disk(str(root / "saved"))
    return root, docs


def _reference(root, docs, positions: str) -> list[dict[str, torch.Tensor]]:
    tok = load_tokenizer(str(root / "tokenizer"))
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    return list(pack_documents(ids, SEQ, separator=tok.eos_token_id, reset_positions=positions == "per_document"))


def _build(root, source, positions="continuous", **kwargs) -> PackedTextDataset:
    return PackedTextDataset.build(source, str(root / "tokenizer"), SEQ, positions=positions,
                                   cache_dir=root / "packed", hf_cache_dir=root / "hf", **kwargs)


@pytest.mark.parametrize("positions", ["continuous", "per_document"])
def test_packing_equals_pack_documents(corpus, positions):
    root, docs = corpus
    packed = _build(root, str(root / "docs.jsonl"), positions)
    reference = _reference(root, docs, positions)
    assert len(packed) == len(reference) > 10
    for i, row in enumerate(reference):
        sample = packed[i]
        if positions == "continuous":
            assert torch.equal(sample, row["input_ids"])
        else:
            assert torch.equal(sample["input_ids"], row["input_ids"])
            assert torch.equal(sample["position_ids"], row["position_ids"])
    eos = load_tokenizer(str(root / "tokenizer")).eos_token_id
    assert packed.meta["documents"] == len(docs) and packed.eos_token_id == eos
    assert packed.meta["tokens"] == sum(len(r["input_ids"]) for r in reference) + packed.meta["dropped_tokens"]
    if positions == "per_document":  # positions restart at every document start (after each EOS)
        ids, pos = packed[3]["input_ids"], packed[3]["position_ids"]
        after_eos = torch.nonzero(ids[:-1] == eos).flatten() + 1
        assert (pos[after_eos] == 0).all() and pos[0] == 0


def test_every_source_kind_packs_the_same_rows(corpus, tmp_path):
    root, docs = corpus
    jsonl = _build(root, str(root / "docs.jsonl"))
    saved = _build(root, str(root / "saved"), text_column="content")
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    (text_dir / "a.txt").write_text("\n".join(d.replace("\n", " ") for d in docs[:60]))
    lines = _build(root, str(text_dir))
    assert [saved[i].tolist() for i in range(len(saved))] == [jsonl[i].tolist() for i in range(len(jsonl))]
    assert len(lines) > 0 and lines.meta["documents"] == len(
        [ln for ln in (text_dir / "a.txt").read_text().split("\n")])  # the text builder: one document per line


def test_the_packing_is_cached(corpus):
    root, _ = corpus
    logged: list[str] = []
    first = _build(root, str(root / "docs.jsonl"), log=logged.append)
    again = _build(root, str(root / "docs.jsonl"), log=logged.append)
    assert first.directory == again.directory and first.fingerprint == again.fingerprint
    other = _build(root, str(root / "docs.jsonl"), positions="per_document", log=logged.append)
    assert other.directory != first.directory
    assert sum("packing" in line for line in logged) <= 1  # per_document may be new; continuous is not rebuilt


def test_global_batches_are_deterministic_sharded_and_resumable(corpus):
    root, _ = corpus
    packed = _build(root, str(root / "docs.jsonl"))

    def step_rows(stream):
        return [row.tolist() for mb in stream.next_step() for row in mb]

    single = GlobalBatches(packed, micro_batch=2, grad_accum=2, seed=5)
    steps = [step_rows(single) for _ in range(6)]  # 24 sequences: crosses no epoch yet
    again = GlobalBatches(packed, micro_batch=2, grad_accum=2, seed=5)
    assert [step_rows(again) for _ in range(6)] == steps
    shuffled_epoch = [packed[single.index(p)].tolist() for p in range(len(packed))]
    assert sorted(shuffled_epoch) == sorted(packed[i].tolist() for i in range(len(packed)))  # a permutation
    # Two data-parallel ranks with one micro-batch of 2 each consume the same global sequences per step.
    ranks = [GlobalBatches(packed, micro_batch=2, grad_accum=1, dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    for expected in steps:
        got = step_rows(ranks[0]) + step_rows(ranks[1])
        assert got == expected
    # Resume at step 3 on another data-parallel size: the same place in the global stream.
    state = single.state_dict()
    assert state["sequences_consumed"] == 24
    resumed = GlobalBatches(packed, micro_batch=1, grad_accum=1, dp_rank=1, dp_size=4, seed=5)
    resumed.load_state_dict(state)
    expected = step_rows(single)
    assert step_rows(resumed) == expected[1:2]
    # The stream continues into the next epoch with a new permutation.
    late = GlobalBatches(packed, micro_batch=1, seed=5)
    late.load_state_dict({**state, "sequences_consumed": len(packed) - 1})
    assert late.epoch == 0 and late.next_step() and late.epoch == 1
    with pytest.raises(RuntimeConfigError, match="refers to other data"):
        GlobalBatches(packed, micro_batch=1, seed=6).load_state_dict(state)


def test_per_document_rows_feed_the_sharder(corpus):
    """Restarting positions reach the sharder and no label crosses a document start (the data side of
    document masking; attention across documents is the sharder's decision)."""
    from sp_plan.runtime.context import SequenceParallel

    root, _ = corpus
    packed = _build(root, str(root / "docs.jsonl"), positions="per_document")
    data = GlobalBatches(packed, micro_batch=2, shuffle=False)
    batch = data.next_step()[0]
    assert set(batch) == {"input_ids", "position_ids"} and batch["input_ids"].shape == (2, SEQ)
    sharder = BatchSharder(SequenceParallel(), cross_document_attention=True)
    full = sharder.prepare(batch)
    starts = batch["position_ids"][:, 1:] == 0
    assert (full["labels"][:, :-1][starts] == IGNORE_INDEX).all()
    assert torch.equal(full["position_ids"], batch["position_ids"])


def test_bad_inputs_get_one_clear_error(corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(RuntimeConfigError, match="does not exist"):
        _build(root, str(tmp_path / "missing.jsonl"))
    with pytest.raises(RuntimeConfigError, match="no column 'body'.*--text-column"):
        _build(root, str(root / "docs.jsonl"), text_column="body")
    with pytest.raises(RuntimeConfigError, match="holds .*not text"):
        load_text_dataset(str(root / "docs.jsonl"), text_column="id", cache_dir=root / "hf")
    with pytest.raises(RuntimeConfigError, match="tokenizer path .* does not exist"):
        load_tokenizer(str(tmp_path / "no-tokenizer"))
    from transformers import PreTrainedTokenizerFast

    no_eos = PreTrainedTokenizerFast.from_pretrained(str(root / "tokenizer"))
    no_eos.eos_token = None
    no_eos.save_pretrained(str(tmp_path / "no-eos"))
    with pytest.raises(RuntimeConfigError, match="no EOS token"):
        load_tokenizer(str(tmp_path / "no-eos"))
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "x = 1"}) + "\n")
    with pytest.raises(RuntimeConfigError, match="fewer than one sequence"):
        _build(root, str(tmp_path / "tiny.jsonl"))
    packed = _build(root, str(root / "docs.jsonl"))
    with pytest.raises(RuntimeConfigError, match="vocab_size >= 320"):
        check_vocabulary(packed, 100)
    with pytest.raises(RuntimeConfigError, match="positions="):
        _build(root, str(root / "docs.jsonl"), positions="reset")


def _rank_zero_error(rank: int, world: int, root: str) -> str:
    try:
        PackedTextDataset.build(os.path.join(root, "missing.jsonl"), os.path.join(root, "tokenizer"), SEQ,
                                cache_dir=os.path.join(root, "packed"))
    except RuntimeConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiproc
def test_rank_zeros_packing_error_reaches_every_rank(corpus):
    from tests.distributed import run_ranks

    root, _ = corpus
    messages = run_ranks(2, _rank_zero_error, str(root), timeout=60)
    assert all("does not exist" in m for m in messages), messages


def _train_packed(rank: int, world: int, root: str, layout: dict, positions: str) -> dict:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.trainer import Trainer
    from tests.test_checkpoint import model

    setup = auto_configure(model(vocab_size=320), seq_len=SEQ, global_batch=2, dtype="fp32", topology="dgx-h100",
                           fixed_layout=layout, fixed_options={"zero_stage": 3})
    packed = PackedTextDataset.build(os.path.join(root, "docs.jsonl"), os.path.join(root, "tokenizer"), SEQ,
                                     positions=positions, cache_dir=os.path.join(root, "packed"),
                                     hf_cache_dir=os.path.join(root, "hf"))
    data = GlobalBatches.for_setup(setup, packed, seed=0)
    first = setup.shard(GlobalBatches.for_setup(setup, packed, seed=0).next_step()[0])
    optimizer = setup.make_optimizer(lr=1e-2)
    fit = Trainer(setup, optimizer, data, max_steps=3, progress=False, log_every=0, print_fn=lambda _: None).fit()
    return {"losses": fit.losses, "documents": "cu_seqlens" in first, "layout": setup.plan.layout.describe()}


@pytest.mark.multiproc
def test_per_document_rows_train_the_same_on_every_layout(corpus):
    """Per-document positions through the whole path (packing, global batches, sharder, document-masked
    attention, trainer): zigzag ring 2 on 2 ranks matches 1 rank, and differs from continuous positions."""
    from tests.distributed import run_ranks

    root, _ = corpus
    ring = run_ranks(2, _train_packed, str(root), {"ring": 2}, "per_document", timeout=120)[0]
    single = run_ranks(1, _train_packed, str(root), {}, "per_document", timeout=120)[0]
    continuous = run_ranks(1, _train_packed, str(root), {}, "continuous", timeout=120)[0]
    assert ring["layout"] == "ring=2" and ring["documents"] and single["documents"] and not continuous["documents"]
    assert max(abs(a - b) for a, b in zip(ring["losses"], single["losses"])) < 1e-4, (ring, single)
    assert max(abs(a - b) for a, b in zip(single["losses"], continuous["losses"])) > 1e-3
