"""The data path of sequence-parallel training: pre-shift, pad, shard; and data-parallel sampling.

Order matters (DESIGN.md section 4):

1. **Pre-shift labels on the full sequence.** ``labels[t]`` becomes the token at ``t + 1`` (the last
   position gets :data:`IGNORE_INDEX`). Shifting after sharding would lose one label per shard: the
   next token of a shard's last position lives on another rank.
2. **Pad** the sequence to the layout's multiple (``ulysses x ring``, times 2 for zigzag ring,
   times tp under Megatron sequence parallelism):
   padded tokens get label :data:`IGNORE_INDEX`, so they add nothing to the loss or the gradients.
3. **Shard** input ids, position ids and labels with the ONE shard function of
   :class:`sp_plan.runtime.context.SequenceParallel` (zigzag / USP layout). Position ids are the global
   positions, which is all RoPE needs: no attention mask is ever built (a 4-D mask at 128K tokens is
   about a terabyte).

Padding masks (HF ``attention_mask``) are accepted only as right padding: padded positions become
ignored labels and the mask is dropped (causal attention never lets a real token see a later pad).

**Packed sequences.** A row may hold several documents, marked HF-style by ``position_ids`` that
restart (at 0) at each document start, or by a ``cu_seqlens`` entry: flash-attn's cumulative document
boundaries over the flattened ``(batch x seq)`` rows. The sharder then (a) keeps the positions for RoPE
(with ``cu_seqlens`` alone, positions restart at 0 per document), (b) ignores the label that would
predict a document's first token from the previous document, and (c) adds ``cu_seqlens`` to the
shard: the boundaries over the whole padded batch (the same on every rank, a small CPU tensor), which
the model hands to the attention, so every token attends only to its own document (document
masking, exact on every SP layout: :mod:`sp_plan.runtime.attention.documents`). Padding joins the last
document of its row (causal: no real token sees it). ``cross_document_attention=True`` is the explicit
opt-in for the old objective: positions and labels as above but attention causal over the whole row
(Megatron-LM's ``reset_position_ids`` without ``reset_attention_mask``); no ``cu_seqlens`` then.
GPT-style packing (documents joined by an EOS token, positions continuous) is one document per row as
far as the runtime can tell: see :func:`pack_documents`.

**Per-document sharding** (a context built with ``sharding="per_document"``, see
:mod:`sp_plan.runtime.context`): ``prepare`` first pads every document of a packed row to a multiple of
2 x ring (:func:`pad_documents`: pad tokens at the end of each document, inside it, labels
:data:`IGNORE_INDEX`, positions continuing the document's; documents shorter than 2 x ring, even of one
token, become one chunk per ring rank pair), then every row to the common length (a multiple of the
layout's); the row's end padding is a document of its own. ``cu_seqlens`` describes the padded batch and
``shard`` hands its per-row boundaries to ``sp.shard`` (rows of unpacked batches: one document each). The
token-weighted loss needs nothing more: pads carry no label.

**Data parallelism.** Ranks of one sequence-parallel group (and, later, one TP group) must see the
same sample; different data-parallel ranks (``dp_replicate x dp_shard``) different samples.
:func:`data_parallel_sampler` is a ``DistributedSampler`` keyed by the data-parallel rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from sp_plan.cost_models import degrees
from sp_plan.runtime.attention.documents import check_cu_seqlens, cu_seqlens_from_starts, row_bounds
from sp_plan.runtime.errors import RuntimeConfigError

#: Label value PyTorch's cross-entropy (and HF) skip.
IGNORE_INDEX = -100
#: Keys of a batch the sharder produces (sharded along the sequence); a packed batch adds
#: :data:`DOCUMENTS_KEY` (not sharded: boundaries over the whole batch).
BATCH_KEYS: tuple[str, ...] = ("input_ids", "position_ids", "labels")
DOCUMENTS_KEY = "cu_seqlens"


# ----- full-sequence preparation -----------------------------------------------------------------------


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool (batch, seq): True where a packed document starts after the first token (positions restart)."""
    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    return starts


