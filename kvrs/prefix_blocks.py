"""Which prefix blocks of KV a worker keeps, by chain hash: reference counts and LRU order.

A block is `block_tokens` tokens of KV named by its chained prefix hash
(`kvrs.tokenizer.prefix_block_hashes`), so a resident hash means the whole prefix up to
and including that block is resident. A request starting with resident blocks reuses
them instead of computing them; blocks no request uses stay until memory is needed, the
least recently used going first, and a block in use is never evicted. Pure bookkeeping:
the worker holds the tensors, this decides which ones live.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvrs.errors import InvalidArgument

__all__ = ["PrefixBlocks"]


@dataclass
class _Block:
    refs: int
    last_used: int


class PrefixBlocks:
    """Resident prefix blocks: lookup by prefix, pin while in use, LRU eviction."""

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def resident_prefix(self, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a prompt's chain, in order) are resident from the start."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def acquire(self, hashes: Iterable[int]) -> None:
        """Pin resident blocks (a request is reading them); InvalidArgument if one is not."""
        hashes = list(hashes)
        missing = [h for h in hashes if h not in self._blocks]
        if missing:
            raise InvalidArgument("hashes", f"block {missing[0]:#x} is not resident")
        for block_hash in hashes:
            block = self._blocks[block_hash]
            block.refs += 1
            block.last_used = next(self._clock)

    def release(self, hashes: Iterable[int]) -> None:
        """Unpin blocks `acquire` pinned (they stay resident, most recently used)."""
        for block_hash in hashes:
            block = self._blocks[block_hash]
            if block.refs <= 0:
                raise InvalidArgument("hashes", f"block {block_hash:#x} is not in use")
            block.refs -= 1
            block.last_used = next(self._clock)

    def insert(self, block_hash: int) -> bool:
        """Make `block_hash` resident (unpinned, most recently used); False if it was."""
        if block_hash in self._blocks:
            self._blocks[block_hash].last_used = next(self._clock)
            return False
        self._blocks[block_hash] = _Block(refs=0, last_used=next(self._clock))
        return True

    def evict(self, count: int) -> list[int]:
        """Drop up to `count` unpinned blocks, least recently used first; their hashes."""
        idle = sorted(
            (block.last_used, block_hash)
            for block_hash, block in self._blocks.items()
            if block.refs == 0
        )
        gone = [block_hash for _, block_hash in idle[: max(0, count)]]
        for block_hash in gone:
            del self._blocks[block_hash]
        return gone

    @property
    def evictable(self) -> int:
        """Blocks no request is using."""
        return sum(1 for block in self._blocks.values() if block.refs == 0)

    def hashes(self) -> list[int]:
        """Every resident hash, most recently used first."""
        return [h for h, _ in sorted(self._blocks.items(), key=lambda kv: -kv[1].last_used)]
