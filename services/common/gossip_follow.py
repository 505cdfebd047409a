"""Copies of the gossip registry and of its link samples, kept current by asking for what
changed (`ListChanges`, `ListLinks` measured after a time).

Every view of the registry (scheduler replicas, cost oracle, router, prober) holds one.
Reading the whole registry costs gossip and Redis in proportion to the cluster (at 4,096
instances, ~0.4 s and 600 kB per listing); following the feed costs in proportion to
what changed since the last poll, which for a cluster heartbeating every 2 s with steady
load is a handful of instances.

A full listing replaces the copy at the first poll, whenever gossip answers `full` (its
change history no longer reaches back to the copy's change id: trimmed, or Redis lost
it), and every `resync_s` regardless: that drops instances the registry forgot (their
hash expired after the down retention), which no delta reports, and bounds how long any
change missed for an unforeseen reason can linger. The registry's periodic listing runs
beside the polls, not in one: at 4,096 instances it takes gossip a second or more, and
a poll waiting for it would leave the view that old (the views' age at p99 was the
resyncs'). Each copy's period is drawn around `resync_s` (±10 %), so views started
together do not all ask gossip for everything at the same moment.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable

from services.common.gossip_records import GossipReader, LinkRecord, NodeChanges, NodeRecord

DEFAULT_RESYNC_S = 30.0
"""Seconds between full listings of a view that follows the change feed."""

LINK_CLOCK_MARGIN_MS = 2_000
"""How far before the newest measurement a link listing asks from. Every measurement
on one Redis is stamped by its clock within the script that stores it, so one listing
sees every link stamped before its own; the margin covers the shards of a Redis Cluster,
whose nodes' clocks may differ by this much. What it lists twice is applied twice."""


class _Resynced:
    """When a copy lists everything again: at its first poll, then every `resync_s`, or
    every period drawn within `jitter` of it (every poll with `resync_s=0`)."""

    def __init__(self, resync_s: float, clock: Callable[[], float], jitter: float = 0.0) -> None:
        self.resync_s = resync_s
        self._clock = clock
        self._full_at_s = -math.inf
        self._period_s = resync_s * random.uniform(1.0 - jitter, 1.0 + jitter)

    def _resync_due(self, now_s: float) -> bool:
        return self.resync_s <= 0 or now_s - self._full_at_s >= self._period_s


class RegistryCopy(_Resynced):
    """Every instance gossip remembers, by id, as of the last `poll`.

    `resync_s=0` lists everything at every poll: what views did before the change feed
    (kept for comparison in bench.scale, and as a fallback).
    """

    def __init__(
        self, resync_s: float = DEFAULT_RESYNC_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(resync_s, clock, jitter=0.1)
        self.nodes: dict[str, NodeRecord] = {}
        self._change_id = ""
        self.full_listings = 0
        """How many polls were answered with a full listing (start, gaps, resyncs)."""
        self._listing: asyncio.Future[NodeChanges] | None = None
        self._changed_since_listing: set[str] = set()
        """Instances a delta brought while the listing under way was read."""

    async def poll(self, reader: GossipReader) -> tuple[NodeRecord, ...] | None:
        """Applies what changed; returns the changed records, or None when the copy was
        replaced by a full listing. Errors of the reader propagate (the copy is kept)."""
        now_s = self._clock()
        if self.resync_s <= 0 or self._full_at_s == -math.inf:
            self._replace(await reader.list_changes(""), now_s)
            return None
        if self._listing is None and self._resync_due(now_s):
            self._listing = asyncio.ensure_future(reader.list_changes(""))
            self._changed_since_listing = set()
            self._full_at_s = now_s
        changes = await reader.list_changes(self._change_id)
        if changes.full:
            self.cancel_listing()
            self._replace(changes, now_s)
            return None
        self._change_id = changes.change_id
        for node in changes.nodes:
            instance_id = node.registration.instance_id
            self.nodes[instance_id] = node
            self._changed_since_listing.add(instance_id)
        listing = self._listing
        if listing is not None and listing.done():
            self._listing = None
            if listing.exception() is None:
                self._merge(listing.result())
                return None
            self._full_at_s = now_s - self._period_s  # due again at the next poll
        return changes.nodes

    def _replace(self, changes: NodeChanges, now_s: float) -> None:
        self._change_id = changes.change_id
        self.nodes = {node.registration.instance_id: node for node in changes.nodes}
        self._full_at_s = now_s
        self.full_listings += 1

    def _merge(self, listing: NodeChanges) -> None:
        """A listing read beside the polls: each instance as it lists it, but those a
        delta brought since it began as the delta did (they are newer), and none it
        lacks unless a delta brought them (the registry forgot them)."""
        fresh = self._changed_since_listing
        merged = {
            node.registration.instance_id: node
            for node in listing.nodes
            if node.registration.instance_id not in fresh
        }
        merged.update((instance_id, self.nodes[instance_id]) for instance_id in fresh)
        self.nodes = merged
        self.full_listings += 1

    def cancel_listing(self) -> None:
        """Drops a listing under way (the copy is being closed, or replaced anyway)."""
        listing, self._listing = self._listing, None
        if listing is None:
            return
        if listing.done() and not listing.cancelled():
            listing.exception()  # retrieved: a failed listing replaced anyway is no news
        listing.cancel()


class LinkCopy(_Resynced):
    """The newest sample of every measured link, by (src, dst), as of the last `poll`.

    The first poll, and every `resync_s` after (each poll with `resync_s=0`), lists every
    link; the polls between ask for the links measured since the newest measurement
    held (less `LINK_CLOCK_MARGIN_MS`). A full listing also drops the links gossip
    forgot (older than its down retention), which no partial one reports. A record's
    `age_s` is as of the listing that brought it; its `measured_unix_ms` stays true.
    """

    def __init__(
        self, resync_s: float = DEFAULT_RESYNC_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(resync_s, clock)
        self.links: dict[tuple[str, str], LinkRecord] = {}
        self._newest_ms = 0

    async def poll(self, reader: GossipReader) -> tuple[LinkRecord, ...] | None:
        """Applies what was measured since the last poll; returns the records that
        changed (a link listed again within the clock margin, unchanged, is not one), or
        None when the copy was replaced by a full listing. Errors of the reader propagate
        (the copy is kept)."""
        now_s = self._clock()
        full = self._resync_due(now_s)
        after_ms = 0 if full else max(1, self._newest_ms - LINK_CLOCK_MARGIN_MS)
        records = await reader.list_links(after_ms)
        if full:
            self.links = {}
            self._full_at_s = now_s
        changed = []
        for record in records:
            sample = record.sample
            pair = (sample.src_instance_id, sample.dst_instance_id)
            held = self.links.get(pair)
            if held is None or (held.sample, held.measured_unix_ms) != (
                sample,
                record.measured_unix_ms,
            ):
                changed.append(record)
            self.links[pair] = record
            self._newest_ms = max(self._newest_ms, record.measured_unix_ms)
        return None if full else tuple(changed)
