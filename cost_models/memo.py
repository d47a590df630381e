"""Bounded memo tables for the cost model's hot paths.

``functools.lru_cache`` keys on every argument; the planner's inner loop calls the cost model with
TrainSpecs that differ in fields a given sub-computation never reads (ZeRO stage for FLOPs,
offloading for collectives, ...). These tables are keyed on exactly the inputs a computation depends
on, which the caller names, so the thousands of option combinations a search scores share results.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

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
