"""The shared server bootstrap: error mapping, health, reflection, TLS settings."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import redis.exceptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.errors import InvalidArgument, NotFound
from kvrs.rpc import ConfigError, TlsConfig
from services.common import GrpcSettings, open_channel, setup_tracing, start_server
from services.common.telemetry import client_interceptors, server_interceptors

SERVICE = "kvrs.test.Probe"
Request = health_pb2.HealthCheckRequest
Response = health_pb2.HealthCheckResponse


async def _unary(request, context):
    if request.service == "invalid":
        raise InvalidArgument("service", "must not be 'invalid'")
    if request.service == "missing":
        raise NotFound("instance 'missing' is not registered")
    if request.service == "crash":
        raise RuntimeError("secret internal detail")
    if request.service == "failing-over":
        raise redis.exceptions.ClusterDownError("The cluster is down")
    if request.service == "demoted":
        raise redis.exceptions.ReadOnlyError("You can't write against a read only replica.")
    return Response(status=Response.SERVING)


async def _stream(request, context):
    yield Response(status=Response.SERVING)
    if request.service == "invalid":
        raise InvalidArgument("service", "rejected mid-stream")
    while request.service == "forever":
        yield Response(status=Response.SERVING)


def _register(server: grpc.aio.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(
            _unary, Request.FromString, Response.SerializeToString
        ),
        "Stream": grpc.unary_stream_rpc_method_handler(
            _stream, Request.FromString, Response.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture
async def traced_probe():
    """A channel to the probe service and the exporter its server's spans go to."""
    settings = GrpcSettings()
    exporter = InMemorySpanExporter()
    provider = setup_tracing("test", exporter=exporter)
    handle = await start_server(_register, [SERVICE], "127.0.0.1:0", settings, provider)
    channel = open_channel(f"127.0.0.1:{handle.port}", settings)
    yield channel, exporter
    await channel.close()
    await handle.stop(0)


@pytest.fixture
async def probe_channel(traced_probe):
    return traced_probe[0]


def _unary_call(channel):
    return channel.unary_unary(f"/{SERVICE}/Unary", Request.SerializeToString, Response.FromString)


async def test_domain_errors_map_to_their_status_and_name_the_field(probe_channel):
    call = _unary_call(probe_channel)
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await call(Request(service="invalid"), timeout=5)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.details().startswith("service:")
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await call(Request(service="missing"), timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("service", ["failing-over", "demoted"])
async def test_a_redis_cluster_failing_over_is_unavailable_not_internal(probe_channel, service):
    with pytest.raises(grpc.aio.AioRpcError) as failing:
        await _unary_call(probe_channel)(Request(service=service), timeout=5)
    assert failing.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failing.value.details().startswith("redis cluster unavailable:")


async def test_unexpected_errors_are_internal_without_leaking_details(probe_channel):
    with pytest.raises(grpc.aio.AioRpcError) as crash:
        await _unary_call(probe_channel)(Request(service="crash"), timeout=5)
    assert crash.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in crash.value.details()
    reply = await _unary_call(probe_channel)(Request(service="ok"), timeout=5)
    assert reply.status == Response.SERVING


async def test_stream_errors_are_mapped_after_items(probe_channel):
    call = probe_channel.unary_stream(
        f"/{SERVICE}/Stream", Request.SerializeToString, Response.FromString
    )
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for item in call(Request(service="invalid"), timeout=5):
            received.append(item)
    assert len(received) == 1
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_stream_the_client_cancels_ends_its_span_without_an_error_log(traced_probe, caplog):
    channel, exporter = traced_probe
    call = channel.unary_stream(
        f"/{SERVICE}/Stream", Request.SerializeToString, Response.FromString
    )(Request(service="forever"), timeout=5)
    await call.read()
    call.cancel()
    for _ in range(200):
        if any(span.name == f"/{SERVICE}/Stream" for span in exporter.get_finished_spans()):
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the cancelled stream's server span never ended")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_health_reports_serving_for_the_service(probe_channel):
    stub = health_pb2_grpc.HealthStub(probe_channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_config_names_the_bad_variable(tmp_path):
    with pytest.raises(ConfigError, match="KVRS_TLS_CA_FILE"):
        TlsConfig.from_env({"KVRS_TLS_CA_FILE": str(tmp_path / "absent.pem")})
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="KVRS_TLS_KEY_FILE"):
        TlsConfig.from_env({"KVRS_TLS_CERT_FILE": str(cert)})


async def test_health_checks_leave_no_span_where_every_other_call_does():
    """Both tracing interceptors (server and client) skip the health service alone."""
    settings = GrpcSettings()
    server_spans, client_spans = InMemorySpanExporter(), InMemorySpanExporter()
    server = setup_tracing("test-server", exporter=server_spans)
    handle = await start_server(_register, [SERVICE], "127.0.0.1:0", settings, server)
    client = setup_tracing("test-client", exporter=client_spans)
    channel = open_channel(f"127.0.0.1:{handle.port}", settings, client)
    try:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
        )
        await _unary_call(channel)(Request(service="ok"), timeout=5)
    finally:
        await channel.close()
        await handle.stop(0)
    for spans in (client_spans.get_finished_spans(), server_spans.get_finished_spans()):
        assert [span.name for span in spans] == [f"/{SERVICE}/Unary"]


async def test_a_process_without_an_exporter_neither_records_nor_intercepts():
    """No exporter: no span recorded and no tracing interceptor on its channels and
    servers, which still serve calls; with an exporter, both interceptors are there."""
    settings = GrpcSettings()
    quiet = setup_tracing("quiet", env={})
    assert client_interceptors(quiet) == [] and server_interceptors(quiet) == []
    with quiet.get_tracer("test").start_as_current_span("decision") as span:
        assert not span.is_recording()
    handle = await start_server(_register, [SERVICE], "127.0.0.1:0", settings, quiet)
    channel = open_channel(f"127.0.0.1:{handle.port}", settings, quiet)
    try:
        reply = await _unary_call(channel)(Request(service="ok"), timeout=5)
        assert reply.status == Response.SERVING
    finally:
        await channel.close()
        await handle.stop(0)
    traced = setup_tracing("traced", exporter=InMemorySpanExporter())
    assert len(client_interceptors(traced)) > 0 and len(server_interceptors(traced)) == 1


SERVES_UNTIL_SIGNAL = """
import asyncio, gc, os, signal
from opentelemetry.sdk.trace import TracerProvider
from services.common import GrpcSettings, run_until_signal, start_server

async def main():
    settings, provider = GrpcSettings(shutdown_grace_s=0.1), TracerProvider()
    handle = await start_server(
        lambda server: None, ["kvrs.test.Probe"], "127.0.0.1:0", settings, provider
    )
    before = gc.get_threshold(), gc.get_freeze_count()
    asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
    await run_until_signal(handle, settings, provider)
    print(before, gc.get_threshold(), gc.get_freeze_count() > 0)

asyncio.run(main())
"""


def test_a_serving_process_freezes_its_startup_heap_and_collects_rarely():
    """A service's long-lived heap (its views) is walked by no collection it need not
    make: what startup built is frozen once the service serves, and young collections
    wait for tens of thousands of allocations, not 700."""
    import subprocess
    import sys

    from services.common.heap import THRESHOLDS

    done = subprocess.run(
        [sys.executable, "-c", SERVES_UNTIL_SIGNAL], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.strip()
    assert printed.startswith("((700, 10, 10), 0)"), printed
    assert printed.endswith(f"{THRESHOLDS} True"), printed
