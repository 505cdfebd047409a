"""A copy of the gossip registry kept current by its change feed (`ListChanges`).

Every view of the registry (scheduler replicas, cost oracle, router, prober) holds one.
Reading the whole registry costs gossip and Redis in proportion to the cluster (at 4,096
instances, ~0.4 s and 600 kB per listing); following the feed costs in proportion to
what changed since the last poll, which for a cluster heartbeating every 2 s with steady
load is a handful of instances.

A full listing replaces the copy at the first poll, whenever gossip answers `full` (its
change history no longer reaches back to the copy's change id: trimmed, or Redis lost
it), and every `resync_s` regardless: that drops instances the registry forgot (their
hash expired after the down retention), which no delta reports, and bounds how long any
change missed for an unforeseen reason can linger.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.gossip_records import GossipReader, NodeRecord

DEFAULT_RESYNC_S = 30.0
"""Seconds between full listings of a view that follows the change feed."""


class RegistryCopy:
    """Every instance gossip remembers, by id, as of the last `poll`.

    `resync_s=0` lists everything at every poll: what views did before the change feed
    (kept for comparison in bench.scale, and as a fallback).
    """

    def __init__(
        self, resync_s: float = DEFAULT_RESYNC_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.resync_s = resync_s
        self.nodes: dict[str, NodeRecord] = {}
        self._clock = clock
        self._change_id = ""
        self._full_at_s = 0.0
        self.full_listings = 0
        """How many polls were answered with a full listing (start, gaps, resyncs)."""

    async def poll(self, reader: GossipReader) -> tuple[NodeRecord, ...] | None:
        """Applies what changed; returns the changed records, or None when the copy was
        replaced by a full listing. Errors of the reader propagate (the copy is kept)."""
        now_s = self._clock()
        after = self._change_id
        if self.resync_s <= 0 or now_s - self._full_at_s >= self.resync_s:
            after = ""
        changes = await reader.list_changes(after)
        self._change_id = changes.change_id
        if changes.full:
            self.nodes = {node.registration.instance_id: node for node in changes.nodes}
            self._full_at_s = now_s
            self.full_listings += 1
            return None
        for node in changes.nodes:
            self.nodes[node.registration.instance_id] = node
        return changes.nodes
