"""Asks a server's standard gRPC health service how it is, over TLS when configured.

A container healthcheck and the local launcher both ask it, so "healthy" means what each
service decided it means (workers: after their canary forward pass), not that a port is
open.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrs.rpc.channels import open_channel
from kvrs.rpc.settings import GrpcSettings

SERVING = "SERVING"


async def check_health(
    address: str, settings: GrpcSettings, service: str = "", timeout_s: float = 1.0
) -> str:
    """The server's health status name (SERVING, NOT_SERVING, ...), or the status code name
    of the failed check (UNAVAILABLE when nothing listens, DEADLINE_EXCEEDED, ...)."""
    async with open_channel(address, settings) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
