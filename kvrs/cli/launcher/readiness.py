"""Readiness: a process is ready when its gRPC health service says SERVING (or its HTTP
health path answers 200); `wait_serving` waits for a whole stage."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvrs.cli.launcher.errors import ClusterError
from kvrs.cli.launcher.processes import is_running, log_tail
from kvrs.cli.launcher.services import tls_env
from kvrs.cli.launcher.state import ProcessRecord

SERVING = "SERVING"


def _http_health(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as reply:
            return SERVING if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:
        return f"unreachable ({exc})"


async def probe_health(record: ProcessRecord, settings) -> str:
    """SERVING when the process is ready, else what its health check answered."""
    from kvrs.rpc import check_health

    if record.health_path:
        return await asyncio.to_thread(
            _http_health, f"http://{record.health_addr or record.address}{record.health_path}"
        )
    return await check_health(record.address, settings, timeout_s=0.5)


async def wait_serving(
    records: Sequence[ProcessRecord], tls_dir: Path | None, timeout_s: float
) -> None:
    from kvrs.rpc import GrpcSettings, TlsConfig

    settings = GrpcSettings()
    if tls_dir is not None:
        settings = GrpcSettings(tls=TlsConfig.from_env(tls_env(tls_dir, "client")))
    pending = {record.name: record for record in records}
    last_status: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for record in list(pending.values()):
            if not is_running(record):
                raise ClusterError(
                    f"{record.name} exited during startup; last lines of {record.log_file}:\n"
                    f"{log_tail(record.log_file)}"
                )
        statuses = await asyncio.gather(
            *(probe_health(record, settings) for record in pending.values())
        )
        for name, status in zip(list(pending), statuses, strict=True):
            last_status[name] = status
            if status == SERVING:
                del pending[name]
        if not pending:
            return
        if time.monotonic() > deadline:
            record = next(iter(pending.values()))
            others = ", ".join(sorted(set(pending) - {record.name}))
            raise ClusterError(
                f"{record.name} at {record.address} is not SERVING after {timeout_s:.0f} s "
                f"(health: {last_status[record.name]})"
                + (f"; also waiting for {others}" if others else "")
                + f"; last lines of {record.log_file}:\n{log_tail(record.log_file)}"
            )
        await asyncio.sleep(0.2)
