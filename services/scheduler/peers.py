"""The scheduler's adapter to the slot broker, and a channel that reopens when stuck.

They turn peer RPCs into the domain calls `decisions.Scheduler` expects (the gossip side
is `services.common.gossip_source`), and peer failures into `kvrs.errors` through
`kvrs.rpc.relayed` (RESOURCE_EXHAUSTED stays a "no slot" answer; UNAVAILABLE and
DEADLINE_EXCEEDED become "peer unreachable"; a refusal reaches the scheduler's caller as
FAILED_PRECONDITION).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.errors import KvrsError
from kvrs.rpc import error_from_rpc, relayed
from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.scheduler.leases import Lease

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
