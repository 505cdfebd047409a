"""`python -m services.cost_oracle`: transfer and compute time predictions over gRPC."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.cost_oracle.config import Config
from services.cost_oracle.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    asyncio.run(serve(config, setup_tracing("kvrs-cost-oracle")))


if __name__ == "__main__":
    main()
