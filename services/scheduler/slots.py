"""Migration slots reserved by the scheduler itself, in the slot broker's Redis.

A `Recover` that needs a slot would otherwise pay a second RPC (scheduler -> broker ->
Redis). Here the scheduler runs the broker's own reserve script (`services.common.
slot_leases`, one implementation) against the same keys, so a reservation is one Redis
round trip, and the cap stays exact: the script reads the caps the broker published and
checks them atomically with every other reservation, the broker's and other replicas'.
Leases carry the same TTL and expire the same way when their holder crashes; renewals,
releases and everyone else's reservations still go through the slot broker's API.

Until a broker has published its policy there is nothing to hold reservations to, and
this asks the broker instead (which publishes it when it starts).
"""

from __future__ import annotations

import logging

import redis.exceptions

from kvrs.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from kvrs.rpc.errors import relayed
from services.common.slot_leases import NoSlotPolicy, SlotStore
from services.scheduler.leases import Lease
from services.scheduler.peers import SlotBrokerClient

log = logging.getLogger(__name__)


class RedisSlots:
    """`SlotBroker` over the broker's Redis keys, falling back to the broker's RPC."""

    def __init__(
        self, store: SlotStore, holder_id: str, ttl_s: float, broker: SlotBrokerClient
    ) -> None:
        self._store = store
        self.holder_id = holder_id
        self.ttl_s = ttl_s
        self._broker = broker

    async def reserve(self, request_id: str, src_id: str, dst_id: str) -> Lease:
        try:
            grant = await self._store.reserve(
                request_id, self.holder_id, src_id, dst_id, self.ttl_s
            )
        except NoSlotPolicy:
            log.info("no slot policy in Redis yet; reserving %s at the broker", request_id)
            return await self._broker.reserve(request_id, src_id, dst_id)
        except redis.exceptions.TimeoutError as exc:
            raise DeadlineExceeded(f"slot reservation in Redis timed out: {exc}") from None
        except redis.exceptions.RedisError as exc:
            raise Unavailable(f"Redis holding the slots: {exc}") from None
        except (InvalidArgument, NotFound) as exc:
            # The field it names is the scheduler's own config, not its caller's input.
            raise relayed(exc) from None
        lease = grant.lease
        return Lease(
            lease_id=lease.lease_id,
            request_id=lease.request_id,
            holder_id=lease.holder_id,
            src_id=lease.src_instance_id,
            dst_id=lease.dst_instance_id,
            expires_unix_ms=lease.expires_unix_ms,
        )

    async def free_slots(self) -> int:
        try:
            stats = await self._store.stats()
        except redis.exceptions.RedisError as exc:
            raise Unavailable(f"Redis holding the slots: {exc}") from None
        if not stats.cluster_cap:
            return await self._broker.free_slots()
        return max(0, stats.cluster_cap - stats.slots_in_use)

    async def pair_flows(self) -> dict[tuple[str, str], int]:
        """Leases in flight per (src, dst) pair; empty when Redis cannot say."""
        try:
            stats = await self._store.stats()
        except redis.exceptions.RedisError as exc:
            log.debug("no flow counts from Redis: %s", exc)
            return {}
        return {
            (link.src_instance_id, link.dst_instance_id): link.in_use
            for link in stats.links
            if link.in_use > 0
        }
