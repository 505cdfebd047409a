"""With mTLS, an instance registers, heartbeats and leaves only as the id its certificate names.

A real gossip server demanding client certificates, the development certificates
`deploy/gen-certs.sh` writes (one per worker), the real Redis; each caller dials with the
certificate of the instance it is.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.rpc.settings import GrpcSettings, TlsConfig
from kvrs.v1 import common_pb2, gossip_pb2, gossip_pb2_grpc
from services.common import open_channel, setup_tracing
from services.gossip.config import Config
from services.gossip.server import build_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    subprocess.run(
        ["bash", str(REPO / "deploy" / "gen-certs.sh"), str(directory)],
        check=True,
        capture_output=True,
    )
    return directory


def tls(certs: Path, identity: str) -> GrpcSettings:
    return GrpcSettings(
        tls=TlsConfig(
            cert_file=str(certs / f"{identity}.pem"),
            key_file=str(certs / f"{identity}.key"),
            ca_file=str(certs / "ca.pem"),
            require_client_cert=True,
        )
    )


@pytest.fixture
async def gossip(certs, redis_url, redis_prefix):
    config = Config(
        listen_addr="127.0.0.1:0",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        heartbeat_ttl_s=5.0,
        grpc=tls(certs, "server"),
    )
    handle = await build_server(config, setup_tracing("test-gossip-tls", InMemorySpanExporter()))
    channels: list[grpc.aio.Channel] = []

    def stub_as(identity: str) -> gossip_pb2_grpc.GossipServiceStub:
        channel = open_channel(f"127.0.0.1:{handle.port}", tls(certs, identity))
        channels.append(channel)
        return gossip_pb2_grpc.GossipServiceStub(channel)

    yield stub_as
    for channel in channels:
        await channel.close()
    await handle.stop(0)


def registration(instance_id: str) -> gossip_pb2.RegisterNodeRequest:
    return gossip_pb2.RegisterNodeRequest(
        request_id=f"r-{instance_id}",
        instance_id=instance_id,
        role=common_pb2.ROLE_DECODE,
        address=f"{instance_id}:50060",
    )


async def denied(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    assert failure.value.code() == grpc.StatusCode.PERMISSION_DENIED, failure.value
    assert failure.value.details().startswith("instance_id: "), failure.value.details()
    return failure.value.details()


async def test_an_instance_cannot_register_heartbeat_or_leave_as_another(gossip):
    decode_0, decode_1 = gossip("decode-0"), gossip("decode-1")
    await decode_0.RegisterNode(registration("decode-0"), timeout=5)
    await decode_1.RegisterNode(registration("decode-1"), timeout=5)

    details = await denied(decode_0.RegisterNode(registration("decode-1"), timeout=5))
    assert "not 'decode-1'" in details and "decode-0" in details
    beat = gossip_pb2.HeartbeatRequest(instance_id="decode-1", queue_depth=99)
    await denied(decode_0.Heartbeat(beat, timeout=5))
    leave = gossip_pb2.DeregisterNodeRequest(instance_id="decode-1", reason="hijack")
    await denied(decode_0.DeregisterNode(leave, timeout=5))

    stream = decode_0.StreamHeartbeats(timeout=5)
    await stream.write(beat)
    await stream.write(gossip_pb2.HeartbeatRequest(instance_id="decode-0"))
    refused, accepted = await stream.read(), await stream.read()
    await stream.done_writing()
    assert refused.code == grpc.StatusCode.PERMISSION_DENIED.value[0], refused
    assert accepted.code == 0 and accepted.expires_unix_ms > 0, accepted

    nodes = {
        n.instance_id: n for n in (await decode_1.ListNodes(gossip_pb2.ListNodesRequest())).nodes
    }
    assert nodes["decode-1"].state == gossip_pb2.NODE_STATE_ALIVE
    assert nodes["decode-1"].queue_depth == 0, "the forged heartbeat changed nothing"
    await decode_1.Heartbeat(gossip_pb2.HeartbeatRequest(instance_id="decode-1"), timeout=5)


async def test_a_certificate_naming_no_instance_speaks_for_none(gossip):
    client = gossip("client")
    await denied(client.RegisterNode(registration("decode-0"), timeout=5))
    # Reads stay open to every authenticated caller.
    await asyncio.wait_for(client.ListNodes(gossip_pb2.ListNodesRequest()), 5)
