"""A model of PyTorch's CUDA caching allocator, to turn an alloc/free sequence into reserved memory.

``torch.cuda.max_memory_reserved()`` (and NVML's used memory, which adds the CUDA context and NCCL)
exceeds the allocated peak because freed blocks stay cached and a request that no cached block fits
needs fresh memory while the too-small (or badly placed) free blocks stay reserved. How much depends on
the order and sizes of the allocations, so instead of a flat fraction the timeline replays the liveness
simulation's events of the peak phase (:mod:`.liveness`, ``trace=True``) through this model.

What is modelled (c10/cuda/CUDACachingAllocator.cpp):

- sizes round up to 512 B (``kMinBlockSize``); requests of at most 1 MiB (``kSmallSize``) come from the
  small pool (2 MiB segments), larger ones from the large pool; pools are per stream (one stream here);
- a request takes the smallest cached free block that holds it (best fit, lowest address on ties) and
  splits off the remainder (large pool: when it exceeds 1 MiB; with expandable segments: always);
- a freed block merges with free neighbours of the same segment;
- ``segments`` (the default): a miss cudaMallocs a new segment of the request rounded up to 2 MiB
  (``kRoundLarge``; 20 MiB ``kLargeBuffer`` below 10 MiB, 2 MiB ``kSmallBuffer`` for the small pool); a
  segment is never returned (until empty_cache or an out-of-memory retry), so blocks cached in partly
  used segments stay reserved;
- ``expandable`` (``expandable_segments:True``): one segment per pool and stream, a virtual range whose
  physical pages (20 MiB large, 2 MiB small) are mapped on demand at its end; a miss extends the free
  block at the end (or appends) by whole pages. Holes below live blocks stay mapped.

The reserved high-water mark minus the live high-water mark is the fragmentation of that sequence.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..units import MiB

MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB


def round_size(nbytes: int) -> int:
    """The allocator's request size: at least 512 B, a multiple of 512 B."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """cudaMalloc size for a miss of ``nbytes`` (already rounded), non-expandable mode."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    addr: int
    size: int
    segment: int
    free: bool = True


@dataclass
class _Pool:
    """Blocks of one pool (small or large) of one stream, with a sorted index of the free ones."""

    small: bool
    expandable: bool
    blocks: dict[int, _Block] = field(default_factory=dict)  # addr -> block
    order: list[int] = field(default_factory=list)  # sorted block addresses
    free_index: list[tuple[int, int]] = field(default_factory=list)  # sorted (size, addr) of free blocks
    next_addr: int = 0
    reserved: int = 0

    def _insert(self, b: _Block) -> None:
        self.blocks[b.addr] = b
        bisect.insort(self.order, b.addr)
        if b.free:
            bisect.insort(self.free_index, (b.size, b.addr))

    def _remove(self, b: _Block) -> None:
        del self.blocks[b.addr]
        self.order.pop(bisect.bisect_left(self.order, b.addr))
        if b.free:
            self.free_index.pop(bisect.bisect_left(self.free_index, (b.size, b.addr)))

    def _neighbour(self, b: _Block, step: int) -> _Block | None:
        i = bisect.bisect_left(self.order, b.addr) + step
        if 0 <= i < len(self.order):
            n = self.blocks[self.order[i]]
            if n.segment == b.segment:
                return n
        return None

    def _should_split(self, remaining: int) -> bool:
        if self.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _take(self, b: _Block, size: int) -> int:
        """Allocate ``size`` from the start of free block ``b`` (splitting off the rest)."""
        self._remove(b)
        rest = b.size - size
        if self._should_split(rest):
            self._insert(_Block(b.addr + size, rest, b.segment, True))
            b.size = size
        b.free = False
        self._insert(b)
        return b.addr

    def malloc(self, size: int) -> int:
        i = bisect.bisect_left(self.free_index, (size, -1))
        if i < len(self.free_index):
            return self._take(self.blocks[self.free_index[i][1]], size)
        if self.expandable:
            page = SMALL_BUFFER if self.small else LARGE_BUFFER
            tail = self.blocks[self.order[-1]] if self.order else None
            if tail is not None and tail.free:
                grow = -(-(size - tail.size) // page) * page
                self._remove(tail)
                tail.size += grow
                self._insert(tail)
                self.reserved += grow
                self.next_addr += grow
                return self._take(tail, size)
            grow = -(-size // page) * page
            b = _Block(self.next_addr, grow, 0, True)
            self.next_addr += grow
            self.reserved += grow
            self._insert(b)
            return self._take(b, size)
        seg = SMALL_BUFFER if self.small else segment_size(size)
        b = _Block(self.next_addr, seg, self.next_addr, True)
        self.next_addr += seg
        self.reserved += seg
        self._insert(b)
        return self._take(b, size)

    def release(self, addr: int) -> None:
        b = self.blocks[addr]
        prev, nxt = self._neighbour(b, -1), self._neighbour(b, 1)
        self._remove(b)
        b.free = True
        if prev is not None and prev.free:
            self._remove(prev)
            prev.size += b.size
            b = prev
        if nxt is not None and nxt.free:
            self._remove(nxt)
            b.size += nxt.size
        self._insert(b)


class AllocatorModel:
    """One stream's caching allocator (a small and a large pool); ``mode`` 'expandable' or 'segments'."""

    def __init__(self, mode: str) -> None:
        expandable = mode == "expandable"
        self.pools = {True: _Pool(True, expandable), False: _Pool(False, expandable)}
        self.live: dict[object, tuple[bool, int, int]] = {}  # key -> (small, addr, rounded size)
        self.allocated = 0
        self.peak_allocated = 0
        self.peak_reserved = 0

    @property
    def reserved(self) -> int:
        return self.pools[True].reserved + self.pools[False].reserved

    def malloc(self, key: object, nbytes: int) -> None:
        if nbytes <= 0 or key in self.live:
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        addr = self.pools[small].malloc(size)
        self.live[key] = (small, addr, size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key: object) -> None:
        entry = self.live.pop(key, None)
        if entry is None:
            return
        small, addr, size = entry
        self.pools[small].release(addr)
        self.allocated -= size


#: One allocator event: ('a', key, nbytes) allocates, ('f', key, 0) frees.
Event = tuple[str, object, int]


def replay(events: Iterable[Event], mode: str) -> AllocatorModel:
    """Run ``events`` through a fresh allocator; the result holds the live and reserved high-water marks."""
    model = AllocatorModel(mode)
    for kind, key, nbytes in events:
        if kind == "a":
            model.malloc(key, nbytes)
        else:
            model.free(key)
    return model


def fragmentation(events: Iterable[Event], mode: str) -> int:
    """Reserved bytes above the live peak after replaying ``events`` (>= 0)."""
    model = replay(events, mode)
    return max(0, model.peak_reserved - model.peak_allocated)


__all__ = ["AllocatorModel", "Event", "fragmentation", "replay", "round_size", "segment_size"]
