"""`python -m services.epp`: the endpoint picker (Envoy ext_proc) backed by the kvrs scheduler."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.epp.config import Config
from services.epp.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    asyncio.run(serve(config, setup_tracing("kvrs-epp")))


if __name__ == "__main__":
    main()
