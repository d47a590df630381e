"""``sp-plan train`` packs and shards a real dataset the way the planner priced it (issue 32 part b).

Whole-document packings (``first_fit``, ``sorted``: :func:`sp_plan.cost_models.packing.pack`) keep every token of
every document once, split documents continuing in order, rows padded at the end (and each piece to a multiple
under per-document sharding) with the padding out of the loss and the token counts; stream packing writes the
same bytes as before; per-document ring sharding on 2 gloo ranks trains like one process on the same rows; the
console script prints the packing and the plan's sharding rule, and refuses bad combinations in one line."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sp_plan.cost_models.packing import pack
from sp_plan.runtime.data import IGNORE_INDEX, BatchSharder, valid_tokens
from sp_plan.runtime.text_data import (
    PACK_FORMAT,
    PackedTextDataset,
    build_bpe_tokenizer,
    load_text_dataset,
    load_tokenizer,
    tokenizer_fingerprint,
)

SEQ = 48
ROOT = Path(__file__).resolve().parents[1]


def documents() -> list[str]:
    """Varied snippets: empty ones (EOS only), short ones, and two longer than a row (split by the packer)."""
    out = []
    for i in range(90):
        body = "".join(f"    y{j} = x * {i + j} + {j % 7}\n" for j in range(i % 9))
        out.append("" if i % 17 == 5 else f"def f{i}(x):\n{body}    return x - {i}\n")
    out[3] = "".join(f"z{j} = {j} * {j}\n" for j in range(30))  # several rows long
    out[40] = "".join(f"w{j} = w{j - 1} + {j}\n" for j in range(1, 20))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train-packing")
    docs = documents()
    build_bpe_tokenizer(docs, root / "tokenizer", vocab_size=320)
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return root


def _build(root: Path, **kwargs) -> PackedTextDataset:
    return PackedTextDataset.build(str(root / "docs.jsonl"), str(root / "tokenizer"), SEQ,
                                   cache_dir=root / "packed", hf_cache_dir=root / "hf", **kwargs)


def _token_lists(root: Path) -> list[list[int]]:
    """Each document's token ids with its EOS, tokenised independently of the packer."""
    tok = load_tokenizer(str(root / "tokenizer"))
    return [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in documents()]


def _segments(sample: dict) -> list[list[int]]:
    """The real tokens of each document segment of a row (segments start where positions restart)."""
    ids, labels, pos = sample["input_ids"].tolist(), sample["labels"].tolist(), sample["position_ids"].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
    out = []
    for a, b in itertools.pairwise(starts):
        real = [t for t, lab in zip(ids[a:b], labels[a:b]) if lab != IGNORE_INDEX]
        if real:
            out.append(real)
    return out


@pytest.mark.parametrize("packing,multiple", [("first_fit", 1), ("sorted", 1), ("first_fit", 4)])
def test_whole_document_rows_keep_every_token_once_and_pad_outside_the_loss(corpus, packing, multiple):
    docs = _token_lists(corpus)
    packed = _build(corpus, positions="per_document", packing=packing, multiple=multiple)
    reference = pack([len(d) for d in docs], SEQ, packing, multiple=multiple, split_long=True)
    assert len(packed) == len(reference) and packed.packing == packing and packed.padded
    covered = [[0] * len(d) for d in docs]
    real_tokens = pieces = 0
    for index, row in enumerate(reference):
        sample = packed[index]
        assert sample["input_ids"].shape == (SEQ,)  # no row exceeds seq_len
        expected = [docs[p.doc][p.start:p.start + p.length] for p in row]
        assert _segments(sample) == expected  # the pieces in order; a split document's pieces continue it
        for p in row:
            for t in range(p.start, p.start + p.length):
                covered[p.doc][t] += 1
        real_tokens += sum(p.length for p in row)
        pieces += len(row)
    assert all(c == 1 for doc in covered for c in doc)  # every token of every document exactly once
    assert any(len(d) > SEQ for d in docs)  # the split case is exercised
    assert packed.meta["tokens"] == real_tokens == sum(map(len, docs))
    assert packed.padding_tokens == len(packed) * SEQ - real_tokens > 0
    lengths = packed.lengths()  # recorded while tokenising: what train plans on
    assert lengths.documents == len(docs) and lengths.tokens == real_tokens
    # through the sharder: a target is never a pad, so the loss and the token counts skip padding
    sharder = BatchSharder(type("OneRank", (), {"seq_multiple": 1, "shard": staticmethod(lambda x, dim=1: x)})())
    batch = {k: torch.stack([packed[i][k] for i in range(len(packed))]) for k in packed[0]}
    full = sharder.prepare(batch)
    assert valid_tokens(full["labels"]) == real_tokens - pieces  # each piece's last token predicts nothing
    pads = batch["labels"] == IGNORE_INDEX
    targets_pad = torch.zeros_like(pads)
    targets_pad[:, :-1] = pads[:, 1:]
    assert (full["labels"][targets_pad | pads] == IGNORE_INDEX).all()


