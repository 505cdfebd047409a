"""GossipService: protobuf in, `GossipStore` call, protobuf out.

With mTLS (`KVRS_TLS_REQUIRE_CLIENT_CERT`), the calls that speak for an instance —
RegisterNode, Heartbeat, StreamHeartbeats, DeregisterNode — are accepted only for an
`instance_id` the caller's client certificate names (its Common Name or one of its DNS
subject alternative names): an instance cannot register, heartbeat or leave as another.
Anything else is PERMISSION_DENIED, naming the field. How much this protects depends on
the certificates issued: one certificate per instance (deploy/gen-certs.sh writes them
for the local cluster's workers) confines each to its own id; a certificate shared by
many services names all of them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterable

import grpc

from kvrs.errors import FailedPrecondition, InvalidArgument, NotFound
from kvrs.v1 import gossip_pb2, gossip_pb2_grpc
from services.common.gossip_records import ALIVE, ROLES, NodeRecord
from services.common.metrics import Metrics
from services.gossip import convert
from services.gossip.change_feed import ChangeFeed
from services.gossip.store import YIELD_EVERY, GossipStore

WATCH_BLOCK_S = 0.25
"""Longest wait on the event stream before a watcher re-checks for server shutdown."""


def certified_names(context: grpc.aio.ServicerContext) -> frozenset[str]:
    """The identities the caller's verified client certificate carries (empty without one)."""
    auth = context.auth_context()
    return frozenset(
        name.decode(errors="replace")
        for name in (*auth.get("x509_common_name", ()), *auth.get("peer_dns", ()))
    )


