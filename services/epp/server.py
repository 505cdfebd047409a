"""Endpoint picker assembly: the kvrs client, the endpoint directory, the ext_proc servicer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, fields

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_pb2_grpc
from grpc_health.v1 import health_pb2
from opentelemetry.sdk.trace import TracerProvider

from kvrs.client import KvrsClient
from kvrs.errors import KvrsError
from services.common import (
    ConfigError,
    Metrics,
    ServerHandle,
    run_until_signal,
    serve_metrics,
    start_server,
)
from services.common.tokenizer import load_codec
from services.epp.config import Config
from services.epp.endpoints import EndpointDirectory
from services.epp.picker import Picker
from services.epp.servicer import ExternalProcessorServicer

log = logging.getLogger(__name__)

SERVICE_NAME = ext_proc_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS = "liveness"
"""Health service the protocol asks for: SERVING while the process answers at all."""
READINESS = "readiness"
"""Health service the protocol asks for: SERVING once the picker can place requests (the
same as the ext_proc service's and ""'s status)."""


@dataclass
class EppServerHandle(ServerHandle):
    """A started endpoint picker and the parts tests look into."""

    picker: Picker | None = None


async def build_server(
    config: Config, provider: TracerProvider, metrics: Metrics | None = None
) -> EppServerHandle:
    """Starts the picker on `config.listen_addr`; gossip and the scheduler are asked per
    request (through a cached endpoint map), so it serves before they answer."""
    client = KvrsClient(
        config.scheduler_addrs,
        gossip_addr=config.gossip_addr,
        settings=config.grpc,
        provider=provider,
        timeout_s=config.scheduler_timeout_s,
        max_attempts=max(2, len(config.scheduler_addrs)),
    )
    directory = EndpointDirectory(
        client,
        refresh_s=config.endpoints_refresh_s,
        target_port=config.target_port,
        endpoints=config.endpoints,
        timeout_s=config.scheduler_timeout_s,
        prefill_target_port=config.prefill_target_port,
    )
    picker = Picker(
        directory,
        client,
        provider.get_tracer("kvrs.epp"),
        profile=config.profile(),
        block_tokens=config.block_tokens,
        prefill_instance_id=config.prefill_instance_id,
        policy=config.policy,
        fallback_endpoints=config.fallback_endpoints,
        prefiller_header=config.prefiller_header,
        metrics=metrics,
    )

    try:
        codec = load_codec(config.model)
    except KvrsError as exc:
        raise ConfigError(f"KVRS_MODEL {config.model}: {exc}") from None

    def register(server: grpc.aio.Server) -> None:
        ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessorServicer(picker, config.block_tokens, codec), server
        )

    base = await start_server(
        register, [SERVICE_NAME], config.listen_addr, config.grpc, provider, serving=False
    )
    handle = EppServerHandle(
        **{item.name: getattr(base, item.name) for item in fields(base)}, picker=picker
    )
    await handle.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await handle.health.set(READINESS, health_pb2.HealthCheckResponse.NOT_SERVING)
    # One try now (ready at once when gossip answers), then in the background.
    ready = asyncio.create_task(_ready_once_synced(handle, directory, config.endpoints_refresh_s))
    await asyncio.wait({ready}, timeout=config.scheduler_timeout_s)

    async def stop_waiting() -> None:
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ready

    handle.cleanups.append(client.close)
    handle.cleanups.append(stop_waiting)
    return handle


async def _ready_once_synced(
    handle: EppServerHandle, directory: EndpointDirectory, retry_s: float
) -> None:
    """Readiness, the ext_proc service and "" turn SERVING once the endpoint map first
    loads from gossip (the protocol's "datastore synced"); liveness is SERVING from the
    start. After that the last map keeps serving through a gossip outage, so readiness
    stays."""
    while True:
        try:
            await directory.current()
        except KvrsError as exc:
            log.info("not ready: %s", exc)
            await asyncio.sleep(retry_s)
            continue
        await handle.set_serving(True)
        await handle.health.set(READINESS, health_pb2.HealthCheckResponse.SERVING)
        return


async def serve(config: Config, provider: TracerProvider) -> None:
    """Runs the picker until SIGTERM/SIGINT, then drains and shuts down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    handle = await build_server(config, provider, metrics)
    await run_until_signal(handle, config.grpc, provider)
