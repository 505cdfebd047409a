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

Spares take even that round trip off the decision's path. A replica keeps a few leases
reserved ahead for no request (`SlotStore.reserve_spare`: they count against the
cluster cap like any other, so the cap stays exact); a decision that needs a slot takes
one of them and answers at once, and the spare is claimed for its request in Redis
(fields, link, TTL) after the reply is sent (`after_reply`), off the path: the claims of
the spares handed out within `CLAIM_BATCH_S` share one script run. A migration
that ends before the claim lands has released the spare already: the claim then holds
nothing, and still reserves the spare that replaces it. Spares are short-lived and replaced
before they lapse, so a crashed replica's return within `SPARE_TTL_S`; they are only
taken far from the cap (while under half of it is held) and without a per-link cap, so
under pressure every reservation is the exact one-trip check, and the spares left lapse.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import redis.exceptions

from kvrs.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from kvrs.rpc.errors import relayed
from services.common.slot_leases import NoSlotPolicy, SlotStore, SpareClaim
from services.scheduler.after_reply import after_reply
from services.scheduler.leases import Lease
from services.scheduler.peers import SlotBrokerClient

log = logging.getLogger(__name__)

SPARE_TTL_S = 4.0
"""Lifetime of a spare in Redis: how long a crashed replica's spares hold capacity."""
SPARE_MARGIN_S = 1.0
"""A spare with less life than this left is not handed out (its claim must land first);
it lapses and a new one takes its place."""
CLAIM_BATCH_S = 0.02
"""How long a handed-out spare's claim waits for others to share its Redis step: a
failure's burst of decisions claims its spares in one script run, and the claim of a
lone decision lands after its reply, not beside it. Far below `SPARE_MARGIN_S`."""
TEND_INTERVAL_S = 0.25
"""How often the spares are checked (a Redis call only to replace a lapsing one)."""


class RedisSlots:
    """`SlotBroker` over the broker's Redis keys, falling back to the broker's RPC."""

    def __init__(
        self,
        store: SlotStore,
        holder_id: str,
        ttl_s: float,
        broker: SlotBrokerClient,
        spares: int = 0,
    ) -> None:
        self._store = store
        self.holder_id = holder_id
        self.ttl_s = ttl_s
        self._broker = broker
        self.spares = spares
        """How many spares `keep_spares` holds (0: none; every reservation a round trip)."""
        self._spares: collections.deque[tuple[str, float]] = collections.deque()
        """(lease id, monotonic time it lapses) of the spares held, oldest first."""
        self._pending: list[SpareClaim] = []
        """Spares handed out whose claim waits for the next batch."""
        self._batch_timer: asyncio.TimerHandle | None = None
        self._claims: set[asyncio.Task] = set()
        self._reserving = False

    async def reserve(self, request_id: str, src_id: str, dst_id: str) -> Lease:
        spare = self._take_spare()
        if spare is not None:
            claim = SpareClaim(spare, request_id, src_id, dst_id)
            after_reply(lambda: self._claim_soon(claim))
            expires_unix_ms = int((time.time() + (self.ttl_s or SPARE_TTL_S)) * 1000)
            return Lease(
                lease_id=spare,
                request_id=request_id,
                holder_id=self.holder_id,
                src_id=src_id,
                dst_id=dst_id,
                expires_unix_ms=expires_unix_ms,
            )
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
        # Every replica's spares hold capacity; this one's are its own to use.
        held = stats.slots_in_use + stats.spare_slots - len(self._spares)
        return max(0, stats.cluster_cap - held)

    # -- spares -----------------------------------------------------------------------

    def _take_spare(self) -> str | None:
        """A spare with enough life left for its claim to land, else None."""
        now = time.monotonic()
        while self._spares:
            lease_id, lapses_s = self._spares.popleft()
            if lapses_s - now > SPARE_MARGIN_S:
                return lease_id
        return None

    def _claim_soon(self, claim: SpareClaim) -> None:
        """Queues `claim` for the next batch, which starts `CLAIM_BATCH_S` after the
        first claim it holds."""
        self._pending.append(claim)
        if self._batch_timer is None:
            self._batch_timer = asyncio.get_running_loop().call_later(
                CLAIM_BATCH_S, self._start_batch
            )

    def _start_batch(self) -> None:
        self._batch_timer = None
        claims, self._pending = self._pending, []
        if claims:
            task = asyncio.create_task(self._claim(claims))
            self._claims.add(task)
            task.add_done_callback(self._claims.discard)

    async def _claim(self, claims: list[SpareClaim]) -> None:
        """Makes each spare its request's lease and, in the same Redis step, reserves the
        spares that replace them: a burst of decisions finds the next ones ready."""
        reserved_s = time.monotonic()
        try:
            results = await self._store.claim(claims, self.ttl_s, self.holder_id, SPARE_TTL_S)
        except (redis.exceptions.RedisError, InvalidArgument) as exc:
            names = ", ".join(c.request_id for c in claims)
            log.warning("claiming %d spare slots (for %s) failed: %r", len(claims), names, exc)
            return
        for claim, result in zip(claims, results, strict=True):
            if result.lease is None:
                # Released (its migration ended) or lapsed before this claim.
                log.info(
                    "spare slot %s was gone before its claim for %s",
                    claim.lease_id,
                    claim.request_id,
                )
            if result.spare is not None:
                self._spares.append((result.spare.lease_id, reserved_s + SPARE_TTL_S))

    async def keep_spares(self) -> None:
        """Holds `spares` spares until cancelled (see the module docstring), then gives
        back those held. Stops once asked even when Redis turned the cancellation into a
        connection error."""
        task = asyncio.current_task()
        try:
            while task is None or not task.cancelling():
                try:
                    await self._tend()
                except (redis.exceptions.RedisError, NoSlotPolicy) as exc:
                    log.debug("spare slots not replaced: %r", exc)
                if task is not None and task.cancelling():
                    break
                await asyncio.sleep(TEND_INTERVAL_S)
        finally:
            await asyncio.shield(self._give_back())
        raise asyncio.CancelledError

    async def _tend(self) -> None:
        """Lets lapsing spares go and reserves new ones up to `spares` (one reservation
        in flight at a time, whoever asks)."""
        now = time.monotonic()
        while self._spares and self._spares[0][1] - now <= SPARE_MARGIN_S:
            self._spares.popleft()  # it lapses in Redis on its own
        if self._reserving:
            return
        self._reserving = True
        try:
            while len(self._spares) < self.spares:
                reserved_s = time.monotonic()
                spare = await self._store.reserve_spare(self.holder_id, SPARE_TTL_S)
                if spare is None:  # near the cap, or per-link caps: one trip each
                    return
                self._spares.append((spare.lease_id, reserved_s + SPARE_TTL_S))
        finally:
            self._reserving = False

    async def _give_back(self) -> None:
        """Lets the claims queued and under way land, then releases the spares still
        held."""
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._start_batch()
        if self._claims:
            await asyncio.wait(self._claims, timeout=SPARE_MARGIN_S)
        spares, self._spares = list(self._spares), collections.deque()
        for lease_id, _ in spares:
            with contextlib.suppress(redis.exceptions.RedisError, asyncio.TimeoutError):
                await asyncio.wait_for(self._store.release(lease_id), SPARE_MARGIN_S)

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
