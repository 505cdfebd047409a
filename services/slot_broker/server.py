"""Slot broker assembly: the servicer, its Redis lease store and the expiry sweeper."""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common import (
    RedisClient,
    ServerHandle,
    connect_redis,
    run_until_signal,
    start_server,
)
from services.common.metrics import Metrics, serve_metrics
from services.common.slot_leases import SlotPolicy, SlotStore, purge_forever
from services.slot_broker.config import Config
from services.slot_broker.servicer import SlotBrokerServicer

SERVICE_NAME = slots_pb2.DESCRIPTOR.services_by_name["SlotBrokerService"].full_name


async def build_server(
    config: Config,
    provider: TracerProvider,
    redis_client: RedisClient | None = None,
    metrics: Metrics | None = None,
) -> ServerHandle:
    """Starts a slot broker on `config.listen_addr` (a Redis client is opened from
    `config.redis_url` unless one is passed; it is then closed on stop)."""
    owns_redis = redis_client is None
    client = (
        redis_client
        if redis_client is not None
        else connect_redis(config.redis_url, config.redis_tls)
    )
    store = SlotStore(
        client,
        config.redis_prefix,
        SlotPolicy(
            cluster_cap=config.cluster_cap,
            link_cap=config.link_cap,
            default_ttl_s=config.lease_ttl_s,
            max_ttl_s=config.max_lease_ttl_s,
        ),
        metrics=metrics,
    )
    # Before serving: from here on every reservation, wherever it is made, is held to it.
    await store.publish_policy()
    servicer = SlotBrokerServicer(store)

    def register(server: grpc.aio.Server) -> None:
        slots_pb2_grpc.add_SlotBrokerServiceServicer_to_server(servicer, server)

    handle = await start_server(register, [SERVICE_NAME], config.listen_addr, config.grpc, provider)
    stop = asyncio.Event()
    sweeper = asyncio.create_task(purge_forever(store, config.purge_interval_s, stop))

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
    """Runs the slot broker until SIGTERM/SIGINT, then drains and shuts down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    handle = await build_server(config, provider, metrics=metrics)
    await run_until_signal(handle, config.grpc, provider)
