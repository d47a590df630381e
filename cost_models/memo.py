"""Bounded memo tables for the cost model's hot paths.

``functools.lru_cache`` keys on every argument; the planner's inner loop calls the cost model with
TrainSpecs that differ in fields a given sub-computation never reads (ZeRO stage for FLOPs,
offloading for collectives, ...). These tables are keyed on exactly the inputs a computation depends
on, which the caller names, so the thousands of option combinations a search scores share results.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Memo(Generic[T]):
    """A dict cache cleared wholesale when full (entries are cheap to recompute; no LRU bookkeeping
    on the hot path)."""

    def __init__(self, max_entries: int = 16384):
        self.max_entries = max_entries
        self._table: dict[Hashable, T] = {}

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        value = self._table.get(key)
        if value is None:
            if len(self._table) >= self.max_entries:
                self._table.clear()
            value = self._table[key] = compute()
        return value

    def clear(self) -> None:
        self._table.clear()

    def __len__(self) -> int:
        return len(self._table)


def hash_once(model: Any) -> int:
    """The hash of a frozen pydantic model (no extra fields), computed on its first use and kept in the
    model's ``_hash`` slot: the memo tables key on specs thousands of times per search, and pydantic's own
    hash re-hashes every field each time. The value is pydantic's (the fields' values, in order), so equal
    models still hash equal. A class opts in with ``__slots__ = ("_hash",)`` and ``__hash__ = hash_once``;
    a slot, not a private attribute, which would take part in equality. Copies and unpickled models do not
    carry it and compute it again."""
    try:
        return model._hash
    except AttributeError:
        value = hash(tuple(model.__dict__.values()))
        object.__setattr__(model, "_hash", value)
        return value
