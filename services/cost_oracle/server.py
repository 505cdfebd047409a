"""Cost oracle server assembly: the cached gossip view and the servicer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, fields

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.v1 import oracle_pb2, oracle_pb2_grpc
from services.common import ServerHandle, run_until_signal, start_server
from services.common.decision_inputs import load_inputs
from services.common.gossip_source import GossipSource
from services.common.gossip_view import ViewCache
from services.common.metrics import Metrics, serve_metrics
from services.cost_oracle.config import Config
from services.cost_oracle.estimates import CostOracle
from services.cost_oracle.servicer import CostOracleServicer
from services.gossip.client import GossipClient

log = logging.getLogger(__name__)

SERVICE_NAME = oracle_pb2.DESCRIPTOR.services_by_name["CostOracleService"].full_name


@dataclass
class CostOracleServerHandle(ServerHandle):
    """A started cost oracle and its view (tests wait on its refreshes)."""

    view: ViewCache | None = None


async def build_server(
    config: Config, provider: TracerProvider, metrics: Metrics | None = None
) -> CostOracleServerHandle:
    """Starts a cost oracle on `config.listen_addr` after one attempt to read gossip;
    `metrics.telemetry_age_s` then reads the age of the view it prices from."""
    inputs = load_inputs(config.inputs)
    source = GossipSource(
        lambda: GossipClient(config.gossip_addr, config.grpc, timeout_s=config.peer_timeout_s),
        resync_s=config.inputs.view_resync_s,
    )
    view = ViewCache(inputs, source, config.refresh_s, stale_after_s=inputs.staleness.stale_after_s)
    if not await view.refresh():
        log.warning(
            "gossip at %s did not answer; pricing from the topology file alone", config.gossip_addr
        )
    oracle = CostOracle(view)
    if metrics is not None:
        metrics.telemetry_age_s.set_function(lambda: _view_age_s(view))

    def register(server: grpc.aio.Server) -> None:
        oracle_pb2_grpc.add_CostOracleServiceServicer_to_server(CostOracleServicer(oracle), server)

    base = await start_server(register, [SERVICE_NAME], config.listen_addr, config.grpc, provider)
    handle = CostOracleServerHandle(
        **{item.name: getattr(base, item.name) for item in fields(base)}, view=view
    )
    tasks = [
        asyncio.create_task(view.run(), name="cost-oracle-view-refresh"),
        asyncio.create_task(source.watch(view), name="cost-oracle-gossip-events"),
    ]

    async def stop_background() -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await source.close()

    handle.cleanups.append(stop_background)
    return handle


async def serve(config: Config, provider: TracerProvider) -> None:
    """Runs the cost oracle until SIGTERM/SIGINT, then drains and shuts down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    handle = await build_server(config, provider, metrics)
    await run_until_signal(handle, config.grpc, provider)


def _view_age_s(view: ViewCache) -> float:
    """Seconds since the view was read from gossip; NaN before the first read."""
    state = view.state
    return float("nan") if state is None else state.age_s(view.clock())
