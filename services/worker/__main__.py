"""Entry point: `python -m services.worker --role prefill|decode` (settings: config.py)."""

from __future__ import annotations

import argparse
import asyncio
import os

from services.common import configure_logging, setup_tracing
from services.worker.config import ROLES, Config
from services.worker.server import serve

# Flags override the variable of the same meaning, for running a worker by hand.
_FLAG_ENV = {
    "instance_id": "WORKER_INSTANCE_ID",
    "listen_addr": "WORKER_LISTEN_ADDR",
    "model": "WORKER_MODEL",
    "dtype": "WORKER_DTYPE",
    "gossip_addr": "GOSSIP_ADDR",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.worker", description="a kvrs prefill/decode worker"
    )
    parser.add_argument("--role", choices=ROLES, help="overrides WORKER_ROLE")
    parser.add_argument("--instance-id", help="overrides WORKER_INSTANCE_ID")
    parser.add_argument("--listen-addr", help="overrides WORKER_LISTEN_ADDR")
    parser.add_argument("--model", help="overrides WORKER_MODEL (a checkpoint directory, or tiny)")
    parser.add_argument(
        "--dtype", help="overrides WORKER_DTYPE (float64, float32, bfloat16, float16)"
    )
    parser.add_argument("--gossip-addr", help="overrides GOSSIP_ADDR")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    for flag, variable in _FLAG_ENV.items():
        value = getattr(args, flag)
        if value:
            env[variable] = value
    configure_logging()
    config = Config.from_env(env, role=args.role)
    asyncio.run(serve(config, setup_tracing(f"kvrs-worker-{config.role}")))


if __name__ == "__main__":
    main()
