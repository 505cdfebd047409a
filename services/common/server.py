"""Server bootstrap shared by every kvrs service.

`start_server` builds a grpc.aio server with the tracing and error interceptors, the
library health service and reflection, binds it (TLS/mTLS when configured) and starts
it; `run_until_signal` settles the heap (`heap.settle_heap`), then waits for
SIGTERM/SIGINT and shuts down in order: NOT_SERVING → stop(grace) → the service's own
cleanup → flush the tracer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from kvrs.rpc import GrpcSettings
from services.common.errors import ErrorInterceptor
from services.common.heap import settle_heap
from services.common.telemetry import server_interceptors

log = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]


def configure_logging() -> None:
    """Process-wide logging for a service's __main__ (level from KVRS_LOG_LEVEL)."""
    logging.basicConfig(
        level=os.environ.get("KVRS_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@dataclass
class ServerHandle:
    """A started server, the port it bound and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: HealthServicer
    service_names: Sequence[str]
    cleanups: list[Cleanup] = field(default_factory=list)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Graceful stop; safe to call twice and after a partial start."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        while self.cleanups:
            await self.cleanups.pop()()


def server_credentials(settings: GrpcSettings) -> grpc.ServerCredentials | None:
    tls = settings.tls
    if not tls.cert_file:
        return None
    return grpc.ssl_server_credentials(
        [(tls.read(tls.key_file), tls.read(tls.cert_file))],
        root_certificates=tls.read(tls.ca_file),
        require_client_auth=tls.require_client_cert,
    )


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    listen_addr: str,
    settings: GrpcSettings,
    provider: TracerProvider,
    serving: bool = True,
) -> ServerHandle:
    """Build, bind and start a server; `register` adds the service's servicers.

    `serving=False` leaves health NOT_SERVING until the caller says otherwise (workers
    wait for their canary forward pass).
    """
    server = grpc.aio.server(
        interceptors=[*server_interceptors(provider), ErrorInterceptor()],
        options=settings.channel_options(),
    )
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            *service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    credentials = server_credentials(settings)
    if credentials is None:
        port = server.add_insecure_port(listen_addr)
    else:
        port = server.add_secure_port(listen_addr, credentials)
    if port == 0:
        raise OSError(f"cannot bind {listen_addr}")
    await server.start()
    handle = ServerHandle(server=server, port=port, health=health, service_names=service_names)
    await handle.set_serving(serving)
    log.info("serving %s on port %d", ", ".join(service_names), port)
    return handle


async def run_until_signal(
    handle: ServerHandle, settings: GrpcSettings, provider: TracerProvider
) -> None:
    """Block until SIGTERM/SIGINT, then drain and shut down (see module doc)."""
    settle_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.1f s", settings.shutdown_grace_s)
    await handle.stop(settings.shutdown_grace_s)
    provider.shutdown()