class GossipServicer(gossip_pb2_grpc.GossipServiceServicer):
    def __init__(self, store: GossipStore, metrics: Metrics, check_identity: bool = False) -> None:
        """`check_identity`: the servers demand client certificates (mTLS); see the module."""
        self._store = store
        self._feed = ChangeFeed(store)
        self._metrics = metrics
        self._check_identity = check_identity
        self._closing = asyncio.Event()
        self.active_watchers = 0
        """WatchEvents streams open now (with one registry shard each holds a Redis
        connection while it waits; with several each polls every shard)."""

    def close(self) -> None:
        """Ends every open WatchEvents stream with OK within `WATCH_BLOCK_S`."""
        self._closing.set()

    def _refusal(self, context: grpc.aio.ServicerContext, instance_id: str) -> str:
        """Why the caller may not speak for `instance_id` ("" when it may)."""
        if not self._check_identity:
            return ""
        names = certified_names(context)
        if instance_id in names:
            return ""
        self._metrics.heartbeats.labels(outcome="denied").inc()
        return (
            f"instance_id: the client certificate names {', '.join(sorted(names)) or 'nothing'}"
            f", not {instance_id!r}"
        )

    async def _authorize(self, context: grpc.aio.ServicerContext, instance_id: str) -> None:
        refusal = self._refusal(context, instance_id)
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)

    async def RegisterNode(self, request, context: grpc.aio.ServicerContext):
        await self._authorize(context, request.instance_id)
        record = await self._store.register(convert.registration_from_pb(request))
        return gossip_pb2.RegisterNodeResponse(node=convert.node_to_pb(record))

    async def _heartbeat(self, request: gossip_pb2.HeartbeatRequest) -> int:
        outcome = "ok"
        try:
            return await self._store.heartbeat(
                request.instance_id,
                convert.load_from_pb(request),
                load_unchanged=request.load_unchanged,
                prefix_hashes_unchanged=request.prefix_hashes_unchanged,
            )
        except NotFound:
            outcome = "unknown"
            raise
        except FailedPrecondition:
            outcome = "not_alive"
            raise
        finally:
            self._metrics.heartbeats.labels(outcome=outcome).inc()

    async def Heartbeat(self, request, context: grpc.aio.ServicerContext):
        await self._authorize(context, request.instance_id)
        expires_ms = await self._heartbeat(request)
        return gossip_pb2.HeartbeatResponse(expires_unix_ms=expires_ms)

    async def StreamHeartbeats(
        self, request_iterator, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gossip_pb2.StreamHeartbeatsResponse]:
        # A refused beat is an answer on the stream, not its end: the instance registers
        # again and keeps beating over the same stream. Redis being down says nothing
        # about the instance: it ends the stream UNAVAILABLE, as the unary call fails.
        async for request in request_iterator:
            refusal = self._refusal(context, request.instance_id)
            if refusal:
                yield gossip_pb2.StreamHeartbeatsResponse(
                    instance_id=request.instance_id,
                    code=grpc.StatusCode.PERMISSION_DENIED.value[0],
                    message=refusal,
                )
                continue
            try:
                expires_ms = await self._heartbeat(request)
            except (InvalidArgument, NotFound, FailedPrecondition) as exc:
                yield gossip_pb2.StreamHeartbeatsResponse(
                    instance_id=request.instance_id,
                    code=grpc.StatusCode[exc.code].value[0],
                    message=str(exc),
                )
                continue
            yield gossip_pb2.StreamHeartbeatsResponse(
                instance_id=request.instance_id, expires_unix_ms=expires_ms
            )

    async def DeregisterNode(self, request, context: grpc.aio.ServicerContext):
        await self._authorize(context, request.instance_id)
        await self._store.deregister(request.instance_id, request.reason)
        self._metrics.membership_events.labels(type="left").inc()
        return gossip_pb2.DeregisterNodeResponse()

    async def ReportLinkSample(self, request, context: grpc.aio.ServicerContext):
        await self._store.report_link(convert.link_sample_from_pb(request))
        return gossip_pb2.ReportLinkSampleResponse()

    def _count_alive(self, records: Iterable[NodeRecord]) -> None:
        """Sets the alive gauge from a full listing: every view makes one at start and
        every resync, so the gauge stays fresh without a listing of its own."""
        alive = Counter(r.registration.role for r in records if r.state == ALIVE)
        for role in ROLES:
            self._metrics.instances_alive.labels(role=role).set(alive[role])

    async def ListNodes(self, request, context: grpc.aio.ServicerContext):
        role = convert.role_from_pb(request.role) or None
        records, now_ms = await self._store.list_nodes(role, request.include_down)
        if role is None:
            self._count_alive(records)
        return gossip_pb2.ListNodesResponse(nodes=await _nodes_pb(records), server_unix_ms=now_ms)

    async def ListChanges(self, request, context: grpc.aio.ServicerContext):
        reply = await self._feed.answer(request.after_change_id)
        if reply is not None:
            return reply
        listing = await self._store.list_changes(request.after_change_id)
        if listing.full:
            self._count_alive(listing.nodes)
        return gossip_pb2.ListChangesResponse(
            nodes=await _nodes_pb(listing.nodes),
            change_id=listing.change_id,
            full=listing.full,
            server_unix_ms=listing.now_ms,
        )

    async def ListLinks(self, request, context: grpc.aio.ServicerContext):
        if request.measured_after_unix_ms < 0:
            raise InvalidArgument(
                "measured_after_unix_ms",
                f"must be >= 0 (0 lists every link), got {request.measured_after_unix_ms}",
            )
        records, now_ms = await self._store.list_links(request.measured_after_unix_ms)
        return gossip_pb2.ListLinksResponse(
            links=[convert.link_to_pb(record) for record in records], server_unix_ms=now_ms
        )

    async def WatchEvents(
        self, request, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gossip_pb2.NodeEvent]:
        reader = self._store.event_reader(await self._store.resolve_after(request.after_event_id))
        self.active_watchers += 1
        try:
            while not self._closing.is_set():
                for event in await reader.read(WATCH_BLOCK_S):
                    yield convert.event_to_pb(event)
        finally:
            self.active_watchers -= 1


async def _nodes_pb(records: Iterable[NodeRecord]) -> list[gossip_pb2.NodeInfo]:
    """Every record as a NodeInfo, the event loop turned every `YIELD_EVERY` of them
    (a full listing's encoding would otherwise hold up the replica's other callers)."""
    nodes = []
    for index, record in enumerate(records):
        nodes.append(convert.node_to_pb(record))
        if index % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
    return nodes
