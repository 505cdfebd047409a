"""A copy of the gossip registry: who is alive, where, how loaded; who just died.

The router and the prober each keep one.

A background task follows the registry's change feed every `refresh_s` (a full
listing at start and every `gossip_follow.DEFAULT_RESYNC_S`, deltas in between, so a
refresh costs gossip what changed, not the cluster's size); another follows the gossip
event stream and, on a `failed` or `left` event, marks the instance down at once and
tells every listener (the router, which then recovers the requests it had decoding
there). A `suspect` event (a late heartbeat, death not confirmed) only stops new work
going there: its streams stay, and a `refuted` event brings it back. Reads never await:
a request picks its prefill instance from the last copy.

A full listing that no longer holds an instance the copy had alive (a Redis restart that
lost the registry) does not drop it at once: it stays, as it was, for one heartbeat TTL,
in which a live worker registers again; otherwise every request in that moment would be
refused ("no alive prefill instance") though nothing died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvrs.errors import KvrsError
from services.common.gossip_follow import RegistryCopy
from services.common.gossip_records import (
    ALIVE,
    FAILED,
    JOINED,
    LEFT,
    SUSPECT,
    GossipReader,
    NodeRecord,
)

log = logging.getLogger(__name__)

FailureListener = Callable[[str, str], None]
"""Called with (instance_id, reason) when gossip reports an instance failed or gone."""


@dataclass(frozen=True)
class Instance:
    """One worker as the router last saw it."""

    instance_id: str
    role: str
    """"prefill" or "decode"."""
    address: str
    transfer_address: str = ""
    alive: bool = True
    """Takes new work: registered, heartbeating on time."""
    suspect: bool = False
    """Late heartbeat, death unconfirmed: no new work, but not down (its KV is still there)."""
    queued_work_s: float = 0.0
    queue_depth: int = 0
    running_requests: int = 0
    resident_prefix_hashes: frozenset[int] = frozenset()
    heartbeat_ttl_s: float = 0.0


def instance_from_record(record: NodeRecord) -> Instance:
    registration, load = record.registration, record.load
    return Instance(
        instance_id=registration.instance_id,
        role=registration.role,
        address=registration.address,
        transfer_address=registration.transfer_address,
        alive=record.state == ALIVE,
        suspect=record.state == SUSPECT,
        queued_work_s=load.queued_work_s,
        queue_depth=load.queue_depth,
        running_requests=load.running_requests,
        resident_prefix_hashes=frozenset(load.resident_prefix_hashes),
        heartbeat_ttl_s=record.heartbeat_ttl_s,
    )


class Membership:
    """See the module docstring. `start()` launches the background tasks, `close()` ends them."""

    def __init__(self, gossip: GossipReader, refresh_s: float) -> None:
        self._gossip = gossip
        self.refresh_s = refresh_s
        self._registry = RegistryCopy()
        self._instances: dict[str, Instance] = {}
        self._alive: dict[str, list[Instance]] = {}
        """`alive(role)`'s answers, built once after each change of `_instances`: a
        request reads them, and a cluster has thousands of instances."""
        self._vanished_at_s: dict[str, float] = {}
        """Alive instances a full listing lacked, and since when (see the module doc)."""
        self._down: set[str] = set()
        """Instances a failure event named; down until a `joined` event (a restarted
        worker registers again), whatever a listing fetched before the event says."""
        self._joined_at_s: dict[str, float] = {}
        """When a `joined` event last named each instance (monotonic s): it registered
        again after it failed, left or was forgotten."""
        self._joining: dict[str, float] = {}
        """`joined` events seen since the last refresh began: `_joined_at_s` once one ran."""
        self._refresh_wanted = asyncio.Event()
        self._listeners: list[FailureListener] = []
        self._tasks: list[asyncio.Task] = []
        self._loaded = asyncio.Event()

    def add_failure_listener(self, listener: FailureListener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [
            asyncio.create_task(self._refresh_forever(), name="router-membership-refresh"),
            asyncio.create_task(self._watch_forever(), name="router-membership-events"),
        ]

    async def close(self) -> None:
        self._registry.cancel_listing()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []

    async def wait_loaded(self, timeout_s: float) -> bool:
        """True once one refresh succeeded (within `timeout_s`)."""
        try:
            await asyncio.wait_for(self._loaded.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # -- reads ---------------------------------------------------------------------------

    def instance(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def is_alive(self, instance_id: str) -> bool:
        known = self._instances.get(instance_id)
        return known is not None and known.alive

    def is_down(self, instance_id: str) -> bool:
        """Known and gone (failed, left, or named by a failure event); a suspect is not."""
        known = self._instances.get(instance_id)
        return instance_id in self._down or (
            known is not None and not known.alive and not known.suspect
        )

    def joined_since(self, instance_id: str, since_s: float) -> bool:
        """Whether the instance registered again after `since_s` (monotonic): a restarted
        worker is a new process, whatever its predecessor did to a request."""
        return self._joined_at_s.get(instance_id, -float("inf")) > since_s

    def alive(self, role: str) -> list[Instance]:
        """The alive instances of `role` in id order (shared: the caller must not modify
        the list)."""
        if role not in self._alive:
            self._alive[role] = sorted(
                (i for i in self._instances.values() if i.alive and i.role == role),
                key=lambda instance: instance.instance_id,
            )
        return self._alive[role]

    # -- updates -------------------------------------------------------------------------

    async def refresh(self) -> bool:
        """Reads what changed in the registry; False (the old copy kept) when gossip does
        not answer."""
        try:
            changed = await self._registry.poll(self._gossip)
        except KvrsError as exc:
            log.warning("gossip listing failed; keeping the last view: %s", exc)
            return False
        if changed is None:
            self._replace(self._vanished_but_kept())
            changed = tuple(self._registry.nodes.values())
        self._apply(instance_from_record(record) for record in changed)
        self._loaded.set()
        return True

    def _vanished_but_kept(self) -> dict[str, Instance]:
        """After a full listing: the alive instances it lacks, kept for one TTL."""
        now_s = time.monotonic()
        kept: dict[str, Instance] = {}
        for instance_id, instance in self._instances.items():
            if instance_id in self._registry.nodes or not instance.alive:
                continue
            since_s = self._vanished_at_s.get(instance_id, now_s)
            if now_s - since_s <= instance.heartbeat_ttl_s:
                kept[instance_id] = instance
        if kept.keys() - self._vanished_at_s.keys():
            log.warning(
                "alive instances missing from gossip's listing (did the registry lose "
                "them?); kept for one heartbeat TTL: %s",
                ", ".join(sorted(kept.keys() - self._vanished_at_s.keys())),
            )
        self._vanished_at_s = {i: self._vanished_at_s.get(i, now_s) for i in kept}
        return kept

    def _apply(self, instances: Iterable[Instance]) -> None:
        for instance in instances:
            if instance.instance_id in self._down:
                instance = dataclasses.replace(instance, alive=False, suspect=False)
            self._put(instance)

    # `_put` and `_replace` are the only writers of `_instances`: each drops the cached
    # `alive()` lists with it, so no update can leave them stale.

    def _put(self, instance: Instance) -> None:
        self._instances[instance.instance_id] = instance
        self._alive = {}

    def _replace(self, instances: dict[str, Instance]) -> None:
        self._instances = instances
        self._alive = {}

    def mark_suspect(self, instance_id: str) -> None:
        """No new work for the instance until a refresh or a `refuted` event says otherwise."""
        known = self._instances.get(instance_id)
        if known is not None and known.alive:
            self._put(dataclasses.replace(known, alive=False, suspect=True))

    def mark_down(self, instance_id: str, reason: str) -> None:
        """Takes an instance out of service now and tells the listeners (once per failure)."""
        known = self._instances.get(instance_id)
        if known is not None:
            self._put(dataclasses.replace(known, alive=False, suspect=False))
        if instance_id in self._down:
            return
        self._down.add(instance_id)
        for listener in self._listeners:
            listener(instance_id, reason)

    async def _refresh_forever(self) -> None:
        """A refresh every `refresh_s`, or sooner when an event asks for one: the events
        that arrive during a refresh share the next (thousands of instances registering
        at once cost a few listings, not one each)."""
        while True:
            try:
                await asyncio.wait_for(self._refresh_wanted.wait(), self.refresh_s)
            except TimeoutError:
                pass
            self._refresh_wanted.clear()
            joined, self._joining = self._joining, {}
            await self.refresh()
            # Once the refresh has them alive, as a caller asking expects.
            self._joined_at_s.update(joined)

    async def _watch_forever(self) -> None:
        after_event_id = ""
        while True:
            try:
                async for event in self._gossip.watch_events(after_event_id):
                    after_event_id = event.event_id
                    if event.type in (FAILED, LEFT):
                        log.info("gossip: %s %s (%s)", event.instance_id, event.type, event.reason)
                        self.mark_down(
                            event.instance_id,
                            f"gossip: {event.type} ({event.reason or 'no reason given'})",
                        )
                    elif event.type == SUSPECT:
                        log.info("gossip: %s suspect (%s)", event.instance_id, event.reason)
                        self.mark_suspect(event.instance_id)
                    else:
                        self._down.discard(event.instance_id)
                        if event.type == JOINED:
                            self._joining[event.instance_id] = time.monotonic()
                        self._refresh_wanted.set()
            except KvrsError as exc:
                log.warning("gossip event stream failed, reopening: %s", exc)
                await asyncio.sleep(0.2)
