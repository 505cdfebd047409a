"""Prefix-block LRU caches, with views of what they held at an earlier time.

Telemetry samples instance state every T seconds, so a policy must see the blocks a
cache held at the last sample, not now. Copying thousands of block ids into a frozenset
at every sample would dominate the run time, so each cache remembers when each block
became resident (and, for recently evicted blocks, when it left): `as_of(t)` answers
membership at time t in O(1) without copying.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence


class BlockIndex:
    """Which caches may hold each block, for finding a block's holders among many caches.

    A cache is listed under a block from the block's insertion until it has left both the
    cache and its eviction history, so the list covers every cache whose `as_of` view (at
    any time within its history) holds the block: asking only those caches finds the same
    holders as asking every one.
    """

    __slots__ = ("_caches",)

    def __init__(self) -> None:
        self._caches: dict[int, set[PrefixCache]] = {}

    def caches(self, block: int) -> Collection[PrefixCache]:
        """The caches that may hold `block` (now or in their history); ask each to be sure."""
        return self._caches.get(block, ())

    def _add_all(self, blocks: Iterable[int], cache: PrefixCache) -> None:
        caches = self._caches
        for block in blocks:
            holders = caches.get(block)
            if holders is None:
                caches[block] = {cache}
            else:
                holders.add(cache)

    def _discard(self, block: int, cache: PrefixCache) -> None:
        holders = self._caches.get(block)
        if holders is not None:
            holders.discard(cache)
            if not holders:
                del self._caches[block]


class PrefixCache:
    """LRU set of prefix-block hashes with a capacity in blocks."""

    __slots__ = (
        "capacity_blocks",
        "_resident",
        "_members",
        "_evicted",
        "_history_s",
        "hits_tokens",
        "lookups_tokens",
        "_snapshot",
        "_index",
        "changed_s",
    )

    def __init__(
        self, capacity_blocks: int, history_s: float = 60.0, index: BlockIndex | None = None
    ) -> None:
        self.capacity_blocks = max(0, int(capacity_blocks))
        self._resident: OrderedDict[int, float] = OrderedDict()  # block -> resident since
        # The same blocks as a plain set, kept once `snapshot` is first asked for (decode
        # caches; prefill pools are read through `as_of`): a frozenset copies a set ten
        # times faster than an OrderedDict's keys (~2 µs against ~20 µs for 976 blocks).
        self._members: set[int] | None = None
        # block -> (since, until): what `as_of` reads, up to `history_s` back (0: nothing;
        # the cache is then only read as of now).
        self._evicted: dict[int, tuple[float, float]] = {}
        self._history_s = history_s
        self.hits_tokens = 0
        self.lookups_tokens = 0
        self._snapshot: frozenset[int] | None = None
        self._index = index
        self.changed_s = -math.inf
        """When a block last joined or left (a recency update changes no membership)."""

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, block: object) -> bool:
        return block in self._resident

    def __iter__(self) -> Iterator[int]:
        return iter(self._resident)

    def leading_hits(self, blocks: Sequence[int]) -> int:
        """How many leading blocks are resident now (stops at the first miss)."""
        resident = self._resident
        count = 0
        for block in blocks:
            if block not in resident:
                break
            count += 1
        return count

    def insert(self, blocks: Sequence[int], now_s: float) -> None:
        """Mark `blocks` most recently used, adding the missing ones and evicting the LRU."""
        if self.capacity_blocks == 0:
            return
        resident = self._resident
        move_to_end = resident.move_to_end
        added = []
        for block in blocks[-self.capacity_blocks :]:
            if block in resident:
                move_to_end(block)
            else:
                resident[block] = now_s
                added.append(block)
        if not added:
            return  # only recency changed: no block joined, none is evicted
        self._snapshot = None
        self.changed_s = now_s
        if self._members is not None:
            self._members.update(added)
        if self._index is not None:
            self._index._add_all(added, self)
        self._evict(now_s)

    def _evict(self, now_s: float) -> None:
        """Drop the least recently used blocks over capacity, remembering when they left."""
        resident, members = self._resident, self._members
        popitem = resident.popitem
        evicted = self._evicted if self._history_s > 0 else None
        for _ in range(len(resident) - self.capacity_blocks):
            block, since_s = popitem(False)
            if members is not None:
                members.discard(block)
            if evicted is not None:
                evicted[block] = (since_s, now_s)
        if evicted is not None and len(evicted) > 4 * self.capacity_blocks + 1024:
            horizon_s = now_s - self._history_s
            self._evicted = {b: span for b, span in evicted.items() if span[1] >= horizon_s}
            if self._index is not None:
                for block in evicted.keys() - self._evicted.keys() - resident.keys():
                    self._index._discard(block, self)

    def snapshot(self) -> frozenset[int]:
        """The blocks resident now, as one frozenset shared until a block joins or leaves.

        Telemetry reports an instance's blocks at every change of the instance, and most
        changes (a decode step, a memory grant) leave its cache as it was.
        """
        if self._snapshot is None:
            if self._members is None:
                self._members = set(self._resident)
            self._snapshot = frozenset(self._members)
        return self._snapshot

    def as_of(self, time_s: float) -> ResidentView:
        """A membership view of the blocks resident at `time_s` (within the history)."""
        return ResidentView(self, time_s)

    def _was_resident(self, block: int, time_s: float) -> bool:
        since_s = self._resident.get(block)
        if since_s is not None:
            if since_s <= time_s:
                return True
        span = self._evicted.get(block)
        return span is not None and span[0] <= time_s < span[1]


class ResidentView:
    """Read-only `in` over a cache's contents at one past instant (what telemetry saw)."""

    __slots__ = ("_cache", "_resident", "time_s")

    def __init__(self, cache: PrefixCache, time_s: float) -> None:
        self._cache = cache
        self._resident = cache._resident
        self.time_s = time_s

    def __contains__(self, block: object) -> bool:
        # Inlined `_was_resident`: decisions ask this for every block of every candidate.
        since_s = self._resident.get(block)  # type: ignore[call-overload]
        if since_s is not None and since_s <= self.time_s:
            return True
        span = self._cache._evicted.get(block)  # type: ignore[call-overload]
        return span is not None and span[0] <= self.time_s < span[1]

    def leading(self, blocks: Sequence[int]) -> int:
        """How many of `blocks`, from the first on, were resident at `time_s`."""
        cache = self._cache
        if cache.changed_s <= self.time_s:
            # No block joined or left since: the contents now are the contents then, and
            # the cache's own lookup runs without a Python call per block.
            return cache.leading_hits(blocks)
        count = 0
        for block in blocks:
            if block not in self:
                break
            count += 1
        return count

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self) -> Iterator[int]:
        cache = self._cache
        seen = [b for b in cache._resident if cache._was_resident(b, self.time_s)]
        seen.extend(
            b
            for b in cache._evicted
            if cache._was_resident(b, self.time_s) and b not in cache._resident
        )
        return iter(seen)

    def __bool__(self) -> bool:
        return len(self._cache) > 0 or bool(self._cache._evicted)
