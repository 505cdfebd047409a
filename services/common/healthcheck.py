"""`python -m services.common.healthcheck HOST:PORT`: exit 0 when the server reports SERVING.

A container healthcheck and the local launcher both ask the standard gRPC health service,
over TLS when KVRS_TLS_* is set, so "healthy" means what each service decided it means
(workers: after their canary forward pass), not that a port is open.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import open_channel
from services.common.config import GrpcSettings

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.common.healthcheck", description=__doc__.splitlines()[0]
    )
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help="service name ('' = the whole server)")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the check")
    args = parser.parse_args(argv)
    status = asyncio.run(
        check_health(args.address, GrpcSettings.from_env(), args.service, args.timeout_s)
    )
    print(f"{args.address}: {status}")
    return 0 if status == SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
