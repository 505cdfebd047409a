"""Resident KV of one worker: leases, eviction, and the prefix blocks prompts share.

A request's KV stays here after hand-off (the prefill side keeps it for a possible
migration) until it is released, its lease runs out, or memory is needed: then
expired entries go first, least recently used next. Entries in use (a decode step, a
transfer) are pinned and never evicted.

The memory is the worker's `KvPool`, in blocks. Every full prompt block a request
computed or received is published under its chained prefix hash, so a later prompt
that starts the same way shares those blocks instead of computing them; when the last
request holding such a block goes, the block stays cached for later prompts until its
room is needed (`kvrs.block_manager` decides). Lives on the event loop; only the
tensors are touched from compute and transfer threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrs.errors import NotFound, ResourceExhausted
from kvrs.sampling import Sampling
from kvrs.tokenizer import prefix_block_hashes
from services.worker.paged_kv import KvCache, KvPool

Clock = Callable[[], float]


@dataclass(eq=False)
class Resident:
    """One request's KV on this worker."""

    request_id: str
    cache: KvCache
    token_ids: list[int]
    """Token ids of the resident positions (len == cache.length once committed)."""
    prompt_tokens: int
    """Positions before generated token 0 (Decode counts generated tokens from here)."""
    lease_s: float
    expires_at_s: float
    last_used_s: float
    next_token_id: int | None = None
    """Greedy token after the last resident position, when computed here."""
    first_token_id: int | None = None
    """Prefill's answer, so a retried Prefill gets the same one."""
    prefix_hit_tokens: int = 0
    """Leading tokens whose KV came from this worker's resident prefix blocks."""
    sampling: Sampling = field(default_factory=Sampling)
    """How this request's tokens are drawn (the last Prefill, Decode or Extend's say)."""
    pins: int = 0
    release_pending: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _block_hashes: list[int] = field(default_factory=list)

    def block_hashes(self, block_tokens: int) -> list[int]:
        """Prefix-block hashes of the resident tokens (extended as the sequence grows)."""
        full_blocks = min(len(self.token_ids), self.resident_tokens) // block_tokens
        if len(self._block_hashes) != full_blocks:
            self._block_hashes = prefix_block_hashes(
                self.token_ids[: full_blocks * block_tokens], block_tokens
            )
        return self._block_hashes

    @property
    def resident_tokens(self) -> int:
        return self.cache.length


