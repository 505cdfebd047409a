"""Gossip server assembly: the servicer, its Redis store and the failure sweeper."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.v1 import gossip_pb2, gossip_pb2_grpc
from services.common import (
    RedisClient,
    ServerHandle,
    connect_redis,
    run_until_signal,
    start_server,
)
from services.common.metrics import Metrics, serve_metrics
from services.gossip.config import Config
from services.gossip.servicer import GossipServicer
from services.gossip.store import GossipStore, sweep_forever

SERVICE_NAME = gossip_pb2.DESCRIPTOR.services_by_name["GossipService"].full_name


@dataclass
class GossipServerHandle(ServerHandle):
    """A started gossip server; `stop` first ends open WatchEvents streams with OK, so
    watchers see a clean end (and resume elsewhere) instead of waiting out the grace."""

    servicer: GossipServicer | None = None

    async def stop(self, grace_s: float) -> None:
        if self.servicer is not None:
            self.servicer.close()
        await super().stop(grace_s)


async def build_server(
    config: Config,
    provider: TracerProvider,
    redis_client: RedisClient | None = None,
    metrics: Metrics | None = None,
) -> GossipServerHandle:
    """Starts a gossip server on `config.listen_addr` (a Redis client is opened from
    `config.redis_url` unless one is passed; it is then closed on stop)."""
    metrics = metrics or Metrics()
    owns_redis = redis_client is None
    client = (
        redis_client
        if redis_client is not None
        else connect_redis(config.redis_url, config.redis_tls)
    )
    store = GossipStore(
        client,
        config.redis_prefix,
        default_ttl_s=config.heartbeat_ttl_s,
        events_maxlen=config.events_maxlen,
        down_retention_s=config.down_retention_s,
        changes_maxlen=config.changes_maxlen,
        confirm_ttls=config.confirm_ttls,
        shards=config.registry_shards,
    )
    tls = config.grpc.tls
    servicer = GossipServicer(
        store, metrics, check_identity=tls.enabled and tls.require_client_cert
    )

    def register(server: grpc.aio.Server) -> None:
        gossip_pb2_grpc.add_GossipServiceServicer_to_server(servicer, server)

    base = await start_server(register, [SERVICE_NAME], config.listen_addr, config.grpc, provider)
    handle = GossipServerHandle(
        **{item.name: getattr(base, item.name) for item in fields(base)}, servicer=servicer
    )
    stop = asyncio.Event()
    sweeper = asyncio.create_task(sweep_forever(store, config.sweep_interval_s, stop, metrics))

    async def stop_sweeper() -> None:
        stop.set()
        await sweeper

    async def close_redis() -> None:
        await client.aclose()

    if owns_redis:
        handle.cleanups.append(close_redis)
    handle.cleanups.append(stop_sweeper)
    return handle


async def serve(config: Config, provider: TracerProvider) -> None:
    """Runs the gossip service until SIGTERM/SIGINT, then drains and shuts down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    handle = await build_server(config, provider, metrics=metrics)
    await run_until_signal(handle, config.grpc, provider)
