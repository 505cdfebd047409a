"""Entry point: `python -m services.gossip` (configuration in services/gossip/config.py)."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.gossip.config import Config
from services.gossip.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    asyncio.run(serve(config, setup_tracing("kvrs-gossip")))


if __name__ == "__main__":
    main()
