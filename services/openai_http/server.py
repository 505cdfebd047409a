"""HTTP adapter assembly: the aiohttp server over a generator (the router, in production)."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from kvrs.errors import KvrsError
from services.common import ConfigError, Metrics, serve_metrics
from services.common.healthcheck import check_health
from services.common.server import Cleanup
from services.common.tokenizer import load_codec
from services.openai_http.app import CompletionsApi
from services.openai_http.config import Config
from services.openai_http.generation import Generator, RouterGenerator

log = logging.getLogger(__name__)


@dataclass
class HttpServerHandle:
    """A started HTTP server and the port it bound."""

    runner: web.AppRunner
    port: int
    cleanups: list[Cleanup] = field(default_factory=list)

    async def stop(self) -> None:
        """Stops accepting, lets in-flight requests finish (up to the shutdown grace), then
        runs the cleanups; safe to call twice."""
        await self.runner.cleanup()
        while self.cleanups:
            await self.cleanups.pop()()


async def build_server(
    config: Config,
    generator: Generator,
    provider: TracerProvider,
    metrics: Metrics | None = None,
) -> HttpServerHandle:
    """Serves the OpenAI API on `config.listen_addr` with completions from `generator`;
    `/ready` asks the router at `config.router_addr`."""
    try:
        codec = load_codec(config.checkpoint)
    except KvrsError as exc:
        raise ConfigError(f"KVRS_MODEL {config.checkpoint}: {exc}") from None

    async def router_health() -> str:
        return await check_health(
            config.router_addr, config.grpc, timeout_s=config.readiness_timeout_s
        )

    api = CompletionsApi(
        config,
        generator,
        provider.get_tracer("kvrs.openai_http"),
        metrics,
        codec,
        readiness=router_health,
    )
    runner = web.AppRunner(
        api.app(),
        handle_signals=False,
        access_log=None,
        shutdown_timeout=config.grpc.shutdown_grace_s,
    )
    await runner.setup()
    host, _, port = config.listen_addr.rpartition(":")
    site = web.TCPSite(runner, host.strip("[]") or "127.0.0.1", int(port))
    await site.start()
    bound = runner.addresses[0][1]
    log.info(
        "serving the OpenAI API for model %s on port %d (router %s)",
        config.model,
        bound,
        config.router_addr,
    )
    return HttpServerHandle(runner=runner, port=bound)


async def serve(config: Config, provider: TracerProvider) -> None:
    """Runs the adapter until SIGTERM/SIGINT, then drains and shuts down."""
    metrics = Metrics()
    serve_metrics(metrics, config.metrics_addr)
    generator = RouterGenerator(config.router_addr, config.grpc, provider)
    handle = await build_server(config, generator, provider, metrics)
    handle.cleanups.append(generator.close)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.1f s", config.grpc.shutdown_grace_s)
    await handle.stop()
    provider.shutdown()
