"""`python -m services.openai_http`: OpenAI-compatible HTTP API over RouterService.Generate."""

import asyncio

from services.common import configure_logging, setup_tracing
from services.openai_http.config import Config
from services.openai_http.server import serve


def main() -> None:
    configure_logging()
    config = Config.from_env()
    asyncio.run(serve(config, setup_tracing("kvrs-openai-http")))


if __name__ == "__main__":
    main()
