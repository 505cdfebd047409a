"""`python -m services.scheduler`: the recovery scheduler (SelectDecode, Recover, RecoverBatch)."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.scheduler.config import Config
from services.scheduler.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    provider = setup_tracing("kvrs-scheduler")
    asyncio.run(serve(config, provider))


if __name__ == "__main__":
    main()