def document_starts_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Bool (batch, seq): True where a document of ``cu_seqlens`` starts after the first token of its row."""
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    for row, bounds in enumerate(row_bounds(cu_seqlens, batch, seq)):
        starts[row, list(bounds[1:-1])] = True
    return starts


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Position ids (batch, seq) that restart at 0 at every document start (HF packed format)."""
    batch, seq = starts.shape
    index = torch.arange(seq).expand(batch, seq)
    begin = torch.where(starts, index, torch.zeros_like(index))
    begin[:, 0] = 0
    return index - begin.cummax(dim=1).values


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                 starts: torch.Tensor | None = None) -> torch.Tensor:
    """Pre-shift ``labels`` (batch, seq) so position t holds the target of token t: ``labels[t + 1]``.

    The last position, and (for packed rows) every position followed by a document start (restarting
    ``position_ids``, or ``starts`` as from :func:`document_starts`), get :data:`IGNORE_INDEX`:
    nothing is predicted across a document boundary.
    """
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if starts is None and position_ids is not None:
        starts = document_starts(position_ids)
    if starts is not None:
        shifted[:, :-1].masked_fill_(starts[:, 1:].to(shifted.device), IGNORE_INDEX)
    return shifted


def _right_padding_only(mask: torch.Tensor) -> bool:
    """True when each row of the 0/1 mask is ones followed by zeros."""
    m = mask.to(torch.int64)
    return bool((m[:, 1:] <= m[:, :-1]).all())


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad input ids (``pad_token_id``), labels (:data:`IGNORE_INDEX`) and positions (continuing)."""
    seq = batch["input_ids"].shape[1]
    extra = -seq % multiple
    if extra == 0:
        return batch
    out = dict(batch)
    out["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra), value=pad_token_id)
    out["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=IGNORE_INDEX)
    last = batch["position_ids"][:, -1:]
    steps = torch.arange(1, extra + 1, device=last.device, dtype=last.dtype)
    out["position_ids"] = torch.cat([batch["position_ids"], last + steps], dim=1)
    return out


def as_batch_dict(batch: Any) -> dict[str, torch.Tensor]:
    """Accept a (batch, seq) tensor of token ids, a tuple/list ``(input_ids[, labels])`` or an HF-style mapping."""
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise RuntimeConfigError(
                f"batch mapping has keys {sorted(batch)} but no 'input_ids': give token ids as 'input_ids'"
            )
        unknown = set(batch) - {"input_ids", "labels", "position_ids", "attention_mask", DOCUMENTS_KEY}
        if unknown:
            raise RuntimeConfigError(
                f"batch keys {sorted(unknown)} are not supported by the sequence-parallel data path (it takes "
                "input_ids, labels, position_ids, cu_seqlens and a right-padding attention_mask); drop them in the "
                "collate_fn"
            )
        return dict(batch)
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return dict(zip(("input_ids", "labels"), batch))
    raise RuntimeConfigError(
        f"cannot read a batch of type {type(batch).__name__}: yield a (batch, seq) tensor of token ids, a tuple "
        "(input_ids, labels) or a dict with input_ids[, labels, position_ids, attention_mask]"
    )


# ----- the sharder --------------------------------------------------------------------------------------


@dataclass
class BatchSharder:
    """Turns a full-sequence batch into this rank's shard: ``{"input_ids", "position_ids", "labels"}``,
    plus ``"cu_seqlens"`` for packed rows (document masking; see the module docstring).

    ``sp`` is the :class:`sp_plan.runtime.context.SequenceParallel` context (anything with ``shard(x, dim)``,
    ``size`` and ``seq_multiple``). ``labels_shifted``: the batch's labels are already aligned with the
    inputs (position t holds the target of token t); by default they are HF-style (labels = the input
    ids, the model shifts) and are pre-shifted here. ``cross_document_attention``: packed rows attend
    across their documents (no ``cu_seqlens``). ``device``: where the shards go (``cu_seqlens`` stays
    on the CPU: the attention reads it on the host). ``tp_multiple``: the tensor-parallel degree when
    Megatron sequence parallelism splits each rank's shard again over TP (``Layout.seq_multiple``), else 1.
    """

    sp: Any
    pad_token_id: int = 0
    labels_shifted: bool = False
    cross_document_attention: bool = False
    device: torch.device | str | None = None
    tp_multiple: int = 1

    @property
    def seq_multiple(self) -> int:
        return self.sp.seq_multiple * self.tp_multiple

    def prepare(self, batch: Any) -> dict[str, torch.Tensor]:
        """The full-sequence batch, labels pre-shifted and padded to the layout's multiple (not sharded)."""
        data = as_batch_dict(batch)
        input_ids = data["input_ids"]
        if input_ids.dim() != 2:
            raise RuntimeConfigError(
                f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}: add a batch dimension"
            )
        if input_ids.dtype.is_floating_point:
            raise RuntimeConfigError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        batch_size, seq = input_ids.shape
        if batch_size == 0 or seq == 0:
            raise RuntimeConfigError(
                f"empty batch: input_ids has shape {tuple(input_ids.shape)} (batch, seq); every batch needs at least "
                "one sequence of at least one token (drop empty batches in the dataset or collate_fn)"
            )
        position_ids = data.get("position_ids")
        cu_seqlens = data.get(DOCUMENTS_KEY)
        starts = None  # document starts (batch, seq), when the rows are packed
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens)
            starts = document_starts_from_cu_seqlens(cu_seqlens, batch_size, seq)
        if position_ids is None:
            if starts is not None:
                position_ids = positions_from_starts(starts).to(input_ids.device)
            else:
                position_ids = torch.arange(seq, device=input_ids.device).expand(batch_size, seq)
        else:
            position_ids = position_ids.expand(batch_size, seq) if position_ids.dim() == 1 else position_ids
            if position_ids.shape != input_ids.shape:
                raise RuntimeConfigError(
                    f"position_ids {tuple(position_ids.shape)} and input_ids {tuple(input_ids.shape)} differ in shape"
                )
            if starts is None:
                restarts = document_starts(position_ids)
                starts = restarts.cpu() if bool(restarts.any()) else None
        labels = data.get("labels")
        if labels is None:
            labels = input_ids
        if labels.shape != input_ids.shape:
            raise RuntimeConfigError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ")
        if not self.labels_shifted:
            labels = shift_labels(labels, starts=starts)
        mask = data.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or mask.shape != input_ids.shape:
                raise RuntimeConfigError(
                    f"attention_mask must be a (batch, seq) padding mask like input_ids, got {tuple(mask.shape)}; "
                    "4-D masks are never used (position_ids carry the layout)"
                )
            if not _right_padding_only(mask):
                raise RuntimeConfigError(
                    "attention_mask has zeros before ones (left padding or holes); the runtime passes no mask to "
                    "attention, so only right padding is exact: pad on the right (tokenizer.padding_side='right')"
                )
            pad = mask == 0
            labels = labels.masked_fill(pad, IGNORE_INDEX)
            if not self.labels_shifted:  # the last real token must not predict the first pad
                labels[:, :-1].masked_fill_(pad[:, 1:], IGNORE_INDEX)
        full = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
        documents = starts is not None and bool(starts.any()) and not self.cross_document_attention
        if documents and getattr(self.sp, "per_document", False):
            full, starts = pad_documents(full, starts, 2 * self.sp.ring_size, self.seq_multiple, self.pad_token_id)
            seq = full["input_ids"].shape[1]
        full = pad_to_multiple(full, self.seq_multiple, self.pad_token_id)
        if starts is not None and bool(starts.any()) and not self.cross_document_attention:
            padded = full["input_ids"].shape[1]
            starts = torch.nn.functional.pad(starts.to(torch.bool), (0, padded - seq), value=False)
            full[DOCUMENTS_KEY] = cu_seqlens_from_starts(starts)  # padding joins each row's last document
        return full

    def shard(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of an already prepared (shifted, padded) full batch."""
        out = {}
        documents = None
        if getattr(self.sp, "per_document", False):  # each row split by its own documents (one per row if unpacked)
            batch, seq = full["input_ids"].shape
            cu = full.get(DOCUMENTS_KEY)
            documents = row_bounds(cu, batch, seq) if cu is not None else ((0, seq),) * batch
        for key in BATCH_KEYS:
            local = self.sp.shard(full[key], dim=1) if documents is None else self.sp.shard(full[key], 1, documents)
            # Always a copy: a narrow view would keep the whole batch alive (autograd saves the token ids).
            out[key] = local.to(self.device if self.device is not None else local.device, copy=True)
        if full.get(DOCUMENTS_KEY) is not None:
            out[DOCUMENTS_KEY] = full[DOCUMENTS_KEY].to("cpu", torch.int32)  # the whole batch's boundaries
        return out

    def __call__(self, batch: Any) -> dict[str, torch.Tensor]:
        return self.shard(self.prepare(batch))


def pad_documents(full: dict[str, torch.Tensor], starts: torch.Tensor, multiple: int, row_multiple: int,
                  pad_token_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every document of every packed row padded to a multiple of ``multiple`` tokens (the per-document
    sharding rule's 2 x ring chunks), and every row to one length, a multiple of ``row_multiple``.

    A document's pad tokens follow it inside the document (causal: no real token sees them), with labels
    :data:`IGNORE_INDEX` and positions continuing the document's; the row's end padding is a document of its
    own (positions from 0). ``starts``: bool ``(batch, seq)``, True at document starts after a row's first
    token. Returns the padded batch and its document starts (same convention)."""
    input_ids, positions, labels = full["input_ids"], full["position_ids"], full["labels"]
    batch, seq = input_ids.shape
    starts = starts.to("cpu", torch.bool).clone()
    starts[:, 0] = True
    doc = starts.to(torch.int64).cumsum(dim=1) - 1  # (batch, seq): document index of every token
    plans = []
    for row in range(batch):
        lo = starts[row].nonzero().flatten()
        lengths = torch.diff(lo, append=torch.tensor([seq]))
        padded = (lengths + multiple - 1) // multiple * multiple
        dest_lo = torch.cumsum(padded, 0) - padded  # where each document starts in the padded row
        plans.append((lo, lengths, padded, dest_lo, int(padded.sum())))
    length = max(plan[-1] for plan in plans)
    length = -(-length // row_multiple) * row_multiple
    out_ids = torch.full((batch, length), pad_token_id, dtype=input_ids.dtype)
    out_labels = torch.full((batch, length), IGNORE_INDEX, dtype=labels.dtype)
    out_pos = torch.empty((batch, length), dtype=positions.dtype)
    new_starts = torch.zeros(batch, length, dtype=torch.bool)
    ids_cpu, labels_cpu, pos_cpu = input_ids.cpu(), labels.cpu(), positions.cpu()
    for row, (lo, lengths, padded, dest_lo, used) in enumerate(plans):
        row_doc = doc[row]
        dest = torch.arange(seq) - lo[row_doc] + dest_lo[row_doc]  # real tokens keep their order inside the doc
        out_ids[row, dest] = ids_cpu[row]
        out_labels[row, dest] = labels_cpu[row]
        # every slot of a document: position of the doc's last real token + how far past it the slot lies
        slot_doc = torch.repeat_interleave(torch.arange(len(lo)), padded)
        slot = torch.arange(used)
        last = lo + lengths - 1
        out_pos[row, :used] = pos_cpu[row, last[slot_doc]] + (slot - dest_lo[slot_doc] - lengths[slot_doc] + 1)
        out_pos[row, dest] = pos_cpu[row]
        out_pos[row, used:] = torch.arange(length - used, dtype=positions.dtype)  # the row's end padding
        new_starts[row, dest_lo[1:]] = True
        if used < length:
            new_starts[row, used] = True
    out = dict(full)
    out.update(input_ids=out_ids.to(input_ids.device), labels=out_labels.to(labels.device),
               position_ids=out_pos.to(positions.device))
    return out, new_starts


def valid_tokens(labels: torch.Tensor) -> int:
    """Number of labels that count in the loss."""
    return int((labels != IGNORE_INDEX).sum())


class ShardedLoader:
    """Wrap an iterable of full-sequence batches (e.g. a DataLoader) to yield this rank's shards."""

    def __init__(self, loader: Iterable, sharder: BatchSharder) -> None:
        self.loader, self.sharder = loader, sharder

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            yield self.sharder(batch)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


# ----- data parallelism ---------------------------------------------------------------------------------


def data_parallel_coordinates(mesh) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this rank over the data-parallel dims, ``dp_replicate x dp_shard`` (SP and TP
    ranks share one), row-major in mesh order."""
    rank, size = 0, 1
    for dim in degrees.with_role("data"):
        rank = rank * mesh.size(dim) + mesh.local_rank(dim)
        size *= mesh.size(dim)
    return rank, size


def data_parallel_sampler(dataset, mesh, *, shuffle: bool = True, seed: int = 0,
                          drop_last: bool = True) -> DistributedSampler:
    """A ``DistributedSampler`` over the data-parallel ranks: one sample stream per SP (and TP) group.

    ``drop_last`` defaults to True: every data-parallel rank must run the same number of steps.
    """
    rank, size = data_parallel_coordinates(mesh)
    return DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)


# ----- corpora ------------------------------------------------------------------------------------------


class TokenWindows(torch.utils.data.Dataset):
    """Fixed-length windows of a long token stream (a 1-D tensor), each ``seq_len`` tokens.

    Sample i covers tokens ``[i * seq_len, (i + 1) * seq_len)``; labels are the inputs (HF-style) and are
    pre-shifted by the sharder. Documents inside a window are joined GPT-style (separator token,
    continuous positions), so attention across them is the intended objective.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise RuntimeConfigError(f"token stream must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 2:
            raise RuntimeConfigError(f"seq_len must be at least 2, got {seq_len}")
        if tokens.numel() < seq_len:
            raise RuntimeConfigError(
                f"the corpus has {tokens.numel()} tokens, fewer than one sequence of {seq_len}: use a shorter "
                "--seq-len or a larger corpus"
            )
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.tokens[index * self.seq_len : (index + 1) * self.seq_len]


def pack_documents(documents: Iterable[Sequence[int]], seq_len: int, *, separator: int | None = None,
                   reset_positions: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Pack token lists into rows of ``seq_len`` tokens: ``{"input_ids", "position_ids"}`` of shape (seq_len,).

    Documents are concatenated (``separator`` appended to each, if given) and cut into rows; a document
    may continue in the next row. With ``reset_positions`` positions restart at 0 at each document start
    (HF packed format: the sharder turns the restarts into ``cu_seqlens`` and attention is
    document-masked, see the module doc); otherwise they run 0 .. seq_len-1 in every row (GPT-style
    packing, documents attend across the separator). A final partial row is dropped.
    """
    buffer: list[int] = []
    positions: list[int] = []
    for doc in documents:
        tokens = list(doc) + ([separator] if separator is not None else [])
        buffer.extend(tokens)
        positions.extend(range(len(tokens)))
        while len(buffer) >= seq_len:
            row, buffer = buffer[:seq_len], buffer[seq_len:]
            row_pos, positions = positions[:seq_len], positions[seq_len:]
            if reset_positions:  # a document continued from the previous row restarts at 0 in this one
                lead = _first_restart(row_pos)
                pos = [p - row_pos[0] for p in row_pos[:lead]] + row_pos[lead:]
            else:
                pos = list(range(seq_len))
            yield {"input_ids": torch.tensor(row, dtype=torch.int64), "position_ids": torch.tensor(pos)}


def _first_restart(positions: list[int]) -> int:
    """Index of the first document start after position 0 (len(positions) if none)."""
    return next((i for i, (a, b) in enumerate(itertools.pairwise(positions), start=1) if b <= a), len(positions))
