"""Packed rows train with document masking through the whole runtime, like a single process (4 gloo ranks).

Rows of 64 tokens pack several learnable documents (arithmetic progressions mod VOCAB) with position
ids restarting at 0 per document; documents straddle rank boundaries and zigzag halves. Each
configuration runs through ``sp_plan.runtime.auto_configure`` and ``sp_plan.runtime.step.train_step`` (the sharder
turns the restarts into ``cu_seqlens``, the model hands them to the SP attention) and is compared with
a single-process run on the same rows that shares no runtime code on the data or attention side:

- the runtime's LlamaModel (USP 2 x 2 with selective checkpointing and the tiled loss, Ring 4 with
  two packed rows per micro-batch and full checkpointing, Ulysses 2 x data parallel 2) against the same
  model whose attention is PyTorch SDPA with an explicit block-diagonal causal mask;
- an HF Llama (USP 2 x 2, Ring 4) against HF's own SDPA attention, which detects the packed rows from
  the position ids and builds its block-diagonal mask itself.

Loss curves agree within 1e-4 (fp32, 4 AdamW steps). The data is sensitive to the mask: attending
across documents moves the reference's loss curve by about 2e-2, 200x the tolerance (checked: more
than 50x), so a run that ignored ``cu_seqlens`` would fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

STEPS, BATCH, SEQ, VOCAB, LR = 4, 2, 64, 96, 3e-3
LOSS_TOL = 1e-4
#: (name, kind, layout pins, option pins, micro-batch)
CONFIGS = [
    ("llama usp ring=2 x ulysses=2", "llama", {"ring": 2, "ulysses": 2},
     {"zero_stage": 3, "checkpointing": "selective", "tiled_loss": True}, 1),
    ("llama ring=4", "llama", {"ring": 4}, {"zero_stage": 2, "checkpointing": "full"}, 2),
    ("llama ulysses=2 x dp_shard=2", "llama", {"ulysses": 2, "dp_shard": 2}, {"zero_stage": 1, "checkpointing": "none"},
     1),
    ("hf usp ring=2 x ulysses=2", "hf", {"ring": 2, "ulysses": 2},
     {"zero_stage": 3, "checkpointing": "full", "tiled_loss": True}, 1),
    ("hf ring=4", "hf", {"ring": 4}, {"zero_stage": 2, "checkpointing": "selective"}, 1),
]
HF_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, attention_dropout=0.0,
                 tie_word_embeddings=False)


def _spec():
    from sp_plan.cost_models import ModelSpec

    return ModelSpec(name="tiny-llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=128, vocab_size=VOCAB)


def _model(kind: str, attention_fn=None):
    if kind == "hf":
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
        model.set_attn_implementation("sdpa")
        return model.float()
    from sp_plan.runtime.models import LlamaModel

    model = LlamaModel(_spec(), attention_fn=attention_fn)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


def _data() -> list[dict[str, torch.Tensor]]:
    """STEPS x BATCH packed rows: documents of 2..30 tokens, positions restarting at 0 per document."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(STEPS * BATCH):
        ids: list[int] = []
        positions: list[int] = []
        while len(ids) < SEQ:
            length = int(torch.randint(2, 31, (1,), generator=gen))
            start, stride = (int(x) for x in torch.randint(0, VOCAB, (2,), generator=gen))
            ids += [(start + (stride % 5 + 1) * i) % VOCAB for i in range(length)]
            positions += list(range(length))
        rows.append({"input_ids": torch.tensor([ids[:SEQ]]), "position_ids": torch.tensor([positions[:SEQ]])})
    return rows


# ----- the single-process reference (no runtime data or attention code) ---------------------------------


class _BlockDiagonalSDPA(torch.nn.Module):
    """PyTorch SDPA with an explicit mask: same document (from the boundaries) and causal."""

    def forward(self, q, k, v, causal=True, cu_seqlens=None):
        batch, seq = q.shape[:2]
        doc = torch.zeros(batch * seq, dtype=torch.int64)
        if cu_seqlens is not None:
            doc[cu_seqlens[1:-1].long()] = 1
        doc = doc.cumsum(0).view(batch, seq)
        mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], enable_gqa=True)
        return out.transpose(1, 2)


def _boundaries(positions: torch.Tensor) -> torch.Tensor:
    flat = positions.reshape(-1)
    starts = (flat == 0).nonzero().flatten().tolist()
    return torch.tensor(sorted(set(starts) | {0, flat.numel()}), dtype=torch.int32)


def _reference(kind: str, masked: bool = True, steps: int = STEPS) -> list[float]:
    import torch.nn.functional as F

    model = _model(kind, attention_fn=_BlockDiagonalSDPA())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = _data()
    losses = []
    for step in range(steps):
        rows = data[step * BATCH:(step + 1) * BATCH]
        ids = torch.cat([r["input_ids"] for r in rows])
        positions = torch.cat([r["position_ids"] for r in rows])
        labels = ids[:, 1:].masked_fill(positions[:, 1:] == 0, -100)  # never predict across a document start
        if kind == "hf":  # HF builds the block-diagonal mask itself from the restarting positions
            logits = model(input_ids=ids, position_ids=positions if masked else None, use_cache=False).logits
        else:
            logits = model(ids, positions, _boundaries(positions) if masked else None)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# ----- the runtime on 4 ranks -------------------------------------------------------------------------------


def _train_rank(rank: int, world: int) -> dict:
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.step import train_step

    results = {}
    for name, kind, layout, options, micro_batch in CONFIGS:
        setup = auto_configure(_model(kind), seq_len=SEQ, micro_batch=micro_batch, global_batch=BATCH, dtype="fp32",
                               topology="dgx-h100", fixed_layout=layout, fixed_options=options)
        assert all(setup.plan.layout.degrees()[k] == v for k, v in layout.items()), setup.plan.layout
        optimizer = setup.make_optimizer(lr=LR)
        data = _data()
        per_rank = BATCH // setup.dp_size
        losses = []
        for step in range(STEPS):
            mine = data[step * BATCH + setup.dp_rank * per_rank:][:per_rank]
            micro = [{key: torch.cat([b[key] for b in mine[i:i + micro_batch]]) for key in mine[0]}
                     for i in range(0, per_rank, micro_batch)]
            shard = setup.shard(micro[0])
            assert shard["cu_seqlens"][-1] == micro_batch * SEQ  # the documents reach the model
            losses.append(train_step(setup, micro, optimizer).loss)
        results[name] = losses
    return results


@pytest.fixture(scope="module")
def trained():
    per_rank = run_ranks(4, _train_rank, timeout=300)
    for name in per_rank[0]:
        assert all(r[name] == per_rank[0][name] for r in per_rank), name
    return per_rank[0]


@pytest.mark.parametrize("name,kind", [(c[0], c[1]) for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_packed_rows_train_like_a_single_process_with_document_masking(trained, name, kind):
    reference = _reference(kind)
    got = trained[name]
    assert max(abs(a - b) for a, b in zip(got, reference)) < LOSS_TOL, (name, got, reference)


def test_the_data_is_sensitive_to_the_document_mask():
    masked, unmasked = _reference("llama", True), _reference("llama", False)
    assert max(abs(a - b) for a, b in zip(masked, unmasked)) > 50 * LOSS_TOL, (masked, unmasked)
