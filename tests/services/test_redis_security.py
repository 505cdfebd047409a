"""Gossip and the slot broker against a Redis that wants a password, TLS, or a client
certificate: private `redis-server` processes configured that way, real gRPC servers."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs import errors
from kvrs.cli.launcher import find_redis_server, free_ports
from kvrs.v1 import slots_pb2, slots_pb2_grpc
from services.common import ConfigError, GrpcSettings, RedisTls, open_channel, setup_tracing
from services.common.gossip_records import Registration
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.slot_broker.config import Config as BrokerConfig
from services.slot_broker.server import build_server as build_broker

PASSWORD = "s3cret-for-tests"
PREFIX = "{kvrs-sec}:"


def _redis(args: list[str], ping) -> Iterator[None]:
    """A private redis-server with `args`; `ping()` says when it answers."""
    process = subprocess.Popen(
        [find_redis_server(), "--save", "", "--appendonly", "no", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, "redis-server exited"
            try:
                ping()
                break
            except redis.exceptions.RedisError:
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)
        yield
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def auth_url() -> Iterator[str]:
    (port,) = free_ports(1)
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    for _ in _redis(
        ["--port", str(port), "--requirepass", PASSWORD], lambda: redis.Redis.from_url(url).ping()
    ):
        yield url


@pytest.fixture(scope="module")
def tls_port(certs) -> Iterator[int]:
    """Redis speaking only TLS, requiring a client certificate signed by the dev CA."""
    (port,) = free_ports(1)
    args = [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(certs / "server.pem"),
        "--tls-key-file",
        str(certs / "server.key"),
        "--tls-ca-cert-file",
        str(certs / "ca.pem"),
        "--tls-auth-clients",
        "yes",
    ]

    def ping() -> None:
        redis.Redis(
            host="localhost",
            port=port,
            ssl=True,
            ssl_ca_certs=str(certs / "ca.pem"),
            ssl_certfile=str(certs / "client.pem"),
            ssl_keyfile=str(certs / "client.key"),
        ).ping()

    for _ in _redis(args, ping):
        yield port


async def _gossip_round_trip(config: GossipConfig) -> list[str]:
    """Registers one instance through a gossip server on `config`; the instances listed."""
    handle = await build_gossip(config, setup_tracing("gossip", exporter=InMemorySpanExporter()))
    try:
        async with GossipClient(f"127.0.0.1:{handle.port}", timeout_s=5) as client:
            await client.register(Registration("decode-0", "decode", "127.0.0.1:1"))
            return [node.registration.instance_id for node in await client.list_nodes()]
    finally:
        await handle.stop(0)


async def test_gossip_and_the_slot_broker_authenticate_with_the_password_in_the_url(auth_url):
    config = GossipConfig(listen_addr="127.0.0.1:0", redis_url=auth_url, redis_prefix=PREFIX)
    assert await _gossip_round_trip(config) == ["decode-0"]
    broker = await build_broker(
        BrokerConfig(listen_addr="127.0.0.1:0", redis_url=auth_url, redis_prefix=PREFIX),
        setup_tracing("broker", exporter=InMemorySpanExporter()),
    )
    channel = open_channel(f"127.0.0.1:{broker.port}", GrpcSettings())
    try:
        reply = await slots_pb2_grpc.SlotBrokerServiceStub(channel).ReserveSlot(
            slots_pb2.ReserveSlotRequest(
                request_id="r-auth", holder_id="test", src_instance_id="p0", dst_instance_id="d0"
            ),
            timeout=5,
        )
        assert reply.lease.lease_id and reply.slots_in_use == 1
    finally:
        await channel.close()
        await broker.stop(0)


async def test_a_wrong_password_is_unavailable_naming_redis(auth_url):
    wrong = auth_url.replace(PASSWORD, "guess")
    config = GossipConfig(listen_addr="127.0.0.1:0", redis_url=wrong, redis_prefix=PREFIX)
    with pytest.raises(errors.Unavailable) as failure:
        await _gossip_round_trip(config)
    assert "redis" in str(failure.value)


async def test_rediss_with_the_ca_and_a_client_certificate(certs, tls_port):
    url = f"rediss://localhost:{tls_port}/0"
    tls = RedisTls(
        ca_file=str(certs / "ca.pem"),
        cert_file=str(certs / "client.pem"),
        key_file=str(certs / "client.key"),
    )
    config = GossipConfig(
        listen_addr="127.0.0.1:0", redis_url=url, redis_prefix=PREFIX, redis_tls=tls
    )
    assert await _gossip_round_trip(config) == ["decode-0"]


@pytest.mark.parametrize("missing", ["the CA", "the client certificate"])
async def test_rediss_without_the_ca_or_the_client_certificate_is_refused(certs, tls_port, missing):
    tls = (
        RedisTls(cert_file=str(certs / "client.pem"), key_file=str(certs / "client.key"))
        if missing == "the CA"
        else RedisTls(ca_file=str(certs / "ca.pem"))
    )
    config = GossipConfig(
        listen_addr="127.0.0.1:0",
        redis_url=f"rediss://localhost:{tls_port}/0",
        redis_prefix=PREFIX,
        redis_tls=tls,
    )
    with pytest.raises(errors.Unavailable):
        await asyncio.wait_for(_gossip_round_trip(config), 30)


def test_redis_tls_settings_are_checked_at_start(certs):
    ca = str(certs / "ca.pem")
    env = {"REDIS_URL": "rediss://redis:6380/0", "KVRS_REDIS_TLS_CA_FILE": ca}
    assert GossipConfig.from_env(env).redis_tls == RedisTls(ca_file=ca)
    assert BrokerConfig.from_env(env).redis_tls == RedisTls(ca_file=ca)
    with pytest.raises(ConfigError, match="KVRS_REDIS_TLS_CA_FILE names a missing file"):
        GossipConfig.from_env({**env, "KVRS_REDIS_TLS_CA_FILE": "/nonexistent/ca.pem"})
    with pytest.raises(ConfigError, match="need a rediss:// REDIS_URL"):
        GossipConfig.from_env({**env, "REDIS_URL": "redis://redis:6379/0"})
    with pytest.raises(ConfigError, match="must be set together"):
        BrokerConfig.from_env({**env, "KVRS_REDIS_TLS_CERT_FILE": str(certs / "client.pem")})
