"""The decision services' source of gossip snapshots: the registry, the links, and the
migrations in flight, fetched together for `gossip_view.ViewCache`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Protocol

from kvrs.errors import DeadlineExceeded, InvalidArgument, KvrsError, Unavailable
from services.common.gossip_follow import DEFAULT_RESYNC_S, LinkCopy, RegistryCopy
from services.common.gossip_records import (
    FAILED,
    JOINED,
    LEFT,
    REFUTED,
    SUSPECT,
    GossipReader,
)
from services.common.gossip_view import GossipSnapshot, ViewCache

log = logging.getLogger(__name__)


class FlowCounter(Protocol):
    """Who counts the migrations in flight (the scheduler's slot-broker client)."""

    async def pair_flows(self) -> dict[tuple[str, str], int]:
        """Leases in flight per (src, dst) pair; empty when the broker cannot say."""
        ...


async def _no_flows() -> dict[tuple[str, str], int]:
    return {}


class GossipSource:
    """Fetches the view from gossip, plus the migrations in flight from the slot broker.

    The registry is followed by its change feed (`gossip_follow.RegistryCopy`): a
    snapshot carries every instance, and `changed` says which of them the fetch
    updated (None: all of them, after a full listing), so the view rebuilds only those.
    The links are followed likewise (`gossip_follow.LinkCopy`, `changed_links`).

    A fetch that found gossip unreachable replaces the gossip client: a fresh channel
    tries to connect at once, where the old one would wait out gRPC's reconnect backoff
    (up to two minutes), so a restarted gossip store is seen again within one refresh.
    One that ran past its deadline keeps it: the channel works, and a gossip too busy to
    answer in time would only get connection set-ups on top.
    """

    def __init__(
        self,
        connect: Callable[[], GossipReader],
        slots: FlowCounter | None = None,
        resync_s: float = DEFAULT_RESYNC_S,
    ) -> None:
        """`resync_s`: seconds between full listings (0: a full listing every fetch)."""
        self._connect = connect
        self.client = connect()
        self.slots = slots
        self.registry = RegistryCopy(resync_s)
        self.links = LinkCopy(resync_s)
        self._closing: set[asyncio.Task] = set()

    async def fetch(self) -> GossipSnapshot:
        client = self.client
        fetched_at_s = time.time()
        flows = asyncio.ensure_future(
            self.slots.pair_flows() if self.slots is not None else _no_flows()
        )
        try:
            changed, changed_links = await asyncio.gather(
                self.registry.poll(client), self.links.poll(client)
            )
        except KvrsError as exc:
            if isinstance(exc, Unavailable):
                self._reconnect()
            # Whatever gossip answered, there is no fresh view: the cached one keeps serving.
            if isinstance(exc, Unavailable | DeadlineExceeded):
                raise
            raise Unavailable(f"gossip: {exc}") from exc
        finally:
            if not flows.done():
                await asyncio.wait([flows])
        return GossipSnapshot(
            nodes=tuple(self.registry.nodes.values()),
            links=MappingProxyType(self.links.links),
            fetched_at_s=fetched_at_s,
            flows=flows.result(),
            changed=changed,
            changed_links=changed_links,
        )

    def _reconnect(self) -> None:
        old, self.client = self.client, self._connect()
        task = asyncio.get_running_loop().create_task(old.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def watch(self, view: ViewCache) -> None:
        """Applies failure events to `view` as they happen, forever.

        Resumes after the last event seen (also across a reconnect), so no failure is lost
        while gossip retains it.
        """
        after_event_id = ""
        while True:
            try:
                async for event in self.client.watch_events(after_event_id):
                    after_event_id = event.event_id
                    if event.type in (FAILED, LEFT, SUSPECT):
                        # A suspect gets no placements until it heartbeats again (the
                        # refresh after its `refuted` event brings it back).
                        log.info("instance %s %s: %s", event.instance_id, event.type, event.reason)
                        view.mark_down(event.instance_id)
                    elif event.type in (JOINED, REFUTED):
                        view.request_refresh()
            except InvalidArgument as exc:
                log.warning("gossip forgot event %r, watching from now: %s", after_event_id, exc)
                after_event_id = ""
            except KvrsError as exc:
                log.debug("gossip event stream ended: %s", exc)
            # The stream ends when the client is replaced after a failed fetch.
            await asyncio.sleep(view.refresh_s)

    async def close(self) -> None:
        self.registry.cancel_listing()
        await self.client.close()
        for task in list(self._closing):
            with contextlib.suppress(asyncio.CancelledError):
                await task
