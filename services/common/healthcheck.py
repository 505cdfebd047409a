"""`python -m services.common.healthcheck HOST:PORT`: exit 0 when the server reports SERVING.

The container healthcheck of every service (see `kvrs.rpc.health`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvrs.rpc import SERVING, GrpcSettings, check_health


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
