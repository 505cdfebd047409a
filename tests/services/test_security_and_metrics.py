"""TLS/mTLS on the shared server bootstrap, message-size limits, and the metrics endpoint."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import (
    GrpcSettings,
    Metrics,
    TlsConfig,
    open_channel,
    serve_metrics,
    setup_tracing,
    start_server,
)


def _noop(server: grpc.aio.Server) -> None:
    """Health and reflection are enough to exercise the transport."""


async def _check(settings: GrpcSettings, port: int) -> health_pb2.HealthCheckResponse:
    channel = open_channel(f"localhost:{port}", settings)
    try:
        return await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=3
        )
    finally:
        await channel.close()


async def _start(settings: GrpcSettings):
    provider = setup_tracing("tls-test", exporter=InMemorySpanExporter())
    return await start_server(_noop, [], "127.0.0.1:0", settings, provider)


async def test_tls_client_without_the_ca_is_refused(certs: Path):
    server_tls = TlsConfig(cert_file=str(certs / "server.pem"), key_file=str(certs / "server.key"))
    handle = await _start(GrpcSettings(tls=server_tls))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await _check(GrpcSettings(), handle.port)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        trusted = GrpcSettings(tls=TlsConfig(ca_file=str(certs / "ca.pem")))
        reply = await _check(trusted, handle.port)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await handle.stop(0)


async def test_mtls_rejects_a_client_without_a_certificate(certs: Path):
    server_tls = TlsConfig(
        cert_file=str(certs / "server.pem"),
        key_file=str(certs / "server.key"),
        ca_file=str(certs / "ca.pem"),
        require_client_cert=True,
    )
    handle = await _start(GrpcSettings(tls=server_tls))
    try:
        ca_only = GrpcSettings(tls=TlsConfig(ca_file=str(certs / "ca.pem")))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(ca_only, handle.port)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        client_tls = TlsConfig(
            cert_file=str(certs / "client.pem"),
            key_file=str(certs / "client.key"),
            ca_file=str(certs / "ca.pem"),
        )
        reply = await _check(GrpcSettings(tls=client_tls), handle.port)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await handle.stop(0)


async def test_oversized_messages_are_refused():
    settings = GrpcSettings(max_message_bytes=1024)
    handle = await _start(settings)
    channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as too_big:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="x" * 4096), timeout=3
            )
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await channel.close()
        await handle.stop(0)


def test_metrics_endpoint_serves_recorded_decisions():
    metrics = Metrics()
    metrics.decisions.labels(decision="recover", action="migrate").inc(3)
    metrics.slots_in_use.set(5)
    port = serve_metrics(metrics, "127.0.0.1:0")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3).read().decode()
    assert 'kvrs_decisions_total{action="migrate",decision="recover"} 3.0' in body
    assert "kvrs_slots_in_use 5.0" in body
