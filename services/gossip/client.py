"""Async client of the gossip service and the heartbeat loop every instance runs.

    async with GossipClient("gossip:50051", GrpcSettings.from_env(), provider) as gossip:
        loop = HeartbeatLoop(gossip, Registration("decode-0", "decode", "w0:50060"),
                             load=lambda: NodeLoad(queue_depth=len(queue)))
        await loop.start()
        ...
        await loop.stop()

Callers deal only in `services.common.gossip_records` types and `kvrs.errors` exceptions: a
failed RPC raises the `KvrsError` subclass matching its status code (`kvrs.rpc.error_from_rpc`:
NotFound, FailedPrecondition, InvalidArgument, Unavailable, DeadlineExceeded, ...), with the
`grpc.aio.AioRpcError` chained as its cause. Every call carries a deadline; the channel
retries UNAVAILABLE, since every gossip RPC is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs import errors
from kvrs.rpc import error_for_code, error_from_rpc
from kvrs.v1 import gossip_pb2, gossip_pb2_grpc
from services.common import DEFAULT_RPC_TIMEOUT_S, GrpcSettings, open_channel
from services.common.gossip_records import (
    LinkRecord,
    LinkSample,
    NodeChanges,
    NodeEvent,
    NodeLoad,
    NodeRecord,
    Registration,
)
from services.gossip import convert

__all__ = ["GossipClient", "HeartbeatLoop", "LinkSample", "NodeLoad", "Registration"]

log = logging.getLogger(__name__)

SERVICE_NAME = gossip_pb2.DESCRIPTOR.services_by_name["GossipService"].full_name

_WATCH_RECONNECT_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)
_MAX_RECONNECT_BACKOFF_S = 2.0
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _request_id() -> str:
    return uuid.uuid4().hex


class GossipClient:
    """Calls the gossip service at `address`; one channel, closed by `close()`."""

    def __init__(
        self,
        address: str,
        settings: GrpcSettings | None = None,
        provider: TracerProvider | None = None,
        *,
        timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        watch_stream_s: float = 60.0,
    ) -> None:
        """`timeout_s` bounds each unary call; `watch_stream_s` each WatchEvents stream,
        which `watch_events` then reopens from the last event seen."""
        self._channel = open_channel(
            address, settings or GrpcSettings(), provider, idempotent_services=(SERVICE_NAME,)
        )
        self._stub = gossip_pb2_grpc.GossipServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._watch_stream_s = watch_stream_s
        self._closed = False

    async def close(self) -> None:
        """Closes the channel; open `watch_events` iterators end. Safe to call twice."""
        self._closed = True
        await self._channel.close()

    async def __aenter__(self) -> GossipClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Awaitable], request):
        try:
            return await method(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from exc

    async def register(self, registration: Registration) -> NodeRecord:
        """Registers or refreshes an instance; returns it as stored (TTL resolved)."""
        reply = await self._call(
            self._stub.RegisterNode, convert.registration_to_pb(registration, _request_id())
        )
        return convert.node_from_pb(reply.node)

    async def heartbeat(
        self,
        instance_id: str,
        load: NodeLoad | None = None,
        *,
        load_unchanged: bool = False,
        prefix_hashes_unchanged: bool = False,
    ) -> int:
        """Reports liveness and load; returns when the instance expires (unix ms).

        `load_unchanged` / `prefix_hashes_unchanged`: the registry keeps what an earlier
        heartbeat stored for the load fields / the resident prefix set, and they are not
        sent. NotFound: the registry does not know the instance; FailedPrecondition: it
        was declared failed or left. Register again in both cases (HeartbeatLoop does).
        """
        request = convert.heartbeat_to_pb(
            instance_id,
            load or NodeLoad(),
            _request_id(),
            load_unchanged=load_unchanged,
            prefix_hashes_unchanged=prefix_hashes_unchanged,
        )
        reply = await self._call(self._stub.Heartbeat, request)
        return reply.expires_unix_ms

    def heartbeat_stream(self) -> HeartbeatStream:
        """A long-lived StreamHeartbeats call for one instance (or several, in turn)."""
        return HeartbeatStream(self._stub, self._timeout_s)

    async def deregister(self, instance_id: str, reason: str = "") -> None:
        """Leaves cleanly (a "left" event, not "failed"); NotFound for an unknown id."""
        request = gossip_pb2.DeregisterNodeRequest(
            request_id=_request_id(), instance_id=instance_id, reason=reason
        )
        await self._call(self._stub.DeregisterNode, request)

    async def report_link_sample(self, sample: LinkSample) -> None:
        """Publishes the newest bandwidth estimate of the path src -> dst."""
        await self._call(
            self._stub.ReportLinkSample, convert.link_sample_to_pb(sample, _request_id())
        )

    async def list_nodes(
        self, role: str | None = None, include_down: bool = False
    ) -> list[NodeRecord]:
        """Alive instances ("prefill" / "decode" / None = all), each with its age_s."""
        if role and role not in convert.ROLE_TO_PB:
            raise errors.InvalidArgument("role", f"must be one of {tuple(convert.ROLE_TO_PB)}")
        request = gossip_pb2.ListNodesRequest(
            role=convert.ROLE_TO_PB[role] if role else None, include_down=include_down
        )
        reply = await self._call(self._stub.ListNodes, request)
        return [convert.node_from_pb(info) for info in reply.nodes]

    async def list_changes(self, after_change_id: str = "") -> NodeChanges:
        """The instances that changed after `after_change_id` ("" = every instance, `full`).

        A view applies each reply's nodes over its copy (or replaces its copy when `full`:
        the history no longer reached back) and passes `change_id` next time.
        """
        reply = await self._call(
            self._stub.ListChanges, gossip_pb2.ListChangesRequest(after_change_id=after_change_id)
        )
        return convert.changes_from_pb(reply)

    async def list_links(self, measured_after_unix_ms: int = 0) -> list[LinkRecord]:
        """The newest sample of every measured link, each with its age_s; with
        `measured_after_unix_ms`, only those measured after then."""
        reply = await self._call(
            self._stub.ListLinks,
            gossip_pb2.ListLinksRequest(measured_after_unix_ms=measured_after_unix_ms),
        )
        return [convert.link_from_pb(info) for info in reply.links]

    async def watch_events(self, after_event_id: str = "") -> AsyncIterator[NodeEvent]:
        """Yields joined / failed / left events until the client is closed.

        `after_event_id`: "" = only events from now on, "0" = all retained history, or
        the `event_id` of the last event already handled. When the stream breaks (server
        restart, network, the periodic `watch_stream_s` deadline) it is reopened after the
        last event yielded, so none is lost while the history retains it. Before any
        event was seen, a reopened "" stream resumes from this call's start time (stream
        ids are Redis-clock milliseconds). InvalidArgument for a malformed id.
        """
        after = after_event_id
        started_ms = int(time.time() * 1000)
        backoff_s = 0.05
        while not self._closed:
            call = self._stub.WatchEvents(
                gossip_pb2.WatchEventsRequest(after_event_id=after), timeout=self._watch_stream_s
            )
            try:
                async for message in call:
                    event = convert.event_from_pb(message)
                    after = event.event_id
                    backoff_s = 0.05
                    yield event
            except grpc.aio.AioRpcError as exc:
                if self._closed:
                    return
                if exc.code() not in _WATCH_RECONNECT_CODES:
                    raise error_from_rpc(exc) from exc
                log.debug("event stream broke (%s); reopening", exc.code().name)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
            finally:
                call.cancel()
                if after == "":
                    after = f"{started_ms}-0"
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, _MAX_RECONNECT_BACKOFF_S)


class HeartbeatStream:
    """Heartbeats over one StreamHeartbeats call, opened on first use and reopened after
    it breaks; one beat at a time (each waits for its answer).

    A beat costs the registry a message on an open stream instead of a unary call (no
    call set-up, no span per beat). Errors are those of `GossipClient.heartbeat`.
    """

    def __init__(self, stub: gossip_pb2_grpc.GossipServiceStub, timeout_s: float) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()

    async def heartbeat(
        self,
        instance_id: str,
        load: NodeLoad | None = None,
        *,
        load_unchanged: bool = False,
        prefix_hashes_unchanged: bool = False,
    ) -> int:
        request = convert.heartbeat_to_pb(
            instance_id,
            load or NodeLoad(),
            "",
            load_unchanged=load_unchanged,
            prefix_hashes_unchanged=prefix_hashes_unchanged,
        )
        async with self._lock:
            if self._call is None:
                self._call = self._stub.StreamHeartbeats()
            call = self._call
            try:
                async with asyncio.timeout(self._timeout_s):
                    await call.write(request)
                    reply = await call.read()
            except TimeoutError:
                self._drop(call)
                raise errors.DeadlineExceeded(
                    f"no heartbeat answer within {self._timeout_s} s"
                ) from None
            except grpc.aio.AioRpcError as exc:
                self._drop(call)
                raise error_from_rpc(exc) from exc
            except asyncio.CancelledError:
                self._drop(call)  # its answer would be read as the next beat's
                raise
            if reply is grpc.aio.EOF:
                self._drop(call)
                raise errors.Unavailable("the gossip service ended the heartbeat stream")
        if reply.code:
            raise error_for_code(_STATUS_CODES[reply.code], reply.message)
        return reply.expires_unix_ms

    def _drop(self, call: grpc.aio.StreamStreamCall) -> None:
        call.cancel()
        if self._call is call:
            self._call = None

    async def close(self) -> None:
        """Ends the stream; safe to call twice. A later beat opens a new one."""
        async with self._lock:
            if self._call is not None:
                call, self._call = self._call, None
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call.done_writing()
                call.cancel()


WORK_THRESHOLD_S = 0.001
"""A change of `queued_work_s` below this is not worth a load update (W(x) within 1 ms)."""
FREE_KV_THRESHOLD = 0.01
"""A change of free KV blocks below this share of the capacity is not worth an update."""
COMPUTE_FACTOR_THRESHOLD = 0.05
"""A change of `compute_factor` below this share of it is not worth an update."""
CONTEXT_THRESHOLD = 0.05
"""A change of `running_context_tokens` below this share of it is not worth an update
(it grows by one token per stream at every decode step)."""
FULL_LOAD_EVERY = 10
"""Every this many beats the whole load is sent, whatever changed: what the thresholds
held back reaches the registry within this many intervals."""


def load_changed(sent: NodeLoad, load: NodeLoad, kv_capacity_blocks: int) -> bool:
    """Whether `load`'s scalar fields differ from `sent` by more than the thresholds."""
    return (
        load.queue_depth != sent.queue_depth
        or load.running_requests != sent.running_requests
        or abs(load.queued_work_s - sent.queued_work_s) >= WORK_THRESHOLD_S
        or abs(load.free_kv_blocks - sent.free_kv_blocks)
        > FREE_KV_THRESHOLD * max(0, kv_capacity_blocks)
        or abs(load.compute_factor - sent.compute_factor)
        > COMPUTE_FACTOR_THRESHOLD * max(1.0, sent.compute_factor)
        or abs(load.running_context_tokens - sent.running_context_tokens)
        > CONTEXT_THRESHOLD * sent.running_context_tokens
    )


