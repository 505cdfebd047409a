"""Entry point: `python -m services.slot_broker` (configuration in config.py beside it)."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.slot_broker.config import Config
from services.slot_broker.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    asyncio.run(serve(config, setup_tracing("kvrs-slot-broker")))


if __name__ == "__main__":
    main()
