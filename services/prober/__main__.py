"""`python -m services.prober`: measures worker links over the KV data plane, reports to gossip."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.prober.config import Config
from services.prober.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    asyncio.run(serve(config, setup_tracing("kvrs-prober")))


if __name__ == "__main__":
    main()