LoadSource = Callable[[], "NodeLoad | Awaitable[NodeLoad]"]


class HeartbeatLoop:
    """Keeps one instance registered: register, then heartbeat every `interval_s`.

    Each heartbeat carries `load()` (sync or async; when it raises, the last good load
    is sent, so a broken metric never makes a healthy instance look dead). When the
    registry answers FailedPrecondition (it declared the instance failed and told the
    cluster, so its in-flight requests are being recovered elsewhere) or NotFound (it no
    longer knows the instance), the loop registers again at once and then calls
    `on_reregistered`, where the instance drops the work the cluster gave up on (only
    after a failure declaration: `declared_failed` says which it was). Other
    errors are logged and retried at the next beat; the loop itself never dies of one.

    Beats go over one StreamHeartbeats stream, and carry only what changed since the
    registry last stored it: the load fields when they moved past the thresholds
    (`load_changed`), the prefix set when it differs, and everything every
    `FULL_LOAD_EVERY` beats and after each (re-)registration.
    """

    def __init__(
        self,
        client: GossipClient,
        registration: Registration,
        load: LoadSource | None = None,
        interval_s: float | None = None,
        on_reregistered: Callable[[], Awaitable[None] | None] | None = None,
        beating: Callable[[], bool] | None = None,
    ) -> None:
        """`interval_s` defaults to a quarter of the TTL the registry resolved (the
        registration's own, or the server default). A beat is skipped (the instance
        falls silent) while `beating()` says False."""
        self._client = client
        self._registration = registration
        self._load_source = load
        self._interval_s = interval_s
        self._on_reregistered = on_reregistered
        self._beating = beating
        self._last_load = NodeLoad()
        self._stream = client.heartbeat_stream()
        self._sent: NodeLoad | None = None
        """The load the registry holds for the instance; None = unknown, send it all."""
        self._beats_since_full = 0
        self._task: asyncio.Task[None] | None = None
        self.registrations = 0
        """Successful registrations: 1 after `start`, +1 per re-registration."""
        self.declared_failed = False
        """Why the last re-registration happened: True when the registry had declared the
        instance failed (FailedPrecondition: its work was recovered elsewhere), False when
        it no longer knew the instance (NotFound: a registry that lost its data declared
        nothing, so no one took the instance's work over)."""

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> NodeRecord:
        """Registers (errors propagate: the instance is not announced) and starts beating."""
        if self.running:
            raise errors.FailedPrecondition("the heartbeat loop is already running")
        record = await self._register()
        interval_s = self._interval_s or record.heartbeat_ttl_s / 4
        self._task = asyncio.create_task(
            self._run(interval_s), name=f"heartbeat-{record.registration.instance_id}"
        )
        return record

    async def stop(self, deregister: bool = True, reason: str = "shutdown") -> None:
        """Stops beating; with `deregister`, leaves cleanly ("left", not "failed").

        Safe to call twice and before `start`.
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            await self._stream.close()
            if deregister:
                try:
                    await self._client.deregister(self._registration.instance_id, reason)
                except errors.KvrsError as exc:
                    log.warning("deregistering %s failed: %s", self._registration.instance_id, exc)

    async def _register(self) -> NodeRecord:
        record = await self._client.register(self._registration)
        self._sent = None  # a (re)joining instance's stored load was reset
        self.registrations += 1
        return record

    async def _send(self, load: NodeLoad) -> None:
        sent = self._sent
        full = sent is None or self._beats_since_full + 1 >= FULL_LOAD_EVERY
        load_unchanged = prefix_unchanged = False
        if sent is not None and not full:
            load_unchanged = not load_changed(sent, load, self._registration.kv_capacity_blocks)
            prefix_unchanged = load.resident_prefix_hashes == sent.resident_prefix_hashes
        self._sent = None  # unknown until the registry answers
        await self._stream.heartbeat(
            self._registration.instance_id,
            load,
            load_unchanged=load_unchanged,
            prefix_hashes_unchanged=prefix_unchanged,
        )
        self._beats_since_full = 0 if full else self._beats_since_full + 1
        if load_unchanged:
            # What the registry holds now: the load sent before, the prefix set as sent.
            assert sent is not None
            load = replace(sent, resident_prefix_hashes=load.resident_prefix_hashes)
        self._sent = load

    async def _current_load(self) -> NodeLoad:
        if self._load_source is None:
            return self._last_load
        try:
            load = self._load_source()
            if inspect.isawaitable(load):
                load = await load
        except Exception:  # noqa: BLE001 - any metric bug: keep beating with the last load
            log.exception("load callback of %s failed", self._registration.instance_id)
            return self._last_load
        self._last_load = load
        return load

    async def _beat(self) -> None:
        instance_id = self._registration.instance_id
        if self._beating is not None and not self._beating():
            return
        load = await self._current_load()
        try:
            await self._send(load)
            return
        except (errors.NotFound, errors.FailedPrecondition) as exc:
            log.warning("registering %s again: %s", instance_id, exc)
            declared_failed = isinstance(exc, errors.FailedPrecondition)
        except errors.KvrsError as exc:
            log.warning("heartbeat of %s failed, retrying: %s", instance_id, exc)
            return
        try:
            await self._register()
        except errors.KvrsError as exc:
            # The next beat is refused again and registers again.
            log.warning("registering %s again failed, retrying: %s", instance_id, exc)
            return
        self.declared_failed = declared_failed
        # Once registered the instance must drop what the cluster gave up on, whatever
        # becomes of the beat that follows: the next one would be accepted, and the
        # callback never called.
        if self._on_reregistered is not None:
            outcome = self._on_reregistered()
            if inspect.isawaitable(outcome):
                await outcome
        try:
            await self._send(await self._current_load())
        except errors.KvrsError as exc:
            log.warning("heartbeat of %s failed, retrying: %s", instance_id, exc)

    async def _run(self, interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        next_beat_s = loop.time()
        while True:
            next_beat_s = max(next_beat_s + interval_s, loop.time())
            await asyncio.sleep(next_beat_s - loop.time())
            try:
                await self._beat()
            except Exception:  # noqa: BLE001 - a loop that dies silently fakes a failure
                log.exception("heartbeat of %s failed", self._registration.instance_id)
