"""`python -m services.router`: the front door (Generate, with recovery of lost decodes)."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.router.config import Config
from services.router.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    asyncio.run(serve(config, setup_tracing("kvrs-router")))


if __name__ == "__main__":
    main()
