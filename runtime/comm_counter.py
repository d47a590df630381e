"""Opt-in accounting of the bytes this rank SENDS, per collective type and per pass.

The cost model predicts communication volume as bytes sent per GPU (see DESIGN.md section 3). To check
those predictions against what the runtime really does, every collective issued by ``runtime`` code
reports itself here at the call site, with the number of bytes that leave this rank:

* all-to-all over P ranks: the buffer minus this rank's own chunk, i.e. (P-1)/P of it;
* send/recv (ring attention): the full tensor handed to ``isend``;
* all-gather: the local shard sent to each of the P-1 others, (P-1)/P of the gathered tensor;
* reduce-scatter: (P-1)/P of the full (unsharded) input;
* all-reduce: 2(P-1)/P of the tensor (ring algorithm).

Counting is off unless a :class:`CommCounter` is active, so the hot path pays one list check.
Records are split by the pass that issued them: ``forward``, ``backward``, and ``recompute`` (a
forward-pass collective executed while autograd runs a backward pass, as activation checkpointing
does), so a model with checkpointing can be compared term by term with the cost model. Call sites
may also name the strategy a record belongs to (``tp`` for tensor parallelism's collectives, ``loss``
for the loss reduction), where the collective type alone does not say it: TP and FSDP both
all-gather, TP and the loss both all-reduce.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import torch

Collective = Literal["all_to_all", "send_recv", "all_reduce", "all_gather", "reduce_scatter"]
Phase = Literal["forward", "backward", "recompute"]

COLLECTIVES: tuple[str, ...] = ("all_to_all", "send_recv", "all_reduce", "all_gather", "reduce_scatter")
PHASES: tuple[str, ...] = ("forward", "backward", "recompute")

_ACTIVE: list[CommCounter] = []


class CommCounter:
    """Context manager collecting the bytes this rank sends inside its ``with`` block.

    Counters nest: every active counter sees every record. Each rank counts only its own sends, so
    compare per-rank numbers with the cost model's per-GPU figures.

    Example::

        with CommCounter() as counter:
            out = ctx.attention(q, k, v)
            out.sum().backward()
        counter.bytes("all_to_all", "forward")
    """

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str, str | None], int] = defaultdict(int)
        self._calls: dict[tuple[str, str, str | None], int] = defaultdict(int)

    def __enter__(self) -> CommCounter:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)

    def _add(self, collective: str, phase: str, strategy: str | None, nbytes: int) -> None:
        self._bytes[(collective, phase, strategy)] += nbytes
        self._calls[(collective, phase, strategy)] += 1

    @staticmethod
    def _sum(table: dict, collective: str | None, phase: str | None, strategy: str | None) -> int:
        return sum(
            n
            for (c, p, s), n in table.items()
            if (collective is None or c == collective) and (phase is None or p == phase)
            and (strategy is None or s == strategy)
        )

    def bytes(self, collective: str | None = None, phase: str | None = None, strategy: str | None = None) -> int:
        """Bytes sent, summed over the collectives, phases and strategies that match (None matches all)."""
        return self._sum(self._bytes, collective, phase, strategy)

    def calls(self, collective: str | None = None, phase: str | None = None, strategy: str | None = None) -> int:
        """Number of collective calls (a send/recv step counts once) that match."""
        return self._sum(self._calls, collective, phase, strategy)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{phase: {collective: bytes}}`` with every phase and collective present (zeros included)."""
        return {p: {c: self.bytes(c, p) for c in COLLECTIVES} for p in PHASES}

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()


def counting() -> bool:
    """True when at least one counter is active (call sites skip the arithmetic otherwise)."""
    return bool(_ACTIVE)


def _in_backward_pass() -> bool:
    """Whether autograd is currently executing a backward graph (this thread).

    Used to tell a forward collective re-run by activation checkpointing from the original forward.
    ``_current_graph_task_id`` is an internal but long-standing torch API; without it every forward
    call site counts as ``forward``.
    """
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def record(collective: Collective, nbytes: int, phase: Literal["forward", "backward"],
           strategy: str | None = None) -> None:
    """Report ``nbytes`` sent by this rank in one ``collective`` call issued by a ``phase`` call site
    (of ``strategy``, when the call site names one)."""
    if not _ACTIVE:
        return
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; use one of {', '.join(COLLECTIVES)}")
    effective = "recompute" if phase == "forward" and _in_backward_pass() else phase
    for counter in _ACTIVE:
        counter._add(collective, effective, strategy, int(nbytes))


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def record_all_to_all(buffer: torch.Tensor, world: int, phase: Literal["forward", "backward"],
                      strategy: str | None = None) -> None:
    """An all-to-all of ``buffer`` split in ``world`` equal chunks: this rank's own chunk stays home."""
    if _ACTIVE:
        record("all_to_all", tensor_bytes(buffer) * (world - 1) // world, phase, strategy)


def record_all_gather(shard: torch.Tensor, world: int, phase: Literal["forward", "backward"],
                      strategy: str | None = None) -> None:
    """An all-gather of equal ``shard``s: the shard goes to each of the other ``world - 1`` ranks."""
    if _ACTIVE:
        record("all_gather", tensor_bytes(shard) * (world - 1), phase, strategy)


def record_all_reduce(tensor: torch.Tensor, world: int, phase: Literal["forward", "backward"],
                      strategy: str | None = None) -> None:
    """A (ring) all-reduce of ``tensor``: reduce-scatter plus all-gather, 2(P-1)/P of it."""
    if _ACTIVE:
        record("all_reduce", 2 * tensor_bytes(tensor) * (world - 1) // world, phase, strategy)


def record_reduce_scatter(full: torch.Tensor, world: int, phase: Literal["forward", "backward"],
                          strategy: str | None = None) -> None:
    """A reduce-scatter of the full (unsharded) ``full``: everything but this rank's own shard is sent."""
    if _ACTIVE:
        record("reduce_scatter", tensor_bytes(full) * (world - 1) // world, phase, strategy)
