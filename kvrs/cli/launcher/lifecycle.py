"""Orchestration: start every service stage by stage, stop them all.

`start_cluster` runs each row of the service table as `python -m <module>` in its own
session, with its environment, its log file under the run directory and a port of its
own (and one for its Prometheus metrics). It starts them stage by stage, a stage once the
one before it is ready, records pids and addresses in the state file, writes a Prometheus
scrape configuration naming every metrics endpoint, and on any failure stops what it
started before raising `ClusterError`, which names the service that did not come up and
quotes its log.
`stop_cluster` reads the state file back: SIGTERM to every process group, SIGKILL after
the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvrs.cli.launcher.errors import ClusterError
from kvrs.cli.launcher.ports import free_ports, layout_ports
from kvrs.cli.launcher.processes import is_running, spawn, stop_processes
from kvrs.cli.launcher.prometheus import SCRAPE_CONFIG_FILE, write_scrape_config
from kvrs.cli.launcher.readiness import wait_serving
from kvrs.cli.launcher.redis_server import start_private_redis
from kvrs.cli.launcher.services import (
    SERVICES,
    ClusterOptions,
    ServiceSpec,
    Wiring,
    command_line,
    common_env,
    generate_certs,
    has_main,
)
from kvrs.cli.launcher.state import STATE_FILE, ClusterState, ProcessRecord

log = logging.getLogger(__name__)


def _check_not_running(run_dir: Path) -> None:
    try:
        state = ClusterState.load(run_dir)
    except ClusterError:
        return
    alive = [record.name for record in state.processes if is_running(record)]
    if alive:
        raise ClusterError(
            f"a cluster is already running from {run_dir} ({', '.join(alive)}); "
            f"run `kvrs down --dir {run_dir}` first"
        )


def start_cluster(
    options: ClusterOptions, services: Sequence[ServiceSpec] = SERVICES
) -> ClusterState:
    """Starts every service stage by stage and returns the saved state (see module doc).

    On failure everything already started is stopped before ClusterError is raised.
    """
    run_dir = options.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_not_running(run_dir)
    missing = [spec.name for spec in services if spec.command is None and not has_main(spec.module)]
    if missing:
        raise ClusterError(f"services not installed in this checkout: {', '.join(missing)}")
    if not options.topology_file.is_file():
        raise ClusterError(f"topology file not found: {options.topology_file}")
    if options.profile_file is not None and not options.profile_file.is_file():
        raise ClusterError(f"profile file not found: {options.profile_file}")
    for stale in (run_dir / "logs").glob("*.log"):
        stale.unlink()

    private_redis = not options.redis_url
    # Every listener: each service's port, then the separate health ports.
    listeners = [
        *services,
        *(replace(spec, port=spec.health_port) for spec in services if spec.health_port),
    ]
    # Every kvrs process also serves Prometheus metrics, always on a free port.
    metered = [spec for spec in services if spec.command is None]
    spare = free_ports(len(listeners) + len(metered) + 1)
    if options.base_port:
        ports = layout_ports(options.base_port, listeners)
        spare = [port for port in spare if port not in ports]
    else:
        ports, spare = spare[: len(listeners)], spare[len(listeners) :]

    def on_host(name: str, port: int) -> str:
        return f"{options.host_of(name).address}:{port}"

    metrics_addresses = {
        spec.name: on_host(spec.name, port) for spec, port in zip(metered, spare, strict=False)
    }
    addresses = {
        spec.name: on_host(spec.name, port) for spec, port in zip(services, ports, strict=False)
    }
    health_addresses = {
        spec.name: on_host(spec.name, port)
        for spec, port in zip(listeners[len(services) :], ports[len(services) :], strict=True)
    }
    wiring = Wiring(
        addresses=addresses, options=options, health_addresses=health_addresses, run_dir=run_dir
    )

    tls_dir = generate_certs(run_dir) if options.tls else None
    started: list[ProcessRecord] = []
    state = ClusterState(
        run_dir=str(run_dir),
        created_unix_ms=int(time.time() * 1000),
        redis_url=options.redis_url,
        redis_prefix=options.redis_prefix,
        tls_dir=str(tls_dir) if tls_dir else "",
        processes=started,
    )
    try:
        if private_redis:
            redis_port = spare[-1]
            started.append(start_private_redis(run_dir, redis_port))
            state.redis_url = f"redis://127.0.0.1:{redis_port}/0"
            state.redis_prefix = options.redis_prefix or "{kvrs}:"
        elif not state.redis_prefix:
            state.redis_prefix = f"{{kvrs-{uuid.uuid4().hex[:8]}}}:"
        shared = common_env(wiring, tls_dir, state.redis_url, state.redis_prefix)
        for stage in sorted({spec.stage for spec in services}):
            batch = []
            for spec in (s for s in services if s.stage == stage):
                env = {
                    **shared,
                    **({spec.listen_env: addresses[spec.name]} if spec.listen_env else {}),
                    "OTEL_SERVICE_NAME": f"kvrs-{spec.name}",
                    **(
                        {"KVRS_METRICS_ADDR": metrics_addresses[spec.name]}
                        if spec.name in metrics_addresses
                        else {}
                    ),
                    **spec.env(wiring),
                }
                record = spawn(
                    spec.name,
                    spec.kind,
                    command_line(spec, wiring),
                    spec.module,
                    addresses[spec.name],
                    env,
                    run_dir,
                    spec.health_path,
                )
                record.health_addr = health_addresses.get(spec.name, "")
                record.metrics_addr = metrics_addresses.get(spec.name, "")
                batch.append(record)
            started.extend(batch)
            state.save()
            stage_started_s = time.monotonic()
            asyncio.run(wait_serving(batch, tls_dir, options.startup_timeout_s))
            log.info(
                "stage %d (%s) serving after %.1f s",
                stage,
                ", ".join(record.name for record in batch),
                time.monotonic() - stage_started_s,
            )
    except BaseException:
        stop_processes(list(reversed(started)), grace_s=3.0)
        (run_dir / STATE_FILE).unlink(missing_ok=True)
        raise
    state.save()
    write_scrape_config(state, run_dir / SCRAPE_CONFIG_FILE)
    return state


def stop_cluster(run_dir: Path, grace_s: float = 10.0) -> tuple[ClusterState, list[str]]:
    """Stops every process of the cluster in `run_dir` (services first, Redis last).

    Returns the state and the names of processes that had to be killed; the state file
    and the private Redis' data are removed.
    """
    state = ClusterState.load(run_dir)
    services = [record for record in state.processes if record.name != "redis"]
    redis_records = [record for record in state.processes if record.name == "redis"]
    killed = stop_processes(list(reversed(services)), grace_s)
    killed += stop_processes(redis_records, grace_s=2.0)
    (Path(run_dir) / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(Path(run_dir) / "redis", ignore_errors=True)
    return state, [record.name for record in killed]