class KvStore:
    """The resident requests and the pool of blocks they share."""

    def __init__(self, pool: KvPool, clock: Clock = time.monotonic) -> None:
        self.pool = pool
        self.block_tokens = pool.block_tokens
        self.bytes_per_token = pool.bytes_per_token
        self.capacity_blocks = pool.num_blocks
        self._clock = clock
        self._entries: dict[str, Resident] = {}
        self._added = asyncio.Event()
        """Set (and replaced) whenever an entry is added."""
        self.evicted = 0
        self.expired = 0

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    @property
    def free_blocks(self) -> int:
        """Blocks a new request can have: free ones and cached prefix blocks."""
        return self.pool.available_blocks()

    @property
    def used_bytes(self) -> int:
        """Memory of the blocks requests hold."""
        return (self.capacity_blocks - self.free_blocks) * self.pool.block_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def request_ids(self) -> list[str]:
        return list(self._entries)

    def find(self, request_id: str) -> Resident | None:
        return self._entries.get(request_id)

    def get(self, request_id: str) -> Resident:
        """The resident request; NotFound (naming request_id) when it is not here."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise NotFound(
                f"request {request_id!r} has no KV on this worker (never "
                "computed here, released, expired or evicted)",
                field="request_id",
            )
        return entry

    def add(
        self,
        request_id: str,
        reserved_tokens: int,
        lease_s: float,
        prompt_tokens: int = 0,
        shared: list[int] | None = None,
    ) -> Resident:
        """A new, pinned entry with room for `reserved_tokens` positions (evicting others
        for it), starting with the `shared` resident blocks (`reusable_prefix`)."""
        shared = shared or []
        cache = self.pool.new_cache(0, shared)  # shared first: cached ones are no room
        try:
            self._make_room(self.blocks(reserved_tokens) - len(shared), exclude=None)
            cache.reserve(reserved_tokens)
        except BaseException:
            cache.free()
            raise
        now = self._clock()
        entry = Resident(
            request_id=request_id,
            cache=cache,
            token_ids=[],
            prompt_tokens=prompt_tokens,
            lease_s=lease_s,
            expires_at_s=now + lease_s,
            last_used_s=now,
            prefix_hit_tokens=cache.length,
            pins=1,
        )
        self._entries[request_id] = entry
        self._added.set()
        self._added = asyncio.Event()
        return entry

    async def arrival(self, request_id: str, timeout_s: float) -> Resident | None:
        """The entry of `request_id`, waiting up to `timeout_s` for it to be added (a
        pull streamed from a prefill may reach this worker before the prefill does)."""
        deadline = time.monotonic() + timeout_s
        while (entry := self._entries.get(request_id)) is None:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._added.wait(), remaining_s)
        return entry

    def grow(self, entry: Resident, tokens: int) -> None:
        """Room for `entry` to reach `tokens` positions (evicting others for it)."""
        missing = self.blocks(tokens) - len(entry.cache.blocks)
        if missing > 0:
            self._make_room(missing, exclude=entry)
        entry.cache.reserve(tokens)

    def pin(self, entry: Resident) -> None:
        entry.pins += 1
        self.touch(entry)

    def unpin(self, entry: Resident) -> None:
        """Done using `entry`; a release requested meanwhile happens now."""
        entry.pins -= 1
        self.touch(entry)
        if entry.pins == 0 and entry.release_pending:
            self._remove(entry)

    def touch(self, entry: Resident) -> None:
        entry.last_used_s = self._clock()
        entry.expires_at_s = entry.last_used_s + entry.lease_s

    def discard(self, entry: Resident) -> None:
        """Drop an entry whose computation or transfer failed."""
        if self._entries.get(entry.request_id) is entry:
            self._remove(entry)

    def release(self, request_id: str) -> int:
        """Free a request's KV now, or when its current user is done; bytes freed (0: absent)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return 0
        freed = entry.cache.resident_bytes()
        if entry.pins:
            entry.release_pending = True
        else:
            self._remove(entry)
        return freed

    def expire(self) -> list[str]:
        """Remove unpinned entries whose lease has run out; their request ids."""
        now = self._clock()
        gone = [e for e in self._entries.values() if not e.pins and e.expires_at_s <= now]
        for entry in gone:
            self._remove(entry)
        self.expired += len(gone)
        return [e.request_id for e in gone]

    def _make_room(self, blocks: int, exclude: Resident | None) -> None:
        """At least `blocks` blocks available: expired entries go first, then unpinned
        ones, least recently used first (cached prefix blocks count as available: the
        pool takes them, least recently used first, before it runs out)."""
        if blocks <= self.free_blocks:
            return
        self.expire()
        candidates = sorted(
            (e for e in self._entries.values() if not e.pins and e is not exclude),
            key=lambda e: e.last_used_s,
        )
        while blocks > self.free_blocks and candidates:
            self._remove(candidates.pop(0))
            self.evicted += 1
        if blocks > self.free_blocks:
            raise ResourceExhausted(
                f"needs {blocks} KV blocks of {self.block_tokens} tokens, "
                f"{self.free_blocks} of {self.capacity_blocks} free and the "
                "rest in use"
            )

    def _remove(self, entry: Resident) -> None:
        """Forget `entry` and give its blocks back (published ones stay cached)."""
        self._entries.pop(entry.request_id, None)
        entry.cache.free()

    # -- prefix blocks ----------------------------------------------------------------

    def publish(self, entry: Resident) -> None:
        """Offer `entry`'s full prompt blocks to later prompts that start the same way."""
        full = min(entry.prompt_tokens, entry.resident_tokens) // self.block_tokens
        entry.cache.publish(entry.block_hashes(self.block_tokens)[:full])

    def reusable_prefix(self, token_ids: list[int], limit_tokens: int) -> list[int]:
        """The resident blocks of the leading full blocks of `token_ids` (within
        `limit_tokens`), for `add` to share. Take them before the next await: until an
        entry shares them, cached ones may be given to others."""
        return self.pool.lookup(prefix_block_hashes(token_ids[:limit_tokens], self.block_tokens))

    def prefix_hashes(self, limit: int = 4096) -> list[int]:
        """Hashes of the full prefix blocks resident here (most recently used first)."""
        return self.pool.hashes(limit)
