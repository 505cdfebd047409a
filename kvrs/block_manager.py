"""Which physical KV blocks hold what: reference counts, prefix hashes, least-recently-used reuse.

A worker keeps KV in a pool of fixed-size blocks (`block_tokens` positions each, the
cluster's prefix-block size); a sequence is a table of block ids. This module is the
bookkeeping of that pool, with no tensors in it:

- **References.** Every sequence that lists a block in its table holds one reference;
  a prompt whose leading blocks are already resident shares them (one more reference
  each) instead of computing or copying them.
- **Prefix hashes.** A full prompt block can be published under its chained prefix hash
  (`kvrs.tokenizer.prefix_block_hashes`), so a resident hash means the whole prefix up to
  and including that block is resident. These are the hashes heartbeats advertise and
  placement prices.
- **Reuse.** A block whose last reference goes away is free; if it carries a hash it
  stays *cached* — still found by `lookup`, still advertised — until its room is needed,
  the least recently used going first. A referenced block is never taken.

Pure bookkeeping, as the block managers of vLLM-style engines are: the worker's
`KvPool` holds the tensors and calls this under its lock.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvrs.errors import InvalidArgument, ResourceExhausted

__all__ = ["BlockManager"]


class BlockManager:
    """Allocation, sharing and prefix caching of `num_blocks` KV blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise InvalidArgument("num_blocks", f"must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        """Blocks holding nothing; popped from the end, so low ids go first."""
        self._cached: OrderedDict[int, None] = OrderedDict()
        """Unreferenced blocks that still carry a hash, least recently used first."""
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._last_used: dict[int, int] = {}
        """Per published block, when it was last shared or released (for `hashes`)."""
        self._clock = itertools.count()

    # -- counts -----------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all."""
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Unreferenced blocks kept for their prefix hash (reusable, and evictable)."""
        return len(self._cached)

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation may take: the free ones, then the cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.available_blocks

    def refs(self, block: int) -> int:
        return self._refs[self._check(block)]

    def hash_of(self, block: int) -> int | None:
        """The prefix hash `block` is published under, if any."""
        return self._hash_of.get(self._check(block))

    # -- allocation and sharing -------------------------------------------------------

    def grow(self, blocks: int) -> None:
        """Add `blocks` new, free blocks (ids after the existing ones)."""
        if blocks < 0:
            raise InvalidArgument("blocks", f"must be >= 0, got {blocks}")
        start = self.num_blocks
        self.num_blocks += blocks
        self._refs.extend([0] * blocks)
        self._free[:0] = range(self.num_blocks - 1, start - 1, -1)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, one reference each: free ones first, then the least recently
        used cached ones (their hashes are forgotten). ResourceExhausted, taking nothing,
        when fewer are available."""
        if count < 0:
            raise InvalidArgument("count", f"must be >= 0, got {count}")
        if count > self.available_blocks:
            raise ResourceExhausted(
                f"needs {count} KV blocks, {self.available_blocks} of {self.num_blocks} "
                "available and the rest in use"
            )
        taken: list[int] = []
        while len(taken) < count and self._free:
            taken.append(self._free.pop())
        while len(taken) < count:
            block, _ = self._cached.popitem(last=False)
            self._forget_hash(block)
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
        return taken

    def share(self, blocks: Iterable[int]) -> None:
        """One more reference on each of `blocks`, which must be resident: referenced, or
        cached (which takes it out of the eviction order)."""
        blocks = [self._check(b) for b in blocks]
        for block in blocks:
            if self._refs[block] == 0 and block not in self._cached:
                raise InvalidArgument("blocks", f"block {block} holds nothing to share")
        for block in blocks:
            self._cached.pop(block, None)
            self._refs[block] += 1
            self._touch(block)

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each of `blocks`. A block left unreferenced is free, or
        cached (most recently used) when it carries a hash."""
        blocks = [self._check(b) for b in blocks]
        for block in blocks:
            if self._refs[block] <= 0:
                raise InvalidArgument("blocks", f"block {block} is not in use")
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._cached[block] = None
                self._touch(block)
            else:
                self._free.append(block)

    # -- prefix hashes ----------------------------------------------------------------

    def publish(self, block: int, block_hash: int) -> bool:
        """Name the referenced, full `block` by its chained prefix hash, so later prompts
        find it. False (nothing changes) when that hash already names a block or this
        block already carries a hash: the first copy of a prefix is the shared one."""
        self._check(block)
        if self._refs[block] <= 0:
            raise InvalidArgument("block", f"block {block} is not in use")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._touch(block)
        return True

    def unpublish(self, block: int) -> None:
        """Forget `block`'s hash (its owner is about to write into it)."""
        if self._check(block) in self._cached:
            raise InvalidArgument("block", f"block {block} is cached, not owned")
        self._forget_hash(block)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The resident blocks of the leading `hashes` (a prompt's chain, in order), up to
        the first one that is not resident. Takes no reference: `share` them."""
        blocks: list[int] = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def hashes(self, limit: int | None = None) -> list[int]:
        """Every published hash, most recently used first (what a heartbeat advertises)."""
        ordered = sorted(self._last_used.items(), key=lambda item: -item[1])
        return [self._hash_of[block] for block, _ in ordered[:limit]]

    # -- internals --------------------------------------------------------------------

    def _check(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise InvalidArgument("block", f"{block} is outside [0, {self.num_blocks})")
        return block

    def _touch(self, block: int) -> None:
        if block in self._hash_of:
            self._last_used[block] = next(self._clock)

    def _forget_hash(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            del self._last_used[block]
