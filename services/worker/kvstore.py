"""Resident KV of one worker: leases, a memory budget in blocks, prefix blocks, eviction.

A request's KV stays here after hand-off (the prefill side keeps it for a possible
migration) until it is released, its lease runs out, or memory is needed: then
expired entries go first, least recently used next. Entries in use (a decode step, a
transfer) are pinned and never evicted.

Besides the requests, the store keeps prefix blocks: copies of the KV of every full
prompt block a request computed or received, under its chained prefix hash
(`kvrs.prefix_blocks` decides which live). A later prompt starting with those blocks
reuses them; they share the budget and are the first thing given up when memory is
needed, least recently used first, never one a request is reading. Lives on the event
loop; only the tensors are touched from compute threads.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrs.errors import NotFound, ResourceExhausted
from kvrs.prefix_blocks import PrefixBlocks
from kvrs.sampling import Sampling
from kvrs.tokenizer import prefix_block_hashes
from services.worker.model import KvCache

Clock = Callable[[], float]


@dataclass
class PrefixReuse:
    """Resident KV a new request starts from: per block, per layer (key, value)."""

    blocks: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    """Kept prefix blocks pinned for the copy."""
    entries: list[Resident] = field(default_factory=list)
    """Resident requests pinned for the copy."""


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
    reserved_tokens: int = 0
    """Tokens the budget holds for this entry (>= resident, while it grows)."""
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
    """The resident requests and the block budget they share."""

    def __init__(
        self,
        capacity_bytes: int,
        bytes_per_token: int,
        block_tokens: int,
        clock: Clock = time.monotonic,
    ) -> None:
        self.block_tokens = block_tokens
        self.bytes_per_token = bytes_per_token
        self.capacity_blocks = capacity_bytes // (block_tokens * bytes_per_token)
        self._clock = clock
        self._entries: dict[str, Resident] = {}
        self.prefix = PrefixBlocks()
        self._prefix_kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.evicted = 0
        self.expired = 0

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    @property
    def used_blocks(self) -> int:
        return len(self.prefix) + sum(
            self.blocks(e.reserved_tokens) for e in self._entries.values()
        )

    @property
    def free_blocks(self) -> int:
        return max(0, self.capacity_blocks - self.used_blocks)

    @property
    def used_bytes(self) -> int:
        blocks = len(self.prefix) * self.block_tokens * self.bytes_per_token
        return blocks + sum(e.cache.resident_bytes() for e in self._entries.values())

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
        cache: KvCache,
        reserved_tokens: int,
        lease_s: float,
        prompt_tokens: int = 0,
    ) -> Resident:
        """A new, pinned entry holding `reserved_tokens` of the budget (evicting for it)."""
        self._make_room(self.blocks(reserved_tokens), exclude=None)
        now = self._clock()
        entry = Resident(
            request_id=request_id,
            cache=cache,
            token_ids=[],
            prompt_tokens=prompt_tokens,
            lease_s=lease_s,
            expires_at_s=now + lease_s,
            last_used_s=now,
            reserved_tokens=reserved_tokens,
            pins=1,
        )
        self._entries[request_id] = entry
        return entry

    def grow(self, entry: Resident, tokens: int) -> None:
        """Reserve room for `entry` to reach `tokens` positions (evicting others for it)."""
        if tokens <= entry.reserved_tokens:
            return
        extra = self.blocks(tokens) - self.blocks(entry.reserved_tokens)
        self._make_room(extra, exclude=entry)
        entry.reserved_tokens = tokens

    def pin(self, entry: Resident) -> None:
        entry.pins += 1
        self.touch(entry)

    def unpin(self, entry: Resident) -> None:
        """Done using `entry`; a release requested meanwhile happens now."""
        entry.pins -= 1
        self.touch(entry)
        if entry.pins == 0 and entry.release_pending:
            self._remove(entry, retain=True)

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
            self._remove(entry, retain=True)
        return freed

    def expire(self) -> list[str]:
        """Remove unpinned entries whose lease has run out; their request ids."""
        now = self._clock()
        gone = [e for e in self._entries.values() if not e.pins and e.expires_at_s <= now]
        for entry in gone:
            self._remove(entry, retain=True)
        self.expired += len(gone)
        return [e.request_id for e in gone]

    def _make_room(self, blocks: int, exclude: Resident | None) -> None:
        if blocks <= self.free_blocks:
            return
        self.expire()
        self._drop_prefix_blocks(blocks - self.free_blocks)
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

    def _remove(self, entry: Resident, retain: bool = False) -> None:
        """Forget `entry`; with `retain`, its full prompt blocks stay as prefix blocks as
        far as the memory it frees allows (an eviction for memory keeps nothing)."""
        self._entries.pop(entry.request_id, None)
        if not retain:
            return
        tokens = min(entry.prompt_tokens, entry.resident_tokens, len(entry.token_ids))
        for index, block_hash in enumerate(entry.block_hashes(self.block_tokens)):
            if (index + 1) * self.block_tokens > tokens or self.free_blocks < 1:
                break
            if not self.prefix.insert(block_hash):
                continue
            start = index * self.block_tokens
            self._prefix_kv[block_hash] = [
                (k.clone(), v.clone())
                for k, v in entry.cache.layers_kv(start, start + self.block_tokens)
            ]

    # -- prefix blocks ----------------------------------------------------------------

    def _drop_prefix_blocks(self, count: int) -> None:
        for block_hash in self.prefix.evict(count):
            del self._prefix_kv[block_hash]

    def reusable_prefix(self, token_ids: list[int], limit_tokens: int) -> PrefixReuse:
        """The leading blocks of `token_ids` (within `limit_tokens`) whose KV this worker
        holds — kept prefix blocks, or blocks of a resident request with the same prefix —
        pinned until `release_prefix`."""
        hashes = prefix_block_hashes(token_ids[:limit_tokens], self.block_tokens)
        live: dict[int, tuple[Resident, int]] = {}
        for entry in self._entries.values():
            if entry.release_pending:
                continue
            full = min(entry.prompt_tokens, entry.resident_tokens) // self.block_tokens
            for index, block_hash in enumerate(entry.block_hashes(self.block_tokens)[:full]):
                live.setdefault(block_hash, (entry, index))
        reuse = PrefixReuse()
        for block_hash in hashes:
            if block_hash in self.prefix:
                self.prefix.acquire([block_hash])
                reuse.kept.append(block_hash)
                reuse.blocks.append(self._prefix_kv[block_hash])
            elif block_hash in live:
                entry, index = live[block_hash]
                if entry not in reuse.entries:
                    self.pin(entry)
                    reuse.entries.append(entry)
                start = index * self.block_tokens
                reuse.blocks.append(entry.cache.layers_kv(start, start + self.block_tokens))
            else:
                break
        return reuse

    def release_prefix(self, reuse: PrefixReuse) -> None:
        """Unpin what `reusable_prefix` pinned (once its KV has been copied)."""
        self.prefix.release(reuse.kept)
        for entry in reuse.entries:
            self.unpin(entry)
        reuse.kept, reuse.entries = [], []

    def prefix_hashes(self, limit: int = 4096) -> list[int]:
        """Hashes of the full prefix blocks resident here (most recently used first)."""
        hashes: list[int] = list(self.prefix.hashes()[:limit])
        seen: set[int] = set(hashes)
        for entry in sorted(self._entries.values(), key=lambda e: -e.last_used_s):
            for block_hash in entry.block_hashes(self.block_tokens):
                if block_hash not in seen:
                    seen.add(block_hash)
                    hashes.append(block_hash)
                    if len(hashes) >= limit:
                        return hashes
        return hashes
