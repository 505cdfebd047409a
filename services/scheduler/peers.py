"""Adapters to the decision services' peers: the gossip store and the slot broker.

They turn peer RPCs into the domain calls `view.ViewCache` and `decisions.Scheduler`
expect, and peer failures into `kvrs.errors` through `kvrs.rpc.relayed` (RESOURCE_EXHAUSTED
stays a "no slot" answer; UNAVAILABLE and DEADLINE_EXCEEDED become "peer unreachable"; a
refusal reaches the scheduler's caller as FAILED_PRECONDITION).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.errors import DeadlineExceeded, InvalidArgument, KvrsError, Unavailable
from kvrs.rpc import error_from_rpc, relayed
from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.gossip.client import GossipClient
from services.gossip.records import FAILED, JOINED, LEFT
from services.scheduler.leases import Lease
from services.scheduler.view import GossipSnapshot, ViewCache

log = logging.getLogger(__name__)


class PeerChannel:
    """A channel to one peer that is reopened when it is stuck reconnecting.

    gRPC backs off reconnecting for up to two minutes after a peer went away; reopening
    the channel when a call found it in TRANSIENT_FAILURE makes the next call try at once,
    so the scheduler notices a restarted peer within one refresh.
    """

    def __init__(
        self,
        address: str,
        settings: GrpcSettings,
        provider: TracerProvider | None,
        idempotent_services: tuple[str, ...] = (),
        min_reopen_interval_s: float = 0.05,
    ) -> None:
        self.address = address
        self._open: Callable[[], grpc.aio.Channel] = lambda: open_channel(
            address, settings, provider, idempotent_services
        )
        self.channel = self._open()
        self._min_reopen_interval_s = min_reopen_interval_s
        self._reopened_at_s = time.monotonic()
        self._closing: set[asyncio.Task] = set()

    def reopen_if_failing(self) -> bool:
        """Reopens the channel if it is in TRANSIENT_FAILURE; True when it did."""
        state = self.channel.get_state(try_to_connect=False)
        now_s = time.monotonic()
        if state != grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return False
        if now_s - self._reopened_at_s < self._min_reopen_interval_s:
            return False
        old, self.channel = self.channel, self._open()
        self._reopened_at_s = now_s
        task = asyncio.get_running_loop().create_task(old.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return True

    async def close(self) -> None:
        await self.channel.close()
        for task in list(self._closing):
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _no_flows() -> dict[tuple[str, str], int]:
    return {}


class GossipSource:
    """Fetches the view from gossip, plus the migrations in flight from the slot broker.

    A failed fetch replaces the gossip client: a fresh channel tries to connect at once,
    where the old one would wait out gRPC's reconnect backoff (up to two minutes), so a
    restarted gossip store is seen again within one refresh.
    """

    def __init__(
        self,
        connect: Callable[[], GossipClient],
        slots: SlotBrokerClient | None = None,
    ) -> None:
        self._connect = connect
        self.client = connect()
        self.slots = slots
        self._closing: set[asyncio.Task] = set()

    async def fetch(self) -> GossipSnapshot:
        client = self.client
        fetched_at_s = time.time()
        flows = asyncio.ensure_future(
            self.slots.pair_flows() if self.slots is not None else _no_flows()
        )
        try:
            nodes, links = await asyncio.gather(
                client.list_nodes(include_down=True), client.list_links()
            )
        except KvrsError as exc:
            self._reconnect()
            # Whatever gossip answered, there is no fresh view: the cached one keeps serving.
            if isinstance(exc, Unavailable | DeadlineExceeded):
                raise
            raise Unavailable(f"gossip: {exc}") from exc
        finally:
            if not flows.done():
                await asyncio.wait([flows])
        return GossipSnapshot(
            nodes=tuple(nodes),
            links=tuple(links),
            fetched_at_s=fetched_at_s,
            flows=flows.result(),
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
                    if event.type in (FAILED, LEFT):
                        log.info("instance %s %s: %s", event.instance_id, event.type, event.reason)
                        view.mark_down(event.instance_id)
                    elif event.type == JOINED:
                        view.request_refresh()
            except InvalidArgument as exc:
                log.warning("gossip forgot event %r, watching from now: %s", after_event_id, exc)
                after_event_id = ""
            except KvrsError as exc:
                log.debug("gossip event stream ended: %s", exc)
            # The stream ends when the client is replaced after a failed fetch.
            await asyncio.sleep(view.refresh_s)

    async def close(self) -> None:
        await self.client.close()
        for task in list(self._closing):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class SlotBrokerClient:
    """Migration slot leases at the slot broker, held in the scheduler's name."""

    def __init__(self, broker: PeerChannel, holder_id: str, ttl_s: float, timeout_s: float) -> None:
        self.broker = broker
        self.holder_id = holder_id
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s

    async def reserve(self, request_id: str, src_id: str, dst_id: str) -> Lease:
        stub = slots_pb2_grpc.SlotBrokerServiceStub(self.broker.channel)
        try:
            reply = await stub.ReserveSlot(
                slots_pb2.ReserveSlotRequest(
                    request_id=request_id,
                    holder_id=self.holder_id,
                    src_instance_id=src_id,
                    dst_instance_id=dst_id,
                    ttl_s=self.ttl_s,
                ),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            self.broker.reopen_if_failing()
            raise relayed(error_from_rpc(exc, "slot broker")) from None
        lease = reply.lease
        return Lease(
            lease_id=lease.lease_id,
            request_id=lease.request_id,
            holder_id=lease.holder_id,
            src_id=lease.src_instance_id,
            dst_id=lease.dst_instance_id,
            expires_unix_ms=lease.expires_unix_ms,
        )

    async def _stats(self) -> slots_pb2.GetSlotStatsResponse:
        stub = slots_pb2_grpc.SlotBrokerServiceStub(self.broker.channel)
        try:
            return await stub.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.broker.reopen_if_failing()
            raise relayed(error_from_rpc(exc, "slot broker")) from None

    async def free_slots(self) -> int:
        stats = await self._stats()
        return max(0, stats.cluster_cap - stats.slots_in_use)

    async def pair_flows(self) -> dict[tuple[str, str], int]:
        """Leases in flight per (src, dst) pair; empty when the broker cannot say."""
        try:
            stats = await self._stats()
        except (KvrsError, grpc.aio.AioRpcError) as exc:
            log.debug("no flow counts from the slot broker: %s", exc)
            return {}
        return {
            (link.src_instance_id, link.dst_instance_id): link.in_use
            for link in stats.links
            if link.in_use > 0
        }
