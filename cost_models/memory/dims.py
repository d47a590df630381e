"""Per-GPU tensor shapes after tensor, Ulysses and Ring parallelism.

All sharding arithmetic of the memory model lives here, so the tensor graphs can speak in local sizes
and never re-derive a split. Conventions (DESIGN.md): the sequence is split over ulysses x ring outside
attention; inside attention Ulysses trades the sequence split for a head split (each GPU sees the whole
ring-local sequence and ``heads / (tp x ulysses)`` heads); TP splits heads, the FFN and the vocabulary;
Megatron sequence parallelism (``tp_sequence_parallel``) also splits the norm/residual regions over tp.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..layout import Layout
from ..memo import Memo
from ..model_spec import ModelSpec
from ..train_spec import TrainSpec


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LocalDims:
    """Element counts one GPU works on. Token counts include the micro-batch.

    Hashed once (:meth:`__hash__`): the simulation caches key on it several times per memory evaluation."""

    tokens: int
    """T: tokens of the local sequence shard (micro_batch x seq / (ulysses x ring))."""
    norm_tokens: int
    """Tokens in norm/residual regions: T / tp with TP sequence parallelism, else T."""
    attn_seq: int
    """Sequence length one attention call sees per sample: seq / ring (Ulysses gathers it whole)."""
    batch: int
    hidden: int
    head_dim: int
    q_heads: int
    """Query heads per GPU outside attention (heads / tp); per token."""
    kv_heads_proj: int
    """KV heads each TP rank's K/V projection produces (KV weights replicated when tp > kv heads)."""
    kv_heads: int
    """KV heads per GPU outside attention after Ulysses replication (kv x rep / tp)."""
    q_heads_attn: int
    """Query heads per GPU inside attention (heads / (tp x ulysses))."""
    kv_heads_attn: int
    """KV heads per GPU inside attention (kv x rep / (tp x ulysses)), at least 1."""
    kv_replication: int
    """Copies of each KV head across the tp x ulysses head split (1 when KV heads divide it)."""
    ffn: int
    """FFN width per GPU (ffn / tp, rounded up)."""
    vocab: int
    """Vocabulary rows per GPU (vocab-parallel embedding and lm_head: vocab / tp, rounded up)."""
    compute_bytes: int
    ulysses: int
    ring: int
    tp: int
    sequence_parallel: bool
    """TP > 1 with Megatron sequence parallelism: an all-gather before and a reduce-scatter after
    each TP region."""
    sequences: int = 1
    """Sequences one attention call sees (packed documents count separately: micro_batch x
    ceil(attention sequence / document_length)); sizes flash-attn varlen's per-sequence padding."""
    ep: int = 1
    """Expert-parallel degree: this rank runs ``num_experts / ep`` experts on the rows dispatched to them."""

    def __hash__(self) -> int:
        # The fields' hash (equal dims hash equal), kept outside the fields so equality ignores it.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", value)
            return value

    @property
    def attn_tokens(self) -> int:
        """Tokens per GPU inside attention: batch x seq / ring (= tokens x ulysses)."""
        return self.batch * self.attn_seq

    @property
    def q_width(self) -> int:
        return self.q_heads * self.head_dim

    def q_bytes(self) -> int:
        """Q (or the attention output) per GPU, before or after the all-to-all (same bytes)."""
        return self.tokens * self.q_width * self.compute_bytes

    def k_bytes(self) -> int:
        """K (or V) per GPU fed to attention, after KV replication; same before and after the all-to-all."""
        return self.tokens * self.kv_heads * self.head_dim * self.compute_bytes

    def k_proj_bytes(self) -> int:
        """K (or V) as the TP rank's projection produces it, before any Ulysses replication."""
        return self.tokens * self.kv_heads_proj * self.head_dim * self.compute_bytes


#: TrainSpec fields local shapes depend on: the memo key (see :mod:`sp_plan.cost_models.memo`).
DIMS_FIELDS = ("micro_batch", "seq_len", "tp_sequence_parallel", "dtype", "document_length", "data")
_DIMS: Memo[LocalDims] = Memo()


def local_dims(model: ModelSpec, train: TrainSpec, layout: Layout) -> LocalDims:
    """Shapes for ``model`` under ``layout``; assumes ``layout.check_against`` has passed. Memoized:
    one shared (frozen) object per distinct shape, which also makes the simulation caches keyed on
    it hit by identity."""
    key = (model, *layout.model_degrees(), *(getattr(train, f) for f in DIMS_FIELDS))
    return _DIMS.get(key, lambda: _local_dims(model, train, layout))


def _local_dims(model: ModelSpec, train: TrainSpec, layout: Layout) -> LocalDims:
    tp, u, r = layout.tp, layout.ulysses, layout.ring
    sp = u * r
    tokens = train.micro_batch * train.seq_len // sp
    sequence_parallel = train.tp_sequence_parallel and tp > 1
    rep_tp = model.kv_replication(tp)
    rep = model.kv_replication(layout.head_split)
    kv_heads = model.num_kv_heads * rep // tp
    return LocalDims(
        tokens=tokens,
        norm_tokens=tokens // tp if sequence_parallel else tokens,
        attn_seq=train.seq_len // r,
        batch=train.micro_batch,
        hidden=model.hidden_size,
        head_dim=model.head_dim,
        q_heads=model.num_heads // tp,
        kv_heads_proj=model.num_kv_heads * rep_tp // tp,
        kv_heads=kv_heads,
        q_heads_attn=model.num_heads // layout.head_split,
        kv_heads_attn=kv_heads // u,
        kv_replication=rep,
        ffn=ceil_div(model.ffn_hidden_size, tp),
        vocab=ceil_div(model.vocab_size, tp),
        compute_bytes=train.dtype_bytes,
        ulysses=u,
        ring=r,
        tp=tp,
        sequence_parallel=sequence_parallel,
        sequences=train.micro_batch * (ceil_div(train.seq_len // r, train.attention_document_length)
                                       if train.attention_document_length else 1),
        ep=layout.ep,
    )
