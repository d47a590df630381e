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


class _Pool:
    """Blocks of one pool (small or large) of one stream. A block is ``[size, segment, free]`` keyed by its
    address; ``ends`` maps each block's end address to its start (O(1) neighbours); ``free_index`` is the
    sorted (size, address) list of free blocks (best fit by bisection)."""

    __slots__ = ("small", "expandable", "blocks", "ends", "free_index", "next_addr", "reserved")

    def __init__(self, small: bool, expandable: bool) -> None:
        self.small = small
        self.expandable = expandable
        self.blocks: dict[int, list] = {}
        self.ends: dict[int, int] = {}
        self.free_index: list[tuple[int, int]] = []
        self.next_addr = 0
        self.reserved = 0

    def _insert(self, addr: int, size: int, segment: int, free: bool) -> None:
        self.blocks[addr] = [size, segment, free]
        self.ends[addr + size] = addr
        if free:
            bisect.insort(self.free_index, (size, addr))

    def _remove(self, addr: int) -> list:
        b = self.blocks.pop(addr)
        del self.ends[addr + b[0]]
        if b[2]:
            del self.free_index[bisect.bisect_left(self.free_index, (b[0], addr))]
        return b

    def _should_split(self, remaining: int) -> bool:
        if self.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _take(self, addr: int, size: int) -> int:
        """Allocate ``size`` from the start of the free block at ``addr`` (splitting off the rest)."""
        bsize, segment, _ = self._remove(addr)
        rest = bsize - size
        if self._should_split(rest):
            self._insert(addr + size, rest, segment, True)
            bsize = size
        self._insert(addr, bsize, segment, False)
        return addr

    def malloc(self, size: int) -> int:
        i = bisect.bisect_left(self.free_index, (size, -1))
        if i < len(self.free_index):
            return self._take(self.free_index[i][1], size)
        if self.expandable:
            page = SMALL_BUFFER if self.small else LARGE_BUFFER
            tail = self.ends.get(self.next_addr)
            if tail is not None and self.blocks[tail][2]:
                tail_size = self._remove(tail)[0]
                grow = -(-(size - tail_size) // page) * page
                self._insert(tail, tail_size + grow, 0, True)
            else:
                grow = -(-size // page) * page
                tail = self.next_addr
                self._insert(tail, grow, 0, True)
            self.next_addr += grow
            self.reserved += grow
            return self._take(tail, size)
        seg = SMALL_BUFFER if self.small else segment_size(size)
        addr = self.next_addr
        self.next_addr += seg
        self.reserved += seg
        self._insert(addr, seg, addr, True)
        return self._take(addr, size)

    def release(self, addr: int) -> None:
        size, segment, _ = self._remove(addr)
        prev = self.ends.get(addr)
        if prev is not None:
            p = self.blocks[prev]
            if p[2] and p[1] == segment:
                size += self._remove(prev)[0]
                addr = prev
        nxt = self.blocks.get(addr + size)
        if nxt is not None and nxt[2] and nxt[1] == segment:
            size += self._remove(addr + size)[0]
        self._insert(addr, size, segment, True)


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