def test_stream_packing_writes_the_bytes_it_always_wrote(corpus):
    """Stream rows against an independent reference (documents + EOS concatenated, cut every SEQ, the last
    partial row dropped), its document starts, and the cache key of earlier versions."""
    docs = _token_lists(corpus)
    flat = np.concatenate([np.asarray(d, dtype=np.uint32) for d in docs])
    rows = len(flat) // SEQ
    expected = hashlib.sha256(flat[:rows * SEQ].tobytes()).hexdigest()
    dataset = load_text_dataset(str(corpus / "docs.jsonl"), cache_dir=corpus / "hf")
    for positions in ("continuous", "per_document"):
        packed = _build(corpus, positions=positions)
        assert packed.packing == "stream" and not packed.padded and len(packed) == rows
        assert hashlib.sha256((packed.directory / "tokens.u32").read_bytes()).hexdigest() == expected
        spec = {"format": PACK_FORMAT, "dataset": dataset._fingerprint, "rows": len(dataset), "text_column": "text",
                "tokenizer": tokenizer_fingerprint(load_tokenizer(str(corpus / "tokenizer"))), "seq_len": SEQ,
                "positions": positions}
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
        assert packed.directory.name == f"packed-{key}"  # existing caches are found again
        assert packed.lengths().tokens == len(flat)
        if positions == "per_document":
            bounds = np.cumsum([0] + [len(d) for d in docs])
            for index in (0, 5, rows - 1):
                lo, hi = index * SEQ, (index + 1) * SEQ
                starts = [int(b) - lo for b in bounds if lo < b < hi]
                assert torch.nonzero(packed[index]["position_ids"][1:] == 0).flatten().add(1).tolist() == starts


def test_a_loaded_plan_fixes_the_sharding_rule():
    from sp_plan.cost_models.data_balance import DataShape
    from sp_plan.cost_models.lengths import histogram_from_lengths
    from sp_plan.cost_models.model_spec import ModelSpec
    from sp_plan.cost_models.topology import load_topology
    from sp_plan.cost_models.train_spec import TrainSpec
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.planning import plan_for, sharding_choice
    from sp_plan.runtime.train_options import TrainRunOptions
    from sp_plan.runtime.train_run import check_plan_data

    spec = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=320)
    shape = DataShape(bins=histogram_from_lengths([5, 9, 30, 3, 60, 12] * 20).bins, packing="first_fit",
                      sharding="per_document")
    plan = plan_for(spec, TrainSpec(seq_len=SEQ, dtype="fp32", data=shape), load_topology("dgx-h100", 2), 2,
                    fixed_layout={"ring": 2})
    assert sharding_choice(plan) == ("per_document", "as requested at ring=2")
    check_plan_data(plan, TrainRunOptions(dataset="d", tokenizer="t", positions="per-document"))
    with pytest.raises(RuntimeConfigError, match="needs the rows' document boundaries: add --positions per-document"):
        check_plan_data(plan, TrainRunOptions(dataset="d", tokenizer="t"))
    with pytest.raises(RuntimeConfigError, match="--sharding zigzag, but the plan shards rows per_document"):
        check_plan_data(plan, TrainRunOptions(dataset="d", tokenizer="t", positions="per-document", sharding="zigzag"))


