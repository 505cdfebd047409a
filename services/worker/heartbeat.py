"""The worker's heartbeats, sent from a thread of their own with its own event loop.

A worker's event loop carries every decode stream, pull and RPC; under load (or while
its compute thread and a CPU-starved machine leave it little time) a heartbeat queued
behind that work arrives late, and a late heartbeat makes the worker suspect. Here the
beats run on a private loop in their own thread with their own gossip channel: they need
the GIL only for the few microseconds of one RPC, which Python hands to a waiting thread
within its switch interval however busy the other threads are, and never wait behind the
worker's coroutines.

The load each beat carries is a snapshot the worker's loop refreshes every beat
interval. A worker whose loop stops making progress (wedged, not merely slow) must not
look alive forever: once the snapshot is `STALL_TTLS` TTLs old the thread stops beating,
and gossip suspects, then fails, the worker as if it had died.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from opentelemetry.sdk.trace import TracerProvider

from services.common import GrpcSettings
from services.common.gossip_records import NodeLoad, NodeRecord, Registration
from services.gossip.client import GossipClient, HeartbeatLoop

log = logging.getLogger(__name__)

STALL_TTLS = 2.0
"""TTLs without a load snapshot from the worker's loop after which the beats pause."""


class HeartbeatThread:
    """Registers and heartbeats `registration` from its own thread (see the module doc).

    `start` and `stop` are called on the worker's loop; `load` and `on_reregistered` run
    there too, never on the heartbeat thread. `on_reregistered(declared_failed)` says
    whether the registry had declared the worker failed (its streams were recovered
    elsewhere) or only no longer knew it (a registry that lost its data: nothing moved).
    """

    def __init__(
        self,
        gossip_addr: str,
        settings: GrpcSettings,
        provider: TracerProvider,
        registration: Registration,
        load: Callable[[], NodeLoad],
        on_reregistered: Callable[[bool], None],
        interval_s: float | None,
    ) -> None:
        self._gossip_addr = gossip_addr
        self._settings = settings
        self._provider = provider
        self._registration = registration
        self._load = load
        self._on_reregistered = on_reregistered
        self._interval_s = interval_s
        self._stall_s = float("inf")
        self._snapshot: tuple[float, NodeLoad] = (time.monotonic(), NodeLoad())
        self._worker_loop: asyncio.AbstractEventLoop | None = None
        self._beat_loop: asyncio.AbstractEventLoop | None = None
        self._stop_beating: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._heartbeat: HeartbeatLoop | None = None
        self._refresher: asyncio.Task | None = None
        self._finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.interval_s = 0.0
        """The beat interval the loop resolved (known after `start`)."""

    async def start(self) -> NodeRecord:
        """Registers (errors propagate) and starts beating."""
        self._worker_loop = asyncio.get_running_loop()
        self._take_snapshot()
        started: concurrent.futures.Future[NodeRecord] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run,
            args=(started,),
            name=f"heartbeat-{self._registration.instance_id}",
            daemon=True,
        )
        self._thread.start()
        record = await asyncio.wrap_future(started)
        self.interval_s = self._interval_s or record.heartbeat_ttl_s / 4
        self._stall_s = STALL_TTLS * record.heartbeat_ttl_s
        self._refresher = asyncio.create_task(self._refresh_forever())
        return record

    async def stop(self, deregister: bool = True, reason: str = "shutdown") -> None:
        """Stops beating (deregistering first unless told not to); safe twice."""
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        beat_loop, stop = self._beat_loop, self._stop_beating
        if beat_loop is None or stop is None or self._thread is None:
            return
        self._deregister, self._reason = deregister, reason
        with contextlib.suppress(RuntimeError):  # the loop already ended
            beat_loop.call_soon_threadsafe(stop.set)
        await asyncio.wrap_future(self._finished)
        await asyncio.to_thread(self._thread.join)
        self._beat_loop = self._thread = None

    # -- on the worker's loop --------------------------------------------------------

    def _take_snapshot(self) -> None:
        try:
            load = self._load()
        except Exception:  # noqa: BLE001 - a broken metric must not silence the beats
            log.exception("load of %s failed; sending the last one", self._registration.instance_id)
            load = self._snapshot[1]
        self._snapshot = (time.monotonic(), load)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._take_snapshot()

    # -- on the heartbeat thread -----------------------------------------------------

    def _fresh(self) -> bool:
        age_s = time.monotonic() - self._snapshot[0]
        if age_s > self._stall_s:
            log.warning(
                "worker loop of %s silent for %.1f s: heartbeats paused",
                self._registration.instance_id,
                age_s,
            )
            return False
        return True

    def _reregistered(self) -> None:
        assert self._worker_loop is not None and self._heartbeat is not None
        declared_failed = self._heartbeat.declared_failed
        self._worker_loop.call_soon_threadsafe(self._on_reregistered, declared_failed)

    def _run(self, started: concurrent.futures.Future[NodeRecord]) -> None:
        try:
            asyncio.run(self._beat(started))
        finally:
            self._finished.set_result(None)

    async def _beat(self, started: concurrent.futures.Future[NodeRecord]) -> None:
        self._beat_loop = asyncio.get_running_loop()
        self._stop_beating = asyncio.Event()
        self._deregister, self._reason = True, "shutdown"
        client = GossipClient(self._gossip_addr, self._settings, self._provider)
        heartbeat = HeartbeatLoop(
            client,
            self._registration,
            load=lambda: self._snapshot[1],
            interval_s=self._interval_s,
            on_reregistered=self._reregistered,
            beating=self._fresh,
        )
        self._heartbeat = heartbeat
        try:
            try:
                record = await heartbeat.start()
            except BaseException as exc:
                started.set_exception(exc)
                return
            started.set_result(record)
            await self._stop_beating.wait()
            await heartbeat.stop(deregister=self._deregister, reason=self._reason)
        finally:
            await client.close()
