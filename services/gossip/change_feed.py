"""One reading of the change streams, shared by every view that follows this replica.

Every view (each scheduler replica, the cost oracle, the prober, the router) polls
`ListChanges` about ten times a second. Answered straight from Redis, each poll reads,
decodes and encodes every instance that changed since that view's last poll: with five
views, the same change costs five Redis reads and five protobufs, and at a few thousand
heartbeating instances that work outgrows the replica (a poll then takes longer than its
changes took to accumulate, and the views' age grows without bound).

`ChangeFeed` polls the registry's change streams itself, at most one poll in flight
(a view's request arriving meanwhile waits for that poll), and keeps, for the last
`retain_s`, each poll's position (the change id it reached) and the ids it found
changed, with one encoded `NodeInfo` per changed instance. A view's cursor is
answered from memory: the ids changed in the polls after the newest position at or
before the cursor (per shard), each as the latest poll read it. A cursor this replica
cannot place (a full listing's "", one older than what it retains, one from a replica
further ahead, a malformed one) is the store's to answer as before (`answer` returns
None): the replies are the same, only their cost changes.

Re-sending an instance a view already has is harmless (every reply carries instances
as they are now), so answering from the poll before the cursor's position is safe.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from dataclasses import dataclass

from kvrs.v1 import gossip_pb2
from services.gossip import convert
from services.gossip.store import GossipStore

_NUMBER = re.compile(r"^[0-9]{1,19}$")  # what the store accepts in a change id

RETAIN_S = 60.0
"""How long a poll's changes stay answerable from memory (views resync every 30 s)."""

Position = tuple[tuple[int, int], ...]
"""A change id as one (milliseconds, sequence) stream position per shard."""


def position(change_id: str, shards: int) -> Position | None:
    """`change_id` as per-shard stream positions; None for "" and for an id this
    registry's shard count does not read (the store then answers, or refuses it)."""
    if not change_id:
        return None
    parts = change_id.split(",")
    if len(parts) == 1:
        parts *= shards
    if len(parts) != shards:
        return None
    ordered = []
    for part in parts:
        ms, _, seq = part.partition("-")
        if not (_NUMBER.match(ms) and (seq == "" or _NUMBER.match(seq))):
            return None
        ordered.append((int(ms), int(seq or 0)))
    return tuple(ordered)


def _at_or_before(a: Position, b: Position) -> bool:
    """Whether every shard of `a` is at or before the same shard of `b`."""
    return all(x <= y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class _Poll:
    seq: int
    at: Position
    """Where the change streams were when this poll read them."""
    change_id: str
    changed: frozenset[str]
    """The ids whose records this poll read (changed since the poll before)."""
    read_at_s: float
    """Monotonic time of the poll."""


class ChangeFeed:
    """`ListChanges` answered from one shared reading of the change streams."""

    def __init__(self, store: GossipStore, retain_s: float = RETAIN_S) -> None:
        self._store = store
        self._retain_s = retain_s
        self._polls: deque[_Poll] = deque()
        """Oldest first; the first is the baseline (nothing before it is answerable)."""
        self._latest: dict[str, tuple[int, gossip_pb2.NodeInfo]] = {}
        """instance id -> (the seq of the newest poll that read it, its record then)."""
        self._now_ms = 0
        self._seq = 0
        self._polling: asyncio.Future[None] | None = None

    async def answer(self, after_change_id: str) -> gossip_pb2.ListChangesResponse | None:
        """The reply `ListChanges(after_change_id)` gets from memory, after a poll; None
        for a cursor this feed cannot place (the store answers it; see the module)."""
        after = position(after_change_id, self._store.shards)
        if after is None:
            return None
        if not self._polls:
            # Start where the first view is: a start from "" would list every instance.
            self._polls.append(_Poll(0, after, after_change_id, frozenset(), time.monotonic()))
        await self._fresh()
        return self._answer(after)

    async def _fresh(self) -> None:
        """Waits for the poll in flight, or runs one: a view's answer is no older than
        the poll that was running (or started) when it asked."""
        if self._polling is None:
            self._polling = asyncio.ensure_future(self._poll())
            self._polling.add_done_callback(self._poll_done)
        # Shielded: a view giving up must not cancel the poll others wait for.
        await asyncio.shield(self._polling)

    def _poll_done(self, poll: asyncio.Future[None]) -> None:
        self._polling = None
        if not poll.cancelled():
            poll.exception()  # retrieved here too: every waiter may have given up

    async def _poll(self) -> None:
        listing = await self._store.list_changes(self._polls[-1].change_id)
        at = position(listing.change_id, self._store.shards)
        assert at is not None, f"the store's own change id {listing.change_id!r}"
        now_s = time.monotonic()
        self._seq += 1
        self._now_ms = listing.now_ms
        if listing.full:
            # A gap: nothing before this is answerable from memory.
            self._polls.clear()
            self._latest.clear()
            changed: frozenset[str] = frozenset()
        else:
            changed = frozenset(record.registration.instance_id for record in listing.nodes)
            for record in listing.nodes:
                self._latest[record.registration.instance_id] = (
                    self._seq,
                    convert.node_to_pb(record),
                )
        self._polls.append(_Poll(self._seq, at, listing.change_id, changed, now_s))
        self._forget_before(now_s - self._retain_s)

    def _forget_before(self, oldest_s: float) -> None:
        """Drops polls read before `oldest_s`, the newest always kept as the baseline."""
        while len(self._polls) > 1 and self._polls[0].read_at_s < oldest_s:
            self._polls.popleft()
            # The baseline's own changes are never answered (only polls after it are).
            for instance_id in self._polls[0].changed:
                if self._latest[instance_id][0] == self._polls[0].seq:
                    del self._latest[instance_id]

    def _answer(self, after: Position) -> gossip_pb2.ListChangesResponse | None:
        """The reply for a cursor at `after` from memory; None when no retained poll is at
        or before it, or it is past the newest poll (it came from a replica ahead)."""
        if not self._polls or not _at_or_before(after, self._polls[-1].at):
            return None
        changed: set[str] = set()
        for poll in reversed(self._polls):
            if _at_or_before(poll.at, after):
                break
            changed |= poll.changed
        else:
            return None
        nodes = []
        for instance_id in sorted(changed):
            info = self._latest[instance_id][1]
            info.age_s = max(0.0, (self._now_ms - info.last_seen_unix_ms) / 1000)
            nodes.append(info)
        # The reply copies each message: the age set above is this reply's.
        return gossip_pb2.ListChangesResponse(
            nodes=nodes,
            change_id=self._polls[-1].change_id,
            full=False,
            server_unix_ms=self._now_ms,
        )
