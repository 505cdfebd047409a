"""Server reflection on real kvrs servers: what a generic client (grpcurl, `kvrs rpc`) sees.

Each server lists its own service, the health service and reflection itself, and hands
out the descriptors a client needs to call its RPCs without the protos: the file that
defines the service, with the files it imports.
"""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import GrpcSettings, open_channel, setup_tracing
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.slot_broker.config import Config as BrokerConfig
from services.slot_broker.server import build_server as build_broker

REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


async def ask(address: str, request: reflection_pb2.ServerReflectionRequest):
    async with open_channel(address, GrpcSettings()) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        await call.write(request)
        reply = await call.read()
        await call.done_writing()
        return reply


@pytest.mark.parametrize(
    ("build", "config", "service", "proto_file"),
    [
        (build_gossip, GossipConfig, "kvrs.v1.GossipService", "kvrs/v1/gossip.proto"),
        (build_broker, BrokerConfig, "kvrs.v1.SlotBrokerService", "kvrs/v1/slots.proto"),
    ],
)
async def test_reflection_lists_the_service_and_describes_its_rpcs(
    build, config, service, proto_file, redis_url, redis_prefix
):
    provider = setup_tracing("test-reflection", exporter=InMemorySpanExporter())
    handle = await build(
        config(listen_addr="127.0.0.1:0", redis_url=redis_url, redis_prefix=redis_prefix),
        provider,
    )
    address = f"127.0.0.1:{handle.port}"
    try:
        listed = await ask(address, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}
        assert {service, "grpc.health.v1.Health", REFLECTION} <= names, names

        described = await ask(
            address, reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
        )
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in described.file_descriptor_response.file_descriptor_proto
        ]
        defining = next(f for f in files if f.name == proto_file)
        assert defining.package == "kvrs.v1"
        [described_service] = [s for s in defining.service if f"kvrs.v1.{s.name}" == service]
        assert described_service.method, "its RPCs are described"
        imported = {f.name for f in files}
        assert set(defining.dependency) <= imported | {"google/protobuf/empty.proto"}, (
            defining.dependency,
            imported,
        )

        unknown = await ask(
            address, reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvrs.v1.Nope")
        )
        assert unknown.WhichOneof("message_response") == "error_response"
    finally:
        await handle.stop(0)