def _train(rank: int, world: int, root: str, layout: dict) -> dict:
    from sp_plan.cost_models.data_balance import DataShape
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.text_data import GlobalBatches
    from sp_plan.runtime.trainer import Trainer

    from tests.test_checkpoint import model

    def build(multiple: int) -> PackedTextDataset:
        return PackedTextDataset.build(os.path.join(root, "docs.jsonl"), os.path.join(root, "tokenizer"), SEQ,
                                       positions="per_document", packing="first_fit", multiple=multiple,
                                       cache_dir=os.path.join(root, "packed"), hf_cache_dir=os.path.join(root, "hf"))

    lengths = build(1).lengths()
    shape = DataShape(bins=lengths.bins, packing="first_fit", sharding="per_document")
    setup = auto_configure(model(vocab_size=320), seq_len=SEQ, global_batch=2, dtype="fp32", topology="dgx-h100",
                           fixed_layout=layout, fixed_options={"zero_stage": 3}, data=shape, sharding=None)
    packed = build(4)  # the rows per-document sharding over ring 2 trains on: every piece a multiple of 4
    data = GlobalBatches.for_setup(setup, packed, seed=0)
    first = setup.shard(GlobalBatches.for_setup(setup, packed, seed=0).next_step()[0])
    optimizer = setup.make_optimizer(lr=1e-2)
    fit = Trainer(setup, optimizer, data, max_steps=3, progress=False, log_every=0, print_fn=lambda _: None).fit()
    return {"losses": fit.losses, "tokens": [r.tokens for r in fit.records], "sharding": setup.sp.sharding,
            "per_document": setup.sp.per_document, "shard_tokens": first["input_ids"].shape[1],
            "layout": setup.plan.layout.describe()}


@pytest.mark.multiproc
def test_per_document_sharding_on_two_ranks_trains_like_one_process(corpus):
    from tests.distributed import run_ranks

    ring = run_ranks(2, _train, str(corpus), {"ring": 2}, timeout=120)
    single = run_ranks(1, _train, str(corpus), {}, timeout=120)[0]
    assert ring[0]["layout"] == "ring=2" and ring[0]["per_document"] and ring[0]["sharding"] == "per_document"
    assert ring[0]["shard_tokens"] == SEQ // 2  # pieces padded to 4 in the rows: the sharder adds no padding
    assert ring[0]["losses"] == ring[1]["losses"]
    assert ring[0]["tokens"] == single["tokens"]  # padding counted on neither
    assert max(abs(a - b) for a, b in zip(ring[0]["losses"], single["losses"])) < 1e-4, (ring[0], single)


def _sp_plan() -> str:
    return str(Path(sys.executable).parent / "sp-plan")


def _run(args: list[str], corpus: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(corpus / "hf-cli"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1")
    return subprocess.run([_sp_plan(), "train", *args], check=False, cwd=corpus, env=env, capture_output=True,
                          text=True, timeout=timeout)


DATA_ARGS = ["--dataset", "docs.jsonl", "--tokenizer", "tokenizer", "--data-cache", "packed-cli"]


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_the_console_script_prints_the_packing_and_the_plans_sharding(corpus):
    done = _run([*DATA_ARGS, "--packing", "first_fit", "--positions", "per-document", "--seq-len", "48", "--steps",
                 "2", "--layers", "2", "--hidden", "64", "--ffn", "128", "--topology", "dgx-h100", "--ring", "2",
                 "--no-progress", "--nproc-per-node", "2"], corpus)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("packing first_fit, sharding ")]
    assert len(lines) == 1, out[-3000:]  # rank 0 only
    assert "(chosen by auto at ring=2)" in lines[0] and "planned on the dataset's lengths" in lines[0]
    assert "padding " in lines[0] and " rows of 48 tokens" in lines[0]


@pytest.mark.parametrize("args,message", [
    (["--sharding", "per_document", *DATA_ARGS], ("--sharding per_document splits every document of a row over the "
                                                 "ring ranks, so it needs the rows' document boundaries: add "
                                                 "--positions per-document")),
    (["--packing", "sorted"], "--packing shapes the rows of a --dataset"),
    (["--sharding", "contiguous", *DATA_ARGS], "'contiguous' is not one of 'auto', 'zigzag', 'per_document'"),
])
def test_bad_combinations_are_one_line_and_exit_2(corpus, args, message):
    done = _run(args, corpus, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr
