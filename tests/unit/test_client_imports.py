"""Importing the typed client loads no server code and no heavy dependency."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("services", "torch", "redis", "aiohttp")


def test_importing_kvrs_client_loads_no_services_torch_redis_or_aiohttp():
    probe = (
        "import sys, kvrs.client, kvrs.rpc\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "", f"kvrs.client loaded: {result.stdout.strip()}"
